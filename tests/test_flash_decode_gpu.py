"""GPU tests of flash-decoding (kernels/flash_decode.py); skipped without CUDA.

Accuracy: the FlashAttention test rule, max|ours - ref64| <= 2 * max|torch_lowprec - ref64| + 1e-5, with
ref64 float64 attention from the same low-precision inputs and torch_lowprec naive PyTorch attention whose
probabilities are rounded to the input dtype before the product with v (as a bf16/fp16 kernel does).
Also: the triton_op path (opcheck, torch.compile fullgraph bitwise equal to eager; cache_seqlens=None
bitwise equal to full lengths) and cached greedy
generation of a small GPT equal to uncached generation with the flash backend on CUDA.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _compiled_triton(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from kernels import _launch

    try:
        _launch.kernel_module(False)
    except _launch.FlashAttentionUnavailableError as e:
        pytest.skip(str(e))


def _refs(q, k, v, lengths):
    """(ref64, torch_lowprec) outputs (B, Hq, Nq, d) float64 for rows i seeing keys j <= L_b - Nq + i."""
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
        ref[b] = torch.softmax(s64.masked_fill(~allowed, -math.inf), -1) @ vv.double()
        s32 = (q[b].float() @ kk.float().transpose(-1, -2)) / math.sqrt(d)
        p = torch.softmax(s32.masked_fill(~allowed, -math.inf), -1).to(q.dtype)
        low[b] = (p.float() @ vv.float()).to(q.dtype).double()
    return ref, low


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,hq,hkv", [(64, 12, 12), (128, 32, 8), (128, 8, 1)])
@pytest.mark.parametrize("nq", [1, 4, 16])
@pytest.mark.parametrize("n_max", [1000, 8192])
def test_fa_rule_ragged_gqa_gpu(seed, dtype, d, hq, hkv, nq, n_max):
    from kernels import flash_decode

    B = 3
    q = torch.randn(B, hq, nq, d, device="cuda", dtype=dtype)
    k = torch.randn(B, hkv, n_max, d, device="cuda", dtype=dtype)
    v = torch.randn(B, hkv, n_max, d, device="cuda", dtype=dtype)
    lengths = torch.tensor([n_max, nq, max(nq, n_max // 3 + 7)], dtype=torch.int32, device="cuda")
    o = flash_decode(q, k, v, lengths)
    ref, low = _refs(q, k, v, lengths)
    err = (o.double() - ref).abs().max().item()
    err_pt = (low - ref).abs().max().item()
    assert o.dtype == dtype and err <= 2 * err_pt + 1e-5, f"seed={seed}: err {err} vs torch {err_pt}"


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


def test_op_path_opcheck_and_compile_gpu(seed):
    from kernels import flash_decode
    from kernels.flash_decode import flash_decode_op

    q = torch.randn(2, 8, 1, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 2, 3000, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lengths = torch.tensor([3000, 1234], dtype=torch.int32, device="cuda")
    eager = flash_decode(q, k, v, lengths)
    compiled = torch.compile(lambda *a: flash_decode(*a), fullgraph=True)(q, k, v, lengths)
    assert torch.equal(eager, compiled), f"seed={seed}"
    result = torch.library.opcheck(flash_decode_op, (q, k, v, lengths, 0.125, 4))
    assert set(result.values()) == {"SUCCESS"}, result


def test_no_lengths_equals_full_lengths_gpu(seed):
    """cache_seqlens=None (HAS_SEQLENS=False, no lengths tensor) bitwise equals L_b = Nmax, eagerly and
    compiled (the triton_op takes None), and its opcheck passes."""
    from kernels import flash_decode
    from kernels.flash_decode import flash_decode_op

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


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("backend", ["flash", "sdpa", "naive"])
def test_cuda_graph_decode_gives_the_same_tokens_gpu(seed, monkeypatch, backend, compiled):
    """generate(cuda_graph=True) (model.decode_graph: the static step replayed as one CUDA graph) gives the
    static path's greedy tokens, bf16, batch 3; the prompt of the second call fills the block so the cache
    resets and prefills again under the same graph (the window slides); the graph is captured once."""
    from model import GPT, GPTConfig
    from model import decode_graph as dg

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
