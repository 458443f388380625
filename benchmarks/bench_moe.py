"""Routed-expert (MoE) benchmark: the whole kbit::fused_moe layer against the same layer in bf16
with torch._grouped_mm and the same permutation, plus the single grouped-GEMM view.

Kernel time from CUDA-graph replay of back-to-back calls (bench_linear.graph_time_us). HOT:
one weight copy and one routing; COLD: weight copies (and routings) rotated so that the
weights the calls touch exceed 4x the L2, what decode across layers sees. Weights are random
packed codes (kbit) or random bf16; activations random; routing = top-k of random scores.

    python benchmarks/bench_moe.py --commit $(git rev-parse --short HEAD) --out benchmarks/results

Writes moe_<gpu>_<date>.json (a list of records) and .md into --out. Layer records: op
kbit_moe (automatic path), kbit_moe_gemv / kbit_moe_grouped_mma / kbit_moe_grouped_mm (path forced,
k=4 only), bf16_grouped_mm (baseline); `baseline_us` = the bf16 layer in the same run. GEMM records
(view "gemm"): one projection of 8 experts with M rows each, kbit grouped GEMV, kbit grouped
dequant + MMA, kbit dequantize + grouped GEMM, fp16 torch.bmm and bf16 torch._grouped_mm.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
import vllm_kbit  # noqa: E402
from bench_linear import copy_bandwidth, graph_time_us  # noqa: E402
from vllm_kbit import reference as fmt  # noqa: E402
from vllm_kbit.moe import kbit_fused_moe  # noqa: E402

MODELS = [  # name, E, top_k, H, I
    ("qwen3_30b_a3b", 128, 8, 2048, 768),
    ("glm47_flash_routed", 64, 4, 2048, 1536),
    ("qwen3_next_80b", 512, 10, 2048, 512),
]
TOKENS = (1, 4, 16, 64, 256, 1024, 4096)
GEMV_FORCED_MAX_T = 1024  # the GEMV path re-reads an expert's tiles per 4 rows: far too slow beyond
GEMM_M = (1, 4, 16, 64, 256, 1024)
MAX_COPIES = 16


def distinct_experts(E, top_k, T):
    """Expected number of experts T tokens pick (top_k distinct each, uniform)."""
    return E * (1 - (1 - top_k / E) ** T)


def cold_copies(touched_bytes, l2):
    return min(MAX_COPIES, max(2, math.ceil(4 * l2 / max(touched_bytes, 1)) + 1))


def kbit_bytes(N, K, k):
    """Bytes of one [N, K] weight in the runtime layout (packed planes + scale codes)."""
    q_shape, a_shape = fmt.runtime_shapes(N, K, k)
    return 4 * math.prod(q_shape) + math.prod(a_shape)


def random_stacked(E, N, K, k):
    q_shape, a_shape = fmt.runtime_shapes(N, K, k)
    q = torch.randint(-(2**31), 2**31 - 1, (E, *q_shape), dtype=torch.int32, device="cuda")
    a = torch.randint(80, 120, (E, *a_shape), dtype=torch.uint8, device="cuda")
    return q, a


def routing(T, E, top_k, n):
    out = []
    for _ in range(n):
        ids = torch.topk(torch.rand(T, E, device="cuda"), top_k, dim=1).indices.to(torch.int32)
        out.append((ids, torch.softmax(torch.randn(T, top_k, device="cuda"), -1)))
    return out


def bf16_layer(x, ids, w, W13, W2, I):
    """The baseline: same routing kernel and permutation, bf16 weights, torch._grouped_mm."""
    T, top_k = ids.shape
    E = W13.shape[0]
    offsets, pos, slot_of, _, _ = torch.ops.kbit._moe_route(ids, None, E, 4, 0)
    offs = offsets[1:]
    xp = x.index_select(0, slot_of.clamp(min=0) // top_k)
    g = torch._grouped_mm(xp, W13.transpose(1, 2), offs=offs)
    h = F.silu(g[:, :I]) * g[:, I:]
    y = torch._grouped_mm(h, W2.transpose(1, 2), offs=offs)
    return (y.index_select(0, pos.long()).view(T, top_k, -1).float() * w[..., None]).sum(1).to(x.dtype)


def calls_for(T):
    return 20 if T <= 256 else 6


def bench_layers(args, l2, common, records, save):
    bits = [int(b) for b in args.bits.split(",")]
    for name, E, top_k, H, I in [m for m in MODELS if m[0] in args.models.split(",")]:
        for regime in args.regimes.split(","):
            n_rt = 1 if regime == "hot" else 8
            routes = {T: routing(T, E, top_k, n_rt) for T in TOKENS}
            xs = {T: torch.randn(T, H, device="cuda", dtype=torch.bfloat16) for T in TOKENS}
            expert_bf16 = 2 * 3 * H * I  # w13 + w2 bytes of one expert
            n_base = 1 if regime == "hot" else cold_copies(distinct_experts(E, top_k, 1) * expert_bf16, l2)
            W = [(torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.02,
                  torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.02) for _ in range(n_base)]
            base = {}
            for T in TOKENS:
                n = 1 if regime == "hot" else cold_copies(distinct_experts(E, top_k, T) * expert_bf16, l2)
                fns = [lambda i=i, T=T: bf16_layer(xs[T], *routes[T][i % n_rt], *W[i % n], I) for i in range(max(n, n_rt))]
                base[T] = graph_time_us(fns, min_calls=calls_for(T), replays=10)
                records.append(dict(common, view="layer", model=name, op="bf16_grouped_mm", E=E, top_k=top_k, T=T, H=H,
                                    I=I, k=0, dtype="bfloat16", regime=regime, us=round(base[T], 2),
                                    baseline_us=round(base[T], 2)))
            del W
            torch.cuda.empty_cache()
            for k in bits:
                expert_kbit = kbit_bytes(2 * I, H, k) + kbit_bytes(H, I, k)
                n_w = 1 if regime == "hot" else cold_copies(distinct_experts(E, top_k, 1) * expert_kbit, l2)
                cb = fmt.normal_float_codebook(k, "cuda")
                Wk = [(*random_stacked(E, 2 * I, H, k), *random_stacked(E, H, I, k)) for _ in range(n_w)]
                for T in TOKENS:
                    n = 1 if regime == "hot" else cold_copies(distinct_experts(E, top_k, T) * expert_kbit, l2)
                    paths = [("kbit_moe", "auto")]
                    if k == 4:
                        paths += [("kbit_moe_gemv", "gemv")] if T <= GEMV_FORCED_MAX_T else []
                        paths += [("kbit_moe_grouped_mma", "grouped_mma"), ("kbit_moe_grouped_mm", "grouped_mm")]
                    for op, path in paths:
                        def call(i, T=T, path=path, path_id=torch.ops.kbit._moe_path_id(path)):
                            ids, w = routes[T][i % n_rt]
                            if path == "auto":
                                return kbit_fused_moe(xs[T], ids, w, *Wk[i % n], cb, I)
                            return torch.ops.kbit._fused_moe_cuda(xs[T], ids, w, *Wk[i % n], cb, I, None, False, path_id)
                        us = graph_time_us([lambda i=i: call(i) for i in range(max(n, n_rt))], min_calls=calls_for(T),
                                           replays=10)
                        records.append(dict(common, view="layer", model=name, op=op, E=E, top_k=top_k, T=T, H=H, I=I,
                                            k=k, dtype="bfloat16", regime=regime, us=round(us, 2),
                                            baseline_us=round(base[T], 2)))
                        if op == "kbit_moe":
                            print(f"{name:>19} {regime:4} k={k} T={T:5}: {us:9.1f} us  bf16 {base[T]:9.1f} us  "
                                  f"x{base[T] / us:5.2f}", flush=True)
                del Wk
                torch.cuda.empty_cache()
                save()


def bench_gemm(args, l2, common, records):
    """One grouped projection of 8 experts, M rows each, against fp16 torch.bmm and bf16 grouped mm."""
    E = 8
    for proj, K, N in (("gate_up", 2048, 512), ("down", 512, 2048)):
        for regime in args.regimes.split(","):
            n16 = 1 if regime == "hot" else cold_copies(E * N * K * 2, l2)
            n4 = 1 if regime == "hot" else cold_copies(E * kbit_bytes(N, K, 4), l2)
            Wh = [torch.randn(E, N, K, device="cuda", dtype=torch.float16) * 0.02 for _ in range(n16)]
            Wb = [w.to(torch.bfloat16) for w in Wh]
            cb = fmt.normal_float_codebook(4, "cuda")
            Wk = [random_stacked(E, N, K, 4) for _ in range(n4)]
            for M in GEMM_M:
                A16 = torch.randn(E, M, K, device="cuda", dtype=torch.float16)
                Ab = A16.view(E * M, K).to(torch.bfloat16)
                # Chunks as the fused op makes them for M tokens: the GEMV's one-row chunks at M = 1, else
                # kMoeChunkRows; the grouped MMA's height covering M rows per expert.
                gemv = vllm_kbit.ops.named(torch.ops.kbit.moe_plan, M, 1, E, 4, "gemv")
                rows, gemv_kernel = gemv.chunk_rows, torch.ops.kbit._moe_kernel_id(gemv.kernel)
                ids = torch.arange(E, dtype=torch.int32, device="cuda").repeat_interleave(M).view(-1, 1)
                offsets, _, _, chunks, num = torch.ops.kbit._moe_route(ids, None, E, rows,
                                                                       torch.ops.kbit._moe_max_chunks(E * M, E, rows))
                offs = offsets[1:]
                t = {
                    "fp16_bmm": graph_time_us([lambda w=w: torch.bmm(A16, w.transpose(1, 2)) for w in Wh]),
                    "bf16_grouped_mm": graph_time_us([lambda w=w: torch._grouped_mm(Ab, w.transpose(1, 2), offs=offs)
                                                      for w in Wb]),
                    "kbit_dequant_grouped_mm": graph_time_us([lambda w=w: torch._grouped_mm(
                        Ab, torch.ops.kbit.dequantize_runtime(w[0].view(-1, *w[0].shape[2:]), w[1].view(-1, *w[1].shape[2:]),
                                                              cb, E * N, K, torch.bfloat16).view(E, N, K).transpose(1, 2),
                        offs=offs) for w in Wk]),
                }
                if M <= 256:
                    t["kbit_grouped_gemv"] = graph_time_us(
                        [lambda w=w: torch.ops.kbit._moe_grouped_linear(Ab, chunks, num, w[0], w[1], cb, N, K,
                                                                        gemv_kernel, rows) for w in Wk])
                if M <= 4:  # the GEMV at every K split count (the heuristic's choice is the row above)
                    max_splits = torch.ops.kbit.linear_plan(1, N, K, torch.bfloat16, 9, 132, 1, "gemv")[2]
                    for s in range(1, max_splits + 1):
                        t[f"kbit_grouped_gemv_s{s}"] = graph_time_us(
                            [lambda w=w, s=s: torch.ops.kbit._moe_grouped_linear(Ab, chunks, num, w[0], w[1], cb, N, K,
                                                                                 gemv_kernel, rows, s) for w in Wk])
                mma = vllm_kbit.ops.named(torch.ops.kbit.moe_plan, E * M, 1, E, 4, "grouped_mma")
                mrows, mmax, mma_kernel = mma.chunk_rows, mma.max_chunks, torch.ops.kbit._moe_kernel_id(mma.kernel)
                _, _, _, mchunks, mnum = torch.ops.kbit._moe_route(ids, None, E, mrows, mmax)
                t["kbit_grouped_mma"] = graph_time_us(
                    [lambda w=w: torch.ops.kbit._moe_grouped_linear(Ab, mchunks, mnum, w[0], w[1], cb, N, K, mma_kernel,
                                                                    mrows) for w in Wk])
                for op, us in t.items():
                    records.append(dict(common, view="gemm", op=op, proj=proj, E=E, M=M, K=K, N=N,
                                        k=4 if op.startswith("kbit") else 0, dtype="bfloat16", regime=regime,
                                        us=round(us, 2), baseline_us=round(t["fp16_bmm"], 2)))
                print(f"gemm {proj:7} {regime:4} M={M:5}: " + "  ".join(f"{o} {u:7.1f}" for o, u in t.items()), flush=True)
            del Wh, Wb, Wk
            torch.cuda.empty_cache()


def markdown(meta, records) -> str:
    lines = [f"# bench_moe: {meta['gpu']}, {meta['date']}, commit {meta['commit']}", "",
             f"copy bandwidth {meta['copy_bandwidth_GBps']} GB/s; L2 {meta['l2_MiB']} MiB; command `{meta['command']}`", "",
             "Whole routed-expert layer (bf16 activations), µs per call: kbit (automatic path) / bf16 layer "
             "(torch._grouped_mm, same routing and permutation) and speedup; k=4 rows also give the forced "
             "paths (GEMV / grouped dequant + MMA / dequantize + grouped mm).", ""]
    lay = [r for r in records if r["view"] == "layer"]
    for model in dict.fromkeys(r["model"] for r in lay):
        for regime in ("cold", "hot"):
            rows = [r for r in lay if r["model"] == model and r["regime"] == regime]
            if not rows:
                continue
            E, top_k, H, I = rows[0]["E"], rows[0]["top_k"], rows[0]["H"], rows[0]["I"]
            Ts = sorted({r["T"] for r in rows})
            lines += [f"## {model} (E={E}, top-{top_k}, H={H}, I={I}), {regime.upper()}", "",
                      "| k | path | " + " | ".join(f"T={T}" for T in Ts) + " |",
                      "| --- | --- | " + " | ".join("---:" for _ in Ts) + " |"]
            by = {(r["op"], r["k"], r["T"]): r for r in rows}
            b = [by.get(("bf16_grouped_mm", 0, T)) for T in Ts]
            lines.append("| bf16 | grouped_mm | " + " | ".join(f"{r['us']:.1f}" if r else "" for r in b) + " |")
            for k in sorted({r["k"] for r in rows if r["k"]}):
                for op in ("kbit_moe", "kbit_moe_gemv", "kbit_moe_grouped_mma", "kbit_moe_grouped_mm"):
                    cells = [by.get((op, k, T)) for T in Ts]
                    if not any(cells):
                        continue
                    lines.append(f"| {k} | {op.replace('kbit_moe', 'auto').replace('auto_', '')} | " + " | ".join(
                        f"{r['us']:.1f} ({r['baseline_us'] / r['us']:.2f}x)" if r else "" for r in cells) + " |")
            lines.append("")
    gemm = [r for r in records if r["view"] == "gemm"]
    if gemm:
        lines += ["## One grouped projection, 8 experts x M rows, k=4: µs (fp16 bmm / this)", ""]
        for regime in ("cold", "hot"):
            for proj in ("gate_up", "down"):
                rows = [r for r in gemm if r["regime"] == regime and r["proj"] == proj]
                if not rows:
                    continue
                Ms = sorted({r["M"] for r in rows})
                K, N = rows[0]["K"], rows[0]["N"]
                lines += [f"### {proj} (K={K}, N={N}), {regime.upper()}", "",
                          "| op | " + " | ".join(f"M={M}" for M in Ms) + " |", "| --- | " + " | ".join("---:" for _ in Ms) + " |"]
                by = {(r["op"], r["M"]): r for r in rows}
                forced = sorted({r["op"] for r in rows if r["op"].startswith("kbit_grouped_gemv_s")}, key=lambda o: int(o[19:]))
                for op in ("fp16_bmm", "bf16_grouped_mm", "kbit_grouped_gemv", *forced, "kbit_grouped_mma",
                           "kbit_dequant_grouped_mm"):
                    cells = [by.get((op, M)) for M in Ms]
                    lines.append(f"| {op} | " + " | ".join(
                        f"{r['us']:.1f} ({r['baseline_us'] / r['us']:.2f}x)" if r else "" for r in cells) + " |")
                lines.append("")
    return "\n".join(lines) + "\n"


def plot(json_path: str) -> str:
    """Speedup over the bf16 layer vs tokens, one panel per model (COLD), one line per k; PNG beside the JSON."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as f:
        recs = [r for r in json.load(f) if r["view"] == "layer" and r["regime"] == "cold" and r["op"] == "kbit_moe"]
    models = list(dict.fromkeys(r["model"] for r in recs))
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for k in sorted({r["k"] for r in recs if r["model"] == model}):
            rows = sorted((r for r in recs if r["model"] == model and r["k"] == k), key=lambda r: r["T"])
            ax.plot([r["T"] for r in rows], [r["baseline_us"] / r["us"] for r in rows], marker="o", label=f"k={k}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.axhline(2.0, color="gray", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens T")
        ax.set_ylabel("speedup over bf16 layer")
        ax.set_title(f"{model} (COLD)")
        ax.legend()
    fig.suptitle(f"kbit fused_moe vs bf16 torch._grouped_mm layer, {recs[0]['gpu']}, commit {recs[0]['commit']}")
    fig.tight_layout()
    out = json_path.rsplit(".", 1)[0] + ".png"
    fig.savefig(out, dpi=110)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plot", metavar="JSON", help="only draw the speedup plot of an earlier run's JSON")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--commit", default=os.environ.get("KBIT_COMMIT", "unknown"))
    ap.add_argument("--models", default=",".join(m[0] for m in MODELS))
    ap.add_argument("--bits", default="4,2,3,5")
    ap.add_argument("--regimes", default="cold,hot")
    ap.add_argument("--no-gemm", action="store_true", help="skip the single grouped-GEMM view")
    args = ap.parse_args()
    if args.plot:
        print(plot(args.plot))
        return
    assert torch.cuda.is_available() and vllm_kbit.HAS_CUDA_KERNELS, "needs a GPU and the built extension"
    props = torch.cuda.get_device_properties(0)
    gpu, l2 = props.name, props.L2_cache_size
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    bw = copy_bandwidth()
    print(f"{gpu}: L2 {l2 >> 20} MiB, copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    common = dict(gpu=gpu, commit=args.commit, date=date)
    meta = dict(common, copy_bandwidth_GBps=round(bw / 1e9, 1), l2_MiB=l2 >> 20, command=" ".join(sys.argv))
    os.makedirs(args.out, exist_ok=True)
    tag = f"{gpu.replace(' ', '_')}_{date[:10]}"
    records = []

    def save():  # after every block of measurements, so a run cut short still leaves its results
        with open(os.path.join(args.out, f"moe_{tag}.json"), "w") as f:
            json.dump([dict(r, copy_bandwidth_GBps=meta["copy_bandwidth_GBps"], command=meta["command"]) for r in records],
                      f, indent=1)
        with open(os.path.join(args.out, f"moe_{tag}.md"), "w") as f:
            f.write(markdown(meta, records))

    if not args.no_gemm:
        bench_gemm(args, l2, common, records)
        save()
    bench_layers(args, l2, common, records, save)
    save()
    print(markdown(meta, records))


if __name__ == "__main__":
    main()
