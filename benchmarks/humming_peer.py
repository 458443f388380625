"""vLLM's Humming k-bit weight-only kernels (``humming-kernels``) as a peer in bench_kernels.py.

Humming is what vLLM ships for 2..8-bit weight-only layers (dense and MoE, ``--quantization humming``;
vLLM 0.33 pins humming-kernels 0.1.19). vLLM 0.26, the version the other peers come from, cannot serve
it on MoE, so the comparison is at kernel level, set up as vLLM's integration sets it up:

* weights: fresh random bf16 (std BF16_STD) quantized by Humming's own quantizer
  (``HummingWeightSchema.quant_tensor``) with weight_config ``{"quant_method": "humming", "dtype":
  "uint{k}", "group_size": 128}``: symmetric offset-binary codes, one bf16 scale per 128 inputs (signed,
  so the larger side of a group uses the extra code), then ``HummingLayer.transform()`` (the kernel
  layout); padding as vLLM's methods pad (N to 256, K to 128: a no-op for the bench shapes);
* dense: ``HummingLayer.forward(x, compute_config={"gemm_type": "dense", ...})``, vLLM's
  ``HummingLinearMethod.apply``;
* MoE: vLLM's ``HummingIndexedExperts.main_apply`` (the default gemm type): moe_align_block_size (block =
  the w13 config's block_shape[0]) -> indexed GEMM w13 (top_k) -> SiLU * up -> indexed GEMM w2 (top_k = 1,
  same sorted ids) -> weighted sum over top_k. Humming ships no align / combine op: vLLM's
  ``moe_align_block_size`` and ``silu_and_mul`` run where vLLM imports (as in vLLM), the combine is a
  ``torch.bmm`` (vLLM 0.26 has no ``moe_fused_mul_sum``);
* kernel config: vLLM passes no tuning_config, so Humming compiles its heuristic's whole list (one config
  per M interval) at the first call. Here the same heuristic is asked for the one M of each call
  (``get_heuristics_config(shape_m=M)``, the entry the list selects for M), so only that kernel is
  JIT-compiled; every record's ``config`` names the configs chosen.

Kernels are JIT-compiled (NVRTC, sm_90a) at their first call, which the benchmark's eager check makes
before any graph capture; the calls themselves never sync with the host.
"""

from __future__ import annotations

import functools
import json

import torch

GROUP = 128  # Humming weight_scale_group_size
BF16_STD = 0.02  # std of the random bf16 weights (as bench_kernels.py)
PAD_N, PAD_K = 256, 128  # vLLM's HummingLinearMethod / HummingMoEMethod pad_n_to_multiple / pad_k_to_multiple
TUNING_MODE = "per_m"  # "per_m" | "list" (see module docstring)
QUANT_CHUNK_EXPERTS = 16  # experts quantized at once (quant_weight makes an int32 code per weight before packing)
SILU_MUL_IMPL = "a / (1.0f + __expf(-a)) * b"  # humming process_input binary_split: a = gate, b = up


def _package() -> str:
    from importlib import metadata

    try:
        return f"humming-kernels=={metadata.version('humming-kernels')}"
    except metadata.PackageNotFoundError:
        return "humming (version unknown)"


def _compute_config(gemm_type: str) -> dict:
    # vLLM: {"use_batch_invariant": VLLM_BATCH_INVARIANT, "use_f16_accum": VLLM_HUMMING_USE_F16_ACCUM, "gemm_type": ...}
    return {"use_batch_invariant": False, "use_f16_accum": False, "gemm_type": gemm_type}


@functools.lru_cache(maxsize=None)
def humming_api():
    """Humming's Python API, imported on first use (import humming needs torch, numpy, jinja2, filelock, triton,
    cuda-bindings; the first kernel needs a CUDA 13 toolkit for NVRTC)."""
    from types import SimpleNamespace

    import humming
    from humming.layer import HummingLayer
    from humming.schema import HummingWeightSchema
    from humming.tune import get_heuristics_config

    return SimpleNamespace(humming=humming, ops=humming.ops, HummingLayer=HummingLayer,
                           HummingWeightSchema=HummingWeightSchema, get_heuristics_config=get_heuristics_config,
                           version=getattr(humming, "__version__", "?"))


@functools.lru_cache(maxsize=None)
def glue_api():
    """MoE glue around the two GEMMs: vLLM's ops where importable (what vLLM's Humming MoE runs), else fallbacks."""
    from types import SimpleNamespace

    align = act = None
    try:
        from vllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size as align
    except Exception:  # noqa: BLE001  (no vLLM: torch fallback below)
        align = None
    try:
        import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)

        if hasattr(torch.ops._C, "silu_and_mul"):
            act = torch.ops._C.silu_and_mul
    except Exception:  # noqa: BLE001
        act = None
    return SimpleNamespace(align=align, silu_and_mul=act)


# ----------------------------------------------------------------------------- helpers


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _kbit_bytes(n: int, k_dim: int, k: int) -> int:
    """Bytes of one humming uint-k g128 weight [n, k_dim]: packed codes + bf16 group scales (padded as vLLM pads)."""
    n_p, k_p = round_up(n, PAD_N), round_up(k_dim, PAD_K)
    return n_p * k_p * k // 8 + n_p * (k_p // GROUP) * 2


def _config_at(config: dict, m: int) -> dict:
    """config with "chosen" narrowed to the kernel configs picked for M = m."""
    chosen = {key: c for key, c in config.get("chosen", {}).items() if key.endswith(f"M={m}")}
    return {**config, "chosen": chosen}


def _weight_config(k: int) -> dict:
    return {"quant_method": "humming", "dtype": f"uint{k}", "group_size": GROUP}


def _make_layer(n: int, k_dim: int, k: int, num_experts: int | None, keep_ref: bool):
    """A HummingLayer holding fresh random bf16 weights [E?, n, k_dim] quantized by Humming, transformed for the
    kernel.  Returns (layer, ref) where ref = (schema, quantized tensors before transform) if keep_ref else None."""
    h = humming_api()
    layer = h.HummingLayer(shape_n=n, shape_k=k_dim, weight_config=_weight_config(k), pad_n_to_multiple=PAD_N,
                           pad_k_to_multiple=PAD_K, num_experts=num_experts, torch_dtype=torch.bfloat16).cuda()
    schema = layer.weight_schema  # HummingWeightSchema(b_dtype=uint{k}, weight_scale_group_size=128, bs_dtype=None->bf16)
    if num_experts:
        parts = []
        for s in range(0, num_experts, QUANT_CHUNK_EXPERTS):
            e = min(QUANT_CHUNK_EXPERTS, num_experts - s)
            w = torch.randn(e, n, k_dim, device="cuda", dtype=torch.bfloat16).mul_(BF16_STD)
            parts.append(h.HummingWeightSchema.quant_tensor(w, schema, torch.bfloat16))
            del w
        tensors = {key: torch.cat([p[key] for p in parts]) for key in parts[0]}
        del parts
    else:
        w = torch.randn(n, k_dim, device="cuda", dtype=torch.bfloat16).mul_(BF16_STD)
        tensors = h.HummingWeightSchema.quant_tensor(w, schema, torch.bfloat16)
        del w
    # tensors: weight int32 [E?, n, k_dim*k/32] (packed offset-binary codes), weight_scale bf16 [E?, n, k_dim/128]
    layer.load_from_tensors(tensors)  # copies into the layer's own parameters
    layer.transform()  # repack for the kernel; sets layer.humming_config (LayerConfig)
    ref = (schema, tensors) if keep_ref else None
    return layer, ref


def _dequant(ref, index) -> torch.Tensor:
    """float32 weights of ref's tensors at index (an expert id, or a row slice) via Humming's own dequantizer."""
    schema, tensors = ref
    sub = {key: tensors[key][index].contiguous() for key in ("weight", "weight_scale")}
    return schema.dequant_tensors(sub).float()


def torch_moe_align(topk_ids: torch.Tensor, block: int, num_experts: int):
    """Graph-capturable torch stand-in for vLLM's moe_align_block_size (same outputs: sorted_ids int32 padded with
    numel, expert_ids int32 per block, num_tokens_padded int32 [1]); fixed output sizes, no host sync.  About ten
    small kernels: slower than vLLM's one-kernel op, so its time is part of what is measured when vLLM is absent."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    dev = flat.device
    max_pad = round_up(min(n + num_experts * (block - 1), n * block), block)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block - 1) // block * block
    cum = torch.cumsum(padded, 0)
    order = torch.sort(flat, stable=True).indices
    sorted_exp = flat[order]
    rank = torch.arange(n, device=dev) - (torch.cumsum(counts, 0) - counts)[sorted_exp]
    dest = (cum - padded)[sorted_exp] + rank
    sorted_ids = torch.full((max_pad,), n, dtype=torch.int32, device=dev).scatter_(0, dest, order.to(torch.int32))
    blocks = torch.arange(max_pad // block, device=dev)
    expert_ids = torch.searchsorted(cum // block, blocks, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, cum[-1:].to(torch.int32)


class _Tuning:
    """Kernel config per call shape, as a JSON string for humming's tuning_config (cached per M, host-side only)."""

    def __init__(self, gemm_type: str, record: dict):
        self.gemm_type, self.record, self.cache = gemm_type, record, {}

    def get(self, layer, m: int, label: str = ""):
        key = (label, m)
        if key not in self.cache:
            h = humming_api()
            cc = _compute_config(self.gemm_type)
            if TUNING_MODE == "list":
                cfg = h.get_heuristics_config(layer.humming_config, use_f16_accum=cc["use_f16_accum"],
                                              use_batch_invariant=cc["use_batch_invariant"], gemm_type=self.gemm_type)
                chosen = next(c for lo, hi, c in cfg if lo < m <= (hi if hi > 0 else 1 << 30))
            else:
                cfg = h.get_heuristics_config(layer.humming_config, shape_m=m, use_f16_accum=cc["use_f16_accum"],
                                              use_batch_invariant=cc["use_batch_invariant"], gemm_type=self.gemm_type)
                chosen = cfg
            self.record.setdefault("chosen", {})[f"{label}M={m}" if label else f"M={m}"] = chosen
            self.cache[key] = (json.dumps(cfg), chosen)
        return self.cache[key]


# ----------------------------------------------------------------------------- MoE


class HummingMoe:
    """vLLM's Humming MoE (HummingIndexedExperts) on uint-k g128 weights, bf16 activations."""

    name = "humming"

    def __init__(self, E, top_k, H, I, k):
        assert k in (1, 2, 3, 4, 5, 6, 7, 8), k
        self.E, self.top_k, self.H, self.I, self.k = E, top_k, H, I, k
        self.ref = None
        self.config = {
            "package": _package(), "api": "humming.layer.HummingLayer (one per projection)",
            "weight_config": _weight_config(k), "scale_dtype": "bfloat16 (signed scales)", "zero_point": False,
            "activation_dtype": "bfloat16 (no input quantization)", "pad_n/pad_k": [PAD_N, PAD_K],
            "compute_config": _compute_config("indexed"), "moe_gemm_type": "indexed (vLLM default)",
            "tuning_mode": TUNING_MODE, "glue": None,
        }
        self._tuning = _Tuning("indexed", self.config)
        self._compute = json.dumps(_compute_config("indexed"))

    def expert_bytes(self) -> int:
        return _kbit_bytes(2 * self.I, self.H, self.k) + _kbit_bytes(self.H, self.I, self.k)

    def config_for(self, T: int) -> dict:
        """The config of the calls at T tokens: the kernel configs chosen for M = T * top_k only."""
        return _config_at(self.config, T * self.top_k)

    def build(self, first: bool):
        w13, r13 = _make_layer(2 * self.I, self.H, self.k, self.E, keep_ref=first)  # gate rows, then up rows
        w2, r2 = _make_layer(self.H, self.I, self.k, self.E, keep_ref=first)
        if first:
            self.ref = (r13, r2)
        return w13, w2

    def _align(self, ids, block):
        g = glue_api()
        if g.align is not None:
            return g.align(topk_ids=ids, block_size=block, num_experts=self.E)
        return torch_moe_align(ids, block, self.E)

    def _silu_mul(self, gate_up):
        g = glue_api()
        out = torch.empty(gate_up.shape[0], self.I, device=gate_up.device, dtype=gate_up.dtype)
        if g.silu_and_mul is not None:
            g.silu_and_mul(out, gate_up)
        else:
            humming_api().ops.process_input(gate_up, outputs=out, activation_type="binary_split",
                                            activation_impl=SILU_MUL_IMPL)
        return out

    def call(self, W, x, ids, w):
        w13, w2 = W
        T, top_k = ids.shape
        m = T * top_k  # vLLM's valid_shape_m (estimate_local_valid_shape_m without EP / DP)
        if self.config["glue"] is None:
            g = glue_api()
            self.config["glue"] = {"align": "vllm moe_align_block_size" if g.align else "torch_moe_align (this file)",
                                   "activation": "vllm silu_and_mul" if g.silu_and_mul else "humming process_input",
                                   "combine": "torch.bmm(topk_weights, down) (vLLM: moe_fused_mul_sum)"}
        t13, c13 = self._tuning.get(w13, m, "w13 ")
        t2, c2 = self._tuning.get(w2, m, "w2 ")
        b13, b2 = c13["block_shape"][0], c2["block_shape"][0]
        sorted_ids, expert_ids, ntp = self._align(ids, b13)
        gate_up = torch.empty(m, 2 * self.I, device=x.device, dtype=x.dtype)
        w13(x, outputs=gate_up, sorted_ids=sorted_ids, expert_ids=expert_ids, num_tokens_padded=ntp, top_k=top_k,
            valid_shape_m=m, compute_config=self._compute, tuning_config=t13)
        act = self._silu_mul(gate_up)
        if b2 != b13:  # vLLM reuses w13's alignment; the kernel indexes expert_ids by its own block_m (scheduler.cuh)
            sorted_ids, expert_ids, ntp = self._align(ids, b2)
        down = torch.empty(m, self.H, device=x.device, dtype=x.dtype)
        w2(act, outputs=down, sorted_ids=sorted_ids, expert_ids=expert_ids, num_tokens_padded=ntp, top_k=1,
           valid_shape_m=m, compute_config=self._compute, tuning_config=t2)
        return torch.bmm(w.to(x.dtype).unsqueeze(1), down.view(T, top_k, self.H)).view(T, self.H)

    def expert(self, W, e):
        r13, r2 = self.ref  # the first copy's quantized tensors (the check uses that copy)
        return _dequant(r13, e), _dequant(r2, e)


# ----------------------------------------------------------------------------- dense


class HummingDense:
    """vLLM's HummingLinearMethod on uint-k g128 weights, bf16 activations (one humming GEMM, gemm_type dense)."""

    name = "humming"

    def __init__(self, K, N, k):
        assert k in (1, 2, 3, 4, 5, 6, 7, 8), k
        self.K, self.N, self.k = K, N, k
        self.ref = None
        self.config = {
            "package": _package(), "api": "humming.layer.HummingLayer",
            "weight_config": _weight_config(k), "scale_dtype": "bfloat16 (signed scales)", "zero_point": False,
            "activation_dtype": "bfloat16 (no input quantization)", "pad_n/pad_k": [PAD_N, PAD_K],
            "compute_config": _compute_config("dense"), "tuning_mode": TUNING_MODE,
        }
        self._tuning = _Tuning("dense", self.config)
        self._compute = json.dumps(_compute_config("dense"))

    def nbytes(self) -> int:
        return _kbit_bytes(self.N, self.K, self.k)

    def config_for(self, T: int) -> dict:
        """The config of the calls at M = T rows: the kernel config chosen for that M only."""
        return _config_at(self.config, T)

    def build(self, first: bool):
        layer, ref = _make_layer(self.N, self.K, self.k, None, keep_ref=first)
        if first:
            self.ref = ref
        return layer

    def call(self, W, x):
        tuning, _ = self._tuning.get(W, x.shape[0])
        return W(x, compute_config=self._compute, tuning_config=tuning)

    def rows(self, W, n):
        return _dequant(self.ref, slice(0, n))
