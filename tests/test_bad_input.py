"""Bad input gets a one-line error saying what is wrong and what is supported.

The table in bad_input_cases.py runs here through the CPU implementations and through the C++ checks
as ops (kbit::_check_<op> on CPU tensors, in a subprocess); tests/gpu/test_bad_input_cuda.py runs it
through the CUDA implementations. Every one of them raises what csrc/ops/checks.cpp states.
"""

import glob
import os
import shutil
import subprocess
import sys

import pytest
import torch

import vllm_kbit
import vllm_kbit.moe  # noqa: F401  (registers kbit::fused_moe)
from vllm_kbit import reference as fmt

from bad_input_cases import CASES, ROUTING_CASES, run_case, run_routing_case
from child_env import child_env

_CASES_FILE = os.path.join(os.path.dirname(__file__), "bad_input_cases.py")
_EXTENSION = glob.glob(os.path.join(os.path.dirname(vllm_kbit.__file__), "_C*.so"))
_CPU_EXTENSION = glob.glob(os.path.join(os.path.dirname(vllm_kbit.__file__), "_cpu*.so"))
pytestmark = pytest.mark.skipif(not _CPU_EXTENSION, reason="vllm_kbit._cpu (the argument checks) is not built")


def test_the_reference_asks_the_cpp_checks():
    assert fmt.checks_loaded()


@pytest.mark.parametrize("first", ["reference", "ops"])
def test_the_checks_do_not_depend_on_import_order(first):
    """The reference turns its checks on itself: loaded on its own before anything else of the package (its file
    as a module, so not even the package's __init__ runs first) or after vllm_kbit.ops, it refuses bad input."""
    code = (
        "import importlib.util, os, sys\n" +
        ("import vllm_kbit.ops\n" if first == "ops" else "") +
        f"spec = importlib.util.spec_from_file_location('reference_alone', {fmt.__file__!r})\n"
        "ref = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(ref)\n"
        "assert ('vllm_kbit.ops' in sys.modules) == " + repr(first == "ops") + "\n"
        "try:\n"
        "    ref.check_bits(7)\n"
        "except ValueError as e:\n"
        "    print('refused:', e)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], env=child_env(VLLM_KBIT_LOAD_EXTENSION="1"),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "refused: kbit: k=7 is not supported" in run.stdout, (run.stdout, run.stderr[-3000:])


@pytest.mark.parametrize("case", [c for c in CASES if not c.cuda_only], ids=lambda c: c.id)
def test_cpu_op_refuses_bad_input_in_one_line(case):
    assert run_case(case, "cpu") is None


@pytest.mark.parametrize("case_id", ROUTING_CASES)
def test_cpu_routing_ids_outside_the_local_experts_contribute_zero(case_id):
    assert run_routing_case(case_id, "cpu") is None


def test_cpp_checks_as_ops_raise_what_the_ops_raise():
    """kbit::_check_<op> on the table's CPU tensors, in a child process: a crash fails this test alone."""
    run = subprocess.run([sys.executable, _CASES_FILE, "--check-op"], env=child_env(VLLM_KBIT_LOAD_EXTENSION="1"),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.returncode, run.stdout[-4000:], run.stderr[-4000:])
    assert run.stdout.count(": ok") == sum(c.cpp_check and not c.cuda_only for c in CASES)


@pytest.mark.skipif(not _EXTENSION, reason="the CUDA extension is not built")
def test_plan_heuristic_ops_refuse_what_they_cannot_plan_for():
    """The split-count, row-group and chunk-bound ops divide by the SM count or the chunk height: zero gets a
    one-line ValueError, not a crash (a child process, so a crash fails this test alone)."""
    calls = ["_gemv_splits(8, 6, 0)", "_mma_splits(8, 100, 6, 0, 3, 16)", "_mma_grouped_r(1, 24, 16, 4, 81, 0)",
             "_moe_max_chunks(100, 8, 0)"]
    script = "\n".join(["import torch, vllm_kbit.ops as o", "assert o.HAS_EXTENSION"] + [
        f"try:\n    torch.ops.kbit.{c}\n    print('no error')\nexcept ValueError as e:\n    print('ValueError', len(str(e).splitlines()))"
        for c in calls])
    run = subprocess.run([sys.executable, "-c", script], env=child_env(VLLM_KBIT_LOAD_EXTENSION="1"), capture_output=True,
                         text=True, timeout=300)
    if run.returncode != 0 and "libcudart" in run.stderr:
        pytest.skip("the extension needs libcudart, which this machine lacks")
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert run.stdout.split("\n")[: len(calls)] == ["ValueError 1"] * len(calls), run.stdout


def _one_line(excinfo):
    assert "\n" not in str(excinfo.value)


@pytest.mark.parametrize("k", [1, 6, 8, 4.0])
def test_unsupported_k(k):
    with pytest.raises(ValueError, match="k must be one of") as e:
        vllm_kbit.quantize(torch.randn(4, 32), k)
    _one_line(e)


def test_unsupported_dtype():
    with pytest.raises(TypeError, match="supported: float16, bfloat16, float32") as e:
        vllm_kbit.quantize(torch.randn(4, 32).double(), 4)
    _one_line(e)
    with pytest.raises(TypeError, match="supported"):
        vllm_kbit.quantize(torch.randint(0, 3, (4, 32)), 4)


@pytest.mark.parametrize("shape", [(4, 33), (4, 0), (4, 48)])
def test_K_not_a_multiple_of_32(shape):
    with pytest.raises(ValueError, match="multiple of 32") as e:
        vllm_kbit.quantize(torch.randn(shape), 4)
    _one_line(e)


def test_not_2d():
    with pytest.raises(ValueError, match="2-D"):
        vllm_kbit.quantize(torch.randn(2, 4, 32), 4)


def test_non_contiguous():
    with pytest.raises(ValueError, match="contiguous"):
        vllm_kbit.quantize(torch.randn(64, 64).T, 4)


def test_non_finite_and_out_of_range_weights():
    W = torch.randn(4, 32)
    W[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf") as e:
        vllm_kbit.quantize(W, 4)
    _one_line(e)
    # |w| beyond the E4M4 block scale: range-scaled (codebook x 8), not refused; the raw op still refuses it.
    W[1, 3] = 100.0
    q = vllm_kbit.quantize(W, 4)
    assert q.codebook.abs().max().item() == 8.0 and abs(q.dequantize(torch.float32)[1, 3].item() - 100.0) < 1.0
    with pytest.raises(ValueError, match="above the largest E4M4 block scale") as e:
        torch.ops.kbit.quantize(W, q.codebook / 8, 4)
    _one_line(e)


def test_mismatched_packed_tensors_through_the_op():
    w = vllm_kbit.quantize(torch.randn(8, 64), 3)
    with pytest.raises(ValueError, match="absmax must be uint8"):
        torch.ops.kbit.dequantize(w.qweight, w.absmax[:, :1].contiguous(), w.codebook, torch.bfloat16)
    with pytest.raises(ValueError, match="absmax must be uint8"):
        torch.ops.kbit.dequantize(w.qweight, w.absmax.to(torch.int32), w.codebook, torch.bfloat16)
    with pytest.raises(ValueError, match="codebook has 16 entries but k=3 needs 8"):
        torch.ops.kbit.dequantize(w.qweight, w.absmax, fmt.normal_float_codebook(4), torch.bfloat16)
    with pytest.raises(TypeError, match="qweight must be int32"):
        torch.ops.kbit.dequantize(w.qweight.float(), w.absmax, w.codebook, torch.bfloat16)
    with pytest.raises(ValueError, match="k must be one of"):
        torch.ops.kbit.dequantize(torch.zeros(8, 2, 6, dtype=torch.int32), w.absmax[:, :2].contiguous(), w.codebook, torch.bfloat16)
    with pytest.raises(TypeError, match="output dtype"):
        torch.ops.kbit.dequantize(w.qweight, w.absmax, w.codebook, torch.int8)


def test_mismatched_runtime_tensors_and_activations():
    w = vllm_kbit.quantize(torch.randn(8, 64), 3)
    q_rt, a_rt = w.repack()
    with pytest.raises(ValueError, match="runtime tensors for \\[8, 544\\]"):
        torch.ops.kbit.dequantize_runtime(q_rt, a_rt, w.codebook, 8, 128 * 4 + 32, torch.float32)
    with pytest.raises(ValueError, match="x has 32 features but the weight has K=64"):
        torch.ops.kbit.linear(torch.randn(2, 32), q_rt, a_rt, w.codebook, 8, 64, None)
    with pytest.raises(TypeError, match="x has dtype torch.int64"):
        torch.ops.kbit.linear(torch.ones(2, 64, dtype=torch.long), q_rt, a_rt, w.codebook, 8, 64, None)


@pytest.mark.skipif(not shutil.which("nm"), reason="no nm")
@pytest.mark.parametrize("so", _EXTENSION + _CPU_EXTENSION, ids=os.path.basename)
def test_extension_has_no_iostream_code_of_its_own(so):
    """Messages go through csrc/common/check.h: no stream template of libstdc++ is instantiated in the .so (those
    copies crashed the process when a check fired, with a g++ other than the process's libstdc++)."""
    symbols = subprocess.run(["nm", "-C", "--defined-only", so], capture_output=True, text=True, check=True).stdout
    streams = [line for line in symbols.splitlines() if "ostream" in line or "num_put" in line]
    assert not streams, "stream code in the extension (use KBIT_CHECK*, not TORCH_CHECK):\n" + "\n".join(streams[:10])
