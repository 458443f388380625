"""GPU clocks, power and clock-event reasons sampled by `nvidia-smi` while one benchmark step runs.

Why: throughput at large concurrency can vary from run to run with the same kernels. If the card slows
itself down (power cap or thermal limits), the clock and power samples show it; the utilization (share of
time a kernel was running) shows the other cause, steps bound by the host, which leave the GPU idle between
kernels (docs/decisions.md, "Serving benchmark").
Read-only: nvidia-smi is only queried; the card's settings are never changed.
"""

from __future__ import annotations

import datetime
import functools
import operator
import os
import shutil
import statistics
import subprocess
import tempfile

FIELDS = "clocks.sm,power.draw,temperature.gpu,utilization.gpu,clocks_event_reasons.active"
POWER_CAP = 0x4  # nvidia-smi's "SW power cap" clock-event reason bit


def visible_ids() -> str | None:
    """The GPUs this process may use, as nvidia-smi's --id list: CUDA_VISIBLE_DEVICES when it names GPUs by index
    (nvidia-smi ignores it, so rows run side by side on one host would otherwise read each other's GPUs), else
    None (every GPU)."""
    ids = [i.strip() for i in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if i.strip()]
    return ",".join(ids) if ids and all(i.isdigit() for i in ids) else None


def parse(text: str) -> dict:
    """Summary of `nvidia-smi --query-gpu=FIELDS --format=csv,noheader,nounits` lines of one GPU. Lines
    that are not five readable values (an error message, a '[N/A]') are skipped."""
    samples = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 5:
            continue
        try:
            samples.append((*map(float, parts[:4]), int(parts[4], 16)))
        except ValueError:
            continue
    if not samples:
        return {}
    clocks, power, temps, util, reasons = zip(*samples)
    seen = functools.reduce(operator.or_, reasons)
    return {
        "gpu_samples": len(clocks),
        "sm_clock_mhz": round(statistics.fmean(clocks)),
        "sm_clock_mhz_min": round(min(clocks)),
        "power_w": round(statistics.fmean(power)),
        "power_w_max": round(max(power)),
        "gpu_temp_c_max": round(max(temps)),
        "gpu_util_pct": round(statistics.fmean(util)),
        "clock_event_reasons": f"0x{seen:x}",
        "power_capped_pct": round(100 * sum(1 for r in reasons if r & POWER_CAP) / len(reasons)),
    }


def stop(proc: subprocess.Popen) -> None:
    """Ends a sampling nvidia-smi: terminate, and kill it if it has not exited within 10 s."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class GpuMonitor:
    """Context manager: samples the first visible GPU (the one a single-GPU server runs on) every `period_ms` while the
    block runs; `summary` holds parse()'s result afterwards ({} without nvidia-smi or a readable sample).
    The sampler also stops by itself after `max_s` (coreutils `timeout`), so a parent killed without a
    chance to clean up does not leave it running on a machine that stays warm."""

    def __init__(self, period_ms: int = 250, max_s: float = 3600):
        self.period_ms = period_ms
        self.max_s = max_s
        self.summary: dict = {}
        self._proc: subprocess.Popen | None = None
        self._out = None

    def __enter__(self) -> "GpuMonitor":
        smi = shutil.which("nvidia-smi")
        if smi is not None:
            self._out = tempfile.TemporaryFile(mode="w+")
            limit = ["timeout", str(max(1, round(self.max_s)))] if shutil.which("timeout") else []
            self._proc = subprocess.Popen([*limit, smi, f"--id={(visible_ids() or '0').split(',')[0]}",
                                           f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits",
                                           f"--loop-ms={self.period_ms}"], stdout=self._out, stderr=subprocess.STDOUT)
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        stop(self._proc)
        self._out.seek(0)
        self.summary = parse(self._out.read())
        self._out.close()


MEMORY_FIELDS = "timestamp,index,memory.used"
_TIME_FORMAT = "%Y/%m/%d %H:%M:%S.%f"


def parse_memory(text: str, until: datetime.datetime | None = None) -> dict[int, float]:
    """{GPU index: largest memory.used in GiB} of `nvidia-smi --query-gpu=MEMORY_FIELDS --format=csv,noheader,nounits`
    lines, only the samples taken at or before ``until`` if given; unreadable lines are skipped."""
    peak: dict[int, float] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            continue
        try:
            when = datetime.datetime.strptime(parts[0], _TIME_FORMAT)
            index, mib = int(parts[1]), float(parts[2])
        except ValueError:
            continue
        if until is None or when <= until:
            peak[index] = max(peak.get(index, 0.0), mib / 1024)
    return peak


class MemorySampler:
    """Context manager: samples every visible GPU's memory.used every `period_ms` (nvidia-smi, timestamped) while the block
    runs, e.g. a server's start-up; :meth:`peak_gib` reads the samples so far, up to a time if given (the moment the
    server logged that its weights were loaded), as {GPU index: GiB}. Without nvidia-smi every peak is {}. Like
    GpuMonitor the sampler stops by itself after `max_s`."""

    def __init__(self, period_ms: int = 100, max_s: float = 3600):
        self.period_ms = period_ms
        self.max_s = max_s
        self._proc: subprocess.Popen | None = None
        self._out = None

    def __enter__(self) -> "MemorySampler":
        smi = shutil.which("nvidia-smi")
        if smi is not None:
            self._out = tempfile.NamedTemporaryFile(mode="w+", prefix="kbit_gpu_memory_", suffix=".csv")
            limit = ["timeout", str(max(1, round(self.max_s)))] if shutil.which("timeout") else []
            visible = visible_ids()
            ids = [f"--id={visible}"] if visible else []
            self._proc = subprocess.Popen([*limit, smi, *ids, f"--query-gpu={MEMORY_FIELDS}", "--format=csv,noheader,nounits",
                                           f"--loop-ms={self.period_ms}"], stdout=self._out, stderr=subprocess.STDOUT)
        return self

    def peak_gib(self, until: datetime.datetime | None = None) -> dict[int, float]:
        if self._out is None:
            return {}
        with open(self._out.name, errors="replace") as f:
            return parse_memory(f.read(), until)

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            stop(self._proc)
            self._proc = None

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None
