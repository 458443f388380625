// Input checks that raise a one-line Python exception (ValueError, TypeError, RuntimeError) without
// iostreams. TORCH_CHECK formats numbers and shapes through <ostream> templates that get instantiated
// inside this extension; with a g++ other than the one that built the process's libstdc++, and
// -Bsymbolic-functions (Debian/Ubuntu Python's link flags), those copies crash when a check fires,
// killing the process instead of raising. Here messages are built with std::string and
// std::to_string only, and the exception is constructed by libc10, so a failing check raises for
// any toolchain pip uses. Use KBIT_CHECK* everywhere in csrc/ (host code), never TORCH_CHECK.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

namespace kbit {
namespace msg {

// Python's name of a dtype ("torch.int64"), as the reference's messages print it.
inline const char* dtype_name(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return "torch.float32";
    case c10::ScalarType::Half: return "torch.float16";
    case c10::ScalarType::BFloat16: return "torch.bfloat16";
    case c10::ScalarType::Double: return "torch.float64";
    case c10::ScalarType::Byte: return "torch.uint8";
    case c10::ScalarType::Char: return "torch.int8";
    case c10::ScalarType::Short: return "torch.int16";
    case c10::ScalarType::Int: return "torch.int32";
    case c10::ScalarType::Long: return "torch.int64";
    case c10::ScalarType::Bool: return "torch.bool";
    default: return c10::toString(t);
  }
}

inline void append(std::string& s, const char* v) { s += v; }
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, bool v) { s += v ? "True" : "False"; }
template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>, int> = 0>
inline void append(std::string& s, T v) {
  s += std::to_string(v);
}
inline void append(std::string& s, c10::ScalarType t) { s += dtype_name(t); }
inline void append(std::string& s, const c10::Device& d) { s += d.str(); }
// Shapes as Python lists: [8, 2, 4].
inline void append(std::string& s, c10::IntArrayRef shape) {
  s += '[';
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  s += ']';
}
inline void append(std::string& s, const std::vector<int64_t>& shape) { append(s, c10::IntArrayRef(shape)); }

template <typename... Args>
std::string build(const Args&... args) {
  std::string s;
  (append(s, args), ...);
  return s;
}

template <typename E, typename... Args>
[[noreturn]] C10_NOINLINE void fail(const char* func, const char* file, uint32_t line, const Args&... args) {
  throw E(c10::SourceLocation{func, file, line}, build(args...));
}

}  // namespace msg
}  // namespace kbit

#define KBIT_CHECK_AS(error_t, cond, ...)                                                       \
  do {                                                                                         \
    if (C10_UNLIKELY(!(cond))) {                                                               \
      ::kbit::msg::fail<error_t>(__func__, __FILE__, static_cast<uint32_t>(__LINE__), __VA_ARGS__); \
    }                                                                                          \
  } while (0)

// ValueError (values, shapes, devices), TypeError (dtypes), RuntimeError (limits of the kernels).
#define KBIT_CHECK_VALUE(cond, ...) KBIT_CHECK_AS(::c10::ValueError, cond, __VA_ARGS__)
#define KBIT_CHECK_TYPE(cond, ...) KBIT_CHECK_AS(::c10::TypeError, cond, __VA_ARGS__)
#define KBIT_CHECK(cond, ...) KBIT_CHECK_AS(::c10::Error, cond, __VA_ARGS__)
