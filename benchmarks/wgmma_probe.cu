// The layouts a wgmma (sm_90a) port of the tensor-core kernels needs, checked one at a time: one
// warpgroup multiplies a 64 x 64 A by a 64 x 64 B^T (bf16, float32 accumulation, four k16 steps
// of m64n64k16) with each operand stored in shared memory K-major or MN-major, without swizzle,
// in 8 x 16-byte core matrices `stride_k` bytes apart along K and `stride_mn` apart along M or N;
// or with A from registers (the mma.sync A fragment, as the masked scores would be). The
// descriptor's two offsets (leading: along K, stride: along M/N, by the PTX ISA) are given in
// that order, or swapped, so that a run shows which encoding each storage needs.
// benchmarks/wgmma_probe.py builds and runs it.
#include <c10/cuda/CUDAException.h>
#include <torch/extension.h>

#include <cuda_bf16.h>

#include <cstdint>

namespace {

constexpr int kN = 64;  // M = N = K = 64

__device__ uint64_t smem_descriptor(const void* smem, uint32_t leading, uint32_t stride) {
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  // bits 0-13: address >> 4; 16-29: leading byte offset >> 4; 32-45: stride byte offset >> 4;
  // 49-51: base offset 0; 62-63: swizzle mode 0 (none)
  return uint64_t((address & 0x3FFFF) >> 4) | (uint64_t((leading & 0x3FFFF) >> 4) << 16) |
         (uint64_t((stride & 0x3FFFF) >> 4) << 32);
}

// Byte offset of element (mn, k) of a 64 x 64 16-bit operand stored K-major (8 consecutive k of
// one row in 16 bytes) or MN-major (8 consecutive mn of one k in 16 bytes).
__device__ int stored_at(int mn, int k, bool k_major, int stride_k, int stride_mn) {
  const int core = (mn / 8) * stride_mn + (k / 8) * stride_k;
  return core + (k_major ? (mn % 8) * 16 + (k % 8) * 2 : (k % 8) * 16 + (mn % 8) * 2);
}

#define FCA_D32                                                                                              \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),   \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),  \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define FCA_D32_LIST                                                                                        \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31}"

// d (64 x 64, float32) += A B^T, A and B from shared memory; kTransA / kTransB: MN-major.
template <int kTransA, int kTransB>
__device__ void wgmma_ss(float (&d)[32], uint64_t a, uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " FCA_D32_LIST
      ", %32, %33, p, 1, 1, %35, %36;\n}\n"
      : FCA_D32
      : "l"(a), "l"(b), "r"(1), "n"(kTransA), "n"(kTransB));
}

// The same with A from registers (each warp its 16 rows, mma.sync's m16n8k16 A fragment).
template <int kTransB>
__device__ void wgmma_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " FCA_D32_LIST
      ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
      : FCA_D32
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1), "n"(kTransB));
}

__device__ uint32_t pack(__nv_bfloat16 lo, __nv_bfloat16 hi) {
  return uint32_t(__bfloat16_as_ushort(lo)) | (uint32_t(__bfloat16_as_ushort(hi)) << 16);
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
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // generic-proxy stores, seen by wgmma
  __syncthreads();
  const uint32_t leading = swap ? stride_mn : stride_k, stride = swap ? stride_k : stride_mn;
  float d[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) d[i] = 0.f;
  uint32_t frag[4][4];  // A from registers: k-step s, rows 16 warp + g (+8), k 16 s + 2q (+1, +8, +9)
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const int r = 16 * warp + g, k = 16 * s + 2 * q;
    frag[s][0] = pack(a[r * kN + k], a[r * kN + k + 1]);
    frag[s][1] = pack(a[(r + 8) * kN + k], a[(r + 8) * kN + k + 1]);
    frag[s][2] = pack(a[r * kN + k + 8], a[r * kN + k + 9]);
    frag[s][3] = pack(a[(r + 8) * kN + k + 8], a[(r + 8) * kN + k + 9]);
  }
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
  for (int s = 0; s < 4; ++s) {  // k16 step s: two core matrices along K further
    const uint64_t b_desc = smem_descriptor(b_s + 2 * s * stride_k, leading, stride);
    if constexpr (kRegisterA) {
      wgmma_rs<kTransB>(d, frag[s], b_desc);
    } else {
      wgmma_ss<kTransA, kTransB>(d, smem_descriptor(a_s + 2 * s * stride_k, leading, stride), b_desc);
    }
  }
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  // D: warp w rows 16w + g (+8), n-tile j columns 8j + 2q (+1), as mma.sync's accumulators
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) out[(16 * warp + g + 8 * (e / 2)) * kN + 8 * j + 2 * q + e % 2] = d[4 * j + e];
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("probe", &probe); }
