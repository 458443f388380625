"""Random LoRA adapters in PEFT's format for the tiny models, and the same adapters merged into a checkpoint.

:func:`make_adapter` writes ``adapter_config.json`` + ``adapter_model.safetensors`` as PEFT saves them (what
``vllm serve --lora-modules`` and ``LoRARequest`` load): for each targeted linear module of each decoder layer a
``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]``, drawn from a seeded generator (``lora_B`` non-zero, so the
adapter changes the outputs). :func:`merge_adapter` adds ``scale * B @ A`` (``scale = alpha / r``) to the weights
of a checkpoint: serving that with no LoRA is the reference for serving the base with the adapter.
"""

from __future__ import annotations

import json
import os
import re

import torch

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
PREFIX = "base_model.model."


def _linear_shapes(model_dir: str, targets: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """{checkpoint module name: (out, in)} of the 2-D ``.weight`` tensors whose last name part is a target."""
    from safetensors import safe_open

    shapes = {}
    for f in sorted(os.listdir(model_dir)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, f), framework="pt") as st:
                for key in st.keys():
                    module, _, kind = key.rpartition(".")
                    shape = st.get_slice(key).get_shape()
                    if kind == "weight" and len(shape) == 2 and module.rpartition(".")[2] in targets \
                            and re.search(r"\.layers\.\d+\.", module):
                        shapes[module] = tuple(shape)
    if not shapes:
        raise ValueError(f"no {targets} linear weights in {model_dir}")
    return shapes


def _write_adapter(out_dir: str, shapes: dict, target_modules: list, seed: int, rank: int, alpha: int, std: float,
                   **config) -> str:
    """Random bf16 A / B of every module in ``shapes`` ({name: (out, in)}) and a PEFT adapter_config.json with
    ``target_modules`` (and any other ``config`` keys) into ``out_dir``; returns ``out_dir``."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (n_out, n_in) in shapes.items():
        tensors[f"{PREFIX}{module}.lora_A.weight"] = (torch.randn(rank, n_in, generator=g) * std).to(torch.bfloat16)
        tensors[f"{PREFIX}{module}.lora_B.weight"] = (torch.randn(n_out, rank, generator=g) * std).to(torch.bfloat16)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
                   "target_modules": target_modules, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
                   "modules_to_save": None, **config}, f, indent=1)
    return out_dir


def make_adapter(model_dir: str, out_dir: str, seed: int = 0, targets: tuple[str, ...] = ATTENTION, rank: int = 8,
                 alpha: int = 16, std: float = 0.05) -> str:
    """A random rank-``rank`` adapter on every ``targets`` module of ``model_dir`` (routed experts included when
    ``targets`` names their projections); returns ``out_dir``."""
    return _write_adapter(out_dir, dict(sorted(_linear_shapes(model_dir, targets).items())), sorted(set(targets)),
                          seed, rank, alpha, std, base_model_name_or_path=model_dir)


def merge_adapter(model_dir: str, adapter_dir: str) -> None:
    """Adds the adapter's ``alpha / r * B @ A`` to the matching weights of ``model_dir`` in place (in float32,
    stored back in the weights' dtype)."""
    from safetensors.torch import load_file, save_file

    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        config = json.load(f)
    scale = config["lora_alpha"] / config["r"]
    lora = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    deltas = {key[len(PREFIX):-len(".lora_A.weight")] + ".weight": (lora[key], lora[key.replace("lora_A", "lora_B")])
              for key in lora if key.endswith(".lora_A.weight")}
    merged = set()
    for f in sorted(os.listdir(model_dir)):
        if not f.endswith(".safetensors"):
            continue
        path = os.path.join(model_dir, f)
        tensors = load_file(path)
        for key in set(tensors) & set(deltas):
            A, B = deltas[key]
            tensors[key] = (tensors[key].float() + scale * (B.float() @ A.float())).to(tensors[key].dtype)
            merged.add(key)
        save_file(tensors, path, metadata={"format": "pt"})
    if merged != set(deltas):
        raise ValueError(f"adapter modules not in {model_dir}: {sorted(set(deltas) - merged)[:3]}")


def attention_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """{checkpoint module name: (out, in)} of q/k/v/o_proj in every layer of a Llama / Qwen3-style config."""
    H, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    hd = config.get("head_dim") or H // heads
    per_layer = {"q_proj": (heads * hd, H), "k_proj": (kv * hd, H), "v_proj": (kv * hd, H), "o_proj": (H, heads * hd)}
    return {f"model.layers.{i}.self_attn.{m}": s for i in range(layers) for m, s in per_layer.items()}


def make_attention_adapter(config: dict, out_dir: str, seed: int = 0, rank: int = 8, alpha: int = 16,
                           std: float = 0.05) -> str:
    """A random rank-``rank`` adapter on q/k/v/o_proj of every layer, from the model's config alone (for models
    served with dummy weights, which have no checkpoint to read shapes from); returns ``out_dir``."""
    return _write_adapter(out_dir, attention_shapes(config), list(ATTENTION), seed, rank, alpha, std)


if __name__ == "__main__":
    # python -m kbit_dev.lora MODEL_DIR OUT_DIR [RANK]: a random adapter on q/k/v/o_proj from MODEL_DIR/config.json.
    import sys

    with open(os.path.join(sys.argv[1], "config.json")) as f:
        cfg = json.load(f)
    print(make_attention_adapter(cfg.get("text_config", cfg), sys.argv[2], rank=int(sys.argv[3]) if len(sys.argv) > 3 else 8))
