"""One sweep over the planner's fields (csrc/plan/plan.h): time a kernel at every value of one field of its plan,
forced, beside the planner's own choice, COLD (weight copies rotated past the L2), CUDA-graph replay. Each field
is a subcommand; each writes <out>/<stem>_<gpu>_<date>.{json,md} (the stems the results index cites):

    python benchmarks/sweep_plan.py dense_splits [--kernel mma|gemv|wgmma_ws] [--shapes qkv,o,...|all] [--m 8,16]
        K splits of the dense MMA (at both row-group widths r), GEMV (M = 1..4) or warp-specialized wgmma (clusters
        of up to 8), through kbit::_linear_forced: the data for gemv_splits / mma_splits / ws_rule_splits. Stem sweep_<kernel>_splits.
    python benchmarks/sweep_plan.py dense_paths [--shapes ...] [--bits 2,3,4,5] [--m 1,2] [--paths gemv,mma]
        [--report JSON]
        The dense path per M, each forced at the planner's splits: the GEMV against the MMA kernel at few rows
        (kGemvPathMaxM), the MMA kernel against the wgmma kernels (Hopper) near kMmaMaxM (--paths mma,wgmma,
        wgmma_ws); outputs checked against x @ dequantize_runtime(W)^T first. Stem dense_paths.
    python benchmarks/sweep_plan.py moe_chunk_rows [--layers qwen3_30b_moe,glm45_air_moe] [--bits 2,3,4,5]
        The grouped MoE MMA's chunk height (8, 16, 24, 32, 64 rows; moe_mma_chunk_rows) per T: gate_up + down through
        kbit::_moe_route + kbit::_moe_grouped_linear. Stem sweep_moe_chunk_rows.
    python benchmarks/sweep_plan.py moe_grid [--layers ...] [--bits ...] [--tokens 4,16,64] [--splits 1,2,3,4]
        The grouped MoE MMA's K splits and row groups per warp per projection (mma_splits, mma_grouped_r), at
        the planner's chunk height. Stem sweep_moe_grid.
    python benchmarks/sweep_plan.py moe_gemv_splits [--layers ...] [--bits 2,4]
        The direct MoE GEMV's K splits per projection (gemv_splits with its per-CTA overhead), whole fused_moe
        calls through kbit::_fused_moe_cuda forcing one projection's count. Stem sweep_moe_gemv_splits.

    python benchmarks/sweep_plan.py moe_paths [--layers ...] [--bits 2,4,5] [--tokens 128,...,4096]
        [--paths grouped_mma,grouped_wgmma,grouped_wgmma:1]
        The routed experts' path at many slots per expert: whole fused_moe calls per forced path (the data for
        moe_plan's grouped wgmma bound, wgmma_min_slots_per_expert; Hopper); `path:N` also forces N producer
        warpgroups of the grouped wgmma (ws_producers). Stem moe_paths.

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
from typing import NamedTuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import vllm_kbit  # noqa: E402,F401  (loads the extension)
from bench_kernels import routing as topk_routing  # noqa: E402
from bench_linear import SHAPES, copies_for, graph_time_us, random_runtime_weight  # noqa: E402
from bench_moe import kbit_bytes, random_stacked  # noqa: E402
from vllm_kbit import reference as fmt  # noqa: E402


# ----------------------------------------------------------------------------- what every sweep shares


RESULTS = os.path.join(os.path.dirname(__file__), "results")
LAYERS = {"qwen3_30b_moe": (128, 8, 2048, 768), "glm45_air_moe": (128, 8, 4096, 1408)}  # E, top_k, H, I
# The MoE sweeps' options besides --out and --commit (each sweep's own defaults for --bits).
MOE_OPTIONS = {"--layers": dict(default=",".join(LAYERS)), "--bits": dict(default="2,3,4,5")}


class Meta(NamedTuple):
    """What a sweep's files record about its run."""
    gpu: str
    l2: int
    commit: str
    date: str
    command: str


def sweep_args(name: str, argv: list[str], options: dict, commit: str | None = None) -> argparse.Namespace:
    """A sweep's options: --out, --commit (default ``commit``; none: git's HEAD) and its own {flag: add_argument kwargs}."""
    ap = argparse.ArgumentParser(prog=f"sweep_plan.py {name}")
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--commit", default=commit)
    for flag, kwargs in options.items():
        ap.add_argument(flag, **kwargs)
    return ap.parse_args(argv)


def run_meta(commit: str | None) -> Meta:
    """GPU name, L2 bytes, commit (given, else git's HEAD), UTC date and command line of a sweep; seeds torch."""
    torch.manual_seed(0)
    commit = commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                      text=True).stdout.strip()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    command = "python benchmarks/sweep_plan.py " + " ".join(sys.argv[1:])
    return Meta(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).L2_cache_size, commit, date, command)


def run(args: argparse.Namespace, name: str, measure, report, key: str | None = "records") -> None:
    """Runs one sweep: measure(args, meta) yields records (each printed as a JSON line as it comes), then
    <out>/<name>_<gpu>_<date>.json holds {gpu, date, commit, command, <key>: records} (key None: the records
    alone, as dense_splits has always written them) and report(args, meta, records) gives the .md's lines."""
    meta = run_meta(args.commit)
    records = []
    for rec in measure(args, meta):
        records.append(rec)
        print(json.dumps(rec), flush=True)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"{name}_{meta.gpu.replace(' ', '_')}_{meta.date}")
    with open(stem + ".json", "w") as f:
        json.dump(records if key is None else
                  dict(gpu=meta.gpu, date=meta.date, commit=meta.commit, command=meta.command, **{key: records}), f, indent=1)
    write_md(stem, report(args, meta, records))


def write_md(stem: str, lines: list) -> None:
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines).rstrip("\n") + "\n")
    print("wrote", stem + ".md")


def title(what: str, meta: Meta) -> str:
    return f"# {what}: {meta.gpu}, {meta.date}, commit {meta.commit}"


def table_head(cols: list[str], left: tuple[str, ...] = ()) -> list[str]:
    """A markdown table's header and alignment rows: numbers right-aligned, the columns named in left not."""
    return ["| " + " | ".join(cols) + " |", "| " + " | ".join("---" if c in left else "---:" for c in cols) + " |"]


def per_layer(args: argparse.Namespace, records: list, table) -> list[str]:
    """A '## <layer>' section per layer of --layers: table(that layer's records) gives its lines."""
    lines = []
    for layer in args.layers.split(","):
        lines += [f"## {layer}", "", *table([r for r in records if r["layer"] == layer]), ""]
    return lines


def us_cell(us: float, best: float) -> str:
    """A table cell of µs, bold where it is the row's best."""
    return f"**{us:.1f}**" if us == best else f"{us:.1f}"


def moe_layers(args: argparse.Namespace, meta: Meta, measure):
    """The records of measure(layer, E, top_k, H, I, k, codebook, expert copies) for every layer and k of
    --layers and --bits; each k's copies are freed before the next are made."""
    for layer in args.layers.split(","):
        E, top_k, H, I = LAYERS[layer]
        for k in (int(b) for b in args.bits.split(",")):
            cb, W = expert_copies(layer, k, meta.l2)
            yield from measure(layer, E, top_k, H, I, k, cb, W)
            del W
            torch.cuda.empty_cache()


def expert_copies(layer: str, k: int, l2: int) -> tuple[torch.Tensor, list]:
    """The layer's k-bit codebook and enough copies of random stacked experts (w13 qweight, absmax, w2
    qweight, absmax) that cycling through them reads past 4x the L2 (COLD)."""
    E, _, H, I = LAYERS[layer]
    expert_bytes = kbit_bytes(2 * I, H, k) + kbit_bytes(H, I, k)
    n_copies = max(2, math.ceil(4 * l2 / (E * expert_bytes)) + 1)
    return fmt.normal_float_codebook(k, "cuda"), [(*random_stacked(E, 2 * I, H, k), *random_stacked(E, H, I, k))
                                                   for _ in range(n_copies)]


def rotated(fn, copies: list, routes: list) -> list:
    """Calls fn(copy, routing) cycling through every weight copy (COLD) and every routing, for graph_time_us."""
    return [lambda w=copies[i % len(copies)], r=routes[i % len(routes)]: fn(w, r)
            for i in range(max(len(copies), len(routes)))]


def routing(T: int, E: int, top_k: int) -> torch.Tensor:
    """Top-k of random router scores, int32 [T * top_k] (bench_kernels.py's routing)."""
    return torch.topk(torch.randn(T, E, device="cuda"), top_k, dim=1).indices.to(torch.int32).flatten()


# ----------------------------------------------------------------------------- dense kernels: K splits and row groups


SPLITS_K_BITS = 4


def sweep_dense_splits(argv: list[str]) -> None:
    """dense_splits: the dense GEMV or MMA kernel at every K split count (and the MMA at both row-group widths)."""
    args = sweep_args("dense_splits", argv, {
        "--kernel": dict(choices=("mma", "gemv", "wgmma_ws"), default="mma"),
        "--shapes": dict(default="qkv,o,gate_up,down,llama8b_gate_up,llama70b_gate_up",
                         help="comma-separated names of bench_linear.SHAPES or KxN weights (2048x3968), or 'all'"),
        "--m": dict(help="default: 8,16,32,64 (mma), 1,2,4 (gemv), 128,256,512 (wgmma_ws)"),
        "--bits": dict(default=str(SPLITS_K_BITS), help="comma list of k")}, commit=os.environ.get("KBIT_COMMIT", "unknown"))
    run(args, f"sweep_{args.kernel}_splits", dense_splits_measure, dense_splits_report, key=None)


def dense_splits_measure(args, meta: Meta):
    gemv = args.kernel == "gemv"
    is_ws = args.kernel == "wgmma_ws"
    ms = [int(m) for m in (args.m or ("1,2,4" if gemv else "128,256,512" if is_ws else "8,16,32,64")).split(",")]
    props = torch.cuda.get_device_properties(0)
    op = torch.ops.kbit._linear_forced.default
    path = torch.ops.kbit._linear_path_id(args.kernel)
    for (name, K, N), k in ((s, int(b)) for s in split_shapes(args.shapes) for b in args.bits.split(",")):
        w0 = random_runtime_weight(N, K, k)
        nbytes = w0.qweight_rt.numel() * 4 + w0.absmax_rt.numel()
        ws = [w0] + [random_runtime_weight(N, K, k) for _ in range(copies_for(nbytes, "cold", meta.l2) - 1)]
        n_tiles = w0.qweight_rt.shape[0]
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            plan = vllm_kbit.ops.named(torch.ops.kbit.linear_plan.device, M, N, K, torch.bfloat16, k, x.device,
                                       args.kernel)
            max_splits, p, r_auto, m_blocks = plan.max_splits, plan.p, plan.r, plan.m_blocks
            for r in [0] if gemv or is_ws else sorted({1, r_auto}):
                ctas_per_split = n_tiles if gemv else plan.cols * m_blocks if is_ws else -(-n_tiles // r) * m_blocks
                for s in range(0, max_splits + 1):  # 0: the heuristic's choice
                    us = graph_time_us([lambda w=w: op(x, w.qweight_rt, w.absmax_rt, w.codebook, N, K, None, path, r, s)
                                        for w in ws])
                    yield dict(gpu=meta.gpu, commit=meta.commit, date=meta.date, kernel=args.kernel, shape=name, N=N,
                               K=K, k=k, M=M, p=p, r=r, splits=s, ctas=ctas_per_split * s if s else None,
                               us=round(us, 2))
            del x
        del ws, w0


def split_shapes(names: str) -> list[tuple[str, int, int]]:
    """--shapes of dense_splits: (name, K, N) of bench_linear.SHAPES by name ('all': every one) and of KxN weights."""
    if names == "all":
        return list(SHAPES)
    known = {s[0]: s for s in SHAPES}
    out = []
    for n in names.split(","):
        dims = n.split("x")
        if n in known:
            out.append(known[n])
        elif len(dims) == 2 and all(d.isdigit() for d in dims):
            out.append((n, int(dims[0]), int(dims[1])))
        else:
            sys.exit(f"sweep_plan.py dense_splits: shape {n!r} is neither in bench_linear.SHAPES nor KxN")
    return out


def dense_splits_report(args, meta: Meta, records: list) -> list[str]:
    lines = [title(f"{args.kernel.upper()} kernel split sweep", meta), "",
             "COLD, bf16, µs per call (CUDA-graph replay); `*` marks the fastest split count; auto = the "
             f"heuristic's ({args.kernel}_splits) launch, on this GPU's plan.", f"Command: `{meta.command}`", "",
             *table_head(["shape", "k", "M", "r", "auto", *(f"S={s}" for s in range(1, 9))], left=("shape",))]
    order = list(dict.fromkeys(x["shape"] for x in records))  # as measured
    keys = {(x["shape"], x["k"], x["M"], x["r"]) for x in records}
    for shape, k, M, r in sorted(keys, key=lambda t: (order.index(t[0]), t[1], t[2], t[3])):
        rows = {x["splits"]: x["us"] for x in records if (x["shape"], x["k"], x["M"], x["r"]) == (shape, k, M, r)}
        best = min((s for s in rows if s > 0), key=rows.get)
        cells = [f"{rows[s]:.1f}{'*' if s == best else ''}" if s in rows else "" for s in range(0, 9)]
        lines.append(f"| {shape} | {k} | {M} | {r} | " + " | ".join(cells) + " |")
    return lines


# ----------------------------------------------------------------------------- dense kernels: GEMV or MMA at few rows


PATHS_CHECK_TOL = 1e-2  # relative Frobenius error against the fp32 product of the dequantized weight


def sweep_dense_paths(argv: list[str]) -> None:
    args = sweep_args("dense_paths", argv, {
        "--shapes": dict(default="qkv,o,gate_up,down,llama70b_gate_up", help="names of bench_linear.SHAPES"),
        "--bits": dict(default="2,3,4,5"),
        "--m": dict(default="1,2"),
        "--paths": dict(default="gemv,mma", help="kbit::_linear_path_id names, the first the baseline of the ratios"),
        "--report": dict(metavar="JSON", help="only rewrite the .md of an earlier run's JSON")},
        commit=os.environ.get("KBIT_COMMIT", "unknown"))
    if not args.report:
        run(args, "dense_paths", dense_paths_measure, dense_paths_report, key="rows")
        return
    with open(args.report) as f:
        res = json.load(f)
    meta = Meta(res["gpu"], 0, res["commit"], res["date"], res["command"])
    write_md(args.report[: -len(".json")], dense_paths_report(args, meta, res["rows"]))


def dense_paths_measure(args, meta: Meta):
    op = torch.ops.kbit._linear_forced.default
    paths = [(name, torch.ops.kbit._linear_path_id(name)) for name in args.paths.split(",")]
    shapes = {s[0]: s for s in SHAPES}
    for name in args.shapes.split(","):
        _, K, N = shapes[name]
        for k in (int(b) for b in args.bits.split(",")):
            w0 = random_runtime_weight(N, K, k)
            nbytes = w0.qweight_rt.numel() * 4 + w0.absmax_rt.numel()
            ws = [w0] + [random_runtime_weight(N, K, k) for _ in range(copies_for(nbytes, "cold", meta.l2) - 1)]
            deq = torch.ops.kbit.dequantize_runtime(w0.qweight_rt, w0.absmax_rt, w0.codebook, N, K, torch.float32)
            for M in (int(m) for m in args.m.split(",")):
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                ref = x.float() @ deq.T
                rec = dict(shape=name, K=K, N=N, k=k, M=M)
                for path, pid in paths:
                    def fn(w, pid=pid):
                        return op(x, w.qweight_rt, w.absmax_rt, w.codebook, N, K, None, pid, 0, 0)
                    err = float((fn(w0).float() - ref).norm() / ref.norm())
                    if not err <= PATHS_CHECK_TOL:
                        raise RuntimeError(f"{name} k={k} M={M} {path}: relative error {err:.3g}")
                    rec[path] = round(graph_time_us([lambda w=w, fn=fn: fn(w) for w in ws]), 2)
                yield rec
            del ws, w0, deq


def dense_paths_report(args, meta: Meta, rows: list) -> list[str]:
    paths = [p for p in rows[0] if p not in ("shape", "K", "N", "k", "M")] if rows else []
    base = paths[0] if paths else ""
    return [title("Dense paths per M, each forced", meta), "",
            "COLD, bf16, µs per call (CUDA-graph replay), each kernel at its heuristic's split count; "
            f"`X / {base}` < 1: X is faster than {base}.", f"Command: `{meta.command}`", "",
            *table_head(["shape (K -> N)", "k", "M", *(f"{p} µs" for p in paths), *(f"{p} / {base}" for p in paths[1:])],
                        left=("shape (K -> N)",)),
            *(f"| {r['shape']} ({r['K']} -> {r['N']}) | {r['k']} | {r['M']} | "
              + " | ".join(f"{r[p]:.2f}" for p in paths) + " | "
              + " | ".join(f"{r[p] / r[base]:.2f}" for p in paths[1:]) + " |" for r in rows)]


# ----------------------------------------------------------------------------- routed experts: chunk height


CHUNK_TS = (16, 32, 64, 128, 256, 512, 1024)
HEIGHTS = (8, 16, 24, 32, 64)
CHUNK_ROUTINGS = 4


def sweep_moe_chunk_rows(argv: list[str]) -> None:
    run(sweep_args("moe_chunk_rows", argv, MOE_OPTIONS), "sweep_moe_chunk_rows", moe_chunk_rows_measure,
        moe_chunk_rows_report)


def moe_chunk_rows_measure(args, meta: Meta):
    mma_grouped = torch.ops.kbit._moe_kernel_id("mma_grouped")  # the kernel of every height in HEIGHTS

    def measure(layer, E, top_k, H, I, k, cb, W):
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
                    torch.ops.kbit._moe_grouped_linear(a1, r[3], r[4], w[0], w[1], cb, 2 * I, H, mma_grouped, rows)
                    torch.ops.kbit._moe_grouped_linear(a2, r[3], r[4], w[2], w[3], cb, H, I, mma_grouped, rows)

                us = graph_time_us(rotated(call, W, routes), min_calls=20 if T <= 256 else 8, replays=10)
                yield dict(layer=layer, k=k, T=T, rows=rows, us=round(us, 2), chunks=chunks, rows_per_expert=S / E)

    return moe_layers(args, meta, measure)


def moe_chunk_rows_report(args, meta: Meta, records: list) -> list[str]:
    def table(recs):
        lines = table_head(["k", "T", "rows/expert", *(f"{h} rows µs (chunks)" for h in HEIGHTS)])
        for k in sorted({r["k"] for r in recs}):
            for T in CHUNK_TS:
                rs = [r for r in recs if r["k"] == k and r["T"] == T]
                if rs:
                    best = min(r["us"] for r in rs)
                    cells = [us_cell(r["us"], best) + f" ({r['chunks']:.0f})" for r in rs]
                    lines.append(f"| {k} | {T} | {rs[0]['rows_per_expert']:.0f} | " + " | ".join(cells) + " |")
        return lines

    return [title("Grouped MoE MMA chunk height", meta), "",
            f"`{meta.command}`. gate_up + down grouped projections (no routing, gather, activation or combine), "
            "COLD, CUDA-graph replay, µs; chunks = mean chunks per call; best height in bold.", "",
            *per_layer(args, records, table)]


# ----------------------------------------------------------------------------- routed experts: grouped MMA K splits and row groups


GRID_TS = (4, 16, 32, 64, 128, 256)
GRID_SPLITS = (1, 2, 3, 4)
GRID_ROUTINGS = 4


def sweep_moe_grid(argv: list[str]) -> None:
    args = sweep_args("moe_grid", argv, {
        **MOE_OPTIONS, "--tokens": dict(default=",".join(map(str, GRID_TS))),
        "--splits": dict(default=",".join(map(str, GRID_SPLITS)), help="forced K split counts besides the rule")})
    run(args, "sweep_moe_grid", moe_grid_measure, moe_grid_report)


def moe_grid_measure(args, meta: Meta):
    splits = [int(s) for s in args.splits.split(",")]

    def measure(layer, E, top_k, H, I, k, cb, W):
        for T in (int(t) for t in args.tokens.split(",")):
            S = T * top_k
            plan = vllm_kbit.ops.named(torch.ops.kbit.moe_plan, T, top_k, E, k, "grouped_mma")
            rows, G, kernel = plan.chunk_rows, plan.max_chunks, torch.ops.kbit._moe_kernel_id(plan.kernel)
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
                        us = graph_time_us(rotated(lambda w, rt: torch.ops.kbit._moe_grouped_linear(
                            a, rt[3], rt[4], w[wi], w[wi + 1], cb, N, K, kernel, rows, s, r), W, routes), min_calls=20,
                            replays=10)
                        yield dict(layer=layer, k=k, T=T, proj=proj, rows=rows, r=r, splits=s, us=round(us, 2),
                                   chunks=chunks)

    return moe_layers(args, meta, measure)


def moe_grid_report(args, meta: Meta, records: list) -> list[str]:
    def table(recs):
        cols = sorted({(r["r"], r["splits"]) for r in recs if r["r"]})
        lines = table_head(["k", "T", "proj", "rows", "chunks", "rule µs", *(f"r={r} s={s}" for r, s in cols)],
                           left=("proj",))
        for key in sorted({(r["k"], r["T"], r["proj"]) for r in recs}):
            rs = [r for r in recs if (r["k"], r["T"], r["proj"]) == key]
            best = min(r["us"] for r in rs)
            cell = {(r["r"], r["splits"]): us_cell(r["us"], best) for r in rs}
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {rs[0]['rows']} | {rs[0]['chunks']:.0f} | "
                         f"{cell.get((0, 0), '-')} | " + " | ".join(cell.get(c, "-") for c in cols) + " |")
        return lines

    return [title("Grouped MoE MMA grid (K splits s, row groups per warp r)", meta), "",
            f"`{meta.command}`. One grouped projection, COLD, CUDA-graph replay, µs; `rule` = the launcher's own "
            "choice; best in bold.", "", *per_layer(args, records, table)]


# ----------------------------------------------------------------------------- routed experts: direct GEMV K splits


GEMV_TS = (1, 2)
GEMV_SPLITS = (1, 2, 3, 4, 6, 8)
GEMV_ROUTINGS = 4


def sweep_moe_gemv_splits(argv: list[str]) -> None:
    args = sweep_args("moe_gemv_splits", argv, {**MOE_OPTIONS, "--bits": dict(default="2,4")})
    run(args, "sweep_moe_gemv_splits", moe_gemv_splits_measure, moe_gemv_splits_report)


def moe_gemv_splits_measure(args, meta: Meta):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    reach = torch.ops.kbit._cluster_sms()  # the SMs clusters of 1..8 reach: the rule's device facts
    direct = torch.ops.kbit._moe_path_id("gemv_direct")

    def measure(layer, E, top_k, H, I, k, cb, W):
        # (n-tiles, k-tiles) of each projection: dims 1 and 2 of its stacked runtime qweight
        tiles = {"gate_up": tuple(W[0][0].shape[1:3]), "down": tuple(W[0][2].shape[1:3])}
        for T in GEMV_TS:
            S = T * top_k
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            routes = [topk_routing(T, E, top_k) for _ in range(GEMV_ROUTINGS)]
            auto = {s: torch.ops.kbit._gemv_splits(S * n, kt, sms, reach) for s, (n, kt) in tiles.items()}
            configs = [("auto", 0, 0)] + [("gate_up", s, 0) for s in GEMV_SPLITS if s <= tiles["gate_up"][1]] + \
                      [("down", 0, s) for s in GEMV_SPLITS if s <= tiles["down"][1]]
            for stage, g, d in configs:
                # kbit::_fused_moe_cuda with the direct GEMV's splits forced (0: the rule)
                us = graph_time_us(rotated(lambda w, r: torch.ops.kbit._fused_moe_cuda(
                    x, r[0], r[1], *w, cb, I, None, False, direct, g, d), W, routes), min_calls=40, replays=10)
                yield dict(layer=layer, k=k, T=T, stage=stage, splits=g or d, auto_gate_up=auto["gate_up"],
                           auto_down=auto["down"], us=round(us, 2))

    return moe_layers(args, meta, measure)


def moe_gemv_splits_report(args, meta: Meta, records: list) -> list[str]:
    def table(recs):
        lines = table_head(["k", "T", "heuristic µs", "projection", *(f"{s} splits" for s in GEMV_SPLITS)],
                           left=("projection",))
        for k in sorted({r["k"] for r in recs}):
            for T in GEMV_TS:
                rs = [r for r in recs if r["k"] == k and r["T"] == T]
                base = [r for r in rs if r["stage"] == "auto"][0]
                for stage in ("gate_up", "down"):
                    cells = {r["splits"]: r["us"] for r in rs if r["stage"] == stage}
                    best = min(cells.values())
                    mark = base[f"auto_{stage}"]
                    row = [us_cell(cells[s], best) + (" (auto)" if s == mark else "") if s in cells else "-"
                           for s in GEMV_SPLITS]
                    lines.append(f"| {k} | {T} | {base['us']:.1f} | {stage} | " + " | ".join(row) + " |")
        return lines

    return [title("Direct MoE GEMV K splits", meta), "",
            f"`{meta.command}`. Whole fused_moe call (two launches), COLD, CUDA-graph replay, µs; one projection's "
            "split count forced, the other on the heuristic; (auto) marks the heuristic's count.", "",
            *per_layer(args, records, table)]


# ----------------------------------------------------------------------------- routed experts: path by slots


PATH_TS = (128, 256, 512, 1024, 2048, 4096)
PATH_NAMES = ("grouped_mma", "grouped_wgmma")
PATH_CHECK_TOL = 1e-2  # relative difference between two paths' outputs (both round gate_up and h to bf16)


def sweep_moe_paths(argv: list[str]) -> None:
    args = sweep_args("moe_paths", argv, {**MOE_OPTIONS, "--bits": dict(default="2,4,5"),
                                          "--tokens": dict(default=",".join(map(str, PATH_TS))),
                                          "--paths": dict(default=",".join(PATH_NAMES))})
    run(args, "moe_paths", moe_paths_measure, moe_paths_report)


def moe_paths_measure(args, meta: Meta):
    paths = args.paths.split(",")
    # "name" or "name:producers": the path's id and the forced producer count (0: the rule)
    ids = {p: (torch.ops.kbit._moe_path_id(p.split(":")[0]), int(p.split(":")[1]) if ":" in p else 0) for p in paths}

    def measure(layer, E, top_k, H, I, k, cb, W):
        for T in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16) / 4
            routes = [topk_routing(T, E, top_k) for _ in range(2)]
            rec = dict(layer=layer, k=k, T=T, auto=torch.ops.kbit.moe_plan.device(T, top_k, E, k, H, I, x.device)[0])
            outs = {}
            for p in paths:
                def call(w, r, p=p):
                    path_id, producers = ids[p]
                    return torch.ops.kbit._fused_moe_cuda(x, r[0], r[1], *w, cb, I, None, False, path_id, 0, 0, 0, 0,
                                                          producers)
                outs[p] = call(W[0], routes[0]).float()
                rec[p] = round(graph_time_us(rotated(call, W, routes), min_calls=8, replays=10), 1)
            ref = outs[paths[0]]
            for p in paths[1:]:
                err = float((outs[p] - ref).norm() / ref.norm())
                if not err <= PATH_CHECK_TOL:
                    raise RuntimeError(f"{layer} k={k} T={T}: {p} differs from {paths[0]} by {err:.3g}")
            yield rec

    return moe_layers(args, meta, measure)


def moe_paths_report(args, meta: Meta, records: list) -> list[str]:
    paths = args.paths.split(",")

    def table(recs):
        lines = table_head(["k", "T", "slots / expert", *(f"{p} µs" for p in paths), "auto"], left=("auto",))
        for r in recs:
            best = min(r[p] for p in paths)
            E, top_k = LAYERS[r["layer"]][:2]
            lines.append(f"| {r['k']} | {r['T']} | {r['T'] * top_k / E:.0f} | "
                         + " | ".join(us_cell(r[p], best) for p in paths) + f" | {r['auto']} |")
        return lines

    return [title("Routed-expert path by slots per expert", meta), "",
            f"`{meta.command}`. Whole fused_moe call per forced path (routing, gather, gate_up, SiLU * up, down, "
            "combine), COLD, CUDA-graph replay, µs; outputs of the paths checked against each other first; best in "
            "bold; auto = the planner's path on this GPU.", "", *per_layer(args, records, table)]


SWEEPS = {"dense_splits": sweep_dense_splits, "dense_paths": sweep_dense_paths, "moe_chunk_rows": sweep_moe_chunk_rows,
          "moe_grid": sweep_moe_grid, "moe_gemv_splits": sweep_moe_gemv_splits, "moe_paths": sweep_moe_paths}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in SWEEPS:
        sys.exit(f"usage: python benchmarks/sweep_plan.py {{{','.join(SWEEPS)}}} [options]\n\n" + __doc__)
    SWEEPS[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    main()
