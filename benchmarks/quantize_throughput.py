"""Throughput of the kbit quantize and dequantize CUDA kernels on large weights.

Kernel time comes from CUDA-graph replay: one graph holds back-to-back calls that cycle
through enough weight copies to exceed 4x the L2 cache (so every call reads from device
memory), and the median over many replays is divided by the calls in the graph. Reported
next to a device-to-device copy measured in the same run (bytes read + written).

    python benchmarks/quantize_throughput.py [--out DIR] [--commit SHA]

writes quantize_throughput_<gpu>_<date>.json and .md into DIR (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import statistics
import subprocess
import sys

import torch

import vllm_kbit
from vllm_kbit import reference as fmt

SHAPES = ((8192, 28672), (4096, 14336), (2048, 5120))  # (K, N), target shapes of docs/architecture.md; weights are [N, K]
BITS = (2, 3, 4, 5)


def median_ms(fn_calls, replays: int = 30) -> float:
    """Median time of one call: a CUDA graph of the calls, replayed `replays` times after warm-up."""
    calls = len(fn_calls)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fn_calls:  # warm-up outside the graph (module load, allocator)
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fn_calls:
            fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return statistics.median(times)


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy of 1 GiB, counting bytes read plus bytes written."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = median_ms([lambda: dst.copy_(src)] * 4)
    return 2 * n / ms / 1e6


def copies_for(nbytes: int) -> int:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(1, math.ceil(4 * l2 / nbytes))


def bench_shape(K: int, N: int, copy_gbs: float) -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    in_bytes = N * K * 2
    n_copies = copies_for(in_bytes)
    weights = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(n_copies)]
    for k in BITS:
        cb = fmt.normal_float_codebook(k, "cuda")
        q_bytes = N * (K // 32) * (4 * k + 1)
        for search in (False, True):
            calls = [lambda W=W: torch.ops.kbit.quantize(W, cb, k, search) for W in weights] * max(1, 8 // n_copies)
            ms = median_ms(calls)
            rows.append(dict(op="quantize_searched" if search else "quantize", K=K, N=N, k=k, dtype="bfloat16", ms=ms,
                             read_gbs=in_bytes / ms / 1e6, total_gbs=(in_bytes + q_bytes) / ms / 1e6, copies=n_copies))

        packed = [torch.ops.kbit.quantize(W, cb, k) for W in weights[: copies_for(q_bytes + in_bytes)]]
        calls = [lambda q=q, a=a: torch.ops.kbit.dequantize(q, a, cb, torch.bfloat16) for q, a in packed]
        calls = calls * max(1, 8 // len(calls))
        ms = median_ms(calls)
        rows.append(dict(op="dequantize", K=K, N=N, k=k, dtype="bfloat16", ms=ms, read_gbs=q_bytes / ms / 1e6,
                         total_gbs=(in_bytes + q_bytes) / ms / 1e6, copies=len(packed)))

        packed_rt = [torch.ops.kbit.repack(q, a) for q, a in packed]
        calls = [lambda q=q, a=a: torch.ops.kbit.dequantize_runtime(q, a, cb, N, K, torch.bfloat16) for q, a in packed_rt]
        calls = calls * max(1, 8 // len(calls))
        ms = median_ms(calls)
        rows.append(dict(op="dequantize_runtime", K=K, N=N, k=k, dtype="bfloat16", ms=ms, read_gbs=q_bytes / ms / 1e6,
                         total_gbs=(in_bytes + q_bytes) / ms / 1e6, copies=len(packed_rt)))
        del packed, packed_rt
    for r in rows:
        r["copy_fraction"] = r["total_gbs"] / copy_gbs
    del weights
    torch.cuda.empty_cache()
    return rows


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--commit", default=os.environ.get("KBIT_COMMIT") or git_commit())
    args = parser.parse_args()
    assert vllm_kbit.HAS_CUDA_KERNELS, "the CUDA extension is not loaded: this would time the PyTorch reference"

    gpu = torch.cuda.get_device_name(0)
    now = datetime.datetime.now(datetime.timezone.utc)
    copy_gbs = copy_bandwidth_gbs()
    rows = [r for K, N in SHAPES for r in bench_shape(K, N, copy_gbs)]
    meta = dict(gpu=gpu, date=now.isoformat(timespec="seconds"), commit=args.commit, torch=torch.__version__,
                command="python " + " ".join(shlex.quote(a) for a in sys.argv), copy_gbs=copy_gbs,
                method="CUDA-graph replay, median of 30 replays; weight copies rotated to exceed 4x L2; "
                "quantize read_gbs = bf16 bytes read; total_gbs = bf16 + packed bytes (read + written)")

    lines = [f"# kbit quantize / dequantize throughput on {gpu}", "",
             f"date {meta['date']}, commit {meta['commit']}, torch {meta['torch']}", "",
             f"command: `{meta['command']}`", "", f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write)", "",
             meta["method"], "",
             "| op | K | N | k | ms | bf16 GB/s | total GB/s | of copy |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['op']} | {r['K']} | {r['N']} | {r['k']} | {r['ms']:.3f} | "
                     f"{(r['K'] * r['N'] * 2) / r['ms'] / 1e6:.0f} | {r['total_gbs']:.0f} | {r['copy_fraction']:.0%} |")
    md = "\n".join(lines) + "\n"
    print(md)

    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"quantize_throughput_{gpu.replace(' ', '_')}_{now.date().isoformat()}")
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta=meta, results=rows), f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(md)


if __name__ == "__main__":
    main()
