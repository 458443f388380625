// The rotation kernel's launcher (rotate.cu): out2 = x2 · R with R = diag(signs) · blockdiag(H_block / sqrt(block)),
// or x2 · Rᵀ when `inverse`.
// x2: [M, K] bf16 / fp16 / fp32 with unit column stride, K a multiple of 32; signs: float32 [K] on x2's
// device; out2: [M, K] contiguous, x2's dtype; block: a power of two in 2..kRotateMaxBlock dividing K.
// The op checks all of it first.
#pragma once

#include <ATen/ATen.h>

namespace kbit {

constexpr int64_t kRotateMaxBlock = 1024;  // the largest Hadamard block one warp holds in registers

void launch_rotate(const at::Tensor& x2, const at::Tensor& signs, int64_t block, bool inverse, at::Tensor& out2);

}  // namespace kbit
