// Op schemas, input checks, output allocation and params setup. No kernels here: each backend
// registers its implementation in its own directory (csrc/cpu, csrc/cuda) through the two entry
// points declared in ops.h.
#include "ops.h"

#include <Python.h>

#include <cmath>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

namespace fast_causal_attn {
namespace {

enum class Layout { BHLD, BLHD };

Layout parse_layout(c10::string_view layout) {
  if (layout == "bhld") return Layout::BHLD;
  if (layout == "blhd") return Layout::BLHD;
  TORCH_CHECK(false, "fast_causal_attn: layout must be 'bhld' ([B, H, L, D]) or 'blhd' ([B, L, H, D]), got '",
              std::string(layout), "'");
}

const char* dims_of(Layout layout, char head_dim) {
  if (layout == Layout::BHLD) return head_dim == 'E' ? "[B, H, L, E]" : "[B, H, L, M]";
  return head_dim == 'E' ? "[B, L, H, E]" : "[B, L, H, M]";
}

// The [B, H, L, D] view of a tensor given in `layout`: a transpose, never a copy.
at::Tensor as_bhld(const at::Tensor& t, Layout layout) {
  return layout == Layout::BLHD ? t.transpose(1, 2) : t;
}

// The kernels read rows of D contiguous elements; any other stride costs one copy here. On CUDA a
// row of whole 16-byte vectors (D elements a multiple of 16 bytes) that starts off a 16-byte
// boundary (a view at an odd offset, a row stride that is not whole vectors) is copied too, into
// a fresh tensor, where it starts on one: the kernels then stage every such row 16 bytes at a
// time, and the wgmma kernels have no other path (launch_wgmma checks).
at::Tensor with_contiguous_rows(const at::Tensor& t) {
  const at::Tensor rows = (t.size(-1) <= 1 || t.stride(-1) == 1) ? t : t.contiguous();
  if (!rows.is_cuda() || rows.numel() == 0) return rows;
  const int64_t bytes = rows.element_size();
  if ((rows.size(-1) * bytes) % 16 != 0) return rows;
  bool aligned = reinterpret_cast<uintptr_t>(rows.data_ptr()) % 16 == 0;
  for (int64_t d = 0; d + 1 < rows.dim(); ++d) aligned = aligned && (rows.stride(d) * bytes) % 16 == 0;
  return aligned ? rows : rows.clone(at::MemoryFormat::Contiguous);
}

// A new tensor of `like`'s [B, H, L, D] shape, contiguous in `layout`, returned as its bhld view.
at::Tensor empty_bhld(const at::Tensor& like_bhld, int64_t D, Layout layout) {
  const int64_t B = like_bhld.size(0), H = like_bhld.size(1), L = like_bhld.size(2);
  if (layout == Layout::BLHD) return at::empty({B, L, H, D}, like_bhld.options()).transpose(1, 2);
  return at::empty({B, H, L, D}, like_bhld.options());
}

StridedTensor strided(const at::Tensor& t_bhld) {
  StridedTensor s;
  s.ptr = t_bhld.data_ptr();
  s.stride_b = t_bhld.stride(0);
  s.stride_h = t_bhld.stride(1);
  s.stride_l = t_bhld.stride(2);
  return s;
}

void check_rank(const at::Tensor& t, const char* name, Layout layout, char head_dim) {
  TORCH_CHECK(t.dim() == 4, "fast_causal_attn: ", name, " must be a 4-D tensor ", dims_of(layout, head_dim),
              ", got a ", t.dim(), "-D tensor of shape ", t.sizes());
}

void check_dtype_and_device(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), "fast_causal_attn: ", name,
              " must have the same dtype as q (", q.scalar_type(), "), got ", t.scalar_type());
  TORCH_CHECK(t.device() == q.device(), "fast_causal_attn: ", name, " must be on the same device as q (",
              q.device(), "), got ", t.device());
}

// q, k and v share B, H and L; the message shows them in the caller's layout.
void check_batch_heads_length(const at::Tensor& t, const char* name, const at::Tensor& q, Layout layout) {
  if (t.sizes().slice(0, 3) == q.sizes().slice(0, 3)) return;
  TORCH_CHECK(false, "fast_causal_attn: ", name, " must have the same ",
              layout == Layout::BHLD ? "(B, H, L)" : "(B, L, H)", " as q, got ", t.sizes().slice(0, 3), " for ",
              name, " and ", q.sizes().slice(0, 3), " for q");
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, Layout layout) {
  check_rank(q, "q", layout, 'E');
  check_rank(k, "k", layout, 'E');
  check_rank(v, "v", layout, 'M');
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16,
              "fast_causal_attn: q, k and v must be float32, float64, float16 or bfloat16, got ", dtype);
  check_dtype_and_device(k, "k", q);
  check_dtype_and_device(v, "v", q);
  check_batch_heads_length(k, "k", q, layout);
  check_batch_heads_length(v, "v", q, layout);
  TORCH_CHECK(k.size(3) == q.size(3), "fast_causal_attn: q and k must have the same head dimension E, got ",
              q.size(3), " for q and ", k.size(3), " for k");
  TORCH_CHECK(q.size(3) >= 1, "fast_causal_attn: the head dimension E of q and k must be at least 1, got 0");
  TORCH_CHECK(v.size(3) >= 1, "fast_causal_attn: the head dimension M of v must be at least 1, got 0");
}

void check_scalars(double scale, double eps) {
  TORCH_CHECK(std::isfinite(scale), "fast_causal_attn: scale must be finite, got ", scale);
  TORCH_CHECK(std::isfinite(eps) && eps > 0, "fast_causal_attn: eps must be finite and > 0, got ", eps);
}

at::ScalarType accumulation_dtype(at::ScalarType dtype) {
  return dtype == at::kDouble ? at::kDouble : at::kFloat;
}

void fill_problem(ForwardParams& p, const at::Tensor& qb, const at::Tensor& vb, double scale, bool normalize,
                  double eps) {
  p.dtype = qb.scalar_type();
  p.B = qb.size(0);
  p.H = qb.size(1);
  p.L = qb.size(2);
  p.E = qb.size(3);
  p.M = vb.size(3);
  p.scale = scale;
  p.normalize = normalize;
  p.eps = eps;
  p.num_seqs = p.B;
}

// A [B, H, E, M] or [B, H, E] state tensor: shape, dtype and device, made contiguous.
// N is B, or the number of sequences with cu_seqlens (`varlen`).
at::Tensor checked_state(const at::Tensor& t, const char* name, at::IntArrayRef shape, const at::Tensor& q,
                         bool varlen) {
  const auto dtype = accumulation_dtype(q.scalar_type());
  const char* dims = shape.size() == 4 ? (varlen ? " ([N, H, E, M])" : " ([B, H, E, M])")
                                       : (varlen ? " ([N, H, E])" : " ([B, H, E])");
  TORCH_CHECK(t.sizes() == shape, "fast_causal_attn: ", name, " must have shape ", shape, dims, ", got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == dtype, "fast_causal_attn: ", name, " must be ", dtype, " (the state dtype for ",
              q.scalar_type(), " inputs), got ", t.scalar_type());
  TORCH_CHECK(t.device() == q.device(), "fast_causal_attn: ", name, " must be on the same device as q (", q.device(),
              "), got ", t.device());
  return t.contiguous();
}

// A tensor of `shape` when wanted, else an empty one: the op always returns every output.
at::Tensor empty_if(bool wanted, at::IntArrayRef shape, const at::TensorOptions& options) {
  return wanted ? at::empty(shape, options) : at::empty({0}, options);
}

struct StateShapes {
  std::vector<int64_t> kv, k_sum;
};

// [N, H, E, M] and [N, H, E]: N sequences, the batch entries or the cu_seqlens sequences.
StateShapes state_shapes(const at::Tensor& q_bhld, const at::Tensor& v_bhld, int64_t num_seqs) {
  const int64_t H = q_bhld.size(1), E = q_bhld.size(3), M = v_bhld.size(3);
  return {{num_seqs, H, E, M}, {num_seqs, H, E}};
}

// cu_seqlens as int64 on the CPU, checked against the packed inputs (batch 1, `total` timesteps).
at::Tensor checked_cu_seqlens(const at::Tensor& cu, const at::Tensor& q, int64_t batch, int64_t total) {
  TORCH_CHECK(cu.scalar_type() == at::kInt || cu.scalar_type() == at::kLong,
              "fast_causal_attn: cu_seqlens must be int32 or int64, got ", cu.scalar_type());
  TORCH_CHECK(cu.dim() == 1 && cu.size(0) >= 1,
              "fast_causal_attn: cu_seqlens must be a 1-D tensor [N + 1], got shape ", cu.sizes());
  TORCH_CHECK(cu.device() == q.device(), "fast_causal_attn: cu_seqlens must be on the same device as q (",
              q.device(), "), got ", cu.device());
  TORCH_CHECK(batch == 1, "fast_causal_attn: with cu_seqlens, q, k and v hold the sequences packed along the time "
              "dimension with batch size 1, got batch size ", batch);
  at::Tensor offsets = cu.to(at::kCPU, at::kLong).contiguous();
  const int64_t* c = offsets.data_ptr<int64_t>();
  const int64_t n = offsets.size(0);
  TORCH_CHECK(c[0] == 0, "fast_causal_attn: cu_seqlens must start at 0, got ", c[0]);
  for (int64_t i = 1; i < n; ++i) {
    TORCH_CHECK(c[i] >= c[i - 1], "fast_causal_attn: cu_seqlens must be non-decreasing, got ", c[i - 1], " then ",
                c[i], " at index ", i);
  }
  TORCH_CHECK(c[n - 1] == total, "fast_causal_attn: the last entry of cu_seqlens must be the number of packed "
              "timesteps ", total, ", got ", c[n - 1]);
  return offsets;
}

// The sequences of a call (the batch entries, or cu_seqlens) and its initial state, checked: the
// forward and the backward take them alike.
struct Sequences {
  at::Tensor offsets;  // cu_seqlens as int64 on the CPU, or undefined
  at::Tensor kernel_offsets;  // the same on q's device, for the kernels
  int64_t count = 0;   // N: the state's first dimension
  StateShapes shapes;
  at::Tensor kv0, k_sum0;  // the initial state, contiguous, or undefined

  // A state-shaped argument, checked and made contiguous.
  at::Tensor state(const at::Tensor& t, const char* name, bool kv, const at::Tensor& q) const {
    return checked_state(t, name, kv ? shapes.kv : shapes.k_sum, q, offsets.defined());
  }

  void fill(ForwardParams& p) const {
    if (offsets.defined()) {
      p.cu_seqlens = kernel_offsets.data_ptr<int64_t>();
      p.num_seqs = count;
    }
    if (kv0.defined()) {
      p.initial_kv = kv0.data_ptr();
      p.initial_k_sum = k_sum0.data_ptr();
    }
  }
};

Sequences checked_sequences(const at::Tensor& q, const at::Tensor& qb, const at::Tensor& vb,
                            const c10::optional<at::Tensor>& cu_seqlens, const c10::optional<at::Tensor>& initial_kv,
                            const c10::optional<at::Tensor>& initial_k_sum) {
  Sequences s;
  if (cu_seqlens.has_value()) {
    s.offsets = checked_cu_seqlens(*cu_seqlens, q, qb.size(0), qb.size(2));
    s.kernel_offsets = q.is_cpu() ? s.offsets : s.offsets.to(q.device());
  }
  s.count = s.offsets.defined() ? s.offsets.size(0) - 1 : qb.size(0);
  s.shapes = state_shapes(qb, vb, s.count);
  if (initial_kv.has_value()) {
    s.kv0 = s.state(*initial_kv, "initial_state.kv", true, q);
    s.k_sum0 = s.state(*initial_k_sum, "initial_state.k_sum", false, q);
  }
  return s;
}

// kv and k_sum of a state come together or not at all.
void check_state_pair(const c10::optional<at::Tensor>& kv, const c10::optional<at::Tensor>& k_sum,
                      const char* what) {
  TORCH_CHECK(kv.has_value() == k_sum.has_value(), "fast_causal_attn: ", what,
              " needs both kv and k_sum, got only ", kv.has_value() ? "kv" : "k_sum");
}

// On CUDA only the chunked kernels take states and packed sequences, and their buckets hold head
// dims up to 256.
void check_state_backend(const at::Tensor& q, const at::Tensor& v, bool uses_state, bool uses_cu_seqlens) {
  constexpr int64_t kMaxCudaStateDim = 256;  // kMaxChunkedRows in csrc/cuda/chunked_product.cuh
  const int64_t E = q.size(-1), M = v.size(-1);
  TORCH_CHECK(!(uses_state || uses_cu_seqlens) || !q.is_cuda() || (E <= kMaxCudaStateDim && M <= kMaxCudaStateDim),
              "fast_causal_attn: states and cu_seqlens on CUDA support head dims up to ", kMaxCudaStateDim,
              ", got E = ", E, ", M = ", M);
}

// The forward's segment starts given to the backward (its last two results): [N * H, S, E, M] and
// [N * H, S, E] (or S = 0 there: none kept), accumulation dtype, on q's device. Undefined where
// absent or S = 0 (the dq pass then sums its segments itself); the segment count's fit to L is
// the kernels' to check, which know the segments' step.
ForwardSegments checked_segments(const c10::optional<at::Tensor>& kv, const c10::optional<at::Tensor>& k_sum,
                                 const at::Tensor& qb, const at::Tensor& vb, int64_t num_seqs, const at::Tensor& q) {
  const int64_t pairs = num_seqs * qb.size(1), E = qb.size(3), M = vb.size(3);
  const auto dtype = accumulation_dtype(q.scalar_type());
  auto check = [&](const at::Tensor& t, const char* name, std::vector<int64_t> shape, const char* dims) {
    shape[1] = t.dim() == int64_t(shape.size()) ? t.size(1) : 0;  // any segment count
    TORCH_CHECK(t.sizes() == at::IntArrayRef(shape), "fast_causal_attn: ", name, " must have shape ", dims,
                " with N * H = ", pairs, " (the forward's result), got ", t.sizes());
    TORCH_CHECK(t.scalar_type() == dtype && t.device() == q.device(), "fast_causal_attn: ", name, " must be ", dtype,
                " on ", q.device(), ", got ", t.scalar_type(), " on ", t.device());
    TORCH_CHECK(t.is_contiguous(), "fast_causal_attn: ", name, " must be contiguous (the forward's result)");
  };
  ForwardSegments s;
  if (kv.has_value()) {
    check(*kv, "segment_kv", {pairs, 0, E, M}, "[N * H, S, E, M]");
    if (kv->size(1) > 0) s.kv = *kv;
  }
  if (k_sum.has_value()) {
    check(*k_sum, "segment_k_sum", {pairs, 0, E}, "[N * H, S, E]");
    const int64_t S = s.kv.defined() ? s.kv.size(1) : 0;
    TORCH_CHECK(k_sum->size(1) == 0 || k_sum->size(1) == S, "fast_causal_attn: segment_k_sum must have as many "
                "segments as segment_kv (", S, ") or none, got ", k_sum->size(1));
    if (k_sum->size(1) > 0) s.k_sum = *k_sum;
  }
  return s;
}

}  // namespace

ForwardResult causal_attn_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& initial_kv,
    const c10::optional<at::Tensor>& initial_k_sum, const c10::optional<at::Tensor>& cu_seqlens, double scale,
    bool normalize, double eps, c10::string_view layout_name, bool return_final_state, bool keep_segments,
    ForwardLauncher launch) {
  const Layout layout = parse_layout(layout_name);
  check_scalars(scale, eps);
  check_inputs(q, k, v, layout);
  check_state_pair(initial_kv, initial_k_sum, "initial_state");
  check_state_backend(q, v, initial_kv.has_value() || return_final_state, cu_seqlens.has_value());
  c10::DeviceGuard guard(q.device());

  const at::Tensor qb = with_contiguous_rows(as_bhld(q, layout));
  const at::Tensor kb = with_contiguous_rows(as_bhld(k, layout));
  const at::Tensor vb = with_contiguous_rows(as_bhld(v, layout));
  const Sequences seqs = checked_sequences(q, qb, vb, cu_seqlens, initial_kv, initial_k_sum);
  const auto acc = q.options().dtype(accumulation_dtype(q.scalar_type()));
  const at::Tensor ob = empty_bhld(vb, vb.size(3), layout);
  const at::Tensor den = empty_if(normalize, qb.sizes().slice(0, 3), acc);
  const at::Tensor kv1 = empty_if(return_final_state, seqs.shapes.kv, acc);
  const at::Tensor k_sum1 = empty_if(return_final_state, seqs.shapes.k_sum, acc);
  ForwardSegments kept;
  if (ob.numel() > 0 || kv1.numel() > 0) {
    ForwardParams p;
    fill_problem(p, qb, vb, scale, normalize, eps);
    p.q = strided(qb);
    p.k = strided(kb);
    p.v = strided(vb);
    p.o = strided(ob);
    p.den = normalize ? den.data_ptr() : nullptr;
    seqs.fill(p);
    if (return_final_state) {
      p.final_kv = kv1.data_ptr();
      p.final_k_sum = k_sum1.data_ptr();
    }
    p.keep_segments = keep_segments;
    kept = launch(p);
  }
  // No segments: S = 0, so that the results' ranks never change.
  const int64_t pairs = seqs.count * qb.size(1), E = qb.size(3), M = vb.size(3);
  const at::Tensor segment_kv = kept.kv.defined() ? kept.kv : at::empty({pairs, 0, E, M}, acc);
  // The key sums' starts only under normalize, the one backward that reads them (the mma.sync
  // kernels also sum them for a final state; the wgmma kernels do not: either way S = 0 here).
  const at::Tensor segment_k_sum = kept.k_sum.defined() && normalize ? kept.k_sum : at::empty({pairs, 0, E}, acc);
  return {as_bhld(ob, layout), den, kv1, k_sum1, segment_kv, segment_k_sum};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> causal_attn_backward(
    const at::Tensor& grad_out, const c10::optional<at::Tensor>& grad_final_kv,
    const c10::optional<at::Tensor>& grad_final_k_sum, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& out, const c10::optional<at::Tensor>& den,
    const c10::optional<at::Tensor>& initial_kv, const c10::optional<at::Tensor>& initial_k_sum,
    const c10::optional<at::Tensor>& cu_seqlens, double scale, bool normalize, c10::string_view layout_name,
    const c10::optional<at::Tensor>& segment_kv, const c10::optional<at::Tensor>& segment_k_sum,
    BackwardLauncher launch) {
  const Layout layout = parse_layout(layout_name);
  check_scalars(scale, 1.0);
  check_inputs(q, k, v, layout);
  TORCH_CHECK(grad_out.sizes() == v.sizes(), "fast_causal_attn: grad_out must have the shape of the output ",
              v.sizes(), ", got ", grad_out.sizes());
  check_dtype_and_device(grad_out, "grad_out", q);
  check_state_pair(initial_kv, initial_k_sum, "initial_state");
  check_state_pair(grad_final_kv, grad_final_k_sum, "the gradient of the final state");
  check_state_backend(q, v, initial_kv.has_value() || grad_final_kv.has_value(), cu_seqlens.has_value());
  if (normalize) {
    TORCH_CHECK(out.has_value() && den.has_value(),
                "fast_causal_attn: the backward with normalize=True needs the forward's out and den");
    TORCH_CHECK(out->sizes() == v.sizes(), "fast_causal_attn: out must have the shape ", v.sizes(), ", got ",
                out->sizes());
    check_dtype_and_device(*out, "out", q);
    const auto bhl = as_bhld(q, layout).sizes().slice(0, 3);
    TORCH_CHECK(den->sizes() == bhl, "fast_causal_attn: den must have shape [B, H, L] = ", bhl, ", got ",
                den->sizes());
    TORCH_CHECK(den->scalar_type() == accumulation_dtype(q.scalar_type()) && den->device() == q.device(),
                "fast_causal_attn: den must be ", accumulation_dtype(q.scalar_type()), " on ", q.device(),
                ", got ", den->scalar_type(), " on ", den->device());
  }
  c10::DeviceGuard guard(q.device());

  const at::Tensor qb = with_contiguous_rows(as_bhld(q, layout));
  const at::Tensor kb = with_contiguous_rows(as_bhld(k, layout));
  const at::Tensor vb = with_contiguous_rows(as_bhld(v, layout));
  const Sequences seqs = checked_sequences(q, qb, vb, cu_seqlens, initial_kv, initial_k_sum);
  const ForwardSegments segments = checked_segments(segment_kv, segment_k_sum, qb, vb, seqs.count, q);
  at::Tensor dkv1, dk_sum1;
  if (grad_final_kv.has_value()) {
    dkv1 = seqs.state(*grad_final_kv, "grad_final_kv", true, q);
    dk_sum1 = seqs.state(*grad_final_k_sum, "grad_final_k_sum", false, q);
  }
  const auto acc = q.options().dtype(accumulation_dtype(q.scalar_type()));
  const at::Tensor dqb = empty_bhld(qb, qb.size(3), layout);
  const at::Tensor dkb = empty_bhld(kb, kb.size(3), layout);
  const at::Tensor dvb = empty_bhld(vb, vb.size(3), layout);
  const bool initial = seqs.kv0.defined();
  const at::Tensor dkv0 = empty_if(initial, seqs.shapes.kv, acc);
  const at::Tensor dk_sum0 = empty_if(initial, seqs.shapes.k_sum, acc);
  if (dqb.numel() > 0 || dkv0.numel() > 0) {
    const at::Tensor dob = with_contiguous_rows(as_bhld(grad_out, layout));
    at::Tensor ob, denc;
    BackwardParams p;
    fill_problem(p, qb, vb, scale, normalize, /*eps=*/1.0);
    p.q = strided(qb);
    p.k = strided(kb);
    p.v = strided(vb);
    p.dout = strided(dob);
    p.dq = strided(dqb);
    p.dk = strided(dkb);
    p.dv = strided(dvb);
    if (normalize) {
      ob = with_contiguous_rows(as_bhld(*out, layout));
      denc = den->contiguous();
      p.o = strided(ob);
      p.den = denc.data_ptr();
    }
    seqs.fill(p);
    if (initial) {
      p.grad_initial_kv = dkv0.data_ptr();
      p.grad_initial_k_sum = dk_sum0.data_ptr();
    }
    if (dkv1.defined()) {
      p.grad_final_kv = dkv1.data_ptr();
      p.grad_final_k_sum = dk_sum1.data_ptr();
    }
    if (segments.kv.defined()) {
      p.forward_segment_kv = segments.kv.data_ptr();
      p.forward_segment_k_sum = segments.k_sum.defined() ? segments.k_sum.data_ptr() : nullptr;
      p.forward_segments = segments.kv.size(1);
    }
    launch(p);
  }
  return {as_bhld(dqb, layout), as_bhld(dkb, layout), as_bhld(dvb, layout), dkv0, dk_sum0};
}

TORCH_LIBRARY(fast_causal_attn, m) {
  m.def("forward(Tensor q, Tensor k, Tensor v, Tensor? initial_kv, Tensor? initial_k_sum, Tensor? cu_seqlens,"
        " float scale, bool normalize, float eps, str layout, bool return_final_state, bool keep_segments=False)"
        " -> (Tensor out, Tensor den, Tensor final_kv, Tensor final_k_sum, Tensor segment_kv, Tensor segment_k_sum)");
  m.def("backward(Tensor grad_out, Tensor? grad_final_kv, Tensor? grad_final_k_sum, Tensor q, Tensor k, Tensor v,"
        " Tensor? out, Tensor? den, Tensor? initial_kv, Tensor? initial_k_sum, Tensor? cu_seqlens, float scale,"
        " bool normalize, str layout, Tensor? segment_kv=None, Tensor? segment_k_sum=None)"
        " -> (Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor grad_initial_kv, Tensor grad_initial_k_sum)");
  // forward's results that a caller sees, differentiable in q, k, v and the initial state: the
  // backward op is its gradient (csrc/autograd.cpp)
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor? initial_kv, Tensor? initial_k_sum, Tensor? cu_seqlens,"
        " float scale, bool normalize, float eps, str layout, bool return_final_state, bool keep_segments)"
        " -> (Tensor out, Tensor final_kv, Tensor final_k_sum)");
}

#ifndef FAST_CAUSAL_ATTN_WITH_CUDA
// A CPU-only build still checks CUDA inputs, then says what to do.
namespace {
template <typename Result, typename Params>
Result no_cuda(const Params&) {
  TORCH_CHECK(false, "fast_causal_attn was built without CUDA support; reinstall it where a CUDA toolkit and a "
                     "CUDA build of torch are present (or set FAST_CAUSAL_ATTN_BUILD=cuda)");
  return Result();
}
}  // namespace

TORCH_LIBRARY_IMPL(fast_causal_attn, CUDA, m) {
  m.impl("forward", &forward_op<&no_cuda<ForwardSegments, ForwardParams>>);
  m.impl("backward", &backward_op<&no_cuda<void, BackwardParams>>);
}

int64_t plan_forward_segments(const ForwardParams&, int) { return 0; }
#endif

namespace {
// _C.plan_forward_segments(dtype, B, H, L, E, M, normalize, with_state, device) -> int: the S of
// a CUDA forward's segment_kv with keep_segments (see plan_forward_segments), for the fake
// kernel: dtype as torch names it without "torch." ("bfloat16"), with_state: an initial or final
// state. A plain function, not an op: the fake kernel calls it while tracing, outside any graph.
PyObject* py_plan_forward_segments(PyObject*, PyObject* args) {
  const char* dtype_name = nullptr;
  long long B = 0, H = 0, L = 0, E = 0, M = 0;
  int normalize = 0, with_state = 0, device = 0;
  if (!PyArg_ParseTuple(args, "sLLLLLppi", &dtype_name, &B, &H, &L, &E, &M, &normalize, &with_state, &device)) {
    return nullptr;
  }
  try {
    const std::string name = dtype_name;
    ForwardParams p;
    if (name == "float16") {
      p.dtype = at::kHalf;
    } else if (name == "bfloat16") {
      p.dtype = at::kBFloat16;
    } else if (name == "float32") {
      p.dtype = at::kFloat;
    } else if (name == "float64") {
      p.dtype = at::kDouble;
    } else {
      TORCH_CHECK(false, "fast_causal_attn: plan_forward_segments takes float16, bfloat16, float32 or float64, got ",
                  name);
    }
    p.B = B, p.H = H, p.L = L, p.E = E, p.M = M, p.num_seqs = B;
    p.normalize = normalize != 0;
    static char state_marker;  // never read or written: a plan only asks whether a state is there
    if (with_state) p.initial_kv = &state_marker, p.final_kv = &state_marker;
    p.keep_segments = true;
    return PyLong_FromLongLong(plan_forward_segments(p, device));
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    return nullptr;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

PyMethodDef methods[] = {
    {"plan_forward_segments", py_plan_forward_segments, METH_VARARGS,
     "The segment count of a CUDA forward's segment_kv with keep_segments (see ops.h)."},
    {nullptr, nullptr, 0, nullptr}};
}  // namespace

}  // namespace fast_causal_attn

// Lets `import fast_causal_attn._C` load the library (and run the registrations above); the ops are
// reached through torch.ops.fast_causal_attn. Its one function: plan_forward_segments (above).
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, fast_causal_attn::methods};
  return PyModule_Create(&module_def);
}
