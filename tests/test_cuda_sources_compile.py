"""Every CUDA source compiles for sm_90a with the wgmma kernel (FAST_CAUSAL_ATTN_SM90A, as setup.py
builds when TORCH_CUDA_ARCH_LIST holds 9.0a; the mma.sync kernels compile in the same pass), also
on a machine with no GPU (CI): nvcc against the installed torch's headers. Skipped where there is
no nvcc."""
import concurrent.futures
import glob
import importlib.util
import os
import shutil
import subprocess
import sysconfig
import tempfile

import pytest
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = sorted(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")))


def _setup_module():
    """setup.py as a module (its setup() runs only as __main__): its build rules, not a copy."""
    spec = importlib.util.spec_from_file_location("fast_causal_attn_setup", os.path.join(ROOT, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cxx_standard = _setup_module().cxx_standard  # C++20 from torch 2.14 on, whose headers refuse older


def nvcc_path():
    home = cpp_extension.CUDA_HOME
    candidate = os.path.join(home, "bin", "nvcc") if home else None
    return candidate if candidate and os.path.exists(candidate) else shutil.which("nvcc")


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc is not available")
def test_cuda_sources_compile_for_sm90a():
    assert SOURCES, "no CUDA sources found"
    with tempfile.TemporaryDirectory() as tmp:
        # A CPU build of torch ships the CUDA headers but not this generated one.
        shim = os.path.join(tmp, "shim", "c10", "cuda", "impl")
        os.makedirs(shim)
        with open(os.path.join(shim, "cuda_cmake_macros.h"), "w") as f:
            f.write("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        includes = [f"-I{p}" for p in cpp_extension.include_paths()]
        includes += [f"-I{sysconfig.get_paths()['include']}", f"-I{os.path.join(tmp, 'shim')}"]

        def compile_one(src):
            obj = os.path.join(tmp, os.path.basename(src) + ".o")
            cmd = [nvcc_path(), "-c", src, "-o", obj, cxx_standard(), "-O3", "-gencode=arch=compute_90a,code=sm_90a",
                   "-DFAST_CAUSAL_ATTN_WITH_CUDA", "-DFAST_CAUSAL_ATTN_SM90A", *includes]
            result = subprocess.run(cmd, capture_output=True, text=True)
            return src, result.returncode, result.stderr[-3000:]

        workers = max(1, min(len(SOURCES), os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            failures = [(s, err) for s, rc, err in pool.map(compile_one, SOURCES) if rc != 0]
    assert not failures, "\n\n".join(f"{os.path.relpath(s, ROOT)}:\n{err}" for s, err in failures)
