"""The bad-input table (tests/bad_input_cases.py) through the CUDA implementations, each case in its
own process: a case that crashes the process (a signal, a CUDA error) fails its test and the run goes on."""

import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bad_input_cases import CASES, ROUTING_CASES  # noqa: E402
from child_env import child_env  # noqa: E402

_CASES_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bad_input_cases.py")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _run(case_id):
    run = subprocess.run(
        [sys.executable, _CASES_FILE, "--device", "cuda", case_id], env=child_env(), capture_output=True, text=True,
        timeout=300,
    )
    output = (run.stdout + run.stderr)[-4000:]
    assert run.returncode >= 0, f"{case_id}: the process died of signal {-run.returncode}: {output}"
    assert run.returncode == 0 and f"{case_id}: ok" in run.stdout, output


def test_extension_is_loaded():
    import vllm_kbit

    assert vllm_kbit.HAS_CUDA_KERNELS, "vllm_kbit/_C*.so is missing or failed to load: these tests would test the reference"


@pytest.mark.parametrize("case_id", [c.id for c in CASES])
def test_cuda_op_refuses_bad_input_in_one_line(case_id):
    _run(case_id)


@pytest.mark.parametrize("case_id", ROUTING_CASES)
def test_cuda_routing_ids_outside_the_local_experts_contribute_zero(case_id):
    _run(case_id)
