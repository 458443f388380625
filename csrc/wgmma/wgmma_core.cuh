// Pieces shared by the fused dequant + wgmma kernels (wgmma.cu: weights in registers, wgmma_ws.cu:
// warp-specialized, weights through shared memory): the shared-memory matrix descriptor and swizzle,
// wgmma / async-proxy fences, the host-side shared-memory opt-in and dtype / k dispatch (16-bit pairs:
// dequant_core.cuh, cp.async: cp_async.cuh). Hopper (sm_90a) only.
#pragma once

#include "cp_async.cuh"
#include "dequant_core.cuh"
#include "kbit_format.cuh"

#include <atomic>
#include <cstdint>
#include <type_traits>

#include <c10/cuda/CUDAException.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "check.h"
#include "launch_utils.cuh"  // with_bits

namespace kbit {
namespace wgmma_core {

constexpr int kTileK = kTileKB * kBlockSize;       // 128 elements of K per runtime k-tile
constexpr int kPlaneBytes = kTileBlocks * 4;      // one bit plane of a runtime tile
constexpr int kCodeBytes = kTileBlocks;           // scale codes of a runtime tile
constexpr int kMaxDevices = 64;                    // devices whose launch preparation is tracked

// The 64 fp32 accumulators of one m64n128 wgmma, as asm operands %0..%63.
#define KBIT_WGMMA_D64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define KBIT_WGMMA_D64_OPERANDS(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// The same for the narrower wgmma N of the grouped register-operand kernel (wgmma.cu): N / 2 accumulators.
#define KBIT_WGMMA_D8 "{%0, %1, %2, %3, %4, %5, %6, %7}"
#define KBIT_WGMMA_D8_OPERANDS(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
#define KBIT_WGMMA_D16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define KBIT_WGMMA_D16_OPERANDS(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define KBIT_WGMMA_D24 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23}"
#define KBIT_WGMMA_D24_OPERANDS(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
#define KBIT_WGMMA_D32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define KBIT_WGMMA_D32_OPERANDS(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define KBIT_WGMMA_D48 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}"
#define KBIT_WGMMA_D48_OPERANDS(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])

// wgmma descriptor of a K-major operand in the 128-byte swizzle layout: start address, 1024 bytes
// between groups of 8 rows (8 rows x 128 bytes), swizzle mode 1 (128 B). The leading offset is
// unused by this layout. Start addresses of k16 steps inside a slab advance by 32 bytes: the
// hardware applies the swizzle to the full address, which is why slabs are 1024-byte aligned.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

// Byte offset of 16-byte chunk `chunk` (0..15: elements 8 chunk .. 8 chunk + 7 of a k-tile) of row
// `row` in a k-tile of `rows` rows stored as two 64-wide K slabs in that layout: the chunk's slot
// in its 128-byte row is XORed with the row's position in its group of 8.
__device__ __forceinline__ uint32_t swizzled_chunk(int rows, int row, int chunk) {
  return (chunk / 8) * rows * 128 + row * 128 + (((chunk % 8) ^ (row % 8)) * 16);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Waits until at most N of the warpgroup's committed wgmma groups are still running (groups complete in order).
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void wgmma_wait_all() { wgmma_wait<0>(); }
// Generic-proxy writes to shared memory (st.shared, cp.async) become visible to the async proxy
// that wgmma reads shared memory through.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Register operands of in-flight wgmmas must stay where they are until the wait: an empty asm that
// "rewrites" them after the wait keeps the compiler from reusing or reading them earlier.
__device__ __forceinline__ void pin(float& v) { asm volatile("" : "+f"(v)::"memory"); }
__device__ __forceinline__ void pin(uint32_t& v) { asm volatile("" : "+r"(v)::"memory"); }

// ----------------------------------------------------------------------------- host side

// The shared-memory opt-in above 48 KB, once per kernel instance and device (preparing twice is harmless).
template <auto kKernel>
void opt_in_shared_memory(int bytes, int device) {
  static std::atomic<bool> prepared[kMaxDevices] = {};
  KBIT_CHECK(device >= 0 && device < kMaxDevices, "kbit wgmma: device index ", device, " >= ", kMaxDevices);
  if (!prepared[device].load(std::memory_order_relaxed)) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    prepared[device].store(true, std::memory_order_relaxed);
  }
}

// Calls f(T{}, std::integral_constant<int, BITS>{}) for activations of 16-bit type `dtype` and k = bits.
template <typename F>
void dispatch_type_and_bits(at::ScalarType dtype, int64_t bits, const char* what, F&& f) {
  const auto with_type = [&](auto type) { with_bits(bits, what, [&](auto k) { f(type, k); }); };
  if (dtype == at::kBFloat16) return with_type(__nv_bfloat16{});
  KBIT_CHECK(dtype == at::kHalf, what, ": activations must be bf16 or fp16, got ", dtype);
  with_type(__half{});
}

}  // namespace wgmma_core
}  // namespace kbit
