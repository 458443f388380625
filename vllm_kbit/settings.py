"""kbit quantization settings: bits, codebook, per-module overrides, skipped modules (no vLLM import).

Used by the vLLM plugin (:mod:`vllm_kbit.vllm.config`) and by ``vllm-kbit convert``.

Where the settings come from
----------------------------
* Pre-quantized checkpoint (``vllm-kbit convert``): config.json carries
  ``quantization_config = {"quant_method": "kbit", "prequantized": true, "bits": k,
  "blocksize": 32, "codebook": ..., "modules_to_not_convert": [...],
  "bits_overrides": {...}}``; vLLM detects it with no ``--quantization`` flag.
* Online (a bf16/fp16 checkpoint): ``--quantization kbit`` alone quantizes with
  the defaults below. Settings go through vLLM's ``--hf-overrides``, which merges
  a ``quantization_config`` dict into the model config (vLLM then needs no
  ``--quantization`` flag either)::

      vllm serve MODEL --hf-overrides '{"quantization_config": {"quant_method": "kbit",
          "bits": 3, "bits_overrides": {"self_attn": 5}}}'

Fields
------
``bits``: 2..5 (default 4). ``codebook``: ``"normal_float_by_bits"`` (default: ``"normal_float"``
at 2 bits, ``"normal_float_zero"`` at 3..5), ``"normal_float_zero"`` (normal quantiles with an exact
zero), ``"normal_float"`` (symmetric, no zero level; checkpoints converted under an earlier default
name theirs), a list of
``2**bits`` ascending float32 values with max |c| == 1, or a dict ``{"<k>": [...]}``
per bit width. ``bits_overrides``: ``{regex: bits}``; a module takes the bits of
the first regex (in order) that ``re.search`` finds in its name. ``modules_to_not_convert``:
module names left in bf16; an entry matches whole dotted components of a name
(``"gate"`` matches ``model.layers.0.mlp.gate``, not ``gate_proj``). Default:
:data:`DEFAULT_MODULES_TO_NOT_CONVERT` (router gates and lm_head); a given list
replaces it. ``quantize_lm_head``: ``true`` quantizes the output head (``lm_head``) too, at
``bits_for("lm_head")`` (``bits``, or a ``bits_overrides`` entry matching ``lm_head``); default
``false``. It takes ``lm_head`` out of the default ``modules_to_not_convert`` (a given list that
names ``lm_head`` contradicts it and is refused). A head tied to the input embedding stays bf16
with a warning: the embedding lookup reads the same tensor and stays bf16.

``rotation``: optional, ``{"seed": 0, "max_block": 128, "tp": 1}`` (every key optional; a converted checkpoint
adds ``"method": "hadamard"`` and ``"blocks": {"<K>": b}``): every quantized layer stores Q(W R) and is fed x R,
R a randomized Hadamard transform of its input (:class:`Rotation`, docs/format.md section 9); the vLLM layers
rotate their inputs inside the kbit ops. Absent (the default) means no rotation; online quantization rotates only
when it is given (``--hf-overrides``), since without calibration rotation measured worse.

Names are checkpoint (Hugging Face) module names. A fused vLLM layer (qkv_proj,
gate_up_proj) is looked up through its shards (q_proj, k_proj, v_proj, ...); all
its shards must agree. The routed experts of one MoE block are one module named
``<block>.experts`` (e.g. ``model.layers.3.mlp.experts``).

Rules for layers the format cannot hold
---------------------------------------
* A linear layer whose input size K is not a multiple of 32 stays unquantized
  (bf16), with a warning naming it; ``vllm-kbit convert`` applies the same rule.
* Routed experts whose hidden or intermediate size is not a multiple of 32 are
  refused with an error naming the layer (add it to ``modules_to_not_convert``).
* Weights beyond the E4M4 block scale's range quantize online with a power-of-two range scale
  (:func:`vllm_kbit.reference.range_scale`); NaN / Inf leave a linear layer in bf16 with a warning and
  refuse routed experts. ``vllm-kbit convert`` keeps a dense tensor with |w| > 31 in bf16 and refuses
  such a routed-expert tensor (a checkpoint has no range scale).
* Embeddings are never quantized (the lookup stays bf16); lm_head only with ``quantize_lm_head``
  and only when it is not tied to the embedding; layers other than linear, lm_head and FusedMoE are
  left to vLLM unchanged.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from vllm_kbit import reference as fmt

QUANT_METHOD = "kbit"
DEFAULT_BITS = 4
DEFAULT_CODEBOOK = fmt.DEFAULT_CODEBOOK
LM_HEAD = "lm_head"
DEFAULT_MODULES_TO_NOT_CONVERT = (LM_HEAD, "gate", "shared_expert_gate", "embed_tokens")
_EXPERT_TENSOR = re.compile(r"^(?P<block>.*\.experts)\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)$")
_KNOWN_KEYS = {
    "quant_method",
    "bits",
    "blocksize",
    "codebook",
    "bits_overrides",
    "modules_to_not_convert",
    "prequantized",
    "quantize_lm_head",
    "rotation",
}
ROTATION_METHOD = "hadamard"
_ROTATION_KEYS = {"method", "seed", "max_block", "tp", "blocks"}


def module_key(checkpoint_module: str) -> str:
    """The name a checkpoint module is looked up by: per-expert projections map to their ``<block>.experts``."""
    m = _EXPERT_TENSOR.match(checkpoint_module)
    return m.group("block") if m else checkpoint_module


def name_matches(entry: str, name: str) -> bool:
    """True when ``entry`` is a run of whole dotted components of ``name``."""
    return re.search(r"(^|\.)" + re.escape(entry) + r"(\.|$)", name) is not None


class KbitSettings:
    """The settings of a kbit quantization, independent of vLLM (shared by the plugin and ``vllm-kbit convert``)."""

    def __init__(
        self,
        bits: int = DEFAULT_BITS,
        codebook: str | list | dict | None = None,
        bits_overrides: dict[str, int] | None = None,
        modules_to_not_convert: list[str] | tuple[str, ...] | None = None,
        prequantized: bool = False,
        quantize_lm_head: bool = False,
        rotation: "Rotation | dict | None" = None,
    ) -> None:
        _check_bits(bits, "bits")
        self.bits = bits
        self.bits_overrides: dict[str, int] = dict(bits_overrides or {})
        for pattern, k in self.bits_overrides.items():
            _check_bits(k, f"bits_overrides[{pattern!r}]")
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"kbit: bits_overrides key {pattern!r} is not a valid regex: {e}") from None
        if not isinstance(quantize_lm_head, bool):
            raise ValueError(f"kbit: quantize_lm_head must be true or false, got {quantize_lm_head!r}")
        self.quantize_lm_head = quantize_lm_head
        if modules_to_not_convert is None:
            modules_to_not_convert = DEFAULT_MODULES_TO_NOT_CONVERT
            if quantize_lm_head:
                modules_to_not_convert = tuple(m for m in modules_to_not_convert if m != LM_HEAD)
        if isinstance(modules_to_not_convert, str) or not all(isinstance(m, str) for m in modules_to_not_convert):
            raise ValueError(f"kbit: modules_to_not_convert must be a list of names, got {modules_to_not_convert!r}")
        self.modules_to_not_convert = list(modules_to_not_convert)
        if quantize_lm_head and self.is_skipped(LM_HEAD):
            raise ValueError(
                "kbit: quantize_lm_head is true but modules_to_not_convert lists lm_head; remove one of the two"
            )
        self.codebook_spec = DEFAULT_CODEBOOK if codebook is None else codebook
        self.bit_widths = sorted({bits, *self.bits_overrides.values()})
        self._codebooks = {k: self._make_codebook(k) for k in self.bit_widths}
        self.prequantized = bool(prequantized)
        self.rotation = Rotation.from_dict(rotation) if isinstance(rotation, dict) else rotation
        if self.rotation is not None and not isinstance(self.rotation, Rotation):
            raise ValueError(f"kbit: rotation must be a dict like {{\"seed\": 0}} or null, got {rotation!r}")

    # ------------------------------------------------------------------ codebooks

    def _make_codebook(self, k: int) -> torch.Tensor:
        spec = self.codebook_spec
        if isinstance(spec, str) and spec in fmt.CODEBOOKS:
            return fmt.CODEBOOKS[spec](k)
        if isinstance(spec, dict):
            if str(k) not in spec:
                raise ValueError(f"kbit: codebook dict has no entry for {k} bits (keys: {sorted(spec)})")
            values = spec[str(k)]
        elif isinstance(spec, (list, tuple)):
            if len(self.bit_widths) > 1:
                raise ValueError("kbit: a codebook list serves one bit width; with bits_overrides give {\"<k>\": [...]}")
            values = spec
        else:
            names = " or ".join(repr(n) for n in fmt.CODEBOOKS)
            raise ValueError(f"kbit: codebook must be {names}, a list or a dict, got {spec!r}")
        # Errors name the entry that is wrong: codebook["3"] of a per-bit-width dict, or the codebook list.
        label = f"codebook[{str(k)!r}]" if isinstance(spec, dict) else "codebook"
        try:
            cb = torch.tensor(values, dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"kbit: {label} must be a list of {2**k} numbers, got {values!r}") from None
        try:
            fmt.check_codebook(cb, k)
            fmt.check_codebook_values(cb)
        except (TypeError, ValueError) as e:
            raise ValueError(str(e).replace("kbit: codebook", f"kbit: {label}", 1)) from None
        return cb

    def codebook(self, k: int) -> torch.Tensor:
        return self._codebooks[k]

    # ------------------------------------------------------------------ per-module decisions

    def is_skipped(self, module: str) -> bool:
        return any(name_matches(entry, module) for entry in self.modules_to_not_convert)

    def bits_for(self, module: str) -> int:
        for pattern, k in self.bits_overrides.items():
            if re.search(pattern, module):
                return k
        return self.bits

    # ------------------------------------------------------------------ (de)serialisation

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "KbitSettings":
        if not isinstance(config, dict):
            raise ValueError(f"kbit: quantization_config must be a dict, got {type(config).__name__}")
        method = config.get("quant_method", QUANT_METHOD)
        if method != QUANT_METHOD:
            raise ValueError(f"kbit: quantization_config has quant_method={method!r}, expected {QUANT_METHOD!r}")
        unknown = sorted(set(config) - _KNOWN_KEYS)
        if unknown:
            raise ValueError(f"kbit: unknown quantization_config keys {unknown}; known: {sorted(_KNOWN_KEYS)}")
        blocksize = config.get("blocksize", fmt.BLOCK_SIZE)
        if blocksize != fmt.BLOCK_SIZE:
            raise ValueError(f"kbit: blocksize={blocksize!r} is not supported; the format uses {fmt.BLOCK_SIZE}")
        overrides = config.get("bits_overrides") or {}
        if not isinstance(overrides, dict):
            raise ValueError(f"kbit: bits_overrides must be a dict {{regex: bits}}, got {overrides!r}")
        return cls(
            bits=config.get("bits", DEFAULT_BITS),
            codebook=config.get("codebook"),
            bits_overrides=overrides,
            modules_to_not_convert=config.get("modules_to_not_convert"),
            prequantized=config.get("prequantized", False),
            quantize_lm_head=config.get("quantize_lm_head", False),
            rotation=config.get("rotation"),
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "quant_method": QUANT_METHOD,
            "prequantized": self.prequantized,
            "bits": self.bits,
            "blocksize": fmt.BLOCK_SIZE,
            "codebook": self.codebook_spec,
            "modules_to_not_convert": list(self.modules_to_not_convert),
        }
        if self.bits_overrides:
            out["bits_overrides"] = dict(self.bits_overrides)
        if self.quantize_lm_head:
            out["quantize_lm_head"] = True
        if self.rotation is not None:
            out["rotation"] = self.rotation.to_dict()
        return out


class Rotation:
    """A layer's optional input rotation (:mod:`vllm_kbit.reference`, "rotation"): every quantized layer with input
    size K stores Q(W R) and is fed x R, R = diag(signs(K, seed)) . blockdiag(H_b), b = :meth:`block` (K).

    ``blocks`` ({K: b}) is what a converted checkpoint recorded for each input size it holds; a K it does not
    list (and every K of an online quantization) gets :func:`reference.rotation_block` (K, max_block, tp).
    """

    def __init__(self, seed: int = fmt.ROTATION_DEFAULT_SEED, max_block: int = fmt.ROTATION_DEFAULT_MAX_BLOCK, tp: int = 1,
                 blocks: dict | None = None) -> None:
        fmt.check_rotation_settings(max_block, tp, seed)
        self.seed, self.max_block, self.tp = seed, max_block, tp
        self.blocks: dict[int, int] = {}
        for K, b in (blocks or {}).items():
            try:
                K_int = int(K)
            except (TypeError, ValueError):
                K_int = None
            if K_int is None or str(K_int) != str(K) or K_int <= 0:
                raise ValueError(f"kbit: rotation blocks key {K!r} is not an input size (a positive integer)")
            if not fmt._is_int(b) or b < fmt.ROTATION_MIN_BLOCK or b & (b - 1) or K_int % (b * tp):
                raise ValueError(f"kbit: rotation blocks[{K!r}]={b!r} is not supported; it must be a power of two >= "
                                 f"{fmt.ROTATION_MIN_BLOCK} with block * tp ({tp}) dividing K")
            self.blocks[K_int] = b

    def block(self, K: int) -> int:
        return self.blocks[K] if K in self.blocks else fmt.rotation_block(K, self.max_block, self.tp)

    def signs(self, K: int, device: torch.device | str = "cpu") -> torch.Tensor:
        return fmt.rotation_signs(K, self.seed, device)

    def rotate(self, W: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """W R (``inverse``: W R^T) along W's last dimension (weights [.., N, K] and inputs [.., K] alike)."""
        K = W.shape[-1]
        return fmt.hadamard_rotate(W, self.signs(K, W.device), self.block(K), inverse)

    def rotate_hessian(self, H: torch.Tensor) -> torch.Tensor:
        """R^T H R of a [..., K, K] Hessian of inputs x: the Hessian of x R."""
        K = H.shape[-1]
        return fmt.rotate_hessian(H, self.signs(K, H.device), self.block(K))

    def recorded(self, input_sizes) -> "Rotation":
        """This rotation with the block of each of ``input_sizes`` written out (what a converted checkpoint stores)."""
        return Rotation(self.seed, self.max_block, self.tp, {**{K: self.block(K) for K in input_sizes}, **self.blocks})

    @classmethod
    def from_dict(cls, config: Any) -> "Rotation":
        if not isinstance(config, dict):
            raise ValueError(f"kbit: rotation must be a dict like {{\"seed\": 0}}, got {config!r}")
        unknown = sorted(set(config) - _ROTATION_KEYS)
        if unknown:
            raise ValueError(f"kbit: unknown rotation keys {unknown}; known: {sorted(_ROTATION_KEYS)}")
        method = config.get("method", ROTATION_METHOD)
        if method != ROTATION_METHOD:
            raise ValueError(f"kbit: rotation method={method!r} is not supported; supported: {ROTATION_METHOD!r}")
        blocks = config.get("blocks") or {}
        if not isinstance(blocks, dict):
            raise ValueError(f"kbit: rotation blocks must be a dict {{input size: block}}, got {blocks!r}")
        return cls(config.get("seed", fmt.ROTATION_DEFAULT_SEED), config.get("max_block", fmt.ROTATION_DEFAULT_MAX_BLOCK),
                   config.get("tp", 1), blocks)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"method": ROTATION_METHOD, "seed": self.seed, "max_block": self.max_block, "tp": self.tp}
        if self.blocks:
            out["blocks"] = {str(K): b for K, b in sorted(self.blocks.items())}
        return out

    def __eq__(self, other) -> bool:
        return isinstance(other, Rotation) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"Rotation({self.to_dict()})"


def _check_bits(k: Any, what: str) -> None:
    """The format's bits rule (:func:`reference.check_bits`: C++ decides), its message naming the config key ``what``."""
    # A config value that no C++ Scalar holds (a string, null, a list, a huge int) goes to the rule as NaN, which it refuses.
    number = isinstance(k, (int, float)) and -(2**63) <= k < 2**63
    try:
        fmt.check_bits(k if number else math.nan)
    except ValueError as e:  # "kbit: k=9 is not supported; k must be one of (2, 3, 4, 5)"
        rule = str(e).partition("; k ")[2]
        raise ValueError(f"kbit: {what}={k!r} is not supported; bits {rule}") from None
