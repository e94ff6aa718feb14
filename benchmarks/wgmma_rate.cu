// How fast wgmma (sm_90a, bf16, float32 accumulation) runs by its N and where A comes from, with
// and without other shared-memory traffic beside it: the ceiling the chunk kernels' m64n64k16
// products meet. Each block (one a multiprocessor, 132) runs kGroups warpgroups; each issues
// `rounds` rounds of kAccs independent accumulators x four k16 steps (K = 64) on fixed tiles in
// the 128-byte swizzle (A: 64 x 64 a warpgroup, K-major; B: N x 64, K-major, shared by the
// block's warpgroups, as the kernels share B), one commit group a round with one round in
// flight (wait<1>), and times them with clock64. kStoreBytes: bytes the block writes to shared
// memory a round beside the products (16-byte stores into a scratch area), as the kernels' copies
// of the state and staging rows do (about 130 KB beside a chunk's 72 products at E = M = 128).
// benchmarks/wgmma_rate.py builds and runs it.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cstdint>

#include "wgmma.cuh"

namespace {

template <int N>
__device__ __forceinline__ void mma_ss(float (&d)[N / 2], uint64_t a, uint64_t b);
template <int N>
__device__ __forceinline__ void mma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b);

// The accumulators of an m64nNk16 as asm operands (N / 2 floats a thread), eight and 32 at a time,
// and their registers' names in the instruction (%0 on).
#define RATE_D8(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
    "+f"(d[i + 6]), "+f"(d[i + 7])
#define RATE_D32(d, i) RATE_D8(d, i), RATE_D8(d, i + 8), RATE_D8(d, i + 16), RATE_D8(d, i + 24)
#define RATE_REGS_0_16 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define RATE_REGS_0_32 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
    "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define RATE_REGS_32_64 \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, " \
    "%51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define RATE_REGS_64_128 \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, " \
    "%83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, " \
    "%102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, " \
    "%118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define RATE_REGS_64 RATE_REGS_0_32 ", " RATE_REGS_32_64
#define RATE_REGS_128 RATE_REGS_64 ", " RATE_REGS_64_128
#define RATE_SCALE_D "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"  // (scale-d: accumulate)
#define RATE_WGMMA(N) "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 {"

// d += A B^T, both K-major: A and B from shared memory (mma_ss) or A from registers (mma_rs: the
// four registers of mma.sync's A fragment)
template <>  // (N = 32: half a tile's columns, as a warpgroup owning 32 of them would multiply)
__device__ __forceinline__ void mma_ss<32>(float (&d)[16], uint64_t a, uint64_t b) {
  wgmma::mma_ss_n32<0, 0>(d, a, b);
}
template <>  // (N = 64: the kernels' own, wgmma.cuh's)
__device__ __forceinline__ void mma_ss<64>(float (&d)[32], uint64_t a, uint64_t b) {
  wgmma::mma_ss<0, 0>(d, a, b);
}
template <>
__device__ __forceinline__ void mma_ss<128>(float (&d)[64], uint64_t a, uint64_t b) {
  asm volatile(RATE_SCALE_D RATE_WGMMA(128) RATE_REGS_64 "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
               : RATE_D32(d, 0), RATE_D32(d, 32)
               : "l"(a), "l"(b));
}
template <>
__device__ __forceinline__ void mma_ss<256>(float (&d)[128], uint64_t a, uint64_t b) {
  asm volatile(RATE_SCALE_D RATE_WGMMA(256) RATE_REGS_128 "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
               : RATE_D32(d, 0), RATE_D32(d, 32), RATE_D32(d, 64), RATE_D32(d, 96)
               : "l"(a), "l"(b));
}
template <>
__device__ __forceinline__ void mma_rs<32>(float (&d)[16], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(RATE_SCALE_D RATE_WGMMA(32) RATE_REGS_0_16 "}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
               : RATE_D8(d, 0), RATE_D8(d, 8)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
template <>
__device__ __forceinline__ void mma_rs<64>(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
  wgmma::mma_rs<0>(d, a, b);
}
template <>
__device__ __forceinline__ void mma_rs<128>(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(RATE_SCALE_D RATE_WGMMA(128) RATE_REGS_64 "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
               : RATE_D32(d, 0), RATE_D32(d, 32)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

using wgmma::commit;
using wgmma::fence;
using wgmma::wait;
// The kernels' operand descriptor (wgmma_product.cuh): the 128-byte swizzle
using wgmma::swizzled_descriptor;

constexpr int kATile = 64 * 128;  // bytes: 64 rows of 64 bf16
constexpr int kScratch = 64 * 1024;

template <int N, bool kRegisterA, int kGroups, int kAccs, int kStoreBytes>
__global__ void __launch_bounds__(128 * kGroups, 1) rate_kernel(long long* cycles, float* sink, int rounds) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const int tid = threadIdx.x, group = tid / 128;
  const int tiles_bytes = kGroups * kATile + N * 128;
  for (int i = tid; i < tiles_bytes / 2; i += blockDim.x) {  // small bf16 values, none zero
    reinterpret_cast<uint16_t*>(smem)[i] = uint16_t(0x3c00 + (i % 61));
  }
  wgmma::fence_shared_writes();
  __syncthreads();
  const uint32_t base = wgmma::smem_address(smem);
  const uint32_t a_tile = base + group * kATile, b_tile = base + kGroups * kATile;
  const uint32_t store_at = base + ((tiles_bytes + 1023) / 1024) * 1024 + 16 * tid;  // the scratch area's
  uint32_t a_regs[4][4];
#pragma unroll
  for (int s = 0; s < 4; ++s)
#pragma unroll
    for (int r = 0; r < 4; ++r) a_regs[s][r] = 0x3c003c00u + uint32_t(tid + s + r);
  float d[kAccs][N / 2];
#pragma unroll
  for (int c = 0; c < kAccs; ++c)
#pragma unroll
    for (int i = 0; i < N / 2; ++i) d[c][i] = 0.f;
  constexpr int kStores = kStoreBytes / 16 / (128 * kGroups);  // 16-byte stores a thread a round
  static_assert(kStoreBytes <= kScratch, "the stores of a round fit the scratch area");
  __syncthreads();
  const long long start = clock64();
  for (int round = 0; round < rounds; ++round) {
    fence();
#pragma unroll
    for (int c = 0; c < kAccs; ++c)
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        if constexpr (kRegisterA) {
          mma_rs<N>(d[c], a_regs[s], swizzled_descriptor(b_tile + 32 * s));
        } else {
          mma_ss<N>(d[c], swizzled_descriptor(a_tile + 32 * s), swizzled_descriptor(b_tile + 32 * s));
        }
      }
    commit();
#pragma unroll
    for (int i = 0; i < kStores; ++i) {  // (a store at a constant offset from this thread's first)
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(store_at + i * 128 * kGroups * 16), "r"(round));
    }
    wait<1>();
  }
  wait<0>();
  const long long end = clock64();
  if (tid % 128 == 0) cycles[blockIdx.x * kGroups + group] = end - start;
  float total = 0.f;
#pragma unroll
  for (int c = 0; c < kAccs; ++c)
#pragma unroll
    for (int i = 0; i < N / 2; ++i) total += d[c][i];
  sink[blockIdx.x * blockDim.x + tid] = total;
}

// One variant's parameters and each warpgroup's cycles for `rounds` rounds.
struct Measured {
  int n, groups, accumulators, stored_bytes;
  bool register_a;
  std::vector<int64_t> cycles;
};

template <int N, bool kRegisterA, int kGroups, int kAccs, int kStoreBytes>
Measured launch(int64_t blocks, int64_t rounds) {
  auto kernel = rate_kernel<N, kRegisterA, kGroups, kAccs, kStoreBytes>;
  const int smem = ((kGroups * kATile + N * 128 + 1023) / 1024) * 1024 + (kStoreBytes > 0 ? kScratch : 0);
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  auto opts = torch::TensorOptions().device(torch::kCUDA);
  auto cycles = torch::zeros({blocks * kGroups}, opts.dtype(torch::kInt64));
  auto sink = torch::empty({blocks * 128 * kGroups}, opts.dtype(torch::kFloat));
  kernel<<<blocks, 128 * kGroups, smem, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<long long*>(cycles.data_ptr<int64_t>()), sink.data_ptr<float>(), int(rounds));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  auto host = cycles.cpu();
  return {N, kGroups, kAccs, kStoreBytes, kRegisterA,
          std::vector<int64_t>(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel())};
}

// The variants, by number: <N, A from registers, warpgroups, accumulators, bytes stored a round>
// (12-14, N = 32: an m64n32k16 with A in shared memory reads 2 KB of A and 1 KB of B in the 16
// cycles of its peak rate, 192 bytes a cycle where the shared-memory budget measured about 128:
// the E = 256 column-halves design's products, RESULTS.md, eighty-third session; four
// accumulators of N = 32 serialize the products: ptxas C7514)
constexpr int64_t kVariants = 15;
Measured run(int64_t variant, int64_t blocks, int64_t rounds) {
  switch (variant) {
    case 0: return launch<64, false, 1, 2, 0>(blocks, rounds);
    case 1: return launch<64, false, 2, 2, 0>(blocks, rounds);
    case 2: return launch<64, true, 2, 2, 0>(blocks, rounds);
    case 3: return launch<128, false, 1, 1, 0>(blocks, rounds);
    case 4: return launch<128, false, 2, 1, 0>(blocks, rounds);
    case 5: return launch<128, true, 2, 1, 0>(blocks, rounds);
    case 6: return launch<256, false, 1, 1, 0>(blocks, rounds);
    case 7: return launch<256, false, 2, 1, 0>(blocks, rounds);
    case 8: return launch<64, false, 2, 2, 16384>(blocks, rounds);
    case 9: return launch<64, false, 2, 2, 32768>(blocks, rounds);
    case 10: return launch<64, true, 2, 2, 32768>(blocks, rounds);
    case 11: return launch<128, false, 2, 1, 32768>(blocks, rounds);
    case 12: return launch<32, false, 1, 2, 0>(blocks, rounds);
    case 13: return launch<32, false, 2, 2, 0>(blocks, rounds);
    case 14: return launch<32, true, 2, 2, 0>(blocks, rounds);
    default: TORCH_CHECK(false, "wgmma_rate: no variant ", variant, " (", kVariants, " of them)");
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<Measured>(m, "Measured")
      .def_readonly("n", &Measured::n)
      .def_readonly("groups", &Measured::groups)
      .def_readonly("accumulators", &Measured::accumulators)
      .def_readonly("stored_bytes", &Measured::stored_bytes)
      .def_readonly("register_a", &Measured::register_a)
      .def_readonly("cycles", &Measured::cycles);
  m.attr("variants") = kVariants;
  m.def("run", &run, "a variant's parameters and each warpgroup's cycles for `rounds` rounds");
}
