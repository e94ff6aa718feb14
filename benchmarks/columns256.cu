// A prototype of the E = M = 256 forward in column halves (benchmarks/RESULTS.md, eighty-third
// session: "E = 256 column-halves design"), to measure before any change to wgmma_product_kernel:
// bfloat16, contiguous [B, H, L, 256], L a multiple of 64, scale 1, no normalize, no states, no
// segments; one block a (batch, head, 64-column tile of V and O) walking all of L, as the
// library's four-atom forward does at 4,16,2048,256 (256 pairs: one segment); and the same walked
// backward with the mask reversed (kReverse: the shape of the backward's dk and dv passes).
//
// The library's four-atom forward splits the state's 256 rows between its two consumer
// warpgroups (two atoms each): each makes partial scores and a partial output over its half of
// E, and the second's partial output is added to the first's through shared memory every chunk,
// which couples the two groups' chains. Here each consumer group g owns 32 of the tile's 64
// columns and all 256 rows of the state (four m64n32 accumulators, 64 registers a thread), and
// the producer warpgroup computes the chunk's masked scores P once (16 m64n64k16 over E = 256)
// into a 2-tile ring before it announces the chunk. A group's chain a chunk:
//
//   acc = Q [S_hi | S_lo]      16 m64n64k16 (its copy as one 256 x 64 B: its hi and lo parts
//                              side by side; the two halves of acc added at the end)
//   S_g += K^T V_g             16 m64n32k16 (A = K^T from the staged K, MN-major; B = V's
//                              32-column half g, the descriptor 64 g bytes into the swizzled tile)
//   pv = P V_g                 4 m64n32k16
//   O_g = acc_hi + acc_lo + pv, staged over V's half g (read by this group alone), stored
//
// with no exchange between the groups: 26 m64n64k16-equivalents each, 68 a block with the
// producer's 16 (72 in the row split). Shared memory: two stage slots of Q (4 atoms), K (4) and
// V's tile (1), 144 KB; the groups' copies, 32 KB each; P's ring, 16 KB: 224 KB, as the row split.
// Everything shared with the library (descriptors, the staging, the mask, stmatrix of fragments)
// is csrc/cuda/wgmma_product.cuh's; the m64n32k16 product is benchmarks/wgmma.cuh's; the ring is
// ProducedRing's walk written out, so that the schedules (Schedule, below) can change when a
// slot is announced, released and refilled. Measured (RESULTS.md, eighty-fifth session, H100):
// kShared 0.152 ms at 4,16,2048 against the row split's 0.161; the groups apart (kOwnFull,
// kPingPong) 6-8% slower, which points at the slot's refill. benchmarks/columns256.py builds
// this, checks it against float64 and against the library, and times it beside the library.
#include <cuda.h>
#include <cudaTypedefs.h>

#include "columns256.cuh"
#include "wgmma.cuh"
#include "wgmma_tf32_product.cuh"  // (its mbarrier helpers, for the cluster kernel)

namespace columns256 {

constexpr int kDepth = 2;                      // stage slots
constexpr int kSlotTiles = 2 * kAtoms + 1;     // Q's atoms, K's atoms, V's column tile
constexpr int kCopyAt = kDepth * kSlotTiles;   // group g's copy: tiles kCopyAt + kAtoms g on (state rows 64 a)
constexpr int kScoresAt = kCopyAt + 2 * kAtoms;  // P's ring: chunk it's P at kScoresAt + it % kDepth
constexpr int kSmemBytes = (kScoresAt + kDepth) * fw::kTile;
static_assert(kSmemBytes <= 227 * 1024, "shared memory of one block");
constexpr int kBlockThreads = 3 * fw::kThreads;  // two consumer groups, then the producer
// How the two consumer groups meet the ring (Schedule): kShared, one full barrier a slot for all
// 384 threads, so a group starts chunk it only once the other has finished chunk it - 1 and the
// two run their products and their copies in lock step; kOwnFull, a full barrier a slot for each
// group (the producer arrives on both), so they drift apart as far as the slots let them;
// kPingPong, own full barriers and the groups take turns issuing their products (turn barriers,
// as flash-attention 3's two consumer warpgroups do), so one group's copy and stores run while
// the other's products hold the tensor cores; kEarlyRelease, kShared with the slot's Q and K
// released once the group's Q S and update are in (kEmpty) and V's tile once its outputs are
// stored (kEmptyV), so the producer stages most of the next chunk's bytes sooner.
// kEarlyStage, kEarlyRelease with the producer issuing the next chunk's Q and K copies before
// this chunk's scores (not after announcing it), so the copies run during the scores.
// Two diagnostics of kShared, their outputs wrong: kLoadsOnly, the copies and the barriers alone
// (no products: the ring's time for the bytes); kComputeOnly, every product on the first two
// chunks' data (no copies after them: the chain's time without the loads).
enum Schedule : int {
  kShared = 0, kOwnFull = 1, kPingPong = 2, kEarlyRelease = 3, kEarlyStage = 4, kLoadsOnly = 5, kComputeOnly = 6
};
// named barriers: 0 is __syncthreads; the ring's full ones (kFull + kDepth g + slot: group g's,
// 256 threads; kShared: kFull + slot, 384), its empty ones (kEmpty + slot, 384); each group's own;
// the producer's (its copies landed, before the scores); the turns (kTurn + g: group g may issue)
constexpr int kFull = 1, kEmpty = kFull + 2 * kDepth, kEmptyV = kEmpty + kDepth, kGroupBarrier = kEmptyV + kDepth,
              kLandedBarrier = kGroupBarrier + 2, kTurn = kLandedBarrier + 1;
static_assert(kTurn + 1 < 16, "named barriers");
constexpr int kPairThreads = 2 * fw::kThreads;  // a group's full barrier or a turn: it and one other warpgroup

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// stmatrix of an accumulator's n-tiles 2 k and 2 k + 1 (64 rows, 16 columns) into a staged tile
// (row r, column c at 128 r + 16 ((c / 8) ^ (r % 8)) + 2 (c % 8)), fw::StateCopy::store_parts'
// mapping: matrix m of a store holds n-tile 2 k + m / 2, rows + 8 (m % 2), each lane's pair of it
// at d[fw::matrix_pair(k, m)]; lane l gives the address of row l % 8 of matrix l / 8, whose 16-byte group
// in the row is `group` + (l / 8) / 2 before the swizzle.
__device__ __forceinline__ uint32_t matrix_row(uint32_t tile, int group) {
  const int lane = threadIdx.x % kWarp, r = lane % 8, i = lane / 8;
  return tile + (16 * fw::group_warp() + 8 * (i % 2) + r) * 128 + (((group + i / 2) ^ r) * 16);
}

// This group's state (state[a]: rows 64 a + 16 warp + g (+8), its columns 8 j + 2 q4 (+1), j < 4)
// into its copy: tile a holds rows 64 a on, hi = bf16(S) in columns 0-31 (groups 0-3), lo =
// bf16(S - hi) in 32-63 (groups 4-7).
__device__ __forceinline__ void publish_copy(uint32_t copy, const float (&state)[kAtoms][16]) {
#pragma unroll
  for (int k = 0; k < 2; ++k) {
#pragma unroll
    for (int a = 0; a < kAtoms; ++a) {
      uint32_t hi[4], lo[4];
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const float x = state[a][fw::matrix_pair(k, m)], y = state[a][fw::matrix_pair(k, m) + 1];
        hi[m] = fw::pack<false>(x, y);
        lo[m] = fw::pack<false>(x - __uint_as_float(hi[m] << 16), y - __uint_as_float(hi[m] & 0xffff0000u));
      }
      fw::store_matrices(matrix_row(copy + a * fw::kTile, 2 * k), hi);
      fw::store_matrices(matrix_row(copy + a * fw::kTile, 4 + 2 * k), lo);
    }
  }
}

// This group's 64 x 32 outputs of the chunk (out: the accumulator layout, n-tiles j < 4) rounded
// into V's half `half` of the staged tile at v_bytes (its logical columns 32 half on: the same
// swizzled bytes V's half held), each warp its 16 rows, then written 16 bytes a lane to o's first
// 64 rows (o: the chunk's first row), columns col0 on.
__device__ __forceinline__ void store_outputs(const float (&out)[16], unsigned char* v_bytes, int half,
                                              __nv_bfloat16* o, int64_t col0) {
  const int warp = fw::group_warp(), lane = threadIdx.x % kWarp;
  __syncwarp();
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    uint32_t x[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) x[m] = fw::pack<false>(out[fw::matrix_pair(k, m)], out[fw::matrix_pair(k, m) + 1]);
    fw::store_matrices(matrix_row(fw::smem_address(v_bytes), 4 * half + 2 * k), x);
  }
  __syncwarp();
#pragma unroll
  for (int t = 0; t < 2; ++t) {  // the warp's 16 rows x 4 groups of 8 columns
    const int piece = lane + kWarp * t, rr = 16 * warp + piece / 4, c = piece % 4;
    const uint4 x = *reinterpret_cast<const uint4*>(v_bytes + rr * 128 + (((4 * half + c) ^ (rr % 8)) * 16));
    *reinterpret_cast<uint4*>(o + rr * kWidth + col0 + 8 * c) = x;
  }
}

// A consumer group g: its columns 32 g on of the tile, all 256 state rows (state[a]: rows 64 a
// on) and its state's copy (4 tiles at `copy`), published zero at the start.
struct Group {
  int g;
  uint32_t copy;
  float state[kAtoms][16];
  __device__ __forceinline__ Group(int g_, uint32_t copy_) : g(g_), copy(copy_) {
#pragma unroll
    for (int a = 0; a < kAtoms; ++a)
#pragma unroll
      for (int i = 0; i < 16; ++i) state[a][i] = 0.f;
    publish_copy(copy, state);
    fw::fence_shared_writes();
    fw::named_sync(kGroupBarrier + g, fw::kThreads);
  }
  // The chunk's products, three commit groups: acc = Q [S_hi | S_lo] (K = the state's rows, 64 a
  // an atom), S_g += K^T V_g, pv = P V_g (V's half g: the descriptor 64 g bytes in).
  __device__ __forceinline__ void issue(float (&acc)[32], float (&pv)[16], uint32_t q_tile, uint32_t k_tile,
                                        uint32_t v_tile, uint32_t p_tile) {
    fw::fence();
#pragma unroll
    for (int a = 0; a < kAtoms; ++a)
#pragma unroll
      for (int s = 0; s < 4; ++s)
        fw::mma_ss<false, 0, 1>(acc, fw::k_along_columns(q_tile + a * fw::kTile, s),
                                fw::k_along_rows(copy + a * fw::kTile, s), a > 0 || s > 0);
    fw::commit();
#pragma unroll
    for (int a = 0; a < kAtoms; ++a)
#pragma unroll
      for (int s = 0; s < 4; ++s)
        ::wgmma::mma_ss_n32<1, 1>(state[a], fw::k_along_rows(k_tile + a * fw::kTile, s),
                                  fw::k_along_rows(v_tile, s, 64 * g));
    fw::commit();
#pragma unroll
    for (int s = 0; s < 4; ++s)
      ::wgmma::mma_ss_n32<0, 1>(pv, fw::k_along_columns(p_tile, s), fw::k_along_rows(v_tile, s, 64 * g), s > 0);
    fw::commit();
  }
  // The chunk's end: the next chunk's copy, then O_g = acc_hi + acc_lo + pv staged over V's half g
  // (v_bytes: the slot's V tile) and stored to o (the chunk's first row), columns col0 on.
  // qk_free() runs once every warp's Q S and update are in (the slot's Q and K read by nothing
  // more). kPublish: false where nothing was issued (kLoadsOnly).
  // A warp's wait covers its own 16 rows of a product: the other warps' parts may still read the
  // copy or V's half, so each overwrite waits for the group's barrier.
  template <bool kPublish = true, typename QkFree>
  __device__ __forceinline__ void finish(const float (&acc)[32], const float (&pv)[16], unsigned char* v_bytes,
                                         __nv_bfloat16* o, int64_t col0, QkFree&& qk_free) {
    fw::wait<1>();  // Q S and the update in: the next chunk's copy
    fw::named_sync(kGroupBarrier + g, fw::kThreads);  // every warp's Q S has read the copy
    qk_free();
    if constexpr (kPublish) publish_copy(copy, state);
    fw::fence_shared_writes();
    fw::wait<0>();
    // every warp's update and P V have read V's half g, and the copy is whole before the next Q S
    fw::named_sync(kGroupBarrier + g, fw::kThreads);
    float o_g[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) o_g[i] = acc[16 + i] + (acc[i] + pv[i]);  // (lo, the small terms, last)
    store_outputs(o_g, v_bytes, g, o, col0);
  }
};
#endif

// kReverse: time walked backward with the mask t <= s kept (the shape of the backward's dk and dv
// passes: out[t] = sum over s >= t), the chunks from the last to the first.
template <bool kReverse, int kSchedule>
__global__ void __launch_bounds__(kBlockThreads, 1)
    product_kernel(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v, __nv_bfloat16* o,
                   int64_t L) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t base = fw::smem_address(smem);
  const int64_t pair = blockIdx.x / kAtoms, col_tile = blockIdx.x % kAtoms;  // a pair's tiles run together (L2)
  const int64_t pair_offset = pair * L * kWidth;
  const int64_t chunks = L / fw::C;
  const int64_t first = kReverse ? L - fw::C : 0;                            // the first chunk's first row
  auto chunk_of = [&](int64_t it) { return kReverse ? chunks - 1 - it : it; };  // walk step it's chunk
  auto tile = [&](int slot, int which) { return base + uint32_t(slot * kSlotTiles + which) * fw::kTile; };
  auto scores_tile = [&](int64_t it) { return base + uint32_t(kScoresAt + int(it % kDepth)) * fw::kTile; };
  const int group = fw::warpgroup();

  if (group == 2) {  // the producer: Q, K and V's tile staged, then P
    const fw::Stager stage(int(threadIdx.x % fw::kThreads));
    fw::Source q_src = stage.source(Rows{q + pair_offset, kWidth}, first, kWidth);
    fw::Source k_src = stage.source(Rows{k + pair_offset, kWidth}, first, kWidth);
    fw::Source v_src = stage.source(Rows{v + pair_offset, kWidth}, first, kWidth, 64 * col_tile);
    // chunk it's copies (none past the last chunk; kComputeOnly: none after the first kDepth, the
    // slots' data reused), Q and K's apart from V's tile's; then one cp.async group a chunk
    auto copies = [&](int64_t it) { return it < chunks && !(kSchedule == kComputeOnly && it >= kDepth); };
    auto stage_qk = [&](int64_t it, int slot) {
      if (!copies(it)) return;
      stage.operator()<kReverse, kAtoms>(tile(slot, 0), q_src, q, fw::C);
      stage.operator()<kReverse, kAtoms>(tile(slot, kAtoms), k_src, k, fw::C);
    };
    auto stage_v = [&](int64_t it, int slot) {
      if (copies(it)) stage.operator()<kReverse, 1>(tile(slot, 2 * kAtoms), v_src, v, fw::C);
      fw::StageRing<kDepth>::commit_copies();  // (empty where nothing was staged: the count in flight holds)
    };
    constexpr bool kSplitRelease = kSchedule == kEarlyRelease || kSchedule == kEarlyStage;
    // fw::ProducedRing::produce's walk (kDepth = 2: one chunk staged ahead), announcing each chunk
    // to each group on its own barrier where the schedule asks
    stage_qk(0, 0);
    stage_v(0, 0);
    for (int64_t it = 0; it < chunks; ++it) {
      const int slot = int(it % kDepth), refill = int((it + 1) % kDepth);
      producer_copies_landed(kLandedBarrier);  // chunk it
      // chunk it - 1's slot takes chunk it + 1 once both groups are done with it (kSplitRelease: its
      // Q and K, then its V); kEarlyStage: Q and K's copies issued before chunk it's scores
      const bool refills = it > 0 && it + 1 < chunks;
      if constexpr (kSchedule == kEarlyStage) {
        if (refills) fw::named_sync(kEmpty + refill, kBlockThreads);
        stage_qk(it + 1, refill);
      }
      // (P's tile it % 2 was last read by chunk it - 2's P V, released before chunk it's V was staged)
      if constexpr (kSchedule != kLoadsOnly) fw::make_masked_scores<false, kAtoms, kReverse>(tile(slot, 0), tile(slot, kAtoms), scores_tile(it));
      if constexpr (kSchedule == kOwnFull || kSchedule == kPingPong) {
        fw::named_arrive(kFull + slot, kPairThreads);
        fw::named_arrive(kFull + kDepth + slot, kPairThreads);
      } else {
        fw::named_arrive(kFull + slot, kBlockThreads);
      }
      if constexpr (kSchedule != kEarlyStage) {
        if (refills) fw::named_sync(kEmpty + refill, kBlockThreads);
        stage_qk(it + 1, refill);
      }
      if (kSplitRelease && refills) fw::named_sync(kEmptyV + refill, kBlockThreads);
      stage_v(it + 1, refill);
    }
    return;
  }

  // a consumer group: columns 32 group on of the tile
  Group consumer(group, base + uint32_t(kCopyAt + kAtoms * group) * fw::kTile);
  __nv_bfloat16* const out = o + pair_offset;
  const int64_t col0 = 64 * col_tile + 32 * group;
  constexpr bool kSplitRelease = kSchedule == kEarlyRelease || kSchedule == kEarlyStage;
  if (kSchedule == kPingPong && group == 1 && chunks > 0) fw::named_arrive(kTurn, kPairThreads);  // group 0 first
  for (int64_t it = 0; it < chunks; ++it) {
    const int slot = int(it % kDepth);
    if constexpr (kSchedule == kOwnFull || kSchedule == kPingPong) {  // chunk it's Q, K, V and P
      fw::named_sync(kFull + kDepth * group + slot, kPairThreads);
    } else {
      fw::named_sync(kFull + slot, kBlockThreads);
    }
    if constexpr (kSchedule == kPingPong) fw::named_sync(kTurn + group, kPairThreads);  // the other has issued
    const uint32_t v_tile = tile(slot, 2 * kAtoms);
    float acc[32], pv[16];
    if constexpr (kSchedule == kLoadsOnly) {
#pragma unroll
      for (int i = 0; i < 32; ++i) acc[i] = 0.f;
#pragma unroll
      for (int i = 0; i < 16; ++i) pv[i] = 0.f;
    } else {
      consumer.issue(acc, pv, tile(slot, 0), tile(slot, kAtoms), v_tile, scores_tile(it));
    }
    // the other group's turn (group 1's last turn hands nothing on: each turn barrier met as often
    // by its syncs as by its arrivals)
    if (kSchedule == kPingPong && (group == 0 || it + 1 < chunks)) fw::named_arrive(kTurn + 1 - group, kPairThreads);
    consumer.finish<kSchedule != kLoadsOnly>(acc, pv, smem + (v_tile - base), out + chunk_of(it) * fw::C * kWidth,
                                             col0, [&] {
      if (kSplitRelease && it + kDepth < chunks) fw::named_arrive(kEmpty + slot, kBlockThreads);  // Q, K
    });
    if (it + kDepth < chunks) fw::named_arrive((kSplitRelease ? kEmptyV : kEmpty) + slot, kBlockThreads);
  }
#endif
}

template <bool kReverse, int kSchedule>
void launch(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& o) {
  static bool configured = false;
  if (!configured) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(product_kernel<kReverse, kSchedule>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    configured = true;
  }
  auto bf16 = [](const torch::Tensor& t) { return reinterpret_cast<const __nv_bfloat16*>(t.data_ptr()); };
  const unsigned blocks = unsigned(q.size(0) * q.size(1) * kAtoms);
  product_kernel<kReverse, kSchedule><<<blocks, kBlockThreads, kSmemBytes, c10::cuda::getCurrentCUDAStream()>>>(
      bf16(q), bf16(k), bf16(v), reinterpret_cast<__nv_bfloat16*>(o.data_ptr()), q.size(2));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// schedule: Schedule (the reverse direction with kEarlyStage alone)
torch::Tensor forward(torch::Tensor q, torch::Tensor k, torch::Tensor v, bool reverse, int64_t schedule) {
  check_inputs(q, k, v);
  TORCH_CHECK(0 <= schedule && schedule <= kComputeOnly && (!reverse || schedule == kEarlyStage),
              "columns256: schedule 0 to 6 (reversed: 4), got ", schedule);
  using Launch = void (*)(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, torch::Tensor&);
  static constexpr Launch kForward[] = {launch<false, kShared>,       launch<false, kOwnFull>,
                                        launch<false, kPingPong>,     launch<false, kEarlyRelease>,
                                        launch<false, kEarlyStage>,   launch<false, kLoadsOnly>,
                                        launch<false, kComputeOnly>};
  static_assert(sizeof(kForward) / sizeof(Launch) == kComputeOnly + 1, "one launch a schedule, in order");
  auto o = torch::empty_like(q);
  (reverse ? launch<true, kEarlyStage> : kForward[schedule])(q, k, v, o);
  return o;
}

// ---- The same forward with q and k multicast in clusters of two column tiles (kShared's order) ----
//
// Each chunk a block reads 72 KB (q and k whole, V's tile) and the four column tiles of a pair
// read the same q and k: about 9.5 MB a chunk over 132 blocks from the L2. Here the column tiles
// 2c and 2c + 1 of a pair form a cluster; each block's one producer thread loads two of the four
// atoms of q and of k with the bulk tensor copy (TMA, the 128-byte swizzle the tiles already
// have) multicast into both blocks, and its own V tile: 40 KB a chunk a block from the L2. A
// slot's full mbarrier (each block's own) counts the bytes that land in it; its empty mbarrier
// takes both blocks' consumer groups' releases (4), since either block's copies write into both.
// Clusters of two blocks of this size keep all 132 multiprocessors (benchmarks/cluster_probe.py).
// Forward only; q, k, v as the other kernel takes them.
namespace cluster {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // (where wgmma_tf32_product.cuh defines them)
using fast_causal_attn::cuda::wgmma_tf32::mbarrier_init;
using fast_causal_attn::cuda::wgmma_tf32::mbarrier_wait;
#endif

constexpr int kBarriersAt = columns256::kSmemBytes;  // full[kDepth], then empty[kDepth], 8 bytes each
constexpr int kSmemBytes = kBarriersAt + 2 * kDepth * 8;
static_assert(kSmemBytes <= 227 * 1024, "shared memory of one block");
constexpr uint32_t kChunkBytes = (2 * kAtoms + 1) * fw::kTile;  // what lands in a block's slot a chunk

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void expect_bytes(uint32_t bar, uint32_t bytes) {  // this thread's arrival
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void arrive_in(uint32_t bar, uint32_t rank) {  // on block `rank`'s barrier
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(bar), "r"(rank));
  // (the default .release.cta, as CUTLASS's ClusterBarrier::arrive: .release.cluster made a
  // MEMBAR.ALL.GPU, which waits for this thread's output stores)
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(remote) : "memory");
}
// A 64 x 64 box of `map` (column c0, row r0) into `tile` of every block in `mask`, or of this
// block alone (mask 0), counted on `bar` at the same offset in each.
__device__ __forceinline__ void load_box(uint32_t tile, const CUtensorMap* map, int c0, int r0, uint32_t bar,
                                         uint16_t mask) {
  if (mask != 0) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(tile),
        "l"(map), "r"(c0), "r"(r0), "r"(bar), "h"(mask)
        : "memory");
  } else {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(tile),
        "l"(map), "r"(c0), "r"(r0), "r"(bar)
        : "memory");
  }
}

__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(kBlockThreads, 1)
    product_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                   const __grid_constant__ CUtensorMap v_map, __nv_bfloat16* o, int64_t L) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t base = fw::smem_address(smem);
  const int64_t pair = blockIdx.x / kAtoms, col_tile = blockIdx.x % kAtoms;
  const int64_t chunks = L / fw::C;
  const uint32_t rank = cluster_rank();  // col_tile % 2
  auto tile = [&](int slot, int which) { return base + uint32_t(slot * kSlotTiles + which) * fw::kTile; };
  auto scores_tile = [&](int64_t it) { return base + uint32_t(kScoresAt + int(it % kDepth)) * fw::kTile; };
  auto full = [&](int slot) { return base + uint32_t(kBarriersAt + 8 * slot); };
  auto empty = [&](int slot) { return base + uint32_t(kBarriersAt + 8 * (kDepth + slot)); };
  const int group = fw::warpgroup();
  if (threadIdx.x == 0) {
    for (int s = 0; s < kDepth; ++s) {
      mbarrier_init(full(s), 1);      // the producer's expect_bytes, then the bytes
      mbarrier_init(empty(s), 2 * 2);  // both blocks' two consumer groups
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  cluster_sync();  // both blocks' barriers initialized before either block's copies or releases

  if (group == 2) {  // the producer: thread 0 issues the copies; all of it make P
    const bool issues = threadIdx.x % fw::kThreads == 0;
    auto stage_chunk = [&](int64_t it, int slot) {  // (it < chunks)
      const int row = int(pair * L + it * fw::C);
      expect_bytes(full(slot), kChunkBytes);
#pragma unroll
      for (int a = 2 * int(rank); a < 2 * int(rank) + 2; ++a) {  // this block's two atoms of q and of k, to both
        load_box(tile(slot, a), &q_map, 64 * a, row, full(slot), 0b11);
        load_box(tile(slot, kAtoms + a), &k_map, 64 * a, row, full(slot), 0b11);
      }
      load_box(tile(slot, 2 * kAtoms), &v_map, int(64 * col_tile), row, full(slot), 0);
    };
    if (issues) {
      for (int64_t it = 0; it < kDepth && it < chunks; ++it) stage_chunk(it, int(it));
    }
    for (int64_t it = 0; it < chunks; ++it) {
      const int slot = int(it % kDepth), refill = int((it + 1) % kDepth);
      mbarrier_wait(full(slot), uint32_t(it / kDepth) & 1u);  // chunk it landed (this block's and the other's copies)
      fw::make_masked_scores<false, kAtoms, false>(tile(slot, 0), tile(slot, kAtoms), scores_tile(it));
      fw::named_arrive(kFull + slot, kBlockThreads);
      // chunk it - 1's slot takes chunk it + 1 once both blocks' consumers are done with it
      if (issues && it > 0 && it + 1 < chunks) {
        mbarrier_wait(empty(refill), uint32_t((it - 1) / kDepth) & 1u);
        stage_chunk(it + 1, refill);
      }
    }
  } else {
    Group consumer(group, base + uint32_t(kCopyAt + kAtoms * group) * fw::kTile);
    __nv_bfloat16* const out = o + pair * L * kWidth;
    const int64_t col0 = 64 * col_tile + 32 * group;
    for (int64_t it = 0; it < chunks; ++it) {
      const int slot = int(it % kDepth);
      mbarrier_wait(full(slot), uint32_t(it / kDepth) & 1u);  // the copies' bytes, seen by this thread
      fw::named_sync(kFull + slot, kBlockThreads);        // and P
      const uint32_t v_tile = tile(slot, 2 * kAtoms);
      float acc[32], pv[16];
      consumer.issue(acc, pv, tile(slot, 0), tile(slot, kAtoms), v_tile, scores_tile(it));
      consumer.finish(acc, pv, smem + (v_tile - base), out + it * fw::C * kWidth, col0, [] {});
      // the slot free in both blocks' eyes (the staging's generic writes ordered before the next
      // copies' async ones)
      if (it + kDepth < chunks) {
        fw::fence_shared_writes();
        fw::named_sync(kGroupBarrier + group, fw::kThreads);
        if (threadIdx.x % fw::kThreads == 0) {
          arrive_in(empty(slot), 0);
          arrive_in(empty(slot), 1);
        }
      }
    }
  }
  cluster_sync();  // neither block ends while the other's copies or releases may still reach it
#endif
}

// A [rows, 256] bfloat16 tensor map over `t` (contiguous [B, H, L, 256]) in 64 x 64 boxes with the
// 128-byte swizzle (the staged tiles' layout).
CUtensorMap tensor_map(const torch::Tensor& t) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
    TORCH_CHECK(found == cudaDriverEntryPointSuccess && fn != nullptr, "columns256: no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  CUtensorMap map;
  const cuuint64_t dims[2] = {cuuint64_t(kWidth), cuuint64_t(t.numel() / kWidth)};
  const cuuint64_t strides[1] = {cuuint64_t(kWidth * 2)};  // bytes between rows
  const cuuint32_t box[2] = {64, 64}, element_strides[2] = {1, 1};
  const CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, t.data_ptr(), dims, strides, box,
                            element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(r == CUDA_SUCCESS, "columns256: cuTensorMapEncodeTiled failed (", int(r), ")");
  return map;
}

}  // namespace cluster

torch::Tensor forward_cluster(torch::Tensor q, torch::Tensor k, torch::Tensor v) {
  check_inputs(q, k, v);
  static bool configured = false;
  if (!configured) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(cluster::product_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        cluster::kSmemBytes));
    configured = true;
  }
  auto o = torch::empty_like(q);
  const unsigned blocks = unsigned(q.size(0) * q.size(1) * kAtoms);  // (a multiple of the cluster's 2)
  cluster::product_kernel<<<blocks, kBlockThreads, cluster::kSmemBytes, c10::cuda::getCurrentCUDAStream()>>>(
      cluster::tensor_map(q), cluster::tensor_map(k), cluster::tensor_map(v),
      reinterpret_cast<__nv_bfloat16*>(o.data_ptr()), q.size(2));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return o;
}

}  // namespace columns256

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &columns256::forward);
  m.def("forward_cluster", &columns256::forward_cluster);
}
