// kbit quantize: W [N, K] -> bit-plane qweight [N, K/32, k] + E4M4 absmax [N, K/32].
//
// One lane owns one 32-element block: it takes the absmax on integer bits, encodes/decodes
// the scale, scales the codebook thresholds once, then finds every element's index with a
// k-step branch-free binary search whose masks are the bit-planes themselves. A warp covers
// 32 consecutive blocks (a "group"). While it computes one group, the next one is already
// on its way into shared memory (cp.async, coalesced 512-byte rows, double buffered), so
// every warp keeps loads in flight through its long compute phase. Packed words go through
// shared memory too, so the qweight stores are coalesced.
//
// With scale search (format.block_scales) the lane quantizes its block against the absmax
// code and each code absmax + kScaleSearchOffsets, in that order, and keeps the first code
// with the smallest block squared error; the block is still in registers, so the search
// costs arithmetic only, no extra memory traffic.
#include "kbit_format.cuh"
#include "kbit_ops.h"
#include "launch_utils.cuh"

#include <c10/util/Exception.h>

#include "check.h"
#include "cp_async.cuh"

namespace kbit {
namespace {

// 8 warps per block for 16-bit inputs, 4 for fp32 (whose groups take twice the shared memory).
template <typename T>
constexpr int kWarps = sizeof(T) == 4 ? 4 : 8;
template <typename T>
constexpr int kThreads = 32 * kWarps<T>;

// Resident blocks per SM the register budget is sized for: 64 registers where the search
// fits, 128 for k=5 (31 thresholds) and fp32 (32 input words).
template <typename T, int K>
constexpr int kMinBlocks = sizeof(T) == 4 ? 4 : (K == 5 ? 2 : 4);

// Shared-memory slot of 16-byte chunk c of the block owned by `lane`: XOR-swizzled so that
// a warp reading chunk c of its 32 blocks (64 or 128 bytes apart) hits 32 distinct banks.
template <int kChunks>
__device__ __forceinline__ int chunk_slot(int lane, int c) {
  return lane * kChunks + (c ^ ((lane * kChunks / 8) & (kChunks - 1)));
}

// E4M4 code offsets tried around the absmax code, in order (format.SCALE_SEARCH_OFFSETS).
constexpr int kScaleSearchMin = -kScaleSearchRadius, kScaleSearchMax = kScaleSearchRadius;

// 32-bit registers holding one block of T.
template <typename T>
constexpr int kRawWords = kBlockSize * sizeof(T) / 4;

// Bit-plane words of the block in raw quantized against scale sc: every unit's index search.
template <typename T, int K>
__device__ __forceinline__ void quantize_block(const uint32_t (&raw)[kRawWords<T>], const float (&t)[(1 << K) - 1],
                                               float sc, uint32_t (&words)[K]) {
  using Traits = ElemTraits<T>;
  uint32_t thr[(1 << K) - 1];
#pragma unroll
  for (int i = 0; i < (1 << K) - 1; ++i) thr[i] = Traits::threshold(scaled_threshold(t[i], sc));
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
}

// Squared error of dequantizing the block (codebook level * sc, fp32) against its elements,
// rounded per operation and summed in format.block_squared_error's order: per quarter of 8
// elements j+4, then j+2, then j+1; then quarters q+2, then q+1.
template <typename T, int K>
__device__ __forceinline__ float block_squared_error(const uint32_t (&raw)[kRawWords<T>], const uint32_t (&words)[K],
                                                     const float* __restrict__ cb_smem, float sc) {
  float quarter[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    float sq[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int i = 8 * q + j;
      uint32_t idx = 0;
#pragma unroll
      for (int b = 0; b < K; ++b) idx |= ((words[b] >> i) & 1u) << b;
      const float e = __fsub_rn(ElemTraits<T>::element(raw, i), __fmul_rn(cb_smem[idx], sc));
      sq[j] = __fmul_rn(e, e);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) sq[j] = __fadd_rn(sq[j], sq[j + 4]);
    quarter[q] = __fadd_rn(__fadd_rn(sq[0], sq[2]), __fadd_rn(sq[1], sq[3]));
  }
  return __fadd_rn(__fadd_rn(quarter[0], quarter[2]), __fadd_rn(quarter[1], quarter[3]));
}

// The scale code format.block_scales(search=True) picks: the absmax code, then each offset
// in order; a candidate replaces the best only with a strictly smaller error.
template <typename T, int K>
__device__ __forceinline__ uint32_t searched_scale_code(const uint32_t (&raw)[kRawWords<T>],
                                                        const float (&t)[(1 << K) - 1],
                                                        const float* __restrict__ cb_smem, uint32_t absmax_code) {
  uint32_t words[K];
  float sc = e4m4_decode(absmax_code);
  quantize_block<T, K>(raw, t, sc, words);
  float best_err = block_squared_error<T, K>(raw, words, cb_smem, sc);
  uint32_t best = absmax_code;
#pragma unroll 1
  for (int offset = kScaleSearchMin; offset <= kScaleSearchMax; ++offset) {
    if (offset == 0) continue;
    const uint32_t code = static_cast<uint32_t>(min(max(static_cast<int>(absmax_code) + offset, 0), 255));
    sc = e4m4_decode(code);
    quantize_block<T, K>(raw, t, sc, words);
    const float err = block_squared_error<T, K>(raw, words, cb_smem, sc);
    if (err < best_err) {
      best_err = err;
      best = code;
    }
  }
  return best;
}

template <typename T, int K>
__global__ void __launch_bounds__(kThreads<T>, kMinBlocks<T, K>)
    quantize_kernel(const T* __restrict__ W, const float* __restrict__ codebook, uint32_t* __restrict__ qweight,
                    uint8_t* __restrict__ absmax, int64_t n_blocks, bool search) {
  constexpr int kLevels = 1 << K;
  constexpr int kChunks = kBlockSize * sizeof(T) / 16;  // 16-byte chunks per block
  constexpr int kGroupChunks = 32 * kChunks;
  constexpr int kW = kWarps<T>;
  using Traits = ElemTraits<T>;
  __shared__ uint4 buf[kW][2][kGroupChunks];
  __shared__ uint32_t stage[kW][32 * K];
  __shared__ float cb_smem[kLevels];  // levels looked up by run-time index (distinct banks)

  if (threadIdx.x < kLevels) cb_smem[threadIdx.x] = codebook[threadIdx.x];
  __syncthreads();
  float t[kLevels - 1];
#pragma unroll
  for (int i = 0; i < kLevels - 1; ++i) t[i] = codebook_threshold(__ldg(codebook + i), __ldg(codebook + i + 1));

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint4* src = reinterpret_cast<const uint4*>(W);
  const int64_t n_chunks = n_blocks * kChunks;
  // Copy instruction i of the warp moves chunks i*32 .. i*32+31 of the group: 512 contiguous bytes.
  auto prefetch = [&](int64_t group, int s) {
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int c = i * 32 + lane;
      const int64_t g = group * kGroupChunks + c;
      // L2 only (cp.async.cg): every byte is read once.
      if (g < n_chunks)
        cp_async16(static_cast<uint32_t>(__cvta_generic_to_shared(&buf[warp][s][chunk_slot<kChunks>(c / kChunks, c % kChunks)])),
                   src + g, true);
    }
    cp_async_commit();
  };

  const int64_t warp_stride = static_cast<int64_t>(gridDim.x) * kW;
  int64_t group = static_cast<int64_t>(blockIdx.x) * kW + warp;
  prefetch(group, 0);
  for (int s = 0; group * 32 < n_blocks; group += warp_stride, s ^= 1) {
    prefetch(group + warp_stride, s ^ 1);
    cp_async_wait<1>();  // the group just prefetched may stay in flight
    __syncwarp();  // every lane's copies of this group are complete and visible
    const int64_t blk = group * 32 + lane;
    if (blk < n_blocks) {
      uint32_t raw[kRawWords<T>];
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {
        const uint4 v = buf[warp][s][chunk_slot<kChunks>(lane, i)];
        raw[4 * i] = v.x;
        raw[4 * i + 1] = v.y;
        raw[4 * i + 2] = v.z;
        raw[4 * i + 3] = v.w;
      }
      uint32_t amax = 0;
#pragma unroll
      for (int i = 0; i < kRawWords<T>; ++i) amax = Traits::max_bits(amax, raw[i] & Traits::kAbsMask);
      uint32_t code = e4m4_encode(Traits::absmax_to_float(amax));
      if (search) code = searched_scale_code<T, K>(raw, t, cb_smem, code);
      uint32_t words[K];
      quantize_block<T, K>(raw, t, e4m4_decode(code), words);
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
    __syncwarp();  // stage and buf[s] are free for the next iteration's writes
  }
}

template <typename T, int K>
void launch_typed(const at::Tensor& W, const at::Tensor& codebook, bool search, at::Tensor& qweight,
                  at::Tensor& absmax) {
  const int64_t n_blocks = absmax.numel();
  const int64_t groups = (n_blocks + 31) / 32;
  auto kernel = quantize_kernel<T, K>;
  const int grid = persistent_grid(kernel, kThreads<T>, (groups + kWarps<T> - 1) / kWarps<T>);
  kernel<<<grid, kThreads<T>, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const T*>(W.data_ptr()), codebook.data_ptr<float>(),
      reinterpret_cast<uint32_t*>(qweight.data_ptr<int32_t>()), absmax.data_ptr<uint8_t>(), n_blocks, search);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_k(const at::Tensor& W, const at::Tensor& codebook, int64_t k, bool search, at::Tensor& qweight,
              at::Tensor& absmax) {
  with_bits(k, "kbit quantize", [&](auto bits) {
    launch_typed<T, decltype(bits)::value>(W, codebook, search, qweight, absmax);
  });
}

}  // namespace

void launch_quantize(const at::Tensor& W, const at::Tensor& codebook, int64_t k, bool search_scale,
                     at::Tensor& qweight, at::Tensor& absmax) {
  if (absmax.numel() == 0) return;
  switch (W.scalar_type()) {
    case at::kBFloat16: return launch_k<__nv_bfloat16>(W, codebook, k, search_scale, qweight, absmax);
    case at::kHalf: return launch_k<__half>(W, codebook, k, search_scale, qweight, absmax);
    case at::kFloat: return launch_k<float>(W, codebook, k, search_scale, qweight, absmax);
    default: KBIT_CHECK_TYPE(false, "kbit: weight has dtype ", W.scalar_type(), "; supported: float16, bfloat16, float32");
  }
}

}  // namespace kbit
