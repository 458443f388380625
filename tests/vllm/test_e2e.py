"""End to end on vLLM's CPU backend: online kbit, converted checkpoints, mixed bits, tensor and expert parallel.

Each engine configuration starts once per session (see conftest.engine).
"""

from __future__ import annotations

import pytest

from kbit_e2e import (
    ONLINE, TEXT_PROMPTS, assert_agree, assert_every_layer_accounted_for, dequantized_checkpoint, load_summaries,
    online_kwargs, report_agreement, settings_of,
)


def _online(engine, tiny, kind: str, k: int, config: dict | None = None, **extra):
    config = ONLINE[k] if config is None else config
    return engine(f"{kind}-online{k}", tiny[kind], online_kwargs(config), text_prompts=TEXT_PROMPTS, **extra)


_DEQUANTIZED_DIRS: dict[tuple[str, int], str] = {}


def _dequantized(engine, tiny, tmp_path_factory, kind: str, k: int, llm_kwargs: dict | None = None,
                 env: dict | None = None, key_suffix: str = ""):
    """The bf16 model whose weights are kbit-k's dequantized values (written once per kind and k)."""
    if (kind, k) not in _DEQUANTIZED_DIRS:
        _DEQUANTIZED_DIRS[(kind, k)] = dequantized_checkpoint(
            tiny[kind], str(tmp_path_factory.mktemp(f"{kind}-deq{k}")), settings_of(ONLINE[k]))
    return engine(f"{kind}-deq{k}{key_suffix}", _DEQUANTIZED_DIRS[(kind, k)], llm_kwargs, env=env,
                  text_prompts=TEXT_PROMPTS)


def _kbit_layers(result: dict) -> dict:
    return {name: info for name, info in result["layers"].items() if "bits" in info}


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_online_matches_dequantized_model(engine, tiny, tmp_path_factory, k):
    got = _online(engine, tiny, "qwen3_moe", k)
    ref = _dequantized(engine, tiny, tmp_path_factory, "qwen3_moe", k)
    layers = _kbit_layers(got)
    assert any(i["method"] == "KbitOnlineMoEMethod" for i in layers.values()), layers
    assert any(i["method"] == "KbitOnlineLinearMethod" for i in layers.values()), layers
    assert_agree(f"qwen3_moe k={k}", got, ref)


def test_mixed_bits_and_modules_to_not_convert_take_effect(engine, tiny):
    layers = _online(engine, tiny, "qwen3_moe", 3)["layers"]
    for i in range(2):
        for proj in ("qkv_proj", "o_proj"):
            info = layers[f"model.layers.{i}.self_attn.{proj}"]
            assert (info["method"], info["bits"]) == ("KbitOnlineLinearMethod", 5), info
            assert info["params"]["qweight"][0] == "torch.int32" and info["params"]["qweight"][1][2] == 5
        assert layers[f"model.layers.{i}.mlp.gate"]["method"] == "UnquantizedLinearMethod"
    moe0 = layers["model.layers.0.mlp.experts"]
    assert (moe0["method"], moe0["bits"]) == ("KbitOnlineMoEMethod", 3), moe0
    assert layers["model.layers.1.mlp.experts"]["method"] == "UnquantizedFusedMoEMethod"
    assert "w13_weight" in layers["model.layers.1.mlp.experts"]["params"]


def test_load_summary_counts_mixed_bits_and_layers_left_unquantized(engine, tiny):
    """The k=3 engine: attention at 5 bits, routed experts at 3, the router gates and layer 1's experts in
    modules_to_not_convert."""
    got = _online(engine, tiny, "qwen3_moe", 3)
    groups = assert_every_layer_accounted_for("qwen3_moe k=3", got)
    assert sorted(groups["left"]) == [
        "model.layers.0.mlp.gate", "model.layers.1.mlp.experts", "model.layers.1.mlp.gate"], groups
    line = load_summaries(got)[0][0]
    assert "quantized 4 linear layers and 1 routed-expert block to bits 3 (1 layer), 5 (4 layers)" in line, line
    assert "left unquantized: 2 linear layers and 1 routed-expert block (modules_to_not_convert: 3)" in line, line


def test_converted_checkpoint_is_detected_and_identical_to_online(engine, tiny, converted_offline):
    online = _online(engine, tiny, "qwen3_moe", 4)
    conv = converted_offline  # served with no quantization flag
    on_layers, conv_layers = _kbit_layers(online), _kbit_layers(conv)
    assert set(on_layers) == set(conv_layers) and on_layers
    for name, info in conv_layers.items():
        assert info["method"] in ("KbitLinearMethod", "KbitMoEMethod"), (name, info)
        assert info["hash"] == on_layers[name]["hash"], f"packed weights of {name} differ"
    assert conv["tokens"] == online["tokens"]
    assert conv["texts"] == online["texts"]
    assert assert_every_layer_accounted_for("qwen3_moe converted", conv)["kbit"] == list(conv_layers)


def test_tensor_parallel_2_matches_dequantized_tp2(engine, tiny, tmp_path_factory):
    tp1 = _online(engine, tiny, "qwen3_moe", 4)
    tp2 = engine(
        "qwen3_moe-online4-tp2",
        tiny["qwen3_moe"],
        {**online_kwargs(ONLINE[4]), "tensor_parallel_size": 2},
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
        text_prompts=TEXT_PROMPTS,  # the same prompt list as tp1
    )
    # Each rank holds half of every sharded layer (runtime tiles of 64 rows along N, of 4 blocks along K).
    ranks = tp2["layers_per_rank"]
    assert len(ranks) == 2
    qkv1 = tp1["layers"]["model.layers.0.self_attn.qkv_proj"]["params"]["qweight"][1]
    o1 = tp1["layers"]["model.layers.0.self_attn.o_proj"]["params"]["qweight"][1]
    for r in ranks:
        assert r["model.layers.0.self_attn.qkv_proj"]["params"]["qweight"][1][0] * 2 == qkv1[0]
        assert r["model.layers.0.self_attn.o_proj"]["params"]["qweight"][1][1] * 2 == o1[1]
    assert ranks[0]["model.layers.0.mlp.experts"]["hash"] != ranks[1]["model.layers.0.mlp.experts"]["hash"]
    # The reference is the dequantized model at the same TP=2: it shards and all-reduces exactly as kbit
    # does, so a sharding bug (a scale row split from its weight row) shows while reduction order does not.
    # Against TP1 even the bf16 dequantized model moves: reported, not asserted (docs/decisions.md).
    ref = _dequantized(engine, tiny, tmp_path_factory, "qwen3_moe", 4, llm_kwargs={"tensor_parallel_size": 2},
                       env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, key_suffix="-tp2")
    assert_agree("TP2 vs dequantized TP2", tp2, ref)
    report_agreement("TP2 vs TP1", tp2, tp1)


def test_expert_parallel_2_matches_dequantized_tp2(engine, tiny, tmp_path_factory):
    """TP=2 with expert parallel: attention sharded as in TP=2, the routed experts split whole between the
    ranks (4 of 8 each, at full intermediate size) through vLLM's expert_map."""
    tp1 = _online(engine, tiny, "qwen3_moe", 4)
    ep2 = engine(
        "qwen3_moe-online4-tp2-ep",
        tiny["qwen3_moe"],
        {**online_kwargs(ONLINE[4]), "tensor_parallel_size": 2, "enable_expert_parallel": True},
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
        text_prompts=TEXT_PROMPTS,
    )
    ranks = ep2["layers_per_rank"]
    assert len(ranks) == 2
    qkv1 = tp1["layers"]["model.layers.0.self_attn.qkv_proj"]["params"]["qweight"][1]
    for r in ranks:
        assert r["model.layers.0.self_attn.qkv_proj"]["params"]["qweight"][1][0] * 2 == qkv1[0]
    for layer in ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts"):
        full = tp1["layers"][layer]["params"]
        for r in ranks:
            assert r[layer]["method"] == "KbitOnlineMoEMethod"
            for name in ("w13_qweight", "w2_qweight"):
                shape = r[layer]["params"][name][1]
                assert shape[0] * 2 == full[name][1][0] and shape[1:] == full[name][1][1:], (layer, name, shape, full[name])
        assert ranks[0][layer]["hash"] != ranks[1][layer]["hash"]
    # Reference: the dequantized model at TP=2 without expert parallel (attention sharded the same way);
    # vLLM 0.26's own CPU MoE kernel crashes given an expert_map, so a bf16 TP2+EP engine cannot run here.
    ref = _dequantized(engine, tiny, tmp_path_factory, "qwen3_moe", 4, llm_kwargs={"tensor_parallel_size": 2},
                       env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, key_suffix="-tp2")
    assert_agree("TP2+EP vs dequantized TP2", ep2, ref)
    report_agreement("TP2+EP vs TP1", ep2, tp1)


@pytest.mark.parametrize("kind", ["glm4_moe", "qwen3"])
def test_other_families_match_dequantized_model(engine, tiny, tmp_path_factory, kind):
    got = _online(engine, tiny, kind, 4)
    ref = _dequantized(engine, tiny, tmp_path_factory, kind, 4)
    layers = _kbit_layers(got)
    if kind == "glm4_moe":
        assert layers["model.layers.1.mlp.experts"]["method"] == "KbitOnlineMoEMethod"
        assert layers["model.layers.1.mlp.shared_experts.gate_up_proj"]["method"] == "KbitOnlineLinearMethod"
        assert layers["model.layers.0.mlp.gate_up_proj"]["method"] == "KbitOnlineLinearMethod"  # dense first layer
    else:
        assert layers["model.layers.0.mlp.down_proj"]["bits"] == 4
    assert_agree(f"{kind} k=4", got, ref)


# Projections vLLM builds without a quantization config, so no quantization method is asked about them:
# router gates (GateLinear), Qwen3-Next's shared-expert gate (one output) and its gated delta-net's conv1d
# (a depthwise convolution held as a [channels, kernel 4] linear weight).
NOT_OFFERED = ("gate", "shared_expert_gate", "conv1d")


@pytest.mark.parametrize("kind", ["glm4_moe_lite", "qwen3_next"])
def test_mla_and_gated_delta_net_families_match_dequantized_model(engine, tiny, tmp_path_factory, kind):
    """GLM-4.7-Flash's architecture (multi-head latent attention, dense first layer, shared + routed experts) and
    Qwen3-Next's (gated delta-net linear attention beside gated full attention, shared + routed experts), both on
    vLLM's CPU build: every projection kbit, the load summary counting them, agreement with the dequantized model."""
    got = _online(engine, tiny, kind, 4)
    groups = assert_every_layer_accounted_for(f"{kind} k=4", got)
    assert groups["left"] == [], groups
    assert {name.rpartition(".")[2] for name in groups["not_offered"]} <= set(NOT_OFFERED), groups
    layers = _kbit_layers(got)
    if kind == "glm4_moe_lite":
        for proj in ("fused_qkv_a_proj", "q_b_proj", "kv_b_proj", "o_proj"):  # MLA: q_a + kv_a fused, then q_b, kv_b
            for i in range(2):
                assert layers[f"model.layers.{i}.self_attn.{proj}"]["bits"] == 4
        assert layers["model.layers.0.mlp.gate_up_proj"]["method"] == "KbitOnlineLinearMethod"  # dense first layer
        assert layers["model.layers.1.mlp.shared_experts.down_proj"]["method"] == "KbitOnlineLinearMethod"
        assert layers["model.layers.1.mlp.experts"]["method"] == "KbitOnlineMoEMethod"
    else:
        for proj in ("in_proj_qkvz", "in_proj_ba", "out_proj"):  # layer 0: gated delta-net
            assert layers[f"model.layers.0.linear_attn.{proj}"]["bits"] == 4
        assert layers["model.layers.1.self_attn.qkv_proj"]["bits"] == 4  # layer 1: full attention
        for i in range(2):
            assert layers[f"model.layers.{i}.mlp.shared_expert.gate_up_proj"]["method"] == "KbitOnlineLinearMethod"
            assert layers[f"model.layers.{i}.mlp.experts"]["method"] == "KbitOnlineMoEMethod"
    ref = _dequantized(engine, tiny, tmp_path_factory, kind, 4)
    assert_agree(f"{kind} k=4", got, ref)


@pytest.mark.parametrize("kind", ["glm4_moe_lite", "qwen3_next"])
def test_mla_and_gated_delta_net_converted_checkpoints_identical_to_online(engine, tiny, converted4, kind):
    """`vllm-kbit convert --bits 4` of GLM-4.7-Flash's and Qwen3-Next's architectures, served with no quantization
    flag: every layer the online engine quantizes is a kbit layer of the converted model with the same packed
    weights (MLA's fused q_a / kv_a, the gated delta-net's fused projections, the routed and shared experts), and
    the outputs are the online engine's."""
    online = _online(engine, tiny, kind, 4)
    conv = engine(f"{kind}-converted4", converted4(kind), text_prompts=TEXT_PROMPTS)
    on_layers, conv_layers = _kbit_layers(online), _kbit_layers(conv)
    assert set(on_layers) == set(conv_layers) and on_layers, set(on_layers) ^ set(conv_layers)
    for name, info in conv_layers.items():
        assert info["method"] in ("KbitLinearMethod", "KbitMoEMethod"), (name, info)
        assert info["hash"] == on_layers[name]["hash"], f"packed weights of {name} differ"
    assert_every_layer_accounted_for(f"{kind} converted", conv)
    assert conv["tokens"] == online["tokens"]


def _beyond_e4m4_range(src: str, dst: str) -> str:
    """A copy of the qwen3_moe checkpoint with weights the E4M4 block scale cannot hold at scale 1: one element
    of 100 in a dense layer and in a routed expert, and a dense layer of weights ~1e-6."""
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in sorted(os.listdir(dst)):
        if f.endswith(".safetensors"):
            tensors = load_file(os.path.join(dst, f))
            for key in ("model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.experts.3.down_proj.weight"):
                tensors[key] = tensors[key].clone()
                tensors[key].view(-1)[5] = 100.0
            key = "model.layers.1.self_attn.o_proj.weight"
            tensors[key] = (tensors[key].float() * 2e-5).to(tensors[key].dtype)
            save_file(tensors, os.path.join(dst, f), metadata={"format": "pt"})
    return dst


def test_weights_beyond_the_e4m4_range_quantize_online_and_match_dequantized(engine, tiny, tmp_path_factory):
    """|w| = 100 in a dense layer and in one routed expert, and a dense layer of ~1e-6: each layer is quantized
    with a range scale (reference.range_scale; one per MoE layer), named in the load summary, and the model
    matches the bf16 model of the dequantized weights (which decode to the same values)."""
    src = _beyond_e4m4_range(tiny["qwen3_moe"], str(tmp_path_factory.mktemp("range") / "m"))
    got = engine("qwen3_moe-range-online4", src, online_kwargs(ONLINE[4]), text_prompts=TEXT_PROMPTS)
    ref = engine("qwen3_moe-range-deq4", dequantized_checkpoint(src, str(tmp_path_factory.mktemp("range-deq")),
                                                               settings_of(ONLINE[4])), text_prompts=TEXT_PROMPTS)
    layers = got["layers"]
    for name in ("model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"):
        assert layers[name]["method"] == "KbitOnlineLinearMethod", layers[name]
    assert layers["model.layers.0.mlp.experts"]["method"] == "KbitOnlineMoEMethod"
    assert_every_layer_accounted_for("qwen3_moe beyond E4M4 k=4", got)
    line = load_summaries(got)[0].string
    assert "not representable" not in line and "range-scaled (max |w| outside [2^-4, 31]): 3 (" in line, line
    for name in ("model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj", "model.layers.0.mlp.experts"):
        assert name in line, line
    assert_agree("qwen3_moe beyond E4M4 k=4 vs dequantized", got, ref)
