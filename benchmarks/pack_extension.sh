#!/usr/bin/env bash
# On the CPU machine, after `make env` compiled vllm_kbit/_C.abi3.so: writes .device/_C.abi3.so.xz
# (git-ignored; ~7 MB) and its commit, for a device call to carry (carry: [".device"]);
# benchmarks/gpu_env.sh unpacks it there. One .so serves every Python with torch 2.11.0.
set -euo pipefail
cd "$(dirname "$0")/.."
so=vllm_kbit/_C.abi3.so
[ -f "$so" ] || { echo "pack_extension: $so is missing: run make env first" >&2; exit 1; }
mkdir -p .device
xz -T0 -6 -c "$so" >.device/_C.abi3.so.xz
git rev-parse --short HEAD >.device/commit
echo "pack_extension: .device/_C.abi3.so.xz ($(du -h .device/_C.abi3.so.xz | cut -f1)) from $so at commit $(cat .device/commit)$(git diff --quiet HEAD -- csrc || echo ' + uncommitted csrc changes')"
