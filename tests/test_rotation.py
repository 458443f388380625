"""The layer input rotation (issue 61): R = diag(s) . blockdiag(H_b) on K, stored as Q(W R), fed x R."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from vllm_kbit import gptq
from vllm_kbit import ops  # noqa: F401  (registers torch.ops.kbit)
from vllm_kbit import reference as fmt
from vllm_kbit.settings import KbitSettings, Rotation


def _dense_R(K: int, block: int, seed: int) -> torch.Tensor:
    s = fmt.rotation_signs(K, seed).double()
    return torch.diag(s) @ torch.block_diag(*[fmt.hadamard_matrix(block)] * (K // block))


@pytest.mark.parametrize("K,block", [(64, 2), (96, 32), (576, 64), (1536, 512), (2048, 1024)])
def test_rotation_is_orthogonal_and_round_trips_in_fp32(K, block):
    """x R equals the dense diag(s) blockdiag(H) product; R R^T = I; x R R^T = x to fp32 rounding."""
    R = fmt.hadamard_rotate(torch.eye(K), fmt.rotation_signs(K, 7), block).double()  # I R = R
    assert torch.allclose(R, _dense_R(K, block, 7), atol=1e-6, rtol=0)
    assert (R @ R.T - torch.eye(K, dtype=torch.float64)).abs().max() < 1e-6
    x = torch.randn(5, K)
    s = fmt.rotation_signs(K, 7)
    back = fmt.hadamard_rotate(fmt.hadamard_rotate(x, s, block), s, block, inverse=True)
    assert (back - x).abs().max() <= 4 * math.log2(block) * torch.finfo(torch.float32).eps * x.abs().max()


@pytest.mark.parametrize("block", [4, 16, 64, 256])
def test_round_trip_is_bit_exact_where_every_step_is(block):
    """With 1 / sqrt(b) a power of two (b a power of 4) and small integer inputs every add and scale is exact in
    fp32, so rotate then unrotate gives x back bit for bit: the transform adds no error of its own."""
    K = 4 * block
    x = torch.randint(-100, 100, (3, K)).float()
    s = fmt.rotation_signs(K, 1)
    assert torch.equal(fmt.hadamard_rotate(fmt.hadamard_rotate(x, s, block), s, block, inverse=True), x)


def test_signs_are_a_documented_function_of_k_and_seed():
    """splitmix64's (i + 1)-th output, top bit set -> -1: pinned values (a change would silently re-rotate every
    checkpoint), the same for every call, about half negative, other seeds other signs."""
    s = fmt.rotation_signs(16, 0)
    assert s.tolist() == [1.0 if c == "+" else -1.0 for c in "-++-+++-+-+-----"]
    assert torch.equal(fmt.rotation_signs(4096, 3), fmt.rotation_signs(4096, 3))
    assert abs(fmt.rotation_signs(4096, 3).sum().item()) < 200
    assert not torch.equal(fmt.rotation_signs(4096, 3), fmt.rotation_signs(4096, 4))
    assert torch.equal(fmt.rotation_signs(64, 5), fmt.rotation_signs(128, 5)[:64])  # a prefix: shards slice it



def test_signs_match_splitmix64_written_out():
    def splitmix(seed, n):
        out, state = [], seed
        for _ in range(n):
            state = (state + 0x9E3779B97F4A7C15) % 2**64
            z = state
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
            out.append(z ^ (z >> 31))
        return out

    for seed in (0, 1, 2**62 + 5):
        want = [-1.0 if z >> 63 else 1.0 for z in splitmix(seed, 100)]
        assert fmt.rotation_signs(100, seed).tolist() == want


def test_block_rule():
    big = fmt.ROTATION_MAX_BLOCK
    assert fmt.rotation_block(576, big) == 64 and fmt.rotation_block(1536, big) == 512
    assert fmt.rotation_block(2048, big) == 1024 and fmt.rotation_block(640, big) == 128
    assert fmt.rotation_block(8192, big) == fmt.ROTATION_MAX_BLOCK == 1024
    # The default cap: one GEMV k-tile.
    assert fmt.ROTATION_DEFAULT_MAX_BLOCK == 128
    assert fmt.rotation_block(2048) == 128 and fmt.rotation_block(1536) == 128 and fmt.rotation_block(576) == 64
    assert fmt.rotation_block(576, tp=8) == 8 and fmt.rotation_block(768, tp=8) == 32  # divides every shard
    assert fmt.rotation_block(576, tp=3) == 64
    for K, kw, match in [(576, {"tp": 5}, "does not divide"), (2048, {"max_block": 48}, "power of two"),
                         (96, {"tp": 32}, "no power-of-two block"), (0, {}, "positive input size"),
                         (64, {"tp": 0}, "tp=0")]:
        with pytest.raises(ValueError, match=match):
            fmt.rotation_block(K, **kw)


def test_hessian_rotation_is_that_of_rotated_inputs():
    K, b = 192, 64
    X = torch.randn(300, K)
    s = fmt.rotation_signs(K, 2)
    Xr = fmt.hadamard_rotate(X, s, b)
    want = Xr.double().T @ Xr.double()
    got = fmt.rotate_hessian(X.T @ X, s, b).double()
    assert (got - want).abs().max() < 1e-4 * want.abs().max()


def test_quantized_rotated_weight_decodes_back_to_w():
    """Q(W R) decoded and un-rotated approximates W as closely as Q(W) does (an orthogonal R keeps the error's
    energy): SQNR of both within 1.5 dB on Gaussian weights, each above the format's level at k = 4."""
    torch.manual_seed(0)
    W = torch.randn(256, 512) * 0.02
    rot = Rotation(seed=1)
    cb = fmt.default_codebook(4)

    def sqnr(W_hat):
        return 10 * math.log10(W.square().sum() / (W - W_hat).square().sum())

    Wr = rot.rotate(W)
    back = rot.rotate(fmt.dequantize(*fmt.quantize(Wr, cb, 4), cb, torch.float32), inverse=True)
    plain = fmt.dequantize(*fmt.quantize(W, cb, 4), cb, torch.float32)
    assert sqnr(back) > 18 and abs(sqnr(back) - sqnr(plain)) < 1.5
    assert not torch.equal(back, plain)


def test_gptq_with_rotation_lowers_the_output_error_on_outlier_inputs():
    """A layer whose inputs have a few outlier features and whose weights have a few outlier entries: GPTQ on the
    rotated basis spreads them over each Hadamard block and its output error on the inputs is lower than unrotated
    GPTQ's, at k = 2 and 3 (the mechanism issue 61 relies on)."""
    torch.manual_seed(0)
    N, K = 128, 256
    X = torch.randn(2048, K)
    X[:, torch.randperm(K)[:6]] *= 25  # outlier input features
    W = torch.randn(N, K) * 0.02
    W.view(-1)[torch.randperm(N * K)[:40]] *= 12  # outlier weights
    H = X.T @ X
    rot = Rotation(seed=0, max_block=64)
    for k in (2, 3):
        cb = fmt.default_codebook(k)
        errs = []
        for r in (None, rot):
            _, _, W_hat = gptq.rounded_weight(W, H, cb, k, r)
            errs.append((X @ (W_hat - W).T).square().sum().item())
        assert errs[1] < 0.8 * errs[0], (k, errs)


def test_rounded_weight_of_experts_equals_each_expert_alone():
    torch.manual_seed(1)
    W = torch.randn(3, 32, 128) * 0.02
    X = torch.randn(3, 400, 128)
    H = X.transpose(1, 2) @ X
    rot, cb = Rotation(seed=4), fmt.default_codebook(3)
    q, a, W_hat = gptq.rounded_weight(W, H, cb, 3, rot)
    for e in range(3):
        q1, a1, W1 = gptq.rounded_weight(W[e], H[e], cb, 3, rot)
        assert torch.equal(q[e], q1) and torch.equal(a[e], a1) and torch.equal(W_hat[e], W1)


def test_op_equals_the_reference_and_refuses_bad_input_in_one_line():
    x = torch.randn(2, 3, 128, dtype=torch.bfloat16)
    s = fmt.rotation_signs(128, 9)
    assert torch.equal(torch.ops.kbit.hadamard_rotate(x, s, 32), fmt.hadamard_rotate(x, s, 32))
    assert torch.equal(torch.ops.kbit.hadamard_rotate(x, s, 32, True), fmt.hadamard_rotate(x, s, 32, inverse=True))
    with torch.device("meta"):
        assert torch.ops.kbit.hadamard_rotate(torch.empty(4, 128), torch.empty(128), 64).shape == (4, 128)
    bad = [((x, s, 24), ValueError, "block=24"), ((x, s, 256), ValueError, "multiple of block=256"),
           ((x, s[:64], 32), ValueError, "signs have shape"), ((x.int(), s, 32), TypeError, "x has dtype"),
           ((x, s.half(), 32), TypeError, "signs have dtype"), ((x, s, 1), ValueError, "block=1")]
    for args, exc, match in bad:
        with pytest.raises(exc, match=match) as e:
            torch.ops.kbit.hadamard_rotate(*args)
        assert "\n" not in str(e.value)


def test_settings_round_trip_and_refuse_bad_rotation():
    s = KbitSettings(bits=3, rotation={"seed": 5, "max_block": 256})
    d = s.to_dict()
    assert d["rotation"] == {"method": "hadamard", "seed": 5, "max_block": 256, "tp": 1}
    assert KbitSettings.from_dict(d).rotation == s.rotation and KbitSettings(bits=3).rotation is None
    assert "rotation" not in KbitSettings(bits=3).to_dict()  # checkpoints without it: as before
    rec = s.rotation.recorded([576, 1536])
    assert rec.to_dict()["blocks"] == {"576": 64, "1536": 256} and rec.block(576) == 64
    assert Rotation.from_dict({"seed": 0, "blocks": {"576": 32}}).block(576) == 32  # recorded wins over the rule
    for bad, match in [({"seed": -1}, "seed=-1"), ({"max_block": 100}, "block 100"), ({"tp": 0}, "tp=0"),
                       ({"method": "random"}, "method='random'"), ({"bogus": 1}, "unknown rotation keys"),
                       ({"blocks": {"576": 48}}, "blocks\\['576'\\]=48"), ({"blocks": {"x": 64}}, "blocks key 'x'"),
                       ({"blocks": [1]}, "blocks must be a dict"), ({"seed": "0"}, "seed='0'")]:
        with pytest.raises(ValueError, match=match) as e:
            KbitSettings.from_dict({"quant_method": "kbit", "bits": 3, "rotation": bad})
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="rotation must be a dict"):
        KbitSettings.from_dict({"quant_method": "kbit", "rotation": 3})


def test_a_rotated_config_is_read_where_it_is_served():
    """The vLLM plugin reads the same settings the converter wrote: the rotation with its blocks."""
    config = {"quant_method": "kbit", "bits": 3, "prequantized": True,
              "rotation": {"method": "hadamard", "seed": 0, "max_block": 1024, "tp": 2, "blocks": {"576": 32}}}
    got = KbitSettings.from_dict(config).rotation
    # Converted at the earlier default cap (1024): its recorded cap holds for sizes the blocks do not list.
    assert got == Rotation(seed=0, max_block=1024, tp=2, blocks={576: 32}) and got.block(576) == 32
    assert got.block(2048) == 1024 and Rotation(seed=0, tp=2).block(2048) == 128


def test_convert_writes_rotated_weights_and_the_rotation_it_used(tmp_path):
    """Round to nearest with rotation: each qweight is Q(W R) of its checkpoint weight, and config.json records the
    rotation with the block of every input size; the settings read it back. --gptq with rotation: the same layout
    and record, and the first layer's q_proj output on calibration text closer to bf16's than unrotated --gptq's."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_kbit.convert import convert
    from kbit_dev import tiny_models

    src = tiny_models.build("qwen3", str(tmp_path / "src"), hidden=128, layers=1)
    rot = Rotation(seed=3, max_block=64)
    rtn_dir = str(tmp_path / "rtn")
    convert(src, rtn_dir, KbitSettings(bits=3, rotation=rot), progress=False)
    config = json.load(open(f"{rtn_dir}/config.json"))["quantization_config"]
    got = KbitSettings.from_dict(config)
    orig = load_file(f"{src}/model.safetensors")
    packed = load_file(f"{rtn_dir}/model-00001-of-00001.safetensors")
    Ks = sorted({orig[n[: -len('.qweight')] + '.weight'].shape[1] for n in packed if n.endswith(".qweight")})
    assert config["rotation"]["blocks"] == {str(K): min(64, K & -K) for K in Ks} and got.rotation.seed == 3
    cb = got.codebook(3)
    p = "model.layers.0.mlp.down_proj"
    want = torch.ops.kbit.quantize(got.rotation.rotate(orig[f"{p}.weight"].float()), cb, 3)
    assert torch.equal(packed[f"{p}.qweight"], want[0]) and torch.equal(packed[f"{p}.absmax"], want[1])

    text = gptq.calibration_text()[:20000]
    dirs = {}
    for name, r in (("plain", None), ("rot", rot)):
        dirs[name] = str(tmp_path / name)
        convert(src, dirs[name], KbitSettings(bits=2, rotation=r), progress=False, gptq=True, calibration_text=text)
    cfg = json.load(open(f"{dirs['rot']}/config.json"))["quantization_config"]
    assert cfg["rotation"]["seed"] == 3 and "rotation" not in json.load(open(f"{dirs['plain']}/config.json"))["quantization_config"]
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(src)(text, return_tensors="pt").input_ids[:, :512]
    captured = {}
    layer = model.model.layers[0]
    h = layer.self_attn.q_proj.register_forward_pre_hook(lambda m, a: captured.setdefault("x", a[0]))
    with torch.no_grad():
        model.model(input_ids=ids)
    h.remove()
    x, W = captured["x"][0], layer.self_attn.q_proj.weight
    q = "model.layers.0.self_attn.q_proj"
    errs = {}
    for name in dirs:
        t = load_file(f"{dirs[name]}/model-00001-of-00001.safetensors")
        D = fmt.dequantize(t[f"{q}.qweight"], t[f"{q}.absmax"], fmt.default_codebook(2), torch.float32)
        if name == "rot":
            D = rot.rotate(D, inverse=True)
        errs[name] = (x @ (D - W).T).square().sum().item()
    assert errs["rot"] < errs["plain"], errs


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "vllm_kbit.cli", "convert", *args], capture_output=True, text=True)


@pytest.mark.parametrize("flags,match", [
    (["--rotation-seed", "1"], "--rotation-seed needs --rotate"),
    (["--no-rotate", "--rotation-block", "64"], "--rotation-block needs --rotate"),
    (["--rotate", "--rotation-block", "48"], "rotation block 48 is not supported"),
    (["--rotate", "--rotation-tp", "0"], "rotation tp=0 is not supported"),
    (["--rotate", "--rotation-seed", "-2"], "rotation seed=-2 is not supported"),
    (["--damp", "0.1"], "--damp needs --gptq"),
    (["--no-act-order"], "--no-act-order needs --gptq"),
    (["--gptq", "--damp", "-1"], "--damp -1.0 is not supported"),
    (["--refine-passes", "2"], "--refine-passes needs --gptq"),
    (["--gptq", "--refine-passes", "17"], "--refine-passes 17 is not supported; it must be 0 to 16"),
    (["--gptq", "--refine-passes", "-1"], "--refine-passes -1 is not supported"),
    (["--asymmetric", "0.5"], "--asymmetric needs --gptq"),
    (["--gptq", "--asymmetric", "1.5"], "--asymmetric 1.5 is not supported; it must be 0 to 1"),
    (["--gptq", "--asymmetric", "nan"], "--asymmetric nan is not supported"),
    (["--codebook", "nf9"], "codebook must be"),
])
def test_cli_refuses_bad_rotation_flags_in_one_line(tmp_path, flags, match):
    proc = _cli(str(tmp_path / "in"), str(tmp_path / "out"), *flags)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert match in err and "\n" not in err and "Traceback" not in err


def test_cli_refuses_a_tp_that_leaves_no_block(tmp_path):
    from kbit_dev import tiny_models

    src = tiny_models.build("qwen3", str(tmp_path / "src"), hidden=128, layers=1)
    proc = _cli(src, str(tmp_path / "out"), "--rotate", "--rotation-tp", "3", "--quiet")
    assert proc.returncode == 2 and "does not divide the input size" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_opcheck_hadamard_rotate():
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    s = fmt.rotation_signs(256, 1)
    for args in ((x, s, 64), (x, s, 256, True), (x.float(), s, 2)):
        torch.library.opcheck(torch.ops.kbit.hadamard_rotate.default, args)


def test_convert_gptq_rotates_by_default_now_that_rotated_checkpoints_serve():
    """docs/decisions.md ("Rotation with --gptq"): measured better with GPTQ, so --gptq rotates unless --no-rotate;
    round to nearest stays unrotated unless --rotate."""
    from vllm_kbit import cli

    assert gptq.DEFAULT_ROTATE is gptq.ROTATE_WITH_GPTQ is True and cli.DEFAULT_RTN_ROTATE is False
    proc = subprocess.run([sys.executable, "-m", "vllm_kbit.cli", "convert", "--help"], capture_output=True, text=True)
    assert "default: on with --gptq, off without" in " ".join(proc.stdout.split())
