"""Residual-stream rotation (QuaRot's R1, folded offline) against kbit's per-layer rotation, with ``--gptq``.

    .venv/bin/python benchmarks/residual_rotation.py --variant {none,perlayer,fold_perlayer,resid,resid_down}
                                                    [--k 3] [--seed 0] [--r1 hadamard|ortho] [--out FILE.jsonl]

The question: can the rotation cost nothing at run time? kbit rotates each quantized layer's input (x R at run time,
Q(W R) stored). A Llama-style model can instead rotate its residual stream once, offline: fold every RMSNorm's
weight into the layers that read it (W diag(g), norm weight 1), rotate the embedding (E R1), every reader's input
(W diag(g) R1: q/k/v, gate/up, the LM head, untied) and every writer's output (R1^T W: o_proj, down_proj). Per head,
R2 folds into v_proj's rows and o_proj's input. Then no layer but down_proj (whose input is SiLU(gate) * up) needs a
rotation at run time. Variants (the dense SmolLM2-135M of ``accuracy_moe.py``, its evaluation and calibration
tokens, 4096 / 2048, window 1024; GPTQ as ``vllm-kbit convert --gptq`` runs it, on the bf16 weights):

- ``none``: GPTQ, no rotation; ``perlayer``: kbit's rotation on every layer (what ``convert --gptq`` does);
- ``fold_perlayer``: the norms folded into the weights first, then ``perlayer``;
- ``resid``: R1 and R2 folded, no run-time rotation; ``resid_down``: plus kbit's rotation of down_proj's input.

R1 is kbit's block Hadamard with random signs (``--r1 hadamard``, the seed's signs, blocks as kbit picks them) or a
random orthogonal matrix of the full width (``--r1 ortho``). Each run appends one json line (perplexity) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time

import torch

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parent), str(pathlib.Path(__file__).resolve().parents[1])]

VARIANTS = ("none", "perlayer", "fold_perlayer", "resid", "resid_down")


class Transform:
    """The residual-stream rotation of a Llama-style model, in place (see the module docstring)."""

    def __init__(self, model, seed: int, r1: str, fold_only: bool) -> None:
        from vllm_kbit import reference as fmt
        from vllm_kbit.settings import Rotation

        cfg = model.config
        self.H, self.nq, self.nkv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or self.H // self.nq
        self.fold_only, self.rot, self.fmt = fold_only, Rotation(seed=seed), fmt
        gen = torch.Generator().manual_seed(1000 + seed)
        self.Q1 = self.Q2 = None
        if r1 == "ortho":  # Haar-random orthogonal matrices (QR of Gaussians), full width and per kv head
            self.Q1 = torch.linalg.qr(torch.randn(self.H, self.H, generator=gen, dtype=torch.float64))[0].float()
            self.Q2 = torch.linalg.qr(torch.randn(self.nkv, self.hd, self.hd, generator=gen, dtype=torch.float64))[0].float()
        self.s2 = fmt.rotation_signs(self.nkv * self.hd, seed + 1)  # R2's signs per kv head; q heads take their group's

    def rot_in(self, W: torch.Tensor) -> torch.Tensor:  # W R1: a reader of the residual stream
        W = W.float()
        return W if self.fold_only else W @ self.Q1 if self.Q1 is not None else self.rot.rotate(W)

    def rot_out(self, W: torch.Tensor) -> torch.Tensor:  # R1^T W: a writer (its output rows rotated)
        W = W.float()
        if self.fold_only:
            return W
        return self.Q1.t() @ W if self.Q1 is not None else self.rot.rotate(W.t()).t()

    def rot_v_o(self, Wv: torch.Tensor, Wo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """R2 per head: v_proj's rows of kv head g by R2_g^T, o_proj's input columns of q head h by R2_g(h)."""
        Wv, Wo, hd, group = Wv.float(), Wo.float(), self.hd, self.nq // self.nkv
        if self.fold_only:
            return Wv, Wo
        if self.Q2 is not None:
            Wv = torch.einsum("gji,gjk->gik", self.Q2, Wv.view(self.nkv, hd, -1)).reshape(self.nkv * hd, -1)
            Wo = torch.einsum("ngi,gij->ngj", Wo.view(-1, self.nq, hd), self.Q2.repeat_interleave(group, 0))
            return Wv, Wo.reshape(Wo.shape[0], -1)
        s_q = self.s2.view(self.nkv, hd).repeat_interleave(group, 0).reshape(-1)
        return (self.fmt.hadamard_rotate(Wv.t().contiguous(), self.s2, hd).t(),
                self.fmt.hadamard_rotate(Wo.contiguous(), s_q, hd))

    @torch.no_grad()
    def apply(self, model) -> None:
        def put(param, value):
            param.data = value.to(param.dtype).contiguous()

        body = model.model
        g = body.norm.weight.float()
        model.lm_head.weight = torch.nn.Parameter(self.rot_in(model.lm_head.weight.float() * g).to(body.norm.weight.dtype))
        body.embed_tokens.weight = torch.nn.Parameter(self.rot_in(body.embed_tokens.weight).to(body.norm.weight.dtype))
        model.config.tie_word_embeddings = False
        body.norm.weight.fill_(1.0)
        for layer in body.layers:
            at, mlp = layer.self_attn, layer.mlp
            g1, g2 = layer.input_layernorm.weight.float(), layer.post_attention_layernorm.weight.float()
            for lin in (at.q_proj, at.k_proj, at.v_proj):
                put(lin.weight, self.rot_in(lin.weight.float() * g1))
            Wv, Wo = self.rot_v_o(at.v_proj.weight, at.o_proj.weight)
            put(at.v_proj.weight, Wv)
            put(at.o_proj.weight, self.rot_out(Wo))
            for lin in (mlp.gate_proj, mlp.up_proj):
                put(lin.weight, self.rot_in(lin.weight.float() * g2))
            put(mlp.down_proj.weight, self.rot_out(mlp.down_proj.weight))
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)


class OnlyInputSize:
    """kbit's rotation of the layers with input size K only (down_proj's); the others rounded unrotated."""

    def __init__(self, rotation, K: int) -> None:
        self.rotation, self.K = rotation, K

    def block(self, K: int) -> int:
        return self.rotation.block(K)

    def rotate(self, W: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        return self.rotation.rotate(W, inverse) if W.shape[-1] == self.K else W.float()

    def rotate_hessian(self, H: torch.Tensor) -> torch.Tensor:
        return self.rotation.rotate_hessian(H) if H.shape[-1] == self.K else H


def load(model_dir: str, variant: str, seed: int, r1: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    if variant in ("fold_perlayer", "resid", "resid_down"):
        Transform(model, seed, r1, fold_only=variant == "fold_perlayer").apply(model)
    return model


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", choices=VARIANTS, required=True)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--r1", choices=["hadamard", "ortho"], default="hadamard")
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--no-quant", action="store_true", help="evaluate the transformed bf16 model (the fold's own error)")
    ap.add_argument("--out", default="residual_rotation.jsonl")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.time()

    from transformers import AutoTokenizer

    import accuracy_moe as am
    from accuracy_real import evaluate_text
    from vllm_kbit import gptq
    from vllm_kbit import reference as fmt
    from vllm_kbit.settings import KbitSettings, Rotation

    model_dir = am._real_model().checkpoint()
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = torch.tensor(am.eval_ids(tok, a.eval_tokens)[0])
    _, calib_text = am.calibration_ids(tok, a.calib_tokens)
    model = load(model_dir, a.variant, a.seed, a.r1)
    inter = model.config.intermediate_size
    rotation = {"none": None, "resid": None, "perlayer": Rotation(seed=a.seed), "fold_perlayer": Rotation(seed=a.seed),
                "resid_down": OnlyInputSize(Rotation(seed=a.seed), inter)}[a.variant]
    packed = {}
    if not a.no_quant:
        cb = KbitSettings.from_dict({"bits": a.k}).codebook(a.k)
        packed = gptq.quantize_model(model, tok, lambda name: (a.k, cb), calib_text, a.calib_tokens, rotation=rotation)
        model = load(model_dir, a.variant, a.seed, a.r1)  # quantize_model used the first copy up
        modules = dict(model.named_modules())
        with torch.no_grad():
            for name, (q, s) in packed.items():
                W_hat = fmt.dequantize(q, s, cb, torch.float32)
                if rotation is not None:
                    W_hat = rotation.rotate(W_hat, inverse=True)
                modules[name].weight.copy_(W_hat.to(torch.bfloat16))
    with torch.inference_mode():
        nll, _ = evaluate_text(model.float(), ids, 1024, predicted_only=True)
    rec = {"variant": a.variant, "r1": a.r1, "k": None if a.no_quant else a.k, "seed": a.seed, "ppl": math.exp(nll),
           "tensors": len(packed), "calib_tokens": a.calib_tokens, "eval_tokens": a.eval_tokens,
           "seconds": round(time.time() - t0)}
    print(json.dumps(rec), flush=True)
    with open(a.out, "a") as f:
        f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
