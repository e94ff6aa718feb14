"""The registered torch ops, their fake (meta) implementations and the autograd Function."""
import torch

from . import _C  # noqa: F401  (loads the library; its static initializers register the ops)

_forward = torch.ops.fast_causal_attn.forward.default
_backward = torch.ops.fast_causal_attn.backward.default


def _accumulation_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _bhl(q, layout):
    return (q.shape[0], q.shape[2], q.shape[1]) if layout == "blhd" else tuple(q.shape[:3])


def _check_same_device(q, **others):
    # A mix of devices can reach the fake kernels (meta tensors, tracing); the C++ check does not
    # run there, so the same message comes from here.
    for name, t in others.items():
        torch._check(
            t is None or t.device == q.device,
            lambda: f"fast_causal_attn: {name} must be on the same device as q ({q.device}), got {t.device}",
        )


@torch.library.register_fake("fast_causal_attn::forward")
def _forward_fake(q, k, v, scale, normalize, eps, layout):
    _check_same_device(q, k=k, v=v)
    # The output has v's shape in either layout, contiguous in that layout.
    out = v.new_empty(v.shape)
    den_shape = _bhl(q, layout) if normalize else (0,)
    den = q.new_empty(den_shape, dtype=_accumulation_dtype(q.dtype))
    return out, den


@torch.library.register_fake("fast_causal_attn::backward")
def _backward_fake(grad_out, q, k, v, out, den, scale, normalize, layout):
    _check_same_device(q, k=k, v=v, grad_out=grad_out, out=out, den=den)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


class CausalDotProduct(torch.autograd.Function):
    """Differentiable causal linear attention over the registered ops.

    ``CausalDotProduct.apply(q, k, v)`` is a drop-in for fast-transformers' class of the same name
    (unnormalized, scale 1, [B, H, L, D]); the trailing arguments expose the rest of the op.
    """

    @staticmethod
    def forward(ctx, q, k, v, scale=1.0, normalize=False, eps=1e-6, layout="bhld"):
        out, den = _forward(q, k, v, scale, normalize, eps, layout)
        if normalize:
            ctx.save_for_backward(q, k, v, out, den)
        else:
            ctx.save_for_backward(q, k, v)
        ctx.scale, ctx.normalize, ctx.layout = scale, normalize, layout
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        if ctx.normalize:
            q, k, v, out, den = ctx.saved_tensors
        else:
            (q, k, v), out, den = ctx.saved_tensors, None, None
        grad_q, grad_k, grad_v = _backward(grad_out, q, k, v, out, den, ctx.scale, ctx.normalize, ctx.layout)
        return grad_q, grad_k, grad_v, None, None, None, None
