// CUDA backend: the launchers behind the ops and their registration for CUDA tensors.
#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cstdlib>
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>

#include <cuda.h>
#include <cudaTypedefs.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Context.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../ops.h"
#include "dispatch.cuh"

namespace fast_causal_attn {
namespace cuda {

namespace {
// ask(device) for the current device, asked once per device and kept in `asked` (ask never
// returns 0, which marks "not asked yet"; devices past the first 64 are asked each time).
template <typename Ask>
int once_per_device(std::atomic<int> (&asked)[64], Ask ask) {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  int value = device < 64 ? asked[device].load(std::memory_order_relaxed) : 0;
  if (value == 0) {
    value = ask(device);
    if (device < 64) asked[device].store(value, std::memory_order_relaxed);
  }
  return value;
}
}  // namespace

// The current device's multiprocessor count (launchers ask every call).
int multiprocessor_count() {
  static std::atomic<int> asked[64] = {};
  return once_per_device(asked, [](int device) {
    int sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    return sms;
  });
}

// Whether the current device is of compute capability 9.0 (H100, H200), where a binary built for
// sm_90a runs.
bool device_runs_sm90a() {
  static std::atomic<int> asked[64] = {};
  return once_per_device(asked, [](int device) {
           int major = 0, minor = 0;
           C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
           C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
           return major == 9 && minor == 0 ? 2 : 1;  // 2: yes, 1: no
         }) == 2;
}

void allow_dynamic_smem(const void* kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return;  // the default limit
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::map<std::pair<int, const void*>, size_t> raised;  // (device, kernel) -> limit set
  std::lock_guard<std::mutex> lock(mutex);
  size_t& limit = raised[{device, kernel}];
  if (limit < bytes) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
    limit = bytes;
  }
}

bool transposed_map(CUtensorMap& map, bool half, const void* ptr, int64_t B, int64_t H, int64_t L, int64_t D,
                    int64_t stride_b, int64_t stride_h, int64_t stride_l) {
  // the driver's encoder through the runtime (no link against libcuda), looked up once
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
    return found == cudaDriverEntryPointSuccess ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn) : nullptr;
  }();
  if (encode == nullptr) return false;
  // dimensions innermost first: D, L, H, B; strides in bytes of the three outer ones (a map over
  // an empty tensor is never launched: any size of 1 stands in)
  const cuuint64_t dims[4] = {cuuint64_t(std::max<int64_t>(D, 1)), cuuint64_t(std::max<int64_t>(L, 1)),
                              cuuint64_t(std::max<int64_t>(H, 1)), cuuint64_t(std::max<int64_t>(B, 1))};
  const cuuint64_t strides[3] = {cuuint64_t(stride_l * 2), cuuint64_t(stride_h * 2), cuuint64_t(stride_b * 2)};
  const cuuint32_t box[4] = {64, 64, 1, 1}, element_strides[4] = {1, 1, 1, 1};
  for (int i = 0; i < 3; ++i) {
    if (strides[i] % 16 != 0 || strides[i] >= (cuuint64_t(1) << 40)) return false;
  }
  if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return false;
  return encode(&map, half ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<void*>(ptr), dims, strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

int64_t choose_segments(int64_t blocks, int64_t target_blocks, int64_t L, int64_t min_segment_len) {
  if (const char* forced = std::getenv("FAST_CAUSAL_ATTN_SEGMENTS")) {
    const int64_t n = std::atoll(forced);
    if (n >= 1) return n;
  }
  if (blocks >= target_blocks) return 1;
  const int64_t most = std::max<int64_t>(1, L / min_segment_len);
  return std::min((target_blocks + blocks - 1) / blocks, most);
}

namespace {

// dout_dot_out[t] = dO[t] . O[t]: the one reduction over M that the normalized gradients of
// q and k need per timestep (flash-attention's backward prepares its dO . O the same way), where
// the dq pass does not make them itself (grad_q_makes_dots: the 16-bit wgmma dq in one column
// tile, whose producer reads O beside its staged dO: bf16 4,16,8192,64 dq 0.0971 + this
// kernel's 0.0501 ms -> dq 0.1246, normalized fwd+bwd 0.511 -> 0.481; H100, RESULTS.md,
// fifty-sixth session). `lanes` lanes a row (a power of two up to a warp), each reading kVector
// elements at a time: 16-byte vectors where both tensors' rows are whole aligned vectors
// (vector_rows), else one element.
// One lane a 4-byte piece of a row, as this kernel first read them, took 70 us for the 67 MB of
// bf16 8,16,2048,64 (H100, RESULTS.md, fifty-third session), a third of the copy bandwidth. A
// thread a row piece, its row found by three 64-bit divisions, took 54 us for the 67 MB of float32
// 8,16,2048,64: so each block holds rows of one (batch, head) pair, its pair found once by a
// 32-bit division, and each thread kPrepareRows rows (rows_at_once apart), their loads issued
// together: 54 -> 50 us there, 204 -> 178 at 1,16,32768,128 (fifty-eighth session). It reads
// dO and O at 86% of the DRAM peak (2.89 TB/s, ncu, fifty-ninth session): at the bandwidth.
constexpr int kPrepareRows = 4;
template <typename scalar_t, int kVector>
__global__ void backward_prepare_kernel(const KernelParams p, int lanes, unsigned blocks_per_pair) {
  using acc_t = at::opmath_type<scalar_t>;
  using Vector = std::conditional_t<kVector == 1, scalar_t, uint4>;
  const unsigned pair = blockIdx.x / blocks_per_pair, piece = blockIdx.x % blocks_per_pair;
  const int64_t b = pair / unsigned(p.H), h = pair % unsigned(p.H);
  const int lane = int(threadIdx.x) % lanes, rows_at_once = int(blockDim.x) / lanes;
  const int64_t t_first = int64_t(piece) * rows_at_once * kPrepareRows + int(threadIdx.x) / lanes;
  const scalar_t* dout = static_cast<const scalar_t*>(p.dout.ptr) + p.dout.offset(b, h, t_first);
  const scalar_t* out = static_cast<const scalar_t*>(p.o.ptr) + p.o.offset(b, h, t_first);
  const int64_t dout_step = rows_at_once * p.dout.stride_l, out_step = rows_at_once * p.o.stride_l;
  int64_t t[kPrepareRows];  // this thread's rows
#pragma unroll
  for (int i = 0; i < kPrepareRows; ++i) t[i] = t_first + int64_t(i) * rows_at_once;
  acc_t dot[kPrepareRows] = {};
  for (int64_t m = int64_t(lane) * kVector; m < p.M; m += int64_t(lanes) * kVector) {
    Vector x[kPrepareRows], y[kPrepareRows];
#pragma unroll
    for (int i = 0; i < kPrepareRows; ++i) {
      if (t[i] < p.L) {
        x[i] = *reinterpret_cast<const Vector*>(dout + i * dout_step + m);
        y[i] = *reinterpret_cast<const Vector*>(out + i * out_step + m);
      }
    }
#pragma unroll
    for (int i = 0; i < kPrepareRows; ++i) {
      if (t[i] < p.L) {
        const scalar_t* xs = reinterpret_cast<const scalar_t*>(&x[i]);
        const scalar_t* ys = reinterpret_cast<const scalar_t*>(&y[i]);
#pragma unroll
        for (int e = 0; e < kVector; ++e) dot[i] += acc_t(xs[e]) * acc_t(ys[e]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kPrepareRows; ++i) {  // (every lane takes part in the shuffles)
    for (int offset = lanes / 2; offset > 0; offset /= 2) dot[i] += __shfl_xor_sync(0xffffffffu, dot[i], offset, lanes);
    if (lane == 0 && t[i] < p.L) static_cast<acc_t*>(p.dout_dot_out)[int64_t(pair) * p.L + t[i]] = dot[i];
  }
}

// Whether dO's and O's rows are whole 16-byte vectors, each at a 16-byte boundary.
bool vector_rows(const KernelParams& p, int64_t element) {
  const int64_t vector = 16 / element;
  auto aligned = [&](const StridedTensor& t) {
    return reinterpret_cast<uintptr_t>(t.ptr) % 16 == 0 && t.stride_b % vector == 0 && t.stride_h % vector == 0 &&
           t.stride_l % vector == 0;
  };
  return p.M % vector == 0 && aligned(p.dout) && aligned(p.o);
}

// dout_dot_out for every (batch, head, timestep) of p (launch_backward_cuda's, under normalize).
template <typename scalar_t>
void launch_backward_prepare(const KernelParams& p, cudaStream_t stream) {
  constexpr int kThreads = 256, kVector = 16 / sizeof(scalar_t);
  const bool vectors = vector_rows(p, sizeof(scalar_t));
  const int64_t pieces = vectors ? p.M / kVector : p.M;  // a row's reads
  int lanes = 1;
  while (lanes < kWarp && lanes < pieces) lanes *= 2;
  const int64_t block_rows = int64_t(kThreads / lanes) * kPrepareRows;  // a block's rows, of one pair
  const int64_t blocks_per_pair = (p.L + block_rows - 1) / block_rows, blocks = p.B * p.H * blocks_per_pair;
  if (blocks == 0) return;
  TORCH_CHECK(blocks <= int64_t(0x7fffffff), "fast_causal_attn: B * H * L too large: ", p.B * p.H * p.L);
  if (vectors) {
    backward_prepare_kernel<scalar_t, kVector><<<unsigned(blocks), kThreads, 0, stream>>>(p, lanes, unsigned(blocks_per_pair));
  } else {
    backward_prepare_kernel<scalar_t, 1><<<unsigned(blocks), kThreads, 0, stream>>>(p, lanes, unsigned(blocks_per_pair));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// float16's normalized backward on the wgmma kernels divides q (and dv's dO) by den in float16:
// about 1 / |key sum| for positive features, below float16's smallest normal (6.1e-5) once den
// passes a few thousand, where each halving loses a bit (dk 1e-2 off at den 4e4: RESULTS.md,
// sixty-eighth session). The quotients are taken times a power of two instead
// (KernelParams::den_unit): unit = 2^floor(log2(max |den| / 256)), at least 1, which puts the
// last rows' (den near its largest) near q / 256 and the first rows' below q L / 256. Each block
// takes the largest |den| of its stretch into `scratch[0]` (the bits of non-negative floats order
// as unsigned integers; non-finite values are left out), and the last block to finish
// (scratch[1] counts them) writes unit and 1 / unit to scratch[2], scratch[3]: the kernels and
// launch_wgmma read them there.
constexpr int kDenUnitThreads = 256;
__global__ void __launch_bounds__(kDenUnitThreads) den_unit_kernel(const float* den, int64_t n, unsigned* scratch) {
  float largest = 0.f;
  auto take = [&](float x) {
    x = fabsf(x);
    if (x <= FLT_MAX) largest = fmaxf(largest, x);
  };
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  // 16 bytes a load where den starts on a 16-byte boundary (the forward's den, a fresh tensor, does;
  // 4 bytes a load and an atomic a warp took 5.0 us over 1 MB at 8,16,2048: RESULTS.md,
  // sixty-ninth session)
  const bool vectors = reinterpret_cast<uintptr_t>(den) % 16 == 0;
  const int64_t head = vectors ? n / 4 : 0;
  for (int64_t i = first; i < head; i += stride) {
    const float4 x = reinterpret_cast<const float4*>(den)[i];
    take(x.x), take(x.y), take(x.z), take(x.w);
  }
  for (int64_t i = 4 * head + first; i < n; i += stride) take(den[i]);
  // the block's largest, then one atomic a block on the one address
  __shared__ float warp_largest[kDenUnitThreads / kWarp];
  for (int offset = kWarp / 2; offset > 0; offset /= 2) largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, offset));
  if (threadIdx.x % kWarp == 0) warp_largest[threadIdx.x / kWarp] = largest;
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int w = 1; w < kDenUnitThreads / kWarp; ++w) largest = fmaxf(largest, warp_largest[w]);
  atomicMax(&scratch[0], __float_as_uint(largest));
  __threadfence();  // seen by the last block before this block counts itself
  if (atomicAdd(&scratch[1], 1u) != gridDim.x - 1) return;  // not the last block
  __threadfence();
  const float x = __uint_as_float(atomicMax(&scratch[0], 0u)) / 256.f;
  int exponent = 1;
  if (x >= 1.f) frexpf(x, &exponent);  // x = m 2^exponent, m in [0.5, 1): floor(log2 x) = exponent - 1
  const float unit = ldexpf(1.f, min(exponent - 1, 120));
  reinterpret_cast<float*>(scratch)[2] = unit;
  reinterpret_cast<float*>(scratch)[3] = 1.f / unit;  // a power of two: exact
}

// KernelParams::den_unit for p (float16 under normalize; nullptr otherwise): four words, zeroed,
// then den_unit_kernel over den's B H L values (float32, contiguous).
at::Tensor make_den_unit(KernelParams& p, cudaStream_t stream) {
  const int64_t n = p.B * p.H * p.L;
  if (!p.normalize || p.dtype != at::kHalf || n == 0) return at::Tensor();
  at::Tensor scratch = at::zeros({4}, at::TensorOptions().dtype(at::kInt).device(at::kCUDA));
  // (a float4 a thread, at most four blocks a multiprocessor)
  const int64_t per_block = 4 * kDenUnitThreads;
  const int64_t blocks = std::min<int64_t>((n + per_block - 1) / per_block, 4 * multiprocessor_count());
  den_unit_kernel<<<unsigned(blocks), kDenUnitThreads, 0, stream>>>(static_cast<const float*>(p.den), n,
                                                           reinterpret_cast<unsigned*>(scratch.data_ptr<int>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  p.den_unit = reinterpret_cast<const float*>(scratch.data_ptr<int>()) + 2;
  return scratch;
}

// The user's TF32 setting for float32 matmuls, which the tensor-core kernels follow.
bool tf32_allowed(const KernelParams& p) { return p.dtype == at::kFloat && at::globalContext().allowTF32CuBLAS(); }

// One timestep (decoding): the decoding-step kernel, 1.4-2.7x faster than the chunked kernels'
// general path (H200, H = 16, E = M = 128, fp32 state, us for B = 1 / 8 / 64: 17.8 / 20.6 / 101
// vs 25.2 / 34.4 / 223). A forced family keeps its own kernel, so that the tests cover each.
bool decoding_step(const KernelParams& p) {
  const Family family = forced_family();
  return p.L == 1 && p.cu_seqlens == nullptr && (family == Family::Default || family == Family::Decode);
}

ForwardSegments launch_forward_cuda(const ForwardParams& params) {
  KernelParams p;
  static_cast<ForwardParams&>(p) = params;
  p.tf32 = tf32_allowed(p);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (decoding_step(p)) {
    run_decode_step(p, stream);
    return {};
  }
  return run_forward_pass(p, stream);
}

// Without normalize the key sum passes straight through: its gradient at the start is the final one's.
void add_grad_initial_k_sum(const KernelParams& p, cudaStream_t stream) {
  if (p.normalize || p.grad_initial_k_sum == nullptr) return;
  const size_t bytes = size_t(p.num_seqs * p.H * p.E) * (p.dtype == at::kDouble ? 8 : 4);
  if (p.grad_final_k_sum != nullptr) {
    C10_CUDA_CHECK(cudaMemcpyAsync(p.grad_initial_k_sum, p.grad_final_k_sum, bytes, cudaMemcpyDeviceToDevice, stream));
  } else {
    C10_CUDA_CHECK(cudaMemsetAsync(p.grad_initial_k_sum, 0, bytes, stream));
  }
}

void launch_backward_cuda(const BackwardParams& params) {
  KernelParams p;
  static_cast<BackwardParams&>(p) = params;
  p.tf32 = tf32_allowed(p);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor den_unit = make_den_unit(p, stream);  // (float16 under normalize)
  // The one-pass backward (one_pass_backward), from the forward's segment ends, which the
  // forward kept where it decided on it (the two decide alike)
  const bool one_pass =
      p.forward_segments >= 1 && keeps_one_pass_ends(p.B * p.H, p.forward_segments) && one_pass_backward_takes(p);
  at::Tensor dout_dot_out;
  // dO . O under normalize: made by the kernel that makes dq where it can (the one pass's producer,
  // or the dq pass's, reading O beside the dO it stages, 16 bytes at a time: O's rows whole vectors
  // at 16-byte boundaries), else here, before it
  auto make_dots = [&](bool in_one_pass) {
    if (!p.normalize || p.L == 0) return;
    if (!dout_dot_out.defined()) {
      const auto acc = p.dtype == at::kDouble ? at::kDouble : at::kFloat;
      dout_dot_out = at::empty({p.B * p.H * p.L}, at::TensorOptions().dtype(acc).device(at::kCUDA));
      p.dout_dot_out = dout_dot_out.data_ptr();
    }
    p.dots_in_grad_q = (in_one_pass ? one_pass_makes_dots(p.forward_segments) : grad_q_pass_makes_dots(p)) &&
                       vector_rows(p, int64_t(c10::elementSize(p.dtype)));
    if (!p.dots_in_grad_q) {
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p.dtype, "fast_causal_attn backward_prepare",
                                      [&] { launch_backward_prepare<scalar_t>(p, stream); });
    }
  };
  make_dots(one_pass);
  // The one pass: dk, dv and dq in one launch (or three in many segments, as dk-with-dv's). Where
  // it cannot run after all (a given final state's gradient with |scale| outside wgmma_takes'
  // range), dq and dk-with-dv run as below, dq summing its own segments: the ends are no starts,
  // and the dots, where the one pass was to make them, made for the two passes.
  if (one_pass) {
    p.one_pass = true;
    if (run_grad_kv_pass(p, stream)) {
      add_grad_initial_k_sum(p, stream);
      return;
    }
    p.one_pass = false;
    p.forward_segments = 0;
    p.forward_segment_kv = p.forward_segment_k_sum = nullptr;
    if (p.dots_in_grad_q) make_dots(false);
  }
  // dq, then dk and dv, on the caller's stream. The dk/dv passes on a side stream beside dq (the
  // issue's "concurrently where possible") measured slower or no faster at every shape (H200
  // fwd+bwd ms, sequential / concurrent: bf16 8,16,2048,64 0.373 / 0.446, 4,16,8192,64 0.589 /
  // 0.649, 1,16,32768,128 1.753 / 1.843; fp32 8,16,2048,128 3.167 / 3.167): each pass already
  // fills one wave, and two of them side by side only share it; removed (benchmarks/RESULTS.md).
  run_grad_q_pass(p, stream);
  if (!run_grad_kv_pass(p, stream)) {
    // dk keeps its segments' starts where it ran on the float32 wgmma kernel in segments, and dv
    // reads them transposed (dk's state dO^T q is dv's q^T dO): one state-only launch and scan
    // for both, as the dq pass reads the forward's
    // The forward's starts are dq's alone: dk starts from none, dv from dk's or none (with the
    // forward's, which hold q^T v where dv wants q^T dO, dv was wrong wherever the forward ran in
    // segments and dk did not: bf16 4,16,2048,256,64 on the H200, twenty-fifth session).
    KernelParams dv = p;
    dv.forward_segments = 0;
    dv.forward_segment_kv = dv.forward_segment_k_sum = nullptr;
    KernelParams dk = dv;
    dk.keep_segments = true;
    const ForwardSegments dk_starts = run_grad_k_pass(dk, stream);
    if (dk_starts.kv.defined()) {
      dv.forward_segment_kv = dk_starts.kv.data_ptr();
      dv.forward_segments = dk_starts.count;
    }
    run_grad_v_pass(dv, stream);
  }
  add_grad_initial_k_sum(p, stream);
}

}  // namespace
}  // namespace cuda

int64_t plan_forward_segments(const ForwardParams& params, int device) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  cuda::KernelParams p;
  static_cast<ForwardParams&>(p) = params;
  p.dry_run = true;
  // No output and no state to write (ops.cpp launches nothing), or a decoding step: no segments.
  if (p.B * p.H * p.M == 0 || cuda::decoding_step(p)) return 0;
  return cuda::run_forward_pass(p, nullptr).count;
}

TORCH_LIBRARY_IMPL(fast_causal_attn, CUDA, m) {
  m.impl("forward", &forward_op<&cuda::launch_forward_cuda>);
  m.impl("backward", &backward_op<&cuda::launch_backward_cuda>);
}

}  // namespace fast_causal_attn
