// The down stage of the grouped kbit GEMV (SiLU * up staged from the gate_up output, fp32 out).
#include "moe_gemv.cuh"

namespace kbit {
namespace moe_gemv {
template void launch_moe_gemv_stage<MoeStage::kSiluMul>(const MoeGemvParams&, const StageLaunch&);
}  // namespace moe_gemv
}  // namespace kbit
