"""Dense kbit linear benchmark: kbit::linear (GEMV for M <= 2, fused dequant + MMA up to 64, fused dequant
+ wgmma on large weights (register-fragment up to 128, warp-specialized up to 512), dequant + cuBLAS
elsewhere) and each of its kernels forced on its own, vs cuBLAS bf16 and fp16.

Kernel time only: each measurement captures many back-to-back calls in one CUDA graph and
times its replays with events (median replay / calls). HOT reuses one weight; COLD rotates
through enough weight copies that the working set exceeds 4x the L2, which is what decode
across layers sees. Roofline % = bytes moved (weights + activations + output, each once) /
measured device-to-device copy bandwidth / time.

    python benchmarks/bench_linear.py --commit $(git rev-parse --short HEAD) --out benchmarks/results

Writes bench_linear_<gpu>_<date>.json (a list of records), .md (tables) and .png (speedup over
cuBLAS bf16 vs M, one line per k) into --out; `--plot JSON` redraws the plot of a JSON file.
The records' meaning: op `kbit_linear` is the dispatch (`path` says which kernel it ran),
`kbit_mma` / `kbit_dequant_cublas` / `kbit_wgmma` / `kbit_wgmma_ws` force one kernel where the dispatch
picks another (k=4, COLD: the crossovers; `kbit_mma` also where the dispatch runs the GEMV, both wgmma
kernels from M = 64 on Hopper), `kbit_mma_r<r>` the MMA kernel
with the row-group width r its heuristic did not pick (k=4, COLD, at VARIANT_M);
`us` median kernel time per call, `baseline_us` cuBLAS bf16 at the same shape/M/regime in the
same run, `roofline_pct` as above, `splits` the GEMV's K splits (M <= 4).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import vllm_kbit  # noqa: E402
from vllm_kbit import reference as fmt  # noqa: E402
from vllm_kbit.linear import KbitLinearWeight, kbit_linear  # noqa: E402

# The target shapes of docs/architecture.md, as (name, K, N)
SHAPES = [
    ("qkv", 2048, 4096),
    ("kv", 2048, 512),
    ("o", 4096, 2048),
    ("gate_up", 2048, 5120),
    ("down", 5120, 2048),
    ("moe_gate_up", 2048, 1024),
    ("moe_down", 512, 2048),
    ("glm_sh_gate_up", 2048, 10240),
    ("glm_sh_down", 10240, 2048),
    ("glm_rt_gate_up", 2048, 1536),
    ("glm_rt_down", 1536, 2048),
    ("llama8b_gate_up", 4096, 14336),
    ("llama70b_gate_up", 8192, 28672),
    ("qwen3_lm_head", 2048, 151936),  # quantize_lm_head: the output head of Qwen3-30B-A3B
    ("llama8b_gate_up_merged", 4096, 28672),  # gate and up as vLLM merges them (Llama-3-8B)
    ("glm_air_dense_gate_up", 4096, 21888),  # GLM-4.5-Air's dense first layer, merged
    ("llama8b_down", 14336, 4096),
    ("llama70b_down", 28672, 8192),
]
QWEN3_BLOCK = ("qkv", "kv", "o", "gate_up", "down")
OPTIONAL_SHAPES = ("qwen3_lm_head", "llama8b_gate_up_merged", "glm_air_dense_gate_up", "llama8b_down",
                   "llama70b_down")  # only with --shapes
GOAL_SHAPES = ("llama8b_gate_up", "llama70b_gate_up")  # >= 8 MB packed at k=4
GOAL_M = (1, 16, 64, 256, 1024)
M_ALL = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)  # k = 4
M_OTHER_K = (1, 4, 16, 64, 256, 1024)  # k = 2, 3, 5 (fewer M than k = 4, to keep a full run short)
M_SHORT = (4, 8, 16, 32, 64, 128, 256)  # --short: k = 4 COLD; other k COLD and k = 4 HOT at M_SHORT_OTHER
M_SHORT_OTHER = (16,)
FORCED_MAX_M = 512  # the MMA kernel is timed up to here where the dispatch picks dequant + cuBLAS
WGMMA_MIN_M = 64  # the wgmma kernels (Hopper) are timed from here where the dispatch picks another path
VARIANT_M = (8, 16, 32, 64, 128, 256)  # the MMA kernel's other row-group width is timed here (k=4 COLD)


def copy_bandwidth() -> float:
    """Device-to-device copy of 1 GiB, bytes read + written per second (median of 20)."""
    n = 1 << 28
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        dst.copy_(src)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e-3)
    del src, dst
    return 2 * n * 4 / statistics.median(times)


def graph_time_us(fns, min_calls=20, replays=15) -> float:
    """Median per-call time of the calls fns (cycled to at least min_calls) captured in one graph."""
    calls = [fns[i % len(fns)] for i in range(max(min_calls, len(fns)))]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns[:2]:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / len(calls))
    del graph
    return statistics.median(times)


def copies_for(nbytes: int, regime: str, l2_bytes: int) -> int:
    if regime == "hot":
        return 1
    return max(2, math.ceil(4 * l2_bytes / nbytes) + 1)


def random_runtime_weight(N: int, K: int, k: int) -> KbitLinearWeight:
    q_shape, a_shape = fmt.runtime_shapes(N, K, k)
    q = torch.randint(-(2**31), 2**31 - 1, q_shape, dtype=torch.int32, device="cuda")
    a = torch.randint(100, 180, a_shape, dtype=torch.uint8, device="cuda")
    return KbitLinearWeight(q, a, fmt.normal_float_codebook(k, "cuda"), N, K, k)


def eager_overhead_us() -> dict:
    """Host time per call of the Python entry point and of the bare op, on a tiny GEMV (host-bound)."""
    w = random_runtime_weight(512, 2048, 4)
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    W = torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16)
    out = {}
    op = torch.ops.kbit.linear.default
    for name, fn in (
        ("kbit_linear", lambda: kbit_linear(x, w)),
        ("torch.ops.kbit.linear", lambda: op(x, w.qweight_rt, w.absmax_rt, w.codebook, w.N, w.K, None)),
        ("F.linear_bf16", lambda: F.linear(x, W)),
        ("torch.add (dispatcher floor)", lambda: torch.add(x, x)),
    ):
        for _ in range(200):
            fn()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(2000):
                fn()
            torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - t0) / 2000 * 1e6)
        out[name] = best
    return out


def wgmma_fn(x, w, warp_specialized=False):
    op, path = torch.ops.kbit._linear_forced.default, torch.ops.kbit._linear_path_id("wgmma_ws" if warp_specialized else "wgmma")
    return lambda: op(x, w.qweight_rt, w.absmax_rt, w.codebook, w.N, w.K, None, path, 0, 0)


def mma_fn(x, w, row_groups=0):
    op, path = torch.ops.kbit._linear_forced.default, torch.ops.kbit._linear_path_id("mma")
    return lambda: op(x, w.qweight_rt, w.absmax_rt, w.codebook, w.N, w.K, None, path, row_groups, 0)


def m_plan(args, k: int, regime: str) -> tuple:
    """The M values timed for k-bit weights in one regime."""
    if args.short:
        if regime == "hot":
            return M_SHORT_OTHER if k == 4 else ()
        return M_SHORT if k == 4 else M_SHORT_OTHER
    return M_ALL if k == 4 else M_OTHER_K


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--commit", default=os.environ.get("KBIT_COMMIT", "unknown"))
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES if s[0] not in OPTIONAL_SHAPES))
    ap.add_argument("--bits", default="2,3,4,5")
    ap.add_argument("--regimes", default="hot,cold")
    ap.add_argument("--short", action="store_true",
                    help=f"Qwen3 block + large shapes; k=4 COLD at M in {M_SHORT}, other k COLD and k=4 HOT at M in {M_SHORT_OTHER}")
    ap.add_argument("--tag", default="", help="suffix of the output file names")
    ap.add_argument("--plot", metavar="JSON", help="only redraw the PNG of an existing JSON file")
    args = ap.parse_args()
    if args.plot:
        with open(args.plot) as f:
            plot([r for r in json.load(f) if r["regime"] in ("hot", "cold")], args.plot[: -len(".json")] + ".png")
        return
    assert torch.cuda.is_available() and vllm_kbit.HAS_CUDA_KERNELS, "needs a GPU and the built extension"

    props = torch.cuda.get_device_properties(0)
    gpu, sms, l2 = props.name, props.multi_processor_count, props.L2_cache_size
    hopper = props.major == 9
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    bw = copy_bandwidth()
    print(f"{gpu}: {sms} SMs, L2 {l2 >> 20} MiB, copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    overhead = eager_overhead_us()
    print("eager host time per call (us):", {k: round(v, 2) for k, v in overhead.items()}, flush=True)

    bits = [int(b) for b in args.bits.split(",")]
    regimes = args.regimes.split(",")
    shapes = [s for s in SHAPES if s[0] in args.shapes.split(",")]
    if args.short:  # the goal shapes first: a run cut short still has them
        shapes = [s for name in GOAL_SHAPES + QWEN3_BLOCK for s in shapes if s[0] == name]
    common = dict(gpu=gpu, commit=args.commit, date=date)
    records = []
    os.makedirs(args.out, exist_ok=True)
    tag = f"{gpu.replace(' ', '_')}_{date[:10]}{args.tag}"
    meta = dict(common, copy_bandwidth_GBps=round(bw / 1e9, 1), sms=sms, l2_MiB=l2 >> 20, eager_host_us=overhead,
                command=" ".join(sys.argv))

    def write_tables():
        with open(os.path.join(args.out, f"bench_linear_{tag}.json"), "w") as f:
            json.dump(json_records(meta, records), f, indent=1)
        with open(os.path.join(args.out, f"bench_linear_{tag}.md"), "w") as f:
            f.write(markdown(meta, records))

    def record(op, name, K, N, k, M, dtype, regime, us, nbytes, extra=None):
        rec = dict(common, op=op, shape=name, N=N, K=K, k=k, M=M, dtype=str(dtype).replace("torch.", ""),
                   regime=regime, us=round(us, 3), roofline_pct=round(100 * nbytes / bw / (us * 1e-6), 1))
        rec.update(extra or {})
        records.append(rec)
        return rec

    def plan(M, N, K, dtype, path="auto"):  # the plan's named fields (path, splits, max_splits, p, r, ...) on this GPU
        return vllm_kbit.ops.named(torch.ops.kbit.linear_plan, M, N, K, dtype, props.major, sms, 1, path)

    for name, K, N in shapes:
        for regime in regimes:
            base = {}
            for dtype in (torch.bfloat16, torch.float16):
                wbytes = N * K * 2
                Ws = [torch.randn(N, K, device="cuda", dtype=dtype) for _ in range(copies_for(wbytes, regime, l2))]
                ms = sorted({M for k in bits for M in m_plan(args, k, regime)})
                for M in ms if dtype == torch.bfloat16 else [M for M in ms if M in (1, 4, 16, 64)]:
                    x = torch.randn(M, K, device="cuda", dtype=dtype)
                    us = graph_time_us([lambda W=W: F.linear(x, W) for W in Ws])
                    base[(dtype, M)] = us
                    record(f"cublas_{'bf16' if dtype == torch.bfloat16 else 'fp16'}", name, K, N, 0, M, dtype, regime,
                           us, wbytes + 2 * M * (K + N))
                del Ws
            for k in bits:
                w0 = random_runtime_weight(N, K, k)
                wbytes = w0.qweight_rt.nbytes + w0.absmax_rt.nbytes
                ws = [w0] + [random_runtime_weight(N, K, k) for _ in range(copies_for(wbytes, regime, l2) - 1)]
                for dtype in (torch.bfloat16, torch.float16):
                    for M in m_plan(args, k, regime):
                        if dtype == torch.float16 and (M not in (1, 16) or k != 4):
                            continue
                        x = torch.randn(M, K, device="cuda", dtype=dtype)
                        nbytes = wbytes + 2 * M * (K + N)
                        extra = dict(baseline_us=round(base[(torch.bfloat16, M)], 3),
                                     fp16_us=round(base[(torch.float16, M)], 3) if (torch.float16, M) in base else None)
                        path, splits = plan(M, N, K, dtype)[:2]
                        us = graph_time_us([lambda w=w: kbit_linear(x, w) for w in ws])
                        rec = record("kbit_linear", name, K, N, k, M, dtype, regime, us, nbytes,
                                     dict(extra, path=path, **(dict(splits=splits) if path == "gemv" else {})))
                        if k == 4 and regime == "cold" and dtype == torch.bfloat16:
                            # the other side of each crossover, forced: dequant + cuBLAS where the dispatch
                            # runs the MMA kernel, the MMA kernel where it runs the GEMV or (up to
                            # FORCED_MAX_M) dequant + cuBLAS
                            if path == "mma":
                                us2 = graph_time_us([lambda w=w: F.linear(x, w.dequantize(dtype)) for w in ws])
                                record("kbit_dequant_cublas", name, K, N, k, M, dtype, regime, us2, nbytes, extra)
                            elif M <= FORCED_MAX_M:
                                record("kbit_mma", name, K, N, k, M, dtype, regime, graph_time_us([mma_fn(x, w) for w in ws]),
                                       nbytes, extra)
                            if M >= WGMMA_MIN_M and hopper:  # both wgmma kernels where the dispatch runs another path
                                for op, ws_kernel in (("kbit_wgmma", False), ("kbit_wgmma_ws", True)):
                                    if path != op[len("kbit_"):]:
                                        record(op, name, K, N, k, M, dtype, regime,
                                               graph_time_us([wgmma_fn(x, w, ws_kernel) for w in ws]), nbytes, extra)
                            if path.startswith("wgmma"):
                                us2 = graph_time_us([lambda w=w: F.linear(x, w.dequantize(dtype)) for w in ws])
                                record("kbit_dequant_cublas", name, K, N, k, M, dtype, regime, us2, nbytes, extra)
                            if M in ((16, 64) if args.short else VARIANT_M):
                                p, r = plan(M, N, K, dtype, "mma")[3:5]
                                other = (1 if r > 1 else (2 if p == 8 else 4))
                                us3 = graph_time_us([mma_fn(x, w, other) for w in ws])
                                record(f"kbit_mma_r{other}", name, K, N, k, M, dtype, regime, us3, nbytes,
                                       dict(extra, default_r=r))
                        if dtype == torch.bfloat16 and M in (1, 16, 64, 256) and k == 4:
                            print(f"{name:>17} k={k} M={M:<4} {regime:4} {path:>14}: {us:8.2f} us  cuBLAS bf16 "
                                  f"{rec['baseline_us']:8.2f}  x{rec['baseline_us'] / us:5.2f}  {rec['roofline_pct']:5.1f}% roofline",
                                  flush=True)
                del ws, w0
                torch.cuda.empty_cache()
        write_tables()  # after every shape, so a run cut short keeps what it measured

    try:
        plot(records, os.path.join(args.out, f"bench_linear_{tag}.png"))
    except ImportError as e:  # matplotlib missing: `--plot JSON` redraws it elsewhere
        print(f"no plot: {e}")
    print(markdown(meta, records, summary_only=True))
    print("\n".join(headline(records)))


def json_records(meta, records) -> list:
    """The JSON file: a list of records, each carrying the run's copy bandwidth and command; the
    eager host times are records of their own (op "eager:<entry point>", regime "host")."""
    run = dict(copy_bandwidth_GBps=meta["copy_bandwidth_GBps"], sms=meta["sms"], command=meta["command"])
    eager = [dict(gpu=meta["gpu"], commit=meta["commit"], date=meta["date"], op=f"eager:{name}", shape="kv", N=512,
                  K=2048, k=4, M=1, dtype="bfloat16", regime="host", us=round(us, 3))
             for name, us in meta["eager_host_us"].items()]
    return [dict(r, **run) for r in records + eager]


def _speedup_table(rows, lines, title):
    """Rows of one op/regime/k/dtype as a shape x M table of `kbit / cuBLAS bf16 (speedup, roofline %)`."""
    Ms = sorted({r["M"] for r in rows})
    by = {(r["shape"], r["M"]): r for r in rows}
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    lines += [title, "", "| shape | K x N | " + " | ".join(f"M={M}" for M in Ms) + " |",
              "| --- | --- | " + " | ".join("---:" for _ in Ms) + " |"]
    for s in shapes:
        r0 = next(r for r in rows if r["shape"] == s)
        cells = []
        for M in Ms:
            r = by.get((s, M))
            cells.append("" if r is None else
                         f"{r['us']:.1f} / {r['baseline_us']:.1f} ({r['baseline_us'] / r['us']:.2f}x, {r['roofline_pct']:.0f}%)")
        lines.append(f"| {s} | {r0['K']}x{r0['N']} | " + " | ".join(cells) + " |")
    if all(s in shapes for s in QWEN3_BLOCK):
        cells = []
        for M in Ms:
            if all((s, M) in by for s in QWEN3_BLOCK):
                t = sum(by[(s, M)]["us"] for s in QWEN3_BLOCK)
                b = sum(by[(s, M)]["baseline_us"] for s in QWEN3_BLOCK)
                cells.append(f"{t:.1f} / {b:.1f} ({b / t:.2f}x)")
            else:
                cells.append("")
        lines.append("| Qwen3 block TOTAL | 5 dense | " + " | ".join(cells) + " |")
    lines.append("")


def headline(records) -> list:
    """The goal table (COLD, k=4) and the MMA / dequant + cuBLAS crossover, as markdown lines."""
    lines = []
    lin = [r for r in records if r["op"] == "kbit_linear" and r["dtype"] == "bfloat16"]
    by = {(r["shape"], r["M"], r["k"], r["regime"]): r for r in lin}
    if any(r["regime"] == "cold" and r["k"] == 4 for r in lin):
        Ms = [M for M in GOAL_M if any(r["M"] == M and r["k"] == 4 and r["regime"] == "cold" for r in lin)]
        lines += ["## Goals (COLD, k=4, bf16): speedup of kbit_linear over cuBLAS bf16 (M=1: % of roofline too)", "",
                  "| | " + " | ".join(f"M={M}" for M in Ms) + " |", "| --- | " + " | ".join("---:" for _ in Ms) + " |"]
        for s in GOAL_SHAPES:
            cells = []
            for M in Ms:
                r = by.get((s, M, 4, "cold"))
                cells.append("" if r is None else f"{r['baseline_us'] / r['us']:.2f}x" + (f" ({r['roofline_pct']:.0f}%)" if M == 1 else ""))
            lines.append(f"| {s} | " + " | ".join(cells) + " |")
        cells = []
        for M in Ms:
            rs = [by.get((s, M, 4, "cold")) for s in QWEN3_BLOCK]
            cells.append("" if None in rs else f"{sum(r['baseline_us'] for r in rs) / sum(r['us'] for r in rs):.2f}x")
        lines += ["| Qwen3 block TOTAL | " + " | ".join(cells) + " |", ""]
    gemv_side = [r for r in lin if r["regime"] == "cold" and r["k"] == 4 and r.get("path") == "gemv"]
    mma_forced = {(r["shape"], r["M"]): r["us"] for r in records if r["op"] == "kbit_mma"}
    if any((r["shape"], r["M"]) in mma_forced for r in gemv_side):
        Ms = sorted({r["M"] for r in gemv_side})
        lines += ["## GEMV / MMA crossover (COLD, k=4, bf16): µs of the GEMV (the dispatch's pick) / the MMA kernel forced",
                  "", "| shape | " + " | ".join(f"M={M}" for M in Ms) + " |", "| --- | " + " | ".join("---:" for _ in Ms) + " |"]
        gby = {(r["shape"], r["M"]): r["us"] for r in gemv_side}
        for s in dict.fromkeys(r["shape"] for r in gemv_side):
            cells = [f"{gby[(s, M)]:.1f} / {mma_forced[(s, M)]:.1f}" if (s, M) in gby and (s, M) in mma_forced else ""
                     for M in Ms]
            lines.append(f"| {s} | " + " | ".join(cells) + " |")
        lines.append("")
    forced = [r for r in records if r["op"] in ("kbit_mma", "kbit_dequant_cublas") and r["M"] >= 4]
    if forced:
        lines += ["## Crossover (COLD, k=4, bf16): µs of the MMA kernel / dequant + cuBLAS (dispatch's pick in bold)", "",
                  "| shape | " + " | ".join(f"M={M}" for M in sorted({r["M"] for r in forced})) + " |",
                  "| --- | " + " | ".join("---:" for _ in sorted({r["M"] for r in forced})) + " |"]
        fby = {(r["shape"], r["M"], r["op"]): r["us"] for r in forced}
        for s in dict.fromkeys(r["shape"] for r in forced):
            cells = []
            for M in sorted({r["M"] for r in forced}):
                d = by.get((s, M, 4, "cold"))
                if d is None:
                    cells.append("")
                    continue
                mma = d["us"] if d["path"] == "mma" else fby.get((s, M, "kbit_mma"))
                deq = d["us"] if d["path"] == "dequant_cublas" else fby.get((s, M, "kbit_dequant_cublas"))
                fmt_ = lambda v, bold: "-" if v is None else (f"**{v:.1f}**" if bold else f"{v:.1f}")
                cells.append(f"{fmt_(mma, d['path'] == 'mma')} / {fmt_(deq, d['path'] == 'dequant_cublas')}")
            lines.append(f"| {s} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def markdown(meta, records, summary_only=False) -> str:
    lines = [f"# bench_linear: {meta['gpu']}, {meta['date']}, commit {meta['commit']}", "",
             f"copy bandwidth {meta['copy_bandwidth_GBps']} GB/s; {meta['sms']} SMs; L2 {meta['l2_MiB']} MiB; "
             f"command `{meta['command']}`", ""]
    if meta["eager_host_us"]:
        lines += ["Eager host time per call (µs): " + ", ".join(f"{k} {v:.2f}" for k, v in meta["eager_host_us"].items()), ""]
    lines += headline(records)
    lin = [r for r in records if r["op"] == "kbit_linear" and r["dtype"] == "bfloat16"]
    variants = sorted({r["op"] for r in records if r["op"].startswith("kbit_mma_r")})
    for op in variants:
        _speedup_table([r for r in records if r["op"] == op], lines,
                       f"## {op}: the MMA kernel with r={op[len('kbit_mma_r'):]} row groups per warp, where the "
                       "default r differs (COLD, k=4, bf16; compare the crossover table)")
    for regime in ("cold", "hot"):
        for k in sorted({r["k"] for r in lin}):
            rows = [r for r in lin if r["regime"] == regime and r["k"] == k]
            if rows:
                _speedup_table(rows, lines, f"## {regime.upper()}, k={k}, bf16: kbit_linear µs / cuBLAS bf16 µs (speedup, roofline %)")
    if not summary_only:
        lines += ["## All records", "", "| op | path | shape | k | M | dtype | regime | µs | cuBLAS bf16 µs | cuBLAS fp16 µs | roofline % |",
                  "| --- | --- | --- | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: |"]
        for r in records:
            lines.append(f"| {r['op']} | {r.get('path', '')} | {r['shape']} | {r['k']} | {r['M']} | {r['dtype']} | {r['regime']} | "
                         f"{r['us']:.2f} | {r.get('baseline_us', '')} | {r.get('fp16_us', '')} | {r['roofline_pct']} |")
    return "\n".join(lines) + "\n"


def plot(records, path) -> None:
    """Speedup of kbit_linear over cuBLAS bf16 vs M (COLD, bf16), one line per k: the largest shape and the
    Qwen3 block total."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lin = [r for r in records if r["op"] == "kbit_linear" and r["dtype"] == "bfloat16" and r["regime"] == "cold"]
    by = {(r["shape"], r["M"], r["k"]): r for r in lin}
    measured = {r["shape"] for r in lin}
    panels = [(t, shapes) for t, shapes in (("llama70b_gate_up 8192x28672", ("llama70b_gate_up",)),
                                            ("Qwen3 block TOTAL (5 dense shapes)", QWEN3_BLOCK))
              if measured.issuperset(shapes)]
    # A run of other shapes (--shapes): one panel per shape measured.
    panels = panels or [(name, (name,)) for name, _, _ in SHAPES if name in measured]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (title, shapes) in zip(axes[0], panels):
        for k in sorted({r["k"] for r in lin}):
            Ms = sorted(M for M in {r["M"] for r in lin if r["k"] == k} if all((s, M, k) in by for s in shapes))
            sp = [sum(by[(s, M, k)]["baseline_us"] for s in shapes) / sum(by[(s, M, k)]["us"] for s in shapes) for M in Ms]
            ax.plot(Ms, sp, marker="o", label=f"k={k}")
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M (rows of x)")
        ax.set_ylabel("speedup over cuBLAS bf16 (COLD)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    r0 = records[0]
    fig.suptitle(f"kbit_linear, {r0['gpu']}, commit {r0['commit']}, {r0['date'][:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
