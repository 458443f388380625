// Device helpers for the kbit format. vllm_kbit/reference.py is the spec: every helper
// here reproduces one of its steps bit for bit (no fast-math, explicit _rn arithmetic).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "format_constants.h"  // kBlockSize, kTileN, kTileKB, kE4M4Bias

namespace kbit {

// Blocks of one runtime tile (kTileN rows x kTileKB blocks): the words of one index plane, the scale codes.
constexpr int kTileBlocks = kTileN * kTileKB;

// Reinterprets the bits of one 32-bit value as another type (packed halves <-> registers).
template <typename To, typename From>
__host__ __device__ __forceinline__ To bits_as(const From& v) {
  static_assert(sizeof(To) == sizeof(From), "bits_as needs equal sizes");
  To out;
  memcpy(&out, &v, sizeof(To));
  return out;
}

// ----------------------------------------------------------------------------- E4M4 scale

// Decoded scale of a code, exactly format.e4m4_table: normal 2^(e-11)*(1+m/16) built as
// IEEE bits (no rounding possible), subnormal m*2^-14 (an exact product), code 0 -> 0.
__host__ __device__ __forceinline__ float e4m4_decode(uint32_t code) {
  const uint32_t e = code >> 4, m = code & 15u;
  if (e == 0) return static_cast<float>(m) * 6.103515625e-05f;  // 2^-14
  return bits_as<float>(((e - kE4M4Bias + 127u) << 23) | (m << 19));
}

// Midpoint between codes c and c+1, as format._e4m4_midpoints computes it in fp32 (exact:
// both values have 5 significant bits and adjacent exponents).
__host__ __device__ __forceinline__ float e4m4_midpoint(uint32_t c) {
  return (e4m4_decode(c) + e4m4_decode(c + 1)) * 0.5f;
}

// Nearest code to x >= 0 (or NaN), = format.e4m4_encode: the number of midpoints below x
// (searchsorted right=False), so ties go to the lower code and x > 31.5 saturates at 255.
// The code whose value is the largest <= x comes from x's exponent and top 4 mantissa bits
// (or x*2^14 below the normal range); one comparison with its upper midpoint finishes it.
// NaN gives 255 like torch.searchsorted (NaN sorts last).
__host__ __device__ __forceinline__ uint32_t e4m4_encode(float x) {
  if (!(x == x)) return 255u;
  uint32_t c;
  if (x >= 9.765625e-04f) {  // 2^-10: smallest normal E4M4 value
    const uint32_t bits = bits_as<uint32_t>(x);
    const int e = static_cast<int>(bits >> 23) - 127 + kE4M4Bias;
    if (e > 15) return 255u;
    c = (static_cast<uint32_t>(e) << 4) | ((bits >> 19) & 15u);
  } else {
    c = static_cast<uint32_t>(x * 16384.0f);  // exact product, truncation = floor for x >= 0
  }
  return (c < 255u && x > e4m4_midpoint(c)) ? c + 1 : c;
}

// ----------------------------------------------------------------------------- codebook

// Decision threshold between levels c0 < c1 in fp32: format.codebook_thresholds.
__device__ __forceinline__ float codebook_threshold(float c0, float c1) {
  return __fmul_rn(__fadd_rn(c0, c1), 0.5f);
}

// Threshold against a block's decoded scale: a plain fp32 product (choose_indices), never
// contracted into anything else.
__device__ __forceinline__ float scaled_threshold(float t, float s) { return __fmul_rn(t, s); }

// ----------------------------------------------------------------------------- element types
// A quantize "unit" is one 32-bit register compared against a threshold with one instruction
// giving an all-ones mask per element: two elements for 16-bit types, one for fp32. For
// 16-bit types unit p holds elements p (low half) and p + 16 (high half) of the block, so the
// mask bits at positions p and p + 16 are exactly bit-plane bits p and p + 16.

template <typename T>
struct ElemTraits;

template <>
struct ElemTraits<__nv_bfloat16> {
  static constexpr int kUnits = 16;
  // |w| as integer bits: clearing the sign makes bit order = magnitude order (NaN above Inf).
  static constexpr uint32_t kAbsMask = 0x7FFF7FFFu;
  __device__ static __forceinline__ uint32_t max_bits(uint32_t a, uint32_t b) { return __vmaxu2(a, b); }
  __device__ static __forceinline__ float absmax_to_float(uint32_t m) {
    return __uint_as_float(__vmaxu2(m, m >> 16) << 16);  // larger half as fp32 (exact widening)
  }
  // w > t (fp32) <=> w > round_down_bf16(t) for any bf16 w, so the fp32 comparison of the
  // reference becomes one packed bf16 compare; the threshold is duplicated into both halves.
  __device__ static __forceinline__ uint32_t threshold(float t) {
    return bits_as<uint32_t>(__bfloat162bfloat162(__float2bfloat16_rd(t)));
  }
  __device__ static __forceinline__ uint32_t gt_mask(uint32_t u, uint32_t t) {
    return __hgt2_mask(bits_as<__nv_bfloat162>(u), bits_as<__nv_bfloat162>(t));
  }
  __device__ static __forceinline__ uint32_t plane_bits(int p) { return 0x00010001u << p; }
  // Element i of a block held as 16 registers of two (element 2r low, 2r+1 high), widened exactly.
  __device__ static __forceinline__ float element(const uint32_t* raw, int i) {
    return __uint_as_float((i & 1) ? (raw[i / 2] & 0xFFFF0000u) : (raw[i / 2] << 16));
  }
};

template <>
struct ElemTraits<__half> {
  static constexpr int kUnits = 16;
  static constexpr uint32_t kAbsMask = 0x7FFF7FFFu;
  __device__ static __forceinline__ uint32_t max_bits(uint32_t a, uint32_t b) { return __vmaxu2(a, b); }
  __device__ static __forceinline__ float absmax_to_float(uint32_t m) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(__vmaxu2(m, m >> 16))));
  }
  // Same rounding-down argument as bf16 (fp16 subnormals included: no flush to zero).
  __device__ static __forceinline__ uint32_t threshold(float t) {
    return bits_as<uint32_t>(__half2half2(__float2half_rd(t)));
  }
  __device__ static __forceinline__ uint32_t gt_mask(uint32_t u, uint32_t t) {
    return __hgt2_mask(bits_as<__half2>(u), bits_as<__half2>(t));
  }
  __device__ static __forceinline__ uint32_t plane_bits(int p) { return 0x00010001u << p; }
  __device__ static __forceinline__ float element(const uint32_t* raw, int i) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>((i & 1) ? raw[i / 2] >> 16 : raw[i / 2])));
  }
};

template <>
struct ElemTraits<float> {
  static constexpr int kUnits = 32;
  static constexpr uint32_t kAbsMask = 0x7FFFFFFFu;
  __device__ static __forceinline__ uint32_t max_bits(uint32_t a, uint32_t b) { return a > b ? a : b; }
  __device__ static __forceinline__ float absmax_to_float(uint32_t m) { return __uint_as_float(m); }
  __device__ static __forceinline__ uint32_t threshold(float t) { return __float_as_uint(t); }
  __device__ static __forceinline__ uint32_t gt_mask(uint32_t u, uint32_t t) {
    uint32_t m;
    asm("set.gt.u32.f32 %0, %1, %2;" : "=r"(m) : "f"(__uint_as_float(u)), "f"(__uint_as_float(t)));
    return m;
  }
  __device__ static __forceinline__ uint32_t plane_bits(int p) { return 1u << p; }
  __device__ static __forceinline__ float element(const uint32_t* raw, int i) { return __uint_as_float(raw[i]); }
};

// ----------------------------------------------------------------------------- index search

// Bitwise select: a where mask bits are 0, b where they are 1 (one LOP3).
__device__ __forceinline__ uint32_t select_bits(uint32_t mask, uint32_t a, uint32_t b) {
  return (a & ~mask) | (b & mask);
}

// Calls f(std::integral_constant<int, i>) for i = 0 .. N-1: compile-time indices, so the
// register arrays below are never indexed at run time (which would move them to local memory).
template <typename F, int... Is>
__device__ __forceinline__ void static_for_impl(F&& f, std::integer_sequence<int, Is...>) {
  (f(std::integral_constant<int, Is>{}), ...);
}
template <int N, typename F>
__device__ __forceinline__ void static_for(F&& f) {
  static_for_impl(f, std::make_integer_sequence<int, N>{});
}

// Index of each element of a unit, OR-ed into the K bit-plane words at plane_bits.
// idx = #{i : w > T[i]} equals a binary search because the scaled thresholds are
// non-decreasing (ascending codebook, s >= 0): level l compares against the middle
// threshold of the range its l higher bits select, and its mask is bit K-1-l of idx.
// The candidate thresholds of level l are narrowed with the masks of the levels above,
// lowest first (2^l - 1 bitwise selects).
template <typename T, int K>
__device__ __forceinline__ void search_unit(uint32_t unit, const uint32_t (&thr)[(1 << K) - 1], uint32_t plane_bits,
                                            uint32_t (&words)[K]) {
  uint32_t m[K];
  static_for<K>([&](auto L) {
    constexpr int l = L;
    uint32_t cand[1 << l];
    static_for<(1 << l)>([&](auto P) { cand[P] = thr[(P << (K - l)) + (1 << (K - l - 1)) - 1]; });
    static_for<l>([&](auto R) {
      constexpr int j = l - 1 - R;
      static_for<(1 << j)>([&](auto Q) { cand[Q] = select_bits(m[j], cand[2 * Q], cand[2 * Q + 1]); });
    });
    m[l] = ElemTraits<T>::gt_mask(unit, cand[0]);
    words[K - 1 - l] |= m[l] & plane_bits;
  });
}

// ----------------------------------------------------------------------------- runtime index words

// Delta swap: exchanges the bits of x at mask << s with the bits of y at mask (5 ALU ops).
__host__ __device__ __forceinline__ void swap_bits(uint32_t& x, uint32_t& y, int s, uint32_t mask) {
  const uint32_t t = ((x >> s) ^ y) & mask;
  y ^= t;
  x ^= t << s;
}

// Every k stores each block's words in the runtime layout already arranged for the kernels' lookups
// (reference.planes_to_runtime_words, the same steps in the same order), so no kernel transposes them
// per call. For k = 2..4 a plane bit has address bits (word w, position p0..p4) = (index bit, element);
// a swap between words w and w + 2^i at distance 2^j exchanges w_i and p_j.
//   k = 4: byte n of word w = indices of elements e (low nibble) and e + 1, e = 8n + 2 (w >> 1) + 4 (w & 1);
//   k = 3: the k = 4 words of the three planes and a zero fourth (3-bit indices in bits 0-2 and 4-6 of
//          each byte, bits 3 and 7 clear), with the fourth word folded into those clear bits of the
//          other three (fold3) so the block stays 3 words: bits 3, 7 of each byte of word i hold bits
//          i, i + 4 of the same byte of word 3;
//   k = 2: byte n of word w = 2-bit indices of elements 8n + 4w .. +3, lowest first;
//   k = 5: the five words are one little-endian 160-bit stream of 5-bit indices, element e at bits
//          5e .. 5e + 4, so the pair (2j, 2j + 1) is the 10-bit field at bit 10j: one (funnel) shift
//          extracts an element for the shuffle decode or a pair's row of the 1024-entry table.

// Word and shift of stream bit `bit` of a k = 5 block (element e's index starts at bit 5e, pair j's at 10j).
__host__ __device__ constexpr int stream5_word(int bit) { return bit / 32; }
__host__ __device__ constexpr int stream5_shift(int bit) { return bit % 32; }

// Stream bits [bit, bit + 32) of a k = 5 block's words (bits past the stream read as 0): one shift, or one
// funnel shift where the field crosses a word.
__host__ __device__ __forceinline__ uint32_t stream5_bits(const uint32_t (&w)[5], int bit) {
  const int i = stream5_word(bit), s = stream5_shift(bit);
  if (s == 0) return w[i];
  const uint32_t next = i + 1 < 5 ? w[i + 1] : 0u;
#ifdef __CUDA_ARCH__
  return __funnelshift_r(w[i], next, s);
#else
  return (w[i] >> s) | (next << (32 - s));
#endif
}

// The k = 3 fold: word 3 of the k = 4 transpose (bits 3, 7 of every byte clear) into the clear bits
// of words 0..2, and back. unfold3 returns word 3; clear_fold3 masks the folded bits off a word.
constexpr uint32_t kFoldMask = 0x88888888u;
__host__ __device__ __forceinline__ void fold3(uint32_t (&w)[4]) {
  w[0] |= (w[3] << 3) & kFoldMask;
  w[1] |= (w[3] << 2) & kFoldMask;
  w[2] |= (w[3] << 1) & kFoldMask;
  w[3] = 0;
}
__host__ __device__ __forceinline__ uint32_t unfold3(uint32_t w0, uint32_t w1, uint32_t w2) {
  return ((w0 >> 3) & 0x11111111u) | ((w1 >> 2) & 0x22222222u) | ((w2 >> 1) & 0x44444444u);
}
__host__ __device__ __forceinline__ uint32_t clear_fold3(uint32_t w) { return w & ~kFoldMask; }

template <int K>
__host__ __device__ __forceinline__ void planes_to_runtime_words(uint32_t (&w)[K]) {
  if constexpr (K == 5) {
    uint32_t out[5] = {0u, 0u, 0u, 0u, 0u};
#pragma unroll
    for (int e = 0; e < 32; ++e) {
      uint32_t idx = 0;
#pragma unroll
      for (int b = 0; b < 5; ++b) idx |= ((w[b] >> e) & 1u) << b;
      const int i = stream5_word(5 * e), s = stream5_shift(5 * e);
      out[i] |= idx << s;
      if (s > 27) out[i + 1] |= idx >> (32 - s);
    }
#pragma unroll
    for (int b = 0; b < 5; ++b) w[b] = out[b];
  } else if constexpr (K == 2) {
    swap_bits(w[0], w[1], 1, 0x55555555u);  // index bit to position bit 0, element bit 0 to the word
    swap_bits(w[0], w[1], 2, 0x33333333u);  // element bit 0 to position bit 1, bit 1 to the word
    swap_bits(w[0], w[1], 4, 0x0F0F0F0Fu);  // element bit 1 to position bit 2, bit 2 to the word
  } else if constexpr (K == 3) {
    uint32_t u[4] = {w[0], w[1], w[2], 0u};
    planes_to_runtime_words<4>(u);
    fold3(u);
    w[0] = u[0], w[1] = u[1], w[2] = u[2];
  } else {
    swap_bits(w[0], w[1], 1, 0x55555555u);  // index bit 0 in, element bit 0 to word bit 0
    swap_bits(w[2], w[3], 1, 0x55555555u);
    swap_bits(w[0], w[2], 2, 0x33333333u);  // index bit 1 in, element bit 1 to word bit 1
    swap_bits(w[1], w[3], 2, 0x33333333u);
    swap_bits(w[0], w[1], 4, 0x0F0F0F0Fu);  // element bit 0 to the nibble, bit 2 to word bit 0
    swap_bits(w[2], w[3], 4, 0x0F0F0F0Fu);
  }
}

// The inverse for k = 2..4: each swap undoes itself, so the same swaps in reverse order (k = 3: unfold first). k = 5's
// readers take indices from the stream itself (stream5_bits, stream5_octet).
template <int K>
__host__ __device__ __forceinline__ void runtime_words_to_planes(uint32_t (&w)[K]) {
  static_assert(K >= 2 && K <= 4, "k = 5 is read from its stream, not turned back into planes");
  if constexpr (K == 2) {
    swap_bits(w[0], w[1], 4, 0x0F0F0F0Fu);
    swap_bits(w[0], w[1], 2, 0x33333333u);
    swap_bits(w[0], w[1], 1, 0x55555555u);
  } else if constexpr (K == 3) {
    uint32_t u[4] = {clear_fold3(w[0]), clear_fold3(w[1]), clear_fold3(w[2]), unfold3(w[0], w[1], w[2])};
    runtime_words_to_planes<4>(u);
    w[0] = u[0], w[1] = u[1], w[2] = u[2];
  } else {
    swap_bits(w[2], w[3], 4, 0x0F0F0F0Fu);
    swap_bits(w[0], w[1], 4, 0x0F0F0F0Fu);
    swap_bits(w[1], w[3], 2, 0x33333333u);
    swap_bits(w[0], w[2], 2, 0x33333333u);
    swap_bits(w[2], w[3], 1, 0x55555555u);
    swap_bits(w[0], w[1], 1, 0x55555555u);
  }
}

// Word and bit offset of element e's index among a block's index words (k = 2, 4: the runtime words;
// k = 3: the four k = 4 words its three runtime words unfold into; k = 5 reads its stream: stream5_bits).
template <int K>
__host__ __device__ constexpr int runtime_word_of(int e) {
  return K >= 3 ? ((e >> 2) & 1) | (((e >> 1) & 1) << 1) : (e >> 2) & 1;
}
template <int K>
__host__ __device__ constexpr int runtime_shift_of(int e) {
  return K >= 3 ? 8 * (e >> 3) + 4 * (e & 1) : 8 * (e >> 3) + 2 * (e & 3);
}

// ----------------------------------------------------------------------------- bit-plane unpack

// Bits 0..3 of x moved to bits 0, 8, 16, 24 (the four partial products x<<7i land on
// distinct bits, so the multiply never carries into the kept ones).
__device__ __forceinline__ uint32_t spread_nibble(uint32_t x) { return (x * 0x00204081u) & 0x01010101u; }

// Indices of elements 8q .. 8q+7 of a block from its K plane words, one per byte:
// lo holds elements 8q..8q+3, hi 8q+4..8q+7 (byte j = element j's index).
template <int K>
__device__ __forceinline__ void unpack_octet(const uint32_t (&words)[K], int q, uint32_t& lo, uint32_t& hi) {
  lo = 0;
  hi = 0;
#pragma unroll
  for (int b = 0; b < K; ++b) {
    const uint32_t byte = words[b] >> (8 * q);
    lo |= spread_nibble(byte & 15u) << b;
    hi |= spread_nibble((byte >> 4) & 15u) << b;
  }
}

// The same from a k = 5 block's stream words: the octet's 40 bits start at bit 40q, i.e. at bit 8q of word q.
__device__ __forceinline__ void stream5_octet(const uint32_t (&words)[5], int q, uint32_t& lo, uint32_t& hi) {
  uint32_t a = words[0], b = words[1];
#pragma unroll
  for (int i = 1; i < 4; ++i) {
    if (q == i) a = words[i], b = words[i + 1];
  }
  const uint64_t x = ((static_cast<uint64_t>(b) << 32) | a) >> (8 * q);
  lo = 0;
  hi = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    lo |= static_cast<uint32_t>((x >> (5 * j)) & 31u) << (8 * j);
    hi |= static_cast<uint32_t>((x >> (5 * (j + 4))) & 31u) << (8 * j);
  }
}

}  // namespace kbit
