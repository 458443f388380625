"""Fail unless the venv has the torch and vLLM versions the project pins and `from vllm import LLM` works.

Run by `make env` after installing vLLM: pip resolves the CPU recipe with --no-deps and
without torch's extras, so this is the check that nothing replaced torch on the way.
"""

import argparse
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--torch", required=True)
    ap.add_argument("--vllm", required=True)
    args = ap.parse_args()

    import torch

    torch_version = torch.__version__.split("+")[0]
    if torch_version != args.torch:
        print(f"check_env: torch {torch.__version__}, expected {args.torch}", file=sys.stderr)
        return 1
    import vllm
    from vllm import LLM  # noqa: F401  (the import that breaks when an extra is wrong)

    if vllm.__version__.split("+")[0] != args.vllm:
        print(f"check_env: vllm {vllm.__version__}, expected {args.vllm}", file=sys.stderr)
        return 1
    print(f"check_env: torch {torch.__version__} (CUDA {torch.version.cuda}), vllm {vllm.__version__}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
