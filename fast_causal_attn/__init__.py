"""Causal linear attention for PyTorch: fused CPU and CUDA kernels, forward and backward.

For each batch and head, with q' = scale * q:

    unnormalized:  O[t] = sum_{s<=t} (q'[t] . k[s]) v[s]
    normalized:    O[t] = sum_{s<=t} (q'[t] . k[s]) v[s] / (q'[t] . sum_{s<=t} k[s] + eps)
"""
import torch

from . import feature_maps, nn
from ._ops import CausalDotProduct, State, attend, autocast_dtype

__all__ = ["causal_dot_product", "causal_linear_attention", "CausalDotProduct", "State", "feature_maps", "nn"]
__version__ = "0.1.0"


def causal_dot_product(q, k, v):
    """Unnormalized causal linear attention, as ``fast_transformers.causal_product.causal_dot_product``.

    q, k: [B, H, L, E]; v: [B, H, L, M]. Returns [B, H, L, M]:
    ``out[b, h, t] = sum_{s<=t} (q[b, h, t] . k[b, h, s]) v[b, h, s]``. Differentiable in q, k and v.
    """
    return causal_linear_attention(q, k, v)


def causal_linear_attention(q, k, v, *, scale=1.0, normalize=False, eps=1e-6, layout="bhld", initial_state=None,
                            return_final_state=False, cu_seqlens=None):
    """Causal linear attention, optionally normalized, in either layout.

    Args:
        q, k: [B, H, L, E] for ``layout="bhld"``, [B, L, H, E] for ``layout="blhd"``.
        v: [B, H, L, M] or [B, L, H, M]; M may differ from E.
        scale: multiplies q (q' = scale * q).
        normalize: divide by ``q'[t] . sum_{s<=t} k[s] + eps``; q and k should then be non-negative
            (a positive feature map), as in linear transformers.
        eps: added to the normalizer; must be finite and > 0.
        layout: ``"bhld"`` or ``"blhd"`` (flash-attn's and fla's). Inputs are read through their
            strides; only an input whose last dimension is not contiguous, or on CUDA whose rows
            start off 16-byte boundaries, is copied.
        initial_state: a ``State(kv, k_sum)`` (kv [B, H, E, M], k_sum [B, H, E], float32 or float64
            for float64 inputs) to start from, e.g. the final state of the previous piece of the
            sequence; None starts from zero. On CUDA, E and M up to 256.
        return_final_state: also return the state after the last timestep. On CUDA, E and M up to 256.
        cu_seqlens: variable-length batches: int32 or int64 [N + 1] offsets (0, ..., total) of N
            sequences packed along the time dimension of inputs with batch size 1. Attention never
            crosses a sequence boundary; states are then per sequence, [N, H, E, M] and [N, H, E].
            On CUDA, E and M up to 256.

    Under torch.autocast (float16 or bfloat16 on CUDA, bfloat16 on the CPU) q, k and v run in the
    autocast dtype, accumulating in float32.

    Returns:
        The output, in the inputs' layout and dtype: [B, H, L, M] or [B, L, H, M]; with
        return_final_state, ``(out, State(kv, k_sum))``. float16 and bfloat16 inputs accumulate in
        float32, float64 in float64. Differentiable in q, k, v and the initial state, in reverse and
        forward mode (torch.func.jvp); processing a
        sequence in pieces, each from the previous piece's final state, gives what processing it
        whole gives.
    """
    kv, k_sum = (None, None) if initial_state is None else initial_state
    args = (cu_seqlens, float(scale), bool(normalize), float(eps), layout, bool(return_final_state))
    run_dtype = autocast_dtype(q)
    if run_dtype is None:
        out, final_kv, final_k_sum = attend(q, k, v, kv, k_sum, *args)
    else:  # run in the autocast dtype (accumulating in float32); the state stays float32
        q, k, v = (x.to(run_dtype) for x in (q, k, v))
        with torch.autocast(q.device.type, enabled=False):
            out, final_kv, final_k_sum = attend(q, k, v, kv, k_sum, *args)
    return (out, State(final_kv, final_k_sum)) if return_final_state else out
