"""What fast_causal_attn is measured against: plain PyTorch, and peers when they are present.

Peers are never part of this repository: put their source in third_party/ (git-ignored) to have
them built and timed beside ours, e.g. fast-transformers' causal_product_cpu.cpp and
causal_product_cuda.cu in third_party/fast_transformers/, and flash-linear-attention's `fla`
package (with the pure-Python packages it imports, such as einops) in third_party/.
"""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THIRD_PARTY = os.path.join(ROOT, "third_party")


def quadratic_reference(q, k, v, reverse=False):
    """float64 causal linear attention, [B, H, L, D], as one masked product; reverse: out[t] = sum
    over s >= t (the shape of the backward's dk and dv passes)."""
    q, k, v = (x.double() for x in (q, k, v))
    scores = q @ k.transpose(-1, -2)
    return (scores.triu() if reverse else scores.tril()) @ v


def max_relative_error(x, exact):
    """The largest absolute difference over the largest absolute value of `exact` (float64)."""
    return ((x.double() - exact).abs().max() / exact.abs().max()).item()


def issue_inputs(B, H, L, E, generator, dtype=torch.bfloat16, device="cuda"):
    """Issue 5's inputs, [B, H, L, E] contiguous: q and k N(0, 1/E), v N(0, 1), drawn in float32
    on the CPU from `generator` (the prototypes' checks and timings: columns256.py, transposed256.py)."""
    q, k = (torch.randn(B, H, L, E, generator=generator) / E**0.5 for _ in range(2))
    v = torch.randn(B, H, L, E, generator=generator)
    return [x.to(device, dtype) for x in (q, k, v)]


def device_copy_bandwidth():
    """Bytes read plus written a second by a 256 MiB clone on the GPU, do_bench's median (the
    prototypes' floors; benchmark.py's copy_bandwidth needs the library imported)."""
    import triton.testing

    buffer = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    ms = triton.testing.do_bench(lambda: buffer.clone(), return_mode="median")
    return 2 * buffer.numel() / (ms * 1e-3)


def prototype_shapes(shapes, inputs):
    """The prototypes' timed shapes ("B,H,L;..."): the copy bandwidth measured and printed once,
    then for each shape (B, H, L), its inputs (inputs(B, H, L)) and the forward's HBM floor in ms
    (q, k and v read, o written, at that bandwidth)."""
    bandwidth = device_copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    for shape in shapes.split(";"):
        B, H, L = (int(x) for x in shape.split(","))
        q, k, v = inputs(B, H, L)
        yield (B, H, L), (q, k, v), 4 * q.numel() * q.element_size() / bandwidth * 1e3


def reversed_forward(forward, q, k, v):
    """The reverse direction's outputs (out[t] = sum over s >= t) from `forward`: the forward of the
    time-reversed sequences (flipped outside any timing), flipped back, in float64."""
    return forward(*(x.flip(2).contiguous() for x in (q, k, v))).flip(2).double()


def time_runs(label, runs, floor, against_name, width):
    """Each of runs, (name, fn, expected or None): fn's output against `expected` where given, then
    do_bench's median beside the floor, one line each, `label` first."""
    import triton.testing

    for name, fn, against in runs:
        check = f"  vs {against_name} {max_relative_error(fn(), against):.1e}" if against is not None else ""
        ms = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
        print(f"{label} {name:{width}} {ms:8.4f} ms  {ms / floor:4.2f}x floor ({floor:.4f}){check}", flush=True)


def torch_chunked(q, k, v, chunk=64):
    """Plain-PyTorch chunked causal linear attention, [B, H, L, D], unnormalized, scale 1:
    masked products inside each chunk plus an exclusive prefix sum of per-chunk k^T v states."""
    B, H, L, E = q.shape
    M = v.shape[-1]
    pad = (-L) % chunk
    if pad:
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    n = (L + pad) // chunk
    qc, kc, vc = (x.reshape(B, H, n, chunk, x.shape[-1]) for x in (q, k, v))
    intra = (qc @ kc.transpose(-1, -2)).tril() @ vc
    kv = kc.transpose(-1, -2) @ vc  # [B, H, n, E, M]
    states = kv.cumsum(2) - kv  # state before each chunk
    out = intra + qc @ states
    return out.reshape(B, H, n * chunk, M)[:, :, :L]


def torch_chunked_normalized(q, k, v, eps=1e-6, chunk=64):
    """torch_chunked normalized as causal_linear_attention(normalize=True): divided by q[t] .
    sum_{s<=t} k[s] + eps, which is torch_chunked with v a column of ones."""
    return torch_chunked(q, k, v, chunk) / (torch_chunked(q, k, torch.ones_like(v[..., :1]), chunk) + eps)


_fast_transformers = {}


def fast_transformers_causal_dot_product(device):
    """fast-transformers' causal_dot_product for `device`, built from third_party/ (None when its
    source is absent). Its own Python wrapper is used when the package is installed."""
    if device in _fast_transformers:
        return _fast_transformers[device]
    fn = None
    try:
        from fast_transformers.causal_product import causal_dot_product as fn  # noqa: F811
    except ImportError:
        src_dir = os.path.join(THIRD_PARTY, "fast_transformers")
        name = "causal_product_cuda.cu" if device == "cuda" else "causal_product_cpu.cpp"
        src = os.path.join(src_dir, name)
        if os.path.exists(src):
            from torch.utils.cpp_extension import load

            flags = ["-O3", "-fopenmp"]
            module = load(
                name="ft_causal_product_" + device,
                sources=[src],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                extra_cuda_cflags=["-O3"],
                verbose=False,
            )
            fn = _autograd_wrapper(module)
    _fast_transformers[device] = fn
    return fn


def _autograd_wrapper(module):
    """fast-transformers' CausalDotProduct, as its __init__.py wraps the compiled functions."""

    class CausalDotProduct(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            ctx.save_for_backward(q, k, v)
            out = torch.zeros((*q.shape[:-1], v.shape[-1]), device=q.device, dtype=q.dtype)
            module.causal_dot_product(q, k, v, out)
            return out

        @staticmethod
        def backward(ctx, grad_out):
            q, k, v = ctx.saved_tensors
            gq, gk, gv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
            module.causal_dot_backward(q, k, v, grad_out, gq, gk, gv)
            return gq, gk, gv

    return CausalDotProduct.apply


def fla_linear_attention(device, normalize=False):
    """flash-linear-attention's chunk and fused_chunk linear attention as {name: fn}, fn(q, k, v)
    on [B, L, H, D] inputs, scale 1, unnormalized (the issue's setting; `normalize`: normalized,
    the names ending in " normalize"); {} off CUDA or when fla cannot be imported (from an
    installed package or from third_party/)."""
    if device != "cuda":
        return {}
    if os.path.isdir(os.path.join(THIRD_PARTY, "fla")) and THIRD_PARTY not in sys.path:
        sys.path.insert(0, THIRD_PARTY)
    try:
        from fla.ops.linear_attn import chunk_linear_attn, fused_chunk_linear_attn
    except Exception as error:  # absent, or a dependency missing: time without it, and say so
        print(f"fla not timed: {type(error).__name__}: {error}")
        return {}
    suffix = " normalize" if normalize else ""
    return {
        "fla chunk" + suffix: lambda q, k, v: chunk_linear_attn(q, k, v, scale=1.0, normalize=normalize)[0],
        "fla fused_chunk" + suffix: lambda q, k, v: fused_chunk_linear_attn(q, k, v, scale=1.0, normalize=normalize)[0],
    }
