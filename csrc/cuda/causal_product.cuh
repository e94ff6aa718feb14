// The recurrent (per-timestep) CUDA kernel family: one template serves the forward and the three
// gradient passes, in either direction in time, as the seed's lmha kernels do with GO_BACKWARD.
//
// Every pass is the causal product  out[t] = sum_{s<=t} (a[t] . b[s]) c[s]  (or s >= t in
// reverse), computed with a running state S = sum_s b[s] c[s]^T of Da x 32 per block:
//   - a block owns one (batch, head) and 32 columns of c (one per lane), and the full Da rows of the
//     state, split over GROUPS warps of ROWS rows each, all in registers;
//   - time advances in tiles of kSteps timesteps: a, b, c of the tile are staged in shared memory
//     (converted to the accumulation type, scaled and normalized as the pass asks), then each
//     thread walks the tile step by step: S[r] += b[t][r] c[t][lane], part[t] += a[t][r] S[r];
//   - the GROUPS partial sums of each output are added through shared memory and written once.
// The passes differ only in what a, b and c are (see the Pass* structs below).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include "../causal_attn.h"

namespace fast_causal_attn {
namespace cuda {

constexpr int kWarp = 32;
constexpr int kSteps = 32;  // timesteps per tile; the normalizer's prefix sum maps them to lanes
constexpr int kCols = 32;   // columns of c per block: one per lane

enum class Pass { Forward, GradQ, GradK, GradV };

struct KernelParams : BackwardParams {
  // -(dO[t] . O[t]) / den[t], made by backward_prepare_kernel when normalize.
  void* grad_den = nullptr;  // [B, H, L] contiguous, accumulation dtype
  // Head dims above the largest bucket split the state's rows into slabs, one block each; the
  // slabs' partial outputs (and normalizer) are added into these, then finish_slabs_kernel
  // writes the output. Unused (nullptr, 1 slab) otherwise.
  int64_t slabs = 1;
  void* slab_out = nullptr;  // [B, H, L, Dc] contiguous, accumulation dtype, zeroed
  void* slab_den = nullptr;  // [B, H, L] contiguous, accumulation dtype, zeroed (forward normalize)
};

template <typename scalar_t>
__device__ __forceinline__ const scalar_t* row_ptr(const StridedTensor& t, int64_t b, int64_t h, int64_t s) {
  return static_cast<const scalar_t*>(t.ptr) + t.offset(b, h, s);
}

template <typename scalar_t>
__device__ __forceinline__ scalar_t* mutable_row_ptr(const StridedTensor& t, int64_t b, int64_t h, int64_t s) {
  return static_cast<scalar_t*>(t.ptr) + t.offset(b, h, s);
}

// What a, b and c are in each pass, element by element (r indexes a and b, m indexes c), and
// what becomes of the output. den and grad_den point at this (batch, head)'s [L] slice.
//
//   forward  a = q' = scale q   b = k            c = v          out = a S [/ den]
//   grad q   a = g              b = v            c = k          dq  = scale * out
//   grad k   a = v              b = g            c = q'         dk  = out        (reverse)
//   grad v   a = k              b = q'           c = g          dv  = out        (reverse)
// with g = dO / den under normalize (dO otherwise). Under normalize the gradients of q and k also
// have an extra row, the 1 of [v, 1] against the c = -(g . O) of [g, c]; forward normalize adds
// the denominator q' . sum k (an extra column of ones in c).
template <Pass P>
struct PassTraits {
  static constexpr bool kReverse = P == Pass::GradK || P == Pass::GradV;
  static constexpr bool kMayHaveExtraRow = P == Pass::GradQ || P == Pass::GradK;
  static constexpr bool kMayHaveDenominator = P == Pass::Forward;
};

template <Pass P, typename scalar_t, typename acc_t>
struct Operands {
  const KernelParams& p;
  int64_t b, h;
  const acc_t* den;       // [L] in the gradients under normalize, else nullptr
  const acc_t* grad_den;  // [L] in the gradients of q and k under normalize, else nullptr

  __device__ acc_t inv_den(int64_t s) const { return den ? acc_t(1) / den[s] : acc_t(1); }

  __device__ acc_t a_at(int64_t s, int r) const {
    switch (P) {
      case Pass::Forward: return acc_t(p.scale) * acc_t(row_ptr<scalar_t>(p.q, b, h, s)[r]);
      case Pass::GradQ: return acc_t(row_ptr<scalar_t>(p.dout, b, h, s)[r]) * inv_den(s);
      case Pass::GradK: return acc_t(row_ptr<scalar_t>(p.v, b, h, s)[r]);
      case Pass::GradV: return acc_t(row_ptr<scalar_t>(p.k, b, h, s)[r]);
    }
    return acc_t(0);
  }
  __device__ acc_t b_at(int64_t s, int r) const {
    switch (P) {
      case Pass::Forward: return acc_t(row_ptr<scalar_t>(p.k, b, h, s)[r]);
      case Pass::GradQ: return acc_t(row_ptr<scalar_t>(p.v, b, h, s)[r]);
      case Pass::GradK: return acc_t(row_ptr<scalar_t>(p.dout, b, h, s)[r]) * inv_den(s);
      case Pass::GradV: return acc_t(p.scale) * acc_t(row_ptr<scalar_t>(p.q, b, h, s)[r]);
    }
    return acc_t(0);
  }
  __device__ acc_t c_at(int64_t s, int64_t m) const {
    switch (P) {
      case Pass::Forward: return acc_t(row_ptr<scalar_t>(p.v, b, h, s)[m]);
      case Pass::GradQ: return acc_t(row_ptr<scalar_t>(p.k, b, h, s)[m]);
      case Pass::GradK: return acc_t(p.scale) * acc_t(row_ptr<scalar_t>(p.q, b, h, s)[m]);
      case Pass::GradV: return acc_t(row_ptr<scalar_t>(p.dout, b, h, s)[m]) * inv_den(s);
    }
    return acc_t(0);
  }
  // The extra row's a and b (normalize, gradients of q and k only).
  __device__ acc_t extra_a(int64_t s) const { return P == Pass::GradQ ? grad_den[s] : acc_t(1); }
  __device__ acc_t extra_b(int64_t s) const { return P == Pass::GradQ ? acc_t(1) : grad_den[s]; }

  // denominator: the forward's normalizer at s (1 without normalize).
  __device__ void store(int64_t s, int64_t m, acc_t value, acc_t denominator) const {
    switch (P) {
      case Pass::Forward: mutable_row_ptr<scalar_t>(p.o, b, h, s)[m] = scalar_t(value / denominator); break;
      case Pass::GradQ: mutable_row_ptr<scalar_t>(p.dq, b, h, s)[m] = scalar_t(acc_t(p.scale) * value); break;
      case Pass::GradK: mutable_row_ptr<scalar_t>(p.dk, b, h, s)[m] = scalar_t(value); break;
      case Pass::GradV: mutable_row_ptr<scalar_t>(p.dv, b, h, s)[m] = scalar_t(value); break;
    }
  }
};

// Shared memory of one block, in accumulation-type elements: the a and b tiles (later reused for
// the partial sums), the c tile, the extra row, the normalizer's partial sums and the normalizer.
template <int ROWS, int GROUPS>
struct SmemLayout {
  static constexpr int kRows = ROWS * GROUPS;
  static constexpr int kTiles = 2 * kSteps * kRows;
  static constexpr int kPartials = GROUPS * kSteps * kCols;
  static constexpr int kAB = kTiles > kPartials ? kTiles : kPartials;
  static constexpr int kC = kSteps * kCols;
  static constexpr int kExtra = 2 * kSteps;
  static constexpr int kDenPartials = GROUPS * kSteps;
  static constexpr int kDen = kSteps;
  static constexpr int kElements = kAB + kC + kExtra + kDenPartials + kDen;
};

// grid.x = (batch * heads) * column tiles * slabs; block = GROUPS warps; slab i holds rows
// [i * ROWS * GROUPS, (i + 1) * ROWS * GROUPS) of the Da rows.
template <Pass P, typename scalar_t, int ROWS, int GROUPS>
__global__ void __launch_bounds__(GROUPS * kWarp)
    causal_product_kernel(const KernelParams p, int64_t Da, int64_t Dc, int64_t col_tiles) {
  using acc_t = at::opmath_type<scalar_t>;
  using Traits = PassTraits<P>;
  using Smem = SmemLayout<ROWS, GROUPS>;
  constexpr int kRows = Smem::kRows;
  constexpr int kThreads = GROUPS * kWarp;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  acc_t* a_s = reinterpret_cast<acc_t*>(smem_raw);  // [kSteps][kRows]
  acc_t* b_s = a_s + kSteps * kRows;                // [kSteps][kRows]
  acc_t* partial_s = a_s;                           // [GROUPS][kSteps][kCols], once a, b are used
  acc_t* c_s = a_s + Smem::kAB;                     // [kSteps][kCols]
  acc_t* extra_s = c_s + Smem::kC;                  // [2][kSteps]: extra row's a, then b
  acc_t* den_partial_s = extra_s + Smem::kExtra;    // [GROUPS][kSteps]
  acc_t* den_s = den_partial_s + Smem::kDenPartials;  // [kSteps]

  const int tid = threadIdx.x, group = tid / kWarp, lane = tid % kWarp, row0 = group * ROWS;
  const int64_t slab = blockIdx.x % p.slabs, tile_index = blockIdx.x / p.slabs;
  const int64_t col_tile = tile_index % col_tiles, pair = tile_index / col_tiles;
  const int64_t b = pair / p.H, h = pair % p.H;
  const int64_t row_base = slab * kRows;
  const bool split = p.slabs > 1;
  const int64_t m0 = col_tile * kCols;
  const int cols = int(Dc - m0 < kCols ? Dc - m0 : kCols);
  const int64_t L = p.L;

  const bool normalize = p.normalize;
  const bool extra_row = Traits::kMayHaveExtraRow && normalize && slab == 0;
  const bool denominator = Traits::kMayHaveDenominator && normalize;
  acc_t* den_out = denominator ? static_cast<acc_t*>(p.den) + pair * L : nullptr;
  const acc_t* den_in =
      (normalize && P != Pass::Forward) ? static_cast<const acc_t*>(p.den) + pair * L : nullptr;
  const acc_t* grad_den = extra_row ? static_cast<const acc_t*>(p.grad_den) + pair * L : nullptr;
  const Operands<P, scalar_t, acc_t> ops{p, b, h, den_in, grad_den};

  acc_t state[ROWS];
  acc_t key_sum[ROWS];  // sum_s b[s] over this thread's rows: the normalizer's state
#pragma unroll
  for (int r = 0; r < ROWS; ++r) state[r] = key_sum[r] = acc_t(0);
  acc_t extra_state = acc_t(0);  // sum_s extra_b[s] c[s][lane]

  const int64_t tiles = (L + kSteps - 1) / kSteps;
  for (int64_t it = 0; it < tiles; ++it) {
    const int64_t t0 = (Traits::kReverse ? tiles - 1 - it : it) * kSteps;
    const int n = int(L - t0 < kSteps ? L - t0 : kSteps);

    // Stage the tile; rows past L or Da and columns past Dc are zero, so they add nothing.
    for (int i = tid; i < kSteps * kRows; i += kThreads) {
      const int t = i / kRows, r = i % kRows;
      const bool valid = t < n && row_base + r < Da;
      a_s[i] = valid ? ops.a_at(t0 + t, int(row_base + r)) : acc_t(0);
      b_s[i] = valid ? ops.b_at(t0 + t, int(row_base + r)) : acc_t(0);
    }
    for (int i = tid; i < kSteps * kCols; i += kThreads) {
      const int t = i / kCols, m = i % kCols;
      c_s[i] = (t < n && m < cols) ? ops.c_at(t0 + t, m0 + m) : acc_t(0);
    }
    if (extra_row && tid < kSteps) {
      extra_s[tid] = tid < n ? ops.extra_a(t0 + tid) : acc_t(0);
      extra_s[kSteps + tid] = tid < n ? ops.extra_b(t0 + tid) : acc_t(0);
    }
    __syncthreads();

    // The normalizer q'[t] . sum_{s<=t} k[s]: lanes are timesteps here, a prefix sum over lanes
    // per row, then a dot product with a (forward only, so never reversed).
    if (denominator) {
      acc_t den_partial = acc_t(0);
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        acc_t running = b_s[lane * kRows + row0 + r];
#pragma unroll
        for (int offset = 1; offset < kWarp; offset *= 2) {
          const acc_t up = __shfl_up_sync(0xffffffffu, running, offset);
          if (lane >= offset) running += up;
        }
        den_partial += a_s[lane * kRows + row0 + r] * (key_sum[r] + running);
        key_sum[r] += __shfl_sync(0xffffffffu, running, kWarp - 1);
      }
      den_partial_s[group * kSteps + lane] = den_partial;
    }

    // The recurrence: this thread's rows of the state, its lane's column.
    acc_t part[kSteps];
#pragma unroll
    for (int j = 0; j < kSteps; ++j) {
      const int t = Traits::kReverse ? kSteps - 1 - j : j;
      const acc_t cv = c_s[t * kCols + lane];
      const acc_t* a_t = a_s + t * kRows + row0;
      const acc_t* b_t = b_s + t * kRows + row0;
      acc_t sum0 = acc_t(0), sum1 = acc_t(0);
#pragma unroll
      for (int r = 0; r < ROWS; r += 2) {
        state[r] += b_t[r] * cv;
        sum0 += a_t[r] * state[r];
        if (r + 1 < ROWS) {
          state[r + 1] += b_t[r + 1] * cv;
          sum1 += a_t[r + 1] * state[r + 1];
        }
      }
      if (extra_row) {
        extra_state += extra_s[kSteps + t] * cv;
        if (group == 0) sum0 += extra_s[t] * extra_state;
      }
      part[t] = sum0 + sum1;
    }
    __syncthreads();  // a_s and b_s become partial_s

#pragma unroll
    for (int t = 0; t < kSteps; ++t) partial_s[(group * kSteps + t) * kCols + lane] = part[t];
    if (denominator && tid < kSteps) {
      acc_t d = split ? acc_t(0) : acc_t(p.eps);
#pragma unroll
      for (int g = 0; g < GROUPS; ++g) d += den_partial_s[g * kSteps + tid];
      den_s[tid] = d;
      if (col_tile == 0 && tid < n) {
        if (split) {
          atomicAdd(static_cast<acc_t*>(p.slab_den) + pair * L + t0 + tid, d);
        } else {
          den_out[t0 + tid] = d;
        }
      }
    }
    __syncthreads();

    for (int i = tid; i < kSteps * kCols; i += kThreads) {
      const int t = i / kCols, m = i % kCols;
      if (t < n && m < cols) {
        acc_t sum = acc_t(0);
#pragma unroll
        for (int g = 0; g < GROUPS; ++g) sum += partial_s[(g * kSteps + t) * kCols + m];
        if (split) {
          atomicAdd(static_cast<acc_t*>(p.slab_out) + (pair * L + t0 + t) * Dc + m0 + m, sum);
        } else {
          ops.store(t0 + t, m0 + m, sum, denominator ? den_s[t] : acc_t(1));
        }
      }
    }
    __syncthreads();  // the next tile overwrites shared memory
  }
}

// Writes the output from the slabs' sums: one thread per output element.
template <Pass P, typename scalar_t>
__global__ void finish_slabs_kernel(const KernelParams p, int64_t Dc) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= p.B * p.H * p.L * Dc) return;
  const int64_t m = i % Dc, row = i / Dc, s = row % p.L, pair = row / p.L;
  const bool normalize = p.normalize;
  const acc_t* den = (normalize && P != Pass::Forward) ? static_cast<const acc_t*>(p.den) + pair * p.L : nullptr;
  const Operands<P, scalar_t, acc_t> ops{p, pair / p.H, pair % p.H, den, nullptr};
  acc_t denominator = acc_t(1);
  if (P == Pass::Forward && normalize) {
    denominator = static_cast<const acc_t*>(p.slab_den)[row] + acc_t(p.eps);
    if (m == 0) static_cast<acc_t*>(p.den)[row] = denominator;
  }
  ops.store(s, m, static_cast<const acc_t*>(p.slab_out)[i], denominator);
}

template <Pass P, typename scalar_t, int ROWS, int GROUPS>
void launch_causal_product(const KernelParams& params, int64_t Da, int64_t Dc, cudaStream_t stream) {
  using acc_t = at::opmath_type<scalar_t>;
  KernelParams p = params;
  p.slabs = (Da + ROWS * GROUPS - 1) / (ROWS * GROUPS);
  at::Tensor slab_out, slab_den;
  if (p.slabs > 1) {
    const auto options = at::TensorOptions().dtype(c10::CppTypeToScalarType<acc_t>::value).device(at::kCUDA);
    slab_out = at::zeros({p.B * p.H * p.L * Dc}, options);
    slab_den = at::zeros({p.normalize ? p.B * p.H * p.L : 0}, options);
    p.slab_out = slab_out.data_ptr();
    p.slab_den = slab_den.data_ptr();
  }
  const int64_t col_tiles = (Dc + kCols - 1) / kCols;
  const int64_t blocks = p.B * p.H * col_tiles * p.slabs;
  TORCH_CHECK(blocks <= int64_t(0x7fffffff), "fast_causal_attn: too many (batch, head, column) tiles: ", blocks);
  const size_t smem = SmemLayout<ROWS, GROUPS>::kElements * sizeof(acc_t);
  auto kernel = causal_product_kernel<P, scalar_t, ROWS, GROUPS>;
  if (smem > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  }
  kernel<<<dim3(unsigned(blocks)), dim3(GROUPS * kWarp), smem, stream>>>(p, Da, Dc, col_tiles);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (p.slabs > 1) {
    constexpr int kThreads = 256;
    const int64_t elements = p.B * p.H * p.L * Dc;
    const int64_t finish_blocks = (elements + kThreads - 1) / kThreads;
    TORCH_CHECK(finish_blocks <= int64_t(0x7fffffff), "fast_causal_attn: output too large: ", elements);
    finish_slabs_kernel<P, scalar_t><<<unsigned(finish_blocks), kThreads, 0, stream>>>(p, Dc);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// The head-dim bucket: the state's Da rows over GROUPS warps of ROWS rows.
template <Pass P, typename scalar_t>
void run_pass(const KernelParams& p, cudaStream_t stream) {
  const bool a_is_e = P == Pass::Forward || P == Pass::GradV;
  const int64_t Da = a_is_e ? p.E : p.M;
  const int64_t Dc = a_is_e ? p.M : p.E;
  if (Da <= 32) {
    launch_causal_product<P, scalar_t, 8, 4>(p, Da, Dc, stream);
  } else if (Da <= 48) {
    launch_causal_product<P, scalar_t, 12, 4>(p, Da, Dc, stream);
  } else if (Da <= 64) {
    launch_causal_product<P, scalar_t, 16, 4>(p, Da, Dc, stream);
  } else if (Da <= 128) {
    launch_causal_product<P, scalar_t, 16, 8>(p, Da, Dc, stream);
  } else {  // 256 rows a block; above that, slabs of 256
    launch_causal_product<P, scalar_t, 32, 8>(p, Da, Dc, stream);
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

}  // namespace cuda
}  // namespace fast_causal_attn
