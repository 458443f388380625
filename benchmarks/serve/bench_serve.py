"""Serving throughput of a Qwen3-30B-A3B-shaped model (dummy weights) per weight format: `vllm serve` + `vllm bench serve`.

For each method (bf16, gptq-int4, kbit-2..5; see methods.py) it starts `vllm serve` on a weightless
model directory (model_dir.py) with --load-format dummy, waits for /health, runs `vllm bench serve`
(random dataset, --ignore-eos, max(8, P x concurrency) prompts with P = 4 at 1024/256 and 2 at 128/1024)
for every input/output setting and concurrency, reads the weight memory and KV-cache capacity from the
server log, and stops the server. Each bench first sends as many warm-up requests as its concurrency, at
once, so kernels compiled on first use for that batch's shapes (vLLM's LoRA Triton kernels: seconds) are
compiled before the timing. While a step runs, nvidia-smi samples the GPU's clocks and power
(gpu_monitor.py) into its record.
After every measurement it appends a record to STEM.jsonl (records.py) and rewrites STEM.md and STEM.png
(report.py), so a run killed at its time limit still leaves every finished measurement behind.

    python3 benchmarks/serve/bench_serve.py --methods kbit-4,bf16 --settings 1024/256 --concurrency 1,16,64,128

--lora-rank R serves every method with the same random rank-R LoRA adapter on q/k/v/o_proj (kbit_dev.lora) and
sends every request through it (`vllm bench serve --lora-modules`); the records name the method <method>+loraR.

--tp N serves every method with `vllm serve --tensor-parallel-size N` (N GPUs); its results go to
serve_tp<N>_<gpu>_<date>.* and their records carry "tp". The weight and KV-cache memory in the records are
per GPU (each worker logs its own); the KV-cache size in tokens is the engine's. nvidia-smi samples GPU 0.

The steps run in one long-lived `vllm bench serve` worker (bench_client.py). A full sweep is 6 methods x 2
settings x 5 concurrencies. To split it over several runs (e.g. one method each), give every run the same
command plus `--skip-done <earlier JSONL files>`: it skips what those files already hold for this commit.
`--repeats N` runs each step N times back to back on one server, to size the run-to-run spread (report.py
lists repeats at one commit with their spread).

The output folder is --out, else benchmarks/results/. --deadline bounds the whole run: a server start or
bench gets at most what is left (less a reserve for stopping the server), and steps that no longer fit are
skipped with a message. bash benchmarks/serve/run.sh wraps this (install, optional GPU tests and profile).
On the CPU build, check the harness with a tiny model:

    python benchmarks/serve/bench_serve.py --shape tiny --methods bf16,kbit-4 --settings 32/16 \
        --concurrency 1,2 --max-model-len 256 --gpu-memory-utilization 0.3 --server-args=--enforce-eager --out /tmp/x
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

import bench_client  # noqa: E402
import gpu_monitor  # noqa: E402
import model_dir  # noqa: E402
import records  # noqa: E402
import report  # noqa: E402
import vllm_server  # noqa: E402
from methods import Method, parse_methods  # noqa: E402

STOP_RESERVE_S = 45  # stopping a server (SIGTERM, up to 30 s, then SIGKILL) and writing the outputs


def num_prompts(concurrency: int, per_concurrency: int = 4, minimum: int = 8) -> int:
    return max(minimum, per_concurrency * concurrency)


def parse_settings(text: str, per_concurrency: int = 4) -> list[tuple[int, int, int]]:
    """"1024/256,128/1024:2" -> [(1024, 256, 4), (128, 1024, 2)]: input and output lengths, and prompts per
    unit of concurrency (after ':', else per_concurrency)."""
    out = []
    for item in text.split(","):
        lengths, _, per_c = item.partition(":")
        inp, _, outp = lengths.partition("/")
        try:
            setting = (int(inp), int(outp), int(per_c) if per_c else per_concurrency)
        except ValueError:
            raise ValueError(f"setting {item!r} is not IN/OUT or IN/OUT:PROMPTS_PER_CONCURRENCY") from None
        if min(setting) < 1:
            raise ValueError(f"setting {item!r}: lengths and prompts per concurrency must be at least 1")
        out.append(setting)
    return out


def parse_concurrency(text: str) -> list[int]:
    return [int(c) for c in text.split(",")]


def gpu_name() -> str:
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=30).stdout.split("\n")
        if names[0].strip():
            return names[0].strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return "cpu"


def commit() -> str:
    """$KBIT_COMMIT, else git's HEAD, else "unknown"."""
    if os.environ.get("KBIT_COMMIT"):
        return os.environ["KBIT_COMMIT"]
    try:
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        if head:
            return head
    except (OSError, subprocess.TimeoutExpired):
        pass
    return "unknown"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def done_steps(paths: list[str], at_commit: str, tp: int = 1) -> set[tuple]:
    """(method, input_len, output_len, concurrency) measured without error at this commit and tensor-parallel
    size in the given JSONL files (missing files count as empty), so that a sweep split over several runs
    resumes where it stopped."""
    found = [p for p in paths if os.path.exists(p)]
    rows = records.latest(r for r in records.load(found) if r.get("tp", 1) == tp)
    return {key for key, r in rows.items() if r["commit"] == at_commit and not r.get("error")}


class Run:
    """One harness invocation: settings, output paths, the deadline and the per-method loop."""

    def __init__(self, args: argparse.Namespace, settings: list[tuple[int, int, int]]):
        self.args = args
        self.settings = settings  # parse_settings(args.settings, args.prompts_per_concurrency)
        self.min_prompts = getattr(args, "min_prompts", 8)  # prompts per bench: at least this many
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.deadline
        self.gpu = gpu_name()
        self.commit = commit()
        today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
        out_dir = args.out or os.path.join(REPO, "benchmarks", "results")
        os.makedirs(out_dir, exist_ok=True)
        tp = f"tp{args.tp}_" if args.tp > 1 else ""
        self.stem = os.path.join(out_dir, args.tag or f"serve_{tp}{self.gpu.replace(' ', '_')}_{today}")
        self.results = self.stem + ".jsonl"
        self.servers_log = self.stem + "_servers.log"
        os.makedirs(os.path.join(args.work, "bench"), exist_ok=True)
        self.done = done_steps(args.skip_done.split(",") if args.skip_done else [], self.commit, args.tp)
        self.client = bench_client.BenchClient(os.path.join(args.work, "bench_worker.log"))
        self.bench_extra: list[str] = []  # `vllm bench serve` arguments every step adds (--lora-modules)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def say(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.0f} s] {msg}", flush=True)

    def model_dirs(self, methods: list[Method]) -> dict[str, str]:
        dirs = {}
        for variant in sorted({m.model_variant for m in methods}):
            qc = model_dir.GPTQ_INT4 if variant == "gptq-int4" else None
            path = os.path.join(self.args.work, f"{self.args.shape}-{variant}")
            dirs[variant] = model_dir.write(self.args.shape, path, qc)
        return dirs

    def serve_args(self, method: Method) -> list[str]:
        a = self.args
        tp = ["--tensor-parallel-size", str(a.tp)] if a.tp > 1 else []
        return ["--load-format", "dummy", *tp, "--max-model-len", str(a.max_model_len),
                "--gpu-memory-utilization", str(a.gpu_memory_utilization), "--no-enable-prefix-caching",
                "--disable-uvicorn-access-log", *method.serve_args, *shlex.split(a.server_args)]

    def server_env(self) -> dict:
        """The server's extra environment: vLLM's routing simulation unless --routing model."""
        return routing_env(self.args.routing)

    def start_server(self, model: str, log_path: str, method: Method) -> vllm_server.Server:
        return vllm_server.start(model, free_port(), log_path, self.serve_args(method), self.server_env())

    def command_line(self, server: vllm_server.Server) -> str:
        """The server's command as a shell would run it, its extra environment first."""
        return shlex.join([f"{k}={v}" for k, v in self.server_env().items()] + server.command)

    def context(self, method: Method, model: str, setting: tuple[int, int, int], c: int, facts: dict, command: str,
                repeat: int = 0) -> dict:
        return {
            "gpu": self.gpu, "commit": self.commit,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "model": f"{self.args.shape} shape, dummy weights" + (f", TP={self.args.tp}" if self.args.tp > 1 else ""),
            "tp": self.args.tp, "method": method.name, "bits": method.bits,
            "concurrency": c, "input_len": setting[0], "output_len": setting[1],
            "num_prompts": num_prompts(c, setting[2], self.min_prompts), "repeat": repeat, **facts,
            "routing": self.args.routing, "command": command,
        }

    def save(self, record: dict) -> None:
        records.append(self.results, record)
        report.write(records.load([self.results]), self.stem)

    def bench(self, server: vllm_server.Server, method: Method, model: str, setting: tuple[int, int, int], c: int,
              facts: dict, repeat: int = 0) -> bool:
        """One `vllm bench serve`; records the result (or the failure). False when the server cannot take the
        next step: it died, or a timed-out bench may have left requests running on it."""
        inp, outp, per_c = setting
        name = f"{method.name}_{inp}_{outp}_c{c}_r{repeat}.json"
        step = f"{method.name} {inp}/{outp} c={c}" + (f" run {repeat + 1}" if self.args.repeats > 1 else "")
        result_dir = os.path.join(self.args.work, "bench")
        bench_args = [
            "--backend", "vllm", "--base-url", server.base_url, "--model", model,
            "--dataset-name", "random", "--random-input-len", str(inp), "--random-output-len", str(outp),
            "--num-prompts", str(num_prompts(c, per_c, self.min_prompts)), "--max-concurrency", str(c),
            "--ignore-eos", "--num-warmups", str(c), "--disable-tqdm", "--save-result", "--result-dir", result_dir,
            "--result-filename", name, *self.bench_extra,
        ]
        command = f"{self.command_line(server)} && {shlex.join(vllm_server.bench_command() + bench_args)}"
        ctx = self.context(method, model, setting, c, facts, command, repeat)
        timeout = min(self.args.bench_timeout, self.left() - STOP_RESERVE_S)
        path = os.path.join(result_dir, name)
        if os.path.exists(path):
            os.remove(path)
        try:
            with gpu_monitor.GpuMonitor(max_s=timeout + 60) as gpu:
                rc, output = self.client.run(bench_args, timeout)
        except TimeoutError:
            self.save(records.failed(ctx, f"bench timed out after {timeout:.0f} s"))
            self.say(f"{step}: bench timed out after {timeout:.0f} s")
            return False
        if rc != 0 or not os.path.exists(path):
            tail = output.strip().splitlines()[-15:]
            self.save(records.failed(ctx, f"bench exited with {rc}: {tail[-1] if tail else ''}"))
            self.say(f"{step}: bench failed (rc={rc}):\n  " + "\n  ".join(tail))
            return server.proc.poll() is None
        with open(path) as f:
            r = {**records.from_bench(json.load(f), ctx), **gpu.summary}
        self.save(r)
        self.say(f"{step}: {r['output_tok_s']:.1f} output tok/s, "
                 f"TPOT {r['tpot_ms']:.2f} ms, TTFT {r['ttft_ms']:.1f} ms, {r['duration_s']:.1f} s"
                 + (f"; SM {r['sm_clock_mhz']} MHz (min {r['sm_clock_mhz_min']}), {r['power_w']} W (max "
                    f"{r['power_w_max']}), busy {r['gpu_util_pct']}%, reasons {r['clock_event_reasons']}"
                    if "sm_clock_mhz" in r else "")
                 + (f"  [{r['error']}]" if r["error"] else ""))
        return True

    def method(self, method: Method, model: str) -> None:
        """Starts the server for one method, runs every setting x concurrency on it, stops it."""
        a = self.args
        steps = [(s, c, i) for s in self.settings for c in parse_concurrency(a.concurrency)
                 if (method.name, s[0], s[1], c) not in self.done for i in range(a.repeats)]
        if not steps:
            self.say(f"{method.name}: every step already measured at {self.commit} (--skip-done)")
            return
        if self.left() < a.min_start_s:
            self.say(f"{method.name}: skipped, {self.left():.0f} s left (< --min-start-s {a.min_start_s})")
            return
        log_path = os.path.join(a.work, f"server_{method.name}.log")
        server = self.start_server(model, log_path, method)
        self.say(f"{method.name}: starting {self.command_line(server)}")
        try:
            try:
                startup = server.wait_healthy(min(a.start_timeout, self.left() - STOP_RESERVE_S))
            except RuntimeError as e:
                errors = [ln for ln in server.log_text().splitlines() if "Error" in ln][-3:]
                why = f"{e}; " + " | ".join(errors)
                self.say(f"{method.name}: {why}\n  log: {log_path}")
                for setting, c, i in steps:
                    ctx = self.context(method, model, setting, c, {}, self.command_line(server), i)
                    self.save(records.failed(ctx, why))
                return
            facts = {**vllm_server.log_facts(server.log_text()), "startup_s": round(startup, 1)}
            self.say(f"{method.name}: healthy after {startup:.0f} s; {facts}")
            for setting, c, i in steps:
                if self.left() < STOP_RESERVE_S + a.min_bench_s:
                    self.say(f"{method.name} {setting[0]}/{setting[1]} c={c}: skipped, {self.left():.0f} s left")
                    continue
                if not self.bench(server, method, model, setting, c, facts, i):
                    self.say(f"{method.name}: server gone or busy; its remaining steps skipped")
                    break
        finally:
            server.stop()
            with open(self.servers_log, "a") as out:
                out.write(f"\n===== {method.name}: {self.command_line(server)}\n{server.log_text()}")

    def run(self) -> None:
        methods = parse_methods(self.args.methods)
        dirs = self.model_dirs(methods)
        if self.args.lora_rank:
            # One random adapter on q/k/v/o_proj for every method (the same file), every request through it.
            from kbit_dev.lora import make_attention_adapter

            with open(os.path.join(next(iter(dirs.values())), "config.json")) as f:
                adapter = make_attention_adapter(json.load(f), os.path.join(self.args.work, f"lora-r{self.args.lora_rank}"),
                                                 rank=self.args.lora_rank)
            methods = [with_lora(m, adapter, self.args.lora_rank) for m in methods]
            self.bench_extra = ["--lora-modules", LORA_NAME]
        self.say(f"gpu {self.gpu}, commit {self.commit}; results -> {self.results}")
        self.client.start()
        try:
            for m in methods:
                self.method(m, dirs[m.model_variant])
        finally:
            self.client.close()
        self.say(f"done; {self.stem}.md")


LORA_NAME = "adapter"


def with_lora(method: Method, adapter: str, rank: int) -> Method:
    """``method`` serving the LoRA ``adapter`` (named LORA_NAME; benches send every request to it): ``--enable-lora``
    with room for 4 adapters of rank ``rank``; the records call it ``<method>+lora<rank>``."""
    args = ("--enable-lora", "--max-loras", "4", "--max-lora-rank", str(rank), "--lora-modules", f"{LORA_NAME}={adapter}")
    return Method(f"{method.name}+lora{rank}", method.bits, method.model_variant, method.serve_args + args,
                  method.llm_kwargs)


# --routing: MODEL_ROUTING (the model's router; with dummy weights it routes by each method's own random activations)
# or a routing strategy of vLLM's simulator (VLLM_MOE_ROUTING_SIMULATION_STRATEGY), the same for every method.
MODEL_ROUTING = "model"
ROUTINGS = (MODEL_ROUTING, "uniform_random")


def routing_env(routing: str) -> dict:
    """The environment that makes vLLM route as --routing says ({} for the model's router)."""
    return {} if routing == MODEL_ROUTING else {"VLLM_MOE_ROUTING_SIMULATION_STRATEGY": routing}


def add_serve_options(ap: argparse.ArgumentParser, *, concurrency: str, stem: str, work: str, deadline_help: str,
                      deadline: float, start_timeout: float, bench_timeout: float, min_bench_s: float) -> None:
    """The options this script and big.py share (the server, the benches, the output, the time limits), with
    each one's defaults."""
    ap.add_argument("--concurrency", default=concurrency)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size: `vllm serve --tensor-parallel-size` (GPUs)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    ap.add_argument("--server-args", default="", help="extra `vllm serve` arguments, one shell-quoted string")
    ap.add_argument("--routing", default=MODEL_ROUTING, choices=ROUTINGS,
                    help="routed experts per token: the model's router (with dummy weights it routes by each method's "
                    "own random activations) or uniformly random (vLLM's VLLM_MOE_ROUTING_SIMULATION_STRATEGY)")
    ap.add_argument("--out", help="output folder (default: benchmarks/results)")
    ap.add_argument("--tag", help=f"output file stem (default: {stem})")
    ap.add_argument("--work", default=work, help="model directories, server logs, raw bench JSON")
    ap.add_argument("--deadline", type=float, default=deadline, help=deadline_help)
    ap.add_argument("--start-timeout", type=float, default=start_timeout, help="seconds for a server to become healthy")
    ap.add_argument("--bench-timeout", type=float, default=bench_timeout, help="seconds for one `vllm bench serve`")
    ap.add_argument("--min-bench-s", type=float, default=min_bench_s, help="do not start a bench with less time left")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="bf16,kbit-4,gptq-int4,kbit-2,kbit-3,kbit-5",
                    help="comma-separated, run in this order, or 'all' (bf16,gptq-int4,kbit-2..5)")
    ap.add_argument("--settings", default="1024/256,128/1024:2",
                    help="IN/OUT lengths, comma-separated; IN/OUT:P runs max(8, P x concurrency) prompts at that setting")
    ap.add_argument("--prompts-per-concurrency", type=int, default=4,
                    help="P of the settings without their own: prompts per bench = max(8, P x concurrency)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run each setting x concurrency this many times back to back on the same server")
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(model_dir.SHAPES))
    add_serve_options(ap, concurrency="1,4,16,64,128", stem="serve_<gpu>_<date>", work="/tmp/kbit_serve",
                      deadline=86400, deadline_help="seconds for the whole run (default: no practical limit)",
                      start_timeout=420, bench_timeout=300, min_bench_s=20)
    ap.add_argument("--skip-done", metavar="JSONL[,JSONL]",
                    help="skip the steps these results files already hold for this commit (resume a sweep across runs)")
    ap.add_argument("--min-start-s", type=float, default=150, help="do not start a server with less time left")
    ap.add_argument("--lora-rank", type=int, default=0, metavar="R",
                    help="serve every method with one random rank-R LoRA adapter on q/k/v/o_proj (--enable-lora "
                    "--lora-modules) and send every request to it; methods are recorded as <method>+lora<R>")
    # A SIGTERM (e.g. `timeout`) unwinds like an exception, so the running server is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.tp < 1:
        ap.error(f"--tp must be at least 1, got {args.tp}")
    try:
        settings = parse_settings(args.settings, args.prompts_per_concurrency)
    except ValueError as e:
        ap.error(str(e))
    Run(args, settings).run()


if __name__ == "__main__":
    main()
