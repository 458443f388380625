"""Throughput of the kbit quantize and dequantize kernels on large weights, CUDA or CPU.

CPU (``--device cpu``, any machine): the compiled CPU quantizer (vllm_kbit._cpu), what ``vllm-kbit
convert --device cpu`` runs, in weights per second at each k with the default scale search, on one
thread and on all of torch's threads; median of 5 calls on a fresh random bf16 weight, after a warm-up.

CUDA (default): kernel time comes from CUDA-graph replay: one graph holds back-to-back calls that cycle
through enough weight copies to exceed 4x the L2 cache (so every call reads from device
memory), and the median over many replays is divided by the calls in the graph. Reported
next to a device-to-device copy measured in the same run (bytes read + written).

    python benchmarks/quantize_throughput.py [--device cuda|cpu] [--out DIR] [--commit SHA]

writes quantize_throughput_<gpu or cpu>_<date>.json and .md into DIR (default benchmarks/results).
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
import vllm_kbit.ops
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


def median_ms_eager(fn_calls, repeats: int = 10) -> float:
    """Median time of one call, run eagerly between CUDA events: for quantize, whose range check reads one
    value back to the host (a load-time op, never captured), so it cannot go into a graph."""
    for fn in fn_calls:
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for fn in fn_calls:
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(fn_calls))
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
            ms = median_ms_eager(calls)
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


CPU_SHAPE = (4096, 4096)  # (K, N): 16.8M weights per call


def cpu_rates() -> list[dict]:
    """Weights/s of kbit::quantize on CPU tensors (default scale search) per k, 1 thread and all threads."""
    import time

    assert vllm_kbit.ops.HAS_CPU_KERNELS, "the CPU kernels are not built: this would time the PyTorch reference"
    K, N = CPU_SHAPE
    threads_all = torch.get_num_threads()
    rows = []
    for threads in sorted({1, threads_all}):
        torch.set_num_threads(threads)
        for k in BITS:
            cb = fmt.default_codebook(k)
            W = (torch.randn(N, K, generator=torch.Generator().manual_seed(k)) * 0.02).to(torch.bfloat16)
            torch.ops.kbit.quantize(W[:64].contiguous(), cb, k)
            times = []
            for _ in range(5):
                t = time.perf_counter()
                torch.ops.kbit.quantize(W, cb, k)
                times.append(time.perf_counter() - t)
            sec = statistics.median(times)
            rows.append(dict(op="quantize_searched", device="cpu", K=K, N=N, k=k, dtype="bfloat16", threads=threads,
                             ms=sec * 1e3, weights_per_s=N * K / sec, weights_per_s_per_thread=N * K / sec / threads))
    torch.set_num_threads(threads_all)
    return rows


def write_results(out: str, name: str, lines: list, meta: dict, rows: list) -> None:
    """Prints the markdown table and writes <out>/<name>.md and .json (meta + rows)."""
    md = "\n".join(lines) + "\n"
    print(md)
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, name)
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta=meta, results=rows), f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(md)


def cpu_main(args) -> None:
    import platform

    now = datetime.datetime.now(datetime.timezone.utc)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    rows = cpu_rates()
    meta = dict(device="cpu", cpu=cpu, cores=os.cpu_count(), date=now.isoformat(timespec="seconds"), commit=args.commit,
                torch=torch.__version__, command="python " + " ".join(shlex.quote(a) for a in sys.argv),
                method="kbit::quantize on a bf16 [4096, 4096] N(0, 0.02) weight, default scale search; median of 5 calls")
    lines = [f"# kbit quantize throughput on the CPU ({cpu}, {meta['cores']} cores)", "",
             f"date {meta['date']}, commit {meta['commit']}, torch {meta['torch']}", "", f"command: `{meta['command']}`", "",
             meta["method"], "", "| k | threads | ms | M weights/s | M weights/s per thread |", "| ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['k']} | {r['threads']} | {r['ms']:.0f} | {r['weights_per_s'] / 1e6:.1f} | "
                     f"{r['weights_per_s_per_thread'] / 1e6:.1f} |")
    write_results(args.out, f"quantize_throughput_cpu_{meta['cores']}cores_{now.date().isoformat()}", lines, meta, rows)


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--commit", default=os.environ.get("KBIT_COMMIT") or git_commit())
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    if args.device == "cpu":
        return cpu_main(args)
    assert vllm_kbit.HAS_CUDA_KERNELS, "the CUDA extension is not loaded: this would time the PyTorch reference"

    gpu = torch.cuda.get_device_name(0)
    now = datetime.datetime.now(datetime.timezone.utc)
    copy_gbs = copy_bandwidth_gbs()
    rows = [r for K, N in SHAPES for r in bench_shape(K, N, copy_gbs)]
    meta = dict(gpu=gpu, date=now.isoformat(timespec="seconds"), commit=args.commit, torch=torch.__version__,
                command="python " + " ".join(shlex.quote(a) for a in sys.argv), copy_gbs=copy_gbs,
                method="CUDA-graph replay, median of 30 replays (quantize: eager between CUDA events, range check "
                "included, median of 10); weight copies rotated to exceed 4x L2; "
                "quantize read_gbs = bf16 bytes read; total_gbs = bf16 + packed bytes (read + written)")

    lines = [f"# kbit quantize / dequantize throughput on {gpu}", "",
             f"date {meta['date']}, commit {meta['commit']}, torch {meta['torch']}", "",
             f"command: `{meta['command']}`", "", f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write)", "",
             meta["method"], "",
             "quantize_searched is the default (scale search), what `vllm-kbit convert` and online loading run.", "",
             "| op | K | N | k | ms | G weights/s | bf16 GB/s | total GB/s | of copy |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['op']} | {r['K']} | {r['N']} | {r['k']} | {r['ms']:.3f} | {r['K'] * r['N'] / r['ms'] / 1e6:.0f} | "
                     f"{(r['K'] * r['N'] * 2) / r['ms'] / 1e6:.0f} | {r['total_gbs']:.0f} | {r['copy_fraction']:.0%} |")
    write_results(args.out, f"quantize_throughput_{gpu.replace(' ', '_')}_{now.date().isoformat()}", lines, meta, rows)


if __name__ == "__main__":
    main()
