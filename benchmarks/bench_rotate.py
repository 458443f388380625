"""What the input rotation of rotated kbit layers costs: each layer with and without it, in one run.

For the MoE layers (hidden states rotated once per layer before every expert's gate_up, the down projection's
input per routed slot) and the dense layers of bench_kernels.py, at k = 4 by default, COLD (weight copies
rotated beyond L2), CUDA-graph replay:

  base          the kbit layer alone (kbit_fused_moe / kbit_linear), as bench_kernels.py times it;
  +kbit         torch.ops.kbit.hadamard_rotate of the layer's input, then the layer, captured together;
  +hadacore     the sign multiply and vLLM's Hadacore (vllm._custom_ops.hadacore_transform on [.., K/b, b], in
                place on the product), then the layer (needs vLLM's CUDA build; skipped without it);
  down (kbit)   MoE only: torch.ops.kbit.hadamard_rotate of the down projection's input alone ([T * top_k, I]), the
                cost of rotating it as its own kernel rather than inside the activation.

The share is (t(+rotation) - t(base)) / t(base). Writes rotate_<gpu>_<date>.json and .md into --out.

    python benchmarks/bench_rotate.py --out benchmarks/results [--bits 2,3,4] [--tokens 1,4,16,64,256]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_kernels as bk  # noqa: E402
from bench_linear import copy_bandwidth, graph_time_us  # noqa: E402
from vllm_kbit import reference as fmt  # noqa: E402

MOE_T = (1, 4, 16, 64, 256)
DENSE_M = (1, 4, 16, 64)


def block_for(K: int) -> int:
    return fmt.rotation_block(K)  # the converter's default rule


def signs_for(K: int) -> torch.Tensor:
    return fmt.rotation_signs(K, device="cuda")


@functools.lru_cache(maxsize=None)
def hadacore():
    try:
        import vllm._custom_ops as ops
    except Exception:  # noqa: BLE001  (no vLLM CUDA build: the column is skipped)
        return None
    return ops.hadacore_transform if hasattr(torch.ops._C, "hadacore_transform") else None


def rotate_kbit(x, s, b):
    return torch.ops.kbit.hadamard_rotate(x, s, b)


def rotate_hadacore(x, s, b):
    return hadacore()((x * s.to(x.dtype)).unflatten(-1, (-1, b)), inplace=True).flatten(-2, -1)  # diag(s), then H


def timed(fns):
    return graph_time_us(fns, min_calls=20, replays=10)


def run_layer(layer: str, k: int, Ts, l2: int, rows: list) -> None:
    moe = layer in bk.MOE_LAYERS
    if moe:
        E, top_k, H, I = bk.MOE_LAYERS[layer]
        impl = bk.KbitMoe(E, top_k, H, I, k)
        K = H
        touched = lambda T: min(E, T * top_k) * impl.expert_bytes()  # noqa: E731
        nbytes = E * impl.expert_bytes()
    else:
        K, N = bk.DENSE_LAYERS[layer]
        impl = bk.KbitDense(K, N, k)
        touched = lambda T: impl.nbytes()  # noqa: E731
        nbytes = impl.nbytes()
    b = block_for(K)
    s = signs_for(K)
    n = bk.fit_copies(bk.cold_copies(touched(max(Ts)) if not moe else touched(1), l2), nbytes, layer)
    weights = [impl.build(first=i == 0) for i in range(n)]
    for T in Ts:
        x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
        if moe:
            routes = [bk.routing(T, E, top_k) for _ in range(bk.ROUTINGS)]
            layer_fn = lambda W, xx, r: impl.call(W, xx, *r)  # noqa: E731
            args = [(weights[i % n], routes[i % len(routes)]) for i in range(max(n, len(routes)))]
        else:
            layer_fn = lambda W, xx, r: impl.call(W, xx)  # noqa: E731
            args = [(weights[i % n], None) for i in range(n)]
        ref = layer_fn(args[0][0], x, args[0][1])
        rot = layer_fn(args[0][0], rotate_kbit(x, s, b), args[0][1])
        assert torch.isfinite(ref).all() and torch.isfinite(rot).all()
        base = timed([functools.partial(layer_fn, W, x, r) for W, r in args])
        with_kbit = timed([(lambda W=W, r=r: layer_fn(W, rotate_kbit(x, s, b), r)) for W, r in args])
        with_hc = None
        if hadacore() is not None:
            with_hc = timed([(lambda W=W, r=r: layer_fn(W, rotate_hadacore(x, s, b), r)) for W, r in args])
        rec = dict(layer=layer, k=k, T=T, K=K, block=b, base_us=round(base, 3), kbit_rot_us=round(with_kbit, 3),
                   hadacore_rot_us=None if with_hc is None else round(with_hc, 3),
                   kbit_share=round((with_kbit - base) / base, 4),
                   hadacore_share=None if with_hc is None else round((with_hc - base) / base, 4))
        if moe:
            bd = block_for(I)
            xd = torch.randn(T * top_k, I, device="cuda", dtype=torch.bfloat16)
            sd = signs_for(I)
            rec.update(down_block=bd, down_rot_us=round(timed([functools.partial(rotate_kbit, xd, sd, bd)]), 3))
            rec["down_share"] = round(rec["down_rot_us"] / base, 4)
        rows.append(rec)
        print(json.dumps(rec), flush=True)
    del weights
    torch.cuda.empty_cache()


def markdown(meta: dict, rows: list) -> str:
    out = [f"# Input rotation cost: each kbit layer with and without it ({meta['gpu']})", "",
           f"date {meta['date']}, commit {meta['commit']}, torch {meta['torch']}, vLLM {meta['vllm']}", "",
           f"command: `{meta['command']}`", "",
           "COLD, CUDA-graph replay, bf16 activations. share = (t(rotation + layer) - t(layer)) / t(layer); "
           "down: the MoE down projection's input rotated as its own kernel, over t(layer).", "",
           "| layer | k | T / M | b | layer µs | + kbit rotate µs | share | + Hadacore µs | share | down b | down rotate µs | down share |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        pct = lambda v: "" if v is None else f"{100 * v:+.1f}%"  # noqa: E731
        hc = "" if r["hadacore_rot_us"] is None else f"{r['hadacore_rot_us']:.2f}"
        out.append(f"| {r['layer']} | {r['k']} | {r['T']} | {r['block']} | {r['base_us']:.2f} | {r['kbit_rot_us']:.2f} | "
                   f"{pct(r['kbit_share'])} | {hc} | "
                   f"{pct(r['hadacore_share'])} | {r.get('down_block', '')} | {r.get('down_rot_us', '')} | "
                   f"{pct(r.get('down_share'))} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--layers", default="qwen3_30b_moe,glm45_air_moe,qkv,o,llama70b_gate_up")
    ap.add_argument("--bits", default="4")
    ap.add_argument("--tokens", help="comma list of T / M (default MoE 1,4,16,64,256; dense 1,4,16,64)")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args(argv)
    props = torch.cuda.get_device_properties(0)
    gpu = props.name
    l2 = props.L2_cache_size
    copy_bandwidth()  # warms the device up as bench_kernels does
    rows: list = []
    for layer in args.layers.split(","):
        Ts = [int(t) for t in args.tokens.split(",")] if args.tokens else (MOE_T if layer in bk.MOE_LAYERS else DENSE_M)
        for k in (int(v) for v in args.bits.split(",")):
            run_layer(layer, k, Ts, l2, rows)
    meta = dict(gpu=gpu, date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
                commit=args.commit or bk.git_commit(), command="python " + " ".join(sys.argv),
                torch=torch.__version__, vllm=bk.versions().get("vllm"))
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"rotate_{gpu.replace(' ', '_')}_{meta['date']}")
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta, records=rows), f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(markdown(meta, rows))
    print(markdown(meta, rows))


if __name__ == "__main__":
    main()
