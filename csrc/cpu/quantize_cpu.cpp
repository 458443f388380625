// kbit quantize on the CPU: the bits of vllm_kbit/reference.py quantize (scale search included), at
// compiled speed on every core. Built as its own extension, vllm_kbit._cpu, with the host compiler
// only, so a machine without nvcc or without a CUDA build of torch quantizes fast too.
//
// One task owns one 32-weight block at a time: it converts the block to fp32 once, then for every
// scale candidate decodes each element's nearest level with one compare-and-select pass per
// threshold (vectorized across the block) and sums the block's squared error in the reference's
// order; the indices are counted once, for the scale that wins. All fp32
// arithmetic is one rounding per operation (the file is compiled with -ffp-contract=off: no fused
// multiply-add), so the result equals the reference's bit for bit.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>

#include "check.h"
#include "checks.h"
#include "format_constants.h"

namespace kbit {
namespace {

constexpr int kCodes = 256;  // E4M4 scale codes

// All 256 E4M4 values (reference.e4m4_table): exact in fp32, 5 significant bits each.
struct E4M4Table {
  std::array<float, kCodes> value;
  std::array<float, kCodes - 1> midpoint;  // (v[c] + v[c+1]) / 2, the encode boundaries
  E4M4Table() {
    for (int c = 0; c < kCodes; ++c) {
      const int e = c >> 4, m = c & 15;
      value[c] = e > 0 ? std::ldexp(1.0f + m / 16.0f, e - kE4M4Bias) : std::ldexp(m / 16.0f, 1 - kE4M4Bias);
    }
    for (int c = 0; c + 1 < kCodes; ++c) midpoint[c] = (value[c] + value[c + 1]) * 0.5f;
  }
};
const E4M4Table& e4m4() {
  static const E4M4Table table;
  return table;
}

// Nearest code of a non-negative scale, ties to the lower code (reference.e4m4_encode: the number of
// midpoints strictly below x).
int e4m4_encode(float x) {
  const auto& mid = e4m4().midpoint;
  return static_cast<int>(std::lower_bound(mid.begin(), mid.end(), x) - mid.begin());
}

inline float to_float(float v) { return v; }
inline float to_float(c10::Half v) { return static_cast<float>(v); }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

// The decoded values of a block's 32 elements against scale sc, fp32(cb[idx] * sc) with
// idx = #{i : w > fp32(t_i * sc)} (reference.choose_indices). As the products are non-decreasing in i,
// selecting level i + 1 wherever w > p_i, for i in ascending order, leaves exactly level idx; each
// pass is one compare and one select over 32 lanes, which the compiler vectorizes.
template <int K>
inline void block_values(const float (&w)[kBlockSize], const float* thresholds, const float* cb, float sc,
                         float (&v)[kBlockSize]) {
  for (int j = 0; j < kBlockSize; ++j) v[j] = cb[0] * sc;
  for (int i = 0; i < (1 << K) - 1; ++i) {
    const float p = thresholds[i] * sc, level = cb[i + 1] * sc;
    for (int j = 0; j < kBlockSize; ++j) v[j] = w[j] > p ? level : v[j];
  }
}

// The indices themselves, #{i : w > fp32(t_i * sc)}: once per block, for the chosen scale.
template <int K>
inline void block_indices(const float (&w)[kBlockSize], const float* thresholds, float sc, uint8_t (&idx)[kBlockSize]) {
  for (int j = 0; j < kBlockSize; ++j) idx[j] = 0;
  for (int i = 0; i < (1 << K) - 1; ++i) {
    const float p = thresholds[i] * sc;
    for (int j = 0; j < kBlockSize; ++j) idx[j] += w[j] > p;
  }
}

// Sum of fp32 (w - v)^2 in reference.block_squared_error's order: per quarter of 8 elements
// j + 4, then j + 2, then j + 1; then quarters q + 2, then q + 1.
inline float block_error(const float (&w)[kBlockSize], const float (&v)[kBlockSize]) {
  float s[kBlockSize];
  for (int j = 0; j < kBlockSize; ++j) {
    const float e = w[j] - v[j];
    s[j] = e * e;
  }
  float q[4];
  for (int quarter = 0; quarter < 4; ++quarter) {
    float* t = s + 8 * quarter;
    for (int j = 0; j < 4; ++j) t[j] = t[j] + t[j + 4];
    q[quarter] = (t[0] + t[2]) + (t[1] + t[3]);
  }
  return (q[0] + q[2]) + (q[1] + q[3]);
}

// Bit-plane words of one block: bit j of word b is bit b of idx[j].
template <int K>
inline void pack_planes(const uint8_t (&idx)[kBlockSize], int32_t* words) {
  for (int b = 0; b < K; ++b) {
    uint32_t word = 0;
    for (int j = 0; j < kBlockSize; ++j) word |= static_cast<uint32_t>((idx[j] >> b) & 1) << j;
    words[b] = static_cast<int32_t>(word);
  }
}

template <typename T, int K>
void quantize_blocks(const T* W, const float* cb, bool search, int64_t n_blocks, int32_t* qweight, uint8_t* absmax) {
  float thresholds[(1 << K) - 1];
  for (int i = 0; i < (1 << K) - 1; ++i) thresholds[i] = (cb[i] + cb[i + 1]) * 0.5f;
  const auto& scale = e4m4().value;
  at::parallel_for(0, n_blocks, 256, [&](int64_t begin, int64_t end) {
    float w[kBlockSize], v[kBlockSize];
    uint8_t idx[kBlockSize];
    for (int64_t blk = begin; blk < end; ++blk) {
      float amax = 0.0f;
      for (int j = 0; j < kBlockSize; ++j) {
        w[j] = to_float(W[blk * kBlockSize + j]);
        amax = std::max(amax, std::fabs(w[j]));
      }
      const int absmax_code = e4m4_encode(amax);
      int best = absmax_code;
      if (search) {
        // The absmax code first, then each offset in order; only a strictly smaller error replaces it.
        block_values<K>(w, thresholds, cb, scale[absmax_code], v);
        float best_err = block_error(w, v);
        for (int offset = -kScaleSearchRadius; offset <= kScaleSearchRadius; ++offset) {
          if (offset == 0) continue;
          const int code = std::min(std::max(absmax_code + offset, 0), kCodes - 1);
          block_values<K>(w, thresholds, cb, scale[code], v);
          const float err = block_error(w, v);
          if (err < best_err) best_err = err, best = code;
        }
      }
      block_indices<K>(w, thresholds, scale[best], idx);
      pack_planes<K>(idx, qweight + blk * K);
      absmax[blk] = static_cast<uint8_t>(best);
    }
  });
}

template <typename T>
void quantize_dispatch_bits(const T* W, const float* cb, int64_t k, bool search, int64_t n, int32_t* q, uint8_t* a) {
  switch (k) {
    case 2: return quantize_blocks<T, 2>(W, cb, search, n, q, a);
    case 3: return quantize_blocks<T, 3>(W, cb, search, n, q, a);
    case 4: return quantize_blocks<T, 4>(W, cb, search, n, q, a);
    default: return quantize_blocks<T, 5>(W, cb, search, n, q, a);
  }
}

// kbit::_quantize_cpu: kbit::quantize's CPU kernel. vllm_kbit.ops checks W's values before calling it
// (reference.check_quantize); the argument checks here keep a direct call from reading out of bounds.
std::tuple<at::Tensor, at::Tensor> quantize_cpu(const at::Tensor& W, const at::Tensor& codebook, int64_t k,
                                                bool search_scale) {
  check_quantize(W, codebook, k);
  KBIT_CHECK_VALUE(W.is_cpu() && codebook.is_cpu(), "kbit: _quantize_cpu needs CPU tensors, got ", W.device(), " and ",
                   codebook.device());
  const auto dtype = W.scalar_type();
  const int64_t N = W.size(0), KB = W.size(1) / kBlockSize;
  at::Tensor qweight = at::empty({N, KB, k}, W.options().dtype(at::kInt));
  at::Tensor absmax = at::empty({N, KB}, W.options().dtype(at::kByte));
  const float* cb = codebook.data_ptr<float>();
  int32_t* q = qweight.data_ptr<int32_t>();
  uint8_t* a = absmax.data_ptr<uint8_t>();
  if (dtype == at::kFloat) {
    quantize_dispatch_bits(W.data_ptr<float>(), cb, k, search_scale, N * KB, q, a);
  } else if (dtype == at::kHalf) {
    quantize_dispatch_bits(W.data_ptr<c10::Half>(), cb, k, search_scale, N * KB, q, a);
  } else {
    quantize_dispatch_bits(W.data_ptr<c10::BFloat16>(), cb, k, search_scale, N * KB, q, a);
  }
  return {qweight, absmax};
}

}  // namespace

TORCH_LIBRARY_IMPL(kbit, CPU, m) { m.impl("_quantize_cpu", &quantize_cpu); }

}  // namespace kbit
