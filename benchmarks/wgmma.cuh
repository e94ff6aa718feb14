// What the wgmma (sm_90a) experiments share (benchmarks/wgmma_probe.cu, wgmma_forward.cu,
// wgmma_rate.cu): the shared-memory operand descriptor (plain and in the 128-byte swizzle), the
// m64n64k16 and m64n32k16 bf16 products with float32 accumulators, the warpgroup's fence / commit /
// wait, and bf16 packing.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace wgmma {

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// A shared-memory operand, no swizzle: bits 0-13 address >> 4, 16-29 leading byte offset >> 4,
// 32-45 stride byte offset >> 4, 49-51 base offset 0, 62-63 swizzle mode 0.
__device__ __forceinline__ uint64_t descriptor(uint32_t address, uint32_t leading, uint32_t stride) {
  return uint64_t((address & 0x3FFFF) >> 4) | (uint64_t((leading & 0x3FFFF) >> 4) << 16) |
         (uint64_t((stride & 0x3FFFF) >> 4) << 32);
}

// The same descriptor in the kernels' 128-byte swizzle (bits 62-63 = 1; csrc's wgmma_product.cuh):
// stride byte offset 1024, the leading one unused while a tile is one swizzle atom (64 columns)
// wide. The hardware swizzles the absolute address, so each tile starts at a multiple of 1024.
__device__ __forceinline__ uint64_t swizzled_descriptor(uint32_t address) {
  return descriptor(address, 1024, 1024) | (uint64_t(1) << 62);
}

#define WGMMA_D32(d)                                                                                             \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),     \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),       \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),      \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define WGMMA_D32_LIST                                                                                      \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31}"

// d (64 x 64 float32: warp w rows 16w + g (+8), n-tile j columns 8j + 2q (+1) in d[4j ..], as
// mma.sync's accumulators) += A B^T, A and B from shared memory; kTransA / kTransB: the operand
// is MN-major there. accumulate = false: d = A B^T, d's values ignored (an accumulator's first
// product: zeroing d with ordinary instructions instead let nvcc place the zeros between two
// wgmma groups, where ptxas then waited for every product in flight, C7517).
template <int kTransA, int kTransB>
__device__ __forceinline__ void mma_ss(float (&d)[32], uint64_t a, uint64_t b, bool accumulate = true) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WGMMA_D32_LIST
      ", %32, %33, p, 1, 1, %35, %36;\n}\n"
      : WGMMA_D32(d)
      : "l"(a), "l"(b), "r"(accumulate ? 1 : 0), "n"(kTransA), "n"(kTransB));
}
// The same with A from registers: each warp its 16 rows in mma.sync's m16n8k16 A fragment.
template <int kTransB>
__device__ __forceinline__ void mma_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WGMMA_D32_LIST
      ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
      : WGMMA_D32(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1), "n"(kTransB));
}
// The same at N = 32 (d: 64 x 32, n-tiles j < 4 in d[4j ..]): half of a 64-column B
template <int kTransA, int kTransB>
__device__ __forceinline__ void mma_ss_n32(float (&d)[16], uint64_t a, uint64_t b, bool accumulate = true) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
      "%12, %13, %14, %15}, %16, %17, p, 1, 1, %19, %20;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(a), "l"(b), "r"(accumulate ? 1 : 0), "n"(kTransA), "n"(kTransB));
}
#undef WGMMA_D32
#undef WGMMA_D32_LIST

__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// This thread's shared-memory writes (generic proxy), made visible to the wgmma (async proxy).
__device__ __forceinline__ void fence_shared_writes() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ uint32_t pack(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t pack(__nv_bfloat16 lo, __nv_bfloat16 hi) {
  return uint32_t(__bfloat16_as_ushort(lo)) | (uint32_t(__bfloat16_as_ushort(hi)) << 16);
}

}  // namespace wgmma
