"""Error-compensating rounding (GPTQ) into the kbit format, for ``vllm-kbit convert --gptq``.

Round-to-nearest (``reference.quantize``) picks each index on its own. GPTQ (Frantar et al.,
2022) rounds the columns of ``W[N, K]`` one at a time and moves each column's rounding error
onto the columns not yet rounded, weighted by the inverse of ``H = X^T X`` (X: the layer's
inputs on calibration text), so the layer's *output* error ``||X W^T - X W_hat^T||`` shrinks
instead of the weight error. The result is an ordinary kbit weight: the same codebook, the
same E4M4 scale per block of 32 (picked by ``reference.block_scales`` on the error-updated
block when GPTQ reaches its first column), indices chosen with the reference's thresholds
against the updated values; ``reference.dequantize`` reads it unchanged.

:func:`quantize_model` runs the calibration forward once and quantizes sequentially: a hook
on each linear layer quantizes it when its input first arrives, so every later layer is
calibrated on the outputs of the already quantized ones. Calibration text defaults to
:func:`calibration_text` (docstrings of Python's standard library, which every CPython ships).
"""

from __future__ import annotations

import torch

from vllm_kbit import reference as fmt

DEFAULT_DAMP = 0.01  # added to H's diagonal, as a fraction of its mean diagonal
DEFAULT_CALIBRATION_TOKENS = 4096
DEFAULT_CALIBRATION_WINDOW = 512
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """W[N, K] and H[K, K] (sum of x x^T over calibration inputs) -> (qweight, absmax) in the flat layout.

    Columns in natural order; lazy batch updates over ``lazy_cols`` columns (a multiple of 32).
    Inputs that never fire (H[i, i] == 0) get H[i, i] = 1, so their columns are rounded to
    nearest with nothing to compensate.
    """
    fmt.check_weight(W)
    fmt.check_codebook(codebook, k)
    fmt.check_representable(W)
    N, K = W.shape
    if H.shape != (K, K):
        raise ValueError(f"kbit gptq: H has shape {list(H.shape)}, weight {list(W.shape)} needs [{K}, {K}]")
    if lazy_cols % fmt.BLOCK_SIZE:
        raise ValueError(f"kbit gptq: lazy_cols={lazy_cols} is not a multiple of {fmt.BLOCK_SIZE}")
    dev = W.device
    Wf = W.float().clone()
    H = H.to(dev, torch.float32).clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    H.diagonal().add_(damp * H.diagonal().mean())
    # Upper Cholesky factor of H^-1: row i holds the update of columns > i after rounding column i.
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)

    cb = codebook.to(dev)
    thresholds = fmt.codebook_thresholds(cb)
    KB = K // fmt.BLOCK_SIZE
    idx = torch.empty(N, K, dtype=torch.uint8, device=dev)
    codes = torch.empty(N, KB, dtype=torch.uint8, device=dev)
    for c0 in range(0, K, lazy_cols):
        c1 = min(c0 + lazy_cols, K)
        Wb = Wf[:, c0:c1].clone()
        Eb = torch.zeros_like(Wb)
        Hb = Hinv[c0:c1, c0:c1]
        for j in range(c1 - c0):
            col = c0 + j
            if col % fmt.BLOCK_SIZE == 0:  # a new block: its scale from the updated weights
                blk = col // fmt.BLOCK_SIZE
                block = Wb[:, j : j + fmt.BLOCK_SIZE].contiguous()
                codes[:, blk] = fmt.block_scales(block, cb, search_scale)[:, 0]
                s = fmt.e4m4_decode(codes[:, blk])
                products = thresholds.unsqueeze(0) * s.unsqueeze(-1)  # fp32(t_i * s), as the reference
            w = Wb[:, j]
            q_idx = (w.unsqueeze(-1) > products).sum(-1)
            idx[:, col] = q_idx.to(torch.uint8)
            q = cb[q_idx] * s
            err = (w - q) / Hb[j, j]
            Wb[:, j:] -= err.unsqueeze(-1) * Hb[j, j:].unsqueeze(0)
            Eb[:, j] = err
        Wf[:, c1:] -= Eb @ Hinv[c0:c1, c1:]
    qweight = fmt.pack_bitplanes(idx.view(N, KB, fmt.BLOCK_SIZE), k)
    return qweight, codes


def _linear_inputs_hessian(x: torch.Tensor) -> torch.Tensor:
    x = x.reshape(-1, x.shape[-1]).float()
    return x.T @ x


@torch.no_grad()
def quantize_model(model, tokenizer, select, text: str | None = None, n_tokens: int = DEFAULT_CALIBRATION_TOKENS,
                   window: int = DEFAULT_CALIBRATION_WINDOW, search_scale: bool = fmt.DEFAULT_SEARCH_SCALE,
                   damp: float = DEFAULT_DAMP, progress=None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
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

    def hook_for(name, module, k, codebook):
        def hook(mod, args):
            if name in results:
                return
            H = _linear_inputs_hessian(args[0])
            qweight, absmax = gptq_quantize(mod.weight.detach(), H, codebook.to(mod.weight.device), k, search_scale, damp)
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
