# Sourced by the GPU scripts (run_gpu.sh, run_linear_gpu.sh, run_moe_gpu.sh, serve/run.sh) at the top of
# a device call: repo root as working directory, $OUT, unbuffered Python with the repo importable,
# carried wheels installed, and the CUDA extension in place.
#
# The extension comes, in this order, from: vllm_kbit/_C.abi3.so already there (a warm machine or
# an earlier step), .device/_C.abi3.so.xz carried from the CPU machine (benchmarks/pack_extension.sh
# writes it: ~7 MB instead of ~37 MB, so it fits beside a 40 MB vLLM payload part in one call, and
# the device spends no minutes compiling), or a build with nvcc there.
set -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/kbit_out}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then  # e.g. pytest-xdist for machines without it
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
if [ ! -f vllm_kbit/_C.abi3.so ] && [ -f .device/_C.abi3.so.xz ]; then
  python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
    .device/_C.abi3.so.xz vllm_kbit/_C.abi3.so && echo "gpu_env: extension unpacked from .device/_C.abi3.so.xz"
fi
if [ ! -f vllm_kbit/_C.abi3.so ]; then
  echo "gpu_env: building the extension (log: $OUT/build.log)"
  MAX_JOBS=16 python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
fi
