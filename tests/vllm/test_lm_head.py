"""``quantize_lm_head``: the output head through the kbit linear method, online and converted (vLLM CPU engines),
its default (off: vLLM's bf16 head) and tied heads (left bf16).

The head is put at 2 bits (``bits_overrides``) while the body is at 4, so that what the head does shows in
the logits: the run must agree with the plain model whose weights, head included, are the dequantized kbit
values, and must differ from the same body with a bf16 head.
"""

from __future__ import annotations

import json
import os

import pytest
from kbit_e2e import (
    MAX_LOGPROB_GAP,
    ONLINE,
    TEXT_PROMPTS,
    agreement,
    assert_agree,
    assert_every_layer_accounted_for,
    dequantized_checkpoint,
    online_kwargs,
    settings_of,
)

from vllm_kbit.convert import convert, quantization_decision, tied_word_embeddings
from vllm_kbit.settings import KbitSettings

HEAD = {"bits": 4, "quantize_lm_head": True, "bits_overrides": {"lm_head": 2}}


def _online(engine, tiny, key: str, config: dict, model: str | None = None) -> dict:
    return engine(key, model or tiny["qwen3_moe"], online_kwargs(config), text_prompts=TEXT_PROMPTS)


@pytest.fixture(scope="session")
def converted_head(tiny, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("converted") / "qwen3_moe-kbit4-head2")
    summary = convert(tiny["qwen3_moe"], out, settings_of(HEAD), progress=False)
    assert not summary.tied_lm_head
    return out


# ----------------------------------------------------------------------------- settings and convert (no engine)


def test_settings_default_off_and_round_trip():
    assert KbitSettings().quantize_lm_head is False
    assert KbitSettings().is_skipped("lm_head")
    s = settings_of(HEAD)
    assert s.quantize_lm_head and not s.is_skipped("lm_head") and s.bits_for("lm_head") == 2
    again = KbitSettings.from_dict(s.to_dict())
    assert again.quantize_lm_head and again.modules_to_not_convert == s.modules_to_not_convert
    assert "quantize_lm_head" not in KbitSettings().to_dict()  # recipes without the option are unchanged


@pytest.mark.parametrize(
    "config, match",
    [
        ({"quantize_lm_head": True, "modules_to_not_convert": ["lm_head", "gate"]}, "lists lm_head; remove one"),
        ({"quantize_lm_head": "yes"}, "quantize_lm_head must be true or false"),
    ],
)
def test_settings_refuse_contradictions(config, match):
    with pytest.raises(ValueError, match=match):
        settings_of(config)


def test_convert_decision_for_the_head():
    shape, on, off = (384, 256), settings_of(HEAD), settings_of(ONLINE[4])
    import torch

    assert quantization_decision("lm_head.weight", shape, torch.bfloat16, off) is None
    assert quantization_decision("lm_head.weight", shape, torch.bfloat16, on) == 2
    assert quantization_decision("lm_head.weight", shape, torch.bfloat16, on, tied_lm_head=True) is None
    assert quantization_decision("model.embed_tokens.weight", shape, torch.bfloat16, on) is None
    assert quantization_decision("lm_head.weight", (384, 250), torch.bfloat16, on) == -1  # K % 32: stays bf16
    assert tied_word_embeddings({"tie_word_embeddings": True})
    assert not tied_word_embeddings({"text_config": {"tie_word_embeddings": False}, "tie_word_embeddings": True})
    assert not tied_word_embeddings({"model_type": "qwen3_moe"})  # the transformers class default


def test_converted_checkpoint_holds_a_kbit_head_and_its_recipe(converted_head):
    from safetensors import safe_open

    with open(os.path.join(converted_head, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert qc["quantize_lm_head"] is True and qc["bits_overrides"]["lm_head"] == 2 and "lm_head" not in qc["modules_to_not_convert"]
    with open(os.path.join(converted_head, "model.safetensors.index.json")) as f:
        names = json.load(f)["weight_map"]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    with safe_open(os.path.join(converted_head, names["lm_head.qweight"]), "pt") as f:
        assert list(f.get_tensor("lm_head.qweight").shape) == [384, 256 // 32, 2]


def test_cli_flag(tiny, tmp_path, capsys):
    from vllm_kbit.cli import main

    out = str(tmp_path / "cli")
    assert main(["convert", tiny["qwen3_moe"], out, "--quantize-lm-head", "--bits-overrides", "lm_head=5", "--quiet"]) == 0
    with open(os.path.join(out, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert qc["quantize_lm_head"] is True and qc["bits_overrides"] == {"lm_head": 5}


# ----------------------------------------------------------------------------- vLLM engines


def test_default_leaves_lm_head_bf16(engine, tiny):
    layers = _online(engine, tiny, "qwen3_moe-online4", ONLINE[4])["layers"]
    head = layers["lm_head"]
    assert head["method"] == "UnquantizedEmbeddingMethod" and "bits" not in head, head
    assert head["params"]["weight"][0] == "torch.bfloat16", head


def test_online_kbit_head_matches_dequantized_model(engine, tiny, tmp_path_factory):
    got = _online(engine, tiny, "qwen3_moe-online4-head2", HEAD)
    head = got["layers"]["lm_head"]
    assert (head["method"], head["bits"]) == ("KbitOnlineLinearMethod", 2), head
    assert head["params"]["qweight"][0] == "torch.int32" and "weight" not in head["params"], head
    assert got["layers"]["model.embed_tokens"]["method"] == "UnquantizedEmbeddingMethod"  # the lookup stays bf16
    assert "lm_head" in assert_every_layer_accounted_for("qwen3_moe lm_head k=2", got)["kbit"]  # counted as a linear
    ref_dir = dequantized_checkpoint(tiny["qwen3_moe"], str(tmp_path_factory.mktemp("qwen3_moe-deq4-head2")), settings_of(HEAD))
    ref = engine("qwen3_moe-deq4-head2", ref_dir, text_prompts=TEXT_PROMPTS)
    assert_agree("qwen3_moe k=4, lm_head k=2", got, ref)
    # The 2-bit head moves the logits well beyond the agreement tolerance of the same body with a bf16 head.
    bf16_head = _online(engine, tiny, "qwen3_moe-online4", ONLINE[4])
    _, _, worst = agreement(got, bf16_head)
    assert worst > 3 * MAX_LOGPROB_GAP, f"a 2-bit head changed no logprob by more than {worst:.4f}"


def test_converted_kbit_head_identical_to_online(engine, tiny, converted_head):
    online = _online(engine, tiny, "qwen3_moe-online4-head2", HEAD)
    conv = engine("qwen3_moe-converted4-head2", converted_head, text_prompts=TEXT_PROMPTS)  # no flag
    head = conv["layers"]["lm_head"]
    assert (head["method"], head["bits"]) == ("KbitLinearMethod", 2), head
    assert "lm_head" in assert_every_layer_accounted_for("qwen3_moe lm_head k=2 converted", conv)["kbit"]
    assert head["hash"] == online["layers"]["lm_head"]["hash"]
    assert conv["tokens"] == online["tokens"] and conv["texts"] == online["texts"]


def test_tied_head_stays_bf16(engine, tiny, tmp_path_factory):
    """A checkpoint whose config ties lm_head to the embedding (no lm_head tensor): the head stays vLLM's."""
    from safetensors.torch import load_file, save_file

    src, dst = tiny["qwen3_moe"], str(tmp_path_factory.mktemp("qwen3_moe-tied"))
    for name in os.listdir(src):
        if name.endswith(".safetensors"):
            tensors = {k: v for k, v in load_file(os.path.join(src, name)).items() if k != "lm_head.weight"}
            save_file(tensors, os.path.join(dst, name), metadata={"format": "pt"})
        elif name == "config.json":
            with open(os.path.join(src, name)) as f:
                config = {**json.load(f), "tie_word_embeddings": True}
            with open(os.path.join(dst, name), "w") as f:
                json.dump(config, f)
        elif not name.endswith(".json") or name != "model.safetensors.index.json":
            with open(os.path.join(src, name), "rb") as fi, open(os.path.join(dst, name), "wb") as fo:
                fo.write(fi.read())
    got = _online(engine, tiny, "qwen3_moe-tied-online4-head", {"bits": 4, "quantize_lm_head": True}, model=dst)
    head = got["layers"]["lm_head"]
    assert head["method"] == "UnquantizedEmbeddingMethod" and "bits" not in head, head
    assert got["layers"]["model.layers.0.self_attn.qkv_proj"]["bits"] == 4
    assert all(len(t) > 0 for t in got["tokens"])
    assert_every_layer_accounted_for("qwen3_moe tied head", got)
    summary = convert(dst, str(tmp_path_factory.mktemp("tied-converted") / "out"), settings_of({"quantize_lm_head": True}), progress=False)
    assert summary.tied_lm_head
