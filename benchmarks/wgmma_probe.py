"""Which shared-memory layouts and descriptor encodings wgmma (sm_90a) takes, checked on the GPU:
the groundwork of a wgmma port of the tensor-core kernels (issue 5: "wgmma on sm_90a if it pays").

A 64 x 64 by 64 x 64 bf16 product (one warpgroup, four m64n64k16 steps) against float64, for each
way the chunk products would feed it: A and B in shared memory K-major or MN-major (no swizzle,
8 x 16-byte core matrices), or A from registers in mma.sync's fragment layout (the masked scores).
Each storage is tried with the core matrices packed along K first or along M/N first, and with
the descriptor's two byte offsets in the PTX ISA's order (leading: along K) or swapped:

    python benchmarks/wgmma_probe.py            # builds benchmarks/wgmma_probe.cu for sm_90a

Variant 6 checks the E = 256 column-halves design's P V_g instead: both operands in the kernels'
128-byte swizzle, B MN-major, and an m64n32k16 on each 32-column half of B, its descriptor started
64 bytes into the tile for the second (RESULTS.md, eighty-third session).

Each variant runs in its own process, so that a faulting encoding does not stop the others.
"""
import itertools
import os
import subprocess
import sys

VARIANTS = {
    0: "A K-major,   B K-major",
    1: "A K-major,   B MN-major",
    2: "A MN-major,  B K-major",
    3: "A MN-major,  B MN-major",
    4: "A registers, B K-major",
    5: "A registers, B MN-major",
    6: "A K-major,   B MN-major, 128-byte swizzle, m64n32k16 on each half of B's 64 columns",
}
# (bytes between core matrices along K, along M/N): packed along K first, or along M/N first
STORAGES = [(128, 1024), (1024, 128)]


def build_sm90a(name, source, flags=()):
    """benchmarks/<source> JIT-built for sm_90a (wgmma needs the arch-specific target) as module name."""
    import torch.utils.cpp_extension

    os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0a"
    here = os.path.dirname(os.path.abspath(__file__))
    return torch.utils.cpp_extension.load(name, [os.path.join(here, source)], extra_cuda_cflags=["-O3", *flags],
                                          verbose=False)


def build_beside_library(name, source):
    """benchmarks/<source> built as build_sm90a does, with csrc/cuda's headers (the prototypes that
    take the library's wgmma helpers: columns256.cu, transposed256.cu)."""
    csrc = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "cuda")
    return build_sm90a(name, source, [f"-I{csrc}", "-DFAST_CAUSAL_ATTN_WITH_CUDA"])


def load():
    return build_sm90a("wgmma_probe", "wgmma_probe.cu")


def verdict_of(out, exact):
    """Whether the GPU's product matches float64's within float32 rounding, and by how much."""
    from baselines import max_relative_error  # (torch with it: imported where a variant runs)

    error = max_relative_error(out.cpu(), exact)
    return f"{'match' if error < 1e-5 else 'wrong'} (relative error {error:.2e})"


def run_variant(variant):
    import torch

    module = load()
    gen = torch.Generator().manual_seed(variant)
    a = torch.randn(64, 64, generator=gen).bfloat16()
    b = torch.randn(64, 64, generator=gen).bfloat16()
    if variant == 6:  # (b as V's chunk, [K][N]: each half of its columns, the descriptor 64 half bytes in)
        for half in (0, 1):
            out = module.probe_half_columns(a.cuda(), b.cuda(), half)
            verdict = verdict_of(out, a.double() @ b.double()[:, 32 * half:32 * half + 32])
            print(f"{VARIANTS[variant]}: columns {32 * half}-{32 * half + 31}: {verdict}", flush=True)
        return
    exact = a.double() @ b.double().T
    for (stride_k, stride_mn), swap in itertools.product(STORAGES, (0, 1)):
        out = module.probe(a.cuda(), b.cuda(), variant, stride_k, stride_mn, swap)
        offsets = f"leading {stride_mn if swap else stride_k:4}, stride {stride_k if swap else stride_mn:4}"
        verdict = verdict_of(out, exact)
        print(f"{VARIANTS[variant]}  core matrices {stride_k:4} B along K, {stride_mn:4} B along M/N; "
              f"descriptor {offsets}: {verdict}", flush=True)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--variant":
        run_variant(int(sys.argv[2]))
        return
    load()  # build once, before the variants' processes
    for variant in VARIANTS:
        done = subprocess.run([sys.executable, __file__, "--variant", str(variant)], capture_output=True, text=True)
        sys.stdout.write(done.stdout)
        if done.returncode != 0:
            print(f"{VARIANTS[variant]}: exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")


if __name__ == "__main__":
    main()
