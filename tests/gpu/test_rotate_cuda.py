"""kbit::hadamard_rotate on CUDA (x · diag(s) · blockdiag(H_b / sqrt(b)), the input rotation of rotated layers) against
a float64 reference built from an explicit Sylvester Hadamard matrix, and against the PyTorch reference the
CPU path runs. Outputs are poisoned with NaN before each call so an unwritten element shows up."""

import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [pytest.mark.gpu, requires_cuda]

import vllm_kbit  # noqa: E402,F401  (registers torch.ops.kbit)


def _sylvester(b: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _reference(x: torch.Tensor, signs: torch.Tensor, b: int) -> torch.Tensor:
    K = x.shape[-1]
    R = signs.double().cpu()[:, None] * torch.block_diag(*[_sylvester(b) / b**0.5] * (K // b))
    return (x.double().cpu().reshape(-1, K) @ R).reshape(x.shape)


def _poison_cache(nbytes: int) -> None:
    """Leaves a freed block of 0xFF bytes (NaN in every float dtype) for the next output to land in."""
    torch.full((nbytes + 4096,), 0xFF, dtype=torch.uint8, device="cuda")


def _signs(K, gen):
    return (torch.randint(0, 2, (K,), generator=gen) * 2 - 1).float().cuda()


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 8e-3), (torch.float16, 1e-3), (torch.float32, 1e-6)])
@pytest.mark.parametrize("b", [2, 8, 16, 32, 64, 128, 256, 512, 1024])
@pytest.mark.parametrize("M", [1, 3, 64, 257])
def test_rotate_matches_float64_reference(M, b, dtype, tol):
    gen = torch.Generator().manual_seed(M * 7919 + b)
    K = 2 * b if b >= 512 else max(3 * b, 96)  # several blocks per row, a multiple of 32, not a power of two
    x = torch.randn(M, K, generator=gen).to(dtype).cuda()
    s = _signs(K, gen)
    _poison_cache(M * K * x.element_size())
    out = torch.ops.kbit.hadamard_rotate(x, s, b)
    torch.cuda.synchronize()
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.isfinite(out).all(), "unwritten (NaN) outputs"
    ref = _reference(x, s, b)
    err = (out.double().cpu() - ref).norm() / ref.norm()
    assert err < tol, f"relative error {err:.3g}"


def test_rotate_round_trip_and_strided_rows():
    """R is orthogonal: rotating by R then by Rᵀ = H · diag(s) (H is symmetric) gives x back; rows of a strided view
    (x[:, :K] of a wider tensor) are read at their stride."""
    gen = torch.Generator().manual_seed(3)
    K, b = 2048, 1024
    wide = torch.randn(33, K + 64, generator=gen).cuda()
    x = wide[:, :K]
    s = _signs(K, gen)
    y = torch.ops.kbit.hadamard_rotate(x, s, b)
    back = torch.ops.kbit.hadamard_rotate(y, s, b, inverse=True)
    assert torch.allclose(back, x, atol=1e-5, rtol=0)
    by_hand = torch.ops.kbit.hadamard_rotate(y, torch.ones_like(s), b) * s  # x Rᵀ = (x H) diag(s)
    assert torch.allclose(by_hand, back, atol=1e-6, rtol=0)


@pytest.mark.parametrize("inverse", [False, True])
def test_rotate_matches_cpu_reference_and_graph_replay(inverse):
    gen = torch.Generator().manual_seed(5)
    K, b = 768, 256
    x = torch.randn(16, K, generator=gen).to(torch.bfloat16)
    s = _signs(K, gen)
    cpu = torch.ops.kbit.hadamard_rotate(x, s.cpu(), b, inverse)
    xg = x.cuda()
    eager = torch.ops.kbit.hadamard_rotate(xg, s, b, inverse)
    # both round once from float32 to bf16; the sums differ only in order
    assert torch.allclose(eager.float().cpu(), cpu.float(), atol=1e-2, rtol=1e-2)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = torch.ops.kbit.hadamard_rotate(xg, s, b, inverse)
    xg.copy_(torch.randn(16, K, generator=gen).to(torch.bfloat16))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.ops.kbit.hadamard_rotate(xg, s, b, inverse))


def test_rotate_cuda_refusals():
    x = torch.randn(2, 48, device="cuda")
    with pytest.raises(ValueError, match="multiple of 32"):
        torch.ops.kbit.hadamard_rotate(x, torch.ones(48, device="cuda"), 16)
    x = torch.randn(2, 4096, device="cuda")
    with pytest.raises(ValueError, match="not supported on CUDA"):
        torch.ops.kbit.hadamard_rotate(x, torch.ones(4096, device="cuda"), 2048)
    with pytest.raises(ValueError, match="signs are on"):
        torch.ops.kbit.hadamard_rotate(x, torch.ones(4096), 1024)
