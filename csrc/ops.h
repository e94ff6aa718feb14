// Host side of the ops: input checks, output allocation and params setup, shared by every backend.
// A backend supplies only a launcher that runs its kernels on filled-in params.
#pragma once

#include <tuple>

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>

#include "causal_attn.h"

namespace fast_causal_attn {

using ForwardLauncher = void (*)(const ForwardParams&);
using BackwardLauncher = void (*)(const BackwardParams&);

// Returns (out, den, final_kv, final_k_sum): out in q's layout and dtype; den [B, H, L] in the
// accumulation dtype when normalize; the final state [N, H, E, M] and [N, H, E] in the
// accumulation dtype when return_final_state (N = B, or the number of cu_seqlens sequences). What
// is not asked for comes back empty.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> causal_attn_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& initial_kv,
    const c10::optional<at::Tensor>& initial_k_sum, const c10::optional<at::Tensor>& cu_seqlens, double scale,
    bool normalize, double eps, c10::string_view layout, bool return_final_state, ForwardLauncher launch);

// Returns (grad_q, grad_k, grad_v, grad_initial_kv, grad_initial_k_sum), the first three in their
// input's layout and dtype, the last two empty without an initial state. out and den are the
// forward's results, needed only when normalize; grad_final_* may be absent (zero).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> causal_attn_backward(
    const at::Tensor& grad_out, const c10::optional<at::Tensor>& grad_final_kv,
    const c10::optional<at::Tensor>& grad_final_k_sum, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& out, const c10::optional<at::Tensor>& den,
    const c10::optional<at::Tensor>& initial_kv, const c10::optional<at::Tensor>& initial_k_sum,
    const c10::optional<at::Tensor>& cu_seqlens, double scale, bool normalize, c10::string_view layout,
    BackwardLauncher launch);

// A backend's op implementations are these two, instantiated with its launchers:
//   m.impl("forward", &forward_op<&launch_forward_cpu>);
template <ForwardLauncher launch>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward_op(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& initial_kv,
    const c10::optional<at::Tensor>& initial_k_sum, const c10::optional<at::Tensor>& cu_seqlens, double scale,
    bool normalize, double eps, c10::string_view layout, bool return_final_state) {
  return causal_attn_forward(q, k, v, initial_kv, initial_k_sum, cu_seqlens, scale, normalize, eps, layout,
                             return_final_state, launch);
}

template <BackwardLauncher launch>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_op(
    const at::Tensor& grad_out, const c10::optional<at::Tensor>& grad_final_kv,
    const c10::optional<at::Tensor>& grad_final_k_sum, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& out, const c10::optional<at::Tensor>& den,
    const c10::optional<at::Tensor>& initial_kv, const c10::optional<at::Tensor>& initial_k_sum,
    const c10::optional<at::Tensor>& cu_seqlens, double scale, bool normalize, c10::string_view layout) {
  return causal_attn_backward(grad_out, grad_final_kv, grad_final_k_sum, q, k, v, out, den, initial_kv,
                              initial_k_sum, cu_seqlens, scale, normalize, layout, launch);
}

}  // namespace fast_causal_attn
