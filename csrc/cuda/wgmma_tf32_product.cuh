// Every pass of float32 on Hopper's wgmma (sm_90a): the forward and dq, and dk and dv as two
// reverse passes (where run_grad_kv takes them), in 3xTF32 (float32-accurate; the heads alone
// where the user allowed TF32, KernelParams::tf32), without normalize: wgmma_product.cuh's
// products, per chunk of C = 64 timesteps
//
//   scores = A B^T,  out = A S + mask(scores) Cc,  S += B^T Cc
//
// in 96 m64n64k8 instructions where the mma.sync kernel issues about 1500 and their loads (H200,
// 8,16,2048,64 forward kernel: 0.133 ms against the mma.sync kernel's 0.199; RESULTS.md, nineteenth
// session). One block a (sequence, head, time segment), three warpgroups: a producer that stages
// the chunks and writes the operands below, two consumers that run the products of alternate
// chunks (see the kernel).
//
// TF32 wgmma reads its shared-memory operands K-major only (no transposed view, as 16-bit wgmma
// has), so each product takes its operands as follows:
//
//   A B^T     A: the staged tile's fragments in registers, split there; B: the staged tile
//             (K = Da along its columns)
//   A S       A: the same fragments, held since A B^T; B: the state's copy, written transposed
//             each chunk (S^T: rows m, K = e along them)
//   P Cc      A: the masked scores from their accumulators as they are (below);
//             B: Cc^T, written from the staged Cc each chunk (rows m, K = time along them)
//   B^T Cc    A: B^T's fragments, read transposed from the staged B into registers and split
//             there; B: Cc^T
//
// The two products over time take their K axis in a k-step order of their own: within each k8
// step, k position p holds timestep 2 (p % 4) + p / 4 (timestep t at k_position(t) = t / 2 + 4
// (t % 2)), in Cc^T as the producer writes it and in the A fragments alike (a k-step's sum is the
// same sum in any order of its terms). In that order a lane's P fragments are its own score
// accumulators (columns 2 q4 and 2 q4 + 1 of an n8 tile at k positions q4 and q4 + 4), where the
// natural order took two shuffles and six selects a pair of them, and B^T's transposed loads fall
// on 32 banks where they fell on 16 (the mma.sync kernel's float32 P takes the same order:
// tensorcore_product.cuh's score_as_a and load_b_after_scores).
//
// so every shared-memory operand is a tile the producer writes (or the state's copy). 3xTF32
// makes each product three: head x head + head x tail + tail x head (tail x tail dropped). A head
// is the float32 operand as it is (the tensor core ignores its 13 low bits: it truncates to TF32),
// a tail x - trunc(x) (exact in float32; tensorcore_product.cuh's split), written beside the
// staged tiles each chunk (B's tail, Cc^T's, S^T's) or kept in registers (A's, B^T's and P's). The kernel is bound by
// shared memory's bandwidth (H200 ncu, 1,16,32768,128: L1 76% busy, issue slots 25%, thirty-fifth
// session): A and B^T in registers spare their products' wgmma reads of them (48 KB a product) and
// the stores of three derived tiles (A's tail, B^T's head and tail: 48 KB a chunk).
//
// The tensor cores add into their accumulators without rounding to nearest: with S accumulated in
// them, the prototype's error grew with the chunks summed (1.6e-6 at L = 64, 2.2e-5 at 4097, H200,
// nineteenth session; the mma.sync kernel met the same, tensorcore_product.cuh). So each chunk's
// B^T Cc goes to fresh accumulators and is added to S in float32; S itself lives in shared memory
// (S^T's head is the float32 state), which keeps 32 registers free.
//
// Tiles are 64 x 64 float32 (16 KB) in wgmma's 128-byte swizzle: two atoms of 32 columns, 8 KB
// apart; element (r, c) of an atom at 128 r + 16 ((c / 4) ^ (r % 8)) + 4 (c % 4) bytes; a k8 step
// moves the start address 32 bytes. Shared memory: each consumer's chunk, A, B and Cc as staged
// by cp.async and its three derived tiles (96 KB), and S^T's two (32 KB): 224 KB, one block a
// multiprocessor.
//
// A block holds 64 of the state's rows (Da: a's and b's columns) and 64 of its columns (Dc). Wider
// states run in column tiles (each block its own outputs) and, up to 256 rows, in up to four row
// tiles: causal linear attention is a sum over the state's rows (O = sum over e of the products of
// q's and k's column e), so each row tile's block is a problem of its own, with its own part of
// the state. Row tiles 0 and 1 add their outputs into the zeroed output, 2 and 3 into a zeroed
// buffer that is added to it after the pass (atomics: 0 + x + y rounds as 0 + y + x, so each sum
// repeats bit for bit, where three or four addends in the order the blocks finish would not; they
// flush subnormal sums, below 1.2e-38, to zero). Tiles of the full 128 rows would not fit: 384 KB.
//
// Around the chunk loop everything is the 16-bit kernels' (chunked::BlockWork, Operands, segments
// and their scan, SegmentStart / SegmentEnd, launch_wgmma), so the two families plan and segment
// alike.
#pragma once

#include "wgmma_product.cuh"

namespace fast_causal_attn {
namespace cuda {
namespace wgmma_tf32 {

constexpr int C = 64;               // timesteps a chunk; the state's rows and columns, zero-padded
constexpr int kThreads = 128;       // a warpgroup (a block: two consumers' and the producer's)
constexpr int kConsumers = 2;       // consumer warpgroups, on alternate chunks
constexpr int kTile = 64 * 64 * 4;  // bytes of a 64 x 64 float32 tile (two 8 KB atoms)
// A consumer's set of tiles (consumer j's at j * kSetTiles on): its chunk as staged (A, B, Cc),
// B's tail, Cc^T's head and tail. Then the state's copy S^T, head and tail, which both read.
enum SetTile : int { kA, kB, kC, kBTail, kCtHead, kCtTail, kSetTiles };
enum Tiles : int { kStHead = kConsumers * kSetTiles, kStTail, kTileCount };
// After the tiles, the state's two hand-off mbarriers (consumer j waits on its own: see kFull).
constexpr size_t kHandOffs = size_t(kTileCount) * kTile;
constexpr size_t kSmemBytes = kHandOffs + kConsumers * sizeof(uint64_t);
static_assert(kSmemBytes <= 227 * 1024, "shared memory of one block");

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
using wgmma::descriptor;

// The byte offset of element (r, c) in a swizzled tile.
__device__ __forceinline__ uint32_t offset_of(int r, int c) {
  return uint32_t((c / 32) * 8192 + 128 * r + 16 * (((c % 32) / 4) ^ (r % 8)) + 4 * (c % 4));
}
// A tile's descriptor as a K-major operand (K along its columns), k8 step s from the tile's own
// (descriptor(tile + offset) = descriptor(tile) + offset / 16 below 256 KB: one add, where each
// descriptor built whole was about 20 uniform instructions a wgmma, a fifth of the kernel's).
__device__ __forceinline__ uint64_t k_step(uint64_t tile_descriptor, int s) {
  return tile_descriptor + uint64_t(((s / 4) * 8192 + 32 * (s % 4)) / 16);
}

// x's TF32 head and exact tail: tensorcore_product.cuh's split (why truncated, what it costs).
__device__ __forceinline__ void split(float x, uint32_t& head, uint32_t& tail) {
  tensorcore::MmaTraits<float>::split(x, head, tail);
}
__device__ __forceinline__ float tail_of(float x) {
  uint32_t head, tail;
  split(x, head, tail);
  return __uint_as_float(tail);
}

#define FCA_TF32_D32(d)                                                                                          \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),     \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),       \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),      \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define FCA_TF32_D32_LIST                                                                                   \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31}"
// d (64 x 64: wgmma_product.cuh's accumulator layout) += A B^T, k8, B K-major from shared memory,
// A from registers: a0 (row g, k q), a1 (g + 8, q), a2 (g, q + 4), a3 (g + 8, q + 4) of the warp's
// 16 rows (CUTLASS's ALayout_64x8); accumulate = false: d = A B^T.
__device__ __forceinline__ void mma_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t b, bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 " FCA_TF32_D32_LIST ", {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
      : FCA_TF32_D32(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate ? 1 : 0));
}
#undef FCA_TF32_D32
#undef FCA_TF32_D32_LIST

// at[0], at[1] += x, y as one vector reduction (red.global.add.v2.f32, sm_90): atomicAdd's float2
// form made its 64-bit address again before each one (11 instructions a reduction against a
// store's 3). Like atomicAdd on float, it flushes subnormal sums to zero.
__device__ __forceinline__ void add_pair(float* at, float x, float y) {
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(at), "f"(x), "f"(y) : "memory");
}

// An A operand in registers, K = 64 (eight k8 steps), split into heads and tails.
struct SplitFragments {
  uint32_t head[8][4], tail[8][4];
  __device__ __forceinline__ void set(int s, int r, float x) { split(x, head[s][r], tail[s][r]); }
};

// d (+)= A B^T over K = 64, B a K-major tile (its head) with its tail `b_tail` (kTile bytes on
// where the caller wrote it), A in registers (RegisterOperand: its heads and tails).
// Per k8 step the small terms first (the accumulators truncate); kSplit = false: the heads alone.
template <bool kSplit, typename A>
__device__ __forceinline__ void times(float (&d)[32], const A& a, uint32_t b_head_tile, uint32_t b_tail_tile,
                                      bool accumulate) {
  const uint64_t b_head = descriptor(b_head_tile), b_tail = descriptor(b_tail_tile);
#pragma unroll
  for (int s = 0; s < 8; ++s) {
    const bool first = !accumulate && s == 0;
    if constexpr (kSplit) {
      a.tail_times(d, s, k_step(b_head, s), !first);
      a.head_times(d, s, k_step(b_tail, s), true);
    }
    a.head_times(d, s, k_step(b_head, s), kSplit || !first);
  }
}
struct RegisterOperand {  // A from registers
  const SplitFragments& f;
  __device__ void head_times(float (&d)[32], int s, uint64_t b, bool acc) const { mma_rs(d, f.head[s], b, acc); }
  __device__ void tail_times(float (&d)[32], int s, uint64_t b, bool acc) const { mma_rs(d, f.tail[s], b, acc); }
};

// Named barriers (0 is __syncthreads), each of two warpgroups (one arrives, the other waits)
// unless kOwn: kFull + j, the producer's announcement that consumer j's set holds its next chunk;
// kCopied + j, consumer j's that it has read the chunk's staged A and B (the producer may copy
// the next chunk over them); kFree + j, that it has run the products that read the derived tiles
// (the producer may write the next chunk's); kOwn + w, warpgroup w's own (w = kConsumers: the
// producer). The state passes from one consumer to the
// other through an mbarrier instead (each thread's arrive a release of its own writes, the
// waiter's an acquire): across bar.arrive and bar.sync racecheck took the threads' reads and
// writes of S for races.
enum Barrier : int {
  kFull = 1,
  kCopied = kFull + kConsumers,
  kFree = kCopied + kConsumers,
  kOwn = kFree + kConsumers
};
static_assert(kOwn + kConsumers < 16, "named barriers of a block");
__device__ __forceinline__ void named_sync(int id, int threads = 2 * kThreads) { wgmma::named_sync(id, threads); }
__device__ __forceinline__ void named_arrive(int id, int threads = 2 * kThreads) { wgmma::named_arrive(id, threads); }
__device__ __forceinline__ void mbarrier_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// One operand's rows as this thread copies them (Stager): the next chunk's first row of this
// thread's pieces, the step between them (8 rows), and whether its columns lie inside the operand.
struct Source {
  const float* next;
  int64_t piece_step;
  bool inside;
};

// This thread's 16-byte pieces of a staged tile: columns 4 (tid % 16) on, rows tid / 16 + 8 i
// (i < 8); sixteen lanes copy one 256-byte row (eight to an atom's 128-byte row, whole lines to
// the L2, as wgmma_product.cuh's Stager). Rows past the chunk and columns past the operand's width
// (a multiple of 4: wgmma_takes) are zeros. Every row is 16-byte vectors (launch_wgmma checks;
// the ops copy rows off 16-byte boundaries into aligned ones).
struct Stager {
  int row0, col;
  uint32_t piece0;  // row0's piece in a tile; piece i (8 rows on: the same row % 8) at + 1024 i
  __device__ explicit Stager(int tid) : row0(tid / 16), col(4 * (tid % 16)) {
    piece0 = uint32_t((col / 32) * 8192 + 128 * row0 + 16 * (((col % 32) / 4) ^ row0));
  }
  template <typename Rows>
  __device__ Source source(const Rows& x, int64_t first, int64_t width, int64_t col0 = 0) const {
    const bool inside = col0 + col < width;
    return Source{x.ptr + (first + row0) * x.stride + col0 + (inside ? col : 0), 8 * x.stride, inside};
  }
  // The chunk of n rows at src.next into `tile` as cp.async copies, zeros past n; `any`: a valid
  // address of the operand (the zero copies' source). Then src steps a chunk on (back: kBack).
  template <bool kBack>
  __device__ __forceinline__ void operator()(uint32_t tile, Source& src, const float* any, int n) const {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const bool valid = src.inside && row0 + 8 * i < n;
      wgmma::copy_16(tile + piece0 + 1024 * i, valid ? src.next + i * src.piece_step : any, valid);
    }
    src.next += kBack ? -8 * src.piece_step : 8 * src.piece_step;
  }
};
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace wgmma_tf32

// One pass of float32 (wgmma_takes): one block a (sequence, head, time segment), from the
// segment's start (dk and dv: from its end, time walked backward, the scores' mask c >= r);
// state-only blocks (launch_segmented's first launch) sum their segment's B^T Cc alone. Da and Dc
// up to 256: the block's row tile from work.k0, its column tile from work.m0 (see the file's
// comment). kSplit: 3xTF32; without, the heads alone (TF32, where the user allowed it:
// KernelParams::tf32; a runtime switch between the products made ptxas wait for the accumulators
// between every two).
//
// Three warpgroups with their own roles: two consumers on alternate chunks (consumer j on chunks
// j, j + 2, ...) and a producer. One consumer on every chunk (to main 8f0f624) ran its ALU work
// and its products one after the other: about 8300 cycles a chunk against 3072 for its wgmma
// (H200 ncu, 8,16,2048,128, thirty-eighth session). Two let one consumer's loads, splits, P and
// state update run while the other's products keep the tensor cores busy (that pass 550 -> 415
// us; fwd+bwd 11-13% faster at every shape: RESULTS.md, thirty-ninth session).
//  - A consumer's products of a chunk, each waited for before the next (the other consumer's
//    fill the gaps): A B^T, P Cc and B^T Cc, which need no state, then A S, once the other
//    consumer has added its chunk's sums to S (hand_off). It adds its own sums and hands S on. So
//    S passes between the consumers each chunk: one copy in shared memory, read and updated in
//    chunk order, the hand-off (A S and the update) the only part of a chunk run in series.
//  - Each consumer has its own set of tiles (SetTile): the producer stages the chunk into it
//    (cp.async) and writes B's tail and Cc^T (head and tail) there, announcing it (kFull + j).
//    The consumer frees the staged A and B (kCopied + j) once it holds A's and B^T's fragments
//    (B^T's loaded while P Cc runs), so that the next chunk's copies run behind its last
//    products, and the derived tiles (kFree + j) once B^T Cc has run (the staged Cc is the
//    producer's alone: transposed before the chunk is announced).
//  - Registers: 384 threads, 168 a thread at launch, the producer down to 40 and the consumers up
//    to 232 (setmaxnreg); a consumer holds A's fragments from A B^T to A S (64 registers), one
//    other operand's at a time beside them (P's, then B^T's), out and the sums (64).
// State-only blocks: the consumers sum alternate chunks' B^T Cc in registers, consumer 0 adds
// consumer 1's total to its own at the end (two partial sums in a fixed order: the same sum on
// every run). They free the staged B as soon as they have read its fragments, and the producer
// issues the next chunk's copies before it derives this chunk's tiles (its loop says why).
template <Pass P, bool kSplit>
__global__ void __launch_bounds__((wgmma_tf32::kConsumers + 1) * wgmma_tf32::kThreads, 1)
    wgmma_tf32_product_kernel(const KernelParams p, int64_t Da, int64_t Dc, int64_t col_tiles) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace wgmma_tf32;
  using wgmma::commit;
  using wgmma::fence;
  using wgmma::wait;
  static_assert(P != Pass::GradKV, "one pass: the forward, dq, dk or dv");
  constexpr bool kReverse = PassTraits<P>::kReverse;  // dk and dv: time walked backward

  extern __shared__ __align__(1024) unsigned char wgmma_smem[];
  const uint32_t base = wgmma::smem_address(wgmma_smem);
  auto tile = [&](int which) { return base + uint32_t(which) * kTile; };
  auto word = [&](int which, int r, int c) -> float& {
    return *reinterpret_cast<float*>(wgmma_smem + which * kTile + offset_of(r, c));
  };
  auto set_tile = [](int consumer, int which) { return consumer * kSetTiles + which; };  // a SetTile's index
  const int64_t row_tiles = (Da + C - 1) / C;  // above 64, tiles of the state's rows (see above)
  const chunked::BlockWork<P, float> work(p, col_tiles, C, Dc, row_tiles, C);
  const Operands<P, float, float> ops = work.operands(p);
  // row tiles 2 and 3 (above 128 rows) add into their own buffer, at the output's place in it
  float* const out_rows = work.k0 >= 2 * C
                              ? p.upper_row_tiles_out + (ops.out - static_cast<float*>(pass_output<P>(p).ptr))
                              : ops.out;
  const int64_t chunks = work.chunk_count(C);
  const bool state_only = work.state_only;
  auto chunk_begin = [&](int64_t it) { return work.chunk_begin(it, chunks, C); };  // chunk it's first step
  // (wgmma::warpgroup(): uniform to ptxas, which otherwise serialized the wgmma, C7520)
  const int group = wgmma::warpgroup(), tid = int(threadIdx.x) % kThreads;
  // hand_off(j): consumer j's mbarrier, completed by the other consumer's 128 arrivals
  auto hand_off = [&](int consumer) { return base + uint32_t(kHandOffs) + uint32_t(consumer) * 8u; };
  if (threadIdx.x == 0) {
    for (int j = 0; j < kConsumers; ++j) mbarrier_init(hand_off(j), kThreads);
  }
  __syncthreads();
  // registers: 168 a thread at launch (384 threads); the producer gives back what the consumers take
  constexpr int kProducerRegisters = 40, kConsumerRegisters = 232;
  static_assert(kConsumers * kConsumerRegisters + kProducerRegisters <= (kConsumers + 1) * 168, "the block's registers");

  if (group == kConsumers) {  // the producer
    wgmma::registers_down_to<kProducerRegisters>();
    const Stager stage(tid);
    const int64_t first = chunk_begin(0);
    Source a_src = stage.source(ops.a_rows(), first, Da, work.k0);
    Source b_src = stage.source(ops.b_rows(), first, Da, work.k0);
    Source c_src = stage.source(ops.c_rows(), first, Dc, work.m0);
    auto issue = [&](int64_t it) {  // it = 0, 1, 2, ... in order, into its consumer's set
      const int n = work.chunk_len(chunk_begin(it), C), j = int(it % kConsumers);
      if (!state_only) stage.operator()<kReverse>(tile(set_tile(j, kA)), a_src, ops.a_rows().ptr, n);
      stage.operator()<kReverse>(tile(set_tile(j, kB)), b_src, ops.b_rows().ptr, n);
      stage.operator()<kReverse>(tile(set_tile(j, kC)), c_src, ops.c_rows().ptr, n);
      wgmma::StageRing<>::commit_copies();
    };
    // a transposed tile, heads and tails, its time axis in the k-step order (timestep t at
    // column k_position(t): the file's comment; a warp: 32 consecutive timesteps, one row of
    // the transpose each; both the reads and the writes conflict-free). The addresses are
    // offset_of's as a base of this thread's (read_at, write_at: the swizzle's bits in them) and
    // a constant XOR and offset each, from the tiles' places made opaque each call (the 40
    // addresses held across the loop took the producer's registers).
    const int s_row = tid % 64, half = tid / 64;  // this thread's timestep; its columns' half (4 of 8)
    const uint32_t read_at = 128 * s_row + 16 * (half ^ (s_row % 8));
    // (offset_of(4 (half + 2 i) + e, k_position(s_row)))
    const uint32_t write_at = 8192 * (s_row / 32) + 512 * half + 16 * ((2 * ((s_row % 32) / 8) + s_row % 2) ^ (4 * half)) +
                              4 * ((s_row % 8) / 2);
    auto transpose = [&](int from, int head) {  // head's tail: the tile after it
      uint32_t in = uint32_t(from * kTile) + read_at, out = uint32_t(head * kTile) + write_at;
      asm volatile("" : "+r"(in), "+r"(out));
#pragma unroll
      for (int i = 0; i < 8; ++i) {  // columns 4 half + 8 i .. + 3
        const float4 x = *reinterpret_cast<const float4*>(wgmma_smem + ((in ^ (32 * (i % 4))) + 8192 * (i / 4)));
        const float xs[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float* const to = reinterpret_cast<float*>(wgmma_smem + ((out ^ (16 * e)) + 128 * e + 1024 * i));
          to[0] = xs[e];
          if constexpr (kSplit) to[kTile / 4] = tail_of(xs[e]);
        }
      }
    };
    if (chunks > 0) issue(0);
    for (int64_t it = 0; it < chunks; ++it) {
      const int j = int(it % kConsumers);
      asm volatile("cp.async.wait_group 0;\n" ::: "memory");  // chunk it, this thread's copies
      named_sync(kOwn + kConsumers, kThreads);                 // every thread's
      // The next chunk's copies, once its consumer holds the staged A and B of the chunk two before.
      // State-only blocks issue them first, so that they land while this chunk's tiles are derived:
      // issued after those, the copies' latency stood between every two chunks of this warpgroup's,
      // which paces a launch whose consumers run one product a chunk. The pass issues them last: its
      // consumers release the staged tiles only halfway through their chunk (after P Cc), and a
      // producer that waited for that before deriving the next chunk's tiles would lengthen the
      // chain that announces each chunk.
      auto next_copies = [&] {
        if (it + 1 < chunks) {
          if (it + 1 >= kConsumers) named_sync(kCopied + (1 - j));
          issue(it + 1);
        }
      };
      if (state_only) next_copies();
      if (it >= kConsumers) named_sync(kFree + j);  // the chunk two before has run B^T Cc: its derived tiles free
      if (!state_only && kSplit) {  // B's tail, in its head's places (A's: the consumer's, in registers)
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const uint32_t offset = stage.piece0 + 1024 * i;
          const float4 x = *reinterpret_cast<const float4*>(wgmma_smem + set_tile(j, kB) * kTile + offset);
          *reinterpret_cast<float4*>(wgmma_smem + set_tile(j, kBTail) * kTile + offset) =
              make_float4(tail_of(x.x), tail_of(x.y), tail_of(x.z), tail_of(x.w));
        }
      }
      static_assert(kCtTail == kCtHead + 1, "Cc^T's tail after its head");
      transpose(set_tile(j, kC), set_tile(j, kCtHead));
      wgmma::fence_shared_writes();  // (the cp.async copies and the derived tiles, to wgmma)
      named_arrive(kFull + j);
      if (!state_only) next_copies();
    }
    return;
  }

  // A consumer: chunks group, group + 2, ...
  wgmma::registers_up_to<kConsumerRegisters>();
  const int me = group, other = 1 - group;
  const int warp = tid / kWarp, lane = tid % kWarp, g = lane / 4, q4 = lane % 4;
  // The state S lives in shared memory as the copy A S reads: S^T (row m, column e), its head the
  // float32 state itself (the master: registers held no more), its tail beside. Each thread reads
  // and writes the elements of an accumulator's layout: row e = 16 warp + g (+8), column m = m0 +
  // 8 j + 2 q4 (+1), element 4 j .. of a 32-float array (the same in both consumers: each element
  // passes between the two threads of one rank, hand_off ordering them).
  // Its words' addresses: offset_of's as a base of this thread's (the swizzle's bits in it) and a
  // constant XOR and offset each element, from the base made opaque where they are used
  // (state_at(): held across the loop, the 64 addresses took the consumers' registers).
  const uint32_t state_base =
      kStHead * kTile + 8192 * (warp / 2) + 256 * q4 + 16 * ((4 * (warp % 2) + g / 4) ^ (2 * q4)) + 4 * (g % 4);
  auto state_at = [&] {
    uint32_t at = state_base;
    asm volatile("" : "+r"(at));
    return at;
  };
  auto state = [&](uint32_t at, int i) -> float& {  // element i's head; its tail a tile on (kStTail)
    return *reinterpret_cast<float*>(wgmma_smem + ((at ^ (16 * (2 * ((i % 4) / 2) + i % 2))) + 1024 * (i / 4) + 128 * (i % 2)));
  };
  static_assert(kStTail == kStHead + 1, "S^T's tail after its head");
  auto state_tail = [&](uint32_t at, int i) -> float& { return (&state(at, i))[kTile / 4]; };
  // A fragments of tile `which` (its rows 16 warp + g, + 8 and columns 8 s + q4, + 4 of k-step s;
  // where `transposed`, of its transpose with time, now the K axis, in the k-step order: k
  // positions q4 and q4 + 4 are timesteps 8 s + 2 q4 and + 1), split into heads and tails here.
  // Each warp's 32 loads of a k-step fall on 32 banks. The addresses are offset_of's in two
  // parts: a base of this thread's (x, y below; the swizzle's three bits hold g, or 4 (warp % 2)
  // + g / 4 ^ 2 q4) and what each load adds (a constant XOR on those bits, then constant bytes),
  // from the tile's place made opaque each call: held across the loop, the 32 addresses of each
  // tile spilled.
  const uint32_t frag_x = 128 * (16 * warp + g) + 16 * g + 4 * q4;
  const uint32_t frag_y = 8192 * (warp / 2) + 256 * q4 + 16 * ((4 * (warp % 2) + g / 4) ^ (2 * q4)) + 4 * (g % 4);
  auto staged_fragments = [&](SplitFragments& f, int which, bool transposed) {
    uint32_t at = uint32_t(which * kTile) + (transposed ? frag_y : frag_x);
    asm volatile("" : "+r"(at));
#pragma unroll
    for (int s = 0; s < 8; ++s)
#pragma unroll
      for (int h = 0; h < 4; ++h) {
        const uint32_t offset = transposed ? (at ^ (16 * (2 * (h % 2) + h / 2))) + 1024 * s + 128 * (h / 2)
                                           : (at ^ (16 * (2 * (s % 4) + h / 2))) + 8192 * (s / 4) + 1024 * (h % 2);
        f.set(s, h, *reinterpret_cast<const float*>(wgmma_smem + offset));
      }
  };
  auto store_segment_end = [&](const float (&end)[32]) {
    wgmma::store_end(end, SegmentEnd<float>(p, work.pair, work.segment, Da, Dc, kReverse, P == Pass::Forward, work.piece).state,
                     Da, Dc, work.k0, work.m0);
  };
  // d = B^T Cc of consumer me's chunk it (B^T's fragments read transposed from the staged B),
  // the staged A and B released to the producer once read (the next copies may come while the
  // product runs), the derived tiles once it has run
  auto state_sums = [&](float (&d)[32], int64_t it) {
    SplitFragments bf;
    staged_fragments(bf, set_tile(me, kB), true);
    const bool more = it + kConsumers < chunks;
    if (more) named_arrive(kCopied + me);
    fence();
    times<kSplit>(d, RegisterOperand{bf}, tile(set_tile(me, kCtHead)), tile(set_tile(me, kCtTail)), false);
    commit();
    wait<0>();
    if (more) named_arrive(kFree + me);
  };

  if (state_only) {  // (a loop of its own: sharing the products' loop, ptxas fenced the accumulators)
    // No A S reads the state here: it stays in registers, each chunk's sums added in float32 as
    // the pass adds them, and is written as the segment's end below (a state-only block starts
    // from zero: load_start).
    float total[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) total[i] = 0.f;
    for (int64_t it = me; it < chunks; it += kConsumers) {
      float sums[32];
      named_sync(kFull + me);
      state_sums(sums, it);
#pragma unroll
      for (int i = 0; i < 32; ++i) total[i] += sums[i];
    }
    if (chunks > 1) {  // consumer 1's total to consumer 0 through S^T's (unused) place
      if (me == 1) {
        const uint32_t at = state_at();
#pragma unroll
        for (int i = 0; i < 32; ++i) state(at, i) = total[i];
        mbarrier_arrive(hand_off(0));
        return;
      }
      mbarrier_wait(hand_off(0), 0);
      const uint32_t at = state_at();
#pragma unroll
      for (int i = 0; i < 32; ++i) total[i] += state(at, i);
    }
    if (me == 0) store_segment_end(total);
    return;
  }

  if (me == 0) {  // the segment's start into S, for chunk 0's A S
    float start[32];
    wgmma::load_start(start, p, work.pair, work.segment, Da, Dc, /*zero=*/false, work.k0, work.m0);
    const uint32_t at = state_at();
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      state(at, i) = start[i];
      if constexpr (kSplit) state_tail(at, i) = tail_of(start[i]);
    }
    wgmma::fence_shared_writes();
    named_sync(kOwn + me, kThreads);
  }
  const float factor = float(p.scale);  // each output times the pass's constant factor (wgmma_product.cuh)
  const int row = 16 * warp + g;
  for (int64_t it = me; it < chunks; it += kConsumers) {
    named_sync(kFull + me);
    float score[32], out[32], sums[32];
    SplitFragments bf;
    SplitFragments af;  // held for A S
    {
      staged_fragments(af, set_tile(me, kA), false);
      fence();
      times<kSplit>(score, RegisterOperand{af}, tile(set_tile(me, kB)), tile(set_tile(me, kBTail)), false);  // A B^T
      commit();
      wait<0>();
    }
    {
      // P = mask(scores) as A fragments, straight from the accumulators: this lane holds
      // columns 8 s + 2 q4 and + 1 of n-tile s, which in the k-step order are its k positions q4
      // and q4 + 4 (the shuffles that brought columns q4 and q4 + 4 are gone).
      SplitFragments pf;
#pragma unroll
      for (int s = 0; s < 8; ++s)
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // rows g, g + 8
          const int r = row + 8 * h;
          auto kept = [r](int column) { return kReverse ? column >= r : column <= r; };
          pf.set(s, h, kept(8 * s + 2 * q4) ? score[4 * s + 2 * h] : 0.f);              // k position q4
          pf.set(s, h + 2, kept(8 * s + 2 * q4 + 1) ? score[4 * s + 2 * h + 1] : 0.f);  // q4 + 4
        }
      fence();
      times<kSplit>(out, RegisterOperand{pf}, tile(set_tile(me, kCtHead)), tile(set_tile(me, kCtTail)), false);  // P Cc
      commit();
      staged_fragments(bf, set_tile(me, kB), true);  // B^T's, while P Cc runs
      wait<0>();
    }
    if (it + kConsumers < chunks) named_arrive(kCopied + me);  // A's and B^T's fragments held: chunk it + 2's copies may come
    fence();
    times<kSplit>(sums, RegisterOperand{bf}, tile(set_tile(me, kCtHead)), tile(set_tile(me, kCtTail)), false);  // B^T Cc
    commit();
    // S holds the state before chunk it: the other consumer's update, its hand-off (it - 1) / 2
    if (it > 0) mbarrier_wait(hand_off(me), uint32_t((it - 1) / kConsumers) & 1u);
    times<kSplit>(out, RegisterOperand{af}, tile(kStHead), tile(kStTail), true);  // += A S
    commit();
    wait<1>();  // B^T Cc: the derived tiles read, chunk it + 2's may come
    if (it + kConsumers < chunks) named_arrive(kFree + me);
    wait<0>();
    // S += the sums, rounded in float32, handed to the other consumer for chunk it + 1
    const uint32_t at = state_at();
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const float x = state(at, i) + sums[i];
      state(at, i) = x;
      if constexpr (kSplit) state_tail(at, i) = tail_of(x);
    }
    if (it + 1 < chunks) {
      wgmma::fence_shared_writes();  // (for the other's A S)
      mbarrier_arrive(hand_off(other));
    }

    const int64_t t0 = chunk_begin(it);
    const int n = work.chunk_len(t0, C);
    float* to = out_rows + (t0 + row) * ops.out_l + work.m0 + 2 * q4;  // row, then row + 8
    const int64_t to_h = 8 * ops.out_l;
    // a whole chunk of whole columns (every chunk but a sequence's last, wherever Dc is a multiple
    // of 64) stores without a test; the rest each element behind its own (a predicated store, a
    // branch around a reduction)
    auto stores = [&](auto store) {
      auto each = [&](auto inside) {
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            if (inside(h, j)) store(to + h * to_h + 8 * j, out[4 * j + 2 * h] * factor, out[4 * j + 2 * h + 1] * factor);
          }
      };
      if (n == C && work.cols == C) {
        each([](int, int) { return true; });
      } else {  // (cols: a multiple of 4)
        each([&](int h, int j) { return row + 8 * h < n && 8 * j + 2 * q4 < work.cols; });
      }
    };
    if (row_tiles > 1) {  // two row tiles' sums into a zeroed buffer: 0 + x + y, either order alike
      stores(add_pair);
    } else {
      stores([](float* at, float x, float y) { *reinterpret_cast<float2*>(at) = make_float2(x, y); });
    }
  }
  // the segment's end: S after the last chunk, by the consumer that updated it (chunk 0's where none)
  if (me == (chunks > 0 ? int((chunks - 1) % kConsumers) : 0)) {
    float end[32];
    const uint32_t at = state_at();
#pragma unroll
    for (int i = 0; i < 32; ++i) end[i] = state(at, i);
    store_segment_end(end);
  }
#else
  __trap();  // built without sm_90a: the dispatcher never launches this (see wgmma_takes)
#endif
}

}  // namespace cuda
}  // namespace fast_causal_attn
