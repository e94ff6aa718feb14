// The chunked family on tensor cores: the same per-chunk products as chunked_product.cuh
// (P = mask(A B^T), out = P Cc + A S, S += B^T Cc), each on 16 x 16 WMMA tiles with float32
// accumulation; float16/bfloat16 inputs take one 16-bit MMA per step, float32 inputs three TF32
// MMAs (3xTF32, float32-level accuracy; see MmaPolicy).
//
//   - A, B and Cc are staged in shared memory in the input dtype (A and B after the pass's
//     scaling, rounded once);
//   - the state S is kept in float32 accumulator fragments, each warp owning DA / 32 of its 16 x 16
//     tiles, and published each chunk as a copy in the input dtype for the A S product (as fla
//     keeps its state);
//   - the masked scores P go through float32 shared memory (masking, the normalizer's row sums,
//     the extra row of the normalized gradients) and on in the input dtype for P Cc;
//   - outputs go through float32 shared memory, where the normalizer divides them.
// Blocks own one (sequence, head), NB = 64 columns of c and one time segment, as in the chunked
// family.
//
// Not on the default path: FAST_CAUSAL_ATTN_KERNEL=tensorcore selects the family for float16,
// bfloat16 and float32 inputs with head dims up to 128 (see dispatch.cuh). Measured on the H200
// this WMMA kernel was within -15% .. +17% of the recurrent family in bf16 and 2x slower in fp32
// (benchmarks/RESULTS.md): the shared-memory round trips between WMMA products bound it, not the
// tensor cores. 16-bit inputs now take the mma.sync kernels of mma_product.cuh instead; float32
// stays here until 3xTF32 moves there too.
#pragma once

#include <mma.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "chunked_product.cuh"
#include "mma_product.cuh"

namespace fast_causal_attn {
namespace cuda {
namespace tensorcore {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kWarp;
constexpr int kTile = 16;  // WMMA tile edge
constexpr int C = 64;      // timesteps per chunk
constexpr int NB = 64;     // columns of c per block

// How the products run for each input dtype. float16 and bfloat16 stay 16-bit in shared memory and
// take one 16x16x16 MMA per tile step. float32 stays float32 and takes three 16x16x8 TF32 MMAs
// (3xTF32: each operand split into a TF32 head and a TF32 tail, tail x tail dropped), which keeps
// the products at float32's accuracy while they run on tensor cores.
template <typename scalar_t>
struct MmaPolicy {  // float16, bfloat16
  using Storage = scalar_t;
  using Element = std::conditional_t<std::is_same_v<scalar_t, at::Half>, __half, __nv_bfloat16>;  // same bits
  using Pointer = const Element*;
  static constexpr int kK = 16;
  static constexpr bool kSplit = false;
};
template <>
struct MmaPolicy<float> {
  using Storage = float;
  using Element = nvcuda::wmma::precision::tf32;
  using Pointer = const float*;
  static constexpr int kK = 8;
  static constexpr bool kSplit = true;
};

// acc += a b, as the policy says.
template <typename Policy, typename FragA, typename FragB, typename FragAcc>
__device__ __forceinline__ void mma(FragAcc& acc, FragA& a, FragB& b) {
  using namespace nvcuda;
  if constexpr (Policy::kSplit) {
    FragA a_tail;
    FragB b_tail;
#pragma unroll
    for (int i = 0; i < a.num_elements; ++i) {
      const float head = wmma::__float_to_tf32(a.x[i]);
      a_tail.x[i] = wmma::__float_to_tf32(a.x[i] - head);
      a.x[i] = head;
    }
#pragma unroll
    for (int i = 0; i < b.num_elements; ++i) {
      const float head = wmma::__float_to_tf32(b.x[i]);
      b_tail.x[i] = wmma::__float_to_tf32(b.x[i] - head);
      b.x[i] = head;
    }
    wmma::mma_sync(acc, a_tail, b, acc);  // the small terms first
    wmma::mma_sync(acc, a, b_tail, acc);
    wmma::mma_sync(acc, a, b, acc);
  } else {
    wmma::mma_sync(acc, a, b, acc);
  }
}

// Shared memory, in bytes from the start. Rows are padded by 16 bytes (8 16-bit or 4 float
// elements) so that the 8 rows a WMMA load reads at once fall in different banks; every tile
// starts 32-byte aligned, as WMMA loads ask.
template <int DA, typename Storage>
struct Layout {
  static constexpr int kPad = 16 / int(sizeof(Storage));
  static constexpr int kAB = DA + kPad;  // row strides, in Storage elements
  static constexpr int kCS = NB + kPad;
  static constexpr int kPH = C + kPad;
  static constexpr int kSH = NB + kPad;
  static constexpr int kPF = C + 4;      // row strides, float
  static constexpr int kOF = NB + 4;
  static constexpr int kScratch = (C * kPF + C * kOF > DA * kOF) ? C * kPF + C * kOF : DA * kOF;
  static constexpr size_t kElem = sizeof(Storage);

  static constexpr size_t a = 0;                                    // [C][kAB]
  static constexpr size_t b = a + size_t(C) * kAB * kElem;          // [C][kAB]
  static constexpr size_t c = b + size_t(C) * kAB * kElem;          // [C][kCS]
  static constexpr size_t p_masked = c + size_t(C) * kCS * kElem;   // [C][kPH]: masked scores
  static constexpr size_t s_copy = p_masked + size_t(C) * kPH * kElem;  // [DA][kSH]: the state entering the chunk
  // Float scratch: the scores [C][kPF] then the outputs [C][kOF]; the whole of it holds the state
  // [DA][kOF] while it is published.
  static constexpr size_t scratch = s_copy + size_t(DA) * kSH * kElem;
  static constexpr size_t extra_a = scratch + size_t(kScratch) * 4;  // [C] float
  static constexpr size_t extra_b = extra_a + C * 4;                 // [C]
  static constexpr size_t extra_state = extra_b + C * 4;             // [NB]
  static constexpr size_t key_sum = extra_state + NB * 4;            // [DA]
  static constexpr size_t den = key_sum + DA * 4;                    // [C]
  static constexpr size_t total = den + C * 4;
  static_assert(a % 32 == 0 && b % 32 == 0 && c % 32 == 0 && p_masked % 32 == 0 && s_copy % 32 == 0 &&
                    scratch % 32 == 0,
                "WMMA tiles start 32-byte aligned");
  static_assert(DA % 32 == 0, "each warp owns DA / 32 tiles of the state");
};

// Two blocks a multiprocessor where shared memory allows it (128 registers a thread), else one.
template <int DA, typename Storage>
constexpr int kMinBlocks = Layout<DA, Storage>::total <= 113 * 1024 ? 2 : 1;

}  // namespace tensorcore

template <Pass P, typename scalar_t, int DA>
__global__ void __launch_bounds__(tensorcore::kThreads, tensorcore::kMinBlocks<DA, scalar_t>)
    tensorcore_product_kernel(const KernelParams p, int64_t Da, int64_t Dc, int64_t col_tiles) {
  using namespace nvcuda;
  using namespace tensorcore;
  using acc_t = float;
  using Policy = MmaPolicy<scalar_t>;
  using Storage = typename Policy::Storage;
  using Traits = PassTraits<P>;
  using S = Layout<DA, Storage>;
  constexpr bool kReverse = Traits::kReverse;
  constexpr int kK = Policy::kK;  // the MMA's depth
  constexpr int kChunkTiles = C / kTile, kColTiles = NB / kTile, kRowTiles = DA / kTile;
  constexpr int kStateTiles = kRowTiles * kColTiles / kWarps;  // per warp
  using Element = typename Policy::Element;
  using AccFrag = wmma::fragment<wmma::accumulator, kTile, kTile, kK, float>;
  using RowA = wmma::fragment<wmma::matrix_a, kTile, kTile, kK, Element, wmma::row_major>;
  using ColA = wmma::fragment<wmma::matrix_a, kTile, kTile, kK, Element, wmma::col_major>;
  using RowB = wmma::fragment<wmma::matrix_b, kTile, kTile, kK, Element, wmma::row_major>;
  using ColB = wmma::fragment<wmma::matrix_b, kTile, kTile, kK, Element, wmma::col_major>;

  extern __shared__ __align__(128) unsigned char tc_smem_raw[];
  Storage* a_s = reinterpret_cast<Storage*>(tc_smem_raw + S::a);
  Storage* b_s = reinterpret_cast<Storage*>(tc_smem_raw + S::b);
  Storage* c_s = reinterpret_cast<Storage*>(tc_smem_raw + S::c);
  Storage* p_masked = reinterpret_cast<Storage*>(tc_smem_raw + S::p_masked);
  Storage* s_copy = reinterpret_cast<Storage*>(tc_smem_raw + S::s_copy);
  float* scratch = reinterpret_cast<float*>(tc_smem_raw + S::scratch);
  float* p_f = scratch;                // [C][kPF]
  float* o_f = scratch + C * S::kPF;   // [C][kOF]
  float* extra_a_s = reinterpret_cast<float*>(tc_smem_raw + S::extra_a);
  float* extra_b_s = reinterpret_cast<float*>(tc_smem_raw + S::extra_b);
  float* extra_state_s = reinterpret_cast<float*>(tc_smem_raw + S::extra_state);
  float* key_sum_s = reinterpret_cast<float*>(tc_smem_raw + S::key_sum);
  float* den_s = reinterpret_cast<float*>(tc_smem_raw + S::den);
  auto as_mma = [](Storage* x) { return reinterpret_cast<typename Policy::Pointer>(x); };

  const int tid = threadIdx.x, warp = tid / kWarp;
  const chunked::BlockWork<P, scalar_t> work(p, col_tiles, NB, Dc);
  const int64_t segment = work.segment, col_tile = work.col_tile, pair = work.pair, m0 = work.m0;
  const int cols = work.cols;
  const bool state_only = work.state_only, extra_row = work.extra_row, denominator = work.denominator;
  const bool track_key_sum = work.track_key_sum;
  const Operands<P, scalar_t, acc_t> ops = work.operands(p);

  // The starting state: the segments before this one (after, in reverse) and the given start, built
  // in the float scratch, then loaded into this warp's accumulator tiles.
  float key_sum = 0.f, extra_state = 0.f;  // thread tid's entries: key_sum[tid] (< DA), extra_state[tid] (< NB)
  {
    const SegmentStart<acc_t> start(p, pair, segment, Da, Dc, kReverse);
    for (int e = tid; e < DA * NB; e += kThreads) {
      const int row = e / NB, col = e % NB;
      scratch[row * S::kOF + col] = (!state_only && row < Da && col < cols) ? start.state(row, m0 + col) : 0.f;
    }
    if (!state_only && track_key_sum && tid < Da) key_sum = start.key_sum(tid);
    if (!state_only && extra_row && tid < cols) extra_state = start.extra(m0 + tid);
  }
  __syncthreads();
  AccFrag state[kStateTiles];  // tile t = warp + kWarps * j: rows (t / kColTiles) * 16, columns (t % kColTiles) * 16
#pragma unroll
  for (int j = 0; j < kStateTiles; ++j) {
    const int t = warp + kWarps * j;
    wmma::load_matrix_sync(state[j], scratch + (t / kColTiles) * kTile * S::kOF + (t % kColTiles) * kTile, S::kOF,
                           wmma::mem_row_major);
  }
  // The copy of the state in the input dtype and the vectors, for the first chunk.
  auto publish_vectors_and_state_copy = [&] {
    for (int e = tid; e < DA * NB; e += kThreads) {
      s_copy[(e / NB) * S::kSH + e % NB] = static_cast<Storage>(scratch[(e / NB) * S::kOF + e % NB]);
    }
    if (tid < DA) key_sum_s[tid] = key_sum;
    if (tid < NB) extra_state_s[tid] = extra_state;
  };
  publish_vectors_and_state_copy();

  const int64_t chunks = work.chunk_count(C);
  for (int64_t it = 0; it < chunks; ++it) {
    const int64_t t0 = work.chunk_begin(it, chunks, C);
    const int n = work.chunk_len(t0, C);

    __syncthreads();  // the previous chunk is done with every buffer
    chunked::stage_chunk<C, DA, NB, S::kAB, S::kCS>(a_s, b_s, c_s, extra_a_s, extra_b_s, ops, t0, n, Da, m0, cols,
                                                    !state_only, extra_row);
    __syncthreads();

    if (!state_only) {
      // Scores A B^T, tile by tile; tiles wholly outside the causal mask are skipped (never read).
      for (int t = warp; t < kChunkTiles * kChunkTiles; t += kWarps) {
        const int ti = t / kChunkTiles, tj = t % kChunkTiles;
        if (kReverse ? tj < ti : tj > ti) continue;
        AccFrag acc;
        wmma::fill_fragment(acc, 0.f);
#pragma unroll 2
        for (int k = 0; k < DA; k += kK) {
          RowA fa;
          ColB fb;  // B^T: element (k, j) of the tile is b[j][k]
          wmma::load_matrix_sync(fa, as_mma(a_s + ti * kTile * S::kAB + k), S::kAB);
          wmma::load_matrix_sync(fb, as_mma(b_s + tj * kTile * S::kAB + k), S::kAB);
          mma<Policy>(acc, fa, fb);
        }
        wmma::store_matrix_sync(p_f + ti * kTile * S::kPF + tj * kTile, acc, S::kPF, wmma::mem_row_major);
      }
      __syncthreads();

      // Mask, add the extra row, round to the input dtype for the P Cc product.
      for (int e = tid; e < C * C; e += kThreads) {
        const int i = e / C, j = e % C;
        const bool keep = kReverse ? j >= i : j <= i;
        float value = keep ? p_f[i * S::kPF + j] : 0.f;
        if (keep && extra_row) value += extra_a_s[i] * extra_b_s[j];
        p_masked[i * S::kPH + j] = static_cast<Storage>(value);
      }
      if (denominator) {  // eps + the row sum of the float scores + a . key_sum; 4 threads a row
        constexpr int kPerRow = kThreads / C;
        const int i = tid / kPerRow, part = tid % kPerRow;
        float d = 0.f;
        for (int j = part; j <= i; j += kPerRow) d += p_f[i * S::kPF + j];
        for (int k = part; k < DA; k += kPerRow) d += static_cast<float>(a_s[i * S::kAB + k]) * key_sum_s[k];
#pragma unroll
        for (int offset = kPerRow / 2; offset > 0; offset /= 2) d += __shfl_xor_sync(0xffffffffu, d, offset);
        if (part == 0) {
          d += float(p.eps);
          den_s[i] = d;
          if (col_tile == 0 && i < n) static_cast<acc_t*>(p.den)[work.den_row + t0 + i] = d;
        }
      }
      __syncthreads();

      // Outputs P Cc + A S, tile by tile; only the score tiles inside the mask contribute.
      for (int t = warp; t < kChunkTiles * kColTiles; t += kWarps) {
        const int ti = t / kColTiles, tn = t % kColTiles;
        AccFrag acc;
        wmma::fill_fragment(acc, 0.f);
        const int k_first = kReverse ? ti : 0, k_last = kReverse ? kChunkTiles - 1 : ti;
        for (int k = k_first * kTile; k < (k_last + 1) * kTile; k += kK) {
          RowA fa;
          RowB fb;
          wmma::load_matrix_sync(fa, as_mma(p_masked + ti * kTile * S::kPH + k), S::kPH);
          wmma::load_matrix_sync(fb, as_mma(c_s + k * S::kCS + tn * kTile), S::kCS);
          mma<Policy>(acc, fa, fb);
        }
#pragma unroll 2
        for (int k = 0; k < DA; k += kK) {
          RowA fa;
          RowB fb;
          wmma::load_matrix_sync(fa, as_mma(a_s + ti * kTile * S::kAB + k), S::kAB);
          wmma::load_matrix_sync(fb, as_mma(s_copy + k * S::kSH + tn * kTile), S::kSH);
          mma<Policy>(acc, fa, fb);
        }
        wmma::store_matrix_sync(o_f + ti * kTile * S::kOF + tn * kTile, acc, S::kOF, wmma::mem_row_major);
      }
    }

    // S += B^T Cc on this warp's state tiles (float32 accumulators throughout).
#pragma unroll
    for (int j = 0; j < kStateTiles; ++j) {
      const int t = warp + kWarps * j, rt = t / kColTiles, ct = t % kColTiles;
#pragma unroll 2
      for (int k = 0; k < C; k += kK) {
        ColA fa;  // B^T: element (r, s) of the tile is b[s][r]
        RowB fb;
        wmma::load_matrix_sync(fa, as_mma(b_s + k * S::kAB + rt * kTile), S::kAB);
        wmma::load_matrix_sync(fb, as_mma(c_s + k * S::kCS + ct * kTile), S::kCS);
        mma<Policy>(state[j], fa, fb);
      }
    }
    if (track_key_sum && tid < DA) {
      for (int t = 0; t < C; ++t) key_sum += static_cast<float>(b_s[t * S::kAB + tid]);
    }
    if (extra_row && tid < NB) {
      for (int t = 0; t < C; ++t) extra_state += extra_b_s[t] * static_cast<float>(c_s[t * S::kCS + tid]);
    }
    __syncthreads();  // outputs complete in o_f; every read of s_copy done

    if (!state_only) {
      for (int e = tid; e < C * NB; e += kThreads) {
        const int i = e / NB, m = e % NB;
        if (i >= n || m >= cols) continue;
        float value = o_f[i * S::kOF + m];
        if (extra_row) value += extra_a_s[i] * extra_state_s[m];  // the state entering the chunk
        if (p.out_bias != nullptr) value += static_cast<const acc_t*>(p.out_bias)[pair * Dc + m0 + m];
        ops.store(t0 + i, m0 + m, value, denominator ? den_s[i] : 1.f);
      }
      __syncthreads();  // o_f is read
    }

    // Publish the state for the next chunk (and the end): float tiles into the scratch, then the
    // copy in the input dtype.
#pragma unroll
    for (int j = 0; j < kStateTiles; ++j) {
      const int t = warp + kWarps * j;
      wmma::store_matrix_sync(scratch + (t / kColTiles) * kTile * S::kOF + (t % kColTiles) * kTile, state[j], S::kOF,
                              wmma::mem_row_major);
    }
    if (!state_only) {
      __syncthreads();
      publish_vectors_and_state_copy();
    }
  }
  __syncthreads();  // the scratch holds the final state

  const SegmentEnd<acc_t> end(p, pair, segment, Da, Dc, kReverse, P == Pass::Forward);
  if (end.state != nullptr) {
    for (int e = tid; e < DA * NB; e += kThreads) {
      const int row = e / NB, col = e % NB;
      if (row < Da && col < cols) end.state[row * Dc + m0 + col] = scratch[row * S::kOF + col];
    }
  }
  if (end.key_sum != nullptr && track_key_sum && tid < Da && col_tile == 0) end.key_sum[tid] = key_sum;
  if (end.extra != nullptr && extra_row && tid < cols) end.extra[m0 + tid] = extra_state;
}

template <Pass P, typename scalar_t, int DA>
void launch_tensorcore(const KernelParams& params, int64_t Da, int64_t Dc, cudaStream_t stream) {
  using namespace tensorcore;
  using acc_t = float;
  KernelParams p = params;
  const int64_t pairs = p.num_seqs * p.H;  // (sequence, head) pairs
  const int64_t col_tiles = (Dc + NB - 1) / NB;
  auto kernel = tensorcore_product_kernel<P, scalar_t, DA>;
  const size_t smem = Layout<DA, typename MmaPolicy<scalar_t>::Storage>::total;
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
  const SegmentWorkspace workspace = SegmentWorkspace::make<P, acc_t>(p, segments, C, Da, Dc);

  launch_segmented(kernel, p, pairs * col_tiles * p.segments, kThreads, smem, stream, Da, Dc, col_tiles);
}

constexpr int64_t kMaxTensorCoreRows = 128;

template <typename scalar_t>
constexpr bool kTensorCoreInput =
    std::is_same_v<scalar_t, at::Half> || std::is_same_v<scalar_t, at::BFloat16> || std::is_same_v<scalar_t, float>;

// float16, bfloat16 and float32 inputs, the state's rows (Da) up to kMaxTensorCoreRows: 16-bit
// inputs on the mma.sync kernels (mma_product.cuh), float32 on WMMA with 3xTF32 (this file).
template <Pass P, typename scalar_t>
void run_tensorcore(const KernelParams& p, int64_t Da, int64_t Dc, cudaStream_t stream) {
  if constexpr (kMmaInput<scalar_t>) {
    run_mma<P, scalar_t>(p, Da, Dc, stream);
  } else if constexpr (kTensorCoreInput<scalar_t>) {
    if (Da <= 32) {
      launch_tensorcore<P, scalar_t, 32>(p, Da, Dc, stream);
    } else if (Da <= 64) {
      launch_tensorcore<P, scalar_t, 64>(p, Da, Dc, stream);
    } else {
      launch_tensorcore<P, scalar_t, 128>(p, Da, Dc, stream);
    }
  } else {
    TORCH_CHECK(false, "fast_causal_attn: the tensor-core kernels take float16, bfloat16 and float32 inputs");
  }
}

}  // namespace cuda
}  // namespace fast_causal_attn
