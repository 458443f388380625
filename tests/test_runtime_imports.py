"""The package never imports the checkout's development fixtures: `kbit_dev` (the tiny and real test models, the
demo, engine helpers; at the checkout's root, not installed) is for tests, benchmarks, examples and `make demo`
only. Scans every module of the package for imports of it (absolute, and module names passed as strings, e.g. to
importlib) or of the old in-package location `vllm_kbit.testing`."""

import ast
import os
import subprocess
import sys

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "vllm_kbit")
FIXTURES = ("kbit_dev", "vllm_kbit.testing")


def _package_of(path: str) -> str:
    """The dotted package a module file is in (what its relative imports start from)."""
    return os.path.relpath(os.path.dirname(path), os.path.dirname(PACKAGE)).replace(os.sep, ".")


def _runtime_modules():
    for root, dirs, files in os.walk(PACKAGE):
        dirs[:] = sorted(dirs)
        for name in sorted(files):
            if name.endswith(".py"):
                yield os.path.join(root, name)


def _is_fixture(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FIXTURES)


def fixture_imports(source: str, package: str) -> list[str]:
    """Lines of `source` (a module of `package`) that import kbit_dev (or vllm_kbit.testing) or name it in a string."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value]
        if any(_is_fixture(n) for n in names):
            found.append(f"line {node.lineno}: {', '.join(n for n in names if _is_fixture(n))}")
    return found


@pytest.mark.parametrize("path", list(_runtime_modules()), ids=lambda p: os.path.relpath(p, PACKAGE))
def test_runtime_module_does_not_import_fixtures(path):
    with open(path, encoding="utf-8") as f:
        assert fixture_imports(f.read(), _package_of(path)) == []


def test_fixtures_are_outside_the_package():
    for name in ("real_model.py", "tiny_models.py", "demo.py"):
        assert not os.path.exists(os.path.join(PACKAGE, name)), f"vllm_kbit/{name} belongs in kbit_dev/"
    assert not os.path.exists(os.path.join(PACKAGE, "testing")), "vllm_kbit/testing belongs in kbit_dev/"
    assert os.path.exists(os.path.join(os.path.dirname(PACKAGE), "kbit_dev", "tiny_models.py"))


@pytest.mark.parametrize(
    "source,package",
    [
        ("from kbit_dev import tiny_models", "vllm_kbit"),
        ("import kbit_dev.real_model", "vllm_kbit"),
        ("import importlib\nimportlib.import_module('kbit_dev.demo')", "vllm_kbit"),
        ("from vllm_kbit.testing import tiny_models", "vllm_kbit"),
        ("import vllm_kbit.testing.real_model", "vllm_kbit"),
        ("from vllm_kbit import testing", "vllm_kbit"),
        ("from .testing import demo", "vllm_kbit"),
        ("from . import testing", "vllm_kbit"),
        ("from ..testing.tiny_models import build", "vllm_kbit.vllm"),
        ("import importlib\nimportlib.import_module('vllm_kbit.testing.real_model')", "vllm_kbit"),
    ],
)
def test_the_scan_finds_fixture_imports(source, package):
    assert fixture_imports(source, package)


def test_the_scan_passes_other_imports():
    source = "from . import ops\nfrom .vllm import config\nimport vllm_kbit.reference\nfrom ..settings import KbitSettings"
    assert fixture_imports(source, "vllm_kbit.vllm") == []


def test_importing_the_package_loads_no_fixture():
    code = ("import sys, vllm_kbit, vllm_kbit.ops, vllm_kbit.convert, vllm_kbit.cli, vllm_kbit.settings; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'kbit_dev' or m.startswith('vllm_kbit.testing')); "
            "assert not bad, bad")
    env = dict(os.environ, VLLM_KBIT_LOAD_EXTENSION="0")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
