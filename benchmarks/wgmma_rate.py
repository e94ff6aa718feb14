"""How fast wgmma runs on this GPU by N, by where A comes from, and beside other shared-memory
traffic (benchmarks/wgmma_rate.cu): the ceiling the chunk kernels' m64n64k16 products meet.

    python benchmarks/wgmma_rate.py               # builds wgmma_rate.cu for sm_90a (about 90 s)

For each variant: each warpgroup's multiply-adds a cycle (clock64 over its rounds, the median
warpgroup of one block a multiprocessor), the block's, and the block's as a percentage of the
dense bf16 peak (2048 multiply-adds a cycle a multiprocessor: 989 TFLOPS at 1.83 GHz on 132);
the shared-memory bytes the products read a cycle (A, unless from registers, and B, each k16
step) and the stores beside them.
"""
import argparse
import statistics

import torch

from wgmma_probe import build_sm90a

PEAK = 2048  # dense bf16 multiply-adds a cycle a multiprocessor


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4096)
    args = parser.parse_args()
    module = build_sm90a("wgmma_rate", "wgmma_rate.cu")
    blocks = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}: {blocks} blocks, {args.rounds} rounds")
    print("variant                                   MAC/clk a warpgroup  MAC/clk a block  % of peak"
          "  smem B/clk read  stored")
    for variant in range(module.variants):  # (each variant's parameters: wgmma_rate.cu's run)
        module.run(variant, blocks, 16)  # warm-up (clocks up)
        measured = module.run(variant, blocks, args.rounds)
        n, groups, stored = measured.n, measured.groups, measured.stored_bytes
        cycles = statistics.median(measured.cycles)
        steps = args.rounds * measured.accumulators * 4  # k16 steps a warpgroup
        per_group = steps * 64 * n * 16 / cycles
        per_block = per_group * groups
        read = groups * steps * ((0 if measured.register_a else 64 * 16 * 2) + n * 16 * 2) / cycles
        name = (f"m64n{n}k16 A from {'registers' if measured.register_a else 'smem     '}, {groups} wg x "
                f"{measured.accumulators} acc")
        if stored:
            name += f", +{stored // 1024} KB stores"
        print(f"{name:42s} {per_group:10.0f}          {per_block:10.0f}     {100 * per_block / PEAK:6.1f}"
              f"     {read:10.1f}      {stored * args.rounds / cycles:6.1f}", flush=True)


if __name__ == "__main__":
    main()
