"""Run-to-run repeatability of vLLM engines on the tiny Qwen3-MoE: is a difference between two engines
the weights' doing, or does the same engine already differ from itself when started twice?

    python tests/vllm/repeatability.py OUT_DIR [--eager] [--parallel 3] [--env KEY=VALUE ...]

(e.g. --env TORCHINDUCTOR_DETERMINISTIC=1: Inductor without the on-device benchmarking that can pick a
different reduction order per process; --env VLLM_KBIT_MOE_PATH=gemv: one MoE path everywhere).

Starts, each in a fresh process with its own compile cache: online kbit-4 twice, the converted kbit-4
checkpoint once, the dequantized bf16 model twice. Prints, per pair, the free-running greedy token match,
the teacher-forced greedy match and the largest teacher-forced logprob gap (0.0 = bit-identical logits
on the probes), and writes the same as OUT_DIR/repeatability.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kbit_e2e import (  # noqa: E402
    ONLINE, agreement, dequantized_checkpoint, online_kwargs, packed_weight_differences, run_engine, settings_of, token_match,
)

from vllm_kbit.convert import convert  # noqa: E402
from kbit_dev import tiny_models  # noqa: E402

PAIRS = [("online4-a", "online4-b"), ("converted4", "online4-a"), ("converted4", "online4-b"), ("deq4-a", "deq4-b")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--eager", action="store_true", help="enforce_eager (default: vLLM's CUDA graphs + torch.compile)")
    ap.add_argument("--parallel", type=int, default=3, help="engines at a time")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="environment of every engine")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    tiny = tiny_models.build("qwen3_moe", os.path.join(args.out, "tiny"))
    settings = settings_of(ONLINE[4])
    converted = os.path.join(args.out, "converted4")
    convert(tiny, converted, settings, progress=False)
    deq = dequantized_checkpoint(tiny, os.path.join(args.out, "deq4"), settings)
    extra = {"enforce_eager": True} if args.eager else {}
    env = dict(e.split("=", 1) for e in args.env)
    runs = {
        "online4-a": (tiny, {**online_kwargs(ONLINE[4]), **extra}),
        "online4-b": (tiny, {**online_kwargs(ONLINE[4]), **extra}),
        "converted4": (converted, extra),
        "deq4-a": (deq, extra),
        "deq4-b": (deq, extra),
    }

    def start(key: str) -> dict:
        model, kwargs = runs[key]
        return run_engine(model, os.path.join(args.out, "engines", key), kwargs,
                          {**env, "VLLM_CACHE_ROOT": os.path.join(args.out, "cache", key)})

    with ThreadPoolExecutor(args.parallel) as pool:
        results = dict(zip(runs, pool.map(start, runs)))
    report = []
    for a, b in PAIRS:
        match, within, worst = agreement(results[a], results[b])
        row = {"a": a, "b": b, "free_running_token_match": token_match(results[a]["tokens"], results[b]["tokens"]),
               "teacher_forced_match": match, "within_gap": within, "max_logprob_gap": worst,
               "same_kbit_weights": not packed_weight_differences(results[a], results[b])}
        report.append(row)
        print(f"{a} vs {b}: free-running match {row['free_running_token_match']:.1%}, teacher-forced match "
              f"{match:.1%}, largest logprob gap {worst:.4f}, same kbit weights {row['same_kbit_weights']}")
    with open(os.path.join(args.out, "repeatability.json"), "w") as f:
        json.dump({"eager": args.eager, "env": args.env, "pairs": report}, f, indent=1)


if __name__ == "__main__":
    main()
