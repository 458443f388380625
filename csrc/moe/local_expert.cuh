// The local expert of a routed slot, shared by the routing kernel and the direct grouped GEMV.
#pragma once

namespace kbit {

// Local expert of a global id, -1 when it is on another rank or out of range.
__device__ __forceinline__ int local_expert(int id, const int* expert_map, int map_len, int E) {
  if (expert_map != nullptr) id = (id >= 0 && id < map_len) ? __ldg(expert_map + id) : -1;
  return (id >= 0 && id < E) ? id : -1;
}

}  // namespace kbit
