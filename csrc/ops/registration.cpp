// CUDA implementations of the torch.ops.kbit ops whose schemas vllm_kbit/ops.py defines.
// Each op runs its checks (checks.cpp, which vllm_kbit/reference.py asks too) and the
// CUDA-only ones (devices, index limits), allocates its outputs and calls a launcher.
// Plain C++ with no CUDA headers (c10::DeviceGuard selects the tensors' GPU).
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <tuple>

#include "check.h"
#include "format_constants.h"
#include "checks.h"
#include "kbit_ops.h"

namespace kbit {
namespace {

std::tuple<at::Tensor, at::Tensor> quantize(const at::Tensor& W, const at::Tensor& codebook, int64_t k,
                                            bool search_scale) {
  check_quantize(W, codebook, k);
  check_cuda(W, "weight");
  check_device(codebook, W, "codebook", "weight");
  const int64_t N = W.size(0), KB = W.size(1) / kBlockSize;
  check_block_count(N * KB);
  const c10::DeviceGuard guard(W.device());
  check_representable(W);  // one reduction and a host sync: quantize is a load-time op, never in a graph
  // The kernel reads whole blocks with 16-byte loads; a view at an odd offset is copied once.
  const at::Tensor Wa = reinterpret_cast<uintptr_t>(W.data_ptr()) % 16 == 0 ? W : W.clone();
  at::Tensor qweight = at::empty({N, KB, k}, W.options().dtype(at::kInt));
  at::Tensor absmax = at::empty({N, KB}, W.options().dtype(at::kByte));
  launch_quantize(Wa, codebook, k, search_scale, qweight, absmax);
  return {qweight, absmax};
}

at::Tensor dequantize(const at::Tensor& qweight, const at::Tensor& absmax, const at::Tensor& codebook,
                      at::ScalarType dtype) {
  const int64_t k = check_dequantize(qweight, absmax, codebook, dtype);
  check_cuda(qweight, "qweight");
  check_device(absmax, qweight, "absmax", "qweight");
  check_block_count(qweight.size(0) * qweight.size(1));
  check_device(codebook, qweight, "codebook", "qweight");
  const int64_t N = qweight.size(0), KB = qweight.size(1);
  const c10::DeviceGuard guard(qweight.device());
  at::Tensor out = at::empty({N, KB * kBlockSize}, qweight.options().dtype(dtype));
  launch_dequantize(qweight, absmax, codebook, k, /*runtime_layout=*/false, N, KB, out);
  return out;
}

std::tuple<at::Tensor, at::Tensor> repack(const at::Tensor& qweight, const at::Tensor& absmax) {
  const int64_t k = check_repack(qweight, absmax);
  check_cuda(qweight, "qweight");
  check_device(absmax, qweight, "absmax", "qweight");
  check_block_count(qweight.size(0) * qweight.size(1));
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
  const int64_t k = check_dequantize_runtime(qweight_rt, absmax_rt, codebook, N, K, dtype);
  check_cuda(qweight_rt, "runtime qweight");
  check_device(absmax_rt, qweight_rt, "runtime absmax", "runtime qweight");
  check_device(codebook, qweight_rt, "codebook", "runtime qweight");
  const int64_t KB = K / kBlockSize;
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
