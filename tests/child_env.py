"""The environment of a test's child Python process: it imports the same vllm_kbit as the test.

`python -m pytest` in a checkout imports the checkout's package without an install (the working
directory is on sys.path); a child started as `python FILE` would not find it, or would find another
installed copy.
"""

import os
import site

import vllm_kbit

# The folder the test imported vllm_kbit from: a checkout (editable install or none) or site-packages.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(vllm_kbit.__file__)))


def child_env(**overrides: str) -> dict[str, str]:
    """os.environ plus `overrides`; a checkout's folder goes first on PYTHONPATH (site-packages is on
    every child's path already, and put on PYTHONPATH it would shadow the standard library)."""
    env = {**os.environ, **overrides}
    if _ROOT not in site.getsitepackages():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH", "")) if p)
    return env
