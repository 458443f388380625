// kbit::_hadamard_rotate_cuda: the CUDA kernel of kbit::hadamard_rotate. vllm_kbit/ops.py defines the schema
// and registers hadamard_rotate's CUDA implementation, which checks the arguments (reference.py,
// check_hadamard_rotate: the op's one set of rules) and then calls this; here only what the kernel adds.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include "check.h"
#include "checks.h"
#include "rotate.h"

namespace kbit {
namespace {

at::Tensor hadamard_rotate_cuda(const at::Tensor& x, const at::Tensor& signs, int64_t block, bool inverse) {
  check_cuda(x, "x");
  check_device(signs, x, "signs", "x");
  const int64_t K = x.size(-1);
  KBIT_CHECK_VALUE(K % 32 == 0, "kbit: hadamard_rotate: x has ", K, " columns; on CUDA they must be a multiple of 32 ",
                   "(every kbit layer's input is)");
  KBIT_CHECK_VALUE(block <= kRotateMaxBlock, "kbit: hadamard_rotate: block=", block, " is not supported on CUDA; ",
                   "supported: powers of two 2..", kRotateMaxBlock);
  const c10::DeviceGuard guard(x.device());
  // Rows at any stride; the kernel needs unit column stride (a transposed view is copied once).
  at::Tensor x2 = x.reshape({-1, K});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor out2 = out.view({-1, K});
  launch_rotate(x2, signs.contiguous(), block, inverse, out2);
  return out;
}

}  // namespace
}  // namespace kbit

TORCH_LIBRARY_IMPL(kbit, CUDA, m) { m.impl("_hadamard_rotate_cuda", &kbit::hadamard_rotate_cuda); }
