"""Helpers of the vLLM end-to-end tests: prompts, settings per k, engine runs in fresh processes, comparisons."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import torch

from vllm_kbit.convert import quantization_decision
from vllm_kbit.settings import KbitSettings

HERE = os.path.dirname(os.path.abspath(__file__))
RUNNER = os.path.join(HERE, "engine_runner.py")
ENGINE_TIMEOUT_S = 600

# 8 prompts of 12 random byte tokens; 24 greedy tokens each.
_gen = torch.Generator().manual_seed(1234)
PROMPTS = [torch.randint(0, 256, (12,), generator=_gen).tolist() for _ in range(8)]
MAX_TOKENS = 24
# Teacher-forced probes: each prompt followed by 24 fixed random tokens.
PROBES = [p + torch.randint(0, 256, (24,), generator=_gen).tolist() for p in PROMPTS]
TEXT_PROMPTS = ["Hello world"]

# Online settings per k; k=3 also exercises per-module bits and modules_to_not_convert:
# attention at 5 bits, the routed experts of layer 1 left in bf16.
ONLINE = {
    2: {"bits": 2},
    3: {
        "bits": 3,
        "bits_overrides": {r"self_attn\.": 5},
        "modules_to_not_convert": ["lm_head", "gate", "layers.1.mlp.experts"],
    },
    4: {"bits": 4},
    5: {"bits": 5},
}

# Mixed bits of the converted checkpoints of the tensor / expert parallel tests: the routed experts at 3 bits,
# attention at 5, everything else (GLM's shared experts and dense first layer) at 4. Routed experts are one
# module named <block>.experts; the `$` keeps GLM's shared_experts out of the 3-bit pattern.
MIXED = {"bits": 4, "bits_overrides": {r"mlp\.experts$": 3, r"self_attn\.": 5}}


# Rotated checkpoints (docs/format.md, section 9): the seed, the block cap, and the calibration budget of the rotated
# --gptq conversions (tiny models: a quick calibration). The cap is the format's largest, 1024 (256 on these models),
# the setting these agreement thresholds were set at: at the default 128 the tiny MoE's agreement with its
# dequantized model sits at the 98% threshold (96.4-98.6% of positions within 0.1 over seeds 0..2, against 98.2-98.9%
# at 1024; docs/decisions.md, "Rotation block"). The ops' tests cover every block.
ROTATION = {"seed": 1, "max_block": 1024}
GPTQ_CALIBRATION_TOKENS = 1024


def settings_of(config: dict) -> KbitSettings:
    return KbitSettings.from_dict({"quant_method": "kbit", **config})


def dequantized_checkpoint(src: str, dst: str, settings: KbitSettings) -> str:
    """Copy of ``src`` whose quantized weights are replaced by their dequantized bf16 values (a plain checkpoint).
    With ``settings.rotation`` each weight is quantized as online quantization does, Q(W R) with W R in float32, and
    decoded in the original basis, Q(W R) R^T (docs/format.md, section 9)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    import vllm_kbit

    os.makedirs(dst, exist_ok=True)
    for name in [f for f in os.listdir(src) if not f.endswith(".safetensors")]:
        with open(os.path.join(src, name), "rb") as fi, open(os.path.join(dst, name), "wb") as fo:
            fo.write(fi.read())
    for shard in sorted(f for f in os.listdir(src) if f.endswith(".safetensors")):
        out = {}
        with safe_open(os.path.join(src, shard), "pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                bits = quantization_decision(key, tuple(t.shape), t.dtype, settings)
                if bits is not None and bits > 0 and settings.rotation is not None:
                    q = vllm_kbit.quantize(settings.rotation.rotate(t.float()), bits, settings.codebook(bits))
                    t = settings.rotation.rotate(q.dequantize(torch.float32), inverse=True).to(t.dtype)
                elif bits is not None and bits > 0:
                    q = vllm_kbit.quantize(t, bits, settings.codebook(bits))
                    t = q.dequantize(t.dtype)
                out[key] = t.contiguous()
        save_file(out, os.path.join(dst, shard), metadata={"format": "pt"})
    return dst


def dequantized_converted_checkpoint(src: str, converted: str, dst: str) -> str:
    """Copy of the bf16 checkpoint ``src`` whose weights are the values the converted checkpoint ``converted``
    stores for them, decoded in the original basis: Q(W R) R^T for a rotated conversion (docs/format.md, section
    9), Q(W) otherwise. A plain checkpoint: what the kbit engine on ``converted`` must compute."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from vllm_kbit import reference as fmt

    with open(os.path.join(converted, "config.json")) as f:
        settings = KbitSettings.from_dict(json.load(f)["quantization_config"])
    packed = {}
    for shard in (f for f in os.listdir(converted) if f.endswith(".safetensors")):
        packed.update(load_file(os.path.join(converted, shard)))
    os.makedirs(dst, exist_ok=True)
    for name in [f for f in os.listdir(src) if not f.endswith(".safetensors")]:
        with open(os.path.join(src, name), "rb") as fi, open(os.path.join(dst, name), "wb") as fo:
            fo.write(fi.read())
    decoded = 0
    for shard in sorted(f for f in os.listdir(src) if f.endswith(".safetensors")):
        out = {}
        with safe_open(os.path.join(src, shard), "pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                module = key.removesuffix(".weight")
                if key.endswith(".weight") and f"{module}.qweight" in packed:
                    a = packed[f"{module}.absmax"]
                    N, KB = a.shape
                    q = packed[f"{module}.qweight"]
                    q = q.view(N, KB, q.numel() // (N * KB))  # routed experts' qweights are stored 2-D
                    W = fmt.dequantize(q, a, settings.codebook(q.shape[2]), torch.float32)
                    if settings.rotation is not None:
                        W = settings.rotation.rotate(W, inverse=True)
                    t = W.to(t.dtype)
                    decoded += 1
                out[key] = t.contiguous()
        save_file(out, os.path.join(dst, shard), metadata={"format": "pt"})
    assert decoded, f"no quantized weight of {src} found in {converted}"
    return dst


def run_engine(model: str, workdir: str, llm_kwargs: dict | None = None, env: dict | None = None,
               text_prompts: list[str] | None = None, check: bool = True, loras: list[str] | None = None,
               prompt_loras: list[int] | None = None, probe_by_prefix: bool = False) -> dict | subprocess.CompletedProcess:
    """Starts one engine in a fresh process, generates greedily from PROMPTS and returns the runner's JSON.
    ``loras``: LoRA adapter directories; ``prompt_loras``: the adapter of each prompt and probe (-1: none);
    ``probe_by_prefix``: the probes from one request per prefix (engine_runner.probe_prefixes)."""
    os.makedirs(workdir, exist_ok=True)
    spec_path, out_path = os.path.join(workdir, "spec.json"), os.path.join(workdir, "out.json")
    with open(spec_path, "w") as f:
        json.dump(
            {"model": model, "llm_kwargs": llm_kwargs or {}, "prompts": PROMPTS, "text_prompts": text_prompts or [],
             "max_tokens": MAX_TOKENS, "logprobs": 5, "probes": PROBES, "loras": loras or [],
             "prompt_loras": prompt_loras or [], "probe_by_prefix": probe_by_prefix},
            f,
        )
    proc = subprocess.run(
        [sys.executable, RUNNER, spec_path, out_path],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=ENGINE_TIMEOUT_S,
    )
    if not check:
        return proc
    if proc.returncode != 0:
        # vLLM logs the workers' errors on stdout; the engine's own failure comes on stderr.
        causes = [line for line in (proc.stdout + proc.stderr).splitlines() if "Error" in line and "Traceback" not in line]
        raise AssertionError(
            f"engine for {model} failed (rc={proc.returncode}); error lines:\n" + "\n".join(causes[:20])
            + f"\n--- stderr tail ---\n{proc.stderr[-3000:]}"
        )
    with open(out_path) as f:
        result = json.load(f)
    # The plugin's log lines (the load summary, layers left unquantized), from every process of the engine.
    result["kbit_log"] = [line for line in (proc.stdout + proc.stderr).splitlines() if "kbit: " in line]
    return result


def select_prompts(sources: list[dict], of_prompt: list[int]) -> dict:
    """One run's worth of per-prompt results taken from several runs: prompt / probe i from
    ``sources[of_prompt[i]]`` (e.g. each LoRA adapter's reference engine for the prompts served with it)."""
    return {key: [sources[src][key][i] for i, src in enumerate(of_prompt)] for key in ("probes", "tokens", "logprobs")}


def token_match(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of generated positions with the same token."""
    assert len(a) == len(b) and [len(r) for r in a] == [len(r) for r in b], "runs generated different shapes"
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    return same / sum(len(r) for r in a)


def probe_match(a: dict, b: dict, ties: bool = False) -> float:
    """Fraction of teacher-forced positions (same contexts for both runs) where the greedy next token is the same;
    with ``ties``, two different greedy tokens also agree when each run gives the other's token a logprob within
    MAX_LOGPROB_GAP of its own greedy one (both in its recorded top tokens). The tiny models' logits are bf16 over a
    nearly flat 384-token distribution, so their top two often tie exactly and argmax takes either."""
    def tied(top: dict, mine: int, other: int) -> bool:
        return str(other) in top and top[str(mine)] - top[str(other)] <= MAX_LOGPROB_GAP

    agree = n = 0
    for pa, pb in zip(a["probes"], b["probes"]):
        ta, tb = (pa.get("top"), pb.get("top")) if ties else (None, None)
        for i, (x, y) in enumerate(zip(pa["argmax"], pb["argmax"])):
            n += 1
            agree += x == y or (ta is not None and tb is not None and tied(ta[i], x, y) and tied(tb[i], y, x))
    assert n and len(a["probes"]) == len(b["probes"])
    return agree / n


def probe_logprob_gaps(a: dict, b: dict) -> list[float]:
    """|difference| of the logprob given to the actual next token, per teacher-forced position."""
    return [abs(x - y) for pa, pb in zip(a["probes"], b["probes"]) for x, y in zip(pa["logprob"], pb["logprob"])]


# Two ways of computing the same (dequantized) model agree when greedy next tokens match, up to ties, at >= 95%
# of the teacher-forced positions and the logprob of the actual next token differs by <= 0.1 at >= 95% of them.
# Not at all of them: in a MoE a token whose router scores nearly tie takes another expert under any change of
# summation order, and its logprob, and those of the positions after it that attend to it, move by a few tenths,
# whichever kernel computes the experts. On the tiny MoEs that leaves 96.4-98.9% of positions within 0.1 (over
# sign seeds and CPUs); a wrong computation the size of the 4-bit rounding itself (kbit-4 against bf16) leaves
# 38% (docs/decisions.md, "End-to-end tests compare agreement").
MIN_TOKEN_MATCH = 0.95
MAX_LOGPROB_GAP = 0.1
MIN_POSITIONS_WITHIN_GAP = 0.95


def agreement(a: dict, b: dict) -> tuple[float, float, float]:
    """(greedy match up to ties, fraction of positions with logprob gap <= MAX_LOGPROB_GAP, largest gap) over the
    probes."""
    gaps = probe_logprob_gaps(a, b)
    return probe_match(a, b, ties=True), sum(g <= MAX_LOGPROB_GAP for g in gaps) / len(gaps), max(gaps)


def report_agreement(what: str, a: dict, b: dict) -> tuple[float, float, float]:
    """Prints the agreement of two runs on the probes and returns it (see :func:`agreement`)."""
    match, within, worst = agreement(a, b)
    print(f"{what}: teacher-forced greedy match {match:.1%} (up to ties), logprob gap <= {MAX_LOGPROB_GAP} at {within:.1%} "
          f"of positions (largest {worst:.4f}); free-running greedy match {token_match(a['tokens'], b['tokens']):.1%} "
          f"(common-prefix gap {max_logprob_gap(a, b):.4f})")
    return match, within, worst


def assert_agree(what: str, a: dict, b: dict) -> None:
    """Prints the agreement of two runs on the probes and asserts it (see MIN_TOKEN_MATCH above)."""
    match, within, _ = report_agreement(what, a, b)
    assert match >= MIN_TOKEN_MATCH, f"{what}: greedy match {match:.1%} < {MIN_TOKEN_MATCH:.0%}"
    assert within >= MIN_POSITIONS_WITHIN_GAP, (
        f"{what}: logprob gap <= {MAX_LOGPROB_GAP} at only {within:.1%} of positions (< {MIN_POSITIONS_WITHIN_GAP:.0%})")


def first_differences(a: dict, b: dict) -> list[tuple[int, int, int, int]]:
    """(prompt, position, token of a, token of b) at the first generated position where a prompt's greedy
    tokens differ between two runs; prompts whose tokens are identical are left out."""
    out = []
    for i, (ta, tb) in enumerate(zip(a["tokens"], b["tokens"])):
        pos = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        if pos is not None:
            out.append((i, pos, ta[pos], tb[pos]))
    return out


def report_token_differences(what: str, a: dict, b: dict) -> list[tuple[int, int, int, int]]:
    """Prints whether the free-running greedy tokens of two runs are identical and, where not, each prompt's
    first differing position with both runs' logprobs of the two candidate tokens there (a near-tie shows as
    a small margin); returns first_differences(a, b)."""
    diffs = first_differences(a, b)
    n, length = len(a["tokens"]), max((len(t) for t in a["tokens"]), default=0)
    if not diffs:
        print(f"{what}: greedy tokens identical ({n} prompts x {length} tokens)")
        return diffs

    def lp(run: dict, i: int, pos: int, tok: int) -> str:
        v = run["logprobs"][i][pos].get(str(tok))
        return "not in top-5" if v is None else f"{v:.4f}"

    print(f"{what}: greedy tokens differ in {len(diffs)} of {n} prompts ({n} x {length} tokens); "
          f"first differing position per prompt:")
    for i, pos, x, y in diffs:
        print(f"{what}:   prompt {i} token {pos}: {x} vs {y}; logprobs of ({x}, {y}): first run "
              f"({lp(a, i, pos, x)}, {lp(a, i, pos, y)}), second run ({lp(b, i, pos, x)}, {lp(b, i, pos, y)})")
    return diffs


def assert_rotated(what: str, result: dict, hidden: int | None = None) -> None:
    """Every kbit layer holds its input rotation (layer_summary's ``rotation``): attention and dense layers one,
    routed experts two, the first over the hidden size (when given)."""
    kbit = {n: i for n, i in result["layers"].items() if "bits" in i}
    assert kbit, what
    for name, info in kbit.items():
        rot = info.get("rotation", {})
        if "Mo" in info["method"]:
            assert set(rot) == {"kbit_w13_rot_signs", "kbit_w2_rot_signs"}, (what, name, info)
            assert hidden is None or rot["kbit_w13_rot_signs"] == hidden, (what, name, info)
        else:
            assert set(rot) == {"kbit_rot_signs"}, (what, name, info)


def packed_weight_differences(a: dict, b: dict) -> list[str]:
    """kbit layers whose packed weights (layer_summary's hash) differ between two runs, or that only one has."""
    ha, hb = ({n: i["hash"] for n, i in r["layers"].items() if "hash" in i} for r in (a, b))
    return sorted(n for n in ha.keys() | hb.keys() if ha.get(n) != hb.get(n))


def max_logprob_gap(a: dict, b: dict) -> float:
    """Largest |logprob difference| of the chosen token, over positions where both runs chose the same prefix."""
    worst = 0.0
    for ta, tb, la, lb in zip(a["tokens"], b["tokens"], a["logprobs"], b["logprobs"]):
        for x, y, sa, sb in zip(ta, tb, la, lb):
            if x != y:
                break
            worst = max(worst, abs(sa[str(x)] - sb[str(x)]))
    return worst


def engine_has_arg(name: str) -> bool:
    """Whether this vLLM's EngineArgs (what LLM(...) keyword arguments go to) has the field ``name``."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    return name in {f.name for f in dataclasses.fields(EngineArgs)}


def arch_kwargs(kind: str) -> dict:
    """LLM kwargs an architecture needs on the GPU machine: qwen3_next's gated delta-net prefill on Triton
    (vLLM's default on Hopper is FlashInfer's kernel, and flashinfer is not installed there), where this vLLM
    has the setting (``gdn_prefill_backend``, vLLM 0.26+)."""
    if kind == "qwen3_next" and engine_has_arg("gdn_prefill_backend"):
        return {"gdn_prefill_backend": "triton"}
    return {}


def online_kwargs(config: dict) -> dict:
    """LLM kwargs for online kbit quantization with the given quantization_config (the --hf-overrides route)."""
    return {"quantization": "kbit", "hf_overrides": {"quantization_config": {"quant_method": "kbit", **config}}}


# The load summary KbitConfig logs once per loaded model and rank (vllm_kbit/vllm/load_report.py).
SUMMARY = re.compile(
    r"kbit: quantized (?P<linear>\d+) linear layers? and (?P<experts>\d+) routed-expert blocks?"
    r"(?: to (?P<bits>[^:]+))?: weights (?P<before>[\d.]+) GiB in (?P<dtype>\S+) -> (?P<after>[\d.]+) GiB"
    r"; left unquantized: (?P<left>none|(?P<left_linear>\d+ linear layers?)?(?: and )?"
    r"(?P<left_experts>\d+ routed-expert blocks?)? \((?P<why>[^)]*)\))"
)


def _leading_int(text: str | None) -> int:
    return int(text.split()[0]) if text else 0


def load_summaries(result: dict) -> list[re.Match]:
    """The load summary lines of an engine run (one per tensor-parallel rank)."""
    return [m for m in map(SUMMARY.search, result["kbit_log"]) if m]


def assert_every_layer_accounted_for(what: str, result: dict) -> dict[str, list[str]]:
    """Every linear / routed-expert layer of rank 0 is kbit, or left unquantized by the kbit config for a
    reason it logs (its summary counts it; format limits also name it in a warning), or built by vLLM
    without a quantization config (the config is never asked: router gates, conv1d). The summary line is
    present once per rank and counts exactly these layers, bits and sizes. Returns the layer names by class
    ("kbit", "left", "not_offered")."""
    ranks = result["layers_per_rank"]
    summaries = load_summaries(result)
    assert len(summaries) == len(ranks), (
        f"{what}: {len(summaries)} load summary lines for {len(ranks)} ranks: {result['kbit_log']}")
    layers, summary = result["layers"], summaries[0]
    groups: dict[str, list[str]] = {"kbit": [], "left": [], "not_offered": []}
    count = {"linear": 0, "experts": 0, "left_linear": 0, "left_experts": 0}
    bits: dict[int, int] = {}
    packed = 0
    for name, info in layers.items():
        if "Embedding" in info["method"] and "bits" not in info and "left_unquantized" not in info:
            continue  # embed_tokens, and lm_head unless quantize_lm_head
        kind = "experts" if "MoE" in info["method"] or "w13_weight" in info["params"] else "linear"
        if "bits" in info:
            groups["kbit"].append(name)
            count[kind] += 1
            bits[info["bits"]] = bits.get(info["bits"], 0) + 1
            packed += sum(_nbytes(*p) for n, p in info["params"].items() if n.endswith(("qweight", "absmax")))
        elif "left_unquantized" in info:
            groups["left"].append(name)
            count[f"left_{kind}"] += 1
            if info["left_unquantized"] != "modules_to_not_convert":
                assert any(name in line for line in result["kbit_log"]), f"{what}: no warning names {name}"
        else:
            assert info.get("quant_config", "") is None, (
                f"{what}: {name} ({info['method']}) is neither kbit nor left unquantized by kbit")
            groups["not_offered"].append(name)
    assert (int(summary["linear"]), int(summary["experts"])) == (count["linear"], count["experts"]), (summary[0], count)
    assert _leading_int(summary["left_linear"]) == count["left_linear"], (summary[0], count)
    assert _leading_int(summary["left_experts"]) == count["left_experts"], (summary[0], count)
    assert (summary["left"] == "none") == (count["left_linear"] + count["left_experts"] == 0), summary[0]
    if len(bits) == 1:
        k = next(iter(bits))
        assert summary["bits"] == f"{k} bits", summary[0]
        # k bits + one E4M4 byte per 32 weights, against 16 bits per weight (bf16)
        assert abs(float(summary["after"]) / float(summary["before"]) - (4 * k + 1) / 64) < 0.01, summary[0]
    else:
        got = {int(k): int(n) for k, n in re.findall(r"(\d+) \((\d+) layers?\)", summary["bits"] or "")}
        assert got == bits, (summary[0], bits)
    assert abs(float(summary["after"]) - packed / 2**30) <= 0.006 * float(summary["after"]), (summary[0], packed)
    return groups


def _nbytes(dtype: str, shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=getattr(torch, dtype.removeprefix("torch."))).element_size()


# LoRA runs: three random adapters (kbit_dev.lora) served at once beside the base model: prompt / probe i uses
# adapter PROMPT_LORAS[i] (-1: none), all in one batch, with room for four adapters (max_loras).
LORA_ENGINE = {"enable_lora": True, "max_loras": 4, "max_lora_rank": 8}
# vLLM's LoRA logits processor fails on prompt_logprobs on its CPU build, so every engine of the LoRA comparison
# (the references too, for the same computation) probes one request per prefix, with all logprobs returned.
PROBE_BY_PREFIX = {"max_logprobs": 384}  # tiny_models.VOCAB_SIZE
N_ADAPTERS = 3
PROMPT_LORAS = [i % (N_ADAPTERS + 1) - 1 for i in range(len(PROMPTS))]


def lora_runs(engine, tiny, tmp_path_factory, kind: str, targets: tuple[str, ...], tag: str = "",
              llm_kwargs: dict | None = None, rotation: dict | None = None,
              ref_kwargs: dict | None = None) -> tuple[dict, dict, dict]:
    """(kbit-4 served with the adapters, the reference, the dequantized model without adapters) for ``kind``.

    The kbit engine quantizes online (``ONLINE[4]``, with ``rotation`` when given: every layer fed x R) and serves
    N_ADAPTERS random adapters on ``targets`` beside the base model in one batch. The reference takes each prompt
    from a bf16 engine serving, without LoRA, the dequantized kbit-4 weights (decoded in the original basis when
    rotated) with that prompt's adapter merged in (``alpha / r * B @ A``; the dequantized model itself for prompts
    without one). ``ref_kwargs`` go to the reference engines only (the GPU test runs them eager: they check the
    arithmetic, and four more CUDA-graph captures cost minutes)."""
    from kbit_dev.lora import make_adapter, merge_adapter

    config = {**ONLINE[4], **({"rotation": rotation} if rotation is not None else {})}
    root = tmp_path_factory.mktemp(f"lora-{kind}{tag}")
    adapters = [make_adapter(tiny[kind], str(root / f"adapter{i}"), seed=100 + i, targets=targets)
                for i in range(N_ADAPTERS)]
    deq_dir = dequantized_checkpoint(tiny[kind], str(root / "deq4"), settings_of(config))
    extra = {**PROBE_BY_PREFIX, **(llm_kwargs or {})}
    by_prefix = {"probe_by_prefix": True}
    specs = [(f"{kind}-online4-lora{tag}", tiny[kind], {**online_kwargs(config), **LORA_ENGINE, **extra},
              None, None, {"loras": adapters, "prompt_loras": PROMPT_LORAS, **by_prefix})]
    for i, adapter in enumerate(adapters):
        merged = str(root / f"deq4-merged{i}")
        import shutil

        shutil.copytree(deq_dir, merged)
        merge_adapter(merged, adapter)
        specs.append((f"{kind}-deq4-merged{i}{tag}", merged, {**extra, **(ref_kwargs or {})}, None, None, by_prefix))
    specs.append((f"{kind}-deq4-plain{tag}", deq_dir, {**extra, **(ref_kwargs or {})}, None, None, by_prefix))
    for key, model, kwargs, env, text, lora in specs:
        engine.start(key, model, kwargs, env, text, **lora)
    got, *refs = [engine(key, model, kwargs, env, text, **lora) for key, model, kwargs, env, text, lora in specs]
    plain = refs[-1]
    ref = select_prompts(refs, [a if a >= 0 else N_ADAPTERS for a in PROMPT_LORAS])
    return got, ref, plain


def assert_lora_agrees(what: str, got: dict, ref: dict, plain: dict) -> None:
    """kbit with the adapters agrees with the merged reference as two computations of one model do
    (assert_agree), and the adapters matter: on the prompts served with one, the greedy next tokens of the model
    without adapters differ at a good share of the positions."""
    assert_agree(what, got, ref)
    adapted = [i for i, a in enumerate(PROMPT_LORAS) if a >= 0]
    sub = lambda run: {"probes": [run["probes"][i] for i in adapted]}  # noqa: E731
    moved = 1 - probe_match(sub(got), sub(plain))
    print(f"{what}: the adapters change the greedy next token at {moved:.1%} of the adapted positions")
    assert moved >= 0.2, f"{what}: the adapters changed only {moved:.1%} of the greedy next tokens"
