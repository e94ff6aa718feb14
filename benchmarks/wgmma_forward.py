"""Checks and times the wgmma (sm_90a) forward prototype (benchmarks/wgmma_forward.cu) beside this
library's default path, its single-segment pass and, when importable, fla's fused_chunk:

    python benchmarks/wgmma_forward.py [--fla] [--shapes "B,H,L;..."] [--swap auto|0|1]

bf16, E = M = 64, contiguous [B, H, L, 64], scale 1, unnormalized. Correctness first (against
float64 at a small shape with a partial last chunk, and against this library at each timed
shape), then do_bench medians beside the HBM floor (read q, k, v, write o at the copy bandwidth
measured here). The descriptor's offsets are in the PTX ISA's order (--swap: also or only the
other way round). One warpgroup a block, chunks of 64 steps (a two-warpgroup variant measured no
faster and was removed: benchmarks/RESULTS.md, ninth session); 3 or 4 chunks staged, by every
thread's cp.async copies or by the TMA; the state's copy in one bf16 part or two (the library's
bfloat16 accuracy).
"""
import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import baselines  # noqa: E402
import fast_causal_attn  # noqa: E402
from wgmma_probe import build_sm90a  # noqa: E402


def load(swap_offsets):
    """The prototype built with the descriptor offsets in the PTX ISA's order, or swapped."""
    return build_sm90a(f"wgmma_forward_swap{int(swap_offsets)}", "wgmma_forward.cu",
                       [f"-DWGMMA_SWAP_OFFSETS={int(swap_offsets)}"])


def one_segment(q, k, v):
    """This library's forward with every sequence in one time segment (FAST_CAUSAL_ATTN_SEGMENTS=1):
    the prototype's and fla fused_chunk's shape of work."""
    os.environ["FAST_CAUSAL_ATTN_SEGMENTS"] = "1"
    try:
        return fast_causal_attn.causal_dot_product(q, k, v)
    finally:
        del os.environ["FAST_CAUSAL_ATTN_SEGMENTS"]


reference, relative_error = baselines.quadratic_reference, baselines.max_relative_error


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="8,16,2048;4,16,8192;2,4,8192")
    parser.add_argument("--fla", action="store_true", help="also time fla's fused_chunk (Triton compiles: minutes)")
    parser.add_argument("--swap", choices=["auto", "0", "1"], default="0",
                        help="the descriptor offsets as the PTX ISA orders them (0, the default: what "
                             "wgmma_probe.py measured right on the H200), swapped (1), or both (auto; a build "
                             "that faults leaves the GPU context unusable)")
    args = parser.parse_args()
    import triton.testing

    gen = torch.Generator().manual_seed(0)

    def inputs(B, H, L):
        q, k = (torch.randn(B, H, L, 64, generator=gen) / 8 for _ in range(2))
        v = torch.randn(B, H, L, 64, generator=gen)
        return [x.to("cuda", torch.bfloat16) for x in (q, k, v)]

    q, k, v = inputs(2, 3, 150)  # a partial last chunk (22 rows)
    exact = reference(q.cpu(), k.cpu(), v.cpu())
    library = relative_error(fast_causal_attn.causal_dot_product(q, k, v).cpu(), exact)
    module, tma_passed = None, False
    for swap in ((False, True) if args.swap == "auto" else (args.swap == "1",)):
        candidate = load(swap)
        # 3 segments asked: 2, of 128 and 22 steps
        # cp.async first: a TMA variant that faults ends the process after the cp.async lines print
        errors = {(stages, segments, parts, tma): relative_error(
                      candidate.forward(q, k, v, stages, segments, parts, tma, False).cpu(), exact)
                  for tma in (False, True) for stages in (3, 4) for segments in (1, 3) for parts in (1, 2)}
        exact_reverse = reference(q.cpu(), k.cpu(), v.cpu(), reverse=True)
        reverse_errors = {tma: max(relative_error(candidate.forward(q, k, v, 3, segments, 2, tma, True).cpu(),
                                                  exact_reverse) for segments in (1, 3))
                          for tma in (False, True)}
        print(f"float64 check, 2,3,150, offsets {'swapped' if swap else 'as the PTX ISA orders them'}: relative "
              f"error {max(errors.values()):.2e} at most over 3-4 stages, 1 or 3 segments, 1 or 2 state parts, "
              f"cp.async or TMA; this library {library:.2e}")
        print(f"  reverse (s >= t), 3 stages, two parts: at most {reverse_errors[False]:.2e} (cp.async), "
              f"{reverse_errors[True]:.2e} (TMA)")
        print(f"  the TMA loads a tile in {candidate.tma_pieces(q, k, v)} piece(s) (1: the 4-d view; 8: the 3-d one)")
        for parts in (1, 2):
            for tma in (False, True):
                worst = max(e for (_, _, pa, tm), e in errors.items() if pa == parts and tm == tma)
                print(f"  state copy in {parts} bf16 part(s), {'TMA' if tma else 'cp.async'}: at most {worst:.2e}")
        bound = 4 * max(library, 2.0**-8)
        passed = {tma: max(e for key, e in errors.items() if key[3] == tma) < bound and reverse_errors[tma] < bound
                  for tma in (False, True)}
        if module is None and passed[False]:
            module, tma_passed = candidate, passed[True]
            if not tma_passed:
                print("  the TMA variant misses the reference: not timed")
    if module is None:
        print("neither encoding gives the reference result: see benchmarks/wgmma_probe.py")
        return

    buffer = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    copy_ms = triton.testing.do_bench(lambda: buffer.clone(), return_mode="median")
    bandwidth = 2 * buffer.numel() / (copy_ms * 1e-3)
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    fla = baselines.fla_linear_attention("cuda") if args.fla else {}
    for shape in args.shapes.split(";"):
        B, H, L = (int(x) for x in shape.split(","))
        q, k, v = inputs(B, H, L)
        expected = fast_causal_attn.causal_dot_product(q, k, v)
        # the reverse direction is the forward of the time-reversed sequence, reversed
        expected_reverse = fast_causal_attn.causal_dot_product(q.flip(2), k.flip(2), v.flip(2)).flip(2)
        floor = 4 * q.numel() * 2 / bandwidth * 1e3
        # segments as this library picks them: a wave of blocks (3 a multiprocessor), 256 steps at least
        cases = {}
        segments = max(1, min(132 * 3 // (B * H), L // 256))
        for st in (3, 4):
            for sg in sorted({1, segments}):
                for pa in (1, 2):
                    for tma in (False, True) if tma_passed else (False,):
                        cases[f"wgmma {st} st., {sg} segm., {pa} part(s){', TMA' if tma else ''}"] = (
                            lambda st=st, sg=sg, pa=pa, tma=tma: module.forward(q, k, v, st, sg, pa, tma, False))
        for sg in sorted({1, segments}):  # the reverse direction (dk / dv's shape), two parts
            for tma in (False, True) if tma_passed else (False,):
                cases[f"wgmma reverse 3 st., {sg} segm.{', TMA' if tma else ''}"] = (
                    lambda sg=sg, tma=tma: module.forward(q, k, v, 3, sg, 2, tma, True))
        cases["fast_causal_attn"] = lambda: fast_causal_attn.causal_dot_product(q, k, v)
        cases["fast_causal_attn 1 segment"] = lambda: one_segment(q, k, v)
        blhd = [x.transpose(1, 2).contiguous() for x in (q, k, v)]
        for name, fn in fla.items():
            if "fused" in name:
                cases[name] = lambda fn=fn: fn(*blhd)
        for name, fn in cases.items():
            if name.startswith("wgmma"):
                error = relative_error(fn(), (expected_reverse if "reverse" in name else expected).double())
                check = f"vs this library {error:.1e}"
            else:
                check = ""
            ms = triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
            print(f"{B},{H},{L},64 {name:38} {ms:8.4f} ms  {ms / floor:4.1f}x floor ({floor:.4f})  {check}", flush=True)


if __name__ == "__main__":
    main()
