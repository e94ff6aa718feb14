"""The registered torch ops, their fake (meta) implementations and the differentiable call."""
import collections

import torch
from torch.autograd import forward_ad

from . import _C  # loads the library (its static initializers register the ops); plan_forward_segments

_forward = torch.ops.fast_causal_attn.forward.default
_attention = torch.ops.fast_causal_attn.attention.default

State = collections.namedtuple("State", ["kv", "k_sum"])
State.__doc__ = """The running state of causal linear attention, per batch and head.

kv: [B, H, E, M], the sum of k v^T so far; k_sum: [B, H, E], the sum of k so far (the normalizer's
state). float32, or float64 for float64 inputs."""


def autocast_dtype(q):
    """The dtype torch.autocast asks for on q's device, or None outside autocast. float64 inputs
    are left alone, as autocast leaves them."""
    device = q.device.type
    if device not in ("cpu", "cuda") or not torch.is_autocast_enabled(device) or q.dtype == torch.float64:
        return None
    return torch.get_autocast_dtype(device)


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


def _state_shapes(q, v, layout, cu_seqlens):
    B, H, _ = _bhl(q, layout)
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return (N, H, q.shape[-1], v.shape[-1]), (N, H, q.shape[-1])


def _static_shapes(*tensors):
    return all(isinstance(d, int) for t in tensors for d in t.shape)


def _planned_segments(q, v, layout, normalize, with_state, cu_seqlens):
    """The S of a CUDA forward's segment_kv with keep_segments, where the shapes are static (else
    None): the same decision the forward makes (_C.plan_forward_segments). Packed sequences
    (cu_seqlens) are never split in time: 0."""
    if not _static_shapes(q, v):
        return None
    if cu_seqlens is not None:
        return 0
    B, H, L = _bhl(q, layout)
    dtype = str(q.dtype).removeprefix("torch.")
    return _C.plan_forward_segments(dtype, B, H, L, q.shape[-1], v.shape[-1], bool(normalize), bool(with_state),
                                    q.device.index if q.device.index is not None else torch.cuda.current_device())


@torch.library.register_fake("fast_causal_attn::forward")
def _forward_fake(q, k, v, initial_kv, initial_k_sum, cu_seqlens, scale, normalize, eps, layout, return_final_state,
                  keep_segments=False):
    _check_same_device(q, k=k, v=v, initial_kv=initial_kv, initial_k_sum=initial_k_sum, cu_seqlens=cu_seqlens)
    acc = _accumulation_dtype(q.dtype)
    # The output has v's shape in either layout, contiguous in that layout.
    out = v.new_empty(v.shape)
    den = q.new_empty(_bhl(q, layout) if normalize else (0,), dtype=acc)
    kv_shape, k_sum_shape = _state_shapes(q, v, layout, cu_seqlens) if return_final_state else ((0,), (0,))
    # The segment starts kept for the dq pass (their ends, where the 16-bit backward runs in one
    # pass: one segment or more): how many segments the CUDA kernels split time into
    # depends on the device (its multiprocessors, the kernel's occupancy). With static shapes the
    # library plans the count ahead, as the real call decides it (plan_forward_segments); with
    # symbolic ones it is a size only the real call knows. None without keep_segments, and none
    # on the CPU. The key sums have as many under normalize (the one backward that reads them),
    # none otherwise.
    (N, H, E, M), _ = _state_shapes(q, v, layout, cu_seqlens)
    if keep_segments and q.device.type == "cuda":
        planned = _planned_segments(q, v, layout, normalize, initial_kv is not None or return_final_state,
                                    cu_seqlens)
        if planned is None:
            ctx = torch.library.get_ctx()
            segments = ctx.new_dynamic_size()
            key_sum_segments = ctx.new_dynamic_size() if normalize else 0
        else:
            segments = planned
            key_sum_segments = planned if normalize else 0
    else:
        segments = key_sum_segments = 0
    return (out, den, q.new_empty(kv_shape, dtype=acc), q.new_empty(k_sum_shape, dtype=acc),
            q.new_empty((N * H, segments, E, M), dtype=acc), q.new_empty((N * H, key_sum_segments, E), dtype=acc))


@torch.library.register_fake("fast_causal_attn::backward")
def _backward_fake(grad_out, grad_final_kv, grad_final_k_sum, q, k, v, out, den, initial_kv, initial_k_sum,
                   cu_seqlens, scale, normalize, layout, segment_kv=None, segment_k_sum=None):
    _check_same_device(q, k=k, v=v, grad_out=grad_out, out=out, den=den, initial_kv=initial_kv,
                       initial_k_sum=initial_k_sum, grad_final_kv=grad_final_kv, grad_final_k_sum=grad_final_k_sum,
                       cu_seqlens=cu_seqlens, segment_kv=segment_kv, segment_k_sum=segment_k_sum)
    acc = _accumulation_dtype(q.dtype)
    kv_shape, k_sum_shape = _state_shapes(q, v, layout, cu_seqlens) if initial_kv is not None else ((0,), (0,))
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty(kv_shape, dtype=acc), q.new_empty(k_sum_shape, dtype=acc))


@torch.library.register_fake("fast_causal_attn::attention")
def _attention_fake(q, k, v, initial_kv, initial_k_sum, cu_seqlens, scale, normalize, eps, layout,
                    return_final_state, keep_segments):
    out, _, final_kv, final_k_sum, _, _ = _forward_fake(q, k, v, initial_kv, initial_k_sum, cu_seqlens, scale,
                                                        normalize, eps, layout, return_final_state, keep_segments)
    return out, final_kv, final_k_sum


def _keep_segments(q, v):
    """Whether the forward keeps its segment starts for the dq pass, or their ends for the one-pass
    backward (CUDA): always in eager mode
    and, compiled, where the shapes are static, when their count is planned ahead
    (_planned_segments). With symbolic shapes it would be a size only the real call knows, and
    such a size keeps CUDA graphs (mode="reduce-overhead") off the whole graph: there the dq pass
    sums its segments itself (and the backward runs as two passes)."""
    return not torch.compiler.is_compiling() or _static_shapes(q, v)


def _tangent(t):
    return None if t is None else forward_ad.unpack_dual(t).tangent


def _attend_with_tangents(q, k, v, initial_kv, initial_k_sum, cu_seqlens, scale, normalize, eps, layout,
                          return_final_state):
    """attend's results as dual tensors: forward-mode AD (torch.func.jvp, torch.autograd.forward_ad).

    The unnormalized output N[t] = q'[t] (kv0 + sum_{s<=t} k[s] v[s]^T) is linear in q, in (k, kv0)
    and in v, so its tangent is three calls of the forward on the primals with one argument
    swapped for its tangent: N(dq, k, v, kv0) + N(q, dk, v, dkv0) + N(q, k, dv, 0); the final state
    (kv0 + sum k v^T, k_sum0 + sum k) takes its tangent from the last two calls the same way. The
    normalized output N / D (D = q' (k_sum0 + sum_{s<=t} k[s]) + eps: the same product with v = 1
    and kv0 = k_sum0) takes the quotient rule, D and its tangent computed in the accumulation dtype.
    Calls whose tangent is absent (zero) are skipped."""
    (q, dq), (k, dk), (v, dv), (kv0, dkv0), (ks0, dks0) = (
        (None, None) if t is None else forward_ad.unpack_dual(t) for t in (q, k, v, initial_kv, initial_k_sum))
    out, kv1, ks1 = attend(q, k, v, kv0, ks0, cu_seqlens, scale, normalize, eps, layout, return_final_state)

    def product(q_, k_, v_, kv_, ks_, final_state):  # (N, final kv, final k_sum), unnormalized
        return attend(q_, k_, v_, kv_, ks_, cu_seqlens, scale, False, eps, layout, final_state)

    def add(total, part):
        return part if total is None else total + part

    kv_shape, ks_shape = _state_shapes(q, v, layout, cu_seqlens)
    acc = _accumulation_dtype(q.dtype)
    key_tangent = dk is not None or dks0 is not None  # (the normalizer's: k and k_sum0 move it)
    # the state's tangents as a pair (the op takes both or neither), none where neither moves
    if dkv0 is not None or dks0 is not None:
        dkv0 = q.new_zeros(kv_shape, dtype=acc) if dkv0 is None else dkv0
        dks0 = q.new_zeros(ks_shape, dtype=acc) if dks0 is None else dks0
    if dk is None and dkv0 is not None:
        dk = torch.zeros_like(k)

    d_out = d_kv1 = d_ks1 = None
    if dq is not None:
        d_out = product(dq, k, v, kv0, ks0, False)[0]
    if dk is not None:
        part = product(q, dk, v, dkv0, dks0, return_final_state)
        d_out, d_kv1, d_ks1 = add(d_out, part[0]), part[1], part[2]
    if dv is not None:
        part = product(q, k, dv, None, None, return_final_state)
        d_out, d_kv1 = add(d_out, part[0]), add(d_kv1, part[1])

    if normalize:  # d(N / D) = (dN - out dD) / D
        ones = v.new_ones(v.shape[:-1] + (1,), dtype=acc)

        def key_sums(q_, k_, ks_):  # q_' (ks_ + sum k_), without eps: [..., 1] in the layout
            start = (None, None) if ks_ is None else (ks_.unsqueeze(-1), q.new_zeros(ks_shape, dtype=acc))
            return product(q_.to(acc), k_.to(acc), ones, *start, False)[0]

        d_num = d_out.to(acc)
        if dq is not None:
            d_num = d_num - out.to(acc) * key_sums(dq, k, ks0)
        if key_tangent:
            d_num = d_num - out.to(acc) * key_sums(q, dk, dks0)
        d_out = (d_num / (key_sums(q, k, ks0) + eps)).to(out.dtype)

    out = forward_ad.make_dual(out, d_out)
    if return_final_state:  # (a state no tangent moves: zero)
        kv1 = forward_ad.make_dual(kv1, torch.zeros_like(kv1) if d_kv1 is None else d_kv1)
        ks1 = forward_ad.make_dual(ks1, torch.zeros_like(ks1) if d_ks1 is None else d_ks1)
    return out, kv1, ks1


def attend(q, k, v, initial_kv, initial_k_sum, cu_seqlens, scale, normalize, eps, layout, return_final_state):
    """(out, final_kv, final_k_sum): through the differentiable op where a gradient can flow,
    else the forward op alone (one dispatch fewer: a decoding step's latency at small batch).
    The final state is empty without return_final_state."""
    # Tangents exist only inside a dual level (forward_ad._current_level >= 0; torch.func.jvp
    # enters one): outside it, one read of a module global.
    if forward_ad._current_level >= 0 and any(
            _tangent(t) is not None for t in (q, k, v, initial_kv, initial_k_sum)):
        return _attend_with_tangents(q, k, v, initial_kv, initial_k_sum, cu_seqlens, scale, normalize, eps, layout,
                                     return_final_state)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or
                                    (initial_kv is not None and initial_kv.requires_grad) or
                                    (initial_k_sum is not None and initial_k_sum.requires_grad)):
        return _attention(q, k, v, initial_kv, initial_k_sum, cu_seqlens, scale, normalize, eps, layout,
                          return_final_state, _keep_segments(q, v))
    out, _, final_kv, final_k_sum, _, _ = _forward(q, k, v, initial_kv, initial_k_sum, cu_seqlens, scale, normalize,
                                                   eps, layout, return_final_state, False)
    return out, final_kv, final_k_sum


class CausalDotProduct:
    """Causal linear attention through the registered ops, differentiable.

    ``CausalDotProduct.apply(q, k, v)`` is a drop-in for fast-transformers' autograd Function of
    the same name (unnormalized, scale 1, [B, H, L, D]); the trailing arguments expose the rest of
    the op. With return_final_state it returns (out, final_kv, final_k_sum), else out. The
    gradient is the C++ autograd node of the op fast_causal_attn::attention (csrc/autograd.cpp):
    no Python runs in the backward.
    """

    @staticmethod
    def apply(q, k, v, scale=1.0, normalize=False, eps=1e-6, layout="bhld", initial_kv=None, initial_k_sum=None,
              return_final_state=False, cu_seqlens=None):
        out, final_kv, final_k_sum = attend(q, k, v, initial_kv, initial_k_sum, cu_seqlens, scale, normalize, eps,
                                            layout, return_final_state)
        return (out, final_kv, final_k_sum) if return_final_state else out
