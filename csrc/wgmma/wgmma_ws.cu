// kbit fused dequant + wgmma for large M, warp-specialized: C[M, N] = A[M, K] @ dequant(W)^T (+ bias),
// Hopper only. A second design beside wgmma.cu (which dequantizes into each warpgroup's registers):
// here producer warpgroups dequantize each weight tile once into shared memory and two consumer
// warpgroups multiply it with 128 activation rows each, so a weight is dequantized once per 256 rows
// of A instead of once per 128, by warps that hold no accumulators. Grouped (routed experts), CTA row y
// is chunk y of the routing (one expert's rows, up to 256) with that expert's weights.
//
// Roles (CTA = NP + 2 warpgroups; 128 weight rows = 2 runtime n-tiles, 256 activation rows):
//   producers (0 .. NP-1)   thread r of each owns weight row r: producer p takes k-tiles p, p + NP, ...;
//                            per k-tile it loads the row's runtime words and scale codes (a register
//                            ring, several of its k-tiles ahead), decodes its 4 blocks (k = 2..4 through
//                            the per-lane table of pairs / quads, k = 5 by shuffle; dequant_core.cuh), and
//                            stores them as bf16/fp16 into the stage's weight tile in wgmma's K-major
//                            128-byte-swizzled layout. NP = 2 (k = 2..4) moves registers from the
//                            producers to the consumers with setmaxnreg.
//   consumers (NP, NP + 1)  each copies its 128 activation rows of the k-tile with cp.async into the
//                            same layout, then issues m64n128k16 wgmmas with both operands in shared
//                            memory: A = 64 activation rows, B = the 128 weight rows (none for a 64-row
//                            half without rows).
// Stages: kStages deep; per stage a `full` mbarrier (the producer's 128 threads arrive after their
// stores and an async-proxy fence) and an `empty` mbarrier (the consumers' 256 threads arrive once
// their wgmmas on the stage are complete, before the producer may overwrite its weights).
// Weights are stored in their natural K order, so unlike wgmma.cu the activations need no permutation.
// Dense split-K (splits > 1, where a weight has fewer CTA columns than SMs): the `splits` CTAs of one column and
// row block are a thread-block cluster, each multiplying a contiguous share of the k-tiles; at the end each parks
// its fp32 tile in its own (then idle) stages, and rank s sums slice s of the tile over the ranks in rank order
// through distributed shared memory and stores it (deterministic, no workspace; as mma_kernel.cuh).
#include "wgmma.cuh"

#include "dequant_core.cuh"
#include "launch_utils.cuh"  // launch_kernel (cluster launches)
#include "plan.h"  // kMoeWsChunkRows, kWgmmaWsMaxSplits, record_launch
#include "wgmma_core.cuh"


#include <cooperative_groups.h>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

namespace kbit {
namespace {

using namespace wgmma_core;
namespace cg = cooperative_groups;

constexpr int kWeightRows = 2 * kTileN;                 // per CTA: two runtime n-tiles
constexpr int kConsumers = 2;
constexpr int kConsumerRows = 128;                      // activation rows per consumer warpgroup
constexpr int kActRows = kConsumers * kConsumerRows;    // per CTA
static_assert(kActRows == kMoeWsChunkRows, "a grouped chunk is one CTA's rows of A");
// Producer warpgroups: 1, or 2 taking alternate k-tiles (registers moved to the consumers by setmaxnreg).
template <int NP>
constexpr int kThreads = 128 * (NP + kConsumers);
constexpr int kProducerRegs = 88, kConsumerRegs = 168;  // NP = 2: 256 x 88 + 256 x 168 = 64 K registers
static_assert(2 * 128 * (kProducerRegs + kConsumerRegs) <= 65536, "the register file of an SM");
constexpr int kWeightBytes = kWeightRows * kTileK * 2;  // one stage's weight tile (16-bit)
constexpr int kActBytes = kActRows * kTileK * 2;        // one stage's activation tile
constexpr int kStageBytes = kWeightBytes + kActBytes;
constexpr int kStages = 2;
template <int NP>
constexpr int kProducerAhead = NP == 1 ? 3 : 2;  // a producer's own k-tiles its loads run ahead (register ring)
constexpr int kBarrierBytes = 64;  // 2 * kStages mbarriers, rounded up
// k = 2..4 decode through the per-lane table of pairs / quads (dequant_core.cuh: Lut), which sits at the
// start of the window, before the stages and barriers: one shared load per two or four weights instead
// of a shuffle, a conversion and a multiply per weight. k = 5 (a 1024-entry pair table would not fit)
// keeps the shuffle decode.
template <int BITS>
constexpr bool producer_uses_lut() { return BITS <= 4; }
template <int BITS>
constexpr int lut_bytes() {
  if constexpr (producer_uses_lut<BITS>()) return Lut<BITS>::kBytes;
  return 0;
}
template <int BITS>
constexpr int smem_bytes() {  // table + stages + mbarriers + alignment slack
  return lut_bytes<BITS>() + kStages * kStageBytes + kBarrierBytes + 1024;
}
static_assert(smem_bytes<4>() <= 227 * 1024, "one CTA's shared memory must fit an SM (227 KB on Hopper)");
// Split-K: the CTA's fp32 tile (256 activation rows x 128 weight rows) parks in the stages once they are idle.
constexpr int kPartialUnits = kActRows * kWeightRows / 4;  // float4 units
static_assert(kPartialUnits * 16 <= kStages * kStageBytes, "the parked partial tile fits the stages");

// ----------------------------------------------------------------------------- the MMA

// d (64 x 128 fp32 of the warpgroup) += A (descriptor: 64 activation rows) * B (descriptor: 128 weight rows)^T.
template <typename T>
__device__ __forceinline__ void mma_ss(float (&d)[64], uint64_t a_desc, uint64_t b_desc);

template <>
__device__ __forceinline__ void mma_ss<__nv_bfloat16>(float (&d)[64], uint64_t a_desc, uint64_t b_desc) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " KBIT_WGMMA_D64 ", %64, %65, p, 1, 1, 0, 0;\n}\n"
               : KBIT_WGMMA_D64_OPERANDS(d)
               : "l"(a_desc), "l"(b_desc), "r"(1));
}

template <>
__device__ __forceinline__ void mma_ss<__half>(float (&d)[64], uint64_t a_desc, uint64_t b_desc) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " KBIT_WGMMA_D64 ", %64, %65, p, 1, 1, 0, 0;\n}\n"
               : KBIT_WGMMA_D64_OPERANDS(d)
               : "l"(a_desc), "l"(b_desc), "r"(1));
}

// ----------------------------------------------------------------------------- barriers

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// Arrive with release semantics: this thread's earlier shared-memory writes happen before the phase completes.
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Until the phase of the given parity has completed (acquire).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(bar), "r"(parity)
                 : "memory");
  }
}
// Barrier of one consumer warpgroup's 128 threads (ids 1.., 0 is __syncthreads).
__device__ __forceinline__ void warpgroup_sync(int id) { asm volatile("bar.sync %0, 128;" ::"r"(id) : "memory"); }

__device__ __forceinline__ void st_shared16(uint32_t addr, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

// ----------------------------------------------------------------------------- kernel

template <typename T>
struct WsParams {
  const T* A;              // [M, K]
  const uint4* qweight;    // runtime layout as 16-byte plane vectors (grouped: expert 0's)
  const uint32_t* absmax;  // runtime scale codes, 4 per word (grouped: expert 0's)
  const float* codebook;
  const T* bias;
  T* C;
  int M, N, K, n_tiles, k_tiles;
  int splits;  // dense: K splits per CTA column (the cluster's size along x); grouped: 1
  // Grouped (routed experts): CTA row y multiplies chunk y = {expert, first row, rows, 0} of A's rows
  // (moe_route), with that expert's weights; nullptr for a dense launch.
  const int4* chunks;
  int64_t expert_vectors, expert_words;  // plane vectors / scale words of one expert's weight
};

// What one CTA multiplies: rows [row0, row_end) of A and C with the weight at (qweight, absmax), CTA column col
// (its 128 weight rows), k-tiles [kt0, kt1) of the weight (its K split).
struct WsWork {
  const uint4* qweight;
  const uint32_t* absmax;
  int row0, row_end;
  int col, kt0, kt1;
};

// The producer: thread r (0..127) dequantizes weight row r of the CTA, every k-tile, into the stages.
// Its loads run kAhead k-tiles ahead in a register ring: one CTA per SM with 128 loading threads
// needs several k-tiles of weight bytes in flight to cover HBM latency.
template <typename T, int BITS, int NP>
__device__ __forceinline__ void produce(const WsParams<T>& prm, const WsWork& work, uint32_t smem, uint32_t full,
                                        uint32_t empty, uint8_t* lut, int p) {
  constexpr int F = Fields<BITS>::kWords;
  constexpr int kAhead = kProducerAhead<NP>;
  const int r = threadIdx.x % 128, lane = r % 32;
  // A row of an n-tile past the last one reads the last tile (its outputs are never stored).
  const int n_tile = min(work.col * 2 + r / kTileN, prm.n_tiles - 1), tile_row = r % kTileN;
  const int k_tiles = work.kt1 - work.kt0;  // this split's; k below counts from its first (work.kt0)
  const float codebook_reg = __ldg(prm.codebook + (lane & ((1 << BITS) - 1)));
  // Plane b of runtime tile (n, kt) is 64 consecutive 16-byte vectors, one per row (word j = block j).
  const uint4* planes = work.qweight + (static_cast<int64_t>(n_tile) * prm.k_tiles + work.kt0) * BITS * kTileN + tile_row;
  const uint32_t* codes = work.absmax + (static_cast<int64_t>(n_tile) * prm.k_tiles + work.kt0) * kTileN + tile_row;
  struct Row {
    uint4 plane[BITS];
    uint32_t codes;
  };
  const auto load = [&](Row& w, int kt) {
#pragma unroll
    for (int b = 0; b < BITS; ++b) w.plane[b] = __ldg(planes + (static_cast<int64_t>(kt) * BITS + b) * kTileN);
    w.codes = __ldg(codes + static_cast<int64_t>(kt) * kTileN);
  };
  // Block j of the row: index words, scale, then 4 chunks of 8 weights rounded to T and scaled in
  // pairs (as mma_kernel.cuh), each stored as one 16-byte swizzled chunk.
  const auto store_shuffle = [&](const Row& w, uint32_t tile) {
#pragma unroll
    for (int j = 0; j < kTileKB; ++j) {
      uint32_t plane[BITS], q[F];
#pragma unroll
      for (int b = 0; b < BITS; ++b) plane[b] = j == 0 ? w.plane[b].x : j == 1 ? w.plane[b].y : j == 2 ? w.plane[b].z : w.plane[b].w;
      gather_indices<BITS>(plane, q);
      const float sc = decode_scale(w.codes, j);
      const uint32_t scale = Half2<T>::pack(sc, sc);
      const auto pair = [&](int e) {
        return Half2<T>::scale2(Half2<T>::pack(lookup<BITS>(codebook_reg, q, e), lookup<BITS>(codebook_reg, q, e + 1)),
                                scale);
      };
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        st_shared16(tile + swizzled_chunk(kWeightRows, r, 4 * j + c), pair(8 * c), pair(8 * c + 2), pair(8 * c + 4),
                    pair(8 * c + 6));
      }
    }
  };
  // The same chunks from the table: chunk c of block j is elements 8c .. 8c + 7, i.e. byte c of the
  // index words 0, 2, 1, 3 (pairs e, e + 2, e + 4, e + 6: kbit_format.cuh's runtime words) or of words 0, 1
  // (k = 2 quads e, e + 4). The table holds the codebook rounded to T, so the products equal the shuffle
  // path's bit for bit.
  constexpr int LB = kLutBits<BITS>;  // the table's k (unused at k = 5)
  const uint32_t lut_lane = lut_lane_offset<LB>(lane);
  const auto store_lut = [&](const Row& w, uint32_t tile) {
#pragma unroll
    for (int j = 0; j < kTileKB; ++j) {
      uint32_t words[LB], q[Lut<LB>::kWords];
#pragma unroll
      for (int b = 0; b < LB; ++b) words[b] = j == 0 ? w.plane[b].x : j == 1 ? w.plane[b].y : j == 2 ? w.plane[b].z : w.plane[b].w;
      lut_indices<LB>(words, q);
      const float sc = decode_scale(w.codes, j);
      const uint32_t scale = Half2<T>::pack(sc, sc);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        uint32_t v[4];
        lut_scaled_pairs<T, LB>(lut, q, c, lut_lane, scale, v);
        st_shared16(tile + swizzled_chunk(kWeightRows, r, 4 * j + c), v[0], v[1], v[2], v[3]);
      }
    }
  };
  const auto store = [&](const Row& w, uint32_t tile) {
    if constexpr (producer_uses_lut<BITS>()) {
      store_lut(w, tile);
    } else {
      store_shuffle(w, tile);
    }
  };
  // Producer p of NP takes k-tiles p, p + NP, p + 2 NP, ...
  Row ring[kAhead + 1];
#pragma unroll
  for (int i = 0; i < kAhead; ++i) {
    if (p + NP * i < k_tiles) load(ring[i], p + NP * i);
  }
  if constexpr (producer_uses_lut<BITS>()) {
    // While the first loads fly: the table, filled by the producers' threads (a barrier of their own).
    lut_fill<T, LB>(lut, prm.codebook, static_cast<int>(threadIdx.x), 128 * NP);
    asm volatile("bar.sync 3, %0;" ::"n"(128 * NP) : "memory");
  }
  for (int i0 = 0; p + NP * i0 < k_tiles; i0 += kAhead + 1) {
    // kAhead + 1 of its k-tiles per iteration, unrolled, so every ring slot is a fixed set of registers.
#pragma unroll
    for (int u = 0; u <= kAhead; ++u) {
      const int k = p + NP * (i0 + u);
      if (k >= k_tiles) break;
      if (k + NP * kAhead < k_tiles) load(ring[(u + kAhead) % (kAhead + 1)], k + NP * kAhead);
      const int s = k % kStages;
      if (k >= kStages) mbar_wait(empty + 8 * s, ((k / kStages) - 1) & 1);  // consumers done with k - kStages
      store(ring[u], smem + s * kStageBytes);
      fence_proxy_async();
      mbar_arrive(full + 8 * s);
    }
  }
}

// One stage's wgmmas of consumer c over its first kHalves 64-row halves, then the wait for them.
template <typename T, int kHalves>
__device__ __forceinline__ void issue_stage(float (&acc)[2][64], uint32_t st, int c) {
  wgmma_fence();
#pragma unroll
  for (int j = 0; j < kTileK / 16; ++j) {
    const uint32_t k_off = (j % 4) * 32;  // k16 step inside its 64-wide slab
    const uint64_t b_desc = smem_desc(st + (j / 4) * kWeightRows * 128 + k_off);
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      const uint32_t a = st + kWeightBytes + (j / 4) * kActRows * 128 + (c * kConsumerRows + 64 * h) * 128 + k_off;
      mma_ss<T>(acc[h], smem_desc(a), b_desc);
    }
  }
  wgmma_commit();
  wgmma_wait_all();
}

// C[m, n], C[m, n + 1] = y0, y1 (+ bias) where they exist: two adjacent weight rows of a thread are two adjacent
// outputs, so one 32-bit store where both exist.
template <typename T>
__device__ __forceinline__ void store_pair(const WsParams<T>& prm, const WsWork& work, int m, int n, float y0, float y1) {
  if (m >= work.row_end || n >= prm.N) return;
  T* c_row = prm.C + static_cast<int64_t>(m) * prm.N;
  if (prm.bias != nullptr) {
    y0 += Half2<T>::to_float(prm.bias[n]);
    if (n + 1 < prm.N) y1 += Half2<T>::to_float(prm.bias[n + 1]);
  }
  if (n + 1 < prm.N && prm.N % 2 == 0) {
    *reinterpret_cast<uint32_t*>(c_row + n) = Half2<T>::pack(y0, y1);
  } else {
    c_row[n] = Half2<T>::narrow(y0);
    if (n + 1 < prm.N) c_row[n + 1] = Half2<T>::narrow(y1);
  }
}

// A consumer: warpgroup c (0, 1) multiplies activation rows row0 + 128c .. +127 (those below row_end)
// with the CTA's 128 weight rows; D = acc[h]: activation rows 64h + 16 warp + g (+8), weight rows
// 8i + 2t (+1). A 64-row half with no rows skips its wgmmas (a grouped chunk is often one or two
// halves); the warpgroup still takes part in every stage's barriers.
template <typename T>
__device__ __forceinline__ void consume(const WsParams<T>& prm, const WsWork& work, uint32_t smem, uint32_t full,
                                        uint32_t empty, int c, void* stages) {
  const int ct = threadIdx.x % 128, warp = ct / 32, lane = ct % 32, g = lane / 4, t = lane % 4;
  const int rows0 = work.row0 + c * kConsumerRows;  // first activation row of this warpgroup
  const int halves = max(0, min(2, (work.row_end - rows0 + 63) / 64));
  const int k_tiles = work.kt1 - work.kt0;  // this split's; kt below counts from its first (work.kt0)

  // Thread ct copies 16-byte chunk ct % 16 of rows ct / 16 + 8i (i < 16) of the warpgroup's rows.
  const int x_row = ct / 16, x_ch = ct % 16;
  const uint32_t x_dst = kWeightBytes + swizzled_chunk(kActRows, c * kConsumerRows + x_row, x_ch);
  const T* x_src = prm.A + static_cast<int64_t>(rows0 + x_row) * prm.K + work.kt0 * kTileK + x_ch * 8;
  const int rows_valid = work.row_end - rows0 - x_row;  // copies of rows x_row + 8i with 8i >= this read nothing
  const auto load_acts = [&](int kt) {
    const uint32_t st = smem + (kt % kStages) * kStageBytes + x_dst;
    const bool k_valid = (work.kt0 + kt) * kTileK + x_ch * 8 < prm.K;
#pragma unroll
    for (int i = 0; i < kConsumerRows / 8; ++i) {
      if (8 * i >= 64 * halves) break;  // rows of a skipped half are never read
      const bool valid = k_valid && 8 * i < rows_valid;
      cp_async16(st + 8 * i * 128, valid ? x_src + static_cast<int64_t>(8 * i) * prm.K + kt * kTileK : prm.A, valid);
    }
  };

  float acc[2][64];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[h][i] = 0.f;

#pragma unroll
  for (int s = 0; s < kStages; ++s) {
    if (s < k_tiles) load_acts(s);
    cp_async_commit();
  }
  for (int kt = 0; kt < k_tiles; ++kt) {
    const int s = kt % kStages;
    const uint32_t st = smem + s * kStageBytes;
    cp_async_wait<kStages - 1>();  // this k-tile's activations (one group per k-tile, always committed)
    fence_proxy_async();
    warpgroup_sync(1 + c);
    mbar_wait(full + 8 * s, (kt / kStages) & 1);
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < 64; ++i) pin(acc[h][i]);
    // Straight-line wgmma sequences per number of halves: a branch between wgmmas of one group
    // would make ptxas serialize them (it injects warpgroup.arrive).
    if (halves == 2) {
      issue_stage<T, 2>(acc, st, c);
    } else if (halves == 1) {
      issue_stage<T, 1>(acc, st, c);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < 64; ++i) pin(acc[h][i]);
    mbar_arrive(empty + 8 * s);
    // Stage s's activation slice of this warpgroup is free (its wgmmas are complete): refill it.
    if (kt + kStages < k_tiles) load_acts(kt + kStages);
    cp_async_commit();
  }
  cp_async_wait<0>();

  if (prm.splits == 1) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int v = 0; v < 2; ++v)
#pragma unroll
        for (int i = 0; i < kWeightRows / 8; ++i)
          store_pair(prm, work, rows0 + 64 * h + 16 * warp + g + 8 * v, work.col * kWeightRows + 8 * i + 2 * t,
                     acc[h][4 * i + 2 * v], acc[h][4 * i + 2 * v + 1]);
    return;
  }
  // Split-K: both warpgroups' wgmmas are complete (the producers' last stores were too, before the last full
  // phase), so the stages are idle: park the tile there, float4 unit ((c, h, i), ct) = acc[h][4i .. 4i + 3].
  asm volatile("bar.sync 4, %0;" ::"n"(128 * kConsumers) : "memory");
  float4* part = reinterpret_cast<float4*>(stages);
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < kWeightRows / 8; ++i)
      part[((c * 2 + h) * (kWeightRows / 8) + i) * 128 + ct] =
          make_float4(acc[h][4 * i], acc[h][4 * i + 1], acc[h][4 * i + 2], acc[h][4 * i + 3]);
}

// Split-K, after every CTA of the cluster parked its tile (a cluster barrier): the consumers of rank `split` sum
// slice `split` of the units over the ranks in rank order and store them.
template <typename T>
__device__ __forceinline__ void reduce_splits(const WsParams<T>& prm, const WsWork& work, float4* part, int split) {
  cg::cluster_group cluster = cg::this_cluster();
  const int splits = prm.splits;
  for (int u = split * kPartialUnits / splits + static_cast<int>(threadIdx.x) % (128 * kConsumers);
       u < (split + 1) * kPartialUnits / splits; u += 128 * kConsumers) {
    float4 sum = cluster.map_shared_rank(part, 0)[u];
    for (int s = 1; s < splits; ++s) {
      const float4 x = cluster.map_shared_rank(part, s)[u];
      sum.x += x.x, sum.y += x.y, sum.z += x.z, sum.w += x.w;
    }
    // Unit ((c, h, i), ct): thread ct of consumer c held it, as acc[h][4i .. 4i + 3] (rows g, g + 8; columns 2t, 2t + 1).
    const int ct = u % 128, i = (u / 128) % (kWeightRows / 8), h = (u / (128 * (kWeightRows / 8))) % 2;
    const int c = u / (2 * 128 * (kWeightRows / 8)), warp = ct / 32, g = (ct % 32) / 4, t = ct % 4;
    const int m = work.row0 + c * kConsumerRows + 64 * h + 16 * warp + g, n = work.col * kWeightRows + 8 * i + 2 * t;
    store_pair(prm, work, m, n, sum.x, sum.y);
    store_pair(prm, work, m + 8, n, sum.z, sum.w);
  }
}

// Grid: (ceil(n_tiles / 2) * splits, ceil(M / 256)) dense, in clusters of `splits` along x (CTA x = col * splits +
// split), or (ceil(n_tiles / 2), chunks) grouped.
template <typename T, int BITS, int NP>
__global__ void __launch_bounds__(kThreads<NP>, 1) wgmma_ws_kernel(const __grid_constant__ WsParams<T> prm) {
  const int splits = prm.splits, split = static_cast<int>(blockIdx.x) % splits;
  WsWork work{prm.qweight, prm.absmax, static_cast<int>(blockIdx.y) * kActRows, prm.M,
              static_cast<int>(blockIdx.x) / splits, split * prm.k_tiles / splits, (split + 1) * prm.k_tiles / splits};
  if (prm.chunks != nullptr) {
    // Every chunk entry holds defined values; unused ones have expert -1 (moe_route).
    const int4 chunk = prm.chunks[blockIdx.y];
    if (chunk.x < 0 || chunk.z <= 0) return;
    work.qweight = prm.qweight + chunk.x * prm.expert_vectors;
    work.absmax = prm.absmax + chunk.x * prm.expert_words;
    work.row0 = chunk.y;
    work.row_end = chunk.y + min(chunk.z, kActRows);
  }
  extern __shared__ __align__(16) uint8_t smem_raw[];
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t smem = (raw + lut_bytes<BITS>() + 1023) & ~1023u;  // the stages, after the table
  const uint32_t full = smem + kStages * kStageBytes, empty = full + 8 * kStages;
  uint8_t* lut = smem_raw;  // k <= 4 only
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full + 8 * s, 128);
      mbar_init(empty + 8 * s, 128 * kConsumers);
    }
  }
  __syncthreads();
  // The role through a shuffle from lane 0: warp-uniform to the compiler, so the producer's lookups
  // stay plain warp-wide shuffles.
  const int role = __shfl_sync(0xFFFFFFFFu, static_cast<int>(threadIdx.x) / 128, 0);
  if (role < NP) {
    if constexpr (NP == 2) asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kProducerRegs));
    produce<T, BITS, NP>(prm, work, smem, full, empty, lut, role);
  } else {
    if constexpr (NP == 2) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kConsumerRegs));
    consume<T>(prm, work, smem, full, empty, role - NP, smem_raw + (smem - raw));
  }
  if (splits > 1) {
    // Every CTA of the cluster has parked its tile (a release / acquire barrier over all their threads); the consumers
    // sum their rank's slice; the second barrier keeps every CTA's shared memory alive until the remote reads end.
    cg::this_cluster().sync();
    if (role >= NP) reduce_splits<T>(prm, work, reinterpret_cast<float4*>(smem_raw + (smem - raw)), split);
    cg::this_cluster().sync();
  }
}

static_assert(kWeightRows == kWgmmaWsTileN * kTileN, "the planner sizes the grid by kWgmmaWsTileN n-tiles per CTA");

template <typename T, int BITS, int NP>
void launch_np(const WsParams<T>& prm, int grid_rows, int cols, int device, const char* name) {
  opt_in_shared_memory<wgmma_ws_kernel<T, BITS, NP>>(smem_bytes<BITS>(), device);
  const dim3 grid(static_cast<unsigned>(cols * prm.splits), static_cast<unsigned>(grid_rows));
  record_launch({name, 0, 0, grid.y, cols, prm.splits, NP, 0, false});  // launched without programmatic dependence
  launch_kernel(wgmma_ws_kernel<T, BITS, NP>, grid, dim3(kThreads<NP>), smem_bytes<BITS>(),
                at::cuda::getCurrentCUDAStream(), prm.splits > 1 ? static_cast<int>(prm.splits) : 0, false, prm);
}

// The plan's producer count (k = 5 is built with one: its shuffle decode needs the registers a second
// producer warpgroup would take).
template <typename T, int BITS>
void launch(const WsParams<T>& prm, int grid_rows, int cols, int producers, int device, const char* name) {
  KBIT_CHECK(producers == 1 || (producers == 2 && BITS <= 4), "kbit wgmma_ws: no kernel with ", producers,
             " producer warpgroups for k=", BITS);
  if constexpr (BITS <= 4) {
    if (producers == 2) return launch_np<T, BITS, 2>(prm, grid_rows, cols, device, name);
  }
  launch_np<T, BITS, 1>(prm, grid_rows, cols, device, name);
}

// Both launches: a dense weight is a stack of one expert without a chunk list (chunks == nullptr). The plan's
// grid (cols x grid_rows) must be the one covering the n-tiles and M rows (dense) or the chunk list (grouped).
void launch_ws(const at::Tensor& A, const at::Tensor& q, const at::Tensor& a, const at::Tensor& codebook,
               const std::optional<at::Tensor>& bias, int64_t N, int64_t K, at::Tensor& C, int64_t bits,
               int64_t n_tiles, int64_t k_tiles, const at::Tensor* chunks, int64_t grid_rows, int64_t cols,
               int64_t splits, int64_t producers, const char* what, const char* name) {
  const int64_t want_rows = chunks != nullptr ? chunks->size(0) : (A.size(0) + kActRows - 1) / kActRows;
  const int64_t want_cols = (n_tiles + kWgmmaWsTileN - 1) / kWgmmaWsTileN;
  KBIT_CHECK(grid_rows == want_rows && cols == want_cols, what, ": the plan's grid ", cols, " x ", grid_rows,
             " is not the ", want_cols, " x ", want_rows, " CTAs covering ", n_tiles, " n-tiles and ",
             chunks != nullptr ? "the chunk list" : "M rows");
  KBIT_CHECK(splits >= 1 && splits <= std::min<int64_t>(kWgmmaWsMaxSplits, k_tiles) && (splits == 1 || chunks == nullptr),
             what, ": splits=", splits, " outside 1 .. min(", kWgmmaWsMaxSplits, ", ", k_tiles, " k-tiles) (grouped: 1)");
  dispatch_type_and_bits(A.scalar_type(), bits, what, [&](auto type, auto k) {
    using T = decltype(type);
    const WsParams<T> prm{reinterpret_cast<const T*>(A.data_ptr()),
                          reinterpret_cast<const uint4*>(q.data_ptr()),
                          reinterpret_cast<const uint32_t*>(a.data_ptr()),
                          codebook.data_ptr<float>(),
                          bias.has_value() ? reinterpret_cast<const T*>(bias->data_ptr()) : nullptr,
                          reinterpret_cast<T*>(C.data_ptr()),
                          static_cast<int>(A.size(0)), static_cast<int>(N), static_cast<int>(K),
                          static_cast<int>(n_tiles), static_cast<int>(k_tiles), static_cast<int>(splits),
                          chunks != nullptr ? reinterpret_cast<const int4*>(chunks->data_ptr<int>()) : nullptr,
                          chunks != nullptr ? q.numel() / q.size(0) / 4 : 0,
                          chunks != nullptr ? a.numel() / a.size(0) / 4 : 0};
    launch<T, decltype(k)::value>(prm, static_cast<int>(grid_rows), static_cast<int>(cols), static_cast<int>(producers),
                                  A.get_device(), name);
  });
}

}  // namespace

void launch_wgmma_ws(const at::Tensor& A, const at::Tensor& qweight_rt, const at::Tensor& absmax_rt,
                     const at::Tensor& codebook, const std::optional<at::Tensor>& bias, int64_t N, int64_t K,
                     at::Tensor& C, const LinearPlan& plan) {
  KBIT_CHECK(plan.path == LinearPath::kWgmmaWs && !plan.pdl, "kbit wgmma_ws: the plan (",
             linear_path_name(plan.path), ") is not the wgmma_ws path's");
  launch_ws(A, qweight_rt, absmax_rt, codebook, bias, N, K, C, qweight_rt.size(2), qweight_rt.size(0),
            qweight_rt.size(1), nullptr, plan.m_blocks, plan.cols, plan.splits, plan.producers, "kbit wgmma_ws",
            "wgmma_ws");
}

void launch_wgmma_ws_grouped(const at::Tensor& A, const at::Tensor& chunks, const at::Tensor& qweight,
                             const at::Tensor& absmax, const at::Tensor& codebook, int64_t N, int64_t K,
                             at::Tensor& C, const MoeProjPlan& plan) {
  KBIT_CHECK(plan.splits == 1 && !plan.pdl, "kbit wgmma_ws grouped: the plan (splits=", plan.splits,
             ") is not the warp-specialized kernel's");
  if (chunks.size(0) == 0) return;
  launch_ws(A, qweight, absmax, codebook, std::nullopt, N, K, C, qweight.size(3), qweight.size(1), qweight.size(2),
            &chunks, plan.m_blocks, plan.cols, 1, plan.producers, "kbit wgmma_ws grouped", "wgmma_ws_grouped");
}

}  // namespace kbit
