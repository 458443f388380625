"""Decode-step time of the real model through vLLM's CPU backend: bf16 against kbit (online, default settings).

    python benchmarks/cpu_decode.py [--bits 4] [--max-tokens 24] [--prompts 2] [--out results/cpu_decode_X.json]

Each configuration runs in its own process (one engine each): bf16, kbit-k with the CPU decode cache (the
default) and, with ``--uncached-tokens N`` > 0, kbit-k with ``VLLM_KBIT_CPU_DECODE_CACHE=0`` for N tokens
(each step decodes every weight again: slow). Per engine: a warm-up generate, then the median of
``--repeats`` timed generates of 1 token (prefill) and of ``--max-tokens`` tokens from ``--prompts`` prompts;
step = (t_max - t_1) / (max_tokens - 1). vLLM's CPU worker picks its threads (on a 2-core machine: one).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # kbit_dev: the checkout's fixtures

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Water boils at"]


def measure(spec: dict) -> dict:
    from kbit_dev import real_model
    from vllm import LLM, SamplingParams

    from vllm_kbit.vllm.compat import VLLM_VERSION

    import torch

    model_dir = real_model.checkpoint()
    kwargs = {"quantization": "kbit"} if spec["kbit"] else {}
    if spec["kbit"] and spec["bits"] != 4:
        kwargs["hf_overrides"] = {"quantization_config": {"quant_method": "kbit", "bits": spec["bits"]}}
    t0 = time.perf_counter()
    llm = LLM(model=model_dir, enforce_eager=True, max_model_len=256, seed=0, enable_prefix_caching=False,
              gpu_memory_utilization=0.1, **kwargs)
    load_s = time.perf_counter() - t0
    prompts = PROMPTS[: spec["prompts"]]

    def generate(n: int) -> float:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == n for o in outs)
        return time.perf_counter() - t

    generate(2)  # warm-up (the first forward of a kbit layer on CPU also builds its decode cache)
    n = spec["max_tokens"]
    t1 = statistics.median(generate(1) for _ in range(spec["repeats"]))
    tn = statistics.median(generate(n) for _ in range(spec["repeats"]))
    return {"vllm": VLLM_VERSION, "torch": torch.__version__, "load_s": load_s, "prefill_s": t1, "total_s": tn,
            "step_s": (tn - t1) / (n - 1), **spec}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--uncached-tokens", type=int, default=0, help="also kbit without the decode cache, this many tokens")
    parser.add_argument("--out", help="append the JSON lines here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(measure(json.loads(args.child))), flush=True)
        return
    base = {"bits": args.bits, "prompts": args.prompts, "repeats": args.repeats}
    runs = [
        ({**base, "kbit": False, "cache": None, "max_tokens": args.max_tokens}, {}),
        ({**base, "kbit": True, "cache": True, "max_tokens": args.max_tokens}, {"VLLM_KBIT_CPU_DECODE_CACHE": "1"}),
    ]
    if args.uncached_tokens:
        runs.append(({**base, "kbit": True, "cache": False, "max_tokens": args.uncached_tokens, "repeats": 1},
                     {"VLLM_KBIT_CPU_DECODE_CACHE": "0"}))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    for spec, env in runs:
        proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                              env={**os.environ, **env})
        line = next((s for s in proc.stdout.splitlines() if s.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            sys.exit(f"cpu_decode: {spec} failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
        r = {**json.loads(line[len("RESULT "):]), "commit": commit, "command": " ".join(sys.argv),
             "date": time.strftime("%Y-%m-%d")}
        name = "bf16" if not r["kbit"] else f"kbit-{r['bits']}" + ("" if r["cache"] else " (no decode cache)")
        print(f"vLLM {'.'.join(map(str, r['vllm']))} torch {r['torch']} {name:24s} load {r['load_s']:6.1f} s  prefill {r['prefill_s'] * 1e3:8.1f} ms  "
              f"step {r['step_s'] * 1e3:8.1f} ms  {r['prompts']} x {r['max_tokens']} tokens {r['total_s']:7.2f} s", flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
