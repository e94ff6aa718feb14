"""The one-pass 16-bit backward prototype (one_pass_backward.cu) checked and timed on an sm_90a GPU.

JIT-builds the prototype alone (sm_90a, the library's headers), checks dq, dk and dv against
float64 beside the library's own backward on the same inputs (q, k ~ N(0, 1/E), v, dO ~ N(0, 1)),
then times both (and the library's forward with and without its final state, which the one pass
would need kept): the device time of a call (every kernel summed, torch's profiler) and the do_bench
median, with the HBM floor (q, k, v, dO read, dq, dk, dv written) at the copy bandwidth measured in
the same run. The prototype runs one block a (batch, head) pair, the whole sequence in one segment:
it is the library's shape of work only where the pairs fill the multiprocessors (8,16,2048,64: 128
pairs), so the timed shapes say where the design pays before it takes segments.

    python benchmarks/experiments/one_pass_backward/one_pass_backward.py [--time-only | --small] [--no-library]

--small: the first three checks alone, no timing (for compute-sanitizer: memcheck, racecheck, synccheck).
--no-library: without the package (no build of it needed): the final state from torch.einsum, each
error against a fixed bound (bf16 2.5e-3, fp16 3.5e-4: 1.5x the library's on the CPU), the prototype
timed alone (do_bench).

Exits 1 when any check fails (the prototype's error above 1.1x the library's plus 1e-4).
"""
import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
# the package (torch.ops.fast_causal_attn) and the benchmark's timers, unless --no-library
LIBRARY = "--no-library" not in sys.argv
if LIBRARY:
    import fast_causal_attn  # noqa: E402,F401
    from benchmark import copy_bandwidth, kernel_breakdown  # noqa: E402
BOUND = {torch.bfloat16: 2.5e-3, torch.float16: 3.5e-4}  # --no-library's


def build():
    from torch.utils.cpp_extension import load

    os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0a"
    return load("one_pass_backward", [os.path.join(HERE, "one_pass_backward.cu")],
                extra_include_paths=[os.path.join(ROOT, "csrc", "cuda"), os.path.join(ROOT, "csrc")],
                extra_cuda_cflags=["-O3", "-lineinfo", "-DFAST_CAUSAL_ATTN_WITH_CUDA", "-DFAST_CAUSAL_ATTN_SM90A"],
                verbose=False)


def inputs(B, H, L, E, M, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, E, generator=g) / E**0.5
    k = torch.randn(B, H, L, E, generator=g) / E**0.5
    v = torch.randn(B, H, L, M, generator=g)
    dout = torch.randn(B, H, L, M, generator=g)
    return [x.to("cuda", dtype) for x in (q, k, v, dout)]


def forward(q, k, v, scale):
    """The library's forward with its final state (float32 [B, H, E, M]) and kept segment starts
    (--no-library: the final state alone, from torch.einsum)."""
    if not LIBRARY:
        return None, torch.einsum("bhle,bhlm->bhem", k.float(), v.float()), None
    out, _, final_kv, _, segment_kv, _ = torch.ops.fast_causal_attn.forward(q, k, v, None, None, None, scale, False,
                                                                           1e-6, "bhld", True, True)
    return out, final_kv, segment_kv


def segment_states(q, k, v, dout, segments):
    """(segment_len, kv_end [B, H, S, E, M], d_end [B, H, S, M, E]): each time segment's end state
    (the sum of k^T v up to its end) and D there (the sum of dO^T q over the segments after it), in
    float32 from torch: what a forward keeping its segments' ends and a reverse scan of dO^T q would
    give the segmented one pass (its launch's inputs; not timed)."""
    L = q.shape[2]
    segment_len = -(-L // (64 * segments)) * 64
    own_kv, own_d = [], []
    for j in range(segments):
        part = slice(j * segment_len, min(L, (j + 1) * segment_len))
        own_kv.append(torch.einsum("bhle,bhlm->bhem", k[:, :, part].float(), v[:, :, part].float()))
        own_d.append(torch.einsum("bhlm,bhle->bhme", dout[:, :, part].float(), q[:, :, part].float()))
    own_d = torch.stack(own_d, 2)
    later = own_d.flip(2).cumsum(2).flip(2) - own_d
    return segment_len, torch.stack(own_kv, 2).cumsum(2).contiguous(), later.contiguous()


def launcher(module, q, k, v, dout, segments, scale=1.0, final_kv=None):
    """The prototype's launch alone, its inputs made first: in one segment from final_kv (the
    library's forward's; else torch.einsum's), or in `segments` from segment_states'."""
    B, H, L = q.shape[:3]
    if segments == 1:
        segment_len = -(-L // 64) * 64
        if final_kv is None:
            final_kv = torch.einsum("bhle,bhlm->bhem", k.float(), v.float())
        kv_end = final_kv.reshape(B, H, 1, q.shape[3], v.shape[3]).contiguous()
        d_end = torch.empty(0, device=q.device)
    else:
        segment_len, kv_end, d_end = segment_states(q, k, v, dout, segments)
    return lambda: module.one_pass_backward(q, k, v, dout, kv_end, d_end, segments, segment_len, scale)


def library_backward(q, k, v, dout, scale, segment_kv):
    return torch.ops.fast_causal_attn.backward(dout, None, None, q, k, v, None, None, None, None, None, scale, False,
                                               "bhld", segment_kv, None)[:3]


def exact_grads(q, k, v, dout, scale, pairs):
    """float64 dq, dk, dv of the first `pairs` (batch, head) pairs, [pairs, L, E or M]."""
    grads = [[], [], []]
    for i in range(pairs):
        qd, kd, vd, dd = (x.flatten(0, 1)[i].double() for x in (q, k, v, dout))
        scores = (qd @ kd.T).tril() * scale  # row t, column s <= t
        dscores = (dd @ vd.T).tril() * scale
        for out, x in zip(grads, (dscores @ kd, dscores.T @ qd, scores.T @ dd)):
            out.append(x)
    return [torch.stack(x) for x in grads]


def relative_error(x, exact):
    x = x.double()
    return ((x - exact).norm() / exact.norm()).item()


CHECKS = [  # B, H, L, E, M, scale, pairs checked against float64, segments
    (1, 1, 64, 64, 64, 1.0, 1, 1),
    (2, 3, 150, 64, 64, 1.0, 6, 1),  # a partial last chunk (22 rows)
    (1, 2, 1000, 64, 64, 0.125, 2, 1),
    (2, 2, 4100, 64, 64, 1.0, 4, 1),
    (1, 2, 300, 64, 32, 1.0, 2, 1),
    (1, 2, 300, 32, 64, 1.0, 2, 1),
    (1, 2, 333, 16, 16, 1.0, 2, 1),
    (8, 16, 2048, 64, 64, 1.0, 4, 1),
    (1, 2, 16384, 64, 64, 1.0, 2, 1),  # the state taken down over 256 chunks
    (1, 2, 1000, 64, 64, 0.7, 2, 4),  # segments: each from its end's D and T
    (2, 3, 333, 40, 24, 1.0, 6, 2),
    (2, 2, 4100, 64, 64, 1.0, 4, 3),
]
# B, H, L, E, M, segments: the prototype's shape of work (one segment where the pairs fill the
# multiprocessors), and segments enough for a block a multiprocessor where they do not
TIMED = [(8, 16, 2048, 64, 64, 1), (16, 16, 2048, 64, 64, 1), (8, 16, 4096, 64, 64, 1), (4, 16, 8192, 64, 64, 1),
         (4, 16, 8192, 64, 64, 2), (2, 4, 8192, 64, 64, 16), (1, 8, 16384, 64, 64, 16)]


def check(module, checks):
    failed = 0
    for dtype in (torch.bfloat16, torch.float16):
        for B, H, L, E, M, scale, pairs, segments in checks:
            q, k, v, dout = inputs(B, H, L, E, M, dtype)
            _, final_kv, segment_kv = forward(q, k, v, scale)
            ours = launcher(module, q, k, v, dout, segments, scale, final_kv)()
            library = library_backward(q, k, v, dout, scale, segment_kv) if LIBRARY else (None,) * 3
            torch.cuda.synchronize()
            exact = exact_grads(q, k, v, dout, scale, pairs)
            line = []
            for name, o, lib, x in zip(("dq", "dk", "dv"), ours, library, exact):
                err_o = relative_error(o.flatten(0, 1)[:pairs], x)
                if LIBRARY:
                    err_l = relative_error(lib.flatten(0, 1)[:pairs], x)
                    ok = err_o <= 1.1 * err_l + 1e-4
                    line.append(f"{name} {err_o:.2e} (library {err_l:.2e}){'' if ok else ' FAIL'}")
                else:
                    ok = err_o <= BOUND[dtype]
                    line.append(f"{name} {err_o:.2e}{'' if ok else ' FAIL'}")
                failed += not ok
            print(f"{str(dtype)[6:]:9} {B},{H},{L},{E},{M} scale {scale}, {segments} segment(s): " + "; ".join(line),
                  flush=True)
    return failed


def time_alone(module):
    """--no-library: the prototype's do_bench median beside its floor (a 1 GiB copy's bandwidth)."""
    import triton.testing

    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() * 4 / (triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200) * 1e-3)
    print(f"\ncopy bandwidth {bandwidth / 1e9:.1f} GB/s; the prototype's do_bench ms, x the backward's floor")
    for dtype in (torch.bfloat16, torch.float16):
        for B, H, L, E, M, segments in TIMED:
            q, k, v, dout = inputs(B, H, L, E, M, dtype)
            floor = B * H * L * (4 * E + 3 * M) * q.element_size() / bandwidth * 1e3
            ms = triton.testing.do_bench(launcher(module, q, k, v, dout, segments), warmup=25, rep=200)
            print(f"{str(dtype)[6:]:9} {B},{H},{L},{E},{M}, {segments} segment(s): {ms:.4f} ms, floor {floor:.4f}, "
                  f"{ms / floor:.2f}x", flush=True)


def time_shapes(module):
    import triton.testing

    bandwidth = copy_bandwidth("cuda")
    print(f"\ncopy bandwidth {bandwidth / 1e9:.1f} GB/s; ms: device time a call (do_bench median), x floor")
    for dtype in (torch.bfloat16, torch.float16):
        for B, H, L, E, M, segments in TIMED:
            q, k, v, dout = inputs(B, H, L, E, M, dtype)
            segment_kv = forward(q, k, v, 1.0)[2]
            # the floors: the backward reads q, k, v, dO and writes dq, dk, dv; the forward reads q, k, v, writes o
            floor = B * H * L * (4 * E + 3 * M) * q.element_size() / bandwidth * 1e3
            forward_floor = B * H * L * (2 * E + 2 * M) * q.element_size() / bandwidth * 1e3
            # the forward as autograd runs it now (segment starts kept), and with the final state
            # too, which the one pass would need kept
            runs = {f"one pass ({segments} segment(s))": launcher(module, q, k, v, dout, segments),
                    "library": lambda: library_backward(q, k, v, dout, 1.0, segment_kv),
                    "forward": lambda: torch.ops.fast_causal_attn.forward(q, k, v, None, None, None, 1.0, False, 1e-6,
                                                                          "bhld", False, True),
                    "forward + final state": lambda: forward(q, k, v, 1.0)}
            cells = []
            for name, fn in runs.items():
                device_ms, parts = kernel_breakdown(fn)
                bench = triton.testing.do_bench(fn, warmup=25, rep=200)
                kernels = ", ".join(f"{ms:.4f} {n.split('<')[0].split('(')[0][-28:]}" for ms, _, n in parts[:3])
                x = device_ms / (forward_floor if name.startswith("forward") else floor)
                cells.append(f"{name} {device_ms:.4f} ({bench:.4f}) {x:.2f}x [{kernels}]")
            print(f"{str(dtype)[6:]:9} {B},{H},{L},{E},{M} floors fwd {forward_floor:.4f} bwd {floor:.4f}:\n  "
                  + "\n  ".join(cells), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--time-only", action="store_true")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--no-library", action="store_true")
    args = parser.parse_args()
    module = build()
    failed = 0 if args.time_only else check(module, CHECKS[:3] if args.small else CHECKS)
    if not args.small:
        (time_shapes if LIBRARY else time_alone)(module)
    print(f"\n{failed} check(s) failed" if failed else "\nall checks passed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
