// Dequantization steps shared by the kernels that read the runtime layout (gemv.cu, mma_*.cuh,
// wgmma*.cu): E4M4 scale decode, the bit-matrix transpose of a block's plane words into index
// words, the codebook lookup by register shuffle, and the 16-bit pairs the tensor-core kernels
// build their weight fragments from.
#pragma once

#include "kbit_format.cuh"

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace kbit {

// E4M4 code -> scale with two instructions: the code's bits shifted into an fp32 exponent and
// mantissa give 2^(e-127)(1+m/16) (e > 0) or the subnormal m/16 * 2^-126 (e = 0); the exact
// multiply by 2^116 re-biases both to format.e4m4_table's 2^(e-11)(1+m/16) and m/16 * 2^-10.
// Needs subnormals kept (no -ftz / fast-math), which setup.py guarantees.
__device__ __forceinline__ float decode_scale(uint32_t codes, int j) {
  return __uint_as_float(((codes >> (8 * j)) & 0xFFu) << 19) * 0x1p116f;
}

// Index fields: F bits per element, F index words per block (32 / F elements each).
template <int BITS>
struct Fields {
  static constexpr int kBits = BITS <= 4 ? 4 : 8;
};

// Delta swap: exchanges the bits of x at mask << s with the bits of y at mask (5 ALU ops).
__device__ __forceinline__ void swap_bits(uint32_t& x, uint32_t& y, int s, uint32_t mask) {
  const uint32_t t = ((x >> s) ^ y) & mask;
  y ^= t;
  x ^= t << s;
}

// Index words of one block from its plane words: a bit-matrix transpose of the F x 32 planes
// (missing planes are 0) in log2(F) stages of delta swaps between words i and i + s. After it,
// field j of q[r] holds bits (F*j + r) of planes 0..F-1, i.e. the index of element F*j + r.
// For k = 4 that is 20 ops per block instead of 28 for gathering each field bit separately;
// swaps involving zero planes fold away for smaller k.
template <int BITS>
__device__ __forceinline__ void gather_indices(const uint32_t (&plane)[BITS], uint32_t (&q)[Fields<BITS>::kBits]) {
  constexpr int F = Fields<BITS>::kBits;
#pragma unroll
  for (int r = 0; r < F; ++r) q[r] = r < BITS ? plane[r] : 0u;
#pragma unroll
  for (int s = 1; s < F; s *= 2) {
    const uint32_t mask = s == 1 ? 0x55555555u : s == 2 ? 0x33333333u : 0x0F0F0F0Fu;
#pragma unroll
    for (int i = 0; i < F; ++i) {
      if ((i & s) == 0) swap_bits(q[i], q[i + s], s, mask);
    }
  }
}

// Codebook value of element e of a block. The shuffle reads the source lane mod 32, so only
// the low 5 bits of the shifted word matter: they are e's index plus, for 4-bit fields, the
// lowest bit of the next field times 16, which the codebook register's replication
// (lane L holds codebook[L mod 2^k]) makes harmless.
// e is an unrolled loop counter, so q[e % F] and the shift are compile-time after unrolling.
template <int BITS>
__device__ __forceinline__ float lookup(float codebook_reg, const uint32_t (&q)[Fields<BITS>::kBits], int e) {
  constexpr int F = Fields<BITS>::kBits;
  return __shfl_sync(0xFFFFFFFFu, codebook_reg, static_cast<int>(q[e % F] >> (F * (e / F))));
}

// 16-bit element type T of the tensor-core kernels' weight fragments: two fp32 values rounded to
// nearest-even into one register (lo in the low half), scaled in pairs, and the scalar conversions.
template <typename T>
struct Half2;

template <>
struct Half2<__nv_bfloat16> {
  __device__ static __forceinline__ uint32_t pack(float lo, float hi) {
    return bits_as<uint32_t>(__floats2bfloat162_rn(lo, hi));
  }
  // Both halves times the scale pair s (round to nearest): one instruction for two weights.
  __device__ static __forceinline__ uint32_t scale2(uint32_t v, uint32_t s) {
    return bits_as<uint32_t>(__hmul2(bits_as<__nv_bfloat162>(v), bits_as<__nv_bfloat162>(s)));
  }
  __device__ static __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __forceinline__ __nv_bfloat16 narrow(float v) { return __float2bfloat16_rn(v); }
};

template <>
struct Half2<__half> {
  __device__ static __forceinline__ uint32_t pack(float lo, float hi) { return bits_as<uint32_t>(__floats2half2_rn(lo, hi)); }
  __device__ static __forceinline__ uint32_t scale2(uint32_t v, uint32_t s) {
    return bits_as<uint32_t>(__hmul2(bits_as<__half2>(v), bits_as<__half2>(s)));
  }
  __device__ static __forceinline__ float to_float(__half v) { return __half2float(v); }
  __device__ static __forceinline__ __half narrow(float v) { return __float2half_rn(v); }
};

}  // namespace kbit
