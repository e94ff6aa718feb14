// How fast blocks shaped like the tensor-core kernels' state-only launch can stream their chunks
// from HBM, with no products: each block of 128 threads reads `chunks` consecutive chunks of
// 64 rows x 64 bf16 (8 KB) of two [pairs, L, 64] tensors (k and v), as the launch's segments do,
// through a ring of kStages chunk slots in shared memory, by one of two copy engines:
//   cp.async (kBulk = false): 16 bytes a thread a copy, eight copies a thread a chunk, what the
//     kernels do now;
//   bulk copies (kBulk = true, sm_90's cp.async.bulk: the TMA's one-dimensional copy): one thread
//     copies each operand's 8 KB with one instruction, completion counted on an mbarrier.
// Each thread reads one 16-byte vector of each chunk back (so that nothing is optimized away) and
// the block's xor is written out. benchmarks/stream_probe.py builds, checks and times it.
//
// The cp.async copies land in one of four shared-memory layouts of a chunk's 64 rows x 128 bytes
// (each eight lanes copy one whole row, as the kernels' staging does), to see whether where a
// global line lands decides how it reaches the L2 (the unswizzled wgmma staging's copies became
// one-sector requests; RESULTS.md, seventeenth session):
//   kContiguous: row r at 128 r, its 16-byte groups in order;
//   kPadded: row r at 144 r (the mma.sync kernels' rows padded by 16 bytes for ldmatrix);
//   kSwizzled: row r at 128 r, group c at (c ^ r % 8) 16 (wgmma's 128-byte swizzle);
//   kCoreMatrices: group c of row r at (r / 8) 1024 + c 128 + (r % 8) 16 (the unswizzled wgmma layout).
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <torch/extension.h>

#include <cstdint>

namespace {

constexpr int kThreads = 128;
constexpr int kChunkBytes = 64 * 64 * 2;          // one operand's chunk
constexpr int kVectors = kChunkBytes / 16;        // its 16-byte vectors
constexpr int kPerThread = kVectors / kThreads;   // a thread's copies of one operand a chunk

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_address(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbarrier_expect(uint64_t* bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_address(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait;\n"
      "}\n" ::"r"(smem_address(bar)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, int bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_address(dst)),
               "l"(src), "r"(bytes), "r"(smem_address(bar))
               : "memory");
}

enum Layout { kContiguous, kPadded, kSwizzled, kCoreMatrices };
template <int kLayout>
constexpr int kOperandBytes = kLayout == kPadded ? 64 * 144 : kChunkBytes;
// Where vector i of an operand's chunk (row i / 8, group i % 8) lands, in bytes from the operand's slot.
template <int kLayout>
__device__ __forceinline__ uint32_t place(int i) {
  const int r = i / 8, c = i % 8;
  if constexpr (kLayout == kPadded) return r * 144 + c * 16;
  if constexpr (kLayout == kSwizzled) return r * 128 + ((c ^ (r % 8)) * 16);
  if constexpr (kLayout == kCoreMatrices) return (r / 8) * 1024 + c * 128 + (r % 8) * 16;
  return 16 * i;
}

template <int kStages, bool kBulk, int kLayout = kContiguous>
__global__ void __launch_bounds__(kThreads) stream_kernel(const uint4* k, const uint4* v, int64_t L, int chunks,
                                                          int segments, uint4* out) {
  extern __shared__ __align__(128) unsigned char smem[];
  uint4* slots = reinterpret_cast<uint4*>(smem);  // [kStages][2][kVectors] (kBulk: kContiguous)
  unsigned char* bytes = smem;                    // [kStages][2][kOperandBytes] (cp.async)
  static_assert(!kBulk || kLayout == kContiguous, "bulk copies: contiguous");
  __shared__ uint64_t bars[kStages];
  const int tid = threadIdx.x;
  const int64_t pair = blockIdx.x / segments, segment = blockIdx.x % segments;
  const int64_t row0 = segment * int64_t(chunks) * 64;
  const int64_t rows = L - row0 < int64_t(chunks) * 64 ? L - row0 : int64_t(chunks) * 64;
  const int n = rows > 0 ? int(rows / 64) : 0;  // whole chunks only (L a multiple of 64 here)
  const uint4* k0 = k + (pair * L + row0) * 64 * 2 / 16;
  const uint4* v0 = v + (pair * L + row0) * 64 * 2 / 16;

  if constexpr (kBulk) {
    if (tid == 0) {
      for (int s = 0; s < kStages; ++s) mbarrier_init(&bars[s], 1);
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
  }
  auto issue = [&](int it) {
    if (it >= n) {
      if constexpr (!kBulk) asm volatile("cp.async.commit_group;\n" ::: "memory");
      return;
    }
    if constexpr (kBulk) {
      uint4* slot = slots + (it % kStages) * 2 * kVectors;
      if (tid == 0) {
        uint64_t* bar = &bars[it % kStages];
        mbarrier_expect(bar, 2 * kChunkBytes);
        bulk_copy(slot, k0 + int64_t(it) * kVectors, kChunkBytes, bar);
        bulk_copy(slot + kVectors, v0 + int64_t(it) * kVectors, kChunkBytes, bar);
      }
    } else {
      unsigned char* to = bytes + (it % kStages) * 2 * kOperandBytes<kLayout>;
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {
        const int i = tid + j * kThreads;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_address(to + place<kLayout>(i))),
                     "l"(k0 + int64_t(it) * kVectors + i)
                     : "memory");
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(
                         smem_address(to + kOperandBytes<kLayout> + place<kLayout>(i))),
                     "l"(v0 + int64_t(it) * kVectors + i)
                     : "memory");
      }
      asm volatile("cp.async.commit_group;\n" ::: "memory");
    }
  };
  for (int it = 0; it < kStages - 1; ++it) issue(it);
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (int it = 0; it < n; ++it) {
    if constexpr (kBulk) {
      mbarrier_wait(&bars[it % kStages], uint32_t((it / kStages) & 1));
    } else {
      asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 2) : "memory");
    }
    __syncthreads();  // chunk it is here for every thread; every thread is done with chunk it - 1
    issue(it + kStages - 1);  // into chunk it - 1's slot
    const unsigned char* at = bytes + (it % kStages) * 2 * kOperandBytes<kLayout>;
    const uint4 a = *reinterpret_cast<const uint4*>(at + place<kLayout>(tid));
    const uint4 b = *reinterpret_cast<const uint4*>(at + kOperandBytes<kLayout> + place<kLayout>(tid));
    acc.x ^= a.x ^ b.x, acc.y ^= a.y ^ b.y, acc.z ^= a.z ^ b.z, acc.w ^= a.w ^ b.w;
  }
  out[int64_t(blockIdx.x) * kThreads + tid] = acc;
}

template <int kStages, bool kBulk, int kLayout = kContiguous>
void launch(const torch::Tensor& k, const torch::Tensor& v, int chunks, int segments, torch::Tensor& out) {
  const int64_t pairs = k.size(0), L = k.size(1);
  const size_t smem = size_t(kStages) * 2 * kOperandBytes<kLayout>;
  auto kernel = stream_kernel<kStages, kBulk, kLayout>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  kernel<<<unsigned(pairs * segments), kThreads, smem, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const uint4*>(k.data_ptr()), reinterpret_cast<const uint4*>(v.data_ptr()), L, chunks, segments,
      reinterpret_cast<uint4*>(out.data_ptr()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// k, v: [pairs, L, 64] bf16 contiguous, L a multiple of 64; segments of `chunks` chunks from the
// start of each pair (as many as `segments`). Returns [pairs * segments, 128] 16-byte xors.
// layout: Layout, for cp.async (bulk copies land contiguous).
torch::Tensor stream(torch::Tensor k, torch::Tensor v, int64_t chunks, int64_t segments, int64_t stages, bool bulk,
                     int64_t layout) {
  TORCH_CHECK(k.is_cuda() && k.is_contiguous() && k.dim() == 3 && k.size(2) == 64 && k.element_size() == 2, "k");
  TORCH_CHECK(v.sizes() == k.sizes() && v.is_contiguous() && v.element_size() == 2, "v");
  TORCH_CHECK(k.size(1) % 64 == 0 && chunks * segments * 64 <= k.size(1), "segments past L");
  auto out = torch::empty({k.size(0) * segments, kThreads, 4}, k.options().dtype(torch::kInt32));
  const int c = int(chunks), s = int(segments);
  TORCH_CHECK(layout >= kContiguous && layout <= kCoreMatrices && (!bulk || layout == kContiguous), "layout");
#define STREAM_CASE(N)                                                 \
  if (stages == N) {                                                   \
    if (bulk) {                                                        \
      launch<N, true>(k, v, c, s, out);                                \
    } else if (layout == kPadded) {                                    \
      launch<N, false, kPadded>(k, v, c, s, out);                      \
    } else if (layout == kSwizzled) {                                  \
      launch<N, false, kSwizzled>(k, v, c, s, out);                    \
    } else if (layout == kCoreMatrices) {                              \
      launch<N, false, kCoreMatrices>(k, v, c, s, out);                \
    } else {                                                           \
      launch<N, false>(k, v, c, s, out);                               \
    }                                                                  \
    return out;                                                        \
  }
  STREAM_CASE(2)
  STREAM_CASE(3)
  STREAM_CASE(4)
  STREAM_CASE(6)
#undef STREAM_CASE
  TORCH_CHECK(false, "stages: 2, 3, 4 or 6");
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("stream", &stream, pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("chunks"), pybind11::arg("segments"),
        pybind11::arg("stages"), pybind11::arg("bulk"), pybind11::arg("layout") = 0);
}
