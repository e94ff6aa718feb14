"""Latency of one decoding step (L = 1 from a state) beside the floor of reading and writing the
state once.

    python benchmarks/decode_benchmark.py                  # CUDA when present, else the CPU
    python benchmarks/decode_benchmark.py --device cpu

H = 16, E = M = 128, normalize, B in {1, 8, 64}. On CUDA: triton.testing.do_bench medians, the
floor is the state's bytes (read kv and k_sum, write them back) over the copy bandwidth measured
in the same run. On the CPU: medians of perf_counter, and the floor is allocating and filling one
new state (the API returns a new state each step).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fast_causal_attn  # noqa: E402
from benchmark import copy_bandwidth, median_ms  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--batches", default="1,8,64")
    args = parser.parse_args()
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    H, E, M = 16, 128, 128
    bandwidth = copy_bandwidth(device)
    print(f"decode step on {device}, torch {torch.__version__}, H={H}, E=M={E}, fp32 state; "
          f"copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    print(f"{'B':>4} {'dtype':>9} {'step us':>9} {'floor us':>9}")
    for dtype in (torch.float32, torch.bfloat16):
        for B in (int(b) for b in args.batches.split(",")):
            g = torch.Generator().manual_seed(B)
            q, k = (torch.rand(B, H, 1, E, generator=g).to(device, dtype) for _ in range(2))
            v = torch.randn(B, H, 1, M, generator=g).to(device, dtype)
            state = fast_causal_attn.State(torch.randn(B, H, E, M, generator=g).to(device),
                                           torch.rand(B, H, E, generator=g).to(device))

            def step():
                with torch.no_grad():
                    return fast_causal_attn.causal_linear_attention(q, k, v, normalize=True, initial_state=state,
                                                                    return_final_state=True)

            step_ms = median_ms(step, device, reps=50)
            state_bytes = 2 * (state.kv.numel() + state.k_sum.numel()) * 4
            if device == "cuda":
                floor_ms = state_bytes / bandwidth * 1e3
            else:
                floor_ms = median_ms(lambda: torch.empty_like(state.kv).copy_(state.kv), device, reps=50)
            print(f"{B:>4} {str(dtype).replace('torch.', ''):>9} {step_ms * 1e3:9.1f} {floor_ms * 1e3:9.1f}")


if __name__ == "__main__":
    main()
