"""The package's environment settings, every one read here (the extension's own, which force kernel
choices for benchmarks, are read in csrc/plan/overrides.cpp; docs/development.md lists both).

* ``VLLM_KBIT_CPU_DECODE_CACHE``: ``1`` (default) keeps each packed weight decoded on CPU after its first
  forward (vllm_kbit.ops.cpu_decoded), ``0`` decodes at every call.
* ``VLLM_KBIT_LOAD_EXTENSION``: ``0`` leaves the compiled extensions unloaded (tests of the reference-only
  package); anything else loads them where built.
* ``VLLM_KBIT_CACHE``: folder of the demo's model cache (default ``$XDG_CACHE_HOME/vllm-kbit``, else
  ``~/.cache/vllm-kbit``).
"""

from __future__ import annotations

import os


def cpu_decode_cache() -> bool:
    value = os.environ.get("VLLM_KBIT_CPU_DECODE_CACHE", "1")
    if value not in ("0", "1"):
        raise ValueError(f"kbit: VLLM_KBIT_CPU_DECODE_CACHE={value!r} is not a setting; supported: 0 (off), 1 (on)")
    return value == "1"


def load_extension() -> bool:
    return os.environ.get("VLLM_KBIT_LOAD_EXTENSION") != "0"


def cache_root() -> str:
    if os.environ.get("VLLM_KBIT_CACHE"):
        return os.environ["VLLM_KBIT_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "vllm-kbit")
