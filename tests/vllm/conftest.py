"""Fixtures of the vLLM end-to-end tests (CPU backend; each engine runs in its own process).

Engine start-up costs about a minute on CPU, so every engine configuration is
started once per session (:func:`engine`) and its outputs and layer summary are
cached for all tests that need them.
"""

from __future__ import annotations

import pytest
from kbit_e2e import ONLINE, TEXT_PROMPTS, run_engine, settings_of

from vllm_kbit import tiny_models


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """Builds the tiny bf16 checkpoints once: {"qwen3_moe": dir, "glm4_moe": dir, "qwen3": dir}."""
    root = tmp_path_factory.mktemp("tiny")
    return {kind: tiny_models.build(kind, str(root / kind)) for kind in tiny_models.BUILDERS}


@pytest.fixture(scope="session")
def engine(tmp_path_factory):
    """engine(key, model, **kwargs) -> cached runner output; each key starts one engine per session."""
    cache: dict[str, dict] = {}
    root = tmp_path_factory.mktemp("engines")

    def get(key: str, model: str, llm_kwargs: dict | None = None, env: dict | None = None,
            text_prompts: list[str] | None = None) -> dict:
        if key not in cache:
            cache[key] = run_engine(model, str(root / key), llm_kwargs, env, text_prompts)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def converted_qwen3_moe(tiny, tmp_path_factory):
    """The tiny Qwen3-MoE written by `vllm-kbit convert --bits 4`."""
    from vllm_kbit.convert import convert

    out = str(tmp_path_factory.mktemp("converted") / "qwen3_moe-kbit4")
    summary = convert(tiny["qwen3_moe"], out, settings_of(ONLINE[4]), progress=False)
    assert summary.quantized > 0 and summary.output_bytes < summary.input_bytes
    return out


@pytest.fixture(scope="session")
def converted_offline(engine, converted_qwen3_moe):
    """Offline engine on the converted checkpoint, started with no quantization flag."""
    return engine("qwen3_moe-converted4", converted_qwen3_moe, text_prompts=TEXT_PROMPTS)
