"""Dense kbit linear benchmark: kbit::linear (GEMV for M <= 4, dequant + cuBLAS above) vs cuBLAS.

Kernel time only: each measurement captures many back-to-back calls in one CUDA graph and
times its replays with events (median replay / calls). HOT reuses one weight; COLD rotates
through enough weight copies that the working set exceeds 4x the L2, which is what decode
across layers sees. Roofline % = bytes moved (weights + activations + output, each once) /
measured device-to-device copy bandwidth / time.

    python benchmarks/bench_linear.py --commit $(git rev-parse --short HEAD) --out benchmarks/results

Writes bench_linear_<gpu>_<date>.json (a list of records) and .md (tables) into --out.
The records' meaning: `us` median kernel time per call, `baseline_us` cuBLAS bf16 at the same
shape/M/regime in the same run, `roofline_pct` as above, `splits` the GEMV's K splits.
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
from vllm_kbit import format as fmt  # noqa: E402
from vllm_kbit.linear import KbitLinearWeight, gemv_splits, gemv_tiles, kbit_linear  # noqa: E402

# design.md section 6 as (name, K, N)
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
]
QWEN3_BLOCK = ("qkv", "kv", "o", "gate_up", "down")
M_GEMV = (1, 2, 3, 4)
M_LARGE = (8, 16, 64, 256, 1024)


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--commit", default=os.environ.get("KBIT_COMMIT", "unknown"))
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--bits", default="2,3,4,5")
    ap.add_argument("--quick", action="store_true", help="M <= 4 and k = 4 only")
    args = ap.parse_args()
    assert torch.cuda.is_available() and vllm_kbit.HAS_CUDA_KERNELS, "needs a GPU and the built extension"

    props = torch.cuda.get_device_properties(0)
    gpu, sms, l2 = props.name, props.multi_processor_count, props.L2_cache_size
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    bw = copy_bandwidth()
    print(f"{gpu}: {sms} SMs, L2 {l2 >> 20} MiB, copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    overhead = eager_overhead_us()
    print("eager host time per call (us):", {k: round(v, 2) for k, v in overhead.items()}, flush=True)

    bits = [4] if args.quick else [int(b) for b in args.bits.split(",")]
    m_all = M_GEMV if args.quick else M_GEMV + M_LARGE
    shapes = [s for s in SHAPES if s[0] in args.shapes.split(",")]
    common = dict(gpu=gpu, commit=args.commit, date=date)
    records = []

    def record(op, name, K, N, k, M, dtype, regime, us, nbytes, extra=None):
        rec = dict(common, op=op, shape=name, N=N, K=K, k=k, M=M, dtype=str(dtype).replace("torch.", ""),
                   regime=regime, us=round(us, 3), roofline_pct=round(100 * nbytes / bw / (us * 1e-6), 1))
        rec.update(extra or {})
        records.append(rec)
        return rec

    for name, K, N in shapes:
        for regime in ("hot", "cold"):
            base = {}
            for dtype in (torch.bfloat16, torch.float16):
                wbytes = N * K * 2
                Ws = [torch.randn(N, K, device="cuda", dtype=dtype) for _ in range(copies_for(wbytes, regime, l2))]
                for M in m_all:
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
                splits = gemv_splits(*gemv_tiles(N, K), sms)
                for dtype in (torch.bfloat16, torch.float16):
                    for M in m_all:
                        if dtype == torch.float16 and M not in (1, 4):
                            continue
                        x = torch.randn(M, K, device="cuda", dtype=dtype)
                        us = graph_time_us([lambda w=w: kbit_linear(x, w) for w in ws])
                        op = "kbit_gemv" if M <= 4 else "kbit_dequant_cublas"
                        rec = record(op, name, K, N, k, M, dtype, regime, us, wbytes + 2 * M * (K + N),
                                     dict(baseline_us=round(base[(torch.bfloat16, M)], 3),
                                          fp16_us=round(base[(torch.float16, M)], 3), splits=splits))
                        if dtype == torch.bfloat16 and M in (1, 4) and k == 4:
                            print(f"{name:>17} k={k} M={M} {regime:4}: {us:8.2f} us  cuBLAS bf16 {rec['baseline_us']:8.2f}"
                                  f"  x{rec['baseline_us'] / us:5.2f}  {rec['roofline_pct']:5.1f}% roofline  S={splits}",
                                  flush=True)
                del ws, w0
                torch.cuda.empty_cache()

    os.makedirs(args.out, exist_ok=True)
    tag = f"{gpu.replace(' ', '_')}_{date[:10]}"
    meta = dict(common, copy_bandwidth_GBps=round(bw / 1e9, 1), sms=sms, l2_MiB=l2 >> 20, eager_host_us=overhead,
                command=" ".join(sys.argv))
    with open(os.path.join(args.out, f"bench_linear_{tag}.json"), "w") as f:
        json.dump(json_records(meta, records), f, indent=1)
    with open(os.path.join(args.out, f"bench_linear_{tag}.md"), "w") as f:
        f.write(markdown(meta, records))
    print(markdown(meta, records, summary_only=True))


def json_records(meta, records) -> list:
    """The JSON file: a list of records, each carrying the run's copy bandwidth and command; the
    eager host times are records of their own (op "eager:<entry point>", regime "host")."""
    run = dict(copy_bandwidth_GBps=meta["copy_bandwidth_GBps"], sms=meta["sms"], command=meta["command"])
    eager = [dict(gpu=meta["gpu"], commit=meta["commit"], date=meta["date"], op=f"eager:{name}", shape="kv", N=512,
                  K=2048, k=4, M=1, dtype="bfloat16", regime="host", us=round(us, 3))
             for name, us in meta["eager_host_us"].items()]
    return [dict(r, **run) for r in records + eager]


def markdown(meta, records, summary_only=False) -> str:
    lines = [f"# bench_linear: {meta['gpu']}, {meta['date']}, commit {meta['commit']}", "",
             f"copy bandwidth {meta['copy_bandwidth_GBps']} GB/s; {meta['sms']} SMs; L2 {meta['l2_MiB']} MiB; "
             f"command `{meta['command']}`", "",
             "Eager host time per call (µs): " + ", ".join(f"{k} {v:.2f}" for k, v in meta["eager_host_us"].items()), ""]
    kb = [r for r in records if r["op"].startswith("kbit") and r["dtype"] == "bfloat16"]
    for regime in ("cold", "hot"):
        for k in sorted({r["k"] for r in kb}):
            rows = [r for r in kb if r["regime"] == regime and r["k"] == k]
            Ms = sorted({r["M"] for r in rows})
            lines += [f"## {regime.upper()}, k={k}, bf16: kbit µs / cuBLAS bf16 µs (speedup, kbit roofline %)", "",
                      "| shape | K x N | " + " | ".join(f"M={M}" for M in Ms) + " |",
                      "| --- | --- | " + " | ".join("---:" for _ in Ms) + " |"]
            by = {(r["shape"], r["M"]): r for r in rows}
            shapes = list(dict.fromkeys(r["shape"] for r in rows))
            for s in shapes:
                r0 = by[(s, Ms[0])]
                cells = []
                for M in Ms:
                    r = by[(s, M)]
                    cells.append(f"{r['us']:.1f} / {r['baseline_us']:.1f} ({r['baseline_us'] / r['us']:.2f}x, {r['roofline_pct']:.0f}%)")
                lines.append(f"| {s} | {r0['K']}x{r0['N']} | " + " | ".join(cells) + " |")
            if all(s in shapes for s in QWEN3_BLOCK):
                cells = []
                for M in Ms:
                    t = sum(by[(s, M)]["us"] for s in QWEN3_BLOCK)
                    b = sum(by[(s, M)]["baseline_us"] for s in QWEN3_BLOCK)
                    cells.append(f"{t:.1f} / {b:.1f} ({b / t:.2f}x)")
                lines.append("| Qwen3 block total | 5 dense | " + " | ".join(cells) + " |")
            lines.append("")
    if not summary_only:
        lines += ["## All records", "", "| op | shape | k | M | dtype | regime | µs | cuBLAS bf16 µs | roofline % |",
                  "| --- | --- | ---: | ---: | --- | --- | ---: | ---: | ---: |"]
        for r in records:
            lines.append(f"| {r['op']} | {r['shape']} | {r['k']} | {r['M']} | {r['dtype']} | {r['regime']} | {r['us']:.2f} | "
                         f"{r.get('baseline_us', '')} | {r['roofline_pct']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
