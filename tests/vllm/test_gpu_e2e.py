"""The end-to-end checks on a GPU with vLLM's CUDA build (`pytest -m gpu`); skipped without a CUDA GPU."""

from __future__ import annotations

import pytest
import torch
from kbit_e2e import (
    ONLINE,
    ROTATION,
    arch_kwargs,
    assert_agree,
    assert_lora_agrees,
    lora_runs,
    assert_every_layer_accounted_for,
    assert_rotated,
    dequantized_checkpoint,
    online_kwargs,
    packed_weight_differences,
    report_token_differences,
    settings_of,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and vLLM's CUDA build"),
]


# The target architectures: GLM-4.7-Flash's (glm4_moe_lite: multi-head latent attention, dense first layer, shared +
# routed experts) and Qwen3-Coder-Next's (qwen3_next: gated delta-net linear attention beside gated full attention,
# shared + routed experts). Their gated delta-net prefill runs on Triton (arch_kwargs: flashinfer is not installed).
TARGETS = ["glm4_moe_lite", "qwen3_next"]
# Projections vLLM builds without a quantization config (router gates, Qwen3-Next's shared-expert gate and conv1d).
NOT_OFFERED = ("gate", "shared_expert_gate", "conv1d")

_DEQ4: dict[str, str] = {}


def _engines4(engine, tiny, tmp_path_factory, kind: str) -> dict[str, tuple]:
    """The kbit-4 engines of one kind, {role: (key, model, llm_kwargs)}: online quantization and the same weights
    dequantized to bf16 (written once per kind), both served with the architecture's settings (arch_kwargs)."""
    if kind not in _DEQ4:
        _DEQ4[kind] = dequantized_checkpoint(tiny[kind], str(tmp_path_factory.mktemp(f"gpu-{kind}-deq4")),
                                             settings_of(ONLINE[4]))
    return {"online": (f"gpu-{kind}-online4", tiny[kind], {**online_kwargs(ONLINE[4]), **arch_kwargs(kind)}),
            "deq": (f"gpu-{kind}-deq4", _DEQ4[kind], arch_kwargs(kind))}


def _start_and_get(engine, specs: list[tuple]) -> list[dict]:
    """Starts every engine first (KBIT_E2E_ENGINES at once; each key once per session), then waits for each."""
    for spec in specs:
        engine.start(*spec)
    return [engine(*spec) for spec in specs]


@pytest.mark.parametrize("kind", ["qwen3_moe", "glm4_moe", *TARGETS])
def test_gpu_online_matches_dequantized_model(engine, tiny, tmp_path_factory, kind):
    specs = _engines4(engine, tiny, tmp_path_factory, kind)
    got, ref = _start_and_get(engine, [specs["online"], specs["deq"]])
    assert any(i.get("method") == "KbitOnlineMoEMethod" for i in got["layers"].values())
    if kind in TARGETS:  # every projection kbit or named; the load summary counts them (no silent no-op)
        groups = assert_every_layer_accounted_for(f"GPU {kind}", got)
        assert groups["left"] == [], groups
        assert {name.rpartition(".")[2] for name in groups["not_offered"]} <= set(NOT_OFFERED), groups
    assert_agree(f"GPU {kind}", got, ref)


@pytest.mark.parametrize("kind", TARGETS)
def test_gpu_converted_target_architectures_match_dequantized_model(engine, tiny, tmp_path_factory, converted4, kind):
    """`vllm-kbit convert --bits 4` of both target architectures served with no quantization flag, under CUDA graphs
    and torch.compile: the packed weights are the online engine's, every layer is kbit or accounted for, and the
    outputs agree with the dequantized model (and with the online engine) as two runs of one engine do."""
    specs = _engines4(engine, tiny, tmp_path_factory, kind)
    conv_spec = (f"gpu-{kind}-converted4", converted4(kind), arch_kwargs(kind))
    conv, online, ref = _start_and_get(engine, [conv_spec, specs["online"], specs["deq"]])
    assert any(i.get("method") == "KbitMoEMethod" for i in conv["layers"].values()), "no kbit MoE layer"
    differ = packed_weight_differences(conv, online)
    assert not differ, f"packed weights differ from online quantization in {differ}"
    assert assert_every_layer_accounted_for(f"GPU {kind} converted", conv)["left"] == []
    assert_agree(f"GPU {kind} converted vs dequantized", conv, ref)
    assert_agree(f"GPU {kind} converted vs online", conv, online)


def test_gpu_converted_checkpoint_identical_to_online(engine, tiny, converted_qwen3_moe):
    """Bit-identical packed weights, and outputs that agree like two runs of one engine do.

    Not token-identical outputs (the CPU test asks for those): under CUDA graphs and torch.compile two
    processes serving the same weights need not produce bit-identical logits (tests/vllm/repeatability.py
    measures it; docs/decisions.md, "End-to-end tests compare agreement"), and on this tiny random MoE
    router near-ties turn any last-bit difference into a different free-running continuation."""
    online = engine("gpu-qwen3_moe-online4", tiny["qwen3_moe"], online_kwargs(ONLINE[4]))
    conv = engine("gpu-qwen3_moe-converted4", converted_qwen3_moe)
    assert any("hash" in i for i in online["layers"].values()), "no kbit layer in the online model"
    differ = packed_weight_differences(conv, online)
    assert not differ, f"packed weights differ from online quantization in {differ}"
    assert_agree("GPU converted vs online", conv, online)


def test_gpu_mixed_bits_match_dequantized_model(engine, tiny, tmp_path_factory):
    """k=3 with attention at 5 bits and layer 1's routed experts left in bf16: the settings take effect
    on the CUDA build too (k=5 dense MMA/GEMV, k=3 MoE kernels, an unquantized MoE beside them)."""
    config = ONLINE[3]
    got = engine("gpu-qwen3_moe-online3", tiny["qwen3_moe"], online_kwargs(config))
    layers = got["layers"]
    assert (layers["model.layers.0.self_attn.qkv_proj"]["method"], layers["model.layers.0.self_attn.qkv_proj"]["bits"]) == (
        "KbitOnlineLinearMethod", 5)
    assert (layers["model.layers.0.mlp.experts"]["method"], layers["model.layers.0.mlp.experts"]["bits"]) == (
        "KbitOnlineMoEMethod", 3)
    assert layers["model.layers.1.mlp.experts"]["method"] == "UnquantizedFusedMoEMethod"
    ref_dir = dequantized_checkpoint(tiny["qwen3_moe"], str(tmp_path_factory.mktemp("gpu-qwen3_moe-deq3")),
                                     settings_of(config))
    ref = engine("gpu-qwen3_moe-deq3", ref_dir)
    assert_agree("GPU mixed bits", got, ref)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_gpu_lora_adapters_match_merged_dequantized_model(engine, tiny, tmp_path_factory, kind):
    """Three random LoRA adapters at once (max_loras 4) beside the base model, under CUDA graphs and torch.compile,
    on every linear projection: attention and the MLP, which for Qwen3-MoE are the routed experts (vLLM's MoE LoRA
    layer around the kbit modular kernel: the experts run stage by stage and vLLM's punica kernels add each
    adapter after gate_up and after down). Against the dequantized bf16 model with each adapter merged in."""
    from kbit_dev.lora import ATTENTION, MLP

    got, ref, plain = lora_runs(engine, tiny, tmp_path_factory, kind, ATTENTION + MLP, tag="-gpu")
    if kind == "qwen3_moe":
        moe = got["layers"]["model.layers.0.mlp.experts"]
        assert moe["bits"] == 4 and "w13_qweight" in moe["params"], moe
    assert_lora_agrees(f"GPU {kind} kbit-4 + 3 LoRA adapters", got, ref, plain)


@pytest.mark.parametrize("kind,gptq", [("qwen3_moe", False), ("qwen3", True), *((k, False) for k in TARGETS)])
def test_gpu_rotated_checkpoint_matches_dequantized_model(engine, rotated, kind, gptq):
    """`vllm-kbit convert --rotate` (and --gptq, which rotates by default) served under CUDA graphs and
    torch.compile: every kbit layer rotates its input inside the kbit ops, and the outputs agree with the bf16 model
    of the stored weights decoded in the original basis (Q(W R) R^T)."""
    out, deq = rotated(kind, gptq)
    tag = f"gpu-{kind}-rot4{'-gptq' if gptq else ''}"
    got, ref = _start_and_get(engine, [(tag, out, arch_kwargs(kind)), (f"{tag}-deq", deq, arch_kwargs(kind))])
    assert_rotated(f"GPU {kind} rotated", got)
    assert_agree(f"GPU {kind} rotated vs its dequantized model", got, ref)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_gpu_rotated_lora_adapters_match_merged_dequantized_model(engine, tiny, tmp_path_factory, kind):
    """Online kbit-4 with a rotation and three LoRA adapters on attention and the MLP (Qwen3-MoE: the routed
    experts stage by stage, the adapters' deltas from the unrotated hidden states and activations) against the
    dequantized rotated model with each adapter merged in."""
    from kbit_dev.lora import ATTENTION, MLP

    got, ref, plain = lora_runs(engine, tiny, tmp_path_factory, kind, ATTENTION + MLP, tag="-gpu-rot",
                                rotation=ROTATION)
    assert_rotated(f"GPU {kind} rotated + LoRA", got)
    assert_lora_agrees(f"GPU {kind} rotated kbit-4 + 3 LoRA adapters", got, ref, plain)


# Tensor / expert parallel on two GPUs against TP=1 on the same machine. Each kind x quantization has one
# TP=1 reference engine shared by its parallel variants; `parallel_engines` starts all the engines the
# selected tests need at once (KBIT_E2E_ENGINES at a time), so the set takes a few engine start-ups, not twelve.
PARALLEL = {
    "tp2": {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
    "tp2-ep": {"tensor_parallel_size": 2, "distributed_executor_backend": "mp", "enable_expert_parallel": True},
}
# converted-rotated: `convert --rotate --rotation-tp 2` (each rank rotates its shard of a row-parallel layer's and
# of the experts' down inputs with its slice of the signs).
QUANTS = ("online4", "converted-mixed", "converted-rotated")
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


class ParallelEngines:
    """The engines of test_gpu_parallel_matches_tp1: (kind, quant, parallel or None for TP=1) -> runner output."""

    def __init__(self, engine, tiny, converted_mixed, rotated):
        self.engine, self.tiny, self.converted_mixed, self.rotated = engine, tiny, converted_mixed, rotated

    def spec(self, kind: str, quant: str, parallel: str | None) -> tuple[str, str, dict]:
        if quant == "online4":  # the TP=1 key is the one test_gpu_online_matches_dequantized_model starts
            key, model, kwargs = f"gpu-{kind}-online4", self.tiny[kind], online_kwargs(ONLINE[4])
        elif quant == "converted-rotated":
            key, model, kwargs = f"gpu-{kind}-converted-rotated-tp2", self.rotated(kind, tp=2)[0], {}
        else:  # a converted checkpoint, served with no quantization flag
            key, model, kwargs = f"gpu-{kind}-converted-mixed", self.converted_mixed(kind), {}
        if parallel is None:
            return key, model, kwargs
        return f"{key}-{parallel}", model, {**kwargs, **PARALLEL[parallel]}

    def start(self, kind: str, quant: str, parallel: str | None) -> None:
        self.engine.start(*self.spec(kind, quant, parallel))

    def get(self, kind: str, quant: str, parallel: str | None) -> dict:
        return self.engine(*self.spec(kind, quant, parallel))


@pytest.fixture(scope="session")
def parallel_engines(request, engine, tiny, converted_mixed, rotated):
    engines = ParallelEngines(engine, tiny, converted_mixed, rotated)
    wanted = [item.callspec.params for item in request.session.items
              if getattr(item, "originalname", None) == "test_gpu_parallel_matches_tp1" and hasattr(item, "callspec")]
    for p in wanted:  # the TP=1 references first: every parallel test waits for one
        engines.start(p["kind"], p["quant"], None)
    for p in wanted:
        engines.start(p["kind"], p["quant"], p["parallel"])
    return engines


def _kbit(layers: dict) -> dict:
    return {name: info for name, info in layers.items() if "bits" in info}


def _describe(rank: int, layers: dict) -> str:
    kbit = _kbit(layers)
    experts = {n: i["params"]["w13_qweight"][1][0] for n, i in kbit.items() if "w13_qweight" in i["params"]}
    bits = sorted({i["bits"] for i in kbit.values()})
    return (f"rank {rank}: {len(layers)} linear/MoE layers, {len(kbit)} kbit (bits {bits}), "
            f"local experts per MoE layer {sorted(set(experts.values()))}")


@TWO_GPUS
@pytest.mark.parametrize("parallel", list(PARALLEL))
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("kind", ["qwen3_moe", "glm4_moe"])
def test_gpu_parallel_matches_tp1(parallel_engines, kind, quant, parallel):
    """TP=2 (and TP=2 with expert parallel) against TP=1: each rank holds its share of every kbit layer with
    the same method and bits, and the outputs agree like two runs of one engine (assert_agree: the all-reduce
    sums the halves in another order, so bf16 noise, and router near-ties can flip an expert). Where the
    free-running greedy tokens differ, the first differing position of each prompt is printed."""
    what = f"GPU {kind} {quant} {parallel} vs TP1"
    tp1 = parallel_engines.get(kind, quant, None)
    got = parallel_engines.get(kind, quant, parallel)
    ranks = got["layers_per_rank"]
    for r, layers in enumerate(ranks):
        print(f"{what}: {_describe(r, layers)}")
    assert len(ranks) == 2
    ref = _kbit(tp1["layers"])
    assert ref, "no kbit layer in the TP=1 model"
    if quant == "converted-mixed":
        for name, info in tp1["layers"].items():
            if name.endswith("mlp.experts"):
                assert (info["method"], info["bits"]) == ("KbitMoEMethod", 3), (name, info)
            elif ".self_attn." in name:
                assert (info["method"], info["bits"]) == ("KbitLinearMethod", 5), (name, info)
    if quant == "converted-rotated":
        for layers in (tp1["layers"], *ranks):
            assert_rotated(what, {"layers": layers})
    expert_parallel = PARALLEL[parallel].get("enable_expert_parallel", False)
    for r, layers in enumerate(ranks):
        assert set(layers) == set(tp1["layers"]), f"rank {r} has other layers than TP=1"
        for name, info in ref.items():
            mine = layers[name]
            assert (mine["method"], mine["bits"]) == (info["method"], info["bits"]), (r, name, mine["method"], info["method"])
            if "w13_qweight" in info["params"]:  # routed experts: [E, ...] runtime tiles
                for p in ("w13_qweight", "w2_qweight"):
                    full, part = info["params"][p][1], mine["params"][p][1]
                    if expert_parallel:  # whole experts, half of them per rank
                        assert part[0] * 2 == full[0] and part[1:] == full[1:], (r, name, p, part, full)
                    else:  # every expert, sharded along its intermediate size
                        assert part[0] == full[0], (r, name, p, part, full)
            elif name.endswith("self_attn.qkv_proj"):  # column parallel: half the 64-row tiles
                assert mine["params"]["qweight"][1][0] * 2 == info["params"]["qweight"][1][0], (r, name)
    for name in ref:
        if name.endswith("mlp.experts"):
            assert ranks[0][name]["hash"] != ranks[1][name]["hash"], f"both ranks hold the same experts of {name}"
    report_token_differences(what, got, tp1)
    assert_agree(what, got, tp1)
