// The one dispatcher of the CUDA backend: which kernel family and head-dim bucket runs a pass.
#pragma once

#include <cstdlib>
#include <cstring>

#include "chunked_product.cuh"
#include "recurrent_product.cuh"

namespace fast_causal_attn {
namespace cuda {

enum class Family { Recurrent, Chunked };

// The recurrent family by default: it was as fast or faster than the chunked family (CUDA-core
// FMA micro-tiles) at every benchmark shape, forward+backward (H200, fp32 ms, recurrent / chunked:
// 8,16,2048,64: 2.82 / 3.35; 4,16,8192,64: 6.35 / 7.44; 8,16,2048,128: 4.83 / 5.14;
// 2,4,8192,64: 0.63 / 0.73; 1,16,32768,128: 23.7 / 23.9; 8,16,2048,64,128: 4.03 / 4.20; bf16 the
// same order). The chunked family is where tensor cores go next (issue 5).
// FAST_CAUSAL_ATTN_KERNEL=recurrent or =chunked forces one family (the chunked one where its
// buckets hold the state's rows), so that the tests cover both.
inline Family choose_family(int64_t Da) {
  const char* forced = std::getenv("FAST_CAUSAL_ATTN_KERNEL");
  if (forced != nullptr && forced[0] != '\0') {
    TORCH_CHECK(std::strcmp(forced, "recurrent") == 0 || std::strcmp(forced, "chunked") == 0,
                "FAST_CAUSAL_ATTN_KERNEL must be 'recurrent' or 'chunked', got '", forced, "'");
    if (std::strcmp(forced, "chunked") == 0 && Da <= kMaxChunkedRows) return Family::Chunked;
  }
  return Family::Recurrent;
}

template <Pass P, typename scalar_t>
void run_pass(const KernelParams& p, cudaStream_t stream) {
  // a and b index the state's rows, c its columns (see Operands).
  const bool a_is_e = P == Pass::Forward || P == Pass::GradV;
  const int64_t Da = a_is_e ? p.E : p.M;
  const int64_t Dc = a_is_e ? p.M : p.E;
  if (choose_family(Da) == Family::Chunked) {
    run_chunked<P, scalar_t>(p, Da, Dc, stream);
  } else {
    run_recurrent<P, scalar_t>(p, Da, Dc, stream);
  }
}

template <Pass P>
void run_pass_for_dtype(const KernelParams& p, cudaStream_t stream) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p.dtype, "fast_causal_attn (CUDA)",
                                  [&] { run_pass<P, scalar_t>(p, stream); });
}

// One compile unit each (csrc/cuda/pass_*.cu), so that builds run in parallel.
void run_forward_pass(const KernelParams& p, cudaStream_t stream);
void run_grad_q_pass(const KernelParams& p, cudaStream_t stream);
void run_grad_k_pass(const KernelParams& p, cudaStream_t stream);
void run_grad_v_pass(const KernelParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace fast_causal_attn
