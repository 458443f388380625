// The input rotation of rotated kbit layers: out = x · R, R = diag(s) · blockdiag(H_b / sqrt(b)), row by row,
// or x · Rᵀ (`inverse`: the signs after the butterflies); the rule: vllm_kbit/reference.py, hadamard_rotate. H_b is the Sylvester Walsh-Hadamard matrix of order b
// (a power of two, 2..1024) and s a ±1 vector over the K columns. Weights are stored quantized as W·R, so
// feeding x·R leaves x·Wᵀ unchanged.
//
// One warp per unit of U = max(b, 32) elements of one row (K is a multiple of 32, so units tile rows). Lane l
// holds the U/32 elements e = i·32 + l: each load instruction of the warp reads 32 consecutive elements
// (coalesced), the butterflies over the bits of i run in registers and those over the bits of l below b by
// shuffles (for b < 32 a unit holds 32/b blocks, one per group of b lanes). Sylvester's H is the product of
// one 2-point butterfly per bit of the index, in any order, so the result is in natural order with no
// permutation. Accumulation in float32; one rounding to the output dtype.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "launch_utils.cuh"
#include "plan.h"
#include "rotate.h"
#include "rotate_core.cuh"

namespace kbit {
namespace {

using rotate_core::butterfly_lanes;
using rotate_core::butterfly_registers;

constexpr int kRotateWarps = 8;  // warps (units of max(b, 32) elements) per CTA

template <typename T>
__device__ __forceinline__ float to_f32(T v) { return static_cast<float>(v); }
template <>
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_f32(float v) { return static_cast<T>(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_f32(float v) { return __float2half_rn(v); }

// B = b; E = max(b, 32) / 32 elements per lane. x rows are `x_stride` elements apart, out rows K apart.
template <typename T, int B>
__global__ void __launch_bounds__(kRotateWarps * 32) rotate_kernel(const T* __restrict__ x, int64_t x_stride,
                                                                   const float* __restrict__ signs,
                                                                   T* __restrict__ out, int64_t M, int64_t K,
                                                                   float scale, bool inverse) {
  constexpr int E = B >= 32 ? B / 32 : 1;
  constexpr int U = E * 32;
  const int lane = threadIdx.x & 31;
  const int64_t blocks_per_row = K / U;
  const int64_t blk = static_cast<int64_t>(blockIdx.x) * kRotateWarps + (threadIdx.x >> 5);
  pdl_wait();  // x is the previous kernel's output; out may be memory it still reads
  pdl_launch_dependents();  // the next GEMM can start fetching its weights meanwhile
  if (blk >= M * blocks_per_row) return;
  const int64_t row = blk / blocks_per_row, col0 = (blk % blocks_per_row) * U;
  const T* xr = x + row * x_stride + col0;
  float v[E];
#pragma unroll
  for (int i = 0; i < E; ++i) {
    v[i] = to_f32(xr[i * 32 + lane]);
    if (!inverse) v[i] *= signs[col0 + i * 32 + lane];  // x R: diag(s) before H
  }
  // Low index bits first, as the reference's transform runs them: the same fp32 sums in the same order, so the
  // result is the reference's bit for bit.
  butterfly_lanes<E, (B < 32 ? B : 32)>(v, lane);  // index bits 0..4 (lane bits)
  butterfly_registers(v);                           // index bits 5 and up
  T* orow = out + row * K + col0;
#pragma unroll
  for (int i = 0; i < E; ++i) {
    const float s = inverse ? signs[col0 + i * 32 + lane] * scale : scale;  // x Rᵀ: diag(s) after H
    orow[i * 32 + lane] = from_f32<T>(v[i] * s);
  }
}

template <typename T>
void launch_typed(const at::Tensor& x2, const at::Tensor& signs, int64_t block, bool inverse, at::Tensor& out2) {
  const int64_t M = x2.size(0), K = x2.size(1);
  const int64_t work = M * (K / std::max<int64_t>(block, 32));
  if (work == 0) return;
  const dim3 grid(static_cast<unsigned>((work + kRotateWarps - 1) / kRotateWarps));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const T* xp = reinterpret_cast<const T*>(x2.data_ptr());
  T* op = reinterpret_cast<T*>(out2.data_ptr());
  const float* sp = signs.data_ptr<float>();
  // A programmatic dependent where the planner's rule says so: the next GEMM's weight fetch overlaps this kernel.
  const bool pdl = pdl_rule(device_facts(x2.get_device()).sm_major);
  // 1 / sqrt(b) rounded once from double, as the reference's float32 multiply by Python's 1.0 / math.sqrt(b).
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(block)));
  auto go = [&](auto b) {
    constexpr int B = decltype(b)::value;
    launch_kernel(rotate_kernel<T, B>, grid, dim3(kRotateWarps * 32), 0, stream, 0, pdl, xp, x2.stride(0), sp, op, M, K, scale, inverse);
    record_launch({"rotate", 0, 0, static_cast<int64_t>(grid.x), 0, 0, 0, 0, pdl, InputRotation::kSeparate});
  };
  switch (block) {
    case 2: return go(std::integral_constant<int, 2>{});
    case 4: return go(std::integral_constant<int, 4>{});
    case 8: return go(std::integral_constant<int, 8>{});
    case 16: return go(std::integral_constant<int, 16>{});
    case 32: return go(std::integral_constant<int, 32>{});
    case 64: return go(std::integral_constant<int, 64>{});
    case 128: return go(std::integral_constant<int, 128>{});
    case 256: return go(std::integral_constant<int, 256>{});
    case 512: return go(std::integral_constant<int, 512>{});
    case 1024: return go(std::integral_constant<int, 1024>{});
    default: KBIT_CHECK_VALUE(false, "kbit: hadamard_rotate: block=", block, " is not supported on CUDA; supported: ",
                              "powers of two 2..", kRotateMaxBlock);
  }
}

}  // namespace

void launch_rotate(const at::Tensor& x2, const at::Tensor& signs, int64_t block, bool inverse, at::Tensor& out2) {
  switch (x2.scalar_type()) {
    case at::kBFloat16: return launch_typed<__nv_bfloat16>(x2, signs, block, inverse, out2);
    case at::kHalf: return launch_typed<__half>(x2, signs, block, inverse, out2);
    case at::kFloat: return launch_typed<float>(x2, signs, block, inverse, out2);
    default: KBIT_CHECK_TYPE(false, "kbit: hadamard_rotate: x has dtype ", x2.scalar_type(), "; supported: bfloat16, float16, float32");
  }
}

}  // namespace kbit
