// GEMV for M = 1..4: C[M, N] = A[M, K] @ dequant(W)^T (+ bias), reading the runtime layout
// (vllm_kbit/reference.py: repack) exactly once. Launcher and kernel in gemv.cu; its split count is the
// planner's (csrc/plan/plan.h: gemv_splits).
#pragma once

#include <optional>

#include <ATen/core/Tensor.h>

#include "plan.h"

namespace kbit {

// A [M, K] (bf16/fp16, contiguous, 16-byte aligned, 1 <= M <= kGemvMaxM) -> C [M, N] of A's dtype, with
// the K split count of `plan` (linear_plan, path gemv), which the launcher validates.
void launch_gemv(const at::Tensor& A, const at::Tensor& qweight_rt, const at::Tensor& absmax_rt,
                 const at::Tensor& codebook, const std::optional<at::Tensor>& bias, int64_t N, int64_t K,
                 at::Tensor& C, const LinearPlan& plan);

}  // namespace kbit
