"""Installing vllm-kbit into an environment that already has torch and vLLM changes neither.

`make test` runs this in .venv (torch 2.13 / vLLM 0.32 on CPU machines) and `make test-cuda-build` in
torch 2.11 / vLLM 0.26, so the oldest supported torch and a newer one are both covered.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_pip_install_keeps_the_installed_torch(tmp_path):
    """`pip install --no-build-isolation` of the package (the documented install) would install only
    vllm-kbit: its requirements are met by what the environment has, torch included. Offline
    (--no-index): pip resolves against the installed packages and builds only the metadata."""
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--report", str(report), ROOT],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    would_install = {item["metadata"]["name"]: item["metadata"]["version"] for item in json.loads(report.read_text())["install"]}
    assert set(would_install) == {"vllm-kbit"}, f"pip would also install {would_install} next to torch {torch.__version__}"


def test_build_without_torch_says_how_to_install(tmp_path):
    """A build that cannot import torch (pip's default isolated build: pyproject lists no torch to build
    with) stops with a message naming the install command instead of a bare ImportError."""
    code = "import sys; sys.modules['torch'] = None; sys.argv = ['setup.py', '--version']; exec(open('setup.py').read())"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "pip install --no-build-isolation" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("spec", ["torch==2.11.0", "torch==2.13.0", "torch==2.14.0"])
def test_torch_requirement_has_no_upper_bound(spec):
    """pyproject's runtime requirement accepts torch releases newer than the oldest supported one."""
    from packaging.requirements import Requirement

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        pytest.skip("tomllib needs Python 3.11")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    deps = [Requirement(d) for d in project["project"]["dependencies"]]
    (torch_req,) = [d for d in deps if d.name == "torch"]
    assert torch_req.specifier.contains(spec.split("==")[1]), (str(torch_req), spec)
    assert "torch" not in " ".join(project["build-system"]["requires"])
