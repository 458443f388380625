"""What a wheel of the package holds: `vllm_kbit` and its data, never the checkout's fixtures (`kbit_dev`, the old
`vllm_kbit/testing`). setuptools' `build_py` copies exactly the Python files and package data that `bdist_wheel`
puts in the wheel (pyproject.toml's package config), without compiling the extensions."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def wheel_python_files(tmp_path) -> list[str]:
    build = tmp_path / "lib"
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(build)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "CUDA_HOME": "/nonexistent"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return sorted(os.path.relpath(os.path.join(d, f), build) for d, _, files in os.walk(build) for f in files)


def test_wheel_holds_the_package_and_no_fixtures(tmp_path):
    files = wheel_python_files(tmp_path)
    top = {f.split(os.sep)[0] for f in files}
    assert top == {"vllm_kbit"}, top
    assert not [f for f in files if f.startswith(os.path.join("vllm_kbit", "testing"))], files
    # What the runtime needs is there: the vLLM plugin, the ops and the header reference.py reads at import.
    for need in ("vllm_kbit/plugin.py", "vllm_kbit/ops.py", "vllm_kbit/vllm/moe_method.py", "vllm_kbit/format_constants.h"):
        assert need.replace("/", os.sep) in files, need
