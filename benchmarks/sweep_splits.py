"""Times a dense kernel at every K split count (1..8), COLD, k=4, next to the launch with its heuristic's
split count (column "auto"): the data for tuning gemv_splits / mma_splits. --kernel mma (default) also
sweeps both row-group widths r; --kernel gemv runs M = 1..4 (r does not apply: shown as 0). Writes
sweep_<kernel>_splits_<gpu>_<date>.{json,md} to --out.

    python benchmarks/sweep_splits.py --commit <sha> [--kernel gemv] [--shapes qkv,o,llama70b_gate_up] [--m 1,2]
"""

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_linear import SHAPES, copies_for, graph_time_us, random_runtime_weight  # noqa: E402

K_BITS = 4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--commit", default=os.environ.get("KBIT_COMMIT", "unknown"))
    ap.add_argument("--kernel", choices=("mma", "gemv"), default="mma")
    ap.add_argument("--shapes", default="qkv,o,gate_up,down,llama8b_gate_up,llama70b_gate_up",
                    help="comma-separated names of bench_linear.SHAPES, or 'all'")
    ap.add_argument("--m", help="default: 8,16,32,64 (mma), 1,2,4 (gemv)")
    args = ap.parse_args()
    gemv = args.kernel == "gemv"
    ms = [int(m) for m in (args.m or ("1,2,4" if gemv else "8,16,32,64")).split(",")]

    props = torch.cuda.get_device_properties(0)
    gpu, l2 = props.name, props.L2_cache_size
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    mma_op, gemv_op = torch.ops.kbit._mma_linear.default, torch.ops.kbit._gemv_linear.default
    records = []
    for name, K, N in (s for s in SHAPES if args.shapes == "all" or s[0] in args.shapes.split(",")):
        w0 = random_runtime_weight(N, K, K_BITS)
        nbytes = w0.qweight_rt.numel() * 4 + w0.absmax_rt.numel()
        ws = [w0] + [random_runtime_weight(N, K, K_BITS) for _ in range(copies_for(nbytes, "cold", l2) - 1)]
        n_tiles, k_tiles = w0.qweight_rt.shape[0], w0.qweight_rt.shape[1]
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            _, _, max_splits, p, r_auto, m_blocks = torch.ops.kbit.linear_plan(
                M, N, K, torch.bfloat16, props.major, props.multi_processor_count, 1, "gemv" if gemv else "mma")
            for r in [0] if gemv else sorted({1, r_auto}):
                ctas_per_split = n_tiles if gemv else -(-n_tiles // r) * m_blocks
                for s in range(0, max_splits + 1):  # 0: the heuristic's choice
                    if gemv:
                        fns = [lambda w=w, s=s: gemv_op(x, w.qweight_rt, w.absmax_rt, w.codebook, N, K, None, s) for w in ws]
                    else:
                        fns = [lambda w=w, s=s, r=r: mma_op(x, w.qweight_rt, w.absmax_rt, w.codebook, N, K, None, r, s)
                               for w in ws]
                    us = graph_time_us(fns)
                    records.append(dict(gpu=gpu, commit=args.commit, date=date, kernel=args.kernel, shape=name, N=N, K=K,
                                        k=K_BITS, M=M, p=p, r=r, splits=s, ctas=ctas_per_split * s if s else None,
                                        us=round(us, 2)))
                    print(f"{name} M={M} r={r} S={s or 'auto'}: {us:.1f} us", flush=True)
            del x
        del ws, w0

    stem = os.path.join(args.out, f"sweep_{args.kernel}_splits_{gpu.replace(' ', '_')}_{date}")
    os.makedirs(args.out, exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump(records, f, indent=1)
    lines = [f"# {args.kernel.upper()} kernel split sweep: {gpu}, {date}, commit {args.commit}", "",
             f"COLD, k={K_BITS}, bf16, µs per call (CUDA-graph replay); `*` marks the fastest split count; auto = the "
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


if __name__ == "__main__":
    main()
