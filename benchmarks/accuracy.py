"""Quantization accuracy of kbit next to NF4 (blocks of 64) and int RTN (groups of 128).

    python benchmarks/accuracy.py [--n 1048576] [--seed 0]

For each weight distribution (Gaussian, Student-t with 4 degrees of freedom, Gaussian
with 0.1% outliers at 20 sigma) and each method, reports SQNR in dB and the max/mean
absolute error, then writes benchmarks/results/accuracy_<date>.{json,md} and a PNG of
SQNR against bits per weight (Gaussian). Everything runs on the CPU in float32/64.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import subprocess

import torch

from vllm_kbit import reference as fmt

RESULTS = pathlib.Path(__file__).parent / "results"


def sample(dist: str, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dist == "gaussian":
        return torch.randn(n, generator=g)
    if dist == "student_t4":
        z = torch.randn(n, generator=g, dtype=torch.float64)
        chi2 = torch.randn(n, 4, generator=g, dtype=torch.float64).square().sum(-1)
        return (z / torch.sqrt(chi2 / 4)).float()
    if dist == "outliers":
        x = torch.randn(n, generator=g)
        hit = torch.rand(n, generator=g) < 1e-3
        return torch.where(hit, 20 * torch.sign(x), x)
    raise ValueError(dist)


def kbit_fp32_absmax(x: torch.Tensor, k: int) -> torch.Tensor:
    """kbit levels with an exact fp32 absmax scale (no E4M4 rounding): the format's ceiling."""
    cb = fmt.normal_float_codebook(k)
    w = x.view(-1, 32)
    s = w.abs().amax(-1, keepdim=True)
    idx = (w.unsqueeze(-1) / s.unsqueeze(-1) - cb).abs().argmin(-1)
    return (cb[idx] * s).flatten()


def kbit(x: torch.Tensor, k: int, search_scale: bool) -> torch.Tensor:
    cb = fmt.normal_float_codebook(k)
    W = x.view(-1, 1024)
    q, a = fmt.quantize(W, cb, k, search_scale)
    return fmt.dequantize(q, a, cb, torch.float32).flatten()


def rounded_up_absmax_codes(W: torch.Tensor) -> torch.Tensor:
    """Per-block smallest E4M4 code whose value is >= the block absmax (never clips), int32 [N, K/32]."""
    amax = W.float().view(W.shape[0], -1, fmt.BLOCK_SIZE).abs().amax(-1)
    return torch.searchsorted(fmt.e4m4_table(), amax.contiguous(), right=False).int()


def kbit_window(x: torch.Tensor, k: int, offsets: range) -> torch.Tensor:
    """E4M4 scale searched over ``rounded-up absmax code + offsets`` by block squared error (the
    earliest candidate wins ties), from the format's reference primitives: an alternative to the
    library's default window (nearest code -8..+8), kept for comparison."""
    cb = fmt.normal_float_codebook(k)
    W = x.view(-1, 1024)
    w = W.view(W.shape[0], -1, fmt.BLOCK_SIZE)
    anchor = rounded_up_absmax_codes(W)
    best_values, best_err = None, None
    for offset in offsets:
        scale = fmt.e4m4_decode((anchor + offset).clamp(0, 255).to(torch.uint8))
        values = cb[fmt.choose_indices(W, scale, cb).long()] * scale.unsqueeze(-1)
        err = fmt.block_squared_error(w, values)
        if best_err is None:
            best_values, best_err = values, err
            continue
        better = err < best_err
        best_values = torch.where(better.unsqueeze(-1), values, best_values)
        best_err = torch.where(better, err, best_err)
    return best_values.flatten()


def nf4_codebook() -> torch.Tensor:
    """bitsandbytes' NF4: 8 positive and 7 negative normal quantiles (tail offset 0.9677) and an exact zero."""
    offset = 0.9677083
    pos = torch.special.ndtri(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1])
    neg = -torch.special.ndtri(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1])
    levels = torch.cat([pos, torch.zeros(1, dtype=torch.float64), neg]).sort().values
    return (levels / levels.abs().max()).float()


def nf4_blocks64(x: torch.Tensor) -> torch.Tensor:
    cb = nf4_codebook()
    w = x.view(-1, 64)
    s = w.abs().amax(-1, keepdim=True)
    idx = (w.unsqueeze(-1) / s.unsqueeze(-1) - cb).abs().argmin(-1)
    return (cb[idx] * s).flatten()


def int_rtn_g128(x: torch.Tensor, k: int) -> torch.Tensor:
    """Asymmetric round-to-nearest integers per group of 128 (GPTQ's format, without GPTQ)."""
    w = x.view(-1, 128).double()
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = (hi - lo) / (2**k - 1)
    zero = torch.round(-lo / scale)
    q = torch.clamp(torch.round(w / scale) + zero, 0, 2**k - 1)
    return ((q - zero) * scale).float().flatten()


def methods():
    for k in fmt.SUPPORTED_BITS:
        yield "kbit, fp32 absmax scale", k, k + 0.25, lambda x, k=k: kbit_fp32_absmax(x, k)
        yield "kbit, E4M4 absmax", k, k + 0.25, lambda x, k=k: kbit(x, k, False)
        yield "kbit, E4M4 searched (rounded-up absmax code -4..+1, block MSE)", k, k + 0.25, lambda x, k=k: kbit_window(x, k, range(-4, 2))
        yield "kbit, E4M4 searched (absmax code -8..+8, block MSE)", k, k + 0.25, lambda x, k=k: kbit(x, k, True)
    yield "NF4, blocks of 64, fp32 absmax", 4, 4.5, nf4_blocks64
    for k in (2, 3, 4):
        yield "int RTN asymmetric, groups of 128", k, k + 0.25, lambda x, k=k: int_rtn_g128(x, k)


def measure(x: torch.Tensor, x_hat: torch.Tensor) -> dict:
    err = (x.double() - x_hat.double()).abs()
    return {
        "sqnr_db": 10 * math.log10(x.double().square().sum().item() / err.square().sum().item()),
        "max_abs_err": err.max().item(),
        "mean_abs_err": err.mean().item(),
    }


METRICS = {"sqnr_db": ("SQNR (dB)", "{:.2f}"), "max_abs_err": ("max |error|", "{:.4f}"), "mean_abs_err": ("mean |error|", "{:.5f}")}


def markdown(records: list[dict], dist: str, metric: str) -> str:
    title, cell = METRICS[metric]
    rows = {}
    for r in records:
        if r["dist"] == dist:
            rows.setdefault((r["method"], r["bits_per_weight"] - r["k"]), {})[r["k"]] = r[metric]
    lines = [f"{title}, {dist}", "", "| method | bits/weight | k=2 | k=3 | k=4 | k=5 |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    for (method, extra), by_k in rows.items():
        cells = " | ".join(cell.format(by_k[k]) if k in by_k else "" for k in fmt.SUPPORTED_BITS)
        lines.append(f"| {method} | k + {extra:g} | {cells} |")
    return "\n".join(lines)


def plot(records: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    by_method = {}
    for r in records:
        if r["dist"] == "gaussian":
            by_method.setdefault(r["method"], []).append((r["bits_per_weight"], r["sqnr_db"]))
    for method, pts in by_method.items():
        pts.sort()
        ax.plot(*zip(*pts), marker="o", label=method)
    ax.set_xlabel("bits per weight")
    ax.set_ylabel("SQNR (dB), N(0,1) weights")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2**20, help="elements per distribution (multiple of 1024)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()

    records = []
    for dist in ("gaussian", "student_t4", "outliers"):
        x = sample(dist, args.n, args.seed)
        for method, k, bpw, fn in methods():
            records.append({"dist": dist, "method": method, "k": k, "bits_per_weight": bpw, **measure(x, fn(x))})
    date = datetime.date.today().isoformat()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    header = f"# Quantization accuracy\n\ndate {date}, commit {commit}, n={args.n}, seed={args.seed}, CPU\n\ncommand: `python benchmarks/accuracy.py --n {args.n} --seed {args.seed}`\n"
    dists = ("gaussian", "student_t4", "outliers")
    text = header + "\n\n".join(markdown(records, d, m) for m in METRICS for d in dists) + "\n"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"accuracy_{date}.json").write_text(json.dumps({"date": date, "commit": commit, "n": args.n, "records": records}, indent=1))
    (RESULTS / f"accuracy_{date}.md").write_text(text)
    if not args.no_plot:
        plot(records, RESULTS / f"accuracy_{date}.png")
    print(text)


if __name__ == "__main__":
    main()
