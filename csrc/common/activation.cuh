// The MoE activation, one definition for every kernel that applies it (the grouped GEMV's down stage
// and the elementwise SiLU * up kernel).
#pragma once

namespace kbit {

// SiLU in fp32: g * sigmoid(g).
__device__ __forceinline__ float silu(float g) { return g / (1.f + __expf(-g)); }

}  // namespace kbit
