// The chunked product on Hopper's warpgroup MMA (wgmma, sm_90a): bfloat16 and float16, the
// state's rows and columns up to 64, without normalize. Per chunk of C = 64 timesteps (tensorcore_product.cuh's
// products, one warpgroup a block):
//
//   scores = A B^T,  out = A S + mask(scores) Cc,  S += B^T Cc
//
// in 16 wgmma instructions where the mma.sync kernel issues about 480 HMMA and their ldmatrix
// loads (benchmarks/wgmma_forward.cu measured the design: 57 us for the bf16 8,16,2048,64 forward
// in one segment, the mma.sync kernel's one segment 82 us; RESULTS.md, fifteenth session). A, B
// and Cc are staged by cp.async, three chunks deep, into one layout that serves every role:
// element (r, c) of a 64 x 64 tile at (r / 8) 1024 + (c / 8) 128 + (r % 8) 16 + (c % 8) 2 bytes
// (8 x 16-byte core matrices, no swizzle), rows past the chunk and columns past Da / Dc zero.
// The state S (64 x 64 float32) lives in the warpgroup's accumulators; its copy for A S is kept
// as the mma.sync kernel keeps it: two bfloat16 parts (S = hi + lo), or one float16 part scaled
// by a power of two where S passes float16's range.
//
// What runs around the chunk loop is the tensor-core family's: chunked::BlockWork (pairs and
// packed sequences) and Operands (each pass's rows and strides). The kernel runs the forward and
// dq (the passes in the forward direction), one block a whole (sequence, head), where enough
// pairs fill the device (wgmma_takes); time segments, states in or out, normalize and the
// backward's dk and dv stay with the mma.sync kernels.
//
// Without normalize every row factor is the constant scale (q's in the forward, the output's in
// dq), so rows are staged as they are and the outputs are multiplied by scale in float32.
//
// The kernel is compiled for sm_90a only (its body needs __CUDA_ARCH_FEAT_SM90_ALL); the build
// defines FAST_CAUSAL_ATTN_SM90A when its arch list holds 9.0a, and the dispatcher takes the
// kernel on devices of compute capability 9.0 then.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "chunked_product.cuh"
#include "tensorcore_product.cuh"  // rows_are_vectors

namespace fast_causal_attn {
namespace cuda {
namespace wgmma {

constexpr int C = 64;              // timesteps a chunk; the state's rows and columns, zero-padded
constexpr int kThreads = 128;      // one warpgroup
constexpr int kTile = C * 64 * 2;  // bytes of a 64 x 64 bfloat16 tile
constexpr int kStages = 3;         // chunks staged (two on their way; a fourth measured no faster)
constexpr int kOutStride = 64 + 8;  // the outputs' staging rows, in elements (16 bytes of padding)
// kStages x {A, B, Cc} tiles, the state copy's two parts (bfloat16; float16 uses one), the
// outputs' staging rows, each warp's largest |S| (float16's copy scale)
constexpr size_t kSmemBytes = size_t(kStages * 3 + 2) * kTile + size_t(64) * kOutStride * 2 + 4 * sizeof(float);

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// A shared-memory operand, no swizzle: bits 0-13 address >> 4, 16-29 the leading byte offset
// (between core matrices along K) >> 4, 32-45 the stride byte offset (along M or N) >> 4
// (benchmarks/wgmma_probe.py settled this order on the H200).
__device__ __forceinline__ uint64_t descriptor(uint32_t address, uint32_t leading, uint32_t stride) {
  return uint64_t((address & 0x3FFFF) >> 4) | (uint64_t((leading & 0x3FFFF) >> 4) << 16) |
         (uint64_t((stride & 0x3FFFF) >> 4) << 32);
}
// Operand views of a staged tile (rows r, columns c), k16 step s: K along the columns (A and B of
// the scores, A of A S) or along the rows (B^T and Cc of the state's update, Cc of P Cc, the state
// copy as B of A S).
__device__ __forceinline__ uint64_t k_along_columns(uint32_t tile, int s) { return descriptor(tile + 256 * s, 128, 1024); }
__device__ __forceinline__ uint64_t k_along_rows(uint32_t tile, int s) { return descriptor(tile + 2048 * s, 1024, 128); }

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
// The same with A from registers: each warp its 16 rows in mma.sync's m16n8k16 A fragment.
template <bool kHalf, int kTransB>
__device__ __forceinline__ void mma_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
  if constexpr (kHalf) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " FCA_WGMMA_D32_LIST
        ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
        : FCA_WGMMA_D32(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1), "n"(kTransB));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " FCA_WGMMA_D32_LIST
        ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
        : FCA_WGMMA_D32(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1), "n"(kTransB));
  }
}
#undef FCA_WGMMA_D32
#undef FCA_WGMMA_D32_LIST

__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// This thread's shared-memory writes (generic proxy) made visible to wgmma (async proxy).
__device__ __forceinline__ void fence_shared_writes() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

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

// A 16-byte copy that does not wait (cp.async); zeros when !valid.
__device__ __forceinline__ void copy_16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace wgmma

// One block a (sequence, head): its timesteps from the first, the state from zero. The forward
// and dq only (wgmma_takes): neither has states in or out, and a whole sequence a block is what
// measured fastest here (two segments on two blocks a multiprocessor: bf16 8,16,2048,64 forward
// 0.090 ms of kernels against one segment's 0.064; RESULTS.md, sixteenth session).
template <Pass P, typename scalar_t>
__global__ void __launch_bounds__(wgmma::kThreads, 1)
    wgmma_product_kernel(const KernelParams p, int64_t Da, int64_t Dc, int64_t col_tiles) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace wgmma;
  constexpr bool kHalf = std::is_same_v<scalar_t, at::Half>;
  static_assert(kHalf || std::is_same_v<scalar_t, at::BFloat16>, "bfloat16 or float16");
  static_assert(P == Pass::Forward || P == Pass::GradQ, "the forward direction's passes");
  using Rows = typename Operands<P, scalar_t, float>::Rows;

  extern __shared__ __align__(1024) unsigned char wgmma_smem[];
  const uint32_t base = smem_address(wgmma_smem);
  const uint32_t state_copy = base + kStages * 3 * kTile;  // head, then remainder one tile after
  uint16_t* out_rows = reinterpret_cast<uint16_t*>(wgmma_smem + (kStages * 3 + 2) * kTile);
  float* warp_max_s = reinterpret_cast<float*>(wgmma_smem + (kStages * 3 + 2) * kTile + 64 * kOutStride * 2);

  const chunked::BlockWork<P, scalar_t> work(p, col_tiles, C, Dc);
  const Operands<P, scalar_t, float> ops = work.operands(p);
  const int64_t chunks = work.chunk_count(C);
  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp, g = lane / 4, q4 = lane % 4;

  // This thread's 16-byte pieces of a staged tile: pieces tid + 128 i (i < 4) are rows
  // row0 + 16 i of one column group, at bytes 16 tid + 2048 i, so that a warp writes 512
  // consecutive bytes; a row past the sequence or a column group past the operand's width is
  // zeros. Each operand's next source row is kept and stepped a chunk at a time, and a whole
  // chunk is copied without row tests (computed per piece and chunk, with 64-bit products and
  // the row pointers reloaded from the parameters, the copies' address arithmetic was the
  // kernel's most-executed and most-stalled work: H200 ncu, 8,16,2048). Rows that are not
  // 16-byte vectors (KernelParams::rows_are_vectors) are copied element by element, in the same
  // places.
  const int row0 = 8 * (tid / 64) + tid % 8, col = 8 * ((tid % 64) / 8);
  const bool vectors = p.rows_are_vectors;
  struct Source {
    const uint16_t* next;  // row row0 of the next chunk to stage, column col (0 past the width)
    int64_t piece_step;    // 16 rows
    bool inside;           // col < the operand's width
  };
  auto source = [&](const Rows& x, int64_t width) {
    const bool inside = col < width;
    return Source{reinterpret_cast<const uint16_t*>(x.ptr) + work.seg_begin * x.stride + row0 * x.stride +
                      (inside ? col : 0),
                  16 * x.stride, inside};
  };
  Source a_src = source(ops.a_rows(), Da), b_src = source(ops.b_rows(), Da), c_src = source(ops.c_rows(), Dc);
  auto stage = [&](uint32_t tile, Source& src, const Rows& x, int n) {
    const uint32_t at = tile + 16 * tid;
    if (vectors && n == C) {
#pragma unroll
      for (int i = 0; i < 4; ++i) copy_16(at + 2048 * i, src.next + i * src.piece_step, src.inside);
    } else if (vectors) {  // the sequence's last, partial chunk
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const bool valid = src.inside && row0 + 16 * i < n;
        copy_16(at + 2048 * i, valid ? src.next + i * src.piece_step : reinterpret_cast<const uint16_t*>(x.ptr), valid);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        uint32_t words[4] = {0, 0, 0, 0};
        if (src.inside && row0 + 16 * i < n) {
          const uint16_t* from = src.next + i * src.piece_step;
#pragma unroll
          for (int w = 0; w < 4; ++w) words[w] = uint32_t(from[2 * w]) | (uint32_t(from[2 * w + 1]) << 16);
        }
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(at + 2048 * i), "r"(words[0]),
                     "r"(words[1]), "r"(words[2]), "r"(words[3])
                     : "memory");
      }
    }
    src.next += 4 * src.piece_step;  // the next chunk's
  };
  auto tile_of = [&](int slot, int which) { return base + uint32_t(slot * 3 + which) * kTile; };
  // Chunk `it` into stage slot `slot`, as one group of copies (none past the last); called for
  // it = 0, 1, 2, ... in order (the sources step a chunk each call).
  auto issue = [&](int64_t it, int slot) {
    if (it < chunks) {
      const int n = work.chunk_len(work.seg_begin + it * C, C);
      stage(tile_of(slot, 0), a_src, ops.a_rows(), n);
      stage(tile_of(slot, 1), b_src, ops.b_rows(), n);
      stage(tile_of(slot, 2), c_src, ops.c_rows(), n);
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  };

  // The state: row e = 16 warp + g (+8), column m = 8 j + 2 q4 (+1) in state[4 j ..]; from zero.
  float state[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) state[i] = 0.f;
  // The state's copy for the next chunk's A S, in the staged layout. bfloat16: hi = bf16(S),
  // lo = bf16(S - hi) one tile after. float16 (one part, rounding 8x finer) holds S 2^-shift,
  // shift chosen each chunk from the block's largest |S| so that the copy stays below 2^14
  // (float16 ends at 65504; a state can pass that long before any output does), and A S is
  // multiplied back by copy_scale = 2^shift: the mma.sync kernel's scaled copy. The largest |S|
  // is posted by each warp (post_warp_max) before the barrier that precedes publish.
  float copy_scale = 1.f;
  auto post_warp_max = [&] {
    float largest = 0.f;
#pragma unroll
    for (int i = 0; i < 32; ++i) largest = fmaxf(largest, fabsf(state[i]));
#pragma unroll
    for (int offset = kWarp / 2; offset > 0; offset /= 2) largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, offset));
    if (lane == 0) warp_max_s[warp] = largest;
  };
  auto publish = [&] {
    float inverse = 1.f;
    if constexpr (kHalf) {
      const float largest = fmaxf(fmaxf(warp_max_s[0], warp_max_s[1]), fmaxf(warp_max_s[2], warp_max_s[3]));
      int shift = 0;
      if (largest > 16384.f && largest <= FLT_MAX) frexpf(largest / 16384.f, &shift);  // largest 2^-shift <= 2^14
      copy_scale = ldexpf(1.f, shift);
      inverse = 1.f / copy_scale;  // a power of two: exact
    }
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int e = 16 * warp + g + 8 * h, m = 8 * j + 2 * q4;
        const uint32_t at = state_copy + (e / 8) * 1024 + (m / 8) * 128 + (e % 8) * 16 + (m % 8) * 2;
        const float x = state[4 * j + 2 * h] * inverse, y = state[4 * j + 2 * h + 1] * inverse;
        const uint32_t hi = pack<kHalf>(x, y);
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at), "r"(hi) : "memory");
        if constexpr (!kHalf) {
          const float x_hi = __uint_as_float(hi << 16), y_hi = __uint_as_float(hi & 0xffff0000u);
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at + kTile), "r"(pack<kHalf>(x - x_hi, y - y_hi)) : "memory");
        }
      }
  };
  if constexpr (kHalf) {  // the zero state's copy, at scale 1
    if (lane == 0) warp_max_s[warp] = 0.f;
    __syncthreads();
  }
  publish();

  // Each output times the pass's constant factor (see the file's comment).
  const float factor = float(p.scale);
  for (int i = 0; i < kStages - 1; ++i) issue(i, i);
  int slot = 0;  // chunk it's stage slot
  for (int64_t it = 0; it < chunks; ++it, slot = slot + 1 == kStages ? 0 : slot + 1) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 2) : "memory");  // chunk it is staged
    fence_shared_writes();  // its tiles and the state copy, written by this thread, seen by wgmma
    __syncthreads();        // ... and by every thread's; the slot chunk it + kStages - 1 fills is free
    const int next_slot = slot == 0 ? kStages - 1 : slot - 1;  // chunk it - 1's
    const uint32_t at = tile_of(slot, 0), bt = tile_of(slot, 1), ct = tile_of(slot, 2);

    float score[32], out[32];  // set by their first products (accumulate = false)
    fence();
#pragma unroll
    for (int s = 0; s < 4; ++s) mma_ss<kHalf, 0, 0>(score, k_along_columns(at, s), k_along_columns(bt, s), s > 0);  // A B^T
    commit();
    if constexpr (!kHalf) {
#pragma unroll
      for (int s = 0; s < 4; ++s) {  // A S: the remainder first (the small terms first), then the head
        mma_ss<kHalf, 0, 1>(out, k_along_columns(at, s), k_along_rows(state_copy + kTile, s), s > 0);
      }
    }
#pragma unroll
    for (int s = 0; s < 4; ++s) mma_ss<kHalf, 0, 1>(out, k_along_columns(at, s), k_along_rows(state_copy, s), !kHalf || s > 0);
    commit();
#pragma unroll
    for (int s = 0; s < 4; ++s) mma_ss<kHalf, 1, 1>(state, k_along_rows(bt, s), k_along_rows(ct, s));  // S += B^T Cc
    commit();
    issue(it + kStages - 1, next_slot);  // the copies' instructions issue while the tensor cores work
    wait<1>();  // the scores and A S (P Cc accumulates into out next); the state's update may still run
    if constexpr (kHalf) {  // A S alone back from the copy's scale (see publish)
      if (copy_scale != 1.f) {
#pragma unroll
        for (int i = 0; i < 32; ++i) out[i] *= copy_scale;
      }
    }

    // The masked scores (row t, column s: s <= t kept) as the 16-bit A fragments of P Cc, each
    // warp its 16 rows.
    uint32_t scores[4][4];
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int column = 8 * j + 2 * q4 + e % 2, row = 16 * warp + g + 8 * (e / 2);
        if (column > row) score[4 * j + e] = 0.f;
      }
#pragma unroll
    for (int s = 0; s < 4; ++s)
#pragma unroll
      for (int r = 0; r < 4; ++r) scores[s][r] = pack<kHalf>(score[8 * s + 2 * r], score[8 * s + 2 * r + 1]);
    fence();
#pragma unroll
    for (int s = 0; s < 4; ++s) mma_rs<kHalf, 1>(out, scores[s], k_along_rows(ct, s));  // out += P Cc
    commit();
    wait<0>();
    if constexpr (kHalf) post_warp_max();  // the state after this chunk; read after the barrier below

    // The outputs, rounded into this warp's 16 staging rows, then written out 16 bytes a lane:
    // rows t0 + r (r < n), columns < Dc.
    const int64_t t0 = work.seg_begin + it * C;
    const int n = work.chunk_len(t0, C);
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = 16 * warp + g + 8 * h, column = 8 * j + 2 * q4;
        *reinterpret_cast<uint32_t*>(out_rows + row * kOutStride + column) =
            pack<kHalf>(out[4 * j + 2 * h] * factor, out[4 * j + 2 * h + 1] * factor);
      }
    __syncwarp();
    scalar_t* out_base = ops.out + t0 * ops.out_l;
#pragma unroll
    for (int i = lane; i < 16 * 8; i += kWarp) {
      const int row = 16 * warp + i / 8, column = 8 * (i % 8);
      if (row < n && column < Dc) {
        if (vectors) {
          *reinterpret_cast<uint4*>(out_base + row * ops.out_l + column) =
              *reinterpret_cast<const uint4*>(out_rows + row * kOutStride + column);
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            reinterpret_cast<uint16_t*>(out_base)[row * ops.out_l + column + e] = out_rows[row * kOutStride + column + e];
          }
        }
      }
    }
    __syncthreads();  // every warp's wgmma has read the state copy (and its staging rows are free)
    publish();        // S after this chunk, for the next
  }
#else
  __trap();  // built without sm_90a: the dispatcher never launches this (see wgmma_takes)
#endif
}

template <typename scalar_t>
constexpr bool kWgmmaInput = std::is_same_v<scalar_t, at::BFloat16> || std::is_same_v<scalar_t, at::Half>;

// Whether the device is of compute capability 9.0 (where an sm_90a binary runs), asked once per device.
bool device_runs_sm90a();

// Whether `pairs` (sequence, head) pairs are what the wgmma kernel runs faster than the mma.sync
// kernels by default: one wave of one block a multiprocessor, from 70% of the multiprocessors to
// all of them. H200 (132 multiprocessors), bfloat16 E = M = 64, CUDA graph replay, fwd / fwd+bwd
// ms, wgmma against mma.sync (RESULTS.md, sixteenth session):
//   L = 2048:  96 pairs 0.059 / 0.222 against 0.072 / 0.227;  112: 0.062 / 0.229 against 0.083 / 0.251
//              128: 0.067 / 0.241 against 0.085 / 0.257 (E = M = 32: 0.048 / 0.196 against 0.072 / 0.229)
//              192: 0.114 / 0.382 against 0.107 / 0.346;  256: 0.126 / 0.412 against 0.113 / 0.395
//   L = 8192:  64 pairs (the kernel's first version, forward) 0.219 against 0.152, the mma.sync
//              kernels' time segments filling the device;  128: 0.235 / 0.835 against 0.250 / 0.823
// Below, the mma.sync kernels' time segments fill the device; above, two blocks share a
// multiprocessor, which the mma.sync kernels use better.
inline bool wgmma_pair_count(int64_t pairs) {
  const int64_t sms = multiprocessor_count();
  return 10 * pairs >= 7 * sms && pairs <= sms;
}

// Whether pass P runs on the wgmma kernel: built for sm_90a, a device of compute capability 9.0,
// the forward or dq, bfloat16 or float16, Da and Dc up to 64 in whole 16-byte vectors, no
// normalize, no states in or out, and a pair count it runs faster (wgmma_pair_count; packed
// sequences too, counted as pairs: the mma.sync kernels run one block a sequence as well). dk and
// dv keep their fused mma.sync pass (as two wgmma passes they measured slower: bf16 8,16,2048,64
// 0.066 ms each against 0.110 for both). A function of the shapes and the device alone (not of
// the rows' alignment), so that a plan (dry_run) and the run agree on the forward's segments.
// FAST_CAUSAL_ATTN_WGMMA=0 turns the kernel off and =1 takes it wherever it can run, for
// measuring; a forced segment count (FAST_CAUSAL_ATTN_SEGMENTS > 1) asks for the segmented
// kernels and turns it off too.
template <Pass P, typename scalar_t>
bool wgmma_takes(const KernelParams& p, int64_t Da, int64_t Dc) {
#if defined(FAST_CAUSAL_ATTN_SM90A)
  if constexpr (!kWgmmaInput<scalar_t> || (P != Pass::Forward && P != Pass::GradQ)) {
    return false;
  } else {
    const char* switch_ = std::getenv("FAST_CAUSAL_ATTN_WGMMA");
    if (switch_ != nullptr && std::strcmp(switch_, "0") == 0) return false;
    const char* segments = std::getenv("FAST_CAUSAL_ATTN_SEGMENTS");
    if (segments != nullptr && std::atoll(segments) > 1) return false;
    if (Da > 64 || Dc > 64 || Da % 8 != 0 || Dc % 8 != 0 || p.normalize) return false;
    // States in or out keep the mma.sync kernels: with them come the key sums, and a plan (which
    // marks a state by its kv alone) must decide as the run does.
    if (p.has_state_io()) return false;
    const bool forced = switch_ != nullptr && std::strcmp(switch_, "1") == 0;
    if (!forced && !wgmma_pair_count(p.num_seqs * p.H)) return false;
    return device_runs_sm90a();
  }
#else
  (void)p, (void)Da, (void)Dc;
  return false;
#endif
}

// Runs pass P on the wgmma kernel (wgmma_takes must hold): one block a (sequence, head), whole.
template <Pass P, typename scalar_t>
void launch_wgmma(const KernelParams& params, int64_t Da, int64_t Dc, cudaStream_t stream) {
  KernelParams p = params;
  p.rows_are_vectors = rows_are_vectors(p, 2);
  p.state_head = 0;
  const SegmentWorkspace workspace = SegmentWorkspace::make<P, float>(p, 1, wgmma::C, Da, Dc);  // one segment
  launch_segmented<P>(wgmma_product_kernel<P, scalar_t>, p, workspace, p.num_seqs * p.H, wgmma::kThreads,
                      wgmma::kSmemBytes, stream, Da, Dc, 1);
}

}  // namespace cuda
}  // namespace fast_causal_attn
