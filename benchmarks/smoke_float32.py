"""A quick check of the float32 CUDA kernels before the suite: forward and backward at a few
shapes (one and several chunks, odd chunk counts, row tiles up to E = 256, E != M, segments with
state-only launches) against a float64 reference on the GPU, each call timed, the whole run
meant to sit under a watchdog (`timeout 150 python benchmarks/smoke_float32.py`): a kernel that
deadlocks (a barrier protocol gone wrong) then fails in seconds instead of hanging the suite.

Exit status 0 when every relative error is at most 1e-5 (the float32 standard), 1 otherwise."""
import sys
import time

import torch

sys.path.insert(0, "tests")
from reference import make_inputs, reference, relative_error  # noqa: E402

import fast_causal_attn as fca  # noqa: E402

SHAPES = [(1, 1, 64, 64, 64), (1, 2, 65, 64, 64), (1, 2, 300, 64, 64), (2, 2, 1000, 128, 128),
          (1, 1, 4100, 256, 256), (1, 2, 20000, 64, 64), (1, 3, 777, 100, 40), (1, 2, 8192, 128, 128),
          (1, 1, 3000, 256, 256)]


def main():
    torch.manual_seed(0)
    worst = 0.0
    for B, H, L, E, M in SHAPES:
        q, k, v = (x.requires_grad_() for x in make_inputs(B, H, L, E, M, dtype=torch.float32, device="cuda"))
        grad_out = torch.randn_like(v)
        start = time.time()
        out = fca.causal_linear_attention(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        torch.cuda.synchronize()
        seconds = time.time() - start
        leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
        ref_out = reference(*leaves)
        refs = (ref_out, *torch.autograd.grad(ref_out, leaves, grad_out.double()))
        errors = [relative_error(x, r) for x, r in zip((out, *grads), refs)]
        worst = max(worst, *errors)
        print((B, H, L, E, M), "out, dq, dk, dv:", " ".join(f"{e:.2e}" for e in errors), f"({seconds:.2f} s)",
              flush=True)
    print(f"worst relative error {worst:.2e}")
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
