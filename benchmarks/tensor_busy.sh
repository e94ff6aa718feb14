#!/usr/bin/env bash
# How much of the tensor pipe's peak the wgmma kernels use (ncu), beside their DRAM throughput:
# does a kernel wait on its products or leave the pipe idle (latency, warpgroups in lockstep)?
# After a build, on the device:
#   bash benchmarks/tensor_busy.sh "1 16 32768 128 128 fwd bfloat16" "8 16 2048 64 64 fwd bfloat16"
# (the first three wgmma launches of each call: a segmented forward's state-only launch and pass).
# sm__ops_path_tensor_src_bf16_dst_fp32's peak: the twenty-eighth session's numbers are half
# the dense utilization counted from the kernels' products and durations (RESULTS.md), so it
# likely counts the sparse peak. (sm__pipe_tensor_op_gmma_cycles_active read n/a on the H200.)
set -u
for case_ in "$@"; do
  echo "== $case_"
  ncu --clock-control none -k regex:wgmma -c 3 \
    --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,sm__ops_path_tensor_src_bf16_dst_fp32.sum.pct_of_peak_sustained_elapsed \
    python benchmarks/profile_kernels.py $case_ 2>&1 |
    grep -E "^  [a-z].*\(|gpu__time|dram__|tensor|warps_active" | sed -E 's/\(fast_causal_attn::KernelParams.*//; s/^ +//'
done
