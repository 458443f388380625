"""The one log line per loaded model that says what kbit quantized (:class:`LoadReport`).

vLLM asks the kbit config for a method per layer while it builds the model, before any weight loads;
the config registers each layer it gives a kbit method (:meth:`LoadReport.plan`) and each it leaves
unquantized (:meth:`LoadReport.leave`, with the reason). Each kbit method reports once its weights are in
their final form (:meth:`LoadReport.finish`, or :meth:`LoadReport.finish_unquantized` for an online layer
the format cannot hold). When the last planned layer has reported, one info line gives the counts, bits
and weight sizes before / after (and names the layers quantized with a range scale), so a load that
quantizes nothing shows as such. Plain counters, run once
per layer at load: nothing on the forward path.
"""

from __future__ import annotations

import math
import weakref

import torch

from vllm_kbit import ops
from vllm_kbit.vllm.compat import init_logger

logger = init_logger(__name__)

LINEAR = "linear"
EXPERTS = "experts"
_NOUNS = {LINEAR: ("linear layer", "linear layers"), EXPERTS: ("routed-expert block", "routed-expert blocks")}

# Why a layer the kbit config was asked about stays unquantized (the reasons layer_summary reports).
SKIPPED = "modules_to_not_convert"
K_NOT_MULTIPLE = "K not a multiple of 32"
NOT_REPRESENTABLE = "weights not representable"
TIED_LM_HEAD = "tied to the input embedding"


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _count(kind: str, n: int) -> str:
    return f"{n} {_NOUNS[kind][0] if n == 1 else _NOUNS[kind][1]}"


def _gib(nbytes: int) -> str:
    """GiB to 3 significant digits, without an exponent (a tiny model's weights are a few MiB)."""
    v = nbytes / 2**30
    if v <= 0:
        return "0 GiB"
    return f"{v:.{max(2, 2 - math.floor(math.log10(v)))}f} GiB"


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class LoadReport:
    """What kbit did to the model being loaded in this process (one per KbitConfig; per rank).

    A pickled or copied config starts with an empty report: vLLM sends the config to each worker before
    any layer exists. The tally starts over after each line, so a second model built with the same config
    (a draft model) gets a line of its own; a layer processed again (a weight reload) is not counted again.
    """

    def __init__(self) -> None:
        self._pending: weakref.WeakSet = weakref.WeakSet()
        self._reset()

    def __reduce__(self):
        return (LoadReport, ())

    def _reset(self) -> None:
        self.quantized = {LINEAR: 0, EXPERTS: 0}
        self.bits: dict[int, int] = {}
        self.dtypes: set[str] = set()
        self.bytes_before = 0
        self.bytes_after = 0
        self.left: dict[str, dict[str, int]] = {}
        self.range_scaled: list[str] = []  # layers quantized with a range scale != 1 (reference.range_scale)
        self.cpu_decode_cache = False
        self.device: torch.device | None = None

    def plan(self, layer: torch.nn.Module) -> None:
        """The config gave ``layer`` a kbit method; the line waits for it."""
        self._pending.add(layer)

    def leave(self, layer: torch.nn.Module, kind: str, reason: str) -> None:
        """The config left ``layer`` unquantized (``reason`` is one of the constants above)."""
        layer.kbit_left_unquantized = reason
        counts = self.left.setdefault(reason, {LINEAR: 0, EXPERTS: 0})
        counts[kind] += 1

    def finish(self, layer: torch.nn.Module, kind: str, bits: int, bytes_before: int, dtype: torch.dtype,
               packed: list[torch.Tensor], range_scaled: str | None = None) -> None:
        """``layer``'s packed weights are installed: ``bytes_before`` in ``dtype``, now ``packed``;
        ``range_scaled``: the layer's name if it was quantized with a range scale != 1."""
        if layer not in self._pending:
            return
        if range_scaled:
            self.range_scaled.append(range_scaled)
        self.quantized[kind] += 1
        self.bits[bits] = self.bits.get(bits, 0) + 1
        self.dtypes.add(_DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch.")))
        self.bytes_before += bytes_before
        self.bytes_after += _nbytes(packed)
        self.cpu_decode_cache |= ops.cpu_decode_cache_on(packed[0])
        self.device = packed[0].device
        self._done(layer)

    def finish_unquantized(self, layer: torch.nn.Module, kind: str, reason: str) -> None:
        """A layer given a kbit method stays unquantized after all (its weights, seen at load)."""
        if layer not in self._pending:
            return
        self.leave(layer, kind, reason)
        self._done(layer)

    def _done(self, layer: torch.nn.Module) -> None:
        self._pending.discard(layer)
        if not self._pending:
            logger.info("%s", self.line())
            self._reset()

    def line(self) -> str:
        """The summary: counts, bits, sizes before / after, what stays unquantized and why."""
        q = self.quantized
        if len(self.bits) == 1:
            bits = f" to {next(iter(self.bits))} bits"
        elif self.bits:
            widths = (f"{k} ({n} layer{'' if n == 1 else 's'})" for k, n in sorted(self.bits.items()))
            bits = " to bits " + ", ".join(widths)
        else:
            bits = ""
        dtype = "/".join(sorted(self.dtypes)) or "bf16"
        line = (
            f"kbit: quantized {_count(LINEAR, q[LINEAR])} and {_count(EXPERTS, q[EXPERTS])}{bits}: "
            f"weights {_gib(self.bytes_before)} in {dtype} -> {_gib(self.bytes_after)}"
        )
        left = {kind: sum(c[kind] for c in self.left.values()) for kind in (LINEAR, EXPERTS)}
        if not any(left.values()):
            line += "; left unquantized: none"
        else:
            what = " and ".join(_count(kind, n) for kind, n in left.items() if n)
            why = ", ".join(f"{reason}: {sum(c.values())}" for reason, c in self.left.items())
            line += f"; left unquantized: {what} ({why})"
        if self.range_scaled:
            n = len(self.range_scaled)
            names = ", ".join(self.range_scaled[:3]) + (f" and {n - 3} more" if n > 3 else "")
            line += f"; range-scaled (max |w| outside [2^-4, 31]): {n} ({names})"
        if self.device is not None and self.device.type == "cuda":
            # What loading needed at its peak (allocated) against what the caching allocator held (reserved):
            # a gap between the two is fragmentation, not data.
            line += (
                f"; peak GPU memory so far: {_gib(torch.cuda.max_memory_allocated(self.device))} allocated, "
                f"{_gib(torch.cuda.max_memory_reserved(self.device))} reserved"
            )
        if self.cpu_decode_cache:
            line += (
                "; on CPU each kbit layer also keeps its weights decoded after its first forward "
                "(VLLM_KBIT_CPU_DECODE_CACHE=0 turns that off)"
            )
        return line
