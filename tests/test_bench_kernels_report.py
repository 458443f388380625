"""benchmarks/bench_kernels.py's report on a synthetic run (CPU): ratio columns computed from the records,
missing measurements and null fields shown as '-', the ncu table, and the plot."""

import json
import os

import pytest

from kbit_dev import benchmarks


def _load():
    return benchmarks.load("bench_kernels")


def _moe(impl, k, T, us, floor_us=None, inst=None, kernels=None):
    rec = dict(layer="qwen3_30b_moe", impl=impl, k=k, T=T, N=1536, K=2048, regime="cold", us=us, floor_us=floor_us,
               inst_per_weight=inst, E=128, top_k=8, I=768, H=2048)
    if kernels is not None:
        rec["kernels"] = kernels
    return rec


def _dense(impl, k, M, us, floor_us=None):
    return dict(layer="llama70b_gate_up", impl=impl, k=k, T=M, N=28672, K=8192, regime="cold", us=us,
                floor_us=floor_us, inst_per_weight=None)


RECORDS = [
    # MoE T=16: every impl; kbit-4 carries the floor and an ncu count
    _moe("kbit", 2, 16, 8.0, 3.0),
    _moe("kbit", 3, 16, 9.0, 4.0),
    _moe("kbit", 4, 16, 10.0, 5.0, inst=1.25,
         kernels=[{"name": "void kbit::moe_gemv<4>(int const*, float)", "inst": 1.0e6, "inst_per_weight": 1.0},
                  {"name": "kbit::route", "inst": 2.5e5, "inst_per_weight": 0.25}]),
    _moe("kbit", 5, 16, 11.0, 6.0),
    _moe("marlin_int4", None, 16, 13.0, 7.0),
    _moe("triton_bf16", None, 16, 40.0, 20.0),
    _moe("humming", 3, 16, 12.0, 4.5),
    _moe("humming", 4, 16, 11.0, 5.5),
    # MoE T=1: no Marlin record and no kbit-2 -> '-' in the ratios that need them
    _moe("kbit", 4, 1, 6.0, 2.4),
    _moe("triton_bf16", None, 1, 30.0),
    # dense M=16: kbit-2 and kbit-4 only
    _dense("kbit", 2, 16, 30.0, 20.0),
    _dense("kbit", 4, 16, 50.0, 40.0),
    _dense("marlin_int4", None, 16, 60.0, 45.0),
    _dense("cublas_bf16", None, 16, 200.0, 150.0),
]


@pytest.fixture
def run_json(tmp_path):
    data = dict(gpu="Test GPU", date="2026-11-24", commit="abc1234", command="python benchmarks/bench_kernels.py",
                copy_GBps=3000.0, records=RECORDS,
                errors=[dict(layer="qkv", impl="marlin_int4", k=None, T=None, error="ImportError: no vllm")])
    path = tmp_path / "kernels_Test_GPU_2026-11-24.json"
    path.write_text(json.dumps(data))
    return str(path)


def _table_row(md, layer, T):
    """The cells of row T of the layer's table, keyed by the header."""
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"## {layer}"))
    table = [line for line in lines[start + 1:] if line.startswith("|")][: 2 + 20]
    split = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]  # noqa: E731
    head = split(table[0])
    for line in table[2:]:
        cells = split(line)
        if cells[0] == str(T):
            return dict(zip(head, cells))
    raise AssertionError(f"no row T={T} in {layer}")


def test_report_writes_the_ratios_from_the_records(run_json):
    mod = _load()
    md_path, _ = mod.report(run_json)
    assert md_path == run_json[: -len(".json")] + ".md"
    md = open(md_path).read()
    assert "Test GPU" in md and "abc1234" in md and "3000.0 GB/s" in md and "`python benchmarks/bench_kernels.py`" in md

    row = _table_row(md, "qwen3_30b_moe", 16)
    assert row["kbit-2 µs"] == "8.00" and row["kbit-4 µs"] == "10.0" and row["marlin int4 µs"] == "13.0"
    assert row["triton bf16 µs"] == "40.0"
    assert row["kbit-4 vs marlin"] == f"{13.0 / 10.0:.2f}"
    assert row["kbit-3 vs marlin"] == f"{13.0 / 9.0:.2f}"
    assert row["kbit-2 vs marlin"] == f"{13.0 / 8.0:.2f}"
    assert row["k2/k4"] == f"{8.0 / 10.0:.2f}"
    assert row["kbit-4 % of floor"] == "50%"
    assert row["humming-3 µs"] == "12.0" and row["humming-4 µs"] == "11.0" and "humming-2 µs" not in row
    assert row["kbit-3 vs humming-3"] == f"{12.0 / 9.0:.2f}" and row["kbit-4 vs humming-4"] == f"{11.0 / 10.0:.2f}"

    row = _table_row(md, "qwen3_30b_moe", 1)  # no Marlin, no kbit-2/3/5, no humming at T=1
    assert row["marlin int4 µs"] == "-" and row["kbit-2 µs"] == "-" and row["kbit-4 vs humming-4"] == "-"
    assert row["kbit-4 vs marlin"] == "-" and row["k2/k4"] == "-"
    assert row["kbit-4 % of floor"] == f"{100 * 2.4 / 6.0:.0f}%"

    row = _table_row(md, "llama70b_gate_up", 16)
    assert "triton bf16 µs" not in row and row["cuBLAS bf16 µs"] == "200.0"
    assert "kbit-3 µs" not in row  # only the measured k get a column
    assert row["kbit-4 vs marlin"] == f"{60.0 / 50.0:.2f}"
    assert row["kbit-2 vs marlin"] == f"{60.0 / 30.0:.2f}"
    assert row["kbit-3 vs marlin"] == "-"
    assert row["k2/k4"] == f"{30.0 / 50.0:.2f}"
    assert row["kbit-4 % of floor"] == "80%"

    # the ncu table: only the record with a count, kernel names shortened
    ncu = md[md.index("## Instructions per weight"):]
    assert "| qwen3_30b_moe | kbit | 4 | 16 | 1.25 |" in ncu
    assert "kbit::moe_gemv 1" in ncu and "kbit::route 0.25" in ncu
    assert "marlin_int4 | - |" not in ncu
    assert "qkv marlin_int4 k=- T=-: ImportError: no vllm" in md


def test_report_draws_the_plot(run_json):
    pytest.importorskip("matplotlib")
    _, png = _load().report(run_json)
    assert png == run_json[: -len(".json")] + ".png"
    assert os.path.getsize(png) > 1000


def test_ncu_csv_parsing_splits_the_calls_at_the_markers():
    mod = _load()
    header = '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Metric Name","Metric Unit","Metric Value"'
    rows = [
        '"0","1","python","h","at::cuda::(anonymous namespace)::spin_kernel(long)","1","7","smsp__inst_executed.sum","inst","12"',
        '"1","1","python","h","void kbit::gemv<4>(int, float)","1","7","smsp__inst_executed.sum","inst","1,000,000"',
        '"2","1","python","h","at::cuda::(anonymous namespace)::spin_kernel(long)","1","7","smsp__inst_executed.sum","inst","12"',
        '"3","1","python","h","Marlin<1, 2>(int const*)","1","7","smsp__inst_executed.sum","Kinst","2,500"',
        '"4","1","python","h","moe_sum_kernel","1","7","smsp__inst_executed.sum","inst","n/a"',
    ]
    text = "==PROF== Connected to process 1\n" + "\n".join([header] + rows) + "\n==PROF== Disconnected\n"
    groups = mod.split_at_markers(mod.parse_ncu_csv(text))
    assert groups == [[("void kbit::gemv<4>(int, float)", 1e6)], [("Marlin<1, 2>(int const*)", 2.5e6)]]
    rec = {}
    mod.attach_ncu(rec, groups[1], 1_000_000)
    assert rec["inst_per_weight"] == 80.0 and rec["kernels"][0]["inst"] == 2.5e6
