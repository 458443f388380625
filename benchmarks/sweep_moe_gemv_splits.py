"""K splits of the direct MoE GEMV (few slots): time the whole fused_moe call at every split count of
gate_up (down on the heuristic) and of down (gate_up on the heuristic), for T = 1 and 2.

The direct GEMV launches slots x n-tiles x splits CTAs (clusters of `splits` sum one n-tile's K
halves). More splits give more CTAs and bytes in flight, but fewer k-tiles per warp (no software
pipeline left below two) and one more cluster reduction; the heuristic (kbit::_gemv_splits) picks one
count per projection from the grid alone. This sweep forces each count through VLLM_KBIT_MOE_GEMV_SPLITS,
COLD (weight copies rotated past 4x the L2), CUDA-graph replay, random top-k routing, so the rule can
be checked against it.

    python benchmarks/sweep_moe_gemv_splits.py --out DIR [--layers qwen3_30b_moe,glm45_air_moe] [--bits 2,4]

Writes DIR/sweep_moe_gemv_splits_<gpu>_<date>.{md,json}.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import vllm_kbit  # noqa: E402,F401  (loads the extension)
from bench_kernels import routing  # noqa: E402
from bench_linear import graph_time_us  # noqa: E402
from sweep_moe_chunk_rows import LAYERS, emit, expert_copies, run_meta, save_records, us_cell, write_md  # noqa: E402

from vllm_kbit.moe import kbit_fused_moe  # noqa: E402

TS = (1, 2)
SPLITS = (1, 2, 3, 4, 6, 8)
ROUTINGS = 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--layers", default=",".join(LAYERS))
    ap.add_argument("--bits", default="2,4")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    gpu, l2, commit, date = run_meta(args.commit)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    records = []
    for layer in args.layers.split(","):
        E, top_k, H, I = LAYERS[layer]
        for k in (int(b) for b in args.bits.split(",")):
            cb, W = expert_copies(layer, k, l2)
            # (n-tiles, k-tiles) of each projection: dims 1 and 2 of its stacked runtime qweight
            tiles = {"gate_up": tuple(W[0][0].shape[1:3]), "down": tuple(W[0][2].shape[1:3])}
            for T in TS:
                S = T * top_k
                x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
                routes = [routing(T, E, top_k) for _ in range(ROUTINGS)]
                auto = {s: torch.ops.kbit._gemv_splits(S * n, kt, sms) for s, (n, kt) in tiles.items()}
                configs = [("auto", 0, 0)] + [("gate_up", s, 0) for s in SPLITS if s <= tiles["gate_up"][1]] + \
                          [("down", 0, s) for s in SPLITS if s <= tiles["down"][1]]
                for stage, g, d in configs:
                    os.environ["VLLM_KBIT_MOE_GEMV_SPLITS"] = f"{g},{d}"
                    fns = [lambda w=W[i % len(W)], r=routes[i % ROUTINGS]: kbit_fused_moe(x, r[0], r[1], *w, cb, I)
                           for i in range(max(len(W), ROUTINGS))]
                    us = graph_time_us(fns, min_calls=40, replays=10)
                    rec = dict(layer=layer, k=k, T=T, stage=stage, splits=g or d, auto_gate_up=auto["gate_up"],
                               auto_down=auto["down"], us=round(us, 2))
                    emit(records, rec)
                os.environ.pop("VLLM_KBIT_MOE_GEMV_SPLITS")
            del W
            torch.cuda.empty_cache()
    stem, command = save_records(args.out, "sweep_moe_gemv_splits", gpu, date, commit, records)
    lines = [f"# Direct MoE GEMV K splits: {gpu}, {date}, commit {commit}", "",
             f"`{command}`. Whole fused_moe call (two launches), COLD, CUDA-graph replay, µs; one projection's "
             "split count forced, the other on the heuristic; (auto) marks the heuristic's count.", ""]
    for layer in args.layers.split(","):
        lines += [f"## {layer}", "", "| k | T | heuristic µs | projection | " + " | ".join(f"{s} splits" for s in SPLITS)
                  + " |", "| ---: | ---: | ---: | --- |" + " ---: |" * len(SPLITS)]
        for k in sorted({r["k"] for r in records if r["layer"] == layer}):
            for T in TS:
                rs = [r for r in records if r["layer"] == layer and r["k"] == k and r["T"] == T]
                base = [r for r in rs if r["stage"] == "auto"][0]
                for stage in ("gate_up", "down"):
                    cells = {r["splits"]: r["us"] for r in rs if r["stage"] == stage}
                    best = min(cells.values())
                    mark = base[f"auto_{stage}"]
                    row = [us_cell(cells[s], best) + (" (auto)" if s == mark else "") if s in cells else "-"
                           for s in SPLITS]
                    lines.append(f"| {k} | {T} | {base['us']:.1f} | {stage} | " + " | ".join(row) + " |")
        lines.append("")
    write_md(stem, lines)


if __name__ == "__main__":
    main()
