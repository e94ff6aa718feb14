"""How many blocks the GPU runs at once in thread-block clusters of 1, 2, 4 and 8, each block the
size of the wgmma kernels' at four atoms (benchmarks/cluster_probe.cu says why):

    python benchmarks/cluster_probe.py
    python benchmarks/cluster_probe.py --smem 212992 --threads 384 --blocks 256

For each cluster size: cudaOccupancyMaxActiveClusters (times the size: blocks), then `blocks`
blocks that each spin --spin-us microseconds, from their records the most running at once, the
multiprocessors they used and the launch's span in units of one block's spin (its waves).
"""
import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from wgmma_probe import build_sm90a  # noqa: E402


def most_at_once(record):
    """The most blocks whose [start, end) intervals overlap, from [blocks, 3] records."""
    events = sorted([(int(s), 1) for s in record[:, 1]] + [(int(e), -1) for e in record[:, 2]],
                    key=lambda x: (x[0], x[1]))  # an end before a start at the same instant
    running = most = 0
    for _, step in events:
        running += step
        most = max(most, running)
    return most


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smem", type=int, default=224 * 1024, help="dynamic shared memory a block (bytes)")
    parser.add_argument("--threads", type=int, default=384, help="threads a block")
    parser.add_argument("--blocks", type=int, default=0, help="blocks launched (default: two a multiprocessor, "
                        "rounded down to a multiple of 8)")
    parser.add_argument("--spin-us", type=float, default=200.0, help="each block's spin")
    parser.add_argument("--sizes", default="1,2,4,8", help="cluster sizes")
    args = parser.parse_args()

    module = build_sm90a("cluster_probe", "cluster_probe.cu")
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    blocks = args.blocks or (2 * sms) // 8 * 8
    print(f"{props.name}: {sms} multiprocessors; blocks of {args.threads} threads and {args.smem} bytes of "
          f"shared memory; {blocks} blocks launched, each spinning {args.spin_us} us", flush=True)
    spin_ns = int(args.spin_us * 1000)
    module.run(8, 1, args.threads, args.smem, 1000)  # (a first launch: the module's setup out of the way)
    torch.cuda.synchronize()
    for size in (int(s) for s in args.sizes.split(",")):
        try:
            clusters = module.max_active_clusters(size, args.threads, args.smem)
        except RuntimeError as error:
            print(f"cluster of {size}: cudaOccupancyMaxActiveClusters refused ({error})", flush=True)
            continue
        n = blocks // size * size
        record = module.run(n, size, args.threads, args.smem, spin_ns)
        torch.cuda.synchronize()
        record = record.cpu()
        span = (record[:, 2].max() - record[:, 1].min()).item() / spin_ns
        used = len(set(record[:, 0].tolist()))
        print(f"cluster of {size}: the driver's {clusters} clusters at once = {clusters * size} blocks; measured "
              f"{most_at_once(record)} of {n} blocks at once on {used} multiprocessors, the launch {span:.2f} "
              f"spins long", flush=True)


if __name__ == "__main__":
    main()
