"""Grid of the grouped MoE MMA: K splits and row groups per warp, per projection, against the rules.

At a few dozen tokens a routed-expert projection is a few hundred CTAs, about one wave of the GPU,
so how each call is cut into CTAs (row groups per warp r: 64 or 256 weight rows per CTA; K splits s:
CTAs per column summed through a cluster) decides how full the last wave is. This sweep times the
gate_up and the down projection (torch.ops.kbit._moe_grouped_linear, at the chunk height
moe_mma_chunk_rows picks) separately at every s in --splits and r in {1, wide}, beside the rules'
choice (s = 0, r = 0), COLD (weight copies rotated past 4x the L2), CUDA-graph replay, with the random
top-k routing of bench_kernels.py.

    python benchmarks/sweep_moe_grid.py --out DIR [--layers qwen3_30b_moe,glm45_air_moe] [--bits 2,3,4,5]
        [--tokens 4,16,64] [--splits 1,2,3,4]

Writes DIR/sweep_moe_grid_<gpu>_<date>.{md,json}.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import vllm_kbit  # noqa: E402,F401  (loads the extension)
from bench_linear import graph_time_us  # noqa: E402
from sweep_moe_chunk_rows import (LAYERS, emit, expert_copies, routing, run_meta, save_records, us_cell,  # noqa: E402
                                  write_md)

TS = (4, 16, 32, 64, 128, 256)
SPLITS = (1, 2, 3, 4)
ROUTINGS = 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--layers", default=",".join(LAYERS))
    ap.add_argument("--bits", default="2,3,4,5")
    ap.add_argument("--tokens", default=",".join(map(str, TS)))
    ap.add_argument("--splits", default=",".join(map(str, SPLITS)), help="forced K split counts besides the rule")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    gpu, l2, commit, date = run_meta(args.commit)
    splits = [int(s) for s in args.splits.split(",")]
    records = []
    for layer in args.layers.split(","):
        E, top_k, H, I = LAYERS[layer]
        for k in (int(b) for b in args.bits.split(",")):
            cb, W = expert_copies(layer, k, l2)
            n_copies = len(W)
            for T in (int(t) for t in args.tokens.split(",")):
                S = T * top_k
                _, rows, G = torch.ops.kbit.moe_plan(T, top_k, E, k, "grouped_mma")
                ids = [routing(T, E, top_k) for _ in range(ROUTINGS)]
                routes = [torch.ops.kbit._moe_route(i, None, E, rows, G) for i in ids]
                chunks = statistics.mean(int(r[4][0]) for r in routes)
                wide = 2 if rows == 64 else 4
                for proj, (N, K, wi) in {"gate_up": (2 * I, H, 0), "down": (H, I, 2)}.items():
                    a = torch.randn(S, K, device="cuda", dtype=torch.bfloat16)
                    k_tiles = K // 128
                    for r in (0, 1, wide):
                        for s in [0] + splits:
                            if s > min(8, k_tiles) or (r == 0) != (s == 0):
                                continue  # the rules' point is (0, 0); forced points force both
                            fns = [lambda w=W[i % n_copies], rt=routes[i % ROUTINGS], s=s, r=r:
                                   torch.ops.kbit._moe_grouped_linear(a, rt[3], rt[4], w[wi], w[wi + 1], cb, N, K, rows, s, r)
                                   for i in range(max(n_copies, ROUTINGS))]
                            us = graph_time_us(fns, min_calls=20, replays=10)
                            rec = dict(layer=layer, k=k, T=T, proj=proj, rows=rows, r=r, splits=s, us=round(us, 2),
                                       chunks=chunks)
                            emit(records, rec)
            del W
            torch.cuda.empty_cache()
    stem, command = save_records(args.out, "sweep_moe_grid", gpu, date, commit, records)
    lines = [f"# Grouped MoE MMA grid (K splits s, row groups per warp r): {gpu}, {date}, commit {commit}", "",
             f"`{command}`. One grouped projection, COLD, CUDA-graph replay, µs; `rule` = the launcher's own "
             "choice; best in bold.", ""]
    for layer in args.layers.split(","):
        rs_l = [r for r in records if r["layer"] == layer]
        cols = sorted({(r["r"], r["splits"]) for r in rs_l if r["r"]})
        lines += [f"## {layer}", "", "| k | T | proj | rows | chunks | rule µs | " +
                  " | ".join(f"r={r} s={s}" for r, s in cols) + " |", "| ---: | ---: | --- | ---: | ---: | ---: |" +
                  " ---: |" * len(cols)]
        for key in sorted({(r["k"], r["T"], r["proj"]) for r in rs_l}):
            rs = [r for r in rs_l if (r["k"], r["T"], r["proj"]) == key]
            best = min(r["us"] for r in rs)
            cell = {(r["r"], r["splits"]): us_cell(r["us"], best) for r in rs}
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {rs[0]['rows']} | {rs[0]['chunks']:.0f} | "
                         f"{cell.get((0, 0), '-')} | " + " | ".join(cell.get(c, "-") for c in cols) + " |")
        lines.append("")
    write_md(stem, lines)


if __name__ == "__main__":
    main()
