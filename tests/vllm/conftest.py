"""Fixtures of the vLLM end-to-end tests (CPU backend; each engine runs in its own process).

Engine start-up costs about a minute on CPU, so every engine configuration is
started once per session (:func:`engine`) and its outputs and layer summary are
cached for all tests that need them. ``KBIT_E2E_ENGINES=N`` (default 1) lets up to
N engines run at once: tests can start the engines they need ahead with
``engine.start(...)`` (the GPU tensor-parallel set does), and each engine then gets
a vLLM compile cache of its own, so engines running at once never write one cache.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
from kbit_e2e import (
    GPTQ_CALIBRATION_TOKENS, MIXED, ONLINE, ROTATION, TEXT_PROMPTS, dequantized_converted_checkpoint, run_engine,
    settings_of,
)

from kbit_dev import tiny_models


@pytest.fixture(scope="session", autouse=True)
def kbit_plugin_installed():
    """vLLM finds the ``kbit`` quantization through this package's ``vllm.general_plugins`` entry point,
    which only an install writes (PYTHONPATH alone gives engines that reject ``quantization="kbit"``)."""
    import importlib.metadata as md

    if not any(e.name == "kbit" for e in md.entry_points(group="vllm.general_plugins")):
        pytest.fail("vllm_kbit is not installed in this interpreter, so vLLM cannot find the kbit plugin: "
                    "pip install -e . (make env does it)", pytrace=False)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """Builds the tiny bf16 checkpoints once: {kind: dir} for every kind of tiny_models.BUILDERS."""
    root = tmp_path_factory.mktemp("tiny")
    return {kind: tiny_models.build(kind, str(root / kind)) for kind in tiny_models.BUILDERS}


class Engines:
    """``engine(key, model, llm_kwargs, env, text_prompts)`` -> the runner's output for that key (one engine
    start per key and session); ``engine.start(...)`` with the same arguments begins it in the background."""

    def __init__(self, root, parallel: int):
        self.root = root
        self.parallel = parallel
        self.pool = ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="engine")
        self.runs: dict[str, Future] = {}

    def start(self, key: str, model: str, llm_kwargs: dict | None = None, env: dict | None = None,
              text_prompts: list[str] | None = None, **lora) -> Future:
        """``lora``: run_engine's ``loras`` and ``prompt_loras``."""
        if key not in self.runs:
            env = dict(env or {})
            if self.parallel > 1:
                cache = os.environ.get("VLLM_CACHE_ROOT") or os.path.join(os.path.expanduser("~"), ".cache", "vllm")
                env.setdefault("VLLM_CACHE_ROOT", os.path.join(cache, "kbit-e2e", key))
            self.runs[key] = self.pool.submit(run_engine, model, str(self.root / key), llm_kwargs, env, text_prompts,
                                              **lora)
        return self.runs[key]

    def __call__(self, key: str, model: str, llm_kwargs: dict | None = None, env: dict | None = None,
                 text_prompts: list[str] | None = None, **lora) -> dict:
        return self.start(key, model, llm_kwargs, env, text_prompts, **lora).result()


@pytest.fixture(scope="session")
def engine(tmp_path_factory):
    """engine(key, model, **kwargs) -> cached runner output; each key starts one engine per session."""
    engines = Engines(tmp_path_factory.mktemp("engines"), max(1, int(os.environ.get("KBIT_E2E_ENGINES", "1"))))
    yield engines
    engines.pool.shutdown(wait=False, cancel_futures=True)


@pytest.fixture(scope="session")
def converted_qwen3_moe(tiny, tmp_path_factory):
    """The tiny Qwen3-MoE written by `vllm-kbit convert --bits 4`."""
    from vllm_kbit.convert import convert

    out = str(tmp_path_factory.mktemp("converted") / "qwen3_moe-kbit4")
    summary = convert(tiny["qwen3_moe"], out, settings_of(ONLINE[4]), progress=False)
    assert summary.quantized > 0 and summary.output_bytes < summary.input_bytes
    return out


@pytest.fixture(scope="session")
def converted4(tiny, tmp_path_factory):
    """converted4(kind) -> the tiny checkpoint written by `vllm-kbit convert --bits 4` (ONLINE[4]'s settings, so
    its packed weights are the online kbit-4 ones); each kind converted once per session."""
    from vllm_kbit.convert import convert

    done: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in done:
            out = str(tmp_path_factory.mktemp("converted") / f"{kind}-kbit4")
            summary = convert(tiny[kind], out, settings_of(ONLINE[4]), progress=False)
            assert summary.quantized > 0 and summary.output_bytes < summary.input_bytes
            done[kind] = out
        return done[kind]

    return get


@pytest.fixture(scope="session")
def converted_mixed(tiny, tmp_path_factory):
    """converted_mixed(kind) -> the tiny checkpoint written by `vllm-kbit convert` with MIXED bits (routed
    experts 3, attention 5, the rest 4); each kind converted once per session."""
    from vllm_kbit.convert import convert

    done: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in done:
            out = str(tmp_path_factory.mktemp("converted") / f"{kind}-mixed")
            summary = convert(tiny[kind], out, settings_of(MIXED), progress=False)
            assert summary.quantized > 0 and summary.output_bytes < summary.input_bytes
            done[kind] = out
        return done[kind]

    return get


@pytest.fixture(scope="session")
def converted_offline(engine, converted_qwen3_moe):
    """Offline engine on the converted checkpoint, started with no quantization flag."""
    return engine("qwen3_moe-converted4", converted_qwen3_moe, text_prompts=TEXT_PROMPTS)


@pytest.fixture(scope="session")
def rotated(tiny, tmp_path_factory):
    """rotated(kind, gptq=False, tp=1) -> (the kbit-4 checkpoint `vllm-kbit convert` writes with ROTATION at
    --rotation-tp tp, its dequantized rotated model: the stored weights decoded in the original basis); each
    converted once per session."""
    from vllm_kbit.convert import convert

    done: dict[tuple, tuple[str, str]] = {}

    def get(kind: str, gptq: bool = False, tp: int = 1) -> tuple[str, str]:
        if (kind, gptq, tp) not in done:
            root = tmp_path_factory.mktemp(f"{kind}-rot{'-gptq' if gptq else ''}-tp{tp}")
            out = str(root / "kbit")
            config = {**ONLINE[4], "rotation": {**ROTATION, "tp": tp}}
            summary = convert(tiny[kind], out, settings_of(config), progress=False, gptq=gptq,
                              calibration_tokens=GPTQ_CALIBRATION_TOKENS if gptq else None)
            assert summary.quantized > 0
            done[(kind, gptq, tp)] = out, dequantized_converted_checkpoint(tiny[kind], out, str(root / "deq"))
        return done[(kind, gptq, tp)]

    return get
