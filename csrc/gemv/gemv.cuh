// GEMV for M = 1..4: C[M, N] = A[M, K] @ dequant(W)^T (+ bias), reading the runtime layout
// (vllm_kbit/reference.py: repack) exactly once. Launcher and split-K heuristic; kernel in gemv.cu.
#pragma once

#include <optional>

#include <ATen/core/Tensor.h>

namespace kbit {

constexpr int kGemvMaxM = 4;      // rows of A one GEMV launch handles
constexpr int kGemvMaxSplits = 8;  // portable thread-block cluster size: split-K partners of one n-tile

// Number of K splits (CTAs of one cluster per 64-row n-tile) for a grid of n_tiles x k_tiles
// runtime tiles on num_sms SMs. Always in [1, min(kGemvMaxSplits, k_tiles)], so with the
// balanced partition [s*k_tiles/S, (s+1)*k_tiles/S) every split owns at least one k-tile.
// kbit::_gemv_splits exposes it for the property tests (dispatch.cpp).
int gemv_splits(int64_t n_tiles, int64_t k_tiles, int64_t num_sms);

// A [M, K] (bf16/fp16, contiguous, 16-byte aligned, 1 <= M <= kGemvMaxM) -> C [M, N] of A's dtype.
// splits: K splits per n-tile, 0 = gemv_splits' choice (a forced count is for tests and benchmarks).
void launch_gemv(const at::Tensor& A, const at::Tensor& qweight_rt, const at::Tensor& absmax_rt,
                 const at::Tensor& codebook, const std::optional<at::Tensor>& bias, int64_t N, int64_t K,
                 at::Tensor& C, int64_t splits = 0);

}  // namespace kbit
