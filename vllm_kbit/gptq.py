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

:func:`quantize_model` runs the calibration forward once and quantizes sequentially: a hook
on each linear layer quantizes it when its input first arrives, so every later layer is
calibrated on the outputs of the already quantized ones. Calibration text defaults to
:func:`calibration_text` (docstrings of Python's standard library, which every CPython ships).
"""

from __future__ import annotations

import torch

from vllm_kbit import reference as fmt

DEFAULT_DAMP = 0.01  # added to H's diagonal, as a fraction of its mean diagonal
DEFAULT_CALIBRATION_TOKENS = 16384  # enough rows for H of wide layers (K up to several thousand)
DEFAULT_CALIBRATION_WINDOW = 512
DEFAULT_ACT_ORDER = True  # columns in order of decreasing H[i, i] (see the module docstring)
# How GPTQ picks a block's E4M4 scale among the reference's candidates: "mse" the reference's plain
# block error; "hdiag" each column's squared error weighted by its input energy H[i, i]; "gptq" weighted
# by 1 / [H^-1]_ii of the columns still open when it is rounded (GPTQ's own loss for that column).
SCALE_RULES = ("mse", "hdiag", "gptq")
DEFAULT_SCALE_RULE = "gptq"
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """W[N, K] and H[K, K] (sum of x x^T over calibration inputs) -> (qweight, absmax) in the flat layout.

    Columns in natural order, or with ``act_order`` in order of decreasing H[i, i] (the inputs with
    the most energy first, while the most columns are left to take their error); lazy batch updates
    over ``lazy_cols`` columns (a multiple of 32) of that order. A block's scale is fixed when the
    order first reaches one of its columns, from the block's values as updated so far (``scale_rule``:
    see :data:`SCALE_RULES`). Inputs that never fire (H[i, i] == 0) get H[i, i] = 1, so their
    columns are rounded to nearest with nothing to compensate.
    """
    fmt.check_weight(W)
    fmt.check_codebook(codebook, k)
    fmt.check_representable(W)
    N, K = W.shape
    if H.shape != (K, K):
        raise ValueError(f"kbit gptq: H has shape {list(H.shape)}, weight {list(W.shape)} needs [{K}, {K}]")
    if lazy_cols % fmt.BLOCK_SIZE:
        raise ValueError(f"kbit gptq: lazy_cols={lazy_cols} is not a multiple of {fmt.BLOCK_SIZE}")
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"kbit gptq: scale_rule={scale_rule!r}, expected one of {sorted(SCALE_RULES)}")
    dev = W.device
    H = _damped(H.to(dev, torch.float32), damp)
    perm = torch.argsort(torch.diag(H), descending=True, stable=True) if act_order else torch.arange(K, device=dev)
    # Upper Cholesky factor of H^-1 in processing order: row i holds the update of the columns
    # processed after i once column i is rounded.
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H[perm][:, perm])), upper=True)
    col_weight = _column_weights(H, Hinv, perm, scale_rule)

    Wf = W.float()[:, perm].contiguous()  # processing order
    pos = torch.argsort(perm)  # processing position of each original column
    block_of = (perm // fmt.BLOCK_SIZE).tolist()
    cb = codebook.to(dev)
    thresholds = fmt.codebook_thresholds(cb)
    KB = K // fmt.BLOCK_SIZE
    idx = torch.empty(N, K, dtype=torch.uint8, device=dev)  # processing order
    codes = torch.empty(N, KB, dtype=torch.uint8, device=dev)
    scales, products = {}, {}  # per block, once decided: decoded scale [N], fp32(t_i * s) [N, 2^k - 1]
    for c0 in range(0, K, lazy_cols):
        c1 = min(c0 + lazy_cols, K)
        Wb = Wf[:, c0:c1].clone()
        Eb = torch.zeros_like(Wb)
        Hb = Hinv[c0:c1, c0:c1]
        for j in range(c1 - c0):
            blk = block_of[c0 + j]
            if blk not in scales:  # the first column of this block: its scale from the updated weights
                cols = pos[blk * fmt.BLOCK_SIZE : (blk + 1) * fmt.BLOCK_SIZE]
                block = _current_columns(Wf, Wb, Eb, Hinv, cols, c0, c1)
                weight = None if col_weight is None else col_weight[blk * fmt.BLOCK_SIZE : (blk + 1) * fmt.BLOCK_SIZE]
                codes[:, blk] = fmt.block_scales(block, cb, search_scale, weight)[:, 0]
                scales[blk] = fmt.e4m4_decode(codes[:, blk])
                products[blk] = thresholds.unsqueeze(0) * scales[blk].unsqueeze(-1)  # fp32(t_i * s), as the reference
            w = Wb[:, j]
            q_idx = (w.unsqueeze(-1) > products[blk]).sum(-1)
            idx[:, c0 + j] = q_idx.to(torch.uint8)
            q = cb[q_idx] * scales[blk]
            err = (w - q) / Hb[j, j]
            Wb[:, j:] -= err.unsqueeze(-1) * Hb[j, j:].unsqueeze(0)
            Eb[:, j] = err
        Wf[:, c1:] -= Eb @ Hinv[c0:c1, c1:]
    idx = idx[:, pos]  # back to the original column order
    qweight = fmt.pack_bitplanes(idx.view(N, KB, fmt.BLOCK_SIZE), k)
    return qweight, codes


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


@torch.no_grad()
def quantize_model(model, tokenizer, select, text: str | None = None, n_tokens: int = DEFAULT_CALIBRATION_TOKENS,
                   window: int = DEFAULT_CALIBRATION_WINDOW, search_scale: bool = fmt.DEFAULT_SEARCH_SCALE,
                   damp: float = DEFAULT_DAMP, act_order: bool = DEFAULT_ACT_ORDER, scale_rule: str = DEFAULT_SCALE_RULE,
                   progress=None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """GPTQ-quantizes the model's linear layers in place, sequentially, in one calibration forward.

    ``select(module_name) -> (k, codebook) or None`` picks the layers and their settings. Returns
    ``{module_name: (qweight, absmax)}``; each chosen layer's weight is replaced by its decoded
    value (in its dtype) before the layer runs, so later layers see quantized inputs. The
    calibration text (``text``, default :func:`calibration_text`) is cut into ``n_tokens //
    window`` windows of ``window`` tokens, all run as one batch.
    """
    text = calibration_text() if text is None else text
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    n_windows = min(n_tokens, ids.numel()) // window
    if n_windows == 0:
        raise ValueError(f"kbit gptq: calibration text has {ids.numel()} tokens, fewer than one window of {window}")
    batch = ids[: n_windows * window].view(n_windows, window)
    results: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    handles = []
    last = {}  # the last input seen and its H: q/k/v (and gate/up) read the same tensor

    def hessian(x):
        if last.get("x") is not x:
            last.update(x=x, H=_linear_inputs_hessian(x))
        return last["H"]

    def hook_for(name, module, k, codebook):
        def hook(mod, args):
            if name in results:
                return
            qweight, absmax = gptq_quantize(mod.weight.detach(), hessian(args[0]), codebook.to(mod.weight.device), k,
                                            search_scale, damp, act_order=act_order, scale_rule=scale_rule)
            mod.weight.copy_(fmt.dequantize(qweight, absmax, codebook.to(qweight.device), mod.weight.dtype))
            results[name] = (qweight.cpu(), absmax.cpu())
            if progress is not None:
                progress(name)
        return hook

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            choice = select(name)
            if choice is not None:
                handles.append(module.register_forward_pre_hook(hook_for(name, module, *choice)))
    try:
        body = getattr(model, "model", model)  # the decoder without the LM head: its logits are not needed
        body(input_ids=batch.to(next(model.parameters()).device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return results
