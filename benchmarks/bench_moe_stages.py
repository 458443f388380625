"""What running the routed experts stage by stage costs: the fused op against vllm_kbit.moe.fused_moe_stages.

vLLM's LoRA layer wraps every MoE layer when `--enable-lora` is given, and the kbit experts then run stage by stage
(routing, gate_up, a hook, SiLU-and-mul, down, a hook, the router-weighted sum) so that the adapters can add to the
intermediate results. This times, per MoE layer shape and T, COLD (weight copies rotated beyond L2), CUDA-graph
replay, bf16 activations:

  fused     kbit_fused_moe, what runs without LoRA;
  stages    fused_moe_stages with no hooks: the kernels and glue the experts add under LoRA (vLLM's adapter
            kernels, which every quantization method pays alike, are not included).

ratio = t(stages) / t(fused). Writes moe_stages_<gpu>_<date>.json and .md into --out.

    python benchmarks/bench_moe_stages.py --out DIR [--layers qwen3_30b_moe] [--bits 4] [--tokens 1,16,64,256,1024,4096]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_kernels as bk  # noqa: E402
from bench_linear import copy_bandwidth, graph_time_us  # noqa: E402
from bench_rotate import run_meta, write_results  # noqa: E402
from vllm_kbit.moe import fused_moe_stages  # noqa: E402

TOKENS = (1, 4, 16, 64, 256, 1024, 4096)


def run_layer(layer: str, k: int, Ts, l2: int, rows: list) -> None:
    E, top_k, H, I = bk.MOE_LAYERS[layer]
    impl = bk.KbitMoe(E, top_k, H, I, k)
    n = bk.fit_copies(bk.cold_copies(E * impl.expert_bytes(), l2), E * impl.expert_bytes(), layer)
    weights = [impl.build(first=i == 0) for i in range(n)]
    stages = lambda W, x, ids, w: fused_moe_stages(x, ids, w, *W, impl.cb, I)  # noqa: E731
    for T in Ts:
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        routes = [bk.routing(T, E, top_k) for _ in range(bk.ROUTINGS)]
        args = [(weights[i % n], routes[i % len(routes)]) for i in range(max(n, len(routes)))]
        fused_out = impl.call(args[0][0], x, *args[0][1])
        stage_out = stages(args[0][0], x, *args[0][1])
        err = bk.rel_err(stage_out.float(), fused_out.float())
        assert torch.isfinite(stage_out).all() and err < 2e-2, f"{layer} T={T}: stages differ from the fused op ({err:.2e})"
        t_fused = graph_time_us([functools.partial(impl.call, W, x, *r) for W, r in args], min_calls=20, replays=10)
        t_stages = graph_time_us([functools.partial(stages, W, x, *r) for W, r in args], min_calls=20, replays=10)
        rec = dict(layer=layer, k=k, T=T, fused_us=round(t_fused, 3), stages_us=round(t_stages, 3),
                   ratio=round(t_stages / t_fused, 3), rel_err=float(f"{err:.2e}"))
        rows.append(rec)
        print(json.dumps(rec), flush=True)
    del weights
    torch.cuda.empty_cache()


def markdown(meta: dict, rows: list) -> str:
    out = [f"# Routed experts stage by stage (vLLM's LoRA path) against the fused op ({meta['gpu']})", "",
           f"date {meta['date']}, commit {meta['commit']}, torch {meta['torch']}", "", f"command: `{meta['command']}`", "",
           "COLD, CUDA-graph replay, bf16 activations; ratio = t(stages) / t(fused); rel err: stages against fused.", "",
           "| layer | k | T | fused µs | stages µs | ratio | rel err |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    out += [f"| {r['layer']} | {r['k']} | {r['T']} | {r['fused_us']:.2f} | {r['stages_us']:.2f} | {r['ratio']:.2f} | "
            f"{r['rel_err']:.1e} |" for r in rows]
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--layers", default="qwen3_30b_moe", help=f"comma list of {', '.join(bk.MOE_LAYERS)}")
    ap.add_argument("--bits", default="4")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--commit", default=None)
    args = ap.parse_args(argv)
    props = torch.cuda.get_device_properties(0)
    copy_bandwidth()  # warms the device up as bench_kernels does
    rows: list = []
    for layer in args.layers.split(","):
        for k in (int(v) for v in args.bits.split(",")):
            run_layer(layer, k, [int(t) for t in args.tokens.split(",")], props.L2_cache_size, rows)
    write_results(args.out, "moe_stages", run_meta(props.name, args.commit), rows, markdown)

if __name__ == "__main__":
    main()
