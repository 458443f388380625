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

#include "plan.h"

namespace kbit {

// Chunk heights, chunk counts, split counts and `pdl` (launch as a programmatic dependent: MoePlan::pdl) are
// the planner's (csrc/plan/plan.h: moe_plan).

// topk_ids int32 [S] (global ids), expert_map int32 [global experts] or none -> offsets int32
// [E + 1], pos int32 [S], slot_of int32 [S] (-1 past offsets[E]), and when chunks has rows:
// chunks int32 [max_chunks, 4] = {expert, first row, rows <= chunk_rows, 0} (the first
// num_chunks[0] valid, the rest {-1, 0, 0, 0}).
void launch_moe_route(const at::Tensor& topk_ids, const std::optional<at::Tensor>& expert_map, int64_t num_experts,
                      int64_t chunk_rows, at::Tensor& offsets, at::Tensor& pos, at::Tensor& slot_of, at::Tensor& chunks,
                      at::Tensor& num_chunks, bool pdl);

// How the grouped GEMV reads activation row p of a chunk.
enum class MoeStage : int {
  kGather,   // x[slot_of[p] / top_k] (times the slot's router weight if given), or A[p] without slot_of
  kSiluMul,  // silu(h[p, :K]) * h[p, K:2K] of the gate_up output h [S, 2K]
};

// Grouped kbit GEMV, one launch: C[p, :N] = A_p @ dequant(W_e)^T for every row p of every valid
// chunk (expert e). W: stacked runtime tensors [E, n_tiles, k_tiles, k, 64, 4] / [E, .., 64, 4].
// C is A's dtype for kGather and float32 for kSiluMul. Rows outside the chunks are not written.
// plan: moe_proj_plan for moe_gemv over chunks.size(0) grid rows (K splits, decode, pdl), validated here.
// rot_signs (float32 [K], 16-byte aligned) and rot_block (a power of two 4..1024 dividing K): every activation row is
// rotated, A_p · R (R = diag(signs) · blockdiag(H_b / sqrt(b))), in fp32 in the kernel's activation load, after
// the router weight (kGather) or silu * up (kSiluMul); null: no rotation.
void launch_moe_gemv(MoeStage stage, const at::Tensor& A, const std::optional<at::Tensor>& slot_of,
                     const std::optional<at::Tensor>& slot_weight, int64_t top_k, const at::Tensor& chunks,
                     const at::Tensor& num_chunks, const at::Tensor& qweight, const at::Tensor& absmax,
                     const at::Tensor& codebook, int64_t N, int64_t K, int64_t chunk_rows, at::Tensor& C,
                     const MoeProjPlan& plan, const float* rot_signs = nullptr, int64_t rot_block = 0);

// The grouped GEMV without routing: chunk s is slot s, one row, its expert topk_ids[s] through expert_map
// (slots whose expert is not local are skipped). kGather: C[s] = x[s / top_k] (times slot_weight[s] if
// given) @ dequant(W_e)^T, and the launch zeroes `arrivals` (int32, one counter per token and n-tile of
// the down projection that follows). kSiluMul: C[s] (fp32 [S, N], a workspace) = silu * up of row s of A
// @ dequant(W_e)^T; the last of a token's top_k CTAs of an n-tile to finish sums their rows of C into
// out[t] = sum_j w_s C[s], s = t * top_k + j, w = slot_weight (1 without), j in order as in
// launch_moe_combine, in out's dtype (A's). Every element of out is written. plan: moe_proj_plan for moe_gemv_direct over S
// grid rows (its K splits), validated here. rot_signs / rot_block: the fused rotation, as for launch_moe_gemv.
void launch_moe_gemv_direct(MoeStage stage, const at::Tensor& A, const at::Tensor& topk_ids,
                            const std::optional<at::Tensor>& expert_map, const std::optional<at::Tensor>& slot_weight,
                            int64_t top_k, const at::Tensor& qweight, const at::Tensor& absmax,
                            const at::Tensor& codebook, int64_t N, int64_t K, at::Tensor& C, at::Tensor& arrivals,
                            const MoeProjPlan& plan, at::Tensor* out = nullptr, const float* rot_signs = nullptr,
                            int64_t rot_block = 0);

// xp[p] = bf16(x[slot_of[p] / top_k] * (slot_weight or 1)), zero rows where slot_of[p] < 0.
void launch_moe_gather(const at::Tensor& x, const at::Tensor& slot_of, const std::optional<at::Tensor>& slot_weight,
                       int64_t top_k, at::Tensor& xp, bool pdl);

// h[p, i] = silu(g[p, i]) * g[p, I + i] in fp32, rounded once to h's dtype (g's: bf16 or fp16).
void launch_moe_silu_mul(const at::Tensor& g, at::Tensor& h, bool pdl);

// out[t] = sum_j w[t, j] * y[pos[t, j]] in fp32, j in order (deterministic); pos < 0 adds
// nothing; without weights every w is 1 (router weights already applied to the input). y: fp32, bf16 or
// fp16. With top_k = 1 it is a scatter from routed order back to slot order (zeros for pos < 0).
void launch_moe_combine(const at::Tensor& y, const at::Tensor& pos, const std::optional<at::Tensor>& weights,
                        int64_t top_k, at::Tensor& out, bool pdl);

}  // namespace kbit
