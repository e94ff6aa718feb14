// Parameters of the causal linear attention kernels: raw pointers and strides only, no torch types,
// so that CPU and CUDA kernels (and their compile units) share one description of the problem.
//
// Every tensor is seen as [B, H, L, D] whatever its memory layout ("bhld" or "blhd"): the layout
// lives entirely in the strides. All strides are in elements and 64-bit; the last dimension is
// contiguous (the host code guarantees it).
#pragma once

#include <cstdint>

#include <c10/core/ScalarType.h>
#include <c10/macros/Macros.h>

namespace fast_causal_attn {

// One [B, H, L, D] operand: base pointer plus the strides of its first three dimensions.
struct StridedTensor {
  void* ptr = nullptr;
  int64_t stride_b = 0;
  int64_t stride_h = 0;
  int64_t stride_l = 0;

  C10_HOST_DEVICE int64_t offset(int64_t b, int64_t h, int64_t t) const {
    return b * stride_b + h * stride_h + t * stride_l;
  }
};

// One (sequence, head) of a problem: its batch entry, its timesteps [begin, begin + length), and
// its index into the states and the den rows.
struct Sequence {
  int64_t b, h, begin, length;
  int64_t state;  // sequence * H + head: the [.., H, ..] state's row

  template <typename Params>
  C10_HOST_DEVICE static Sequence of(const Params& p, int64_t index) {  // index in [0, num_seqs * H)
    const int64_t seq = index / p.H, h = index % p.H;
    if (p.cu_seqlens == nullptr) return {seq, h, 0, p.L, index};
    return {0, h, p.cu_seqlens[seq], p.cu_seqlens[seq + 1] - p.cu_seqlens[seq], index};
  }
  // Offset of timestep t of this sequence in a contiguous [B, H, L] array (den).
  C10_HOST_DEVICE int64_t row(int64_t L, int64_t H, int64_t t) const { return (b * H + h) * L + begin + t; }
};

// O[t] = q'[t] (S0 + sum_{s<=t} k[s] v[s]^T), q' = scale * q, optionally divided by
// q'[t] . (z0 + sum_{s<=t} k[s]) + eps, where S0 (kv) and z0 (k_sum) are the initial state (zero
// unless given). The final state S0 + sum k v^T, z0 + sum k is written when asked for.
//
// With cu_seqlens the inputs are packed (B = 1) and sequence i is timesteps
// [cu_seqlens[i], cu_seqlens[i + 1]); attention never crosses a boundary, and the states are per
// sequence ([N, H, ...] instead of [B, H, ...]).
struct ForwardParams {
  c10::ScalarType dtype;   // of q, k, v and o; accumulation is float (double for double inputs)
  int64_t B = 0, H = 0, L = 0;
  int64_t E = 0;           // head dim of q and k
  int64_t M = 0;           // head dim of v and o

  StridedTensor q;         // [B, H, L, E]
  StridedTensor k;         // [B, H, L, E]
  StridedTensor v;         // [B, H, L, M]
  StridedTensor o;         // [B, H, L, M], written

  double scale = 1.0;
  bool normalize = false;
  double eps = 1e-6;
  // [B, H, L] contiguous, accumulation dtype; written when normalize: the denominator
  // q'[t] . sum_{s<=t} k[s] + eps, kept for the backward.
  void* den = nullptr;

  const int64_t* cu_seqlens = nullptr;  // [N + 1], or nullptr: every batch entry is one sequence
  int64_t num_seqs = 0;                 // N when cu_seqlens, else B

  // The state, contiguous, accumulation dtype; each may be nullptr (no initial state: zero).
  const void* initial_kv = nullptr;     // [num_seqs, H, E, M]
  const void* initial_k_sum = nullptr;  // [num_seqs, H, E]
  void* final_kv = nullptr;             // [num_seqs, H, E, M], written
  void* final_k_sum = nullptr;          // [num_seqs, H, E], written

  // Keep the segment starts of a segmented forward for the backward (ForwardSegments in ops.h),
  // or, in the backward, float32's dk pass's for its dv pass; otherwise they are freed with the
  // launch.
  bool keep_segments = false;
};

// Gradients of the forward above. With g[t] = dO[t] / den[t] and c[t] = -(g[t] . O[t]) (normalize;
// otherwise g = dO and no c), the three gradients are causal products of the same kind as the
// forward, which is why one kernel family serves both directions:
//   dq'[t] = sum_{s<=t} ([g, c][t] . [v, 1][s]) k[s]      forward in time
//   dk[s]  = sum_{t>=s} ([v, 1][s] . [g, c][t]) q'[t]     reverse in time
//   dv[s]  = sum_{t>=s} (k[s] . q'[t]) g[t]               reverse in time
//
// The state enters the same products as their starting points: the dq product starts from
// [S0^T; z0^T], the dk product from [dS_final^T; dz_final^T] and ends at dz0 in its last row, the
// dv product starts from dS_final and ends at dS0.
struct BackwardParams : ForwardParams {
  StridedTensor dout;      // [B, H, L, M]
  StridedTensor dq;        // [B, H, L, E], written
  StridedTensor dk;        // [B, H, L, E], written
  StridedTensor dv;        // [B, H, L, M], written
  // o (inherited) is read, not written, in the backward: only when normalize. initial_kv and
  // initial_k_sum (inherited) are read; final_kv and final_k_sum are unused.

  // Contiguous, accumulation dtype, each may be nullptr.
  const void* grad_final_kv = nullptr;     // [num_seqs, H, E, M]
  const void* grad_final_k_sum = nullptr;  // [num_seqs, H, E]
  void* grad_initial_kv = nullptr;         // [num_seqs, H, E, M], written
  void* grad_initial_k_sum = nullptr;      // [num_seqs, H, E], written

  // The forward's segment starts (ForwardSegments in ops.h), or nullptr: with forward_segments > 1
  // time segments, the state S = sum k v^T before each, [num_seqs * H, segments, E, M], and the
  // key sum before each, [num_seqs * H, segments, E] (nullptr unless the forward tracked it).
  // The dq pass's state is [S^T; z^T], so its segments may start from these. (launch_backward_cuda
  // points the dv pass's copy of these at the dk pass's starts, dO^T q, where it kept them.)
  // Where the forward decided on the one-pass backward (one_pass_backward in
  // csrc/cuda/dispatch.cuh), forward_segment_kv holds each segment's end instead, the initial
  // state included, and forward_segments may be 1.
  const void* forward_segment_kv = nullptr;
  const void* forward_segment_k_sum = nullptr;
  int64_t forward_segments = 0;
};

}  // namespace fast_causal_attn
