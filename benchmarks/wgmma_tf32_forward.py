"""Checks and times the float32 3xTF32 wgmma forward prototype (benchmarks/wgmma_tf32_forward.cu)
beside this library's float32 forward (mma.sync, 3xTF32), on an sm_90a device:

    python benchmarks/wgmma_tf32_forward.py [--shapes "B,H,L;..."]

float32, E = M = 64, contiguous [B, H, L, 64], scale 0.7. Correctness first, against float64 at
small shapes with partial last chunks (the bound: float32's 1e-5), then CUDA-graph replays (no
host time in them) beside the library's default and single-segment forward and the HBM floor
(read q, k, v, write o at the copy bandwidth measured here). The prototype runs one block a
(batch, head), without segments: compare it with the single-segment row.
"""
import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import fast_causal_attn  # noqa: E402
from benchmark import copy_bandwidth, graph_ms  # noqa: E402
from wgmma_probe import build_sm90a  # noqa: E402

SCALE = 0.7


def reference(q, k, v):
    q, k, v = (x.double() for x in (q, k, v))
    return (SCALE * q @ k.transpose(-1, -2)).tril() @ v


def relative_error(x, exact):
    return ((x.double() - exact).norm() / exact.norm()).item()


def inputs(B, H, L):
    q, k = (torch.randn(B, H, L, 64, device="cuda") / 8 for _ in range(2))
    return q, k, torch.randn(B, H, L, 64, device="cuda")


def library(q, k, v, segments=None):
    if segments is not None:
        os.environ["FAST_CAUSAL_ATTN_SEGMENTS"] = str(segments)
    try:
        return fast_causal_attn.causal_linear_attention(q, k, v, scale=SCALE)
    finally:
        os.environ.pop("FAST_CAUSAL_ATTN_SEGMENTS", None)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="8,16,2048;4,16,8192;2,4,8192")
    args = parser.parse_args()
    module = build_sm90a("wgmma_tf32_forward", "wgmma_tf32_forward.cu",
                         ["-DFAST_CAUSAL_ATTN_WITH_CUDA", "-DFAST_CAUSAL_ATTN_SM90A"])
    torch.manual_seed(0)
    worst = 0.0
    for B, H, L in ((1, 1, 64), (1, 2, 200), (2, 3, 1000), (1, 1, 4097)):
        q, k, v = inputs(B, H, L)
        exact = reference(q, k, v)
        ours, theirs = relative_error(module.forward(q, k, v, SCALE), exact), relative_error(library(q, k, v), exact)
        worst = max(worst, ours)
        print(f"check {B},{H},{L}: prototype {ours:.2e}, library {theirs:.2e} (float64 reference)", flush=True)
    print("prototype float32-accurate (<= 1e-5):", worst <= 1e-5)
    bandwidth = copy_bandwidth("cuda")
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write)")
    for shape in args.shapes.split(";"):
        B, H, L = (int(x) for x in shape.split(","))
        q, k, v = inputs(B, H, L)
        floor = 4 * q.numel() * 4 / bandwidth * 1e3
        error = relative_error(module.forward(q, k, v, SCALE), reference(q, k, v)) if B * H * L * L <= 2**31 else float("nan")
        times = {
            "prototype": graph_ms(lambda: module.forward(q, k, v, SCALE)),
            "library (default)": graph_ms(lambda: library(q, k, v)),
            "library (1 segment)": graph_ms(lambda: library(q, k, v, 1)),
        }
        line = ", ".join(f"{name} {ms:.3f} ms ({ms / floor:.1f} x)" for name, ms in times.items())
        print(f"{B},{H},{L},64 float32 forward (graph replay; floor {floor:.3f} ms; prototype error {error:.1e}): {line}",
              flush=True)


if __name__ == "__main__":
    main()
