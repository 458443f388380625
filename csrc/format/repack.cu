// kbit repack: flat layout -> runtime layout (format.repack), once at load time.
//
// One thread per runtime word: it computes which flat word (or padding zero) belongs there,
// so every output element is written, padding included. Threads below the absmax_rt size
// also write one scale code. Writes are coalesced; reads gather (load time only).
#include "kbit_format.cuh"
#include "kbit_ops.h"
#include "launch_utils.cuh"

namespace kbit {
namespace {

constexpr int kThreads = 256;

// Word b of a block's runtime words from its k flat plane words (kbit_format.cuh: planes_to_runtime_words).
template <int K>
__device__ __forceinline__ int32_t runtime_word_k(const int32_t* planes, int64_t b) {
  uint32_t w[K];
#pragma unroll
  for (int i = 0; i < K; ++i) w[i] = static_cast<uint32_t>(planes[i]);
  planes_to_runtime_words<K>(w);
  uint32_t out = w[0];
#pragma unroll
  for (int i = 1; i < K; ++i) out = b == i ? w[i] : out;
  return static_cast<int32_t>(out);
}

__device__ __forceinline__ int32_t runtime_word(const int32_t* planes, int64_t k, int64_t b) {
  if (k == 2) return runtime_word_k<2>(planes, b);
  if (k == 3) return runtime_word_k<3>(planes, b);
  if (k == 4) return runtime_word_k<4>(planes, b);
  return runtime_word_k<5>(planes, b);
}

__global__ void __launch_bounds__(kThreads)
    repack_kernel(const int32_t* __restrict__ qweight, const uint8_t* __restrict__ absmax, int32_t* __restrict__ qweight_rt,
                  uint8_t* __restrict__ absmax_rt, int64_t N, int64_t KB, int64_t k, int64_t KT, int64_t rt_words,
                  int64_t rt_codes) {
  for (int64_t o = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; o < rt_words;
       o += static_cast<int64_t>(gridDim.x) * kThreads) {
    // qweight_rt[nt, kt, b, r, j] = runtime word b of the block qweight[nt*64 + r, kt*4 + j, :]
    const int64_t j = o % kTileKB, r = (o / kTileKB) % kTileN, rest = o / kTileBlocks;
    const int64_t b = rest % k, tile = rest / k;
    const int64_t n = (tile / KT) * kTileN + r, kb = (tile % KT) * kTileKB + j;
    qweight_rt[o] = (n < N && kb < KB) ? runtime_word(qweight + (n * KB + kb) * k, k, b) : 0;
    if (o < rt_codes) {
      // absmax_rt[nt, kt, r, j] = absmax[nt*64 + r, kt*4 + j]
      const int64_t ctile = o / kTileBlocks;
      const int64_t cn = (ctile / KT) * kTileN + r, ckb = (ctile % KT) * kTileKB + j;
      absmax_rt[o] = (cn < N && ckb < KB) ? absmax[cn * KB + ckb] : 0;
    }
  }
}

}  // namespace

void launch_repack(const at::Tensor& qweight, const at::Tensor& absmax, at::Tensor& qweight_rt, at::Tensor& absmax_rt) {
  const int64_t rt_words = qweight_rt.numel();
  if (rt_words == 0) return;
  const int64_t N = qweight.size(0), KB = qweight.size(1), k = qweight.size(2);
  const int64_t KT = qweight_rt.size(1);
  const int grid = persistent_grid(repack_kernel, kThreads, (rt_words + kThreads - 1) / kThreads);
  repack_kernel<<<grid, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      qweight.data_ptr<int32_t>(), absmax.data_ptr<uint8_t>(), qweight_rt.data_ptr<int32_t>(),
      absmax_rt.data_ptr<uint8_t>(), N, KB, k, KT, rt_words, absmax_rt.numel());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace kbit
