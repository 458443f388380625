// kbit quantize: W [N, K] -> bit-plane qweight [N, K/32, k] + E4M4 absmax [N, K/32].
//
// One lane owns one 32-element block: it reads the block with 16-byte loads, takes the
// absmax on integer bits, encodes/decodes the scale, scales the codebook thresholds once,
// then finds every element's index with a k-step branch-free binary search whose masks are
// the bit-planes themselves. A warp covers 32 consecutive blocks; its packed words go
// through shared memory so the qweight stores are coalesced.
#include "kbit_format.cuh"
#include "kbit_ops.h"
#include "launch_utils.cuh"

#include <c10/util/Exception.h>

namespace kbit {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// Resident blocks per SM the register budget is sized for: 4 (64 registers) where the
// search fits, 2 (128) for k=5 and fp32, whose 31 thresholds / 32 input words need more.
template <typename T, int K>
constexpr int kMinBlocks = (K == 5 || sizeof(T) == 4) ? 2 : 4;

template <typename T, int K>
__global__ void __launch_bounds__(kThreads, kMinBlocks<T, K>) quantize_kernel(const T* __restrict__ W, const float* __restrict__ codebook,
                                                            uint32_t* __restrict__ qweight, uint8_t* __restrict__ absmax,
                                                            int64_t n_blocks) {
  constexpr int kLevels = 1 << K;
  constexpr int kRaw = kBlockSize * sizeof(T) / 4;  // 32-bit registers per block
  using Traits = ElemTraits<T>;
  __shared__ uint32_t stage[kWarps][32 * K];

  float t[kLevels - 1];
#pragma unroll
  for (int i = 0; i < kLevels - 1; ++i) t[i] = codebook_threshold(__ldg(codebook + i), __ldg(codebook + i + 1));

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t warp_stride = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t group = static_cast<int64_t>(blockIdx.x) * kWarps + warp; group * 32 < n_blocks; group += warp_stride) {
    const int64_t blk = group * 32 + lane;
    if (blk < n_blocks) {
      uint32_t raw[kRaw];
      const uint4* src = reinterpret_cast<const uint4*>(W) + blk * (kRaw / 4);
#pragma unroll
      for (int i = 0; i < kRaw / 4; ++i) {
        const uint4 v = __ldg(src + i);
        raw[4 * i] = v.x;
        raw[4 * i + 1] = v.y;
        raw[4 * i + 2] = v.z;
        raw[4 * i + 3] = v.w;
      }
      uint32_t amax = 0;
#pragma unroll
      for (int i = 0; i < kRaw; ++i) amax = Traits::max_bits(amax, raw[i] & Traits::kAbsMask);
      const uint32_t code = e4m4_encode(Traits::absmax_to_float(amax));
      const float s = e4m4_decode(code);

      uint32_t thr[kLevels - 1];
#pragma unroll
      for (int i = 0; i < kLevels - 1; ++i) thr[i] = Traits::threshold(scaled_threshold(t[i], s));

      uint32_t words[K];
#pragma unroll
      for (int b = 0; b < K; ++b) words[b] = 0;
#pragma unroll
      for (int p = 0; p < Traits::kUnits; ++p) {
        // 16-bit types: unit p = (element p, element p + 16); fp32: unit p = element p.
        uint32_t unit;
        if constexpr (Traits::kUnits == 16) {
          unit = __byte_perm(raw[p / 2], raw[8 + p / 2], (p & 1) ? 0x7632 : 0x5410);
        } else {
          unit = raw[p];
        }
        search_unit<T, K>(unit, thr, Traits::plane_bits(p), words);
      }
      absmax[blk] = static_cast<uint8_t>(code);
#pragma unroll
      for (int b = 0; b < K; ++b) stage[warp][lane * K + b] = words[b];
    }
    __syncwarp();
    const int64_t out_base = group * 32 * K, out_end = n_blocks * K;
#pragma unroll
    for (int b = 0; b < K; ++b) {
      const int64_t o = out_base + b * 32 + lane;
      if (o < out_end) qweight[o] = stage[warp][b * 32 + lane];
    }
    __syncwarp();
  }
}

template <typename T, int K>
void launch_typed(const at::Tensor& W, const at::Tensor& codebook, at::Tensor& qweight, at::Tensor& absmax) {
  const int64_t n_blocks = absmax.numel();
  const int64_t groups = (n_blocks + 31) / 32;
  auto kernel = quantize_kernel<T, K>;
  const int grid = persistent_grid(kernel, kThreads, (groups + kWarps - 1) / kWarps);
  kernel<<<grid, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const T*>(W.data_ptr()), codebook.data_ptr<float>(),
      reinterpret_cast<uint32_t*>(qweight.data_ptr<int32_t>()), absmax.data_ptr<uint8_t>(), n_blocks);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_k(const at::Tensor& W, const at::Tensor& codebook, int64_t k, at::Tensor& qweight, at::Tensor& absmax) {
  switch (k) {
    case 2: return launch_typed<T, 2>(W, codebook, qweight, absmax);
    case 3: return launch_typed<T, 3>(W, codebook, qweight, absmax);
    case 4: return launch_typed<T, 4>(W, codebook, qweight, absmax);
    case 5: return launch_typed<T, 5>(W, codebook, qweight, absmax);
    default: TORCH_CHECK_VALUE(false, "kbit: k=", k, " is not supported; k must be one of (2, 3, 4, 5)");
  }
}

}  // namespace

void launch_quantize(const at::Tensor& W, const at::Tensor& codebook, int64_t k, at::Tensor& qweight,
                     at::Tensor& absmax) {
  if (absmax.numel() == 0) return;
  switch (W.scalar_type()) {
    case at::kBFloat16: return launch_k<__nv_bfloat16>(W, codebook, k, qweight, absmax);
    case at::kHalf: return launch_k<__half>(W, codebook, k, qweight, absmax);
    case at::kFloat: return launch_k<float>(W, codebook, k, qweight, absmax);
    default: TORCH_CHECK_TYPE(false, "kbit: weight has dtype ", W.scalar_type(), "; supported: float16, bfloat16, float32");
  }
}

}  // namespace kbit
