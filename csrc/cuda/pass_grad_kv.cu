// The fused grad k and grad v pass of the tensor-core and recurrent families (see run_grad_kv in
// dispatch.cuh).
#include "dispatch.cuh"

namespace fast_causal_attn {
namespace cuda {

bool run_grad_kv_pass(const KernelParams& p, cudaStream_t stream) {
  bool ran = false;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p.dtype, "fast_causal_attn (CUDA)",
                                  [&] { ran = run_grad_kv<scalar_t>(p, stream); });
  return ran;
}

bool one_pass_backward_takes(const KernelParams& p) {
  bool takes = false;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p.dtype, "fast_causal_attn one_pass_backward",
                                  [&] { takes = one_pass_backward<scalar_t>(p); });
  return takes;
}

}  // namespace cuda
}  // namespace fast_causal_attn
