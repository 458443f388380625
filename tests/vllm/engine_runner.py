"""Runs one vLLM engine in its own process for the tests: ``python engine_runner.py SPEC.json OUT.json``.

SPEC: {"model": dir, "llm_kwargs": {...}, "prompts": [[token ids]...], "text_prompts": [str...],
       "max_tokens": n, "logprobs": n}
OUT:  {"tokens": [[ids]], "logprobs": [[{id: logprob}]], "texts": [str], "layers": {name: info},
       "load_peak_rss_bytes": int}

Each engine gets a fresh process, so engines never share memory or distributed
state and a failing load shows its own error on stderr.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys


def inspect_layers(model):
    """Per quantized layer: kind, bits, codebook size and a hash of its runtime tensors (runs in the worker)."""
    import resource

    out = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        kind = type(method).__name__ if method is not None else None
        if kind is None or not ("Linear" in kind or "MoE" in kind):
            continue
        info = {"method": kind}
        tensors = {n: p for n, p in module.named_parameters(recurse=False)}
        if hasattr(module, "kbit_codebook"):
            info["bits"] = int(module.kbit_codebook.numel()).bit_length() - 1
            h = hashlib.sha256()
            for n in sorted(tensors):
                h.update(n.encode())
                h.update(tensors[n].detach().cpu().contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
            info["hash"] = h.hexdigest()
        info["params"] = {n: [str(p.dtype), list(p.shape)] for n, p in tensors.items()}
        out[name] = info
    out["__peak_rss_bytes__"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def main(spec_path: str, out_path: str) -> None:
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model ships inspect_layers to the worker
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(spec_path) as f:
        spec = json.load(f)
    kwargs = dict(gpu_memory_utilization=0.3, enforce_eager=True, max_model_len=256, seed=0)
    kwargs.update(spec.get("llm_kwargs", {}))
    llm = LLM(model=spec["model"], **kwargs)
    layers = llm.apply_model(inspect_layers)
    params = SamplingParams(
        max_tokens=spec.get("max_tokens", 16), temperature=0.0, logprobs=spec.get("logprobs", 5), ignore_eos=True
    )
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec.get("prompts", [])] + spec.get("text_prompts", [])
    outputs = llm.generate(prompts, params, use_tqdm=False)
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "texts": [o.outputs[0].text for o in outputs],
        "logprobs": [
            [{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs] for o in outputs
        ],
        "layers": {k: v for k, v in layers[0].items() if k != "__peak_rss_bytes__"},
        "layers_per_rank": [{k: v for k, v in r.items() if k != "__peak_rss_bytes__"} for r in layers],
        "load_peak_rss_bytes": layers[0]["__peak_rss_bytes__"],
    }
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
