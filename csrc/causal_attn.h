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

// O[t] = q'[t] (S0 + sum_{s<=t} k[s] v[s]^T), q' = scale * q, optionally divided by
// q'[t] . (z0 + sum_{s<=t} k[s]) + eps, where S0 (kv) and z0 (k_sum) are the initial state (zero
// unless given). The final state S0 + sum k v^T, z0 + sum k is written when asked for.
//
// Per-sequence offsets (cu_seqlens) slot in here later: the kernels already run one (batch, head)
// sequence at a time from a running state.
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

  // The state, contiguous, accumulation dtype; each may be nullptr (no initial state: zero).
  const void* initial_kv = nullptr;     // [B, H, E, M]
  const void* initial_k_sum = nullptr;  // [B, H, E]
  void* final_kv = nullptr;             // [B, H, E, M], written
  void* final_k_sum = nullptr;          // [B, H, E], written
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
  const void* grad_final_kv = nullptr;     // [B, H, E, M]
  const void* grad_final_k_sum = nullptr;  // [B, H, E]
  void* grad_initial_kv = nullptr;         // [B, H, E, M], written
  void* grad_initial_k_sum = nullptr;      // [B, H, E], written
};

}  // namespace fast_causal_attn
