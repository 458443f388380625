"""Fail unless `make demo`'s output (the file given) shows the real model through vLLM, end to end.

Checks the lines the demo prints: the model, the conversion's sizes before and after, both engines
started, the perplexity of bf16 and kbit (a trained model's, and kbit within the bound the real-model
test holds kbit-4 to), and both answers side by side, non-empty. And that the demo printed only its own lines: it
names the file vLLM's output goes to, and no vLLM log line, warning or progress bar reached the terminal.
"""

import math
import os
import re
import sys

# tests/test_real_model.py's bounds for the same model and text.
BF16_MAX_PPL = 25.0
KBIT_MAX_PPL_RATIO = 1.30


def main(path: str) -> int:
    text = open(path, encoding="utf-8", errors="replace").read()
    problems = []

    def need(pattern: str, what: str):
        m = re.search(pattern, text, re.MULTILINE)
        if m is None:
            problems.append(f"missing: {what} (/{pattern}/)")
        return m

    need(r"^== SmolLM2-135M-Instruct", "the real model's name")
    need(r"^   \d+ decoder linears \([\d.]+M weights\): [\d.]+ MiB -> [\d.]+ MiB \([\d.]+ bits/weight\); "
         r"checkpoint [\d.]+ MiB -> [\d.]+ MiB", "sizes before and after")
    need(r"^== vLLM: bf16 \(no quantization\)", "the bf16 engine")
    need(r"^== vLLM: kbit-\d \(quantization='kbit'\)", "the kbit engine")
    ppl = need(r"^   bf16 ([\d.]+)   kbit-\d ([\d.]+) \(", "perplexity of bf16 and kbit")
    if ppl:
        bf16, kbit = float(ppl.group(1)), float(ppl.group(2))
        if not (math.isfinite(bf16) and bf16 < BF16_MAX_PPL):
            problems.append(f"bf16 perplexity {bf16} is not a trained model's (< {BF16_MAX_PPL})")
        if not (math.isfinite(kbit) and kbit <= KBIT_MAX_PPL_RATIO * bf16):
            problems.append(f"kbit perplexity {kbit} is above {KBIT_MAX_PPL_RATIO} x bf16's {bf16}")
    for label in ("bf16  ", r"kbit-\d"):
        answer = need(rf"^   {label}: '(.+)'$", f"the {label.strip()} answer")
        if answer and not answer.group(1).strip():
            problems.append(f"the {label.strip()} answer is empty")
    log = need(r"^== vLLM's log lines and warnings go to (\S+)$", "the file that gets vLLM's output")
    if log and not os.path.isfile(log.group(1)):
        problems.append(f"the demo named {log.group(1)} for vLLM's output, which does not exist")
    # vLLM's log lines ("INFO 12-02 03:04:05 [file.py:12] ..."), its engine process's prefixed lines and tqdm bars.
    foreign = [line for line in text.splitlines()
               if re.match(r"^(\(\w+ pid=\d+\) )?(INFO|WARNING|ERROR|DEBUG) \d\d-\d\d ", line)
               or re.match(r"^\((EngineCore|Worker)", line) or re.search(r"\d+%\|.*\| \d+/\d+ \[", line)]
    if foreign:
        problems.append(f"{len(foreign)} lines of vLLM's output reached the terminal, e.g. {foreign[0][:120]!r}")
    for p in problems:
        print(f"check_demo: {p}", file=sys.stderr)
    if not problems:
        print("check_demo: the demo showed the model, its sizes, both perplexities and both answers")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
