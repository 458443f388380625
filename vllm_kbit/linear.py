"""``kbit_linear``: the dense entry point, ``x @ dequant(W).T (+ bias)`` on a runtime-layout weight.

The op ``torch.ops.kbit.linear`` picks its kernel by M (rows of x) and the weight's size: GEMV,
fused dequant + MMA, on Hopper the fused dequant + wgmma kernels, dequantize + cuBLAS. That choice
and its tile and split plan are made in C++ only (``csrc/plan/``); ask
``torch.ops.kbit.linear_plan`` what it picks. Without the extension the PyTorch reference serves
every device and there is no plan to ask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_kbit import reference as fmt
from vllm_kbit import ops  # noqa: F401  (registers torch.ops.kbit)
from vllm_kbit.weight import KbitWeight

_linear = torch.ops.kbit.linear.default


@dataclass(frozen=True)
class KbitLinearWeight:
    """A [N, K] kbit weight in the runtime layout the kernels read (built once at load)."""

    qweight_rt: torch.Tensor  # int32 [ceil(N/64), ceil(K/128), k, 64, 4]
    absmax_rt: torch.Tensor  # uint8 [ceil(N/64), ceil(K/128), 64, 4], E4M4 codes
    codebook: torch.Tensor  # float32 [2**k]
    N: int
    K: int
    k: int

    @classmethod
    def from_kbit(cls, weight: KbitWeight) -> KbitLinearWeight:
        qweight_rt, absmax_rt = weight.repack()
        N, K = weight.shape
        return cls(qweight_rt, absmax_rt, weight.codebook, N, K, weight.k)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.ops.kbit.dequantize_runtime(self.qweight_rt, self.absmax_rt, self.codebook, self.N, self.K, dtype)


def kbit_linear(x: torch.Tensor, weight: KbitLinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """out[..., N] = x[..., K] @ dequant(W).T (+ bias), in x's dtype. No host sync; graph-capturable."""
    return _linear(x, weight.qweight_rt, weight.absmax_rt, weight.codebook, weight.N, weight.K, bias)


def gemv_tiles(N: int, K: int) -> tuple[int, int]:
    """(n_tiles, k_tiles) of a [N, K] weight's runtime layout."""
    q_shape, _ = fmt.runtime_shapes(N, K, 2)
    return q_shape[0], q_shape[1]
