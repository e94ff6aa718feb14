// The grad q pass of both kernel families, every dtype and head-dim bucket.
#include "dispatch.cuh"

namespace fast_causal_attn {
namespace cuda {

void run_grad_q_pass(const KernelParams& p, cudaStream_t stream) { run_pass_for_dtype<Pass::GradQ>(p, stream); }

}  // namespace cuda
}  // namespace fast_causal_attn
