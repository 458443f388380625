"""The environment of a test's child Python process: it imports the same vllm_kbit as the test.

`python -m pytest` in a checkout imports the checkout's package without an install (the working
directory is on sys.path); a child started as `python FILE` would not find it, or would find another
installed copy.
"""

import os

import vllm_kbit


def child_env(**overrides: str) -> dict[str, str]:
    """os.environ plus `overrides`, with the folder holding the imported vllm_kbit first on PYTHONPATH."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(vllm_kbit.__file__)))
    env = {**os.environ, **overrides}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env
