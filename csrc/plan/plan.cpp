// The planner (plan.h): every rule that picks a kernel, its tile shape, split counts and the MoE routing's
// chunking, and the device facts they read. The measurements behind each bound: docs/decisions.md.
#include "plan.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <iterator>

#include <ATen/cuda/CUDAContext.h>

#include "check.h"
#include "format_constants.h"
#include "overrides.h"

namespace kbit {
namespace {

// The largest M each path serves (bf16/fp16 x; fp32 x always dequantizes). GEMV for M = 1 only: from
// M = 2 the MMA kernel (whose time is flat up to M = 8, one n8 tile; table decode at k <= 4) is as fast
// or faster on every target shape. Fused dequant + MMA up to kMmaMaxM. Above it, on Hopper, the fused
// dequant + wgmma kernels: the register-fragment one
// (wgmma.cu) up to kWgmmaMaxM on weights of at least kWgmmaMinN rows and kWgmmaMinK columns (one CTA
// per 128 rows: fewer rows leave most SMs idle), the warp-specialized one (wgmma_ws.cu, 256 rows of x
// per CTA) up to kWgmmaWsMaxM on weights of at least kWgmmaWsMinWeight elements, and from kMmaMaxM + 1 with K
// split over clusters on long-K weights whose tiles leave SMs idle (ws_rule_splits); everything else
// dequantize + cuBLAS. The warp-specialized kernel also takes M = kWgmmaWsMinM..kMmaMaxM from the MMA
// kernel on those large weights where it runs two producer warpgroups (k <= 4): with 64 rows the MMA
// kernel's mma.sync and per-CTA decode bound it, the wgmma pipeline's do not (k = 5's single producer
// loses there). docs/decisions.md, "Dense linear layers".
constexpr int64_t kGemvPathMaxM = 1;
constexpr int64_t kMmaMaxM = 64;
constexpr int64_t kWgmmaMaxM = 128;
constexpr int64_t kWgmmaWsMaxM = 512;
constexpr int64_t kWgmmaMinN = 10240;
constexpr int64_t kWgmmaMinK = 2048;
constexpr int64_t kWgmmaWsMinWeight = int64_t{1} << 25;
// The first M of the MMA kernel's largest tile (p = kMmaMaxRowTiles n8 tiles): its time steps up there, and only from
// there does the warp-specialized wgmma win (sweep_plan.py dense_paths --paths mma,wgmma_ws).
constexpr int64_t kWgmmaWsMinM = 8 * kMmaMaxRowTiles / 2 + 1;
// The register-operand wgmma's narrow instance (4 warpgroups, table decode: k <= 4) replaces the MMA kernel at M =
// kRsNarrowMinM..kRsNarrowMmaMaxM on Hopper, where the MMA kernel's 32-row tile decodes by shuffle, on weights whose
// 4-tile CTAs fill at least kRsNarrowMinWave of the SMs in their first wave, and the warp-specialized wgmma (or the
// MMA kernel) up to kRsNarrowMaxM where they fill kRsNarrowWsMinWave: wgmma_ws's producers decode with half the warps
// per SM (sweep_plan.py dense_paths --paths wgmma_ws,wgmma,mma). Below that M the MMA kernel's table decode is as fast.
constexpr int64_t kRsNarrowMinM = 17;
constexpr int64_t kRsNarrowMmaMaxM = 32;
constexpr int64_t kRsNarrowMaxM = 64;
static_assert(kRsNarrowMaxM <= kRsNarrowRows, "the narrow instance holds at most kRsNarrowRows rows");
constexpr double kRsNarrowMinWave = 0.75;
constexpr double kRsNarrowWsMinWave = 0.6;
// At M <= kMmaMaxM wgmma_ws (no split of K) beats the MMA kernel only where its 2-tile CTAs fill at least this share
// of the SMs; on weights of few n-tiles and long K (a down projection) the MMA kernel's K splits win.
constexpr double kWgmmaWsMinWave = 0.75;
// Above kMmaMaxM, on weights of at least kWsSplitMinKTiles k-tiles whose warp-specialized CTA tiles leave SMs idle,
// that kernel with K split over clusters of s CTAs per column (ws_rule_splits) beats dequantize + cuBLAS up to
// kWsSplitMaxCublasM rows, and the register-operand or unsplit kernel up to kWgmmaWsMaxM: the s that minimises
// waves(s) x (k_tiles / s + kWsSplitFixedKTiles), a wave being the CTAs clusters of s reach at one per SM, and a
// launch's fill, table and reduction costing about kWsSplitFixedKTiles k-tiles (benchmarks/probes/ws_splits.py;
// docs/decisions.md, "Dense K splits of the warp-specialized wgmma").
constexpr int64_t kWsSplitMinKTiles = 32;
constexpr int64_t kWsSplitMaxCublasM = 256;
constexpr int64_t kWsSplitFixedKTiles = 10;

// MoE path by slots. The GEMV wins only while few experts are touched (its per-byte cost is higher,
// its latency lower), and it runs direct: one CTA row per slot, its expert read from topk_ids, no
// routing kernel, the combine folded into the down projection (two launches instead of four; slots
// that share an expert re-read it, which at <= 16 slots costs less than the routing it saves). Past
// kMmaMaxSlotsPerExpert rows per expert, grouped mm (dequantize + cuBLAS) wins. docs/decisions.md,
// "Three paths, picked by slots per expert" and "Few slots: two launches".
constexpr int64_t kGemvMaxSlots = 16;
constexpr int64_t kMmaMaxSlotsPerExpert = 256;
// On Hopper, from this many slots per expert the grouped wgmma (an expert's weight tile dequantized once per
// chunk of its rows, wgmma at full rate) replaces the grouped MMA and grouped mm: from 32 at k = 3..5, where
// its register-operand kernel decodes through the table with three warpgroups; 48 at k = 2 (its grouped MMA
// still wins at 32..40 on the Qwen3-30B layer).
constexpr int64_t wgmma_min_slots_per_expert(int64_t bits) { return bits == 2 ? 48 : 32; }
// Up to this many slots per expert the grouped wgmma runs its register-operand kernel: one 128-row chunk
// holds a typical expert, decoded once, with a wgmma no wider than its rows; past it, where an expert
// spans two or more such chunks, the warp-specialized kernel's 256-row chunks decode each tile fewer
// times. 128 at k = 3..5; 96 at k = 2, where the warp-specialized kernel already wins at 128.
// docs/decisions.md, "Paths by slots per expert".
constexpr int64_t rs_max_slots_per_expert(int64_t bits) { return bits == 2 ? 96 : 128; }

constexpr int kMaxDevices = 64;  // devices whose facts are cached

constexpr const char* kLinearPathNames[] = {"gemv", "mma", "wgmma", "wgmma_ws", "dequant_cublas"};
constexpr const char* kMoePathNames[] = {"auto", "gemv", "grouped_mm", "grouped_mma", "gemv_direct", "grouped_wgmma",
                                         "reference"};
constexpr int kForcedMoePaths = 6;  // the first ones: a caller may force them (the reference is the dtype's)
constexpr const char* kMoeKernelNames[] = {"none", "moe_gemv_direct", "moe_gemv", "mma_grouped", "wgmma_rs_grouped",
                                           "wgmma_ws_grouped", "grouped_mm"};

template <size_t N>
std::string joined(const char* const (&names)[N], size_t first = 0, size_t count = N) {
  std::string s;
  for (size_t i = first; i < first + count && i < N; ++i) s += (i > first ? ", " : "") + std::string(names[i]);
  return s;
}

int64_t k_tiles_of(int64_t K) { return (K / kBlockSize + kTileKB - 1) / kTileKB; }
int64_t n_tiles_of(int64_t N) { return (N + kTileN - 1) / kTileN; }

// The facts the MMA split rule reads for one instance: queried on a GPU, given off it.
MmaInstanceFacts mma_facts(const DeviceFacts& facts, int64_t bits, int p, int r, bool grouped, bool bf16) {
  if (facts.device >= 0) return mma_instance_facts(static_cast<int>(bits), p, r, grouped, bf16, facts.device);
  MmaInstanceFacts f;
  f.ctas_per_sm = facts.ctas_per_sm;
  return f;
}

// The dense MMA's split count at p >= 4 (more than 24 activation rows) where one exists that puts a CTA on each of
// at least 95% of the SMs, one per SM within the SMs its clusters reach (DeviceFacts::cluster_sms; unknown on given
// facts: 0, none); the largest such count. Measured: a CTA of 32..64 rows streams best alone on its SM; 2-3 CTAs
// sharing one at half the k-tiles each ran 1.1-1.45x slower on 1024..3072 x 4096..8192 weights, the grids mma_splits
// (which counts an SM's slots, not its CTAs) gave; docs/decisions.md, "Dense MMA split count".
int64_t mma_one_wave_splits(int64_t ctas_per_split, int64_t k_tiles, int p, const DeviceFacts& facts) {
  static_assert(kMmaMaxSplits <= kGemvMaxSplits, "cluster_sms covers clusters of up to kGemvMaxSplits CTAs");
  if (p < 4) return 0;
  int64_t best = 0;
  for (int64_t s = 1; s <= std::min<int64_t>(kMmaMaxSplits, k_tiles); ++s) {
    const int64_t ctas = ctas_per_split * s, reach = std::min(facts.num_sms, facts.cluster_sms[s]);
    if (reach > 0 && ctas <= reach && 100 * ctas >= 95 * facts.num_sms) best = s;
  }
  return best;
}

}  // namespace

// ----------------------------------------------------------------------------- device facts

DeviceFacts device_facts(int device) {
  KBIT_CHECK(device >= 0 && device < kMaxDevices, "kbit: device index ", device, " >= ", kMaxDevices);
  static std::atomic<int64_t> num_sms[kMaxDevices] = {}, sm_major[kMaxDevices] = {};
  static std::atomic<int64_t> cluster_sms[kMaxDevices][kGemvMaxSplits + 1] = {};
  int64_t sms = num_sms[device].load(std::memory_order_acquire);
  if (sms == 0) {  // querying twice is harmless
    const cudaDeviceProp* props = at::cuda::getDeviceProperties(device);
    sm_major[device].store(props->major, std::memory_order_relaxed);
    // Thread-block clusters exist from sm_90 on; before, every launch is clusters of one.
    for (int s = 1; s <= kGemvMaxSplits; ++s) {
      cluster_sms[device][s].store(props->major >= 9 ? cluster_sms_of(s, device) : 0, std::memory_order_relaxed);
    }
    sms = props->multiProcessorCount;
    num_sms[device].store(sms, std::memory_order_release);
  }
  DeviceFacts f;
  f.num_sms = sms;
  f.sm_major = sm_major[device].load(std::memory_order_relaxed);
  f.device = device;
  for (int s = 1; s <= kGemvMaxSplits; ++s) f.cluster_sms[s] = cluster_sms[device][s].load(std::memory_order_relaxed);
  return f;
}

DeviceFacts given_facts(int64_t sm_major, int64_t num_sms, int64_t ctas_per_sm) {
  DeviceFacts f;
  f.num_sms = num_sms;
  f.sm_major = sm_major;
  f.ctas_per_sm = ctas_per_sm;
  return f;
}

// ----------------------------------------------------------------------------- rules

bool mma_built(int p, int r) {
#define KBIT_MMA_BUILT(P_, R_) \
  if (p == P_ && r == R_) return true;
  KBIT_MMA_INSTANCES(KBIT_MMA_BUILT)
#undef KBIT_MMA_BUILT
  return false;
}

MmaConfig mma_config(int64_t M, int64_t n_tiles, int64_t row_groups) {
  // p: the fewest built n8 activation tiles covering M (64 rows per CTA at most, more go to grid rows). p = 3
  // (M = 17..24) keeps the table decode of p <= 3 (mma_kernel.cuh: uses_lut), which p = 4 trades for shuffles.
  const int p = M <= 8 ? 1 : M <= 16 ? 2 : M <= 24 ? 3 : M <= 32 ? 4 : kMmaMaxRowTiles;
  const int m_blocks = static_cast<int>((M + 8 * p - 1) / (8 * p));
  // r: wide warps (4 row groups, or 2 at p = 8 where accumulators fill the registers) read each
  // activation fragment from shared memory once per 64 (32) weight rows, which pays from p = 4 on
  // large weights; narrow warps (1) give more, shorter CTAs, which small weights and p <= 2 need
  // (docs/decisions.md, "MMA tile shape").
  int r = static_cast<int>(row_groups);
  if (r == 0) r = n_tiles >= kMmaWideTiles && p >= kMmaWideMinRowTiles ? (p == kMmaMaxRowTiles ? 2 : 4) : 1;
  return {p, r, m_blocks};
}

int mma_grouped_r(int p, int64_t n_tiles, int64_t k_tiles, int bits, int64_t expected_chunks, int64_t num_sms) {
  // Wide warps wherever an expert has the rows for them: all experts' chunks share one launch, so
  // there are CTAs enough either way (unlike a narrow dense weight). At p <= 3 the table-decode
  // instances (mma_kernel.cuh: uses_lut) spread each k-tile's fixed costs (table offsets, scale
  // codes, B fragments) over four row groups; at p = 4 and 8 each activation fragment read from
  // shared memory serves 4 (2) row groups, as on wide dense weights (mma_config).
  if (n_tiles < 4) return 1;
  const int wide = p == kMmaMaxRowTiles ? 2 : 4;
  // Except where the wide grid's last wave would be mostly empty: a wide CTA is four narrow ones'
  // work, so when the expected CTAs run past one wave and leave the last under half full, the
  // narrow grid's quarter-size CTAs even out the SMs' load. Measured to pay at k = 4 with one n8 tile
  // (8-row chunks: a few tokens per expert) and long experts (>= 16 k-tiles); at k = 2 and 3, and on
  // short K, four times the per-CTA table and pipeline fills cost more than the tail
  // (benchmarks/sweep_plan.py moe_grid; docs/decisions.md, "Grouped MMA: narrow warps for light last waves").
  if (bits == 4 && p == 1 && k_tiles >= 16) {
    const int64_t slots = num_sms * mma_resident_ctas(4, 1, 4);
    const int64_t ctas = (n_tiles + wide - 1) / wide * expected_chunks;
    const int64_t tail = ctas % slots;
    if (ctas > slots && tail > 0 && 2 * tail < slots) return 1;
  }
  return wide;
}

int mma_splits(int64_t cols, int64_t m_blocks, int64_t k_tiles, int64_t num_sms, int64_t ctas_per_sm,
               int64_t split_cost, const int64_t* cluster_ctas) {
  // Cost of S splits in quarter k-tiles x ctas_per_sm: the busiest SM's CTA k-tiles shared by its
  // ctas_per_sm slots, but never less than one CTA's own k-tiles (latency), plus a fixed cost per CTA
  // (pipeline fill, epilogue) growing with the cluster reduction (split_cost per split). Smallest wins, ties
  // to fewer splits.
  const int64_t max_splits = std::max<int64_t>(1, std::min<int64_t>(kMmaMaxSplits, k_tiles));
  const int64_t slots = std::max<int64_t>(1, ctas_per_sm);
  int best = 1;
  int64_t best_cost = -1;
  for (int64_t s = 1; s <= max_splits; ++s) {
    const int64_t ctas = cols * m_blocks * s;
    const int64_t per_sm = (ctas + num_sms - 1) / num_sms;  // CTAs on the busiest SM
    const int64_t tiles = (k_tiles + s - 1) / s;            // k-tiles of the largest split
    // With the cluster capacity known, a grid past it runs whole further waves of `slots` CTAs per SM:
    // fewer clusters of s CTAs fit at once than the per-CTA occupancy says (a cluster's CTAs share a GPC).
    const int64_t busy = cluster_ctas != nullptr && cluster_ctas[s] > 0
                             ? std::max(per_sm, slots * ((ctas + cluster_ctas[s] - 1) / cluster_ctas[s]))
                             : std::max(per_sm, slots);
    const int64_t cost = 4 * busy * tiles + slots * (4 + split_cost * s);
    if (best_cost < 0 || cost < best_cost) {
      best = static_cast<int>(s);
      best_cost = cost;
    }
  }
  return best;
}

int gemv_table_blocks(int64_t bits, int64_t rows, bool grouped) {
  if (!gemv_table_possible(bits, rows)) return 0;
  const int mixed = !grouped && rows == 1 ? kGemvMixedTableBlocks : 4;
  const std::string& forced = overrides::gemv_decode();
  if (forced == "shuffle") return 0;
  if (forced == "table") return 4;
  if (forced == "mixed") return mixed;
  // Measured (docs/decisions.md, "GEMV: K splits ... decode by a table"): the dense GEMV at k = 3 decodes all
  // blocks by table, at k = 4 three of four (its table offsets cost two ALU ops, k = 3's one); the grouped
  // GEMV takes the table at k = 3 only (its short CTAs run their code about once, and the table's code is
  // longer); k = 2 was not shown faster.
  if (bits == 2 || (bits == 4 && grouped)) return 0;
  return bits == 4 ? mixed : 4;
}

bool pdl_rule(int64_t sm_major) {
  // Programmatic dependent launch (griddepcontrol) exists from sm_90 on.
  return overrides::pdl() && sm_major >= 9;
}

int gemv_splits(int64_t n_tiles, int64_t k_tiles, int64_t num_sms, const int64_t* cluster_sms) {
  // Cost model: k-tile slots the busiest SM spends (its CTAs times the slowest warp's k-tiles plus
  // kCtaOverhead, times the warps), slowed down when fewer than kStreamingWarps warps per SM have loads
  // in flight. The overhead is what a CTA costs beyond its tiles: its first tile's load, which nothing
  // hides, and the split-K reduction; without it the model split few-row MoE GEMVs 4-8 ways where 1-2
  // run up to 25% faster (benchmarks/sweep_plan.py moe_gemv_splits). A grid in clusters of s spreads over the SMs
  // such clusters reach (from s = 3 on, fewer than the GPU has: the GLM shared-expert gate_up at 4 splits put
  // up to 6 CTAs on an SM where 2 splits run 1.05-1.45x faster; docs/decisions.md). Cost = num / den; the smallest
  // wins, ties to fewer splits.
  constexpr int64_t kWarps = kGemvWarps;
  constexpr int64_t kResidentCtas = 8;      // CTAs of kThreads one SM holds at once (registers)
  constexpr int64_t kStreamingWarps = 16;   // warps per SM that keep enough bytes in flight
  constexpr int64_t kCtaOverhead = 1;       // k-tile slots per CTA beyond its own k-tiles
  const int64_t max_splits = std::max<int64_t>(1, std::min<int64_t>(kGemvMaxSplits, k_tiles));
  int best = 1;
  int64_t best_num = -1, best_den = 1;
  for (int64_t s = 1; s <= max_splits; ++s) {
    const int64_t sms = cluster_sms != nullptr && cluster_sms[s] > 0 ? std::min(num_sms, cluster_sms[s]) : num_sms;
    const int64_t per_sm = (n_tiles * s + sms - 1) / sms;            // CTAs on the busiest SM
    const int64_t tiles = (k_tiles + s - 1) / s;                        // k-tiles of the largest split
    const int64_t warp_iters = (tiles + kWarps - 1) / kWarps;           // its slowest warp's k-tiles
    const int64_t active = std::min<int64_t>(kWarps, tiles);
    const int64_t streaming = std::min(std::min(per_sm, kResidentCtas) * active, kStreamingWarps);
    const int64_t num = per_sm * (warp_iters + kCtaOverhead) * kWarps * kStreamingWarps, den = streaming;
    if (best_num < 0 || num * best_den < best_num * den) {
      best = static_cast<int>(s);
      best_num = num;
      best_den = den;
    }
  }
  return best;
}

int64_t moe_chunk_rows(int64_t tokens) { return tokens == 1 ? 1 : kMoeChunkRows; }

// From the average rows of an expert that got any, avg = ceil(S / min(E, S)). Every chunk decodes its
// expert's weights once, so a height below an expert's rows decodes them again per chunk, and one far
// above multiplies padding MMAs. Heights 8, 16 and 24 (p <= 3) decode through the per-lane table
// (mma_kernel.cuh, uses_lut), which makes them cheap: 16 wins from 8 average rows; from 16 average rows
// (Poisson counts past 16 re-decode a 16-row expert) 24 wins up to 32, and at k = 2, 3 beyond (measured to 64);
// k = 4 past 32 and k = 5 past 8 favour the wider 32 / 64 (k = 5 decodes by shuffle, no table).
// At k = 2 the 8-row table decode is cheap enough that re-decoding beats padding up to 8 average rows.
// Measured per T and k: benchmarks/sweep_plan.py moe_chunk_rows (docs/decisions.md, "Grouped MMA chunk height");
// the 16 -> 24 switch at 12 average rows lies between the measured 8 (16 wins) and 16 (24 wins).
int64_t moe_mma_chunk_rows(int64_t slots, int64_t experts, int bits) {
  const int64_t busy = std::max<int64_t>(1, std::min(experts, slots));
  const int64_t avg = (slots + busy - 1) / busy;
  if (avg <= 4 || (avg <= 8 && bits == 2)) return 8;
  if (bits == 5) return avg <= 8 ? 16 : avg <= 32 ? 32 : 64;
  if (avg <= 12) return 16;
  return avg <= 32 || bits <= 3 ? 24 : 64;
}

int64_t moe_max_chunks(int64_t slots, int64_t experts, int64_t chunk_rows) {
  return std::min(slots, (slots + (chunk_rows - 1) * std::min(experts, slots)) / chunk_rows);
}

int64_t moe_expected_chunks(int64_t slots, int64_t experts, int64_t chunk_rows) {
  if (slots <= 0 || experts <= 0 || chunk_rows <= 0) return 0;
  const double lambda = static_cast<double>(slots) / static_cast<double>(experts);
  double per_expert;
  if (lambda > 64) {
    // Counts near normal and wide against R: c / R's fractional part is close to uniform.
    per_expert = lambda / chunk_rows + 0.5 * (chunk_rows - 1) / chunk_rows;
  } else {
    // sum_j P(c > jR) over the Poisson pmf, by its recurrence, to far past the mean.
    const int64_t c_max = static_cast<int64_t>(lambda + 12 * std::sqrt(lambda) + 12);
    double pmf = std::exp(-lambda), cdf = 0;
    per_expert = 0;
    for (int64_t c = 0; c <= c_max; ++c) {
      cdf += pmf;
      if (c % chunk_rows == 0) per_expert += std::max(0.0, 1.0 - cdf);
      pmf *= lambda / static_cast<double>(c + 1);
    }
  }
  const int64_t expected = static_cast<int64_t>(std::ceil(per_expert * static_cast<double>(experts)));
  return std::max<int64_t>(1, std::min(expected, moe_max_chunks(slots, experts, chunk_rows)));
}

// ----------------------------------------------------------------------------- dense linear

const char* linear_path_name(LinearPath path) { return kLinearPathNames[static_cast<int>(path)]; }

int64_t linear_path_id(const std::string& name) {
  if (name == "auto") return -1;
  const auto* names = std::begin(kLinearPathNames);
  const auto* it = std::find(names, std::end(kLinearPathNames), name);
  KBIT_CHECK_VALUE(it != std::end(kLinearPathNames), "kbit linear_plan: path '", name, "' is not one of auto, ",
                   joined(kLinearPathNames));
  return it - names;
}

int64_t mma_max_m() {
  const int64_t forced = overrides::mma_max_m();
  return forced >= 0 ? forced : kMmaMaxM;
}

LinearPath linear_path(int64_t M, int64_t N, int64_t K, at::ScalarType dtype, int64_t bits, int64_t sm_major) {
  if (dtype != at::kBFloat16 && dtype != at::kHalf) return LinearPath::kDequantCublas;  // fp32 x
  if (M <= kGemvPathMaxM) return LinearPath::kGemv;
  if (M <= mma_max_m()) {
    const bool ws = sm_major == 9 && M >= kWgmmaWsMinM && N * K >= kWgmmaWsMinWeight && ws_producers(bits) == 2;
    return ws ? LinearPath::kWgmmaWs : LinearPath::kMma;
  }
  if (M <= kWgmmaWsMaxM && sm_major == 9) {
    if (M <= kWgmmaMaxM && N >= kWgmmaMinN && K >= kWgmmaMinK) return LinearPath::kWgmma;
    if (M > kWgmmaMaxM && N * K >= kWgmmaWsMinWeight) return LinearPath::kWgmmaWs;
  }
  return LinearPath::kDequantCublas;
}

const char* input_rotation_name(InputRotation rotation) {
  return rotation == InputRotation::kSeparate ? "separate" : rotation == InputRotation::kFused ? "fused" : "none";
}

InputRotation input_rotation(int64_t rot_block, bool gemv) {
  if (rot_block == 0) return InputRotation::kNone;
  return gemv && fused_rotation_block(rot_block) ? InputRotation::kFused : InputRotation::kSeparate;
}

namespace {

// Whether CTAs of `tiles_per_cta` n-tiles each, over an N-row weight, fill at least `wave` of the SMs.
bool fills_sms(int64_t N, int64_t tiles_per_cta, double wave, const DeviceFacts& facts) {
  const int64_t ctas = (n_tiles_of(N) + tiles_per_cta - 1) / tiles_per_cta;
  return static_cast<double>(ctas) >= wave * static_cast<double>(facts.num_sms);
}

// Whether the dense narrow wgmma takes M rows of an N-row weight from the MMA kernel or wgmma_ws (kRsNarrowMinM above).
bool rs_narrow_rule(int64_t M, int64_t N, int64_t bits, const DeviceFacts& facts) {
  const int64_t wg = wgmma_rs_warpgroups(/*grouped=*/false, wgmma_rs_narrow(false, M));
  const double wave = M <= kRsNarrowMmaMaxM ? kRsNarrowMinWave : kRsNarrowWsMinWave;
  return facts.sm_major == 9 && bits >= kMinBits && bits <= kMaxBits && M >= kRsNarrowMinM && M <= kRsNarrowMaxM &&
         fills_sms(N, wg, wave, facts);
}

// The warp-specialized kernel's K splits by the rule (kWsSplitMinKTiles above); 1 where the rule does not apply.
int64_t ws_rule_splits(int64_t M, int64_t N, int64_t K, const DeviceFacts& facts) {
  static_assert(kWgmmaWsMaxSplits <= kGemvMaxSplits, "cluster_sms covers clusters of up to kGemvMaxSplits CTAs");
  const int64_t k_tiles = k_tiles_of(K);
  if (facts.sm_major != 9 || M <= mma_max_m() || M > kWgmmaWsMaxM || k_tiles < kWsSplitMinKTiles) return 1;
  const int64_t tiles = (n_tiles_of(N) + kWgmmaWsTileN - 1) / kWgmmaWsTileN * ((M + kMoeWsChunkRows - 1) / kMoeWsChunkRows);
  int64_t best = 1, best_cost = -1;
  for (int64_t s = 1; s <= std::min<int64_t>(kWgmmaWsMaxSplits, k_tiles); ++s) {
    const int64_t reach = facts.cluster_sms[s] > 0 ? std::min(facts.num_sms, facts.cluster_sms[s]) : facts.num_sms;
    const int64_t cost = (tiles * s + reach - 1) / reach * ((k_tiles + s - 1) / s + kWsSplitFixedKTiles);
    if (best_cost < 0 || cost < best_cost) best = s, best_cost = cost;
  }
  return best;
}

}  // namespace

LinearPlan linear_plan(int64_t M, int64_t N, int64_t K, at::ScalarType dtype, int64_t bits, const DeviceFacts& facts,
                       const LinearForced& forced, int64_t rot_block) {
  KBIT_CHECK_VALUE(M >= 1 && N >= 1 && whole_blocks(K) && facts.num_sms >= 1 && facts.ctas_per_sm >= 1,
                   "kbit linear_plan: needs M, N, num_sms, ctas_per_sm >= 1 and K a positive multiple of ", kBlockSize,
                   ", got M=", M, " N=", N, " K=", K, " num_sms=", facts.num_sms, " ctas_per_sm=", facts.ctas_per_sm);
  LinearPlan plan{linear_path(M, N, K, dtype, bits, facts.sm_major)};
  // The rules below need the SM count, which linear_path does not take.
  // wgmma_ws beats the MMA kernel at M <= kMmaMaxM only where its CTAs fill kWgmmaWsMinWave of the SMs.
  if (plan.path == LinearPath::kWgmmaWs && M <= mma_max_m() && !fills_sms(N, kWgmmaWsTileN, kWgmmaWsMinWave, facts))
    plan.path = LinearPath::kMma;
  if ((plan.path == LinearPath::kMma || plan.path == LinearPath::kWgmmaWs) && rs_narrow_rule(M, N, bits, facts))
    plan.path = LinearPath::kWgmma;
  // Long K and too few CTA tiles for the SMs: the warp-specialized kernel with K split (kWsSplitMinKTiles above).
  const bool x16 = dtype == at::kBFloat16 || dtype == at::kHalf;
  const int64_t ws_splits = ws_rule_splits(M, N, K, facts);  // also the wgmma_ws launch's count below
  if (x16 && (plan.path != LinearPath::kDequantCublas || M <= kWsSplitMaxCublasM) && ws_splits > 1)
    plan.path = LinearPath::kWgmmaWs;
  if (forced.path >= 0) {
    KBIT_CHECK_VALUE(forced.path < static_cast<int64_t>(std::size(kLinearPathNames)), "kbit linear_plan: path id ",
                     forced.path, " is not one kbit::_linear_path_id returns");
    plan.path = static_cast<LinearPath>(forced.path);
  }
  plan.rotation = input_rotation(rot_block, plan.path == LinearPath::kGemv);
  const int64_t n_tiles = n_tiles_of(N), k_tiles = k_tiles_of(K);
  if (plan.path == LinearPath::kGemv) {
    plan.max_splits = std::min<int64_t>(kGemvMaxSplits, k_tiles);
    KBIT_CHECK(forced.splits >= 0 && forced.splits <= plan.max_splits, "kbit linear_plan: gemv splits=", forced.splits,
                     " outside 0 (heuristic) .. ", plan.max_splits);
    plan.splits = forced.splits > 0 ? forced.splits : gemv_splits(n_tiles, k_tiles, facts.num_sms, facts.cluster_sms);
    plan.m_blocks = 1;  // one CTA row multiplies every row of x
    plan.cols = n_tiles;
    plan.table_blocks = gemv_table_blocks(bits, M, /*grouped=*/false);
    plan.pdl = pdl_rule(facts.sm_major);
  } else if (plan.path == LinearPath::kMma) {
    const int p = mma_config(M, n_tiles).p;
    KBIT_CHECK(forced.row_groups == 0 || mma_built(p, static_cast<int>(forced.row_groups)),
                     "kbit linear_plan: row_groups=", forced.row_groups, " is not built for M=", M,
                     "; supported: 0 (heuristic), 1, ", p == kMmaMaxRowTiles ? 2 : 4);
    const MmaConfig c = mma_config(M, n_tiles, forced.row_groups);
    plan.p = c.p;
    plan.r = c.r;
    plan.m_blocks = c.m_blocks;
    plan.max_splits = std::min<int64_t>(kMmaMaxSplits, k_tiles);
    KBIT_CHECK(forced.splits >= 0 && forced.splits <= plan.max_splits, "kbit linear_plan: mma splits=", forced.splits,
                     " outside 0 (heuristic) .. ", plan.max_splits);
    if (forced.splits > 0) {
      plan.splits = forced.splits;
    } else {
      // Dense grids are exact, so the waves their clusters take count (cluster capacities: on a GPU only).
      const int64_t cols = (n_tiles + c.r - 1) / c.r;
      plan.splits = mma_one_wave_splits(cols * c.m_blocks, k_tiles, c.p, facts);
      if (plan.splits == 0) {
        const MmaInstanceFacts f = mma_facts(facts, bits, c.p, c.r, /*grouped=*/false, dtype == at::kBFloat16);
        plan.splits = mma_splits(cols, c.m_blocks, k_tiles, facts.num_sms, f.ctas_per_sm, kMmaSplitCostDense,
                                 f.cluster_ctas);
      }
    }
    plan.cols = (n_tiles + c.r - 1) / c.r;
    plan.pdl = pdl_rule(facts.sm_major);
  } else if (plan.path == LinearPath::kWgmmaWs) {
    KBIT_CHECK_VALUE(forced.row_groups == 0, "kbit linear_plan: row_groups apply to the mma path only, not wgmma_ws");
    // K splits in clusters (wgmma_ws.cu).
    plan.max_splits = std::min<int64_t>(kWgmmaWsMaxSplits, k_tiles);
    KBIT_CHECK(forced.splits >= 0 && forced.splits <= plan.max_splits, "kbit linear_plan: wgmma_ws splits=",
               forced.splits, " outside 0 (the rule) .. ", plan.max_splits);
    plan.splits = forced.splits > 0 ? forced.splits : ws_splits;
  } else {
    KBIT_CHECK_VALUE(forced.splits == 0 && forced.row_groups == 0, "kbit linear_plan: splits and row_groups apply to ",
                     "the gemv, mma and wgmma_ws paths only, not ", linear_path_name(plan.path));
  }
  if (plan.path == LinearPath::kWgmma) {
    // One CTA per kMoeRsChunkRows rows of x and per warpgroup count of n-tiles (the same kernel as the grouped one's).
    const int64_t wg = wgmma_rs_warpgroups(/*grouped=*/false, wgmma_rs_narrow(false, M));
    plan.m_blocks = (M + kMoeRsChunkRows - 1) / kMoeRsChunkRows;
    plan.cols = (n_tiles + wg - 1) / wg;
  }
  if (plan.path == LinearPath::kWgmmaWs) {
    plan.producers = ws_producers(bits, forced.producers);
    plan.m_blocks = (M + kMoeWsChunkRows - 1) / kMoeWsChunkRows;
    plan.cols = (n_tiles + kWgmmaWsTileN - 1) / kWgmmaWsTileN;
  } else {
    KBIT_CHECK_VALUE(forced.producers == 0, "kbit linear_plan: producers apply to the wgmma_ws path only, not ",
                     linear_path_name(plan.path));
  }
  return plan;
}

int64_t ws_producers(int64_t bits, int64_t forced) {
  const int64_t most = bits == 5 ? 1 : 2;
  KBIT_CHECK_VALUE(forced >= 0 && forced <= most, "kbit: producers=", forced, " is not built for k=", bits,
                   "; supported: 0 (the rule), 1", most == 2 ? ", 2" : "");
  if (forced > 0) return forced;
  return std::min(most, overrides::ws_producers());
}

bool moe_wgmma_rs(int64_t slots, int64_t experts, int64_t bits, int64_t forced_producers) {
  const std::string& forced = overrides::moe_wgmma();
  if (!forced.empty()) return forced == "rs";
  return forced_producers == 0 && slots <= rs_max_slots_per_expert(bits) * experts;
}

// ----------------------------------------------------------------------------- routed experts

const char* moe_path_name(MoePath path) { return kMoePathNames[static_cast<int>(path)]; }

MoePath moe_path_from_name(const std::string& name) {
  const auto* names = std::begin(kMoePathNames);
  const auto* it = std::find(names, names + kForcedMoePaths, name);
  KBIT_CHECK_VALUE(it != names + kForcedMoePaths, "kbit fused_moe: path '", name, "' is not one of ",
                   joined(kMoePathNames, 0, kForcedMoePaths));
  return static_cast<MoePath>(it - names);
}

int64_t moe_path_override_id() {
  const std::string& name = overrides::moe_path();
  if (name.empty()) return static_cast<int64_t>(MoePath::kAuto);
  const auto* names = std::begin(kMoePathNames);
  const auto* it = std::find(names, names + kForcedMoePaths, name);
  KBIT_CHECK_VALUE(it != names + kForcedMoePaths, "kbit: VLLM_KBIT_MOE_PATH=", name, " is not one of ",
                   joined(kMoePathNames, 0, kForcedMoePaths));
  return it - names;
}

MoePath moe_path_from_id(int64_t id) {
  KBIT_CHECK_VALUE(id >= 0 && id < kForcedMoePaths, "kbit fused_moe: path id ", id,
                   " is not one kbit::_moe_path_id returns");
  return static_cast<MoePath>(id);
}

const char* moe_kernel_name(MoeKernel kernel) { return kMoeKernelNames[static_cast<int>(kernel)]; }

MoeKernel moe_kernel_from_name(const std::string& name) {
  const auto* names = std::begin(kMoeKernelNames);
  const auto* it = std::find(names + 1, std::end(kMoeKernelNames), name);
  KBIT_CHECK_VALUE(it != std::end(kMoeKernelNames), "kbit: MoE kernel '", name, "' is not one of ",
                   joined(kMoeKernelNames, 1));
  return static_cast<MoeKernel>(it - names);
}

MoeKernel moe_kernel_from_id(int64_t id) {
  KBIT_CHECK_VALUE(id >= 1 && id < static_cast<int64_t>(std::size(kMoeKernelNames)), "kbit: MoE kernel id ", id,
                   " is not one kbit::_moe_kernel_id returns");
  return static_cast<MoeKernel>(id);
}

std::string mma_grouped_chunk_rows_text() {
  constexpr size_t n = sizeof(kMmaGroupedChunkRows) / sizeof(kMmaGroupedChunkRows[0]);
  std::string text;
  for (size_t i = 0; i < n; ++i) {
    text += (i == 0 ? "" : i + 1 == n ? " or " : ", ") + std::to_string(kMmaGroupedChunkRows[i]);
  }
  return text;
}

namespace {

// The grouped MMA's plan for one projection (moe_proj_plan).
MoeProjPlan moe_grouped_mma_plan(int64_t rows, int64_t experts, int64_t chunk_rows, int64_t grid_rows, int64_t n_tiles,
                                 int64_t k_tiles, int64_t bits, const DeviceFacts& facts, int64_t row_groups,
                                 int64_t splits) {
  MoeProjPlan plan;
  KBIT_CHECK_VALUE(mma_grouped_chunk_rows(chunk_rows), "kbit fused_moe: the grouped MMA takes chunks of ",
                   mma_grouped_chunk_rows_text(), " rows, not ", chunk_rows);
  plan.p = chunk_rows / 8;  // one CTA row covers a chunk
  plan.m_blocks = grid_rows;
  KBIT_CHECK_VALUE(row_groups == 0 || mma_built(static_cast<int>(plan.p), static_cast<int>(row_groups)),
                   "kbit fused_moe: row_groups=", row_groups, " is not a built grouped MMA shape for ", chunk_rows,
                   "-row chunks; supported: 0 (the rule), 1, ", plan.p == kMmaMaxRowTiles ? 2 : 4);
  KBIT_CHECK_VALUE(splits >= 0 && splits <= std::min<int64_t>(kMmaMaxSplits, k_tiles), "kbit fused_moe: splits=",
                   splits, " outside 0 (the rule) .. ", std::min<int64_t>(kMmaMaxSplits, k_tiles), " for the grouped MMA");
  // The grid holds the worst case's chunks (moe_max_chunks); the row groups and split count are
  // planned for the chunks a typical routing fills, since CTA rows past the device-side count leave at once.
  const int64_t expected = moe_expected_chunks(rows, experts, chunk_rows);
  plan.r = row_groups > 0 ? row_groups
                          : mma_grouped_r(static_cast<int>(plan.p), n_tiles, k_tiles, static_cast<int>(bits), expected,
                                          facts.num_sms);
  if (splits > 0) {
    plan.splits = splits;
  } else {
    // A grouped grid's live CTAs are an expectation, for which the per-CTA model without waves fits the
    // measurements.
    const MmaInstanceFacts f = mma_facts(facts, bits, static_cast<int>(plan.p), static_cast<int>(plan.r),
                                         /*grouped=*/true, /*bf16=*/true);
    plan.splits = mma_splits((n_tiles + plan.r - 1) / plan.r, expected, k_tiles, facts.num_sms, f.ctas_per_sm,
                             kMmaSplitCostGrouped);
  }
  plan.cols = (n_tiles + plan.r - 1) / plan.r;
  plan.pdl = pdl_rule(facts.sm_major);
  return plan;
}

// The grouped GEMV's plan for one projection (moe_proj_plan): grid_rows CTA rows of n_tiles n-tiles over k_tiles.
MoeProjPlan moe_gemv_plan(int64_t grid_rows, int64_t chunk_rows, int64_t n_tiles, int64_t k_tiles, int64_t bits,
                          const DeviceFacts& facts, int64_t splits) {
  MoeProjPlan plan;
  plan.m_blocks = grid_rows;
  plan.cols = n_tiles;
  KBIT_CHECK_VALUE(splits >= 0 && splits <= std::min<int64_t>(kGemvMaxSplits, k_tiles), "kbit fused_moe: splits=",
                   splits, " outside 0 (the rule) .. ", std::min<int64_t>(kGemvMaxSplits, k_tiles), " for the GEMV");
  plan.splits = splits > 0 ? splits : gemv_splits(grid_rows * n_tiles, k_tiles, facts.num_sms, facts.cluster_sms);
  plan.table_blocks = gemv_table_blocks(bits, chunk_rows, /*grouped=*/true);
  plan.pdl = pdl_rule(facts.sm_major);
  return plan;
}

// Forced values where the path has no such field are refused, not ignored.
void check_moe_forced_fields(const MoeForced& f, MoePath path) {
  const bool splits = path == MoePath::kGemv || path == MoePath::kGemvDirect || path == MoePath::kGroupedMma;
  const bool row_groups = path == MoePath::kGroupedMma, producers = path == MoePath::kGroupedWgmma;
  KBIT_CHECK_VALUE(splits || (f.gate_up_splits == 0 && f.down_splits == 0), "kbit fused_moe: splits apply to the ",
                   "gemv, gemv_direct and grouped_mma paths, not ", moe_path_name(path));
  KBIT_CHECK_VALUE(row_groups || (f.gate_up_row_groups == 0 && f.down_row_groups == 0),
                   "kbit fused_moe: row_groups apply to the grouped_mma path, not ", moe_path_name(path));
  KBIT_CHECK_VALUE(producers || f.producers == 0, "kbit fused_moe: producers apply to the grouped_wgmma path, not ",
                   moe_path_name(path));
}

}  // namespace

MoeProjPlan moe_proj_plan(MoeKernel kernel, int64_t rows, int64_t experts, int64_t chunk_rows, int64_t grid_rows,
                          int64_t n_tiles, int64_t k_tiles, int64_t bits, const DeviceFacts& facts,
                          int64_t row_groups, int64_t splits, int64_t producers) {
  const bool gemv = kernel == MoeKernel::kGemv || kernel == MoeKernel::kGemvDirect;
  const bool wgmma = kernel == MoeKernel::kWgmmaRsGrouped || kernel == MoeKernel::kWgmmaWsGrouped;
  KBIT_CHECK_VALUE(gemv || wgmma || kernel == MoeKernel::kMmaGrouped, "kbit: the MoE kernel ", moe_kernel_name(kernel),
                   " has no projection plan");
  KBIT_CHECK_VALUE(row_groups == 0 || kernel == MoeKernel::kMmaGrouped, "kbit: row_groups apply to the grouped MMA ",
                   "(mma_grouped) only, not ", moe_kernel_name(kernel));
  KBIT_CHECK_VALUE(splits == 0 || !wgmma, "kbit: splits do not apply to the grouped wgmma (",
                   moe_kernel_name(kernel), ")");
  KBIT_CHECK_VALUE(producers == 0 || kernel == MoeKernel::kWgmmaWsGrouped, "kbit fused_moe: producers apply to the ",
                   "warp-specialized grouped_wgmma kernel, not ", moe_kernel_name(kernel),
                   kernel == MoeKernel::kWgmmaRsGrouped ? " (VLLM_KBIT_MOE_WGMMA=rs)" : "");
  KBIT_CHECK_VALUE(facts.num_sms >= 1, "kbit moe_plan: needs num_sms >= 1 to plan the projections, got ",
                   facts.num_sms);
  if (kernel == MoeKernel::kMmaGrouped) {
    return moe_grouped_mma_plan(rows, experts, chunk_rows, grid_rows, n_tiles, k_tiles, bits, facts, row_groups,
                                splits);
  }
  if (gemv) {
    const bool direct = kernel == MoeKernel::kGemvDirect;
    KBIT_CHECK_VALUE(chunk_rows == 1 || (!direct && chunk_rows == kMoeChunkRows), "kbit: ", moe_kernel_name(kernel),
                     " takes chunks of 1", direct ? "" : " or " + std::to_string(kMoeChunkRows), " rows, not ",
                     chunk_rows);
    return moe_gemv_plan(grid_rows, chunk_rows, n_tiles, k_tiles, bits, facts, splits);
  }
  // The grouped wgmma: one CTA per chunk and group of n-tiles, no splits, no programmatic dependent launch.
  const bool rs = kernel == MoeKernel::kWgmmaRsGrouped;
  const int64_t want_rows = rs ? kMoeRsChunkRows : kMoeWsChunkRows;
  KBIT_CHECK_VALUE(chunk_rows == want_rows, "kbit: ", moe_kernel_name(kernel), " takes chunks of ", want_rows,
                   " rows, not ", chunk_rows);
  MoeProjPlan plan;
  plan.m_blocks = grid_rows;
  plan.splits = 1;
  const int64_t tiles_per_cta = rs ? wgmma_rs_warpgroups(/*grouped=*/true, /*narrow=*/false) : kWgmmaWsTileN;
  plan.cols = (n_tiles + tiles_per_cta - 1) / tiles_per_cta;
  plan.producers = rs ? 0 : ws_producers(bits, producers);
  return plan;
}

MoePlan moe_plan(int64_t tokens, int64_t top_k, int64_t experts, int64_t bits, const MoeForced& forced, int64_t hidden,
                 int64_t intermediate, const DeviceFacts& facts, at::ScalarType dtype, int64_t gate_up_rot_block,
                 int64_t down_rot_block) {
  MoePath path = forced.path;
  KBIT_CHECK_VALUE(tokens >= 0 && top_k >= 0 && experts >= 1 && experts <= kMaxLocalExperts,
                   "kbit moe_plan: needs tokens, top_k >= 0 and 1..", kMaxLocalExperts, " local experts, got ", tokens,
                   ", ", top_k, " and ", experts);
  KBIT_CHECK_VALUE(bits >= kMinBits && bits <= kMaxBits, "kbit moe_plan: k=", bits, " is not supported; supported: ",
                   kMinBits, "..", kMaxBits);
  KBIT_CHECK_VALUE(path != MoePath::kReference, "kbit moe_plan: the reference path is picked by dtype, not forced");
  MoePlan plan{path, MoeKernel::kNone, pdl_rule(facts.sm_major), kMoeChunkRows, 0, 0, {}, {}};
  // The kernels take 16-bit activations (the grouped paths run fp16 in bf16); fp32 runs the reference.
  if (dtype != at::kBFloat16 && dtype != at::kHalf) {
    plan.path = MoePath::kReference;
    plan.chunk_rows = 0;
    return plan;
  }
  const int64_t S = tokens * top_k;
  const bool down_separate = down_rot_block > 0 && !fused_rotation_block(down_rot_block);
  if (path == MoePath::kAuto) {
    path = S <= kGemvMaxSlots && 2 * S <= experts                            ? MoePath::kGemvDirect
           : facts.sm_major == 9 && S >= wgmma_min_slots_per_expert(bits) * experts ? MoePath::kGroupedWgmma
           : S <= kMmaMaxSlotsPerExpert * experts                                   ? MoePath::kGroupedMma
                                                                                    : MoePath::kGroupedMm;
    // The GEMV paths compute SiLU-and-mul inside their down projection: nothing to rotate in between unless they
    // rotate it there (fused).
    if (down_separate && path == MoePath::kGemvDirect) path = MoePath::kGroupedMma;
  }
  KBIT_CHECK_VALUE(!down_separate || (path != MoePath::kGemvDirect && path != MoePath::kGemv), "kbit fused_moe: path ",
                   moe_path_name(path), " cannot rotate the down projection's input (w2_rot_signs) with block=",
                   down_rot_block, "; supported with it: auto, grouped_mma, grouped_wgmma, grouped_mm (the GEMV ",
                   "paths take blocks ", kFusedRotationMinBlock, "..", kFusedRotationMaxBlock, ")");
  check_moe_forced_fields(forced, path);
  const bool rs = path == MoePath::kGroupedWgmma && moe_wgmma_rs(S, experts, bits, forced.producers);
  KBIT_CHECK_VALUE(!rs || forced.producers == 0, "kbit fused_moe: producers apply to the warp-specialized ",
                   "grouped_wgmma kernel, not the register-operand one (VLLM_KBIT_MOE_WGMMA=rs)");
  plan.path = path;  // grouped mm: the routing's offsets only, no chunk list
  if (path == MoePath::kGemvDirect) {
    plan.kernel = MoeKernel::kGemvDirect;
    plan.chunk_rows = 1;  // CTA row s multiplies slot s's row
    plan.max_chunks = S;
  } else if (path == MoePath::kGemv) {
    plan.kernel = MoeKernel::kGemv;
    plan.chunk_rows = moe_chunk_rows(tokens);
    plan.max_chunks = moe_max_chunks(S, experts, plan.chunk_rows);
  } else if (path == MoePath::kGroupedMma) {
    plan.kernel = MoeKernel::kMmaGrouped;
    plan.chunk_rows = moe_mma_chunk_rows(S, experts, static_cast<int>(bits));
    plan.max_chunks = moe_max_chunks(S, experts, plan.chunk_rows);
    plan.expected_chunks = moe_expected_chunks(S, experts, plan.chunk_rows);
  } else if (path == MoePath::kGroupedWgmma) {
    plan.kernel = rs ? MoeKernel::kWgmmaRsGrouped : MoeKernel::kWgmmaWsGrouped;
    plan.chunk_rows = rs ? kMoeRsChunkRows : kMoeWsChunkRows;
    plan.max_chunks = moe_max_chunks(S, experts, plan.chunk_rows);
    plan.expected_chunks = moe_expected_chunks(S, experts, plan.chunk_rows);
  } else {
    plan.kernel = MoeKernel::kGroupedMm;
  }
  const bool gemv = path == MoePath::kGemvDirect || path == MoePath::kGemv;  // the kernels that fuse a rotation
  // The hidden states are rotated apart, once per layer: a fusing GEMV would rotate x's row again in every
  // (slot, n-tile) CTA, top_k x n_tiles times (H200, T = 1: 2.0 µs more per layer than one pass; docs/decisions.md).
  plan.gate_up.rotation = input_rotation(gate_up_rot_block, false);
  plan.down.rotation = input_rotation(down_rot_block, gemv);
  if (hidden <= 0 || intermediate <= 0 || S == 0 || plan.max_chunks == 0) return plan;
  KBIT_CHECK_VALUE(facts.num_sms >= 1, "kbit moe_plan: needs num_sms >= 1 to plan the projections, got ",
                   facts.num_sms);
  // gate_up: [2I, H] per expert; down: [H, I]. The direct GEMV has one CTA row per slot, the others one per chunk.
  const int64_t grid_rows = path == MoePath::kGemvDirect ? S : plan.max_chunks;
  plan.gate_up = moe_proj_plan(plan.kernel, S, experts, plan.chunk_rows, grid_rows, n_tiles_of(2 * intermediate),
                               k_tiles_of(hidden), bits, facts, forced.gate_up_row_groups, forced.gate_up_splits,
                               forced.producers);
  plan.down = moe_proj_plan(plan.kernel, S, experts, plan.chunk_rows, grid_rows, n_tiles_of(hidden),
                            k_tiles_of(intermediate), bits, facts, forced.down_row_groups, forced.down_splits,
                            forced.producers);
  plan.gate_up.rotation = input_rotation(gate_up_rot_block, false);
  plan.down.rotation = input_rotation(down_rot_block, gemv);
  return plan;
}

// ----------------------------------------------------------------------------- what launched

namespace {
struct LaunchRing {
  LaunchRecord records[kLaunchRecords];
  int64_t count = 0;  // records made since the last take
};
thread_local LaunchRing launch_ring;
}  // namespace

void record_launch(const LaunchRecord& record) {
  launch_ring.records[launch_ring.count % kLaunchRecords] = record;
  ++launch_ring.count;
}

int take_launch_records(LaunchRecord* out) {
  const int64_t n = std::min<int64_t>(launch_ring.count, kLaunchRecords);
  for (int64_t i = 0; i < n; ++i) out[i] = launch_ring.records[(launch_ring.count - n + i) % kLaunchRecords];
  launch_ring.count = 0;
  return static_cast<int>(n);
}

}  // namespace kbit
