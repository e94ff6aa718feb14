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

// Returns (out, den): out in q's layout and dtype; den [B, H, L] in the accumulation dtype when
// normalize, else an empty tensor.
std::tuple<at::Tensor, at::Tensor> causal_attn_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, bool normalize,
    double eps, c10::string_view layout, ForwardLauncher launch);

// Returns (grad_q, grad_k, grad_v), each in its input's layout and dtype. out and den are the
// forward's results and are needed only when normalize.
std::tuple<at::Tensor, at::Tensor, at::Tensor> causal_attn_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& out, const c10::optional<at::Tensor>& den, double scale,
    bool normalize, c10::string_view layout, BackwardLauncher launch);

// A backend's op implementations are these two, instantiated with its launchers:
//   m.impl("forward", &forward_op<&launch_forward_cpu>);
template <ForwardLauncher launch>
std::tuple<at::Tensor, at::Tensor> forward_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                              double scale, bool normalize, double eps, c10::string_view layout) {
  return causal_attn_forward(q, k, v, scale, normalize, eps, layout, launch);
}

template <BackwardLauncher launch>
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_op(const at::Tensor& grad_out, const at::Tensor& q,
                                                           const at::Tensor& k, const at::Tensor& v,
                                                           const c10::optional<at::Tensor>& out,
                                                           const c10::optional<at::Tensor>& den, double scale,
                                                           bool normalize, c10::string_view layout) {
  return causal_attn_backward(grad_out, q, k, v, out, den, scale, normalize, layout, launch);
}

}  // namespace fast_causal_attn
