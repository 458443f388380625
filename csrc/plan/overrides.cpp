// The one place the extension reads its environment (overrides.h says what each variable does).
#include "overrides.h"

#include <cstdlib>

#include "check.h"

namespace kbit {
namespace overrides {
namespace {

std::string read(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? std::string() : std::string(v);
}

}  // namespace

bool pdl() {
  static const bool on = [] {
    const std::string s = read("VLLM_KBIT_PDL");
    KBIT_CHECK(s.empty() || s == "0" || s == "1", "kbit: VLLM_KBIT_PDL=", s,
               " is not supported; supported: 0 (no programmatic dependent launch) or 1 (default)");
    return s != "0";
  }();
  return on;
}

int64_t mma_max_m() {
  static const int64_t m = [] {
    const std::string s = read("VLLM_KBIT_MMA_MAX_M");
    return s.empty() ? int64_t{-1} : static_cast<int64_t>(std::atoll(s.c_str()));
  }();
  return m;
}

const std::string& moe_path() {
  static const std::string path = read("VLLM_KBIT_MOE_PATH");
  return path;
}

int64_t ws_producers() {
  static const int64_t n = [] {
    const std::string s = read("VLLM_KBIT_WS_PRODUCERS");
    KBIT_CHECK(s.empty() || s == "1" || s == "2", "kbit: VLLM_KBIT_WS_PRODUCERS=", s, " is not supported; supported: 1 or 2");
    return s == "1" ? int64_t{1} : int64_t{2};
  }();
  return n;
}

const std::string& gemv_decode() {
  static const std::string mode = [] {
    const std::string s = read("VLLM_KBIT_GEMV_DECODE");
    KBIT_CHECK(s.empty() || s == "shuffle" || s == "table" || s == "mixed", "kbit: VLLM_KBIT_GEMV_DECODE=", s,
               " is not supported; supported: shuffle, table or mixed");
    return s;
  }();
  return mode;
}

const std::string& moe_wgmma() {
  static const std::string kernel = [] {
    const std::string s = read("VLLM_KBIT_MOE_WGMMA");
    KBIT_CHECK(s.empty() || s == "ws" || s == "rs", "kbit: VLLM_KBIT_MOE_WGMMA=", s,
               " is not supported; supported: ws (warp-specialized) or rs (register operand)");
    return s;
  }();
  return kernel;
}

}  // namespace overrides
}  // namespace kbit
