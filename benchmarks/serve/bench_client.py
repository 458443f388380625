"""`vllm bench serve` steps run by one long-lived worker process instead of one new process per step.

The worker imports vLLM's benchmark module once (``vllm.benchmarks.serve``: the parser and ``main`` the
``vllm bench serve`` subcommand runs) and then runs one step per request, so the measurement is vLLM's own
code with vLLM's own arguments. Why: a step as a new process pays vLLM's import every time, which can take
as long as a short benchmark step itself.

Protocol: the parent writes one JSON list of arguments per line to the worker's stdin; the worker runs them
and answers one JSON line {"rc": exit status} on a pipe of its own (its stdout and stderr, where vLLM prints
the benchmark's table, go to a log file). A step past its timeout kills the worker (its whole process group);
the next step starts a fresh one.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback


class BenchClient:
    """Runs `vllm bench serve` argument lists in the worker; `log_path` collects the worker's output."""

    def __init__(self, log_path: str):
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.reply_fd = -1

    def start(self) -> None:
        """Starts the worker if none is running (bench_serve.py does this before a server start, so that the
        worker's import of vLLM overlaps the server's start-up instead of delaying the first step)."""
        if self.proc is not None and self.proc.poll() is None:
            return
        self.close()
        read_fd, write_fd = os.pipe()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(write_fd)],
                                         stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                         pass_fds=(write_fd,), start_new_session=True)
        os.close(write_fd)
        self.reply_fd = read_fd

    def _read_reply(self, timeout_s: float) -> str | None:
        """The worker's next reply line; None if it did not come within timeout_s. '' if the worker died."""
        end = time.monotonic() + timeout_s
        data = b""
        while not data.endswith(b"\n"):
            ready, _, _ = select.select([self.reply_fd], [], [], max(0.0, end - time.monotonic()))
            if not ready:
                return None
            chunk = os.read(self.reply_fd, 4096)
            if not chunk:
                return ""
            data += chunk
        return data.decode()

    def run(self, args: list[str], timeout_s: float) -> tuple[int, str]:
        """Runs one step; returns (exit status, the worker's output during it). TimeoutError past timeout_s."""
        self.start()
        offset = os.path.getsize(self.log_path)
        try:
            self.proc.stdin.write((json.dumps(args) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # the worker died at start; the reply read below sees it
        reply = self._read_reply(timeout_s)
        if reply is None:
            self.close()
            raise TimeoutError(f"bench step not finished after {timeout_s:.0f} s")
        if reply == "":
            self.proc.wait()
            rc = self.proc.returncode or 1
            self.close()
        else:
            rc = json.loads(reply)["rc"]
        with open(self.log_path, errors="replace") as f:
            f.seek(offset)
            return rc, f.read()

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
            self.proc.stdin.close()
            self.proc = None
        if self.reply_fd >= 0:
            os.close(self.reply_fd)
            self.reply_fd = -1


def _worker(reply_fd: int) -> None:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    with os.fdopen(reply_fd, "w", buffering=1) as replies:
        for line in sys.stdin:
            parser = FlexibleArgumentParser()
            add_cli_args(parser)
            try:
                main(parser.parse_args(json.loads(line)))
                rc = 0
            except SystemExit as e:
                rc = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
            except Exception:  # noqa: BLE001 -- reported to the parent as a failed step, the worker goes on
                traceback.print_exc()
                rc = 1
            sys.stdout.flush()
            sys.stderr.flush()
            replies.write(json.dumps({"rc": rc}) + "\n")


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(int(sys.argv[2]))
