"""Serving soak: `vllm serve` with kbit under a long random load, then checks that nothing was lost.

    python benchmarks/serve/soak.py                       # Qwen3-30B-A3B shape, dummy weights, kbit-4, 2000 requests
    python benchmarks/serve/soak.py --model DIR           # a model directory (its own weights)

What it does (issue 21, item 6):

1. Starts `vllm serve` (vllm_server.py: the CLI on vLLM's CUDA build, the api_server module on the CPU build)
   with --quantization kbit (--method, default kbit-4) and --max-model-len = --max-prompt + --max-output.
   Without --model it serves a weightless model directory of --shape (model_dir.py) with --load-format dummy.
2. Before the load: a greedy pass (temperature 0, --greedy-tokens tokens, ignore_eos) over 8 fixed
   token-id prompts, one request at a time, and the GPU memory in use (nvidia-smi; null without a GPU).
3. The load: --requests streaming completions on localhost through aiohttp. Prompts are random token ids
   of length uniform in 1..--max-prompt; outputs uniform in 1..--max-output with ignore_eos (so each
   request must end with exactly that many tokens); sampling temperature drawn from {0, 0.7, 1}. The
   number of requests in flight follows a random target in 1..--max-concurrency that changes after a
   random number of requests (a phase), so the server sees both rising and falling load. --cut-fraction
   of the requests (10%) disconnect after their first 1..3 streamed chunks. Every random choice comes
   from --seed, so the same arguments send the same requests in the same phases.
4. After it: the in-flight requests drain; /metrics must show no request left running or waiting (aborted
   streams were freed); /health and one completion answer; the greedy pass again gives the same token ids;
   the GPU memory in use is within --mem-tolerance (1%) of before; the server log has no traceback, CUDA
   error or ERROR line.

A request counts as completed when its stream ended with [DONE], finish_reason "length", exactly
max_tokens token ids streamed and the usage numbers (prompt and completion tokens) as sent; as aborted
when the client closed it on purpose; anything else is an error (HTTP status, exception, short or long
output), and the first few are listed in the result.

Why token-id prompts: their length in tokens is exact for any tokenizer (the tokenizer of the dummy
directories and a real model's alike). Why prefix caching is off by default: a cached prefix computes the
prompt in another order than a fresh prefill, which can flip a near-tied greedy choice (dummy weights are
nearly tied everywhere); the before/after comparison is meant to catch corrupted state, not that.
--prefix-caching keeps vLLM's default (on).

Writes OUT/soak_<gpu>_<date>.json (OUT: --out, default benchmarks/results) with requests, completed, aborted,
errors, gpu_mem_before_mib, gpu_mem_after_mib, outputs_identical, commit, command and the details (checks,
failures, durations, concurrency, token totals, log problems), the server log beside it as *_server.log,
prints a one-line summary and exits 1 when a check fails.

Bounds: --duration-limit S stops issuing new requests S seconds into the load; --deadline S does the same
when less than --reserve-s is left of S seconds for the whole run (start-up included). Requests already
sent still drain and are checked; the result then says "stopped_early" with the reason and how many of
--requests were sent. Requests still running when the drain time runs out are cancelled and fail the run.

Lengths are clamped to what the model holds (config.json's max_position_embeddings), with a warning; the
dummy directories are written with room for --max-prompt + --max-output. On the CPU build, check the
harness with the tiny random checkpoint (max_position_embeddings 512):

    python -m kbit_dev.tiny_models qwen3_moe /tmp/soak-tiny
    python benchmarks/serve/soak.py --model /tmp/soak-tiny --requests 40 --max-prompt 64 --max-output 16 \\
        --max-concurrency 8 --gpu-memory-utilization 0.3 --server-args=--enforce-eager --out /tmp/soak-out
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

import model_dir  # noqa: E402
import vllm_server  # noqa: E402
from bench_serve import commit, free_port, gpu_name  # noqa: E402
from methods import METHODS  # noqa: E402

SERVED_NAME = "soak"
CUT_MIN_OUTPUT = 8  # a request chosen to disconnect asks for at least this many tokens, so it is cut mid-stream
CUT_MAX_CHUNKS = 3  # ... after its first 1..3 chunks that carry tokens
GREEDY_PROMPTS = 8
TEMPERATURES = (0.0, 0.7, 1.0)
MAX_EXAMPLES = 20  # error examples and log lines kept in the result

# Server log lines that mean something broke. Aborted requests (client disconnects) log at INFO.
LOG_PROBLEM = re.compile(
    r"Traceback \(most recent call last\)|CUDA error|cudaError|CUBLAS_STATUS|illegal memory access|"
    r"device-side assert|out of memory|EngineDeadError|EngineCore[^\n]*(died|failed)|Segmentation fault|"
    r"core dumped|\bERROR\b"
)


def say(t0: float, msg: str) -> None:
    print(f"[{time.monotonic() - t0:6.0f} s] {msg}", flush=True)


# ---------------------------------------------------------------- the plan: every random choice, from the seed


@dataclass(frozen=True)
class Request:
    index: int
    prompt_len: int
    max_tokens: int
    temperature: float
    cut_after: int | None  # disconnect after this many token-carrying chunks; None: read to the end


def plan_requests(n: int, seed: int, max_prompt: int, max_output: int, cut_fraction: float) -> list[Request]:
    rng = random.Random(f"soak-requests-{seed}")
    n_cut = round(n * cut_fraction) if max_output >= 2 else 0
    cut = set(rng.sample(range(n), n_cut))
    out = []
    for i in range(n):
        prompt_len = rng.randint(1, max_prompt)
        temperature = rng.choice(TEMPERATURES)
        if i in cut:
            max_tokens = rng.randint(min(CUT_MIN_OUTPUT, max_output), max_output)
            cut_after = rng.randint(1, min(CUT_MAX_CHUNKS, max_tokens - 1))
        else:
            max_tokens = rng.randint(1, max_output)
            cut_after = None
        out.append(Request(i, prompt_len, max_tokens, temperature, cut_after))
    return out


def plan_phases(n: int, seed: int, max_concurrency: int) -> list[tuple[int, int]]:
    """[(target concurrency, requests issued at it), ...] covering n requests. A phase issues 1..2x its
    target, so a high target fills up and a low one drains the server down to it."""
    rng = random.Random(f"soak-phases-{seed}")
    phases, left = [], n
    while left > 0:
        target = rng.randint(1, max_concurrency)
        count = min(left, rng.randint(1, 2 * target))
        phases.append((target, count))
        left -= count
    return phases


def prompt_ids(key: str, length: int, vocab: int) -> list[int]:
    rng = random.Random(key)
    return [rng.randrange(vocab) for _ in range(length)]


def greedy_prompts(seed: int, max_prompt: int, vocab: int) -> list[list[int]]:
    """GREEDY_PROMPTS fixed prompts from 1 token to max_prompt tokens."""
    fractions = [i / (GREEDY_PROMPTS - 1) for i in range(GREEDY_PROMPTS)]
    return [prompt_ids(f"soak-greedy-{seed}-{i}", max(1, round(max_prompt * f)), vocab) for i, f in enumerate(fractions)]


# ---------------------------------------------------------------- plain HTTP (before and after the load)


def http_json(url: str, body: dict | None = None, timeout: float = 300) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def health_ok(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=30) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def greedy_pass(base: str, prompts: list[list[int]], max_tokens: int) -> list[list[int] | str]:
    """Generated token ids per prompt, one request at a time (same batch shapes on both passes); a failed
    request gives its error text instead, which never equals a list of ids."""
    outs = []
    for ids in prompts:
        body = {"model": SERVED_NAME, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True}
        try:
            reply = http_json(f"{base}/v1/completions", body)
            outs.append(list(reply["choices"][0]["token_ids"]))
        except (urllib.error.URLError, ConnectionError, TimeoutError, KeyError, ValueError) as e:
            outs.append(f"error: {e!r}")
    return outs


_FINISHED = re.compile(r'^vllm:request_success_total\{[^}]*finished_reason="([^"]+)"[^}]*\} ([0-9.e+]+)$')


def engine_metrics(base: str) -> dict | None:
    """From /metrics: {"in_engine": requests running + waiting, "finished": {finish reason: requests}}
    (None if unreadable)."""
    try:
        with urllib.request.urlopen(f"{base}/metrics", timeout=30) as r:
            text = r.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None
    in_engine, seen, finished = 0.0, False, {}
    for line in text.splitlines():
        if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
            in_engine += float(line.rsplit(" ", 1)[1])
            seen = True
        elif m := _FINISHED.match(line):
            finished[m.group(1)] = finished.get(m.group(1), 0) + round(float(m.group(2)))
    return {"in_engine": round(in_engine) if seen else None, "finished": finished}


def wait_idle(base: str, timeout_s: float) -> dict | None:
    """engine_metrics() once no request is left in the engine, or when timeout_s has passed."""
    end = time.monotonic() + timeout_s
    while True:
        m = engine_metrics(base)
        if (m is not None and m["in_engine"] == 0) or time.monotonic() > end:
            return m
        time.sleep(1)


def gpu_memory_mib() -> int | None:
    """Memory in use on the server's GPU (the first of CUDA_VISIBLE_DEVICES, else 0) per nvidia-smi; None
    without one. Read from outside the server so this process holds no CUDA context of its own."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    dev = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip() or "0"
    try:
        out = subprocess.run([smi, f"--id={dev}", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
        return int(out.split()[0])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None


# ---------------------------------------------------------------- the load


def _check_stream(req: Request, finished: bool, finish: str | None, tokens: int, usage: dict | None) -> str | None:
    """Why a stream read to the end is not a correct completion, or None."""
    if not finished:
        return "stream ended without [DONE]"
    if finish != "length":
        return f"finish_reason {finish!r}, expected 'length'"
    if tokens != req.max_tokens:
        return f"{tokens} token ids streamed, expected {req.max_tokens}"
    if not usage:
        return "no usage chunk"
    if usage.get("completion_tokens") != req.max_tokens or usage.get("prompt_tokens") != req.prompt_len:
        return (f"usage {usage.get('prompt_tokens')}/{usage.get('completion_tokens')} tokens, expected "
                f"{req.prompt_len}/{req.max_tokens}")
    return None


async def send(session, base: str, req: Request, seed: int, vocab: int, request_timeout: float) -> dict:
    """One streaming completion; {"outcome": "completed" | "aborted" | "error", "error", "tokens"}."""
    import aiohttp

    body = {"model": SERVED_NAME, "prompt": prompt_ids(f"soak-prompt-{seed}-{req.index}", req.prompt_len, vocab),
            "max_tokens": req.max_tokens, "temperature": req.temperature, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    tokens = chunks = 0
    finish, usage, finished = None, None, False
    timeout = aiohttp.ClientTimeout(total=request_timeout, sock_connect=30)
    try:
        async with session.post(f"{base}/v1/completions", json=body, timeout=timeout) as resp:
            if resp.status != 200:
                text = (await resp.text())[:200]
                return {"outcome": "error", "error": f"HTTP {resp.status}: {text}", "tokens": 0}
            buf = b""
            async for data in resp.content.iter_any():
                buf += data
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    for line in event.splitlines():
                        if not line.startswith(b"data:"):
                            continue
                        payload = line[5:].strip()
                        if payload == b"[DONE]":
                            finished = True
                            continue
                        obj = json.loads(payload)
                        if "error" in obj:
                            return {"outcome": "error", "error": f"in stream: {obj['error']}"[:300], "tokens": tokens}
                        for choice in obj.get("choices") or []:
                            got = len(choice.get("token_ids") or [])
                            tokens += got
                            chunks += got > 0
                            finish = choice.get("finish_reason") or finish
                        usage = obj.get("usage") or usage
                if req.cut_after is not None and chunks >= req.cut_after and finish is None:
                    resp.close()  # drops the connection: the server sees the client go away
                    return {"outcome": "aborted", "error": None, "tokens": tokens}
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        return {"outcome": "error", "error": f"{type(e).__name__}: {e}"[:300], "tokens": tokens}
    problem = _check_stream(req, finished, finish, tokens, usage)
    return {"outcome": "error" if problem else "completed", "error": problem, "tokens": tokens}


def _until(t: float, at_least: float = 0.05) -> float | None:
    """A timeout for asyncio.wait that ends at monotonic time t (None: no end)."""
    return None if t == float("inf") else max(at_least, t - time.monotonic())


async def run_load(base: str, plan: list[Request], phases: list[tuple[int, int]], args, stop_at: float,
                   drain_limit: float, server_alive, t0: float) -> dict:
    """Issues the plan phase by phase, keeping at most the phase's target in flight; stops issuing at stop_at
    (or when the server exits), then waits for what is in flight up to --drain-timeout (and not past
    drain_limit) and cancels the rest."""
    import aiohttp

    results: list[dict] = []
    in_flight: set[asyncio.Task] = set()
    max_in_flight, issued, stop_reason = 0, 0, None
    next_report = time.monotonic() + 30
    t_load = time.monotonic()

    def collect(done: set) -> None:
        for task in done:
            results.append(task.result())

    # One connection per request, as independent clients have: a pooled keep-alive connection that sat idle
    # past the server's keep-alive timeout can be closed by the server just as it is reused, and the request
    # then fails with a connection reset that says nothing about the server. The phases bound the count.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        requests = iter(plan)
        for phase_no, (target, count) in enumerate(phases):
            for _ in range(count):
                req = next(requests)
                while len(in_flight) >= target and time.monotonic() < stop_at:
                    done, in_flight = await asyncio.wait(in_flight, timeout=_until(stop_at),
                                                         return_when=asyncio.FIRST_COMPLETED)
                    collect(done)
                if time.monotonic() >= stop_at:
                    stop_reason = stop_reason or "time limit"
                    break
                if not server_alive():
                    stop_reason = "server exited"
                    break
                in_flight.add(asyncio.create_task(send(session, base, req, args.seed, args.prompt_vocab,
                                                       args.request_timeout)))
                issued += 1
                max_in_flight = max(max_in_flight, len(in_flight))
                if time.monotonic() >= next_report:
                    next_report += 30
                    say(t0, f"load: {issued}/{len(plan)} sent, {len(results)} done, {len(in_flight)} in flight "
                            f"(phase {phase_no + 1}/{len(phases)}, target {target})")
            if stop_reason:
                break
        t_issue_end = time.monotonic()
        pending: set = set()
        if in_flight:
            say(t0, f"load: {issued} sent{f' (stopped: {stop_reason})' if stop_reason else ''}; "
                    f"draining {len(in_flight)} in flight")
            drain_until = min(time.monotonic() + args.drain_timeout, drain_limit)
            done, pending = await asyncio.wait(in_flight, timeout=_until(drain_until, 1.0))
            collect(done)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    phases_run = phases[: phase_no + 1] if phases else []
    return {
        "results": results, "issued": issued, "unfinished": len(pending), "stop_reason": stop_reason,
        "max_in_flight": max_in_flight, "load_s": time.monotonic() - t_load, "issue_s": t_issue_end - t_load,
        "phases": len(phases_run), "targets": [t for t, _ in phases_run],
    }


# ---------------------------------------------------------------- the run


def model_limit(model: str) -> int | None:
    """max_position_embeddings from the model's config.json (a directory, else the Hugging Face cache)."""
    path = os.path.join(model, "config.json")
    try:
        if os.path.isfile(path):
            with open(path) as f:
                cfg = json.load(f)
        else:
            from transformers import AutoConfig

            cfg = AutoConfig.from_pretrained(model).to_dict()
    except Exception as e:  # noqa: BLE001 -- no limit known: lengths stay as asked, the server then decides
        print(f"warning: could not read {model}'s config ({e}); lengths are not clamped", flush=True)
        return None
    cfg = cfg.get("text_config") or cfg
    return cfg.get("max_position_embeddings")


def clamp_lengths(max_prompt: int, max_output: int, limit: int | None) -> tuple[int, int, str | None]:
    """(max_prompt, max_output) so that their sum fits limit; the output keeps at most a quarter of it."""
    if limit is None or max_prompt + max_output <= limit:
        return max_prompt, max_output, None
    new_output = max(1, min(max_output, limit // 4))
    new_prompt = max(1, min(max_prompt, limit - new_output))
    why = (f"the model holds {limit} positions: prompts up to {new_prompt} tokens (asked {max_prompt}), outputs "
           f"up to {new_output} (asked {max_output})")
    return new_prompt, new_output, why


def dummy_model(shape: str, work: str, positions: int) -> str:
    """A weightless directory of the shape (model_dir.py) whose max_position_embeddings holds `positions`."""
    path = model_dir.write(shape, os.path.join(work, shape))
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if cfg.get("max_position_embeddings", 0) < positions:
        cfg["max_position_embeddings"] = positions
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2)
    return path


def log_problems(text: str) -> list[str]:
    return [ln.strip()[:300] for ln in text.splitlines() if LOG_PROBLEM.search(ln)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory or id served with its own weights (default: --shape, dummy weights)")
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(model_dir.SHAPES),
                    help="weightless model directory served with --load-format dummy when no --model is given")
    ap.add_argument("--method", default="kbit-4", choices=sorted(METHODS), help="weight format (methods.py)")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--max-prompt", type=int, default=4096, help="prompt lengths uniform in 1..this (tokens)")
    ap.add_argument("--max-output", type=int, default=512, help="output lengths uniform in 1..this (tokens)")
    ap.add_argument("--max-concurrency", type=int, default=256, help="phase targets uniform in 1..this")
    ap.add_argument("--cut-fraction", type=float, default=0.1, help="share of requests that disconnect mid-stream")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-vocab", type=int, default=256,
                    help="prompt token ids are drawn from 0..this-1 (256: the byte tokens of the dummy directories)")
    ap.add_argument("--greedy-tokens", type=int, default=32, help="max_tokens of the fixed greedy prompts")
    ap.add_argument("--mem-tolerance", type=float, default=0.01, help="allowed GPU memory change, as a fraction")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--prefix-caching", action="store_true", help="leave vLLM's prefix caching on (default: off)")
    ap.add_argument("--server-args", default="", help="extra `vllm serve` arguments, one shell-quoted string")
    ap.add_argument("--duration-limit", type=float, default=None, help="stop sending new requests after this many s of load")
    ap.add_argument("--deadline", type=float, default=None, help="seconds for the whole run, server start-up included")
    ap.add_argument("--reserve-s", type=float, default=120,
                    help="with --deadline: stop sending when this much is left (drain, checks, server stop)")
    ap.add_argument("--start-timeout", type=float, default=600, help="seconds for the server to become healthy")
    ap.add_argument("--request-timeout", type=float, default=900, help="seconds for one load request")
    ap.add_argument("--drain-timeout", type=float, default=600, help="seconds for the requests in flight after the last send")
    ap.add_argument("--idle-timeout", type=float, default=60, help="seconds for /metrics to show no request left")
    ap.add_argument("--out", help="output folder (default: benchmarks/results)")
    ap.add_argument("--tag", help="output file stem (default: soak_<gpu>_<date>)")
    ap.add_argument("--work", default="/tmp/kbit_soak", help="model directory and server log")
    args = ap.parse_args()
    if args.requests < 1 or args.max_prompt < 1 or args.max_output < 1 or args.max_concurrency < 1:
        ap.error("--requests, --max-prompt, --max-output and --max-concurrency must be at least 1")
    if not 0 <= args.cut_fraction <= 1:
        ap.error("--cut-fraction must be in [0, 1]")
    # A SIGTERM (e.g. `timeout`) unwinds like an exception, so the server is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    t0 = time.monotonic()
    end_of_run = t0 + args.deadline if args.deadline else float("inf")
    gpu = gpu_name()
    today = datetime.datetime.now(datetime.timezone.utc)
    out_dir = args.out or os.path.join(REPO, "benchmarks", "results")
    os.makedirs(out_dir, exist_ok=True)
    os.makedirs(args.work, exist_ok=True)
    stem = os.path.join(out_dir, args.tag or f"soak_{gpu.replace(' ', '_')}_{today:%Y-%m-%d}")
    warnings = []

    if args.model:
        model, model_desc, dummy = args.model, args.model, False
        max_prompt, max_output, why = clamp_lengths(args.max_prompt, args.max_output, model_limit(args.model))
        if why:
            warnings.append(why)
            print(f"warning: {why}", flush=True)
    else:
        max_prompt, max_output = args.max_prompt, args.max_output
        model = dummy_model(args.shape, args.work, max_prompt + max_output)
        model_desc, dummy = f"{args.shape} shape, dummy weights", True
    if args.cut_fraction > 0 and max_output < 2:
        warnings.append("no disconnects: a request must ask for at least 2 tokens to be cut mid-stream")
    greedy_tokens = min(args.greedy_tokens, max_output)
    max_model_len = max_prompt + max_output

    method = METHODS[args.method]
    serve_args = [
        "--served-model-name", SERVED_NAME, "--max-model-len", str(max_model_len),
        "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--disable-uvicorn-access-log",
        *(["--load-format", "dummy"] if dummy else []),
        *([] if args.prefix_caching else ["--no-enable-prefix-caching"]),
        *method.serve_args, *shlex.split(args.server_args),
    ]
    plan = plan_requests(args.requests, args.seed, max_prompt, max_output, args.cut_fraction)
    phases = plan_phases(args.requests, args.seed, args.max_concurrency)
    prompts = greedy_prompts(args.seed, max_prompt, args.prompt_vocab)

    record = {
        "requests": 0, "completed": 0, "aborted": 0, "errors": 0, "gpu_mem_before_mib": None,
        "gpu_mem_after_mib": None, "outputs_identical": False, "commit": commit(),
        "command": shlex.join([os.path.relpath(sys.executable, REPO) if sys.executable.startswith(REPO) else
                               sys.executable, os.path.relpath(os.path.abspath(__file__), REPO), *sys.argv[1:]]),
        "passed": False, "failures": [], "gpu": gpu, "date": f"{today:%Y-%m-%d %H:%M} UTC", "model": model_desc,
        "method": args.method, "requests_planned": args.requests, "max_prompt": max_prompt, "max_output": max_output,
        "max_model_len": max_model_len, "max_concurrency": args.max_concurrency, "cut_fraction": args.cut_fraction,
        "seed": args.seed, "greedy_prompts": len(prompts), "greedy_tokens": greedy_tokens, "warnings": warnings,
    }
    failures = record["failures"]
    log_path = os.path.join(args.work, "server.log")
    server = vllm_server.start(model, free_port(), log_path, serve_args)
    record["server_command"] = shlex.join(server.command)
    say(t0, f"{gpu}, commit {record['commit']}; starting {record['server_command']}")
    try:
        try:
            startup = server.wait_healthy(min(args.start_timeout, end_of_run - args.reserve_s - time.monotonic()))
        except RuntimeError as e:
            failures.append(f"server start: {e}")
            record["log_problems"] = log_problems(server.log_text())[:MAX_EXAMPLES]
            record["log_tail"] = server.log_text().splitlines()[-20:]
            return finish(record, stem, server, t0)
        record["startup_s"] = round(startup, 1)
        say(t0, f"healthy after {startup:.0f} s; greedy pass over {len(prompts)} prompts")
        before = greedy_pass(server.base_url, prompts, greedy_tokens)
        record["gpu_mem_before_mib"] = gpu_memory_mib()
        metrics_before = engine_metrics(server.base_url)

        stop_at = end_of_run - args.reserve_s
        if args.duration_limit is not None:
            stop_at = min(stop_at, time.monotonic() + args.duration_limit)
        say(t0, f"load: {args.requests} requests, prompts 1..{max_prompt}, outputs 1..{max_output}, "
                f"{len(phases)} concurrency phases in 1..{args.max_concurrency}, "
                f"{sum(r.cut_after is not None for r in plan)} to disconnect; "
                f"GPU memory {record['gpu_mem_before_mib']} MiB")
        stats = asyncio.run(run_load(server.base_url, plan, phases, args, stop_at, end_of_run - 60,
                                     lambda: server.proc.poll() is None, t0))
        results = stats["results"]
        record.update({
            "requests": stats["issued"],
            "completed": sum(r["outcome"] == "completed" for r in results),
            "aborted": sum(r["outcome"] == "aborted" for r in results),
            "errors": sum(r["outcome"] == "error" for r in results),
            "unfinished": stats["unfinished"],
            "stopped_early": stats["stop_reason"] is not None,
            "stop_reason": stats["stop_reason"],
            "duration_s": round(stats["load_s"], 1),
            "max_in_flight": stats["max_in_flight"],
            "concurrency_phases": stats["phases"],
            "concurrency_targets": stats["targets"],
            "prompt_tokens_sent": sum(plan[i].prompt_len for i in range(stats["issued"])),
            "output_tokens_received": sum(r["tokens"] for r in results),
            "error_examples": [f"{r['error']} (after {r['tokens']} tokens)" for r in results
                               if r["outcome"] == "error"][:MAX_EXAMPLES],
        })
        if record["errors"]:
            failures.append(f"{record['errors']} requests failed (e.g. {record['error_examples'][0]})")
        if stats["unfinished"]:
            failures.append(f"{stats['unfinished']} requests still running when the drain time ran out")
        if stats["stop_reason"] == "server exited":
            failures.append("the server exited during the load")

        metrics = wait_idle(server.base_url, min(args.idle_timeout, max(5.0, end_of_run - 30 - time.monotonic())))
        left = metrics and metrics["in_engine"]
        record["requests_left_in_engine"] = left
        if metrics and metrics_before:
            # How the engine ended the load's requests (abort: it saw the client go away first); recorded, not checked.
            record["engine_finished_during_load"] = {
                k: v - metrics_before["finished"].get(k, 0) for k, v in sorted(metrics["finished"].items())
                if v != metrics_before["finished"].get(k, 0)}
        if left != 0:
            failures.append(f"/metrics: {left} requests still running or waiting {args.idle_timeout:.0f} s after the load"
                            if left is not None else "/metrics unreadable after the load")
        record["health_after"] = health_ok(server.base_url)
        if not record["health_after"]:
            failures.append("/health does not answer 200 after the load")
        after = greedy_pass(server.base_url, prompts, greedy_tokens)
        record["completion_after"] = isinstance(after[0], list) and len(after[0]) == greedy_tokens
        if not record["completion_after"]:
            failures.append(f"a completion after the load failed: {after[0]!r}"[:300])
        record["gpu_mem_after_mib"] = gpu_memory_mib()
        record["outputs_identical"] = before == after and all(isinstance(o, list) for o in before)
        if not record["outputs_identical"]:
            failed = [i for i, (a, b) in enumerate(zip(before, after)) if isinstance(a, str) or isinstance(b, str)]
            diff = [i for i, (a, b) in enumerate(zip(before, after)) if a != b and i not in failed]
            record["greedy_differs"] = [{"prompt": i, "prompt_len": len(prompts[i]), "before": before[i],
                                         "after": after[i]} for i in failed + diff]
            if failed:
                failures.append(f"greedy requests failed for prompts {failed} (before or after the load)")
            if diff:
                failures.append(f"greedy outputs differ before and after the load for prompts {diff}")
        mb, ma = record["gpu_mem_before_mib"], record["gpu_mem_after_mib"]
        if mb is not None and ma is not None:
            record["gpu_mem_change_pct"] = round(100 * (ma - mb) / mb, 3)
            if abs(ma - mb) > args.mem_tolerance * mb:
                failures.append(f"GPU memory {mb} -> {ma} MiB, more than {100 * args.mem_tolerance:g}% apart")
        elif (mb is None) != (ma is None):
            failures.append(f"GPU memory read before ({mb}) or after ({ma}) the load only")
        if server.proc.poll() is not None:
            failures.append(f"the server exited with {server.proc.returncode}")
        log_text = server.log_text()
        problems = log_problems(log_text)
        # The copy beside the result also holds the shutdown that follows; only these lines were checked.
        record["log_lines_checked"] = log_text.count("\n")
        record["log_problems"] = problems[:MAX_EXAMPLES]
        if problems:
            failures.append(f"{len(problems)} server log lines with errors (e.g. {problems[0]!r})")
        return finish(record, stem, server, t0)
    finally:
        server.stop()
        shutil.copyfile(log_path, stem + "_server.log")


def finish(record: dict, stem: str, server, t0: float) -> int:
    record["total_s"] = round(time.monotonic() - t0, 1)
    record["passed"] = not record["failures"]
    record["server_log"] = os.path.basename(stem) + "_server.log"
    with open(stem + ".json", "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    early = (f"; stopped early ({record.get('stop_reason')}): {record['requests']}/{record['requests_planned']} sent"
             if record.get("stopped_early") else "")
    print(f"soak {'PASS' if record['passed'] else 'FAIL'}: {record['requests']} requests, {record['completed']} "
          f"completed, {record['aborted']} cut off, {record['errors']} errors, max in flight "
          f"{record.get('max_in_flight')}; GPU memory {record['gpu_mem_before_mib']} -> {record['gpu_mem_after_mib']} "
          f"MiB; outputs identical: {record['outputs_identical']}; load {record.get('duration_s')} s, total "
          f"{record['total_s']} s{early} -> {stem}.json"
          + "".join(f"\n  FAIL: {f}" for f in record["failures"]), flush=True)
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
