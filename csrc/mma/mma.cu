// kbit fused dequant + MMA: the launchers (they launch a plan, plan.h) and the instance facts the planner
// reads (kernel in mma_kernel.cuh).
#include "mma.cuh"
#include "mma_kernel.cuh"

#include <algorithm>

#include <ATen/cuda/CUDAContext.h>
#include <c10/util/Exception.h>

#include "check.h"

namespace kbit {

MmaInstanceFacts mma_instance_facts(int bits, int p, int r, bool grouped, bool bf16, int device) {
  MmaInstanceFacts f;
  with_bits(bits, "kbit mma", [&](auto k) { f = mma_detail::mma_facts_k<decltype(k)::value>(p, r, grouped, bf16, device); });
  return f;
}

int mma_resident_ctas(int bits, int p, int r) {
  int n = 0;
  with_bits(bits, "kbit mma", [&](auto k) { n = mma_detail::mma_resident_k<decltype(k)::value>(p, r); });
  return n;
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
  L.stream = at::cuda::getCurrentCUDAStream();
  return L;
}

void launch_k(const mma_detail::MmaLaunch& L, int64_t k, bool bf16) {
  with_bits(k, "kbit mma", [&](auto bits) { mma_detail::launch_mma_k<decltype(bits)::value>(L, bf16); });
}

}  // namespace

void launch_mma(const at::Tensor& A, const at::Tensor& qweight_rt, const at::Tensor& absmax_rt,
                const at::Tensor& codebook, const std::optional<at::Tensor>& bias, int64_t N, int64_t K, at::Tensor& C,
                const LinearPlan& plan) {
  const int64_t n_tiles = qweight_rt.size(0);
  mma_detail::MmaLaunch L =
      launch_fields(A, qweight_rt, absmax_rt, codebook, N, K, n_tiles, qweight_rt.size(1), C);
  L.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  KBIT_CHECK(plan.path == LinearPath::kMma && plan.p == mma_config(L.M, n_tiles).p && mma_built(plan.p, plan.r) &&
                 plan.m_blocks * 8 * plan.p >= L.M && plan.m_blocks <= kMmaMaxGridRows,
             "kbit mma: the plan (", linear_path_name(plan.path), ", p=", plan.p, ", r=", plan.r, ", m_blocks=",
             plan.m_blocks, ") does not cover M=", L.M);
  L.config = {static_cast<int>(plan.p), static_cast<int>(plan.r), static_cast<int>(plan.m_blocks)};
  L.splits = static_cast<int>(plan.splits);
  L.cols = static_cast<int>(plan.cols);
  L.pdl = plan.pdl;
  launch_k(L, qweight_rt.size(2), A.scalar_type() == at::kBFloat16);
}

void launch_mma_grouped(const at::Tensor& A, const at::Tensor& chunks, const at::Tensor& num_chunks,
                        const at::Tensor& qweight, const at::Tensor& absmax, const at::Tensor& codebook, int64_t N,
                        int64_t K, int64_t chunk_rows, at::Tensor& C, const MoeProjPlan& plan, bool chunks_early) {
  if (chunks.size(0) == 0) return;
  const int64_t n_tiles = qweight.size(1);
  mma_detail::MmaLaunch L = launch_fields(A, qweight, absmax, codebook, N, K, n_tiles, qweight.size(2), C);
  KBIT_CHECK(8 * plan.p == chunk_rows && mma_built(static_cast<int>(plan.p), static_cast<int>(plan.r)) &&
                 plan.m_blocks == chunks.size(0),
             "kbit mma grouped: the plan (p=", plan.p, ", r=", plan.r, ", m_blocks=", plan.m_blocks,
             ") does not match chunks of ", chunk_rows, " rows in a list of ", chunks.size(0));
  L.config = {static_cast<int>(plan.p), static_cast<int>(plan.r), static_cast<int>(plan.m_blocks)};
  L.splits = static_cast<int>(plan.splits);
  L.cols = static_cast<int>(plan.cols);
  L.pdl = plan.pdl;
  L.chunks = chunks.data_ptr<int>();
  L.num_chunks = num_chunks.data_ptr<int>();
  L.expert_qbytes = qweight.stride(0) * static_cast<int64_t>(sizeof(int32_t));
  L.expert_abytes = absmax.stride(0);
  L.chunks_early = chunks_early;
  launch_k(L, qweight.size(3), A.scalar_type() == at::kBFloat16);
}

}  // namespace kbit
