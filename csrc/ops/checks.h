// Argument checks of the torch.ops.kbit ops: every rule and its one-line message, stated once.
// Metadata only (dtypes, shapes, contiguity, devices among the tensors), device-agnostic, except the
// weight-value check at the end. Compiled into both extensions: the CUDA ops run them before any
// allocation or launch, and the CPU extension registers them as kbit::_check_<rule>
// (csrc/cpu/check_ops.cpp), which vllm_kbit/reference.py asks; tests/bad_input_cases.py holds the messages.
#pragma once

#include <optional>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/core/Scalar.h>

namespace kbit {

// k is an integer in kMinBits..kMaxBits; a Scalar, as Python's quantize(W, k) may get any number.
void check_bits(const c10::Scalar& k);
// A codebook for k bits: 1-D float32, 2^k entries, contiguous.
void check_codebook(const at::Tensor& codebook, int64_t k);

// One per op; each returns k (bits per weight).
int64_t check_quantize(const at::Tensor& W, const at::Tensor& codebook, int64_t k);
int64_t check_dequantize(const at::Tensor& qweight, const at::Tensor& absmax, const at::Tensor& codebook,
                         at::ScalarType dtype);
int64_t check_repack(const at::Tensor& qweight, const at::Tensor& absmax);
int64_t check_unrepack(const at::Tensor& qweight_rt, const at::Tensor& absmax_rt, int64_t N, int64_t K);
int64_t check_dequantize_runtime(const at::Tensor& qweight_rt, const at::Tensor& absmax_rt, const at::Tensor& codebook,
                                 int64_t N, int64_t K, at::ScalarType dtype);
// The rotation arguments (rot_signs, rot_block; fused_moe: one pair per projection) are optional: no signs and
// block 0 means the layer is not rotated (check_rotation).
int64_t check_linear(const at::Tensor& x, const at::Tensor& qweight_rt, const at::Tensor& absmax_rt,
                     const at::Tensor& codebook, int64_t N, int64_t K, const std::optional<at::Tensor>& bias,
                     const std::optional<at::Tensor>& rot_signs = std::nullopt, int64_t rot_block = 0);
int64_t check_fused_moe(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                        const at::Tensor& w13_qweight, const at::Tensor& w13_absmax, const at::Tensor& w2_qweight,
                        const at::Tensor& w2_absmax, const at::Tensor& codebook, int64_t I,
                        const std::optional<at::Tensor>& expert_map,
                        const std::optional<at::Tensor>& w13_rot_signs = std::nullopt, int64_t w13_rot_block = 0,
                        const std::optional<at::Tensor>& w2_rot_signs = std::nullopt, int64_t w2_rot_block = 0);
// A layer input rotation over K inputs (x R, docs/format.md section 9): either none (no signs, block 0) or
// float32 contiguous signs [K] on `device` and a power-of-two block in kRotationMinBlock..kRotationMaxBlock
// dividing K. `op` and `what` name the arguments in the message (e.g. "fused_moe", "w2_rot_"). Returns whether
// the layer is rotated.
bool check_rotation(const std::optional<at::Tensor>& signs, int64_t block, int64_t K, const c10::Device& device,
                    const char* op, const char* what);

// A weight's largest |w|: finite, and with bounded at most what the largest E4M4 scale holds (quantize
// at range scale 1; reference.range_scale asks only for finite).
void check_weight_amax(double amax, bool bounded);
// check_weight_amax(max |W|, true): one reduction and a host sync, a load-time check (the CUDA quantize op, and
// the reference's check_representable through kbit::_check_representable).
void check_representable(const at::Tensor& W);

// Pieces of the rules above, for the C++-only ops (csrc/ops/moe_ops.cpp): t is contiguous; a [N, K] weight has
// N > 0 and K a positive multiple of the block size.
void check_contiguous(const at::Tensor& t, const char* what);
void check_weight_shape(int64_t N, int64_t K);
// Stacked runtime weights of E experts (kbit::fused_moe's w13 / w2): <prefix>qweight is [E >= 1, ...] with 6 dims,
// returns its k; check_stacked: <prefix>qweight int32 [E, *runtime shape of [N, K] at k bits], <prefix>absmax uint8
// [E, *its runtime shape]. op and prefix name them in the message, note goes before "k=" in its parenthesis.
int64_t check_stacked_bits(const at::Tensor& qweight, const char* op, const char* prefix);
void check_stacked(const at::Tensor& qweight, const at::Tensor& absmax, int64_t E, int64_t N, int64_t K, int64_t k,
                   const char* op, const char* prefix, const std::string& note = "");

// For the CUDA implementations: t is a CUDA tensor; t is on ref's device.
void check_cuda(const at::Tensor& t, const char* what);
void check_device(const at::Tensor& t, const at::Tensor& ref, const char* what, const char* ref_what);
// The kernels index blocks of 32 with 32-bit integers.
void check_block_count(int64_t n_blocks);

}  // namespace kbit
