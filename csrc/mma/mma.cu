// kbit fused dequant + MMA: tile shape, split-K heuristic and the launcher (kernel in mma_kernel.cuh).
#include "mma.cuh"
#include "mma_kernel.cuh"
#include "moe.cuh"

#include <algorithm>

#include <ATen/cuda/CUDAContext.h>
#include <c10/util/Exception.h>

#include "check.h"

namespace kbit {

MmaConfig mma_config(int64_t M, int64_t n_tiles, int64_t row_groups) {
  // p: the fewest n8 activation tiles covering M (64 rows per CTA at most, more go to grid rows).
  const int p = M <= 8 ? 1 : M <= 16 ? 2 : M <= 32 ? 4 : kMmaMaxRowTiles;
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
  // there are CTAs enough either way (unlike a narrow dense weight). At p <= 2 the table-decode
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
  // (benchmarks/sweep_moe_grid.py; docs/decisions.md, "Grouped MMA: narrow warps for light last waves").
  if (bits == 4 && p == 1 && k_tiles >= 16) {
    const int64_t slots = num_sms * mma_detail::Shape<4, 1, 4>::kResident;
    const int64_t ctas = (n_tiles + wide - 1) / wide * expected_chunks;
    const int64_t tail = ctas % slots;
    if (ctas > slots && tail > 0 && 2 * tail < slots) return 1;
  }
  return wide;
}

bool mma_built(int p, int r) {
#define KBIT_MMA_BUILT(P_, R_) \
  if (p == P_ && r == R_) return true;
  KBIT_MMA_INSTANCES(KBIT_MMA_BUILT)
#undef KBIT_MMA_BUILT
  return false;
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

namespace {

// The launch fields every MMA launch shares; the caller sets the tile shape and, for grouped ones,
// the chunk list.
mma_detail::MmaLaunch launch_fields(const at::Tensor& A, const at::Tensor& qweight, const at::Tensor& absmax,
                                    const at::Tensor& codebook, int64_t N, int64_t K, int64_t n_tiles, int64_t k_tiles,
                                    at::Tensor& C) {
  mma_detail::MmaLaunch L{};
  L.A = A.data_ptr();
  L.qweight = qweight.data_ptr();
  L.absmax = absmax.data_ptr();
  L.codebook = codebook.data_ptr<float>();
  L.C = C.data_ptr();
  L.M = static_cast<int>(A.size(0));
  L.N = static_cast<int>(N);
  L.K = static_cast<int>(K);
  L.n_tiles = static_cast<int>(n_tiles);
  L.k_tiles = static_cast<int>(k_tiles);
  L.device = A.get_device();
  L.num_sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  L.stream = at::cuda::getCurrentCUDAStream();
  return L;
}

void launch_k(const mma_detail::MmaLaunch& L, int64_t k, bool bf16) {
  with_bits(k, "kbit mma", [&](auto bits) { mma_detail::launch_mma_k<decltype(bits)::value>(L, bf16); });
}

}  // namespace

void launch_mma(const at::Tensor& A, const at::Tensor& qweight_rt, const at::Tensor& absmax_rt,
                const at::Tensor& codebook, const std::optional<at::Tensor>& bias, int64_t N, int64_t K, at::Tensor& C,
                int64_t row_groups, int64_t splits) {
  const int64_t n_tiles = qweight_rt.size(0);
  mma_detail::MmaLaunch L =
      launch_fields(A, qweight_rt, absmax_rt, codebook, N, K, n_tiles, qweight_rt.size(1), C);
  L.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  L.config = mma_config(L.M, n_tiles, row_groups);
  L.splits = static_cast<int>(splits);
  launch_k(L, qweight_rt.size(2), A.scalar_type() == at::kBFloat16);
}

void launch_mma_grouped(const at::Tensor& A, const at::Tensor& chunks, const at::Tensor& num_chunks,
                        const at::Tensor& qweight, const at::Tensor& absmax, const at::Tensor& codebook, int64_t N,
                        int64_t K, int64_t chunk_rows, at::Tensor& C, int64_t row_groups, int64_t splits,
                        bool chunks_early) {
  if (chunks.size(0) == 0) return;
  const int64_t n_tiles = qweight.size(1);
  mma_detail::MmaLaunch L = launch_fields(A, qweight, absmax, codebook, N, K, n_tiles, qweight.size(2), C);
  L.config = mma_config(chunk_rows, n_tiles, 1);  // 8p == chunk_rows: one CTA row covers a chunk
  L.splits = static_cast<int>(splits);
  L.config.m_blocks = static_cast<int>(chunks.size(0));
  // The grid holds the worst case's chunks (moe_max_chunks); the row groups and split count are
  // planned for the chunks a typical routing fills, since CTA rows past the device-side count leave at once.
  L.plan_m_blocks = moe_expected_chunks(A.size(0), qweight.size(0), chunk_rows);
  L.config.r = row_groups > 0 ? static_cast<int>(row_groups)
                              : mma_grouped_r(L.config.p, n_tiles, L.k_tiles, static_cast<int>(qweight.size(3)),
                                              L.plan_m_blocks, L.num_sms);
  L.chunks = chunks.data_ptr<int>();
  L.num_chunks = num_chunks.data_ptr<int>();
  L.expert_qbytes = qweight.stride(0) * static_cast<int64_t>(sizeof(int32_t));
  L.expert_abytes = absmax.stride(0);
  L.chunks_early = chunks_early;
  launch_k(L, qweight.size(3), A.scalar_type() == at::kBFloat16);
}

}  // namespace kbit
