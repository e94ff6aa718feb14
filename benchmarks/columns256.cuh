// What the E = M = 256 forward prototypes share (benchmarks/columns256.cu: the state's columns
// split between two consumer groups, its copy in shared memory; benchmarks/transposed256.cu: the
// state kept transposed in registers): their inputs, the producer's masked scores and the
// accumulator's stmatrix order. bfloat16, contiguous [B, H, L, 256], L a multiple of 64.
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

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// An accumulator's pairs in stmatrix's order: matrix m (of an x4 store) of n-tiles 2 k and 2 k + 1
// holds n-tile 2 k + m / 2, rows + 8 (m % 2), each lane's pair of it at d[entry(k, m)]. The same
// index gives a register A fragment's: a[m] of k-step k (rows g, g + 8; k 2 q and 2 q + 8).
__device__ __forceinline__ int entry(int k, int m) { return 4 * (2 * k + m / 2) + 2 * (m % 2); }

// The chunk's masked scores P from its staged Q and K (four atoms each at q_tile, k_tile) into
// p_tile, fenced for the consumers' wgmma: the producer's work a chunk (kReverse: the mask t <= s;
// kHalf: float16).
template <bool kReverse, bool kHalf = false>
__device__ __forceinline__ void make_scores(uint32_t q_tile, uint32_t k_tile, uint32_t p_tile) {
  float score[32];
  fw::fence();
  fw::scores_of<kHalf, kAtoms>(score, q_tile, k_tile);
  fw::commit();
  fw::wait<0>();
  uint32_t masked[4][4];
  fw::masked_fragments<kHalf, kReverse>(masked, score);
  fw::store_fragments(p_tile, masked);
  fw::fence_shared_writes();
}
#endif

}  // namespace columns256
