"""Checks and times benchmarks/stream_probe.cu: blocks shaped like the tensor-core kernels'
state-only launch streaming their k and v chunks with no products, by cp.async (16 bytes a thread,
as the kernels do) or by bulk copies (sm_90's one-dimensional TMA copy), at 2-6 chunk slots:

    python benchmarks/stream_probe.py

bf16 [pairs, L, 64] contiguous. Each case is checked against torch (the xor of the vectors each
thread reads), then timed (do_bench median) beside the copy bandwidth measured here.

    python benchmarks/stream_probe.py --layouts           # cp.async into four shared-memory layouts
    bash benchmarks/l2_requests.sh stream_kernel python benchmarks/stream_probe.py --layouts --once

--layouts: the cp.async copies (3 and 4 slots) landing contiguous, in rows padded to 144 bytes
(the mma.sync kernels' ldmatrix rows), in wgmma's 128-byte swizzle, or in the unswizzled
core-matrix layout; --once launches each case once and times nothing (for ncu).
"""
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from wgmma_probe import build_sm90a  # noqa: E402

# (name, pairs, L, segments, chunks a segment): the bf16 8,16,2048,64 forward's state-only launch
# (2 segments of 11 chunks: 256 blocks), its heads and tails' share (384 blocks of 7), one block a
# multiprocessor (128 blocks of 16), and every slot of three a multiprocessor (384 blocks of 10)
CASES = [("state-only 8,16,2048,64", 128, 2048, 2, 11), ("384 blocks of 7", 128, 2048, 3, 7),
         ("128 blocks of 16", 128, 2048, 1, 16), ("384 blocks of 10", 128, 2048, 3, 10),
         ("4,16,8192,64 state-only", 64, 8192, 5, 22)]


def expected(k, v, segments, chunks):
    """The xor the kernel writes: block (pair, segment), thread t, over the segment's chunks, of
    vector t of each chunk of k and of v."""
    pairs, L, _ = k.shape
    kv = [x.view(torch.int32).reshape(pairs, L // 64, 512, 4)[:, :, :128] for x in (k, v)]
    out = torch.zeros(pairs, segments, 128, 4, dtype=torch.int32, device=k.device)
    for s in range(segments):
        for c in range(s * chunks, (s + 1) * chunks):
            out[:, s] ^= kv[0][:, c] ^ kv[1][:, c]
    return out.reshape(pairs * segments, 128, 4)


LAYOUTS = ["contiguous", "padded 144", "swizzled", "core matrices"]


def layouts(module, once):
    """The cp.async copies into each shared-memory layout: checked, then timed (or launched once)."""
    from triton.testing import do_bench

    for name, pairs, L, segments, chunks in CASES[2:]:
        k = torch.randn(pairs, L, 64, device="cuda").bfloat16()
        v = torch.randn(pairs, L, 64, device="cuda").bfloat16()
        want = expected(k, v, segments, chunks)
        nbytes = pairs * segments * chunks * 2 * 64 * 64 * 2
        line = [f"{name:26} {pairs * segments:4} blocks, {nbytes / 1e6:5.1f} MB:"]
        for stages in (3, 4):
            for layout, layout_name in enumerate(LAYOUTS):
                out = module.stream(k, v, chunks, segments, stages, False, layout)
                assert torch.equal(out, want), f"{name}: wrong data, {layout_name}, stages={stages}"
                if once:
                    continue
                ms = do_bench(lambda: module.stream(k, v, chunks, segments, stages, False, layout), warmup=25, rep=200)
                line.append(f"{layout_name} {stages}: {ms * 1e3:5.1f} us {nbytes / ms / 1e9:4.2f} TB/s")
        print(line[0])
        for i in range(1, len(line), 4):
            print("    " + "; ".join(line[i:i + 4]))


def main():
    from triton.testing import do_bench

    module = build_sm90a("stream_probe", "stream_probe.cu")
    if "--layouts" in sys.argv:
        layouts(module, "--once" in sys.argv)
        return
    big = torch.empty(2**28, dtype=torch.int32, device="cuda")
    copy_ms = do_bench(lambda: big.clone(), warmup=50, rep=300)
    bandwidth = 2 * big.numel() * 4 / copy_ms / 1e9  # TB/s, read + write
    print(f"copy bandwidth {bandwidth:.2f} TB/s (read + write)")
    for name, pairs, L, segments, chunks in CASES:
        k = torch.randn(pairs, L, 64, device="cuda").bfloat16()
        v = torch.randn(pairs, L, 64, device="cuda").bfloat16()
        want = expected(k, v, segments, chunks)
        nbytes = pairs * segments * chunks * 2 * 64 * 64 * 2
        line = [f"{name:26} {pairs * segments:4} blocks, {nbytes / 1e6:5.1f} MB (floor {nbytes / bandwidth / 1e6:5.1f} us):"]
        for bulk in (False, True):
            for stages in (2, 3, 4, 6):
                out = module.stream(k, v, chunks, segments, stages, bulk)
                assert torch.equal(out, want), f"{name}: wrong data, bulk={bulk} stages={stages}"
                ms = do_bench(lambda: module.stream(k, v, chunks, segments, stages, bulk), warmup=25, rep=200)
                line.append(f"{'bulk' if bulk else 'cp.async'} {stages}: {ms * 1e3:5.1f} us {nbytes / ms / 1e9:4.2f} TB/s")
        print(line[0])
        for i in range(1, len(line), 4):
            print("    " + "; ".join(line[i:i + 4]))


if __name__ == "__main__":
    main()
