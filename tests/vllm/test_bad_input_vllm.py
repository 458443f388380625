"""Bad input to the plugin and to `vllm-kbit convert`: clear errors, or the documented unquantized rule."""

from __future__ import annotations

import json
import os
import shutil
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_kbit.cli import main as cli_main
from vllm_kbit.convert import ConvertError, convert
from vllm_kbit.settings import KbitSettings
from kbit_dev import tiny_models

from kbit_e2e import assert_every_layer_accounted_for, load_summaries, online_kwargs, run_engine, settings_of


# ----------------------------------------------------------------------------- settings


@pytest.mark.parametrize("bits", [1, 6, 8, "4", 4.0, True])
def test_unknown_bits_are_refused(bits):
    with pytest.raises(ValueError, match="not supported"):
        KbitSettings(bits=bits)
    with pytest.raises(ValueError, match="not supported"):
        KbitSettings(bits=4, bits_overrides={"experts": bits})


def test_bad_config_dicts_are_refused():
    from vllm_kbit.vllm.config import KbitConfig

    with pytest.raises(ValueError, match="blocksize"):
        KbitConfig.from_config({"quant_method": "kbit", "bits": 4, "blocksize": 64})
    with pytest.raises(ValueError, match="unknown quantization_config keys"):
        KbitConfig.from_config({"quant_method": "kbit", "bitz": 4})
    with pytest.raises(ValueError, match="not a valid regex"):
        KbitConfig.from_config({"quant_method": "kbit", "bits_overrides": {"(": 3}})
    with pytest.raises(ValueError, match="codebook has 8 entries"):
        KbitConfig.from_config({"quant_method": "kbit", "bits": 4, "codebook": [-1, -0.5, -0.2, 0, 0.2, 0.4, 0.7, 1]})
    cfg = KbitConfig.from_config({"quant_method": "kbit", "bits": 2, "codebook": [-1, -0.25, 0.3, 1]})
    assert cfg.settings.codebook(2).tolist() == pytest.approx([-1, -0.25, 0.3, 1])


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (10, 0)])
def test_gpus_other_than_hopper_are_refused_in_one_line(monkeypatch, capability):
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    from vllm_kbit.vllm.config import KbitConfig

    assert KbitConfig.get_min_capability() == 90
    KbitConfig()  # no GPU here: nothing to check
    monkeypatch.setattr(current_platform, "is_cuda_alike", lambda: True)
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    monkeypatch.setattr(current_platform, "get_device_name", lambda device_id=0: "NVIDIA Test GPU")
    monkeypatch.setattr(current_platform, "get_device_capability", lambda device_id=0: DeviceCapability(*capability))
    with pytest.raises(ValueError, match=rf"compute capability {capability[0]}\.{capability[1]};.*Hopper GPU \(sm_90") as e:
        KbitConfig.from_config({"quant_method": "kbit", "bits": 4})
    assert "\n" not in str(e.value)
    monkeypatch.setattr(current_platform, "get_device_capability", lambda device_id=0: DeviceCapability(9, 0))
    KbitConfig()


def test_unknown_bits_fail_the_engine_with_a_clear_error(tiny, tmp_path):
    proc = run_engine(tiny["qwen3"], str(tmp_path), online_kwargs({"bits": 7}), check=False)
    assert proc.returncode != 0
    assert "bits=7 is not supported" in proc.stdout + proc.stderr


# ----------------------------------------------------------------------------- unsupported layers


def _fake_moe_layer(**overrides):
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    cfg = dict(activation=MoEActivation.SILU, is_act_and_mul=True, has_bias=False, hidden_dim=256,
               intermediate_size_per_partition=128)
    cfg.update(overrides)
    return types.SimpleNamespace(moe_config=types.SimpleNamespace(**cfg))


def test_unsupported_moe_layers_are_refused_by_name():
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    from vllm_kbit.vllm.moe_method import check_moe_layer

    check_moe_layer(_fake_moe_layer(), "model.layers.0.mlp.experts")
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.experts' uses activation.*SiLU"):
        check_moe_layer(_fake_moe_layer(activation=MoEActivation.GELU), "model.layers.0.mlp.experts")
    with pytest.raises(ValueError, match="expert biases"):
        check_moe_layer(_fake_moe_layer(has_bias=True), "model.layers.0.mlp.experts")
    with pytest.raises(ValueError, match="intermediate size per rank 48, not a multiple of 32"):
        check_moe_layer(_fake_moe_layer(intermediate_size_per_partition=48), "model.layers.0.mlp.experts")


def test_moe_with_k_not_multiple_of_32_fails_naming_the_layer(tmp_path):
    model = tiny_models.build("qwen3_moe", str(tmp_path / "m"), moe_intermediate=48)
    proc = run_engine(model, str(tmp_path / "run"), {"quantization": "kbit"}, check=False)
    assert proc.returncode != 0
    assert "MoE layer 'model.layers.0.mlp.experts' has intermediate size per rank 48" in proc.stdout + proc.stderr
    with pytest.raises(ConvertError, match=r"experts\.0\.down_proj\.weight has K=48"):
        convert(model, str(tmp_path / "out"), KbitSettings(), progress=False)


def test_linear_with_k_not_multiple_of_32_stays_unquantized(tmp_path, engine):
    """The documented rule: a linear layer with K % 32 != 0 is left in bf16, online and in convert alike."""
    model = tiny_models.build("qwen3", str(tmp_path / "m"), intermediate=1000)
    out = str(tmp_path / "kbit")
    summary = convert(model, out, KbitSettings(), progress=False)
    assert summary.left_unquantized == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    converted = engine("qwen3-k1000-converted", out)
    layers = converted["layers"]
    assert layers["model.layers.0.mlp.down_proj"]["method"] == "UnquantizedLinearMethod"
    assert layers["model.layers.0.mlp.gate_up_proj"]["method"] == "KbitLinearMethod"
    assert len(converted["tokens"]) == 8 and all(len(t) == 24 for t in converted["tokens"])
    # Each is named in a warning and counted in the load summary beside the pre-quantized layers.
    assert_every_layer_accounted_for("qwen3 K=1000 converted", converted)
    assert "left unquantized: 2 linear layers (K not a multiple of 32: 2)" in load_summaries(converted)[0][0]


def _with_weight_value(src: str, dst: str, key: str, value: float) -> str:
    """A copy of the checkpoint src with one element of tensor `key` set to value."""
    shutil.copytree(src, dst)
    for f in sorted(os.listdir(dst)):
        if f.endswith(".safetensors"):
            tensors = load_file(os.path.join(dst, f))
            if key in tensors:
                tensors[key] = tensors[key].clone()
                tensors[key].view(-1)[5] = value
                save_file(tensors, os.path.join(dst, f), metadata={"format": "pt"})
                return dst
    raise KeyError(key)


def test_linear_with_non_finite_weights_stays_bf16_with_a_warning(tiny, tmp_path):
    """Online: one linear layer with an Inf weight stays in bf16, named in a warning; the server runs.
    (|w| beyond the E4M4 range is range-scaled instead: test_e2e.py.)"""
    model = _with_weight_value(tiny["qwen3"], str(tmp_path / "m"), "model.layers.0.self_attn.o_proj.weight", float("inf"))
    proc = run_engine(model, str(tmp_path / "run"), {"quantization": "kbit"}, check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert "kbit: layer model.layers.0.self_attn.o_proj left unquantized: weight has NaN or Inf values" in log
    with open(tmp_path / "run" / "out.json") as f:
        out = json.load(f)
    # The layer keeps its kbit method, which runs vLLM's unquantized one on the bf16 weight (no quant_method swap).
    left = out["layers"]["model.layers.0.self_attn.o_proj"]
    assert left["method"] == "KbitOnlineLinearMethod" and "bits" not in left, left
    assert left["left_unquantized"] == "weights not representable" and left["params"]["weight"][0] == "torch.bfloat16"
    assert out["layers"]["model.layers.1.self_attn.o_proj"]["method"] == "KbitOnlineLinearMethod"
    assert len(out["tokens"]) == 8 and all(len(t) == 24 for t in out["tokens"])
    assert "quantized 7 linear layers and 0 routed-expert blocks to 4 bits" in log
    assert "left unquantized: 1 linear layer (weights not representable: 1)" in log


def test_moe_experts_beyond_e4m4_fail_naming_layer_and_expert(tiny, tmp_path):
    model = _with_weight_value(tiny["qwen3_moe"], str(tmp_path / "m"), "model.layers.1.mlp.experts.3.down_proj.weight", float("inf"))
    proc = run_engine(model, str(tmp_path / "run"), {"quantization": "kbit"}, check=False)
    assert proc.returncode != 0
    assert "MoE layer 'model.layers.1.mlp.experts' expert 3 w2: weight has NaN or Inf values" in proc.stdout + proc.stderr


# ----------------------------------------------------------------------------- corrupted checkpoints


def _corrupt(src: str, dst: str, edit) -> str:
    shutil.copytree(src, dst)
    index = json.load(open(os.path.join(dst, "model.safetensors.index.json")))
    for shard in sorted(set(index["weight_map"].values())):
        path = os.path.join(dst, shard)
        tensors = load_file(path)
        edit(tensors)
        save_file(tensors, path, metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k in _all_keys(dst)}
    json.dump(index, open(os.path.join(dst, "model.safetensors.index.json"), "w"))
    return dst


def _all_keys(d: str) -> set:
    from safetensors import safe_open

    keys = set()
    for f in os.listdir(d):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(d, f), "pt") as sf:
                keys |= set(sf.keys())
    return keys


def test_corrupted_qweight_dtype_is_refused(converted_qwen3_moe, tmp_path):
    def edit(t):
        key = "model.layers.0.self_attn.q_proj.qweight"
        if key in t:
            t[key] = t[key].to(torch.int64)

    bad = _corrupt(converted_qwen3_moe, str(tmp_path / "bad"), edit)
    proc = run_engine(bad, str(tmp_path / "run"), check=False)
    assert proc.returncode != 0
    shard = _shard_of(bad, "model.layers.0.self_attn.q_proj.qweight")
    assert f"checkpoint tensor model.layers.0.self_attn.q_proj.qweight in {shard} is torch.int64" in proc.stdout + proc.stderr


def test_missing_absmax_is_refused(converted_qwen3_moe, tmp_path):
    def edit(t):
        t.pop("model.layers.1.self_attn.k_proj.absmax", None)
        t.pop("model.layers.0.mlp.experts.5.up_proj.absmax", None)

    bad = _corrupt(converted_qwen3_moe, str(tmp_path / "bad"), edit)
    proc = run_engine(bad, str(tmp_path / "run"), check=False)
    assert proc.returncode != 0
    # Whichever layer vLLM finishes first fails the load; the tensor's qweight names the file it belongs in.
    moe_q, linear_q = "model.layers.0.mlp.experts.5.up_proj.qweight", "model.layers.1.self_attn.k_proj.qweight"
    assert (
        f"checkpoint has no model.layers.0.mlp.experts.5.up_proj.absmax (MoE layer 'model.layers.0.mlp.experts'; "
        f"{moe_q} is in {_shard_of(bad, moe_q)})" in proc.stdout + proc.stderr
    ) or (
        f"checkpoint has no model.layers.1.self_attn.k_proj.absmax (layer 'model.layers.1.self_attn.qkv_proj'; "
        f"{linear_q} is in {_shard_of(bad, linear_q)})" in proc.stdout + proc.stderr
    )


def _shard_of(checkpoint: str, key: str) -> str:
    index = json.load(open(os.path.join(checkpoint, "model.safetensors.index.json")))
    return index["weight_map"][key]


def test_truncated_shard_fails_the_engine_naming_the_file(converted_qwen3_moe, tmp_path):
    bad = str(tmp_path / "bad")
    shutil.copytree(converted_qwen3_moe, bad)
    shard = _shard_of(bad, "model.layers.1.self_attn.o_proj.qweight")
    path = os.path.join(bad, shard)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    proc = run_engine(bad, str(tmp_path / "run"), check=False)
    assert proc.returncode != 0
    log = proc.stdout + proc.stderr
    line = next(x for x in log.splitlines() if "kbit: checkpoint shard" in x)
    assert f"kbit: checkpoint shard {path} ({os.path.getsize(path)} bytes) cannot be read" in line
    assert "expected a complete safetensors file" in line


def test_wrong_codebook_in_config_json_fails_the_engine_naming_the_entry(converted_qwen3_moe, tmp_path):
    bad = str(tmp_path / "bad")
    shutil.copytree(converted_qwen3_moe, bad)
    config = json.load(open(os.path.join(bad, "config.json")))
    config["quantization_config"]["codebook"] = {"4": [-1.0, -0.5, 0.0, 0.5, 1.0]}
    json.dump(config, open(os.path.join(bad, "config.json"), "w"))
    proc = run_engine(bad, str(tmp_path / "run"), check=False)
    assert proc.returncode != 0
    assert ("kbit: codebook['4'] has 5 entries but k=4 needs 16 (quantization_config in the model's config.json "
            "or --hf-overrides)") in proc.stdout + proc.stderr


def test_config_json_errors_name_the_entry_and_where_it_comes_from():
    from vllm_kbit.vllm.config import KbitConfig

    where = "(quantization_config in the model's config.json or --hf-overrides)"
    cases = [
        ({"bits": 9}, "kbit: bits=9 is not supported; bits must be one of (2, 3, 4, 5) "),
        ({"bits": 4, "bits_overrides": {"experts": 3}, "codebook": {"4": "normal_float_zero"}},
         "kbit: codebook dict has no entry for 3 bits (keys: ['4']) "),
        ({"bits": 3, "codebook": {"3": [-1, 0, 1]}}, "kbit: codebook['3'] has 3 entries but k=3 needs 8 "),
        ({"bits": 2, "codebook": ["a", "b", "c", "d"]}, "kbit: codebook must be a list of 4 numbers, got ['a', 'b', 'c', 'd'] "),
    ]
    for config, message in cases:
        with pytest.raises(ValueError) as e:
            KbitConfig.from_config({"quant_method": "kbit", "prequantized": True, **config})
        assert str(e.value) == message + where


def test_checkpoint_files_find_the_shard_of_a_tensor(tiny, converted_qwen3_moe, tmp_path):
    from vllm_kbit.vllm.checkpoint import CheckpointFiles

    sharded = str(tmp_path / "sharded")
    convert(tiny["qwen3"], sharded, KbitSettings(), max_shard_bytes=1 << 16, progress=False)
    weight_map = json.load(open(os.path.join(sharded, "model.safetensors.index.json")))["weight_map"]
    assert len(set(weight_map.values())) > 1
    assert all(CheckpointFiles(sharded).file_of(k) == f for k, f in weight_map.items())

    files = CheckpointFiles(converted_qwen3_moe)
    files.check_shards()
    key = "model.layers.1.mlp.experts.3.down_proj.qweight"
    shard = _shard_of(converted_qwen3_moe, key)
    assert files.where(key) == f"{key} in {shard}"
    assert files.file_of("model.language_model.layers.1.mlp.experts.3.down_proj.qweight") == shard  # remapped prefix
    assert files.file_of("model.layers.7.mlp.experts.3.down_proj.qweight") is None  # never another layer's
    assert CheckpointFiles("org/some-hub-model").where(key) == key  # not a local directory: the name alone
    # Without an index, the shards' headers are read.
    single = tmp_path / "single"
    shutil.copytree(converted_qwen3_moe, single)
    os.remove(single / "model.safetensors.index.json")
    assert CheckpointFiles(str(single)).file_of(key) == shard


# ----------------------------------------------------------------------------- convert


def test_failed_convert_removes_the_output_it_created(tiny, tmp_path):
    src = str(tmp_path / "in")
    shutil.copytree(tiny["qwen3"], src)
    shard = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))[0]
    size = os.path.getsize(os.path.join(src, shard))
    with open(os.path.join(src, shard), "r+b") as f:
        f.truncate(size // 2)
    out = str(tmp_path / "out")
    with pytest.raises(ConvertError, match=f"cannot read .*{shard}"):
        convert(src, out, KbitSettings(), progress=False)
    assert not os.path.exists(out)
    os.makedirs(out)  # an empty directory given by the user stays, empty
    with pytest.raises(ConvertError):
        convert(src, out, KbitSettings(), progress=False)
    assert os.listdir(out) == []


def test_failed_convert_of_an_unrepresentable_tensor_names_it_and_leaves_nothing(tiny, tmp_path):
    src = _with_weight_value(tiny["qwen3"], str(tmp_path / "in"), "model.layers.1.mlp.up_proj.weight", float("nan"))
    out = str(tmp_path / "out")
    with pytest.raises(ConvertError, match="tensor model.layers.1.mlp.up_proj.weight: kbit: weight has NaN or Inf"):
        convert(src, out, KbitSettings(), max_shard_bytes=1 << 16, progress=False)
    assert not os.path.exists(out)


def test_convert_keeps_a_dense_tensor_beyond_e4m4_in_bf16_with_a_warning(tiny, tmp_path, capsys):
    src = _with_weight_value(tiny["qwen3"], str(tmp_path / "in"), "model.layers.1.mlp.up_proj.weight", 100.0)
    out = str(tmp_path / "out")
    summary = convert(src, out, KbitSettings(), progress=False)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.layers.1.mlp.up_proj.weight has |w| = 100, above the largest E4M4" in err, err
    assert summary.out_of_range == ["model.layers.1.mlp.up_proj"]
    assert "left unquantized (|w| > 31): model.layers.1.mlp.up_proj" in summary.format()
    tensors = {}
    for f in sorted(os.listdir(out)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(out, f)))
    assert tensors["model.layers.1.mlp.up_proj.weight"].dtype == torch.bfloat16
    assert "model.layers.1.mlp.up_proj.qweight" not in tensors and "model.layers.0.mlp.up_proj.qweight" in tensors


def test_convert_refuses_a_routed_expert_beyond_e4m4_pointing_to_online(tiny, tmp_path):
    src = _with_weight_value(tiny["qwen3_moe"], str(tmp_path / "in"), "model.layers.1.mlp.experts.3.down_proj.weight", 100.0)
    out = str(tmp_path / "out")
    with pytest.raises(ConvertError, match=r"routed expert tensor model.layers.1.mlp.experts.3.down_proj.weight has "
                                           r"\|w\| = 100.*--quantization kbit") as e:
        convert(src, out, KbitSettings(), progress=False)
    assert "\n" not in str(e.value)
    assert not os.path.exists(out)


def test_convert_refuses_bad_locations_and_inputs(tiny, tmp_path, capsys):
    src = tiny["qwen3"]
    with pytest.raises(ConvertError, match="overlaps the input"):
        convert(src, src, KbitSettings(), progress=False)
    with pytest.raises(ConvertError, match="overlaps the input"):
        convert(src, os.path.join(src, "sub"), KbitSettings(), progress=False)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    with pytest.raises(ConvertError, match="not empty"):
        convert(src, str(busy), KbitSettings(), progress=False)

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(os.path.join(src, "config.json"), pickled)
    torch.save({"w": torch.zeros(2)}, pickled / "pytorch_model.bin")
    with pytest.raises(ConvertError, match="pickle-based checkpoints are never loaded"):
        convert(str(pickled), str(tmp_path / "o1"), KbitSettings(), progress=False)

    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConvertError, match="cannot read"):
        convert(str(broken), str(tmp_path / "o2"), KbitSettings(), progress=False)

    (broken / "config.json").write_text("{not json")
    with pytest.raises(ConvertError, match="not valid JSON"):
        convert(str(broken), str(tmp_path / "o3"), KbitSettings(), progress=False)

    # The CLI turns these into one-line errors and exit code 2.
    assert cli_main(["convert", src, src, "--quiet"]) == 2
    assert "overlaps the input" in capsys.readouterr().err
    assert cli_main(["convert", src, str(tmp_path / "o4"), "--bits", "6", "--quiet"]) == 2
    assert "bits=6 is not supported" in capsys.readouterr().err


def test_convert_refuses_already_quantized_input(converted_qwen3_moe, tmp_path):
    with pytest.raises(ConvertError, match="already quantized"):
        convert(converted_qwen3_moe, str(tmp_path / "again"), KbitSettings(), progress=False)


def test_convert_cli_writes_sharded_checkpoint_with_overrides(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    rc = cli_main(["convert", tiny["glm4_moe"], str(out), "--bits", "4", "--bits-overrides", "experts=3",
                   r"self_attn\.=5", "--max-shard-size", "1MB", "--quiet"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "GiB saved" in printed
    config = json.load(open(out / "config.json"))
    qc = config["quantization_config"]
    assert qc["quant_method"] == "kbit" and qc["prequantized"] is True and qc["bits"] == 4
    assert qc["bits_overrides"] == {"experts": 3, r"self_attn\.": 5}
    index = json.load(open(out / "model.safetensors.index.json"))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all(os.path.exists(out / s) for s in shards)
    assert (out / "tokenizer.json").exists() and (out / "generation_config.json").exists()
    keys = _all_keys(str(out))
    from safetensors import safe_open

    def tensor(name):
        with safe_open(out / index["weight_map"][name], "pt") as f:
            return f.get_tensor(name)

    # A routed expert's qweight is 2-D, [N, K/32 * k]; dense layers' [N, K/32, k] (docs/format.md).
    assert tensor("model.layers.1.mlp.experts.0.gate_proj.qweight").shape == (128, 256 // 32 * 3)
    assert tensor("model.layers.0.self_attn.q_proj.qweight").shape[-1] == 5
    assert tensor("model.layers.0.mlp.gate_proj.qweight").shape[-1] == 4
    assert "model.layers.1.mlp.gate.weight" in keys and "lm_head.weight" in keys  # defaults left in bf16
    assert "model.embed_tokens.weight" in keys
    # Bit-identical to quantizing the same tensor in memory.
    import vllm_kbit
    from safetensors import safe_open as so

    with so(os.path.join(tiny["glm4_moe"], "model.safetensors"), "pt") as f:
        w = f.get_tensor("model.layers.1.mlp.experts.0.gate_proj.weight")
    q = vllm_kbit.quantize(w, 3)
    assert torch.equal(q.qweight.flatten(1), tensor("model.layers.1.mlp.experts.0.gate_proj.qweight"))
    assert torch.equal(q.absmax, tensor("model.layers.1.mlp.experts.0.gate_proj.absmax"))
    assert settings_of(qc).bits_for("model.layers.1.mlp.experts") == 3


def test_convert_prints_the_weights_to_do_an_estimate_and_a_rate(tiny, tmp_path, capsys):
    """Before quantizing: the tensors, the weights per bit width, the device (auto: the CPU without CUDA)
    and a measured estimate; while it runs, a bar counting weights (its rate in weights/s)."""
    from vllm_kbit.convert import resolve_device

    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cuda:1") == "cuda:1"
    out = tmp_path / "out"
    rc = cli_main(["convert", tiny["glm4_moe"], str(out), "--bits", "4", "--bits-overrides", "experts=3"])
    assert rc == 0
    captured = capsys.readouterr()
    from vllm_kbit.convert import quantization_decision

    settings = settings_of({"quant_method": "kbit", "bits": 4, "bits_overrides": {"experts": 3}})
    todo = {}
    for file in sorted(f for f in os.listdir(tiny["glm4_moe"]) if f.endswith(".safetensors")):
        for name, t in load_file(os.path.join(tiny["glm4_moe"], file)).items():
            bits = quantization_decision(name, tuple(t.shape), t.dtype, settings)
            if bits not in (None, -1):
                todo[bits] = todo.get(bits, 0) + t.numel()
    line = next(line for line in captured.out.splitlines() if line.startswith("kbit convert:"))
    assert f"{sum(todo.values()) / 1e6:.1f}M weights to quantize" in line
    assert f"{todo[3] / 1e6:.1f}M at k=3" in line and f"{todo[4] / 1e6:.1f}M at k=4" in line
    assert f"on {resolve_device('auto')}" in line and "quantizing takes about" in line
    assert "w/s" in captured.err  # the bar's rate, in weights per second



def test_a_rotation_is_sliced_per_rank_and_a_tensor_parallel_size_it_does_not_cover_is_refused():
    """A row-parallel rank (and the experts' down input) takes its slice of the full K's signs with the recorded
    block; a tensor-parallel size whose shard the block does not divide is refused in one line naming --rotation-tp."""
    from vllm_kbit import reference as fmt
    from vllm_kbit.settings import Rotation
    from vllm_kbit.vllm.linear_method import layer_rotation, shard_rotation

    full = fmt.rotation_signs(1536, 5)
    big = fmt.ROTATION_MAX_BLOCK  # the format's largest cap: blocks over 128 where K allows
    signs, block = shard_rotation(Rotation(seed=5, max_block=big, tp=2), "model.layers.0.mlp.down_proj", "input", 1536,
                                  768, 1)
    assert block == 256 and torch.equal(signs, full[768:])  # 1536 / 2 = 768 = 3 * 256
    layer = types.SimpleNamespace(tp_rank=1)
    layer_rotation(layer, Rotation(seed=5, max_block=big, tp=2), "model.layers.0.mlp.down_proj", 768, 1536)
    assert torch.equal(layer.kbit_rotation[0], full[768:]) and layer.kbit_rotation[1] == 256
    layer_rotation(layer, Rotation(seed=5, max_block=big, tp=2), "model.layers.0.mlp.gate_up_proj", 1536, 1536)
    assert torch.equal(layer.kbit_rotation[0], full)  # column parallel: the whole K
    # The default cap (128) divides this shard with no --rotation-tp.
    signs, block = shard_rotation(Rotation(seed=5), "model.layers.0.mlp.down_proj", "input", 1536, 768, 1)
    assert block == 128 and torch.equal(signs, full[768:])
    with pytest.raises(ValueError, match=r"blocks of 512 over its 1536 inputs, which do not divide this rank's 768 "
                                         r"inputs at tensor parallel 2.*--rotation-tp 2") as e:
        shard_rotation(Rotation(seed=5, max_block=big), "model.layers.0.mlp.down_proj", "input", 1536, 768, 0)
    assert "\n" not in str(e.value)
