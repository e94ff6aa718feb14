#!/usr/bin/env bash
# ptxas -v of float32's wgmma kernel instances for sm_90a, without a GPU: registers, spills and
# the wgmma serialization warnings (C7510-C7520; C7519, a warpgroup.arrive ptxas added, left
# out), for trying a change's register budget before a device run.
#
#   bash benchmarks/ptxas_offline.sh                          # every pass, 3xTF32 and TF32
#   PASSES="Forward GradK" SPLITS=true bash benchmarks/ptxas_offline.sh
#
# Needs nvcc and torch's headers (as sass_offline.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
shim=/tmp/sass_shim/c10/cuda/impl  # the CMake-generated header a pip torch lacks
mkdir -p $shim && printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' >$shim/cuda_cmake_macros.h
includes=$(python -c "import torch.utils.cpp_extension as c; print(' '.join('-I' + p for p in c.include_paths()))")
python_include=$(python -c "import sysconfig; print(sysconfig.get_paths()['include'])")
unit=csrc/cuda/zz_ptxas_offline.cu  # the explicit instances, removed after
trap 'rm -f "$unit"' EXIT
{
  echo '#include "wgmma_launch.cuh"'
  echo 'namespace fast_causal_attn { namespace cuda {'
  for pass in ${PASSES:-Forward GradQ GradK GradV}; do
    for split in ${SPLITS:-true false}; do
      echo "template __global__ void wgmma_tf32_product_kernel<Pass::$pass, $split>(const KernelParams, int64_t, int64_t, int64_t);"
    done
  done
  echo '}}'
} >"$unit"
nvcc -std=c++17 -O3 -arch=sm_90a -DFAST_CAUSAL_ATTN_SM90A -DFAST_CAUSAL_ATTN_WITH_CUDA -cubin -Xptxas -v -w \
  -I/tmp/sass_shim $includes -I"$python_include" "$unit" -o /tmp/zz_ptxas_offline.cubin 2>&1 |
  grep -v C7519 | grep -E "C75|Compiling entry|spill|Used" | python -c "
import re, sys
passes = ['Forward', 'GradQ', 'GradK', 'GradV', 'GradKV']  # kernel_common.cuh's Pass
for line in sys.stdin:
    kernel = re.search(r'Compiling entry.*PassE(\d)ELb(\d)E', line)
    if kernel:
        print('wgmma_tf32_product_kernel<%s, %s>' % (passes[int(kernel[1])], '3xTF32' if kernel[2] == '1' else 'TF32'))
    else:
        print('   ', line.replace('ptxas info    : ', '').strip())
"
