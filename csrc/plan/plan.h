// The planner: every choice of which kernel runs and how, in one place. From the shapes of a call and
// the facts of the GPU (queried once per device: SM count, compute capability, and per MMA instance its
// occupancy and cluster capacity), it decides the dense linear's path, the MMA tile shape (p, r), the
// K splits of the GEMV and MMA kernels, every kernel's grid, the GEMV decode, the wgmma_ws producers,
// programmatic dependent launch, the routed experts' path (fp32: the reference), their projections' kernel
// (rs or ws for the grouped wgmma), chunk height, chunk counts and each projection's splits / row groups.
// Launchers take a plan and decide nothing (they validate it and record what they launched).
// kbit::linear_plan and kbit::moe_plan expose the plans (csrc/ops/dispatch.cpp); the measurements behind
// every bound and rule are in docs/decisions.md. Host C++ only: no tensors, no kernel symbols (the MMA
// instance facts come from the MMA launcher, mma.cu).
#pragma once

#include <cstdint>
#include <string>

#include <c10/core/ScalarType.h>

namespace kbit {

// ----------------------------------------------------------------------------- kernel limits

constexpr int kGemvMaxM = 4;        // rows of A one GEMV launch handles
constexpr int kGemvWarps = 4;       // warps of one GEMV CTA (gemv_core.cuh: kWarps; gemv.cu asserts they agree)
constexpr int kGemvMaxSplits = 8;   // portable thread-block cluster size: split-K partners of one n-tile
constexpr int kMmaMaxSplits = 8;    // portable thread-block cluster size: split-K partners of one column
constexpr int kMmaMaxRowTiles = 8;  // n8 activation tiles per CTA: one CTA covers at most 64 rows of A
constexpr int kMmaWideTiles = 128;  // runtime n-tiles from which warps take wide row groups (mma_config)
constexpr int kMmaWideMinRowTiles = 4;  // ... and activation tiles per CTA (p) from which they do
constexpr int kMoeChunkRows = 4;      // most rows of one expert a grouped-GEMV CTA multiplies (the GEMV's M)
constexpr int kMoeWsChunkRows = 256;  // rows of one chunk of the grouped wgmma (wgmma_ws.cu: a CTA's 256 rows of A)
constexpr int kMoeRsChunkRows = 128;  // ... of its register-operand kernel (wgmma.cu: a CTA's 128 rows, the widest N)
constexpr int64_t kMaxLocalExperts = 4096;  // the routing kernel's shared-memory counters (2 ints each)
constexpr int kWgmmaWsTileN = 2;  // runtime n-tiles of one warp-specialized wgmma CTA (wgmma_ws.cu: kWeightRows)
constexpr int kWgmmaWsMaxSplits = 8;  // K splits of one dense warp-specialized CTA column (a cluster of that many)
// Dense launches of the register-operand wgmma with at most this many rows of x run its narrow instance (wgmma.cu).
constexpr int64_t kRsNarrowRows = 64;
constexpr bool wgmma_rs_narrow(bool grouped, int64_t rows) { return !grouped && rows <= kRsNarrowRows; }
// Warpgroups of one register-operand wgmma CTA, one runtime n-tile each (wgmma.cu: kWarpGroupsOf): three in the
// grouped kernel, four in the dense narrow instance (M <= 64: 128 registers, one wave of 4-tile CTAs), both of which
// decode through the table at every k, two in the dense one.
constexpr int wgmma_rs_warpgroups(bool grouped, bool narrow) {
  return grouped ? 3 : narrow ? 4 : 2;
}

// The (p, r) MMA instances built for every k, dtype and launch kind (dense and grouped): narrow warps
// (r = 1) at every p, wide ones (4 row groups; 2 at p = 8, where the accumulators fill the registers).
// The one list the launchers, the facts queries and mma_built expand: X(P, R) per instance.
#define KBIT_MMA_INSTANCES(X) X(1, 1) X(1, 4) X(2, 1) X(2, 4) X(3, 1) X(3, 4) X(4, 1) X(4, 4) X(8, 1) X(8, 2)
// Chunk heights (rows of one expert per CTA row, 8p) the grouped MMA is built for.
constexpr int64_t kMmaGroupedChunkRows[] = {8, 16, 24, 32, 64};
constexpr bool mma_grouped_chunk_rows(int64_t rows) {
  for (const int64_t r : kMmaGroupedChunkRows) {
    if (r == rows) return true;
  }
  return false;
}
// The same heights for messages: "8, 16, 24, 32 or 64".
std::string mma_grouped_chunk_rows_text();

// Whether a kernel is built for p activation tiles and r row groups (KBIT_MMA_INSTANCES).
bool mma_built(int p, int r);

// ----------------------------------------------------------------------------- device facts

// What the rules need to know about the GPU. On a GPU (device >= 0) the planner queries the MMA
// instance facts of the instance it picks; off the GPU (device = -1, kbit::linear_plan's given facts)
// every instance holds ctas_per_sm CTAs per SM and cluster capacities are unknown.
struct DeviceFacts {
  int64_t num_sms = 0;
  int64_t sm_major = 0;
  int device = -1;
  int64_t ctas_per_sm = 1;  // device = -1 only
  // SMs that clusters of s CTAs (s = 1..kGemvMaxSplits; index 0 unused) fill at one CTA per SM: a cluster sits in
  // one GPC, so from s = 3 on some SMs of each GPC stay out of reach (0 = unknown: num_sms).
  int64_t cluster_sms[kGemvMaxSplits + 1] = {};
};

// The facts of a GPU, queried once per device (thread-safe).
DeviceFacts device_facts(int device);
// Defined by the GEMV launcher (gemv.cu, which has a kernel to ask about): DeviceFacts::cluster_sms for clusters of
// s on `device`, from the driver's cluster occupancy (cudaOccupancyMaxActiveClusters) of a one-CTA-per-SM launch.
int64_t cluster_sms_of(int s, int device);
// Facts given by the caller (what-if plans, property tests; no GPU needed).
DeviceFacts given_facts(int64_t sm_major, int64_t num_sms, int64_t ctas_per_sm);

// Per MMA instance and device: CTAs one SM holds (cudaOccupancyMaxActiveBlocksPerMultiprocessor) and,
// for dense instances, the CTAs the GPU holds at once in clusters of s along x for s = 1..kMmaMaxSplits
// (cudaOccupancyMaxActiveClusters x s; index 0 unused, 0 = unknown).
struct MmaInstanceFacts {
  int64_t ctas_per_sm = 1;
  int64_t cluster_ctas[kMmaMaxSplits + 1] = {};
};
// Defined by the MMA launcher (mma.cu, which has the kernel symbols): prepares the instance on the device
// once (shared-memory opt-in) and queries its facts once; later calls read the cache.
MmaInstanceFacts mma_instance_facts(int bits, int p, int r, bool grouped, bool bf16, int device);
// CTAs an SM holds of the instance by its launch bounds and shared memory (compile time; mma.cu).
int mma_resident_ctas(int bits, int p, int r);

// ----------------------------------------------------------------------------- rules

// Tile shape of one MMA launch: `p` n8 tiles of activation rows per CTA (8p rows), `r` 16-row groups of
// weight rows per warp (a CTA of 4 warps covers 64r weight rows = r runtime n-tiles), and the number
// of CTA rows along M.
struct MmaConfig {
  int p;
  int r;
  int m_blocks;
};

// The tile shape for M activation rows and n_tiles runtime n-tiles (r forced when row_groups > 0).
MmaConfig mma_config(int64_t M, int64_t n_tiles, int64_t row_groups = 0);

// Row groups per warp of the grouped (routed-expert) kernel for p activation tiles and an expert's
// n_tiles x k_tiles of k-bit weights, with expected_chunks CTA rows (moe_expected_chunks) on num_sms
// SMs: 4 (2 at p = 8, where the accumulators fill the registers); 1 for experts under 4 n-tiles, and
// at k = 4, p = 1 on long experts where the wide grid would end in a mostly empty wave.
int mma_grouped_r(int p, int64_t n_tiles, int64_t k_tiles, int bits, int64_t expected_chunks, int64_t num_sms);

// K splits (CTAs of one cluster per CTA column) for cols x m_blocks CTA tiles over k_tiles, on num_sms
// SMs holding ctas_per_sm CTAs each; split_cost weighs each further split's fixed cost (pipeline fill,
// cluster reduction) per CTA slot. cluster_ctas, when given, holds for every split count s in
// 1..kMmaMaxSplits the CTAs that fit on the GPU at once in clusters of s (MmaInstanceFacts): a grid past
// it runs a further wave. Always in [1, min(kMmaMaxSplits, k_tiles)], so with the balanced partition
// [s*k_tiles/S, (s+1)*k_tiles/S) every split owns at least one k-tile.
int mma_splits(int64_t cols, int64_t m_blocks, int64_t k_tiles, int64_t num_sms, int64_t ctas_per_sm,
               int64_t split_cost, const int64_t* cluster_ctas = nullptr);

// split_cost of the two launch kinds. Grouped (routed-expert) CTAs are short (an expert's K) and every
// further split repeats the table fill and pipeline fill of a whole 64r-row tile and adds a cluster
// reduction of it, so splits cost far more there than the dense kernel's model assumes; both values
// measured with benchmarks/sweep_plan.py dense_splits and moe_grid (docs/decisions.md, "Grouped MMA grid" and "Dense MMA split
// count by cluster waves").
constexpr int kMmaSplitCostDense = 2;
constexpr int kMmaSplitCostGrouped = 16;

// Number of K splits (CTAs of one cluster per 64-row n-tile) of the GEMV for a grid of n_tiles x k_tiles
// runtime tiles on num_sms SMs, of which clusters of s reach cluster_sms[s] (DeviceFacts::cluster_sms; null or
// 0: all). Always in [1, min(kGemvMaxSplits, k_tiles)].
int gemv_splits(int64_t n_tiles, int64_t k_tiles, int64_t num_sms, const int64_t* cluster_sms = nullptr);

// How many of the 4 blocks of each k-tile a GEMV kernel (dense, or grouped over routed experts, with up to
// `rows` activation rows) decodes through a shared-memory table of codebook pairs (k = 3, 4) or quads
// (k = 2) filled per CTA; the other blocks take one register shuffle per weight (k = 5 always; k = 2 in a one-row
// kernel uses register tables of partial sums instead). Shuffles load the MIO pipe, table offsets and
// widening the ALU, so a mix can beat either alone. VLLM_KBIT_GEMV_DECODE forces "shuffle" (0),
// "table" (4) or "mixed" (kGemvMixedTableBlocks for the dense GEMV at one row, 4 elsewhere).
constexpr int kGemvMixedTableBlocks = 3;
// Whether a GEMV kernel of k bits and up to `rows` rows can take the table at all (the launchers build
// table instances only where it can).
constexpr bool gemv_table_possible(int64_t bits, int64_t rows) {
  return bits >= 2 && bits <= 4 && !(bits == 2 && rows == 1);
}
int gemv_table_blocks(int64_t bits, int64_t rows, bool grouped);

// Whether the kernels launched through launch_kernel (launch_utils.cuh: the GEMV, MMA and routing kernels) carry
// the programmatic-dependent-launch attribute on a GPU of compute capability major sm_major: from sm_90 on,
// unless VLLM_KBIT_PDL=0. The wgmma kernels, the dequantize kernel and cuBLAS launch without it.
bool pdl_rule(int64_t sm_major);

// Rows per chunk of the grouped GEMV for T tokens: 1 for T = 1 (a one-row kernel, fewer registers), else
// kMoeChunkRows.
int64_t moe_chunk_rows(int64_t tokens);

// Rows per chunk of the grouped MMA (the CTA height 8p: 8, 16, 32 or 64) for S slots over E experts of
// k-bit weights.
int64_t moe_mma_chunk_rows(int64_t slots, int64_t experts, int bits);

// Upper bound on the number of chunks (<= R rows of one expert) S slots over E experts can
// need: sum_e ceil(c_e / R) <= (S + (R - 1) * min(E, S)) / R, and never more than S.
int64_t moe_max_chunks(int64_t slots, int64_t experts, int64_t chunk_rows);

// The chunks a typical routing needs: each expert's count of S slots taken as Poisson(S / E), the
// expected sum_e ceil(c_e / R) = E * sum_j P(c > jR), rounded up and at most moe_max_chunks. Sizes the
// grouped MMA's row groups and split count (the grid itself is sized for moe_max_chunks).
int64_t moe_expected_chunks(int64_t slots, int64_t experts, int64_t chunk_rows);

// ----------------------------------------------------------------------------- input rotation

// How a rotated layer's input x R (docs/format.md, section 9; the caller gives the signs and block) reaches its
// kernel: kNone, not rotated; kSeparate, the rotation kernel (csrc/rotate/rotate.cu) writes x R into a scratch
// tensor before the GEMM (MoE: the hidden states once before gate_up; SiLU-and-mul's output in place before down);
// kFused, the GEMV kernel rotates the activations as it loads them (gemv_core.cuh, accumulate; no launch, no pass).
enum class InputRotation : int64_t { kNone = 0, kSeparate = 1, kFused = 2 };
// "none", "separate", "fused".
const char* input_rotation_name(InputRotation rotation);
// The blocks the GEMV kernels rotate in their activation load: powers of two in this range (csrc/rotate/
// rotate_core.cuh: up to 128 inside one k-tile, above it mixed over b / 128 k-tiles; b = 2 would split a register
// pair).
constexpr int64_t kFusedRotationMinBlock = 4;
constexpr int64_t kFusedRotationMaxBlock = 1024;
constexpr bool fused_rotation_block(int64_t block) {
  return block >= kFusedRotationMinBlock && block <= kFusedRotationMaxBlock && (block & (block - 1)) == 0;
}
// The rule for a layer input of rotation block rot_block (0: not rotated) read by a GEMV kernel (`gemv`: the dense
// GEMV, the routed-expert GEMVs) or another: none without a rotation, fused where a GEMV takes the block, separate
// elsewhere (the MMA and wgmma kernels, dequantize + cuBLAS: prefill-sized calls, where one pass costs little).
InputRotation input_rotation(int64_t rot_block, bool gemv);

// ----------------------------------------------------------------------------- dense linear

enum class LinearPath { kGemv, kMma, kWgmma, kWgmmaWs, kDequantCublas };

// "gemv", "mma", "wgmma", "wgmma_ws", "dequant_cublas".
const char* linear_path_name(LinearPath path);

// The largest M of the MMA path: kMmaMaxM, or VLLM_KBIT_MMA_MAX_M (read once; <= 2 turns the path off).
int64_t mma_max_m();

// The path kbit::linear takes for M rows of x (dtype) and an [N, K] weight of k-bit codes (bits; 0: not named,
// planned as k <= 4) on a GPU of compute capability major sm_major.
LinearPath linear_path(int64_t M, int64_t N, int64_t K, at::ScalarType dtype, int64_t bits, int64_t sm_major);

struct LinearPlan {
  LinearPath path;
  int64_t splits = 1;        // K splits per n-tile (GEMV) or CTA column (MMA, wgmma_ws); 1 for the other paths
  int64_t max_splits = 1;    // the most splits the kernel accepts for this weight
  int64_t p = 0, r = 0;      // the MMA tile shape (MmaConfig); 0 for the other paths
  int64_t m_blocks = 0;      // CTA rows of the kernel's grid (its y); 0 for dequant_cublas
  int64_t cols = 0;          // CTA columns per K split (the grid's x / splits); 0 for dequant_cublas
  int64_t producers = 0;     // wgmma_ws: producer warpgroups (ws_producers); 0 for the other paths
  int64_t table_blocks = 0;  // GEMV: blocks of each k-tile decoded through the table (gemv_table_blocks); else 0
  bool pdl = false;          // launched as a programmatic dependent (pdl_rule; the GEMV and MMA kernels only)
  InputRotation rotation = InputRotation::kNone;  // how a rotated layer's x R is made (input_rotation)
};

// -1 for "auto", else the id (LinearPath) of a linear_path_name; anything else raises a one-line ValueError.
// Kernels take ids (a `str` argument of a C++ kernel brings libstdc++ stream code into the extension
// through torch's argument unboxing); kbit::_linear_path_id gives them to Python.
int64_t linear_path_id(const std::string& name);

// What a caller forces instead of the rules (kbit::_linear_forced, sweeps); -1 / 0: the rule. Aggregate-
// initialized in this field order (the ops' argument order).
struct LinearForced {
  int64_t path = -1;        // -1 (auto) or a LinearPath
  int64_t row_groups = 0;   // MMA r
  int64_t splits = 0;       // GEMV / MMA K splits
  int64_t producers = 0;    // wgmma_ws producer warpgroups
};

// Producer warpgroups of the warp-specialized wgmma kernel (wgmma_ws.cu) for k-bit weights: two (alternate
// k-tiles, setmaxnreg moves registers to the consumers) for k = 2..4, one for k = 5, whose shuffle decode
// needs the registers a second one would take; VLLM_KBIT_WS_PRODUCERS=1 or `forced` (> 0) picks one.
// Raises a one-line ValueError for a forced count the kernel is not built with.
int64_t ws_producers(int64_t bits, int64_t forced = 0);
// Whether the grouped_wgmma MoE path runs the register-operand kernel (wgmma.cu, 128-row chunks, the wgmma N
// fitted to each chunk) instead of the warp-specialized one (wgmma_ws.cu, 256-row chunks) for `slots` routed
// rows over `experts` at k = `bits`: VLLM_KBIT_MOE_WGMMA=rs|ws when set, else the rule (plan.cpp,
// rs_max_slots_per_expert); a forced producer count (ws only) picks ws.
bool moe_wgmma_rs(int64_t slots, int64_t experts, int64_t bits, int64_t forced_producers = 0);

// The plan of kbit::linear for M rows of x (dtype) and an [N, K] weight of k-bit codes on the GPU the
// facts describe, rot_block: the block of the layer's input rotation (0: none): exactly what launches. Raises a
// one-line ValueError for what no kernel serves.
LinearPlan linear_plan(int64_t M, int64_t N, int64_t K, at::ScalarType dtype, int64_t bits, const DeviceFacts& facts,
                       const LinearForced& forced = {}, int64_t rot_block = 0);

// ----------------------------------------------------------------------------- routed experts (MoE)

// kGemvDirect: the grouped GEMV without routing (one chunk per slot) and with the combine folded into
// the down projection: two launches in all (moe_ops.cpp). kGroupedWgmma: the warp-specialized dequant +
// wgmma kernel over chunks of up to kMoeWsChunkRows rows (Hopper only).
// kReference: activations no kernel takes (fp32): kbit::fused_moe runs its PyTorch implementation
// (vllm_kbit/moe.py asks the plan); the planner picks it by dtype, no caller forces it.
enum class MoePath : int64_t {
  kAuto = 0, kGemv = 1, kGroupedMm = 2, kGroupedMma = 3, kGemvDirect = 4, kGroupedWgmma = 5, kReference = 6
};

const char* moe_path_name(MoePath path);
// "auto", "gemv", "grouped_mm", "grouped_mma", "gemv_direct" or "grouped_wgmma" (the paths a caller may force);
// anything else raises a one-line ValueError.
MoePath moe_path_from_name(const std::string& name);
// The path of an id kbit::_moe_path_id returned (kernels take ids: a `str` argument of a C++ kernel
// brings libstdc++ stream code into the extension through torch's argument unboxing).
MoePath moe_path_from_id(int64_t id);
// The MoE path VLLM_KBIT_MOE_PATH forces, as its id (0: auto, unset).
int64_t moe_path_override_id();

// The kernel of each projection of a MoE plan, named as the launchers record it (kbit::_launch_record):
// "none" (the reference path: nothing launches), "moe_gemv_direct", "moe_gemv", "mma_grouped", "wgmma_rs_grouped"
// (register operand, wgmma.cu), "wgmma_ws_grouped" (warp-specialized, wgmma_ws.cu) or "grouped_mm".
enum class MoeKernel : int64_t {
  kNone = 0, kGemvDirect = 1, kGemv = 2, kMmaGrouped = 3, kWgmmaRsGrouped = 4, kWgmmaWsGrouped = 5, kGroupedMm = 6
};
const char* moe_kernel_name(MoeKernel kernel);
// The kernel of a name moe_kernel_name gives (not "none"); anything else raises a one-line ValueError.
MoeKernel moe_kernel_from_name(const std::string& name);
MoeKernel moe_kernel_from_id(int64_t id);

// One projection of a grouped launch: its kernel's grid (m_blocks CTA rows: one per chunk, or per slot for the
// direct GEMV; cols CTA columns per K split), the GEMV's K splits and decode, the grouped MMA's tile (p, r)
// and K splits, the grouped wgmma's producer warpgroups (warp-specialized kernel), and whether the kernel
// launches as a programmatic dependent; 0 where a field does not apply or is not planned.
struct MoeProjPlan {
  int64_t splits = 0;
  int64_t p = 0, r = 0, m_blocks = 0;
  int64_t producers = 0;
  int64_t cols = 0;
  int64_t table_blocks = 0;  // grouped GEMV: blocks of each k-tile decoded through the table (gemv_table_blocks)
  bool pdl = false;
  InputRotation rotation = InputRotation::kNone;  // how a rotated projection's input is made (input_rotation)
};

// What a caller forces instead of the rules (kbit::_fused_moe_cuda, kbit::moe_plan.device, sweeps); 0: the
// rule. Splits apply to the GEMV paths and the grouped MMA, row groups to the grouped MMA, producers to the
// grouped wgmma; anything forced where it does not apply raises a one-line ValueError. Aggregate-initialized
// in this field order (the ops' argument order).
struct MoeForced {
  MoePath path = MoePath::kAuto;
  int64_t gate_up_splits = 0, down_splits = 0;
  int64_t gate_up_row_groups = 0, down_row_groups = 0;
  int64_t producers = 0;
};

struct MoePlan {
  MoePath path;             // never kAuto
  MoeKernel kernel;         // what each projection launches (kNone for the reference)
  bool pdl;                 // the routing, gather, SiLU and combine kernels launch as programmatic dependents
  int64_t chunk_rows;       // rows of one expert one CTA multiplies (the routing's chunk height)
  int64_t max_chunks;       // chunk rows the routing allocates (its workspace), bounded by slots; gemv_direct:
                            // the CTA rows of its grid, one per slot (no routing)
  int64_t expected_chunks;  // grouped MMA: the chunks a typical routing fills (what r and splits are planned for)
  MoeProjPlan gate_up, down;  // planned when the hidden and intermediate sizes are given (> 0)
};

// The plan of kbit::fused_moe for T tokens with top_k picks each over E local experts of k-bit weights
// (the rules, or what `forced` fixes), hidden size H and intermediate size I (0: the projections are not
// planned), on the GPU the facts describe (auto takes the grouped wgmma on Hopper only: facts.sm_major == 9),
// for activations of `dtype` (fp32: the reference path, whatever is forced). gate_up_rot_block / down_rot_block:
// the blocks of the experts' rotation of the hidden states / of the SiLU-and-mul output (0: none). The GEMV paths
// rotate the down input in their activation load (input_rotation: fused) for the blocks they take; a separate rotation of
// the down projection's input needs the SiLU-and-mul as its own kernel, which the GEMV paths fold into their down
// projection: for a block they do not fuse, auto takes the grouped MMA instead of the direct GEMV and a forced GEMV
// path is refused. The hidden states (gate_up's input) are rotated separately on every path: once per layer, where
// a fusing GEMV would rotate each token's row in each of its slots' n-tile CTAs.
MoePlan moe_plan(int64_t tokens, int64_t top_k, int64_t experts, int64_t bits, const MoeForced& forced,
                 int64_t hidden = 0, int64_t intermediate = 0, const DeviceFacts& facts = {},
                 at::ScalarType dtype = at::kBFloat16, int64_t gate_up_rot_block = 0, int64_t down_rot_block = 0);

// The plan of one grouped projection of an expert's [N, K] weights (n_tiles x k_tiles at k bits) by `kernel`
// over `rows` rows of A (the slots) grouped into chunks of chunk_rows over `experts` experts, in a grid of
// grid_rows CTA rows; row_groups / splits / producers force r / the split count / the producer warpgroups
// (0: the rules; refused where the kernel has no such field). moe_plan plans both projections with it, and
// kbit::_moe_grouped_linear its one.
MoeProjPlan moe_proj_plan(MoeKernel kernel, int64_t rows, int64_t experts, int64_t chunk_rows, int64_t grid_rows,
                          int64_t n_tiles, int64_t k_tiles, int64_t bits, const DeviceFacts& facts,
                          int64_t row_groups = 0, int64_t splits = 0, int64_t producers = 0);

// ----------------------------------------------------------------------------- what launched

// The launchers record every launch they make here (kernel name and the plan fields they launched
// with), a small per-thread ring with no allocation and no sync, so tests can compare plans with
// launches (kbit::_launch_record).
struct LaunchRecord {
  const char* kernel;
  int64_t p = 0, r = 0, m_blocks = 0, cols = 0, splits = 0, producers = 0, table_blocks = 0;
  bool pdl = false;
  // fused: the kernel rotated its input as it loaded it; separate: the rotation kernel's own launch; else none.
  InputRotation rotation = InputRotation::kNone;
};
// Each launcher records the values it launched with (its grid, kernel instance and launch attributes), not
// its plan's fields, so that the comparison tests the launch.
void record_launch(const LaunchRecord& record);
// The launches recorded on this thread since the last call, oldest first (at most kLaunchRecords).
constexpr int kLaunchRecords = 16;
int take_launch_records(LaunchRecord* out);

}  // namespace kbit
