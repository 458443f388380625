"""kbit::_moe_stage_gate_up / _moe_stage_down (the routed experts in two ops, slot order: what vLLM's LoRA on experts
runs, through vllm_kbit.moe.fused_moe_stages) on every MoE path forced, bf16 and fp16, with and without an expert map,
rotated and not: each slot's gate_up output, SiLU-and-mul output and weighted down output against the dequantized
experts (one float32 matmul per expert over its slots); down reads the h13 it is given (a caller's additions count);
outputs land in freed NaN memory and come back finite; the sum over slots is the fused op's result."""

from __future__ import annotations

import pytest
import torch

import vllm_kbit
from vllm_kbit import ops
from vllm_kbit import reference as fmt
from vllm_kbit.moe import kbit_fused_moe, stack_runtime

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not ops.HAS_CUDA_KERNELS, reason="the CUDA extension is not built"),
]

E, H, I, TOP_K, K_BITS = 8, 256, 128, 4, 4
# Tokens per forced path: the GEMV paths at decode sizes, the grouped ones with several chunks per expert.
TOKENS = {"gemv_direct": 3, "gemv": 9, "grouped_mma": 40, "grouped_wgmma": 200}


def _poison(nbytes: int) -> None:
    """A freed block of NaNs in the caching allocator, for the ops' outputs to land in."""
    torch.full((nbytes // 2 + 4096,), float("nan"), dtype=torch.float16, device="cuda")


def _problem(T: int, dtype: torch.dtype, expert_map: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    w13 = [vllm_kbit.quantize((torch.randn(2 * I, H, generator=g) * 0.05).to(dtype), K_BITS) for _ in range(E)]
    w2 = [vllm_kbit.quantize((torch.randn(H, I, generator=g) * 0.05).to(dtype), K_BITS) for _ in range(E)]
    q13, a13 = stack_runtime([(w.qweight, w.absmax) for w in w13])
    q2, a2 = stack_runtime([(w.qweight, w.absmax) for w in w2])
    n_global = 2 * E if expert_map else E
    emap = None
    if expert_map:  # this rank holds the odd global experts
        emap = torch.full((n_global,), -1, dtype=torch.int32)
        emap[1::2] = torch.arange(E, dtype=torch.int32)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(n_global, generator=g)[:TOP_K] for _ in range(T)]).to(torch.int32)
    weights = torch.softmax(torch.randn(T, TOP_K, generator=g), -1)
    return w13, w2, (q13, a13, q2, a2), w13[0].codebook, emap, x, ids, weights


def _local(ids: torch.Tensor, emap: torch.Tensor | None) -> list[int]:
    return [int(i) if emap is None else int(emap[i]) for i in ids.reshape(-1)]


@pytest.mark.parametrize("rotated", [False, True], ids=["plain", "rotated"])
@pytest.mark.parametrize("expert_map", [False, True], ids=["all-local", "expert-map"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("path", list(TOKENS))
def test_stage_ops_match_the_dequantized_experts(path, dtype, expert_map, rotated):
    if path == "grouped_wgmma" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("grouped_wgmma needs a Hopper GPU")
    T = TOKENS[path]
    w13, w2, packed, cb, emap, x, ids, weights = _problem(T, dtype, expert_map, seed=T + 7 * expert_map + 3 * rotated)
    rot, r13, r2 = {}, (lambda a: a), (lambda a: a)
    if rotated:
        s13, s2 = fmt.rotation_signs(H, seed=11), fmt.rotation_signs(I, seed=12)
        rot = dict(w13_rot_signs=s13.cuda(), w13_rot_block=64, w2_rot_signs=s2.cuda(), w2_rot_block=128)
        r13 = lambda a: torch.ops.kbit.hadamard_rotate(a, s13, 64)  # noqa: E731
        r2 = lambda a: torch.ops.kbit.hadamard_rotate(a, s2, 128)  # noqa: E731
    cuda = [t.cuda() for t in (x, ids, weights, *packed, cb)]
    xc, idc, wc, q13, a13, q2, a2, cbc = cuda
    args = (xc, idc, wc, q13, a13, q2, a2, cbc, I, None if emap is None else emap.cuda(), False)
    pid = torch.ops.kbit._moe_path_id(path)
    S = T * TOP_K

    _poison(S * 2 * I * 8)
    h13 = torch.ops.kbit._moe_stage_gate_up(*args, pid, **rot)
    assert h13.shape == (S, 2 * I) and h13.dtype == dtype and torch.isfinite(h13).all()
    local = torch.tensor(_local(ids, emap))
    xr = r13(x).float()
    token = torch.arange(S) // TOP_K
    # One float32 matmul per expert over its slots, each expert dequantized once: a per-slot loop in the
    # activations' dtype was CPU-bound for minutes under 12 xdist workers.
    slots_of = {e: (local == e).nonzero().flatten() for e in range(E) if bool((local == e).any())}
    d13 = {e: w13[e].dequantize(dtype).float() for e in slots_of}
    d2 = {e: w2[e].dequantize(dtype).float() for e in slots_of}
    want13 = torch.zeros(S, 2 * I)
    for e, slots in slots_of.items():
        want13[slots] = xr[token[slots]] @ d13[e].T
    torch.testing.assert_close(h13.float().cpu(), want13, atol=2e-2, rtol=2e-2)

    # A caller's addition to h13 (as LoRA's) reaches act and y.
    h13 += 0.25 * torch.randn_like(h13)
    given = h13.float().cpu()
    _poison(S * (H + I) * 8)
    act, y = torch.ops.kbit._moe_stage_down(*args, h13, pid, **rot)
    assert act.shape == (S, I) and y.shape == (S, H) and act.dtype == y.dtype == dtype
    assert torch.isfinite(act).all() and torch.isfinite(y).all()
    want_act = torch.nn.functional.silu(given[:, :I]) * given[:, I:]
    torch.testing.assert_close(act.float().cpu(), want_act, atol=2e-2, rtol=2e-2)
    act_r = r2(act.cpu()).float()
    want_y = torch.zeros(S, H)
    for e, slots in slots_of.items():
        want_y[slots] = (act_r[slots] @ d2[e].T) * weights.reshape(-1)[slots, None]
    torch.testing.assert_close(y.float().cpu(), want_y, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("path", list(TOKENS))
def test_stage_ops_sum_to_the_fused_op(path):
    """Without additions, the weighted down outputs summed over each token's slots are the fused op's output."""
    if path == "grouped_wgmma" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("grouped_wgmma needs a Hopper GPU")
    T = TOKENS[path]
    _, _, packed, cb, emap, x, ids, weights = _problem(T, torch.bfloat16, True, seed=5)
    args = [t.cuda() for t in (x, ids, weights, *packed, cb)]
    args = (*args[:8], I, emap.cuda(), False)
    pid = torch.ops.kbit._moe_path_id(path)
    h13 = torch.ops.kbit._moe_stage_gate_up(*args, pid)
    _, y = torch.ops.kbit._moe_stage_down(*args, h13, pid)
    want = kbit_fused_moe(*args)
    torch.testing.assert_close(y.view(T, TOP_K, H).float().sum(1), want.float(), atol=3e-2, rtol=3e-2)


def test_stage_down_refuses_a_wrong_h13_in_one_line():
    _, _, packed, cb, emap, x, ids, weights = _problem(3, torch.bfloat16, False, seed=1)
    args = [t.cuda() for t in (x, ids, weights, *packed, cb)]
    args = (*args[:8], I, None, False)
    bad = torch.zeros(3 * TOP_K, I, dtype=torch.bfloat16, device="cuda")  # [S, I] instead of [S, 2I]
    with pytest.raises(ValueError, match="h13 must be") as e:
        torch.ops.kbit._moe_stage_down(*args, bad)
    assert "\n" not in str(e.value)
