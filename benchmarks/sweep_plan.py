"""One sweep over the planner's fields (csrc/plan/plan.h): time a kernel at every value of one field of its plan,
forced, beside the planner's own choice, COLD (weight copies rotated past the L2), CUDA-graph replay. Each field
is a subcommand; each writes <out>/<stem>_<gpu>_<date>.{json,md} (the stems the results index cites):

    python benchmarks/sweep_plan.py dense_splits [--kernel mma|gemv] [--shapes qkv,o,...|all] [--m 8,16]
        K splits of the dense MMA (at both row-group widths r) or GEMV (M = 1..4), through kbit::_linear_forced:
        the data for gemv_splits / mma_splits. Stem sweep_<kernel>_splits.
    python benchmarks/sweep_plan.py dense_paths [--shapes ...] [--bits 2,3,4,5] [--m 1,2] [--report JSON]
        The dense path at few rows: the GEMV against the MMA kernel, each at the planner's splits (kGemvPathMaxM);
        outputs checked against x @ dequantize_runtime(W)^T first. Stem dense_paths.
    python benchmarks/sweep_plan.py moe_chunk_rows [--layers qwen3_30b_moe,glm45_air_moe] [--bits 2,3,4,5]
        The grouped MoE MMA's chunk height (8, 16, 32, 64 rows; moe_mma_chunk_rows) per T: gate_up + down through
        kbit::_moe_route + kbit::_moe_grouped_linear. Stem sweep_moe_chunk_rows.
    python benchmarks/sweep_plan.py moe_grid [--layers ...] [--bits ...] [--tokens 4,16,64] [--splits 1,2,3,4]
        The grouped MoE MMA's K splits and row groups per warp per projection (mma_splits, mma_grouped_r), at
        the planner's chunk height. Stem sweep_moe_grid.
    python benchmarks/sweep_plan.py moe_gemv_splits [--layers ...] [--bits 2,4]
        The direct MoE GEMV's K splits per projection (gemv_splits with its per-CTA overhead), whole fused_moe
        calls with VLLM_KBIT_MOE_GEMV_SPLITS forcing one projection's count. Stem sweep_moe_gemv_splits.

Common options: --out DIR (default benchmarks/results), --commit SHA.
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
from bench_kernels import routing as topk_routing  # noqa: E402
from bench_linear import SHAPES, copies_for, graph_time_us, random_runtime_weight  # noqa: E402
from bench_moe import kbit_bytes, random_stacked  # noqa: E402
from vllm_kbit import reference as fmt  # noqa: E402
from vllm_kbit.moe import kbit_fused_moe  # noqa: E402


# ----------------------------------------------------------------------------- dense kernels: K splits and row groups


SPLITS_K_BITS = 4


def sweep_dense_splits(argv: list[str]) -> None:
    """dense_splits: the dense GEMV or MMA kernel at every K split count (and the MMA at both row-group widths)."""
    ap = argparse.ArgumentParser(prog="sweep_plan.py dense_splits")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--commit", default=os.environ.get("KBIT_COMMIT", "unknown"))
    ap.add_argument("--kernel", choices=("mma", "gemv"), default="mma")
    ap.add_argument("--shapes", default="qkv,o,gate_up,down,llama8b_gate_up,llama70b_gate_up",
                    help="comma-separated names of bench_linear.SHAPES, or 'all'")
    ap.add_argument("--m", help="default: 8,16,32,64 (mma), 1,2,4 (gemv)")
    args = ap.parse_args(argv)
    gemv = args.kernel == "gemv"
    ms = [int(m) for m in (args.m or ("1,2,4" if gemv else "8,16,32,64")).split(",")]

    props = torch.cuda.get_device_properties(0)
    gpu, l2 = props.name, props.L2_cache_size
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    op = torch.ops.kbit._linear_forced.default
    path = torch.ops.kbit._linear_path_id(args.kernel)
    records = []
    for name, K, N in (s for s in SHAPES if args.shapes == "all" or s[0] in args.shapes.split(",")):
        w0 = random_runtime_weight(N, K, SPLITS_K_BITS)
        nbytes = w0.qweight_rt.numel() * 4 + w0.absmax_rt.numel()
        ws = [w0] + [random_runtime_weight(N, K, SPLITS_K_BITS) for _ in range(copies_for(nbytes, "cold", l2) - 1)]
        n_tiles, k_tiles = w0.qweight_rt.shape[0], w0.qweight_rt.shape[1]
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            _, _, max_splits, p, r_auto, m_blocks = torch.ops.kbit.linear_plan(
                M, N, K, torch.bfloat16, props.major, props.multi_processor_count, 1, "gemv" if gemv else "mma")
            for r in [0] if gemv else sorted({1, r_auto}):
                ctas_per_split = n_tiles if gemv else -(-n_tiles // r) * m_blocks
                for s in range(0, max_splits + 1):  # 0: the heuristic's choice
                    if gemv:
                        fns = [lambda w=w, s=s: op(x, w.qweight_rt, w.absmax_rt, w.codebook, N, K, None, path, 0, s)
                               for w in ws]
                    else:
                        fns = [lambda w=w, s=s, r=r: op(x, w.qweight_rt, w.absmax_rt, w.codebook, N, K, None, path, r, s)
                               for w in ws]
                    us = graph_time_us(fns)
                    records.append(dict(gpu=gpu, commit=args.commit, date=date, kernel=args.kernel, shape=name, N=N, K=K,
                                        k=SPLITS_K_BITS, M=M, p=p, r=r, splits=s, ctas=ctas_per_split * s if s else None,
                                        us=round(us, 2)))
                    print(f"{name} M={M} r={r} S={s or 'auto'}: {us:.1f} us", flush=True)
            del x
        del ws, w0

    stem = os.path.join(args.out, f"sweep_{args.kernel}_splits_{gpu.replace(' ', '_')}_{date}")
    os.makedirs(args.out, exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump(records, f, indent=1)
    lines = [f"# {args.kernel.upper()} kernel split sweep: {gpu}, {date}, commit {args.commit}", "",
             f"COLD, k={SPLITS_K_BITS}, bf16, µs per call (CUDA-graph replay); `*` marks the fastest split count; auto = the "
             f"heuristic's ({args.kernel}_splits) launch.",
             f"Command: `python {' '.join(sys.argv)}`", "",
             "| shape | M | r | auto | " + " | ".join(f"S={s}" for s in range(1, 9)) + " |",
             "| --- | ---: | ---: | ---: |" + " ---: |" * 8]
    order = [s[0] for s in SHAPES]
    for shape, M, r in sorted({(x["shape"], x["M"], x["r"]) for x in records}, key=lambda t: (order.index(t[0]), t[1], t[2])):
        rows = {x["splits"]: x["us"] for x in records if (x["shape"], x["M"], x["r"]) == (shape, M, r)}
        best = min((s for s in rows if s > 0), key=rows.get)
        cells = [f"{rows[s]:.1f}{'*' if s == best else ''}" if s in rows else "" for s in range(0, 9)]
        lines.append(f"| {shape} | {M} | {r} | " + " | ".join(cells) + " |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


# ----------------------------------------------------------------------------- dense kernels: GEMV or MMA at few rows


PATHS_CHECK_TOL = 1e-2  # relative Frobenius error against the fp32 product of the dequantized weight


def dense_paths_measure(args) -> dict:
    props = torch.cuda.get_device_properties(0)
    op = torch.ops.kbit._linear_forced.default
    gemv, mma = torch.ops.kbit._linear_path_id("gemv"), torch.ops.kbit._linear_path_id("mma")
    shapes = {s[0]: s for s in SHAPES}
    rows = []
    for name in args.shapes.split(","):
        _, K, N = shapes[name]
        for k in (int(b) for b in args.bits.split(",")):
            w0 = random_runtime_weight(N, K, k)
            nbytes = w0.qweight_rt.numel() * 4 + w0.absmax_rt.numel()
            ws = [w0] + [random_runtime_weight(N, K, k) for _ in range(copies_for(nbytes, "cold", props.L2_cache_size) - 1)]
            deq = torch.ops.kbit.dequantize_runtime(w0.qweight_rt, w0.absmax_rt, w0.codebook, N, K, torch.float32)
            for M in (int(m) for m in args.m.split(",")):
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                ref = x.float() @ deq.T
                rec = dict(shape=name, K=K, N=N, k=k, M=M)
                for path, fn in (("gemv", lambda w: op(x, w.qweight_rt, w.absmax_rt, w.codebook, N, K, None, gemv, 0, 0)),
                                 ("mma", lambda w: op(x, w.qweight_rt, w.absmax_rt, w.codebook, N, K, None, mma, 0, 0))):
                    err = float((fn(w0).float() - ref).norm() / ref.norm())
                    if not err <= PATHS_CHECK_TOL:
                        raise RuntimeError(f"{name} k={k} M={M} {path}: relative error {err:.3g}")
                    rec[path] = round(graph_time_us([lambda w=w: fn(w) for w in ws]), 2)
                rows.append(rec)
                print(rec, flush=True)
            del ws, w0, deq
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    return dict(gpu=props.name, date=date, commit=args.commit, command="python " + " ".join(sys.argv), rows=rows)


def dense_paths_report(res: dict) -> str:
    lines = [f"# GEMV vs MMA at few rows: {res['gpu']}, {res['date']}, commit {res['commit']}", "",
             "COLD, bf16, µs per call (CUDA-graph replay), each kernel at its heuristic's split count; "
             "`mma / gemv` < 1: the MMA kernel is faster.", f"Command: `{res['command']}`", "",
             "| shape (K -> N) | k | M | GEMV µs | MMA µs | mma / gemv |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in res["rows"]:
        lines.append(f"| {r['shape']} ({r['K']} -> {r['N']}) | {r['k']} | {r['M']} | {r['gemv']:.2f} | {r['mma']:.2f} | "
                     f"{r['mma'] / r['gemv']:.2f} |")
    return "\n".join(lines) + "\n"


def sweep_dense_paths(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="sweep_plan.py dense_paths")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--commit", default=os.environ.get("KBIT_COMMIT", "unknown"))
    ap.add_argument("--shapes", default="qkv,o,gate_up,down,llama70b_gate_up", help="names of bench_linear.SHAPES")
    ap.add_argument("--bits", default="2,3,4,5")
    ap.add_argument("--m", default="1,2")
    ap.add_argument("--dense_paths_report", metavar="JSON", help="only rewrite the .md of an earlier run's JSON")
    args = ap.parse_args(argv)
    if args.report:
        with open(args.report) as f:
            res = json.load(f)
        stem = args.report[: -len(".json")]
    else:
        import vllm_kbit  # noqa: F401  (loads the extension's ops)
        res = dense_paths_measure(args)
        stem = os.path.join(args.out, f"dense_paths_{res['gpu'].replace(' ', '_')}_{res['date']}")
        os.makedirs(args.out, exist_ok=True)
        with open(stem + ".json", "w") as f:
            json.dump(res, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(dense_paths_report(res))


# ----------------------------------------------------------------------------- routed experts: chunk height (and the helpers the MoE sweeps share)


LAYERS = {"qwen3_30b_moe": (128, 8, 2048, 768), "glm45_air_moe": (128, 8, 4096, 1408)}  # E, top_k, H, I
CHUNK_TS = (16, 32, 64, 128, 256, 512, 1024)
HEIGHTS = (8, 16, 32, 64)
CHUNK_ROUTINGS = 4


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
    command = "python benchmarks/sweep_plan.py " + " ".join(sys.argv[1:])
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


def sweep_moe_chunk_rows(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="sweep_plan.py moe_chunk_rows")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--layers", default=",".join(LAYERS))
    ap.add_argument("--bits", default="2,3,4,5")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args(argv)
    gpu, l2, commit, date = run_meta(args.commit)
    records = []
    for layer in args.layers.split(","):
        E, top_k, H, I = LAYERS[layer]
        for k in (int(b) for b in args.bits.split(",")):
            cb, W = expert_copies(layer, k, l2)
            n_copies = len(W)
            for T in CHUNK_TS:
                S = T * top_k
                a1 = torch.randn(S, H, device="cuda", dtype=torch.bfloat16)
                a2 = torch.randn(S, I, device="cuda", dtype=torch.bfloat16)
                ids = [routing(T, E, top_k) for _ in range(CHUNK_ROUTINGS)]
                for rows in HEIGHTS:
                    G = torch.ops.kbit._moe_max_chunks(S, E, rows)
                    routes = [torch.ops.kbit._moe_route(i, None, E, rows, G) for i in ids]
                    chunks = statistics.mean(int(r[4][0]) for r in routes)

                    def call(w, r, rows=rows):
                        torch.ops.kbit._moe_grouped_linear(a1, r[3], r[4], w[0], w[1], cb, 2 * I, H, rows)
                        torch.ops.kbit._moe_grouped_linear(a2, r[3], r[4], w[2], w[3], cb, H, I, rows)

                    fns = [lambda w=W[i % n_copies], r=routes[i % CHUNK_ROUTINGS]: call(w, r)
                           for i in range(max(n_copies, CHUNK_ROUTINGS))]
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
            for T in CHUNK_TS:
                rs = [r for r in records if r["layer"] == layer and r["k"] == k and r["T"] == T]
                if not rs:
                    continue
                best = min(r["us"] for r in rs)
                cells = [us_cell(r["us"], best) + f" ({r['chunks']:.0f})"
                         for r in rs]
                lines.append(f"| {k} | {T} | {rs[0]['rows_per_expert']:.0f} | " + " | ".join(cells) + " |")
        lines.append("")
    write_md(stem, lines)


# ----------------------------------------------------------------------------- routed experts: grouped MMA K splits and row groups


GRID_TS = (4, 16, 32, 64, 128, 256)
GRID_SPLITS = (1, 2, 3, 4)
GRID_ROUTINGS = 4


def sweep_moe_grid(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="sweep_plan.py moe_grid")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--layers", default=",".join(LAYERS))
    ap.add_argument("--bits", default="2,3,4,5")
    ap.add_argument("--tokens", default=",".join(map(str, GRID_TS)))
    ap.add_argument("--splits", default=",".join(map(str, GRID_SPLITS)), help="forced K split counts besides the rule")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args(argv)
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
                ids = [routing(T, E, top_k) for _ in range(GRID_ROUTINGS)]
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
                            fns = [lambda w=W[i % n_copies], rt=routes[i % GRID_ROUTINGS], s=s, r=r:
                                   torch.ops.kbit._moe_grouped_linear(a, rt[3], rt[4], w[wi], w[wi + 1], cb, N, K, rows, s, r)
                                   for i in range(max(n_copies, GRID_ROUTINGS))]
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


# ----------------------------------------------------------------------------- routed experts: direct GEMV K splits


GEMV_TS = (1, 2)
GEMV_SPLITS = (1, 2, 3, 4, 6, 8)
GEMV_ROUTINGS = 4


def sweep_moe_gemv_splits(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="sweep_plan.py moe_gemv_splits")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--layers", default=",".join(LAYERS))
    ap.add_argument("--bits", default="2,4")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args(argv)
    gpu, l2, commit, date = run_meta(args.commit)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    records = []
    for layer in args.layers.split(","):
        E, top_k, H, I = LAYERS[layer]
        for k in (int(b) for b in args.bits.split(",")):
            cb, W = expert_copies(layer, k, l2)
            # (n-tiles, k-tiles) of each projection: dims 1 and 2 of its stacked runtime qweight
            tiles = {"gate_up": tuple(W[0][0].shape[1:3]), "down": tuple(W[0][2].shape[1:3])}
            for T in GEMV_TS:
                S = T * top_k
                x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
                routes = [topk_routing(T, E, top_k) for _ in range(GEMV_ROUTINGS)]
                auto = {s: torch.ops.kbit._gemv_splits(S * n, kt, sms) for s, (n, kt) in tiles.items()}
                configs = [("auto", 0, 0)] + [("gate_up", s, 0) for s in GEMV_SPLITS if s <= tiles["gate_up"][1]] + \
                          [("down", 0, s) for s in GEMV_SPLITS if s <= tiles["down"][1]]
                for stage, g, d in configs:
                    os.environ["VLLM_KBIT_MOE_GEMV_SPLITS"] = f"{g},{d}"
                    fns = [lambda w=W[i % len(W)], r=routes[i % GEMV_ROUTINGS]: kbit_fused_moe(x, r[0], r[1], *w, cb, I)
                           for i in range(max(len(W), GEMV_ROUTINGS))]
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
        lines += [f"## {layer}", "", "| k | T | heuristic µs | projection | " + " | ".join(f"{s} splits" for s in GEMV_SPLITS)
                  + " |", "| ---: | ---: | ---: | --- |" + " ---: |" * len(GEMV_SPLITS)]
        for k in sorted({r["k"] for r in records if r["layer"] == layer}):
            for T in GEMV_TS:
                rs = [r for r in records if r["layer"] == layer and r["k"] == k and r["T"] == T]
                base = [r for r in rs if r["stage"] == "auto"][0]
                for stage in ("gate_up", "down"):
                    cells = {r["splits"]: r["us"] for r in rs if r["stage"] == stage}
                    best = min(cells.values())
                    mark = base[f"auto_{stage}"]
                    row = [us_cell(cells[s], best) + (" (auto)" if s == mark else "") if s in cells else "-"
                           for s in GEMV_SPLITS]
                    lines.append(f"| {k} | {T} | {base['us']:.1f} | {stage} | " + " | ".join(row) + " |")
        lines.append("")
    write_md(stem, lines)


SWEEPS = {"dense_splits": sweep_dense_splits, "dense_paths": sweep_dense_paths, "moe_chunk_rows": sweep_moe_chunk_rows,
          "moe_grid": sweep_moe_grid, "moe_gemv_splits": sweep_moe_gemv_splits}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in SWEEPS:
        sys.exit(f"usage: python benchmarks/sweep_plan.py {{{','.join(SWEEPS)}}} [options]\n\n" + __doc__)
    SWEEPS[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    main()
