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
// Dequantization per block of 32 elements: the k plane words are regrouped into index words
// whose 4-bit (k <= 4) or 8-bit (k = 5) fields each hold one element's index (bit b of field s
// of word r = bit F*s + r of plane b), then each index picks its codebook value from a register
// with one shuffle, the value is multiplied into all M activation rows, and the block's E4M4
// scale is applied once to the block's fp32 partial sum instead of once per element.
#include "gemv.cuh"
#include "dequant_core.cuh"
#include "kbit_format.cuh"

#include <algorithm>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cooperative_groups.h>

namespace kbit {
namespace {

namespace cg = cooperative_groups;

constexpr int kWarps = 4;                // warps per CTA, all on the same n-tile
constexpr int kThreads = 32 * kWarps;
constexpr int kRowsPerLane = kTileN / 32;  // lane l owns rows l and l + 32 of the n-tile

// ----------------------------------------------------------------------------- activations

// Widening of two packed activations to fp32 (exact) and the final rounding of an output.
template <typename T>
struct Act;

template <>
struct Act<__nv_bfloat16> {
  // A bf16 is the high half of its fp32: one shift or one mask per element.
  __device__ static __forceinline__ float2 widen(uint32_t w) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xFFFF0000u));
  }
  __device__ static __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __forceinline__ __nv_bfloat16 narrow(float v) { return __float2bfloat16_rn(v); }
};

template <>
struct Act<__half> {
  __device__ static __forceinline__ float2 widen(uint32_t w) { return __half22float2(bits_as<__half2>(w)); }
  __device__ static __forceinline__ float to_float(__half v) { return __half2float(v); }
  __device__ static __forceinline__ __half narrow(float v) { return __float2half_rn(v); }
};

// ----------------------------------------------------------------------------- loads

// Weights are read exactly once: keep them out of L1, which holds the activations every warp re-reads.
__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t load_stream(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// Word j of a 16-byte vector; j is a compile-time constant after unrolling, so this is a register pick.
__device__ __forceinline__ uint32_t word(const uint4& v, int j) {
  return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

// Adds one block (32 elements along K) of this lane's two rows times all M activation rows.
// Activations come as fp32 from the warp's staging buffer, 4 per 16-byte shared load (one
// address for the whole warp: a broadcast); each codebook value feeds M fused multiply-adds
// into two alternating partial sums (ILP), and the block scale multiplies the partial sum once.
template <int BITS, int M, int J>
__device__ __forceinline__ void dot_block(const float4* __restrict__ a_stage, float codebook_reg,
                                          const uint4 (&planes)[kRowsPerLane][BITS],
                                          const uint32_t (&codes)[kRowsPerLane], float (&acc)[kRowsPerLane][M]) {
  constexpr int F = Fields<BITS>::kBits;
  uint32_t q[kRowsPerLane][F];
#pragma unroll
  for (int row = 0; row < kRowsPerLane; ++row) {
    uint32_t plane[BITS];
#pragma unroll
    for (int b = 0; b < BITS; ++b) plane[b] = word(planes[row][b], J);
    gather_indices<BITS>(plane, q[row]);
  }
  float part[kRowsPerLane][M][2];
#pragma unroll
  for (int row = 0; row < kRowsPerLane; ++row)
#pragma unroll
    for (int m = 0; m < M; ++m) part[row][m][0] = part[row][m][1] = 0.f;

#pragma unroll
  for (int c = 0; c < kBlockSize / 8; ++c) {
    float a[M][8];
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const float4 lo = a_stage[m * (kTileKB * kBlockSize / 4) + J * (kBlockSize / 4) + 2 * c];
      const float4 hi = a_stage[m * (kTileKB * kBlockSize / 4) + J * (kBlockSize / 4) + 2 * c + 1];
      a[m][0] = lo.x, a[m][1] = lo.y, a[m][2] = lo.z, a[m][3] = lo.w;
      a[m][4] = hi.x, a[m][5] = hi.y, a[m][6] = hi.z, a[m][7] = hi.w;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
#pragma unroll
      for (int row = 0; row < kRowsPerLane; ++row) {
        const float v = lookup<BITS>(codebook_reg, q[row], 8 * c + i);
#pragma unroll
        for (int m = 0; m < M; ++m) part[row][m][i & 1] = fmaf(v, a[m][i], part[row][m][i & 1]);
      }
    }
  }
#pragma unroll
  for (int row = 0; row < kRowsPerLane; ++row) {
    const float scale = decode_scale(codes[row], J);
#pragma unroll
    for (int m = 0; m < M; ++m) acc[row][m] = fmaf(scale, part[row][m][0] + part[row][m][1], acc[row][m]);
  }
}

// This lane's share of runtime tile `tile`: bit-plane vectors and scale codes of rows lane and
// lane + 32. Plane b of the tile's 64 rows is 64 consecutive 16-byte vectors (format.repack).
template <int BITS>
__device__ __forceinline__ void load_tile(const uint4* __restrict__ qweight, const uint32_t* __restrict__ absmax,
                                          int64_t tile, int lane, uint4 (&planes)[kRowsPerLane][BITS],
                                          uint32_t (&codes)[kRowsPerLane]) {
#pragma unroll
  for (int row = 0; row < kRowsPerLane; ++row) {
#pragma unroll
    for (int b = 0; b < BITS; ++b) planes[row][b] = load_stream(qweight + (tile * BITS + b) * kTileN + lane + 32 * row);
    codes[row] = load_stream(absmax + tile * kTileN + lane + 32 * row);
  }
}

// ----------------------------------------------------------------------------- kernel

// Grid: n_tiles * splits CTAs in clusters of `splits` (CTA = n-tile * splits + split). qweight and
// absmax are the runtime layout viewed as 16-byte plane vectors and 4-code words.
template <typename T, int BITS, int M>
__global__ void __launch_bounds__(kThreads) gemv_kernel(const T* __restrict__ A, const uint4* __restrict__ qweight,
                                                        const uint32_t* __restrict__ absmax,
                                                        const float* __restrict__ codebook, const T* __restrict__ bias,
                                                        T* __restrict__ C, int N, int K, int k_tiles, int splits) {
  __shared__ float4 a_stage[kWarps][M * kTileKB * kBlockSize / 4];  // per warp: its k-tile's activations, fp32
  __shared__ float warp_sums[kWarps][M][kTileN];
  __shared__ float cta_sums[M * kTileN];

  // The warp index through a shuffle from lane 0: provably warp-uniform to the compiler, so the
  // k-tile loop below counts as convergent and its shuffles need no divergence handling.
  const int warp = __shfl_sync(0xFFFFFFFFu, static_cast<int>(threadIdx.x) / 32, 0), lane = threadIdx.x % 32;
  const int n_tile = blockIdx.x / splits, split = blockIdx.x % splits;
  const int kt_begin = split * k_tiles / splits, kt_end = (split + 1) * k_tiles / splits;
  const float codebook_reg = __ldg(codebook + (lane & ((1 << BITS) - 1)));

  float acc[kRowsPerLane][M];
#pragma unroll
  for (int row = 0; row < kRowsPerLane; ++row)
#pragma unroll
    for (int m = 0; m < M; ++m) acc[row][m] = 0.f;

  // Software pipeline over this warp's k-tiles, two register buffers used in turn: the next
  // tile's loads are issued before the current tile is dequantized, so every warp keeps 2k+2
  // requests in flight while it computes (without it a warp alternates between waiting on HBM
  // and computing). Unrolled by two so the buffers swap roles without register copies.
  const auto process = [&](const uint4 (&pl)[kRowsPerLane][BITS], const uint32_t (&cd)[kRowsPerLane], int kt) {
    // The tile's 128 x M activations, widened to fp32 once per warp instead of once per lane:
    // lane l stages elements 4l..4l+3 of every row. Elements past K (the last k-tile's padding
    // blocks, whose scales are 0) are staged as 0, so padding adds exactly nothing.
    __syncwarp();  // every lane is done reading the previous tile's activations
    const int e = kt * kTileKB * kBlockSize + 4 * lane;
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
      if (e < K) {
        const uint2 raw = __ldg(reinterpret_cast<const uint2*>(A + static_cast<int64_t>(m) * K + e));
        const float2 lo = Act<T>::widen(raw.x), hi = Act<T>::widen(raw.y);
        v = make_float4(lo.x, lo.y, hi.x, hi.y);
      }
      a_stage[warp][m * 32 + lane] = v;
    }
    __syncwarp();
    dot_block<BITS, M, 0>(a_stage[warp], codebook_reg, pl, cd, acc);
    dot_block<BITS, M, 1>(a_stage[warp], codebook_reg, pl, cd, acc);
    dot_block<BITS, M, 2>(a_stage[warp], codebook_reg, pl, cd, acc);
    dot_block<BITS, M, 3>(a_stage[warp], codebook_reg, pl, cd, acc);
  };
  const int64_t band = static_cast<int64_t>(n_tile) * k_tiles;
  uint4 planes0[kRowsPerLane][BITS], planes1[kRowsPerLane][BITS];
  uint32_t codes0[kRowsPerLane], codes1[kRowsPerLane];
  int kt = kt_begin + warp;
  if (kt < kt_end) load_tile<BITS>(qweight, absmax, band + kt, lane, planes0, codes0);
  while (kt < kt_end) {
    if (kt + kWarps < kt_end) load_tile<BITS>(qweight, absmax, band + kt + kWarps, lane, planes1, codes1);
    process(planes0, codes0, kt);
    kt += kWarps;
    if (kt >= kt_end) break;
    if (kt + kWarps < kt_end) load_tile<BITS>(qweight, absmax, band + kt + kWarps, lane, planes0, codes0);
    process(planes1, codes1, kt);
    kt += kWarps;
  }

#pragma unroll
  for (int row = 0; row < kRowsPerLane; ++row)
#pragma unroll
    for (int m = 0; m < M; ++m) warp_sums[warp][m][lane + 32 * row] = acc[row][m];
  __syncthreads();

  // Output i = m * 64 + r of the tile (activation row m, tile row r) is finished by thread
  // i % kThreads, summing the warps (then the splits) in a fixed order.
  constexpr int kOutputs = M * kTileN;
  constexpr int kPerThread = (kOutputs + kThreads - 1) / kThreads;
  float total[kPerThread];
#pragma unroll
  for (int t = 0; t < kPerThread; ++t) {
    const int i = threadIdx.x + t * kThreads;
    total[t] = 0.f;
    if (i < kOutputs) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) total[t] += warp_sums[w][i / kTileN][i % kTileN];
    }
  }
  if (splits > 1) {
    // Split 0 of the cluster adds the other splits' sums from their shared memory; the second
    // cluster barrier keeps every CTA (and so its shared memory) alive until those reads are done.
    cg::cluster_group cluster = cg::this_cluster();
#pragma unroll
    for (int t = 0; t < kPerThread; ++t) {
      const int i = threadIdx.x + t * kThreads;
      if (i < kOutputs) cta_sums[i] = total[t];
    }
    cluster.sync();
    if (split == 0) {
      for (int s = 1; s < splits; ++s) {
        const float* remote = cluster.map_shared_rank(cta_sums, s);
#pragma unroll
        for (int t = 0; t < kPerThread; ++t) {
          const int i = threadIdx.x + t * kThreads;
          if (i < kOutputs) total[t] += remote[i];
        }
      }
    }
    cluster.sync();
  }
  if (split != 0) return;
#pragma unroll
  for (int t = 0; t < kPerThread; ++t) {
    const int i = threadIdx.x + t * kThreads;
    const int n = n_tile * kTileN + i % kTileN;
    if (i < kOutputs && n < N) {
      float v = total[t];
      if (bias != nullptr) v += Act<T>::to_float(bias[n]);
      C[static_cast<int64_t>(i / kTileN) * N + n] = Act<T>::narrow(v);
    }
  }
}

template <typename T, int BITS, int M>
void launch_typed(const at::Tensor& A, const at::Tensor& qweight_rt, const at::Tensor& absmax_rt,
                  const at::Tensor& codebook, const T* bias, int N, int K, at::Tensor& C) {
  const int n_tiles = static_cast<int>(qweight_rt.size(0)), k_tiles = static_cast<int>(qweight_rt.size(1));
  const int splits = gemv_splits(n_tiles, k_tiles, at::cuda::getCurrentDeviceProperties()->multiProcessorCount);

  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(n_tiles * splits));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = 0;
  config.stream = at::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(splits);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, gemv_kernel<T, BITS, M>, reinterpret_cast<const T*>(A.data_ptr()),
                                    reinterpret_cast<const uint4*>(qweight_rt.data_ptr()),
                                    reinterpret_cast<const uint32_t*>(absmax_rt.data_ptr()),
                                    codebook.data_ptr<float>(), bias, reinterpret_cast<T*>(C.data_ptr()), N, K,
                                    k_tiles, splits));
}

template <typename T, int BITS>
void launch_bits(const at::Tensor& A, const at::Tensor& q, const at::Tensor& a, const at::Tensor& cb, const T* bias,
                 int N, int K, at::Tensor& C) {
  switch (A.size(0)) {
    case 1: return launch_typed<T, BITS, 1>(A, q, a, cb, bias, N, K, C);
    case 2: return launch_typed<T, BITS, 2>(A, q, a, cb, bias, N, K, C);
    case 3: return launch_typed<T, BITS, 3>(A, q, a, cb, bias, N, K, C);
    case 4: return launch_typed<T, BITS, 4>(A, q, a, cb, bias, N, K, C);
    default: TORCH_CHECK(false, "kbit gemv: M=", A.size(0), " is outside 1..", kGemvMaxM);
  }
}

template <typename T>
void launch_dtype(const at::Tensor& A, const at::Tensor& q, const at::Tensor& a, const at::Tensor& cb,
                  const std::optional<at::Tensor>& bias, int N, int K, at::Tensor& C) {
  const T* bias_ptr = bias.has_value() ? reinterpret_cast<const T*>(bias->data_ptr()) : nullptr;
  switch (q.size(2)) {
    case 2: return launch_bits<T, 2>(A, q, a, cb, bias_ptr, N, K, C);
    case 3: return launch_bits<T, 3>(A, q, a, cb, bias_ptr, N, K, C);
    case 4: return launch_bits<T, 4>(A, q, a, cb, bias_ptr, N, K, C);
    case 5: return launch_bits<T, 5>(A, q, a, cb, bias_ptr, N, K, C);
    default: TORCH_CHECK(false, "kbit gemv: k=", q.size(2), " is not supported");
  }
}

}  // namespace

int gemv_splits(int64_t n_tiles, int64_t k_tiles, int64_t num_sms) {
  // Cost model: k-tile slots the busiest SM spends (its CTAs times the slowest warp's k-tiles
  // times the warps), slowed down when fewer than kStreamingWarps warps per SM have loads in flight. Cost = num / den; the smallest wins, ties to fewer splits.
  constexpr int64_t kResidentCtas = 8;      // CTAs of kThreads one SM holds at once (registers)
  constexpr int64_t kStreamingWarps = 16;   // warps per SM that keep enough bytes in flight
  const int64_t max_splits = std::max<int64_t>(1, std::min<int64_t>(kGemvMaxSplits, k_tiles));
  int best = 1;
  int64_t best_num = -1, best_den = 1;
  for (int64_t s = 1; s <= max_splits; ++s) {
    const int64_t per_sm = (n_tiles * s + num_sms - 1) / num_sms;   // CTAs on the busiest SM
    const int64_t tiles = (k_tiles + s - 1) / s;                        // k-tiles of the largest split
    const int64_t warp_iters = (tiles + kWarps - 1) / kWarps;           // its slowest warp's k-tiles
    const int64_t active = std::min<int64_t>(kWarps, tiles);
    const int64_t streaming = std::min(std::min(per_sm, kResidentCtas) * active, kStreamingWarps);
    const int64_t num = per_sm * warp_iters * kWarps * kStreamingWarps, den = streaming;
    if (best_num < 0 || num * best_den < best_num * den) {
      best = static_cast<int>(s);
      best_num = num;
      best_den = den;
    }
  }
  return best;
}

void launch_gemv(const at::Tensor& A, const at::Tensor& qweight_rt, const at::Tensor& absmax_rt,
                 const at::Tensor& codebook, const std::optional<at::Tensor>& bias, int64_t N, int64_t K,
                 at::Tensor& C) {
  TORCH_CHECK(N <= INT32_MAX && K <= INT32_MAX && qweight_rt.size(0) * qweight_rt.size(1) <= INT32_MAX,
              "kbit gemv: weight too large");
  if (A.scalar_type() == at::kBFloat16) {
    launch_dtype<__nv_bfloat16>(A, qweight_rt, absmax_rt, codebook, bias, static_cast<int>(N), static_cast<int>(K), C);
  } else {
    TORCH_CHECK(A.scalar_type() == at::kHalf, "kbit gemv: activations must be bf16 or fp16");
    launch_dtype<__half>(A, qweight_rt, absmax_rt, codebook, bias, static_cast<int>(N), static_cast<int>(K), C);
  }
}

}  // namespace kbit
