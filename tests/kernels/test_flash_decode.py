"""Flash-decoding (kernels/flash_decode.py): one grid per check over {interpreter, cuda} (kernel_modes.py:
small shapes under the Triton interpreter on the CPU, the inference shapes on the GPU), then the CPU-only
rules and errors and the GPU-only launches (PDL, CUDA graphs, cached generation).

Accuracy: under the interpreter against float64 PyTorch (2e-5); on the GPU the FlashAttention rule,
max|ours - ref64| <= 2 * max|torch_lowprec - ref64| + 1e-5, with ref64 float64 attention from the same
low-precision inputs and torch_lowprec naive PyTorch attention whose probabilities are rounded to the input
dtype before the product with v (as a bf16/fp16 kernel does).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
from kernels import MAX_DECODE_ROWS, flash_decode  # noqa: E402
from kernels.flash_decode import flash_decode_cpu_op, flash_decode_op  # noqa: E402
from tests.kernel_modes import DEVICES, enter  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _mode(request, monkeypatch):
    """Grid tests name their mode in `device`; the others run under the interpreter, gpu-marked ones on
    CUDA."""
    params = getattr(request.node, "callspec", None)
    device = params.params.get("device") if params else None
    if device is None:
        device = "cuda" if request.node.get_closest_marker("gpu") else "interpreter"
    enter(device, monkeypatch)


def reference(q, k, v, lengths, scale=None, softcap=None):
    """float64 attention per sequence b over keys [0, L_b), row i seeing keys j <= L_b - Nq + i; GQA by
    repeating each KV head for its query heads; softcap c: scores c * tanh(s / c). Returns (o, natural-log
    lse)."""
    B, Hq, Nq, d = q.shape
    group = Hq // k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    o = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.zeros(q.shape[:3], dtype=torch.float64)
    for b in range(B):
        n = int(lengths[b])
        kk = k[b, :, :n].double().repeat_interleave(group, 0)
        vv = v[b, :, :n].double().repeat_interleave(group, 0)
        s = q[b].double() @ kk.transpose(-1, -2) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        allowed = torch.arange(n)[None, :] <= torch.arange(Nq)[:, None] + (n - Nq)
        s = s.masked_fill(~allowed, -math.inf)
        lse[b] = torch.logsumexp(s, -1)
        o[b] = torch.softmax(s, -1) @ vv
    return o, lse


def _refs(q, k, v, lengths, softcap=None):
    """(ref64, torch_lowprec) outputs (B, Hq, Nq, d) float64 for rows i seeing keys j <= L_b - Nq + i."""

    def cap(s):
        return s if softcap is None else softcap * torch.tanh(s / softcap)

    B, Hq, Nq, d = q.shape
    group = Hq // k.shape[1]
    ref = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    low = torch.zeros_like(ref)
    for b in range(B):
        n = int(lengths[b])
        kk = k[b, :, :n].repeat_interleave(group, 0)
        vv = v[b, :, :n].repeat_interleave(group, 0)
        cols, rows = torch.arange(n, device=q.device), torch.arange(Nq, device=q.device)
        allowed = cols[None, :] <= rows[:, None] + n - Nq
        s64 = (q[b].double() @ kk.double().transpose(-1, -2)) / math.sqrt(d)
        ref[b] = torch.softmax(cap(s64).masked_fill(~allowed, -math.inf), -1) @ vv.double()
        s32 = (q[b].float() @ kk.float().transpose(-1, -2)) / math.sqrt(d)
        p = torch.softmax(cap(s32).masked_fill(~allowed, -math.inf), -1).to(q.dtype)
        low[b] = (p.float() @ vv.float()).to(q.dtype).double()
    return ref, low


# (device, dtype, d, hq, hkv, nq, n_max, num_splits): the interpreter's ragged GQA cases (n_max 45: not a
# multiple of the tile or the split; d 24: not a power of two), the GPU's inference shapes
ACCURACY = [
    *(pytest.param("interpreter", torch.float32, 24, hq, hkv, nq, 45, sp)
      for hq, hkv in ((2, 2), (4, 1), (8, 2)) for nq in (1, 3) for sp in (1, 3, None)),
    *(pytest.param("cuda", dt, d, hq, hkv, nq, n, None, marks=pytest.mark.gpu)
      for dt in (torch.bfloat16, torch.float16) for d, hq, hkv in ((64, 12, 12), (128, 32, 8), (128, 8, 1))
      for nq in (1, 4, 16) for n in (1000, 8192)),
]  # fmt: skip


@pytest.mark.parametrize("device,dtype,d,hq,hkv,nq,n_max,num_splits", ACCURACY)
def test_matches_reference_ragged_gqa(seed, device, dtype, d, hq, hkv, nq, n_max, num_splits):
    """Three sequences: the full cache, only the new rows, a ragged length; GQA / MQA groups."""
    dev = torch.device("cpu" if device == "interpreter" else "cuda")
    B = 3
    q = torch.randn(B, hq, nq, d, device=dev, dtype=dtype)
    k = torch.randn(B, hkv, n_max, d, device=dev, dtype=dtype)
    v = torch.randn(B, hkv, n_max, d, device=dev, dtype=dtype)
    third = 20 if device == "interpreter" else max(nq, n_max // 3 + 7)
    lengths = torch.tensor([n_max, nq, third], dtype=torch.int32, device=dev)
    o, lse = flash_decode(q, k, v, lengths, num_splits=num_splits, return_lse=True)
    assert o.shape == q.shape and o.dtype == dtype and lse.shape == (B, hq, nq)
    if device == "interpreter":
        ref_o, ref_lse = reference(q, k, v, lengths)
        err = (o.double() - ref_o).abs().max().item()
        lerr = (lse.double() - ref_lse).abs().max().item()
        assert err < 2e-5 and lerr < 2e-5, f"seed={seed}: o err {err}, lse err {lerr}"
        return
    ref, low = _refs(q, k, v, lengths)
    err = (o.double() - ref).abs().max().item()
    err_pt = (low - ref).abs().max().item()
    assert err <= 2 * err_pt + 1e-5, f"seed={seed}: err {err} vs torch {err_pt}"


# (device, dtype, d, hq, hkv, nq, n_max, softcap, q_gain): the cap alone, with GQA and several rows, and on
# scores of a hundred times the cap (q_gain: every tanh saturated, fp16 included: no NaN, no inf)
SOFTCAP = [
    *(pytest.param("interpreter", dt, 16, hq, hkv, nq, 45, c, gain)
      for dt in (torch.float32, torch.float16)
      for hq, hkv, nq, c, gain in ((2, 2, 1, 2.0, 2.0), (8, 2, 3, 0.5, 1.0), (4, 1, 2, 1.0, 40.0))),
    *(pytest.param("cuda", dt, d, hq, hkv, 4, 4096, c, gain, marks=pytest.mark.gpu)
      for dt in (torch.bfloat16, torch.float16) for d, hq, hkv in ((64, 12, 12), (128, 32, 8))
      for c, gain in ((2.0, 1.0), (5.0, 40.0))),
]  # fmt: skip


@pytest.mark.parametrize("device,dtype,d,hq,hkv,nq,n_max,softcap,gain", SOFTCAP)
def test_softcap_matches_reference(seed, device, dtype, d, hq, hkv, nq, n_max, softcap, gain):
    """flash_decode(..., softcap=c) against the float64 reference with c * tanh(s / c) scores: float32
    tightly, 16-bit dtypes by the FlashAttention rule; ragged lengths, GQA / MQA."""
    dev = torch.device("cpu" if device == "interpreter" else "cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    q = (torch.randn(3, hq, nq, d, device=dev, generator=g) * gain).to(dtype)
    k, v = (torch.randn(3, hkv, n_max, d, device=dev, generator=g).to(dtype) for _ in range(2))
    lengths = torch.tensor([n_max, nq, n_max // 3 + 7], dtype=torch.int32, device=dev)
    o, lse = flash_decode(q, k, v, lengths, softcap=softcap, return_lse=True)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all(), f"seed={seed}: non-finite output"
    ref, low = _refs(q, k, v, lengths, softcap)
    err = (o.double() - ref).abs().max().item()
    if dtype == torch.float32:
        ref_o, ref_lse = reference(q.cpu(), k.cpu(), v.cpu(), lengths.cpu(), softcap=softcap)
        lerr = (lse.cpu().double() - ref_lse).abs().max().item()
        assert err < 2e-5 and lerr < 2e-5, f"seed={seed}: o err {err}, lse err {lerr}"
    else:
        bound = 2 * (low - ref).abs().max().item() + 1e-5
        assert err <= bound, f"seed={seed}: err {err} > {bound}"


@pytest.mark.parametrize("device", DEVICES)
def test_no_lengths_equals_full_lengths(seed, device):
    """cache_seqlens=None (no lengths tensor: the kernel compiles SEQLENS out) is bitwise the result of
    passing L_b = Nmax for every sequence, eagerly and through the op (the CPU op called directly, the
    compiled triton op on CUDA), whose opcheck takes None."""
    if device == "interpreter":
        q = torch.randn(2, 4, 3, 24)
        k, v = torch.randn(2, 2, 37, 24), torch.randn(2, 2, 37, 24)
        full = torch.full((2,), 37, dtype=torch.int32)
        o, lse = flash_decode(q, k, v, full, num_splits=3, return_lse=True)
        o2, lse2 = flash_decode(q, k, v, None, num_splits=3, return_lse=True)
        assert torch.equal(o, o2) and torch.equal(lse, lse2), f"seed={seed}"
        o3, lse3 = flash_decode_cpu_op(q, k, v, None, 1.0 / math.sqrt(24), 3)
        assert torch.equal(o, o3) and torch.equal(lse, lse3), f"seed={seed}"
        result = torch.library.opcheck(flash_decode_cpu_op, (q, k, v, None, 0.25, 3))
        assert set(result.values()) == {"SUCCESS"}, result
        return
    q = torch.randn(2, 8, 1, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 2, 3000, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    full = torch.full((2,), 3000, dtype=torch.int32, device="cuda")
    ref = flash_decode(q, k, v, full)
    assert torch.equal(flash_decode(q, k, v), ref), f"seed={seed}"
    compiled = torch.compile(lambda *a: flash_decode(*a), fullgraph=True)(q, k, v)
    assert torch.equal(compiled, ref), f"seed={seed}"
    result = torch.library.opcheck(flash_decode_op, (q, k, v, None, 0.125, 4))
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("device", DEVICES)
def test_op_path_equals_eager(seed, device):
    """Under torch.compile, fake tensors etc. flash_decode goes through its op (flashgpt::flash_decode_cpu,
    opaque; flashgpt::flash_decode, a triton op traced into the graph on CUDA): same kernels, bitwise the same
    result as the eager launch; the fake gives the shapes; opcheck passes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if device == "interpreter":
        q, k, v = torch.randn(2, 4, 2, 16), torch.randn(2, 2, 30, 16), torch.randn(2, 2, 30, 16)
        lengths = torch.tensor([30, 9], dtype=torch.int32)
        o, lse = flash_decode(q, k, v, lengths, num_splits=2, return_lse=True)
        o2, lse2 = flash_decode_cpu_op(q, k, v, lengths, 0.25, 2)
        assert torch.equal(o, o2) and torch.equal(lse, lse2), f"seed={seed}"
        with FakeTensorMode() as mode:
            fo = flash_decode(*(mode.from_tensor(t) for t in (q, k, v, lengths)))
        assert fo.shape == q.shape and fo.dtype == q.dtype
        result = torch.library.opcheck(flash_decode_cpu_op, (q, k, v, lengths, 0.25, 2))
        assert set(result.values()) == {"SUCCESS"}, result
        return
    q = torch.randn(2, 8, 1, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 2, 3000, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lengths = torch.tensor([3000, 1234], dtype=torch.int32, device="cuda")
    eager = flash_decode(q, k, v, lengths)
    compiled = torch.compile(lambda *a: flash_decode(*a), fullgraph=True)(q, k, v, lengths)
    assert torch.equal(eager, compiled), f"seed={seed}"
    result = torch.library.opcheck(flash_decode_op, (q, k, v, lengths, 0.125, 4))
    assert set(result.values()) == {"SUCCESS"}, result


# ---------------------------------------------------------------------------- interpreter only


def test_pdl_rule_and_split_rule(monkeypatch):
    """PDL only for eager launches on CUDA devices of compute capability >= 9. The GPU split rule (checked
    without a GPU through a stand-in for the device properties, 132 SMs as on the H200) gives the counts
    the session-13 sweep measured best (bench/NOTES.md): Hkv 8, 128-key tiles; the CPU rule 4 programs."""
    from types import SimpleNamespace

    from kernels.plan import _sms, decode_splits, use_pdl

    cpu = torch.device("cpu")
    assert not use_pdl(cpu, traced=False) and not use_pdl(cpu, traced=True)
    assert decode_splits(1000, 16, 1, _sms(cpu), 64) == 4 and decode_splits(1000, 16, 8, _sms(cpu), 64) == 1
    h200 = SimpleNamespace(multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: h200)
    sms = _sms(torch.device("cuda"))
    cases = {  # (context, batch, d) -> splits
        (8192, 1, 64): 16, (32768, 1, 64): 33, (8192, 16, 64): 2, (8192, 64, 64): 4,
        (8192, 1, 128): 16, (32768, 1, 128): 16, (8192, 16, 128): 1, (8192, 64, 128): 1,
        (1024, 1, 64): 2,  # 8 tiles: no split shorter than 4 tiles
    }  # fmt: skip
    for (ctx, b, d), want in cases.items():
        assert decode_splits(ctx, 128, b * 8, sms, d) == want, (ctx, b, d)


def test_strided_cache_view_default_lengths_and_scale(seed):
    """A prefix view of a bigger cache (as the model passes it), lengths None = Nmax, 16 rows."""
    cache = torch.randn(2, 2, 2, 64, 32)  # (k/v, B, Hkv, slots, d)
    k, v = cache[0, :, :, :40], cache[1, :, :, :40]
    q = torch.randn(2, 4, 40, 32).transpose(1, 2)[:, :, :MAX_DECODE_ROWS]  # strided (B, Hq, 16, d)
    o = flash_decode(q, k, v, softmax_scale=0.3)
    ref_o, _ = reference(q, k, v, [40, 40], scale=0.3)
    err = (o.double() - ref_o).abs().max().item()
    assert err < 2e-5, f"seed={seed}: {err}"


def test_float16_close_to_float64(seed):
    q = torch.randn(2, 4, 1, 64).half()
    k, v = torch.randn(2, 2, 37, 64).half(), torch.randn(2, 2, 37, 64).half()
    lengths = torch.tensor([37, 11])
    o = flash_decode(q, k, v, lengths, num_splits=2)
    ref_o, _ = reference(q, k, v, lengths)
    # the FlashAttention rule: no worse than twice PyTorch's own float16 error, plus 1e-5
    torch_err = 0.0
    for b, n in enumerate(lengths.tolist()):
        kk = k[b, :, :n].repeat_interleave(2, 0)
        vv = v[b, :, :n].repeat_interleave(2, 0)
        p = torch.softmax((q[b].float() @ kk.float().transpose(-1, -2) / 8.0), -1).half()
        torch_err = max(torch_err, (p.float() @ vv.float()).half().double().sub(ref_o[b]).abs().max().item())
    err = (o.double() - ref_o).abs().max().item()
    assert o.dtype == torch.float16 and err <= 2 * torch_err + 1e-5, f"seed={seed}: {err} vs {torch_err}"


def test_unchecked_lengths_are_clamped_to_the_cache(seed):
    """check_lengths=False reads no lengths on the host (no error for out-of-range ones) and the kernel
    clamps each length to [0, Nmax]: a length past the cache gives the full cache's result, bitwise, and no
    slot outside the cache is read (the cache is a prefix view of a bigger buffer holding NaN past it)."""
    buf = torch.full((2, 2, 2, 50, 16), float("nan"))  # (k/v, B, Hkv, slots, d)
    buf[:, :, :, :30] = torch.randn(2, 2, 2, 30, 16)
    k, v = buf[0, :, :, :30], buf[1, :, :, :30]
    q = torch.randn(2, 4, 1, 16)
    lengths = torch.tensor([30, 12], dtype=torch.int32)
    with pytest.raises(ValueError, match="max 45"):
        flash_decode(q, k, v, torch.tensor([45, 12], dtype=torch.int32))
    over = flash_decode(q, k, v, torch.tensor([45, 12], dtype=torch.int32), check_lengths=False)
    assert torch.equal(over, flash_decode(q, k, v, lengths, check_lengths=False)), f"seed={seed}"
    ref_o, _ = reference(q, k, v, lengths)
    err = (over.double() - ref_o).abs().max().item()
    assert err < 2e-5, f"seed={seed}: {err}"


def test_strided_and_int64_lengths(seed):
    """A strided lengths view (every other element of a buffer) means its own elements, not the buffer's
    first B; an unchecked int64 length past 2**32 clamps to Nmax like any other length past the cache
    (it once wrapped to its low 32 bits: 2**32 + 3 gave length 3's result)."""
    q, k, v = torch.randn(3, 2, 1, 16), torch.randn(3, 2, 40, 16), torch.randn(3, 2, 40, 16)
    buf = torch.tensor([1, 0, 7, 0, 40, 0], dtype=torch.int32)
    lengths = buf[::2]
    ref_o, _ = reference(q, k, v, lengths)
    for check in (True, False):
        o = flash_decode(q, k, v, lengths, check_lengths=check)
        err = (o.double() - ref_o).abs().max().item()
        assert err < 2e-5, f"seed={seed} check_lengths={check}: {err}"
    huge = torch.full((3,), 2**32 + 3, dtype=torch.int64)
    o = flash_decode(q, k, v, huge, check_lengths=False)
    assert torch.equal(o, flash_decode(q, k, v)), f"seed={seed}"


def test_bfloat16_runs_in_float32_under_interpreter(seed):
    q, k = torch.randn(1, 2, 2, 16).bfloat16(), torch.randn(1, 2, 9, 16).bfloat16()
    o = flash_decode(q, k, k)
    ref_o, _ = reference(q, k, k, [9])
    assert o.dtype == torch.bfloat16 and (o.double() - ref_o).abs().max().item() < 2e-2, f"seed={seed}"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(q=torch.randn(1, 2, 17, 16)), "1..16 query rows"),
        (dict(q=torch.randn(1, 3, 1, 16)), "multiple of KV heads"),
        (dict(q=torch.randn(1, 2, 1, 16).double()), "one dtype"),
        (dict(cache_seqlens=torch.tensor([0])), r"cache_seqlens must be in \[Nq=1"),
        (dict(cache_seqlens=torch.tensor([11])), "max 11"),
        (dict(cache_seqlens=torch.tensor([3.0])), "int32/int64 tensor"),
        (dict(num_splits=0), "num_splits must be an int >= 1"),
        (dict(check_lengths="no"), "check_lengths must be True or False"),
        (dict(check_lengths=None), "check_lengths must be True or False"),
        (dict(k_cache=torch.randn(1, 0, 10, 16), v_cache=torch.randn(1, 0, 10, 16)), "one KV head"),
        (dict(softmax_scale=True), "softmax_scale must be a finite float"),
        (dict(softcap=0.0), r"softcap must be None .* e\.g\. softcap=50\.0"),
        (dict(softcap=float("nan")), "softcap must be None"),
    ],
)
def test_errors(kwargs, match):
    args = dict(
        q=torch.randn(1, 2, 1, 16), k_cache=torch.randn(1, 2, 10, 16), v_cache=torch.randn(1, 2, 10, 16)
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        flash_decode(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), **args)


def test_read_floor_names_what_is_wrong():
    """bench.decode's read-floor provider: a clear error for inputs it cannot read as one flat stream, and
    per-program sums that add up to the sum of k and v (it reads every element once)."""
    from bench.decode import read_floor

    k, v = torch.randn(1, 2, 300, 16), torch.randn(1, 2, 300, 16)
    assert torch.allclose(read_floor(None, k, v).sum(), (k.sum() + v.sum()).float(), atol=1e-3)
    for bad_k, bad_v, match in (
        (k.transpose(2, 3), v.transpose(2, 3), "contiguous"),
        (k, v[..., :8].contiguous(), "one shape"),
        (k, v.double(), "one dtype"),
        (k, "v", "tensors k and v"),
    ):
        with pytest.raises(ValueError, match=match):
            read_floor(None, bad_k, bad_v)


def test_empty_batch_with_lengths():
    """B = 0 gives an empty result with or without a lengths tensor (no range check over nothing)."""
    q, k = torch.randn(0, 2, 1, 16), torch.randn(0, 2, 10, 16)
    for lengths in (None, torch.zeros(0, dtype=torch.int32)):
        assert flash_decode(q, k, k, lengths).shape == (0, 2, 1, 16)


def test_needs_interpreter_or_cuda(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        flash_decode(torch.randn(1, 1, 1, 16), torch.randn(1, 1, 4, 16), torch.randn(1, 1, 4, 16))


_DECODE_COMPILE_CASES = [  # (dtype, d, group, n_q): the first is GPT-2 style decode; the rest in the slow set
    ("bfloat16", 128, 8, 16),
    *(pytest.param(*c, marks=pytest.mark.slow) for c in [
        ("bfloat16", 128, 8, 1), ("float16", 64, 1, 16), ("float32", 64, 4, 1), ("float32", 128, 8, 16)]),
]  # fmt: skip


@pytest.mark.parametrize("dtype,d,group,n_q", _DECODE_COMPILE_CASES)
def test_kernels_compile_for_sm90(dtype, d, group, n_q):
    """No GPU here: compile both kernels for sm_90 as a launch would (the GPU tile, Triton's default 3
    stages), within an H100/H200 block's shared memory (catches compiled-mode-only errors and a tile too
    big; GPU accuracy is the cuda params'). In a fresh process without TRITON_INTERPRET:
    the kernels are compiled or interpreted per process (the one of this test may run the interpreter).
    A cold compile takes about 20 s a case, so the default set compiles one case and the slow set the rest."""
    code = f"""
import os, sys, torch, triton
if not os.path.exists(triton.knobs.nvidia.ptxas.path): print('SKIP no ptxas'); sys.exit(0)
from kernels.compile_report import compile_decode_kernel
dtype, d, group, n_q = torch.{dtype}, {d}, {group}, {n_q}
for has_seqlens in (True, False):
    split = compile_decode_kernel('split', dtype, d, group=group, n_q=n_q, num_stages=3,
                                  has_seqlens=has_seqlens, pdl=True, softcap=not has_seqlens)
    combine = compile_decode_kernel('combine', dtype, d, group=group, n_q=n_q, num_stages=3, pdl=True)
    where = (dtype, d, group, n_q, has_seqlens)
    assert split.metadata.shared <= 227 * 1024 and combine.asm['ptx'], (where, split.metadata.shared)
    # as a Hopper launch: both kernels wait for their predecessor (PDL) before touching memory
    for ptx in (split.asm['ptx'], combine.asm['ptx']):
        assert 'griddepcontrol.wait' in ptx, where
    if dtype != torch.float32:
        assert 'mma' in split.asm['ptx'], where  # the tile products run on tensor cores
print('ok')
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=600
    )
    if "SKIP" in out.stdout:
        pytest.skip("Triton's NVIDIA backend (ptxas) is not available")
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]


def test_decode_bench_dry_run(tmp_path):
    """bench.decode's plumbing on the CPU: every provider checked against the reference, then timed."""
    from bench import decode

    code = decode.main(
        [
            "--dry-run",
            "--out",
            str(tmp_path),
            "--contexts",
            "40",
            "--batches",
            "2",
            "--dims",
            "16",
            "--groups",
            "4",
            "--kv-heads",
            "2",
            "--providers",
            "flash-decode,naive,sdpa-math",
            "--e2e",
            "--e2e-backends",
            "naive",
            "--prompt-len",
            "4",
            "--new-tokens",
            "3",
        ]
    )
    assert code == 0
    data = __import__("json").loads((tmp_path / "decode_dryrun.json").read_text())
    assert [r["status"] for r in data["kernel"]] == ["ok"] * 3, data["kernel"]
    assert all(r["max_abs_err"] < 1e-4 for r in data["kernel"])
    assert [r["status"] for r in data["e2e"]] == ["ok"] * 3 and data["meta"]["copy_ceiling_gbs"] > 0
    # the three e2e modes; the dry run compiles with dynamo's eager backend (no Inductor) and says so
    assert [(r["mode"], r["static_decode"]) for r in data["e2e"]] == [
        ("eager", False),
        ("static", True),
        ("compiled", True),
    ]
    compiled = data["e2e"][2]
    assert compiled["compile_backend"] == "eager" and compiled["recompiles"] == 0, compiled
    assert data["meta"]["complete"] is True
    md = (tmp_path / "decode_dryrun.md").read_text()
    assert "flash-decode" in md and "| naive | compiled | 2 |" in md and "no Inductor" in md
    assert "Incomplete" not in md


@pytest.mark.slow  # over 5 s on 2 cores
def test_decode_bench_dry_run_defaults_are_tiny(tmp_path):
    """`--dry-run` alone (what the README shows) runs tiny shapes on the CPU, not the GPU grid (contexts up
    to 131072, batch 64: gigabytes of cache and hours under the interpreter)."""
    from bench import decode

    assert decode.main(["--dry-run", "--out", str(tmp_path), "--providers", "flash-decode,naive"]) == 0
    data = __import__("json").loads((tmp_path / "decode_dryrun.json").read_text())
    assert data["kernel"] and all(r["status"] == "ok" for r in data["kernel"]), data["kernel"]
    assert max(r["context"] for r in data["kernel"]) <= 100 and max(r["batch"] for r in data["kernel"]) <= 2


# ---------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("d,hkv,group", [(64, 8, 4), (128, 2, 8), (256, 1, 1)])
def test_pdl_launches_equal_plain_launches_gpu(seed, d, hkv, group):
    """The eager default on Hopper (both kernels launched with programmatic dependent launch) gives bitwise
    the output and LSE of plain launches, eagerly and inside a CUDA graph of 3 back-to-back calls (where
    each call's split kernel overlaps the previous call's combine), ragged lengths with NaN past them."""
    from kernels.flash_decode import _launch_decode
    from kernels.plan import use_pdl as _use_pdl

    if not _use_pdl(torch.device("cuda"), traced=False):
        pytest.skip("PDL launches are the default from compute capability 9.0")
    B, n_max = 3, 2000
    q = torch.randn(B, hkv * group, 2, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, hkv, n_max, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lengths = torch.tensor([n_max, 2, 777], dtype=torch.int32, device="cuda")
    for b in range(B):
        k[b, :, int(lengths[b]) :] = float("nan")
        v[b, :, int(lengths[b]) :] = float("nan")
    scale = d**-0.5
    plain = _launch_decode(q, k, v, lengths, scale, 5, _pdl=False)
    fast = _launch_decode(q, k, v, lengths, scale, 5)
    assert not plain[0].isnan().any(), f"seed={seed}"
    assert all(torch.equal(a, b) for a, b in zip(fast, plain, strict=True)), f"seed={seed}"
    graph = torch.cuda.CUDAGraph()
    _launch_decode(q, k, v, lengths, scale, 5)  # warm-up outside the capture
    with torch.cuda.graph(graph):
        outs = [_launch_decode(q, k, v, lengths, scale, 5) for _ in range(3)]
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(o[0], plain[0]) and torch.equal(o[1], plain[1]) for o in outs), f"seed={seed}"


@pytest.mark.gpu
@pytest.mark.parametrize("static_decode", [False, True])
def test_cached_generation_equals_uncached_flash_gpu(seed, static_decode):
    from model import GPT, GPTConfig

    cfg = GPTConfig(block_size=64, vocab_size=97, n_layer=2, n_head=4, n_embd=64, attention="flash")
    model = GPT(cfg).cuda().eval()
    idx = torch.randint(0, 97, (2, 5), device="cuda")
    with torch.no_grad():
        cached = model.generate(idx, 40, temperature=0.0, use_cache=True, static_decode=static_decode)
        plain = model.generate(idx, 40, temperature=0.0, use_cache=False)
    assert torch.equal(cached, plain), f"seed={seed}"


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("backend", ["flash", "sdpa", "naive"])
def test_cuda_graph_decode_gives_the_same_tokens_gpu(seed, monkeypatch, backend, compiled):
    """generate(cuda_graph=True) (model.generate: the static step replayed as one CUDA graph) gives the
    static path's greedy tokens, bf16, batch 3; the prompt of the second call fills the block so the cache
    resets and prefills again under the same graph (the window slides); the graph is captured once."""
    from model import GPT, GPTConfig
    from model import generate as dg

    cfg = GPTConfig(block_size=48, vocab_size=97, n_layer=2, n_head=4, n_embd=64, attention=backend)
    model = GPT(cfg).cuda().to(torch.bfloat16).eval()
    if compiled:
        model._decode_static = torch.compile(model._decode_static)
    captures = []
    real = dg.DecodeGraph.__init__
    monkeypatch.setattr(dg.DecodeGraph, "__init__", lambda self, *a: captures.append(1) or real(self, *a))
    g = torch.Generator(device="cuda").manual_seed(seed)
    for n_prompt, new in ((5, 30), (44, 20)):
        idx = torch.randint(0, 97, (3, n_prompt), device="cuda", generator=g)
        with torch.no_grad():
            static = model.generate(idx, new, temperature=0.0, static_decode=True)
            graphed = model.generate(idx, new, temperature=0.0, cuda_graph=True)
        assert torch.equal(graphed, static), f"seed={seed} {backend} prompt {n_prompt}: tokens differ"
    assert len(captures) == 1, f"seed={seed}: {len(captures)} captures for one batch size"
    dg.release(model)
    assert "_decode_graph" not in model.__dict__
