// Argument checks of the torch.ops.kbit ops (see checks.h): the one statement of each rule and message.
// Plain C++ compiled by the host compiler into both extensions; messages through check.h.
#include "checks.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <ATen/ATen.h>

#include "check.h"
#include "format_constants.h"

namespace kbit {
namespace {

// Python's repr of a number that is not an int (the k a Python caller passed): 4.0, 2.5, True.
std::string python_repr(const c10::Scalar& v) {
  if (v.isBoolean()) return v.toBool() ? "True" : "False";
  if (v.isIntegral(false)) return std::to_string(v.toLong());
  const double d = v.toDouble();
  char text[32];
  if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 1e16) {
    std::snprintf(text, sizeof(text), "%.1f", d);
    return text;
  }
  for (int digits = 1; digits <= 17; ++digits) {  // the shortest text that reads back as d
    std::snprintf(text, sizeof(text), "%.*g", digits, d);
    if (std::strtod(text, nullptr) == d) break;
  }
  return std::isnan(d) ? "nan" : std::isinf(d) ? (d > 0 ? "inf" : "-inf") : text;
}

bool is_float_dtype(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat; }

void check_float_dtype(const at::Tensor& t, const char* what) {
  KBIT_CHECK_TYPE(is_float_dtype(t.scalar_type()), "kbit: ", what, " has dtype ", t.scalar_type(),
                  "; supported: float16, bfloat16, float32");
}

void check_out_dtype(at::ScalarType dtype) {
  KBIT_CHECK_TYPE(is_float_dtype(dtype), "kbit: output dtype ", dtype,
                  " is not supported; supported: float16, bfloat16, float32");
}

// qweight int32 [N, KB, k] and absmax uint8 [N, KB]; returns k.
int64_t check_flat(const at::Tensor& qweight, const at::Tensor& absmax) {
  KBIT_CHECK_TYPE(qweight.scalar_type() == at::kInt && qweight.dim() == 3, "kbit: qweight must be int32 [N, K/32, k], got ",
                  qweight.scalar_type(), " of shape ", qweight.sizes());
  const int64_t k = qweight.size(2);
  check_bits(k);
  KBIT_CHECK_VALUE(absmax.scalar_type() == at::kByte && absmax.sizes() == qweight.sizes().slice(0, 2),
                   "kbit: absmax must be uint8 ", qweight.sizes().slice(0, 2), " to match qweight ", qweight.sizes(),
                   ", got ", absmax.scalar_type(), " ", absmax.sizes());
  return k;
}

// The runtime-layout shapes of a [N, K] weight at k bits (reference.runtime_shapes).
std::vector<int64_t> runtime_qweight_shape(int64_t N, int64_t K, int64_t k) {
  return {(N + kTileN - 1) / kTileN, (K / kBlockSize + kTileKB - 1) / kTileKB, k, kTileN, kTileKB};
}
std::vector<int64_t> runtime_absmax_shape(int64_t N, int64_t K) {
  return {(N + kTileN - 1) / kTileN, (K / kBlockSize + kTileKB - 1) / kTileKB, kTileN, kTileKB};
}

// A runtime-layout pair for a [N, K] weight; returns k.
int64_t check_runtime(const at::Tensor& qweight_rt, const at::Tensor& absmax_rt, int64_t N, int64_t K) {
  check_weight_shape(N, K);
  KBIT_CHECK_TYPE(qweight_rt.scalar_type() == at::kInt && qweight_rt.dim() == 5, "kbit: runtime qweight must be int32 [N/",
                  kTileN, ", K/", kBlockSize * kTileKB, ", k, ", kTileN, ", ", kTileKB, "], got ",
                  qweight_rt.scalar_type(), " of shape ", qweight_rt.sizes());
  const int64_t k = qweight_rt.size(2);
  check_bits(k);
  const std::vector<int64_t> q_shape = runtime_qweight_shape(N, K, k), a_shape = runtime_absmax_shape(N, K);
  KBIT_CHECK_VALUE(qweight_rt.sizes() == at::IntArrayRef(q_shape) && absmax_rt.scalar_type() == at::kByte &&
                       absmax_rt.sizes() == at::IntArrayRef(a_shape),
                   "kbit: runtime tensors for [", N, ", ", K, "] must be int32 ", q_shape, " and uint8 ", a_shape,
                   ", got ", qweight_rt.scalar_type(), " ", qweight_rt.sizes(), " and ", absmax_rt.scalar_type(), " ",
                   absmax_rt.sizes());
  check_contiguous(qweight_rt, "runtime qweight");
  check_contiguous(absmax_rt, "runtime absmax");
  return k;
}

}  // namespace

void check_bits(const c10::Scalar& k) {
  if (k.isIntegral(false) && k.toLong() >= kMinBits && k.toLong() <= kMaxBits) return;
  std::string bits = "(";  // Python's tuple repr, as reference.SUPPORTED_BITS prints
  for (int b = kMinBits; b <= kMaxBits; ++b) bits += std::to_string(b) + (b < kMaxBits ? ", " : ")");
  KBIT_CHECK_VALUE(false, "kbit: k=", python_repr(k), " is not supported; k must be one of ", bits);
}

void check_codebook(const at::Tensor& codebook, int64_t k) {
  check_bits(k);
  KBIT_CHECK_TYPE(codebook.scalar_type() == at::kFloat && codebook.dim() == 1,
                  "kbit: codebook must be a 1-D float32 tensor, got ", codebook.scalar_type(), " of shape ",
                  codebook.sizes());
  KBIT_CHECK_VALUE(codebook.numel() == (int64_t{1} << k), "kbit: codebook has ", codebook.numel(), " entries but k=", k,
                   " needs ", int64_t{1} << k);
  check_contiguous(codebook, "codebook");
}

void check_contiguous(const at::Tensor& t, const char* what) {
  KBIT_CHECK_VALUE(t.is_contiguous(), "kbit: ", what, " must be contiguous (call .contiguous() first)");
}

void check_weight_shape(int64_t N, int64_t K) {
  KBIT_CHECK_VALUE(N > 0 && whole_blocks(K), "kbit: weight shape [", N, ", ", K,
                   "] needs N > 0 and K a positive multiple of ", kBlockSize);
}

int64_t check_stacked_bits(const at::Tensor& qweight, const char* op, const char* prefix) {
  KBIT_CHECK_VALUE(qweight.dim() == 6 && qweight.size(0) >= 1, "kbit: ", op, " ", prefix,
                   "qweight must be stacked runtime tensors [E, ...], got ", qweight.sizes());
  const int64_t k = qweight.size(3);
  check_bits(k);
  return k;
}

void check_stacked(const at::Tensor& qweight, const at::Tensor& absmax, int64_t E, int64_t N, int64_t K, int64_t k,
                   const char* op, const char* prefix, const std::string& note) {
  std::vector<int64_t> q_shape = runtime_qweight_shape(N, K, k), a_shape = runtime_absmax_shape(N, K);
  q_shape.insert(q_shape.begin(), E);
  a_shape.insert(a_shape.begin(), E);
  KBIT_CHECK_VALUE(qweight.scalar_type() == at::kInt && qweight.sizes() == at::IntArrayRef(q_shape) &&
                       absmax.scalar_type() == at::kByte && absmax.sizes() == at::IntArrayRef(a_shape),
                   "kbit: ", op, " ", prefix, "qweight/", prefix, "absmax for ", E, " experts of [", N, ", ", K, "] (",
                   note, "k=", k, ") must be int32 ", q_shape, " and uint8 ", a_shape, ", got ", qweight.scalar_type(),
                   " ", qweight.sizes(), " and ", absmax.scalar_type(), " ", absmax.sizes());
}

void check_cuda(const at::Tensor& t, const char* what) {
  KBIT_CHECK_VALUE(t.is_cuda(), "kbit: ", what, " is on ", t.device(), "; the CUDA kernels need CUDA tensors");
}

void check_device(const at::Tensor& t, const at::Tensor& ref, const char* what, const char* ref_what) {
  KBIT_CHECK_VALUE(t.device() == ref.device(), "kbit: ", what, " is on ", t.device(), " but ", ref_what, " is on ",
                   ref.device());
}

void check_block_count(int64_t n_blocks) {
  KBIT_CHECK_VALUE(n_blocks <= INT32_MAX, "kbit: ", n_blocks, " blocks of 32 is more than the kernels index (2^31 - 1)");
}

int64_t check_quantize(const at::Tensor& W, const at::Tensor& codebook, int64_t k) {
  check_float_dtype(W, "weight");
  KBIT_CHECK_VALUE(W.dim() == 2, "kbit: weight must be 2-D [N, K], got shape ", W.sizes());
  KBIT_CHECK_VALUE(whole_blocks(W.size(1)), "kbit: weight K=", W.size(1), " (shape ", W.sizes(),
                   ") is not a positive multiple of ", kBlockSize);
  check_contiguous(W, "weight");
  check_codebook(codebook, k);
  return k;
}

int64_t check_dequantize(const at::Tensor& qweight, const at::Tensor& absmax, const at::Tensor& codebook,
                         at::ScalarType dtype) {
  const int64_t k = check_flat(qweight, absmax);
  check_codebook(codebook, k);
  check_contiguous(qweight, "qweight");
  check_contiguous(absmax, "absmax");
  check_out_dtype(dtype);
  return k;
}

int64_t check_repack(const at::Tensor& qweight, const at::Tensor& absmax) {
  const int64_t k = check_flat(qweight, absmax);
  check_contiguous(qweight, "qweight");
  check_contiguous(absmax, "absmax");
  return k;
}

int64_t check_unrepack(const at::Tensor& qweight_rt, const at::Tensor& absmax_rt, int64_t N, int64_t K) {
  return check_runtime(qweight_rt, absmax_rt, N, K);
}

int64_t check_dequantize_runtime(const at::Tensor& qweight_rt, const at::Tensor& absmax_rt, const at::Tensor& codebook,
                                 int64_t N, int64_t K, at::ScalarType dtype) {
  const int64_t k = check_runtime(qweight_rt, absmax_rt, N, K);
  check_codebook(codebook, k);
  check_out_dtype(dtype);
  return k;
}

bool check_rotation(const std::optional<at::Tensor>& signs, int64_t block, int64_t K, const c10::Device& device,
                    const char* op, const char* what) {
  if (!signs.has_value()) {
    KBIT_CHECK_VALUE(block == 0, "kbit: ", op, " got ", what, "block=", block, " without ", what,
                     "signs; give both (float32 [", K, "] signs and the block) or neither (no rotation)");
    return false;
  }
  const at::Tensor& s = *signs;
  KBIT_CHECK_TYPE(s.scalar_type() == at::kFloat, "kbit: ", op, " ", what, "signs have dtype ", s.scalar_type(),
                  "; expected float32 (+-1 values)");
  KBIT_CHECK_VALUE(s.dim() == 1 && s.size(0) == K && s.is_contiguous(), "kbit: ", op, " ", what, "signs have shape ",
                   s.sizes(), "; expected a contiguous [", K, "] (one sign per input)");
  KBIT_CHECK_VALUE(s.device() == device, "kbit: ", op, " ", what, "signs are on ", s.device(), ", x on ", device,
                   "; expected one device");
  KBIT_CHECK_VALUE(block >= kRotationMinBlock && block <= kRotationMaxBlock && (block & (block - 1)) == 0 &&
                       K % block == 0,
                   "kbit: ", op, " ", what, "block=", block, " is not supported for ", K, " inputs; supported: a power ",
                   "of two ", kRotationMinBlock, "..", kRotationMaxBlock, " dividing ", K);
  return true;
}

int64_t check_linear(const at::Tensor& x, const at::Tensor& qweight_rt, const at::Tensor& absmax_rt,
                     const at::Tensor& codebook, int64_t N, int64_t K, const std::optional<at::Tensor>& bias,
                     const std::optional<at::Tensor>& rot_signs, int64_t rot_block) {
  check_float_dtype(x, "x");
  KBIT_CHECK_VALUE(x.dim() >= 1, "kbit: x must be [..., K] with K=", K, ", got a 0-d tensor");
  KBIT_CHECK_VALUE(x.size(-1) == K, "kbit: x has ", x.size(-1), " features but the weight has K=", K);
  const int64_t k = check_dequantize_runtime(qweight_rt, absmax_rt, codebook, N, K, x.scalar_type());
  if (bias.has_value()) {
    KBIT_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == x.scalar_type(),
                     "kbit: bias must be [", N, "] of x's dtype ", x.scalar_type(), ", got ", bias->scalar_type(), " ",
                     bias->sizes());
  }
  check_rotation(rot_signs, rot_block, K, x.device(), "linear", "rot_");
  return k;
}

// Stacked runtime weights of E experts: w13 [E, *runtime shape of (2I, H)], w2 [E, *runtime shape of (H, I)].
int64_t check_fused_moe(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                        const at::Tensor& w13_qweight, const at::Tensor& w13_absmax, const at::Tensor& w2_qweight,
                        const at::Tensor& w2_absmax, const at::Tensor& codebook, int64_t I,
                        const std::optional<at::Tensor>& expert_map, const std::optional<at::Tensor>& w13_rot_signs,
                        int64_t w13_rot_block, const std::optional<at::Tensor>& w2_rot_signs, int64_t w2_rot_block) {
  check_float_dtype(x, "x");
  KBIT_CHECK_VALUE(x.dim() == 2 && topk_ids.dim() == 2 && topk_ids.sizes() == topk_weights.sizes() &&
                       topk_ids.size(0) == x.size(0),
                   "kbit: fused_moe needs x [T, H] and topk_ids/topk_weights [T, top_k], got ", x.sizes(), ", ",
                   topk_ids.sizes(), " and ", topk_weights.sizes());
  KBIT_CHECK_TYPE(!at::isFloatingType(topk_ids.scalar_type()) && topk_ids.scalar_type() != at::kBool,
                  "kbit: fused_moe topk_ids must be an integer tensor, got ", topk_ids.scalar_type());
  KBIT_CHECK_TYPE(at::isFloatingType(topk_weights.scalar_type()), "kbit: fused_moe topk_weights must be a float tensor, got ",
                  topk_weights.scalar_type());
  const int64_t H = x.size(1);
  KBIT_CHECK_VALUE(whole_blocks(H) && whole_blocks(I), "kbit: fused_moe hidden size ", H,
                   " and intermediate size ", I, " must be positive multiples of ", kBlockSize);
  const int64_t E = w13_qweight.size(0), k = check_stacked_bits(w13_qweight, "fused_moe", "w13_");
  const std::string note = msg::build("intermediate size ", I, ", ");
  check_stacked(w13_qweight, w13_absmax, E, 2 * I, H, k, "fused_moe", "w13_", note);
  check_stacked(w2_qweight, w2_absmax, E, H, I, k, "fused_moe", "w2_", note);
  KBIT_CHECK_VALUE(codebook.scalar_type() == at::kFloat && codebook.dim() == 1 && codebook.numel() == (int64_t{1} << k),
                   "kbit: fused_moe codebook must be float32 [", int64_t{1} << k, "], got ", codebook.scalar_type(), " ",
                   codebook.sizes());
  if (expert_map.has_value()) {
    KBIT_CHECK_VALUE(expert_map->dim() == 1 && !at::isFloatingType(expert_map->scalar_type()),
                     "kbit: fused_moe expert_map must be a 1-D integer tensor, got ", expert_map->scalar_type(), " ",
                     expert_map->sizes());
  }
  for (const at::Tensor* t : {&topk_ids, &topk_weights, &w13_qweight, &w13_absmax, &w2_qweight, &w2_absmax, &codebook}) {
    KBIT_CHECK_VALUE(t->device() == x.device(), "kbit: fused_moe needs every tensor on x's device ", x.device());
  }
  KBIT_CHECK_VALUE(!expert_map.has_value() || expert_map->device() == x.device(),
                   "kbit: fused_moe needs every tensor on x's device ", x.device());
  check_rotation(w13_rot_signs, w13_rot_block, H, x.device(), "fused_moe", "w13_rot_");
  check_rotation(w2_rot_signs, w2_rot_block, I, x.device(), "fused_moe", "w2_rot_");
  return k;
}

void check_weight_amax(double amax, bool bounded) {
  KBIT_CHECK_VALUE(std::isfinite(amax), "kbit: weight has NaN or Inf values; cannot quantize");
  // Up to kRangeMax64 / 64: the largest scale (code 255) and the 1/64 above it that still rounds to it.
  if (!bounded || amax <= kRangeMax64 / 64.0) return;
  char amax_text[32], max_text[32];
  std::snprintf(amax_text, sizeof(amax_text), "%.4g", amax);
  std::snprintf(max_text, sizeof(max_text), "%.1f", static_cast<double>(kE4M4Max));
  KBIT_CHECK_VALUE(false, "kbit: weight has |w| = ", std::string(amax_text), ", above the largest E4M4 block scale ",
                   std::string(max_text), "; leave this module unquantized (modules_to_not_convert)");
}

void check_representable(const at::Tensor& W) {
  if (W.numel() == 0) return;
  // min and max rather than abs().amax(): no temporary the size of W (a whole MoE layer's experts at load).
  const auto [lo, hi] = at::aminmax(W);
  check_weight_amax(at::maximum(hi, -lo).item<double>(), true);
}

}  // namespace kbit
