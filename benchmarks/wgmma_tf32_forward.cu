// A prototype: the float32 forward on Hopper's wgmma in 3xTF32 (float32-accurate), E = M = 64,
// contiguous [B, H, L, 64], one block (one warpgroup) a (batch, head), no segments. Checked and
// timed by benchmarks/wgmma_tf32_forward.py beside the library's float32 forward (mma.sync,
// 3xTF32: bf16 8,16,2048,64 0.210 ms against a floor of 0.063; RESULTS.md, eighteenth session).
//
// Why it might pay: the 16-bit wgmma kernels run the same products in 20 instructions a chunk
// where mma.sync issues hundreds, and float32's forward is bound by its tensor-core work (3
// products a term). TF32 wgmma reads both shared-memory operands K-major only (no transposed
// view), so the layout differs from the 16-bit kernels':
//
//   scores = Q K^T       A = Q (raw tile, K = e along its columns), B = K (raw tile)
//   out    = Q S         B = S^T, written by the block as its state's copy ([m][e])
//   out   += P V         A = P from registers (the scores' accumulators, shuffled into the A
//                        fragment's layout), B = V^T (written per chunk from the raw V tile)
//   S     += K^T V       A = K^T from registers (gathered from the raw K tile), B = V^T
//
// Each term is head x head + head x tail + tail x head: the head is the raw float32 (the tensor
// core ignores an operand's 13 low bits: it truncates to TF32), the tail x - trunc(x), exact in
// float32 (tensorcore_product.cuh's split). Tails: q's and k's as tiles (written per chunk), P's
// and K^T's in registers, v^T's and S^T's as tiles (q's in registers spilled 196 bytes; as a tile
// 20, at 255 registers). Tiles are 64 x 64 float32 in wgmma's 128-byte
// swizzle: two atoms of 32 columns (8 KB apart), element (r, c) of an atom at 128 r + 16 ((c / 4)
// ^ (r % 8)) + 4 (c % 4); a k8 step moves the start address 32 bytes. Raw q, k, v are staged by
// cp.async two chunks deep (96 KB), the derived tiles single (96 KB): 192 KB, one block a
// multiprocessor.
#include <torch/extension.h>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include "../csrc/cuda/wgmma_product.cuh"  // descriptor, fence, commit, wait, copy_16, ...

namespace {

using namespace fast_causal_attn::cuda::wgmma;

constexpr int D = 64;                   // E = M
constexpr int kTileF = 64 * 64 * 4;     // bytes of a float32 tile (two 8 KB atoms)
constexpr int kDepth = 2;               // raw chunks staged
constexpr int kRawAt = 0;               // stage s: q, k, v at (3 s + 0, 1, 2) tiles
constexpr int kKLoAt = 3 * kDepth;      // k's tails
constexpr int kVtHiAt = kKLoAt + 1, kVtLoAt = kKLoAt + 2;  // v^T, [m][s]
constexpr int kStHiAt = kKLoAt + 3, kStLoAt = kKLoAt + 4;  // the state's copy S^T, [m][e]
constexpr int kQLoAt = kKLoAt + 5;                         // q's tails
constexpr int kSmem = (kKLoAt + 6) * kTileF;

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The byte offset of element (r, c) in a swizzled float32 tile.
__device__ __forceinline__ uint32_t at(int r, int c) {
  return uint32_t((c / 32) * 8192 + 128 * r + 16 * (((c % 32) / 4) ^ (r % 8)) + 4 * (c % 4));
}
// K-major operand, k8 step s (K = 64: two atoms)
__device__ __forceinline__ uint64_t k_step(uint32_t tile, int s) { return descriptor(tile + (s / 4) * 8192 + 32 * (s % 4)); }

__device__ __forceinline__ uint32_t tail_of(float x) {
  return __float_as_uint(x - __uint_as_float(__float_as_uint(x) & 0xffffe000u));
}
__device__ __forceinline__ uint32_t head_of(float x) { return __float_as_uint(x) & 0xffffe000u; }

#define FCA_D32(d)                                                                                                 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),     \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),       \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),      \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define FCA_D32_LIST                                                                                        \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31}"
// d (64 x 64) += A B^T, k8, both K-major from shared memory (accumulate = false: d = A B^T)
__device__ __forceinline__ void tf32_ss(float (&d)[32], uint64_t a, uint64_t b, bool accumulate = true) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 " FCA_D32_LIST ", %32, %33, p, 1, 1;\n}\n"
      : FCA_D32(d)
      : "l"(a), "l"(b), "r"(accumulate ? 1 : 0));
}
// the same with A from registers: a0 (row g, k q), a1 (g + 8, q), a2 (g, q + 4), a3 (g + 8, q + 4)
// of the warp's 16 rows (CUTLASS's ALayout_64x8)
__device__ __forceinline__ void tf32_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 " FCA_D32_LIST ", {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
      : FCA_D32(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}
#undef FCA_D32
#undef FCA_D32_LIST
#endif

__global__ void __launch_bounds__(128, 1)
    tf32_forward_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                        float* __restrict__ out, int64_t L, float scale) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t base = smem_address(smem);
  auto tile = [&](int which) { return base + uint32_t(which) * kTileF; };
  auto word = [&](int which, int r, int c) -> float& {
    return *reinterpret_cast<float*>(smem + which * kTileF + at(r, c));
  };
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, q4 = lane % 4;
  const int64_t pair = blockIdx.x, chunks = (L + C - 1) / C;
  const float* qp = q + pair * L * D;
  const float* kp = k + pair * L * D;
  const float* vp = v + pair * L * D;
  float* op = out + pair * L * D;

  // Staging: 16 lanes copy one 256-byte row (eight to an atom's 128-byte row), rows r0 + 8 i.
  const int piece = tid % 16, r0 = tid / 16;
  const uint32_t piece_at = uint32_t((piece / 8) * 8192 + 128 * r0 + 16 * ((piece % 8) ^ r0));
  auto issue = [&](int64_t it, int slot) {
    if (it < chunks) {
      const int64_t t0 = it * C;
      const float* sources[3] = {qp, kp, vp};
#pragma unroll
      for (int x = 0; x < 3; ++x)
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int64_t t = t0 + r0 + 8 * i;
          const bool valid = t < L;
          copy_16(tile(3 * slot + x) + piece_at + 1024 * i, sources[x] + (valid ? t : 0) * D + 4 * piece, valid);
        }
    }
    StageRing<kDepth>::commit_copies();
  };

  // The state S: row e = 16 warp + g (+8), column m = 8 j + 2 q4 (+1) in state[4 j ..].
  float state[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) state[i] = 0.f;
  for (int i = tid; i < 2 * kTileF / 4; i += 128) reinterpret_cast<float*>(smem + kStHiAt * kTileF)[i] = 0.f;

  issue(0, 0);
  StageRing<kDepth> ring;
  for (int64_t it = 0; it < chunks; ++it, ring.advance()) {
    ring.arrive();
    const int slot = ring.slot;
    const int qt = 3 * slot, kt = 3 * slot + 1, vt = 3 * slot + 2;
    // Per chunk: k's tails (the same places), v^T's heads and tails ([m][s]).
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t offset = piece_at + 1024 * i;
      const float4 x = *reinterpret_cast<const float4*>(smem + kt * kTileF + offset);
      *reinterpret_cast<uint4*>(smem + kKLoAt * kTileF + offset) =
          make_uint4(tail_of(x.x), tail_of(x.y), tail_of(x.z), tail_of(x.w));
      const float4 y = *reinterpret_cast<const float4*>(smem + qt * kTileF + offset);
      *reinterpret_cast<uint4*>(smem + kQLoAt * kTileF + offset) =
          make_uint4(tail_of(y.x), tail_of(y.y), tail_of(y.z), tail_of(y.w));
    }
    {
      const int s = tid % 64;  // a warp: 32 consecutive timesteps (one row of v^T each, conflict-free)
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int group = tid / 64 + 2 * i;  // four columns of v
        const float4 x = *reinterpret_cast<const float4*>(smem + vt * kTileF + at(s, 4 * group));
        const float xs[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          word(kVtHiAt, 4 * group + e, s) = xs[e];
          word(kVtLoAt, 4 * group + e, s) = __uint_as_float(tail_of(xs[e]));
        }
      }
    }
    fence_shared_writes();
    __syncthreads();  // the derived tiles, written by every warp

    float score[32], acc[32];
    fence();
#pragma unroll
    for (int s = 0; s < 8; ++s) {  // scores = Q K^T
      tf32_ss(score, k_step(tile(qt), s), k_step(tile(kt), s), s > 0);
      tf32_ss(score, k_step(tile(qt), s), k_step(tile(kKLoAt), s));
      tf32_ss(score, k_step(tile(kQLoAt), s), k_step(tile(kt), s));
    }
#pragma unroll
    for (int s = 0; s < 8; ++s) {  // out = Q S (S^T's copy, K = e)
      tf32_ss(acc, k_step(tile(qt), s), k_step(tile(kStLoAt), s), s > 0);
      tf32_ss(acc, k_step(tile(qt), s), k_step(tile(kStHiAt), s));
      tf32_ss(acc, k_step(tile(kQLoAt), s), k_step(tile(kStHiAt), s));
    }
    commit();
    issue(it + 1, ring.refill());
    wait<0>();

    // P = mask(scores) into A fragments: column c of k-step s sits in lane (g, c / 2), element c % 2
    // of n-tile s; this lane needs columns q4 and q4 + 4.
    const int64_t t0 = it * C;
    const int src = (lane & ~3) | (q4 >> 1);
    uint32_t p_hi[8][4], p_lo[8][4];
#pragma unroll
    for (int s = 0; s < 8; ++s)
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // rows g, g + 8
        const int row = 16 * warp + g + 8 * h;
#pragma unroll
        for (int half = 0; half < 2; ++half) {  // columns q4, q4 + 4
          const float x0 = __shfl_sync(0xffffffffu, score[4 * s + 2 * h], src + 2 * half);
          const float x1 = __shfl_sync(0xffffffffu, score[4 * s + 2 * h + 1], src + 2 * half);
          const float x = 8 * s + q4 + 4 * half <= row ? (q4 % 2 ? x1 : x0) : 0.f;
          p_hi[s][h + 2 * half] = head_of(x);
          p_lo[s][h + 2 * half] = tail_of(x);
        }
      }
    fence();
#pragma unroll
    for (int s = 0; s < 8; ++s) {  // out += P V (v^T, K = s)
      tf32_rs(acc, p_hi[s], k_step(tile(kVtHiAt), s));
      tf32_rs(acc, p_hi[s], k_step(tile(kVtLoAt), s));
      tf32_rs(acc, p_lo[s], k_step(tile(kVtHiAt), s));
    }
    commit();
    wait<0>();  // (gathering K^T while P V ran spilled: 255 registers and 244 bytes)
    // K^T as A fragments: rows e = 16 warp + g (+8), k-step s columns (timesteps) 8 s + q4 (+4)
    uint32_t kt_hi[8][4], kt_lo[8][4];
#pragma unroll
    for (int s = 0; s < 8; ++s)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float x = word(kt, 8 * s + q4 + 4 * (r / 2), 16 * warp + g + 8 * (r % 2));
        kt_hi[s][r] = head_of(x), kt_lo[s][r] = tail_of(x);
      }
    fence();
#pragma unroll
    for (int s = 0; s < 8; ++s) {  // S += K^T V
      tf32_rs(state, kt_hi[s], k_step(tile(kVtHiAt), s));
      tf32_rs(state, kt_hi[s], k_step(tile(kVtLoAt), s));
      tf32_rs(state, kt_lo[s], k_step(tile(kVtHiAt), s));
    }
    commit();
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t t = t0 + 16 * warp + g + 8 * h;
        if (t < L) {
          *reinterpret_cast<float2*>(op + t * D + 8 * j + 2 * q4) =
              make_float2(acc[4 * j + 2 * h] * scale, acc[4 * j + 2 * h + 1] * scale);
        }
      }
    wait<0>();
    __syncthreads();  // every warp's wgmma has read this chunk's tiles and the state's copy
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // S^T[m][e] = S[e][m]
        const int e = 16 * warp + g + 8 * (i / 2), m = 8 * j + 2 * q4 + i % 2;
        const float x = state[4 * j + i];
        word(kStHiAt, m, e) = x;
        word(kStLoAt, m, e) = __uint_as_float(tail_of(x));
      }
  }
#else
  __trap();
#endif
}

torch::Tensor forward(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale) {
  for (const auto* x : {&q, &k, &v}) {
    TORCH_CHECK(x->is_cuda() && x->scalar_type() == at::kFloat && x->is_contiguous() && x->dim() == 4 &&
                    x->size(3) == D && x->sizes() == q.sizes(),
                "the prototype takes contiguous float32 [B, H, L, 64] on CUDA, all three alike");
  }
  auto out = torch::empty_like(q);
  const int64_t pairs = q.size(0) * q.size(1), L = q.size(2);
  C10_CUDA_CHECK(cudaFuncSetAttribute(tf32_forward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  tf32_forward_kernel<<<unsigned(pairs), 128, kSmem, c10::cuda::getCurrentCUDAStream()>>>(
      q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), out.data_ptr<float>(), L, float(scale));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("forward", &forward); }
