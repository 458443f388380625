"""kbit methods for vLLM's routed experts (``RoutedExperts``): packed w13/w2 per expert, run as a vLLM modular kernel.

* :class:`KbitMoEMethod` loads a pre-quantized checkpoint: per expert
  ``w13_qweight`` int32 ``[E, 2I, H/32, k]`` (gate rows, then up rows),
  ``w2_qweight`` ``[E, H, I/32, k]`` and the matching uint8 ``*_absmax``. vLLM's
  ``RoutedExperts.load_weights`` maps each checkpoint name to a parameter, expert and shard (the model's expert
  mapping) and calls that parameter's ``weight_loader``: the method's own, which checks the tensor, maps the
  global expert id to this rank's (``expert_map_manager``; other ranks' experts are skipped) and copies this
  rank's tensor-parallel slice (w1/w3 rows, w2 blocks of I/32).
* :class:`KbitOnlineMoEMethod` loads bf16/fp16 experts on the meta device;
  vLLM's layerwise loading materializes the block once all its experts arrived,
  then each expert is quantized and the bf16 block is freed. One range scale s per layer, over w13 and
  w2 of all local experts (:func:`vllm_kbit.reference.range_scale`; the fused op takes one codebook per
  layer), lets any finite weights quantize: experts are quantized as W / s and the layer's codebook is
  ``codebook * s``. NaN or Inf weights fail the load naming the layer and expert, as soon as that
  layer's weights have arrived (their values are not known earlier); structural problems (activation,
  biases, sizes not multiples of 32) are refused when the method is created, before any weight loads.

After loading, each expert is repacked to the runtime layout and the experts are stacked ``[E, ...]``; the block
is then counted in the load's summary line (:mod:`vllm_kbit.vllm.load_report`) and the method builds its modular
kernel the way vLLM's own methods do: the prepare/finalize vLLM picks for the parallel setup
(``maybe_make_prepare_finalize``: none, naive, or an all-to-all backend in the standard activation format)
around :class:`KbitExperts`, which runs ``torch.ops.kbit.fused_moe`` on the prepared activations. vLLM routes
(its router; on CPU before vLLM 0.30 the method routes itself) and calls ``apply``; vLLM's LoRA on experts
wraps the same kernel and hands the experts its adapters (``LoRAExpertsMixin``), which then run stage by stage
(:func:`vllm_kbit.moe.fused_moe_stages`) so the adapters add to gate_up before the activation and to down
before the combine. ``w13_weight`` / ``w2_weight`` name the packed tensors too, as for vLLM's GPTQ experts:
vLLM's modular method (LoRA) hands those to the kernel.

Rotated experts (``quantization_config.rotation``, docs/format.md section 9) store Q(W13 R_H) and Q(W2 R_I): the
layer holds both rotations (``kbit_w13_rot_signs`` over the hidden size, ``kbit_w2_rot_signs`` over this rank's
slice of the intermediate size, and their blocks) and the experts hand them to the op
(:class:`vllm_kbit.moe.ExpertsRotation`), which rotates the hidden states once for every expert and each slot's
SiLU-and-mul output before down. Stage by stage (LoRA), only the projections' inputs are rotated: the adapters'
deltas come from the unrotated hidden states and activations, as for an unrotated layer. Online, each expert is
rotated (float32) before it is quantized.
"""

from __future__ import annotations

import functools
import math

import torch

from vllm_kbit import reference as fmt
from vllm_kbit.moe import ExpertsRotation, fused_moe_stages, kbit_fused_moe, stack_runtime
from vllm_kbit.settings import Rotation
from vllm_kbit.vllm.checkpoint import CheckpointFiles
from vllm_kbit.vllm.compat import (
    ROUTER_RUNS_ON_CPU,
    FusedMoEActivationFormat,
    FusedMoEExpertsModular,
    FusedMoEKernel,
    FusedMoEMethodBase,
    FusedMoEQuantConfig,
    LoRAExpertsMixin,
    MoEActivation,
    TopKWeightAndReduceNoOP,
    cpu_select_experts,
    current_platform,
    initialize_online_processing,
    maybe_make_prepare_finalize,
    replace_parameter,
    set_weight_attrs,
)
from vllm_kbit.vllm.linear_method import shard_rotation
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


class KbitExperts(LoRAExpertsMixin, FusedMoEExpertsModular):
    """The kbit routed experts inside vLLM's modular kernel (standard activation format: ``[T, H]`` tokens with
    their top-k ids and weights, global ids with ``expert_map``). ``apply`` writes the finished (weighted and
    reduced) output, so the finalize step only copies or combines across ranks (``TopKWeightAndReduceNoOP``).

    ``w1`` / ``w2`` of ``apply`` are the stacked runtime qweights; the absmax codes and the codebook are the
    layer's, given here. With a LoRA context (vLLM's LoRA on experts) the experts run stage by stage and vLLM's
    punica kernels add each adapter to the gate_up output and to the down output; vLLM's CPU build has no such
    kernels, so there an adapter with expert weights is refused and the others run the fused op."""

    def __init__(self, moe_config, quant_config, w13_absmax: torch.Tensor, w2_absmax: torch.Tensor,
                 codebook: torch.Tensor, max_num_tokens: int | None = None, num_dispatchers: int | None = None,
                 rotation: ExpertsRotation | None = None):
        super().__init__(moe_config=moe_config, quant_config=quant_config, max_num_tokens=max_num_tokens,
                         num_dispatchers=num_dispatchers)
        self.w13_absmax, self.w2_absmax, self.codebook = w13_absmax, w2_absmax, codebook
        self.rotation = rotation
        self.intermediate_size = moe_config.intermediate_size_per_partition

    @staticmethod
    def activation_format() -> FusedMoEActivationFormat:
        return FusedMoEActivationFormat.Standard

    @staticmethod
    def _supports_current_device() -> bool:
        return current_platform.is_cpu() or current_platform.is_cuda()

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_quant_scheme(weight_key, activation_key) -> bool:
        return activation_key is None  # bf16/fp16 activations; the weight format is kbit's own

    @staticmethod
    def _supports_activation(activation) -> bool:
        return activation == MoEActivation.SILU

    @staticmethod
    def _supports_parallel_config(moe_parallel_config) -> bool:
        return True  # any prepare/finalize in the standard format (KbitMoEMethod checks what vLLM picked)

    def moe_problem_size(self, a1, w1, w2, topk_ids):
        return w1.shape[0], a1.shape[0], 2 * self.intermediate_size, a1.shape[-1], topk_ids.shape[1]

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta, activation):
        return (0,), (0,), (M, K)  # the kbit op allocates its own intermediates

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceNoOP()

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts, expert_map,
              a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta, apply_router_weight_on_input):
        if apply_router_weight_on_input:
            # The prepare step scaled the input by the router weights already (vLLM's contract, top-k 1).
            topk_weights = torch.ones_like(topk_weights)
        args = (hidden_states, topk_ids, topk_weights, w1, self.w13_absmax, w2, self.w2_absmax, self.codebook,
                self.intermediate_size, expert_map)
        ctx = self._lora_context
        if ctx is None or not self._experts_have_lora(ctx):
            output.copy_(kbit_fused_moe(*args, False, self.rotation))
            return None
        hooks = self._lora_hooks(ctx, hidden_states, topk_ids, topk_weights, expert_map)
        output.copy_(fused_moe_stages(*args, *hooks, rotation=self.rotation))
        return None

    def _experts_have_lora(self, ctx) -> bool:
        """Whether the LoRA context's adapters can touch these experts. On a GPU always (the adapters live on the
        device; CUDA graphs capture the LoRA path once). On CPU, vLLM has no MoE LoRA kernels: adapters with expert
        weights are refused; without any, the fused op runs (the adapters add nothing to the experts)."""
        if not current_platform.is_cpu():
            return True
        if any(bool(t.any()) for t in (*ctx.w13_lora_b_stacked, *ctx.w2_lora_b_stacked)):
            raise NotImplementedError(
                "kbit: a LoRA adapter with routed-expert weights needs vLLM's GPU MoE LoRA kernels; vLLM's CPU build has "
                "none (adapters on attention and dense layers work on CPU)")
        return False

    def _lora_hooks(self, ctx, hidden_states, topk_ids, topk_weights, expert_map):
        """(after_gate_up, after_down) for fused_moe_stages: vLLM's LoRA helpers add the adapters' deltas in place,
        as vLLM's Marlin experts do around their activation and their sum."""
        T, top_k = topk_ids.shape
        H, I, E = hidden_states.shape[-1], self.intermediate_size, self.w13_absmax.shape[0]
        # The LoRA helpers read only the shapes of w1 / w2 (their kernels' tuned-config lookup): the dense shapes.
        w1 = torch.empty(E, 2 * I, H, device="meta", dtype=hidden_states.dtype)
        w2 = torch.empty(E, H, I, device="meta", dtype=hidden_states.dtype)
        x = ctx.original_hidden_states if getattr(ctx, "original_hidden_states", None) is not None else hidden_states
        state = {}

        def after_gate_up(h13):
            state["w13"] = self.apply_w13_lora(ctx, y=h13, x=x, topk_ids=topk_ids, topk_weights=topk_weights,
                                               expert_map=expert_map, w1=w1, w2=w2, num_tokens=T, top_k_num=top_k)

        def after_down(y, act):
            sorted_ids, expert_ids, num_post_padded, token_lora_mapping = state["w13"]
            self.apply_w2_lora(ctx, y=y, x=act, topk_weights=topk_weights, sorted_token_ids_lora=sorted_ids,
                               expert_ids_lora=expert_ids, num_tokens_post_padded_lora=num_post_padded,
                               token_lora_mapping=token_lora_mapping, num_tokens=T, w1=w1, w2=w2, top_k_num=top_k)

        return after_gate_up, after_down


def _late_tensor_loader(layer: torch.nn.Module, prefix: str, param, loaded_weight, weight_name, shard_id, expert_id,
                        return_success=False):
    """The loader of an online layer's packed experts: a checkpoint tensor arriving after the layer was quantized.
    Under expert parallelism vLLM's layerwise loader quantizes a layer once this rank's experts are in, and the
    checkpoint's later tensors are other ranks' experts: skipped. One of this rank's would be a checkpoint with an
    expert twice."""
    if layer.expert_map_manager.map_global_to_local(expert_id) < 0:
        return False if return_success else None
    raise ValueError(f"kbit: MoE layer {prefix!r}: checkpoint tensor {weight_name} of expert {expert_id} arrived after "
                     "the layer's experts were loaded and quantized (an expert twice in the checkpoint?)")


class _KbitMoEBase(FusedMoEMethodBase):
    def __init__(self, layer: torch.nn.Module, prefix: str, bits: int, codebook: torch.Tensor,
                 report: LoadReport | None = None, rotation: Rotation | None = None):
        super().__init__(layer.moe_config)
        check_moe_layer(layer, prefix)
        self.prefix = prefix
        self.bits = bits
        self.codebook = codebook
        self.report = report if report is not None else LoadReport()
        # Rotated experts: (signs, block) of gate_up's input (the hidden size, never sharded) and of down's (this
        # rank's slice of the intermediate size, as the loader slices w2), checked against the shard now.
        self.rotations = None
        if rotation is not None:
            moe = layer.moe_config
            H, I, Ip = moe.hidden_dim, moe.intermediate_size, moe.intermediate_size_per_partition
            rank = moe.tp_rank if Ip != I else 0
            self.rotations = (shard_rotation(rotation, prefix, "experts' gate_up input", H, H, 0),
                              shard_rotation(rotation, prefix, "experts' down input", I, Ip, rank))

    # ------------------------------------------------------------------ the modular kernel

    def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> FusedMoEQuantConfig:
        # Activations stay bf16/fp16 (no activation quantization in prepare); the experts hold the weight format.
        return FusedMoEQuantConfig.make()

    def _experts(self, layer: torch.nn.Module, prepare_finalize) -> KbitExperts:
        if prepare_finalize.activation_format != FusedMoEActivationFormat.Standard:
            backend = getattr(self.moe.moe_parallel_config, "all2all_backend", "?")
            raise ValueError(
                f"kbit: MoE layer {self.prefix!r}: vLLM's all-to-all backend {backend!r} "
                f"({type(prepare_finalize).__name__}) hands experts batched activations; the kbit experts take the "
                "standard format (e.g. --all2all-backend allgather_reducescatter or deepep_high_throughput)")
        return KbitExperts(self.moe, self.moe_quant_config, layer.w13_absmax, layer.w2_absmax, layer.kbit_codebook,
                           rotation=self._experts_rotation(layer))

    def _experts_rotation(self, layer: torch.nn.Module) -> ExpertsRotation | None:
        if self.rotations is None:
            return None
        (_, b13), (_, b2) = self.rotations
        return ExpertsRotation(layer.kbit_w13_rot_signs, b13, layer.kbit_w2_rot_signs, b2)

    def _rotated(self, which: int, W: torch.Tensor) -> torch.Tensor:
        """One expert's weight as quantized: W R (float32) for rotated experts (which: 0 gate_up, 1 down), else W."""
        if self.rotations is None:
            return W
        signs, block = self.rotations[which]
        return torch.ops.kbit.hadamard_rotate(W.float(), signs.to(W.device), block)

    def select_gemm_impl(self, prepare_finalize, layer: torch.nn.Module) -> KbitExperts:
        """The experts for a prepare/finalize vLLM picked (vLLM up to 0.27 asks this where a method holds no kernel)."""
        if self.moe_quant_config is None:
            self.moe_quant_config = self.get_fused_moe_quant_config(layer)
        return self._experts(layer, prepare_finalize)

    def _init_kernel(self, layer: torch.nn.Module) -> None:
        """The modular kernel, as vLLM's own methods build it once their weights are final: the prepare/finalize for
        this parallel setup (no all-to-all: vLLM's naive one) around the kbit experts."""
        self.moe_quant_config = self.get_fused_moe_quant_config(layer)
        prepare_finalize = maybe_make_prepare_finalize(moe=self.moe, quant_config=self.moe_quant_config,
                                                       routing_tables=None, allow_new_interface=True,
                                                       use_monolithic=False)
        self.moe_kernel = FusedMoEKernel(prepare_finalize, self._experts(layer, prepare_finalize))

    def _install(self, layer: torch.nn.Module, w13: list, w2: list, bytes_before: int, dtype: torch.dtype,
                 range_scale: float = 1.0) -> None:
        """Per-expert flat (qweight, absmax) -> stacked runtime parameters on the layer; ``bytes_before``: the
        experts' size unquantized (in ``dtype``), for the load's summary; ``range_scale``: the power of two the
        experts were divided by, folded into the layer's codebook. Then the modular kernel."""
        w13_q, w13_a = stack_runtime(w13)
        w2_q, w2_a = stack_runtime(w2)
        for name, tensor in (("w13_qweight", w13_q), ("w13_absmax", w13_a), ("w2_qweight", w2_q), ("w2_absmax", w2_a)):
            replace_parameter(layer, name, tensor)
        # vLLM's modular method (under LoRA) hands the kernel layer.w13_weight / w2_weight: the packed experts.
        layer.register_parameter("w13_weight", layer.w13_qweight)
        layer.register_parameter("w2_weight", layer.w2_qweight)
        layer.register_buffer("kbit_codebook", self.codebook.to(w13_q.device) * range_scale, persistent=False)
        if self.rotations is not None:
            for name, (signs, _) in zip(("kbit_w13_rot_signs", "kbit_w2_rot_signs"), self.rotations):
                layer.register_buffer(name, signs.to(w13_q.device), persistent=False)
        self.report.finish(layer, EXPERTS, self.bits, bytes_before, dtype, [w13_q, w13_a, w2_q, w2_a],
                           range_scaled=self.prefix if range_scale != 1.0 else None)
        self._init_kernel(layer)

    @staticmethod
    def _processed(layer: torch.nn.Module) -> bool:
        """The layer holds its packed experts (vLLM may ask a layer the layerwise loader processed once more)."""
        return getattr(layer, "kbit_codebook", None) is not None

    # ------------------------------------------------------------------ forward

    @property
    def is_monolithic(self) -> bool:
        # Where vLLM's router cannot run on CPU (before 0.30), route here with vLLM's CPU routing, as its own CPU
        # MoE does there; everywhere else vLLM routes and calls apply.
        return current_platform.is_cpu() and not ROUTER_RUNS_ON_CPU

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
        return kbit_fused_moe(x, topk_ids, topk_weights, layer.w13_qweight, layer.w13_absmax, layer.w2_qweight,
                              layer.w2_absmax, layer.kbit_codebook, layer.intermediate_size_per_partition,
                              layer.expert_map, layer.apply_router_weight_on_input, self._experts_rotation(layer))

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input) -> torch.Tensor:
        return self.moe_kernel.apply(
            hidden_states=x,
            w1=layer.w13_qweight,
            w2=layer.w2_qweight,
            topk_weights=topk_weights,
            topk_ids=topk_ids,
            activation=layer.activation,
            global_num_experts=layer.global_num_experts,
            expert_map=layer.expert_map,
            apply_router_weight_on_input=layer.apply_router_weight_on_input,
            shared_experts=shared_experts,
            shared_experts_input=shared_experts_input,
        )


class KbitMoEMethod(_KbitMoEBase):
    """Pre-quantized kbit experts; ``checkpoint`` names the files of tensors in load errors."""

    def __init__(self, layer: torch.nn.Module, prefix: str, bits: int, codebook: torch.Tensor,
                 checkpoint: CheckpointFiles | None = None, report: LoadReport | None = None,
                 rotation: Rotation | None = None):
        super().__init__(layer, prefix, bits, codebook, report, rotation)
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
        shapes = {
            "w13_qweight": ((num_experts, 2 * I, H // 32, k), torch.int32),
            "w13_absmax": ((num_experts, 2 * I, H // 32), torch.uint8),
            "w2_qweight": ((num_experts, H, I // 32, k), torch.int32),
            "w2_absmax": ((num_experts, H, I // 32), torch.uint8),
        }
        layer.kbit_loaded = {name: set() for name in shapes}
        layer.kbit_dense_dtype = params_dtype  # what the experts would be unquantized, for the load's summary
        for name, (shape, dtype) in shapes.items():
            param = torch.nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(param, {**extra_weight_attrs, "weight_loader": functools.partial(self._load, layer, name)})

    def _load(self, layer, name, param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
        """One expert's checkpoint tensor (``RoutedExperts.load_weights`` calls this with vLLM's expert mapping):
        checked, then this rank's slice copied into its local expert. Routed-expert qweights come 2-D,
        ``[N, K/32 * k]`` (``vllm-kbit convert``), or 3-D, ``[N, K/32, k]`` (older conversions; vLLM >= 0.32)."""
        local = layer.expert_map_manager.map_global_to_local(expert_id)
        if local < 0:  # another rank's expert
            return False if return_success else None
        moe = layer.moe_config
        K = moe.hidden_dim if name.startswith("w13") else moe.intermediate_size
        KB, k = K // fmt.BLOCK_SIZE, self.bits
        is_q = name.endswith("qweight")
        w = loaded_weight
        if is_q and w.dtype == torch.int32 and w.dim() == 2 and w.shape[1] == KB * k:
            w = w.view(w.shape[0], KB, k)
        tensor = functools.partial(self._tensor_name, layer, expert_id, shard_id, name.split("_", 1)[1])
        if w.dtype != (torch.int32 if is_q else torch.uint8) or w.dim() != (3 if is_q else 2) or w.shape[1] != KB or (
                is_q and w.shape[2] != k):
            want = f"int32 [N, {KB * k}] (or [N, {KB}, {k}])" if is_q else f"uint8 [N, {KB}]"
            raise ValueError(
                f"kbit: checkpoint tensor {self.checkpoint.where(tensor())} is {loaded_weight.dtype} "
                f"{list(loaded_weight.shape)}, expected {want} for {k}-bit experts with K={K}: corrupted or mismatched "
                "checkpoint")
        # Tensor parallel: w1 / w3 rows and w2's blocks of I/32 are split between the ranks, as for bf16 experts.
        Ip, rank = moe.intermediate_size_per_partition, moe.tp_rank
        N = moe.hidden_dim if shard_id == "w2" else moe.intermediate_size
        if shard_id == "w2":
            src, dst = w.narrow(1, rank * Ip // fmt.BLOCK_SIZE, Ip // fmt.BLOCK_SIZE), param.data[local]
        else:
            src = w.narrow(0, rank * Ip, Ip) if w.shape[0] == N else w
            dst = param.data[local].narrow(0, 0 if shard_id == "w1" else Ip, Ip)
        if w.shape[0] != N or src.shape != dst.shape:
            raise ValueError(
                f"kbit: checkpoint tensor {self.checkpoint.where(tensor())} of shape {list(loaded_weight.shape)} does "
                f"not fit {name} of expert {expert_id} (rank slice {list(src.shape)}, parameter {list(dst.shape)}): "
                "corrupted or mismatched checkpoint")
        dst.copy_(src)
        layer.kbit_loaded[name].add((expert_id, shard_id))
        return True if return_success else None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if self._processed(layer):
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
        w13 = [(layer.w13_qweight.data[e], layer.w13_absmax.data[e]) for e in range(E)]
        w2 = [(layer.w2_qweight.data[e], layer.w2_absmax.data[e]) for e in range(E)]
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

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if self._processed(layer):
            return
        w13_full, w2_full = layer.w13_weight.data, layer.w2_weight.data
        if w13_full.device.type == "meta" or w2_full.device.type == "meta":
            raise ValueError(f"kbit: checkpoint has no expert weights for MoE layer {self.prefix!r}")
        codebook = self.codebook.to(w13_full.device)
        amax = []
        for which, (name, W) in enumerate((("w13", w13_full), ("w2", w2_full))):
            amax.append(fmt.weight_amax(W))
            if math.isfinite(amax[-1]) and self.rotations is not None:
                # Rotated experts: the range of W R (each expert rotated here and again when quantized: one at a time).
                amax[-1] = max(fmt.weight_amax(self._rotated(which, W[e])) for e in range(W.shape[0]))
            if not math.isfinite(amax[-1]):
                # Routed experts have no bf16 fallback here: refuse, naming the first expert with NaN or Inf.
                e = next(e for e in range(W.shape[0]) if not torch.isfinite(W[e]).all())
                raise ValueError(
                    f"kbit: MoE layer {self.prefix!r} expert {e} {name}: weight has NaN or Inf values; "
                    "cannot quantize; add the layer to modules_to_not_convert to keep it in bf16"
                )
        scale = fmt.range_scale(max(amax))  # one per layer: the fused op takes one codebook for w13 and w2
        packed = {"w13": [], "w2": []}
        for which, (name, W) in enumerate((("w13", w13_full), ("w2", w2_full))):
            for e in range(W.shape[0]):
                We = fmt.range_scaled(self._rotated(which, W[e]), scale).contiguous()
                packed[name].append(torch.ops.kbit.quantize(We, codebook, self.bits))
        bytes_before = sum(w.numel() * w.element_size() for w in (w13_full, w2_full))
        dtype = w13_full.dtype
        del layer.w13_weight, layer.w2_weight, w13_full, w2_full, W
        if codebook.is_cuda:
            # Give the freed bf16 experts back before stacking: else the stacked packed weights are carved out of
            # their blocks, the next layer's bf16 experts need a new segment, and reserved memory grows each layer.
            torch.cuda.empty_cache()
        self._install(layer, packed["w13"], packed["w2"], bytes_before, dtype, scale)
        # Tensors that arrive now are other ranks' experts (expert parallel): the packed parameters skip them.
        for name in ("w13_qweight", "w2_qweight", "w13_absmax", "w2_absmax"):
            set_weight_attrs(getattr(layer, name), {"weight_loader": functools.partial(_late_tensor_loader, layer, self.prefix)})
