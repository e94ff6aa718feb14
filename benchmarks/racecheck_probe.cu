// Whether compute-sanitizer's racecheck follows the stage ring of the 16-bit wgmma kernels
// (wgmma_product.cuh, ProducedRing): a producer warpgroup fills a slot, announces it with bar.arrive
// on the slot's full barrier (the consumers bar.sync on it), the consumers read the slot with
// ordinary loads and release it with bar.arrive on its empty barrier, and the producer bar.syncs
// on that before it writes the slot again. The normalized forward's racecheck reported races
// between the producer's next copies into a slot and the consumers' reads of it (RESULTS.md,
// fifty-second session); this kernel is that protocol alone, correct by construction, in three
// variants of the producer's writes: ordinary stores, cp.async copies waited for by the producer
// before it arrives (the kernels' way), and the same with a fence.proxy.async after the wait; with
// one consumer warpgroup and with two (the barriers' thread counts of either layout). If
// racecheck reports races here too, they are the tool's; if not, the kernels' are worth a second
// look. A fourth variant (two groups, cp.async) adds the four-atom forward's exchange
// (wgmma_product.cuh, kSplitRows): each chunk the second group's warp w writes its part and
// bar.arrives on barrier 1 + 2 kSlots + w of 64 threads, the first group's warp w bar.syncs there
// and reads it; the second group writes the part again only in the next chunk, after the slot's
// full barrier that the first group reaches once its reads are done (racecheck reported that
// order in the library at 10 chunks, not at 3; RESULTS.md, eighty-fifth session).
// benchmarks/racecheck_probe.py runs it.
#include <torch/extension.h>

#include <cuda_runtime.h>

namespace {

constexpr int kThreads = 128;  // a warpgroup: the consumers, then the producer
constexpr int kSlots = 3;      // the kernels' ring depth
constexpr int kWords = 1024;   // 4 KB a slot

__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// variant 0: st.shared; 1: cp.async, waited for; 2: cp.async, waited for, then fence.proxy.async;
// 3: cp.async and the exchange (two groups): the first group's sums of it at out[256 + thread].
// `groups` consumer warpgroups (one or two, as the kernels' layouts), then the producer.
__global__ void ring_probe(const float* source, float* out, int chunks, int variant, int groups) {
  __shared__ __align__(16) float slots[kSlots][kWords];
  __shared__ float exchange[4 * kThreads];  // (variant 3) warp w's part: words 128 w .. 128 w + 127
  const int tid = threadIdx.x % kThreads, all = (groups + 1) * kThreads;
  // named barriers: full 1 .. kSlots, empty kSlots + 1 .. 2 kSlots (the kernels' layout, shifted)
  auto full = [](int slot) { return 1 + slot; };
  auto empty = [](int slot) { return 1 + kSlots + slot; };
  if (threadIdx.x >= groups * kThreads) {  // the producer
    auto fill = [&](int chunk, int slot) {
      for (int w = tid * 4; w < kWords; w += 4 * kThreads) {
        const float* from = source + (size_t(chunk) * kWords + w);
        if (variant == 0) {
          for (int i = 0; i < 4; ++i) slots[slot][w + i] = from[i];
        } else {
          const uint32_t to = static_cast<uint32_t>(__cvta_generic_to_shared(&slots[slot][w]));
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(to), "l"(from) : "memory");
        }
      }
      asm volatile("cp.async.commit_group;\n" ::: "memory");
    };
    for (int chunk = 0; chunk < kSlots - 1 && chunk < chunks; ++chunk) fill(chunk, chunk);
    for (int chunk = 0; chunk < chunks; ++chunk) {
      const int slot = chunk % kSlots;
      asm volatile("cp.async.wait_group %0;\n" ::"n"(kSlots - 2) : "memory");
      if (variant == 2) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      named_arrive(full(slot), all);
      const int next = chunk + kSlots - 1, refill = next % kSlots;
      if (next < chunks) {
        if (chunk > 0) named_sync(empty(refill), all);  // the consumers done with chunk - 1
        fill(next, refill);
      } else {
        asm volatile("cp.async.commit_group;\n" ::: "memory");  // (the count in flight holds)
      }
    }
    return;
  }
  float sum = 0.f;  // the consumers: every word of each chunk, read by a thread that did not write it
  float exchanged = 0.f;  // (variant 3, the first group) the second group's parts, another lane's words
  const int warp = tid / 32, lane = tid % 32, group = threadIdx.x / kThreads;
  for (int chunk = 0; chunk < chunks; ++chunk) {
    const int slot = chunk % kSlots;
    named_sync(full(slot), all);
    for (int w = (tid + 37) % kThreads; w < kWords; w += kThreads) sum += slots[slot][w];
    if (variant == 3 && group == 1) {
      for (int i = 0; i < 4; ++i) exchange[128 * warp + 32 * i + lane] = float(chunk + i + tid);
      named_arrive(1 + 2 * kSlots + warp, 2 * 32);
    } else if (variant == 3) {
      named_sync(1 + 2 * kSlots + warp, 2 * 32);
      for (int i = 0; i < 4; ++i) exchanged += exchange[128 * warp + 32 * i + (lane + 5) % 32];
    }
    // released where the producer waits for it (ProducedRing::release's condition, kReuse = kSlots)
    if (chunk + kSlots < chunks) named_arrive(empty(slot), all);
  }
  out[threadIdx.x] = sum;
  if (variant == 3 && group == 0) out[groups * kThreads + tid] = exchanged;
}

}  // namespace

// The consumers' sums (one a consumer thread, groups x 128) of `chunks` chunks of source, then
// (variant 3) the first group's sums of the exchange (128).
torch::Tensor run(torch::Tensor source, int64_t chunks, int64_t variant, int64_t groups) {
  TORCH_CHECK(source.is_cuda() && source.dtype() == torch::kFloat && source.numel() >= chunks * kWords,
              "racecheck_probe: source must be float32 CUDA with chunks * ", kWords, " elements");
  TORCH_CHECK(groups == 1 || groups == 2, "racecheck_probe: one consumer warpgroup or two");
  TORCH_CHECK(variant != 3 || groups == 2, "racecheck_probe: the exchange (variant 3) takes two groups");
  auto out = torch::zeros({(groups + 1) * kThreads}, source.options());
  ring_probe<<<1, unsigned((groups + 1) * kThreads)>>>(source.data_ptr<float>(), out.data_ptr<float>(), int(chunks),
                                                      int(variant), int(groups));
  TORCH_CHECK(cudaGetLastError() == cudaSuccess, "racecheck_probe: launch failed");
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("run", &run); }
