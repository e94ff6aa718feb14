// The recurrent (per-timestep) CUDA kernel family: one template serves the forward and the three
// gradient passes, in either direction in time, as the seed's lmha kernels do with GO_BACKWARD.
//
// Every pass is the causal product  out[t] = sum_{s<=t} (a[t] . b[s]) c[s]  (or s >= t in
// reverse), computed with a running state S = sum_s b[s] c[s]^T of Da x 32 per block:
//   - a block owns one (batch, head) and 32 columns of c (one per lane), and the full Da rows of the
//     state, split over GROUPS warps of ROWS rows each, all in registers;
//   - time advances in tiles of kSteps timesteps: a, b, c of the tile are staged in shared memory
//     (converted to the accumulation type, scaled and normalized as the pass asks), then each
//     thread walks the tile step by step: S[r] += b[t][r] c[t][lane], out[t] += a[t][r] S[r];
//   - the GROUPS partial sums of each output are added through shared memory and written once;
//   - the low-occupancy variant (few (batch, head) pairs) also splits time into segments, each
//     started from the summed states of the segments before it.
// The passes differ only in what a, b and c are (see Operands below).
#pragma once

#include "kernel_common.cuh"

namespace fast_causal_attn {
namespace cuda {

constexpr int kSteps = 32;  // timesteps per tile; the normalizer's prefix sum maps them to lanes
constexpr int kCols = 32;   // columns of c per lane group: one per lane

// The low-occupancy threshold: a launch with fewer threads than kThreadsPerSM per multiprocessor
// splits time into segments until it has that many. Measured on the H200 (fp32 ms, fwd /
// fwd+bwd, one segment -> split): 2,4,8192,64 (16 blocks): 2.76 / 11.1 -> 0.31 / 1.18;
// 4,16,8192,64 (128 blocks): 2.81 / 11.7 -> 1.59 / 6.6; 1,16,32768,128: 13.0 / 53.4 -> 6.1 / 28.0;
// but 8,16,2048,128 (512 blocks of 256 threads, two segments at 1024 threads per SM): 1.81 / 7.29
// -> 2.40 / 10.9, so the bar sits at 512.
constexpr int64_t kThreadsPerSM = 512;
constexpr int64_t kMinTilesPerSegment = 4;

// One tile of the recurrence for one thread: its ROWS rows of the state, one column of c. The
// restrict-qualified pointers tell the compiler that the partial sums it stores never alias the
// tiles it reads, so the loads of the next steps move ahead of the stores.
// c and partial point at this thread's first column; its NC columns are kCols apart, in rows of
// kCols * NC.
template <int ROWS, int NC, int kRows, bool REVERSE, typename acc_t>
__device__ __forceinline__ void recurrence_tile(const acc_t* __restrict__ a, const acc_t* __restrict__ b,
                                                const acc_t* __restrict__ c, const acc_t* __restrict__ extra,
                                                acc_t* __restrict__ partial, acc_t (&state)[NC][ROWS],
                                                acc_t (&extra_state)[NC], bool extra_row, bool add_extra) {
  constexpr int kBlockCols = kCols * NC;
#pragma unroll 4
  for (int j = 0; j < kSteps; ++j) {
    const int t = REVERSE ? kSteps - 1 - j : j;
    acc_t cv[NC];
#pragma unroll
    for (int n = 0; n < NC; ++n) cv[n] = c[t * kBlockCols + n * kCols];
    acc_t a_t[ROWS], b_t[ROWS];
    load_rows<ROWS>(a + t * kRows, a_t);
    load_rows<ROWS>(b + t * kRows, b_t);
#pragma unroll
    for (int n = 0; n < NC; ++n) {
      acc_t sum0 = acc_t(0), sum1 = acc_t(0);
#pragma unroll
      for (int r = 0; r < ROWS; r += 2) {
        state[n][r] += b_t[r] * cv[n];
        sum0 += a_t[r] * state[n][r];
        state[n][r + 1] += b_t[r + 1] * cv[n];
        sum1 += a_t[r + 1] * state[n][r + 1];
      }
      if (extra_row) {
        extra_state[n] += extra[kSteps + t] * cv[n];
        if (add_extra) sum0 += extra[t] * extra_state[n];
      }
      partial[t * kBlockCols + n * kCols] = sum0 + sum1;
    }
  }
}

// Output (t, m) of a tile: the GROUPS warps' partial sums, [GROUPS][STEPS][COLS] in shared memory.
template <int GROUPS, int STEPS, int COLS, typename acc_t>
__device__ __forceinline__ acc_t sum_partials(const acc_t* partial_s, int t, int m) {
  acc_t sum = acc_t(0);
#pragma unroll
  for (int g = 0; g < GROUPS; ++g) sum += partial_s[(g * STEPS + t) * COLS + m];
  return sum;
}

// Shared memory of one block, in accumulation-type elements: the a and b tiles, the partial sums
// of the outputs, the c tile, the extra row, the normalizer's partial sums and the normalizer.
template <int ROWS, int GROUPS, int NC>
struct SmemLayout {
  static constexpr int kRows = ROWS * GROUPS;
  static constexpr int kAB = 2 * kSteps * kRows;
  static constexpr int kPartials = GROUPS * kSteps * kCols * NC;
  static constexpr int kC = kSteps * kCols * NC;
  static constexpr int kExtra = 2 * kSteps;
  static constexpr int kDenPartials = GROUPS * kSteps;
  static constexpr int kDen = kSteps;
  static constexpr int kElements = kAB + kPartials + kC + kExtra + kDenPartials + kDen;
};

// Blocks per multiprocessor the register budget is set for: 128 registers a thread (64 spilled).
template <int GROUPS>
constexpr int kMinBlocks = 65536 / (GROUPS * kWarp * 128);

// grid.x = (((batch * heads) * column tiles + column tile) * slabs + slab) * segments + segment;
// block = GROUPS warps. A column tile is kCols * NC columns (NC per lane), slab i holds rows
// [i * ROWS * GROUPS, (i + 1) * ROWS * GROUPS) of the Da rows, segment j timesteps
// [j * segment_len, (j + 1) * segment_len).
template <Pass P, typename scalar_t, int ROWS, int GROUPS, int NC>
__global__ void __launch_bounds__(GROUPS * kWarp, kMinBlocks<GROUPS>)
    recurrent_product_kernel(const KernelParams p, int64_t Da, int64_t Dc, int64_t col_tiles) {
  using acc_t = at::opmath_type<scalar_t>;
  using Traits = PassTraits<P>;
  using Smem = SmemLayout<ROWS, GROUPS, NC>;
  constexpr int kRows = Smem::kRows;
  constexpr int kBlockCols = kCols * NC;
  constexpr int kThreads = GROUPS * kWarp;
  constexpr int kTileLoads = kSteps * kRows / kThreads;     // a and b elements each thread stages
  constexpr int kColLoads = kSteps * kBlockCols / kThreads;  // c elements each thread stages
  constexpr int kLoadBatch = 8;                           // loads in flight per thread while staging
  // A thread's share of a tile held in registers across the recurrence (see read_share): up to
  // 24 registers' worth (float32 rows up to 32, 64 and 128; more spilled: 32 at 48 rows, 500 bytes).
  constexpr bool kPrefetch = (2 * kTileLoads + kColLoads) * sizeof(acc_t) <= 24 * 4;
  static_assert(kSteps * kRows % kThreads == 0 && kSteps * kBlockCols % kThreads == 0,
                "tile loads must divide evenly");
  static_assert(ROWS % 4 == 0, "rows are read from shared memory 16 bytes at a time");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  acc_t* a_s = reinterpret_cast<acc_t*>(smem_raw);    // [kSteps][kRows]
  acc_t* b_s = a_s + kSteps * kRows;                  // [kSteps][kRows]
  acc_t* partial_s = a_s + Smem::kAB;                 // [GROUPS][kSteps][kBlockCols]
  acc_t* c_s = partial_s + Smem::kPartials;           // [kSteps][kBlockCols]
  acc_t* extra_s = c_s + Smem::kC;                    // [2][kSteps]: extra row's a, then b
  acc_t* den_partial_s = extra_s + Smem::kExtra;      // [GROUPS][kSteps]
  acc_t* den_s = den_partial_s + Smem::kDenPartials;  // [kSteps]

  const int tid = threadIdx.x, group = tid / kWarp, lane = tid % kWarp, row0 = group * ROWS;
  int64_t index = blockIdx.x;
  const int64_t segment = segment_of_block<P>(p, index);
  const int64_t slab = index % p.slabs;
  index /= p.slabs;
  const int64_t col_tile = index % col_tiles, pair = index / col_tiles;
  const int64_t b = pair / p.H, h = pair % p.H;
  const int64_t row_base = slab * kRows;
  const int64_t m0 = col_tile * kBlockCols;
  const int cols = int(Dc - m0 < kBlockCols ? Dc - m0 : kBlockCols);
  const int64_t L = p.L;
  const bool split_rows = p.slabs > 1;
  const bool state_only = p.state_only;

  const bool normalize = p.normalize;
  const bool extra_row = Traits::kMayHaveExtraRow && normalize && slab == 0;
  const bool denominator = Traits::kMayHaveDenominator && normalize;
  const acc_t* den_in =
      (normalize && P != Pass::Forward) ? static_cast<const acc_t*>(p.den) + pair * L : nullptr;
  const acc_t* dout_dot_out = extra_row ? static_cast<const acc_t*>(p.dout_dot_out) + pair * L : nullptr;
  const Operands<P, scalar_t, acc_t> ops(p, b, h, den_in, dout_dot_out);

  // This thread's rows of the state (in its NC columns: lane, lane + 32, ...), of the sum of b
  // (the normalizer's state) and, under an extra row, sum_s extra_b[s] c[s][column].
  acc_t state[NC][ROWS], key_sum[ROWS], extra_state[NC];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) key_sum[r] = acc_t(0);
#pragma unroll
  for (int n = 0; n < NC; ++n) {
    extra_state[n] = acc_t(0);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) state[n][r] = acc_t(0);
  }

  // Segment states: index of (segment j, global row, column) in the workspace.
  auto seg_index = [&](int64_t j, int64_t row, int n) {
    return ((pair * p.segments + j) * Da + row) * Dc + m0 + lane + n * kCols;
  };
  if (p.segments > 1 && !state_only) {  // start from the sum of the segments before this one (after, in reverse)
    const acc_t* seg_state = static_cast<const acc_t*>(p.seg_state);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int64_t row = row_base + row0 + r;
#pragma unroll
      for (int n = 0; n < NC; ++n) {
        if (row < Da && lane + n * kCols < cols) state[n][r] += seg_state[seg_index(segment, row, n)];
      }
      if (denominator && row < Da) key_sum[r] += static_cast<const acc_t*>(p.seg_key_sum)[(pair * p.segments + segment) * Da + row];
    }
#pragma unroll
    for (int n = 0; n < NC; ++n) {
      if (extra_row && lane + n * kCols < cols) {
        extra_state[n] += static_cast<const acc_t*>(p.seg_extra)[(pair * p.segments + segment) * Dc + m0 + lane + n * kCols];
      }
    }
  }

  const int64_t seg_begin = segment * p.segment_len;
  const int64_t seg_end = seg_begin + p.segment_len < L ? seg_begin + p.segment_len : L;
  const int64_t tiles = seg_end > seg_begin ? (seg_end - seg_begin + kSteps - 1) / kSteps : 0;
  auto tile_start = [&](int64_t it) { return seg_begin + (Traits::kReverse ? tiles - 1 - it : it) * kSteps; };
  auto tile_steps = [&](int64_t t0) { return int(seg_end - t0 < kSteps ? seg_end - t0 : kSteps); };

  // Staging a tile of n timesteps from t0: each thread reads its share of a, b and c (and of the
  // extra row) into registers, then stores it in shared memory. Element k of the share: a and b
  // at shared-memory index tid + k * kThreads of their tiles, c likewise. Rows past the segment or
  // Da and columns past Dc (and k past the share) are zero, so they add nothing.
  auto read_ab = [&](int64_t t0, int n, int k, acc_t& a, acc_t& b) {
    const int i = tid + k * kThreads, t = i / kRows, r = i % kRows;
    const bool valid = k < kTileLoads && t < n && row_base + r < Da;
    a = (valid && !state_only) ? ops.a_at(t0 + t, row_base + r) : acc_t(0);
    b = valid ? ops.b_at(t0 + t, row_base + r) : acc_t(0);
  };
  auto read_c = [&](int64_t t0, int n, int k) {
    const int i = tid + k * kThreads, t = i / kBlockCols, m = i % kBlockCols;
    return (k < kColLoads && t < n && m < cols) ? ops.c_at(t0 + t, m0 + m) : acc_t(0);
  };
  auto read_extra = [&](int64_t t0, int n, acc_t (&x)[2]) {  // threads tid < kSteps only
    x[0] = tid < n ? ops.extra_a(t0 + tid) : acc_t(0);
    x[1] = tid < n ? ops.extra_b(t0 + tid) : acc_t(0);
  };
  acc_t a_r[kTileLoads], b_r[kTileLoads], c_r[kColLoads], extra_r[2];
  auto read_share = [&](int64_t t0, int n) {
#pragma unroll
    for (int k = 0; k < kTileLoads; ++k) read_ab(t0, n, k, a_r[k], b_r[k]);
#pragma unroll
    for (int k = 0; k < kColLoads; ++k) c_r[k] = read_c(t0, n, k);
    if (extra_row && tid < kSteps) read_extra(t0, n, extra_r);
  };
  auto write_share = [&] {
#pragma unroll
    for (int k = 0; k < kTileLoads; ++k) a_s[tid + k * kThreads] = a_r[k], b_s[tid + k * kThreads] = b_r[k];
#pragma unroll
    for (int k = 0; k < kColLoads; ++k) c_s[tid + k * kThreads] = c_r[k];
    if (extra_row && tid < kSteps) extra_s[tid] = extra_r[0], extra_s[kSteps + tid] = extra_r[1];
  };
  // Without kPrefetch, in batches of kLoadBatch reads: read_share then write_share at once
  // spilled 1240 bytes a thread in the 256-row bucket (a share of 68 registers), 350 at 48 rows.
  auto stage_in_batches = [&](int64_t t0, int n) {
#pragma unroll 1
    for (int k0 = 0; k0 < kTileLoads; k0 += kLoadBatch) {
      acc_t a_b[kLoadBatch], b_b[kLoadBatch];
#pragma unroll
      for (int kk = 0; kk < kLoadBatch; ++kk) read_ab(t0, n, k0 + kk, a_b[kk], b_b[kk]);
#pragma unroll
      for (int kk = 0; kk < kLoadBatch; ++kk) {
        if (k0 + kk < kTileLoads) a_s[tid + (k0 + kk) * kThreads] = a_b[kk], b_s[tid + (k0 + kk) * kThreads] = b_b[kk];
      }
    }
#pragma unroll 1
    for (int k0 = 0; k0 < kColLoads; k0 += kLoadBatch) {
      acc_t c_b[kLoadBatch];
#pragma unroll
      for (int kk = 0; kk < kLoadBatch; ++kk) c_b[kk] = read_c(t0, n, k0 + kk);
#pragma unroll
      for (int kk = 0; kk < kLoadBatch; ++kk) {
        if (k0 + kk < kColLoads) c_s[tid + (k0 + kk) * kThreads] = c_b[kk];
      }
    }
    if (extra_row && tid < kSteps) {
      acc_t x[2];
      read_extra(t0, n, x);
      extra_s[tid] = x[0], extra_s[kSteps + tid] = x[1];
    }
  };

  // With kPrefetch the next tile's reads are issued before this tile's recurrence and stored
  // after it, so that their latency hides behind the work instead of stalling every tile (H200
  // fp32 ms, fwd / fwd+bwd, before -> after: 8,16,2048,128 1.259 / 4.404 -> 1.085 / 4.179;
  // 8,16,2048,64 recurrent forced: fwd+bwd 2.73 -> 2.71).
  if constexpr (kPrefetch) {
    if (tiles > 0) read_share(tile_start(0), tile_steps(tile_start(0))), write_share();
  }
  for (int64_t it = 0; it < tiles; ++it) {
    const int64_t t0 = tile_start(it);
    const int n = tile_steps(t0);
    const bool more = it + 1 < tiles;
    if constexpr (kPrefetch) {
      if (more) read_share(tile_start(it + 1), tile_steps(tile_start(it + 1)));
    } else {
      stage_in_batches(t0, n);
    }
    __syncthreads();

    // The normalizer q'[t] . sum_{s<=t} k[s]: lanes are timesteps here, a prefix sum over lanes
    // per row, then a dot product with a (forward only, so never reversed).
    if (denominator && !state_only) {
      acc_t den_partial = acc_t(0);
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        acc_t running = b_s[lane * kRows + row0 + r];
#pragma unroll
        for (int offset = 1; offset < kWarp; offset *= 2) {
          const acc_t up = __shfl_up_sync(0xffffffffu, running, offset);
          if (lane >= offset) running += up;
        }
        den_partial += a_s[lane * kRows + row0 + r] * (key_sum[r] + running);
        key_sum[r] += __shfl_sync(0xffffffffu, running, kWarp - 1);
      }
      den_partial_s[group * kSteps + lane] = den_partial;
    }

    if (state_only) {  // the segment's sum of b c^T (and of b, and of extra_b c) only
#pragma unroll 4
      for (int t = 0; t < kSteps; ++t) {
        acc_t b_t[ROWS];
        load_rows<ROWS>(b_s + t * kRows + row0, b_t);
#pragma unroll
        for (int n = 0; n < NC; ++n) {
          const acc_t cv = c_s[t * kBlockCols + n * kCols + lane];
#pragma unroll
          for (int r = 0; r < ROWS; ++r) state[n][r] += b_t[r] * cv;
          if (extra_row) extra_state[n] += extra_s[kSteps + t] * cv;
        }
        if (denominator) {
#pragma unroll
          for (int r = 0; r < ROWS; ++r) key_sum[r] += b_t[r];
        }
      }
      __syncthreads();  // the next tile overwrites shared memory
      if constexpr (kPrefetch) {
        if (more) write_share();
      }
      continue;
    }

    // The recurrence: this thread's rows of the state, its lane's column.
    recurrence_tile<ROWS, NC, kRows, Traits::kReverse>(a_s + row0, b_s + row0, c_s + lane, extra_s,
                                                      partial_s + group * kSteps * kBlockCols + lane, state,
                                                      extra_state, extra_row, extra_row && group == 0);
    __syncthreads();

    if (denominator && tid < kSteps) {
      acc_t d = split_rows ? acc_t(0) : acc_t(p.eps);
#pragma unroll
      for (int g = 0; g < GROUPS; ++g) d += den_partial_s[g * kSteps + tid];
      den_s[tid] = d;
      if (col_tile == 0 && tid < n) {
        if (split_rows) {
          atomicAdd(static_cast<acc_t*>(p.slab_den) + pair * L + t0 + tid, d);
        } else {
          static_cast<acc_t*>(p.den)[pair * L + t0 + tid] = d;
        }
      }
    }
    __syncthreads();

#pragma unroll
    for (int k = 0; k < kColLoads; ++k) {
      const int i = tid + k * kThreads, t = i / kBlockCols, m = i % kBlockCols;
      if (t < n && m < cols) {
        const acc_t sum = sum_partials<GROUPS, kSteps, kBlockCols>(partial_s, t, m);
        if (split_rows) {
          atomicAdd(static_cast<acc_t*>(p.slab_out) + (pair * L + t0 + t) * Dc + m0 + m, sum);
        } else {
          ops.store(t0 + t, m0 + m, sum, denominator ? den_s[t] : acc_t(1));
        }
      }
    }
    if constexpr (kPrefetch) {  // a, b and c were last read before the barrier after the recurrence
      if (more) write_share();
    }
    __syncthreads();  // the next tile overwrites shared memory (and, with kPrefetch, is in it)
  }

  if (state_only) {
    acc_t* seg_state = static_cast<acc_t*>(p.seg_state);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int64_t row = row_base + row0 + r;
#pragma unroll
      for (int n = 0; n < NC; ++n) {
        if (row < Da && lane + n * kCols < cols) seg_state[seg_index(segment, row, n)] = state[n][r];
      }
      if (denominator && row < Da && lane == 0 && col_tile == 0) {
        static_cast<acc_t*>(p.seg_key_sum)[(pair * p.segments + segment) * Da + row] = key_sum[r];
      }
    }
#pragma unroll
    for (int n = 0; n < NC; ++n) {
      if (extra_row && lane + n * kCols < cols && group == 0) {
        static_cast<acc_t*>(p.seg_extra)[(pair * p.segments + segment) * Dc + m0 + lane + n * kCols] = extra_state[n];
      }
    }
  }
}

// Writes the output from the slabs' sums: one thread per output element.
template <Pass P, typename scalar_t>
__global__ void finish_slabs_kernel(const KernelParams p, int64_t Dc) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= p.B * p.H * p.L * Dc) return;
  const int64_t m = i % Dc, row = i / Dc, s = row % p.L, pair = row / p.L;
  const bool normalize = p.normalize;
  const acc_t* den = (normalize && P != Pass::Forward) ? static_cast<const acc_t*>(p.den) + pair * p.L : nullptr;
  const Operands<P, scalar_t, acc_t> ops(p, pair / p.H, pair % p.H, den, nullptr);
  acc_t denominator = acc_t(1);
  if (P == Pass::Forward && normalize) {
    denominator = static_cast<const acc_t*>(p.slab_den)[row] + acc_t(p.eps);
    if (m == 0) static_cast<acc_t*>(p.den)[row] = denominator;
  }
  ops.store(s, m, static_cast<const acc_t*>(p.slab_out)[i], denominator);
}

template <Pass P, typename scalar_t, int ROWS, int GROUPS, int NC = 1>
void launch_recurrent(const KernelParams& params, int64_t Da, int64_t Dc, cudaStream_t stream) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int kThreads = GROUPS * kWarp;
  const auto options = at::TensorOptions().dtype(c10::CppTypeToScalarType<acc_t>::value).device(at::kCUDA);
  KernelParams p = params;
  const int64_t pairs = p.B * p.H;

  p.slabs = (Da + ROWS * GROUPS - 1) / (ROWS * GROUPS);
  at::Tensor slab_out, slab_den;
  if (p.slabs > 1) {
    slab_out = at::zeros({pairs * p.L * Dc}, options);
    slab_den = at::zeros({p.normalize ? pairs * p.L : 0}, options);
    p.slab_out = slab_out.data_ptr();
    p.slab_den = slab_den.data_ptr();
  }

  const int64_t col_tiles = (Dc + kCols * NC - 1) / (kCols * NC);
  const int64_t segments = choose_segments(pairs * col_tiles * p.slabs, multiprocessor_count() * kThreadsPerSM / kThreads,
                                           p.L, kMinTilesPerSegment * kSteps);
  const SegmentWorkspace workspace = SegmentWorkspace::make<P, acc_t>(p, segments, kSteps, Da, Dc);

  const size_t smem = SmemLayout<ROWS, GROUPS, NC>::kElements * sizeof(acc_t);
  launch_segmented<P>(recurrent_product_kernel<P, scalar_t, ROWS, GROUPS, NC>, p, workspace,
                      pairs * col_tiles * p.slabs * p.segments, kThreads, smem, stream, Da, Dc, col_tiles);

  if (p.slabs > 1) {
    constexpr int kFinishThreads = 256;
    const int64_t elements = pairs * p.L * Dc;
    const int64_t finish_blocks = (elements + kFinishThreads - 1) / kFinishThreads;
    TORCH_CHECK(finish_blocks <= int64_t(0x7fffffff), "fast_causal_attn: output too large: ", elements);
    finish_slabs_kernel<P, scalar_t><<<unsigned(finish_blocks), kFinishThreads, 0, stream>>>(p, Dc);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// The head-dim bucket: the state's Da rows over GROUPS warps of ROWS rows.
template <Pass P, typename scalar_t>
void run_recurrent(const KernelParams& p, int64_t Da, int64_t Dc, cudaStream_t stream) {
  // Two columns a lane (when Dc > 32) feed each shared-memory read of a and b to twice the FMAs:
  // H200 fp32 fwd / fwd+bwd ms, one -> two columns: 8,16,2048,128: 1.49 / 6.91 -> 1.09 / 4.82;
  // 1,16,32768,128: 6.36 / 29.0 -> 5.28 / 23.7; 4,16,8192,64: 1.58 / 7.25 -> 1.40 / 6.35. Not with
  // double accumulation: its partial sums would pass the 227 KB of shared memory a block can have.
  constexpr int kColsPerLane = sizeof(at::opmath_type<scalar_t>) == 4 ? 2 : 1;
  // 8 rows a thread beat 16 at every benchmark shape with E = 64 and 128 (H200, fp32, fwd+bwd ms,
  // 16 -> 8 rows: 8,16,2048,64: 3.54 -> 2.86; 4,16,8192,64: 7.88 -> 7.25; 8,16,2048,128: 7.13 ->
  // 6.91; 2,4,8192,64: 0.82 -> 0.76; 1,16,32768,128: 32.5 -> 29.0): ncu showed the 16-row kernel
  // stalled on shared-memory loads half the time at 25% occupancy; more, shorter rows hide it.
  if (Da <= 32) {
    launch_recurrent<P, scalar_t, 8, 4>(p, Da, Dc, stream);
  } else if (Da <= 48) {
    launch_recurrent<P, scalar_t, 12, 4>(p, Da, Dc, stream);
  } else if (Da <= 64) {
    if (Dc > kCols) launch_recurrent<P, scalar_t, 8, 8, kColsPerLane>(p, Da, Dc, stream);
    else launch_recurrent<P, scalar_t, 8, 8>(p, Da, Dc, stream);
  } else if (Da <= 128) {
    if (Dc > kCols) launch_recurrent<P, scalar_t, 8, 16, kColsPerLane>(p, Da, Dc, stream);
    else launch_recurrent<P, scalar_t, 8, 16>(p, Da, Dc, stream);
  } else {  // 256 rows a block; above that, slabs of 256
    if constexpr (kColsPerLane == 2) {
      // As at Da = 128: two columns a lane, 16 warps of 16 rows (207 KB of shared memory, one
      // block a multiprocessor) read a and b half as often a product as <32 rows, 8 warps, one
      // column> (101 KB, two blocks). H200 fp32 fwd / fwd+bwd ms, one -> two columns:
      // 4,16,2048,256: 2.04 / 9.02 -> 1.79 / 7.46; 2,4,8192,256: 2.08 / 9.05 -> 1.80 / 7.71.
      if (Dc > kCols) return launch_recurrent<P, scalar_t, 16, 16, kColsPerLane>(p, Da, Dc, stream);
    }
    launch_recurrent<P, scalar_t, 32, 8>(p, Da, Dc, stream);
  }
}

// The gradients of k and v in one reverse pass (float32, E and M up to 128, no states in or out,
// no packed sequences): both are products of one state S = sum_{s>=t} q'[s] dO[s]^T (E x M,
// q' = q scale / den), the GradV pass's state and the transpose of GradK's:
//   dv[t][m] = sum_e k[t][e] S[e][m],   dk[t][e] = sum_m v[t][m] S[e][m]  (+ the normalizer's row).
// A block owns one (batch, head) and the whole state, so that q, k, v and dO are read once and
// each step's q' dO^T is added once (the two passes each did both, in two blocks of 64 columns at
// E = M = 128): warp g holds rows [8g, 8g + 8), lane l columns l + 32n (n < NC). dv's sums over
// rows cross warps (partial sums in shared memory, as in the recurrent kernel); dk's sums over
// columns stay within a warp (shuffles), so each warp writes its own rows of dk.
constexpr int kFusedSteps = 16;  // timesteps a tile: 16 warps' dv partial sums of 128 columns fill 128 KB

// Sums x[r] (r < 8) over the warp: lane l returns the total of row (l >> 2) & 7 (each total held
// by four lanes). A reduce-scatter: 4 + 2 + 1 exchanges halve the rows a lane holds, then 2 more
// finish the sum; 9 shuffles instead of 8 x 5.
__device__ __forceinline__ float warp_sum_rows8(const float (&x)[8], int lane) {
  const bool hi16 = lane & 16, hi8 = lane & 8, hi4 = lane & 4;
  float y[4], z[2];
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // rows 4 (hi16) + i
    y[i] = (hi16 ? x[i + 4] : x[i]) + __shfl_xor_sync(0xffffffffu, hi16 ? x[i] : x[i + 4], 16);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {  // rows 4 (hi16) + 2 (hi8) + i
    z[i] = (hi8 ? y[i + 2] : y[i]) + __shfl_xor_sync(0xffffffffu, hi8 ? y[i] : y[i + 2], 8);
  }
  float w = (hi4 ? z[1] : z[0]) + __shfl_xor_sync(0xffffffffu, hi4 ? z[0] : z[1], 4);
  w += __shfl_xor_sync(0xffffffffu, w, 2);
  return w + __shfl_xor_sync(0xffffffffu, w, 1);
}

template <int GROUPS, int NC>
struct FusedSmemLayout {
  static constexpr int kRows = 8 * GROUPS, kBlockCols = kCols * NC;
  static constexpr int kRowTiles = 2 * kFusedSteps * kRows;        // k, q'
  static constexpr int kColTiles = 2 * kFusedSteps * kBlockCols;   // dO, v
  static constexpr int kPartials = GROUPS * kFusedSteps * kBlockCols;
  static constexpr int kGradK = kFusedSteps * kRows;
  static constexpr int kElements = kRowTiles + kColTiles + kPartials + kGradK + kFusedSteps;  // + the extra row's b
};

// grid.x = batch * heads; block = GROUPS warps.
template <typename scalar_t, int GROUPS, int NC>
__global__ void __launch_bounds__(GROUPS * kWarp, 16 / GROUPS) recurrent_grad_kv_kernel(const KernelParams p) {
  using acc_t = float;
  using Smem = FusedSmemLayout<GROUPS, NC>;
  constexpr int ROWS = 8, kRows = Smem::kRows, kBlockCols = Smem::kBlockCols, kThreads = GROUPS * kWarp;
  constexpr int kRowLoads = kFusedSteps * kRows / kThreads, kColLoads = kFusedSteps * kBlockCols / kThreads;
  static_assert(kFusedSteps * kRows % kThreads == 0 && kFusedSteps * kBlockCols % kThreads == 0, "even split");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  acc_t* k_s = reinterpret_cast<acc_t*>(smem_raw);        // [kFusedSteps][kRows]
  acc_t* q_s = k_s + kFusedSteps * kRows;                 // [kFusedSteps][kRows], q'
  acc_t* dout_s = k_s + Smem::kRowTiles;                  // [kFusedSteps][kBlockCols]
  acc_t* v_s = dout_s + kFusedSteps * kBlockCols;         // [kFusedSteps][kBlockCols]
  acc_t* partial_s = dout_s + Smem::kColTiles;            // [GROUPS][kFusedSteps][kBlockCols]
  acc_t* dk_s = partial_s + Smem::kPartials;              // [kFusedSteps][kRows]
  acc_t* extra_b_s = dk_s + Smem::kGradK;                 // [kFusedSteps]

  const int tid = threadIdx.x, group = tid / kWarp, lane = tid % kWarp, row0 = group * ROWS;
  const int64_t pair = blockIdx.x, b = pair / p.H, h = pair % p.H, L = p.L, E = p.E, M = p.M;
  const bool normalize = p.normalize;
  const acc_t* den = normalize ? static_cast<const acc_t*>(p.den) + pair * L : nullptr;
  const acc_t* dout_dot_out = normalize ? static_cast<const acc_t*>(p.dout_dot_out) + pair * L : nullptr;
  const Operands<Pass::GradK, scalar_t, acc_t> ops_k(p, b, h, den, dout_dot_out);  // v, the extra row, dk
  const Operands<Pass::GradV, scalar_t, acc_t> ops_v(p, b, h, den, nullptr);        // k, q', dO, dv

  acc_t state[NC][ROWS], extra[ROWS];  // extra: sum_{s>=t} extra_b[s] q'[s] (normalize), lane 0's adds it
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    extra[r] = acc_t(0);
#pragma unroll
    for (int n = 0; n < NC; ++n) state[n][r] = acc_t(0);
  }

  // Each thread's share of a tile, read into registers while the tile before it is worked on and
  // stored after (as read_share in the recurrent kernel). Past L, E or M: zeros. A thread reads
  // one row element (column) of every kRowStep-th (kColStep-th) timestep, stepping pointers down
  // the rows: addresses computed once per share held 48 registers.
  constexpr int kRowStep = kThreads / kRows, kColStep = kThreads / kBlockCols;
  static_assert(kThreads % kRows == 0 && kThreads % kBlockCols == 0, "whole rows per pass over the threads");
  const int row_t = tid / kRows, row_e = tid % kRows, col_t = tid / kBlockCols, col_m = tid % kBlockCols;
  const auto k_rows = ops_v.a_rows(), q_rows = ops_v.b_rows(), dout_rows = ops_v.c_rows();
  const auto v_rows = ops_k.a_rows();
  const int64_t tiles = (L + kFusedSteps - 1) / kFusedSteps;
  acc_t k_r[kRowLoads], q_r[kRowLoads], dout_r[kColLoads], v_r[kColLoads], extra_b_r = acc_t(0);
  auto read_share = [&](int64_t it) {
    const int64_t t0 = (tiles - 1 - it) * kFusedSteps;
    const scalar_t* k_at = k_rows.ptr + (t0 + row_t) * k_rows.stride + row_e;
    const scalar_t* q_at = q_rows.ptr + (t0 + row_t) * q_rows.stride + row_e;
#pragma unroll
    for (int j = 0; j < kRowLoads; ++j) {
      const int64_t t = t0 + row_t + j * kRowStep;
      const bool valid = t < L && row_e < E;
      k_r[j] = valid ? acc_t(*k_at) : acc_t(0);  // GradV's a and b: k, q scale / den
      q_r[j] = valid ? acc_t(*q_at) * ops_v.b_factor(t) : acc_t(0);
      k_at += kRowStep * k_rows.stride, q_at += kRowStep * q_rows.stride;
    }
    const scalar_t* dout_at = dout_rows.ptr + (t0 + col_t) * dout_rows.stride + col_m;
    const scalar_t* v_at = v_rows.ptr + (t0 + col_t) * v_rows.stride + col_m;
#pragma unroll
    for (int j = 0; j < kColLoads; ++j) {
      const bool valid = t0 + col_t + j * kColStep < L && col_m < M;
      dout_r[j] = valid ? acc_t(*dout_at) : acc_t(0);  // GradV's c and GradK's a: dO, v
      v_r[j] = valid ? acc_t(*v_at) : acc_t(0);
      dout_at += kColStep * dout_rows.stride, v_at += kColStep * v_rows.stride;
    }
    if (normalize && tid < kFusedSteps) extra_b_r = t0 + tid < L ? ops_k.extra_b(t0 + tid) : acc_t(0);
  };
  auto write_share = [&] {
#pragma unroll
    for (int j = 0; j < kRowLoads; ++j) k_s[tid + j * kThreads] = k_r[j], q_s[tid + j * kThreads] = q_r[j];
#pragma unroll
    for (int j = 0; j < kColLoads; ++j) dout_s[tid + j * kThreads] = dout_r[j], v_s[tid + j * kThreads] = v_r[j];
    if (normalize && tid < kFusedSteps) extra_b_s[tid] = extra_b_r;
  };

  if (tiles > 0) read_share(0), write_share();
  __syncthreads();
  for (int64_t it = 0; it < tiles; ++it) {
    const int64_t t0 = (tiles - 1 - it) * kFusedSteps;
    const int n = int(L - t0 < kFusedSteps ? L - t0 : kFusedSteps);
    const bool more = it + 1 < tiles;
    if (more) read_share(it + 1);

#pragma unroll 2
    for (int j = 0; j < kFusedSteps; ++j) {
      const int t = kFusedSteps - 1 - j;  // reverse in time
      acc_t k_t[ROWS], q_t[ROWS], dout_t[NC], v_t[NC];
      load_rows<ROWS>(k_s + t * kRows + row0, k_t);
      load_rows<ROWS>(q_s + t * kRows + row0, q_t);
#pragma unroll
      for (int c = 0; c < NC; ++c) dout_t[c] = dout_s[t * kBlockCols + c * kCols + lane], v_t[c] = v_s[t * kBlockCols + c * kCols + lane];
      acc_t dk_part[ROWS];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) dk_part[r] = acc_t(0);
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        acc_t dv_part = acc_t(0);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          state[c][r] += q_t[r] * dout_t[c];
          dv_part += k_t[r] * state[c][r];
          dk_part[r] += v_t[c] * state[c][r];
        }
        partial_s[(group * kFusedSteps + t) * kBlockCols + c * kCols + lane] = dv_part;
      }
      if (normalize) {
        const acc_t xb = extra_b_s[t];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          extra[r] += xb * q_t[r];
          if (lane == 0) dk_part[r] += extra[r];
        }
      }
      const acc_t dk = warp_sum_rows8(dk_part, lane);
      if ((lane & 3) == 0) dk_s[t * kRows + row0 + ((lane >> 2) & 7)] = dk;
    }
    __syncthreads();

    // dv: the warps' partial sums added; dk as the warps left it. Both written row by row.
#pragma unroll
    for (int j = 0; j < kColLoads; ++j) {
      const int i = tid + j * kThreads, t = i / kBlockCols, m = i % kBlockCols;
      if (t < n && m < M) ops_v.store(t0 + t, m, sum_partials<GROUPS, kFusedSteps, kBlockCols>(partial_s, t, m), acc_t(1));
    }
#pragma unroll
    for (int j = 0; j < kRowLoads; ++j) {
      const int i = tid + j * kThreads, t = i / kRows, e = i % kRows;
      if (t < n && e < E) ops_k.store(t0 + t, e, dk_s[t * kRows + e], acc_t(1));
    }
    if (more) write_share();  // k, q', dO and v were last read before the barrier above
    __syncthreads();
  }
}

template <typename scalar_t, int GROUPS, int NC>
void launch_recurrent_grad_kv(const KernelParams& p, cudaStream_t stream) {
  auto kernel = recurrent_grad_kv_kernel<scalar_t, GROUPS, NC>;
  constexpr size_t smem = FusedSmemLayout<GROUPS, NC>::kElements * sizeof(float);
  static_assert(smem <= 227 * 1024, "fits a multiprocessor");
  const int64_t pairs = p.B * p.H;
  TORCH_CHECK(pairs <= int64_t(0x7fffffff), "fast_causal_attn: too many (batch, head) pairs: ", pairs);
  allow_dynamic_smem(kernel, smem);
  kernel<<<dim3(unsigned(pairs)), dim3(GROUPS * kWarp), smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// One bucket: E and M up to 128 (16 warps, 4 columns a lane). Smaller ones run it too when
// forced (FAST_CAUSAL_ATTN_FUSED_GRAD_KV=1), with idle rows and columns; by default they take
// the two passes (see run_grad_kv). An 8-warp bucket for E <= 64 spilled at its two blocks a
// multiprocessor.
template <typename scalar_t>
void run_recurrent_grad_kv(const KernelParams& p, cudaStream_t stream) {
  launch_recurrent_grad_kv<scalar_t, 16, 4>(p, stream);
}
constexpr int64_t kMaxFusedRecurrentDim = 128;  // E and M

}  // namespace cuda
}  // namespace fast_causal_attn
