"""Which dense kernel at few rows: the GEMV against the table-decode MMA kernel, each launched with its own
heuristic's split count (and row groups), COLD, CUDA-graph replay, bf16, k = 2..5, M = 1, 2. The data behind
the planner's kGemvPathMaxM (csrc/plan/plan.cpp). Each output is checked against x @ dequantize_runtime(W)^T first.

    python benchmarks/dense_paths.py --commit <sha> [--shapes qkv,o,gate_up,down,llama70b_gate_up] [--m 1,2]
    python benchmarks/dense_paths.py --report RESULTS.json   # only rewrite the .md
Writes dense_paths_<gpu>_<date>.{json,md} to --out.
"""

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_linear import SHAPES, copies_for, graph_time_us, random_runtime_weight  # noqa: E402

CHECK_TOL = 1e-2  # relative Frobenius error against the fp32 product of the dequantized weight


def measure(args) -> dict:
    props = torch.cuda.get_device_properties(0)
    gemv_op, mma_op = torch.ops.kbit._gemv_linear.default, torch.ops.kbit._mma_linear.default
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
                for path, fn in (("gemv", lambda w: gemv_op(x, w.qweight_rt, w.absmax_rt, w.codebook, N, K, None, 0)),
                                 ("mma", lambda w: mma_op(x, w.qweight_rt, w.absmax_rt, w.codebook, N, K, None, 0, 0))):
                    err = float((fn(w0).float() - ref).norm() / ref.norm())
                    if not err <= CHECK_TOL:
                        raise RuntimeError(f"{name} k={k} M={M} {path}: relative error {err:.3g}")
                    rec[path] = round(graph_time_us([lambda w=w: fn(w) for w in ws]), 2)
                rows.append(rec)
                print(rec, flush=True)
            del ws, w0, deq
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    return dict(gpu=props.name, date=date, commit=args.commit, command="python " + " ".join(sys.argv), rows=rows)


def report(res: dict) -> str:
    lines = [f"# GEMV vs MMA at few rows: {res['gpu']}, {res['date']}, commit {res['commit']}", "",
             "COLD, bf16, µs per call (CUDA-graph replay), each kernel at its heuristic's split count; "
             "`mma / gemv` < 1: the MMA kernel is faster.", f"Command: `{res['command']}`", "",
             "| shape (K -> N) | k | M | GEMV µs | MMA µs | mma / gemv |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in res["rows"]:
        lines.append(f"| {r['shape']} ({r['K']} -> {r['N']}) | {r['k']} | {r['M']} | {r['gemv']:.2f} | {r['mma']:.2f} | "
                     f"{r['mma'] / r['gemv']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--commit", default=os.environ.get("KBIT_COMMIT", "unknown"))
    ap.add_argument("--shapes", default="qkv,o,gate_up,down,llama70b_gate_up", help="names of bench_linear.SHAPES")
    ap.add_argument("--bits", default="2,3,4,5")
    ap.add_argument("--m", default="1,2")
    ap.add_argument("--report", metavar="JSON", help="only rewrite the .md of an earlier run's JSON")
    args = ap.parse_args()
    if args.report:
        with open(args.report) as f:
            res = json.load(f)
        stem = args.report[: -len(".json")]
    else:
        import vllm_kbit  # noqa: F401  (loads the extension's ops)
        res = measure(args)
        stem = os.path.join(args.out, f"dense_paths_{res['gpu'].replace(' ', '_')}_{res['date']}")
        os.makedirs(args.out, exist_ok=True)
        with open(stem + ".json", "w") as f:
            json.dump(res, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(report(res))


if __name__ == "__main__":
    main()
