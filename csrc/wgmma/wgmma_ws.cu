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
//
// Work: a tile is 128 weight rows x 256 activation rows over all k-tiles, a unit one k-tile of one tile.
// Either one CTA per tile (grouped always; dense where the tiles fill whole waves), or stream-K (dense):
// `ctas` CTAs, one per SM, each takes an equal run of the units in order, crossing tile boundaries, so the
// last wave leaves no SM idle. The pipeline (stages, mbarrier phases) runs on across a CTA's tiles: its
// i-th unit uses stage i % kStages. A tile split among CTAs is finished by the one holding its k-tile 0
// (the end of that CTA's run); every other part is the first segment of its CTA's run, which writes its
// fp32 accumulators to the CTA's slot in a workspace and raises a flag per consumer warpgroup. Flags are
// waited for only by lower-numbered CTAs, so no cycle; all `ctas` CTAs are resident at once (one per SM).
#include "wgmma.cuh"

#include "dequant_core.cuh"
#include "plan.h"  // kMoeWsChunkRows, record_launch
#include "wgmma_core.cuh"


#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

namespace kbit {
namespace {

using namespace wgmma_core;

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
  // Grouped (routed experts): CTA row y multiplies chunk y = {expert, first row, rows, 0} of A's rows
  // (moe_route), with that expert's weights; nullptr for a dense launch.
  const int4* chunks;
  int64_t expert_vectors, expert_words;  // plane vectors / scale words of one expert's weight
  int cols, row_blocks;   // tiles: n-tile pairs x row blocks (dense: 256 rows of A; grouped: chunks)
  // Stream-K (dense): `ctas` CTAs share the tiles' units; 0: one CTA per tile (grid cols x rows).
  int ctas;
  float* partials;        // [ctas, kConsumers, 128 threads x 128 accumulators]: a CTA's first-segment sums
  int* flags;             // [ctas, kConsumers], zero at launch; 1 once that slot's partial sums are written
};

// What one tile multiplies: rows [row0, row_end) of A and C with weight rows 128 col.. of (qweight, absmax).
struct WsWork {
  const uint4* qweight;
  const uint32_t* absmax;
  int row0, row_end, col;
};

// A CTA's run of units [begin, end); unit u is k-tile u % k_tiles of tile u / k_tiles (int32: launch_ws checks).
struct WsRange {
  int begin, end;
};

// The first unit of stream-K CTA g: the units split as evenly as integers allow.
__device__ __forceinline__ int stream_start(int units, int ctas, int g) {
  return static_cast<int>(static_cast<int64_t>(units) * g / ctas);
}

template <typename T>
__device__ __forceinline__ WsRange cta_range(const WsParams<T>& prm) {
  const int kt = prm.k_tiles;
  if (prm.ctas > 0) {
    const int units = prm.cols * prm.row_blocks * kt;
    return {stream_start(units, prm.ctas, blockIdx.x), stream_start(units, prm.ctas, blockIdx.x + 1)};
  }
  const int tile = static_cast<int>(blockIdx.y) * prm.cols + blockIdx.x;
  return {tile * kt, (tile + 1) * kt};
}

// Tile t's work: dense, rows 256 (t / cols).. of A; grouped, chunk t / cols with its expert's weight. A grouped
// tile of an unused chunk (expert < 0) has no rows.
template <typename T>
__device__ __forceinline__ WsWork tile_work(const WsParams<T>& prm, int tile) {
  const int row_block = tile / prm.cols, col = tile % prm.cols;
  if (prm.chunks == nullptr) return {prm.qweight, prm.absmax, row_block * kActRows, prm.M, col};
  const int4 chunk = prm.chunks[row_block];  // every entry holds defined values; unused ones expert -1 (moe_route)
  if (chunk.x < 0 || chunk.z <= 0) return {prm.qweight, prm.absmax, 0, 0, col};
  return {prm.qweight + chunk.x * prm.expert_vectors, prm.absmax + chunk.x * prm.expert_words, chunk.y,
          chunk.y + min(chunk.z, kActRows), col};
}

// The producer: thread r (0..127) dequantizes weight row r of the CTA, every k-tile, into the stages.
// Its loads run kAhead k-tiles ahead in a register ring: one CTA per SM with 128 loading threads
// needs several k-tiles of weight bytes in flight to cover HBM latency.
template <typename T, int BITS, int NP, bool kStream>
__device__ __forceinline__ void produce(const WsParams<T>& prm, const WsRange range, uint32_t smem, uint32_t full,
                                        uint32_t empty, uint8_t* lut, int p) {
  constexpr int F = Fields<BITS>::kBits;
  constexpr int kAhead = kProducerAhead<NP>;
  const int r = threadIdx.x % 128, lane = r % 32, tile_row = r % kTileN;
  const int k_tiles = prm.k_tiles;
  const int units = range.end - range.begin;
  const float codebook_reg = __ldg(prm.codebook + (lane & ((1 << BITS) - 1)));
  struct Row {
    uint4 plane[BITS];
    uint32_t codes;
  };
  // The loads walk the CTA's units p, p + NP, ... in order: a cursor (tile, k-tile, the tile's row bases) moved
  // by NP units per load, so the bases are recomputed (a division, the chunk's expert) only at a tile change.
  const uint4* planes = nullptr;  // plane 0 of weight row r of the cursor's tile at k-tile 0
  const uint32_t* codes = nullptr;
  int cur_tile = (range.begin + p) / k_tiles, cur_kt = (range.begin + p) % k_tiles;
  const auto set_tile = [&](int tile) {
    const WsWork work = tile_work(prm, tile);
    // A row of an n-tile past the last one reads the last tile (its outputs are never stored).
    const int n_tile = min(work.col * 2 + r / kTileN, prm.n_tiles - 1);
    // Plane b of runtime tile (n, kt) is 64 consecutive 16-byte vectors, one per row (word j = block j).
    planes = work.qweight + static_cast<int64_t>(n_tile) * k_tiles * BITS * kTileN + tile_row;
    codes = work.absmax + static_cast<int64_t>(n_tile) * k_tiles * kTileN + tile_row;
  };
  if (range.begin + p < range.end) set_tile(cur_tile);  // a producer with no unit reads no chunk past the list
  const auto load = [&](Row& w) {
#pragma unroll
    for (int b = 0; b < BITS; ++b) w.plane[b] = __ldg(planes + (cur_kt * BITS + b) * kTileN);
    w.codes = __ldg(codes + cur_kt * kTileN);
    cur_kt += NP;
    if constexpr (kStream) {  // a run of one tile (otherwise) ends at its last k-tile
      if (cur_kt >= k_tiles) {  // the run goes on in the next tile(s) at k-tile 0..
        while (cur_kt >= k_tiles) {
          cur_kt -= k_tiles;
          ++cur_tile;
        }
        if (cur_tile * k_tiles + cur_kt < range.end) set_tile(cur_tile);  // not past the run (a chunk past the list)
      }
    }
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
  // Producer p of NP takes the CTA's units p, p + NP, p + 2 NP, ...
  Row ring[kAhead + 1];
#pragma unroll
  for (int i = 0; i < kAhead; ++i) {
    if (p + NP * i < units) load(ring[i]);
  }
  if constexpr (producer_uses_lut<BITS>()) {
    // While the first loads fly: the table, filled by the producers' threads (a barrier of their own).
    lut_fill<T, LB>(lut, prm.codebook, static_cast<int>(threadIdx.x), 128 * NP);
    asm volatile("bar.sync 3, %0;" ::"n"(128 * NP) : "memory");
  }
  for (int i0 = 0; p + NP * i0 < units; i0 += kAhead + 1) {
    // kAhead + 1 of its units per iteration, unrolled, so every ring slot is a fixed set of registers.
#pragma unroll
    for (int u = 0; u <= kAhead; ++u) {
      const int k = p + NP * (i0 + u);
      if (k >= units) break;
      if (k + NP * kAhead < units) load(ring[(u + kAhead) % (kAhead + 1)]);  // unit k + NP kAhead
      const int s = k % kStages;
      if (k >= kStages) mbar_wait(empty + 8 * s, ((k / kStages) - 1) & 1);  // consumers done with unit k - kStages
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

// The hand-off of stream-K partial sums between CTAs, per consumer warpgroup (128 threads).
// Raise: every thread's stores are made visible device-wide (fence), the warpgroup meets, one thread sets the flag.
__device__ __forceinline__ void raise_flag(int* flag, int bar_id) {
  __threadfence();
  warpgroup_sync(bar_id);
  if (threadIdx.x % 128 == 0) asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(flag), "r"(1) : "memory");
}
// Wait: one thread spins with acquire loads, then resets the flag for the next launch; the warpgroup meets after.
__device__ __forceinline__ void wait_flag(int* flag, int bar_id) {
  if (threadIdx.x % 128 == 0) {
    int v = 0;
    do {
      asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
    } while (v == 0);
    *flag = 0;
  }
  warpgroup_sync(bar_id);
}

// A consumer of a CTA that multiplies one whole tile (grouped, and dense where the tiles fill whole waves): warpgroup
// c (0, 1) multiplies activation rows row0 + 128c .. +127 (those below row_end) with the tile's 128 weight rows; D = acc[h]: activation rows 64h + 16 warp + g (+8), weight rows
// 8i + 2t (+1). A 64-row half with no rows skips its wgmmas (a grouped chunk is often one or two
// halves); the warpgroup still takes part in every stage's barriers.
template <typename T>
__device__ __forceinline__ void consume_tile(const WsParams<T>& prm, const WsWork& work, uint32_t smem, uint32_t full,
                                        uint32_t empty, int c) {
  const int ct = threadIdx.x % 128, warp = ct / 32, lane = ct % 32, g = lane / 4, t = lane % 4;
  const int rows0 = work.row0 + c * kConsumerRows;  // first activation row of this warpgroup
  const int halves = max(0, min(2, (work.row_end - rows0 + 63) / 64));
  const int k_tiles = prm.k_tiles;

  // Thread ct copies 16-byte chunk ct % 16 of rows ct / 16 + 8i (i < 16) of the warpgroup's rows.
  const int x_row = ct / 16, x_ch = ct % 16;
  const uint32_t x_dst = kWeightBytes + swizzled_chunk(kActRows, c * kConsumerRows + x_row, x_ch);
  const T* x_src = prm.A + static_cast<int64_t>(rows0 + x_row) * prm.K + x_ch * 8;
  const int rows_valid = work.row_end - rows0 - x_row;  // copies of rows x_row + 8i with 8i >= this read nothing
  const auto load_acts = [&](int kt) {
    const uint32_t st = smem + (kt % kStages) * kStageBytes + x_dst;
    const bool k_valid = kt * kTileK + x_ch * 8 < prm.K;
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

  // Two adjacent weight rows of a thread are two adjacent outputs: one 32-bit store where both exist.
  const int n0 = work.col * kWeightRows;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int v = 0; v < 2; ++v) {
      const int m = rows0 + 64 * h + 16 * warp + g + 8 * v;
      if (m >= work.row_end) continue;
      T* c_row = prm.C + static_cast<int64_t>(m) * prm.N;
#pragma unroll
      for (int i = 0; i < kWeightRows / 8; ++i) {
        const int n = n0 + 8 * i + 2 * t;
        if (n >= prm.N) continue;
        float y0 = acc[h][4 * i + 2 * v], y1 = acc[h][4 * i + 2 * v + 1];
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
    }
  }
}

// A consumer of a stream-K CTA: warpgroup c (0, 1) multiplies, for each tile of the CTA's run, activation rows row0 + 128c .. +127
// (those below row_end) with the tile's 128 weight rows; D = acc[h]: activation rows 64h + 16 warp + g (+8),
// weight rows 8i + 2t (+1). A 64-row half with no rows skips its wgmmas (a grouped chunk is often one or two
// halves); the warpgroup still takes part in every stage's barriers.
template <typename T>
__device__ __forceinline__ void consume(const WsParams<T>& prm, const WsRange range, uint32_t smem, uint32_t full,
                                        uint32_t empty, int c) {
  const int ct = threadIdx.x % 128, warp = ct / 32, lane = ct % 32, g = lane / 4, t = lane % 4;
  const int k_tiles = prm.k_tiles;
  const int units = range.end - range.begin;
  const auto unit_tile = [&](int i) { return (range.begin + i) / k_tiles; };
  const auto unit_kt = [&](int i) { return (range.begin + i) % k_tiles; };
  // 64-row halves of this warpgroup's rows in a tile.
  const auto halves_of = [&](const WsWork& w) { return max(0, min(2, (w.row_end - w.row0 - c * kConsumerRows + 63) / 64)); };

  // Thread ct copies 16-byte chunk ct % 16 of rows ct / 16 + 8i (i < 16) of the warpgroup's rows.
  const int x_row = ct / 16, x_ch = ct % 16;
  const uint32_t x_dst = kWeightBytes + swizzled_chunk(kActRows, c * kConsumerRows + x_row, x_ch);
  const auto load_acts = [&](int i) {
    const WsWork w = tile_work(prm, unit_tile(i));
    const int kt = unit_kt(i), halves = halves_of(w);
    const int rows0 = w.row0 + c * kConsumerRows;
    const T* x_src = prm.A + static_cast<int64_t>(rows0 + x_row) * prm.K + x_ch * 8;
    const int rows_valid = w.row_end - rows0 - x_row;  // copies of rows x_row + 8j with 8j >= this read nothing
    const uint32_t st = smem + (i % kStages) * kStageBytes + x_dst;
    const bool k_valid = kt * kTileK + x_ch * 8 < prm.K;
#pragma unroll
    for (int j = 0; j < kConsumerRows / 8; ++j) {
      if (8 * j >= 64 * halves) break;  // rows of a skipped half are never read
      const bool valid = k_valid && 8 * j < rows_valid;
      cp_async16(st + 8 * j * 128, valid ? x_src + static_cast<int64_t>(8 * j) * prm.K + kt * kTileK : prm.A, valid);
    }
  };

  float acc[2][64];
  const auto zero_acc = [&] {
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[h][i] = 0.f;
  };
  // Partial sums of slot (CTA g, this warpgroup): float4 j of half h of thread ct at ((h * 16 + j) * 128 + ct),
  // so a warp's 16-byte accesses are contiguous.
  const auto slot = [&](int cta) {
    return reinterpret_cast<float4*>(prm.partials) + static_cast<int64_t>(cta * kConsumers + c) * 2 * 16 * 128 + ct;
  };
  const int bar_id = 1 + c;

  // Tile `tile`'s sums over k-tiles [kt0, kt1) are in acc: store them, or hand them to the tile's finisher, or
  // finish the tile with the other CTAs' parts.
  const auto epilogue = [&](int tile, int kt0, int kt1) {
    const WsWork w = tile_work(prm, tile);
    const int halves = halves_of(w);
    if (kt0 > 0) {
      // Not the tile's k-tile 0: the first segment of this CTA's run (stream-K). Hand the sums over.
      float4* dst = slot(blockIdx.x);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (h >= halves) break;
#pragma unroll
        for (int j = 0; j < 16; ++j)
          __stcg(dst + (h * 16 + j) * 128, make_float4(acc[h][4 * j], acc[h][4 * j + 1], acc[h][4 * j + 2], acc[h][4 * j + 3]));
      }
      raise_flag(prm.flags + blockIdx.x * kConsumers + c, bar_id);
      return;
    }
    if (kt1 < k_tiles) {
      // The tile's k-tile 0 but not its last: the CTAs after this one hold the rest, each as its first segment.
      const int tile_end = (tile + 1) * k_tiles, units_all = prm.cols * prm.row_blocks * k_tiles;
      for (int o = blockIdx.x + 1; o < prm.ctas && stream_start(units_all, prm.ctas, o) < tile_end; ++o) {
        // A CTA with an empty run (more CTAs than units) holds no part.
        if (stream_start(units_all, prm.ctas, o + 1) == stream_start(units_all, prm.ctas, o)) continue;
        wait_flag(prm.flags + o * kConsumers + c, bar_id);
        const float4* src = slot(o);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (h >= halves) break;
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            const float4 v = __ldcg(src + (h * 16 + j) * 128);
            acc[h][4 * j] += v.x;
            acc[h][4 * j + 1] += v.y;
            acc[h][4 * j + 2] += v.z;
            acc[h][4 * j + 3] += v.w;
          }
        }
      }
    }
    // Two adjacent weight rows of a thread are two adjacent outputs: one 32-bit store where both exist.
    const int n0 = w.col * kWeightRows, rows0 = w.row0 + c * kConsumerRows;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int v = 0; v < 2; ++v) {
        const int m = rows0 + 64 * h + 16 * warp + g + 8 * v;
        if (m >= w.row_end) continue;
        T* c_row = prm.C + static_cast<int64_t>(m) * prm.N;
#pragma unroll
        for (int i = 0; i < kWeightRows / 8; ++i) {
          const int n = n0 + 8 * i + 2 * t;
          if (n >= prm.N) continue;
          float y0 = acc[h][4 * i + 2 * v], y1 = acc[h][4 * i + 2 * v + 1];
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
      }
    }
  };

  zero_acc();
#pragma unroll
  for (int s = 0; s < kStages; ++s) {
    if (s < units) load_acts(s);
    cp_async_commit();
  }
  int tile = unit_tile(0), kt0 = unit_kt(0), kt = kt0;
  int halves = halves_of(tile_work(prm, tile));
  for (int i = 0; i < units; ++i) {
    const int s = i % kStages;
    const uint32_t st = smem + s * kStageBytes;
    cp_async_wait<kStages - 1>();  // this unit's activations (one group per unit, always committed)
    fence_proxy_async();
    warpgroup_sync(bar_id);
    mbar_wait(full + 8 * s, (i / kStages) & 1);
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int j = 0; j < 64; ++j) pin(acc[h][j]);
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
      for (int j = 0; j < 64; ++j) pin(acc[h][j]);
    mbar_arrive(empty + 8 * s);
    // Stage s's activation slice of this warpgroup is free (its wgmmas are complete): refill it.
    if (i + kStages < units) load_acts(i + kStages);
    cp_async_commit();
    if (kt + 1 == k_tiles || i + 1 == units) {  // the end of a tile or of the run
      epilogue(tile, kt0, kt + 1);
      if (i + 1 < units) {
        zero_acc();
        tile += 1;  // a run's next unit is k-tile 0 of the next tile
        kt0 = kt = 0;
        halves = halves_of(tile_work(prm, tile));
      }
    } else {
      ++kt;
    }
  }
  cp_async_wait<0>();
}

// Grid: stream-K (kStream), ctas CTAs; else one per tile, (ceil(n_tiles / 2), ceil(M / 256)) dense or
// (ceil(n_tiles / 2), chunks) grouped. Two instances: a run crossing tiles costs the consumer index work per
// k-tile and an epilogue inside its loop, which slowed one-tile CTAs by 12-22% when they shared its code.
template <typename T, int BITS, int NP, bool kStream>
__global__ void __launch_bounds__(kThreads<NP>, 1) wgmma_ws_kernel(const __grid_constant__ WsParams<T> prm) {
  const WsRange range = cta_range(prm);
  if (range.end <= range.begin) return;
  const WsWork work = tile_work(prm, range.begin / prm.k_tiles);  // a one-tile CTA's tile
  if (!kStream && work.row_end <= work.row0) return;  // a grouped CTA of an unused chunk: no rows
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
    produce<T, BITS, NP, kStream>(prm, range, smem, full, empty, lut, role);
  } else {
    if constexpr (NP == 2) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kConsumerRegs));
    if constexpr (kStream) {
      consume<T>(prm, range, smem, full, empty, role - NP);
    } else {
      consume_tile<T>(prm, work, smem, full, empty, role - NP);
    }
  }
}

static_assert(kWeightRows == kWgmmaWsTileN * kTileN, "the planner sizes the grid by kWgmmaWsTileN n-tiles per CTA");
static_assert(kWsStreamSlot == kWeightRows * kActRows && kWsStreamFlags == kConsumers, "wgmma.cuh's hand-off sizes");

template <typename T, int BITS, int NP, bool kStream>
void launch_kind(const WsParams<T>& prm, const dim3 grid, int device) {
  opt_in_shared_memory<wgmma_ws_kernel<T, BITS, NP, kStream>>(smem_bytes<BITS>(), device);
  wgmma_ws_kernel<T, BITS, NP, kStream><<<grid, kThreads<NP>, smem_bytes<BITS>(), at::cuda::getCurrentCUDAStream()>>>(prm);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int BITS, int NP>
void launch_np(const WsParams<T>& prm, int device, const char* name) {
  // The tile grid and the CTAs sharing it (1: one per tile); launched without programmatic dependence.
  record_launch({name, 0, 0, prm.row_blocks, prm.cols, prm.ctas > 0 ? prm.ctas : 1, NP, 0, false});
  if (prm.ctas > 0) return launch_kind<T, BITS, NP, true>(prm, dim3(static_cast<unsigned>(prm.ctas)), device);
  launch_kind<T, BITS, NP, false>(prm, dim3(prm.cols, prm.row_blocks), device);
}

// The plan's producer count (k = 5 is built with one: its shuffle decode needs the registers a second
// producer warpgroup would take).
template <typename T, int BITS>
void launch(const WsParams<T>& prm, int producers, int device, const char* name) {
  KBIT_CHECK(producers == 1 || (producers == 2 && BITS <= 4), "kbit wgmma_ws: no kernel with ", producers,
             " producer warpgroups for k=", BITS);
  if constexpr (BITS <= 4) {
    if (producers == 2) return launch_np<T, BITS, 2>(prm, device, name);
  }
  launch_np<T, BITS, 1>(prm, device, name);
}

// Both launches: a dense weight is a stack of one expert without a chunk list (chunks == nullptr). The plan's
// tile grid (cols x grid_rows) must be the one covering the n-tiles and M rows (dense) or the chunk list
// (grouped); `ctas` > 1 streams the tiles' k-tiles over that many CTAs (dense only; at most one per SM, as
// the CTAs wait on each other), 1 runs one CTA per tile.
void launch_ws(const at::Tensor& A, const at::Tensor& q, const at::Tensor& a, const at::Tensor& codebook,
               const std::optional<at::Tensor>& bias, int64_t N, int64_t K, at::Tensor& C, int64_t bits,
               int64_t n_tiles, int64_t k_tiles, const at::Tensor* chunks, int64_t grid_rows, int64_t cols,
               int64_t ctas, const at::Tensor* partials, const at::Tensor* flags, int64_t producers, const char* what,
               const char* name) {
  const int64_t want_rows = chunks != nullptr ? chunks->size(0) : (A.size(0) + kActRows - 1) / kActRows;
  const int64_t want_cols = (n_tiles + kWgmmaWsTileN - 1) / kWgmmaWsTileN;
  KBIT_CHECK(grid_rows == want_rows && cols == want_cols, what, ": the plan's grid ", cols, " x ", grid_rows,
             " is not the ", want_cols, " x ", want_rows, " CTAs covering ", n_tiles, " n-tiles and ",
             chunks != nullptr ? "the chunk list" : "M rows");
  KBIT_CHECK(cols * grid_rows * k_tiles <= INT32_MAX, what, ": ", cols * grid_rows, " tiles of ", k_tiles,
             " k-tiles exceed int32 unit indices");
  const int sms = at::cuda::getDeviceProperties(A.get_device())->multiProcessorCount;
  KBIT_CHECK(ctas == 1 || (chunks == nullptr && ctas >= 2 && ctas <= sms), what, ": the plan's ", ctas,
             " stream-K CTAs are not 1 (one per tile) or 2..", sms, " (one per SM, dense)");
  KBIT_CHECK(ctas == 1 || (partials != nullptr && partials->numel() >= ctas * kWsStreamSlot && flags != nullptr &&
                           flags->numel() >= ctas * kWsStreamFlags),
             what, ": stream-K over ", ctas, " CTAs needs its hand-off tensors (wgmma.cuh)");
  dispatch_type_and_bits(A.scalar_type(), bits, what, [&](auto type, auto k) {
    using T = decltype(type);
    const WsParams<T> prm{reinterpret_cast<const T*>(A.data_ptr()),
                          reinterpret_cast<const uint4*>(q.data_ptr()),
                          reinterpret_cast<const uint32_t*>(a.data_ptr()),
                          codebook.data_ptr<float>(),
                          bias.has_value() ? reinterpret_cast<const T*>(bias->data_ptr()) : nullptr,
                          reinterpret_cast<T*>(C.data_ptr()),
                          static_cast<int>(A.size(0)), static_cast<int>(N), static_cast<int>(K),
                          static_cast<int>(n_tiles), static_cast<int>(k_tiles),
                          chunks != nullptr ? reinterpret_cast<const int4*>(chunks->data_ptr<int>()) : nullptr,
                          chunks != nullptr ? q.numel() / q.size(0) / 4 : 0,
                          chunks != nullptr ? a.numel() / a.size(0) / 4 : 0,
                          static_cast<int>(cols),
                          static_cast<int>(grid_rows),
                          ctas > 1 ? static_cast<int>(ctas) : 0,
                          ctas > 1 ? static_cast<float*>(partials->data_ptr()) : nullptr,
                          ctas > 1 ? static_cast<int*>(flags->data_ptr()) : nullptr};
    launch<T, decltype(k)::value>(prm, static_cast<int>(producers), A.get_device(), name);
  });
}

}  // namespace

void launch_wgmma_ws(const at::Tensor& A, const at::Tensor& qweight_rt, const at::Tensor& absmax_rt,
                     const at::Tensor& codebook, const std::optional<at::Tensor>& bias, int64_t N, int64_t K,
                     at::Tensor& C, const LinearPlan& plan, const at::Tensor& partials, const at::Tensor& flags) {
  KBIT_CHECK(plan.path == LinearPath::kWgmmaWs && !plan.pdl, "kbit wgmma_ws: the plan (",
             linear_path_name(plan.path), ") is not the wgmma_ws path's");
  launch_ws(A, qweight_rt, absmax_rt, codebook, bias, N, K, C, qweight_rt.size(2), qweight_rt.size(0),
            qweight_rt.size(1), nullptr, plan.m_blocks, plan.cols, plan.splits, partials.defined() ? &partials : nullptr,
            flags.defined() ? &flags : nullptr, plan.producers, "kbit wgmma_ws", "wgmma_ws");
}

void launch_wgmma_ws_grouped(const at::Tensor& A, const at::Tensor& chunks, const at::Tensor& qweight,
                             const at::Tensor& absmax, const at::Tensor& codebook, int64_t N, int64_t K,
                             at::Tensor& C, const MoeProjPlan& plan) {
  KBIT_CHECK(plan.splits == 1 && !plan.pdl, "kbit wgmma_ws grouped: the plan (splits=", plan.splits,
             ") is not the warp-specialized kernel's");
  if (chunks.size(0) == 0) return;
  launch_ws(A, qweight, absmax, codebook, std::nullopt, N, K, C, qweight.size(3), qweight.size(1), qweight.size(2),
            &chunks, plan.m_blocks, plan.cols, 1, nullptr, nullptr, plan.producers, "kbit wgmma_ws grouped",
            "wgmma_ws_grouped");
}

}  // namespace kbit
