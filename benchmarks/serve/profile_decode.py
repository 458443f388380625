"""Where one decode step's time goes, per weight format: a top-kernels table from torch.profiler around vLLM.

Runs vLLM in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, so the model runner and its kernels are in
reach of the profiler) on the same weightless model and method settings as bench_serve.py, with vLLM's
defaults (torch.compile + CUDA graphs; CUPTI still records the kernels a graph replays). For each batch
size B it profiles generate(max_tokens=1) (prefill + the first token) and generate(max_tokens=1+S) on the
same B prompts, and subtracts: a kernel's time and launch count per decode step are (second - first) / S.
The step's wall time comes the same way from unprofiled runs (median of 3). "GPU busy" is the time at least
one kernel or copy runs (the union of their intervals, by the same subtraction), as a share of the step's
wall time; the rest is launch and host overhead. Per-kernel times are each kernel's own span: under
programmatic dependent launch a kernel starts while the one before it still runs and waits for it, so
their sum can exceed the busy time.

    python3 benchmarks/serve/profile_decode.py --method kbit-4 [--batches 1,16] [--out DIR]

Appends one section per method to DIR/profile_<gpu>_<date>.md (DIR: --out, else
benchmarks/results). Without CUDA (vLLM's CPU build) it lists CPU operators by self time instead.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

import model_dir  # noqa: E402
from bench_serve import MODEL_ROUTING, ROUTINGS, commit, gpu_name, parse_concurrency, routing_env  # noqa: E402
from methods import METHODS  # noqa: E402

# First match wins; names are matched lower-cased.
CATEGORIES = [
    ("kbit", ("kbit",)),
    ("gptq marlin", ("marlin",)),
    ("moe (vLLM)", ("moe", "topk", "expert")),
    ("attention", ("flash", "fmha", "attn", "attention", "rotary", "reshape_and_cache")),
    ("gemm (cuBLAS/CUTLASS)", ("gemm", "cutlass", "nvjet", "xmma", "cublas")),
    ("norm / activation", ("norm", "silu", "act_and_mul")),
    ("memcpy / memset", ("memcpy", "memset")),
]


def category(name: str) -> str:
    low = name.lower()
    return next((c for c, keys in CATEGORIES if any(k in low for k in keys)), "other")


def op_times(prof, device: bool) -> dict[str, list[float]]:
    """name -> [total µs, count]: GPU kernels (device=True) or CPU operators by self time."""
    from torch.autograd import DeviceType

    out: dict[str, list[float]] = {}
    for e in prof.events():
        if device and e.device_type == DeviceType.CUDA:
            us = e.time_range.elapsed_us()
        elif not device and e.device_type == DeviceType.CPU:
            us = e.self_cpu_time_total
        else:
            continue
        acc = out.setdefault(e.name, [0.0, 0])
        acc[0] += us
        acc[1] += 1
    return out


def busy_us(prof) -> float:
    """µs during which at least one GPU kernel or copy ran: the union of their intervals."""
    from torch.autograd import DeviceType

    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA)
    return union_length(spans)


def union_length(spans: list[tuple[float, float]]) -> float:
    """Total length covered by the sorted (start, end) intervals, overlaps counted once."""
    total, end = 0.0, float("-inf")
    for s, e in spans:
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def per_step(short: dict, long: dict, steps: int) -> dict[str, tuple[float, float]]:
    """name -> (µs, count) per decode step, from the runs without and with `steps` decode steps."""
    out = {}
    for name, (us, n) in long.items():
        us0, n0 = short.get(name, (0.0, 0))
        d_us, d_n = (us - us0) / steps, (n - n0) / steps
        if d_us > 0 or d_n > 0:
            out[name] = (max(d_us, 0.0), d_n)
    return out


def section(method: str, batch: int, input_len: int, steps: int, wall_us: float, kernels: dict, device: bool,
            top: int, gpu_busy_us: float | None = None) -> str:
    """One batch's markdown: the step's wall and busy time, then kernel time by category and by kernel.
    gpu_busy_us: the per-step union of kernel intervals (None without a GPU)."""
    busy = sum(us for us, _ in kernels.values())
    if device:
        share = f" ({100 * gpu_busy_us / wall_us:.0f}% of the step)" if wall_us > 0 else ""
        head = (f"Decode step: {wall_us:.0f} µs wall; GPU busy {gpu_busy_us:.0f} µs{share}; "
                f"kernel times summed {busy:.0f} µs (overlapping kernels count twice).")
    else:
        head = f"Decode step: {wall_us:.0f} µs wall; CPU operators (self time): {busy:.0f} µs."
    lines = [
        f"### {method}, batch {batch} ({input_len}-token prompts, {steps} decode steps)",
        "",
        head,
        "",
        "| category | µs / step | % of kernel time |",
        "| --- | ---: | ---: |",
    ]
    by_cat: dict[str, float] = {}
    for name, (us, _) in kernels.items():
        by_cat[category(name)] = by_cat.get(category(name), 0.0) + us
    for cat, us in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {cat} | {us:.1f} | {100 * us / busy:.1f} |")
    lines += ["", "| kernel | µs / step | launches / step | % of kernel time | category |",
              "| --- | ---: | ---: | ---: | --- |"]
    for name, (us, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]:
        short = name if len(name) <= 110 else name[:107] + "..."
        lines.append(f"| `{short.replace('|', '/')}` | {us:.1f} | {n:.1f} | {100 * us / busy:.1f} | {category(name)} |")
    if device and not kernels:
        lines.append("\nNo GPU kernels recorded (CUPTI saw none): rerun with --eager.")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", required=True, choices=list(METHODS))
    ap.add_argument("--batches", default="1,16", help="decode batch sizes (requests in flight)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=model_dir.names(),
                    help="a Qwen3-MoE shape or a public model's recorded config (benchmarks/serve/configs/)")
    ap.add_argument("--routing", default=MODEL_ROUTING, choices=ROUTINGS, help="as bench_serve.py's --routing")
    ap.add_argument("--layers", type=int, help="serve only the first N decoder layers (per-layer times stay those of "
                    "the full model; loading is quicker)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--eager", action="store_true", help="no torch.compile / CUDA graphs (vLLM's --enforce-eager)")
    ap.add_argument("--top", type=int, default=25, help="kernels listed per table")
    ap.add_argument("--out", help="output folder (default: benchmarks/results)")
    ap.add_argument("--work", default="/tmp/kbit_serve")
    args = ap.parse_args()

    os.environ.update(routing_env(args.routing))  # before vLLM reads its environment
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    method = METHODS[args.method]
    qc = model_dir.gptq_config(args.shape) if method.model_variant == "gptq-int4" else None
    model = model_dir.write(args.shape, os.path.join(args.work, f"{args.shape}-{method.model_variant}"), qc)
    kwargs = dict(method.llm_kwargs)
    if args.layers:
        kwargs["hf_overrides"] = {**kwargs.get("hf_overrides", {}), "num_hidden_layers": args.layers}
    device = torch.cuda.is_available()
    t0 = time.monotonic()
    llm = LLM(model=model, load_format="dummy", max_model_len=args.max_model_len, seed=0,
              gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=False,
              enforce_eager=args.eager, **kwargs)
    print(f"{args.method}: engine up in {time.monotonic() - t0:.0f} s", flush=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device else [])
    gen = torch.Generator().manual_seed(0)
    steps = args.decode_steps
    parts = []
    for batch in parse_concurrency(args.batches):
        prompts = [TokensPrompt(prompt_token_ids=torch.randint(0, model_dir.EOS_TOKEN_ID, (args.input_len,), generator=gen).tolist())
                   for _ in range(batch)]
        short, long = (SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in (1, 1 + steps))

        def wall(params) -> float:
            times = []
            for _ in range(3):
                t = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                times.append(time.perf_counter() - t)
            return statistics.median(times)

        llm.generate(prompts, long, use_tqdm=False)  # warm-up
        wall_us = (wall(long) - wall(short)) / steps * 1e6
        traces, busy = [], []
        for params in (short, long):
            with profile(activities=activities) as prof:
                llm.generate(prompts, params, use_tqdm=False)
            traces.append(op_times(prof, device))
            if device:
                busy.append(busy_us(prof))
        kernels = per_step(traces[0], traces[1], steps)
        gpu_busy = (busy[1] - busy[0]) / steps if device else None
        parts.append(section(args.method, batch, args.input_len, steps, wall_us, kernels, device, args.top, gpu_busy))
        print(parts[-1], flush=True)

    gpu = gpu_name()
    out_dir = args.out or os.path.join(REPO, "benchmarks", "results")
    os.makedirs(out_dir, exist_ok=True)
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    path = os.path.join(out_dir, f"profile_{gpu.replace(' ', '_')}_{today}.md")
    header = (f"## {args.method} on {gpu}, {args.shape} shape{f' ({args.layers} layers)' if args.layers else ''} (dummy weights), commit {commit()}, "
              f"{'eager' if args.eager else 'torch.compile + CUDA graphs'}, routing {args.routing}\n\n"
              f"`python3 benchmarks/serve/profile_decode.py {' '.join(sys.argv[1:])}`\n\n")
    with open(path, "a") as f:
        f.write(header + "\n".join(parts) + "\n")
    print("appended to", path)


if __name__ == "__main__":
    main()
