"""The kbit weight format, in PyTorch: the reference every kernel is checked against.

A weight ``W[N, K]`` (PyTorch Linear layout, out x in) is cut into blocks of 32
consecutive elements along K. Each block stores

* one scale: the block's absmax rounded to the nearest E4M4 code (uint8), and
* one k-bit index per element into a ``2**k``-entry codebook, chosen against the
  *decoded* scale, packed as k bit-planes: bit ``i`` of word ``b`` is bit ``b`` of
  element ``i``'s index.

Flat layout (checkpoints, stable): ``qweight`` int32 ``[N, K/32, k]`` and
``absmax`` uint8 ``[N, K/32]``. Runtime layout (internal, produced once at load
by :func:`repack`): tiles of ``TILE_N`` rows x ``TILE_KB`` blocks, see
:func:`repack`.

Every function here runs on any device and is exact: the CUDA kernels must
reproduce it bit for bit (packed words, scale codes and dequantized values).
The format's constants (block size, bits, E4M4 bias, scale search, tile) are
written once, in ``format_constants.h`` beside this file, which the CUDA
extension includes.
"""

from __future__ import annotations

import functools
import math
import os
import re

import torch



def _read_format_constants() -> dict[str, int]:
    """The `constexpr int kName = value;` lines of format_constants.h (shared with the CUDA extension)."""
    path = os.path.join(os.path.dirname(__file__), "format_constants.h")
    with open(path) as f:
        found = dict(re.findall(r"^constexpr int (k\w+) = (-?\d+);", f.read(), re.MULTILINE))
    return {name: int(value) for name, value in found.items()}


_FORMAT = _read_format_constants()
BLOCK_SIZE = _FORMAT["kBlockSize"]
SUPPORTED_BITS = tuple(range(_FORMAT["kMinBits"], _FORMAT["kMaxBits"] + 1))
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

E4M4_BIAS = _FORMAT["kE4M4Bias"]
E4M4_MAX = float(_FORMAT["kE4M4Max"])  # code 255 (e = 15, m = 15): the largest scale a block can have
# Range scale (:func:`range_scale`): layers whose max |w| lies in [RANGE_MIN, RANGE_MAX] are quantized as they are.
RANGE_MIN = 2.0**-4
RANGE_MAX = _FORMAT["kRangeMax64"] / 64  # the largest |w| the E4M4 code 255 still holds (check_representable's bound)
RANGE_TARGET = 16.0  # a range-scaled layer's max |W / s| lies in (RANGE_TARGET / 2, RANGE_TARGET]
_RANGE_EXP_MIN, _RANGE_EXP_MAX = -100, 127  # s stays a normal fp32 power of two, codebook * s finite and exact
# Scale search (see block_scales): E4M4 code offsets tried around each block's absmax code,
# -8..+8 (about x0.7..x1.4). On by default; search_scale=False gives plain absmax scales.
SCALE_SEARCH_OFFSETS = tuple(d for d in range(-_FORMAT["kScaleSearchRadius"], _FORMAT["kScaleSearchRadius"] + 1) if d)
DEFAULT_SEARCH_SCALE = True

# Runtime tile: TILE_N rows (output features) by TILE_KB blocks of 32 along K.
TILE_N = _FORMAT["kTileN"]
TILE_KB = _FORMAT["kTileKB"]


# ----------------------------------------------------------------------------- checks
# Every op's argument rules and their one-line messages are stated once, in C++ (csrc/ops/checks.cpp): the CUDA
# ops run them, and the CPU extension (vllm_kbit._cpu) registers them as kbit::_check_<rule>, which the
# functions here ask. Without that extension nothing is checked (docs/development.md, "Argument checks").


@functools.cache
def checks_loaded() -> bool:
    """Whether the C++ checks are loaded. Asks vllm_kbit.ops, which defines their schemas and loads the CPU
    extension, on the first check: whichever module is imported first, the checks are on where they are built."""
    from vllm_kbit import ops  # noqa: PLC0415 (ops imports this module: a top-level import would be circular)

    return ops.HAS_CPU_KERNELS


def check(rule: str, *args) -> None:
    """Raises what kbit::_check_<rule> raises for ``args`` (a one-line ValueError or TypeError)."""
    if checks_loaded():
        getattr(torch.ops.kbit, "_check_" + rule)(*args)


def check_bits(k: int) -> None:
    check("bits", k)


def check_codebook(codebook: torch.Tensor, k: int) -> None:
    """A codebook for k bits: 2**k float32 values, 1-D, contiguous (its values: :func:`check_codebook_values`)."""
    check("codebook", codebook, k)


def check_quantize(W: torch.Tensor, codebook: torch.Tensor, k: int, search_scale: bool = DEFAULT_SEARCH_SCALE) -> None:
    """kbit::quantize's checks: its arguments, then W's values (:func:`check_representable`)."""
    check("quantize", W, codebook, k, search_scale)
    check_representable(W)


def check_codebook_values(codebook: torch.Tensor) -> None:
    """Value checks (host sync): only for codebooks that come from users or checkpoints."""
    cb = codebook.detach().double().cpu()
    if not torch.isfinite(cb).all():
        raise ValueError("kbit: codebook has non-finite values")
    if not (cb[1:] > cb[:-1]).all():
        raise ValueError("kbit: codebook must be strictly ascending")
    if cb.abs().max().item() != 1.0:
        raise ValueError(f"kbit: codebook must have max |c| == 1, got {cb.abs().max().item()}")


def check_representable(W: torch.Tensor) -> None:
    """Refuses weights the format cannot hold at scale 1: non-finite values or |w| beyond the E4M4 range
    (the callers that quantize whole layers divide by :func:`range_scale` first).

    Syncs with the host (one reduction): a load-time check, never on a forward path.
    """
    check("representable", W)


def range_scale(amax: float) -> float:
    """The power-of-two range scale s of a layer whose largest |w| is ``amax``: quantize W / s and give the
    layer the codebook ``codebook * s``. Both are exact (a power of two only moves exponents), and every op
    reads the fp32 codebook and multiplies codebook value x block scale, so the layer decodes to
    ``s * dequantize(W / s)`` with no kernel change.

    Why: a block's scale is one E4M4 code, at most E4M4_MAX = 31 and, below the smallest normal code 2^-10,
    subnormal (step 2^-14: blocks under 2^-10 lose precision, blocks under 2^-15 decode to zero).

    * s = 1 for RANGE_MIN <= amax <= RANGE_MAX (and amax = 0), so a layer in that range is quantized
      bit-identically to a format without range scales. RANGE_MAX is the bound the format always had.
      RANGE_MIN = 2^-4: the smallest non-zero codebook level c_min is >= 0.0174 (k = 5 normal_float; 0.035
      at k = 5 of the default codebook), so in a layer with amax >= 2^-4 every block whose absmax is at
      least c_min * amax (>= 1.09e-3 > 2^-10) -- a block that levels scaled to the layer's max could still
      resolve -- keeps a normal E4M4 scale. Below 2^-4 such blocks go subnormal, so the layer is rescaled.
    * otherwise s = 2^ceil(log2(amax / RANGE_TARGET)), so that 8 < |W / s| <= 16: the layer's largest block
      sits at the top of the E4M4 range (the scale search's x1.4 candidates, <= 22.6, stay below 31), so
      blocks down to ~2^-13 of the layer's max keep normal scales. That headroom matters in an MoE layer,
      whose one s covers every expert: one expert at |w| = 100 leaves the others' blocks of 0.1 at 0.0125.
      s is clamped to [2^-100, 2^127] (no bf16 / fp16 weight needs more); codebook * s <= amax / 8 never
      overflows fp16. Limit: the GPU tensor-core kernels round codebook * s to the activation type, so with
      fp16 activations a layer scaled by s < 2^-8 (|w| < 2^-8) gets fp16-subnormal table entries -- such
      weights are fp16 subnormals themselves; bf16 has fp32's exponent range and is exact.

    Non-finite amax raises (NaN / Inf weights cannot be quantized at any scale).
    """
    amax = float(amax)
    check("weight_amax", amax, False)
    if amax == 0.0 or RANGE_MIN <= amax <= RANGE_MAX:
        return 1.0
    m, e = math.frexp(amax / RANGE_TARGET)  # = m * 2^e, 0.5 <= m < 1: ceil(log2) is e, or e - 1 for m = 0.5
    e = e - 1 if m == 0.5 else e
    return math.ldexp(1.0, min(max(e, _RANGE_EXP_MIN), _RANGE_EXP_MAX))


def weight_amax(W: torch.Tensor) -> float:
    """W's largest |w| (0 when empty; NaN or Inf when W has them): one reduction, host sync, load time only.
    min and max instead of abs().amax(): no temporary the size of W (a whole MoE layer's experts at load)."""
    if not W.numel():
        return 0.0
    lo, hi = torch.aminmax(W.detach())
    return torch.maximum(hi, -lo).float().item()


def weight_range_scale(W: torch.Tensor) -> float:
    """:func:`range_scale` of W's largest |w| (one reduction, host sync: a load-time call)."""
    return range_scale(weight_amax(W))


def range_scaled(W: torch.Tensor, s: float) -> torch.Tensor:
    """W / s, exact (s a power of two): W itself for s = 1, else in float32 so that no element's exponent
    leaves the dtype's range."""
    return W if s == 1.0 else W.float() / s


# ----------------------------------------------------------------------------- codebook


@functools.lru_cache(maxsize=None)
def _normal_float_codebook_cpu(k: int) -> torch.Tensor:
    # 2**k equiprobable bins of N(0,1); each level is the mean of N(0,1) inside its bin:
    # E[X | a < X < b] = (phi(a) - phi(b)) / P(a < X < b), P = 2**-k. Then scaled to max |c| = 1.
    n = 2**k
    edges = torch.special.ndtri(torch.arange(n + 1, dtype=torch.float64) / n)
    pdf = torch.exp(-0.5 * edges.square()) / math.sqrt(2 * math.pi)
    pdf = torch.where(torch.isinf(edges), torch.zeros_like(pdf), pdf)
    levels = (pdf[:-1] - pdf[1:]) * n
    return (levels / levels.abs().max()).float()


def normal_float_codebook(k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """2**k normal-float levels, ascending, symmetric (no zero level), max |c| == 1."""
    check_bits(k)
    return _normal_float_codebook_cpu(k).to(device)


@functools.lru_cache(maxsize=None)
def _normal_float_zero_codebook_cpu(k: int) -> torch.Tensor:
    # bitsandbytes' NF4 construction at k bits: 2**(k-1) positive and 2**(k-1) - 1 negative normal
    # quantiles at equally spaced probabilities from 1/2 to `offset` (the middle of the two outer bins
    # of 2**k - 1 and 2**k levels), plus an exact zero; scaled to max |c| = 1. At k = 4: NF4's values.
    n = 2**k
    offset = 0.5 * ((1 - 1 / (2 * (n - 1))) + (1 - 1 / (2 * n)))
    pos = torch.special.ndtri(torch.linspace(offset, 0.5, n // 2 + 1, dtype=torch.float64)[:-1])
    neg = -torch.special.ndtri(torch.linspace(offset, 0.5, n // 2, dtype=torch.float64)[:-1])
    levels = torch.cat([pos, torch.zeros(1, dtype=torch.float64), neg]).sort().values
    return (levels / levels.abs().max()).float()


def normal_float_zero_codebook(k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """2**k normal-quantile levels with an exact zero (one more positive level than negative), ascending,
    max |c| == 1 at both ends: the default at k = 3..5."""
    check_bits(k)
    return _normal_float_zero_codebook_cpu(k).to(device)


# The default per bit width: the symmetric levels at k = 2 (of four levels, a zero level costs more than it saves:
# better perplexity on every model measured, rotated and calibrated, and SQNR on Gaussian weights), the levels with an
# exact zero at k = 3..5 (docs/decisions.md, "Codebook per bit width"). A fixed rule: checkpoints name it, so a
# later default gets a new name.
BY_BITS = {2: "normal_float", 3: "normal_float_zero", 4: "normal_float_zero", 5: "normal_float_zero"}


def codebook_name(name: str, k: int) -> str:
    """The named codebook that ``name`` is at k bits: itself, or for "normal_float_by_bits" the one BY_BITS gives."""
    if name != "normal_float_by_bits":
        return name
    check_bits(k)
    return BY_BITS[k]


def normal_float_by_bits_codebook(k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The default codebook: normal_float at 2 bits, normal_float_zero at 3..5 (BY_BITS)."""
    return CODEBOOKS[codebook_name("normal_float_by_bits", k)](k, device)


# Named codebooks a checkpoint's quantization_config may give; the first is the default.
CODEBOOKS = {"normal_float_by_bits": normal_float_by_bits_codebook, "normal_float_zero": normal_float_zero_codebook,
             "normal_float": normal_float_codebook}
DEFAULT_CODEBOOK = "normal_float_by_bits"


def default_codebook(k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return CODEBOOKS[DEFAULT_CODEBOOK](k, device)


def codebook_thresholds(codebook: torch.Tensor) -> torch.Tensor:
    """Decision thresholds between neighbouring levels, in float32: (c[i] + c[i+1]) * 0.5."""
    return (codebook[:-1] + codebook[1:]) * 0.5


# ----------------------------------------------------------------------------- E4M4 scale


@functools.lru_cache(maxsize=None)
def _e4m4_table_cpu() -> torch.Tensor:
    code = torch.arange(256, dtype=torch.int64)
    e, m = code >> 4, (code & 15).double()
    normal = torch.ldexp(1.0 + m / 16, e - E4M4_BIAS)
    subnormal = torch.ldexp(m / 16, torch.full_like(e, 1 - E4M4_BIAS))
    return torch.where(e > 0, normal, subnormal).float()


def e4m4_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """All 256 E4M4 values, float32, ascending in the code (code 0 is 0.0)."""
    return _e4m4_table_cpu().to(device)


@functools.lru_cache(maxsize=None)
def _e4m4_midpoints_cpu() -> torch.Tensor:
    t = _e4m4_table_cpu()
    return (t[:-1] + t[1:]) * 0.5  # exact in float32: the values have 5 significant bits


def e4m4_decode(code: torch.Tensor) -> torch.Tensor:
    """uint8 codes -> float32 scales."""
    return e4m4_table(code.device)[code.long()]


def e4m4_encode(x: torch.Tensor) -> torch.Tensor:
    """Non-negative float32 -> the nearest E4M4 code (ties to the lower code; > 31 saturates to 255)."""
    mid = _e4m4_midpoints_cpu().to(x.device)
    return torch.searchsorted(mid, x.float().contiguous(), right=False).to(torch.uint8)


# ----------------------------------------------------------------------------- bit-planes


def pack_bitplanes(idx: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [..., 32] (each < 2**k) -> int32 words [..., k]; bit i of word b = bit b of idx[i]."""
    weights = torch.ones(BLOCK_SIZE, dtype=torch.int64, device=idx.device) << torch.arange(
        BLOCK_SIZE, device=idx.device
    )
    planes = [(((idx.long() >> b) & 1) * weights).sum(-1) for b in range(k)]
    words = torch.stack(planes, dim=-1)
    return (words - (words >= 2**31).long() * 2**32).to(torch.int32)


def unpack_bitplanes(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., k] -> indices [..., 32] (int64)."""
    lanes = torch.arange(BLOCK_SIZE, device=words.device)
    bits = (words.long().unsqueeze(-2) >> lanes.view(-1, 1)) & 1  # [..., 32, k]
    return (bits << torch.arange(words.shape[-1], device=words.device)).sum(-1)


# ----------------------------------------------------------------------------- quantize / dequantize


def block_absmax_codes(W: torch.Tensor) -> torch.Tensor:
    """Per-block absmax of W[N, K] rounded to the nearest E4M4 code [N, K/32]."""
    N, K = W.shape
    amax = W.float().view(N, K // BLOCK_SIZE, BLOCK_SIZE).abs().amax(-1)
    return e4m4_encode(amax)


def choose_indices(W: torch.Tensor, scale: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index of each element of W[N, K] against decoded block scales [N, K/32].

    idx = #{i : w > fp32(t_i * s)} with t the codebook thresholds: nearest level, ties
    to the lower one. Comparing w against the product (no division) keeps the
    rounding identical on every device.
    """
    N, K = W.shape
    w = W.float().view(N, K // BLOCK_SIZE, BLOCK_SIZE)
    idx = torch.zeros(w.shape, dtype=torch.uint8, device=W.device)
    for t in codebook_thresholds(codebook.to(W.device)):
        idx += w > (t * scale).unsqueeze(-1)
    return idx


def block_squared_error(w: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Sum over each block [..., 32] of fp32 (w - v)^2, in one fixed order every device reproduces.

    Each element's error is rounded separately (subtract, then square: no fused
    multiply-add). The 32 terms are summed as 4 quarters of 8 consecutive elements:
    inside a quarter pairwise (j + j+4, then + j+2, then + j+1), then the quarters
    (q + q+2, then + q+1) -- the order of a kernel whose 4 lanes hold 8 elements each
    and combine with xor-shuffles.
    """
    e = (w - values).square().view(*w.shape[:-1], 4, 8)
    e = e[..., :4] + e[..., 4:]
    e = e[..., :2] + e[..., 2:]
    e = e[..., 0] + e[..., 1]
    e = e[..., :2] + e[..., 2:]
    return e[..., 0] + e[..., 1]


def block_scales(
    W: torch.Tensor, codebook: torch.Tensor, search: bool, col_weight: torch.Tensor | None = None
) -> torch.Tensor:
    """E4M4 scale code per block [N, K/32].

    Without search: the absmax code. With search: the absmax code and its neighbours
    ``absmax_code + SCALE_SEARCH_OFFSETS`` (clamped to 0..255) are tried in that order and
    the one with the smallest block squared error wins (strictly smaller: ties keep the
    earlier candidate, so the absmax code wins every tie). A smaller scale clips the
    largest element for finer steps elsewhere; a larger one moves the block's big values
    next to the codebook's outer levels. ``col_weight`` [K] (GPTQ's scale rules,
    :mod:`vllm_kbit.gptq`) weighs each column's squared error instead of the plain block error.
    """
    absmax_code = block_absmax_codes(W)
    if not search:
        return absmax_code
    N, K = W.shape
    w = W.float().view(N, K // BLOCK_SIZE, BLOCK_SIZE)
    cb = codebook.to(W.device)
    best_code, best_err = absmax_code, None
    for offset in (0, *SCALE_SEARCH_OFFSETS):
        code = (absmax_code.int() + offset).clamp(0, 255).to(torch.uint8)
        scale = e4m4_decode(code)
        values = cb[choose_indices(W, scale, cb).long()] * scale.unsqueeze(-1)
        if col_weight is None:
            err = block_squared_error(w, values)
        else:
            err = ((w - values).square() * col_weight.view(K // BLOCK_SIZE, BLOCK_SIZE)).sum(-1)
        if best_err is None:
            best_err = err
            continue
        better = err < best_err
        best_code = torch.where(better, code, best_code)
        best_err = torch.where(better, err, best_err)
    return best_code


def quantize(
    W: torch.Tensor, codebook: torch.Tensor, k: int, search_scale: bool = DEFAULT_SEARCH_SCALE
) -> tuple[torch.Tensor, torch.Tensor]:
    """W[N, K] (fp16/bf16/fp32) -> (qweight int32 [N, K/32, k], absmax uint8 [N, K/32])."""
    check_quantize(W, codebook, k, search_scale)
    absmax = block_scales(W, codebook, search_scale)
    idx = choose_indices(W, e4m4_decode(absmax), codebook)
    return pack_bitplanes(idx, k), absmax


def dequantize(
    qweight: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Flat layout -> W[N, K] in dtype: fp32(codebook[idx] * scale), then rounded to dtype."""
    check("dequantize", qweight, absmax, codebook, dtype)
    return _dequantize(qweight, absmax, codebook, dtype)


def _dequantize(qweight, absmax, codebook, dtype):
    N, KB, _ = qweight.shape
    idx = unpack_bitplanes(qweight)
    values = codebook.to(qweight.device)[idx] * e4m4_decode(absmax).unsqueeze(-1)
    return values.view(N, KB * BLOCK_SIZE).to(dtype)


# ----------------------------------------------------------------------------- runtime layout


def runtime_shapes(N: int, K: int, k: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the runtime (qweight, absmax) for a [N, K] weight: N padded to TILE_N, K/32 to TILE_KB."""
    n_tiles = -(-N // TILE_N)
    kb_tiles = -(-(K // BLOCK_SIZE) // TILE_KB)
    return (n_tiles, kb_tiles, k, TILE_N, TILE_KB), (n_tiles, kb_tiles, TILE_N, TILE_KB)


# Runtime index words for k = 2, 3 and 4: each block's k plane words transposed, once at load, into
# the words the kernels' table lookup reads (csrc/format/dequant_core.cuh: runtime index words). For
# k = 4, byte n of word w holds the pair (e, e + 1), e = 8n + 2 (w >> 1) + 4 (w & 1), as two 4-bit
# indices (e low); for k = 2, byte n of word w holds elements 8n + 4w .. +3 as four 2-bit indices
# (lowest first). k = 3 takes the k = 4 words of its three planes and a zero fourth (bits 3 and 7 of
# every byte clear) and folds the fourth word into those clear bits of the other three (FOLD3_SHIFTS:
# word i takes bits i and i + 4 of each byte of word 3 at bits 3 and 7), so it stays 3 words per block.
# k = 5 packs the 5-bit indices into its five words as one little-endian stream (element e at bits
# 5e .. 5e + 4, so the pair (2j, 2j + 1) is the 10-bit field at bit 10j): one funnel shift yields an
# element for the shuffle decode, or a pair's row of the 1024-entry table. Each swap entry is a delta
# swap (word a, word b, shift, mask) of csrc's swap_bits, applied in order.
RUNTIME_WORD_SWAPS = {
    2: ((0, 1, 1, 0x55555555), (0, 1, 2, 0x33333333), (0, 1, 4, 0x0F0F0F0F)),
    4: (
        (0, 1, 1, 0x55555555), (2, 3, 1, 0x55555555),
        (0, 2, 2, 0x33333333), (1, 3, 2, 0x33333333),
        (0, 1, 4, 0x0F0F0F0F), (2, 3, 4, 0x0F0F0F0F),
    ),
}
FOLD3_SHIFTS = (3, 2, 1)  # csrc kbit_format.cuh: fold3 / unfold3
FOLD3_MASK = 0x88888888


def _to_signed(w: torch.Tensor) -> torch.Tensor:
    return (w - ((w >> 31) << 32)).to(torch.int32)


def _swap_words(words: torch.Tensor, swaps) -> torch.Tensor:
    """Applies delta swaps along the last dim of int32 words (csrc swap_bits: bits of word a at
    mask << shift exchanged with bits of word b at mask)."""
    w = [words[..., i].to(torch.int64) & 0xFFFFFFFF for i in range(words.shape[-1])]
    for a, b, shift, mask in swaps:
        t = ((w[a] >> shift) ^ w[b]) & mask
        w[b] = w[b] ^ t
        w[a] = w[a] ^ (t << shift)
    return _to_signed(torch.stack(w, dim=-1))


def _planes_to_stream5(planes: torch.Tensor) -> torch.Tensor:
    """k = 5: the 32 indices of each block (from its planes) as a 160-bit stream of 5-bit fields."""
    p = planes.to(torch.int64) & 0xFFFFFFFF
    w = [torch.zeros_like(p[..., 0]) for _ in range(5)]
    for i in range(BLOCK_SIZE):
        idx = sum(((p[..., b] >> i) & 1) << b for b in range(5))
        word, shift = divmod(5 * i, 32)
        w[word] = w[word] | ((idx << shift) & 0xFFFFFFFF)
        if shift > 27:
            w[word + 1] = w[word + 1] | (idx >> (32 - shift))
    return _to_signed(torch.stack(w, dim=-1))


def _stream5_to_planes(words: torch.Tensor) -> torch.Tensor:
    w = words.to(torch.int64) & 0xFFFFFFFF
    planes = [torch.zeros_like(w[..., 0]) for _ in range(5)]
    for i in range(BLOCK_SIZE):
        word, shift = divmod(5 * i, 32)
        v = w[..., word] >> shift
        if shift > 27:
            v = v | (w[..., word + 1] << (32 - shift))
        for b in range(5):
            planes[b] = planes[b] | (((v >> b) & 1) << i)
    return _to_signed(torch.stack(planes, dim=-1))


def planes_to_runtime_words(planes: torch.Tensor) -> torch.Tensor:
    """[..., k] bit-plane words of blocks -> their runtime index words."""
    k = planes.shape[-1]
    if k == 5:
        return _planes_to_stream5(planes)
    if k == 3:
        u = _swap_words(torch.cat([planes, torch.zeros_like(planes[..., :1])], -1), RUNTIME_WORD_SWAPS[4])
        u = u.to(torch.int64) & 0xFFFFFFFF
        w = [u[..., i] | ((u[..., 3] << s) & FOLD3_MASK) for i, s in enumerate(FOLD3_SHIFTS)]
        return _to_signed(torch.stack(w, dim=-1))
    swaps = RUNTIME_WORD_SWAPS.get(k)
    return planes.clone() if swaps is None else _swap_words(planes, swaps)


def runtime_words_to_planes(words: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`planes_to_runtime_words` (each swap is its own inverse: reverse order)."""
    k = words.shape[-1]
    if k == 5:
        return _stream5_to_planes(words)
    if k == 3:
        w = words.to(torch.int64) & 0xFFFFFFFF
        w3 = sum((w[..., i] >> s) & (0x11111111 << i) for i, s in enumerate(FOLD3_SHIFTS))
        u = torch.stack([w[..., i] & ~FOLD3_MASK & 0xFFFFFFFF for i in range(3)] + [w3], dim=-1)
        return _swap_words(_to_signed(u), tuple(reversed(RUNTIME_WORD_SWAPS[4])))[..., :3].contiguous()
    swaps = RUNTIME_WORD_SWAPS.get(k)
    return words.clone() if swaps is None else _swap_words(words, tuple(reversed(swaps)))


def repack(qweight: torch.Tensor, absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat -> runtime layout.

    qweight_rt[nt, kt, b, r, j] = word b of planes_to_runtime_words(qweight[nt*TILE_N + r, kt*TILE_KB + j])
    absmax_rt[nt, kt, r, j]     = absmax[nt*TILE_N + r, kt*TILE_KB + j]

    One tile (TILE_N rows x TILE_KB blocks) is contiguous and tiles of one row band
    follow each other along K, so a kernel streams a row band front to back. Inside
    a tile, word b of the TILE_KB blocks of one row is one 16-byte vector, and the 64
    rows of that word are consecutive: a warp reads word b of 32 rows as 512
    contiguous bytes. Padding rows/blocks hold zero words and scale code 0, so
    they dequantize to 0.
    """
    check("repack", qweight, absmax)
    N, KB, k = qweight.shape
    q_shape, a_shape = runtime_shapes(N, KB * BLOCK_SIZE, k)
    nt, kt = q_shape[0], q_shape[1]
    q = qweight.new_zeros(nt * TILE_N, kt * TILE_KB, k)
    q[:N, :KB] = planes_to_runtime_words(qweight)
    a = absmax.new_zeros(nt * TILE_N, kt * TILE_KB)
    a[:N, :KB] = absmax
    q_rt = q.view(nt, TILE_N, kt, TILE_KB, k).permute(0, 2, 4, 1, 3).contiguous()
    a_rt = a.view(nt, TILE_N, kt, TILE_KB).permute(0, 2, 1, 3).contiguous()
    return q_rt, a_rt


def unrepack(qweight_rt: torch.Tensor, absmax_rt: torch.Tensor, N: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Runtime -> flat layout (inverse of :func:`repack`), for a weight of shape [N, K]."""
    check("unrepack", qweight_rt, absmax_rt, N, K)
    return _unrepack(qweight_rt, absmax_rt, N, K)


def _unrepack(qweight_rt, absmax_rt, N, K):
    nt, kt, k = qweight_rt.shape[:3]
    q = runtime_words_to_planes(qweight_rt.permute(0, 3, 1, 4, 2).reshape(nt * TILE_N, kt * TILE_KB, k))
    a = absmax_rt.permute(0, 2, 1, 3).reshape(nt * TILE_N, kt * TILE_KB)
    KB = K // BLOCK_SIZE
    return q[:N, :KB].contiguous(), a[:N, :KB].contiguous()


def dequantize_runtime(
    qweight_rt: torch.Tensor, absmax_rt: torch.Tensor, codebook: torch.Tensor, N: int, K: int, dtype: torch.dtype
) -> torch.Tensor:
    """Runtime layout -> W[N, K] in dtype (same values as :func:`dequantize`)."""
    check("dequantize_runtime", qweight_rt, absmax_rt, codebook, N, K, dtype)
    return _dequantize(*_unrepack(qweight_rt, absmax_rt, N, K), codebook, dtype)


# ----------------------------------------------------------------------------- rotation (incoherence processing)
# An optional input transform per quantized layer: R = diag(s) . blockdiag(H_b, ..., H_b) on the layer's input
# dimension K, H_b the normalized Walsh-Hadamard matrix of order b (Sylvester order, H_b = H_b^T, H_b H_b = I)
# and s a vector of K random signs. R is orthogonal, so a layer stores Q(W R) and is fed x R:
# (x R)(W R)^T = x W^T. Mixing each block of b inputs spreads an outlier column over b columns, which GPTQ's
# rounding turns into a smaller output error (docs/format.md, section 9). The signs act before the Hadamard
# (x R = H(x * s) per block): after it they would only flip whole columns of the mixed weight.
# The rule for b and s is written here once; the converter records it (settings.KbitSettings.rotation) and the
# runtime asks it (rotation_block, rotation_signs, hadamard_rotate / torch.ops.kbit.hadamard_rotate).
# Blocks the runtime rotates (kbit::linear / fused_moe's rotation arguments, the CUDA kernel): powers of two
# ROTATION_MIN_BLOCK..ROTATION_MAX_BLOCK (format_constants.h). The default cap on b is 128: one GEMV k-tile, so the
# decode kernels rotate in-tile without mixing k-tiles, and the accuracy of larger blocks measured the same at 3 bits
# (docs/decisions.md, "Rotation block: at most 128 by default").
ROTATION_MAX_BLOCK = _FORMAT["kRotationMaxBlock"]
ROTATION_MIN_BLOCK = _FORMAT["kRotationMinBlock"]
ROTATION_DEFAULT_MAX_BLOCK = 128
ROTATION_DEFAULT_SEED = 0
_SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_rotation_settings(max_block, tp, seed) -> None:
    """The rotation settings' rules, one-line ValueErrors naming the value and what is supported."""
    if not _is_int(max_block) or max_block < ROTATION_MIN_BLOCK or max_block & (max_block - 1):
        raise ValueError(f"kbit: rotation block {max_block!r} is not supported; it must be a power of two >= "
                         f"{ROTATION_MIN_BLOCK} (default {ROTATION_DEFAULT_MAX_BLOCK})")
    if not _is_int(tp) or tp < 1:
        raise ValueError(f"kbit: rotation tp={tp!r} is not supported; it must be an integer >= 1 (the largest "
                         "tensor-parallel size the checkpoint is served at)")
    if not _is_int(seed) or not 0 <= seed < 2**63:
        raise ValueError(f"kbit: rotation seed={seed!r} is not supported; it must be an integer in [0, 2**63)")


def rotation_block(K: int, max_block: int = ROTATION_DEFAULT_MAX_BLOCK, tp: int = 1) -> int:
    """The Hadamard block b of a layer with input size K: the largest power of two b <= ``max_block`` with
    b * tp dividing K, so that b divides every tensor-parallel shard of K (a row-parallel layer holds K / tp
    inputs per rank and rotates only its own). Raises when no b >= 2 exists (K / tp odd, or tp not dividing K):
    such a layer cannot be rotated at that tensor-parallel size."""
    check_rotation_settings(max_block, tp, 0)
    if not _is_int(K) or K <= 0:
        raise ValueError(f"kbit: rotation needs a positive input size K, got {K!r}")
    if K % tp:
        raise ValueError(f"kbit: rotation tp={tp} does not divide the input size K={K}; convert with a --rotation-tp "
                         "that divides every layer's K")
    shard = K // tp
    b = min(shard & -shard, max_block)  # the largest power of two dividing the shard
    if b < ROTATION_MIN_BLOCK:
        raise ValueError(f"kbit: input size K={K} at rotation tp={tp} leaves shards of {shard} inputs, which no "
                         f"power-of-two block >= {ROTATION_MIN_BLOCK} divides; lower --rotation-tp")
    return b


@functools.lru_cache(maxsize=64)
def _rotation_signs_cpu(K: int, seed: int) -> torch.Tensor:
    out = []
    for i in range(K):  # splitmix64: the (i + 1)-th output of the generator seeded with `seed`
        z = (seed + (i + 1) * _SPLITMIX_GAMMA) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        z ^= z >> 31
        out.append(-1.0 if z >> 63 else 1.0)
    return torch.tensor(out, dtype=torch.float32)


def rotation_signs(K: int, seed: int = ROTATION_DEFAULT_SEED, device: torch.device | str = "cpu") -> torch.Tensor:
    """The K signs s (float32 +-1) of a layer with input size K: s[i] = -1 where the top bit of the (i + 1)-th
    output of splitmix64 seeded with ``seed`` is set, else +1. A function of (K, seed) alone: layers that
    read the same input (q / k / v, gate / up, every expert's gate_up) share their rotation, so one x R feeds
    them all; a tensor-parallel shard takes its slice s[rank * K / tp : (rank + 1) * K / tp]."""
    check_rotation_settings(ROTATION_MAX_BLOCK, 1, seed)
    if not _is_int(K) or K <= 0:
        raise ValueError(f"kbit: rotation needs a positive input size K, got {K!r}")
    return _rotation_signs_cpu(K, seed).to(device)


def check_hadamard_rotate(x: torch.Tensor, signs: torch.Tensor, block: int) -> None:
    """kbit::hadamard_rotate's argument rules (one-line ValueError / TypeError)."""
    if not isinstance(x, torch.Tensor) or not isinstance(signs, torch.Tensor):
        raise TypeError("kbit: hadamard_rotate needs tensors x and signs")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"kbit: hadamard_rotate: x has dtype {x.dtype}; supported: float16, bfloat16, float32")
    if signs.dtype != torch.float32:
        raise TypeError(f"kbit: hadamard_rotate: signs have dtype {signs.dtype}; expected float32 (+-1 values)")
    if not _is_int(block) or block < ROTATION_MIN_BLOCK or block & (block - 1):
        raise ValueError(f"kbit: hadamard_rotate: block={block!r} is not supported; it must be a power of two >= "
                         f"{ROTATION_MIN_BLOCK}")
    if x.dim() < 1 or x.shape[-1] == 0 or x.shape[-1] % block:
        raise ValueError(f"kbit: hadamard_rotate: x has shape {list(x.shape)}; its last dimension must be a positive "
                         f"multiple of block={block}")
    if signs.dim() != 1 or signs.shape[0] != x.shape[-1]:
        raise ValueError(f"kbit: hadamard_rotate: signs have shape {list(signs.shape)}; expected [{x.shape[-1]}] "
                         "(one per input of x's last dimension)")
    if signs.device != x.device:
        raise ValueError(f"kbit: hadamard_rotate: signs are on {signs.device}, x on {x.device}; expected one device")


def _fwht(y: torch.Tensor, block: int) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard transform (Sylvester order) of each block of ``block`` along the last dim."""
    shape = y.shape
    h = 1
    while h < block:
        v = y.reshape(-1, block // (2 * h), 2, h)
        a, b = v[:, :, 0], v[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return y.reshape(shape)


def hadamard_rotate(x: torch.Tensor, signs: torch.Tensor, block: int, inverse: bool = False) -> torch.Tensor:
    """x R (``inverse``: x R^T) along x's last dimension, R = diag(signs) . blockdiag(H_block): computed in
    float32 (a fast Walsh-Hadamard transform, O(K log block)) and returned in x's dtype. The weight of a rotated
    layer is W R (rows rotated like inputs), and W_hat R^T its value in the original basis."""
    check_hadamard_rotate(x, signs, block)
    y = x.float()
    if not inverse:
        y = y * signs
    y = _fwht(y, block) * (1.0 / math.sqrt(block))
    if inverse:
        y = y * signs
    return y.to(x.dtype)


def hadamard_matrix(block: int) -> torch.Tensor:
    """H_block (normalized, float64) as a dense matrix, for tests: H[i, j] = (-1)^popcount(i & j) / sqrt(block)."""
    i = torch.arange(block)
    bits = torch.bitwise_and(i.view(-1, 1), i.view(1, -1))
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    return (1.0 - 2.0 * parity.double()) / math.sqrt(block)


def rotate_hessian(H: torch.Tensor, signs: torch.Tensor, block: int) -> torch.Tensor:
    """R^T H R of a symmetric [..., K, K] H (float32): the Hessian of the rotated inputs x R."""
    HR = hadamard_rotate(H.float(), signs, block)  # rows of H times R: H R
    return hadamard_rotate(HR.transpose(-1, -2).contiguous(), signs, block).transpose(-1, -2).contiguous()
