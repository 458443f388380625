// Fused dequant + tensor-core MMA for small M: C[M, N] = A[M, K] @ dequant(W)^T (+ bias), reading
// the runtime layout (vllm_kbit/reference.py: repack) once per block of activation rows.
// Launcher, configuration and split-K heuristic in mma.cu; kernel in mma_kernel.cuh.
#pragma once

#include <optional>

#include <ATen/core/Tensor.h>

namespace kbit {

constexpr int kMmaMaxSplits = 8;    // portable thread-block cluster size: split-K partners of one column
constexpr int kMmaMaxRowTiles = 8;  // n8 activation tiles per CTA: one CTA covers at most 64 rows of A
constexpr int kMmaWideTiles = 128;  // runtime n-tiles from which warps take wide row groups (mma_config)
constexpr int kMmaWideMinRowTiles = 4;  // ... and activation tiles per CTA (p) from which they do
constexpr int kMmaMaxGridRows = 65535;  // CTA rows of one launch (gridDim.y): grouped chunk lists longer are refused

// Tile shape of one launch: `p` n8 tiles of activation rows per CTA (8p rows), `r` 16-row groups of
// weight rows per warp (a CTA of 4 warps covers 64r weight rows = r runtime n-tiles), and the
// number of CTA rows along M.
struct MmaConfig {
  int p;
  int r;
  int m_blocks;
};

// The tile shape for M activation rows and n_tiles runtime n-tiles (r forced when row_groups > 0).
// kbit::linear_plan reports it (dispatch.cpp).
MmaConfig mma_config(int64_t M, int64_t n_tiles, int64_t row_groups = 0);

// Row groups per warp of the grouped (routed-expert) kernel for p activation tiles and an expert's
// n_tiles x k_tiles of k-bit weights, with expected_chunks CTA rows (moe_expected_chunks) on num_sms
// SMs: 4 (2 at p = 8, where the accumulators fill the registers); 1 for experts under 4 n-tiles, and
// at k = 4, p = 1 on long experts where the wide grid would end in a mostly empty wave.
int mma_grouped_r(int p, int64_t n_tiles, int64_t k_tiles, int bits, int64_t expected_chunks, int64_t num_sms);

// The (p, r) instances built for every k, dtype and launch kind (dense and grouped): narrow warps (r = 1)
// at every p, wide ones (4 row groups; 2 at p = 8, where the accumulators fill the registers). The one
// list the launchers and mma_built expand: X(P, R) per instance.
#define KBIT_MMA_INSTANCES(X) X(1, 1) X(1, 4) X(2, 1) X(2, 4) X(4, 1) X(4, 4) X(8, 1) X(8, 2)

// Whether a kernel is built for p activation tiles and r row groups (KBIT_MMA_INSTANCES).
bool mma_built(int p, int r);

// K splits (CTAs of one cluster per CTA column) for cols x m_blocks CTA tiles over k_tiles, on num_sms
// SMs holding ctas_per_sm CTAs each; split_cost weighs each further split's fixed cost (pipeline fill,
// cluster reduction) per CTA slot. cluster_ctas, when given, holds for every split count s in
// 1..kMmaMaxSplits the CTAs that fit on the GPU at once in clusters of s (cudaOccupancyMaxActiveClusters
// x s; index 0 unused): a grid past it runs a further wave. Always in [1, min(kMmaMaxSplits, k_tiles)],
// so with the balanced partition [s*k_tiles/S, (s+1)*k_tiles/S) every split owns at least one k-tile.
// kbit::_mma_splits exposes it for the property tests (dispatch.cpp).
int mma_splits(int64_t cols, int64_t m_blocks, int64_t k_tiles, int64_t num_sms, int64_t ctas_per_sm,
               int64_t split_cost, const int64_t* cluster_ctas = nullptr);

// split_cost of the two launch kinds. Grouped (routed-expert) CTAs are short (an expert's K) and every
// further split repeats the table fill and pipeline fill of a whole 64r-row tile and adds a cluster
// reduction of it, so splits cost far more there than the dense kernel's model assumes; both values
// measured with benchmarks/sweep_splits.py and benchmarks/sweep_moe_grid.py (docs/decisions.md,
// "Grouped MMA grid" and "Dense MMA split count by cluster waves").
constexpr int kMmaSplitCostDense = 2;
constexpr int kMmaSplitCostGrouped = 16;

// A [M, K] (bf16/fp16, contiguous, 16-byte aligned) -> C [M, N] of A's dtype. row_groups / splits
// force the tile shape / split count (0: heuristic), for tests and benchmarks; the caller
// (linear.cpp) validates them before the launch.
void launch_mma(const at::Tensor& A, const at::Tensor& qweight_rt, const at::Tensor& absmax_rt,
                const at::Tensor& codebook, const std::optional<at::Tensor>& bias, int64_t N, int64_t K, at::Tensor& C,
                int64_t row_groups = 0, int64_t splits = 0);

// Grouped over experts, one launch: C[p] = A[p] @ dequant(W_e)^T for the rows p of every valid chunk
// {e, first row, rows <= chunk_rows, 0} of `chunks` (int32 [max_chunks, 4], the first num_chunks[0]
// valid, as the MoE routing writes them); W: stacked runtime tensors [E, n_tiles, k_tiles, k, 64, 4] /
// [E, n_tiles, k_tiles, 64, 4]. chunk_rows is 8, 16, 32 or 64 (one CTA row per chunk); A is
// contiguous bf16 [rows, K], C [rows, N] bf16; rows outside the chunks are not written.
// row_groups / splits: 0 takes the rule (mma_grouped_r, mma_splits); sweeps force them.
// chunks_early: the chunk list was written at least two launches before this one (not by the kernel
// right before it), so the weight prologue overlaps the previous kernel's tail (MmaParams).
// The caller validates (moe_ops.cpp), including max_chunks <= kMmaMaxGridRows.
void launch_mma_grouped(const at::Tensor& A, const at::Tensor& chunks, const at::Tensor& num_chunks,
                        const at::Tensor& qweight, const at::Tensor& absmax, const at::Tensor& codebook, int64_t N,
                        int64_t K, int64_t chunk_rows, at::Tensor& C, int64_t row_groups = 0, int64_t splits = 0,
                        bool chunks_early = false);

}  // namespace kbit
