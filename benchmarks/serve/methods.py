"""The weight formats the serving benchmark compares, as `vllm serve` arguments on a weightless model directory.

Every method serves the same Qwen3-MoE shape with ``--load-format dummy``:

* ``bf16``: the plain directory.
* ``gptq-int4``: a second directory whose config.json carries a GPTQ 4-bit group-128 ``quantization_config``
  (vLLM picks its Marlin kernels; see :mod:`model_dir`).
* ``kbit-2`` .. ``kbit-5``: the plain directory quantized online while loading:
  ``--quantization kbit --hf-overrides '{"quantization_config": {"quant_method": "kbit", "bits": k}}'``
  (the route of ``tests/vllm/kbit_e2e.online_kwargs``). The dummy loader fills each layer in bf16 and runs
  the kbit method's ``process_weights_after_loading`` on it, so the served weights are real kbit weights.
* ``kbit-4-rot``: kbit-4 with every layer's input rotated (``"rotation": {"seed": 0}``, blocks <= 128, as
  ``convert --gptq`` writes them): what the rotation costs a served model (the weights are quantized as W R
  online; the kernels rotate x).

vLLM's ``--quantization bitsandbytes`` is not among them: vLLM 0.26 forces ``--load-format bitsandbytes``
with it (``EngineArgs.create_load_config``), which reads real safetensors, so it cannot run on dummy
weights; the bitsandbytes package is not in the GPU payload either.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    name: str
    bits: int
    model_variant: str  # "plain" or "gptq-int4": which model directory it serves
    serve_args: tuple[str, ...] = ()
    llm_kwargs: tuple[tuple[str, object], ...] = ()  # the same settings for vllm.LLM(...) (profile mode)


def _kbit(k: int, rotation: dict | None = None) -> Method:
    qc = {"quantization_config": {"quant_method": "kbit", "bits": k, **({"rotation": rotation} if rotation else {})}}
    return Method(
        name=f"kbit-{k}" + ("-rot" if rotation else ""),
        bits=k,
        model_variant="plain",
        serve_args=("--quantization", "kbit", "--hf-overrides", json.dumps(qc)),
        llm_kwargs=(("quantization", "kbit"), ("hf_overrides", qc)),
    )


METHODS = {
    m.name: m
    for m in [
        Method("bf16", 16, "plain"),
        Method("gptq-int4", 4, "gptq-int4"),
        *(_kbit(k) for k in (2, 3, 4, 5)),
    ]
}
# Variants of a format, named explicitly (not in "all", which compares the formats).
VARIANTS = {m.name: m for m in [_kbit(4, {"seed": 0})]}


def parse_methods(text: str) -> list[Method]:
    """"bf16,kbit-4" -> [Method, ...] in the given order ("all": every method)."""
    names = list(METHODS) if text == "all" else [n.strip() for n in text.split(",") if n.strip()]
    known = {**METHODS, **VARIANTS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose from {list(known)} or 'all'")
    return [known[n] for n in names]
