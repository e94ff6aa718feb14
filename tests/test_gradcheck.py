"""torch.autograd.gradcheck in float64: the backward is the derivative of the forward."""
import pytest
import torch

import fast_causal_attn
from conftest import DEVICES
from reference import make_inputs


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
