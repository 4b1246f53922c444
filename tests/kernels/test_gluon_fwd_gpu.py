"""GPU tests of the sm_90 Gluon forward (kernels/_gluon_fwd.py); skipped without an sm_90 GPU.

The same FlashAttention accuracy rule as tests/kernels/test_flash_gpu.py (o and every gradient within 2x the
error of naive attention in the input dtype, against a float32 reference), with the Gluon forward forced
(FLASHGPT_GLUON_FWD=1) so that short sequences, ragged N, GQA / MQA, fp16 and the fused-qkv layout all
run it; then the routing, determinism, torch.compile (the opaque op in the graph), CUDA graphs and
torch.library.opcheck. Fresh torch.randn inputs from the per-test seed shown in every message.
"""

import math

import pytest
import torch

from tests.kernels.test_flash_gpu import (
    BF16,
    F16,
    _compiled_fwd_bwd,
    assert_fa_rule,
    flash_with_grads,
    gluon_sm90_env,
    make_inputs,
    naive_chunked,
    spy_launches,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _sm90(monkeypatch):
    yield from gluon_sm90_env(monkeypatch, "FLASHGPT_GLUON_FWD")


@pytest.fixture
def launches(monkeypatch):
    """The Gluon forward's launches (q's shape per launch)."""
    from kernels import _gluon_fwd

    return spy_launches(monkeypatch, _gluon_fwd, "fwd_launch", lambda q, *args: q.shape)


# (dtype, B, Hq, Hkv, N, d)
CASES = [
    (BF16, 8, 4, 4, 1024, 64),
    (F16, 8, 4, 4, 1024, 128),
    (BF16, 4, 8, 2, 4096, 128),  # GQA
    (F16, 2, 8, 1, 4096, 64),  # MQA
    (BF16, 4, 4, 4, 2000, 64),  # ragged N: the last query block and key block partly past N
    (BF16, 3, 4, 2, 777, 128),
    (F16, 2, 2, 2, 100, 64),  # one block, shorter than it
    (BF16, 1, 2, 2, 16384, 128),
    (BF16, 64, 3, 3, 384, 64),  # 576 short tiles over the persistent programs: the claimed-tile path
    # d = 64 runs 192-row tiles (three 64-row warpgroups): the last tile's later parts past N
    (BF16, 2, 4, 2, 200, 64),  # parts 1, 2 of the second tile past N
    (F16, 3, 2, 2, 320, 64),  # part 2 past N, part 1 ending at N
    (BF16, 2, 6, 3, 1088, 64),  # N % 192 = 128: the last tile's diagonal blocks 8 and 9
]


@pytest.mark.parametrize("dtype,B,Hq,Hkv,N,d", CASES)
def test_fa_accuracy_rule_gluon_fwd(seed, launches, dtype, B, Hq, Hkv, N, d):
    q, k, v, do = make_inputs(seed, B, Hq, Hkv, N, N, d, dtype)
    scale = 1.0 / math.sqrt(d)
    ours = flash_with_grads(q, k, v, do, True)
    assert launches == [q.shape], f"seed={seed}: the Gluon forward did not run"
    low = naive_chunked(q, k, v, do, True, scale, dtype)
    ref = naive_chunked(q, k, v, do, True, scale, torch.float32)
    assert_fa_rule(seed, ours, low, ref, f"gluon fwd case={(dtype, B, Hq, Hkv, N, d)}")


def test_lse_matches_reference_gluon_fwd(seed, launches):
    """The LSE the backward reads: natural log, within float32 rounding of a float64 reference."""
    from kernels import flash_attention
    from kernels.reference import attention_reference

    q, k, v, _ = make_inputs(seed, 2, 4, 2, 1500, 1500, 128, BF16)
    o, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    o_ref, lse_ref = attention_reference(q, k, v, causal=True)  # float64
    err = (lse.double() - lse_ref).abs().max().item()
    assert launches and err < 1e-4, f"seed={seed}: lse err {err:.3g}"
    err = (o.double() - o_ref).abs().max().item()
    assert err < 2e-2, f"seed={seed}: o err {err:.3g}"


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_fused_qkv_layout_gluon_fwd(seed, launches, dtype):
    """The trainer's packed qkv (B, N, 3, H, d): views and `flash_attention_qkvpacked` both take the
    Gluon forward (device-side descriptors per head) and match contiguous inputs bitwise."""
    from kernels import flash_attention, flash_attention_qkvpacked

    B, N, H, d = 2, 4096, 4, 64
    x = torch.randn(B, N, 3, H, d, device="cuda", dtype=dtype)
    q, k, v = (x[:, :, i].transpose(1, 2) for i in range(3))
    o_views = flash_attention(q, k, v, causal=True)
    o_contig = flash_attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    o_packed = flash_attention_qkvpacked(x, causal=True)  # (B, N, H, d)
    assert len(launches) == 3, f"seed={seed}: {launches}"
    assert torch.equal(o_views, o_contig), f"seed={seed}"
    assert torch.equal(o_packed.transpose(1, 2), o_contig), f"seed={seed}"


def test_route_gpu(seed, launches, monkeypatch):
    """auto: N >= MIN_N[d] only; never non-causal, Nq != Nk, d outside 64 / 128, float32, a variant, a
    softmax_scale <= 0, an expanded q, or FLASHGPT_GLUON_FWD=0; a bad value of the variable is a ValueError
    naming it."""
    from kernels import flash_attention
    from kernels import plan as _gluon_route
    from kernels.reference import attention_reference

    monkeypatch.setenv("FLASHGPT_GLUON_FWD", "auto")
    for d, n_min in _gluon_route.MIN_N.items():
        for N, expected in ((n_min, 1), (n_min // 2, 0)):
            launches.clear()
            q, k, v, _ = make_inputs(seed, 1, 2, 2, N, N, d, BF16)
            flash_attention(q, k, v, causal=True)
            assert len(launches) == expected, f"seed={seed}: d={d} N={N} launches={launches}"
    monkeypatch.setenv("FLASHGPT_GLUON_FWD", "1")
    launches.clear()
    q, k, v, _ = make_inputs(seed, 1, 2, 2, 1024, 1024, 64, BF16)
    flash_attention(q, k, v, causal=False)
    flash_attention(q, k[:, :, :512], v[:, :, :512], causal=True)
    flash_attention(q, k, v, causal=True, window=128)
    flash_attention(q.float(), k.float(), v.float(), causal=True)
    q96, k96, v96, _ = make_inputs(seed, 1, 2, 2, 1024, 1024, 96, BF16)
    flash_attention(q96, k96, v96, causal=True)
    assert launches == [], f"seed={seed}: {launches}"
    monkeypatch.setenv("FLASHGPT_GLUON_FWD", "0")
    flash_attention(q, k, v, causal=True)
    assert launches == []
    monkeypatch.setenv("FLASHGPT_GLUON_FWD", "1")
    # the kernel masks before it scales (scale > 0 only) and writes o with unit last stride (no expanded q)
    for scale in (0.0, -0.125):
        o = flash_attention(q, k, v, causal=True, softmax_scale=scale)
        ref = attention_reference(q, k, v, causal=True, softmax_scale=scale)[0]
        assert (o.double() - ref).abs().max().item() < 2e-2, f"seed={seed}: scale {scale}"
    qe = q[:, :1].expand(1, 2, 1024, 64)
    o = flash_attention(qe, k, v, causal=True)
    assert (o.double() - attention_reference(qe, k, v, causal=True)[0]).abs().max().item() < 2e-2
    assert launches == [], f"seed={seed}: {launches}"
    monkeypatch.setenv("FLASHGPT_GLUON_FWD", "yes")
    with pytest.raises(ValueError, match="FLASHGPT_GLUON_FWD"):
        flash_attention(q, k, v, causal=True)


def test_deterministic_gluon_fwd(seed, launches):
    q, k, v, do = make_inputs(seed, 2, 8, 2, 4096, 4096, 128, BF16)
    a = flash_with_grads(q, k, v, do, True)
    b = flash_with_grads(q, k, v, do, True)
    assert len(launches) == 2
    for name, x, y in zip(("o", "dq", "dk", "dv"), a, b, strict=True):
        assert torch.equal(x, y), f"seed={seed}: {name} differs between runs"


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_graph_calls_the_gluon_op_gpu(seed, mode):
    """Under torch.compile the forward is the opaque op flashgpt::flash_attn_fwd_sm90 (Inductor cannot
    trace a Gluon kernel), the backward kernels are traced as usual; compiled (also inside CUDA graphs)
    equals eager bitwise."""
    from torch._inductor.utils import run_and_get_code

    q, k, v, do = make_inputs(seed, 2, 8, 2, 1536, 1536, 128, BF16)
    if mode is None:
        out, codes = run_and_get_code(_compiled_fwd_bwd, q, k, v, do)
        code = "\n".join(codes)
        assert "flashgpt.flash_attn_fwd_sm90" in code, "the Gluon op is not in the compiled graph"
        assert "def _bwd_dkdv_kernel" in code and "def _fwd_kernel" not in code
    else:
        out = _compiled_fwd_bwd(q, k, v, do, mode=mode)
    eager = flash_with_grads(q, k, v, do, True)
    for name, a, b in zip(("o", "dq", "dk", "dv"), out, eager, strict=True):
        assert torch.equal(a, b), f"seed={seed} mode={mode}: compiled {name} differs from eager"


def test_gluon_op_opcheck_gpu(seed):
    from kernels import plan as _gluon_route

    q, k, v, _ = make_inputs(seed, 1, 4, 2, 256, 256, 64, BF16)
    assert _gluon_route.plan_fwd(q, k, v, True, 0.125, 0, None, 0.0).backend == "gluon"
    torch.library.opcheck(torch.ops.flashgpt.flash_attn_fwd_sm90.default, (q, k, v, 0.125))
