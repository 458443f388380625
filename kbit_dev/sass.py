"""The built CUDA extension's machine code (SASS), read with cuobjdump where the extension was compiled (no GPU needed):
the tripwire of tests/test_sass_guard.py and the instruction mix of benchmarks/probes/sass_mix.py.

Kernels are keyed by their mangled names with anonymous-namespace tags dropped (`stable_name`): a tag hashes its
source file, so it differs between two builds of different sources, and without that two builds' kernels would not
pair up."""

from __future__ import annotations

import collections
import glob
import os
import re
import shutil
import subprocess

_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
_ANON = re.compile(r"(\d+)_GLOBAL__N__")


def extension() -> str | None:
    """The built vllm_kbit/_C*.so of this checkout, or None."""
    import vllm_kbit

    found = sorted(glob.glob(os.path.join(os.path.dirname(vllm_kbit.__file__), "_C*.so")))
    return found[0] if found else None


def cuobjdump() -> str | None:
    """cuobjdump from the CUDA toolkit, else the copy Triton ships beside torch's CUDA build, else None."""
    toolkit = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "cuobjdump")
    found = shutil.which("cuobjdump") or (toolkit if os.path.exists(toolkit) else None)
    if found:
        return found
    try:
        import triton.backends.nvidia as nv
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
    return path if os.path.exists(path) else None


def disassemble(path: str, tool: str) -> str:
    """cuobjdump -sass of a shared object or cubin."""
    return subprocess.run([tool, "-sass", path], capture_output=True, text=True, timeout=600, check=True).stdout


def functions(sass: str) -> dict[str, list[str]]:
    """Mangled kernel name -> its instructions in order, each without address, predicate guard or encoding
    ("F2FP.BF16.F32.PACK_AB R4, R5, R4"). Names as cuobjdump prints them (stable_name pairs two builds)."""
    out: dict[str, list[str]] = {}
    current = None
    for line in sass.splitlines():
        if "Function :" in line:
            current = out.setdefault(line.split("Function :", 1)[1].strip(), [])
            continue
        m = _INSTRUCTION.match(line)
        if m and current is not None:
            text = m.group(1)
            if text.startswith("@"):
                text = text.split(None, 1)[1] if " " in text else ""
            if text:
                current.append(text)
    return out


def opcode(instruction: str) -> str:
    """"F2FP.BF16.F32.PACK_AB R4, R5, R4" -> "F2FP" (the operation without its modifiers)."""
    return instruction.split(None, 1)[0].split(".", 1)[0]


def mix(instructions: list[str]) -> collections.Counter:
    """Opcode -> count."""
    return collections.Counter(opcode(i) for i in instructions)


def stable_name(mangled: str) -> str:
    """The mangled name with each anonymous-namespace component (<length>_GLOBAL__N__<file hash>...) replaced by
    "(anon)"; the length prefix says where the component ends."""
    out, pos = [], 0
    for m in _ANON.finditer(mangled):
        if m.start() < pos:
            continue
        out.append(mangled[pos:m.start()] + "(anon)")
        pos = m.start(1) + len(m.group(1)) + int(m.group(1))
    return "".join(out) + mangled[pos:]


def demangle(names: list[str]) -> dict[str, str]:
    """Mangled -> readable (c++filt where present, else the names unchanged)."""
    tool = shutil.which("c++filt")
    if tool is None or not names:
        return {n: n for n in names}
    run = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True, timeout=60)
    readable = run.stdout.splitlines()
    return dict(zip(names, readable)) if run.returncode == 0 and len(readable) == len(names) else {n: n for n in names}
