"""kbit with vLLM's Python `LLM` API: online quantization of a bf16 checkpoint.

    python examples/llm_api.py [MODEL]

MODEL: a bf16/fp16 model id or directory; default: a tiny random Qwen3-MoE built locally.
A checkpoint written by `vllm-kbit convert` loads the same way without `quantization=`.
"""

import os
import sys

from vllm import LLM, SamplingParams

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # kbit_dev: the checkout's fixtures
from kbit_dev import tiny_models  # noqa: E402

if __name__ == "__main__":  # vLLM starts its engine in a new process
    model = sys.argv[1] if len(sys.argv) > 1 else "/tmp/kbit-examples/tiny-qwen3-moe"
    if len(sys.argv) == 1 and not os.path.exists(os.path.join(model, "config.json")):
        tiny_models.build("qwen3_moe", model)

    llm = LLM(
        model=model,
        quantization="kbit",
        # kbit settings (all optional): 4 bits, routed experts at 3, router gates and lm_head in bf16.
        hf_overrides={"quantization_config": {"quant_method": "kbit", "bits": 4, "bits_overrides": {"experts": 3}}},
        max_model_len=512,  # the tiny model holds 512 positions
        gpu_memory_utilization=0.3,
    )
    outputs = llm.generate(
        ["The capital of France is", "def fibonacci(n):"], SamplingParams(max_tokens=16, temperature=0.0)
    )
    for out in outputs:
        print(f"{out.prompt!r} -> {out.outputs[0].text!r}")
