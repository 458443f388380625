"""Markdown tables and a throughput-vs-concurrency plot from serving-benchmark records.

    python3 benchmarks/serve/report.py RESULTS.jsonl [MORE.jsonl ...] --out STEM   # writes STEM.md, STEM.png

bench_serve.py calls :func:`write` after every measurement; run this by hand to merge the records of
several runs into one table and plot. Where a (method, setting, concurrency) was measured more
than once, the last record counts in the tables; repeats at one commit are also listed with their spread,
and runs at several commits with their commits and dates.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import records as rec  # noqa: E402

BASELINES = ("bf16", "gptq-int4")


def _settings(rows: dict) -> list[tuple[int, int]]:
    return sorted({(k[1], k[2]) for k in rows}, key=lambda s: (s[0] < s[1], -s[0]))


def _methods(rows: dict) -> list[str]:
    seen = []
    for k in rows:
        if k[0] not in seen:
            seen.append(k[0])
    return seen


def _cell(r: dict | None) -> str:
    if r is None:
        return ""
    if r["output_tok_s"] is None:
        return f"failed: {r['error']}"
    cell = f"{r['output_tok_s']:.0f} ({r['tpot_ms']:.2f} / {r['ttft_ms']:.0f})"
    return cell + (" ⚠" if r.get("error") else "")


def markdown(records: list[dict]) -> str:
    rows = rec.latest(records)
    if not rows:
        return "no records\n"
    first = records[0]
    methods = _methods(rows)
    out = [
        f"# Serving throughput: {first['model']}, {first['gpu']}",
        "",
        f"Dates {min(r['date'] for r in records)} .. {max(r['date'] for r in records)}; "
        f"commits {', '.join(sorted({r['commit'] for r in records}))}. `vllm bench serve`, random dataset, "
        "`--ignore-eos`, max(8, P x concurrency) prompts (per setting below). Cells: output tok/s (mean TPOT ms / mean TTFT ms); "
        "⚠: the run has an error note in the JSON (failed requests or short outputs).",
    ]
    for inp, outp in _settings(rows):
        concs = sorted({k[3] for k in rows if k[1:3] == (inp, outp)})
        prompts = [sorted({r["num_prompts"] for k, r in rows.items() if k[1:] == (inp, outp, c) and r.get("num_prompts")})
                   for c in concs]
        out += ["", f"## {inp} in / {outp} out", "",
                "Prompts per bench: " + ", ".join(f"c={c} {'/'.join(map(str, p)) or '?'}" for c, p in zip(concs, prompts)),
                "", "| method | " + " | ".join(f"c={c}" for c in concs) + " |", "| --- |" + " ---: |" * len(concs)]
        for m in methods:
            out.append(f"| {m} | " + " | ".join(_cell(rows.get((m, inp, outp, c))) for c in concs) + " |")
        # bf16 and GPTQ int4, and each with a LoRA adapter (bench_serve.py --lora-rank: "<method>+lora<R>").
        for base in [m for m in methods if m.partition("+")[0] in BASELINES]:
            if len(methods) < 2 or not any(rows.get((base, inp, outp, c), {}).get("output_tok_s") for c in concs):
                continue
            out += ["", f"Output tok/s relative to {base}:", "", "| method | " + " | ".join(f"c={c}" for c in concs) + " |",
                    "| --- |" + " ---: |" * len(concs)]
            for m in methods:
                if m == base:
                    continue
                cells = []
                for c in concs:
                    a, b = rows.get((m, inp, outp, c)), rows.get((base, inp, outp, c))
                    ok = a and b and a["output_tok_s"] and b["output_tok_s"]
                    cells.append(f"{a['output_tok_s'] / b['output_tok_s']:.2f}x" if ok else "")
                out.append(f"| {m} | " + " | ".join(cells) + " |")
    out += ["", "## Memory (from the server log)", "",
            "Weights and KV cache GiB per GPU (the largest over the tensor-parallel workers); KV cache tokens: what "
            "the engine holds.", "",
            "| method | bits | TP | weights GiB per GPU | KV cache GiB per GPU | KV cache tokens | start-up s |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for m in methods:
        r = next(r for r in reversed(records) if r["method"] == m)
        out.append(f"| {m} | {r['bits']} | {r.get('tp', 1)} | {_fmt(r.get('weight_gib'))} | {_fmt(r.get('kv_cache_gib'))} | "
                   f"{_fmt(r.get('kv_cache_tokens'), ',')} | {_fmt(r.get('startup_s'), '.0f')} |")
    again = rec.repeated(records)
    if again:
        out += ["", "## Repeated measurements (one method, setting, concurrency and commit)", "",
                "Output tok/s of each run in order; spread = (max - min) / min.", "",
                "| method | in / out | c | commit | runs | spread |", "| --- | --- | ---: | --- | --- | ---: |"]
        for (m, inp, outp, c, commit), rs in again.items():
            tok = [r["output_tok_s"] for r in rs]
            out.append(f"| {m} | {inp} / {outp} | {c} | {commit} | {', '.join(f'{t:.0f}' for t in tok)} | "
                       f"{(max(tok) - min(tok)) / min(tok):.0%} |")
    other = rec.across_commits(records)
    if other:
        out += ["", "## Measured at more than one commit", "",
                "Output tok/s of each run in order, with its commit and date; the tables above show the last.", "",
                "| method | in / out | c | runs |", "| --- | --- | ---: | --- |"]
        for (m, inp, outp, c), rs in other.items():
            runs = ", ".join(f"{r['output_tok_s']:.0f} ({r['commit']}, {r['date']})" for r in rs)
            out.append(f"| {m} | {inp} / {outp} | {c} | {runs} |")
    sampled = [(k, r) for k, r in rows.items() if r.get("sm_clock_mhz") is not None]
    if sampled:
        out += ["", "## GPU during each bench (nvidia-smi samples, gpu_monitor.py)", "",
                "| method | in / out | c | SM MHz mean (min) | W mean (max) | °C max | GPU busy | clock-event reasons | "
                "power-capped |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
        for (m, inp, outp, c), r in sampled:
            out.append(f"| {m} | {inp} / {outp} | {c} | {r['sm_clock_mhz']} ({r['sm_clock_mhz_min']}) | {r['power_w']} "
                       f"({r['power_w_max']}) | {r['gpu_temp_c_max']} | {r['gpu_util_pct']}% | {r['clock_event_reasons']} | "
                       f"{r['power_capped_pct']}% |")
    out += ["", "Commands (last record of each method):", ""]
    for m in methods:
        r = next(r for r in reversed(records) if r["method"] == m)
        out.append(f"- {m}: `{r['command']}`")
    return "\n".join(out) + "\n"


def _fmt(v, spec: str = "") -> str:
    return "" if v is None else format(v, spec)


def plot(records: list[dict], path: str) -> bool:
    """Output tok/s vs concurrency, one line per method, one panel per setting. False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = rec.latest(records)
    settings = _settings(rows)
    fig, axes = plt.subplots(1, len(settings), figsize=(6.5 * len(settings), 4.8), squeeze=False)
    for ax, (inp, outp) in zip(axes[0], settings):
        for m in _methods(rows):
            pts = sorted((k[3], r["output_tok_s"]) for k, r in rows.items()
                         if k[0] == m and k[1:3] == (inp, outp) and r["output_tok_s"])
            if pts:
                ax.plot(*zip(*pts), marker="o", label=m, linestyle="--" if m in BASELINES else "-")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel("output tok/s")
        ax.set_title(f"{inp} in / {outp} out")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    first = records[0]
    fig.suptitle(f"{first['model']}, {first['gpu']}, {max(r['date'] for r in records)}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write(records: list[dict], stem: str) -> list[str]:
    """Writes STEM.md and STEM.png (if matplotlib is there); returns the paths written."""
    with open(stem + ".md", "w") as f:
        f.write(markdown(records))
    return [stem + ".md"] + ([stem + ".png"] if plot(records, stem + ".png") else [])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="JSONL files written by bench_serve.py")
    ap.add_argument("--out", required=True, help="output stem: writes STEM.md and STEM.png")
    args = ap.parse_args()
    for path in write(rec.load(args.results), args.out):
        print("wrote", path)


if __name__ == "__main__":
    main()
