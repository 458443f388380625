"""Error-compensating rounding (GPTQ) into the kbit format, for ``vllm-kbit convert --gptq``.

Round-to-nearest (``reference.quantize``) picks each index on its own. GPTQ (Frantar et al.,
2022) rounds the columns of ``W[N, K]`` one at a time and moves each column's rounding error
onto the columns not yet rounded, weighted by the inverse of ``H = X^T X`` (X: the layer's
inputs on calibration text), so the layer's *output* error ``||X W^T - X W_hat^T||`` shrinks
instead of the weight error. The result is an ordinary kbit weight: the same codebook, the
same E4M4 scale per block of 32, indices chosen with the reference's thresholds against the
updated values; ``reference.dequantize`` reads it unchanged.

Two choices go beyond plain GPTQ. Act-order (GPTQ's ``desc_act``) rounds the columns in order of
decreasing input energy H[i, i], so the inputs that matter most are rounded while the most
columns are still open to absorb their error; the format keeps its blocks of 32 consecutive
columns, so a block's scale is fixed when the order first reaches any of its columns, from the
whole block as updated by then (``qweight`` stays in the original column order). The scale is
chosen among the reference's candidates (``reference.block_scales``: the absmax code and its
search offsets) by the squared error of each column weighted by what GPTQ's loss charges for it
(``scale_rule="gptq"``), not by the plain block error, which treats an input that is always
near zero like the largest one.

After the column loop, :func:`refine_rounding` (``refine_passes``, default :data:`DEFAULT_REFINE_PASSES`) revisits
every block with the other columns fixed: its scale among a few codes around the current one, then each index by
the exact one-weight step of the same loss (coordinate descent, as QuantEase does after GPTQ); the loss never rises.

:func:`quantize_model` calibrates one decoder layer at a time, as llm-compressor's sequential
pipeline does: the model stays where it was loaded (the CPU), a forward of the decoder with every layer
passing its input through records the first layer's input and every layer's other arguments (masks,
position embeddings) on the compute device, then layer i alone goes to the device, runs once on all
calibration tokens and goes to the meta device. In that run each linear layer
is GPTQ-rounded when its input first arrives (a pre-hook), so every layer is calibrated on the outputs of
the already rounded ones, and the run's output, computed with the rounded weights, is layer i + 1's input.
Routed experts (transformers' 3-D expert tensors) are rounded :data:`EXPERT_GROUP` at a time
(:func:`gptq_quantize_experts`), each on the Hessian of the tokens the router sends it; an expert with
fewer than :func:`expert_min_tokens` is rounded on the Hessian of every token entering the layer. Device memory peaks at one decoder layer plus the calibration
activations. Calibration text defaults to :func:`calibration_text` (docstrings of Python's standard
library, which every CPython ships).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from vllm_kbit import reference as fmt

DEFAULT_DAMP = 0.01  # added to H's diagonal, as a fraction of its mean diagonal
DEFAULT_CALIBRATION_TOKENS = 16384  # enough rows for H of wide layers (K up to several thousand)
DEFAULT_CALIBRATION_WINDOW = 512
DEFAULT_ACT_ORDER = True  # columns in order of decreasing H[i, i] (see the module docstring)
# Whether `convert --gptq` rotates (settings.Rotation: randomized Hadamard on each layer's input) without
# --rotate / --no-rotate. Rotation measured better with GPTQ on both packaged models (docs/decisions.md,
# "Rotation"), and the vLLM layers serve rotated checkpoints, so it is the default.
ROTATE_WITH_GPTQ = True
DEFAULT_ROTATE = ROTATE_WITH_GPTQ
# How GPTQ picks a block's E4M4 scale among the reference's candidates: "mse" the reference's plain
# block error; "hdiag" each column's squared error weighted by its input energy H[i, i]; "gptq" weighted
# by 1 / [H^-1]_ii of the columns still open when it is rounded (GPTQ's own loss for that column).
SCALE_RULES = ("mse", "hdiag", "gptq")
DEFAULT_SCALE_RULE = "gptq"
# Passes of coordinate descent on GPTQ's loss after its column loop (:func:`refine_rounding`); 0 = plain GPTQ.
# 4: lower perplexity in every pair measured (k = 2..4; SmolLM2, its MoE rewrite, Gemma 3 270M; docs/decisions.md,
# "GPTQ refinement").
DEFAULT_REFINE_PASSES = 4
MAX_REFINE_PASSES = 16
# Scale codes a refinement pass tries around each block's current one: +-2 finds nearly all that the reference's
# whole search radius does, at a third of the time (docs/decisions.md, "GPTQ refinement").
REFINE_SCALE_OFFSETS = (-2, -1, 1, 2)
# Sweeps of a block's 32 columns per scale candidate: 2 sweeps x 4 passes lowered the loss more than 1 x 8 (same steps).
REFINE_SWEEPS = 2
# Blocks refined at once hold [rows, scale candidates, 32] floats a few times over; rows go in chunks of this many
# weights x candidates (64 MiB per tensor).
REFINE_CHUNK = 1 << 24
# On a GPU each refinement step (one block, one chunk of rows) runs as a replayed CUDA graph (_GraphedStep).
REFINE_CUDA_GRAPHS = True
# Asymmetric calibration (GPTAQ, Li et al. 2025): each layer's target is the full-precision model's output on its
# full-precision inputs, not the layer's own output on the (already rounded) model's inputs; ``asymmetric`` = a in
# [0, 1] moves GPTQ's target from W to W + a W dC H^-1 (see :func:`asymmetric_target`); 0 = plain GPTQ. 0.25 (GPTAQ's
# own): lower perplexity in every pair measured, 0.5 as low, 1.0 less so (docs/decisions.md, "Asymmetric calibration").
DEFAULT_ASYMMETRIC = 0.25
# A routed expert with fewer routed calibration tokens than this many per block of 32 inputs (K/8) is
# rounded on the Hessian of every token entering its layer (see expert_min_tokens).
EXPERT_MIN_TOKENS_PER_BLOCK = 4
EXPERT_GROUP = 8  # routed experts rounded together (gptq_quantize_experts): a few hundred MiB of H and H^-1
# Weights packed into bit-planes and decoded back this many at a time (whole rows): the reference's pack and
# decode go through int64 tensors of k (decode: 2 x k) x 8 bytes per weight, 1.7 GiB for a group of 8 of
# Qwen3-30B-A3B's gate_up at k = 4 in one call; per chunk of 2^20 weights at most 80 MiB (k = 5).
PACK_CHUNK_WEIGHTS = 1 << 20
# Blocks whose scale candidates _block_scales tries at once: its comparisons take about 25 KB per block at
# k = 5, so 4096 bound them near 100 MiB (a group of 8 experts' 12288 blocks at once took 0.44 GiB).
SCALE_SEARCH_ROWS = 4096
# Modules whose docstrings make up the default calibration text (prose with some code, like the
# instructions and documentation a language model reads). Fixed, so a Python version always gives
# the same text.
CALIBRATION_MODULES = (
    "argparse", "collections", "contextlib", "csv", "dataclasses", "datetime", "decimal", "difflib",
    "email.message", "fractions", "functools", "heapq", "http.client", "inspect", "io", "itertools",
    "json", "logging", "os", "pathlib", "pickle", "random", "re", "shutil", "socket", "sqlite3",
    "statistics", "string", "subprocess", "tarfile", "textwrap", "threading", "typing", "unittest",
    "urllib.parse", "uuid", "zipfile",
)


def calibration_text() -> str:
    """Docstrings of :data:`CALIBRATION_MODULES` and of their public classes and functions, in order."""
    import importlib
    import inspect

    parts = []
    for mod_name in CALIBRATION_MODULES:
        mod = importlib.import_module(mod_name)
        if mod.__doc__:
            parts.append(inspect.cleandoc(mod.__doc__))
        for name in sorted(getattr(mod, "__all__", None) or dir(mod)):
            obj = getattr(mod, name, None)
            if name.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            if getattr(obj, "__module__", None) != mod.__name__ or not obj.__doc__:
                continue
            parts.append(f"{name}: {inspect.cleandoc(obj.__doc__)}")
    return "\n\n".join(parts)


def gptq_quantize(
    W: torch.Tensor,
    H: torch.Tensor,
    codebook: torch.Tensor,
    k: int,
    search_scale: bool = fmt.DEFAULT_SEARCH_SCALE,
    damp: float = DEFAULT_DAMP,
    lazy_cols: int = 128,
    act_order: bool = DEFAULT_ACT_ORDER,
    scale_rule: str = DEFAULT_SCALE_RULE,
    refine_passes: int = DEFAULT_REFINE_PASSES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """W[N, K] and H[K, K] (sum of x x^T over calibration inputs) -> (qweight, absmax) in the flat layout.

    Columns in natural order, or with ``act_order`` in order of decreasing H[i, i] (the inputs with
    the most energy first, while the most columns are left to take their error); lazy batch updates
    over ``lazy_cols`` columns (a multiple of 32) of that order. A block's scale is fixed when the
    order first reaches one of its columns, from the block's values as updated so far (``scale_rule``:
    see :data:`SCALE_RULES`). Inputs that never fire (H[i, i] == 0) get H[i, i] = 1, so their
    columns are rounded to nearest with nothing to compensate. ``refine_passes`` > 0 then improves the
    result by :func:`refine_rounding`.
    """
    fmt.check_quantize(W, codebook, k)
    N, K = W.shape
    if H.shape != (K, K):
        raise ValueError(f"kbit gptq: H has shape {list(H.shape)}, weight {list(W.shape)} needs [{K}, {K}]")
    # One weight is the experts' loop with B = 1: the algorithm is written once.
    qweight, codes = gptq_quantize_experts(W.unsqueeze(0), H.unsqueeze(0), codebook, k, search_scale, damp, lazy_cols,
                                           act_order, scale_rule, refine_passes)
    return qweight[0], codes[0]


def gptq_quantize_experts(
    W: torch.Tensor,
    H: torch.Tensor,
    codebook: torch.Tensor,
    k: int,
    search_scale: bool = fmt.DEFAULT_SEARCH_SCALE,
    damp: float = DEFAULT_DAMP,
    lazy_cols: int = 128,
    act_order: bool = DEFAULT_ACT_ORDER,
    scale_rule: str = DEFAULT_SCALE_RULE,
    refine_passes: int = DEFAULT_REFINE_PASSES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gptq_quantize` of B weights W[B, N, K], each with its own H[B, K, K] (routed experts), in one
    column loop: every weight is processed in its own order, so position j of the loop is column perm_b[j] of
    weight b, and a block's scale is decided at the position that first reaches it in that weight. Each
    weight's arithmetic is what it would be alone (its matrix products one weight at a time), so B = 1 is
    :func:`gptq_quantize`. Returns qweight [B, N, K/32, k] and absmax [B, N, K/32]; the loop's Python work is
    paid once for all B instead of B times."""
    if W.dim() != 3:
        raise ValueError(f"kbit gptq: experts' weight must be 3-D [B, N, K], got shape {list(W.shape)}")
    B, N, K = W.shape
    for b in range(B):
        fmt.check("quantize", W[b], codebook, k)
    fmt.check_representable(W)
    if H.shape != (B, K, K):
        raise ValueError(f"kbit gptq: H has shape {list(H.shape)}, weights {list(W.shape)} need [{B}, {K}, {K}]")
    if lazy_cols % fmt.BLOCK_SIZE:
        raise ValueError(f"kbit gptq: lazy_cols={lazy_cols} is not a multiple of {fmt.BLOCK_SIZE}")
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"kbit gptq: scale_rule={scale_rule!r}, expected one of {sorted(SCALE_RULES)}")
    check_refine_passes(refine_passes)
    dev, KB, bs = W.device, K // fmt.BLOCK_SIZE, fmt.BLOCK_SIZE
    perms, Hinv, col_weight = [], torch.empty(B, K, K, device=dev), []
    for b in range(B):  # the factorizations one weight at a time: its values alone, and one H in memory
        Hb_ = _damped(H[b].to(dev, torch.float32), damp)
        perm = torch.argsort(torch.diag(Hb_), descending=True, stable=True) if act_order else torch.arange(K, device=dev)
        Hinv[b] = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(Hb_[perm][:, perm])), upper=True)
        perms.append(perm)
        col_weight.append(_column_weights(Hb_, Hinv[b], perm, scale_rule))
        del Hb_
    perm = torch.stack(perms)
    Wf = torch.stack([W[b].float()[:, perm[b]] for b in range(B)])  # processing order of each weight
    pos = torch.argsort(perm, dim=-1)  # processing position of each original column
    block_at = perm // bs  # [B, K]: the block of each processing position
    first = torch.full((B, KB), K, device=dev).scatter_reduce(1, block_at, torch.arange(K, device=dev).expand(B, K), "amin")
    opens = (first.gather(1, block_at) == torch.arange(K, device=dev)).cpu()  # [B, K]: position j decides a scale
    opens_any, block_at_cpu = opens.any(0).tolist(), block_at.cpu()
    cb = codebook.to(dev)
    thresholds = fmt.codebook_thresholds(cb)
    ar = torch.arange(B, device=dev)
    idx = torch.empty(B, N, K, dtype=torch.uint8, device=dev)  # processing order
    codes = torch.empty(B, N, KB, dtype=torch.uint8, device=dev)
    scales = torch.zeros(B, KB, N, device=dev)
    products = torch.zeros(B, KB, N, thresholds.numel(), device=dev)
    for c0 in range(0, K, lazy_cols):
        c1 = min(c0 + lazy_cols, K)
        Wb = Wf[:, :, c0:c1].clone()
        Eb = torch.zeros_like(Wb)
        Hb = Hinv[:, c0:c1, c0:c1]
        for j in range(c1 - c0):
            p = c0 + j
            if opens_any[p]:  # some weights reach a block first here: its scale from their updated values
                ws = opens[:, p].nonzero().flatten().tolist()
                blocks = [int(block_at_cpu[b, p]) for b in ws]
                values = torch.stack([_current_columns(Wf[b], Wb[b], Eb[b], Hinv[b], pos[b, blk * bs:(blk + 1) * bs], c0, c1)
                                      for b, blk in zip(ws, blocks)])
                weight = None if col_weight[0] is None else torch.stack(
                    [col_weight[b][blk * bs:(blk + 1) * bs].expand(N, bs) for b, blk in zip(ws, blocks)]).reshape(-1, bs)
                new = _block_scales(values.reshape(-1, bs), cb, search_scale, weight).view(len(ws), N)
                for i, (b, blk) in enumerate(zip(ws, blocks)):
                    codes[b, :, blk] = new[i]
                    scales[b, blk] = fmt.e4m4_decode(new[i])
                    products[b, blk] = thresholds.unsqueeze(0) * scales[b, blk].unsqueeze(-1)
            blk = block_at[:, p]
            w = Wb[:, :, j]
            q_idx = (w.unsqueeze(-1) > products[ar, blk]).sum(-1)
            idx[:, :, p] = q_idx.to(torch.uint8)
            q = cb[q_idx] * scales[ar, blk]
            err = (w - q) / Hb[:, j, j].unsqueeze(-1)
            Wb[:, :, j:] -= err.unsqueeze(-1) * Hb[:, j, j:].unsqueeze(1)
            Eb[:, :, j] = err
        for b in range(B):  # one product per weight, as it would be alone
            Wf[b, :, c1:] -= Eb[b] @ Hinv[b, c0:c1, c1:]
    idx = idx.gather(2, pos.unsqueeze(1).expand(B, N, K))  # back to the original column order
    del Wf, Hinv
    if refine_passes:  # all B weights in one loop, as the column loop above
        Hd = torch.stack([_damped(H[b].to(dev, torch.float32), damp) for b in range(B)])
        idx, codes = refine_rounding(W.to(dev, torch.float32), Hd, idx, codes, cb, refine_passes)
    return _pack_bitplanes(idx.view(B * N, KB, bs), k).view(B, N, KB, k), codes


def check_refine_passes(passes) -> None:
    if isinstance(passes, bool) or not isinstance(passes, int) or not 0 <= passes <= MAX_REFINE_PASSES:
        raise ValueError(f"kbit gptq: refine_passes={passes!r} is not supported; it must be an integer in "
                         f"[0, {MAX_REFINE_PASSES}]")


@torch.no_grad()
def refine_rounding(W: torch.Tensor, H: torch.Tensor, idx: torch.Tensor, codes: torch.Tensor, codebook: torch.Tensor,
                    passes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Coordinate descent on GPTQ's loss ``tr((W - Q) H (W - Q)^T)`` from a rounding (idx [N, K] uint8, scale codes
    [N, K/32]) of W [N, K] (float32) with H [K, K] (damped), as QuantEase (Behdin et al., 2023) does after GPTQ;
    or of B weights at once (W, idx [B, N, K], H [B, K, K], codes [B, N, K/32]), each on its own H.

    GPTQ decides each column once, against the columns after it; a pass here revisits every block of 32 in column
    order with all other columns fixed: first its scale, among :data:`REFINE_SCALE_OFFSETS` around the current code
    (each candidate's indices by :data:`REFINE_SWEEPS` sweeps of the exact one-column step below, the current
    solution kept as candidate 0), then, inside the sweeps, each column's index: the loss as a function of one
    weight q_j is H_jj (q_j - t_j)^2 + const with t_j = w_j + (E H)_j / H_jj - e_j, so the level nearest t_j is exact. Every step
    keeps or lowers the loss, so the result is never worse than its start. Returns (idx, codes), new tensors.
    """
    if W.dim() == 2:
        i, c = refine_rounding(W[None], H[None], idx[None], codes[None], codebook, passes)
        return i[0], c[0]
    B, N, K = W.shape
    bs = fmt.BLOCK_SIZE
    cb = codebook.to(W.device)
    consts = (cb, fmt.codebook_thresholds(cb), torch.tensor((0, *REFINE_SCALE_OFFSETS), device=W.device),
              fmt.e4m4_table(W.device))
    idx, codes = idx.clone(), codes.clone()
    E = W - cb[idx.long()] * fmt.e4m4_decode(codes).repeat_interleave(bs, dim=-1)
    G = _per_weight_matmul(E, H)  # (E H)[n, j]: the loss's gradient / 2, kept current per block
    rows = max(1, REFINE_CHUNK // (B * consts[2].numel() * bs))
    graphs = {}  # chunk shape -> its captured step (CUDA only), alive for this call

    def step(*inputs):
        if not (W.is_cuda and REFINE_CUDA_GRAPHS):
            return _refine_block(*inputs, *consts)
        key = tuple(t.shape for t in inputs)
        if key not in graphs:
            graphs[key] = _GraphedStep(lambda *x: _refine_block(*x, *consts), inputs)
        return graphs[key](*inputs)

    for _ in range(passes):
        for blk in range(K // bs):
            c = slice(blk * bs, (blk + 1) * bs)
            Hbb, E_old = H[:, c, c].contiguous(), E[:, :, c].clone()
            for r in range(0, N, rows):
                n = slice(r, min(r + rows, N))
                e, q, code = step(W[:, n, c], G[:, n, c], E_old[:, n], codes[:, n, blk], Hbb)
                E[:, n, c], idx[:, n, c], codes[:, n, blk] = e, q.to(idx.dtype), code
            G += _per_weight_matmul(E[:, :, c] - E_old, H[:, c])
    return idx, codes


def _refine_block(w_c, g_c, e_old, code, Hbb, cb, thresholds, offsets, table):
    """One block of 32 columns of :func:`refine_rounding` for a chunk of rows of B weights: w_c, g_c (the gradient E H
    on the block), e_old (its current errors) [B, n, 32], code (its scale codes) [B, n], Hbb [B, 32, 32]; returns the
    best candidate's (errors, indices, scale code)."""
    outside = g_c - _per_weight_matmul(e_old, Hbb)  # the other blocks' part of the gradient
    cand = (code.int().unsqueeze(-1) + offsets).clamp(0, 255).to(torch.uint8)  # [B, n, C]
    scale = table[cand.long()]
    w = w_c.unsqueeze(2).expand(-1, -1, cand.shape[-1], -1)  # [B, n, C, 32]
    e = w - cb[(w.unsqueeze(-1) > thresholds * scale[..., None, None]).sum(-1)] * scale.unsqueeze(-1)
    e[:, :, 0] = e_old
    grad = outside.unsqueeze(2) + _per_weight_matmul(e, Hbb)
    e, q = _block_sweeps(w, e, grad, Hbb, scale, cb, thresholds, REFINE_SWEEPS)
    # e Hbb e^T + 2 e . outside per candidate: the block's part of the loss
    loss = (e * (_per_weight_matmul(e, Hbb) + 2 * outside.unsqueeze(2))).sum(-1)
    best = loss.argmin(-1, keepdim=True)  # [B, n, 1]; the first smallest: ties keep the current scale
    pick = best.unsqueeze(-1).expand(-1, -1, 1, w.shape[-1])
    return e.gather(2, pick)[:, :, 0], q.gather(2, pick)[:, :, 0], cand.gather(2, best)[..., 0]


class _GraphedStep:
    """``fn`` captured once in a CUDA graph on static copies of its inputs (tensors of one shape): a call copies the
    inputs in and replays it. Refinement's steps are hundreds of small kernels each, so on a GPU its loop is bound by
    their launches; replayed, they cost one launch (the same kernels, so the same results)."""

    _warmup_streams: dict = {}  # device -> the one side stream of every warm-up (see __init__)

    def __init__(self, fn, inputs):
        self.inputs = [t.clone() for t in inputs]
        # One warm-up stream per device for all steps: cuBLAS keeps a workspace (32 MiB on Hopper) per stream it
        # ran on, and the allocator caches freed blocks per stream: a new stream per step (torch hands out 32 in turn)
        # kept 32 workspaces, a GiB, allocated.
        dev = inputs[0].device
        if dev not in self._warmup_streams:
            self._warmup_streams[dev] = torch.cuda.Stream(dev)
        side = self._warmup_streams[dev]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture (library handles, allocator)
            fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = fn(*self.inputs)

    def __call__(self, *inputs):
        for static, t in zip(self.inputs, inputs):
            static.copy_(t)
        self.graph.replay()
        return self.outputs


def check_asymmetric(alpha) -> None:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise ValueError(f"kbit gptq: asymmetric={alpha!r} is not supported; it must be a number from 0 to 1 "
                         "(0 = plain GPTQ)")


def asymmetric_target(W: torch.Tensor, H: torch.Tensor, dC: torch.Tensor, damp: float, alpha: float) -> torch.Tensor:
    """GPTQ's target for asymmetric calibration, float32: W + alpha W dC H_d^-1, of W [N, K] (or [B, N, K] with
    H, dC [B, K, K]), H = x^T x and dC = (x_fp - x)^T x over the calibration tokens (x: the layer's inputs in the
    rounded model, x_fp: in the full-precision one), H_d = H damped as GPTQ damps it. At alpha = 1 it is the
    least-squares weight for x of the full-precision output x_fp W^T, so ||x_fp W^T - x Q^T||^2 = ||x (W' - Q)^T||^2
    + const: GPTQ on W' with H minimizes the error against the full-precision model."""
    Wf = W.float()
    batched = Wf.dim() == 3
    Wb, Hb, dCb = (Wf, H, dC) if batched else (Wf[None], H[None], dC[None])
    out = torch.empty_like(Wb)
    for b in range(Wb.shape[0]):
        L = torch.linalg.cholesky(_damped(Hb[b], damp))
        G = Wb[b] @ dCb[b]  # [N, K]
        out[b] = Wb[b] + alpha * torch.cholesky_solve(G.T.contiguous(), L).T  # G H_d^-1 (H_d symmetric)
    return out if batched else out[0]


def _planned_modules(layer, prefix, plan):
    """(name, module, is_experts) of the layer's modules that hold planned weights: linear layers under their
    weight's name, fused routed experts under the module's name."""
    for name, module in layer.named_modules():
        full = f"{prefix}.{name}" if name else prefix
        if isinstance(module, torch.nn.Linear) and f"{full}.weight" in plan:
            yield f"{full}.weight", module, False
        elif _is_fused_experts(module) and {f"{full}.gate_up_proj", f"{full}.down_proj"} & plan.keys():
            yield full, module, True


def _full_precision_inputs(layer, prefix, hidden_fp, call, plan):
    """({planned name: its input in the full-precision model}, the layer's full-precision output), from one run of
    the layer with its own (not yet rounded) weights on the full-precision stream. Fused routed experts record
    their hidden-state input under the module's name."""
    inputs, handles = {}, []

    def record(name):
        def hook(mod, args, kwargs=None):
            inputs.setdefault(name, args[0] if args else kwargs["hidden_states"])
        return hook

    for name, module, experts in _planned_modules(layer, prefix, plan):
        handles.append(module.register_forward_pre_hook(record(name), with_kwargs=experts))
    try:
        args, kwargs = call
        out = layer(hidden_fp, *args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return inputs, (out[0] if isinstance(out, tuple) else out)


def _per_weight_matmul(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x[b] @ m[b] for each weight b of [B, ...] stacks, one product at a time, so a weight's arithmetic is what it
    would be alone (a batched product may round differently)."""
    return torch.stack([x[b] @ m[b] for b in range(m.shape[0])])


def _block_sweeps(w, e, grad, Hbb, scale, cb, thresholds, sweeps):
    """``sweeps`` passes of the exact one-column step over a block's 32 columns, for blocks [B, ..., 32] with scales
    [B, ...] and each weight's block of H, Hbb [B, 32, 32] (w: target values, e: their errors, grad: (E H)
    restricted to the block); returns (e, indices)."""
    lead = (Hbb.shape[0],) + (1,) * (w.dim() - 2)  # Hbb's weight dimension against the blocks' [B, ...]
    products = thresholds * scale.unsqueeze(-1)
    q = torch.empty(e.shape, dtype=torch.long, device=e.device)
    for _ in range(sweeps):
        for j in range(w.shape[-1]):
            target = w[..., j] + grad[..., j] / Hbb[:, j, j].view(lead) - e[..., j]
            q[..., j] = (target.unsqueeze(-1) > products).sum(-1)
            new = w[..., j] - cb[q[..., j]] * scale
            grad.addcmul_((new - e[..., j]).unsqueeze(-1), Hbb[:, j].view(*lead, -1))
            e[..., j] = new
    return e, q


def _row_chunks(rows: int, row_weights: int):
    """Row slices of at most :data:`PACK_CHUNK_WEIGHTS` weights (at least one row each)."""
    step = max(1, PACK_CHUNK_WEIGHTS // row_weights)
    return (slice(r, min(r + step, rows)) for r in range(0, rows, step))


def _pack_bitplanes(idx: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`reference.pack_bitplanes` of indices [R, K/32, 32], a few rows at a time (the same words: each
    word is its own block's), so its int64 temporaries stay bounded."""
    R, KB, bs = idx.shape
    out = torch.empty(R, KB, k, dtype=torch.int32, device=idx.device)
    for rows in _row_chunks(R, KB * bs):
        out[rows] = fmt.pack_bitplanes(idx[rows], k)
    return out


def _dequantize(qweight: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`reference.dequantize` of the flat layout [R, K/32, k] a few rows at a time (the same values, row
    for row), so its int64 temporaries stay bounded."""
    R, KB, _ = qweight.shape
    out = torch.empty(R, KB * fmt.BLOCK_SIZE, dtype=dtype, device=qweight.device)
    for rows in _row_chunks(R, KB * fmt.BLOCK_SIZE):
        out[rows] = fmt.dequantize(qweight[rows], absmax[rows], codebook, dtype)
    return out


def _block_scales(block: torch.Tensor, codebook: torch.Tensor, search: bool, col_weight: torch.Tensor | None) -> torch.Tensor:
    """:func:`reference.block_scales` of blocks [R, 32] (per-row column weights [R, 32] or None) -> codes [R]: the
    same candidates, indices, errors and first-smallest rule, with every candidate at once (a few dozen ops
    instead of a loop of a thousand, which the column loop would pay at each of its scale decisions)."""
    if search and block.shape[0] > SCALE_SEARCH_ROWS:  # rows are independent: a few at a time bounds the temporaries
        return torch.cat([_block_scales(block[r:r + SCALE_SEARCH_ROWS], codebook, search,
                                        None if col_weight is None else col_weight[r:r + SCALE_SEARCH_ROWS])
                          for r in range(0, block.shape[0], SCALE_SEARCH_ROWS)])
    absmax_code = fmt.block_absmax_codes(block)[:, 0]
    if not search:
        return absmax_code
    offsets = torch.tensor((0, *fmt.SCALE_SEARCH_OFFSETS), device=block.device)
    codes = (absmax_code.int().unsqueeze(-1) + offsets).clamp(0, 255).to(torch.uint8)  # [R, C]
    scale = fmt.e4m4_decode(codes)
    products = fmt.codebook_thresholds(codebook) * scale.unsqueeze(-1)  # [R, C, 2^k - 1]: fp32(t_i * s)
    w = block.float().unsqueeze(1)  # [R, 1, 32]
    idx = (w.unsqueeze(-1) > products.unsqueeze(2)).sum(-1)  # [R, C, 32]
    values = codebook[idx] * scale.unsqueeze(-1)
    if col_weight is None:
        err = fmt.block_squared_error(w.expand_as(values), values)
    else:
        err = ((w - values).square() * col_weight.unsqueeze(1)).sum(-1)
    return codes.gather(1, torch.argmin(err, dim=1, keepdim=True))[:, 0]  # the first smallest: ties keep the earlier


def _damped(H: torch.Tensor, damp: float) -> torch.Tensor:
    """A copy of H with dead inputs (H[i, i] == 0) set to 1 and ``damp`` x mean diagonal added to the diagonal."""
    H = H.clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    H.diagonal().add_(damp * H.diagonal().mean())
    return H


def _column_weights(H: torch.Tensor, Hinv: torch.Tensor, perm: torch.Tensor, scale_rule: str) -> torch.Tensor | None:
    """Weight of each column's squared rounding error (original column order) in the block scale choice;
    None for plain block error (the reference's rule)."""
    if scale_rule == "mse":
        return None
    if scale_rule == "hdiag":  # the input energy of the column
        return torch.diag(H).clone()
    # "gptq": 1 / [H^-1]_jj of the columns still open when j is rounded: what GPTQ's own loss charges
    # for rounding error on column j
    w = torch.empty_like(perm, dtype=torch.float32)
    w[perm] = 1.0 / torch.diag(Hinv).square()
    return w


def _current_columns(Wf, Wb, Eb, Hinv, cols, c0, c1) -> torch.Tensor:
    """Current values [N, len(cols)] of not-yet-rounded columns at processing positions ``cols``: those
    inside the lazy batch [c0, c1) from ``Wb``, later ones from ``Wf`` with the batch's pending update."""
    inside = cols < c1
    if bool(inside.all()):
        return Wb[:, cols - c0]
    later = Wf[:, cols.clamp_min(c1)] - Eb @ Hinv[c0:c1, cols.clamp_min(c1)]
    return torch.where(inside.unsqueeze(0), Wb[:, (cols - c0).clamp_max(c1 - c0 - 1)], later)


def _linear_inputs_hessian(x: torch.Tensor) -> torch.Tensor:
    x = x.reshape(-1, x.shape[-1]).float()
    return x.T @ x


def _input_shift(x_fp: torch.Tensor, x: torch.Tensor, rows: int = 4096) -> torch.Tensor:
    """dC = (x_fp - x)^T x [K, K], summed over the tokens as H is (asymmetric calibration); ``rows`` tokens at a
    time, so its float32 temporaries stay small beside the layer."""
    K = x.shape[-1]
    x, x_fp = x.reshape(-1, K), x_fp.reshape(-1, K)
    dC = torch.zeros(K, K, dtype=torch.float32, device=x.device)
    for r in range(0, x.shape[0], rows):
        xr = x[r:r + rows].float()
        dC.addmm_((x_fp[r:r + rows].float() - xr).T, xr)
    return dC


@dataclass
class CalibrationReport:
    """What :func:`quantize_model` did: filled in as it goes (``convert`` prints it)."""

    tokens: int = 0
    device: str = ""
    layer_seconds: list[float] = field(default_factory=list)
    experts: int = 0  # routed experts rounded by GPTQ
    experts_fallback: int = 0  # of them, rounded with the Hessian of all the layer's tokens
    min_expert_tokens: list[int] = field(default_factory=list)  # the threshold of each experts block


def expert_min_tokens(K: int) -> int:
    """Routed tokens an expert needs for a Hessian of its own: :data:`EXPERT_MIN_TOKENS_PER_BLOCK` per block
    of 32 inputs (K/8); fewer give an H of rank so low that GPTQ fits its rounding to a handful of tokens."""
    return EXPERT_MIN_TOKENS_PER_BLOCK * K // fmt.BLOCK_SIZE


@torch.no_grad()
def quantize_model(model, tokenizer, select, text: str | None = None, n_tokens: int = DEFAULT_CALIBRATION_TOKENS,
                   window: int = DEFAULT_CALIBRATION_WINDOW, search_scale: bool = fmt.DEFAULT_SEARCH_SCALE,
                   damp: float = DEFAULT_DAMP, act_order: bool = DEFAULT_ACT_ORDER, scale_rule: str = DEFAULT_SCALE_RULE,
                   refine_passes: int = DEFAULT_REFINE_PASSES, progress=None, device=None, min_expert_tokens: int | None = None,
                   report: CalibrationReport | None = None, rotation=None,
                   asymmetric: float = DEFAULT_ASYMMETRIC) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """GPTQ-quantizes the model's decoder layers one at a time (see the module docstring).

    ``select(checkpoint_module_name) -> (k, codebook) or None`` picks the layers and their settings; it is
    asked about the names the checkpoint stores (``...experts.3.gate_proj``, not the fused
    ``...experts.gate_up_proj`` transformers runs). Returns ``{checkpoint module name: (qweight, absmax)}``
    on the CPU. The calibration text (``text``, default :func:`calibration_text`) is cut into ``n_tokens //
    window`` windows of ``window`` tokens, run through each layer as one batch on ``device`` (default: where
    the model is). The model is used up: each decoder layer goes to ``device`` for its turn, then to the meta
    device. ``min_expert_tokens`` overrides :func:`expert_min_tokens`; ``progress(message)`` gets one line
    per layer; ``report`` (a :class:`CalibrationReport`) is filled in.

    ``rotation`` (a :class:`vllm_kbit.settings.Rotation`) rounds every weight in the rotated basis: GPTQ on
    W R with the Hessian of the rotated inputs, R^T H R (:func:`rounded_weight`); the packed result is Q(W R),
    and the layer runs on with W_hat = Q(W R) R^T, so the next layers calibrate on what the model will compute.

    ``asymmetric`` = a > 0 also runs the full-precision model alongside: each decoder layer first runs with its own
    weights on the full-precision stream of hidden states, recording every planned weight's input x_fp there, and
    each weight is then rounded towards :func:`asymmetric_target` (its output on x_fp, by least squares on the
    rounded model's inputs x, moved a of the way), so errors the rounded layers before it made are compensated.
    """
    check_refine_passes(refine_passes)
    check_asymmetric(asymmetric)
    report = CalibrationReport() if report is None else report
    batch = _calibration_batch(tokenizer, text, n_tokens, window)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    report.tokens, report.device = batch.numel(), str(device)
    body = getattr(model, "model", model)  # the decoder without the LM head: its logits are not needed
    layers = getattr(body, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"kbit gptq: {type(model).__name__} has no decoder layer list (model.layers)")
    names = {id(m): n for n, m in model.named_modules()}
    hidden, layer_args = _capture_layer_inputs(body, layers, batch, device)
    hidden_fp = hidden if asymmetric > 0 else None  # the full-precision model's stream (same input to layer 0)
    options = dict(search_scale=search_scale, damp=damp, act_order=act_order, scale_rule=scale_rule,
                   refine_passes=refine_passes)
    results: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for i, layer in enumerate(layers):
        t0 = time.perf_counter()
        plan = _layer_plan(model, layer, names[id(layer)], select, rotation)
        _onload(layer, device)
        try:
            packed, fp_inputs = {}, None
            if hidden_fp is not None:
                fp_inputs, hidden_fp = _full_precision_inputs(layer, names[id(layer)], hidden_fp, layer_args[i], plan)
                fp_inputs["alpha"] = asymmetric
            hidden = _calibrate_layer(layer, names[id(layer)], hidden, layer_args[i], plan, packed, options,
                                      min_expert_tokens, report, rotation, fp_inputs)
        finally:
            _release(layer)
        for param, (qweight, absmax) in packed.items():
            results.update(_to_checkpoint_names(qweight, absmax, plan[param][2]))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        report.layer_seconds.append(time.perf_counter() - t0)
        if progress is not None:
            peak = (f", device peak {torch.cuda.max_memory_allocated(device) / 1024**3:.2f} GiB"
                    if device.type == "cuda" else "")
            progress(f"layer {i + 1}/{len(layers)}: {len(packed)} weights in {report.layer_seconds[-1]:.1f} s{peak}")
    return results


def _calibration_batch(tokenizer, text, n_tokens, window) -> torch.Tensor:
    """[windows, window] token ids of the calibration text."""
    text = calibration_text() if text is None else text
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    n_windows = min(n_tokens, ids.numel()) // window
    if n_windows == 0:
        raise ValueError(f"kbit gptq: calibration text has {ids.numel()} tokens, fewer than one window of {window}")
    return ids[: n_windows * window].view(n_windows, window)


def _capture_layer_inputs(body, layers, batch, device):
    """(the first layer's hidden states, [(args, kwargs) of every layer but the hidden states]) on ``device``,
    from one forward of the decoder in which every layer passes its input through: masks and position
    embeddings depend on the tokens only, so only the modules around the layers (embedding, rotary) go to
    the device, and back."""
    calls = []

    def passthrough(*args, **kwargs):
        kwargs = dict(kwargs)
        hidden = args[0] if args else kwargs.pop("hidden_states")
        calls.append((hidden, (args[1:], kwargs)))
        return hidden

    others = [m for m in body.children() if m is not layers]
    homes = [_device_of(m) for m in others]
    for m in others:
        m.to(device)
    for layer in layers:
        layer.forward = passthrough
    try:
        body(input_ids=batch.to(device), use_cache=False)
    finally:
        for layer in layers:
            del layer.forward
        for m, home in zip(others, homes):
            m.to(home)
    return calls[0][0], [call for _, call in calls]


def _device_of(module: torch.nn.Module) -> torch.device:
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return torch.device("cpu")


def _onload(layer: torch.nn.Module, device) -> None:
    """The one decoder layer on the compute device (a function of its own, so tests can count)."""
    layer.to(device)


def _release(layer: torch.nn.Module) -> None:
    """A calibrated layer's weights freed: its packed result is kept, its float weights are not needed."""
    layer.to("meta")


def _is_fused_experts(module: torch.nn.Module) -> bool:
    """transformers' routed experts as 3-D tensors, [gate; up] concatenated, no bias, computed as
    act(gate) * up then down (Qwen3-MoE, Mixtral, GLM-4 MoE, Qwen3-Next, GLM-4.7-Flash)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gate_up, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter) and gate_up.dim() == 3
            and down.dim() == 3 and hasattr(module, "act_fn") and not getattr(module, "has_bias", False)
            and not getattr(module, "is_transposed", False) and getattr(module, "is_concatenated", True)
            and getattr(module, "has_gate", True))


def _rotatable(rotation, K: int) -> bool:
    """Whether a layer of input size K can be rotated (a block divides K / tp); convert refuses the others."""
    try:
        rotation.block(K)
    except ValueError:
        return False
    return True


def _layer_plan(model, layer, prefix, select, rotation=None) -> dict:
    """{parameter name: (k, codebook, pieces)} of the layer's weights GPTQ rounds; pieces: the checkpoint
    tensors each is stored as (:func:`_checkpoint_pieces`). A weight is left to round-to-nearest when a piece
    is not selected, its pieces ask for different settings, K is not a multiple of 32 or a value is beyond
    the format's range (the conversion loop keeps it bf16 or refuses it)."""
    shapes = {}
    for name, module in layer.named_modules():
        full = f"{prefix}.{name}" if name else prefix
        if isinstance(module, torch.nn.Linear):
            shapes[f"{full}.weight"] = module.weight
        elif _is_fused_experts(module):
            shapes[f"{full}.gate_up_proj"], shapes[f"{full}.down_proj"] = module.gate_up_proj, module.down_proj
    pieces = _checkpoint_pieces(model, {n: tuple(p.shape) for n, p in shapes.items()})
    plan = {}
    for name, param in shapes.items():
        if rotation is not None and not _rotatable(rotation, param.shape[-1]):
            continue
        choices = [select(module) for module, _ in pieces[name]]
        if not choices or any(c is None for c in choices) or param.shape[-1] % fmt.BLOCK_SIZE:
            continue
        k, cb = choices[0]
        if any(c[0] != k or not torch.equal(c[1], cb) for c in choices):
            continue
        lo, hi = torch.aminmax(param.detach())  # max |w| without a copy of the weight
        amax = max(-lo.item(), hi.item())
        if rotation is not None and amax * math.sqrt(rotation.block(param.shape[-1])) > fmt.RANGE_MAX:
            amax = fmt.weight_amax(rotation.rotate(param.detach().float()))  # |(W R)_ij| <= sqrt(b) max |w|
        if not amax <= fmt.RANGE_MAX:
            continue
        plan[name] = (k, cb, pieces[name])
    return plan


def _checkpoint_pieces(model, shapes: dict[str, tuple]) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """{parameter name: [(checkpoint module name, rows of the parameter's [rows, K] view it stores)]}.

    transformers fuses some checkpoint tensors when it loads them (routed experts into [E, 2I, H]
    gate_up_proj and [E, H, I] down_proj, renamed blocks) and reverts that when it saves; the revert run
    on row numbers instead of weights tells which rows go to which checkpoint tensor, for any architecture
    it knows."""
    tags, spans, start = {}, [], 0
    for name, shape in shapes.items():
        rows = math.prod(shape[:-1])
        tags[name] = torch.arange(start, start + rows).view(*shape[:-1], 1)
        spans.append((start, name))
        start += rows
    try:
        from transformers.core_model_loading import revert_weight_conversion

        reverted = revert_weight_conversion(model, tags)
    except ImportError:  # transformers without load-time conversions: names are the checkpoint's
        reverted = tags
    pieces = {name: [] for name in shapes}
    firsts = torch.tensor([s for s, _ in spans])
    for key, codes in reverted.items():
        codes = codes.flatten()
        if not key.endswith(".weight") or codes.numel() == 0:
            continue
        owner = int(torch.searchsorted(firsts, codes[0], right=True)) - 1
        first, name = spans[owner]
        pieces[name].append((key[: -len(".weight")], codes - first))
    for name, shape in shapes.items():  # a weight whose rows the revert did not all place is not rounded here
        if sum(rows.numel() for _, rows in pieces[name]) != math.prod(shape[:-1]):
            pieces[name] = []
    return pieces


def _to_checkpoint_names(qweight, absmax, pieces) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A parameter's packed result cut into the checkpoint tensors it is stored as."""
    q, a = qweight.reshape(-1, *qweight.shape[-2:]), absmax.reshape(-1, absmax.shape[-1])
    return {module: (q[rows].contiguous(), a[rows].contiguous()) for module, rows in pieces}


def rounded_weight(W: torch.Tensor, H: torch.Tensor, codebook: torch.Tensor, k: int, rotation=None, **options):
    """(qweight, absmax, W_hat in W's dtype) of W [N, K] (H [K, K]) or of a group of experts W [G, N, K]
    (H [G, K, K]) by GPTQ. With ``rotation`` the packed weight is Q(W R), rounded on the Hessian of the rotated
    inputs R^T H R (W R computed in float32), and W_hat = Q(W R) R^T is the value in the original basis."""
    cb = codebook.to(W.device)
    Wq = W if rotation is None else rotation.rotate(W.float())
    if rotation is not None:
        H = rotation.rotate_hessian(H)
    if W.dim() == 3:
        qweight, absmax = gptq_quantize_experts(Wq, H, cb, k, **options)
    else:
        qweight, absmax = gptq_quantize(Wq, H, cb, k, **options)
    shape = qweight.shape
    out_dtype = W.dtype if rotation is None else torch.float32
    W_hat = _dequantize(qweight.reshape(-1, *shape[-2:]), absmax.reshape(-1, shape[-2]), cb, out_dtype).view(W.shape)
    if rotation is not None:
        W_hat = rotation.rotate(W_hat, inverse=True).to(W.dtype)
    return qweight, absmax, W_hat


def _calibrate_layer(layer, prefix, hidden, call, plan, packed, options, min_expert_tokens, report, rotation=None,
                     fp_inputs=None):
    """Runs the layer once on all calibration tokens, rounding each planned weight when its input first
    arrives (linear layers: a pre-hook; routed experts: :func:`_experts_forward`); returns the layer's
    output, computed with the rounded weights: the next layer's input. ``fp_inputs`` (from
    :func:`_full_precision_inputs`, with "alpha"): round towards :func:`asymmetric_target`."""
    last = {}  # the last input seen, its H and dC: q/k/v (and gate/up) read the same tensor

    def hessian(x):
        if last.get("x") is not x:
            last.clear()
            last.update(x=x, H=_linear_inputs_hessian(x))
        return last["H"]

    def shift(x_fp, x):
        hessian(x)
        if "dC" not in last:
            last["dC"] = _input_shift(x_fp, x)
        return last["dC"]

    def rounded(name, W, H, dC=None):
        """(qweight, absmax, W's rounded values in its dtype) by GPTQ with the planned settings; W [N, K], or
        [G, N, K] with H [G, K, K] for a group of experts; with dC (asymmetric calibration) towards
        :func:`asymmetric_target`."""
        k, cb, _ = plan[name]
        if dC is not None:
            W_target = asymmetric_target(W, H, dC, options["damp"], fp_inputs["alpha"])
            qweight, absmax, W_hat = rounded_weight(W_target, H, cb, k, rotation, **options)
            return qweight, absmax, W_hat.to(W.dtype)
        return rounded_weight(W, H, cb, k, rotation, **options)

    def linear_hook(name):
        def hook(mod, args):
            if name in packed:
                return
            x = args[0]
            dC = None if fp_inputs is None else shift(fp_inputs[name], x)
            qweight, absmax, W_hat = rounded(name, mod.weight.detach(), hessian(x), dC)
            mod.weight.copy_(W_hat)
            packed[name] = (qweight.cpu(), absmax.cpu())
        return hook

    handles, patched = [], []
    for name, module, experts in _planned_modules(layer, prefix, plan):
        if not experts:
            handles.append(module.register_forward_pre_hook(linear_hook(name)))
            continue
        extra = {} if fp_inputs is None else {"x_fp_all": fp_inputs[name]}
        module.forward = _experts_forward(module, name, plan, packed, rounded, min_expert_tokens, report, **extra)
        patched.append(module)
    try:
        args, kwargs = call
        out = layer(hidden, *args, **kwargs)
    finally:
        for h in handles:
            h.remove()
        for module in patched:
            del module.forward
    return out[0] if isinstance(out, tuple) else out


def _experts_forward(mod, name, plan, packed, rounded, min_expert_tokens, report, x_fp_all=None):
    """The experts' forward (transformers' eager one: act(x gate^T) * (x up^T), then down, weighted by the
    router) that rounds the experts just before they run, :data:`EXPERT_GROUP` at a time
    (:func:`gptq_quantize_experts`): gate_up on the Hessian of the tokens routed to each, down on the Hessian
    of its intermediate activations on those tokens. An expert with fewer than ``min_expert_tokens``
    (default :func:`expert_min_tokens`) is rounded on every token entering the layer instead (and its down
    projection on its activations of all of them); it still outputs only its own tokens. ``x_fp_all`` (asymmetric
    calibration): the layer's input in the full-precision model; each expert's gate_up then rounds towards the
    full-precision output on the same tokens, and its down projection towards its full-precision activations (its
    gate_up's own weights on x_fp)."""
    E, two_i, K = mod.gate_up_proj.shape
    names = (f"{name}.gate_up_proj", f"{name}.down_proj")
    threshold = expert_min_tokens(K) if min_expert_tokens is None else min_expert_tokens
    report.min_expert_tokens.append(threshold)
    for param_name, param in zip(names, (mod.gate_up_proj, mod.down_proj)):
        if param_name in plan:
            k = plan[param_name][0]
            N, KB = param.shape[1], param.shape[2] // fmt.BLOCK_SIZE
            packed[param_name] = (torch.empty(E, N, KB, k, dtype=torch.int32), torch.empty(E, N, KB, dtype=torch.uint8))

    def round_experts(param_name, param, group, H, dC=None):
        """The group's weights [G, N, K] (a view of the layer's), rounded in place when planned; H (and dC) [G, K, K]."""
        experts = slice(group[0], group[-1] + 1)
        if param_name in plan:
            qweight, absmax, W_hat = rounded(param_name, param[experts].detach(), H, dC)
            param[experts].copy_(W_hat)
            packed[param_name][0][experts], packed[param_name][1][experts] = qweight.cpu(), absmax.cpu()
        return param[experts]

    def forward(hidden_states, top_k_index, top_k_weights):
        # Alive across the layer: the input, the routing, the output and (once an expert falls back) the Hessian of
        # all tokens. Per group: its G Hessians (one buffer, gate_up's then down's), the routed tokens of the
        # experts that have their own Hessian, and each expert's activations on its routed tokens only (a
        # fallback expert's activations on all tokens live while its down Hessian is summed, then are cut).
        out = torch.zeros_like(hidden_states)
        H_all = None
        for e0 in range(0, E, EXPERT_GROUP):
            group = list(range(e0, min(e0 + EXPERT_GROUP, E)))
            routes = [torch.where(top_k_index == e) for e in group]
            few = [token_idx.numel() < threshold for token_idx, _ in routes]
            if any(few) and H_all is None:
                H_all = _linear_inputs_hessian(hidden_states)
            xs = [hidden_states if f else hidden_states[token_idx] for f, (token_idx, _) in zip(few, routes)]
            report.experts += len(group)
            report.experts_fallback += sum(few)
            H = hidden_states.new_empty(len(group), K, K, dtype=torch.float32)
            for i, (f, x) in enumerate(zip(few, xs)):
                H[i] = H_all if f else _linear_inputs_hessian(x)
            dC = dC_down = xs_fp = W_up_fp = None
            if x_fp_all is not None:
                xs_fp = [x_fp_all if f else x_fp_all[token_idx] for f, (token_idx, _) in zip(few, routes)]
                dC = torch.empty_like(H)
                for i, (x_fp, x) in enumerate(zip(xs_fp, xs)):
                    dC[i] = _input_shift(x_fp, x)
                W_up_fp = mod.gate_up_proj[group[0]: group[-1] + 1].detach().clone()  # before it is rounded in place
            W_up = round_experts(names[0], mod.gate_up_proj, group, H, dC)
            del H, dC
            H_down, acts = hidden_states.new_empty(len(group), two_i // 2, two_i // 2, dtype=torch.float32), []
            if x_fp_all is not None:
                dC_down = torch.empty_like(H_down)
            for i, (f, x, (token_idx, _)) in enumerate(zip(few, xs, routes)):
                gate, up = torch.nn.functional.linear(x, W_up[i]).chunk(2, dim=-1)
                act = mod.act_fn(gate) * up
                del gate, up
                H_down[i] = _linear_inputs_hessian(act)
                if dC_down is not None:
                    gate, up = torch.nn.functional.linear(xs_fp[i], W_up_fp[i]).chunk(2, dim=-1)
                    dC_down[i] = _input_shift(mod.act_fn(gate) * up, act)
                    del gate, up
                acts.append(act[token_idx] if f else act)  # what the expert outputs: its routed tokens
                del act
            del xs, xs_fp, W_up_fp
            W_down = round_experts(names[1], mod.down_proj, group, H_down, dC_down)
            del H_down, dC_down
            for i, (token_idx, pos) in enumerate(routes):
                y = torch.nn.functional.linear(acts[i], W_down[i]) * top_k_weights[token_idx, pos, None]
                out.index_add_(0, token_idx, y.to(out.dtype))
            del acts
        return out

    return forward
