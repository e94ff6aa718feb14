// The chunked product on Hopper's warpgroup MMA (wgmma, sm_90a): bfloat16 and float16, the
// state's rows and columns up to 256 (dk with dv in one pass: 128); normalize in the forward and
// dq up to 128 rows and in dk with dv up to 64 (KeySums, RowTerms). Per chunk
// of C = 64 timesteps (tensorcore_product.cuh's products; at E = M = 64 one warpgroup a block):
//
//   scores = A B^T,  out = A S + mask(scores) Cc,  S += B^T Cc
//
// in 20 wgmma instructions (16 for float16's one-part state copy) where the mma.sync kernel
// issues about 480 HMMA and their ldmatrix loads (bf16 8,16,2048,64 on the H200: 43 us for the
// forward kernel, the mma.sync kernels 75; RESULTS.md, seventeenth session). A, B and Cc are
// staged by cp.async (each pass alone: by a producer warpgroup of its own), three chunks deep
// (two where Da is above 128), into one layout that serves
// every role: element (r, c) of a 64 x 64 tile at 128 r + 16 ((c / 8) ^ (r % 8)) + 2 (c % 8) bytes (128-byte
// rows whose 16-byte groups are permuted by the row: wgmma's 128-byte swizzle, CUTLASS's
// Swizzle<3,4,3>), rows past the chunk and columns past Da / Dc zero. See Stager for why.
// The state S (64 x 64 float32; above 64, row blocks, and column halves or, at four row blocks,
// row halves on two warpgroups) lives in the warpgroups' accumulators; its copy for A S is kept
// as the mma.sync kernel keeps it: two bfloat16 parts (S = hi + lo), or one float16 part scaled
// by a power of two where S passes float16's range.
//
// What runs around the chunk loop is the tensor-core family's: chunked::BlockWork (pairs,
// segments, state-only blocks, packed sequences), Operands (each pass's rows and strides),
// SegmentStart / SegmentEnd and, on the host, SegmentWorkspace and launch_segmented. The kernels
// run each pass alone (wgmma_product_kernel: the forward and dq, and dk and dv as two reverse
// passes where E or M is above 128), and dk with dv in one reverse pass (wgmma_grad_kv_kernel,
// wgmma_grad_kv_wide_kernel above 64), one block a (sequence, head, time segment), where
// wgmma_takes says; the rest of the normalized backward (and states with packed sequences) stay
// with the mma.sync kernels. A state in or out: each block starts from SegmentStart (a given
// start added to the segments' sums) and the last in pass order writes SegmentEnd's (dk with dv
// in one pass: the initial state's gradient transposed, run_grad_kv); the key sums beside it are
// launch_wgmma's, but under normalize the kernels' own (KeySums).
//
// Without normalize every row factor is the constant scale (q's in the forward, the output's in
// dq, q's again in dk and dv, which are linear in it), so rows are staged as they are and the
// outputs are multiplied by scale in float32.
//
// The kernel is compiled for sm_90a only (its body needs __CUDA_ARCH_FEAT_SM90_ALL); the build
// defines FAST_CAUSAL_ATTN_SM90A when its arch list holds 9.0a, and the dispatcher takes the
// kernel on devices of compute capability 9.0 then.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "chunked_product.cuh"
#include "tensorcore_product.cuh"  // rows_are_vectors, take_forward_segments

namespace fast_causal_attn {
namespace cuda {
namespace wgmma {

constexpr int C = 64;              // timesteps a chunk; the state's rows and columns, zero-padded
constexpr int kThreads = 128;      // one warpgroup
constexpr int kTile = C * 64 * 2;  // bytes of a 64 x 64 bfloat16 tile (1024-byte aligned: the swizzle's period)
constexpr int kStages = 3;         // chunks staged (two on their way; a fourth measured no faster)
// The forward-direction kernel's stage slots for A and B of kAtoms atoms: three, but two at four
// atoms (Da up to 256), whose slot (A, B: 8 tiles, Cc: 1) and two-part state copy (8 tiles) leave
// room for two (217 KB of the 227 KB a block may have; 224 KB with the state's rows on two
// warpgroups, their partial outputs' exchange in place of the staging rows).
__host__ __device__ constexpr int stages_for_atoms(int atoms) { return atoms > 2 ? 2 : kStages; }
constexpr int kOutStride = 64 + 8;  // the outputs' staging rows, in elements (16 bytes of padding)
constexpr int kStagingBytes = 64 * kOutStride * 2;
// The normalized backward's per-row terms (RowTerms: dO[t] . O[t], den[t]), 64 floats a
// term a stage slot.
__host__ __device__ constexpr int row_terms_bytes(int slots, int terms) { return slots * terms * 64 * 4; }
// the normalized dk-with-dv kernel's extra row e (KeySums, 64 floats), after its warps' largest
// |S|, and its chunks' dO . O and den in up to six slots (the pass's ring, or the sums' deeper one:
// sum_depth)
constexpr int kNormalizedGradKVBytes = 64 * 4 + row_terms_bytes(6, 2);
// the normalized one-pass backward's (wgmma_grad_kv_kernel's kWithDq): the same, and dq's extra
// row's key sum (minus the forward's, taken down a chunk at a time: 64 floats) beside e
constexpr int kNormalizedOnePassBytes = kNormalizedGradKVBytes + 64 * 4;
// the wide dk-with-dv kernel's: e over up to 128 columns, and each chunk's dO . O and den in up to
// six slots (its pass's two, or its state-only walk's deeper ring)
constexpr int kNormalizedWideBytes = 128 * 4 + row_terms_bytes(6, 2);
// `stages` x slot_tiles tiles ({A, B, each group's Cc}: 2 kAtoms + kGroups; {q, k, v, dO} for dk
// and dv, kAtoms each), the state copies (two parts, bfloat16; float16 uses one) in copy_tiles, and
// for each of `groups` warpgroups its outputs' staging rows and its warps' largest |S| (float16's
// copy scale)
__host__ __device__ constexpr size_t smem_bytes(int slot_tiles, int copy_tiles = 2, int groups = 1,
                                                int stages = kStages) {
  return size_t(stages * slot_tiles + copy_tiles) * kTile + groups * (kStagingBytes + 4 * sizeof(float));
}
// wgmma_product_kernel's layout for `atoms` atoms on `groups` warpgroups, which the kernel and its
// launch both read. At four atoms on two warpgroups (splits_rows: the state's rows split between
// them; see wgmma_product_kernel) a slot holds one Cc, each group copies its two atoms, and the
// second's partial outputs reach the first through kExchangeBytes (64 x 64 float32), where the
// first's staging rows lie too; otherwise each group its own Cc, copy and staging rows. bfloat16
// at two atoms on two warpgroups (producer_scores): the producer computes each chunk's masked
// scores P into a ring of kScoresDepth tiles read by both groups' P Cc, and each group stages its
// outputs over its copy's first tiles (9 KB of its four: the copy is dead between its A S and the
// next chunk's copy) where the staging rows were. Measured (RESULTS.md, thirty-third session):
// there the forward and dq 4-11% faster; float16 there 1-3% slower (its P Cc kept apart from A S
// until that is scaled back), one atom 1-6% slower, (2, 1) and (1, 2) even.
// The forward and dq under normalize (KeySums): each group's key sum, 128 floats, after the warps'
// largest |S|; the producer leaves the scores to the consumers (they need their row sums), and at
// two atoms on two groups each group stages its outputs over its copy, as with producer_scores
// (the staging rows would not fit beside the key sums: 226 KB of the 227 without them). At four
// atoms on two groups (splits_rows) each group's z covers its own two atoms, and the second's
// partial row sums of den reach the first beside its partial outputs (den_parts_bytes): the
// forward 225.5 KB, dq (its row terms in their place) 226.
constexpr int kExchangeBytes = 64 * 64 * 4;
constexpr int kDenPartsBytes = 4 * 16 * 2 * 4;  // (ProductLayout::den_parts_bytes)
constexpr int kScoresDepth = 2;
struct ProductLayout {
  int atoms, groups;
  bool half;               // float16 (its state copy scaled), not bfloat16
  bool normalize = false;  // the normalizer (KeySums)
  bool row_terms = false;  // the gradients' under normalize: each stage slot's dO . O and den (RowTerms)
  __host__ __device__ constexpr bool splits_rows() const { return atoms == 4 && groups == 2; }
  __host__ __device__ constexpr int state_atoms() const { return splits_rows() ? 2 : atoms; }  // a group's
  __host__ __device__ constexpr int cc_tiles() const { return splits_rows() ? 1 : groups; }  // a column tile's
  __host__ __device__ constexpr int slot_tiles() const { return 2 * atoms + cc_tiles(); }    // A, B, Cc
  __host__ __device__ constexpr int copy_tiles() const { return 2 * state_atoms() * groups; }  // two parts
  __host__ __device__ constexpr bool producer_scores() const {
    return atoms == 2 && groups == 2 && !half && !normalize;
  }
  __host__ __device__ constexpr int scores_tiles() const { return producer_scores() ? kScoresDepth : 0; }
  // each group's outputs staged over its copy's first tiles (the copy is dead between its A S and
  // the next chunk's copy), not in staging rows of their own
  __host__ __device__ constexpr bool stages_over_copy() const {
    return producer_scores() || (normalize && atoms == 2 && groups == 2);
  }
  __host__ __device__ constexpr int staging_bytes() const {
    return splits_rows() ? kExchangeBytes : stages_over_copy() ? 0 : groups * kStagingBytes;
  }
  // (a group's 128 floats: the forward's z over its two atoms, dq's over its 64 columns twice)
  __host__ __device__ constexpr int key_sum_bytes() const { return normalize ? groups * 128 * 4 : 0; }
  // the forward's under normalize at four atoms (splits_rows; dq reads its den from the row terms):
  // the second group's partial row sums of the normalizer for the first, two floats each of a
  // warp's 16 rows, beside its partial outputs
  __host__ __device__ constexpr int den_parts_bytes() const {
    return normalize && splits_rows() && !row_terms ? kDenPartsBytes : 0;
  }
  // bfloat16's forward under normalize, but at four atoms (splits_rows: partial row sums): a 64 x
  // 8 tile of ones (1 KB, 1024-aligned after the staging rows), B of the n8 products that sum P's
  // rows and (one atom) k's columns on the tensor cores (rows_of_ones, column_sums_of_ones); at
  // one atom, each group's copy of z for q . z there too (KeySums::publish_copy: two 1 KB parts).
  // Measured (RESULTS.md, sixty-eighth session, H100): bfloat16 1-2% faster; float16 5-6% slower
  // at 8,16,2048,64 (its copy of z needed a scale), so float16 keeps the sums on the CUDA cores.
  __host__ __device__ constexpr int ones_bytes() const {
    return normalize && !half && !row_terms && !splits_rows() ? 1024 + (atoms == 1 ? groups * 2048 : 0) : 0;
  }
  // the stage slots, the copies and P's ring (tiles), the staging rows, the ones, each group's
  // warps' largest |S|, the key sums, the row terms or the den parts
  __host__ __device__ constexpr size_t smem_bytes() const {
    return size_t(stages_for_atoms(atoms) * slot_tiles() + copy_tiles() + scores_tiles()) * kTile +
           staging_bytes() + ones_bytes() + groups * 4 * sizeof(float) + key_sum_bytes() +
           (row_terms ? row_terms_bytes(stages_for_atoms(atoms), 2) : 0) + den_parts_bytes();
  }
};
// pass P's layout, the kernel's and its launch's alike (the gradients keep their row terms under
// normalize)
__host__ __device__ constexpr ProductLayout product_layout(Pass P, int atoms, int groups, bool half, bool normalize) {
  return ProductLayout{atoms, groups, half, normalize, normalize && P != Pass::Forward};
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// A shared-memory operand in the 128-byte swizzle (bits 62-63 = 1): bits 0-13 address >> 4, 16-29
// the leading byte offset >> 4, 32-45 the stride byte offset >> 4. A tile's 64 columns are one
// swizzle atom wide, so the leading offset (between atoms along M or N, MN-major; unused K-major)
// never counts, and the stride offset is 1024 both ways: K-major, between groups of 8 rows along M
// or N; MN-major, between groups of 8 rows along K (CUTLASS make_gmma_desc's canonical layouts).
// A k16 step moves the start address (32 bytes along the columns, 2048 along the rows); the
// hardware swizzles the absolute address, so each tile starts at a multiple of 1024 bytes.
__device__ __forceinline__ uint64_t descriptor(uint32_t address) {
  constexpr uint64_t kOffsets = (uint64_t(1024 >> 4) << 16) | (uint64_t(1024 >> 4) << 32);
  return uint64_t((address & 0x3FFFF) >> 4) | kOffsets | (uint64_t(1) << 62);
}
// The descriptor of tile + bytes: tile's with bytes / 16 added to its address field, which does not
// carry out (shared addresses lie below 2^18). Built whole for each k-step, the descriptors took a
// third of the four-atom forward's instructions (ncu, RESULTS.md, twenty-second session); built
// once a tile (the compiler keeps descriptor(tile) for each distinct tile) they take one add.
__device__ __forceinline__ uint64_t descriptor(uint32_t tile, uint32_t bytes) {
  const uint64_t d = descriptor(tile);
  return (d & 0xFFFFFFFF00000000ull) | uint32_t(uint32_t(d) + bytes / 16);
}
// Operand views of a staged tile (rows r, columns c), k16 step s: K along the columns (A and B of
// the scores, A of A S) or along the rows (B^T and Cc of the state's update, Cc of P Cc, the state
// copy as B of A S); `bytes`: from the tile's start (another atom, part or row block).
__device__ __forceinline__ uint64_t k_along_columns(uint32_t tile, int s, uint32_t bytes = 0) {
  return descriptor(tile, bytes + 32 * s);
}
__device__ __forceinline__ uint64_t k_along_rows(uint32_t tile, int s, uint32_t bytes = 0) {
  return descriptor(tile, bytes + 2048 * s);
}

#define FCA_WGMMA_D32(d)                                                                                          \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),     \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),       \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),      \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define FCA_WGMMA_D32_LIST                                                                                  \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31}"

// d (64 x 64 float32: warp w rows 16 w + g (+8), n-tile j columns 8 j + 2 q (+1) in d[4 j ..]) +=
// A B^T, both from shared memory, bfloat16 or (kHalf) float16; kTransA / kTransB: that operand is
// MN-major. accumulate = false: d = A B^T (an accumulator's first product; zeroing d with
// ordinary instructions let nvcc place the zeros between two wgmma groups, where ptxas then
// waited for every product in flight).
template <bool kHalf, int kTransA, int kTransB>
__device__ __forceinline__ void mma_ss(float (&d)[32], uint64_t a, uint64_t b, bool accumulate = true) {
  if constexpr (kHalf) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " FCA_WGMMA_D32_LIST
        ", %32, %33, p, 1, 1, %35, %36;\n}\n"
        : FCA_WGMMA_D32(d)
        : "l"(a), "l"(b), "r"(accumulate ? 1 : 0), "n"(kTransA), "n"(kTransB));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " FCA_WGMMA_D32_LIST
        ", %32, %33, p, 1, 1, %35, %36;\n}\n"
        : FCA_WGMMA_D32(d)
        : "l"(a), "l"(b), "r"(accumulate ? 1 : 0), "n"(kTransA), "n"(kTransB));
  }
}
// The same with A from registers: each warp its 16 rows in mma.sync's m16n8k16 A fragment (float32's
// wgmma kernel starts its accumulators with accumulate = false).
template <bool kHalf, int kTransB>
__device__ __forceinline__ void mma_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t b, bool accumulate = true) {
  if constexpr (kHalf) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " FCA_WGMMA_D32_LIST
        ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
        : FCA_WGMMA_D32(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate ? 1 : 0), "n"(kTransB));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " FCA_WGMMA_D32_LIST
        ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
        : FCA_WGMMA_D32(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate ? 1 : 0), "n"(kTransB));
  }
}
#undef FCA_WGMMA_D32
#undef FCA_WGMMA_D32_LIST
// d (64 x 8 float32: warp w rows 16 w + g (+8), columns 2 q (+1): d[0], d[1] row g, d[2], d[3]
// row g + 8) += A B^T, bfloat16, A from registers as mma_rs's, B (8 x 16) K-major from shared
// memory (the n8 products of bfloat16's normalizer sums: rows_of_ones)
__device__ __forceinline__ void mma_rs_n8(float (&d)[4], const uint32_t (&a)[4], uint64_t b, bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate ? 1 : 0));
}

__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Named barriers of `threads` threads (0 is __syncthreads'): sync waits for them all, arrive
// counts this thread and goes on; the shared-memory writes before either are seen by the threads
// that sync after. kAnyPath: for a barrier that warpgroups running different code share
// (wgmma_grad_kv_kernel's kWithDq): bar.sync and bar.arrive are .aligned, every thread at a
// barrier on the same instruction, which two code paths break (compute-sanitizer's synccheck:
// "Divergent thread(s) in block"); barrier.sync and barrier.arrive (not .aligned) let them share it.
template <bool kAnyPath = false>
__device__ __forceinline__ void named_sync(int id, int threads) {
  if constexpr (kAnyPath) {
    asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
  } else {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
  }
}
template <bool kAnyPath = false>
__device__ __forceinline__ void named_arrive(int id, int threads) {
  if constexpr (kAnyPath) {
    asm volatile("barrier.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
  } else {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
  }
}
// This warpgroup's registers a thread set to kCount (setmaxnreg; every warp of the warpgroup runs
// it): a producer gives back what its consumers take, within the block's allocation at launch.
template <int kCount>
__device__ __forceinline__ void registers_down_to() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kCount)); }
template <int kCount>
__device__ __forceinline__ void registers_up_to() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kCount)); }
// This thread's shared-memory writes (generic proxy) made visible to wgmma (async proxy).
__device__ __forceinline__ void fence_shared_writes() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Four 8 x 8 matrices of 16-bit pairs into shared memory (stmatrix.x4): lane l gives row l % 8 of
// matrix l / 8's address, and its register m holds its own row l / 4, columns 2 (l % 4) (+1) of
// matrix m. kTransposed (.trans): those land in rows 2 (l % 4) (+1), column l / 4 of memory
// matrix m (wgmma_transposed_kernel's outputs).
template <bool kTransposed = false>
__device__ __forceinline__ void store_matrices(uint32_t address, const uint32_t (&x)[4]) {
  if constexpr (kTransposed) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(address), "r"(x[0]),
                 "r"(x[1]), "r"(x[2]), "r"(x[3])
                 : "memory");
  } else {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(address), "r"(x[0]),
                 "r"(x[1]), "r"(x[2]), "r"(x[3])
                 : "memory");
  }
}

// An accumulator's pairs in stmatrix's order: matrix m of an x4 store of n-tiles 2 k and 2 k + 1
// holds n-tile 2 k + m / 2, rows + 8 (m % 2), each lane's pair of it at d[matrix_pair(k, m)]. The
// same index gives register A fragment a[m] of k16 step k (rows g, g + 8; k 2 q and 2 q + 8).
__device__ __forceinline__ int matrix_pair(int k, int m) { return 4 * (2 * k + m / 2) + 2 * (m % 2); }

// Two floats rounded to bfloat16 or (kHalf) float16, lo in the low half.
template <bool kHalf>
__device__ __forceinline__ uint32_t pack(float lo, float hi) {
  if constexpr (kHalf) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// Two 16-bit values (lo in the low half) as floats: pack's inverse.
template <bool kHalf>
__device__ __forceinline__ float2 unpack(uint32_t x) {
  if constexpr (kHalf) {
    return __half22float2(*reinterpret_cast<const __half2*>(&x));
  } else {
    return make_float2(__uint_as_float(x << 16), __uint_as_float(x & 0xffff0000u));
  }
}

// This thread's warpgroup in its block, broadcast from lane 0 (CUTLASS's
// canonical_warp_group_idx): a value the compiler then knows to be one across the warp, so that
// the shared-memory addresses built from it, and the wgmma descriptors from them, stay in uniform
// registers. From threadIdx.x / 128 directly, each descriptor took its own R2UR (136 in the loop
// of the four-atom forward on two warpgroups, 16 this way; 255 registers, 214 this way).
__device__ __forceinline__ int warpgroup() { return __shfl_sync(0xffffffffu, int(threadIdx.x / kThreads), 0); }
// This thread's warp within its warpgroup (a block runs one warpgroup or two, each its own
// products: the accumulators' rows follow the warp's rank in the warpgroup).
__device__ __forceinline__ int group_warp() { return int(threadIdx.x % kThreads) / kWarp; }

// A 16-byte copy that does not wait (cp.async); zeros when !valid.
__device__ __forceinline__ void copy_16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
// The same of 4 bytes (RowTerms: one float a row; cp.async's 4-byte copies take .ca only).
__device__ __forceinline__ void copy_4(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0) : "memory");
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace wgmma

namespace wgmma {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// One operand's rows as this thread copies them (Stager): row row0 of the next chunk to stage,
// column col of its first 64-column atom (col0, a column tile's first, where col is past the
// operand's width), the step of 16 rows between this thread's pieces, and which atoms' columns
// (col + 64 a: bit a) lie inside the operand's width (the others copy zeros from `next`, a valid
// address).
struct Source {
  const uint16_t* next;
  int64_t piece_step;
  uint32_t inside;
};

// This thread's 16-byte pieces of a staged tile: rows row0 + 16 i (i < 4) of one column group.
// Eight lanes copy one whole 128-byte row into one 128-byte row of the tile (its groups permuted
// by the swizzle): so the copies reach the L2 as whole lines. Into the unswizzled core-matrix
// layout (a row's eight groups 128 bytes apart), every 16-byte copy was its own request of one
// sector, each sector requested twice, for any assignment of lanes to pieces (three measured):
// 6.3 M sectors in 5.9 M L2 requests against fla's 3.1 M in 0.8 M, with the L2 78% busy at 2.1
// TB/s, the kernel's limit (H200 ncu, bf16 8,16,2048,64; RESULTS.md, seventeenth session). A row
// past the sequence or a column group past the operand's width is zeros. Each operand's next
// source row is kept and stepped a chunk at a time, and a whole chunk is copied without row tests
// (computed per piece and chunk, with 64-bit products and the row pointers reloaded from the
// parameters, the copies' address arithmetic was the kernel's most-executed and most-stalled
// work: H200 ncu, 8,16,2048). Every row is 16-byte vectors (launch_wgmma checks
// KernelParams::rows_are_vectors; the ops copy rows off 16-byte boundaries into aligned ones).
struct Stager {
  int row0, col;
  uint32_t piece0;  // row0's piece in a tile; piece i (16 rows on: the same row % 8) at + 2048 i
  __device__ explicit Stager(int tid) : row0(4 * (tid / kWarp) + (tid % kWarp) / 8), col(8 * (tid % 8)) {
    piece0 = uint32_t(row0 * 128 + ((col / 8) ^ (row0 % 8)) * 16);
  }
  // x's rows (x: a pointer and a row stride) from row `first` on, columns col0 on (a column
  // tile's first), the operand `width` columns wide in all.
  template <typename Rows>
  __device__ Source source(const Rows& x, int64_t first, int64_t width, int64_t col0 = 0) const {
    uint32_t inside = 0;
#pragma unroll
    for (int a = 0; a < 4; ++a) inside |= uint32_t(col0 + col + 64 * a < width) << a;
    return Source{reinterpret_cast<const uint16_t*>(x.ptr) + (first + row0) * x.stride + col0 + (inside & 1u ? col : 0),
                  16 * x.stride, inside};
  }
  // The chunk of n rows at src.next into `tile` (kAtoms 64-column atoms, kTile bytes apart) as
  // cp.async copies, zeros past n; `any`: a valid
  // address of the operand (the zero copies' source). Then src steps to the next chunk: C rows
  // on, or back (kBack).
  template <bool kBack, int kAtoms = 1>
  __device__ __forceinline__ void operator()(uint32_t tile, Source& src, const void* any, int n) const {
    constexpr uint32_t kAll = (1u << kAtoms) - 1;
    if (kAtoms > 2 && n == C && __all_sync(0xffffffffu, src.inside == kAll)) {
      // a whole chunk of every atom (the common case; asked of the warp, so that a width that ends
      // inside an atom sends no warp down both paths): each of the four rows' address once, the
      // atoms at constant offsets from it (LDGSTS's immediate), where each atom's pieces took
      // their own 64-bit adds. Four atoms only: measured on the H200 (RESULTS.md, twenty-fourth
      // session) it made the four-atom kernels 10-13% faster and the two-atom ones 2-4% slower.
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint16_t* row = src.next + i * src.piece_step;
#pragma unroll
        for (int a = 0; a < kAtoms; ++a) copy_16(tile + a * kTile + piece0 + 2048 * i, row + 64 * a, true);
      }
      src.next += kBack ? -4 * src.piece_step : 4 * src.piece_step;
      return;
    }
#pragma unroll
    for (int a = 0; a < kAtoms; ++a) {
      const uint32_t at = tile + a * kTile + piece0;
      const bool inside = (src.inside >> a) & 1u;
      const uint16_t* from0 = src.next + (inside ? 64 * a : 0);
      if (n == C) {
#pragma unroll
        for (int i = 0; i < 4; ++i) copy_16(at + 2048 * i, from0 + i * src.piece_step, inside);
      } else {  // a partial chunk: the sequence's last
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const bool valid = inside && row0 + 16 * i < n;
          copy_16(at + 2048 * i, valid ? static_cast<const void*>(from0 + i * src.piece_step) : any, valid);
        }
      }
    }
    src.next += kBack ? -4 * src.piece_step : 4 * src.piece_step;
  }
};

// The ring of kDepth stage slots the kernels stage their chunks into: chunk it in `slot`, the
// next kDepth - 2 on their way, each thread's copies of a chunk one cp.async group (committed by
// commit_copies even where it is empty, past the last chunk, so that the count in flight holds).
// With kDepth = 2 the next chunk's copies run behind this chunk's products only.
template <int kDepth = kStages>
struct StageRing {
  int slot = 0;  // chunk it's
  // Chunk it in shared memory for every thread and seen by wgmma (with whatever else each thread
  // wrote to shared memory before); after this, the slot of chunk it - 1 (refill) is free for
  // chunk it + kDepth - 1.
  __device__ __forceinline__ void arrive() const {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kDepth - 2) : "memory");
    fence_shared_writes();
    __syncthreads();
  }
  __device__ __forceinline__ int refill() const { return slot == 0 ? kDepth - 1 : slot - 1; }
  __device__ __forceinline__ void advance() { slot = slot + 1 == kDepth ? 0 : slot + 1; }
  __device__ __forceinline__ static void commit_copies() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
};

// The ring of kDepth stage slots a producer warpgroup fills for its consumers: slot s announced
// full by named barrier full0 + s once the producer's copies of its chunk have landed (the
// producer arrives, the consumers sync), and free again by full0 + kDepth + s once the
// consumers' products have read it (they arrive, the producer syncs before refilling it), each
// barrier of `threads` threads (the producer's and the consumers'). kReuse: how many chunks on
// the producer writes over what a chunk's products read (kDepth: its stage slot; fewer where it
// also writes a shallower ring, as P's), so the consumers release the chunks that have a chunk
// kReuse on. The consumers' ring (slot: their chunk it's); kAnyPath: consumer warpgroups that run
// different code on it (named_sync's).
template <int kDepth, int kReuse = kDepth, bool kAnyPath = false>
struct ProducedRing : StageRing<kDepth> {
  static_assert(2 <= kReuse && kReuse <= kDepth, "a chunk's slots outlive its products");
  int full0, threads;
  __device__ ProducedRing(int full0_, int threads_) : full0(full0_), threads(threads_) {}
  // The producer's walk: chunks 0 .. chunks - 1 staged by stage(it, slot), it = 0, 1, 2, ... in
  // order (one cp.async group each, committed even where it is empty), kDepth - 1 ahead; each
  // chunk, once this thread's copies have landed (and been fenced for wgmma), passed to
  // landed(it, slot) (what the producer derives from it, in a ring kReuse chunks deep) before it
  // is announced.
  template <typename Stage, typename Landed>
  __device__ void produce(int64_t chunks, Stage&& stage, Landed&& landed) const {
    for (int i = 0; i < kDepth - 1; ++i) stage(i, i);
    StageRing<kDepth> ring;
    for (int64_t it = 0; it < chunks; ++it, ring.advance()) {
      asm volatile("cp.async.wait_group %0;\n" ::"n"(kDepth - 2) : "memory");  // chunk it, this thread's copies
      fence_shared_writes();
      landed(it, ring.slot);
      named_arrive(full0 + ring.slot, threads);
      // the consumers done with chunk it - 1: its stage slot takes chunk it + kDepth - 1, its
      // derived ring's place chunk it - 1 + kReuse
      if (it > 0 && it + kReuse - 1 < chunks) named_sync(full0 + kDepth + ring.refill(), threads);
      stage(it + kDepth - 1, ring.refill());
    }
  }
  template <typename Stage>
  __device__ void produce(int64_t chunks, Stage&& stage) const {
    produce(chunks, stage, [](int64_t, int) {});
  }
  // The consumers: chunk it in `slot` for every consumer, seen by wgmma (with whatever each wrote
  // to shared memory before and fenced: fence_shared_writes); the slot released once the
  // chunk's products have run.
  __device__ void wait() const { named_sync<kAnyPath>(full0 + this->slot, threads); }
  __device__ void release(int64_t it, int64_t chunks) const {
    if (it + kReuse < chunks) named_arrive<kAnyPath>(full0 + kDepth + this->slot, threads);
  }
};

// dk and dv's walks that sum a segment's own dO^T Q alone (state-only blocks, a one-launch pass's
// first walk) stage two of the pass's four operands a chunk and use none of the rest of its shared
// memory: their ring takes the stage slots and the state copy's tiles (`area` tiles) in slots of
// `slot` tiles, up to kMaxSumDepth chunks deep, where the pass's ring keeps one or two chunks in
// flight behind the one summed. Those walks do one or two products a chunk: they wait on the
// copies (at 1,16,32768,128 bf16 the wide kernel's state-only launch moved 235 MB at 53% of the
// DRAM peak on two stages; ncu, RESULTS.md, twenty-eighth session). Measured on the H200 (bf16,
// kernel ms; RESULTS.md, twenty-ninth session): dk with dv 0.1430 -> 0.1319 at 4,16,8192,64 (one
// launch), 0.0361 -> 0.0338 at 2,4,8192,64, the wide kernel 0.3526 -> 0.3340 at 1,16,32768,128.
// The forward's state-only blocks keep the pass's ring: the same deeper ring there measured no
// faster (1,16,32768,128 forward 0.2315 -> 0.2361 ms).
constexpr int kMaxSumDepth = 6;
__host__ __device__ constexpr int sum_depth(int area, int slot) {
  return area / slot < kMaxSumDepth ? area / slot : kMaxSumDepth;
}

// A segment's own sums alone, chunk by chunk, by a block that stages its own chunks (the wide
// dk-with-dv kernel's state-only blocks): issue(it, slot)
// stages chunk it, it = 0, 1, 2, ... in order; add(slot) issues the sums' products on the chunk in
// `slot`, each chunk's waited for before its slot takes the next.
template <int kDepth, typename Issue, typename Add, typename Landed, typename Beside>
__device__ __forceinline__ void sum_chunks(int64_t chunks, Issue&& issue, Add&& add, Landed&& landed, Beside&& beside) {
  for (int i = 0; i < kDepth - 1; ++i) issue(i, i);
  StageRing<kDepth> ring;
  for (int64_t it = 0; it < chunks; ++it, ring.advance()) {
    ring.arrive();
    landed(it, ring.slot);  // (what is made of the chunk before its products; its own barrier)
    fence();
    add(ring.slot);
    commit();
    beside(ring.slot);  // (what else reads the chunk, while its products run)
    issue(it + kDepth - 1, ring.refill());
    wait<0>();
  }
}
template <int kDepth, typename Issue, typename Add>
__device__ __forceinline__ void sum_chunks(int64_t chunks, Issue&& issue, Add&& add) {
  sum_chunks<kDepth>(chunks, issue, add, [](int64_t, int) {}, [](int) {});
}

// The state's 16-bit copy, read by the products that multiply by the state, in the staged layout
// (state row r, column c at 128 r + 16 ((c / 8) ^ (r % 8)) + 2 (c % 8) bytes; kAtoms x 64 rows,
// the state's in row blocks of 64, state[a] rows 64 a on). bfloat16: hi = bf16(S) at `at`,
// lo = bf16(S - hi) kPart bytes after. float16 (one part, rounding 8x finer)
// holds S 2^-shift, shift chosen each chunk from the block's largest |S| so that the copy stays
// below 2^14 (float16 ends at 65504; a state can pass that long before any output does), and the
// products with the copy are multiplied back by scale = 2^shift (scale_back): the mma.sync
// kernel's scaled copy. The largest |S| is posted by each warp (post_max) before the barrier that
// precedes publish; the scale is the largest over kWarps warps: one warpgroup's (a copy that its
// own products read), or a block's two (one state in two copies, the products reading both).
// kTwoParts: float16 in two parts as well (the one-pass backward's T, whose chunk terms dq's
// strictly upper product takes back: wgmma_grad_kv_kernel's kWithDq), lo = fp16(S 2^-shift - hi).
template <bool kHalf, int kAtoms = 1, int kWarps = 4, bool kTwoParts = !kHalf>
struct StateCopy {
  static constexpr uint32_t kPart = kAtoms * kTile;
  using State = float[kAtoms][32];
  uint32_t at;
  float* warp_max;  // [kWarps], shared
  float scale = 1.f;

  // A state of one row block as State (kAtoms = 1).
  __device__ static const State& rows(const float (&state)[32]) { return reinterpret_cast<const State&>(state); }

  __device__ void post_max(const State& state) const {
    float largest = 0.f;
#pragma unroll
    for (int a = 0; a < kAtoms; ++a)
#pragma unroll
      for (int i = 0; i < 32; ++i) largest = fmaxf(largest, fabsf(state[a][i]));
#pragma unroll
    for (int offset = kWarp / 2; offset > 0; offset /= 2) largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, offset));
    if (threadIdx.x % kWarp == 0) warp_max[int(threadIdx.x / kWarp) % kWarps] = largest;
  }
  // The copy of `state`, by stmatrix: matrix i of a store (lanes 8 i .. 8 i + 7 give its rows'
  // addresses) is the 8 x 8 block of rows 16 warp + 8 (i % 2) on, columns 8 (2 k + i / 2) on of row
  // block a, and each lane's register i holds its row g, columns 2 q4 (+1): the accumulator's own
  // layout, so one stmatrix.x4 stores what four st.shared.b32 did (32 a part where there were 128
  // at four atoms).
  __device__ void publish(const State& state) {
    if constexpr (kHalf) {
      float largest = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) largest = fmaxf(largest, warp_max[w]);
      int shift = 0;
      if (largest > 16384.f && largest <= FLT_MAX) frexpf(largest / 16384.f, &shift);  // largest 2^-shift <= 2^14
      scale = ldexpf(1.f, shift);
      // (at scale 1, the usual case, the copy without its multiplies: 32 a part and chunk)
      if (shift == 0) {
        store_parts<false>(state, 1.f);
      } else {
        store_parts<true>(state, 1.f / scale);  // a power of two: exact
      }
    } else {
      store_parts<false>(state, 1.f);
    }
  }
  // publish's stores, the state times `inverse` where kScaled
  template <bool kScaled>
  __device__ void store_parts(const State& state, float inverse) {
    const int warp = group_warp(), lane = threadIdx.x % kWarp, r = lane % 8, i = lane / 8;
    // this lane's row of matrix i: state row 16 warp + 8 (i % 2) + r, column group 2 k + i / 2
    const uint32_t row = at + (16 * warp + 8 * (i % 2) + r) * 128;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t to = row + (((2 * k + i / 2) ^ r) * 16);
#pragma unroll
      for (int a = 0; a < kAtoms; ++a) {
        uint32_t hi[4], lo[4];
#pragma unroll
        for (int m = 0; m < 4; ++m) {  // matrix m: n-tile 2 k + m / 2, rows + 8 (m % 2)
          const int v = matrix_pair(k, m);
          const float x = kScaled ? state[a][v] * inverse : state[a][v],
                      y = kScaled ? state[a][v + 1] * inverse : state[a][v + 1];
          hi[m] = pack<kHalf>(x, y);
          if constexpr (!kHalf) {
            lo[m] = pack<kHalf>(x - __uint_as_float(hi[m] << 16), y - __uint_as_float(hi[m] & 0xffff0000u));
          } else if constexpr (kTwoParts) {
            const float2 head = unpack<kHalf>(hi[m]);
            lo[m] = pack<kHalf>(x - head.x, y - head.y);
          }
        }
        store_matrices(to + a * kTile, hi);
        if constexpr (kTwoParts) store_matrices(to + a * kTile + kPart, lo);
      }
    }
  }
  // The first chunk's copy (a barrier before its first reader): float16's scale from the state
  // itself, which a segment's start makes anything; `sync`: the barrier of the threads that post
  // the largest |S| (the whole block's, or its consumers' where a producer stages the chunks).
  template <typename Sync>
  __device__ void publish_first(const State& state, Sync&& sync) {
    if constexpr (kHalf) {
      post_max(state);
      sync();
    }
    publish(state);
  }
  __device__ void publish_first(const State& state) {
    publish_first(state, [] { __syncthreads(); });
  }
  // A product with the copy alone (before anything else accumulates into it), back to S's scale.
  __device__ void scale_back(float (&d)[32]) const {
    if constexpr (kHalf) {
      if (scale != 1.f) {
#pragma unroll
        for (int i = 0; i < 32; ++i) d[i] *= scale;
      }
    }
  }
};

// A state's entries in an accumulator's layout: row row0 + 16 warp + g (+8), column col0 + 8 j +
// 2 q4 (+1) in d[4 j ..] (row0: the row block's first, col0: the column tile's); rows below Da,
// columns below Dc, zeros past them. `from` is [Da, Dc] by rows, or transposed [Dc, Da]. Loads
// are issued together before any is used: SegmentStart::state's entry by entry (a branch, a load
// and an add each) waited out one round trip after another, and the forward with a state ran 18%
// slower than without at 8,16,2048,128 (ncu, RESULTS.md, seventy-seventh session).
struct StateEntries {
  const float* from;
  int64_t row, column, row_step, column_step, Da, Dc;  // (row, column: the thread's first entry's)
  __device__ StateEntries(const float* from_, bool transposed, int64_t Da_, int64_t Dc_, int64_t row0, int64_t col0)
      : from(from_),
        row(row0 + 16 * group_warp() + (threadIdx.x % kWarp) / 4),
        column(col0 + 2 * (threadIdx.x % 4)),
        row_step(transposed ? 1 : Dc_),
        column_step(transposed ? Da_ : 1),
        Da(Da_),
        Dc(Dc_) {}
  __device__ __forceinline__ float operator()(int j, int e) const {  // d[4 j + e]'s
    const int64_t r = row + 8 * (e / 2), c = column + 8 * j + e % 2;
    return r < Da && c < Dc ? from[r * row_step + c * column_step] : 0.f;
  }
};
// The given start's entries (KernelParams::start_state, not null) in an accumulator's layout.
__device__ __forceinline__ StateEntries given_start_entries(const KernelParams& p, int64_t pair, int64_t Da,
                                                            int64_t Dc, int64_t row0, int64_t col0) {
  return StateEntries(static_cast<const float*>(p.start_state) + pair * Da * Dc, p.start_transposed, Da, Dc, row0,
                      col0);
}
// The pass's given start (KernelParams::start_state: SegmentStart's second term, added after the
// segments' sums as there) into an accumulator, layout as StateEntries': load_start's, and one
// launch's segments' (which sum the segments before them themselves, add_segments_before). Half
// the entries at a time: all 32 at once spilled the bf16 forward under normalize at E = 128.
__device__ __forceinline__ void add_given_start(float (&d)[32], const KernelParams& p, int64_t pair, int64_t Da,
                                                int64_t Dc, int64_t row0 = 0, int64_t col0 = 0) {
  if (p.start_state == nullptr) return;
  const StateEntries given = given_start_entries(p, pair, Da, Dc, row0, col0);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float x[16];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) x[4 * j + e] = given(4 * half + j, e);
#pragma unroll
    for (int i = 0; i < 16; ++i) d[16 * half + i] += x[i];
  }
}
// A segment's start (SegmentStart's: the scanned sums of the segments before it, in time order,
// then the given start) into an accumulator, layout as StateEntries', or zeros (a state-only
// block sums its segment's own); and the segment's own sums out (SegmentEnd, state-only blocks).
// store_end writes its own loop over the layout: one shared loop (a lambda per entry) raised the
// dk-with-dv kernel's registers (bf16 154 -> 176 with store_end's, 156 with load_start's alone;
// fifty-second and fifty-third sessions).
__device__ __forceinline__ void load_start(float (&d)[32], const KernelParams& p, int64_t pair, int64_t segment,
                                           int64_t Da, int64_t Dc, bool zero, int64_t row0 = 0, int64_t col0 = 0) {
  const bool scanned = !zero && p.segments > 1, given = !zero && p.start_state != nullptr;
  if (scanned || given) {  // the first term loaded as it is (no temporaries), the given start added to the scan's
    const StateEntries first =
        scanned ? StateEntries(static_cast<const float*>(p.seg_state) + (pair * p.segments + segment) * Da * Dc,
                               p.seg_from_forward, Da, Dc, row0, col0)
                : given_start_entries(p, pair, Da, Dc, row0, col0);
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) d[4 * j + e] = first(j, e);
    if (scanned) add_given_start(d, p, pair, Da, Dc, row0, col0);
  } else {
#pragma unroll
    for (int i = 0; i < 32; ++i) d[i] = 0.f;
  }
}
// A segment's start in one launch (KernelParams::lookback): the own sums of the `count` segments
// before it in pass order, [Da, Dc] each, the first at `sums`, the next `step` slots on (1; -1
// in reverse), added in that order (as scan_segments adds them, so the start is the scan's to the
// bit). Accumulator layout as StateEntries'. The sums are other blocks' writes: read through the
// L2 (ld.global.cg), past this multiprocessor's L1; two segments' loads in flight at once (a
// round trip each, one after the other, cost about half a microsecond a segment).
__device__ __forceinline__ void add_segments_before(float (&d)[32], const float* sums, int64_t count, int64_t step,
                                                    int64_t Da, int64_t Dc, int64_t row0 = 0, int64_t col0 = 0) {
  const int warp = group_warp(), g = (threadIdx.x % kWarp) / 4, q4 = threadIdx.x % 4;
  auto load = [&](float (&to)[32], const float* from) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t row = row0 + 16 * warp + g + 8 * (e / 2), column = col0 + 8 * j + 2 * q4 + e % 2;
        to[4 * j + e] = row < Da && column < Dc ? __ldcg(from + row * Dc + column) : 0.f;
      }
  };
#pragma unroll
  for (int i = 0; i < 32; ++i) d[i] = 0.f;
  int64_t s = 0;
  for (; s + 1 < count; s += 2, sums += 2 * step * Da * Dc) {
    float first[32], second[32];
    load(first, sums);
    load(second, sums + step * Da * Dc);
#pragma unroll
    for (int i = 0; i < 32; ++i) d[i] += first[i];
#pragma unroll
    for (int i = 0; i < 32; ++i) d[i] += second[i];
  }
  for (; s < count; ++s, sums += step * Da * Dc) {
    float next[32];
    load(next, sums);
#pragma unroll
    for (int i = 0; i < 32; ++i) d[i] += next[i];
  }
}
// One entry of a vector's start in one launch (KernelParams::seg_own_vector_sums: the forward's
// key sums, dk with dv's extra row): its own sums in the `count` segments before the block's in
// pass order, the first at `sums`, the next `step` floats on (negative in reverse), added in that
// order, as add_segments_before adds the states'.
__device__ __forceinline__ float add_vector_sums_before(const float* sums, int64_t count, int64_t step) {
  float value = 0.f;
  for (int64_t s = 0; s < count; ++s, sums += step) value += __ldcg(sums);
  return value;
}
__device__ __forceinline__ void store_end(const float (&d)[32], float* to, int64_t Da, int64_t Dc, int64_t row0 = 0,
                                          int64_t col0 = 0, bool transposed = false) {
  if (to == nullptr) return;
  const int warp = group_warp(), g = (threadIdx.x % kWarp) / 4, q4 = threadIdx.x % 4;
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t row = row0 + 16 * warp + g + 8 * (e / 2), column = col0 + 8 * j + 2 * q4 + e % 2;
      if (row < Da && column < Dc) to[transposed ? column * Da + row : row * Dc + column] = d[4 * j + e];
    }
}

// A staged tile of kAtoms 64-column atoms (kTile bytes apart), K along its columns: k16 step s.
template <int kAtoms>
__device__ __forceinline__ uint64_t k_along_atoms(uint32_t tile, int s) {
  return k_along_columns(tile, s % 4, (s / 4) * kTile);
}

// d = A B^T over a chunk (the scores), both staged tiles (kAtoms atoms) K-major along their columns.
template <bool kHalf, int kAtoms = 1>
__device__ __forceinline__ void scores_of(float (&d)[32], uint32_t a_tile, uint32_t b_tile) {
#pragma unroll
  for (int s = 0; s < 4 * kAtoms; ++s) {
    mma_ss<kHalf, 0, 0>(d, k_along_atoms<kAtoms>(a_tile, s), k_along_atoms<kAtoms>(b_tile, s), s > 0);
  }
}

// d += B^T C over a chunk (a state's update: S += B^T Cc in the forward direction, D += dO^T Q
// in dk and dv), K (time) along the rows of both staged tiles.
template <bool kHalf>
__device__ __forceinline__ void add_bt_times_c(float (&d)[32], uint32_t b_tile, uint32_t c_tile, uint32_t b_atom = 0) {
#pragma unroll
  for (int s = 0; s < 4; ++s) mma_ss<kHalf, 1, 1>(d, k_along_rows(b_tile, s, b_atom), k_along_rows(c_tile, s));
}
// The same for a state of kAtoms row blocks: row block a from B's atom a (kTile bytes apart).
template <bool kHalf, int kAtoms>
__device__ __forceinline__ void add_bt_times_c(float (&d)[kAtoms][32], uint32_t b_tile, uint32_t c_tile) {
#pragma unroll
  for (int a = 0; a < kAtoms; ++a) add_bt_times_c<kHalf>(d[a], b_tile, c_tile, a * kTile);
}

// d = A (a staged tile, K-major) times the state's copy at `copy`: the copy as it is (kTransB = 1,
// MN-major: A S) or transposed (kTransB = 0, K-major: A S^T). bfloat16 multiplies both parts
// (kPart bytes apart), the remainder first (the small terms first), then the head. kAtoms: A's
// atoms, K = 64 kAtoms: the copy's row blocks (the rows continue 128 bytes apart, so K along its
// rows steps on as in one atom), or, transposed, its column atoms, next_atom bytes apart (the
// copies of the state's two column halves). onto: d += A S. kTwoParts: float16's two-part copy
// (StateCopy's) too.
template <bool kHalf, int kTransB, int kAtoms = 1, bool kTwoParts = !kHalf>
__device__ __forceinline__ void times_state_copy(float (&d)[32], uint32_t a_tile, uint32_t copy, uint32_t next_atom = 0,
                                                 bool onto = false) {
  constexpr uint32_t kPart = StateCopy<kHalf, kAtoms>::kPart;
  auto b = [copy, next_atom](uint32_t part, int s) {
    return kTransB ? k_along_rows(copy, s, part) : k_along_columns(copy, s % 4, part + (s / 4) * next_atom);
  };
  if constexpr (kTwoParts) {
#pragma unroll
    for (int s = 0; s < 4 * kAtoms; ++s) {
      mma_ss<kHalf, 0, kTransB>(d, k_along_atoms<kAtoms>(a_tile, s), b(kPart, s), onto || s > 0);
    }
  }
#pragma unroll
  for (int s = 0; s < 4 * kAtoms; ++s) {
    mma_ss<kHalf, 0, kTransB>(d, k_along_atoms<kAtoms>(a_tile, s), b(0, s), onto || kTwoParts || s > 0);
  }
}

// The masked scores (row r, column c: c <= r kept, or c >= r for kReverse; kStrict: the diagonal
// dropped too, c > r for the one-pass backward's dq, wgmma_grad_kv_kernel's kWithDq, where
// `complement`, a flag the same for the whole warpgroup, takes the mask's complement, c <= r) as
// 16-bit register A fragments of the products by them, each warp its 16 rows: k-step s in a[s].
// The warp's rank in its warpgroup is made a constant (one branch a warp), so that only the two
// 8 x 8 blocks on the diagonal compare columns with rows (the others are kept or zero whole): with
// the rank a variable, each of the 32 scores took its own compare and select every chunk.
// Whether the mask keeps this lane's score[4 j + e] (row 16 kWarpRank + g + 8 (e / 2), column
// 8 j + 2 q4 + e % 2).
template <bool kReverse, int kWarpRank, bool kStrict = false>
__device__ __forceinline__ bool kept_by_mask(int j, int e) {
  const int g = (threadIdx.x % kWarp) / 4, q4 = threadIdx.x % 4;
  const int row_block = 2 * kWarpRank + e / 2;  // of 8 rows, as j is of 8 columns
  if (j != row_block) return kReverse ? j > row_block : j < row_block;
  const int column = 2 * q4 + e % 2;
  if constexpr (kStrict) return kReverse ? column > g : column < g;
  return kReverse ? column >= g : column <= g;
}
// f(rank) with this thread's warp rank in its warpgroup as a constant (std::integral_constant):
// one branch a warp, each taking its own instance.
template <typename F>
__device__ __forceinline__ void with_warp_rank(F&& f) {
  switch (group_warp()) {
    case 0: f(std::integral_constant<int, 0>{}); break;
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 3>{}); break;
  }
}
template <bool kHalf, bool kReverse, int kWarpRank, bool kStrict = false>
__device__ __forceinline__ void masked_fragments_of(uint32_t (&a)[4][4], const float (&score)[32], bool complement) {
  auto kept = [&](int j, int e) { return kept_by_mask<kReverse, kWarpRank, kStrict>(j, e) != complement; };
#pragma unroll
  for (int s = 0; s < 4; ++s)
#pragma unroll
    for (int r = 0; r < 4; ++r) {  // fragment register r of k-step s: n-tile 2 s + r / 2, entries 2 (r % 2) ..
      const int j = 2 * s + r / 2, e = 2 * (r % 2);
      const bool dropped = j != 2 * kWarpRank + e / 2 && !kept(j, e);  // a block off the diagonal, zero whole
      a[s][r] = dropped ? 0u  // (the compiler does not fold a conversion of zeros)
                        : pack<kHalf>(kept(j, e) ? score[4 * j + e] : 0.f, kept(j, e + 1) ? score[4 * j + e + 1] : 0.f);
    }
}
template <bool kHalf, bool kReverse, bool kStrict = false>
__device__ __forceinline__ void masked_fragments(uint32_t (&a)[4][4], const float (&score)[32],
                                                 bool complement = false) {
  with_warp_rank(
      [&](auto rank) { masked_fragments_of<kHalf, kReverse, decltype(rank)::value, kStrict>(a, score, complement); });
}
// exact[h] += the lane's masked float32 scores of its row g + 8 h (the normalizer's exact sums, before
// the quad's shuffles)
template <bool kReverse, int kWarpRank>
__device__ __forceinline__ void add_kept_scores(float (&exact)[2], const float (&score)[32]) {
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (kept_by_mask<kReverse, kWarpRank>(j, e)) exact[e / 2] += score[4 * j + e];
    }
}
// The normalizer's row sums of this lane's two rows (16 warp + g, + 8), each added across the
// quad: of the masked float32 scores (exact: the den the backward reads), and of P as rounded to
// 16 bits (masked_fragments: the values P Cc multiplies; fragment register r holds row g + 8 (r %
// 2)), which the outputs are divided by, so that each output weighs its rounded terms against their
// own sum. (One den from the float32 scores for both: bf16 L = 2 out 4.6e-3 from float64, over the
// 2^-8 floor; one from P for both: grad v 5.3e-3 there. RESULTS.md, fifty-second session.)
template <bool kHalf, bool kReverse, int kWarpRank>
__device__ __forceinline__ void normalizer_sums_of(float (&exact)[2], float (&rounded)[2], const float (&score)[32],
                                                   const uint32_t (&a)[4][4]) {
  exact[0] = exact[1] = rounded[0] = rounded[1] = 0.f;
  add_kept_scores<kReverse, kWarpRank>(exact, score);
#pragma unroll
  for (int s = 0; s < 4; ++s)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float2 x = unpack<kHalf>(a[s][r]);
      rounded[r % 2] += x.x + x.y;
    }
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int offset = 1; offset < 4; offset *= 2) {
      exact[h] += __shfl_xor_sync(0xffffffffu, exact[h], offset);
      rounded[h] += __shfl_xor_sync(0xffffffffu, rounded[h], offset);
    }
}
template <bool kHalf, bool kReverse>
__device__ __forceinline__ void normalizer_sums(float (&exact)[2], float (&rounded)[2], const float (&score)[32],
                                                const uint32_t (&a)[4][4]) {
  with_warp_rank(
      [&](auto rank) { normalizer_sums_of<kHalf, kReverse, decltype(rank)::value>(exact, rounded, score, a); });
}
// The exact sums alone (normalizer_sums_of's first), where P's rounded ones come from the tensor
// cores (rows_of_ones)
template <bool kReverse, int kWarpRank>
__device__ __forceinline__ void exact_row_sums_of(float (&exact)[2], const float (&score)[32]) {
  exact[0] = exact[1] = 0.f;
  add_kept_scores<kReverse, kWarpRank>(exact, score);
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int offset = 1; offset < 4; offset *= 2) exact[h] += __shfl_xor_sync(0xffffffffu, exact[h], offset);
}
template <bool kReverse>
__device__ __forceinline__ void exact_row_sums(float (&exact)[2], const float (&score)[32]) {
  with_warp_rank([&](auto rank) { exact_row_sums_of<kReverse, decltype(rank)::value>(exact, score); });
}
// d (64 x 8 float32, mma_rs_n8's layout) += A B^T, bfloat16, both from shared memory, B K-major,
// A K-major (kTransA 0: a staged tile with K along its columns, A of the scores) or MN-major (1:
// K along its rows, B^T of the state's update)
template <int kTransA>
__device__ __forceinline__ void mma_ss_n8(float (&d)[4], uint64_t a, uint64_t b, bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, %4, %5, p, 1, 1, %7, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "l"(a), "l"(b), "r"(accumulate ? 1 : 0), "n"(kTransA));
}
// d = A z for a staged tile A (one atom, K-major) and z's bfloat16 copy (KeySums::publish_copy: its
// two parts, 1 KB apart, z in row 0 of each), the remainder first: column 0 (lane q4 = 0's d[0],
// row g, and d[2], row g + 8) holds q . z, the other columns nothing of use
__device__ __forceinline__ void times_key_copy(float (&d)[4], uint32_t a_tile, uint32_t copy_tile) {
#pragma unroll
  for (int part = 1; part >= 0; --part)
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      mma_ss_n8<0>(d, k_along_columns(a_tile, s), k_along_columns(copy_tile + 1024 * part, s), part == 0 || s > 0);
    }
}
// d[a] = B^T 1 for each atom a of the staged tile at b_tile: the chunk's sums of B's columns 64 a
// + 16 w + g (d[a][0]) and + 8 (d[a][2]), on the tensor cores (four m64n8k16 products an atom,
// in the caller's committed group; KeySums::add_column_sums takes them in; bfloat16)
template <int kAtoms>
__device__ __forceinline__ void column_sums_of_ones(float (&d)[kAtoms][4], uint32_t b_tile, uint32_t ones_tile) {
#pragma unroll
  for (int a = 0; a < kAtoms; ++a)
#pragma unroll
    for (int s = 0; s < 4; ++s) mma_ss_n8<1>(d[a], k_along_rows(b_tile, s, a * kTile), descriptor(ones_tile), s > 0);
}
// d = P 1 (P's fragments, masked_fragments): each row's sum of P as rounded to 16 bits, on the
// tensor cores (four m64n8k16 products with the ones tile, in the caller's committed group); row
// g's in d[0] (and d[1]), row g + 8's in d[2]. What normalizer_sums_of's rounded sums took on the
// CUDA cores: 32 conversions, 32 adds and 6 shuffles a thread and chunk (bfloat16).
__device__ __forceinline__ void rows_of_ones(float (&d)[4], const uint32_t (&a)[4][4], uint32_t ones_tile) {
#pragma unroll
  for (int s = 0; s < 4; ++s) mma_rs_n8(d, a[s], descriptor(ones_tile), s > 0);
}
// d += P X for P's fragments (masked_fragments; the caller fences after writing them), X a staged
// tile, MN-major: K along its rows.
template <bool kHalf>
__device__ __forceinline__ void add_fragments_times(float (&d)[32], const uint32_t (&a)[4][4], uint32_t x_tile) {
#pragma unroll
  for (int s = 0; s < 4; ++s) mma_rs<kHalf, 1>(d, a[s], k_along_rows(x_tile, s));
}
// d += mask(score) X (complement: masked_fragments'), in one committed group.
template <bool kHalf, bool kReverse, bool kStrict = false>
__device__ __forceinline__ void add_masked_times(float (&d)[32], const float (&score)[32], uint32_t x_tile,
                                                 bool complement = false) {
  uint32_t a[4][4];
  masked_fragments<kHalf, kReverse, kStrict>(a, score, complement);
  fence();
  add_fragments_times<kHalf>(d, a, x_tile);
  commit();
}

// P (masked_fragments: each warp its 16 rows, k-step s in a[s]) into a 64 x 64 tile in the staged
// layout (row r, column c at 128 r + 16 ((c / 8) ^ (r % 8)) + 2 (c % 8)), K-major along its
// columns as A of P X: by stmatrix, matrix i of k-step s the 8 x 8 block of rows 16 warp + 8 (i %
// 2) on, columns 16 s + 8 (i / 2) on (StateCopy::publish's mapping, k-step for column group).
__device__ __forceinline__ void store_fragments(uint32_t tile, const uint32_t (&a)[4][4]) {
  const int lane = threadIdx.x % kWarp, r = lane % 8, i = lane / 8;
  const uint32_t row = tile + (16 * group_warp() + 8 * (i % 2) + r) * 128;
#pragma unroll
  for (int s = 0; s < 4; ++s) store_matrices(row + (((2 * s + i / 2) ^ r) * 16), a[s]);
}
// A chunk's masked scores P = mask(A B^T) from its staged A and B (kAtoms atoms each) into p_tile
// (store_fragments), fenced for the consumers' wgmma: a producer warpgroup's work a chunk
// (wgmma_product_kernel's kProducerScores, wgmma_transposed_kernel).
template <bool kHalf, int kAtoms, bool kReverse>
__device__ __forceinline__ void make_masked_scores(uint32_t a_tile, uint32_t b_tile, uint32_t p_tile) {
  float score[32];
  fence();
  scores_of<kHalf, kAtoms>(score, a_tile, b_tile);  // A B^T
  commit();
  wait<0>();
  uint32_t masked[4][4];
  masked_fragments<kHalf, kReverse>(masked, score);
  store_fragments(p_tile, masked);
  fence_shared_writes();
}
// d = P X, P a staged tile (store_fragments), X a staged tile, MN-major: K along its rows.
template <bool kHalf>
__device__ __forceinline__ void tile_times(float (&d)[32], uint32_t p_tile, uint32_t x_tile) {
#pragma unroll
  for (int s = 0; s < 4; ++s) mma_ss<kHalf, 0, 1>(d, k_along_columns(p_tile, s), k_along_rows(x_tile, s), s > 0);
}

// An accumulator times factor, rounded into this warp's 16 staging rows (kOutStride elements
// apart), then written out 16 bytes a lane: rows r < n, columns < width of out (rows out_l
// apart).
// times(h, x): entry x of the lane's row g + 8 h, finished.
template <bool kHalf, typename scalar_t, typename Times>
__device__ __forceinline__ void store_rows_times(const float (&acc)[32], Times&& times, uint16_t* staging,
                                                 scalar_t* out, int64_t out_l, int n, int64_t width) {
  const int warp = group_warp(), lane = threadIdx.x % kWarp, g = lane / 4, q4 = lane % 4;
  __syncwarp();  // the warp's reads of its rows' previous contents are done
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = 16 * warp + g + 8 * h, column = 8 * j + 2 * q4;
      *reinterpret_cast<uint32_t*>(staging + row * kOutStride + column) =
          pack<kHalf>(times(h, acc[4 * j + 2 * h]), times(h, acc[4 * j + 2 * h + 1]));
    }
  __syncwarp();
  auto write = [&](auto inside) {
#pragma unroll
    for (int i = lane; i < 16 * 8; i += kWarp) {
      const int row = 16 * warp + i / 8, column = 8 * (i % 8);
      if (inside(row, column)) {
        *reinterpret_cast<uint4*>(out + row * out_l + column) =
            *reinterpret_cast<const uint4*>(staging + row * kOutStride + column);
      }
    }
  };
  // a whole chunk of 64 columns (the common case) without a test a store
  if (n == C && width >= 64) {
    write([](int, int) { return true; });
  } else {
    write([n, width](int row, int column) { return row < n && column < width; });
  }
}
template <bool kHalf, typename scalar_t>
__device__ __forceinline__ void store_rows(const float (&acc)[32], float factor, uint16_t* staging, scalar_t* out,
                                           int64_t out_l, int n, int64_t width) {
  // factor 1 (every pass's default scale) without its 32 multiplies
  if (factor == 1.f) {
    store_rows_times<kHalf>(acc, [](int, float x) { return x; }, staging, out, out_l, n, width);
  } else {
    store_rows_times<kHalf>(acc, [factor](int, float x) { return x * factor; }, staging, out, out_l, n, width);
  }
}
// The same with a factor a row: factors[h] for the lane's row g + 8 h (the normalizer's).
template <bool kHalf, typename scalar_t>
__device__ __forceinline__ void store_rows(const float (&acc)[32], const float (&factors)[2], uint16_t* staging,
                                           scalar_t* out, int64_t out_l, int n, int64_t width) {
  store_rows_times<kHalf>(acc, [&factors](int h, float x) { return x * factors[h]; }, staging, out, out_l, n, width);
}

// The forward's normalizer (wgmma_product_kernel's kNormalize): den[t] = eps + scale (the row sum
// of the chunk's masked scores + q[t] . z), z the key sum entering the chunk (the segment's start,
// SegmentStart::key_sum, then += each chunk's column sums of k), and each output row times scale /
// den[t] (the mma.sync kernel's terms, tensorcore_product.cuh, with q unscaled on the tensor
// cores; the outputs' den from the row sums of P as rounded, normalizer_sums). z is float32 in
// shared memory, one copy a warpgroup ([64 kAtoms]). Warp w owns columns 64 a + 16 w .. + 15 of
// each atom a: lane l sums columns 16 w + 2 (l % 8) (+1) over
// rows 8 i + 2 (l / 8) (+1) of the staged chunk (each 32-bit load of the warp reads eight
// different 16-byte groups of the swizzled rows: no bank conflicts), the four row phases are added
// by two shuffles, and lanes 0-7 (owners) keep, add and write out those columns of z. Every warp
// reads all of z (q . z) between the chunk's arrival and its group's barrier after the state's
// copy; the owners add the chunk's sums after that barrier, and the ring's next wait (every
// consumer's) orders their adds before the next chunk's reads.
template <bool kHalf, int kAtoms>
struct KeySums {
  float* z;  // this group's, [64 kAtoms], shared

  __device__ bool owner() const { return threadIdx.x % kWarp < 8; }
  __device__ int column(int a, int e) const { return 64 * a + 16 * group_warp() + 2 * int(threadIdx.x % 8) + e; }
  // An owner's columns of z set from `value(column)` (others: nothing).
  template <typename Value>
  __device__ void set(Value&& value) const {
    if (!owner()) return;
#pragma unroll
    for (int a = 0; a < kAtoms; ++a)
#pragma unroll
      for (int e = 0; e < 2; ++e) z[column(a, e)] = value(column(a, e));
  }
  // This lane's columns of b summed over the staged chunk at b_tile (kAtoms atoms), each row times
  // weight(row) (1: plain sums), the row phases added: an owner's sums.
  template <typename Weight>
  __device__ void chunk_sums(float (&sums)[kAtoms][2], uint32_t b_tile, Weight&& weight) const {
    const int lane = threadIdx.x % kWarp, phase = lane / 8, pair = lane % 8;
    const int group16 = 2 * group_warp() + pair / 4;  // the 16-byte group of columns 16 w + 2 pair (+1)
    // the rows' weights first: each read after the tile's loads (asm, ordered with memory) would
    // wait on its own
    float weights[8][2];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int u = 0; u < 2; ++u) weights[i][u] = weight(8 * i + 2 * phase + u);
#pragma unroll
    for (int a = 0; a < kAtoms; ++a) {
      float lo = 0.f, hi = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int row = 8 * i + 2 * phase + u;
          uint32_t x;
          asm volatile("ld.shared.u32 %0, [%1];\n"
                       : "=r"(x)
                       : "r"(b_tile + a * kTile + row * 128 + ((group16 ^ (row % 8)) * 16) + 4 * (pair % 4))
                       : "memory");
          const float2 f = unpack<kHalf>(x);
          lo += f.x * weights[i][u], hi += f.y * weights[i][u];
        }
#pragma unroll
      for (int offset = 8; offset < kWarp; offset *= 2) {
        lo += __shfl_xor_sync(0xffffffffu, lo, offset);
        hi += __shfl_xor_sync(0xffffffffu, hi, offset);
      }
      sums[a][0] = lo, sums[a][1] = hi;
    }
  }
  __device__ void chunk_sums(float (&sums)[kAtoms][2], uint32_t b_tile) const {
    chunk_sums(sums, b_tile, [](int) { return 1.f; });
  }
  // z's bfloat16 copy for times_key_copy (one atom): lane q4 = 0 of each row pair writes its
  // warp's entries 16 w + g, + 8 (the warp's own: its writes seen after a __syncwarp) in two parts
  // (hi, and the remainder 1 KB on: q . z to 2^-16 relative) in row 0 of the parts' tiles (K-major,
  // row 0 unswizzled: entry e at 2 e bytes). bfloat16 has float32's exponents, so z needs no scale.
  __device__ void publish_copy(uint16_t* copy) const {
    static_assert(!kHalf, "float16's z would need a scale (its sums stay on the CUDA cores)");
    const int lane = threadIdx.x % kWarp;
    if (lane % 4 == 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int e = 16 * group_warp() + lane / 4 + 8 * h;
        const uint32_t hi = pack<false>(z[e], 0.f);
        const float head = unpack<false>(hi).x;
        copy[e] = uint16_t(hi & 0xffffu);
        copy[512 + e] = uint16_t(pack<false>(z[e] - head, 0.f) & 0xffffu);
      }
    }
  }
  // z += column_sums_of_ones' sums (lane q4 = 0 of each row pair g, g + 8: its columns 64 a + 16 w
  // + g, + 8)
  __device__ void add_column_sums(const float (&sums)[kAtoms][4]) const {
    const int lane = threadIdx.x % kWarp;
    if (lane % 4 != 0) return;
#pragma unroll
    for (int a = 0; a < kAtoms; ++a)
#pragma unroll
      for (int h = 0; h < 2; ++h) z[64 * a + 16 * group_warp() + lane / 4 + 8 * h] += sums[a][2 * h];
  }
  // An owner's columns of z set to `previous`'s plus its chunk sums (dq's double-buffered z).
  __device__ void assign(const KeySums& previous, const float (&sums)[kAtoms][2]) const {
    if (!owner()) return;
#pragma unroll
    for (int a = 0; a < kAtoms; ++a)
#pragma unroll
      for (int e = 0; e < 2; ++e) z[column(a, e)] = previous.z[column(a, e)] + sums[a][e];
  }
  // z's entries at this lane's accumulator columns times weights[h], added to its row g + 8 h of
  // acc (dq's extra row: -dO[t] . O[t] z).
  __device__ void add_scaled_to_rows(float (&acc)[32], const float (&weights)[2]) const {
    const int q4 = threadIdx.x % 4;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float2 x = *reinterpret_cast<const float2*>(z + 8 * j + 2 * q4);
#pragma unroll
      for (int h = 0; h < 2; ++h) acc[4 * j + 2 * h] += weights[h] * x.x, acc[4 * j + 2 * h + 1] += weights[h] * x.y;
    }
  }
  // z's entries at this lane's accumulator columns added to every row of acc (dk's extra row e).
  __device__ void add_to_rows(float (&acc)[32]) const { add_scaled_to_rows(acc, {1.f, 1.f}); }
  // An owner's columns of z below Da to `to` (the key sum's end).
  __device__ void store(float* to, int64_t Da) const {
    if (!owner()) return;
#pragma unroll
    for (int a = 0; a < kAtoms; ++a)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if (column(a, e) < Da) to[column(a, e)] = z[column(a, e)];
      }
  }
  // z += an owner's chunk sums.
  __device__ void add(const float (&sums)[kAtoms][2]) const {
    if (!owner()) return;
#pragma unroll
    for (int a = 0; a < kAtoms; ++a)
#pragma unroll
      for (int e = 0; e < 2; ++e) z[column(a, e)] += sums[a][e];
  }
  // q[row] . z for this lane's two rows (16 warp + g, + 8) of the staged A tile at a_tile: lane q4
  // of the quad takes column groups 2 q4 and 2 q4 + 1 of each atom, added across the quad.
  __device__ void row_dots(float (&dots)[2], uint32_t a_tile) const {
    const int lane = threadIdx.x % kWarp, g = lane / 4, q4 = lane % 4;
    dots[0] = dots[1] = 0.f;
#pragma unroll
    for (int a = 0; a < kAtoms; ++a)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int group16 = 2 * q4 + c;
        const float4 z0 = *reinterpret_cast<const float4*>(z + 64 * a + 8 * group16);
        const float4 z1 = *reinterpret_cast<const float4*>(z + 64 * a + 8 * group16 + 4);
        const float zs[8] = {z0.x, z0.y, z0.z, z0.w, z1.x, z1.y, z1.z, z1.w};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = 16 * group_warp() + g + 8 * h;  // (row % 8 = g)
          const uint4 x = tensorcore::load_shared_16(a_tile + a * kTile + row * 128 + ((group16 ^ g) * 16));
          const uint32_t words[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
          for (int w = 0; w < 4; ++w) {
            const float2 f = unpack<kHalf>(words[w]);
            dots[h] += f.x * zs[2 * w] + f.y * zs[2 * w + 1];
          }
        }
      }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      dots[h] += __shfl_xor_sync(0xffffffffu, dots[h], 1);
      dots[h] += __shfl_xor_sync(0xffffffffu, dots[h], 2);
    }
  }
};

// The normalized backward's per-row terms of a chunk, kTerms arrays of 64 floats a stage slot
// (dO[t] . O[t], den[t]), staged by the producer beside the chunk's tiles: one 4-byte
// cp.async a thread in the chunk's copy group, rows past n zeros. The consumers read them from
// shared memory once the ring says the chunk is staged (every producer thread's copies landed).
// Read from global memory where each was used, the loads' latency sat on the consumers' chain
// every chunk (RESULTS.md, fifty-third session).
template <int kTerms>
struct RowTerms {
  static_assert(kTerms == 1 || kTerms == 2, "a producer thread a row's term");
  float* at;  // [slots][kTerms][64], shared
  __device__ const float* slot(int s) const { return at + s * kTerms * 64; }
  // (the producer) from[term][0 .. n) into slot s, but term `made` (-1: none), which the
  // producer writes itself (put: the dq pass's dO . O where it makes them)
  __device__ void stage(int s, const float* const (&from)[kTerms], int n, int made = -1) const {
    const int thread = int(threadIdx.x % kThreads), term = thread / 64, row = thread % 64;
    if (term < kTerms && term != made) {
      copy_4(smem_address(slot(s) + 64 * term + row), from[term] + (row < n ? row : 0), row < n);
    }
  }
  __device__ void put(int s, int term, int row, float value) const { at[s * kTerms * 64 + 64 * term + row] = value; }
  // dk's extra row's b in slot s, -dO[t] . O[t] of row t (zero past the chunk's rows), as a weight
  // a row (KeySums::chunk_sums, add_to_columns)
  __device__ auto extra_weights(int s) const {
    return [dots = slot(s)](int row) { return -dots[row]; };
  }
  // dq's, for the lane's two accumulator rows (16 warp + g, + 8) of slot s's chunk of n rows: the
  // extra row's a = -dO[t] . O[t] (weights) or the output's factor / den[t], zero past n
  __device__ void dq_rows(float (&values)[2], int s, int n, bool weights, float factor) const {
    const float* const terms = slot(s);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = 16 * group_warp() + int(threadIdx.x % kWarp) / 4 + 8 * h;
      values[h] = row >= n ? 0.f : weights ? -terms[row] : factor * __frcp_rn(terms[64 + row]);
    }
  }
};

// The L2 line holding `at` fetched ahead (a hint: no fault, nothing waits for it)
__device__ __forceinline__ void prefetch_l2(const void* at) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(at)); }

// O's rows of the chunk of n rows from row t0 (o: row 0, o_l apart) to the L2 for row_dots, a
// line once: an atom's 128 bytes of a row, the lines of its first and last pieces (`inside`:
// Source's bits)
template <int kAtoms, typename scalar_t>
__device__ __forceinline__ void prefetch_rows(const Stager& stage, const scalar_t* o, int64_t t0, int64_t o_l,
                                              uint32_t inside, int n) {
#pragma unroll
  for (int a = 0; a < kAtoms; ++a)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const bool ends = stage.col == 0 || stage.col == 56;
      if (ends && ((inside >> a) & 1u) && stage.row0 + 16 * i < n) {
        prefetch_l2(o + (t0 + stage.row0 + 16 * i) * o_l + stage.col + 64 * a);
      }
    }
}

// O's pieces of one atom for row_dots: this thread's 16 bytes of the chunk's rows Stager::row0 +
// 16 i (o: the chunk's first row at the atom's first column, o_l apart), 0 past n
template <typename scalar_t>
__device__ __forceinline__ void load_row_pieces(uint4 (&pieces)[4], const Stager& stage, const scalar_t* o,
                                                int64_t o_l, int n) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = stage.row0 + 16 * i;
    pieces[i] = row < n ? __ldg(reinterpret_cast<const uint4*>(o + row * o_l + stage.col)) : make_uint4(0, 0, 0, 0);
  }
}
// The same pieces of the staged dO (the atom at a_atom, this thread's own copies landed) times O's
// (load_row_pieces), added to each row's partial dot
template <bool kHalf>
__device__ __forceinline__ void add_row_dots(float (&dots)[4], const Stager& stage, uint32_t a_atom,
                                             const uint4 (&pieces)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint4 d = tensorcore::load_shared_16(a_atom + stage.piece0 + 2048 * i);
    const uint32_t dw[4] = {d.x, d.y, d.z, d.w}, ow[4] = {pieces[i].x, pieces[i].y, pieces[i].z, pieces[i].w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float2 x = unpack<kHalf>(dw[w]), y = unpack<kHalf>(ow[w]);
      dots[i] = fmaf(x.y, y.y, fmaf(x.x, y.x, dots[i]));
    }
  }
}
// the partial dots summed over each row's eight lanes
__device__ __forceinline__ void sum_row_dots(float (&dots)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int lanes = 1; lanes < 8; lanes *= 2) dots[i] += __shfl_xor_sync(0xffffffffu, dots[i], lanes);
}

// dO[t] . O[t] of the chunk's rows Stager::row0 + 16 i (where the kernel that makes dq makes them,
// KernelParams::dots_in_grad_q: the dq pass, or the one-pass backward in one segment): this
// thread's pieces of the staged dO (A: kAtoms atoms at a_tile, its own copies landed) times the
// same pieces of O, read from global memory (o: the chunk's first row, o_l apart; prefetched to
// the L2 when the chunk was staged), then summed over the row's eight lanes. Rows past n and
// atoms outside the operand's width (`inside`: Source's bits) give 0.
// backward_prepare_kernel read dO a second time for these (bf16 4,16,8192,64: 47.7 us of the
// normalized backward, 136 MB; ncu, H100, RESULTS.md, fifty-fifth session).
template <bool kHalf, int kAtoms, typename scalar_t>
__device__ __forceinline__ void row_dots(float (&dots)[4], const Stager& stage, uint32_t a_tile, const scalar_t* o,
                                         int64_t o_l, uint32_t inside, int n) {
  static_assert(kAtoms <= 2, "up to two atoms (at four the producer's registers spilled)");
#pragma unroll
  for (int i = 0; i < 4; ++i) dots[i] = 0.f;
#pragma unroll
  for (int a = 0; a < kAtoms; ++a) {
    if (((inside >> a) & 1u) == 0) continue;
    uint4 from_o[4];
    load_row_pieces(from_o, stage, o + 64 * a, o_l, n);
    add_row_dots<kHalf>(dots, stage, a_tile + a * kTile, from_o);
  }
  sum_row_dots(dots);
}

// weight(t) added to every score of column t of an accumulator (columns 8 j + 2 q4, + 1): dk's
// extra row in V dO^T, before the mask
template <typename Weight>
__device__ __forceinline__ void add_to_columns(float (&score)[32], Weight&& weight) {
  const int q4 = threadIdx.x % 4;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float w0 = weight(8 * j + 2 * q4), w1 = weight(8 * j + 2 * q4 + 1);
    score[4 * j] += w0, score[4 * j + 1] += w1, score[4 * j + 2] += w0, score[4 * j + 3] += w1;
  }
}

// The normalized backward's rows divided by their den (wgmma_grad_kv_kernel's kNormalize: q / den
// is dv's B and dk's Cc, as the mma.sync kernels' staged operand; wgmma_product_kernel's dv divides
// its Cc, dO, instead), in place by the producer thread
// that copied them: its own pieces of the staged tile (Stager's rows row0 + 16 i of its column
// group, its copies landed), row r times 1 / den[r] in float32 and rounded once; rows past n are
// zeros and stay so. Then fenced for wgmma. den: the chunk's, in its slot's row terms. The four
// are read first, at once (read between the tile's loads, each waited on its own). unit: float16's
// KernelParams::den_unit (a power of two: the quotients out of its subnormals), 1 for bfloat16.
template <bool kHalf>
__device__ __forceinline__ void divide_rows(const Stager& stage, uint32_t tile, const float* den, int n, float unit) {
  float factors[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = stage.row0 + 16 * i;
    factors[i] = row < n ? __frcp_rn(den[row]) * unit : 0.f;
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (stage.row0 + 16 * i >= n) continue;
    const uint32_t at = tile + stage.piece0 + 2048 * i;
    const uint4 x = tensorcore::load_shared_16(at);
    uint32_t words[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float2 f = unpack<kHalf>(words[w]);
      words[w] = pack<kHalf>(f.x * factors[i], f.y * factors[i]);
    }
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(at), "r"(words[0]), "r"(words[1]), "r"(words[2]),
                 "r"(words[3])
                 : "memory");
  }
  fence_shared_writes();
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace wgmma

// A final key sum's entry i: k's sum over time (float32) plus the given start's entry (start:
// nullptr where none was given); the plain forward's kernels (KernelParams::key_sum_end) and
// launch_key_sum's.
__device__ __forceinline__ void write_key_sum(float* end, const float* start, int64_t i, float sum) {
  end[i] = start != nullptr ? sum + start[i] : sum;
}

// One pass of the four (wgmma_takes): the forward and dq walk time forward, dk and dv (as two
// passes: E or M above 128, or FAST_CAUSAL_ATTN_FUSED_GRAD_KV=0) backward, with the masks kept
// t >= s (Operands give each pass its A, B, Cc and output). One block a (sequence, head, column
// tile, time segment), from the segment's start (SegmentStart: the sums of the segments before it,
// after it in reverse); state-only blocks (launch_segmented's first launch) sum their segment's
// B^T Cc alone. kAtoms: A and B are 64 kAtoms columns wide (Da up to 64, 128 or 256), staged as
// kAtoms atoms, and the state's Da rows are kAtoms row blocks (state[a], each the accumulator of
// one m64 wgmma). kGroups: consumer warpgroups a block, all of them on the block's one staging of
// A and B (the producer's; see below):
//  - up to two atoms, each warpgroup its own 64 columns of Cc, the state and the outputs (the
//    column tile is 64 kGroups wide): A and B are read once for Dc up to 128, where column tiles
//    of 64 read them once a tile;
//  - at four atoms (kSplitRows), the state's rows split between them, two atoms each (rows 128
//    group on), on one Cc of 64 columns: each warpgroup the scores and A S over its half of Da
//    and its own partial output A_g S_g + mask(A_g B_g^T) Cc (the mask is linear, so the partial
//    outputs sum to the output), the second's added to the first's through shared memory, warp
//    by warp. One warpgroup holding all four atoms (kGroups = 1: FAST_CAUSAL_ATTN_WGMMA_GROUPS=1)
//    keeps 128 state registers a thread and spills, and runs alone on its multiprocessor (one
//    block: 217 KB): 27% slower at bf16 4,16,2048,256, every pass (H200, RESULTS.md, twenty-fifth
//    session: fwd / fwd+bwd 0.259 / 1.059 ms against 0.190 / 0.777).
// kOneLaunch: the forward's segments in one launch (KernelParams::lookback), an instance of its
// own, so that the other launches keep the pass's code as it is without it (beside the new code
// ptxas allocated the pass's loop differently: 2-5% more instructions).
// A producer warpgroup (the block's last) stages A, B and Cc for the kGroups consumer warpgroups
// (kOneLaunch: B and Cc of the summing walk first, then the pass's), kDepth - 1 chunks ahead:
// the consumers' chains, which bound the pass (each warp issues its ~720 instructions a chunk one
// in six cycles, the tensor pipe 53% busy: ncu, RESULTS.md, thirtieth session), keep the products,
// the state's copy and the outputs, on a ProducedRing whose named barriers start at kFull.
// bfloat16 at two atoms on two groups (producer_scores): the producer also computes each chunk's
// masked scores P before it announces the chunk, into a ring of kScoresDepth tiles; the
// consumers' chains then hold P Cc (from shared memory, running while the state's copy is made),
// A S and the update, but neither the scores' products nor the mask (the scores once a block,
// where each group computed them).
// Registers (kProducerRegisters, kConsumerRegisters): the producer gives back what the consumers
// take, where the block's share at launch (kLaunchRegisters) is below what they need (two
// consumer groups: 168 a thread; two blocks a multiprocessor at one atom on one group: 128).
namespace wgmma {
// wgmma_product_kernel's blocks a multiprocessor: two at one atom on one warpgroup (97 KB of
// shared memory each), one otherwise
__host__ __device__ constexpr int product_blocks_per_sm(int atoms, int groups) { return atoms == 1 && groups == 1 ? 2 : 1; }
}  // namespace wgmma
template <Pass P, typename scalar_t, int kAtoms, int kGroups, bool kOneLaunch = false, bool kNormalize = false>
__global__ void __launch_bounds__(wgmma::kThreads * (kGroups + 1), wgmma::product_blocks_per_sm(kAtoms, kGroups))
    wgmma_product_kernel(const KernelParams p, int64_t Da, int64_t Dc, int64_t col_tiles) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace wgmma;
  constexpr bool kHalf = std::is_same_v<scalar_t, at::Half>;
  static_assert(kHalf || std::is_same_v<scalar_t, at::BFloat16>, "bfloat16 or float16");
  static_assert(P != Pass::GradKV, "one pass: the forward, dq, dk or dv (dk with dv: wgmma_grad_kv_kernel)");
  static_assert(kAtoms == 1 || kAtoms == 2 || kAtoms == 4, "Da up to 64, 128 or 256");
  static_assert(kGroups == 1 || kGroups == 2, "one warpgroup or two");
  constexpr bool kReverse = PassTraits<P>::kReverse;  // dk and dv: time walked backward
  constexpr ProductLayout kLayout = product_layout(P, kAtoms, kGroups, kHalf, kNormalize);
  // the normalizer: the forward (den, KeySums) and dq (the extra row, KeySums), each group's copy
  // beside its scores; dk (the extra row e, KeySums) takes q / den, dv dO / den, its Cc, which the
  // producer divides in place (kDividesCc). Up to two atoms, or four on two groups (kSplitRows:
  // each group's row sums over its half of Da, the second's added to the first's beside its
  // partial outputs; the extra rows' terms in the first group's partial scores and summed outputs
  // alone)
  static_assert(!kNormalize || (kAtoms <= 2 || kGroups == 2), "normalize: Da up to 128, or 256 on two warpgroups");
  // (kNormalize) dk's q / den and dv's dO / den: their Cc, divided by the producer once staged
  constexpr bool kDividesCc = kNormalize && kReverse;
  // (kNormalize) the extra row's key sums (KeySums): dq's z (the sums of k, its Cc) and dk's e (the
  // sums of its Cc q / den weighted by -dO[t] . O[t]), each over this group's Cc columns
  constexpr bool kExtraRow = kNormalize && (P == Pass::GradQ || P == Pass::GradK);
  constexpr bool kSplitRows = kLayout.splits_rows();
  constexpr int kStateAtoms = kLayout.state_atoms();  // a warpgroup's row blocks of the state
  constexpr int kCcTiles = kLayout.cc_tiles();        // Cc's 64-column tiles a stage slot
  constexpr int kDepth = stages_for_atoms(kAtoms);
  constexpr int kSlot = kLayout.slot_tiles();  // tiles a stage slot: A, B (kAtoms each), Cc
  // the producer computes each chunk's masked scores P into a ring of kScoresDepth tiles (below)
  constexpr bool kProducerScores = kLayout.producer_scores();
  static_assert(!kProducerScores || (!kHalf && kGroups == 2), "A S onto P Cc: bfloat16's unscaled copy");
  static_assert(!kProducerScores || !kOneLaunch, "P's ring follows the pass's chunks alone (no summing walk)");
  // in tiles: the state copies (two parts of kStateAtoms tiles, a group), P's ring, then each
  // group's staging rows (kSplitRows: the partial outputs' exchange, the first group's staging
  // inside it; none beside P's ring: each group stages its outputs over its copy's tiles)
  constexpr int kCopyAt = kDepth * kSlot, kScoresAt = kCopyAt + kLayout.copy_tiles();
  constexpr int kStagingAt = kScoresAt + kLayout.scores_tiles();
  constexpr int kStagingEnd = kStagingAt * kTile + kLayout.staging_bytes();
  static_assert(kLayout.smem_bytes() <= 227 * 1024, "shared memory of one block");
  static_assert(kLayout.ones_bytes() == 0 || kStagingEnd % 1024 == 0, "the ones tile on the swizzle's period");

  extern __shared__ __align__(1024) unsigned char wgmma_smem[];
  const uint32_t base = smem_address(wgmma_smem);
  const int group = kGroups == 1 ? 0 : warpgroup();
  // kSplitRows: warp w's part of the exchange is 4 KB at 4096 w, its 16 staging rows (kOutStride
  // elements apart, from row 16 w on) inside it
  // (stages_over_copy: the staging rows over the group's copy)
  const int copy_tile = kCopyAt + 2 * kStateAtoms * group;  // this group's state copy
  unsigned char* const staging_at = wgmma_smem + kStagingAt * kTile;
  uint16_t* staging = reinterpret_cast<uint16_t*>(
      kLayout.stages_over_copy() ? wgmma_smem + copy_tile * kTile
                      : staging_at + (kSplitRows ? (kExchangeBytes / 4 - 16 * kOutStride * 2) * group_warp()
                                                 : group * kStagingBytes));
  // (kLayout.ones_bytes) the ones tile, B of rows_of_ones, after the staging rows; at one atom this
  // group's copy of z (its two parts) after it
  const uint32_t ones_tile = base + uint32_t(kStagingEnd), key_copy_tile = ones_tile + 1024 + 2048 * group;
  uint16_t* const key_copy = reinterpret_cast<uint16_t*>(wgmma_smem + kStagingEnd + 1024 + 2048 * group);
  float* warp_max = reinterpret_cast<float*>(wgmma_smem + kStagingEnd + kLayout.ones_bytes());
  StateCopy<kHalf, kStateAtoms> copy{base + uint32_t(copy_tile) * kTile, warp_max + 4 * group};
  // (kNormalize) the key sum: the forward's z over this group's B columns (Da's, kSplitRows: its
  // half's), for den; dq's over its group's Cc columns (k's, the extra row's; kSplitRows: both
  // groups the same, the first's used), twice (keys_of: chunk it's in keys_of(it), the next
  // chunk's written beside it, so that no barrier parts the reads from the owners' writes)
  using ColumnSums = KeySums<kHalf, P == Pass::Forward ? kStateAtoms : 1>;
  float* const key_base = warp_max + 4 * kGroups + 128 * group;
  const ColumnSums keys{key_base};
  auto keys_of = [key_base](int64_t it) { return ColumnSums{key_base + 64 * int(it % 2)}; };
  // after the key sums: (kLayout.row_terms) each stage slot's dO . O and den (dv: den twice; it has
  // no extra row); or (the forward, kSplitRows) the den parts, warp w's 16 rows' two partial sums
  // at 32 w (den_parts_bytes)
  float* const after_key_sums = warp_max + 4 * kGroups + 128 * kGroups;
  const RowTerms<2> row_terms{after_key_sums};
  float2* const den_parts = reinterpret_cast<float2*>(after_key_sums) + 16 * group_warp();

  // One launch for the segments (the forward's): the block's work by the order blocks start
  static_assert(!kOneLaunch || (P == Pass::Forward && kAtoms == 1 && kGroups == 1),
                "one launch: the forward's segments at Da and Dc up to 64 (one_launch_segments)");
  const int64_t block = kOneLaunch ? lookback::ticket(p.lookback, reinterpret_cast<unsigned*>(wgmma_smem)) : -1;
  const chunked::BlockWork<P, scalar_t> work(p, col_tiles, C * kCcTiles, Dc, 1, 0, block);
  const Operands<P, scalar_t, float> ops = work.operands(p);
  const int64_t chunks = work.chunk_count(C);
  const bool state_only = work.state_only;  // the segment's own B^T Cc alone (launch_segmented's first launch)
  // the normalized dq pass makes dO . O itself (KernelParams::dots_in_grad_q: one column tile, up
  // to two atoms), from O's rows beside its staged dO (row_dots)
  constexpr bool kMakesDots = kNormalize && P == Pass::GradQ && kAtoms <= 2;
  const bool makes_dots = kMakesDots && p.dots_in_grad_q;
  const scalar_t* const o_rows =
      makes_dots ? static_cast<const scalar_t*>(p.o.ptr) + p.o.offset(work.seq.b, work.seq.h, work.seq.begin) : nullptr;
  const int64_t o_l = p.o.stride_l;
  // this group's first column of Cc, the state and the outputs, and first row of the state
  const int64_t m0 = work.m0 + (kSplitRows ? 0 : C * group), row0 = kSplitRows ? 64 * kStateAtoms * group : 0;
  const uint32_t my_atoms = uint32_t(row0 / 64) * kTile;  // this group's A and B atoms in their tiles
  const int cols = int(Dc - m0 < C ? Dc - m0 : C);
  auto chunk_begin = [&](int64_t it) { return work.chunk_begin(it, chunks, C); };  // chunk it's first step
  const int64_t first_step = chunks > 0 ? chunk_begin(0) : work.seg_begin;
  const Stager stage(int(threadIdx.x % kThreads));
  auto tile_of = [&](int slot, int which) { return base + uint32_t(slot * kSlot + which) * kTile; };
  // the producer and its barriers (see above); 1 + warp: kSplitRows' exchange
  constexpr int kConsumers = kThreads * kGroups, kBlockThreads = kConsumers + kThreads;
  // kLandedBarrier: the producer's own (each chunk's copies landed, before its scores or its q / den)
  constexpr int kGroupBarrier = 5, kFull = kGroupBarrier + kGroups, kLandedBarrier = kFull + 2 * kDepth;
  static_assert(kLandedBarrier < 16, "named barriers");
  // P's ring lives kScoresDepth chunks: the stage slots are released for it
  using Ring = ProducedRing<kDepth, kProducerScores ? kScoresDepth : kDepth>;
  auto scores_tile = [&](int64_t it) { return base + uint32_t(kScoresAt + int(it % kScoresDepth)) * kTile; };
  // One launch (kOneLaunch): where a later segment starts from this one's own sums, B^T Cc, the
  // block first walks its chunks (all whole: not the sequence's last segment) from the last back
  // to the first summing them, so that the pass after starts on the chunks read last, their k and
  // v likely still in the L2. One ring serves both walks: the ring's chunk j < summed is the
  // summing walk's, j - summed the pass's, and the producer stages the pass's first chunks while
  // the consumers wait for the sums of the segments before. (Measured against one warpgroup
  // staging its own chunks, H200, kernel ms: 0.0311 -> 0.0296 bf16, 0.0329 -> 0.0316 fp16 at
  // 2,4,8192,64; RESULTS.md, thirty-second session.)
  const int64_t summed = kOneLaunch && work.segment + 1 < p.segments ? chunks : 0;
  const int64_t walked = summed + chunks;  // the ring's chunks
  // The forward's state-only blocks (launch_segmented's first launch) sum their chunks from the
  // last back to the first, for the same reason: the pass's launch after starts each segment on
  // the k and v read last, the likeliest still in the L2. The sums are order-free (the consumers'
  // sum_own_chunks; a partial last chunk staged with zeros past it). Not dq's nor at four atoms:
  // the second staging direction there spilled the producer's registers (ptxas, sm_90a: the
  // normalized dq at two atoms 0 -> 56 bytes), and neither runs the long-sequence shapes this is for.
  // Measured (H100, the forward's kernels, profiler ms, two A/B runs each): bf16 1,16,32768,128
  // 0.2783 -> 0.2757, 2,4,8192,128 0.0527 -> 0.0505; fp16 0.2835 -> 0.2773 and 0.0537 -> 0.0504;
  // 4,16,8192,128 unchanged in bf16, -1.4% in fp16 (RESULTS.md, seventy-fifth session).
  constexpr bool kSumsBack = P == Pass::Forward && kAtoms <= 2 && !kOneLaunch;
  const bool sums_back = kSumsBack && state_only;
  // A (but in state-only blocks and the summing walk), B and the slot's Cc tiles of the ring's
  // chunk j into stage slot `slot`, as one group of copies (none past the last); called for j =
  // 0, 1, 2, ... in order (the sources step a chunk each call, back in reverse and in the summing
  // walk), by the producer
  const int64_t b_first = summed > 0 || sums_back ? work.chunk_begin(0, chunks, C, true) : first_step;
  Source a_src = stage.source(ops.a_rows(), first_step, Da);
  Source b_src = stage.source(ops.b_rows(), b_first, Da);
  Source c_src[kCcTiles];
#pragma unroll
  for (int g = 0; g < kCcTiles; ++g) c_src[g] = stage.source(ops.c_rows(), b_first, Dc, work.m0 + C * g);
  // a walk that only sums (one launch's, sums_back's): B and Cc of n steps, the sources stepping
  // back (A is the pass's)
  auto stage_sums_back = [&](int slot, int n) {
    stage.operator()<true, kAtoms>(tile_of(slot, kAtoms), b_src, ops.b_rows().ptr, n);
#pragma unroll
    for (int g = 0; g < kCcTiles; ++g) stage.operator()<true>(tile_of(slot, 2 * kAtoms + g), c_src[g], ops.c_rows().ptr, n);
  };
  auto stage_chunk = [&](int64_t j, int slot) {
    if constexpr (kOneLaunch) {
      if (j < summed) {
        stage_sums_back(slot, C);
        StageRing<kDepth>::commit_copies();
        if (j + 1 == summed) {  // the pass's sources, from its first chunk
          b_src = stage.source(ops.b_rows(), first_step, Da);
          c_src[0] = stage.source(ops.c_rows(), first_step, Dc, work.m0);
        }
        return;
      }
    }
    const int64_t it = j - summed;
    if (sums_back) {
      if (it < chunks) stage_sums_back(slot, work.chunk_len(work.chunk_begin(it, chunks, C, true), C));
      StageRing<kDepth>::commit_copies();
      return;
    }
    if (it < chunks) {
      const int n = work.chunk_len(chunk_begin(it), C);
      if (!state_only) stage.operator()<kReverse, kAtoms>(tile_of(slot, 0), a_src, ops.a_rows().ptr, n);
      stage.operator()<kReverse, kAtoms>(tile_of(slot, kAtoms), b_src, ops.b_rows().ptr, n);
#pragma unroll
      for (int g = 0; g < kCcTiles; ++g) {
        stage.operator()<kReverse>(tile_of(slot, 2 * kAtoms + g), c_src[g], ops.c_rows().ptr, n);
      }
      if constexpr (kNormalize && P != Pass::Forward) {  // (kLayout.row_terms)
        // (dq's state-only blocks sum k alone; dk's and dv's divide q by den, dk's weight e's sums)
        const int64_t t0 = chunk_begin(it);
        const float* dots = P == Pass::GradV ? ops.den + t0 : ops.dout_dot_out + t0;
        if (!state_only || kReverse) row_terms.stage(slot, {dots, ops.den + t0}, n, makes_dots ? 0 : -1);
        if (makes_dots && !state_only) prefetch_rows<kAtoms>(stage, o_rows, t0, o_l, a_src.inside, n);
      }
    }
    StageRing<kDepth>::commit_copies();
  };
  {
    // each producer thread's registers and each consumer's, where the launch's share is too few
    constexpr int kLaunchRegisters = 65536 / (kBlockThreads * product_blocks_per_sm(kAtoms, kGroups)) / 8 * 8;
    constexpr bool kReallocate = kLaunchRegisters < 255;
    // (the producer's scores: 32 accumulators and 16 fragments more than its copies take)
    // (the normalized dq's row_dots: O's pieces and dO's, 16 registers each, beside its copies; 56
    // spilled them at two groups)
    constexpr int kProducerRegisters = kProducerScores ? 88 : kGroups == 2 ? (kMakesDots ? 72 : 56) : 48;
    constexpr int kConsumerRegisters = kProducerScores ? 208 : kGroups == 2 ? 216 : 208;
    static_assert(!kReallocate || kGroups * kConsumerRegisters + kProducerRegisters <= (kGroups + 1) * kLaunchRegisters,
                  "the block's registers at launch");
    // (warpgroup(), broadcast: a branch the compiler knows each warp takes whole, so that the
    // consumers' descriptors stay in uniform registers: <Forward, bf16, 2, 1>'s chunk loop 860 ->
    // 743 static instructions, 106 R2UR -> 0; its kernel times unchanged on the H200, RESULTS.md,
    // thirty-second session)
    if (warpgroup() == kGroups) {
      if constexpr (kReallocate) registers_down_to<kProducerRegisters>();
      // The pass's chunk it's masked scores P (every group's: they share A and B) into P's ring,
      // once every producer thread's copies of it have landed, before it is announced: the
      // consumers' chains then hold neither the scores' products nor the mask.
      auto scores = [&](int64_t it, int slot) {
        if constexpr (kProducerScores) {
          if (state_only) return;
          named_sync(kLandedBarrier, kThreads);
          make_masked_scores<kHalf, kAtoms, kReverse>(tile_of(slot, 0), tile_of(slot, kAtoms), scores_tile(it));
        }
      };
      // (kDividesCc) chunk it's staged Cc divided by its rows' den once every producer thread's
      // copies of it (den among them) have landed, before it is announced (as wgmma_grad_kv_kernel's):
      // dk's Cc is q; dv's is dO, where its 1 / den[t] goes as well as into q (B): row t of Cc is
      // column t of the scores in P Cc and row t of B^T Cc, so both products see it once, and Cc
      // is one tile where B is kAtoms (dv dividing B's four atoms at bf16 4,16,2048,256 took 0.301
      // ms where dk took 0.215; H100, RESULTS.md, fifty-sixth session)
      // (float16: the quotients in KernelParams::den_unit's unit, read once here)
      const float unit = den_unit_of<kHalf && kDividesCc>(p, 0);
      auto divide_cc = [&](int64_t it, int slot) {
        if constexpr (kDividesCc) {
          named_sync(kLandedBarrier, kThreads);
          const int n = work.chunk_len(chunk_begin(it), C);
          const float* den = row_terms.slot(slot) + 64;
#pragma unroll
          for (int g = 0; g < kCcTiles; ++g) divide_rows<kHalf>(stage, tile_of(slot, 2 * kAtoms + g), den, n, unit);
        }
      };
      // (makes_dots) chunk it's dO . O, from this thread's own landed pieces of dO, into the slot's
      // row terms for the consumers (before the chunk is announced) and into dout_dot_out for the
      // dk pass after this one
      auto dots_of = [&](int64_t it, int slot) {
        if constexpr (kMakesDots) {
          if (!makes_dots || state_only) return;
          const int64_t t0 = chunk_begin(it);
          const int n = work.chunk_len(t0, C);
          float dots[4];
          row_dots<kHalf, kAtoms>(dots, stage, tile_of(slot, 0), o_rows + t0 * o_l, o_l, a_src.inside, n);
          if (stage.col != 0) return;
          float* const to = static_cast<float*>(p.dout_dot_out) + work.den_row + t0;
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int row = stage.row0 + 16 * i;
            row_terms.put(slot, 0, row, dots[i]);  // (0 past n)
            if (row < n) to[row] = dots[i];
          }
        }
      };
      static_assert(!(kProducerScores && kDividesCc), "one use of the landed barrier");
      Ring(kFull, kBlockThreads).produce(walked, stage_chunk, [&](int64_t it, int slot) {
        scores(it, slot);
        divide_cc(it, slot);
        dots_of(it, slot);
      });
      return;
    }
    if constexpr (kReallocate) registers_up_to<kConsumerRegisters>();
  }
  const int my_c = 2 * kAtoms + (kSplitRows ? 0 : group);  // this group's Cc in a slot
  // the consumers' barriers: this warpgroup's threads (the readers of its state copy), and all of
  // the consumers' (one launch's flags)
  auto group_sync = [&] { named_sync(kGroupBarrier + group, kThreads); };
  auto consumers_sync = [] { named_sync(kGroupBarrier, kConsumers); };
  static_assert(!kOneLaunch || kGroups == 1, "(one group: its barrier is the consumers')");
  // The ring's chunk j in ring.slot for every consumer (with whatever each wrote to shared memory
  // before and fenced: fence_shared_writes), and the slot released once the chunk's products
  // have run.
  Ring ring(kFull, kBlockThreads);
  auto release = [&](int64_t j) { ring.release(j, walked); };
  // The state: row e = row0 + 64 a + 16 warp + g (+8), column m = m0 + 8 j + 2 q4 (+1) in
  // state[a][4 j ..]; from the segment's start.
  float state[kStateAtoms][32];
  // (kExtraRow) a chunk's sums for the extra row over this group's Cc columns (at c_tile, stage
  // slot `slot`), by `of`'s owners: dq's of k, dk's of q / den weighted by -dO[t] . O[t]
  auto extra_chunk_sums = [&](const ColumnSums& of, float (&sums)[1][2], uint32_t c_tile, int slot) {
    if constexpr (kExtraRow && P == Pass::GradQ) {
      of.chunk_sums(sums, c_tile);
    } else if constexpr (kExtraRow) {
      of.chunk_sums(sums, c_tile, row_terms.extra_weights(slot));
    }
  };
  // S += B^T Cc over the segment's chunks, the ring's first (a state-only block's whole walk, or
  // one launch's summing walk)
  // (kNormalize: z or e += the chunks' sums as well, read by no other warp here)
  auto sum_own_chunks = [&] {
    for (int64_t j = 0; j < chunks; ++j, ring.advance()) {
      ring.wait();
      fence();
      add_bt_times_c<kHalf>(state, tile_of(ring.slot, kAtoms) + my_atoms, tile_of(ring.slot, my_c));
      commit();
      if constexpr (kNormalize && P == Pass::Forward) {  // (k as B, this group's atoms)
        float sums[kStateAtoms][2];
        keys.chunk_sums(sums, tile_of(ring.slot, kAtoms) + my_atoms);
        keys.add(sums);
      } else if constexpr (kExtraRow) {
        float sums[1][2];
        extra_chunk_sums(keys, sums, tile_of(ring.slot, my_c), ring.slot);
        keys.add(sums);
      }
      wait<0>();
      release(j);
    }
  };
  if constexpr (kOneLaunch) {
    // This (pair, column tile)'s segments: their sums' slots and their blocks' flags.
    const int64_t slot0 = work.pair * p.segments;
    unsigned* const flags = p.lookback + 1 + (block - work.segment);
    if (summed > 0) {  // this segment's own sums, the ring's first chunks
#pragma unroll
      for (int a = 0; a < kStateAtoms; ++a)
#pragma unroll
        for (int i = 0; i < 32; ++i) state[a][i] = 0.f;
      if constexpr (kNormalize) keys.set([](int) { return 0.f; });  // (z: the segment's own key sums too)
      sum_own_chunks();  // (summed = chunks)
#pragma unroll
      for (int a = 0; a < kStateAtoms; ++a) {
        store_end(state[a], p.seg_sums + (slot0 + work.segment) * Da * Dc, Da, Dc, row0 + 64 * a, m0);
      }
      if constexpr (kNormalize) keys.store(p.seg_own_vector_sums + (slot0 + work.segment) * Da + row0, Da - row0);
      lookback::publish(flags + work.segment, consumers_sync);
    }
    lookback::wait_for(flags, work.segment, consumers_sync, kConsumers);
#pragma unroll
    for (int a = 0; a < kStateAtoms; ++a) {
      add_segments_before(state[a], p.seg_sums + slot0 * Da * Dc, work.segment, 1, Da, Dc, row0 + 64 * a, m0);
      // the start, where the scan would have left it: the dq pass's (the forward's kept starts,
      // where it keeps them: seg_state, else nullptr)
      if (p.seg_state != nullptr) {
        store_end(state[a], static_cast<float*>(p.seg_state) + (slot0 + work.segment) * Da * Dc, Da, Dc,
                  row0 + 64 * a, m0);
      }
      add_given_start(state[a], p, work.pair, Da, Dc, row0 + 64 * a, m0);  // (after the kept start: dq adds its own)
    }
  } else {
#pragma unroll
    for (int a = 0; a < kStateAtoms; ++a) {
      load_start(state[a], p, work.pair, work.segment, Da, Dc, state_only, row0 + 64 * a, m0);
    }
  }
  // kNormalize: z (e) from the segment's start (zeros in state-only blocks), seen after the ring's first wait
  if constexpr (kNormalize && kOneLaunch) {
    // (one launch: the key sums of the segments before, published beside their states, stored
    // where the scan would have left them for the dq pass, as the state's are; then the given
    // start's, which dq adds itself)
    const int64_t slot0 = work.pair * p.segments;
    keys.set([&](int column) {
      return row0 + column < Da
                 ? add_vector_sums_before(p.seg_own_vector_sums + slot0 * Da + row0 + column, work.segment, Da)
                 : 0.f;
    });
    if (p.seg_key_sum != nullptr) {
      keys.store(static_cast<float*>(p.seg_key_sum) + (slot0 + work.segment) * Da + row0, Da - row0);
    }
    if (p.start_vector != nullptr) {
      const float* const given = static_cast<const float*>(p.start_vector) + work.pair * Da + row0;
      keys.set([&](int column) { return row0 + column < Da ? keys.z[column] + given[column] : 0.f; });
    }
  } else if constexpr (kNormalize && P == Pass::Forward) {
    const SegmentStart<float> start(p, work.pair, work.segment, Da, Dc);
    keys.set([&](int column) { return !state_only && row0 + column < Da ? start.key_sum(row0 + column) : 0.f; });
  } else if constexpr (kExtraRow) {  // the extra row's start (with_state_io's z0, dk's dz1), this group's columns
    const SegmentStart<float> start(p, work.pair, work.segment, Da, Dc);
    keys.set([&](int column) { return !state_only && m0 + column < Dc ? start.extra(m0 + column) : 0.f; });
  }

  // Each output times the pass's constant factor (see the file's comment; the reverse passes'
  // under normalize in float16 also times 1 / KernelParams::den_unit, the unit of their sums).
  const float factor = float(p.scale) * den_unit_of<kHalf && kNormalize && kReverse>(p, 1);
  // The plain forward's key sum beside a final state (KernelParams::key_sum_end): the pass's first
  // group of column tile 0 (kSplitRows: each group its half of Da) sums k's columns from each
  // staged chunk while the chunk's first products run (keys.chunk_sums: an owner lane's two
  // columns an atom, kept in registers; z in shared memory spilled more, RESULTS.md, seventy-sixth
  // session), and writes them at the end. Every plain 16-bit forward, bfloat16 at four atoms too
  // since load_start's loads went together (no spills there with the sums, ptxas; before, their
  // spills ran that forward 2.7% slower; RESULTS.md, seventy-seventh and seventy-eighth sessions).
  constexpr bool kPlainKeySums = P == Pass::Forward && !kNormalize;
  const bool sums_keys =
      kPlainKeySums && p.key_sum_end != nullptr && !state_only && (kSplitRows || group == 0) && work.col_tile == 0;
  float plain_keys[kStateAtoms][2] = {};
  auto add_plain_key_sums = [&](uint32_t b_tile) {
    if constexpr (kPlainKeySums) {
      if (!sums_keys) return;
      float sums[kStateAtoms][2];
      keys.chunk_sums(sums, b_tile);
#pragma unroll
      for (int a = 0; a < kStateAtoms; ++a)
#pragma unroll
        for (int e = 0; e < 2; ++e) plain_keys[a][e] += sums[a][e];
    }
  };
  if (state_only) {  // the segment's own B^T Cc alone (no summing walk before)
    sum_own_chunks();
  } else {
    // Where the copy of the state before a chunk is made: up to two atoms a warpgroup beside the
    // chunk's scores (the tensor cores work while the copy's conversion runs; the scores read only
    // the staged A and B), at four at the end of the chunk before, where nothing runs beside it.
    // Measured on the H200 (RESULTS.md, twenty-fourth session): beside the scores, two atoms'
    // forward and dq 3-6% faster; four atoms no faster, with twice the spills.
    constexpr bool kCopyBesideScores = kStateAtoms < 4;
    // bfloat16 on one warpgroup of one atom (no scale of the copy to take back before P Cc): P
    // Cc behind A S once the scores are in, the state's update behind P Cc, running while the
    // outputs are stored. Measured on the H200 (bf16, kernel ms; RESULTS.md, twenty-eighth
    // session): dq 0.0710 -> 0.0696 at 4,16,8192,64, 0.0138 -> 0.0130 at 2,4,8192,64, the
    // forward even; on two warpgroups slower (8,16,2048,128 forward 0.0894 -> 0.0940,
    // 4,16,2048,256 0.179 -> 0.193), so they keep the update before the wait for A S.
    constexpr bool kStateBehindOutputs = !kHalf && kAtoms == 1 && kGroups == 1;
    if constexpr (kCopyBesideScores) {
      if constexpr (kHalf) copy.post_max(state);  // the first copy's scale, read after the barrier of arrive
    } else {
      copy.publish_first(state, group_sync);
    }
    // kNormalize: q . z of the lane's two rows (KeySums::row_dots), the forward's row sums of its
    // normalizer at four atoms (row_sums[h]: P's rounded and the float32 scores', over this group's
    // half of Da) and the outputs' factors a row
    float key_dots[2], row_sums[2][2], row_factors[2];
    static_assert(!kNormalize || (kCopyBesideScores && !kProducerScores), "the normalizer's place");
    // (kNormalize, bfloat16's forward, but kSplitRows: kLayout.ones_bytes) P's rounded row sums on
    // the tensor cores, beside P Cc (rows_of_ones, in rounded_sums once P Cc is waited for), the
    // float32 scores' on the CUDA cores (exact_sums); the first group writes the ones tile, which
    // the ring's first wait (every consumer's barrier) shows the second
    constexpr bool kOnesRows = kLayout.ones_bytes() > 0;
    // and (one atom) the chunk's sums of k too (column_sums_of_ones; at two atoms their eight
    // accumulators beside the scores spilled 44-132 bytes)
    constexpr bool kKeySumsOnOnes = kOnesRows && kStateAtoms == 1;
    // and (one atom) q . z, from z's 16-bit copy (KeySums::publish_copy at each chunk's start, its
    // products with A S: times_key_copy), z as set above: the warp's own entries, hence its sync
    constexpr bool kKeyDotsOnOnes = kKeySumsOnOnes;
    float exact_sums[2], rounded_sums[4], key_columns[kStateAtoms][4], key_copy_dots[4];
    if constexpr (kKeyDotsOnOnes) __syncwarp();
    if constexpr (kOnesRows) {
      if (group == 0) {
        const uint32_t one = 0x3F803F80u;  // two bfloat16 ones
        reinterpret_cast<uint2*>(wgmma_smem + kStagingEnd)[threadIdx.x % kThreads] = make_uint2(one, one);
        fence_shared_writes();
      }
    }
    for (int64_t it = 0; it < chunks; ++it, ring.advance()) {
      const int64_t j = summed + it;  // the ring's chunk
      // kNormalize, dq: the lane's rows' extra-row a (-dO[t] . O[t]) or output factor (scale /
      // den[t]), from the chunk's row terms, each read where it is used and before the slot's
      // release (held across the chunk, the two-atom two-group instance spilled 108 bytes)
      auto dq_rows = [&](float (&values)[2], bool weights) {
        row_terms.dq_rows(values, ring.slot, work.chunk_len(chunk_begin(it), C), weights, factor);
      };
      // kNormalize, the forward, from the whole row sums: den = eps + scale (the row sum of the
      // masked float32 scores + q . z), kept for the backward (by the first group of column tile
      // 0), and the rows' factors scale / (the same with P's rounded row sum: normalizer_sums)
      auto finish_normalizer = [&](const float (&rounded)[2], const float (&exact)[2]) {
        const int64_t t0 = chunk_begin(it);
        const int n = work.chunk_len(t0, C);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = 16 * group_warp() + int(threadIdx.x % kWarp) / 4 + 8 * h;
          row_factors[h] = factor * __frcp_rn(float(p.eps) + factor * (rounded[h] + key_dots[h]));
          if (group == 0 && work.col_tile == 0 && threadIdx.x % 4 == 0 && row < n) {
            static_cast<float*>(p.den)[work.den_row + t0 + row] = float(p.eps) + factor * (exact[h] + key_dots[h]);
          }
        }
      };
      // the forward's row sums (kSplitRows: this group's half, finished by the first group once
      // the second's have come with its partial outputs)
      auto normalizer = [&](const float (&score)[32], const uint32_t (&masked)[4][4]) {
        float exact[2], rounded[2];
        normalizer_sums<kHalf, kReverse>(exact, rounded, score, masked);
        if constexpr (kSplitRows) {
#pragma unroll
          for (int h = 0; h < 2; ++h) row_sums[h][0] = rounded[h], row_sums[h][1] = exact[h];
        } else {
          finish_normalizer(rounded, exact);
        }
      };
      // out += mask(score) Cc in one committed group (add_masked_times), kNormalize's normalizer
      // taken from the masked fragments on the way
      auto add_masked = [&](float (&to)[32], float (&score)[32], uint32_t c_tile) {
        // dq's extra row: each score of row t plus its a (kSplitRows: in the first group's partial scores)
        if (kNormalize && P == Pass::GradQ && (!kSplitRows || group == 0)) {
          float weights[2];
          dq_rows(weights, true);
#pragma unroll
          for (int i = 0; i < 32; ++i) score[i] += weights[(i % 4) / 2];
        }
        // dk's: each score of column t plus -dO[t] . O[t] (kSplitRows: likewise the first group's)
        if (kNormalize && P == Pass::GradK && (!kSplitRows || group == 0)) {
          add_to_columns(score, row_terms.extra_weights(ring.slot));
        }
        if constexpr (kNormalize && P == Pass::Forward) {
          // (kKeySumsOnOnes: the scores waited for, their group's k sums too; every warp's q . z
          // read z before the copy's barrier)
          if constexpr (kKeySumsOnOnes) keys.add_column_sums(key_columns);
          uint32_t masked[4][4];
          masked_fragments<kHalf, kReverse>(masked, score);
          if constexpr (kOnesRows) {
            exact_row_sums<kReverse>(exact_sums, score);
          } else {
            normalizer(score, masked);
          }
          fence();
          add_fragments_times<kHalf>(to, masked, c_tile);
          if constexpr (kOnesRows) rows_of_ones(rounded_sums, masked, ones_tile);
          commit();
        } else {
          add_masked_times<kHalf, kReverse>(to, score, c_tile);
        }
      };
      if constexpr (!kCopyBesideScores) fence_shared_writes();  // the copy made at the end of the chunk before
      ring.wait();  // chunk it staged (and that copy seen)
      const uint32_t at = tile_of(ring.slot, 0) + my_atoms, bt = tile_of(ring.slot, kAtoms) + my_atoms,
                     ct = tile_of(ring.slot, my_c);
      float out[32];  // set by its first product (accumulate = false)
      if constexpr (kProducerScores) {
        // P Cc first (P from the producer), running while the state's copy is made; then A S onto
        // it, the state's update behind
        fence();
        tile_times<kHalf>(out, scores_tile(it), ct);  // P Cc
        commit();
        add_plain_key_sums(bt);
        copy.publish(state);
        fence_shared_writes();
        group_sync();  // the copy seen by every warp's wgmma
        fence();
        times_state_copy<kHalf, 1, kStateAtoms>(out, at, copy.at, 0, true);  // A S onto P Cc
        commit();
        add_bt_times_c<kHalf>(state, bt, ct);
        commit();
        wait<1>();  // P Cc and A S; the state's update may still run
      } else {  // the scores and the mask on this group's chain
        float score[32];  // set by its first product
        fence();
        scores_of<kHalf, kStateAtoms>(score, at, bt);  // A B^T (kSplitRows: over this group's half)
        // (kKeySumsOnOnes) this chunk's sums of k, z's next update, on the tensor cores with the scores
        // (key_columns, taken into z by add_masked once the scores are waited for)
        if constexpr (kKeySumsOnOnes) column_sums_of_ones<kStateAtoms>(key_columns, bt, ones_tile);
        commit();
        add_plain_key_sums(bt);
        // (kKeyDotsOnOnes) z's copy for this chunk's q . z, seen by the tensor cores after the state
        // copy's fence and barrier below
        if constexpr (kKeyDotsOnOnes) keys.publish_copy(key_copy);
        float key_chunk[kStateAtoms][2];  // (kNormalize, but kKeySumsOnOnes) this chunk's sums of k
        if constexpr (kNormalize && P == Pass::Forward) {  // while the scores run
          if constexpr (!kKeyDotsOnOnes) keys.row_dots(key_dots, at);
          if constexpr (!kKeySumsOnOnes) keys.chunk_sums(key_chunk, bt);
        }
        if constexpr (kExtraRow) {  // the next chunk's z (e) beside this one's
          float sums[1][2];
          extra_chunk_sums(keys_of(it), sums, ct, ring.slot);
          keys_of(it + 1).assign(keys_of(it), sums);
        }
        if constexpr (kCopyBesideScores) {
          copy.publish(state);
          fence_shared_writes();
          group_sync();  // the copy seen by every warp's wgmma
        }
        if constexpr (kNormalize && P == Pass::Forward && !kKeySumsOnOnes) keys.add(key_chunk);  // (every warp's q . z has read z)
        if constexpr (kStateAtoms == 4) {
          // The state's 128 registers leave no room for the scores, A S and P at once (that order
          // spilled 1.4 KB a thread): the state's update runs while the scores become P, then A S
          // and P Cc.
          fence();
          add_bt_times_c<kHalf>(state, bt, ct);
          commit();
          wait<1>();  // the scores
          uint32_t masked[4][4];
          masked_fragments<kHalf, kReverse>(masked, score);
          fence();
          times_state_copy<kHalf, 1, kStateAtoms>(out, at, copy.at);  // A S
          if constexpr (kHalf) {  // back to S's scale before P Cc adds in
            commit();
            wait<0>();
            copy.scale_back(out);
            fence();
          }
          add_fragments_times<kHalf>(out, masked, ct);  // out += P Cc
          commit();
        } else {
          fence();
          times_state_copy<kHalf, 1, kStateAtoms>(out, at, copy.at);  // A S
          if constexpr (kKeyDotsOnOnes) times_key_copy(key_copy_dots, at, key_copy_tile);  // q . z
          commit();
          if constexpr (kStateBehindOutputs) {  // P Cc behind A S, the state's update behind P Cc
            wait<1>();  // the scores; A S may still run
            add_masked(out, score, ct);  // out += P Cc (its fence before the update too)
          }
          add_bt_times_c<kHalf>(state, bt, ct);
          commit();
          wait<1>();  // the scores and A S (P Cc too, behind A S); the state's update may still run
          if constexpr (!kStateBehindOutputs) {
            copy.scale_back(out);  // (back to S's scale before P Cc)
            add_masked(out, score, ct);  // out += P Cc
          }
        }
      }
      float row_weights[2];  // (kNormalize, dq: the extra row's a, read before the slot's release)
      if constexpr (kNormalize && P == Pass::GradQ) {
        dq_rows(row_weights, true);
        dq_rows(row_factors, false);
      }
      if constexpr (!kStateBehindOutputs) {
        wait<0>();
        release(j);
      }
      if constexpr (kHalf) copy.post_max(state);  // the state after this chunk: read after the next barrier

      const int64_t t0 = chunk_begin(it);
      // the chunk's outputs times the constant factor or (kNormalize: the forward's, dq's) each row's
      constexpr bool kRowFactors = kNormalize && !kReverse;
      // the extra rows' terms (dq: each row's a times z; dk: e) added, then the outputs stored
      auto finish_outputs = [&] {
        if constexpr (kNormalize && P == Pass::GradQ) keys_of(it).add_scaled_to_rows(out, row_weights);  // + a z
        if constexpr (kNormalize && P == Pass::GradK) keys_of(it).add_to_rows(out);  // + e
        auto store_outputs = [&](const auto& factors) {
          store_rows<kHalf>(out, factors, staging, ops.out + t0 * ops.out_l + m0, ops.out_l, work.chunk_len(t0, C), cols);
        };
        if constexpr (kRowFactors) {
          store_outputs(row_factors);
        } else {
          store_outputs(factor);
        }
      };
      if constexpr (kSplitRows) {
        // the second group's partial output to the first, warp w to warp w (named barrier 1 + w
        // of their 64 threads), float4 j of lane l at 16 (32 j + l) bytes of the warp's part: each
        // store and load a whole 512 bytes (kNormalize, the forward: its rows' partial row sums
        // beside, the quad's first lane's, in the den parts). The part is free again: the first
        // group's warp read it and its staging rows (inside it) before this chunk's arrive (the
        // ring's wait: every consumer's).
        float4* part = reinterpret_cast<float4*>(staging_at + (kExchangeBytes / 4) * group_warp()) + threadIdx.x % kWarp;
        const int quad_row = int(threadIdx.x % kWarp) / 4;  // (the den parts: the lane's rows g, g + 8)
        if (group == 1) {
#pragma unroll
          for (int j = 0; j < 8; ++j) part[kWarp * j] = make_float4(out[4 * j], out[4 * j + 1], out[4 * j + 2], out[4 * j + 3]);
          if constexpr (kNormalize && P == Pass::Forward) {
            if (threadIdx.x % 4 == 0) {
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                den_parts[quad_row + 8 * h] = make_float2(row_sums[h][0] + key_dots[h], row_sums[h][1] + key_dots[h]);
              }
            }
          }
          named_arrive(1 + group_warp(), 2 * kWarp);
        } else {
          named_sync(1 + group_warp(), 2 * kWarp);
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const float4 x = part[kWarp * j];
            out[4 * j] += x.x, out[4 * j + 1] += x.y, out[4 * j + 2] += x.z, out[4 * j + 3] += x.w;
          }
          if constexpr (kNormalize && P == Pass::Forward) {  // the whole row sums, then den and the factors
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const float2 other = den_parts[quad_row + 8 * h];
              row_sums[h][0] += other.x, row_sums[h][1] += other.y;
            }
            finish_normalizer({row_sums[0][0], row_sums[1][0]}, {row_sums[0][1], row_sums[1][1]});
          }
          finish_outputs();
        }
      } else {
        // (in the copy's tiles: every warp's A S has read the copy)
        if constexpr (kLayout.stages_over_copy()) group_sync();
        if constexpr (kKeyDotsOnOnes) {  // (A S waited for) lane q4 = 0's column 0 to its quad
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            key_dots[h] = __shfl_sync(0xffffffffu, key_copy_dots[2 * h], int(threadIdx.x % kWarp) & ~3);
          }
        }
        if constexpr (kOnesRows) finish_normalizer({rounded_sums[0], rounded_sums[2]}, exact_sums);  // (P Cc waited for)
        finish_outputs();
      }
      if constexpr (kStateBehindOutputs) {
        wait<0>();  // the state's update, before its next copy
        release(j);
      }
      if constexpr (!kCopyBesideScores) {
        group_sync();         // every warp's wgmma has read the state copy
        copy.publish(state);  // S after this chunk, for the next
      }
    }
  }
  const SegmentEnd<float> end(p, work.pair, work.segment, Da, Dc, kReverse, P == Pass::Forward, work.piece);
  // (the forward's segment ends, for the one-pass backward: KernelParams::segment_ends)
  float* const kept_end =
      P == Pass::Forward && p.segment_ends != nullptr && !state_only
          ? p.segment_ends + (work.pair * p.segments + work.segment) * Da * Dc
          : nullptr;
#pragma unroll
  for (int a = 0; a < kStateAtoms; ++a) {
    store_end(state[a], end.state, Da, Dc, row0 + 64 * a, m0);
    store_end(state[a], kept_end, Da, Dc, row0 + 64 * a, m0);
  }
  // the plain forward's key sum: the end itself (one segment: with the given start), or the
  // segment's own sums (KernelParams::key_sum_parts)
  if constexpr (kPlainKeySums) {
    if (sums_keys && keys.owner()) {
      const bool whole = p.segments == 1;
      float* const to = whole ? static_cast<float*>(p.key_sum_end) + work.pair * Da
                              : p.key_sum_parts + (work.pair * p.segments + work.segment) * Da;
      const float* const start =
          whole && p.key_sum_start != nullptr ? static_cast<const float*>(p.key_sum_start) + work.pair * Da : nullptr;
#pragma unroll
      for (int a = 0; a < kStateAtoms; ++a)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int64_t column = row0 + keys.column(a, e);
          if (column < Da) write_key_sum(to, start, column, plain_keys[a][e]);
        }
    }
  }
  // kNormalize: the key sum's end (the owners' columns of z, each warp's own: the warp's lanes
  // q4 = 0 wrote them last where the chunk sums came from the tensor cores, hence its sync;
  // kSplitRows: the forward's each group its half, dq's the first group's)
  if constexpr (kNormalize && P == Pass::Forward) {
    __syncwarp();
    if ((kSplitRows || group == 0) && work.col_tile == 0) {
      if (end.key_sum != nullptr) keys.store(end.key_sum + row0, Da - row0);
      // (the segment's end kept beside its state's for the one-pass backward: segment_key_sum_ends)
      if (kept_end != nullptr && p.segment_key_sum_ends != nullptr) {
        keys.store(p.segment_key_sum_ends + (work.pair * p.segments + work.segment) * Da + row0, Da - row0);
      }
    }
  }
  if constexpr (kExtraRow) {  // (state-only blocks: their segment's sums of k, or dk's of e)
    if (end.extra != nullptr && (!kSplitRows || group == 0)) keys_of(state_only ? 0 : chunks).store(end.extra + m0, Dc - m0);
  }
#else
  __trap();  // built without sm_90a: the dispatcher never launches this (see wgmma_takes)
#endif
}

// dk and dv in one pass, in reverse time: one block a (sequence, head, time segment), from its
// last chunk to its first, from the sums of the segments after it (state-only blocks sum their
// segment's dO^T Q alone). The state D = sum over the timesteps after the chunk of dO^T q (M x E; the mma.sync
// fused pass's, without the scale) serves both gradients:
//
//   dv = K D^T + mask(K Q^T) dO,  dk = V D + mask(V dO^T) Q  (each times scale),  D += dO^T Q
//
// (mask: the scores of timesteps t >= s kept), dv's products first, then dk's with D's update
// behind them. q, k, v and dO are staged once a chunk where the two passes staged six tiles; the
// state's copy serves D (dk's, MN-major) and D^T (dv's, K-major) alike. Da = M, Dc = E (the dk
// pass's, as run_grad_kv gives them). A producer warpgroup stages q, k, v and dO (the walks that
// only sum: q and dO, in a deeper ring) as wgmma_product_kernel's.
//
// kWithDq (the one-pass backward, KernelParams::one_pass): a third warpgroup makes
// dq on the same staged chunks, from the state taken down from its segment's end:
//
//   dq_c = dO_c S(c + 1) - U(dO_c v_c^T) k_c,   S(c) = S(c + 1) - v_c^T k_c
//
// (S(c): the sum of v^T k over the chunks before chunk c, M x E, the forward's state transposed;
// U: the scores of s > t kept, the diagonal not). With T = -S(c + 1), from minus the forward's
// state at the segment's end (KernelParams::forward_segment_kv, the forward's segment ends, the
// initial state in them): dq = -scale (dO T +
// U(dO v^T) k), and T += v^T k behind each chunk's products. q, k, v and dO are then read once
// for all three gradients: 7 tensors where this kernel and the dq pass move 10 (prototype, H100
// bf16 8,16,2048,64: 0.095 ms against the two kernels' 0.120; RESULTS.md, sixty-first session).
// T's copy is in two parts in float16 too (StateCopy's kTwoParts): its rounding stays off dq where
// the chunk's own terms are taken back from its early rows. In time segments (the forward's) the dq
// warpgroup needs no sums: its start is the forward's; in the walks that only sum (state-only
// blocks, one launch's first walk) it waits on and releases the ring's chunks beside the
// dk-with-dv consumer, with nothing to do.
// Under the normalizer (kNormalize; three launches in segments: no one launch), with a_t = -dO[t] .
// O[t] and z(c) the key sum before chunk c (the forward's, from the key sum's kept end):
//
//   dq_t = scale / den[t] (dO_t S(c + 1) + a_t z(c + 1) - sum_{s > t in c} (dO_t . v_s + a_t) k_s)
//
// so each kept score of U gets its row's a_t (as the dq pass's get theirs), y = -z(c + 1) is
// taken down as T (y += k's column sums a chunk, KeySums), a_t y is added to row t, and row t is
// stored times -scale / den[t]: dq = -scale / den (dO T + U(dO v^T + a) k + a y). The producer stages
// each chunk's dO . O (backward_prepare_kernel's, or in one segment its own: kProducerDots) and den
// beside it for both consumers, as the two passes' kernel does.
// kProducerDots (the normalized one pass): its producer makes dO . O (KernelParams::dots_in_grad_q),
// an instance of its own for the registers that takes (one_pass_makes_dots says where).
template <typename scalar_t, bool kOneLaunch = false, bool kNormalize = false, bool kWithDq = false,
          bool kProducerDots = false>  // (kOneLaunch: as wgmma_product_kernel's)
__global__ void __launch_bounds__((kWithDq ? 3 : 2) * wgmma::kThreads, 1)
    wgmma_grad_kv_kernel(const KernelParams p, int64_t Da, int64_t Dc, int64_t col_tiles) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace wgmma;
  constexpr bool kHalf = std::is_same_v<scalar_t, at::Half>;
  static_assert(kHalf || std::is_same_v<scalar_t, at::BFloat16>, "bfloat16 or float16");
  // (the normalized one pass's dq warpgroup has taken kSummed, one launch's barrier: three launches)
  static_assert(!(kOneLaunch && kNormalize && kWithDq), "the normalized one pass: three launches");
  static_assert(!kProducerDots || (kNormalize && kWithDq), "dO . O: the normalized one pass's");
  using Rows = typename Operands<Pass::GradKV, scalar_t, float>::Rows;

  // Shared memory: the stage slots, the state copies (D's; kWithDq: T's after it), each consumer
  // warpgroup's staging rows, their warps' largest |state| (wgmma::smem_bytes(4, kCopyTiles, groups))
  constexpr int kCopyTiles = kWithDq ? 4 : 2;
  extern __shared__ __align__(1024) unsigned char wgmma_smem[];
  const uint32_t base = smem_address(wgmma_smem);
  uint16_t* staging = reinterpret_cast<uint16_t*>(wgmma_smem + (kStages * 4 + kCopyTiles) * kTile);
  float* const warp_max =
      reinterpret_cast<float*>(wgmma_smem + (kStages * 4 + kCopyTiles) * kTile + (kWithDq ? 2 : 1) * kStagingBytes);
  StateCopy<kHalf> copy{base + kStages * 4 * kTile, warp_max};
  // kNormalize (kNormalizedGradKVBytes): dk's extra row e = the sum over the chunks after this one
  // of -dO[t] . O[t] q[t] / den[t], E columns, added to every dk row; its start and end are the key
  // sums' gradients (with_state_io's GradKV), and -dO[t] . O[t] is added to each kept score of
  // V dO^T, column t. Each chunk's dO . O and den staged beside it (terms, a slot of either ring).
  // (kWithDq: after the second warpgroup's largest |T| too, then dq's own extra row's key sum:
  // kNormalizedOnePassBytes)
  constexpr int kTermsAt = kWithDq ? 8 : 4;
  const KeySums<kHalf, 1> extra{warp_max + kTermsAt};
  const RowTerms<2> terms{warp_max + kTermsAt + (kWithDq ? 2 : 1) * 64};

  // one launch for the segments (KernelParams::lookback): the block's work by the order blocks start
  const int64_t block =
      kOneLaunch ? lookback::ticket_in_reverse(p.lookback, reinterpret_cast<unsigned*>(wgmma_smem), p.segments) : -1;
  const chunked::BlockWork<Pass::GradKV, scalar_t> work(p, col_tiles, C, Dc, 1, 0, block);
  const Operands<Pass::GradKV, scalar_t, float> ops = work.operands(p);  // q, k, v, dO; out: dk
  const Operands<Pass::GradV, scalar_t, float> ops_v(p, work.seq.b, work.seq.h, nullptr, nullptr, work.seq.begin);
  const int64_t chunks = work.chunk_count(C), M = Da, E = Dc;
  const bool state_only = work.state_only;  // the segment's own dO^T Q alone
  const Stager stage(int(threadIdx.x % kThreads));
  const int64_t last = work.seg_begin + (chunks > 0 ? chunks - 1 : 0) * C;  // the first chunk taken
  const Rows q_rows{ops.q, ops.q_l}, k_rows{ops.k, ops.k_l}, v_rows{ops.v, ops.v_l}, dout_rows{ops.dout, ops.dout_l};
  Source q_src = stage.source(q_rows, last, E), k_src = stage.source(k_rows, last, E),
         v_src = stage.source(v_rows, last, M), dout_src = stage.source(dout_rows, last, M);
  auto tile_of = [&](int slot, int which) { return base + uint32_t(slot * 4 + which) * kTile; };
  auto chunk_begin = [&](int64_t it) { return work.seg_begin + (chunks - 1 - it) * C; };
  // kProducerDots (launched where KernelParams::dots_in_grad_q: O's rows whole 16-byte vectors):
  // each chunk's dO . O made by the producer from its own landed pieces of dO and O's rows
  // (row_dots, as the dq pass makes them), into the slot's row terms alone (no later pass reads
  // them), where backward_prepare_kernel read dO and O once more and wrote them out
  const scalar_t* const o_rows =
      kProducerDots ? static_cast<const scalar_t*>(p.o.ptr) + p.o.offset(work.seq.b, work.seq.h, work.seq.begin)
                    : nullptr;
  const int64_t o_l = p.o.stride_l;
  // (kNormalize) chunk it's row terms, dO . O (unless made here) and den, into its slot; O's rows
  // to the L2 where the producer makes the dots
  auto stage_terms = [&](int slot, int64_t t0, int n) {
    if constexpr (kNormalize) {
      terms.stage(slot, {ops.dout_dot_out + t0, ops.den + t0}, n, kProducerDots ? 0 : -1);
      if constexpr (kProducerDots) prefetch_rows<1>(stage, o_rows, t0, o_l, dout_src.inside, n);
    }
  };
  auto stage_chunk = [&](int64_t it, int slot) {  // it = 0, 1, 2, ... in order: the sources step back a chunk each
    if (it < chunks) {
      const int n = work.chunk_len(chunk_begin(it), C);
      stage.operator()<true>(tile_of(slot, 0), q_src, ops.q, n);
      stage.operator()<true>(tile_of(slot, 1), k_src, ops.k, n);
      stage.operator()<true>(tile_of(slot, 2), v_src, ops.v, n);
      stage.operator()<true>(tile_of(slot, 3), dout_src, ops.dout, n);
      stage_terms(slot, chunk_begin(it), n);
    }
    StageRing<>::commit_copies();
  };

  // D: row m = 16 warp + g (+8), column e = 8 j + 2 q4 (+1) in d[4 j ..]; from the segment's start
  // (the sums of the segments after it).
  float d[32];
  // The walks that sum dO^T Q alone (state-only blocks; one launch's, first to last, where the
  // segment before starts from this one's sums): their deeper ring (sum_depth) of q's and dO's
  // tiles, over the stage slots and the state copy.
  constexpr int kSumDepth = sum_depth(kStages * 4 + 2, 2);
  auto sum_tile = [&](int slot, int which) { return base + uint32_t(slot * 2 + which) * kTile; };
  const bool sums_first = kOneLaunch && work.segment > 0;  // one launch's walk before the pass
  // named barriers: 1 the consumers', 2 on the produced rings' (the pass's or the sums'),
  // kSummed: one launch's walk done with its slots, which the pass's ring takes after it, and
  // (kNormalize) kLanded: every producer thread's copies of a chunk landed
  // (kWithDq: the dq warpgroup's own barrier takes kLanded's, which has no use without the
  // normalizer, and under it kSummed's, which has none without one launch; the rings' barriers
  // and kSummed count its threads too)
  constexpr int kConsumersBarrier = 1, kFull = 2, kSummed = kFull + 2 * kSumDepth, kLanded = kSummed + 1,
                kDqBarrier = kNormalize ? kSummed : kLanded, kBlockThreads = (kWithDq ? 3 : 2) * kThreads;
  static_assert(kLanded < 16, "named barriers");
  // the consumers' rings (kWithDq: two consumer warpgroups of different code on each)
  using PassRing = ProducedRing<kStages, kStages, kWithDq>;
  using SumRing = ProducedRing<kSumDepth, kSumDepth, kWithDq>;
  // kWithDq: the producer's registers to the consumers (launched at 168 a thread: 65536 / 384);
  // kProducerDots: row_dots' pieces of O and dO, 16 registers each, beside the copies (ptxas -v:
  // at 56 the producer spilled 44-52 bytes, at 72 8-40, at 80 8, at 88 none)
  constexpr int kProducerRegisters = kProducerDots ? 88 : 56, kConsumerRegisters = kProducerDots ? 208 : 224;
  static_assert(!kWithDq || 2 * kConsumerRegisters + kProducerRegisters <= 3 * (65536 / (3 * kThreads) / 8 * 8),
                "the block's registers at launch");
  if (warpgroup() == 1) {  // the producer (broadcast, as above)
    if constexpr (kWithDq) registers_down_to<kProducerRegisters>();
    // kNormalize: chunk it's staged q (at `tile`) divided by its rows' den once landed, den read
    // from the slot's terms once every producer thread's copies are in (each thread divides rows
    // whose den another copied). Read from global memory, den cost each chunk's announcement a
    // read's latency, which the sums' walks (a product a chunk) could not hide. (float16: the
    // quotients in KernelParams::den_unit's unit, read once here.)
    const float unit = den_unit_of<kHalf && kNormalize>(p, 0);
    auto divide_q = [&](uint32_t tile, int slot, int64_t t0) {
      if constexpr (kNormalize) {
        named_sync(kLanded, kThreads);
        divide_rows<kHalf>(stage, tile, terms.slot(slot) + 64, work.chunk_len(t0, C), unit);
      }
    };
    // (kProducerDots) bfloat16 reads O's pieces of the next chunk to be announced (load_row_pieces) a
    // chunk ahead: while that chunk lands, not between its landing and its announcement, where the
    // read's latency was the producer's and the chunk's. bfloat16's one pass 5% faster so; float16's
    // 5% slower, and it reads O where it makes the dots (RESULTS.md, sixty-seventh session).
    constexpr bool kOAhead = kProducerDots && !kHalf;
    uint4 o_ahead[4];
    auto load_o_ahead = [&](int64_t t0) {
      if constexpr (kOAhead) load_row_pieces(o_ahead, stage, o_rows + t0 * o_l, o_l, work.chunk_len(t0, C));
    };
    // (kProducerDots) chunk t0's dO . O (its dO staged at `tile`) into the slot's row terms, before
    // the chunk is announced; then (kOAhead) the next chunk's O (next_t0 < 0: none)
    auto dots_of = [&](uint32_t tile, int slot, int64_t t0, int64_t next_t0) {
      if constexpr (kProducerDots) {
        float dots[4] = {0.f, 0.f, 0.f, 0.f};
        if constexpr (kOAhead) {
          if (dout_src.inside & 1u) add_row_dots<kHalf>(dots, stage, tile, o_ahead);
          sum_row_dots(dots);
          if (next_t0 >= 0) load_o_ahead(next_t0);
        } else {
          row_dots<kHalf, 1>(dots, stage, tile, o_rows + t0 * o_l, o_l, dout_src.inside, work.chunk_len(t0, C));
        }
        if (stage.col != 0) return;
#pragma unroll
        for (int i = 0; i < 4; ++i) terms.put(slot, 0, stage.row0 + 16 * i, dots[i]);  // (0 past n)
      }
    };
    auto produce_sums = [&](Source& q_from, Source& dout_from, auto&& chunk_start, auto step_back) {
      SumRing(kFull, kBlockThreads)
          .produce(
              chunks,
              [&](int64_t it, int slot) {
                if (it < chunks) {
                  const int n = work.chunk_len(chunk_start(it), C);
                  stage.operator()<decltype(step_back)::value>(sum_tile(slot, 0), q_from, ops.q, n);
                  stage.operator()<decltype(step_back)::value>(sum_tile(slot, 1), dout_from, ops.dout, n);
                  stage_terms(slot, chunk_start(it), n);
                }
                StageRing<>::commit_copies();
              },
              [&](int64_t it, int slot) {
                divide_q(sum_tile(slot, 0), slot, chunk_start(it));
                dots_of(sum_tile(slot, 1), slot, chunk_start(it), it + 1 < chunks ? chunk_start(it + 1) : -1);
              });
    };
    if (sums_first) {  // first to last
      Source q_on = stage.source(q_rows, work.seg_begin, E), dout_on = stage.source(dout_rows, work.seg_begin, M);
      if (chunks > 0) load_o_ahead(work.seg_begin);
      produce_sums(q_on, dout_on, [&](int64_t it) { return work.seg_begin + it * C; }, std::false_type{});
      named_sync(kSummed, kBlockThreads);
    }
    if (chunks > 0) load_o_ahead(chunk_begin(0));
    if (state_only) {  // the chunks from the last back to the first, as the pass's
      produce_sums(q_src, dout_src, chunk_begin, std::true_type{});
    } else {
      PassRing(kFull, kBlockThreads).produce(chunks, stage_chunk, [&](int64_t it, int slot) {
        divide_q(tile_of(slot, 0), slot, chunk_begin(it));
        dots_of(tile_of(slot, 3), slot, chunk_begin(it), it + 1 < chunks ? chunk_begin(it + 1) : -1);
      });
    }
    return;
  }
  static_assert(kSumDepth <= 6 && kStages <= 6, "kNormalizedGradKVBytes: the row terms' slots");
  if constexpr (kWithDq) {
    registers_up_to<kConsumerRegisters>();
    if (warpgroup() == 2) {  // dq (see above): T = -S(c + 1), row m = 16 warp + g (+8), column e as D's
      if (state_only || sums_first) {  // a walk that only sums: its chunks waited on and released
        SumRing sums(kFull, kBlockThreads);
        for (int64_t it = 0; it < chunks; ++it, sums.advance()) {
          sums.wait();
          sums.release(it, chunks);
        }
        if (state_only) return;
        named_arrive<true>(kSummed, kBlockThreads);  // (the pass's ring takes the slots after the walk)
      }
      const Operands<Pass::GradQ, scalar_t, float> ops_q(p, work.seq.b, work.seq.h, nullptr, nullptr, work.seq.begin);
      uint16_t* const q_staging = staging + kStagingBytes / sizeof(uint16_t);
      // T's copy in two parts in float16 too: its one part cost dq up to 1.4x dk's error where the
      // chunk's own terms are taken back from its early rows (a one-chunk sequence; H100 prototype,
      // RESULTS.md, sixty-first session); the second part's product is one more a chunk
      StateCopy<kHalf, 1, 4, true> t_copy{base + (kStages * 4 + 2) * kTile, warp_max + 4};
      auto dq_sync = [] { named_sync(kDqBarrier, kThreads); };
      // kNormalize: dq's extra row's key sum y = -z(c + 1) (see above), taken down as T is
      const KeySums<kHalf, 1> minus_z{warp_max + kTermsAt + 64};
      // The sequence's first chunk, where no initial state was given, takes the forward's form: its
      // row t sums over s <= t from T = -S(c) = 0 and y = 0,
      //
      //   dq = -scale / den (dO T + a y - L(dO v^T + a) k)      (L: s <= t)
      //
      // where the walk's form takes the rows after t back from the chunk's end. Its early rows, of
      // a few terms each (and under the normalizer the largest 1 / den), then carry their own
      // terms' rounding instead of the whole chunk's (the walk's form there: normalized dq up to
      // 2x its bound of float64 at one chunk, H100, RESULTS.md, sixty-fourth session).
      // (the walk's last chunk, it = chunks - 1, where the segment is the sequence's first)
      const bool ends_at_zero =
          work.seg_begin == 0 && p.initial_kv == nullptr && (!kNormalize || p.initial_k_sum == nullptr);
      auto from_zero = [&](int64_t it) { return ends_at_zero && it == chunks - 1; };
      float t[32];
      {  // minus the forward's state [E, M] at the segment's end, transposed (the end of the last of
         // the forward's segments it spans: KernelParams::one_pass_span); kNormalize: minus its key
         // sum's end (the forward's segment_k_sum). Zeros where the segment is one chunk, the
         // sequence's first, from a zero start (above).
        const bool zeros = from_zero(0);
        const int64_t spanned = min((work.segment + 1) * p.one_pass_span, p.forward_segments);
        const int64_t kept = work.pair * p.forward_segments + spanned - 1;
        const float* const end = static_cast<const float*>(p.forward_segment_kv) + kept * E * M;
        const int warp = group_warp(), g = (threadIdx.x % kWarp) / 4, q4 = threadIdx.x % 4;
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int64_t row = 16 * warp + g + 8 * (e / 2), column = 8 * j + 2 * q4 + e % 2;
            t[4 * j + e] = row < M && column < E && !zeros ? -end[column * M + row] : 0.f;
          }
        if constexpr (kNormalize) {
          const float* const key_end = static_cast<const float*>(p.forward_segment_k_sum) + kept * E;
          minus_z.set([&](int column) { return column < E && !zeros ? -key_end[column] : 0.f; });
        }
      }
      t_copy.publish_first(t_copy.rows(t), dq_sync);
      const float factor = -float(p.scale);
      PassRing ring(kFull, kBlockThreads);
      for (int64_t it = 0; it < chunks; ++it, ring.advance()) {
        fence_shared_writes();  // T's copy, made at the end of the chunk before
        ring.wait();
        const uint32_t kt = tile_of(ring.slot, 1), vt = tile_of(ring.slot, 2), dt = tile_of(ring.slot, 3);
        const int64_t t0 = chunk_begin(it);
        const int n = work.chunk_len(t0, C);
        // U(dO v^T) k, or in the forward's form L(dO v^T) k, whose sign the store's factor takes
        // (T and y zeros there)
        const bool forward_form = from_zero(it);
        const float out_factor = forward_form ? -factor : factor;
        // kNormalize: the lane's rows' a = -dO[t] . O[t] and factors out_factor / den[t] (zero
        // past the chunk's rows), from the chunk's row terms before the slot's release
        float row_a[2], row_factors[2];
        if constexpr (kNormalize) {
          terms.dq_rows(row_a, ring.slot, n, true, out_factor);
          terms.dq_rows(row_factors, ring.slot, n, false, out_factor);
        }
        float score[32], acc[32];
        fence();
        scores_of<kHalf>(score, dt, vt);  // dO v^T: row t, column s
        commit();
        times_state_copy<kHalf, 1, 1, true>(acc, dt, t_copy.at);  // dO T
        commit();
        float key_chunk[1][2];  // (kNormalize) k's column sums over the chunk: y's update
        if constexpr (kNormalize) minus_z.chunk_sums(key_chunk, kt);  // while the products run
        auto add_masked = [&] {  // (kNormalize: each score of row t plus its a first)
          if constexpr (kNormalize) {
#pragma unroll
            for (int i = 0; i < 32; ++i) score[i] += row_a[(i % 4) / 2];
          }
          // (the forward's form, rare, its own call: a complement known at run time cost float16
          // a PLOP3 a score fragment on every chunk)
          if (forward_form) {
            add_masked_times<kHalf, true, true>(acc, score, kt, true);
          } else {
            add_masked_times<kHalf, true, true>(acc, score, kt, false);
          }
        };
        // as dk's below: bfloat16 the masked product behind dO T once the scores are in, T's
        // update behind both while dq is stored; float16 takes the copy's scale back first
        if constexpr (!kHalf) {
          wait<1>();
          add_masked();
        }
        add_bt_times_c<kHalf>(t, vt, kt);  // T += v^T k: -S(c), the chunk before's
        commit();
        wait<1>();
        if constexpr (kHalf) {
          t_copy.scale_back(acc);
          add_masked();
          wait<0>();
          ring.release(it, chunks);
          t_copy.post_max(t_copy.rows(t));
        }
        if constexpr (kNormalize) {
          minus_z.add_scaled_to_rows(acc, row_a);  // + a y
          store_rows<kHalf>(acc, row_factors, q_staging, ops_q.out + t0 * ops_q.out_l, ops_q.out_l, n, E);
        } else {
          store_rows<kHalf>(acc, out_factor, q_staging, ops_q.out + t0 * ops_q.out_l, ops_q.out_l, n, E);
        }
        if constexpr (!kHalf) {
          wait<0>();
          ring.release(it, chunks);
        }
        // the next chunk the sequence's first from a zero start: T = y = 0 (above), not taken down
        const bool next_from_zero = from_zero(it + 1);
        if (next_from_zero) {
#pragma unroll
          for (int i = 0; i < 32; ++i) t[i] = 0.f;
        }
        dq_sync();  // every warp's wgmma has read T's copy (kNormalize: and y)
        if constexpr (kNormalize) {
          if (next_from_zero) {
            minus_z.set([](int) { return 0.f; });
          } else {
            minus_z.add(key_chunk);  // y = -z(c)
          }
        }
        t_copy.publish(t_copy.rows(t));
      }
      return;
    }
  }
  auto consumers_sync = [] { named_sync(kConsumersBarrier, kThreads); };
  // D += dO^T Q over the chunks of a summing walk
  // (kNormalize, state-only blocks: e += the extra row's sums as well, read by no other warp here)
  auto consume_sums = [&] {
    SumRing ring(kFull, kBlockThreads);
    for (int64_t it = 0; it < chunks; ++it, ring.advance()) {
      ring.wait();
      fence();
      add_bt_times_c<kHalf>(d, sum_tile(ring.slot, 1), sum_tile(ring.slot, 0));
      commit();
      if constexpr (kNormalize) {
        float sums[1][2];
        extra.chunk_sums(sums, sum_tile(ring.slot, 0), terms.extra_weights(ring.slot));
        extra.add(sums);
      }
      wait<0>();
      ring.release(it, chunks);
    }
  };

  if constexpr (kOneLaunch) {
    const int64_t slot0 = work.pair * p.segments;
    unsigned* const flags = p.lookback + 1 + (block - work.segment);  // this pair's segments' flags
    if (sums_first) {
      // The segment before it in time starts from this one's own sums, dO^T Q: its chunks walked
      // first to last, so that the pass below (last to first) starts on the chunks read last.
#pragma unroll
      for (int i = 0; i < 32; ++i) d[i] = 0.f;
      if constexpr (kNormalize) extra.set([](int) { return 0.f; });  // (e: the segment's own extra row too)
      consume_sums();
      named_arrive<kWithDq>(kSummed, kBlockThreads);  // (the pass's chunks staged while the flags are awaited)
      store_end(d, p.seg_sums + (slot0 + work.segment) * M * E, M, E);
      if constexpr (kNormalize) extra.store(p.seg_own_vector_sums + (slot0 + work.segment) * E, E);
      lookback::publish(flags + work.segment, consumers_sync);
    }
    // from the sums of the segments after it, the last first (the reverse scan's order)
    lookback::wait_for(flags + work.segment + 1, p.segments - 1 - work.segment, consumers_sync, kThreads);
    add_segments_before(d, p.seg_sums + (slot0 + p.segments - 1) * M * E, p.segments - 1 - work.segment, -1, M, E);
    add_given_start(d, p, work.pair, M, E);
    if constexpr (kNormalize) {  // e likewise: the extra row's sums of the segments after it, then the given start's
      extra.set([&](int column) {
        if (column >= E) return 0.f;
        float value = add_vector_sums_before(p.seg_own_vector_sums + (slot0 + p.segments - 1) * E + column,
                                             p.segments - 1 - work.segment, -E);
        if (p.start_vector != nullptr) value += static_cast<const float*>(p.start_vector)[work.pair * E + column];
        return value;
      });
    }
  } else {
    load_start(d, p, work.pair, work.segment, M, E, state_only);
    if constexpr (kNormalize) {  // e from the segment's start (zeros in state-only blocks)
      const SegmentStart<float> start(p, work.pair, work.segment, M, E);
      extra.set([&](int column) { return !state_only && column < E ? start.extra(column) : 0.f; });
    }
  }
  // D to where the segment ends (SegmentEnd; state-only blocks: their own sums; the initial state's
  // gradient E x M, transposed), at both of its stores; e beside it (the owners' own writes)
  auto store_segment_end = [&] {
    const SegmentEnd<float> end(p, work.pair, work.segment, M, E, true, false, work.piece);
    store_end(d, end.state, M, E, 0, 0, end.transposed);
    if constexpr (kNormalize) {
      if (end.extra != nullptr) extra.store(end.extra, E);
    }
  };
  if (state_only) {  // the segment's own dO^T Q alone
    consume_sums();
    store_segment_end();
    return;
  }
  copy.publish_first(copy.rows(d), consumers_sync);

  // dk's and dv's factor: the scale, and under normalize in float16 1 / KernelParams::den_unit
  // (the unit of the divided q and of everything summed from it)
  const float factor = float(p.scale) * den_unit_of<kHalf && kNormalize>(p, 1);
  PassRing ring(kFull, kBlockThreads);
  for (int64_t it = 0; it < chunks; ++it, ring.advance()) {
    fence_shared_writes();  // the state's copy, made at the end of the chunk before
    ring.wait();
    const uint32_t qt = tile_of(ring.slot, 0), kt = tile_of(ring.slot, 1), vt = tile_of(ring.slot, 2),
                   dt = tile_of(ring.slot, 3);
    const int64_t t0 = chunk_begin(it);
    const int n = work.chunk_len(t0, C);

    float score[32], acc[32];
    // dv = K D^T + mask(K Q^T) dO
    fence();
    scores_of<kHalf>(score, kt, qt);
    commit();
    times_state_copy<kHalf, 0>(acc, kt, copy.at);
    commit();
    // bfloat16: P dO accumulates behind K D^T once the scores are in; float16 takes the copy's
    // scale back from K D^T first
    wait<kHalf ? 0 : 1>();
    copy.scale_back(acc);
    add_masked_times<kHalf, true>(acc, score, dt);
    wait<0>();
    store_rows<kHalf>(acc, factor, staging, ops_v.out + t0 * ops_v.out_l, ops_v.out_l, n, M);

    // dk = V D + mask(V dO^T) Q, with D += dO^T Q behind it (kNormalize: Q divided by den, as
    // above, each score of V dO^T plus -dO[t] . O[t] of its column t, and e added to every row)
    fence();
    scores_of<kHalf>(score, vt, dt);
    commit();
    times_state_copy<kHalf, 1>(acc, vt, copy.at);
    commit();
    float e_chunk[1][2];  // (kNormalize) this chunk's part of e, added once every warp has read e
    const auto weight = terms.extra_weights(ring.slot);
    if constexpr (kNormalize) extra.chunk_sums(e_chunk, qt, weight);  // while the products run
    auto add_extra_row = [&] {  // (kNormalize) the scores' columns t
      if constexpr (kNormalize) add_to_columns(score, weight);
    };
    // bfloat16: P Q behind V D once the scores are in, D's update behind P Q while dk is
    // stored (float16 takes the copy's scale back from V D first). Measured on the H200 (bf16,
    // RESULTS.md, twenty-eighth session): this kernel 0.1521 -> 0.1426 ms at 4,16,8192,64,
    // 0.0636 -> 0.0591 at 8,16,2048,64, 0.0372 -> 0.0355 at 2,4,8192,64.
    if constexpr (!kHalf) {
      wait<1>();  // the scores; V D may still run
      add_extra_row();
      add_masked_times<kHalf, true>(acc, score, qt);
    }
    add_bt_times_c<kHalf>(d, dt, qt);  // D += dO^T Q
    commit();
    wait<1>();  // the scores and V D (P Q too, behind V D); D's update may still run
    if constexpr (kHalf) {
      copy.scale_back(acc);
      add_extra_row();
      add_masked_times<kHalf, true>(acc, score, qt);
      wait<0>();
      ring.release(it, chunks);
      copy.post_max(copy.rows(d));
    }
    if constexpr (kNormalize) extra.add_to_rows(acc);
    store_rows<kHalf>(acc, factor, staging, ops.out + t0 * ops.out_l, ops.out_l, n, E);
    if constexpr (!kHalf) {
      wait<0>();  // D's update, before its copy
      ring.release(it, chunks);
    }
    consumers_sync();  // every warp's wgmma has read the state copy (and e)
    if constexpr (kNormalize) extra.add(e_chunk);
    copy.publish(copy.rows(d));
  }
  store_segment_end();
#else
  __trap();  // built without sm_90a: the dispatcher never launches this (see wgmma_takes)
#endif
}

// dk and dv as wgmma_grad_kv_kernel, for E or M in (64, 128]: D (M x E, both zero-padded to 128)
// is split by its columns between two warpgroups (group g holds columns 64 g on, two row blocks of
// M, and keeps their copy, rows m, columns e, in the staged layout), and the gradients by role:
//
//   group 0: dv = K D^T + mask(K Q^T) dO      group 1: dk = V D + mask(V dO^T) Q
//
// each 128 columns wide (two accumulators), both reading the two halves' copies: dk's V D takes
// half h's copy MN-major (K = M along its rows), dv's K D^T K-major (K = E along the two halves'
// columns). So the scale of float16's copy is the block's (StateCopy over its eight warps). Each
// group adds dO^T Q for its own half. Four inputs of two atoms a chunk are 64 KB: two stage slots
// (kDepth 2: the next chunk's copies run behind this chunk's products) and the copies take 208 KB.
// Group 0 stages q and k, group 1 v and dO (state-only blocks: q, and dO).
// kNormalize (wgmma_grad_kv_kernel's terms): group 0 divides its staged q rows by den once the
// chunk is in (a second barrier then shows them to both groups), group 1 stages each chunk's
// dO . O and den (RowTerms) and keeps dk's extra row e (E columns) in shared memory.
template <typename scalar_t, bool kNormalize = false>
__global__ void __launch_bounds__(2 * wgmma::kThreads, 1)
    wgmma_grad_kv_wide_kernel(const KernelParams p, int64_t Da, int64_t Dc, int64_t col_tiles) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace wgmma;
  constexpr bool kHalf = std::is_same_v<scalar_t, at::Half>;
  static_assert(kHalf || std::is_same_v<scalar_t, at::BFloat16>, "bfloat16 or float16");
  using Rows = typename Operands<Pass::GradKV, scalar_t, float>::Rows;
  constexpr int kDepth = 2, kSlot = 8;  // a slot: q, k, v, dO, two atoms each
  constexpr int kCopyAt = kDepth * kSlot, kStagingAt = kCopyAt + 8;  // two halves' copies, two parts of 2 tiles
  static_assert(smem_bytes(kSlot, 8, 2, kDepth) + (kNormalize ? kNormalizedWideBytes : 0) <= 227 * 1024,
                "shared memory of one block");

  extern __shared__ __align__(1024) unsigned char wgmma_smem[];
  const uint32_t base = smem_address(wgmma_smem);
  // The warpgroup: bfloat16's broadcast (warpgroup()), so that its chunk loop's descriptors stay in
  // uniform registers (2716 static instructions -> 2489, 288 R2UR -> 0, sm_90a; dk with dv 6% faster
  // at E = M = 128 on the H200, RESULTS.md, thirty-second session); float16's threadIdx.x / 128,
  // where the broadcast spilled into its loop and measured 1-4% slower.
  const int group = kHalf ? int(threadIdx.x / kThreads) : warpgroup();
  uint16_t* staging = reinterpret_cast<uint16_t*>(wgmma_smem + kStagingAt * kTile + group * kStagingBytes);
  float* warp_max = reinterpret_cast<float*>(wgmma_smem + kStagingAt * kTile + 2 * kStagingBytes);
  constexpr uint32_t kHalfCopy = 4 * kTile;  // from one half's copy to the other's
  StateCopy<kHalf, 2, 8> copy{base + kCopyAt * kTile + group * kHalfCopy, warp_max};
  // (kNormalize, kNormalizedWideBytes) e: group 1's, its warps owning 16 of each 64 columns; the
  // row terms of either ring's slots
  const KeySums<kHalf, 2> extra{warp_max + 8};
  const RowTerms<2> terms{warp_max + 8 + 128};

  const chunked::BlockWork<Pass::GradKV, scalar_t> work(p, col_tiles, 2 * C, Dc);
  const Operands<Pass::GradKV, scalar_t, float> ops = work.operands(p);  // q, k, v, dO; out: dk
  const Operands<Pass::GradV, scalar_t, float> ops_v(p, work.seq.b, work.seq.h, nullptr, nullptr, work.seq.begin);
  const int64_t chunks = work.chunk_count(C), M = Da, E = Dc;
  const bool state_only = work.state_only;
  const Stager stage(int(threadIdx.x % kThreads));
  const int64_t last = work.seg_begin + (chunks > 0 ? chunks - 1 : 0) * C;  // the first chunk taken
  const Rows first_rows = group == 0 ? Rows{ops.q, ops.q_l} : Rows{ops.dout, ops.dout_l};
  const Rows second_rows = group == 0 ? Rows{ops.k, ops.k_l} : Rows{ops.v, ops.v_l};
  Source first = stage.source(first_rows, last, group == 0 ? E : M);
  Source second = stage.source(second_rows, last, group == 0 ? E : M);
  // tiles of a slot: q 0-1, k 2-3, v 4-5, dO 6-7 (group 0 stages q and k, group 1 dO and v)
  auto tile_of = [&](int slot, int which) { return base + uint32_t(slot * kSlot + which) * kTile; };
  auto chunk_begin = [&](int64_t it) { return work.seg_begin + (chunks - 1 - it) * C; };
  // (kNormalize) chunk it's dO . O and den into slot `slot` of the row terms, by group 1
  auto issue_terms = [&](int64_t it, int slot, int n) {
    if constexpr (kNormalize) {
      const int64_t t0 = chunk_begin(it);
      if (group == 1) terms.stage(slot, {ops.dout_dot_out + t0, ops.den + t0}, n);
    }
  };
  auto issue = [&](int64_t it, int slot) {  // it = 0, 1, 2, ... in order: the sources step back a chunk each
    if (it < chunks) {
      const int n = work.chunk_len(chunk_begin(it), C);
      stage.operator()<true, 2>(tile_of(slot, group == 0 ? 0 : 6), first, first_rows.ptr, n);
      stage.operator()<true, 2>(tile_of(slot, group == 0 ? 2 : 4), second, second_rows.ptr, n);
      issue_terms(it, slot, n);
    }
    StageRing<kDepth>::commit_copies();
  };
  // (kNormalize) once chunk it is in (in `slot`, q's two atoms at q_tile): group 0 divides the q
  // rows it staged by their den (divide_rows; float16's in KernelParams::den_unit's unit), and a
  // second barrier shows them to every wgmma
  const float unit = den_unit_of<kHalf && kNormalize>(p, 0);
  auto divide_q = [&](int64_t it, int slot, uint32_t q_tile) {
    if constexpr (kNormalize) {
      if (group == 0) {
        const int n = work.chunk_len(chunk_begin(it), C);
#pragma unroll
        for (int a = 0; a < 2; ++a) divide_rows<kHalf>(stage, q_tile + a * kTile, terms.slot(slot) + 64, n, unit);
      }
      __syncthreads();
    }
  };
  // This group's half of D: row m = 64 a + 16 warp + g (+8), column e = 64 group + 8 j + 2 q4 (+1) in
  // d[a][4 j ..]; from the segment's start (the sums of the segments after it).
  float d[2][32];
#pragma unroll
  for (int a = 0; a < 2; ++a) load_start(d[a], p, work.pair, work.segment, M, E, state_only, 64 * a, 64 * group);
  if constexpr (kNormalize) {  // e from the segment's start (zeros in state-only blocks), group 1's
    const SegmentStart<float> start(p, work.pair, work.segment, M, E);
    if (group == 1) extra.set([&](int column) { return !state_only && column < E ? start.extra(column) : 0.f; });
  }
  // D's columns 64 group on (two row blocks of M) += dO^T Q's
  auto update_state = [&](uint32_t dt, uint32_t qt) { add_bt_times_c<kHalf>(d, dt, qt + group * kTile); };
  const SegmentEnd<float> end(p, work.pair, work.segment, M, E, true, false, work.piece);
  // D's end, and (kNormalize) e's: group 1's owners' own columns
  auto store_segment_end = [&] {
#pragma unroll
    for (int a = 0; a < 2; ++a) store_end(d[a], end.state, M, E, 64 * a, 64 * group, end.transposed);
    if constexpr (kNormalize) {
      if (group == 1 && end.extra != nullptr) extra.store(end.extra, E);
    }
  };
  if (state_only) {  // the segment's own dO^T Q alone: a deeper ring (sum_depth) of q's and dO's atoms
    constexpr int kSumDepth = sum_depth(kStagingAt, 4);
    static_assert(kSumDepth <= 6, "kNormalizedWideBytes: the row terms' slots");
    auto sum_tile = [&](int slot, int which) { return base + uint32_t(slot * 4 + which) * kTile; };
    auto issue_sums = [&](int64_t it, int slot) {
      if (it < chunks) {
        const int n = work.chunk_len(chunk_begin(it), C);
        stage.operator()<true, 2>(sum_tile(slot, group == 0 ? 0 : 2), first, first_rows.ptr, n);
        issue_terms(it, slot, n);
      }
      StageRing<>::commit_copies();
    };
    // (kNormalize: q divided first; e += the chunk's sums, read by no other warp here)
    sum_chunks<kSumDepth>(
        chunks, issue_sums, [&](int slot) { update_state(sum_tile(slot, 2), sum_tile(slot, 0)); },
        [&](int64_t it, int slot) { divide_q(it, slot, sum_tile(slot, 0)); },
        [&](int slot) {
          if constexpr (kNormalize) {
            if (group == 1) {
              float sums[2][2];
              extra.chunk_sums(sums, sum_tile(slot, 0), terms.extra_weights(slot));
              extra.add(sums);
            }
          }
        });
    store_segment_end();
    return;
  }
  copy.publish_first(d);

  // dk's and dv's factor: the scale, and under normalize in float16 1 / KernelParams::den_unit
  // (the unit of the divided q and of everything summed from it)
  const float factor = float(p.scale) * den_unit_of<kHalf && kNormalize>(p, 1);
  for (int i = 0; i < kDepth - 1; ++i) issue(i, i);
  StageRing<kDepth> ring;
  for (int64_t it = 0; it < chunks; ++it, ring.advance()) {
    ring.arrive();
    const int next_slot = ring.refill();
    const uint32_t qt = tile_of(ring.slot, 0), kt = tile_of(ring.slot, 2), vt = tile_of(ring.slot, 4),
                   dt = tile_of(ring.slot, 6);
    const int64_t t0 = chunk_begin(it);
    const int n = work.chunk_len(t0, C);
    divide_q(it, ring.slot, qt);
    float e_chunk[2][2];  // (kNormalize, group 1) this chunk's part of e, added once every warp has read e

    // group 0: scores K Q^T, acc[h] = K D^T (dv's columns 64 h on), then += mask(scores) dO;
    // group 1: scores V dO^T, acc[h] = V D (dk's columns 64 h on), then += mask(scores) Q. Each
    // group's products, waits included, in a branch of their own (with the products of both in
    // one body ptxas fenced the accumulators between them).
    auto gradient = [&](auto role) {
      constexpr bool kDv = decltype(role)::value == 0;
      const uint32_t copies = base + kCopyAt * kTile;
      float score[32], acc[2][32];
      fence();
      scores_of<kHalf, 2>(score, kDv ? kt : vt, kDv ? qt : dt);
      commit();
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if constexpr (kDv) {
          times_state_copy<kHalf, 0, 2>(acc[h], kt, copies + h * kTile, kHalfCopy);  // rows 64 h on of both halves
        } else {
          times_state_copy<kHalf, 1, 2>(acc[h], vt, copies + h * kHalfCopy);
        }
      }
      commit();
      update_state(dt, qt);
      commit();
      const auto weight = terms.extra_weights(ring.slot);
      if constexpr (kNormalize && !kDv) extra.chunk_sums(e_chunk, qt, weight);  // while the products run
      issue(it + kDepth - 1, next_slot);
      wait<1>();  // the scores and the state's products; D's update may still run
      // dk's extra row: each score of V dO^T plus -dO[t] . O[t] of its column t
      if constexpr (kNormalize && !kDv) add_to_columns(score, weight);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        copy.scale_back(acc[h]);
        add_masked_times<kHalf, true>(acc[h], score, (kDv ? dt : qt) + h * kTile);
      }
      wait<0>();
      if constexpr (kNormalize && !kDv) {  // + e, every row
#pragma unroll
        for (int h = 0; h < 2; ++h) KeySums<kHalf, 1>{extra.z + 64 * h}.add_to_rows(acc[h]);
      }
      if constexpr (kHalf) copy.post_max(d);
      scalar_t* out = kDv ? ops_v.out : ops.out;  // dv's or dk's
      const int64_t out_l = kDv ? ops_v.out_l : ops.out_l, width = kDv ? M : E;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (64 * h < width) {
          store_rows<kHalf>(acc[h], factor, staging, out + t0 * out_l + 64 * h, out_l, n, width - 64 * h);
        }
      }
    };
    if (group == 0) {
      gradient(std::integral_constant<int, 0>{});
    } else {
      gradient(std::integral_constant<int, 1>{});
    }
    __syncthreads();  // every warp's wgmma has read both copies (and group 1's, e)
    if constexpr (kNormalize) {
      if (group == 1) extra.add(e_chunk);
    }
    copy.publish(d);
  }
  store_segment_end();
#else
  __trap();  // built without sm_90a: the dispatcher never launches this (see wgmma_takes)
#endif
}

}  // namespace cuda
}  // namespace fast_causal_attn

