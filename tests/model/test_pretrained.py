"""init_from: a Hugging Face GPT-2 checkpoint in our GPT gives transformers' own logits and greedy tokens.

The reference is transformers' GPT2LMHeadModel itself, on a small randomly initialised GPT-2 that the
test builds and saves (no download): same logits in float32 (1e-5) on every attention backend (flash on
Triton's CPU interpreter), and cached greedy generation equal to theirs.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from model.pretrained import PretrainedError, gpt_from_pretrained, load_gpt2  # noqa: E402


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1234)
    cfg = GPT2Config(
        n_layer=2, n_head=4, n_embd=64, n_positions=32, vocab_size=97, bos_token_id=0, eos_token_id=0
    )
    hf = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # biases and LayerNorms away from their 0 / 1 init, so a dropped one shows
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    d = tmp_path_factory.mktemp("hf_gpt2")
    hf.save_pretrained(d)
    return d, hf


def _need(backend, monkeypatch):
    if backend == "flash":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        kernels = pytest.importorskip("kernels")
        kernels.check_flash_available(torch.device("cpu"))


@pytest.mark.parametrize("backend", ["naive", "sdpa", "flash"])
def test_logits_equal_transformers(hf_dir, backend, monkeypatch, seed):
    _need(backend, monkeypatch)
    d, hf = hf_dir
    model = gpt_from_pretrained(str(d), attention=backend).eval()
    c = model.config
    assert (c.n_layer, c.n_head, c.n_embd, c.block_size, c.vocab_size, c.bias) == (2, 4, 64, 32, 97, True)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 97, (2, 16), generator=g)
    with torch.no_grad():
        ours, _ = model(idx)
        theirs = hf(idx).logits
    assert ours.dtype == torch.float32
    err = (ours - theirs).abs().max().item()
    assert err <= 1e-5, f"seed={seed} backend={backend}: max |diff| {err}"


@pytest.mark.parametrize("backend", ["naive", "sdpa", "flash"])
def test_cached_greedy_generation_equals_transformers(hf_dir, backend, monkeypatch, seed):
    _need(backend, monkeypatch)
    d, hf = hf_dir
    model = gpt_from_pretrained(str(d), attention=backend).eval()
    idx = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(seed))
    ours = model.generate(idx, 12, temperature=0)
    theirs = hf.generate(idx, max_new_tokens=12, do_sample=False, use_cache=True, pad_token_id=0)
    assert torch.equal(ours, theirs), f"seed={seed} backend={backend}\n{ours}\n{theirs}"


def test_bad_init_from_is_named(tmp_path):
    with pytest.raises(PretrainedError, match=r"init_from='nope'.*gpt2"):
        load_gpt2("nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PretrainedError, match=r"could not load GPT-2 weights.*huggingface-cli download"):
        load_gpt2(str(tmp_path / "empty"))


def test_offline_gpt2_without_cache_says_what_to_fetch(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(PretrainedError, match=r"(?s)openai-community/gpt2.*huggingface-cli download"):
        load_gpt2("gpt2")
