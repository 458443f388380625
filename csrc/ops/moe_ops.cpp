// Routed experts on CUDA: kbit::_fused_moe_cuda (what vllm_kbit.moe registers as the CUDA
// kbit::fused_moe for 16-bit activations) and the routing / grouped-GEMV pieces as ops for
// tests and benchmarks. Plain C++ (like linear.cpp): input checks, allocations, launchers.
//
// Four paths, picked from shapes alone (no host sync, every allocation sized by T * top_k or E):
//   GEMV direct  grouped GEMV gate_up, one CTA row per slot (its expert read from topk_ids, x's row
//                read in place) -> grouped GEMV down (SiLU * up while staging) whose last CTA per
//                token and n-tile does the combine. Two launches; auto at few slots (slots that share
//                an expert read it again).
//   GEMV         route -> grouped GEMV gate_up (gathers x rows) -> grouped GEMV down (SiLU * up
//                while staging, fp32 out) -> combine. Reads each expert once per 4 rows; only when forced.
//   grouped MMA  route (chunks of 8p rows) -> gather x (bf16) -> grouped dequant + MMA gate_up ->
//                SiLU * up -> grouped dequant + MMA down -> combine. Reads only the experts that
//                got tokens, each weight tile once per chunk of up to 64 rows (the GEMV: per 4).
//   grouped mm   route -> gather x (bf16) -> dequantize all experts to bf16 -> torch._grouped_mm ->
//                SiLU * up -> dequantize -> torch._grouped_mm -> combine.
//   grouped wgmma  (Hopper) as grouped MMA, with chunks of up to 256 rows and the warp-specialized
//                dequant + wgmma kernel (wgmma_ws.cu): each weight tile dequantized once per chunk into
//                shared memory, wgmma at full rate. Many rows per expert (prefill-sized batches).
// The planner's moe_plan (csrc/plan/plan.h) picks the path, sizes the routing and plans each projection's
// kernel; this file launches the plan. The grouped paths (MMA, mm, wgmma) run fp16 inputs in bf16.
// Rotated experts (the plan's projections' rotation "separate"): x R_13 into a scratch once before gate_up (every
// path), and the SiLU-and-mul output rotated in place before down (the grouped paths, the only ones the planner
// gives a rotated down input).
#include "checks.h"
#include "plan.h"
#include "mma.cuh"
#include "moe.cuh"
#include "rotate.h"
#include "wgmma.cuh"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include "check.h"
#include "format_constants.h"

namespace kbit {
namespace {

struct Routing {
  at::Tensor offsets, pos, slot_of, chunks, num_chunks;
};

Routing route(const at::Tensor& ids, const std::optional<at::Tensor>& expert_map, int64_t E, int64_t chunk_rows,
              int64_t max_chunks, bool pdl) {
  const auto i32 = ids.options().dtype(at::kInt);
  const int64_t S = ids.numel();
  Routing r{at::empty({E + 1}, i32), at::empty({S}, i32), at::empty({S}, i32), at::empty({max_chunks, 4}, i32),
            at::empty({1}, i32)};
  launch_moe_route(ids, expert_map, E, chunk_rows, r.offsets, r.pos, r.slot_of, r.chunks, r.num_chunks, pdl);
  return r;
}

std::optional<at::Tensor> int32_map(const std::optional<at::Tensor>& expert_map, const at::Tensor& x) {
  if (!expert_map.has_value()) return std::nullopt;
  KBIT_CHECK(expert_map->dim() == 1 && !at::isFloatingType(expert_map->scalar_type()) &&
                  expert_map->device() == x.device(),
              "kbit fused_moe: expert_map must be a 1-D integer tensor on ", x.device(), ", got ",
              expert_map->scalar_type(), " ", expert_map->sizes(), " on ", expert_map->device());
  return expert_map->to(at::kInt).contiguous();
}

// All E experts of a stacked runtime weight as bf16 [E, N, K]: the stack is the runtime layout
// of one [E * n_tiles * 64, K] weight, so one dequantize launch covers it.
at::Tensor dequantize_stacked(const at::Tensor& q, const at::Tensor& a, const at::Tensor& codebook, int64_t N,
                              int64_t K) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("kbit::dequantize_runtime", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::SymInt,
                                               c10::SymInt, at::ScalarType)>();
  const int64_t E = q.size(0), rows = q.size(0) * q.size(1);
  const at::Tensor W = op.call(q.view({rows, q.size(2), q.size(3), kTileN, kTileKB}), a.view({rows, a.size(2), kTileN, kTileKB}),
                               codebook, c10::SymInt(rows * kTileN), c10::SymInt(K), at::kBFloat16);
  return W.view({E, q.size(1) * kTileN, K}).narrow(1, 0, N);
}

// fused_moe's argument rules, then what the CUDA kernels need beyond them: a CUDA x, at most kMaxLocalExperts experts
// (what they index) and contiguous weights. Returns k. `op` names the caller in the messages.
int64_t check_cuda_moe(const char* op, const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                       const at::Tensor& w13_qweight, const at::Tensor& w13_absmax, const at::Tensor& w2_qweight,
                       const at::Tensor& w2_absmax, const at::Tensor& codebook, int64_t I,
                       const std::optional<at::Tensor>& expert_map, const std::optional<at::Tensor>& w13_rot_signs,
                       int64_t w13_rot_block, const std::optional<at::Tensor>& w2_rot_signs, int64_t w2_rot_block) {
  const int64_t k = check_fused_moe(x, topk_ids, topk_weights, w13_qweight, w13_absmax, w2_qweight, w2_absmax, codebook,
                                    I, expert_map, w13_rot_signs, w13_rot_block, w2_rot_signs, w2_rot_block);
  check_cuda(x, "x");
  KBIT_CHECK_VALUE(w13_qweight.size(0) <= kMaxLocalExperts, "kbit ", op, ": w13_qweight must be [E, ...] with 1 <= E <= ",
                   kMaxLocalExperts, " local experts, got ", w13_qweight.sizes());
  for (const at::Tensor* t : {&w13_qweight, &w13_absmax, &w2_qweight, &w2_absmax, &codebook}) {
    KBIT_CHECK(t->is_contiguous(), "kbit ", op, ": the weight tensors and the codebook must be contiguous");
  }
  return k;
}

// One grouped projection over routed bf16 rows by the plan's grouped kernel (MMA, or Hopper's register-operand /
// warp-specialized wgmma). chunks_early: the routing ran before the gather, so the grouped MMA may prefetch weights.
void launch_grouped(MoeKernel kernel, const at::Tensor& A, const at::Tensor& chunks, const at::Tensor& num_chunks,
                    const at::Tensor& q, const at::Tensor& a, const at::Tensor& codebook, int64_t N, int64_t K,
                    int64_t chunk_rows, at::Tensor& C, const MoeProjPlan& proj) {
  if (kernel == MoeKernel::kWgmmaRsGrouped) {
    launch_wgmma_rs_grouped(A, chunks, q, a, codebook, N, K, C, proj);
  } else if (kernel == MoeKernel::kWgmmaWsGrouped) {
    launch_wgmma_ws_grouped(A, chunks, q, a, codebook, N, K, C, proj);
  } else {
    KBIT_CHECK(kernel == MoeKernel::kMmaGrouped, "kbit fused_moe: the plan's kernel ", moe_kernel_name(kernel),
               " is not a grouped MMA or wgmma");
    launch_mma_grouped(A, chunks, num_chunks, q, a, codebook, N, K, chunk_rows, C, proj, /*chunks_early=*/true);
  }
}

at::Tensor fused_moe_cuda(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                          const at::Tensor& w13_qweight, const at::Tensor& w13_absmax, const at::Tensor& w2_qweight,
                          const at::Tensor& w2_absmax, const at::Tensor& codebook, int64_t I,
                          const std::optional<at::Tensor>& expert_map, bool on_input, int64_t path_id,
                          int64_t gate_up_splits, int64_t down_splits, int64_t gate_up_row_groups,
                          int64_t down_row_groups, int64_t producers, const std::optional<at::Tensor>& w13_rot_signs,
                          int64_t w13_rot_block, const std::optional<at::Tensor>& w2_rot_signs, int64_t w2_rot_block) {
  // The op's rules and the kernels' (CUDA, contiguous weights, E they index); the plan's path: 16-bit activations.
  const int64_t k = check_cuda_moe("fused_moe", x, topk_ids, topk_weights, w13_qweight, w13_absmax, w2_qweight,
                                   w2_absmax, codebook, I, expert_map, w13_rot_signs, w13_rot_block, w2_rot_signs,
                                   w2_rot_block);
  const int64_t T = x.size(0), H = x.size(1), E = w13_qweight.size(0), top_k = topk_ids.size(1);
  const c10::DeviceGuard guard(x.device());
  const DeviceFacts facts = device_facts(x.get_device());
  const MoeForced forced{moe_path_from_id(path_id), gate_up_splits, down_splits, gate_up_row_groups, down_row_groups,
                         producers};
  const MoePlan plan = moe_plan(T, top_k, E, k, forced, H, I, facts, x.scalar_type(),
                                w13_rot_signs.has_value() ? w13_rot_block : 0, w2_rot_signs.has_value() ? w2_rot_block : 0);
  KBIT_CHECK_TYPE(plan.path != MoePath::kReference, "kbit fused_moe: x has dtype ", x.scalar_type(),
             "; the CUDA kernels support bfloat16 and float16");
  at::Tensor out = at::empty({T, H}, x.options());
  if (T == 0 || top_k == 0) return out.zero_();

  at::Tensor xc = x.contiguous();
  if (plan.gate_up.rotation == InputRotation::kSeparate) {  // x R_13, once for every expert's gate_up
    at::Tensor xr = at::empty({T, H}, x.options());
    launch_rotate(xc, *w13_rot_signs, w13_rot_block, /*inverse=*/false, xr);
    xc = xr;
  } else if (reinterpret_cast<uintptr_t>(xc.data_ptr()) % 16 != 0) {
    xc = xc.clone();  // 8- and 16-byte vector loads
  }
  // The down projection's input (the SiLU-and-mul output h [S, I]) rotated in place: each warp of the rotation
  // reads its whole unit before it writes it.
  const auto rotate_down_input = [&](at::Tensor& h) {
    if (plan.down.rotation == InputRotation::kSeparate) launch_rotate(h, *w2_rot_signs, w2_rot_block, false, h);
  };
  const at::Tensor ids = topk_ids.to(at::kInt).contiguous().view({-1});
  const at::Tensor weights = topk_weights.to(at::kFloat).contiguous().view({-1});
  const std::optional<at::Tensor> map = int32_map(expert_map, x);
  const int64_t S = ids.numel();
  const std::optional<at::Tensor> input_weights = on_input ? std::optional<at::Tensor>(weights) : std::nullopt;
  const std::optional<at::Tensor> output_weights = on_input ? std::nullopt : std::optional<at::Tensor>(weights);
  const int64_t rows = plan.chunk_rows, max_chunks = plan.max_chunks;

  KBIT_CHECK(plan.down.rotation != InputRotation::kSeparate ||
                 (plan.path != MoePath::kGemvDirect && plan.path != MoePath::kGemv),
             "kbit fused_moe: the plan rotates the down input separately on a GEMV path");
  // Fused rotations (the GEMV paths): the signs and block go to the projection's launch, which rotates each row of
  // its input in its activation load (gate_up: x; down: silu(gate) * up).
  const float* signs13 = plan.gate_up.rotation == InputRotation::kFused ? w13_rot_signs->data_ptr<float>() : nullptr;
  const float* signs2 = plan.down.rotation == InputRotation::kFused ? w2_rot_signs->data_ptr<float>() : nullptr;
  const int64_t block13 = signs13 != nullptr ? w13_rot_block : 0, block2 = signs2 != nullptr ? w2_rot_block : 0;
  if (plan.path == MoePath::kGemvDirect) {
    at::Tensor h13 = at::empty({S, 2 * I}, x.options());
    at::Tensor arrivals = at::empty({T, w2_qweight.size(1)}, ids.options());  // zeroed by the gate_up launch
    launch_moe_gemv_direct(MoeStage::kGather, xc, ids, map, input_weights, top_k, w13_qweight, w13_absmax, codebook,
                           2 * I, H, h13, arrivals, plan.gate_up, nullptr, signs13, block13);
    at::Tensor y = at::empty({S, H}, x.options().dtype(at::kFloat));
    launch_moe_gemv_direct(MoeStage::kSiluMul, h13, ids, map, output_weights, top_k, w2_qweight, w2_absmax, codebook,
                           H, I, y, arrivals, plan.down, &out, signs2, block2);
    return out;
  }
  if (plan.path == MoePath::kGemv) {
    const Routing r = route(ids, map, E, rows, max_chunks, plan.pdl);
    at::Tensor h13 = at::empty({S, 2 * I}, x.options());
    launch_moe_gemv(MoeStage::kGather, xc, r.slot_of, input_weights, top_k, r.chunks, r.num_chunks, w13_qweight,
                    w13_absmax, codebook, 2 * I, H, rows, h13, plan.gate_up, signs13, block13);
    at::Tensor y = at::empty({S, H}, x.options().dtype(at::kFloat));
    launch_moe_gemv(MoeStage::kSiluMul, h13, std::nullopt, std::nullopt, top_k, r.chunks, r.num_chunks, w2_qweight,
                    w2_absmax, codebook, H, I, rows, y, plan.down, signs2, block2);
    launch_moe_combine(y, r.pos, output_weights, top_k, out, plan.pdl);
    return out;
  }
  if (plan.path == MoePath::kGroupedMma || plan.path == MoePath::kGroupedWgmma) {
    const bool wgmma = plan.path == MoePath::kGroupedWgmma;
    KBIT_CHECK_VALUE(!wgmma || facts.sm_major == 9, "kbit fused_moe: path grouped_wgmma needs a Hopper GPU (sm_90), ",
                     "this one is sm_", facts.sm_major, "x; supported there: auto, gemv, grouped_mm, grouped_mma, gemv_direct");
    KBIT_CHECK(max_chunks <= kMmaMaxGridRows, "kbit fused_moe: ", S, " slots need up to ", max_chunks,
                " chunks of ", rows, " rows; the grouped ", wgmma ? "wgmma" : "MMA", " launches at most ", kMmaMaxGridRows);
    const Routing r = route(ids, map, E, rows, max_chunks, plan.pdl);
    at::Tensor xp = at::empty({S, H}, x.options().dtype(at::kBFloat16));
    launch_moe_gather(xc, r.slot_of, input_weights, top_k, xp, plan.pdl);
    // One projection over the routing's chunks by the plan's kernel. The routing ran before the gather (and
    // before gate_up for down): the grouped MMA prefetches weights early.
    const auto project = [&](const at::Tensor& A, const at::Tensor& q, const at::Tensor& a, int64_t N, int64_t K,
                             at::Tensor& C, const MoeProjPlan& proj) {
      launch_grouped(plan.kernel, A, r.chunks, r.num_chunks, q, a, codebook, N, K, rows, C, proj);
    };
    at::Tensor g = at::empty({S, 2 * I}, xp.options());
    project(xp, w13_qweight, w13_absmax, 2 * I, H, g, plan.gate_up);
    at::Tensor h = at::empty({S, I}, xp.options());
    launch_moe_silu_mul(g, h, plan.pdl);  // rows past the chunks are garbage in g and h and never read again
    rotate_down_input(h);
    at::Tensor y = at::empty({S, H}, xp.options());
    project(h, w2_qweight, w2_absmax, H, I, y, plan.down);
    launch_moe_combine(y, r.pos, output_weights, top_k, out, plan.pdl);
    return out;
  }
  const Routing r = route(ids, map, E, rows, max_chunks, plan.pdl);
  const at::Tensor offs = r.offsets.narrow(0, 1, E);  // end row of each expert's group
  at::Tensor xp = at::empty({S, H}, x.options().dtype(at::kBFloat16));
  launch_moe_gather(xc, r.slot_of, input_weights, top_k, xp, plan.pdl);
  const at::Tensor g = at::_grouped_mm(xp, dequantize_stacked(w13_qweight, w13_absmax, codebook, 2 * I, H).transpose(1, 2), offs);
  at::Tensor h = at::empty({S, I}, xp.options());
  launch_moe_silu_mul(g, h, plan.pdl);
  rotate_down_input(h);
  const at::Tensor y = at::_grouped_mm(h, dequantize_stacked(w2_qweight, w2_absmax, codebook, H, I).transpose(1, 2), offs);
  record_launch({moe_kernel_name(plan.kernel)});
  launch_moe_combine(y, r.pos, output_weights, top_k, out, plan.pdl);
  return out;
}

// ----------------------------------------------------------------------------- stage by stage
// The routed experts in two ops, for callers that add to the intermediate results between them (vLLM's LoRA on
// experts, through vllm_kbit.moe.fused_moe_stages): _moe_stage_gate_up returns each slot's gate_up output h13
// [S, 2I] and _moe_stage_down, given h13 (as the caller left it), returns the SiLU-and-mul output act [S, I] and
// each slot's down output times its router weight y [S, H]. All in slot order (s = t * top_k + j) and x's dtype;
// slots whose expert is not local hold zeros. The plan is fused_moe's for the same shapes: on the direct GEMV path
// each CTA row reads its slot's row in place and writes its slot's row (no routing, no copies); the routed paths
// (a forced GEMV, grouped MMA / wgmma; grouped mm runs as grouped MMA) route, gather (grouped kernels: bf16 rows),
// project, and scatter the routed rows back to slot order with the combine kernel at top_k = 1 (times the router
// weights for down). Rotations as the plan says: fused into the GEMV's activation load, else a separate pass into
// a scratch (act itself stays unrotated: the caller's adapters read it).

struct StageSetup {
  MoePlan plan;
  at::Tensor ids, weights;  // int32 [S], fp32 [S]
  std::optional<at::Tensor> map, input_weights, output_weights;
  int64_t T, H, E, top_k, S;
};

StageSetup stage_setup(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                       const at::Tensor& w13_qweight, const at::Tensor& w13_absmax, const at::Tensor& w2_qweight,
                       const at::Tensor& w2_absmax, const at::Tensor& codebook, int64_t I,
                       const std::optional<at::Tensor>& expert_map, bool on_input, int64_t path_id,
                       const std::optional<at::Tensor>& w13_rot_signs, int64_t w13_rot_block,
                       const std::optional<at::Tensor>& w2_rot_signs, int64_t w2_rot_block) {
  const int64_t k = check_cuda_moe("moe stages", x, topk_ids, topk_weights, w13_qweight, w13_absmax, w2_qweight,
                                   w2_absmax, codebook, I, expert_map, w13_rot_signs, w13_rot_block, w2_rot_signs,
                                   w2_rot_block);
  const int64_t T = x.size(0), H = x.size(1), E = w13_qweight.size(0), top_k = topk_ids.size(1);
  const DeviceFacts facts = device_facts(x.get_device());
  const int64_t b13 = w13_rot_signs.has_value() ? w13_rot_block : 0, b2 = w2_rot_signs.has_value() ? w2_rot_block : 0;
  MoeForced forced{moe_path_from_id(path_id)};
  MoePlan plan = moe_plan(T, top_k, E, k, forced, H, I, facts, x.scalar_type(), b13, b2);
  KBIT_CHECK_TYPE(plan.path != MoePath::kReference, "kbit moe stages: x has dtype ", x.scalar_type(),
                  "; the CUDA kernels support bfloat16 and float16");
  if (plan.path == MoePath::kGroupedMm) {  // no chunk list to scatter by: the grouped MMA over the same routing
    forced.path = MoePath::kGroupedMma;
    plan = moe_plan(T, top_k, E, k, forced, H, I, facts, x.scalar_type(), b13, b2);
  }
  KBIT_CHECK(plan.path == MoePath::kGemvDirect || plan.max_chunks <= kMmaMaxGridRows || plan.path == MoePath::kGemv,
             "kbit moe stages: ", T * top_k, " slots need up to ", plan.max_chunks, " chunks of ", plan.chunk_rows,
             " rows; the grouped kernels launch at most ", kMmaMaxGridRows);
  KBIT_CHECK_VALUE(plan.path != MoePath::kGroupedWgmma || facts.sm_major == 9,
                   "kbit moe stages: path grouped_wgmma needs a Hopper GPU (sm_90), this one is sm_", facts.sm_major, "x");
  const at::Tensor ids = topk_ids.to(at::kInt).contiguous().view({-1});
  const at::Tensor weights = topk_weights.to(at::kFloat).contiguous().view({-1});
  StageSetup st{plan, ids, weights, int32_map(expert_map, x), std::nullopt, std::nullopt, T, H, E, top_k, ids.numel()};
  (on_input ? st.input_weights : st.output_weights) = weights;
  return st;
}

// x R into a scratch where the projection's plan rotates separately (the input itself is left as it is).
at::Tensor rotated_input(const at::Tensor& A, const MoeProjPlan& proj, const std::optional<at::Tensor>& signs,
                         int64_t block) {
  at::Tensor a = A.contiguous();
  if (proj.rotation == InputRotation::kSeparate) {
    at::Tensor r = at::empty_like(a);
    launch_rotate(a, *signs, block, /*inverse=*/false, r);
    return r;
  }
  return reinterpret_cast<uintptr_t>(a.data_ptr()) % 16 != 0 ? a.clone() : a;  // 8- and 16-byte vector loads
}

// One projection of the stage ops: C[s] = (w_in[s] A[s / a_top_k] R) @ dequant(W_e(s))^T * w_out[s] in slot order,
// into C ([S, N], A's dtype); each weight 1 where not given (at most one is: fused_moe's on_input rule).
void stage_project(const StageSetup& st, const MoeProjPlan& proj, const at::Tensor& A, int64_t a_top_k,
                   const std::optional<at::Tensor>& in_w, const std::optional<at::Tensor>& out_w, const at::Tensor& q,
                   const at::Tensor& a, const at::Tensor& codebook, int64_t N, int64_t K,
                   const std::optional<at::Tensor>& signs, int64_t block, at::Tensor& C) {
  const MoePlan& plan = st.plan;
  const at::Tensor in = rotated_input(A, proj, signs, block);
  const float* fused_signs = proj.rotation == InputRotation::kFused ? signs->data_ptr<float>() : nullptr;
  const int64_t fused_block = fused_signs != nullptr ? block : 0;
  if (plan.path == MoePath::kGemvDirect) {
    // CTA row s reads row s / a_top_k of A in place and writes row s of C, the weight on its input (a product's
    // factor either way); slots of other ranks' experts are skipped: C starts zeroed.
    C.zero_();
    at::Tensor no_arrivals = at::empty({0}, st.ids.options());  // kGather zeroes the counters of a down that follows
    launch_moe_gemv_direct(MoeStage::kGather, in, st.ids, st.map, in_w.has_value() ? in_w : out_w, a_top_k, q, a,
                           codebook, N, K, C, no_arrivals, proj, nullptr, fused_signs, fused_block);
    return;
  }
  const Routing r = route(st.ids, st.map, st.E, plan.chunk_rows, plan.max_chunks, plan.pdl);
  at::Tensor routed;
  if (plan.path == MoePath::kGemv) {  // gathers A's rows (times w_in) in its activation load
    routed = at::empty({st.S, N}, A.options());
    launch_moe_gemv(MoeStage::kGather, in, r.slot_of, in_w, a_top_k, r.chunks, r.num_chunks, q, a, codebook, N, K,
                    plan.chunk_rows, routed, proj, fused_signs, fused_block);
  } else {
    at::Tensor rows = at::empty({st.S, K}, A.options().dtype(at::kBFloat16));
    launch_moe_gather(in, r.slot_of, in_w, a_top_k, rows, plan.pdl);
    routed = at::empty({st.S, N}, rows.options());
    launch_grouped(plan.kernel, rows, r.chunks, r.num_chunks, q, a, codebook, N, K, plan.chunk_rows, routed, proj);
  }
  launch_moe_combine(routed, r.pos, out_w, /*top_k=*/1, C, plan.pdl);  // rows back to slot order (zeros: not local)
}

at::Tensor moe_stage_gate_up(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                             const at::Tensor& w13_qweight, const at::Tensor& w13_absmax, const at::Tensor& w2_qweight,
                             const at::Tensor& w2_absmax, const at::Tensor& codebook, int64_t I,
                             const std::optional<at::Tensor>& expert_map, bool on_input, int64_t path_id,
                             const std::optional<at::Tensor>& w13_rot_signs, int64_t w13_rot_block,
                             const std::optional<at::Tensor>& w2_rot_signs, int64_t w2_rot_block) {
  const c10::DeviceGuard guard(x.device());
  const StageSetup st = stage_setup(x, topk_ids, topk_weights, w13_qweight, w13_absmax, w2_qweight, w2_absmax, codebook,
                                    I, expert_map, on_input, path_id, w13_rot_signs, w13_rot_block, w2_rot_signs,
                                    w2_rot_block);
  at::Tensor h13 = at::empty({st.S, 2 * I}, x.options());
  if (st.S == 0) return h13;
  stage_project(st, st.plan.gate_up, x, st.top_k, st.input_weights, std::nullopt, w13_qweight, w13_absmax, codebook,
                2 * I, st.H, w13_rot_signs, w13_rot_block, h13);
  return h13;
}

std::tuple<at::Tensor, at::Tensor> moe_stage_down(
    const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights, const at::Tensor& w13_qweight,
    const at::Tensor& w13_absmax, const at::Tensor& w2_qweight, const at::Tensor& w2_absmax, const at::Tensor& codebook,
    int64_t I, const std::optional<at::Tensor>& expert_map, bool on_input, const at::Tensor& h13, int64_t path_id,
    const std::optional<at::Tensor>& w13_rot_signs, int64_t w13_rot_block, const std::optional<at::Tensor>& w2_rot_signs,
    int64_t w2_rot_block) {
  const c10::DeviceGuard guard(x.device());
  const StageSetup st = stage_setup(x, topk_ids, topk_weights, w13_qweight, w13_absmax, w2_qweight, w2_absmax, codebook,
                                    I, expert_map, on_input, path_id, w13_rot_signs, w13_rot_block, w2_rot_signs,
                                    w2_rot_block);
  KBIT_CHECK_VALUE(h13.dim() == 2 && h13.size(0) == st.S && h13.size(1) == 2 * I &&
                       h13.scalar_type() == x.scalar_type() && h13.device() == x.device(),
                   "kbit _moe_stage_down: h13 must be x's dtype [T * top_k, 2 * intermediate_size] = [", st.S, ", ",
                   2 * I, "] on ", x.device(), " (what _moe_stage_gate_up returns), got ", h13.scalar_type(), " ",
                   h13.sizes(), " on ", h13.device());
  at::Tensor act = at::empty({st.S, I}, x.options());
  at::Tensor y = at::empty({st.S, st.H}, x.options());
  if (st.S == 0) return {act, y};
  launch_moe_silu_mul(h13.contiguous(), act, st.plan.pdl);
  stage_project(st, st.plan.down, act, 1, std::nullopt, st.output_weights, w2_qweight, w2_absmax, codebook, st.H, I, w2_rot_signs,
                w2_rot_block, y);
  return {act, y};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_route_op(
    const at::Tensor& topk_ids, const std::optional<at::Tensor>& expert_map, int64_t num_experts, int64_t chunk_rows,
    int64_t max_chunks) {
  KBIT_CHECK(topk_ids.is_cuda() && !at::isFloatingType(topk_ids.scalar_type()),
              "kbit _moe_route: topk_ids must be an integer CUDA tensor");
  KBIT_CHECK(max_chunks >= 0 && chunk_rows >= 1 && chunk_rows <= kMoeWsChunkRows && num_experts >= 1 &&
                  num_experts <= kMaxLocalExperts,
              "kbit _moe_route: needs max_chunks >= 0, chunk_rows in 1..", kMoeWsChunkRows, " and 1..",
              kMaxLocalExperts, " experts");
  const c10::DeviceGuard guard(topk_ids.device());
  const DeviceFacts facts = device_facts(topk_ids.get_device());
  const Routing r = route(topk_ids.to(at::kInt).contiguous().view({-1}), int32_map(expert_map, topk_ids), num_experts,
                          chunk_rows, max_chunks, pdl_rule(facts.sm_major));
  return {r.offsets, r.pos, r.slot_of, r.chunks, r.num_chunks};
}

// One grouped projection on rows that are already grouped by expert (chunks from _moe_route):
// C[p] = A[p] @ dequant(W_e)^T; rows outside the chunks are left unwritten. `kernel` is a MoE plan's
// (kbit::_moe_kernel_id of moe_plan's kernel: moe_gemv, mma_grouped, wgmma_rs_grouped or wgmma_ws_grouped,
// the last two Hopper only) and chunk_rows the chunk height given to _moe_route; the planner plans the
// projection for them (moe_proj_plan) with splits / row_groups / producers forced where not 0 (sweeps).
at::Tensor moe_grouped_linear_op(const at::Tensor& A, const at::Tensor& chunks, const at::Tensor& num_chunks,
                               const at::Tensor& qweight, const at::Tensor& absmax, const at::Tensor& codebook,
                               int64_t N, int64_t K, int64_t kernel_id, int64_t chunk_rows, int64_t splits,
                               int64_t row_groups, int64_t producers) {
  KBIT_CHECK(A.is_cuda() && A.dim() == 2 && A.size(1) == K && A.is_contiguous() &&
                  (A.scalar_type() == at::kBFloat16 || A.scalar_type() == at::kHalf),
              "kbit _moe_grouped_linear: A must be contiguous bf16/fp16 [rows, K=", K, "], got ", A.sizes());
  check_weight_shape(N, K);
  KBIT_CHECK(chunks.scalar_type() == at::kInt && chunks.dim() == 2 && chunks.size(1) == 4 && chunks.is_contiguous() &&
                  num_chunks.scalar_type() == at::kInt && num_chunks.numel() == 1,
              "kbit _moe_grouped_linear: chunks/num_chunks as _moe_route returns them");
  // The experts' weights and codebook by checks.cpp's rules (kbit::fused_moe's stacks), contiguous for the kernels.
  const int64_t k = check_stacked_bits(qweight, "_moe_grouped_linear", "");
  check_stacked(qweight, absmax, qweight.size(0), N, K, k, "_moe_grouped_linear", "");
  check_contiguous(qweight, "qweight");
  check_contiguous(absmax, "absmax");
  check_codebook(codebook, k);
  const MoeKernel kernel = moe_kernel_from_id(kernel_id);
  KBIT_CHECK_VALUE(kernel != MoeKernel::kGemvDirect && kernel != MoeKernel::kGroupedMm,
                   "kbit _moe_grouped_linear: runs moe_gemv, mma_grouped, wgmma_rs_grouped or wgmma_ws_grouped, not ",
                   moe_kernel_name(kernel));
  KBIT_CHECK(chunks.size(0) <= kMmaMaxGridRows, "kbit _moe_grouped_linear: at most ", kMmaMaxGridRows, " chunks");
  const c10::DeviceGuard guard(A.device());
  const DeviceFacts facts = device_facts(A.get_device());
  // The planner checks the chunk height and the forced fields against the kernel, as fused_moe's.
  const MoeProjPlan plan = moe_proj_plan(kernel, A.size(0), qweight.size(0), chunk_rows, chunks.size(0),
                                         qweight.size(1), qweight.size(2), k, facts, row_groups, splits, producers);
  at::Tensor C = at::empty({A.size(0), N}, A.options());
  if (kernel == MoeKernel::kWgmmaRsGrouped || kernel == MoeKernel::kWgmmaWsGrouped) {
    KBIT_CHECK_VALUE(facts.sm_major == 9, "kbit _moe_grouped_linear: ", moe_kernel_name(kernel),
                     " needs a Hopper GPU (sm_90), this one is sm_", facts.sm_major, "x");
    if (kernel == MoeKernel::kWgmmaRsGrouped) {
      launch_wgmma_rs_grouped(A, chunks, qweight, absmax, codebook, N, K, C, plan);
    } else {
      launch_wgmma_ws_grouped(A, chunks, qweight, absmax, codebook, N, K, C, plan);
    }
  } else if (kernel == MoeKernel::kMmaGrouped) {
    KBIT_CHECK(A.scalar_type() == at::kBFloat16, "kbit _moe_grouped_linear: the grouped MMA takes bf16 A");
    launch_mma_grouped(A, chunks, num_chunks, qweight, absmax, codebook, N, K, chunk_rows, C, plan);
  } else if (chunks.size(0) > 0) {
    launch_moe_gemv(MoeStage::kGather, A, std::nullopt, std::nullopt, 1, chunks, num_chunks, qweight, absmax, codebook,
                    N, K, chunk_rows, C, plan);
  }
  return C;
}

}  // namespace
}  // namespace kbit

// The routing pieces as ops (C++ only); _fused_moe_cuda's schema is kbit::fused_moe's plus the path
// (vllm_kbit/ops.py).
TORCH_LIBRARY_FRAGMENT(kbit, m) {
  m.def(
      "_moe_route(Tensor topk_ids, Tensor? expert_map, int num_experts, int chunk_rows, int max_chunks) -> "
      "(Tensor offsets, Tensor pos, Tensor slot_of, Tensor chunks, Tensor num_chunks)");
  m.def(
      "_moe_grouped_linear(Tensor A, Tensor chunks, Tensor num_chunks, Tensor qweight, Tensor absmax, Tensor codebook, "
      "int N, int K, int kernel, int chunk_rows, int splits=0, int row_groups=0, int producers=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(kbit, CUDA, m) {
  m.impl("_fused_moe_cuda", &kbit::fused_moe_cuda);
  m.impl("_moe_route", &kbit::moe_route_op);
  m.impl("_moe_grouped_linear", &kbit::moe_grouped_linear_op);
  m.impl("_moe_stage_gate_up", &kbit::moe_stage_gate_up);
  m.impl("_moe_stage_down", &kbit::moe_stage_down);
}
