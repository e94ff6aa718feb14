// The decoding step on CUDA: the forward of one timestep (L = 1) from a state, reading the state
// once and writing the new one once; nothing to chunk, so none of the families' staging.
//
//   S1 = S0 + k v^T,  z1 = z0 + k,  o = q' S1 [/ (q' . z1 + eps)]
//
// A block owns one (batch, head) and kCols columns of v: lane m of every warp owns column m, the
// warps share the E rows, and their partial sums of o meet in shared memory.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>

#include "kernel_common.cuh"

namespace fast_causal_attn {
namespace cuda {
namespace {

constexpr int kDecodeWarps = 8;
constexpr int kDecodeCols = kWarp;

template <typename scalar_t>
__global__ void __launch_bounds__(kDecodeWarps * kWarp) decode_step_kernel(const KernelParams p, int64_t col_tiles) {
  using acc_t = at::opmath_type<scalar_t>;
  __shared__ acc_t partial[kDecodeWarps][kDecodeCols];
  __shared__ acc_t den_s;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t col_tile = blockIdx.x % col_tiles, pair = blockIdx.x / col_tiles;
  const int64_t b = pair / p.H, h = pair % p.H, E = p.E, M = p.M;
  const int64_t m = col_tile * kDecodeCols + lane;
  const scalar_t* q = static_cast<const scalar_t*>(p.q.ptr) + p.q.offset(b, h, 0);
  const scalar_t* k = static_cast<const scalar_t*>(p.k.ptr) + p.k.offset(b, h, 0);
  const scalar_t* v = static_cast<const scalar_t*>(p.v.ptr) + p.v.offset(b, h, 0);
  const acc_t* kv0 = p.initial_kv ? static_cast<const acc_t*>(p.initial_kv) + pair * E * M : nullptr;
  const acc_t* z0 = p.initial_k_sum ? static_cast<const acc_t*>(p.initial_k_sum) + pair * E : nullptr;
  acc_t* kv1 = p.final_kv ? static_cast<acc_t*>(p.final_kv) + pair * E * M : nullptr;
  acc_t* z1 = p.final_k_sum ? static_cast<acc_t*>(p.final_k_sum) + pair * E : nullptr;
  const acc_t scale = acc_t(p.scale);

  // This lane's column: S1[e][m] for the warp's rows, and q' . S1[:, m] over them.
  const acc_t vm = m < M ? acc_t(v[m]) : acc_t(0);
  acc_t sum = acc_t(0);
  // Unrolled so that several rows' loads are in flight at once: the step is one pass over the
  // state, bound by memory latency (B = 64 measured 101 us against a 32 us floor rolled).
#pragma unroll 4
  for (int64_t e = warp; e < E; e += kDecodeWarps) {
    const acc_t ke = acc_t(k[e]);
    if (m < M) {
      const acc_t s = (kv0 ? kv0[e * M + m] : acc_t(0)) + ke * vm;
      if (kv1) kv1[e * M + m] = s;
      sum += scale * acc_t(q[e]) * s;
    }
  }
  partial[warp][lane] = sum;

  // The key sum and the normalizer: warp 0, lanes over the E rows (every column tile needs den;
  // tile 0 writes the new key sum).
  if (warp == 0 && (p.normalize || z1 != nullptr)) {
    acc_t dot = acc_t(0);
    for (int64_t e = lane; e < E; e += kWarp) {
      const acc_t z = (z0 ? z0[e] : acc_t(0)) + acc_t(k[e]);
      if (z1 && col_tile == 0) z1[e] = z;
      dot += scale * acc_t(q[e]) * z;
    }
#pragma unroll
    for (int offset = kWarp / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    if (lane == 0) den_s = dot + acc_t(p.eps);
  }
  __syncthreads();

  if (warp == 0 && m < M) {
    acc_t out = acc_t(0);
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) out += partial[w][lane];
    if (p.normalize) {
      out /= den_s;
      if (col_tile == 0 && lane == 0) static_cast<acc_t*>(p.den)[pair] = den_s;  // den is [B, H, 1]
    }
    static_cast<scalar_t*>(p.o.ptr)[p.o.offset(b, h, 0) + m] = scalar_t(out);
  }
}

}  // namespace

void run_decode_step(const KernelParams& p, cudaStream_t stream) {
  const int64_t col_tiles = (p.M + kDecodeCols - 1) / kDecodeCols;
  const int64_t blocks = p.B * p.H * col_tiles;
  TORCH_CHECK(blocks <= int64_t(0x7fffffff), "fast_causal_attn: too many (batch, head) pairs: ", p.B * p.H);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p.dtype, "fast_causal_attn decode step (CUDA)", [&] {
    decode_step_kernel<scalar_t><<<unsigned(blocks), kDecodeWarps * kWarp, 0, stream>>>(p, col_tiles);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace cuda
}  // namespace fast_causal_attn
