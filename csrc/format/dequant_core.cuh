// Dequantization steps shared by the kernels that read the runtime layout (gemv.cu, mma_*.cuh,
// wgmma*.cu): E4M4 scale decode, the bit-matrix transpose of a block's plane words into index
// words, the codebook lookup by register shuffle, the 16-bit pairs the tensor-core kernels build
// their weight fragments from, and (k = 2..4) the shared-memory lookup table of 16-bit pairs and
// quads the MMA kernel decodes with.
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

// Index words of one block as a kernel holds them (q arrays): k = 2..4 four (k = 2 uses two, k = 3 unfolds a
// fourth), k = 5 its five stream words.
template <int BITS>
struct Fields {
  static constexpr int kWords = BITS <= 4 ? 4 : 5;
};

// Index words of one block from its runtime words, for lookup(): the runtime words as they are, and for k = 3 the
// fourth unfolded from their bits 3 and 7 (kbit_format.cuh: fold3), which lookup() may leave in place (see there).
template <int BITS>
__device__ __forceinline__ void gather_indices(const uint32_t (&plane)[BITS], uint32_t (&q)[Fields<BITS>::kWords]) {
  constexpr int F = Fields<BITS>::kWords;
#pragma unroll
  for (int r = 0; r < F; ++r) q[r] = r < BITS ? plane[r] : 0u;
  if constexpr (BITS == 3) q[3] = unfold3(plane[0], plane[1], plane[2]);
}

// Codebook value of element e of a block. The shuffle reads the source lane mod 32, so only
// the low 5 bits of the shifted word matter: they are e's index plus bits above it (the next
// field's, or k = 3's folded bit 3 of a byte), which the codebook register's replication
// (lane L holds codebook[L mod 2^k]) makes harmless.
// e is an unrolled loop counter, so the word and the shift are compile-time after unrolling.
template <int BITS>
__device__ __forceinline__ float lookup(float codebook_reg, const uint32_t (&q)[Fields<BITS>::kWords], int e) {
  if constexpr (BITS == 5) {
    return __shfl_sync(0xFFFFFFFFu, codebook_reg, static_cast<int>(stream5_bits(q, 5 * e)));
  } else {
    return __shfl_sync(0xFFFFFFFFu, codebook_reg, static_cast<int>(q[runtime_word_of<BITS>(e)] >> runtime_shift_of<BITS>(e)));
  }
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

// ----------------------------------------------------------------------------- lookup-table decode
// For k <= 4 the tensor-core kernels decode from a table in shared memory instead of one register
// shuffle, one conversion and one multiply per weight: an 8-bit index selects a ready 16-bit pair
// (k = 3, 4: two weights per 32-bit load) or quad (k = 2: four weights per 64-bit load) of codebook
// values in the activation type, so a weight costs a fraction of an extraction, a load and a
// multiply by the block scale. Every entry is stored once per lane (k = 2: per half-warp lane, since a
// 64-bit load is served a half-warp at a time) in that lane's own bank, so a warp's 32 random
// indices never conflict: an entry is a 128-byte row of replicas. A kernel addresses the table from the
// start of its dynamic shared memory, so each load takes its base as a uniform register ([R + UR]) and
// costs no add.

// The table's k for a kernel instance built at BITS whose k = 5 decodes by shuffle (the kernels of several CTAs per
// SM, where k = 5's 128 KB table does not fit): its instances name a k = 4 table they never read.
template <int BITS>
constexpr int kLutBits = BITS < 2 ? 2 : (BITS > 4 ? 4 : BITS);

template <int BITS, bool kWide = false>
struct Lut {
  static_assert(BITS >= 2 && BITS <= 5, "lookup-table decode is for k = 2..5");
  static constexpr bool kQuad = BITS == 2;
  // index words per block: 8-bit indices, 4 per word (k = 2..4), or k = 5's five stream words of 10-bit pairs
  static constexpr int kWords = kQuad ? 2 : BITS == 5 ? 5 : 4;
  // k = 3 indices have bits 3 and 7 clear, so one PRMT turns a byte into the row offset when rows
  // are 256 bytes apart (the spare 128 bytes of each row unused); 8-bit indices of k = 2, 4 would
  // double the table that way (64 KB), so their offset is a shift and a mask instead, unless the
  // kernel has the shared memory to spare (kWide: the PRMT at k <= 4). k = 5: 1024 rows of 128 bytes
  // (128 KB), a pair's 10-bit field shifted into place and masked.
  static constexpr int kRowShift = BITS == 5 ? 7 : BITS == 3 || kWide ? 8 : 7;
  static constexpr int kMaxIndex = BITS == 5 ? 0x3FF : BITS == 3 ? 0x77 : 0xFF;
  static constexpr int kBytes = (kMaxIndex + 1) << kRowShift;
  static constexpr int kRowBytes = 128;  // replicas of one entry: 32 x 4 bytes or 16 x 8 bytes
  static constexpr int kPairShift = BITS == 5 ? 5 : 4;  // an index pair's second index (k = 3, 4, 5)
};

// Lane's byte offset inside a table row: its own bank (pairs) or bank pair (quads).
template <int BITS>
__device__ __forceinline__ uint32_t lut_lane_offset(int lane) {
  return Lut<BITS>::kQuad ? static_cast<uint32_t>(lane & 15) * 8u : static_cast<uint32_t>(lane) * 4u;
}

// Fills the table from the fp32 codebook, entries in T rounded to nearest (the same values the
// pack + scale2 path produces). Threads tid = 0..nthreads-1 of the CTA each fill whole rows; the
// 16-byte stores of a row rotate with the lane so that 8 lanes of a store hit 8 different bank groups.
template <typename T, int BITS, bool kWide = false>
__device__ __forceinline__ void lut_fill(uint8_t* lut, const float* __restrict__ codebook, int tid, int nthreads) {
  using L = Lut<BITS, kWide>;
  const auto pack = [](float lo, float hi) { return Half2<T>::pack(lo, hi); };
  constexpr int mask = (1 << BITS) - 1;
  const int lane = tid % 32;
  for (int v = tid; v <= L::kMaxIndex; v += nthreads) {
    uint4 row;
    if constexpr (L::kQuad) {
      row.x = pack(__ldg(codebook + (v & 3)), __ldg(codebook + ((v >> 2) & 3)));
      row.y = pack(__ldg(codebook + ((v >> 4) & 3)), __ldg(codebook + (v >> 6)));
      row.z = row.x;
      row.w = row.y;
    } else {
      row.x = pack(__ldg(codebook + (v & mask)), __ldg(codebook + ((v >> L::kPairShift) & mask)));
      row.y = row.z = row.w = row.x;
    }
    uint8_t* dst = lut + (v << L::kRowShift);
#pragma unroll
    for (int i = 0; i < L::kRowBytes / 16; ++i) *reinterpret_cast<uint4*>(dst + 16 * ((i + lane) & 7)) = row;
  }
}

// Table index words of one block from its runtime words (kbit_format.cuh: planes_to_runtime_words):
// byte n of word W holds the pair (e, e + 1), e = 8n + 2 (W >> 1) + 4 (W & 1) (k = 3, 4), or elements
// 8n + 4W .. +3 (k = 2). k = 3 unfolds its fourth word from bits 3 and 7 of the other three and clears
// those bits (9 ALU operations per block), so one PRMT turns any byte into a table offset.
// Either way the two pairs one MMA step needs per row, (e, e + 1) and (e + 2, e + 3) with
// e = 8n + 4 jj, come from words jj and jj + 2 (pairs) or from one entry (quads). k = 5: its five stream
// words as they are (lut5_pair_offset).
template <int BITS>
__device__ __forceinline__ void lut_indices(const uint32_t (&words)[BITS], uint32_t (&q)[Lut<BITS>::kWords]) {
  if constexpr (BITS == 3) {
    q[3] = unfold3(words[0], words[1], words[2]);
#pragma unroll
    for (int r = 0; r < 3; ++r) q[r] = clear_fold3(words[r]);
  } else {
#pragma unroll
    for (int r = 0; r < BITS; ++r) q[r] = words[r];
  }
}

// Table offset of byte n of an index word for this lane (lane_off from lut_lane_offset).
template <int BITS, bool kWide = false>
__device__ __forceinline__ uint32_t lut_offset(uint32_t word, int n, uint32_t lane_off) {
  if constexpr (Lut<BITS, kWide>::kRowShift == 8) {
    // byte 0 <- lane_off, byte 1 <- byte n of word, bytes 2, 3 <- zero bytes of lane_off
    return __byte_perm(word, lane_off, 0x5504u | (static_cast<uint32_t>(n) << 4));
  } else {
    const uint32_t v = n == 0 ? word << 7 : word >> (8 * n - 7);
    uint32_t off;  // (v & 0x7F80) | lane_off in one LOP3 (the compiler splits it in two)
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(off) : "r"(v), "n"(0x7F80), "r"(lane_off));
    return off;
  }
}

// k = 5: table offset of the pair (2j, 2j + 1), the 10-bit field at bit 10j of the block's stream, for this lane:
// the field shifted to bit 7 (a funnel shift where it crosses a word), masked, the lane's bank or'ed in.
__device__ __forceinline__ uint32_t lut5_pair_offset(const uint32_t (&q)[5], int j, uint32_t lane_off) {
  const int bit = 10 * j, i = stream5_word(bit), s = stream5_shift(bit);
  uint32_t v;
  if (s + 10 <= 32) {
    v = s >= 7 ? q[i] >> (s - 7) : q[i] << (7 - s);
  } else {
    v = __funnelshift_r(q[i], q[i + 1], s - 7);
  }
  uint32_t off;  // (v & 0x1FF80) | lane_off in one LOP3
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(off) : "r"(v), "n"(0x1FF80), "r"(lane_off));
  return off;
}

// Elements 8n .. 8n + 7 of one block from the table as four pairs (8n, +1), (8n + 2, +3), (8n + 4, +5),
// (8n + 6, +7), each times the block's scale (in both halves of T): byte n of index words 0, 2, 1, 3 (pairs)
// or of words 0, 1 (quads), as lut_indices lays them out, or k = 5's stream pairs 4n .. 4n + 3. The wgmma kernels
// build A fragments (registers or shared memory) from these.
template <typename T, int BITS, bool kWide = false>
__device__ __forceinline__ void lut_scaled_pairs(const uint8_t* lut, const uint32_t (&q)[Lut<BITS>::kWords], int n,
                                                 uint32_t lane_off, uint32_t scale, uint32_t (&out)[4]) {
  const auto at = [&](uint32_t word) { return lut + lut_offset<BITS, kWide>(word, n, lane_off); };
  uint32_t v[4];
  if constexpr (BITS == 5) {
#pragma unroll
    for (int m = 0; m < 4; ++m) v[m] = *reinterpret_cast<const uint32_t*>(lut + lut5_pair_offset(q, 4 * n + m, lane_off));
  } else if constexpr (Lut<BITS>::kQuad) {
    const uint2 lo = *reinterpret_cast<const uint2*>(at(q[0]));
    const uint2 hi = *reinterpret_cast<const uint2*>(at(q[1]));
    v[0] = lo.x, v[1] = lo.y, v[2] = hi.x, v[3] = hi.y;
  } else {
    v[0] = *reinterpret_cast<const uint32_t*>(at(q[0]));
    v[1] = *reinterpret_cast<const uint32_t*>(at(q[2]));
    v[2] = *reinterpret_cast<const uint32_t*>(at(q[1]));
    v[3] = *reinterpret_cast<const uint32_t*>(at(q[3]));
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) out[i] = Half2<T>::scale2(v[i], scale);
}

}  // namespace kbit
