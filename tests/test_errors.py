"""Every bad input gets an error that names the tensor or argument, what was expected and what
came, and no input is modified."""
import math
import subprocess
import sys

import pytest
import torch

import fast_causal_attn
from reference import make_inputs


def good_inputs(dtype=torch.float32):
    return make_inputs(2, 3, 10, 4, 5, dtype=dtype, device="cpu")


def expect_error(pattern, q, k, v, **kwargs):
    before = [x.clone() for x in (q, k, v)]
    with pytest.raises(RuntimeError, match=pattern):
        fast_causal_attn.causal_linear_attention(q, k, v, **kwargs)
    for x, b in zip((q, k, v), before):
        assert x.is_meta or torch.equal(x, b), "an input was modified by a refused call"


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_rank(name):
    inputs = dict(zip("qkv", good_inputs()))
    inputs[name] = inputs[name][0]
    expect_error(rf"{name} must be a 4-D tensor .*got a 3-D tensor of shape \[3, 10, ", **inputs)


@pytest.mark.parametrize("layout", ["bhld", "blhd"])
def test_rank_message_names_the_layout(layout):
    q, k, v = good_inputs()
    dims = r"\[B, H, L, E\]" if layout == "bhld" else r"\[B, L, H, E\]"
    expect_error(rf"q must be a 4-D tensor {dims}", q[0], k, v, layout=layout)


def test_head_dims_differ():
    q, k, v = good_inputs()
    expect_error(r"q and k must have the same head dimension E, got 4 for q and 3 for k", q, k[..., :3], v)


@pytest.mark.parametrize("name", ["k", "v"])
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_batch_heads_length_differ(name, dim):
    inputs = dict(zip("qkv", good_inputs()))
    inputs[name] = inputs[name].narrow(dim, 0, inputs[name].shape[dim] - 1)
    expect_error(rf"{name} must have the same \(B, H, L\) as q", **inputs)


def test_batch_heads_length_message_in_blhd():
    q, k, v = make_inputs(2, 3, 10, 4, 5, dtype=torch.float32, device="cpu", layout="blhd")
    expect_error(r"v must have the same \(B, L, H\) as q, got \[2, 9, 3\] for v and \[2, 10, 3\] for q",
                 q, k, v[:, :9], layout="blhd")


@pytest.mark.parametrize("name", ["k", "v"])
def test_dtypes_differ(name):
    inputs = dict(zip("qkv", good_inputs()))
    inputs[name] = inputs[name].double()
    expect_error(rf"{name} must have the same dtype as q \(Float\), got Double", **inputs)


@pytest.mark.parametrize(
    "dtype", [torch.int32, torch.int64, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2], ids=str
)
def test_unsupported_dtype(dtype):
    q, k, v = (x.to(dtype) for x in good_inputs())
    expect_error(r"q, k and v must be float32, float64, float16 or bfloat16, got ", q, k, v)


def test_devices_differ():
    q, k, v = good_inputs()
    expect_error(r"v must be on the same device as q \(cpu\), got meta", q, k, v.to("meta"))


# Bad inputs on CUDA, checked in a child process: on the H200 the messages that format a number
# once crashed the process (SIGSEGV: a static libstdc++ in _C.so beside torch's shared one, see
# setup.py's shared_cxx_runtime); a crash here must fail this test, not end the suite.
CUDA_ERROR_SCRIPT = """
import torch, fast_causal_attn
cases = [
    (dict(eps=-1.0, normalize=True), 4, 4, "eps must be finite and > 0, got -1"),
    (dict(scale=float("nan")), 4, 4, "scale must be finite, got nan"),
    (dict(return_final_state=True), 257, 4, "states and cu_seqlens on CUDA support head dims up to 256, got E = 257, M = 4"),
    (dict(layout="bshd"), 4, 4, "layout must be 'bhld'"),
    (dict(cu_seqlens=torch.tensor([0, 7], device="cuda")), 4, 4,
     "the last entry of cu_seqlens must be the number of packed timesteps 8, got 7"),
]
for kwargs, E, M, message in cases:
    q, k = torch.rand(1, 1, 8, E, device="cuda"), torch.rand(1, 1, 8, E, device="cuda")
    v = torch.rand(1, 1, 8, M, device="cuda")
    try:
        fast_causal_attn.causal_linear_attention(q, k, v, **kwargs)
    except RuntimeError as e:
        assert message in str(e), f"{kwargs}: {e}"
    else:
        raise SystemExit(f"{kwargs}: no error")
print("all raised")
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
def test_bad_inputs_on_cuda_raise_cleanly():
    result = subprocess.run([sys.executable, "-c", CUDA_ERROR_SCRIPT], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "all raised" in result.stdout, (
        f"exit code {result.returncode}\n{result.stdout[-1000:]}\n{result.stderr[-3000:]}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
def test_devices_differ_cuda():
    q, k, v = good_inputs()
    with pytest.raises(RuntimeError, match=r"must be on the same device as q"):
        fast_causal_attn.causal_linear_attention(q.cuda(), k.cuda(), v)


def test_unknown_layout():
    expect_error(r"layout must be 'bhld' \(\[B, H, L, D\]\) or 'blhd' \(\[B, L, H, D\]\), got 'bshd'",
                 *good_inputs(), layout="bshd")


@pytest.mark.parametrize("scale", [math.inf, -math.inf, math.nan])
def test_non_finite_scale(scale):
    expect_error(r"scale must be finite, got", *good_inputs(), scale=scale)


@pytest.mark.parametrize("eps", [0.0, -1e-6, math.inf, math.nan])
def test_bad_eps(eps):
    expect_error(r"eps must be finite and > 0, got", *good_inputs(), eps=eps, normalize=True)


def test_zero_head_dim():
    q, k, v = good_inputs()
    expect_error(r"head dimension E of q and k must be at least 1, got 0", q[..., :0], k[..., :0], v)
    expect_error(r"head dimension M of v must be at least 1, got 0", q, k, v[..., :0])


def test_backward_op_checks_grad_out():
    q, k, v = good_inputs()
    with pytest.raises(RuntimeError, match=r"grad_out must have the shape of the output \[2, 3, 10, 5\], got"):
        torch.ops.fast_causal_attn.backward(torch.zeros(2, 3, 10, 4), None, None, q, k, v, None, None, None, None, None, 1.0,
                                            False, "bhld")
    with pytest.raises(RuntimeError, match=r"normalize=True needs the forward's out and den"):
        torch.ops.fast_causal_attn.backward(torch.zeros(2, 3, 10, 5), None, None, q, k, v, None, None, None, None, None, 1.0,
                                            True, "bhld")


def test_backward_op_checks_forward_segments():
    """The forward's segment starts (its last two results) come back to the backward as they went:
    shape, dtype, contiguity and matching segment counts are checked."""
    q, k, v = good_inputs()  # B * H = 6, E = 4, M = 5
    grad_out = torch.zeros_like(v)

    def backward(segment_kv, segment_k_sum=None):
        torch.ops.fast_causal_attn.backward(grad_out, None, None, q, k, v, None, None, None, None, None, 1.0, False,
                                            "bhld", segment_kv, segment_k_sum)

    backward(torch.zeros(6, 0, 4, 5), torch.zeros(6, 0, 4))  # none kept: accepted
    with pytest.raises(RuntimeError, match=r"segment_kv must have shape \[N \* H, S, E, M\] with N \* H = 6 "
                                           r"\(the forward's result\), got \[6, 2, 5, 4\]"):
        backward(torch.zeros(6, 2, 5, 4))
    with pytest.raises(RuntimeError, match=r"segment_kv must have shape .*got \[6, 4, 5\]"):
        backward(torch.zeros(6, 4, 5))
    with pytest.raises(RuntimeError, match=r"segment_kv must be Float on cpu, got Double on cpu"):
        backward(torch.zeros(6, 2, 4, 5, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"segment_kv must be contiguous"):
        backward(torch.zeros(6, 4, 5, 2).permute(0, 3, 1, 2))
    with pytest.raises(RuntimeError, match=r"segment_k_sum must have shape \[N \* H, S, E\] .*got \[6, 2, 5\]"):
        backward(torch.zeros(6, 2, 4, 5), torch.zeros(6, 2, 5))
    with pytest.raises(RuntimeError, match=r"segment_k_sum must have as many segments as segment_kv \(2\) or none, "
                                           r"got 3"):
        backward(torch.zeros(6, 2, 4, 5), torch.zeros(6, 3, 4))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
def test_forward_segments_that_do_not_fit_the_length():
    """A segment count no forward of this length makes (7 segments of 10 timesteps) is refused by
    the dq pass, which would otherwise read segments past the sequence."""
    q, k, v = (x.cuda() for x in good_inputs())
    with pytest.raises(RuntimeError, match=r"segment_kv holds 7 segments, which no forward of 10 timesteps makes"):
        torch.ops.fast_causal_attn.backward(torch.zeros_like(v), None, None, q, k, v, None, None, None, None, None, 1.0,
                                            False, "bhld", torch.zeros(6, 7, 4, 5, device="cuda"), None)
