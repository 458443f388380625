"""Headline kernel benchmark: the kbit kernels side by side with what a vLLM user would otherwise run.

In one process and run, kernel time per call of
  * whole MoE layers (routing / align, gate_up, SiLU * up, down, weighted combine) of the
    Qwen3-30B-A3B and GLM-4.5-Air routed experts (and, by --layers, Qwen3-Coder-Next's and
    Qwen3-235B-A22B's) at T tokens:
      kbit         torch.ops.kbit.fused_moe on k = 2..5 bit weights (vllm_kbit.moe.kbit_fused_moe),
      marlin_int4  vLLM's fused_marlin_moe on GPTQ int4 group-128 weights, prepared as vLLM's
                   GPTQ MoE method prepares them (gptq_marlin_moe_repack, marlin_moe_permute_scales),
      triton_bf16  vLLM's Triton fused_experts on bf16 weights (the path vLLM runs for an
                   unquantized MoE on Hopper),
      humming      vLLM's Humming kernels on uint-k group-128 weights at the same k = 2..5
                   (benchmarks/humming_peer.py: set up as vLLM's Humming MoE method runs them);
  * dense layers (qkv, o, Llama-70B gate_up) at M rows:
      kbit         kbit_linear (torch.ops.kbit.linear) on k = 2..5 bit weights,
      marlin_int4  vLLM's GPTQ Marlin linear (apply_gptq_marlin_linear -> ops.marlin_gemm, g128),
      cublas_bf16  torch.nn.functional.linear in bf16,
      humming      Humming's dense GEMM on uint-k group-128 weights (vLLM's HummingLinearMethod).
Each humming record carries the Humming config it ran under "config"; what Humming refuses is
listed under "errors" with its message.

Regime COLD only: each measurement captures back-to-back calls in one CUDA graph
(bench_linear.graph_time_us) that rotate through enough weight copies (and, for MoE, routings)
that the weights the calls touch exceed 4x the L2, as decode across layers sees them. Weights are
random (packed codes, int4 or bf16), activations random, routing = top-k of random scores; all
impls get the same x and routings. Before timing, each impl's output is checked finite and its
first token against a float32 reference built from that impl's own weights.

Each record carries `floor_us`: the bytes the call must read (the touched weights in that impl's
format -- for MoE the experts its routing hits -- plus activations in and out) over the measured
device-to-device copy bandwidth (read + write counted). With --ncu, a few configs are re-run
under Nsight Compute and get `inst_per_weight` = warp instructions executed (smsp__inst_executed.sum)
x 32 / weights read, summed over the call's kernels, and the per-kernel list.

Needs a CUDA GPU, vLLM's CUDA build and this repo's extension (vllm_kbit/_C.abi3.so):

    python benchmarks/bench_kernels.py --out benchmarks/results [--ncu]
    python benchmarks/bench_kernels.py --quick                # T / M in 1, 16, 256: a smoke run
    python benchmarks/bench_kernels.py --report FILE.json     # redo .md and .png of a run (CPU is enough)

Writes kernels_<gpu>_<date>.json (records), .md (one table per layer) and .png (us vs T) into --out,
after every block of measurements, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import functools
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)
import vllm_kbit  # noqa: E402
from bench_linear import copy_bandwidth, graph_time_us, random_runtime_weight  # noqa: E402
from bench_moe import kbit_bytes, random_stacked  # noqa: E402
from vllm_kbit import reference as fmt  # noqa: E402
from vllm_kbit.linear import kbit_linear  # noqa: E402
from vllm_kbit.moe import kbit_fused_moe  # noqa: E402

sys.path.insert(0, os.path.join(HERE, "serve"))
import model_dir  # noqa: E402  (the target models' recorded configs)


def _config_moe_shape(model: str) -> tuple[int, int, int, int]:
    """(E, top_k, H, I) of a target model's routed experts, from its recorded public config (serve/model_dir.py)."""
    c = model_dir.public_config(model)
    return c["num_experts"], c["num_experts_per_tok"], c["hidden_size"], c["moe_intermediate_size"]


MOE_LAYERS = {  # name: (E, top_k, H, I)
    "qwen3_30b_moe": (128, 8, 2048, 768),
    "glm45_air_moe": (128, 8, 4096, 1408),
    # The routed experts of two target models whose serving rows trail GPTQ-Marlin (docs/performance.md, big models).
    "qwen3_coder_next_moe": _config_moe_shape("qwen3-coder-next"),
    "qwen3_235b_moe": _config_moe_shape("qwen3-235b-a22b"),
}
DENSE_LAYERS = {  # name: (K, N)
    "qkv": (2048, 5120),
    "o": (4096, 2048),
    "llama70b_gate_up": (8192, 28672),
}
LAYERS = (*MOE_LAYERS, *DENSE_LAYERS)
# The default run: the two MoE layers and three dense ones every result so far reports.
DEFAULT_LAYERS = ("qwen3_30b_moe", "glm45_air_moe", *DENSE_LAYERS)
MOE_TOKENS = (1, 4, 16, 32, 64, 128, 256, 1024, 4096)
DENSE_M = (1, 4, 16, 64, 128, 256, 1024)
QUICK_TOKENS = (1, 16, 256)
IMPLS = ("kbit", "marlin_int4", "triton_bf16", "cublas_bf16", "humming")
MOE_IMPLS = ("kbit", "marlin_int4", "triton_bf16", "humming")
DENSE_IMPLS = ("kbit", "marlin_int4", "cublas_bf16", "humming")
K_IMPLS = ("kbit", "humming")  # impls timed at every k of --bits
IMPL_LABEL = {"marlin_int4": "marlin int4", "triton_bf16": "triton bf16", "cublas_bf16": "cuBLAS bf16", "humming": "humming"}

GROUP = 128  # GPTQ group size of the Marlin baseline
BF16_STD = 0.02  # std of the random bf16 weights
GPTQ_SCALE = BF16_STD / 4.6  # int4 scales giving about the same weight rms (rms of a code in [-8, 7] ~ 4.6)
ROUTINGS = 8  # routings rotated per MoE measurement
MEM_BUDGET = 40e9  # bytes of weight copies one impl may hold at once (fits an 80 GB card with room to spare)
CHECK_ROWS = 256  # output features of the first row the dense check compares
CHECK_TOL = 0.05  # relative L2 error of the first token's output vs the float32 reference

NCU_METRIC = "smsp__inst_executed.sum"
NCU_TIMEOUT_S = 240
NCU_MARKER = "spin_kernel"  # torch.cuda._sleep's kernel: launched before each profiled call to separate them
NCU_CONFIGS = [  # (layer, impl, k, T)
    *[("qwen3_30b_moe", impl, k, T) for T in (16, 1)
      for impl, k in (("kbit", 2), ("kbit", 3), ("kbit", 4), ("kbit", 5), ("marlin_int4", None), ("triton_bf16", None))],
    *[("llama70b_gate_up", impl, k, 16) for impl, k in (("kbit", 2), ("kbit", 4), ("marlin_int4", None))],
]


# ----------------------------------------------------------------------------- vLLM baselines


@functools.lru_cache(maxsize=None)
def vllm_api() -> SimpleNamespace:
    """The vLLM 0.26 functions the baselines call, imported on first use (needs vLLM's CUDA build).

    Importing vllm._custom_ops loads vLLM's kernels (_C, _moe_C) through current_platform.import_kernels().
    """
    import vllm._custom_ops as ops
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts.marlin_moe import fused_marlin_moe
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts
    from vllm.model_executor.layers.quantization.utils.marlin_utils import (
        apply_gptq_marlin_linear,
        marlin_make_empty_g_idx,
        marlin_make_workspace_new,
        marlin_moe_permute_scales,
        marlin_permute_scales,
    )
    from vllm.scalar_type import scalar_types

    if not hasattr(torch.ops._C, "marlin_gemm") or not hasattr(torch.ops._moe_C, "moe_wna16_marlin_gemm"):
        raise RuntimeError("vLLM's CUDA kernels (torch.ops._C / _moe_C) are not loaded: needs vLLM's CUDA build")
    return SimpleNamespace(
        ops=ops, MoEActivation=MoEActivation, fused_marlin_moe=fused_marlin_moe, fused_experts=fused_experts,
        apply_gptq_marlin_linear=apply_gptq_marlin_linear, marlin_make_empty_g_idx=marlin_make_empty_g_idx,
        marlin_make_workspace_new=marlin_make_workspace_new, marlin_moe_permute_scales=marlin_moe_permute_scales,
        marlin_permute_scales=marlin_permute_scales, uint4b8=scalar_types.uint4b8,
    )


def random_gptq(k_dim: int, n_dim: int, lead: tuple = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Random GPTQ int4 weight as a checkpoint stores it: qweight [*lead, K/8, N] int32 (8 codes per
    word along K, code c means c - 8) and bf16 scales [*lead, K/GROUP, N]."""
    q = torch.randint(-(2**31), 2**31 - 1, (*lead, k_dim // 8, n_dim), dtype=torch.int32, device="cuda")
    s = torch.empty((*lead, k_dim // GROUP, n_dim), dtype=torch.bfloat16, device="cuda")
    s.uniform_(0.75 * GPTQ_SCALE, 1.25 * GPTQ_SCALE)
    return q, s


def gptq_dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """GPTQ qweight [K/8, N] + scales [K/GROUP, N] -> float32 weight [N, K] (the reference for the check)."""
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int32).view(1, 8, 1)
    codes = ((q.unsqueeze(1) >> shifts) & 0xF).reshape(-1, q.shape[1]).float() - 8
    return (codes * s.float().repeat_interleave(GROUP, dim=0)).t()


def bf16_random(*shape) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16).mul_(BF16_STD)


# ----------------------------------------------------------------------------- MoE implementations
# Each: expert_bytes() in its own format, build(first) -> one copy of all E experts, call(W, x, ids, w)
# -> the layer output [T, H], expert(W, e) -> that expert's (w13 [2I, H], w2 [H, I]) in float32.


class KbitMoe:
    name = "kbit"

    def __init__(self, E, top_k, H, I, k):
        self.E, self.H, self.I, self.k = E, H, I, k
        self.cb = fmt.normal_float_codebook(k, "cuda")

    def expert_bytes(self) -> int:
        return kbit_bytes(2 * self.I, self.H, self.k) + kbit_bytes(self.H, self.I, self.k)

    def build(self, first: bool):
        return (*random_stacked(self.E, 2 * self.I, self.H, self.k), *random_stacked(self.E, self.H, self.I, self.k))

    def call(self, W, x, ids, w):
        return kbit_fused_moe(x, ids, w, *W, self.cb, self.I)

    def expert(self, W, e):
        deq = torch.ops.kbit.dequantize_runtime
        return (deq(W[0][e], W[1][e], self.cb, 2 * self.I, self.H, torch.bfloat16).float(),
                deq(W[2][e], W[3][e], self.cb, self.H, self.I, torch.bfloat16).float())


class MarlinMoe:
    """vLLM's GPTQ int4 MoE on Marlin, as AutoGPTQMoEMethod (quantization/auto_gptq.py) sets it up with the
    MARLIN backend (fused_moe/oracle/int_wna16.py _process_weights_marlin) and MarlinExperts.apply
    (fused_moe/experts/marlin_moe.py) calls it: no act-order (empty g_idx / sort indices, is_k_full),
    symmetric uint4b8, bf16 scales, moe_sum = ops.moe_sum."""

    name = "marlin_int4"
    k = None

    def __init__(self, E, top_k, H, I, k=None):
        self.v = vllm_api()
        self.E, self.H, self.I = E, H, I
        empty = lambda: torch.empty((E, 0), dtype=torch.int32, device="cuda")  # noqa: E731
        self.g_idx13, self.g_idx2, self.sort13, self.sort2 = empty(), empty(), empty(), empty()
        # allocated once, outside the graph (AutoGPTQMoEMethod.create_weights: marlin_make_workspace_new(device, 4))
        self.workspace = self.v.marlin_make_workspace_new(torch.device("cuda"), 4)
        self.ref = None

    def expert_bytes(self) -> int:
        n = 3 * self.H * self.I
        return n // 2 + n // GROUP * 2

    def build(self, first: bool):
        E, H, I, v = self.E, self.H, self.I, self.v
        q13, s13 = random_gptq(H, 2 * I, (E,))  # gate_up: K = H, N = 2I (gate columns, then up)
        q2, s2 = random_gptq(I, H, (E,))  # down: K = I, N = H
        if first:
            self.ref = (q13, s13, q2, s2)
        # the calls _process_weights_marlin makes (size_k of the w13 scales is the intermediate size there too)
        w13 = v.ops.gptq_marlin_moe_repack(q13, self.sort13, q13.shape[1] * 8, q13.shape[2], 4, is_a_8bit=False)
        w2 = v.ops.gptq_marlin_moe_repack(q2, self.sort2, q2.shape[1] * 8, q2.shape[2], 4, is_a_8bit=False)
        s13m = v.marlin_moe_permute_scales(s=s13, size_k=I, size_n=s13.shape[2], group_size=GROUP, is_a_8bit=False)
        s2m = v.marlin_moe_permute_scales(s=s2, size_k=s2.shape[1] * GROUP, size_n=s2.shape[2], group_size=GROUP,
                                          is_a_8bit=False)
        return w13, w2, s13m, s2m

    def _moe_sum(self, inp, out, topk_ids, expert_map):
        self.v.ops.moe_sum(inp, out)  # MarlinExperts.moe_sum without an expert map

    def call(self, W, x, ids, w):
        out = torch.empty_like(x)
        self.v.fused_marlin_moe(
            hidden_states=x, w1=W[0], w2=W[1], bias1=None, bias2=None, w1_scale=W[2], w2_scale=W[3],
            topk_weights=w, topk_ids=ids, quant_type_id=self.v.uint4b8.id, apply_router_weight_on_input=False,
            global_num_experts=self.E, activation=self.v.MoEActivation.SILU, moe_sum=self._moe_sum, expert_map=None,
            g_idx1=self.g_idx13, g_idx2=self.g_idx2, sort_indices1=self.sort13, sort_indices2=self.sort2,
            workspace=self.workspace, is_k_full=True, output=out, input_dtype=None,
        )
        return out

    def expert(self, W, e):
        q13, s13, q2, s2 = self.ref  # the GPTQ tensors of the first copy (the check uses that copy)
        return gptq_dequant(q13[e], s13[e]), gptq_dequant(q2[e], s2[e])


class TritonMoe:
    """vLLM's Triton fused_experts (fused_moe/fused_moe.py) in bf16: the kernels TritonExperts, the backend the
    unquantized-MoE oracle picks on Hopper, runs (same config lookup, align, two fused_moe_kernel, silu_and_mul,
    moe_sum)."""

    name = "triton_bf16"
    k = None

    def __init__(self, E, top_k, H, I, k=None):
        self.v = vllm_api()
        self.E, self.H, self.I = E, H, I

    def expert_bytes(self) -> int:
        return 2 * 3 * self.H * self.I

    def build(self, first: bool):
        return bf16_random(self.E, 2 * self.I, self.H), bf16_random(self.E, self.H, self.I)

    def call(self, W, x, ids, w):
        return self.v.fused_experts(x, W[0], W[1], w, ids, activation=self.v.MoEActivation.SILU,
                                    apply_router_weight_on_input=False, global_num_experts=self.E)

    def expert(self, W, e):
        return W[0][e].float(), W[1][e].float()


# ----------------------------------------------------------------------------- dense implementations
# Each: nbytes() in its own format, build(first) -> one weight copy, call(W, x) -> [M, N],
# rows(W, n) -> the first n output features' weights [n, K] in float32.


class KbitDense:
    name = "kbit"

    def __init__(self, K, N, k):
        self.K, self.N, self.k = K, N, k

    def nbytes(self) -> int:
        return kbit_bytes(self.N, self.K, self.k)

    def build(self, first: bool):
        return random_runtime_weight(self.N, self.K, self.k)

    def call(self, W, x):
        return kbit_linear(x, W)

    def rows(self, W, n):
        tiles = -(-n // fmt.TILE_N)
        deq = torch.ops.kbit.dequantize_runtime(W.qweight_rt[:tiles], W.absmax_rt[:tiles], W.codebook,
                                                tiles * fmt.TILE_N, self.K, torch.bfloat16)
        return deq[:n].float()


class MarlinDense:
    """vLLM's GPTQ int4 g128 linear on Marlin: the weight as MarlinLinearKernel.process_weights_after_loading
    (kernels/linear/mixed_precision/marlin.py) prepares it, called through apply_gptq_marlin_linear as its
    apply_weights does (no act-order, no zero points, no padding for these shapes)."""

    name = "marlin_int4"
    k = None

    def __init__(self, K, N, k=None):
        self.v = vllm_api()
        self.K, self.N = K, N
        self.empty = self.v.marlin_make_empty_g_idx(torch.device("cuda"))  # g_idx, sort indices, zero points
        self.workspace = self.v.marlin_make_workspace_new(torch.device("cuda"))  # allocated once, outside the graph
        self.ref = None

    def nbytes(self) -> int:
        return self.N * self.K // 2 + self.N * self.K // GROUP * 2

    def build(self, first: bool):
        q, s = random_gptq(self.K, self.N)
        if first:
            self.ref = (q, s)
        qm = self.v.ops.gptq_marlin_repack(q, perm=self.empty, size_k=self.K, size_n=self.N, num_bits=4, is_a_8bit=False)
        sm = self.v.marlin_permute_scales(s, size_k=self.K, size_n=self.N, group_size=GROUP, is_a_8bit=False)
        return qm, sm

    def call(self, W, x):
        return self.v.apply_gptq_marlin_linear(
            input=x, weight=W[0], weight_scale=W[1], weight_zp=self.empty, g_idx=self.empty,
            g_idx_sort_indices=self.empty, workspace=self.workspace, wtype=self.v.uint4b8,
            output_size_per_partition=self.N, input_size_per_partition=self.K, is_k_full=True,
            input_global_scale=None, bias=None, input_dtype=None,
        )

    def rows(self, W, n):
        q, s = self.ref
        return gptq_dequant(q[:, :n], s[:, :n])


class CublasDense:
    name = "cublas_bf16"
    k = None

    def __init__(self, K, N, k=None):
        self.K, self.N = K, N

    def nbytes(self) -> int:
        return 2 * self.N * self.K

    def build(self, first: bool):
        return bf16_random(self.N, self.K)

    def call(self, W, x):
        return F.linear(x, W)

    def rows(self, W, n):
        return W[:n].float()


def make_impl(layer: str, impl: str, k):
    if impl == "humming":
        import humming_peer  # its own module: Humming is imported only where it is asked for

        return humming_peer.HummingMoe(*MOE_LAYERS[layer], k) if layer in MOE_LAYERS else humming_peer.HummingDense(
            *DENSE_LAYERS[layer], k)
    if layer in MOE_LAYERS:
        cls = {"kbit": KbitMoe, "marlin_int4": MarlinMoe, "triton_bf16": TritonMoe}[impl]
        return cls(*MOE_LAYERS[layer], k)
    cls = {"kbit": KbitDense, "marlin_int4": MarlinDense, "cublas_bf16": CublasDense}[impl]
    return cls(*DENSE_LAYERS[layer], k)


# ----------------------------------------------------------------------------- checks


def routing(T: int, E: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of random router scores: int32 ids [T, top_k] and float32 weights (softmax of the picked scores)."""
    vals, ids = torch.topk(torch.randn(T, E, device="cuda"), top_k, dim=1)
    return ids.to(torch.int32), torch.softmax(vals, dim=-1)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def check_moe(impl, W, x, ids, w) -> float:
    """Relative error of the first token's output vs a float32 reference from impl's own expert weights
    (inf if any output is not finite; an all-zero output gives 1)."""
    out = impl.call(W, x, ids, w)
    torch.cuda.synchronize()
    if not bool(torch.isfinite(out).all()):
        return math.inf
    I = impl.I
    ref = torch.zeros(impl.H, device="cuda")
    for j in range(ids.shape[1]):
        w13, w2 = impl.expert(W, int(ids[0, j]))
        g = w13 @ x[0].float()
        h = (F.silu(g[:I]) * g[I:]).to(x.dtype).float()  # every impl keeps the activation in bf16
        ref += float(w[0, j]) * (w2 @ h)
    return rel_err(out[0], ref)


def check_dense(impl, W, x) -> float:
    """Relative error of the first row's first CHECK_ROWS outputs vs float32 (inf if any output is not finite)."""
    out = impl.call(W, x)
    torch.cuda.synchronize()
    if not bool(torch.isfinite(out).all()):
        return math.inf
    n = min(CHECK_ROWS, impl.N)
    return rel_err(out[0, :n], impl.rows(W, n) @ x[0].float())


# ----------------------------------------------------------------------------- the run


def impl_config(impl, T: int) -> dict:
    """{"config": ...} for impls that run under a configuration of their own (humming: the one at T), else nothing."""
    if not hasattr(impl, "config_for"):
        return {}
    return {"config": json.loads(json.dumps(impl.config_for(T), default=str))}


def cold_copies(touched_bytes: float, l2: int) -> int:
    """Weight copies to rotate so that the bytes the calls touch exceed 4x the L2 (at least 2)."""
    return max(2, math.ceil(4 * l2 / max(touched_bytes, 1)) + 1)


def fit_copies(n: int, copy_bytes: int, what: str) -> int:
    """n, or fewer where n copies would pass MEM_BUDGET (with a warning: the regime is then warmer)."""
    most = max(1, int(MEM_BUDGET // max(copy_bytes, 1)))
    if n > most:
        print(f"warning: {what}: {most} weight copies instead of {n} (memory budget)", flush=True)
    return min(n, most)


class Run:
    """One benchmark run: device facts, the deadline, the records, and saving them."""

    def __init__(self, args, gpu: str, l2: int, bw: float, start: float):
        self.l2, self.bw = l2, bw
        self.deadline = None if args.deadline is None else start + args.deadline
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
        self.data = dict(gpu=gpu, date=date, commit=args.commit or git_commit(),
                         command="python " + " ".join(sys.argv), copy_GBps=round(bw / 1e9, 1), l2_MiB=l2 >> 20,
                         versions=versions(), records=[], errors=[])
        os.makedirs(args.out, exist_ok=True)
        self.json_path = os.path.join(args.out, f"kernels_{gpu.replace(' ', '_')}_{date}.json")
        self.warned_plot = False

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def floor_us(self, nbytes: float) -> float:
        return nbytes / self.bw * 1e6

    def record(self, rec: dict) -> None:
        rec.update(us=round(rec["us"], 3), floor_us=round(rec["floor_us"], 3), rel_err=float(f"{rec['rel_err']:.3g}"))
        self.data["records"].append(rec)
        k = "-" if rec["k"] is None else rec["k"]
        print(f"{rec['layer']:>17} {rec['impl']:>11} k={k} T={rec['T']:<5} {rec['us']:10.2f} us   floor "
              f"{rec['floor_us']:9.2f} us ({100 * rec['floor_us'] / rec['us']:3.0f}%)   check {rec['rel_err']:.1e}",
              flush=True)

    def error(self, layer, impl, k, T, msg) -> None:
        self.data["errors"].append(dict(layer=layer, impl=impl, k=k, T=T, error=str(msg)[:500]))
        print(f"warning: {layer} {impl} k={k} T={T}: {str(msg)[:300]}", flush=True)

    def find(self, layer, impl, k, T):
        return next((r for r in self.data["records"]
                     if (r["layer"], r["impl"], r["k"], r["T"]) == (layer, impl, k, T)), None)

    def save(self) -> None:
        with open(self.json_path, "w") as f:
            json.dump(self.data, f, indent=1)
        _, png = report(self.json_path)
        if png is None and not self.warned_plot:
            print(f"no plot (matplotlib missing): `--report {self.json_path}` draws it elsewhere", flush=True)
            self.warned_plot = True


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def versions() -> dict:
    from importlib import metadata

    out = {"torch": torch.__version__, "vllm_kbit": vllm_kbit.__version__}
    try:
        out["vllm"] = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        out["vllm"] = None
    return out


def impl_plan(layer: str, impls: list, bits: list) -> list:
    """(impl, k) pairs to time for a layer, kbit first, baselines after."""
    allowed = MOE_IMPLS if layer in MOE_LAYERS else DENSE_IMPLS
    plan = []
    for impl in allowed:
        if impl in impls:
            plan += [(impl, k) for k in bits] if impl in K_IMPLS else [(impl, None)]
    return plan


def bench_moe_layer(run: Run, layer: str, plan: list, Ts: list) -> None:
    E, top_k, H, I = MOE_LAYERS[layer]
    xs = {T: torch.randn(T, H, device="cuda", dtype=torch.bfloat16) for T in Ts}
    routes = {T: [routing(T, E, top_k) for _ in range(ROUTINGS)] for T in Ts}
    hit = {T: sum(torch.unique(ids).numel() for ids, _ in routes[T]) / ROUTINGS for T in Ts}  # experts per call
    for impl_name, k in plan:
        if run.expired():
            return
        try:
            bench_moe_impl(run, layer, make_impl(layer, impl_name, k), xs, routes, hit)
        except Exception as e:  # noqa: BLE001  (one impl failing, e.g. vLLM missing, must not lose the others)
            run.error(layer, impl_name, k, None, f"{type(e).__name__}: {e}")
        torch.cuda.empty_cache()
        run.save()


def bench_moe_impl(run: Run, layer: str, impl, xs: dict, routes: dict, hit: dict) -> None:
    E, top_k, H, I = MOE_LAYERS[layer]
    eb = impl.expert_bytes()
    copies = {T: cold_copies(hit[T] * eb, run.l2) for T in xs}
    n_built = fit_copies(max(copies.values()), E * eb, f"{layer} {impl.name}")
    weights = [impl.build(first=i == 0) for i in range(n_built)]
    for T, x in xs.items():
        if run.expired():
            return
        n = min(copies[T], n_built)
        try:
            err = check_moe(impl, weights[0], x, *routes[T][0])
            if not err <= CHECK_TOL:
                raise RuntimeError(f"output check failed: relative error {err:.3g} vs the float reference")
            fns = [functools.partial(impl.call, weights[i % n], x, *routes[T][i % ROUTINGS])
                   for i in range(max(n, ROUTINGS))]
            us = graph_time_us(fns, min_calls=20 if T <= 256 else 6, replays=10)
        except Exception as e:  # noqa: BLE001
            run.error(layer, impl.name, impl.k, T, f"{type(e).__name__}: {e}")
            continue
        run.record(dict(layer=layer, impl=impl.name, k=impl.k, T=T, N=2 * I, K=H, regime="cold", us=us,
                        floor_us=run.floor_us(hit[T] * eb + 2 * 2 * T * H), inst_per_weight=None,
                        E=E, top_k=top_k, I=I, H=H, experts_hit=round(hit[T], 2), copies=n, rel_err=err,
                        **impl_config(impl, T)))


def bench_dense_layer(run: Run, layer: str, plan: list, Ms: list) -> None:
    K, N = DENSE_LAYERS[layer]
    xs = {M: torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for M in Ms}
    for impl_name, k in plan:
        if run.expired():
            return
        try:
            bench_dense_impl(run, layer, make_impl(layer, impl_name, k), xs)
        except Exception as e:  # noqa: BLE001
            run.error(layer, impl_name, k, None, f"{type(e).__name__}: {e}")
        torch.cuda.empty_cache()
        run.save()


def bench_dense_impl(run: Run, layer: str, impl, xs: dict) -> None:
    K, N = DENSE_LAYERS[layer]
    nbytes = impl.nbytes()
    n = fit_copies(cold_copies(nbytes, run.l2), nbytes, f"{layer} {impl.name}")
    weights = [impl.build(first=i == 0) for i in range(n)]
    for M, x in xs.items():
        if run.expired():
            return
        try:
            err = check_dense(impl, weights[0], x)
            if not err <= CHECK_TOL:
                raise RuntimeError(f"output check failed: relative error {err:.3g} vs the float reference")
            us = graph_time_us([functools.partial(impl.call, W, x) for W in weights])
        except Exception as e:  # noqa: BLE001
            run.error(layer, impl.name, impl.k, M, f"{type(e).__name__}: {e}")
            continue
        run.record(dict(layer=layer, impl=impl.name, k=impl.k, T=M, N=N, K=K, regime="cold", us=us,
                        floor_us=run.floor_us(nbytes + 2 * M * (K + N)), inst_per_weight=None, copies=n, rel_err=err,
                        **impl_config(impl, M)))


# ----------------------------------------------------------------------------- ncu pass


def find_ncu():
    path = shutil.which("ncu")
    if path is None and os.path.exists("/usr/local/cuda/bin/ncu"):
        path = "/usr/local/cuda/bin/ncu"
    return path


def profile_configs(configs: list, out_path: str) -> None:
    """The hidden --profile-one mode (run under ncu): per config, build one weight copy, warm up eagerly,
    then inside cudaProfilerStart/Stop a marker kernel and exactly one call. Writes the configs with the
    weights each call reads to out_path, in order."""
    built, done = {}, []
    for layer, impl_name, k_arg, T_arg in configs:
        k, T = (None if k_arg in ("-", "none", "None") else int(k_arg)), int(T_arg)
        if (layer, impl_name, k) not in built:
            impl = make_impl(layer, impl_name, k)
            built[(layer, impl_name, k)] = (impl, impl.build(first=False))
        impl, W = built[(layer, impl_name, k)]
        if layer in MOE_LAYERS:
            E, top_k, H, I = MOE_LAYERS[layer]
            ids, w = routing(T, E, top_k)
            fn = functools.partial(impl.call, W, torch.randn(T, H, device="cuda", dtype=torch.bfloat16), ids, w)
            n_weights = torch.unique(ids).numel() * 3 * H * I  # gate_up + down of the experts hit
        else:
            K, N = DENSE_LAYERS[layer]
            fn = functools.partial(impl.call, W, torch.randn(T, K, device="cuda", dtype=torch.bfloat16))
            n_weights = N * K
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        torch.cuda._sleep(1000)  # the marker: ncu's kernel list is split at it
        fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        done.append(dict(layer=layer, impl=impl_name, k=k, T=T, weights=n_weights))
    with open(out_path, "w") as f:
        json.dump(done, f)


def read_text(path: str) -> str:
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return f.read()


def metric_value(value: str, unit: str):
    """ncu's number ('1,234,567'), scaled where its unit carries a prefix ('Kinst', 'Minst'); None if not a number."""
    scale = {"K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}.get(unit[:1], 1.0) if unit not in ("inst", "") else 1.0
    try:
        return float(value.replace(",", "")) * scale
    except ValueError:
        return None


def parse_ncu_csv(text: str) -> list:
    """(ID, kernel name, NCU_METRIC value) of each profiled kernel in ncu --csv output, in launch order."""
    rows = list(csv.reader(line for line in text.splitlines() if line.startswith('"')))
    head = next((r for r in rows if "ID" in r and "Metric Name" in r and "Metric Value" in r), None)
    if head is None:
        return []
    col = {name: i for i, name in enumerate(head)}
    name_col = col.get("Kernel Name", col.get("Function Name"))
    unit_col = col.get("Metric Unit")
    out = []
    for r in rows:
        if len(r) != len(head) or r[col["Metric Name"]] != NCU_METRIC or name_col is None:
            continue
        value = metric_value(r[col["Metric Value"]], r[unit_col] if unit_col is not None else "")
        if value is not None and r[col["ID"]].isdigit():
            out.append((int(r[col["ID"]]), r[name_col], value))
    return sorted(out)


def split_at_markers(kernels: list) -> list:
    """Kernels after each marker kernel, as one list of (name, inst) per profiled call."""
    groups = []
    for _, name, inst in kernels:
        if NCU_MARKER in name:
            groups.append([])
        elif groups:
            groups[-1].append((name, inst))
    return groups


def ncu_pass(run: Run) -> None:
    """Re-run the NCU_CONFIGS measured in this run under ncu (one subprocess) and attach instructions per weight."""
    configs = [c for c in NCU_CONFIGS if run.find(*c) is not None]
    ncu = find_ncu()
    if not configs or ncu is None:
        if configs:
            print("warning: ncu not found (PATH, /usr/local/cuda/bin/ncu): inst_per_weight left null", flush=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        log, meta = os.path.join(tmp, "ncu.csv"), os.path.join(tmp, "configs.json")
        cmd = [ncu, "--metrics", NCU_METRIC, "--csv", "--profile-from-start", "off", "--target-processes", "all",
               "--log-file", log, sys.executable, os.path.abspath(__file__), "--profile-out", meta]
        for layer, impl, k, T in configs:
            cmd += ["--profile-one", layer, impl, "-" if k is None else str(k), str(T)]
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=NCU_TIMEOUT_S, cwd=REPO)
        except (OSError, subprocess.SubprocessError) as e:
            print(f"warning: ncu failed ({type(e).__name__}): inst_per_weight left null", flush=True)
            return
        text = read_text(log) + proc.stdout
        groups = split_at_markers(parse_ncu_csv(text))
        profiled = json.loads(read_text(meta) or "[]")
    if not profiled or len(groups) != len(profiled):
        why = next((ln for ln in (text + proc.stderr).splitlines() if "ERROR" in ln), proc.stderr.strip()[-200:])
        print(f"warning: ncu gave {len(groups)} kernel groups for {len(profiled)} configs (rc {proc.returncode}; "
              f"{why}): inst_per_weight left null", flush=True)
        return
    for cfg, group in zip(profiled, groups):
        attach_ncu(run.find(cfg["layer"], cfg["impl"], cfg["k"], cfg["T"]), group, cfg["weights"])
    print(f"ncu: {len(profiled)} configs in {time.monotonic() - t0:.0f} s", flush=True)


def attach_ncu(rec: dict, group: list, n_weights: int) -> None:
    rec["kernels"] = [dict(name=name[:300], inst=inst, inst_per_weight=round(inst * 32 / n_weights, 4))
                      for name, inst in group]
    rec["inst_per_weight"] = round(sum(inst for _, inst in group) * 32 / n_weights, 4)


# ----------------------------------------------------------------------------- report (CPU)


def fmt_us(v) -> str:
    return "-" if v is None else f"{v:.2f}" if v < 10 else f"{v:.1f}"


def fmt_ratio(a, b) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def layer_order(records: list) -> list:
    names = list(dict.fromkeys(r["layer"] for r in records))
    return [n for n in LAYERS if n in names] + [n for n in names if n not in LAYERS]


def layer_heading(layer: str, r0: dict) -> str:
    if "E" in r0:
        return (f"## {layer}: MoE layer, E={r0['E']}, top-{r0['top_k']}, H={r0['H']}, I={r0['I']} "
                f"(gate_up N={r0['N']}, K={r0['K']}); T = tokens")
    return f"## {layer}: dense, K={r0['K']} -> N={r0['N']}; T = M rows"


def layer_table(rows: list) -> list:
    """Markdown lines of one layer: rows T, columns the impls' µs, then the ratios."""
    moe = "E" in rows[0]
    base = "triton_bf16" if moe else "cublas_bf16"
    bits = sorted({r["k"] for r in rows if r["impl"] == "kbit"})
    hbits = sorted({r["k"] for r in rows if r["impl"] == "humming"})
    us = {(r["impl"], r["k"], r["T"]): r["us"] for r in rows}
    floor = {(r["impl"], r["k"], r["T"]): r.get("floor_us") for r in rows}
    head = (["T"] + [f"kbit-{k} µs" for k in bits] + ["marlin int4 µs", f"{IMPL_LABEL[base]} µs"]
            + [f"humming-{k} µs" for k in hbits] + ["kbit-4 vs marlin", "kbit-3 vs marlin", "kbit-2 vs marlin"]
            + [f"kbit-{k} vs humming-{k}" for k in hbits] + ["k2/k4", "kbit-4 % of floor"])
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---:" for _ in head) + " |"]
    for T in sorted({r["T"] for r in rows}):
        kb = {k: us.get(("kbit", k, T)) for k in (2, 3, 4, 5, *bits)}
        marlin = us.get(("marlin_int4", None, T))
        f4 = floor.get(("kbit", 4, T))
        pct = "-" if f4 is None or kb[4] is None else f"{100 * f4 / kb[4]:.0f}%"
        hum = {k: us.get(("humming", k, T)) for k in hbits}
        cells = ([str(T)] + [fmt_us(kb[k]) for k in bits] + [fmt_us(marlin), fmt_us(us.get((base, None, T)))]
                 + [fmt_us(hum[k]) for k in hbits] + [fmt_ratio(marlin, kb[k]) for k in (4, 3, 2)]
                 + [fmt_ratio(hum[k], kb.get(k)) for k in hbits] + [fmt_ratio(kb[2], kb[4]), pct])
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def short_kernel_name(name: str) -> str:
    """'void ns::Marlin<...>(args)' -> 'ns::Marlin': template arguments and parameter lists dropped."""
    depth, out = 0, []
    for ch in name:
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth = max(0, depth - 1)
        elif depth == 0:
            out.append(ch)
    s = "".join(out).strip()
    return (s[5:] if s.startswith("void ") else s)[:60]


def ncu_table(records: list) -> list:
    prof = [r for r in records if r.get("inst_per_weight") is not None]
    if not prof:
        return []
    lines = [f"## Instructions per weight (ncu {NCU_METRIC} x 32 / weights read, one call)", "",
             "| layer | impl | k | T | inst/weight | kernels (inst/weight) |", "| --- | --- | ---: | ---: | ---: | --- |"]
    for r in prof:
        kernels = "; ".join(f"{short_kernel_name(kr['name'])} {kr['inst_per_weight']:.3g}" for kr in r.get("kernels", []))
        lines.append(f"| {r['layer']} | {r['impl']} | {'-' if r['k'] is None else r['k']} | {r['T']} | "
                     f"{r['inst_per_weight']:.3g} | {kernels} |")
    return lines + [""]


def markdown(data: dict) -> str:
    recs = data["records"]
    lines = [f"# Kernel benchmark: {data['gpu']}, {data['date']}, commit {data['commit']}", "",
             f"copy bandwidth {data['copy_GBps']} GB/s (device-to-device, read + write); command `{data['command']}`", "",
             "COLD regime (weights, and for MoE routings, rotated so that the bytes touched exceed 4x the L2); µs per "
             "call from CUDA-graph replay. `X vs marlin` = marlin µs / kbit-X µs (> 1: kbit faster), `kbit-k vs "
             "humming-k` likewise at equal k; `k2/k4` = "
             "kbit-2 µs / kbit-4 µs; `% of floor` = HBM floor (bytes read at copy bandwidth) / measured time.", ""]
    for layer in layer_order(recs):
        rows = [r for r in recs if r["layer"] == layer]
        lines += [layer_heading(layer, rows[0]), ""] + layer_table(rows) + [""]
    lines += ncu_table(recs)
    if data.get("errors"):
        lines += ["## Not measured", ""] + [f"- {e['layer']} {e['impl']} k={e['k'] or '-'} T={e['T'] or '-'}: "
                                            f"{e['error']}" for e in data["errors"]] + [""]
    return "\n".join(lines)


def series_label(impl: str, k) -> str:
    return f"{impl}-{k}" if impl in K_IMPLS else IMPL_LABEL.get(impl, impl)


def series_color(impl: str, k) -> str:
    """The same colour for an impl / k in every panel: kbit k = 2..5 blues to greens, Marlin red, bf16 grey."""
    if impl == "kbit":
        return {2: "#08519c", 3: "#3182bd", 4: "#31a354", 5: "#74c476"}.get(k, "#636363")
    if impl == "humming":
        return {2: "#54278f", 3: "#756bb1", 4: "#e6550d", 5: "#fd8d3c"}.get(k, "#9e9ac8")
    return {"marlin_int4": "#de2d26", "triton_bf16": "#525252", "cublas_bf16": "#525252"}.get(impl, "#9e9ac8")


def plot(data: dict, path: str) -> None:
    """µs vs T (log-log), one panel per layer, one line per impl / k."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = data["records"]
    layers = layer_order(recs) or ["(no records)"]
    ncols = min(3, len(layers))
    nrows = -(-len(layers) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 4.2 * nrows), squeeze=False)
    for ax, layer in zip(axes.flat, layers):
        rows = [r for r in recs if r["layer"] == layer and r.get("us")]
        keys = sorted({(r["impl"], r["k"]) for r in rows}, key=lambda s: (IMPLS.index(s[0]) if s[0] in IMPLS else 9, s[1] or 0))
        for impl, k in keys:
            pts = sorted((r["T"], r["us"]) for r in rows if (r["impl"], r["k"]) == (impl, k))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, ls="-" if impl == "kbit" else "--",
                    color=series_color(impl, k), label=series_label(impl, k))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("T (tokens / rows)")
        ax.set_ylabel("µs per call (COLD)")
        ax.set_title(layer)
        ax.grid(alpha=0.3, which="both")
        if keys:
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(layers):]:
        ax.set_visible(False)
    fig.suptitle(f"kbit vs vLLM kernels, {data['gpu']}, {data['date']}, commit {data['commit']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(json_path: str) -> tuple:
    """Write the .md and .png of a run's JSON beside it; returns their paths (png None without matplotlib)."""
    with open(json_path) as f:
        data = json.load(f)
    stem = os.path.splitext(json_path)[0]
    with open(stem + ".md", "w") as f:
        f.write(markdown(data))
    png = stem + ".png"
    try:
        plot(data, png)
    except ImportError:  # matplotlib missing: the caller says so
        png = None
    return stem + ".md", png


# ----------------------------------------------------------------------------- main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--layers", default=",".join(DEFAULT_LAYERS), help=f"comma list of {', '.join(LAYERS)}")
    ap.add_argument("--impls", default=",".join(IMPLS), help=f"comma list of {', '.join(IMPLS)}")
    ap.add_argument("--bits", default="2,3,4,5", help="k of the kbit and humming impls")
    ap.add_argument("--tokens", help=f"comma list of T (MoE tokens and dense M); default MoE {MOE_TOKENS}, dense {DENSE_M}")
    ap.add_argument("--quick", action="store_true", help=f"T / M in {QUICK_TOKENS} only")
    ap.add_argument("--ncu", action="store_true", help="also count instructions per weight for a few configs under ncu")
    ap.add_argument("--commit", help="default: git rev-parse --short HEAD")
    ap.add_argument("--deadline", type=float, help="seconds after which no new measurement starts")
    ap.add_argument("--report", metavar="JSON", help="only write the .md and .png of an earlier run's JSON")
    ap.add_argument("--profile-one", nargs=4, action="append", metavar=("LAYER", "IMPL", "K", "T"), help=argparse.SUPPRESS)
    ap.add_argument("--profile-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.layers = args.layers.split(",")
    args.impls = args.impls.split(",")
    args.bits = [int(b) for b in args.bits.split(",")]
    for name, given, known in (("layer", args.layers, LAYERS), ("impl", args.impls, IMPLS)):
        if set(given) - set(known):
            ap.error(f"unknown {name} {sorted(set(given) - set(known))}; known: {', '.join(known)}")
    return args


def token_plan(args, moe: bool) -> list:
    if args.tokens:
        return [int(t) for t in args.tokens.split(",")]
    if args.quick:
        return list(QUICK_TOKENS)
    return list(MOE_TOKENS if moe else DENSE_M)


def main(argv=None) -> None:
    start = time.monotonic()
    args = parse_args(argv)
    if args.report:
        md, png = report(args.report)
        print(md, png or "(no plot: matplotlib missing)")
        return
    assert torch.cuda.is_available() and vllm_kbit.HAS_CUDA_KERNELS, "needs a CUDA GPU and the built extension"
    if args.profile_one:
        profile_configs(args.profile_one, args.profile_out or os.devnull)
        return
    props = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth()
    run = Run(args, props.name, props.L2_cache_size, bw, start)
    print(f"{props.name}: L2 {props.L2_cache_size >> 20} MiB, copy bandwidth {bw / 1e9:.0f} GB/s -> {run.json_path}",
          flush=True)
    for layer in [name for name in LAYERS if name in args.layers]:
        if run.expired():
            print("deadline reached: no further measurements", flush=True)
            break
        plan = impl_plan(layer, args.impls, args.bits)
        if layer in MOE_LAYERS:
            bench_moe_layer(run, layer, plan, token_plan(args, moe=True))
        else:
            bench_dense_layer(run, layer, plan, token_plan(args, moe=False))
        torch.cuda.empty_cache()
        run.save()
    if args.ncu and not run.expired():
        ncu_pass(run)
    run.save()
    print(markdown(run.data))


if __name__ == "__main__":
    main()
