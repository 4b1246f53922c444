"""GPU tests of our Triton FlashAttention-2 (run by the lead on an H200; skipped without CUDA).

Accuracy rule (the FlashAttention test-suite rule): for the output and each gradient,
    max|ours - ref| <= 2 * max|torch_same_dtype - ref| + 1e-5
where ref is naive attention computed in float32 (IEEE matmuls, no TF32) from the same low-precision
inputs, and torch_same_dtype is naive PyTorch attention computed in the input dtype (bf16 / fp16).
Naive references are computed in chunks of query rows so N = 16384 fits in memory.

Also: GQA/MQA, Nq != Nk, strided inputs, determinism (bitwise-identical gradients), peak memory of
forward + backward linear in N, and torch.compile(fullgraph=True) of a small module.
Inputs are fresh torch.randn with a per-test random seed shown in every assertion message.
"""

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

TOKENS = 16384  # B * N per test case


@pytest.fixture(autouse=True)
def _compiled_triton(monkeypatch):
    """These tests need compiled kernels: make sure the interpreter is off for them."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from kernels import _launch

    try:
        _launch.kernel_module(False)
    except _launch.FlashAttentionUnavailableError as e:
        pytest.skip(str(e))


@pytest.fixture(autouse=True)
def _ieee_fp32_matmul():
    """The float32 reference must not use TF32."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)


def gluon_sm90_env(monkeypatch, env: str):
    """Body of the Gluon GPU tests' autouse fixture (``yield from``): skip without an sm_90 GPU, compiled
    kernels, ``env`` = 1 (the Gluon kernel wherever it can run), no TF32 in the float32 reference."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are for sm_90 (H100 / H200)")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv(env, "1")
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)


def spy_launches(monkeypatch, module, name: str, shape_of) -> list:
    """Replace ``module.name`` (a launcher) by a spy that records ``shape_of(*args)`` per call; the list."""
    calls = []
    real = getattr(module, name)

    def spy(*args):
        calls.append(tuple(shape_of(*args)))
        real(*args)

    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.fixture
def split_bwd(monkeypatch):
    """The split Triton backward even where the one-pass Gluon one would run (sm_90, N >= MIN_N_BWD): for the
    tests of its bitwise properties (tests/kernels/test_gluon_bwd_gpu.py tests the Gluon one)."""
    monkeypatch.setenv("FLASHGPT_GLUON_BWD", "0")


@pytest.fixture
def triton_only(split_bwd, monkeypatch):
    """The Triton forward and split backward at every N, also where the Gluon kernels would run (sm_90,
    N >= MIN_N / MIN_N_BWD; tests/kernels/test_gluon_*_gpu.py test those)."""
    monkeypatch.setenv("FLASHGPT_GLUON_FWD", "0")


def _flash():
    from kernels import flash_attention

    return flash_attention


def naive_chunked(q, k, v, do, causal, scale, dtype, chunk_elems=2**28):
    """Naive attention computed in `dtype` (scores, softmax and matmuls), chunked over query rows.

    Returns (o, dq, dk, dv) in `dtype`. Bottom-right causal mask; rows without a visible key give 0.
    chunk_elems bounds the size of one (B, H, rows, Nk) score block.
    """
    q = q.detach().to(dtype).requires_grad_()
    k = k.detach().to(dtype).requires_grad_()
    v = v.detach().to(dtype).requires_grad_()
    do = do.to(dtype)
    B, Hq, Nq, _ = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    rows = max(1, chunk_elems // (B * Hq * Nk))
    o = torch.empty_like(q, requires_grad=False)
    cols = torch.arange(Nk, device=q.device)
    for r0 in range(0, Nq, rows):
        r1 = min(Nq, r0 + rows)
        kk = k.repeat_interleave(group, dim=1)
        vv = v.repeat_interleave(group, dim=1)
        s = torch.matmul(q[:, :, r0:r1], kk.transpose(-1, -2)) * scale
        if causal:
            i = torch.arange(r0, r1, device=q.device)[:, None]
            mask = cols[None, :] <= i + (Nk - Nq)
        else:
            mask = torch.ones(r1 - r0, Nk, dtype=torch.bool, device=q.device)
        row_any = mask.any(-1, keepdim=True)
        s = s.masked_fill(~mask, float("-inf")).masked_fill(~row_any, 0.0)
        p = torch.softmax(s, dim=-1) * mask.to(dtype)
        oc = torch.matmul(p, vv)
        oc.backward(do[:, :, r0:r1])
        o[:, :, r0:r1] = oc.detach()
        del s, p, oc
    return o, q.grad, k.grad, v.grad


def flash_with_grads(q, k, v, do, causal):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = _flash()(q, k, v, causal=causal)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


def assert_fa_rule(seed, ours, low, ref, what):
    for name, a, b, r in zip(("o", "dq", "dk", "dv"), ours, low, ref, strict=True):
        assert torch.isfinite(a).all(), f"seed={seed} {what}: non-finite {name}"
        err = (a.float() - r.float()).abs().max().item()
        base = (b.float() - r.float()).abs().max().item()
        assert err <= 2 * base + 1e-5, (
            f"seed={seed} {what}: {name} max err {err:.3g} > 2 * torch-{a.dtype} err {base:.3g} + 1e-5"
        )


def make_inputs(seed, B, Hq, Hkv, Nq, Nk, d, dtype):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Hq, Nq, d, generator=g, device="cuda", dtype=dtype)
    k = torch.randn(B, Hkv, Nk, d, generator=g, device="cuda", dtype=dtype)
    v = torch.randn(B, Hkv, Nk, d, generator=g, device="cuda", dtype=dtype)
    do = torch.randn(B, Hq, Nq, d, generator=g, device="cuda", dtype=dtype)
    return q, k, v, do


BF16, F16 = torch.bfloat16, torch.float16
# (dtype, Hq, Hkv, Nq, Nk, d, causal); B = TOKENS // Nq
CASES = [
    (BF16, 4, 4, 1024, 1024, 64, True),
    (F16, 4, 4, 1024, 1024, 64, True),
    (BF16, 4, 4, 4096, 4096, 128, True),
    (F16, 4, 4, 4096, 4096, 128, False),
    (BF16, 2, 2, 16384, 16384, 128, True),
    (F16, 2, 2, 16384, 16384, 64, True),
    (BF16, 4, 4, 2000, 2000, 80, True),  # odd N, odd d
    (F16, 4, 4, 777, 777, 96, False),
    (BF16, 8, 2, 4096, 4096, 128, True),  # GQA
    (F16, 4, 1, 1000, 3000, 64, True),  # MQA, Nq < Nk (bottom-right causal)
    (BF16, 4, 2, 3000, 1000, 64, True),  # GQA, Nq > Nk (rows without keys)
]


@pytest.mark.parametrize("dtype,Hq,Hkv,Nq,Nk,d,causal", CASES)
def test_fa_accuracy_rule(seed, dtype, Hq, Hkv, Nq, Nk, d, causal):
    B = max(1, TOKENS // Nq)
    q, k, v, do = make_inputs(seed, B, Hq, Hkv, Nq, Nk, d, dtype)
    scale = 1.0 / math.sqrt(d)
    ours = flash_with_grads(q, k, v, do, causal)
    low = naive_chunked(q, k, v, do, causal, scale, dtype)
    ref = naive_chunked(q, k, v, do, causal, scale, torch.float32)
    assert_fa_rule(seed, ours, low, ref, f"case={(dtype, B, Hq, Hkv, Nq, Nk, d, causal)}")


def test_rows_without_keys_gpu(seed):
    """Causal, Nq > Nk: the first Nq - Nk rows give o = 0, lse = -inf and zero dq; nothing is NaN."""
    q, k, v, do = make_inputs(seed, 2, 4, 2, 700, 300, 64, BF16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o, lse = _flash()(q, k, v, causal=True, return_lse=True)
    o.backward(do)
    empty = 700 - 300
    assert torch.all(o[:, :, :empty] == 0), f"seed={seed}"
    assert torch.all(torch.isneginf(lse[:, :, :empty])), f"seed={seed}"
    assert torch.all(q.grad[:, :, :empty] == 0), f"seed={seed}"
    for t in (o, q.grad, k.grad, v.grad):
        assert torch.isfinite(t).all(), f"seed={seed}"


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_strided_fused_qkv_gpu(seed, dtype):
    """q, k, v sliced from a fused (B, N, 3, H, d) tensor and transposed: same bits as contiguous inputs."""
    B, N, H, d = 4, 2048, 4, 64
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(B, N, 3, H, d, generator=g, device="cuda", dtype=dtype)
    do = torch.randn(B, H, N, d, generator=g, device="cuda", dtype=dtype)
    results = []
    for contiguous in (False, True):
        xx = x.clone().requires_grad_()
        q, k, v = (xx[:, :, i].transpose(1, 2) for i in range(3))
        if contiguous:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        o = _flash()(q, k, v, causal=True)
        o.backward(do)
        results.append((o.detach(), xx.grad))
    assert torch.equal(results[0][0], results[1][0]), f"seed={seed}"
    assert torch.equal(results[0][1], results[1][1]), f"seed={seed}"


@pytest.mark.parametrize("Hq,Hkv", [(8, 8), (8, 2)])
def test_backward_deterministic_gpu(seed, split_bwd, Hq, Hkv):
    """The split backward has no atomics: bitwise-identical gradients across runs (MHA and GQA)."""
    q, k, v, do = make_inputs(seed, 2, Hq, Hkv, 4096, 4096, 128, BF16)
    a = flash_with_grads(q, k, v, do, True)
    b = flash_with_grads(q, k, v, do, True)
    for name, x, y in zip(("o", "dq", "dk", "dv"), a, b, strict=True):
        assert torch.equal(x, y), f"seed={seed}: {name} differs between runs"


def test_peak_memory_linear_in_n(seed):
    """Forward + backward peak memory (above the inputs) grows ~linearly in N: x2 for 2N, not x4."""
    B, H, d = 1, 16, 64
    flash = _flash()

    def peak(N):
        q, k, v, do = make_inputs(seed, B, H, H, N, N, d, BF16)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        flash(q, k, v, causal=True).backward(do)  # warm-up / compile
        q.grad = k.grad = v.grad = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        flash(q, k, v, causal=True).backward(do)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    p1, p2, p4 = peak(4096), peak(8192), peak(16384)
    msg = f"seed={seed} peak extra bytes N=4096: {p1}, 8192: {p2}, 16384: {p4}"
    assert 1.6 <= p2 / p1 <= 2.5, msg
    assert 1.6 <= p4 / p2 <= 2.5, msg
    # far below a single N x N score matrix per head in bf16
    assert p4 < 0.05 * B * H * 16384 * 16384 * 2, msg


def test_torch_compile_fullgraph_gpu(seed):
    """torch.compile(fullgraph=True) (inductor) of a tiny attention module: forward and backward
    without graph breaks, matching eager."""
    flash = _flash()

    class TinyAttention(torch.nn.Module):
        def __init__(self, dim=256, heads=4):
            super().__init__()
            self.heads = heads
            self.qkv = torch.nn.Linear(dim, 3 * dim)
            self.proj = torch.nn.Linear(dim, dim)

        def forward(self, x):
            B, N, C = x.shape
            qkv = self.qkv(x).view(B, N, 3, self.heads, C // self.heads)
            q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
            y = flash(q, k, v, causal=True)
            return self.proj(y.transpose(1, 2).reshape(B, N, C))

    torch.manual_seed(seed)
    model = TinyAttention().cuda().to(BF16)
    x = torch.randn(2, 512, 256, device="cuda", dtype=BF16)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x)
    out.float().square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    ref = model(x)
    ref.float().square().mean().backward()
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= 2e-2 * ref.float().abs().max().item(), f"seed={seed} compiled vs eager output err {err:.3g}"
    for g, p in zip(grads, model.parameters(), strict=True):
        gerr = (g.float() - p.grad.float()).abs().max().item()
        assert gerr <= 5e-2 * p.grad.float().abs().max().item() + 1e-6, f"seed={seed} grad err {gerr:.3g}"


@pytest.mark.parametrize(
    "layout,Hq,Hkv,N,d",
    [
        ("bhnd", 8, 2, 1024, 128),
        ("fused", 12, 12, 1024, 64),
        ("bhnd", 4, 4, 4096, 64),
        ("fused", 8, 8, 2048, 128),
    ],
)
def test_tma_backward_bitwise_gpu(seed, split_bwd, layout, Hq, Hkv, N, d):
    """Tensor-descriptor (TMA) loads in the compiled backward: same tiles, so bitwise-identical gradients
    to the pointer loads, for contiguous heads with GQA and for the trainer's fused-qkv layout (N a
    multiple of the blocks: the launcher's condition for TMA)."""
    from kernels import override_tile_config
    from kernels.plan import tma_operand

    B = 2
    q, k, v, do = make_inputs(seed, B, Hq, Hkv, N, N, d, BF16)
    if layout == "fused":
        qkv = torch.cat([t.transpose(1, 2).reshape(B, N, -1) for t in (q, k, v)], dim=2)
        q, k, v = (x.view(B, N, -1, d).transpose(1, 2) for x in qkv.split([Hq * d, Hkv * d, Hkv * d], 2))
    for t in (q, k, v):
        assert tma_operand(t, d) is not None
    with override_tile_config(tma=True):
        tma = flash_with_grads(q, k, v, do, True)
    with override_tile_config(tma=False):
        ptr = flash_with_grads(q, k, v, do, True)
    for name, a, b in zip(("o", "dq", "dk", "dv"), tma, ptr, strict=True):
        assert torch.equal(a, b), f"seed={seed} {layout}: {name} differs between TMA and pointer loads"


@pytest.mark.parametrize("N", [2000, 2048])
@pytest.mark.parametrize("which", ["q", "k", "v", "do"])
def test_tma_neighbour_non_finite_does_not_leak_gpu(seed, which, N):
    """Default tiles (TMA where chosen): a NaN/inf in head 1 must not reach head 0 (with N not a multiple of
    the blocks a descriptor would read head 1's rows past N; the launcher then uses pointer loads); head 0
    equals the pointer-load result bitwise."""
    from kernels import override_tile_config

    q, k, v, do = make_inputs(seed, 2, 4, 4, N, N, 64, BF16)
    t = dict(q=q, k=k, v=v, do=do)[which]
    t[:, 1] = float("nan")
    t[:, 1, 5] = float("inf")
    default = flash_with_grads(q, k, v, do, True)
    with override_tile_config(tma=False):
        pointers = flash_with_grads(q, k, v, do, True)
    for name, a, b in zip(("o", "dq", "dk", "dv"), default, pointers, strict=True):
        assert torch.isfinite(a[:, 0]).all(), f"seed={seed} {which}: non-finite {name} leaked into head 0"
        assert torch.equal(a[:, 0], b[:, 0]), f"seed={seed} {which}: {name} head 0 differs from pointer loads"


# ------------------------------------------------------------------- torch.compile: the kernels in the graph


def _compiled_fwd_bwd(q, k, v, do, mode=None):
    """flash_attention forward + backward through torch.compile (Inductor); returns (o, dq, dk, dv).

    Inductor's FX-graph and AOTAutograd caches are off: they key on the traced graph, which is the same
    whichever kernel FLASHGPT_GLUON_FWD / _BWD route to, so a cached graph could hold the other kernels."""
    import torch._functorch.config
    import torch._inductor.config

    flash = _flash()
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: flash(q, k, v, causal=True), fullgraph=True, mode=mode)
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        return _run_compiled(f, qs, ks, vs, do, mode)


def _run_compiled(f, qs, ks, vs, do, mode):
    out = None
    for _ in range(3):  # CUDA graphs record on a later call: check a replay, not only the warm-up
        for t in (qs, ks, vs):
            t.grad = None
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        o = f(qs, ks, vs)
        o.backward(do)
        out = (o.detach().clone(), qs.grad.clone(), ks.grad.clone(), vs.grad.clone())
    return out


@pytest.mark.parametrize("Hq,Hkv,N,d", [(12, 12, 1024, 64), (8, 2, 2048, 128), (4, 4, 4096, 64)])
def test_compiled_graph_holds_the_triton_kernels_gpu(seed, triton_only, Hq, Hkv, N, d):
    """Under torch.compile the generated code launches our Triton kernels itself (triton_op +
    wrap_triton): the forward and backward code define _fwd_kernel / _bwd_dq_kernel / _bwd_dkdv_kernel
    and never call back into the flashgpt Python ops; the results equal eager mode bitwise."""
    from torch._inductor.utils import run_and_get_code

    q, k, v, do = make_inputs(seed, 2, Hq, Hkv, N, N, d, BF16)
    out, codes = run_and_get_code(_compiled_fwd_bwd, q, k, v, do)
    code = "\n".join(codes)
    for kernel in ("_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel"):
        assert f"def {kernel}" in code, f"{kernel} not in the generated code"
    assert "torch.ops.flashgpt" not in code, "the compiled graph calls the Python op"
    eager = flash_with_grads(q, k, v, do, True)
    for name, a, b in zip(("o", "dq", "dk", "dv"), out, eager, strict=True):
        assert torch.equal(a, b), f"seed={seed}: compiled {name} differs from eager"


def test_cuda_graphs_equal_default_compile_gpu(seed):
    """mode="reduce-overhead" (CUDA graphs around the compiled graph, our kernels inside) gives the
    same bits as the default mode, on a replay."""
    q, k, v, do = make_inputs(seed, 4, 12, 12, 1024, 1024, 64, BF16)
    graphs = _compiled_fwd_bwd(q, k, v, do, mode="reduce-overhead")
    default = _compiled_fwd_bwd(q, k, v, do)
    for name, a, b in zip(("o", "dq", "dk", "dv"), graphs, default, strict=True):
        assert torch.equal(a, b), f"seed={seed}: {name} differs under CUDA graphs"


def test_triton_ops_opcheck_gpu(seed):
    """torch.library.opcheck of the CUDA triton ops: schema, fake tensors (traced body), autograd
    registration and AOT dispatch are consistent."""
    q, k, v, do = make_inputs(seed, 1, 4, 2, 256, 256, 64, BF16)
    args = tuple(t.clone().requires_grad_() for t in (q, k, v))
    torch.library.opcheck(torch.ops.flashgpt.flash_attn_fwd.default, (*args, True, 0.125))
    o, lse = torch.ops.flashgpt.flash_attn_fwd(q, k, v, True, 0.125)
    torch.library.opcheck(torch.ops.flashgpt.flash_attn_bwd.default, (do, q, k, v, o, lse, True, 0.125))
