// Argument checks of the torch.ops.kbit ops, one function per op, run by their CUDA implementations
// before any allocation or launch. Metadata only (dtypes, shapes, contiguity, devices among the
// tensors), device-agnostic: the same functions are registered as kbit::_check_<op> so the CPU test
// suite runs them on CPU tensors. They raise what vllm_kbit/reference.py raises for the same input
// (exception type and message), which tests/bad_input_cases.py holds both to.
#pragma once

#include <optional>

#include <ATen/core/Tensor.h>

namespace kbit {

// Each returns k (bits per weight).
int64_t check_quantize(const at::Tensor& W, const at::Tensor& codebook, int64_t k);
int64_t check_dequantize(const at::Tensor& qweight, const at::Tensor& absmax, const at::Tensor& codebook,
                         at::ScalarType dtype);
int64_t check_repack(const at::Tensor& qweight, const at::Tensor& absmax);
int64_t check_dequantize_runtime(const at::Tensor& qweight_rt, const at::Tensor& absmax_rt, const at::Tensor& codebook,
                                 int64_t N, int64_t K, at::ScalarType dtype);
int64_t check_linear(const at::Tensor& x, const at::Tensor& qweight_rt, const at::Tensor& absmax_rt,
                     const at::Tensor& codebook, int64_t N, int64_t K, const std::optional<at::Tensor>& bias);

// For the CUDA implementations: t is a CUDA tensor; t is on ref's device.
void check_cuda(const at::Tensor& t, const char* what);
void check_device(const at::Tensor& t, const at::Tensor& ref, const char* what, const char* ref_what);
// The kernels index blocks of 32 with 32-bit integers.
void check_block_count(int64_t n_blocks);

}  // namespace kbit
