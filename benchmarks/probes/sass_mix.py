"""Instruction mix of the built CUDA extension's kernels, read from their machine code (no GPU needed).

    python benchmarks/probes/sass_mix.py [--so PATH] [--base PATH] [--match REGEX] [--ops F2FP,PRMT,SHFL,LDS,HMMA]

Per kernel whose readable name matches --match: its instruction count and the count of each of --ops. With --base
(another build of the extension), only the kernels whose mix differs between the two, each as base -> this build:
what a change to the kernels did to their code before it runs, e.g. a conversion per weight pair replaced by a byte
permute (F2FP -> PRMT). Static counts over the whole kernel, not instructions issued: ncu counts those
(benchmarks/bench_kernels.py --ncu).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from kbit_dev import sass  # noqa: E402


def kernel_mixes(path: str, tool: str) -> dict[str, tuple[str, dict]]:
    """stable name -> (mangled name, opcode counts with "total")."""
    out = {}
    for name, instrs in sass.functions(sass.disassemble(path, tool)).items():
        counts = dict(sass.mix(instrs))
        counts["total"] = len(instrs)
        out[sass.stable_name(name)] = (name, counts)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--so", help="the extension to read (default: this checkout's vllm_kbit/_C*.so)")
    ap.add_argument("--base", help="another build to compare with: only kernels whose mix differs are listed")
    ap.add_argument("--match", default="", help="regular expression on the readable kernel name")
    ap.add_argument("--ops", default="F2FP,PRMT,SHFL,LDS,HMMA", help="comma list of opcodes to count")
    args = ap.parse_args(argv)
    so = args.so or sass.extension()
    tool = sass.cuobjdump()
    for what, value in (("no built extension (build it, or pass --so)", so),
                        ("no cuobjdump (CUDA toolkit or Triton)", tool)):
        if not value:
            print(f"error: {what}", file=sys.stderr)
            return 2
    for path in filter(None, (so, args.base)):
        if not os.path.isfile(path):
            print(f"error: {path} is not a file", file=sys.stderr)
            return 2
    try:
        pattern = re.compile(args.match)
    except re.error as e:
        print(f"error: --match {args.match!r} is not a regular expression ({e})", file=sys.stderr)
        return 2
    ops = [o for o in args.ops.split(",") if o]
    new = kernel_mixes(so, tool)
    old = kernel_mixes(args.base, tool) if args.base else {}
    readable = sass.demangle([mangled for mangled, _ in new.values()])
    columns = ["total", *ops]
    print("| kernel | " + " | ".join(columns) + " |")
    print("| --- |" + " ---: |" * len(columns))
    listed = 0
    for key, (mangled, counts) in sorted(new.items(), key=lambda kv: readable[kv[1][0]]):
        name = readable[mangled]
        if not pattern.search(name):
            continue
        if args.base:
            if key not in old or old[key][1] == counts:
                continue
            cells = [f"{old[key][1].get(c, 0)} -> {counts.get(c, 0)}" for c in columns]
        else:
            cells = [str(counts.get(c, 0)) for c in columns]
        print(f"| {name} | " + " | ".join(cells) + " |")
        listed += 1
    if args.base:
        only = sorted(set(new) ^ set(old))
        print(f"\n{listed} kernels differ; {len(only)} in one build only", *only[:10], sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
