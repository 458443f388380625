"""A workload for compute-sanitizer over the GEMV and MMA kernels: every k, the dense GEMV at M = 1 .. 4
and each split count, every activation tile count p and row-group shape of the MMA kernel, dense (M = 1 .. 64,
forced and heuristic row groups, ragged N), the register-operand wgmma's narrow instance (M <= 64, every built
width), and grouped over experts (fused_moe's grouped MMA path at 1 .. 64 rows per expert, the direct GEMV at
1 and 3 tokens), plus the wgmma kernels at one M each and the grouped wgmma's two kernels (warp-specialized
through fused_moe, register-operand at every built wgmma N), and rotated inputs (the rotation kernel before a
dense and a grouped GEMM, in place on the experts' activations).
Fresh random inputs; each output is checked finite (NaN-poisoned outputs would show).

    compute-sanitizer --tool memcheck python tests/gpu/sanitizer_workload.py
    compute-sanitizer --tool racecheck python tests/gpu/sanitizer_workload.py --quick
"""

from __future__ import annotations

import argparse

import torch

import vllm_kbit  # noqa: F401  (registers torch.ops.kbit)
from vllm_kbit import reference as fmt


def random_runtime(E: int | None, N: int, K: int, k: int):
    q_shape, a_shape = fmt.runtime_shapes(N, K, k)
    lead = () if E is None else (E,)
    q = torch.randint(-(2**31), 2**31 - 1, (*lead, *q_shape), dtype=torch.int32, device="cuda")
    a = torch.randint(100, 140, (*lead, *a_shape), dtype=torch.uint8, device="cuda")
    return q, a


def path(name: str) -> int:
    """kbit::_linear_forced's id of a dense path."""
    return torch.ops.kbit._linear_path_id(name)


def check(name: str, out: torch.Tensor) -> None:
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), f"{name}: non-finite output"


def dense(k: int, quick: bool) -> None:
    cb = fmt.normal_float_codebook(k, "cuda")
    shapes = [(320, 256)] if quick else [(320, 256), (1088, 512)]  # N not a multiple of 256: ragged tiles
    for N, K in shapes:
        q, a = random_runtime(None, N, K, k)
        for M in range(1, 5):  # the GEMV (k = 2, M = 1: pair tables), heuristic and every split count
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            for splits in range(0, 3 if quick else K // 128 + 1):
                check(f"gemv k={k} M={M} N={N} S={splits}",
                      torch.ops.kbit._linear_forced(x, q, a, cb, N, K, None, path("gemv"), 0, splits))
        for M in ([1, 9, 33] if quick else [1, 3, 8, 9, 16, 17, 32, 33, 64]):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            p = torch.ops.kbit.linear_plan(M, N, K, torch.bfloat16, 9, 132, 1, "mma")[3]  # p: rows / 8 per CTA
            for r in [0, 1, 2 if p == 8 else 4]:
                out = torch.ops.kbit._linear_forced(x, q, a, cb, N, K, None, path("mma"), r, 0)
                check(f"mma k={k} M={M} N={N} r={r}", out)
        # The register-operand wgmma's narrow instance (M <= 64: every built width) and, past it, its dense one.
        for M in [24, 48] if quick else [1, 16, 17, 33, 64, 80]:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            check(f"wgmma k={k} M={M}", torch.ops.kbit._linear_forced(x, q, a, cb, N, K, None, path("wgmma")))
        if not quick:
            x = torch.randn(80, K, device="cuda", dtype=torch.bfloat16)
            check(f"wgmma_ws k={k}", torch.ops.kbit._linear_forced(x, q, a, cb, N, K, None, path("wgmma_ws")))


def grouped(k: int, quick: bool) -> None:
    E, top_k, H, I = 16, 4, 256, 192
    cb = fmt.normal_float_codebook(k, "cuda")
    q13, a13 = random_runtime(E, 2 * I, H, k)
    q2, a2 = random_runtime(E, H, I, k)
    for T in ([4, 64] if quick else [4, 16, 40, 64, 150, 256]):  # up to 64 rows per expert: p = 1 .. 8
        ids = torch.topk(torch.rand(T, E, device="cuda"), top_k, dim=1).indices.to(torch.int32)
        w = torch.softmax(torch.randn(T, top_k, device="cuda"), -1)
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        grouped_mma = torch.ops.kbit._moe_path_id("grouped_mma")
        out = torch.ops.kbit._fused_moe_cuda(x, ids, w, q13, a13, q2, a2, cb, I, None, False, grouped_mma)
        check(f"grouped mma k={k} T={T}", out)
    # The grouped wgmma (Hopper): one or two 64-row halves per chunk, and experts of several chunks.
    if torch.cuda.get_device_capability()[0] == 9:
        grouped_wgmma = torch.ops.kbit._moe_path_id("grouped_wgmma")
        for T in ([300] if quick else [40, 300, 1100]):
            ids = torch.topk(torch.rand(T, E, device="cuda"), top_k, dim=1).indices.to(torch.int32)
            w = torch.softmax(torch.randn(T, top_k, device="cuda"), -1)
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            out = torch.ops.kbit._fused_moe_cuda(x, ids, w, q13, a13, q2, a2, cb, I, None, False, grouped_wgmma)
            check(f"grouped wgmma k={k} T={T}", out)
        # Its register-operand kernel (128-row chunks): experts of 5 .. 200 rows, every built wgmma N.
        counts = torch.tensor([5, 20, 40, 70, 100, 128, 200, 0] * (E // 8))
        slot_ids = torch.repeat_interleave(torch.arange(E), counts).to(torch.int32).view(-1, 1).cuda()
        S = int(counts.sum())
        route = torch.ops.kbit._moe_route(slot_ids, None, E, 128, torch.ops.kbit._moe_max_chunks(S, E, 128))
        A = torch.randn(S, H, device="cuda", dtype=torch.bfloat16)
        rs = torch.ops.kbit._moe_kernel_id("wgmma_rs_grouped")
        out = torch.ops.kbit._moe_grouped_linear(A, route[3], route[4], q13, a13, cb, 2 * I, H, rs, 128, 0, 0)
        check(f"grouped wgmma (register operand) k={k}", out)
    # The direct GEMV: one token (its automatic path), and several tokens forced (the combine counters).
    gemv_direct = torch.ops.kbit._moe_path_id("gemv_direct")
    for T in (1, 3):
        ids = torch.topk(torch.rand(T, E, device="cuda"), top_k, dim=1).indices.to(torch.int32)
        w = torch.softmax(torch.randn(T, top_k, device="cuda"), -1)
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        out = torch.ops.kbit._fused_moe_cuda(x, ids, w, q13, a13, q2, a2, cb, I, None, False, gemv_direct)
        check(f"gemv direct k={k} T={T}", out)


def rotated(k: int) -> None:
    """Rotated inputs: the dense GEMV and the routed GEMVs rotating as they load (the plan's rotation "fused", blocks
    256 across two k-tiles and 64), the rotation into a scratch before a dense MMA ("separate"), and before the
    experts' gate_up plus in place on the SiLU-and-mul output before down (grouped MMA and mm)."""
    cb = fmt.normal_float_codebook(k, "cuda")
    N, K = 320, 256
    q, a = random_runtime(None, N, K, k)
    signs = fmt.rotation_signs(K, 0, "cuda")
    for M in (1, 33):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        check(f"rotated linear k={k} M={M}",
              torch.ops.kbit.linear(x, q, a, cb, N, K, None, rot_signs=signs, rot_block=256))
    E, top_k, H, I = 16, 4, 256, 192
    q13, a13 = random_runtime(E, 2 * I, H, k)
    q2, a2 = random_runtime(E, H, I, k)
    rot = dict(w13_rot_signs=fmt.rotation_signs(H, 0, "cuda"), w13_rot_block=256,
               w2_rot_signs=fmt.rotation_signs(I, 0, "cuda"), w2_rot_block=64)
    for T, name in ((1, "gemv_direct"), (3, "gemv"), (3, "auto"), (40, "grouped_mma"), (150, "grouped_mm")):
        ids = torch.topk(torch.rand(T, E, device="cuda"), top_k, dim=1).indices.to(torch.int32)
        w = torch.softmax(torch.randn(T, top_k, device="cuda"), -1)
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        out = torch.ops.kbit._fused_moe_cuda(x, ids, w, q13, a13, q2, a2, cb, I, None, False,
                                             torch.ops.kbit._moe_path_id(name), **rot)
        check(f"rotated fused_moe {name} k={k} T={T}", out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few shapes per kernel (racecheck is slow)")
    ap.add_argument("--bits", default="2,3,4,5")
    args = ap.parse_args()
    torch.manual_seed(0)
    for k in (int(b) for b in args.bits.split(",")):
        dense(k, args.quick)
        grouped(k, args.quick)
        rotated(k)
    print("sanitizer workload done")


if __name__ == "__main__":
    main()
