"""Time of the runtime-layout dequantize (`torch.ops.kbit.dequantize_runtime` to bf16) and its share of the HBM
floor: k-bit weight and scale bytes read plus bf16 bytes written, at the measured device copy bandwidth. COLD
(weight copies past 4x the L2), CUDA-graph replay; bench_linear.py's helpers.

    python benchmarks/probes/dequant_bw.py [--bits 2,3,4,5]
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_linear as bl  # noqa: E402

SHAPES = (("llama70b_gate_up", 28672, 8192), ("qwen3_30b_gate_up_x128", 128 * 1536, 2048), ("qkv", 5120, 2048))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", default="2,3,4,5")
    args = parser.parse_args()
    bw = bl.copy_bandwidth()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s")
    for name, N, K in SHAPES:
        for k in (int(b) for b in args.bits.split(",")):
            w = bl.random_runtime_weight(N, K, k)
            nbytes = w.qweight_rt.numel() * 4 + w.absmax_rt.numel() + N * K * 2
            ws = [w] + [bl.random_runtime_weight(N, K, k) for _ in range(bl.copies_for(nbytes, "cold", l2) - 1)]
            us = bl.graph_time_us([lambda w=w: w.dequantize(torch.bfloat16) for w in ws], min_calls=4, replays=7)
            floor = nbytes / bw * 1e6
            print(f"{name} k={k} ({N} x {K}): {us:.1f} us, floor {floor:.1f} us, {100 * floor / us:.0f}% of it", flush=True)
            del ws, w
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
