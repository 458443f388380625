// CUDA implementations of the torch.ops.kbit ops whose schemas vllm_kbit/ops.py defines.
// Each op checks its inputs like vllm_kbit/reference.py (same exception types: TypeError for
// dtypes, ValueError for values and shapes), allocates its outputs and calls a launcher.
// Plain C++ with no CUDA headers (c10::DeviceGuard selects the tensors' GPU).
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <tuple>

#include "kbit_ops.h"

namespace kbit {
namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kTileN = 64;
constexpr int64_t kTileKB = 4;

bool is_float_dtype(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat; }

void check_bits(int64_t k) {
  TORCH_CHECK_VALUE(k >= 2 && k <= 5, "kbit: k=", k, " is not supported; k must be one of (2, 3, 4, 5)");
}

void check_contiguous(const at::Tensor& t, const char* what) {
  TORCH_CHECK_VALUE(t.is_contiguous(), "kbit: ", what, " must be contiguous (call .contiguous() first)");
}

void check_device(const at::Tensor& t, const at::Tensor& ref, const char* what, const char* ref_what) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), "kbit: ", what, " is on ", t.device(), " but ", ref_what, " is on ",
                    ref.device());
}

void check_codebook(const at::Tensor& codebook, int64_t k, const at::Tensor& ref, const char* ref_what) {
  check_bits(k);
  TORCH_CHECK_TYPE(codebook.scalar_type() == at::kFloat && codebook.dim() == 1,
                   "kbit: codebook must be a 1-D float32 tensor, got ", codebook.scalar_type(), " of shape ",
                   codebook.sizes());
  TORCH_CHECK_VALUE(codebook.numel() == (int64_t{1} << k), "kbit: codebook has ", codebook.numel(),
                    " entries but k=", k, " needs ", int64_t{1} << k);
  check_contiguous(codebook, "codebook");
  check_device(codebook, ref, "codebook", ref_what);
}

void check_out_dtype(at::ScalarType dtype) {
  TORCH_CHECK_TYPE(is_float_dtype(dtype), "kbit: output dtype ", dtype,
                   " is not supported; supported: float16, bfloat16, float32");
}

// The kernels index blocks with 32-bit integers.
void check_block_count(int64_t n_blocks) {
  TORCH_CHECK_VALUE(n_blocks <= INT32_MAX, "kbit: ", n_blocks, " blocks of 32 is more than the kernels index (2^31 - 1)");
}

// Checks a flat (qweight, absmax) pair like format.check_packed / the start of format.repack; returns k.
int64_t check_flat(const at::Tensor& qweight, const at::Tensor& absmax) {
  TORCH_CHECK_TYPE(qweight.scalar_type() == at::kInt && qweight.dim() == 3,
                   "kbit: qweight must be int32 [N, K/32, k], got ", qweight.scalar_type(), " of shape ",
                   qweight.sizes());
  const int64_t k = qweight.size(2);
  check_bits(k);
  TORCH_CHECK_VALUE(absmax.scalar_type() == at::kByte && absmax.sizes() == qweight.sizes().slice(0, 2),
                    "kbit: absmax must be uint8 ", qweight.sizes().slice(0, 2), " to match qweight ", qweight.sizes(),
                    ", got ", absmax.scalar_type(), " ", absmax.sizes());
  check_contiguous(qweight, "qweight");
  check_contiguous(absmax, "absmax");
  TORCH_CHECK_VALUE(qweight.is_cuda(), "kbit: qweight is on ", qweight.device(), "; the CUDA kernels need CUDA tensors");
  check_device(absmax, qweight, "absmax", "qweight");
  check_block_count(qweight.size(0) * qweight.size(1));
  return k;
}

std::tuple<at::Tensor, at::Tensor> quantize(const at::Tensor& W, const at::Tensor& codebook, int64_t k,
                                            bool search_scale) {
  TORCH_CHECK_TYPE(is_float_dtype(W.scalar_type()), "kbit: weight has dtype ", W.scalar_type(),
                   "; supported: float16, bfloat16, float32");
  TORCH_CHECK_VALUE(W.dim() == 2, "kbit: weight must be 2-D [N, K], got shape ", W.sizes());
  TORCH_CHECK_VALUE(W.size(1) % kBlock == 0 && W.size(1) > 0, "kbit: weight K=", W.size(1), " (shape ", W.sizes(),
                    ") is not a positive multiple of ", kBlock);
  check_contiguous(W, "weight");
  TORCH_CHECK_VALUE(W.is_cuda(), "kbit: weight is on ", W.device(), "; the CUDA kernels need CUDA tensors");
  check_codebook(codebook, k, W, "weight");
  const int64_t N = W.size(0), KB = W.size(1) / kBlock;
  check_block_count(N * KB);
  // The kernel reads whole blocks with 16-byte loads; a view at an odd offset is copied once.
  const c10::DeviceGuard guard(W.device());
  const at::Tensor Wa = reinterpret_cast<uintptr_t>(W.data_ptr()) % 16 == 0 ? W : W.clone();
  at::Tensor qweight = at::empty({N, KB, k}, W.options().dtype(at::kInt));
  at::Tensor absmax = at::empty({N, KB}, W.options().dtype(at::kByte));
  launch_quantize(Wa, codebook, k, search_scale, qweight, absmax);
  return {qweight, absmax};
}

at::Tensor dequantize(const at::Tensor& qweight, const at::Tensor& absmax, const at::Tensor& codebook,
                      at::ScalarType dtype) {
  const int64_t k = check_flat(qweight, absmax);
  check_codebook(codebook, k, qweight, "qweight");
  check_out_dtype(dtype);
  const int64_t N = qweight.size(0), KB = qweight.size(1);
  const c10::DeviceGuard guard(qweight.device());
  at::Tensor out = at::empty({N, KB * kBlock}, qweight.options().dtype(dtype));
  launch_dequantize(qweight, absmax, codebook, k, /*runtime_layout=*/false, N, KB, out);
  return out;
}

std::tuple<at::Tensor, at::Tensor> repack(const at::Tensor& qweight, const at::Tensor& absmax) {
  const int64_t k = check_flat(qweight, absmax);
  const int64_t N = qweight.size(0), KB = qweight.size(1);
  const int64_t NT = (N + kTileN - 1) / kTileN, KT = (KB + kTileKB - 1) / kTileKB;
  const c10::DeviceGuard guard(qweight.device());
  at::Tensor qweight_rt = at::empty({NT, KT, k, kTileN, kTileKB}, qweight.options());
  at::Tensor absmax_rt = at::empty({NT, KT, kTileN, kTileKB}, absmax.options());
  launch_repack(qweight, absmax, qweight_rt, absmax_rt);
  return {qweight_rt, absmax_rt};
}

at::Tensor dequantize_runtime(const at::Tensor& qweight_rt, const at::Tensor& absmax_rt, const at::Tensor& codebook,
                              int64_t N, int64_t K, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(N > 0 && K > 0 && K % kBlock == 0, "kbit: weight shape [", N, ", ", K,
                    "] needs N > 0 and K a positive multiple of ", kBlock);
  TORCH_CHECK_TYPE(qweight_rt.scalar_type() == at::kInt && qweight_rt.dim() == 5,
                   "kbit: runtime qweight must be int32 [N/64, K/128, k, 64, 4], got ", qweight_rt.scalar_type(),
                   " of shape ", qweight_rt.sizes());
  const int64_t k = qweight_rt.size(2);
  check_bits(k);
  const int64_t KB = K / kBlock;
  const int64_t NT = (N + kTileN - 1) / kTileN, KT = (KB + kTileKB - 1) / kTileKB;
  const std::vector<int64_t> q_shape{NT, KT, k, kTileN, kTileKB}, a_shape{NT, KT, kTileN, kTileKB};
  TORCH_CHECK_VALUE(qweight_rt.sizes() == q_shape && absmax_rt.scalar_type() == at::kByte && absmax_rt.sizes() == a_shape,
                    "kbit: runtime tensors for [", N, ", ", K, "] must be int32 ", at::IntArrayRef(q_shape),
                    " and uint8 ", at::IntArrayRef(a_shape), ", got ", qweight_rt.scalar_type(), " ",
                    qweight_rt.sizes(), " and ", absmax_rt.scalar_type(), " ", absmax_rt.sizes());
  check_contiguous(qweight_rt, "runtime qweight");
  check_contiguous(absmax_rt, "runtime absmax");
  TORCH_CHECK_VALUE(qweight_rt.is_cuda(), "kbit: runtime qweight is on ", qweight_rt.device(),
                    "; the CUDA kernels need CUDA tensors");
  check_device(absmax_rt, qweight_rt, "runtime absmax", "runtime qweight");
  check_codebook(codebook, k, qweight_rt, "runtime qweight");
  check_out_dtype(dtype);
  check_block_count(N * KB);
  const c10::DeviceGuard guard(qweight_rt.device());
  at::Tensor out = at::empty({N, K}, qweight_rt.options().dtype(dtype));
  launch_dequantize(qweight_rt, absmax_rt, codebook, k, /*runtime_layout=*/true, N, KB, out);
  return out;
}

}  // namespace
}  // namespace kbit

TORCH_LIBRARY_IMPL(kbit, CUDA, m) {
  m.impl("quantize", &kbit::quantize);
  m.impl("dequantize", &kbit::dequantize);
  m.impl("repack", &kbit::repack);
  m.impl("dequantize_runtime", &kbit::dequantize_runtime);
}
