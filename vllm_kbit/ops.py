"""``torch.ops.kbit.*``: schemas, CPU (reference) and fake implementations.

The schemas of every op with a PyTorch reference, and of the C++ variants of those ops, live here
(``_SCHEMAS``); the CUDA extension (``vllm_kbit/_C*.so``, built from ``csrc/``) only adds kernels
to them with ``TORCH_LIBRARY_IMPL``. Its C++-only ops (``linear_plan``, ``moe_plan``, the routing
pieces) are defined in ``csrc/`` and exist only with the extension. Without
the extension (a CPU-only install) the PyTorch reference also serves CUDA
tensors, slowly, and :data:`HAS_EXTENSION` and :data:`HAS_CUDA_KERNELS` are False.

On CPU the ops that multiply by a packed weight (``linear``, ``fused_moe``) decode it once and keep
the decoded tensor (:func:`cpu_decoded`), so a forward costs a plain matmul; ``VLLM_KBIT_CPU_DECODE_CACHE=0``
turns this off (each call decodes again: less memory, ~100x slower decode steps).
"""

from __future__ import annotations

import collections
import functools
import glob
import os
import warnings
import weakref
from typing import Callable

import torch

from vllm_kbit import envs
from vllm_kbit import reference as fmt

_lib = torch.library.Library("kbit", "DEF")

# Every schema of an op with a PyTorch reference, written once. The C++ extension adds kernels to
# them (TORCH_LIBRARY_IMPL) and defines no schema of its own for these ops or their variants below.
_SCHEMAS = {
    "quantize": (
        "quantize(Tensor W, Tensor codebook, int k, bool search_scale=True) -> (Tensor qweight, Tensor absmax)"
    ),
    "dequantize": "dequantize(Tensor qweight, Tensor absmax, Tensor codebook, ScalarType dtype) -> Tensor",
    "repack": "repack(Tensor qweight, Tensor absmax) -> (Tensor qweight_rt, Tensor absmax_rt)",
    "unrepack": "unrepack(Tensor qweight_rt, Tensor absmax_rt, SymInt N, SymInt K) -> (Tensor qweight, Tensor absmax)",
    "dequantize_runtime": (
        "dequantize_runtime(Tensor qweight_rt, Tensor absmax_rt, Tensor codebook, SymInt N, SymInt K, "
        "ScalarType dtype) -> Tensor"
    ),
    # A rotated layer (docs/format.md, section 9) is given its input rotation: float32 signs [K] and the Hadamard
    # block; the op computes (x R) W^T. Keyword-only, so the C++ variants' extra arguments stay positional.
    "linear": (
        "linear(Tensor x, Tensor qweight_rt, Tensor absmax_rt, Tensor codebook, SymInt N, SymInt K, "
        "Tensor? bias, *, Tensor? rot_signs=None, int rot_block=0) -> Tensor"
    ),
    # w13_rot_*: the rotation of the hidden states (gate_up's input, once for every expert); w2_rot_*: that of
    # each routed slot's SiLU-and-mul output (down's input, over the intermediate size).
    "fused_moe": (
        "fused_moe(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13_qweight, Tensor w13_absmax, "
        "Tensor w2_qweight, Tensor w2_absmax, Tensor codebook, SymInt intermediate_size, Tensor? expert_map, "
        "bool apply_router_weight_on_input, *, Tensor? w13_rot_signs=None, int w13_rot_block=0, "
        "Tensor? w2_rot_signs=None, int w2_rot_block=0) -> Tensor"
    ),
}


def _variant(op: str, name: str, extra_args: str = "", returns: str | None = None) -> str:
    """The schema of `op` renamed, with extra arguments after its positional ones (before its keyword-only ones,
    so positional calls of the variant keep working) and/or other returns."""
    args, ret = _SCHEMAS[op].split(" -> ")
    positional, star, keyword = args[len(op) + 1 : -1].partition(", *")
    return f"{name}({positional}{extra_args}{star}{keyword}) -> {returns or ret}"


# Variants the C++ extensions implement: the argument checks on any device (csrc/ops/checks.cpp, registered
# by vllm_kbit._cpu; reference.check asks them): each op's, with its arguments and no outputs, and the rules
# the reference also asks alone; the dense plan forced and fused_moe's CUDA composition with its plan forced
# (tests, benchmarks, sweeps). The CUDA extension's C++-only ops (plans, routing pieces) are defined in csrc/.
_VARIANTS = {
    # (every argument positional: reference.check passes them so)
    **{f"_check_{op}": _variant(op, f"_check_{op}", returns="()").replace(", *, ", ", ") for op in _SCHEMAS},
    "_check_bits": "_check_bits(Scalar k) -> ()",
    "_check_codebook": "_check_codebook(Tensor codebook, int k) -> ()",
    "_check_weight_amax": "_check_weight_amax(float amax, bool bounded) -> ()",
    "_check_representable": "_check_representable(Tensor W) -> ()",
    # kbit::linear and fused_moe's CUDA composition with their plans forced (path: kbit::_linear_path_id, -1 =
    # auto / kbit::_moe_path_id, 0 = auto; 0 = the rule for the rest: csrc/plan/plan.h, LinearForced / MoeForced).
    "_linear_forced": _variant("linear", "_linear_forced", ", int path=-1, int row_groups=0, int splits=0, int producers=0"),
    "_fused_moe_cuda": _variant("fused_moe", "_fused_moe_cuda", ", int path=0, int gate_up_splits=0, int down_splits=0, "
                                "int gate_up_row_groups=0, int down_row_groups=0, int producers=0"),
    # The routed experts in two stages, for callers that add to h13 between them (vllm_kbit.moe.fused_moe_stages on
    # CUDA): gate_up returns each slot's h13 [T * top_k, 2I]; down, given h13, returns act [T * top_k, I] and each
    # slot's down output times its router weight y [T * top_k, H], all in slot order (csrc/ops/moe_ops.cpp).
    "_moe_stage_gate_up": _variant("fused_moe", "_moe_stage_gate_up", ", int path=0"),
    "_moe_stage_down": _variant("fused_moe", "_moe_stage_down", ", Tensor h13, int path=0",
                                returns="(Tensor act, Tensor y)"),
    # quantize's compiled CPU kernel (vllm_kbit._cpu, csrc/cpu/): the reference's bits, fast.
    "_quantize_cpu": _variant("quantize", "_quantize_cpu"),
}
# Ops whose argument rules live in reference.py, asked in Python before any kernel (docs/decisions.md,
# "Rotation"): the layer input rotation x R. Its CUDA kernel is the extension's C++ variant, which checks
# only what the kernel adds (a CUDA device, columns a multiple of 32).
_PYTHON_SCHEMAS = {
    "hadamard_rotate": "hadamard_rotate(Tensor x, Tensor signs, int block, bool inverse=False) -> Tensor",
    "_hadamard_rotate_cuda": "_hadamard_rotate_cuda(Tensor x, Tensor signs, int block, bool inverse=False) -> Tensor",
}
for _schema in (*_SCHEMAS.values(), *_VARIANTS.values(), *_PYTHON_SCHEMAS.values()):
    _lib.define(_schema)


# ----------------------------------------------------------------------------- CPU decode cache


CPU_DECODE_CACHE = envs.cpu_decode_cache()
# id(packed weight) -> (weak reference to it, {key: (stamp, decoded)}); the weak reference's callback drops
# the entry when the packed tensor dies. A plain dict: this lookup runs on every CPU forward of every layer.
_decoded: dict[int, tuple[weakref.ref, dict]] = {}


def _entries(owner: torch.Tensor) -> dict:
    slot = _decoded.get(id(owner))
    if slot is None or slot[0]() is not owner:
        def drop(ref, i=id(owner)):
            if _decoded.get(i, (None,))[0] is ref:
                del _decoded[i]

        slot = _decoded[id(owner)] = (weakref.ref(owner, drop), {})
    return slot[1]


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter (and no in-place writes outside it)
        return -1


def _stamp(tensors: tuple[torch.Tensor, ...]) -> tuple:
    """What a decoded weight depends on: the packed tensors themselves, their storage and in-place writes."""
    return tuple((weakref.ref(t), t.data_ptr(), _version(t)) for t in tensors)


def _stamp_matches(stamp: tuple, tensors: tuple[torch.Tensor, ...]) -> bool:
    return len(stamp) == len(tensors) and all(
        ref() is t and ptr == t.data_ptr() and v == _version(t) for (ref, ptr, v), t in zip(stamp, tensors)
    )


def cpu_decode_cache_on(t: torch.Tensor) -> bool:
    """Whether :func:`cpu_decoded` keeps what it decodes for a packed tensor on t's device."""
    return CPU_DECODE_CACHE and t.is_cpu


def cpu_decoded(packed: tuple[torch.Tensor, ...], key: tuple, decode: Callable[[], object]):
    """``decode()``, computed once per packed weight on CPU and kept while ``packed[0]`` lives.

    ``packed`` holds every tensor the result is decoded from (qweight first: the entry hangs on it);
    ``key`` tells apart results decoded from the same tensors (output dtype, shape). A packed tensor
    written in place or swapped for another one is decoded again. The decoded values are exactly
    ``decode()``'s, so a cached forward equals the reference's bit for bit; the price is the weight's
    size in the decoded dtype, kept beside the packed tensors. Off (or off CPU): ``decode()`` each call.
    """
    owner = packed[0]
    if not cpu_decode_cache_on(owner):
        return decode()
    entries = _entries(owner)
    hit = entries.get(key)
    if hit is not None and _stamp_matches(hit[0], packed):
        return hit[1]
    value = decode()
    entries[key] = (_stamp(packed), value)
    return value


def cpu_decode_cache_nbytes() -> int:
    """Bytes held by the CPU decode cache (decoded weights of packed tensors still alive)."""
    total = 0
    for _, entries in list(_decoded.values()):
        for _, value in entries.values():
            total += sum(t.nbytes for t in (value if isinstance(value, tuple) else (value,)))
    return total


def _linear_reference(x, qweight_rt, absmax_rt, codebook, N, K, bias, *, rot_signs=None, rot_block=0):
    """out[..., N] = x[..., K] @ dequant(W).T (+ bias), in x's dtype; rotated layers get x R first (rot_signs,
    rot_block: :func:`reference.hadamard_rotate`, rounded to x's dtype as the CUDA rotation is)."""
    fmt.check("linear", x, qweight_rt, absmax_rt, codebook, N, K, bias, rot_signs, rot_block)
    if rot_signs is not None:
        x = fmt.hadamard_rotate(x, rot_signs, rot_block)
    W = cpu_decoded(
        (qweight_rt, absmax_rt, codebook),
        ("linear", x.dtype, N, K),
        lambda: fmt.dequantize_runtime(qweight_rt, absmax_rt, codebook, N, K, x.dtype),
    )
    return torch.nn.functional.linear(x, W, bias)


def _load_cpu_extension() -> bool:
    """Loads vllm_kbit/_cpu*.so (the CPU kernels and the argument checks) where it is built; False leaves
    quantize to the reference and the ops unchecked."""
    candidates = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "_cpu*.so")))
    if not candidates or not envs.load_extension():
        return False
    try:
        torch.ops.load_library(candidates[0])
    except OSError as e:  # built against another torch: the reference still serves every op, slower
        warnings.warn(
            f"vllm-kbit: cannot load {candidates[0]} with torch {torch.__version__} ({e}): quantize runs the slow "
            "reference and bad arguments are not checked; reinstall with `pip install --no-build-isolation "
            "--no-deps --force-reinstall vllm-kbit`", stacklevel=2,
        )
        return False
    return True


# HAS_CPU_KERNELS: kbit::quantize on CPU tensors runs the compiled kernel (kbit::_quantize_cpu), and the
# reference's checks ask the C++ ones (reference.check, which reads this).
HAS_CPU_KERNELS = _load_cpu_extension()


def _quantize_cpu(W, codebook, k, search_scale=fmt.DEFAULT_SEARCH_SCALE):
    """kbit::quantize on CPU: the op's checks, then the compiled kernel (bit-identical to
    :func:`reference.quantize`, which serves where the kernel is not built)."""
    if not HAS_CPU_KERNELS:
        return fmt.quantize(W, codebook, k, search_scale)
    fmt.check_quantize(W, codebook, k, search_scale)
    return torch.ops.kbit._quantize_cpu(W, codebook, k, search_scale)


# The reference implementations are device-agnostic PyTorch.
_REFERENCE = {
    "quantize": fmt.quantize,
    "dequantize": fmt.dequantize,
    "repack": fmt.repack,
    "unrepack": fmt.unrepack,
    "dequantize_runtime": fmt.dequantize_runtime,
    "linear": _linear_reference,
}
# Ops that have CUDA kernels in csrc/; the rest run the reference on every device.
_CUDA_KERNEL_OPS = ("quantize", "dequantize", "repack", "dequantize_runtime", "linear")

for _name, _fn in {**_REFERENCE, "quantize": _quantize_cpu}.items():
    _lib.impl(_name, _fn, "CPU")
_lib.impl("hadamard_rotate", fmt.hadamard_rotate, "CompositeExplicitAutograd")
_lib.impl("unrepack", fmt.unrepack, "CUDA")


def _load_extension() -> bool:
    """Loads vllm_kbit/_C*.so where it is built and loadable; False leaves the reference serving every op.

    It loads on machines without a GPU too (its plan ops and checks are host C++); there a load
    failure (no CUDA runtime, or built for another torch) only means no extension. With a GPU it
    is an error: CUDA tensors would silently run the slow reference. VLLM_KBIT_LOAD_EXTENSION=0
    skips it (tests of the extension-less package).
    """
    here = os.path.dirname(__file__)
    candidates = sorted(glob.glob(os.path.join(here, "_C*.so")))
    if not candidates or not envs.load_extension():
        return False
    try:
        torch.ops.load_library(candidates[0])
    except OSError as e:
        if not torch.cuda.is_available():
            return False
        # Typically undefined torch symbols: the extension was compiled against another torch than this one.
        raise ImportError(
            f"vllm-kbit: cannot load its CUDA extension {candidates[0]} with torch {torch.__version__} ({e}). "
            "The extension is built against the torch installed at build time; after changing torch, reinstall "
            "with `pip install --no-build-isolation --no-deps --force-reinstall vllm-kbit` (or `pip install "
            "--no-build-isolation -e .` in a checkout)"
        ) from None
    return True


# HAS_EXTENSION: the C++ extension is loaded, so its ops exist (CUDA kernels, and on any machine the
# plans kbit::linear_plan / kbit::moe_plan and the C++ checks). HAS_CUDA_KERNELS: CUDA tensors run
# the kernels. Nothing outside tests and benchmarks needs the extension's own ops: without it the
# PyTorch reference serves every public op on every device.
HAS_EXTENSION = _load_extension()
HAS_CUDA_KERNELS = HAS_EXTENSION and torch.cuda.is_available()


def _hadamard_rotate_cuda(x, signs, block, inverse=False):
    fmt.check_hadamard_rotate(x, signs, block)
    return torch.ops.kbit._hadamard_rotate_cuda(x, signs, block, inverse)


if HAS_EXTENSION:  # CUDA tensors run the kernel; without the extension the reference serves them too
    _lib.impl("hadamard_rotate", _hadamard_rotate_cuda, "CUDA")
if not HAS_EXTENSION:
    for _name in _CUDA_KERNEL_OPS:
        _lib.impl(_name, _REFERENCE[_name], "CUDA")


# ----------------------------------------------------------------------------- plans as named tuples


@functools.cache
def _returns_type(schema_name: str, overload: str, names: tuple[str, ...]):
    return collections.namedtuple(f"{schema_name.split('::')[-1]}_{overload or 'default'}", names)


def named(op: torch._ops.OpOverload, *args, **kwargs):
    """``op(*args, **kwargs)`` as a namedtuple of the return names in its schema: the plans
    (``named(torch.ops.kbit.linear_plan.default, M, N, K, ...)``, ``linear_plan.device``, ``moe_plan.default``,
    ``moe_plan.device``) name every field, so callers read ``plan.splits`` instead of an index. The names are the
    C++ schema's (csrc/ops/dispatch.cpp), written once."""
    if isinstance(op, torch._ops.OpOverloadPacket):
        op = op.default
    schema = op._schema
    names = tuple(r.name for r in schema.returns)
    return _returns_type(schema.name, schema.overload_name, names)(*op(*args, **kwargs))


# ----------------------------------------------------------------------------- fake (meta) implementations
# Shapes only: under torch.compile sizes may be symbolic; the real kernels validate.


@torch.library.register_fake("kbit::_quantize_cpu")
@torch.library.register_fake("kbit::quantize")
def _quantize_fake(W, codebook, k, search_scale=True):
    N, K = W.shape
    return W.new_empty(N, K // fmt.BLOCK_SIZE, k, dtype=torch.int32), W.new_empty(
        N, K // fmt.BLOCK_SIZE, dtype=torch.uint8
    )


@torch.library.register_fake("kbit::hadamard_rotate")
def _hadamard_rotate_fake(x, signs, block, inverse=False):
    fmt.check_hadamard_rotate(x, signs, block)  # shapes and dtypes only: no data is read
    return torch.empty_like(x)


@torch.library.register_fake("kbit::dequantize")
def _dequantize_fake(qweight, absmax, codebook, dtype):
    N, KB, _ = qweight.shape
    return qweight.new_empty(N, KB * fmt.BLOCK_SIZE, dtype=dtype)


@torch.library.register_fake("kbit::repack")
def _repack_fake(qweight, absmax):
    N, KB, k = qweight.shape
    q_shape, a_shape = fmt.runtime_shapes(N, KB * fmt.BLOCK_SIZE, k)
    return qweight.new_empty(q_shape), absmax.new_empty(a_shape)


@torch.library.register_fake("kbit::unrepack")
def _unrepack_fake(qweight_rt, absmax_rt, N, K):
    k = qweight_rt.shape[2]
    return qweight_rt.new_empty(N, K // fmt.BLOCK_SIZE, k), absmax_rt.new_empty(N, K // fmt.BLOCK_SIZE)


@torch.library.register_fake("kbit::dequantize_runtime")
def _dequantize_runtime_fake(qweight_rt, absmax_rt, codebook, N, K, dtype):
    return qweight_rt.new_empty(N, K, dtype=dtype)


@torch.library.register_fake("kbit::linear")
def _linear_fake(x, qweight_rt, absmax_rt, codebook, N, K, bias, *, rot_signs=None, rot_block=0):
    return x.new_empty(*x.shape[:-1], N)
