"""GPU tests of `flash_attention_qkvpacked` (skipped without CUDA): bf16/fp16 equality with the separate path,
the FlashAttention accuracy rule, the compiled graph (our kernels, and no concatenation of dq, dk, dv), and
opcheck of the triton ops. Fresh seeded inputs; the seed is in every assertion message."""

import re

import pytest
import torch
from test_flash_gpu import BF16, F16, assert_fa_rule, naive_chunked

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _compiled_triton(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _inputs(seed, B, N, H, d, dtype):
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(B, N, 3, H, d, generator=g, device="cuda", dtype=dtype)
    do = torch.randn(B, N, H, d, generator=g, device="cuda", dtype=dtype)
    return qkv, do


def _views(qkv):
    return tuple(t.transpose(1, 2) for t in qkv.unbind(2))


def _packed(qkv, do):
    from kernels import flash_attention_qkvpacked

    x = qkv.detach().clone().requires_grad_()
    o = flash_attention_qkvpacked(x)
    o.backward(do)
    return o.detach(), x.grad


def _separate(qkv, do):
    from kernels import flash_attention

    x = qkv.detach().clone().requires_grad_()
    o = flash_attention(*_views(x)).transpose(1, 2)
    o.backward(do)
    return o.detach(), x.grad


# (dtype, B, N, H, d): the training shape, d = 128, ragged N (pointer loads), odd d
PACKED_CASES = [
    (BF16, 4, 1024, 12, 64),
    (F16, 2, 2048, 4, 128),
    (BF16, 3, 1000, 4, 64),
    (BF16, 1, 777, 2, 80),
]


@pytest.mark.parametrize("dtype,B,N,H,d", PACKED_CASES)
def test_packed_equals_separate_and_fa_rule_gpu(seed, monkeypatch, dtype, B, N, H, d):
    """Packed o and d(qkv) equal the separate path's bitwise (TMA and pointer-load tiles alike; the split
    backward: the one-pass Gluon one's dq has no fixed summation order, tests/test_gluon_bwd_gpu.py), and pass
    the FlashAttention rule against a float32 reference of the views."""
    monkeypatch.setenv("FLASHGPT_GLUON_BWD", "0")
    qkv, do = _inputs(seed, B, N, H, d, dtype)
    o, dqkv = _packed(qkv, do)
    so, sdqkv = _separate(qkv, do)
    assert torch.equal(o, so), f"seed={seed}: packed o differs from the separate path"
    assert torch.equal(dqkv, sdqkv), f"seed={seed}: packed d(qkv) differs from the separate path"
    q, k, v = _views(qkv)
    dob = do.transpose(1, 2)
    scale = d**-0.5
    ref = naive_chunked(q.float(), k.float(), v.float(), dob.float(), True, scale, torch.float32)
    low = naive_chunked(q, k, v, dob, True, scale, dtype)
    dq, dk, dv = _views(dqkv)
    assert_fa_rule(seed, (o.transpose(1, 2), dq, dk, dv), low, ref, f"packed {dtype} N={N} d={d}")


def _kernel_names(code: str) -> list[str]:
    return re.findall(r"def (triton_\w+|_\w+_kernel)\(", code)


def test_compiled_packed_graph_has_no_concat_gpu(seed):
    """Under torch.compile the packed backward writes d(qkv) itself: the generated code launches our kernels
    and holds no cat / stack / scatter kernel, where the separate path concatenates dq, dk, dv (checked, so
    the test can fail); compiled results equal eager bitwise."""
    from torch._inductor.utils import run_and_get_code

    from kernels import flash_attention, flash_attention_qkvpacked

    qkv, do = _inputs(seed, 4, 1024, 12, 64, BF16)

    def run(fn):
        torch._dynamo.reset()
        f = torch.compile(lambda x: (fn(x).float() * do.float()).sum(), fullgraph=True)
        x = qkv.detach().clone().requires_grad_()
        f(x).backward()
        return x.grad

    grad, codes = run_and_get_code(run, flash_attention_qkvpacked)
    names = _kernel_names("\n".join(codes))
    for kernel in ("_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel"):
        assert kernel in names, f"{kernel} not in the generated code: {names}"
    copies = [n for n in names if re.search("cat|stack|scatter", n)]
    assert not copies, f"packed graph copies d(qkv): {copies}"
    _, codes = run_and_get_code(run, lambda x: flash_attention(*_views(x)).transpose(1, 2))
    assert [n for n in _kernel_names("\n".join(codes)) if re.search("cat|stack", n)], "separate: no concat?"
    assert torch.equal(grad, _packed(qkv, do)[1]), f"seed={seed}: compiled d(qkv) differs from eager"


def test_packed_triton_ops_opcheck_gpu(seed):
    """torch.library.opcheck of the packed CUDA triton ops."""
    from kernels import flash_attn as fp

    qkv, do = _inputs(seed, 1, 256, 4, 64, BF16)
    torch.library.opcheck(fp.PACKED.fwd, (qkv.clone().requires_grad_(), True, 0.125))
    o, lse = fp.PACKED.fwd(qkv, True, 0.125)
    torch.library.opcheck(fp.PACKED.bwd, (do, qkv, o, lse, True, 0.125))
