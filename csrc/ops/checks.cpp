// Argument checks of the torch.ops.kbit ops (see checks.h), in the order and with the messages of
// vllm_kbit/reference.py. Plain C++ compiled by the host compiler; messages through check.h.
#include "checks.h"

#include <string>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "check.h"
#include "format_constants.h"

namespace kbit {
namespace {

void check_bits(int64_t k) {
  if (k >= kMinBits && k <= kMaxBits) return;
  std::string bits = "(";  // Python's tuple repr, as reference.SUPPORTED_BITS prints
  for (int b = kMinBits; b <= kMaxBits; ++b) bits += std::to_string(b) + (b < kMaxBits ? ", " : ")");
  KBIT_CHECK_VALUE(false, "kbit: k=", k, " is not supported; k must be one of ", bits);
}

bool is_float_dtype(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat; }

void check_float_dtype(const at::Tensor& t, const char* what) {
  KBIT_CHECK_TYPE(is_float_dtype(t.scalar_type()), "kbit: ", what, " has dtype ", t.scalar_type(),
                  "; supported: float16, bfloat16, float32");
}

void check_contiguous(const at::Tensor& t, const char* what) {
  KBIT_CHECK_VALUE(t.is_contiguous(), "kbit: ", what, " must be contiguous (call .contiguous() first)");
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

void check_out_dtype(at::ScalarType dtype) {
  KBIT_CHECK_TYPE(is_float_dtype(dtype), "kbit: output dtype ", dtype,
                  " is not supported; supported: float16, bfloat16, float32");
}

// qweight int32 [N, KB, k] and absmax uint8 [N, KB] (reference.repack's checks); returns k.
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

// A runtime-layout pair for a [N, K] weight (reference.check_runtime); returns k.
int64_t check_runtime(const at::Tensor& qweight_rt, const at::Tensor& absmax_rt, int64_t N, int64_t K) {
  KBIT_CHECK_VALUE(N > 0 && K > 0 && K % kBlockSize == 0, "kbit: weight shape [", N, ", ", K,
                   "] needs N > 0 and K a positive multiple of ", kBlockSize);
  KBIT_CHECK_TYPE(qweight_rt.scalar_type() == at::kInt && qweight_rt.dim() == 5,
                  "kbit: runtime qweight must be int32 [N/64, K/128, k, 64, 4], got ", qweight_rt.scalar_type(),
                  " of shape ", qweight_rt.sizes());
  const int64_t k = qweight_rt.size(2);
  check_bits(k);
  const int64_t KB = K / kBlockSize;
  const int64_t NT = (N + kTileN - 1) / kTileN, KT = (KB + kTileKB - 1) / kTileKB;
  const std::vector<int64_t> q_shape{NT, KT, k, kTileN, kTileKB}, a_shape{NT, KT, kTileN, kTileKB};
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
  KBIT_CHECK_VALUE(W.size(1) % kBlockSize == 0 && W.size(1) > 0, "kbit: weight K=", W.size(1), " (shape ", W.sizes(),
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

int64_t check_dequantize_runtime(const at::Tensor& qweight_rt, const at::Tensor& absmax_rt, const at::Tensor& codebook,
                                 int64_t N, int64_t K, at::ScalarType dtype) {
  const int64_t k = check_runtime(qweight_rt, absmax_rt, N, K);
  check_codebook(codebook, k);
  check_out_dtype(dtype);
  return k;
}

int64_t check_linear(const at::Tensor& x, const at::Tensor& qweight_rt, const at::Tensor& absmax_rt,
                     const at::Tensor& codebook, int64_t N, int64_t K, const std::optional<at::Tensor>& bias) {
  check_float_dtype(x, "x");
  KBIT_CHECK_VALUE(x.dim() >= 1, "kbit: x must be [..., K] with K=", K, ", got a 0-d tensor");
  KBIT_CHECK_VALUE(x.size(-1) == K, "kbit: x has ", x.size(-1), " features but the weight has K=", K);
  const int64_t k = check_dequantize_runtime(qweight_rt, absmax_rt, codebook, N, K, x.scalar_type());
  if (bias.has_value()) {
    KBIT_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == x.scalar_type(),
                     "kbit: bias must be [", N, "] of x's dtype ", x.scalar_type(), ", got ", bias->scalar_type(), " ",
                     bias->sizes());
  }
  return k;
}

namespace {

// The checks as ops (kbit::_check_<op>, any device), for the tests.
void check_quantize_op(const at::Tensor& W, const at::Tensor& codebook, int64_t k, bool) { check_quantize(W, codebook, k); }
void check_dequantize_op(const at::Tensor& q, const at::Tensor& a, const at::Tensor& cb, at::ScalarType dtype) {
  check_dequantize(q, a, cb, dtype);
}
void check_repack_op(const at::Tensor& q, const at::Tensor& a) { check_repack(q, a); }
void check_dequantize_runtime_op(const at::Tensor& q, const at::Tensor& a, const at::Tensor& cb, int64_t N, int64_t K,
                                 at::ScalarType dtype) {
  check_dequantize_runtime(q, a, cb, N, K, dtype);
}
void check_linear_op(const at::Tensor& x, const at::Tensor& q, const at::Tensor& a, const at::Tensor& cb, int64_t N,
                     int64_t K, const std::optional<at::Tensor>& bias) {
  check_linear(x, q, a, cb, N, K, bias);
}

}  // namespace
}  // namespace kbit

// Schemas: vllm_kbit/ops.py (each public op's, with `_check_` and no outputs). Any device.
TORCH_LIBRARY_IMPL(kbit, CompositeExplicitAutograd, m) {
  m.impl("_check_quantize", &kbit::check_quantize_op);
  m.impl("_check_dequantize", &kbit::check_dequantize_op);
  m.impl("_check_repack", &kbit::check_repack_op);
  m.impl("_check_dequantize_runtime", &kbit::check_dequantize_runtime_op);
  m.impl("_check_linear", &kbit::check_linear_op);
}
