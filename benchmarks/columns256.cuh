// What the E = M = 256 forward prototypes share (benchmarks/columns256.cu: the state's columns
// split between two consumer groups, its copy in shared memory; benchmarks/transposed256.cu: the
// state kept transposed in registers): their inputs, the producer's masked scores and the
// accumulator's stmatrix order (the library's). bfloat16, contiguous [B, H, L, 256], L a multiple of 64.
#pragma once
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "wgmma_product.cuh"

namespace columns256 {

namespace fw = fast_causal_attn::cuda::wgmma;
using fast_causal_attn::cuda::kWarp;

constexpr int kAtoms = 4;            // E = 256: Q's and K's 64-column atoms
constexpr int kWidth = 64 * kAtoms;  // E = M

struct Rows {  // fw::Stager's view of an operand: its pointer and row stride (elements)
  const void* ptr;
  int64_t stride;
};

// half: float16 taken too (transposed256.cu), each of q, k, v of q's dtype
inline void check_inputs(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, bool half = false) {
  const bool dtype = q.scalar_type() == torch::kBFloat16 || (half && q.scalar_type() == torch::kHalf);
  for (const auto* t : {&q, &k, &v}) {
    TORCH_CHECK(dtype && t->is_cuda() && t->scalar_type() == q.scalar_type() && t->is_contiguous() && t->dim() == 4 &&
                    t->size(3) == kWidth && t->sizes() == q.sizes(),
                "columns256: q, k, v contiguous ", half ? "bfloat16 or float16" : "bfloat16",
                " CUDA tensors [B, H, L, 256] of one shape and dtype");
  }
  TORCH_CHECK(q.size(2) % fw::C == 0, "columns256: L a multiple of 64, got ", q.size(2));
}

// (the accumulator's stmatrix order and the producer's masked scores: the library's
// fw::matrix_pair and fw::make_masked_scores, which these prototypes first wrote for themselves)

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The producer's wait for a chunk (fw::ProducedRing::produce's at two stage slots: one chunk in
// flight): this thread's copies landed and fenced for wgmma, then every producer thread's, at its
// warpgroup's own named barrier.
__device__ __forceinline__ void producer_copies_landed(int barrier) {
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
  fw::fence_shared_writes();
  fw::named_sync(barrier, fw::kThreads);
}
#endif

}  // namespace columns256
