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
// themselves are plain small GEMMs (float32 BLAS; bfloat16 inputs' in bfloat16 on the CPU's matrix
// units where it has them: bf16_products). dk and dv, whose states are each other's transposes,
// mostly run as one walk with one state (ChunkedGradKV; backward_cpu_kernel says where).
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>  // F16C's conversions (load_row and store_row of float16), AVX-512's of bfloat16
// oneDNN's brgemm ukernel as torch exports it (at::native::cpublas::brgemm): bfloat16's products
// on the CPU's matrix units (bf16_products). Built against torch 2.13 and newer, whose header has
// the bfloat16 brgemm and could_pack (older ones keep every product in float32).
#if __has_include(<ATen/native/CPUBlas.h>) && __has_include(<torch/version.h>)
#include <torch/version.h>
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
#include <ATen/native/CPUBlas.h>
#if defined(CPUBLAS_BRGEMM_BF16BF16F32)
#define FAST_CAUSAL_ATTN_BF16_PRODUCTS 1
#endif
#endif
#endif
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
// States of fewer elements (Da x Dc) keep bfloat16's products in float32 (bf16_products): on the
// 2-core machine (bf16 ms, fwd / fwd+bwd, products in bfloat16 / float32, two runs each; RESULTS.md,
// fifty-fourth session) B,H,L,E,M = 8,8,1024,32,32 (states 32 x 32 and 33) 3.85-4.18 /
// 16.9-17.6 against 3.85-4.02 / 15.9-16.8, where at 64 x 64 and above they gained: 4,8,2048,64
// 8.0-8.6 / 32.6-33.9 against 10.0-10.7 / 37.1-40.1, 2,8,2048,128 9.1-10.7 / 39.1-43.2 against
// 13.4-14.5 / 48.5-52.5.
constexpr int64_t kMinBf16State = 64 * 64;
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

// bfloat16 inputs' chunk products in bfloat16 on the CPU's matrix units (AMX), where torch's oneDNN
// has them: at::native::cpublas::brgemm sums A B in float32, A row-major and B in VNNI pairs (its
// element (k, n) at 2 (ldb (k / 2) + n) + k % 2: each 32-bit word one column's two rows k, k + 1),
// K even (odd ones padded with a zero row). The float32 chunk buffers are rounded to bfloat16 for
// each product (to nearest even), as the GPU's 16-bit kernels round their operands and P; the
// state, as theirs, in two parts (bf16_lanes: with one, the output's error was 2.9e-3 against
// float32 products' 1.7e-3, over the 2.3e-3; with two 1.7-1.9e-3). The float32 states
// stay exact where their operands are read exactly (k and v; q with its scale applied after the
// products: a_scale, b_scale, q_scale). On the 2-core machine (Xeon, AMX) a 64 x 64 x 64 product
// took 0.81 us on one thread against float32 sgemm's 3.19, but 32-row products run far below
// that (32 x 128 x 128: 2.1 us); bfloat16 fwd / fwd+bwd ms against float32 products, three runs
// each: 4,8,2048,64 7.2-8.8 / 29.6-32.7 against 10.2-11.7 / 40.2-42.6; 2,8,2048,128 10.7-11.5 /
// 42.4-52.4 against 13.8-14.5 / 52.2-54.2 (RESULTS.md, fifty-fourth session; kMinBf16State: where
// they pay). FAST_CAUSAL_ATTN_CPU_BF16_PRODUCTS=0 keeps every product in float32 (the tests
// compare the two).
#ifdef FAST_CAUSAL_ATTN_BF16_PRODUCTS
#define FAST_CAUSAL_ATTN_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

bool cpu_has_bf16_products() {
  static const bool has = __builtin_cpu_supports("avx512bf16") && at::native::cpublas::could_pack(at::kBFloat16);
  return has;
}

// The mask of the first `count` of 16 lanes (none for count <= 0, all 16 from 16 on)
inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? __mmask16(0xffff) : count <= 0 ? __mmask16(0) : __mmask16((1u << count) - 1);
}

// 16 floats at src (the first `count`; zeros after) rounded to bfloat16 (VCVTNEPS2BF16: to nearest
// even; subnormal floats, below 2^-126, flush to zero), as 16-bit lanes; with `lo`, as two parts,
// hi (returned) and lo = x - hi rounded (into *lo): the state's copy, whose one rounding alone put
// bfloat16's error over the bound on the GPU (RESULTS.md, tenth session;
// MmaTraits::kStateParts)
FAST_CAUSAL_ATTN_AVX512_BF16 inline __m256i bf16_lanes(const float* src, int64_t count, __m256i* lo = nullptr) {
  const __m512 x = _mm512_maskz_loadu_ps(first_lanes(count), src);
  const __m256i hi = (__m256i)_mm512_cvtneps_pbh(x);
  if (lo != nullptr) {
    const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
    *lo = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(x, back));
  }
  return hi;
}

// dst[r][j] = src[r][j] in bfloat16 for r < rows, j < cols; zeros for j in [cols, width)
FAST_CAUSAL_ATTN_AVX512_BF16 void bf16_rows(const float* src, int64_t rows, int64_t cols, int64_t ld_src,
                                            uint16_t* dst, int64_t ld_dst, int64_t width) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < width; j += 16) {
      const __m256i x = j < cols ? bf16_lanes(src + r * ld_src + j, cols - j) : _mm256_setzero_si256();
      _mm256_mask_storeu_epi16(dst + r * ld_dst + j, first_lanes(width - j), x);
    }
  }
}

// Two 16-lane halves of bfloat16 as 16 words: a word lane i the halves' lanes i, low (`low`) and
// high (`high`) 16 bits
FAST_CAUSAL_ATTN_AVX512_BF16 inline __m512i interleaved(__m256i low, __m256i high) {
  return _mm512_or_si512(_mm512_cvtepu16_epi32(low), _mm512_slli_epi32(_mm512_cvtepu16_epi32(high), 16));
}

// Two 16-lane halves of bfloat16 one after the other: 32 bfloat16, as 16 words a pair of them each
FAST_CAUSAL_ATTN_AVX512_BF16 inline __m512i concatenated(__m256i first, __m256i second) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(first), second, 1);
}

// B (K x N, row-major at src) as VNNI pairs at dst (ldb words a pair of rows; a zero row after an
// odd K; zeros in columns [N, ldb)); with `lo`, B as two parts: dst its rounding, lo the remainder
// (bf16_lanes)
FAST_CAUSAL_ATTN_AVX512_BF16 void bf16_pairs(const float* src, int64_t K, int64_t N, int64_t ld_src, uint32_t* dst,
                                             int64_t ldb, uint32_t* lo = nullptr) {
  for (int64_t i = 0; 2 * i < K; ++i) {
    const float* even = src + 2 * i * ld_src;
    const float* odd = 2 * i + 1 < K ? even + ld_src : nullptr;
    for (int64_t j = 0; j < ldb; j += 16) {
      __m256i hi0 = _mm256_setzero_si256(), hi1 = hi0, lo0 = hi0, lo1 = hi0;
      if (j < N) {
        hi0 = bf16_lanes(even + j, N - j, lo ? &lo0 : nullptr);
        if (odd != nullptr) hi1 = bf16_lanes(odd + j, N - j, lo ? &lo1 : nullptr);
      }
      const __mmask16 lanes = first_lanes(ldb - j);
      _mm512_mask_storeu_epi32(dst + i * ldb + j, lanes, interleaved(hi0, hi1));
      if (lo != nullptr) _mm512_mask_storeu_epi32(lo + i * ldb + j, lanes, interleaved(lo0, lo1));
    }
  }
}

// B = X^T as VNNI pairs at dst, X (N x K, row-major at src): B's (k, n) is X's (n, k), so the word
// (k / 2, n) is X's row n's word k / 2 in bfloat16 (zeros past K; columns [N, ldb) zeros)
FAST_CAUSAL_ATTN_AVX512_BF16 void bf16_pairs_of_transpose(const float* src, int64_t N, int64_t K, int64_t ld_src,
                                                          uint32_t* dst, int64_t ldb) {
  const int64_t pairs = (K + 1) / 2;
  for (int64_t i = 0; i < pairs; ++i) std::fill(dst + i * ldb + N, dst + (i + 1) * ldb, 0u);
  const __m512i pair_rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                               _mm512_set1_epi32(int(ldb)));
  for (int64_t n = 0; n < N; ++n) {
    const float* x = src + n * ld_src;
    for (int64_t j = 0; j < K; j += 32) {  // words j / 2 .. j / 2 + 15 of the row, each to its pair's row
      const __m512i words = concatenated(bf16_lanes(x + j, K - j), bf16_lanes(x + j + 16, K - j - 16));
      _mm512_mask_i32scatter_epi32(dst + (j / 2) * ldb + n, first_lanes(pairs - j / 2), pair_rows, words, 4);
    }
  }
}

// A (rows x cols, row-major at dst, lda) from VNNI pairs at src (ldb words a pair of rows): the
// pairs' rows split back into two
FAST_CAUSAL_ATTN_AVX512_BF16 void bf16_rows_of_pairs(const uint32_t* src, int64_t rows, int64_t cols, int64_t ldb,
                                                     uint16_t* dst, int64_t lda) {
  for (int64_t i = 0; 2 * i < rows; ++i) {
    for (int64_t j = 0; j < cols; j += 16) {
      const __mmask16 lanes = first_lanes(cols - j);
      const __m512i words = _mm512_maskz_loadu_epi32(lanes, src + i * ldb + j);
      _mm256_mask_storeu_epi16(dst + 2 * i * lda + j, lanes, _mm512_cvtepi32_epi16(words));
      if (2 * i + 1 < rows) {
        _mm256_mask_storeu_epi16(dst + (2 * i + 1) * lda + j, lanes, _mm512_cvtepi32_epi16(_mm512_srli_epi32(words, 16)));
      }
    }
  }
}

// C (M x N, float32, ldc) = (add_c: C +) A B, A bfloat16 rows (M x K, lda), B VNNI pairs (ldb), K even
void bf16_product(int64_t M, int64_t N, int64_t K, const uint16_t* a, int64_t lda, const uint32_t* b, int64_t ldb,
                  float* c, int64_t ldc, bool add_c) {
  if (M == 0 || N == 0) return;
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add_c, reinterpret_cast<const at::BFloat16*>(a),
                              reinterpret_cast<const at::BFloat16*>(b), c, true);
}
#endif

// Whether a chunked product of scalar_t inputs runs its products in bfloat16: for
// bfloat16 where the CPU and torch have them, unless FAST_CAUSAL_ATTN_CPU_BF16_PRODUCTS=0.
template <typename scalar_t>
bool bf16_products() {
#ifdef FAST_CAUSAL_ATTN_BF16_PRODUCTS
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    const char* switch_ = std::getenv("FAST_CAUSAL_ATTN_CPU_BF16_PRODUCTS");
    return cpu_has_bf16_products() && !(switch_ != nullptr && std::strcmp(switch_, "0") == 0);
  }
#endif
  return false;
}

#ifdef FAST_CAUSAL_ATTN_BF16_PRODUCTS
// x[r][j] *= factor for r < rows, j < cols (nothing for factor 1)
void scale_rows(float* x, int64_t rows, int64_t cols, int64_t ld, float factor) {
  if (factor == 1.f) return;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) x[r * ld + j] *= factor;
}

// C (M x N, float32, ldc = N) += factor A B (bf16_product's operands), the factor applied in float32
// to the product (made in `scratch`, M x N, where factor is not 1)
void bf16_add_product(int64_t M, int64_t N, int64_t K, const uint16_t* a, int64_t lda, const uint32_t* b, int64_t ldb,
                      float factor, float* c, float* scratch) {
  if (factor == 1.f) return bf16_product(M, N, K, a, lda, b, ldb, c, N, true);
  bf16_product(M, N, K, a, lda, b, ldb, scratch, N, false);
  for (int64_t i = 0; i < M * N; ++i) c[i] += factor * scratch[i];
}
#endif

// x rounded up to even (the K of a bfloat16 product: VNNI pairs)
constexpr int64_t even(int64_t x) { return x + (x & 1); }

#ifdef FAST_CAUSAL_ATTN_BF16_PRODUCTS
// The bfloat16 operands of a chunk's out = mask(A B^T) C + A S (both directions, dv's and dk's in
// the joint walk), in one product of K = 2 even(D) + n: out = [A, A, P] [S_hi; S_lo; C], the state
// in two parts (bf16_lanes) and P the masked scores; one brgemm call where three took a quarter
// more time at E = 64 (2.70 against 3.39 us a chunk with the scores and the state's update, one
// thread of the 2-core machine, fifty-fourth session).
//   rows:  n x (2 even(D) + kChunk): A, A again, P (kChunk = the ld of the scores' B^T pairs)
//   pairs: [S_hi; S_lo; C], even(D) / 2, even(D) / 2 and kChunk / 2 pair rows of ldb words
struct Bf16Chunk {
  int64_t d2, ld, ldb;  // even(D), the rows' width, the pairs' (even of the outputs' width)
  std::vector<uint16_t> rows;
  std::vector<uint32_t> pairs, bt_pairs;  // (bt_pairs: B^T's, the scores' B, kChunk words a pair row)
  Bf16Chunk() = default;
  Bf16Chunk(int64_t D, int64_t width)
      : d2(even(D)), ld(2 * even(D) + kChunk), ldb(even(width)), rows(kChunk * ld), pairs((d2 + kChunk / 2) * ldb),
        bt_pairs(d2 / 2 * kChunk) {}
  uint32_t* state_pairs() { return pairs.data(); }
  uint32_t* c_pairs() { return pairs.data() + d2 * ldb; }
  // The chunk's scores (n x n, rows kChunk apart) = mask(factor A B^T) for A and B of n rows of D
  // (float32, D apart): A's rows into `rows` (converted once, then copied beside), B^T into bt_pairs
  template <bool REVERSE>
  void masked_scores(const float* a, const float* b, int64_t n, int64_t D, float factor, float* scores) {
    bf16_rows(a, n, D, D, rows.data(), ld, d2);
    for (int64_t r = 0; r < n; ++r) std::copy_n(rows.data() + r * ld, d2, rows.data() + r * ld + d2);
    bf16_pairs_of_transpose(b, n, D, D, bt_pairs.data(), kChunk);
    bf16_product(n, n, d2, rows.data(), ld, bt_pairs.data(), kChunk, scores, kChunk, false);
    scale_rows(scores, n, n, kChunk, factor);
    mask_scores<REVERSE>(scores, n);
  }
  // out (n x N, ld N) = [A, A, P] [S_hi; S_lo; C] for the state (D x width, float32, ld width) and C
  // (n x width, ld width): the first N columns
  void times(const float* scores, const float* state, const float* c, int64_t n, int64_t D, int64_t width,
             int64_t N, float* out) {
    const int64_t np = even(n);
    bf16_rows(scores, n, n, kChunk, rows.data() + 2 * d2, ld, np);
    bf16_pairs(state, D, width, width, state_pairs(), ldb, state_pairs() + d2 / 2 * ldb);
    bf16_pairs(c, n, width, width, c_pairs(), ldb);
    bf16_product(n, N, 2 * d2 + np, rows.data(), ld, pairs.data(), ldb, out, N, false);
  }
};
#endif

// Packed chunk operands and the running state of one causal product.
template <typename acc_t>
class ChunkedCausalProduct {
 public:
  // bf16: the products in bfloat16 (bf16_products; a float32 accumulator only). a_scale, b_scale:
  // a's and b's constant factors (the forward's q' = scale q; dv's), which the packer applies
  // (a_factor(), b_factor()), or with bfloat16 products the products do, in float32 (the outputs;
  // the scores and the state's update): the operands reach the products as read, so that the
  // state's sums stay float32-exact where b and c are (as the GPU's reverse passes keep them), and
  // q' is not rounded to bfloat16 (as the GPU's passes multiply their outputs).
  ChunkedCausalProduct(int64_t a_cols, int64_t c_cols, bool bf16 = false, acc_t a_scale = acc_t(1),
                       acc_t b_scale = acc_t(1))
      : da_(a_cols), dc_(c_cols), a_(kChunk * a_cols), b_(kChunk * a_cols), c_(kChunk * c_cols),
        scores_(kChunk * kChunk), out_(kChunk * c_cols), state_(a_cols * c_cols, acc_t(0)),
        bf16_(bf16 && std::is_same_v<acc_t, float> && a_cols * c_cols >= kMinBf16State), a_scale_(a_scale),
        b_scale_(b_scale) {
#ifdef FAST_CAUSAL_ATTN_BF16_PRODUCTS
    if (bf16_) {
      chunk_ = Bf16Chunk(da_, dc_);
      bt16_.resize(da_ * kChunk);
      if (b_scale_ != acc_t(1)) state_update_.resize(da_ * dc_);
    }
#endif
  }
  // The multipliers the packer applies to a's and b's rows
  acc_t a_factor() const { return bf16_ ? acc_t(1) : a_scale_; }
  acc_t b_factor() const { return bf16_ ? acc_t(1) : b_scale_; }

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
#ifdef FAST_CAUSAL_ATTN_BF16_PRODUCTS
    if (bf16_) at::native::cpublas::brgemm_release(true);  // (the matrix units' state)
#endif
  }

 private:
  template <bool REVERSE>
  void step(int64_t n) {
    if (da_ * dc_ <= kMaxRecurrentState) {
      if (!fixed_step<REVERSE>(n)) recurrent_step<REVERSE>(n);
      return;
    }
#ifdef FAST_CAUSAL_ATTN_BF16_PRODUCTS
    if constexpr (std::is_same_v<acc_t, float>) {
      if (bf16_) return bf16_step<REVERSE>(n);
    }
#endif
    acc_t* scores = scores_.data();
    small_gemm<acc_t>(false, true, n, n, da_, a_.data(), da_, b_.data(), da_, acc_t(0), scores, kChunk);
    mask_scores<REVERSE>(scores, n);
    small_gemm<acc_t>(false, false, n, dc_, da_, a_.data(), da_, state_.data(), dc_, acc_t(0), out_.data(), dc_);
    small_gemm<acc_t>(false, false, n, dc_, n, scores, kChunk, c_.data(), dc_, acc_t(1), out_.data(), dc_);
    small_gemm<acc_t>(true, false, da_, dc_, n, b_.data(), da_, c_.data(), dc_, acc_t(1), state_.data(), dc_);
  }

#ifdef FAST_CAUSAL_ATTN_BF16_PRODUCTS
  // step's products in bfloat16 (bf16_products, Bf16Chunk), then the state's update b^T c (b^T's
  // rows from the scores' pairs).
  template <bool REVERSE>
  void bf16_step(int64_t n) {
    const int64_t np = even(n);
    acc_t* scores = scores_.data();
    chunk_.masked_scores<REVERSE>(a_.data(), b_.data(), n, da_, b_scale_, scores);
    chunk_.times(scores, state_.data(), c_.data(), n, da_, dc_, dc_, out_.data());
    scale_rows(out_.data(), n, dc_, dc_, a_scale_);
    bf16_rows_of_pairs(chunk_.bt_pairs.data(), da_, np, kChunk, bt16_.data(), kChunk);  // b^T
    bf16_add_product(da_, dc_, np, bt16_.data(), kChunk, chunk_.c_pairs(), chunk_.ldb, b_scale_, state_.data(),
                     state_update_.data());
  }
#endif

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
  bool bf16_;  // (bf16_step)
  acc_t a_scale_, b_scale_;
#ifdef FAST_CAUSAL_ATTN_BF16_PRODUCTS
  Bf16Chunk chunk_;
  std::vector<uint16_t> bt16_;       // b^T's rows
  std::vector<acc_t> state_update_;  // (b_scale_ != 1) b^T c, before its factor (bf16_add_product)
#endif
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
  // bf16: the products in bfloat16 (bf16_products; a float32 accumulator only). q_scale: q's
  // constant factor (q' = scale q), applied by the packer (q_factor()) or, with bfloat16 products,
  // by the products in float32 (ChunkedCausalProduct's b_scale: the state's sums stay exact).
  ChunkedGradKV(int64_t E, int64_t M, int64_t Mg, bool bf16 = false, acc_t q_scale = acc_t(1))
      : e_(E), m_(M), mg_(Mg), q_(kChunk * E), k_(kChunk * E), g_(kChunk * Mg), v_(kChunk * Mg),
        scores_(kChunk * kChunk), dk_(kChunk * E), dv_(kChunk * M), state_(E * Mg, acc_t(0)),
        bf16_(bf16 && std::is_same_v<acc_t, float> && E * Mg >= kMinBf16State), q_scale_(q_scale) {
#ifdef FAST_CAUSAL_ATTN_BF16_PRODUCTS
    if (bf16_) {
      dv_chunk_ = Bf16Chunk(E, Mg), dk_chunk_ = Bf16Chunk(Mg, E);
      state_t_.resize(Mg * E), qt16_.resize(E * kChunk), gt16_.resize(Mg * kChunk);
      if (q_scale_ != acc_t(1)) state_update_.resize(E * Mg);
    }
#endif
  }
  // The multiplier the packer applies to q's rows
  acc_t q_factor() const { return bf16_ ? acc_t(1) : q_scale_; }

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
#ifdef FAST_CAUSAL_ATTN_BF16_PRODUCTS
    if (bf16_) {  // S^T from the start state
      for (int64_t e = 0; e < e_; ++e)
        for (int64_t m = 0; m < mg_; ++m) state_t_[m * e_ + e] = state_[e * mg_ + m];
    }
#endif
    walk_chunks<true>(L, [&](int64_t t0, int64_t n) {
      pack(t0, n);
      step(n);
      unpack(t0, n);
    });
#ifdef FAST_CAUSAL_ATTN_BF16_PRODUCTS
    if (bf16_) at::native::cpublas::brgemm_release(true);
#endif
  }

 private:
  void step(int64_t n) {
#ifdef FAST_CAUSAL_ATTN_BF16_PRODUCTS
    if constexpr (std::is_same_v<acc_t, float>) {
      if (bf16_) return bf16_step(n);
    }
#endif
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

#ifdef FAST_CAUSAL_ATTN_BF16_PRODUCTS
  // step's products in bfloat16 (bf16_products): dv = k S + P g and dk = v S^T + P' q' (Bf16Chunk),
  // then the state and its transpose S^T (kept beside it in float32, where its bfloat16 pairs
  // were a scatter a pair of S's columns: bf16_pairs_of_transpose took the most of any step at E =
  // 128) updated by q'^T g and g^T q' (q^T's and g^T's rows from the scores' pairs).
  void bf16_step(int64_t n) {
    const int64_t np = even(n);
    acc_t* scores = scores_.data();
    dv_chunk_.masked_scores<true>(k_.data(), q_.data(), n, e_, q_scale_, scores);
    dv_chunk_.times(scores, state_.data(), g_.data(), n, e_, mg_, m_, dv_.data());
    dk_chunk_.masked_scores<true>(v_.data(), g_.data(), n, mg_, q_scale_, scores);  // (q's factor: P q')
    dk_chunk_.times(scores, state_t_.data(), q_.data(), n, mg_, e_, e_, dk_.data());
    bf16_rows_of_pairs(dv_chunk_.bt_pairs.data(), e_, np, kChunk, qt16_.data(), kChunk);  // q^T
    bf16_add_product(e_, mg_, np, qt16_.data(), kChunk, dv_chunk_.c_pairs(), dv_chunk_.ldb, q_scale_, state_.data(),
                     state_update_.data());
    bf16_rows_of_pairs(dk_chunk_.bt_pairs.data(), mg_, np, kChunk, gt16_.data(), kChunk);  // g^T
    bf16_add_product(mg_, e_, np, gt16_.data(), kChunk, dk_chunk_.c_pairs(), dk_chunk_.ldb, q_scale_, state_t_.data(),
                     state_update_.data());
  }
#endif

  int64_t e_, m_, mg_;
  std::vector<acc_t> q_, k_, g_, v_, scores_, dk_, dv_, state_;
  bool bf16_;  // (bf16_step)
  acc_t q_scale_;
#ifdef FAST_CAUSAL_ATTN_BF16_PRODUCTS
  Bf16Chunk dv_chunk_, dk_chunk_;
  std::vector<acc_t> state_t_;      // S^T (Mg x E)
  std::vector<uint16_t> qt16_, gt16_;  // q^T's and g^T's rows
  std::vector<acc_t> state_update_;  // (q_scale_ != 1) a state's update before its factor (bf16_add_product)
#endif
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

// bfloat16 rows the same way, eight at a time with AVX2's integer lanes, where the CPU has them:
// c10::BFloat16's conversions, loop for loop (a bfloat16 is a float's top 16 bits; the float
// rounds to nearest even as c10's round_to_nearest_even does, NaN to 0x7fc0). The scalar loops
// took 14% of a bfloat16 forward's samples at 4,8,2048,64 (perf, fifty-fourth session).
bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}

__attribute__((target("avx2"))) int64_t load_bfloat16_avx2(const c10::BFloat16* src, int64_t n, float multiplier, float* dst) {
  const __m256 scale = _mm256_set1_ps(multiplier);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(scale, _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16))));
  }
  return i;
}

__attribute__((target("avx2"))) int64_t store_bfloat16_avx2(const float* src, int64_t n, float multiplier, c10::BFloat16* dst) {
  const __m256 scale = _mm256_set1_ps(multiplier);
  const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff), nan = _mm256_set1_epi32(0x7fc0);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_mul_ps(scale, _mm256_loadu_ps(src + i));
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(bias, lsb)), 16);
    rounded = _mm256_blendv_epi8(rounded, nan, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    // the eight 32-bit lanes (each below 2^16) to 16 bits: packed within 128-bit halves, then the
    // halves' low quarters brought together
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0xd8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_castsi256_si128(packed));
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
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<acc_t, float>) {
    if (cpu_has_avx2()) i = load_bfloat16_avx2(src, n, multiplier, dst);
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
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<acc_t, float>) {
    if (cpu_has_avx2()) i = store_bfloat16_avx2(src, n, multiplier, dst);
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<scalar_t>(multiplier * src[i]);
}

// Column blocks of width D for `tasks` independent products (one per (batch, head) and pass): the
// count that gives the busiest thread the least work, none narrower than kMinColumnsPerBlock. A
// thread's work is its items, each 1 / count of a product plus what a block does not shrink (the
// scores mask(A B^T) and A's rows, recomputed by every block: kUnsplitShare of a product). It was
// two items a thread: where the items already fill the threads evenly (two (batch, head) pairs on
// two threads) or a thread takes several blocks of one product, the blocks only recomputed the
// scores. On the 2-core machine (forward ms, two runs each, the old rule / this one; RESULTS.md,
// fifty-fourth session): bf16 1,2,8192,64 3.8-4.1 / 2.5-3.0, 1,1,8192,128 5.3-5.7 / 3.5-3.8,
// 2,1,4096,256 11.1-12.2 / 8.2-9.3; float32 3.5-4.4 / 2.6-3.4, 6.8-8.0 / 4.9-5.1, 14.3-15.2 /
// 11.5-14.2. Three products on two threads still take two blocks each (six items), as before.
constexpr double kUnsplitShare = 0.25;
struct ColumnBlocks {
  int64_t count, width;
  ColumnBlocks(int64_t D, int64_t tasks) {
    const int64_t threads = at::get_num_threads();
    const int64_t most = std::max<int64_t>(1, (D + kMinColumnsPerBlock - 1) / kMinColumnsPerBlock);
    count = 1;
    double least = 0;
    for (int64_t c = 1; c <= most; ++c) {
      const double busiest = double((tasks * c + threads - 1) / threads) * (1.0 / double(c) + kUnsplitShare);
      if (c == 1 || busiest < least - 1e-9) least = busiest, count = c;
    }
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
  const bool bf16 = bf16_products<scalar_t>();  // (once a call: it reads the environment)
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
      ChunkedCausalProduct<acc_t> prod(p.E, mw + ones, bf16, scale);
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
              load_row(q[t0 + r], p.E, prod.a_factor(), prod.a_row(r));
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
  const bool bf16;  // the products in bfloat16 (bf16_products, asked once a call)

  SequenceGrads(const BackwardParams& p_, int64_t pair, bool bf16_)
      : p(p_), seq(Sequence::of(p_, pair)), q(p_.q, seq), k(p_.k, seq), v(p_.v, seq), dout(p_.dout, seq),
        o(p_.o, seq), den(p_.normalize ? static_cast<const acc_t*>(p_.den) + seq.row(p_.L, p_.H, 0) : nullptr),
        scale(static_cast<acc_t>(p_.scale)), E(p_.E), M(p_.M), Mg(p_.M + p_.normalize),
        kv0(state_slice<acc_t>(p_.initial_kv, seq, E * M)), k_sum0(state_slice<acc_t>(p_.initial_k_sum, seq, E)),
        dkv1(state_slice<acc_t>(p_.grad_final_kv, seq, E * M)),
        dk_sum1(state_slice<acc_t>(p_.grad_final_k_sum, seq, E)), bf16(bf16_) {}

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
    ChunkedCausalProduct<acc_t> prod(Mg, cw, bf16);
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
    ChunkedCausalProduct<acc_t> prod(Mg, cw, bf16);
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
    ChunkedCausalProduct<acc_t> prod(E, cw, bf16, acc_t(1), scale);
    if (dkv1 != nullptr) {
      for (int64_t e = 0; e < E; ++e) std::copy(dkv1 + e * M + c0, dkv1 + e * M + c0 + cw, prod.state_row(e));
    }
    const Rows<scalar_t> dv(p.dv, seq);
    prod.template run<true>(
        seq.length,
        [&](int64_t t0, int64_t n) {
          for (int64_t r = 0; r < n; ++r) {
            load_row(k[t0 + r], E, acc_t(1), prod.a_row(r));
            load_row(q[t0 + r], E, prod.b_factor(), prod.b_row(r));
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
    ChunkedGradKV<acc_t> prod(E, M, Mg, bf16, scale);
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
            load_row(q[t0 + r], E, prod.q_factor(), prod.q_row(r));
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
  const bool bf16 = bf16_products<scalar_t>();  // (once a call: it reads the environment)
  if (p.E * p.M > kMaxRecurrentState && 2 * pairs >= at::get_num_threads()) {
    at::parallel_for(0, 2 * pairs, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const SequenceGrads<scalar_t> grads(p, item / 2, bf16);
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
      const SequenceGrads<scalar_t> grads(p, local / blocks.count, bf16);
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
