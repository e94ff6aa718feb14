"""Whether a call's host work waits for the GPU: each piece of a fwd+bwd issued behind a long GPU
sleep (torch.cuda._sleep), timed on the host. A piece that returns well within the sleep queued its work
behind the sleep; one that takes the sleep's milliseconds waited for the GPU (a synchronizing
runtime call, an allocation that had to free cached blocks, a copy to the host). (A call issued
right after a synchronize takes 0.05-1 ms on the H200 machine's host without waiting: cold caches;
RESULTS.md, thirty-eighth session. A wait shows as the sleep's 20 ms.) Then the host
time per call of each piece with the GPU idle (benchmark.host_ms), so that a wait can be told from
host work.

    python benchmarks/host_sync.py --shapes "2,4,8192,64,64;8,16,2048,64,64" --dtypes bfloat16,float32
"""
import argparse
import os
import time

import torch

import fast_causal_attn
from benchmark import host_ms, make_case
from host_profile import op_calls

SLEEP_CYCLES = 40_000_000  # about 20 ms at the H200's clock


def behind_sleep(fn):
    """ms the host spends in fn() issued behind SLEEP_CYCLES of GPU sleep (then waits it out)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    start = time.perf_counter()
    fn()
    ms = (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    return ms


def pieces(q, k, v, dout):
    """The public API's fwd+bwd and its parts: the forward with its node, autograd's backward
    over a graph kept for it, and the ops alone (host_profile.op_calls)."""
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    kept = fast_causal_attn.causal_dot_product(*leaves)
    return {
        "fwd+bwd": lambda: torch.autograd.grad(fast_causal_attn.causal_dot_product(*leaves), leaves, dout),
        "forward with autograd": lambda: fast_causal_attn.causal_dot_product(*leaves),
        "grad of a kept graph": lambda: torch.autograd.grad(kept, leaves, dout, retain_graph=True),
        **{name: fn for name, fn in op_calls(q, k, v, dout).items() if name != "attention op"},
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="2,4,8192,64,64;8,16,2048,64,64")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    for dtype_name in args.dtypes.split(","):
        for shape in args.shapes.split(";"):
            B, H, L, E, M = (int(x) for x in shape.split(","))
            q, k, v, dout = make_case(B, H, L, E, M, getattr(torch, dtype_name), "cuda")
            for reuse in ("1", "0"):  # the backward from the forward's segment starts, or not
                os.environ["FAST_CAUSAL_ATTN_REUSE_SEGMENTS"] = reuse
                print(f"{dtype_name} {B},{H},{L},{E},{M} REUSE_SEGMENTS={reuse}: host ms behind a GPU sleep / "
                      f"host ms per call (GPU idle)")
                for name, fn in pieces(q, k, v, dout).items():
                    fn()
                    waited = sorted(behind_sleep(fn) for _ in range(5))[2]
                    print(f"  {name:24s} {waited:8.3f} / {host_ms(fn, args.iters):.3f}")
    os.environ.pop("FAST_CAUSAL_ATTN_REUSE_SEGMENTS")


if __name__ == "__main__":
    main()
