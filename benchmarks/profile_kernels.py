"""A few launches of the CUDA kernels at one shape, for ncu or compute-sanitizer to look at.

    ncu --clock-control none -k regex:causal_product python benchmarks/profile_kernels.py 8 16 2048 64 64
    FAST_CAUSAL_ATTN_KERNEL=tensorcore ncu -k regex:tensorcore python benchmarks/profile_kernels.py \\
        8 16 2048 64 64 bwd bfloat16

Arguments: B H L E M, then optionally `bwd` (forward and backward; `fwd` the forward alone), a
dtype (float32 by default), then any of `normalize` (causal_linear_attention(normalize=True), on q
and k made positive as feature maps are) and `state` (a zero initial state in, the final state
returned: the benchmark's "fca state").
"""
import sys

import torch

import fast_causal_attn
from benchmark import with_zero_state

B, H, L, E, M = (int(x) for x in sys.argv[1:6])
backward = len(sys.argv) > 6 and sys.argv[6] == "bwd"
dtype = getattr(torch, sys.argv[7]) if len(sys.argv) > 7 else torch.float32
normalize = "normalize" in sys.argv[8:]
state = "state" in sys.argv[8:]
q = (torch.randn(B, H, L, E, device="cuda") / E**0.5).to(dtype)
k = (torch.randn(B, H, L, E, device="cuda") / E**0.5).to(dtype)
if normalize:
    q, k = q.abs(), k.abs()
q.requires_grad_(backward and normalize)
k.requires_grad_(backward and normalize)
v = torch.randn(B, H, L, M, device="cuda", dtype=dtype, requires_grad=backward)
if state:
    out = with_zero_state(q, k, v, normalize=normalize)
elif normalize:
    out = fast_causal_attn.causal_linear_attention(q, k, v, normalize=True)
else:
    out = fast_causal_attn.causal_dot_product(q, k, v)
if backward:
    out.backward(torch.randn_like(out))
torch.cuda.synchronize()
