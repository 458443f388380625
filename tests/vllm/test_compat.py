"""vllm_kbit.vllm.compat against the installed vLLM, and the rule that the package reaches vLLM only through it."""

from __future__ import annotations

import ast
import os

import torch

import vllm_kbit

PACKAGE = os.path.dirname(os.path.abspath(vllm_kbit.__file__))


def test_only_compat_imports_vllm():
    offenders = []
    for dirpath, _, files in os.walk(PACKAGE):
        for name in files:
            path = os.path.join(dirpath, name)
            if not name.endswith(".py") or path == os.path.join(PACKAGE, "vllm", "compat.py"):
                continue
            for node in ast.walk(ast.parse(open(path).read(), path)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
                offenders += [f"{os.path.relpath(path, PACKAGE)}:{node.lineno} {m}" for m in mods
                              if m == "vllm" or m.startswith("vllm.")]
    assert not offenders, "import vLLM through vllm_kbit.vllm.compat: " + ", ".join(offenders)


def test_installed_vllm_is_in_the_supported_range():
    from vllm_kbit.vllm import compat

    assert compat.OLDEST_SUPPORTED <= compat.VLLM_VERSION <= compat.NEWEST_TESTED
    assert compat.LLM.__name__ == "LLM" and compat.TokensPrompt is not None


def test_cpu_select_experts_is_softmax_top_k():
    """vLLM's CPU routing, wherever this release keeps it: renormalized softmax over the top-k logits."""
    from vllm_kbit.vllm.compat import cpu_select_experts

    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    weights, ids = cpu_select_experts(
        hidden_states=torch.zeros(5, 32), router_logits=logits, top_k=2, use_grouped_topk=False, renormalize=True
    )
    ref_vals, ref_ids = logits.topk(2, dim=-1)
    order = ids.sort(dim=-1).indices
    assert torch.equal(ids.gather(1, order).long(), ref_ids.sort(dim=-1).values)
    ref_w = torch.softmax(ref_vals, dim=-1).gather(1, ref_ids.sort(dim=-1).indices)
    torch.testing.assert_close(weights.gather(1, order), ref_w)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
