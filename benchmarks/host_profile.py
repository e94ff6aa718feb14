"""Where the host's time to issue one call goes: the CPU side of torch's profiler over calls of
the public API, by op and by CUDA runtime call (launches, attribute sets, allocations), per call.

    python benchmarks/host_profile.py                       # the issue's bf16 shapes, fwd+bwd
    python benchmarks/host_profile.py --shapes "2,4,8192,64,64" --dtype float32 --top 25

Beside benchmark.py --kernel-time ("host per call" against "GPU busy per call") it tells which
host work to cut when a call is bound by it. Each section times calls back to back (the GPU not
waited for; benchmark.host_ms: the median of batches of `iters`) without the profiler, beside two baselines (a builtin op's and a Python
Function's fwd+bwd: what autograd costs any call) and the ops' own host times (no autograd),
then lists the profiled calls' CPU events.
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import fast_causal_attn
from benchmark import host_ms, make_case

SHAPES = "8,16,2048,64,64;4,16,8192,64,64;8,16,2048,128,128;2,4,8192,64,64;1,16,32768,128,128"


class _Clone(torch.autograd.Function):
    """A Python autograd Function as small as one can be: one copy forward, none backward."""

    @staticmethod
    def forward(ctx, v):
        return v.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad


def baselines(v, dout, iters):
    """The host's ms per call of what any autograd call on these tensors costs: a builtin op and
    its backward (one launch each, no Python in the backward), a builtin of three differentiable
    inputs (addcmul: the gradients of three leaves, as ours), and a Python Function (its backward
    runs Python on autograd's device thread), each through torch.autograd.grad as the timed calls."""
    leaf = v.detach().requires_grad_()
    builtin = host_ms(lambda: torch.autograd.grad(leaf * 2.0, [leaf], dout), iters)
    builtin3 = host_ms(three_leaves(v, dout), iters)
    python = host_ms(lambda: torch.autograd.grad(_Clone.apply(leaf), [leaf], dout), iters)
    return builtin, builtin3, python


def three_leaves(v, dout):
    """fwd+bwd of addcmul over three leaves of v's shape: what a builtin of three inputs costs."""
    leaves = [v.detach().clone().requires_grad_() for _ in range(3)]
    return lambda: torch.autograd.grad(torch.addcmul(*leaves), leaves, dout)


def profiled(fn, iters, top, title):
    """The CPU events of iters calls of fn under torch's profiler, by self time, per call."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU]
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    print(f"  {'self us/call':>12} {'total us/call':>13} {'calls/call':>10}  CPU event ({title}, profiled)")
    for e in events[:top]:
        print(f"  {e.self_cpu_time_total / iters:12.1f} {e.cpu_time_total / iters:13.1f} "
              f"{e.count / iters:10.1f}  {e.key[:90]}")


def op_calls(q, k, v, dout):
    """The ops alone, no autograd, as calls: the forward op, the backward op (on the forward's own
    results) and the differentiable op's forward (its C++ autograd node, csrc/autograd.cpp)."""
    ops = torch.ops.fast_causal_attn
    args = (None, None, None, 1.0, False, 1e-6, "bhld", False, True)
    results = ops.forward(q, k, v, *args)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    return {
        "forward op": lambda: ops.forward(q, k, v, *args),
        "backward op": lambda: ops.backward(dout, None, None, q, k, v, None, None, None, None, None, 1.0, False,
                                            "bhld", results[4], results[5]),
        "attention op": lambda: ops.attention(*leaves, *args),
    }


def op_times(q, k, v, dout, iters):
    """The host's ms per call of op_calls: what the ops cost, told from what autograd adds."""
    return tuple(host_ms(fn, iters) for fn in op_calls(q, k, v, dout).values())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=SHAPES, help='"B,H,L,E,M;..."')
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--baseline-profile", action="store_true", help="also profile the three-leaf builtin")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    for shape in args.shapes.split(";"):
        B, H, L, E, M = (int(x) for x in shape.split(","))
        q, k, v, dout = make_case(B, H, L, E, M, dtype, "cuda")
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]

        def forward():
            with torch.no_grad():
                return fast_causal_attn.causal_dot_product(q, k, v)

        def forward_with_graph():
            return fast_causal_attn.causal_dot_product(*leaves)

        def forward_backward():
            return torch.autograd.grad(fast_causal_attn.causal_dot_product(*leaves), leaves, dout)

        print(f"\n{args.dtype} {B},{H},{L},{E},{M}: host ms per call: forward "
              f"{host_ms(forward, args.iters):.3f}, forward with autograd {host_ms(forward_with_graph, args.iters):.3f}, "
              f"forward+backward {host_ms(forward_backward, args.iters):.3f}")
        builtin, builtin3, python = baselines(v, dout, args.iters)
        print(f"  baselines, fwd+bwd host ms per call: builtin op {builtin:.3f}, builtin of three leaves "
              f"(addcmul) {builtin3:.3f}, Python Function {python:.3f}")
        forward_op, backward_op, attention_op = op_times(q, k, v, dout, args.iters)
        print(f"  the ops alone, host ms per call: forward {forward_op:.3f}, backward {backward_op:.3f}, "
              f"attention (forward with its autograd node) {attention_op:.3f}")
        profiled(forward_backward, args.iters, args.top, "forward+backward")
        if args.baseline_profile:
            profiled(three_leaves(v, dout), args.iters, args.top, "addcmul's forward+backward")

if __name__ == "__main__":
    main()
