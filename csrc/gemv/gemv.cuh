// GEMV for M = 1..4: C[M, N] = A[M, K] @ dequant(W)^T (+ bias), reading the runtime layout
// (vllm_kbit/reference.py: repack) exactly once. Launcher and kernel in gemv.cu; its split count is the
// planner's (csrc/plan/plan.h: gemv_splits).
#pragma once

#include <optional>

#include <ATen/core/Tensor.h>

#include "plan.h"

namespace kbit {

// A [M, K] (bf16/fp16, contiguous, 16-byte aligned, 1 <= M <= kGemvMaxM) -> C [M, N] of A's dtype, with
// the K split count of `plan` (linear_plan, path gemv), which the launcher validates. rot_signs (float32 [K] on
// A's device, 16-byte aligned) and rot_block (a power of two 4..1024 dividing K): C = (A · R) @ dequant(W)^T, the rotation
// R = diag(signs) · blockdiag(H_b / sqrt(b)) applied in fp32 in the kernel's activation load; null: no rotation.
void launch_gemv(const at::Tensor& A, const at::Tensor& qweight_rt, const at::Tensor& absmax_rt,
                 const at::Tensor& codebook, const std::optional<at::Tensor>& bias, int64_t N, int64_t K,
                 at::Tensor& C, const LinearPlan& plan, const float* rot_signs = nullptr, int64_t rot_block = 0);

}  // namespace kbit
