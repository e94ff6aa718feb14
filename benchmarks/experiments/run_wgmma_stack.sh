#!/usr/bin/env bash
# One device call for the stacked wgmma experiments (README.md here): applies the first N patches
# in order, builds for sm_90a, runs the tests, the wgmma sanitizer subset and the bench against
# FAST_CAUSAL_ATTN_WGMMA=0 and 1, then (PROFILE=1) ncu of the forward at 128 and 256 pairs.
#
#   N=1 bash benchmarks/experiments/run_wgmma_stack.sh             # full sectors
#   N=3 TESTS="cuda or wgmma" bash benchmarks/experiments/run_wgmma_stack.sh
set -u
cd "$(dirname "$0")/../.."
patches=(wgmma_full_sectors wgmma_grad_kv wgmma_segments)
for ((i = 0; i < ${N:-1}; ++i)); do
  git apply "benchmarks/experiments/${patches[i]}.patch" || { echo "${patches[i]}.patch does not apply"; exit 1; }
  echo "applied ${patches[i]}.patch"
done
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STAGES="build tests sanitize" SANITIZE_SUBSETS=wgmma TESTS="${TESTS:-wgmma}" \
  bash benchmarks/gpu_check.sh 2>&1 | grep -vE "^\.+ *\[|^$" | tail -12
python benchmarks/benchmark.py --out "$OUT" --no-peers --kernel-time --dtypes bfloat16 \
  --methods fast_causal_attn,fca --sweep FAST_CAUSAL_ATTN_WGMMA=0,1 \
  --shapes "${SHAPES:-8,16,2048,64,64;16,16,2048,64,64;4,16,8192,64,64;2,4,8192,64,64}" >"$OUT/stack_bench.log" 2>&1
grep -E "^bfloat16|GPU busy|wgmma_|tensorcore_product" "$OUT/stack_bench.log" | cut -c1-150
if [[ "${PROFILE:-0}" == 1 ]]; then
  for pairs in "8 16" "16 16"; do
    FAST_CAUSAL_ATTN_WGMMA=1 ncu --clock-control none -k regex:wgmma_product_kernel --launch-count 1 --set full \
      python benchmarks/profile_kernels.py $pairs 2048 64 64 fwd bfloat16 >"$OUT/ncu_${pairs// /_}.txt" 2>&1
    echo "== B H = $pairs"
    grep -E "Duration|L2 Cache Throughput|DRAM Throughput|Achieved Occupancy|excessive" "$OUT/ncu_${pairs// /_}.txt" | head -8
  done
fi
