"""CPU tests of `flash_attention_qkvpacked` (kernels/flash_qkvpacked.py) and of
`model.attention.attention_qkvpacked`, under the Triton interpreter (the import order of
tests/test_flash_kernel.py: TRITON_INTERPRET before triton).

The packed entry point runs the launchers of `flash_attention` on views of qkv and writes the gradients into
one d(qkv) buffer, so outputs and gradients must equal the separate path bit for bit; they are also checked
against the float64 reference. Fresh seeded inputs per test (the seed is printed on failure).
"""

import importlib
import os

import torch

_PREVIOUS_INTERPRET = os.environ.get("TRITON_INTERPRET")
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before importing triton / kernels (see test_flash_kernel.py)

import pytest  # noqa: E402
import triton  # noqa: E402, F401

from kernels import flash_attention, flash_attention_qkvpacked  # noqa: E402
from kernels import flash_attn as fp  # noqa: E402
from kernels.reference import attention_reference  # noqa: E402

A = importlib.import_module("model.attention")  # the module (`model.attention` is also a function name)

if _PREVIOUS_INTERPRET is None:
    os.environ.pop("TRITON_INTERPRET", None)
else:
    os.environ["TRITON_INTERPRET"] = _PREVIOUS_INTERPRET

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}  # max|ours - ref| / max(max|ref|, 1)


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _views(qkv):
    return tuple(t.transpose(1, 2) for t in qkv.unbind(2))


def _packed(seed, B, N, H, d, dtype):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, N, 3, H, d, generator=g).to(dtype)
    do = torch.randn(B, N, H, d, generator=g).to(dtype)
    return qkv, do


def _run_packed(qkv, do, **kw):
    x = qkv.detach().clone().requires_grad_()
    o, lse = flash_attention_qkvpacked(x, return_lse=True, **kw)
    o.backward(do)
    return o.detach(), lse, x.grad


def _run_separate(qkv, do, **kw):
    x = qkv.detach().clone().requires_grad_()
    o, lse = flash_attention(*_views(x), return_lse=True, **kw)
    o.transpose(1, 2).backward(do)
    return o.transpose(1, 2).detach(), lse, x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal,N", [(True, 48), (False, 37), (True, 33)])
def test_packed_equals_separate_bitwise(seed, dtype, causal, N):
    """o, lse and d(qkv) equal flash_attention on the three views bit for bit; d(qkv) is contiguous."""
    qkv, do = _packed(seed, 2, N, 3, 16, dtype)
    packed = _run_packed(qkv, do, causal=causal)
    separate = _run_separate(qkv, do, causal=causal)
    for name, a, b in zip(("o", "lse", "dqkv"), packed, separate, strict=True):
        assert torch.equal(a, b), f"seed={seed}: packed {name} differs from the separate path"
    assert packed[0].is_contiguous() and packed[2].is_contiguous()
    assert packed[0].shape == (2, N, 3, 16) and packed[2].shape == qkv.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_packed_matches_float64_reference(seed, dtype):
    """Against the float64 reference on the upcast views: output, lse and the three gradient slices."""
    qkv, do = _packed(seed, 2, 40, 2, 32, dtype)
    o, lse, dqkv = _run_packed(qkv, do)
    x = qkv.double().requires_grad_()
    ref_o, ref_lse = attention_reference(*_views(x), causal=True)
    ref_o.transpose(1, 2).backward(do.double())
    tol = TOL[dtype]
    for name, a, r in (("o", o, ref_o.transpose(1, 2)), ("lse", lse, ref_lse), ("dqkv", dqkv, x.grad)):
        err = ((a.double() - r).abs().max() / r.abs().max().clamp_min(1.0)).item()
        assert err <= tol, f"seed={seed} {dtype}: {name} relative error {err:.3g} > {tol}"


@pytest.mark.parametrize(
    "variant",
    [
        {"window": 7},
        {"doc_ids": "docs"},
        {"dropout_p": 0.3, "dropout_seed": 1234},
    ],
    ids=["window", "documents", "dropout"],
)
def test_packed_variants_equal_separate(seed, variant):
    """Sliding window, document mask and dropout (same seed): the packed path equals the separate one."""
    qkv, do = _packed(seed, 2, 40, 2, 16, torch.float32)
    kw = dict(variant)
    if kw.get("doc_ids") == "docs":
        kw["doc_ids"] = torch.tensor([[0] * 15 + [1] * 25, [0] * 30 + [1] * 10])
    packed = _run_packed(qkv, do, **kw)
    separate = _run_separate(qkv, do, **kw)
    for name, a, b in zip(("o", "lse", "dqkv"), packed, separate, strict=True):
        assert torch.equal(a, b), f"seed={seed} {variant}: packed {name} differs from the separate path"


def test_packed_strided_inputs(seed):
    """A qkv view with padding between rows (any strides) and one with a non-unit last stride (copied)."""
    qkv, do = _packed(seed, 2, 24, 2, 16, torch.float32)
    wide = torch.zeros(2, 24, 3, 2, 20)
    wide[..., :16] = qkv
    sliced = wide[..., :16]  # row stride 3 * 2 * 20: not contiguous, last stride 1
    tail = qkv.transpose(-1, -2).contiguous().transpose(-1, -2)  # last stride != 1
    want = _run_separate(qkv, do)
    for name, x in (("padded rows", sliced), ("non-unit last stride", tail)):
        got = _run_packed(x, do)
        for what, a, b in zip(("o", "lse", "dqkv"), got, want, strict=True):
            assert torch.equal(a, b), f"seed={seed} {name}: {what} differs"


def test_packed_compiled_equals_eager(seed):
    """torch.compile(fullgraph=True) traces the opaque CPU op (fake implementation) without graph breaks and
    gives eager's bits."""
    qkv, do = _packed(seed, 1, 32, 2, 16, torch.float32)
    torch._dynamo.reset()
    f = torch.compile(lambda x: flash_attention_qkvpacked(x), fullgraph=True)
    x = qkv.clone().requires_grad_()
    o = f(x)
    o.backward(do)
    eager = _run_packed(qkv, do)
    assert torch.equal(o.detach(), eager[0]) and torch.equal(x.grad, eager[2]), f"seed={seed}"


def test_packed_ops_opcheck(seed):
    """torch.library.opcheck of the interpreter ops: schema, fake implementation, autograd registration."""
    qkv, do = _packed(seed, 1, 16, 2, 16, torch.float32)
    x = qkv.clone().requires_grad_()
    torch.library.opcheck(fp.PACKED.fwd_cpu, (x, True, 0.25))
    o, lse = fp.PACKED.fwd_cpu(qkv, True, 0.25)
    torch.library.opcheck(fp.PACKED.bwd_cpu, (do, qkv, o, lse, True, 0.25))


@pytest.mark.parametrize(
    "bad,err,match",
    [
        ("list", TypeError, "qkv must be a torch.Tensor"),
        ((2, 8, 6, 16), ValueError, r"qkv must be \(B, N, 3, H, d\), got shape \(2, 8, 6, 16\)"),
        ((2, 8, 2, 3, 16), ValueError, r"qkv must be \(B, N, 3, H, d\)"),
        ((2, 8, 3, 3, 4), ValueError, "head dim d=4 is outside"),
        ("int", TypeError, "qkv has dtype torch.int64"),
        ((2, 0, 3, 2, 16), ValueError, r"qkv \(2, 0, 3, 2, 16\) has an empty dim"),
        ("lse", TypeError, "return_lse must be a bool"),
        ("det", TypeError, "deterministic must be a bool"),
    ],
)
def test_packed_bad_input(bad, err, match):
    """Bad input raises a clear error naming qkv before any launch."""
    kw = {}
    if bad == "list":
        x = [[1.0]]
    elif bad == "int":
        x = torch.zeros(1, 8, 3, 2, 16, dtype=torch.int64)
    elif bad == "lse":
        x, kw = torch.randn(1, 8, 3, 2, 16), {"return_lse": "yes"}
    elif bad == "det":
        x, kw = torch.randn(1, 8, 3, 2, 16), {"deterministic": 1}
    else:
        x = torch.randn(*bad)
    with pytest.raises(err, match=match):
        flash_attention_qkvpacked(x, **kw)


@pytest.mark.parametrize("backend", ["naive", "sdpa", "flash"])
def test_attention_qkvpacked_every_backend(seed, backend):
    """model.attention.attention_qkvpacked: every backend gives attention() on the views, as (B, N, H, d)."""
    qkv, _ = _packed(seed, 2, 24, 2, 16, torch.float32)
    got = A.attention_qkvpacked(qkv, backend)
    want = A.attention(*_views(qkv), "naive").transpose(1, 2)
    assert got.shape == (2, 24, 2, 16)
    assert (got - want).abs().max().item() < 1e-5, f"seed={seed} {backend}"
    with pytest.raises(ValueError, match=r"expects qkv of shape \(B, N, 3, H, d\)"):
        A.attention_qkvpacked(qkv[:, :, :2], backend)
    with pytest.raises(TypeError, match="expects qkv as a torch.Tensor, got list"):
        A.attention_qkvpacked([1, 2], backend)


def test_registry_qkvpacked_keyword(seed):
    """A backend registered with qkvpacked= gets qkv whole; re-registered without it, the three views."""
    calls = []

    def plain(q, k, v, sdpa_backend):
        calls.append("views")
        return A.attention(q, k, v, "naive")

    def packed(qkv, sdpa_backend, **variants):
        calls.append("packed")
        return A.attention(*_views(qkv), "naive").transpose(1, 2)

    qkv, _ = _packed(seed, 1, 8, 2, 16, torch.float32)
    try:
        A.register_attention_backend("test_packed", plain, qkvpacked=packed)
        A.attention_qkvpacked(qkv, "test_packed")
        A.register_attention_backend("test_packed", plain, overwrite=True)
        A.attention_qkvpacked(qkv, "test_packed")
        with pytest.raises(ValueError, match="without variants=True"):
            A.register_attention_backend("test_packed", plain, overwrite=True, qkvpacked=packed)
            A.attention_qkvpacked(qkv, "test_packed", window=4)
    finally:
        A._REGISTRY.pop("test_packed", None)
        A._QKVPACKED.pop("test_packed", None)
    assert calls == ["packed", "views"]


def test_registry_refuses_what_cannot_run(seed):
    """A non-callable fn / qkvpacked is refused at registration; a packed function that returns the
    unpacked (B, H, N, d) layout is refused at the call instead of being read scrambled."""
    for kw in ({"fn": None}, {"fn": A.attention, "qkvpacked": "not a function"}):
        with pytest.raises(TypeError, match="must be callable"):
            A.register_attention_backend("test_bad", **kw)
    assert "test_bad" not in A.available_attention_backends()
    qkv, _ = _packed(seed, 2, 8, 2, 16, torch.float32)

    def wrong_layout(qkv, sdpa_backend, **variants):
        return A.attention(*_views(qkv), "naive")  # (B, H, N, d)

    try:
        A.register_attention_backend("test_layout", lambda q, k, v, s: q, qkvpacked=wrong_layout)
        with pytest.raises(RuntimeError, match=r"returned shape \(2, 2, 8, 16\), expected \(B, N, H, d\)"):
            A.attention_qkvpacked(qkv, "test_layout")
    finally:
        A._REGISTRY.pop("test_layout", None)
        A._QKVPACKED.pop("test_layout", None)
