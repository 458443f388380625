// Launchers of the routed-expert (MoE) kernels; moe_ops.cpp composes them into kbit::fused_moe.
//
// Slots: a token's top_k picks, s = t * top_k + j (S = T * top_k in all). Routing sorts the
// slots by local expert: permuted row p holds slot slot_of[p], pos[s] is the row of slot s
// (-1: its expert is not on this rank), and the rows of local expert e are
// [offsets[e], offsets[e + 1]). Every size here is bounded by S or E: nothing depends on data.
#pragma once

#include <algorithm>
#include <optional>

#include <ATen/core/Tensor.h>

namespace kbit {

constexpr int kMoeChunkRows = 4;      // most rows of one expert a grouped-GEMV CTA multiplies (the GEMV's M)
constexpr int kMoeMaxChunkRows = 64;  // most rows of one chunk: a grouped-MMA CTA covers 8p <= 64 rows

// Rows per chunk for T tokens: 1 for T = 1 (a one-row kernel, fewer registers), else kMoeChunkRows.
inline int64_t moe_chunk_rows(int64_t tokens) { return tokens == 1 ? 1 : kMoeChunkRows; }

// Rows per chunk of the grouped MMA (the CTA height 8p: 8, 16, 32 or 64) for S slots over E experts of
// k-bit weights, from the average rows of an expert that got any, avg = ceil(S / min(E, S)). Every chunk
// decodes its expert's weights once, so a height below an expert's rows decodes them again per chunk,
// and one far above multiplies padding MMAs. Heights 8 and 16 (p <= 2) decode through the per-lane table
// (mma_kernel.cuh, uses_lut), which makes 16 rows cheap: from 8 average rows (many experts past 8) 16
// wins, and stays best up to 32 average rows except at k = 5, whose wider decode favours 32; past 32, 64.
// At k = 2 the 8-row table decode is cheap enough that re-decoding beats padding up to 8 average rows.
// Measured per T and k: benchmarks/sweep_moe_chunk_rows.py (docs/decisions.md, "Grouped MMA chunk height").
inline int64_t moe_mma_chunk_rows(int64_t slots, int64_t experts, int bits) {
  const int64_t busy = std::max<int64_t>(1, std::min(experts, slots));
  const int64_t avg = (slots + busy - 1) / busy;
  if (avg <= 4 || (avg <= 8 && bits == 2)) return 8;
  if (avg <= 32) return bits == 5 && avg > 8 ? 32 : 16;
  return 64;
}

// Upper bound on the number of chunks (<= R rows of one expert) S slots over E experts can
// need: sum_e ceil(c_e / R) <= (S + (R - 1) * min(E, S)) / R, and never more than S.
int64_t moe_max_chunks(int64_t slots, int64_t experts, int64_t chunk_rows);

// The chunks a typical routing needs: each expert's count of S slots taken as Poisson(S / E), the
// expected sum_e ceil(c_e / R) = E * sum_j P(c > jR), rounded up and at most moe_max_chunks. Sizes the
// grouped MMA's split count (the grid itself is sized for moe_max_chunks).
int64_t moe_expected_chunks(int64_t slots, int64_t experts, int64_t chunk_rows);

// topk_ids int32 [S] (global ids), expert_map int32 [global experts] or none -> offsets int32
// [E + 1], pos int32 [S], slot_of int32 [S] (-1 past offsets[E]), and when chunks has rows:
// chunks int32 [max_chunks, 4] = {expert, first row, rows <= chunk_rows, 0} (the first
// num_chunks[0] valid, the rest {-1, 0, 0, 0}).
void launch_moe_route(const at::Tensor& topk_ids, const std::optional<at::Tensor>& expert_map, int64_t num_experts,
                      int64_t chunk_rows, at::Tensor& offsets, at::Tensor& pos, at::Tensor& slot_of, at::Tensor& chunks,
                      at::Tensor& num_chunks);

// How the grouped GEMV reads activation row p of a chunk.
enum class MoeStage : int {
  kGather,   // x[slot_of[p] / top_k] (times the slot's router weight if given), or A[p] without slot_of
  kSiluMul,  // silu(h[p, :K]) * h[p, K:2K] of the gate_up output h [S, 2K]
};

// Grouped kbit GEMV, one launch: C[p, :N] = A_p @ dequant(W_e)^T for every row p of every valid
// chunk (expert e). W: stacked runtime tensors [E, n_tiles, k_tiles, k, 64, 4] / [E, .., 64, 4].
// C is A's dtype for kGather and float32 for kSiluMul. Rows outside the chunks are not written.
void launch_moe_gemv(MoeStage stage, const at::Tensor& A, const std::optional<at::Tensor>& slot_of,
                     const std::optional<at::Tensor>& slot_weight, int64_t top_k, const at::Tensor& chunks,
                     const at::Tensor& num_chunks, const at::Tensor& qweight, const at::Tensor& absmax,
                     const at::Tensor& codebook, int64_t N, int64_t K, int64_t chunk_rows, at::Tensor& C,
                     int64_t splits = 0);

// The grouped GEMV without routing: chunk s is slot s, one row, its expert topk_ids[s] through expert_map
// (slots whose expert is not local are skipped). kGather: C[s] = x[s / top_k] (times slot_weight[s] if
// given) @ dequant(W_e)^T, and the launch zeroes `arrivals` (int32, one counter per token and n-tile of
// the down projection that follows). kSiluMul: C[s] (fp32 [S, N], a workspace) = silu * up of row s of A
// @ dequant(W_e)^T; the last of a token's top_k CTAs of an n-tile to finish sums their rows of C into
// out[t] = sum_j w_s C[s], s = t * top_k + j, w = slot_weight (1 without), j in order as in
// launch_moe_combine, in out's dtype (A's). Every element of out is written.
void launch_moe_gemv_direct(MoeStage stage, const at::Tensor& A, const at::Tensor& topk_ids,
                            const std::optional<at::Tensor>& expert_map, const std::optional<at::Tensor>& slot_weight,
                            int64_t top_k, const at::Tensor& qweight, const at::Tensor& absmax,
                            const at::Tensor& codebook, int64_t N, int64_t K, at::Tensor& C, at::Tensor& arrivals,
                            at::Tensor* out = nullptr);

// xp[p] = bf16(x[slot_of[p] / top_k] * (slot_weight or 1)), zero rows where slot_of[p] < 0.
void launch_moe_gather(const at::Tensor& x, const at::Tensor& slot_of, const std::optional<at::Tensor>& slot_weight,
                       int64_t top_k, at::Tensor& xp);

// h[p, i] = silu(g[p, i]) * g[p, I + i] in fp32, rounded once to h's dtype (bf16).
void launch_moe_silu_mul(const at::Tensor& g, at::Tensor& h);

// out[t] = sum_j w[t, j] * y[pos[t, j]] in fp32, j in order (deterministic); pos < 0 adds
// nothing; without weights every w is 1 (router weights already applied to the input).
void launch_moe_combine(const at::Tensor& y, const at::Tensor& pos, const std::optional<at::Tensor>& weights,
                        int64_t top_k, at::Tensor& out);

}  // namespace kbit
