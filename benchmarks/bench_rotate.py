"""What the input rotation of rotated kbit layers costs: each layer unrotated, rotated as the planner runs it, and
rotated by a separate pass, in one run.

For the MoE layers (hidden states rotated once per layer before every expert's gate_up, the down projection's
input per routed slot) and the dense layers of bench_kernels.py, at k = 4 by default, COLD (weight copies
rotated beyond L2), CUDA-graph replay, for each block b in --blocks (128: inside one GEMV k-tile, the
converter's default cap; max: the largest power of two <= 1024 dividing K; MoE: b of each projection's own K):

  base          the kbit layer alone (kbit_fused_moe / kbit::linear), as bench_kernels.py times it;
  rotated       the op given the layer's rotation (signs, b): what the plan does, recorded per projection in the
                rotation column ("fused": the GEMV rotates in its activation load; "separate": the rotation kernel
                writes x R first; MoE: gate_up / down);
  separate      torch.ops.kbit.hadamard_rotate of the layer's input, then the unrotated layer, captured together;
                MoE: plus the down projection's input rotated alone ([T * top_k, I]), timed as its own graph;
  +hadacore     (--hadacore) the sign multiply and vLLM's Hadacore (vllm._custom_ops.hadacore_transform on
                [.., K/b, b], in place on the product), then the layer (needs vLLM's CUDA build).

Shares are (t - t(base)) / t(base). Writes rotate_fused_<gpu>_<date>.json and .md into --out.

    python benchmarks/bench_rotate.py --out benchmarks/results [--bits 2,3,4] [--tokens 1,16,64,256] [--blocks 128,max]
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
from vllm_kbit import ops  # noqa: E402
from vllm_kbit import reference as fmt  # noqa: E402

MOE_T = (1, 16, 64, 256)
DENSE_M = (1, 2, 4, 16, 64)


def max_block(K: int) -> int:
    return fmt.rotation_block(K, fmt.ROTATION_MAX_BLOCK)  # the largest block the format takes (the default cap is 128)


def blocks_for(K: int, blocks: list[str]) -> list[int]:
    """The blocks of --blocks that apply to K ("max": max_block), each once, in order."""
    out = []
    for b in blocks:
        v = max_block(K) if b == "max" else int(b)
        if K % v == 0 and v not in out:
            out.append(v)
    return out


def signs_for(K: int) -> torch.Tensor:
    return fmt.rotation_signs(K, device="cuda")


@functools.lru_cache(maxsize=None)
def hadacore():
    try:
        import vllm._custom_ops as vllm_ops
    except Exception:  # noqa: BLE001  (no vLLM CUDA build: the column is skipped)
        return None
    return vllm_ops.hadacore_transform if hasattr(torch.ops._C, "hadacore_transform") else None


def rotate_kbit(x, s, b):
    return torch.ops.kbit.hadamard_rotate(x, s, b)


def rotate_hadacore(x, s, b):
    return hadacore()((x * s.to(x.dtype)).unflatten(-1, (-1, b)), inplace=True).flatten(-2, -1)  # diag(s), then H


def timed(fns):
    return graph_time_us(fns, min_calls=20, replays=10)


def linear_rotated(W, x, s, b):
    return torch.ops.kbit.linear(x, W.qweight_rt, W.absmax_rt, W.codebook, W.N, W.K, None, rot_signs=s, rot_block=b)


def moe_rotated(impl, W, x, ids, w, rot):
    return torch.ops.kbit.fused_moe(x, ids, w, *W, impl.cb, impl.I, None, False, **rot)


def plan_rotation(moe: bool, T: int, shape: tuple, k: int, blocks: tuple) -> str:
    """What the planner does with the rotation at this call: "fused" / "separate" (MoE: gate_up / down)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    if moe:
        E, top_k, H, I = shape
        p = ops.named(torch.ops.kbit.moe_plan.device, T, top_k, E, k, H, I, dev, gate_up_rot_block=blocks[0],
                      down_rot_block=blocks[1])
        return f"{p.path}: {p.gate_up_rotation} / {p.down_rotation}"
    K, N = shape
    p = ops.named(torch.ops.kbit.linear_plan.device, T, N, K, torch.bfloat16, k, dev, rot_block=blocks[0])
    return f"{p.path}: {p.rotation}"


def run_layer(layer: str, k: int, Ts, l2: int, rows: list, block_names: list[str], with_hadacore: bool) -> None:
    moe = layer in bk.MOE_LAYERS
    if moe:
        E, top_k, H, I = bk.MOE_LAYERS[layer]
        impl = bk.KbitMoe(E, top_k, H, I, k)
        K = H
        touched = lambda T: min(E, T * top_k) * impl.expert_bytes()  # noqa: E731
        nbytes = E * impl.expert_bytes()
        pairs = list(zip(blocks_for(H, block_names), blocks_for(I, block_names)))  # (gate_up b, down b) per --blocks
    else:
        K, N = bk.DENSE_LAYERS[layer]
        impl = bk.KbitDense(K, N, k)
        touched = lambda T: impl.nbytes()  # noqa: E731
        nbytes = impl.nbytes()
        pairs = [(b, None) for b in blocks_for(K, block_names)]
    s = signs_for(K)
    sd = signs_for(I) if moe else None
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
        base = timed([functools.partial(layer_fn, W, x, r) for W, r in args])
        for b, bd in pairs:
            if moe:
                rot = dict(w13_rot_signs=s, w13_rot_block=b, w2_rot_signs=sd, w2_rot_block=bd)
                rotated_fn = lambda W, r, rot=rot: moe_rotated(impl, W, x, *r, rot)  # noqa: E731
            else:
                rotated_fn = lambda W, r, b=b: linear_rotated(W, x, s, b)  # noqa: E731
            # The rotated op against the separate pass's result, once, outside the timing: same x R, same weights.
            got = rotated_fn(*args[0])
            want = layer_fn(args[0][0], rotate_kbit(x, s, b), args[0][1]) if not moe else None
            assert torch.isfinite(got).all()
            if want is not None:
                err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                assert err < 2e-2, f"{layer} T={T} b={b}: the rotated op is {err:.2e} off the separate pass"
            rotated = timed([(lambda W=W, r=r: rotated_fn(W, r)) for W, r in args])
            separate = timed([(lambda W=W, r=r, b=b: layer_fn(W, rotate_kbit(x, s, b), r)) for W, r in args])
            with_hc = None
            if with_hadacore and hadacore() is not None:
                with_hc = timed([(lambda W=W, r=r, b=b: layer_fn(W, rotate_hadacore(x, s, b), r)) for W, r in args])
            rec = dict(layer=layer, k=k, T=T, K=K, block=b, down_block=bd,
                       plan=plan_rotation(moe, T, bk.MOE_LAYERS[layer] if moe else (K, N), k, (b, bd)),
                       base_us=round(base, 3), rotated_us=round(rotated, 3), rotated_share=round((rotated - base) / base, 4),
                       separate_us=round(separate, 3), hadacore_us=None if with_hc is None else round(with_hc, 3))
            if moe:
                xd = torch.randn(T * top_k, I, device="cuda", dtype=torch.bfloat16)
                rec["down_rot_us"] = round(timed([functools.partial(rotate_kbit, xd, sd, bd)]), 3)
                rec["separate_us"] = round(separate + rec["down_rot_us"], 3)
            rec["separate_share"] = round((rec["separate_us"] - base) / base, 4)
            rec["hadacore_share"] = None if with_hc is None else round((with_hc - base) / base, 4)
            rows.append(rec)
            print(json.dumps(rec), flush=True)
    del weights
    torch.cuda.empty_cache()


def markdown(meta: dict, rows: list) -> str:
    out = [f"# Input rotation cost: each kbit layer unrotated, rotated as planned, rotated by a separate pass ({meta['gpu']})",
           "", f"date {meta['date']}, commit {meta['commit']}, torch {meta['torch']}, vLLM {meta['vllm']}", "",
           f"command: `{meta['command']}`", "",
           "COLD, CUDA-graph replay, bf16 activations. share = (t - t(layer)) / t(layer). rotated: the op given the "
           "rotation, as planned (plan: path, then the rotation of the input, MoE gate_up / down). separate: the "
           "rotation kernel then the unrotated layer in one graph (MoE: plus the down input's rotation timed alone).", "",
           "| layer | k | T / M | b | down b | plan | layer µs | rotated µs | share | separate µs | share | + Hadacore µs | share |",
           "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        pct = lambda v: "" if v is None else f"{100 * v:+.1f}%"  # noqa: E731
        hc = "" if r["hadacore_us"] is None else f"{r['hadacore_us']:.2f}"
        out.append(f"| {r['layer']} | {r['k']} | {r['T']} | {r['block']} | {r['down_block'] or ''} | {r['plan']} | "
                   f"{r['base_us']:.2f} | {r['rotated_us']:.2f} | {pct(r['rotated_share'])} | {r['separate_us']:.2f} | "
                   f"{pct(r['separate_share'])} | {hc} | {pct(r['hadacore_share'])} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--layers", default="qwen3_30b_moe,qkv,o")
    ap.add_argument("--bits", default="4")
    ap.add_argument("--tokens", help="comma list of T / M (default MoE 1,16,64,256; dense 1,2,4,16,64)")
    ap.add_argument("--blocks", default="128,max", help="comma list of rotation blocks: numbers or max")
    ap.add_argument("--hadacore", action="store_true", help="also time vLLM's Hadacore with the sign multiply")
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
            run_layer(layer, k, Ts, l2, rows, args.blocks.split(","), args.hadacore)
    write_results(args.out, "rotate_fused", run_meta(gpu, args.commit), rows, markdown)


def run_meta(gpu: str, commit: str | None) -> dict:
    """What a result file records about its run: GPU, date, commit, command, torch and vLLM versions."""
    return dict(gpu=gpu, date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
                commit=commit or bk.git_commit(), command="python " + " ".join(sys.argv),
                torch=torch.__version__, vllm=bk.versions().get("vllm"))


def write_results(out: str, prefix: str, meta: dict, rows: list, markdown) -> None:
    """<out>/<prefix>_<gpu>_<date>.json (meta and rows) and .md (markdown(meta, rows)), and the table printed."""
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, f"{prefix}_{meta['gpu'].replace(' ', '_')}_{meta['date']}")
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta, records=rows), f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(markdown(meta, rows))
    print(markdown(meta, rows))


if __name__ == "__main__":
    main()
