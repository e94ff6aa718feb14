"""torch.autograd.gradcheck in float64: the backward is the derivative of the forward."""
import pytest
import torch

import fast_causal_attn
from conftest import DEVICES
from reference import make_inputs, make_state


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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["q", "k", "v", "initial_kv", "initial_k_sum"])
def test_forward_mode_ad_is_refused(name, device):
    """A tangent on any input raises: the ops have no forward-mode rule, and their outputs would
    otherwise carry none (a zero derivative, silently)."""
    import torch.autograd.forward_ad as fwAD

    q, k, v = make_inputs(1, 2, 20, 4, 3, dtype=torch.float64, device=device)
    kv0, k_sum0 = (x.to(device) for x in make_state(1, 2, 4, 3, torch.float64, False))
    inputs = dict(q=q, k=k, v=v, initial_kv=kv0, initial_k_sum=k_sum0)
    with fwAD.dual_level():
        inputs[name] = fwAD.make_dual(inputs[name], torch.randn_like(inputs[name]))
        with pytest.raises(RuntimeError, match=f"forward-mode AD .* is not supported: {name} carries a tangent"):
            fast_causal_attn.causal_linear_attention(
                inputs["q"], inputs["k"], inputs["v"],
                initial_state=fast_causal_attn.State(inputs["initial_kv"], inputs["initial_k_sum"]))


@pytest.mark.parametrize("device", DEVICES)
def test_func_jvp_is_refused(device):
    q, k, v = make_inputs(1, 2, 20, 4, 3, dtype=torch.float64, device=device)
    tangents = tuple(torch.randn_like(x) for x in (q, k, v))
    with pytest.raises(RuntimeError, match="forward-mode AD .* is not supported: q carries a tangent"):
        torch.func.jvp(fast_causal_attn.causal_dot_product, (q, k, v), tangents)


@pytest.mark.parametrize("device", DEVICES)
def test_dual_level_without_tangents_runs(device):
    """Inside a dual level, inputs without tangents (the tangent on another tensor) run as outside."""
    import torch.autograd.forward_ad as fwAD

    q, k, v = make_inputs(1, 2, 20, 4, 3, dtype=torch.float64, device=device)
    expected = fast_causal_attn.causal_dot_product(q, k, v)
    with fwAD.dual_level():
        other = fwAD.make_dual(torch.zeros(3, device=device), torch.ones(3, device=device))
        out = fast_causal_attn.causal_dot_product(q, k, v) + other.sum()
        assert fwAD.unpack_dual(out).tangent is not None  # the other tensor's, through the sum
    torch.testing.assert_close(fwAD.unpack_dual(out).primal, expected, rtol=0, atol=0)
