// A prototype of the chunked forward on wgmma (sm_90a), to measure before any port (issue 5:
// "wgmma on sm_90a if it pays"): bf16, E = M = 64, contiguous [B, H, L, 64], scale 1, no
// normalize, no states; one block (one warpgroup) a (batch, head) walking all of L, as
// flash-linear-attention's fused_chunk does, or a (batch, head, time segment) as this library's
// segmented launches do (each segment's K^T V first, scanned, then the outputs from each
// segment's start). Per chunk of 64 timesteps:
//
//   scores = Q K^T (shared x shared), O = Q S (shared x shared, S's bf16 copy),
//   S += K^T V (shared x shared, float32 in registers), O += mask(scores) V (registers x shared)
//
// 16 wgmma instructions a chunk where the mma.sync kernel issues about 480 HMMA and their
// ldmatrix loads. Q, K and V are staged (cp.async, kStages chunks deep) once, into one layout
// that serves every role: element (r, c) of a 64 x 64 tile at (r / 8) 1024 + (c / 8) 128 +
// (r % 8) 16 + (c % 8) 2 bytes, no swizzle: 8 x 16-byte core matrices, 128 bytes apart along c and
// 1024 along r. Along c is K for Q and K as score operands, along r is K for K and V in K^T V and
// for V in P V (MN-major operands). The descriptor encoding (which offset is "leading") follows
// the PTX ISA, or the other way round (kSwapOffsets); benchmarks/wgmma_probe.py checks both.
// A two-warpgroup variant (chunks of 128, eight warps a multiprocessor) measured no faster on the
// H200 and was removed (benchmarks/RESULTS.md, ninth session; its code: git history).
// kTwoParts: the state's copy as two bf16 parts (S = hi + lo, Q S as two products), as the library
// multiplies it for bfloat16 (one part: 2.35e-3 relative error against float64, over issue 5's
// 2.3e-3; two: 1.7e-3); kStages 3 or 4 chunks staged (2 or 3 on their way; 2 stages were always
// slower and were dropped). kTma: the chunks staged by the Tensor Memory Accelerator
// (cp.async.bulk.tensor, one thread issuing a tile, an mbarrier a stage counting its bytes) instead
// of every thread's 16-byte cp.async copies, whose address registers stalled the prototype
// (benchmarks/RESULTS.md, fifteenth session). The TMA writes its box dimension 0 fastest, so its
// tiles are column-blocked: element (r, c) at (c / 8) 1024 + (r / 8) 128 + (r % 8) 16 + (c % 8) 2,
// the same core matrices arranged the other way round (the descriptors' offsets swap with them).
// kTma also writes the outputs by TMA (stmatrix into a column-blocked tile, one bulk store a
// chunk, two tiles in turn) and the state copy by stmatrix, where the cp.async variant stores
// 32-bit words and each lane writes 16-byte pieces of rows to global memory.
// benchmarks/wgmma_forward.py builds this, checks it against float64 and times it.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "wgmma.cuh"

namespace {

constexpr int C = 64;           // timesteps a chunk
constexpr int D = 64;           // E = M
constexpr int kTile = C * D * 2;  // bytes of a 64 x 64 bf16 tile
// The descriptor's offsets in the PTX ISA's order (leading: along K), or swapped when built with
// -DWGMMA_SWAP_OFFSETS=1 (benchmarks/wgmma_forward.py builds both and keeps what checks out).
#ifndef WGMMA_SWAP_OFFSETS
#define WGMMA_SWAP_OFFSETS 0
#endif
constexpr bool kSwapOffsets = WGMMA_SWAP_OFFSETS != 0;

// A wgmma operand, no swizzle: core matrices k_bytes apart along K, mn_bytes along M/N.
__device__ __forceinline__ uint64_t operand(uint32_t address, uint32_t k_bytes, uint32_t mn_bytes) {
  return kSwapOffsets ? wgmma::descriptor(address, mn_bytes, k_bytes) : wgmma::descriptor(address, k_bytes, mn_bytes);
}
// Operand views of a staged tile (rows r, columns c, see above), for k16 step s: row-blocked
// (the cp.async staging's and the state copy's) or, kColumnBlocked, the TMA's.
template <bool kColumnBlocked = false>
__device__ __forceinline__ uint64_t k_along_columns(uint32_t tile, int s) {
  return kColumnBlocked ? operand(tile + 2048 * s, 1024, 128) : operand(tile + 256 * s, 128, 1024);
}
template <bool kColumnBlocked = false>
__device__ __forceinline__ uint64_t k_along_rows(uint32_t tile, int s) {
  return kColumnBlocked ? operand(tile + 256 * s, 128, 1024) : operand(tile + 2048 * s, 1024, 128);
}

// A column-blocked tile to rows [row, row + 64) of a pair (kTma's outputs; rows at or past L are
// not written), as a bulk group of this thread's; `pieces` as in tma_tile.
__device__ __forceinline__ void tma_store(uint32_t tile, const CUtensorMap* map, int row, int pair, int pieces) {
  if (pieces == 1) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %1, %3}], [%4];\n" ::"l"(
                     reinterpret_cast<uint64_t>(map)),
                 "r"(0), "r"(row), "r"(pair), "r"(tile)
                 : "memory");
  } else {
    for (int group = 0; group < 8; ++group) {
      asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];\n" ::"l"(
                       reinterpret_cast<uint64_t>(map)),
                   "r"(8 * group), "r"(row), "r"(pair), "r"(tile + 1024 * group)
                   : "memory");
    }
  }
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Until this thread's bulk stores but the kPending latest have read their shared memory.
template <int kPending>
__device__ __forceinline__ void tma_store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}

// The TMA's side: an mbarrier a stage (one arrival, thread 0's, which also expects the stage's
// bytes), and a tile of rows [row, row + 64) of one (batch, head) pair. The tensor map views a
// [B, H, L, 64] array as 4-d {8 elements, L rows, 8 column groups, B H pairs} (strides 128 B, 16 B,
// L 128 B), box {8, 64, 8, 1}: column-blocked tiles, and zeros for rows at or past L.
__device__ __forceinline__ void barrier_init(uint32_t bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void barrier_expect(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void barrier_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n@!done bra WAIT;\n}\n" ::"r"(
          bar),
      "r"(parity)
      : "memory");
}
// Where the driver refuses that view (its 16-byte stride for the column groups is smaller than the
// rows'), a 3-d one, {64 elements, L rows, B H pairs} with box {8, 64, 1}: a tile in 8 loads, one
// column group (1024 bytes) each. `pieces`: 1 (4-d) or 8 (3-d).
__device__ __forceinline__ void tma_tile(uint32_t tile, const CUtensorMap* map, uint32_t bar, int row, int pair,
                                         int pieces) {
  if (pieces == 1) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %2, %4}], "
        "[%5];\n" ::"r"(tile),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(0), "r"(row), "r"(pair), "r"(bar)
        : "memory");
  } else {
    for (int group = 0; group < 8; ++group) {
      asm volatile(
          "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
          "[%5];\n" ::"r"(tile + 1024 * group),
          "l"(reinterpret_cast<uint64_t>(map)), "r"(8 * group), "r"(row), "r"(pair), "r"(bar)
          : "memory");
    }
  }
}

__device__ __forceinline__ void copy_16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

__device__ __forceinline__ void copy_16_whole(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}

// Rows [t0, t0 + 64) of a [L, 64] bf16 array into a staged tile, zeros past the segment's end: the
// tile's 16-byte piece p is row 8 (p / 64) + p % 8, columns 8 ((p % 64) / 8) .., at byte 16 p, so
// that a warp writes 512 consecutive bytes. Thread t of the 128 copies pieces t + 128 i (i < 4):
// rows row0 + 16 i of one column group, at bytes 16 t + 2048 i; its offsets are taken once, and a
// whole chunk is copied without row tests. (Computed per piece and chunk with 64-bit products and
// row tests, the copies' address arithmetic was the prototype's most-executed instructions and
// their register moves its most-stalled: H200 ncu, 8,16,2048.)
struct Stager {
  int row0, col;
  uint32_t offset;
  __device__ explicit Stager(int thread)
      : row0(8 * (thread / 64) + thread % 8), col(8 * ((thread % 64) / 8)), offset(16 * thread) {}
  __device__ __forceinline__ void operator()(uint32_t tile, const __nv_bfloat16* x, int64_t t0, int64_t end) const {
    const __nv_bfloat16* src = x + (t0 + row0) * D + col;
    if (t0 + C <= end) {
#pragma unroll
      for (int i = 0; i < 4; ++i) copy_16_whole(tile + offset + 2048 * i, src + 16 * i * D);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const bool inside = t0 + row0 + 16 * i < end;
        copy_16(tile + offset + 2048 * i, inside ? src + 16 * i * D : x, inside);
      }
    }
  }
};

// A warpgroup's 64 x 64 accumulator, as wgmma lays it out: warp w rows 16 w + g (+8), n-tile j
// columns 8 j + 2 q4 (+1) in d[4 j ..] (g = lane / 4, q4 = lane % 4). The state from a float32
// [64][64] slot, to it, and to the state's bf16 copy in the staged tile layout (element (e, m) at
// (e / 8) 1024 + (m / 8) 128 + (e % 8) 16 + (m % 8) 2 bytes).
__device__ __forceinline__ void load_state(float (&d)[32], const float* slot) {
  const int warp = (threadIdx.x % 128) / 32, g = (threadIdx.x % 32) / 4, q4 = threadIdx.x % 4;
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      d[4 * j + e] = slot != nullptr ? slot[(16 * warp + g + 8 * (e / 2)) * D + 8 * j + 2 * q4 + e % 2] : 0.f;
    }
}
__device__ __forceinline__ void store_state(const float (&d)[32], float* slot) {
  const int warp = (threadIdx.x % 128) / 32, g = (threadIdx.x % 32) / 4, q4 = threadIdx.x % 4;
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) slot[(16 * warp + g + 8 * (e / 2)) * D + 8 * j + 2 * q4 + e % 2] = d[4 * j + e];
}

// kTma's epilogue: stmatrix stores four 8 x 8 bf16 blocks from the accumulator layout (lane l's
// registers hold row l / 4, columns 2 (l % 4) .. + 1 of each block; lane l gives the address of
// row l % 8 of block l / 8). packed[2 j + h]: this thread's pair of block (rows 16 warp + 8 h ..,
// columns 8 j ..). Both tile layouts keep an 8 x 8 block in 128 contiguous bytes, rows 16 apart:
// row-blocked (the state copy: block (r / 8, c / 8) at (r / 8) 1024 + (c / 8) 128) or column-blocked
// (the TMA's: at (c / 8) 1024 + (r / 8) 128). 4 stmatrix where 16 st.shared.b32 went.
template <bool kColumnBlocked>
__device__ __forceinline__ void store_blocks(const uint32_t (&packed)[16], uint32_t tile) {
  const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32, block = lane / 8;
  const int row = 16 * warp + (block % 2) * 8 + lane % 8;
#pragma unroll
  for (int j = 0; j < 8; j += 2) {
    const int column_block = j + block / 2;
    const uint32_t at = tile + (kColumnBlocked ? column_block * 1024 + (row / 8) * 128 : (row / 8) * 1024 + column_block * 128) +
                        (row % 8) * 16;
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(at), "r"(packed[2 * j]),
                 "r"(packed[2 * j + 1]), "r"(packed[2 * j + 2]), "r"(packed[2 * j + 3])
                 : "memory");
  }
}
// The accumulator rounded to bf16 pairs for store_blocks; with `remainder`, also the remainder
// pairs bf16(d - bf16(d)) (the state copy's second part).
__device__ __forceinline__ void pack_blocks(const float (&d)[32], uint32_t (&head)[16], uint32_t (&remainder)[16],
                                            bool with_remainder) {
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float x = d[4 * j + 2 * h], y = d[4 * j + 2 * h + 1];
      const uint32_t hi = wgmma::pack(x, y);
      head[2 * j + h] = hi;
      if (with_remainder) {
        remainder[2 * j + h] = wgmma::pack(x - __uint_as_float(hi << 16), y - __uint_as_float(hi & 0xffff0000u));
      }
    }
}

// The cp.async variant's state copy: kTwoParts: the head hi = bf16(S) at state_copy, the
// remainder bf16(S - hi) one tile after (pack_blocks' pairs), a 32-bit word at a time.
template <bool kTwoParts>
__device__ __forceinline__ void publish_state(const float (&d)[32], uint32_t state_copy) {
  const int warp = (threadIdx.x % 128) / 32, g = (threadIdx.x % 32) / 4, q4 = threadIdx.x % 4;
  uint32_t head[16], remainder[16];
  pack_blocks(d, head, remainder, kTwoParts);
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int e = 16 * warp + g + 8 * h, m = 8 * j + 2 * q4;
      const uint32_t at = state_copy + (e / 8) * 1024 + (m / 8) * 128 + (e % 8) * 16 + (m % 8) * 2;
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at), "r"(head[2 * j + h]) : "memory");
      if constexpr (kTwoParts) {
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at + kTile), "r"(remainder[2 * j + h]) : "memory");
      }
    }
}

// A 64 x 64 block of scores as the bf16 A fragments of P V (each warp its 16 rows in mma.sync's
// m16n8k16 A layout), zero above the diagonal (the causal mask: row t, column s, s <= t kept).
// reverse: zero below the diagonal instead (s >= t kept: the backward's dk and dv passes).
__device__ __forceinline__ void pack_scores(float (&score)[32], uint32_t (&p)[4][4], bool reverse) {
  const int warp = (threadIdx.x % 128) / 32, g = (threadIdx.x % 32) / 4, q4 = threadIdx.x % 4;
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int column = 8 * j + 2 * q4 + e % 2, row = 16 * warp + g + 8 * (e / 2);
      if (reverse ? column < row : column > row) score[4 * j + e] = 0.f;
    }
#pragma unroll
  for (int s = 0; s < 4; ++s)
#pragma unroll
    for (int r = 0; r < 4; ++r) p[s][r] = wgmma::pack(score[8 * s + 2 * r], score[8 * s + 2 * r + 1]);
}

// A warpgroup's 64 x 64 accumulator (warp w rows 16 w + g (+8), as the state) to out's rows
// t0 .., through this warp's 16 staging rows ([64][D + 8] bf16 a warpgroup), 16 bytes a lane;
// rows at or past `end` are not written.
__device__ __forceinline__ void write_rows(const float (&o)[32], __nv_bfloat16* staging, __nv_bfloat16* out,
                                           int64_t t0, int64_t end) {
  constexpr int kStride = D + 8;
  const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32, g = lane / 4, q4 = lane % 4;
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = 16 * warp + g + 8 * h, col = 8 * j + 2 * q4;
      *reinterpret_cast<uint32_t*>(staging + row * kStride + col) = wgmma::pack(o[4 * j + 2 * h], o[4 * j + 2 * h + 1]);
    }
  __syncwarp();
#pragma unroll
  for (int i = lane; i < 16 * D / 8; i += 32) {
    const int row = 16 * warp + i / 8, col = 8 * (i % 8);
    if (t0 + row < end) {
      const uint4 piece = *reinterpret_cast<const uint4*>(staging + row * kStride + col);
      *reinterpret_cast<uint4*>(out + (t0 + row) * D + col) = piece;
    }
  }
}

// One block a (batch, head, time segment): timesteps [segment segment_len, + segment_len) of L.
// reverse: the chunks from the segment's last to its first, each output the sum over s >= t
// (the shape of the backward's dk and dv passes: q, k, v stand for their a, b and c; the forward
// one stands for the dq pass's).
// kStateOnly: the segment's own K^T V only, written to states[block] (float32 [64][64], rows e);
// otherwise the outputs, starting from states[block] (the segments before, scanned) when given.
template <int kStages, bool kStateOnly, bool kTwoParts, bool kTma>
__global__ void __launch_bounds__(128) wgmma_forward_kernel(const __nv_bfloat16* q, const __nv_bfloat16* k,
                                                            const __nv_bfloat16* v, __nv_bfloat16* out, int64_t L,
                                                            int64_t segments, int64_t segment_len, float* states,
                                                            const __grid_constant__ CUtensorMap q_map,
                                                            const __grid_constant__ CUtensorMap k_map,
                                                            const __grid_constant__ CUtensorMap v_map,
                                                            const __grid_constant__ CUtensorMap o_map,
                                                            int tma_pieces, bool reverse) {
  extern __shared__ __align__(1024) unsigned char smem[];
  // [kStages][Q, K, V tiles], then the state's bf16 copy (a tile, rows e, columns m; two with
  // kTwoParts: head, remainder), then the outputs: cp.async's staging rows ([64][72] bf16), or
  // kTma's two column-blocked tiles (chunk it's in it % 2, stored by the TMA while the next chunk
  // is worked on) and an mbarrier a stage.
  constexpr int kParts = kTwoParts ? 2 : 1;
  const uint32_t base = wgmma::smem_address(smem);
  const uint32_t state_copy = base + kStages * 3 * kTile;
  const uint32_t epilogue = base + (kStages * 3 + kParts) * kTile;
  __nv_bfloat16* out_rows = reinterpret_cast<__nv_bfloat16*>(smem + (kStages * 3 + kParts) * kTile);
  const uint32_t bars = epilogue + 2 * kTile;
  if (kTma && threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) barrier_init(bars + 8 * i);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  if (kTma) __syncthreads();

  const int64_t pair = blockIdx.x / segments, begin = (blockIdx.x % segments) * segment_len;
  const int64_t end = begin + segment_len < L ? begin + segment_len : L;  // this segment's timesteps
  const int64_t offset = pair * L * D;
  q += offset, k += offset, v += offset, out += offset;
  const int64_t chunks = end > begin ? (end - begin + C - 1) / C : 0;
  // the first timestep of the chunk processed `it`-th
  auto chunk_start = [&](int64_t it) { return begin + (reverse ? chunks - 1 - it : it) * C; };

  // Chunk `chunk` lives in stage slot chunk % kStages.
  auto tile_of = [&](int slot, int which) { return base + uint32_t(slot * 3 + which) * kTile; };
  const Stager stage(threadIdx.x);
  auto issue = [&](int64_t chunk, int slot) {
    if constexpr (kTma) {
      if (chunk < chunks && threadIdx.x == 0) {
        const uint32_t bar = bars + 8 * slot;
        const int row = int(chunk_start(chunk)), pair_index = int(pair);
        barrier_expect(bar, (kStateOnly ? 2 : 3) * kTile);
        if (!kStateOnly) tma_tile(tile_of(slot, 0), &q_map, bar, row, pair_index, tma_pieces);
        tma_tile(tile_of(slot, 1), &k_map, bar, row, pair_index, tma_pieces);
        tma_tile(tile_of(slot, 2), &v_map, bar, row, pair_index, tma_pieces);
      }
    } else {
      if (chunk < chunks) {
        if (!kStateOnly) stage(tile_of(slot, 0), q, chunk_start(chunk), end);
        stage(tile_of(slot, 1), k, chunk_start(chunk), end);
        stage(tile_of(slot, 2), v, chunk_start(chunk), end);
      }
      asm volatile("cp.async.commit_group;\n" ::: "memory");
    }
  };

  // The state (columns 0 .. 63, see load_state); its bf16 copy is read by the next chunk's Q S.
  float state[32];
  float* state_slot = states != nullptr ? states + int64_t(blockIdx.x) * D * D : nullptr;
  load_state(state, kStateOnly ? nullptr : state_slot);
  auto publish = [&] {
    if constexpr (kTma) {  // stmatrix (see store_blocks)
      uint32_t head[16], remainder[16];
      pack_blocks(state, head, remainder, kTwoParts);
      store_blocks<false>(head, state_copy);
      if constexpr (kTwoParts) store_blocks<false>(remainder, state_copy + kTile);
    } else {
      publish_state<kTwoParts>(state, state_copy);
    }
  };
  if (!kStateOnly) publish();

  for (int i = 0; i < kStages - 1; ++i) issue(i, i);
  int slot = 0;  // chunk it's stage slot
  for (int64_t it = 0; it < chunks; ++it, slot = slot + 1 == kStages ? 0 : slot + 1) {
    if constexpr (kTma) {
      // chunk it - 2's output store has read its tile, which this chunk's outputs take
      if (!kStateOnly && threadIdx.x == 0) tma_store_wait_read<1>();
      barrier_wait(bars + 8 * slot, uint32_t(it / kStages) & 1);  // chunk it is staged
    } else {
      asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 2) : "memory");  // chunk it is staged
    }
    wgmma::fence_shared_writes();  // its tiles (cp.async) and the state copy, written by this thread, seen by wgmma
    __syncthreads();               // ... and by every thread's; the slot chunk it + kStages - 1 fills is free
    const int next_slot = slot == 0 ? kStages - 1 : slot - 1;  // chunk it - 1's
    const uint32_t qt = tile_of(slot, 0), kt = tile_of(slot, 1), vt = tile_of(slot, 2);
    if constexpr (kStateOnly) {
      wgmma::fence();
#pragma unroll
      for (int s = 0; s < 4; ++s) wgmma::mma_ss<1, 1>(state, k_along_rows<kTma>(kt, s), k_along_rows<kTma>(vt, s));  // S += K^T V
      wgmma::commit();
      issue(it + kStages - 1, next_slot);  // while the tensor cores work
      wgmma::wait<0>();
      continue;
    }

    float score[32], o[32];  // set by their first products (accumulate = false)
    wgmma::fence();
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      wgmma::mma_ss<0, 0>(score, k_along_columns<kTma>(qt, s), k_along_columns<kTma>(kt, s), s > 0);  // Q K^T
    }
    wgmma::commit();
    if constexpr (kTwoParts) {  // the remainder first: the small terms first
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        wgmma::mma_ss<0, 1>(o, k_along_columns<kTma>(qt, s), k_along_rows(state_copy + kTile, s), s > 0);
      }
    }
#pragma unroll
    for (int s = 0; s < 4; ++s) {  // Q S
      wgmma::mma_ss<0, 1>(o, k_along_columns<kTma>(qt, s), k_along_rows(state_copy, s), kTwoParts || s > 0);
    }
    wgmma::commit();
#pragma unroll
    for (int s = 0; s < 4; ++s) wgmma::mma_ss<1, 1>(state, k_along_rows<kTma>(kt, s), k_along_rows<kTma>(vt, s));  // S += K^T V
    wgmma::commit();
    issue(it + kStages - 1, next_slot);  // the copies' instructions issue while the tensor cores work
    wgmma::wait<1>();  // the scores and Q S (P V accumulates into o next); K^T V may still run

    uint32_t p[4][4];
    pack_scores(score, p, reverse);
    wgmma::fence();
#pragma unroll
    for (int s = 0; s < 4; ++s) wgmma::mma_rs<1>(o, p[s], k_along_rows<kTma>(vt, s));  // O += P V
    wgmma::commit();
    wgmma::wait<0>();

    if constexpr (kTma) {
      const uint32_t out_tile = epilogue + uint32_t(it & 1) * kTile;
      uint32_t head[16], unused[16];
      pack_blocks(o, head, unused, false);
      store_blocks<true>(head, out_tile);
      wgmma::fence_shared_writes();  // the tile, written by this thread, seen by the TMA
      __syncthreads();  // ... written by every thread; every warp's wgmma has read the state copy
      if (threadIdx.x == 0) tma_store(out_tile, &o_map, int(chunk_start(it)), int(pair), tma_pieces);
    } else {
      write_rows(o, out_rows, out, chunk_start(it), end);
      __syncthreads();  // every warp's wgmma has read the state copy (and the staging rows are free)
    }
    publish();  // S after this chunk, for the next
  }
  if (kTma && !kStateOnly && threadIdx.x == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
  if constexpr (kStateOnly) store_state(state, state_slot);
}

// The TMA's view of a contiguous bf16 [B, H, L, 64] array (see tma_tile): 4-d, or where the
// driver refuses it 3-d (`pieces` 1 or 8); rows past L read as zeros.
struct Maps {
  CUtensorMap q, k, v, o;
  int pieces = 1;
};
bool encode_map(CUtensorMap& map, const torch::Tensor& x, int pieces) {
  static const auto encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
    TORCH_CHECK(fn != nullptr && found == cudaDriverEntryPointSuccess, "cuTensorMapEncodeTiled is not available");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  const cuuint64_t L = cuuint64_t(x.size(2)), pairs = cuuint64_t(x.size(0) * x.size(1));
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  auto encoded = [&](cuuint32_t rank, const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box) {
    return encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank, x.data_ptr(), dims, strides, box, element_strides,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
  };
  if (pieces == 1) {
    const cuuint64_t dims[4] = {8, L, 8, pairs};
    const cuuint64_t strides[3] = {D * 2, 16, L * D * 2};  // bytes, of dimensions 1, 2, 3
    const cuuint32_t box[4] = {8, C, 8, 1};
    return encoded(4, dims, strides, box);
  }
  const cuuint64_t dims[3] = {D, L, pairs};
  const cuuint64_t strides[2] = {D * 2, L * D * 2};
  const cuuint32_t box[3] = {8, C, 1};
  return encoded(3, dims, strides, box);
}
Maps tensor_maps(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& o) {
  Maps maps;
  for (int pieces : {1, 8}) {
    maps.pieces = pieces;
    if (encode_map(maps.q, q, pieces) && encode_map(maps.k, k, pieces) && encode_map(maps.v, v, pieces) &&
        encode_map(maps.o, o, pieces)) {
      return maps;
    }
  }
  TORCH_CHECK(false, "cuTensorMapEncodeTiled refused both views of q, k, v and out");
  return maps;
}

template <int kStages, bool kStateOnly, bool kTwoParts, bool kTma>
void launch(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& out,
            int64_t segments, int64_t segment_len, float* states, const Maps& maps, bool reverse) {
  const int64_t pairs = q.size(0) * q.size(1), L = q.size(2);
  const int smem = (kStages * 3 + (kTwoParts ? 2 : 1)) * kTile + (kTma ? 2 * kTile + 8 * kStages : 64 * (D + 8) * 2);
  auto kernel = wgmma_forward_kernel<kStages, kStateOnly, kTwoParts, kTma>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<unsigned(pairs * segments), 128, smem, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const __nv_bfloat16*>(q.data_ptr()), reinterpret_cast<const __nv_bfloat16*>(k.data_ptr()),
      reinterpret_cast<const __nv_bfloat16*>(v.data_ptr()), reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), L,
      segments, segment_len, states, maps.q, maps.k, maps.v, maps.o, maps.pieces, reverse);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// segments > 1: each segment's K^T V first (state-only launch), scanned (exclusive, torch's
// cumsum), then every segment's outputs from its start state.
template <int kStages, bool kTwoParts, bool kTma>
void run(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& out,
         int64_t segments, bool reverse) {
  const int64_t pairs = q.size(0) * q.size(1), L = q.size(2);
  const int64_t segment_len = ((L + segments - 1) / segments + C - 1) / C * C;
  segments = std::max<int64_t>(1, (L + segment_len - 1) / segment_len);
  const Maps maps = kTma ? tensor_maps(q, k, v, out) : Maps{};
  if (segments == 1) {
    launch<kStages, false, kTwoParts, kTma>(q, k, v, out, 1, L, nullptr, maps, reverse);
    return;
  }
  auto sums = torch::empty({pairs, segments, D, D}, q.options().dtype(at::kFloat));
  launch<kStages, true, false, kTma>(q, k, v, out, segments, segment_len, sums.data_ptr<float>(), maps,
                                     reverse);  // no state copy
  // each segment starts from the sum of those before it (reverse: after it)
  auto starts = (reverse ? sums.flip(1).cumsum(1).flip(1) : sums.cumsum(1)) - sums;
  starts = starts.contiguous();
  launch<kStages, false, kTwoParts, kTma>(q, k, v, out, segments, segment_len, starts.data_ptr<float>(), maps,
                                          reverse);
}

// parts: the state's copy in one bf16 part or two; tma: staged by the TMA (else cp.async);
// reverse: out[t] = sum over s >= t (see wgmma_forward_kernel).
torch::Tensor forward(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t stages, int64_t segments,
                      int64_t parts, bool tma, bool reverse) {
  for (const auto& x : {q, k, v}) {
    TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.dim() == 4 &&
                    x.size(3) == D && x.sizes() == q.sizes(),
                "the prototype takes contiguous bf16 [B, H, L, 64] q, k, v of one shape");
  }
  TORCH_CHECK(segments >= 1, "segments >= 1");
  TORCH_CHECK(stages == 3 || stages == 4, "stages: 3 or 4");
  TORCH_CHECK(parts == 1 || parts == 2, "parts: 1 or 2");
  TORCH_CHECK(q.size(2) < (int64_t(1) << 31) && q.size(0) * q.size(1) < (int64_t(1) << 31),
              "the TMA's coordinates are 32-bit");
  auto out = torch::empty_like(v);
  auto dispatch = [&](auto two_parts, auto with_tma) {
    constexpr bool kTwo = decltype(two_parts)::value, kTma = decltype(with_tma)::value;
    if (stages == 3) run<3, kTwo, kTma>(q, k, v, out, segments, reverse);
    if (stages == 4) run<4, kTwo, kTma>(q, k, v, out, segments, reverse);
  };
  auto by_parts = [&](auto with_tma) {
    parts == 2 ? dispatch(std::true_type{}, with_tma) : dispatch(std::false_type{}, with_tma);
  };
  tma ? by_parts(std::true_type{}) : by_parts(std::false_type{});
  return out;
}

}  // namespace

// The TMA's loads a tile (1: the 4-d view, 8: the 3-d one the driver took instead), for the record.
int64_t tma_pieces(torch::Tensor q, torch::Tensor k, torch::Tensor v) { return tensor_maps(q, k, v, v).pieces; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward);
  m.def("tma_pieces", &tma_pieces);
}
