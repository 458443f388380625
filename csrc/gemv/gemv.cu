// kbit GEMV for M = 1..4: C[M, N] = A[M, K] @ dequant(W)^T (+ bias).
//
// Work split. A CTA of kWarps warps owns one runtime n-tile (64 output rows) and one K split
// (a contiguous range of 128-wide k-tiles); its warps take the split's k-tiles round robin.
// Lane l owns rows l and l + 32 of the tile, so one warp-wide 16-byte load of bit-plane b
// reads 512 contiguous bytes (format.repack puts the 64 rows of a plane next to each other).
// A warp widens its k-tile's activations to fp32 once into shared memory; every value a lane
// reads back serves two weight rows, and every dequantized weight serves all M activation rows.
// The splits of one n-tile form a thread-block cluster and are summed through distributed
// shared memory: no workspace, no counters, nothing to zero, deterministic order.
//
// Dequantization per block of 32 elements: the block's runtime words hold each element's index where
// one shift (k = 5: one funnel shift) brings it down (kbit_format.cuh: planes_to_runtime_words), then
// each index picks its codebook value from a register
// with one shuffle (or, where the plan says so, each index pair its two values from a per-CTA
// table in shared memory: plan.h, gemv_table_blocks), the value is multiplied into all M activation rows,
// and the block's E4M4 scale is applied once to the block's fp32 partial sum instead of once per element.
//
// The tile/dequant core (k-tile loop, block dot product, warp and cluster sums) is
// gemv_core.cuh, shared with the grouped MoE GEMV (moe_gemv.cuh).
#include "gemv.cuh"
#include "gemv_core.cuh"

#include <algorithm>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include "check.h"
#include "launch_utils.cuh"

namespace kbit {
namespace {

using namespace gemv_core;

static_assert(gemv_core::kWarps == kGemvWarps, "the planner's GEMV cost model counts kGemvWarps warps per CTA");

// ----------------------------------------------------------------------------- kernel

// Grid: n_tiles * splits CTAs in clusters of `splits` (CTA = n-tile * splits + split). qweight and
// absmax are the runtime layout viewed as 16-byte plane vectors and 4-code words. ROT: A is multiplied by the
// rotation `rot` as it is loaded (a rotated layer's x · R; accumulate in gemv_core.cuh).
template <typename T, int BITS, int M, int TB, int ROT>
__global__ void __launch_bounds__(kThreads) gemv_kernel(const T* __restrict__ A, const uint4* __restrict__ qweight,
                                                        const uint32_t* __restrict__ absmax,
                                                        const float* __restrict__ codebook, const T* __restrict__ bias,
                                                        T* __restrict__ C, int N, int K, int k_tiles, int splits,
                                                        const rotate_core::FusedRotation rot) {
  __shared__ float4 a_stage[kWarps][M * kTileKB * kBlockSize / 4];  // per warp: its k-tile's activations, fp32
  __shared__ float warp_sums[kWarps][M][kTileN];
  __shared__ float cta_sums[M * kTileN];
  extern __shared__ __align__(16) uint8_t lut[];  // TB > 0: the decode table (Lut<BITS>::kBytes)

  // The warp index through a shuffle from lane 0: provably warp-uniform to the compiler, so the
  // k-tile loop below counts as convergent and its shuffles need no divergence handling.
  const int warp = __shfl_sync(0xFFFFFFFFu, static_cast<int>(threadIdx.x) / 32, 0), lane = threadIdx.x % 32;
  const int n_tile = blockIdx.x / splits, split = blockIdx.x % splits;
  const int kt_begin = split * k_tiles / splits, kt_end = (split + 1) * k_tiles / splits;

  float acc[kRowsPerLane][M];
  accumulate<T, BITS, M, TB, ROT>(
      qweight, absmax, codebook, static_cast<int64_t>(n_tile) * k_tiles, kt_begin, kt_end, K, warp, lane,
      a_stage[warp], lut,
      [&](int m, int e) { return __ldg(reinterpret_cast<const uint2*>(A + static_cast<int64_t>(m) * K + e)); },
      [&](int, uint2 raw) {
        const float2 lo = Act<T>::widen(raw.x), hi = Act<T>::widen(raw.y);
        return make_float4(lo.x, lo.y, hi.x, hi.y);
      },
      [] {
        pdl_wait();               // first weight tile in flight; A is the previous kernel's output, C written below
        pdl_launch_dependents();  // the main loop only streams: the next kernel may start its weight prologue
      },
      rot, acc);
  reduce_and_store<M>(acc, &warp_sums[0][0][0], cta_sums, warp, lane, split, splits, [&](int m, int r, float v) {
    const int n = n_tile * kTileN + r;
    if (n < N) {
      if (bias != nullptr) v += Act<T>::to_float(bias[n]);
      C[static_cast<int64_t>(m) * N + n] = Act<T>::narrow(v);
    }
  });
}

// What the launch takes from the plan: K splits, the decode (table blocks) and programmatic dependent launch;
// and the fused rotation (signs null: none).
struct GemvLaunch {
  int splits;
  int table_blocks;
  bool pdl;
  rotate_core::FusedRotation rot;
};

template <typename T, int BITS, int M, int ROT>
void launch_typed_rot(const at::Tensor& A, const at::Tensor& qweight_rt, const at::Tensor& absmax_rt,
                  const at::Tensor& codebook, const T* bias, int N, int K, at::Tensor& C, const GemvLaunch& g) {
  const int n_tiles = static_cast<int>(qweight_rt.size(0)), k_tiles = static_cast<int>(qweight_rt.size(1));
  const auto launch = [&](auto kernel, size_t smem, int table_blocks) {
    const dim3 grid(static_cast<unsigned>(n_tiles * g.splits));
    record_launch({"gemv", 0, 0, grid.y, grid.x / g.splits, g.splits, 0, table_blocks, g.pdl,
                   ROT ? InputRotation::kFused : InputRotation::kNone});
    launch_kernel(kernel, grid, dim3(kThreads), smem, at::cuda::getCurrentCUDAStream(), g.splits, g.pdl,
                  reinterpret_cast<const T*>(A.data_ptr()), reinterpret_cast<const uint4*>(qweight_rt.data_ptr()),
                  reinterpret_cast<const uint32_t*>(absmax_rt.data_ptr()), codebook.data_ptr<float>(), bias,
                  reinterpret_cast<T*>(C.data_ptr()), N, K, k_tiles, g.splits, g.rot);
  };
  // The plan's decode (gemv_table_blocks): 0 (shuffle), kGemvMixedTableBlocks (one row only) or 4 (table).
  if constexpr (gemv_table_possible(BITS, M)) {
    if constexpr (M == 1) {
      if (g.table_blocks == kGemvMixedTableBlocks) {
        return launch(gemv_kernel<T, BITS, M, kGemvMixedTableBlocks, ROT>, Lut<BITS>::kBytes, kGemvMixedTableBlocks);
      }
    }
    if (g.table_blocks == 4) return launch(gemv_kernel<T, BITS, M, 4, ROT>, Lut<BITS>::kBytes, 4);
  }
  KBIT_CHECK(g.table_blocks == 0, "kbit gemv: no kernel decodes ", g.table_blocks, " blocks of each k-tile by table at k=",
             BITS, " with ", M, " rows");
  launch(gemv_kernel<T, BITS, M, 0, ROT>, 0, 0);
}

// The rotated instances of the launch's kind where it rotates, the unrotated (today's code) elsewhere.
template <typename T, int BITS, int M>
void launch_typed(const at::Tensor& A, const at::Tensor& qweight_rt, const at::Tensor& absmax_rt,
                  const at::Tensor& codebook, const T* bias, int N, int K, at::Tensor& C, const GemvLaunch& g) {
  rotate_core::with_rot_kind(g.rot, [&](auto kind) {
    launch_typed_rot<T, BITS, M, decltype(kind)::value>(A, qweight_rt, absmax_rt, codebook, bias, N, K, C, g);
  });
}

template <typename T, int BITS>
void launch_bits(const at::Tensor& A, const at::Tensor& q, const at::Tensor& a, const at::Tensor& cb, const T* bias,
                 int N, int K, at::Tensor& C, const GemvLaunch& g) {
  switch (A.size(0)) {
    case 1: return launch_typed<T, BITS, 1>(A, q, a, cb, bias, N, K, C, g);
    case 2: return launch_typed<T, BITS, 2>(A, q, a, cb, bias, N, K, C, g);
    case 3: return launch_typed<T, BITS, 3>(A, q, a, cb, bias, N, K, C, g);
    case 4: return launch_typed<T, BITS, 4>(A, q, a, cb, bias, N, K, C, g);
    default: KBIT_CHECK(false, "kbit gemv: M=", A.size(0), " is outside 1..", kGemvMaxM);
  }
}

template <typename T>
void launch_dtype(const at::Tensor& A, const at::Tensor& q, const at::Tensor& a, const at::Tensor& cb,
                  const std::optional<at::Tensor>& bias, int N, int K, at::Tensor& C, const GemvLaunch& g) {
  const T* bias_ptr = bias.has_value() ? reinterpret_cast<const T*>(bias->data_ptr()) : nullptr;
  with_bits(q.size(2), "kbit gemv", [&](auto bits) {
    launch_bits<T, decltype(bits)::value>(A, q, a, cb, bias_ptr, N, K, C, g);
  });
}

// Nothing to run: the kernel the driver is asked how many clusters of one CTA per SM it fits (cluster_sms_of).
__global__ void cluster_reach_kernel() {}

}  // namespace

int64_t cluster_sms_of(int s, int device) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  // All of an SM's shared memory per CTA, so that one CTA holds an SM and the CTAs that fit count SMs.
  const int smem = static_cast<int>(at::cuda::getDeviceProperties(device)->sharedMemPerBlockOptin);
  if (cudaFuncSetAttribute(cluster_reach_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) {
    (void)cudaGetLastError();  // leaves no sticky error behind; the split rule then counts every SM
    return 0;
  }
  return cluster_capacity(cluster_reach_kernel, s, 32, smem, s);
}

void launch_gemv(const at::Tensor& A, const at::Tensor& qweight_rt, const at::Tensor& absmax_rt,
                 const at::Tensor& codebook, const std::optional<at::Tensor>& bias, int64_t N, int64_t K,
                 at::Tensor& C, const LinearPlan& plan, const float* rot_signs, int64_t rot_block) {
  const int64_t n_tiles = qweight_rt.size(0), k_tiles = qweight_rt.size(1);
  KBIT_CHECK(N <= INT32_MAX && K <= INT32_MAX && n_tiles * k_tiles <= INT32_MAX, "kbit gemv: weight too large");
  const int64_t max_splits = std::min<int64_t>(kGemvMaxSplits, k_tiles);
  KBIT_CHECK(plan.path == LinearPath::kGemv && plan.splits >= 1 && plan.splits <= max_splits && plan.cols == n_tiles &&
                 plan.m_blocks == 1,
             "kbit gemv: the plan (", linear_path_name(plan.path), ", splits=", plan.splits, ", grid ", plan.cols,
             " x ", plan.m_blocks, ") is not a GEMV with 1..", max_splits, " splits over ", n_tiles, " x 1 CTAs");
  const GemvLaunch g{static_cast<int>(plan.splits), static_cast<int>(plan.table_blocks), plan.pdl,
                     rotate_core::fused_rotation("kbit gemv", rot_signs, rot_block, K)};
  if (A.scalar_type() == at::kBFloat16) {
    launch_dtype<__nv_bfloat16>(A, qweight_rt, absmax_rt, codebook, bias, static_cast<int>(N), static_cast<int>(K), C, g);
  } else {
    KBIT_CHECK(A.scalar_type() == at::kHalf, "kbit gemv: activations must be bf16 or fp16");
    launch_dtype<__half>(A, qweight_rt, absmax_rt, codebook, bias, static_cast<int>(N), static_cast<int>(K), C, g);
  }
}

}  // namespace kbit
