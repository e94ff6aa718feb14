"""Initial and final state: against the float64 reference, and a sequence processed in pieces
(each from the previous piece's final state) against the same sequence processed whole, outputs
and gradients (into q, k, v and the initial state) alike."""
import pytest
import torch

import fast_causal_attn
from conftest import CUDA, DEVICES, STATE_KERNELS, cases
from reference import (STATE_TOLERANCE, check_state_matches_reference, make_inputs, make_state, reference_with_state,
                       relative_error, time_dim)

# Outputs and states start as NaN: anything the kernels leave unwritten fails.
pytestmark = pytest.mark.usefixtures("nan_filled_outputs")

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def time_slice(x, layout, start, stop):
    return x.narrow(time_dim(layout), start, stop - start)


# Every dtype, normalize setting and layout, on each device and CUDA family that takes states.
state_cases = cases(
    pytest.mark.parametrize("device,kernel", STATE_KERNELS),
    pytest.mark.parametrize("dtype", DTYPES, ids=str),
    pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"]),
    pytest.mark.parametrize("layout", ["bhld", "blhd"]),
)


@state_cases
def test_state_matches_reference(layout, normalize, dtype, device, kernel, use_kernel):
    use_kernel(kernel)
    check_state_matches_reference(2, 3, 100, 17, 24, layout=layout, normalize=normalize, dtype=dtype, device=device,
                                  scale=0.7)


@state_cases
def test_pieces_equal_whole(layout, normalize, dtype, device, kernel, use_kernel):
    use_kernel(kernel)
    check_pieces_equal_whole(2, 2, 150, 8, 12, layout=layout, normalize=normalize, dtype=dtype, device=device)


@pytest.mark.parametrize("device,kernel", STATE_KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("E,M", [(100, 70), (130, 64), (256, 200)], ids=lambda d: str(d))
def test_pieces_equal_whole_wide_heads(E, M, dtype, device, kernel, use_kernel):
    """Head dims in every bucket up to 256 (the kernels' state tiles: 128 and 256 rows, partial
    column blocks), from a state and in pieces."""
    use_kernel(kernel)
    check_state_matches_reference(1, 2, 140, E, M, layout="bhld", normalize=True, dtype=dtype, device=device, scale=0.7)
    check_pieces_equal_whole(1, 2, 140, E, M, layout="bhld", normalize=True, dtype=dtype, device=device)


def check_pieces_equal_whole(B, H, L, E, M, *, layout, normalize, dtype, device):
    q, k, v = make_inputs(B, H, L, E, M, dtype=dtype, device=device, layout=layout, normalize=normalize)
    state0 = [x.to(device) for x in make_state(B, H, E, M, dtype, normalize)]
    splits = sorted(torch.randperm(L - 1)[:3].add(1).tolist())
    w_out = torch.randn(v.shape, dtype=torch.float64).to(device)
    w_kv = torch.randn(B, H, E, M, dtype=torch.float64).to(device)
    w_k_sum = torch.randn(B, H, E, dtype=torch.float64).to(device)
    kw = dict(scale=0.9, normalize=normalize, layout=layout)

    def run(pieces):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, *state0)]
        q_, k_, v_, kv0, k_sum0 = leaves
        state, outs = fast_causal_attn.State(kv0, k_sum0), []
        for start, stop in zip(pieces[:-1], pieces[1:]):
            out, state = fast_causal_attn.causal_linear_attention(
                *(time_slice(x, layout, start, stop) for x in (q_, k_, v_)), initial_state=state,
                return_final_state=True, **kw)
            outs.append(out)
        out = torch.cat(outs, dim=time_dim(layout))
        loss = (out.double() * w_out).sum() + (state.kv.double() * w_kv).sum() + (state.k_sum.double() * w_k_sum).sum()
        loss.backward()
        return [out, state.kv, state.k_sum] + [x.grad for x in leaves]

    whole, pieces = run([0, L]), run([0, *splits, L])
    names = ["out", "final kv", "final k_sum", "grad q", "grad k", "grad v", "grad kv0", "grad k_sum0"]
    # Outputs in 16-bit round once either way; everything else is accumulated in float32 or better,
    # except that under normalize the gradients read the 16-bit output back (dO . O), and an output
    # element may round the other way when made in pieces (kernels that round products to 16 bits
    # meet the state at other points; 1.5e-4 seen in bfloat16): 1e-3 there.
    sixteen_bit = dtype in (torch.float16, torch.bfloat16)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-3 if (sixteen_bit and normalize) else 1e-5
    for name, a, b in zip(names, whole, pieces):
        tol = STATE_TOLERANCE[dtype] if (sixteen_bit and a.dtype == dtype) else tolerance
        assert relative_error(b, a) <= tol, f"{name}: pieces {splits} differ from the whole sequence"


def gradcheck_with_state(L, layout, normalize, device):
    """gradcheck in float64 through q, k, v and the initial state into out and the final state."""
    B, H, E, M = 1, 2, 3, 4
    q, k, v = make_inputs(B, H, L, E, M, dtype=torch.float64, device=device, layout=layout, normalize=normalize)
    if normalize:
        q, k = q + 0.1, k + 0.1
    kv0, k_sum0 = (x.to(device) for x in make_state(B, H, E, M, torch.float64, normalize))
    inputs = tuple(x.requires_grad_() for x in (q, k, v, kv0, k_sum0))

    def f(q, k, v, kv0, k_sum0):
        out, state = fast_causal_attn.causal_linear_attention(
            q, k, v, scale=0.8, normalize=normalize, layout=layout, initial_state=(kv0, k_sum0),
            return_final_state=True)
        return out, state.kv, state.k_sum

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
def test_gradcheck_with_state(layout, normalize, device):
    gradcheck_with_state(40, layout, normalize, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
def test_empty_sequence_passes_state_through(normalize, device):
    q, k, v = make_inputs(2, 3, 0, 4, 5, dtype=torch.float32, device=device)
    kv0, k_sum0 = (x.to(device).requires_grad_() for x in make_state(2, 3, 4, 5, torch.float32, normalize))
    out, state = fast_causal_attn.causal_linear_attention(q, k, v, normalize=normalize, initial_state=(kv0, k_sum0),
                                                          return_final_state=True)
    assert out.shape == (2, 3, 0, 5)
    torch.testing.assert_close(state.kv, kv0, rtol=0, atol=0)
    torch.testing.assert_close(state.k_sum, k_sum0, rtol=0, atol=0)
    (state.kv.sum() + 2 * state.k_sum.sum()).backward()
    torch.testing.assert_close(kv0.grad, torch.ones_like(kv0), rtol=0, atol=0)
    torch.testing.assert_close(k_sum0.grad, torch.full_like(k_sum0, 2.0), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_final_state_without_initial_state(device):
    q, k, v = make_inputs(2, 2, 70, 5, 6, dtype=torch.float64, device=device)
    _, state = fast_causal_attn.causal_linear_attention(q, k, v, return_final_state=True)
    _, ref_kv, ref_k_sum = reference_with_state(q, k, v)
    assert relative_error(state.kv, ref_kv) <= 1e-12 and relative_error(state.k_sum, ref_k_sum) <= 1e-12


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("L", [1, 37])
def test_calls_without_gradients_match_calls_with(L, device):
    """Calls no gradient can flow through skip the autograd Function: the same kernels, the same bits."""
    q, k, v = make_inputs(2, 3, L, 8, 5, dtype=torch.float32, device=device, normalize=True)
    state = fast_causal_attn.State(*(x.to(device) for x in make_state(2, 3, 8, 5, torch.float32, True)))
    kwargs = dict(scale=0.5, normalize=True, initial_state=state, return_final_state=True)
    with torch.no_grad():
        plain = fast_causal_attn.causal_linear_attention(q, k, v, **kwargs)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    tracked = fast_causal_attn.causal_linear_attention(*leaves, **kwargs)
    assert plain[0].grad_fn is None and tracked[0].grad_fn is not None
    for a, b in zip((plain[0], *plain[1]), (tracked[0], *tracked[1])):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def good_state_case():
    q, k, v = make_inputs(2, 3, 10, 4, 5, dtype=torch.float32, device="cpu")
    return (q, k, v), make_state(2, 3, 4, 5, torch.float32, True)


@pytest.mark.parametrize(
    "bad, pattern",
    [
        (lambda s: (s.kv[:, :, :3], s.k_sum), r"initial_state.kv must have shape \[2, 3, 4, 5\] \(\[B, H, E, M\]\), got \[2, 3, 3, 5\]"),
        (lambda s: (s.kv, s.k_sum[..., :2]), r"initial_state.k_sum must have shape \[2, 3, 4\] \(\[B, H, E\]\), got \[2, 3, 2\]"),
        (lambda s: (s.kv.half(), s.k_sum), r"initial_state.kv must be Float \(the state dtype for Float inputs\), got Half"),
        (lambda s: (s.kv, s.k_sum.double()), r"initial_state.k_sum must be Float .*got Double"),
        (lambda s: (s.kv, None), r"initial_state needs both kv and k_sum, got only kv"),
        (lambda s: (s.kv.to("meta"), s.k_sum), r"initial_kv must be on the same device as q \(cpu\), got meta"),
    ],
    ids=["kv_shape", "k_sum_shape", "kv_dtype", "k_sum_dtype", "missing_k_sum", "kv_device"],
)
def test_bad_initial_state(bad, pattern):
    (q, k, v), state = good_state_case()
    with pytest.raises(RuntimeError, match=pattern):
        fast_causal_attn.causal_linear_attention(q, k, v, normalize=True, initial_state=bad(state))


@CUDA
@pytest.mark.parametrize("kernel", [None, "tensorcore"], ids=["default", "tensorcore"])
@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
def test_state_on_cuda_long_sequences_with_segments(normalize, kernel, use_kernel):
    """Few (batch, head) pairs and a long sequence: the chunked kernels split time into segments,
    and the given state enters every segment's start while the last one writes the final state."""
    use_kernel(kernel)
    B, H, L, E, M = 1, 2, 3000, 64, 64
    q, k, v = make_inputs(B, H, L, E, M, dtype=torch.float32, device="cuda", normalize=normalize)
    state0 = fast_causal_attn.State(*(x.cuda() for x in make_state(B, H, E, M, torch.float32, normalize)))
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, *state0)]
    out, state1 = fast_causal_attn.causal_linear_attention(*leaves[:3], normalize=normalize,
                                                           initial_state=leaves[3:], return_final_state=True)
    ref_out, ref_kv, ref_k_sum = reference_with_state(q, k, v, state0, normalize=normalize)
    assert relative_error(out, ref_out) <= 1e-5
    assert relative_error(state1.kv, ref_kv) <= 1e-5 and relative_error(state1.k_sum, ref_k_sum) <= 1e-5
    (out.sum() + state1.kv.sum() + state1.k_sum.sum()).backward()
    cpu = [x.detach().cpu().double().requires_grad_() for x in leaves]
    out_c, state_c = fast_causal_attn.causal_linear_attention(*cpu[:3], normalize=normalize,
                                                              initial_state=cpu[3:], return_final_state=True)
    (out_c.sum() + state_c.kv.sum() + state_c.k_sum.sum()).backward()
    for name, a, b in zip(["q", "k", "v", "kv0", "k_sum0"], leaves, cpu):
        assert relative_error(a.grad, b.grad) <= 1e-5, f"grad {name}"


def test_state_under_torch_compile():
    torch._dynamo.reset()
    q, k, v = make_inputs(1, 2, 40, 4, 6, dtype=torch.float32, device="cpu", normalize=True)
    kv0, k_sum0 = make_state(1, 2, 4, 6, torch.float32, True)

    def step(q, k, v, kv0, k_sum0):
        out, state = fast_causal_attn.causal_linear_attention(q, k, v, normalize=True, initial_state=(kv0, k_sum0),
                                                              return_final_state=True)
        return out.square().sum() + state.kv.sum() + state.k_sum.sum()

    leaves = [x.clone().requires_grad_() for x in (q, k, v, kv0, k_sum0)]
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(*leaves), leaves)
    want = torch.autograd.grad(step(*leaves), leaves)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


# The decoding step (L = 1 from a state): the CPU's dedicated path, the default CUDA path (the
# decoding-step kernel), and the chunked kernels' general path forced.
DECODE_PATHS = [
    pytest.param("cpu", None, id="cpu"),
    pytest.param("cuda", None, id="cuda", marks=CUDA),
    pytest.param("cuda", "chunked", id="cuda-chunked", marks=CUDA),
]


@pytest.mark.parametrize("device,kernel", DECODE_PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize("with_initial", [True, False], ids=["from-state", "from-zero"])
def test_decode_step_matches_reference(with_initial, layout, normalize, dtype, device, kernel, use_kernel):
    use_kernel(kernel)
    B, H, E, M = 3, 2, 40, 70  # more columns than a warp, more rows than the warps
    q, k, v = make_inputs(B, H, 1, E, M, dtype=dtype, device=device, layout=layout, normalize=normalize)
    state0 = make_state(B, H, E, M, dtype, normalize) if with_initial else None
    if state0 is not None:
        state0 = fast_causal_attn.State(*(x.to(device) for x in state0))
    out, state1 = fast_causal_attn.causal_linear_attention(
        q, k, v, scale=0.7, normalize=normalize, layout=layout, initial_state=state0, return_final_state=True)
    ref_out, ref_kv, ref_k_sum = reference_with_state(q, k, v, state0, scale=0.7, normalize=normalize, layout=layout)
    assert relative_error(out, ref_out) <= STATE_TOLERANCE[dtype]
    state_tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    assert relative_error(state1.kv, ref_kv) <= state_tolerance
    assert relative_error(state1.k_sum, ref_k_sum) <= state_tolerance


@pytest.mark.parametrize("device,kernel", DECODE_PATHS)
@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
def test_gradcheck_decode_step(normalize, device, kernel, use_kernel):
    """The backward of a decoding step, from the denominator its forward saved."""
    use_kernel(kernel)
    gradcheck_with_state(1, "bhld", normalize, device)
