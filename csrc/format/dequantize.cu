// kbit dequantize: flat (qweight [N, KB, k]) or runtime (qweight_rt [N/64, KB/4, k, 64, 4])
// layout -> W [N, KB*32] in fp16/bf16/fp32.
//
// Four lanes share one block, eight elements each, so a warp writes 8 blocks (512 bytes of
// bf16) with one coalesced 16-byte store per lane. Each lane reads the block's k plane words
// (the four lanes read the same words: one broadcast transaction), spreads its byte of each
// plane into eight indices, looks the levels up by shuffling from the lane that holds that
// codebook entry, and rounds fp32(level * scale) to the output type with round-to-nearest-even.
#include "kbit_format.cuh"
#include "kbit_ops.h"
#include "launch_utils.cuh"

#include <c10/util/Exception.h>

#include "check.h"

namespace kbit {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// Eight fp32 values rounded to OutT and written as 16-byte vectors.
template <typename OutT>
__device__ __forceinline__ void store_octet(OutT* dst, const float (&v)[8]);

template <>
__device__ __forceinline__ void store_octet<__nv_bfloat16>(__nv_bfloat16* dst, const float (&v)[8]) {
  uint4 o;
  o.x = bits_as<uint32_t>(__floats2bfloat162_rn(v[0], v[1]));
  o.y = bits_as<uint32_t>(__floats2bfloat162_rn(v[2], v[3]));
  o.z = bits_as<uint32_t>(__floats2bfloat162_rn(v[4], v[5]));
  o.w = bits_as<uint32_t>(__floats2bfloat162_rn(v[6], v[7]));
  *reinterpret_cast<uint4*>(dst) = o;
}

template <>
__device__ __forceinline__ void store_octet<__half>(__half* dst, const float (&v)[8]) {
  uint4 o;
  o.x = bits_as<uint32_t>(__floats2half2_rn(v[0], v[1]));
  o.y = bits_as<uint32_t>(__floats2half2_rn(v[2], v[3]));
  o.z = bits_as<uint32_t>(__floats2half2_rn(v[4], v[5]));
  o.w = bits_as<uint32_t>(__floats2half2_rn(v[6], v[7]));
  *reinterpret_cast<uint4*>(dst) = o;
}

template <>
__device__ __forceinline__ void store_octet<float>(float* dst, const float (&v)[8]) {
  reinterpret_cast<float4*>(dst)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(dst)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// Where block (n, kb) = blk lives: its plane-0 word, the distance between planes, its scale code.
struct BlockAddr {
  int64_t word;
  int64_t plane_stride;
  int64_t code;
};

template <int K, bool kRuntime>
__device__ __forceinline__ BlockAddr block_addr(uint32_t blk, uint32_t KB) {
  if constexpr (kRuntime) {
    // reference.repack: qweight_rt[nt, kt, b, r, j] (runtime word b), absmax_rt[nt, kt, r, j].
    const uint32_t n = blk / KB, kb = blk - n * KB;
    const uint32_t KT = (KB + kTileKB - 1) / kTileKB;
    const int64_t tile = static_cast<int64_t>(n / kTileN) * KT + kb / kTileKB;
    const uint32_t in_tile = (n % kTileN) * kTileKB + kb % kTileKB;
    return {tile * K * kTileN * kTileKB + in_tile, kTileN * kTileKB, tile * kTileN * kTileKB + in_tile};
  } else {
    return {static_cast<int64_t>(blk) * K, 1, blk};
  }
}

template <typename OutT, int K, bool kRuntime>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint32_t* __restrict__ qweight, const uint8_t* __restrict__ absmax,
                      const float* __restrict__ codebook, OutT* __restrict__ out, uint32_t n_blocks, uint32_t KB) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float level = lane < (1 << K) ? __ldg(codebook + lane) : 0.0f;  // lane i holds codebook[i]
  const int q = lane % 4;
  const int64_t warp_stride = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t group = static_cast<int64_t>(blockIdx.x) * kWarps + warp; group * 8 < n_blocks; group += warp_stride) {
    const int64_t blk = group * 8 + lane / 4;
    const bool active = blk < n_blocks;
    uint32_t words[K];
    uint32_t code = 0;
#pragma unroll
    for (int b = 0; b < K; ++b) words[b] = 0;
    if (active) {
      const BlockAddr a = block_addr<K, kRuntime>(static_cast<uint32_t>(blk), KB);
#pragma unroll
      for (int b = 0; b < K; ++b) words[b] = __ldg(qweight + a.word + b * a.plane_stride);
      code = __ldg(absmax + a.code);
    }
    const float s = e4m4_decode(code);
    uint32_t lo, hi;
    if constexpr (kRuntime && K == 5) {
      stream5_octet(words, q, lo, hi);
    } else {
      if constexpr (kRuntime) runtime_words_to_planes<K>(words);
      unpack_octet<K>(words, q, lo, hi);
    }
    float v[8];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      v[j] = __fmul_rn(__shfl_sync(0xffffffffu, level, (lo >> (8 * j)) & 0xFFu), s);
      v[4 + j] = __fmul_rn(__shfl_sync(0xffffffffu, level, (hi >> (8 * j)) & 0xFFu), s);
    }
    if (active) store_octet<OutT>(out + blk * kBlockSize + q * 8, v);
  }
}

template <typename OutT, int K, bool kRuntime>
void launch_typed(const at::Tensor& qweight, const at::Tensor& absmax, const at::Tensor& codebook, int64_t N,
                  int64_t KB, at::Tensor& out) {
  const int64_t n_blocks = N * KB;
  const int64_t groups = (n_blocks + 7) / 8;
  auto kernel = dequantize_kernel<OutT, K, kRuntime>;
  const int grid = persistent_grid(kernel, kThreads, (groups + kWarps - 1) / kWarps);
  kernel<<<grid, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const uint32_t*>(qweight.data_ptr<int32_t>()), absmax.data_ptr<uint8_t>(),
      codebook.data_ptr<float>(), reinterpret_cast<OutT*>(out.data_ptr()), static_cast<uint32_t>(n_blocks),
      static_cast<uint32_t>(KB));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename OutT, int K>
void launch_layout(const at::Tensor& qweight, const at::Tensor& absmax, const at::Tensor& codebook, bool runtime_layout,
                   int64_t N, int64_t KB, at::Tensor& out) {
  if (runtime_layout) return launch_typed<OutT, K, true>(qweight, absmax, codebook, N, KB, out);
  launch_typed<OutT, K, false>(qweight, absmax, codebook, N, KB, out);
}

template <typename OutT>
void launch_k(const at::Tensor& qweight, const at::Tensor& absmax, const at::Tensor& codebook, int64_t k,
              bool runtime_layout, int64_t N, int64_t KB, at::Tensor& out) {
  with_bits(k, "kbit dequantize", [&](auto bits) {
    launch_layout<OutT, decltype(bits)::value>(qweight, absmax, codebook, runtime_layout, N, KB, out);
  });
}

}  // namespace

void launch_dequantize(const at::Tensor& qweight, const at::Tensor& absmax, const at::Tensor& codebook, int64_t k,
                       bool runtime_layout, int64_t N, int64_t KB, at::Tensor& out) {
  if (N * KB == 0) return;
  switch (out.scalar_type()) {
    case at::kBFloat16: return launch_k<__nv_bfloat16>(qweight, absmax, codebook, k, runtime_layout, N, KB, out);
    case at::kHalf: return launch_k<__half>(qweight, absmax, codebook, k, runtime_layout, N, KB, out);
    case at::kFloat: return launch_k<float>(qweight, absmax, codebook, k, runtime_layout, N, KB, out);
    default:
      KBIT_CHECK_TYPE(false, "kbit: output dtype ", out.scalar_type(),
                       " is not supported; supported: float16, bfloat16, float32");
  }
}

}  // namespace kbit
