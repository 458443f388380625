// kbit::linear on CUDA: out[..., N] = x[..., K] @ dequant(W)^T (+ bias), W in the runtime layout.
//
// The planner (csrc/plan/plan.h: linear_plan) picks the path by M (rows of x) and the weight's size, and
// the kernel's tile shape and splits: GEMV (gemv.cu), fused dequant + MMA (mma.cu), fused dequant + wgmma
// (wgmma.cu, wgmma_ws.cu), dequantize + cuBLAS. This file launches the plan.
// Everything here is metadata work: no host sync, and every allocation's size follows from the
// shapes alone, so calls are capturable in CUDA graphs.
#include "plan.h"
#include "gemv.cuh"
#include "rotate.h"
#include "mma.cuh"
#include "wgmma.cuh"

#include <algorithm>
#include <cstdint>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include "check.h"
#include "checks.h"

namespace kbit {
namespace {

// The op's checks (checks.cpp) plus the CUDA-only ones: every tensor on x's GPU.
void check_inputs(const at::Tensor& x, const at::Tensor& q, const at::Tensor& a, const at::Tensor& cb, int64_t N,
                  int64_t K, const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& rot_signs,
                  int64_t rot_block) {
  check_linear(x, q, a, cb, N, K, bias, rot_signs, rot_block);
  check_cuda(x, "x");
  check_device(q, x, "runtime qweight", "x");
  check_device(a, x, "runtime absmax", "x");
  check_device(cb, x, "codebook", "x");
  if (bias.has_value()) check_device(*bias, x, "bias", "x");
}

at::Tensor dequantize_runtime(const at::Tensor& q, const at::Tensor& a, const at::Tensor& cb, int64_t N, int64_t K,
                              at::ScalarType dtype) {
  // Through the dispatcher: whichever CUDA kernel is registered for kbit::dequantize_runtime.
  static const auto op = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("kbit::dequantize_runtime", "")
                              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::SymInt,
                                                c10::SymInt, at::ScalarType)>();
  return op.call(q, a, cb, c10::SymInt(N), c10::SymInt(K), dtype);
}

// x as a contiguous, 16-byte aligned [M, K] matrix (the kernels read 16-byte vectors).
at::Tensor as_matrix(const at::Tensor& x, int64_t M, int64_t K) {
  at::Tensor A = x.reshape({M, K}).contiguous();
  if (reinterpret_cast<uintptr_t>(A.data_ptr()) % 16 != 0) A = A.clone();
  return A;
}

std::optional<at::Tensor> contiguous_bias(const std::optional<at::Tensor>& bias) {
  if (!bias.has_value()) return std::nullopt;
  return bias->contiguous();
}

// Runs `plan` for x [..., K] (M rows): one kernel, or dequantize + cuBLAS, after the input rotation where the
// plan has one (separate: x R into a scratch [M, K] of x's dtype, then the GEMM reads it). Returns [M, N] (x's
// shape with N last on the dequantize path). The caller holds the device guard.
at::Tensor launch_plan(const at::Tensor& x_in, const at::Tensor& qweight_rt, const at::Tensor& absmax_rt,
                       const at::Tensor& codebook, int64_t N, int64_t K, const std::optional<at::Tensor>& bias,
                       const LinearPlan& plan, const std::optional<at::Tensor>& rot_signs, int64_t rot_block) {
  at::Tensor x = x_in;
  if (plan.rotation == InputRotation::kSeparate) {
    KBIT_CHECK(rot_signs.has_value(), "kbit linear: the plan rotates the input but no rot_signs were given");
    at::Tensor x2 = x_in.reshape({-1, K});
    if (x2.stride(1) != 1) x2 = x2.contiguous();
    x = at::empty(x_in.sizes(), x_in.options().memory_format(at::MemoryFormat::Contiguous));
    at::Tensor out2 = x.view({-1, K});
    launch_rotate(x2, *rot_signs, rot_block, /*inverse=*/false, out2);
  }
  if (plan.path == LinearPath::kDequantCublas) {
    const at::Tensor W = dequantize_runtime(qweight_rt, absmax_rt, codebook, N, K, x.scalar_type());
    record_launch({"dequant_cublas", 0, 0, 0, 0, 1});
    return at::linear(x, W, bias);
  }
  const int64_t M = x.numel() / K;
  KBIT_CHECK(N <= INT32_MAX && K <= INT32_MAX && M <= INT32_MAX, "kbit linear: weight or x too large for int32 sizes");
  const at::Tensor A = as_matrix(x, M, K);
  at::Tensor C = at::empty({M, N}, x.options());
  if (plan.path == LinearPath::kGemv) {
    KBIT_CHECK(M <= kGemvMaxM, "kbit gemv: x has ", M, " rows; supported: 1..", kGemvMaxM);
    // A fused rotation: the GEMV multiplies x R as it loads x (the plan's rule: input_rotation).
    const bool fused = plan.rotation == InputRotation::kFused;
    KBIT_CHECK(!fused || rot_signs.has_value(), "kbit linear: the plan fuses a rotation but no rot_signs were given");
    launch_gemv(A, qweight_rt, absmax_rt, codebook, contiguous_bias(bias), N, K, C, plan,
                fused ? rot_signs->data_ptr<float>() : nullptr, fused ? rot_block : 0);
  } else if (plan.path == LinearPath::kMma) {
    launch_mma(A, qweight_rt, absmax_rt, codebook, contiguous_bias(bias), N, K, C, plan);
  } else {
    KBIT_CHECK(at::cuda::getCurrentDeviceProperties()->major == 9, "kbit ", linear_path_name(plan.path),
               ": needs a Hopper (sm_90) GPU");
    if (plan.path == LinearPath::kWgmma) {
      launch_wgmma(A, qweight_rt, absmax_rt, codebook, contiguous_bias(bias), N, K, C, plan);
    } else {
      launch_wgmma_ws(A, qweight_rt, absmax_rt, codebook, contiguous_bias(bias), N, K, C, plan);
    }
  }
  return C;
}

at::Tensor linear_cuda(const at::Tensor& x, const at::Tensor& qweight_rt, const at::Tensor& absmax_rt,
                       const at::Tensor& codebook, int64_t N, int64_t K, const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& rot_signs, int64_t rot_block) {
  check_inputs(x, qweight_rt, absmax_rt, codebook, N, K, bias, rot_signs, rot_block);
  const c10::DeviceGuard guard(x.device());
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  const int64_t M = x.numel() / K;
  if (M == 0) return at::empty(out_shape, x.options());

  const LinearPlan plan = linear_plan(M, N, K, x.scalar_type(), qweight_rt.size(2), device_facts(x.get_device()), {},
                                      rot_signs.has_value() ? rot_block : 0);
  const at::Tensor out = launch_plan(x, qweight_rt, absmax_rt, codebook, N, K, bias, plan, rot_signs, rot_block);
  return plan.path == LinearPath::kDequantCublas ? out : out.view(out_shape);
}

// x of a test op that forces one kernel, as the contiguous [M, K] matrix the kernels read: the
// dense op's checks, plus 16-bit x, at least one row and int32 sizes. The caller holds the device guard.
at::Tensor forced_kernel_input(const char* op, const at::Tensor& x, const at::Tensor& qweight_rt,
                               const at::Tensor& absmax_rt, const at::Tensor& codebook, int64_t N, int64_t K,
                               const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& rot_signs,
                               int64_t rot_block) {
  check_inputs(x, qweight_rt, absmax_rt, codebook, N, K, bias, rot_signs, rot_block);
  KBIT_CHECK(x.scalar_type() != at::kFloat, op, ": x must be bf16 or fp16");
  const int64_t M = x.numel() / K;
  KBIT_CHECK(M > 0 && M <= INT32_MAX && N <= INT32_MAX && K <= INT32_MAX, op,
              ": x has no rows or sizes exceed int32");
  return as_matrix(x, M, K);
}

// kbit::_linear_forced: the kernel of path id `path` (kbit::_linear_path_id; -1: the rules) with the
// planner's rules for what is not forced (row_groups / splits / producers 0), for tests, benchmarks and sweeps;
// kbit::linear is the entry point. x: 16-bit, at least one row (GEMV: at most kGemvMaxM).
at::Tensor linear_forced_cuda(const at::Tensor& x, const at::Tensor& qweight_rt, const at::Tensor& absmax_rt,
                              const at::Tensor& codebook, int64_t N, int64_t K, const std::optional<at::Tensor>& bias,
                              int64_t path, int64_t row_groups, int64_t splits, int64_t producers,
                              const std::optional<at::Tensor>& rot_signs, int64_t rot_block) {
  const c10::DeviceGuard guard(x.device());
  const at::Tensor A = forced_kernel_input("kbit _linear_forced", x, qweight_rt, absmax_rt, codebook, N, K, bias,
                                           rot_signs, rot_block);
  const LinearForced forced{path, row_groups, splits, producers};
  const LinearPlan plan = linear_plan(A.size(0), N, K, x.scalar_type(), qweight_rt.size(2),
                                      device_facts(x.get_device()), forced, rot_signs.has_value() ? rot_block : 0);
  KBIT_CHECK(plan.path != LinearPath::kGemv || A.size(0) <= kGemvMaxM, "kbit _linear_forced: x has ", A.size(0),
             " rows; the GEMV supports 1..", kGemvMaxM);
  return launch_plan(A, qweight_rt, absmax_rt, codebook, N, K, bias, plan, rot_signs, rot_block);
}

}  // namespace
}  // namespace kbit

// Schemas: vllm_kbit/ops.py (the forced-plan op is kbit::linear's with its extra arguments).
TORCH_LIBRARY_IMPL(kbit, CUDA, m) {
  m.impl("linear", &kbit::linear_cuda);
  m.impl("_linear_forced", &kbit::linear_forced_cuda);
}
