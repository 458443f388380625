"""Chunk height of the grouped MoE MMA: time gate_up + down at every chunk height for each T.

fused_moe's grouped MMA path cuts each expert's rows into chunks of 8p rows (8, 16, 32 or 64) and one
CTA row decodes the expert's weights once per chunk. A height below an expert's row count decodes its
weights again for every further chunk; a height above it multiplies padding rows. This sweep times the
two grouped projections (torch.ops.kbit._moe_route + _moe_grouped_linear, gate_up then down) at each
height, COLD (weight copies rotated past 4x the L2), CUDA-graph replay, with the random top-k routing
of bench_kernels.py, so the rule in csrc (moe_mma_chunk_rows) can be checked against it.

    python benchmarks/sweep_moe_chunk_rows.py --out DIR [--layers qwen3_30b_moe,glm45_air_moe] [--bits 2,3,4,5]

Writes DIR/sweep_moe_chunk_rows_<gpu>_<date>.{md,json}.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import vllm_kbit  # noqa: E402,F401  (loads the extension)
from bench_linear import graph_time_us  # noqa: E402
from bench_moe import kbit_bytes, random_stacked  # noqa: E402
from vllm_kbit import reference as fmt  # noqa: E402

LAYERS = {"qwen3_30b_moe": (128, 8, 2048, 768), "glm45_air_moe": (128, 8, 4096, 1408)}  # E, top_k, H, I
TS = (16, 32, 64, 128, 256, 512, 1024)
HEIGHTS = (8, 16, 32, 64)
ROUTINGS = 4


def routing(T: int, E: int, top_k: int) -> torch.Tensor:
    """Top-k of random router scores, int32 [T * top_k] (bench_kernels.py's routing)."""
    return torch.topk(torch.randn(T, E, device="cuda"), top_k, dim=1).indices.to(torch.int32).flatten()


def run_meta(commit: str | None) -> tuple[str, int, str, str]:
    """(GPU name, L2 bytes, commit (given, else git's HEAD), UTC date) of a sweep; seeds torch."""
    torch.manual_seed(0)
    commit = commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                      text=True).stdout.strip()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    return torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).L2_cache_size, commit, date


def save_records(out: str, name: str, gpu: str, date: str, commit: str, records: list) -> tuple[str, str]:
    """Writes <out>/<name>_<gpu>_<date>.json ({gpu, date, commit, command, records}); returns (path stem,
    the command line that ran)."""
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, f"{name}_{gpu.replace(' ', '_')}_{date}")
    command = f"python benchmarks/{name}.py " + " ".join(sys.argv[1:])
    with open(stem + ".json", "w") as f:
        json.dump(dict(gpu=gpu, date=date, commit=commit, command=command, records=records), f, indent=1)
    return stem, command


def emit(records: list, rec: dict) -> None:
    """Keeps one measurement and prints it as a JSON line (progress of a long sweep)."""
    records.append(rec)
    print(json.dumps(rec), flush=True)


def us_cell(us: float, best: float) -> str:
    """A table cell of µs, bold where it is the row's best."""
    return f"**{us:.1f}**" if us == best else f"{us:.1f}"


def write_md(stem: str, lines: list) -> None:
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines))
    print("wrote", stem + ".md")


def expert_copies(layer: str, k: int, l2: int) -> tuple[torch.Tensor, list]:
    """The layer's k-bit codebook and enough copies of random stacked experts (w13 qweight, absmax, w2
    qweight, absmax) that cycling through them reads past 4x the L2 (COLD)."""
    E, _, H, I = LAYERS[layer]
    expert_bytes = kbit_bytes(2 * I, H, k) + kbit_bytes(H, I, k)
    n_copies = max(2, math.ceil(4 * l2 / (E * expert_bytes)) + 1)
    return fmt.normal_float_codebook(k, "cuda"), [(*random_stacked(E, 2 * I, H, k), *random_stacked(E, H, I, k))
                                                   for _ in range(n_copies)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--layers", default=",".join(LAYERS))
    ap.add_argument("--bits", default="2,3,4,5")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    gpu, l2, commit, date = run_meta(args.commit)
    records = []
    for layer in args.layers.split(","):
        E, top_k, H, I = LAYERS[layer]
        for k in (int(b) for b in args.bits.split(",")):
            cb, W = expert_copies(layer, k, l2)
            n_copies = len(W)
            for T in TS:
                S = T * top_k
                a1 = torch.randn(S, H, device="cuda", dtype=torch.bfloat16)
                a2 = torch.randn(S, I, device="cuda", dtype=torch.bfloat16)
                ids = [routing(T, E, top_k) for _ in range(ROUTINGS)]
                for rows in HEIGHTS:
                    G = torch.ops.kbit._moe_max_chunks(S, E, rows)
                    routes = [torch.ops.kbit._moe_route(i, None, E, rows, G) for i in ids]
                    chunks = statistics.mean(int(r[4][0]) for r in routes)

                    def call(w, r, rows=rows):
                        torch.ops.kbit._moe_grouped_linear(a1, r[3], r[4], w[0], w[1], cb, 2 * I, H, rows)
                        torch.ops.kbit._moe_grouped_linear(a2, r[3], r[4], w[2], w[3], cb, H, I, rows)

                    fns = [lambda w=W[i % n_copies], r=routes[i % ROUTINGS]: call(w, r)
                           for i in range(max(n_copies, ROUTINGS))]
                    us = graph_time_us(fns, min_calls=20 if T <= 256 else 8, replays=10)
                    rec = dict(layer=layer, k=k, T=T, rows=rows, us=round(us, 2), chunks=chunks,
                               rows_per_expert=S / E)
                    emit(records, rec)
            del W
            torch.cuda.empty_cache()
    stem, command = save_records(args.out, "sweep_moe_chunk_rows", gpu, date, commit, records)
    lines = [f"# Grouped MoE MMA chunk height: {gpu}, {date}, commit {commit}", "",
             f"`{command}`. gate_up + down grouped projections (no routing, gather, activation or combine), "
             "COLD, CUDA-graph replay, µs; chunks = mean chunks per call; best height in bold.", ""]
    for layer in args.layers.split(","):
        lines += [f"## {layer}", "", "| k | T | rows/expert | " + " | ".join(f"{h} rows µs (chunks)" for h in HEIGHTS)
                  + " |", "| ---: | ---: | ---: |" + " ---: |" * len(HEIGHTS)]
        for k in sorted({r["k"] for r in records if r["layer"] == layer}):
            for T in TS:
                rs = [r for r in records if r["layer"] == layer and r["k"] == k and r["T"] == T]
                if not rs:
                    continue
                best = min(r["us"] for r in rs)
                cells = [us_cell(r["us"], best) + f" ({r['chunks']:.0f})"
                         for r in rs]
                lines.append(f"| {k} | {T} | {rs[0]['rows_per_expert']:.0f} | " + " | ".join(cells) + " |")
        lines.append("")
    write_md(stem, lines)


if __name__ == "__main__":
    main()
