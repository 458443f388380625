"""``vllm-kbit``: command-line tools.

    vllm-kbit convert IN_DIR OUT_DIR --bits 4 [--bits-overrides experts=3 self_attn=5]
        [--modules-to-not-convert lm_head gate] [--quantize-lm-head] [--device auto|cpu|cuda] [--max-shard-size 4GB] [--overwrite]
        [--codebook NAME] [--gptq [--calibration-file PATH] [--calibration-tokens N] [--damp F] [--no-act-order] [--refine-passes N] [--asymmetric A]]
        [--rotate | --no-rotate] [--rotation-block B] [--rotation-seed S] [--rotation-tp T]
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from vllm_kbit import gptq
from vllm_kbit import reference as fmt

# `convert` without --gptq (round to nearest, what online quantization stores) rotates only when asked: see
# docs/decisions.md ("Rotation") for the measurements behind this and gptq.DEFAULT_ROTATE.
DEFAULT_RTN_ROTATE = False
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|KIB|MIB|GIB)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def _size(text: str) -> int:
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 500MB, 4GB)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])


def _overrides(items: list[str]) -> dict[str, int]:
    """``REGEX=BITS`` pairs, or one JSON object ``{"REGEX": BITS}``."""
    if len(items) == 1 and items[0].lstrip().startswith("{"):
        try:
            value = json.loads(items[0])
        except json.JSONDecodeError as e:
            raise ValueError(f"--bits-overrides: invalid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("--bits-overrides: JSON must be an object {\"regex\": bits}")
        return value
    out: dict[str, int] = {}
    for item in items:
        pattern, sep, bits = item.rpartition("=")
        if not sep or not pattern or not bits.strip().isdigit():
            raise ValueError(f"--bits-overrides: {item!r} is not REGEX=BITS (e.g. experts=3)")
        out[pattern] = int(bits)
    return out


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--calibration-file: cannot read {path}: {e}") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-kbit", description="k-bit weight quantization tools for vLLM")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser(
        "convert",
        help="write a pre-quantized kbit checkpoint from a bf16/fp16 safetensors checkpoint",
        description="Quantize a Hugging Face safetensors checkpoint to kbit; `vllm serve OUT_DIR` then needs no flag.",
    )
    c.add_argument("in_dir", help="bf16/fp16 Hugging Face model directory (safetensors)")
    c.add_argument("out_dir", help="output directory (must be empty or absent unless --overwrite)")
    c.add_argument("--bits", type=int, default=4, help=f"bits per weight, one of {fmt.SUPPORTED_BITS} (default 4)")
    c.add_argument(
        "--bits-overrides",
        nargs="+",
        default=[],
        metavar="REGEX=BITS",
        help="per-module bits: the first regex found in a module name wins (e.g. experts=3 self_attn=5)",
    )
    c.add_argument(
        "--modules-to-not-convert",
        nargs="*",
        default=None,
        metavar="NAME",
        help="modules left in bf16 (replaces the default: lm_head, router gates, embeddings)",
    )
    c.add_argument(
        "--quantize-lm-head",
        action="store_true",
        help="quantize the output head too (at the bits of lm_head: --bits, or --bits-overrides lm_head=K); "
        "a head tied to the embedding stays bf16",
    )
    c.add_argument(
        "--device",
        default="auto",
        help="device that quantizes: auto (a CUDA GPU where torch sees one, else the CPU), cpu, cuda, cuda:1, ...",
    )
    c.add_argument("--max-shard-size", type=_size, default="4GB", help="largest output shard (default 4GB)")
    c.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR (never the input)")
    c.add_argument(
        "--gptq",
        action="store_true",
        help=f"error-compensating (GPTQ) rounding on calibration text ({'act-order, ' if gptq.DEFAULT_ACT_ORDER else ''}"
        f"{gptq.DEFAULT_CALIBRATION_TOKENS} tokens); loads the model with transformers on the CPU and calibrates one "
        "decoder layer at a time on --device (slower)",
    )
    c.add_argument(
        "--calibration-file",
        default=None,
        metavar="PATH",
        help="UTF-8 text for --gptq (default: docstrings of Python's standard library)",
    )
    c.add_argument(
        "--calibration-tokens",
        type=int,
        default=None,
        metavar="N",
        help=f"tokens of calibration text for --gptq, in windows of {gptq.DEFAULT_CALIBRATION_WINDOW} "
        f"(default {gptq.DEFAULT_CALIBRATION_TOKENS})",
    )
    c.add_argument(
        "--codebook",
        default=None,
        metavar="NAME",
        help=f"named codebook, one of {', '.join(fmt.CODEBOOKS)} (default: {fmt.DEFAULT_CODEBOOK})",
    )
    c.add_argument("--damp", type=float, default=None, metavar="F",
                   help=f"--gptq: dampening added to H's diagonal, as a fraction of its mean (default {gptq.DEFAULT_DAMP})")
    c.add_argument("--no-act-order", action="store_true",
                   help="--gptq: round columns in their natural order instead of decreasing input energy")
    c.add_argument("--refine-passes", type=int, default=None, metavar="N",
                   help="--gptq: passes of coordinate descent on GPTQ's loss after its rounding (block scales and "
                   f"indices; 0 to {gptq.MAX_REFINE_PASSES}, default {gptq.DEFAULT_REFINE_PASSES})")
    c.add_argument("--asymmetric", type=float, default=None, metavar="A",
                   help="--gptq: asymmetric calibration (GPTAQ): round each layer towards the full-precision model's "
                   f"output on its full-precision inputs, A of the way (0 to 1, default {gptq.DEFAULT_ASYMMETRIC:g}; 0: plain "
                   "GPTQ, each layer's own output on the rounded model's inputs)")
    c.add_argument(
        "--rotate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="store every quantized layer rotated by a randomized Hadamard transform of its input (incoherence "
        f"processing: weights Q(W R), inputs x R at run time); default: {'on' if gptq.DEFAULT_ROTATE else 'off'} "
        f"with --gptq, {'on' if DEFAULT_RTN_ROTATE else 'off'} without",
    )
    c.add_argument("--rotation-block", type=int, default=None, metavar="B",
                   help=f"largest Hadamard block (a power of two up to {fmt.ROTATION_MAX_BLOCK}; default "
                   f"{fmt.ROTATION_DEFAULT_MAX_BLOCK}): each layer takes the "
                   "largest power of two <= B that divides its input size / --rotation-tp")
    c.add_argument("--rotation-seed", type=int, default=None, metavar="S",
                   help=f"seed of the rotation's random signs (default {fmt.ROTATION_DEFAULT_SEED})")
    c.add_argument("--rotation-tp", type=int, default=None, metavar="T",
                   help="largest tensor-parallel size the checkpoint will be served at (default 1): blocks then divide "
                   "every shard's inputs")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    u = sub.add_parser(
        "upgrade",
        help="rewrite a kbit checkpoint of an older vllm-kbit convert in today's layout (no requantization)",
        description="Copy a kbit checkpoint with its routed experts' qweights 2-D ([N, K/32*k]), as `convert` writes "
        "them now; vLLM before 0.32 loads only those.",
    )
    u.add_argument("in_dir", help="kbit checkpoint directory")
    u.add_argument("out_dir", help="output directory (must be empty or absent unless --overwrite)")
    u.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR (never the input)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from vllm_kbit.convert import ConvertError, convert, upgrade
    from vllm_kbit.settings import KbitSettings, Rotation

    if args.command == "upgrade":
        try:
            n = upgrade(args.in_dir, args.out_dir, overwrite=args.overwrite)
        except ConvertError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"wrote {args.out_dir}: {n} routed-expert qweights rewritten 2-D; serve it with `vllm serve {args.out_dir}`")
        return 0

    if (args.calibration_file or args.calibration_tokens) and not args.gptq:
        flag = "--calibration-file" if args.calibration_file else "--calibration-tokens"
        print(f"error: {flag} needs --gptq (the text calibrates GPTQ rounding)", file=sys.stderr)
        return 2
    gptq_only = [f for f, v in (("--damp", args.damp), ("--no-act-order", args.no_act_order or None),
                                ("--refine-passes", args.refine_passes), ("--asymmetric", args.asymmetric))
                if v is not None]
    if gptq_only and not args.gptq:
        print(f"error: {gptq_only[0]} needs --gptq (it sets GPTQ rounding)", file=sys.stderr)
        return 2
    rotate = args.rotate if args.rotate is not None else (gptq.DEFAULT_ROTATE if args.gptq else DEFAULT_RTN_ROTATE)
    rotation_flags = {"--rotation-block": args.rotation_block, "--rotation-seed": args.rotation_seed,
                      "--rotation-tp": args.rotation_tp}
    given = [f for f, v in rotation_flags.items() if v is not None]
    if given and not rotate:
        print(f"error: {given[0]} needs --rotate (no rotation is applied{' with --no-rotate' if args.rotate is False else ''})",
              file=sys.stderr)
        return 2
    if args.damp is not None and not (0 < args.damp < 10 and args.damp == args.damp):
        print(f"error: --damp {args.damp} is not supported; it must be a fraction of H's mean diagonal in (0, 10)",
              file=sys.stderr)
        return 2
    if args.asymmetric is not None and not 0 <= args.asymmetric <= 1:
        print(f"error: --asymmetric {args.asymmetric} is not supported; it must be 0 to 1", file=sys.stderr)
        return 2
    if args.refine_passes is not None and not 0 <= args.refine_passes <= gptq.MAX_REFINE_PASSES:
        print(f"error: --refine-passes {args.refine_passes} is not supported; it must be 0 to {gptq.MAX_REFINE_PASSES}",
              file=sys.stderr)
        return 2
    try:
        rotation = None
        if rotate:
            rotation = Rotation(
                seed=fmt.ROTATION_DEFAULT_SEED if args.rotation_seed is None else args.rotation_seed,
                max_block=fmt.ROTATION_DEFAULT_MAX_BLOCK if args.rotation_block is None else args.rotation_block,
                tp=1 if args.rotation_tp is None else args.rotation_tp,
            )
        settings = KbitSettings(
            bits=args.bits,
            codebook=args.codebook,
            bits_overrides=_overrides(args.bits_overrides),
            modules_to_not_convert=args.modules_to_not_convert,
            quantize_lm_head=args.quantize_lm_head,
            rotation=rotation,
        )
        summary = convert(
            args.in_dir,
            args.out_dir,
            settings,
            device=args.device,
            max_shard_bytes=args.max_shard_size,
            overwrite=args.overwrite,
            progress=not args.quiet,
            gptq=args.gptq,
            calibration_text=_read_text(args.calibration_file) if args.calibration_file else None,
            calibration_tokens=args.calibration_tokens,
            gptq_options={k: v for k, v in (("damp", args.damp), ("act_order", False if args.no_act_order else None),
                                            ("refine_passes", args.refine_passes), ("asymmetric", args.asymmetric))
                          if v is not None},
        )
    except (ConvertError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summary.format())
    print(f"wrote {args.out_dir}: serve it with `vllm serve {args.out_dir}`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
