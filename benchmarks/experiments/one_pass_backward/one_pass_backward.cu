// Prototype (benchmarks/experiments README, "dq beside dk and dv in one reverse pass"): the 16-bit
// backward at E, M <= 64 in one reverse pass, one block a (batch, head) pair and time segment
// (each segment's starts given: D's and T's, at the segment's end).
// wgmma_grad_kv_kernel's producer and dk-with-dv consumer, and a second consumer warpgroup that
// makes dq on the same staged chunks from the state taken down from the sequence's end:
//
//   dq_c = dO_c S(c + 1) - U(dO_c v_c^T) k_c,   S(c) = S(c + 1) - v_c^T k_c,
//
// S(c) the sum of v^T k over the chunks before chunk c (M x E), U the scores of s > t kept (the
// diagonal not). With T = -S(c + 1), from -S(end) (the forward's final state, transposed):
// out = dO T + U(dO v^T) k, stored times -scale, and T += v^T k behind each chunk's products.
// q, k, v and dO are read once for all three gradients (7 tensors moved where the library's two
// kernels move 10). Built alone by one_pass_backward.py (torch.utils.cpp_extension.load, sm_90a),
// which checks it against float64 and times it beside the library's backward. Not in the package.
#include <torch/extension.h>

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>

#include "wgmma_product.cuh"

namespace fast_causal_attn {
namespace cuda {
namespace one_pass {

// bhld, each tensor contiguous; rows E (q, k, dq, dk) or M (v, dO, dv) elements apart
template <typename scalar_t>
struct Params {
  const scalar_t *q, *k, *v, *dout;
  scalar_t *dq, *dk, *dv;
  // [pairs, segments, E, M]: the state at each segment's end (the sum of k^T v up to it; one
  // segment: the forward's final state)
  const float* kv_end;
  // [pairs, segments, M, E]: D at each segment's end, the sum of dO^T q over the segments after it
  // (nullptr: zeros; one segment)
  const float* d_end;
  int64_t L, E, M;
  int64_t segments, segment_len;  // time segments of segment_len steps (a multiple of C), one block each
  float scale;
};

template <typename scalar_t>
struct Rows {
  const scalar_t* ptr;
  int64_t stride;
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
using namespace wgmma;

// The masked scores with s > t kept (row t, column s; the diagonal dropped) as wgmma's A fragments:
// masked_fragments_of's layout and its blocks off the diagonal kept or dropped whole.
template <bool kHalf, int kWarpRank>
__device__ __forceinline__ void strict_upper_fragments_of(uint32_t (&a)[4][4], const float (&score)[32]) {
  const int g = (threadIdx.x % kWarp) / 4, q4 = threadIdx.x % 4;
  auto kept = [g, q4](int j, int e) {
    const int row_block = 2 * kWarpRank + e / 2;
    if (j != row_block) return j > row_block;
    return 2 * q4 + e % 2 > g;
  };
#pragma unroll
  for (int s = 0; s < 4; ++s)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int j = 2 * s + r / 2, e = 2 * (r % 2);
      const bool dropped = j < 2 * kWarpRank + e / 2;  // a block below the diagonal, zero whole
      a[s][r] = dropped ? 0u : pack<kHalf>(kept(j, e) ? score[4 * j + e] : 0.f, kept(j, e + 1) ? score[4 * j + e + 1] : 0.f);
    }
}
// The ring's wait and release for the two consumer warpgroups, whose code differs: bar.sync and
// bar.arrive are .aligned (every thread at the barrier on the same instruction), which a barrier
// shared by two code paths breaks (synccheck: "Divergent thread(s) in block"); barrier.sync and
// barrier.arrive without .aligned allow it.
__device__ __forceinline__ void consumer_wait(const ProducedRing<kStages>& ring) {
  asm volatile("barrier.sync %0, %1;\n" ::"r"(ring.full0 + ring.slot), "r"(ring.threads) : "memory");
}
__device__ __forceinline__ void consumer_release(const ProducedRing<kStages>& ring, int64_t it, int64_t chunks) {
  if (it + kStages < chunks) {
    asm volatile("barrier.arrive %0, %1;\n" ::"r"(ring.full0 + kStages + ring.slot), "r"(ring.threads) : "memory");
  }
}
// An M x E state into this lane's accumulator entries (row m = 16 warp + g (+8), column e = 8 j +
// 2 q4 (+1)) times `sign`, from `from`: [M, E], or (kTransposed) [E, M]; zeros where it is null
// (and past M and E)
template <bool kTransposed>
__device__ __forceinline__ void load_state(float (&d)[32], const float* from, int64_t M, int64_t E, float sign) {
  const int warp = group_warp(), g = (threadIdx.x % kWarp) / 4, q4 = threadIdx.x % 4;
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t row = 16 * warp + g + 8 * (e / 2), column = 8 * j + 2 * q4 + e % 2;
      d[4 * j + e] = from != nullptr && row < M && column < E
                         ? sign * from[kTransposed ? column * M + row : row * E + column]
                         : 0.f;
    }
}
// d += U(score) X in one committed group, X a staged tile (K = time along its rows)
template <bool kHalf>
__device__ __forceinline__ void add_strict_upper_times(float (&d)[32], const float (&score)[32], uint32_t x_tile) {
  uint32_t a[4][4];
  with_warp_rank([&](auto rank) { strict_upper_fragments_of<kHalf, decltype(rank)::value>(a, score); });
  fence();
  add_fragments_times<kHalf>(d, a, x_tile);
  commit();
}
#endif

// Shared memory: kStages slots of {q, k, v, dO}, D's copy (two tiles), T's copy (two tiles), the
// two consumers' staging rows, their warps' largest |state| (float16's copy scales).
constexpr int kCopyTiles = 2;
constexpr size_t kSmemBytes =
    size_t(wgmma::kStages * 4 + 2 * kCopyTiles) * wgmma::kTile + 2 * wgmma::kStagingBytes + 8 * sizeof(float);
// warpgroup 0: dk and dv; 1: the producer; 2: dq
constexpr int kBlockThreads = 3 * wgmma::kThreads;

template <typename scalar_t>
__global__ void __launch_bounds__(kBlockThreads, 1) one_pass_backward_kernel(const Params<scalar_t> p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool kHalf = std::is_same_v<scalar_t, at::Half>;
  extern __shared__ __align__(1024) unsigned char wgmma_smem[];
  const uint32_t base = smem_address(wgmma_smem);
  const int64_t pair = blockIdx.x / p.segments, segment = blockIdx.x % p.segments, L = p.L, E = p.E, M = p.M;
  const int64_t seg_begin = segment * p.segment_len;
  const int64_t seg_end = seg_begin + p.segment_len < L ? seg_begin + p.segment_len : L;
  const int64_t chunks = (seg_end - seg_begin + C - 1) / C;
  unsigned char* const after_copies = wgmma_smem + (kStages * 4 + 2 * kCopyTiles) * kTile;
  float* const warp_max = reinterpret_cast<float*>(after_copies + 2 * kStagingBytes);
  const int group = warpgroup();
  // named barriers: 1 dk-with-dv's warpgroup, 2 dq's, kFull on the ring (both consumers and the producer)
  constexpr int kKvGroup = 1, kQGroup = 2, kFull = 3;
  static_assert(kFull + 2 * kStages <= 16, "named barriers");
  auto tile_of = [&](int slot, int which) { return base + uint32_t(slot * 4 + which) * kTile; };
  auto chunk_begin = [&](int64_t it) { return seg_begin + (chunks - 1 - it) * C; };  // it = 0: the last chunk
  auto chunk_len = [&](int64_t t0) { return int(L - t0 < C ? L - t0 : C); };
  const scalar_t* const q = p.q + pair * L * E;
  const scalar_t* const k = p.k + pair * L * E;
  const scalar_t* const v = p.v + pair * L * M;
  const scalar_t* const dout = p.dout + pair * L * M;

  constexpr int kLaunchRegisters = 65536 / kBlockThreads / 8 * 8;  // 168
  constexpr int kProducerRegisters = 56, kConsumerRegisters = 224;
  static_assert(2 * kConsumerRegisters + kProducerRegisters <= 3 * kLaunchRegisters, "the block's registers");

  if (group == 1) {  // the producer: q, k, v, dO of each chunk, from the last back to the first
    registers_down_to<kProducerRegisters>();
    const Stager stage(int(threadIdx.x % kThreads));
    const int64_t last = seg_begin + (chunks - 1) * C;
    Source q_src = stage.source(Rows<scalar_t>{q, E}, last, E), k_src = stage.source(Rows<scalar_t>{k, E}, last, E),
           v_src = stage.source(Rows<scalar_t>{v, M}, last, M), dout_src = stage.source(Rows<scalar_t>{dout, M}, last, M);
    ProducedRing<kStages>(kFull, kBlockThreads).produce(chunks, [&](int64_t it, int slot) {
      if (it < chunks) {
        const int n = chunk_len(chunk_begin(it));
        stage.operator()<true>(tile_of(slot, 0), q_src, q, n);
        stage.operator()<true>(tile_of(slot, 1), k_src, k, n);
        stage.operator()<true>(tile_of(slot, 2), v_src, v, n);
        stage.operator()<true>(tile_of(slot, 3), dout_src, dout, n);
      }
      StageRing<>::commit_copies();
    });
    return;
  }
  registers_up_to<kConsumerRegisters>();
  const float factor = p.scale;
  ProducedRing<kStages> ring(kFull, kBlockThreads);

  if (group == 0) {
    // dk and dv (wgmma_grad_kv_kernel's consumer, no normalizer): D = sum over the
    // chunks after this one of dO^T q (M x E), from the segment's end (d_end, or zeros)
    //   dv = K D^T + mask(K Q^T) dO,  dk = V D + mask(V dO^T) Q  (each times scale),  D += dO^T Q
    uint16_t* const staging = reinterpret_cast<uint16_t*>(after_copies);
    StateCopy<kHalf> copy{base + kStages * 4 * kTile, warp_max};
    auto group_sync = [] { named_sync(kKvGroup, kThreads); };
    float d[32];
    load_state<false>(d, p.d_end != nullptr ? p.d_end + (pair * p.segments + segment) * M * E : nullptr, M, E, 1.f);
    copy.publish_first(copy.rows(d), group_sync);
    scalar_t* const dk = p.dk + pair * L * E;
    scalar_t* const dv = p.dv + pair * L * M;
    for (int64_t it = 0; it < chunks; ++it, ring.advance()) {
      fence_shared_writes();  // the state's copy, made at the end of the chunk before
      consumer_wait(ring);
      const uint32_t qt = tile_of(ring.slot, 0), kt = tile_of(ring.slot, 1), vt = tile_of(ring.slot, 2),
                     dt = tile_of(ring.slot, 3);
      const int64_t t0 = chunk_begin(it);
      const int n = chunk_len(t0);
      float score[32], acc[32];
      fence();
      scores_of<kHalf>(score, kt, qt);
      commit();
      times_state_copy<kHalf, 0>(acc, kt, copy.at);
      commit();
      wait<kHalf ? 0 : 1>();
      copy.scale_back(acc);
      add_masked_times<kHalf, true>(acc, score, dt);
      wait<0>();
      store_rows<kHalf>(acc, factor, staging, dv + t0 * M, M, n, M);

      fence();
      scores_of<kHalf>(score, vt, dt);
      commit();
      times_state_copy<kHalf, 1>(acc, vt, copy.at);
      commit();
      if constexpr (!kHalf) {
        wait<1>();
        add_masked_times<kHalf, true>(acc, score, qt);
      }
      add_bt_times_c<kHalf>(d, dt, qt);  // D += dO^T Q
      commit();
      wait<1>();
      if constexpr (kHalf) {
        copy.scale_back(acc);
        add_masked_times<kHalf, true>(acc, score, qt);
        wait<0>();
        consumer_release(ring, it, chunks);
        copy.post_max(copy.rows(d));
      }
      store_rows<kHalf>(acc, factor, staging, dk + t0 * E, E, n, E);
      if constexpr (!kHalf) {
        wait<0>();
        consumer_release(ring, it, chunks);
      }
      group_sync();  // every warp's wgmma has read the state copy
      copy.publish(copy.rows(d));
    }
  } else {
    // dq from T = -S(c + 1), starting at -S(end): row m = 16 warp + g (+8), column e = 8 j + 2 q4 (+1)
    uint16_t* const staging = reinterpret_cast<uint16_t*>(after_copies + kStagingBytes);
    StateCopy<kHalf> copy{base + (kStages * 4 + kCopyTiles) * kTile, warp_max + 4};
    auto group_sync = [] { named_sync(kQGroup, kThreads); };
    float t[32];
    load_state<true>(t, p.kv_end + (pair * p.segments + segment) * E * M, M, E, -1.f);
    copy.publish_first(copy.rows(t), group_sync);
    scalar_t* const dq = p.dq + pair * L * E;
    for (int64_t it = 0; it < chunks; ++it, ring.advance()) {
      fence_shared_writes();  // T's copy, made at the end of the chunk before
      consumer_wait(ring);
      const uint32_t kt = tile_of(ring.slot, 1), vt = tile_of(ring.slot, 2), dt = tile_of(ring.slot, 3);
      const int64_t t0 = chunk_begin(it);
      const int n = chunk_len(t0);
      float score[32], acc[32];
      fence();
      scores_of<kHalf>(score, dt, vt);  // dO v^T: row t, column s
      commit();
      times_state_copy<kHalf, 1>(acc, dt, copy.at);  // dO T
      commit();
      if constexpr (!kHalf) {
        wait<1>();  // the scores; dO T may still run
        add_strict_upper_times<kHalf>(acc, score, kt);
      }
      add_bt_times_c<kHalf>(t, vt, kt);  // T += v^T k: -S(c) for the chunk before
      commit();
      wait<1>();
      if constexpr (kHalf) {
        copy.scale_back(acc);
        add_strict_upper_times<kHalf>(acc, score, kt);
        wait<0>();
        consumer_release(ring, it, chunks);
        copy.post_max(copy.rows(t));
      }
      store_rows<kHalf>(acc, -factor, staging, dq + t0 * E, E, n, E);
      if constexpr (!kHalf) {
        wait<0>();
        consumer_release(ring, it, chunks);
      }
      group_sync();  // every warp's wgmma has read T's copy
      copy.publish(copy.rows(t));
    }
  }
#else
  __trap();
#endif
}

}  // namespace one_pass
}  // namespace cuda
}  // namespace fast_causal_attn

// (dq, dk, dv) of causal linear attention from q, k, v, dO ([B, H, L, E or M], contiguous, bf16 or
// fp16, E and M multiples of 8 up to 64), in `segments` time segments of segment_len steps: the
// state at each segment's end, kv_end ([B, H, segments, E, M] float32; one segment: the forward's
// final state), and D at each segment's end, d_end ([B, H, segments, M, E] float32, or empty: zeros)
std::vector<at::Tensor> one_pass_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                          const at::Tensor& dout, const at::Tensor& kv_end, const at::Tensor& d_end,
                                          int64_t segments, int64_t segment_len, double scale) {
  using namespace fast_causal_attn::cuda;
  TORCH_CHECK(q.is_cuda() && q.dim() == 4, "q: a 4-d CUDA tensor");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf, "q: bfloat16 or float16");
  for (const at::Tensor* x : {&q, &k, &v, &dout}) {
    TORCH_CHECK(x->is_contiguous() && x->scalar_type() == q.scalar_type() && x->dim() == 4, "inputs: contiguous, q's dtype");
  }
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), E = q.size(3), M = v.size(3);
  TORCH_CHECK(k.sizes() == q.sizes() && v.sizes() == dout.sizes() && v.size(2) == L, "shapes");
  TORCH_CHECK(E <= 64 && M <= 64 && E % 8 == 0 && M % 8 == 0 && L > 0, "E, M: multiples of 8 up to 64");
  TORCH_CHECK(segments >= 1 && segment_len % 64 == 0 && (segments - 1) * segment_len < L && segments * segment_len >= L,
              "segments of segment_len steps (a multiple of 64) covering L");
  TORCH_CHECK(kv_end.is_contiguous() && kv_end.scalar_type() == at::kFloat && kv_end.numel() == B * H * segments * E * M,
              "kv_end: [B, H, segments, E, M] float32");
  TORCH_CHECK(d_end.numel() == 0 || (d_end.is_contiguous() && d_end.scalar_type() == at::kFloat &&
                                     d_end.numel() == B * H * segments * M * E),
              "d_end: [B, H, segments, M, E] float32, or empty");
  auto dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_REDUCED_FLOATING_TYPES(q.scalar_type(), "one_pass_backward", [&] {
    one_pass::Params<scalar_t> p{q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                                 dout.data_ptr<scalar_t>(), dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(),
                                 dv.data_ptr<scalar_t>(), kv_end.data_ptr<float>(),
                                 d_end.numel() > 0 ? d_end.data_ptr<float>() : nullptr, L, E, M, segments,
                                 segment_len, float(scale)};
    const auto kernel = one_pass::one_pass_backward_kernel<scalar_t>;
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(one_pass::kSmemBytes)));
    kernel<<<dim3(unsigned(B * H * segments)), one_pass::kBlockThreads, one_pass::kSmemBytes, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {dq, dk, dv};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("one_pass_backward", &one_pass_backward); }
