"""`convert --gptq` one decoder layer at a time (vllm_kbit.gptq.quantize_model): the same packed weights as
the whole-model calibration forward it replaced, one layer on the compute device at a time, and routed
experts rounded on the Hessian of the tokens routed to them (all tokens for an expert that got too few)."""

from __future__ import annotations

import pytest
import torch

from vllm_kbit import gptq
from vllm_kbit import reference as fmt
from vllm_kbit.settings import KbitSettings


def _text(chars: int = 6000) -> str:
    return gptq.calibration_text()[:chars]


def _load(src):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(src, dtype="auto").eval(), AutoTokenizer.from_pretrained(src)


@torch.no_grad()
def _whole_model_gptq(model, tokenizer, select, text, n_tokens, window):
    """The calibration `convert --gptq` ran before: the whole model in one forward, each linear layer rounded
    by a pre-hook when its input first arrives."""
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    batch = ids[: min(n_tokens, ids.numel()) // window * window].view(-1, window)
    results, handles, last = {}, [], {}

    def hessian(x):
        if last.get("x") is not x:
            last.update(x=x, H=gptq._linear_inputs_hessian(x))
        return last["H"]

    def hook_for(name, k, cb):
        def hook(mod, args):
            if name not in results:
                results[name] = gptq.gptq_quantize(mod.weight.detach(), hessian(args[0]), cb, k)
                mod.weight.copy_(fmt.dequantize(*results[name], cb, mod.weight.dtype))
        return hook

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and select(name) is not None:
            handles.append(module.register_forward_pre_hook(hook_for(name, *select(name))))
    model.model(input_ids=batch, use_cache=False)
    for h in handles:
        h.remove()
    return results


@pytest.mark.parametrize("k, rule, act_order", [(4, "gptq", True), (3, "mse", False), (2, "hdiag", True), (5, "gptq", True)])
def test_experts_together_equal_one_at_a_time(k, rule, act_order):
    """gptq_quantize_experts on B weights with their own H (one with no inputs at all: H = 0) is gptq_quantize
    of each, bit for bit: each weight in its own column order, its scales decided where its order first
    reaches a block."""
    B, N, K = 4, 40, 256
    g = torch.Generator().manual_seed(k)
    W = (torch.randn(B, N, K, generator=g) * 0.02).to(torch.bfloat16)
    H = []
    for b in range(B):
        X = torch.randn(200 + 100 * b, K, generator=g) @ (torch.randn(K, K, generator=g) / K**0.5 + torch.eye(K))
        X[:, torch.randperm(K, generator=g)[:8]] *= 8
        H.append(X.T @ X)
    H = torch.stack(H)
    H[2] = 0
    cb = fmt.default_codebook(k)
    q, a = gptq.gptq_quantize_experts(W, H, cb, k, act_order=act_order, scale_rule=rule, lazy_cols=64)
    assert q.shape == (B, N, K // 32, k) and a.shape == (B, N, K // 32)
    for b in range(B):
        want = gptq.gptq_quantize(W[b], H[b], cb, k, act_order=act_order, scale_rule=rule, lazy_cols=64)
        assert torch.equal(q[b], want[0]) and torch.equal(a[b], want[1]), b


@pytest.mark.parametrize("k", fmt.SUPPORTED_BITS)
@pytest.mark.parametrize("search", [True, False])
@pytest.mark.parametrize("rows_at_once", [None, 128])
def test_all_candidate_block_scales_equal_the_reference(k, search, rows_at_once, monkeypatch):
    """The experts' scale decision (every candidate at once) picks the reference's code: zero blocks, blocks
    with tied candidates (values on a coarse grid) and per-row column weights included; also when it takes the
    blocks a few rows at a time (SCALE_SEARCH_ROWS below the 600 here: 4 full chunks and a short one)."""
    if rows_at_once:
        monkeypatch.setattr(gptq, "SCALE_SEARCH_ROWS", rows_at_once)
    g = torch.Generator().manual_seed(20 + k)
    W = torch.randn(600, 32, generator=g) * torch.rand(600, 1, generator=g) * 0.1
    W[:50] = 0
    W[50:150] = W[50:150].round(decimals=2)
    cw = torch.rand(600, 32, generator=g) ** 4 * 100
    cb = fmt.default_codebook(k)
    assert torch.equal(gptq._block_scales(W, cb, search, None), fmt.block_scales(W, cb, search)[:, 0])
    want = torch.cat([fmt.block_scales(W[i:i + 1], cb, search, cw[i])[:, 0] for i in range(W.shape[0])])
    assert torch.equal(gptq._block_scales(W, cb, search, cw), want)


def _select(bits=3):
    settings = KbitSettings(bits=bits)
    return lambda name: (bits, settings.codebook(bits)) if ".layers." in name and not name.endswith(".gate") else None


def test_layer_by_layer_equals_the_whole_model_forward_on_a_dense_model(tmp_path):
    """Dense model: calibrating one decoder layer at a time feeds every linear layer the same inputs as the
    whole-model forward did (each layer's input computed with the rounded weights before it), so every
    packed weight is bit for bit the same."""
    from kbit_dev import tiny_models

    src = tiny_models.build("qwen3", str(tmp_path / "src"), hidden=128, layers=2)
    select = _select()
    want = _whole_model_gptq(*_load(src), select, _text(), n_tokens=2048, window=512)
    got = gptq.quantize_model(*_load(src), select, _text(), n_tokens=2048, window=512, asymmetric=0)
    assert len(want) == 14 and sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name][0], want[name][0]) and torch.equal(got[name][1], want[name][1]), name


def test_one_decoder_layer_on_the_device_at_a_time(tmp_path, monkeypatch):
    """Every GPTQ rounding (attention, every routed expert) happens while exactly one decoder layer, the one
    holding the weight, is on the compute device; calibrated layers are freed (meta) as the run goes."""
    from kbit_dev import tiny_models

    src = tiny_models.build("qwen3_moe", str(tmp_path / "src"), hidden=128, layers=3, experts=4, moe_intermediate=64)
    model, tokenizer = _load(src)
    layers = list(model.model.layers)
    live, most, rounded = [], [0], []

    def onload(layer, device):
        live.append(layer)
        most[0] = max(most[0], len(live))
        layer.to(device)

    def release(layer):
        live.remove(layer)
        layer.to("meta")

    def spy(W, H, *args, **kwargs):  # every rounding, dense (as B = 1) or routed experts, goes through here
        storages = [{p.untyped_storage().data_ptr() for p in layer.parameters()} for layer in live]
        rounded.append([W.untyped_storage().data_ptr() in s for s in storages])
        idx = layers.index(live[0]) if live else -1
        assert all(p.device.type == "meta" for layer in layers[:idx] for p in layer.parameters())
        assert all(p.device.type != "meta" for layer in layers[idx:] for p in layer.parameters())
        return real_experts(W, H, *args, **kwargs)

    monkeypatch.setattr(gptq, "_onload", onload)
    monkeypatch.setattr(gptq, "_release", release)
    real_experts = gptq.gptq_quantize_experts
    monkeypatch.setattr(gptq, "gptq_quantize_experts", spy)
    # asymmetric=0: the weight rounded is then the live layer's own tensor (its asymmetric target is a new one)
    got = gptq.quantize_model(model, tokenizer, _select(), _text(), n_tokens=1024, window=512, asymmetric=0)
    assert most[0] == 1 and not live
    assert len(rounded) == 3 * (4 + 2) and all(r == [True] for r in rounded)  # q, k, v, o; the experts' gate_up, down
    assert len(got) == 3 * (4 + 3 * 4)  # the experts' gate / up / down under their checkpoint names
    assert all(p.device.type == "meta" for layer in layers for p in layer.parameters())


def _moe_with_an_unused_expert(out_dir, experts=8, victim=4):
    """Tiny Qwen3-MoE whose router rows are v, -v, u, -u, 0 (the victim), ...: for any input one of v / -v
    and one of u / -u score above 0, so with top-2 the victim is never picked."""
    from safetensors.torch import load_file, save_file

    from kbit_dev import tiny_models

    src = tiny_models.build("qwen3_moe", out_dir, hidden=128, layers=1, experts=experts, top_k=2, moe_intermediate=64)
    path = f"{src}/model.safetensors"
    tensors = load_file(path)
    router = tensors["model.layers.0.mlp.gate.weight"]
    v, u = router[0].clone(), router[1].clone()
    router[0], router[1], router[2], router[3], router[victim] = v, -v, u, -u, 0
    save_file(tensors, path, metadata={"format": "pt"})
    return src, tensors


def test_routed_experts_are_rounded_on_their_own_tokens(tmp_path, monkeypatch, capsys):
    """convert --gptq on a Qwen3-MoE with an expert the router never picks: the routing the experts see is the
    router's on the MoE block's input; every expert's gate_up Hessian is X_e^T X_e of the tokens routed to it
    (the victim's, with none, that of all tokens, and its down projection's that of its activations on all
    tokens); one warning line names how many fell back; the checkpoint holds each expert's GPTQ result under
    its own gate / up / down names; and GPTQ's output error on each expert's tokens is below round-to-nearest's."""
    from safetensors.torch import load_file

    from vllm_kbit.convert import convert

    E, I, victim = 8, 64, 4
    src, original = _moe_with_an_unused_expert(str(tmp_path / "src"), E, victim)
    calls, seen = [], {}
    real_quantize, real_forward = gptq.gptq_quantize_experts, gptq._experts_forward

    def spy(W, H, *args, **kwargs):  # one call per group of experts: recorded per expert
        qweight, absmax = real_quantize(W, H, *args, **kwargs)
        calls.extend((W[i].clone(), H[i].clone(), (qweight[i], absmax[i])) for i in range(W.shape[0]))
        return qweight, absmax

    def forward_spy(*args, **kwargs):
        forward = real_forward(*args, **kwargs)

        def recorded(hidden_states, top_k_index, top_k_weights):
            seen.update(x=hidden_states.clone(), idx=top_k_index.clone())
            return forward(hidden_states, top_k_index, top_k_weights)
        return recorded

    monkeypatch.setattr(gptq, "gptq_quantize_experts", spy)
    monkeypatch.setattr(gptq, "_experts_forward", forward_spy)
    summary = convert(src, str(tmp_path / "out"), KbitSettings(bits=3), progress=False, gptq=True,
                      calibration_text=_text(8000), gptq_options={"asymmetric": 0})  # W rounded = the expert's own
    x, idx = seen["x"], seen["idx"]
    logits = torch.nn.functional.linear(x, original["model.layers.0.mlp.gate.weight"])  # as the router: in bf16
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    assert torch.equal(idx.sort(-1).values, probs.topk(2, -1).indices.sort(-1).values)

    counts = torch.bincount(idx.flatten(), minlength=E)
    threshold = gptq.expert_min_tokens(128)
    few = [e for e in range(E) if counts[e] < threshold]
    assert counts[victim] == 0 and victim in few and len(few) < E
    assert (summary.gptq.experts, summary.gptq.experts_fallback) == (E, len(few))
    warnings = [line for line in capsys.readouterr().err.splitlines() if "routed experts got fewer than" in line]
    assert len(warnings) == 1 and f"{len(few)} of {E} routed experts got fewer than {threshold} " in warnings[0]

    out = load_file(str(tmp_path / "out" / "model-00001-of-00001.safetensors"))
    cb = KbitSettings(bits=3).codebook(3)
    p = "model.layers.0.mlp.experts"
    gptq_err = rtn_err = 0.0
    for e in range(E):
        W = torch.cat([original[f"{p}.{e}.gate_proj.weight"], original[f"{p}.{e}.up_proj.weight"]])
        (_, H, (q, a)), = [c for c in calls if torch.equal(c[0], W)]
        xs = x if e in few else x[(idx == e).any(-1)]
        assert torch.allclose(H, gptq._linear_inputs_hessian(xs), rtol=1e-5, atol=1e-4), e
        # Routed experts' qweights are written 2-D, [N, K/32 * k] (docs/format.md).
        assert torch.equal(out[f"{p}.{e}.gate_proj.qweight"], q[:I].flatten(1))
        assert torch.equal(out[f"{p}.{e}.up_proj.absmax"], a[I:])
        (_, H_down, (q_down, _)), = [c for c in calls if torch.equal(c[0], original[f"{p}.{e}.down_proj.weight"])]
        assert torch.equal(out[f"{p}.{e}.down_proj.qweight"], q_down.flatten(1))
        gate, up = torch.nn.functional.linear(xs, fmt.dequantize(q, a, cb, x.dtype)).chunk(2, -1)
        act = torch.nn.functional.silu(gate) * up  # through its rounded gate_up (the victim: on every token)
        assert torch.allclose(H_down, gptq._linear_inputs_hessian(act), rtol=1e-5, atol=1e-4), e
        if e not in few:
            xf, Wf = xs.float(), W.float()
            gptq_err += (xf @ (fmt.dequantize(q, a, cb, torch.float32) - Wf).T).square().sum().item()
            rtn_err += (xf @ (fmt.dequantize(*fmt.quantize(W, cb, 3), cb, torch.float32) - Wf).T).square().sum().item()
    assert gptq_err < 0.9 * rtn_err


def test_expert_tensors_map_to_their_checkpoint_names():
    """transformers fuses Mixtral's per-expert w1 / w3 into gate_up_proj and renames block_sparse_moe to mlp;
    the reverted row numbers give each checkpoint tensor its rows."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    from kbit_dev import tiny_models

    config = MixtralConfig(**tiny_models._common(64, 1), intermediate_size=96, num_local_experts=3, num_experts_per_tok=2)
    model = AutoModelForCausalLM.from_config(config)
    p = "model.layers.0"
    pieces = gptq._checkpoint_pieces(model, {f"{p}.mlp.experts.gate_up_proj": (3, 192, 64),
                                             f"{p}.mlp.experts.down_proj": (3, 64, 96),
                                             f"{p}.self_attn.q_proj.weight": (256, 64)})
    gate_up = dict((n, rows.tolist()) for n, rows in pieces[f"{p}.mlp.experts.gate_up_proj"])
    assert gate_up == {f"{p}.block_sparse_moe.experts.{e}.{w}": list(range(192 * e + 96 * h, 192 * e + 96 * (h + 1)))
                       for e in range(3) for h, w in enumerate(("w1", "w3"))}
    down = dict((n, rows.tolist()) for n, rows in pieces[f"{p}.mlp.experts.down_proj"])
    assert down == {f"{p}.block_sparse_moe.experts.{e}.w2": list(range(64 * e, 64 * (e + 1))) for e in range(3)}
    assert [(n, rows.tolist()) for n, rows in pieces[f"{p}.self_attn.q_proj.weight"]] == [(f"{p}.self_attn.q_proj", list(range(256)))]


def test_a_model_without_decoder_layers_is_refused():
    class Flat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(32, 32)

    class Tok:
        def __call__(self, text, **kwargs):
            return type("T", (), {"input_ids": torch.zeros(1, 64, dtype=torch.long)})()

    with pytest.raises(ValueError, match=r"Flat has no decoder layer list \(model.layers\)"):
        gptq.quantize_model(Flat(), Tok(), lambda n: None, "x", n_tokens=64, window=32)


def test_cli_calibration_tokens_needs_gptq(tmp_path, capsys):
    from vllm_kbit import cli

    assert cli.main(["convert", str(tmp_path / "in"), str(tmp_path / "out"), "--calibration-tokens", "1024"]) == 2
    assert "--calibration-tokens needs --gptq" in capsys.readouterr().err


def _experts_forward_at_09e7264(mod, name, plan, packed, rounded, min_expert_tokens, report):
    """gptq._experts_forward as committed in 09e7264 (before the routed experts' memory was bounded), verbatim:
    the reference the restructured forward must reproduce bit for bit."""
    E, two_i, K = mod.gate_up_proj.shape
    names = (f"{name}.gate_up_proj", f"{name}.down_proj")
    threshold = gptq.expert_min_tokens(K) if min_expert_tokens is None else min_expert_tokens
    report.min_expert_tokens.append(threshold)
    for param_name, param in zip(names, (mod.gate_up_proj, mod.down_proj)):
        if param_name in plan:
            k = plan[param_name][0]
            N, KB = param.shape[1], param.shape[2] // fmt.BLOCK_SIZE
            packed[param_name] = (torch.empty(E, N, KB, k, dtype=torch.int32), torch.empty(E, N, KB, dtype=torch.uint8))

    def round_experts(param_name, param, group, Hs):
        experts = slice(group[0], group[-1] + 1)
        if param_name in plan:
            qweight, absmax, W_hat = rounded(param_name, param[experts].detach(), torch.stack(Hs))
            param[experts].copy_(W_hat)
            packed[param_name][0][experts], packed[param_name][1][experts] = qweight.cpu(), absmax.cpu()
        return param[experts]

    def forward(hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        H_all = None
        for e0 in range(0, E, gptq.EXPERT_GROUP):
            group = list(range(e0, min(e0 + gptq.EXPERT_GROUP, E)))
            routes = [torch.where(top_k_index == e) for e in group]
            few = [token_idx.numel() < threshold for token_idx, _ in routes]
            if any(few) and H_all is None:
                H_all = gptq._linear_inputs_hessian(hidden_states)
            xs = [hidden_states if f else hidden_states[token_idx] for f, (token_idx, _) in zip(few, routes)]
            report.experts += len(group)
            report.experts_fallback += sum(few)
            W_up = round_experts(names[0], mod.gate_up_proj, group,
                                 [H_all if f else gptq._linear_inputs_hessian(x) for f, x in zip(few, xs)])
            acts = []
            for i, x in enumerate(xs):
                gate, up = torch.nn.functional.linear(x, W_up[i]).chunk(2, dim=-1)
                acts.append(mod.act_fn(gate) * up)
            W_down = round_experts(names[1], mod.down_proj, group, [gptq._linear_inputs_hessian(a) for a in acts])
            for i, (f, (token_idx, pos)) in enumerate(zip(few, routes)):
                act = acts[i][token_idx] if f else acts[i]
                y = torch.nn.functional.linear(act, W_down[i]) * top_k_weights[token_idx, pos, None]
                out.index_add_(0, token_idx, y.to(out.dtype))
        return out

    return forward


@pytest.mark.parametrize("min_expert_tokens", [256, 10**9])
def test_bounded_memory_experts_equal_the_committed_calibration(tmp_path, monkeypatch, min_expert_tokens):
    """The routed experts' Hessians built one group at a time into one buffer, only the routed tokens'
    activations kept, packing and decoding a few rows at a time: every packed weight of a 2-layer random
    Qwen3-MoE with 16 experts (two groups; some or every expert falling back to all tokens) is bit
    for bit what the forward committed in 09e7264, packing and decoding in one call, gives."""
    from kbit_dev import tiny_models

    src = tiny_models.build("qwen3_moe", str(tmp_path / "src"), hidden=128, layers=2, experts=16, top_k=2,
                            moe_intermediate=64)
    select = _select(4)

    def calibrate():
        report = gptq.CalibrationReport()
        result = gptq.quantize_model(*_load(src), select, _text(), n_tokens=2048, window=512, asymmetric=0,
                                     min_expert_tokens=min_expert_tokens, report=report)
        return result, report

    with monkeypatch.context() as m:  # the committed code: one pack / decode per call
        m.setattr(gptq, "_experts_forward", _experts_forward_at_09e7264)
        m.setattr(gptq, "PACK_CHUNK_WEIGHTS", 1 << 40)
        want, want_report = calibrate()
    monkeypatch.setattr(gptq, "PACK_CHUNK_WEIGHTS", 1000)  # several chunks per weight, a short last one
    got, report = calibrate()
    assert report.experts == want_report.experts == 32
    assert report.experts_fallback == want_report.experts_fallback
    assert 0 < report.experts_fallback < 32 if min_expert_tokens == 256 else report.experts_fallback == 32
    assert sorted(got) == sorted(want) and sum(".experts." in n for n in want) == 2 * 16 * 3
    for name in want:
        assert torch.equal(got[name][0], want[name][0]) and torch.equal(got[name][1], want[name][1]), name


def test_asymmetric_target_is_the_least_squares_fit_of_the_full_precision_output():
    """asymmetric_target at a = 1 (no damping to speak of): for any Q, ||x_fp W^T - x Q^T||^2 - ||x (W' - Q)^T||^2 is
    one constant, so GPTQ on W' minimizes the error against the full-precision output; x_fp = x leaves W as it is;
    a = 0.5 moves W half the way."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(800, 48, generator=g, dtype=torch.float64).float()
    x_fp = x + 0.2 * torch.randn(800, 48, generator=g)
    W = torch.randn(24, 48, generator=g)
    H, dC = gptq._linear_inputs_hessian(x), gptq._input_shift(x_fp, x)
    Wt = gptq.asymmetric_target(W, H, dC, 1e-9, 1.0)
    gaps = []
    for _ in range(3):
        Q = W + 0.3 * torch.randn(24, 48, generator=g)
        full = (x_fp.double() @ W.double().T - x.double() @ Q.double().T).square().sum()
        gaps.append(full - (x.double() @ (Wt.double() - Q.double()).T).square().sum())
    assert max(gaps) - min(gaps) <= 1e-4 * gaps[0].abs() + 1e-3, gaps
    assert torch.equal(gptq.asymmetric_target(W, H, gptq._input_shift(x, x), gptq.DEFAULT_DAMP, 1.0), W)
    half = gptq.asymmetric_target(W, H, dC, 1e-9, 0.5)
    assert torch.allclose(half, (W + Wt) / 2, atol=1e-4)
    batched = gptq.asymmetric_target(torch.stack([W, 2 * W]), torch.stack([H, H]), torch.stack([dC, dC]), 1e-9, 1.0)
    assert torch.allclose(batched[1], 2 * Wt, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_asymmetric_calibration_leaves_the_first_inputs_and_moves_the_rest(tmp_path, arch):
    """Layer 0's q/k/v read the same input in the full-precision and the rounded model, so asymmetric calibration
    packs them as plain GPTQ does, bit for bit; weights after the first rounded ones (o, the MLP or routed experts,
    layer 1) see rounded inputs and move."""
    from kbit_dev import tiny_models

    src = tiny_models.build(arch, str(tmp_path / "src"), hidden=128, layers=2)
    select = _select()
    plain = gptq.quantize_model(*_load(src), select, _text(), n_tokens=2048, window=512, asymmetric=0.0)
    asym = gptq.quantize_model(*_load(src), select, _text(), n_tokens=2048, window=512, asymmetric=1.0)
    assert sorted(asym) == sorted(plain)
    first = [n for n in plain if ".layers.0.self_attn." in n and n.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj")]
    assert len(first) == 3
    for name in first:
        assert torch.equal(asym[name][0], plain[name][0]) and torch.equal(asym[name][1], plain[name][1]), name
    moved = [n for n in plain if n not in first and not torch.equal(asym[n][0], plain[n][0])]
    assert len(moved) >= len(plain) - len(first) - 2, (moved, sorted(plain))
    if arch == "qwen3_moe":
        assert any(".experts." in n for n in moved)


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), True, "1"])
def test_bad_asymmetric_is_refused_before_calibration(bad):
    with pytest.raises(ValueError, match="asymmetric=.* is not supported; it must be a number from 0 to 1") as e:
        gptq.quantize_model(None, None, lambda n: None, asymmetric=bad)
    assert "\n" not in str(e.value)
