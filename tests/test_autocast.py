"""Under torch.autocast the ops run in the autocast dtype, accumulating in float32, and gradients
reach the float32 leaves."""
import pytest
import torch

import fast_causal_attn
from conftest import CUDA
from reference import make_inputs, reference_with_grads, relative_error

CASES = [
    ("cpu", torch.bfloat16),
    pytest.param("cuda", torch.float16, marks=CUDA),
    pytest.param("cuda", torch.bfloat16, marks=CUDA),
]
# The 16-bit rule of the correctness tests: at most twice the error of plain PyTorch computing in
# the autocast dtype, never asked to beat the unit roundoff.
UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


@pytest.mark.parametrize("device, dtype", CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
def test_autocast(layout, normalize, device, dtype):
    q, k, v = make_inputs(2, 3, 90, 16, 20, dtype=torch.float32, device=device, layout=layout, normalize=normalize)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    with torch.autocast(device, dtype=dtype):
        out = fast_causal_attn.causal_linear_attention(q, k, v, scale=0.5, normalize=normalize, layout=layout)
    assert out.dtype == dtype
    grad_out = torch.randn(out.shape, device=device)
    grads = torch.autograd.grad(out, (q, k, v), grad_out.to(dtype))
    assert all(g.dtype == torch.float32 for g in grads)
    kwargs = dict(scale=0.5, normalize=normalize, layout=layout)
    exact = reference_with_grads(q, k, v, grad_out, **kwargs)
    plain = reference_with_grads(q, k, v, grad_out.to(dtype), dtype=dtype, **kwargs)
    for name, got, p, want in zip(("out", "grad_q", "grad_k", "grad_v"), (out, *grads), plain, exact):
        err, tol = relative_error(got, want), max(2 * relative_error(p, want), UNIT_ROUNDOFF[dtype])
        assert err <= tol, f"{name}: relative error {err:.3g} > {tol:.3g}"


def test_autocast_leaves_float64_alone():
    q, k, v = make_inputs(1, 2, 30, 4, 4, dtype=torch.float64, device="cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fast_causal_attn.causal_dot_product(q, k, v)
    assert out.dtype == torch.float64
