"""The one reference every test compares against: the quadratic form with a tril mask.

Run in float64 it is the ground truth; run in a 16-bit dtype it is "plain PyTorch in that dtype",
the yardstick for 16-bit tolerances.
"""
import torch

import fast_causal_attn


# Norm-wise relative error allowed where results through the state are compared (against the
# float64 reference, or pieces against the whole): the error floors of well-conditioned cases
# (positive q, k under normalize).
STATE_TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def reference(q, k, v, *, scale=1.0, normalize=False, eps=1e-6, layout="bhld", dtype=torch.float64):
    """causal_linear_attention computed as mask(q' k^T) v in `dtype`, returned in `dtype`."""
    return reference_with_state(q, k, v, scale=scale, normalize=normalize, eps=eps, layout=layout, dtype=dtype)[0]


def reference_with_state(q, k, v, initial_state=None, *, scale=1.0, normalize=False, eps=1e-6, layout="bhld",
                         dtype=torch.float64):
    """(out, final kv, final k_sum) from an initial (kv [B, H, E, M], k_sum [B, H, E]) or zero state:
    out = q' (kv0 + mask(k v^T)) as mask(q' k^T) v + q' kv0, normalized by
    q' . (k_sum0 + cumsum k) + eps."""
    if layout == "blhd":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    q, k, v = (x.to(dtype) for x in (q, k, v))
    q = scale * q
    scores = (q @ k.transpose(-1, -2)).tril()
    out = scores @ v
    den = scores.sum(-1, keepdim=True) + eps
    kv = k.transpose(-1, -2) @ v
    k_sum = k.sum(-2)
    if initial_state is not None:
        kv0, k_sum0 = (x.to(dtype) for x in initial_state)
        out = out + q @ kv0
        den = den + (q @ k_sum0.unsqueeze(-1))
        kv, k_sum = kv + kv0, k_sum + k_sum0
    if normalize:
        out = out / den
    return (out.transpose(1, 2) if layout == "blhd" else out), kv, k_sum


def reference_with_grads(q, k, v, grad_out, *, dtype=torch.float64, **kwargs):
    """(out, grad_q, grad_k, grad_v) of `reference` in `dtype`, for the cotangent grad_out."""
    leaves = [x.detach().cpu().to(dtype).requires_grad_() for x in (q, k, v)]
    out = reference(*leaves, dtype=dtype, **kwargs)
    grads = torch.autograd.grad(out, leaves, grad_out.detach().cpu().to(dtype))
    return (out.detach(), *grads)


def gradient_magnitudes(q, k, v, grad_out, *, scale=1.0, normalize=False, eps=1e-6, layout="bhld"):
    """Norms of the terms each exact gradient is a sum of, for measuring error against.

    A normalized gradient is a difference of two terms (in q: S g against (g . O) z), which cancel
    almost exactly where the output hardly depends on the input (L = 1, or E = 1 where it does not
    depend on q at all): there an error relative to the gradient itself says nothing. These are the
    norms of the first terms, the gradients of the numerator alone with g = grad_out / den."""
    if not normalize:
        return (0.0, 0.0, 0.0)
    kw = dict(scale=scale, eps=eps, layout=layout)
    den = reference(q, k, torch.ones_like(v[..., :1]), normalize=False, **kw) + eps
    _, *grads = reference_with_grads(q, k, v, grad_out.double() / den, normalize=False, **kw)
    return tuple(g.norm().item() for g in grads)


def relative_error(x, ref, magnitude=0.0):
    """Norm-wise relative error ||x - ref|| / max(||ref||, magnitude) in float64 (the absolute
    error for an all-zero ref)."""
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    assert x.shape == ref.shape, f"shape {tuple(x.shape)} != reference shape {tuple(ref.shape)}"
    denom = max(ref.norm().item(), magnitude)
    diff = (x - ref).norm().item()
    if denom == 0:
        return diff
    return diff / denom


def time_dim(layout):
    """The dimension of L: 2 in [B, H, L, D], 1 in [B, L, H, D]."""
    return 1 if layout == "blhd" else 2


def make_inputs(B, H, L, E, M, *, dtype, device, layout="bhld", normalize=False, generator=None):
    """Fresh random q, k, v: N(0, 1/E) q and k and N(0, 1) v; with normalize, q and k are made
    non-negative (a positive feature map's output), as the normalizer expects."""
    shape = (lambda D: (B, L, H, D)) if layout == "blhd" else (lambda D: (B, H, L, D))
    q = torch.randn(shape(E), generator=generator, dtype=torch.float64) / E**0.5
    k = torch.randn(shape(E), generator=generator, dtype=torch.float64) / E**0.5
    v = torch.randn(shape(M), generator=generator, dtype=torch.float64)
    if normalize:
        q, k = q.abs(), k.abs()
    return tuple(x.to(device=device, dtype=dtype) for x in (q, k, v))


def make_state(B, H, E, M, dtype, normalize):
    """A random initial State for inputs of `dtype` (float32 state, float64 for float64); with
    normalize, k_sum is non-negative like a sum of non-negative keys."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    kv = torch.randn(B, H, E, M, dtype=acc)
    k_sum = torch.rand(B, H, E, dtype=acc) * 3  # a sum of non-negative keys, as normalize expects
    return fast_causal_attn.State(kv, k_sum if normalize else k_sum - 1.5)


def check_state_matches_reference(B, H, L, E, M, *, layout, normalize, dtype, device, scale):
    """Fresh inputs and initial state through causal_linear_attention: the output and the final
    state (its dtype and shape too) as the float64 reference gives them."""
    q, k, v = make_inputs(B, H, L, E, M, dtype=dtype, device=device, layout=layout, normalize=normalize)
    state0 = fast_causal_attn.State(*(x.to(device) for x in make_state(B, H, E, M, dtype, normalize)))
    out, state1 = fast_causal_attn.causal_linear_attention(
        q, k, v, scale=scale, normalize=normalize, layout=layout, initial_state=state0, return_final_state=True)
    assert state1.kv.dtype == state0.kv.dtype and state1.kv.shape == (B, H, E, M) and state1.k_sum.shape == (B, H, E)
    ref_out, ref_kv, ref_k_sum = reference_with_state(q, k, v, state0, scale=scale, normalize=normalize, layout=layout)
    assert relative_error(out, ref_out) <= STATE_TOLERANCE[dtype]
    # The state accumulates in float32 from 16-bit inputs read exactly: float32-level error.
    state_tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    assert relative_error(state1.kv, ref_kv) <= state_tolerance
    assert relative_error(state1.k_sum, ref_k_sum) <= state_tolerance
