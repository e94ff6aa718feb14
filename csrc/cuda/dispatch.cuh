// The one dispatcher of the CUDA backend: which kernel family and head-dim bucket runs a pass.
#pragma once

#include <cstdlib>
#include <cstring>

#include <type_traits>

#include "chunked_product.cuh"
#include "recurrent_product.cuh"
#include "tensorcore_product.cuh"
#include "wgmma_launch.cuh"

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
// dk and dv in one pass (the 16-bit wgmma kernels' GradKV; run_grad_kv): its state D = sum dO^T q
// (M x E) serves both gradients (dk = V D, dv = K D^T), so it starts from dS1^T (dk's start; dv's
// is the same matrix) and ends as dS0 (E x M: dv's end), written transposed, with dk's constant
// row, or under normalize dk's extra row from dz1 to dz0.
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
    case Pass::GradKV:  // (dk's extra row under normalize: the key sums' gradients, as GradK's)
      s.start_state = p.grad_final_kv, s.start_transposed = true;
      s.end_state = p.grad_initial_kv, s.end_transposed = true;
      s.start_vector = p.normalize ? p.grad_final_k_sum : nullptr;
      s.end_vector = p.normalize ? p.grad_initial_k_sum : nullptr;
      s.out_bias = p.normalize ? nullptr : p.grad_final_k_sum;
      break;
  }
  return s;
}

// The family a pass gets by default, from crossovers measured side by side (H200, forward +
// backward ms, tensor-core / recurrent family; benchmarks/RESULTS.md, 2026-11-30, fifth session):
//  - float16 / bfloat16, every Da up to 256: tensor cores, 3-14x faster at every benchmark shape
//    (bf16 8,16,2048,64: 0.44 / 2.84; 2,4,8192,64: 0.34 / 0.55; 1,16,32768,128: 1.72 / 24.3;
//    4,16,2048,256 (DA = 256): 1.76 / 10.6).
//  - float32 (3xTF32), Da <= 64: tensor cores (sixth session: 8,16,2048,64: 1.12 / 2.71;
//    4,16,8192,64: 2.08 / 5.68; 2,4,8192,64 (8 blocks, segments scanned): 0.41-0.56 / 0.57;
//    8,16,2048,64,128: 2.24 / 3.60).
//  - float32, Da = 128, on Hopper (sm_90a builds): every pass on the wgmma kernel, in two row tiles
//    (wgmma_takes says where it was measured faster). Elsewhere, and with FAST_CAUSAL_ATTN_WGMMA=0:
//  - float32, Da = 128 (tensor cores hold one block a multiprocessor: about 245 registers, 209 KB
//    of shared memory): the forward on tensor cores at any block count (thirteenth session,
//    8,16,2048,128, 256 blocks: forward 0.886, 0.804 with the k-loops unrolled, against the
//    recurrent family's 1.082); the backward's passes on tensor cores while their blocks fit one
//    wave (1,16,32768,128 fwd+bwd 8.27 / 16.96, thirteenth session), recurrent beyond
//    (8,16,2048,128 fwd+bwd with every pass on tensor cores 3.64, with the recurrent backward
//    3.17: its fused dk/dv pass, see run_grad_kv, 1.30 ms).
//  - float32, Da in (128, 256], on Hopper (sm_90a builds): the wgmma kernel in up to four row
//    tiles (wgmma_takes; twenty-fifth session, fwd+bwd, the families below / wgmma:
//    4,16,2048,256 7.46 / 4.74, 2,4,8192,256 6.63 / 2.40). Elsewhere, and with
//    FAST_CAUSAL_ATTN_WGMMA=0:
//  - float32, Da in (128, 256] (DA = 256: 32 columns a block, 3xTF32's three products in one
//    buffer): tensor cores while their blocks fit one wave, recurrent beyond (fourteenth
//    session, fwd+bwd: 2,4,8192,256 (64 blocks) 6.64 / 7.71, every pass faster on tensor cores;
//    4,16,2048,256 (512 blocks) 12.0 / 7.46); float64: recurrent (the chunked family was never
//    faster than it: 8,16,2048,64 fp32 3.29 / 2.73, 1,16,32768,128 21.9 / 21.9).
template <Pass P, typename scalar_t>
bool tensorcore_by_default(const KernelParams& p, int64_t Da, int64_t Dc) {
  if constexpr (!kTensorCoreInput<scalar_t>) return false;
  if constexpr (!std::is_same_v<scalar_t, float>) return true;
  if (Da > kMaxTensorCoreRows) return false;
  if (Da <= 64 || (Da <= 128 && P == Pass::Forward)) return true;
  // Da = 128 on Hopper: the wgmma kernel's row tiles, faster at every shape measured (wgmma_takes)
  if (wgmma_takes<P, scalar_t>(p, Da, Dc)) return true;
  const int64_t columns = tensorcore_block_columns(Da);
  const int64_t blocks = p.num_seqs * p.H * ((Dc + columns - 1) / columns);
  return blocks <= multiprocessor_count();
}

// Whether pass P, with the state's Da rows and Dc columns, runs on tensor cores: forced where the
// family can run it, else where it is the default.
template <Pass P, typename scalar_t>
bool on_tensor_cores(const KernelParams& p, int64_t Da, int64_t Dc) {
  const Family family = forced_family();
  return kTensorCoreInput<scalar_t> && Da <= kMaxTensorCoreRows &&
         (family == Family::TensorCore ||
          (family == Family::Default && tensorcore_by_default<P, scalar_t>(p, Da, Dc)));
}

// A pass on tensor cores: the wgmma kernels where they take the pass by default (wgmma_launch.cuh),
// the mma.sync kernels otherwise (and whenever FAST_CAUSAL_ATTN_KERNEL=tensorcore forces the
// family, so that their tests keep testing them).
template <Pass P, typename scalar_t>
bool on_wgmma(const KernelParams& p, int64_t Da, int64_t Dc) {
  if constexpr (kWgmmaPass<P, scalar_t> && P != Pass::GradKV) {  // (GradKV: run_grad_kv)
    return forced_family() == Family::Default && wgmma_takes<P, scalar_t>(p, Da, Dc);
  } else {
    (void)p, (void)Da, (void)Dc;
    return false;
  }
}
template <Pass P, typename scalar_t>
ForwardSegments run_on_tensor_cores(const KernelParams& p, int64_t Da, int64_t Dc, cudaStream_t stream) {
  if constexpr (kWgmmaPass<P, scalar_t> && P != Pass::GradKV) {
    if (on_wgmma<P, scalar_t>(p, Da, Dc)) return launch_wgmma<P, scalar_t>(p, Da, Dc, stream);
  }
  return run_tensorcore<P, scalar_t>(p, Da, Dc, stream);
}

// Returns the forward's segment starts where the tensor-core family kept them (see ForwardSegments).
template <Pass P, typename scalar_t>
ForwardSegments run_pass(const KernelParams& params, cudaStream_t stream) {
  const KernelParams p = with_state_io<P>(params);
  // a and b index the state's rows, c its columns (see Operands).
  const bool a_is_e = P == Pass::Forward || P == Pass::GradV;
  const int64_t Da = a_is_e ? p.E : p.M;
  const int64_t Dc = a_is_e ? p.M : p.E;
  const Family family = forced_family();
  const bool tensorcore = on_tensor_cores<P, scalar_t>(p, Da, Dc);
  // Only the tensor-core family keeps segments: a plan for any other ends here (a forced chunked
  // family is never on tensor cores).
  if (p.dry_run && !tensorcore) return {};
  if (p.has_state_io() || p.cu_seqlens != nullptr) {  // the chunked families take states and packed sequences
    // ops.cpp refuses such calls before anything is allocated; this guards the kernels' buckets.
    TORCH_CHECK(Da <= kMaxChunkedRows, "fast_causal_attn: states and cu_seqlens on CUDA support head dims up to ",
                int64_t(kMaxChunkedRows), ", got E = ", p.E, ", M = ", p.M);
    if (tensorcore) return run_on_tensor_cores<P, scalar_t>(p, Da, Dc, stream);
    run_chunked<P, scalar_t>(p, Da, Dc, stream);
    return {};
  }
  if (family == Family::Chunked && Da <= kMaxChunkedRows) {
    run_chunked<P, scalar_t>(p, Da, Dc, stream);
  } else if (tensorcore) {
    return run_on_tensor_cores<P, scalar_t>(p, Da, Dc, stream);
  } else {
    run_recurrent<P, scalar_t>(p, Da, Dc, stream);
  }
  return {};
}

// Whether the normalized dq pass makes dO . O itself (KernelParams::dots_in_grad_q, launch_backward_cuda):
// where it runs on the wgmma kernels (as run_pass sends it) in one column tile (E <= 64, or <= 128
// on two 16-bit warpgroups), so that each row's dot is made once (with more tiles each would read
// O again, where backward_prepare_kernel reads dO and O once for all), with all of dO's columns in
// a block: 16-bit at up to two atoms (M <= 128; wgmma_product_kernel's kMakesDots), float32 at one
// part (M <= 64; wgmma_tf32_product_kernel's kMakesDots).
template <typename scalar_t>
bool grad_q_makes_dots(const KernelParams& params) {
  if constexpr (!kWgmmaInput<scalar_t> && !std::is_same_v<scalar_t, float>) {
    (void)params;
    return false;
  } else {
    const KernelParams p = with_state_io<Pass::GradQ>(params);
    const int64_t Da = p.M, Dc = p.E;  // (run_pass's, dq's a is dO)
    if (!(p.normalize && on_tensor_cores<Pass::GradQ, scalar_t>(p, Da, Dc) && on_wgmma<Pass::GradQ, scalar_t>(p, Da, Dc) &&
          wgmma_column_tiles<Pass::GradQ, scalar_t>(Da, Dc, true) == 1)) {
      return false;
    }
    if constexpr (std::is_same_v<scalar_t, float>) {
      return Da <= wgmma::C;
    } else {
      return wgmma_pass_layout<Pass::GradQ, scalar_t>(Da, Dc, true).atoms <= 2;
    }
  }
}

// Whether pass P, with the state's Da rows and Dc columns, runs on the recurrent family (see run_pass).
template <Pass P, typename scalar_t>
bool on_recurrent(const KernelParams& p, int64_t Da, int64_t Dc) {
  return !(forced_family() == Family::Chunked && Da <= kMaxChunkedRows) && !on_tensor_cores<P, scalar_t>(p, Da, Dc);
}

// The gradients of k and v in one pass, where both would run in the same family, without packed
// sequences, and without states in or out but on the 16-bit wgmma kernels (with_state_io's GradKV;
// elsewhere those keep the two passes; bf16 1,16,32768,128 with a state: the two reverse passes
// 0.284 + 0.196 ms, the fused pass without one 0.396, H100, RESULTS.md, fifty-first session):
//  - Hopper's wgmma, 16-bit, E, M <= 128, where wgmma_takes (wgmma_grad_kv_kernel, and above 64
//    wgmma_grad_kv_wide_kernel: the state dO^T q feeds both gradients; bf16 8,16,2048,64 kernel
//    79 us against the fused mma.sync pass's 110, 8,16,2048,128 149 us against the two mma.sync
//    passes' 326; RESULTS.md, seventeenth and eighteenth sessions); above 128 (where its state
//    would not fit a block) the two passes, on wgmma_product_kernel as reverse passes;
//  - float32 on Hopper's wgmma, E, M <= 64, where wgmma_takes: two reverse passes of the float32
//    wgmma kernel (GradK, GradV), dv from dk's segment starts (launch_backward_cuda), at every
//    length. H200 fwd+bwd ms, CUDA graph replay, two wgmma passes / fused mma.sync (RESULTS.md,
//    twenty-first session, call 1): 8,16,2048,64 (128 pairs, one segment) 0.573 / 0.645;
//    4,16,8192,64 (64 pairs, 2 segments) 1.312 / 1.360; 2,4,8192,64 (8 pairs, 16 segments) 0.239
//    / 0.249. (Before dv took dk's starts, each reverse pass ran its own state-only launch and
//    scan, and the fused pass won in segments: 1.418 / 1.362, 0.267 / 0.249, twentieth session.)
//    Under normalize too (every M up to 256, wgmma_takes), H100 fwd+bwd ms, the fused mma.sync pass
//    (or recurrent) / two wgmma passes: 8,16,2048,64 0.807 / 0.615; 4,16,8192,64 1.611 / 1.246;
//    8,16,2048,128 (recurrent) 2.239 / 1.545 (RESULTS.md, fifty-eighth session); 2,8,4096,64,256
//    (mma.sync) 1.82 / 0.71 (fifty-ninth);
//  - tensor cores, E, M <= 64 (Pass::GradKV, see tensorcore_product.cuh): faster than the two
//    passes at every shape it takes (H200 fwd+bwd ms, fused / two passes: bf16 8,16,2048,64 0.368
//    / 0.438, 4,16,8192,64 0.594 / 0.685; fp32 8,16,2048,64 1.511 / 1.552, 2,4,8192,64 0.461 /
//    0.511), so on by default;
//  - recurrent, float32, E and M in (64, 128] (recurrent_grad_kv_kernel; smaller ones only when
//    forced): one block a (batch, head) for the whole state, where the two passes each run two
//    blocks of 64 columns: 8,16,2048,128 fwd+bwd 3.18 ms fused / 4.22 two passes (fast-transformers
//    3.89 in the same run). Where both passes are recurrent at these E, M by default the pairs
//    fill more than half the multiprocessors (fewer take tensor cores); when the recurrent family
//    is forced with fewer, the two passes split time into segments and keep them.
// FAST_CAUSAL_ATTN_FUSED_GRAD_KV=0 runs the two passes, =1 the fused one wherever it can run
// (tests compare them). Returns whether it ran.
template <typename scalar_t>
bool run_grad_kv(const KernelParams& p, cudaStream_t stream) {
  const char* fused = std::getenv("FAST_CAUSAL_ATTN_FUSED_GRAD_KV");
  if (fused != nullptr && std::strcmp(fused, "0") == 0) return false;
  const bool forced = fused != nullptr && std::strcmp(fused, "1") == 0;
  if (p.cu_seqlens != nullptr) return false;
  const bool states = with_state_io<Pass::GradK>(p).has_state_io() || with_state_io<Pass::GradV>(p).has_state_io();
  // Both passes' (Da, Dc): dk's (M, E), dv's (E, M).
  if constexpr (kWgmmaInput<scalar_t>) {
    const KernelParams s = with_state_io<Pass::GradKV>(p);
    if (forced_family() == Family::Default && wgmma_takes<Pass::GradKV, scalar_t>(s, p.M, p.E)) {
      launch_wgmma<Pass::GradKV, scalar_t>(s, p.M, p.E, stream);
      return true;
    }
  }
  if (states) return false;  // the other fused passes take no state
  if constexpr (std::is_same_v<scalar_t, float>) {  // float32 on wgmma: dk and dv as two reverse passes
    if (!forced && forced_family() == Family::Default && wgmma_takes<Pass::GradK, scalar_t>(p, p.M, p.E) &&
        wgmma_takes<Pass::GradV, scalar_t>(p, p.E, p.M)) {
      return false;
    }
  }
  if constexpr (kTensorCoreInput<scalar_t>) {
    if (p.E <= 64 && p.M <= 64 && on_tensor_cores<Pass::GradK, scalar_t>(p, p.M, p.E) &&
        on_tensor_cores<Pass::GradV, scalar_t>(p, p.E, p.M)) {
      launch_tensorcore<Pass::GradKV, scalar_t, 64, 64>(p, p.M, p.E, stream);  // the dk pass's Da, Dc
      return true;
    }
  }
  if constexpr (std::is_same_v<scalar_t, float>) {
    const bool by_default = p.E > 64 && p.M > 64 && 2 * p.B * p.H > multiprocessor_count();
    if (p.E <= kMaxFusedRecurrentDim && p.M <= kMaxFusedRecurrentDim && on_recurrent<Pass::GradK, scalar_t>(p, p.M, p.E) &&
        on_recurrent<Pass::GradV, scalar_t>(p, p.E, p.M) && (forced || by_default)) {
      run_recurrent_grad_kv<scalar_t>(p, stream);
      return true;
    }
  }
  return false;
}

// Whether the backward makes dk, dv and dq in one reverse pass (wgmma_grad_kv_kernel's kWithDq:
// q, k, v and dO read once, 7 tensors where dk-with-dv and the dq pass move 10) from the forward's
// segment ends, which the forward then keeps (KernelParams::one_pass, segment_ends; under
// normalize the key sum's ends beside): 16-bit, E and M up to 64, no packed sequences, where dk
// with dv runs on the wgmma kernel
// (run_grad_kv). It runs in the forward's time segments, dq's state in each taken down from its
// segment's end, D's from the segments after it as dk-with-dv's (one launch's look-back, or the
// state-only launch and the scan).
// Measured: in one segment (H100, RESULTS.md, sixty-second session) fwd+bwd bf16 8,16,2048,64
// 0.178 -> 0.149 ms, 16,16,2048,64 0.335 -> 0.277, 4,16,8192,64 (64 pairs, one block each over
// 128 chunks) 0.408 -> 0.380; float16 alike but at 4,16,8192,64, 0.412 -> 0.425 (dq's product
// with T's second part, which the long chain did not hide). The prototype in segments, each
// segment's starts given (untimed): bf16 4,16,8192,64 in 2 segments 0.188 against the one pass's
// 0.231 in one; 2,4,8192,64 in 16 0.028 against the two kernels' 0.052; 1,8,16384,64 0.051
// against 0.086. In the library (H100, sixty-second session; kernels' ms, one pass against
// dk-with-dv + dq): bf16 8,16,2048,64 0.090 / 0.117, 4,16,8192,64 (4 segments) 0.209 / 0.259,
// 2,4,8192,64 (16) 0.040 / 0.050, 8,16,2048,64,32 0.073 / 0.093; float16 alike. So it runs at
// every pair count. In more than KernelParams::kMaxOnePassSegments (16) of the forward's
// segments each of its segments spans several of them (one_pass_span): at 1,8,16384,64 the
// forward's 32 (three launches, a state-only launch on the three-warpgroup kernel) took 0.144 ms
// of GPU time fwd+bwd against the two passes' 0.138 (float16 0.148 against 0.140); in 16 of two
// each, in one launch, 0.123 (float16 0.124; H100, sixty-third session). Where those spanning
// segments' blocks fill less than half the multiprocessors (1,4,32768,64: 64 blocks, as fast as
// the two passes in bf16, 6% slower in float16), the forward keeps its starts and the backward
// runs the two passes (keeps_one_pass_ends in kernel_common.cuh). Under normalize (dq's extra
// row from the key sum's ends, kept beside; three launches in segments; dO . O by
// backward_prepare_kernel) in bfloat16 only: the backward's kernels, ms, two passes -> one pass
// (H100, sixty-fourth session), bf16 8,16,2048,64 0.147 -> 0.124, 4,16,8192,64 0.308 -> 0.305,
// 2,4,8192,64 0.062 -> 0.058; float16 0.149 -> 0.142, 0.310 -> 0.335, 0.064 -> 0.065 (its one
// pass 12% slower than bfloat16's at 4,16,8192,64, where the plain one passes differ by 2%: not
// yet profiled). Its producer makes dO . O in one segment (one_pass_makes_dots), and there
// float16's one pass is faster than its two passes too (H100, RESULTS.md, sixty-sixth session,
// call 2, GPU ms fwd+bwd at 8,16,2048,64: 0.178 against 0.209), so float16 takes it under
// normalize where the forward runs in one segment (wgmma_forward_segments), and in segments runs
// the two passes.
// FAST_CAUSAL_ATTN_ONE_PASS_BACKWARD=0 turns it off; =1 takes it wherever it can run, float16
// under normalize in segments too.
// A function of the shapes, the dtype, the device and the environment (no state: wgmma_takes on
// p as given, its pass's states not set), so that the forward and the backward decide alike;
// where the backward's states keep the kernel off after all, launch_backward_cuda runs the two
// passes.
template <typename scalar_t>
bool one_pass_backward(const KernelParams& p) {
  if constexpr (!kWgmmaInput<scalar_t>) {
    (void)p;
    return false;
  } else {
    const char* switch_ = std::getenv("FAST_CAUSAL_ATTN_ONE_PASS_BACKWARD");
    if (switch_ != nullptr && std::strcmp(switch_, "0") == 0) return false;
    const bool forced = switch_ != nullptr && std::strcmp(switch_, "1") == 0;
    const char* fused = std::getenv("FAST_CAUSAL_ATTN_FUSED_GRAD_KV");
    if (fused != nullptr && std::strcmp(fused, "0") == 0) return false;
    if (p.cu_seqlens != nullptr || p.E > 64 || p.M > 64 || forced_family() != Family::Default) return false;
    if (p.normalize && std::is_same_v<scalar_t, at::Half> && !forced && wgmma_forward_segments<scalar_t>(p) != 1) {
      return false;
    }
    return wgmma_takes<Pass::GradKV, scalar_t>(p, p.M, p.E);
  }
}

// Whether the normalized one pass's producer makes dO . O (wgmma_grad_kv_kernel's kProducerDots:
// its producer at 88 registers, the consumers at 208, where the other instance has 56 and 224),
// backward_prepare_kernel otherwise: where the one pass runs in one segment (the forward's
// `forward_segments`). Measured (H100, RESULTS.md; the one pass's kernel with its dots against it
// without and backward_prepare_kernel, ms): in one segment, bf16 8,16,2048,64 0.114 against 0.126
// (sixty-sixth session, call 2), float16 0.118 against 0.138 (sixty-fifth); in segments slower
// (sixty-fifth): bf16 4,16,8192,64 0.323 against 0.302, 1,8,16384,64 0.102 against 0.093 (the
// state-only blocks read O for their own chunks too: at four segments O read 1.75 times).
// bfloat16 reading O a chunk ahead did not change that (sixty-seventh session, the whole
// normalized fwd+bwd's kernels with the dots in segments against without): 4,16,8192,64 0.460
// against 0.461, 1,8,16384,64 0.179 against 0.174.
inline bool one_pass_makes_dots(int64_t forward_segments) { return forward_segments == 1; }

template <Pass P>
ForwardSegments run_pass_for_dtype(const KernelParams& p, cudaStream_t stream) {
  ForwardSegments kept;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p.dtype, "fast_causal_attn (CUDA)",
                                  [&] { kept = run_pass<P, scalar_t>(p, stream); });
  return kept;
}

// One compile unit each (csrc/cuda/pass_*.cu), so that builds run in parallel.
ForwardSegments run_forward_pass(const KernelParams& p, cudaStream_t stream);
void run_grad_q_pass(const KernelParams& p, cudaStream_t stream);
bool grad_q_pass_makes_dots(const KernelParams& p);  // grad_q_makes_dots for p's dtype
ForwardSegments run_grad_k_pass(const KernelParams& p, cudaStream_t stream);  // dk's segment starts, where kept
void run_grad_v_pass(const KernelParams& p, cudaStream_t stream);
bool run_grad_kv_pass(const KernelParams& p, cudaStream_t stream);  // false: run the two passes
bool one_pass_backward_takes(const KernelParams& p);  // one_pass_backward for p's dtype

}  // namespace cuda
}  // namespace fast_causal_attn
