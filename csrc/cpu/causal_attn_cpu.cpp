// CPU kernels: the chunked form of the causal product.
//
// Every pass (the forward and the three gradients) is one causal product
//     out[t] = sum_{s<=t} (a[t] . b[s]) c[s]      (forward in time)
//     out[t] = sum_{s>=t} (a[t] . b[s]) c[s]      (reverse in time)
// computed a chunk of kChunk timesteps at a time: inside the chunk a masked product
// mask(A B^T) C, across chunks a running state S = sum b[s] c[s]^T, so that
//     out_chunk = mask(A B^T) C + A S,   then   S += B^T C.
// The operands are packed per chunk into contiguous accumulation-dtype buffers, which is where
// scale, dtype conversion, layout strides and the normalize terms are applied: the products
// themselves are plain small GEMMs. dk and dv, whose states are each other's transposes, mostly
// run as one walk with one state (ChunkedGradKV; backward_cpu_kernel says where).
#include <algorithm>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>  // F16C's conversions (load_row and store_row of float16)
#endif

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../causal_attn.h"
#include "../ops.h"

// The BLAS that torch links (MKL or OpenBLAS on Linux) exports these; declared weak so that a
// torch without them still loads us, and small_gemm falls back to plain loops.
extern "C" {
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc) __attribute__((weak));
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc) __attribute__((weak));
}

namespace fast_causal_attn {
namespace {

// Timesteps per chunk. The intra-chunk work grows with the chunk (kChunk * (Da + Dc) flops per
// timestep) and the state update does not (2 * Da * Dc), while smaller GEMMs run further below the
// BLAS peak. Measured on the 2-core CI machine (2026-11-30, fp32, forward+backward, ms, two runs
// each): B, H, L, E = 4, 8, 2048, 64: 55-64 at 32, 62-68 at 64, 94 at 128; 1, 2, 8192, 64: 18 at 32,
// 22-23 at 64, 31 at 128. The forward alone is within noise of 64.
constexpr int64_t kChunk = 32;
// States of at most this many elements (Da x Dc) are advanced one timestep at a time instead of
// by GEMMs (see recurrent_step). Measured on the 2-core machine (ms fwd / fwd+bwd through the op,
// 2026-11-30): E = M = 8, B,H,L = 2,2,256: 0.049 / 0.143 by GEMMs, 0.026-0.037 / 0.074-0.092 one step
// at a time; E = 16, M = 24: 0.050 / 0.14 by GEMMs, 0.094 / 0.29 one step at a time (state 384).
constexpr int64_t kMaxRecurrentState = 128;
// A column block narrower than this spends more on recomputing mask(A B^T) than it gains in
// parallelism.
constexpr int64_t kMinColumnsPerBlock = 32;

// Row-major C = alpha * op(A) op(B) + beta * C on the column-major BLAS: the row-major product is
// the column-major C^T = op(B)^T op(A)^T, so the operands swap and the transpose flags stay.
template <typename acc_t>
void blas_gemm(bool trans_a, bool trans_b, int m, int n, int k, acc_t alpha, const acc_t* a, int lda,
               const acc_t* b, int ldb, acc_t beta, acc_t* c, int ldc);

template <>
void blas_gemm<float>(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
                      const float* b, int ldb, float beta, float* c, int ldc) {
  const char ta = trans_a ? 'T' : 'N', tb = trans_b ? 'T' : 'N';
  sgemm_(&tb, &ta, &n, &m, &k, &alpha, b, &ldb, a, &lda, &beta, c, &ldc);
}

template <>
void blas_gemm<double>(bool trans_a, bool trans_b, int m, int n, int k, double alpha, const double* a, int lda,
                       const double* b, int ldb, double beta, double* c, int ldc) {
  const char ta = trans_a ? 'T' : 'N', tb = trans_b ? 'T' : 'N';
  dgemm_(&tb, &ta, &n, &m, &k, &alpha, b, &ldb, a, &lda, &beta, c, &ldc);
}

template <typename acc_t>
bool have_blas() {
  return std::is_same<acc_t, float>::value ? sgemm_ != nullptr : dgemm_ != nullptr;
}

// C[m, n] = op(A)[m, k] op(B)[k, n] + beta * C, row-major, beta 0 or 1. Chunk-sized operands
// only (at most kChunk x max(E, M) + 1), so int sizes are safe for the BLAS call.
template <typename acc_t>
void small_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const acc_t* a, int64_t lda,
                const acc_t* b, int64_t ldb, acc_t beta, acc_t* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (have_blas<acc_t>()) {
    blas_gemm<acc_t>(trans_a, trans_b, int(m), int(n), int(k), acc_t(1), a, int(lda), b, int(ldb), beta, c,
                     int(ldc));
    return;
  }
  for (int64_t i = 0; i < m; ++i) {
    acc_t* c_row = c + i * ldc;
    if (beta == acc_t(0)) std::fill(c_row, c_row + n, acc_t(0));
    for (int64_t p = 0; p < k; ++p) {
      const acc_t a_ip = trans_a ? a[p * lda + i] : a[i * lda + p];
      if (trans_b) {
        for (int64_t j = 0; j < n; ++j) c_row[j] += a_ip * b[j * ldb + p];
      } else {
        const acc_t* b_row = b + p * ldb;
        for (int64_t j = 0; j < n; ++j) c_row[j] += a_ip * b_row[j];
      }
    }
  }
}

// Calls chunk(t0, n) for timesteps [t0, t0 + n), kChunk at a time, over [0, L) (from the end when
// REVERSE).
template <bool REVERSE, class Chunk>
void walk_chunks(int64_t L, Chunk&& chunk) {
  const int64_t chunks = (L + kChunk - 1) / kChunk;
  for (int64_t i = 0; i < chunks; ++i) {
    const int64_t t0 = (REVERSE ? chunks - 1 - i : i) * kChunk;
    chunk(t0, std::min(kChunk, L - t0));
  }
}

// Zeroes the scores of a chunk's n x n block (rows kChunk apart) that its causal product leaves
// out: row i keeps the columns s <= i in forward time, s >= i in reverse.
template <bool REVERSE, typename acc_t>
void mask_scores(acc_t* scores, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    acc_t* row = scores + i * kChunk;
    if (REVERSE) {
      std::fill(row, row + i, acc_t(0));
    } else {
      std::fill(row + i + 1, row + n, acc_t(0));
    }
  }
}

// Packed chunk operands and the running state of one causal product.
template <typename acc_t>
class ChunkedCausalProduct {
 public:
  ChunkedCausalProduct(int64_t a_cols, int64_t c_cols)
      : da_(a_cols), dc_(c_cols), a_(kChunk * a_cols), b_(kChunk * a_cols), c_(kChunk * c_cols),
        scores_(kChunk * kChunk), out_(kChunk * c_cols), state_(a_cols * c_cols, acc_t(0)) {}

  acc_t* a_row(int64_t r) { return a_.data() + r * da_; }
  acc_t* b_row(int64_t r) { return b_.data() + r * da_; }
  acc_t* c_row(int64_t r) { return c_.data() + r * dc_; }
  const acc_t* out_row(int64_t r) const { return out_.data() + r * dc_; }
  // Row r of the running state (Da x Dc): set it before run() to start from a given state, read it
  // after run() for the final one.
  acc_t* state_row(int64_t r) { return state_.data() + r * dc_; }

  // Walks L timesteps chunk by chunk (from the end when REVERSE): pack(t0, n) fills rows
  // [0, n) of a, b, c with timesteps [t0, t0 + n); unpack(t0, n) reads the same rows of out.
  template <bool REVERSE, class Pack, class Unpack>
  void run(int64_t L, Pack&& pack, Unpack&& unpack) {
    walk_chunks<REVERSE>(L, [&](int64_t t0, int64_t n) {
      pack(t0, n);
      step<REVERSE>(n);
      unpack(t0, n);
    });
  }

 private:
  template <bool REVERSE>
  void step(int64_t n) {
    if (da_ * dc_ <= kMaxRecurrentState) {
      if (!fixed_step<REVERSE>(n)) recurrent_step<REVERSE>(n);
      return;
    }
    acc_t* scores = scores_.data();
    small_gemm<acc_t>(false, true, n, n, da_, a_.data(), da_, b_.data(), da_, acc_t(0), scores, kChunk);
    mask_scores<REVERSE>(scores, n);
    small_gemm<acc_t>(false, false, n, dc_, da_, a_.data(), da_, state_.data(), dc_, acc_t(0), out_.data(), dc_);
    small_gemm<acc_t>(false, false, n, dc_, n, scores, kChunk, c_.data(), dc_, acc_t(1), out_.data(), dc_);
    small_gemm<acc_t>(true, false, da_, dc_, n, b_.data(), da_, c_.data(), dc_, acc_t(1), state_.data(), dc_);
  }

  // The same chunk one timestep at a time: S += b[i] c[i]^T, out[i] = a[i] S. 4 Da Dc flops a
  // timestep against the GEMMs' 2 kChunk (Da + Dc) + 4 Da Dc, and no BLAS call overheads: the
  // faster form for a small state.
  template <bool REVERSE>
  void recurrent_step(int64_t n) {
    acc_t* __restrict__ state = state_.data();
    for (int64_t j = 0; j < n; ++j) {
      const int64_t i = REVERSE ? n - 1 - j : j;
      const acc_t* __restrict__ a = a_.data() + i * da_;
      const acc_t* __restrict__ b = b_.data() + i * da_;
      const acc_t* __restrict__ c = c_.data() + i * dc_;
      acc_t* __restrict__ out = out_.data() + i * dc_;
      std::fill(out, out + dc_, acc_t(0));
      for (int64_t r = 0; r < da_; ++r) {
        acc_t* __restrict__ s = state + r * dc_;
        const acc_t b_r = b[r], a_r = a[r];
        for (int64_t m = 0; m < dc_; ++m) {
          s[m] += b_r * c[m];
          out[m] += a_r * s[m];
        }
      }
    }
  }

  // recurrent_step_fixed where the state's shape is one it is built for (rows and columns of 4, 8
  // or 16, at most kMaxRecurrentState elements); false otherwise. On the 2-core machine (fp32 ms,
  // fwd / fwd+bwd, three runs) B,H,L,E,M = 8,8,512,8,8 went from 1.0-1.1 / 3.7-4.2 (runtime sizes)
  // to 0.34-0.54 / 1.6-2.2, where fast-transformers' loops take 0.75 / 2.5-2.8.
  template <bool REVERSE>
  bool fixed_step(int64_t n) {
    const auto shape = std::make_pair(da_, dc_);
    if (shape == std::make_pair<int64_t, int64_t>(4, 4)) return recurrent_step_fixed<REVERSE, 4, 4>(n), true;
    if (shape == std::make_pair<int64_t, int64_t>(4, 8)) return recurrent_step_fixed<REVERSE, 4, 8>(n), true;
    if (shape == std::make_pair<int64_t, int64_t>(4, 16)) return recurrent_step_fixed<REVERSE, 4, 16>(n), true;
    if (shape == std::make_pair<int64_t, int64_t>(8, 4)) return recurrent_step_fixed<REVERSE, 8, 4>(n), true;
    if (shape == std::make_pair<int64_t, int64_t>(8, 8)) return recurrent_step_fixed<REVERSE, 8, 8>(n), true;
    if (shape == std::make_pair<int64_t, int64_t>(8, 16)) return recurrent_step_fixed<REVERSE, 8, 16>(n), true;
    if (shape == std::make_pair<int64_t, int64_t>(16, 4)) return recurrent_step_fixed<REVERSE, 16, 4>(n), true;
    if (shape == std::make_pair<int64_t, int64_t>(16, 8)) return recurrent_step_fixed<REVERSE, 16, 8>(n), true;
    return false;
  }

  // recurrent_step with the state's shape known at compile time: the state stays in registers for
  // the whole chunk and every row update is a fixed-width vector operation.
  template <bool REVERSE, int DA, int DC>
  void recurrent_step_fixed(int64_t n) {
    static_assert(DA % 2 == 0, "rows go in pairs");
    acc_t state[DA][DC];
    for (int r = 0; r < DA; ++r)
      for (int m = 0; m < DC; ++m) state[r][m] = state_[r * DC + m];
    for (int64_t j = 0; j < n; ++j) {
      const int64_t i = REVERSE ? n - 1 - j : j;
      const acc_t* __restrict__ a = a_.data() + i * DA;
      const acc_t* __restrict__ b = b_.data() + i * DA;
      const acc_t* __restrict__ c = c_.data() + i * DC;
      acc_t even[DC] = {}, odd[DC] = {};  // two sums: half the dependent chain of adds
      for (int r = 0; r < DA; r += 2) {
        for (int m = 0; m < DC; ++m) {
          state[r][m] += b[r] * c[m];
          even[m] += a[r] * state[r][m];
          state[r + 1][m] += b[r + 1] * c[m];
          odd[m] += a[r + 1] * state[r + 1][m];
        }
      }
      acc_t* __restrict__ out = out_.data() + i * DC;
      for (int m = 0; m < DC; ++m) out[m] = even[m] + odd[m];
    }
    for (int r = 0; r < DA; ++r)
      for (int m = 0; m < DC; ++m) state_[r * DC + m] = state[r][m];
  }

  int64_t da_, dc_;
  std::vector<acc_t> a_, b_, c_, scores_, out_, state_;
};

// dk and dv of one sequence in one walk back in time. Their states are each other's transposes:
// dv's is S = dS1 + sum_{t>=s} q'[t] g[t]^T (E x M), dk's [S | z]^T, where z = dz1 + sum c[t] q'[t]
// is the row of ones' part under normalize. So one state [S | z] (E x Mg) serves both, and one
// GEMM a chunk advances it where the two passes apart advanced two; and q' and [g, c] are read
// once, not twice. A chunk:
//     dv = mask(k q'^T) g + k S,   dk = mask([v, 1] [g, c]^T) q' + [v, 1] [S | z]^T,
//     then [S | z] += q'^T [g, c].
template <typename acc_t>
class ChunkedGradKV {
 public:
  ChunkedGradKV(int64_t E, int64_t M, int64_t Mg)
      : e_(E), m_(M), mg_(Mg), q_(kChunk * E), k_(kChunk * E), g_(kChunk * Mg), v_(kChunk * Mg),
        scores_(kChunk * kChunk), dk_(kChunk * E), dv_(kChunk * M), state_(E * Mg, acc_t(0)) {}

  acc_t* q_row(int64_t r) { return q_.data() + r * e_; }   // q'
  acc_t* k_row(int64_t r) { return k_.data() + r * e_; }
  acc_t* g_row(int64_t r) { return g_.data() + r * mg_; }  // [g, c] (c under normalize)
  acc_t* v_row(int64_t r) { return v_.data() + r * mg_; }  // [v, 1] (1 under normalize)
  const acc_t* dk_row(int64_t r) const { return dk_.data() + r * e_; }
  const acc_t* dv_row(int64_t r) const { return dv_.data() + r * m_; }
  // Row e of [S | z]: set it before run() to start from the final state's gradients, read it after
  // run() for the initial state's.
  acc_t* state_row(int64_t e) { return state_.data() + e * mg_; }

  // Walks L timesteps from the end: pack(t0, n) fills rows [0, n) of q, k, g and v with timesteps
  // [t0, t0 + n); unpack(t0, n) reads the same rows of dk and dv.
  template <class Pack, class Unpack>
  void run(int64_t L, Pack&& pack, Unpack&& unpack) {
    walk_chunks<true>(L, [&](int64_t t0, int64_t n) {
      pack(t0, n);
      step(n);
      unpack(t0, n);
    });
  }

 private:
  void step(int64_t n) {
    acc_t* scores = scores_.data();
    acc_t* state = state_.data();
    small_gemm<acc_t>(false, true, n, n, e_, k_.data(), e_, q_.data(), e_, acc_t(0), scores, kChunk);
    mask_scores<true>(scores, n);
    small_gemm<acc_t>(false, false, n, m_, e_, k_.data(), e_, state, mg_, acc_t(0), dv_.data(), m_);
    small_gemm<acc_t>(false, false, n, m_, n, scores, kChunk, g_.data(), mg_, acc_t(1), dv_.data(), m_);
    small_gemm<acc_t>(false, true, n, n, mg_, v_.data(), mg_, g_.data(), mg_, acc_t(0), scores, kChunk);
    mask_scores<true>(scores, n);
    small_gemm<acc_t>(false, true, n, e_, mg_, v_.data(), mg_, state, mg_, acc_t(0), dk_.data(), e_);
    small_gemm<acc_t>(false, false, n, e_, n, scores, kChunk, q_.data(), e_, acc_t(1), dk_.data(), e_);
    small_gemm<acc_t>(true, false, e_, mg_, n, q_.data(), e_, g_.data(), mg_, acc_t(1), state, mg_);
  }

  int64_t e_, m_, mg_;
  std::vector<acc_t> q_, k_, g_, v_, scores_, dk_, dv_, state_;
};

#if defined(__GNUC__) && defined(__x86_64__)
// float16 rows through the CPU's own conversions (F16C, eight at a time), where it has them. The
// build targets plain x86-64, where c10::Half converts in software: float16 took twice
// bfloat16's time (4,8,2048,64 on the 2-core machine: forward 21.3 ms against 10.4,
// fwd+bwd 91 against 45). The same values as the loops of load_row and store_row: each
// conversion is exact one way and rounds to nearest-even the other, and the products by the
// multiplier are the same IEEE multiplications. Each does the row's whole groups of eight and
// returns how many elements that is; the caller's loop does the rest.
#define FAST_CAUSAL_ATTN_F16C 1
bool cpu_has_f16c() {
  static const bool has = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
  return has;
}

__attribute__((target("avx,f16c"))) int64_t load_halves_f16c(const c10::Half* src, int64_t n, float multiplier, float* dst) {
  const __m256 scale = _mm256_set1_ps(multiplier);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(scale, _mm256_cvtph_ps(halves)));
  }
  return i;
}

__attribute__((target("avx,f16c"))) int64_t store_halves_f16c(const float* src, int64_t n, float multiplier, c10::Half* dst) {
  const __m256 scale = _mm256_set1_ps(multiplier);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i halves = _mm256_cvtps_ph(_mm256_mul_ps(scale, _mm256_loadu_ps(src + i)), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), halves);
  }
  return i;
}
#endif

template <typename scalar_t, typename acc_t>
void load_row(const scalar_t* src, int64_t n, acc_t multiplier, acc_t* dst) {
  int64_t i = 0;
#ifdef FAST_CAUSAL_ATTN_F16C
  if constexpr (std::is_same_v<scalar_t, c10::Half> && std::is_same_v<acc_t, float>) {
    if (cpu_has_f16c()) i = load_halves_f16c(src, n, multiplier, dst);
  }
#endif
  for (; i < n; ++i) dst[i] = multiplier * static_cast<acc_t>(src[i]);
}

template <typename scalar_t, typename acc_t>
void store_row(const acc_t* src, int64_t n, acc_t multiplier, scalar_t* dst) {
  int64_t i = 0;
#ifdef FAST_CAUSAL_ATTN_F16C
  if constexpr (std::is_same_v<scalar_t, c10::Half> && std::is_same_v<acc_t, float>) {
    if (cpu_has_f16c()) i = store_halves_f16c(src, n, multiplier, dst);
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<scalar_t>(multiplier * src[i]);
}

// Column blocks of width D split so that the `tasks` independent products (one per (batch, head)
// and pass) give every thread about two work items, but none narrower than kMinColumnsPerBlock.
struct ColumnBlocks {
  int64_t count, width;
  ColumnBlocks(int64_t D, int64_t tasks) {
    const int64_t wanted = (2 * at::get_num_threads() + tasks - 1) / tasks;
    const int64_t most = (D + kMinColumnsPerBlock - 1) / kMinColumnsPerBlock;
    count = std::max<int64_t>(1, std::min(wanted, most));
    width = (D + count - 1) / count;
    count = (D + width - 1) / width;
  }
};

// One sequence's rows of a [B, H, L, D] operand: row t is the sequence's timestep t.
template <typename scalar_t>
struct Rows {
  scalar_t* base;
  int64_t stride;
  Rows(const StridedTensor& t, const Sequence& s)
      : base(static_cast<scalar_t*>(t.ptr) + t.offset(s.b, s.h, s.begin)), stride(t.stride_l) {}
  scalar_t* operator[](int64_t t) const { return base + t * stride; }
};

// This sequence's slice (`size` elements) of a [N, H, ...] state array, or nullptr when the array
// is absent.
template <typename acc_t>
const acc_t* state_slice(const void* base, const Sequence& s, int64_t size) {
  return base == nullptr ? nullptr : static_cast<const acc_t*>(base) + s.state * size;
}

template <typename acc_t>
acc_t* state_slice(void* base, const Sequence& s, int64_t size) {
  return base == nullptr ? nullptr : static_cast<acc_t*>(base) + s.state * size;
}

template <typename scalar_t>
void forward_cpu_kernel(const ForwardParams& p) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t pairs = p.num_seqs * p.H;
  const ColumnBlocks blocks(p.M, pairs);
  const acc_t scale = static_cast<acc_t>(p.scale), eps = static_cast<acc_t>(p.eps);
  at::parallel_for(0, pairs * blocks.count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const Sequence seq = Sequence::of(p, item / blocks.count);
      const int64_t m0 = (item % blocks.count) * blocks.width, mw = std::min(blocks.width, p.M - m0);
      const Rows<const scalar_t> q(p.q, seq), k(p.k, seq), v(p.v, seq);
      const Rows<scalar_t> o(p.o, seq);
      acc_t* den = p.normalize ? static_cast<acc_t*>(p.den) + seq.row(p.L, p.H, 0) : nullptr;
      // With normalize (or a final state to return), c carries a column of ones: its output is the
      // denominator's q' . sum k, its state the sum of k.
      const bool ones = p.normalize || p.final_k_sum != nullptr;
      ChunkedCausalProduct<acc_t> prod(p.E, mw + ones);
      if (const acc_t* kv0 = state_slice<acc_t>(p.initial_kv, seq, p.E * p.M)) {
        const acc_t* k_sum0 = state_slice<acc_t>(p.initial_k_sum, seq, p.E);
        for (int64_t e = 0; e < p.E; ++e) {
          std::copy(kv0 + e * p.M + m0, kv0 + e * p.M + m0 + mw, prod.state_row(e));
          if (ones) prod.state_row(e)[mw] = k_sum0[e];
        }
      }
      prod.template run<false>(
          seq.length,
          [&](int64_t t0, int64_t n) {
            for (int64_t r = 0; r < n; ++r) {
              load_row(q[t0 + r], p.E, scale, prod.a_row(r));
              load_row(k[t0 + r], p.E, acc_t(1), prod.b_row(r));
              load_row(v[t0 + r] + m0, mw, acc_t(1), prod.c_row(r));
              if (ones) prod.c_row(r)[mw] = acc_t(1);
            }
          },
          [&](int64_t t0, int64_t n) {
            for (int64_t r = 0; r < n; ++r) {
              const acc_t* out = prod.out_row(r);
              scalar_t* dst = o[t0 + r] + m0;
              if (p.normalize) {
                const acc_t d = out[mw] + eps;
                for (int64_t j = 0; j < mw; ++j) dst[j] = static_cast<scalar_t>(out[j] / d);
                if (m0 == 0) den[t0 + r] = d;
              } else {
                store_row(out, mw, acc_t(1), dst);
              }
            }
          });
      if (acc_t* kv1 = state_slice<acc_t>(p.final_kv, seq, p.E * p.M)) {
        acc_t* k_sum1 = state_slice<acc_t>(p.final_k_sum, seq, p.E);
        for (int64_t e = 0; e < p.E; ++e) {
          std::copy(prod.state_row(e), prod.state_row(e) + mw, kv1 + e * p.M + m0);
          if (m0 == 0) k_sum1[e] = prod.state_row(e)[mw];
        }
      }
    }
  });
}

// The decoding step, L = 1: out = q' (S0 + k v^T) [/ (q' . (z0 + k) + eps)], S1 = S0 + k v^T. One
// read of the state and one write, nothing else: the step is bound by the state's bytes, which the
// chunked path would copy in and out of its buffers several times.
// One row e of the decoding step: s = row0 + k_e v (row0 absent: zero), row1 = s, out += q_e s.
// Branch-free inner loops over restrict pointers, so that they vectorize.
template <typename acc_t>
void decode_row(const acc_t* __restrict__ row0, acc_t* __restrict__ row1, const acc_t* __restrict__ v,
                acc_t* __restrict__ out, acc_t q_e, acc_t k_e, int64_t M) {
  if (row0 && row1) {
    for (int64_t m = 0; m < M; ++m) {
      const acc_t s = row0[m] + k_e * v[m];
      row1[m] = s;
      out[m] += q_e * s;
    }
  } else if (row0) {
    for (int64_t m = 0; m < M; ++m) out[m] += q_e * (row0[m] + k_e * v[m]);
  } else if (row1) {
    for (int64_t m = 0; m < M; ++m) {
      row1[m] = k_e * v[m];
      out[m] += q_e * row1[m];
    }
  } else {
    for (int64_t m = 0; m < M; ++m) out[m] += q_e * k_e * v[m];
  }
}

template <typename scalar_t>
void decode_step_cpu_kernel(const ForwardParams& p) {
  using acc_t = at::opmath_type<scalar_t>;
  const acc_t scale = static_cast<acc_t>(p.scale), eps = static_cast<acc_t>(p.eps);
  at::parallel_for(0, p.B * p.H, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> v_row(p.M), out(p.M);
    for (int64_t pair = begin; pair < end; ++pair) {
      const Sequence seq = Sequence::of(p, pair);
      const scalar_t* q = Rows<const scalar_t>(p.q, seq)[0];
      const scalar_t* k = Rows<const scalar_t>(p.k, seq)[0];
      load_row(Rows<const scalar_t>(p.v, seq)[0], p.M, acc_t(1), v_row.data());
      const acc_t* kv0 = state_slice<acc_t>(p.initial_kv, seq, p.E * p.M);
      const acc_t* k_sum0 = state_slice<acc_t>(p.initial_k_sum, seq, p.E);
      acc_t* kv1 = state_slice<acc_t>(p.final_kv, seq, p.E * p.M);
      acc_t* k_sum1 = state_slice<acc_t>(p.final_k_sum, seq, p.E);
      std::fill(out.begin(), out.end(), acc_t(0));
      acc_t den = acc_t(0);
      for (int64_t e = 0; e < p.E; ++e) {
        const acc_t q_e = scale * static_cast<acc_t>(q[e]), k_e = static_cast<acc_t>(k[e]);
        const acc_t z = (k_sum0 ? k_sum0[e] : acc_t(0)) + k_e;
        den += q_e * z;
        if (k_sum1) k_sum1[e] = z;
        decode_row(kv0 ? kv0 + e * p.M : nullptr, kv1 ? kv1 + e * p.M : nullptr, v_row.data(), out.data(), q_e,
                   k_e, p.M);
      }
      scalar_t* o = Rows<scalar_t>(p.o, seq)[0];
      if (p.normalize) {
        static_cast<acc_t*>(p.den)[seq.row(p.L, p.H, 0)] = den + eps;
        for (int64_t m = 0; m < p.M; ++m) o[m] = static_cast<scalar_t>(out[m] / (den + eps));
      } else {
        store_row(out.data(), p.M, acc_t(1), o);
      }
    }
  });
}

// One sequence's gradients: dq, dk and dv apart (each in column blocks [c0, c0 + cw) of its
// output), or dk with dv in one walk.
template <typename scalar_t>
struct SequenceGrads {
  using acc_t = at::opmath_type<scalar_t>;
  const BackwardParams& p;
  const Sequence seq;
  const Rows<const scalar_t> q, k, v, dout, o;
  const acc_t* den;  // the forward's q' . z + eps, under normalize
  const acc_t scale;
  const int64_t E, M, Mg;  // Mg: width of [g, c] and of [v, 1]
  const acc_t* kv0;
  const acc_t* k_sum0;
  const acc_t* dkv1;
  const acc_t* dk_sum1;

  SequenceGrads(const BackwardParams& p_, int64_t pair)
      : p(p_), seq(Sequence::of(p_, pair)), q(p_.q, seq), k(p_.k, seq), v(p_.v, seq), dout(p_.dout, seq),
        o(p_.o, seq), den(p_.normalize ? static_cast<const acc_t*>(p_.den) + seq.row(p_.L, p_.H, 0) : nullptr),
        scale(static_cast<acc_t>(p_.scale)), E(p_.E), M(p_.M), Mg(p_.M + p_.normalize),
        kv0(state_slice<acc_t>(p_.initial_kv, seq, E * M)), k_sum0(state_slice<acc_t>(p_.initial_k_sum, seq, E)),
        dkv1(state_slice<acc_t>(p_.grad_final_kv, seq, E * M)),
        dk_sum1(state_slice<acc_t>(p_.grad_final_k_sum, seq, E)) {}

  // g = dO / den under normalize, plain dO otherwise.
  acc_t inv_den(int64_t t) const { return p.normalize ? acc_t(1) / den[t] : acc_t(1); }
  // [g, c][t] with c = -(g . O) under normalize; plain dO otherwise.
  void load_grad(int64_t t, acc_t* dst) const {
    load_row(dout[t], M, inv_den(t), dst);
    if (p.normalize) {
      acc_t dot = 0;
      const scalar_t* o_t = o[t];
      for (int64_t j = 0; j < M; ++j) dot += dst[j] * static_cast<acc_t>(o_t[j]);
      dst[M] = -dot;
    }
  }
  void load_v_ones(int64_t t, acc_t* dst) const {
    load_row(v[t], M, acc_t(1), dst);
    if (p.normalize) dst[M] = acc_t(1);
  }
  // Rows [m][j] = kv[c0 + j][m] of an [Mg, cw] state from a kv-shaped [E, M] state (and a k_sum).
  void set_transposed(ChunkedCausalProduct<acc_t>& prod, const acc_t* kv, const acc_t* k_sum, int64_t c0,
                      int64_t cw) const {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; j < cw; ++j) prod.state_row(m)[j] = kv[(c0 + j) * M + m];
    if (p.normalize)
      for (int64_t j = 0; j < cw; ++j) prod.state_row(M)[j] = k_sum[c0 + j];
  }
  // Without normalize there is no row of ones to carry dz1 into dk: it adds to every row.
  const acc_t* dk_add() const { return !p.normalize ? dk_sum1 : nullptr; }
  // dz0[j] for j in [begin, begin + count), where asked for: dz1 + sum_t c[t] q'[t] under normalize,
  // the row of ones' state, z(j); dz1 (or zero) otherwise (no row of ones: nothing adds to it).
  template <class Z>
  void store_grad_k_sum0(int64_t begin, int64_t count, Z&& z) const {
    acc_t* dk_sum0 = state_slice<acc_t>(p.grad_initial_k_sum, seq, E);
    if (dk_sum0 == nullptr) return;
    for (int64_t j = begin; j < begin + count; ++j)
      dk_sum0[j] = p.normalize ? z(j) : (dk_sum1 != nullptr ? dk_sum1[j] : acc_t(0));
  }

  // dq = scale * ([g, c][t] . ([S0^T; z0^T] + sum_{s<=t} [v, 1][s] k[s]^T))
  void grad_q(int64_t c0, int64_t cw) const {
    ChunkedCausalProduct<acc_t> prod(Mg, cw);
    if (kv0 != nullptr) set_transposed(prod, kv0, k_sum0, c0, cw);
    const Rows<scalar_t> dq(p.dq, seq);
    prod.template run<false>(
        seq.length,
        [&](int64_t t0, int64_t n) {
          for (int64_t r = 0; r < n; ++r) {
            load_grad(t0 + r, prod.a_row(r));
            load_v_ones(t0 + r, prod.b_row(r));
            load_row(k[t0 + r] + c0, cw, acc_t(1), prod.c_row(r));
          }
        },
        [&](int64_t t0, int64_t n) {
          for (int64_t r = 0; r < n; ++r) store_row(prod.out_row(r), cw, scale, dq[t0 + r] + c0);
        });
  }

  // dk = [v, 1][s] . ([dS1^T; dz1^T] + sum_{t>=s} [g, c][t] q'[t]^T)
  void grad_k(int64_t c0, int64_t cw) const {
    ChunkedCausalProduct<acc_t> prod(Mg, cw);
    if (dkv1 != nullptr) set_transposed(prod, dkv1, dk_sum1, c0, cw);
    const acc_t* add = dk_add();
    const Rows<scalar_t> dk(p.dk, seq);
    prod.template run<true>(
        seq.length,
        [&](int64_t t0, int64_t n) {
          for (int64_t r = 0; r < n; ++r) {
            load_v_ones(t0 + r, prod.a_row(r));
            load_grad(t0 + r, prod.b_row(r));
            load_row(q[t0 + r] + c0, cw, scale, prod.c_row(r));
          }
        },
        [&](int64_t t0, int64_t n) {
          for (int64_t r = 0; r < n; ++r) store_dk(prod.out_row(r), add ? add + c0 : nullptr, cw, dk[t0 + r] + c0);
        });
    store_grad_k_sum0(c0, cw, [&](int64_t j) { return prod.state_row(M)[j - c0]; });
  }

  // dv = k[s] . (dS1 + sum_{t>=s} q'[t] g[t]^T)
  void grad_v(int64_t c0, int64_t cw) const {
    ChunkedCausalProduct<acc_t> prod(E, cw);
    if (dkv1 != nullptr) {
      for (int64_t e = 0; e < E; ++e) std::copy(dkv1 + e * M + c0, dkv1 + e * M + c0 + cw, prod.state_row(e));
    }
    const Rows<scalar_t> dv(p.dv, seq);
    prod.template run<true>(
        seq.length,
        [&](int64_t t0, int64_t n) {
          for (int64_t r = 0; r < n; ++r) {
            load_row(k[t0 + r], E, acc_t(1), prod.a_row(r));
            load_row(q[t0 + r], E, scale, prod.b_row(r));
            load_row(dout[t0 + r] + c0, cw, inv_den(t0 + r), prod.c_row(r));  // g's columns only
          }
        },
        [&](int64_t t0, int64_t n) {
          for (int64_t r = 0; r < n; ++r) store_row(prod.out_row(r), cw, acc_t(1), dv[t0 + r] + c0);
        });
    if (acc_t* dkv0 = state_slice<acc_t>(p.grad_initial_kv, seq, E * M)) {  // dS0 = dS1 + sum_t q'[t] g[t]^T
      for (int64_t e = 0; e < E; ++e) std::copy(prod.state_row(e), prod.state_row(e) + cw, dkv0 + e * M + c0);
    }
  }

  // grad_k and grad_v over all columns, in one walk (ChunkedGradKV)
  void grad_kv() const {
    ChunkedGradKV<acc_t> prod(E, M, Mg);
    if (dkv1 != nullptr) {
      for (int64_t e = 0; e < E; ++e) {
        std::copy(dkv1 + e * M, dkv1 + (e + 1) * M, prod.state_row(e));
        if (p.normalize) prod.state_row(e)[M] = dk_sum1[e];
      }
    }
    const acc_t* add = dk_add();
    const Rows<scalar_t> dk(p.dk, seq), dv(p.dv, seq);
    prod.run(
        seq.length,
        [&](int64_t t0, int64_t n) {
          for (int64_t r = 0; r < n; ++r) {
            load_row(q[t0 + r], E, scale, prod.q_row(r));
            load_row(k[t0 + r], E, acc_t(1), prod.k_row(r));
            load_grad(t0 + r, prod.g_row(r));
            load_v_ones(t0 + r, prod.v_row(r));
          }
        },
        [&](int64_t t0, int64_t n) {
          for (int64_t r = 0; r < n; ++r) {
            store_dk(prod.dk_row(r), add, E, dk[t0 + r]);
            store_row(prod.dv_row(r), M, acc_t(1), dv[t0 + r]);
          }
        });
    if (acc_t* dkv0 = state_slice<acc_t>(p.grad_initial_kv, seq, E * M)) {
      for (int64_t e = 0; e < E; ++e) std::copy(prod.state_row(e), prod.state_row(e) + M, dkv0 + e * M);
    }
    store_grad_k_sum0(0, E, [&](int64_t e) { return prod.state_row(e)[M]; });
  }

  static void store_dk(const acc_t* out, const acc_t* add, int64_t n, scalar_t* dst) {
    if (add == nullptr) return store_row(out, n, acc_t(1), dst);
    for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<scalar_t>(out[j] + add[j]);
  }
};

// The backward as work items. Where the items give every thread one, two items a sequence (batch,
// head): dq, and dk with dv in one walk (ChunkedGradKV), adjacent so that at::parallel_for's
// contiguous ranges give the threads whole sequences' work where there are enough. Otherwise
// (fewer items than threads), or for states small enough to step one timestep at a time
// (kMaxRecurrentState: ChunkedCausalProduct's recurrent steps, which the joint walk has not), the
// three passes apart, over (pass, batch, head, column block), so that column blocks keep the
// threads busy. Measured on the 2-core machine (float32 backward ms, the passes apart -> dk with dv
// together; RESULTS.md, forty-sixth session): B,H,L,E,M = 4,8,2048,64,64 51-53 -> 44-45;
// 8,8,1024,32,32 20-21 -> 15-16; 2,8,2048,128,128 58-65 -> 51-54; 1,2,8192,64,64 9.9-10.1 ->
// 8.7-9.4; 2,4,1024,16,16 1.09-1.11 -> 0.98-1.01. One sequence, its two items on the two threads
// against six half-width passes (three runs each): 1,1,16384,64,64 10.1-10.9 -> 8.2-9.2;
// 1,1,8192,128,128 16.9-18.3 -> 11.5-15.1; 1,1,4096,64,64 2.5-3.6 -> 2.0-2.7; 1,1,2048,256,256
// 10.0-10.5 -> 9.1-9.5 (the joint walk does more than dq, but no pass recomputes scores for a
// column block).
template <typename scalar_t>
void backward_cpu_kernel(const BackwardParams& p) {
  const int64_t pairs = p.num_seqs * p.H;
  if (p.E * p.M > kMaxRecurrentState && 2 * pairs >= at::get_num_threads()) {
    at::parallel_for(0, 2 * pairs, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const SequenceGrads<scalar_t> grads(p, item / 2);
        if (item % 2 == 0) {
          grads.grad_kv();
        } else {
          grads.grad_q(0, p.E);
        }
      }
    });
    return;
  }
  const ColumnBlocks e_blocks(p.E, 3 * pairs), m_blocks(p.M, 3 * pairs);
  const int64_t dq_items = pairs * e_blocks.count, dk_items = dq_items, dv_items = pairs * m_blocks.count;
  at::parallel_for(0, dq_items + dk_items + dv_items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      int64_t kind = 0, local = item;  // 0: dq, 1: dk, 2: dv
      if (local >= dq_items) { kind = 1; local -= dq_items; }
      if (kind == 1 && local >= dk_items) { kind = 2; local -= dk_items; }
      const ColumnBlocks& blocks = kind == 2 ? m_blocks : e_blocks;
      const SequenceGrads<scalar_t> grads(p, local / blocks.count);
      const int64_t c0 = (local % blocks.count) * blocks.width;
      const int64_t cw = std::min(blocks.width, (kind == 2 ? p.M : p.E) - c0);
      if (kind == 0) {
        grads.grad_q(c0, cw);
      } else if (kind == 1) {
        grads.grad_k(c0, cw);
      } else {
        grads.grad_v(c0, cw);
      }
    }
  });
}

// The CPU kernels run whole sequences: no segments to keep for the backward.
ForwardSegments launch_forward_cpu(const ForwardParams& p) {
  const bool decode_step = p.L == 1 && p.cu_seqlens == nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p.dtype, "fast_causal_attn forward (CPU)", [&] {
    if (decode_step) {
      decode_step_cpu_kernel<scalar_t>(p);
    } else {
      forward_cpu_kernel<scalar_t>(p);
    }
  });
  return {};
}

void launch_backward_cpu(const BackwardParams& p) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p.dtype, "fast_causal_attn backward (CPU)",
                                  [&] { backward_cpu_kernel<scalar_t>(p); });
}

}  // namespace

TORCH_LIBRARY_IMPL(fast_causal_attn, CPU, m) {
  m.impl("forward", &forward_op<&launch_forward_cpu>);
  m.impl("backward", &backward_op<&launch_backward_cpu>);
}

}  // namespace fast_causal_attn
