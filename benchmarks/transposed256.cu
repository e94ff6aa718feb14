// A prototype of the E = M = 256 forward with the state kept transposed in registers (RESULTS.md,
// eighty-sixth session), to measure before any change to wgmma_product_kernel: bfloat16 (and
// float16, below), the inputs of benchmarks/columns256.cu (columns256.cuh), one block a (batch, head, 128-column tile
// of V and O) walking all of L, forward or (kReverse) backward with the mask t <= s.
//
// Why: the column-halves prototype (columns256.cu) measured its products alone at 0.144 ms and its
// loads alone at 0.122 at 4,16,2048,256 (H100, eighty-sixth session): its consumers' chain bounds
// it. Each chunk a group there rounds its state into a two-part bfloat16 copy in shared memory
// (208 of its 493 instructions), waits for it, and multiplies Q by it from shared memory at N = 32.
// Here consumer group g keeps S_g^T (64 columns of V by E = 256: four m64n64 accumulators, 128
// registers a thread) and multiplies it as wgmma's register A operand, rounded in registers:
//
//   O_g^T  = S_g^T [Q^T]          hi and lo parts of S_g^T as A fragments, 32 m64n64k16 (B = the
//                                 staged Q, K-major: as the scores' B)
//   S_g^T += V_g^T K              16 m64n64k16 (A = V's 64-column tile g, MN-major; B = K's
//                                 atoms, MN-major: the library's update with the roles swapped)
//   O_g^T += V_g^T P^T            4 m64n64k16 (B = the producer's P, K-major)
//
// and O_g^T goes out transposed through stmatrix .trans into a staging tile. No copy, no wait for
// one, every product at N = 64; a block covers 128 columns, so q and k are read by two column
// tiles of a pair, not four, and the producer's scores serve twice the columns. A chunk: 120
// m64n64k16 a block (104 the groups', 16 the scores) for 128 columns, against 68 for 64 in the
// column halves. The cost: 128 + 32 + 32 registers of state, output and fragments a consumer
// thread (setmaxnreg: 216 each, the producer 72).
// Shared memory: two stage slots of Q (4 tiles), K (4) and V's two 64-column tiles, 160 KB; P's
// ring, 16 KB; a staging tile a group, 16 KB: 192 KB.
// float16 (kHalf, written after the bfloat16 form ran): the copy in one part (16 products, not 32),
// each row of S_g^T scaled by a power of two into float16's range (row_factors) and O_g^T's rows
// scaled back before P V's products join them (a wait more a chunk), as the library's float16
// state copy is one part scaled by its warp's largest entry.
// Its register helpers (the state's fragments, float16's row factors; stmatrix .trans) are the
// library's since its form there merged (csrc/cuda/wgmma_transposed.cuh): the same SASS.
#include "columns256.cuh"
#include "wgmma_transposed.cuh"  // the state's fragments, float16's row factors

namespace transposed256 {

using namespace columns256;
namespace wt = fast_causal_attn::cuda::wgmma_transposed;  // (the library's form of this prototype)

constexpr int kColumns = 128;                  // a block's columns of V and O (two groups of 64)
constexpr int kDepth = 2;                      // stage slots
constexpr int kSlotTiles = 2 * kAtoms + 2;     // Q's atoms, K's atoms, V's two tiles
constexpr int kScoresAt = kDepth * kSlotTiles;  // P's ring: chunk it's P at kScoresAt + it % kDepth
constexpr int kStagingAt = kScoresAt + kDepth;  // group g's output staging tile at kStagingAt + g
constexpr int kSmemBytes = (kStagingAt + 2) * fw::kTile;
static_assert(kSmemBytes <= 227 * 1024, "shared memory of one block");
constexpr int kBlockThreads = 3 * fw::kThreads;  // two consumer groups, then the producer
// the registers a thread after setmaxnreg (the launch's 168 a thread given from the producer to
// the consumers: 2 x 216 + 72 = 3 x 168)
constexpr int kProducerRegisters = 72, kConsumerRegisters = 216;
static_assert(2 * kConsumerRegisters + kProducerRegisters <= 3 * (65536 / kBlockThreads / 8 * 8), "registers");
// named barriers: 0 is __syncthreads; the ring's full ones (kFull + slot: the producer arrives,
// both groups sync) and empty ones (kEmpty + slot: the groups arrive, the producer syncs); each
// group's own; the producer's (its copies landed, before the scores)
constexpr int kFull = 1, kEmpty = kFull + kDepth, kGroupBarrier = kEmpty + kDepth, kLandedBarrier = kGroupBarrier + 2;
static_assert(kLandedBarrier < 16, "named barriers");

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// O_g^T (rows m = 64 g + 16 warp + g' (+8) of the block's columns, columns t = 8 j + 2 q (+1) of
// the chunk) rounded and stored transposed into the group's staging tile (row t, its 64 columns m
// in the 128-byte swizzle), then, once the group's warps have all stored, written out 16 bytes a
// lane to o's 64 rows (o: the chunk's first row, the group's first column).
// The group's barrier before (the previous chunk's reads of the tile done) and after.
template <bool kHalf>
__device__ __forceinline__ void store_outputs(const float (&out)[32], uint32_t staging, const unsigned char* staged,
                                              int group, uint16_t* o) {
  const int warp = fw::group_warp(), lane = threadIdx.x % kWarp, r = lane % 8, i = lane / 8;
  fw::named_sync(kGroupBarrier + group, fw::kThreads);
#pragma unroll
  for (int k = 0; k < 4; ++k) {  // n-tiles 2 k, 2 k + 1: rows t = 16 k + 8 (i / 2) + r, column group 2 warp + i % 2
    uint32_t x[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) x[m] = fw::pack<kHalf>(out[fw::matrix_pair(k, m)], out[fw::matrix_pair(k, m) + 1]);
    const int t = 16 * k + 8 * (i / 2) + r;
    fw::store_matrices<true>(staging + t * 128 + (((2 * warp + i % 2) ^ r) * 16), x);
  }
  fw::named_sync(kGroupBarrier + group, fw::kThreads);
  const int tid = threadIdx.x % fw::kThreads;
#pragma unroll
  for (int n = 0; n < 4; ++n) {  // 64 rows x 8 groups of 8 columns, 8 lanes a row
    const int piece = tid + fw::kThreads * n, t = piece / 8, c = piece % 8;
    const uint4 x = *reinterpret_cast<const uint4*>(staged + t * 128 + ((c ^ (t % 8)) * 16));
    *reinterpret_cast<uint4*>(o + t * kWidth + 8 * c) = x;
  }
}
#endif

// kHalf: float16 (the state's copy in one part, its rows scaled: row_factors), else bfloat16
template <bool kHalf, bool kReverse>
__global__ void __launch_bounds__(kBlockThreads, 1)
    product_kernel(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* o, int64_t L) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t base = fw::smem_address(smem);
  constexpr int kTiles = kWidth / kColumns;
  const int64_t pair = blockIdx.x / kTiles, col_tile = blockIdx.x % kTiles;  // a pair's tiles run together (L2)
  const int64_t pair_offset = pair * L * kWidth;
  const int64_t chunks = L / fw::C;
  const int64_t first = kReverse ? L - fw::C : 0;                            // the first chunk's first row
  auto tile = [&](int slot, int which) { return base + uint32_t(slot * kSlotTiles + which) * fw::kTile; };
  auto scores_tile = [&](int64_t it) { return base + uint32_t(kScoresAt + int(it % kDepth)) * fw::kTile; };
  const int group = fw::warpgroup();

  if (group == 2) {  // the producer: Q, K and V's two tiles staged, then P
    fw::registers_down_to<kProducerRegisters>();
    const fw::Stager stage(int(threadIdx.x % fw::kThreads));
    fw::Source q_src = stage.source(Rows{q + pair_offset, kWidth}, first, kWidth);
    fw::Source k_src = stage.source(Rows{k + pair_offset, kWidth}, first, kWidth);
    fw::Source v_src = stage.source(Rows{v + pair_offset, kWidth}, first, kWidth, kColumns * col_tile);
    auto stage_chunk = [&](int64_t it, int slot) {  // one cp.async group a chunk (empty past the last)
      if (it < chunks) {
        stage.operator()<kReverse, kAtoms>(tile(slot, 0), q_src, q, fw::C);
        stage.operator()<kReverse, kAtoms>(tile(slot, kAtoms), k_src, k, fw::C);
        stage.operator()<kReverse, 2>(tile(slot, 2 * kAtoms), v_src, v, fw::C);
      }
      fw::StageRing<kDepth>::commit_copies();
    };
    // fw::ProducedRing::produce's walk (kDepth = 2: one chunk staged ahead), as columns256's kShared
    stage_chunk(0, 0);
    for (int64_t it = 0; it < chunks; ++it) {
      const int slot = int(it % kDepth), refill = int((it + 1) % kDepth);
      producer_copies_landed(kLandedBarrier);  // chunk it
      // (P's tile it % 2 was last read by chunk it - 2's products, released before chunk it was staged)
      fw::make_masked_scores<kHalf, kAtoms, kReverse>(tile(slot, 0), tile(slot, kAtoms), scores_tile(it));
      fw::named_arrive(kFull + slot, kBlockThreads);
      // chunk it - 1's slot takes chunk it + 1 once both groups are done with it
      if (it > 0 && it + 1 < chunks) fw::named_sync(kEmpty + refill, kBlockThreads);
      stage_chunk(it + 1, refill);
    }
    return;
  }

  // a consumer group: columns 64 group on of the block's tile; S_g^T by atoms of E
  fw::registers_up_to<kConsumerRegisters>();
  float state[kAtoms][32];
#pragma unroll
  for (int a = 0; a < kAtoms; ++a)
#pragma unroll
    for (int i = 0; i < 32; ++i) state[a][i] = 0.f;
  const uint32_t staging = base + uint32_t(kStagingAt + group) * fw::kTile;
  // (this group's columns of the pair's outputs; 32-bit counts and offsets within the pair: the
  // consumers' registers are what the state leaves, launch checks L * 256 < 2^31)
  uint16_t* const out = o + pair_offset + kColumns * col_tile + 64 * group;
  const int n_chunks = int(chunks);
  for (int it = 0; it < n_chunks; ++it) {
    const int slot = int(it % kDepth);
    fw::named_sync(kFull + slot, kBlockThreads);  // chunk it's Q, K, V and P
    const uint32_t q_tile = tile(slot, 0), k_tile = tile(slot, kAtoms), v_tile = tile(slot, 2 * kAtoms + group);
    float acc[32];  // O_g^T
    float factor[2], inverse[2];  // (kHalf) the rows' scales
    if constexpr (kHalf) wt::row_factors(state, factor, inverse);
    // a k16 step of E at a time: its fragments (once the last step's products have read theirs),
    // O^T += its parts times Q^T; after an atom's last, its update (its accumulators free again by
    // the next chunk's wait)
#pragma unroll
    for (int step = 0; step < 4 * kAtoms; ++step) {
      const int a = step / 4, s = step % 4;
      if (step > 0) {  // the last step's products done (an update after them may run on)
        if (s == 0) fw::wait<1>(); else fw::wait<0>();
      }
      const uint64_t b = fw::k_along_columns(q_tile + a * fw::kTile, s);
      if constexpr (kHalf) {  // one part, the rows scaled
        uint32_t hi[4];
        wt::scaled_fragments(state[a], s, factor, hi);
        fw::fence();
        fw::mma_rs<true, 0>(acc, hi, b, step > 0);
      } else {
        uint32_t hi[4], lo[4];
        wt::state_fragments(state[a], s, hi, lo);
        fw::fence();
        fw::mma_rs<false, 0>(acc, lo, b, step > 0);  // (the small terms first)
        fw::mma_rs<false, 0>(acc, hi, b);
      }
      fw::commit();
      if (s == 3) {
        fw::add_bt_times_c<kHalf>(state[a], v_tile, k_tile + a * fw::kTile);  // S_g^T += V_g^T K
        fw::commit();
      }
    }
    if constexpr (kHalf) {  // O_g^T's rows back from their scales (the last update may run on)
      fw::wait<1>();
#pragma unroll
      for (int i = 0; i < 32; ++i) acc[i] *= inverse[(i % 4) / 2];
      fw::fence();
    }
#pragma unroll
    for (int s = 0; s < 4; ++s)  // O_g^T += V_g^T P^T
      fw::mma_ss<kHalf, 1, 0>(acc, fw::k_along_rows(v_tile, s), fw::k_along_columns(scores_tile(it), s));
    fw::commit();
    fw::wait<0>();
    // the slot is read by nothing more of this warp's (the producer waits for every thread's arrival)
    if (it + kDepth < n_chunks) fw::named_arrive(kEmpty + slot, kBlockThreads);
    const int chunk = kReverse ? n_chunks - 1 - it : it;
    store_outputs<kHalf>(acc, staging, smem + (staging - base), group, out + chunk * (fw::C * kWidth));
  }
#endif
}

template <bool kHalf, bool kReverse>
void launch(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& o) {
  static bool configured = false;
  if (!configured) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(product_kernel<kHalf, kReverse>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        kSmemBytes));
    configured = true;
  }
  auto bits = [](const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); };
  const unsigned blocks = unsigned(q.size(0) * q.size(1) * (kWidth / kColumns));
  product_kernel<kHalf, kReverse><<<blocks, kBlockThreads, kSmemBytes, c10::cuda::getCurrentCUDAStream()>>>(
      bits(q), bits(k), bits(v), bits(o), q.size(2));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// bfloat16 or float16, forward or reversed
torch::Tensor forward(torch::Tensor q, torch::Tensor k, torch::Tensor v, bool reverse) {
  check_inputs(q, k, v, true);
  TORCH_CHECK(q.size(2) * kWidth < (int64_t(1) << 31), "transposed256: L * 256 below 2^31, got L = ", q.size(2));
  auto o = torch::empty_like(q);
  using Launch = void (*)(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, torch::Tensor&);
  static constexpr Launch kLaunches[2][2] = {{launch<false, false>, launch<false, true>},
                                             {launch<true, false>, launch<true, true>}};
  kLaunches[q.scalar_type() == torch::kHalf][reverse](q, k, v, o);
  return o;
}

}  // namespace transposed256

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("forward", &transposed256::forward); }
