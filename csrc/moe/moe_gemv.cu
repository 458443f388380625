// Launcher of the grouped kbit GEMV (kernel in moe_gemv.cuh); instantiates the gate_up stage.
#include "moe_gemv.cuh"
#include "check.h"

namespace kbit {
namespace moe_gemv {
template void launch_moe_gemv_stage<MoeStage::kGather>(bool, int, int, const MoeGemvParams&, int);
}  // namespace moe_gemv

void launch_moe_gemv(MoeStage stage, const at::Tensor& A, const std::optional<at::Tensor>& slot_of,
                     const std::optional<at::Tensor>& slot_weight, int64_t top_k, const at::Tensor& chunks,
                     const at::Tensor& num_chunks, const at::Tensor& qweight, const at::Tensor& absmax,
                     const at::Tensor& codebook, int64_t N, int64_t K, int64_t chunk_rows, at::Tensor& C,
                     int64_t splits) {
  using namespace moe_gemv;
  const int64_t max_chunks = chunks.size(0);
  if (max_chunks == 0) return;
  const int64_t n_tiles = qweight.size(1), k_tiles = qweight.size(2), bits = qweight.size(3);
  KBIT_CHECK(max_chunks * n_tiles * kGemvMaxSplits <= INT32_MAX && N <= INT32_MAX && K <= INT32_MAX,
              "kbit moe gemv: problem too large");
  MoeGemvParams p;
  p.A = A.data_ptr();
  p.slot_of = slot_of.has_value() ? slot_of->data_ptr<int>() : nullptr;
  p.slot_weight = slot_weight.has_value() ? slot_weight->data_ptr<float>() : nullptr;
  p.top_k = static_cast<int>(top_k);
  p.chunks = reinterpret_cast<const int4*>(chunks.data_ptr<int>());
  p.num_chunks = num_chunks.data_ptr<int>();
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
  // Split K as the dense GEMV would for all chunks' n-tiles side by side (or as forced, for benchmarks).
  KBIT_CHECK(splits >= 0 && splits <= std::min<int64_t>(kGemvMaxSplits, k_tiles), "kbit moe gemv: splits=", splits,
              " outside 0 (heuristic) .. ", std::min<int64_t>(kGemvMaxSplits, k_tiles));
  p.splits = splits > 0 ? static_cast<int>(splits)
                        : gemv_splits(max_chunks * n_tiles, k_tiles,
                                      at::cuda::getCurrentDeviceProperties()->multiProcessorCount);
  KBIT_CHECK(A.scalar_type() == at::kBFloat16 || A.scalar_type() == at::kHalf,
              "kbit moe gemv: activations must be bf16 or fp16");
  const bool bf16 = A.scalar_type() == at::kBFloat16;
  if (stage == MoeStage::kGather) {
    launch_moe_gemv_stage<MoeStage::kGather>(bf16, static_cast<int>(bits), static_cast<int>(chunk_rows), p,
                                            static_cast<int>(max_chunks));
  } else {
    launch_moe_gemv_stage<MoeStage::kSiluMul>(bf16, static_cast<int>(bits), static_cast<int>(chunk_rows), p,
                                             static_cast<int>(max_chunks));
  }
}

}  // namespace kbit
