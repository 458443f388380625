"""A trained dense Llama-architecture model rewritten as a Mixtral MoE that computes the same function.

No trained MoE checkpoint can be downloaded here, but a trained dense model can be turned into one whose
routed experts carry its trained weights: each MLP's intermediate dimension is split into E experts
(expert e holds rows e*I/E .. (e+1)*I/E - 1 of gate_proj / up_proj and the same columns of down_proj),
the router's weights are zero, so every expert gets the same logit and softmax gives each 1/E, every
token goes to all E experts (top-k = E; Mixtral renormalizes the top-k weights, which stay 1/E), and
each expert's output is multiplied by E: its up projection by a and its down projection by E / a (the
expert is linear in both), a a power of two chosen per layer so that the larger of the two scaled
projections is as small as it can be. Then sum_e (1/E) * (E/a) down_e(silu(gate_e x) * a up_e x) is the
dense MLP, split along its intermediate dimension. With E a power of two, every scaling is exact in bf16,
so the MoE differs from the dense model only by the order of the intermediate sums. Splitting the factor
keeps the experts' weights inside what kbit's block scale holds (|w| <= 31): SmolLM2-135M's up and down
projections reach 6.7 and 6.1, so 8 x either alone would not fit, 2 x up and 4 x down (27.0) does.

Its experts then run through vLLM's FusedMoE and, with ``--quantization kbit``, the kbit MoE kernels on
trained weights. kbit quantizes them as it quantizes the dense model: gate / up blocks are the same
rows, down's blocks of 32 along the intermediate dimension stay whole (I/E is a multiple of 32) and a
block multiplied by a power of two gets the same indices, its E4M4 scale a whole number of exponents
higher (while the scale stays in the normal range).

    python benchmarks/moe_rewrite.py DENSE_DIR OUT_DIR [--experts 8]

(An exact Qwen3-MoE rewrite of this model is not possible: Qwen3 attention normalizes q and k per head,
which a Llama model does not.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

MLP = ("gate_proj", "up_proj", "down_proj")
# Mixtral's expert names for the dense MLP's projections (w1 = gate, w3 = up, w2 = down).
EXPERT_NAME = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def mixtral_config(llama: dict, experts: int) -> dict:
    """The Mixtral config.json of a Llama config.json with its MLP split into `experts` routed experts."""
    if llama.get("model_type") != "llama":
        raise ValueError(f"moe_rewrite: expects a Llama checkpoint, got model_type {llama.get('model_type')!r}")
    inter = llama["intermediate_size"]
    if experts < 1 or experts & (experts - 1) or inter % experts or (inter // experts) % 32:
        raise ValueError(f"moe_rewrite: {experts} experts must be a power of two dividing intermediate_size {inter} "
                         "into slices that are multiples of 32")
    keep = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps", "rope_parameters",
            "rope_theta", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "attention_dropout",
            "dtype", "torch_dtype")
    config = {k: llama[k] for k in keep if k in llama}
    config.update(model_type="mixtral", architectures=["MixtralForCausalLM"], intermediate_size=inter // experts,
                  num_local_experts=experts, num_experts_per_tok=experts, sliding_window=None,
                  router_jitter_noise=0.0, output_router_logits=False)
    return config


def split_factor(up: torch.Tensor, down: torch.Tensor, experts: int) -> tuple[int, int]:
    """(a, E / a): the powers of two multiplying up and down whose product is E, the larger scaled |w| smallest."""
    mu, md = up.abs().max().item(), down.abs().max().item()
    options = [(1 << i, experts >> i) for i in range(experts.bit_length())]
    return min(options, key=lambda ab: max(ab[0] * mu, ab[1] * md))


def rewrite_state(state: dict, experts: int) -> dict:
    """Dense Llama tensors -> Mixtral tensors (see the module docstring)."""
    out = {}
    for name, t in state.items():
        parts = name.split(".")
        if len(parts) >= 5 and parts[3] == "mlp" and parts[4] in MLP:  # model.layers.<i>.mlp.<proj>.weight
            layer = ".".join(parts[:4])
            prefix = ".".join(parts[:3]) + ".block_sparse_moe"
            proj = parts[4]
            a, b = split_factor(state[f"{layer}.up_proj.weight"], state[f"{layer}.down_proj.weight"], experts)
            factor = {"gate_proj": 1, "up_proj": a, "down_proj": b}[proj]
            axis = 1 if proj == "down_proj" else 0  # down: [H, I]; gate, up: [I, H]
            for e, piece in enumerate(t.chunk(experts, dim=axis)):
                out[f"{prefix}.experts.{e}.{EXPERT_NAME[proj]}.weight"] = (piece * factor).contiguous()  # exact
            if proj == "gate_proj":
                out[f"{prefix}.gate.weight"] = torch.zeros(experts, t.shape[1], dtype=t.dtype)
        else:
            out[name] = t
    return out


def rewrite(dense_dir: str, out_dir: str, experts: int = 8) -> str:
    """Writes the Mixtral rewrite of the Llama checkpoint in dense_dir to out_dir; returns out_dir."""
    with open(os.path.join(dense_dir, "config.json")) as f:
        config = mixtral_config(json.load(f), experts)
    files = sorted(n for n in os.listdir(dense_dir) if n.endswith(".safetensors"))
    if files != ["model.safetensors"]:
        raise ValueError(f"moe_rewrite: expects one model.safetensors in {dense_dir}, found {files}")
    state = rewrite_state(load_file(os.path.join(dense_dir, "model.safetensors")), experts)
    os.makedirs(out_dir, exist_ok=True)
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in os.listdir(dense_dir):  # tokenizer, chat template, generation config
        if name not in ("config.json", "model.safetensors") and os.path.isfile(os.path.join(dense_dir, name)):
            shutil.copy2(os.path.join(dense_dir, name), os.path.join(out_dir, name))
    return out_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dense_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--experts", type=int, default=8)
    args = ap.parse_args()
    print(rewrite(args.dense_dir, args.out_dir, args.experts))


if __name__ == "__main__":
    main()
