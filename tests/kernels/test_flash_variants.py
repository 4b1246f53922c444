"""Attention variants of our Triton FlashAttention-2 under the Triton
interpreter (CPU).

Sliding window, document masking, attention dropout and logit soft-capping, alone and together, with GQA and
Nq != Nk, checked against `kernels.reference.attention_reference` (float64, explicit boolean mask; dropout
through the kernels' own keep mask from `dropout_keep_mask`). Block skipping is checked by poisoning blocks
that no row of a tile may see with NaN: a kernel that visited them would return NaN. Inputs are fresh seeded
torch.randn (the seed is in every message); document lengths are random too.

Shapes stay small (N <= 96, d <= 32, B * H <= 4): the interpreter is slow.
"""

import os

import torch

_PREVIOUS_INTERPRET = os.environ.get("TRITON_INTERPRET")
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before importing triton (see tests/kernels/test_flash_kernel.py)

import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import triton  # noqa: E402, F401

from kernels import flash_attention  # noqa: E402
from kernels.flash_attn import document_ranges, dropout_keep_mask  # noqa: E402
from kernels.reference import attention_mask, attention_reference  # noqa: E402

if _PREVIOUS_INTERPRET is None:
    os.environ.pop("TRITON_INTERPRET", None)
else:
    os.environ["TRITON_INTERPRET"] = _PREVIOUS_INTERPRET

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
F32, F16 = torch.float32, torch.float16


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def random_doc_ids(g: torch.Generator, B: int, N: int, mean_len: float) -> torch.Tensor:
    """(B, N) int32 non-decreasing document ids: each position starts a new document with prob 1/mean_len."""
    starts = torch.rand(B, N, generator=g) < 1.0 / mean_len
    starts[:, 0] = True
    return (starts.cumsum(-1) - 1).to(torch.int32)


def inputs(seed, B, Hq, Hkv, Nq, Nk, d, dtype=F32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, d, generator=g).to(dtype)
    k = torch.randn(B, Hkv, Nk, d, generator=g).to(dtype)
    v = torch.randn(B, Hkv, Nk, d, generator=g).to(dtype)
    do = torch.randn(B, Hq, Nq, d, generator=g).to(dtype)
    return g, q, k, v, do


def run_flash(q, k, v, do, **kw):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o, lse = flash_attention(q, k, v, return_lse=True, **kw)
    o.backward(do)
    return o.detach(), lse.detach(), q.grad, k.grad, v.grad


def run_reference(q, k, v, do, dtype=torch.float64, **kw):
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    o, lse = attention_reference(q, k, v, dtype=dtype, **kw)
    o.backward(do.to(dtype))
    return o.detach(), lse.detach(), q.grad, k.grad, v.grad


def check(seed, ours, ref, what, low=None):
    """float32: max|ours - ref64| <= 1e-5 * max(1, max|ref|). float16: the FlashAttention rule against the
    same computation in float32 (`low`): err(ours) <= 2 * err(low) + 1e-3."""
    msg = f"seed={seed} {what}"
    assert torch.equal(torch.isneginf(ours[1]), torch.isneginf(ref[1])), f"{msg}: -inf lse rows differ"
    for name, a, b, i in zip(("o", "lse", "dq", "dk", "dv"), ours, ref, range(5), strict=True):
        assert not torch.isnan(a).any(), f"{msg}: NaN in {name}"
        fin = torch.isfinite(b)
        err = (a.double()[fin] - b[fin]).abs().max().item() if fin.any() else 0.0
        scale = max(1.0, b[fin].abs().max().item()) if fin.any() else 1.0
        if low is None:
            assert err <= 1e-5 * scale, f"{msg}: {name} err {err:.3g}"
        else:
            bound = 2 * (low[i].double()[fin] - b[fin]).abs().max().item() + 1e-3 * scale
            assert err <= bound, f"{msg}: {name} err {err:.3g} > {bound:.3g}"


# (B, Hq, Hkv, Nq, Nk, d, causal, window, docs, dropout_p): docs = mean document length, "pair" variants use
# separate query / key ids; a covering set, not the cross product.
CASES = [
    (1, 2, 2, 96, 96, 16, True, 1, None, 0.0),  # window 1: each query sees only itself
    (1, 2, 2, 96, 96, 16, True, 24, None, 0.0),  # several skipped blocks on both sides
    (2, 2, 1, 70, 70, 32, True, 17, None, 0.0),  # ragged N, window not a block multiple, GQA
    (1, 2, 2, 40, 90, 16, True, 33, None, 0.0),  # Nq < Nk (bottom-right window)
    (1, 2, 2, 90, 40, 16, True, 9, None, 0.0),  # Nq > Nk: rows without keys
    (1, 2, 2, 50, 50, 16, True, 500, None, 0.0),  # window wider than N = plain causal
    (1, 2, 2, 96, 96, 16, True, None, 12.0, 0.0),  # documents
    (2, 2, 1, 77, 77, 32, True, None, 5.0, 0.0),  # many short documents (length-1 ones too), GQA
    (1, 2, 2, 96, 96, 16, False, None, 20.0, 0.0),  # bidirectional within documents
    (1, 2, 2, 96, 96, 16, True, 10, 30.0, 0.0),  # window and documents
    (1, 4, 2, 33, 80, 16, True, None, "pair", 0.0),  # Nq < Nk, separate ids: rows of absent docs see nothing
    (1, 2, 2, 64, 64, 16, True, None, None, 0.25),  # dropout
    (1, 4, 1, 45, 70, 16, True, None, None, 0.5),  # dropout, MQA, Nq < Nk
    (1, 2, 2, 80, 80, 32, True, 19, 16.0, 0.2),  # everything
]
# soft-capping c * tanh(s / c) (the last field), alone and with the other variants; `check` of the
# gradients covers the 1 - tanh^2 factor of dS (the inputs are scaled up so the cap bites: see `inputs`)
SOFTCAP_CASES = [
    (1, 2, 2, 64, 64, 16, True, None, None, 0.0, 2.0),  # causal, several blocks
    (1, 4, 1, 45, 70, 16, False, None, None, 0.0, 5.0),  # MQA, Nq < Nk, bidirectional
    (2, 4, 2, 70, 70, 32, True, 17, None, 0.0, 1.0),  # GQA and window
    (1, 2, 2, 90, 40, 16, True, None, None, 0.0, 3.0),  # Nq > Nk: rows without keys
    (1, 2, 2, 96, 96, 16, True, 10, 30.0, 0.0, 4.0),  # window and documents
    (1, 4, 2, 80, 80, 32, True, 19, 16.0, 0.2, 2.5),  # everything
]


@pytest.mark.parametrize(
    "B,Hq,Hkv,Nq,Nk,d,causal,window,docs,p,softcap", [(*c, None) for c in CASES] + SOFTCAP_CASES
)
def test_variant_matches_reference(seed, B, Hq, Hkv, Nq, Nk, d, causal, window, docs, p, softcap):
    g, q, k, v, do = inputs(seed, B, Hq, Hkv, Nq, Nk, d)
    if softcap is not None:  # scores of a few times the cap, so the tanh saturates on some of them
        q, k = q * 2.0, k * 2.0
    if docs is None:
        doc_ids = None
    elif docs == "pair":
        doc_k = random_doc_ids(g, B, Nk, 10.0)
        doc_q = torch.sort(torch.randint(-1, int(doc_k.max()) + 2, (B, Nq), generator=g), dim=-1).values
        doc_ids = (doc_q.to(torch.int32), doc_k)
    else:
        doc_ids = random_doc_ids(g, B, Nk, docs)
    kw = dict(causal=causal, window=window, doc_ids=doc_ids, softcap=softcap)
    dropout_seed = int(torch.randint(0, 2**62, (1,), generator=g)) if p > 0 else None
    ours = run_flash(q, k, v, do, dropout_p=p, dropout_seed=dropout_seed, **kw)
    keep = dropout_keep_mask(dropout_seed, B, Hq, Nq, Nk, p) if p > 0 else None
    ref = run_reference(q, k, v, do, dropout_keep=keep, dropout_p=p, **kw)
    check(seed, ours, ref, f"case={(B, Hq, Hkv, Nq, Nk, d, causal, window, docs, p, softcap)}")


@pytest.mark.parametrize("dtype", [F32, F16])
def test_softcap_saturated_scores_stay_finite(seed, dtype):
    """Scores in the hundreds with a cap of 5: almost every tanh is +-1, its derivative 0. No NaN or inf in
    o, lse or any gradient (fp16 included), and the values agree with float64: float32 tightly, float16 by
    the FlashAttention rule against the reference computed in float16 (the rule's "same precision" one:
    dS rounded to fp16 before its dots is what the kernels do too). GQA with a window."""
    g, q, k, v, do = inputs(seed, 1, 4, 2, 64, 64, 16, dtype)
    q, k = q * 6.0, k * 6.0  # |s| up to ~ 36 * 16 / 4
    kw = dict(window=40, softcap=5.0)
    ours = run_flash(q, k, v, do, **kw)
    for name, t in zip(("o", "lse", "dq", "dk", "dv"), ours, strict=True):
        assert torch.isfinite(t).all(), f"seed={seed} {dtype}: non-finite {name}"
    ref = run_reference(q, k, v, do, **kw)
    low = run_reference(q, k, v, do, dtype=F16, **kw) if dtype == F16 else None
    check(seed, ours, ref, f"saturated softcap {dtype}", low=low)


def test_softcap_none_is_bitwise_plain(seed):
    """softcap=None runs the kernels without the capping code: bitwise the call without the argument."""
    _, q, k, v, do = inputs(seed, 1, 2, 2, 40, 40, 16)
    plain = run_flash(q, k, v, do, window=9)
    none = run_flash(q, k, v, do, window=9, softcap=None)
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), plain, none, strict=True):
        assert torch.equal(a, b), f"seed={seed}: {name}"


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan"), True, "30"])
def test_softcap_errors_name_the_argument(bad):
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match=r"softcap must be None .* e\.g\. softcap=50\.0"):
        flash_attention(q, q, q, softcap=bad)


def test_float16_window_and_documents(seed):
    """FlashAttention test rule in float16 (interpreter: numpy fp16 dots), window with documents."""
    g, q, k, v, do = inputs(seed, 1, 2, 2, 80, 80, 32, F16)
    kw = dict(window=21, doc_ids=random_doc_ids(g, 1, 80, 25.0))
    ours = run_flash(q, k, v, do, **kw)
    ref = run_reference(q, k, v, do, **kw)
    low = run_reference(q, k, v, do, dtype=torch.float32, **kw)
    check(seed, ours, ref, "fp16 window+docs", low=low)


def test_bfloat16_inputs_give_bfloat16_outputs(seed):
    _, q, k, v, do = inputs(seed, 1, 2, 2, 40, 40, 16, torch.bfloat16)
    o, _, dq, dk, dv = run_flash(q, k, v, do, window=7, dropout_p=0.1, dropout_seed=3)
    assert all(t.dtype == torch.bfloat16 and torch.isfinite(t).all() for t in (o, dq, dk, dv)), f"seed={seed}"


# ------------------------------------------------------------------------------- block skipping


def _poison(t, rows, value=float("nan")):
    t = t.clone()
    t[:, :, rows] = value
    return t


def test_window_skips_key_blocks_outside_it(seed):
    """NaN in the first 16 keys' v: a query block whose window starts past them must never load them.
    (A visited block that only masks them would give NaN through 0 * NaN in P V.) Forward and dQ; then NaN
    in the last 16 query rows' dO for dK/dV of the first key blocks."""
    N, w = 96, 8
    _, q, k, v, do = inputs(seed, 1, 2, 2, N, N, 16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o = flash_attention(q, k, _poison(v, slice(0, 16)), window=w)
    # rows >= 64 see keys > 56 only: every tile of those rows lies wholly after key 16 (blocks <= 32)
    assert torch.isfinite(o[:, :, 64:]).all(), f"seed={seed}: a skipped key block was visited (forward)"
    assert torch.isnan(o[:, :, :16]).any(), f"seed={seed}: the poison did not reach the rows that see it"
    o = flash_attention(q, k, v, window=w)
    o.backward(_poison(do, slice(80, 96)))
    assert torch.isfinite(k.grad[:, :, :32]).all() and torch.isfinite(v.grad[:, :, :32]).all(), (
        f"seed={seed}: dK/dV visited query blocks outside the window"
    )
    assert torch.isfinite(q.grad[:, :, :80]).all(), f"seed={seed}: dQ of clean rows"


def test_documents_skip_blocks_of_other_documents(seed):
    """Two documents [0, 32) and [32, 96) (the boundary on a tile edge: a tile that straddles it would
    visit both): NaN in document 0's v never reaches document 1 (forward, dQ), and NaN in document 1's dO
    never reaches document 0's dK/dV, causal and bidirectional."""
    _, q, k, v, do = inputs(seed, 1, 2, 2, 96, 96, 16)
    doc = torch.tensor([[0] * 32 + [1] * 64], dtype=torch.int32)
    for causal in (True, False):
        o = flash_attention(q, k, _poison(v, slice(0, 32)), causal=causal, doc_ids=doc)
        assert torch.isfinite(o[:, :, 32:]).all(), f"seed={seed} causal={causal}: forward visited doc 0"
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        flash_attention(qq, kk, vv, causal=causal, doc_ids=doc).backward(_poison(do, slice(32, 96)))
        assert torch.isfinite(kk.grad[:, :, :32]).all() and torch.isfinite(vv.grad[:, :, :32]).all(), (
            f"seed={seed} causal={causal}: dK/dV of doc 0 visited doc 1's queries"
        )
        assert torch.isfinite(qq.grad[:, :, :32]).all(), f"seed={seed} causal={causal}: dQ of doc 0"


def test_document_ranges():
    """Each query row's key range is exactly its document's keys (checked against the boolean mask)."""
    g = torch.Generator().manual_seed(5)
    doc = random_doc_ids(g, 2, 50, 6.0)
    q_doc, k_doc = document_ranges(doc[:, 10:], doc)
    same = attention_mask(40, 50, causal=False, doc_ids=doc)[:, 0]
    j = torch.arange(50)
    from_ranges = (j >= q_doc[0][..., None]) & (j < q_doc[1][..., None])
    assert torch.equal(from_ranges, same)
    i = torch.arange(40)
    assert torch.equal((i >= k_doc[0][..., None]) & (i < k_doc[1][..., None]), same.transpose(1, 2))


# ------------------------------------------------------------------------------------- dropout


def test_dropout_zero_is_bitwise_no_dropout(seed):
    _, q, k, v, do = inputs(seed, 1, 2, 2, 40, 40, 16)
    plain = run_flash(q, k, v, do)
    zero = run_flash(q, k, v, do, dropout_p=0.0, dropout_seed=123)
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), plain, zero, strict=True):
        assert torch.equal(a, b), f"seed={seed}: {name} differs with dropout_p=0"


def test_dropout_same_seed_same_result_other_seed_other(seed):
    _, q, k, v, do = inputs(seed, 1, 2, 2, 40, 40, 16)
    a = run_flash(q, k, v, do, dropout_p=0.3, dropout_seed=seed)
    b = run_flash(q, k, v, do, dropout_p=0.3, dropout_seed=seed)
    c = run_flash(q, k, v, do, dropout_p=0.3, dropout_seed=seed + 1)
    for name, x, y in zip(("o", "lse", "dq", "dk", "dv"), a, b, strict=True):
        assert torch.equal(x, y), f"seed={seed}: {name} differs for the same dropout seed"
    assert not torch.equal(a[0], c[0]), f"seed={seed}: another dropout seed gave the same output"
    assert torch.equal(a[1], c[1]), f"seed={seed}: the LSE is the undropped one, independent of the seed"
    # seed None draws from torch's generator: torch.manual_seed makes it reproducible
    torch.manual_seed(seed)
    d = run_flash(q, k, v, do, dropout_p=0.3)
    torch.manual_seed(seed)
    e = run_flash(q, k, v, do, dropout_p=0.3)
    assert torch.equal(d[0], e[0]) and torch.equal(d[2], e[2]), f"seed={seed}: seed=None not reproducible"


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_keep_rate_within_binomial_bounds(seed, p):
    """Keep rate of n = 2 * 2 * 96 * 96 weights within 5 standard deviations of 1 - p, per head too; the
    masks of two heads and of the transposed position are not equal (the counter carries h, i and j)."""
    B, H, N = 2, 2, 96
    keep = dropout_keep_mask(seed, B, H, N, N, p)
    n = keep.numel()
    rate = keep.float().mean().item()
    sd = math.sqrt(p * (1 - p) / n)
    assert abs(rate - (1 - p)) <= 5 * sd, f"seed={seed}: keep rate {rate:.4f}, expected {1 - p:.2f}"
    per_head = keep.float().mean(dim=(-1, -2))
    sd_h = math.sqrt(p * (1 - p) / (N * N))
    assert ((per_head - (1 - p)).abs() <= 5 * sd_h).all(), f"seed={seed}: per-head rates {per_head}"
    assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0, 0], keep[1, 0])
    assert not torch.equal(keep[0, 0], keep[0, 0].T), f"seed={seed}: mask symmetric in (i, j)"
    # neighbouring elements are independent: agreement of horizontal neighbours ~ p^2 + (1 - p)^2
    agree = (keep[..., 1:] == keep[..., :-1]).float().mean().item()
    expect = p * p + (1 - p) ** 2
    assert abs(agree - expect) <= 5 * math.sqrt(expect * (1 - expect) / keep[..., 1:].numel()), (
        f"seed={seed}: neighbour agreement {agree:.4f}, expected {expect:.4f}"
    )


# -------------------------------------------------------------------------------------- errors


def _qkv(n=16, d=16):
    return torch.randn(1, 2, n, d), torch.randn(1, 2, n, d), torch.randn(1, 2, n, d)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(window=0), ValueError, "window must be None or an int >= 1"),
        (dict(window=True), ValueError, "window must be None or an int >= 1"),
        (dict(window=2.0), ValueError, "window must be None or an int >= 1"),
        (dict(window=4, causal=False), ValueError, "window needs causal=True"),
        (dict(dropout_p=1.0), ValueError, r"dropout_p must be a float in \[0, 1\)"),
        (dict(dropout_p=-0.1), ValueError, r"dropout_p must be a float in \[0, 1\)"),
        (dict(dropout_p=0.1, dropout_seed=-1), ValueError, "dropout_seed must be None, an int"),
        (dict(dropout_p=0.1, dropout_seed=torch.tensor([1.0])), ValueError, "one int64 element"),
        (dict(doc_ids=torch.zeros(1, 16)), TypeError, "must be an integer tensor"),
        (dict(doc_ids=torch.zeros(1, 15, dtype=torch.int32)), ValueError, r"doc_ids must be \(B, Nk\)"),
        (dict(doc_ids=torch.zeros(2, 16, dtype=torch.int32)), ValueError, "doc_ids have batch size 2"),
        (dict(doc_ids=torch.tensor([[1] * 8 + [0] * 8])), ValueError, "non-decreasing"),
        (dict(doc_ids="abc"), TypeError, "doc_ids must be a"),
    ],
)
def test_variant_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        flash_attention(*_qkv(), **kwargs)


def test_dropout_keep_mask_errors():
    with pytest.raises(ValueError, match="dropout_p must be a float"):
        dropout_keep_mask(1, 1, 1, 4, 4, 1.5)


# ---------------------------------------------------------------------------------- ops, compile


def test_ops_opcheck_with_variants(seed):
    """The ops' schemas, fake kernels and autograd stay consistent with the variants' arguments."""
    g, q, k, v, do = inputs(seed, 1, 2, 2, 40, 40, 16)
    q_doc, k_doc = document_ranges(*(random_doc_ids(g, 1, 40, 10.0),) * 2)
    s = torch.tensor([seed], dtype=torch.int64)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.library.opcheck(
        torch.ops.flashgpt.flash_attn_fwd_cpu.default, (q, k, v, True, 0.25, 9, q_doc, k_doc, 0.2, s)
    )
    torch.library.opcheck(  # soft-capping: the last argument
        torch.ops.flashgpt.flash_attn_fwd_cpu.default,
        (q, k, v, True, 0.25, 0, None, None, 0.0, None, False, 2.0),
    )
    o, lse = torch.ops.flashgpt.flash_attn_fwd_cpu(q, k, v, True, 0.25, 9, q_doc, k_doc, 0.2, s)
    torch.library.opcheck(
        torch.ops.flashgpt.flash_attn_bwd_cpu.default,
        (
            do,
            q.detach(),
            k.detach(),
            v.detach(),
            o.detach(),
            lse.detach(),
            True,
            0.25,
            None,
            9,
            q_doc,
            k_doc,
            0.2,
            s,
        ),
    )


def test_custom_op_equals_eager_path_bitwise(seed):
    """The op path (as torch.compile / fake tensors take it) and the eager autograd.Function agree bitwise."""
    g, q, k, v, do = inputs(seed, 1, 2, 2, 48, 48, 16)
    doc = random_doc_ids(g, 1, 48, 12.0)
    eager = run_flash(q, k, v, do, window=11, doc_ids=doc, dropout_p=0.2, dropout_seed=7)
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    q_doc, k_doc = document_ranges(doc, doc)
    o, lse = torch.ops.flashgpt.flash_attn_fwd_cpu(
        qq, kk, vv, True, 0.25, 11, q_doc, k_doc, 0.2, torch.tensor([7])
    )
    o.backward(do)
    for name, a, b in zip(
        ("o", "lse", "dq", "dk", "dv"), eager, (o, lse, qq.grad, kk.grad, vv.grad), strict=True
    ):
        assert torch.equal(a, b.detach()), f"seed={seed}: {name} differs between the op and the eager path"


def test_variant_kernels_compile_for_sm90():
    """The compiled path of every kernel with all variants on (window, documents, dropout), bf16 d = 64,
    ragged and even lengths; and the plain causal dK/dV tile at d = 128 still spills nothing (the variants'
    code must compile away when off)."""
    body = (
        "for even in (False, True):\n"
        "    for kernel in ('fwd', 'bwd_dkdv', 'bwd_dq'):\n"
        "        info = compile_kernel(kernel, torch.bfloat16, 64, even=even,\n"
        "                              variants=('window', 'doc', 'dropout', 'softcap'))\n"
        "        assert info.shared_bytes <= 227 * 1024 and info.uses_wgmma, info.line()\n"
        "        print(info.line())\n"
        "info = compile_kernel('bwd_dkdv', torch.bfloat16, 128, even=True)\n"
        "assert info.uses_tma and info.spill_store_bytes == 0, info.line()\n"
        "print(compile_kernel('fwd', torch.bfloat16, 64, even=True, inductor=True, variants=('window',\n"
        "                     'doc', 'dropout')).line())\n"
    )
    code = (
        "import os, torch\nos.environ.pop('TRITON_INTERPRET', None)\n"
        "from kernels.compile_report import compile_kernel\n" + body + "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=600
    )
    if "ptxas" in out.stderr and "not found" in out.stderr.lower():
        pytest.skip("Triton's NVIDIA backend (ptxas) is not available")
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]


# ------------------------------------------------------------------------ GPU (skipped without CUDA)


def _gpu_ready(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from kernels import _launch

    try:
        _launch.kernel_module(False)
    except _launch.FlashAttentionUnavailableError as e:
        pytest.skip(str(e))
    torch.set_float32_matmul_precision("highest")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("variant", ["window", "docs", "dropout", "softcap", "all"])
@pytest.mark.parametrize("h_kv", [4, 1])
def test_gpu_flash_attention_rule(seed, monkeypatch, dtype, d, variant, h_kv):
    """FlashAttention rule on the GPU: err(ours - ref32) <= 2 * err(ref_same_dtype - ref32) + 1e-5 for o and
    every gradient; ref32 / ref_same_dtype: the reference attention in float32 / the input dtype. 4 query
    heads over h_kv KV heads (1: multi-query); the LSE against float32 within 1e-3 (it is kept in float32)."""
    _gpu_ready(monkeypatch)
    B, H, N = 2, 4, 1000
    g = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(B, H, N, d, generator=g).to("cuda", dtype) for _ in range(2))
    k, v = (torch.randn(B, h_kv, N, d, generator=g).to("cuda", dtype) for _ in range(2))
    kw = {}
    if variant in ("window", "all"):
        kw["window"] = 129
    if variant in ("docs", "all"):
        kw["doc_ids"] = random_doc_ids(g, B, N, 150.0).cuda()
    if variant in ("softcap", "all"):
        kw["softcap"] = 2.0  # randn inputs: s ~ N(0, 1), so the cap bites on the tails
    p = 0.2 if variant in ("dropout", "all") else 0.0
    ours = run_flash(q, k, v, do, dropout_p=p, dropout_seed=seed, **kw)
    keep = dropout_keep_mask(seed, B, H, N, N, p, device="cuda") if p else None
    ref = run_reference(q, k, v, do, dtype=torch.float32, dropout_keep=keep, dropout_p=p, **kw)
    low = run_reference(q, k, v, do, dtype=dtype, dropout_keep=keep, dropout_p=p, **kw)
    what = f"seed={seed} {variant} {dtype} d={d} h_kv={h_kv}"
    for name, a, r, lo in zip(("o", "lse", "dq", "dk", "dv"), ours, ref, low, strict=True):
        assert not torch.isnan(a).any(), f"{what}: NaN in {name}"
        if name == "lse":
            fin = torch.isfinite(r)
            assert torch.equal(torch.isneginf(a), torch.isneginf(r)), f"{what}: -inf lse rows differ"
            err = (a.float()[fin] - r[fin]).abs().max().item()
            assert err <= 1e-3 * max(1.0, r[fin].abs().max().item()), f"{what}: lse err {err:.3g}"
            continue
        err = (a.float() - r).abs().max().item()
        bound = 2 * (lo.float() - r).abs().max().item() + 1e-5
        assert err <= bound, f"{what}: {name} err {err:.3g} > {bound:.3g}"


@pytest.mark.gpu
def test_gpu_compiled_equals_eager_with_variants(seed, monkeypatch):
    """torch.compile(fullgraph=True) of flash_attention with window, documents and dropout (a seed tensor:
    no recompilation per seed) gives the eager results bitwise."""
    _gpu_ready(monkeypatch)
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(2, 4, 512, 64, generator=g).to("cuda", torch.bfloat16) for _ in range(4))
    doc = random_doc_ids(g, 2, 512, 100.0).cuda()
    s = torch.tensor([seed], dtype=torch.int64, device="cuda")

    def f(q, k, v):
        return flash_attention(q, k, v, window=64, doc_ids=doc, dropout_p=0.1, dropout_seed=s)

    results = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        o = fn(qq, kk, vv)
        o.backward(do)
        results.append((o, qq.grad, kk.grad, vv.grad))
    for name, a, b in zip(("o", "dq", "dk", "dv"), *results, strict=True):
        assert torch.equal(a, b), f"seed={seed}: {name} compiled != eager"
