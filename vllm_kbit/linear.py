"""``kbit_linear``: the dense entry point, ``x @ dequant(W).T (+ bias)`` on a runtime-layout weight.

The op ``torch.ops.kbit.linear`` picks its kernel by M (rows of x) and the weight's size
(``csrc/linear.cpp``): the GEMV kernel for M <= 2, the fused dequant + MMA kernel up to M = 64, on
Hopper the fused dequant + wgmma kernels (register-fragment up to M = 128 on weights of >= 10240 rows
and >= 2048 columns, warp-specialized up to M = 512 on weights of >= 2^25 elements), and dequantize +
cuBLAS elsewhere (``linear_path``). Without the CUDA extension the PyTorch reference serves every device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from vllm_kbit import reference as fmt
from vllm_kbit import ops  # noqa: F401  (registers torch.ops.kbit)
from vllm_kbit.weight import KbitWeight

_linear = torch.ops.kbit.linear.default

# Mirrors csrc/gemv.cu (kWarps, kResidentCtas, kStreamingWarps) and csrc/gemv.cuh (kGemvMaxSplits).
_GEMV_WARPS = 4
_GEMV_RESIDENT_CTAS = 8
_GEMV_STREAMING_WARPS = 16
GEMV_MAX_SPLITS = 8

# Mirrors csrc/linear.cpp (kGemvPathMaxM, kMmaMaxM, kWgmmaMaxM, kWgmmaWsMaxM, kWgmmaMinN, kWgmmaMinK,
# kWgmmaWsMinWeight and the KBIT_MMA_MAX_M override) and csrc/mma.cuh (kMmaMaxSplits, kMmaMaxRowTiles,
# kMmaWideTiles, kMmaWideMinRowTiles).
GEMV_PATH_MAX_M = 2
_MMA_MAX_M = 64
_WGMMA_MAX_M = 128
_WGMMA_WS_MAX_M = 512
_WGMMA_MIN_N = 10240
_WGMMA_MIN_K = 2048
_WGMMA_WS_MIN_WEIGHT = 1 << 25
_MMA_MAX_M_ENV = os.environ.get("KBIT_MMA_MAX_M")
MMA_MAX_SPLITS = 8
_MMA_MAX_ROW_TILES = 8
_MMA_WIDE_TILES = 128
_MMA_WIDE_MIN_ROW_TILES = 4


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


def gemv_splits(n_tiles: int, k_tiles: int, num_sms: int) -> int:
    """The GEMV's K splits per n-tile, exactly as csrc/gemv.cu computes them (see gemv_splits there).

    The result is in [1, min(GEMV_MAX_SPLITS, k_tiles)], and split s owns k-tiles
    [s*k_tiles//S, (s+1)*k_tiles//S), which is non-empty for every s because S <= k_tiles.
    """
    max_splits = max(1, min(GEMV_MAX_SPLITS, k_tiles))
    best, best_num, best_den = 1, -1, 1
    for s in range(1, max_splits + 1):
        per_sm = -(-(n_tiles * s) // num_sms)
        tiles = -(-k_tiles // s)
        warp_iters = -(-tiles // _GEMV_WARPS)
        active = min(_GEMV_WARPS, tiles)
        streaming = min(min(per_sm, _GEMV_RESIDENT_CTAS) * active, _GEMV_STREAMING_WARPS)
        num, den = per_sm * warp_iters * _GEMV_WARPS * _GEMV_STREAMING_WARPS, streaming
        if best_num < 0 or num * best_den < best_num * den:
            best, best_num, best_den = s, num, den
    return best


def gemv_tiles(N: int, K: int) -> tuple[int, int]:
    """(n_tiles, k_tiles) of a [N, K] weight's runtime layout."""
    q_shape, _ = fmt.runtime_shapes(N, K, 2)
    return q_shape[0], q_shape[1]


def mma_max_m() -> int:
    """The largest M the fused dequant + MMA kernel serves (csrc/linear.cpp)."""
    if _MMA_MAX_M_ENV is not None:
        return int(_MMA_MAX_M_ENV)
    return _MMA_MAX_M


def linear_path(M: int, N: int, K: int, hopper: bool = True) -> str:
    """The kernel ``kbit::linear`` runs for M rows of bf16/fp16 x and an [N, K] weight."""
    if M <= GEMV_PATH_MAX_M:
        return "gemv"
    if M <= mma_max_m():
        return "mma"
    if hopper and M <= _WGMMA_MAX_M and N >= _WGMMA_MIN_N and K >= _WGMMA_MIN_K:
        return "wgmma"
    if hopper and _WGMMA_MAX_M < M <= _WGMMA_WS_MAX_M and N * K >= _WGMMA_WS_MIN_WEIGHT:
        return "wgmma_ws"
    return "dequant_cublas"


def mma_config(M: int, n_tiles: int, row_groups: int = 0) -> tuple[int, int, int]:
    """(p, r, m_blocks) of the MMA kernel, exactly as csrc/mma.cu's mma_config: p n8 tiles of
    activation rows per CTA, r 16-row groups of weight rows per warp, m_blocks CTA rows along M."""
    p = 1 if M <= 8 else 2 if M <= 16 else 4 if M <= 32 else _MMA_MAX_ROW_TILES
    m_blocks = -(-M // (8 * p))
    wide = n_tiles >= _MMA_WIDE_TILES and p >= _MMA_WIDE_MIN_ROW_TILES
    r = row_groups or ((2 if p == _MMA_MAX_ROW_TILES else 4) if wide else 1)
    return p, r, m_blocks


def mma_splits(cols: int, m_blocks: int, k_tiles: int, num_sms: int, ctas_per_sm: int) -> int:
    """The MMA kernel's K splits per CTA column, exactly as csrc/mma.cu computes them.

    The result is in [1, min(MMA_MAX_SPLITS, k_tiles)], and split s owns k-tiles
    [s*k_tiles//S, (s+1)*k_tiles//S), which is non-empty for every s because S <= k_tiles.
    """
    max_splits = max(1, min(MMA_MAX_SPLITS, k_tiles))
    slots = max(1, ctas_per_sm)
    best, best_cost = 1, -1
    for s in range(1, max_splits + 1):
        per_sm = -(-(cols * m_blocks * s) // num_sms)
        tiles = -(-k_tiles // s)
        cost = 4 * max(per_sm * tiles, slots * tiles) + slots * (4 + s)
        if best_cost < 0 or cost < best_cost:
            best, best_cost = s, cost
    return best
