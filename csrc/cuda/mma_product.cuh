// The tensor-core family for float16 and bfloat16 inputs on mma.sync (m16n8k16, float32
// accumulation), with every intermediate product kept in registers: the chunked products of
// chunked_product.cuh,
//
//   P = mask(A B^T),  out = P Cc + A S,  S += B^T Cc,
//
// laid out as flash-attention 2 lays out its softmax(Q K^T) V. A block is 4 warps and owns one
// (sequence, head), NB = 64 columns of c and one time segment. Per chunk of C = 64 timesteps,
// warp w owns the chunk's rows 16w .. 16w + 15: its scores (a 16 x 64 accumulator) are masked,
// take the extra row and the normalizer's row sums in registers, and become the 16-bit A
// operand of P Cc without leaving registers. The state S (DA x NB, float32) is split by rows
// over the warps, also in accumulators; a 16-bit copy in shared memory serves the A S product of
// the next chunk. Operands are staged in shared memory with 16-byte row padding so that every
// ldmatrix is free of bank conflicts.
//
// The WMMA version (tensorcore_product.cuh) went through shared memory between every product and
// measured no faster than the CUDA-core families (benchmarks/RESULTS.md); this one is written to
// remove exactly those round trips. Not yet run on a GPU.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "chunked_product.cuh"

namespace fast_causal_attn {
namespace cuda {
namespace mma16 {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * kWarp;
constexpr int C = 64;   // timesteps per chunk: 16 rows a warp
constexpr int NB = 64;  // columns of c per block
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

// d += a b for one 16 x 8 x 16 step: a the 16 x 16 A fragment, (b0, b1) the 16 x 8 B fragment.
template <typename scalar_t>
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats rounded to the input dtype, packed as one 32-bit register (lo in the low half).
template <typename scalar_t>
__device__ __forceinline__ uint32_t pack(float lo, float hi) {
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// Where lane l points ldmatrix for each operand shape (m = l / 8 the matrix, r = l % 8 its row).
// Fragment tile at (row0, col0) of a row-major array with row stride ld:
struct Lane {
  int m, r;
  __device__ Lane() : m((threadIdx.x % kWarp) / 8), r(threadIdx.x % 8) {}
  // A (16 x 16) stored as [row][k]: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7,
  // k 8-15), (rows 8-15, k 8-15) are a0..a3.
  __device__ int a_row_major(int row0, int k0, int ld) const { return (row0 + (m & 1) * 8 + r) * ld + k0 + (m >> 1) * 8; }
  // A (16 x 16) stored as [k][row] (a transposed operand), with .trans.
  __device__ int a_k_major(int row0, int k0, int ld) const { return (k0 + (m >> 1) * 8 + r) * ld + row0 + (m & 1) * 8; }
  // Two B fragments (k 16 x n 8, columns n0 and n0 + 8) stored as [n][k]: b0, b1 of the first,
  // then of the second.
  __device__ int b_n_major(int n0, int k0, int ld) const { return (n0 + (m >> 1) * 8 + r) * ld + k0 + (m & 1) * 8; }
  // The same stored as [k][n], with .trans.
  __device__ int b_k_major(int k0, int n0, int ld) const { return (k0 + (m & 1) * 8 + r) * ld + n0 + (m >> 1) * 8; }
};

// Shared memory, in bytes from the start: 16-bit rows padded by 8 elements (16 bytes), so that the
// 8 rows an ldmatrix reads fall in 8 different bank groups.
template <int DA>
struct Layout {
  static constexpr int kAB = DA + 8;  // row strides, in 16-bit elements
  static constexpr int kCS = NB + 8;
  static constexpr int kSS = NB + 8;
  static constexpr size_t a = 0;                                 // [C][kAB]
  static constexpr size_t b = a + size_t(C) * kAB * 2;           // [C][kAB]
  static constexpr size_t c = b + size_t(C) * kAB * 2;           // [C][kCS]
  static constexpr size_t s_copy = c + size_t(C) * kCS * 2;      // [DA][kSS]: the state entering the chunk
  static constexpr size_t extra_a = s_copy + size_t(DA) * kSS * 2;  // [C] float
  static constexpr size_t extra_b = extra_a + C * 4;                // [C]
  static constexpr size_t extra_state = extra_b + C * 4;            // [NB]
  static constexpr size_t key_sum = extra_state + NB * 4;           // [DA]
  static constexpr size_t total = key_sum + DA * 4;
  static_assert(b % 16 == 0 && c % 16 == 0 && s_copy % 16 == 0 && extra_a % 16 == 0, "ldmatrix rows are 16-byte aligned");
  static_assert(DA % (16 * kWarps) == 0, "each warp owns DA / 4 rows of the state, whole 16-row tiles");
};

}  // namespace mma16

template <Pass P, typename scalar_t, int DA>
__global__ void __launch_bounds__(mma16::kThreads)
    mma_product_kernel(const KernelParams p, int64_t Da, int64_t Dc, int64_t col_tiles) {
  using namespace mma16;
  using acc_t = float;
  using S = Layout<DA>;
  constexpr bool kReverse = PassTraits<P>::kReverse;
  constexpr int kKSteps = DA / 16;                // k-steps over the state's rows
  constexpr int kStateTiles = DA / (16 * kWarps);  // 16-row tiles of the state a warp owns

  extern __shared__ __align__(128) unsigned char mma_smem_raw[];
  scalar_t* a_s = reinterpret_cast<scalar_t*>(mma_smem_raw + S::a);
  scalar_t* b_s = reinterpret_cast<scalar_t*>(mma_smem_raw + S::b);
  scalar_t* c_s = reinterpret_cast<scalar_t*>(mma_smem_raw + S::c);
  scalar_t* s_copy = reinterpret_cast<scalar_t*>(mma_smem_raw + S::s_copy);
  float* extra_a_s = reinterpret_cast<float*>(mma_smem_raw + S::extra_a);
  float* extra_b_s = reinterpret_cast<float*>(mma_smem_raw + S::extra_b);
  float* extra_state_s = reinterpret_cast<float*>(mma_smem_raw + S::extra_state);
  float* key_sum_s = reinterpret_cast<float*>(mma_smem_raw + S::key_sum);

  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp;
  const int g = lane / 4, q = lane % 4;  // an accumulator's rows g and g + 8, columns 2q and 2q + 1
  const Lane ld;
  const chunked::BlockWork<P, scalar_t> work(p, col_tiles, NB, Dc);
  const int64_t segment = work.segment, col_tile = work.col_tile, pair = work.pair, m0 = work.m0;
  const int cols = work.cols;
  const bool state_only = work.state_only, extra_row = work.extra_row, denominator = work.denominator;
  const bool track_key_sum = work.track_key_sum;
  const Operands<P, scalar_t, acc_t> ops = work.operands(p);
  const int row_lo = 16 * warp + g, row_hi = row_lo + 8;  // this thread's rows of the chunk
  const int state_row0 = warp * (DA / kWarps);             // this warp's rows of the state

  // The state: tile i of this warp holds rows state_row0 + 16 i + (g, g + 8), columns 8 j + 2q (+1)
  // in state[i][j][0, 1] (row g) and [2, 3] (row g + 8).
  float state[kStateTiles][NB / 8][4];
  float key_sum = 0.f, extra_state = 0.f;  // thread tid's entries: key_sum[tid] (< DA), extra_state[tid] (< NB)
  {
    const SegmentStart<acc_t> start(p, pair, segment, Da, Dc, kReverse);
#pragma unroll
    for (int i = 0; i < kStateTiles; ++i)
#pragma unroll
      for (int j = 0; j < NB / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = state_row0 + 16 * i + g + (e >> 1) * 8, col = 8 * j + 2 * q + (e & 1);
          state[i][j][e] = (!state_only && row < Da && col < cols) ? start.state(row, m0 + col) : 0.f;
        }
    if (!state_only && track_key_sum && tid < Da) key_sum = start.key_sum(tid);
    if (!state_only && extra_row && tid < cols) extra_state = start.extra(m0 + tid);
  }
  // The copy of the state in the input dtype and the vectors, read by the next chunk's outputs.
  auto publish = [&] {
#pragma unroll
    for (int i = 0; i < kStateTiles; ++i)
#pragma unroll
      for (int j = 0; j < NB / 8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = state_row0 + 16 * i + g + h * 8, col = 8 * j + 2 * q;
          *reinterpret_cast<uint32_t*>(s_copy + row * S::kSS + col) =
              pack<scalar_t>(state[i][j][2 * h], state[i][j][2 * h + 1]);
        }
    if (tid < DA) key_sum_s[tid] = key_sum;
    if (tid < NB) extra_state_s[tid] = extra_state;
  };
  if (!state_only) publish();

  const int64_t chunks = work.chunk_count(C);
  for (int64_t it = 0; it < chunks; ++it) {
    const int64_t t0 = work.chunk_begin(it, chunks, C);
    const int n = work.chunk_len(t0, C);

    __syncthreads();  // the previous chunk is done with every buffer; the state copy is published
    chunked::stage_chunk<C, DA, NB, S::kAB, S::kCS>(a_s, b_s, c_s, extra_a_s, extra_b_s, ops, t0, n, Da, m0, cols,
                                                    !state_only, extra_row);
    __syncthreads();

    if (!state_only) {
      // This warp's rows of A, all k-steps: the scores' and the A S product's A operand.
      uint32_t a_frag[kKSteps][4];
#pragma unroll
      for (int k = 0; k < kKSteps; ++k) ldmatrix_x4(a_frag[k], a_s + ld.a_row_major(16 * warp, 16 * k, S::kAB));

      // Scores A B^T over the chunk's 64 columns, two 8-column tiles at a time; the 16-column
      // blocks wholly outside the causal mask are skipped.
      float score[C / 8][4];
#pragma unroll
      for (int j = 0; j < C / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) score[j][e] = 0.f;
#pragma unroll
      for (int jp = 0; jp < C / 16; ++jp) {
        if (kReverse ? jp < warp : jp > warp) continue;
#pragma unroll
        for (int k = 0; k < kKSteps; ++k) {
          uint32_t b[4];
          ldmatrix_x4(b, b_s + ld.b_n_major(16 * jp, 16 * k, S::kAB));
          mma<scalar_t>(score[2 * jp], a_frag[k], b[0], b[1]);
          mma<scalar_t>(score[2 * jp + 1], a_frag[k], b[2], b[3]);
        }
      }

      // Mask, the normalizer's row sums (of the float scores), the extra row.
      float row_sum[2] = {0.f, 0.f};
#pragma unroll
      for (int j = 0; j < C / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = (e >> 1) ? row_hi : row_lo, col = 8 * j + 2 * q + (e & 1);
          const bool keep = kReverse ? col >= row : col <= row;
          float value = keep ? score[j][e] : 0.f;
          row_sum[e >> 1] += value;
          if (keep && extra_row) value += extra_a_s[row] * extra_b_s[col];
          score[j][e] = value;
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

      // The masked scores as the A operand of P Cc (an accumulator pair is an A fragment).
      uint32_t p_frag[C / 16][4];
#pragma unroll
      for (int k = 0; k < C / 16; ++k) {
        p_frag[k][0] = pack<scalar_t>(score[2 * k][0], score[2 * k][1]);
        p_frag[k][1] = pack<scalar_t>(score[2 * k][2], score[2 * k][3]);
        p_frag[k][2] = pack<scalar_t>(score[2 * k + 1][0], score[2 * k + 1][1]);
        p_frag[k][3] = pack<scalar_t>(score[2 * k + 1][2], score[2 * k + 1][3]);
      }

      // Outputs P Cc + A S.
      float out[NB / 8][4];
#pragma unroll
      for (int j = 0; j < NB / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) out[j][e] = 0.f;
#pragma unroll
      for (int k = 0; k < C / 16; ++k) {
        if (kReverse ? k < warp : k > warp) continue;
#pragma unroll
        for (int np = 0; np < NB / 16; ++np) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, c_s + ld.b_k_major(16 * k, 16 * np, S::kCS));
          mma<scalar_t>(out[2 * np], p_frag[k], b[0], b[1]);
          mma<scalar_t>(out[2 * np + 1], p_frag[k], b[2], b[3]);
        }
      }
#pragma unroll
      for (int k = 0; k < kKSteps; ++k)
#pragma unroll
        for (int np = 0; np < NB / 16; ++np) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, s_copy + ld.b_k_major(16 * k, 16 * np, S::kSS));
          mma<scalar_t>(out[2 * np], a_frag[k], b[0], b[1]);
          mma<scalar_t>(out[2 * np + 1], a_frag[k], b[2], b[3]);
        }

#pragma unroll
      for (int j = 0; j < NB / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = (e >> 1) ? row_hi : row_lo, col = 8 * j + 2 * q + (e & 1);
          if (row >= n || col >= cols) continue;
          float value = out[j][e];
          if (extra_row) value += extra_a_s[row] * extra_state_s[col];  // the state entering the chunk
          if (p.out_bias != nullptr) value += static_cast<const acc_t*>(p.out_bias)[pair * Dc + m0 + col];
          ops.store(t0 + row, m0 + col, value, den[e >> 1]);
        }
    }

    // S += B^T Cc on this warp's rows of the state (float32 accumulators throughout).
#pragma unroll
    for (int i = 0; i < kStateTiles; ++i)
#pragma unroll
      for (int k = 0; k < C / 16; ++k) {
        uint32_t a[4];
        ldmatrix_x4_trans(a, b_s + ld.a_k_major(state_row0 + 16 * i, 16 * k, S::kAB));
#pragma unroll
        for (int np = 0; np < NB / 16; ++np) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, c_s + ld.b_k_major(16 * k, 16 * np, S::kCS));
          mma<scalar_t>(state[i][2 * np], a, b[0], b[1]);
          mma<scalar_t>(state[i][2 * np + 1], a, b[2], b[3]);
        }
      }
    if (track_key_sum && tid < DA) {
      for (int t = 0; t < C; ++t) key_sum += static_cast<float>(b_s[t * S::kAB + tid]);
    }
    if (extra_row && tid < NB) {
      for (int t = 0; t < C; ++t) extra_state += extra_b_s[t] * static_cast<float>(c_s[t * S::kCS + tid]);
    }
    if (!state_only) {
      __syncthreads();  // every read of the state copy and the vectors is done
      publish();
    }
  }

  const SegmentEnd<acc_t> end(p, pair, segment, Da, Dc, kReverse, P == Pass::Forward);
  if (end.state != nullptr) {
#pragma unroll
    for (int i = 0; i < kStateTiles; ++i)
#pragma unroll
      for (int j = 0; j < NB / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = state_row0 + 16 * i + g + (e >> 1) * 8, col = 8 * j + 2 * q + (e & 1);
          if (row < Da && col < cols) end.state[row * Dc + m0 + col] = state[i][j][e];
        }
  }
  if (end.key_sum != nullptr && track_key_sum && tid < Da && col_tile == 0) end.key_sum[tid] = key_sum;
  if (end.extra != nullptr && extra_row && tid < cols) end.extra[m0 + tid] = extra_state;
}

template <Pass P, typename scalar_t, int DA>
void launch_mma(const KernelParams& params, int64_t Da, int64_t Dc, cudaStream_t stream) {
  using namespace mma16;
  KernelParams p = params;
  const int64_t pairs = p.num_seqs * p.H;  // (sequence, head) pairs
  const int64_t col_tiles = (Dc + NB - 1) / NB;
  auto kernel = mma_product_kernel<P, scalar_t, DA>;
  const size_t smem = Layout<DA>::total;
  if (smem > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  }
  int resident = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, kThreads, smem));
  const int64_t slots = int64_t(multiprocessor_count()) * std::max(resident, 1);
  // Packed sequences (cu_seqlens) are not split in time: each block runs a whole sequence.
  const int64_t segments = (p.cu_seqlens != nullptr || 2 * pairs * col_tiles > slots)
                               ? 1
                               : choose_segments(pairs * col_tiles, slots, p.L, kMinChunksPerSegment * C);
  const SegmentWorkspace workspace = SegmentWorkspace::make<P, float>(p, segments, C, Da, Dc);
  launch_segmented(kernel, p, pairs * col_tiles * p.segments, kThreads, smem, stream, Da, Dc, col_tiles);
}

template <typename scalar_t>
constexpr bool kMmaInput = std::is_same_v<scalar_t, at::Half> || std::is_same_v<scalar_t, at::BFloat16>;

// float16 and bfloat16 inputs, the state's rows (Da) up to kMaxTensorCoreRows.
template <Pass P, typename scalar_t>
void run_mma(const KernelParams& p, int64_t Da, int64_t Dc, cudaStream_t stream) {
  if constexpr (kMmaInput<scalar_t>) {
    if (Da <= 64) {
      launch_mma<P, scalar_t, 64>(p, Da, Dc, stream);
    } else {
      launch_mma<P, scalar_t, 128>(p, Da, Dc, stream);
    }
  } else {
    TORCH_CHECK(false, "fast_causal_attn: the mma.sync kernels take float16 and bfloat16 inputs");
  }
}

}  // namespace cuda
}  // namespace fast_causal_attn
