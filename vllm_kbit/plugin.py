"""vLLM general plugin (entry point ``vllm.general_plugins: kbit``): registers the ``kbit`` quantization.

vLLM calls :func:`register` in every process it starts (API server, engine
core, workers), so ``--quantization kbit`` and pre-quantized kbit checkpoints
work with no wrapper script. Calling it again is a no-op.
"""

from __future__ import annotations


def register() -> None:
    from vllm_kbit import moe  # noqa: F401  (registers torch.ops.kbit.fused_moe)
    from vllm_kbit.settings import QUANT_METHOD
    from vllm_kbit.vllm.compat import QUANTIZATION_METHODS, get_quantization_config, register_quantization_config
    from vllm_kbit.vllm.config import KbitConfig

    if QUANT_METHOD in QUANTIZATION_METHODS:
        if get_quantization_config(QUANT_METHOD) is KbitConfig:
            return
    register_quantization_config(QUANT_METHOD)(KbitConfig)
