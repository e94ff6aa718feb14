// The differentiable op fast_causal_attn::attention: the forward op, and the backward op as its
// gradient, in a C++ autograd node. The public API calls it wherever a gradient can flow.
//
// Why C++: the autograd Function this replaces was Python, forward and backward (the backward's
// Python ran on autograd's device thread), and on the H200 machine's host a bf16 8,16,2048,64
// fwd+bwd took 0.27 ms to issue against 0.150 ms of GPU work: the call was host-bound. Measured
// on this repo's CPU machine (1,1,4,8,8, one thread, torch.autograd.grad of q, k and v, the two
// interleaved): fwd+bwd 45.3 us through the Python Function, 35.7 us through this node, 21.2 us for
// a builtin `v * 2` (benchmarks/RESULTS.md, twenty-fourth session).
#include <string>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "ops.h"

namespace fast_causal_attn {
namespace {

using at::Tensor;
using c10::optional;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using BackwardResult = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;

// The two ops through the dispatcher, so that each call reaches the device's kernel, or the fake
// kernel while torch.compile traces (the ops' schemas: ops.cpp).
ForwardResult call_forward(const Tensor& q, const Tensor& k, const Tensor& v, const optional<Tensor>& initial_kv,
                           const optional<Tensor>& initial_k_sum, const optional<Tensor>& cu_seqlens, double scale,
                           bool normalize, double eps, c10::string_view layout, bool return_final_state,
                           bool keep_segments) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fast_causal_attn::forward", "")
                             .typed<ForwardResult(const Tensor&, const Tensor&, const Tensor&, const optional<Tensor>&,
                                                  const optional<Tensor>&, const optional<Tensor>&, double, bool,
                                                  double, c10::string_view, bool, bool)>();
  return op.call(q, k, v, initial_kv, initial_k_sum, cu_seqlens, scale, normalize, eps, layout, return_final_state,
                 keep_segments);
}

BackwardResult call_backward(const Tensor& grad_out, const optional<Tensor>& grad_final_kv,
                             const optional<Tensor>& grad_final_k_sum, const Tensor& q, const Tensor& k,
                             const Tensor& v, const optional<Tensor>& out, const optional<Tensor>& den,
                             const optional<Tensor>& initial_kv, const optional<Tensor>& initial_k_sum,
                             const optional<Tensor>& cu_seqlens, double scale, bool normalize,
                             c10::string_view layout, const optional<Tensor>& segment_kv,
                             const optional<Tensor>& segment_k_sum) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fast_causal_attn::backward", "")
          .typed<BackwardResult(const Tensor&, const optional<Tensor>&, const optional<Tensor>&, const Tensor&,
                                const Tensor&, const Tensor&, const optional<Tensor>&, const optional<Tensor>&,
                                const optional<Tensor>&, const optional<Tensor>&, const optional<Tensor>&, double,
                                bool, c10::string_view, const optional<Tensor>&, const optional<Tensor>&)>();
  return op.call(grad_out, grad_final_kv, grad_final_k_sum, q, k, v, out, den, initial_kv, initial_k_sum, cu_seqlens,
                 scale, normalize, layout, segment_kv, segment_k_sum);
}

optional<Tensor> if_defined(const Tensor& t) { return t.defined() ? optional<Tensor>(t) : c10::nullopt; }

// What the backward reads, in the order saved.
enum Saved { kQ, kK, kV, kOut, kDen, kInitialKv, kInitialKSum, kCuSeqlens, kSegmentKv, kSegmentKSum, kSavedCount };

// The gradients that the backward returns under create_graph=True, joined to q, k, v and the
// initial state by a node that raises when anything differentiates through them. (torch's own
// DelayedError node is held by std::shared_ptr in some torch versions and c10::intrusive_ptr in
// others; a Function builds its node the same way in all.)
struct RefuseSecondDerivative : public torch::autograd::Function<RefuseSecondDerivative> {
  // grads: the defined ones
  static variable_list forward(AutogradContext*, at::TensorList grads, const Tensor&, const Tensor&, const Tensor&,
                               const optional<Tensor>&, const optional<Tensor>&) {
    return variable_list(grads.begin(), grads.end());
  }
  static variable_list backward(AutogradContext*, variable_list) {
    TORCH_CHECK(false, "fast_causal_attn: the backward is not differentiable (a second derivative of causal "
                "linear attention is not supported)");
    return {};
  }
};

struct Attention : public torch::autograd::Function<Attention> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                               const optional<Tensor>& initial_kv, const optional<Tensor>& initial_k_sum,
                               const optional<Tensor>& cu_seqlens, double scale, bool normalize, double eps,
                               c10::string_view layout, bool return_final_state, bool keep_segments) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, den, final_kv, final_k_sum, segment_kv, segment_k_sum] =
        call_forward(q, k, v, initial_kv, initial_k_sum, cu_seqlens, scale, normalize, eps, layout,
                     return_final_state, keep_segments);
    // the gradients of outputs nothing used stay undefined (no zeros made for them)
    ctx->set_materialize_grads(false);
    // out and den only where the normalized gradients need them
    ctx->save_for_backward({q, k, v, normalize ? out : Tensor(), normalize ? den : Tensor(),
                            initial_kv.value_or(Tensor()), initial_k_sum.value_or(Tensor()),
                            cu_seqlens.value_or(Tensor()), segment_kv, segment_k_sum});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["normalize"] = normalize;
    ctx->saved_data["layout"] = std::string(layout);
    ctx->saved_data["return_final_state"] = return_final_state;
    return {out, final_kv, final_k_sum};
  }

  // grads: those of (out, final_kv, final_k_sum), each undefined where nothing used it.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    TORCH_INTERNAL_ASSERT(saved.size() == kSavedCount);
    // create_graph=True turns grad mode on here. The backward is not itself differentiable: its
    // results then carry a node that refuses a second differentiation, instead of gradients that
    // would silently be wrong.
    const bool differentiable = at::GradMode::is_enabled();
    variable_list result(12);  // one per forward input; the non-tensor ones stay undefined
    {
      at::NoGradGuard no_grad;
      const Tensor& q = saved[kQ];
      const Tensor& v = saved[kV];
      // without return_final_state the final state's outputs are empty placeholders: a gradient
      // for them (torch.compile gives zeros of their empty shape) is no gradient
      if (!ctx->saved_data["return_final_state"].toBool()) grads[1] = grads[2] = Tensor();
      if (!grads[0].defined() && !grads[1].defined() && !grads[2].defined()) return result;
      // Only the final state used: the output's gradient is zero
      const Tensor grad_out = grads[0].defined() ? grads[0] : at::zeros_like(v);
      // the backward takes the final state's gradient as a pair (one alone: the other zero)
      Tensor grad_kv1 = grads[1], grad_k_sum1 = grads[2];
      // (kv [N, H, E, M], k_sum [N, H, E])
      if (!grad_kv1.defined() && grad_k_sum1.defined()) {
        grad_kv1 = grad_k_sum1.new_zeros({grad_k_sum1.size(0), grad_k_sum1.size(1), grad_k_sum1.size(2), v.size(-1)});
      } else if (grad_kv1.defined() && !grad_k_sum1.defined()) {
        grad_k_sum1 = grad_kv1.new_zeros(grad_kv1.sizes().slice(0, 3));
      }
      const std::string layout = ctx->saved_data["layout"].toStringRef();
      auto [grad_q, grad_k, grad_v, grad_kv0, grad_k_sum0] = call_backward(
          grad_out, if_defined(grad_kv1), if_defined(grad_k_sum1), q, saved[kK], v, if_defined(saved[kOut]),
          if_defined(saved[kDen]), if_defined(saved[kInitialKv]), if_defined(saved[kInitialKSum]),
          if_defined(saved[kCuSeqlens]), ctx->saved_data["scale"].toDouble(), ctx->saved_data["normalize"].toBool(),
          layout, if_defined(saved[kSegmentKv]), if_defined(saved[kSegmentKSum]));
      result[0] = grad_q, result[1] = grad_k, result[2] = grad_v;
      if (saved[kInitialKv].defined()) result[3] = grad_kv0, result[4] = grad_k_sum0;
    }
    if (differentiable) {
      variable_list defined;
      for (const Tensor& t : result) {
        if (t.defined()) defined.push_back(t);
      }
      variable_list joined = RefuseSecondDerivative::apply(at::TensorList(defined), saved[kQ], saved[kK], saved[kV],
                                                           if_defined(saved[kInitialKv]),
                                                           if_defined(saved[kInitialKSum]));
      auto next = joined.begin();
      for (Tensor& t : result) {
        if (t.defined()) t = *next++;
      }
    }
    return result;
  }
};

std::tuple<Tensor, Tensor, Tensor> attention_autograd(const Tensor& q, const Tensor& k, const Tensor& v,
                                                      const optional<Tensor>& initial_kv,
                                                      const optional<Tensor>& initial_k_sum,
                                                      const optional<Tensor>& cu_seqlens, double scale, bool normalize,
                                                      double eps, c10::string_view layout, bool return_final_state,
                                                      bool keep_segments) {
  variable_list r = Attention::apply(q, k, v, initial_kv, initial_k_sum, cu_seqlens, scale, normalize, eps, layout,
                                     return_final_state, keep_segments);
  return {r[0], r[1], r[2]};
}

// Where autograd is not in the dispatch (inference tensors, tracing below autograd): the forward.
std::tuple<Tensor, Tensor, Tensor> attention_forward_only(const Tensor& q, const Tensor& k, const Tensor& v,
                                                          const optional<Tensor>& initial_kv,
                                                          const optional<Tensor>& initial_k_sum,
                                                          const optional<Tensor>& cu_seqlens, double scale,
                                                          bool normalize, double eps, c10::string_view layout,
                                                          bool return_final_state, bool keep_segments) {
  auto [out, den, final_kv, final_k_sum, segment_kv, segment_k_sum] =
      call_forward(q, k, v, initial_kv, initial_k_sum, cu_seqlens, scale, normalize, eps, layout, return_final_state,
                   keep_segments);
  return {out, final_kv, final_k_sum};
}

}  // namespace

TORCH_LIBRARY_IMPL(fast_causal_attn, Autograd, m) { m.impl("attention", &attention_autograd); }
TORCH_LIBRARY_IMPL(fast_causal_attn, CompositeExplicitAutograd, m) { m.impl("attention", &attention_forward_only); }

}  // namespace fast_causal_attn
