"""Programmatic dependent launch (VLLM_KBIT_PDL, csrc/common/launch_utils.cuh) changes no output bit.

With PDL each kbit kernel may start while the previous one runs and waits (griddepcontrol.wait) before
it touches memory an earlier kernel writes; a wait in the wrong place reads stale or unwritten data. A
chain of dependent ops -- dense linear (GEMV at M <= 2, MMA above) -> MoE layer (grouped GEMV or
grouped MMA path) -> dense linear -> MoE layer, each reading the previous op's output -- runs eagerly on
a NaN-poisoned allocator cache and as one captured CUDA graph replayed on fresh inputs with NaN-filled
outputs, once in a process with VLLM_KBIT_PDL=1 and once with VLLM_KBIT_PDL=0; every output must be bitwise equal.

Run as a script (`python tests/gpu/test_pdl.py OUT.pt`), this file is the worker of one process.
"""

import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from child_env import child_env  # noqa: E402

# (tokens, MoE path: 1 = routed grouped GEMV, 3 = grouped MMA, 4 = direct GEMV, k of the experts). T = 1
# and 2 run the dense GEMV, 4..64 the dense MMA. The direct GEMV's down stage and both grouped MMAs
# request their first weight tiles before the PDL wait (their experts come from inputs written two
# launches back), so they are here at every k they are built for.
CASES = [(1, 1, 4), (1, 1, 5), (2, 1, 2), (1, 4, 4), (1, 4, 5), (2, 4, 2), (2, 4, 3), (4, 3, 4), (4, 3, 5),
         (16, 3, 3), (16, 3, 2), (64, 3, 4), (64, 3, 5), (64, 1, 4)]
E, TOP_K, H, I = 64, 8, 1024, 512
REPLAYS = 3


def _worker(out_path):
    import vllm_kbit
    from vllm_kbit.linear import KbitLinearWeight, kbit_linear

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_moe_cuda import Experts, poison_cache, random_routing

    gen = torch.Generator().manual_seed(0)
    dense = [
        KbitLinearWeight.from_kbit(vllm_kbit.quantize((0.05 * torch.randn(H, H, generator=gen)).to(torch.bfloat16).cuda(), k))
        for k in (3, 5)
    ]
    bias = (0.1 * torch.randn(H, generator=gen)).to(torch.bfloat16).cuda()
    experts = {k: Experts(E, H, I, k, gen) for k in sorted({c[2] for c in CASES})}
    results = {"pdl": torch.tensor(torch.ops.kbit._pdl_enabled())}

    def chain(x, ids, w, ids2, w2, ex, path):
        a = kbit_linear(x, dense[0], bias)
        m = torch.ops.kbit._fused_moe_cuda(a, ids, w, *ex.args(), ex.I, None, False, path)
        b = kbit_linear(m, dense[1])
        return a, m, b, torch.ops.kbit._fused_moe_cuda(b, ids2, w2, *ex.args(), ex.I, None, False, path)

    def inputs(T):
        x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
        return (x, *random_routing(T, E, TOP_K, gen, "random"), *random_routing(T, E, TOP_K, gen, "few"))

    for T, path, k in CASES:
        ex = experts[k]
        name = f"T{T}_path{path}_k{k}"
        args = inputs(T)
        poison_cache()
        for i, o in enumerate(chain(*args, ex, path)):
            results[f"{name}_eager_{i}"] = o.cpu()
        static = inputs(T)
        chain(*static, ex, path)  # warm-up: lazy per-kernel setup happens outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = chain(*static, ex, path)
        for r in range(REPLAYS):
            for s, v in zip(static, inputs(T)):
                s.copy_(v)
            for o in outs:
                o.fill_(float("nan"))
            graph.replay()
            for i, o in enumerate(outs):
                results[f"{name}_graph{r}_{i}"] = o.cpu()
    torch.cuda.synchronize()
    torch.save(results, out_path)


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _run(pdl, out_path):
    env = child_env(VLLM_KBIT_PDL=pdl)
    run = subprocess.run([sys.executable, os.path.abspath(__file__), str(out_path)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, f"VLLM_KBIT_PDL={pdl} worker failed: {(run.stdout + run.stderr)[-4000:]}"
    return torch.load(out_path)


def test_pdl_outputs_equal_no_pdl(tmp_path):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90+")
    on, off = _run("1", tmp_path / "on.pt"), _run("0", tmp_path / "off.pt")
    assert on.pop("pdl").item() and not off.pop("pdl").item(), "VLLM_KBIT_PDL did not switch PDL on and off"
    assert on.keys() == off.keys()
    for key in on:
        assert torch.isfinite(on[key]).all(), f"{key}: NaN/Inf with PDL (an element read or left unwritten)"
        assert torch.equal(on[key], off[key]), f"{key}: PDL changes {(on[key] != off[key]).sum().item()} elements"


def test_pdl_switch_refuses_other_values():
    run = subprocess.run([sys.executable, "-c", "import torch, vllm_kbit; torch.ops.kbit._pdl_enabled()"],
                         env=child_env(VLLM_KBIT_PDL="yes"), capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "VLLM_KBIT_PDL=yes is not supported" in run.stderr, run.stderr[-2000:]


if __name__ == "__main__":
    _worker(sys.argv[1])
