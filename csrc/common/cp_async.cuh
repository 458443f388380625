// cp.async wrappers shared by the MMA (mma_kernel.cuh) and wgmma (wgmma_core.cuh) kernels: 16-byte
// global -> shared copies that bypass L1 (every tile is read once per CTA), in commit groups.
#pragma once

#include <cstdint>

namespace kbit {

// Copies 16 bytes to a shared-window address; valid = false writes 16 zero bytes instead (padding rows
// of A, K past the end, n-tiles past N) and reads nothing, though gmem must still be a mapped address.
__device__ __forceinline__ void cp_async16(uint32_t smem_addr, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr), "l"(gmem), "r"(valid ? 16 : 0));
}
// No memory clobbers: the copied tiles are read after a barrier (which orders memory for the compiler)
// or only through wgmma (volatile asm, kept in order with these).
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
// Until at most N of this thread's commit groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

}  // namespace kbit
