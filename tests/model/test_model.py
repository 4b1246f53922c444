"""Tests of model/ (GPT and attention backends) on CPU, against independent float64 references.

Random inputs come from the ``seed`` fixture (tests/conftest.py: fixed, printed with a failure; set
FLASHGPT_TEST_SEED=<int> for other inputs).
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels.reference import attention_reference
from model import ATTENTION_BACKENDS, GPT, PRESETS, SDPA_BACKENDS, GPTConfig, attention
from model.attention import (
    BACKENDS,
    available_attention_backends,
    register_attention_backend,
    sdpa_backend_that_ran,
)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The project's one float64 reference (kernels/reference.py: explicit mask, max-subtracted softmax)."""
    return attention_reference(q, k, v, causal=True)[0]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| divided by max(1e-30, max |b|) (max-abs error relative to the reference's scale)."""
    b64 = b.detach().to(torch.float64)
    return ((a.detach().to(torch.float64) - b64).abs().max() / b64.abs().max().clamp_min(1e-30)).item()


def tiny_config(**overrides) -> GPTConfig:
    base = dict(block_size=32, vocab_size=97, dropout=0.0)
    base.update(overrides)
    return GPTConfig.from_preset("tiny", **base)


def strided_qkv(B: int, H: int, N: int, d: int, dtype: torch.dtype):
    """q, k, v as (B, H, N, d) strided views of one (B, N, 3*H*d) tensor, as the model produces them."""
    qkv = torch.randn(B, N, 3 * H * d, dtype=torch.float64).to(dtype)
    q, k, v = qkv.split(H * d, dim=2)
    return tuple(t.view(B, N, H, d).transpose(1, 2) for t in (q, k, v))


# ------------------------------------------------------------------------------------ attention


@pytest.mark.parametrize("backend,sdpa_backend", [("naive", "auto"), ("sdpa", "auto"), ("sdpa", "math")])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_attention_matches_float64_reference(seed, backend, sdpa_backend, dtype, tol):
    B, H, N, d = 2, 3, 17, 16
    q, k, v = strided_qkv(B, H, N, d, dtype)
    assert not q.is_contiguous()
    # Strided leaves: the backends must handle non-contiguous q, k, v.
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out = attention(*leaves, backend=backend, sdpa_backend=sdpa_backend)
    assert out.shape == (B, H, N, d) and out.dtype == dtype

    ref_leaves = [t.detach().to(torch.float64).requires_grad_(True) for t in (q, k, v)]
    ref = reference_attention(*ref_leaves)
    assert rel_err(out, ref) < tol, f"seed={seed}: output error {rel_err(out, ref)}"

    grad_out = torch.randn(B, H, N, d, dtype=torch.float64)
    out.backward(grad_out.to(dtype))
    ref.backward(grad_out)
    for name, a, r in zip("qkv", leaves, ref_leaves, strict=True):
        err = rel_err(a.grad, r.grad)
        assert err < 10 * tol, f"seed={seed}: d{name} error {err}"


def test_naive_attention_low_precision_scores_in_float32(seed):
    B, H, N, d = 1, 2, 33, 32
    q, k, v = strided_qkv(B, H, N, d, torch.bfloat16)
    out = attention(q, k, v, backend="naive")
    assert out.dtype == torch.bfloat16
    ref = reference_attention(q, k, v)
    # bf16 has ~3 significant digits; only the final probs cast and P@V matmul are in bf16.
    assert rel_err(out, ref) < 2e-2, f"seed={seed}: {rel_err(out, ref)}"


def test_attention_is_causal(seed):
    """Changing future keys/values must not change earlier outputs (for every backend tested here)."""
    B, H, N, d = 1, 2, 12, 8
    q, k, v = strided_qkv(B, H, N, d, torch.float64)
    t = int(torch.randint(1, N - 1, ()).item())
    k2, v2 = k.clone(), v.clone()
    k2[:, :, t:] = torch.randn_like(k2[:, :, t:])
    v2[:, :, t:] = torch.randn_like(v2[:, :, t:])
    for backend in ("naive", "sdpa"):
        a = attention(q, k, v, backend)
        b = attention(q, k2, v2, backend)
        assert torch.equal(a[:, :, :t], b[:, :, :t]), f"seed={seed} backend={backend} t={t}"
        assert not torch.allclose(a[:, :, t:], b[:, :, t:]), f"seed={seed} backend={backend} t={t}"


def test_attention_unknown_backend_lists_valid_names(seed):
    q, k, v = strided_qkv(1, 1, 4, 8, torch.float32)
    with pytest.raises(ValueError) as exc:
        attention(q, k, v, backend="bogus")
    for name in ATTENTION_BACKENDS:
        assert name in str(exc.value)
    with pytest.raises(ValueError) as exc:
        attention(q, k, v, backend="sdpa", sdpa_backend="bogus")
    for name in SDPA_BACKENDS:
        assert name in str(exc.value)


def test_pinned_sdpa_backend_that_cannot_run_raises_clear_error(seed):
    q, k, v = strided_qkv(1, 2, 8, 16, torch.float32)
    with pytest.raises(RuntimeError) as exc:
        attention(q, k, v, backend="sdpa", sdpa_backend="cudnn")
    msg = str(exc.value)
    assert "cudnn" in msg and "attention.sdpa_backend=auto" in msg
    assert str(tuple(q.shape)) in msg and "float32" in msg and "cpu" in msg
    # Through the model too.
    model = GPT(tiny_config(sdpa_backend="cudnn"))
    with pytest.raises(RuntimeError, match="attention.sdpa_backend=auto"):
        model(torch.randint(0, 97, (1, 8)))


def test_sdpa_backend_that_ran(seed):
    q, k, v = strided_qkv(1, 2, 8, 16, torch.float32)
    for pinned in ("flash", "cudnn", "efficient", "math"):
        assert sdpa_backend_that_ran(q, k, v, pinned) == pinned
    assert sdpa_backend_that_ran(q, k, v, "auto") in {"flash", "efficient", "cudnn", "math", "overrideable"}
    if q.device.type == "cpu":  # PyTorch's CPU flash kernel takes no dropout: with it, math runs
        assert sdpa_backend_that_ran(q, k, v, "auto", dropout_p=0.1) == "math"
    with pytest.raises(ValueError):
        sdpa_backend_that_ran(q, k, v, "bogus")


def test_register_attention_backend(seed):
    calls = []

    def doubled_naive(q, k, v, sdpa_backend):
        calls.append(q.shape)
        return 2 * attention(q, k, v, "naive")

    name = "test-doubled-naive"
    register_attention_backend(name, doubled_naive, overwrite=True)
    assert name in available_attention_backends()
    with pytest.raises(ValueError, match="already registered"):
        register_attention_backend(name, doubled_naive)
    q, k, v = strided_qkv(1, 2, 5, 8, torch.float64)
    torch.testing.assert_close(attention(q, k, v, name), 2 * reference_attention(q, k, v))
    assert calls == [q.shape]
    assert GPTConfig.from_preset("tiny", attention=name).attention == name


def _packed_qkv(seed: int, B: int, N: int, H: int, d: int) -> torch.Tensor:
    return torch.randn(B, N, 3, H, d, generator=torch.Generator().manual_seed(seed))


def _views(qkv: torch.Tensor):
    return tuple(t.transpose(1, 2) for t in qkv.unbind(2))  # (B, H, N, d) each


@pytest.mark.parametrize("backend", ["naive", "sdpa", "flash"])
def test_attention_on_packed_qkv_every_backend(seed, monkeypatch, backend):
    """attention(qkv=...), the model's training call: every backend gives attention() on the three views,
    as (B, N, H, d) (flash through its packed kernel entry, under the Triton interpreter)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    qkv = _packed_qkv(seed, 2, 24, 2, 16)
    got = attention(qkv=qkv, backend=backend)
    want = reference_attention(*_views(qkv)).transpose(1, 2)
    assert got.shape == (2, 24, 2, 16)
    assert rel_err(got, want) < 1e-5, f"seed={seed} {backend}: {rel_err(got, want)}"
    with pytest.raises(ValueError, match=r"expects qkv of shape \(B, N, 3, H, d\)"):
        attention(qkv=qkv[:, :, :2], backend=backend)
    with pytest.raises(TypeError, match="expects qkv as a torch.Tensor, got list"):
        attention(qkv=[1, 2], backend=backend)
    with pytest.raises(ValueError, match="either q, k, v or qkv="):
        attention(*_views(qkv), backend, qkv=qkv)


def test_backend_record_packed_and_variants(seed):
    """A backend registered with qkvpacked= gets qkv whole, re-registered without it the three views; one
    registered without variants=True refuses a window, naming the config keys."""
    calls = []

    def plain(q, k, v, sdpa_backend):
        calls.append("views")
        return attention(q, k, v, "naive")

    def packed(qkv, sdpa_backend, **variants):
        calls.append("packed")
        return attention(*_views(qkv), "naive").transpose(1, 2)

    qkv = _packed_qkv(seed, 1, 8, 2, 16)
    try:
        record = register_attention_backend("test_packed", plain, qkvpacked=packed)
        assert BACKENDS["test_packed"] is record and record.packed is packed and not record.variants
        attention(qkv=qkv, backend="test_packed")
        register_attention_backend("test_packed", plain, overwrite=True)
        attention(qkv=qkv, backend="test_packed")
        register_attention_backend("test_packed", plain, overwrite=True, qkvpacked=packed)
        with pytest.raises(ValueError, match="without variants=True.*attention.window"):
            attention(qkv=qkv, backend="test_packed", window=4)
    finally:
        BACKENDS.pop("test_packed", None)
    assert calls == ["packed", "views"]


def test_backend_registration_refuses_what_cannot_run(seed):
    """A non-callable fn / qkvpacked / decode is refused at registration; a packed function that returns the
    unpacked (B, H, N, d) layout is refused at the call instead of being read scrambled."""
    for kw in ({"fn": None}, {"fn": attention, "qkvpacked": "no"}, {"fn": attention, "decode": 1}):
        with pytest.raises(TypeError, match="must be callable"):
            register_attention_backend("test_bad", **kw)
    assert "test_bad" not in available_attention_backends()
    qkv = _packed_qkv(seed, 2, 8, 2, 16)

    def wrong_layout(qkv, sdpa_backend, **variants):
        return attention(*_views(qkv), "naive")  # (B, H, N, d)

    try:
        register_attention_backend("test_layout", lambda q, k, v, s: q, qkvpacked=wrong_layout)
        with pytest.raises(RuntimeError, match=r"returned shape \(2, 2, 8, 16\), expected \(B, N, H, d\)"):
            attention(qkv=qkv, backend="test_layout")
    finally:
        BACKENDS.pop("test_layout", None)


# ------------------------------------------------------------------------------------ GPT


def test_initial_loss_near_log_vocab(seed):
    cfg = GPTConfig.from_preset("tiny", block_size=64)
    model = GPT(cfg).eval()
    idx = torch.randint(0, cfg.vocab_size, (4, 64))
    targets = torch.randint(0, cfg.vocab_size, (4, 64))
    with torch.no_grad():
        logits, loss = model(idx, targets)
    assert logits.shape == (4, 64, cfg.vocab_size) and logits.dtype == torch.float32
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.3, f"seed={seed}: loss {loss.item()}"
    _, no_loss = model(idx)
    assert no_loss is None


def test_ignore_index_minus_one(seed):
    cfg = tiny_config()
    model = GPT(cfg).double().eval()
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    targets = torch.randint(0, cfg.vocab_size, (2, 16))
    targets[:, ::3] = -1
    logits, loss = model(idx, targets)
    keep = targets != -1
    logp = torch.log_softmax(logits.double(), dim=-1)
    expected = -logp[keep].gather(1, targets[keep].unsqueeze(1)).mean()
    assert abs(loss.item() - expected.item()) < 1e-12, f"seed={seed}"


def test_training_call_has_no_logits_output(seed):
    """return_logits=False (the trainer's step): the same loss, and the compiled graph has no (B, T, V)
    output, so its backward takes no zero-filled (B, T, V) gradient (the default call keeps both)."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    cfg = GPTConfig.from_preset("tiny", block_size=32, vocab_size=1000, attention="sdpa")
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 32))
    logits, loss = model(idx, idx)
    none, same = model(idx, idx, return_logits=False)
    assert none is None and torch.equal(loss, same), f"seed={seed}"
    vocab_sized = []

    def backward_inputs(gm, _):
        vocab_sized.extend(
            n for n in gm.graph.nodes if n.op == "placeholder" and n.meta["val"].shape == logits.shape
        )
        return make_boxed_func(gm.forward)

    def backend(gm, inputs):
        forward = lambda gm, _: make_boxed_func(gm.forward)  # noqa: E731
        return aot_module_simplified(gm, inputs, fw_compiler=forward, bw_compiler=backward_inputs)

    for return_logits, expected in ((True, 1), (False, 0)):
        torch._dynamo.reset()
        vocab_sized.clear()
        _, loss = torch.compile(model, backend=backend)(idx, idx, return_logits=return_logits)
        loss.backward()
        assert len(vocab_sized) == expected, f"seed={seed}: return_logits={return_logits}"


def _logits_and_grads(model: GPT, idx, targets):
    model.zero_grad(set_to_none=True)
    logits, loss = model(idx, targets)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return logits.detach(), loss.detach(), grads


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("bias", [True, False])
def test_naive_and_sdpa_same_logits_and_grads(seed, dtype, tol, bias):
    cfg = tiny_config(bias=bias, attention="naive")
    model = GPT(cfg).to(dtype).eval()
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    targets = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    ref_logits, ref_loss, ref_grads = _logits_and_grads(model, idx, targets)
    with model.use_attention_backend("sdpa", "auto"):
        logits, loss, grads = _logits_and_grads(model, idx, targets)
    assert model.attention_backend == "naive"
    assert rel_err(logits, ref_logits) < tol, f"seed={seed}: logits {rel_err(logits, ref_logits)}"
    assert rel_err(loss, ref_loss) < tol, f"seed={seed}: loss"
    for name, g in ref_grads.items():
        err = rel_err(grads[name], g)
        assert err < 10 * tol, f"seed={seed}: grad {name} error {err}"


def test_use_attention_backend_restores_on_exception(seed):
    model = GPT(tiny_config(attention="naive", sdpa_backend="auto"))
    with pytest.raises(KeyError):
        with model.use_attention_backend("sdpa", "math") as m:
            assert m is model
            assert model.config.attention == "sdpa" and model.config.sdpa_backend == "math"
            assert all(b.attn.attention_backend == "sdpa" for b in model.transformer.h)
            assert all(b.attn.sdpa_backend == "math" for b in model.transformer.h)
            raise KeyError("boom")
    assert model.config.attention == "naive" and model.config.sdpa_backend == "auto"
    assert all(b.attn.attention_backend == "naive" for b in model.transformer.h)
    assert all(b.attn.sdpa_backend == "auto" for b in model.transformer.h)
    # An invalid switch changes nothing.
    with pytest.raises(ValueError):
        model.set_attention_backend("bogus")
    assert model.config.attention == "naive"
    assert all(b.attn.attention_backend == "naive" for b in model.transformer.h)


def test_flash_backend_matches_naive_loss_and_grads(seed, monkeypatch):
    """Tiny GPT, float32 on the CPU: attention=flash (Triton interpreter) gives the same loss and the same
    gradients of every parameter as attention=naive, on fresh random weights and tokens."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read by kernels at call time
    kernels = pytest.importorskip("kernels")
    kernels.check_flash_available(torch.device("cpu"))
    cfg = tiny_config(block_size=32, n_layer=2, n_head=2, n_embd=32)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 23))  # 23: not a multiple of any block size
    targets = torch.randint(0, cfg.vocab_size, (2, 23))

    def loss_and_grads(backend):
        model.zero_grad(set_to_none=True)
        with model.use_attention_backend(backend):
            _, loss = model(idx, targets)
        loss.backward()
        return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    ref_loss, ref_grads = loss_and_grads("naive")
    loss, grads = loss_and_grads("flash")
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item()), f"seed={seed}"
    for name, g in grads.items():
        assert rel_err(g, ref_grads[name]) < 1e-4, f"seed={seed} {name}: {rel_err(g, ref_grads[name])}"


# ------------------------------------------------------------------------------------ config errors


def test_config_n_embd_not_divisible_by_n_head():
    with pytest.raises(ValueError) as exc:
        GPTConfig(n_embd=130, n_head=4)
    assert "n_embd=130" in str(exc.value) and "n_head=4" in str(exc.value)


def test_config_unknown_backends():
    with pytest.raises(ValueError, match="naive, sdpa, flash"):
        GPTConfig(attention="xformers")
    with pytest.raises(ValueError, match="auto, flash, cudnn, efficient, math"):
        GPTConfig(sdpa_backend="fastest")
    with pytest.raises(ValueError, match="tiny"):
        GPTConfig.from_preset("gpt5")


def test_config_field_without_a_range_check(monkeypatch):
    """A new GPTConfig field needs no CHECKS entry (README, "Where things are"): without one it is checked by
    its type only, instead of a KeyError at every config."""
    import model.config as model_config

    monkeypatch.delitem(model_config.CHECKS, "rope_theta")
    assert GPTConfig(rope_theta=-1.0).rope_theta == -1.0
    assert model_config.problem("rope_theta", 5.0) is None
    monkeypatch.undo()
    with pytest.raises(ValueError, match="rope_theta"):
        GPTConfig(rope_theta=-1.0)


def test_config_flash_head_dim_range():
    with pytest.raises(ValueError, match="head_dim=4"):
        GPTConfig(n_embd=16, n_head=4, attention="flash")
    with pytest.raises(ValueError, match="head_dim=512"):
        GPTConfig(n_embd=1024, n_head=2, attention="flash")
    assert GPTConfig(n_embd=1024, n_head=4, attention="flash").head_dim == 256
    # Other backends don't restrict head_dim.
    assert GPTConfig(n_embd=16, n_head=4, attention="sdpa").head_dim == 4


def test_presets():
    for name, sizes in PRESETS.items():
        cfg = GPTConfig.from_preset(name, block_size=8)
        for key, value in sizes.items():
            assert getattr(cfg, key) == value
        assert cfg.block_size == 8


def test_sequence_longer_than_block_size(seed):
    cfg = tiny_config(block_size=8)
    model = GPT(cfg)
    with pytest.raises(ValueError, match="block_size=8"):
        model(torch.randint(0, cfg.vocab_size, (1, 9)))
    logits, _ = model(torch.randint(0, cfg.vocab_size, (1, 8)))
    assert logits.shape == (1, 8, cfg.vocab_size)


# ------------------------------------------------------------------------------------ accounting


def hand_param_count(cfg: GPTConfig) -> tuple[int, int]:
    """(total params, position-embedding params) counted from the GPT-2 architecture description."""
    C, V, T, L = cfg.n_embd, cfg.vocab_size, cfg.block_size, cfg.n_layer
    b = 1 if cfg.bias else 0
    per_block = (
        (C + b * C)  # ln_1
        + (C * 3 * C + b * 3 * C)  # c_attn
        + (C * C + b * C)  # attn.c_proj
        + (C + b * C)  # ln_2
        + (C * 4 * C + b * 4 * C)  # mlp.c_fc
        + (4 * C * C + b * C)  # mlp.c_proj
    )
    total = V * C + T * C + L * per_block + (C + b * C)  # wte (tied lm_head) + wpe + blocks + ln_f
    return total, T * C


@pytest.mark.parametrize("bias", [True, False])
def test_num_params_flops_and_mfu_match_hand_formula(seed, bias):
    n_layer = int(torch.randint(1, 4, ()).item())
    n_head = int(torch.randint(1, 5, ()).item())
    cfg = GPTConfig(
        block_size=int(torch.randint(8, 64, ()).item()),
        vocab_size=int(torch.randint(50, 300, ()).item()),
        n_layer=n_layer,
        n_head=n_head,
        n_embd=8 * n_head * int(torch.randint(1, 4, ()).item()),
        bias=bias,
    )
    model = GPT(cfg)
    total, wpe = hand_param_count(cfg)
    assert model.num_params(non_embedding=False) == total, f"seed={seed} cfg={cfg}"
    assert model.num_params() == total - wpe, f"seed={seed} cfg={cfg}"

    seq_len = int(torch.randint(1, 4096, ()).item())
    # PaLM appendix B: 6N + 12*L*H*Q*T, attention term halved for the causal mask.
    expected = 6 * (total - wpe) + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * seq_len / 2
    assert model.flops_per_token(seq_len) == pytest.approx(expected, rel=1e-12)

    tokens_per_sec = float(torch.rand(()).item() * 1e6)
    peak = 312e12
    assert model.estimate_mfu(tokens_per_sec, seq_len, peak) == pytest.approx(
        tokens_per_sec * expected / peak, rel=1e-12
    )
    assert model.estimate_mfu(tokens_per_sec, seq_len) == pytest.approx(
        tokens_per_sec * expected / 989e12, rel=1e-12
    )
    with pytest.raises(ValueError):
        model.flops_per_token(0)


def test_weight_tying_and_init(seed):
    cfg = tiny_config(n_layer=3, vocab_size=2000, block_size=64)
    model = GPT(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.lm_head.bias is None
    resid_std = 0.02 / math.sqrt(2 * cfg.n_layer)
    for name, p in model.named_parameters():
        if name.endswith("c_proj.weight"):
            assert abs(p.std().item() - resid_std) < 0.1 * resid_std, name
        elif name.endswith(("c_attn.weight", "c_fc.weight", "wte.weight", "wpe.weight")):
            assert abs(p.std().item() - 0.02) < 0.1 * 0.02, name
        elif name.endswith(".bias"):
            assert torch.all(p == 0), name
        elif "ln" in name:
            assert torch.all(p == 1), name


def test_configure_optimizers_groups(seed):
    for bias in (True, False):
        model = GPT(tiny_config(bias=bias))
        wd, lr = 0.1, 3e-4
        opt = model.configure_optimizers(wd, lr, (0.9, 0.95), "cpu")
        assert isinstance(opt, torch.optim.AdamW)
        decay, no_decay = opt.param_groups
        assert decay["weight_decay"] == wd and no_decay["weight_decay"] == 0.0
        assert all(g["lr"] == lr and g["betas"] == (0.9, 0.95) for g in opt.param_groups)
        decay_ids = {id(p) for p in decay["params"]}
        no_decay_ids = {id(p) for p in no_decay["params"]}
        assert not decay_ids & no_decay_ids
        for name, p in model.named_parameters():
            if name.endswith(".bias") or ".ln_" in name or "ln_f" in name:
                assert id(p) in no_decay_ids, name
            else:
                assert id(p) in decay_ids and p.dim() == 2, name
        n = sum(p.numel() for g in opt.param_groups for p in g["params"])
        assert n == model.num_params(non_embedding=False)
        assert len(decay_ids) + len(no_decay_ids) == len(list(model.parameters()))


# ------------------------------------------------------------------------------------ utilities


def test_generate_and_crop_block_size(seed):
    cfg = tiny_config(block_size=16)
    model = GPT(cfg).eval()
    prompt = torch.randint(0, cfg.vocab_size, (2, 5))
    out = model.generate(prompt, 20, temperature=0.8, top_k=5)
    assert out.shape == (2, 25) and out.dtype == torch.int64
    assert torch.equal(out[:, :5], prompt)
    assert int(out.min()) >= 0 and int(out.max()) < cfg.vocab_size
    # Greedy decoding picks the argmax of the full-forward logits.
    greedy = model.generate(prompt, 1, temperature=0)
    logits, _ = model(prompt)
    assert torch.equal(greedy[:, -1], logits[:, -1].argmax(-1))

    idx = torch.randint(0, cfg.vocab_size, (1, 8))
    before, _ = model(idx)
    model.crop_block_size(8)
    assert model.config.block_size == 8 and model.transformer.wpe.weight.shape[0] == 8
    after, _ = model(idx)
    torch.testing.assert_close(after, before)
    with pytest.raises(ValueError):
        model(torch.randint(0, cfg.vocab_size, (1, 9)))
