// The chunked family on tensor cores, for float16 and bfloat16 inputs: the same per-chunk products
// as chunked_product.cuh (P = mask(A B^T), out = P Cc + A S, S += B^T Cc), each on 16 x 16 x 16
// WMMA tiles with float32 accumulation.
//
//   - A, B and Cc are staged in the input dtype (A and B after the pass's scaling, rounded once);
//   - the state S is kept in float32 accumulator fragments, each warp owning DA / 32 of its 16 x 16
//     tiles, and published each chunk as a 16-bit copy for the A S product (as fla keeps its state);
//   - the masked scores P go through float32 shared memory (masking, the normalizer's row sums,
//     the extra row of the normalized gradients) and on as a 16-bit tile for P Cc;
//   - outputs go through float32 shared memory, where the normalizer divides them.
// Blocks own one (batch, head), NB = 64 columns of c and one time segment, as in the chunked family.
//
// Not yet on the default path: FAST_CAUSAL_ATTN_KERNEL=tensorcore selects it for 16-bit inputs
// with head dims up to 128 (see dispatch.cuh) until it has been measured on the device.
#pragma once

#include <mma.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "chunked_product.cuh"

namespace fast_causal_attn {
namespace cuda {
namespace tensorcore {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kWarp;
constexpr int kTile = 16;  // WMMA tile edge
constexpr int C = 64;      // timesteps per chunk
constexpr int NB = 64;     // columns of c per block

// WMMA's element types for torch's 16-bit types (same bits).
template <typename scalar_t>
using mma_t = std::conditional_t<std::is_same_v<scalar_t, at::Half>, __half, __nv_bfloat16>;

// Shared memory, in bytes from the start. 16-bit rows are padded by 8 elements (16 bytes) and
// float rows by 4, so that the 8 rows a WMMA load reads at once fall in different banks; every
// tile starts 32-byte aligned, as WMMA loads ask.
template <int DA>
struct Layout {
  static constexpr int kAB = DA + 8;  // row strides, 16-bit
  static constexpr int kCS = NB + 8;
  static constexpr int kPH = C + 8;
  static constexpr int kSH = NB + 8;
  static constexpr int kPF = C + 4;   // row strides, float
  static constexpr int kOF = NB + 4;
  static constexpr int kScratch = (C * kPF + C * kOF > DA * kOF) ? C * kPF + C * kOF : DA * kOF;

  static constexpr size_t a = 0;                          // [C][kAB] 16-bit
  static constexpr size_t b = a + size_t(C) * kAB * 2;    // [C][kAB]
  static constexpr size_t c = b + size_t(C) * kAB * 2;    // [C][kCS]
  static constexpr size_t p_half = c + size_t(C) * kCS * 2;       // [C][kPH]: masked scores
  static constexpr size_t s_half = p_half + size_t(C) * kPH * 2;  // [DA][kSH]: the state entering the chunk
  // Float scratch: the scores [C][kPF] then the outputs [C][kOF]; the whole of it holds the state
  // [DA][kOF] while it is published.
  static constexpr size_t scratch = s_half + size_t(DA) * kSH * 2;
  static constexpr size_t extra_a = scratch + size_t(kScratch) * 4;  // [C] float
  static constexpr size_t extra_b = extra_a + C * 4;                 // [C]
  static constexpr size_t extra_state = extra_b + C * 4;             // [NB]
  static constexpr size_t key_sum = extra_state + NB * 4;            // [DA]
  static constexpr size_t den = key_sum + DA * 4;                    // [C]
  static constexpr size_t total = den + C * 4;
  static_assert(a % 32 == 0 && b % 32 == 0 && c % 32 == 0 && p_half % 32 == 0 && s_half % 32 == 0 &&
                    scratch % 32 == 0,
                "WMMA tiles start 32-byte aligned");
  static_assert(DA % 32 == 0, "each warp owns DA / 32 tiles of the state");
};

}  // namespace tensorcore

// Two blocks a multiprocessor (shared memory allows it up to DA = 128): 128 registers a thread.
template <Pass P, typename scalar_t, int DA>
__global__ void __launch_bounds__(tensorcore::kThreads, 2)
    tensorcore_product_kernel(const KernelParams p, int64_t Da, int64_t Dc, int64_t col_tiles) {
  using namespace nvcuda;
  using namespace tensorcore;
  using acc_t = float;
  using T = mma_t<scalar_t>;
  using Traits = PassTraits<P>;
  using S = Layout<DA>;
  constexpr bool kReverse = Traits::kReverse;
  constexpr int kChunkTiles = C / kTile, kColTiles = NB / kTile, kRowTiles = DA / kTile;
  constexpr int kStateTiles = kRowTiles * kColTiles / kWarps;  // per warp
  using AccFrag = wmma::fragment<wmma::accumulator, kTile, kTile, kTile, float>;
  using RowA = wmma::fragment<wmma::matrix_a, kTile, kTile, kTile, T, wmma::row_major>;
  using ColA = wmma::fragment<wmma::matrix_a, kTile, kTile, kTile, T, wmma::col_major>;
  using RowB = wmma::fragment<wmma::matrix_b, kTile, kTile, kTile, T, wmma::row_major>;
  using ColB = wmma::fragment<wmma::matrix_b, kTile, kTile, kTile, T, wmma::col_major>;

  extern __shared__ __align__(128) unsigned char tc_smem_raw[];
  scalar_t* a_s = reinterpret_cast<scalar_t*>(tc_smem_raw + S::a);
  scalar_t* b_s = reinterpret_cast<scalar_t*>(tc_smem_raw + S::b);
  scalar_t* c_s = reinterpret_cast<scalar_t*>(tc_smem_raw + S::c);
  scalar_t* p_half = reinterpret_cast<scalar_t*>(tc_smem_raw + S::p_half);
  scalar_t* s_half = reinterpret_cast<scalar_t*>(tc_smem_raw + S::s_half);
  float* scratch = reinterpret_cast<float*>(tc_smem_raw + S::scratch);
  float* p_f = scratch;                // [C][kPF]
  float* o_f = scratch + C * S::kPF;   // [C][kOF]
  float* extra_a_s = reinterpret_cast<float*>(tc_smem_raw + S::extra_a);
  float* extra_b_s = reinterpret_cast<float*>(tc_smem_raw + S::extra_b);
  float* extra_state_s = reinterpret_cast<float*>(tc_smem_raw + S::extra_state);
  float* key_sum_s = reinterpret_cast<float*>(tc_smem_raw + S::key_sum);
  float* den_s = reinterpret_cast<float*>(tc_smem_raw + S::den);
  auto as_mma = [](scalar_t* x) { return reinterpret_cast<const T*>(x); };

  const int tid = threadIdx.x, warp = tid / kWarp;
  int64_t index = blockIdx.x;
  const int64_t segment = index % p.segments;
  index /= p.segments;
  const int64_t col_tile = index % col_tiles, pair = index / col_tiles;
  const Sequence seq = Sequence::of(p, pair);  // a batch entry, or one of the packed sequences
  const int64_t b = seq.b, h = seq.h;
  const int64_t m0 = col_tile * NB;
  const int cols = int(Dc - m0 < NB ? Dc - m0 : NB);
  const int64_t L = seq.length;
  const int64_t den_row = seq.row(p.L, p.H, 0);  // this sequence's first row of den [B, H, L]
  const bool state_only = p.state_only;
  const bool normalize = p.normalize;
  const bool extra_row = Traits::kMayHaveExtraRow && normalize;
  const bool denominator = Traits::kMayHaveDenominator && normalize;
  const bool track_key_sum = denominator || (P == Pass::Forward && p.end_vector != nullptr);
  const acc_t* den_in =
      (normalize && P != Pass::Forward) ? static_cast<const acc_t*>(p.den) + den_row : nullptr;
  const acc_t* grad_den = extra_row ? static_cast<const acc_t*>(p.grad_den) + den_row : nullptr;
  const Operands<P, scalar_t, acc_t> ops(p, b, h, den_in, grad_den, seq.begin);

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
  // The 16-bit copy of the state and the vectors, for the first chunk.
  auto publish_vectors_and_half_state = [&] {
    for (int e = tid; e < DA * NB; e += kThreads) {
      s_half[(e / NB) * S::kSH + e % NB] = static_cast<scalar_t>(scratch[(e / NB) * S::kOF + e % NB]);
    }
    if (tid < DA) key_sum_s[tid] = key_sum;
    if (tid < NB) extra_state_s[tid] = extra_state;
  };
  publish_vectors_and_half_state();

  const int64_t seg_begin = segment * p.segment_len;
  const int64_t seg_end = seg_begin + p.segment_len < L ? seg_begin + p.segment_len : L;
  const int64_t chunks = seg_end > seg_begin ? (seg_end - seg_begin + C - 1) / C : 0;
  for (int64_t it = 0; it < chunks; ++it) {
    const int64_t t0 = seg_begin + (kReverse ? chunks - 1 - it : it) * C;
    const int n = int(seg_end - t0 < C ? seg_end - t0 : C);

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
        for (int k = 0; k < kRowTiles; ++k) {
          RowA fa;
          ColB fb;  // B^T: element (k, j) of the tile is b[j][k]
          wmma::load_matrix_sync(fa, as_mma(a_s + ti * kTile * S::kAB + k * kTile), S::kAB);
          wmma::load_matrix_sync(fb, as_mma(b_s + tj * kTile * S::kAB + k * kTile), S::kAB);
          wmma::mma_sync(acc, fa, fb, acc);
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
        p_half[i * S::kPH + j] = static_cast<scalar_t>(value);
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
          if (col_tile == 0 && i < n) static_cast<acc_t*>(p.den)[den_row + t0 + i] = d;
        }
      }
      __syncthreads();

      // Outputs P Cc + A S, tile by tile; only the score tiles inside the mask contribute.
      for (int t = warp; t < kChunkTiles * kColTiles; t += kWarps) {
        const int ti = t / kColTiles, tn = t % kColTiles;
        AccFrag acc;
        wmma::fill_fragment(acc, 0.f);
        const int k_first = kReverse ? ti : 0, k_last = kReverse ? kChunkTiles - 1 : ti;
        for (int k = k_first; k <= k_last; ++k) {
          RowA fa;
          RowB fb;
          wmma::load_matrix_sync(fa, as_mma(p_half + ti * kTile * S::kPH + k * kTile), S::kPH);
          wmma::load_matrix_sync(fb, as_mma(c_s + k * kTile * S::kCS + tn * kTile), S::kCS);
          wmma::mma_sync(acc, fa, fb, acc);
        }
#pragma unroll 2
        for (int k = 0; k < kRowTiles; ++k) {
          RowA fa;
          RowB fb;
          wmma::load_matrix_sync(fa, as_mma(a_s + ti * kTile * S::kAB + k * kTile), S::kAB);
          wmma::load_matrix_sync(fb, as_mma(s_half + k * kTile * S::kSH + tn * kTile), S::kSH);
          wmma::mma_sync(acc, fa, fb, acc);
        }
        wmma::store_matrix_sync(o_f + ti * kTile * S::kOF + tn * kTile, acc, S::kOF, wmma::mem_row_major);
      }
    }

    // S += B^T Cc on this warp's state tiles (float32 accumulators throughout).
#pragma unroll
    for (int j = 0; j < kStateTiles; ++j) {
      const int t = warp + kWarps * j, rt = t / kColTiles, ct = t % kColTiles;
#pragma unroll 2
      for (int k = 0; k < kChunkTiles; ++k) {
        ColA fa;  // B^T: element (r, s) of the tile is b[s][r]
        RowB fb;
        wmma::load_matrix_sync(fa, as_mma(b_s + k * kTile * S::kAB + rt * kTile), S::kAB);
        wmma::load_matrix_sync(fb, as_mma(c_s + k * kTile * S::kCS + ct * kTile), S::kCS);
        wmma::mma_sync(state[j], fa, fb, state[j]);
      }
    }
    if (track_key_sum && tid < DA) {
      for (int t = 0; t < C; ++t) key_sum += static_cast<float>(b_s[t * S::kAB + tid]);
    }
    if (extra_row && tid < NB) {
      for (int t = 0; t < C; ++t) extra_state += extra_b_s[t] * static_cast<float>(c_s[t * S::kCS + tid]);
    }
    __syncthreads();  // outputs complete in o_f; every read of s_half done

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
    // 16-bit copy.
#pragma unroll
    for (int j = 0; j < kStateTiles; ++j) {
      const int t = warp + kWarps * j;
      wmma::store_matrix_sync(scratch + (t / kColTiles) * kTile * S::kOF + (t % kColTiles) * kTile, state[j], S::kOF,
                              wmma::mem_row_major);
    }
    if (!state_only) {
      __syncthreads();
      publish_vectors_and_half_state();
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
  const SegmentWorkspace workspace = SegmentWorkspace::make<P, acc_t>(p, segments, C, Da, Dc);

  launch_segmented(kernel, p, pairs * col_tiles * p.segments, kThreads, smem, stream, Da, Dc, col_tiles);
}

constexpr int64_t kMaxTensorCoreRows = 128;

// 16-bit inputs, the state's rows (Da) up to kMaxTensorCoreRows.
template <Pass P, typename scalar_t>
void run_tensorcore(const KernelParams& p, int64_t Da, int64_t Dc, cudaStream_t stream) {
  if constexpr (std::is_same_v<scalar_t, at::Half> || std::is_same_v<scalar_t, at::BFloat16>) {
    if (Da <= 32) {
      launch_tensorcore<P, scalar_t, 32>(p, Da, Dc, stream);
    } else if (Da <= 64) {
      launch_tensorcore<P, scalar_t, 64>(p, Da, Dc, stream);
    } else {
      launch_tensorcore<P, scalar_t, 128>(p, Da, Dc, stream);
    }
  } else {
    TORCH_CHECK(false, "fast_causal_attn: the tensor-core kernels take float16 and bfloat16 inputs");
  }
}

}  // namespace cuda
}  // namespace fast_causal_attn
