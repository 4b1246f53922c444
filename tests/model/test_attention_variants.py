"""Attention variants in the model, data and trainer: sliding window, document masking, dropout.

* model.attention: naive, sdpa and flash (Triton interpreter) against the float64 reference of
  kernels.reference, for window and document masks; attention dropout in training only.
* data: prepare with a doc_separator (gpt2 writes <|endoftext|> between documents; char keeps the text),
  the loader's per-token document ids, and the model's ids derived from the tokens agree.
* trainer: the new keys' errors name the key and a valid value (exit 2); tiny CPU runs where the three
  backends log the same losses with a window and a document mask.
Inputs are seeded random tensors; the seed is in the messages.
"""

import pytest
import torch

from kernels.reference import attention_reference
from model.attention import attention

BACKENDS = ("naive", "sdpa", "flash")
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def _qkv(seed, B=2, H=2, N=48, d=16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, N, d, generator=g) for _ in range(3)], g


def _docs(g, B=2, N=48):
    """Random non-decreasing document ids (B, N), a new document with probability 0.1 per token."""
    starts = torch.rand(B, N, generator=g) < 0.1
    starts[:, 0] = True
    return (starts.cumsum(-1) - 1).to(torch.int32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window,docs", [(7, False), (None, True), (12, True)])
def test_backends_match_reference(seed, monkeypatch, backend, window, docs):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    (q, k, v), g = _qkv(seed)
    doc_ids = _docs(g) if docs else None
    o = attention(q, k, v, backend, window=window, doc_ids=doc_ids)
    ref, _ = attention_reference(q, k, v, window=window, doc_ids=doc_ids)
    err = (o.double() - ref).abs().max().item()
    assert err < 1e-5, f"seed={seed} {backend} window={window} docs={docs}: err {err:.3g}"


@pytest.mark.parametrize("backend", ("naive", "sdpa"))
def test_dropout_naive_sdpa(seed, backend):
    """p = 0 is the plain path bitwise; p > 0 changes the output, reproducibly under torch.manual_seed,
    and averages to the undropped output (E[Z / (1 - p)] = 1) within a loose bound."""
    (q, k, v), _ = _qkv(seed, B=1, H=1, N=16)
    plain = attention(q, k, v, backend)
    assert torch.equal(plain, attention(q, k, v, backend, dropout_p=0.0))
    torch.manual_seed(seed)
    a = attention(q, k, v, backend, dropout_p=0.3)
    torch.manual_seed(seed)
    b = attention(q, k, v, backend, dropout_p=0.3)
    assert torch.equal(a, b) and not torch.allclose(a, plain), f"seed={seed}"
    mean = torch.stack([attention(q, k, v, backend, dropout_p=0.3) for _ in range(400)]).mean(0)
    assert (mean - plain).abs().max() < 0.25, f"seed={seed}: dropout mean {(mean - plain).abs().max():.3f}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window,docs", [(9, False), (None, True), (9, True)])
def test_cached_and_static_decode_variants(seed, monkeypatch, backend, window, docs):
    """KV-cache steps with a window and/or documents equal the matching rows of full attention, every
    backend: the last 3 rows against the prefix, and one row per sequence against a whole cache buffer
    with per-sequence lengths (the static decode step; keys past lengths[b] must not count)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    (q, k, v), g = _qkv(seed, B=2, H=2, N=40)
    doc = _docs(g, 2, 40) if docs else None
    full, _ = attention_reference(q, k, v, window=window, doc_ids=doc)
    o = attention(
        q[:, :, -3:], k, v, backend, window=window, doc_ids=None if doc is None else (doc[:, -3:], doc)
    )
    assert (o.double() - full[:, :, -3:]).abs().max() < 1e-5, f"seed={seed} {backend} cached"
    lengths = torch.tensor([40, 25])
    rows = (lengths - 1)[:, None]  # each sequence's newest position
    q_new = torch.stack([q[0, :, 39:40], q[1, :, 24:25]])  # (B, H, 1, d)
    pair = None if doc is None else (doc.gather(1, rows), doc)
    o = attention(q_new, k, v, backend, window=window, doc_ids=pair, lengths=lengths)
    ref25, _ = attention_reference(
        q[1:, :, 24:25],
        k[1:, :, :25],
        v[1:, :, :25],
        window=window,
        doc_ids=None if doc is None else (doc[1:, 24:25], doc[1:, :25]),
    )
    assert (o[0].double() - full[0, :, -1:]).abs().max() < 1e-5, f"seed={seed} {backend} static"
    assert (o[1:].double() - ref25).abs().max() < 1e-5, f"seed={seed} {backend} static, shorter"


def test_attention_variant_errors():
    q = torch.randn(1, 1, 8, 16)
    with pytest.raises(ValueError, match="window must be None or an int >= 1"):
        attention(q, q, q, "naive", window=0)
    with pytest.raises(ValueError, match=r"dropout_p must be a float in \[0, 1\)"):
        attention(q, q, q, "sdpa", dropout_p=1.0)
    with pytest.raises(ValueError, match="doc_ids must be a"):
        attention(q, q, q, "naive", doc_ids=torch.zeros(1, 7, dtype=torch.int32))


# ------------------------------------------------------------------------------------------- data


def test_doc_ids_rule():
    from data.docs import doc_ids_from_tokens, separator_ends

    t = torch.tensor([[5, 1, 1, 7, 1, 1, 1, 2]])
    assert separator_ends(t.numpy()[0], [1, 1]).tolist() == [
        False,
        False,
        True,
        False,
        False,
        True,
        True,
        False,
    ]
    assert doc_ids_from_tokens(t, [1, 1]).tolist() == [[0, 0, 0, 1, 1, 1, 2, 3]]
    assert doc_ids_from_tokens(t, [7]).tolist() == [[0, 0, 0, 0, 1, 1, 1, 1]]


def test_prepare_gpt2_writes_eot_between_documents(tmp_path, gpt2_bpe):
    from data.loader import BinDataset
    from data.prepare import prepare, stale_reason

    src = tmp_path / "c.txt"
    src.write_text("First doc here.\n\nSecond one.\n\n\n\nThird, after an empty one.\n\nFourth and last one.")
    meta = prepare(str(src), tmp_path / "d", "gpt2", 0.3, doc_separator="\n\n")
    assert meta["doc_separator"] == "\n\n" and meta["doc_separator_ids"] == [50256]
    assert meta["train_docs"] + meta["val_docs"] >= 4
    ds = BinDataset(tmp_path / "d", "train", 4)
    toks = ds.tokens()
    assert (toks == 50256).sum() >= 2 and gpt2_bpe.decode(toks[toks != 50256]).startswith("First doc here.")
    assert stale_reason(str(src), tmp_path / "d", "gpt2", 0.3, "\n\n") is None
    assert "doc_separator" in stale_reason(str(src), tmp_path / "d", "gpt2", 0.3, None)


def test_loader_doc_ids_match_the_model_derivation(tmp_path, shakespeare_path, seed):
    """Prepared char data with "\\n\\n": the loader's per-token ids (from the whole split) equal the model's
    ids derived from the window's tokens, except windows whose first token ends a separator."""
    from data.loader import BinDataset
    from data.prepare import prepare
    from model import GPT, GPTConfig

    meta = prepare(str(shakespeare_path), tmp_path / "c", "char", 0.1, doc_separator="\n\n")
    nl = meta["itos"].index("\n")
    assert meta["doc_separator_ids"] == [nl, nl] and meta["train_docs"] > 1000
    ds = BinDataset(tmp_path / "c", "train", 128)
    x, y, doc = ds.batch(16, seed=seed % 1000, step=0, with_doc_ids=True)
    assert doc.dtype == torch.int32 and doc.shape == x.shape and (doc[:, 1:] >= doc[:, :-1]).all()
    model = GPT(
        GPTConfig(
            block_size=128,
            vocab_size=128,
            n_layer=1,
            n_head=2,
            n_embd=32,
            document_mask=True,
            doc_separator_ids=meta["doc_separator_ids"],
        )
    )
    derived = model.document_ids(x)
    clean = x[:, 0] != nl  # a window starting on the second '\n' of a separator: the model cannot see it
    assert torch.equal(derived[clean], doc[clean]), f"seed={seed}"
    assert doc.max() > 0, f"seed={seed}: no document boundary in 16 windows of 128 characters?"


# ---------------------------------------------------------------------------------------- trainer


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["attention.window=0"], "attention.window=0 must be null or a positive integer"),
        (["attention.window=true"], "attention.window=True must be null or a positive integer"),
        (
            ["attention.document_mask=maybe"],
            "attention.document_mask='maybe' is not valid; choose true or false",
        ),
        (["attention.document_mask=true"], "attention.document_mask=true needs documents: set data.doc_sep"),
        (["model.attn_dropout=1.0"], r"model.attn_dropout=1.0 must be in \[0, 1\)"),
        (["data.doc_separator=''"], "data.doc_separator='' must be null or a non-empty string"),
        (
            ["attention=sdpa", "attention.sdpa_backend=cudnn", "attention.window=8"],
            "attention.sdpa_backend=cudnn takes no attention mask",
        ),
    ],
)
def test_variant_config_errors(tmp_path, overrides, match):
    """Each bad variant key is a config error naming it: from OmegaConf's types while composing (as
    train.py reports them, trainer.fields) or from the one check of the model keys, GPTConfig's."""
    import re

    from tests.helpers_train import compose_cfg
    from trainer.checks import ConfigError, resolve_plan
    from trainer.config import TrainConfig
    from trainer.fields import config_error_from

    try:
        cfg = compose_cfg(["experiment=cpu_tiny", f"data.dir={tmp_path}/none", *overrides])
    except Exception as e:  # noqa: BLE001 - a composition error: its ConfigError text
        err = config_error_from(e, TrainConfig)
        assert err is not None, e
        assert re.search(match, str(err)), str(err)
        return
    with pytest.raises(ConfigError, match=match):
        resolve_plan(cfg, world_size=1, cuda_available=False)


@pytest.mark.slow  # over 5 s on 2 cores
def test_data_dir_of_another_doc_separator_is_refused(tmp_path, char_data, shakespeare_path):
    from tests.helpers_train import describe, run_train, tiny_overrides

    proc = run_train(
        tiny_overrides(
            char_data,
            shakespeare_path,
            tmp_path / "run",
            **{"data.doc_separator": "'\\n\\n'", "attention.document_mask": True},
        ),
        timeout=120,
    )
    assert proc.returncode == 2, describe(proc)
    text = proc.stderr + proc.stdout
    assert "data.doc_separator" in text and "a folder of its own" in text, describe(proc)


@pytest.mark.slow  # over 5 s on 2 cores
def test_a_separator_that_never_occurs_is_reported(tmp_path, shakespeare_path):
    """document_mask with a data.doc_separator absent from the corpus (one document): the run goes on but
    says that the mask changes nothing, instead of silently training plain causal attention."""
    from tests.helpers_train import describe, run_train, tiny_overrides

    extra = {
        "data.doc_separator": "ZZZQQQ",
        "attention.document_mask": True,
        "max_steps": 1,
        "eval.interval": 0,
        "attention": "naive",
    }
    proc = run_train(tiny_overrides(tmp_path / "d", shakespeare_path, tmp_path / "run", **extra), timeout=180)
    assert proc.returncode == 0, describe(proc)
    assert "data.doc_separator='ZZZQQQ' does not occur" in proc.stdout, describe(proc)


@pytest.mark.slow
def test_tiny_runs_backends_agree_with_window_and_documents(tmp_path, shakespeare_path):
    """Three 3-step CPU runs (naive, sdpa, flash under TRITON_INTERPRET=1), window 16 and document masks on
    Tiny Shakespeare speeches (float32): the logged losses agree to 1e-4, and differ from plain causal."""
    from tests.helpers_train import describe, run_train, tiny_overrides, train_env, train_losses

    data = tmp_path / "docs"
    losses = {}
    for backend in ("naive", "sdpa", "flash", "plain"):
        extra = {
            "attention": "naive" if backend == "plain" else backend,
            "max_steps": 3,
            "seq_len": 64,
            "batch.tokens_per_step": 512,
            "model.dropout": 0.0,
            "eval.interval": 0,
            "eval.batches": 1,
            "checkpoint.interval": 0,
            "checkpoint.at_end": False,
            "optim.decay_steps": 3,
            "data.doc_separator": "'\\n\\n'",
        }
        if backend != "plain":
            extra.update({"attention.window": 16, "attention.document_mask": True})
        env = train_env(TRITON_INTERPRET=1) if backend == "flash" else train_env()
        proc = run_train(
            tiny_overrides(data, shakespeare_path, tmp_path / backend, **extra), env=env, timeout=400
        )
        assert proc.returncode == 0, describe(proc)
        losses[backend] = train_losses(tmp_path / backend)
    assert sorted(losses["naive"]) == [1, 2, 3]
    for backend in ("sdpa", "flash"):
        for step, loss in losses["naive"].items():
            assert abs(losses[backend][step] - loss) < 1e-4, (
                f"{backend} step {step}: {losses[backend]} vs naive {losses['naive']}"
            )
    assert any(abs(losses["plain"][s] - losses["naive"][s]) > 1e-4 for s in (2, 3)), (
        "window + document mask changed nothing"
    )


@pytest.mark.slow  # over 5 s on 2 cores
def test_bench_variants_dry_run(tmp_path):
    """bench/variants.py plumbing on the CPU: every cell runs (or is skipped with a reason), JSON and
    markdown are written, the markdown has one row per (mask, N, mode)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.variants",
            "--dry-run",
            "--out",
            str(tmp_path),
            "--modes",
            "fwd",
            "--ns",
            "64",
        ],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads((tmp_path / "variants_dryrun.json").read_text())
    assert {r["mask"] for r in data["records"]} == {"causal", "window16", "docs"}
    assert all(r["status"] == "ok" and r["ms"] > 0 for r in data["records"]), data["records"]
    md = (tmp_path / "variants_dryrun.md").read_text()
    assert "Dry run" in md and md.count("| 64 | fwd |") == 3
