"""Build of the fast_causal_attn extension.

Builds the CUDA extension when a CUDA toolkit and a CUDA build of torch are both present, and a
CPU-only extension otherwise. FAST_CAUSAL_ATTN_BUILD=cpu or =cuda forces either (cuda fails loudly
when it cannot be built). TORCH_CUDA_ARCH_LIST and MAX_JOBS are honoured as torch's
cpp_extension honours them; where TORCH_CUDA_ARCH_LIST is unset, the build is for the visible GPUs,
with compute capability 9.0 (H100, H200) as 9.0a (see cuda_arch_list).
"""
import glob
import os
import shlex
import subprocess
import sys

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def want_cuda() -> bool:
    forced = os.environ.get("FAST_CAUSAL_ATTN_BUILD", "").strip().lower()
    if forced not in ("", "cpu", "cuda"):
        raise RuntimeError(f"FAST_CAUSAL_ATTN_BUILD must be 'cpu' or 'cuda', got {forced!r}")
    available = torch.version.cuda is not None and CUDA_HOME is not None
    if forced == "cuda" and not available:
        raise RuntimeError(
            "FAST_CAUSAL_ATTN_BUILD=cuda needs a CUDA build of torch "
            f"(torch.version.cuda = {torch.version.cuda}) and a CUDA toolkit (CUDA_HOME = {CUDA_HOME})"
        )
    return available if forced == "" else forced == "cuda"


def cxx_standard() -> str:
    """The C++ standard torch's headers ask for: C++20 from torch 2.14 on (ATen.h refuses older)."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return "-std=c++20" if (major, minor) >= (2, 14) else "-std=c++17"


def shared_cxx_runtime() -> list:
    """Link arguments that keep libstdc++ shared, as torch has it.

    A toolchain that finds only libstdc++.a (the H200 machine's /opt/gcc wrapper does: its
    `-print-file-name=libstdc++.so` answers a bare name) copies a second C++ runtime into _C.so.
    Two runtimes in one process crashed there (SIGSEGV in locale code) on the first error message
    that formatted a number. Then the shared libstdc++ this process (torch) has loaded is named on
    the link line, ahead of the compiler's own -lstdc++, so nothing is taken from the archive.
    """
    if not sys.platform.startswith("linux"):
        return []
    compiler = shlex.split(os.environ.get("CXX", "c++"))
    try:
        found = subprocess.run(compiler + ["-print-file-name=libstdc++.so"], capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return []  # the build itself will say what is wrong with the compiler
    if os.path.isabs(found):
        return []  # the toolchain links the shared runtime on its own
    with open("/proc/self/maps") as maps:
        loaded = sorted({line.split()[-1] for line in maps if "/libstdc++.so" in line})
    if not loaded:
        raise RuntimeError(f"{compiler[0]} would link libstdc++ statically, and no shared libstdc++ is loaded "
                           "to link instead; set CXX to a compiler that finds libstdc++.so")
    return loaded[:1]


def cuda_arch_list() -> str:
    """TORCH_CUDA_ARCH_LIST as given. Where it is unset and a visible GPU is of compute capability
    9.0 (H100, H200): the visible GPUs' archs with 9.0 built as 9.0a, set in the environment for
    the build. sm_90a code runs on compute capability 9.0 alone, and there the wgmma kernels
    (csrc/cuda/wgmma_product.cuh, wgmma_tf32_product.cuh) are the faster path: a build on such a machine takes it without
    being asked. Otherwise unset stays unset: torch's own choice (no 9.0a)."""
    given = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if given is None and torch.cuda.is_available():
        archs = sorted({"%d.%d" % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
        if "9.0" in archs:
            given = ";".join("9.0a" if arch == "9.0" else arch for arch in archs)
            os.environ["TORCH_CUDA_ARCH_LIST"] = given
    return given or ""


def extension():
    rel = lambda pattern: sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))
    sources = rel("csrc/*.cpp") + rel("csrc/cpu/*.cpp")
    cxx = ["-O3", cxx_standard(), "-fopenmp", "-DPy_LIMITED_API=0x03090000"]
    if want_cuda():
        sources += rel("csrc/cuda/*.cu") + rel("csrc/cuda/*.cpp")
        # No --use_fast_math: its approximate division and flushed denormals would bend the
        # exact-fp32 promise (the normalizer divides every output).
        nvcc = ["-O3", cxx_standard(), "-lineinfo", "-DFAST_CAUSAL_ATTN_WITH_CUDA"]
        # The wgmma kernels (csrc/cuda/wgmma_*.cuh) need sm_90a code: built, and taken on
        # devices of compute capability 9.0, when the arch list holds 9.0a.
        archs = cuda_arch_list().replace(" ", ";").split(";")
        if any(arch.strip().startswith("9.0a") for arch in archs):
            nvcc.append("-DFAST_CAUSAL_ATTN_SM90A")
        return CUDAExtension(
            "fast_causal_attn._C",
            sources,
            extra_compile_args={"cxx": cxx + ["-DFAST_CAUSAL_ATTN_WITH_CUDA"], "nvcc": nvcc},
            extra_link_args=["-fopenmp"] + shared_cxx_runtime(),
            py_limited_api=True,
        )
    return CppExtension(
        "fast_causal_attn._C",
        sources,
        extra_compile_args={"cxx": cxx},
        extra_link_args=["-fopenmp"] + shared_cxx_runtime(),
        py_limited_api=True,
    )


# (setuptools runs this file as __main__; the tests and benchmarks/offline_nvcc.sh import it for
# cxx_standard, without building)
if __name__ == "__main__":
    setup(
        ext_modules=[extension()],
        cmdclass={"build_ext": BuildExtension},
        options={"bdist_wheel": {"py_limited_api": "cp39"}},
    )
