// Fused dequant + tensor-core MMA for small M: C[M, N] = A[M, K] @ dequant(W)^T (+ bias), reading
// the runtime layout (vllm_kbit/reference.py: repack) once per block of activation rows.
// Launchers in mma.cu (they take a plan from csrc/plan/plan.h and decide nothing); kernel in mma_kernel.cuh.
#pragma once

#include <optional>

#include <ATen/core/Tensor.h>

#include "plan.h"

namespace kbit {

constexpr int kMmaMaxGridRows = 65535;  // CTA rows of one launch (gridDim.y): grouped chunk lists longer are refused

// A [M, K] (bf16/fp16, contiguous, 16-byte aligned) -> C [M, N] of A's dtype, with the tile shape and
// split count of `plan` (linear_plan, path mma), which the launcher validates.
void launch_mma(const at::Tensor& A, const at::Tensor& qweight_rt, const at::Tensor& absmax_rt,
                const at::Tensor& codebook, const std::optional<at::Tensor>& bias, int64_t N, int64_t K, at::Tensor& C,
                const LinearPlan& plan);

// Grouped over experts, one launch: C[p] = A[p] @ dequant(W_e)^T for the rows p of every valid chunk
// {e, first row, rows <= chunk_rows, 0} of `chunks` (int32 [max_chunks, 4], the first num_chunks[0]
// valid, as the MoE routing writes them); W: stacked runtime tensors [E, n_tiles, k_tiles, k, 64, 4] /
// [E, n_tiles, k_tiles, 64, 4]. chunk_rows is 8, 16, 32 or 64 (one CTA row per chunk: plan.p = chunk_rows
// / 8, plan.m_blocks = max_chunks); A is contiguous bf16 [rows, K], C [rows, N] bf16; rows outside the
// chunks are not written. plan: moe_proj_plan for mma_grouped (r, splits, grid, pdl), validated here.
// chunks_early: the chunk list was written at least two launches before this one (not by the kernel
// right before it), so the weight prologue overlaps the previous kernel's tail (MmaParams).
// The caller validates the tensors (moe_ops.cpp), including max_chunks <= kMmaMaxGridRows.
void launch_mma_grouped(const at::Tensor& A, const at::Tensor& chunks, const at::Tensor& num_chunks,
                        const at::Tensor& qweight, const at::Tensor& absmax, const at::Tensor& codebook, int64_t N,
                        int64_t K, int64_t chunk_rows, at::Tensor& C, const MoeProjPlan& plan,
                        bool chunks_early = false);

}  // namespace kbit
