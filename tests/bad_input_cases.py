"""Bad input for every torch.ops.kbit op, as one table run three ways:

* through the CPU implementations (tests/test_bad_input.py, in CI);
* through the C++ checks as ops on CPU tensors, ``kbit::_check_<op>`` (tests/test_bad_input.py, in a
  subprocess);
* through the CUDA implementations, one subprocess per case, so a crash fails one test instead of
  killing the run (tests/gpu/test_bad_input_cuda.py; tests/gpu/run_reliability.sh).

Each case builds the op's arguments on a device, and names the exception and a fragment of the
one-line message every implementation raises: the rules are csrc/ops/checks.cpp's, which the CUDA ops
run and the reference asks (vllm_kbit.reference.check). Routing ids outside the local experts are not
errors: ROUTING_CASES check that such slots contribute zero.

As a script: ``python tests/bad_input_cases.py [--device cuda] [--check-op] [CASE ...]`` runs the
given cases (default: all) in this process and exits 0 when every one raised as expected (ROUTING
cases: matched the result without those slots); ``--list`` prints the case ids.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from typing import Callable

import torch

from vllm_kbit import reference as fmt

N, K, KBITS = 8, 64, 4


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    op: str  # torch.ops.kbit.<op>
    build: Callable[[str], tuple]  # device -> the op's arguments
    error: type
    match: str  # regex searched in the message
    cuda_only: bool = False  # needs tensors on two devices
    cpp_check: bool = True  # kbit::_check_<op> covers it (metadata; the weight's values are checked in the op)


def _weight(device, k=KBITS, n=N, kk=K, seed=0):
    g = torch.Generator().manual_seed(seed)
    cb = fmt.normal_float_codebook(k)
    q, a = fmt.quantize(torch.randn(n, kk, generator=g), cb, k)
    return q.to(device), a.to(device), cb.to(device)


def _runtime(device, k=KBITS, n=N, kk=K):
    q, a, cb = _weight("cpu", k, n, kk)
    q_rt, a_rt = fmt.repack(q, a)
    return q_rt.to(device), a_rt.to(device), cb.to(device)


def _noncontig(t):
    """The same shape and values, not contiguous."""
    return t.transpose(0, 1).contiguous().transpose(0, 1)


def _x(device, rows=1, features=K, dtype=torch.bfloat16):
    return torch.randn(rows, features, generator=torch.Generator().manual_seed(1)).to(device, dtype)


def _W(device, shape=(N, K), dtype=torch.float32, fill=None):
    W = torch.randn(*shape, generator=torch.Generator().manual_seed(2), dtype=torch.float32)
    if fill is not None:
        W.view(-1)[3] = fill
    return W.to(device, dtype)


def _cb(device, k):
    return fmt.normal_float_codebook(k).to(device)


def _linear(device, x=None, n=N, kk=K, bias=None, q=None, a=None, cb=None, k=KBITS):
    q_rt, a_rt, cb_rt = _runtime(device, k)
    return (
        _x(device) if x is None else x,
        q_rt if q is None else q,
        a_rt if a is None else a,
        cb_rt if cb is None else cb,
        n,
        kk,
        bias,
    )


# fused_moe: E experts of hidden size H, intermediate size I.
E, H, I, TOP_K, T = 4, 64, 32, 2, 3


def _experts(device, k=KBITS):
    cb = fmt.normal_float_codebook(k)
    stacks = []
    for n_, k_ in ((2 * I, H), (H, I)):
        rts = [fmt.repack(*fmt.quantize(torch.randn(n_, k_, generator=torch.Generator().manual_seed(10 + e)), cb, k)) for e in range(E)]
        stacks += [torch.stack([q for q, _ in rts]).to(device), torch.stack([a for _, a in rts]).to(device)]
    return (*stacks, cb.to(device))


def _moe(device, x=None, ids=None, weights=None, I_=I, expert_map=None, cb=None):
    w13_q, w13_a, w2_q, w2_a, cb_ = _experts(device)
    g = torch.Generator().manual_seed(3)
    return (
        _x(device, T, H) if x is None else x,
        torch.randint(0, E, (T, TOP_K), generator=g).to(device, torch.int32) if ids is None else ids,
        torch.rand(T, TOP_K, generator=g).to(device) if weights is None else weights,
        w13_q, w13_a, w2_q, w2_a,
        cb_ if cb is None else cb,
        I_,
        expert_map,
        False,
    )


def _rotated(args: tuple, **rotation) -> tuple:
    """An op's arguments with its keyword-only rotation arguments (the last element, a dict: run_case passes it as
    keywords)."""
    return (*args, rotation)


def _signs(device, n, dtype=torch.float32):
    return fmt.rotation_signs(n, 0).to(device, dtype)


def _linear_wide(device, kk):
    """A valid linear call on a [N, kk] weight."""
    q_rt, a_rt, cb = _runtime(device, KBITS, N, kk)
    return (_x(device, features=kk), q_rt, a_rt, cb, N, kk, None)


_K6 = "k=6 is not supported; k must be one of"
_CB = "codebook has 16 entries but k=3 needs 8"

CASES: list[Case] = [
    # quantize(W, codebook, k)
    Case("quantize-k6", "quantize", lambda d: (_W(d), _cb(d, 4), 6), ValueError, _K6),
    Case("quantize-k1", "quantize", lambda d: (_W(d), _cb(d, 4), 1), ValueError, "k=1 is not supported"),
    Case("quantize-K33", "quantize", lambda d: (_W(d, (4, 33)), _cb(d, 4), 4), ValueError, r"weight K=33 \(shape \[4, 33\]\) is not a positive multiple of 32"),
    Case("quantize-K48", "quantize", lambda d: (_W(d, (4, 48)), _cb(d, 4), 4), ValueError, "K=48 .* not a positive multiple of 32"),
    Case("quantize-K0", "quantize", lambda d: (_W(d, (4, 0)), _cb(d, 4), 4), ValueError, "K=0 .* not a positive multiple of 32"),
    Case("quantize-3d", "quantize", lambda d: (_W(d, (2, 4, 32)), _cb(d, 4), 4), ValueError, r"weight must be 2-D \[N, K\], got shape \[2, 4, 32\]"),
    Case("quantize-float64", "quantize", lambda d: (_W(d, dtype=torch.float64), _cb(d, 4), 4), TypeError, "weight has dtype torch.float64; supported: float16, bfloat16, float32"),
    Case("quantize-int32", "quantize", lambda d: (_W(d, dtype=torch.int32), _cb(d, 4), 4), TypeError, "weight has dtype torch.int32"),
    Case("quantize-noncontiguous", "quantize", lambda d: (_W(d, (64, 64)).T, _cb(d, 4), 4), ValueError, "weight must be contiguous"),
    Case("quantize-codebook-size", "quantize", lambda d: (_W(d), _cb(d, 4), 3), ValueError, _CB),
    Case("quantize-codebook-float64", "quantize", lambda d: (_W(d), _cb(d, 4).double(), 4), TypeError, "codebook must be a 1-D float32 tensor, got torch.float64"),
    Case("quantize-codebook-2d", "quantize", lambda d: (_W(d), _cb(d, 4).view(4, 4), 4), TypeError, r"codebook must be a 1-D float32 tensor, got torch.float32 of shape \[4, 4\]"),
    Case("quantize-inf", "quantize", lambda d: (_W(d, fill=float("inf")), _cb(d, 4), 4), ValueError, "NaN or Inf", cpp_check=False),
    Case("quantize-minus-inf", "quantize", lambda d: (_W(d, fill=float("-inf")), _cb(d, 4), 4), ValueError, "NaN or Inf", cpp_check=False),
    Case("quantize-nan", "quantize", lambda d: (_W(d, fill=float("nan")), _cb(d, 4), 4), ValueError, "NaN or Inf", cpp_check=False),
    Case("quantize-above-e4m4", "quantize", lambda d: (_W(d, fill=100.0), _cb(d, 4), 4), ValueError, r"\|w\| = 100, above the largest E4M4 block scale 31.0", cpp_check=False),
    Case("quantize-codebook-on-cpu", "quantize", lambda d: (_W(d), _cb("cpu", 4), 4), ValueError, "codebook is on cpu but weight is on cuda", cuda_only=True),
    # dequantize(qweight, absmax, codebook, dtype)
    Case("dequantize-absmax-shape", "dequantize", lambda d: (lambda q, a, cb: (q, a[:, :1].contiguous(), cb, torch.bfloat16))(*_weight(d)), ValueError, r"absmax must be uint8 \[8, 2\] to match qweight \[8, 2, 4\], got torch.uint8 \[8, 1\]"),
    Case("dequantize-absmax-int32", "dequantize", lambda d: (lambda q, a, cb: (q, a.int(), cb, torch.bfloat16))(*_weight(d)), ValueError, "absmax must be uint8"),
    Case("dequantize-codebook-size", "dequantize", lambda d: (lambda q, a, cb: (q, a, _cb(d, 4), torch.bfloat16))(*_weight(d, 3)), ValueError, _CB),
    Case("dequantize-qweight-float", "dequantize", lambda d: (lambda q, a, cb: (q.float(), a, cb, torch.bfloat16))(*_weight(d)), TypeError, r"qweight must be int32 \[N, K/32, k\], got torch.float32"),
    Case("dequantize-k6", "dequantize", lambda d: (torch.zeros(N, 2, 6, dtype=torch.int32, device=d), torch.zeros(N, 2, dtype=torch.uint8, device=d), _cb(d, 4), torch.bfloat16), ValueError, _K6),
    Case("dequantize-out-int8", "dequantize", lambda d: (*_weight(d), torch.int8), TypeError, "output dtype torch.int8 is not supported"),
    Case("dequantize-noncontiguous", "dequantize", lambda d: (lambda q, a, cb: (_noncontig(q), a, cb, torch.bfloat16))(*_weight(d)), ValueError, "qweight must be contiguous"),
    Case("dequantize-absmax-on-cpu", "dequantize", lambda d: (lambda q, a, cb: (q, a.cpu(), cb, torch.bfloat16))(*_weight(d)), ValueError, "absmax is on cpu but qweight is on cuda", cuda_only=True),
    # repack(qweight, absmax)
    Case("repack-absmax-shape", "repack", lambda d: (lambda q, a, cb: (q, a[:, :1].contiguous()))(*_weight(d)), ValueError, r"absmax must be uint8 \[8, 2\] to match qweight \[8, 2, 4\]"),
    Case("repack-absmax-rows", "repack", lambda d: (lambda q, a, cb: (q, a[:3].contiguous()))(*_weight(d)), ValueError, "absmax must be uint8"),
    Case("repack-absmax-int32", "repack", lambda d: (lambda q, a, cb: (q, a.int()))(*_weight(d)), ValueError, "absmax must be uint8"),
    Case("repack-qweight-2d", "repack", lambda d: (lambda q, a, cb: (q[:, :, 0].contiguous(), a))(*_weight(d)), TypeError, "qweight must be int32"),
    Case("repack-k6", "repack", lambda d: (torch.zeros(N, 2, 6, dtype=torch.int32, device=d), torch.zeros(N, 2, dtype=torch.uint8, device=d)), ValueError, _K6),
    Case("repack-noncontiguous", "repack", lambda d: (lambda q, a, cb: (_noncontig(q), a))(*_weight(d)), ValueError, "qweight must be contiguous"),
    Case("repack-absmax-on-cpu", "repack", lambda d: (lambda q, a, cb: (q, a.cpu()))(*_weight(d)), ValueError, "absmax is on cpu but qweight is on cuda", cuda_only=True),
    # unrepack(qweight_rt, absmax_rt, N, K): the reference on every device
    Case("unrepack-N", "unrepack", lambda d: (*_runtime(d)[:2], 100, K), ValueError, r"runtime tensors for \[100, 64\]"),
    Case("unrepack-K", "unrepack", lambda d: (*_runtime(d)[:2], N, 65), ValueError, "K a positive multiple of 32"),
    # dequantize_runtime(qweight_rt, absmax_rt, codebook, N, K, dtype)
    Case("dequantize_runtime-K", "dequantize_runtime", lambda d: (*_runtime(d), N, 544, torch.float32), ValueError, r"runtime tensors for \[8, 544\] must be int32 \[1, 5, 4, 64, 4\]"),
    Case("dequantize_runtime-N", "dequantize_runtime", lambda d: (*_runtime(d), 100, K, torch.float32), ValueError, r"runtime tensors for \[100, 64\]"),
    Case("dequantize_runtime-K65", "dequantize_runtime", lambda d: (*_runtime(d), N, 65, torch.float32), ValueError, r"weight shape \[8, 65\] needs N > 0 and K a positive multiple of 32"),
    Case("dequantize_runtime-N0", "dequantize_runtime", lambda d: (*_runtime(d), 0, K, torch.float32), ValueError, "needs N > 0"),
    Case("dequantize_runtime-codebook-size", "dequantize_runtime", lambda d: (*_runtime(d, 3)[:2], _cb(d, 4), N, K, torch.float32), ValueError, _CB),
    Case("dequantize_runtime-qweight-float", "dequantize_runtime", lambda d: (lambda q, a, cb: (q.float(), a, cb, N, K, torch.float32))(*_runtime(d)), TypeError, "runtime qweight must be int32"),
    Case("dequantize_runtime-absmax-int32", "dequantize_runtime", lambda d: (lambda q, a, cb: (q, a.int(), cb, N, K, torch.float32))(*_runtime(d)), ValueError, "runtime tensors for"),
    Case("dequantize_runtime-out-int8", "dequantize_runtime", lambda d: (*_runtime(d), N, K, torch.int8), TypeError, "output dtype torch.int8"),
    Case("dequantize_runtime-absmax-on-cpu", "dequantize_runtime", lambda d: (lambda q, a, cb: (q, a.cpu(), cb, N, K, torch.float32))(*_runtime(d)), ValueError, "runtime absmax is on cpu but runtime qweight is on cuda", cuda_only=True),
    # linear(x, qweight_rt, absmax_rt, codebook, N, K, bias)
    Case("linear-x-K", "linear", lambda d: _linear(d, x=_x(d, features=32)), ValueError, "x has 32 features but the weight has K=64"),
    Case("linear-x-K-prefill", "linear", lambda d: _linear(d, x=_x(d, rows=100, features=96)), ValueError, "x has 96 features but the weight has K=64"),
    Case("linear-x-0d", "linear", lambda d: _linear(d, x=torch.tensor(1.0, dtype=torch.bfloat16, device=d)), ValueError, "x must be .* got a 0-d tensor"),
    Case("linear-x-int8", "linear", lambda d: _linear(d, x=_x(d).to(torch.int8)), TypeError, "x has dtype torch.int8; supported: float16, bfloat16, float32"),
    Case("linear-x-float64", "linear", lambda d: _linear(d, x=_x(d).double()), TypeError, "x has dtype torch.float64"),
    Case("linear-bias-length", "linear", lambda d: _linear(d, bias=torch.zeros(N + 1, dtype=torch.bfloat16, device=d)), ValueError, r"bias must be \[8\] of x's dtype torch.bfloat16, got torch.bfloat16 \[9\]"),
    Case("linear-bias-2d", "linear", lambda d: _linear(d, bias=torch.zeros(1, N, dtype=torch.bfloat16, device=d)), ValueError, r"bias must be \[8\]"),
    Case("linear-bias-dtype", "linear", lambda d: _linear(d, bias=torch.zeros(N, dtype=torch.float32, device=d)), ValueError, r"bias must be \[8\] of x's dtype"),
    Case("linear-N", "linear", lambda d: _linear(d, n=100), ValueError, r"runtime tensors for \[100, 64\]"),
    Case("linear-N-gemm", "linear", lambda d: _linear(d, x=_x(d, rows=300), n=200), ValueError, r"runtime tensors for \[200, 64\]"),
    Case("linear-K", "linear", lambda d: _linear(d, x=_x(d, features=256), kk=256), ValueError, r"runtime tensors for \[8, 256\]"),
    Case("linear-K-mma", "linear", lambda d: _linear(d, x=_x(d, rows=16, features=256), kk=256), ValueError, r"runtime tensors for \[8, 256\]"),
    Case("linear-K-not-multiple", "linear", lambda d: _linear(d, x=_x(d, features=48), kk=48), ValueError, r"weight shape \[8, 48\] needs N > 0 and K a positive multiple of 32"),
    Case("linear-codebook-size", "linear", lambda d: _linear(d, k=3, cb=_cb(d, 4)), ValueError, _CB),
    Case("linear-codebook-short", "linear", lambda d: _linear(d, cb=_cb(d, 2)), ValueError, "codebook has 4 entries but k=4 needs 16"),
    Case("linear-codebook-float16", "linear", lambda d: _linear(d, cb=_cb(d, 4).half()), TypeError, "codebook must be a 1-D float32 tensor"),
    Case("linear-qweight-float", "linear", lambda d: (lambda a: _linear(d, q=a[1].float()))(_linear(d)), TypeError, "runtime qweight must be int32"),
    Case("linear-qweight-flat", "linear", lambda d: (lambda q, a, cb: _linear(d, q=q, a=a))(*_weight(d)), TypeError, "runtime qweight must be int32"),
    Case("linear-k6", "linear", lambda d: _linear(d, q=torch.zeros(1, 1, 6, 64, 4, dtype=torch.int32, device=d)), ValueError, _K6),
    Case("linear-absmax-shape", "linear", lambda d: (lambda a: _linear(d, a=a[2][:, :, :32].contiguous()))(_linear(d)), ValueError, "runtime tensors for"),
    Case("linear-noncontiguous-qweight", "linear", lambda d: (lambda a: _linear(d, q=a[1].transpose(3, 4).contiguous().transpose(3, 4)))(_linear(d)), ValueError, "runtime qweight must be contiguous"),
    Case("linear-qweight-on-cpu", "linear", lambda d: (lambda a: _linear(d, q=a[1].cpu()))(_linear(d)), ValueError, "runtime qweight is on cpu but x is on cuda", cuda_only=True),
    Case("linear-codebook-on-cpu", "linear", lambda d: _linear(d, cb=_cb("cpu", 4)), ValueError, "codebook is on cpu but x is on cuda", cuda_only=True),
    Case("linear-bias-on-cpu", "linear", lambda d: _linear(d, bias=torch.zeros(N, dtype=torch.bfloat16)), ValueError, "bias is on cpu but x is on cuda", cuda_only=True),
    # linear(..., *, rot_signs, rot_block): a rotated layer's input rotation
    Case("linear-rot-block-without-signs", "linear", lambda d: _rotated(_linear(d), rot_block=16), ValueError, "rot_block=16 without rot_signs; give both"),
    Case("linear-rot-signs-without-block", "linear", lambda d: _rotated(_linear(d), rot_signs=_signs(d, K)), ValueError, "rot_block=0 is not supported for 64 inputs; supported: a power of two 2..1024 dividing 64"),
    Case("linear-rot-signs-length", "linear", lambda d: _rotated(_linear(d), rot_signs=_signs(d, K // 2), rot_block=16), ValueError, r"rot_signs have shape \[32\]; expected a contiguous \[64\]"),
    Case("linear-rot-signs-2d", "linear", lambda d: _rotated(_linear(d), rot_signs=_signs(d, K).view(2, K // 2), rot_block=16), ValueError, r"rot_signs have shape \[2, 32\]"),
    Case("linear-rot-signs-bfloat16", "linear", lambda d: _rotated(_linear(d), rot_signs=_signs(d, K, torch.bfloat16), rot_block=16), TypeError, "rot_signs have dtype torch.bfloat16; expected float32"),
    Case("linear-rot-block-not-power-of-two", "linear", lambda d: _rotated(_linear(d), rot_signs=_signs(d, K), rot_block=24), ValueError, "rot_block=24 is not supported for 64 inputs"),
    Case("linear-rot-block-not-dividing", "linear", lambda d: _rotated(_linear(d), rot_signs=_signs(d, K), rot_block=128), ValueError, "rot_block=128 is not supported for 64 inputs; supported: a power of two 2..1024 dividing 64"),
    Case("linear-rot-block-too-large", "linear", lambda d: _rotated(_linear_wide(d, 2048), rot_signs=_signs(d, 2048), rot_block=2048), ValueError, "rot_block=2048 is not supported for 2048 inputs; supported: a power of two 2..1024"),
    Case("linear-rot-signs-on-cpu", "linear", lambda d: _rotated(_linear(d), rot_signs=_signs("cpu", K), rot_block=16), ValueError, "rot_signs are on cpu, x on cuda", cuda_only=True),
    # fused_moe(x, topk_ids, topk_weights, w13_q, w13_a, w2_q, w2_a, codebook, I, expert_map, on_input)
    Case("fused_moe-topk_weights-int64", "fused_moe", lambda d: _moe(d, weights=torch.ones(T, TOP_K, dtype=torch.int64, device=d)), TypeError, "topk_weights must be a float tensor, got torch.int64"),
    Case("fused_moe-topk_ids-float", "fused_moe", lambda d: _moe(d, ids=torch.zeros(T, TOP_K, device=d)), TypeError, "topk_ids must be an integer tensor"),
    Case("fused_moe-topk-shape", "fused_moe", lambda d: _moe(d, ids=torch.zeros(T, TOP_K + 1, dtype=torch.int32, device=d)), ValueError, r"needs x \[T, H\] and topk_ids/topk_weights \[T, top_k\]"),
    Case("fused_moe-tokens", "fused_moe", lambda d: _moe(d, x=_x(d, T + 1, H)), ValueError, r"needs x \[T, H\]"),
    Case("fused_moe-hidden-size", "fused_moe", lambda d: _moe(d, x=_x(d, T, 2 * H)), ValueError, "w2_qweight/w2_absmax for 4 experts of \\[128, 32\\]"),
    Case("fused_moe-intermediate-size", "fused_moe", lambda d: _moe(d, I_=64), ValueError, "w13_qweight/w13_absmax for 4 experts"),
    Case("fused_moe-intermediate-not-multiple", "fused_moe", lambda d: _moe(d, I_=33), ValueError, "must be positive multiples of 32"),
    Case("fused_moe-x-int8", "fused_moe", lambda d: _moe(d, x=_x(d, T, H).to(torch.int8)), TypeError, "x has dtype torch.int8"),
    Case("fused_moe-codebook-size", "fused_moe", lambda d: _moe(d, cb=_cb(d, 3)), ValueError, r"codebook must be float32 \[16\]"),
    Case("fused_moe-expert_map-float", "fused_moe", lambda d: _moe(d, expert_map=torch.zeros(E, device=d)), ValueError, "expert_map must be a 1-D integer tensor"),
    Case("fused_moe-ids-on-cpu", "fused_moe", lambda d: _moe(d, ids=torch.zeros(T, TOP_K, dtype=torch.int32)), ValueError, "needs every tensor on x's device", cuda_only=True),
    # fused_moe(..., *, w13_rot_signs, w13_rot_block, w2_rot_signs, w2_rot_block): over H and over I
    Case("fused_moe-w13-rot-signs-length", "fused_moe", lambda d: _rotated(_moe(d), w13_rot_signs=_signs(d, I), w13_rot_block=16), ValueError, r"w13_rot_signs have shape \[32\]; expected a contiguous \[64\]"),
    Case("fused_moe-w13-rot-block-without-signs", "fused_moe", lambda d: _rotated(_moe(d), w13_rot_block=16), ValueError, "w13_rot_block=16 without w13_rot_signs"),
    Case("fused_moe-w2-rot-signs-float64", "fused_moe", lambda d: _rotated(_moe(d), w2_rot_signs=_signs(d, I, torch.float64), w2_rot_block=16), TypeError, "w2_rot_signs have dtype torch.float64; expected float32"),
    Case("fused_moe-w2-rot-block-not-dividing", "fused_moe", lambda d: _rotated(_moe(d), w13_rot_signs=_signs(d, H), w13_rot_block=64, w2_rot_signs=_signs(d, I), w2_rot_block=64), ValueError, "w2_rot_block=64 is not supported for 32 inputs; supported: a power of two 2..1024 dividing 32"),
    Case("fused_moe-w2-rot-signs-on-cpu", "fused_moe", lambda d: _rotated(_moe(d), w2_rot_signs=_signs("cpu", I), w2_rot_block=16), ValueError, "w2_rot_signs are on cpu, x on cuda", cuda_only=True),
]

CASES_BY_ID = {c.id: c for c in CASES}
assert len(CASES_BY_ID) == len(CASES), "duplicate case ids"


# Routing ids outside the local experts: each slot with such an id contributes zero.
ROUTING_CASES = {
    "fused_moe-id-E": (torch.tensor([[E, 1], [0, E + 7], [2, 3]]), None),
    "fused_moe-id-negative": (torch.tensor([[-1, 1], [0, -5], [2, 3]]), None),
    "fused_moe-id-huge": (torch.tensor([[2**30, 1], [0, -(2**30)], [2, 3]]), None),
    "fused_moe-id-outside-map": (torch.tensor([[E + 2, 1], [0, -3], [2, 3]]), torch.arange(E + 2)),
    "fused_moe-map-outside-E": (torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.tensor([0, 1, 2, 3, E, 1000])),
}


def routing_result(case_id: str, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(fused_moe with the out-of-range ids, fused_moe with those slots' weights zeroed and ids valid)."""
    ids, expert_map = ROUTING_CASES[case_id]
    args = list(_moe(device))
    ids = ids.to(device, torch.int32)
    emap = None if expert_map is None else expert_map.to(device, torch.int32)
    local = ids.long() if emap is None else torch.where((ids >= 0) & (ids < emap.numel()), emap.long()[ids.clamp(0, emap.numel() - 1)], -1)
    outside = (local < 0) | (local >= E)
    weights = args[2]
    got = torch.ops.kbit.fused_moe(args[0], ids, weights, *args[3:9], emap, False)
    valid_ids = torch.where(outside, 0, ids).to(torch.int32)
    want = torch.ops.kbit.fused_moe(args[0], valid_ids, torch.where(outside, 0.0, weights), *args[3:9], emap, False)
    return got, want


def run_case(case: Case, device: str, check_op: bool = False) -> str | None:
    """Runs one case; None when it raised as expected, else what went wrong."""
    args = case.build(device)
    kwargs = args[-1] if args and isinstance(args[-1], dict) else {}  # keyword-only arguments (_rotated)
    args = args[:-1] if kwargs else args
    op = getattr(torch.ops.kbit, f"_check_{case.op}" if check_op else case.op)
    try:
        op(*args, **kwargs)
    except case.error as e:
        message = str(e)
        if "\n" in message:
            return f"raised a message of several lines: {message!r}"
        if not re.search(case.match, message):
            return f"raised {type(e).__name__}({message!r}), expected a match of {case.match!r}"
        return None
    except Exception as e:  # noqa: BLE001  (a wrong exception type is a failure to report)
        return f"raised {type(e).__name__}: {str(e)[:500]!r}, expected {case.error.__name__} matching {case.match!r}"
    return f"did not raise; expected {case.error.__name__} matching {case.match!r}"


def run_routing_case(case_id: str, device: str) -> str | None:
    got, want = routing_result(case_id, device)
    if not torch.isfinite(got).all():
        return "non-finite output"
    if not torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2):
        return f"output differs from the call without those slots: max |diff| {(got.float() - want.float()).abs().max().item()}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", help="case ids (default: every case for the device)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--check-op", action="store_true", help="call kbit::_check_<op> instead of the op")
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args(argv)
    import vllm_kbit.moe  # noqa: F401  (registers kbit::fused_moe)
    from vllm_kbit import ops

    on_cuda = args.device.startswith("cuda")
    if on_cuda and not ops.HAS_CUDA_KERNELS:
        print("the CUDA extension (vllm_kbit/_C*.so) is not loaded: nothing of it to test", file=sys.stderr)
        return 2
    if not ops.HAS_CPU_KERNELS:
        print("the CPU extension (vllm_kbit/_cpu*.so, with the argument checks) is not loaded", file=sys.stderr)
        return 2
    ids = args.cases or [
        c.id for c in CASES if (on_cuda or not c.cuda_only) and (c.cpp_check or not args.check_op)
    ] + ([] if args.check_op else list(ROUTING_CASES))
    if args.list:
        print("\n".join(ids))
        return 0
    failed = 0
    for case_id in ids:
        if case_id in ROUTING_CASES:
            problem = run_routing_case(case_id, args.device)
        else:
            problem = run_case(CASES_BY_ID[case_id], args.device, args.check_op)
        if on_cuda:
            torch.cuda.synchronize()
        print(f"{case_id}: {'ok' if problem is None else 'FAILED: ' + problem}", flush=True)
        failed += problem is not None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
