"""GPU tests of the sm_90 one-pass Gluon backward (kernels/_gluon_bwd.py); skipped without an sm_90 GPU.

The FlashAttention accuracy rule of tests/kernels/test_flash_gpu.py (o and every gradient within 2x the
error of naive attention in the input dtype, against a float32 reference) with the Gluon backward forced
(FLASHGPT_GLUON_BWD=1) so that short sequences run it too; the packed-qkv layout; the routing (GQA, ragged
N, the LSE gradient, `deterministic=True` and torch.use_deterministic_algorithms keep the split backward);
what is and is not bitwise reproducible; torch.compile (the opaque ops in the graph), CUDA graphs and
torch.library.opcheck. Fresh torch.randn inputs from the per-test seed shown in every message.
"""

import math

import pytest
import torch

from tests.kernels.test_flash_gpu import (
    BF16,
    F16,
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
    yield from gluon_sm90_env(monkeypatch, "FLASHGPT_GLUON_BWD")


@pytest.fixture
def launches(monkeypatch):
    """The Gluon backward's launches (q's shape per launch)."""
    from kernels import _gluon_bwd

    return spy_launches(monkeypatch, _gluon_bwd, "bwd_launch", lambda do, q, *args: q.shape)


# (dtype, B, H, N, d)
CASES = [
    (BF16, 8, 4, 1024, 64),
    (F16, 8, 4, 1024, 128),
    (BF16, 2, 8, 4096, 128),
    (F16, 2, 4, 4096, 64),
    (BF16, 3, 2, 128, 64),  # one key block: only the two masked query blocks
    (F16, 2, 3, 384, 128),  # three key blocks, odd H
    (BF16, 1, 2, 16384, 64),
    (BF16, 1, 4, 8192, 128),
]


@pytest.mark.parametrize("dtype,B,H,N,d", CASES)
def test_fa_accuracy_rule_gluon_bwd(seed, launches, dtype, B, H, N, d):
    q, k, v, do = make_inputs(seed, B, H, H, N, N, d, dtype)
    scale = 1.0 / math.sqrt(d)
    ours = flash_with_grads(q, k, v, do, True)
    assert launches == [q.shape], f"seed={seed}: the Gluon backward did not run ({launches})"
    low = naive_chunked(q, k, v, do, True, scale, dtype)
    ref = naive_chunked(q, k, v, do, True, scale, torch.float32)
    assert_fa_rule(seed, ours, low, ref, f"gluon bwd case={(dtype, B, H, N, d)}")


@pytest.mark.parametrize("dtype,d", [(BF16, 64), (F16, 128)])
def test_packed_qkv_gluon_bwd(seed, launches, dtype, d):
    """The trainer's layout: `flash_attention_qkvpacked` writes d(qkv) through the Gluon backward (device-side
    descriptors on the strided views) and passes the rule; dk and dv equal the separate path's bitwise."""
    from kernels import flash_attention, flash_attention_qkvpacked

    B, N, H = 2, 2048, 4
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(B, N, 3, H, d, generator=g, device="cuda", dtype=dtype)
    do = torch.randn(B, N, H, d, generator=g, device="cuda", dtype=dtype)
    x = qkv.clone().requires_grad_()
    o = flash_attention_qkvpacked(x, causal=True)
    o.backward(do)
    y = qkv.clone().requires_grad_()
    o_sep = flash_attention(*(y[:, :, i].transpose(1, 2) for i in range(3)), causal=True).transpose(1, 2)
    o_sep.backward(do)
    assert len(launches) == 2, f"seed={seed}: {launches}"
    assert torch.equal(o, o_sep) and torch.equal(x.grad[:, :, 1:], y.grad[:, :, 1:]), f"seed={seed}"
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    dob = do.transpose(1, 2)
    low = naive_chunked(q, k, v, dob, True, d**-0.5, dtype)
    ref = naive_chunked(q, k, v, dob, True, d**-0.5, torch.float32)
    grads = tuple(x.grad[:, :, i].transpose(1, 2) for i in range(3))
    assert_fa_rule(seed, (o.transpose(1, 2), *grads), low, ref, f"packed gluon bwd {dtype} d={d}")


def test_what_is_reproducible_gluon_bwd(seed, launches):
    """dk and dv (one program per key block) are bitwise equal run to run; dq (TMA reduce-add across key
    blocks) within float32 rounding; deterministic=True gives the split backward's bits, run to run."""
    from kernels import flash_attention

    q, k, v, do = make_inputs(seed, 2, 8, 8, 4096, 4096, 128, BF16)
    a = flash_with_grads(q, k, v, do, True)
    b = flash_with_grads(q, k, v, do, True)
    assert len(launches) == 2
    assert torch.equal(a[2], b[2]) and torch.equal(a[3], b[3]), f"seed={seed}: dk / dv differ between runs"
    err = (a[1].float() - b[1].float()).abs().max().item()
    assert err <= 1e-2 * a[1].float().abs().max().item(), f"seed={seed}: dq differs by {err:.3g} between runs"

    def det():
        qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
        flash_attention(qs, ks, vs, causal=True, deterministic=True).backward(do)
        return qs.grad, ks.grad, vs.grad

    launches.clear()
    c, e = det(), det()
    assert launches == [], f"seed={seed}: deterministic=True ran the Gluon backward"
    for name, x, y in zip(("dq", "dk", "dv"), c, e, strict=True):
        assert torch.equal(x, y), f"seed={seed}: deterministic {name} differs between runs"


def test_route_bwd_gpu(seed, launches, monkeypatch):
    """auto: N >= MIN_N_BWD[d] only; never GQA, N not a multiple of 128, deterministic=True,
    torch.use_deterministic_algorithms(True) or FLASHGPT_GLUON_BWD=0; a bad value is a ValueError naming
    it."""
    from kernels import flash_attention
    from kernels import plan as _gluon_route

    monkeypatch.setenv("FLASHGPT_GLUON_BWD", "auto")
    for d, n_min in _gluon_route.MIN_N_BWD.items():
        for N, expected in ((n_min, 1), (n_min // 2, 0)):
            launches.clear()
            flash_with_grads(*make_inputs(seed, 1, 2, 2, N, N, d, BF16), True)
            assert len(launches) == expected, f"seed={seed}: d={d} N={N} launches={launches}"
    monkeypatch.setenv("FLASHGPT_GLUON_BWD", "1")
    launches.clear()
    flash_with_grads(*make_inputs(seed, 1, 4, 2, 1024, 1024, 64, BF16), True)  # GQA
    flash_with_grads(*make_inputs(seed, 1, 2, 2, 1000, 1000, 64, BF16), True)  # ragged N
    q, k, v, do = make_inputs(seed, 1, 2, 2, 1024, 1024, 64, BF16)
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    flash_attention(qs, ks, vs, causal=True, deterministic=True).backward(do)
    with _deterministic_algorithms():
        flash_with_grads(q, k, v, do, True)
    monkeypatch.setenv("FLASHGPT_GLUON_BWD", "0")
    flash_with_grads(q, k, v, do, True)
    assert launches == [], f"seed={seed}: {launches}"
    monkeypatch.setenv("FLASHGPT_GLUON_BWD", "on")
    with pytest.raises(ValueError, match="FLASHGPT_GLUON_BWD='on'"):
        flash_with_grads(q, k, v, do, True)


def test_lse_gradient_gluon_bwd(seed, launches, monkeypatch):
    """A loss through o and the LSE (dLSE enters Delta): the Gluon gradients' error against a float64
    reference is at most twice the split backward's (+1e-5)."""
    from kernels import flash_attention
    from kernels.reference import attention_reference

    q, k, v, do = make_inputs(seed, 2, 3, 3, 512, 512, 64, BF16)
    w = torch.randn(2, 3, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(seed + 1))

    def grads(fn, dtype=None):
        xs = [t.detach().clone().to(dtype or t.dtype).requires_grad_() for t in (q, k, v)]
        o, lse = fn(*xs)
        ((o.double() * do.double()).sum() + (lse.double() * w.double()).sum()).backward()
        return [x.grad.double() for x in xs]

    flash = lambda q, k, v: flash_attention(q, k, v, causal=True, return_lse=True)  # noqa: E731
    ours = grads(flash)
    assert len(launches) == 1, f"seed={seed}: {launches}"
    monkeypatch.setenv("FLASHGPT_GLUON_BWD", "0")
    split = grads(flash)
    ref = grads(lambda q, k, v: attention_reference(q, k, v, causal=True), torch.float64)
    for name, a, b, r in zip(("dq", "dk", "dv"), ours, split, ref, strict=True):
        err, base = (a - r).abs().max().item(), (b - r).abs().max().item()
        assert err <= 2 * base + 1e-5, f"seed={seed}: {name} err {err:.3g} > 2 * split err {base:.3g}"


class _deterministic_algorithms:
    def __enter__(self):
        self.previous = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)

    def __exit__(self, *exc):
        torch.use_deterministic_algorithms(self.previous)


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_graph_calls_the_gluon_bwd_op_gpu(seed, mode):
    """Under torch.compile the backward is the opaque op flashgpt::flash_attn_bwd_sm90 (also inside CUDA
    graphs); o, dk and dv equal eager bitwise, dq within float32 rounding."""
    from torch._inductor.utils import run_and_get_code

    from tests.kernels.test_flash_gpu import _compiled_fwd_bwd

    # a shape no other compiled test uses: Inductor's caches key on shapes, not on FLASHGPT_GLUON_BWD
    q, k, v, do = make_inputs(seed, 2, 6, 6, 1280, 1280, 64, BF16)
    if mode is None:
        out, codes = run_and_get_code(_compiled_fwd_bwd, q, k, v, do)
        code = "\n".join(codes)
        assert "flashgpt.flash_attn_bwd_sm90" in code, "the Gluon backward op is not in the compiled graph"
        assert "def _bwd_dkdv_kernel" not in code
    else:
        out = _compiled_fwd_bwd(q, k, v, do, mode=mode)
    eager = flash_with_grads(q, k, v, do, True)
    for name, a, b in zip(("o", "dq", "dk", "dv"), out, eager, strict=True):
        if name == "dq":
            err = (a.float() - b.float()).abs().max().item()
            assert err <= 1e-2 * b.float().abs().max().item(), f"seed={seed} mode={mode}: dq err {err:.3g}"
        else:
            assert torch.equal(a, b), f"seed={seed} mode={mode}: compiled {name} differs from eager"


def test_compiled_packed_graph_calls_the_packed_op_gpu(seed):
    """The compiled packed-qkv backward (the trainer's) calls flashgpt::flash_attn_bwd_sm90_packed, which
    writes d(qkv) in place; the gradient matches eager."""
    from torch._inductor.utils import run_and_get_code

    from kernels import flash_attention_qkvpacked

    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(2, 1408, 3, 4, 64, generator=g, device="cuda", dtype=BF16)
    do = torch.randn(2, 1408, 4, 64, generator=g, device="cuda", dtype=BF16)

    def run(compiled):
        torch._dynamo.reset()
        fn = lambda x: (flash_attention_qkvpacked(x).float() * do.float()).sum()  # noqa: E731
        f = torch.compile(fn, fullgraph=True) if compiled else fn
        x = qkv.clone().requires_grad_()
        f(x).backward()
        return x.grad

    grad, codes = run_and_get_code(run, True)
    assert "flashgpt.flash_attn_bwd_sm90_packed" in "\n".join(codes)
    eager = run(False)
    assert torch.equal(grad[:, :, 1:], eager[:, :, 1:]), f"seed={seed}: compiled dk / dv differ from eager"
    err = (grad[:, :, 0].float() - eager[:, :, 0].float()).abs().max().item()
    assert err <= 1e-2 * eager[:, :, 0].float().abs().max().item(), f"seed={seed}: dq err {err:.3g}"


def test_gluon_bwd_ops_opcheck_gpu(seed):
    from kernels import _gluon_bwd
    from kernels import flash_attn as fa
    from kernels import plan as _gluon_route

    q, k, v, do = make_inputs(seed, 1, 2, 2, 256, 256, 64, BF16)
    o, lse = fa.launch_fwd(q, k, v, True, 0.125)
    assert _gluon_route.plan_bwd(do, q, k, v, o, True, 0.125, 0, None, 0.0, False).backend == "gluon"
    # dq's summation order varies: opcheck compares outputs, so only the schema / fake / dispatch checks
    tests = ("test_schema", "test_faketensor", "test_autograd_registration")
    torch.library.opcheck(_gluon_bwd.backward, (do, q, k, v, o, lse, None, 0.125), test_utils=tests)
    dqkv = torch.empty(1, 256, 3, 2, 64, device="cuda", dtype=BF16)
    args = (do, q, k, v, o, lse, None, 0.125, dqkv)
    torch.library.opcheck(_gluon_bwd.backward_packed, args, test_utils=tests)
