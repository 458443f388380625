"""LoadReport, the load's summary line, without an engine (the end-to-end tests check it on real loads)."""

from __future__ import annotations

import copy
import pickle

import torch

from vllm_kbit import ops
from vllm_kbit.vllm import load_report
from vllm_kbit.vllm.load_report import EXPERTS, K_NOT_MULTIPLE, LINEAR, NOT_REPRESENTABLE, SKIPPED, LoadReport


def _packed(n: int, k_in: int, bits: int) -> list[torch.Tensor]:
    """Flat kbit tensors of an [n, k_in] weight: n * k_in * bits / 8 + n * k_in / 32 bytes."""
    return [torch.zeros(n, k_in // 32, bits, dtype=torch.int32), torch.zeros(n, k_in // 32, dtype=torch.uint8)]


def _capture(monkeypatch) -> list[str]:
    lines: list[str] = []
    monkeypatch.setattr(load_report.logger, "info", lambda fmt, *args: lines.append(fmt % args))
    return lines


def test_one_line_once_the_last_planned_layer_is_processed(monkeypatch):
    lines = _capture(monkeypatch)
    report = LoadReport()
    dense, attn, experts, odd, skipped_gate, skipped_experts = (torch.nn.Module() for _ in range(6))
    for layer in (dense, attn, experts, odd):
        report.plan(layer)
    report.leave(skipped_gate, LINEAR, SKIPPED)
    report.leave(skipped_experts, EXPERTS, SKIPPED)
    report.finish(dense, LINEAR, 4, 1024 * 2048 * 2, torch.bfloat16, _packed(1024, 2048, 4))
    report.finish(attn, LINEAR, 5, 1024 * 2048 * 2, torch.bfloat16, _packed(1024, 2048, 5))
    report.finish_unquantized(odd, LINEAR, NOT_REPRESENTABLE)
    assert lines == []  # the experts are still pending
    report.finish(experts, EXPERTS, 4, 2 * 1024 * 2048 * 2, torch.bfloat16, _packed(2048, 2048, 4))
    assert len(lines) == 1
    line = lines[0]
    before, after = 4 * 1024 * 2048 * 2, 1024 * 2048 * (4 + 5 + 2 * 4) // 8 + 4 * 1024 * 2048 // 32
    assert line.startswith(
        "kbit: quantized 2 linear layers and 1 routed-expert block to bits 4 (2 layers), 5 (1 layer): "
        f"weights {before / 2**30:.4f} GiB in bf16 -> {after / 2**30:.5f} GiB; "
        "left unquantized: 2 linear layers and 1 routed-expert block (modules_to_not_convert: 2, "
        "weights not representable: 1)"
    ), line
    assert ("VLLM_KBIT_CPU_DECODE_CACHE=0" in line) == ops.CPU_DECODE_CACHE
    assert skipped_gate.kbit_left_unquantized == SKIPPED and odd.kbit_left_unquantized == NOT_REPRESENTABLE
    # Processed again (a weight reload): not counted, no second line.
    report.finish(dense, LINEAR, 4, 1024 * 2048 * 2, torch.bfloat16, _packed(1024, 2048, 4))
    assert len(lines) == 1


def test_a_second_model_gets_a_line_of_its_own(monkeypatch):
    """A draft model built with the same config after the main model loaded: its own counts."""
    lines = _capture(monkeypatch)
    report = LoadReport()
    main, draft, draft_odd = torch.nn.Module(), torch.nn.Module(), torch.nn.Module()
    report.plan(main)
    report.finish(main, LINEAR, 4, 64 * 64 * 2, torch.bfloat16, _packed(64, 64, 4))
    report.leave(draft_odd, LINEAR, K_NOT_MULTIPLE)
    report.plan(draft)
    report.finish(draft, LINEAR, 3, 64 * 64 * 2, torch.float16, _packed(64, 64, 3))
    assert len(lines) == 2
    assert "quantized 1 linear layer and 0 routed-expert blocks to 4 bits" in lines[0]
    assert "left unquantized: none" in lines[0]
    assert "to 3 bits" in lines[1] and "in fp16" in lines[1]
    assert "left unquantized: 1 linear layer (K not a multiple of 32: 1)" in lines[1]


def test_a_copied_or_pickled_report_starts_empty():
    """vLLM pickles the config to its workers before the model exists: each process counts its own layers."""
    report = LoadReport()
    layer = torch.nn.Module()
    report.plan(layer)
    report.leave(torch.nn.Module(), LINEAR, SKIPPED)
    for other in (pickle.loads(pickle.dumps(report)), copy.deepcopy(report)):
        assert len(other._pending) == 0 and other.left == {} and other.quantized == {LINEAR: 0, EXPERTS: 0}


def test_range_scaled_layers_are_counted_and_named(monkeypatch):
    lines = _capture(monkeypatch)
    report = LoadReport()
    layers = [torch.nn.Module() for _ in range(6)]
    for layer in layers:
        report.plan(layer)
    report.finish(layers[0], LINEAR, 4, 64 * 64 * 2, torch.bfloat16, _packed(64, 64, 4))
    for i, layer in enumerate(layers[1:5]):
        report.finish(layer, LINEAR, 4, 64 * 64 * 2, torch.bfloat16, _packed(64, 64, 4), range_scaled=f"model.l{i}")
    report.finish(layers[5], EXPERTS, 4, 64 * 64 * 2, torch.bfloat16, _packed(64, 64, 4), range_scaled="model.experts")
    assert len(lines) == 1
    assert "; range-scaled (max |w| outside [2^-4, 31]): 5 (model.l0, model.l1, model.l2 and 2 more)" in lines[0], lines[0]
    # A load with none says nothing about it.
    report.plan(layers[0])
    report.finish(layers[0], LINEAR, 4, 64 * 64 * 2, torch.bfloat16, _packed(64, 64, 4))
    assert "range-scaled" not in lines[1]
