// Fused dequant + wgmma for large M (Hopper, sm_90a): C[M, N] = A[M, K] @ dequant(W)^T (+ bias).
// Two designs: launch_wgmma (wgmma.cu) dequantizes into each warpgroup's registers, once per 128
// rows of A; launch_wgmma_ws (wgmma_ws.cu) has a producer warpgroup dequantize into shared memory
// for two consumer warpgroups, once per 256 rows of A.
#pragma once

#include <optional>

#include <ATen/core/Tensor.h>

#include "plan.h"

namespace kbit {

constexpr int kWgmmaRows = 128;  // rows of A one CTA multiplies (the wgmma N)

// A [M, K] (bf16/fp16, contiguous) -> C [M, N] of A's dtype, every element written. The caller
// validates shapes and dtypes (linear.cpp). plan: linear_plan's (its grid, and for wgmma_ws its producer
// warpgroups: plan.h, ws_producers, 1 or 2 at k = 2..4), validated here.
void launch_wgmma(const at::Tensor& A, const at::Tensor& qweight_rt, const at::Tensor& absmax_rt,
                  const at::Tensor& codebook, const std::optional<at::Tensor>& bias, int64_t N, int64_t K,
                  at::Tensor& C, const LinearPlan& plan);
void launch_wgmma_ws(const at::Tensor& A, const at::Tensor& qweight_rt, const at::Tensor& absmax_rt,
                     const at::Tensor& codebook, const std::optional<at::Tensor>& bias, int64_t N, int64_t K,
                     at::Tensor& C, const LinearPlan& plan);

// Grouped (routed experts): C[p] = A[p] @ dequant(W_e)^T for the rows p of every chunk {e, first row,
// rows <= kMoeWsChunkRows, 0} of `chunks` (moe_route; entries with e < 0 are skipped), W the stacked
// runtime tensors [E, n_tiles, k_tiles, k, 64, 4] / [E, n_tiles, k_tiles, 64, 4]. A bf16/fp16 [rows, K]
// contiguous, C [rows, N] of A's dtype; rows outside the chunks are not written. Hopper only; the
// caller validates (moe_ops.cpp). plan: moe_proj_plan's for the kernel (grid, producer warpgroups).
void launch_wgmma_ws_grouped(const at::Tensor& A, const at::Tensor& chunks, const at::Tensor& qweight,
                             const at::Tensor& absmax, const at::Tensor& codebook, int64_t N, int64_t K,
                             at::Tensor& C, const MoeProjPlan& plan);
// The same with the register-operand kernel (wgmma.cu) over chunks of up to kMoeRsChunkRows (128) rows,
// each through the narrowest built wgmma N that holds its rows.
void launch_wgmma_rs_grouped(const at::Tensor& A, const at::Tensor& chunks, const at::Tensor& qweight,
                             const at::Tensor& absmax, const at::Tensor& codebook, int64_t N, int64_t K,
                             at::Tensor& C, const MoeProjPlan& plan);

}  // namespace kbit
