// The grad q pass of both kernel families, every dtype and head-dim bucket.
#include "dispatch.cuh"

namespace fast_causal_attn {
namespace cuda {

void run_grad_q_pass(const KernelParams& p, cudaStream_t stream) { run_pass_for_dtype<Pass::GradQ>(p, stream); }

bool grad_q_pass_makes_dots(const KernelParams& p) {
  bool makes = false;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p.dtype, "fast_causal_attn grad_q_makes_dots",
                                  [&] { makes = grad_q_makes_dots<scalar_t>(p); });
  return makes;
}

}  // namespace cuda
}  // namespace fast_causal_attn
