// The grad q pass of the recurrent kernel family, every dtype and head-dim bucket.
#include "causal_product.cuh"

namespace fast_causal_attn {
namespace cuda {

void run_grad_q_pass(const KernelParams& p, cudaStream_t stream) { run_pass_for_dtype<Pass::GradQ>(p, stream); }

}  // namespace cuda
}  // namespace fast_causal_attn
