"""How far the 16-bit normalized gradients are from float64 where den is large, for each CUDA path.

Under normalize, the gradients of k and v carry q[t] / den[t] (the attention weights' scale,
about 1 / t for positive features). A kernel that rounds that quotient to float16 lands in
float16's subnormals once den passes a few thousand (below 6.1e-5 its precision drops a bit
per halving), where bfloat16, with float32's exponent, does not. This prints the norm-wise
relative error of out, dq, dk, dv against the float64 quadratic form, beside plain PyTorch's in
the same dtype, for the path each environment setting selects (read by the library at each
call):

    python benchmarks/normalize_range_probe.py                     # every case and path
    python benchmarks/normalize_range_probe.py --cases key_sums --paths default
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

CASES = {  # name: (B, H, L, E, M, how q and k are drawn)
    "key_sums": (1, 2, 4096, 32, 32, "test_float16_key_sums_beyond_float16_range's: q ~ U(0, 1) / E, k ~ 20 + U(0, 1)"),
    "elu64": (1, 2, 4096, 64, 64, "elu(x) + 1, x ~ N(0, 1)"),
    "elu128": (1, 2, 4096, 128, 128, "elu(x) + 1, x ~ N(0, 1)"),
    "elu256": (1, 1, 2048, 256, 256, "elu(x) + 1, x ~ N(0, 1)"),
    "small_den": (1, 2, 4096, 64, 64, "|N(0, 1 / E)|: den about 0.6 t"),
}
PATHS = {  # name: environment
    "default": {},
    "one_pass": {"FAST_CAUSAL_ATTN_ONE_PASS_BACKWARD": "1"},
    "no_one_pass": {"FAST_CAUSAL_ATTN_ONE_PASS_BACKWARD": "0"},
    "grad_kv_apart": {"FAST_CAUSAL_ATTN_ONE_PASS_BACKWARD": "0", "FAST_CAUSAL_ATTN_FUSED_GRAD_KV": "0"},
    "tensorcore": {"FAST_CAUSAL_ATTN_KERNEL": "tensorcore"},
    "chunked": {"FAST_CAUSAL_ATTN_KERNEL": "chunked"},
}


def inputs(case, dtype, device):
    B, H, L, E, M, _ = CASES[case]
    gen = torch.Generator().manual_seed(86000)
    if case == "key_sums":
        q = torch.rand(B, H, L, E, generator=gen, dtype=torch.float64) / E
        k = 20 + torch.rand(B, H, L, E, generator=gen, dtype=torch.float64)
    elif case == "small_den":
        q, k = (torch.randn(B, H, L, E, generator=gen, dtype=torch.float64).abs() / E**0.5 for _ in range(2))
    else:
        q, k = (torch.nn.functional.elu(torch.randn(B, H, L, E, generator=gen, dtype=torch.float64)) + 1 for _ in range(2))
    v = torch.randn(B, H, L, M, generator=gen, dtype=torch.float64)
    g = torch.randn(B, H, L, M, generator=gen, dtype=torch.float64)
    return [x.to(device=device, dtype=dtype) for x in (q, k, v, g)]


def results(q, k, v, g, dtype, call):
    """(out, dq, dk, dv) of call(q, k, v) in `dtype` on the GPU for the cotangent g."""
    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    out = call(*leaves)
    return (out, *torch.autograd.grad(out, leaves, g.to(dtype)))


def main():
    import fast_causal_attn
    from benchmark import method_settings  # (a path's environment while it runs)
    from reference import gradient_magnitudes, reference, relative_error

    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--dtypes", default="float16,bfloat16")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    print("norm-wise relative error vs float64 (gradients against their numerator terms' norms):")
    print("out dq dk dv: ours | plain PyTorch in the same dtype")
    ours = lambda q, k, v: fast_causal_attn.causal_linear_attention(q, k, v, normalize=True)
    quadratic = lambda q, k, v: reference(q, k, v, normalize=True, dtype=q.dtype)
    for case in args.cases.split(","):
        print(f"\n{case}: B, H, L, E, M = {CASES[case][:5]}; q, k: {CASES[case][5]}")
        for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
            q, k, v, g = (x.to(dtype).double() for x in inputs(case, torch.float64, args.device))
            exact = results(q, k, v, g, torch.float64, quadratic)
            magnitudes = (0.0, *gradient_magnitudes(q, k, v, g.to(dtype), normalize=True))
            error = lambda xs: " ".join(f"{relative_error(x.double(), r, m):.2e}" for x, r, m in zip(xs, exact, magnitudes))
            plain = error(results(q, k, v, g, dtype, quadratic))
            for path, env in PATHS.items():
                if path not in args.paths.split(","):
                    continue
                try:
                    with method_settings(env, tf32=torch.backends.cuda.matmul.allow_tf32):
                        xs = results(q, k, v, g, dtype, ours)
                    finite = all(torch.isfinite(x).all().item() for x in xs)
                    line = error(xs) + ("" if finite else " (NOT FINITE)")
                except RuntimeError as e:
                    line = "raised: " + str(e).splitlines()[0][:100]
                print(f"  {str(dtype)[6:]:9s} {path:14s} {line} | {plain}", flush=True)


if __name__ == "__main__":
    main()
