// Which kernel serves a call, decided from shapes alone (no host sync, no kernel launch): the dense
// linear's path and tile/split plan, the routed experts' path and routing workspace. The CUDA ops
// follow these plans; kbit::linear_plan and kbit::moe_plan expose them to Python and tests, on any
// device (host C++ only). The measurements behind each bound: docs/decisions.md.
#pragma once

#include <cstdint>
#include <string>

#include <c10/core/ScalarType.h>

namespace kbit {

// ----------------------------------------------------------------------------- dense linear

enum class LinearPath { kGemv, kMma, kWgmma, kWgmmaWs, kDequantCublas };

// "auto" (what kbit::linear picks), or a kernel forced by name: "gemv", "mma", "wgmma", "wgmma_ws",
// "dequant_cublas".
const char* linear_path_name(LinearPath path);

// The largest M of the MMA path: kMmaMaxM, or VLLM_KBIT_MMA_MAX_M (read once; <= 2 turns the path off).
int64_t mma_max_m();
// The MoE path VLLM_KBIT_MOE_PATH forces, as the id kbit::_moe_path_id gives its name (0: auto, unset).
int64_t moe_path_override_id();

// The path kbit::linear takes for M rows of x (dtype) and an [N, K] weight on a GPU of compute
// capability major sm_major.
LinearPath linear_path(int64_t M, int64_t N, int64_t K, at::ScalarType dtype, int64_t sm_major);

struct LinearPlan {
  LinearPath path;
  int64_t splits;      // K splits per n-tile (GEMV) or CTA column (MMA); 1 for the other paths
  int64_t max_splits;  // the most splits the kernel accepts for this weight (forced splits)
  int64_t p, r, m_blocks;  // the MMA tile shape (mma.cuh: MmaConfig); 0 for the other paths
};

// The plan of kbit::linear (path "auto") or of one forced kernel, on a GPU with num_sms SMs each
// holding ctas_per_sm CTAs of the MMA instance (its occupancy; the launcher queries it).
LinearPlan linear_plan(int64_t M, int64_t N, int64_t K, at::ScalarType dtype, int64_t sm_major, int64_t num_sms,
                       int64_t ctas_per_sm, const std::string& path);

// ----------------------------------------------------------------------------- routed experts (MoE)

// kGemvDirect: the grouped GEMV without routing (one chunk per slot) and with the combine folded into
// the down projection: two launches in all (moe_ops.cpp).
enum class MoePath : int64_t { kAuto = 0, kGemv = 1, kGroupedMm = 2, kGroupedMma = 3, kGemvDirect = 4 };

constexpr int64_t kMaxLocalExperts = 4096;  // the routing kernel's shared-memory counters (2 ints each)

const char* moe_path_name(MoePath path);
// "auto", "gemv", "grouped_mm", "grouped_mma" or "gemv_direct"; anything else raises a one-line ValueError.
MoePath moe_path_from_name(const std::string& name);
// The path of an id kbit::_moe_path_id returned (kernels take ids: a `str` argument of a C++ kernel
// brings libstdc++ stream code into the extension through torch's argument unboxing).
MoePath moe_path_from_id(int64_t id);

struct MoePlan {
  MoePath path;          // never kAuto
  int64_t chunk_rows;    // rows of one expert one CTA multiplies (the routing's chunk height)
  int64_t max_chunks;    // chunk rows the routing allocates (its workspace), bounded by slots; gemv_direct:
                         // the CTA rows of its grid, one per slot (no routing)
};

// The plan of kbit::fused_moe for T tokens with top_k picks each over E local experts of k-bit
// weights ("auto" or a forced path).
MoePlan moe_plan(int64_t tokens, int64_t top_k, int64_t experts, int64_t bits, MoePath path);

}  // namespace kbit
