// Grid sizing shared by the launchers: persistent grids of resident blocks.
#pragma once

#include <algorithm>
#include <cstdint>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

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

}  // namespace kbit
