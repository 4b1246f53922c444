"""CPU tests of our Triton FlashAttention-2 (kernels/) under the Triton interpreter.

Interpreter choice. Classic Triton decides "interpret or compile" for @triton.jit functions when they
are decorated, i.e. at import time -- including Triton's own standard library (tl.sum, tl.max, ...),
which is built when `triton` is imported. So on a machine without CUDA this module sets
TRITON_INTERPRET=1 *before* importing triton/kernels. On a CUDA machine it does not: importing triton
in interpreter mode would make the GPU tests of the same pytest process uncompilable. Our package is
robust to either order anyway: it reads TRITON_INTERPRET at call time, builds its kernels lazily per
mode, and avoids calling Triton's standard-library JIT functions from interpreted code. The variable
is restored right after the imports (other test modules see the user's setting) and an autouse
fixture sets it for every test here.

Reference: float64 PyTorch attention with an explicit softmax and a bottom-right causal mask,
gradients by autograd in float64. Inputs: fresh torch.randn per test, seeded by a per-test random
seed that every assertion message shows. float32 is checked tightly, float16 loosely. numpy (the
interpreter) has no bfloat16, so under the interpreter kernels/ computes bf16 inputs in float32; the
real bf16 tensor-core path is tested on the GPU (tests/kernels/test_flash_gpu.py).
"""

import os

import torch

_PREVIOUS_INTERPRET = os.environ.get("TRITON_INTERPRET")
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before importing triton / kernels (see docstring)

import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import triton  # noqa: E402, F401

import kernels  # noqa: E402
from kernels import (  # noqa: E402
    FlashAttentionUnavailableError,
    TileConfig,
    _launch,  # noqa: E402
    check_flash_available,
    flash_attention,
    get_tile_config,
    override_tile_config,
)
from kernels import flash_attn as fa  # noqa: E402
from kernels import plan as kplan  # noqa: E402
from kernels.reference import attention_reference  # noqa: E402

if _PREVIOUS_INTERPRET is None:
    os.environ.pop("TRITON_INTERPRET", None)
else:
    os.environ["TRITON_INTERPRET"] = _PREVIOUS_INTERPRET

REPO = Path(__file__).resolve().parents[2]
# the Triton interpreter triggers a numpy deprecation warning on every scalar conversion
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # max|ours - ref| / max(max|ref|, 1)


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


# ------------------------------------------------------------------------------------- helpers


def reference(q, k, v, causal, scale, **variants):
    """float64 attention (`kernels.reference.attention_reference`: explicit boolean mask, bottom-right causal,
    rows without any visible key give o = 0 and lse = -inf). Differentiable."""
    return attention_reference(q, k, v, causal=causal, softmax_scale=scale, **variants)


def rel_err(ours, ref):
    ours, ref = ours.double(), ref.double()
    return ((ours - ref).abs().max() / ref.abs().max().clamp_min(1.0)).item()


def make_inputs(seed, B, Hq, Hkv, Nq, Nk, d, dtype):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, d, generator=g).to(dtype)
    k = torch.randn(B, Hkv, Nk, d, generator=g).to(dtype)
    v = torch.randn(B, Hkv, Nk, d, generator=g).to(dtype)
    do = torch.randn(B, Hq, Nq, d, generator=g).to(dtype)
    return q, k, v, do


def run_flash(q, k, v, do, causal, scale=None):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o, lse = flash_attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
    o.backward(do)
    return o.detach(), lse.detach(), q.grad, k.grad, v.grad


def run_reference(q, k, v, do, causal, scale):
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    o, lse = reference(q, k, v, causal, scale)
    o.backward(do.double())
    return o.detach(), lse.detach(), q.grad, k.grad, v.grad


def assert_bitwise_equal(seed, first, second, what, names=("o", "lse", "dq", "dk", "dv")):
    """Two runs' (o, lse, dq, dk, dv) must be identical bit for bit."""
    for name, a, b in zip(names, first, second, strict=True):
        assert torch.equal(a, b), f"seed={seed} {what}: {name} differs"


def check_against_reference(seed, ours, ref, dtype, what):
    o, lse, dq, dk, dv = ours
    o_r, lse_r, dq_r, dk_r, dv_r = ref
    tol = TOL[dtype]
    msg = f"seed={seed} {what}"
    assert o.dtype == dtype and lse.dtype == torch.float32, msg
    for name, t in (("o", o), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert not torch.isnan(t).any(), f"{msg}: NaN in {name}"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_r)), f"{msg}: lse -inf rows differ"
    fin = torch.isfinite(lse_r)
    if fin.any():
        lse_err = (lse.double()[fin] - lse_r[fin]).abs().max().item()
        assert lse_err <= 4 * tol * max(1.0, lse_r[fin].abs().max().item()), f"{msg}: lse err {lse_err:.3g}"
    for name, a, b in (("o", o, o_r), ("dq", dq, dq_r), ("dk", dk, dk_r), ("dv", dv, dv_r)):
        err = rel_err(a, b)
        assert err <= tol, f"{msg}: {name} rel err {err:.3g} > {tol}"


# ------------------------------------------------------------------------- numerical coverage

# (B, Hq, Hkv, Nq, Nk, d, causal, dtype): a covering set, not the cross product.
F32, F16 = torch.float32, torch.float16
CASES = [
    (1, 2, 2, 1, 1, 16, True, F32),  # single token
    (2, 2, 2, 17, 17, 40, True, F32),  # odd N, non-pow2 d
    (1, 2, 2, 64, 64, 64, False, F32),  # exact multiple of the blocks
    (1, 2, 2, 100, 100, 16, True, F32),
    (1, 1, 1, 129, 129, 128, True, F32),  # one past a block boundary, d=128
    (1, 2, 2, 129, 129, 40, False, F32),
    (1, 2, 2, 17, 100, 40, True, F32),  # Nq < Nk (bottom-right causal)
    (1, 2, 2, 1, 64, 16, True, F32),  # decode-like: one query, many keys
    (1, 2, 2, 33, 129, 64, False, F32),
    (1, 2, 2, 100, 17, 16, True, F32),  # Nq > Nk: 83 rows see no key
    (1, 2, 2, 129, 64, 64, False, F32),
    (1, 2, 2, 64, 1, 16, True, F32),  # only the last query row sees the one key
    (2, 4, 1, 64, 64, 64, True, F32),  # MQA
    (1, 4, 2, 100, 100, 40, True, F32),  # GQA
    (1, 4, 2, 17, 64, 16, True, F32),  # GQA, Nq < Nk
    (1, 4, 1, 100, 33, 16, True, F32),  # MQA, Nq > Nk
    (1, 2, 2, 33, 33, 8, True, F32),  # smallest d
    (1, 1, 1, 33, 33, 256, True, F32),  # largest d
    (1, 2, 2, 50, 50, 96, False, F32),
    (2, 2, 2, 100, 100, 64, True, F16),
    (1, 4, 2, 129, 129, 128, True, F16),
    (1, 2, 2, 17, 64, 40, False, F16),
    (1, 2, 1, 100, 17, 16, True, F16),
]


@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,d,causal,dtype", CASES)
def test_matches_float64_reference(seed, B, Hq, Hkv, Nq, Nk, d, causal, dtype):
    q, k, v, do = make_inputs(seed, B, Hq, Hkv, Nq, Nk, d, dtype)
    scale = 1.0 / math.sqrt(d)
    ours = run_flash(q, k, v, do, causal)
    ref = run_reference(q, k, v, do, causal, scale)
    check_against_reference(seed, ours, ref, dtype, f"case={(B, Hq, Hkv, Nq, Nk, d, causal, dtype)}")


def test_bfloat16_under_interpreter(seed):
    """bf16 inputs give bf16 outputs/gradients; under the interpreter they are computed in float32."""
    q, k, v, do = make_inputs(seed, 1, 4, 2, 50, 70, 32, torch.bfloat16)
    ours = run_flash(q, k, v, do, True)
    assert all(t.dtype == torch.bfloat16 for t in (ours[0], *ours[2:]))
    ref = run_reference(q, k, v, do, True, 1.0 / math.sqrt(32))
    check_against_reference(seed, ours, ref, torch.bfloat16, "bf16 (interpreter)")


def test_custom_softmax_scale(seed):
    q, k, v, do = make_inputs(seed, 1, 2, 2, 40, 40, 32, F32)
    ours = run_flash(q, k, v, do, True, scale=0.37)
    ref = run_reference(q, k, v, do, True, 0.37)
    check_against_reference(seed, ours, ref, F32, "softmax_scale=0.37")


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (4, 2)])
def test_strided_fused_qkv_no_copy(seed, monkeypatch, dtype, Hq, Hkv):
    """q, k, v sliced from one fused (B, N, Hq + 2 Hkv, d) projection and transposed to (B, H, N, d):
    the kernels read them through their strides (no .contiguous() copy); x.grad matches float64."""
    B, N, d = 2, 70, 24
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, N, Hq + 2 * Hkv, d, generator=g).to(dtype)
    do = torch.randn(B, Hq, N, d, generator=g).to(dtype)

    def split(t):
        return (
            t[:, :, :Hq].transpose(1, 2),
            t[:, :, Hq : Hq + Hkv].transpose(1, 2),
            t[:, :, Hq + Hkv :].transpose(1, 2),
        )

    copies = []
    real = _launch.unit_last_stride

    def spy(t):
        out = real(t)
        copies.append(out is not t)
        return out

    monkeypatch.setattr(_launch, "unit_last_stride", spy)
    monkeypatch.setattr(fa, "unit_last_stride", spy)
    xf = x.detach().clone().requires_grad_()
    q, k, v = split(xf)
    assert not q.is_contiguous() and not k.is_contiguous()
    o, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    o.backward(do)
    assert copies and not any(copies), f"seed={seed}: an input was copied"

    xr = x.detach().double().requires_grad_()
    o_r, lse_r = reference(*split(xr), True, 1.0 / math.sqrt(d))
    o_r.backward(do.double())
    tol = TOL[dtype]
    for name, a, b in (("o", o, o_r), ("lse", lse, lse_r), ("dx", xf.grad, xr.grad)):
        err = rel_err(a, b)
        assert err <= tol, f"seed={seed} {name} rel err {err:.3g}"


def test_non_unit_last_stride_is_copied(seed):
    """A head dim with stride != 1 (e.g. every other column) is made contiguous, results unchanged."""
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(1, 2, 30, 64, generator=g)
    q, k, v = big[..., ::2], big.flip(2)[..., ::2], big[..., 1::2]
    assert q.stride(-1) == 2
    o = flash_attention(q, k, v, causal=False)
    o_r, _ = reference(q, k, v, False, 1.0 / math.sqrt(32))
    assert rel_err(o, o_r) <= TOL[F32], f"seed={seed}"


@pytest.mark.parametrize("dim", [0, 1])
def test_expanded_inputs(seed, dim):
    """Expanded (stride-0) batch or head dims, e.g. one query broadcast over heads: o and the gradients of
    the unexpanded leaves match float64. o once came back with a stride-2 head dim (the layout put the
    stride-0 dim innermost) that the kernels write as unit stride: a silent wrong o."""
    g = torch.Generator().manual_seed(seed)
    shape, one = [2, 2, 37, 16], [2, 2, 37, 16]
    one[dim] = 1
    leaves = [torch.randn(one, generator=g).requires_grad_() for _ in range(3)]
    do = torch.randn(shape, generator=g)
    q, k, v = (t.expand(shape) for t in leaves)
    assert q.stride(dim) == 0
    o = flash_attention(q, k, v, causal=True)
    o.backward(do)
    ref = [t.detach().double().requires_grad_() for t in leaves]
    o_r, _ = reference(*(t.expand(shape) for t in ref), True, None)
    o_r.backward(do.double())
    assert o.stride(-1) == 1 and rel_err(o, o_r) <= TOL[F32], f"seed={seed} dim={dim}: o"
    for name, t, r in zip("qkv", leaves, ref, strict=True):
        assert rel_err(t.grad, r.grad) <= TOL[F32], f"seed={seed} dim={dim}: d{name}"


def test_lse_gradient(seed):
    """return_lse=True: a loss that uses lse backpropagates through it (dS gets P * dlse)."""
    q, k, v, do = make_inputs(seed, 1, 4, 2, 40, 50, 16, F32)
    dlse = torch.randn(1, 4, 40, generator=torch.Generator().manual_seed(seed + 1))
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    o, lse = flash_attention(qa, ka, va, causal=True, return_lse=True)
    ((o * do).sum() + (lse * dlse).sum()).backward()
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    o_r, lse_r = reference(qr, kr, vr, True, 0.25)
    ((o_r * do.double()).sum() + (lse_r * dlse.double()).sum()).backward()
    for name, a, b in (("dq", qa.grad, qr.grad), ("dk", ka.grad, kr.grad), ("dv", va.grad, vr.grad)):
        err = rel_err(a, b)
        assert err <= TOL[F32], f"seed={seed} {name} rel err {err:.3g}"


def test_rows_without_keys_are_zero(seed):
    """Causal with Nq > Nk: the first Nq - Nk rows see no key -> o = 0, lse = -inf, zero gradients."""
    Nq, Nk = 50, 20
    q, k, v, do = make_inputs(seed, 1, 2, 2, Nq, Nk, 16, F32)
    o, lse, dq, dk, dv = run_flash(q, k, v, do, True)
    empty = Nq - Nk
    assert torch.all(o[:, :, :empty] == 0), f"seed={seed}"
    assert torch.all(torch.isneginf(lse[:, :, :empty])), f"seed={seed}"
    assert torch.isfinite(lse[:, :, empty:]).all(), f"seed={seed}"
    assert torch.all(dq[:, :, :empty] == 0), f"seed={seed}"
    for t in (o, dq, dk, dv):
        assert torch.isfinite(t).all(), f"seed={seed}"


def test_backward_is_deterministic(seed):
    """No atomics: two backward passes give bitwise-identical gradients; deterministic=True (which only
    changes the choice on sm_90, where the one-pass Gluon backward exists) gives the same bits."""
    q, k, v, do = make_inputs(seed, 1, 4, 2, 70, 70, 32, F32)
    first = run_flash(q, k, v, do, True)[2:]
    second = run_flash(q, k, v, do, True)[2:]
    for name, a, b in zip(("dq", "dk", "dv"), first, second, strict=True):
        assert torch.equal(a, b), f"seed={seed}: {name} differs between runs"
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    flash_attention(qs, ks, vs, causal=True, deterministic=True).backward(do)
    for name, a, b in zip(("dq", "dk", "dv"), (qs.grad, ks.grad, vs.grad), first, strict=True):
        assert torch.equal(a, b), f"seed={seed}: {name} differs with deterministic=True"


@pytest.mark.parametrize(
    "configs",
    [
        dict(
            fwd=TileConfig(16, 16, 4, 1), bwd_dkdv=TileConfig(16, 16, 4, 1), bwd_dq=TileConfig(16, 16, 4, 1)
        ),
        dict(
            fwd=TileConfig(16, 64, 4, 1), bwd_dkdv=TileConfig(64, 16, 4, 1), bwd_dq=TileConfig(16, 32, 4, 1)
        ),
        dict(
            fwd=TileConfig(128, 128, 4, 1),
            bwd_dkdv=TileConfig(128, 128, 4, 1),
            bwd_dq=TileConfig(128, 128, 4, 1),
        ),
    ],
    ids=["all16", "mixed", "all128"],
)
@pytest.mark.parametrize("Nq,Nk", [(45, 77), (77, 45), (33, 31)])
def test_tile_configs_agree(seed, configs, Nq, Nk):
    """Tile sizes change only rounding: compare against the float64 reference under several tilings
    (blocks smaller than, mixed with, and larger than the sequence), causal with GQA and Nq != Nk both
    ways (Nq > Nk: leading rows see no key), so the first masked block falls at many positions of the
    one-loop kernels (mask applied from the diagonal block on)."""
    q, k, v, do = make_inputs(seed, 1, 4, 2, Nq, Nk, 24, F32)
    with override_tile_config(**configs):
        ours = run_flash(q, k, v, do, True)
    ref = run_reference(q, k, v, do, True, 1.0 / math.sqrt(24))
    check_against_reference(seed, ours, ref, F32, f"tiles={configs}")


def test_tile_config_values():
    """Every GPU/interpreter config: power-of-two blocks >= 16 (tl.dot minimum), sane warps/stages."""
    for interp in (False, True):
        for kernel in ("fwd", "bwd_dkdv", "bwd_dq"):
            for d in (8, 40, 64, 80, 128, 256):
                for dtype in (torch.float16, torch.bfloat16, torch.float32):
                    for n in (1, 17, 1024, 16384):
                        cfg = get_tile_config(kernel, d, dtype, True, n, n, interpret=interp)
                        for blk in (cfg.block_m, cfg.block_n):
                            assert blk >= 16 and blk & (blk - 1) == 0, (kernel, d, dtype, n, cfg)
                        assert cfg.num_warps in (1, 2, 4, 8, 16) and cfg.num_stages >= 1, cfg
    with pytest.raises(ValueError, match="unknown kernel"):
        get_tile_config("bwd", 64, torch.float16, True, 16, 16)
    with pytest.raises(ValueError, match="powers of two"):
        with override_tile_config(fwd=TileConfig(24, 16, 4, 1)):
            pass


# ------------------------------------------------------------------------------------- errors


def _t(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


def _qkv(q=(1, 1, 4, 16), k=(1, 1, 4, 16), v=(1, 1, 4, 16)):
    return lambda: (_t(*q), _t(*k), _t(*v))


ERROR_CASES = [
    (
        "not a tensor",
        lambda: (1.0, _t(1, 1, 4, 16), _t(1, 1, 4, 16)),
        {},
        TypeError,
        "q must be a torch.Tensor",
    ),
    ("rank", _qkv(q=(1, 4, 16)), {}, ValueError, "q must be 4-D"),
    ("rank v", _qkv(v=(1, 1, 1, 4, 16)), {}, ValueError, "v must be 4-D"),
    (
        "dtype",
        lambda: (_t(1, 1, 4, 16, dtype=torch.float64),) * 3,
        {},
        TypeError,
        "float16, bfloat16 and float32",
    ),
    ("int dtype", lambda: (torch.ones(1, 1, 4, 16, dtype=torch.int32),) * 3, {}, TypeError, "q has dtype"),
    (
        "dtype mismatch",
        lambda: (_t(1, 1, 4, 16), _t(1, 1, 4, 16, dtype=torch.float16), _t(1, 1, 4, 16)),
        {},
        TypeError,
        "same dtype",
    ),
    ("batch", _qkv(q=(2, 1, 4, 16)), {}, ValueError, "batch size mismatch"),
    ("head dim", _qkv(k=(1, 1, 4, 32), v=(1, 1, 4, 32)), {}, ValueError, "head dim mismatch"),
    ("Nk", _qkv(v=(1, 1, 5, 16)), {}, ValueError, "same sequence length"),
    ("Hkv", _qkv(q=(1, 2, 4, 16), k=(1, 2, 4, 16)), {}, ValueError, "same number of heads"),
    ("GQA", _qkv(q=(1, 3, 4, 16), k=(1, 2, 4, 16), v=(1, 2, 4, 16)), {}, ValueError, "multiple of"),
    (
        "d small",
        _qkv((1, 1, 4, 4), (1, 1, 4, 4), (1, 1, 4, 4)),
        {},
        ValueError,
        r"outside the supported range \[8, 256\]",
    ),
    (
        "d large",
        _qkv((1, 1, 2, 264), (1, 1, 2, 264), (1, 1, 2, 264)),
        {},
        ValueError,
        r"outside the supported range \[8, 256\]",
    ),
    ("Nq zero", _qkv(q=(1, 1, 0, 16)), {}, ValueError, "must be >= 1"),
    ("Nk zero", _qkv(k=(1, 1, 0, 16), v=(1, 1, 0, 16)), {}, ValueError, "must be >= 1"),
    ("B zero", _qkv((0, 1, 4, 16), (0, 1, 4, 16), (0, 1, 4, 16)), {}, ValueError, "empty batch or head"),
    ("causal", _qkv(), {"causal": 1}, TypeError, "causal must be a bool"),
    ("deterministic", _qkv(), {"deterministic": "yes"}, TypeError, "deterministic must be a bool"),
    ("scale type", _qkv(), {"softmax_scale": "0.1"}, TypeError, "softmax_scale"),
    ("scale nan", _qkv(), {"softmax_scale": float("nan")}, ValueError, "finite"),
    (
        "device",
        lambda: (_t(1, 1, 4, 16), _t(1, 1, 4, 16).to("meta"), _t(1, 1, 4, 16)),
        {},
        ValueError,
        "same device",
    ),
]


@pytest.mark.parametrize("name,make,kwargs,exc,match", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_errors(monkeypatch, name, make, kwargs, exc, match):
    launched = []
    monkeypatch.setattr(_launch, "kernel_module", lambda *a: launched.append(a))
    with pytest.raises(exc, match=match):
        flash_attention(*make(), **kwargs)
    assert not launched, "a kernel was launched before validation failed"


def test_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = _t(1, 1, 4, 16)
    with pytest.raises(FlashAttentionUnavailableError) as info:
        flash_attention(q, q, q)
    msg = str(info.value)
    assert "CUDA GPU" in msg and "TRITON_INTERPRET=1" in msg and "sdpa" in msg
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, ValueError)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        check_flash_available("cpu")
    with pytest.raises(RuntimeError, match="sdpa"):
        check_flash_available(torch.device("meta"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert check_flash_available("cpu") is None


def _run_python(code: str, env_interpret):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if env_interpret is not None:
        env["TRITON_INTERPRET"] = env_interpret
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )


def test_interpreter_chosen_at_call_time():
    """Worst import order: triton and kernels imported *before* TRITON_INTERPRET=1 is set (fresh
    process). Our kernels still run under the interpreter and match SDPA."""
    code = (
        "import os, torch, triton, triton.language, kernels\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "q = torch.randn(1, 2, 20, 16, requires_grad=True)\n"
        "o = kernels.flash_attention(q, q, q, causal=True)\n"
        "o.sum().backward()\n"
        "r = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)\n"
        "assert (o - r).abs().max() < 1e-5, (o - r).abs().max()\n"
        "assert torch.isfinite(q.grad).all()\n"
        "print('ok')\n"
    )
    out = _run_python(code, None)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


def test_compiled_mode_after_interpreter_import_is_a_clear_error():
    """triton imported with TRITON_INTERPRET=1, then unset: compiled kernels cannot be built in that
    process; we say so (FlashAttentionUnavailableError) instead of failing inside Triton."""
    code = (
        "import os, triton, triton.language\n"
        "del os.environ['TRITON_INTERPRET']\n"
        "from kernels import _launch\n"
        "try:\n"
        "    _launch.kernel_module(False)\n"
        "except _launch.FlashAttentionUnavailableError as err:\n"
        "    assert 'TRITON_INTERPRET' in str(err), err\n"
        "    print('ok')\n"
    )
    out = _run_python(code, "1")
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


def _compile_for_sm90(body: str) -> None:
    """Run `body` (Python source with `compile_kernel` imported) in a subprocess that compiles for sm_90
    with Triton's bundled ptxas (compiled mode needs triton imported without TRITON_INTERPRET); skip when
    ptxas is missing, fail unless the script ends by printing 'ok'."""
    code = (
        "import os, sys, torch, triton\n"
        "if not os.path.exists(triton.knobs.nvidia.ptxas.path): print('SKIP no ptxas'); sys.exit(0)\n"
        "from kernels.compile_report import compile_kernel\n" + body + "print('ok')\n"
    )
    out = _run_python(code, None)
    if "SKIP" in out.stdout:
        pytest.skip("Triton's NVIDIA backend (ptxas) is not available")
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]


def test_gpu_kernels_compile_for_sm90():
    """The compiled (non-interpreter) path: compile every kernel for sm_90 (no GPU needed) -- catches
    code that the interpreter accepts but the compiler rejects, and checks the default Hopper tiles fit
    shared memory. bf16 d=80 (padded head dim) with a runtime GQA group, causal; fp32 (IEEE dots)."""
    _compile_for_sm90(
        "for kernel in ('fwd', 'bwd_dkdv', 'bwd_dq'):\n"
        "    info = compile_kernel(kernel, torch.bfloat16, 80, gqa=True)\n"
        "    assert info.shared_bytes <= 227 * 1024, info.line()\n"
        "    assert not info.wgmma_serialized, info.line()\n"
        "    print(info.line())\n"
        "print(compile_kernel('fwd', torch.float32, 64, causal=False).line())\n"
        "for kernel in ('bwd_dkdv', 'bwd_dq'):  # device-side tensor descriptors (TMA)\n"
        "    info = compile_kernel(kernel, torch.bfloat16, 64, tma=True, even=True)\n"
        "    assert info.uses_tma and info.spill_store_bytes == 0, info.line()\n"
        "    print(info.line())\n"
        "for kernel in ('fwd', 'bwd_dkdv', 'bwd_dq'):  # as Inductor compiles them (fp64 scalars, debug)\n"
        "    for d in (64, 128):\n"
        "        print(compile_kernel(kernel, torch.bfloat16, d, even=True, inductor=True).line())\n"
    )


def test_default_hopper_tiles_keep_wgmma_asynchronous():
    """Performance guard without a GPU: with the default bf16 tiles (d = 64, 128; sequence lengths
    multiples of the blocks or not) every kernel uses wgmma and ptxas does not serialise it (warning
    C7515: a wait after every wgmma). Two pipelined loops carrying an accumulator did that to the forward
    and dK/dV kernels (bench/NOTES.md v5), so a kernel edit that brings it back fails here."""
    _compile_for_sm90(
        "for d in (64, 128):\n"
        "    for even in (False, True):\n"
        "        for kernel in ('fwd', 'bwd_dkdv', 'bwd_dq'):\n"
        "            info = compile_kernel(kernel, torch.bfloat16, d, even=even)\n"
        "            print(info.line(), 'even' if even else 'ragged')\n"
        "            assert info.uses_wgmma and not info.wgmma_serialized, info.line()\n"
    )


def test_matches_sdpa_causal_lower_right(seed):
    """Independent check of the mask convention: PyTorch SDPA with causal_lower_right (Nq < Nk)."""
    from torch.nn.attention.bias import causal_lower_right

    q, k, v, _ = make_inputs(seed, 2, 2, 2, 23, 61, 32, F32)
    o = flash_attention(q, k, v, causal=True)
    r = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=causal_lower_right(23, 61)
    )
    assert rel_err(o, r) <= TOL[F32], f"seed={seed}"


@pytest.mark.parametrize("dtype", [F32, F16])
def test_strided_equals_contiguous_bitwise(seed, dtype):
    """Reading through strides changes nothing: bitwise-identical o and gradients vs contiguous copies."""
    B, N, H, d = 1, 45, 2, 40
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, N, 3, H, d, generator=g).to(dtype)
    do = torch.randn(B, H, N, d, generator=g).to(dtype)
    results = []
    for contiguous in (False, True):
        xx = x.clone().requires_grad_()
        q, k, v = (xx[:, :, i].transpose(1, 2) for i in range(3))
        if contiguous:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        o = flash_attention(q, k, v, causal=True)
        o.backward(do)
        results.append((o.detach(), xx.grad))
    assert torch.equal(results[0][0], results[1][0]), f"seed={seed}"
    assert torch.equal(results[0][1], results[1][1]), f"seed={seed}"


def _dim_order(t):
    return sorted(range(t.dim()), key=lambda i: -t.stride(i))


def test_outputs_and_grads_keep_the_input_layout(seed):
    """Fused-qkv views (B, N, H, d memory): o and dq, dk, dv come back dense in that same dim order
    (so the model's o.transpose(1, 2).reshape and the backward's cat into d(qkv) need no transposing
    copy), in eager mode and through the op's fake implementation; contiguous inputs stay contiguous."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    B, N, H, d = 2, 40, 3, 16
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, N, 3, H, d, generator=g).requires_grad_()
    q, k, v = (x[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, N, d) views, strides (., d, 3Hd, 1)
    o = flash_attention(q, k, v, causal=True)
    assert o.transpose(1, 2).is_contiguous() and _dim_order(o) == [0, 2, 1, 3], f"seed={seed} {o.stride()}"
    grads = torch.ops.flashgpt.flash_attn_bwd_cpu(
        torch.randn_like(o), q.detach(), k.detach(), v.detach(), o.detach(), torch.zeros(B, H, N), True, 0.25
    )
    for gr in grads:
        assert gr.transpose(1, 2).is_contiguous(), f"seed={seed} {gr.stride()}"
    real = [t.detach() for t in (q, k, v)]
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in real)
        fo, flse = torch.ops.flashgpt.flash_attn_fwd_cpu(fq, fk, fv, True, 0.25)
        fgrads = torch.ops.flashgpt.flash_attn_bwd_cpu(fo, fq, fk, fv, fo, flse, True, 0.25)
    assert fo.stride() == o.stride(), f"fake o strides {fo.stride()} != real {o.stride()}"
    assert [t.stride() for t in fgrads] == [t.stride() for t in grads]
    c = torch.randn(B, H, N, d, generator=g)
    assert flash_attention(c, c, c).is_contiguous()


# ------------------------------------------------------------------------ custom ops / compile


def test_custom_ops_opcheck(seed):
    """torch.library.opcheck: schema, fake (meta) kernels and autograd registration are consistent
    (the CPU ops here; the CUDA triton ops in tests/kernels/test_flash_gpu.py)."""
    q, k, v, do = make_inputs(seed, 1, 2, 1, 20, 24, 16, F32)
    q.requires_grad_()
    k.requires_grad_()
    v.requires_grad_()
    torch.library.opcheck(torch.ops.flashgpt.flash_attn_fwd_cpu.default, (q, k, v, True, 0.25))
    o, lse = torch.ops.flashgpt.flash_attn_fwd_cpu(q.detach(), k.detach(), v.detach(), True, 0.25)
    torch.library.opcheck(
        torch.ops.flashgpt.flash_attn_bwd_cpu.default,
        (do, q.detach(), k.detach(), v.detach(), o, lse, True, 0.25),
    )


def test_custom_op_fake_strides_with_k_and_v_laid_out_apart(seed):
    """The kernels take one set of strides for k and v, so the launcher copies both when their layouts differ;
    the backward's fake kernel must give the gradients the layout that copy gives them (opcheck compares the
    fake's strides with the real ones; Inductor asserts them), and the gradients stay exact."""
    q, k, v, do = make_inputs(seed, 1, 2, 2, 16, 16, 16, F32)
    v = v.transpose(1, 2).contiguous().transpose(1, 2)  # (B, N, H, d) memory, k contiguous
    o, lse = torch.ops.flashgpt.flash_attn_fwd_cpu(q, k, v, True, 0.25)
    torch.library.opcheck(torch.ops.flashgpt.flash_attn_bwd_cpu.default, (do, q, k, v, o, lse, True, 0.25))
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    f = torch.compile(lambda q, k, v: flash_attention(q, k, v, softmax_scale=0.25), fullgraph=True)
    torch._dynamo.reset()
    grads = torch.autograd.grad(f(qa, ka, va), (qa, ka, va), do)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref, _ = attention_reference(qd, kd, vd, causal=True, softmax_scale=0.25)
    want = torch.autograd.grad(ref, (qd, kd, vd), do.double())
    for name, g, w in zip(("dq", "dk", "dv"), grads, want, strict=True):
        assert (g.double() - w).abs().max() < 1e-4, f"seed={seed}: {name}"


def test_torch_compile_fullgraph(seed):
    """torch.compile(fullgraph=True) traces through flash_attention (custom op, no graph break)."""
    q, k, v, do = make_inputs(seed, 1, 4, 2, 24, 24, 16, F32)

    def f(q, k, v):
        return flash_attention(q, k, v, causal=True) * 2.0

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    out = compiled(qa, ka, va)
    out.backward(do)
    qb, kb, vb = (t.clone().requires_grad_() for t in (q, k, v))
    ref = f(qb, kb, vb)
    ref.backward(do)
    assert torch.equal(out, ref), f"seed={seed}"
    for a, b in ((qa, qb), (ka, kb), (va, vb)):
        assert torch.equal(a.grad, b.grad), f"seed={seed}"


def test_eager_path_equals_custom_op_bitwise(seed):
    """flash_attention in eager mode (autograd.Function) and the custom op give bitwise-identical o, lse
    and gradients, including a gradient flowing into lse (GQA, causal, Nq != Nk)."""
    q, k, v, do = make_inputs(seed, 1, 4, 2, 33, 40, 16, F32)
    dlse = torch.randn(1, 4, 33, generator=torch.Generator().manual_seed(seed + 1))
    results = []
    for use_op in (False, True):
        qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
        if use_op:
            o, lse = torch.ops.flashgpt.flash_attn_fwd_cpu(qa, ka, va, True, 0.25)
        else:
            o, lse = flash_attention(qa, ka, va, causal=True, softmax_scale=0.25, return_lse=True)
        torch.autograd.backward((o, lse), (do, dlse))
        results.append((o.detach(), lse.detach(), qa.grad, ka.grad, va.grad))
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), *results, strict=True):
        assert torch.equal(a, b), f"seed={seed}: {name} differs between the eager path and the custom op"


@pytest.mark.parametrize("form", ["penalty_backward", "autograd_grad", "wgan_gp"])
def test_double_backward_raises(seed, form):
    """The kernels' gradients are not themselves differentiable: every form of gradient penalty must
    raise, never silently drop the penalty's term (both paths: eager Function and custom op)."""
    q, k, v, _ = make_inputs(seed, 1, 2, 2, 16, 16, 16, F32)
    for use_op in (False, True):
        qa = q.clone().requires_grad_()
        if use_op:
            o = torch.ops.flashgpt.flash_attn_fwd_cpu(qa, k, v, True, 0.25)[0]
        else:
            o = flash_attention(qa, k, v, causal=True, softmax_scale=0.25)
        with pytest.raises(RuntimeError, match="no autograd formula|does not require grad"):
            if form == "penalty_backward":  # grad of o.sum(): the incoming gradient needs no grad itself
                (gq,) = torch.autograd.grad(o.sum(), qa, create_graph=True)
                (o.square().sum() + gq.square().sum()).backward()
            elif form == "autograd_grad":
                (gq,) = torch.autograd.grad(o.square().sum(), qa, create_graph=True)
                torch.autograd.grad(o.sum() + gq.square().sum(), qa)
            else:
                (gq,) = torch.autograd.grad(o, qa, grad_outputs=torch.ones_like(o), create_graph=True)
                (o.square().mean() + ((gq.flatten(1).norm(dim=1) - 1) ** 2).mean()).backward()


def test_fake_tensors_vmap_and_make_fx_use_the_custom_op(seed):
    """Outside plain eager mode flash_attention takes the custom op, which these tools understand:
    FakeTensorMode (fake impl, no kernel), make_fx (traced as one node), vmap (per-sample fallback)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode():
        fq, fk, fv = (torch.empty(1, 4, 24, 16) for _ in range(3))
        assert flash_attention(fq, fk, fv).shape == (1, 4, 24, 16)
    q, k, v, _ = make_inputs(seed, 1, 2, 1, 16, 16, 16, F32)
    gm = make_fx(lambda q, k, v: flash_attention(q, k, v))(q, k, v)
    assert any("flashgpt.flash_attn_fwd_cpu" in str(n.target) for n in gm.graph.nodes)
    qs = torch.stack([q, -q])
    batched = torch.func.vmap(lambda x: flash_attention(x, k, v))(qs)
    for i in range(2):
        assert torch.equal(batched[i], flash_attention(qs[i], k, v)), f"seed={seed} sample {i}"


def test_compiled_graph_calls_the_custom_op(seed):
    """Under torch.compile, flash_attention is traced as the custom op (one node, no graph break)."""
    q, k, v, _ = make_inputs(seed, 1, 2, 2, 16, 16, 16, F32)
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(lambda q, k, v: flash_attention(q, k, v), fullgraph=True, backend=backend)(q, k, v)
    assert any("flashgpt.flash_attn_fwd_cpu" in t for t in seen), seen
    assert torch.equal(out, flash_attention(q, k, v)), f"seed={seed}"


def test_public_api_exports():
    assert callable(kernels.flash_attention) and callable(kernels.check_flash_available)
    for name in ("flash_attn_fwd", "flash_attn_bwd", "flash_attn_fwd_cpu", "flash_attn_bwd_cpu"):
        assert hasattr(torch.ops.flashgpt, name), name


def _qkv_layout(seed, layout, B, Hq, Hkv, Nq, Nk, d, dtype):
    """q, k, v, dO in one of the layouts `plan.tma_operand` addresses: "bhnd" (contiguous heads) or "fused"
    ((B, N, H, d) memory of a fused qkv projection viewed as (B, H, N, d), Nq == Nk)."""
    q, k, v, do = make_inputs(seed, B, Hq, Hkv, Nq, Nk, d, dtype)
    if layout == "fused":
        qkv = torch.cat([t.transpose(1, 2).reshape(B, Nq, -1) for t in (q, k, v)], dim=2)
        q, k, v = (x.view(B, Nq, -1, d).transpose(1, 2) for x in qkv.split([Hq * d, Hkv * d, Hkv * d], 2))
    return q, k, v, do


@pytest.mark.parametrize(
    "layout,Nq,Nk,causal",
    [("bhnd", 48, 80, True), ("bhnd", 80, 48, True), ("fused", 64, 64, True), ("fused", 32, 32, False)],
)
def test_tma_backward_equals_pointer_loads_bitwise(seed, monkeypatch, layout, Nq, Nk, causal):
    """The tensor-descriptor (TMA) loads of the backward move the same tiles as the pointer loads, so
    the gradients are bitwise identical; rows past the sequence end (another head's data through the
    descriptor) must not leak in. GQA (Hq=4, Hkv=2), Nq != Nk, both layouts the trainer and the
    benchmark use; and the TMA path must really be taken (spy on `plan.tma_operand`)."""
    q, k, v, do = _qkv_layout(seed, layout, 2, 4, 2, Nq, Nk, 32, F16)
    taken = []
    real = kplan.tma_operand
    monkeypatch.setattr(kplan, "tma_operand", lambda *a: taken.append(real(*a)) or taken[-1])
    with override_tile_config(tma=True):
        tma = run_flash(q, k, v, do, causal)
    assert len(taken) == 4 and all(t is not None for t in taken), "TMA path not taken"
    with override_tile_config(tma=False):
        ptr = run_flash(q, k, v, do, causal)
    assert_bitwise_equal(seed, tma, ptr, f"{layout}: TMA vs pointer loads")
    if layout == "fused":
        # run_flash clones its inputs (packed per tensor); also the views themselves, where q, k and v
        # share the rows of one qkv buffer, with the gradient landing in that buffer
        base = q._base.detach()
        grads = []
        for force in (True, False):
            qkv = base.clone().requires_grad_()
            views = (x.view(2, Nq, -1, 32).transpose(1, 2) for x in qkv.split([4 * 32, 2 * 32, 2 * 32], 2))
            before = len(taken)
            with override_tile_config(tma=force):
                flash_attention(*views, causal=causal).backward(do)
            if force:
                assert len(taken) == before + 4 and None not in taken[before:], "TMA not taken"
            grads.append(qkv.grad)
        assert torch.equal(grads[0], grads[1]), f"seed={seed}: shared-row qkv grad differs"
    ref = run_reference(q, k, v, do, causal, 1.0 / math.sqrt(32))
    check_against_reference(seed, tma, ref, F16, f"tma {layout}")


def test_tma_operand_refuses_what_it_cannot_address():
    """Layouts and dtypes a 2-D descriptor cannot address fall back to pointer loads (None), and the
    row/column map of the two supported layouts addresses the right elements."""
    t = torch.randn(2, 3, 40, 32, dtype=F16)
    rows, cols, rb, rh, ch = kplan.tma_operand(t, 32)
    assert (rows, cols, rb, rh, ch) == (2 * 3 * 40, 32, 3 * 40, 40, 0)
    fused = torch.randn(2, 40, 3 * 3 * 32, dtype=F16)[..., : 3 * 32].view(2, 40, 3, 32).transpose(1, 2)
    rows, cols, rb, rh, ch = kplan.tma_operand(fused, 32)
    assert (rows, cols, rb, rh, ch) == (2 * 40, 3 * 32, 40, 0, 32)
    for x in (t, fused):  # element (b, h, n, :) sits at descriptor row b*rb + h*rh + n, column h*ch
        rows, cols, rb, rh, ch = kplan.tma_operand(x, 32)
        flat = x.as_strided((rows, cols), (x.stride(2), 1))  # what the kernel's descriptor spans
        for b, h, n in ((1, 2, 7), (0, 1, 39), (1, 0, 0)):
            assert torch.equal(flat[b * rb + h * rh + n, h * ch : h * ch + 32], x[b, h, n])
    assert kplan.tma_operand(t.float(), 32) is None  # not a 16-bit dtype
    assert kplan.tma_operand(t[..., :24], 32) is None  # d != BLOCK_D (padded head dim)
    assert kplan.tma_operand(t.transpose(0, 1), 32) is None  # heads outermost: no 2-D map
    odd = torch.randn(2 * 3 * 40 * 32 + 1, dtype=F16)[1:].view(2, 3, 40, 32)
    assert kplan.tma_operand(odd, 32) is None  # first element not 16-byte aligned


def test_tma_default_and_override(seed, monkeypatch):
    """TileConfig.tma picks TMA per backward kernel; override_tile_config(tma=...) forces both kernels
    on or off (and validates its argument)."""
    q, k, v, do = make_inputs(seed, 1, 2, 2, 48, 48, 32, F16)
    taken = []
    real = kplan.tma_operand
    monkeypatch.setattr(kplan, "tma_operand", lambda t, bd: taken.append(t.shape[2]) or real(t, bd))
    with override_tile_config(
        bwd_dkdv=TileConfig(16, 32, 4, 1, tma=False), bwd_dq=TileConfig(32, 16, 4, 1, tma=True)
    ):
        run_flash(q, k, v, do, True)
        assert len(taken) == 2  # only the dQ kernel's k and v
        taken.clear()
        with override_tile_config(tma=False):
            run_flash(q, k, v, do, True)
            assert taken == []
            with override_tile_config(tma=True):
                run_flash(q, k, v, do, True)
                assert len(taken) == 4
    with pytest.raises(ValueError, match="tma"):
        with override_tile_config(tma=1):
            pass


@pytest.mark.parametrize("N", [45, 48])
def test_no_tma_alternative_tile(seed, monkeypatch, N):
    """A tma=True tile with a `no_tma` alternative runs as is when TMA is taken (N a multiple of the
    block) and is replaced by the alternative when it is not (N = 45, or TMA forced off, or the fused
    backward); the results match the float64 reference either way."""
    q, k, v, do = make_inputs(seed, 1, 2, 2, N, N, 32, F16)
    launched = []
    real = kplan.plan_bwd

    def spy(*args):  # the tiles the backward launches: its plan's (dQ, then dK/dV)
        p = real(*args)
        for name, c in zip(("bwd_dq", "bwd_dkdv"), p.tiles, strict=True):
            launched.append((name, c.block_m, c.block_n))
        return p

    monkeypatch.setattr(kplan, "plan_bwd", spy)
    ref = run_reference(q, k, v, do, True, 32**-0.5)
    tile = TileConfig(16, 32, 4, 1, tma=True, no_tma=TileConfig(32, 16, 4, 1))
    dq_tile = TileConfig(32, 16, 4, 1, tma=True, no_tma=TileConfig(16, 16, 4, 1))
    for forced, expect in ((None, (16, 32) if N % 16 == 0 else (32, 16)), (False, (32, 16))):
        launched.clear()
        with override_tile_config(bwd_dkdv=tile, bwd_dq=dq_tile, tma=forced):
            out = run_flash(q, k, v, do, True)
        dkdv = [blk for name, *blk in launched if name == "bwd_dkdv"]
        assert dkdv == [list(expect)], f"N={N} tma={forced}: launched {launched}"
        # dQ tile: BLOCK_N = 16 rows of k/v, TMA when Nk % 16 == 0 unless forced off
        dq = [blk for name, *blk in launched if name == "bwd_dq"]
        dq_expect = (32, 16) if (N % 16 == 0 and forced is None) else (16, 16)
        assert dq == [list(dq_expect)], f"N={N} tma={forced}: dQ launched {launched}"
        for name, a, r in zip(("o", "lse", "dq", "dk", "dv"), out, ref, strict=True):
            assert rel_err(a, r) <= TOL[F16], f"seed={seed} N={N} {name}"


@pytest.mark.parametrize("N", [45, 48])
@pytest.mark.parametrize(
    "layout,which",
    [("bhnd", "q"), ("bhnd", "k"), ("bhnd", "v"), ("bhnd", "do"), ("fused", "k"), ("fused", "do")],
)
def test_tma_rows_past_the_end_do_not_leak_non_finite_values(seed, monkeypatch, layout, which, N):
    """Through a descriptor, rows past N would be the next head's (contiguous heads) or the next batch
    element's (fused qkv) data, and 0 * inf in the dots would carry a NaN/inf there into this head. So TMA
    is used only when N is a multiple of the block (N = 48: taken; N = 45: pointer loads even when forced):
    with TMA forced on, head 0 / batch 0 stays finite and bitwise equal to the pointer loads."""
    B, H, d = 2, 2, 32
    q, k, v, do = _qkv_layout(seed, layout, B, H, H, N, N, d, F16)
    poisoned = dict(q=q, k=k, v=v, do=do)[which]
    with torch.no_grad():
        if layout == "bhnd":
            poisoned[:, 1] = float("nan")
            poisoned[:, 1, 3] = float("inf")
        else:
            poisoned[1] = float("nan")
    keep = (slice(None), 0) if layout == "bhnd" else (0,)
    taken = []
    real = kplan.tma_operand
    monkeypatch.setattr(kplan, "tma_operand", lambda *a: taken.append(real(*a)) or taken[-1])
    results = {}
    for tma in (True, False):
        with override_tile_config(tma=tma):
            results[tma] = run_flash(q, k, v, do, True)
    assert (len(taken) == 4) == (N % 16 == 0), f"N={N}: TMA taken {len(taken)} times"
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), results[True], results[False], strict=True):
        assert torch.isfinite(a[keep]).all(), f"seed={seed} {layout}/{which}: non-finite {name} leaked in"
        assert torch.equal(a[keep], b[keep]), f"seed={seed} {layout}/{which}: {name} differs TMA vs pointers"
