// kbit dequantize: flat (qweight [N, KB, k]) or runtime (qweight_rt [N/64, KB/4, k, 64, 4])
// layout -> W [N, KB*32] in fp16/bf16/fp32.
//
// Four lanes share one block, eight elements each, so a warp writes 8 blocks (512 bytes of
// bf16) with one coalesced 16-byte store per lane. Each lane reads the block's k plane words
// (the four lanes read the same words: one broadcast transaction), spreads its byte of each
// plane into eight indices, looks the levels up by shuffling from the lane that holds that
// codebook entry, and rounds fp32(level * scale) to the output type with round-to-nearest-even.
// Which 8 blocks a warp takes follows the layout: 8 consecutive ones (flat), or 4 blocks of two
// adjacent rows (runtime, where those rows' words sit side by side; dequantize_runtime_kernel).
#include "kbit_format.cuh"
#include "kbit_ops.h"
#include "launch_utils.cuh"

#include <c10/util/Exception.h>

#include "check.h"

namespace kbit {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// One 16-byte global store. A plain uint4 assignment of the packed halves compiles to four 4-byte
// stores (the halves come from memcpy-based bit casts), a quarter of the bytes per store instruction.
__device__ __forceinline__ void st_global16(void* dst, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

// Eight fp32 values rounded to OutT and written as 16-byte vectors.
template <typename OutT>
__device__ __forceinline__ void store_octet(OutT* dst, const float (&v)[8]);

template <>
__device__ __forceinline__ void store_octet<__nv_bfloat16>(__nv_bfloat16* dst, const float (&v)[8]) {
  st_global16(dst, bits_as<uint32_t>(__floats2bfloat162_rn(v[0], v[1])), bits_as<uint32_t>(__floats2bfloat162_rn(v[2], v[3])),
              bits_as<uint32_t>(__floats2bfloat162_rn(v[4], v[5])), bits_as<uint32_t>(__floats2bfloat162_rn(v[6], v[7])));
}

template <>
__device__ __forceinline__ void store_octet<__half>(__half* dst, const float (&v)[8]) {
  st_global16(dst, bits_as<uint32_t>(__floats2half2_rn(v[0], v[1])), bits_as<uint32_t>(__floats2half2_rn(v[2], v[3])),
              bits_as<uint32_t>(__floats2half2_rn(v[4], v[5])), bits_as<uint32_t>(__floats2half2_rn(v[6], v[7])));
}

template <>
__device__ __forceinline__ void store_octet<float>(float* dst, const float (&v)[8]) {
  st_global16(dst, __float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]), __float_as_uint(v[3]));
  st_global16(dst + 4, __float_as_uint(v[4]), __float_as_uint(v[5]), __float_as_uint(v[6]), __float_as_uint(v[7]));
}

// Lane q's eight levels of a block (elements 8q .. 8q + 7) times its scale, in fp32: indices from the
// block's words, levels by shuffling from the lane that holds that codebook entry (every lane takes part).
template <int K, bool kRuntime>
__device__ __forceinline__ void decode_octet(uint32_t (&words)[K], int q, float level, float s, float (&v)[8]) {
  uint32_t lo, hi;
  if constexpr (kRuntime && K == 5) {
    stream5_octet(words, q, lo, hi);
  } else {
    if constexpr (kRuntime) runtime_words_to_planes<K>(words);
    unpack_octet<K>(words, q, lo, hi);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    v[j] = __fmul_rn(__shfl_sync(0xffffffffu, level, (lo >> (8 * j)) & 0xFFu), s);
    v[4 + j] = __fmul_rn(__shfl_sync(0xffffffffu, level, (hi >> (8 * j)) & 0xFFu), s);
  }
}

// Flat layout: a warp takes 8 consecutive blocks per step.
template <typename OutT, int K>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint32_t* __restrict__ qweight, const uint8_t* __restrict__ absmax,
                      const float* __restrict__ codebook, OutT* __restrict__ out, uint32_t n_blocks) {
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
    for (int b = 0; b < K; ++b) words[b] = active ? __ldg(qweight + blk * K + b) : 0u;
    if (active) code = __ldg(absmax + blk);
    float v[8];
    decode_octet<K, false>(words, q, level, e4m4_decode(code), v);
    if (active) store_octet<OutT>(out + blk * kBlockSize + q * 8, v);
  }
}

// Runtime layout: a warp step is one row pair of one runtime tile's k-tile, lanes 0..15 the even row and
// 16..31 the odd one, four lanes per block. The pair's words of a plane are 32 adjacent bytes (one
// sector, whole), its output two 256-byte row segments. A warp takes kSteps adjacent pairs at once,
// every load issued before the first decode, so each warp keeps kSteps sectors per plane in flight.
constexpr int kSteps = 4;
constexpr int kPairsPerTile = kTileN / 2;
static_assert(kPairsPerTile % kSteps == 0, "a warp's pairs share one runtime tile");

template <typename OutT, int K>
__global__ void __launch_bounds__(kThreads)
    dequantize_runtime_kernel(const uint32_t* __restrict__ qweight, const uint8_t* __restrict__ absmax,
                              const float* __restrict__ codebook, OutT* __restrict__ out, uint32_t N, uint32_t KB,
                              uint32_t KT, int64_t n_pairs) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float level = lane < (1 << K) ? __ldg(codebook + lane) : 0.0f;  // lane i holds codebook[i]
  const int q = lane % 4, blk_in_tile = (lane / 4) % kTileKB, odd = lane / 16;
  const int64_t K_elems = static_cast<int64_t>(KB) * kBlockSize;
  const int64_t warp_stride = static_cast<int64_t>(gridDim.x) * kWarps * kSteps;
  for (int64_t p0 = (static_cast<int64_t>(blockIdx.x) * kWarps + warp) * kSteps; p0 < n_pairs; p0 += warp_stride) {
    const int64_t tile = p0 / kPairsPerTile;  // nt * KT + kt
    const uint32_t nt = static_cast<uint32_t>(tile / KT), kb = static_cast<uint32_t>(tile % KT) * kTileKB + blk_in_tile;
    const int r0 = 2 * static_cast<int>(p0 % kPairsPerTile) + odd;  // this lane's row in the tile at step 0
    uint32_t words[kSteps][K], code[kSteps];
    bool active[kSteps];
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      const int in_tile = (r0 + 2 * u) * kTileKB + blk_in_tile;  // the block's index among the tile's blocks
      active[u] = nt * kTileN + r0 + 2 * u < N && kb < KB;
#pragma unroll
      for (int b = 0; b < K; ++b) words[u][b] = active[u] ? __ldg(qweight + (tile * K + b) * kTileBlocks + in_tile) : 0u;
      code[u] = active[u] ? __ldg(absmax + tile * kTileBlocks + in_tile) : 0u;
    }
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      float v[8];
      decode_octet<K, true>(words[u], q, level, e4m4_decode(code[u]), v);
      const int64_t n = static_cast<int64_t>(nt) * kTileN + r0 + 2 * u;
      if (active[u]) store_octet<OutT>(out + n * K_elems + kb * kBlockSize + q * 8, v);
    }
  }
}

template <typename OutT, int K>
void launch_layout(const at::Tensor& qweight, const at::Tensor& absmax, const at::Tensor& codebook, bool runtime_layout,
                   int64_t N, int64_t KB, at::Tensor& out) {
  const auto* q = reinterpret_cast<const uint32_t*>(qweight.data_ptr<int32_t>());
  const auto* a = absmax.data_ptr<uint8_t>();
  const float* cb = codebook.data_ptr<float>();
  auto* o = reinterpret_cast<OutT*>(out.data_ptr());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (runtime_layout) {
    const int64_t KT = (KB + kTileKB - 1) / kTileKB, n_pairs = (N + kTileN - 1) / kTileN * KT * kPairsPerTile;
    auto kernel = dequantize_runtime_kernel<OutT, K>;
    const int grid = persistent_grid(kernel, kThreads, (n_pairs / kSteps + kWarps - 1) / kWarps);
    kernel<<<grid, kThreads, 0, stream>>>(q, a, cb, o, static_cast<uint32_t>(N), static_cast<uint32_t>(KB),
                                          static_cast<uint32_t>(KT), n_pairs);
  } else {
    const int64_t n_blocks = N * KB, groups = (n_blocks + 7) / 8;
    auto kernel = dequantize_kernel<OutT, K>;
    const int grid = persistent_grid(kernel, kThreads, (groups + kWarps - 1) / kWarps);
    kernel<<<grid, kThreads, 0, stream>>>(q, a, cb, o, static_cast<uint32_t>(n_blocks));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
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
