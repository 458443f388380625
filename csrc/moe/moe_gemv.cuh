// Grouped kbit GEMV for routed experts: every (expert, chunk of <= 4 rows) of one projection in
// one launch, on the dense GEMV's tile/dequant core (gemv_core.cuh). The launcher is in
// moe_gemv.cu; the down stage is instantiated in moe_gemv_down.cu so the two compile in parallel.
//
// Scheduler. The grid is max_chunks x n_tiles x splits CTAs, sized from the shapes alone
// (moe_max_chunks bounds the chunks any routing can need); a CTA reads its chunk {expert,
// first row, rows} from the routing output and leaves at once if the routing made fewer
// chunks, so experts without tokens cost neither bandwidth nor more than an empty CTA. The
// splits of one (chunk, n-tile) are a thread-block cluster summed through distributed shared
// memory exactly like the dense GEMV. Rows of an expert beyond 4 become further chunks, which
// re-read the expert's tiles (mostly from L2, the chunks of an expert run side by side).
//
// Direct mode (no chunk list): CTA row s is slot s, one row, its expert read from topk_ids. Nothing is
// grouped (at few slots, re-reading a shared expert costs less than routing) and no routing kernel
// runs; the down stage then also does the weighted combine: each CTA parks its fp32 rows, and the
// last of a token's top_k CTAs of an n-tile to arrive (an atomic counter per token and n-tile) sums
// them in slot order.
#pragma once

#include "local_expert.cuh"
#include "moe.cuh"
#include "gemv.cuh"
#include "gemv_core.cuh"

#include <type_traits>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include "activation.cuh"
#include "check.h"
#include "launch_utils.cuh"

namespace kbit {
namespace moe_gemv {

using namespace gemv_core;

static_assert(kMoeChunkRows == kGemvMaxM, "a chunk is one GEMV's worth of activation rows");

struct MoeGemvParams {
  const void* A;              // x [T, K] (kGather) or the gate_up output [S, 2K] (kSiluMul)
  const int* slot_of;         // [S] slot of permuted row p; null: row p of A is row p
  const float* slot_weight;   // [S] router weights by slot, applied to the input; may be null
  int top_k;
  const int4* chunks;         // {expert, first row, rows, 0}
  const int* num_chunks;      // valid chunks (device)
  const uint4* qweight;       // stacked runtime planes of all experts
  const uint32_t* absmax;     // stacked runtime scale codes, 4 per word
  int64_t expert_vectors;     // 16-byte plane vectors per expert
  int64_t expert_code_words;  // scale-code words per expert
  const float* codebook;
  void* C;                    // [S, N]
  int N, K, n_tiles, k_tiles, splits;
  // Direct mode only (chunks == nullptr): chunk s is slot s, expert local_expert(ids[s]).
  const int* ids;             // [S] global expert ids
  const int* expert_map;      // [map_len] global -> local id, -1 elsewhere; may be null
  int map_len, num_experts;
  int* arrivals;              // [T, n_tiles of the down projection]: CTAs done per token and n-tile
  int zero_arrivals;          // kGather: counters this launch zeroes for the down stage after it
  const float* combine_weight;  // kSiluMul: [S] router weights of the combine, null: all 1
  void* out;                  // kSiluMul: [T, N] in the activations' dtype; null: no combine
  rotate_core::FusedRotation rot;  // the rotated instances (ROT): x · R of each staged row (signs over K)
};

// Output element types: the activations' dtype for gate_up, fp32 for down (the combine sums it).
template <typename O>
struct Out {
  __device__ static __forceinline__ O narrow(float v) { return Act<O>::narrow(v); }
};
template <>
struct Out<float> {
  __device__ static __forceinline__ float narrow(float v) { return v; }
};

// One chunk of M rows on one (n-tile, split). Row sources are resolved once per CTA (M pointers
// and weights in registers), so staging a k-tile is plain loads. ready() runs after the first weight
// tile is requested and before any activation load (the direct down stage's PDL wait). ROT: each staged
// row is rotated in registers after it is widened: gate_up's x (after the router weight, where the input
// takes it), down's silu(gate) * up.
template <typename T, typename O, int BITS, MoeStage STAGE, bool kTable, int ROT, int M, bool kPairs = true,
          typename Ready>
__device__ __forceinline__ void run_chunk(const MoeGemvParams& p, int expert, int row0, int n_tile, int split,
                                          float4* a_stage, float* warp_sums, float* cta_sums, uint8_t* lut,
                                          Ready&& ready) {
  const int warp = __shfl_sync(0xFFFFFFFFu, static_cast<int>(threadIdx.x) / 32, 0), lane = threadIdx.x % 32;
  const T* src[M];
  float scale[M];
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const int row = row0 + m;
    scale[m] = 1.f;
    if constexpr (STAGE == MoeStage::kGather) {
      // Without slot_of the row is the slot: direct mode (top_k > 1), or rows already gathered (top_k = 1).
      const int slot = p.slot_of != nullptr ? __ldg(p.slot_of + row) : row;
      const int src_row = slot / p.top_k;
      src[m] = static_cast<const T*>(p.A) + static_cast<int64_t>(src_row) * p.K;
      if (p.slot_weight != nullptr) scale[m] = __ldg(p.slot_weight + slot);
    } else {
      src[m] = static_cast<const T*>(p.A) + static_cast<int64_t>(row) * 2 * p.K;
    }
  }
  const bool weighted = STAGE == MoeStage::kGather && p.slot_weight != nullptr;
  // Raw activations: 4 elements (kGather), or 4 gate and 4 up elements (kSiluMul).
  const auto fetch = [&](int m, int e) {
    uint4 raw = {};
    const uint2 x = __ldg(reinterpret_cast<const uint2*>(src[m] + e));
    raw.x = x.x, raw.y = x.y;
    if constexpr (STAGE == MoeStage::kSiluMul) {
      const uint2 up = __ldg(reinterpret_cast<const uint2*>(src[m] + p.K + e));
      raw.z = up.x, raw.w = up.y;
    }
    return raw;
  };
  const auto widen = [&](int m, uint4 raw) {
    float2 lo = Act<T>::widen(raw.x), hi = Act<T>::widen(raw.y);
    if constexpr (STAGE == MoeStage::kSiluMul) {
      const float2 ulo = Act<T>::widen(raw.z), uhi = Act<T>::widen(raw.w);
      return make_float4(silu(lo.x) * ulo.x, silu(lo.y) * ulo.y, silu(hi.x) * uhi.x, silu(hi.y) * uhi.y);
    } else {
      if (weighted) {  // the reference rounds x * w to the activations' dtype before the matmul
        const auto r = [&](float v) { return Act<T>::to_float(Act<T>::narrow(v * scale[m])); };
        lo = make_float2(r(lo.x), r(lo.y));
        hi = make_float2(r(hi.x), r(hi.y));
      }
      return make_float4(lo.x, lo.y, hi.x, hi.y);
    }
  };
  const int kt_begin = split * p.k_tiles / p.splits, kt_end = (split + 1) * p.k_tiles / p.splits;
  float acc[kRowsPerLane][M];
  accumulate<T, BITS, M, kTable ? 4 : 0, ROT, kPairs>(p.qweight + expert * p.expert_vectors,
                                              p.absmax + expert * p.expert_code_words, p.codebook,
                                              static_cast<int64_t>(n_tile) * p.k_tiles, kt_begin, kt_end, p.K, warp,
                                              lane, a_stage + warp * kGemvMaxM * 32, lut, fetch, widen, ready, p.rot,
                                              acc);
  reduce_and_store<M>(acc, warp_sums, cta_sums, warp, lane, split, p.splits, [&](int m, int r, float v) {
    const int n = n_tile * kTileN + r;
    if (n < p.N) static_cast<O*>(p.C)[static_cast<int64_t>(row0 + m) * p.N + n] = Out<O>::narrow(v);
  });
}

// Direct down stage: after this CTA stored its rows of slot s's fp32 output, counts it done for
// (token, n-tile); the last of the token's top_k CTAs sums their rows into out, j in order with the
// same fmaf chain as launch_moe_combine, so the result is the routed path's bit for bit. Slots
// without a local expert count too and add nothing. Called by split 0 of a cluster only (it stored).
template <typename T>
__device__ __forceinline__ void combine_if_last(const MoeGemvParams& p, int slot, int n_tile) {
  __shared__ int is_last;
  __threadfence();  // this CTA's stores of C are visible device-wide before it counts as done
  __syncthreads();
  const int t = slot / p.top_k;
  if (threadIdx.x == 0) is_last = atomicAdd(p.arrivals + t * p.n_tiles + n_tile, 1) == p.top_k - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();  // the other CTAs' stores, fenced before their arrivals, are seen below (L2 reads)
  const float* y = static_cast<const float*>(p.C);
  for (int r = threadIdx.x; r < kTileN; r += kThreads) {
    const int n = n_tile * kTileN + r;
    if (n >= p.N) break;
    float acc = 0.f;
    for (int j = 0; j < p.top_k; ++j) {
      const int s = t * p.top_k + j;
      if (local_expert(__ldg(p.ids + s), p.expert_map, p.map_len, p.num_experts) < 0) continue;
      const float w = p.combine_weight != nullptr ? __ldg(p.combine_weight + s) : 1.f;
      acc = fmaf(w, __ldcg(y + static_cast<int64_t>(s) * p.N + n), acc);
    }
    static_cast<T*>(p.out)[static_cast<int64_t>(t) * p.N + n] = Act<T>::narrow(acc);
  }
}

// Both PDL steps of a grid whose wait comes later than its entry.
__device__ __forceinline__ void pdl_wait_and_release() {
  pdl_wait();                // A (gate_up's output) and the arrival counters come from the previous grid
  pdl_launch_dependents();   // the rest only streams weights: the next kernel may start its prologue
}

// Direct mode (no chunk list): CTA row s is slot s with one row. kGather's first CTA also zeroes the
// down stage's arrival counters (that stage starts after this grid completes: its PDL wait).
// The down stage (kSiluMul) enters before that wait: its expert comes from topk_ids, which the grid
// before gate_up wrote (complete once any gate_up CTA passed its wait, so read from L2 with ld.cg),
// and weights never change, so its first weight tile is in flight while gate_up finishes; the wait
// comes before the activations are read and anything is written.
template <typename T, typename O, int BITS, MoeStage STAGE, bool kTable, int ROT>
__device__ __forceinline__ void run_direct(const MoeGemvParams& p, int slot, int n_tile, int split, float4* a_stage,
                                           float* warp_sums, float* cta_sums, uint8_t* lut) {
  if (STAGE == MoeStage::kGather && blockIdx.x == 0) {
    for (int i = threadIdx.x; i < p.zero_arrivals; i += kThreads) p.arrivals[i] = 0;
  }
  const int expert = local_expert(__ldcg(p.ids + slot), p.expert_map, p.map_len, p.num_experts);
  if constexpr (STAGE == MoeStage::kSiluMul) {
    if (expert >= 0) {
      run_chunk<T, O, BITS, STAGE, kTable, ROT, 1>(p, expert, slot, n_tile, split, a_stage, warp_sums, cta_sums, lut,
                                                   pdl_wait_and_release);
    } else {
      pdl_wait_and_release();
    }
    if (p.out != nullptr && split == 0) combine_if_last<T>(p, slot, n_tile);
  } else {
    if (expert >= 0) {
      run_chunk<T, O, BITS, STAGE, kTable, ROT, 1>(p, expert, slot, n_tile, split, a_stage, warp_sums, cta_sums, lut,
                                                   [] {});
    }
  }
}

// Grid: max_chunks * n_tiles * splits CTAs, clusters of `splits` (CTA = (chunk * n_tiles +
// n-tile) * splits + split). All CTAs of a cluster share the chunk, so they leave together.
template <typename T, typename O, int BITS, MoeStage STAGE, int MAX_ROWS, bool kTable, int ROT>
__device__ __forceinline__ void moe_gemv_body(const MoeGemvParams& p) {
  __shared__ float4 a_stage[kWarps * kGemvMaxM * 32];
  __shared__ float warp_sums[kWarps * kGemvMaxM * kTileN];
  __shared__ float cta_sums[kGemvMaxM * kTileN];
  extern __shared__ __align__(16) uint8_t lut[];  // kTable: the decode table (Lut<BITS>::kBytes)
  // The expert of this CTA comes from the routing kernel, so nothing useful precedes the wait; the
  // direct down stage waits later (run_direct).
  if (STAGE == MoeStage::kGather || p.chunks != nullptr) {
    pdl_wait();                // chunks/num_chunks and A come from earlier kernels; C may be memory they still read
    pdl_launch_dependents();   // the rest only streams weights: the next kernel may start its prologue
  }
  const int per_chunk = p.n_tiles * p.splits;
  const int chunk = blockIdx.x / per_chunk;
  if (p.chunks == nullptr) {
    if constexpr (MAX_ROWS == 1) {
      run_direct<T, O, BITS, STAGE, kTable, ROT>(p, chunk, (blockIdx.x % per_chunk) / p.splits, blockIdx.x % p.splits,
                                            a_stage, warp_sums, cta_sums, lut);
    }
    return;
  }
  // Both loads in flight at once (chunk < max_chunks, so its entry exists even when unused): one
  // memory round trip before the CTA knows its expert instead of two.
  const int valid_chunks = __ldg(p.num_chunks);
  const int4 c = __ldg(p.chunks + chunk);
  if (chunk >= valid_chunks) return;
  const int n_tile = (blockIdx.x % per_chunk) / p.splits, split = blockIdx.x % p.splits;
  // Through a shuffle from lane 0, so the compiler sees the row count as warp-uniform and the
  // shuffles inside the core stay plain (see gemv.cu).
  const int rows = __shfl_sync(0xFFFFFFFFu, c.z, 0);
  // The 4-row kernel keeps a row's arithmetic the same in chunks of any height (gemv_core.cuh, dot_block's kPairs):
  // the routing orders an expert's slots by atomics, so which of them share a chunk changes from call to call.
  const auto run = [&](auto rows_c) {
    run_chunk<T, O, BITS, STAGE, kTable, ROT, decltype(rows_c)::value, MAX_ROWS == 1>(
        p, c.x, c.y, n_tile, split, a_stage, warp_sums, cta_sums, lut, [] {});
  };
  if constexpr (MAX_ROWS == 1) {
    run(std::integral_constant<int, 1>{});
  } else {
    switch (rows) {
      case 1: return run(std::integral_constant<int, 1>{});
      case 2: return run(std::integral_constant<int, 2>{});
      case 3: return run(std::integral_constant<int, 3>{});
      default: return run(std::integral_constant<int, 4>{});
    }
  }
}

template <typename T, typename O, int BITS, MoeStage STAGE, int MAX_ROWS, bool kTable, int ROT>
__global__ void __launch_bounds__(kThreads) moe_gemv_kernel(const __grid_constant__ MoeGemvParams p) {
  moe_gemv_body<T, O, BITS, STAGE, MAX_ROWS, kTable, ROT>(p);
}

// The rotated one-row kernels at k <= 4 (the direct GEMV at decode), capped at 4 CTAs per SM (128 registers), the
// occupancy of their unrotated instances: uncapped, the rotation took the direct down kernel to 167 registers at
// k = 4, 3 CTAs per SM, and its decode grid a second wave. A kernel of its own, since any minimum-CTA bound changes
// how ptxas allocates the other instances' registers (k = 5 and the 4-row kernels keep theirs, uncapped).
template <int BITS, int MAX_ROWS, int ROT>
constexpr bool moe_gemv_capped() {
  return ROT && MAX_ROWS == 1 && BITS <= 4;
}
template <typename T, typename O, int BITS, MoeStage STAGE, int MAX_ROWS, bool kTable, int ROT>
__global__ void __launch_bounds__(kThreads, 4) moe_gemv_kernel_capped(const __grid_constant__ MoeGemvParams p) {
  moe_gemv_body<T, O, BITS, STAGE, MAX_ROWS, kTable, ROT>(p);
}

template <typename T, typename O, int BITS, MoeStage STAGE, int MAX_ROWS, bool kTable, int ROT>
auto moe_gemv_kernel_of() {
  if constexpr (moe_gemv_capped<BITS, MAX_ROWS, ROT>()) {
    return moe_gemv_kernel_capped<T, O, BITS, STAGE, MAX_ROWS, kTable, ROT>;
  } else {
    return moe_gemv_kernel<T, O, BITS, STAGE, MAX_ROWS, kTable, ROT>;
  }
}

// What one launch takes besides the kernel's parameters: the grid rows (chunks, or slots for the direct mode),
// the chunk height (1: the one-row kernel) and, from the plan, the decode and programmatic dependent launch.
struct StageLaunch {
  bool bf16;
  int bits, chunk_rows, grid_rows;
  int table_blocks;  // 0 (shuffle) or 4 (table: gemv_table_blocks, grouped)
  bool pdl;
  const char* kernel;  // the name the launch is recorded under
};

template <typename T, typename O, int BITS, MoeStage STAGE, int MAX_ROWS, int ROT>
void launch_typed_rot(const MoeGemvParams& p, const StageLaunch& s) {
  const auto launch = [&](auto kernel, size_t smem, int table_blocks) {
    const dim3 grid(static_cast<unsigned>(static_cast<int64_t>(s.grid_rows) * p.n_tiles * p.splits));
    record_launch({s.kernel, 0, 0, s.grid_rows, grid.x / (static_cast<unsigned>(s.grid_rows) * p.splits), p.splits, 0,
                   table_blocks, s.pdl, ROT ? InputRotation::kFused : InputRotation::kNone});
    launch_kernel(kernel, grid, dim3(kThreads), smem, at::cuda::getCurrentCUDAStream(), p.splits, s.pdl, p);
  };
  if constexpr (gemv_table_possible(BITS, MAX_ROWS)) {
    if (s.table_blocks == 4) {
      return launch(moe_gemv_kernel_of<T, O, BITS, STAGE, MAX_ROWS, true, ROT>(), Lut<BITS>::kBytes, 4);
    }
  }
  KBIT_CHECK(s.table_blocks == 0, "kbit moe gemv: no kernel decodes ", s.table_blocks,
             " blocks of each k-tile by table at k=", BITS, " with chunks of ", MAX_ROWS, " rows");
  launch(moe_gemv_kernel_of<T, O, BITS, STAGE, MAX_ROWS, false, ROT>(), 0, 0);
}

// The rotated instances of the launch's kind where it rotates (p.rot.signs set), the unrotated (today's code) elsewhere.
// The gather stage rotates only as the kbit stage ops' down projection (SiLU * up computed apart for LoRA's hooks;
// fused_moe rotates the hidden states apart): one rotated instance serves every block there (kRotMix checks the
// block's k-tiles at run time), so that path adds no instances.
template <typename T, typename O, int BITS, MoeStage STAGE, int MAX_ROWS>
void launch_typed(const MoeGemvParams& p, const StageLaunch& s) {
  rotate_core::with_rot_kind(p.rot, [&](auto kind) {
    constexpr int kKind = decltype(kind)::value;
    constexpr bool kOneRotated = STAGE == MoeStage::kGather && kKind == rotate_core::kRotTile;
    launch_typed_rot<T, O, BITS, STAGE, MAX_ROWS, kOneRotated ? rotate_core::kRotMix : kKind>(p, s);
  });
}

template <typename T, typename O, MoeStage STAGE, int MAX_ROWS>
void launch_bits(const MoeGemvParams& p, const StageLaunch& s) {
  with_bits(s.bits, "kbit moe gemv", [&](auto k) { launch_typed<T, O, decltype(k)::value, STAGE, MAX_ROWS>(p, s); });
}

// One stage for both activation dtypes and both chunk sizes (1 row: T = 1, registers of a
// one-row GEMV; up to 4 rows otherwise). Instantiated once per stage, in its own file.
template <MoeStage STAGE>
void launch_moe_gemv_stage(const MoeGemvParams& p, const StageLaunch& s) {
  using O16 = std::conditional_t<STAGE == MoeStage::kGather, __nv_bfloat16, float>;
  using O16h = std::conditional_t<STAGE == MoeStage::kGather, __half, float>;
  if (s.bf16) {
    if (s.chunk_rows == 1) return launch_bits<__nv_bfloat16, O16, STAGE, 1>(p, s);
    return launch_bits<__nv_bfloat16, O16, STAGE, kMoeChunkRows>(p, s);
  }
  if (s.chunk_rows == 1) return launch_bits<__half, O16h, STAGE, 1>(p, s);
  return launch_bits<__half, O16h, STAGE, kMoeChunkRows>(p, s);
}


extern template void launch_moe_gemv_stage<MoeStage::kSiluMul>(const MoeGemvParams&, const StageLaunch&);

}  // namespace moe_gemv
}  // namespace kbit
