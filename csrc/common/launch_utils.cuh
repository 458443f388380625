// Shared by the launchers: persistent grids of resident blocks, and the k -> template dispatch.
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
