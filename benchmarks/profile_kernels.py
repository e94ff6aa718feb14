"""A few launches of the CUDA kernels at one shape, for ncu or compute-sanitizer to look at.

    ncu --clock-control none -k regex:causal_product python benchmarks/profile_kernels.py 8 16 2048 64 64
"""
import sys

import torch

import fast_causal_attn

B, H, L, E, M = (int(x) for x in sys.argv[1:6])
backward = len(sys.argv) > 6 and sys.argv[6] == "bwd"
q = torch.randn(B, H, L, E, device="cuda") / E**0.5
k = torch.randn(B, H, L, E, device="cuda") / E**0.5
v = torch.randn(B, H, L, M, device="cuda", requires_grad=backward)
out = fast_causal_attn.causal_dot_product(q, k, v)
if backward:
    out.backward(torch.randn_like(out))
torch.cuda.synchronize()
