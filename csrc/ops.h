// Host side of the ops: input checks, output allocation and params setup, shared by every backend.
// A backend supplies only a launcher that runs its kernels on filled-in params.
#pragma once

#include <tuple>

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>

#include "causal_attn.h"

namespace fast_causal_attn {

// What a segmented forward hands its backward besides the outputs: the state each time segment
// starts from (the sum of the segments before it), [N * H, segments, E, M], and its key sums
// [N * H, segments, E] (normalize), in the accumulation dtype. The dq pass's
// state is the transpose of the forward's (see BackwardParams), so that its segments can start
// from these instead of summing K^T V again. Undefined where the forward kept none (not asked to
// (keep_segments), one segment, the CPU, families other than the tensor-core one, whose segments
// are 64 timesteps apart). Where the backward will run in one pass (16-bit, E and M up to 64:
// one_pass_backward in csrc/cuda/dispatch.cuh): each segment's end instead, one segment or more
// (the initial state plus the sum of K^T V up to the segment's end), from which that pass takes
// dq's state down in the same segments.
struct ForwardSegments {
  at::Tensor kv, k_sum;
  int64_t count = 0;  // a plan's (plan_forward_segments): the segments kv would hold, 0 for none
};

// How many segments a forward of these shapes keeps with keep_segments (the S of its
// segment_kv), without running it: torch.compile's fake kernel asks ahead, so that S is a
// static size (an unbacked one keeps CUDA graphs off the graph). A function of ForwardParams'
// shapes, dtype and flags (pointers and strides unused), the device and the environment's
// switches; the forward itself decides from exactly these (see launch_tensorcore). 0 on the CPU
// and in builds without CUDA.
int64_t plan_forward_segments(const ForwardParams& p, int device);

using ForwardLauncher = ForwardSegments (*)(const ForwardParams&);
using BackwardLauncher = void (*)(const BackwardParams&);

// Returns (out, den, final_kv, final_k_sum, segment_kv, segment_k_sum): out in q's layout and
// dtype; den [B, H, L] in the accumulation dtype when normalize; the final state [N, H, E, M] and
// [N, H, E] in the accumulation dtype when return_final_state (N = B, or the number of cu_seqlens
// sequences); with keep_segments, the segment starts (see ForwardSegments) as [N * H, S, E, M] and
// [N * H, S, E], S = 0 where there are none (always without keep_segments). What is not asked for
// comes back empty.
using ForwardResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
ForwardResult causal_attn_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& initial_kv,
    const c10::optional<at::Tensor>& initial_k_sum, const c10::optional<at::Tensor>& cu_seqlens, double scale,
    bool normalize, double eps, c10::string_view layout, bool return_final_state, bool keep_segments,
    ForwardLauncher launch);

// Returns (grad_q, grad_k, grad_v, grad_initial_kv, grad_initial_k_sum), the first three in their
// input's layout and dtype, the last two empty without an initial state. out and den are the
// forward's results, needed only when normalize; grad_final_* may be absent (zero). segment_kv and
// segment_k_sum are the forward's last two results, or absent (the dq pass then sums its segments
// itself).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> causal_attn_backward(
    const at::Tensor& grad_out, const c10::optional<at::Tensor>& grad_final_kv,
    const c10::optional<at::Tensor>& grad_final_k_sum, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& out, const c10::optional<at::Tensor>& den,
    const c10::optional<at::Tensor>& initial_kv, const c10::optional<at::Tensor>& initial_k_sum,
    const c10::optional<at::Tensor>& cu_seqlens, double scale, bool normalize, c10::string_view layout,
    const c10::optional<at::Tensor>& segment_kv, const c10::optional<at::Tensor>& segment_k_sum,
    BackwardLauncher launch);

// A backend's op implementations are these two, instantiated with its launchers:
//   m.impl("forward", &forward_op<&launch_forward_cpu>);
template <ForwardLauncher launch>
ForwardResult forward_op(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& initial_kv,
    const c10::optional<at::Tensor>& initial_k_sum, const c10::optional<at::Tensor>& cu_seqlens, double scale,
    bool normalize, double eps, c10::string_view layout, bool return_final_state, bool keep_segments) {
  return causal_attn_forward(q, k, v, initial_kv, initial_k_sum, cu_seqlens, scale, normalize, eps, layout,
                             return_final_state, keep_segments, launch);
}

template <BackwardLauncher launch>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_op(
    const at::Tensor& grad_out, const c10::optional<at::Tensor>& grad_final_kv,
    const c10::optional<at::Tensor>& grad_final_k_sum, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& out, const c10::optional<at::Tensor>& den,
    const c10::optional<at::Tensor>& initial_kv, const c10::optional<at::Tensor>& initial_k_sum,
    const c10::optional<at::Tensor>& cu_seqlens, double scale, bool normalize, c10::string_view layout,
    const c10::optional<at::Tensor>& segment_kv, const c10::optional<at::Tensor>& segment_k_sum) {
  return causal_attn_backward(grad_out, grad_final_kv, grad_final_k_sum, q, k, v, out, den, initial_kv,
                              initial_k_sum, cu_seqlens, scale, normalize, layout, segment_kv, segment_k_sum, launch);
}

}  // namespace fast_causal_attn
