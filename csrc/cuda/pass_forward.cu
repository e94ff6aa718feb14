// The forward pass of both kernel families, every dtype and head-dim bucket.
#include "dispatch.cuh"

namespace fast_causal_attn {
namespace cuda {

// (the run and its plan alike: plan_forward_segments)
ForwardSegments run_forward_pass(const KernelParams& params, cudaStream_t stream) {
  KernelParams p = params;
  p.one_pass = p.keep_segments && one_pass_backward_takes(p);  // its segments' ends kept for the one-pass backward
  return run_pass_for_dtype<Pass::Forward>(p, stream);
}

}  // namespace cuda
}  // namespace fast_causal_attn
