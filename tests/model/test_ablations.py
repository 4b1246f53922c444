"""Issue 38's ablation keys: model.n_kv_head (GQA), model.pos_emb=rope, model.qk_norm, attention.softcap.

* attention: grouped kv heads and soft-capping on naive, sdpa and flash (Triton interpreter) against a float64
  reference written here (forward and gradients); sdpa refuses soft-capping naming both keys.
* RoPE against a complex-number implementation written here; one attention layer with every key against a
  float64 reference layer written here.
* generation: cached decode (growing and static) = the uncached forward, logits and greedy tokens, past
  block_size too, for each key on every backend.
* config: each bad value or combination is a clear error naming its keys (exit 2 in train.py).
* train.py (slow): for each key the three backends log the same losses on a tiny CPU run, and its
  checkpoint loads in sample.py and eval.py.

Inputs are seeded random tensors (the ``seed`` fixture); the seed is in the messages. Flash tests of
soft-capping run through the kernels' ``softcap`` argument.
"""

import math

import pytest
import torch

from model import GPT, GPTConfig
from model.attention import attention
from model.generate import KVCache, decode_step, forward_cached
from model.rope import apply_rope, rope_cos_sin

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

BACKENDS = ("naive", "sdpa", "flash")
# ------------------------------------------------------------------------------ float64 references


def ref_attention(q, k, v, softcap=None, window=None, doc_ids=None):
    """float64 attention, one query head at a time: head h reads kv head h // (Hq // Hkv); scores
    s = q . k / sqrt(d), soft-capped to c * tanh(s / c), then the causal (bottom-right) / window /
    document mask and the softmax."""
    q, k, v = q.double(), k.double(), v.double()
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    i = torch.arange(Nq, device=q.device)[:, None] + (Nk - Nq)  # each query's absolute position
    j = torch.arange(Nk, device=q.device)[None, :]
    keep = (j <= i).expand(B, Nq, Nk)
    if window is not None:
        keep = keep & (j > i - window)
    if doc_ids is not None:
        keep = keep & (doc_ids[:, -Nq:, None] == doc_ids[:, None, :])
    out = []
    for h in range(Hq):
        kh, vh = k[:, h // (Hq // Hkv)], v[:, h // (Hq // Hkv)]
        s = q[:, h] @ kh.transpose(-1, -2) / math.sqrt(d)  # (B, Nq, Nk)
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~keep, float("-inf"))
        out.append(torch.softmax(s, dim=-1) @ vh)
    return torch.stack(out, dim=1)  # (B, Hq, Nq, d)


def ref_rope(x, pos, theta):
    """x (B, T, H, d) rotated as complex numbers z_m = x[m] + i x[m + d/2] times exp(i pos theta^(-2m/d))."""
    d = x.shape[-1]
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2 :].double())
    m = torch.arange(d // 2, dtype=torch.float64, device=x.device)
    angle = pos.double()[:, None] * theta ** (-2 * m / d)  # (T, d/2)
    z = z * torch.polar(torch.ones_like(angle), angle)[:, None, :]  # (T, 1, d/2): broadcast over heads
    return torch.cat((z.real, z.imag), dim=-1)


def ref_layer(attn, cfg: GPTConfig, x):
    """The attention layer of ``GPT`` (its weights ``attn``) in float64 with ``cfg``'s keys, unbatched code
    that shares nothing with model/: projection, QK-norm, RoPE, ``ref_attention``, output projection."""
    B, T, C = x.shape
    H, Hkv, d = cfg.n_head, cfg.kv_heads, cfg.head_dim
    w, b = attn.c_attn.weight.double(), attn.c_attn.bias.double()
    out = x.double() @ w.T + b  # (B, T, (H + 2 Hkv) d)
    q = out[..., : H * d].reshape(B, T, H, d)
    k = out[..., H * d : (H + Hkv) * d].reshape(B, T, Hkv, d)
    v = out[..., (H + Hkv) * d :].reshape(B, T, Hkv, d)
    if cfg.qk_norm:
        for name, t in (("q", q), ("k", k)):
            g = getattr(attn, f"{name}_norm").weight.double()
            normed = t / torch.sqrt((t * t).mean(-1, keepdim=True) + 1e-6) * g
            q, k = (normed, k) if name == "q" else (q, normed)
    if cfg.pos_emb == "rope":
        pos = torch.arange(T, device=x.device)
        q, k = ref_rope(q, pos, cfg.rope_theta), ref_rope(k, pos, cfg.rope_theta)
    y = ref_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), cfg.softcap, cfg.window)
    y = y.transpose(1, 2).reshape(B, T, C)
    return y @ attn.c_proj.weight.double().T + attn.c_proj.bias.double()


# ------------------------------------------------------------------------------ attention


def _qkv(seed, Hq=4, Hkv=2, N=24, d=16, scale=1.0, B=2):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, N, d, generator=g) * scale
    k = torch.randn(B, Hkv, N, d, generator=g) * scale
    v = torch.randn(B, Hkv, N, d, generator=g)
    return q, k, v, g


@pytest.mark.parametrize(
    ("backend", "softcap"),
    [(b, c) for b in BACKENDS for c in (None, 2.0) if not (b == "sdpa" and c)],  # test_sdpa_refuses_softcap
)
@pytest.mark.parametrize("n_kv", [1, 2, 4])
def test_attention_gqa_softcap_match_reference(seed, monkeypatch, backend, n_kv, softcap):
    """Forward and gradients of q, k, v (kv heads: the sum over their group) against ``ref_attention``."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v, g = _qkv(seed, Hkv=n_kv, scale=2.0)  # scores of several units: the cap bites
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o = attention(q, k, v, backend, softcap=softcap)
    ref = ref_attention(q, k, v, softcap)
    do = torch.randn(o.shape, generator=g)
    grads = torch.autograd.grad(o, (q, k, v), do)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do.double())
    msg = f"seed={seed} {backend} n_kv_head={n_kv} softcap={softcap}"
    assert o.shape == q.shape, msg
    assert (o.double() - ref).abs().max() < 1e-5, f"{msg}: forward"
    for name, a, b in zip("qkv", grads, ref_grads, strict=True):
        assert (a.double() - b).abs().max() < 1e-4, (
            f"{msg}: d{name} off by {(a.double() - b).abs().max():.3g}"
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_gqa_softcap_with_window_documents_and_cache_rows(seed, monkeypatch, backend):
    """The new keys with the variants: window, document ids, Nq < Nk (a KV cache's newest rows)."""
    softcap = None if backend == "sdpa" else 3.0
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v, g = _qkv(seed, Hkv=2, N=32, scale=2.0)
    starts = torch.rand(2, 32, generator=g) < 0.15
    starts[:, 0] = True
    docs = (starts.cumsum(-1) - 1).to(torch.int32)
    for nq in (32, 5, 1):
        o = attention(q[:, :, -nq:], k, v, backend, window=9, doc_ids=docs, softcap=softcap)
        ref = ref_attention(q[:, :, -nq:], k, v, softcap, window=9, doc_ids=docs)
        err = (o.double() - ref).abs().max().item()
        assert err < 1e-5, f"seed={seed} {backend} Nq={nq}: err {err:.3g}"


@pytest.mark.parametrize("backend", ["naive", "flash"])
def test_softcap_gradient_is_finite_at_huge_scores(seed, monkeypatch, backend):
    """Scores of 1e4 (tanh saturated): finite outputs and gradients, equal to the reference's; float16
    inputs on the naive path (its scores are float32) too."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v, g = _qkv(seed, Hkv=4, N=16, scale=30.0)
    dtypes = (torch.float32, torch.float16) if backend == "naive" else (torch.float32,)
    for dtype in dtypes:
        qq, kk, vv = (t.to(dtype).requires_grad_() for t in (q, k, v))
        o = attention(qq, kk, vv, backend, softcap=5.0)
        grads = torch.autograd.grad(o.float().sum(), (qq, kk, vv))
        assert torch.isfinite(o).all() and all(torch.isfinite(t).all() for t in grads), f"seed={seed} {dtype}"
        ref = ref_attention(qq, kk, vv, 5.0)
        tol = 1e-4 if dtype == torch.float32 else 5e-3
        assert (o.double() - ref).abs().max() < tol, f"seed={seed} {backend} {dtype}"


def test_sdpa_refuses_softcap():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(
        ValueError, match=r"attention.softcap=2.0 cannot run with attention=sdpa.*attention=flash"
    ):
        attention(q, q, q, "sdpa", softcap=2.0)
    with pytest.raises(ValueError, match=r"attention.softcap=2.0 cannot run with attention=sdpa"):
        GPTConfig(n_layer=1, n_head=2, n_embd=16, attention="sdpa", softcap=2.0)
    model = GPT(
        GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=11, softcap=2.0, attention="naive")
    )
    with pytest.raises(ValueError, match="attention=sdpa"):
        model.set_attention_backend("sdpa")
    assert model.attention_backend == "naive"  # nothing changed
    with pytest.raises(ValueError, match="attention.softcap must be null or a finite number > 0"):
        attention(q, q, q, "naive", softcap=-1.0)


def test_backend_without_gqa_gets_repeated_kv(seed):
    """A backend registered without gqa=True sees k, v repeated to Hq heads (and no softcap keyword)."""
    from model.attention import BACKENDS as REGISTRY
    from model.attention import register_attention_backend

    seen = []

    def plain(q, k, v, sdpa_backend):
        seen.append(k.shape[1])
        return ref_attention(q, k, v).to(q.dtype)

    register_attention_backend("_plain_test", plain, kv_cache=True)
    try:
        q, k, v, _ = _qkv(seed, Hkv=1)
        o = attention(q, k, v, "_plain_test")
        assert seen == [4] and (o.double() - ref_attention(q, k, v)).abs().max() < 1e-6
        with pytest.raises(ValueError, match="attention.softcap=1.0 cannot run with attention=_plain_test"):
            attention(q, k, v, "_plain_test", softcap=1.0)
    finally:
        REGISTRY.pop("_plain_test")


# ------------------------------------------------------------------------------ RoPE, the layer


def test_rope_matches_complex_rotation(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 40, 3, 16, generator=g, dtype=torch.float64)
    pos = torch.randint(0, 5000, (40,), generator=g)
    for theta in (10000.0, 500000.0):
        cos, sin = rope_cos_sin(pos, 16, theta, torch.float64)
        err = (apply_rope(x, cos, sin) - ref_rope(x, pos, theta)).abs().max().item()
        assert err < 1e-12, f"seed={seed} theta={theta}: err {err:.3g}"
    # the scores depend on positions only through their difference
    q, k = x[:1, :1], x[1:, :1]  # (1, 1, 3, 16)
    a = [
        apply_rope(t, *rope_cos_sin(torch.tensor([p]), 16, 10000.0, torch.float64))
        for t, p in ((q, 7), (k, 3))
    ]
    b = [
        apply_rope(t, *rope_cos_sin(torch.tensor([p]), 16, 10000.0, torch.float64))
        for t, p in ((q, 107), (k, 103))
    ]
    assert torch.allclose((a[0] * a[1]).sum(-1), (b[0] * b[1]).sum(-1), atol=1e-9), f"seed={seed}"
    # float16 input: rotated in float32, returned in float16
    half = apply_rope(x.half(), *rope_cos_sin(pos, 16, 10000.0))
    assert (
        half.dtype == torch.float16 and (half.double() - ref_rope(x.half(), pos, 10000.0)).abs().max() < 2e-3
    )


KEYS = {
    "gqa": dict(n_kv_head=2),
    "mqa": dict(n_kv_head=1),
    "rope": dict(pos_emb="rope"),
    "qk_norm": dict(qk_norm=True),
    "softcap": dict(softcap=2.0),
    "all": dict(n_kv_head=2, pos_emb="rope", rope_theta=500.0, qk_norm=True, softcap=2.0, window=6),
}


def _config(backend, **keys) -> GPTConfig:
    base = dict(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=37, attention=backend)
    return GPTConfig(**{**base, **keys})


def _model(seed, cfg) -> GPT:
    torch.manual_seed(seed)
    model = GPT(cfg)
    with torch.no_grad():  # larger q, k weights than GPT-2's init: scores of several units, so the cap bites
        for block in model.transformer.h:
            block.attn.c_attn.weight.mul_(15.0)
            block.attn.c_attn.bias.normal_(0, 0.5)
            if cfg.qk_norm:
                block.attn.q_norm.weight.uniform_(0.5, 3.0)
                block.attn.k_norm.weight.uniform_(0.5, 3.0)
    return model.eval()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("key", KEYS)
def test_layer_matches_float64_reference(seed, monkeypatch, backend, key):
    """One attention layer with the key on: the model's (float64 where the backend takes it, float32 on
    flash) against ``ref_layer``, plus the model's parameter shapes for the key."""
    keys = KEYS[key]
    if backend == "sdpa" and "softcap" in keys:
        keys = {k: v for k, v in keys.items() if k != "softcap"}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = _config(backend, **keys)
    model = _model(seed, cfg)
    dtype = torch.float32 if backend == "flash" else torch.float64
    model.to(dtype)
    attn = model.transformer.h[0].attn
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    rope = (
        rope_cos_sin(torch.arange(16), cfg.head_dim, cfg.rope_theta, torch.float64)
        if cfg.pos_emb == "rope"
        else None
    )
    x.requires_grad_(True)
    y = attn(
        x, rope=None if rope is None else tuple(t.to(torch.promote_types(dtype, torch.float32)) for t in rope)
    )
    ref = ref_layer(attn, cfg, x)
    err = (y.double() - ref).abs().max().item()
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    assert err < tol, f"seed={seed} {backend} {key}: err {err:.3g}"
    # gradients of x and of every weight of the layer (projections, QK-norm scales) through the same keys
    dy = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    params = [x, *attn.parameters()]
    ours = torch.autograd.grad((y.double() * dy).sum(), params)
    theirs = torch.autograd.grad((ref * dy).sum(), params)
    names = ["x", *(n for n, _ in attn.named_parameters())]
    for name, a, b in zip(names, ours, theirs, strict=True):
        gerr = (a.double() - b).abs().max().item() / max(1.0, b.abs().max().item())
        assert gerr < 10 * tol, f"seed={seed} {backend} {key}: d{name} err {gerr:.3g}"
    assert attn.c_attn.weight.shape == ((4 + 2 * cfg.kv_heads) * 8, 32)
    assert ("wpe" in model.transformer) == (cfg.pos_emb == "learned")
    assert (attn.q_norm is not None) == cfg.qk_norm


@pytest.mark.gpu
@pytest.mark.parametrize("key", KEYS)
def test_gpu_layer_flash_attention_rule(seed, monkeypatch, key):
    """On the GPU in bfloat16 (d = 64, N = 256): the flash layer with each key against the float64
    reference layer, within the FlashAttention rule set by naive in bfloat16 with the same weights:
    err(flash) <= 2 * err(naive) + 1e-5, for the output and the gradients of x and every weight."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    keys = {**KEYS[key], **({"window": 100} if "window" in KEYS[key] else {})}
    shape = dict(n_layer=1, n_head=4, n_embd=256, block_size=256, vocab_size=37)
    layers = {}
    for backend in ("flash", "naive"):
        model = _model(seed, GPTConfig(**shape, attention=backend, **keys))
        layers[backend] = model.transformer.h[0].attn.cuda()
    cfg = GPTConfig(**shape, attention="naive", **keys)
    x = torch.randn(2, 256, 256, generator=torch.Generator().manual_seed(seed)).cuda()
    dy = torch.randn(
        2, 256, 256, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64
    ).cuda()
    rope = (
        rope_cos_sin(torch.arange(256), 64, cfg.rope_theta, torch.float64) if cfg.pos_emb == "rope" else None
    )
    rope = None if rope is None else tuple(t.float().cuda() for t in rope)

    def grads(attn, y):
        params = [xs, *attn.parameters()]
        return [y.detach().double(), *torch.autograd.grad((y.double() * dy).sum(), params)]

    results = {}
    for backend, attn in layers.items():
        xs = x.clone().requires_grad_(True)
        with torch.autocast("cuda", torch.bfloat16):
            y = attn(xs, rope=rope)
        results[backend] = grads(attn, y)
    xs = x.double().requires_grad_(True)
    results["ref"] = grads(layers["naive"], ref_layer(layers["naive"], cfg, xs))
    names = ["y", "x", *(n for n, _ in layers["naive"].named_parameters())]
    for i, name in enumerate(names):
        ref = results["ref"][i]
        err = (results["flash"][i] - ref).abs().max().item()
        bound = 2 * (results["naive"][i] - ref).abs().max().item() + 1e-5
        assert err <= bound, f"seed={seed} {key}: {name} err {err:.3g} > {bound:.3g}"


# ------------------------------------------------------------------------------ generation


# flash under the interpreter takes 20-40 s a key on 2 cores: "all" (every key at once) in the default set,
# each key alone in the slow set
DECODE_CASES = [
    pytest.param(b, k, marks=[pytest.mark.slow] if b == "flash" and k != "all" else [])
    for k in KEYS
    for b in BACKENDS
    if not (b == "sdpa" and "softcap" in KEYS[k])  # sdpa refuses soft-capping
]


@pytest.mark.parametrize(("backend", "key"), DECODE_CASES)
def test_cached_decode_equals_uncached_forward(seed, monkeypatch, backend, key):
    """Prefill + growing decode steps and static decode steps give the uncached forward's logits at every
    position; greedy generation past block_size (the sliding recomputation) gives the same tokens with the
    cache, without it and with static steps. The cache holds n_kv_head heads."""
    keys = KEYS[key]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = _config(backend, **keys)
    model = _model(seed, cfg)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.vocab_size, (2, 14), generator=g)
    with torch.no_grad():
        full, _ = model(idx)  # (B, T, V)
        for static in (False, True):
            cache = KVCache(model, 2)
            assert cache.k.shape[2] == cfg.kv_heads
            got = [forward_cached(model, idx[:, :6], cache)]
            for t in range(6, 14):
                step = decode_step if static else forward_cached
                got.append(step(model, idx[:, t : t + 1], cache))
            err = (torch.stack(got, 1) - full[:, 5:]).abs().max().item()
            assert err < 1e-4, f"seed={seed} {backend} {key} static={static}: logits err {err:.3g}"
    prompt = idx[:, :5]
    tokens = [
        model.generate(prompt, 15, temperature=0, use_cache=c, static_decode=s)
        for c, s in ((False, False), (True, False), (True, True))
    ]  # 5 + 15 > block_size 16
    assert all(torch.equal(t, tokens[0]) for t in tokens), f"seed={seed} {backend} {key}: {tokens}"


# ------------------------------------------------------------------------------ config


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(n_kv_head=3), r"model.n_kv_head=3 does not divide model.n_head=4; use model.n_kv_head=1"),
        (dict(n_kv_head=0), r"model.n_kv_head=0"),
        (dict(pos_emb="alibi"), r"model.pos_emb='alibi' is not valid; choose one of: learned, rope"),
        (
            dict(pos_emb="rope", n_embd=36, n_head=4),
            r"model.pos_emb=rope rotates pairs of features, .* gives head_dim=9",
        ),
        (dict(rope_theta=0.0), r"model.rope_theta=0.0 must be > 0"),
        (dict(qk_norm="yes"), r"model.qk_norm='yes' is not valid; choose true or false"),
        (dict(softcap=0.0), r"attention.softcap=0.0 must be > 0"),
        (dict(softcap=1.0, attention="sdpa"), r"attention.softcap=1.0 cannot run with attention=sdpa"),
    ],
)
def test_gptconfig_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**{**dict(n_layer=1, n_head=4, n_embd=32, attention="naive"), **kw})


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["model.n_kv_head=3"], r"model.n_kv_head=3 does not divide model.n_head=4; use model.n_kv_head=1"),
        (["model.pos_emb=alibi"], r"model.pos_emb='alibi' is not valid; choose one of: learned, rope"),
        (["model.n_embd=132", "model.pos_emb=rope"], r"model.pos_emb=rope rotates pairs of features"),
        (["model.rope_theta=-1"], r"model.rope_theta=-1.0 must be > 0"),
        (
            ["attention=sdpa", "attention.softcap=30"],
            r"attention.softcap=30.0 cannot run with attention=sdpa",
        ),
        (
            ["attention=naive", "attention.softcap=-2"],
            r"attention.softcap=-2.0 must be > 0",
        ),
    ],
)
def test_train_config_errors(tmp_path, overrides, match):
    """train.py's config check names the keys (exit 2 there), before any data or model work."""
    from tests.helpers_train import compose_cfg
    from trainer.checks import ConfigError, resolve_plan

    cfg = compose_cfg(["experiment=cpu_tiny", f"data.dir={tmp_path}/none", *overrides])
    with pytest.raises(ConfigError, match=match):
        resolve_plan(cfg, world_size=1, cuda_available=False)


def test_param_counts_and_crop_with_rope():
    """GQA shrinks c_attn; RoPE has no wpe (so non-embedding = all parameters); crop keeps working."""
    mha, gqa = GPT(_config("naive")), GPT(_config("naive", n_kv_head=1))
    assert mha.num_params() - gqa.num_params() == 2 * 2 * (32 * 24 + 24)  # 2 layers, k and v: 4 -> 1 heads
    rope = GPT(_config("naive", pos_emb="rope"))
    assert rope.num_params() == rope.num_params(non_embedding=False) == mha.num_params()
    rope.crop_block_size(8)
    assert rope.config.block_size == 8
    with pytest.raises(ValueError, match="exceeds block_size=8"):
        rope(torch.zeros(1, 9, dtype=torch.long))


# ------------------------------------------------------------------------------ train.py, sample.py, eval.py

TRAIN_KEYS = {
    "n_kv_head": {"model.n_kv_head": 1},
    "rope": {"model.pos_emb": "rope"},
    "qk_norm": {"model.qk_norm": True},
    "softcap": {"attention.softcap": 1.0},
}


@pytest.mark.slow
@pytest.mark.parametrize("key", TRAIN_KEYS)
def test_tiny_runs_backends_agree_and_checkpoint_samples(tmp_path, char_data, shakespeare_path, key):
    """3-step CPU runs with the key on naive, sdpa and flash (TRITON_INTERPRET=1) log the same losses
    (1e-4; softcap: sdpa is refused with exit 2); the naive run's checkpoint samples the same greedy text
    with and without the KV cache and evaluates in eval.py to its logged val loss."""
    import json
    import subprocess
    import sys

    from tests.helpers_train import (
        REPO,
        describe,
        read_jsonl,
        run_train,
        tiny_overrides,
        train_env,
        train_losses,
    )

    losses = {}
    for backend in BACKENDS:
        extra = {
            "attention": backend,
            "max_steps": 3,
            "batch.tokens_per_step": 512,
            "model.dropout": 0.0,
            "eval.interval": 3,
            "eval.batches": 1,
            "checkpoint.interval": 0,
            "optim.decay_steps": 3,
            **TRAIN_KEYS[key],
        }
        env = train_env(TRITON_INTERPRET=1) if backend == "flash" else train_env()
        proc = run_train(
            tiny_overrides(char_data, shakespeare_path, tmp_path / backend, **extra), env=env, timeout=500
        )
        if key == "softcap" and backend == "sdpa":
            assert (
                proc.returncode == 2 and "attention.softcap=1.0 cannot run with attention=sdpa" in proc.stderr
            ), describe(proc)
            continue
        assert proc.returncode == 0, describe(proc)
        losses[backend] = train_losses(tmp_path / backend)
    assert sorted(losses["naive"]) == [1, 2, 3], losses
    for backend, got in losses.items():
        for step, loss in losses["naive"].items():
            assert abs(got[step] - loss) < 1e-4, (
                f"{key} {backend} step {step}: {got} vs naive {losses['naive']}"
            )

    run = tmp_path / "naive"

    def script(name, *args):
        cmd = [sys.executable, str(REPO / name), f"run={run}", *args]
        proc = subprocess.run(cmd, cwd=tmp_path, env=train_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, describe(proc)
        return proc

    common = ["prompt=ROMEO:", "num_samples=1", "max_new_tokens=70", "temperature=0"]  # past seq_len 64
    texts = []
    for i, extra in enumerate((["use_cache=false"], [], ["static_decode=true"])):
        script("sample.py", *common, *extra, f"out={tmp_path / f's{i}.txt'}")
        texts.append(json.loads((tmp_path / f"s{i}.json").read_text())["token_ids"])
    assert texts[0] == texts[1] == texts[2], f"{key}: {texts}"
    script("eval.py")
    (ev,) = (run / "evals").glob("*.json")
    logged = [r["val/loss"] for r in read_jsonl(run) if "val/loss" in r][-1]
    assert abs(json.loads(ev.read_text())["loss"] - logged) < 1e-5, key
