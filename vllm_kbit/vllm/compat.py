"""The vLLM API this package uses, for every supported vLLM release (0.26 through 0.33).

Every other module of ``vllm_kbit`` imports vLLM through this one, so a vLLM release that moves or
renames something is handled here, in one place. What differs between the supported releases:

* CPU expert routing (``select_experts``, used by the kbit MoE method on vLLM's CPU build) moved twice:
  ``fused_moe.cpu_fused_moe`` (0.26, 0.27), ``fused_moe.experts.cpu_moe`` (0.28, 0.29),
  ``fused_moe.router.cpu_router`` (0.30 and later), with the same arguments everywhere.
* ``fused_moe.FusedMoE`` is ``FusedMoEFactory`` from 0.27; the routed experts' layer class,
  ``RoutedExperts``, which the kbit config matches, is the same in every release.
* ``RoutedExperts`` passes ``intermediate_size_full`` to ``create_weights`` of a few GPTQ-style methods
  up to 0.29 and not at all from 0.30; the kbit methods never take it (it would arrive in
  ``**extra_weight_attrs``).
* ``QuantizationConfig.is_mxfp4_quant`` is gone from 0.28 and ``FusedMoEMethodBase``'s
  ``maybe_make_prepare_finalize`` / ``select_gemm_impl`` hooks from 0.28 (vLLM's LoRA on experts calls
  ``select_gemm_impl`` up to 0.27 when a method holds no kernel; the kbit methods hold one, and answer it too).
  The kbit methods keep the base class's defaults for the attributes later releases added
  (``supports_pre_processed_weights``, ``requires_device_loading``).
* The routed-expert modular kernel is the same in every supported release: ``FusedMoEExpertsModular`` (with
  ``LoRAExpertsMixin``, whose ``_lora_context`` vLLM's LoRA sets), ``FusedMoEKernel(prepare_finalize, experts)``
  and ``all2all_utils.maybe_make_prepare_finalize``, which picks the prepare/finalize for the parallel setup.
* vLLM's MoE router computes top-k on CPU from 0.30 (``CPURouter``, :data:`ROUTER_RUNS_ON_CPU`); before, the
  kbit MoE method routes on CPU itself with :func:`cpu_select_experts`.
* ``RoutedExperts.load_weights`` takes a 3-D checkpoint tensor named for one expert
  (``experts.5.up_proj.qweight``, ``[N, K/32, k]``) as that expert's from 0.32
  (:data:`LOADS_PER_EXPERT_3D_TENSORS`); up to 0.31 it takes every 3-D tensor for a stack of all experts. So
  ``vllm-kbit convert`` writes routed experts' qweights 2-D (``[N, K/32 * k]``, the same words), which every
  release hands to the parameter's loader as one expert's; the 3-D ones of older conversions load from 0.32
  (:mod:`vllm_kbit.vllm.checkpoint` refuses them earlier, naming ``vllm-kbit upgrade``).

The kbit MoE methods load through what ``RoutedExperts`` offers every quantization method in every release:
its ``load_weights`` maps each checkpoint name to a parameter, expert and shard with the model's expert mapping
and calls that parameter's ``weight_loader`` attribute, which is the kbit method's own (tensor-parallel slices,
and expert-parallel ids through the layer's ``expert_map_manager.map_global_to_local``).

Everything else the package needs (``LinearMethodBase``, ``FusedMoEMethodBase``, ``ParallelLMHead``,
``get_current_vllm_config``,
``register_quantization_config``, the layerwise online-loading helpers, the ``vllm.general_plugins``
entry point) has kept its name and place across these releases.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

import vllm
from vllm.config import get_current_vllm_config
from vllm.logger import init_logger as _vllm_init_logger
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase, FusedMoeWeightScaleSupported, RoutedExperts
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.all2all_utils import maybe_make_prepare_finalize
from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
from vllm.model_executor.layers.fused_moe.experts.lora_experts_mixin import LoRAExpertsMixin
from vllm.model_executor.layers.fused_moe.modular_kernel import (
    FusedMoEActivationFormat,
    FusedMoEExpertsModular,
    FusedMoEKernel,
)
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.layers.linear import (
    LinearBase,
    LinearMethodBase,
    UnquantizedLinearMethod,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.quantization import (
    QUANTIZATION_METHODS,
    get_quantization_config,
    register_quantization_config,
)
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.model_loader.reload.layerwise import initialize_online_processing
from vllm.model_executor.parameter import ModelWeightParameter
from vllm.model_executor.utils import replace_parameter, set_weight_attrs
from vllm.platforms import current_platform

__all__ = [
    "VLLM_VERSION",
    "VLLM_VERSION_TEXT",
    "OLDEST_SUPPORTED",
    "NEWEST_TESTED",
    "FusedMoEActivationFormat",
    "FusedMoEExpertsModular",
    "FusedMoEKernel",
    "FusedMoEMethodBase",
    "FusedMoEQuantConfig",
    "FusedMoeWeightScaleSupported",
    "LinearBase",
    "LinearMethodBase",
    "LOADS_PER_EXPERT_3D_TENSORS",
    "LoRAExpertsMixin",
    "ModelWeightParameter",
    "MoEActivation",
    "ParallelLMHead",
    "QUANTIZATION_METHODS",
    "QuantizationConfig",
    "QuantizeMethodBase",
    "ROUTER_RUNS_ON_CPU",
    "RoutedExperts",
    "TopKWeightAndReduceNoOP",
    "UnquantizedFusedMoEMethod",
    "UnquantizedLinearMethod",
    "cpu_select_experts",
    "current_platform",
    "get_current_vllm_config",
    "get_quantization_config",
    "init_logger",
    "initialize_online_processing",
    "maybe_make_prepare_finalize",
    "register_quantization_config",
    "register_weight_loader_v2_supported_method",
    "replace_parameter",
    "set_weight_attrs",
]


def init_logger(name: str):
    """vLLM's logger for a module of this package, named under vLLM's ``vllm`` logger (``vllm.vllm_kbit...``) so
    that its lines go through vLLM's handler, format and ``VLLM_LOGGING_LEVEL`` like vLLM's own. A logger
    outside that tree has no handler: Python prints its warnings bare on stderr and drops its info lines."""
    return _vllm_init_logger(name if name.startswith("vllm.") else f"vllm.{name}")


# The supported range, as in pyproject.toml's `vllm` extra and the README.
OLDEST_SUPPORTED = (0, 26)
NEWEST_TESTED = (0, 33)


def _release(version: str) -> tuple[int, int]:
    """(major, minor) of a vLLM version string such as ``0.32.0``, ``0.33.0+cpu`` or ``0.34.0rc1.dev3``."""
    major, minor = (re.match(r"\d*", piece).group() or "0" for piece in (version.split(".") + ["0"])[:2])
    return int(major), int(minor)


VLLM_VERSION = _release(vllm.__version__)
VLLM_VERSION_TEXT = vllm.__version__

if VLLM_VERSION < OLDEST_SUPPORTED:
    raise ImportError(
        f"vllm-kbit supports vLLM {OLDEST_SUPPORTED[0]}.{OLDEST_SUPPORTED[1]} and later; "
        f"this environment has vLLM {vllm.__version__}"
    )
if VLLM_VERSION > NEWEST_TESTED:
    init_logger(__name__).warning(
        "vllm-kbit is tested with vLLM up to %d.%d; vLLM %s is newer and may have moved an API the plugin uses",
        *NEWEST_TESTED,
        vllm.__version__,
    )

# vLLM 0.32 added the per-expert case to RoutedExperts.load_weights (an expert number in the name: one expert).
LOADS_PER_EXPERT_3D_TENSORS = VLLM_VERSION >= (0, 32)


def _router_runs_on_cpu() -> bool:
    try:
        module = importlib.import_module("vllm.model_executor.layers.fused_moe.router.cpu_router")
    except ModuleNotFoundError:
        return False
    return hasattr(module, "CPURouter")


# Whether vLLM's MoE router computes top-k on CPU itself (its CPURouter): where it does not, a MoE method on vLLM's
# CPU build routes inside the method (monolithic; vLLM's own CPU MoE does the same there).
ROUTER_RUNS_ON_CPU = _router_runs_on_cpu()

# Newest location first: the first module that has the function is used.
_CPU_SELECT_EXPERTS_MODULES = (
    "vllm.model_executor.layers.fused_moe.router.cpu_router",  # 0.30 and later
    "vllm.model_executor.layers.fused_moe.experts.cpu_moe",  # 0.28, 0.29
    "vllm.model_executor.layers.fused_moe.cpu_fused_moe",  # 0.26, 0.27
)
_cpu_select_experts = None


def cpu_select_experts(**kwargs: Any):
    """vLLM's CPU expert routing: ``(topk_weights float32, topk_ids int32)`` from router logits.

    Keyword arguments as in every supported release: ``hidden_states``, ``router_logits``, ``top_k``,
    ``use_grouped_topk``, ``renormalize``, ``topk_group``, ``num_expert_group``,
    ``custom_routing_function``, ``scoring_func``, ``routed_scaling_factor``, ``e_score_correction_bias``.
    Imported on first use: the modules holding it import vLLM's CPU ops, which GPU builds need not load.
    """
    global _cpu_select_experts
    if _cpu_select_experts is None:
        _cpu_select_experts = _first_attribute("select_experts", _CPU_SELECT_EXPERTS_MODULES)
    return _cpu_select_experts(**kwargs)


def _first_attribute(name: str, modules: tuple[str, ...]):
    for module in modules:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is not None and module.startswith(e.name):  # this module is absent in this release
                continue
            raise
        if hasattr(mod, name):
            return getattr(mod, name)
    raise ImportError(f"vllm-kbit: vLLM {vllm.__version__} has no {name} in any of {', '.join(modules)}")
