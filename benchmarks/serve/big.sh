#!/usr/bin/env bash
# One row of the big-model serving benchmark (benchmarks/serve/big.py): build the CUDA extension if it is missing
# and install the plugin entry point (benchmarks/gpu_common.sh), then run big.py with the given arguments.
#   bash benchmarks/serve/big.sh --model qwen3-235b-a22b --method kbit-3 [--tp N] [--out DIR] [big.py args]
# Models: qwen3-coder-next, glm-4.7-flash, qwen3-235b-a22b, glm-4.5-air (configs/*.json); methods: bf16,
# gptq-int4, kbit-2 .. kbit-5. Results: DIR/serve_big_<date>.{jsonl,md} (default DIR benchmarks/results) and
# DIR/serve_big_<date>_servers.log.
# Environment: PYTHON (default .venv/bin/python, else python3); DEADLINE seconds for the whole call (default: no
# limit): the row gets what is left after the build and install, and a row that does not finish records why.
source "$(dirname "$0")/../gpu_common.sh"
DEADLINE=${DEADLINE:-86400}
if nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null; then
  ensure_extension || exit 1
else
  echo "no nvidia-smi: no GPU, the PyTorch reference ops serve kbit"
fi
ensure_plugin || exit 1
exec "$PYTHON" benchmarks/serve/big.py --deadline "$((DEADLINE - SECONDS - 5))" "$@"
