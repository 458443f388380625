// kbit fused dequant + wgmma for large M: C[M, N] = A[M, K] @ dequant(W)^T (+ bias), Hopper only.
//
// Operands. Weights are wgmma's A operand, dequantized straight into registers (a warpgroup's
// m64k16 fragment: warp w holds weight rows 16w..16w+15 exactly like mma.sync's m16n8k16 A), and
// 128 activation rows are the B operand (the wgmma N), read by the tensor cores from shared memory.
// So dequantized weights never touch shared memory, and each is used for 128 activation rows.
//
// K order. As in the mma.sync kernel (mma_kernel.cuh), lane (g, t) dequantizes block t of its two
// weight rows per k-tile, and in k16 step j its fragment holds that block's elements 4j..4j+3 at
// logical k {2t, 2t+1, 2t+8, 2t+9}. The B operand must follow the same order, and wgmma reads it
// from shared memory in logical order, so the activations are first permuted once per call
// (permute_kernel: logical position 16j + l of a k-tile <- physical element 32t + 4j + u), into a
// scratch matrix whose K is padded with zeros to whole k-tiles.
//
// Pipeline. A CTA = 2 warpgroups (grouped, k <= 4: 3; dense narrow, k <= 4: 4), each one runtime n-tile
// (64 weight rows), sharing one 128-row activation tile per k-tile, copied by cp.async kStages deep into
// the canonical K-major 128-byte-swizzled layout (two 64-wide K slabs per k-tile). Per k-tile a warpgroup
// issues 8 wgmma m64n128k16 on the tile in shared memory, then dequantizes the next k-tile's fragments
// (its plane words loaded two k-tiles ahead) while those run, then waits for them.
//
// Dense narrow (M <= kRsNarrowRows, plan.cpp: rs_narrow_rule): one block of rows, the wgmma N and the table decode
// as the grouped kernel's, and 4 warpgroups at 128 registers, so a large weight's n-tiles fill one wave.
//
// Grouped (routed experts up to the rule's slots per expert, plan.h: moe_wgmma_rs): a CTA takes one chunk of up
// to 128 rows of one expert (moe_route) and issues wgmma with the narrowest built N that holds the
// chunk's rows (16, 32, 64, 96 or 128), so a short chunk costs MMAs in proportion to its rows while the
// expert's weights are still decoded once per chunk of up to 128 rows. Its table-decode CTAs have a third
// warpgroup: a k-tile's decode is a chain of dependent table loads and multiplies that two warps per
// scheduler do not hide, and three fit in 168 registers.
#include "wgmma.cuh"

#include "dequant_core.cuh"
#include "plan.h"  // kMoeRsChunkRows, record_launch
#include "wgmma_core.cuh"

#include <algorithm>
#include <type_traits>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

namespace kbit {
namespace {

using namespace wgmma_core;

constexpr int kRows = kWgmmaRows;                    // activation rows per CTA: the wgmma N
constexpr int kSlabBytes = kRows * 128;              // 64 K-elements of all rows, 128-byte rows
constexpr int kStageBytes = 2 * kSlabBytes;          // one k-tile of activations
// Activation stages: 4, or 3 beside k = 5's 128 KB table (dequant_core.cuh: Lut).
template <int BITS, bool kLut>
constexpr int kStagesOf = BITS == 5 && kLut ? 3 : 4;
template <int BITS, bool kLut>
constexpr int kSmemBytes = kStagesOf<BITS, kLut> * kStageBytes + 1024;  // + slack to align the stages to 1024 bytes
// Launch kinds: dense (128-row blocks of x), dense narrow (one block of at most kRsNarrowRows rows: the wgmma N
// fitted to it) and grouped (chunks of routed rows, each with the narrowest built N that holds it).
enum class RsKind { kDense, kNarrow, kGrouped };
// The grouped and narrow kernels decode through the per-lane table (dequant_core.cuh: Lut) before the stages, as
// the warp-specialized kernel's producers do at k <= 4; the dense kernel keeps the shuffle decode. At one CTA per
// SM the shared memory has room for the wide table (64 KB at k = 2, 4), whose row offset is one PRMT, and for k = 5's
// 1024 pairs (128 KB, one stage fewer).
template <RsKind kKind>
constexpr bool rs_uses_lut() { return kKind != RsKind::kDense; }
template <int BITS>
using RsLut = Lut<BITS, true>;
template <int BITS, RsKind kKind>
constexpr int rs_lut_bytes() { return rs_uses_lut<kKind>() ? RsLut<BITS>::kBytes : 0; }
// Warpgroups per CTA, one runtime n-tile each (the planner sizes the grid by it: plan.h, wgmma_rs_warpgroups):
// grouped 3 where the table decodes (the third copies no activations): a k-tile's decode is a chain of dependent
// table loads and multiplies that two warps per scheduler do not hide; narrow 4 (128 registers: its fragments and
// accumulators of at most 64 rows fit; a weight of 448 n-tiles is one wave of 112 CTAs); 2 in the dense kernel.
template <int BITS, RsKind kKind>
constexpr int kWarpGroupsOf =
    wgmma_rs_warpgroups(kKind == RsKind::kGrouped, kKind == RsKind::kNarrow);
static_assert(kWarpGroupsOf<4, RsKind::kGrouped> == 3 && kWarpGroupsOf<5, RsKind::kGrouped> == 3 &&
                  kWarpGroupsOf<4, RsKind::kDense> == 2 && kWarpGroupsOf<4, RsKind::kNarrow> == 4 &&
                  kWarpGroupsOf<5, RsKind::kNarrow> == 4 && rs_uses_lut<RsKind::kGrouped>() &&
                  !rs_uses_lut<RsKind::kDense>(),
              "more than two warpgroups exactly where the table decodes");
constexpr int kCopyThreads = 256;  // the activation copies' threads: the first two warpgroups
// Fragment buffering. A warpgroup decodes k-tile kt + 1 while the wgmmas of kt run, into a second set of 32 fragment
// registers. Where that set, the NR / 2 accumulators and the ~40-56 other live registers (words two k-tiles ahead,
// addresses, table offsets) exceed a thread's share of the register file (65536 / (128 WG)), ptxas spills inside the
// k loop (20-92 bytes a thread: the narrow instance at N = 64, the grouped one at N = 128); there the k-tile's wgmmas
// go out in four commit groups of two k16 steps and the next k-tile's fragments are decoded into the same registers,
// each pair of steps as soon as its group has completed. The other registers grow with k's words (two per word:
// the two rows' words in flight), 48 at k = 4.
template <int BITS>
constexpr int kRsOtherRegs = 40 + 2 * BITS;
template <int BITS, int NR, int WG>
constexpr bool rs_single_fragments() {
  return NR / 2 + 2 * 32 + kRsOtherRegs<BITS> > 65536 / (128 * WG) / 8 * 8;
}
static_assert(rs_single_fragments<2, 48, 4>() && !rs_single_fragments<4, 32, 4>() &&
                  rs_single_fragments<5, 32, 4>() && rs_single_fragments<2, 128, 3>() &&
                  !rs_single_fragments<5, 96, 3>(),
              "one fragment buffer exactly where two spill: the narrow instance at N = 64 (k = 5: 32), the grouped one "
              "at 128");
static_assert(kMoeRsChunkRows == kRows, "a grouped chunk is one CTA's activation rows");

// ----------------------------------------------------------------------------- the MMA

// d (64 x NR fp32 of the warpgroup) += A (registers: each warp's m16k16 fragment) * B (descriptor: NR
// activation rows). One specialization per built width and dtype; operands %0.. are the NR / 2
// accumulators, then the four fragment registers, the descriptor and the scale-d flag.
template <typename T, int NR>
__device__ __forceinline__ void mma_rs(float (&d)[NR / 2], const uint32_t (&a)[4], uint64_t desc);

#define KBIT_MMA_RS(TYPE, PTX_TYPE, NR, D, A0, A1, A2, A3, DESC, FLAG)                                               \
  template <>                                                                                                       \
  __device__ __forceinline__ void mma_rs<TYPE, NR>(float (&d)[NR / 2], const uint32_t (&a)[4], uint64_t desc) {     \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #FLAG ", 0;\n"                                                 \
                 "wgmma.mma_async.sync.aligned.m64n" #NR "k16.f32." PTX_TYPE "." PTX_TYPE " " KBIT_WGMMA_D##D        \
                 ", {%" #A0 ", %" #A1 ", %" #A2 ", %" #A3 "}, %" #DESC ", p, 1, 1, 0;\n}\n"                          \
                 : KBIT_WGMMA_D##D##_OPERANDS(d)                                                                    \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));                                   \
  }
#define KBIT_MMA_RS_BOTH(NR, D, A0, A1, A2, A3, DESC, FLAG)                  \
  KBIT_MMA_RS(__nv_bfloat16, "bf16", NR, D, A0, A1, A2, A3, DESC, FLAG) \
  KBIT_MMA_RS(__half, "f16", NR, D, A0, A1, A2, A3, DESC, FLAG)
KBIT_MMA_RS_BOTH(16, 8, 8, 9, 10, 11, 12, 13)
KBIT_MMA_RS_BOTH(32, 16, 16, 17, 18, 19, 20, 21)
KBIT_MMA_RS_BOTH(48, 24, 24, 25, 26, 27, 28, 29)
KBIT_MMA_RS_BOTH(64, 32, 32, 33, 34, 35, 36, 37)
KBIT_MMA_RS_BOTH(96, 48, 48, 49, 50, 51, 52, 53)
KBIT_MMA_RS_BOTH(128, 64, 64, 65, 66, 67, 68, 69)
#undef KBIT_MMA_RS_BOTH
#undef KBIT_MMA_RS

// ----------------------------------------------------------------------------- activation permutation

// Ap[m, 128 kt + 16 j + l] = A[m, 128 kt + 32 t + 4 j + u] with t = (l % 8) / 2, u = 2 (l / 8) + l % 2,
// and zero past K. One thread per pair of elements (l even: u and u + 1 are adjacent in both).
template <typename T>
__global__ void permute_kernel(const T* __restrict__ A, T* __restrict__ Ap, int M, int K, int Kp) {
  const int64_t pairs = static_cast<int64_t>(M) * (Kp / 2);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < pairs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int m = static_cast<int>(i / (Kp / 2)), L = static_cast<int>(i % (Kp / 2)) * 2;
    const int kt = L / kTileK, j = (L % kTileK) / 16, l = L % 16;
    const int P = kt * kTileK + 32 * ((l % 8) / 2) + 4 * j + 2 * (l / 8);
    uint32_t v = 0;
    if (P < K) v = *reinterpret_cast<const uint32_t*>(A + static_cast<int64_t>(m) * K + P);
    *reinterpret_cast<uint32_t*>(Ap + static_cast<int64_t>(m) * Kp + L) = v;
  }
}

// ----------------------------------------------------------------------------- kernel

template <typename T>
struct WgmmaParams {
  const T* Ap;             // [M, Kp] permuted activations
  const uint8_t* qweight;  // runtime layout, bytes (grouped: expert 0's)
  const uint8_t* absmax;
  const float* codebook;
  const T* bias;
  T* C;
  int M, N, Kp, n_tiles, k_tiles;
  // Grouped (routed experts): CTA row y multiplies chunk y = {expert, first row, rows, 0} of A's rows
  // (moe_route) with that expert's weights; nullptr for a dense launch.
  const int4* chunks;
  int64_t expert_q_bytes, expert_a_bytes;  // one expert's bit planes / scale codes
};

// The wgmma N for a chunk of `rows` activation rows: the narrowest built width that holds them (48: the dense narrow
// launch only, measured there).
template <RsKind kKind>
__device__ __forceinline__ int rs_width(int rows) {
  if (kKind == RsKind::kNarrow && rows > 32 && rows <= 48) return 48;
  return rows <= 16 ? 16 : rows <= 32 ? 32 : rows <= 64 ? 64 : rows <= 96 ? 96 : 128;
}

// One CTA's product: activation rows [m0, m_end) (at most kRows) times its warpgroups' n-tiles of the
// weight at (qweight, absmax), through wgmma N = NR >= m_end - m0. The shared-memory stages keep the
// 128-row layout whatever NR is: the MMA reads its first NR rows.
template <typename T, int BITS, int NR, bool kLut, int WG>
__device__ __forceinline__ void rs_tile(const WgmmaParams<T>& prm, const uint8_t* qweight, const uint8_t* absmax,
                                        int m0, int m_end, uint32_t smem, const uint8_t* lut) {
  static_assert(NR % 16 == 0 && NR <= kRows, "activation copies run in steps of 16 rows");
  constexpr int F = Fields<BITS>::kWords;
  constexpr int kStages = kStagesOf<BITS, kLut>;
  const int tid = threadIdx.x;
  // Warp index within the warpgroup through a shuffle from lane 0: provably warp-uniform, so the
  // lookups stay plain warp-wide shuffles.
  const int wg = __shfl_sync(0xFFFFFFFFu, tid / 128, 0), warp = __shfl_sync(0xFFFFFFFFu, (tid / 32) % 4, 0);
  const int lane = tid % 32, g = lane / 4, t = lane % 4;
  const int n_tile = blockIdx.x * WG + wg;
  const int k_tiles = prm.k_tiles;
  const float codebook_reg = __ldg(prm.codebook + (lane & ((1 << BITS) - 1)));

  // Activation copies: thread tid copies 16-byte chunk tid % 16 of rows tid / 16 + 16 i (i < NR / 16);
  // the chunk's swizzled slot ((chunk % 8) ^ (row % 8)) is the same for all i. Rows past m_end are
  // zero-filled; their outputs are never stored.
  const int x_row = tid / 16, x_ch = tid % 16;
  const uint32_t x_dst = swizzled_chunk(kRows, x_row, x_ch);
  const T* x_src = prm.Ap + static_cast<int64_t>(m0 + x_row) * prm.Kp + x_ch * 8;
  const auto load_stage = [&](int kt) {
    const uint32_t st = smem + (kt % kStages) * kStageBytes;
    if (WG > 2 && tid >= kCopyThreads) return;
#pragma unroll
    for (int i = 0; i < NR / 16; ++i) {
      const bool valid = m0 + x_row + 16 * i < m_end;
      cp_async16(st + x_dst + i * 16 * 128, valid ? x_src + static_cast<int64_t>(16 * i) * prm.Kp + kt * kTileK : prm.Ap,
                 valid);
    }
  };

  // Weight words: rows 16 warp + g + 8h of this warpgroup's n-tile, block t of each k-tile. A
  // warpgroup past the last n-tile reads the last one and stores nothing.
  const int tile_row = 16 * warp + g;
  const int64_t band = static_cast<int64_t>(min(n_tile, prm.n_tiles - 1)) * k_tiles;
  const uint8_t* w_words = qweight + band * BITS * kPlaneBytes + (tile_row * kTileKB + t) * 4;
  const uint8_t* w_codes = absmax + band * kCodeBytes + tile_row * kTileKB + t;
  struct Words {
    uint32_t plane[2][BITS];
    uint32_t code[2];
  };
  const auto load_words = [&](Words& w, int kt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int b = 0; b < BITS; ++b)
        w.plane[h][b] = __ldg(reinterpret_cast<const uint32_t*>(w_words + static_cast<int64_t>(kt) * BITS * kPlaneBytes +
                                                                (b * kTileN + 8 * h) * kTileKB * 4));
      w.code[h] = __ldg(w_codes + static_cast<int64_t>(kt) * kCodeBytes + 8 * h * kTileKB);
    }
  };
  // The k-tile's 8 A fragments from its words: index words, the two scales, then per k16 step
  // two pairs of codebook values per row, rounded to T and scaled in pairs (as mma_kernel.cuh).
  const auto build_shuffle = [&](uint32_t (&a)[8][4], const Words& w) {
    uint32_t q[2][F], scale[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      gather_indices<BITS>(w.plane[h], q[h]);
      const float sc = decode_scale(w.code[h], 0);
      scale[h] = Half2<T>::pack(sc, sc);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const auto pair = [&](int e) {
          return Half2<T>::scale2(
              Half2<T>::pack(lookup<BITS>(codebook_reg, q[h], e), lookup<BITS>(codebook_reg, q[h], e + 1)), scale[h]);
        };
        a[j][h] = pair(4 * j);
        a[j][2 + h] = pair(4 * j + 2);
      }
    }
  };

  // The same through the table: per row, its block's index words, then per 8 elements (c) the four
  // pairs (8c, +1), (8c + 2, +3), (8c + 4, +5), (8c + 6, +7) = fragments k16 steps 2c (h, 2 + h) and
  // 2c + 1 (h, 2 + h), scaled in pairs.
  const uint32_t lut_lane = lut_lane_offset<BITS>(lane);
  // Row h's index words and scale (both halves of T) from its block's words.
  const auto lut_row = [&](const Words& w, int h, uint32_t (&q)[Lut<BITS>::kWords], uint32_t& scale) {
    lut_indices<BITS>(w.plane[h], q);
    const float sc = decode_scale(w.code[h], 0);
    scale = Half2<T>::pack(sc, sc);
  };
  // Row h's part of k16 steps 2c and 2c + 1.
  const auto lut_steps = [&](uint32_t (&a)[8][4], const uint32_t (&q)[Lut<BITS>::kWords], uint32_t scale, int h, int c) {
    uint32_t v[4];
    lut_scaled_pairs<T, BITS, true>(lut, q, c, lut_lane, scale, v);
    a[2 * c][h] = v[0];
    a[2 * c][2 + h] = v[1];
    a[2 * c + 1][h] = v[2];
    a[2 * c + 1][2 + h] = v[3];
  };
  const auto build_lut = [&](uint32_t (&a)[8][4], const Words& w) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint32_t q[Lut<BITS>::kWords], scale;
      lut_row(w, h, q, scale);
#pragma unroll
      for (int c = 0; c < 4; ++c) lut_steps(a, q, scale, h, c);
    }
  };
  const auto build = [&](uint32_t (&a)[8][4], const Words& w) {
    if constexpr (kLut) {
      build_lut(a, w);
    } else {
      build_shuffle(a, w);
    }
  };
  // build_lut into the fragments the in-flight wgmmas of the previous k-tile still read (rs_single_fragments): the
  // index words and scales first, then k16 steps 2c, 2c + 1 once commit group c has completed (wgmma_wait<3 - c>).
  // pin keeps the old registers live up to that wait, so the new values cannot take them before it.
  const auto build_lut_after = [&](uint32_t (&a)[8][4], const Words& w) {
    uint32_t q[2][Lut<BITS>::kWords], scale[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) lut_row(w, h, q[h], scale[h]);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      if (c == 0) wgmma_wait<3>();
      if (c == 1) wgmma_wait<2>();
      if (c == 2) wgmma_wait<1>();
      if (c == 3) wgmma_wait<0>();
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        pin(a[2 * c][v]);
        pin(a[2 * c + 1][v]);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) lut_steps(a, q[h], scale[h], h, c);
    }
  };

  float acc[NR / 2];
#pragma unroll
  for (int i = 0; i < NR / 2; ++i) acc[i] = 0.f;

  // A k-tile's start, shared by both steps: wait for its activations, refill the stage the previous k-tile used, and
  // fence the accumulators for its wgmmas; returns the k-tile's stage.
  const auto open_k_tile = [&](int kt) {
    cp_async_wait<kStages - 2>();
    fence_proxy_async();
    __syncthreads();
    if (kt + kStages - 1 < k_tiles) load_stage(kt + kStages - 1);
    cp_async_commit();
    const uint32_t st = smem + (kt % kStages) * kStageBytes;
#pragma unroll
    for (int i = 0; i < NR / 2; ++i) pin(acc[i]);
    wgmma_fence();
    return st;
  };
  const auto mma_step = [&](const uint32_t (&a)[4], uint32_t st, int j) {
    mma_rs<T, NR>(acc, a, smem_desc(st + (j / 4) * kSlabBytes + (j % 4) * 32));
  };

  // One k-tile: open it, issue its 8 wgmmas with fragments `cur`, dequantize k-tile kt + 1 into `next` meanwhile (and
  // load the words of kt + 3 into the buffer `next_words` just emptied), then wait for the wgmmas.
  const auto step = [&](uint32_t (&cur)[8][4], uint32_t (&next)[8][4], Words& next_words, int kt) {
    const uint32_t st = open_k_tile(kt);
#pragma unroll
    for (int j = 0; j < 8; ++j) mma_step(cur[j], st, j);
    wgmma_commit();
    if (kt + 1 < k_tiles) {
      build(next, next_words);
      if (kt + 3 < k_tiles) load_words(next_words, kt + 3);
    }
    wgmma_wait_all();
#pragma unroll
    for (int i = 0; i < NR / 2; ++i) pin(acc[i]);
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int v = 0; v < 4; ++v) pin(cur[j][v]);
  };

  // One k-tile with one fragment buffer: as step, its wgmmas in four commit groups, k-tile kt + 1 decoded into `a`
  // behind them (build_lut_after, which ends with every group complete).
  const auto step_single = [&](uint32_t (&a)[8][4], Words& next_words, int kt) {
    const uint32_t st = open_k_tile(kt);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      mma_step(a[2 * c], st, 2 * c);
      mma_step(a[2 * c + 1], st, 2 * c + 1);
      wgmma_commit();
    }
    if (kt + 1 < k_tiles) {
      build_lut_after(a, next_words);
      if (kt + 3 < k_tiles) load_words(next_words, kt + 3);
    } else {
      wgmma_wait<0>();
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int v = 0; v < 4; ++v) pin(a[j][v]);
    }
#pragma unroll
    for (int i = 0; i < NR / 2; ++i) pin(acc[i]);
  };

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load_stage(s);
    cp_async_commit();
  }
  Words w0, w1;
  load_words(w0, 0);
  if (k_tiles > 1) load_words(w1, 1);
  if constexpr (kLut && rs_single_fragments<BITS, NR, WG>()) {
    uint32_t a[8][4];
    build(a, w0);
    if (k_tiles > 2) load_words(w0, 2);
    for (int kt = 0; kt < k_tiles; kt += 2) {
      step_single(a, w1, kt);
      if (kt + 1 >= k_tiles) break;
      step_single(a, w0, kt + 1);
    }
  } else {
    uint32_t a0[8][4], a1[8][4];
    build(a0, w0);
    if (k_tiles > 2) load_words(w0, 2);
    for (int kt = 0; kt < k_tiles; kt += 2) {
      step(a0, a1, w1, kt);
      if (kt + 1 >= k_tiles) break;
      step(a1, a0, w0, kt + 1);
    }
  }
  cp_async_wait<0>();

  // D fragment: acc[4i + 2h + u] is weight row 16 warp + g + 8h of the n-tile, activation row
  // m0 + 8i + 2t + u.
  if (n_tile >= prm.n_tiles) return;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int n = n_tile * kTileN + tile_row + 8 * h;
    if (n >= prm.N) continue;
    const float b = prm.bias != nullptr ? Half2<T>::to_float(prm.bias[n]) : 0.f;
#pragma unroll
    for (int i = 0; i < NR / 8; ++i) {
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int m = m0 + 8 * i + 2 * t + u;
        if (m < m_end) prm.C[static_cast<int64_t>(m) * prm.N + n] = Half2<T>::narrow(acc[4 * i + 2 * h + u] + b);
      }
    }
  }
}

// Grid: (ceil(n_tiles / WG), ceil(M / 128)) dense, (ceil(n_tiles / WG), 1) narrow, or (ceil(n_tiles / WG), chunk
// entries) grouped.
template <typename T, int BITS, RsKind kKind, int WG = kWarpGroupsOf<BITS, kKind>>
__global__ void __launch_bounds__(128 * WG, 1) wgmma_kernel(const __grid_constant__ WgmmaParams<T> prm) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  constexpr bool kLut = rs_uses_lut<kKind>();
  // The table (if any) first, at the window's start; the stages after it, aligned for the 128-byte swizzle.
  const uint32_t smem =
      (static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) + rs_lut_bytes<BITS, kKind>() + 1023) & ~1023u;
  if constexpr (kKind == RsKind::kDense) {
    rs_tile<T, BITS, kRows, kLut, WG>(prm, prm.qweight, prm.absmax, static_cast<int>(blockIdx.y) * kRows, prm.M,
                                      smem, nullptr);
  } else {
    // Rows [m0, m_end) of A and the weight they multiply: the narrow launch's one block, or chunk y's rows and
    // expert. Every chunk entry holds defined values; unused ones have expert -1 (moe_route). The width is
    // uniform per CTA, so the branch below is too (the tiles' __syncthreads stay CTA-wide).
    int m0 = 0, m_end = prm.M;
    const uint8_t* q = prm.qweight;
    const uint8_t* a = prm.absmax;
    if constexpr (kKind == RsKind::kGrouped) {
      const int4 chunk = prm.chunks[blockIdx.y];
      if (chunk.x < 0 || chunk.z <= 0) return;
      q += chunk.x * prm.expert_q_bytes;
      a += chunk.x * prm.expert_a_bytes;
      m0 = chunk.y;
      m_end = chunk.y + min(chunk.z, kRows);
    }
    // The table, filled by the whole CTA before the first decode (rs_tile builds its first fragments
    // before its first barrier).
    uint8_t* lut = smem_raw;
    if constexpr (kLut) {
      lut_fill<T, BITS, true>(lut, prm.codebook, static_cast<int>(threadIdx.x), 128 * WG);
      __syncthreads();
    }
    switch (rs_width<kKind>(m_end - m0)) {
      case 16: return rs_tile<T, BITS, 16, kLut, WG>(prm, q, a, m0, m_end, smem, lut);
      case 32: return rs_tile<T, BITS, 32, kLut, WG>(prm, q, a, m0, m_end, smem, lut);
      case 64: return rs_tile<T, BITS, 64, kLut, WG>(prm, q, a, m0, m_end, smem, lut);
    }
    if constexpr (kKind == RsKind::kNarrow) {
      return rs_tile<T, BITS, 48, kLut, WG>(prm, q, a, m0, m_end, smem, lut);
    }
    if constexpr (kKind == RsKind::kGrouped) {
      if (m_end - m0 <= 96) return rs_tile<T, BITS, 96, kLut, WG>(prm, q, a, m0, m_end, smem, lut);
      return rs_tile<T, BITS, kRows, kLut, WG>(prm, q, a, m0, m_end, smem, lut);
    }
  }
}

// The activations permuted into the kernel's k order, then the kernel on the plan's grid of `cols` x `grid_rows`
// CTAs, validated here. Dense: q [n_tiles, k_tiles, k, ...]; grouped: q [E, n_tiles, k_tiles, k, ...] and chunks
// from moe_route.
template <typename T, int BITS>
void launch_typed(const at::Tensor& A, const at::Tensor& q, const at::Tensor& a, const at::Tensor& cb,
                  const std::optional<at::Tensor>& bias, int64_t N, int64_t K, at::Tensor& C,
                  const at::Tensor* chunks, int64_t grid_rows, int64_t cols, const char* name) {
  const bool grouped = chunks != nullptr;
  const int M = static_cast<int>(A.size(0));
  const int n_tiles = static_cast<int>(q.size(grouped ? 1 : 0)), k_tiles = static_cast<int>(q.size(grouped ? 2 : 1));
  const int64_t want_rows = grouped ? chunks->size(0) : (M + kRows - 1) / kRows;
  const bool narrow = wgmma_rs_narrow(grouped, M);
  const int64_t wg = wgmma_rs_warpgroups(grouped, narrow);
  const int64_t want_cols = (n_tiles + wg - 1) / wg;
  KBIT_CHECK(grid_rows == want_rows && cols == want_cols, name, ": the plan's grid ", cols, " x ", grid_rows,
             " is not the ", want_cols, " x ", want_rows, " CTAs covering ", n_tiles, " n-tiles and ",
             grouped ? "the chunk list" : "M rows");
  if (M == 0 || grid_rows == 0) return;
  const int Kp = k_tiles * kTileK;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  at::Tensor Ap = at::empty({M, Kp}, A.options());
  const int64_t pairs = static_cast<int64_t>(M) * Kp / 2;
  const int blocks = static_cast<int>(
      std::min<int64_t>((pairs + 255) / 256, 16 * at::cuda::getCurrentDeviceProperties()->multiProcessorCount));
  permute_kernel<T><<<blocks, 256, 0, stream>>>(reinterpret_cast<const T*>(A.data_ptr()),
                                                 reinterpret_cast<T*>(Ap.data_ptr()), M, static_cast<int>(K), Kp);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const WgmmaParams<T> prm{reinterpret_cast<const T*>(Ap.data_ptr()),
                           static_cast<const uint8_t*>(q.data_ptr()),
                           static_cast<const uint8_t*>(a.data_ptr()),
                           cb.data_ptr<float>(),
                           bias.has_value() ? reinterpret_cast<const T*>(bias->data_ptr()) : nullptr,
                           reinterpret_cast<T*>(C.data_ptr()),
                           M, static_cast<int>(N), Kp, n_tiles, k_tiles,
                           grouped ? reinterpret_cast<const int4*>(chunks->data_ptr<int>()) : nullptr,
                           grouped ? static_cast<int64_t>(q.nbytes()) / q.size(0) : 0,
                           grouped ? static_cast<int64_t>(a.nbytes()) / a.size(0) : 0};
  const auto go = [&](auto kind_c) {
    constexpr RsKind kKind = decltype(kind_c)::value;
    constexpr int bytes = kSmemBytes<BITS, rs_uses_lut<kKind>()> + rs_lut_bytes<BITS, kKind>();
    static_assert(bytes <= 227 * 1024, "one CTA's shared memory must fit an SM (227 KB on Hopper)");
    const dim3 grid(static_cast<unsigned>(cols), static_cast<unsigned>(grid_rows));
    record_launch({name, 0, 0, grid.y, grid.x, 1, 0, 0, false});  // launched without programmatic dependence
    opt_in_shared_memory<wgmma_kernel<T, BITS, kKind>>(bytes, A.get_device());
    wgmma_kernel<T, BITS, kKind><<<grid, 128 * kWarpGroupsOf<BITS, kKind>, bytes, stream>>>(prm);
  };
  if (grouped) {
    go(std::integral_constant<RsKind, RsKind::kGrouped>{});
  } else if (narrow) {
    go(std::integral_constant<RsKind, RsKind::kNarrow>{});
  } else {
    go(std::integral_constant<RsKind, RsKind::kDense>{});
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void launch_wgmma(const at::Tensor& A, const at::Tensor& qweight_rt, const at::Tensor& absmax_rt,
                  const at::Tensor& codebook, const std::optional<at::Tensor>& bias, int64_t N, int64_t K,
                  at::Tensor& C, const LinearPlan& plan) {
  KBIT_CHECK(plan.path == LinearPath::kWgmma && plan.splits == 1 && !plan.pdl, "kbit wgmma: the plan (",
             linear_path_name(plan.path), ") is not the wgmma path's");
  dispatch_type_and_bits(A.scalar_type(), qweight_rt.size(2), "kbit wgmma", [&](auto type, auto bits) {
    launch_typed<decltype(type), decltype(bits)::value>(A, qweight_rt, absmax_rt, codebook, bias, N, K, C, nullptr,
                                                        plan.m_blocks, plan.cols, "wgmma");
  });
}

void launch_wgmma_rs_grouped(const at::Tensor& A, const at::Tensor& chunks, const at::Tensor& qweight,
                             const at::Tensor& absmax, const at::Tensor& codebook, int64_t N, int64_t K,
                             at::Tensor& C, const MoeProjPlan& plan) {
  KBIT_CHECK(plan.splits == 1 && plan.producers == 0 && !plan.pdl, "kbit wgmma_rs_grouped: the plan (splits=",
             plan.splits, ", producers=", plan.producers, ") is not the register-operand kernel's");
  dispatch_type_and_bits(A.scalar_type(), qweight.size(3), "kbit wgmma_rs_grouped", [&](auto type, auto bits) {
    launch_typed<decltype(type), decltype(bits)::value>(A, qweight, absmax, codebook, std::nullopt, N, K, C, &chunks,
                                                        plan.m_blocks, plan.cols, "wgmma_rs_grouped");
  });
}

}  // namespace kbit
