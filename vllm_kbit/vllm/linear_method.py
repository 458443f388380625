"""kbit linear methods for every vLLM ``LinearBase`` (column, row, merged column, QKV, replicated) and for
``ParallelLMHead`` (``quantize_lm_head``: vLLM's LogitsProcessor calls ``quant_method.apply`` on the head,
whose vocab-parallel loader shards N like a column-parallel layer's).

* :class:`KbitLinearMethod` loads a pre-quantized checkpoint: ``qweight`` int32
  ``[N, K/32, k]`` and ``absmax`` uint8 ``[N, K/32]`` as vLLM ``ModelWeightParameter``
  (output_dim 0, input_dim 1), so vLLM's loaders shard them along N (column / fused
  QKV / gate_up) and along K/32 (row parallel) exactly like a bf16 weight.
* :class:`KbitOnlineLinearMethod` loads a bf16/fp16 checkpoint: the weight lives
  on the meta device and vLLM's layerwise loading materializes it only once the
  whole layer has arrived; ``process_weights_after_loading`` quantizes it and
  frees the bf16 copy, so peak memory is the packed model plus one layer in bf16. A layer whose
  max |w| is outside the E4M4 block scale's comfortable range is quantized as W / s with the codebook
  times s (:func:`vllm_kbit.reference.range_scale`, a power of two: exact, no kernel change); only
  NaN or Inf weights leave their layer in bf16, with a warning naming it.

Both end the same way: the flat tensors are repacked once to the runtime layout
and ``apply`` calls ``torch.ops.kbit.linear`` (+ bias); the layer is then counted in the load's summary
line (:mod:`vllm_kbit.vllm.load_report`).

Rotated layers (``quantization_config.rotation``, docs/format.md section 9) store Q(W R): the layer holds its
input rotation (``kbit_rot_signs``, a float32 buffer of this rank's K inputs, and ``kbit_rot_block``) and ``apply``
hands it to the op, which feeds x R to the GEMM. A row-parallel layer's rank holds inputs
[rank * K/tp, (rank + 1) * K/tp): its signs are that slice of the full K's, and the block must divide the shard
(:func:`layer_rotation`). Online, the weight is rotated (float32) before it is quantized. vLLM's LoRA wrappers add
their x A B to the base layer's output from the unrotated x, so rotating inside ``apply`` keeps them right.
"""

from __future__ import annotations

import functools

import torch

from vllm_kbit import reference as fmt
from vllm_kbit import ops  # noqa: F401  (registers torch.ops.kbit)
from vllm_kbit.settings import Rotation
from vllm_kbit.vllm.checkpoint import CheckpointFiles
from vllm_kbit.vllm.compat import (
    LinearMethodBase,
    ModelWeightParameter,
    UnquantizedLinearMethod,
    init_logger,
    initialize_online_processing,
    register_weight_loader_v2_supported_method,
    replace_parameter,
)
from vllm_kbit.vllm.load_report import LINEAR, NOT_REPRESENTABLE, LoadReport

logger = init_logger(__name__)


def shard_rotation(rotation: Rotation, prefix: str, what: str, K: int, K_shard: int, rank: int) -> tuple:
    """(signs [K_shard] float32 on the CPU, block) of a rotated input of K inputs of which this rank holds
    [rank * K_shard, (rank + 1) * K_shard): the slice of the full K's signs, and the block of K, which must divide
    the shard (the recorded ``tp`` covers this tensor-parallel size); else a one-line ValueError."""
    block = rotation.block(K)
    if K_shard % block:
        raise ValueError(
            f"kbit: layer {prefix!r} ({what}) is rotated in blocks of {block} over its {K} inputs, which do not "
            f"divide this rank's {K_shard} inputs at tensor parallel {K // K_shard}; the rotation was made for tensor "
            f"parallel {rotation.tp} (supported: sizes dividing it); convert with --rotation-tp {K // K_shard} "
            f"(online: rotation {{\"tp\": {K // K_shard}}}) or serve at tensor parallel {rotation.tp}")
    return rotation.signs(K)[rank * K_shard : (rank + 1) * K_shard].contiguous(), block


def layer_rotation(layer: torch.nn.Module, rotation: Rotation, prefix: str, input_size_per_partition: int,
                   input_size: int) -> None:
    """A rotated linear layer's input rotation, kept on the layer (kbit_rot_signs is registered on the weights'
    device with them: install_runtime_weights)."""
    rank = 0
    if input_size_per_partition != input_size:  # row parallel: vLLM's LinearBase names the layer's rank
        rank = getattr(layer, "tp_rank", None)
        if rank is None:
            raise ValueError(f"kbit: layer {prefix!r} shards its {input_size} inputs but has no tp_rank; a rotated "
                             "layer needs its tensor-parallel rank to slice the rotation's signs")
    layer.kbit_rotation = shard_rotation(rotation, prefix, "input", input_size, input_size_per_partition, rank)


def install_runtime_weights(
    layer: torch.nn.Module, prefix: str, qweight: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor
) -> None:
    """Flat (qweight, absmax) of shape [N, K] -> runtime layout on the layer as ``qweight``/``absmax``; a rotated
    layer's signs go to the same device (``kbit_rot_signs``)."""
    N, KB, k = qweight.shape
    if k != layer.kbit_bits:
        raise ValueError(f"kbit: layer {prefix!r} has {k}-bit qweight but its config says {layer.kbit_bits} bits")
    qweight_rt, absmax_rt = torch.ops.kbit.repack(qweight.contiguous(), absmax.contiguous())
    replace_parameter(layer, "qweight", qweight_rt)
    replace_parameter(layer, "absmax", absmax_rt)
    layer.register_buffer("kbit_codebook", codebook.to(qweight_rt.device), persistent=False)
    layer.kbit_shape = (N, KB * fmt.BLOCK_SIZE)
    if getattr(layer, "kbit_rotation", None) is not None:
        signs, layer.kbit_rot_block = layer.kbit_rotation
        layer.register_buffer("kbit_rot_signs", signs.to(qweight_rt.device), persistent=False)


def _expected_shards(layer: torch.nn.Module) -> set:
    """Shard ids the model's loader passes for a complete weight of this layer."""
    if hasattr(layer, "total_num_kv_heads"):  # QKVParallelLinear
        return {"q", "k", "v"}
    if hasattr(layer, "output_sizes") and len(layer.output_sizes) > 1:  # MergedColumnParallelLinear
        return set(range(len(layer.output_sizes)))
    return {None}


class _KbitLinearBase(LinearMethodBase):
    def __init__(self, prefix: str, bits: int, codebook: torch.Tensor, report: LoadReport | None = None,
                 rotation: Rotation | None = None):
        self.prefix = prefix
        self.bits = bits
        self.codebook = codebook
        self.report = report if report is not None else LoadReport()
        self.rotation = rotation

    def _report(self, layer: torch.nn.Module, bytes_before: int, dtype: torch.dtype, range_scale: float = 1.0) -> None:
        self.report.finish(layer, LINEAR, self.bits, bytes_before, dtype, [layer.qweight, layer.absmax],
                           range_scaled=self.prefix if range_scale != 1.0 else None)

    def _check_partition(self, layer: torch.nn.Module, input_size_per_partition: int, input_size: int) -> None:
        if input_size_per_partition % fmt.BLOCK_SIZE != 0:
            raise ValueError(
                f"kbit: layer {self.prefix!r} has {input_size_per_partition} input features per tensor-parallel "
                f"rank (K={input_size}), not a multiple of {fmt.BLOCK_SIZE}; use a smaller tensor-parallel size "
                "or add the layer to modules_to_not_convert"
            )
        layer.kbit_bits = self.bits
        # The full K (LinearBase has it as input_size; ParallelLMHead, as embedding_dim, is sharded along N only).
        layer.kbit_input_size = input_size
        layer.kbit_rotation = None
        if self.rotation is not None:
            layer_rotation(layer, self.rotation, self.prefix, input_size_per_partition, input_size)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        N, K = layer.kbit_shape
        if layer.kbit_rotation is None:
            return torch.ops.kbit.linear(x, layer.qweight, layer.absmax, layer.kbit_codebook, N, K, bias)
        return torch.ops.kbit.linear(x, layer.qweight, layer.absmax, layer.kbit_codebook, N, K, bias,
                                     rot_signs=layer.kbit_rot_signs, rot_block=layer.kbit_rot_block)


@register_weight_loader_v2_supported_method
class KbitLinearMethod(_KbitLinearBase):
    """Pre-quantized kbit checkpoint: packed parameters, repacked to the runtime layout after loading.

    ``shard_names``: the checkpoint modules behind the layer (q_proj, k_proj, v_proj for qkv_proj), in the
    order of vLLM's shard ids; with ``checkpoint`` they name the tensor and its file in load errors."""

    def __init__(self, prefix: str, bits: int, codebook: torch.Tensor, shard_names: list[str] | None = None,
                 checkpoint: CheckpointFiles | None = None, report: LoadReport | None = None,
                 rotation: Rotation | None = None):
        super().__init__(prefix, bits, codebook, report, rotation)
        self.shard_names = shard_names or [prefix]
        self.checkpoint = checkpoint or CheckpointFiles()

    def _tensor_name(self, name: str, shard_id) -> str:
        """The checkpoint name of the tensor behind vLLM's (layer, shard id)."""
        if isinstance(shard_id, str) and shard_id in ("q", "k", "v") and len(self.shard_names) == 3:
            shard_id = "qkv".index(shard_id)
        if isinstance(shard_id, int) and 0 <= shard_id < len(self.shard_names):
            return f"{self.shard_names[shard_id]}.{name}"
        return f"{self.prefix}.{name}"

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ):
        self._check_partition(layer, input_size_per_partition, input_size)
        N = sum(output_partition_sizes)
        KB = input_size_per_partition // fmt.BLOCK_SIZE
        loader = extra_weight_attrs["weight_loader"]
        layer.kbit_loaded_shards = {"qweight": set(), "absmax": set()}
        qweight = ModelWeightParameter(
            data=torch.empty(N, KB, self.bits, dtype=torch.int32),
            input_dim=1,
            output_dim=0,
            weight_loader=functools.partial(self._load, layer, "qweight", loader),
        )
        absmax = ModelWeightParameter(
            data=torch.empty(N, KB, dtype=torch.uint8),
            input_dim=1,
            output_dim=0,
            weight_loader=functools.partial(self._load, layer, "absmax", loader),
        )
        layer.register_parameter("qweight", qweight)
        layer.register_parameter("absmax", absmax)
        layer.kbit_dense_dtype = params_dtype  # what the weight would be unquantized, for the load's summary

    def _load(self, layer, name, loader, param, loaded_weight, loaded_shard_id=None, *args, **kwargs):
        """Checks a checkpoint tensor before vLLM's (sharding) loader copies it in."""
        want_dtype, want_dim = (torch.int32, 3) if name == "qweight" else (torch.uint8, 2)
        KB = layer.kbit_input_size // fmt.BLOCK_SIZE
        if (
            loaded_weight.dtype != want_dtype
            or loaded_weight.dim() != want_dim
            or loaded_weight.shape[1] != KB
            or (name == "qweight" and loaded_weight.shape[2] != self.bits)
        ):
            want = f"[N, {KB}, {self.bits}]" if name == "qweight" else f"[N, {KB}]"
            raise ValueError(
                f"kbit: checkpoint tensor {self.checkpoint.where(self._tensor_name(name, loaded_shard_id))} is "
                f"{loaded_weight.dtype} {list(loaded_weight.shape)}, expected {want_dtype} {want} "
                f"for a {self.bits}-bit layer with K={layer.kbit_input_size}: corrupted or mismatched checkpoint"
            )
        try:
            loader(param, loaded_weight, loaded_shard_id, *args, **kwargs) if loaded_shard_id is not None else loader(
                param, loaded_weight
            )
        except AssertionError:
            raise ValueError(
                f"kbit: checkpoint tensor {self.checkpoint.where(self._tensor_name(name, loaded_shard_id))} of shape "
                f"{list(loaded_weight.shape)} does not fit the layer's parameter {list(param.shape)}: "
                "corrupted or mismatched checkpoint"
            ) from None
        layer.kbit_loaded_shards[name].add(loaded_shard_id)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if getattr(layer, "kbit_codebook", None) is not None:  # processed (vLLM may ask once more)
            return
        expected = _expected_shards(layer)
        for name, loaded in layer.kbit_loaded_shards.items():
            if None not in loaded and not expected <= loaded:
                missing = [self._tensor_name(name, s) for s in sorted(expected - loaded, key=str)]
                # The missing tensor is in no file; the file of its layer's other tensor says where it belongs.
                sibling = missing[0].removesuffix(name) + ("absmax" if name == "qweight" else "qweight")
                file = self.checkpoint.file_of(sibling)
                beside = f"; {sibling} is in {file}" if file else ""
                raise ValueError(
                    f"kbit: checkpoint has no {', '.join(missing)} (layer {self.prefix!r}{beside}); "
                    "the pre-quantized checkpoint is incomplete"
                )
        N, KB = layer.absmax.shape
        install_runtime_weights(layer, self.prefix, layer.qweight.data, layer.absmax.data, self.codebook)
        del layer.kbit_loaded_shards
        dtype = layer.kbit_dense_dtype
        self._report(layer, N * KB * fmt.BLOCK_SIZE * dtype.itemsize, dtype)


@register_weight_loader_v2_supported_method
class KbitOnlineLinearMethod(_KbitLinearBase):
    """bf16/fp16 checkpoint quantized while loading (vLLM's layerwise online processing).

    A layer whose weights the format cannot hold (NaN or Inf, known only once they are loaded) keeps them in bf16:
    this method then runs vLLM's unquantized linear method on them (``self.unquantized``), so the layer's
    ``quant_method`` stays what vLLM and its wrappers (LoRA) were given."""

    uses_meta_device: bool = True

    def __init__(self, prefix: str, bits: int, codebook: torch.Tensor, report: LoadReport | None = None,
                 rotation: Rotation | None = None):
        super().__init__(prefix, bits, codebook, report, rotation)
        self.unquantized: UnquantizedLinearMethod | None = None

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ):
        self._check_partition(layer, input_size_per_partition, input_size)
        weight = ModelWeightParameter(
            data=torch.empty(sum(output_partition_sizes), input_size_per_partition, device="meta", dtype=params_dtype),
            input_dim=1,
            output_dim=0,
            weight_loader=extra_weight_attrs["weight_loader"],
        )
        layer.register_parameter("weight", weight)
        initialize_online_processing(layer)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # Processed already (vLLM may ask a layer its layerwise loader processed once more).
        if self.unquantized is not None or getattr(layer, "kbit_codebook", None) is not None:
            return
        W = layer.weight.data
        if W.device.type == "meta":
            raise ValueError(f"kbit: checkpoint has no weight for layer {self.prefix!r}")
        bytes_before, dtype = W.numel() * W.element_size(), W.dtype
        Wq = W  # what is quantized: W, or W R in float32 for a rotated layer
        if layer.kbit_rotation is not None:
            signs, block = layer.kbit_rotation
            Wq = torch.ops.kbit.hadamard_rotate(W.float(), signs.to(W.device), block)
        try:
            scale = fmt.weight_range_scale(Wq)
        except ValueError as e:
            # One layer the format cannot hold does not stop the server: it stays in bf16, like K % 32 layers.
            logger.warning("kbit: layer %s left unquantized: %s", self.prefix, str(e).removeprefix("kbit: "))
            layer.kbit_rotation = None  # a bf16 layer takes x as it is
            self.unquantized = UnquantizedLinearMethod()
            self.unquantized.process_weights_after_loading(layer)
            self.report.finish_unquantized(layer, LINEAR, NOT_REPRESENTABLE)
            return
        codebook = self.codebook.to(W.device)
        qweight, absmax = torch.ops.kbit.quantize(fmt.range_scaled(Wq, scale).contiguous(), codebook, self.bits)
        del layer.weight, W, Wq
        install_runtime_weights(layer, self.prefix, qweight, absmax, codebook * scale)
        self._report(layer, bytes_before, dtype, range_scale=scale)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.unquantized is not None:
            return self.unquantized.apply(layer, x, bias)
        return super().apply(layer, x, bias)
