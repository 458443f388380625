"""One row of the big-model serving benchmark: a public model at its full shape (dummy weights), one weight format,
one tensor-parallel size; load time, peak GPU memory while loading, weights, KV cache, then throughput.

    python3 benchmarks/serve/big.py --model qwen3-235b-a22b --method kbit-3 [--tp 1] [--out DIR]

The row (issue 43, item 2):

1. writes the model directory (model_dir.write: the public config.json recorded in configs/<model>.json, a text
   tokenizer of its vocabulary size; GPTQ: plus a 4-bit group-128 quantization_config);
2. starts `vllm serve --load-format dummy` (methods.py gives the method's arguments; qwen3_next's gated delta-net
   prefill runs on Triton where vLLM has --gdn-prefill-backend, as flashinfer is not installed on the GPU
   machine) while nvidia-smi samples every GPU's memory (gpu_monitor.MemorySampler);
3. records the load: ``startup_s`` (server start to /health), ``weight_load_s`` (vLLM's "Model loading took ...
   and N seconds"), ``peak_load_gib`` (largest memory.used per GPU up to the moment vLLM logged its weights loaded:
   what online quantization needs), ``peak_start_gib`` (the whole start-up: KV cache and CUDA graphs included),
   ``weight_gib`` and ``kv_cache_tokens`` (vllm_server.log_facts) and ``weight_gib_estimate`` (from the config);
4. runs `vllm bench serve` (bench_client's worker, bench_serve.Run.bench) at IN/OUT = 1024/256 for every
   concurrency (default 1,16,64) with max(--min-prompts, --prompts-per-concurrency x c) prompts (default 2 x c,
   at least 4), recording output tok/s, TPOT and TTFT;
5. appends one record per concurrency to OUT/serve_big_<date>.jsonl and rewrites OUT/serve_big_<date>.md (every
   row of the file: model, method, GPUs, weight GiB, KV tokens, load s, peak load GiB, tok/s and tok/s per GPU,
   TPOT and TTFT at each concurrency, and each row's command line).

--deadline (default: $DEADLINE, else no limit) bounds the row: a server that is not healthy in time, or a bench
that no longer fits, is recorded as failed with the reason and the load facts found so far, so a row that does not
finish still leaves what it measured. bash benchmarks/serve/big.sh wraps this (builds the CUDA extension if
missing, installs the plugin entry point). Rows measured in separate calls (each writing its own folder) go into one
file with `python3 benchmarks/serve/big.py merge STEM A/serve_big_<date>.jsonl B/serve_big_<date>.jsonl ...`
(writes STEM.jsonl, STEM.md and, where matplotlib imports, STEM.png). Without a GPU, check it on vLLM's CPU build with the CPU-sized shape:

    python benchmarks/serve/big.py --model tiny --method kbit-4 --concurrency 1 --input-len 32 --output-len 8 \
        --max-model-len 256 --gpu-memory-utilization 0.3 --server-args=--enforce-eager --out /tmp/x
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_serve  # noqa: E402
import gpu_monitor  # noqa: E402
import model_dir  # noqa: E402
import records  # noqa: E402
import vllm_server  # noqa: E402
from methods import METHODS, Method  # noqa: E402

_WEIGHT_LOAD_S = re.compile(r"Model loading took [0-9.]+ GiB(?: memory)? and ([0-9.]+) seconds")
_LOADED = "Model loading took"
# The kbit load line's torch figures: peak allocated (what loading needed) and reserved (what the allocator held).
_TORCH_PEAK = re.compile(r"peak GPU memory so far: ([0-9.]+) GiB allocated, ([0-9.]+) GiB reserved")
# Bits per quantized weight for the weight estimate: kbit k + one E4M4 byte per 32; GPTQ 4 bits + an fp16 scale and
# a packed zero per group of 128 (about 4.16); bf16 16.
_BITS = {"gptq-int4": 4 + (16 + 4) / 128, "bf16": 16.0}


def estimate_bits(method: Method) -> float:
    return _BITS.get(method.name, method.bits + 0.25)


def weight_load_s(log_text: str) -> float | None:
    """The seconds of vLLM's "Model loading took X GiB memory and N seconds" (the largest over the workers)."""
    values = [float(v) for v in _WEIGHT_LOAD_S.findall(log_text)]
    return max(values) if values else None


def torch_peak_gib(log_text: str) -> dict:
    """The largest peak allocated / reserved GiB over the kbit load lines of the log (one per worker), or {}."""
    found = [(float(a), float(r)) for a, r in _TORCH_PEAK.findall(log_text)]
    if not found:
        return {}
    return {"torch_peak_allocated_gib": max(a for a, _ in found), "torch_peak_reserved_gib": max(r for _, r in found)}


def model_type(name: str) -> str:
    return model_dir.public_config(name)["model_type"] if name in model_dir.PUBLIC else "qwen3_moe"


class BigRun(bench_serve.Run):
    """bench_serve.Run for one (model, method, tensor-parallel size) row, with the load measured."""

    def __init__(self, args: argparse.Namespace):
        today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
        args.tag = args.tag or f"serve_big_{today}"
        args.skip_done, args.repeats, args.shape = "", 1, args.model
        super().__init__(args, [(args.input_len, args.output_len, args.prompts_per_concurrency)])
        self.method_ = METHODS[args.method]
        self.model_name = args.model

    def serve_args(self, method: Method) -> list[str]:
        a = self.args
        tp = ["--tensor-parallel-size", str(a.tp)] if a.tp > 1 else []
        gdn = (["--gdn-prefill-backend", "triton"]
               if model_type(self.model_name) == "qwen3_next" and vllm_server.has_engine_arg("gdn_prefill_backend")
               else [])
        return ["--load-format", "dummy", *tp, "--max-model-len", str(a.max_model_len),
                "--gpu-memory-utilization", str(a.gpu_memory_utilization), "--no-enable-prefix-caching",
                "--disable-uvicorn-access-log", *method.serve_args, *gdn, *shlex.split(a.server_args)]

    def context(self, method: Method, model: str, setting: tuple[int, int, int], c: int, facts: dict, command: str,
                repeat: int = 0) -> dict:
        ctx = super().context(method, model, setting, c, facts, command, repeat)
        repo = model_dir.PUBLIC[self.model_name].repo if self.model_name in model_dir.PUBLIC else "Qwen3-MoE shape"
        ctx.update(model=f"{self.model_name} ({repo}), full shape, dummy weights", model_name=self.model_name,
                   gpus=self.args.tp)
        return ctx

    def save(self, record: dict) -> None:
        records.append(self.results, record)
        write(records.load([self.results]), self.stem)

    def model_path(self) -> str:
        variant = self.method_.model_variant
        qc = model_dir.gptq_config(self.model_name) if variant == "gptq-int4" else None
        return model_dir.write(self.model_name, os.path.join(self.args.work, f"{self.model_name}-{variant}"), qc)

    def row(self, model: str) -> None:
        a, method = self.args, self.method_
        concurrencies = bench_serve.parse_concurrency(a.concurrency)
        setting = self.settings[0]
        facts: dict = {"weight_gib_estimate": round(model_dir.weight_gib_estimate(self.model_name, estimate_bits(method)), 2)}
        log_path = os.path.join(a.work, f"server_{self.model_name}_{method.name}_tp{a.tp}.log")
        loaded_at: list[datetime.datetime] = []
        with gpu_monitor.MemorySampler() as memory:
            server = self.start_server(model, log_path, method)
            command = self.command_line(server)
            self.say(f"{method.name}: starting {command}")

            def watch() -> None:  # the moment the weights are loaded ends the loading phase
                if not loaded_at and _LOADED in server.log_text():
                    loaded_at.append(datetime.datetime.now())

            def load_facts() -> dict:
                text = server.log_text()
                load = memory.peak_gib(loaded_at[0]) if loaded_at else {}
                start = memory.peak_gib()
                return {**facts, **vllm_server.log_facts(text), **torch_peak_gib(text), "weight_load_s": weight_load_s(text),
                        "peak_load_gib": round(max(load.values()), 2) if load else None,
                        "peak_start_gib": round(max(start.values()), 2) if start else None,
                        "peak_load_gib_per_gpu": [round(load[i], 2) for i in sorted(load)] if load else None}

            try:
                try:
                    startup = server.wait_healthy(min(a.start_timeout, self.left() - bench_serve.STOP_RESERVE_S),
                                                  on_poll=watch, period_s=0.5)
                except RuntimeError as e:
                    watch()
                    errors = [ln for ln in server.log_text().splitlines() if "Error" in ln][-3:]
                    why = f"{e}; " + " | ".join(errors)
                    self.say(f"{method.name}: {why}\n  log: {log_path}")
                    got = {**load_facts(), "gave_up_after_s": round(time.monotonic() - server.started_at, 1)}
                    for c in concurrencies:
                        self.save(records.failed(self.context(method, model, setting, c, got, command), why))
                    return
                watch()
                facts = {**load_facts(), "startup_s": round(startup, 1)}
                self.say(f"{method.name}: healthy after {startup:.0f} s; {facts}")
                for c in concurrencies:
                    if self.left() < bench_serve.STOP_RESERVE_S + a.min_bench_s:
                        why = f"skipped: {self.left():.0f} s left of the deadline"
                        self.say(f"{method.name} c={c}: {why}")
                        self.save(records.failed(self.context(method, model, setting, c, facts, command), why))
                        continue
                    if not self.bench(server, method, model, setting, c, facts):
                        self.say(f"{method.name}: server gone or busy; its remaining steps skipped")
                        break
            finally:
                server.stop()
                memory.close()
                with open(self.servers_log, "a") as out:
                    out.write(f"\n===== {self.model_name} {method.name} TP={a.tp}: {command}\n{server.log_text()}")

    def run(self) -> None:
        model = self.model_path()
        self.say(f"gpu {self.gpu}, commit {self.commit}; {self.model_name} {self.method_.name} TP={self.args.tp}; "
                 f"results -> {self.results}")
        self.client.start()
        try:
            self.row(model)
        finally:
            self.client.close()
        self.say(f"done; {self.stem}.md")


# ---- report: one table row per (model, method, GPUs) --------------------------------------------------------------

def method_label(r: dict) -> str:
    """A row's method, with the routing where it is not the model's router (--routing), so rows of one method under
    different routings stay apart."""
    routing = r.get("routing") or bench_serve.MODEL_ROUTING  # rows recorded before --routing existed
    return r["method"] if routing == bench_serve.MODEL_ROUTING else f"{r['method']}, {routing} routing"


def rows(recs: list[dict]) -> dict[tuple, dict[int, dict]]:
    """(model_name, method label, gpus) -> {concurrency: the last record}, rows in the order first seen."""
    out: dict[tuple, dict[int, dict]] = {}
    for r in recs:
        key = (r.get("model_name", r["model"]), method_label(r), r.get("gpus", r.get("tp", 1)))
        out.setdefault(key, {})[r["concurrency"]] = r
    return out


def _f(v, spec: str = ".1f") -> str:
    return "" if v is None else format(v, spec)


def _load_s(facts: dict) -> str:
    """Server start to healthy; for a server that never got healthy, how long it was given ("> N")."""
    if facts.get("startup_s") is None and facts.get("gave_up_after_s") is not None:
        return f"> {facts['gave_up_after_s']:.0f}"
    return _f(facts.get("startup_s"), ".0f")


def markdown(recs: list[dict]) -> str:
    if not recs:
        return "no records\n"
    table = rows(recs)
    concs = sorted({c for by_c in table.values() for c in by_c})
    first = recs[0]
    out = [
        f"# Big models served with dummy weights, {first['gpu']}",
        "",
        f"Dates {min(r['date'] for r in recs)} .. {max(r['date'] for r in recs)}; commits "
        f"{', '.join(sorted({r['commit'] for r in recs}))}. Full-shape models from their public config.json "
        "(benchmarks/serve/configs/), `vllm serve --load-format dummy`, `vllm bench serve` random dataset "
        f"{first['input_len']} in / {first['output_len']} out, `--ignore-eos`. Weight GiB: vLLM's \"Model loading took\" "
        "(per GPU; estimate from the config in brackets); KV tokens: the engine's; load s: server start to healthy "
        "(weights alone in brackets); peak load GiB: largest nvidia-smi memory.used of a GPU until the weights were "
        "loaded (whole start-up in brackets; torch's peak allocated / reserved while kbit loaded, from its load line, in "
        "square brackets: allocated is what loading needed, reserved minus allocated is the allocator's slack). Per concurrency c: output tok/s, tok/s per GPU, mean TPOT ms, mean TTFT ms.",
        "",
        "| model | method | GPUs | weight GiB | KV tokens | load s | peak load GiB | "
        + " | ".join(f"c={c} tok/s | per GPU | TPOT | TTFT" for c in concs) + " |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |" + " ---: | ---: | ---: | ---: |" * len(concs),
    ]
    notes, commands = [], []
    for (model, method, gpus), by_c in table.items():
        last = by_c[max(by_c)]
        facts = next((r for r in by_c.values() if r.get("weight_gib") is not None), last)
        cells = [model, method, str(gpus),
                 f"{_f(facts.get('weight_gib'), '.2f')} ({_f(facts.get('weight_gib_estimate'))})",
                 _f(facts.get("kv_cache_tokens"), ","),
                 f"{_load_s(facts)} ({_f(facts.get('weight_load_s'), '.0f')})",
                 f"{_f(facts.get('peak_load_gib'))} ({_f(facts.get('peak_start_gib'))})"
                 + (f" [{_f(facts['torch_peak_allocated_gib'])} / {_f(facts.get('torch_peak_reserved_gib'))}]"
                    if facts.get("torch_peak_allocated_gib") is not None else "")]
        for c in concs:
            r = by_c.get(c)
            if r is None or r.get("output_tok_s") is None:
                cells += ["failed" if r is not None else "", "", "", ""]
                if r is not None:
                    notes.append(f"- {model} {method} GPUs={gpus} c={c}: {r.get('error')}")
                continue
            cells += [f"{r['output_tok_s']:.0f}" + (" ⚠" if r.get("error") else ""), f"{r['output_tok_s'] / gpus:.0f}",
                      f"{r['tpot_ms']:.2f}", f"{r['ttft_ms']:.0f}"]
            if r.get("error"):
                notes.append(f"- {model} {method} GPUs={gpus} c={c}: {r['error']}")
        out.append("| " + " | ".join(cells) + " |")
        commands.append(f"- {model} {method} GPUs={gpus}: `{last['command']}`")
    if notes:
        out += ["", "Failed or flagged steps:", "", *notes]
    remarks = [f"- {m} {x} GPUs={g}: {r['note']}" for (m, x, g), by_c in table.items()
               for r in [by_c[max(by_c)]] if r.get("note")]  # a row's free-text remark, e.g. how it was recovered
    if remarks:
        out += ["", "Remarks:", "", *remarks]
    out += ["", "Command lines (server, then the last bench):", "", *commands]
    return "\n".join(out) + "\n"


def write(recs: list[dict], stem: str) -> str:
    with open(stem + ".md", "w") as f:
        f.write(markdown(recs))
    return stem + ".md"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, choices=model_dir.names())
    ap.add_argument("--method", required=True, choices=sorted(METHODS))
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--prompts-per-concurrency", type=int, default=2, help="prompts per bench: P x concurrency ...")
    ap.add_argument("--min-prompts", type=int, default=4, help="... and at least this many")
    bench_serve.add_serve_options(
        ap, concurrency="1,16,64", stem="serve_big_<date>", work="/tmp/kbit_serve_big",
        deadline=float(os.environ.get("DEADLINE", 86400)),
        deadline_help="seconds for the whole row (default: $DEADLINE, else no practical limit)",
        start_timeout=1500, bench_timeout=420, min_bench_s=30)
    args = ap.parse_args(argv)
    if args.tp < 1 or args.min_prompts < 1 or args.prompts_per_concurrency < 1:
        ap.error("--tp, --min-prompts and --prompts-per-concurrency must be at least 1")
    return args


def plot(recs: list[dict], path: str) -> bool:
    """Output tok/s per GPU of every row at each concurrency above 1, one bar group per row (False without
    matplotlib: the plot is optional)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    table = dict(sorted(rows(recs).items(), key=lambda kv: kv[0][0]))  # one model's rows side by side
    concs = sorted({c for by_c in table.values() for c in by_c if c > 1})
    # One line per part of the method label ("kbit-4", "uniform_random routing"), so long labels do not overlap.
    labels = [f"{m}\n{x.replace(', ', chr(10))}\n{g} GPU{'s' if g > 1 else ''}" for m, x, g in table]
    fig, ax = plt.subplots(figsize=(max(8, 1.4 * len(labels)), 5))
    width = 0.8 / max(1, len(concs))
    for j, c in enumerate(concs):
        vals = [(by_c[c]["output_tok_s"] or 0) / g if c in by_c else 0 for (_, _, g), by_c in table.items()]
        ax.bar([i + j * width for i in range(len(labels))], vals, width, label=f"c = {c}")
    ax.set_xticks([i + width * (len(concs) - 1) / 2 for i in range(len(labels))], labels, fontsize=7)
    ax.set_ylabel("output tok/s per GPU")
    ax.set_title(f"Full-shape MoE models, dummy weights, {recs[0]['gpu']}, {recs[0]['input_len']} in / "
                 f"{recs[0]['output_len']} out")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def merge(paths: list[str], stem: str) -> str:
    """Writes STEM.jsonl (the records of the given JSONL files, in order: e.g. one file per GPU call), STEM.md and,
    where matplotlib imports, STEM.png."""
    recs = records.load(paths)
    os.makedirs(os.path.dirname(os.path.abspath(stem)), exist_ok=True)
    with open(stem + ".jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)
    plot(recs, stem + ".png")
    return write(recs, stem)


def main() -> None:
    if sys.argv[1:2] == ["merge"]:  # big.py merge STEM A.jsonl [B.jsonl ...]
        if len(sys.argv) < 4:
            sys.exit("usage: big.py merge STEM RESULTS.jsonl [MORE.jsonl ...]  (writes STEM.jsonl, STEM.md, STEM.png)")
        print("wrote", merge(sys.argv[3:], sys.argv[2]))
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds, so the server is stopped on the way out
    t0 = time.monotonic()
    run = BigRun(parse_args())
    run.t0, run.deadline = t0, t0 + run.args.deadline
    run.run()


if __name__ == "__main__":
    main()
