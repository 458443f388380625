// Dispatch decisions (dispatch.h) and the ops that expose them: kbit::linear_plan, kbit::moe_plan.
// Host C++ only, so the ops run anywhere the extension loads, GPU or not.
#include "dispatch.h"
#include "overrides.h"

#include <algorithm>
#include <iterator>
#include <tuple>

#include <torch/library.h>

#include "check.h"
#include "format_constants.h"
#include "gemv.cuh"
#include "mma.cuh"
#include "moe.cuh"

namespace kbit {
namespace {

// The largest M each path serves (bf16/fp16 x; fp32 x always dequantizes). GEMV for M = 1 only: from
// M = 2 the MMA kernel (whose time is flat up to M = 8, one n8 tile; table decode at k <= 4) is as fast
// or faster on every target shape. Fused dequant + MMA up to kMmaMaxM. Above it, on Hopper, the fused
// dequant + wgmma kernels: the register-fragment one
// (wgmma.cu) up to kWgmmaMaxM on weights of at least kWgmmaMinN rows and kWgmmaMinK columns (one CTA
// per 128 rows: fewer rows leave most SMs idle), the warp-specialized one (wgmma_ws.cu, 256 rows of x
// per CTA) up to kWgmmaWsMaxM on weights of at least kWgmmaWsMinWeight elements; everything else
// dequantize + cuBLAS. docs/decisions.md, "Dense linear layers".
constexpr int64_t kGemvPathMaxM = 1;
constexpr int64_t kMmaMaxM = 64;
constexpr int64_t kWgmmaMaxM = 128;
constexpr int64_t kWgmmaWsMaxM = 512;
constexpr int64_t kWgmmaMinN = 10240;
constexpr int64_t kWgmmaMinK = 2048;
constexpr int64_t kWgmmaWsMinWeight = int64_t{1} << 25;

// MoE path by slots. The GEMV wins only while few experts are touched (its per-byte cost is higher,
// its latency lower), and it runs direct: one CTA row per slot, its expert read from topk_ids, no
// routing kernel, the combine folded into the down projection (two launches instead of four; slots
// that share an expert re-read it, which at <= 16 slots costs less than the routing it saves). Past
// kMmaMaxSlotsPerExpert rows per expert, grouped mm (dequantize + cuBLAS) wins. docs/decisions.md,
// "Three paths, picked by slots per expert" and "Few slots: two launches".
constexpr int64_t kGemvMaxSlots = 16;
constexpr int64_t kMmaMaxSlotsPerExpert = 256;

constexpr const char* kLinearPathNames[] = {"gemv", "mma", "wgmma", "wgmma_ws", "dequant_cublas"};
constexpr const char* kMoePathNames[] = {"auto", "gemv", "grouped_mm", "grouped_mma", "gemv_direct"};

template <size_t N>
std::string joined(const char* const (&names)[N]) {
  std::string s;
  for (size_t i = 0; i < N; ++i) s += (i ? ", " : "") + std::string(names[i]);
  return s;
}

}  // namespace

const char* linear_path_name(LinearPath path) { return kLinearPathNames[static_cast<int>(path)]; }

int64_t mma_max_m() {
  const int64_t forced = overrides::mma_max_m();
  return forced >= 0 ? forced : kMmaMaxM;
}

LinearPath linear_path(int64_t M, int64_t N, int64_t K, at::ScalarType dtype, int64_t sm_major) {
  if (dtype != at::kBFloat16 && dtype != at::kHalf) return LinearPath::kDequantCublas;  // fp32 x
  if (M <= kGemvPathMaxM) return LinearPath::kGemv;
  if (M <= mma_max_m()) return LinearPath::kMma;
  if (M <= kWgmmaWsMaxM && sm_major == 9) {
    if (M <= kWgmmaMaxM && N >= kWgmmaMinN && K >= kWgmmaMinK) return LinearPath::kWgmma;
    if (M > kWgmmaMaxM && N * K >= kWgmmaWsMinWeight) return LinearPath::kWgmmaWs;
  }
  return LinearPath::kDequantCublas;
}

LinearPlan linear_plan(int64_t M, int64_t N, int64_t K, at::ScalarType dtype, int64_t sm_major, int64_t num_sms,
                       int64_t ctas_per_sm, const std::string& path) {
  KBIT_CHECK_VALUE(M >= 1 && N >= 1 && K >= 1 && K % kBlockSize == 0 && num_sms >= 1 && ctas_per_sm >= 1,
                   "kbit linear_plan: needs M, N, num_sms, ctas_per_sm >= 1 and K a positive multiple of ", kBlockSize,
                   ", got M=", M, " N=", N, " K=", K, " num_sms=", num_sms, " ctas_per_sm=", ctas_per_sm);
  LinearPlan plan{linear_path(M, N, K, dtype, sm_major), 1, 1, 0, 0, 0};
  if (path != "auto") {
    const auto* names = std::begin(kLinearPathNames);
    const auto* it = std::find(names, std::end(kLinearPathNames), path);
    KBIT_CHECK_VALUE(it != std::end(kLinearPathNames), "kbit linear_plan: path '", path, "' is not one of auto, ",
                     joined(kLinearPathNames));
    plan.path = static_cast<LinearPath>(it - names);
  }
  const int64_t n_tiles = (N + kTileN - 1) / kTileN, k_tiles = (K / kBlockSize + kTileKB - 1) / kTileKB;
  if (plan.path == LinearPath::kGemv) {
    plan.max_splits = std::min<int64_t>(kGemvMaxSplits, k_tiles);
    plan.splits = gemv_splits(n_tiles, k_tiles, num_sms);
  } else if (plan.path == LinearPath::kMma) {
    const MmaConfig c = mma_config(M, n_tiles);
    plan.p = c.p;
    plan.r = c.r;
    plan.m_blocks = c.m_blocks;
    plan.max_splits = std::min<int64_t>(kMmaMaxSplits, k_tiles);
    // Off the GPU the cluster capacities are unknown: the per-CTA occupancy estimate (a launch on the GPU
    // also counts the waves its clusters take, mma_kernel.cuh: launch_instance).
    plan.splits = mma_splits((n_tiles + c.r - 1) / c.r, c.m_blocks, k_tiles, num_sms, ctas_per_sm, kMmaSplitCostDense);
  }
  return plan;
}

const char* moe_path_name(MoePath path) { return kMoePathNames[static_cast<int>(path)]; }

MoePath moe_path_from_name(const std::string& name) {
  const auto* names = std::begin(kMoePathNames);
  const auto* it = std::find(names, std::end(kMoePathNames), name);
  KBIT_CHECK_VALUE(it != std::end(kMoePathNames), "kbit fused_moe: path '", name, "' is not one of ",
                   joined(kMoePathNames));
  return static_cast<MoePath>(it - names);
}

int64_t moe_path_override_id() {
  const std::string& name = overrides::moe_path();
  if (name.empty()) return static_cast<int64_t>(MoePath::kAuto);
  const auto* names = std::begin(kMoePathNames);
  const auto* it = std::find(names, std::end(kMoePathNames), name);
  KBIT_CHECK_VALUE(it != std::end(kMoePathNames), "kbit: VLLM_KBIT_MOE_PATH=", name, " is not one of ",
                   joined(kMoePathNames));
  return it - names;
}

MoePath moe_path_from_id(int64_t id) {
  KBIT_CHECK_VALUE(id >= 0 && id < static_cast<int64_t>(std::size(kMoePathNames)), "kbit fused_moe: path id ", id,
                   " is not one kbit::_moe_path_id returns");
  return static_cast<MoePath>(id);
}

MoePlan moe_plan(int64_t tokens, int64_t top_k, int64_t experts, int64_t bits, MoePath path) {
  KBIT_CHECK_VALUE(tokens >= 0 && top_k >= 0 && experts >= 1 && experts <= kMaxLocalExperts,
                   "kbit moe_plan: needs tokens, top_k >= 0 and 1..", kMaxLocalExperts, " local experts, got ", tokens,
                   ", ", top_k, " and ", experts);
  KBIT_CHECK_VALUE(bits >= kMinBits && bits <= kMaxBits, "kbit moe_plan: k=", bits, " is not supported; supported: ",
                   kMinBits, "..", kMaxBits);
  const int64_t S = tokens * top_k;
  if (path == MoePath::kAuto) {
    path = S <= kGemvMaxSlots && 2 * S <= experts ? MoePath::kGemvDirect
           : S <= kMmaMaxSlotsPerExpert * experts ? MoePath::kGroupedMma
                                                  : MoePath::kGroupedMm;
  }
  if (path == MoePath::kGemvDirect) return {path, 1, S};  // CTA row s multiplies slot s's row
  if (path == MoePath::kGemv) {
    const int64_t rows = moe_chunk_rows(tokens);
    return {path, rows, moe_max_chunks(S, experts, rows)};
  }
  if (path == MoePath::kGroupedMma) {
    const int64_t rows = moe_mma_chunk_rows(S, experts, static_cast<int>(bits));
    return {path, rows, moe_max_chunks(S, experts, rows)};
  }
  return {path, kMoeChunkRows, 0};  // grouped mm: the routing's offsets only, no chunk list
}

namespace {

std::tuple<std::string, int64_t, int64_t, int64_t, int64_t, int64_t> linear_plan_op(
    int64_t M, int64_t N, int64_t K, at::ScalarType dtype, int64_t sm_major, int64_t num_sms, int64_t ctas_per_sm,
    const std::string& path) {
  const LinearPlan p = linear_plan(M, N, K, dtype, sm_major, num_sms, ctas_per_sm, path);
  return {linear_path_name(p.path), p.splits, p.max_splits, p.p, p.r, p.m_blocks};
}

std::tuple<std::string, int64_t, int64_t> moe_plan_op(int64_t tokens, int64_t top_k, int64_t experts, int64_t bits,
                                                      const std::string& path) {
  const MoePlan p = moe_plan(tokens, top_k, experts, bits, moe_path_from_name(path));
  return {moe_path_name(p.path), p.chunk_rows, p.max_chunks};
}

int64_t moe_path_id_op(const std::string& name) { return static_cast<int64_t>(moe_path_from_name(name)); }

// The heuristics divide by the SM count and the chunk height: the ops refuse what they cannot plan for.
void check_num_sms(const char* op, int64_t num_sms) {
  KBIT_CHECK_VALUE(num_sms >= 1, "kbit ", op, ": num_sms must be >= 1, got ", num_sms);
}

int64_t gemv_splits_op(int64_t n_tiles, int64_t k_tiles, int64_t num_sms) {
  check_num_sms("_gemv_splits", num_sms);
  return gemv_splits(n_tiles, k_tiles, num_sms);
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

// Plans as ops (no tensors, so they run on any device): what kbit::linear and kbit::fused_moe do for
// given shapes, for tests, benchmarks and anyone asking. The heuristics they use are ops too, for the
// property tests: the split counts over arbitrary grids, the MMA tile shape, the grouped MMA's row groups
// per warp, the routing's chunk bound.
TORCH_LIBRARY_FRAGMENT(kbit, m) {
  m.def("linear_plan(int M, int N, int K, ScalarType dtype, int sm_major, int num_sms, int ctas_per_sm=1, "
        "str path=\"auto\") -> (str path, int splits, int max_splits, int p, int r, int m_blocks)",
        &kbit::linear_plan_op);
  m.def("moe_plan(int tokens, int top_k, int experts, int bits, str path=\"auto\") -> (str path, int chunk_rows, int max_chunks)",
        &kbit::moe_plan_op);
  m.def("_moe_path_id(str path) -> int", &kbit::moe_path_id_op);
  m.def("_moe_path_override() -> int", &kbit::moe_path_override_id);
  m.def("_gemv_splits(int n_tiles, int k_tiles, int num_sms) -> int", &kbit::gemv_splits_op);
  m.def("_mma_splits(int cols, int m_blocks, int k_tiles, int num_sms, int ctas_per_sm, int split_cost=1) -> int",
        &kbit::mma_splits_op);
  m.def("_mma_split_cost(bool grouped) -> int", &kbit::mma_split_cost_op);
  m.def("_mma_grouped_r(int p, int n_tiles, int k_tiles, int bits, int expected_chunks, int num_sms) -> int",
        &kbit::mma_grouped_r_op);
  m.def("_moe_max_chunks(int slots, int experts, int chunk_rows) -> int", &kbit::moe_max_chunks_op);
  m.def("_moe_expected_chunks(int slots, int experts, int chunk_rows) -> int", &kbit::moe_expected_chunks);
}
