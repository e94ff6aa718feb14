// The chunked family on tensor cores (mma.sync, float32 accumulation), every intermediate
// product kept in registers: the chunked products of chunked_product.cuh,
//
//   P = mask(A B^T),  out = P Cc + A S,  S += B^T Cc,
//
// laid out as flash-attention 2 lays out its softmax(Q K^T) V. A block is 4 warps and owns one
// (sequence, head), NB columns of c (64; 32 when the state has DA = 256 rows, where 64 do not fit
// the registers) and one time segment. Per chunk of C = 64 timesteps, warp w owns the chunk's
// rows 16w .. 16w + 15: its scores (a 16 x 64 accumulator) are masked,
// take the extra row and the normalizer's row sums in registers, and become the A operand of
// P Cc without leaving registers. The state S (DA x NB, float32) is split by rows over the warps,
// also in accumulators; a copy in shared memory (bfloat16: two parts, see kStateParts) serves the
// A S product of the next chunk.
//
// float16 and bfloat16: one m16n8k16 MMA a step, operands (and the state copy) 16-bit, loaded
// with ldmatrix from rows padded by 16 bytes; float16's copy is scaled by a power of two where the
// state passes float16's range. float32: 3xTF32, three m16n8k8 TF32 MMAs a step
// (see MmaTraits<float>), operands and state copy float32, so float32 stays float32-accurate;
// one TF32 MMA a step only when the user allowed TF32 for float32 matmuls (KernelParams::tf32).
//
// History: a WMMA version that went through shared memory between every product measured no
// faster than the CUDA-core families (bf16 within -15% .. +17% of the recurrent family, fp32 2x
// slower; benchmarks/RESULTS.md); this one removes exactly those round trips, and writes its
// outputs through shared memory 16 bytes a lane (H200, bf16 8,16,2048,64 forward: 0.180 ms with
// element-wise stores, per-copy address arithmetic and a partial second wave of segments, 0.094 ms
// without). The default family for
// float16/bfloat16/float32 where it measured faster (dispatch.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "chunked_product.cuh"

namespace fast_causal_attn {
namespace cuda {
namespace tensorcore {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * kWarp;
constexpr int C = 64;   // timesteps per chunk: 16 rows a warp
// Columns of c per block (NB): 64, or 32 for DA = 256, where 64 would not fit the state in registers.
static_assert(C == 16 * kWarps, "each warp owns 16 rows of the chunk");

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8 x 8 16-bit matrices from shared memory; lane l gives the address of row l % 8 of
// matrix l / 8 and receives, of matrix i, register r[i]: row l / 4, columns 2 (l % 4) and + 1
// (with .trans: rows 2 (l % 4) and + 1 of column l / 4).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row))
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row))
               : "memory");
}
// The same from a shared-memory address (shared_address's).
__device__ __forceinline__ void ldmatrix_x4_at(uint32_t (&r)[4], uint32_t row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(row)
               : "memory");
}

// 32-bit and 16-byte accesses at shared-memory addresses (shared_address's). The chunk buffers'
// pointers come out of a runtime choice of buffer, which loses their address space: written
// through them, nvcc issued generic loads and stores with 64-bit address arithmetic (bf16 DA = 64
// forward, write_outputs: four integer instructions an access, SASS).
__device__ __forceinline__ void store_shared(uint32_t address, uint32_t value) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(address), "r"(value) : "memory");
}
__device__ __forceinline__ void store_shared(uint32_t address, float lo, float hi) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(address), "f"(lo), "f"(hi) : "memory");
}
__device__ __forceinline__ uint4 load_shared_16(uint32_t address) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(address)
               : "memory");
  return v;
}
// 16 bytes to global memory as one store (a C++ store of load_shared_16's result was split in four)
__device__ __forceinline__ void store_global_16(void* to, uint4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"l"(to), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// Where lane l points ldmatrix for each operand shape (m = l / 8 the matrix, r = l % 8 its row),
// for the fragment tile at (row0, k0) of a row-major array with row stride ld.
struct Lane {
  int m, r;
  __device__ Lane() : m((threadIdx.x % kWarp) / 8), r(threadIdx.x % 8) {}
  // A (16 x 16) stored as [row][k]: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7,
  // k 8-15), (rows 8-15, k 8-15) are a0..a3.
  __device__ int a_row_major(int row0, int k0, int ld) const {
    return (row0 + (m & 1) * 8 + r) * ld + k0 + (m >> 1) * 8;
  }
  // A (16 x 16) stored as [k][row] (a transposed operand), with .trans.
  __device__ int a_k_major(int row0, int k0, int ld) const { return (k0 + (m >> 1) * 8 + r) * ld + row0 + (m & 1) * 8; }
  // Two B fragments (k 16 x n 8, columns n0 and n0 + 8) stored as [n][k]: b0, b1 of the first,
  // then of the second.
  __device__ int b_n_major(int n0, int k0, int ld) const { return (n0 + (m >> 1) * 8 + r) * ld + k0 + (m & 1) * 8; }
  // The same stored as [k][n], with .trans.
  __device__ int b_k_major(int k0, int n0, int ld) const { return (k0 + (m & 1) * 8 + r) * ld + n0 + (m >> 1) * 8; }
};

// How each input dtype feeds the MMAs. Fragments hold what one m16n8kK step reads: A 16 x K,
// B K x 8 (two of them, columns n0 and n0 + 8, per load). Every load names how its operand is
// stored in shared memory: A as [row][k] or [k][row], B as [n][k] or [k][n].
template <typename scalar_t>
struct MmaTraits {  // float16, bfloat16: one m16n8k16 MMA a step, operands loaded with ldmatrix
  using Smem = scalar_t;
  static constexpr int kK = 16;
  static constexpr int kPadAB = 8, kPadC = 8, kPadS = 8;  // 16-byte row padding: conflict-free ldmatrix
  // bfloat16 keeps the state's copy as two bfloat16 parts, S = hi + lo (hi = S rounded, lo = the
  // remainder rounded), and multiplies both. Rounded to one bfloat16, the copy took the outputs
  // from 1.66e-3 (the outputs' own rounding) to 2.35e-3 relative error vs float64 (H200, every
  // issue shape; fla's chunk and fused_chunk: 2.35e-3 too), over the 2.3e-3 issue 5 holds bfloat16
  // to; with two parts 1.66e-3 - 1.69e-3. The cost (H200 GPU busy, fwd+bwd): +10-14% at DA = 64
  // (the A S product's MMAs doubled), +25-27% at DA = 128, where with the second part's 18 KB two
  // blocks a multiprocessor fit only one chunk buffer (the launcher's pick; two buffers fit one
  // block), +12% at DA = 256. float16's copy rounds 8x finer (2.93e-4 measured against its own
  // 2.08e-4): one part.
  static constexpr int kStateParts = std::is_same_v<scalar_t, at::BFloat16> ? 2 : 1;
  struct AFrag {
    uint32_t r[4];
  };
  struct BFrag {
    uint32_t r[2];
  };

  __device__ static void load_a(AFrag& a, const Smem* x, int row0, int k0, int ld) {
    ldmatrix_x4(a.r, x + Lane().a_row_major(row0, k0, ld));
  }
  __device__ static void load_a_k_major(AFrag& a, const Smem* x, int row0, int k0, int ld) {
    ldmatrix_x4_trans(a.r, x + Lane().a_k_major(row0, k0, ld));
  }
  __device__ static void load_b_n_major(BFrag (&b)[2], const Smem* x, int n0, int k0, int ld) {
    uint32_t r[4];
    ldmatrix_x4(r, x + Lane().b_n_major(n0, k0, ld));
    b[0].r[0] = r[0], b[0].r[1] = r[1], b[1].r[0] = r[2], b[1].r[1] = r[3];
  }
  __device__ static void load_b_k_major(BFrag (&b)[2], const Smem* x, int k0, int n0, int ld) {
    uint32_t r[4];
    ldmatrix_x4_trans(r, x + Lane().b_k_major(k0, n0, ld));
    b[0].r[0] = r[0], b[0].r[1] = r[1], b[1].r[0] = r[2], b[1].r[1] = r[3];
  }
  // B of the P Cc product, whose A comes from score_as_a: the same k order here.
  __device__ static void load_b_after_scores(BFrag (&b)[2], const Smem* x, int k0, int n0, int ld) {
    load_b_k_major(b, x, k0, n0, ld);
  }
  // B of the scores from a chunk buffer, whose address changes every chunk (two buffers): this
  // lane's part of the address (Lane's offsets at tile (0, 0)) taken once a chunk and kept in a
  // register (the empty asm hides it from rematerialization), each load then adding a constant
  // that folds into the instruction. Left to itself, nvcc recomputed the lane's offsets for every
  // ldmatrix, inside the causal mask's skips (four integer instructions each: bf16 DA = 64
  // forward's chunk loop 2725 -> 2666 SASS instructions). The other chunk-buffer loads gained
  // nothing this way (the state update's) or cost float16's forward a spill (P Cc's).
  __device__ static uint32_t lane_address(const Smem* x, int lane_offset) {
    uint32_t address = shared_address(x + lane_offset);
    asm volatile("" : "+r"(address));
    return address;
  }
  __device__ static uint32_t b_n_major_lane(const Smem* x, int ld) { return lane_address(x, Lane().b_n_major(0, 0, ld)); }
  // At tile (n0, k0) of B stored [n][k], from b_n_major_lane's address.
  __device__ static void load_b_n_major_at(BFrag (&b)[2], uint32_t lane, int n0, int k0, int ld) {
    uint32_t r[4];
    ldmatrix_x4_at(r, lane + uint32_t((n0 * ld + k0) * int(sizeof(Smem))));
    b[0].r[0] = r[0], b[0].r[1] = r[1], b[1].r[0] = r[2], b[1].r[1] = r[3];
  }
  // k-step k of the masked scores (columns 16k .. 16k + 15) as an A fragment: an accumulator pair
  // is an A fragment, rounded to the input dtype.
  __device__ static void score_as_a(AFrag& a, const float (&score)[8][4], int k) {
    a.r[0] = pack(score[2 * k][0], score[2 * k][1]);
    a.r[1] = pack(score[2 * k][2], score[2 * k][3]);
    a.r[2] = pack(score[2 * k + 1][0], score[2 * k + 1][1]);
    a.r[3] = pack(score[2 * k + 1][2], score[2 * k + 1][3]);
  }
  __device__ static void mma(float (&d)[4], const AFrag& a, const BFrag& b, bool /*tf32*/) {
    if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
          "{%0, %1, %2, %3};\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
          : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[0]), "r"(b.r[1]));
    } else {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
          "{%0, %1, %2, %3};\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
          : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[0]), "r"(b.r[1]));
    }
  }
  // Two adjacent elements (col even) at a shared-memory address: an output row's.
  __device__ static void store_pair_at(uint32_t address, float lo, float hi) { store_shared(address, pack(lo, hi)); }
  // Two adjacent elements of the state copy as kStateParts parts: part p at dst + p * part_stride
  // (see kStateParts).
  __device__ static void store_state_pair(Smem* dst, size_t part_stride, float x, float y) {
    const uint32_t head = pack(x, y);
    *reinterpret_cast<uint32_t*>(dst) = head;
    if constexpr (kStateParts == 2) {  // bfloat16: a bfloat16 is the top half of its float
      *reinterpret_cast<uint32_t*>(dst + part_stride) =
          pack(x - __uint_as_float(head << 16), y - __uint_as_float(head & 0xffff0000u));
    }
  }
  // The two elements of a 32-bit word, each times f, rounded back.
  __device__ static uint32_t scale_word(uint32_t w, float f) {
    return pack(to_float(uint16_t(w & 0xffffu)) * f, to_float(uint16_t(w >> 16)) * f);
  }
  __device__ static float to_float(uint16_t bits) {
    if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
      return __bfloat162float(__ushort_as_bfloat16(bits));
    } else {
      return __half2float(__ushort_as_half(bits));
    }
  }

  // Two floats rounded to the input dtype, packed as one 32-bit register (lo in the low half).
  __device__ static uint32_t pack(float lo, float hi) {
    if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
      const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
      return *reinterpret_cast<const uint32_t*>(&v);
    } else {
      const __half2 v = __floats2half2_rn(lo, hi);
      return *reinterpret_cast<const uint32_t*>(&v);
    }
  }
};

// float32: three m16n8k8 TF32 MMAs a step (3xTF32: each operand split into a TF32 head and its
// remainder, tail x tail dropped; see split), float32-level accuracy on tensor cores. Operands
// stay float32 in shared memory, read with 32-bit loads; the state copy is float32 too.
template <>
struct MmaTraits<float> {
  using Smem = float;
  static constexpr int kK = 8;
  // Rows padded to 4 (mod 32 words) for [row][k] and [n][k] reads, 8 for [k][n] reads: bank
  // conflict-free for the lanes' (g, q) patterns below.
  static constexpr int kPadAB = 4, kPadC = 8, kPadS = 8;
  struct AFrag {
    uint32_t hi[4], lo[4];
  };
  struct BFrag {
    uint32_t hi[2], lo[2];
  };

  // The head: x truncated to TF32's 10 fraction bits (its 13 low bits cleared, one instruction);
  // the tail: the exact remainder x - head, which the tensor core truncates to TF32 in turn (it
  // ignores an operand's 13 low bits). The split is most of float32's non-MMA instructions (every
  // element of every operand, in every warp that loads it: at DA = 128 about 45% of the forward's,
  // H200 ncu), so it is kept to two; a head rounded to nearest (half an ulp added first, CUTLASS's
  // round_half_ulp_truncate) was one more, and cost 9-20% of float32's time (H200 CUDA-graph
  // replays, fwd+bwd ms rounded / truncated: 8,16,2048,64 0.854 / 0.740; 1,16,32768,128 10.30 /
  // 8.30). Error against float64 (same runs): 1.27e-6 -> 1.92e-6 at 8,16,2048,64, 1.72e-6 ->
  // 2.37e-6 at 1,16,32768,128, under float32's 1e-5 (a float64 emulation of the products alone:
  // 1.1e-7 -> 6.3e-7; the tensor cores' own accumulation is the rest). With TF32 allowed (the head
  // alone) 4.15e-4 -> 1.48e-3, what fla's TF32 kernels give. An infinite x gives NaN here
  // (inf - inf in the tail), as it would in the sums of the products anyway.
  __device__ static void split(float x, uint32_t& hi, uint32_t& lo) {
    hi = __float_as_uint(x) & 0xffffe000u;
    lo = __float_as_uint(x - __uint_as_float(hi));
  }
  // A fragment (m16n8k8, tf32): a0 (row g, k q), a1 (row g + 8, k q), a2 (row g, k q + 4),
  // a3 (row g + 8, k q + 4); B: b0 (k q, column g), b1 (k q + 4, column g).
  template <typename At>
  __device__ static void fill_a(AFrag& a, At at) {
    const int lane = threadIdx.x % kWarp, g = lane / 4, q = lane % 4;
    split(at(g, q), a.hi[0], a.lo[0]);
    split(at(g + 8, q), a.hi[1], a.lo[1]);
    split(at(g, q + 4), a.hi[2], a.lo[2]);
    split(at(g + 8, q + 4), a.hi[3], a.lo[3]);
  }
  template <typename Bt>
  __device__ static void fill_b(BFrag (&b)[2], Bt bt) {  // bt(k, n) over n in [0, 16)
    const int lane = threadIdx.x % kWarp, g = lane / 4, q = lane % 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      split(bt(q, 8 * h + g), b[h].hi[0], b[h].lo[0]);
      split(bt(q + 4, 8 * h + g), b[h].hi[1], b[h].lo[1]);
    }
  }
  __device__ static void load_a(AFrag& a, const Smem* x, int row0, int k0, int ld) {
    fill_a(a, [&](int r, int k) { return x[(row0 + r) * ld + k0 + k]; });
  }
  __device__ static void load_a_k_major(AFrag& a, const Smem* x, int row0, int k0, int ld) {
    fill_a(a, [&](int r, int k) { return x[(k0 + k) * ld + row0 + r]; });
  }
  __device__ static void load_b_n_major(BFrag (&b)[2], const Smem* x, int n0, int k0, int ld) {
    fill_b(b, [&](int k, int n) { return x[(n0 + n) * ld + k0 + k]; });
  }
  __device__ static void load_b_k_major(BFrag (&b)[2], const Smem* x, int k0, int n0, int ld) {
    fill_b(b, [&](int k, int n) { return x[(k0 + k) * ld + n0 + n]; });
  }
  // score_as_a takes the accumulator's columns in the order 2q, 2q + 1 (k = q and q + 4 of the
  // fragment): the MMA sums over k in any order, so B follows the same one.
  __device__ static void load_b_after_scores(BFrag (&b)[2], const Smem* x, int k0, int n0, int ld) {
    fill_b(b, [&](int k, int n) { return x[(k0 + (k < 4 ? 2 * k : 2 * (k - 4) + 1)) * ld + n0 + n]; });
  }
  // k-step k of the masked scores (columns 8k .. 8k + 7): accumulator n-tile k, its columns
  // permuted as load_b_after_scores expects; no shuffles.
  __device__ static void score_as_a(AFrag& a, const float (&score)[8][4], int k) {
    split(score[k][0], a.hi[0], a.lo[0]);  // (g, 2q)     -> k = q
    split(score[k][2], a.hi[1], a.lo[1]);  // (g + 8, 2q) -> k = q
    split(score[k][1], a.hi[2], a.lo[2]);  // (g, 2q + 1) -> k = q + 4
    split(score[k][3], a.hi[3], a.lo[3]);
  }
  __device__ static void mma_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  // tf32: the user allowed TF32 for float32 matmuls (KernelParams::tf32): the heads alone.
  __device__ static void mma(float (&d)[4], const AFrag& a, const BFrag& b, bool tf32) {
    if (!tf32) {
      mma_tf32(d, a.lo, b.hi);  // the small terms first
      mma_tf32(d, a.hi, b.lo);
    }
    mma_tf32(d, a.hi, b.hi);
  }
  static constexpr int kStateParts = 1;  // the copy is float32
  __device__ static void store_pair_at(uint32_t address, float lo, float hi) { store_shared(address, lo, hi); }
  __device__ static void store_state_pair(Smem* dst, size_t, float x, float y) {
    *reinterpret_cast<float2*>(dst) = make_float2(x, y);
  }
  __device__ static uint32_t scale_word(uint32_t w, float f) { return __float_as_uint(__uint_as_float(w) * f); }
};

// Shared memory, in bytes from the start, rows padded as the traits say: the state's copy and
// vectors, then one or two chunk buffers (two when the chunks are staged asynchronously, the next
// one arriving while this one is worked on).
template <typename T, int DA, int NB, bool kSecondA = false>
struct Layout {
  using Smem = typename T::Smem;
  static constexpr int kDA = DA, kNB = NB;
  static constexpr int kAB = DA + T::kPadAB;  // row strides, in elements
  static constexpr int kCS = NB + T::kPadC;
  static constexpr int kSS = NB + T::kPadS;
  static constexpr size_t kElem = sizeof(Smem);
  static constexpr size_t s_copy = 0;  // [kStateParts][DA][kSS]: the state entering the chunk
  static constexpr size_t s_part = size_t(DA) * kSS;                       // elements between its parts
  static constexpr size_t extra_state = T::kStateParts * s_part * kElem;  // [NB] float
  static constexpr size_t key_sum = extra_state + NB * 4;               // [DA]
  static constexpr size_t warp_max = key_sum + DA * 4;                       // [kWarps] float
  static constexpr size_t buffers = (warp_max + kWarps * 4 + 15) / 16 * 16;  // the chunk buffers
  // One chunk buffer, offsets from its start:
  static constexpr size_t a = 0;                                // [C][kAB]
  static constexpr size_t b = a + size_t(C) * kAB * kElem;      // [C][kAB]
  static constexpr size_t c = b + size_t(C) * kAB * kElem;      // [C][kCS]
  static constexpr size_t extra_a = c + size_t(C) * kCS * kElem;  // [C] float
  static constexpr size_t extra_b = extra_a + C * 4;              // [C]
  static constexpr size_t a2 = extra_b + C * 4;                   // [C][kAB], the fused pass's k
  static constexpr size_t buffer = (a2 + (kSecondA ? size_t(C) * kAB * kElem : 0) + 15) / 16 * 16;
  static constexpr size_t bytes(int count) { return buffers + count * buffer; }
  // Two buffers where they fit the multiprocessor's 227 KB (float32 at DA = 256: one); the
  // launcher picks how many a launch uses. A third (two chunks on their way) measured slower
  // wherever it fit (H200 fwd+bwd ms, three / two buffers: bf16 4,16,8192,64 0.772 / 0.600,
  // 8,16,2048,128 1.140 / 0.704; float32 8,16,2048,64 1.402 / 1.551, one buffer 1.162).
  static constexpr int kBuffers = bytes(2) <= 227 * 1024 ? 2 : 1;
  // Two buffers sharing buffer 0's a region (KernelParams::shared_a): the second starts where its
  // b would follow the first buffer's end, so that it lacks only its a.
  static constexpr size_t second_without_a = buffers + buffer - b;
  static constexpr size_t bytes_shared_a() { return bytes(2) - b; }
  static constexpr int blocks_by_smem(size_t bytes) { return int(228 * 1024 / (bytes + 1024)); }  // 1 KB reserved
  // Compiled in only where the launcher can pick it: two full buffers leave one block a
  // multiprocessor and the shared ones as many as one buffer, at least two (registers, at most
  // 255 a thread, hold two blocks of 128 threads), which is bfloat16 at DA = 128 (its two-part
  // state copy). Elsewhere its code cost the 16-bit DA = 64 kernels 3-7% (H200 GPU busy, bf16
  // 8,16,2048,64 forward 0.079 -> 0.082 ms, fp16 fwd+bwd 0.246 -> 0.258) though never taken.
  // Each warp stages its own 16 rows of a (stage_vectors' kTeam = kWarp): whole vectors a lane.
  static constexpr bool kSharedA = kWarp % (DA * kElem / 16) == 0 && kBuffers == 2 && blocks_by_smem(bytes(2)) == 1 &&
                                   blocks_by_smem(bytes_shared_a()) >= std::max(2, blocks_by_smem(bytes(1)));
  static_assert(bytes(1) <= 227 * 1024, "one chunk buffer fits");
  static_assert(b % 16 == 0 && c % 16 == 0 && extra_a % 16 == 0 && a2 % 16 == 0, "rows stay 16-byte aligned");
  static_assert(DA % (16 * kWarps) == 0, "each warp owns DA / 4 rows of the state, whole 16-row tiles");
};

// Where this lane's accumulator elements sit: element e of n-tile j of a 16-row accumulator is at
// row g + 8 (e / 2), column 8 j + 2 q + e % 2 (g = lane / 4, q = lane % 4). f(j, e, row, col) for
// each, rows from row0, columns of kTiles n-tiles.
template <int kTiles, typename F>
__device__ __forceinline__ void for_each_accumulator(int row0, F f) {
  const int lane = threadIdx.x % kWarp, g = lane / 4, q = lane % 4;
#pragma unroll
  for (int j = 0; j < kTiles; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) f(j, e, row0 + g + (e >> 1) * 8, 8 * j + 2 * q + (e & 1));
}

// acc (16 rows, kTiles n-tiles of 8 columns) += 16 rows of A (a_s from row0, row stride ld) times
// B over k = 0 .. DA: load_b(b, k, pair, part) loads part `part` (of kParts: the state copy's
// parts, see MmaTraits::kStateParts; 1 elsewhere) of B's 16 columns of tiles 2 pair and 2 pair + 1;
// pairs with skip(pair) are left out (wholly outside the causal mask). kUnroll: how far the
// k-loop unrolls.
template <typename T, int DA, int kUnroll, int kTiles, int kParts = 1, typename LoadB, typename Skip>
__device__ __forceinline__ void accumulate_a_rows(float (&acc)[kTiles][4], const typename T::Smem* a_s, int row0,
                                                  int ld, bool tf32, LoadB load_b, Skip skip) {
  constexpr int kPairs = kTiles / 2;
#pragma unroll kUnroll
  for (int k = 0; k < DA; k += T::kK) {
    typename T::AFrag a;
    T::load_a(a, a_s, row0, k, ld);
#pragma unroll
    for (int pair = 0; pair < kPairs; ++pair) {
      if (skip(pair)) continue;
#pragma unroll
      for (int part = kParts - 1; part >= 0; --part) {  // the small part first
        typename T::BFrag b[2];
        load_b(b, k, pair, part);
        T::mma(acc[2 * pair], a, b[0], tf32);
        T::mma(acc[2 * pair + 1], a, b[1], tf32);
      }
    }
  }
}

// One chunk's operands in shared memory.
template <typename Smem>
struct ChunkBuffer {
  Smem *a, *b, *c;
  float *extra_a, *extra_b;
  Smem* a2;  // the fused pass's second A operand (k), else unused
};

// A 16-byte copy from global to shared memory that does not wait (cp.async); zeros when !valid.
__device__ __forceinline__ void copy_async_16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
// The copies issued since the last commit become one group; wait_async_copies waits until every
// group this thread issued is done but the kPending most recent ones.
__device__ __forceinline__ void commit_async_copies() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending = 0>
__device__ __forceinline__ void wait_async_copies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Stages kRows x kWidth elements of one operand 16 bytes at a time: rows [t0, t0 + n) of x from
// column col0, `valid` columns (whole vectors), zeros elsewhere; with `scale`, each row then times
// factor(t). The same values as chunked::stage of ops.a_at etc. Phase 0 issues this thread's
// copies (cp.async: all of them in flight at once, no registers held); phase 1, after
// wait_async_copies, scales the vectors this thread copied (its own copies are complete and
// visible to it, so no barrier is needed between). A thread keeps one column and steps down the
// rows, so that the 64-bit address arithmetic happens once a chunk (per copy it was most of the
// staging's instructions). Needs KernelParams::rows_are_vectors.
// kTeam: the threads that share the rows (the block's; kWarp: one warp's own rows).
template <int kRows, int kWidth, int kStride, int kTeam = kThreads, typename scalar_t, typename Rows, typename Factor>
__device__ __forceinline__ void stage_vectors(int phase, scalar_t* dst, Rows x, int64_t t0, int n, int64_t col0,
                                              int valid, bool scale, Factor factor) {
  constexpr int kVec = 16 / int(sizeof(scalar_t));
  constexpr int kGroups = kWidth / kVec;    // vectors a row
  constexpr int kStep = kTeam / kGroups;  // rows between a thread's vectors
  static_assert(kWidth % kVec == 0 && kTeam % kGroups == 0 && kRows % kStep == 0, "whole vectors, even split");
  if (phase == 1 && !scale) return;
  const unsigned member = kTeam == kThreads ? threadIdx.x : threadIdx.x % kTeam;  // unsigned: shifts, not divisions
  const int row0 = member / kGroups, col = (member % kGroups) * kVec;
  const bool column_inside = col < valid;
  const scalar_t* src = x.ptr + (t0 + row0) * x.stride + col0 + col;
  const int64_t src_step = int64_t(kStep) * x.stride;
  scalar_t* to = dst + row0 * kStride + col;
  // row0 < kStep: every thread takes kRows / kStep rows, with no exit test a row.
#pragma unroll
  for (int i = 0; i < kRows / kStep; ++i, src += src_step, to += kStep * kStride) {
    const int row = row0 + i * kStep;
    const bool inside = column_inside && row < n;
    if (phase == 0) {
      copy_async_16(to, inside ? src : x.ptr, inside);
    } else if (inside) {
      using T = MmaTraits<scalar_t>;
      const float f = factor(t0 + row);
      const uint4 v = *reinterpret_cast<const uint4*>(to);
      *reinterpret_cast<uint4*>(to) =
          make_uint4(T::scale_word(v.x, f), T::scale_word(v.y, f), T::scale_word(v.z, f), T::scale_word(v.w, f));
    }
  }
}

// chunked::stage_chunk, 16 bytes at a time, in two steps: issue_chunk starts the chunk's copies
// (and stores its extra row) as one group, finish_chunk waits for this thread's copies and
// rescales what it copied where the operand has a factor. A barrier after finish_chunk makes the chunk visible.
template <typename S, typename Smem, typename Ops>
__device__ __forceinline__ void stage_chunk_vectors(int phase, const ChunkBuffer<Smem>& buf, const Ops& ops,
                                                    int64_t t0, int n, int64_t Da, int64_t m0, int cols, bool with_a,
                                                    bool extra_row) {
  const int da = int(Da);
  if (with_a) {
    stage_vectors<C, S::kDA, S::kAB>(phase, buf.a, ops.a_rows(), t0, n, 0, da, !ops.a_is_plain(),
                                     [&](int64_t t) { return ops.a_factor(t); });
  }
  stage_vectors<C, S::kDA, S::kAB>(phase, buf.b, ops.b_rows(), t0, n, 0, da, !ops.b_is_plain(),
                                   [&](int64_t t) { return ops.b_factor(t); });
  stage_vectors<C, S::kNB, S::kCS>(phase, buf.c, ops.c_rows(), t0, n, m0, cols, !ops.c_is_plain(),
                                   [&](int64_t t) { return ops.c_factor(t); });
  if (phase == 0 && extra_row) chunked::stage_extra_row<C>(buf.extra_a, buf.extra_b, ops, t0, n);
}
template <typename S, typename Smem, typename Ops>
__device__ __forceinline__ void issue_chunk(const ChunkBuffer<Smem>& buf, const Ops& ops, int64_t t0, int n,
                                            int64_t Da, int64_t m0, int cols, bool with_a, bool extra_row) {
  stage_chunk_vectors<S>(0, buf, ops, t0, n, Da, m0, cols, with_a, extra_row);
}
// one_pending: a later chunk was issued after this one and may still be on its way.
template <typename S, typename Smem, typename Ops>
__device__ __forceinline__ void finish_chunk(const ChunkBuffer<Smem>& buf, const Ops& ops, int64_t t0, int n,
                                             int64_t Da, int64_t m0, int cols, bool with_a, bool extra_row,
                                             bool one_pending) {
  if (one_pending) {
    wait_async_copies<1>();
  } else {
    wait_async_copies<0>();
  }
  stage_chunk_vectors<S>(1, buf, ops, t0, n, Da, m0, cols, with_a, extra_row);
}

// One warp writes 16 rows x S::kNB columns from its rows of an A buffer (row stride S::kAB) to out
// (row stride out_l): rows below `rows`, columns below `cols`; 16 bytes a lane when `vectors`
// (rows 16-byte aligned, cols whole vectors), else one element a lane.
template <typename S, typename scalar_t>
__device__ __forceinline__ void write_rows(const scalar_t* src, scalar_t* out, int64_t out_l, int rows, int cols,
                                           bool vectors) {
  constexpr int NB = S::kNB, kStride = S::kAB;
  const int lane = threadIdx.x % kWarp;
  if (vectors) {
    // A lane keeps one column and steps down the rows: its addresses are worked out once
    constexpr int kVec = 16 / int(sizeof(scalar_t)), kGroups = NB / kVec, kRowStep = kWarp / kGroups;
    static_assert(kWarp % kGroups == 0 && 16 % kRowStep == 0, "whole rows a step");
    const int row0 = lane / kGroups, col = (lane % kGroups) * kVec;
    if (col < cols) {
      scalar_t* to = out + row0 * out_l + col;
      const uint32_t from = shared_address(src + row0 * kStride + col);
#pragma unroll
      for (int i = 0; i < 16 / kRowStep; ++i, to += kRowStep * out_l) {
        if (row0 + i * kRowStep < rows) {
          store_global_16(to, load_shared_16(from + uint32_t(i * kRowStep * kStride * sizeof(scalar_t))));
        }
      }
    }
  } else {
    for (int i = lane; i < 16 * NB; i += kWarp) {
      const int row = i / NB, col = i % NB;
      if (row < rows && col < cols) out[row * out_l + col] = src[row * kStride + col];
    }
  }
}

// Blocks a multiprocessor holds by shared memory at the launcher's usual buffer count (two for
// 16-bit inputs, one for float32; 1 KB a block reserved), at most three: the bound the register
// allocator works to. Left without one, ptxas picked 160-250 registers as the code around
// changed (bf16 DA = 64: forward 160 or 247, dq 234), two blocks where shared memory held three;
// bound, float32 DA = 64 fits 168 registers with no spills (three blocks instead of two), the
// 16-bit passes at DA = 64 168 with 0-24 bytes spilled, the others (one or two blocks) up to 255.
template <Pass P, typename scalar_t, int DA, int NB>
constexpr int min_blocks_per_multiprocessor() {
  using S = Layout<MmaTraits<scalar_t>, DA, NB, P == Pass::GradKV>;
  const size_t block = S::bytes(sizeof(typename S::Smem) == 4 ? 1 : 2) + 1024;
  return int(std::min<size_t>(3, 228 * 1024 / block));
}

}  // namespace tensorcore

template <Pass P, typename scalar_t, int DA, int NB>
__global__ void __launch_bounds__(tensorcore::kThreads, tensorcore::min_blocks_per_multiprocessor<P, scalar_t, DA, NB>())
    tensorcore_product_kernel(const KernelParams p, int64_t Da, int64_t Dc, int64_t col_tiles) {
  using namespace tensorcore;
  using acc_t = float;
  using T = MmaTraits<scalar_t>;
  using Smem = typename T::Smem;
  constexpr bool kFused = P == Pass::GradKV;  // dk and dv in one pass (see below)
  using S = Layout<T, DA, NB, kFused>;
  static_assert(!kFused || DA == NB, "the fused pass reads its state copy both ways: square");
  using AFrag = typename T::AFrag;
  using BFrag = typename T::BFrag;
  constexpr bool kReverse = PassTraits<P>::kReverse;
  constexpr int kK = T::kK;                        // the MMA's depth
  constexpr int kStateParts = T::kStateParts;      // the state copy's parts
  constexpr int kStateTiles = DA / (16 * kWarps);  // 16-row tiles of the state a warp owns
  // How far the k-loops over shared memory unroll. float32 (H200 CUDA-graph replays, fwd+bwd ms,
  // unrolled 1 / 2 / 4, none spilling since the split is two instructions): 8,16,2048,64 0.740 /
  // 0.727 / 0.765; 4,16,8192,64 1.433 / 1.414 / 1.486; 1,16,32768,128 8.32 / 7.78 / 7.42;
  // 8,16,2048,64,128 (DA = 128 in the dq and dk passes) 1.678 / 1.597 / 1.554: 4 at DA = 128, 2 at
  // 64. DA = 256 (float32 there by default only while its blocks fit one wave) stays rolled: it
  // spills a little either way, more unrolled. (With the three-instruction split, unrolled loops spilled at DA = 128 too.)
  constexpr int kUnrollK = sizeof(Smem) != 4 ? 4 : DA == 128 ? 4 : DA == 64 ? 2 : 1;
  // 16-bit scores load B through a lane address kept a chunk (MmaTraits::lane_address)
  constexpr bool kLaneAddresses = sizeof(Smem) == 2;

  extern __shared__ __align__(128) unsigned char tc_smem_raw[];
  Smem* s_copy = reinterpret_cast<Smem*>(tc_smem_raw + S::s_copy);
  float* extra_state_s = reinterpret_cast<float*>(tc_smem_raw + S::extra_state);
  float* key_sum_s = reinterpret_cast<float*>(tc_smem_raw + S::key_sum);
  float* warp_max_s = reinterpret_cast<float*>(tc_smem_raw + S::warp_max);
  // The state-only launch stages no a: with 16-bit inputs and no extra row, the a rows of the two
  // buffers hold a third chunk's b and c (slot 2), so that two chunks are on their way instead of
  // one (its blocks multiply little, and waited on their chunk for a third of their time: H200
  // ncu, bf16 8,16,2048,64). float32 (one buffer, or at DA = 128 one block a multiprocessor
  // either way) keeps the code without it: there it cost registers and spills.
  constexpr bool kDeepStates = sizeof(Smem) == 2 && S::kCS <= S::kAB;
  // Two buffers sharing one a region (KernelParams::shared_a; the launcher sets it only with two
  // buffers of vector rows, and only where the kernel has the code: S::kSharedA).
  const bool shared_a = S::kSharedA && p.shared_a;
  auto chunk_buffer = [&](int i) {
    if (kDeepStates && i == 2) {
      unsigned char* base = tc_smem_raw + S::buffers + S::a;
      return ChunkBuffer<Smem>{nullptr, reinterpret_cast<Smem*>(base), reinterpret_cast<Smem*>(base + S::buffer),
                               nullptr, nullptr, nullptr};
    }
    unsigned char* base = tc_smem_raw + (i == 1 && shared_a ? S::second_without_a : S::buffers + i * S::buffer);
    Smem* a = reinterpret_cast<Smem*>(tc_smem_raw + S::buffers + (shared_a ? 0 : i * S::buffer) + S::a);
    return ChunkBuffer<Smem>{a,                                          reinterpret_cast<Smem*>(base + S::b),
                             reinterpret_cast<Smem*>(base + S::c),       reinterpret_cast<float*>(base + S::extra_a),
                             reinterpret_cast<float*>(base + S::extra_b), reinterpret_cast<Smem*>(base + S::a2)};
  };

  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp;
  const int g = lane / 4, q = lane % 4;  // an accumulator's rows g and g + 8, columns 2q and 2q + 1
  const chunked::BlockWork<P, scalar_t> work(p, col_tiles, NB, Dc);
  const int64_t segment = work.segment, col_tile = work.col_tile, pair = work.pair, m0 = work.m0;
  const int cols = work.cols;
  const bool state_only = work.state_only, extra_row = work.extra_row, denominator = work.denominator;
  const bool track_key_sum = work.track_key_sum;
  Operands<P, scalar_t, acc_t> ops = work.operands(p);
  if constexpr (sizeof(scalar_t) == 2) ops.take_den_unit(p);  // (float16 under normalize, dk and dv)
  // The fused pass (GradKV, Da = M and Dc = E up to 64, one column tile) is the dk pass (a = v,
  // b = dO, c = q' = q scale / den, state S = sum dO^T q', out dk) plus the dv pass, whose
  // operands are the same arrays the other way round (a = k, b = q', c = dO) and whose state,
  // sum q'^T dO, is S^T: per chunk each warp's rows also take dv = mask(K q'^T) dO + K S^T, with
  // K staged as a second A operand (a2) and S^T read from the same state copy, n-major. One pass
  // stages q and dO once and keeps one state where two passes each did.
  const Operands<Pass::GradV, scalar_t, acc_t> ops_v(p, work.seq.b, work.seq.h, ops.den, nullptr, work.seq.begin);
  const bool tf32 = p.tf32;
  const int row_lo = 16 * warp + g, row_hi = row_lo + 8;  // this thread's rows of the chunk
  const int state_row0 = warp * (DA / kWarps);             // this warp's rows of the state

  // The state: tile i of this warp holds rows state_row0 + 16 i + (g, g + 8), columns 8 j + 2q (+1)
  // in state[i][j][0, 1] (row g) and [2, 3] (row g + 8).
  float state[kStateTiles][NB / 8][4];
  // This thread's entries of the key sum (rows tid + kThreads i < DA) and of the extra row's state
  // (column tid < NB).
  constexpr int kKeys = (DA + kThreads - 1) / kThreads;
  float key_sum[kKeys] = {}, extra_state = 0.f;
  {
    const SegmentStart<acc_t> start(p, pair, segment, Da, Dc);
#pragma unroll
    for (int i = 0; i < kStateTiles; ++i) {
      for_each_accumulator<NB / 8>(state_row0 + 16 * i, [&](int j, int e, int row, int col) {
        state[i][j][e] = (!state_only && row < Da && col < cols) ? start.state(row, m0 + col) : 0.f;
      });
    }
#pragma unroll
    for (int i = 0; i < kKeys; ++i) {
      const int row = tid + kThreads * i;
      if (!state_only && track_key_sum && row < Da) key_sum[i] = start.key_sum(row);
    }
    if (!state_only && extra_row && tid < cols) extra_state = start.extra(m0 + tid);
  }
  // float16 ends at 65504, and a state can pass that long before any output does (keys of a
  // positive feature map add up over thousands of steps). So the float16 copy holds S 2^-shift,
  // shift chosen each chunk from the block's largest |S| (none while that stays below 2^14: then
  // the copy is S, rounded), and the A S product is scaled back by copy_scale = 2^shift.
  constexpr bool kScaledCopy = std::is_same_v<scalar_t, at::Half>;
  float copy_scale = 1.f;
  // In two steps around a barrier the block passes anyway (the chunk's last): each warp posts its
  // largest |S| (post_warp_max, after the chunk's state update), then every thread reads the
  // four (choose_copy_scale, in publish). A barrier of its own between them was one more a chunk.
  auto post_warp_max = [&] {
    float largest = 0.f;
#pragma unroll
    for (int i = 0; i < kStateTiles; ++i)
#pragma unroll
      for (int j = 0; j < NB / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) largest = fmaxf(largest, fabsf(state[i][j][e]));
#pragma unroll
    for (int offset = kWarp / 2; offset > 0; offset /= 2) {
      largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, offset));
    }
    // the previous chunk's reads of warp_max_s are behind the loop's first barrier
    if (lane == 0) warp_max_s[warp] = largest;
  };
  auto choose_copy_scale = [&] {
    float largest = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) largest = fmaxf(largest, warp_max_s[w]);
    int shift = 0;
    if (largest > 16384.f && largest <= FLT_MAX) frexpf(largest / 16384.f, &shift);  // largest 2^-shift <= 2^14
    copy_scale = ldexpf(1.f, shift);
  };
  // The copy of the state in shared memory and the vectors, read by the next chunk's outputs;
  // float16: after post_warp_max and a barrier.
  auto publish = [&] {
    if constexpr (kScaledCopy) choose_copy_scale();
    const float inverse = 1.f / copy_scale;  // a power of two: exact
#pragma unroll
    for (int i = 0; i < kStateTiles; ++i)
#pragma unroll
      for (int j = 0; j < NB / 8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = state_row0 + 16 * i + g + h * 8, col = 8 * j + 2 * q;
          T::store_state_pair(s_copy + row * S::kSS + col, S::s_part, state[i][j][2 * h] * inverse,
                              state[i][j][2 * h + 1] * inverse);
        }
#pragma unroll
    for (int i = 0; i < kKeys; ++i) {
      if (tid + kThreads * i < DA) key_sum_s[tid + kThreads * i] = key_sum[i];
    }
    if (tid < NB) extra_state_s[tid] = extra_state;
  };
  if (!state_only) {
    if constexpr (kScaledCopy) {
      post_warp_max();
      __syncthreads();
    }
    publish();
  }

  // A S products read the state copy: scaled back by its scale (float16 only; see publish).
  auto scale_back = [&](float (&acc)[NB / 8][4]) {
    if (kScaledCopy && copy_scale != 1.f) {
#pragma unroll
      for (int j = 0; j < NB / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] *= copy_scale;
    }
  };
  // acc += P X for this warp's 16 rows: the masked scores P are the A operand straight from
  // registers, X (the chunk's rows t, row stride ld) the B operand; k-steps wholly outside the
  // causal mask are skipped.
  auto accumulate_scores_times = [&](float (&acc)[NB / 8][4], const float (&scores)[C / 8][4], const Smem* x, int ld) {
#pragma unroll
    for (int k = 0; k < C / kK; ++k) {
      if (kReverse ? k * kK < 16 * warp : k * kK >= 16 * (warp + 1)) continue;
      AFrag a;
      T::score_as_a(a, scores, k);
#pragma unroll
      for (int np = 0; np < NB / 16; ++np) {
        BFrag b[2];
        T::load_b_after_scores(b, x, k * kK, 16 * np, ld);
        T::mma(acc[2 * np], a, b[0], tf32);
        T::mma(acc[2 * np + 1], a, b[1], tf32);
      }
    }
  };
  // Writes this warp's 16 output rows: each value times its row's factor (factor[0] for row g,
  // [1] for g + 8), rounded to the output dtype into the warp's own rows of an
  // A buffer (no other warp reads them, and this one is done with them), then written out row by
  // row to out_rows (this warp's first row): coalesced, 16 bytes a lane where rows are vectors
  // (element by element they were most of the kernel's instructions).
  auto write_outputs = [&](const float (&acc)[NB / 8][4], Smem* rows_s, scalar_t* out_rows, int64_t out_l,
                           int out_cols, int n, const float (&factor)[2], bool scaled) {
    __syncwarp();
    // rows row_lo and row_hi = row_lo + 8, columns 8 j + 2 q (+ 1): one address and constants
    const uint32_t lane_address = shared_address(rows_s + row_lo * S::kAB + 2 * q);
    auto store = [&](auto value) {
#pragma unroll
      for (int j = 0; j < NB / 8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          T::store_pair_at(lane_address + uint32_t((h * 8 * S::kAB + 8 * j) * sizeof(Smem)), value(j, 2 * h, h),
                           value(j, 2 * h + 1, h));
        }
    };
    if (scaled) {  // a branch the block takes as a whole: the plain forward's factor is 1
      store([&](int j, int e, int h) { return acc[j][e] * factor[h]; });
    } else {
      store([&](int j, int e, int) { return acc[j][e]; });
    }
    __syncwarp();
    write_rows<S>(rows_s + 16 * warp * S::kAB, out_rows, out_l, n - 16 * warp, out_cols, p.rows_are_vectors);
  };

  // Chunks staged 16 bytes at a time arrive asynchronously: with two buffers (see the launcher),
  // the next chunk is on its way while this one is worked on; with one buffer they are copied 16
  // bytes at a time when their turn comes, and rows that are not whole vectors element by element.
  const bool vectors = p.rows_are_vectors;
  const bool pipelined = vectors && p.chunk_buffers == 2;
  // shared_a (see KernelParams): the next chunk's b and c are issued with this chunk's start and
  // each warp issues its own 16 rows of the next chunk's a (no other warp reads them) once it has
  // written this chunk's outputs through them, its last use of a; the copies arrive during the
  // rest of the chunk (the fused pass's dv, the state's update).
  const bool deep =
      kDeepStates && pipelined && !shared_a && state_only && !extra_row && p.deep_state_staging;  // see chunk_buffer
  const int64_t chunks = work.chunk_count(C);
  auto chunk_at = [&](int64_t it, int64_t& t0, int& n) {
    t0 = work.chunk_begin(it, chunks, C);
    n = work.chunk_len(t0, C);
  };
  // This warp's rows of chunk it's a, in phase 0 (issue) or 1 (finish): shared_a.
  auto stage_own_a = [&](int phase, int64_t t0, int n) {
    if constexpr (S::kSharedA) {
      stage_vectors<16, S::kDA, S::kAB, kWarp>(phase, chunk_buffer(0).a + 16 * warp * S::kAB, ops.a_rows(),
                                               t0 + 16 * warp, n - 16 * warp, 0, int(Da), !ops.a_is_plain(),
                                               [&](int64_t t) { return ops.a_factor(t); });
    }
  };
  // Chunk `it` into buffer `slot`, as one group of copies (none past the last chunk); with
  // shared_a its a only for the first chunk (this warp's rows; see issue_own_a).
  auto issue = [&](int slot, int64_t it) {
    if (it < chunks) {
      int64_t t0;
      int n;
      chunk_at(it, t0, n);
      const ChunkBuffer<Smem> buf = chunk_buffer(slot);
      issue_chunk<S>(buf, ops, t0, n, Da, m0, cols, !state_only && !shared_a, extra_row);
      if (shared_a && !state_only && it == 0) stage_own_a(0, t0, n);
      if (kFused && !state_only) {  // k, E = Dc columns, as it is
        stage_vectors<C, DA, S::kAB>(0, buf.a2, ops_v.a_rows(), t0, n, 0, int(Dc), false, [](int64_t) { return 1.f; });
      }
    }
    commit_async_copies();
  };
  auto issue_own_a = [&](int64_t it) {  // shared_a: this warp is done with its rows of a
    if (it < chunks) {
      int64_t t0;
      int n;
      chunk_at(it, t0, n);
      __syncwarp();  // every lane's reads of the rows (write_outputs) are done
      stage_own_a(0, t0, n);
    }
    commit_async_copies();
  };
  auto finish = [&](const ChunkBuffer<Smem>& buf, int64_t t0, int n) {
    finish_chunk<S>(buf, ops, t0, n, Da, m0, cols, !state_only && !shared_a, extra_row, deep);  // a2's copies too
    if (shared_a && !state_only) stage_own_a(1, t0, n);
  };
  if (pipelined) issue(0, 0);
  if (deep) issue(1, 1);
  int slot = 0;  // this chunk's buffer: chunk it % 2 (it % 3 when deep)
  for (int64_t it = 0; it < chunks; ++it, slot = deep ? (slot == 2 ? 0 : slot + 1) : pipelined ? 1 - slot : 0) {
    int64_t t0;
    int n;
    chunk_at(it, t0, n);
    const ChunkBuffer<Smem> buf = chunk_buffer(slot);
    Smem *a_s = buf.a, *b_s = buf.b, *c_s = buf.c;
    float *extra_a_s = buf.extra_a, *extra_b_s = buf.extra_b;
    if (pipelined) {
      finish(buf, t0, n);
      __syncthreads();  // this chunk is staged; every thread is done with the previous one, whose
                        // buffer the next chunk (deep: the one after) now fills; the state copy
                        // is published
      if (deep) {
        issue(slot == 0 ? 2 : slot - 1, it + 2);
      } else {
        issue(1 - slot, it + 1);
      }
    } else {
      __syncthreads();  // the previous chunk is done with every buffer; the state copy is published
      if (vectors) {
        issue(0, it);
        finish(buf, t0, n);
      } else {
        chunked::stage_chunk<C, DA, NB, S::kAB, S::kCS, kThreads>(a_s, b_s, c_s, extra_a_s, extra_b_s, ops, t0, n, Da,
                                                                  m0, cols, !state_only, extra_row);
        if (kFused && !state_only) {
          chunked::stage<C, DA, S::kAB, kThreads>(
              buf.a2, [&](int t, int r) { return t < n && r < Dc ? ops_v.a_at(t0 + t, r) : acc_t(0); });
        }
      }
      __syncthreads();
    }

    if (!state_only) {
      // Scores A B^T of this warp's 16 rows over the chunk's 64 columns; the 16-column blocks
      // wholly outside the causal mask are skipped.
      float score[C / 8][4] = {};
      uint32_t b_lane = 0;
      if constexpr (kLaneAddresses) b_lane = T::b_n_major_lane(b_s, S::kAB);
      accumulate_a_rows<T, DA, kUnrollK>(
          score, a_s, 16 * warp, S::kAB, tf32,
          [&](BFrag(&b)[2], int k, int pair, int) {
            if constexpr (kLaneAddresses) {
              T::load_b_n_major_at(b, b_lane, 16 * pair, k, S::kAB);
            } else {
              T::load_b_n_major(b, b_s, 16 * pair, k, S::kAB);
            }
          },
          [&](int pair) { return kReverse ? pair < warp : pair > warp; });

      // The mask; then the normalizer's row sums (of the masked float scores) and the extra row,
      // each in a branch the block takes as a whole (the plain passes issue neither).
      auto kept = [&](int row, int col) { return kReverse ? col >= row : col <= row; };
      for_each_accumulator<C / 8>(16 * warp, [&](int j, int e, int row, int col) {
        if (!kept(row, col)) score[j][e] = 0.f;
      });
      float row_sum[2] = {0.f, 0.f};
      if (denominator) {
        for_each_accumulator<C / 8>(16 * warp, [&](int j, int e, int, int) { row_sum[e >> 1] += score[j][e]; });
      }
      if (extra_row) {
        for_each_accumulator<C / 8>(16 * warp, [&](int j, int e, int row, int col) {
          if (kept(row, col)) score[j][e] += extra_a_s[row] * extra_b_s[col];
        });
      }
      float den[2] = {1.f, 1.f};
      if (denominator) {  // eps + the row sum + a . key_sum, the quad's four lanes splitting the work
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = h ? row_hi : row_lo;
          float d = row_sum[h];
          for (int k = q; k < DA; k += 4) d += static_cast<float>(a_s[row * S::kAB + k]) * key_sum_s[k];
          d += __shfl_xor_sync(0xffffffffu, d, 1);
          d += __shfl_xor_sync(0xffffffffu, d, 2);
          den[h] = d + float(p.eps);
          if (col_tile == 0 && q == 0 && row < n) static_cast<acc_t*>(p.den)[work.den_row + t0 + row] = den[h];
        }
      }

      // Outputs A S + P Cc: A S first, so that it alone is scaled back from the state copy's scale;
      // the masked scores are the A operand of P Cc straight from registers.
      float out[NB / 8][4] = {};
      accumulate_a_rows<T, DA, kUnrollK, NB / 8, kStateParts>(
          out, a_s, 16 * warp, S::kAB, tf32,
          [&](BFrag(&b)[2], int k, int pair, int part) {
            T::load_b_k_major(b, s_copy + part * S::s_part, k, 16 * pair, S::kSS);
          },
          [](int) { return false; });
      scale_back(out);
      accumulate_scores_times(out, score, c_s, S::kCS);

      // The outputs, finished in registers: the extra row's term (the state entering the chunk)
      // or the bias (never both: one comes with normalize, the other without), then the
      // normalizer or scale. Each in a branch the block takes as a whole: inside the per-element
      // finish they were issued, predicated off, by every plain pass (about a tenth of the bf16
      // forward's instructions, H200 ncu).
      if (extra_row) {
        for_each_accumulator<NB / 8>(16 * warp, [&](int j, int e, int row, int col) {
          out[j][e] += extra_a_s[row] * extra_state_s[col];
        });
      } else if (p.out_bias != nullptr) {
        const acc_t* bias = static_cast<const acc_t*>(p.out_bias) + pair * Dc + m0;
        for_each_accumulator<NB / 8>(16 * warp, [&](int j, int e, int, int col) {
          if (col < cols) out[j][e] += bias[col];
        });
      }
      float factor[2] = {1.f, 1.f};  // the plain forward's: 1 / 1
      const bool scaled = P != Pass::Forward || denominator;
      if (scaled) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = h ? row_hi : row_lo;
          if (row < n) factor[h] = float(ops.out_factor(t0 + row, den[h]));
        }
      }
      write_outputs(out, a_s, ops.out + (t0 + 16 * warp) * ops.out_l + m0, ops.out_l, cols, n, factor, scaled);
      if (shared_a) issue_own_a(it + 1);

      if constexpr (kFused) {  // dv = mask(K q'^T) dO + K S^T on the same rows, no extra row, factor 1
        float score_v[C / 8][4] = {};
        uint32_t c_lane = 0;
        if constexpr (kLaneAddresses) c_lane = T::b_n_major_lane(c_s, S::kCS);
        accumulate_a_rows<T, DA, kUnrollK>(
            score_v, buf.a2, 16 * warp, S::kAB, tf32,
            [&](BFrag(&b)[2], int k, int pair, int) {
              if constexpr (kLaneAddresses) {
                T::load_b_n_major_at(b, c_lane, 16 * pair, k, S::kCS);
              } else {
                T::load_b_n_major(b, c_s, 16 * pair, k, S::kCS);
              }
            },
            [&](int pair) { return pair < warp; });
        for_each_accumulator<C / 8>(16 * warp, [&](int j, int e, int row, int col) {
          if (col < row) score_v[j][e] = 0.f;
        });
        float out_v[NB / 8][4] = {};
        accumulate_a_rows<T, DA, kUnrollK, NB / 8, kStateParts>(
            out_v, buf.a2, 16 * warp, S::kAB, tf32,
            [&](BFrag(&b)[2], int k, int pair, int part) {
              T::load_b_n_major(b, s_copy + part * S::s_part, 16 * pair, k, S::kSS);
            },
            [](int) { return false; });
        scale_back(out_v);
        accumulate_scores_times(out_v, score_v, b_s, S::kAB);
        // (1, or out of den's unit, as dk's: ops.inverse_unit)
        const float dv_factor[2] = {float(ops.inverse_unit), float(ops.inverse_unit)};
        write_outputs(out_v, buf.a2, ops_v.out + (t0 + 16 * warp) * ops_v.out_l, ops_v.out_l, int(Da), n, dv_factor,
                      ops.inverse_unit != acc_t(1));
      }
    }

    // S += B^T Cc on this warp's rows of the state (float32 accumulators throughout). The tensor
    // cores add into their accumulator without rounding to nearest (H200: with S accumulated in
    // them, float32 outputs drifted from float64 in proportion to the chunks summed, 9.6e-5 at
    // 1,16,32768,128, where float32 keeps 1.7e-6 otherwise). 16-bit inputs end at bf16 or fp16
    // roundings far above that; float32 sums each chunk's B^T Cc in fresh accumulators and adds
    // them to S with rounded float32 adds (no more registers at DA = 64 and 128: 161 and 250).
    constexpr bool kRoundedStateSums = sizeof(Smem) == 4;
#pragma unroll
    for (int i = 0; i < kStateTiles; ++i) {
      float fresh[NB / 8][4] = {};
      float(&sums)[NB / 8][4] = kRoundedStateSums ? fresh : state[i];
#pragma unroll kUnrollK
      for (int k = 0; k < C; k += kK) {
        AFrag a;
        T::load_a_k_major(a, b_s, state_row0 + 16 * i, k, S::kAB);
#pragma unroll
        for (int np = 0; np < NB / 16; ++np) {
          BFrag b[2];
          T::load_b_k_major(b, c_s, k, 16 * np, S::kCS);
          T::mma(sums[2 * np], a, b[0], tf32);
          T::mma(sums[2 * np + 1], a, b[1], tf32);
        }
      }
      if constexpr (kRoundedStateSums) {
#pragma unroll
        for (int j = 0; j < NB / 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) state[i][j][e] += fresh[j][e];
      }
    }
#pragma unroll
    for (int i = 0; i < kKeys; ++i) {
      const int row = tid + kThreads * i;
      if (track_key_sum && row < DA) {
        for (int t = 0; t < C; ++t) key_sum[i] += static_cast<float>(b_s[t * S::kAB + row]);
      }
    }
    if (extra_row && tid < NB) {
      for (int t = 0; t < C; ++t) extra_state += extra_b_s[t] * static_cast<float>(c_s[t * S::kCS + tid]);
    }
    if (!state_only) {
      if constexpr (kScaledCopy) post_warp_max();
      __syncthreads();  // every read of the state copy and the vectors is done (float16: the warps'
                        // largest |S| are posted)
      publish();
    }
  }

  const SegmentEnd<acc_t> end(p, pair, segment, Da, Dc, kReverse, P == Pass::Forward, work.piece);
  if (end.state != nullptr) {
#pragma unroll
    for (int i = 0; i < kStateTiles; ++i) {
      for_each_accumulator<NB / 8>(state_row0 + 16 * i, [&](int j, int e, int row, int col) {
        if (row < Da && col < cols) end.state[row * Dc + m0 + col] = state[i][j][e];
      });
    }
  }
#pragma unroll
  for (int i = 0; i < kKeys; ++i) {
    const int row = tid + kThreads * i;
    if (end.key_sum != nullptr && track_key_sum && row < Da && col_tile == 0) end.key_sum[row] = key_sum[i];
  }
  if (end.extra != nullptr && extra_row && tid < cols) end.extra[m0 + tid] = extra_state;
}

// Whether every row the kernels read or write starts 16-byte aligned and E and M are whole 16-byte
// vectors of `element` bytes: then they stage 16 bytes at a time.
inline bool rows_are_vectors(const KernelParams& p, int64_t element) {
  const int64_t vec = 16 / element;
  auto aligned = [&](const StridedTensor& t) {
    return t.ptr == nullptr || (reinterpret_cast<uintptr_t>(t.ptr) % 16 == 0 && t.stride_b % vec == 0 &&
                                t.stride_h % vec == 0 && t.stride_l % vec == 0);
  };
  return p.E % vec == 0 && p.M % vec == 0 && aligned(p.q) && aligned(p.k) && aligned(p.v) && aligned(p.dout) &&
         aligned(p.o) && aligned(p.dq) && aligned(p.dk) && aligned(p.dv);
}

// Whether the dq pass starts its segments from the forward's where it kept them (the default), and
// float32's dv pass from the dk pass's; FAST_CAUSAL_ATTN_REUSE_SEGMENTS=0 sums them again, for
// tests and measuring.
inline bool reuse_forward_segments() {
  const char* reuse = std::getenv("FAST_CAUSAL_ATTN_REUSE_SEGMENTS");
  return reuse == nullptr || std::strcmp(reuse, "0") != 0;
}

// The dq pass's segments and their starts from the forward's, where it kept them (read
// transposed: no state-only launch, no scan), or the wgmma dv pass's from the dk pass's; returns
// whether it takes them. step: the pass's chunk length, whose multiples the earlier pass's
// segments are. Under normalize dq's extra row starts from the forward's key sums (without them
// it cannot take the starts); dv has no extra row (its state under normalize, (q / den)^T dO, is
// dk's transposed all the same).
template <Pass P>
inline bool take_forward_segments(KernelParams& p, int64_t step) {
  const bool key_sums = P == Pass::GradQ && p.normalize;
  if (p.forward_segments <= 1 || p.cu_seqlens != nullptr || (key_sums && p.forward_segment_k_sum == nullptr) ||
      !reuse_forward_segments()) {
    return false;
  }
  p.segments = p.forward_segments;
  p.segment_len = segment_length(p.L, p.segments, step);
  TORCH_CHECK(segment_count(p.L, p.segment_len) == p.segments, "fast_causal_attn: segment_kv holds ", p.segments,
              " segments, which no forward of ", p.L, " timesteps makes");
  p.seg_from_forward = true;
  p.seg_state = const_cast<void*>(p.forward_segment_kv);  // read only
  p.seg_extra = key_sums ? const_cast<void*>(p.forward_segment_k_sum) : nullptr;
  return true;
}

// Returns the forward's segment starts (P = Forward, more than one segment, keep_segments), else
// nothing.
template <Pass P, typename scalar_t, int DA, int NB>
ForwardSegments launch_tensorcore(const KernelParams& params, int64_t Da, int64_t Dc, cudaStream_t stream) {
  using namespace tensorcore;
  KernelParams p = params;
  p.rows_are_vectors = rows_are_vectors(p, int64_t(sizeof(scalar_t)));
  const int64_t pairs = p.num_seqs * p.H;  // (sequence, head) pairs
  const int64_t col_tiles = (Dc + NB - 1) / NB;
  using S = Layout<MmaTraits<scalar_t>, DA, NB, P == Pass::GradKV>;
  auto kernel = tensorcore_product_kernel<P, scalar_t, DA, NB>;
  // Blocks a multiprocessor holds with one buffer, two, or two sharing an a region (index 0, 1,
  // 2): the kernel's and the device's property, asked once per device (a call costs microseconds
  // of host time, every launch).
  enum Staging { kOne, kTwo, kTwoSharingA };
  const size_t staging_bytes[3] = {S::bytes(1), S::bytes(2), S::bytes_shared_a()};
  static int asked[64][3] = {};  // 0: not asked yet
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  auto resident_with = [&](Staging staging) {
    int& blocks = asked[device % 64][staging];
    if (blocks == 0) {
      allow_dynamic_smem(kernel, staging_bytes[staging]);
      C10_CUDA_CHECK(
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, staging_bytes[staging]));
      blocks = std::max(blocks, 1);
    }
    return blocks;
  };
  // Two chunk buffers (the next chunk arriving while this one is worked on) only where they cost
  // no resident blocks: float32 at DA = 64 holds 1 block a multiprocessor with two (126 KB) and
  // more with one (72 KB): one measured faster (H200 fwd+bwd 8,16,2048,64: 1.55 ms with 2 blocks
  // a multiprocessor, two buffers 1.67; now 3, see min_blocks_per_multiprocessor), while bf16 keeps
  // two (0.44 ms, one 0.49). Where two cost blocks, two sharing one a region where they do not:
  // bfloat16 at DA = 128, whose two-part state copy (18 KB more) left two blocks a multiprocessor
  // only one buffer (H200 GPU busy fwd+bwd 8,16,2048,128: 0.578 -> 0.722 ms with the second part).
  // FAST_CAUSAL_ATTN_TC_BUFFERS=1, 2 or shared forces one where it fits, for measuring.
  auto pick_staging = [&](bool vectors) {
    Staging staging = kOne;
    if (vectors && S::kBuffers >= 2) {
      if (resident_with(kTwo) >= resident_with(kOne)) {
        staging = kTwo;
      } else if (S::kSharedA && resident_with(kTwoSharingA) >= resident_with(kOne)) {
        staging = kTwoSharingA;
      }
    }
    if (const char* forced = std::getenv("FAST_CAUSAL_ATTN_TC_BUFFERS")) {
      const bool two_fit = vectors && S::kBuffers >= 2;
      if (std::strcmp(forced, "1") == 0) staging = kOne;
      if (std::strcmp(forced, "2") == 0 && two_fit) staging = kTwo;
      if (std::strcmp(forced, "shared") == 0 && two_fit && S::kSharedA) staging = kTwoSharingA;
    }
    return staging;
  };
  const Staging staging = pick_staging(p.rows_are_vectors);
  p.chunk_buffers = staging == kOne ? 1 : 2;
  p.shared_a = staging == kTwoSharingA;
  // FAST_CAUSAL_ATTN_TC_STATE_SLOTS=2: the state-only launch keeps one chunk on its way instead
  // of two, for measuring.
  if (const char* slots = std::getenv("FAST_CAUSAL_ATTN_TC_STATE_SLOTS")) p.deep_state_staging = std::atoi(slots) != 2;
  const size_t smem = staging_bytes[staging];
  // The segment count from the blocks a multiprocessor holds with the staging of rows at 16-byte
  // boundaries, whatever these rows are (the same for every call but rows that are not): a
  // function of the shapes alone, which torch.compile's fake kernel asks for ahead
  // (plan_forward_segments, ops.h).
  const int64_t vec = 16 / int64_t(sizeof(scalar_t));
  const int resident = resident_with(pick_staging(p.E % vec == 0 && p.M % vec == 0));
  const int64_t slots = int64_t(multiprocessor_count()) * std::max(resident, 1);
  // Packed sequences (cu_seqlens) are not split in time: each block runs a whole sequence. The
  // segments fill one wave and no more: a partial second wave measured slower than fewer segments
  // (8,16,2048,64 bf16 forward, 396 slots: 4 segments 185 us, 2 segments 151 us).
  const int64_t blocks = std::max<int64_t>(pairs * col_tiles, 1);
  // The dq pass's state is the transpose of the forward's (and its extra row's the forward's key
  // sum): where the forward kept its segment starts, the dq pass takes its segments and starts
  // (its own count could differ where E != M or the two kernels' occupancies do), without the
  // state-only launch and the scan: H200 GPU time a fwd+bwd 6-14% lower (bf16 8,16,2048,64 0.256
  // -> 0.231 ms, 1,16,32768,128 1.490 -> 1.404; fp32 8,16,2048,64 0.955 -> 0.898).
  if constexpr (P == Pass::GradQ) {
    if (take_forward_segments<P>(p, C)) {
      launch_segmented<P>(kernel, p, SegmentWorkspace{}, pairs * col_tiles * p.segments, kThreads, smem, stream, Da,
                          Dc, col_tiles);
      return {};
    }
  }
  const int64_t segments = p.cu_seqlens != nullptr
                               ? 1
                               : choose_segments(blocks, slots / blocks * blocks, p.L, kMinChunksPerSegment * C);
  // the segments' length in chunks and their count, as SegmentWorkspace::make sets them
  const int64_t segment_chunks = segment_length(p.L, segments, C) / C;
  const int64_t count = segment_count(p.L, segment_chunks * C);
  if (p.dry_run) {  // a plan: the count the forward keeps
    return {at::Tensor(), at::Tensor(), P == Pass::Forward && count > 1 ? count : 0};
  }
  // float32's state-only launch in heads and tails where whole segments would leave slots idle
  // (choose_state_head): its blocks keep one chunk on their way, so more of them keep more bytes in
  // flight (H200 CUDA graph replay, fwd / fwd+bwd, whole segments -> heads and tails: 1,16,32768,128
  // 2.745 / 10.552 -> 2.645 / 10.240 ms, 4,16,8192,64 0.471 / 1.700 -> 0.462 / 1.675, 8,16,2048,64
  // 0.241 / 0.870 -> 0.238 / 0.852). The 16-bit ones keep two on their way (deep_state_staging) and
  // measured 0-2% slower with them (bf16 8,16,2048,64 0.086 / 0.268 -> 0.087 / 0.270, 1,16,32768,128
  // 0.442 / 1.628 -> 0.450 / 1.649): whole segments. FAST_CAUSAL_ATTN_TC_STATE_HEAD=N forces heads
  // of N chunks (0: whole segments) for any dtype, for measuring.
  p.state_head = state_head_steps(sizeof(scalar_t) == 4, blocks, count, segment_chunks, slots, C);
  const SegmentWorkspace workspace = SegmentWorkspace::make<P, float>(p, segments, C, Da, Dc);
  launch_segmented<P>(kernel, p, workspace, pairs * col_tiles * p.segments, kThreads, smem, stream, Da, Dc, col_tiles);
  if constexpr (P == Pass::Forward) {
    if (p.keep_segments) return workspace.kept();
  }
  return {};
}

constexpr int64_t kMaxTensorCoreRows = 256;

// The columns of c a tensor-core block owns (NB; see run_tensorcore): 64, or 32 where the state
// has DA = 256 rows.
constexpr int64_t tensorcore_block_columns(int64_t Da) { return Da > 128 ? 32 : 64; }

template <typename scalar_t>
constexpr bool kTensorCoreInput =
    std::is_same_v<scalar_t, at::Half> || std::is_same_v<scalar_t, at::BFloat16> || std::is_same_v<scalar_t, float>;

// float16, bfloat16 and float32 (3xTF32) inputs, the state's rows (Da) up to kMaxTensorCoreRows.
template <Pass P, typename scalar_t>
ForwardSegments run_tensorcore_blocks(const KernelParams& p, int64_t Da, int64_t Dc, cudaStream_t stream) {
  if constexpr (kTensorCoreInput<scalar_t>) {
    if (Da <= 64) {
      return launch_tensorcore<P, scalar_t, 64, tensorcore_block_columns(64)>(p, Da, Dc, stream);
    } else if (Da <= 128) {
      // float32 at DA = 128 holds one block of 64 columns a multiprocessor (124 KB of shared
      // memory: 4 warps, one a scheduler). Blocks of 32 columns (two a multiprocessor, 97 KB,
      // the scores computed twice as often) measured no faster (H200 fwd+bwd 8,16,2048,128: 5.08
      // ms vs 5.06; 1,16,32768,128: 12.7 vs 12.2) and were removed. Slower for bfloat16 too, whose
      // two-part state copy leaves two blocks of 64 columns one chunk buffer (GPU busy fwd+bwd,
      // 32 / 64 columns: 8,16,2048,128 1.013 / 0.725 ms, 1,16,32768,128 2.259 / 1.746).
      return launch_tensorcore<P, scalar_t, 128, tensorcore_block_columns(128)>(p, Da, Dc, stream);
    } else {
      return launch_tensorcore<P, scalar_t, 256, tensorcore_block_columns(256)>(p, Da, Dc, stream);
    }
  } else {
    TORCH_CHECK(false, "fast_causal_attn: the tensor-core kernels take float16, bfloat16 and float32 inputs");
    return {};
  }
}

// run_tensorcore_blocks, and where dk's and dv's sums are in KernelParams::den_unit's unit (float16
// under normalize: Operands::take_den_unit) their states in and out of it (ReverseStates; the
// scale is in the operands here).
template <Pass P, typename scalar_t>
ForwardSegments run_tensorcore(const KernelParams& params, int64_t Da, int64_t Dc, cudaStream_t stream) {
  KernelParams p = params;
  const ReverseStates states(p, PassTraits<P>::kReverse && !p.dry_run, Da, Dc, 1.0);
  const ForwardSegments kept = run_tensorcore_blocks<P, scalar_t>(p, Da, Dc, stream);
  states.finish(p);
  return kept;
}

}  // namespace cuda
}  // namespace fast_causal_attn
