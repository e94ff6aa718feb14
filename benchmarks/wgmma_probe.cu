// The layouts a wgmma (sm_90a) port of the tensor-core kernels needs, checked one at a time: one
// warpgroup multiplies a 64 x 64 A by a 64 x 64 B^T (bf16, float32 accumulation, four k16 steps
// of m64n64k16) with each operand stored in shared memory K-major or MN-major, without swizzle,
// in 8 x 16-byte core matrices `stride_k` bytes apart along K and `stride_mn` apart along M or N;
// or with A from registers (the mma.sync A fragment, as the masked scores would be). The
// descriptor's two offsets (leading: along K, stride: along M/N, by the PTX ISA) are given in
// that order, or swapped, so that a run shows which encoding each storage needs; and
// (probe_half_columns) an m64n32k16 on half of a 128-byte-swizzled MN-major B.
// benchmarks/wgmma_probe.py builds and runs it.
#include <c10/cuda/CUDAException.h>
#include <torch/extension.h>

#include <cuda_bf16.h>

#include <cstdint>

#include "wgmma.cuh"

namespace {

constexpr int kN = 64;  // M = N = K = 64

// Byte offset of element (mn, k) of a 64 x 64 16-bit operand stored K-major (8 consecutive k of
// one row in 16 bytes) or MN-major (8 consecutive mn of one k in 16 bytes).
__device__ int stored_at(int mn, int k, bool k_major, int stride_k, int stride_mn) {
  const int core = (mn / 8) * stride_mn + (k / 8) * stride_k;
  return core + (k_major ? (mn % 8) * 16 + (k % 8) * 2 : (k % 8) * 16 + (mn % 8) * 2);
}

// a, b: [64][64] row-major, A(m, k) = a[m][k], B(n, k) = b[n][k]; out: [64][64] float32, A B^T.
template <int kTransA, int kTransB, bool kRegisterA>
__global__ void __launch_bounds__(128) probe_kernel(const __nv_bfloat16* a, const __nv_bfloat16* b, float* out,
                                                    int stride_k, int stride_mn, int swap) {
  __shared__ __align__(128) unsigned char a_s[kN * kN * 2];
  __shared__ __align__(128) unsigned char b_s[kN * kN * 2];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, q = lane % 4;
  for (int i = tid; i < kN * kN; i += 128) {
    const int mn = i / kN, k = i % kN;
    *reinterpret_cast<__nv_bfloat16*>(a_s + stored_at(mn, k, !kTransA, stride_k, stride_mn)) = a[i];
    *reinterpret_cast<__nv_bfloat16*>(b_s + stored_at(mn, k, !kTransB, stride_k, stride_mn)) = b[i];
  }
  wgmma::fence_shared_writes();
  __syncthreads();
  const uint32_t leading = swap ? stride_mn : stride_k, stride = swap ? stride_k : stride_mn;
  float d[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) d[i] = 0.f;
  uint32_t frag[4][4];  // A from registers: k-step s, rows 16 warp + g (+8), k 16 s + 2q (+1, +8, +9)
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const int r = 16 * warp + g, k = 16 * s + 2 * q;
    frag[s][0] = wgmma::pack(a[r * kN + k], a[r * kN + k + 1]);
    frag[s][1] = wgmma::pack(a[(r + 8) * kN + k], a[(r + 8) * kN + k + 1]);
    frag[s][2] = wgmma::pack(a[r * kN + k + 8], a[r * kN + k + 9]);
    frag[s][3] = wgmma::pack(a[(r + 8) * kN + k + 8], a[(r + 8) * kN + k + 9]);
  }
  wgmma::fence();
#pragma unroll
  for (int s = 0; s < 4; ++s) {  // k16 step s: two core matrices along K further
    const uint64_t b_desc = wgmma::descriptor(wgmma::smem_address(b_s + 2 * s * stride_k), leading, stride);
    if constexpr (kRegisterA) {
      wgmma::mma_rs<kTransB>(d, frag[s], b_desc);
    } else {
      const uint64_t a_desc = wgmma::descriptor(wgmma::smem_address(a_s + 2 * s * stride_k), leading, stride);
      wgmma::mma_ss<kTransA, kTransB>(d, a_desc, b_desc);
    }
  }
  wgmma::commit();
  wgmma::wait<0>();
  // D: warp w rows 16w + g (+8), n-tile j columns 8j + 2q (+1), as mma.sync's accumulators
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) out[(16 * warp + g + 8 * (e / 2)) * kN + 8 * j + 2 * q + e % 2] = d[4 * j + e];
}

// The E = 256 column-halves design's P V_g (RESULTS.md, eighty-third session): A (64 x 64,
// K-major) and B (V's chunk, 64 K rows of 64 N columns, MN-major) in the kernels' 128-byte swizzle
// (element (r, c) at 128 r + 16 ((c / 8) ^ (r % 8)) + 2 (c % 8) bytes, each tile 1024-aligned), and
// B's columns 32 half .. 32 half + 31 multiplied by an m64n32k16 whose descriptor starts 64 half
// bytes into the tile, as the kernels' k16 steps start 32 s bytes in along K-major rows.
__device__ int swizzled_at(int r, int c) { return 128 * r + 16 * ((c / 8) ^ (r % 8)) + 2 * (c % 8); }
// a: [64 m][64 k], v: [64 k][64 n], both row-major; out: [64][32] float32, a @ v[:, 32 half:][:, :32].
__global__ void __launch_bounds__(128) half_columns_kernel(const __nv_bfloat16* a, const __nv_bfloat16* v, float* out,
                                                           int half) {
  __shared__ __align__(1024) unsigned char a_s[kN * kN * 2];
  __shared__ __align__(1024) unsigned char v_s[kN * kN * 2];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, q = lane % 4;
  for (int i = tid; i < kN * kN; i += 128) {
    *reinterpret_cast<__nv_bfloat16*>(a_s + swizzled_at(i / kN, i % kN)) = a[i];
    *reinterpret_cast<__nv_bfloat16*>(v_s + swizzled_at(i / kN, i % kN)) = v[i];
  }
  wgmma::fence_shared_writes();
  __syncthreads();
  float d[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) d[i] = 0.f;
  wgmma::fence();
#pragma unroll
  for (int s = 0; s < 4; ++s) {  // k16 step s: 32 bytes along A's rows, 16 rows (2048 bytes) down V's
    wgmma::mma_ss_n32<0, 1>(d, wgmma::swizzled_descriptor(wgmma::smem_address(a_s) + 32 * s),
                            wgmma::swizzled_descriptor(wgmma::smem_address(v_s) + 2048 * s + 64 * half));
  }
  wgmma::commit();
  wgmma::wait<0>();
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) out[(16 * warp + g + 8 * (e / 2)) * 32 + 8 * j + 2 * q + e % 2] = d[4 * j + e];
}

torch::Tensor probe_half_columns(torch::Tensor a, torch::Tensor v, int64_t half) {
  TORCH_CHECK(a.is_cuda() && a.scalar_type() == at::kBFloat16 && a.is_contiguous() && a.numel() == kN * kN, "a");
  TORCH_CHECK(v.is_cuda() && v.scalar_type() == at::kBFloat16 && v.is_contiguous() && v.numel() == kN * kN, "v");
  TORCH_CHECK(half == 0 || half == 1, "half: 0 or 1");
  auto out = torch::empty({kN, kN / 2}, a.options().dtype(at::kFloat));
  half_columns_kernel<<<1, 128>>>(reinterpret_cast<const __nv_bfloat16*>(a.data_ptr()),
                                  reinterpret_cast<const __nv_bfloat16*>(v.data_ptr()), out.data_ptr<float>(),
                                  int(half));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

torch::Tensor probe(torch::Tensor a, torch::Tensor b, int64_t variant, int64_t stride_k, int64_t stride_mn,
                    int64_t swap) {
  TORCH_CHECK(a.is_cuda() && a.scalar_type() == at::kBFloat16 && a.is_contiguous() && a.numel() == kN * kN, "a");
  TORCH_CHECK(b.is_cuda() && b.scalar_type() == at::kBFloat16 && b.is_contiguous() && b.numel() == kN * kN, "b");
  auto out = torch::empty({kN, kN}, a.options().dtype(at::kFloat));
  auto pa = reinterpret_cast<const __nv_bfloat16*>(a.data_ptr());
  auto pb = reinterpret_cast<const __nv_bfloat16*>(b.data_ptr());
  const int sk = int(stride_k), smn = int(stride_mn), sw = int(swap);
  switch (variant) {  // A, B: K-major (0) or MN-major (1); A from registers
    case 0: probe_kernel<0, 0, false><<<1, 128>>>(pa, pb, out.data_ptr<float>(), sk, smn, sw); break;
    case 1: probe_kernel<0, 1, false><<<1, 128>>>(pa, pb, out.data_ptr<float>(), sk, smn, sw); break;
    case 2: probe_kernel<1, 0, false><<<1, 128>>>(pa, pb, out.data_ptr<float>(), sk, smn, sw); break;
    case 3: probe_kernel<1, 1, false><<<1, 128>>>(pa, pb, out.data_ptr<float>(), sk, smn, sw); break;
    case 4: probe_kernel<0, 0, true><<<1, 128>>>(pa, pb, out.data_ptr<float>(), sk, smn, sw); break;
    case 5: probe_kernel<0, 1, true><<<1, 128>>>(pa, pb, out.data_ptr<float>(), sk, smn, sw); break;
    default: TORCH_CHECK(false, "variant 0-5");
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("probe", &probe);
  m.def("probe_half_columns", &probe_half_columns);
}
