"""Peak memory of loading a model with vLLM: bf16 vs online kbit (quantized while loading) vs converted kbit.

    python benchmarks/load_memory.py [--workdir DIR] [--hidden 1024 --layers 8 --experts 32]

Builds a random Qwen3-MoE of the given shape (bf16, ~0.9 GB by default), writes its
kbit conversion, and starts one vLLM engine per mode, each in a fresh process
with a small fixed KV cache. Reported per mode: the worker's peak RSS (VmHWM)
and, on a GPU, torch's peak allocated device memory after loading. Online
quantization is layerwise (vLLM materializes one layer's bf16 weights at a time),
so its peak should sit near the converted-kbit peak plus one layer, far below bf16.
On CPU the reference quantize op (with its per-block scale search) is slow: the
default ~0.8 GB model can take tens of minutes to quantize online on a small CPU;
use a smaller shape there (e.g. --layers 4 --experts 16).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # kbit_dev: the checkout's fixtures

KV_CACHE_BYTES = 64 * 1024**2


def _engine(model: str, kwargs: dict) -> dict:
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    from vllm import LLM

    from vllm_kbit.vllm.inspect import process_memory

    llm = LLM(model=model, enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=KV_CACHE_BYTES, **kwargs)
    return llm.apply_model(process_memory)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", help="keep checkpoints here (default: a temporary directory)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--moe-intermediate", type=int, default=512)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args._child:  # one engine in this process
        model, kwargs = args._child
        print("RESULT " + json.dumps(_engine(model, json.loads(kwargs))))
        return

    import torch

    from vllm_kbit.convert import convert
    from vllm_kbit.settings import KbitSettings
    from kbit_dev import tiny_models

    root = args.workdir or tempfile.mkdtemp(prefix="kbit-load-memory-")
    bf16 = os.path.join(root, "bf16")
    if not os.path.exists(os.path.join(bf16, "config.json")):
        tiny_models.build("qwen3_moe", bf16, hidden=args.hidden, layers=args.layers, experts=args.experts,
                          moe_intermediate=args.moe_intermediate)
    kbit = os.path.join(root, f"kbit{args.bits}")
    summary = convert(bf16, kbit, KbitSettings(bits=args.bits), progress=False, overwrite=True,
                      device="cuda" if torch.cuda.is_available() else "cpu")
    gib = 1024**3
    print(f"checkpoint: bf16 {summary.input_bytes / gib:.3f} GiB, kbit{args.bits} {summary.output_bytes / gib:.3f} GiB")
    modes = {
        "bf16": (bf16, {}),
        f"online kbit{args.bits}": (bf16, {"quantization": "kbit", "hf_overrides": {"quantization_config": {"quant_method": "kbit", "bits": args.bits}}}),
        f"converted kbit{args.bits}": (kbit, {}),
    }
    for name, (model, kwargs) in modes.items():
        proc = subprocess.run([sys.executable, __file__, "--_child", model, json.dumps(kwargs)],
                              capture_output=True, text=True)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise SystemExit(f"{name} failed:\n{proc.stderr[-4000:]}")
        r = json.loads(lines[0][len("RESULT "):])
        extra = f", GPU peak allocated {r['cuda_max_allocated'] / gib:.3f} GiB" if "cuda_max_allocated" in r else ""
        print(f"{name:>16}: worker peak RSS {r['VmHWM'] / gib:.3f} GiB (now: anon {r['RssAnon'] / gib:.3f}, "
              f"file {r['RssFile'] / gib:.3f}){extra}")


if __name__ == "__main__":
    main()
