// Routing prep and the elementwise MoE kernels: permutation of the slots by local expert,
// gathering/scaling the permuted activations, SiLU * up, and the weighted combine.
//
// Routing is one CTA: per-expert token counts by shared-memory atomics (the atomic's old value
// is the slot's rank within its expert), one block-wide scan of (tokens, chunks) per expert,
// then every slot gets its row. The order of slots inside an expert depends on atomic order;
// nothing downstream does: each row is computed on its own, with the same arithmetic whatever rows share its
// chunk (moe_gemv.cuh), and the combine reads rows by slot.
#include "moe.cuh"
#include "local_expert.cuh"

#include "plan.h"  // kMaxLocalExperts

#include <algorithm>
#include <cmath>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "activation.cuh"
#include "check.h"
#include "launch_utils.cuh"

namespace kbit {
namespace {

constexpr int kRouteThreads = 1024;
constexpr int kRouteMaxExperts = kMaxLocalExperts;  // 2 ints per expert of shared memory (32 KiB)
constexpr int kEltThreads = 256;        // elementwise kernels: 4 elements per thread
constexpr int kEltPerBlock = 4 * kEltThreads;

__device__ __forceinline__ int2 add2(int2 a, int2 b) { return make_int2(a.x + b.x, a.y + b.y); }

// Inclusive scan of one int2 per thread over the block (warp shuffles, then the warp totals).
__device__ __forceinline__ int2 block_inclusive_scan(int2 v, int2* warp_totals) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int off = 1; off < 32; off *= 2) {
    const int2 n = make_int2(__shfl_up_sync(0xFFFFFFFFu, v.x, off), __shfl_up_sync(0xFFFFFFFFu, v.y, off));
    if (lane >= off) v = add2(v, n);
  }
  if (lane == 31) warp_totals[warp] = v;
  __syncthreads();
  if (warp == 0) {
    int2 w = lane < kRouteThreads / 32 ? warp_totals[lane] : make_int2(0, 0);
#pragma unroll
    for (int off = 1; off < 32; off *= 2) {
      const int2 n = make_int2(__shfl_up_sync(0xFFFFFFFFu, w.x, off), __shfl_up_sync(0xFFFFFFFFu, w.y, off));
      if (lane >= off) w = add2(w, n);
    }
    if (lane < kRouteThreads / 32) warp_totals[lane] = w;
  }
  __syncthreads();
  return warp > 0 ? add2(v, warp_totals[warp - 1]) : v;
}

__global__ void __launch_bounds__(kRouteThreads)
    moe_route_kernel(const int* __restrict__ ids, int S, const int* __restrict__ expert_map, int map_len, int E,
                     int chunk_rows, int* __restrict__ offsets, int* __restrict__ pos, int* __restrict__ slot_of,
                     int4* __restrict__ chunks, int max_chunks, int* __restrict__ num_chunks) {
  extern __shared__ int smem[];
  int* count = smem;      // [E] tokens per expert
  int* start = smem + E;  // [E + 1] first row per expert, then the local total
  __shared__ int2 warp_totals[kRouteThreads / 32];
  __shared__ int used_chunks;
  const int tid = threadIdx.x;
  for (int e = tid; e < E; e += kRouteThreads) count[e] = 0;  // shared memory only: may overlap the previous kernel
  pdl_wait();                 // ids come from the previous kernels, and pos etc. may be memory they still read
  pdl_launch_dependents();    // one CTA: the next kernel's CTAs may take the other SMs now
  __syncthreads();
  // The rank within the expert parks in pos (this thread reads it back below: same s, same thread).
  for (int s = tid; s < S; s += kRouteThreads) {
    const int e = local_expert(ids[s], expert_map, map_len, E);
    pos[s] = e >= 0 ? atomicAdd(&count[e], 1) : -1;
  }
  __syncthreads();
  // Thread t owns experts [t * per, (t + 1) * per): their rows and chunks follow its exclusive prefix.
  const int per = (E + kRouteThreads - 1) / kRouteThreads;
  const int e0 = min(E, tid * per), e1 = min(E, e0 + per);
  int2 mine = make_int2(0, 0);
  for (int e = e0; e < e1; ++e) mine = add2(mine, make_int2(count[e], (count[e] + chunk_rows - 1) / chunk_rows));
  const int2 incl = block_inclusive_scan(mine, warp_totals);
  int row = incl.x - mine.x, chunk = incl.y - mine.y;
  for (int e = e0; e < e1; ++e) {
    const int c = count[e];
    start[e] = row;
    offsets[e] = row;
    for (int q = 0; q * chunk_rows < c && chunk + q < max_chunks; ++q) {
      chunks[chunk + q] = make_int4(e, row + q * chunk_rows, min(chunk_rows, c - q * chunk_rows), 0);
    }
    row += c;
    chunk += (c + chunk_rows - 1) / chunk_rows;
  }
  if (tid == kRouteThreads - 1) {
    start[E] = incl.x;
    offsets[E] = incl.x;
    num_chunks[0] = used_chunks = min(incl.y, max_chunks);
  }
  __syncthreads();
  // Unused chunk entries get expert -1 and no rows: the grouped GEMV loads its entry before it
  // knows whether the entry is in use, so every entry it can load holds defined values.
  for (int q = used_chunks + tid; q < max_chunks; q += kRouteThreads) chunks[q] = make_int4(-1, 0, 0, 0);
  for (int s = tid; s < S; s += kRouteThreads) {
    const int r = pos[s];
    if (r >= 0) {
      const int p = start[local_expert(ids[s], expert_map, map_len, E)] + r;
      pos[s] = p;
      slot_of[p] = s;
    }
  }
  for (int p = start[E] + tid; p < S; p += kRouteThreads) slot_of[p] = -1;
}

// ----------------------------------------------------------------------------- 4-element vectors

template <typename T>
struct Vec4;

template <>
struct Vec4<float> {
  __device__ static __forceinline__ float4 load(const float* p) { return __ldg(reinterpret_cast<const float4*>(p)); }
  __device__ static __forceinline__ void store(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
};

// 16-bit types: 4 elements are one 8-byte access, converted through fp32 (exact widening, one rounding).
template <typename T, typename T2, float2 (*kWiden)(T2), T2 (*kNarrow)(float2)>
struct Vec4Half {
  __device__ static __forceinline__ float4 load(const T* p) {
    const uint2 raw = __ldg(reinterpret_cast<const uint2*>(p));
    T2 a, b;
    memcpy(&a, &raw.x, 4);
    memcpy(&b, &raw.y, 4);
    const float2 lo = kWiden(a), hi = kWiden(b);
    return make_float4(lo.x, lo.y, hi.x, hi.y);
  }
  // v rounded to T and widened back.
  __device__ static __forceinline__ float4 round(float4 v) {
    const float2 lo = kWiden(kNarrow(make_float2(v.x, v.y))), hi = kWiden(kNarrow(make_float2(v.z, v.w)));
    return make_float4(lo.x, lo.y, hi.x, hi.y);
  }
  __device__ static __forceinline__ void store(T* p, float4 v) {
    const T2 a = kNarrow(make_float2(v.x, v.y)), b = kNarrow(make_float2(v.z, v.w));
    uint2 raw;
    memcpy(&raw.x, &a, 4);
    memcpy(&raw.y, &b, 4);
    *reinterpret_cast<uint2*>(p) = raw;
  }
};
__device__ __forceinline__ float2 widen_bf16(__nv_bfloat162 v) { return __bfloat1622float2(v); }
__device__ __forceinline__ __nv_bfloat162 narrow_bf16(float2 v) { return __float22bfloat162_rn(v); }
__device__ __forceinline__ float2 widen_half(__half2 v) { return __half22float2(v); }
__device__ __forceinline__ __half2 narrow_half(float2 v) { return __float22half2_rn(v); }
template <>
struct Vec4<__nv_bfloat16> : Vec4Half<__nv_bfloat16, __nv_bfloat162, widen_bf16, narrow_bf16> {};
template <>
struct Vec4<__half> : Vec4Half<__half, __half2, widen_half, narrow_half> {};

__device__ __forceinline__ float4 scale4(float4 v, float s) { return make_float4(v.x * s, v.y * s, v.z * s, v.w * s); }

// ----------------------------------------------------------------------------- elementwise kernels

// Grid (S, H / kEltPerBlock): row p of xp from its token's row of x.
template <typename T>
__global__ void __launch_bounds__(kEltThreads)
    moe_gather_kernel(const T* __restrict__ x, const int* __restrict__ slot_of, const float* __restrict__ slot_weight,
                      int top_k, int H, __nv_bfloat16* __restrict__ xp) {
  pdl_wait();                // slot_of and x come from the previous kernels; xp may be memory they still read
  pdl_launch_dependents();   // tiny kernel: let the grouped MMA start its prologue now
  const int p = blockIdx.x, h = (blockIdx.y * kEltThreads + threadIdx.x) * 4;
  if (h >= H) return;
  const int s = slot_of[p];
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
  if (s >= 0) {
    v = Vec4<T>::load(x + static_cast<int64_t>(s / top_k) * H + h);
    if (slot_weight != nullptr) {  // like the reference: x * w rounded to x's dtype
      v = Vec4<T>::round(scale4(v, slot_weight[s]));
    }
  }
  Vec4<__nv_bfloat16>::store(xp + static_cast<int64_t>(p) * H + h, v);
}

// Grid (S, I / kEltPerBlock). T: bf16 (the grouped paths) or fp16 (the stage ops on fp16 activations).
template <typename T>
__global__ void __launch_bounds__(kEltThreads)
    moe_silu_mul_kernel(const T* __restrict__ g, int I, T* __restrict__ h) {
  pdl_wait();                // g is the previous kernel's output; h may be memory it still reads
  pdl_launch_dependents();   // tiny kernel: let the down projection start its prologue now
  const int p = blockIdx.x, i = (blockIdx.y * kEltThreads + threadIdx.x) * 4;
  if (i >= I) return;
  const float4 a = Vec4<T>::load(g + static_cast<int64_t>(p) * 2 * I + i);
  const float4 b = Vec4<T>::load(g + static_cast<int64_t>(p) * 2 * I + I + i);
  Vec4<T>::store(h + static_cast<int64_t>(p) * I + i,
                 make_float4(silu(a.x) * b.x, silu(a.y) * b.y, silu(a.z) * b.z, silu(a.w) * b.w));
}

// Grid (T, H / kEltPerBlock): the token's top_k rows summed in slot order.
template <typename Y, typename T>
__global__ void __launch_bounds__(kEltThreads)
    moe_combine_kernel(const Y* __restrict__ y, const int* __restrict__ pos, const float* __restrict__ weights,
                       int top_k, int H, T* __restrict__ out) {
  pdl_wait();                // y and pos come from the previous kernels; out may be memory they still read
  pdl_launch_dependents();   // tiny kernel: whatever follows may start its prologue now
  const int t = blockIdx.x, h = (blockIdx.y * kEltThreads + threadIdx.x) * 4;
  if (h >= H) return;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int j = 0; j < top_k; ++j) {
    const int s = t * top_k + j, p = pos[s];
    if (p < 0) continue;
    const float w = weights != nullptr ? weights[s] : 1.f;
    const float4 v = Vec4<Y>::load(y + static_cast<int64_t>(p) * H + h);
    acc = make_float4(fmaf(w, v.x, acc.x), fmaf(w, v.y, acc.y), fmaf(w, v.z, acc.z), fmaf(w, v.w, acc.w));
  }
  Vec4<T>::store(out + static_cast<int64_t>(t) * H + h, acc);
}

dim3 elt_grid(int64_t rows, int64_t cols) {
  return dim3(static_cast<unsigned>(rows), static_cast<unsigned>((cols + kEltPerBlock - 1) / kEltPerBlock));
}

template <typename F>
void dispatch_half(at::ScalarType t, const char* what, F&& f) {
  if (t == at::kBFloat16) return f(__nv_bfloat16{});
  KBIT_CHECK(t == at::kHalf, "kbit moe ", what, ": dtype ", t, " is not supported; supported: bfloat16, float16");
  f(__half{});
}

}  // namespace

void launch_moe_route(const at::Tensor& topk_ids, const std::optional<at::Tensor>& expert_map, int64_t num_experts,
                      int64_t chunk_rows, at::Tensor& offsets, at::Tensor& pos, at::Tensor& slot_of, at::Tensor& chunks,
                      at::Tensor& num_chunks, bool pdl) {
  KBIT_CHECK(num_experts >= 1 && num_experts <= kRouteMaxExperts, "kbit fused_moe: ", num_experts,
              " local experts; supported: 1..", kRouteMaxExperts);
  const int64_t S = topk_ids.numel();
  KBIT_CHECK(S <= INT32_MAX / 2, "kbit fused_moe: too many slots (", S, ")");
  KBIT_CHECK(chunk_rows >= 1 && chunk_rows <= kMoeWsChunkRows, "kbit fused_moe: chunk_rows must be in 1..",
              kMoeWsChunkRows);
  const int E = static_cast<int>(num_experts);
  const size_t smem = (2 * static_cast<size_t>(E) + 1) * sizeof(int);
  launch_kernel(moe_route_kernel, dim3(1), dim3(kRouteThreads), smem, at::cuda::getCurrentCUDAStream(), 0, pdl,
      topk_ids.data_ptr<int>(), static_cast<int>(S), expert_map.has_value() ? expert_map->data_ptr<int>() : nullptr,
      expert_map.has_value() ? static_cast<int>(expert_map->numel()) : 0, E, static_cast<int>(chunk_rows),
      offsets.data_ptr<int>(),
      pos.data_ptr<int>(), slot_of.data_ptr<int>(), reinterpret_cast<int4*>(chunks.data_ptr<int>()),
      static_cast<int>(chunks.size(0)), num_chunks.data_ptr<int>());
}

void launch_moe_gather(const at::Tensor& x, const at::Tensor& slot_of, const std::optional<at::Tensor>& slot_weight,
                       int64_t top_k, at::Tensor& xp, bool pdl) {
  const int64_t S = xp.size(0), H = xp.size(1);
  if (S == 0) return;
  dispatch_half(x.scalar_type(), "gather", [&](auto tag) {
    using T = decltype(tag);
    launch_kernel(moe_gather_kernel<T>, elt_grid(S, H), dim3(kEltThreads), 0, at::cuda::getCurrentCUDAStream(), 0, pdl,
        reinterpret_cast<const T*>(x.data_ptr()), slot_of.data_ptr<int>(),
        slot_weight.has_value() ? slot_weight->data_ptr<float>() : nullptr, static_cast<int>(top_k),
        static_cast<int>(H), reinterpret_cast<__nv_bfloat16*>(xp.data_ptr()));
  });
}

void launch_moe_silu_mul(const at::Tensor& g, at::Tensor& h, bool pdl) {
  const int64_t S = h.size(0), I = h.size(1);
  if (S == 0) return;
  KBIT_CHECK(g.scalar_type() == h.scalar_type(), "kbit moe silu_mul: g and h must have one dtype");
  dispatch_half(h.scalar_type(), "silu_mul", [&](auto tag) {
    using T = decltype(tag);
    launch_kernel(moe_silu_mul_kernel<T>, elt_grid(S, I), dim3(kEltThreads), 0, at::cuda::getCurrentCUDAStream(), 0,
                  pdl, reinterpret_cast<const T*>(g.data_ptr()), static_cast<int>(I), reinterpret_cast<T*>(h.data_ptr()));
  });
}

void launch_moe_combine(const at::Tensor& y, const at::Tensor& pos, const std::optional<at::Tensor>& weights,
                        int64_t top_k, at::Tensor& out, bool pdl) {
  const int64_t T = out.size(0), H = out.size(1);
  if (T == 0) return;
  const float* w = weights.has_value() ? weights->data_ptr<float>() : nullptr;
  dispatch_half(out.scalar_type(), "combine", [&](auto out_tag) {
    using T_ = decltype(out_tag);
    const auto go = [&](auto y_tag) {
      using Y = decltype(y_tag);
      launch_kernel(moe_combine_kernel<Y, T_>, elt_grid(T, H), dim3(kEltThreads), 0, at::cuda::getCurrentCUDAStream(),
          0, pdl, reinterpret_cast<const Y*>(y.data_ptr()), pos.data_ptr<int>(), w, static_cast<int>(top_k),
          static_cast<int>(H), reinterpret_cast<T_*>(out.data_ptr()));
    };
    if (y.scalar_type() == at::kFloat) {
      go(float{});
    } else {
      dispatch_half(y.scalar_type(), "combine", go);  // the stage ops' scatter of fp16 routed-GEMV rows too
    }
  });
}

}  // namespace kbit
