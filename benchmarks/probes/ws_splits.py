"""The dense warp-specialized wgmma's K splits beside the alternatives, for the planner's split rule (plan.cpp:
ws_rule_splits): per shape, k and M, COLD CUDA-graph replay (µs) of the planner's launch (auto), dequantize + cuBLAS,
cuBLAS bf16 on the unquantized weight (torch.mm) and wgmma_ws forced at 1..max splits; first, with --cases N, the
forced splits against the fp32 reference on N random cases (every split count, deterministic).

    python benchmarks/probes/ws_splits.py [--shapes o,down,llama8b_down,...] [--bits 2,4,5] [--m 64,128,256,512]
                                          [--cases 40]
"""
import argparse
import os
import sys

import torch

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
import tests.gpu.test_linear_cuda as t  # noqa: E402
import vllm_kbit.ops  # noqa: E402
from bench_linear import SHAPES, copies_for, graph_time_us, random_runtime_weight  # noqa: E402

# Beside bench_linear's shapes (name, K, N): bench_kernels' qkv, the target MoE models' attention o, Llama-3-8B / 70B.
EXTRA = [("qkv_5120", 2048, 5120), ("glm45_o", 12288, 4096), ("qwen3_235b_o", 8192, 4096), ("llama8b_qkv", 4096, 6144),
         ("llama8b_o", 4096, 4096), ("llama70b_o", 8192, 8192)]


def check(cases: int) -> int:
    """Random cases 0 .. cases-1 at every split count (tests/gpu/test_linear_cuda.py: _check_ws_k_splits); how many fail."""
    bad = 0
    for seed in range(cases):
        try:
            t._check_ws_k_splits(seed, first=1)
        except AssertionError as e:
            bad += 1
            print("FAIL", str(e)[:300], flush=True)
    return bad


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qkv_5120,o,gate_up,down,llama8b_qkv,llama8b_o,llama8b_down,llama8b_gate_up,"
                    "llama70b_o,llama70b_down,glm45_o,qwen3_235b_o")
    ap.add_argument("--bits", default="2,4,5")
    ap.add_argument("--m", default="64,128,256,512")
    ap.add_argument("--cases", type=int, default=0)
    args = ap.parse_args()
    if args.cases:
        print(f"correctness: {check(args.cases)} failures", flush=True)
    op = torch.ops.kbit._linear_forced.default
    ids = {p: torch.ops.kbit._linear_path_id(p) for p in ("wgmma_ws", "dequant_cublas")}
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(torch.cuda.get_device_name(), "cluster_sms", torch.ops.kbit._cluster_sms(), flush=True)
    known = {s[0]: s for s in SHAPES + EXTRA}
    for name in filter(None, args.shapes.split(",")):  # --shapes "": the correctness cases only
        _, K, N = known[name]
        for k in (int(b) for b in args.bits.split(",")):
            w0 = random_runtime_weight(N, K, k)
            nbytes = w0.qweight_rt.numel() * 4 + w0.absmax_rt.numel()
            ws = [w0] + [random_runtime_weight(N, K, k) for _ in range(copies_for(nbytes, "cold", l2) - 1)]
            for M in (int(m) for m in args.m.split(",")):
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                plan = vllm_kbit.ops.named(torch.ops.kbit.linear_plan.device, M, N, K, torch.bfloat16, k, x.device)
                row = {f"auto:{plan.path}/{plan.splits}": graph_time_us(
                    [lambda w=w: op(x, w.qweight_rt, w.absmax_rt, w.codebook, N, K, None, -1, 0, 0) for w in ws])}
                row["dequant_cublas"] = graph_time_us([lambda w=w: op(x, w.qweight_rt, w.absmax_rt, w.codebook, N, K,
                                                                      None, ids["dequant_cublas"], 0, 0) for w in ws])
                wbs = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(copies_for(N * K * 2, "cold", l2))]
                row["bf16"] = graph_time_us([lambda wb=wb: torch.mm(x, wb.t()) for wb in wbs])
                del wbs
                for s in range(1, t._plan(M, N, K, "wgmma_ws").max_splits + 1):
                    row[f"ws{s}"] = graph_time_us([lambda w=w, s=s: op(x, w.qweight_rt, w.absmax_rt, w.codebook, N, K,
                                                                       None, ids["wgmma_ws"], 0, s) for w in ws])
                print(f"{name} k={k} M={M}: " + "  ".join(f"{a}={b:.1f}" for a, b in row.items()), flush=True)
            del ws, w0


if __name__ == "__main__":
    main()
