// kbit fused dequant + MMA kernel: C[M, N] = A[M, K] @ dequant(W)^T (+ bias), mma.sync m16n8k16.
//
// Operands. Weights are the MMA's A operand (16 weight rows per fragment) and activations the B
// operand (8 activation rows per n8 tile), so M = 5..8 wastes at most 3 of 8 columns instead of
// 11 of 16 rows. C's fragment is weight row x activation row, fp32.
//
// K order inside a runtime k-tile (128 elements = 4 blocks of 32). The MMA sums over its 16 k
// positions in any order, so A and B only have to agree on which physical element sits at each
// logical k. Lane (g, t) = (lane / 4, lane % 4) holds logical k {2t, 2t+1, 2t+8, 2t+9} of both
// fragments; in MMA j (0..7) of a k-tile these are physical elements 4j .. 4j+3 of block t. So
// each lane dequantizes exactly one block per weight row and k-tile (the GEMV's per-block
// transpose and shuffle lookup, dequant_core.cuh), its fragments come out of the lookups in
// order, and its B fragment for MMA j is 4 consecutive activations (8 bytes).
//
// Pipeline. A CTA (4 warps) owns 64r weight rows (r runtime n-tiles), 8p activation rows and a
// K split; per k-tile it copies the r weight tiles verbatim and the 8p x 128 activations into
// shared memory with cp.async, kStages deep. Each warp owns 16r weight rows: once per k-tile it
// turns its words into index words (k = 2, 4: the runtime layout already holds them; k = 3: one
// word unfolded from the other three; k = 5: its stream words as they are), then per k16 step builds one A fragment per row group and reuses it for
// all p activation tiles; each B fragment serves r row groups. A fragment is built either from 16-bit
// pairs / quads read from a per-lane shared-memory table (uses_lut: one load per two or four
// weights) or by shuffle lookups of single codebook values, a conversion and a scale per pair.
// The K splits of one CTA column are a thread-block cluster; their fp32 partial tiles are
// summed through distributed shared memory in rank order (deterministic, no workspace).
//
// Grouped (routed experts): with a chunk list, CTA row y multiplies chunk y = {expert, first row,
// rows <= 8p} of A (rows grouped by expert) with that expert's weights in a stacked runtime
// tensor; CTA rows past the device-side chunk count leave at once (a whole cluster shares its y).
#pragma once

#include "cp_async.cuh"
#include "dequant_core.cuh"
#include "kbit_format.cuh"
#include "launch_utils.cuh"
#include "mma.cuh"
#include "plan.h"

#include <algorithm>
#include <atomic>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <cooperative_groups.h>

#include "check.h"

namespace kbit {
namespace mma_detail {

namespace cg = cooperative_groups;

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kTileK = kTileKB * kBlockSize;      // 128 elements of K per runtime tile
constexpr int kRowChunks = kTileK * 2 / 16;       // 16-byte chunks of one activation row per k-tile
constexpr int kSmemTarget = 72 * 1024;            // pipeline bytes that still let 3 CTAs share an SM
constexpr int kLutSmemTarget = 20 * 1024;         // ... with a 32 KB table: 4 narrow CTAs per SM
constexpr int kSmemPerSm = 227 * 1024;            // shared memory an sm_90 SM gives its CTAs
constexpr int kSmemReservedPerCta = 1024;         // of which the driver keeps this much per CTA
constexpr int kMaxDevices = 64;                   // devices the per-device launch preparation tracks

// Bytes of one runtime tile: BITS planes of 64 rows x 4 words, then 64 rows x 4 scale codes.
template <int BITS>
constexpr int tile_bytes() {
  return BITS * kTileBlocks * 4 + kTileBlocks;
}

// How an instance decodes: through a shared-memory table of 16-bit pairs / quads (dequant_core.cuh:
// Lut) for k = 2..4 at p <= 3, where decode instructions bound the kernel; by register shuffle at
// k = 5 (no table of pairs fits) and at p >= 4, where MMAs per weight grow with p and the table's
// 32 KB would take the pipeline stages the larger activation tiles need.
template <int BITS, int P>
constexpr bool uses_lut() {
  return BITS <= 4 && P <= 3;
}
template <int BITS, int P>
constexpr int lut_bytes() {
  if constexpr (uses_lut<BITS, P>()) return Lut<BITS>::kBytes;
  return 0;
}

template <int BITS, int P, int R>
struct Shape {
  static constexpr bool kLut = uses_lut<BITS, P>();
  static constexpr int kLutBytes = lut_bytes<BITS, P>();  // the table sits first, the stages after it
  static constexpr int kWBytes = R * tile_bytes<BITS>();
  static constexpr int kXBytes = 8 * P * kTileK * 2;
  static constexpr int kStageBytes = kWBytes + kXBytes;
  static constexpr int kStages = std::max(2, std::min(4, (kLut ? kLutSmemTarget : kSmemTarget) / kStageBytes));
  static constexpr int kPartialUnits = kWarps * R * P * 32;  // float4 C fragments of one CTA
  static constexpr int kSmemBytes = kLutBytes + std::max(kStages * kStageBytes, kPartialUnits * 16);
  static constexpr int kSmemFit = kSmemPerSm / (kSmemBytes + kSmemReservedPerCta);  // CTAs shared memory holds
  // CTAs per SM the registers are capped for (launch bounds). Narrow warps: as many as shared memory
  // holds (uncapped, ptxas trades CTAs for fewer re-computations). Wide warps: 3 (<= 168 registers;
  // shared memory allows 3 or 4, and a cap of 4 = 128 registers spills), except k = 5 with 16 MMA
  // tiles per warp, which spill under 168 too and are left uncapped (2 CTAs per SM).
  static constexpr int kCtasPerSm = R == 1 ? std::min(16, kSmemFit) : BITS == 5 && P * R >= 16 ? 1 : 3;
  // CTAs an SM holds at once: the register cap or what shared memory allows, whichever is lower.
  static constexpr int kResident = std::min(kCtasPerSm, kSmemFit);
};

template <typename T>
struct MmaParams {
  const T* A;
  const uint8_t* qweight;  // runtime layout, bytes
  const uint8_t* absmax;   // runtime layout, scale codes
  const float* codebook;
  const T* bias;
  T* C;
  int M, N, K, n_tiles, k_tiles, splits;
  // Grouped launches only (chunks == nullptr: dense): int4 {expert, first row, rows, 0} per CTA row,
  // how many are valid, and the bytes between two experts' runtime tensors.
  const int4* chunks;
  const int* num_chunks;
  int64_t expert_qbytes, expert_abytes;
  // The chunk list was written at least two launches back (fused_moe: the routing, then the gather or
  // the gate_up chain), so it is complete once this grid runs, and the weight prologue may read it and
  // copy the expert's first tiles before the PDL wait, as the dense launch does.
  bool chunks_early;
};

// ----------------------------------------------------------------------------- element types

// The weight fragment's element type (dequant_core.cuh: Half2) plus its mma.sync m16n8k16.
template <typename T>
struct Elem;

template <>
struct Elem<__nv_bfloat16> : Half2<__nv_bfloat16> {
  __device__ static __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <>
struct Elem<__half> : Half2<__half> {
  __device__ static __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// ----------------------------------------------------------------------------- copies

// Slot of 16-byte chunk ch (0..15) of activation row `row` in its 256-byte smem row. Lane (g, t)
// reads chunk 4t + c of row 8i + g; a 16-byte load is served a quarter warp (8 lanes: g in {2h,
// 2h+1}, t = 0..3) at a time, which is conflict-free when the 8 slots differ mod 8 (mod 128 bytes).
// Slot bits: bit 2 = t's low bit (from ch), bit 1 = c1 ^ t's high bit, bit 0 = c0 ^ row parity.
__device__ __forceinline__ int x_slot(int ch, int row) { return ch ^ ((ch >> 2) & 2) ^ (row & 1); }

// ----------------------------------------------------------------------------- kernel

// Grid: (cols * splits, m_blocks) CTAs in clusters of `splits` along x (CTA x = col * splits + split).
// kGrouped: CTA row y is chunk y (MmaParams::chunks); a separate instance, so the dense kernels'
// code and registers stay as they are.
template <typename T, int BITS, int P, int R, bool kGrouped>
__global__ void __launch_bounds__(kThreads, (Shape<BITS, P, R>::kCtasPerSm)) mma_kernel(const MmaParams<T> prm) {
  using S = Shape<BITS, P, R>;
  constexpr bool kLut = S::kLut;
  constexpr int F = Fields<BITS>::kWords;
  constexpr int kTileBytes = tile_bytes<BITS>();
  constexpr int kTileChunks = kTileBytes / 16;
  constexpr int kPlaneBytes = BITS * kTileBlocks * 4;
  constexpr int kPlaneChunks = kPlaneBytes / 16;
  constexpr int kCodeBytes = kTileBlocks;
  extern __shared__ __align__(16) uint8_t smem[];

  // The warp index through a shuffle from lane 0: provably warp-uniform, so the shuffles below
  // stay plain warp-wide SHFLs.
  const int warp = __shfl_sync(0xFFFFFFFFu, static_cast<int>(threadIdx.x) / 32, 0), lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int splits = prm.splits;
  const int split = blockIdx.x % splits;
  const int kt_begin = split * prm.k_tiles / splits, kt_end = (split + 1) * prm.k_tiles / splits;
  const int nkt = kt_end - kt_begin;
  const float codebook_reg = __ldg(prm.codebook + (lane & ((1 << BITS) - 1)));
  const uint32_t lut_lane = lut_lane_offset<std::min(BITS, 4)>(lane);  // unused for k = 5

  const int tid = threadIdx.x;
  __builtin_assume(tid < kThreads);  // folds the chunk bounds below to compile time
  const int col = blockIdx.x / splits, y = blockIdx.y;
  // Grouped: CTA rows past the device-side chunk count hold no rows (a whole cluster shares its y).
  // With chunks_early the chunk is read from L2 (ld.cg: written by an earlier grid, never cached
  // here), and the wait comes after the weight prologue below.
  const bool weights_early = !kGrouped || prm.chunks_early;
  if constexpr (kGrouped) {
    if (!weights_early) {
      pdl_wait();               // the chunk (and so the expert's weights) comes from the routing kernel
      pdl_launch_dependents();  // the rest is this CTA's own pipeline: the next kernel may start its prologue
    }
    if (y >= __ldcg(prm.num_chunks)) return;  // writes nothing, so it may leave before the wait
  }
  // Rows [m0, m_end) of A and C, and the weight they multiply: the CTA row's block of 8P rows, or
  // its chunk's rows and expert.
  int m0 = y * 8 * P, m_end = prm.M;
  const uint8_t* qweight = prm.qweight;
  const uint8_t* absmax = prm.absmax;
  if constexpr (kGrouped) {
    const int4 chunk = __ldcg(prm.chunks + y);
    m0 = chunk.y;
    m_end = chunk.y + chunk.z;
    qweight += chunk.x * prm.expert_qbytes;
    absmax += chunk.x * prm.expert_abytes;
  }

  // Copy sources. A column's k-tiles lie back to back in the runtime layout (planes and scale codes
  // in two arrays), so every source advances by one tile per k-tile: in the loop a copy costs its
  // LDGSTS (the chunk's place in the tile is an immediate offset) and the sources one add each.
  // n-tiles past N keep pointing at the column's first tile and copy zeros, as do rows of A past
  // m_end and K past the end.
  const uint8_t* w_planes[R];  // this thread's first plane chunk of tile rho, at the next k-tile to copy
  const uint8_t* w_codes[R];   // this thread's first scale-code chunk (tid - kPlaneChunks, may be negative)
  bool w_valid[R];
#pragma unroll
  for (int rho = 0; rho < R; ++rho) {
    w_valid[rho] = col * R + rho < prm.n_tiles;
    const int64_t tile = static_cast<int64_t>(w_valid[rho] ? col * R + rho : col * R) * prm.k_tiles + kt_begin;
    w_planes[rho] = qweight + tile * kPlaneBytes + tid * 16;
    w_codes[rho] = absmax + tile * kCodeBytes + (tid - kPlaneChunks) * 16;
  }
  // Thread x copies activation chunk x % 16 of rows x / 16 + 8i, whose smem slot is the same for
  // every i (8i keeps the row parity).
  const int x_row = tid / kRowChunks, x_ch = tid % kRowChunks;
  const T* x_src = prm.A + static_cast<int64_t>(m0 + x_row) * prm.K + kt_begin * kTileK + x_ch * 8;
  const T* const x_any = prm.A;  // a mapped address for the copies that read nothing
  const int64_t x_row_step = 8 * static_cast<int64_t>(prm.K);
  int x_k = kt_begin * kTileK + x_ch * 8;  // K index of this thread's activation chunk
  uint8_t* const stages = smem + S::kLutBytes;
  const uint32_t smem_base = static_cast<uint32_t>(__cvta_generic_to_shared(stages));
  const uint32_t x_dst = smem_base + S::kWBytes + x_row * (kRowChunks * 16) + x_slot(x_ch, x_row) * 16;

  // Next stage <- the next k-tile: the CTA's R weight tiles verbatim (plane chunks, then scale-code
  // chunks), then its 8P activation rows. Loop bounds are compile-time, so each thread issues a
  // fixed list of copies; whether chunk c = tid + 128 it is a plane or a code chunk is known at
  // compile time except in one warp-uniform case (k = 3, 5: the boundary is a multiple of 64).
  const auto load_weights = [&](int stage) {
    const uint32_t st = smem_base + stage * S::kStageBytes;
#pragma unroll
    for (int rho = 0; rho < R; ++rho) {
#pragma unroll
      for (int it = 0; it < (kTileChunks + kThreads - 1) / kThreads; ++it) {
        const int c = tid + it * kThreads;  // 16-byte chunk of the tile
        if (c < kTileChunks) {
          const uint8_t* src = c < kPlaneChunks ? w_planes[rho] + it * kThreads * 16 : w_codes[rho] + it * kThreads * 16;
          cp_async16(st + rho * kTileBytes + c * 16, src, w_valid[rho]);
        }
      }
      w_planes[rho] += kPlaneBytes;
      w_codes[rho] += kCodeBytes;
    }
  };
  const auto load_activations = [&](int stage) {
    const bool k_valid = x_k < prm.K;
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const bool valid = k_valid && m0 + x_row + 8 * p < m_end;
      cp_async16(x_dst + stage * S::kStageBytes + p * 8 * (kRowChunks * 16), valid ? x_src + p * x_row_step : x_any, valid);
    }
    x_src += kTileK;
    x_k += kTileK;
  };
  const auto load_stage = [&](int stage) {
    load_weights(stage);
    load_activations(stage);
  };

  float acc[R][P][4];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int i = 0; i < P; ++i)
#pragma unroll
      for (int v = 0; v < 4; ++v) acc[r][i][v] = 0.f;

  // One k-tile from shared memory. First every row group's plane words become index words and its
  // two scale codes become scales (all bit work of the k-tile); then 8 MMA steps, each turning
  // index words into one A fragment per row group by lookups alone.
  // This lane's shared-memory reads, as offsets into a stage (the loop adds the stage's base only).
  // Weights: word t of row `row` (+8h, +16r) of plane b, and its scale code; row group R warp + r
  // lies in tile (R warp + r) / 4 at rows 16 ((R warp + r) % 4), i.e. 16r rows past the r = 0 one
  // (R divides 4). Activations: chunk 4t + c of row 8i + g sits in slot 4t + (c ^ x_swz) (x_slot
  // with ch = 4t + c: (ch >> 2) & 2 = t & 2, and the row parity is g's).
  const int rg0 = R * warp, row0 = 16 * (rg0 % 4) + g;
  const int w_rd = (rg0 / 4) * kTileBytes + (row0 * kTileKB + t) * 4;
  const int s_rd = (rg0 / 4) * kTileBytes + kPlaneBytes + row0 * kTileKB + t;
  const int x_rd = S::kWBytes + (g * kRowChunks + 4 * t) * 16, x_swz = (t & 2) ^ (g & 1);

  const auto compute_stage = [&](int stage) {
    const uint8_t* st = stages + stage * S::kStageBytes;
    constexpr int W = kLut ? Lut<std::min(BITS, 4)>::kWords : F;
    uint32_t q[R][2][W];
    uint32_t scale[R][2];  // the scale in both halves of x's 16-bit type (exact: 5 significant bits)
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // Word t of plane b of rows row + 8h: lanes read 32 distinct words of 8 rows x 4 blocks,
        // one per bank (row stride 4 words).
        uint32_t plane[BITS];
#pragma unroll
        for (int b = 0; b < BITS; ++b)
          plane[b] = *reinterpret_cast<const uint32_t*>(st + w_rd + ((b * kTileN + 16 * r + 8 * h) * kTileKB) * 4);
        if constexpr (kLut) {
          lut_indices<BITS>(plane, q[r][h]);
        } else {
          gather_indices<BITS>(plane, q[r][h]);
        }
        const float sc = decode_scale(st[s_rd + (16 * r + 8 * h) * kTileKB], 0);
        scale[r][h] = Elem<T>::pack(sc, sc);
      }
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      uint4 xb[P];  // activations 32t + 8c .. +7 of rows 8i + g: B fragments of MMA steps 2c, 2c + 1
      const uint8_t* xc = st + x_rd + ((c ^ x_swz) * 16);
#pragma unroll
      for (int i = 0; i < P; ++i) xb[i] = *reinterpret_cast<const uint4*>(xc + 8 * i * kRowChunks * 16);
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
        const int j = 2 * c + jj;
#pragma unroll
        for (int r = 0; r < R; ++r) {
          uint32_t a[4];
          if constexpr (kLut) {
            // MMA step (c, jj) takes the activation pairs (8c + 4jj, +1) and (8c + 4jj + 2, +3) of the
            // lane's block (xb .x/.y or .z/.w, as the shuffle path), so its weight pairs are byte c of
            // index words jj and jj + 2 (pairs) or the two halves of byte c of word jj (quads).
            constexpr int LB = std::min(BITS, 4);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              if constexpr (Lut<LB>::kQuad) {
                const uint2 v = *reinterpret_cast<const uint2*>(smem + lut_offset<LB>(q[r][h][jj], c, lut_lane));
                a[h] = Elem<T>::scale2(v.x, scale[r][h]);
                a[2 + h] = Elem<T>::scale2(v.y, scale[r][h]);
              } else {
                const uint32_t lo = *reinterpret_cast<const uint32_t*>(smem + lut_offset<LB>(q[r][h][jj], c, lut_lane));
                const uint32_t hi = *reinterpret_cast<const uint32_t*>(smem + lut_offset<LB>(q[r][h][jj + 2], c, lut_lane));
                a[h] = Elem<T>::scale2(lo, scale[r][h]);
                a[2 + h] = Elem<T>::scale2(hi, scale[r][h]);
              }
            }
          } else {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              // Codebook values rounded to x's type, then scaled in pairs (two roundings: within
              // one more unit roundoff of dequantize_runtime's single one, and half the instructions
              // of an fp32 multiply per weight).
              const auto pair = [&](int e) {
                return Elem<T>::scale2(
                    Elem<T>::pack(lookup<BITS>(codebook_reg, q[r][h], e), lookup<BITS>(codebook_reg, q[r][h], e + 1)),
                    scale[r][h]);
              };
              a[h] = pair(4 * j);
              a[2 + h] = pair(4 * j + 2);
            }
          }
#pragma unroll
          for (int i = 0; i < P; ++i) Elem<T>::mma(acc[r][i], a, jj ? xb[i].z : xb[i].x, jj ? xb[i].w : xb[i].y);
        }
      }
    }
  };

  // Multistage pipeline: k-tile it + kStages - 1 is copied while k-tile it is computed. The copy
  // into a stage is issued after the barrier that follows every warp's last read of it.
  if (!weights_early) {
#pragma unroll
    for (int s = 0; s < S::kStages - 1; ++s) {
      if (s < nkt) load_stage(s);
      cp_async_commit();
    }
  } else {
    // Dense, and grouped with chunks_early: the first stages' weight tiles are copied before the PDL
    // wait (weights are immutable), their activations after it. The weight copies join the first
    // commit group, so the loop's cp_async_wait for k-tile 0 also covers the weights of the stages
    // after it (issued together).
#pragma unroll
    for (int s = 0; s < S::kStages - 1; ++s) {
      if (s < nkt) load_weights(s);
    }
    if constexpr (kLut) lut_fill<T, BITS>(smem, prm.codebook, tid, kThreads);  // codebook only: before the wait too
    pdl_wait();               // A is the previous kernel's output, and C may be memory it still reads
    pdl_launch_dependents();  // the main loop is this CTA's own pipeline: the next kernel may start its prologue
#pragma unroll
    for (int s = 0; s < S::kStages - 1; ++s) {
      if (s < nkt) load_activations(s);
      cp_async_commit();
    }
  }
  // The table is written while the first stages are in flight; the loop's first barrier publishes it.
  if constexpr (kLut && kGrouped) {
    if (!weights_early) lut_fill<T, BITS>(smem, prm.codebook, tid, kThreads);
  }
  for (int it = 0; it < nkt; ++it) {
    cp_async_wait<S::kStages - 2>();
    __syncthreads();
    const int next = it + S::kStages - 1;
    if (next < nkt) load_stage(next % S::kStages);
    cp_async_commit();
    compute_stage(it % S::kStages);
  }
  cp_async_wait<0>();
  __syncthreads();  // the partial tile below reuses the stages

  const int n_base = col * kTileN * R;
  // Output of C fragment element v of (row group rg, n8 tile i) held by lane ln, plus bias.
  const auto store = [&](int rg, int i, int ln, const float (&v)[4]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int n = n_base + 16 * rg + ln / 4 + 8 * h;
      if (n >= prm.N) continue;
      const float b = prm.bias != nullptr ? Elem<T>::to_float(prm.bias[n]) : 0.f;
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int m = m0 + 8 * i + 2 * (ln % 4) + u;
        if (m < m_end) prm.C[static_cast<int64_t>(m) * prm.N + n] = Elem<T>::narrow(v[2 * h + u] + b);
      }
    }
  };
  if (splits == 1) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int i = 0; i < P; ++i) store(R * warp + r, i, lane, acc[r][i]);
    return;
  }
  // Split-K: every CTA of the cluster parks its partial tile in its own shared memory, then rank s
  // sums slice s of the tile over all ranks in rank order and writes it. The second cluster
  // barrier keeps every CTA's shared memory alive until all remote reads are done.
  cg::cluster_group cluster = cg::this_cluster();
  float4* part = reinterpret_cast<float4*>(stages);
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int i = 0; i < P; ++i)
      part[((warp * R + r) * P + i) * 32 + lane] = make_float4(acc[r][i][0], acc[r][i][1], acc[r][i][2], acc[r][i][3]);
  cluster.sync();
  constexpr int U = S::kPartialUnits;
  for (int u = split * U / splits + threadIdx.x; u < (split + 1) * U / splits; u += kThreads) {
    float4 sum = cluster.map_shared_rank(part, 0)[u];
    for (int s = 1; s < splits; ++s) {
      const float4 x = cluster.map_shared_rank(part, s)[u];
      sum.x += x.x, sum.y += x.y, sum.z += x.z, sum.w += x.w;
    }
    const float v[4] = {sum.x, sum.y, sum.z, sum.w};
    store(u / (32 * P), (u / 32) % P, u % 32, v);
  }
  cluster.sync();
}

// ----------------------------------------------------------------------------- launch

// One launch as planned (plan.h: linear_plan / moe_proj_plan): the launcher decides nothing.
struct MmaLaunch {
  const void* A;
  const void* qweight;
  const void* absmax;
  const float* codebook;
  const void* bias;
  void* C;
  int M, N, K, n_tiles, k_tiles;
  MmaConfig config;  // grouped: m_blocks = the chunk list's length
  int splits;
  int cols;           // the plan's CTA columns per split (validated against the launch's tile shape)
  bool pdl;           // the plan's programmatic dependent launch
  const int* chunks;  // grouped only (else nullptr): int32 [m_blocks, 4], see MmaParams
  const int* num_chunks;
  int64_t expert_qbytes, expert_abytes;
  bool chunks_early;  // grouped only: see MmaParams
  int device;
  cudaStream_t stream;
};

// The instance's facts on `device` (plan.h: MmaInstanceFacts), prepared and queried once per instance and
// device (the opt-in is per device): the shared-memory opt-in above 48 KB, how many CTAs an SM holds
// (0 = not prepared yet; preparing twice is harmless) and how many CTAs the GPU holds at once in clusters
// of each split count (dense instances, whose split rule counts waves).
template <typename T, int BITS, int P, int R, bool kGrouped>
MmaInstanceFacts instance_facts(int device) {
  using S = Shape<BITS, P, R>;
  const auto kernel = mma_kernel<T, BITS, P, R, kGrouped>;
  static std::atomic<int> prepared[kMaxDevices] = {};
  static std::atomic<int64_t> cluster_ctas[kMaxDevices][kMmaMaxSplits + 1] = {};
  KBIT_CHECK(device >= 0 && device < kMaxDevices, "kbit mma: device index ", device, " >= ", kMaxDevices);
  int ctas_per_sm = prepared[device].load(std::memory_order_acquire);
  if (ctas_per_sm == 0) {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, S::kSmemBytes));
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas_per_sm, kernel, kThreads, S::kSmemBytes));
    ctas_per_sm = std::max(ctas_per_sm, 1);
    if constexpr (!kGrouped) {
      for (int s = 1; s <= kMmaMaxSplits; ++s) {
        cluster_ctas[device][s].store(cluster_capacity(kernel, s, kThreads, S::kSmemBytes, s * 64), std::memory_order_relaxed);
      }
    }
    prepared[device].store(ctas_per_sm, std::memory_order_release);
  }
  MmaInstanceFacts f;
  f.ctas_per_sm = ctas_per_sm;
  for (int s = 1; s <= kMmaMaxSplits; ++s) f.cluster_ctas[s] = cluster_ctas[device][s].load(std::memory_order_relaxed);
  return f;
}

template <typename T, int BITS, int P, int R, bool kGrouped = false>
void launch_instance(const MmaLaunch& L) {
  using S = Shape<BITS, P, R>;
  const auto kernel = mma_kernel<T, BITS, P, R, kGrouped>;
  (void)instance_facts<T, BITS, P, R, kGrouped>(L.device);  // the opt-in (the planner usually made it already)
  const int cols = (L.n_tiles + R - 1) / R;
  const int splits = L.splits;
  KBIT_CHECK(splits >= 1 && splits <= std::min(kMmaMaxSplits, L.k_tiles), "kbit mma: splits=", splits,
              " outside 1..", std::min(kMmaMaxSplits, L.k_tiles));
  KBIT_CHECK(L.cols == cols, "kbit mma: the plan's ", L.cols, " CTA columns are not the ", cols, " of ", L.n_tiles,
             " n-tiles at r=", R);
  const dim3 grid(static_cast<unsigned>(cols * splits), static_cast<unsigned>(L.config.m_blocks));
  record_launch({kGrouped ? "mma_grouped" : "mma", P, R, grid.y, grid.x / splits, splits, 0, 0, L.pdl});
  const MmaParams<T> prm{static_cast<const T*>(L.A), static_cast<const uint8_t*>(L.qweight),
                         static_cast<const uint8_t*>(L.absmax), L.codebook, static_cast<const T*>(L.bias),
                         static_cast<T*>(L.C), L.M, L.N, L.K, L.n_tiles, L.k_tiles, splits,
                         reinterpret_cast<const int4*>(L.chunks), L.num_chunks, L.expert_qbytes, L.expert_abytes,
                         L.chunks_early};
  launch_kernel(kernel, grid, dim3(kThreads), S::kSmemBytes, L.stream, splits, L.pdl, prm);
}

// Launches the instance of the launch's (p, r) (KBIT_MMA_INSTANCES); kGrouped: the routed-expert kernels
// (bf16 activations: the MoE path gathers x to bf16).
template <typename T, int BITS, bool kGrouped>
void launch_bits(const MmaLaunch& L) {
  const int p = L.config.p, r = L.config.r;
#define KBIT_MMA_CASE(P_, R_) \
  if (p == P_ && r == R_) return launch_instance<T, BITS, P_, R_, kGrouped>(L);
  KBIT_MMA_INSTANCES(KBIT_MMA_CASE)
#undef KBIT_MMA_CASE
  KBIT_CHECK(false, "kbit mma: no kernel for p=", p, " r=", r);
}

// Entry point per k (mma_k2.cu .. mma_k5.cu, compiled in parallel), both activation dtypes; a launch
// with a chunk list goes to the grouped instances (the caller guarantees bf16).
template <int BITS>
void launch_mma_k(const MmaLaunch& L, bool bf16) {
  if (L.chunks != nullptr) return launch_bits<__nv_bfloat16, BITS, true>(L);
  if (bf16) return launch_bits<__nv_bfloat16, BITS, false>(L);
  return launch_bits<__half, BITS, false>(L);
}

// The facts of instance (p, r) of k = BITS (grouped: bf16 only, as launched), for the planner.
template <int BITS>
MmaInstanceFacts mma_facts_k(int p, int r, bool grouped, bool bf16, int device) {
#define KBIT_MMA_FACTS(P_, R_)                                                      \
  if (p == P_ && r == R_) {                                                          \
    if (grouped) return instance_facts<__nv_bfloat16, BITS, P_, R_, true>(device);   \
    if (bf16) return instance_facts<__nv_bfloat16, BITS, P_, R_, false>(device);     \
    return instance_facts<__half, BITS, P_, R_, false>(device);                      \
  }
  KBIT_MMA_INSTANCES(KBIT_MMA_FACTS)
#undef KBIT_MMA_FACTS
  KBIT_CHECK(false, "kbit mma: no kernel for p=", p, " r=", r);
  return {};
}

// CTAs an SM holds of instance (p, r) of k = BITS (Shape::kResident; compile time).
template <int BITS>
int mma_resident_k(int p, int r) {
#define KBIT_MMA_RESIDENT(P_, R_) \
  if (p == P_ && r == R_) return Shape<BITS, P_, R_>::kResident;
  KBIT_MMA_INSTANCES(KBIT_MMA_RESIDENT)
#undef KBIT_MMA_RESIDENT
  KBIT_CHECK(false, "kbit mma: no kernel for p=", p, " r=", r);
  return 0;
}

#define KBIT_MMA_EXTERN(BITS_)                                                                           \
  extern template void launch_mma_k<BITS_>(const MmaLaunch&, bool);                                      \
  extern template MmaInstanceFacts mma_facts_k<BITS_>(int, int, bool, bool, int);
KBIT_MMA_EXTERN(2)
KBIT_MMA_EXTERN(3)
KBIT_MMA_EXTERN(4)
KBIT_MMA_EXTERN(5)
#undef KBIT_MMA_EXTERN

}  // namespace mma_detail
}  // namespace kbit
