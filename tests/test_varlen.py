"""Variable-length batches: packed sequences with cu_seqlens give what each sequence gives alone,
outputs, final states and gradients alike; bad cu_seqlens get clear errors."""
import pytest
import torch

import fast_causal_attn
from conftest import DEVICES, STATE_KERNELS
from reference import STATE_TOLERANCE, make_inputs, make_state, relative_error, time_dim

# Outputs and states start as NaN: anything the kernels leave unwritten fails.
pytestmark = pytest.mark.usefixtures("nan_filled_outputs")

LENGTHS = [5, 0, 64, 1, 33]  # an empty sequence and one of a single step on purpose


def packed_case(layout, normalize, dtype, lengths=LENGTHS, H=2, E=6, M=7, device="cpu"):
    total = sum(lengths)
    q, k, v = make_inputs(1, H, total, E, M, dtype=dtype, device=device, layout=layout, normalize=normalize)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, cu


@pytest.mark.parametrize("device,kernel", STATE_KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
def test_packed_equals_each_sequence_alone(layout, normalize, dtype, device, kernel, use_kernel):
    use_kernel(kernel)
    check_packed_equals_each_sequence_alone(layout, normalize, dtype, device, E=6, M=7)


@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
def test_packed_equals_each_sequence_alone_cpu_bfloat16_products(normalize):
    """The same at a state that takes the CPU's bfloat16 products where it has the matrix units
    (64 x 64 elements or more; test_cpu_bfloat16_products), with its empty, one-step and partial
    chunks."""
    check_packed_equals_each_sequence_alone("bhld", normalize, torch.bfloat16, "cpu", E=64, M=72)


def check_packed_equals_each_sequence_alone(layout, normalize, dtype, device, E, M):
    H = 2
    q, k, v, cu = packed_case(layout, normalize, dtype, H=H, E=E, M=M, device=device)
    N = len(LENGTHS)
    state0 = [x.to(device) for x in make_state(N, H, E, M, dtype, normalize)]
    kw = dict(scale=0.8, normalize=normalize, layout=layout)

    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, *state0)]
    out, state1 = fast_causal_attn.causal_linear_attention(
        *leaves[:3], initial_state=leaves[3:], return_final_state=True, cu_seqlens=cu, **kw)
    w = torch.randn(out.shape, dtype=torch.float64).to(device)
    wkv = torch.randn(state1.kv.shape, dtype=torch.float64).to(device)
    wks = torch.randn(state1.k_sum.shape, dtype=torch.float64).to(device)
    ((out.double() * w).sum() + (state1.kv.double() * wkv).sum() + (state1.k_sum.double() * wks).sum()).backward()

    t = time_dim(layout)
    for i in range(N):
        start, stop = int(cu[i]), int(cu[i + 1])
        alone = [x.detach().narrow(t, start, stop - start).clone().requires_grad_() for x in (q, k, v)]
        init = [x[i : i + 1].detach().clone().requires_grad_() for x in state0]
        o, s = fast_causal_attn.causal_linear_attention(*alone, initial_state=init, return_final_state=True, **kw)
        ((o.double() * w.narrow(t, start, stop - start)).sum() + (s.kv.double() * wkv[i : i + 1]).sum()
         + (s.k_sum.double() * wks[i : i + 1]).sum()).backward()
        pairs = [(out.narrow(t, start, stop - start), o), (state1.kv[i : i + 1], s.kv), (state1.k_sum[i : i + 1], s.k_sum)]
        pairs += [(x.grad.narrow(t, start, stop - start), a.grad) for x, a in zip(leaves[:3], alone)]
        pairs += [(x.grad[i : i + 1], a.grad) for x, a in zip(leaves[3:], init)]
        for j, (packed, single) in enumerate(pairs):
            # Packed, a sequence runs in one piece; alone, it may split into time segments. Kernels
            # that round products to 16 bits then meet the state at other points: 16-bit results
            # agree to 16-bit rounding, and the float32 results made from them to one rounding of
            # their 16-bit inputs (bfloat16 2^-8: 1.2e-3 seen on the H200; float16 2^-10).
            if packed.dtype in (torch.float16, torch.bfloat16):
                tolerance = STATE_TOLERANCE[packed.dtype]
            elif dtype in (torch.float16, torch.bfloat16):
                tolerance = 4e-3 if dtype == torch.bfloat16 else 1e-3
            else:
                tolerance = 1e-13 if dtype == torch.float64 else 1e-6
            assert relative_error(packed, single) <= tolerance, (i, j)


@pytest.mark.parametrize("device", DEVICES)
def test_int64_offsets_and_no_state(device):
    q, k, v, cu = packed_case("blhd", True, torch.float64, device=device)
    out32 = fast_causal_attn.causal_linear_attention(q, k, v, normalize=True, layout="blhd", cu_seqlens=cu)
    out64 = fast_causal_attn.causal_linear_attention(q, k, v, normalize=True, layout="blhd", cu_seqlens=cu.long())
    torch.testing.assert_close(out32, out64, rtol=0, atol=0)
    # Without cu_seqlens the packed sequences would attend to each other: the boundary matters.
    mixed = fast_causal_attn.causal_linear_attention(q, k, v, normalize=True, layout="blhd")
    assert not torch.allclose(mixed, out32)


@pytest.mark.parametrize(
    "make_cu, pattern",
    [
        (lambda cu: cu.float(), r"cu_seqlens must be int32 or int64, got Float"),
        (lambda cu: cu.view(1, -1), r"cu_seqlens must be a 1-D tensor \[N \+ 1\], got shape \[1, 6\]"),
        (lambda cu: cu + 1, r"cu_seqlens must start at 0, got 1"),
        (lambda cu: torch.tensor([0, 5, 3, 103], dtype=torch.int32), r"cu_seqlens must be non-decreasing, got 5 then 3 at index 2"),
        (lambda cu: torch.tensor([0, 5, 100], dtype=torch.int32), r"the last entry of cu_seqlens must be the number of packed timesteps 103, got 100"),
        (lambda cu: cu.to("meta"), r"cu_seqlens must be on the same device as q \(cpu\), got meta"),
    ],
    ids=["dtype", "rank", "start", "decreasing", "last", "device"],
)
def test_bad_cu_seqlens(make_cu, pattern):
    q, k, v, cu = packed_case("bhld", False, torch.float32)
    with pytest.raises(RuntimeError, match=pattern):
        fast_causal_attn.causal_linear_attention(q, k, v, cu_seqlens=make_cu(cu))


def test_cu_seqlens_needs_batch_one():
    q, k, v = make_inputs(2, 2, 10, 4, 4, dtype=torch.float32, device="cpu")
    with pytest.raises(RuntimeError, match=r"packed along the time dimension with batch size 1, got batch size 2"):
        fast_causal_attn.causal_linear_attention(q, k, v, cu_seqlens=torch.tensor([0, 4, 10]))


def test_states_must_have_one_row_per_sequence():
    q, k, v, cu = packed_case("bhld", True, torch.float32)
    state = make_state(len(LENGTHS) - 1, 2, 6, 7, torch.float32, True)
    with pytest.raises(RuntimeError, match=r"initial_state.kv must have shape \[5, 2, 6, 7\] \(\[N, H, E, M\]\), got \[4, 2, 6, 7\]"):
        fast_causal_attn.causal_linear_attention(q, k, v, normalize=True, initial_state=state, cu_seqlens=cu)


@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
def test_packed_gradcheck_cpu_joint_walk(normalize):
    """Packed sequences (an empty one and a single step among them) through the CPU backward's
    dk-with-dv walk, which takes states above the size stepped one timestep at a time (E x M >
    128): gradcheck, states in and out."""
    lengths = [3, 0, 35, 1]
    q, k, v, cu = packed_case("bhld", normalize, torch.float64, lengths=lengths, E=12, M=11)
    if normalize:
        q, k = q + 0.1, k + 0.1
    kv0, k_sum0 = make_state(len(lengths), 2, 12, 11, torch.float64, normalize)
    inputs = tuple(x.requires_grad_() for x in (q, k, v, kv0, k_sum0))

    def f(q, k, v, kv0, k_sum0):
        out, state = fast_causal_attn.causal_linear_attention(
            q, k, v, scale=0.8, normalize=normalize, initial_state=fast_causal_attn.State(kv0, k_sum0),
            return_final_state=True, cu_seqlens=cu)
        return out, state.kv, state.k_sum

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)
