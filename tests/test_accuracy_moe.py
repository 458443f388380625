"""The pure pieces of benchmarks/accuracy_moe.py: the one bits-per-weight rule every row of its table is counted by,
the NF4 reference it falls back to where bitsandbytes does not run, and which checkpoint tensors every method
quantizes (the MoE's router stays bf16) under which names."""

from __future__ import annotations

import os

import pytest
import torch

from kbit_dev import benchmarks


@pytest.fixture(scope="module")
def acc():
    return benchmarks.load("accuracy_moe")


SMOLLM2 = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # one layer


def test_bits_per_weight_counts_scales_and_zeros_per_group(acc):
    # kbit: an 8-bit E4M4 scale per 32 weights
    assert acc.bits_per_weight(SMOLLM2, 4, *acc.storage("kbit", 4)[:2]) == pytest.approx(4.25)
    assert acc.bits_per_weight(SMOLLM2, 3, *acc.storage("kbit-gptq", 3)[:2]) == pytest.approx(3.25)
    # int symmetric g64: a bf16 scale; asymmetric adds a k-bit packed zero point
    assert acc.bits_per_weight(SMOLLM2, 4, *acc.storage("llmc-gptq", 4)[:2]) == pytest.approx(4.25)
    assert acc.bits_per_weight(SMOLLM2, 3, *acc.storage("llmc-awq", 3)[:2]) == pytest.approx(3 + 19 / 64)
    # GPTQModel's GPTQ checkpoint: an fp16 scale and a k-bit packed zero point per 64, symmetric or not
    assert acc.bits_per_weight(SMOLLM2, 4, *acc.storage("gptqmodel-gptq", 4)[:2]) == pytest.approx(4 + 20 / 64)
    # HQQ: bf16 scale and bf16 zero per 64; NF4: fp32 absmax per 64
    assert acc.bits_per_weight(SMOLLM2, 3, *acc.storage("hqq", 3)[:2]) == pytest.approx(3.5)
    assert acc.bits_per_weight(SMOLLM2, 4, *acc.storage("nf4", 4)[:2]) == pytest.approx(4.5)


def test_a_short_last_group_still_carries_a_whole_scale(acc):
    # K = 576 in groups of 128: 4 full groups and one of 64 per row -> 5 scales per 576 weights
    assert acc.bits_per_weight([(10, 576)], 4, 128, 16) == pytest.approx(4 + 5 * 16 / 576)
    # weighted by size across tensors, not averaged per tensor
    mixed = acc.bits_per_weight([(1, 64), (1, 192)], 4, 128, 16)
    assert mixed == pytest.approx((256 * 4 + (1 + 2) * 16) / 256)


def _nf4_naive(W: torch.Tensor, code: torch.Tensor, blocksize: int) -> torch.Tensor:
    """Nearest level by distance, a tie to the lower level, block by block of the flattened tensor."""
    flat = W.reshape(-1).float()
    out = torch.empty_like(flat)
    for s in range(0, flat.numel(), blocksize):
        b = flat[s : s + blocksize]
        am = b.abs().max()
        x = torch.clamp(b * (1.0 / am.clamp(min=1e-38)), -1, 1)
        d = (x[:, None] - code[None, :]).abs()
        idx = torch.tensor([int(torch.nonzero(row == row.min())[0]) for row in d])
        out[s : s + blocksize] = code[idx] * am
    return out.view(W.shape).to(W.dtype)


def test_nf4_reference_is_nearest_level_per_block_of_the_flattened_tensor(acc):
    code = torch.tensor(acc.NF4_CODE)
    assert code.numel() == 16 and code[0] == -1 and code[-1] == 1 and code[7] == 0 and bool((code.diff() > 0).all())
    g = torch.Generator().manual_seed(0)
    # 3 x 80 = 240 weights: blocks of 64 cross row boundaries, and the last block has 48 weights
    W = (torch.randn(3, 80, generator=g) * 0.05).to(torch.bfloat16)
    W[1, 10] = 0.9  # one block's large weight sets its absmax; the others are unaffected
    got = acc.nf4_reference(W)
    assert got.dtype == W.dtype and got.shape == W.shape
    assert torch.equal(got, _nf4_naive(W, code, 64))
    # each block's largest |w| is kept exactly (level +-1 times its own absmax)
    flat, gflat = W.reshape(-1).float(), got.reshape(-1).float()
    for s in range(0, 240, 64):
        i = flat[s : s + 64].abs().argmax()
        assert gflat[s + i] == flat[s + i]


def test_nf4_reference_round_trips_its_levels_and_takes_the_lower_level_at_a_midpoint(acc):
    code = torch.tensor(acc.NF4_CODE)
    W = (code.repeat(4) * 0.5).view(1, 64)  # absmax 0.5, every level present
    assert torch.equal(acc.nf4_reference(W.float()), W.float())
    mid = float((code[8] + code[9]) / 2)
    W = torch.zeros(1, 64)
    W[0, 0], W[0, 1], W[0, 2] = 1.0, mid, mid + 1e-4
    got = acc.nf4_reference(W)
    assert got[0, 1] == code[8] and got[0, 2] == code[9]
    assert torch.equal(acc.nf4_reference(torch.zeros(2, 64)), torch.zeros(2, 64))  # an all-zero block stays zero


def test_every_method_quantizes_the_same_tensors_and_names_experts_alike(acc):
    keys = ["model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight",
            "model.layers.0.self_attn.q_proj.weight", "model.layers.0.block_sparse_moe.gate.weight",
            "model.layers.0.block_sparse_moe.experts.0.w1.weight", "model.layers.0.block_sparse_moe.experts.0.w2.weight",
            "model.layers.0.mlp.down_proj.weight", "lm_head.weight"]
    assert acc.quantized_tensor_names(keys) == sorted([
        "model.layers.0.self_attn.q_proj.weight", "model.layers.0.block_sparse_moe.experts.0.w1.weight",
        "model.layers.0.block_sparse_moe.experts.0.w2.weight", "model.layers.0.mlp.down_proj.weight"])
    # llm-compressor's linearized experts and transformers' names map to the checkpoint's
    assert acc.canonical_module("model.layers.3.mlp.experts.7.gate_proj") == "model.layers.3.block_sparse_moe.experts.7.w1"
    assert acc.canonical_module("model.layers.3.block_sparse_moe.experts.7.up_proj") == "model.layers.3.block_sparse_moe.experts.7.w3"
    assert acc.canonical_module("model.layers.3.mlp.experts.0.down_proj") == "model.layers.3.block_sparse_moe.experts.0.w2"
    assert acc.canonical_module("model.layers.3.mlp.down_proj") == "model.layers.3.mlp.down_proj"  # dense: unchanged


def test_block_diagonal_control_keeps_only_the_experts_blocks_of_the_down_projections_hessian(acc):
    """The dense model's control calibrates each down projection on the 8 diagonal blocks of its H (what each
    expert of the rewrite sees); inputs of any other width keep their whole H."""
    from vllm_kbit import gptq

    cut = acc.block_diagonal(gptq._linear_inputs_hessian, 48, 4)
    x = torch.randn(64, 48)
    H, full = cut(x), x.T @ x
    for i in range(4):
        for j in range(4):
            blk = (slice(12 * i, 12 * i + 12), slice(12 * j, 12 * j + 12))
            assert torch.equal(H[blk], full[blk] if i == j else torch.zeros(12, 12))
    y = torch.randn(64, 32)
    assert torch.equal(cut(y), y.T @ y)


def test_float32_copy_holds_the_same_values_in_float32(acc, tmp_path):
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    src.mkdir()
    state = {"a.weight": torch.randn(4, 32).bfloat16(), "ids": torch.arange(3)}
    save_file(state, str(src / "model.safetensors"))
    (src / "config.json").write_text('{"dtype": "bfloat16", "hidden_size": 32}')
    (src / "tokenizer.json").write_text("{}")
    out = acc.float32_copy(str(src), tmp_path / "out")
    copy = load_file(os.path.join(out, "model.safetensors"))
    assert copy["a.weight"].dtype == torch.float32 and torch.equal(copy["a.weight"], state["a.weight"].float())
    assert torch.equal(copy["ids"], state["ids"])
    assert '"float32"' in (tmp_path / "out" / "config.json").read_text()
    assert (tmp_path / "out" / "tokenizer.json").exists()


def test_humming_rtn_gives_the_larger_side_the_extra_code_at_a_bf16_scale(acc):
    # One group of 128 at k = 4: max 0.8 > |min| 0.5, so scale = -max(0.8 / 8, 0.5 / 7) = -0.1 and 0.8 takes code 0
    # (the extra negative code, -8 * -0.1), stored as bf16(0.1) = 0.10009765625.
    w = torch.zeros(1, 128)
    w[0, :4] = torch.tensor([0.8, -0.5, 0.1, 0.26])
    out = acc.humming_rtn(w.bfloat16(), 4)
    s = 0.10009765625
    assert out[0, 0].item() == pytest.approx(8 * s, abs=0)
    assert out[0, 1].item() == pytest.approx(-5 * s, abs=0)
    assert out[0, 2].item() == pytest.approx(1 * s, abs=0)  # round(0.1 / -0.1) = -1: value -1 * -s
    assert out[0, 3].item() == pytest.approx(3 * s, abs=0)  # 0.26 / 0.1 = 2.6 rounds to 3
    assert out[0, 4:].abs().max().item() == 0
    # Negative side larger: the scale stays positive and the minimum takes code 0 itself.
    assert acc.humming_rtn((-w).bfloat16(), 4)[0, 0].item() == pytest.approx(-8 * s, abs=0)


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_humming_rtn_has_at_most_2k_levels_per_group_and_pads_k_with_zeros(acc, k):
    torch.manual_seed(k)
    W = (torch.randn(64, 192) * 0.02).bfloat16()  # K = 192: one whole group and a half one
    out = acc.humming_rtn(W, k)
    assert out.shape == W.shape
    for g in (out[:, :128], out[:, 128:]):
        for row in g:
            assert row.unique().numel() <= 2 ** k
    # within half a step of every weight, plus the bf16 rounding of the scale times the largest code (no weight is
    # clamped: the step covers the larger side with 2^(k-1) codes and the other with 2^(k-1) - 1)
    g = W.float()[:, :128]
    big = torch.maximum(g.amax(-1), -g.amin(-1))
    small = torch.minimum(g.amax(-1), -g.amin(-1))
    step = torch.maximum(big / 2 ** (k - 1), small / (2 ** (k - 1) - 1)).unsqueeze(-1)
    assert ((out[:, :128] - g).abs() <= step * (0.5 + 2 ** (k - 1) * 2.0 ** -8)).all()
    # the half group is quantized as if zero-padded to 128 (as vLLM pads K)
    padded = torch.cat([W, torch.zeros(64, 64, dtype=W.dtype)], 1)
    assert torch.equal(acc.humming_rtn(padded, k)[:, :192], out)
    assert acc.bits_per_weight([(64, 256)], k, *acc.storage("humming", k)[:2]) == pytest.approx(k + 16 / 128)


GEMMA3_270M = [(1024, 640), (256, 640), (256, 640), (640, 1024), (2048, 640), (2048, 640), (640, 2048)]  # one layer


def test_llm_compressor_takes_its_presets_group_where_it_divides_every_input_size(acc):
    assert acc.llmc_group(GEMMA3_270M) == 128  # 640, 1024, 2048
    assert acc.llmc_group(SMOLLM2) == 64  # 576 and 1536 are not multiples of 128
    assert acc.llmc_group([(1536, 768), (8, 192)]) == 64  # one K that 128 does not divide is enough (the experts' 192)
    # the group sets llm-compressor's storage only; the bits rule is the same
    assert acc.storage("llmc-gptq", 4, 128)[:2] == (128, 16)
    assert acc.storage("llmc-awq", 3, 128)[:2] == (128, 19)
    assert acc.bits_per_weight(GEMMA3_270M, 4, *acc.storage("llmc-gptq", 4, 128)[:2]) == pytest.approx(4 + 16 / 128)
    assert acc.bits_per_weight(GEMMA3_270M, 3, *acc.storage("llmc-awq", 3, 128)[:2]) == pytest.approx(3 + 19 / 128)
    for family in ("kbit", "gptqmodel-gptq", "hqq", "nf4", "humming"):  # every other method keeps its own group
        assert acc.storage(family, 4, 128) == acc.storage(family, 4)


def test_method_rows_name_llm_compressors_group_and_drop_the_expert_controls_without_a_rewrite(acc):
    smol = acc.method_specs(2048)
    names = [s[0] for s in smol]
    assert "llm-compressor GPTQ W4A16 g64" in names and "llm-compressor AWQ W3A16 asym g64" in names
    assert acc.RTN_CONTROL.format(g="g64") == "llm-compressor RTN W4A16 g64 (control)"  # SmolLM2's names unchanged
    assert any(s[3] == "kbit-gptq-blockdiag" for s in smol)
    gemma = acc.method_specs(2048, 128, expert_controls=False)
    gnames = [s[0] for s in gemma]
    assert "llm-compressor GPTQ W4A16 g128" in gnames and "llm-compressor AWQ W3A16 asym g128" in gnames
    assert "llm-compressor RTN W4A16 g128 (control)" in gnames and not any("g64" in n and "llm-compressor" in n for n in gnames)
    assert not any(s[3] == "kbit-gptq-blockdiag" for s in gemma)
    # the same rows otherwise, in the same order
    assert [s[3] for s in gemma] == [s[3] for s in smol if s[3] != "kbit-gptq-blockdiag"]


def _rec(model, method, kind, k, ppl, control=False):
    return {"model": model, "method": method, "kind": kind, "k": k, "perplexity": ppl, "bits_per_weight": k + 0.25,
            "stored_bits_per_weight": k + 0.25, "top1_agreement": 1.0, "calibrated": "gptq" in kind, "control": control}


def test_goal_pairs_find_rows_by_kind_whatever_their_group(acc):
    recs = [_rec("dense", "kbit-4", "kbit", 4, 30.0), _rec("dense", "kbit-4 --gptq", "kbit-gptq", 4, 28.0),
            _rec("dense", "HQQ 4-bit g64", "hqq-4", 4, 31.0),
            _rec("dense", "llm-compressor GPTQ W4A16 g128", "llmc-gptq-w4", 4, 29.0),
            _rec("dense", "kbit-4 --gptq, calibrated in float32 (control)", "kbit-gptq-fp32", 4, 1.0, control=True),
            _rec("dense", "llm-compressor RTN W4A16 g128 (control)", "llmc-rtn-w4", 4, 1.0, control=True)]
    pairs = [(m, a["method"], b["method"]) for m, a, b in acc.goal_pairs(recs)]
    assert pairs == [("dense", "kbit-4", "HQQ 4-bit g64"), ("dense", "kbit-4 --gptq", "llm-compressor GPTQ W4A16 g128")]
    lines = acc.goals(recs, [])
    assert lines[-1].endswith("| 29.000 | yes |") and lines[-2].endswith("| 31.000 | yes |")


def test_a_second_models_run_merges_under_its_key_and_gets_its_own_panel(acc, tmp_path):
    import json

    main = {"date": "d", "records": [_rec("dense", "bf16", "bf16", 16, 12.0), _rec("moe", "bf16", "bf16", 16, 12.0)],
            "vllm": [], "failures": []}
    run = {"key": "gemma3_270m", "model": "Gemma 3 270M (GGUF Q4_K_M, dequantized to bf16)",
           "records": [_rec("dense", "bf16", "bf16", 16, 25.0)], "vllm": [], "failures": []}
    (tmp_path / "main.json").write_text(json.dumps(main))
    (tmp_path / "run.json").write_text(json.dumps(run))
    acc.merge(tmp_path / "main.json", tmp_path / "run.json")
    merged = json.loads((tmp_path / "main.json").read_text())
    assert {k: merged[k] for k in main} == main  # the first model's content as it was
    assert merged["gemma3_270m"] == run and list(acc.extra_models(merged)) == ["gemma3_270m"]
    titles = [t for t, _ in acc.plot_panels(merged)]
    assert titles == ["SmolLM2-135M (dense)", f"its Mixtral rewrite ({acc.EXPERTS} experts)", "Gemma 3 270M (dense)"]
    assert [t for t, _ in acc.plot_panels(run)] == ["Gemma 3 270M (dense)"]
    # the dense-only table has no MoE columns
    table = acc.results_table(run["records"], ("dense",))
    assert table[0] == "| method | calibrated | bits/weight | stored | dense ppl | dense vs bf16 | dense top-1 |"
    assert table[2] == "| bf16 |  | 16.250 | 16.250 | 25.000 | +0.0% | 100.0% |"


def test_rope_parameters_per_layer_type_lose_the_keys_gptqmodel_adds_beside_them(acc):
    import types

    per_type = {"full_attention": {"rope_theta": 1e6, "rope_type": "default"},
                "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}}
    cfg = types.SimpleNamespace(layer_types=["sliding_attention", "full_attention"],
                                rope_parameters={**per_type, "rope_type": "default", "rope_theta": {"global": 1e6, "local": 1e4}})
    assert acc._fix_rope_parameters(cfg) and cfg.rope_parameters == per_type
    assert acc._fix_rope_parameters(cfg) == [] and cfg.rope_parameters == per_type  # already clean: untouched
    flat = types.SimpleNamespace(layer_types=["full_attention"], rope_parameters={"rope_theta": 1e4, "rope_type": "default"})
    assert acc._fix_rope_parameters(flat) == [] and flat.rope_parameters == {"rope_theta": 1e4, "rope_type": "default"}
    assert acc._fix_rope_parameters(types.SimpleNamespace()) == []


def test_rotation_rows_average_over_seeds_and_issue_61_goals_compare_gaps(acc):
    recs = [_rec("dense", "bf16", "bf16", 16, 10.0), _rec("dense", "kbit-4", "kbit", 4, 14.0),
            _rec("dense", "kbit-3 --gptq", "kbit-gptq", 3, 20.0),
            *(_rec("dense", f"kbit-3 --gptq + rotation (seed {s})", f"kbit-gptq-rot-s{s}", 3, p) for s, p in ((0, 15.0), (1, 16.0), (2, 17.0))),
            _rec("dense", "kbit-2 --gptq", "kbit-gptq", 2, 110.0),
            _rec("dense", "kbit-2 --gptq + rotation (seed 0)", "kbit-gptq-rot-s0", 2, 70.0),
            _rec("dense", "llm-compressor QuIP + GPTQ W3A16 g64", "llmc-quip-gptq-w3", 3, 17.5)]
    groups = acc.seed_groups(recs, "dense")
    assert sorted(groups) == ["kbit-2 --gptq + rotation", "kbit-3 --gptq + rotation"] and len(groups["kbit-3 --gptq + rotation"]) == 3
    goals = acc.rotation_goals(recs, ("dense",))
    # k = 3: mean 16 -> gap 6 against 10: 0.60x, met; k = 2: gap 60 against 100: 0.60x > 0.5, missed
    assert "| 0.60x | yes |" in goals[0] and "kbit-3 --gptq + rotation (3 seeds)" in goals[0]
    assert "| 0.60x | **no** |" in goals[1]
    assert "below online kbit-4" in goals[2] and goals[2].endswith("| **no** |")  # 16 > 14
    assert "QuIP + GPTQ W3" in goals[3] and goals[3].endswith("| yes |")  # 16 <= 17.5
    text = "\n".join(acc.rotation_section(recs, ("dense",)))
    assert "| dense | kbit-3 --gptq + rotation | 3 | 16.000 | 15.000 | 17.000 | 6.000 |" in text


def test_kbit_kinds_spell_their_options(acc):
    assert acc.kbit_variant("kbit") == {"gptq": False, "rotate": False, "seed": 0, "max_block": None, "codebook": None,
                                        "damp": None, "act_order": None, "refine_passes": None, "asymmetric": None,
                                        "calib_tokens": None}
    v = acc.kbit_variant("kbit-gptq-rot-nf-damp0.1-noact-ref4-asym0.25-c8192-s2")
    assert v == {"gptq": True, "rotate": True, "seed": 2, "max_block": None, "codebook": "normal_float", "damp": 0.1,
                 "act_order": False, "refine_passes": 4, "asymmetric": 0.25, "calib_tokens": 8192}
    v = acc.kbit_variant("kbit-gptq-rot-b128-s1")
    assert (v["rotate"], v["max_block"], v["seed"]) == (True, 128, 1)
    assert acc.kbit_variant("kbit-gptq-b128") is None  # a block without rotation means nothing
    assert acc.kbit_variant("kbit-gptq-fp32") is None  # the controls go their own way
    kinds = [s[3] for s in acc.method_specs(2048)]
    assert all(acc.kbit_variant(k) is not None for k in kinds if k.startswith("kbit") and k not in acc.GPTQ_CONTROLS)


def test_combine_adds_runs_to_a_combined_json_and_keeps_its_commands(acc, tmp_path):
    import json

    def rec(model, method, ppl):
        return {"model": model, "method": method, "perplexity": ppl}

    done = {"command": "run A", "commands": ["run A", "run B"], "elapsed_s": 10, "records": [rec("dense", "bf16", 13.0)],
            "failures": [], "gemma": {"key": "gemma", "command": "run G", "commands": ["run G"], "elapsed_s": 5,
                                      "records": [rec("dense", "bf16", 26.0)], "failures": []}}
    new = {"command": "run C", "elapsed_s": 3, "records": [rec("dense", "bf16", 99.0), rec("dense", "kbit-3", 17.0)],
           "failures": []}
    new_g = {"key": "gemma", "command": "run H", "elapsed_s": 4, "records": [rec("dense", "kbit-3", 33.0)], "failures": []}
    paths = []
    for i, d in enumerate((done, new, new_g)):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(d))
    acc.combine(tmp_path / "out.json", paths)
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["commands"] == ["run A", "run B", "run C"] and out["elapsed_s"] == 13
    assert [(r["method"], r["perplexity"]) for r in out["records"]] == [("bf16", 13.0), ("kbit-3", 17.0)]  # first kept
    assert out["gemma"]["commands"] == ["run G", "run H"] and len(out["gemma"]["records"]) == 2
