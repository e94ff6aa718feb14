"""Which bad inputs raise cleanly on this device, and which crash the process: each case runs in a
child process. `python benchmarks/error_probe.py [--case N]` (the child form runs one case).

Kept for the SIGSEGV seen on the H200 (torch 2.11.0+cu130, Python 3.12): some checks in
csrc/ops.cpp crashed the process instead of raising when the inputs were CUDA tensors.
"""
import argparse
import subprocess
import sys

import torch

import fast_causal_attn

CASES = [  # (name, keyword arguments, E, M, device)
    ("eps=-1 cuda", dict(eps=-1.0, normalize=True), 4, 4, "cuda"),
    ("eps=-1 cpu", dict(eps=-1.0, normalize=True), 4, 4, "cpu"),
    ("bad layout cuda", dict(layout="bshd"), 4, 4, "cuda"),
    ("state E=257 cuda", dict(return_final_state=True), 257, 4, "cuda"),
    ("unknown family cuda", dict(), 4, 4, "cuda-env"),
]


def run_case(index):
    name, kwargs, E, M, device = CASES[index]
    if device == "cuda-env":
        import os

        os.environ["FAST_CAUSAL_ATTN_KERNEL"] = "tiled"
        device = "cuda"
    q, k = torch.rand(1, 1, 8, E, device=device), torch.rand(1, 1, 8, E, device=device)
    v = torch.rand(1, 1, 8, M, device=device)
    try:
        fast_causal_attn.causal_linear_attention(q, k, v, **kwargs)
        print(f"{name}: no error")
    except RuntimeError as e:
        print(f"{name}: raised: {str(e).splitlines()[0][:100]}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", type=int, default=None)
    args = parser.parse_args()
    if args.case is not None:
        run_case(args.case)
        return
    for i, (name, *_rest) in enumerate(CASES):
        result = subprocess.run([sys.executable, "-X", "faulthandler", __file__, "--case", str(i)], capture_output=True,
                                text=True, timeout=300)
        line = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
        print(f"[{i}] exit {result.returncode:4d}  {line or name + ': (no output)'}")


if __name__ == "__main__":
    main()
