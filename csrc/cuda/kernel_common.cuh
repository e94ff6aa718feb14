// What every CUDA kernel family shares: the kernel parameters, the four passes as one causal
// product out[t] = sum_{s<=t} (a[t] . b[s]) c[s] (s >= t in reverse) with their operands, and the
// time segments of the low-occupancy launches.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>

#include "../causal_attn.h"
#include "../ops.h"

namespace fast_causal_attn {
namespace cuda {

constexpr int kWarp = 32;

// GradKV: the gradients of k and v in one reverse pass (the tensor-core family's fused pass): the
// operands and output of GradK, plus dv from the same state (see tensorcore_product.cuh).
enum class Pass { Forward, GradQ, GradK, GradV, GradKV };

struct KernelParams : BackwardParams {
  // dO[t] . O[t] when normalize (the normalizer's gradient is -dout_dot_out[t] / den[t]): made by
  // backward_prepare_kernel before the dq pass, or by the kernel that makes dq where
  // dots_in_grad_q (the wgmma dq pass in one column tile, or the one-pass backward in one segment:
  // one_pass_makes_dots; their producers read O beside the dO they stage), read by the dk pass
  // after it (the one pass keeps its own in shared memory: dout_dot_out unwritten).
  void* dout_dot_out = nullptr;  // [B, H, L] contiguous, accumulation dtype
  bool dots_in_grad_q = false;
  // The one-pass backward (one_pass_backward in dispatch.cuh): in the forward, keep each time
  // segment's end state (ForwardSegments [B * H, S, E, M], in place of the segments' starts:
  // segment_ends); in the backward, dk, dv and dq in one reverse pass (wgmma_grad_kv_kernel's
  // kWithDq) in the forward's segments, dq's state in each taken down from its segment's end
  // (forward_segment_kv).
  bool one_pass = false;
  // The one pass's segments: each spans this many of the forward's (the last fewer), so that
  // they number at most kMaxOnePassSegments (one launch's look-back; one_pass_backward in
  // dispatch.cuh); dq's state starts from the end of the last forward segment it spans.
  static constexpr int64_t kMaxOnePassSegments = 16;
  int64_t one_pass_span = 1;
  // The forward's segment ends, where it keeps them for the one pass: [B * H, segments, Da, Dc],
  // the given start included (each pass block stores the state it ends with); under normalize the
  // key sum's beside, [B * H, segments, Da] (the backward's forward_segment_k_sum then holds them).
  float* segment_ends = nullptr;
  float* segment_key_sum_ends = nullptr;

  // Every row read or written starts 16-byte aligned and E, M are whole 16-byte vectors: kernels may stage
  // and write rows 16 bytes at a time (set by the launchers that do; see rows_are_vectors).
  bool rows_are_vectors = false;
  // The tensor-core kernels' chunk buffers: with 2, the next chunk is on its way while this one is
  // worked on; with 1, each chunk is staged when its turn comes.
  int chunk_buffers = 1;
  // With two buffers: the second has no a region of its own; the next chunk's a is staged into
  // the one a region once this chunk's outputs are written (see tensorcore_product_kernel).
  bool shared_a = false;
  // With two buffers, the state-only launch of 16-bit inputs may keep two chunks on their way in
  // three slots (see tensorcore_product_kernel); false keeps one, for measuring.
  bool deep_state_staging = true;
  // float32 products may take their operands' heads alone (TF32's on mma.sync, instead of 3xTF32;
  // float16's of the scaled tiles on wgmma, instead of heads and tails): only when the user allowed
  // TF32 for float32 matmuls (torch.backends.cuda.matmul.allow_tf32), as torch.matmul does.
  bool tf32 = false;

  // Head dims above the largest bucket split the state's rows into slabs, one block each; the
  // slabs' partial outputs (and normalizer) are added into these, then finish_slabs_kernel
  // writes the output. Unused (nullptr, 1 slab) otherwise.
  int64_t slabs = 1;
  void* slab_out = nullptr;  // [B, H, L, Dc] contiguous, accumulation dtype, zeroed
  // The float32 wgmma kernel's row tiles (above 64 of the state's rows), where they are all in
  // one launch (row_tile < 0): tiles 2 and 3 (above 128) add their outputs here, tiles 0 and 1
  // into the output: a zeroed buffer with the output's strides, added to it after the pass (see
  // RowTileSums in wgmma_launch.cuh). Where they run one launch each (row_tile >= 0: the tile
  // every block of this launch takes), tile 0 stores its outputs and each later tile adds into
  // them, ordered by the stream (see row_tiles_in_sequence).
  float* upper_row_tiles_out = nullptr;
  int64_t row_tile = -1;
  void* slab_den = nullptr;  // [B, H, L] contiguous, accumulation dtype, zeroed (forward normalize)

  // The low-occupancy variant splits time into segments, one block each: a first launch
  // (state_only) sums each segment's state into seg_*, scan_segments turns those in place into
  // the sum of the segments before each (after it, in reverse), and the second launch starts each
  // segment from its slot. One segment: the tiled variant.
  int64_t segments = 1;
  int64_t segment_len = 0;      // timesteps per segment, a multiple of the family's time step
  bool state_only = false;
  void* seg_state = nullptr;    // [B * H, segments, Da, Dc] accumulation dtype ([.., Dc, Da] when seg_from_forward)
  // The dq pass's segments start from the forward's segment starts (transposed: its state is S^T),
  // which the forward has summed and scanned: no state-only launch, no scan (see ForwardSegments).
  bool seg_from_forward = false;
  void* seg_key_sum = nullptr;  // [B * H, segments, Da]: sum of b (forward normalize)
  void* seg_extra = nullptr;    // [B * H, segments, Dc]: sum of extra_b * c (extra row)
  // The state-only launch may split each of its segments in two, a head of state_head timesteps
  // and a tail (the rest), one block each, heads first, so that its blocks fill the device's
  // slots instead of a part of them (choose_state_head); each tail writes its sums to the same
  // place in the seg_tail_* regions (laid out as seg_*), and the scan adds head + tail. 0: one
  // block a segment.
  int64_t state_head = 0;
  void* seg_tail_state = nullptr;
  void* seg_tail_key_sum = nullptr;
  void* seg_tail_extra = nullptr;
  // One launch for a segmented pass (the 16-bit wgmma forward, and dk with dv, at E and M up to
  // 64: one_launch_segments; launch_segmented): each block sums its segment into seg_sums (a later
  // segment starts from it), publishes that, waits for the sums of the segments before it, adds
  // them in time order (as the scan does) into its start, writes that to seg_state (the starts
  // the dq pass reads) and runs its segment.
  // `lookback`: a counter that numbers the blocks in the order they start (a block waits only on
  // blocks numbered before it, which have started: no deadlock however few are resident), then
  // one flag a block; zeroed before the launch. nullptr: the state-only launch and the scan.
  unsigned* lookback = nullptr;
  float* seg_sums = nullptr;  // [B * H, segments, Da, Dc]: each segment's own sums (one launch)
  // under normalize, each segment's own vector sums beside (one launch): the forward's key sums
  // [B * H, segments, Da], or dk with dv's extra row [B * H, segments, Dc]
  float* seg_own_vector_sums = nullptr;
  // A plan (plan_forward_segments): the launchers decide as for a run and return the forward's
  // segment count (ForwardSegments::count) instead of allocating or launching anything.
  bool dry_run = false;

  // The state a pass starts from and ends at (initial and final state, or their gradients), each
  // [B * H, ...] contiguous in the accumulation dtype, nullptr for none (see with_state_io in
  // dispatch.cuh). Chunked and tensor-core families only.
  const void* start_state = nullptr;   // [B * H, Da, Dc], or [B * H, Dc, Da] when start_transposed
  bool start_transposed = false;
  const void* start_vector = nullptr;  // the forward's key sum [B * H, Da]; the extra row's [B * H, Dc]
  void* end_state = nullptr;           // [B * H, Da, Dc], or [B * H, Dc, Da] when end_transposed
  bool end_transposed = false;         // (dk with dv in one pass: run_grad_kv)
  void* end_vector = nullptr;          // like start_vector
  const void* out_bias = nullptr;      // [B * H, Dc], added to every output row (grad k, no normalize)
  // The 16-bit wgmma forward's final key sum without normalize (launch_wgmma; under normalize the
  // kernels carry it as start_vector and end_vector): the pass's blocks sum k's columns from the
  // chunks they stage. With one segment a block writes key_sum_start (nullptr: none) plus its sums
  // to key_sum_end ([B * H, Da]); with more each segment's own sums go to key_sum_parts [B * H,
  // segments, Da], which key_sum_finish_kernel adds in time order, the start after them.
  void* key_sum_end = nullptr;
  const void* key_sum_start = nullptr;
  float* key_sum_parts = nullptr;
  // float16 under normalize, the reverse passes (dk, dv) on the tensor cores (the wgmma kernels,
  // and the mma.sync kernels through Operands::take_den_unit): the rows they divide by den (q /
  // den, dv's dO / den: about 1 / |key sum|, below float16's smallest normal 6.1e-5 once den is
  // large) are taken times den_unit[0], a power of two (make_den_unit in
  // causal_attn_cuda.cu: 2^floor(log2(max |den| / 256)), at least 1), and everything the passes
  // sum from them (their states, dk's extra row, their outputs) is in that unit: the outputs are
  // stored times den_unit[1] = 1 / den_unit[0], and the states given to and taken from the passes
  // are converted by launch_wgmma (run_tensorcore for the mma.sync kernels). nullptr: unit 1.
  const float* den_unit = nullptr;

  bool has_state_io() const { return start_state || start_vector || end_state || end_vector || out_bias; }
};

// KernelParams::den_unit's unit (which = 0) or its inverse (which = 1); 1 without one, and in a
// kernel instance that never takes one (kTakes: float16 under normalize, where it divides by den).
template <bool kTakes>
__device__ __forceinline__ float den_unit_of(const KernelParams& p, int which) {
  return kTakes && p.den_unit != nullptr ? p.den_unit[which] : 1.f;
}

// float32 tensors on the current device: the converted states (ReverseStates), den's division and
// the key sums' (wgmma_launch.cuh).
inline at::TensorOptions float_options() {
  return at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, c10::cuda::current_device());
}

// A reverse pass's states in the units its kernels sum in: the given start (the final state's
// gradient, and dk's extra row's, [pairs, Dc]) divided by `scale` and, under
// KernelParams::den_unit, times the unit, the end (the initial state's gradient) times `scale`
// and 1 / unit after the launch (finish). launch_wgmma's kernels sum without the scale; the
// mma.sync kernels with it (scale 1). reverse: a reverse pass that runs (not a dry run); any
// other pass converts nothing and takes no unit (p.den_unit cleared: the forward's and dq's
// outputs are not in it). The converted starts live as long as this.
class ReverseStates {
 public:
  ReverseStates(KernelParams& p, bool reverse, int64_t Da, int64_t Dc, double scale)
      : scale_(reverse ? scale : 1.0), den_unit_(reverse ? p.den_unit : nullptr),
        state_numel_(p.num_seqs * p.H * Da * Dc), vector_numel_(p.num_seqs * p.H * Dc) {
    p.den_unit = den_unit_;
    if (!converts()) return;
    p.start_state = into_pass(p.start_state, state_numel_, start_);
    p.start_vector = into_pass(p.start_vector, vector_numel_, start_vector_);
  }
  void finish(const KernelParams& p) const {
    if (!converts()) return;
    out_of_pass(p.end_state, state_numel_);
    out_of_pass(p.end_vector, vector_numel_);
  }

 private:
  bool converts() const { return scale_ != 1.0 || den_unit_ != nullptr; }
  // den_unit's unit (0) or its inverse (1), as a one-element tensor on the device
  at::Tensor unit(int which) const { return at::from_blob(const_cast<float*>(den_unit_) + which, {1}, float_options()); }
  const void* into_pass(const void* given, int64_t numel, at::Tensor& converted) const {
    if (given == nullptr) return given;
    converted = at::from_blob(const_cast<void*>(given), {numel}, float_options());
    // the first conversion makes the pass's own copy (the caller's start is never written); a
    // second works on that copy in place
    if (scale_ != 1.0) converted = converted.div(scale_);
    if (den_unit_ != nullptr) converted = scale_ != 1.0 ? converted.mul_(unit(0)) : converted.mul(unit(0));
    return converted.data_ptr();
  }
  void out_of_pass(void* end, int64_t numel) const {
    if (end == nullptr) return;
    at::Tensor x = at::from_blob(end, {numel}, float_options());
    if (scale_ != 1.0) x.mul_(scale_);
    if (den_unit_ != nullptr) x.mul_(unit(1));
  }
  double scale_;
  const float* den_unit_;
  int64_t state_numel_, vector_numel_;
  at::Tensor start_, start_vector_;
};

// Pass P's output: the forward's o, or dq, dk, dv.
template <Pass P>
C10_HOST_DEVICE inline const StridedTensor& pass_output(const KernelParams& p) {
  return P == Pass::Forward ? p.o : P == Pass::GradQ ? p.dq : P == Pass::GradK ? p.dk : p.dv;
}

// Which passes run backward in time and which carry the normalizer's extra terms. What a, b and c
// are in each pass is Operands' table below. Under normalize the gradients of q and k have an
// extra row (the normalizer's gradient against a row of ones); the forward adds the denominator
// q' . sum k (a column of ones in c).
template <Pass P>
struct PassTraits {
  static constexpr bool kReverse = P == Pass::GradK || P == Pass::GradV || P == Pass::GradKV;
  static constexpr bool kMayHaveExtraRow = P == Pass::GradQ || P == Pass::GradK || P == Pass::GradKV;
  static constexpr bool kMayHaveDenominator = P == Pass::Forward;
};

// Blocks of a segmented launch: segments vary fastest. The state-only launch leaves out the last
// segment in pass order (the last in time; the first in reverse): no segment starts from its sums.
// With heads and tails (KernelParams::state_head) it launches every segment's head, then every
// tail. segment_of_block takes the segment off a block's index (the rest of the index stays in
// `index`); piece_of_block first takes off whether the block is a tail.
__host__ __device__ inline int64_t launched_segments(const KernelParams& p) {
  return p.state_only ? p.segments - 1 : p.segments;
}
enum class Piece { kSegment, kHead, kTail };
__device__ __forceinline__ Piece piece_of_block(const KernelParams& p, int64_t& index) {
  if (!p.state_only || p.state_head == 0) return Piece::kSegment;
  const int64_t heads = int64_t(gridDim.x) / 2;
  if (index < heads) return Piece::kHead;
  index -= heads;
  return Piece::kTail;
}
template <Pass P>
__device__ __forceinline__ int64_t segment_of_block(const KernelParams& p, int64_t& index) {
  const int64_t launched = launched_segments(p);
  const int64_t segment = index % launched;
  index /= launched;
  return p.state_only && PassTraits<P>::kReverse ? segment + 1 : segment;
}

// Pass P's operand `which` (0: a, 1: b, 2: c) of q, k, v and dO (Operands' table below; dk with dv
// in one pass, GradKV, takes GradK's): a device pass's rows and a host launcher's tensors alike.
template <Pass P, typename T>
C10_HOST_DEVICE inline T pass_operand(int which, const T& q, const T& k, const T& v, const T& dout) {
  constexpr Pass Q = P == Pass::GradKV ? Pass::GradK : P;
  if (which == 0) return Q == Pass::Forward ? q : Q == Pass::GradQ ? dout : Q == Pass::GradK ? v : k;
  if (which == 1) return Q == Pass::Forward ? k : Q == Pass::GradQ ? v : Q == Pass::GradK ? dout : q;
  return Q == Pass::Forward ? v : Q == Pass::GradQ ? k : Q == Pass::GradK ? q : dout;
}

template <Pass P_, typename scalar_t, typename acc_t>
struct Operands {
  static constexpr Pass P = P_ == Pass::GradKV ? Pass::GradK : P_;  // the fused pass's own operands are GradK's
  const scalar_t *q, *k, *v, *dout;  // this (batch, head)'s rows
  int64_t q_l, k_l, v_l, dout_l;     // their timestep strides
  scalar_t* out;                     // o, dq, dk or dv
  int64_t out_l;
  acc_t scale;
  const acc_t* den;           // [L] in the gradients under normalize, else nullptr
  const acc_t* dout_dot_out;  // [L] in the gradients of q and k under normalize, else nullptr

  // Timestep s of the operands is timestep t_begin + s of the tensors (a packed sequence's start).
  __device__ Operands(const KernelParams& p, int64_t b, int64_t h, const acc_t* den_, const acc_t* dout_dot_out_,
                      int64_t t_begin = 0)
      : q(static_cast<const scalar_t*>(p.q.ptr) + p.q.offset(b, h, t_begin)),
        k(static_cast<const scalar_t*>(p.k.ptr) + p.k.offset(b, h, t_begin)),
        v(static_cast<const scalar_t*>(p.v.ptr) + p.v.offset(b, h, t_begin)),
        dout(P == Pass::Forward ? nullptr : static_cast<const scalar_t*>(p.dout.ptr) + p.dout.offset(b, h, t_begin)),
        q_l(p.q.stride_l), k_l(p.k.stride_l), v_l(p.v.stride_l), dout_l(p.dout.stride_l),
        scale(acc_t(p.scale)), den(den_), dout_dot_out(dout_dot_out_) {
    const StridedTensor& o = pass_output<P>(p);
    out = static_cast<scalar_t*>(o.ptr) + o.offset(b, h, t_begin);
    out_l = o.stride_l;
  }

  // Each of a, b and c is one input's rows, each row times a factor of its timestep (a and b
  // index the state's rows, c its columns), and the pass's product out becomes the output:
  //
  //   pass     a              b                c                stored       direction
  //   forward  q scale        k                v                out [/ den]  forward
  //   dq       dO             v                k                out scale / den
  //   dk       v              dO               q scale / den    out          reverse
  //   dv       k              q scale / den    dO               out          reverse
  //
  // Under normalize the gradient flowing into the numerator is dO[t] / den[t]. dO itself stays an
  // operand as it is, and 1 / den[t] goes where it costs no rounding of its own: into dq at the
  // store, and into the (already scaled) q of the dk and dv passes. Tensor-core families round
  // their operands to 16 bits, so each rounding saved shows in float16/bfloat16 gradients.
  struct Rows {
    const scalar_t* ptr;
    int64_t stride;  // between timesteps
  };
  __device__ Rows a_rows() const { return rows(0); }
  __device__ Rows b_rows() const { return rows(1); }
  __device__ Rows c_rows() const { return rows(2); }
  __device__ Rows rows(int which) const {
    return pass_operand<P>(which, Rows{q, q_l}, Rows{k, k_l}, Rows{v, v_l}, Rows{dout, dout_l});
  }
  // (the mma.sync kernels, float16 under normalize, dk and dv: take_den_unit) q scale / den in
  // KernelParams::den_unit's unit and the outputs' factor back out of it; 1 and 1 elsewhere (the
  // chunked and recurrent families keep q / den in float32 and never take it)
  acc_t unit = acc_t(1), inverse_unit = acc_t(1);
  __device__ void take_den_unit(const KernelParams& p) {
    if (PassTraits<P>::kReverse && den != nullptr && p.den_unit != nullptr) unit = p.den_unit[0], inverse_unit = p.den_unit[1];
  }
  __device__ acc_t inv_den(int64_t s) const { return den ? acc_t(1) / den[s] : acc_t(1); }
  __device__ acc_t scaled_q_factor(int64_t s) const { return den ? scale / den[s] * unit : scale; }
  __device__ acc_t a_factor(int64_t) const { return P == Pass::Forward ? scale : acc_t(1); }
  __device__ acc_t b_factor(int64_t s) const { return P == Pass::GradV ? scaled_q_factor(s) : acc_t(1); }
  __device__ acc_t c_factor(int64_t s) const { return P == Pass::GradK ? scaled_q_factor(s) : acc_t(1); }
  // Whether the factors are all 1, so that rows can be copied as they are.
  __device__ bool a_is_plain() const { return P != Pass::Forward || scale == acc_t(1); }
  __device__ bool b_is_plain() const { return P != Pass::GradV || (scale == acc_t(1) && den == nullptr); }
  __device__ bool c_is_plain() const { return P != Pass::GradK || (scale == acc_t(1) && den == nullptr); }

  __device__ acc_t a_at(int64_t s, int64_t r) const {
    const Rows x = a_rows();
    return acc_t(x.ptr[s * x.stride + r]) * a_factor(s);
  }
  __device__ acc_t b_at(int64_t s, int64_t r) const {
    const Rows x = b_rows();
    return acc_t(x.ptr[s * x.stride + r]) * b_factor(s);
  }
  __device__ acc_t c_at(int64_t s, int64_t m) const {
    const Rows x = c_rows();
    return acc_t(x.ptr[s * x.stride + m]) * c_factor(s);
  }
  // The extra row's a and b (normalize, gradients of q and k only): the normalizer's gradient
  // -dO[t] . O[t] / den[t], its 1 / den[t] placed as for dO above.
  __device__ acc_t extra_a(int64_t s) const { return P == Pass::GradQ ? -dout_dot_out[s] : acc_t(1); }
  __device__ acc_t extra_b(int64_t s) const { return P == Pass::GradQ ? acc_t(1) : -dout_dot_out[s]; }

  // What the product's row s is multiplied by when stored (denominator as for store), float32
  // kernels only: one correctly rounded reciprocal a row (a division's slow path is a call, and
  // the registers it clobbers spilled the tensor-core kernel's accumulators).
  __device__ float out_factor(int64_t s, float denominator) const {
    static_assert(std::is_same_v<acc_t, float>, "float32 accumulation");
    return P == Pass::Forward ? __frcp_rn(denominator) : P == Pass::GradQ ? (den ? scale * __frcp_rn(den[s]) : scale)
                                                                          : inverse_unit;
  }
  // denominator: the forward's normalizer at s (1 without normalize).
  __device__ void store(int64_t s, int64_t m, acc_t value, acc_t denominator) const {
    const acc_t result = P == Pass::Forward ? value / denominator
                         : P == Pass::GradQ ? scale * value * inv_den(s)
                                            : value;
    out[s * out_l + m] = scalar_t(result);
  }
};

// ROWS consecutive accumulation-type values from shared memory, 16 bytes at a time.
template <int ROWS, typename acc_t>
__device__ __forceinline__ void load_rows(const acc_t* src, acc_t (&dst)[ROWS]) {
  constexpr int kVec = 16 / sizeof(acc_t);
  if constexpr (ROWS % kVec == 0 && sizeof(acc_t) == 4) {
#pragma unroll
    for (int i = 0; i < ROWS / 4; ++i) {
      const float4 x = reinterpret_cast<const float4*>(src)[i];
      dst[4 * i] = x.x, dst[4 * i + 1] = x.y, dst[4 * i + 2] = x.z, dst[4 * i + 3] = x.w;
    }
  } else if constexpr (ROWS % kVec == 0 && sizeof(acc_t) == 8) {
#pragma unroll
    for (int i = 0; i < ROWS / 2; ++i) {
      const double2 x = reinterpret_cast<const double2*>(src)[i];
      dst[2 * i] = x.x, dst[2 * i + 1] = x.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < ROWS; ++i) dst[i] = src[i];
  }
}

int multiprocessor_count();

// How many of the forward's `segments` each of the one pass's spans (KernelParams::one_pass_span).
inline int64_t one_pass_span(int64_t segments) {
  constexpr int64_t most = KernelParams::kMaxOnePassSegments;
  return (segments + most - 1) / most;
}
// Whether the forward in `segments` time segments keeps their ends for the one-pass backward
// (one_pass_backward in dispatch.cuh; the forward's launcher and launch_backward_cuda both ask).
// Up to KernelParams::kMaxOnePassSegments the one pass runs in them; above, each of its segments
// spans several (one_pass_span), and where its `pairs` blocks per segment then fill less than half
// the multiprocessors, the two passes in the forward's segments are as fast or faster (H100,
// sixty-third session, GPU ms fwd+bwd, spanning one pass against two passes: 1,8,16384,64 in 16
// of 32, 128 blocks, bf16 0.123 / 0.138, fp16 0.124 / 0.141; 1,4,32768,64 in 16 of 64, 64
// blocks, bf16 0.151 / 0.151, fp16 0.160 / 0.151): there the forward keeps its starts.
inline bool keeps_one_pass_ends(int64_t pairs, int64_t segments) {
  if (segments <= KernelParams::kMaxOnePassSegments) return true;
  const int64_t span = one_pass_span(segments);
  return 2 * pairs * ((segments + span - 1) / span) >= multiprocessor_count();
}

// How many time segments (blocks along time) a launch of `blocks` blocks gets: enough to fill
// `target_blocks` (what the device holds at once, or a measured share of it), while each segment
// keeps at least min_segment_len timesteps (below that the extra state pass and the prefix sums
// cost more than the parallelism gains). FAST_CAUSAL_ATTN_SEGMENTS=N forces N, for measuring.
int64_t choose_segments(int64_t blocks, int64_t target_blocks, int64_t L, int64_t min_segment_len);

// The head length, in chunks, of the state-only launch's segments (KernelParams::state_head),
// 0 for whole segments: `tiles` blocks a segment, `segments` segments of `chunks` chunks each,
// `slots` blocks resident at once. Whole segments fill tiles * segments slots for `chunks` chunks
// (bf16 8,16,2048,64: 256 of 396 slots, 11 chunks). Heads of M chunks first and tails of
// chunks - M after (the hardware starts blocks in index order as slots free up) end after
// max(M, r * ceil(tails a free slot runs)) chunks: the smallest M >= the work's share of a
// slot whose tails fit in the slots the heads leave free, each running floor(M / (chunks - M))
// of them one after another (that example: heads of 8, tails of 3, all done after 8 chunks).
inline int64_t choose_state_head(int64_t tiles, int64_t segments, int64_t chunks, int64_t slots) {
  const int64_t heads = tiles * segments;
  if (segments < 1 || heads >= slots || chunks < 2) return 0;
  const int64_t share = (heads * chunks + slots - 1) / slots;
  for (int64_t head = std::max<int64_t>(share, 1); head < chunks; ++head) {
    if (heads <= (slots - heads) * (head / (chunks - head))) return head;
  }
  return 0;
}

// KernelParams::state_head, in steps, for a state-only launch of `tiles` blocks a segment, `count`
// segments of `segment_chunks` chunks of `step` steps and `slots` resident blocks: where its
// launcher measured heads to pay (`heads`), choose_state_head's, else whole segments (0); a head
// as long as the segment is none. FAST_CAUSAL_ATTN_TC_STATE_HEAD=N forces heads of N chunks (0:
// whole segments), for measuring. (One segment: SegmentWorkspace::make clears it.)
inline int64_t state_head_steps(bool heads, int64_t tiles, int64_t count, int64_t segment_chunks, int64_t slots,
                                int64_t step) {
  int64_t head = heads && count > 1 ? choose_state_head(tiles, count - 1, segment_chunks, slots) : 0;
  if (const char* forced = std::getenv("FAST_CAUSAL_ATTN_TC_STATE_HEAD")) head = std::max<int64_t>(std::atoll(forced), 0);
  return head < segment_chunks ? head * step : 0;
}

// Timesteps per segment when `segments` share L in multiples of `step`. A function of the segment
// count it leaves (ceil(L / segment_len)) as much as of the one asked for, so that a pass can
// rebuild another pass's segments from their count (see ForwardSegments).
inline int64_t segment_length(int64_t L, int64_t segments, int64_t step) {
  return ((L + segments - 1) / segments + step - 1) / step * step;
}
// The segments that segments of segment_len timesteps make of L (one for an empty sequence).
inline int64_t segment_count(int64_t L, int64_t segment_len) { return L > 0 ? (L + segment_len - 1) / segment_len : 1; }

// The workspace of a segmented launch: each segment's state sum_s b[s] c[s]^T, and its sums of b
// (forward normalize) and of extra_b * c (gradients under normalize). Sets p's segments,
// segment_len (a multiple of step) and workspace pointers. The gradients' passes take one
// allocation for their state and extra-row regions (each 16-byte aligned, for the scan's vector
// loads), none with one segment: every allocation is host time on each call, which small shapes'
// forward+backward is bound by. The forward's two regions are tensors of their own,
// [B * H, segments, Da, Dc] and [B * H, segments, Da], so that the op can return them for the dq
// pass (kept()).
struct SegmentWorkspace {
  struct Region {
    void* data = nullptr;
    int64_t numel = 0;
  };
  at::Tensor buffer;          // owns the regions' memory (the forward: the state's); undefined with one segment
  at::Tensor key_sum_buffer;  // the forward's key sums, where it has them
  at::Tensor tail_buffer;     // the tails' sums (KernelParams::state_head), else undefined
  Region state, key_sum, extra;
  Region tail_state, tail_key_sum, tail_extra;
  at::ScalarType dtype = at::kFloat;

  template <Pass P, typename acc_t>
  // regions = false: the segments alone (a one-launch pass that keeps no starts: its sums are its
  // own buffer's, KernelParams::seg_sums).
  // length: the segments' timesteps where the caller sets them (a multiple of step), else 0
  static SegmentWorkspace make(KernelParams& p, int64_t segments, int64_t step, int64_t Da, int64_t Dc,
                               bool regions = true, int64_t length = 0) {
    p.segment_len = length > 0 ? length : segment_length(p.L, segments, step);
    p.segments = segment_count(p.L, p.segment_len);
    SegmentWorkspace w;
    w.dtype = c10::CppTypeToScalarType<acc_t>::value;
    if (p.segments > 1 && regions) {
      const int64_t pairs = p.num_seqs * p.H, n = pairs * p.segments;
      const auto options = at::TensorOptions().dtype(w.dtype).device(at::kCUDA);
      // regions sharing one allocation start at 16 bytes (the scan's vector loads)
      auto aligned = [](int64_t numel) {
        constexpr int64_t kAlign = 16 / sizeof(acc_t);
        return (numel + kAlign - 1) / kAlign * kAlign;
      };
      if constexpr (P == Pass::Forward) {
        w.buffer = at::empty({pairs, p.segments, Da, Dc}, options);
        w.state = {w.buffer.data_ptr(), w.buffer.numel()};
        if (p.normalize || p.end_vector) {
          w.key_sum_buffer = at::empty({pairs, p.segments, Da}, options);
          w.key_sum = {w.key_sum_buffer.data_ptr(), w.key_sum_buffer.numel()};
        }
      } else {  // the state, then the extra row's sums (normalize) behind it
        const int64_t state_numel = n * Da * Dc, extra_at = aligned(state_numel);
        const int64_t extra_numel = p.normalize ? n * Dc : 0;
        w.buffer = at::empty({extra_at + extra_numel}, options);
        w.state = {w.buffer.data_ptr(), state_numel};
        if (extra_numel > 0) w.extra = {w.buffer.data_ptr<acc_t>() + extra_at, extra_numel};
      }
      p.seg_state = w.state.data;
      p.seg_key_sum = w.key_sum.data;
      p.seg_extra = w.extra.data;
      if (p.state_head > 0) {  // the tails' regions, as the heads', in one allocation
        const int64_t key_sum_at = aligned(w.state.numel), extra_at = key_sum_at + aligned(w.key_sum.numel);
        w.tail_buffer = at::empty({extra_at + w.extra.numel}, options);
        acc_t* base = w.tail_buffer.data_ptr<acc_t>();
        w.tail_state = {base, w.state.numel};
        if (w.key_sum.numel > 0) w.tail_key_sum = {base + key_sum_at, w.key_sum.numel};
        if (w.extra.numel > 0) w.tail_extra = {base + extra_at, w.extra.numel};
        p.seg_tail_state = w.tail_state.data;
        p.seg_tail_key_sum = w.tail_key_sum.data;
        p.seg_tail_extra = w.tail_extra.data;
      }
    } else {
      p.state_head = 0;
    }
    return w;
  }

  // The forward's segment starts (after its scan), for the op to return.
  ForwardSegments kept() const { return {buffer, key_sum_buffer}; }
};

// Where a block of a pass starts, element by element: the sum of the segments before it (after
// it, in reverse; scan_segments made that sum in place between the two launches) plus the pass's
// given start (see with_state_io in dispatch.cuh). Not for the state-only launch, which starts
// from zero. row < Da, col < Dc (global column).
template <typename acc_t>
struct SegmentStart {
  const KernelParams& p;
  int64_t slot, pair, Da, Dc;  // slot: this (pair, segment) in the workspace

  __device__ SegmentStart(const KernelParams& params, int64_t pair_, int64_t segment, int64_t Da_, int64_t Dc_)
      : p(params), slot(pair_ * params.segments + segment), pair(pair_), Da(Da_), Dc(Dc_) {}

  __device__ acc_t state(int64_t row, int64_t col) const {
    acc_t value = acc_t(0);
    if (p.segments > 1) {
      const acc_t* seg = static_cast<const acc_t*>(p.seg_state);
      value = p.seg_from_forward ? seg[(slot * Dc + col) * Da + row] : seg[(slot * Da + row) * Dc + col];
    }
    if (p.start_state != nullptr) value += given(row, col);
    return value;
  }
  // The given start's entry (KernelParams::start_state, not null), without the segments' sums.
  __device__ acc_t given(int64_t row, int64_t col) const {
    const acc_t* start = static_cast<const acc_t*>(p.start_state);
    return p.start_transposed ? start[(pair * Dc + col) * Da + row] : start[(pair * Da + row) * Dc + col];
  }
  __device__ acc_t key_sum(int64_t row) const {  // forward
    acc_t value = p.segments > 1 ? static_cast<const acc_t*>(p.seg_key_sum)[slot * Da + row] : acc_t(0);
    if (p.start_vector != nullptr) value += static_cast<const acc_t*>(p.start_vector)[pair * Da + row];
    return value;
  }
  __device__ acc_t extra(int64_t col) const {  // gradients of q and k under normalize
    acc_t value = p.segments > 1 ? static_cast<const acc_t*>(p.seg_extra)[slot * Dc + col] : acc_t(0);
    if (p.start_vector != nullptr) value += static_cast<const acc_t*>(p.start_vector)[pair * Dc + col];
    return value;
  }
};

// Where a block writes the state it ends with: its segment's slots in the workspace (state-only
// launch), or the pass's end state and vector when it holds the last segment in time order;
// nullptr where nothing is written. state is [Da, Dc] (global columns), key_sum [Da], extra [Dc].
template <typename acc_t>
struct SegmentEnd {
  acc_t* state = nullptr;
  acc_t* key_sum = nullptr;
  acc_t* extra = nullptr;
  bool transposed = false;  // state is [Dc, Da] (KernelParams::end_transposed)

  __device__ SegmentEnd(const KernelParams& p, int64_t pair, int64_t segment, int64_t Da, int64_t Dc, bool reverse,
                        bool forward, Piece piece = Piece::kSegment) {
    if (p.state_only) {
      const int64_t base = pair * p.segments + segment;
      const bool tail = piece == Piece::kTail;
      state = static_cast<acc_t*>(tail ? p.seg_tail_state : p.seg_state) + base * Da * Dc;
      key_sum = static_cast<acc_t*>(tail ? p.seg_tail_key_sum : p.seg_key_sum) + base * Da;
      extra = static_cast<acc_t*>(tail ? p.seg_tail_extra : p.seg_extra) + base * Dc;
    } else if (segment == (reverse ? 0 : p.segments - 1)) {
      if (p.end_state != nullptr) state = static_cast<acc_t*>(p.end_state) + pair * Da * Dc;
      transposed = p.end_transposed;
      if (p.end_vector != nullptr && forward) key_sum = static_cast<acc_t*>(p.end_vector) + pair * Da;
      if (p.end_vector != nullptr && !forward) extra = static_cast<acc_t*>(p.end_vector) + pair * Dc;
    }
  }
};

// The one-launch segmented pass's ordering and flags (KernelParams::lookback).
namespace lookback {
// This block's place in the launch's order: the order blocks start in (thread 0 takes a number,
// the block shares it through `scratch`, a word of shared memory the caller has no use for yet:
// a static variable would take 1 KB of a block's shared memory, the dynamic part's alignment).
// Blocks wait only on blocks numbered before them, and a block numbered has started, so every
// wait ends, however few blocks the device holds at once.
__device__ __forceinline__ int64_t ticket(unsigned* counter, unsigned* scratch) {
  if (threadIdx.x == 0) *scratch = atomicAdd(counter, 1u);
  __syncthreads();
  const unsigned number = *scratch;
  __syncthreads();  // every thread has it: the word is the caller's again
  return number;
}
// The same for a pass walked backward in time: within each (pair, column tile) the later
// segments, which the earlier ones start from, numbered first (segments vary fastest).
__device__ __forceinline__ int64_t ticket_in_reverse(unsigned* counter, unsigned* scratch, int64_t segments) {
  const int64_t number = ticket(counter, scratch), segment = number % segments;
  return number - segment + (segments - 1 - segment);
}
// The block's writes seen device-wide, then its flag raised (release); `sync`: the barrier of
// the threads that wrote them (thread 0 among them: the block's, or a kernel's consumer warps').
template <typename Sync>
__device__ __forceinline__ void publish(unsigned* flag, Sync&& sync) {
  __threadfence();
  sync();
  if (threadIdx.x == 0) asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(flag), "r"(1u) : "memory");
}
// Until flags[0, n) are raised (acquire), for the whole block: thread i polls flags i, i +
// blockDim.x, ..., so that the polls' round trips to the L2 overlap (one thread polling them in
// turn waited n round trips, one after the other, where the flags had long been raised); the
// barrier after passes each thread's acquire on to the block. A wait far longer than any
// segment's sums take (2^24 polls, tens of seconds) traps, as a hang's diagnosis, where the
// protocol says none can be.
// (`sync`, `threads`: as publish's, the threads 0 .. threads - 1 that wait and their barrier)
template <typename Sync>
__device__ __forceinline__ void wait_for(const unsigned* flags, int64_t n, Sync&& sync, int threads) {
  for (int64_t i = threadIdx.x; i < n; i += threads) {
    unsigned raised = 0;
    for (uint64_t spins = 0;; ++spins) {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(raised) : "l"(flags + i) : "memory");
      if (raised != 0) break;
      if (spins > (uint64_t(1) << 24)) __trap();
      __nanosleep(64);
    }
  }
  sync();
}
}  // namespace lookback

// The forward of one timestep from a state (csrc/cuda/decode_step.cu).
void run_decode_step(const KernelParams& p, cudaStream_t stream);

// Turns each segment's own sums (data: [pairs, segments, width]) into what the segment starts
// from, in place: the sum over the segments before it (after it, in reverse; the last segment's
// own sums are never written, see segment_of_block, nor read). One thread per
// (pair, kVec consecutive elements) walks the segments, so that no block of the pass sums all
// earlier segments itself (that was O(segments^2) loads, most of them in the last segments'
// blocks). It loads kBatch segments' vectors before it stores any, so that their loads are in
// flight together: one element a thread, each load waiting for the store before it, took 0.020
// ms for 6.3 MB at fp32 8,16,2048,64 (H200), 8x the time its bytes take.
template <typename acc_t, int kVec>
struct alignas(sizeof(acc_t) * kVec) ScanVector {
  acc_t v[kVec];
};

// With tails (KernelParams::state_head), a segment's own sums are its head's (in data) plus its
// tail's (the same place in tails), added in that order.
template <typename acc_t, int kVec>
__global__ void scan_segments_kernel(acc_t* data, const acc_t* tails, int64_t pairs, int64_t segments, int64_t width,
                                     bool reverse) {
  using Vector = ScanVector<acc_t, kVec>;
  constexpr int kBatch = 8;
  const int64_t groups = width / kVec;  // vectors a segment
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= pairs * groups) return;
  Vector* x = reinterpret_cast<Vector*>(data + (i / groups) * segments * width) + i % groups;
  const Vector* tail =
      tails != nullptr ? reinterpret_cast<const Vector*>(tails + (i / groups) * segments * width) + i % groups : nullptr;
  Vector running;
#pragma unroll
  for (int e = 0; e < kVec; ++e) running.v[e] = acc_t(0);
  for (int64_t j0 = 0; j0 < segments; j0 += kBatch) {
    Vector own[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int64_t j = j0 + b;
      if (j < segments - 1) {  // the last: not summed
        const int64_t at = (reverse ? segments - 1 - j : j) * groups;
        own[b] = x[at];
        if (tail != nullptr) {
          const Vector t = tail[at];
#pragma unroll
          for (int e = 0; e < kVec; ++e) own[b].v[e] += t.v[e];
        }
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int64_t j = j0 + b;
      if (j < segments) {
        x[(reverse ? segments - 1 - j : j) * groups] = running;
        if (j < segments - 1) {
#pragma unroll
          for (int e = 0; e < kVec; ++e) running.v[e] += own[b].v[e];
        }
      }
    }
  }
}

template <typename acc_t>
void scan_segments(acc_t* sums, const acc_t* tails, int64_t numel, int64_t pairs, int64_t segments, bool reverse,
                   cudaStream_t stream) {
  if (numel == 0) return;
  const int64_t width = numel / (pairs * segments);
  constexpr int kVec = 16 / sizeof(acc_t);  // 16 bytes a load where a segment is whole vectors
  const bool vectors = width % kVec == 0 && reinterpret_cast<uintptr_t>(sums) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(tails) % 16 == 0;
  const int64_t threads = pairs * (vectors ? width / kVec : width);
  const unsigned blocks = unsigned((threads + 255) / 256);
  if (vectors) {
    scan_segments_kernel<acc_t, kVec><<<blocks, 256, 0, stream>>>(sums, tails, pairs, segments, width, reverse);
  } else {
    scan_segments_kernel<acc_t, 1><<<blocks, 256, 0, stream>>>(sums, tails, pairs, segments, width, reverse);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Raises `kernel`'s dynamic shared-memory limit to at least `bytes` where that is above the 48 KB
// default, once per kernel and device (causal_attn_cuda.cu): the attribute call costs host time,
// which small shapes' calls are bound by, and a raised limit holds for every later launch.
void allow_dynamic_smem(const void* kernel, size_t bytes);
template <typename Kernel>
void allow_dynamic_smem(Kernel* kernel, size_t bytes) {
  allow_dynamic_smem(reinterpret_cast<const void*>(kernel), bytes);
}

// Launches a segmented pass: with more than one segment, first the state-only launch that sums
// each segment's state, the scans that turn those into each segment's start (unless the starts are
// the forward's), then the pass itself. Both launches with the kernel's (params, Da, Dc, col_tiles).
// one_launch (the kernel's instance that has it, or nullptr: KernelParams::lookback): the pass
// alone, its blocks summing their segments and looking back at the sums before them, where the
// state-only launch, the scan and the pass were three launches (with the pass's threads).
template <Pass P, typename Kernel>
void launch_segmented(Kernel kernel, const KernelParams& p, const SegmentWorkspace& workspace, int64_t blocks,
                      int threads, size_t smem, cudaStream_t stream, int64_t Da, int64_t Dc, int64_t col_tiles,
                      Kernel one_launch = nullptr) {
  TORCH_CHECK(blocks <= int64_t(0x7fffffff), "fast_causal_attn: too many (batch, head, column) tiles: ", blocks);
  if (p.segments > 1 && !p.seg_from_forward && one_launch != nullptr) {
    allow_dynamic_smem(one_launch, smem);
    // (the kernels that have it sum float32 states, under normalize a vector's beside: the
    // forward's key sums, dk with dv's extra row; no scanned extra row kept, no heads and tails)
    TORCH_CHECK(workspace.dtype == at::kFloat && (p.normalize || workspace.key_sum.numel == 0) &&
                    workspace.extra.numel == 0 && p.state_head == 0 && (P == Pass::Forward || P == Pass::GradKV),
                "fast_causal_attn: internal: a one-launch segmented pass sums float32 states (and a vector) alone");
    KernelParams one = p;
    const int64_t sums = p.num_seqs * p.H * p.segments * Da * Dc;
    const int64_t own_vector_sums = p.normalize ? p.num_seqs * p.H * p.segments * (P == Pass::Forward ? Da : Dc) : 0;
    // the segments' own sums (and vector sums), then the counter and one flag a block (zeroed)
    const at::Tensor buffer =
        at::empty({sums + own_vector_sums + 1 + blocks}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA));
    one.seg_sums = buffer.data_ptr<float>();
    one.seg_own_vector_sums = p.normalize ? one.seg_sums + sums : nullptr;
    one.lookback = reinterpret_cast<unsigned*>(one.seg_sums + sums + own_vector_sums);
    C10_CUDA_CHECK(cudaMemsetAsync(one.lookback, 0, size_t(1 + blocks) * sizeof(unsigned), stream));
    one_launch<<<dim3(unsigned(blocks)), dim3(threads), smem, stream>>>(one, Da, Dc, col_tiles);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;  // (the buffer is the allocator's again after the kernel, in stream order)
  }
  allow_dynamic_smem(kernel, smem);
  if (p.segments > 1 && !p.seg_from_forward) {
    KernelParams sums = p;
    sums.state_only = true;
    const int64_t sum_blocks = blocks / p.segments * launched_segments(sums) * (p.state_head > 0 ? 2 : 1);
    TORCH_CHECK(sum_blocks <= int64_t(0x7fffffff), "fast_causal_attn: too many state blocks: ", sum_blocks);
    kernel<<<dim3(unsigned(sum_blocks)), dim3(threads), smem, stream>>>(sums, Da, Dc, col_tiles);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const int64_t pairs = p.num_seqs * p.H;
    const SegmentWorkspace::Region heads[3] = {workspace.state, workspace.key_sum, workspace.extra};
    const SegmentWorkspace::Region tails[3] = {workspace.tail_state, workspace.tail_key_sum, workspace.tail_extra};
    for (int i = 0; i < 3; ++i) {
      if (workspace.dtype == at::kDouble) {
        scan_segments(static_cast<double*>(heads[i].data), static_cast<const double*>(tails[i].data), heads[i].numel,
                      pairs, p.segments, PassTraits<P>::kReverse, stream);
      } else {
        scan_segments(static_cast<float*>(heads[i].data), static_cast<const float*>(tails[i].data), heads[i].numel,
                      pairs, p.segments, PassTraits<P>::kReverse, stream);
      }
    }
  }
  kernel<<<dim3(unsigned(blocks)), dim3(threads), smem, stream>>>(p, Da, Dc, col_tiles);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace fast_causal_attn
