// The argument checks (csrc/ops/checks.cpp) as ops, kbit::_check_<rule>, on any device: the PyTorch
// reference asks them (vllm_kbit/reference.py, check), so each rule and message lives once. Registered
// by the CPU extension only: the CUDA extension compiles checks.cpp for its own ops and registers none.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "checks.h"

namespace kbit {
namespace {

void bits_op(const c10::Scalar& k) { check_bits(k); }
void codebook_op(const at::Tensor& codebook, int64_t k) { check_codebook(codebook, k); }
void weight_amax_op(double amax, bool bounded) { check_weight_amax(amax, bounded); }
void representable_op(const at::Tensor& W) { check_representable(W); }
void quantize_op(const at::Tensor& W, const at::Tensor& codebook, int64_t k, bool) { check_quantize(W, codebook, k); }
void dequantize_op(const at::Tensor& q, const at::Tensor& a, const at::Tensor& cb, at::ScalarType dtype) {
  check_dequantize(q, a, cb, dtype);
}
void repack_op(const at::Tensor& q, const at::Tensor& a) { check_repack(q, a); }
void unrepack_op(const at::Tensor& q, const at::Tensor& a, int64_t N, int64_t K) { check_unrepack(q, a, N, K); }
void dequantize_runtime_op(const at::Tensor& q, const at::Tensor& a, const at::Tensor& cb, int64_t N, int64_t K,
                           at::ScalarType dtype) {
  check_dequantize_runtime(q, a, cb, N, K, dtype);
}
void linear_op(const at::Tensor& x, const at::Tensor& q, const at::Tensor& a, const at::Tensor& cb, int64_t N, int64_t K,
               const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& rot_signs, int64_t rot_block) {
  check_linear(x, q, a, cb, N, K, bias, rot_signs, rot_block);
}
void fused_moe_op(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights, const at::Tensor& w13_q,
                  const at::Tensor& w13_a, const at::Tensor& w2_q, const at::Tensor& w2_a, const at::Tensor& cb, int64_t I,
                  const std::optional<at::Tensor>& expert_map, bool, const std::optional<at::Tensor>& w13_rot_signs,
                  int64_t w13_rot_block, const std::optional<at::Tensor>& w2_rot_signs, int64_t w2_rot_block) {
  check_fused_moe(x, ids, weights, w13_q, w13_a, w2_q, w2_a, cb, I, expert_map, w13_rot_signs, w13_rot_block,
                  w2_rot_signs, w2_rot_block);
}

}  // namespace
}  // namespace kbit

// Schemas: vllm_kbit/ops.py (_VARIANTS).
TORCH_LIBRARY_IMPL(kbit, CompositeExplicitAutograd, m) {
  m.impl("_check_bits", &kbit::bits_op);
  m.impl("_check_codebook", &kbit::codebook_op);
  m.impl("_check_weight_amax", &kbit::weight_amax_op);
  m.impl("_check_representable", &kbit::representable_op);
  m.impl("_check_quantize", &kbit::quantize_op);
  m.impl("_check_dequantize", &kbit::dequantize_op);
  m.impl("_check_repack", &kbit::repack_op);
  m.impl("_check_unrepack", &kbit::unrepack_op);
  m.impl("_check_dequantize_runtime", &kbit::dequantize_runtime_op);
  m.impl("_check_linear", &kbit::linear_op);
  m.impl("_check_fused_moe", &kbit::fused_moe_op);
}
