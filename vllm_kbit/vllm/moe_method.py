"""kbit methods for vLLM's FusedMoE (routed experts): packed w13/w2 per expert, ``apply`` -> ``kbit_fused_moe``.

* :class:`KbitMoEMethod` loads a pre-quantized checkpoint: per expert
  ``w13_qweight`` int32 ``[E, 2I, H/32, k]`` (gate rows, then up rows),
  ``w2_qweight`` ``[E, H, I/32, k]`` and the matching uint8 ``*_absmax``
  (qweights held as ``[E, N, K/32 * k]`` while loading). vLLM's
  ``RoutedExperts.load_weights`` maps each checkpoint name to a parameter, expert and shard and calls
  that parameter's ``weight_loader``, which checks the tensor and hands it to the layer's own expert
  ``weight_loader`` (the absmax as a group scale, ``quant_method`` ``group``), so tensor
  parallel sharding (w1/w3 along rows, w2 along I/32) and expert-parallel maps
  (global -> local expert id, experts of other ranks skipped) are vLLM's.
* :class:`KbitOnlineMoEMethod` loads bf16/fp16 experts on the meta device;
  vLLM's layerwise loading materializes the block once all its experts arrived,
  then each expert is quantized and the bf16 block is freed. One range scale s per layer, over w13 and
  w2 of all local experts (:func:`vllm_kbit.reference.range_scale`; the fused op takes one codebook per
  layer), lets any finite weights quantize: experts are quantized as W / s and the layer's codebook is
  ``codebook * s``. NaN or Inf weights fail the load naming the layer and expert, as soon as that
  layer's weights have arrived (their values are not known earlier); structural problems (activation,
  biases, sizes not multiples of 32) are refused when the method is created, before any weight loads.

After loading, each expert is repacked to the runtime layout and the experts
are stacked ``[E, ...]`` for :func:`vllm_kbit.moe.kbit_fused_moe`; the block is then counted in the load's
summary line (:mod:`vllm_kbit.vllm.load_report`).
"""

from __future__ import annotations

import functools
import math

import torch

from vllm_kbit import reference as fmt
from vllm_kbit.moe import kbit_fused_moe, stack_runtime
from vllm_kbit.vllm.checkpoint import CheckpointFiles
from vllm_kbit.vllm.compat import (
    LOADS_PER_EXPERT_3D_TENSORS,
    FusedMoEMethodBase,
    FusedMoeWeightScaleSupported,
    MoEActivation,
    cpu_select_experts,
    current_platform,
    initialize_online_processing,
    replace_parameter,
    set_weight_attrs,
)
from vllm_kbit.vllm.load_report import EXPERTS, LoadReport


def check_moe_layer(layer: torch.nn.Module, prefix: str) -> None:
    """Refuses MoE blocks the kbit path cannot run, naming the layer."""
    moe = layer.moe_config
    if moe.activation != MoEActivation.SILU or not moe.is_act_and_mul:
        raise ValueError(
            f"kbit: MoE layer {prefix!r} uses activation {moe.activation}; only SiLU-and-mul experts are supported "
            "(add the layer to modules_to_not_convert)"
        )
    if moe.has_bias:
        raise ValueError(
            f"kbit: MoE layer {prefix!r} has expert biases, which kbit does not support "
            "(add the layer to modules_to_not_convert)"
        )
    for what, size in (("hidden size", moe.hidden_dim), ("intermediate size per rank", moe.intermediate_size_per_partition)):
        if size % fmt.BLOCK_SIZE != 0:
            raise ValueError(
                f"kbit: MoE layer {prefix!r} has {what} {size}, not a multiple of {fmt.BLOCK_SIZE}; "
                "add it to modules_to_not_convert (or use a smaller tensor-parallel size)"
            )


def _load_per_expert_tensors(layer: torch.nn.Module, weights):
    """``load_weights`` of a RoutedExperts holding kbit experts, for vLLM before 0.32: each checkpoint tensor is
    one expert's ``qweight``/``absmax``, handed to its parameter's loader with vLLM's (physical) expert mapping,
    as vLLM 0.32's ``load_weights`` does for a 3-D tensor whose name holds an expert number."""
    mapping = layer.get_expert_mapping()
    for expert_name, loaded_weight in weights:
        qual_name = f"{layer.layer_name}.{expert_name}"
        for param_name, weight_name, expert_id, shard_id in mapping:
            if weight_name not in qual_name:
                continue
            full_name = qual_name.replace(weight_name, param_name)
            name = full_name.removeprefix(f"{layer.layer_name}.")
            param = getattr(layer, name)
            if param.weight_loader(
                param=param,
                loaded_weight=loaded_weight,
                weight_name=full_name,
                shard_id=shard_id,
                expert_id=expert_id,
                return_success=True,
            ):
                yield name


def _skip_after_processing(layer: torch.nn.Module, load_weights, weights):
    """``load_weights`` of a RoutedExperts with online kbit experts: tensors that arrive after the layer was
    quantized are dropped. Under expert parallelism vLLM's layerwise loader quantizes the layer once this
    rank's experts are loaded, and the checkpoint's later tensors are other ranks' experts, which vLLM's
    loader would look up as ``w13_weight`` / ``w2_weight``, parameters the kbit layer no longer has."""
    return load_weights(w for w in weights if not getattr(layer, "_already_called_process_weights_after_loading", False))


class _KbitMoEBase(FusedMoEMethodBase):
    def __init__(self, layer: torch.nn.Module, prefix: str, bits: int, codebook: torch.Tensor,
                 report: LoadReport | None = None):
        super().__init__(layer.moe_config)
        check_moe_layer(layer, prefix)
        self.prefix = prefix
        self.bits = bits
        self.codebook = codebook
        self.report = report if report is not None else LoadReport()

    def get_fused_moe_quant_config(self, layer: torch.nn.Module):
        # No modular kernel: kbit_fused_moe is one op that takes vLLM's routing and expert_map as they are (the
        # FusedMoEExpertsModular interface differs between 0.26 and 0.32); without one vLLM calls apply().
        return None

    def _install(self, layer: torch.nn.Module, w13: list, w2: list, bytes_before: int, dtype: torch.dtype,
                 range_scale: float = 1.0) -> None:
        """Per-expert flat (qweight, absmax) -> stacked runtime parameters on the layer; ``bytes_before``: the
        experts' size unquantized (in ``dtype``), for the load's summary; ``range_scale``: the power of two the
        experts were divided by, folded into the layer's codebook."""
        w13_q, w13_a = stack_runtime(w13)
        w2_q, w2_a = stack_runtime(w2)
        replace_parameter(layer, "w13_qweight", w13_q)
        replace_parameter(layer, "w13_absmax", w13_a)
        replace_parameter(layer, "w2_qweight", w2_q)
        replace_parameter(layer, "w2_absmax", w2_a)
        layer.register_buffer("kbit_codebook", self.codebook.to(w13_q.device) * range_scale, persistent=False)
        layer._already_called_process_weights_after_loading = True
        self.report.finish(layer, EXPERTS, self.bits, bytes_before, dtype, [w13_q, w13_a, w2_q, w2_a],
                           range_scaled=self.prefix if range_scale != 1.0 else None)

    @property
    def is_monolithic(self) -> bool:
        # vLLM's router ops are CUDA kernels; on CPU route here with vLLM's CPU routing, as its own CPU MoE does.
        return current_platform.is_cpu()

    def apply_monolithic(self, layer, x, router_logits, input_ids=None) -> torch.Tensor:
        topk_weights, topk_ids = cpu_select_experts(
            hidden_states=x,
            router_logits=router_logits,
            top_k=layer.top_k,
            use_grouped_topk=layer.use_grouped_topk,
            renormalize=layer.renormalize,
            topk_group=layer.topk_group,
            num_expert_group=layer.num_expert_group,
            custom_routing_function=layer.custom_routing_function,
            scoring_func=layer.scoring_func,
            routed_scaling_factor=layer.routed_scaling_factor,
            e_score_correction_bias=layer.e_score_correction_bias,
        )
        return self.apply(layer, x, topk_weights, topk_ids, None, None)

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input) -> torch.Tensor:
        return kbit_fused_moe(
            x,
            topk_ids,
            topk_weights,
            layer.w13_qweight,
            layer.w13_absmax,
            layer.w2_qweight,
            layer.w2_absmax,
            layer.kbit_codebook,
            layer.intermediate_size_per_partition,
            layer.expert_map,
            layer.apply_router_weight_on_input,
        )


class KbitMoEMethod(_KbitMoEBase):
    """Pre-quantized kbit experts; ``checkpoint`` names the files of tensors in load errors."""

    def __init__(self, layer: torch.nn.Module, prefix: str, bits: int, codebook: torch.Tensor,
                 checkpoint: CheckpointFiles | None = None, report: LoadReport | None = None):
        super().__init__(layer, prefix, bits, codebook, report)
        self.checkpoint = checkpoint or CheckpointFiles()

    def _tensor_name(self, layer: torch.nn.Module, expert_id: int, shard_id: str, kind: str) -> str:
        """The checkpoint name of one expert's tensor (``...experts.5.up_proj.absmax``), from vLLM's expert mapping."""
        base = self.prefix.removesuffix("experts")
        for _, weight_name, e, s in layer.get_expert_mapping():
            if e == expert_id and s == shard_id:
                return f"{base}{weight_name}{kind}"
        return f"{self.prefix} expert {expert_id} {shard_id} {kind}"

    def create_weights(
        self,
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ):
        H, I, k = hidden_size, intermediate_size_per_partition, self.bits
        # vLLM's expert loader takes 2-D tensors per expert; each qweight row [K/32, k] is held flattened to
        # K/32 * k words while loading (blocks stay contiguous, so sharding K/32 across ranks is unchanged).
        shapes = {
            "w13_qweight": ((num_experts, 2 * I, H // 32 * k), torch.int32),
            "w13_absmax": ((num_experts, 2 * I, H // 32), torch.uint8),
            "w2_qweight": ((num_experts, H, I // 32 * k), torch.int32),
            "w2_absmax": ((num_experts, H, I // 32), torch.uint8),
        }
        layer.kbit_loaded = {name: set() for name in shapes}
        layer.kbit_dense_dtype = params_dtype  # what the experts would be unquantized, for the load's summary
        if not LOADS_PER_EXPERT_3D_TENSORS:
            # Up to vLLM 0.31 load_weights takes any 3-D tensor for all experts; a kbit qweight is one expert's.
            layer.load_weights = functools.partial(_load_per_expert_tensors, layer)
        expert_loader = extra_weight_attrs["weight_loader"]
        for name, (shape, dtype) in shapes.items():
            param = torch.nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            layer.register_parameter(name, param)
            attrs = {**extra_weight_attrs, "weight_loader": functools.partial(self._load, layer, name, expert_loader)}
            if name.endswith("absmax"):
                attrs["quant_method"] = FusedMoeWeightScaleSupported.GROUP.value  # one scale per block of 32
            set_weight_attrs(param, attrs)

    def _load(self, layer, name, expert_loader, param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
        """Checks one expert's checkpoint tensor, then hands it to the layer's expert loader (TP / EP aware)."""
        H = layer.moe_config.hidden_dim
        I_full = layer.moe_config.intermediate_size
        K = H if name.startswith("w13") else I_full
        is_q = name.endswith("qweight")
        want_dtype, want_dim = (torch.int32, 3) if is_q else (torch.uint8, 2)
        if (
            loaded_weight.dtype != want_dtype
            or loaded_weight.dim() != want_dim
            or loaded_weight.shape[1] != K // 32
            or (is_q and loaded_weight.shape[2] != self.bits)
        ):
            want = f"[N, {K // 32}, {self.bits}]" if is_q else f"[N, {K // 32}]"
            tensor = self._tensor_name(layer, expert_id, shard_id, name.split("_", 1)[1])
            raise ValueError(
                f"kbit: checkpoint tensor {self.checkpoint.where(tensor)} is "
                f"{loaded_weight.dtype} {list(loaded_weight.shape)}, expected {want_dtype} {want}: "
                "corrupted or mismatched checkpoint"
            )
        # The expert loader tells weights from scales by name: it needs "scale" in an absmax's (vLLM's GPTQ "scales").
        try:
            ok = expert_loader(
                param, loaded_weight.reshape(loaded_weight.shape[0], -1),
                weight_name if is_q else f"{weight_name}_scale", shard_id, expert_id, return_success=True,
            )
        except RuntimeError as e:
            tensor = self._tensor_name(layer, expert_id, shard_id, name.split("_", 1)[1])
            raise ValueError(
                f"kbit: checkpoint tensor {self.checkpoint.where(tensor)} of shape "
                f"{list(loaded_weight.shape)} does not fit {name} {list(param.shape)}: {e}"
            ) from None
        if ok:
            layer.kbit_loaded[name].add((expert_id, shard_id))
        return ok if return_success else None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if getattr(layer, "_already_called_process_weights_after_loading", False):
            return
        E = layer.local_num_experts
        for name, loaded in layer.kbit_loaded.items():
            want = E * (2 if name.startswith("w13") else 1)
            if len(loaded) != want:
                # Experts whose other tensor (qweight vs absmax) arrived: name the first missing one and its file.
                group, kind = name.split("_", 1)
                other = f"{group}_{'absmax' if kind == 'qweight' else 'qweight'}"
                missing = sorted(layer.kbit_loaded[other] - loaded)
                if missing:
                    tensor = self._tensor_name(layer, *missing[0], kind)
                    sibling = tensor.removesuffix(kind) + other.split("_", 1)[1]
                    file = self.checkpoint.file_of(sibling)
                    beside = f"; {sibling} is in {file}" if file else ""
                    more = f" and {len(missing) - 1} more {kind} tensors" if len(missing) > 1 else ""
                    raise ValueError(
                        f"kbit: checkpoint has no {tensor}{more} (MoE layer {self.prefix!r}{beside}); "
                        "the pre-quantized checkpoint is incomplete"
                    )
                raise ValueError(
                    f"kbit: checkpoint has {len(loaded)} of the {want} {name.split('_', 1)[1]} tensors of "
                    f"{name.split('_')[0]} for MoE layer {self.prefix!r}: incomplete pre-quantized checkpoint"
                )
        k = self.bits
        w13 = [(layer.w13_qweight.data[e].unflatten(-1, (-1, k)), layer.w13_absmax.data[e]) for e in range(E)]
        w2 = [(layer.w2_qweight.data[e].unflatten(-1, (-1, k)), layer.w2_absmax.data[e]) for e in range(E)]
        del layer.kbit_loaded
        dtype = layer.kbit_dense_dtype
        weights = layer.w13_absmax.numel() + layer.w2_absmax.numel()  # one absmax per block of 32 weights
        self._install(layer, w13, w2, weights * fmt.BLOCK_SIZE * dtype.itemsize, dtype)


class KbitOnlineMoEMethod(_KbitMoEBase):
    """bf16/fp16 experts quantized while loading (vLLM's layerwise online processing)."""

    uses_meta_device: bool = True

    def create_weights(
        self,
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ):
        H, I = hidden_size, intermediate_size_per_partition
        for name, shape in (("w13_weight", (num_experts, 2 * I, H)), ("w2_weight", (num_experts, H, I))):
            param = torch.nn.Parameter(torch.empty(shape, device="meta", dtype=params_dtype), requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(param, extra_weight_attrs)
        initialize_online_processing(layer)
        # No hook drops tensors that arrive after processing, and vLLM's loader needs w13_weight for them.
        layer.load_weights = functools.partial(_skip_after_processing, layer, layer.load_weights)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if getattr(layer, "_already_called_process_weights_after_loading", False):
            return
        w13_full, w2_full = layer.w13_weight.data, layer.w2_weight.data
        if w13_full.device.type == "meta" or w2_full.device.type == "meta":
            raise ValueError(f"kbit: checkpoint has no expert weights for MoE layer {self.prefix!r}")
        codebook = self.codebook.to(w13_full.device)
        amax = []
        for name, W in (("w13", w13_full), ("w2", w2_full)):
            amax.append(fmt.weight_amax(W))
            if not math.isfinite(amax[-1]):
                # Routed experts have no bf16 fallback here: refuse, naming the first expert with NaN or Inf.
                e = next(e for e in range(W.shape[0]) if not torch.isfinite(W[e]).all())
                raise ValueError(
                    f"kbit: MoE layer {self.prefix!r} expert {e} {name}: weight has NaN or Inf values; "
                    "cannot quantize; add the layer to modules_to_not_convert to keep it in bf16"
                )
        scale = fmt.range_scale(max(amax))  # one per layer: the fused op takes one codebook for w13 and w2
        packed = {"w13": [], "w2": []}
        for name, W in (("w13", w13_full), ("w2", w2_full)):
            for e in range(W.shape[0]):
                packed[name].append(torch.ops.kbit.quantize(fmt.range_scaled(W[e], scale).contiguous(), codebook, self.bits))
        bytes_before = sum(w.numel() * w.element_size() for w in (w13_full, w2_full))
        dtype = w13_full.dtype
        del layer.w13_weight, layer.w2_weight, w13_full, w2_full, W
        if codebook.is_cuda:
            # Give the freed bf16 experts back before stacking: else the stacked packed weights are carved out of
            # their blocks, the next layer's bf16 experts need a new segment, and reserved memory grows each layer.
            torch.cuda.empty_cache()
        self._install(layer, packed["w13"], packed["w2"], bytes_before, dtype, scale)
