// How many thread-block clusters of a given size the GPU holds at once when each block is as
// large as the wgmma kernels' at four atoms (E or M above 128: 224 KB of shared memory, three
// warpgroups, one block a multiprocessor). Decides whether a cluster of the four column tiles
// (each chunk's scores made once and shared through distributed shared memory) can fill the
// machine: the thirty-seventh session's clusters of four 208 KB blocks ran 2.3x slower at
// 2,4,8192,256 (128 blocks, one wave), "it seems" because a GPC's multiprocessors in fours leave
// some idle, never measured.
//
// Two answers for each cluster size:
//   - cudaOccupancyMaxActiveClusters, the driver's count;
//   - measured: `clusters` clusters of blocks that each spin `spin_ns` nanoseconds and record
//     their multiprocessor and their start and end (globaltimer); the host counts the most blocks
//     running at once and the distinct multiprocessors used.
// benchmarks/cluster_probe.py builds and runs it.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <cstdint>

namespace {

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint32_t sm_id() {
  uint32_t id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

// record[block] = {multiprocessor, start ns, end ns}; the block's shared memory is touched so
// that it is really held (the launch reserves it either way)
__global__ void spin_kernel(int64_t* record, uint64_t spin_ns) {
  extern __shared__ unsigned char smem[];
  const uint64_t start = global_ns();
  if (threadIdx.x == 0) smem[0] = 1;
  while (global_ns() - start < spin_ns) {
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const int64_t block = blockIdx.x;  // (a one-dimensional grid)
    record[3 * block] = sm_id();
    record[3 * block + 1] = int64_t(start);
    record[3 * block + 2] = int64_t(global_ns());
  }
}

cudaLaunchConfig_t config_for(int blocks, int cluster, int threads, int64_t smem, cudaLaunchAttribute* attribute,
                              cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned(blocks));
  config.blockDim = dim3(unsigned(threads));
  config.dynamicSmemBytes = size_t(smem);
  config.stream = stream;
  attribute->id = cudaLaunchAttributeClusterDimension;
  attribute->val.clusterDim.x = unsigned(cluster);
  attribute->val.clusterDim.y = 1;
  attribute->val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  return config;
}

void allow(int64_t smem) {
  C10_CUDA_CHECK(cudaFuncSetAttribute(spin_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  C10_CUDA_CHECK(cudaFuncSetAttribute(spin_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
}

}  // namespace

// The driver's count of clusters of `cluster` blocks (threads, smem bytes each) resident at once.
int64_t max_active_clusters(int64_t cluster, int64_t threads, int64_t smem) {
  allow(smem);
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config = config_for(int(cluster), int(cluster), int(threads), smem, &attribute, nullptr);
  int count = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&count, spin_kernel, &config));
  return count;
}

// `blocks` blocks (a multiple of `cluster`) that spin spin_ns each: [blocks, 3] int64 records
// {multiprocessor, start ns, end ns}.
torch::Tensor run(int64_t blocks, int64_t cluster, int64_t threads, int64_t smem, int64_t spin_ns) {
  TORCH_CHECK(cluster >= 1 && blocks % cluster == 0, "cluster_probe: blocks must be a multiple of the cluster size");
  allow(smem);
  auto record = torch::zeros({blocks, 3}, torch::dtype(torch::kInt64).device(torch::kCUDA));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config = config_for(int(blocks), int(cluster), int(threads), smem, &attribute, stream);
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, spin_kernel, record.data_ptr<int64_t>(), uint64_t(spin_ns)));
  return record;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("max_active_clusters", &max_active_clusters, "cudaOccupancyMaxActiveClusters");
  m.def("run", &run, "blocks that spin, each recording its multiprocessor, start and end");
}
