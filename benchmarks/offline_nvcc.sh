# Sourced by sass_offline.sh and ptxas_offline.sh: the flags that compile a unit of csrc/cuda
# against torch's headers without a GPU (nvcc here, the headers of the installed torch), in
# $offline_includes.
shim=/tmp/sass_shim/c10/cuda/impl  # the CMake-generated header a pip torch lacks
mkdir -p $shim && printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' >$shim/cuda_cmake_macros.h
offline_includes="-I/tmp/sass_shim $(python -c "import torch.utils.cpp_extension as c; print(' '.join('-I' + p for p in c.include_paths()))")"
offline_includes+=" -I$(python -c "import sysconfig; print(sysconfig.get_paths()['include'])") -DFAST_CAUSAL_ATTN_WITH_CUDA"
# the C++ standard the installed torch's headers need: setup.py's own rule (C++20 from torch 2.14 on)
offline_std=$(python -c "import sys; sys.path.insert(0, '.'); from setup import cxx_standard; print(cxx_standard())")
