"""Peak device memory and time of `vllm-kbit convert --gptq` (one decoder layer at a time) on a Qwen3-30B-A3B-shaped
checkpoint of random bf16 weights.

    python3 benchmarks/gptq_memory.py [--layers 4] [--tokens 16384] [--bits 4] [--out benchmarks/results]
        [--refine-passes P] [--asymmetric A] [--rotate | --no-rotate] [--tag SUFFIX]   (default: convert's)
    python3 benchmarks/gptq_memory.py --shape tiny --device cpu --out /tmp/gptq-memory   # a CPU check, ~1 minute
    python3 benchmarks/gptq_memory.py --layers 1 --tokens 2048 --device cpu   # the 30B shape's peak on a CPU

Writes the checkpoint (Qwen3-30B-A3B's shape: hidden 2048, 128 experts top-8, expert intermediate 768,
32 query / 4 KV heads of 128, vocabulary 151936; N(0, 0.02) weights, so the router spreads tokens about
evenly) with ``--layers`` decoder layers instead of 48: the 48-layer model is 61 GB, beyond the disk of a
one-GPU machine. Calibration holds one layer on the device at a time, so the peak is per layer and does
not grow with the number of layers, while the time grows linearly with it. Then runs ``convert(...,
gptq=True)`` (what ``vllm-kbit convert --gptq --calibration-tokens N`` runs) in this process on
``--tokens`` tokens of the default calibration text (byte tokens) and records: torch's peak allocated
and reserved device memory, the peak of the device's used memory sampled by NVML (or nvidia-smi) every
0.1 s over the baseline before the conversion, the bf16 size of one decoder layer, the calibration
activations kept, and the seconds per layer. On the CPU (no allocator statistics) the peak is that of the
tensors calibration allocates, tracked op by op (:class:`LiveTensorBytes`; slower). The goal (issue 42):
peak <= one decoder layer in bf16 + 2 GiB.
Writes gptq_memory_<gpu or cpu>_<date>.md and .json into ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import torch
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # kbit_dev: the checkout's fixtures

GIB = 1024**3
# Qwen3-30B-A3B (docs/architecture.md, "Target shapes"); "tiny" keeps the architecture at CPU size.
SHAPES = {
    "qwen3-30b-a3b": dict(hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          vocab_size=151936),
    "tiny": dict(hidden_size=128, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                 intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=1024),
}


def write_checkpoint(out_dir: str, shape: dict, layers: int, seed: int = 0) -> dict:
    """A Qwen3-MoE checkpoint of N(0, 0.02) bf16 weights (norms 1), one safetensors shard per decoder layer,
    with the byte tokenizer of the tests; returns {decoder layer: bf16 bytes}. The tensor names are those
    transformers saves (its load-time expert fusion reverted), built on the meta device, so only one layer's
    tensors are in memory at a time."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: the model's names are the checkpoint's
        def revert_weight_conversion(model, state_dict):
            return state_dict

    from kbit_dev import tiny_models

    config = Qwen3MoeConfig(**shape, num_hidden_layers=layers, norm_topk_prob=True, decoder_sparse_step=1,
                            mlp_only_layers=[], max_position_embeddings=4096, rope_theta=1_000_000.0,
                            rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=tiny_models.EOS_TOKEN_ID,
                            eos_token_id=tiny_models.EOS_TOKEN_ID, pad_token_id=tiny_models.EOS_TOKEN_ID)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    names = revert_weight_conversion(model, dict(model.state_dict()))
    groups: dict[str, dict] = {}
    for name, t in names.items():  # one shard per decoder layer, one for the rest
        parts = name.split(".")
        key = f"layer-{int(parts[2]):03d}" if parts[:2] == ["model", "layers"] else "other"
        groups.setdefault(key, {})[name] = t.shape
    os.makedirs(out_dir, exist_ok=True)
    gen_device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(gen_device).manual_seed(seed)
    weight_map, layer_bytes = {}, {}
    for i, (key, shapes) in enumerate(sorted(groups.items())):
        tensors = {}
        for name, shp in shapes.items():
            if len(shp) == 1:
                tensors[name] = torch.ones(shp, dtype=torch.bfloat16)
            else:
                tensors[name] = (torch.randn(shp, generator=gen, device=gen_device) * 0.02).to(torch.bfloat16).cpu()
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(tensors, os.path.join(out_dir, file), metadata={"format": "pt"})
        weight_map.update({name: file for name in tensors})
        if key != "other":
            layer_bytes[key] = sum(t.nbytes for t in tensors.values())
        del tensors
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    config.save_pretrained(out_dir)
    tiny_models._byte_tokenizer().save_pretrained(out_dir)
    return layer_bytes


class DeviceMemorySampler:
    """Peak used memory of the GPU, sampled by NVML (nvidia-smi when pynvml is missing) every ``period`` s in a
    thread: what the driver sees, CUDA context and allocator cache included."""

    def __init__(self, index: int, period: float = 0.1):
        self.index, self.period, self.peak, self.source = index, period, 0, None
        self._stop = threading.Event()
        self._read = self._reader()
        self.baseline = self._read() if self._read else None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _reader(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(self.index)
            self.source = "pynvml"
            return lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used
        except Exception:  # noqa: BLE001  (no NVML: try the command line tool)
            pass
        cmd = ["nvidia-smi", f"--id={self.index}", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
        try:
            subprocess.run(cmd, capture_output=True, check=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        self.source = "nvidia-smi"
        return lambda: int(subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.split()[0]) * 1024**2

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._read())
            time.sleep(self.period)

    def __enter__(self):
        if self._read:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._read:
            self._thread.join()
            self.peak = max(self.peak, self._read())


class LiveTensorBytes:
    """On the CPU, where torch keeps no allocator statistics: the peak bytes of tensor storages that aten ops
    allocate while it is active (a TorchDispatchMode; a view or an in-place result is its input's storage,
    counted once; a storage is freed when the last tensor of it is). What ``max_memory_allocated`` counts on a
    GPU, less the ops' internal workspaces (BLAS, LAPACK) and tensors that existed before (the model)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        tracker = self
        self.live, self.now, self.peak = {}, 0, 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                          if isinstance(t, torch.Tensor) and t.device.type == "cpu"}
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                        tracker._track(t, inputs)
                return out

        self._mode = Mode()

    def _track(self, t, inputs):
        import weakref

        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0:
            return
        entry = self.live.get(key)
        if entry is None:
            if key in inputs:  # a view or in-place result of a tensor from before
                return
            entry = self.live[key] = [storage.nbytes(), 0]
            self.now += entry[0]
            self.peak = max(self.peak, self.now)
        entry[1] += 1
        weakref.finalize(t, self._drop, key)

    def _drop(self, key):
        entry = self.live.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                del self.live[key]
                self.now -= entry[0]

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


class _TrackCalibration:
    """Patches gptq.quantize_model to run under :class:`LiveTensorBytes` (the CPU's calibration peak)."""

    def __init__(self):
        from vllm_kbit import gptq

        self.gptq, self.real, self.tracker = gptq, gptq.quantize_model, LiveTensorBytes()

    def __enter__(self):
        def tracked(*args, **kwargs):
            with self.tracker:
                return self.real(*args, **kwargs)

        self.gptq.quantize_model = tracked
        return self

    def __exit__(self, *exc):
        self.gptq.quantize_model = self.real
        return False


def calibration_text(tokens: int) -> str:
    """The default calibration text cut to ``tokens`` byte tokens."""
    from vllm_kbit import gptq

    text = gptq.calibration_text().encode("utf-8")[:tokens]
    return text.decode("utf-8", errors="ignore")


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(args) -> tuple[dict, list[str]]:
    from vllm_kbit import gptq
    from vllm_kbit.convert import convert, resolve_device
    from vllm_kbit.settings import KbitSettings, Rotation

    device = resolve_device(args.device)
    cuda = device.startswith("cuda")
    work = args.workdir or tempfile.mkdtemp(prefix="kbit-gptq-memory-")
    src, dst = os.path.join(work, "bf16"), os.path.join(work, "kbit")
    try:
        t0 = time.perf_counter()
        layer_bytes = write_checkpoint(src, SHAPES[args.shape], args.layers)
        build_s = time.perf_counter() - t0
        text = calibration_text(args.tokens)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        index = torch.device(device).index or 0 if cuda else 0
        sampler = DeviceMemorySampler(index) if cuda else None
        cpu_tracker = _TrackCalibration() if device == "cpu" else None
        if cuda and args.peak_trace:  # every allocation with its Python stack, replayed after to the peak
            torch.cuda.memory._record_memory_history(max_entries=TRACE_EVENTS, stacks="python")
        t0 = time.perf_counter()
        with sampler if sampler else _nothing(), cpu_tracker if cpu_tracker else _nothing():
            rotate = gptq.DEFAULT_ROTATE if args.rotate is None else args.rotate
            settings = KbitSettings(bits=args.bits, rotation=Rotation() if rotate else None)
            summary = convert(src, dst, settings, device=device, overwrite=True, progress=True, gptq=True,
                              calibration_text=text, calibration_tokens=args.tokens,
                              gptq_options={k: v for k, v in (("refine_passes", args.refine_passes),
                                                               ("asymmetric", args.asymmetric)) if v is not None})
        refine = gptq.DEFAULT_REFINE_PASSES if args.refine_passes is None else args.refine_passes
        convert_s = time.perf_counter() - t0
        peak_live = None
        if cuda and args.peak_trace:
            peak_live = live_at_peak(torch.cuda.memory._snapshot(), args.peak_trace)
            torch.cuda.memory._record_memory_history(enabled=None)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)

    g = summary.gptq
    shape = SHAPES[args.shape]
    layer = max(layer_bytes.values())
    now = datetime.datetime.now(datetime.timezone.utc)
    gpu = torch.cuda.get_device_name(torch.device(device)) if cuda else "cpu"
    result = dict(
        gpu=gpu, date=now.isoformat(timespec="seconds"), commit=args.commit, torch=torch.__version__,
        transformers=_version("transformers"), command="python3 " + " ".join(shlex.quote(a) for a in sys.argv),
        equivalent_cli=f"vllm-kbit convert BF16_DIR OUT_DIR --bits {args.bits} --gptq --calibration-tokens {args.tokens} "
        f"--refine-passes {refine}" + ("" if args.asymmetric is None else f" --asymmetric {args.asymmetric}")
        + f" --{'' if rotate else 'no-'}rotate --device {device}",
        refine_passes=refine, rotate=rotate, asymmetric=args.asymmetric,
        shape=args.shape, config=shape, layers=args.layers, bits=args.bits, tokens=g.tokens, device=device,
        layer_bf16_bytes=layer, activations_bytes=g.tokens * shape["hidden_size"] * 2,
        layer_seconds=g.layer_seconds, convert_seconds=convert_s, checkpoint_build_seconds=build_s,
        experts=g.experts, experts_fallback=g.experts_fallback, min_expert_tokens=sorted(set(g.min_expert_tokens)),
    )
    if cuda:
        result.update(max_memory_allocated=torch.cuda.max_memory_allocated(device),
                      max_memory_reserved=torch.cuda.max_memory_reserved(device),
                      nvml_source=sampler.source, nvml_baseline=sampler.baseline, nvml_peak=sampler.peak)
        result["goal_bytes"] = layer + 2 * GIB
        result["goal_met"] = result["max_memory_allocated"] <= result["goal_bytes"]
    if peak_live is not None:
        result["peak_live"] = peak_live
    if cpu_tracker is not None:
        result["cpu_calibration_peak_bytes"] = cpu_tracker.tracker.peak
        result["goal_bytes"] = layer + 2 * GIB
        result["goal_met"] = layer + cpu_tracker.tracker.peak <= result["goal_bytes"]
    return result, report_lines(result)


TRACE_EVENTS = 4_000_000  # the allocation trace keeps this many events, the newest


def live_at_peak(snapshot: dict, top: int) -> dict:
    """From a memory-history snapshot: the allocations live when the allocated total peaked, grouped by their stack's
    frames in vllm_kbit (the innermost three), the ``top`` largest groups. The replay counts only what the trace
    holds, so its peak is the allocator's if the trace kept every event (``events_dropped`` says if it did not)."""
    trace = snapshot["device_traces"][0]
    live, total, peak, at = {}, 0, 0, -1
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            total += e["size"]
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])
        if total > peak:
            peak, at = total, i
    groups, live = {}, {}
    for e in trace[:at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    for e in live.values():
        frames = [f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in e.get("frames", ())
                  if "vllm_kbit" in f["filename"]][:3]
        key = " < ".join(frames) or "(no vllm_kbit frame)"
        n, b = groups.get(key, (0, 0))
        groups[key] = (n + 1, b + e["size"])
    rows = sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]
    return dict(peak_bytes=peak, events=len(trace), events_dropped=len(trace) >= TRACE_EVENTS,
                groups=[dict(where=k, tensors=n, bytes=b) for k, (n, b) in rows])


def _size(n: float) -> str:
    return f"{n / GIB:.3f} GiB" if abs(n) >= GIB / 10 else f"{n / 1024**2:.1f} MiB"


def report_lines(r: dict) -> list[str]:
    per_layer = r["layer_seconds"]
    lines = [f"# `convert --gptq` peak memory and time, {r['shape']} shape, {r['layers']} decoder layers, on {r['gpu']}", "",
             f"date {r['date']}, commit {r['commit']}, torch {r['torch']}, transformers {r['transformers']}", "",
             f"command: `{r['command']}`", "", f"conversion run in-process, as `{r['equivalent_cli']}`", "",
             f"Random N(0, 0.02) bf16 weights of the shape {json.dumps(r['config'])}, {r['layers']} decoder layers "
             "(the real model has 48). Calibration holds one decoder layer on the device at a time: the peak is per "
             "layer and does not grow with the number of layers; the time grows linearly with it.", "",
             "| quantity | value |", "| --- | ---: |",
             f"| one decoder layer in bf16 | {_size(r['layer_bf16_bytes'])} |",
             f"| calibration tokens | {r['tokens']} |",
             f"| calibration hidden states kept (bf16) | {_size(r['activations_bytes'])} |"]
    if "max_memory_allocated" in r:
        over = r["max_memory_allocated"] - r["layer_bf16_bytes"]
        lines += [f"| peak allocated (torch.cuda.max_memory_allocated) | {_size(r['max_memory_allocated'])} "
                  f"(layer + {_size(over)}) |",
                  f"| peak reserved (torch.cuda.max_memory_reserved) | {_size(r['max_memory_reserved'])} |"]
        if r["nvml_source"]:
            lines.append(f"| peak used, sampled by {r['nvml_source']} every 0.1 s, over the {_size(r['nvml_baseline'])} "
                         f"before | {_size(r['nvml_peak'] - r['nvml_baseline'])} |")
        lines.append(f"| goal: peak allocated <= layer + 2 GiB ({_size(r['goal_bytes'])}) | "
                     f"{'met' if r['goal_met'] else 'missed'} |")
    if "cpu_calibration_peak_bytes" in r:
        peak = r["cpu_calibration_peak_bytes"]
        lines += [f"| peak of the tensors calibration allocated on the CPU (the model's weights not counted) | "
                  f"{_size(peak)} |",
                  f"| layer + that peak, against the goal layer + 2 GiB ({_size(r['goal_bytes'])}) | "
                  f"{_size(r['layer_bf16_bytes'] + peak)}: {'met' if r['goal_met'] else 'missed'} |"]
    lines += [f"| seconds per decoder layer (calibration + GPTQ) | {', '.join(f'{s:.1f}' for s in per_layer)} "
              f"(mean {sum(per_layer) / len(per_layer):.1f}) |",
              f"| estimate for 48 layers | {48 * sum(per_layer) / len(per_layer) / 60:.1f} min |",
              f"| whole conversion (load, calibrate, write) | {r['convert_seconds']:.1f} s |",
              f"| routed experts rounded / on all tokens (fewer than {'/'.join(map(str, r['min_expert_tokens']))} "
              f"routed tokens) | {r['experts']} / {r['experts_fallback']} |",
              f"| writing the random checkpoint | {r['checkpoint_build_seconds']:.1f} s |"]
    if r.get("peak_live"):
        p = r["peak_live"]
        lines += ["", f"Tensors live at the peak of the allocation trace ({_size(p['peak_bytes'])}, {p['events']} events"
                  + (", the oldest dropped: incomplete" if p["events_dropped"] else "") + "), by where they were made:",
                  "", "| where (innermost vllm_kbit frames) | tensors | size |", "| --- | ---: | ---: |"]
        lines += [f"| `{g['where']}` | {g['tensors']} | {_size(g['bytes'])} |" for g in p["groups"]]
    return lines


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _version(package: str) -> str:
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:  # noqa: BLE001
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (the real model has 48)")
    parser.add_argument("--tokens", type=int, default=16384, help="calibration tokens (convert --gptq's default)")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--refine-passes", type=int, default=None,
                        help="GPTQ refinement passes (convert --refine-passes; default: convert's)")
    parser.add_argument("--asymmetric", type=float, default=None, metavar="A",
                        help="asymmetric calibration (convert --asymmetric A; default: convert's)")
    parser.add_argument("--rotate", action=argparse.BooleanOptionalAction, default=None,
                        help="convert --rotate / --no-rotate (default: convert's with --gptq)")
    parser.add_argument("--peak-trace", type=int, default=0, metavar="N",
                        help="CUDA: record every allocation's Python stack and report the N largest groups of "
                        "tensors live at the peak (slower)")
    parser.add_argument("--tag", default="", help="suffix of the result files' names")
    parser.add_argument("--device", default="auto", help="auto, cuda, cuda:1 or cpu")
    parser.add_argument("--workdir", help="keep the checkpoints here (default: a temporary directory, removed)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--commit", default=os.environ.get("KBIT_COMMIT") or git_commit())
    args = parser.parse_args()
    result, lines = run(args)
    md = "\n".join(lines) + "\n"
    print(md)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"gptq_memory_{result['gpu'].replace(' ', '_')}_{result['date'][:10]}{args.tag}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(md)
    print(f"wrote {stem}.md and .json")


if __name__ == "__main__":
    main()
