"""torch.autograd.gradcheck in float64: the backward is the derivative of the forward."""
import pytest
import torch
import torch.autograd.forward_ad as fwAD

import fast_causal_attn
from conftest import DEVICES
from reference import make_inputs, make_state, reference_with_state, relative_error


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize("shape", [(2, 3, 9, 4, 5), (1, 2, 70, 3, 2)], ids=["short", "two_chunks"])
def test_gradcheck(shape, layout, normalize, device):
    q, k, v = make_inputs(*shape, dtype=torch.float64, device=device, layout=layout, normalize=normalize)
    if normalize:  # keep the normalizer well away from zero so finite differences stay meaningful
        q, k = q + 0.1, k + 0.1
    inputs = tuple(x.requires_grad_() for x in (q, k, v))

    def f(q, k, v):
        return fast_causal_attn.causal_linear_attention(q, k, v, scale=0.8, normalize=normalize, layout=layout)

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("threads", [1, 5], ids=["dk_with_dv", "passes_apart"])
@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
def test_gradcheck_cpu_backward_walks(normalize, threads):
    """The CPU backward takes dk and dv in one walk where its two items a sequence (dq, dk with
    dv) give every thread one (here two sequences, one thread), the three passes apart where not
    (five threads): both, with states in and out, at a state above the size stepped one timestep
    at a time (E x M > 128)."""
    q, k, v = make_inputs(1, 2, 45, 12, 13, dtype=torch.float64, device="cpu", normalize=normalize)
    if normalize:
        q, k = q + 0.1, k + 0.1
    kv0, k_sum0 = make_state(1, 2, 12, 13, torch.float64, normalize)
    inputs = tuple(x.requires_grad_() for x in (q, k, v, kv0, k_sum0))

    def f(q, k, v, kv0, k_sum0):
        out, state = fast_causal_attn.causal_linear_attention(
            q, k, v, scale=0.8, normalize=normalize, initial_state=fast_causal_attn.State(kv0, k_sum0),
            return_final_state=True)
        return out, state.kv, state.k_sum

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck_causal_dot_product(device):
    q, k, v = make_inputs(2, 2, 67, 5, 3, dtype=torch.float64, device=device)
    inputs = tuple(x.requires_grad_() for x in (q, k, v))
    assert torch.autograd.gradcheck(fast_causal_attn.causal_dot_product, inputs)


def _outputs_with_state(device, normalize):
    """q, k, v (requiring grad) and an initial state, with the call's out and final state."""
    q, k, v = make_inputs(2, 3, 70, 5, 4, dtype=torch.float64, device=device, normalize=normalize)
    kv0, k_sum0 = (x.to(device) for x in make_state(2, 3, 5, 4, torch.float64, normalize))
    leaves = tuple(x.requires_grad_() for x in (q, k, v, kv0, k_sum0))
    out, state = fast_causal_attn.causal_linear_attention(
        *leaves[:3], normalize=normalize, initial_state=fast_causal_attn.State(*leaves[3:]), return_final_state=True)
    return leaves, (out, state.kv, state.k_sum)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
@pytest.mark.parametrize("used", [(0,), (1,), (2,), (1, 2), (0, 2)], ids=["out", "kv", "k_sum", "state", "out_k_sum"])
def test_gradients_of_some_outputs(used, normalize, device):
    """Outputs no loss uses reach the backward without a gradient (nothing materializes zeros for
    them); the gradients are those of a loss that weighs the unused outputs by zero."""
    leaves, outputs = _outputs_with_state(device, normalize)
    weights = [torch.randn_like(x) for x in outputs]
    loss = sum((outputs[i] * weights[i]).sum() for i in used)
    grads = torch.autograd.grad(loss, leaves, retain_graph=True, allow_unused=True)
    zero_weighted = sum((x * (w if i in used else torch.zeros_like(w))).sum()
                        for i, (x, w) in enumerate(zip(outputs, weights)))
    expected = torch.autograd.grad(zero_weighted, leaves)
    for name, g, e in zip(("q", "k", "v", "kv0", "k_sum0"), grads, expected):
        assert g is not None, name
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("device", DEVICES)
def test_second_derivative_is_refused(device):
    """create_graph=True gives the first derivatives; differentiating them again raises (the
    backward is not itself differentiable) instead of returning silently wrong numbers."""
    q, k, v = (x.requires_grad_() for x in make_inputs(1, 2, 20, 4, 3, dtype=torch.float64, device=device))
    grad_out = torch.randn_like(v)
    out = fast_causal_attn.causal_dot_product(q, k, v)
    once = torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)
    with_graph = torch.autograd.grad(out, (q, k, v), grad_out, create_graph=True)
    for a, b in zip(with_graph, once):
        torch.testing.assert_close(a.detach(), b, rtol=0, atol=0)
    assert all(g.requires_grad for g in with_graph)
    with pytest.raises(RuntimeError, match="the backward is not differentiable"):
        torch.autograd.grad(with_graph[0].sum(), q)


# Forward mode (torch.func.jvp, torch.autograd.forward_ad): the tangents against those of the
# float64 reference (plain torch ops, which torch differentiates in forward mode itself).
STATE_NAMES = ("q", "k", "v", "initial_kv", "initial_k_sum")


def _forward_mode_case(device, normalize, layout="bhld", dtype=torch.float64):
    q, k, v = make_inputs(2, 3, 70, 5, 4, dtype=dtype, device=device, layout=layout, normalize=normalize)
    if normalize:  # the normalizer away from zero, as in test_gradcheck
        q, k = q + 0.1, k + 0.1
    kv0, k_sum0 = (x.to(device) for x in make_state(2, 3, 5, 4, torch.float64, normalize))
    return dict(zip(STATE_NAMES, (q, k, v, kv0, k_sum0)))


def _ours_with_state(normalize, layout):
    """(out, final kv, final k_sum) of q, k, v and the initial state."""
    def ours(q, k, v, kv0, k_sum0):
        out, state = fast_causal_attn.causal_linear_attention(
            q, k, v, scale=0.7, normalize=normalize, layout=layout, initial_state=fast_causal_attn.State(kv0, k_sum0),
            return_final_state=True)
        return out, state.kv, state.k_sum

    return ours


def _reference_with_state(normalize, layout):
    """The same through the float64 reference."""
    return lambda q, k, v, kv0, k_sum0: reference_with_state(q, k, v, (kv0, k_sum0), scale=0.7, normalize=normalize,
                                                             layout=layout)


def _assert_tangents_close(ours, expected, rtol):
    for name, a, b in zip(("out", "final kv", "final k_sum"), ours, expected):
        assert a is not None, name
        scale = b.abs().max().clamp_min(1e-300)
        assert ((a.cpu().double() - b.double()).abs().max() / scale).item() <= rtol, name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
def test_func_jvp_matches_reference(layout, normalize, device):
    inputs = _forward_mode_case(device, normalize, layout)
    primals = tuple(inputs.values())
    tangents = tuple(torch.randn_like(x) for x in primals)
    out, ours = torch.func.jvp(_ours_with_state(normalize, layout), primals, tangents)
    ref_out, expected = torch.func.jvp(_reference_with_state(normalize, layout), tuple(x.cpu() for x in primals),
                                       tuple(t.cpu() for t in tangents))
    torch.testing.assert_close(out[0].cpu(), ref_out[0], rtol=1e-10, atol=1e-12)
    _assert_tangents_close(ours, expected, rtol=1e-10)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
@pytest.mark.parametrize("name", STATE_NAMES)
def test_forward_ad_tangent_on_one_input(name, normalize, device):
    """One input dual, the others plain (their tangents absent, not zero): each product skipped."""
    inputs = _forward_mode_case(device, normalize)
    tangent = torch.randn_like(inputs[name])
    with fwAD.dual_level():
        duals = dict(inputs, **{name: fwAD.make_dual(inputs[name], tangent)})
        ours = [fwAD.unpack_dual(x).tangent for x in _ours_with_state(normalize, "bhld")(*duals.values())]
    zero_elsewhere = tuple(tangent.cpu() if n == name else torch.zeros_like(x.cpu()) for n, x in inputs.items())
    _, expected = torch.func.jvp(_reference_with_state(normalize, "bhld"),
                                 tuple(x.cpu() for x in inputs.values()), zero_elsewhere)
    _assert_tangents_close(ours, expected, rtol=1e-10)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
def test_forward_ad_packed_sequences(normalize, device):
    """cu_seqlens: each sequence's tangent is its own, as if it ran alone."""
    lengths = [5, 0, 40, 1]
    q, k, v = make_inputs(1, 2, sum(lengths), 4, 3, dtype=torch.float64, device=device, normalize=normalize)
    if normalize:
        q, k = q + 0.1, k + 0.1
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)
    tangents = tuple(torch.randn_like(x) for x in (q, k, v))

    def packed(q, k, v):
        return fast_causal_attn.causal_linear_attention(q, k, v, normalize=normalize, cu_seqlens=cu)

    def alone(q, k, v):
        return reference_with_state(q, k, v, normalize=normalize)[0]

    _, ours = torch.func.jvp(packed, (q, k, v), tangents)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        piece = tuple(x[:, :, start:end].cpu() for x in (q, k, v))
        _, expected = torch.func.jvp(alone, piece, tuple(t[:, :, start:end].cpu() for t in tangents))
        torch.testing.assert_close(ours[:, :, start:end].cpu(), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
def test_func_jvp_in_bfloat16(normalize, device):
    """16-bit inputs: the tangent in the inputs' dtype (the normalizer's parts in float32), near
    float64's."""
    inputs = _forward_mode_case(device, normalize, dtype=torch.bfloat16)
    primals = tuple(inputs[n] for n in "qkv")
    tangents = tuple(torch.randn_like(x) for x in primals)

    def ours(q, k, v):
        return fast_causal_attn.causal_linear_attention(q, k, v, normalize=normalize)

    def reference(q, k, v):
        return reference_with_state(q, k, v, normalize=normalize)[0]

    out, tangent = torch.func.jvp(ours, primals, tangents)
    assert out.dtype == tangent.dtype == torch.bfloat16
    _, expected = torch.func.jvp(reference, tuple(x.cpu().double() for x in primals),
                                 tuple(t.cpu().double() for t in tangents))
    assert relative_error(tangent, expected) < 2e-2


@pytest.mark.parametrize("device", DEVICES)
def test_dual_level_without_tangents_runs(device):
    """Inside a dual level, inputs without tangents (the tangent on another tensor) run as outside."""
    q, k, v = make_inputs(1, 2, 20, 4, 3, dtype=torch.float64, device=device)
    expected = fast_causal_attn.causal_dot_product(q, k, v)
    with fwAD.dual_level():
        other = fwAD.make_dual(torch.zeros(3, device=device), torch.ones(3, device=device))
        out = fast_causal_attn.causal_dot_product(q, k, v) + other.sum()
        assert fwAD.unpack_dual(out).tangent is not None  # the other tensor's, through the sum
    torch.testing.assert_close(fwAD.unpack_dual(out).primal, expected, rtol=0, atol=0)
