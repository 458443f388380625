// The GEMV tile/dequant core shared by the dense GEMV (gemv.cu) and the grouped MoE GEMV
// (moe_gemv.cu): how a warp streams runtime tiles, dequantizes a block and multiplies it into
// up to 4 activation rows, and how the warps and the split-K cluster of one n-tile are summed.
// The schedulers (which n-tile, which K split, which activation rows) live in the kernels.
// The block dequantization steps themselves are dequant_core.cuh (shared with mma_*.cuh).
#pragma once

#include "dequant_core.cuh"
#include "kbit_format.cuh"
#include "rotate_core.cuh"

#include <cooperative_groups.h>

namespace kbit {
namespace gemv_core {

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

// The codebook registers of a lane: value[lane mod 2^k] for the shuffle lookup, and for the k = 2 pair
// tables (pair_tables) the two values of pair v = lane mod 16: lo = codebook[v & 3], hi = codebook[v >> 2].
struct LaneCodebook {
  float value, lo, hi;
};

template <int BITS>
__device__ __forceinline__ LaneCodebook lane_codebook(const float* __restrict__ codebook, int lane) {
  LaneCodebook cb;
  cb.value = __ldg(codebook + (lane & ((1 << BITS) - 1)));
  cb.lo = BITS == 2 ? __ldg(codebook + (lane & 3)) : 0.f;
  cb.hi = BITS == 2 ? __ldg(codebook + ((lane >> 2) & 3)) : 0.f;
  return cb;
}

// Activations 8c .. 8c+7 of block J of all M rows, fp32 from the warp's staging buffer: 4 per 16-byte
// shared load, one address for the whole warp (a broadcast).
template <int M, int J>
__device__ __forceinline__ void stage_octet(const float4* __restrict__ a_stage, int c, float (&a)[M][8]) {
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const float4 lo = a_stage[m * (kTileKB * kBlockSize / 4) + J * (kBlockSize / 4) + 2 * c];
    const float4 hi = a_stage[m * (kTileKB * kBlockSize / 4) + J * (kBlockSize / 4) + 2 * c + 1];
    a[m][0] = lo.x, a[m][1] = lo.y, a[m][2] = lo.z, a[m][3] = lo.w;
    a[m][4] = hi.x, a[m][5] = hi.y, a[m][6] = hi.z, a[m][7] = hi.w;
  }
}

// k = 2, one activation row: a nibble of the runtime words is the index pair of two consecutive
// elements (kbit_format.cuh: byte n of word w = elements 8n + 4w .. + 3), so instead of one shuffle
// and one FMA per weight, lane L first computes entry L mod 16 of the pair's 16 possible partial
// sums, lo * a[e] + hi * a[e + 1] (two FP ops, shared by the lane's two rows), and each row then
// reads its entry with one shuffle and adds it: per weight half a shuffle, half a shift and one FP
// op instead of a shuffle, a shift and an FMA. The shuffle reads the low 5 bits of the shifted
// word (the nibble and the next one's low bit): lanes L and L + 16 hold the same entry.
template <int J>
__device__ __forceinline__ void pair_tables(const float4* __restrict__ a_stage, const LaneCodebook& cb,
                                            const uint32_t (&q)[kRowsPerLane][4], float (&part)[kRowsPerLane][1][2]) {
#pragma unroll
  for (int c = 0; c < kBlockSize / 8; ++c) {
    float a[1][8];
    stage_octet<1, J>(a_stage, c, a);
#pragma unroll
    for (int i = 0; i < 8; i += 2) {
      const int e = 8 * c + i;
      const float entry = fmaf(cb.hi, a[0][i + 1], cb.lo * a[0][i]);
#pragma unroll
      for (int row = 0; row < kRowsPerLane; ++row) {
        const int src = static_cast<int>(q[row][runtime_word_of<2>(e)] >> runtime_shift_of<2>(e));
        part[row][0][(i / 2) & 1] += __shfl_sync(0xFFFFFFFFu, entry, src);
      }
    }
  }
}

// Every k and M: each codebook value by one shuffle, multiplied into all M activation rows; two
// alternating partial sums give the FMAs ILP.
template <int BITS, int M, int J>
__device__ __forceinline__ void shuffle_lookups(const float4* __restrict__ a_stage, const LaneCodebook& cb,
                                                const uint32_t (&q)[kRowsPerLane][Fields<BITS>::kWords],
                                                float (&part)[kRowsPerLane][M][2]) {
#pragma unroll
  for (int c = 0; c < kBlockSize / 8; ++c) {
    float a[M][8];
    stage_octet<M, J>(a_stage, c, a);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
#pragma unroll
      for (int row = 0; row < kRowsPerLane; ++row) {
        const float v = lookup<BITS>(cb.value, q[row], 8 * c + i);
#pragma unroll
        for (int m = 0; m < M; ++m) part[row][m][i & 1] = fmaf(v, a[m][i], part[row][m][i & 1]);
      }
    }
  }
}

// Blocks decoded by table (accumulate's TB; dequant_core.cuh: Lut, entries in the activations' type T): k = 3, 4:
// byte n of index word W is the pair of elements (e, e + 1), e = 8n + 2 (W >> 1) + 4 (W & 1), and its
// entry holds both values; k = 2: byte n of word W is elements 8n + 4W .. +3, and its entry all four.
// So one shared-memory load yields two or four weights where the shuffle path spends a shuffle per
// weight (both go through the MIO pipe, which bounds the shuffle path); widening a bf16 to fp32 is one
// ALU op (Act<T>::widen).
template <typename T, int BITS, int M, int J>
__device__ __forceinline__ void table_pairs(const float4* __restrict__ a_stage, const uint8_t* __restrict__ lut,
                                            uint32_t lut_lane, const uint32_t (&q)[kRowsPerLane][4],
                                            float (&part)[kRowsPerLane][M][2]) {
#pragma unroll
  for (int c = 0; c < kBlockSize / 8; ++c) {
    float a[M][8];
    stage_octet<M, J>(a_stage, c, a);
    if constexpr (Lut<BITS>::kQuad) {
#pragma unroll
      for (int w = 0; w < 2; ++w) {  // elements 8c + 4w .. +3: byte c of word w
#pragma unroll
        for (int row = 0; row < kRowsPerLane; ++row) {
          const uint2 v = *reinterpret_cast<const uint2*>(lut + lut_offset<BITS>(q[row][w], c, lut_lane));
          const float2 lo = Act<T>::widen(v.x), hi = Act<T>::widen(v.y);
          const float x[4] = {lo.x, lo.y, hi.x, hi.y};
#pragma unroll
          for (int m = 0; m < M; ++m)
#pragma unroll
            for (int i = 0; i < 4; ++i) part[row][m][i & 1] = fmaf(x[i], a[m][4 * w + i], part[row][m][i & 1]);
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        constexpr int kWordOfPair[4] = {0, 2, 1, 3};  // pair (8c + 2i, +1) lives in byte c of this word
#pragma unroll
        for (int row = 0; row < kRowsPerLane; ++row) {
          const float2 v = Act<T>::widen(
              *reinterpret_cast<const uint32_t*>(lut + lut_offset<BITS>(q[row][kWordOfPair[i]], c, lut_lane)));
#pragma unroll
          for (int m = 0; m < M; ++m) {
            part[row][m][0] = fmaf(v.x, a[m][2 * i], part[row][m][0]);
            part[row][m][1] = fmaf(v.y, a[m][2 * i + 1], part[row][m][1]);
          }
        }
      }
    }
  }
}

// Adds one block (32 elements along K) of this lane's two rows times all M activation rows: the
// block's index words, its products summed in fp32 (pair tables, the decode table or shuffle lookups),
// and the block scale applied once to the partial sum. kPairs: k = 2 at one row may take the pair tables,
// whose sums round differently from the other decodes; a kernel whose rows go through chunks of 1..4 rows
// (the routed MoE GEMV: which row lands in a one-row chunk depends on the routing) passes false, so a row's
// result does not depend on its chunk.
template <typename T, int BITS, int M, int J, bool kTable, bool kPairs>
__device__ __forceinline__ void dot_block(const float4* __restrict__ a_stage, const LaneCodebook& cb,
                                          const uint8_t* __restrict__ lut, uint32_t lut_lane,
                                          const uint4 (&planes)[kRowsPerLane][BITS],
                                          const uint32_t (&codes)[kRowsPerLane], float (&acc)[kRowsPerLane][M]) {
  constexpr int F = Fields<BITS>::kWords;
  uint32_t q[kRowsPerLane][F];
#pragma unroll
  for (int row = 0; row < kRowsPerLane; ++row) {
    uint32_t plane[BITS];
#pragma unroll
    for (int b = 0; b < BITS; ++b) plane[b] = word(planes[row][b], J);
    if constexpr (kTable && BITS == 3) {
      lut_indices<BITS>(plane, q[row]);  // the folded bits cleared, so a byte is a table row
    } else {
      gather_indices<BITS>(plane, q[row]);
    }
  }
  float part[kRowsPerLane][M][2];
#pragma unroll
  for (int row = 0; row < kRowsPerLane; ++row)
#pragma unroll
    for (int m = 0; m < M; ++m) part[row][m][0] = part[row][m][1] = 0.f;

  if constexpr (BITS == 2 && M == 1 && kPairs) {
    pair_tables<J>(a_stage, cb, q, part);
  } else if constexpr (kTable) {
    table_pairs<T, BITS, M, J>(a_stage, lut, lut_lane, q, part);
  } else {
    shuffle_lookups<BITS, M, J>(a_stage, cb, q, part);
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

// ----------------------------------------------------------------------------- the k-tile loop

// Accumulates this warp's share of k-tiles [kt_begin, kt_end) of row band `band` (n-tile *
// k_tiles) into acc: the warp takes k-tiles kt_begin + warp, + kWarps, ... Activations come in
// two steps so their loads can be issued early: `fetch(m, e)` loads activation row m's elements
// e..e+3 in whatever raw form the caller keeps (called for e < K only; a zero-initialized raw
// value must widen to zeros), `widen(m, raw)` turns that into fp32. a_stage is the warp's own
// staging buffer of M * 32 float4. `ready()` runs once in every thread, after the first weight
// tile's loads are issued and before any activation load (the dense GEMV's PDL wait).
// TB > 0 (k = 2..4): blocks 0..TB-1 of each k-tile decode through the table of pairs / quads at `lut`
// (Lut<BITS>::kBytes of shared memory), which every thread of the CTA fills here: all of them must call this.
// ROT (rotate_core.cuh: kRotNone / kRotTile / kRotMix): the activations are rotated, x · R (fused_rotation), in
// registers right after widening, before they are staged (kRotMix: blocks over 128 mix their k-tiles first); with
// kRotNone `rot` is not read and the code is the unrotated one.
template <typename T, int BITS, int M, int TB, int ROT, bool kPairs = true, typename Fetch, typename Widen,
          typename Ready>
__device__ __forceinline__ void accumulate(const uint4* __restrict__ qweight, const uint32_t* __restrict__ absmax,
                                           const float* __restrict__ codebook, int64_t band, int kt_begin, int kt_end,
                                           int K, int warp, int lane, float4* __restrict__ a_stage,
                                           uint8_t* __restrict__ lut, Fetch&& fetch, Widen&& widen, Ready&& ready,
                                           const rotate_core::FusedRotation& rot, float (&acc)[kRowsPerLane][M]) {
  constexpr bool kTable = TB > 0;
  static_assert(!kTable || BITS <= 4, "the GEMV's decode table is for k = 2..4");
  using Raw = decltype(fetch(0, 0));
  const LaneCodebook cb = lane_codebook<BITS>(codebook, lane);
  uint32_t lut_lane = 0;
  if constexpr (kTable) lut_lane = lut_lane_offset<BITS>(lane);
#pragma unroll
  for (int row = 0; row < kRowsPerLane; ++row)
#pragma unroll
    for (int m = 0; m < M; ++m) acc[row][m] = 0.f;

  // Lane l fetches elements 4l..4l+3 of every activation row of k-tile kt (and with ROT their signs, one
  // 16-byte load shared by the M rows). Elements past K (the last k-tile's padding blocks, whose scales are 0)
  // stay zero, so padding adds exactly nothing; b divides K, so a rotation block is all data or all padding.
  const auto fetch_tile = [&](Raw (&raw)[M], float4& sg, int kt) {
    const int e = kt * kTileKB * kBlockSize + 4 * lane;
#pragma unroll
    for (int m = 0; m < M; ++m) raw[m] = e < K ? fetch(m, e) : Raw{};
    if constexpr (ROT) sg = e < K ? __ldg(reinterpret_cast<const float4*>(rot.signs + e)) : float4{};
  };
  // Software pipeline over this warp's k-tiles, two register buffers used in turn: the next
  // tile's weight loads (and for M <= 2 its activation loads) are issued before the current tile
  // is dequantized, so every warp keeps 2k+2 weight requests in flight while it computes
  // (without it a warp alternates between waiting on memory and computing). Prefetching the
  // activations too saves a load latency per tile (measured 5-20% at M=1, k=2 and 5); at M=4
  // its registers cost more than it saves (the 4-row grouped GEMV went from 168 to 249+
  // registers and 10% slower). Unrolled by two so the buffers swap roles without register copies.
  constexpr bool kPrefetchActivations = M <= 2;
  // ROT, blocks over P = rot.tiles > 1 k-tiles: sums this k-tile and the block's other k-tiles of row m (signs
  // applied), each times its entry in row `own` of H_P (H_b = H_P ⊗ H_128, k-tile bits high), so that one in-tile
  // transform finishes x · R for this k-tile. b divides K, so every k-tile of the block is inside K.
  const auto mix_block_tiles = [&](int m, float4 v, int kt) {
    const int own = kt & (rot.tiles - 1);
    const float c_own = (__popc(own) & 1) ? -1.f : 1.f;  // H_P[own, own]
    v = make_float4(c_own * v.x, c_own * v.y, c_own * v.z, c_own * v.w);
#pragma unroll
    for (int t = 1; t < rotate_core::kFusedMaxTiles; ++t) {
      if (t < rot.tiles) {
        const int other = own ^ t;
        const int e = (kt - own + other) * kTileKB * kBlockSize + 4 * lane;
        const float4 o =
            rotate_core::mul4(widen(m, fetch(m, e)), __ldg(reinterpret_cast<const float4*>(rot.signs + e)));
        const float c = (__popc(own & other) & 1) ? -1.f : 1.f;  // H_P[own, other]
        v = make_float4(fmaf(c, o.x, v.x), fmaf(c, o.y, v.y), fmaf(c, o.z, v.z), fmaf(c, o.w, v.w));
      }
    }
    return v;
  };
  const auto process = [&](const uint4 (&pl)[kRowsPerLane][BITS], const uint32_t (&cd)[kRowsPerLane],
                           Raw (&raw)[M], float4& sg, int kt) {
    if constexpr (!kPrefetchActivations) fetch_tile(raw, sg, kt);
    // The tile's 128 x M activations, widened to fp32 (and rotated) once per warp instead of once per lane.
    __syncwarp();  // every lane is done reading the previous tile's activations
#pragma unroll
    for (int m = 0; m < M; ++m) {
      if constexpr (ROT) {
        float4 v = rotate_core::mul4(widen(m, raw[m]), sg);  // diag(s) first
        if constexpr (ROT == rotate_core::kRotMix) {
          if (rot.tiles > 1) v = mix_block_tiles(m, v, kt);
        }
        a_stage[m * 32 + lane] = rotate_core::hadamard_tile_quad(v, lane, rot.block, rot.scale);
      } else {
        a_stage[m * 32 + lane] = widen(m, raw[m]);
      }
    }
    __syncwarp();
    dot_block<T, BITS, M, 0, (0 < TB), kPairs>(a_stage, cb, lut, lut_lane, pl, cd, acc);
    dot_block<T, BITS, M, 1, (1 < TB), kPairs>(a_stage, cb, lut, lut_lane, pl, cd, acc);
    dot_block<T, BITS, M, 2, (2 < TB), kPairs>(a_stage, cb, lut, lut_lane, pl, cd, acc);
    dot_block<T, BITS, M, 3, (3 < TB), kPairs>(a_stage, cb, lut, lut_lane, pl, cd, acc);
  };
  uint4 planes0[kRowsPerLane][BITS], planes1[kRowsPerLane][BITS];
  uint32_t codes0[kRowsPerLane], codes1[kRowsPerLane];
  Raw raw0[M], raw1[M];
  float4 sg0, sg1;  // ROT: the signs of raw0 / raw1's elements
  int kt = kt_begin + warp;
  if (kt < kt_end) load_tile<BITS>(qweight, absmax, band + kt, lane, planes0, codes0);
  if constexpr (kTable) {
    // The codebook is constant, so the table is filled while the first tile is in flight and before
    // the PDL wait.
    lut_fill<T, BITS>(lut, codebook, static_cast<int>(threadIdx.x), kThreads);
    __syncthreads();
  }
  ready();
  if constexpr (kPrefetchActivations) {
    if (kt < kt_end) fetch_tile(raw0, sg0, kt);
  }
  while (kt < kt_end) {
    if (kt + kWarps < kt_end) {
      load_tile<BITS>(qweight, absmax, band + kt + kWarps, lane, planes1, codes1);
      if constexpr (kPrefetchActivations) fetch_tile(raw1, sg1, kt + kWarps);
    }
    process(planes0, codes0, raw0, sg0, kt);
    kt += kWarps;
    if (kt >= kt_end) break;
    if (kt + kWarps < kt_end) {
      load_tile<BITS>(qweight, absmax, band + kt + kWarps, lane, planes0, codes0);
      if constexpr (kPrefetchActivations) fetch_tile(raw0, sg0, kt + kWarps);
    }
    process(planes1, codes1, raw1, sg1, kt);
    kt += kWarps;
  }
}

// ----------------------------------------------------------------------------- reduction

// One cluster barrier phase without memory ordering on this thread's side (arrive.relaxed).
__device__ __forceinline__ void cluster_arrive_relaxed_and_wait() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
}

// Sums acc over the CTA's warps and then over the `splits` CTAs of its cluster (split-K
// partners of one n-tile), and calls store(m, r, value) for every activation row m and tile row
// r on split 0. warp_sums is [kWarps][M][kTileN] and cta_sums [M * kTileN] in shared memory.
// Output i = m * 64 + r is finished by thread i % kThreads in a fixed order (warps, then
// splits), so results are deterministic; every CTA of the cluster must call this.
template <int M, typename Store>
__device__ __forceinline__ void reduce_and_store(const float (&acc)[kRowsPerLane][M], float* __restrict__ warp_sums,
                                                 float* __restrict__ cta_sums, int warp, int lane, int split,
                                                 int splits, Store&& store) {
#pragma unroll
  for (int row = 0; row < kRowsPerLane; ++row)
#pragma unroll
    for (int m = 0; m < M; ++m) warp_sums[(warp * M + m) * kTileN + lane + 32 * row] = acc[row][m];
  __syncthreads();

  constexpr int kOutputs = M * kTileN;
  constexpr int kPerThread = (kOutputs + kThreads - 1) / kThreads;
  float total[kPerThread];
#pragma unroll
  for (int t = 0; t < kPerThread; ++t) {
    const int i = threadIdx.x + t * kThreads;
    total[t] = 0.f;
    if (i < kOutputs) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) total[t] += warp_sums[w * kOutputs + i];
    }
  }
  if (splits > 1) {
    // Split 0 of the cluster adds the other splits' sums from their shared memory; the second
    // cluster barrier keeps every CTA (and so its shared memory) alive until those reads are done.
    // Only split 0 has memory operations to order before that barrier (its remote reads), so the
    // other splits arrive without the release fence a full cluster.sync() would cost them.
    namespace cg = cooperative_groups;
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
      cluster.sync();
    } else {
      cluster_arrive_relaxed_and_wait();
    }
  }
  if (split != 0) return;
#pragma unroll
  for (int t = 0; t < kPerThread; ++t) {
    const int i = threadIdx.x + t * kThreads;
    if (i < kOutputs) store(i / kTileN, i % kTileN, total[t]);
  }
}

}  // namespace gemv_core
}  // namespace kbit
