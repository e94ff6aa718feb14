"""Whether compute-sanitizer's racecheck follows the wgmma kernels' stage ring (named barriers: the
producer's bar.arrive announcing a slot, the consumers' bar.arrive releasing it; see
benchmarks/racecheck_probe.cu), on a kernel that is that protocol alone:

    compute-sanitizer --tool racecheck python benchmarks/racecheck_probe.py   # builds it (about 40 s)

Each variant's consumers' sums are checked against the source (a wrong sum: the ring itself is
broken); racecheck's summary then says whether it reports the correct protocol as racy.
"""
import torch

from wgmma_probe import build_sm90a

VARIANTS = ("st.shared", "cp.async", "cp.async + fence.proxy.async", "cp.async + the four-atom exchange")
WORDS, THREADS = 1024, 128


def main():
    module = build_sm90a("racecheck_probe", "racecheck_probe.cu")
    chunks = 10  # more than the three slots: each slot refilled after its release
    source = torch.randn(chunks * WORDS, device="cuda")
    words = source.view(chunks, WORDS).sum(0)  # each word summed over the chunks
    expected = torch.stack([words[(t + 37) % THREADS::THREADS].sum() for t in range(THREADS)]).cpu()
    # the exchange's: thread t reads lane (t + 5) % 32's words of its warp, written as chunk + i + writer
    readers = torch.arange(THREADS)
    writers = (readers // 32) * 32 + (readers % 32 + 5) % 32
    exchanged = sum(float(c + i) for c in range(chunks) for i in range(4)) + 4 * chunks * writers.float()
    for groups in (1, 2):  # consumer warpgroups: the one-group and two-group layouts' barrier counts
        for variant, name in enumerate(VARIANTS):
            if variant == 3 and groups == 1:
                continue
            got = module.run(source, chunks, variant, groups).cpu()
            want = torch.cat([expected.repeat(groups), exchanged if variant == 3 else torch.zeros(THREADS)])
            ok = torch.allclose(got, want, rtol=1e-5, atol=1e-4)
            print(f"{groups} consumer warpgroup(s), variant {variant} ({name}): sums {'match' if ok else 'DIFFER'}")


if __name__ == "__main__":
    main()
