"""Convert a bf16/fp16 Hugging Face safetensors checkpoint into a pre-quantized kbit checkpoint.

Reads the input shards one tensor at a time (``safetensors.safe_open``; nothing is
ever unpickled: ``.bin``/``.pt`` checkpoints are refused), quantizes each linear
weight ``<p>.weight`` into ``<p>.qweight`` int32 ``[N, K/32, k]`` + ``<p>.absmax``
uint8 ``[N, K/32]`` (docs/format.md, sections 7 and 8), copies every other tensor unchanged, and
writes sharded safetensors plus ``model.safetensors.index.json``. config.json gains
``quantization_config`` (``"prequantized": true``), so ``vllm serve OUT_DIR``
needs no flag; every other top-level file (tokenizer, generation config, ...) is
copied.

Which tensors are quantized: 2-D floating-point ``.weight`` tensors, except

* embeddings and output heads (names with a component in :data:`NEVER_QUANTIZED`); with
  ``quantize_lm_head`` the ``lm_head`` is quantized unless the config ties it to the embedding
  (then it stays bf16 with a note in the summary, as the vLLM plugin does online),
* modules matched by ``modules_to_not_convert`` (per-expert tensors are matched
  as their ``<block>.experts`` module, see :mod:`vllm_kbit.settings`),
* linear weights whose K is not a multiple of 32 (left in bf16, the same rule the
  vLLM plugin applies online); per-expert weights with such a K are an error,
* weights with |w| above the largest E4M4 block scale (31, :data:`reference.RANGE_MAX`): a checkpoint
  carries no range scale (it loads with scale 1), so such a tensor is left in bf16 with a warning;
  a routed expert's tensor is an error instead (the loader needs every expert quantized): serve that
  model with online quantization, which range-scales (:func:`reference.range_scale`). Tensors whose
  max |w| is below 2^-4 are quantized at scale 1 as they always were (blocks below 2^-10 lose precision).

The packed tensors are exactly what online quantization (``--quantization kbit``)
of the same checkpoint produces when vLLM runs in the checkpoint's dtype (for tensors with max |w| in
[2^-4, 31], where online quantization's range scale is 1), unless
``gptq`` is set: then the linear layers and routed experts of the decoder layers of transformers'
model of the checkpoint are rounded by GPTQ on calibration text, one decoder layer at a time
(:mod:`vllm_kbit.gptq`; same format and scale candidates, different indices and scale choices), and the
rest (lm_head with ``quantize_lm_head``) as online.

With ``settings.rotation`` every quantized weight is stored rotated, Q(W R) (docs/format.md, section 9): GPTQ
rounds W R on the rotated inputs' Hessian, round-to-nearest quantizes W R; config.json records the rotation
with the block of every input size quantized.
"""

from __future__ import annotations

import json
import re
import os
import shutil
import sys
import math
import time
from dataclasses import dataclass, field

import torch

from vllm_kbit import reference as fmt
from vllm_kbit import ops  # noqa: F401  (registers torch.ops.kbit)
from vllm_kbit.settings import LM_HEAD, KbitSettings, module_key

NEVER_QUANTIZED = ("embed_tokens", "lm_head", "wte", "wpe", "embeddings", "embed_positions")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".msgpack", ".h5")
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 4 * 1024**3


class ConvertError(ValueError):
    """A malformed input checkpoint or an unusable output location."""


@dataclass
class ConvertSummary:
    tensors: int = 0
    quantized: int = 0
    input_bytes: int = 0
    output_bytes: int = 0
    quantized_input_bytes: int = 0
    quantized_output_bytes: int = 0
    left_unquantized: list[str] = field(default_factory=list)
    out_of_range: list[str] = field(default_factory=list)  # |w| above the E4M4 range: kept bf16
    tied_lm_head: bool = False  # quantize_lm_head asked for, but the head is tied to the embedding
    shards: list[str] = field(default_factory=list)
    gptq: object = None  # vllm_kbit.gptq.CalibrationReport of a --gptq conversion

    def format(self) -> str:
        gib = 1024**3
        lines = [
            f"tensors: {self.tensors} ({self.quantized} quantized) in {len(self.shards)} shard(s)",
            f"size: {self.input_bytes / gib:.3f} GiB -> {self.output_bytes / gib:.3f} GiB "
            f"({self.output_bytes / max(self.input_bytes, 1):.1%} of the input, "
            f"{(self.input_bytes - self.output_bytes) / gib:.3f} GiB saved)",
        ]
        if self.quantized:
            lines.append(
                f"quantized weights: {self.quantized_input_bytes / gib:.3f} GiB -> "
                f"{self.quantized_output_bytes / gib:.3f} GiB"
            )
        if self.left_unquantized:
            lines.append(f"left unquantized (K not a multiple of 32): {', '.join(self.left_unquantized)}")
        if self.out_of_range:
            lines.append(f"left unquantized (|w| > {fmt.E4M4_MAX:g}): {', '.join(self.out_of_range)}")
        if self.tied_lm_head:
            lines.append("lm_head left bf16: tied to the input embedding (quantize_lm_head applies to untied heads)")
        if self.gptq is not None and self.gptq.layer_seconds:
            g = self.gptq
            experts = f"; routed experts: {g.experts} ({g.experts_fallback} on all tokens)" if g.experts else ""
            lines.append(f"gptq: {len(g.layer_seconds)} decoder layers one at a time on {g.device}, {g.tokens} tokens, "
                         f"{sum(g.layer_seconds):.1f} s{experts}")
        return "\n".join(lines)


def _input_files(in_dir: str) -> list[str]:
    index = os.path.join(in_dir, INDEX_NAME)
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConvertError(f"kbit convert: {index} is not a valid safetensors index: {e}") from None
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.isfile(os.path.join(in_dir, name)):
                raise ConvertError(f"kbit convert: {INDEX_NAME} lists {name}, which is missing from {in_dir}")
        return files
    files = sorted(f for f in os.listdir(in_dir) if f.endswith(".safetensors"))
    if not files:
        others = sorted(f for f in os.listdir(in_dir) if f.endswith(WEIGHT_SUFFIXES))
        hint = f" (found {', '.join(others)}: pickle-based checkpoints are never loaded; convert them to safetensors)" if others else ""
        raise ConvertError(f"kbit convert: no .safetensors files in {in_dir}{hint}")
    return files


def _read_config(in_dir: str) -> dict:
    path = os.path.join(in_dir, "config.json")
    if not os.path.isfile(path):
        raise ConvertError(f"kbit convert: {in_dir} has no config.json; expected a Hugging Face model directory")
    try:
        with open(path) as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ConvertError(f"kbit convert: {path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ConvertError(f"kbit convert: {path} does not hold a JSON object")
    if "quantization_config" in config:
        method = config["quantization_config"].get("quant_method", "?")
        raise ConvertError(f"kbit convert: {in_dir} is already quantized (quant_method={method!r}); give a bf16/fp16 checkpoint")
    return config


def _check_output(in_dir: str, out_dir: str, overwrite: bool) -> None:
    src, dst = os.path.realpath(in_dir), os.path.realpath(out_dir)
    if src == dst or dst.startswith(src + os.sep) or src.startswith(dst + os.sep):
        raise ConvertError(f"kbit convert: output {out_dir} overlaps the input {in_dir}; choose another directory")
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise ConvertError(f"kbit convert: output {out_dir} exists and is not a directory")
    if os.path.isdir(dst) and os.listdir(dst) and not overwrite:
        raise ConvertError(f"kbit convert: output {out_dir} is not empty (pass --overwrite to replace its contents)")


def tied_word_embeddings(config: dict) -> bool:
    """Whether a Hugging Face config.json ties the output head to the input embedding (text config first,
    as vLLM's models read it; a config without the key gets its transformers class default)."""
    for cfg in (config.get("text_config"), config):
        if isinstance(cfg, dict) and "tie_word_embeddings" in cfg:
            return bool(cfg["tie_word_embeddings"])
    try:
        from transformers import AutoConfig

        return bool(getattr(AutoConfig.for_model(config["model_type"]), "tie_word_embeddings", True))
    except (ImportError, KeyError, ValueError):
        return True  # transformers' PretrainedConfig default


def quantization_decision(
    name: str, tensor_shape: tuple, dtype: torch.dtype, settings: KbitSettings, tied_lm_head: bool = False
) -> int | None:
    """Bits to quantize checkpoint tensor ``name`` with, or None to copy it unchanged.

    ``tied_lm_head``: the config ties lm_head to the embedding (it then stays bf16 under quantize_lm_head).
    Raises for per-expert weights whose K the format cannot hold.
    """
    if not name.endswith(".weight") or len(tensor_shape) != 2 or not dtype.is_floating_point:
        return None
    module = name[: -len(".weight")]
    head = module.rpartition(".")[2] == LM_HEAD
    if head and not (settings.quantize_lm_head and not tied_lm_head):
        return None
    if not head and any(f".{c}." in f".{module}." for c in NEVER_QUANTIZED):
        return None
    key = module_key(module)
    if settings.is_skipped(key):
        return None
    if tensor_shape[1] % fmt.BLOCK_SIZE != 0:
        if key != module:
            raise ConvertError(
                f"kbit convert: expert weight {name} has K={tensor_shape[1]}, not a multiple of {fmt.BLOCK_SIZE}; "
                f"add {key!r} to modules_to_not_convert"
            )
        return -1
    return settings.bits_for(key)


def resolve_device(device: str) -> str:
    """``auto``: the current CUDA GPU when torch sees one, else the CPU; anything else as given."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def measure_rate(device: str, k: int, dtype: torch.dtype = torch.bfloat16) -> float:
    """Weights per second ``kbit::quantize`` reaches on ``device`` at k bits (default scale search):
    one timed call on a fresh random 2048 x 2048 weight after a warm-up, for convert's estimate."""
    W = torch.randn(2048, 2048, device=device).mul_(0.02).to(dtype)
    cb = fmt.default_codebook(k, device)
    torch.ops.kbit.quantize(W[:64].contiguous(), cb, k)
    if W.is_cuda:
        torch.cuda.synchronize(W.device)
    t = time.perf_counter()
    torch.ops.kbit.quantize(W, cb, k)
    if W.is_cuda:
        torch.cuda.synchronize(W.device)
    return W.numel() / max(time.perf_counter() - t, 1e-9)


def convert(
    in_dir: str,
    out_dir: str,
    settings: KbitSettings,
    device: str = "auto",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    progress: bool = True,
    gptq: bool = False,
    calibration_text: str | None = None,
    calibration_tokens: int | None = None,
    gptq_options: dict | None = None,
) -> ConvertSummary:
    """Writes the kbit checkpoint of ``in_dir`` to ``out_dir``; returns what was done. On failure the
    output directory is removed if this call created it (emptied otherwise).

    ``device`` quantizes (``auto``: a CUDA GPU where there is one, else the CPU's compiled kernel on
    every core torch uses). With ``progress`` it prints the weights to quantize and an estimate first,
    then a bar with the rate.

    gptq=True rounds with GPTQ (:mod:`vllm_kbit.gptq`) on ``calibration_text`` (default: the
    bundled :func:`vllm_kbit.gptq.calibration_text`; its first ``calibration_tokens``, default
    :data:`vllm_kbit.gptq.DEFAULT_CALIBRATION_TOKENS`, in windows of 512); the model is loaded once with transformers
    in the checkpoint's dtype on the CPU and calibrated one decoder layer at a time on ``device``; routed
    experts on the tokens routed to them. ``summary.gptq`` says what it did."""
    if not os.path.isdir(in_dir):
        raise ConvertError(f"kbit convert: input {in_dir} is not a directory")
    device = resolve_device(device)
    config = _read_config(in_dir)
    files = _input_files(in_dir)
    _check_output(in_dir, out_dir, overwrite)
    created = not os.path.exists(out_dir)
    if os.path.isdir(out_dir) and overwrite:
        shutil.rmtree(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    try:
        summary = ConvertSummary()
        if settings.rotation is not None:
            _check_rotation(in_dir, files, settings)
        precomputed = (_gptq_weights(in_dir, files, settings, device, calibration_text, calibration_tokens, progress, summary,
                                     gptq_options or {})
                       if gptq else {})
        return _convert(in_dir, out_dir, config, files, settings, device, max_shard_bytes, progress, precomputed, summary)
    except BaseException:
        # A failed conversion leaves nothing behind: the directory it created goes, or, in a directory
        # that existed (empty, or emptied by --overwrite), what it wrote.
        if created:
            shutil.rmtree(out_dir, ignore_errors=True)
        else:
            for entry in os.listdir(out_dir):
                path = os.path.join(out_dir, entry)
                shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
        raise


def _check_rotation(in_dir, files, settings) -> None:
    """Every input size K the conversion quantizes has a rotation block (``rotation.tp`` divides K into
    shards that a power of two >= 2 divides); else a one-line ConvertError, before any work."""
    from safetensors import safe_open

    for name in files:
        with safe_open(os.path.join(in_dir, name), framework="pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                shape, dtype = tuple(sl.get_shape()), _DTYPES.get(sl.get_dtype())
                if dtype is None or quantization_decision(key, shape, dtype, settings) in (None, -1):
                    continue
                try:
                    settings.rotation.block(shape[1])
                except ValueError as e:
                    raise ConvertError(f"kbit convert: tensor {key}: {e}") from None


def _gptq_weights(in_dir, files, settings, device, text, n_tokens, progress, summary, options) -> dict:
    """{checkpoint module name: (qweight, absmax)} of the weights GPTQ rounds (see :func:`convert`): the model
    loaded in the checkpoint's dtype on the CPU, calibrated one decoder layer at a time on ``device``."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_kbit import gptq

    headers = {}  # checkpoint tensor -> (shape, dtype): what the conversion loop decides by
    for name in files:
        with safe_open(os.path.join(in_dir, name), framework="pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                headers[key] = (tuple(sl.get_shape()), _DTYPES.get(sl.get_dtype()))
    tokenizer = AutoTokenizer.from_pretrained(in_dir)
    model = AutoModelForCausalLM.from_pretrained(in_dir, dtype="auto").eval()

    def select(module):
        shape, dtype = headers.get(f"{module}.weight", ((), None))
        bits = None if dtype is None else quantization_decision(f"{module}.weight", shape, dtype, settings)
        return None if bits in (None, -1) else (bits, settings.codebook(bits))

    def report(message):
        if progress:
            print(f"kbit convert: gptq {message}", flush=True)

    calibration = summary.gptq = gptq.CalibrationReport()
    try:
        result = gptq.quantize_model(model, tokenizer, select, text, n_tokens or gptq.DEFAULT_CALIBRATION_TOKENS,
                                     progress=report, device=device, report=calibration, rotation=settings.rotation,
                                     **options)
    finally:
        del model
    if calibration.experts_fallback:
        thresholds = "/".join(str(t) for t in sorted(set(calibration.min_expert_tokens)))
        print(f"kbit convert: warning: {calibration.experts_fallback} of {calibration.experts} routed experts got fewer "
              f"than {thresholds} routed calibration tokens ({gptq.EXPERT_MIN_TOKENS_PER_BLOCK} per {fmt.BLOCK_SIZE} "
              "inputs); their GPTQ rounding used the Hessian of every token entering their layer",
              file=sys.stderr, flush=True)
    return result


def _convert(in_dir, out_dir, config, files, settings, device, max_shard_bytes, progress, precomputed=None,
             summary=None) -> ConvertSummary:
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import save_file
    from tqdm import tqdm

    settings = KbitSettings.from_dict({**settings.to_dict(), "prequantized": True})
    tied_head = settings.quantize_lm_head and tied_word_embeddings(config)
    codebooks = {k: settings.codebook(k).to(device) for k in settings.bit_widths}

    def open_shard(name):
        try:
            return safe_open(os.path.join(in_dir, name), framework="pt", device=device)
        except (SafetensorError, OSError) as e:
            raise ConvertError(f"kbit convert: cannot read {name}: {e}") from None

    # The plan, from the headers alone: how many weights each bit width quantizes (and, with a rotation, the
    # input sizes it rotates: each must have a block, recorded in the config).
    tensors, todo, input_sizes = 0, {}, set()
    for name in files:
        with open_shard(name) as f:
            for key in f.keys():
                tensors += 1
                sl = f.get_slice(key)
                dtype = _DTYPES.get(sl.get_dtype())
                bits = None if dtype is None else quantization_decision(key, tuple(sl.get_shape()), dtype, settings, tied_head)
                if bits not in (None, -1):
                    todo[bits] = todo.get(bits, 0) + math.prod(sl.get_shape())
                    input_sizes.add(sl.get_shape()[1])
    rotation = settings.rotation
    if rotation is not None:
        for K in sorted(input_sizes):
            try:
                rotation.block(K)
            except ValueError as e:
                raise ConvertError(f"kbit convert: {e}") from None
    n_weights = sum(todo.values())
    if progress and n_weights and not precomputed:
        seconds = sum(n / measure_rate(device, k) for k, n in todo.items())
        where = f"{device} ({torch.get_num_threads()} threads)" if device == "cpu" else device
        per_k = ", ".join(f"{n / 1e6:.1f}M at k={k}" for k, n in sorted(todo.items()))
        print(f"kbit convert: {tensors} tensors, {n_weights / 1e6:.1f}M weights to quantize ({per_k}) on {where}; "
              f"quantizing takes about {seconds:.0f} s (+ reading and writing)", flush=True)

    summary = ConvertSummary() if summary is None else summary
    summary.tied_lm_head = tied_head
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0
    weight_map: dict[str, str] = {}
    tmp_names: list[str] = []

    def flush():
        nonlocal pending, pending_bytes
        if not pending:
            return
        tmp = f"model-{len(tmp_names) + 1:05d}.safetensors.tmp"
        save_file(pending, os.path.join(out_dir, tmp), metadata={"format": "pt"})
        for t in pending:
            weight_map[t] = tmp
        tmp_names.append(tmp)
        pending, pending_bytes = {}, 0

    def add(name, t):
        nonlocal pending_bytes
        t = t.contiguous().cpu()
        if pending_bytes and pending_bytes + t.nbytes > max_shard_bytes:
            flush()
        pending[name] = t
        pending_bytes += t.nbytes
        summary.output_bytes += t.nbytes

    # Counts quantized weights, so the bar's rate is the quantizer's (weights/s), reading included.
    bar = tqdm(total=n_weights, desc="kbit convert", unit="w", unit_scale=True, disable=not progress)
    for file_name in files:
        with open_shard(file_name) as f:
            for name in f.keys():
                try:
                    sl = f.get_slice(name)
                    shape, dtype = tuple(sl.get_shape()), _DTYPES.get(sl.get_dtype())
                    if dtype is None:
                        raise ConvertError(f"kbit convert: tensor {name} in {file_name} has unsupported dtype {sl.get_dtype()}")
                    bits = quantization_decision(name, shape, dtype, settings, tied_head)
                    t = f.get_tensor(name)
                except SafetensorError as e:
                    raise ConvertError(f"kbit convert: cannot read tensor {name} from {file_name}: {e}") from None
                summary.tensors += 1
                summary.input_bytes += t.nbytes
                if bits is None or bits == -1:
                    if bits == -1:
                        summary.left_unquantized.append(name[: -len(".weight")])
                    add(name, t)
                else:
                    module = name[: -len(".weight")]
                    original = t
                    if rotation is not None and not (precomputed and module in precomputed):
                        t = rotation.rotate(t.float())  # stored as Q(W R): rotated in float32, then quantized
                    amax = fmt.weight_amax(t)
                    if math.isfinite(amax) and amax > fmt.RANGE_MAX:  # NaN / Inf go on to the op, which refuses them
                        if module_key(module) != module:
                            raise ConvertError(
                                f"kbit convert: routed expert tensor {name} has |w| = {amax:.4g}, above the largest "
                                f"E4M4 block scale {fmt.E4M4_MAX:g}, and a converted checkpoint has no range scale; "
                                "serve this model with online quantization (--quantization kbit on the bf16 "
                                "checkpoint), which range-scales it"
                            )
                        print(f"kbit convert: warning: {name} has |w| = {amax:.4g}, above the largest E4M4 block "
                              f"scale {fmt.E4M4_MAX:g}; left unquantized (online quantization range-scales it)",
                              file=sys.stderr, flush=True)
                        summary.out_of_range.append(module)
                        add(name, original)
                        bar.update(t.numel())
                        del t
                        continue
                    if precomputed and module in precomputed:
                        qweight, absmax = precomputed.pop(module)
                    else:
                        try:  # the op refuses NaN and Inf
                            qweight, absmax = torch.ops.kbit.quantize(t.contiguous(), codebooks[bits], bits)
                        except ValueError as e:
                            raise ConvertError(f"kbit convert: tensor {name}: {e}") from None
                    if module_key(module) != module:
                        # A routed expert's qweight goes 2-D, [N, K/32 * k] (the same words): every supported vLLM
                        # hands a 2-D tensor named for one expert to that expert's loader (docs/format.md).
                        qweight = qweight.flatten(1)
                    add(f"{module}.qweight", qweight)
                    add(f"{module}.absmax", absmax)
                    summary.quantized += 1
                    summary.quantized_input_bytes += original.nbytes
                    summary.quantized_output_bytes += qweight.nbytes + absmax.nbytes
                    bar.update(t.numel())
                del t
    bar.close()
    flush()

    n = len(tmp_names)
    final = {tmp: f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, tmp in enumerate(tmp_names)}
    for tmp, dst in final.items():
        os.replace(os.path.join(out_dir, tmp), os.path.join(out_dir, dst))
    summary.shards = list(final.values())
    with open(os.path.join(out_dir, INDEX_NAME), "w") as f:
        json.dump({"metadata": {"total_size": summary.output_bytes}, "weight_map": {k: final[v] for k, v in sorted(weight_map.items())}}, f, indent=2)

    if rotation is not None:  # the block of every input size rotated here, written out for the loader
        settings.rotation = rotation.recorded(sorted(input_sizes))
    config["quantization_config"] = settings.to_dict()
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for entry in sorted(os.listdir(in_dir)):
        src = os.path.join(in_dir, entry)
        if not os.path.isfile(src) or entry in ("config.json", INDEX_NAME) or entry.endswith(WEIGHT_SUFFIXES):
            continue
        shutil.copy2(src, os.path.join(out_dir, entry))
    return summary


_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


_EXPERT_QWEIGHT = re.compile(r"\.experts\.\d+\.[^.]+\.qweight$")


def upgrade(in_dir: str, out_dir: str, overwrite: bool = False) -> int:
    """Copies a kbit checkpoint from an older ``vllm-kbit convert`` with its routed experts' qweights rewritten
    2-D, ``[N, K/32, k]`` -> ``[N, K/32 * k]`` (the same words; what ``convert`` writes now, and what vLLM before
    0.32 can load). Every other file and tensor is copied as it is. Returns the number of tensors rewritten."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import save_file

    try:
        with open(os.path.join(in_dir, "config.json")) as f:
            method = (json.load(f).get("quantization_config") or {}).get("quant_method")
    except (OSError, ValueError, AttributeError):
        method = None
    if method != "kbit":
        raise ConvertError(f"kbit upgrade: {in_dir} is not a kbit checkpoint (its config.json has no kbit "
                           "quantization_config); `vllm-kbit convert` writes one from a bf16 checkpoint")
    files = _input_files(in_dir)
    _check_output(in_dir, out_dir, overwrite)
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(in_dir):
        path = os.path.join(in_dir, name)
        if os.path.isfile(path) and not name.endswith(".safetensors"):
            shutil.copy2(path, os.path.join(out_dir, name))
    rewritten = 0
    for file in files:
        try:
            with safe_open(os.path.join(in_dir, file), framework="pt") as f:
                metadata = f.metadata() or {"format": "pt"}
                tensors = {key: f.get_tensor(key) for key in f.keys()}
        except (SafetensorError, OSError) as e:
            raise ConvertError(f"kbit upgrade: cannot read {file}: {e}") from None
        for key, t in tensors.items():
            if _EXPERT_QWEIGHT.search(key) and t.dim() == 3:
                tensors[key] = t.flatten(1)
                rewritten += 1
        save_file(tensors, os.path.join(out_dir, file + ".tmp"), metadata=metadata)
        os.replace(os.path.join(out_dir, file + ".tmp"), os.path.join(out_dir, file))
    return rewritten
