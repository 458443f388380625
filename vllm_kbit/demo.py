"""``python -m vllm_kbit.demo``: a tiny random MoE model, quantized with kbit and served by vLLM.

1. builds a tiny random Qwen3-MoE checkpoint (bf16, nothing downloaded),
2. converts it with ``vllm-kbit convert`` (k bits) and prints the size saved,
3. generates greedily with vLLM from the kbit checkpoint (CPU, or the GPU when
   vLLM's CUDA build and a GPU are present) and prints the outputs next to those of the
   bf16 model (Hugging Face transformers, same prompts).

The model's weights are random, so its text is noise; what the demo shows is the
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bits", type=int, default=4, help="bits per weight (2..5)")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--keep", metavar="DIR", help="write the checkpoints to DIR instead of a temporary directory")
    args = parser.parse_args(argv)

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
