"""Runs one vLLM engine in its own process for the tests: ``python engine_runner.py SPEC.json OUT.json``.

SPEC: {"model": dir, "llm_kwargs": {...}, "prompts": [[token ids]...], "text_prompts": [str...],
       "max_tokens": n, "logprobs": n, "probes": [[token ids]...],
       "loras": [adapter dirs], "prompt_loras": [index into loras or -1, per prompt and per probe],
       "probe_by_prefix": bool (probes from one request per prefix instead of prompt_logprobs)}
OUT:  {"tokens": [[ids]], "logprobs": [[{id: logprob}]], "texts": [str], "layers": {name: info},
       "probes": [{"argmax": [ids], "logprob": [floats], "top": [{id: logprob}]}], "memory": {VmHWM, ...}}

Each engine gets a fresh process, so engines never share memory or distributed
state and a failing load shows its own error on stderr.
"""

from __future__ import annotations

import json
import os
import sys

# kbit_dev (the checkout's fixtures) from the repository root; this runs as a script in tests/vllm.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# Tokens whose logprobs a probe position records beside the greedy one (kbit_e2e.probe_match(..., ties=True) reads them).
PROBE_TOP = 5


def main(spec_path: str, out_path: str) -> None:
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model pickles the probe functions
    import torch

    if not torch.cuda.is_available():
        # The engine core in this process: generate() then queues every prompt before the first step, so the
        # batches (and with them the CPU GEMMs' shapes and rounding) do not depend on how busy the machine is.
        # With a separate core process a loaded CPU saw steps start on part of the prompts, and a kbit engine
        # and its dequantized reference batched differently (MoE router near-ties flipped: 88-94% match).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    else:
        # The engine core as a spawned process: vLLM 0.26's MLA setup (glm4_moe_lite) initializes CUDA in this
        # process, after which a forked core cannot ("Cannot re-initialize CUDA in forked subprocess").
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    from vllm import LLM

    from kbit_dev.engine import shutdown_engine

    with open(spec_path) as f:
        spec = json.load(f)
    # Eager on CPU (torch.compile there costs minutes per engine); on a GPU vLLM's defaults: CUDA graphs
    # and torch.compile, what a served model runs, in 15% of the GPU's memory so that several engines
    # (tests in parallel processes, benchmarks/serve/run.sh) fit beside each other.
    cuda = torch.cuda.is_available()
    kwargs = dict(gpu_memory_utilization=0.15 if cuda else 0.3, enforce_eager=not cuda, max_model_len=256, seed=0,
                  enable_prefix_caching=False)
    if cuda:
        # A fixed KV-cache size skips vLLM's memory profiling, which compares the GPU's free memory before
        # and after a profile run and so fails ("No available memory for the cache blocks", "Error in memory
        # profiling") when engines in parallel processes allocate or free memory meanwhile.
        kwargs["kv_cache_memory_bytes"] = 1 << 30
    kwargs.update(spec.get("llm_kwargs", {}))
    llm = LLM(model=spec["model"], **kwargs)
    try:
        result = run(llm, spec)
    finally:
        shutdown_engine(llm)
    with open(out_path, "w") as f:
        json.dump(result, f)


def run(llm, spec: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from vllm_kbit.vllm.inspect import layer_summary, process_memory

    layers = llm.apply_model(layer_summary)
    memory = llm.apply_model(process_memory)
    params = SamplingParams(
        max_tokens=spec.get("max_tokens", 16), temperature=0.0, logprobs=spec.get("logprobs", 5), ignore_eos=True
    )
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec.get("prompts", [])] + spec.get("text_prompts", [])
    # LoRA: each prompt (and probe) i with adapter prompt_loras[i] (-1: none), all in one batch.
    loras = [LoRARequest(f"adapter{i}", i + 1, path) for i, path in enumerate(spec.get("loras", []))]
    lora_of = [loras[i] if i >= 0 else None for i in spec.get("prompt_loras", [])]
    outputs = llm.generate(prompts, params, use_tqdm=False, **({"lora_request": lora_of + [None] * (
        len(prompts) - len(lora_of))} if loras else {}))
    # Teacher-forced probes: on fixed token sequences, the model's greedy (argmax) next token and the
    # logprob of the actual next token at every position, independent of what the model generated.
    probes = (probe_prefixes if spec.get("probe_by_prefix") else probe_prompt_logprobs)(
        llm, spec.get("probes", []), lora_of if loras else None)
    return {
        "probes": probes,
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "texts": [o.outputs[0].text for o in outputs],
        "logprobs": [
            [{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs] for o in outputs
        ],
        "layers": layers[0],
        "layers_per_rank": layers,
        "memory": memory[0],
    }


def probe_prompt_logprobs(llm, probes: list[list[int]], lora_of) -> list[dict]:
    """The probes from one request each (prompt_logprobs): at every position the greedy next token, the logprob
    of the actual one and the PROBE_TOP most likely tokens' logprobs."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if not probes:
        return []
    out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in probes],
                       SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=PROBE_TOP), use_tqdm=False,
                       **({"lora_request": lora_of} if lora_of else {}))
    result = []
    for o, seq in zip(out, probes):
        argmax, actual, top = [], [], []
        for pos, step in enumerate(o.prompt_logprobs[1:], start=1):
            argmax.append(next(t for t, lp in step.items() if lp.rank == 1))
            actual.append(step[seq[pos]].logprob)
            top.append(_top(step))
        result.append({"argmax": argmax, "logprob": actual, "top": top})
    return result


def probe_prefixes(llm, probes: list[list[int]], lora_of) -> list[dict]:
    """The same probes from one request per prefix (seq[:pos] -> one token with the whole distribution's logprobs):
    for engines where prompt_logprobs cannot run (vLLM's LoRA logits processor on its CPU build fails on prompt
    logprobs). Needs the engine's max_logprobs at the vocabulary size."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    vocab = llm.llm_engine.model_config.get_vocab_size()
    prompts, loras, where = [], [], []
    for i, seq in enumerate(probes):
        for pos in range(1, len(seq)):
            prompts.append(TokensPrompt(prompt_token_ids=seq[:pos]))
            loras.append(lora_of[i] if lora_of else None)
            where.append((i, pos))
    out = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, logprobs=vocab), use_tqdm=False,
                       **({"lora_request": loras} if lora_of else {}))
    result = [{"argmax": [], "logprob": [], "top": []} for _ in probes]
    for o, (i, pos) in zip(out, where):
        step = o.outputs[0].logprobs[0]
        result[i]["argmax"].append(o.outputs[0].token_ids[0])
        result[i]["logprob"].append(step[probes[i][pos]].logprob)
        result[i]["top"].append(_top(step))
    return result


def _top(step: dict) -> dict[str, float]:
    """{token id: logprob} of the PROBE_TOP most likely tokens of one position's logprobs (JSON keys are strings)."""
    best = sorted(((lp.rank, t, lp.logprob) for t, lp in step.items() if lp.rank is not None))[:PROBE_TOP]
    return {str(t): v for _, t, v in best}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
