"""Builds the CUDA extension ``vllm_kbit._C`` against the torch installed in the environment.

Install with ``pip install --no-build-isolation .`` (or ``pip install --no-build-isolation vllm-kbit``)
into the environment that already has torch and vLLM: the build imports that torch, so the extension
matches the torch it runs with, and pip leaves torch and vLLM as they are. pyproject.toml does not list
torch as a build requirement on purpose: pip's default isolated build would fetch some other torch and
compile against it. The extension holds only ``TORCH_LIBRARY_IMPL`` registrations (no Python symbols,
no pybind11), so it is built against Python's limited API and one ``.so`` serves any Python with the
torch it was built against; ``vllm_kbit.ops`` loads it with ``torch.ops.load_library``. Without nvcc or
with a CPU build of torch, the package installs without it and the PyTorch reference serves every op.
"""

import glob
import os
import shutil

from setuptools import setup


def _import_torch():
    try:
        import torch
    except ImportError:
        raise SystemExit(
            "vllm-kbit: torch is not importable in the build environment. vllm-kbit builds against the torch "
            "you run: install torch (and vLLM) first, then install this package with "
            "`pip install --no-build-isolation vllm-kbit` (or `pip install --no-build-isolation .` from a checkout)."
        ) from None
    return torch


def cpu_extension(cpp_extension):
    """``vllm_kbit._cpu``: the CPU kernels (csrc/cpu/) and the ops' argument checks (csrc/ops/checks.cpp, as
    kbit::_check_*), built with the host C++ compiler wherever torch is."""
    return cpp_extension.CppExtension(
        name="vllm_kbit._cpu",
        sources=[*sorted(glob.glob("csrc/cpu/*.cpp")), "csrc/ops/checks.cpp"],
        include_dirs=[os.path.abspath("csrc/common"), os.path.abspath("csrc/ops"), os.path.abspath("vllm_kbit")],
        # -ffp-contract=off: no fused multiply-add, so every fp32 operation rounds once, as the reference's;
        # -fopenmp: at::parallel_for spreads the blocks over torch's threads.
        extra_compile_args=["-O3", "-std=c++17", "-fno-ipa-sra", "-ffp-contract=off", "-fopenmp"],
        extra_link_args=["-fopenmp"],
        py_limited_api=True,
    )


def cuda_extensions():
    torch = _import_torch()
    from torch.utils import cpp_extension

    cpu = [cpu_extension(cpp_extension)]
    build = {"build_ext": cpp_extension.BuildExtension}
    if torch.version.cuda is None or cpp_extension.CUDA_HOME is None or shutil.which("nvcc", path=os.path.join(cpp_extension.CUDA_HOME, "bin")) is None:
        print("vllm-kbit: no nvcc or no CUDA build of torch: installing without CUDA kernels (CPU kernels only)")
        return cpu, build
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
    # CPU machines have nvcc without the cuBLAS headers ATen/cuda needs; torch's CUDA wheels ship them.
    nvidia_include = [p for p in (os.path.join(d, "nvidia", "cu13", "include") for d in __import__("site").getsitepackages()) if os.path.isdir(p)]
    ext = cpp_extension.CUDAExtension(
        name="vllm_kbit._C",
        sources=sorted(p for p in glob.glob("csrc/*/*.cpp") + glob.glob("csrc/*/*.cu") if not p.startswith("csrc/cpu/")),
        # csrc/<concept>/ folders include each other's headers by file name; vllm_kbit: format_constants.h
        include_dirs=[*sorted(os.path.abspath(d) for d in glob.glob("csrc/*/")), os.path.abspath("vllm_kbit"), *nvidia_include],
        extra_compile_args={
            # -fno-ipa-sra (also for nvcc's host compiler): no GCC clones of the libstdc++ stream templates that
            # torch's inline checks use; the extension must not carry its own stream code (docs/decisions.md,
            # "Input checks").
            "cxx": ["-O3", "-std=c++17", "-fno-ipa-sra"],
            "nvcc": ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo", "-Xcompiler=-fno-ipa-sra"],
        },
        py_limited_api=True,
    )
    # BuildExtension uses ninja by default; with_options(use_ninja=...) breaks on setuptools >= 80
    # (its Command.__init__ rejects the unknown keyword).
    return [*cpu, ext], build


ext_modules, cmdclass = cuda_extensions()
setup(
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    options={"bdist_wheel": {"py_limited_api": "cp310"}} if ext_modules else {},
)
