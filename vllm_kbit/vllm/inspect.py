"""What a loaded vLLM model holds, for ``LLM.apply_model`` (runs inside each worker; pickled by reference).

    from vllm_kbit.vllm.inspect import layer_summary
    llm.apply_model(layer_summary)   # one dict per worker (tensor-parallel rank)
"""

from __future__ import annotations

import hashlib

import torch


def layer_summary(model: torch.nn.Module) -> dict:
    """Per linear / MoE / embedding layer (embed_tokens, lm_head): its quant method, bits (kbit layers), parameter dtypes and shapes, and for
    kbit layers a sha256 of the runtime tensors (equal hashes = bit-identical packed weights).

    ``left_unquantized``: why the kbit config left the layer unquantized (a reason of
    :mod:`vllm_kbit.vllm.load_report`); ``quant_config``: the name of the quantization config the model
    built the layer with, None where vLLM built it without one (the config is then never asked about it:
    router gates, a gated delta-net's conv1d).

    Layers are keyed by their checkpoint prefix: vLLM 0.26 keeps a MoE block's experts in a
    ``RoutedExperts`` child (``...mlp.experts.routed_experts``) whose ``layer_name`` is that prefix
    (``...mlp.experts``)."""
    out = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        kind = type(method).__name__ if method is not None else ""
        if "Linear" not in kind and "MoE" not in kind and "Embedding" not in kind:
            continue
        params = dict(module.named_parameters(recurse=False))
        name = getattr(module, "layer_name", name) if "MoE" in kind else name
        info: dict = {"method": kind, "params": {n: [str(p.dtype), list(p.shape)] for n, p in params.items()}}
        if hasattr(module, "kbit_left_unquantized"):
            info["left_unquantized"] = module.kbit_left_unquantized
        if hasattr(module, "quant_config"):
            qc = module.quant_config
            info["quant_config"] = None if qc is None else type(qc).__name__
        # Rotated kbit layers: the size of each input rotation's signs this rank holds (kbit_*rot_signs buffers).
        rotated = {n: b.numel() for n, b in module.named_buffers(recurse=False) if n.endswith("rot_signs")}
        if rotated:
            info["rotation"] = rotated
        codebook = getattr(module, "kbit_codebook", None)
        if codebook is not None:
            info["bits"] = codebook.numel().bit_length() - 1
            h = hashlib.sha256()
            for n in sorted(params):
                h.update(n.encode())
                h.update(params[n].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            info["hash"] = h.hexdigest()
        out[name] = info
    return out


def process_memory(model: torch.nn.Module) -> dict:
    """This worker's peak and current resident memory (bytes) and, on a GPU, torch's peak allocation."""
    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                status[key] = int(value.split()[0]) * 1024
    if torch.cuda.is_available():
        status["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
    return status
