// The chunked CUDA kernel family: the same causal product as the recurrent kernels,
// out[t] = sum_{s<=t} (a[t] . b[s]) c[s] (s >= t in reverse), taken C timesteps at a time so that
// every step is a small matrix product instead of a rank-1 update:
//
//   P   = mask(A B^T)            C x C scores of the chunk (lower triangle; upper in reverse)
//   out = P Cc + A S             the chunk's own terms plus everything before it (after, in reverse)
//   S  += B^T Cc                 the running state, Da x NB
//
// A, B are the chunk's C x Da rows of a and b, Cc its C x NB columns of c. A block owns one
// (batch, head), NB columns of c and one time segment; it walks its chunks forward (or backward),
// keeping the state in registers (each thread its TK x kVec corner) with a copy in shared memory for
// the A S product. Every product is a CUDA-core FMA micro-tile over shared memory, in the
// accumulation type, so float32 stays exact float32.
//
// The normalizer and the extra row of the normalized gradients (see Operands) are rank-one
// additions to the same products: den = eps + rowsum(P) + A key_sum, and P += extra_a extra_b^T,
// out += extra_a extra_state^T, extra_state += Cc^T extra_b.
//
// Few (batch, head) pairs: time splits into segments as in the recurrent family (a state-only
// launch, then each segment starts from the sum of the segments before it).
#pragma once

#include "kernel_common.cuh"

namespace fast_causal_attn {
namespace cuda {
namespace chunked {

constexpr int kThreads = 256;
constexpr int kGrid = 16;  // every product spreads its output over a kGrid x kGrid thread grid
static_assert(kGrid * kGrid == kThreads, "the thread grid is the block");

// Shared memory of a block (offsets in accumulation-type elements). Rows are padded by one vector
// so that the 16 rows a warp reads at once fall in different banks.
template <typename acc_t, int DA, int C>
struct Layout {
  static constexpr int kVec = 16 / int(sizeof(acc_t));  // elements per 16-byte shared-memory access
  static constexpr int NB = kGrid * kVec;                // columns of c per block: one vector a thread
  static constexpr int kAB = DA + kVec;                  // row strides
  static constexpr int kCS = NB + kVec;
  static constexpr int kPS = C + kVec;
  static constexpr int a = 0;                  // [C][kAB]
  static constexpr int b = a + C * kAB;        // [C][kAB]
  static constexpr int c = b + C * kAB;        // [C][kCS]
  static constexpr int p = c + C * kCS;        // [C][kPS]
  static constexpr int s = p + C * kPS;        // [DA][kCS]: the state entering the chunk
  static constexpr int extra_a = s + DA * kCS;  // [C]
  static constexpr int extra_b = extra_a + C;   // [C]
  static constexpr int extra_state = extra_b + C;  // [NB]
  static constexpr int key_sum = extra_state + NB;  // [DA]
  static constexpr int den = key_sum + DA;          // [C]
  static constexpr int total = den + C;
  static_assert(DA % kGrid == 0 && DA % kVec == 0 && C % kGrid == 0 && C % kVec == 0, "tile shapes");
};

template <typename acc_t, int DA, int C>
constexpr size_t bytes() {
  return size_t(Layout<acc_t, DA, C>::total) * sizeof(acc_t);
}

// Timesteps per chunk: 64 where two blocks still fit a multiprocessor, else 32.
template <typename acc_t, int DA>
constexpr int chunk_len() {
  return sizeof(acc_t) == 4 && DA <= 64 ? 64 : 32;
}

template <int N, typename acc_t>
__device__ __forceinline__ void load_vec(const acc_t* src, acc_t (&dst)[N]) {
  constexpr int kVec = 16 / int(sizeof(acc_t));
  if constexpr (N % kVec == 0) {
#pragma unroll
    for (int i = 0; i < N; i += kVec) {
      if constexpr (sizeof(acc_t) == 4) {
        const float4 x = *reinterpret_cast<const float4*>(src + i);
        dst[i] = x.x, dst[i + 1] = x.y, dst[i + 2] = x.z, dst[i + 3] = x.w;
      } else {
        const double2 x = *reinterpret_cast<const double2*>(src + i);
        dst[i] = x.x, dst[i + 1] = x.y;
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = src[i];
  }
}

// Stages kRows x kWidth elements of one operand into shared memory rows of kStride, converted to
// Dst, by a block of kBlock threads: thread tid loads column tid % kWidth of rows tid / kWidth +
// k * (kBlock / kWidth), kBatch loads in flight before their stores. Rows wider than the block
// go in slices of kBlock columns.
template <int kRows, int kWidth, int kStride, int kBlock, typename Dst, typename Load>
__device__ __forceinline__ void stage(Dst* dst, Load load) {
  if constexpr (kWidth > kBlock) {
    static_assert(kWidth % kBlock == 0, "whole slices");
#pragma unroll 1
    for (int col0 = 0; col0 < kWidth; col0 += kBlock) {
      stage<kRows, kBlock, kStride, kBlock>(dst + col0, [&](int t, int c) { return load(t, col0 + c); });
    }
  } else {
    using Value = decltype(load(0, 0));
    static_assert(kBlock % kWidth == 0, "every thread keeps one column");
    constexpr int kRowStep = kBlock / kWidth;
    constexpr int kPerThread = kRows / kRowStep;
    constexpr int kBatch = kPerThread < 8 ? kPerThread : 8;
    static_assert(kRows % kRowStep == 0 && kPerThread % kBatch == 0, "staging must divide evenly");
    const int col = threadIdx.x % kWidth, row0 = threadIdx.x / kWidth;
#pragma unroll 1
    for (int k0 = 0; k0 < kPerThread; k0 += kBatch) {
      Value r[kBatch];
#pragma unroll
      for (int kk = 0; kk < kBatch; ++kk) r[kk] = load(row0 + (k0 + kk) * kRowStep, col);
#pragma unroll
      for (int kk = 0; kk < kBatch; ++kk) dst[(row0 + (k0 + kk) * kRowStep) * kStride + col] = static_cast<Dst>(r[kk]);
    }
  }
}

// The extra row's a and b of timesteps [t0, t0 + n) (zero past them), by the block's first C threads.
template <int C, typename Extra, typename Ops>
__device__ __forceinline__ void stage_extra_row(Extra* extra_a_s, Extra* extra_b_s, const Ops& ops, int64_t t0, int n) {
  const int tid = threadIdx.x;
  if (tid < C) {
    extra_a_s[tid] = tid < n ? Extra(ops.extra_a(t0 + tid)) : Extra(0);
    extra_b_s[tid] = tid < n ? Extra(ops.extra_b(t0 + tid)) : Extra(0);
  }
}

// Stages one chunk, timesteps [t0, t0 + n): a (when with_a), b and c, converted to Dst, and the
// extra row's a and b; rows past the chunk, Da or the block's columns are zero. kBlock threads
// (at least C) share the work.
template <int C, int DA, int NB, int kAB, int kCS, int kBlock, typename Dst, typename Extra, typename Ops>
__device__ __forceinline__ void stage_chunk(Dst* a_s, Dst* b_s, Dst* c_s, Extra* extra_a_s, Extra* extra_b_s,
                                            const Ops& ops, int64_t t0, int n, int64_t Da, int64_t m0, int cols,
                                            bool with_a, bool extra_row) {
  using acc_t = decltype(ops.a_at(0, 0));
  if (with_a) {
    stage<C, DA, kAB, kBlock>(a_s, [&](int t, int r) { return t < n && r < Da ? ops.a_at(t0 + t, r) : acc_t(0); });
  }
  stage<C, DA, kAB, kBlock>(b_s, [&](int t, int r) { return t < n && r < Da ? ops.b_at(t0 + t, r) : acc_t(0); });
  stage<C, NB, kCS, kBlock>(c_s, [&](int t, int m) { return t < n && m < cols ? ops.c_at(t0 + t, m0 + m) : acc_t(0); });
  if (extra_row) stage_extra_row<C>(extra_a_s, extra_b_s, ops, t0, n);
}

// out[ii][nn] += sum_{k < K} x[row_ii][k] y[k][col_nn], rows ty + G ii of x (row stride ldx),
// columns tx kVec + nn of y (row stride ldy): the micro-tile step of every product here.
template <int K, int TP, int kVec, int G, typename acc_t>
__device__ __forceinline__ void accumulate_product(acc_t (&out)[TP][kVec], const acc_t* x, int ldx, const acc_t* y,
                                                   int ldy, int ty, int tx) {
#pragma unroll 1
  for (int k = 0; k < K; k += kVec) {
    acc_t xv[TP][kVec];
#pragma unroll
    for (int ii = 0; ii < TP; ++ii) load_vec(x + (ty + G * ii) * ldx + k, xv[ii]);
#pragma unroll
    for (int u = 0; u < kVec; ++u) {
      acc_t yv[kVec];
      load_vec(y + (k + u) * ldy + tx * kVec, yv);
#pragma unroll
      for (int ii = 0; ii < TP; ++ii)
#pragma unroll
        for (int nn = 0; nn < kVec; ++nn) out[ii][nn] += xv[ii][u] * yv[nn];
    }
  }
}

// What a block of a chunked kernel works on, from its index: grid.x = ((sequence * heads + head) *
// column tiles + column tile) * segments + segment (with row tiles, see the constructor). Its
// (sequence, head), its nb columns of c from m0, its time segment, and the flags of its pass.
template <Pass P, typename scalar_t>
struct BlockWork {
  using acc_t = at::opmath_type<scalar_t>;
  int64_t segment, col_tile, pair;
  Piece piece;       // a whole segment, or its head or tail (KernelParams::state_head)
  Sequence seq;      // a batch entry, or one of the packed sequences
  int64_t m0;
  int cols;          // columns of c this block owns: min(nb, Dc - m0)
  // The state's rows (a's and b's columns) this block owns from k0 on: all (k0 = 0), or with
  // row_tiles > 1 a tile of `rows` (the float32 wgmma kernel: its blocks' outputs are summed),
  // from the grid or, where the launch runs one tile (KernelParams::row_tile), that tile
  int64_t k0 = 0;
  int64_t L;         // the sequence's timesteps
  int64_t den_row;   // the sequence's first row of den [B, H, L]
  int64_t seg_begin, seg_end;  // the segment's timesteps of the sequence
  bool state_only, extra_row, denominator, track_key_sum;

  // With row tiles in the grid: grid.x = ((pair * row_tiles + row tile) * col_tiles + column
  // tile) * segments + segment. `block`: the block's place in that order where it is not blockIdx.x (a ticket:
  // KernelParams::lookback).
  __device__ BlockWork(const KernelParams& p, int64_t col_tiles, int nb, int64_t Dc, int64_t row_tiles = 1,
                       int rows = 0, int64_t block = -1) {
    int64_t index = block >= 0 ? block : int64_t(blockIdx.x);
    piece = piece_of_block(p, index);
    segment = segment_of_block<P>(p, index);
    col_tile = index % col_tiles;
    index /= col_tiles;
    if (p.row_tile >= 0) {
      k0 = p.row_tile * rows;
    } else if (row_tiles > 1) {
      k0 = (index % row_tiles) * rows;
      index /= row_tiles;
    }
    pair = index;
    seq = Sequence::of(p, pair);
    m0 = col_tile * nb;
    cols = int(Dc - m0 < nb ? Dc - m0 : nb);
    L = seq.length;
    den_row = seq.row(p.L, p.H, 0);
    seg_begin = segment * p.segment_len;
    seg_end = seg_begin + p.segment_len < L ? seg_begin + p.segment_len : L;
    if (piece != Piece::kSegment) {  // the state-only launch's head or tail of the segment
      const int64_t split = seg_begin + p.state_head < seg_end ? seg_begin + p.state_head : seg_end;
      (piece == Piece::kHead ? seg_end : seg_begin) = split;
    }
    state_only = p.state_only;
    extra_row = PassTraits<P>::kMayHaveExtraRow && p.normalize;
    denominator = PassTraits<P>::kMayHaveDenominator && p.normalize;
    track_key_sum = denominator || (P == Pass::Forward && p.end_vector != nullptr);
  }

  // The segment's chunks of C timesteps, walked forward (backward in reverse): chunk `it` of
  // `chunks` starts at chunk_begin(it, ...) and holds chunk_len(t0) timesteps. `reverse` walks
  // them from the last whatever the pass (a walk that only sums, which is order-free).
  __device__ int64_t chunk_count(int C) const { return seg_end > seg_begin ? (seg_end - seg_begin + C - 1) / C : 0; }
  __device__ int64_t chunk_begin(int64_t it, int64_t chunks, int C, bool reverse = PassTraits<P>::kReverse) const {
    return seg_begin + (reverse ? chunks - 1 - it : it) * C;
  }
  __device__ int chunk_len(int64_t t0, int C) const { return int(seg_end - t0 < C ? seg_end - t0 : C); }

  __device__ Operands<P, scalar_t, acc_t> operands(const KernelParams& p) const {
    const acc_t* den = (p.normalize && P != Pass::Forward) ? static_cast<const acc_t*>(p.den) + den_row : nullptr;
    const acc_t* dout_dot_out = extra_row ? static_cast<const acc_t*>(p.dout_dot_out) + den_row : nullptr;
    return Operands<P, scalar_t, acc_t>(p, seq.b, seq.h, den, dout_dot_out, seq.begin);
  }
};

}  // namespace chunked

// Blocks per multiprocessor the register budget is set for: as many as shared memory allows, up to
// two (128 registers a thread).
template <typename acc_t, int DA, int C>
constexpr int kChunkedMinBlocks = chunked::bytes<acc_t, DA, C>() <= 113 * 1024 ? 2 : 1;

// grid.x = ((batch * heads) * column tiles + column tile) * segments + segment.
template <Pass P, typename scalar_t, int DA, int C>
__global__ void __launch_bounds__(chunked::kThreads, kChunkedMinBlocks<at::opmath_type<scalar_t>, DA, C>)
    chunked_product_kernel(const KernelParams p, int64_t Da, int64_t Dc, int64_t col_tiles) {
  using acc_t = at::opmath_type<scalar_t>;
  using Traits = PassTraits<P>;
  using S = chunked::Layout<acc_t, DA, C>;
  constexpr int kVec = S::kVec, NB = S::NB, G = chunked::kGrid;
  constexpr int TP = C / G;   // rows (and columns) of P per thread
  constexpr int TK = DA / G;  // rows of the state per thread (its columns: one vector)
  constexpr bool kReverse = Traits::kReverse;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  acc_t* smem = reinterpret_cast<acc_t*>(smem_raw);
  acc_t* a_s = smem + S::a;
  acc_t* b_s = smem + S::b;
  acc_t* c_s = smem + S::c;
  acc_t* p_s = smem + S::p;
  acc_t* s_s = smem + S::s;
  acc_t* extra_a_s = smem + S::extra_a;
  acc_t* extra_b_s = smem + S::extra_b;
  acc_t* extra_state_s = smem + S::extra_state;
  acc_t* key_sum_s = smem + S::key_sum;
  acc_t* den_s = smem + S::den;

  // Thread (ty, tx) of the grid; each warp covers 4 x 8 of it, so that a warp's reads of one row
  // of c or of the state touch 8 distinct 16-byte vectors (one shared-memory wavefront) and its reads
  // of a, b or P rows touch 4 or 8 rows in distinct banks.
  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp;
  const int ty = (warp / 2) * 4 + lane / 8, tx = (warp % 2) * 8 + lane % 8;
  static_assert(G == 16 && chunked::kThreads == 8 * kWarp, "the warp tiling assumes a 16 x 16 grid of 8 warps");
  const chunked::BlockWork<P, scalar_t> work(p, col_tiles, NB, Dc);
  const int64_t segment = work.segment, col_tile = work.col_tile, pair = work.pair, m0 = work.m0;
  const int cols = work.cols;
  const bool state_only = work.state_only, extra_row = work.extra_row, denominator = work.denominator;
  const bool track_key_sum = work.track_key_sum;
  const Operands<P, scalar_t, acc_t> ops = work.operands(p);

  // This thread's corner of the state: rows ty * TK + kk, columns tx * kVec + nn. Thread tid also
  // keeps key_sum[tid] (tid < DA) and extra_state[tid] (tid < NB).
  acc_t state[TK][kVec];
#pragma unroll
  for (int kk = 0; kk < TK; ++kk)
#pragma unroll
    for (int nn = 0; nn < kVec; ++nn) state[kk][nn] = acc_t(0);
  acc_t key_sum = acc_t(0), extra_state = acc_t(0);
  // visit(kk, nn, row, col) for each element of this thread's corner inside Da x cols.
  auto for_each_in_corner = [&](auto&& visit) {
#pragma unroll
    for (int kk = 0; kk < TK; ++kk) {
#pragma unroll
      for (int nn = 0; nn < kVec; ++nn) {
        const int row = ty * TK + kk, col = tx * kVec + nn;
        if (row < Da && col < cols) visit(kk, nn, row, col);
      }
    }
  };

  if (!state_only) {  // start from the segments before this one (after, in reverse) and the given start
    const SegmentStart<acc_t> start(p, pair, segment, Da, Dc);
    for_each_in_corner([&](int kk, int nn, int row, int col) { state[kk][nn] = start.state(row, m0 + col); });
    if (track_key_sum && tid < Da) key_sum = start.key_sum(tid);
    if (extra_row && tid < cols) extra_state = start.extra(m0 + tid);
  }
  auto publish_state = [&] {  // the state entering the next chunk, for its A S product
#pragma unroll
    for (int kk = 0; kk < TK; ++kk)
#pragma unroll
      for (int nn = 0; nn < kVec; ++nn) s_s[(ty * TK + kk) * S::kCS + tx * kVec + nn] = state[kk][nn];
    if (tid < DA) key_sum_s[tid] = key_sum;
    if (tid < NB) extra_state_s[tid] = extra_state;
  };
  publish_state();

  const int64_t chunks = work.chunk_count(C);
  for (int64_t it = 0; it < chunks; ++it) {
    const int64_t t0 = work.chunk_begin(it, chunks, C);
    const int n = work.chunk_len(t0, C);

    __syncthreads();  // every thread is done with the previous chunk
    chunked::stage_chunk<C, DA, NB, S::kAB, S::kCS, chunked::kThreads>(a_s, b_s, c_s, extra_a_s, extra_b_s, ops, t0,
                                                                       n, Da, m0, cols, !state_only, extra_row);
    __syncthreads();

    if (!state_only) {
      // P = mask(A B^T) (+ extra_a extra_b^T): rows ty + G ii, columns tx + G jj.
      acc_t pacc[TP][TP];
#pragma unroll
      for (int ii = 0; ii < TP; ++ii)
#pragma unroll
        for (int jj = 0; jj < TP; ++jj) pacc[ii][jj] = acc_t(0);
#pragma unroll 1
      for (int k = 0; k < DA; k += kVec) {
        acc_t av[TP][kVec], bv[TP][kVec];
#pragma unroll
        for (int ii = 0; ii < TP; ++ii) chunked::load_vec(a_s + (ty + G * ii) * S::kAB + k, av[ii]);
#pragma unroll
        for (int jj = 0; jj < TP; ++jj) chunked::load_vec(b_s + (tx + G * jj) * S::kAB + k, bv[jj]);
#pragma unroll
        for (int ii = 0; ii < TP; ++ii)
#pragma unroll
          for (int jj = 0; jj < TP; ++jj)
#pragma unroll
            for (int u = 0; u < kVec; ++u) pacc[ii][jj] += av[ii][u] * bv[jj][u];
      }
#pragma unroll
      for (int ii = 0; ii < TP; ++ii) {
#pragma unroll
        for (int jj = 0; jj < TP; ++jj) {
          const int i = ty + G * ii, j = tx + G * jj;
          const acc_t value = extra_row ? pacc[ii][jj] + extra_a_s[i] * extra_b_s[j] : pacc[ii][jj];
          p_s[i * S::kPS + j] = (kReverse ? j >= i : j <= i) ? value : acc_t(0);
        }
      }
      __syncthreads();

      // The normalizer (forward only): kThreads / C threads a row, then a shuffle sum.
      if (denominator) {
        constexpr int kPerRow = chunked::kThreads / C;
        const int i = tid / kPerRow, part = tid % kPerRow;
        acc_t d = acc_t(0);
        for (int j = part; j < C; j += kPerRow) d += p_s[i * S::kPS + j];
        for (int k = part; k < DA; k += kPerRow) d += a_s[i * S::kAB + k] * key_sum_s[k];
#pragma unroll
        for (int offset = kPerRow / 2; offset > 0; offset /= 2) d += __shfl_xor_sync(0xffffffffu, d, offset);
        if (part == 0) {
          d += acc_t(p.eps);
          den_s[i] = d;
          if (col_tile == 0 && i < n) static_cast<acc_t*>(p.den)[work.den_row + t0 + i] = d;
        }
        __syncthreads();
      }

      // out = P Cc + A S (+ extra_a extra_state^T): rows ty + G ii, columns tx kVec + nn.
      acc_t out[TP][kVec];
#pragma unroll
      for (int ii = 0; ii < TP; ++ii)
#pragma unroll
        for (int nn = 0; nn < kVec; ++nn) out[ii][nn] = acc_t(0);
      chunked::accumulate_product<C, TP, kVec, G>(out, p_s, S::kPS, c_s, S::kCS, ty, tx);
      chunked::accumulate_product<DA, TP, kVec, G>(out, a_s, S::kAB, s_s, S::kCS, ty, tx);
#pragma unroll
      for (int ii = 0; ii < TP; ++ii) {
        const int i = ty + G * ii;
        if (i >= n) continue;
        const acc_t den = denominator ? den_s[i] : acc_t(1);
#pragma unroll
        for (int nn = 0; nn < kVec; ++nn) {
          const int m = tx * kVec + nn;
          acc_t value = extra_row ? out[ii][nn] + extra_a_s[i] * extra_state_s[m] : out[ii][nn];
          if (m < cols) {
            if (p.out_bias != nullptr) value += static_cast<const acc_t*>(p.out_bias)[pair * Dc + m0 + m];
            ops.store(t0 + i, m0 + m, value, den);
          }
        }
      }
    }

    // S += B^T Cc, and the rank-one sums beside it.
#pragma unroll 2
    for (int t = 0; t < C; ++t) {
      acc_t bv[TK], cv[kVec];
      chunked::load_vec(b_s + t * S::kAB + ty * TK, bv);
      chunked::load_vec(c_s + t * S::kCS + tx * kVec, cv);
#pragma unroll
      for (int kk = 0; kk < TK; ++kk)
#pragma unroll
        for (int nn = 0; nn < kVec; ++nn) state[kk][nn] += bv[kk] * cv[nn];
    }
    if (track_key_sum && tid < DA) {
#pragma unroll 4
      for (int t = 0; t < C; ++t) key_sum += b_s[t * S::kAB + tid];
    }
    if (extra_row && tid < NB) {
#pragma unroll 4
      for (int t = 0; t < C; ++t) extra_state += extra_b_s[t] * c_s[t * S::kCS + tid];
    }
    if (!state_only) {
      __syncthreads();  // every thread has read the state entering this chunk
      publish_state();
    }
  }

  const SegmentEnd<acc_t> end(p, pair, segment, Da, Dc, kReverse, P == Pass::Forward, work.piece);
  if (end.state != nullptr) {
    for_each_in_corner([&](int kk, int nn, int row, int col) { end.state[row * Dc + m0 + col] = state[kk][nn]; });
  }
  if (end.key_sum != nullptr && track_key_sum && tid < Da && col_tile == 0) end.key_sum[tid] = key_sum;
  if (end.extra != nullptr && extra_row && tid < cols) end.extra[m0 + tid] = extra_state;
}

// The low-occupancy threshold of this family: segments are added while the launch has fewer
// blocks than the device holds at once, each segment at least kMinChunksPerSegment chunks long.
constexpr int64_t kMinChunksPerSegment = 4;

template <Pass P, typename scalar_t, int DA>
void launch_chunked(const KernelParams& params, int64_t Da, int64_t Dc, cudaStream_t stream) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int C = chunked::chunk_len<acc_t, DA>();
  using S = chunked::Layout<acc_t, DA, C>;
  KernelParams p = params;
  const int64_t pairs = p.num_seqs * p.H;  // (sequence, head) pairs
  const int64_t col_tiles = (Dc + S::NB - 1) / S::NB;

  auto kernel = chunked_product_kernel<P, scalar_t, DA, C>;
  const size_t smem = chunked::bytes<acc_t, DA, C>();
  allow_dynamic_smem(kernel, smem);
  int resident = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, chunked::kThreads, smem));
  // Segments only while the launch fills less than half of what the device holds: at
  // 8,16,2048,128 (256 blocks, 264 slots) two segments cost a 0.41 ms state pass before a 1.11 ms
  // main pass (H200, fp32, ncu).
  const int64_t slots = int64_t(multiprocessor_count()) * std::max(resident, 1);
  // Packed sequences (cu_seqlens) are not split in time: each block runs a whole sequence.
  const int64_t segments = (p.cu_seqlens != nullptr || 2 * pairs * col_tiles > slots)
                               ? 1
                               : choose_segments(pairs * col_tiles, slots, p.L, kMinChunksPerSegment * C);
  const SegmentWorkspace workspace = SegmentWorkspace::make<P, acc_t>(p, segments, C, Da, Dc);

  launch_segmented<P>(kernel, p, workspace, pairs * col_tiles * p.segments, chunked::kThreads, smem, stream, Da, Dc,
                      col_tiles);
}

// The head-dim bucket: the state's Da rows (a and b's width), up to kMaxChunkedRows.
constexpr int64_t kMaxChunkedRows = 256;

template <Pass P, typename scalar_t>
void run_chunked(const KernelParams& p, int64_t Da, int64_t Dc, cudaStream_t stream) {
  if (Da <= 32) {
    launch_chunked<P, scalar_t, 32>(p, Da, Dc, stream);
  } else if (Da <= 64) {
    launch_chunked<P, scalar_t, 64>(p, Da, Dc, stream);
  } else if (Da <= 128) {
    launch_chunked<P, scalar_t, 128>(p, Da, Dc, stream);
  } else {
    launch_chunked<P, scalar_t, 256>(p, Da, Dc, stream);
  }
}

}  // namespace cuda
}  // namespace fast_causal_attn
