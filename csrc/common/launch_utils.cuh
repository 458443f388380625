// Launch helpers shared by the launchers: persistent grid sizing, the k -> template dispatch, and the
// one launch path of the kernels that take part in programmatic dependent launch (PDL, Hopper).
//
// PDL. A kernel launched with cudaLaunchAttributeProgrammaticStreamSerialization may start while
// the previous kernel in the stream is still running (inside CUDA graphs too: capture turns the
// attribute into a programmatic edge). Such a kernel must call pdl_wait() before it reads any
// memory an earlier kernel wrote (activations, routing outputs) and before it writes any memory
// (the caching allocator may hand it a block an earlier kernel still reads); only reads of weights,
// scale codes and the codebook (immutable) and shared-memory setup may come first. pdl_wait()
// returns once the previous grid has completed and its writes are visible. pdl_launch_dependents()
// lets the next kernel start early; it is only a scheduling hint (visibility comes from the
// dependent's wait). Launched without the attribute (VLLM_KBIT_PDL=0, before sm_90), both are no-ops.
// Whether a launch carries the attribute is the plan's (csrc/plan/plan.h: pdl_rule); launch_kernel takes it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include "check.h"
#include "format_constants.h"

namespace kbit {

// Blocks for a grid-stride kernel: enough to cover `work_blocks`, at most what the device
// keeps resident at once (more would only queue behind the first wave).
template <typename Kernel>
inline int persistent_grid(Kernel kernel, int threads, int64_t work_blocks) {
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
  const int64_t resident = static_cast<int64_t>(std::max(per_sm, 1)) * at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return static_cast<int>(std::max<int64_t>(1, std::min(work_blocks, resident)));
}

// CTAs of `kernel` (`threads` threads, `smem_bytes` of dynamic shared memory each) the GPU holds at once in clusters
// of s along x, asked for a grid of `grid_ctas` CTAs (cudaOccupancyMaxActiveClusters); 0 if the driver cannot say.
template <typename Kernel>
int64_t cluster_capacity(Kernel kernel, int s, int threads, int smem_bytes, int grid_ctas) {
  cudaLaunchConfig_t config = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(s);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  config.gridDim = dim3(static_cast<unsigned>(grid_ctas), 1, 1);
  config.blockDim = dim3(static_cast<unsigned>(threads), 1, 1);
  config.dynamicSmemBytes = static_cast<size_t>(smem_bytes);
  config.attrs = attr;
  config.numAttrs = 1;
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess) {
    (void)cudaGetLastError();  // leaves no sticky error behind; the callers' rules fall back to what they know
    return 0;
  }
  return static_cast<int64_t>(clusters) * s;
}

// Waits for the previous grid in the stream (no-op when not launched as a dependent).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next grid in the stream launch once every CTA of this grid has called it or exited.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Launches kernel<<<grid, block, smem, stream>>>(args...) with cudaLaunchKernelEx: in thread-block
// clusters of `cluster_x` CTAs along x when cluster_x > 0, and as a programmatic dependent of the
// previous kernel when `pdl` (the plan's). Every kernel launched here calls pdl_wait() as described above.
template <typename... KernelArgs, typename... Args>
inline void launch_kernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          int cluster_x, bool pdl, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (cluster_x > 0) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = static_cast<unsigned>(cluster_x);
    attr[n].val.clusterDim.y = 1;
    attr[n].val.clusterDim.z = 1;
    ++n;
  }
  if (pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  config.attrs = attr;
  config.numAttrs = n;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

// Calls f(std::integral_constant<int, k>{}) for k in kMinBits..kMaxBits (one template instance per k);
// any other k raises. The ops check k before launching, so that error is only a safety net.
template <int K = kMinBits, typename F>
void with_bits(int64_t k, const char* what, F&& f) {
  if constexpr (K > kMaxBits) {
    KBIT_CHECK_VALUE(false, what, ": k=", k, " is not supported; supported: ", kMinBits, "..", kMaxBits);
  } else {
    if (k == K) return f(std::integral_constant<int, K>{});
    with_bits<K + 1>(k, what, std::forward<F>(f));
  }
}

}  // namespace kbit
