"""`flash_attention_qkvpacked` (kernels/flash_attn.py): one grid over {interpreter, cuda} (small shapes under
the Triton interpreter on the CPU, the training shapes on the GPU). The model's packed call,
`model.attention.attention(qkv=...)`, is tested in tests/model/test_model.py.

The packed entry point runs the launchers of `flash_attention` on views of qkv and writes the gradients into
one d(qkv) buffer, so outputs and gradients must equal the separate path bit for bit. Accuracy: against the
float64 reference under the interpreter; on the GPU the FlashAttention rule, err <= 2 * err_pt + 1e-5 against
a float32 reference (err_pt: PyTorch attention in the input dtype). Fresh seeded inputs per test (the seed
is printed on failure).
"""

import os
import re

import torch

_PREVIOUS_INTERPRET = os.environ.get("TRITON_INTERPRET")
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before importing triton / kernels (see tests/kernel_modes.py)

import pytest  # noqa: E402
import triton  # noqa: E402, F401

from kernels import flash_attention, flash_attention_qkvpacked  # noqa: E402
from kernels import flash_attn as fa  # noqa: E402
from kernels.reference import attention_reference  # noqa: E402
from tests.kernel_modes import DEVICES, enter  # noqa: E402

if _PREVIOUS_INTERPRET is None:
    os.environ.pop("TRITON_INTERPRET", None)
else:
    os.environ["TRITON_INTERPRET"] = _PREVIOUS_INTERPRET

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}  # interpreter: max|ours - ref| / max(max|ref|, 1)
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture
def interpreter(monkeypatch):
    """The tests below the grid: interpreter only."""
    enter("interpreter", monkeypatch)


def _views(qkv):
    return tuple(t.transpose(1, 2) for t in qkv.unbind(2))


def _packed(seed, B, N, H, d, dtype, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(B, N, 3, H, d, generator=g, device=device, dtype=dtype)
    do = torch.randn(B, N, H, d, generator=g, device=device, dtype=dtype)
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


def _check_accuracy(seed, device, qkv, do, o, lse, dqkv, causal, what):
    """Interpreter: float64 reference within TOL. CUDA: the FlashAttention rule on o and the three slices."""
    if device == "interpreter":
        x = qkv.double().requires_grad_()
        ref_o, ref_lse = attention_reference(*_views(x), causal=causal)
        ref_o.transpose(1, 2).backward(do.double())
        tol = TOL[qkv.dtype]
        for name, a, r in (("o", o, ref_o.transpose(1, 2)), ("lse", lse, ref_lse), ("dqkv", dqkv, x.grad)):
            err = ((a.double() - r).abs().max() / r.abs().max().clamp_min(1.0)).item()
            assert err <= tol, f"seed={seed} {what}: {name} relative error {err:.3g} > {tol}"
        return
    from tests.kernels.test_flash_gpu import assert_fa_rule, naive_chunked

    q, k, v = _views(qkv)
    dob = do.transpose(1, 2)
    scale = q.shape[-1] ** -0.5
    ref = naive_chunked(q.float(), k.float(), v.float(), dob.float(), causal, scale, torch.float32)
    low = naive_chunked(q, k, v, dob, causal, scale, qkv.dtype)
    dq, dk, dv = _views(dqkv)
    assert_fa_rule(seed, (o.transpose(1, 2), dq, dk, dv), low, ref, what)


# (device, dtype, B, N, H, d, causal): small shapes under the interpreter; on the GPU the training shape,
# d = 128, ragged N (pointer loads) and an odd d
CASES = [
    *(pytest.param("interpreter", dt, 2, n, 3, 16, c) for dt in (F32, F16)
      for c, n in ((True, 48), (False, 37), (True, 33))),
    *(pytest.param("interpreter", dt, 2, 40, 2, 32, True) for dt in (F32, F16)),
    *(pytest.param("cuda", *case, True, marks=pytest.mark.gpu) for case in (
        (BF16, 4, 1024, 12, 64), (F16, 2, 2048, 4, 128), (BF16, 3, 1000, 4, 64), (BF16, 1, 777, 2, 80))),
]  # fmt: skip


@pytest.mark.parametrize("device,dtype,B,N,H,d,causal", CASES)
def test_packed_equals_separate_and_is_accurate(seed, monkeypatch, device, dtype, B, N, H, d, causal):
    """o, lse and d(qkv) equal flash_attention on the three views bit for bit (TMA and pointer-load tiles
    alike; the split backward: the one-pass Gluon one's dq has no fixed summation order,
    tests/kernels/test_gluon_bwd_gpu.py); o and d(qkv) are contiguous; and they pass the accuracy check."""
    dev = enter(device, monkeypatch)
    monkeypatch.setenv("FLASHGPT_GLUON_BWD", "0")
    qkv, do = _packed(seed, B, N, H, d, dtype, dev)
    packed = _run_packed(qkv, do, causal=causal)
    separate = _run_separate(qkv, do, causal=causal)
    for name, a, b in zip(("o", "lse", "dqkv"), packed, separate, strict=True):
        assert torch.equal(a, b), f"seed={seed}: packed {name} differs from the separate path"
    assert packed[0].is_contiguous() and packed[2].is_contiguous()
    assert packed[0].shape == (B, N, H, d) and packed[2].shape == qkv.shape
    _check_accuracy(seed, device, qkv, do, *packed, causal, f"packed {device} {dtype} N={N} d={d}")


def _kernel_names(code: str) -> list[str]:
    return re.findall(r"def (triton_\w+|_\w+_kernel)\(", code)


@pytest.mark.parametrize("device", DEVICES)
def test_packed_compiled_equals_eager(seed, monkeypatch, device):
    """torch.compile(fullgraph=True) traces the packed op without graph breaks and gives eager's bits. On the
    CPU the op is opaque (fake implementation); on CUDA the generated code launches our kernels and holds no
    cat / stack / scatter kernel, where the separate path concatenates dq, dk, dv (checked, so the test can
    fail)."""
    dev = enter(device, monkeypatch)
    shape, dtype = ((1, 32, 2, 16), F32) if device == "interpreter" else ((4, 1024, 12, 64), BF16)
    qkv, do = _packed(seed, *shape, dtype, dev)

    def run(fn):
        torch._dynamo.reset()
        f = torch.compile(lambda x: (fn(x).float() * do.float()).sum(), fullgraph=True)
        x = qkv.detach().clone().requires_grad_()
        f(x).backward()
        return x.grad

    eager = _run_packed(qkv, do)
    if device == "interpreter":
        torch._dynamo.reset()
        f = torch.compile(lambda x: flash_attention_qkvpacked(x), fullgraph=True)
        x = qkv.clone().requires_grad_()
        o = f(x)
        o.backward(do)
        assert torch.equal(o.detach(), eager[0]) and torch.equal(x.grad, eager[2]), f"seed={seed}"
        return
    from torch._inductor.utils import run_and_get_code

    grad, codes = run_and_get_code(run, flash_attention_qkvpacked)
    names = _kernel_names("\n".join(codes))
    for kernel in ("_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel"):
        assert kernel in names, f"{kernel} not in the generated code: {names}"
    copies = [n for n in names if re.search("cat|stack|scatter", n)]
    assert not copies, f"packed graph copies d(qkv): {copies}"
    _, codes = run_and_get_code(run, lambda x: flash_attention(*_views(x)).transpose(1, 2))
    assert [n for n in _kernel_names("\n".join(codes)) if re.search("cat|stack", n)], "separate: no concat?"
    assert torch.equal(grad, eager[2]), f"seed={seed}: compiled d(qkv) differs from eager"


@pytest.mark.parametrize("device", DEVICES)
def test_packed_ops_opcheck(seed, monkeypatch, device):
    """torch.library.opcheck of the packed ops (the interpreter's custom ops, CUDA's triton ops): schema,
    fake implementation, autograd registration."""
    dev = enter(device, monkeypatch)
    shape, dtype = ((1, 16, 2, 16), F32) if device == "interpreter" else ((1, 256, 4, 64), BF16)
    qkv, do = _packed(seed, *shape, dtype, dev)
    fwd, bwd = (
        (fa.PACKED.fwd_cpu, fa.PACKED.bwd_cpu) if device == "interpreter" else (fa.PACKED.fwd, fa.PACKED.bwd)
    )
    scale = shape[-1] ** -0.5
    torch.library.opcheck(fwd, (qkv.clone().requires_grad_(), True, scale))
    o, lse = fwd(qkv, True, scale)
    torch.library.opcheck(bwd, (do, qkv, o, lse, True, scale))


# ---------------------------------------------------------- interpreter only: variants, layouts, errors


@pytest.mark.parametrize(
    "variant",
    [
        {"window": 7},
        {"doc_ids": "docs"},
        {"dropout_p": 0.3, "dropout_seed": 1234},
        {"softcap": 1.5, "window": 11},
    ],
    ids=["window", "documents", "dropout", "softcap"],
)
def test_packed_variants_equal_separate(seed, interpreter, variant):
    """Sliding window, document mask, dropout (same seed) and soft-capping: the packed path equals the
    separate one."""
    qkv, do = _packed(seed, 2, 40, 2, 16, torch.float32)
    kw = dict(variant)
    if kw.get("doc_ids") == "docs":
        kw["doc_ids"] = torch.tensor([[0] * 15 + [1] * 25, [0] * 30 + [1] * 10])
    packed = _run_packed(qkv, do, **kw)
    separate = _run_separate(qkv, do, **kw)
    for name, a, b in zip(("o", "lse", "dqkv"), packed, separate, strict=True):
        assert torch.equal(a, b), f"seed={seed} {variant}: packed {name} differs from the separate path"


def test_packed_strided_inputs(seed, interpreter):
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
def test_packed_bad_input(interpreter, bad, err, match):
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
