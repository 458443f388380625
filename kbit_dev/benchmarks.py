"""The checkout's benchmark scripts (benchmarks/*.py) as modules, for tests that check their pure pieces."""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def load(name: str) -> ModuleType:
    """benchmarks/<name>.py, freshly executed as module ``name`` (not entered in sys.modules)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCHMARKS, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
