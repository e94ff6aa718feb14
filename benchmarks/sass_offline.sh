#!/usr/bin/env bash
# SASS of one tensor-core kernel instance for sm_90, without a GPU: where its chunk loop's
# instructions go, by source line (benchmarks/sass_loop.py).
#
#   bash benchmarks/sass_offline.sh bfloat16 64 64 Forward    # dtype DA NB pass (mma.sync)
#   bash benchmarks/sass_offline.sh wgmma bfloat16 2 2 Forward
#                       # wgmma_product_kernel<pass, dtype, atoms, groups> for sm_90a: its chunk
#                       # loop's instructions by opcode and line (the passes are bound by each
#                       # warp's instructions a chunk: RESULTS.md, thirtieth session, call 5)
#   bash benchmarks/sass_offline.sh tf32 Forward [tf32]
#                       # wgmma_tf32_product_kernel<pass, 3xTF32> (float32's; with tf32: the
#                       # heads alone, TF32)
#   bash benchmarks/sass_offline.sh grad_kv bfloat16 [wide|one_pass|one_pass_normalize|one_pass_dots]
#                       # wgmma_grad_kv_kernel (E, M up to 64) or, with wide, the wide kernel
#                       # (up to 128): dk with dv in one pass; one_pass: the one-pass backward
#                       # (dq beside), plain or normalized (the loop with the most HGMMA: dk-dv's);
#                       # one_pass_dots: the normalized one whose producer makes dO . O
#
# Needs nvcc and torch's headers (the build's); nvdisasm comes from PyPI's nvidia-cuda-nvdisasm
# wheel (no CUDA toolkit here has it), unpacked once into /tmp/nvdisasm.
set -euo pipefail
cd "$(dirname "$0")/.."
family=tensorcore
if [[ ${1:-} == wgmma || ${1:-} == grad_kv ]]; then family=$1; shift; fi
if [[ ${1:-} == tf32 ]]; then family=tf32; split=$([[ ${3:-} == tf32 ]] && echo false || echo true); set -- float32 0 0 "${2:-Forward}"; fi
dtype=${1:-bfloat16} DA=${2:-64} NB=${3:-64} pass=${4:-Forward}  # wgmma: DA atoms, NB groups
case $dtype in
  bfloat16) T=at::BFloat16 ;; float16) T=at::Half ;; float32) T=float ;;
  *) echo "dtype: bfloat16, float16 or float32" >&2; exit 2 ;;
esac
tool=/tmp/nvdisasm/nvidia/cu13/bin/nvdisasm
if [[ ! -x $tool ]]; then
  pip download -q --no-deps -d /tmp/nvdisasm nvidia-cuda-nvdisasm 2>/dev/null
  python -m zipfile -e /tmp/nvdisasm/nvidia_cuda_nvdisasm-*.whl /tmp/nvdisasm/
  chmod +x "$tool"
fi
tag=${family}_${dtype}_${DA}_${NB}_${pass}
unit=csrc/cuda/zz_sass_$tag.cu  # one explicit instance, removed after
trap 'rm -f "$unit"' EXIT
if [[ $family == tf32 ]]; then
  include=wgmma_launch.cuh arch="-arch=sm_90a -DFAST_CAUSAL_ATTN_SM90A" kernel=wgmma_tf32_product_kernel
  instance="template __global__ void wgmma_tf32_product_kernel<Pass::$pass, $split>(const KernelParams, int64_t, int64_t, int64_t);"
elif [[ $family == grad_kv ]]; then
  include=wgmma_launch.cuh arch="-arch=sm_90a -DFAST_CAUSAL_ATTN_SM90A" source=wgmma_product
  case $DA in
    wide) kernel=wgmma_grad_kv_wide_kernel args="$T" ;;
    one_pass) kernel=wgmma_grad_kv_kernel args="$T, false, false, true" ;;
    one_pass_normalize) kernel=wgmma_grad_kv_kernel args="$T, false, true, true" ;;
    one_pass_dots) kernel=wgmma_grad_kv_kernel args="$T, false, true, true, true" ;;
    *) kernel=wgmma_grad_kv_kernel args="$T, false" ;;
  esac
  instance="template __global__ void $kernel<$args>(const KernelParams, int64_t, int64_t, int64_t);"
elif [[ $family == wgmma ]]; then
  include=wgmma_launch.cuh arch="-arch=sm_90a -DFAST_CAUSAL_ATTN_SM90A" kernel=wgmma_product_kernel
  instance="template __global__ void wgmma_product_kernel<Pass::$pass, $T, $DA, $NB, false>(const KernelParams, int64_t, int64_t, int64_t);"
else
  include=dispatch.cuh arch="-arch=sm_90" kernel=tensorcore_product_kernel
  instance="template ForwardSegments launch_tensorcore<Pass::$pass, $T, $DA, $NB>(const KernelParams&, int64_t, int64_t, cudaStream_t);"
fi
source=csrc/cuda/${source:-${kernel%_kernel}}.cuh
cat >"$unit" <<X
#include "$include"
namespace fast_causal_attn { namespace cuda {
$instance
}}
X
source benchmarks/offline_nvcc.sh
nvcc $offline_std -O3 $arch -cubin -lineinfo -w $offline_includes "$unit" -o /tmp/sass_$tag.cubin
"$tool" -c -gi /tmp/sass_$tag.cubin >/tmp/sass_$tag.txt
python benchmarks/sass_loop.py /tmp/sass_$tag.txt $source --kernel $kernel
