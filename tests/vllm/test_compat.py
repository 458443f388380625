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


def test_loads_per_expert_3d_tensors_matches_routed_experts_load_weights():
    """LOADS_PER_EXPERT_3D_TENSORS says whether vLLM's RoutedExperts.load_weights hands a 3-D tensor named for one
    expert (a routed expert's qweight as older conversions wrote it, [N, K/32, k]) to its parameter's weight_loader
    whole, as that expert's; where it does not, such checkpoints are refused before loading (checkpoint.py), and a
    2-D one (today's conversions, [N, K/32 * k]) is handed whole on every release (the next test)."""
    import types

    from vllm_kbit.vllm.compat import LOADS_PER_EXPERT_3D_TENSORS, RoutedExperts

    calls = []

    def weight_loader(param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
        calls.append((weight_name, shard_id, expert_id, tuple(loaded_weight.shape)))
        return True

    param = torch.nn.Parameter(torch.empty(2, 12, 8, dtype=torch.int32), requires_grad=False)
    param.weight_loader = weight_loader
    mapping = [(f"experts.{'w2' if s == 'w2' else 'w13'}_", f"experts.{e}.{n}.", e, s)
               for e in range(2) for s, n in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))]
    layer = types.SimpleNamespace(
        layer_name="model.layers.0.mlp.experts", w13_qweight=param, is_fused_checkpoint_transposed=False,
        get_expert_mapping=lambda **_: mapping,
        moe_config=types.SimpleNamespace(hidden_dim_unpadded=64, is_act_and_mul=True),
    )
    qweight = torch.zeros(6, 2, 4, dtype=torch.int32)  # one expert's up_proj: N=6, K=64 (2 blocks), k=4
    try:
        # Names reach a layer's load_weights relative to it (AutoWeightsLoader).
        list(RoutedExperts.load_weights(layer, [("1.up_proj.qweight", qweight)]))
    except (IndexError, RuntimeError, ValueError):  # a release taking it for a stack of experts may fail here
        assert not LOADS_PER_EXPERT_3D_TENSORS
        return
    per_expert = calls == [("model.layers.0.mlp.experts.w13_qweight", "w3", 1, (6, 2, 4))]
    assert per_expert == LOADS_PER_EXPERT_3D_TENSORS, calls


def test_routed_experts_load_weights_hands_a_2d_expert_tensor_whole_to_its_parameter():
    """Every supported release: RoutedExperts.load_weights maps a 2-D tensor named for one expert (today's routed
    expert qweight, [N, K/32 * k], and every absmax, [N, K/32]) to the parameter, expert and shard of vLLM's expert
    mapping and hands it to that parameter's weight_loader as it is (the kbit method's loader does the rest)."""
    import types

    from vllm_kbit.vllm.compat import RoutedExperts

    calls = []

    def weight_loader(param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
        calls.append((weight_name, shard_id, expert_id, tuple(loaded_weight.shape)))
        return True

    params = {}
    for name in ("w13_qweight", "w2_qweight", "w13_absmax"):
        params[name] = torch.nn.Parameter(torch.empty(2, 12, 8, dtype=torch.int32), requires_grad=False)
        params[name].weight_loader = weight_loader
    mapping = [(f"experts.{'w2' if s == 'w2' else 'w13'}_", f"experts.{e}.{n}.", e, s)
               for e in range(2) for s, n in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))]
    layer = types.SimpleNamespace(
        layer_name="model.layers.0.mlp.experts", is_fused_checkpoint_transposed=False, **params,
        get_expert_mapping=lambda **_: mapping,
        moe_config=types.SimpleNamespace(hidden_dim_unpadded=64, is_act_and_mul=True),
    )
    weights = [("1.up_proj.qweight", torch.zeros(6, 8, dtype=torch.int32)),
               ("0.down_proj.qweight", torch.zeros(64, 4, dtype=torch.int32)),
               ("1.gate_proj.absmax", torch.zeros(6, 2, dtype=torch.uint8))]
    list(RoutedExperts.load_weights(layer, weights))
    assert calls == [("model.layers.0.mlp.experts.w13_qweight", "w3", 1, (6, 8)),
                     ("model.layers.0.mlp.experts.w2_qweight", "w2", 0, (64, 4)),
                     ("model.layers.0.mlp.experts.w13_absmax", "w1", 1, (6, 2))], calls


def test_router_runs_on_cpu_matches_vllm():
    """ROUTER_RUNS_ON_CPU: vLLM's router has a CPU implementation (CPURouter) in this release."""
    import importlib

    from vllm_kbit.vllm.compat import ROUTER_RUNS_ON_CPU, VLLM_VERSION

    try:
        importlib.import_module("vllm.model_executor.layers.fused_moe.router.cpu_router").CPURouter
        has = True
    except (ModuleNotFoundError, AttributeError):
        has = False
    assert ROUTER_RUNS_ON_CPU == has
    if VLLM_VERSION >= (0, 32):
        assert ROUTER_RUNS_ON_CPU
