"""The user-facing quantized weight: one object holding the packed tensors and their meaning."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_kbit import reference as fmt
from vllm_kbit import ops  # noqa: F401  (registers torch.ops.kbit)
from vllm_kbit.reference import check_representable  # noqa: F401  (re-exported: the op runs it)


@dataclass(frozen=True)
class KbitWeight:
    """A [N, K] weight in the flat kbit layout (see :mod:`vllm_kbit.reference`)."""

    qweight: torch.Tensor  # int32 [N, K/32, k]
    absmax: torch.Tensor  # uint8 [N, K/32], E4M4 codes
    codebook: torch.Tensor  # float32 [2**k]: the codebook times the weight's range scale (reference.range_scale)
    k: int
    shape: tuple[int, int]

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.ops.kbit.dequantize(self.qweight, self.absmax, self.codebook, dtype)

    def repack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The runtime layout the kernels read (computed once at load)."""
        return torch.ops.kbit.repack(self.qweight, self.absmax)

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.absmax.nbytes

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / (self.shape[0] * self.shape[1])


def quantize(
    W: torch.Tensor, k: int = 4, codebook: torch.Tensor | None = None, search_scale: bool = fmt.DEFAULT_SEARCH_SCALE
) -> KbitWeight:
    """Quantizes W[N, K] (fp16/bf16/fp32, K % 32 == 0) to k bits on W's device.

    search_scale (default) picks each block's E4M4 scale by block squared error among the
    absmax code and its neighbours; False keeps plain absmax scales (bit-exact with other
    absmax implementations of the format).

    A weight whose max |w| is outside [2^-4, 31] is quantized as W / s with s =
    :func:`vllm_kbit.reference.range_scale` (a power of two), and ``codebook`` of the result is the
    codebook times s, so ``dequantize`` and the ops give back W's scale; NaN / Inf weights raise.
    """
    fmt.check_bits(k)
    if codebook is None:
        codebook = fmt.default_codebook(k, W.device)
    fmt.check("quantize", W, codebook, k, search_scale)  # W's rules, then the codebook's
    fmt.check_codebook_values(codebook)
    codebook = codebook.to(W.device)
    scale = fmt.weight_range_scale(W)
    qweight, absmax = torch.ops.kbit.quantize(fmt.range_scaled(W, scale), codebook, k, search_scale)
    return KbitWeight(qweight, absmax, codebook * scale if scale != 1.0 else codebook, k, (W.shape[0], W.shape[1]))
