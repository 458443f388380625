"""Result records of the serving benchmark: one JSON object a line, one line per (method, setting, concurrency).

Fields: gpu, commit, date, model, method, bits, concurrency, input_len, output_len, output_tok_s, tpot_ms,
ttft_ms (means over requests, as `vllm bench serve` reports them), weight_gib, kv_cache_gib, kv_cache_tokens
(from the server log; weights and KV cache GiB per GPU, KV tokens for the engine), tp (tensor-parallel size;
absent = 1), command (the serve and bench command lines), plus num_prompts, completed,
total_output_tokens, duration_s, median_tpot_ms, p99_tpot_ms, median_ttft_ms, startup_s and error. A failed
step is a record with ``error`` set and no numbers, so the table shows what did not run and why.
"""

from __future__ import annotations

import json
import os

NUMBERS = ("output_tok_s", "tpot_ms", "ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_ttft_ms",
           "num_prompts", "completed", "total_output_tokens", "duration_s")

# record field <- `vllm bench serve --save-result` JSON key
_FROM_BENCH = {
    "output_tok_s": "output_throughput",
    "tpot_ms": "mean_tpot_ms",
    "ttft_ms": "mean_ttft_ms",
    "median_tpot_ms": "median_tpot_ms",
    "p99_tpot_ms": "p99_tpot_ms",
    "median_ttft_ms": "median_ttft_ms",
    "num_prompts": "num_prompts",
    "completed": "completed",
    "total_output_tokens": "total_output_tokens",
    "duration_s": "duration",
}


def from_bench(bench: dict, context: dict) -> dict:
    """A record from a bench result JSON and the run's context (gpu, commit, method, ..., command).

    A run where some requests failed, or that produced fewer output tokens than asked (``--ignore-eos``
    makes every request generate exactly output_len), keeps its numbers and gets an ``error`` saying so."""
    record = {**context, **{k: bench.get(src) for k, src in _FROM_BENCH.items()}}
    want = context["num_prompts"] * context["output_len"]
    problems = []
    if bench.get("failed"):
        problems.append(f"{bench['failed']} of {context['num_prompts']} requests failed")
    if bench.get("total_output_tokens") != want:
        problems.append(f"{bench.get('total_output_tokens')} output tokens, expected {want}")
    record["error"] = "; ".join(problems) or None
    return record


def failed(context: dict, error: str) -> dict:
    return {**context, **{k: None for k in NUMBERS}, "error": error}


def append(path: str, record: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def load(paths: list[str]) -> list[dict]:
    """Records of one or more JSONL files, in file order."""
    out = []
    for path in paths:
        with open(path) as f:
            out.extend(json.loads(line) for line in f if line.strip())
    return out


def _cell(r: dict) -> tuple:
    """The table cell a record measures: (method, input_len, output_len, concurrency)."""
    return r["method"], r["input_len"], r["output_len"], r["concurrency"]


def _measured(records: list[dict], key) -> dict[tuple, list[dict]]:
    """key(record) -> the successful records with that key, in order."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if r["output_tok_s"] is not None and not r.get("error"):
            groups.setdefault(key(r), []).append(r)
    return groups


def repeated(records: list[dict]) -> dict[tuple, list[dict]]:
    """(method, input_len, output_len, concurrency, commit) -> its successful records, in order, for the keys
    measured more than once at one commit (bench_serve --repeats, or runs of one build on several servers)."""
    groups = _measured(records, lambda r: _cell(r) + (r["commit"],))
    return {k: v for k, v in groups.items() if len(v) > 1}


def latest(records: list[dict]) -> dict[tuple, dict]:
    """(method, input_len, output_len, concurrency) -> the last record with that key (a re-run replaces a run)."""
    return {_cell(r): r for r in records}


def across_commits(records: list[dict]) -> dict[tuple, list[dict]]:
    """(method, input_len, output_len, concurrency) -> its successful records, in order, for the keys measured
    at more than one commit (a re-run on another server or build; the tables show the last one)."""
    return {k: v for k, v in _measured(records, _cell).items() if len({r["commit"] for r in v}) > 1}
