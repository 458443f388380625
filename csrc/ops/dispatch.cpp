// The planner's ops (csrc/plan/plan.h): kbit::linear_plan and kbit::moe_plan, on given device facts (host C++
// only, so they run anywhere the extension loads, GPU or not) or on a GPU (the .device overloads: exactly
// what kbit::linear and kbit::fused_moe launch there), the rules behind them for the property tests, and
// kbit::_launch_record, what the launchers launched.
#include "plan.h"

#include <optional>
#include <tuple>
#include <vector>

#include <ATen/core/List.h>

#include <c10/cuda/CUDAFunctions.h>
#include <torch/library.h>

#include "check.h"
#include "format_constants.h"

namespace kbit {
namespace {

using LinearPlanTuple = std::tuple<std::string, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                   bool, std::string>;

LinearPlanTuple as_tuple(const LinearPlan& p) {
  return {linear_path_name(p.path), p.splits, p.max_splits, p.p, p.r, p.m_blocks, p.cols, p.producers, p.table_blocks,
          p.pdl, input_rotation_name(p.rotation)};
}

void check_plan_bits(int64_t bits, bool zero_ok) {
  KBIT_CHECK_VALUE((zero_ok && bits == 0) || (bits >= kMinBits && bits <= kMaxBits), "kbit linear_plan: k=", bits,
                   " is not supported; supported: ", zero_ok ? "0 (not named), " : "", kMinBits, "..", kMaxBits);
}

// Given facts: every MMA instance holds ctas_per_sm CTAs per SM, cluster capacities unknown; bits 0: not named
// (planned as k <= 4, GEMV decode by shuffle).
LinearPlanTuple linear_plan_op(int64_t M, int64_t N, int64_t K, at::ScalarType dtype, int64_t sm_major, int64_t num_sms,
                               int64_t ctas_per_sm, const std::string& path, int64_t bits, int64_t rot_block) {
  check_plan_bits(bits, true);
  const LinearForced forced{linear_path_id(path)};
  return as_tuple(linear_plan(M, N, K, dtype, bits, given_facts(sm_major, num_sms, ctas_per_sm), forced, rot_block));
}

int gpu_index(const c10::Device& device, const char* op) {
  KBIT_CHECK_VALUE(device.is_cuda(), "kbit ", op, ": device must be a CUDA device, got ", device.str());
  return device.has_index() ? device.index() : c10::cuda::current_device();
}

// On a GPU: what kbit::linear launches for k-bit weights there (row_groups / splits / producers: forced, 0:
// the rules).
LinearPlanTuple linear_plan_device_op(int64_t M, int64_t N, int64_t K, at::ScalarType dtype, int64_t bits,
                                      const c10::Device& device, const std::string& path, int64_t row_groups,
                                      int64_t splits, int64_t producers, int64_t rot_block) {
  check_plan_bits(bits, false);
  const LinearForced forced{linear_path_id(path), row_groups, splits, producers};
  return as_tuple(linear_plan(M, N, K, dtype, bits, device_facts(gpu_index(device, "linear_plan")), forced, rot_block));
}

at::ScalarType moe_dtype(const std::optional<at::ScalarType>& dtype) { return dtype.value_or(at::kBFloat16); }

// On a GPU of compute capability major sm_major (the auto path depends on it: Hopper has the grouped wgmma),
// for activations of dtype (default bf16; fp32: the reference).
std::tuple<std::string, std::string, int64_t, int64_t, int64_t, bool> moe_plan_op(
    int64_t tokens, int64_t top_k, int64_t experts, int64_t bits, const std::string& path, int64_t sm_major,
    const std::optional<at::ScalarType>& dtype, int64_t gate_up_rot_block, int64_t down_rot_block) {
  DeviceFacts facts;
  facts.sm_major = sm_major;
  const MoeForced forced{moe_path_from_name(path)};
  const MoePlan p = moe_plan(tokens, top_k, experts, bits, forced, 0, 0, facts, moe_dtype(dtype), gate_up_rot_block,
                             down_rot_block);
  return {moe_path_name(p.path), moe_kernel_name(p.kernel), p.chunk_rows, p.max_chunks, p.expected_chunks, p.pdl};
}

// One projection's fields in the schema's order: splits, p, r, m_blocks, cols, producers, table_blocks, pdl,
// rotation.
using ProjTuple = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, std::string>;
ProjTuple proj_tuple(const MoeProjPlan& p) {
  return {p.splits, p.p, p.r, p.m_blocks, p.cols, p.producers, p.table_blocks, p.pdl, input_rotation_name(p.rotation)};
}

// On a GPU: what kbit::fused_moe launches for hidden size H and intermediate size I there, with the fields
// kbit::_fused_moe_cuda forces (0: the rules); each projection's fields prefixed gate_up_ and down_.
auto moe_plan_device_op(int64_t tokens, int64_t top_k, int64_t experts, int64_t bits, int64_t hidden,
                        int64_t intermediate, const c10::Device& device, const std::string& path,
                        int64_t gate_up_splits, int64_t down_splits, int64_t gate_up_row_groups,
                        int64_t down_row_groups, int64_t producers, const std::optional<at::ScalarType>& dtype,
                        int64_t gate_up_rot_block, int64_t down_rot_block) {
  KBIT_CHECK_VALUE(hidden >= 1 && intermediate >= 1, "kbit moe_plan: hidden and intermediate sizes must be >= 1, got ",
                   hidden, " and ", intermediate);
  const MoeForced forced{moe_path_from_name(path), gate_up_splits, down_splits, gate_up_row_groups, down_row_groups,
                         producers};
  const MoePlan p = moe_plan(tokens, top_k, experts, bits, forced, hidden, intermediate,
                             device_facts(gpu_index(device, "moe_plan")), moe_dtype(dtype), gate_up_rot_block,
                             down_rot_block);
  return std::tuple_cat(std::make_tuple(std::string(moe_path_name(p.path)), std::string(moe_kernel_name(p.kernel)),
                                        p.chunk_rows, p.max_chunks, p.expected_chunks, p.pdl),
                        proj_tuple(p.gate_up), proj_tuple(p.down));
}

// The launches recorded on this thread since the last call (oldest first, at most the last 16), then forgets them.
using LaunchRecordLists =
    std::tuple<std::vector<std::string>, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>,
               std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>,
               c10::List<bool>, std::vector<std::string>>;
LaunchRecordLists launch_record_op() {
  LaunchRecord records[kLaunchRecords];
  const int n = take_launch_records(records);
  LaunchRecordLists out;
  for (int i = 0; i < n; ++i) {
    std::get<0>(out).emplace_back(records[i].kernel);
    std::get<1>(out).push_back(records[i].p);
    std::get<2>(out).push_back(records[i].r);
    std::get<3>(out).push_back(records[i].m_blocks);
    std::get<4>(out).push_back(records[i].cols);
    std::get<5>(out).push_back(records[i].splits);
    std::get<6>(out).push_back(records[i].producers);
    std::get<7>(out).push_back(records[i].table_blocks);
    std::get<8>(out).push_back(records[i].pdl);
    std::get<9>(out).emplace_back(input_rotation_name(records[i].rotation));
  }
  return out;
}

// Whether this GPU's launches carry the programmatic-dependent-launch attribute (plan.h: pdl_rule).
bool pdl_enabled_op() { return pdl_rule(device_facts(c10::cuda::current_device()).sm_major); }

int64_t moe_path_id_op(const std::string& name) { return static_cast<int64_t>(moe_path_from_name(name)); }
int64_t moe_kernel_id_op(const std::string& name) { return static_cast<int64_t>(moe_kernel_from_name(name)); }
int64_t linear_path_id_op(const std::string& name) { return linear_path_id(name); }

// The heuristics divide by the SM count and the chunk height: the ops refuse what they cannot plan for.
void check_num_sms(const char* op, int64_t num_sms) {
  KBIT_CHECK_VALUE(num_sms >= 1, "kbit ", op, ": num_sms must be >= 1, got ", num_sms);
}

// cluster_sms: the SMs clusters of 1..kGemvMaxSplits CTAs reach (DeviceFacts::cluster_sms from index 1; 0: all).
int64_t gemv_splits_op(int64_t n_tiles, int64_t k_tiles, int64_t num_sms, at::OptionalIntArrayRef cluster_sms) {
  check_num_sms("_gemv_splits", num_sms);
  if (!cluster_sms.has_value()) return gemv_splits(n_tiles, k_tiles, num_sms);
  KBIT_CHECK_VALUE(cluster_sms->size() == kGemvMaxSplits, "kbit _gemv_splits: cluster_sms must hold ", kGemvMaxSplits,
                   " SM counts (clusters of 1..", kGemvMaxSplits, " CTAs), got ", cluster_sms->size());
  int64_t reach[kGemvMaxSplits + 1] = {};
  for (int s = 1; s <= kGemvMaxSplits; ++s) {
    reach[s] = (*cluster_sms)[s - 1];
    KBIT_CHECK_VALUE(reach[s] >= 0, "kbit _gemv_splits: cluster_sms must be >= 0 (0: every SM), got ", reach[s]);
  }
  return gemv_splits(n_tiles, k_tiles, num_sms, reach);
}

// The current GPU's DeviceFacts::cluster_sms for clusters of 1..kGemvMaxSplits CTAs.
std::vector<int64_t> cluster_sms_op() {
  const DeviceFacts f = device_facts(c10::cuda::current_device());
  return std::vector<int64_t>(f.cluster_sms + 1, f.cluster_sms + kGemvMaxSplits + 1);
}

int64_t mma_splits_op(int64_t cols, int64_t m_blocks, int64_t k_tiles, int64_t num_sms, int64_t ctas_per_sm,
                      int64_t split_cost) {
  check_num_sms("_mma_splits", num_sms);
  return mma_splits(cols, m_blocks, k_tiles, num_sms, ctas_per_sm, split_cost);
}

int64_t moe_max_chunks_op(int64_t slots, int64_t experts, int64_t chunk_rows) {
  KBIT_CHECK_VALUE(chunk_rows >= 1 && slots >= 0 && experts >= 0, "kbit _moe_max_chunks: needs chunk_rows >= 1 and ",
                   "slots, experts >= 0, got chunk_rows=", chunk_rows, ", slots=", slots, ", experts=", experts);
  return moe_max_chunks(slots, experts, chunk_rows);
}

int64_t mma_split_cost_op(bool grouped) { return grouped ? kMmaSplitCostGrouped : kMmaSplitCostDense; }

int64_t mma_grouped_r_op(int64_t p, int64_t n_tiles, int64_t k_tiles, int64_t bits, int64_t expected_chunks,
                         int64_t num_sms) {
  check_num_sms("_mma_grouped_r", num_sms);
  return mma_grouped_r(static_cast<int>(p), n_tiles, k_tiles, static_cast<int>(bits), expected_chunks, num_sms);
}

}  // namespace
}  // namespace kbit

// Plans as ops (no tensors): what kbit::linear and kbit::fused_moe do for given shapes, for tests,
// benchmarks and anyone asking; on given device facts (any machine) or, the .device overloads, on a GPU
// (its facts queried once: exactly what launches). The heuristics they use are ops too, for the property
// tests: the split counts over arbitrary grids, the grouped MMA's row groups per warp, the routing's
// chunk bounds.
// The plans' returns are named (vllm_kbit.ops.named turns them into a namedtuple): LinearPlan's fields, MoePlan's,
// and each projection's (MoeProjPlan) prefixed gate_up_ and down_.
#define KBIT_LINEAR_PLAN_RETURNS                                                                                \
  "(str path, int splits, int max_splits, int p, int r, int m_blocks, int cols, int producers, int table_blocks, " \
  "bool pdl, str rotation)"
#define KBIT_PROJ_RETURNS(P)                                                                                     \
  "int " P "_splits, int " P "_p, int " P "_r, int " P "_m_blocks, int " P "_cols, int " P "_producers, int " P \
  "_table_blocks, bool " P "_pdl, str " P "_rotation"
TORCH_LIBRARY_FRAGMENT(kbit, m) {
  m.def("linear_plan(int M, int N, int K, ScalarType dtype, int sm_major, int num_sms, int ctas_per_sm=1, "
        "str path=\"auto\", int bits=0, int rot_block=0) -> " KBIT_LINEAR_PLAN_RETURNS,
        &kbit::linear_plan_op);
  m.def("linear_plan.device(int M, int N, int K, ScalarType dtype, int bits, Device device, str path=\"auto\", "
        "int row_groups=0, int splits=0, int producers=0, int rot_block=0) -> " KBIT_LINEAR_PLAN_RETURNS,
        &kbit::linear_plan_device_op);
  m.def("moe_plan(int tokens, int top_k, int experts, int bits, str path=\"auto\", int sm_major=0, "
        "ScalarType? dtype=None, int gate_up_rot_block=0, int down_rot_block=0) -> (str path, str kernel, "
        "int chunk_rows, int max_chunks, int expected_chunks, bool pdl)",
        &kbit::moe_plan_op);
  m.def("moe_plan.device(int tokens, int top_k, int experts, int bits, int hidden, int intermediate, Device device, "
        "str path=\"auto\", int gate_up_splits=0, int down_splits=0, int gate_up_row_groups=0, int down_row_groups=0, "
        "int producers=0, ScalarType? dtype=None, int gate_up_rot_block=0, int down_rot_block=0) -> "
        "(str path, str kernel, int chunk_rows, int max_chunks, "
        "int expected_chunks, bool pdl, " KBIT_PROJ_RETURNS("gate_up") ", " KBIT_PROJ_RETURNS("down") ")",
        &kbit::moe_plan_device_op);
  m.def("_launch_record() -> (str[] kernel, int[] p, int[] r, int[] m_blocks, int[] cols, int[] splits, "
        "int[] producers, int[] table_blocks, bool[] pdl, str[] rotation)",
        &kbit::launch_record_op);
  m.def("_pdl_enabled() -> bool", &kbit::pdl_enabled_op);
  m.def("_moe_kernel_id(str kernel) -> int", &kbit::moe_kernel_id_op);
  m.def("_linear_path_id(str path) -> int", &kbit::linear_path_id_op);
  m.def("_moe_path_id(str path) -> int", &kbit::moe_path_id_op);
  m.def("_moe_path_override() -> int", &kbit::moe_path_override_id);
  m.def("_gemv_splits(int n_tiles, int k_tiles, int num_sms, int[]? cluster_sms=None) -> int", &kbit::gemv_splits_op);
  m.def("_cluster_sms() -> int[]", &kbit::cluster_sms_op);
  m.def("_mma_splits(int cols, int m_blocks, int k_tiles, int num_sms, int ctas_per_sm, int split_cost=1) -> int",
        &kbit::mma_splits_op);
  m.def("_mma_split_cost(bool grouped) -> int", &kbit::mma_split_cost_op);
  m.def("_mma_grouped_r(int p, int n_tiles, int k_tiles, int bits, int expected_chunks, int num_sms) -> int",
        &kbit::mma_grouped_r_op);
  m.def("_moe_max_chunks(int slots, int experts, int chunk_rows) -> int", &kbit::moe_max_chunks_op);
  m.def("_moe_expected_chunks(int slots, int experts, int chunk_rows) -> int", &kbit::moe_expected_chunks);
}
