// Every pass of float32 on Hopper's wgmma (sm_90a): the forward and dq, and dk and dv as two
// reverse passes (where run_grad_kv takes them), float32-accurate from float16 parts (the heads
// alone where the user allowed TF32, KernelParams::tf32), and under normalize every pass (the
// forward's normalizer and the backward's extra row, KeySum, summed over row tiles as the outputs
// are; dk's and dv's rows of q and dO divided by den, RowTerms): per chunk of C = 64 timesteps
//
//   scores = A B^T,  out = A S + mask(scores) Cc,  S += B^T Cc
//
// Each float32 tile x, scaled by a power of two 2^k so that its largest
// magnitude lies in [2^14, 2^15), is split into a float16 head h = fp16(x 2^k) and tail t =
// fp16(x 2^k - h): 22 significant bits, as 3xTF32's head and tail. Each product is three float16
// wgmma (head x head + head x tail + tail x head, the small terms first) at twice TF32's rate, on
// tiles half as large: m64n64k16, K = 64 in four steps where 3xTF32 took eight.
//
// The scales, each exact (powers of two): one a tile for A16, B16, Cc16 (2^α, 2^β, 2^γ) and the
// state's copy S16 (2^σ), one a row for P (2^p_r, in registers). With one scale a tile the scales
// lie outside every product, also along K:
//   A B^T     scores' = 2^(α + β) scores
//   P Cc      P = mask(scores') 2^p_r (its row's largest in [2^14, 2^15)): 2^(α + β + p_r + γ) P Cc
//   B^T Cc    B16 read transposed (MN-major A: 16-bit wgmma takes it so): 2^(β + γ) B^T Cc
//   A S       2^(α + σ) A S
// P Cc and A S go to accumulators of their own, scaled back where the output is stored. A tile's
// element 2^-k below the tile's largest keeps 2^(k - 39) of itself (float16's subnormals are 2^-24
// apart, the largest scaled to 2^14): within 1e-5 for k <= 22, a spread inside one 64 x 64 tile
// far past any data's (tests/test_wgmma.py checks 2^-20 by columns and rows).
//
// The pipeline: a producer warpgroup only copies (cp.async), into a ring of kSlots chunk slots,
// each slot's mbarrier completing when the copies have landed; two consumers on alternate chunks
// each derive their chunk's float16 tiles in place (a float32 tile's 16 KB hold its head and tail),
// run the products and release the slot. The producer, with nothing but copies, runs kSlots - 1
// chunks ahead (in a state-only block, which stages no A, a deeper ring: Layout). Where it derived
// the tiles (two sets of staged and derived tiles, all the shared memory held) its chain paced the
// pass: its copies one chunk ahead, its derivation, its waits on the consumers
// (benchmarks/experiments/tf32_halves_tile_scales.patch; RESULTS.md, forty-third session: this
// form 5-11% faster than 3xTF32, that one 0-5% slower).
//
// The tensor cores add into their accumulators without rounding to nearest: a state summed in them
// drifted past 1e-5 by 4097 steps (nineteenth session). So each chunk's B^T Cc goes to fresh
// accumulators and is added to S's float32 master, of which S16 is the scaled copy.
//
// A block holds a row tile of 64 of the state's rows (Da), or 128 above 64 (two parts: its A B^T
// and A S over K = 128, P and P Cc once for the 128 rows), and 64 of its columns (Dc). Wider
// states run in column tiles (each block its own outputs) and, up to 256 rows, in up to four row
// tiles of 64 or two of 128 (O is a sum over the state's rows). Where one launch a row tile takes
// no more rounds of blocks than all in one (row_tiles_in_sequence), the tiles run one launch each:
// tile 0 stores its outputs and each later tile adds into them, in stream order. Otherwise they
// share the grid: row tiles 0 and 1 add their outputs into the zeroed output, 2 and 3 into a
// zeroed buffer added to it after the pass (0 + x + y rounds as 0 + y + x). Either way each sum
// repeats bit for bit. Around the chunk loop everything is the 16-bit kernels' (chunked::BlockWork,
// Operands, segments and their scan, SegmentStart / SegmentEnd, launch_wgmma). Shared memory:
// wgmma_tf32::Layout.
#pragma once

#include "wgmma_product.cuh"

namespace fast_causal_attn {
namespace cuda {
namespace wgmma_tf32 {

constexpr int C = 64;               // timesteps a chunk; the state's rows and columns, zero-padded
constexpr int kThreads = 128;       // a warpgroup (a block: two consumers' and the producer's)
constexpr int kConsumers = 2;       // consumer warpgroups, on alternate chunks
constexpr int kTile = 64 * 64 * 4;  // bytes of a 64 x 64 float32 tile (two 8 KB atoms)
constexpr int kHalfTile = 64 * 64 * 2;  // bytes of a 64 x 64 float16 tile (one atom)

// Shared memory of a block over kParts x 64 of the state's rows (its row tile: 64 or 128 rows). A
// slot: B's kParts tiles (the row tile's columns of k, 64 each), Cc's one and A's kParts tiles
// (q's), as staged (float32), then as derived (float16: head at the tile, tail kHalfTile on); then
// the state's float32 master and S16's heads and tails, kParts tiles each (each consumer thread
// its own 32 elements of a master tile, the accumulator layout); then (kNormalize) the key sum's
// copy Z16, one 1 KB tile a part (KeySum), or in the reverse passes, which have no copy, in its
// place each consumer's row terms of its chunk (RowTerms), then the key sum's float32 master
// (kRows floats); then each
// consumer's warps' largest |A|, |B|, |Cc|, |S| (and |z|), 4 floats each, each consumer's published
// σ (its biased exponent) and ζ (z's), the mbarriers: hand_off (kConsumers), full and empty (kRing
// each). Four slots at 64 rows (48 KB each), two at 128 (80 KB): 224 KB either way, the normalizer
// 1.75 KB or 2.5 KB more.
// A state-only block stages B and Cc alone, the first kStateSlotBytes of a slot, in a ring of its
// own: kStateSlots slots of that size from 0, over the master's place (six of 32 KB at 64 rows,
// four of 48 KB at 128), its consumers' totals meeting after the ring (kStateHandOff, over S16 at
// 128 rows: neither is used there; the key sums' totals in their master's place). With the
// pass's ring its copies waited on the consumers holding both slots and the consumers on the
// copies (ncu, 1,16,32768,128: 46% of its stall samples; DRAM 68% busy; RESULTS.md, fiftieth
// session).
template <int kParts, bool kNormalize = false>
struct Layout {
  static constexpr int kSlots = kParts == 1 ? 4 : 2;  // chunks staged: chunk it in slot it % kSlots
  static constexpr int kSlotBytes = (2 * kParts + 1) * kTile;
  static constexpr int kB = 0, kCc = kParts * kTile, kA = (kParts + 1) * kTile;
  static constexpr int kMaster = kSlots * kSlotBytes, kS16 = kMaster + kParts * kTile;
  static constexpr int kZ16 = kS16 + kParts * 2 * kHalfTile;  // (kNormalize) 1024-aligned: the swizzle's period
  static constexpr int kRowTerms = kZ16;                       // (kNormalize, dk and dv) in Z16's place
  static constexpr int kRowTermBytes = kConsumers * 3 * C * 4;  // inverse den, a, a / den: 64 floats each
  static constexpr int kKeyMaster = kZ16 + (kNormalize ? (kParts * 1024 > kRowTermBytes ? kParts * 1024 : kRowTermBytes) : 0);
  static constexpr int kWarpMax = kKeyMaster + (kNormalize ? kParts * 64 * 4 : 0);
  static constexpr int kMaxima = kNormalize ? 5 : 4;  // operands whose largest |x| the warps offer
  static constexpr int kStateSlotBytes = kA;          // B and Cc
  static constexpr int kStateSlots = kS16 / kStateSlotBytes / kConsumers * kConsumers;
  static constexpr int kStateHandOff = kStateSlots * kStateSlotBytes;
  static constexpr int kRing = kStateSlots > kSlots ? kStateSlots : kSlots;  // mbarriers a kind
  static constexpr int kSigma = kWarpMax + kConsumers * kMaxima * 4 * 4;   // σ, then ζ, a consumer each
  static constexpr size_t kHandOffs = size_t(kSigma + (kNormalize ? 2 : 1) * kConsumers * 4 + 7) / 8 * 8;
  static constexpr size_t kFullBars = kHandOffs + kConsumers * sizeof(uint64_t);
  static constexpr size_t kEmptyBars = kFullBars + kRing * sizeof(uint64_t);
  static constexpr size_t kSmemBytes = kEmptyBars + kRing * sizeof(uint64_t);
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one block");
  static_assert(kSlotBytes % 1024 == 0 && kStateSlotBytes % 1024 == 0 && kS16 % 1024 == 0 && kZ16 % 1024 == 0,
                "the swizzle's period");
  static_assert(kSlots % kConsumers == 0 && kStateSlots % kConsumers == 0, "a slot's chunks go to one consumer");
  static_assert(kStateSlots >= kSlots && kStateHandOff + kParts * kTile <= kZ16, "the state-only ring's place");
};
// A ring of kDepth chunk slots of kBytes each from shared memory's start: chunk it in slot it %
// kDepth, its use of the slot's mbarriers that slot's (it / kDepth)-th phase
template <int kDepth, int kBytes>
struct Ring {
  static constexpr int kSlots = kDepth;
  __device__ static int slot(int64_t it) { return int(it % kDepth) * kBytes; }  // bytes into smem
  __device__ static uint32_t index(int64_t it) { return uint32_t(it % kDepth); }
  __device__ static uint32_t phase(int64_t it) { return uint32_t(it / kDepth) & 1u; }
};
// The block's bytes of shared memory for a row tile of `parts` x 64 rows (normalize: the key sum's)
inline size_t smem_bytes(int parts, bool normalize = false) {
  if (normalize) return parts == 2 ? Layout<2, true>::kSmemBytes : Layout<1, true>::kSmemBytes;
  return parts == 2 ? Layout<2>::kSmemBytes : Layout<1>::kSmemBytes;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
using wgmma::descriptor;

// The scale for a group whose largest magnitude is `largest`: 2^k with largest 2^k in [2^14, 2^15)
// (k at most 126: zeros and float32's subnormals scale by 2^126), as its float's biased exponent.
__device__ __forceinline__ uint32_t scale_exponent(float largest) {
  const uint32_t e = __float_as_uint(largest) >> 23;  // (largest >= 0)
  return e >= 15u ? 268u - e : 253u;
}
__device__ __forceinline__ float scale_of(uint32_t biased) { return __uint_as_float(biased << 23); }

// 2^e, exact for e >= -149 (0 below): two normal powers multiplied, for the product of two to four
// scales' inverses (each in [2^-126, 2^114]), which may leave the normal range. A product scaled
// back by less than 2^-149 (the scaled product at most 2^36: 64 terms of parts below 2^15, so a
// value below 2^-113) comes back as 0: only outputs near float32's own underflow.
__device__ __forceinline__ float power_of_two(int e) {
  const int lo = max(e / 2, -126), hi = e - lo;
  return __uint_as_float(uint32_t(lo + 127) << 23) * __uint_as_float(uint32_t(max(hi, -126) + 127) << 23);
}

// x0, x1 times scale as float16 pairs: head = fp16(x), tail = fp16(x - head) (x - head exact);
// without kSplit the head alone (tail untouched).
template <bool kSplit>
__device__ __forceinline__ void split2(float x0, float x1, float scale, uint32_t& head, uint32_t& tail) {
  x0 *= scale, x1 *= scale;
  head = wgmma::pack<true>(x0, x1);
  if constexpr (kSplit) {
    const float2 back = __half22float2(reinterpret_cast<const __half2&>(head));
    tail = wgmma::pack<true>(x0 - back.x, x1 - back.y);
  }
}

// The largest |v[i]| for i in [kBegin, kBegin + kCount), as a tree of FMNMX with |.| operands
// (one an element, where the magnitudes' bits and an integer max took two). A NaN is passed over
// (it comes out of the products as a NaN all the same).
template <int kBegin, int kCount>
__device__ __forceinline__ float largest_magnitude(const float (&v)[32]) {
  if constexpr (kCount == 2) {
    return fmaxf(fabsf(v[kBegin]), fabsf(v[kBegin + 1]));
  } else {
    return fmaxf(largest_magnitude<kBegin, kCount / 2>(v), largest_magnitude<kBegin + kCount / 2, kCount / 2>(v));
  }
}

// Programmatic dependent launches (launch_after_row_tile): the next launch may start once every
// block of this one has done so; wait until the launch before this one has finished and its
// writes are visible (both no-ops where the launch is not programmatic)
__device__ __forceinline__ void allow_dependent_launch() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }
__device__ __forceinline__ void wait_for_launch_before() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

// The largest of x over the 4 lanes of a quad (one row of a fragment)
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

// at[0], at[1] += x, y as one vector reduction (red.global.add.v2.f32, sm_90): atomicAdd's float2
// form made its 64-bit address again before each one (11 instructions a reduction against a
// store's 3). Like atomicAdd on float, it flushes subnormal sums to zero.
__device__ __forceinline__ void add_pair(float* at, float x, float y) {
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(at), "f"(x), "f"(y) : "memory");
}

// An A operand in registers, K = 64 (four k16 steps), float16 heads and tails (mma.sync's m16n8k16
// A fragment: a0 (row g, k 2 q4, + 1), a1 (g + 8, ...), a2 (g, k 2 q4 + 8, + 9), a3 (g + 8, ...)).
struct HalfFragments {
  uint32_t head[4][4], tail[4][4];
};

// k16 step s of a float16 tile's descriptor: K-major (kTrans = 0: 32 bytes along its rows) or
// MN-major (1: 2048 bytes down them). The descriptor built once a tile and stepped by a 64-bit add
// (wgmma::k_along_rows and k_along_columns, which build it from the address each step, took 3x the
// R2UR here: offline SASS, forty-third session).
template <int kTrans>
__device__ __forceinline__ uint64_t k16_step(uint64_t tile_descriptor, int s) {
  return tile_descriptor + uint64_t((kTrans ? 2048 * s : 32 * s) / 16);
}
// The A operands of `times`: fragments in registers, or a float16 tile in shared memory (its head
// at `tile`, its tail kHalfTile on), K-major (kTransA = 0) or MN-major (1).
struct RegisterHalves {
  static constexpr int kTrans = 0;  // (no tile's)
  const HalfFragments& f;
  __device__ const uint32_t (&head(int s) const)[4] { return f.head[s]; }
  __device__ const uint32_t (&tail(int s) const)[4] { return f.tail[s]; }
};
template <int kTransA>
struct TileHalves {
  static constexpr int kTrans = kTransA;
  uint64_t head_descriptor, tail_descriptor;
  __device__ explicit TileHalves(uint32_t tile) : head_descriptor(descriptor(tile)), tail_descriptor(descriptor(tile + kHalfTile)) {}
  __device__ uint64_t head(int s) const { return k16_step<kTransA>(head_descriptor, s); }
  __device__ uint64_t tail(int s) const { return k16_step<kTransA>(tail_descriptor, s); }
};
template <int kTransA, int kTransB>
__device__ __forceinline__ void mma_half(float (&d)[32], const uint32_t (&a)[4], uint64_t b, bool accumulate) {
  wgmma::mma_rs<true, kTransB>(d, a, b, accumulate);
}
template <int kTransA, int kTransB>
__device__ __forceinline__ void mma_half(float (&d)[32], uint64_t a, uint64_t b, bool accumulate) {
  wgmma::mma_ss<true, kTransA, kTransB>(d, a, b, accumulate);
}

// d (+)= A B over K = 64 in float16 heads and tails: A a RegisterHalves or TileHalves, B a tile (its
// head at b_tile, its tail kHalfTile on), K-major (kTransB = 0) or MN-major (1). Per k16 step the
// small terms first (the accumulators truncate); kSplit = false: the heads alone.
template <bool kSplit, int kTransB, typename A>
__device__ __forceinline__ void times(float (&d)[32], const A& a, uint32_t b_tile, bool accumulate) {
  const TileHalves<kTransB> b(b_tile);
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const bool first = !accumulate && s == 0;
    if constexpr (kSplit) {
      mma_half<A::kTrans, kTransB>(d, a.tail(s), b.head(s), !first);
      mma_half<A::kTrans, kTransB>(d, a.head(s), b.tail(s), true);
    }
    mma_half<A::kTrans, kTransB>(d, a.head(s), b.head(s), kSplit || !first);
  }
}

// Named barriers (0 is __syncthreads): kOwn + j, consumer j's four warps (its tiles' largest
// |x| and its derived tiles written; the state's largest |S|). Every hand-off between warpgroups
// is an mbarrier (an arrive a release of the arriving thread's accesses, a wait an acquire):
// across bar.arrive -> bar.sync racecheck took reads and writes for races (578 and 84 reports in
// two earlier forms of this kernel).
enum Barrier : int { kOwn = 1 };
static_assert(kOwn + kConsumers <= 16, "named barriers of a block");
__device__ __forceinline__ void named_sync(int id) { wgmma::named_sync(id, kThreads); }
__device__ __forceinline__ void mbarrier_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// An arrival on bar once this thread's cp.async copies so far have landed (counted in the
// mbarrier's count: .noinc)
__device__ __forceinline__ void mbarrier_arrive_on_copies(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
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

// The forward's normalizer (wgmma_tf32_product_kernel's kNormalize): den[t] = eps + scale (the
// row sum of the chunk's masked scores + q[t] . z), z the key sum entering the chunk over the
// block's rows of the state (in row tiles each tile's part of den, summed as the outputs are:
// the forward's den then divides O after the pass, divide_by_den). z's float32 master lies in shared
// memory and is handed from consumer to consumer with S (publish): lanes 0-7 of each warp own its
// columns 64 j + 16 w + 2 l (+1), and add to them the chunk's column sums of k, summed from the
// staged float32 B before its derivation (chunk_sums: exact float32). Its copy Z16, one K-major
// tile of 8 rows a part (row 0 the float16 head of z 2^ζ, row 1 the tail, the rest zeros), is B
// of one more product beside A S: A Z16 in m64n8k16 steps, column 0 of the result A's products
// with the heads, column 1 with the tails (times_key_sum), q . z = (d0 + d1) 2^-(α + ζ).
template <int kParts>
struct KeySum {
  float* master;  // [kParts 64], shared
  uint32_t copy;  // Z16's part 0 (shared address; part j 1024 j on)
  int warp, lane;

  __device__ bool owner() const { return lane < 8; }
  __device__ int column(int j, int e) const { return 64 * j + 16 * warp + 2 * (lane % 8) + e; }
  // An owner's columns of the staged float32 B (its parts at `b`, generic) summed over the
  // chunk's rows (zeros past it), each row r times weights[r] where kWeighted (dk's e: RowTerms):
  // lane l sums rows 8 i + 2 (l / 8) (+1), the four row phases added by two shuffles.
  template <bool kWeighted = false>
  __device__ void chunk_sums(float (&sums)[kParts][2], const unsigned char* b, const float* weights = nullptr) const {
    const int phase = lane / 8, c = 16 * warp + 2 * (lane % 8);
#pragma unroll
    for (int j = 0; j < kParts; ++j) {
      float lo = 0.f, hi = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        float2 w = make_float2(1.f, 1.f);  // rows 8 i + 2 phase (+1)
        if constexpr (kWeighted) w = *reinterpret_cast<const float2*>(weights + 8 * i + 2 * phase);
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int r = 8 * i + 2 * phase + u;  // (Stager's layout: row r, column c of a float32 tile)
          const float2 x = *reinterpret_cast<const float2*>(b + kTile * j + (c / 32) * 8192 + 128 * r +
                                                            16 * (((c % 32) / 4) ^ (r % 8)) + 4 * (c % 4));
          if constexpr (kWeighted) {
            const float weight = u == 0 ? w.x : w.y;
            lo = fmaf(x.x, weight, lo), hi = fmaf(x.y, weight, hi);
          } else {
            lo += x.x, hi += x.y;
          }
        }
      }
#pragma unroll
      for (int offset = 8; offset < kWarp; offset *= 2) {
        lo += __shfl_xor_sync(0xffffffffu, lo, offset);
        hi += __shfl_xor_sync(0xffffffffu, hi, offset);
      }
      sums[j][0] = lo, sums[j][1] = hi;
    }
  }
  // An owner's columns of the master into z, plus `add` (non-owners: zeros)
  __device__ void read(float (&z)[kParts][2], const float (&add)[kParts][2]) const {
#pragma unroll
    for (int j = 0; j < kParts; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) z[j][e] = owner() ? master[column(j, e)] + add[j][e] : 0.f;
  }
  __device__ void write(const float (&z)[kParts][2]) const {
    if (!owner()) return;
#pragma unroll
    for (int j = 0; j < kParts; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) master[column(j, e)] = z[j][e];
  }
  // An owner's largest |z| (others 0)
  __device__ float largest(const float (&z)[kParts][2]) const {
    float m = 0.f;
#pragma unroll
    for (int j = 0; j < kParts; ++j) m = fmaxf(m, fmaxf(fabsf(z[j][0]), fabsf(z[j][1])));
    return m;
  }
  // An owner's columns of Z16: z times scale, head in row 0, tail in row 1 (element (n, k) of a
  // K-major tile at 128 n + 16 ((k / 8) ^ n) + 2 (k % 8))
  template <bool kSplit>
  __device__ void write_copy(unsigned char* smem_copy, const float (&z)[kParts][2], float scale) const {
    if (!owner()) return;
    const int k = 16 * warp + 2 * (lane % 8);
#pragma unroll
    for (int j = 0; j < kParts; ++j) {
      uint32_t head, tail = 0u;
      split2<kSplit>(z[j][0], z[j][1], scale, head, tail);
      unsigned char* part = smem_copy + 1024 * j + 2 * (k % 8);
      *reinterpret_cast<uint32_t*>(part + 16 * (k / 8)) = head;
      *reinterpret_cast<uint32_t*>(part + 128 + 16 * ((k / 8) ^ 1)) = tail;
    }
  }
  // Z16's rows 2-7 zeroed (once a block, before the first publish), by a warpgroup's threads
  __device__ static void clear_copy(unsigned char* smem_copy, int tid) {
    for (int i = tid; i < kParts * 6 * 8; i += kThreads) {
      const int j = i / 48, piece = i % 48;  // a 16-byte piece of rows 2-7
      *reinterpret_cast<uint4*>(smem_copy + 1024 * j + 256 + 16 * piece) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
};

// The reverse passes' terms of their chunk's rows under normalize (wgmma_tf32_product_kernel's
// kDividesCc), one consumer's, in shared memory (Layout::kRowTerms): 1 / den[t], by which dk and
// dv divide their Cc's row t (q and dO) as they derive it; dk's a[t] = -dO[t] . O[t], added to each
// kept score of column t, and a[t] / den[t], the weights of e's chunk sums (KeySum::chunk_sums).
// Row r of the chunk is written by the consumer's thread r (zeros past the chunk) and read by all
// after a kOwn sync; the next chunk's writes come after the consumer's next kOwn sync (publish's,
// or in a state-only block derive's), which follows every read.
struct RowTerms {
  float* at;  // [3][C]
  __device__ float* inverse() const { return at; }
  __device__ float* a() const { return at + C; }
  __device__ float* weight() const { return at + 2 * C; }
  // thread r's row (r < C) from den[t] and dO[t] . O[t] (dk; else 0), valid: inside the chunk
  __device__ void write(int r, float den, float dout_dot_out, bool valid) const {
    const float inv = valid ? __frcp_rn(den) : 0.f, a_r = valid ? -dout_dot_out : 0.f;
    inverse()[r] = inv, a()[r] = a_r, weight()[r] = a_r * inv;
  }
};

// d (+)= A Z16 for one part (KeySum): m64n8k16 in four k16 steps, A a tile's halves (K-major; its
// tail first where kSplit), Z16 K-major (its 8 rows one swizzle period). d's columns 0 and 1 (lane
// q4 = 0: d[0], d[1] row g, d[2], d[3] row g + 8) are A's products with z's head and tail.
__device__ __forceinline__ void mma_n8(float (&d)[4], uint64_t a, uint64_t b, bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0, %1, %2, %3}, %4, %5, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "l"(a), "l"(b), "r"(accumulate ? 1 : 0));
}
template <bool kSplit>
__device__ __forceinline__ void times_key_sum(float (&d)[4], const TileHalves<0>& a, uint32_t z_tile, bool accumulate) {
  const uint64_t z = descriptor(z_tile);
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const bool first = !accumulate && s == 0;
    if constexpr (kSplit) mma_n8(d, a.tail(s), k16_step<0>(z, s), !first);
    mma_n8(d, a.head(s), k16_step<0>(z, s), kSplit || !first);
  }
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace wgmma_tf32

// One pass of float32 (wgmma_takes): one block a (sequence, head, time segment), from the
// segment's start (dk and dv: from its end, time walked backward, the scores' mask c >= r);
// state-only blocks (launch_segmented's first launch) sum their segment's B^T Cc alone. Da and Dc
// up to 256: the block's row tile of kParts x 64 of the state's rows from work.k0 (from the grid,
// or KernelParams::row_tile where the row tiles run one launch each), its column tile of 64 from
// work.m0. kSplit: float32 from float16 heads and tails; without, the heads alone (where the user
// allowed TF32).
//
// Three warpgroups: a producer that copies each chunk into its slot (cp.async), and two consumers
// on alternate chunks (consumer j on chunks j, j + 2, ...). A consumer derives its chunk's float16
// tiles, runs A B^T, P Cc and B^T Cc, then A S once the other consumer has added its chunk's sums
// to S (hand_off), adds its own and hands S on. With two parts (128 rows) A B^T and A S run over
// K = 128 (one scale for A's two tiles, one for B's, one σ for S's: the parts' products share
// their accumulators), and B^T Cc and the state are two tiles: P and P Cc are computed once for
// the 128 rows where two row tiles of 64 computed them twice and summed their outputs.
template <Pass P, bool kSplit, int kParts, bool kNormalize = false>
__global__ void __launch_bounds__((wgmma_tf32::kConsumers + 1) * wgmma_tf32::kThreads, 1)
    wgmma_tf32_product_kernel(const KernelParams p, int64_t Da, int64_t Dc, int64_t col_tiles) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace wgmma_tf32;
  using wgmma::commit;
  using wgmma::fence;
  using wgmma::prefetch_l2;
  using wgmma::wait;
  using L = Layout<kParts, kNormalize>;
  static_assert(P != Pass::GradKV, "one pass: the forward, dq, dk or dv");
  static_assert(kParts == 1 || kParts == 2, "a row tile of 64 or 128 of the state's rows");
  constexpr bool kReverse = PassTraits<P>::kReverse;  // dk and dv: time walked backward
  // (kNormalize) the forward's normalizer: z over the state's rows, den. The extra row: dq's z over
  // its Dc columns of k (Cc), a = -dO[t] . O[t] beside each score of row t and times z, scale /
  // den[t]; dk's e over its Dc columns of q / den (Cc), the sums of a[t] q[t] / den[t], a[t]
  // beside each score of column t and e added to each row, times scale. dk and dv divide their
  // Cc's rows by den as they derive them (kDividesCc: q / den, dO / den; RowTerms).
  constexpr bool kForwardSums = kNormalize && P == Pass::Forward;
  constexpr bool kExtraRow = kNormalize && (P == Pass::GradQ || P == Pass::GradK);
  constexpr bool kKeySums = kForwardSums || kExtraRow;  // (KeySum; each output row's own factor)
  constexpr bool kDividesCc = kNormalize && kReverse, kColumnTerms = kExtraRow && kReverse;
  constexpr int kKeyParts = kExtraRow ? 1 : kParts;  // z's 64-column parts: the forward's B's, dq's and dk's Cc's
  constexpr int kRows = kParts * C;                    // the state's rows a block holds
  using PassRing = Ring<L::kSlots, L::kSlotBytes>;
  using StateRing = Ring<L::kStateSlots, L::kStateSlotBytes>;  // a state-only block's (Layout)

  extern __shared__ __align__(1024) unsigned char wgmma_smem[];
  const uint32_t base = wgmma::smem_address(wgmma_smem);
  const int64_t row_tiles = (Da + kRows - 1) / kRows;  // above kRows, tiles of the state's rows
  const chunked::BlockWork<P, float> work(p, col_tiles, C, Dc, row_tiles, kRows);
  // the row tiles in the grid, or this launch's one (KernelParams::row_tile; BlockWork takes it)
  const bool tiles_in_grid = p.row_tile < 0;
  const Operands<P, float, float> ops = work.operands(p);
  // in the grid, row tiles 2 and 3 add into their own buffer, at the output's place in it
  float* const out_rows = tiles_in_grid && work.k0 >= 2 * kRows
                              ? p.upper_row_tiles_out + (ops.out - static_cast<float*>(pass_output<P>(p).ptr))
                              : ops.out;
  // the first row tile of a launch of its own stores; every other row tile adds (two in the grid
  // into one zeroed buffer; one a launch into what the launches before it left)
  const bool adds_outputs = row_tiles > 1 && p.row_tile != 0;
  const bool later_tile_launch = p.row_tile > 0;  // a later tile's launch of its own (programmatic)
  const int64_t chunks = work.chunk_count(C);
  const bool state_only = work.state_only;
  // (dq) dO[t] . O[t] made by this pass (KernelParams::dots_in_grad_q: one part, one column tile,
  // so that each row's dot is made once) into dout_dot_out, which the consumers read for the extra
  // row as they would backward_prepare_kernel's and the dk pass reads after this one. The producer
  // makes them, a chunk at a time right after issuing its copies, from dO's and O's rows in global
  // memory (dO's lines on their way to the L2 for those copies), and announces them on the slot's
  // full barrier: its loads wait there, a ring's depth ahead of the consumers, where in the
  // consumers the same loads sat on the pass's chain (dq 0.1305 -> 0.1945 ms at 8,16,2048,64; H100,
  // RESULTS.md, sixtieth session).
  constexpr bool kMakesDots = kExtraRow && !kReverse && kParts == 1;
  const bool makes_dots = kMakesDots && p.dots_in_grad_q && !state_only;
  // (makes_dots) the sequence's rows of O: one pointer held across the warpgroups' split, as the
  // operands' are (its batch, head and start held there instead spilled; offline, ptxas -v)
  const float* const o_rows =
      makes_dots ? static_cast<const float*>(p.o.ptr) + p.o.offset(work.seq.b, work.seq.h, work.seq.begin) : nullptr;
  auto chunk_begin = [&](int64_t it) { return work.chunk_begin(it, chunks, C); };  // chunk it's first step
  const int group = wgmma::warpgroup(), tid = int(threadIdx.x) % kThreads;
  auto hand_off = [&](int consumer) { return base + uint32_t(L::kHandOffs) + uint32_t(consumer) * 8u; };
  // slot i's mbarriers (Ring::index)
  auto full = [&](uint32_t i) { return base + uint32_t(L::kFullBars) + i * 8u; };
  auto empty = [&](uint32_t i) { return base + uint32_t(L::kEmptyBars) + i * 8u; };
  // a state-only block's ring: its own (deep_state_staging, the default) or the pass's (for measuring)
  const bool deep_ring = state_only && p.deep_state_staging;
  // operand t's part j in a slot (t: 0 A, 1 B, 2 Cc; Cc has one part), bytes from the slot on
  auto tile_of = [](int t, int j) { return (t == 0 ? L::kA : t == 1 ? L::kB : L::kCc) + kTile * j; };
  if (threadIdx.x == 0) {
    for (int j = 0; j < kConsumers; ++j) mbarrier_init(hand_off(j), kThreads);
    for (uint32_t s = 0; s < uint32_t(L::kRing); ++s) {
      // the producer's threads, once their copies have landed (and where it makes the dots, once
      // more after storing them)
      mbarrier_init(full(s), makes_dots ? 2 * kThreads : kThreads);
      mbarrier_init(empty(s), kThreads);  // the consumer's threads, once its products have run
    }
  }
  __syncthreads();
  constexpr int kProducerRegisters = 56, kConsumerRegisters = 224;
  static_assert(kConsumers * kConsumerRegisters + kProducerRegisters <= (kConsumers + 1) * 168, "the block's registers");

  // a later row tile's launch (launch_after_row_tile) may start once every block of this one has
  // (no-op where nothing is launched so)
  allow_dependent_launch();

  if (group == kConsumers) {  // the producer: copies, a ring's depth - 1 chunks ahead of the consumers
    wgmma::registers_down_to<kProducerRegisters>();
    const Stager stage(tid);
    const int64_t first = chunk_begin(0);
    Source a_src[kParts], b_src[kParts];
#pragma unroll
    for (int j = 0; j < kParts; ++j) {
      a_src[j] = stage.source(ops.a_rows(), first, Da, work.k0 + C * j);
      b_src[j] = stage.source(ops.b_rows(), first, Da, work.k0 + C * j);
    }
    Source c_src = stage.source(ops.c_rows(), first, Dc, work.m0);
    // (makes_dots) chunk it's dots, made right after its copies are issued: this thread's 16-byte
    // pieces of rows row0 + 8 i of dO (A's, a_src just stepped past them) and of O (o_src), the
    // sixteen lanes of a row summed by shuffles, the first storing (rows past the chunk: none;
    // columns past M: zeros); then the next chunk's O lines prefetched to the L2, so that its
    // rounds wait on the L2 rather than DRAM. kRowsAtOnce rows a round, their loads at once, and
    // the pointers stepped as the copies' Sources are: within the producer's 56 registers (four
    // rows a round spilled 48-112 bytes; offline, ptxas -v).
    Source o_src{};
    float* dots_to = nullptr;  // dout_dot_out at the chunk's row row0
    if constexpr (kMakesDots) {
      if (makes_dots) {
        o_src = stage.source(decltype(ops.a_rows()){o_rows, p.o.stride_l}, first, Da);
        dots_to = const_cast<float*>(ops.dout_dot_out) + first + stage.row0;  // (the pass's own output here)
      }
    }
    auto make_dots = [&](int64_t it, int n) {
      if constexpr (kMakesDots) {
        constexpr int kRowsAtOnce = 2;
        const float* const dout = a_src[0].next - 8 * a_src[0].piece_step;
#pragma unroll 1
        for (int round = 0; round < 8 / kRowsAtOnce; ++round) {
          float4 x[kRowsAtOnce], y[kRowsAtOnce];
#pragma unroll
          for (int i = 0; i < kRowsAtOnce; ++i) {
            const int piece = kRowsAtOnce * round + i;
            const bool valid = a_src[0].inside && stage.row0 + 8 * piece < n;
            const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
            x[i] = valid ? __ldg(reinterpret_cast<const float4*>(dout + piece * a_src[0].piece_step)) : zero;
            y[i] = valid ? __ldg(reinterpret_cast<const float4*>(o_src.next + piece * o_src.piece_step)) : zero;
          }
#pragma unroll
          for (int i = 0; i < kRowsAtOnce; ++i) {
            float dot = fmaf(x[i].w, y[i].w, fmaf(x[i].z, y[i].z, fmaf(x[i].y, y[i].y, x[i].x * y[i].x)));
#pragma unroll
            for (int lanes = 8; lanes >= 1; lanes /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, lanes);
            const int piece = kRowsAtOnce * round + i;
            if (stage.col == 0 && stage.row0 + 8 * piece < n) dots_to[8 * piece] = dot;
          }
        }
        o_src.next += 8 * o_src.piece_step;
        dots_to += C;
        if (it + 1 < chunks && a_src[0].inside && stage.col % 32 == 0) {  // a 128-byte line once
          const int next_n = work.chunk_len(chunk_begin(it + 1), C);
#pragma unroll
          for (int piece = 0; piece < 8; ++piece) {
            if (stage.row0 + 8 * piece < next_n) prefetch_l2(o_src.next + piece * o_src.piece_step);
          }
        }
      }
    };
    auto produce = [&](auto ring) {
      using R = decltype(ring);
      for (int64_t it = 0; it < chunks; ++it) {
        // chunk it - depth done with the slot
        if (it >= R::kSlots) mbarrier_wait(empty(R::index(it)), R::phase(it - R::kSlots));
        const int n = work.chunk_len(chunk_begin(it), C);
        const uint32_t slot = base + uint32_t(R::slot(it));
#pragma unroll
        for (int j = 0; j < kParts; ++j) {
          if (!state_only) stage.operator()<kReverse>(slot + tile_of(0, j), a_src[j], ops.a_rows().ptr, n);
          stage.operator()<kReverse>(slot + tile_of(1, j), b_src[j], ops.b_rows().ptr, n);
        }
        stage.operator()<kReverse>(slot + L::kCc, c_src, ops.c_rows().ptr, n);
        mbarrier_arrive_on_copies(full(R::index(it)));
        if (makes_dots) {  // (a release of the dots' stores to the consumers, whose wait acquires them)
          make_dots(it, n);
          mbarrier_arrive(full(R::index(it)));
        }
      }
    };
    if (deep_ring) {
      produce(StateRing{});
    } else {
      produce(PassRing{});
    }
    // A later row tile's launch completes only after the tile before it has: every block waits
    // here (where its consumers may never add, an empty sequence), so that what follows in the
    // stream finds both tiles' outputs written
    if (later_tile_launch) wait_for_launch_before();
    return;
  }

  // A consumer: chunks group, group + 2, ...
  wgmma::registers_up_to<kConsumerRegisters>();
  const int me = group, other = 1 - group;
  const int warp = tid / kWarp, lane = tid % kWarp, g = lane / 4, q4 = lane % 4;
  const int row = 16 * warp + g;  // this thread's rows: row, row + 8 (of the chunk; of the state)
  // The state's float32 master, part j: this thread's 32 elements (accumulator layout) as 8
  // vectors from master + kMasterPart j on
  float4* const master = reinterpret_cast<float4*>(wgmma_smem + L::kMaster) + tid;
  constexpr int kMasterPart = kTile / int(sizeof(float4));
  // this consumer's warps' largest |x| of operand t (0: A, 1: B, 2: Cc, 3: S, 4: z), warp_max[4 t + warp]
  float* const warp_max = reinterpret_cast<float*>(wgmma_smem + L::kWarpMax) + 4 * L::kMaxima * me;
  uint32_t* const sigma = reinterpret_cast<uint32_t*>(wgmma_smem + L::kSigma);
  uint32_t* const zeta = sigma + kConsumers;  // (kForwardSums) each consumer's published ζ
  // (kKeySums) the key sum entering each chunk and its copy (KeySum)
  const KeySum<kKeyParts> keys{reinterpret_cast<float*>(wgmma_smem + L::kKeyMaster), base + uint32_t(L::kZ16), warp, lane};
  // (kKeySums) the staged tile whose column sums z adds: the forward's B (k), dq's Cc (k), dk's Cc
  // (q, each row times a / den: RowTerms)
  constexpr int kKeyTile = kExtraRow ? L::kCc : L::kB;
  // (kExtraRow) the extra row's terms go into row tile 0's outputs alone (dq's and dk's outputs
  // summing over the row tiles: launch_wgmma_kernels)
  const bool extra_here = work.k0 == 0;
  // (kDividesCc) this consumer's chunk's row terms
  const RowTerms terms{reinterpret_cast<float*>(wgmma_smem + L::kRowTerms) + 3 * C * me};
  // The chunk's row terms (kDividesCc): den and dO . O of row tid read (before the slot's wait),
  // then written (after it), and the consumer's kOwn sync
  auto read_row_terms = [&](int64_t t0, int n, float (&row)[2]) {
    if constexpr (kDividesCc) {
      row[0] = 1.f, row[1] = 0.f;
      if (tid < n) {
        row[0] = ops.den[t0 + tid];
        if constexpr (kColumnTerms) row[1] = ops.dout_dot_out[t0 + tid];
      }
    }
  };
  auto write_row_terms = [&](int n, const float (&row)[2]) {
    if constexpr (kDividesCc) {
      if (tid < C) terms.write(tid, row[0], row[1], tid < n);
      named_sync(kOwn + me);
    }
  };
  // (kColumnTerms) e's chunk sums from the staged float32 q, each row times a / den; the others'
  // from their staged k
  auto key_chunk_sums = [&](float (&sums)[kKeyParts][2], int slot) {
    keys.template chunk_sums<kColumnTerms>(sums, wgmma_smem + slot + kKeyTile, terms.weight());
  };
  // The largest |x| of operand t: each thread's, through its warp (redux.sync) and the four warps
  // (warp_max; the caller's kOwn sync between this and tile_exponent)
  auto offer_largest = [&](int t, uint32_t largest_bits) {
    largest_bits = __reduce_max_sync(0xffffffffu, largest_bits);
    if (lane == 0) warp_max[4 * t + warp] = __uint_as_float(largest_bits);
  };
  auto tile_exponent = [&](int t) {
    const float4 w = *reinterpret_cast<const float4*>(warp_max + 4 * t);
    return scale_exponent(fmaxf(fmaxf(w.x, w.y), fmaxf(w.z, w.w)));
  };

  // Chunk it's staged operands (A unless state-only, B, Cc) scaled and split in place into float16
  // heads and tails, one scale an operand (over its parts); k[t]: operand t's scale exponent. Four
  // threads a row, thread q of the four its float16 chunks q and q + 4 (float32 chunks 2 q, 2 q +
  // 1 of either atom): rows tid / 4 and + 32, odd rows' atoms in the other order (x[..][a] from
  // atom a ^ 1): a quarter warp's stores (rows r, r + 1) then fall on 32 banks, where in one order
  // they fell on 16 twice (ncu: STS 31% of the shared-memory wavefronts, 1.6x the bytes' count),
  // and its loads stay on 32. Every thread reads all of a round's elements before the kOwn sync and
  // writes after it: the float16 tile lies over the float32 tile's first half and its tail over the
  // second. In rounds of at most three tiles (96 floats a thread held across the sync): A, B and Cc
  // at one part; A's two tiles and Cc, then B's two, at two.
  const int d_row = tid / 4, d_q = tid % 4, d_odd = d_row % 2;
  auto derive_round = [&](int slot, uint32_t (&k)[3], auto operands) {
    constexpr unsigned kOperands = decltype(operands)::value;  // bit t: operand t in this round
    auto in_round = [&](int t) { return ((kOperands >> t) & 1u) != 0 && !(t == 0 && state_only); };
    float4 x[3][kParts][2][2][2];  // [operand][part][pass: row d_row + 32 pass][atom a ^ d_odd][float32 chunk 2 q + d]
    float cc_row[2] = {1.f, 1.f};  // (kDividesCc) Cc's rows d_row, d_row + 32 times 1 / den
    if constexpr (kDividesCc) {
      if (in_round(2)) cc_row[0] = terms.inverse()[d_row], cc_row[1] = terms.inverse()[d_row + 32];
    }
#pragma unroll
    for (int t = 0; t < 3; ++t) {
      if (!in_round(t)) continue;
      float largest = 0.f;  // (the magnitudes' bits order as the floats do)
#pragma unroll
      for (int j = 0; j < (t == 2 ? 1 : kParts); ++j)
#pragma unroll
        for (int pass = 0; pass < 2; ++pass)
#pragma unroll
          for (int a = 0; a < 2; ++a)
#pragma unroll
            for (int d = 0; d < 2; ++d) {
              const int r = d_row + 32 * pass;
              float4 v = *reinterpret_cast<const float4*>(wgmma_smem + slot + tile_of(t, j) + 8192 * (a ^ d_odd) +
                                                          128 * r + 16 * ((2 * d_q + d) ^ (r % 8)));
              if (kDividesCc && t == 2) {
                const float f = cc_row[pass];
                v.x *= f, v.y *= f, v.z *= f, v.w *= f;
              }
              x[t][j][pass][a][d] = v;
              largest = fmaxf(largest, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
            }
      offer_largest(t, __float_as_uint(largest));
    }
    named_sync(kOwn + me);
#pragma unroll
    for (int t = 0; t < 3; ++t) {
      if (!in_round(t)) continue;
      k[t] = tile_exponent(t);
      const float scale = scale_of(k[t]);
#pragma unroll
      for (int j = 0; j < (t == 2 ? 1 : kParts); ++j)
#pragma unroll
        for (int pass = 0; pass < 2; ++pass)
#pragma unroll
          for (int a = 0; a < 2; ++a) {
            const int r = d_row + 32 * pass;
            uint4 head, tail;
            const float4 &lo = x[t][j][pass][a][0], &hi = x[t][j][pass][a][1];
            split2<kSplit>(lo.x, lo.y, scale, head.x, tail.x);
            split2<kSplit>(lo.z, lo.w, scale, head.y, tail.y);
            split2<kSplit>(hi.x, hi.y, scale, head.z, tail.z);
            split2<kSplit>(hi.z, hi.w, scale, head.w, tail.w);
            const int at = slot + tile_of(t, j) + 128 * r + 16 * ((d_q + 4 * (a ^ d_odd)) ^ (r % 8));
            *reinterpret_cast<uint4*>(wgmma_smem + at) = head;
            if constexpr (kSplit) *reinterpret_cast<uint4*>(wgmma_smem + at + kHalfTile) = tail;
          }
    }
  };
  auto derive = [&](int slot, uint32_t (&k)[3]) {  // slot: the chunk's, bytes into smem
    if constexpr (kParts == 1) {
      derive_round(slot, k, std::integral_constant<unsigned, 7u>{});
    } else {
      derive_round(slot, k, std::integral_constant<unsigned, 5u>{});  // A, Cc
      derive_round(slot, k, std::integral_constant<unsigned, 2u>{});  // B (its warp_max entries B's own)
    }
    wgmma::fence_shared_writes();  // (the derived tiles, to wgmma)
    named_sync(kOwn + me);         // every thread's (and warp_max read: free for the next chunk)
  };

  // part j of a float32 state at `tiles` (the master's place, or the state-only hand-off's): this
  // thread's 32 elements written, read
  auto write_tile = [&](float4* tiles, int j, const float (&s)[32]) {
#pragma unroll
    for (int v = 0; v < 8; ++v)
      tiles[kMasterPart * j + 128 * v] = make_float4(s[4 * v], s[4 * v + 1], s[4 * v + 2], s[4 * v + 3]);
  };
  auto read_tile = [&](const float4* tiles, int j, float (&s)[32]) {
#pragma unroll
    for (int v = 0; v < 8; ++v) {
      const float4 x = tiles[kMasterPart * j + 128 * v];
      s[4 * v] = x.x, s[4 * v + 1] = x.y, s[4 * v + 2] = x.z, s[4 * v + 3] = x.w;
    }
  };
  auto write_master = [&](int j, const float (&s)[32]) { write_tile(master, j, s); };
  auto read_master = [&](int j, float (&s)[32]) { read_tile(master, j, s); };
  // S16 part j (rows e, columns m): this thread's pair (e = row + 8 h, m = 8 jj + 2 q4) at
  // (s16_at ^ 16 jj) + 1024 h + kTile j
  const uint32_t s16_at = uint32_t(L::kS16 + 128 * row + 16 * g + 4 * q4);
  // S (the values in the accumulator layout, kParts tiles) into the master and S16, one scale for
  // all its parts; S16's scale exponent into sigma[me]. (kKeySums) z (an owner's columns) into
  // its master and Z16, ζ into zeta[me].
  auto publish = [&](const float (&s)[kParts][32], const float (&z)[kKeyParts][2]) {
    float largest = 0.f;
#pragma unroll
    for (int j = 0; j < kParts; ++j) {
      write_master(j, s[j]);
      largest = fmaxf(largest, largest_magnitude<0, 32>(s[j]));
    }
    offer_largest(3, __float_as_uint(largest));
    if constexpr (kForwardSums) offer_largest(4, __float_as_uint(keys.largest(z)));
    named_sync(kOwn + me);
    // (after the sync: dq's and dk's threads read every column of the master's z before the chunk first)
    if constexpr (kKeySums) keys.write(z);
    const uint32_t k = tile_exponent(3);
    const float scale = scale_of(k);
#pragma unroll
    for (int j = 0; j < kParts; ++j)
#pragma unroll
      for (int jj = 0; jj < 8; ++jj)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t at = (s16_at ^ (16 * jj)) + 1024 * h + kTile * j;
          uint32_t head, tail;
          split2<kSplit>(s[j][4 * jj + 2 * h], s[j][4 * jj + 2 * h + 1], scale, head, tail);
          *reinterpret_cast<uint32_t*>(wgmma_smem + at) = head;
          if constexpr (kSplit) *reinterpret_cast<uint32_t*>(wgmma_smem + at + kHalfTile) = tail;
        }
    if constexpr (kForwardSums) {  // (dq adds a z in float32: no copy)
      const uint32_t kz = tile_exponent(4);
      keys.template write_copy<kSplit>(wgmma_smem + L::kZ16, z, scale_of(kz));
      if (tid == 0) zeta[me] = kz;
    }
    if (tid == 0) sigma[me] = k;
  };
  // the state at the segment's end (kKeySums: and z, an owner's columns, from the first column tile)
  auto store_segment_end = [&](const float (&end)[kParts][32], const float (&z)[kKeyParts][2]) {
    const SegmentEnd<float> to(p, work.pair, work.segment, Da, Dc, kReverse, P == Pass::Forward, work.piece);
#pragma unroll
    for (int j = 0; j < kParts; ++j) wgmma::store_end(end[j], to.state, Da, Dc, work.k0 + C * j, work.m0);
    if constexpr (kForwardSums) {
      if (to.key_sum != nullptr && work.col_tile == 0 && keys.owner()) {
#pragma unroll
        for (int j = 0; j < kParts; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int64_t row = work.k0 + keys.column(j, e);
            if (row < Da) to.key_sum[row] = z[j][e];
          }
      }
    }
    if constexpr (kExtraRow) {  // (each column tile its own columns; in row tiles, tile 0's)
      if (to.extra != nullptr && extra_here && keys.owner()) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int64_t col = work.m0 + keys.column(0, e);
          if (col < Dc) to.extra[col] = z[0][e];
        }
      }
    }
  };

  if (state_only) {
    float total[kParts][32], key_total[kKeyParts][2] = {};  // (kKeySums: an owner's sums of k, dk's of e)
#pragma unroll
    for (int j = 0; j < kParts; ++j)
#pragma unroll
      for (int i = 0; i < 32; ++i) total[j][i] = 0.f;
    auto consume = [&](auto ring) {
      using R = decltype(ring);
      for (int64_t it = me; it < chunks; it += kConsumers) {
        const int64_t t0 = chunk_begin(it);
        const int n = work.chunk_len(t0, C);
        float row_terms[2];
        read_row_terms(t0, n, row_terms);
        mbarrier_wait(full(R::index(it)), R::phase(it));
        write_row_terms(n, row_terms);
        if constexpr (kKeySums) {  // (from the staged float32 k or q, before its derivation)
          float key_chunk[kKeyParts][2];
          key_chunk_sums(key_chunk, R::slot(it));
#pragma unroll
          for (int j = 0; j < kKeyParts; ++j) key_total[j][0] += key_chunk[j][0], key_total[j][1] += key_chunk[j][1];
        }
        uint32_t k[3];
        derive(R::slot(it), k);
        const uint32_t slot = base + uint32_t(R::slot(it));
        float sums[kParts][32];
        fence();
#pragma unroll
        for (int j = 0; j < kParts; ++j) {
          times<kSplit, 1>(sums[j], TileHalves<1>(slot + tile_of(1, j)), slot + L::kCc, false);  // 2^(β + γ) B^T Cc
        }
        commit();
        wait<0>();
        if (it + R::kSlots < chunks) mbarrier_arrive(empty(R::index(it)));
        const float inverse = power_of_two(254 - int(k[1]) - int(k[2]));
#pragma unroll
        for (int j = 0; j < kParts; ++j)
#pragma unroll
          for (int i = 0; i < 32; ++i) total[j][i] += sums[j][i] * inverse;
      }
    };
    if (deep_ring) {
      consume(StateRing{});
    } else {
      consume(PassRing{});
    }
    if (chunks > 1) {  // consumer 1's total to consumer 0, after the deep ring (kStateHandOff)
      float4* const totals = reinterpret_cast<float4*>(wgmma_smem + L::kStateHandOff) + tid;
      if (me == 1) {
#pragma unroll
        for (int j = 0; j < kParts; ++j) write_tile(totals, j, total[j]);
        if constexpr (kKeySums) keys.write(key_total);  // (the key sums' master: unused here)
        mbarrier_arrive(hand_off(0));
        return;
      }
      mbarrier_wait(hand_off(0), 0);
#pragma unroll
      for (int j = 0; j < kParts; ++j) {
        float theirs[32];
        read_tile(totals, j, theirs);
#pragma unroll
        for (int i = 0; i < 32; ++i) total[j][i] += theirs[i];
      }
      if constexpr (kKeySums) keys.read(key_total, key_total);
    }
    if (me == 0) store_segment_end(total, key_total);
    return;
  }

  if (me == 0) {  // the segment's start into S (kKeySums: and z), for chunk 0's A S
    float start[kParts][32], key_start[kKeyParts][2] = {};
#pragma unroll
    for (int j = 0; j < kParts; ++j) {
      wgmma::load_start(start[j], p, work.pair, work.segment, Da, Dc, /*zero=*/false, work.k0 + C * j, work.m0);
    }
    if constexpr (kForwardSums) {
      KeySum<kParts>::clear_copy(wgmma_smem + L::kZ16, tid);
      const SegmentStart<float> from(p, work.pair, work.segment, Da, Dc);
#pragma unroll
      for (int j = 0; j < kParts; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int64_t row = work.k0 + keys.column(j, e);
          key_start[j][e] = keys.owner() && row < Da ? from.key_sum(row) : 0.f;
        }
    }
    if constexpr (kExtraRow) {  // (with_state_io's z0 or dk's de1, or the forward's key sums at segments)
      const SegmentStart<float> from(p, work.pair, work.segment, Da, Dc);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t col = work.m0 + keys.column(0, e);
        key_start[0][e] = keys.owner() && col < Dc ? from.extra(col) : 0.f;
      }
    }
    publish(start, key_start);
    wgmma::fence_shared_writes();
    named_sync(kOwn + me);
  }
  const float factor = float(p.scale);  // each output times the pass's constant factor (wgmma_product.cuh)
  const uint32_t s16 = base + uint32_t(L::kS16);
  for (int64_t it = me; it < chunks; it += kConsumers) {
    const int64_t t0 = chunk_begin(it);
    const int n = work.chunk_len(t0, C);
    float row_terms[2];
    read_row_terms(t0, n, row_terms);
    mbarrier_wait(full(PassRing::index(it)), PassRing::phase(it));
    write_row_terms(n, row_terms);
    // A row tile launched after another adds into outputs that launch wrote, mostly gone from the
    // L2 by now: the chunk's output lines fetched ahead, while its products run, so that the
    // reductions at its end meet them there (the four lanes of a quad 64 bytes of a row each)
    if (later_tile_launch && 16 * q4 < work.cols) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (row + 8 * h < n) prefetch_l2(out_rows + (t0 + row + 8 * h) * ops.out_l + work.m0 + 16 * q4);
      }
    }
    float key_chunk[kKeyParts][2];  // (kKeySums) an owner's sums of the chunk's k: z's update (dk's e's)
    if constexpr (kKeySums) key_chunk_sums(key_chunk, PassRing::slot(it));
    // (kExtraRow) each output row's factor and the weight of z (e) in it: dq's scale / den[t] and
    // a[t] scale / den[t], with a[t] = -dO[t] . O[t] beside each score of row t, read while the
    // chunk derives; dk's scale and scale (its a is a column's: RowTerms)
    // In row tiles (the outputs their sum) the extra row's terms are row tile 0's alone.
    float extra_a[2] = {0.f, 0.f}, extra_factor[2] = {0.f, 0.f}, extra_weight[2] = {0.f, 0.f};
    if constexpr (kExtraRow && !kReverse) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (row + 8 * h < n) {
          extra_a[h] = extra_here ? -ops.dout_dot_out[t0 + row + 8 * h] : 0.f;
          extra_factor[h] = factor / ops.den[t0 + row + 8 * h];
          extra_weight[h] = extra_a[h] * extra_factor[h];
        }
      }
    } else if constexpr (kExtraRow) {
      extra_factor[0] = extra_factor[1] = factor;
      extra_weight[0] = extra_weight[1] = extra_here ? factor : 0.f;
    }
    uint32_t k[3];  // α, β, γ
    derive(PassRing::slot(it), k);
    const uint32_t slot = base + uint32_t(PassRing::slot(it));
    float score[32], out_pc[32], out_as[32], sums[kParts][32];
    float pc_inverse[2];
    float row_sums[2] = {0.f, 0.f};  // (kForwardSums) the masked scores' (2^(α + β) scaled), rows row, row + 8
    fence();
#pragma unroll
    for (int j = 0; j < kParts; ++j) {  // 2^(α + β) A B^T, over the parts' K
      times<kSplit, 0>(score, TileHalves<0>(slot + tile_of(0, j)), slot + tile_of(1, j), j > 0);
    }
    commit();
    {
      wait<0>();
      // P = mask(scores') 2^p_r: register r of k-step s holds n-tile 2 s + r / 2, entries 2 (r % 2)
      // (+1) of the scores' accumulator (rows row + 8 (r % 2))
      HalfFragments pf;
      float x[4][4][2];
      float largest[2] = {0.f, 0.f};
      // (kExtraRow) the scores in their own units, each kept one plus its row's a (dk: its
      // column's): scaled, a times 2^(α + β) could overflow where the chunk's v (dk: dO) is all
      // zeros (β then 2^126)
      const float score_inverse = kExtraRow ? power_of_two(254 - int(k[0]) - int(k[1])) : 1.f;
#pragma unroll
      for (int s = 0; s < 4; ++s)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int t = 16 * s + 2 * q4 + 8 * (r / 2), h = r % 2;  // timestep (column) of entry 0
          const int rr = row + 8 * h;
          float2 column_a = make_float2(0.f, 0.f);  // (kColumnTerms) a of columns t, t + 1
          if constexpr (kColumnTerms) {
            if (extra_here) column_a = *reinterpret_cast<const float2*>(terms.a() + t);
          }
#pragma unroll
          for (int d = 0; d < 2; ++d) {
            const bool kept = kReverse ? t + d >= rr : t + d <= rr;
            const float value = score[4 * (2 * s + r / 2) + 2 * h + d];
            const float extra = kColumnTerms ? (d == 0 ? column_a.x : column_a.y) : extra_a[h];
            x[s][r][d] = !kept ? 0.f : kExtraRow ? fmaf(value, score_inverse, extra) : value;
            largest[h] = fmaxf(largest[h], fabsf(x[s][r][d]));
            if constexpr (kForwardSums) row_sums[h] += x[s][r][d];
          }
        }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t kp = scale_exponent(quad_max(largest[h]));
        largest[h] = scale_of(kp);
        // out_pc = 2^(α + β + p_r + γ) P Cc (kExtraRow: 2^(p_r + γ) P Cc; kKeySums: the factor a
        // row's, at the store)
        const int scores_scale = kExtraRow ? 0 : 254 - int(k[0]) - int(k[1]);
        pc_inverse[h] = power_of_two(scores_scale + 254 - int(kp) - int(k[2])) * (kKeySums ? 1.f : factor);
        if constexpr (kForwardSums) {  // the whole rows' sums, unscaled
          row_sums[h] += __shfl_xor_sync(0xffffffffu, row_sums[h], 1);
          row_sums[h] += __shfl_xor_sync(0xffffffffu, row_sums[h], 2);
          row_sums[h] *= power_of_two(254 - int(k[0]) - int(k[1]));
        }
      }
#pragma unroll
      for (int s = 0; s < 4; ++s)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          split2<kSplit>(x[s][r][0], x[s][r][1], largest[r % 2], pf.head[s][r], pf.tail[s][r]);
        }
      fence();
      times<kSplit, 1>(out_pc, RegisterHalves{pf}, slot + L::kCc, false);  // 2^(α + β + p_r + γ) P Cc
      // at two parts P Cc is a group of its own, waited for before A S (below): its fragments'
      // registers then hold A S's accumulators (all four products in flight at once spilled)
      if constexpr (kParts == 2) commit();
#pragma unroll
      for (int j = 0; j < kParts; ++j) {  // 2^(β + γ) B^T Cc, a tile of the state's rows each
        times<kSplit, 1>(sums[j], TileHalves<1>(slot + tile_of(1, j)), slot + L::kCc, false);
      }
      commit();
    }
    // S holds the state before chunk it: the other consumer's update, its hand-off (it - 1) / 2
    if (it > 0) mbarrier_wait(hand_off(me), uint32_t((it - 1) / kConsumers) & 1u);
    if constexpr (kParts == 2) wait<1>();  // P Cc done (the sums may still run)
    const int handed = it > 0 ? other : 0;  // the consumer that published S (and z) for this chunk
    const float as_inverse = power_of_two(254 - int(k[0]) - int(sigma[handed])) * (kKeySums ? 1.f : factor);
#pragma unroll
    for (int j = 0; j < kParts; ++j) {  // 2^(α + σ) A S, over the parts' K
      times<kSplit, 1>(out_as, TileHalves<0>(slot + tile_of(0, j)), s16 + kTile * j, j > 0);
    }
    float key_dots[4];  // (kForwardSums) 2^(α + ζ) A Z16: q . z's head and tail parts (KeySum)
    float key_inverse = 0.f;
    if constexpr (kForwardSums) {
      key_inverse = power_of_two(254 - int(k[0]) - int(zeta[handed]));
#pragma unroll
      for (int j = 0; j < kParts; ++j) {
        times_key_sum<kSplit>(key_dots, TileHalves<0>(slot + tile_of(0, j)), keys.copy + 1024 * j, j > 0);
      }
    }
    commit();
    // S += the sums, rounded in float32, while A S runs (P Cc's and the sums' group done), handed
    // to the other consumer for chunk it + 1 once A S has read S16
    {
      wait<1>();
      const float inverse = power_of_two(254 - int(k[1]) - int(k[2]));
      float s[kParts][32], z[kKeyParts][2] = {};
#pragma unroll
      for (int j = 0; j < kParts; ++j) {
        read_master(j, s[j]);
#pragma unroll
        for (int i = 0; i < 32; ++i) s[j][i] += sums[j][i] * inverse;
      }
      if constexpr (kKeySums) keys.read(z, key_chunk);  // z after the chunk
      wait<0>();
      // the slot read: chunk it + depth may come
      if (it + PassRing::kSlots < chunks) mbarrier_arrive(empty(PassRing::index(it)));
      // (kExtraRow) A S in its final units, each row's z (e) added (z before the chunk, in the
      // master until this consumer's publish): dq's out_as = scale / den[t] (A S + a[t] z), dk's
      // scale (A S + e)
      if constexpr (kExtraRow) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float2 zc = *reinterpret_cast<const float2*>(keys.master + 8 * j + 2 * q4);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float weight = extra_weight[h], as_factor = as_inverse * extra_factor[h];
            out_as[4 * j + 2 * h] = fmaf(out_as[4 * j + 2 * h], as_factor, weight * zc.x);
            out_as[4 * j + 2 * h + 1] = fmaf(out_as[4 * j + 2 * h + 1], as_factor, weight * zc.y);
          }
        }
      }
      if (it + 1 < chunks) {
        publish(s, z);
        wgmma::fence_shared_writes();  // (for the other's A S)
        mbarrier_arrive(hand_off(other));
      } else {  // the segment's end: S after the last chunk
        store_segment_end(s, z);
      }
    }
    // (kForwardSums) each row's den, stored by the first column tile for the backward (after the
    // outputs), and its factor scale / den in both inverses. In row tiles (two at most: wgmma_takes)
    // each tile's part of den (row tile 0's with eps) is summed as the outputs are, which stay
    // undivided: the launcher divides them by den after the pass (divide_by_den).
    float pc_row[2] = {pc_inverse[0], pc_inverse[1]}, as_row[2] = {as_inverse, as_inverse};
    float den[2] = {0.f, 0.f};  // (kForwardSums) this tile's part: all of it in one tile
    if constexpr (kExtraRow) {  // (out_as final already)
#pragma unroll
      for (int h = 0; h < 2; ++h) pc_row[h] *= extra_factor[h], as_row[h] = 1.f;
    }
    if constexpr (kForwardSums) {
      const int quad_lead = lane & ~3;  // (q4 = 0 holds z's columns of A Z16)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float dot = __shfl_sync(0xffffffffu, (key_dots[2 * h] + key_dots[2 * h + 1]) * key_inverse, quad_lead);
        den[h] = (work.k0 == 0 ? float(p.eps) : 0.f) + factor * (row_sums[h] + dot);
        const float row_factor = row_tiles > 1 ? factor : factor / den[h];
        pc_row[h] *= row_factor, as_row[h] *= row_factor;
      }
    }

    float* to = out_rows + (t0 + row) * ops.out_l + work.m0 + 2 * q4;  // row, then row + 8
    const int64_t to_h = 8 * ops.out_l;
    // (the factor in the inverses, each a power of two: one FMUL an output fewer; an output near
    // float32's underflow may round differently, as any product scaled back there does)
    auto value = [&](int i) { return out_pc[i] * pc_row[(i / 2) % 2] + out_as[i] * as_row[(i / 2) % 2]; };
    auto stores = [&](auto store) {
      auto each = [&](auto inside) {
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            if (inside(h, j)) store(to + h * to_h + 8 * j, value(4 * j + 2 * h), value(4 * j + 2 * h + 1));
          }
      };
      if (n == C && work.cols == C) {
        each([](int, int) { return true; });
      } else {  // (cols: a multiple of 4)
        each([&](int h, int j) { return row + 8 * h < n && 8 * j + 2 * q4 < work.cols; });
      }
    };
    if (adds_outputs) {  // (see adds_outputs: in the grid 0 + x + y, either order alike; one launch a tile in order)
      // one launch a tile: the tile before has finished (launch_after_row_tile; at once where this
      // launch did not start early)
      if (later_tile_launch && it < kConsumers) wait_for_launch_before();
      stores(add_pair);
    } else {
      stores([](float* at, float x, float y) { *reinterpret_cast<float2*>(at) = make_float2(x, y); });
    }
    if (kForwardSums && work.col_tile == 0 && q4 == 0) {  // den (in row tiles its parts, as the outputs)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float* const at = static_cast<float*>(p.den) + work.den_row + t0 + row + 8 * h;
        if (row + 8 * h < n) adds_outputs ? void(atomicAdd(at, den[h])) : void(*at = den[h]);
      }
    }
  }
  if (chunks == 0 && me == 0) {  // an empty segment: its end is its start
    float end[kParts][32], z[kKeyParts][2] = {}, none[kKeyParts][2] = {};
#pragma unroll
    for (int j = 0; j < kParts; ++j) read_master(j, end[j]);
    if constexpr (kKeySums) keys.read(z, none);
    store_segment_end(end, z);
  }
#else
  __trap();  // built without sm_90a: the dispatcher never launches this (see wgmma_takes)
#endif
}

}  // namespace cuda
}  // namespace fast_causal_attn
