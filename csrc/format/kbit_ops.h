// Launchers of the kbit CUDA kernels. registration.cpp validates the inputs and allocates
// the outputs; each launcher only picks the template instance and enqueues on the current stream.
#pragma once

#include <ATen/core/Tensor.h>

namespace kbit {

// W [N, K] (fp16/bf16/fp32, 16-byte aligned) -> qweight int32 [N, K/32, k], absmax uint8 [N, K/32];
// search_scale picks each block's scale code by block squared error (format.block_scales).
void launch_quantize(const at::Tensor& W, const at::Tensor& codebook, int64_t k, bool search_scale,
                     at::Tensor& qweight, at::Tensor& absmax);

// Flat (qweight [N, KB, k]) or runtime (qweight_rt [N/64, KB/4, k, 64, 4]) layout -> out [N, KB*32].
void launch_dequantize(const at::Tensor& qweight, const at::Tensor& absmax, const at::Tensor& codebook, int64_t k,
                       bool runtime_layout, int64_t N, int64_t KB, at::Tensor& out);

// Flat -> runtime layout, padding rows and blocks with zeros.
void launch_repack(const at::Tensor& qweight, const at::Tensor& absmax, at::Tensor& qweight_rt, at::Tensor& absmax_rt);

}  // namespace kbit
