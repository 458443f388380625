"""``KbitConfig``: the vLLM ``QuantizationConfig`` registered as ``kbit`` (see :mod:`vllm_kbit.plugin`).

How vLLM reaches it:

* ``--quantization kbit`` on a bf16/fp16 checkpoint whose config.json has no
  ``quantization_config``: vLLM builds ``KbitConfig()`` (defaults: 4 bits,
  normal-float-with-zero codebook, default ``modules_to_not_convert``) and the weights are
  quantized while loading.
* ``--hf-overrides '{"quantization_config": {"quant_method": "kbit", "bits": 3, ...}}'``
  puts the settings into the model config; vLLM calls :meth:`KbitConfig.from_config`
  with them (``--quantization kbit`` is then optional). Without
  ``"prequantized": true`` the checkpoint is taken as bf16/fp16 and quantized online.
* A checkpoint written by ``vllm-kbit convert`` carries
  ``{"quant_method": "kbit", "prequantized": true, ...}`` in config.json and is
  detected with no flag.

The fields and per-module rules are documented in :mod:`vllm_kbit.settings`.

``quantize_lm_head`` (off by default) gives the model's ``ParallelLMHead`` the kbit linear method: vLLM's
LogitsProcessor computes the logits with ``lm_head.quant_method.apply`` (as for GPTQ's ``lm_head``
flag), so the head reads k-bit bytes through ``torch.ops.kbit.linear``. A head tied to the input
embedding stays bf16 with a warning (:func:`tied_word_embeddings`).

The CUDA kernels are built for Hopper (sm_90a) only: :func:`check_gpu` refuses any other GPU when
the config is created, with a one-line error naming the GPU and its compute capability.

Every layer vLLM asks about gets a kbit method or stays unquantized with a reason; the config's
:class:`~vllm_kbit.vllm.load_report.LoadReport` logs one line per loaded model (per rank) with the counts,
bits and weight sizes before / after, and each layer the format cannot hold is named in a warning.

Before loading, :meth:`KbitConfig.maybe_update_config` checks the safetensors shards of a local checkpoint
(a truncated one fails naming the file); load errors of a pre-quantized checkpoint name the tensor and
its file (:mod:`vllm_kbit.vllm.checkpoint`).
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_kbit.vllm.compat import (
    LOADS_PER_EXPERT_3D_TENSORS,
    VLLM_VERSION_TEXT,
    LinearBase,
    ParallelLMHead,
    QuantizationConfig,
    QuantizeMethodBase,
    RoutedExperts,
    UnquantizedFusedMoEMethod,
    UnquantizedLinearMethod,
    current_platform,
    get_current_vllm_config,
    init_logger,
)

from vllm_kbit import reference as fmt
from vllm_kbit.settings import QUANT_METHOD, KbitSettings
from vllm_kbit.vllm.checkpoint import CheckpointFiles
from vllm_kbit.vllm.linear_method import KbitLinearMethod, KbitOnlineLinearMethod
from vllm_kbit.vllm.load_report import EXPERTS, K_NOT_MULTIPLE, LINEAR, SKIPPED, TIED_LM_HEAD, LoadReport
from vllm_kbit.vllm.moe_method import KbitMoEMethod, KbitOnlineMoEMethod

logger = init_logger(__name__)


def check_gpu() -> None:
    """Raises a one-line ValueError on a GPU the kbit CUDA kernels cannot run on.

    The extension is compiled for sm_90a, whose code runs on compute capability 9.x only (it uses
    wgmma and thread-block clusters). vLLM refuses GPUs below :meth:`KbitConfig.get_min_capability`
    with its own message; this check names the requirement and also refuses newer architectures.
    Without a GPU (vLLM's CPU build) there is nothing to check.
    """
    if not current_platform.is_cuda_alike():
        return
    cap = current_platform.get_device_capability()
    if cap is None or (current_platform.is_cuda() and cap.major == 9):
        return
    raise ValueError(
        f"kbit: the GPU {current_platform.get_device_name()} has compute capability {cap.major}.{cap.minor}; "
        "the kbit CUDA kernels need an NVIDIA Hopper GPU (sm_90, e.g. H100 or H200)"
    )


def tied_word_embeddings() -> bool:
    """Whether the model being built ties its output head to the input embedding.

    A tied head is the embedding table itself: vLLM's model classes share that tensor (``tie_weights``,
    assigning ``lm_head.weight``, or using ``embed_tokens`` as the head) and skip the checkpoint's
    ``lm_head.*`` tensors, and the embedding lookup stays bf16. A k-bit head would be a second copy
    loaded from the embedding, which each model class ties differently; kbit leaves tied heads bf16.
    Read from the model config vLLM is building the model with (text config first, as the models do).
    """
    model_config = get_current_vllm_config().model_config
    if model_config is None:
        return False
    for cfg in (getattr(model_config, "hf_text_config", None), getattr(model_config, "hf_config", None)):
        if cfg is not None and hasattr(cfg, "tie_word_embeddings"):
            return bool(cfg.tie_word_embeddings)
    return False


class KbitConfig(QuantizationConfig):
    """k-bit (2..5) blockwise normal-float weight quantization; activations stay bf16/fp16."""

    def __init__(self, settings: KbitSettings | None = None) -> None:
        super().__init__()
        check_gpu()  # vLLM builds the config (from_config or KbitConfig()) before its capability check
        self.settings = settings if settings is not None else KbitSettings()
        self.checkpoint = CheckpointFiles()  # set by maybe_update_config; names files in load errors
        self.report = LoadReport()  # the load's summary line; per process (a pickled config starts empty)

    def __repr__(self) -> str:
        return f"KbitConfig({self.settings.to_dict()})"

    @classmethod
    def get_name(cls) -> str:
        return QUANT_METHOD

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 90  # Hopper; see check_gpu

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "KbitConfig":
        # vLLM passes only the dict, not where it came from; the message says where to look.
        try:
            settings = KbitSettings.from_dict(config)
        except ValueError as e:
            raise ValueError(f"{e} (quantization_config in the model's config.json or --hf-overrides)") from None
        return cls(settings)

    def maybe_update_config(self, model_name: str, hf_config: Any = None, revision: str | None = None,
                            **kwargs) -> None:
        """vLLM passes the model's path before loading: remember the checkpoint's files and check that every
        safetensors shard of a local checkpoint is complete (headers only)."""
        self.checkpoint = CheckpointFiles(model_name)
        self.checkpoint.check_shards()
        if self.settings.prequantized and not LOADS_PER_EXPERT_3D_TENSORS:
            self.checkpoint.check_expert_qweights_2d(VLLM_VERSION_TEXT)

    # ------------------------------------------------------------------ per-layer decisions

    def _shard_names(self, prefix: str) -> list[str]:
        """Checkpoint module names behind a vLLM layer (qkv_proj -> q_proj, k_proj, v_proj)."""
        head, _, last = prefix.rpartition(".")
        shards = self.packed_modules_mapping.get(last)
        if not shards:
            return [prefix]
        return [f"{head}.{s}" if head else s for s in shards]

    def _resolve(self, prefix: str) -> int | None:
        """Bits for the layer, or None when it stays unquantized; fused shards must agree."""
        names = self._shard_names(prefix)
        skipped = {self.settings.is_skipped(n) for n in names}
        if len(skipped) > 1:
            raise ValueError(
                f"kbit: fused layer {prefix!r} has shards {names} of which only some are in modules_to_not_convert; "
                "list all of them or none"
            )
        if skipped.pop():
            return None
        bits = {self.settings.bits_for(n) for n in names}
        if len(bits) > 1:
            raise ValueError(
                f"kbit: fused layer {prefix!r} has shards {names} with different bits {sorted(bits)} from "
                "bits_overrides; fused shards must share one bit width"
            )
        return bits.pop()

    def _lm_head_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """The kbit linear method for the output head under ``quantize_lm_head``; None keeps vLLM's bf16 head."""
        if not self.settings.quantize_lm_head:
            return None
        bits = self._resolve(prefix)
        if bits is None:
            self.report.leave(layer, LINEAR, SKIPPED)
            return None
        if tied_word_embeddings():
            logger.warning(
                "kbit: quantize_lm_head: %s is tied to the input embedding and stays bf16 "
                "(the embedding lookup reads the same tensor)",
                prefix,
            )
            self.report.leave(layer, LINEAR, TIED_LM_HEAD)
            return None
        if layer.embedding_dim % fmt.BLOCK_SIZE != 0:
            logger.warning(
                "kbit: quantize_lm_head: %s has K=%d, not a multiple of %d: left unquantized",
                prefix,
                layer.embedding_dim,
                fmt.BLOCK_SIZE,
            )
            self.report.leave(layer, LINEAR, K_NOT_MULTIPLE)
            return None
        cls = KbitLinearMethod if self.settings.prequantized else KbitOnlineLinearMethod
        self.report.plan(layer)
        return cls(prefix, bits, self.settings.codebook(bits), report=self.report, rotation=self.settings.rotation)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, ParallelLMHead):
            return self._lm_head_method(layer, prefix)
        if isinstance(layer, LinearBase):
            bits = self._resolve(prefix)
            if bits is None:
                self.report.leave(layer, LINEAR, SKIPPED)
                return UnquantizedLinearMethod()
            if layer.input_size % fmt.BLOCK_SIZE != 0:
                logger.warning(
                    "kbit: layer %s has K=%d, not a multiple of %d: left unquantized",
                    prefix,
                    layer.input_size,
                    fmt.BLOCK_SIZE,
                )
                self.report.leave(layer, LINEAR, K_NOT_MULTIPLE)
                return UnquantizedLinearMethod()
            if self.settings.prequantized:
                method = KbitLinearMethod(
                    prefix, bits, self.settings.codebook(bits), self._shard_names(prefix), self.checkpoint,
                    report=self.report, rotation=self.settings.rotation,
                )
            else:
                method = KbitOnlineLinearMethod(prefix, bits, self.settings.codebook(bits), report=self.report,
                                                rotation=self.settings.rotation)
            self.report.plan(layer)
            return method
        if isinstance(layer, RoutedExperts):
            bits = self._resolve(prefix)
            if bits is None:
                self.report.leave(layer, EXPERTS, SKIPPED)
                return UnquantizedFusedMoEMethod(layer.moe_config)
            if self.settings.prequantized:
                method = KbitMoEMethod(layer, prefix, bits, self.settings.codebook(bits), self.checkpoint,
                                       report=self.report, rotation=self.settings.rotation)
            else:
                method = KbitOnlineMoEMethod(layer, prefix, bits, self.settings.codebook(bits), report=self.report,
                                             rotation=self.settings.rotation)
            self.report.plan(layer)
            return method
        return None
