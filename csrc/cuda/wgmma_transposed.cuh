// The 16-bit passes above 128 of the state's rows with the state kept transposed in registers
// (wgmma_transposed_kernel): the plain forward, dq, dk and dv (the four passes' causal product,
// kernel_common.cuh's Operands) where their blocks fill the device in one time segment and no
// state goes in or out (transposed_takes in wgmma_launch.cuh).
//
// wgmma_product_kernel's four-atom layout keeps the state S (Da x 64 columns of Cc) in float32
// accumulators and, each chunk, rounds it into a two-part bfloat16 copy in shared memory that A S
// then reads as wgmma's B. Here a block covers 128 columns of Cc, and its consumer group g keeps
// S_g^T (its 64 columns by Da's 256 rows: four m64n64 accumulators, 128 registers a thread), which
// is wgmma's register A operand as it stands:
//
//   out_g^T  = S_g^T A^T          each k16 step of Da rounded into hi and lo fragments (the
//                                 copy's two parts) just before its two m64n64k16 (32 a chunk; B =
//                                 the staged A, K-major, as the scores' B)
//   S_g^T   += Cc_g^T B           16 m64n64k16 (A = Cc's 64-column tile g, MN-major; B = B's
//                                 atoms, MN-major: the update with its operands swapped)
//   out_g^T += Cc_g^T P^T         4 m64n64k16 (B = the producer's masked scores P, K-major)
//
// and out_g^T leaves through stmatrix .trans into a staging tile a group, then one bulk tensor
// store. The producer's thread 0 stages A, B and Cc with bulk tensor copies (TMA) into two slots
// (mbarriers: landed, empty), and its warpgroup makes P into a ring of two. No
// copy and no barrier for one, every product at N = 64, A and B read by half as many column tiles
// (128 columns a block, not 64), and the producer's scores serving twice the columns: 120
// m64n64k16 a chunk for 128 columns, against 72 for 64 in the four-atom layout. Measured as
// benchmarks/transposed256.cu (RESULTS.md, eighty-sixth session, H100, bf16 E = M = 256, the
// forward's do_bench median against wgmma_product_kernel's): 4,16,2048 0.110 ms against 0.160
// (1.21x the floor against 1.77x), 8,16,1024 0.110 against 0.166; the reverse direction alike.
// At 2,16,4096 (64 blocks: half the device) 0.179 against 0.159 in two time segments, hence
// one segment only.
// float16 (kHalf): the copy in one part, as StateCopy's float16 copy, each row of S_g^T scaled by
// a power of two into float16's range (row_factors) and out_g^T's rows scaled back before
// Cc_g^T P^T joins them: 16 products of out^T a chunk, not 32, and a wait more.
// As library passes (eighty-seventh session, H100, FAST_CAUSAL_ATTN_TRANSPOSED=1 against 0, fwd /
// fwd+bwd ms): bf16 4,16,2048,256 0.109 / 0.438 against 0.163 / 0.686 (1.2x / 1.8x the floor);
// fp16 0.105 / 0.412 against 0.150 / 0.642; bf16 4,16,2048,200 0.106 / 0.429 against 0.206 / 0.818.
#pragma once

#include <cuda.h>  // CUtensorMap

#include "wgmma_product.cuh"
#include "wgmma_tf32_product.cuh"  // (its mbarrier helpers)

namespace fast_causal_attn {
namespace cuda {
namespace wgmma_transposed {

constexpr int kAtoms = 4;                       // Da up to 256: A's and B's 64-column atoms
constexpr int kColumns = 128;                   // a block's columns of Cc and the outputs (two groups of 64)
constexpr int kDepth = 2;                       // stage slots
constexpr int kSlotTiles = 2 * kAtoms + 2;      // A's atoms, B's atoms, Cc's two tiles
constexpr int kScoresAt = kDepth * kSlotTiles;  // P's ring: chunk it's P at kScoresAt + it % kDepth
constexpr int kStagingAt = kScoresAt + kDepth;  // group g's output staging tile at kStagingAt + g
// then each slot's mbarriers: landed (the chunk's bulk copies: the producer's thread 0 expects
// their bytes) and empty (the consumers' eight warps done with the slot), 8 bytes each
constexpr int kBarriersAt = (kStagingAt + 2) * wgmma::kTile;
constexpr size_t kSmemBytes = size_t(kBarriersAt) + 2 * kDepth * 8;  // 192 KB and the barriers
constexpr uint32_t kChunkBytes = kSlotTiles * wgmma::kTile;  // what lands in a slot a chunk (zeros past the operands)
static_assert(kSmemBytes <= 227 * 1024, "shared memory of one block");
constexpr int kBlockThreads = 3 * wgmma::kThreads;  // two consumer groups, then the producer
// The registers a thread after setmaxnreg (the launch's 168 given from the producer to the
// consumers: 2 x 216 + 72 = 3 x 168). The consumers hold 200 (ptxas, offline): the state's 128,
// the outputs' 32, two sets of one k16 step's fragments. Two steps' fragments at a time spilled
// and ptxas serialized the wgmma (C7512); so did a producer that staged with cp.async (the
// Stager's partial chunks took it past 72) and consumers that wrote their outputs row by row
// (64-bit addresses across the loop): hence the bulk tensor copies both ways (RESULTS.md,
// eighty-sixth session). The producer's scores need more than 56.
constexpr int kProducerRegisters = 72, kConsumerRegisters = 216;
static_assert(2 * kConsumerRegisters + kProducerRegisters <= 3 * (65536 / kBlockThreads / 8 * 8), "registers");
// named barriers: 0 is __syncthreads; the ring's full ones (kFull + slot: the producer arrives
// once P is made, both groups sync); each group's own
constexpr int kFull = 1, kGroupBarrier = kFull + kDepth;
static_assert(kGroupBarrier + 2 <= 16, "named barriers");

// The operands and the output as bulk tensor copies see them (made by launch_transposed): A, B and
// Cc (kernel_common.cuh's Operands) and the pass's output, each the [B, H, L, D] tensor through its
// strides, in 64 x 64 boxes in the 128-byte swizzle (the staged tiles' own layout). A box past the
// sequence or the width lands as zeros and stores nothing there: the partial chunks and atoms.
struct Maps {
  CUtensorMap a, b, c, out;
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
using wgmma::matrix_pair;

// Box (column c0, timestep t0) of (b, h) of `map` into `tile`, counted on `bar`; and the staged
// tile out to the box there (a bulk group of the issuing thread's).
__device__ __forceinline__ void load_box(uint32_t tile, const CUtensorMap* map, int c0, int t0, int h, int b,
                                         uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::
          "r"(tile), "l"(map), "r"(c0), "r"(t0), "r"(h), "r"(b), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void store_box(const CUtensorMap* map, uint32_t tile, int c0, int t0, int h, int b) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(map),
               "r"(c0), "r"(t0), "r"(h), "r"(b), "r"(tile)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Until this thread's bulk stores have read their shared memory (kReadOnly) or are done
template <bool kReadOnly>
__device__ __forceinline__ void wait_stores() {
  if constexpr (kReadOnly) {
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
  } else {
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
  }
}
__device__ __forceinline__ void expect_bytes(uint32_t bar, uint32_t bytes) {  // this thread's arrival
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// k16 step s of atom a of S_g^T (an m64n64 accumulator: rows m = 16 warp + g (+8), columns e =
// 64 a + 8 j + 2 q (+1)) as register A fragments: hi = bf16(S^T), lo = bf16(S^T - hi), the
// two-part rounding of StateCopy's bfloat16 copy.
__device__ __forceinline__ void state_fragments(const float (&st)[32], int s, uint32_t (&hi)[4], uint32_t (&lo)[4]) {
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const float x = st[matrix_pair(s, m)], y = st[matrix_pair(s, m) + 1];
    hi[m] = wgmma::pack<false>(x, y);
    lo[m] = wgmma::pack<false>(x - __uint_as_float(hi[m] << 16), y - __uint_as_float(hi[m] & 0xffff0000u));
  }
}

// (float16) each row m of S_g^T (this lane's rows g and g + 8: h = 0, 1) times a power of two,
// factor[h], that takes the row's largest |entry| into [2^14, 2^15): inside float16's range with
// its 11 bits; inverse[h] takes out_g^T's row back. Rows below 2^-111 take 2^126 (zeros stay
// zeros), an infinite row 2^-114.
__device__ __forceinline__ void row_factors(const float (&state)[kAtoms][32], float (&factor)[2], float (&inverse)[2]) {
  float largest[2] = {0.f, 0.f};
#pragma unroll
  for (int a = 0; a < kAtoms; ++a)
#pragma unroll
    for (int i = 0; i < 32; ++i) largest[(i % 4) / 2] = fmaxf(largest[(i % 4) / 2], fabsf(state[a][i]));
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    // the row's four lanes (a quad) hold its entries
    largest[h] = fmaxf(largest[h], __shfl_xor_sync(0xffffffffu, largest[h], 1));
    largest[h] = fmaxf(largest[h], __shfl_xor_sync(0xffffffffu, largest[h], 2));
    // largest in [2^(biased - 127), 2^(biased - 126))
    const uint32_t biased = max((__float_as_uint(largest[h]) >> 23) & 0xffu, 15u);
    factor[h] = __uint_as_float((268u - biased) << 23);  // 2^(141 - biased)
    inverse[h] = __uint_as_float((biased - 14u) << 23);  // 2^(biased - 141)
  }
}
// (float16) k16 step s of atom a of S_g^T times its rows' factors, as one register A fragment
__device__ __forceinline__ void scaled_fragments(const float (&st)[32], int s, const float (&factor)[2],
                                                 uint32_t (&hi)[4]) {
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    hi[m] = wgmma::pack<true>(factor[m % 2] * st[matrix_pair(s, m)], factor[m % 2] * st[matrix_pair(s, m) + 1]);
  }
}

// out_g^T (rows m = this group's columns 16 warp + g (+8), columns t = 8 j + 2 q (+1) of the chunk)
// times `scale`, rounded and stored transposed into the group's staging tile (row t, its 64
// columns in the 128-byte swizzle), then written out by the group's thread 0 as one bulk tensor
// store of the box (m0, t0) of (b, h): the sequence's end and the width clip it. Before the
// tile is written again, that thread waits for the store's reads and the group for it.
template <bool kHalf>
__device__ __forceinline__ void store_outputs(const float (&acc)[32], float scale, uint32_t staging, int group,
                                              const CUtensorMap* out, int m0, int t0, int h, int b) {
  const int warp = wgmma::group_warp(), lane = threadIdx.x % kWarp, r = lane % 8, i = lane / 8;
  const bool issues = threadIdx.x % wgmma::kThreads == 0;
  if (issues) wait_stores<true>();  // the last chunk's store has read the tile
  wgmma::named_sync(kGroupBarrier + group, wgmma::kThreads);
#pragma unroll
  for (int k = 0; k < 4; ++k) {  // n-tiles 2 k, 2 k + 1: rows t = 16 k + 8 (i / 2) + r, column group 2 warp + i % 2
    uint32_t x[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      x[m] = wgmma::pack<kHalf>(scale * acc[matrix_pair(k, m)], scale * acc[matrix_pair(k, m) + 1]);
    }
    const int t = 16 * k + 8 * (i / 2) + r;
    wgmma::store_matrices<true>(staging + t * 128 + (((2 * warp + i % 2) ^ r) * 16), x);
  }
  wgmma::fence_shared_writes();  // the tile's generic writes seen by the bulk copy (the async proxy)
  wgmma::named_sync(kGroupBarrier + group, wgmma::kThreads);
  if (issues) store_box(out, staging, m0, t0, h, b);
}
#endif

}  // namespace wgmma_transposed

// grid.x = pair * col_tiles + column tile (128 columns of Cc each): one time segment, no packed
// sequences (transposed_takes). The scale multiplies the outputs, as wgmma_product_kernel's.
template <Pass P, typename scalar_t>
__global__ void __launch_bounds__(wgmma_transposed::kBlockThreads, 1)
    wgmma_transposed_kernel(const __grid_constant__ wgmma_transposed::Maps maps, int64_t L, int H, int col_tiles,
                            float scale) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace wgmma;
  using namespace wgmma_transposed;
  using wgmma_tf32::mbarrier_init;
  using wgmma_tf32::mbarrier_wait;
  static_assert(P != Pass::GradKV, "one pass: the forward, dq, dk or dv");
  constexpr bool kHalf = std::is_same_v<scalar_t, at::Half>;
  static_assert(kHalf || std::is_same_v<scalar_t, at::BFloat16>, "bfloat16 or float16");
  constexpr bool kReverse = PassTraits<P>::kReverse;  // dk and dv: time walked backward
  extern __shared__ __align__(1024) unsigned char wgmma_smem[];
  const uint32_t base = smem_address(wgmma_smem);
  const int tile_index = int(blockIdx.x) % col_tiles, pair = int(blockIdx.x) / col_tiles;
  const int b = pair / H, h = pair % H, col0 = kColumns * tile_index;
  const int chunks = int((L + C - 1) / C);                                 // (launch_transposed: L below 2^31)
  auto chunk_of = [&](int it) { return kReverse ? chunks - 1 - it : it; };  // walk step it's chunk
  auto tile = [&](int slot, int which) { return base + uint32_t(slot * kSlotTiles + which) * kTile; };
  auto scores_tile = [&](int it) { return base + uint32_t(kScoresAt + it % kDepth) * kTile; };
  auto landed = [&](int slot) { return base + uint32_t(kBarriersAt + 8 * slot); };
  auto empty = [&](int slot) { return base + uint32_t(kBarriersAt + 8 * (kDepth + slot)); };
  auto phase = [](int it) { return uint32_t(it / kDepth) & 1u; };  // slot it % kDepth's use it / kDepth
  if (threadIdx.x == 0) {
    for (int s = 0; s < kDepth; ++s) {
      mbarrier_init(landed(s), 1);  // the producer's thread 0 (its expected bytes), then the bytes
      mbarrier_init(empty(s), 8);   // lane 0 of each consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const int group = warpgroup();

  if (group == 2) {  // the producer: thread 0 the bulk copies of A, B and Cc's two tiles, all of it P
    registers_down_to<kProducerRegisters>();
    const bool issues = threadIdx.x % kThreads == 0;
    auto stage_chunk = [&](int it, int slot) {  // (it < chunks)
      const int t0 = C * chunk_of(it);
      expect_bytes(landed(slot), kChunkBytes);
#pragma unroll
      for (int a = 0; a < kAtoms; ++a) {
        load_box(tile(slot, a), &maps.a, 64 * a, t0, h, b, landed(slot));
        load_box(tile(slot, kAtoms + a), &maps.b, 64 * a, t0, h, b, landed(slot));
      }
      load_box(tile(slot, 2 * kAtoms), &maps.c, col0, t0, h, b, landed(slot));
      load_box(tile(slot, 2 * kAtoms + 1), &maps.c, col0 + 64, t0, h, b, landed(slot));
    };
    if (issues) {
      for (int it = 0; it < kDepth && it < chunks; ++it) stage_chunk(it, it);
    }
    for (int it = 0; it < chunks; ++it) {
      const int slot = it % kDepth, refill = (it + 1) % kDepth;
      mbarrier_wait(landed(slot), phase(it));  // chunk it's boxes
      // (P's tile it % 2 was last read by chunk it - 2's products, released before chunk it was staged)
      make_masked_scores<kHalf, kAtoms, kReverse>(tile(slot, 0), tile(slot, kAtoms), scores_tile(it));
      named_arrive(kFull + slot, kBlockThreads);
      // chunk it - 1's slot takes chunk it + 1 once both groups are done with it (every producer
      // thread waits: chunk it + 1's P goes where chunk it - 1's was read)
      if (it > 0 && it + 1 < chunks) {
        mbarrier_wait(empty(refill), phase(it - 1));
        if (issues) stage_chunk(it + 1, refill);
      }
    }
    return;
  }

  // a consumer group: columns 64 group on of the block's tile; S_g^T by atoms of Da
  registers_up_to<kConsumerRegisters>();
  float state[kAtoms][32];
#pragma unroll
  for (int a = 0; a < kAtoms; ++a)
#pragma unroll
    for (int i = 0; i < 32; ++i) state[a][i] = 0.f;
  const uint32_t staging = base + uint32_t(kStagingAt + group) * kTile;
  for (int it = 0; it < chunks; ++it) {
    const int slot = it % kDepth;
    mbarrier_wait(landed(slot), phase(it));       // chunk it's boxes, seen by this thread
    named_sync(kFull + slot, kBlockThreads);  // and P
    const uint32_t a_tile = tile(slot, 0), b_tile = tile(slot, kAtoms), c_tile = tile(slot, 2 * kAtoms + group);
    float acc[32];  // out_g^T
    float factor[2], inverse[2];  // (float16) its rows' scales
    if constexpr (kHalf) row_factors(state, factor, inverse);
    // a k16 step of Da at a time: its fragments (once the last step's products have read theirs;
    // ptxas alternates two sets), out^T += its parts times A^T; after an atom's last, its update
    // (its accumulators free again by the chunk's last wait)
#pragma unroll
    for (int step = 0; step < 4 * kAtoms; ++step) {
      const int a = step / 4, s = step % 4;
      if (step > 0) {  // the last step's products done (an update after them may run on)
        if (s == 0) wait<1>(); else wait<0>();
      }
      const uint64_t bt = k_along_columns(a_tile + a * kTile, s);
      if constexpr (kHalf) {  // one part, its rows scaled
        uint32_t hi[4];
        scaled_fragments(state[a], s, factor, hi);
        fence();
        mma_rs<true, 0>(acc, hi, bt, step > 0);
      } else {
        uint32_t hi[4], lo[4];
        state_fragments(state[a], s, hi, lo);
        fence();
        mma_rs<false, 0>(acc, lo, bt, step > 0);  // (the small terms first)
        mma_rs<false, 0>(acc, hi, bt);
      }
      commit();
      if (s == 3) {
        add_bt_times_c<kHalf>(state[a], c_tile, b_tile + a * kTile);  // S_g^T += Cc_g^T B
        commit();
      }
    }
    if constexpr (kHalf) {  // out_g^T's rows back from their scales (the last update may run on)
      wait<1>();
#pragma unroll
      for (int i = 0; i < 32; ++i) acc[i] *= inverse[(i % 4) / 2];
      fence();
    }
#pragma unroll
    for (int s = 0; s < 4; ++s) mma_ss<kHalf, 1, 0>(acc, k_along_rows(c_tile, s), k_along_columns(scores_tile(it), s));
    commit();
    wait<0>();
    // the slot is read by nothing more of this warp's
    if (it + kDepth < chunks) {
      __syncwarp();
      if (threadIdx.x % kWarp == 0) wgmma_tf32::mbarrier_arrive(empty(slot));
    }
    store_outputs<kHalf>(acc, scale, staging, group, &maps.out, col0 + 64 * group, C * chunk_of(it), h, b);
  }
  if (threadIdx.x % kThreads == 0) wait_stores<false>();  // (the block's last stores done before it ends)
#endif
}

// A [B, H, L, D] bfloat16 (half: float16) tensor through its strides (elements; D contiguous) as a
// bulk tensor copy's map in 64 x 64 boxes with the 128-byte swizzle (Maps); false where the driver
// takes no such map (causal_attn_cuda.cu).
bool transposed_map(CUtensorMap& map, bool half, const void* ptr, int64_t B, int64_t H, int64_t L, int64_t D,
                    int64_t stride_b, int64_t stride_h, int64_t stride_l);

// Pass P on wgmma_transposed_kernel (transposed_takes holds: 16-bit, one segment, no packed
// sequences): the maps of its operands (Operands' table in kernel_common.cuh) and its output, then
// the launch. false, launching nothing, where a map cannot be made (wgmma_product_kernel runs the
// pass then: launch_wgmma_kernels).
template <Pass P, typename scalar_t>
bool launch_transposed(const KernelParams& p, int64_t Da, int64_t Dc, cudaStream_t stream) {
  using wgmma_transposed::kColumns;
  TORCH_CHECK(p.L < (int64_t(1) << 31) && p.B * p.H < (int64_t(1) << 31),
              "fast_causal_attn: internal: the transposed kernel takes L and B * H below 2^31");
  wgmma_transposed::Maps maps;
  auto map = [&p](CUtensorMap& m, const StridedTensor& x, int64_t D) {
    return transposed_map(m, std::is_same_v<scalar_t, at::Half>, x.ptr, p.B, p.H, p.L, D, x.stride_b, x.stride_h,
                          x.stride_l);
  };
  auto operand = [&p](int which) { return pass_operand<P>(which, p.q, p.k, p.v, p.dout); };
  if (!map(maps.a, operand(0), Da) || !map(maps.b, operand(1), Da) || !map(maps.c, operand(2), Dc) ||
      !map(maps.out, pass_output<P>(p), Dc)) {
    return false;
  }
  const int64_t col_tiles = (Dc + kColumns - 1) / kColumns, blocks = p.B * p.H * col_tiles;
  TORCH_CHECK(blocks <= int64_t(0x7fffffff), "fast_causal_attn: too many (batch, head, column) tiles: ", blocks);
  if (blocks == 0 || p.L == 0) return true;
  allow_dynamic_smem(wgmma_transposed_kernel<P, scalar_t>, wgmma_transposed::kSmemBytes);
  wgmma_transposed_kernel<P, scalar_t><<<unsigned(blocks), wgmma_transposed::kBlockThreads, wgmma_transposed::kSmemBytes, stream>>>(
      maps, p.L, int(p.H), int(col_tiles), float(p.scale));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

}  // namespace cuda
}  // namespace fast_causal_attn
