// The one dispatcher of the CUDA backend: which kernel family and head-dim bucket runs a pass.
#pragma once

#include <cstdlib>
#include <cstring>

#include <type_traits>

#include "chunked_product.cuh"
#include "recurrent_product.cuh"
#include "tensorcore_product.cuh"

namespace fast_causal_attn {
namespace cuda {

enum class Family { Default, Recurrent, Chunked, TensorCore, Decode };

// FAST_CAUSAL_ATTN_KERNEL=recurrent, =chunked or =tensorcore forces a family where it can run
// (chunked and tensorcore: Da <= 256; tensorcore: float16, bfloat16, float32), so that the tests cover each;
// =decode (as the default does) sends forwards of one timestep to the decoding-step kernel
// (decode_step.cu; see launch_forward_cuda).
inline Family forced_family() {
  const char* forced = std::getenv("FAST_CAUSAL_ATTN_KERNEL");
  if (forced == nullptr || forced[0] == '\0') return Family::Default;
  if (std::strcmp(forced, "recurrent") == 0) return Family::Recurrent;
  if (std::strcmp(forced, "chunked") == 0) return Family::Chunked;
  if (std::strcmp(forced, "tensorcore") == 0) return Family::TensorCore;
  if (std::strcmp(forced, "decode") == 0) return Family::Decode;
  TORCH_CHECK(false, "FAST_CAUSAL_ATTN_KERNEL must be 'recurrent', 'chunked', 'tensorcore' or 'decode', got '", forced,
              "'");
}

// Where each pass starts and ends (csrc/causal_attn.h derives these): the forward runs from
// (S0, z0) to (S1, z1); the dq product starts from [S0^T; z0]; the dk product from
// [dS1^T; dz1] and ends at dz0 in its extra row; the dv product from dS1 to dS0. Without normalize
// the key sums never meet q: dz1 reaches dk as a constant row (out_bias) and dz0 = dz1 (host).
template <Pass P>
KernelParams with_state_io(const KernelParams& p) {
  KernelParams s = p;
  switch (P) {
    case Pass::Forward:
      s.start_state = p.initial_kv, s.start_vector = p.initial_k_sum;
      s.end_state = p.final_kv, s.end_vector = p.final_k_sum;
      break;
    case Pass::GradQ:
      s.start_state = p.initial_kv, s.start_transposed = true;
      s.start_vector = p.normalize ? p.initial_k_sum : nullptr;
      break;
    case Pass::GradK:
      s.start_state = p.grad_final_kv, s.start_transposed = true;
      s.start_vector = p.normalize ? p.grad_final_k_sum : nullptr;
      s.end_vector = p.normalize ? p.grad_initial_k_sum : nullptr;
      s.out_bias = p.normalize ? nullptr : p.grad_final_k_sum;
      break;
    case Pass::GradV:
      s.start_state = p.grad_final_kv, s.end_state = p.grad_initial_kv;
      break;
  }
  return s;
}

// The family a pass gets by default, from crossovers measured side by side (H200, forward +
// backward ms, tensor-core / recurrent family; benchmarks/RESULTS.md, 2026-11-30):
//  - float16 / bfloat16, Da <= 128: tensor cores, 1.4-13x faster at every benchmark shape
//    (bf16 8,16,2048,64: 0.42 / 2.79; 2,4,8192,64: 0.39 / 0.57; 1,16,32768,128: 1.90 / 24.7).
//  - float32 (3xTF32), Da <= 128: tensor cores (8,16,2048,64: 1.80 / 2.56; 4,16,8192,64: 4.24 /
//    5.67; 1,16,32768,128: 13.99 / 21.94; 8,16,2048,64,128: 3.23 / 3.58), except where Da = 128
//    (one block a multiprocessor: about 250 registers, 209 KB of shared memory) needs more blocks than
//    multiprocessors (8,16,2048,128: 5.94 / 4.44), and with fewer than 16 blocks (2,4,8192,64:
//    0.75 / 0.59).
//  - Da 129-256 on tensor cores (DA = 256, 32 columns a block) is not yet measured: forced only.
//  - Da > 128, and float64: the recurrent family (the chunked family was never faster than it:
//    8,16,2048,64 fp32 3.35 / 2.82, 1,16,32768,128 23.9 / 23.7, bf16 the same order).
template <typename scalar_t>
bool tensorcore_by_default(const KernelParams& p, int64_t Da, int64_t Dc) {
  if (!kTensorCoreInput<scalar_t> || Da > 128) return false;
  if constexpr (!std::is_same_v<scalar_t, float>) return true;
  const int64_t blocks = p.num_seqs * p.H * ((Dc + 63) / 64);  // 64 columns a block below DA = 256
  if (Da > 64 && blocks > multiprocessor_count()) return false;
  return blocks >= 16;
}

// Whether a pass with the state's Da rows and Dc columns runs on tensor cores: forced where the
// family can run it, else where it is the default.
template <typename scalar_t>
bool on_tensor_cores(const KernelParams& p, int64_t Da, int64_t Dc) {
  const Family family = forced_family();
  return kTensorCoreInput<scalar_t> && Da <= kMaxTensorCoreRows &&
         (family == Family::TensorCore || (family == Family::Default && tensorcore_by_default<scalar_t>(p, Da, Dc)));
}

template <Pass P, typename scalar_t>
void run_pass(const KernelParams& params, cudaStream_t stream) {
  const KernelParams p = with_state_io<P>(params);
  // a and b index the state's rows, c its columns (see Operands).
  const bool a_is_e = P == Pass::Forward || P == Pass::GradV;
  const int64_t Da = a_is_e ? p.E : p.M;
  const int64_t Dc = a_is_e ? p.M : p.E;
  const Family family = forced_family();
  const bool tensorcore = on_tensor_cores<scalar_t>(p, Da, Dc);
  if (p.has_state_io() || p.cu_seqlens != nullptr) {  // the chunked families take states and packed sequences
    // ops.cpp refuses such calls before anything is allocated; this guards the kernels' buckets.
    TORCH_CHECK(Da <= kMaxChunkedRows, "fast_causal_attn: states and cu_seqlens on CUDA support head dims up to ",
                int64_t(kMaxChunkedRows), ", got E = ", p.E, ", M = ", p.M);
    if (tensorcore) {
      run_tensorcore<P, scalar_t>(p, Da, Dc, stream);
    } else {
      run_chunked<P, scalar_t>(p, Da, Dc, stream);
    }
    return;
  }
  if (family == Family::Chunked && Da <= kMaxChunkedRows) {
    run_chunked<P, scalar_t>(p, Da, Dc, stream);
  } else if (tensorcore) {
    run_tensorcore<P, scalar_t>(p, Da, Dc, stream);
  } else {
    run_recurrent<P, scalar_t>(p, Da, Dc, stream);
  }
}

// The gradients of k and v in one tensor-core pass (Pass::GradKV, see tensorcore_product.cuh)
// where both would run on tensor cores and E, M <= 64, without states in or out or packed
// sequences (those keep the two passes). Not yet measured against the two passes, so opt-in
// until a side-by-side run says where it is faster: FAST_CAUSAL_ATTN_FUSED_GRAD_KV=1. Returns
// whether it ran.
template <typename scalar_t>
bool run_grad_kv(const KernelParams& p, cudaStream_t stream) {
  if constexpr (kTensorCoreInput<scalar_t>) {
    const char* fused = std::getenv("FAST_CAUSAL_ATTN_FUSED_GRAD_KV");
    if (fused == nullptr || std::strcmp(fused, "1") != 0) return false;
    if (p.E > 64 || p.M > 64 || p.cu_seqlens != nullptr) return false;
    if (with_state_io<Pass::GradK>(p).has_state_io() || with_state_io<Pass::GradV>(p).has_state_io()) return false;
    // Both passes' (Da, Dc): dk's (M, E), dv's (E, M).
    if (!on_tensor_cores<scalar_t>(p, p.M, p.E) || !on_tensor_cores<scalar_t>(p, p.E, p.M)) return false;
    launch_tensorcore<Pass::GradKV, scalar_t, 64, 64>(p, p.M, p.E, stream);  // the dk pass's Da, Dc
    return true;
  } else {
    return false;
  }
}

template <Pass P>
void run_pass_for_dtype(const KernelParams& p, cudaStream_t stream) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p.dtype, "fast_causal_attn (CUDA)",
                                  [&] { run_pass<P, scalar_t>(p, stream); });
}

// One compile unit each (csrc/cuda/pass_*.cu), so that builds run in parallel.
void run_forward_pass(const KernelParams& p, cudaStream_t stream);
void run_grad_q_pass(const KernelParams& p, cudaStream_t stream);
void run_grad_k_pass(const KernelParams& p, cudaStream_t stream);
void run_grad_v_pass(const KernelParams& p, cudaStream_t stream);
bool run_grad_kv_pass(const KernelParams& p, cudaStream_t stream);  // false: run the two passes

}  // namespace cuda
}  // namespace fast_causal_attn
