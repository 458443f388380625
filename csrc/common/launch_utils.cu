// The programmatic-dependent-launch switch (launch_utils.cuh): one place decides whether kbit's
// kernels launch as programmatic dependents, and `kbit::_pdl_enabled` lets Python ask.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/library.h>

#include <cstdlib>
#include <string>

#include "check.h"

namespace kbit {
namespace {

// KBIT_PDL from the environment, read once: unset or "1" = on (where the device allows), "0" = off.
bool pdl_env() {
  static const bool on = [] {
    const char* v = std::getenv("KBIT_PDL");
    const std::string s = v == nullptr ? "" : v;
    KBIT_CHECK(s.empty() || s == "0" || s == "1", "kbit: KBIT_PDL=", s,
                " is not supported; supported: 0 (no programmatic dependent launch) or 1 (default)");
    return s != "0";
  }();
  return on;
}

}  // namespace

bool pdl_enabled(int device) {
  // Programmatic dependent launch (griddepcontrol) exists from sm_90 on.
  return pdl_env() && at::cuda::getDeviceProperties(device)->major >= 9;
}

}  // namespace kbit

TORCH_LIBRARY_FRAGMENT(kbit, m) {
  m.def("_pdl_enabled() -> bool", [] { return kbit::pdl_enabled(c10::cuda::current_device()); });
}
