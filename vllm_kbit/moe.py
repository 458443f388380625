"""``torch.ops.kbit.fused_moe``: routed experts (SiLU-and-mul MLPs) on kbit weights in the runtime layout.

Weights of the E local experts are stacked runtime tensors: ``w13_qweight``
``[E, *runtime_shape(2I, H)]`` (gate rows then up rows), ``w2_qweight``
``[E, *runtime_shape(H, I)]`` and their absmax codes likewise, one codebook
for both. ``topk_ids`` hold global expert ids; ``expert_map`` (optional, [global
experts] int32) maps them to local ids, -1 for experts on other ranks, which
then contribute nothing. Ids outside the local experts -- negative, >= E without an
``expert_map``, outside the map, or mapped outside [0, E) -- contribute nothing either (on
CUDA too: the routing kernel drops such slots, so no weight is read for them). They are not
refused because checking device-side ids would need a host sync on every call.

CPU runs the PyTorch reference below, with each expert's weights decoded once and kept
(:func:`vllm_kbit.ops.cpu_decoded`). CUDA with bf16/fp16 activations runs
``kbit::_fused_moe_cuda`` (csrc/ops/moe_ops.cpp: device-side routing, then by slots per
expert the direct kbit GEMV (few slots: no routing, the combine in the down projection), the
grouped dequant + MMA, or dequantize + ``torch._grouped_mm``;
``torch.ops.kbit.moe_plan`` says which, and how large the routing's workspace is); activations the
planner sends to the ``reference`` path (fp32) run the reference on CUDA too. :func:`route_reference` is the
routing those kernels compute, in PyTorch.
"""

from __future__ import annotations

import functools

import torch

from vllm_kbit import reference as fmt
from vllm_kbit import ops

_lib = torch.library.Library("kbit", "FRAGMENT")  # kbit::fused_moe's schema: vllm_kbit/ops.py

# VLLM_KBIT_MOE_PATH forces one CUDA path for every call (benchmarks, bisecting a numerical difference):
# auto (default), gemv, grouped_mm, grouped_mma, gemv_direct or grouped_wgmma; the extension reads and checks it
# (csrc/plan/overrides.h) and this asks which path.
_MOE_PATH = torch.ops.kbit._moe_path_override() if ops.HAS_EXTENSION else 0  # 0: auto


def _fused_moe_reference(
    x, topk_ids, topk_weights, w13_qweight, w13_absmax, w2_qweight, w2_absmax, codebook, intermediate_size, expert_map,
    apply_router_weight_on_input, *, w13_rot_signs=None, w13_rot_block=0, w2_rot_signs=None, w2_rot_block=0,
):
    """out[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = topk_ids[t, j].

    Rotated experts (docs/format.md, section 9) take x R_13 into gate_up and (silu(gate) * up) R_2 into down:
    :func:`reference.hadamard_rotate` with the given signs and block, rounded to x's dtype.
    Device-side only (no host sync, no data-dependent shapes): each local expert
    runs on every token and a per-token combine weight (zero where the expert was
    not picked) selects the result.
    """
    fmt.check("fused_moe", x, topk_ids, topk_weights, w13_qweight, w13_absmax, w2_qweight, w2_absmax, codebook,
              intermediate_size, expert_map, apply_router_weight_on_input, w13_rot_signs, w13_rot_block, w2_rot_signs,
              w2_rot_block)
    if w13_rot_signs is not None:
        x = fmt.hadamard_rotate(x, w13_rot_signs, w13_rot_block)
    T, H = x.shape
    I = intermediate_size
    E = w13_qweight.shape[0]
    ids = topk_ids.long()
    if expert_map is not None:
        inside = (ids >= 0) & (ids < expert_map.numel())
        ids = torch.where(inside, expert_map.long()[ids.clamp(0, max(expert_map.numel() - 1, 0))], -1)
    ids = torch.where(ids < E, ids, -1)  # ids outside [0, E) contribute nothing, as on CUDA
    # combine[t, e] = sum of the router weights token t gives local expert e; column E collects non-local picks.
    combine = torch.zeros(T, E + 1, dtype=torch.float32, device=x.device)
    combine.scatter_add_(1, torch.where(ids < 0, E, ids), topk_weights.float())
    picked = torch.zeros(T, E + 1, dtype=torch.float32, device=x.device)
    picked.scatter_add_(1, torch.where(ids < 0, E, ids), torch.ones_like(topk_weights, dtype=torch.float32))
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)

    def decode_w13(e):
        return fmt.dequantize_runtime(w13_qweight[e], w13_absmax[e], codebook, 2 * I, H, x.dtype)

    def decode_w2(e):
        return fmt.dequantize_runtime(w2_qweight[e], w2_absmax[e], codebook, H, I, x.dtype)

    w13_of, w2_of = decode_w13, decode_w2
    if ops.cpu_decode_cache_on(w13_qweight):  # every expert decoded once per weight (ops.cpu_decoded)
        w13_of = ops.cpu_decoded((w13_qweight, w13_absmax, codebook), ("fused_moe", x.dtype, 2 * I, H),
                                 lambda: tuple(map(decode_w13, range(E)))).__getitem__
        w2_of = ops.cpu_decoded((w2_qweight, w2_absmax, codebook), ("fused_moe", x.dtype, H, I),
                                lambda: tuple(map(decode_w2, range(E)))).__getitem__
    for e in range(E):
        w13, w2 = w13_of(e), w2_of(e)
        if apply_router_weight_on_input:
            xe = (x.float() * combine[:, e : e + 1]).to(x.dtype)
            scale = picked[:, e : e + 1]
        else:
            xe = x
            scale = combine[:, e : e + 1]
        gate_up = torch.nn.functional.linear(xe, w13)
        h = torch.nn.functional.silu(gate_up[:, :I]) * gate_up[:, I:]
        if w2_rot_signs is not None:
            h = fmt.hadamard_rotate(h, w2_rot_signs, w2_rot_block)
        out += torch.nn.functional.linear(h, w2).float() * scale
    return out.to(x.dtype)


@functools.cache
def _runs_reference(dtype: torch.dtype) -> bool:
    """Whether the planner sends activations of ``dtype`` to the reference path (csrc/plan/plan.cpp: moe_plan)."""
    return torch.ops.kbit.moe_plan(0, 0, 1, fmt.SUPPORTED_BITS[0], "auto", 0, dtype)[0] == "reference"


def _fused_moe_cuda(
    x, topk_ids, topk_weights, w13_qweight, w13_absmax, w2_qweight, w2_absmax, codebook, intermediate_size, expert_map,
    apply_router_weight_on_input, *, w13_rot_signs=None, w13_rot_block=0, w2_rot_signs=None, w2_rot_block=0,
):
    """CUDA: the fused kernels, or the reference where the plan's path is (fp32 activations) or without the extension.

    Both check the arguments with the same rules (check_fused_moe, csrc/ops/checks.cpp)."""
    rotation = dict(w13_rot_signs=w13_rot_signs, w13_rot_block=w13_rot_block, w2_rot_signs=w2_rot_signs,
                    w2_rot_block=w2_rot_block)
    if not ops.HAS_CUDA_KERNELS or _runs_reference(x.dtype):
        return _fused_moe_reference(
            x, topk_ids, topk_weights, w13_qweight, w13_absmax, w2_qweight, w2_absmax, codebook, intermediate_size,
            expert_map, apply_router_weight_on_input, **rotation,
        )
    return torch.ops.kbit._fused_moe_cuda(
        x, topk_ids, topk_weights, w13_qweight, w13_absmax, w2_qweight, w2_absmax, codebook, int(intermediate_size),
        expert_map, apply_router_weight_on_input, _MOE_PATH, **rotation,
    )


_lib.impl("fused_moe", _fused_moe_reference, "CPU")
_lib.impl("fused_moe", _fused_moe_cuda, "CUDA")


@torch.library.register_fake("kbit::fused_moe")
def _fused_moe_fake(
    x, topk_ids, topk_weights, w13_qweight, w13_absmax, w2_qweight, w2_absmax, codebook, intermediate_size, expert_map,
    apply_router_weight_on_input, *, w13_rot_signs=None, w13_rot_block=0, w2_rot_signs=None, w2_rot_block=0,
):
    return torch.empty_like(x)


def kbit_fused_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13_qweight: torch.Tensor,
    w13_absmax: torch.Tensor,
    w2_qweight: torch.Tensor,
    w2_absmax: torch.Tensor,
    codebook: torch.Tensor,
    intermediate_size: int,
    expert_map: torch.Tensor | None = None,
    apply_router_weight_on_input: bool = False,
    rotation: "ExpertsRotation | None" = None,
) -> torch.Tensor:
    """Routed-expert MLPs of a MoE block on kbit weights; see the module docstring for the layout.

    Slots whose expert id is outside the local experts (negative, >= E without expert_map, or not
    mapped to a local expert) contribute zero; nothing is read for them. ``rotation``: the experts' input
    rotations when they are stored rotated (gate_up on the hidden size, down on the intermediate size).
    """
    return torch.ops.kbit.fused_moe(
        x, topk_ids, topk_weights, w13_qweight, w13_absmax, w2_qweight, w2_absmax, codebook, intermediate_size,
        expert_map, apply_router_weight_on_input, **(rotation.op_kwargs() if rotation is not None else {}),
    )


class ExpertsRotation:
    """The input rotations of a block of rotated routed experts: ``w13`` = (signs [H], block) of the hidden states
    (gate_up's input) and ``w2`` = (signs [I], block) of the SiLU-and-mul output (down's input); docs/format.md,
    section 9. Under tensor parallelism I is this rank's shard and its signs the matching slice."""

    def __init__(self, w13_signs: torch.Tensor, w13_block: int, w2_signs: torch.Tensor, w2_block: int):
        self.w13_signs, self.w13_block, self.w2_signs, self.w2_block = w13_signs, w13_block, w2_signs, w2_block

    def op_kwargs(self) -> dict:
        return dict(w13_rot_signs=self.w13_signs, w13_rot_block=self.w13_block, w2_rot_signs=self.w2_signs,
                    w2_rot_block=self.w2_block)


def stack_runtime(flat: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert flat (qweight, absmax) pairs -> stacked runtime tensors [E, ...]."""
    rt = [torch.ops.kbit.repack(q.contiguous(), a.contiguous()) for q, a in flat]
    return torch.stack([q for q, _ in rt]), torch.stack([a for _, a in rt])


def route_reference(topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_experts: int):
    """The routing the CUDA path computes, as (offsets [E+1], pos [S], local expert per slot [S]).

    Slots s = t * top_k + j are grouped by local expert: expert e owns rows [offsets[e], offsets[e+1]),
    pos[s] is the row of slot s (-1 for experts not on this rank or ids out of range). Here slots
    keep their order inside an expert; the CUDA routing may order them differently (atomics), which
    changes no result, so tests compare offsets exactly and pos up to that order.
    """
    ids = topk_ids.reshape(-1).long()
    if expert_map is not None:
        inside = (ids >= 0) & (ids < expert_map.numel())
        ids = torch.where(inside, expert_map.long()[ids.clamp(0, max(expert_map.numel() - 1, 0))], -1)
    local = torch.where((ids >= 0) & (ids < num_experts), ids, -1)
    counts = torch.bincount(local[local >= 0], minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    offsets[1:] = torch.cumsum(counts, 0)
    order = torch.argsort(torch.where(local >= 0, local, num_experts), stable=True)
    pos = torch.full_like(local, -1)
    n_local = int(counts.sum())
    pos[order[:n_local]] = torch.arange(n_local, device=ids.device)
    return offsets.to(torch.int32), pos.to(torch.int32), local.to(torch.int32)


# ----------------------------------------------------------------------------------------------- the stages


def fused_moe_stages(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13_qweight: torch.Tensor,
    w13_absmax: torch.Tensor,
    w2_qweight: torch.Tensor,
    w2_absmax: torch.Tensor,
    codebook: torch.Tensor,
    intermediate_size: int,
    expert_map: torch.Tensor | None = None,
    after_gate_up=None,
    after_down=None,
    rotation: ExpertsRotation | None = None,
) -> torch.Tensor:
    """:func:`kbit_fused_moe` (router weights on the output) computed stage by stage, so that a caller can add to
    the intermediate results: ``after_gate_up(h13)`` gets each slot's gate_up output ``[T * top_k, 2I]`` (slot
    s = t * top_k + j, before SiLU-and-mul) and ``after_down(y, act)`` each slot's down output already times its
    router weight, ``[T, top_k, H]``, before the sum over the top_k slots, with the activations ``[T * top_k, I]``
    it was computed from. Both may add in place (vLLM's LoRA on routed experts does). Slots of experts that are not
    local hold zeros. Rotated experts (``rotation``) multiply x R_13 and act R_2; the hooks see the unrotated x
    (their caller's) and act, so adapters computed from them add what they add to an unrotated layer.

    On CUDA the two stages are ``kbit::_moe_stage_gate_up`` and ``kbit::_moe_stage_down`` (csrc/ops/moe_ops.cpp:
    fused_moe's plan and kernels, each projection writing slot order; the rotations inside them); elsewhere each
    local expert runs on every token with its weights decoded, as the reference does. Shapes depend only on T,
    top_k and E."""
    T, H = x.shape
    top_k = topk_ids.shape[1]
    I = intermediate_size
    E = w13_qweight.shape[0]
    S = T * top_k
    if S == 0:
        return torch.zeros_like(x)
    if x.is_cuda and ops.HAS_CUDA_KERNELS and not _runs_reference(x.dtype):
        args = (x, topk_ids, topk_weights, w13_qweight, w13_absmax, w2_qweight, w2_absmax, codebook, int(I), expert_map,
                False)
        rot = rotation.op_kwargs() if rotation is not None else {}
        h13 = torch.ops.kbit._moe_stage_gate_up(*args, _MOE_PATH, **rot)
        if after_gate_up is not None:
            after_gate_up(h13)
        act, y = torch.ops.kbit._moe_stage_down(*args, h13, _MOE_PATH, **rot)
        y = y.view(T, top_k, H)
        if after_down is not None:
            after_down(y, act)
        return y.sum(1)  # accumulated in fp32 (PyTorch's reduction type for 16-bit inputs), rounded once
    # The reference: the projections' inputs are x R_13 and act R_2 for rotated experts; the hooks get x and act.
    ids = topk_ids.reshape(-1)
    xr = x if rotation is None else torch.ops.kbit.hadamard_rotate(x, rotation.w13_signs, rotation.w13_block)
    local = _local_ids(ids, expert_map, E)
    h13 = torch.zeros(S, 2 * I, dtype=x.dtype, device=x.device)
    xs = xr.repeat_interleave(top_k, dim=0)
    for e in range(E):
        W = _decoded(w13_qweight, w13_absmax, codebook, e, 2 * I, H, x.dtype)
        h13 = torch.where((local == e)[:, None], torch.nn.functional.linear(xs, W), h13)
    if after_gate_up is not None:
        after_gate_up(h13)
    act = torch.nn.functional.silu(h13[:, :I]) * h13[:, I:]
    act_in = act if rotation is None else torch.ops.kbit.hadamard_rotate(act, rotation.w2_signs, rotation.w2_block)
    y = torch.zeros(S, H, dtype=x.dtype, device=x.device)
    for e in range(E):
        W = _decoded(w2_qweight, w2_absmax, codebook, e, H, I, x.dtype)
        y = torch.where((local == e)[:, None], torch.nn.functional.linear(act_in, W), y)
    # In place, one pass each: the product in fp32 (the weights' type) rounded once, the sum accumulated in fp32.
    y = y.mul_(topk_weights.reshape(-1, 1).float()).view(T, top_k, H)
    if after_down is not None:
        after_down(y, act)
    return y.sum(1, dtype=torch.float32).to(x.dtype)


def _local_ids(ids: torch.Tensor, expert_map: torch.Tensor | None, E: int) -> torch.Tensor:
    """Each slot's local expert, -1 where it is not local (the reference's rule)."""
    ids = ids.long()
    if expert_map is not None:
        inside = (ids >= 0) & (ids < expert_map.numel())
        ids = torch.where(inside, expert_map.long()[ids.clamp(0, max(expert_map.numel() - 1, 0))], -1)
    return torch.where((ids >= 0) & (ids < E), ids, -1)


def _decoded(q, a, codebook, e, N, K, dtype):
    """Expert e of a stacked runtime weight, decoded ([N, K] in dtype; CPU: kept, ops.cpu_decoded)."""
    if ops.cpu_decode_cache_on(q):
        experts = ops.cpu_decoded((q, a, codebook), ("fused_moe", dtype, N, K),
                                  lambda: tuple(fmt.dequantize_runtime(q[i], a[i], codebook, N, K, dtype)
                                                for i in range(q.shape[0])))
        return experts[e]
    return fmt.dequantize_runtime(q[e], a[e], codebook, N, K, dtype)
