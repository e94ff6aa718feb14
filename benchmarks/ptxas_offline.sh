#!/usr/bin/env bash
# ptxas -v of float32's wgmma kernel instances for sm_90a, without a GPU: registers, spills and
# the wgmma serialization warnings (C7510-C7520; C7519, a warpgroup.arrive ptxas added, left
# out), for trying a change's register budget before a device run.
#
#   bash benchmarks/ptxas_offline.sh                          # every pass, 3xTF32 and TF32
#   PASSES="Forward GradK" SPLITS=true PARTS=2 bash benchmarks/ptxas_offline.sh
#
# Needs nvcc and torch's headers (benchmarks/offline_nvcc.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/offline_nvcc.sh
unit=csrc/cuda/zz_ptxas_offline.cu  # the explicit instances, removed after
trap 'rm -f "$unit"' EXIT
{
  echo '#include "wgmma_launch.cuh"'
  echo 'namespace fast_causal_attn { namespace cuda {'
  for pass in ${PASSES:-Forward GradQ GradK GradV}; do
    for split in ${SPLITS:-true false}; do
      for parts in ${PARTS:-1 2}; do  # row tiles of 64 and 128 of the state's rows
        echo "template __global__ void wgmma_tf32_product_kernel<Pass::$pass, $split, $parts>(const KernelParams, int64_t, int64_t, int64_t);"
      done
    done
  done
  echo '}}'
} >"$unit"
nvcc $offline_std -O3 -arch=sm_90a -DFAST_CAUSAL_ATTN_SM90A -cubin -Xptxas -v -w $offline_includes "$unit" \
  -o /tmp/zz_ptxas_offline.cubin 2>&1 |
  grep -v C7519 | grep -E "C75|Compiling entry|spill|Used" | python -c "
import re, sys
passes = ['Forward', 'GradQ', 'GradK', 'GradV', 'GradKV']  # kernel_common.cuh's Pass
for line in sys.stdin:
    kernel = re.search(r'Compiling entry.*PassE(\d)ELb(\d)ELi(\d)E', line)
    if kernel:
        print('wgmma_tf32_product_kernel<%s, %s, %s rows>' % (passes[int(kernel[1])], 'heads and tails' if kernel[2] == '1' else 'heads', 64 * int(kernel[3])))
    else:
        print('   ', line.replace('ptxas info    : ', '').strip())
"
