// Environment overrides of the kernels' choices: every one is read in overrides.cpp, under the prefix
// VLLM_KBIT_, once per process (docs/development.md lists them with the Python package's own settings).
// For benchmarks and bisecting; unset, each choice is the heuristic's.
#pragma once

#include <cstdint>
#include <string>

namespace kbit {
namespace overrides {

// VLLM_KBIT_PDL: "1" or unset = programmatic dependent launch where the device has it, "0" = never.
bool pdl();
// VLLM_KBIT_MMA_MAX_M: the largest M the dense MMA path takes; -1 when unset.
int64_t mma_max_m();
// VLLM_KBIT_MOE_PATH: the MoE path forced for every call ("" when unset; dispatch.cpp checks the name).
const std::string& moe_path();
// VLLM_KBIT_WS_PRODUCERS: producer warpgroups of the warp-specialized wgmma kernel, 1 or 2 (default; the
// planner's ws_producers keeps k = 5 at 1).
int64_t ws_producers();
// VLLM_KBIT_GEMV_DECODE: "shuffle", "table" or "mixed", how the GEMV kernels decode k = 2..4 (plan.h:
// gemv_table_blocks); "" when unset.
const std::string& gemv_decode();
// VLLM_KBIT_MOE_WGMMA: the kernel of the grouped_wgmma MoE path, "ws" (warp-specialized, 256-row chunks) or
// "rs" (register operand, 128-row chunks); "" when unset (plan.h: moe_wgmma_rs).
const std::string& moe_wgmma();

}  // namespace overrides
}  // namespace kbit
