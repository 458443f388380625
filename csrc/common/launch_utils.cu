// The programmatic-dependent-launch switch (launch_utils.cuh): one place decides whether kbit's
// kernels launch as programmatic dependents, and `kbit::_pdl_enabled` lets Python ask.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/library.h>

#include "overrides.h"

namespace kbit {

bool pdl_enabled(int device) {
  // Programmatic dependent launch (griddepcontrol) exists from sm_90 on; VLLM_KBIT_PDL=0 turns it off.
  return overrides::pdl() && at::cuda::getDeviceProperties(device)->major >= 9;
}

}  // namespace kbit

TORCH_LIBRARY_FRAGMENT(kbit, m) {
  m.def("_pdl_enabled() -> bool", [] { return kbit::pdl_enabled(c10::cuda::current_device()); });
}
