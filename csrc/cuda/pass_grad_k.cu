// The grad k pass of both kernel families, every dtype and head-dim bucket.
#include "dispatch.cuh"

namespace fast_causal_attn {
namespace cuda {

ForwardSegments run_grad_k_pass(const KernelParams& p, cudaStream_t stream) {
  return run_pass_for_dtype<Pass::GradK>(p, stream);
}

}  // namespace cuda
}  // namespace fast_causal_attn
