"""Machine-code guard over the built CUDA extension (runs where it was compiled, no GPU needed).

ptxas (CUDA 13.0) compiled a clamp `max(0, min(2, x))` followed by `== 2` / `== 1` branches into one `VIMNMX.RELU`
with a predicate output and branched on that predicate as if it meant "the result is 2"; warp groups whose x was
above 2 skipped their wgmmas (docs/decisions.md, the TMA activation copy). Main's kernels contain no integer
min / max with a predicate output; this keeps it so, so that a new kernel or toolchain that emits one is looked at
before it runs."""

import glob
import os
import re
import shutil
import subprocess

import pytest

import vllm_kbit

_EXT = glob.glob(os.path.join(os.path.dirname(vllm_kbit.__file__), "_C*.so"))


def _cuobjdump():
    """cuobjdump from the CUDA toolkit, else the copy Triton ships beside torch's CUDA build."""
    found = shutil.which("cuobjdump") or next(iter(glob.glob(os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "cuobjdump"))), None)
    if found:
        return found
    try:
        import triton.backends.nvidia as nv
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
    return path if os.path.exists(path) else None


@pytest.mark.skipif(not _EXT, reason="the CUDA extension is not built here")
def test_no_integer_min_max_with_a_predicate_output():
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton) to read the extension's machine code")
    sass = subprocess.run([tool, "-sass", _EXT[0]], capture_output=True, text=True, timeout=600, check=True).stdout
    functions = sass.count("Function :")
    assert functions > 100, f"cuobjdump read {functions} kernels from {_EXT[0]}"
    offending, current = [], None
    for line in sass.splitlines():
        if "Function :" in line:
            current = line.split("Function :")[1].strip()
        elif re.search(r"\bI?VIMNMX\S*\s+R\w+,\s*!?P\d", line):
            offending.append(f"{current}: {line.strip()[:120]}")
    assert not offending, "integer min / max with a predicate output:\n" + "\n".join(offending[:10])
