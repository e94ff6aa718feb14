// Which passes the wgmma kernels take (wgmma_takes), and their launch (launch_wgmma): the 16-bit
// kernels of wgmma_product.cuh and float32's of wgmma_tf32_product.cuh, in the same segments.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include <ATen/ops/from_blob.h>
#include <c10/cuda/CUDAFunctions.h>

#include "wgmma_product.cuh"
#include "wgmma_tf32_product.cuh"
#include "wgmma_transposed.cuh"

namespace fast_causal_attn {
namespace cuda {

template <typename scalar_t>
constexpr bool kWgmmaInput = std::is_same_v<scalar_t, at::BFloat16> || std::is_same_v<scalar_t, at::Half>;

// The passes the wgmma kernels have, by dtype: 16-bit inputs every pass (dk and dv in one pass,
// GradKV, or as two reverse passes where it does not run); float32 every pass of its own (dk and
// dv as two reverse passes, no GradKV).
template <Pass P, typename scalar_t>
constexpr bool kWgmmaPass = kWgmmaInput<scalar_t> || (std::is_same_v<scalar_t, float> && P != Pass::GradKV);

// Whether the device is of compute capability 9.0 (where an sm_90a binary runs), asked once per device.
bool device_runs_sm90a();

// Whether FAST_CAUSAL_ATTN_WGMMA_GROUPS=1 forces one warpgroup a block on the 16-bit passes (for
// measuring; launch_wgmma_kernels).
inline bool wgmma_one_group_forced() {
  const char* groups = std::getenv("FAST_CAUSAL_ATTN_WGMMA_GROUPS");
  return groups != nullptr && std::strcmp(groups, "1") == 0;
}

// The float32 kernel's row tile, in parts of 64 of the state's rows: above 64 rows two (a block
// over 128 rows: its scores and P Cc computed once for them, where two blocks of 64 computed them
// twice and summed their outputs; up to 128 no row tiles to sum at all), else one. Measured
// (H100, do_bench fwd / fwd+bwd ms, 64-row tiles against 128; RESULTS.md, forty-ninth session):
// 8,16,2048,128 0.383 / 1.605 against 0.305 / 1.271; 1,16,32768,128 0.933 / 3.538 against 0.777 /
// 2.815 (no memsets); 4,16,2048,256 0.767 / 3.131 against 0.604 / 2.512: each pass's kernels 20%
// shorter, with two chunk slots where 64-row blocks had four.
// FAST_CAUSAL_ATTN_ROW_TILE_ROWS=64 keeps blocks of 64 rows at any width (=128, the default, is
// accepted), for measuring and the tests.
inline int tf32_row_parts(int64_t Da) {
  const char* forced = std::getenv("FAST_CAUSAL_ATTN_ROW_TILE_ROWS");
  if (forced != nullptr && std::strcmp(forced, "64") == 0) return 1;
  return Da > 64 ? 2 : 1;
}
// The float32 kernel's row tiles over the state's Da rows (one block each, their outputs summed)
inline int64_t tf32_row_tiles(int64_t Da) {
  const int64_t rows = int64_t(wgmma::C) * tf32_row_parts(Da);
  return (Da + rows - 1) / rows;
}

// Whether pass P runs on the wgmma kernels: built for sm_90a, a device of compute capability 9.0,
// normalize in the 16-bit passes (at four atoms on two warpgroups) and float32's (the forward in up
// to two row tiles), no states in or out with packed sequences, and
//  - bfloat16 or float16: dk and dv in one pass (GradKV; run_grad_kv asks with the dk pass's
//    Da = M, Dc = E) for Da and Dc up to 128, each pass alone (the forward, dq, and dk and dv as
//    two reverse passes where GradKV does not run) up to 256, in whole 16-byte vectors;
//  - float32: the forward, dq, dk and dv (two reverse passes, where run_grad_kv says), Da and Dc
//    up to 256 in whole 16-byte vectors (above 64 in row tiles of 128 and column tiles of 64; above 128
//    faster than the kernels that took it before, fwd+bwd 4,16,2048,256 4.74 against 7.46 ms,
//    2,4,8192,256 2.40 against 6.63, twenty-fifth session; at 128 faster than
//    the mma.sync and recurrent kernels at every shape measured, fwd / fwd+bwd ms, do_bench, H200,
//    RESULTS.md, twenty-first session, call 2: 1,16,32768,128 1.519 / 5.191 against 1.895 / 7.392;
//    8,16,2048,128 0.557 / 2.269 against 0.804 / 2.910; 2,4,8192,128 0.217 / 0.762 against 0.286 /
//    1.123; 4,16,2048,128,64 0.150 / 0.605 against 0.256 / 0.932). The forward and dq at 64 were
//    faster than mma.sync at every
//    shape measured (H200, forward kernel ms and fwd+bwd CUDA graph replay ms, wgmma / mma.sync;
//    RESULTS.md, nineteenth session):
//      8,16,2048,64  0.133 / 0.199, 0.643 / 0.723;  4,16,8192,64 (segments) 0.371 / 0.392, 1.355 / 1.418
//      2,4,8192,64 (segments) 0.059 / 0.075, 0.248 / 0.274
//    (its first form, one warpgroup doing the staging and the products, was as slow as mma.sync or
//    slower: 0.213 ms at 8,16,2048,64; two warpgroups with their own roles, and since the
//    thirty-ninth session two consumers on alternate chunks beside the producer:
//    wgmma_tf32_product.cuh).
// 16-bit: where they run they were the faster family at every shape measured, from one
// (sequence, head) pair to 512 (H200, bfloat16, fwd / fwd+bwd ms, CUDA graph replay, wgmma
// against mma.sync; RESULTS.md, seventeenth and eighteenth sessions):
//   1,1,8192,64 0.032 / 0.076 against 0.035 / 0.102;  1,4,8192,64 0.034 / 0.081 against 0.039 / 0.108
//   2,4,8192,64 0.038 / 0.096 against 0.046 / 0.127;  1,16,8192,64 0.051 / 0.139 against 0.065 / 0.178
//   4,16,8192,64 (64 pairs, time segments) 0.127 / 0.396 against 0.151 / 0.464
//   8,16,2048,64 0.048 / 0.173 against 0.085 / 0.257;  16,16,2048,64 0.082 / 0.312 against 0.113 / 0.399
//   8,16,2048,128 0.107 / 0.382 against 0.164 / 0.668;  1,16,32768,128 0.282 / 0.912 against 0.417 / 1.587
//   8,16,2048,64,128 0.070 / 0.290 against 0.112 / 0.481
// (fewer pairs: time segments fill the multiprocessors on either family). Above 128 (four atoms
// of the state's rows, one warpgroup a block; dk and dv as two reverse passes) against the
// mma.sync kernels' 32 columns a block (bf16, do_bench fwd / fwd+bwd ms; RESULTS.md,
// twenty-second session, beside twentieth's mma.sync): 4,16,2048,256 0.320 / 1.331 against
// 0.443 / 1.778. Below about 16 pairs a call is bound by the host's time to issue it, so do_bench
// medians there follow the host, not the kernels. A function of the shapes and the device alone (not of the rows' alignment), so that a
// plan (dry_run) and the run agree on the forward's segments. FAST_CAUSAL_ATTN_WGMMA=0 turns the
// kernel off, for measuring (=1, the default, is accepted; FAST_CAUSAL_ATTN_SEGMENTS forces its
// segment count as the other families').
template <Pass P, typename scalar_t>
bool wgmma_takes(const KernelParams& p, int64_t Da, int64_t Dc) {
#if defined(FAST_CAUSAL_ATTN_SM90A)
  constexpr bool kFloat = std::is_same_v<scalar_t, float>;
  if constexpr (!kWgmmaPass<P, scalar_t>) {
    return false;
  } else {
    const char* switch_ = std::getenv("FAST_CAUSAL_ATTN_WGMMA");
    if (switch_ != nullptr && std::strcmp(switch_, "0") == 0) return false;
    // 16-bit: one pass alone: Da up to 256 (four atoms), Dc in column tiles of 64 (two a block
    // up to two atoms); dk and dv in one pass: E and M up to 64 on one warpgroup, up to 128 on
    // two. float32: Da and Dc in tiles of 64, up to four (RowTileSums).
    constexpr int64_t kMax = P == Pass::GradKV ? 128 : 256, kVector = 16 / sizeof(scalar_t);
    if (Da > kMax || Dc > kMax || Da % kVector != 0 || Dc % kVector != 0) return false;
    // Normalize: the 16-bit passes (wgmma_product_kernel's kNormalize: the forward's and dq's
    // KeySums, dk's extra row, dk's and dv's q / den; at four atoms only with the state's rows split
    // between two warpgroups), and dk with dv in one pass up to 128 (wgmma_grad_kv_kernel's and the
    // wide kernel's kNormalize); float32's every pass (wgmma_tf32_product_kernel's kNormalize: dq's
    // and dk's extra row in row tile 0's outputs alone; the forward in up to two row tiles, den's
    // parts summed, divide_by_den).
    if (p.normalize && kFloat && P == Pass::Forward && tf32_row_tiles(Da) > 2) return false;
    if (p.normalize && !kFloat && P != Pass::GradKV && Da > 128 && wgmma_one_group_forced()) return false;
    // Packed sequences keep the 16-bit paths their tests have run on the H200 (the forward and dq
    // up to 128); above 128 and dk and dv as two passes they stay on mma.sync until theirs have.
    if (!kFloat && p.cu_seqlens != nullptr && (Da > 128 || Dc > 128 || P == Pass::GradK || P == Pass::GradV)) {
      return false;
    }
    // States in or out (without normalize: above) run here, the key sums beside them on the host
    // (launch_wgmma); with packed sequences those would be sums per sequence: the mma.sync kernels.
    // Otherwise a state changes nothing here, so a plan (which marks a state by its kv alone)
    // decides as the run does.
    if (p.cu_seqlens != nullptr && p.has_state_io()) return false;
    // The reverse passes take a given start divided by the scale (launch_wgmma): where that is
    // finite and as exact as a float32 division, |scale| in [2^-32, 2^32].
    if (PassTraits<P>::kReverse && (p.start_state != nullptr || (p.normalize && p.start_vector != nullptr)) &&
        !(std::abs(p.scale) >= 0x1p-32 && std::abs(p.scale) <= 0x1p32)) {
      return false;
    }
    return device_runs_sm90a();
  }
#else
  (void)p, (void)Da, (void)Dc;
  return false;
#endif
}

// The time segments of a wgmma launch of `blocks` blocks of `smem` bytes each: until the blocks
// fill the multiprocessors once. Where that takes segments at all, and two blocks fit a
// multiprocessor (the 16-bit forward and dq at E, M <= 64: 97 KB), until they fill them twice,
// each segment 8 chunks or longer: bf16 4,16,8192,64 (64 pairs) forward kernels 0.119 ms in 2
// segments, 0.105 in 4, dq 0.083 -> 0.073; 1,16,8192,64 (16 pairs) forward 0.040 in 8, 0.037 in
// 16, dq 0.026 -> 0.024; 2,4,8192,64 (8 pairs) 16 segments of 8 chunks stay (32 of 4: forward
// 0.023 either way, fwd+bwd slower). dk and dv (121 and 210 KB) run one block a multiprocessor:
// at 4,16,8192,64 0.185 ms in 2 segments, 0.199 in 4 (H200, RESULTS.md, eighteenth session, call
// 4); so does every float32 pass (224 KB). A lone segment stays lone: 8,16,2048,64 (128 pairs) in
// two segments was not measured since the swizzled staging (before it, slower: sixteenth session).
// Doubling rereads more: every segment but the last sums its own k and v before its pass reads
// them again, 2 (S - 1) / S tensors beside the pass's 4, so 2 segments never double
// (2 -> 4 adds 10% to the bytes; 4 -> 8 5%, 16 -> 32 1%): at 4,16,8192,64 (64 pairs, 2 segments
// a wave) bf16 forward kernels 0.1323 ms in 4 segments, 0.1225 in 2, fp16 0.1330 and 0.1249
// (H100, RESULTS.md, sixty-first session); fwd+bwd there, the one pass in the forward's segments,
// 0.331 ms of GPU time in 2 against 0.352 in 4 bf16, 0.336 and 0.358 fp16 (H100, seventy-first
// session); 1,8,16384,64 keeps 32 (0.0425 against 0.0489 in 16). From 16 segments on (8 pairs
// and fewer on 132 multiprocessors): at 16-32 pairs and E = 64 the doubled counts (16, 13, 11, 8;
// up to 16 in one launch, whose look-back grows with the count) lost to one wave's on the H100,
// bf16 GPU time fwd / fwd+bwd ms: 1,16,8192,64 16 segments 0.059 / 0.143, 8 0.039 / 0.107;
// 1,32,8192,64 8 0.083 / 0.209, 4 0.068 / 0.187 (RESULTS.md, eighty-first and eighty-third
// sessions). With 16 the threshold (eighty-fourth session, H100): 1,12,8192,64 0.033 / 0.088 in
// 11 against the old 16's 0.049 / 0.125; 1,10,16384,64 0.053 / 0.138 in 13, the old 27 0.054 /
// 0.140; 1,8,16384,64 unchanged, 0.046 / 0.120 (16: 0.047 / 0.121). The H200 measured 16 at 0.037
// against 8 at 0.040 (forward kernels, eighteenth session, older kernels, three launches): not
// yet measured there on these kernels.
constexpr int64_t kMinSegmentsToDouble = 16;
inline int64_t wgmma_segments(const KernelParams& p, int64_t blocks, size_t smem) {
  using wgmma::C;
  if (p.cu_seqlens != nullptr) return 1;
  const int64_t sms = multiprocessor_count();
  int64_t segments = choose_segments(blocks, sms / blocks * blocks, p.L, kMinChunksPerSegment * C);
  if (segments >= kMinSegmentsToDouble && 2 * (smem + 1024) <= 228 * 1024) {  // 1 KB a block the hardware reserves
    segments = std::max(segments, choose_segments(blocks, 2 * sms / blocks * blocks, p.L, 2 * kMinChunksPerSegment * C));
  }
  return segments;
}

// Whether pass P (wgmma_takes holds) runs on wgmma_transposed_kernel (the state transposed in
// registers, 128 columns a block) in place of wgmma_product_kernel's four atoms: 16-bit, Da above
// 128, plain, no state in or out (nor the final key sum the forward's blocks would sum), nor a
// given segment start (dq from the forward's, dv from dk's), and one time segment at its 128-column
// tiles: where its blocks leave the device half idle, the four-atom kernel's segments were faster
// (bf16 E = M = 256, forward ms, H100: 4,16,2048 0.110 against 0.160; 8,16,1024 0.110 against
// 0.166; 2,16,4096, 64 blocks, 0.179 against 0.159 in two segments; RESULTS.md, eighty-sixth
// session). As library passes (eighty-seventh session, H100, the switch's A/B, fwd / fwd+bwd ms):
// bf16 4,16,2048,256 0.109 / 0.438 against 0.163 / 0.686, fp16 0.105 / 0.412 against 0.150 /
// 0.642. Where the transposed kernel's one segment holds, the four-atom kernel's (twice the
// blocks) does too, so a plan (dry_run) agrees with the run on the forward's segments whichever
// takes it. FAST_CAUSAL_ATTN_TRANSPOSED=0 keeps the four-atom kernel (for measuring and the
// tests); FAST_CAUSAL_ATTN_WGMMA_GROUPS=1 (one warpgroup a block) does too.
template <Pass P, typename scalar_t>
bool transposed_takes(const KernelParams& p, int64_t Da, int64_t Dc) {
  if constexpr (!kWgmmaInput<scalar_t> || P == Pass::GradKV) {
    (void)p, (void)Da, (void)Dc;
    return false;
  } else {
    const char* switch_ = std::getenv("FAST_CAUSAL_ATTN_TRANSPOSED");
    if (switch_ != nullptr && std::strcmp(switch_, "0") == 0) return false;
    if (Da <= 128 || Da > 64 * wgmma_transposed::kAtoms || p.normalize || wgmma_one_group_forced()) return false;
    if (p.cu_seqlens != nullptr || p.has_state_io() || p.key_sum_end != nullptr) return false;
    if ((P == Pass::GradQ || P == Pass::GradV) && p.forward_segments > 1) return false;
    const int64_t columns = wgmma_transposed::kColumns;
    return wgmma_segments(p, p.num_seqs * p.H * ((Dc + columns - 1) / columns), wgmma_transposed::kSmemBytes) == 1;
  }
}

// The float32 kernel's row tiles add their outputs into zeroed buffers, two tiles each (0 + x +
// y rounds as 0 + y + x: bit for bit repeatable, where three or four addends in the order the
// blocks finish would not be): tiles 0 and 1 into pass P's output, 2 and 3 (above 128 of the
// state's rows in tiles of 64: FAST_CAUSAL_ATTN_ROW_TILE_ROWS=64) into a buffer with the
// output's strides, added to it once the pass has run
// (finish). The output, [B, H, L, Dc] through its strides, is dense: the ops allocate every
// output whole, in either layout.
template <Pass P>
struct RowTileSums {
  at::Tensor upper;  // tiles 2 and 3's
  int64_t count = 0;

  RowTileSums(KernelParams& p, int64_t row_tiles, int64_t Dc, cudaStream_t stream) {
    const StridedTensor& out = pass_output<P>(p);
    count = p.B * p.H * p.L * Dc;
    if (row_tiles <= 1 || count == 0) return;
    const int64_t span = (p.B - 1) * out.stride_b + (p.H - 1) * out.stride_h + (p.L - 1) * out.stride_l + Dc;
    TORCH_CHECK(span == count, "fast_causal_attn: internal: the float32 wgmma kernel adds into a dense output; got ",
                "strides (", out.stride_b, ", ", out.stride_h, ", ", out.stride_l, ") for [", p.B, ", ", p.H, ", ",
                p.L, ", ", Dc, "]");
    C10_CUDA_CHECK(cudaMemsetAsync(out.ptr, 0, size_t(count) * sizeof(float), stream));
    // (the normalized forward: den's parts added too, divide_by_den)
    if (P == Pass::Forward && p.normalize) C10_CUDA_CHECK(cudaMemsetAsync(p.den, 0, size_t(p.B * p.H * p.L) * sizeof(float), stream));
    if (row_tiles > 2) {
      upper = at::empty({count}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA));
      C10_CUDA_CHECK(cudaMemsetAsync(upper.data_ptr(), 0, size_t(count) * sizeof(float), stream));
      p.upper_row_tiles_out = upper.data_ptr<float>();
    }
  }
  // out += tiles 2 and 3's sum, on the current stream (the launches')
  void finish(const KernelParams& p) const {
    if (!upper.defined()) return;
    at::from_blob(pass_output<P>(p).ptr, {count}, upper.options()).add_(upper);
  }
};

// The normalized float32 forward in two row tiles (wgmma_takes): its outputs, summed undivided as
// den's parts were (wgmma_tf32_product_kernel), divided by den after the pass, on the current
// stream (the launches'): one more read and write of O, where one block holding all of E's rows
// would not fit its chunks' tiles in shared memory.
inline void divide_by_den(const KernelParams& p, int64_t Dc) {
  const StridedTensor& out = pass_output<Pass::Forward>(p);
  at::from_blob(out.ptr, {p.B, p.H, p.L, Dc}, {out.stride_b, out.stride_h, out.stride_l, 1}, float_options())
      .div_(at::from_blob(p.den, {p.B, p.H, p.L, 1}, float_options()));
}

// Whether float32's row tiles (above one tile of the state's rows: 128, or 64 with
// FAST_CAUSAL_ATTN_ROW_TILE_ROWS=64) run one launch each
// (KernelParams::row_tile: tile 0 stores its outputs, each later tile adds into them, in stream
// order) rather than all in one grid (RowTileSums: the output zeroed first, and above two tiles a
// second zeroed buffer, added to the output after the pass): where the pass runs in one segment
// and one row tile's `tile_blocks` blocks take as many rounds of the multiprocessors (one block
// each) a launch as all tiles' blocks would in one, so that the launches cost no parallelism and
// the zeroed buffers go. Measured (H100, RESULTS.md, forty-seventh session; do_bench fwd+bwd ms,
// one grid / one launch a tile): 8,16,2048,128 1.651 / 1.607, 4,16,8192,128 3.289 / 3.136,
// 4,16,2048,256 3.712 / 3.150. Each pass's kernels take 8-11% longer in sequence (a tile's adds
// meet outputs long since written, and its v is read again), less than the memsets (and above
// 128 rows the add) they replace; the adding launches' prefetch of their output lines took a
// fifth of that back (forty-eighth session). Chaining the tiles in one grid instead (each tile
// adding once the tile before has written the chunk, through flags: no memsets) cost each pass
// 15% (benchmarks/experiments/tf32_row_tile_chain.patch). In segments (1,16,32768,128: two) one tile a launch would need
// twice the segments to fill the device, and so a longer state-only launch: not measured.
// FAST_CAUSAL_ATTN_ROW_TILE_LAUNCHES=1 runs them so wherever the pass runs in one segment, =0
// never (for the tests and for measuring).
inline bool row_tiles_in_sequence(int64_t row_tiles, int64_t tile_blocks, int64_t segments) {
  if (row_tiles <= 1 || segments != 1) return false;
  const char* forced = std::getenv("FAST_CAUSAL_ATTN_ROW_TILE_LAUNCHES");
  if (forced != nullptr && std::strcmp(forced, "0") == 0) return false;
  if (forced != nullptr && std::strcmp(forced, "1") == 0) return true;
  const int64_t sms = multiprocessor_count();
  const auto rounds = [sms](int64_t blocks) { return (blocks + sms - 1) / sms; };
  return row_tiles * rounds(tile_blocks) <= rounds(row_tiles * tile_blocks);
}

// A later row tile's launch (row_tiles_in_sequence), programmatic: it may start while the tile
// before it runs its last round of blocks (whose blocks let it, griddepcontrol.launch_dependents,
// once they have started), on the multiprocessors that round leaves idle, and without the gap
// between two launches; its consumers wait for that tile to have finished
// (griddepcontrol.wait) before they add into its outputs. The tile before is always this
// library's own launch of the same kernel, never a caller's kernel (whose outputs we read), and
// that launch (launch_segmented, with as many blocks) has checked the block count and raised the
// kernel's shared-memory limit.
template <typename Kernel>
void launch_after_row_tile(Kernel kernel, const KernelParams& p, int64_t blocks, int threads, size_t smem,
                           cudaStream_t stream, int64_t Da, int64_t Dc, int64_t col_tiles) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(unsigned(blocks));
  config.blockDim = dim3(unsigned(threads));
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, p, Da, Dc, col_tiles));
}

// Whether pass P's `segments` time segments (the count the launch will run) take one launch
// (KernelParams::lookback) instead of three (the state-only launch, the scan, the pass): the
// 16-bit forward and dk with dv in one pass (wgmma_product_kernel<Forward, T, 1, 1, true>,
// wgmma_grad_kv_kernel<T, true>, instances of their own; under normalize <Forward, T, 1, 1, true,
// true> and <T, true, true>, not the one pass), E and M up to 64, 2 to 16 segments, 2 to 8 where `stream` is
// being captured into a CUDA graph. Under normalize as plain (H100, RESULTS.md, sixty-fifth
// session, bf16 forward kernels, one launch against three): 4,16,8192,64 0.137 against 0.145 ms,
// 2,4,8192,64 (16 segments) 0.038 against 0.037, do_bench fwd 0.046 against 0.047.
// Measured (bf16, H200, RESULTS.md, twenty-seventh session; kernels' ms, one launch against three
// with the scan): 4,16,8192,64 (5 segments forward, 2 dk and dv) forward 0.102 against 0.106, dk
// and dv 0.152 against 0.160; at 4 and 8 segments even (1,8,16384,64 forward 0.057 against
// 0.058); 2,4,8192,64 (16) 0.033 against 0.026 and 0.037 against 0.035, but a call there is
// bound by the host's time to issue it (GPU 0.085 ms of a 0.2-0.4 ms call), and one launch
// issues four launches fewer: do_bench fwd+bwd 0.120-0.212 ms in four runs against 0.195-0.431
// in five. A graph's replay has no host cost: there the GPU's time decides (2,4,8192,64 replay
// 0.094 against 0.085 at 16 segments, 0.111 either way at 8). At 32 segments the forward took
// twice as long (1,8,16384,64: 0.088 against 0.045): every block adds all its predecessors'
// sums, reads that grow with the square of the count. At E = M = 128 (1,16,32768,128, 8
// segments) one launch was 6% slower in the forward and 3% in dk and dv; at 256 even.
// Not where the three launches would run their state-only blocks in heads and tails that save an
// eighth of a segment's chunks or more (`heads_pay`: the normalized narrow dk-with-dv kernel's,
// below): one launch's blocks sum their own whole segments, and the blocks of all but the last
// segment wait for that before their pass. Measured (H100, RESULTS.md, sixty-sixth session;
// normalized dk with dv's kernels, ms, three launches with their scans against one): bf16
// 4,16,8192,64 (2 segments, heads of 32 of 64 chunks) 0.190 against 0.207; 2,4,8192,64 (16, no
// heads) 0.051 against 0.049; 1,8,16384,64 (16, heads of 15 of 16) 0.081 against 0.071; float16
// 0.194 / 0.213, 0.054 / 0.051, 0.083 / 0.076.
// FAST_CAUSAL_ATTN_ONE_LAUNCH=0: never; =1: at any count (for measuring and the tests), still
// only where an instance has it.
template <Pass P, typename scalar_t>
bool one_launch_segments(int64_t Da, int64_t Dc, int64_t segments, bool heads_pay, cudaStream_t stream) {
  if constexpr (!kWgmmaInput<scalar_t> || (P != Pass::Forward && P != Pass::GradKV)) {
    (void)Da, (void)Dc, (void)segments, (void)heads_pay, (void)stream;
    return false;
  } else {
    if (segments < 2 || Da > 64 || Dc > 64) return false;
    const char* switch_ = std::getenv("FAST_CAUSAL_ATTN_ONE_LAUNCH");
    if (switch_ != nullptr && std::strcmp(switch_, "0") == 0) return false;
    if (switch_ != nullptr && std::strcmp(switch_, "1") == 0) return true;
    if (heads_pay) return false;
    if (segments <= 8) return true;
    if (segments > 16) return false;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    return capture == cudaStreamCaptureStatusNone;
  }
}

// Pass P's layout at Da and Dc (launch_wgmma_kernels'): 16-bit, one pass alone, Da in one, two or
// four atoms; the forward and dq with Dc above 64 and Da up to 128 on two warpgroups sharing A and
// B, dk and dv (two reverse passes) up to 128 on one; at four atoms, every pass on two, the
// state's rows split between them (FAST_CAUSAL_ATTN_WGMMA_GROUPS=1: one). float32 and dk with dv:
// one atom, one group (their kernels' own layouts).
template <Pass P, typename scalar_t>
wgmma::ProductLayout wgmma_pass_layout(int64_t Da, int64_t Dc, bool normalize) {
  constexpr bool kFloat = std::is_same_v<scalar_t, float>;
  const int atoms = kFloat || P == Pass::GradKV ? 1 : Da > 128 ? 4 : Da > 64 ? 2 : 1;
  const int groups = !kFloat && P != Pass::GradKV && !wgmma_one_group_forced() &&
                             (atoms == 4 || ((P == Pass::Forward || P == Pass::GradQ) && Dc > 64))
                         ? 2
                         : 1;
  return wgmma::product_layout(P, atoms, groups, std::is_same_v<scalar_t, at::Half>, normalize);
}
// Pass P's column tiles at Dc (a block's columns of Cc, the state and the outputs: 64 a group, or
// 64 where the state's rows split; dk with dv: all in one)
template <Pass P, typename scalar_t>
int64_t wgmma_column_tiles(int64_t Da, int64_t Dc, bool normalize) {
  const int64_t tile_columns = wgmma::C * wgmma_pass_layout<P, scalar_t>(Da, Dc, normalize).cc_tiles();
  return P == Pass::GradKV ? 1 : (Dc + tile_columns - 1) / tile_columns;
}
// The 16-bit wgmma forward's time segments, as its launcher counts them (wgmma_segments), for the
// backward's choices that the forward has to make alike (one_pass_backward)
template <typename scalar_t>
int64_t wgmma_forward_segments(const KernelParams& p) {
  const int64_t blocks = p.num_seqs * p.H * wgmma_column_tiles<Pass::Forward, scalar_t>(p.E, p.M, p.normalize);
  return wgmma_segments(p, blocks, wgmma_pass_layout<Pass::Forward, scalar_t>(p.E, p.M, p.normalize).smem_bytes());
}

// The forward's final key sum beside a state (add_key_sums): k summed over time in float32, in a
// fixed order (bit for bit repeatable). Each block sums `slab` timesteps of one (sequence, head),
// a 16-byte vector of columns a thread (rows in 16-byte vectors: wgmma_takes), its rows at once
// as far as 256 threads go, then adds its row groups in order; with one slab a pair it adds the
// given start and writes the end itself, else its slab's sums into `partials` [pair, slab, E]
// for key_sum_finish_kernel. (at::sum over time read k at 1.3-2.4 TB/s of the H100's 3.0: 25 us
// at bf16 8,16,2048,64, RESULTS.md, fifty-first session; this kernel with four 16-bit columns a
// thread and four blocks a multiprocessor 1.9-2.2 TB/s of the H200's 4.2, fifty-second session.)
constexpr int kKeySumThreads = 256;

template <typename scalar_t>
__global__ void __launch_bounds__(kKeySumThreads)
    key_sum_slabs_kernel(const KernelParams p, int64_t slab, int64_t slabs, float* partials) {
  constexpr int kPer = 16 / sizeof(scalar_t);  // a thread's columns: one 16-byte vector of a row
  struct alignas(16) Vector {
    scalar_t x[kPer];
  };
  __shared__ float sums[kKeySumThreads * kPer];
  const int64_t pair = blockIdx.x / slabs, index = blockIdx.x % slabs, b = pair / p.H, h = pair % p.H;
  const int lanes = int(p.E / kPer), rows = kKeySumThreads / lanes;  // threads a row, rows at once
  const int lane = threadIdx.x % lanes, row = threadIdx.x / lanes;
  float sum[kPer] = {};
  if (row < rows) {
    const scalar_t* k = static_cast<const scalar_t*>(p.k.ptr) + p.k.offset(b, h, 0) + kPer * lane;
    const int64_t end = min(p.L, (index + 1) * slab);
#pragma unroll 4
    for (int64_t t = index * slab + row; t < end; t += rows) {
      const Vector v = *reinterpret_cast<const Vector*>(k + t * p.k.stride_l);
#pragma unroll
      for (int e = 0; e < kPer; ++e) sum[e] += static_cast<float>(v.x[e]);
    }
#pragma unroll
    for (int e = 0; e < kPer; ++e) sums[(row * lanes + lane) * kPer + e] = sum[e];
  }
  __syncthreads();
  for (int64_t column = threadIdx.x; column < p.E; column += kKeySumThreads) {
    float total = 0.f;
    for (int r = 0; r < rows; ++r) total += sums[(r * lanes + column / kPer) * kPer + column % kPer];
    if (slabs == 1) {
      write_key_sum(static_cast<float*>(p.end_vector), static_cast<const float*>(p.start_vector), pair * p.E + column,
                    total);
    } else {
      partials[(pair * slabs + index) * p.E + column] = total;
    }
  }
}

// Each pair's `parts` partial sums ([pair, part, E]) added in order, then the given start
// (write_key_sum): one thread a (pair, column); launch_key_sum's slabs, the plain forward's
// segments (KernelParams::key_sum_parts). (A template, as every kernel of these headers, so that
// each compile unit that launches it may hold it.)
template <typename scalar_t>
__global__ void key_sum_finish_kernel(int64_t entries, int64_t E, int64_t parts, const float* partials,
                                      const float* start, float* end) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, pair = i / E, column = i % E;
  if (i >= entries) return;
  float total = 0.f;
  for (int64_t s = 0; s < parts; ++s) total += partials[(pair * parts + s) * E + column];
  write_key_sum(end, start, i, total);
}
template <typename scalar_t>
void launch_key_sum_finish(int64_t pairs, int64_t E, int64_t parts, const float* partials, const void* start, void* end,
                           cudaStream_t stream) {
  const int64_t blocks = (pairs * E + kKeySumThreads - 1) / kKeySumThreads;
  key_sum_finish_kernel<scalar_t><<<unsigned(blocks), kKeySumThreads, 0, stream>>>(
      pairs * E, E, parts, partials, static_cast<const float*>(start), static_cast<float*>(end));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Slabs enough for eight blocks a multiprocessor (its 2048 threads), none under 64 timesteps.
template <typename scalar_t>
void launch_key_sum(const KernelParams& p, cudaStream_t stream) {
  const int64_t pairs = p.B * p.H;
  if (pairs == 0 || p.E == 0) return;
  const int64_t wanted = (8 * multiprocessor_count() + pairs - 1) / pairs;
  const int64_t slabs = std::max<int64_t>(1, std::min(wanted, p.L / 64));
  const int64_t slab = (p.L + slabs - 1) / slabs;
  TORCH_CHECK(pairs * slabs <= int64_t(0x7fffffff), "fast_causal_attn: B * H too large: ", pairs);
  at::Tensor partials;
  if (slabs > 1) {
    partials = at::empty({pairs * slabs * p.E}, float_options());
  }
  key_sum_slabs_kernel<scalar_t><<<unsigned(pairs * slabs), kKeySumThreads, 0, stream>>>(
      p, slab, slabs, slabs > 1 ? partials.data_ptr<float>() : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (slabs > 1) {
    launch_key_sum_finish<scalar_t>(pairs, p.E, slabs, partials.data_ptr<float>(), p.start_vector, p.end_vector, stream);
  }
}

// Runs pass P (the forward, dq, or dk and dv in one pass) on the wgmma kernels (wgmma_takes must
// hold), in time segments where the pairs fill less than the multiprocessors (the dq pass from the
// forward's starts where it kept them); returns the forward's segment starts where it keeps them,
// and a plan's count (dry_run) without launching. The kernels carry the state (a start, an end:
// SegmentStart, SegmentEnd), and the key sums only under normalize (the forward's KeySums; else
// launch_wgmma's).
template <Pass P, typename scalar_t>
ForwardSegments launch_wgmma_kernels(const KernelParams& params, int64_t Da, int64_t Dc, cudaStream_t stream) {
  using wgmma::C;
  KernelParams p = params;
  constexpr bool kFloat = std::is_same_v<scalar_t, float>;
  // every row in whole 16-byte vectors: E and M are (wgmma_takes), and the ops copy rows that start
  // off 16-byte boundaries (with_contiguous_rows in ops.cpp); the kernels copy nothing else
  TORCH_CHECK(rows_are_vectors(p, sizeof(scalar_t)),
              "fast_causal_attn: internal: the wgmma kernels take rows of whole 16-byte vectors");
  p.state_head = 0;
  const int64_t pairs = p.num_seqs * p.H;
  // 16-bit, one pass alone: Da in one, two or four atoms; the forward and dq with Dc above 64 and
  // Da up to 128 on two warpgroups sharing A and B, dk and dv (two reverse passes) up to 128 in
  // column tiles of 64 on one: their two passes run there only with FAST_CAUSAL_ATTN_FUSED_GRAD_KV=0
  // (run_grad_kv), so one instance each width, not two. At four atoms, every pass, the state's
  // rows split between two warpgroups on column tiles of 64. FAST_CAUSAL_ATTN_WGMMA_GROUPS=1 (for
  // measuring): one warpgroup a block, column tiles of 64. float32: two consumer warpgroups on
  // alternate chunks, column tiles of 64, a block over 64 rows of the state or above 64 over 128,
  // and above 128 two row tiles (or up to four of 64), one block each, summing their outputs (one
  // launch a tile, or RowTileSums: row_tiles_in_sequence).
  // (wgmma_takes: 16-bit at four atoms on two groups; float32's forward in up to two row tiles)
  const bool normalize = p.normalize;
  const wgmma::ProductLayout layout = wgmma_pass_layout<P, scalar_t>(Da, Dc, normalize);
  const int atoms = layout.atoms, groups = layout.groups;
  // 16-bit above 128 of the state's rows: the state transposed in registers, 128 columns a block,
  // in one segment (nothing kept: the plan's count 0), where its maps can be made
  if constexpr (kWgmmaInput<scalar_t> && P != Pass::GradKV) {
    if (transposed_takes<P, scalar_t>(p, Da, Dc) && (p.dry_run || launch_transposed<P, scalar_t>(p, Da, Dc, stream))) {
      return {};
    }
  }
  const int64_t col_tiles = wgmma_column_tiles<P, scalar_t>(Da, Dc, normalize);
  // float32's row tiles: 128 of the state's rows a block above 64 (two parts), or 64 (tf32_row_parts)
  const int row_parts = kFloat ? tf32_row_parts(Da) : 1;
  const int64_t row_tiles = kFloat ? tf32_row_tiles(Da) : 1;
  // dk and dv: above 64 (either of E, M), the state on two warpgroups
  const bool wide = P == Pass::GradKV && (Da > 64 || Dc > 64);
  // the one-pass backward: dq beside dk and dv (one_pass_backward)
  const bool one_pass = P == Pass::GradKV && p.one_pass;
  const auto kernel = [atoms, groups, wide, row_parts, normalize, tf32 = p.tf32, one_pass, dots = p.dots_in_grad_q] {
    if constexpr (kFloat) {
      static_assert(P != Pass::GradKV, "float32's dk and dv: two passes");
      (void)dots;
      // float16 heads and tails, or the heads alone where the user allowed TF32; the normalizer's
      // terms (KeySum, RowTerms) in instances of their own
      auto instance = [&](auto normalized) {
        constexpr bool kNormalized = decltype(normalized)::value;
        if (row_parts == 2) {
          return tf32 ? wgmma_tf32_product_kernel<P, false, 2, kNormalized> : wgmma_tf32_product_kernel<P, true, 2, kNormalized>;
        }
        return tf32 ? wgmma_tf32_product_kernel<P, false, 1, kNormalized> : wgmma_tf32_product_kernel<P, true, 1, kNormalized>;
      };
      return normalize ? instance(std::true_type{}) : instance(std::false_type{});
    } else if constexpr (P == Pass::GradKV) {
      (void)row_parts;
      if (one_pass) {  // (under normalize its producer makes dO . O where one_pass_makes_dots says)
        if (!normalize) return wgmma_grad_kv_kernel<scalar_t, false, false, true>;
        return dots ? wgmma_grad_kv_kernel<scalar_t, false, true, true, true> : wgmma_grad_kv_kernel<scalar_t, false, true, true>;
      }
      if (normalize) return wide ? wgmma_grad_kv_wide_kernel<scalar_t, true> : wgmma_grad_kv_kernel<scalar_t, false, true>;
      return wide ? wgmma_grad_kv_wide_kernel<scalar_t> : wgmma_grad_kv_kernel<scalar_t>;
    } else {
      (void)row_parts, (void)dots;
      // the normalizer's instances as the plain ones, but four atoms always on two groups (wgmma_takes)
      auto instance = [&](auto normalized) {
        constexpr bool kNormalized = decltype(normalized)::value;
        if (atoms == 4) {
          if constexpr (kNormalized) {
            return wgmma_product_kernel<P, scalar_t, 4, 2, false, true>;
          } else {
            return groups == 2 ? wgmma_product_kernel<P, scalar_t, 4, 2> : wgmma_product_kernel<P, scalar_t, 4, 1>;
          }
        }
        if constexpr (!PassTraits<P>::kReverse) {  // dk and dv alone: one warpgroup (see groups)
          if (groups == 2) {
            return atoms == 2 ? wgmma_product_kernel<P, scalar_t, 2, 2, false, kNormalized>
                              : wgmma_product_kernel<P, scalar_t, 1, 2, false, kNormalized>;
          }
        }
        return atoms == 2 ? wgmma_product_kernel<P, scalar_t, 2, 1, false, kNormalized>
                          : wgmma_product_kernel<P, scalar_t, 1, 1, false, kNormalized>;
      };
      return normalize ? instance(std::true_type{}) : instance(std::false_type{});
    }
  }();
  // the same kernel's one-launch instance (one_launch_segments says where), nullptr where it has none
  // (under normalize a vector's sums published beside the state's: the forward's key sums, dk with
  // dv's extra row; not the normalized one pass's, whose dq warpgroup has taken one launch's barrier)
  const auto one_launch_kernel = [atoms, groups, wide, normalize, one_pass]() -> decltype(kernel) {
    if constexpr (kFloat || (P != Pass::Forward && P != Pass::GradKV)) {
      (void)atoms, (void)groups, (void)wide, (void)normalize, (void)one_pass;
      return nullptr;
    } else if constexpr (P == Pass::GradKV) {
      (void)atoms, (void)groups;
      if (one_pass) return normalize ? nullptr : wgmma_grad_kv_kernel<scalar_t, true, false, true>;
      if (wide) return nullptr;
      return normalize ? wgmma_grad_kv_kernel<scalar_t, true, true> : wgmma_grad_kv_kernel<scalar_t, true>;
    } else {
      (void)wide, (void)one_pass;
      if (atoms != 1 || groups != 1) return nullptr;
      return normalize ? wgmma_product_kernel<P, scalar_t, 1, 1, true, true> : wgmma_product_kernel<P, scalar_t, 1, 1, true>;
    }
  }();
  // each pass alone: its groups and a producer warpgroup (one launch's instances too); dk with dv:
  // one group and a producer, or above 64 two groups (the wide kernel, which stages its own
  // chunks: a producer there measured slower, RESULTS.md, thirty-first session); the one-pass
  // backward a group more for dq, with its state's copy and staging rows
  const int threads = kFloat              ? (wgmma_tf32::kConsumers + 1) * wgmma_tf32::kThreads
                      : P == Pass::GradKV ? (one_pass ? 3 : 2) * wgmma::kThreads
                                          : wgmma::kThreads * (groups + 1);
  const size_t smem = kFloat                ? wgmma_tf32::smem_bytes(row_parts, normalize)
                      : wide                ? wgmma::smem_bytes(8, 8, 2, 2) + (normalize ? wgmma::kNormalizedWideBytes : 0)
                      : one_pass            ? wgmma::smem_bytes(4, 4, 2) + (normalize ? wgmma::kNormalizedOnePassBytes : 0)
                      : P == Pass::GradKV ? wgmma::smem_bytes(4) + (normalize ? wgmma::kNormalizedGradKVBytes : 0)
                                          : layout.smem_bytes();
  const int64_t blocks = pairs * row_tiles * col_tiles;
  // dq from the forward's segment starts; dv from dk's (launch_backward_cuda)
  if constexpr (P == Pass::GradQ || P == Pass::GradV) {
    if (take_forward_segments<P>(p, C)) {
      if (!p.dry_run) {
        const RowTileSums<P> sums(p, row_tiles, Dc, stream);
        launch_segmented<P>(kernel, p, SegmentWorkspace{}, blocks * p.segments, threads, smem, stream, Da, Dc,
                            col_tiles);
        sums.finish(p);
      }
      return {};
    }
  }
  // (the one-pass backward: in the forward's segments, dq from their ends; each of its segments
  // spans one_pass_span of them, so that they number at most kMaxOnePassSegments)
  const int64_t segments = one_pass ? p.forward_segments : wgmma_segments(p, blocks, smem);
  int64_t length = segment_length(p.L, segments, C);
  TORCH_CHECK(!one_pass || segment_count(p.L, length) == p.forward_segments, "fast_causal_attn: segment_kv holds ",
              p.forward_segments, " segment ends, which no forward of ", p.L, " timesteps makes");
  if (one_pass) {
    p.one_pass_span = one_pass_span(p.forward_segments);
    length *= p.one_pass_span;
  }
  const int64_t count = segment_count(p.L, length);
  // The forward's segment ends kept for the one-pass backward (each pass block's state at its
  // segment's end: KernelParams::segment_ends), in place of their starts: that backward runs no
  // dq pass. One segment or more: the plan's count too. (An empty sequence keeps none: ops.cpp
  // may launch nothing there, and the plan must agree. Where spanning segments would leave most
  // multiprocessors idle, its starts for the two passes: keeps_one_pass_ends.)
  const bool keeps_ends = P == Pass::Forward && p.one_pass && p.keep_segments && p.L > 0 &&
                          keeps_one_pass_ends(pairs, count);
  if (p.dry_run) return {at::Tensor(), at::Tensor(), P == Pass::Forward ? (keeps_ends ? count : count > 1 ? count : 0) : 0};
  at::Tensor kept_ends, kept_key_sum_ends;
  if (keeps_ends) {
    kept_ends = at::empty({pairs, count, Da, Dc}, float_options());
    p.segment_ends = kept_ends.data_ptr<float>();
    if (normalize) {  // (and the key sum's, for dq's extra row)
      kept_key_sum_ends = at::empty({pairs, count, Da}, float_options());
      p.segment_key_sum_ends = kept_key_sum_ends.data_ptr<float>();
    }
  }
  // The state-only launch in heads and tails where its blocks would leave multiprocessors idle
  // (choose_state_head; one block a multiprocessor):
  //  - float32's: 1,16,32768,128 sums its first segment on 64 blocks (16 pairs x 4 tiles) of 132
  //    in whole segments, on 128 in heads and tails (RESULTS.md, thirty-fifth session);
  //  - the normalized narrow dk-with-dv kernel's where it runs in three launches: at bf16
  //    4,16,8192,64 it summed its one segment on 64 blocks of 132, 69
  //    MB in 66 us, 31% of the DRAM peak (ncu, H100, fifty-fifth session); in heads and tails the
  //    kernel's two launches took 0.2102 -> 0.1873 ms. Not the wide kernel's: at 1,16,32768,128
  //    (112 state-only blocks of 132, heads of 55 chunks) its launches took 0.5052 -> 0.5241
  //    (fifty-sixth session).
  // The other 16-bit state-only launches are not short of blocks (their pass fills the device at 2
  // blocks a multiprocessor) and measured 2-11% slower with them (thirty-third session).
  // FAST_CAUSAL_ATTN_TC_STATE_HEAD=N forces heads of N chunks (0: whole segments) where they run,
  // for measuring.
  // Where heads save an eighth of a segment or more, three launches (one_launch_segments).
  const int64_t segment_chunks = segment_length(p.L, segments, C) / C;
  const int64_t head = kFloat || (P == Pass::GradKV && p.normalize && !wide)
                           ? state_head_steps(true, blocks, count, segment_chunks, multiprocessor_count(), C)
                           : 0;
  const bool heads_pay = head > 0 && 8 * (head / C) <= 7 * segment_chunks;
  const bool one_launch =
      one_launch_kernel != nullptr && one_launch_segments<P, scalar_t>(Da, Dc, count, heads_pay, stream);
  if (!one_launch) p.state_head = head;
  // float32's state-only blocks stage their chunks in a ring of their own, deeper than the pass's
  // (wgmma_tf32::Layout); FAST_CAUSAL_ATTN_TC_STATE_SLOTS=2 gives them the pass's ring, for measuring.
  if constexpr (kFloat) {
    if (const char* slots = std::getenv("FAST_CAUSAL_ATTN_TC_STATE_SLOTS")) p.deep_state_staging = std::atoi(slots) != 2;
  }
  // A pass in one launch reads no scanned starts: regions for them only where the forward keeps
  // its starts for the dq pass (which its blocks then store; not where it keeps its ends instead,
  // nor where it keeps nothing)
  const bool keeps_starts = P == Pass::Forward && p.keep_segments && !keeps_ends;
  const SegmentWorkspace workspace =
      SegmentWorkspace::make<P, float>(p, segments, C, Da, Dc, !one_launch || keeps_starts, length);
  // The plain forward's key sum in segments (KernelParams::key_sum_end): each segment's own sums,
  // added after the launch (one segment: the pass's blocks write the end themselves)
  at::Tensor key_sum_parts;
  if (p.key_sum_end != nullptr && p.segments > 1) {
    key_sum_parts = at::empty({pairs * p.segments * Da}, float_options());
    p.key_sum_parts = key_sum_parts.data_ptr<float>();
  }
  const int64_t tile_blocks = blocks / row_tiles;  // one row tile's
  if (kFloat && row_tiles_in_sequence(row_tiles, tile_blocks, p.segments)) {
    for (int64_t tile = 0; tile < row_tiles; ++tile) {  // (one segment: the pass alone)
      KernelParams tile_params = p;
      tile_params.row_tile = tile;
      if (tile == 0) {
        launch_segmented<P>(kernel, tile_params, workspace, tile_blocks, threads, smem, stream, Da, Dc, col_tiles);
      } else {
        launch_after_row_tile(kernel, tile_params, tile_blocks, threads, smem, stream, Da, Dc, col_tiles);
      }
    }
  } else {
    const RowTileSums<P> sums(p, row_tiles, Dc, stream);
    launch_segmented<P>(kernel, p, workspace, blocks * p.segments, threads, smem, stream, Da, Dc, col_tiles,
                        one_launch ? one_launch_kernel : nullptr);
    sums.finish(p);
  }
  if constexpr (kFloat && P == Pass::Forward) {
    if (normalize && row_tiles > 1) divide_by_den(p, Dc);
  }
  if (key_sum_parts.defined()) {  // the segments' own key sums in time order, then the given start
    launch_key_sum_finish<scalar_t>(pairs, Da, p.segments, p.key_sum_parts, p.key_sum_start, p.key_sum_end, stream);
  }
  if constexpr (P == Pass::Forward) {
    if (keeps_ends) return {kept_ends, kept_key_sum_ends, count};
    if (p.keep_segments) return workspace.kept();
  }
  if constexpr (P == Pass::GradK) {  // dk's starts (the state region leads the buffer), for dv
    if (p.keep_segments && p.segments > 1) return {workspace.buffer, at::Tensor(), p.segments};
  }
  return {};
}

// The key sums beside a state that the wgmma kernels do not carry (they carry the forward's under
// normalize, where they meet q: KeySums, and the 16-bit plain forward's: key_sum_end), on the
// current stream after the pass: float32's final key sum (and a 16-bit call's without timesteps),
// the initial one plus the sum of k over time, in float32 (launch_key_sum: k read a second time, a
// quarter of the forward's floor where E = M); and the gradient of k's constant row (the final key
// sum's gradient, out_bias) added to every row of dk (dk read and written once more; rounded twice
// in 16-bit, once by the pass, once by the add, where the mma.sync kernels add it before their one
// rounding). Without packed sequences (wgmma_takes): one sequence a batch entry.
template <Pass P, typename scalar_t>
void add_key_sums(const KernelParams& p, bool kernels_carry_key_sum, cudaStream_t stream) {
  if (P == Pass::Forward && p.end_vector != nullptr && !p.normalize && !kernels_carry_key_sum) {
    launch_key_sum<scalar_t>(p, stream);
  }
  if ((P == Pass::GradK || P == Pass::GradKV) && p.out_bias != nullptr) {  // dk [B, H, L, E] through its strides
    const auto options = float_options().dtype(c10::CppTypeToScalarType<scalar_t>::value);
    at::from_blob(p.dk.ptr, {p.B, p.H, p.L, p.E}, {p.dk.stride_b, p.dk.stride_h, p.dk.stride_l, 1}, options)
        .add_(at::from_blob(const_cast<void*>(p.out_bias), {p.B, p.H, 1, p.E}, float_options()));
  }
}

// Pass P on the wgmma kernels (launch_wgmma_kernels), and the key sums beside a state (add_key_sums).
// The kernels multiply each output by the scale, A's product with the state too, and the reverse
// passes' state holds the sums of q dO^T without it (wgmma_product.cuh): a given start there (the
// final state's gradient, which takes no scale) goes in divided by the scale, and the end (the
// initial state's gradient: the start plus scale times the sums) comes out times it; under
// KernelParams::den_unit (float16 under normalize) in and out of the unit as well (ReverseStates).
template <Pass P, typename scalar_t>
ForwardSegments launch_wgmma(const KernelParams& params, int64_t Da, int64_t Dc, cudaStream_t stream) {
  KernelParams p = params;
  // the key sums beside the kernels (add_key_sums), but under normalize: the kernels' (the
  // forward's KeySums, dk with dv's extra row)
  if (!p.normalize) p.start_vector = p.end_vector = nullptr;  // (no key-sum regions either)
  p.out_bias = nullptr;
  // and the 16-bit plain forward's final key sum, from the chunks its kernels stage (key_sum_end,
  // wgmma_product_kernel's kPlainKeySums): k read once, where launch_key_sum read it again after
  // the pass (bf16 8,16,2048,64 with a state out, H100: the pass 53 us, the sum's two launches 20;
  // RESULTS.md, seventy-sixth session; bf16 4,16,2048,256's state call 0.223 -> 0.196 ms,
  // seventy-eighth)
  const bool kernels_carry_key_sum = P == Pass::Forward && kWgmmaInput<scalar_t> && params.end_vector != nullptr &&
                                     params.L > 0 && !params.normalize;
  if (kernels_carry_key_sum) p.key_sum_end = params.end_vector, p.key_sum_start = params.start_vector;
  const ReverseStates states(p, PassTraits<P>::kReverse && !p.dry_run, Da, Dc, p.scale);
  const ForwardSegments kept = launch_wgmma_kernels<P, scalar_t>(p, Da, Dc, stream);
  states.finish(p);
  if (!params.dry_run) add_key_sums<P, scalar_t>(params, kernels_carry_key_sum, stream);
  return kept;
}

}  // namespace cuda
}  // namespace fast_causal_attn
