"""No module of the package installs software when it runs: dependencies are declared (pyproject.toml,
its extras) and installed by the user or `make env`, never by a function call."""

import ast
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "vllm_kbit")
INSTALLERS = ("pip", "ensurepip", "uv", "conda", "easy_install", "setuptools.command")
PROCESS_CALLS = {"run", "call", "check_call", "check_output", "Popen", "system", "popen", "run_module", "getoutput",
                 "getstatusoutput"} | {f"exec{s}" for s in ("l", "le", "lp", "lpe", "v", "ve", "vp", "vpe")} | {
                 f"spawn{s}" for s in ("l", "le", "lp", "lpe", "v", "ve", "vp", "vpe")}


def _modules():
    for root, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            if name.endswith(".py"):
                yield os.path.join(root, name)


def _strings(node):
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def install_calls(source: str) -> list[str]:
    """Lines that import an installer, build a command line that names one (a list or tuple with an
    element such as "pip"), or start a process whose arguments name one. Messages that tell the user
    what to install (one string) are not calls."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.List, ast.Tuple)):
            items = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if any(i in INSTALLERS or i in ("pip3", "install") for i in items):
                found.append(f"line {node.lineno}: command line {items}")
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            if any(n.split(".")[0] in ("pip", "ensurepip") for n in names):
                found.append(f"line {node.lineno}: imports {', '.join(names)}")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in PROCESS_CALLS:
                words = [w for s in _strings(node) for w in s.replace("/", " ").split()]
                if any(w in INSTALLERS or w.startswith("pip") for w in words):
                    found.append(f"line {node.lineno}: {name}(...) runs {' '.join(words)}")
    return found


@pytest.mark.parametrize("path", list(_modules()), ids=lambda p: os.path.relpath(p, PACKAGE))
def test_module_installs_nothing(path):
    with open(path, encoding="utf-8") as f:
        assert install_calls(f.read()) == []


@pytest.mark.parametrize(
    "source",
    [
        "import subprocess, sys\nsubprocess.run([sys.executable, '-m', 'pip', 'install', 'gguf'])",
        "import subprocess\nsubprocess.check_call(['pip3', 'install', 'x'])",
        "import os\nos.system('pip install x')",
        "from pip._internal.cli.main import main",
        "import runpy\nrunpy.run_module('pip')",
        "import subprocess, sys\ncmd = [sys.executable, '-m', 'pip', 'install', 'x']\nsubprocess.run(cmd)",
    ],
)
def test_the_scan_finds_installs(source):
    assert install_calls(source)


def test_the_scan_passes_other_processes_and_messages():
    source = "import subprocess\nsubprocess.run(['nvidia-smi'])\nraise RuntimeError('missing: pip install gguf')"
    assert install_calls(source) == []
