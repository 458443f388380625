"""Checkpoints of older `vllm-kbit convert` versions: routed experts' qweights stored 3-D, ``[N, K/32, k]`` (the
layout up to the commit that made them 2-D, ``[N, K/32 * k]``). They load on vLLM 0.32 and later exactly like
today's, are refused in one line before 0.32 (whose expert loader takes 3-D tensors for stacks of experts), and
`vllm-kbit upgrade` rewrites them into today's layout bit for bit."""

from __future__ import annotations

import os
import re
import shutil

import pytest
import torch
from kbit_e2e import TEXT_PROMPTS
from safetensors.torch import load_file, save_file

from vllm_kbit.cli import main as cli_main
from vllm_kbit.vllm.checkpoint import CheckpointFiles

EXPERT_QWEIGHT = re.compile(r"\.experts\.\d+\.[^.]+\.qweight$")


def old_layout(src: str, dst: str) -> str:
    """A copy of a converted checkpoint in the earlier layout: each routed expert's qweight [N, K/32, k] (k from
    its absmax's K/32), every other tensor and file as they are."""
    shutil.copytree(src, dst)
    for f in sorted(os.listdir(dst)):
        if f.endswith(".safetensors"):
            tensors = load_file(os.path.join(dst, f))
            for key in [k for k in tensors if EXPERT_QWEIGHT.search(k)]:
                kb = tensors[key.removesuffix("qweight") + "absmax"].shape[1]
                tensors[key] = tensors[key].view(tensors[key].shape[0], kb, -1).contiguous()
            save_file(tensors, os.path.join(dst, f), metadata={"format": "pt"})
    return dst


def _tensors(model_dir: str) -> dict:
    out = {}
    for f in sorted(os.listdir(model_dir)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(model_dir, f)))
    return out


@pytest.fixture(scope="module")
def old_qwen3_moe(converted_qwen3_moe, tmp_path_factory):
    return old_layout(converted_qwen3_moe, str(tmp_path_factory.mktemp("old") / "qwen3_moe-kbit4-3d"))


def test_convert_writes_routed_experts_2d_and_dense_layers_3d(converted_qwen3_moe):
    tensors = _tensors(converted_qwen3_moe)
    expert = tensors["model.layers.0.mlp.experts.3.down_proj.qweight"]
    assert expert.dtype == torch.int32 and expert.shape == (256, 128 // 32 * 4)
    assert tensors["model.layers.0.self_attn.o_proj.qweight"].shape == (256, 256 // 32, 4)


def test_upgrade_rewrites_the_old_layout_bit_for_bit(converted_qwen3_moe, old_qwen3_moe, tmp_path, capsys):
    assert _tensors(old_qwen3_moe)["model.layers.0.mlp.experts.3.down_proj.qweight"].dim() == 3
    out = tmp_path / "upgraded"
    assert cli_main(["upgrade", old_qwen3_moe, str(out)]) == 0
    new, upgraded = _tensors(converted_qwen3_moe), _tensors(str(out))
    n_experts = sum(bool(EXPERT_QWEIGHT.search(k)) for k in new)
    assert n_experts == 2 * 8 * 3  # layers x experts x (gate, up, down)
    assert f"{n_experts} routed-expert qweights rewritten 2-D" in capsys.readouterr().out
    assert set(new) == set(upgraded)
    assert all(torch.equal(new[k], upgraded[k]) for k in new)
    assert sorted(os.listdir(out)) == sorted(os.listdir(converted_qwen3_moe))
    assert cli_main(["upgrade", old_qwen3_moe, str(out)]) == 2  # not empty, no --overwrite
    assert "not empty" in capsys.readouterr().err


def test_before_vllm_032_the_old_layout_is_refused_in_one_line(converted_qwen3_moe, old_qwen3_moe):
    CheckpointFiles(converted_qwen3_moe).check_expert_qweights_2d("0.26.0")  # today's layout: fine
    with pytest.raises(ValueError) as e:
        CheckpointFiles(old_qwen3_moe).check_expert_qweights_2d("0.26.0")
    msg = str(e.value)
    assert "\n" not in msg and "vLLM 0.26.0 cannot load" in msg and f"vllm-kbit upgrade {old_qwen3_moe}" in msg, msg


def test_old_layout_serves_like_today_s(engine, old_qwen3_moe, converted_offline):
    """On this vLLM: 0.32 and later load the old layout, with packed weights and outputs identical to today's
    conversion; earlier releases refuse it naming `vllm-kbit upgrade`."""
    from vllm_kbit.vllm.compat import LOADS_PER_EXPERT_3D_TENSORS

    if not LOADS_PER_EXPERT_3D_TENSORS:
        from kbit_e2e import run_engine

        proc = run_engine(old_qwen3_moe, os.path.join(os.path.dirname(old_qwen3_moe), "run"), check=False)
        assert proc.returncode != 0 and "vllm-kbit upgrade" in proc.stdout + proc.stderr
        return
    old = engine("qwen3_moe-converted4-3d", old_qwen3_moe, text_prompts=TEXT_PROMPTS)
    kbit = {n: i for n, i in converted_offline["layers"].items() if "hash" in i}
    assert kbit and all(old["layers"][n]["hash"] == i["hash"] for n, i in kbit.items())
    assert old["tokens"] == converted_offline["tokens"]
