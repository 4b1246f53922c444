"""KV cache: bottom-right causal attention to a cache prefix, cached == uncached generation, sampling."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import attention_reference
from model import GPT, GPTConfig
from model.attention import attention, register_attention_backend
from model.generate import KVCache, decode_step, forward_cached
from model.sampling import sample_next

BACKENDS = [("naive", "auto"), ("sdpa", "auto"), ("sdpa", "math"), ("flash", "auto")]


def _need(backend: str, monkeypatch) -> None:
    if backend == "flash":
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # read by kernels at call time
        kernels = pytest.importorskip("kernels")
        kernels.check_flash_available(torch.device("cpu"))


def reference_bottom_right(q, k, v) -> torch.Tensor:
    """float64 attention, query i of Nq sees keys j <= i + Nk - Nq (kernels/reference.py)."""
    return attention_reference(q, k, v, causal=True)[0]


@pytest.mark.parametrize("backend,sdpa_backend", BACKENDS)
@pytest.mark.parametrize("nq,nk", [(1, 1), (1, 37), (3, 20), (5, 5)])
def test_cached_attention_matches_float64_reference(seed, monkeypatch, backend, sdpa_backend, nq, nk):
    _need(backend, monkeypatch)
    # a strided view of a preallocated cache, as the model passes it
    cache = torch.randn(2, 2, 3, 48, 16, dtype=torch.float64).float()
    k, v = cache[0, :, :, :nk], cache[1, :, :, :nk]
    q = torch.randn(2, 3, nq, 16)
    out = attention(q, k, v, backend, sdpa_backend)
    ref = reference_bottom_right(q, k, v)
    assert out.shape == (2, 3, nq, 16) and out.dtype == torch.float32
    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-5, f"seed={seed} {backend}/{sdpa_backend} nq={nq} nk={nk}: rel err {err}"


def test_cached_attention_rejects_bad_shapes_and_backends():
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="Nk >= Nq"):
        attention(q, k, k, "naive")
    register_attention_backend("test_no_cache", lambda q, k, v, s: q, overwrite=True)
    with pytest.raises(ValueError, match="kv_cache=True"):
        attention(q[:, :, :1], k, k, "test_no_cache")
    with pytest.raises(ValueError, match="no static decode step"):
        attention(q[:, :, :1], k, k, "test_no_cache", lengths=torch.tensor([3]))


def test_a_backend_registered_without_capabilities_is_refused_naming_the_key():
    """A backend added with register_attention_backend's defaults (no kv_cache, variants or decode step):
    sample.py names use_cache=false or the static-decode keys, GPTConfig the variant keys, before any step
    runs (they failed inside generation / the first training step)."""
    import sample
    from trainer.infer import InferError

    register_attention_backend("test_plain", lambda q, k, v, s: q, overwrite=True)
    with pytest.raises(InferError, match="registered without kv_cache=True.*pass use_cache=false"):
        sample.check_generation_backend("test_plain", use_cache=True, static=False)
    sample.check_generation_backend("test_plain", use_cache=False, static=True)  # uncached: no static step
    register_attention_backend("test_cache_only", lambda q, k, v, s: q, kv_cache=True, overwrite=True)
    sample.check_generation_backend("test_cache_only", use_cache=True, static=False)
    with pytest.raises(InferError, match="no static decode step.*drop static_decode=true"):
        sample.check_generation_backend("test_cache_only", use_cache=True, static=True)
    shape = dict(block_size=16, vocab_size=61, n_layer=1, n_head=2, n_embd=32, attention="test_plain")
    for kw, key in (
        (dict(window=8), "attention.window"),
        (dict(document_mask=True), "attention.document_mask"),
        (dict(attn_dropout=0.1), "model.attn_dropout"),
    ):
        with pytest.raises(ValueError, match=f"{key} needs a backend registered with variants=True"):
            GPTConfig(**shape, **kw)
    GPTConfig(**shape)  # without them it is fine


def _model(backend: str, block_size: int = 16) -> GPT:
    cfg = GPTConfig(
        block_size=block_size, vocab_size=61, n_layer=2, n_head=2, n_embd=32, dropout=0.0, attention=backend
    )
    model = GPT(cfg).eval()
    with torch.no_grad():  # larger weights than GPT-2's init: logits far apart, so argmax ties are unlikely
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    return model


@pytest.mark.parametrize("backend,sdpa_backend", BACKENDS)
def test_cached_logits_equal_full_forward(seed, monkeypatch, backend, sdpa_backend):
    """Prefill 5 tokens, then decode one at a time: each step's logits equal the full forward's logits at
    that position (float32, CPU)."""
    _need(backend, monkeypatch)
    model = _model(backend)
    model.set_attention_backend(backend, sdpa_backend)
    idx = torch.randint(0, 61, (3, 16))
    full, _ = model(idx)
    cache = KVCache(model, 3)
    got = [forward_cached(model, idx[:, :5], cache)]
    for t in range(5, 16):
        got.append(forward_cached(model, idx[:, t : t + 1], cache))
    assert cache.length == 16 and cache.k.shape == (2, 3, 2, 16, 16)
    torch.testing.assert_close(
        torch.stack(got, 1), full[:, 4:], rtol=1e-5, atol=1e-5, msg=lambda m: f"seed={seed} {backend}: {m}"
    )
    with pytest.raises(ValueError, match="at cache position 16"):
        forward_cached(model, idx[:, :1], cache)

    # static decode steps: whole-buffer length mask, same logits
    cache.reset()
    got = [forward_cached(model, idx[:, :5], cache)]
    for t in range(5, 16):
        got.append(decode_step(model, idx[:, t : t + 1], cache))
    assert cache.length == 16 and cache.lengths.tolist() == [16, 16, 16]
    torch.testing.assert_close(
        torch.stack(got, 1),
        full[:, 4:],
        rtol=1e-5,
        atol=1e-5,
        msg=lambda m: f"seed={seed} {backend} static: {m}",
    )
    with pytest.raises(ValueError, match="KV cache is full"):
        decode_step(model, idx[:, :1], cache)


@pytest.mark.parametrize("backend,sdpa_backend", BACKENDS)
def test_greedy_cached_equals_uncached(seed, monkeypatch, backend, sdpa_backend):
    """Greedy tokens with the KV cache == recomputing the whole prefix each step, for every backend,
    including past the block size (the window slides: 5 + 20 > 16)."""
    _need(backend, monkeypatch)
    model = _model(backend)
    model.set_attention_backend(backend, sdpa_backend)
    prompt = torch.randint(0, 61, (2, 5))
    timings: dict = {}
    cached = model.generate(prompt, 20, temperature=0, timings=timings)
    plain = model.generate(prompt, 20, temperature=0, use_cache=False)
    static = model.generate(prompt, 20, temperature=0, static_decode=True)
    assert torch.equal(cached, plain), f"seed={seed} {backend}/{sdpa_backend}\n{cached}\n{plain}"
    assert torch.equal(static, plain), f"seed={seed} {backend}/{sdpa_backend} static\n{static}\n{plain}"
    assert cached.shape == (2, 25) and torch.equal(cached[:, :5], prompt)
    assert timings["prefill_tokens"] == 2 * 5 and timings["decode_tokens"] == 2 * 19
    assert timings["prefill_s"] > 0 and timings["decode_s"] > 0


SEP = (7, 7)  # a two-token document separator, as the char tokenizer writes "\n\n"


def _doc_model(backend: str, sdpa_backend: str = "auto", block_size: int = 16) -> GPT:
    model = _model(backend, block_size)
    model.config = GPTConfig(**{**vars(model.config), "document_mask": True, "doc_separator_ids": SEP})
    model.set_attention_backend(backend, sdpa_backend)
    return model


def _with_separators(idx: torch.Tensor, starts) -> torch.Tensor:
    idx = idx.clone()
    for row, start in starts:
        idx[row, start : start + len(SEP)] = torch.tensor(SEP)
    return idx


@pytest.mark.parametrize("backend,sdpa_backend", BACKENDS)
def test_document_mask_cached_logits_equal_full_forward(seed, monkeypatch, backend, sdpa_backend):
    """Document masks with a KV cache: separators in the prompt, across the prefill/decode
    boundary and in the decoded part; every step's logits (growing cache and static steps) equal the
    training forward's, which applies the document mask."""
    _need(backend, monkeypatch)
    model = _doc_model(backend, sdpa_backend)
    idx = torch.randint(8, 61, (3, 16))  # ids >= 8: no separator but the ones placed here
    idx = _with_separators(idx, [(0, 1), (1, 4), (2, 9), (0, 11), (1, 13)])  # (1, 4): ends at the 6th token
    full, _ = model(idx)
    with model.use_attention_backend("naive"):
        model.config.document_mask = False  # the mask matters for these tokens (else the test shows nothing)
        unmasked, _ = model(idx)
        model.config.document_mask = True
    assert (unmasked[:, 4:] - full[:, 4:]).abs().max() > 1e-3, f"seed={seed}"
    cache = KVCache(model, 3)
    for step in ("growing", "static"):
        cache.reset()
        got = [forward_cached(model, idx[:, :5], cache)]
        decode = decode_step if step == "static" else forward_cached
        got += [decode(model, idx[:, t : t + 1], cache) for t in range(5, 16)]
        torch.testing.assert_close(
            torch.stack(got, 1),
            full[:, 4:],
            rtol=1e-5,
            atol=1e-5,
            msg=lambda m, step=step: f"seed={seed} {step}: {m}",
        )


@pytest.mark.parametrize("backend,sdpa_backend", BACKENDS)
def test_document_mask_greedy_cached_equals_uncached(seed, monkeypatch, backend, sdpa_backend):
    """attention.document_mask=true with a separator inside the prompt: greedy tokens with the KV cache
    (growing and static) equal the uncached ones, also after the window slides (6 + 14 > 16)."""
    _need(backend, monkeypatch)
    model = _doc_model(backend, sdpa_backend)
    prompt = _with_separators(torch.randint(8, 61, (2, 6)), [(0, 2), (1, 3)])
    plain = model.generate(prompt, 14, temperature=0, use_cache=False)
    cached = model.generate(prompt, 14, temperature=0)
    static = model.generate(prompt, 14, temperature=0, static_decode=True)
    assert torch.equal(cached, plain), f"seed={seed} {backend}/{sdpa_backend}\n{cached}\n{plain}"
    assert torch.equal(static, plain), f"seed={seed} {backend}/{sdpa_backend} static\n{static}\n{plain}"


def test_sampling_with_cache_is_reproducible(seed):
    model = _model("sdpa")
    prompt = torch.randint(0, 61, (4, 3))
    a = model.generate(
        prompt, 12, temperature=0.9, top_k=20, top_p=0.9, generator=torch.Generator().manual_seed(seed)
    )
    b = model.generate(
        prompt, 12, temperature=0.9, top_k=20, top_p=0.9, generator=torch.Generator().manual_seed(seed)
    )
    assert torch.equal(a, b), f"seed={seed}"


def test_generate_prompt_longer_than_block_size(seed):
    model = _model("naive", block_size=8)
    prompt = torch.randint(0, 61, (1, 13))
    out = model.generate(prompt, 4, temperature=0)
    assert torch.equal(out, model.generate(prompt, 4, temperature=0, use_cache=False)), f"seed={seed}"
    assert torch.equal(out[:, :13], prompt)


# ------------------------------------------------------------------------------------ sampling


def test_sample_next_filters(seed):
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3]])).repeat(4000, 1)
    g = torch.Generator().manual_seed(seed)
    assert torch.equal(sample_next(logits[:2], 0), torch.tensor([[1], [1]]))
    assert set(sample_next(logits, 1.0, top_k=1, generator=g).unique().tolist()) == {1}
    assert set(sample_next(logits, 1.0, top_k=2, generator=g).unique().tolist()) == {1, 3}
    # top_p=0.8: 0.5 + 0.3 reaches it, so only ids 1 and 3 remain, renormalised to 0.625 / 0.375
    got = sample_next(logits, 1.0, top_p=0.8, generator=g).flatten()
    assert set(got.unique().tolist()) == {1, 3}, f"seed={seed}"
    frac = (got == 1).double().mean().item()
    assert abs(frac - 0.625) < 0.04, f"seed={seed}: {frac}"
    assert set(sample_next(logits, 1.0, top_p=0.01, generator=g).unique().tolist()) == {1}
    assert set(sample_next(logits, 1.0, top_p=1.0, generator=g).unique().tolist()) == {0, 1, 2, 3}


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=-0.1), "temperature must be >= 0"),
        (dict(temperature=float("nan")), "temperature must be >= 0"),
        (dict(top_k=0), "top_k must be an int >= 1"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    ],
)
def test_sampling_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sample_next(torch.zeros(1, 5), **{"temperature": 1.0, **kwargs})
    with pytest.raises(ValueError, match=match):
        _model("naive").generate(torch.zeros(1, 2, dtype=torch.long), 1, **{"temperature": 1.0, **kwargs})


def test_cuda_graph_decoding_needs_cuda_and_the_cache():
    """generate(cuda_graph=True) off CUDA or without the KV cache is a clear error before any work, and
    DecodeGraph refuses a CPU cache (its GPU behaviour: tests/kernels/test_flash_decode.py)."""
    from model.generate import DecodeGraph

    model = _model("naive")
    idx = torch.zeros(1, 2, dtype=torch.long)
    for kwargs in (dict(), dict(use_cache=False)):
        with pytest.raises(ValueError, match="cuda_graph=True needs use_cache=True and a CUDA device"):
            model.generate(idx, 3, cuda_graph=True, **kwargs)
    with pytest.raises(ValueError, match="needs the model and its KV cache on a CUDA device"):
        DecodeGraph(model, KVCache(model, 1))
    from model.generate import decode_graph

    model.train()  # a graph kept from an eval-mode capture must not replay for a training-mode model
    with pytest.raises(ValueError, match=r"needs model.eval\(\)"):
        decode_graph(model, 1)


def test_kept_decode_graph_is_recaptured_when_what_it_replays_changes(monkeypatch):
    """decode_graph keeps one graph per model and recaptures when anything the graph holds changes: the
    batch size, the attention backend or SDPA kernel, a replaced or moved weight (crop_block_size swaps
    wpe), the compiled step, inference mode; it does not recapture for an unchanged model. The old graph
    and cache are unreferenced before the new capture. (CPU: a stand-in for the capture.)"""
    import gc
    import weakref

    from model import generate as dg

    captures, alive = [], []

    class Stand:
        def __init__(self, model, cache):
            alive.append([r() is not None for r in refs])  # the previous graph still referenced?
            captures.append(1)
            self.cache = cache

    refs = []
    monkeypatch.setattr(dg, "DecodeGraph", Stand)
    model = _model("sdpa")

    def get(batch=2):
        g = dg.decode_graph(model, batch)
        gc.collect()
        return g

    refs.append(weakref.ref(get()))  # the test keeps no reference of its own
    fc = model.transformer.h[1].mlp.c_fc
    changes = [
        ("same model", lambda: None, 2, 0),
        ("batch size", lambda: None, 3, 1),
        ("back to batch 2", lambda: None, 2, 1),
        ("backend", lambda: model.set_attention_backend("naive"), 2, 1),
        ("sdpa kernel", lambda: model.set_attention_backend("sdpa", "math"), 2, 1),
        (
            "replaced weight",
            lambda: setattr(fc, "weight", torch.nn.Parameter(fc.weight.detach().clone())),
            2,
            1,
        ),
        ("crop_block_size", lambda: model.crop_block_size(8), 2, 1),
        ("compiled step", lambda: setattr(model, "_decode_static", lambda *a: None), 2, 1),
        ("nothing new", lambda: None, 2, 0),
    ]
    for what, change, batch, want in changes:
        before = len(captures)
        change()
        refs.append(weakref.ref(get(batch)))
        assert len(captures) - before == want, f"{what}: {len(captures) - before} captures"
    with torch.inference_mode():
        before = len(captures)
        get()
        assert len(captures) == before + 1, "inference mode"
    assert not any(any(a) for a in alive), f"an old graph was alive during a capture: {alive}"


def test_flash_decode_steps_use_flash_decoding(seed, monkeypatch):
    """attention=flash: the prefill runs flash_attention, each decode step (per layer) flash_decode."""
    _need("flash", monkeypatch)
    import kernels

    calls = {"decode": 0, "attention": 0}
    real_decode, real_attention = kernels.flash_decode, kernels.flash_attention

    def count(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)

        return wrapped

    monkeypatch.setattr(kernels, "flash_decode", count("decode", real_decode))
    monkeypatch.setattr(kernels, "flash_attention", count("attention", real_attention))
    model = _model("flash")
    model.generate(torch.randint(0, 61, (2, 3)), 4, temperature=0)
    assert calls == {"decode": 3 * 2, "attention": 2}, f"seed={seed}: {calls}"


@pytest.mark.parametrize(
    "backend,batch,docs",
    [("sdpa", 1, False), ("sdpa", 2, False), ("flash", 1, False), ("flash", 2, False), ("sdpa", 2, True)],
)
def test_compiled_static_decode_step_is_one_graph(seed, monkeypatch, backend, batch, docs):
    """The static decode step compiles once for every position (no recompile: shapes, strides and Python
    state do not change between steps), without graph breaks (flash: the flash_decode op), and gives the
    uncached tokens. Batch 1 too: there the (1, 1) view of the growing token buffer counts as contiguous
    with the buffer's row stride, which changes every step. With document masks the step derives the
    document ids from the cached tokens inside the same graph."""
    _need(backend, monkeypatch)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _doc_model(backend) if docs else _model(backend)
    prompt = torch.randint(8 if docs else 0, 61, (batch, 6 if docs else 3))
    if docs:
        prompt = _with_separators(prompt, [(0, 2)])
    ref = model.generate(prompt, 10, temperature=0, use_cache=False)
    model._decode_static = torch.compile(model._decode_static)
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = model.generate(prompt, 10, temperature=0, static_decode=True)
    assert torch.equal(out, ref), f"seed={seed}"
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters)


@pytest.mark.parametrize("backend", ["sdpa", "naive"])
def test_compiled_static_decode_writes_the_cache_in_place(backend):
    """Inductor's code for the static decode step allocates no buffer as large as a layer's cache: the new
    k/v are written into the cache in place and attention reads it there. (Writing through a layer view,
    ``cache.k[layer, rows, :, lengths] = k``, made Inductor copy every layer's cache and copy the whole
    cache back at the end of each step: about 3 ms per token for GPT-2 at batch 16 on the H200.)"""
    import math
    import re

    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model = _model(backend)
    cache = KVCache(model, 3)
    with torch.no_grad():
        forward_cached(model, torch.randint(0, 61, (3, 4)), cache)
        step = torch.compile(model._decode_static)
        _, codes = run_and_get_code(step, torch.randint(0, 61, (3, 1)), cache)
    layer = math.prod(cache.k.shape[1:])  # B * H * max_len * d
    shapes = [
        tuple(int(x) for x in m.split(",") if x.strip())
        for code in codes
        for m in re.findall(r"empty_strided_\w+\(\(([\d, ]*)\)", code)
    ]
    assert shapes, "no buffer allocations found: the generated code's format changed"
    big = [sh for sh in shapes if math.prod(sh) >= layer]
    assert not big, f"buffers the size of a layer's cache ({layer} elements): {big}"


def test_a_batch_other_than_the_caches_is_refused(seed):
    """idx of 1 sequence into a cache made for 3 would broadcast into all 3 rows: a ValueError naming both
    sizes, on the growing path and the static step alike, and the cache is left as it was."""
    model = _model("naive")
    cache = KVCache(model, 3)
    g = torch.Generator().manual_seed(seed)
    forward_cached(model, torch.randint(0, 61, (3, 4), generator=g), cache)
    before = cache.k.clone()
    with pytest.raises(ValueError, match=r"idx holds 1 sequences but the KV cache was made for 3"):
        forward_cached(model, torch.randint(0, 61, (1, 1), generator=g), cache)
    with pytest.raises(ValueError, match=r"KVCache\(model, 1\)"):
        decode_step(model, torch.randint(0, 61, (1, 1), generator=g), cache)
    assert cache.length == 4 and torch.equal(cache.k, before), f"seed={seed}"
