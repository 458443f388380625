// Launcher of the grouped kbit GEMV (kernel in moe_gemv.cuh); instantiates the gate_up stage.
#include "moe_gemv.cuh"
#include "check.h"

namespace kbit {
namespace moe_gemv {
template void launch_moe_gemv_stage<MoeStage::kGather>(const MoeGemvParams&, const StageLaunch&);
}  // namespace moe_gemv

namespace {

// The fields both modes share: weights, codebook, output, shape and the planned K split count
// (moe_proj_plan for `rows` CTA rows of n-tiles side by side).
moe_gemv::MoeGemvParams common_params(const at::Tensor& A, int64_t top_k, const at::Tensor& qweight,
                                      const at::Tensor& absmax, const at::Tensor& codebook, int64_t N, int64_t K,
                                      at::Tensor& C, int64_t rows, const MoeProjPlan& plan) {
  const int64_t n_tiles = qweight.size(1), k_tiles = qweight.size(2);
  KBIT_CHECK(rows * n_tiles * kGemvMaxSplits <= INT32_MAX && N <= INT32_MAX && K <= INT32_MAX,
              "kbit moe gemv: problem too large");
  KBIT_CHECK(A.scalar_type() == at::kBFloat16 || A.scalar_type() == at::kHalf,
              "kbit moe gemv: activations must be bf16 or fp16");
  moe_gemv::MoeGemvParams p{};
  p.A = A.data_ptr();
  p.top_k = static_cast<int>(top_k);
  p.qweight = reinterpret_cast<const uint4*>(qweight.data_ptr());
  p.absmax = reinterpret_cast<const uint32_t*>(absmax.data_ptr());
  p.expert_vectors = qweight[0].numel() / 4;
  p.expert_code_words = absmax[0].numel() / 4;
  p.codebook = codebook.data_ptr<float>();
  p.C = C.data_ptr();
  p.N = static_cast<int>(N);
  p.K = static_cast<int>(K);
  p.n_tiles = static_cast<int>(n_tiles);
  p.k_tiles = static_cast<int>(k_tiles);
  KBIT_CHECK(plan.splits >= 1 && plan.splits <= std::min<int64_t>(kGemvMaxSplits, k_tiles) && plan.m_blocks == rows &&
                 plan.cols == n_tiles,
             "kbit moe gemv: the plan (splits=", plan.splits, ", grid ", plan.cols, " x ", plan.m_blocks, ") is not 1..",
             std::min<int64_t>(kGemvMaxSplits, k_tiles), " splits over ", n_tiles, " x ", rows, " CTAs");
  p.splits = static_cast<int>(plan.splits);
  return p;
}

void launch_stage(MoeStage stage, const at::Tensor& A, int64_t bits, int64_t chunk_rows,
                  const moe_gemv::MoeGemvParams& p, int64_t rows, const MoeProjPlan& plan, const char* kernel) {
  using namespace moe_gemv;
  const StageLaunch s{A.scalar_type() == at::kBFloat16, static_cast<int>(bits), static_cast<int>(chunk_rows),
                      static_cast<int>(rows), static_cast<int>(plan.table_blocks), plan.pdl, kernel};
  if (stage == MoeStage::kGather) {
    launch_moe_gemv_stage<MoeStage::kGather>(p, s);
  } else {
    launch_moe_gemv_stage<MoeStage::kSiluMul>(p, s);
  }
}

}  // namespace

void launch_moe_gemv(MoeStage stage, const at::Tensor& A, const std::optional<at::Tensor>& slot_of,
                     const std::optional<at::Tensor>& slot_weight, int64_t top_k, const at::Tensor& chunks,
                     const at::Tensor& num_chunks, const at::Tensor& qweight, const at::Tensor& absmax,
                     const at::Tensor& codebook, int64_t N, int64_t K, int64_t chunk_rows, at::Tensor& C,
                     const MoeProjPlan& plan, const float* rot_signs, int64_t rot_block) {
  const int64_t max_chunks = chunks.size(0);
  if (max_chunks == 0) return;
  moe_gemv::MoeGemvParams p = common_params(A, top_k, qweight, absmax, codebook, N, K, C, max_chunks, plan);
  p.slot_of = slot_of.has_value() ? slot_of->data_ptr<int>() : nullptr;
  p.slot_weight = slot_weight.has_value() ? slot_weight->data_ptr<float>() : nullptr;
  p.chunks = reinterpret_cast<const int4*>(chunks.data_ptr<int>());
  p.num_chunks = num_chunks.data_ptr<int>();
  p.rot = rotate_core::fused_rotation("kbit moe gemv", rot_signs, rot_block, K);
  launch_stage(stage, A, qweight.size(3), chunk_rows, p, max_chunks, plan, "moe_gemv");
}

void launch_moe_gemv_direct(MoeStage stage, const at::Tensor& A, const at::Tensor& topk_ids,
                            const std::optional<at::Tensor>& expert_map, const std::optional<at::Tensor>& slot_weight,
                            int64_t top_k, const at::Tensor& qweight, const at::Tensor& absmax,
                            const at::Tensor& codebook, int64_t N, int64_t K, at::Tensor& C, at::Tensor& arrivals,
                            const MoeProjPlan& plan, at::Tensor* out, const float* rot_signs, int64_t rot_block) {
  const int64_t S = topk_ids.numel();
  if (S == 0) return;
  KBIT_CHECK(topk_ids.scalar_type() == at::kInt && arrivals.scalar_type() == at::kInt && top_k >= 1 && S % top_k == 0,
              "kbit moe gemv direct: int32 topk_ids and arrivals, and top_k dividing the slots");
  moe_gemv::MoeGemvParams p = common_params(A, top_k, qweight, absmax, codebook, N, K, C, S, plan);
  p.slot_weight = slot_weight.has_value() ? slot_weight->data_ptr<float>() : nullptr;
  p.ids = topk_ids.data_ptr<int>();
  p.expert_map = expert_map.has_value() ? expert_map->data_ptr<int>() : nullptr;
  p.map_len = expert_map.has_value() ? static_cast<int>(expert_map->numel()) : 0;
  p.num_experts = static_cast<int>(qweight.size(0));
  p.arrivals = arrivals.data_ptr<int>();
  p.rot = rotate_core::fused_rotation("kbit moe gemv direct", rot_signs, rot_block, K);
  if (stage == MoeStage::kGather) {
    p.zero_arrivals = static_cast<int>(arrivals.numel());
  } else {
    // The counters hold one per token and n-tile of this projection; the combine's weights are slot_weight.
    KBIT_CHECK(out != nullptr && arrivals.numel() == S / top_k * p.n_tiles && C.scalar_type() == at::kFloat &&
                    out->scalar_type() == A.scalar_type(),
                "kbit moe gemv direct: the down stage needs fp32 C, out in A's dtype and T x n_tiles arrivals");
    p.combine_weight = p.slot_weight;
    p.slot_weight = nullptr;
    p.out = out->data_ptr();
  }
  launch_stage(stage, A, qweight.size(3), 1, p, S, plan, "moe_gemv_direct");
}

}  // namespace kbit
