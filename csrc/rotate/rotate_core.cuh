// The butterflies of the input rotation x · R, R = diag(s) · blockdiag(H_b / sqrt(b)) (vllm_kbit/reference.py,
// hadamard_rotate), shared by the standalone rotation kernel (rotate.cu) and the GEMV kernels that rotate their
// activations as they load them (gemv_core.cuh). Sylvester's H_b is one 2-point butterfly (a + c, a - c) per bit of
// the index within a block, in any order; running them from the lowest bit up, in fp32, gives the reference's sums
// in the reference's order: bit for bit the reference (the GEMV's blocks over 128 k-tiles sum their k-tiles first,
// so theirs agree within fp32 rounding).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include <cuda_runtime.h>

#include "check.h"
#include "plan.h"

namespace kbit {
namespace rotate_core {

// Butterflies over the bits of a register index i: pairs (i, i + h) within one lane.
template <int E>
__device__ __forceinline__ void butterfly_registers(float (&v)[E]) {
#pragma unroll
  for (int h = 1; h < E; h <<= 1) {
#pragma unroll
    for (int i = 0; i < E; ++i) {
      if ((i & h) == 0) {
        const float a = v[i], c = v[i + h];
        v[i] = a + c;
        v[i + h] = a - c;
      }
    }
  }
}

// Butterflies over the lane bits below `lanes` (a power of two <= kMaxLanes <= 32; a compile-time constant where the
// caller knows it, else warp-uniform): the lane with the bit clear keeps a + c, its partner a - c (each sees the
// other's value through the shuffle, so the upper lane computes partner - own).
template <int E, int kMaxLanes>
__device__ __forceinline__ void butterfly_lanes(float (&v)[E], int lane, int lanes = kMaxLanes) {
#pragma unroll
  for (int m = 1; m < kMaxLanes; m <<= 1) {
    if (m >= lanes) break;
    const bool upper = lane & m;
#pragma unroll
    for (int i = 0; i < E; ++i) {
      const float o = __shfl_xor_sync(0xffffffffu, v[i], m);
      v[i] = upper ? o - v[i] : v[i] + o;
    }
  }
}

// The blocks the GEMV kernels rotate as they load activations (gemv_core.cuh, accumulate): a warp holds one k-tile
// row of 128 elements, 4 per lane, so blocks of 4..128 lie inside it (2 register butterflies, then shuffles over
// b/4 lanes); larger blocks span P = b / 128 k-tiles, which the warp first mixes elementwise (H_b = H_P ⊗ H_128:
// the k-tile part is a ±1 sum of the P k-tiles of the block, the in-tile part one H_128) at the cost of P - 1 extra
// activation loads per k-tile. b = 2 would need a butterfly inside a register pair: not fused.
// The range is the planner's (plan.h: kFusedRotationMinBlock, kFusedRotationMaxBlock, fused_rotation_block).
constexpr int kFusedTileElems = 128;                                             // a GEMV k-tile row
constexpr int kFusedMaxTiles = kFusedRotationMaxBlock / kFusedTileElems;         // k-tiles one block spans at most
static_assert(kFusedRotationMinBlock >= 4 && kFusedTileElems % kFusedRotationMinBlock == 0,
              "a fused block covers whole lanes of 4 elements");

// What a rotating GEMV needs: the signs (float32 over K, 16-byte aligned), the block b, the k-tiles it spans
// (max(1, b / 128)), and scale = 1 / sqrt(b) in float32 (the reference's multiply by Python's 1.0 / math.sqrt(b)).
struct FusedRotation {
  const float* signs;
  int block;
  int tiles;
  float scale;
};

// The launchers' FusedRotation for signs (float32 [K] on the device; null: no rotation) and block: refuses what the
// fused instances do not do (the planner decides which calls fuse; this guards the launch).
inline FusedRotation fused_rotation(const char* op, const float* signs, int64_t block, int64_t K) {
  if (signs == nullptr) return {nullptr, 0, 1, 1.f};
  KBIT_CHECK_VALUE(fused_rotation_block(block) && K % block == 0, op, ": a fused rotation needs a power-of-two block ",
                   kFusedRotationMinBlock, "..", kFusedRotationMaxBlock, " dividing K=", K, "; got block=", block);
  KBIT_CHECK_VALUE(reinterpret_cast<uintptr_t>(signs) % 16 == 0, op, ": the rotation signs must be 16-byte aligned");
  const int tiles = block > kFusedTileElems ? static_cast<int>(block / kFusedTileElems) : 1;
  return {signs, static_cast<int>(block), tiles, static_cast<float>(1.0 / std::sqrt(static_cast<double>(block)))};
}

// Which rotation a GEMV instance fuses (its ROT template argument): none, blocks inside one k-tile (b <= 128: the
// in-tile transform alone), or any block (kRotMix: the k-tile mix first where the block spans k-tiles). The two
// rotated kinds are separate instances so that the in-tile kernels' k-tile loop carries none of the mix's code,
// which, unrolled over up to 8 k-tiles, made the rotated one-row routed GEMV's code 1.8x the unrotated one's.
constexpr int kRotNone = 0, kRotTile = 1, kRotMix = 2;
inline int fused_rot_kind(const FusedRotation& r) { return r.signs == nullptr ? kRotNone : r.tiles > 1 ? kRotMix : kRotTile; }

// Calls f(std::integral_constant<int, kind>{}) with the launch's rotation kind: the launchers' one dispatch rule.
template <typename F>
void with_rot_kind(const FusedRotation& r, F&& f) {
  switch (fused_rot_kind(r)) {
    case kRotTile: return f(std::integral_constant<int, kRotTile>{});
    case kRotMix: return f(std::integral_constant<int, kRotMix>{});
    default: return f(std::integral_constant<int, kRotNone>{});
  }
}

// Elementwise product (activations times their ±1 signs: exact).
__device__ __forceinline__ float4 mul4(float4 a, float4 b) {
  return make_float4(a.x * b.x, a.y * b.y, a.z * b.z, a.w * b.w);
}

// The in-tile part of x · R on one k-tile row as the GEMV kernels hold it: lane l has elements 4l .. 4l+3 of 128
// (v: fp32, signs applied, and for b > 128 already mixed across the block's k-tiles). Index bits 0-1 are the
// lane's registers, bits 2 .. 6 its lane bits 0 .. 4: 2 register butterflies and log2(min(b, 128)) - 2 shuffle
// rounds of 4 values, then the scale. For b <= 128 the sums are the reference's, in its order (bit for bit).
// Every lane of the warp must call it (shuffles).
__device__ __forceinline__ float4 hadamard_tile_quad(float4 x, int lane, int block, float scale) {
  float v[4] = {x.x, x.y, x.z, x.w};
  butterfly_registers(v);
  butterfly_lanes<4, kFusedTileElems / 4>(v, lane, (block < kFusedTileElems ? block : kFusedTileElems) / 4);
  return make_float4(v[0] * scale, v[1] * scale, v[2] * scale, v[3] * scale);
}

}  // namespace rotate_core
}  // namespace kbit
