"""Tests of the data step (data/prepare.py, data/loader.py) on real Tiny Shakespeare and small texts.

References are independent of the code under test: hashlib for the hash, tiktoken / Python's str
for tokenization, and a corpus of distinct characters whose char-level ids are 0..n-1 in order, so
every window's expected content is known in closed form.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import subprocess
import sys
import time
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import tiktoken
import torch

from data import prepare as prep
from data.loader import BinDataset, load_meta, tokenizer_from_meta
from data.prepare import ensure_prepared, prepare

REPO = Path(__file__).resolve().parents[2]
SHAKESPEARE_GPT2_TOKENS = 338_025


def _ids(path: Path, dtype: str = "<u2") -> np.ndarray:
    return np.fromfile(path, dtype=dtype).astype(np.int64)


def _split_ids(d: Path, split: str) -> np.ndarray:
    """A split's token stream read straight from its shard files (meta.json's list, in order)."""
    meta = json.loads((d / "meta.json").read_text())
    dtype = {"uint16": "<u2", "uint32": "<u4"}[meta["dtype"]]
    parts = [_ids(d / s["file"], dtype) for s in meta["shards"][split]]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _token_files(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.suffix in (".bin", ".idx"))


def _write(path: Path, text: str) -> Path:
    path.write_bytes(text.encode("utf-8"))
    return path


def _distinct_corpus(tmp_path: Path, n: int = 500) -> Path:
    """n distinct characters in increasing code point order: char ids are exactly 0..n-1 in order."""
    return _write(tmp_path / "distinct.txt", "".join(chr(0x100 + i) for i in range(n)))


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, shakespeare_path, gpt2_bpe) -> Path:
    out = tmp_path_factory.mktemp("shakespeare_gpt2")
    prepare(str(shakespeare_path), out, tokenizer="gpt2")
    return out


@pytest.fixture(scope="module")
def char_dir(tmp_path_factory, shakespeare_path) -> Path:
    out = tmp_path_factory.mktemp("shakespeare_char")
    prepare(shakespeare_path, out, tokenizer="char")
    return out


# ------------------------------------------------------------------------------------------ prepare
def _vocab_sha256(enc) -> str:
    """SHA-256 of every token's bytes (4-byte little-endian length, then the bytes), in id order."""
    h = hashlib.sha256()
    for i in range(enc.n_vocab):
        b = enc.decode_single_token_bytes(i)
        h.update(len(b).to_bytes(4, "little") + b)
    return h.hexdigest()


def test_prepare_gpt2_round_trip_sizes_and_meta(gpt2_dir, shakespeare_path):
    raw = shakespeare_path.read_bytes()
    text = raw.decode("utf-8")
    meta = json.loads((gpt2_dir / "meta.json").read_text())
    train, val = _split_ids(gpt2_dir, "train"), _split_ids(gpt2_dir, "val")
    total = len(train) + len(val)

    assert total == SHAKESPEARE_GPT2_TOKENS
    assert len(train) == int(total * 0.9) == 304_222 and len(val) == 33_803
    assert meta == {
        "format_version": 2,
        "tokenizer": "gpt2",
        "vocab_size": 50257,
        "train_tokens": len(train),
        "val_tokens": len(val),
        "val_fraction": 0.1,
        "source": str(shakespeare_path.resolve()),
        "source_sha256": hashlib.sha256(raw).hexdigest(),
        "source_kind": "text",
        "text_field": "text",
        "max_tokens": None,
        "dtype": "uint16",
        "shard_tokens": prep.DEFAULT_SHARD_TOKENS,
        "shards": {
            split: [{"file": f"{split}_000000.bin", "tokens": n, "docs": 1, "index": f"{split}_000000.idx"}]
            for split, n in (("train", len(train)), ("val", len(val)))
        },
        # what the ids mean (a resume compares it): the encoding's name, and its tokens' bytes in id order
        "encoding": "gpt2",
        "vocab_sha256": _vocab_sha256(tiktoken.get_encoding("gpt2")),
    }
    assert (gpt2_dir / "train_000000.bin").stat().st_size == 2 * len(train)
    # independent reference: tiktoken directly
    enc = tiktoken.get_encoding("gpt2")
    assert np.array_equal(np.concatenate([train, val]), np.array(enc.encode_ordinary(text)))
    tok = tokenizer_from_meta(load_meta(gpt2_dir))
    assert tok.decode(train) + tok.decode(val) == text
    assert tok.encode("Hello world") == enc.encode_ordinary("Hello world")
    assert load_meta(gpt2_dir) == meta


def test_prepare_char_round_trip_and_meta(char_dir, shakespeare_path):
    text = shakespeare_path.read_text(encoding="utf-8")
    meta = load_meta(char_dir)
    train, val = _split_ids(char_dir, "train"), _split_ids(char_dir, "val")

    chars = sorted(set(text))
    assert meta["tokenizer"] == "char" and meta["itos"] == chars and meta["vocab_size"] == len(chars) == 65
    assert len(train) + len(val) == len(text) == 1_115_394
    assert (meta["train_tokens"], meta["val_tokens"]) == (len(train), len(val)) == (1_003_854, 111_540)
    assert meta["source_sha256"] == hashlib.sha256(shakespeare_path.read_bytes()).hexdigest()
    # independent reference: str -> index in the sorted character list
    stoi = {c: i for i, c in enumerate(chars)}
    assert np.array_equal(np.concatenate([train, val]), np.array([stoi[c] for c in text]))
    tok = tokenizer_from_meta(meta)
    assert tok.decode(train) + tok.decode(val) == text
    assert tok.decode(torch.from_numpy(val[:50])) == text[len(train) : len(train) + 50]


@pytest.mark.parametrize("name", ["gpt2", "char"])
def test_prepare_unicode_text_round_trips(tmp_path, name, request):
    if name == "gpt2":
        request.getfixturevalue("gpt2_bpe")  # skips offline without tiktoken's files
    text = "naïve café — 東京 🚀\r\nline two\ttabs\n\ufeffBOM-like\n" * 3
    src = _write(tmp_path / "u.txt", text)
    out = tmp_path / name
    meta = prepare(src, out, tokenizer=name, val_fraction=0.25)
    ids = np.concatenate([_split_ids(out, "train"), _split_ids(out, "val")])
    assert meta["train_tokens"] == int(len(ids) * 0.75)
    assert tokenizer_from_meta(meta).decode(ids) == text  # exact, incl. \r\n


@pytest.mark.slow  # over 5 s on 2 cores
def test_cli_module_and_script(tmp_path, shakespeare_path, request):
    src = _distinct_corpus(tmp_path, 300)
    out = tmp_path / "cli_char"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "data.prepare",
            "--source",
            str(src),
            "--out-dir",
            str(out),
            "--tokenizer",
            "char",
            "--val-fraction",
            "0.2",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "240 train + 60 val tokens" in res.stdout
    assert load_meta(out)["val_fraction"] == 0.2
    assert np.array_equal(_split_ids(out, "train"), np.arange(240))

    # `python data/prepare.py` from another working directory, GPT-2 on the real corpus
    request.getfixturevalue("gpt2_bpe")  # skips offline without tiktoken's files
    out = tmp_path / "cli_gpt2"
    res = subprocess.run(
        [
            sys.executable,
            str(REPO / "data" / "prepare.py"),
            "--source",
            str(shakespeare_path),
            "--out-dir",
            str(out),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    meta = load_meta(out)
    assert meta["train_tokens"] + meta["val_tokens"] == SHAKESPEARE_GPT2_TOKENS

    res = subprocess.run(
        [sys.executable, "-m", "data.prepare", "--source", str(tmp_path / "nope.txt"), "--out-dir", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 1 and "nope.txt" in res.stderr and "Traceback" not in res.stderr


def _files(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


def test_cli_refuses_a_dir_prepared_otherwise_unless_forced(tmp_path, capsys):
    """`python -m data.prepare --out-dir X` never silently replaces X's data of another tokenizer, split
    or corpus (runs read it): exit 1 naming what X holds and both fixes, nothing written; --force
    replaces it; the same arguments again re-prepare it."""
    src = _distinct_corpus(tmp_path, 300)
    out = tmp_path / "data"
    base = ["--source", str(src), "--out-dir", str(out)]
    assert prep.main([*base, "--tokenizer", "char"]) == 0
    before = _files(out)
    capsys.readouterr()
    other = _write(tmp_path / "other.txt", "another text entirely\n" * 20)
    for args, held in [
        (["--tokenizer", "gpt2"], "data tokenized with 'char' (vocab_size 300), not 'gpt2'"),
        (["--tokenizer", "char", "--val-fraction", "0.2"], "data split with val_fraction=0.1, not 0.2"),
        (["--tokenizer", "char", "--source", str(other)], f"data prepared from {src}"),
    ]:
        assert prep.main([*base, *args]) == 1
        err = capsys.readouterr().err
        assert f"{out} already holds {held}" in err, err
        assert f"--out-dir {out}_" in err and "--force" in err, err
        assert _files(out) == before
    assert prep.main([*base, "--tokenizer", "char"]) == 0  # the same data again: fine
    assert _files(out) == before
    assert prep.main([*base, "--tokenizer", "char", "--val-fraction", "0.2", "--force"]) == 0
    assert load_meta(out)["val_fraction"] == 0.2 and load_meta(out)["train_tokens"] == 240


def test_cli_refuses_an_out_dir_inside_its_folder_source(tmp_path, capsys):
    """--out-dir in (or equal to) a folder --source: exit 1 naming a folder outside it, nothing written."""
    src = tmp_path / "corpus"
    src.mkdir()
    _write(src / "a.txt", "some text of a document\n" * 50)
    for out in (src, src / "tok"):
        assert prep.main(["--source", str(src), "--out-dir", str(out), "--no-progress"]) == 1
        err = capsys.readouterr().err
        assert f"--out-dir {out} is inside --source {src}" in err and f"--out-dir {tmp_path}/corpus_" in err
    assert sorted(p.name for p in src.iterdir()) == ["a.txt"]


def test_cli_that_waited_for_another_prepare_refuses_what_that_one_wrote(tmp_path, capsys):
    """Two `python -m data.prepare` of other sources into one --out-dir at once: the second waits for the
    first's lock, then finds its data and refuses (exit 1, nothing replaced), as it would run after it."""
    import threading

    src = _distinct_corpus(tmp_path, 300)
    other = _write(tmp_path / "other.txt", "another text entirely\n" * 20)
    out = tmp_path / "data"
    codes = []
    with prep._locked(out):  # the first prepare, holding the folder
        waiter = threading.Thread(
            target=lambda: codes.append(
                prep.main(
                    ["--source", str(other), "--out-dir", str(out), "--tokenizer", "char", "--no-progress"]
                )
            )
        )
        waiter.start()
        time.sleep(1.0)  # the second has started and waits on the lock
        opts = prep.Options("char", None, None, None, "text", None)
        prep._prepare_into(out, str(src), opts, 1, prep.DEFAULT_SHARD_TOKENS, "auto", False)
        before = _files(out)
    waiter.join(timeout=60)
    assert codes == [1], capsys.readouterr().err
    assert f"{out} already holds data prepared from {src}" in capsys.readouterr().err
    assert _files(out) == before and load_meta(out)["source"] == str(src)


def test_interrupted_prepare_leaves_the_prepared_data_as_it_was(tmp_path, monkeypatch):
    """A prepare killed while writing shards touches nothing prepared: they go to a stage first."""
    from data import shards

    src = _write(tmp_path / "a.txt", "abcdefghij" * 20)
    out = tmp_path / "out"
    prepare(src, out, tokenizer="char")
    before = _files(out)

    real = shards.ShardWriter.finish
    calls = []

    def failing(self):  # the second split's shard write "dies"
        calls.append(self.split)
        if len(calls) == 2:
            raise KeyboardInterrupt("simulated kill")
        return real(self)

    monkeypatch.setattr(shards.ShardWriter, "finish", failing)
    with pytest.raises(KeyboardInterrupt):
        prepare(_write(tmp_path / "b.txt", "zyxw" * 30), out, tokenizer="char")
    assert _files(out) == before  # the old data and meta.json, untouched
    assert not [p for p in os.listdir(out) if p.startswith(".tmp-")]
    assert BinDataset(out, "train", 4).tokens(0, 3).tolist() == [0, 1, 2]
    monkeypatch.undo()
    # ensure_prepared prepares the new corpus
    meta = ensure_prepared(tmp_path / "b.txt", out, "char")
    assert meta["itos"] == ["w", "x", "y", "z"] and not (out / shards.STAGE_NAME).exists()


# ---------------------------------------------------------------------------------- ensure_prepared
def test_ensure_prepared_skips_when_up_to_date_and_redoes_on_change(tmp_path, caplog, gpt2_bpe):
    src = _write(tmp_path / "s.txt", "To be, or not to be, that is the question.\n" * 40)
    out = tmp_path / "out"
    meta = ensure_prepared(src, out, "char")
    files = [*_token_files(out), out / "meta.json"]
    mtimes = [f.stat().st_mtime_ns for f in files]

    caplog.set_level("INFO", logger="data.prepare")
    assert ensure_prepared(str(src), out, "char") == meta
    assert [f.stat().st_mtime_ns for f in files] == mtimes  # nothing rewritten

    caplog.clear()
    meta2 = ensure_prepared(src, out, "gpt2")  # tokenizer changed
    assert meta2["tokenizer"] == "gpt2" and "itos" not in meta2
    assert "tokenized with 'char'" in caplog.text
    assert load_meta(out) == meta2

    caplog.clear()
    _write(src, "Different content now.\n" * 40)  # source changed -> sha256 differs
    meta3 = ensure_prepared(src, out, "gpt2")
    assert meta3["source_sha256"] == hashlib.sha256(src.read_bytes()).hexdigest() != meta2["source_sha256"]
    assert "source changed" in caplog.text

    caplog.clear()
    meta4 = ensure_prepared(src, out, "gpt2", val_fraction=0.5)
    assert meta4["val_fraction"] == 0.5 and "val_fraction" in caplog.text

    caplog.clear()
    with open(out / "val_000000.bin", "r+b") as f:  # truncated file -> re-prepared
        f.truncate(2)
    assert ensure_prepared(src, out, "gpt2", val_fraction=0.5) == meta4
    assert (out / "val_000000.bin").stat().st_size == 2 * meta4["val_tokens"] and "bytes" in caplog.text


def test_ensure_prepared_missing_source_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"missing\.txt.*data\.source=PATH"):
        ensure_prepared(tmp_path / "missing.txt", tmp_path / "out", "char")


# ------------------------------------------------------------------------------------- input errors
def test_non_utf8_source_error(tmp_path):
    src = tmp_path / "latin1.txt"
    src.write_bytes("caf\u00e9 au lait".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.txt is not UTF-8.*offset 3.*Convert"):
        prepare(src, tmp_path / "out", tokenizer="char")
    assert not (tmp_path / "out" / "meta.json").exists()


def test_a_leading_byte_order_mark_is_not_text(tmp_path):
    """A UTF-8 file saved with a byte-order mark (Notepad): the mark is no character of the vocabulary and
    no token; a bad byte's offset still counts the file's bytes, the mark's 3 included."""
    from data.sources import read_blocks

    text = "To be, or not to be: that is the question.\n" * 20
    src = tmp_path / "bom.txt"
    src.write_bytes(b"\xef\xbb\xbf" + text.encode())
    meta = prepare(src, tmp_path / "out", tokenizer="char")
    assert "\ufeff" not in meta["itos"] and sorted(meta["itos"]) == sorted(set(text)), meta["itos"]
    assert meta["train_tokens"] + meta["val_tokens"] == len(text)
    assert "".join(read_blocks(src)) == text
    src.write_bytes(b"\xef\xbb\xbfcaf\xe9")
    with pytest.raises(ValueError, match=r"bom\.txt is not UTF-8.*offset 6"):
        "".join(read_blocks(src))


def test_binary_file_in_a_corpus_is_named_as_binary(tmp_path, gpt2_bpe, seed):
    """A binary file (NUL bytes) among the texts: named, said to look binary, with a glob that leaves it
    out (no iconv advice, which fits a text in another encoding)."""
    rng = np.random.default_rng(seed)
    d = tmp_path / "texts"
    d.mkdir()
    (d / "a.txt").write_text("one document about a cat")
    (d / "b.txt").write_text("another document about a dog")
    (d / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" + rng.bytes(200))
    with pytest.raises(ValueError) as e:
        prepare(str(d), tmp_path / "out", "gpt2", 0.5, workers=1, progress=False)
    msg = str(e.value)
    assert "logo.png looks binary (it holds NUL bytes" in msg and "iconv" not in msg, msg
    glob = re.search(r"data\.source='(\S+)'", msg).group(1).replace("DIR", str(d))
    meta = prepare(glob, tmp_path / "out", "gpt2", 0.5, workers=1, progress=False)  # the advice works
    assert meta["train_docs"] + meta["val_docs"] == 2


def test_missing_source_and_bad_arguments(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no_such\.txt.*does not exist"):
        prepare(tmp_path / "no_such.txt", tmp_path / "out")
    (tmp_path / "empty_dir").mkdir()  # a directory is a list of documents: one without files is refused
    with pytest.raises(FileNotFoundError, match="empty_dir.*holds no"):
        prepare(tmp_path / "empty_dir", tmp_path / "out")
    src = _write(tmp_path / "ok.txt", "hello there")
    with pytest.raises(ValueError, match="unknown tokenizer"):
        prepare(src, tmp_path / "out", tokenizer="bpe")
    for bad in (0.0, 1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="val_fraction"):
            prepare(src, tmp_path / "out", val_fraction=bad)
    with pytest.raises(ValueError, match="empty"):
        prepare(_write(tmp_path / "empty.txt", ""), tmp_path / "out", tokenizer="char")
    with pytest.raises(ValueError, match="at least 2"):
        prepare(_write(tmp_path / "one.txt", "x"), tmp_path / "out", tokenizer="char")


def test_download_failure_says_to_pass_local_path(tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise urllib.error.URLError("Temporary failure in name resolution")

    monkeypatch.setattr(prep.urllib.request, "urlopen", offline)
    with pytest.raises(
        RuntimeError, match=r"could not download https://.*tinyshakespeare.*data\.source=PATH"
    ):
        prepare(None, tmp_path / "out", tokenizer="char")
    assert not (tmp_path / "out" / "input.txt").exists()


def test_failed_download_takes_back_the_data_dirs_it_created(tmp_path, monkeypatch):
    """A prepare whose download fails removes the data directory (and the parents) it created, with the
    same error; a directory that existed before, or that holds other files by then, is kept."""
    foreign: list[Path] = []

    def offline(*args, **kwargs):
        for d in foreign:  # another writer's file appears in the new directory meanwhile
            _write(d / "notes.txt", "not prepare's")
        raise urllib.error.URLError("Temporary failure in name resolution")

    monkeypatch.setattr(prep.urllib.request, "urlopen", offline)

    def failure(out: Path) -> str:
        with pytest.raises(RuntimeError) as e:
            ensure_prepared(None, out, "char")
        return str(e.value)

    existing = tmp_path / "existing"
    existing.mkdir()
    message = failure(existing)
    assert message.startswith(f"could not download {prep.TINY_SHAKESPEARE_URL} (URLError: ")
    assert existing.is_dir() and list(existing.iterdir()) == []  # there before: kept

    assert failure(tmp_path / "new" / "shakespeare_char") == message  # the same error ...
    assert sorted(os.listdir(tmp_path)) == ["existing"]  # ... and both directories it made are gone

    foreign.append(tmp_path / "busy" / "data")
    assert failure(foreign[0]) == message
    assert os.listdir(foreign[0]) == ["notes.txt"]  # someone else's file: the directory stays


@pytest.mark.slow  # real train.py processes
def test_train_without_network_leaves_no_empty_data_dir(tmp_path):
    """train.py with the default (downloaded) corpus and no network: config error, and the data.dir it
    would have prepared is not left behind empty."""
    from tests.helpers_train import describe, offline_train_env, run_train

    data = tmp_path / "data" / "shakespeare_char"
    proc = run_train(
        [
            "experiment=cpu_tiny",
            "max_steps=1",
            f"data.dir={data}",
            f"out_dir={tmp_path / 'run'}",
            "wandb.mode=disabled",
        ],
        env=offline_train_env(),
    )
    assert proc.returncode == 2, describe(proc)
    assert f"data (data.source=None, data.dir={data}): could not download" in proc.stderr, describe(proc)
    assert "data.source=PATH" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "data").exists(), sorted(map(str, tmp_path.rglob("*")))


def test_default_source_reuses_downloaded_input(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    _write(out / "input.txt", "First Citizen:\nBefore we proceed any further, hear me speak.\n")

    def no_network(*args, **kwargs):
        raise AssertionError("must not download when input.txt exists")

    monkeypatch.setattr(prep.urllib.request, "urlopen", no_network)
    meta = ensure_prepared(None, out, "char")
    assert meta["source"] == prep.TINY_SHAKESPEARE_URL
    mtime = (out / "meta.json").stat().st_mtime_ns
    assert ensure_prepared(None, out, "char") == meta
    assert (out / "meta.json").stat().st_mtime_ns == mtime


# --------------------------------------------------------------------------------------- the loader
@pytest.fixture
def distinct_dir(tmp_path) -> Path:
    out = tmp_path / "distinct"
    prepare(_distinct_corpus(tmp_path, 500), out, tokenizer="char")  # train ids 0..449, val 450..499
    return out


def test_batch_windows_are_consecutive_and_shifted(distinct_dir):
    ds = BinDataset(distinct_dir, "train", seq_len=16)
    assert ds.num_tokens == len(ds) == 450
    seen_starts = set()
    for step in range(200):
        x, y = ds.batch(8, seed=3, step=step)
        assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.int64
        starts = x[:, 0]
        expected = starts[:, None] + torch.arange(16)
        assert torch.equal(x, expected) and torch.equal(y, expected + 1)  # ids == positions here
        seen_starts.update(starts.tolist())
    # uniform over every valid window: first (start 0) and last (ends at the final token) both occur
    assert min(seen_starts) == 0 and max(seen_starts) == 450 - 17

    val = BinDataset(distinct_dir, "val", seq_len=16)
    x, y = val.batch(4, seed=3, step=0)
    assert int(x.min()) >= 450 and int(y.max()) <= 499 and torch.equal(y[:, :-1], x[:, 1:])


def test_batch_determinism(gpt2_dir, seed):
    ds = BinDataset(gpt2_dir, "train", seq_len=64)
    ref = ds.batch(4, seed=seed, step=7, micro_step=1, rank=2)
    # same numbers -> same batch, also from a second dataset object and after pickling
    for other in (ds, BinDataset(gpt2_dir, "train", seq_len=64), pickle.loads(pickle.dumps(ds))):
        again = other.batch(4, seed=seed, step=7, micro_step=1, rank=2)
        assert torch.equal(again[0], ref[0]) and torch.equal(again[1], ref[1])
    # any number changed -> a different batch
    for kwargs in (
        dict(seed=seed + 1, step=7, micro_step=1, rank=2),
        dict(seed=seed, step=8, micro_step=1, rank=2),
        dict(seed=seed, step=7, micro_step=0, rank=2),
        dict(seed=seed, step=7, micro_step=1, rank=3),
    ):
        assert not torch.equal(ds.batch(4, **kwargs)[0], ref[0]), kwargs
    # the data itself matches: y is x shifted by one inside the token stream
    x, y = ref
    stream = _split_ids(gpt2_dir, "train")
    assert torch.equal(y[:, :-1], x[:, 1:])
    for row_x, row_y in zip(x.numpy(), y.numpy(), strict=True):
        window = np.concatenate([row_x, row_y[-1:]])
        starts = np.flatnonzero(stream[: len(stream) - 64] == window[0])
        assert any(np.array_equal(stream[s : s + 65], window) for s in starts)
    # the split is part of the key too
    val = BinDataset(gpt2_dir, "val", seq_len=64)
    assert not torch.equal(val.batch(4, seed=seed, step=7, micro_step=1, rank=2)[0], ref[0])


def test_eval_batches_fixed(distinct_dir):
    ds = BinDataset(distinct_dir, "val", seq_len=8)
    a = ds.eval_batches(5, 3, seed=11)
    b = BinDataset(distinct_dir, "val", seq_len=8).eval_batches(5, 3, seed=11)
    assert len(a) == 5 and all(x.shape == (3, 8) and x.dtype == torch.int64 for x, _ in a)
    assert all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b, strict=True))
    prefix = ds.eval_batches(2, 3, seed=11)  # first batches do not depend on n_batches
    assert all(torch.equal(p[0], q[0]) for p, q in zip(prefix, a, strict=False))
    assert not torch.equal(ds.eval_batches(1, 3, seed=12)[0][0], a[0][0])
    for x, y in a:
        assert torch.equal(y, x + 1) and int(x.min()) >= 450


def test_too_short_split_names_both_numbers(tmp_path):
    out = tmp_path / "short"
    # 30 characters -> 27 train + 3 val tokens
    prepare(_write(tmp_path / "s.txt", "abcdefghijklmnopqrstuvwxyz0123"), out, tokenizer="char")
    assert load_meta(out)["val_tokens"] == 3
    with pytest.raises(ValueError) as err:
        BinDataset(out, "val", seq_len=8)
    msg = str(err.value)
    assert "has 3 tokens" in msg and "seq_len=8" in msg and "at least 9" in msg and "smaller seq_len" in msg
    # sorted vocab "0123abc...": the val text "123" is ids 1, 2, 3 and has exactly one window
    x, y = BinDataset(out, "val", seq_len=2).batch(2, seed=0, step=0)
    assert x.tolist() == [[1, 2]] * 2 and y.tolist() == [[2, 3]] * 2


def test_truncated_bin_and_mismatched_meta_errors(tmp_path):
    src = _write(tmp_path / "s.txt", "the quick brown fox jumps over the lazy dog. " * 20)
    out = tmp_path / "out"
    meta = prepare(src, out, tokenizer="char")

    with open(out / "train_000000.bin", "r+b") as f:
        f.truncate(2 * meta["train_tokens"] - 2)
    pattern = re.escape(str(out / "train_000000.bin")) + r" is \d+ bytes.*truncated.*prepare it with `python"
    with pytest.raises(ValueError, match=pattern):
        BinDataset(out, "train", 8)
    BinDataset(out, "val", 8)  # the other split is fine

    prepare(src, out, tokenizer="char")
    bad = json.loads(json.dumps(meta))
    bad["val_tokens"] += 5
    bad["shards"]["val"][0]["tokens"] += 5
    (out / "meta.json").write_text(json.dumps(bad))
    with pytest.raises(
        ValueError, match=r"val_000000\.bin is \d+ bytes, but .*meta\.json says.*prepare it with"
    ):
        BinDataset(out, "val", 8)
    (out / "meta.json").write_text(json.dumps(dict(meta, val_tokens=meta["val_tokens"] + 5)))
    with pytest.raises(ValueError, match=r"val shards do not add up to val_tokens.*prepare it with"):
        BinDataset(out, "val", 8)

    (out / "meta.json").write_text(json.dumps(dict(meta, vocab_size=5)))  # ids up to 27 in the bins
    with pytest.raises(
        ValueError, match=r"holds token id \d+.*vocab_size=5.*corrupt or was written by another prepare run"
    ):
        BinDataset(out, "train", 8)

    (out / "meta.json").write_text(json.dumps(dict(meta, format_version=3)))
    with pytest.raises(ValueError, match=r"format_version=3.*prepare it with"):
        BinDataset(out, "train", 8)
    # an older flashgpt's train.bin / val.bin: one error, naming both ways to prepare the corpus again
    (out / "meta.json").write_text(json.dumps(dict(meta, format_version=1)))
    with pytest.raises(ValueError, match=r"prepared with an older flashgpt.*delete .*data\.dir="):
        BinDataset(out, "train", 8)

    (out / "val_000000.bin").unlink()
    (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(FileNotFoundError, match=r"val_000000\.bin not found"):
        BinDataset(out, "val", 8)


def test_loader_argument_errors(distinct_dir):
    with pytest.raises(ValueError, match="unknown split"):
        BinDataset(distinct_dir, "test", 8)
    with pytest.raises(ValueError, match="seq_len"):
        BinDataset(distinct_dir, "train", 0)
    ds = BinDataset(distinct_dir, "train", 8)
    with pytest.raises(ValueError, match="seed"):
        ds.batch(2, seed=-1, step=0)
    with pytest.raises(TypeError, match="step"):
        ds.batch(2, seed=0, step=1.5)
    with pytest.raises(ValueError, match="batch_size"):
        ds.batch(0, seed=0, step=0)
    assert ds.batch(1, seed=np.int64(5), step=np.int32(1))[0].shape == (1, 8)


def test_prompt_end_of_text_is_the_separator_token(gpt2_bpe, seed):
    """In a prompt, "<|endoftext|>" is token 50256 (what the prepare step puts between documents), at
    every place it occurs; a corpus's text (``encode``) keeps it as the characters it is."""
    import random

    rng = random.Random(seed)
    words = ["ROMEO:", " hello", "\n", " world", "def f():", " <|end", "oftext|"]
    parts = [[rng.choice(words) for _ in range(rng.randrange(0, 5))] for _ in range(3)]
    texts = ["".join(p) for p in parts]
    ids = gpt2_bpe.encode_prompt("<|endoftext|>".join(texts))
    eot = gpt2_bpe.encode_prompt("<|endoftext|>")
    assert eot == [50256], eot
    expect = [
        *gpt2_bpe.encode(texts[0]),
        50256,
        *gpt2_bpe.encode(texts[1]),
        50256,
        *gpt2_bpe.encode(texts[2]),
    ]
    assert ids == expect, (seed, texts)
    assert 50256 not in gpt2_bpe.encode("a<|endoftext|>b"), seed
    assert gpt2_bpe.decode(ids) == "<|endoftext|>".join(texts)


def test_source_hash_is_read_once_and_follows_a_changed_file(tmp_path, seed):
    """sha256_file hashes a file once per process while its size and mtime stay, and a rewrite of the same
    size (another mtime) gets the new bytes' hash."""
    import hashlib
    import os

    from data import prepare as P

    rng = np.random.default_rng(seed)
    f = tmp_path / "corpus.txt"
    first, second = (bytes(rng.integers(97, 123, 5000, dtype=np.uint8)) for _ in range(2))
    f.write_bytes(first)
    hits = P._sha256.cache_info().hits
    assert P.sha256_file(f) == P.sha256_file(f) == hashlib.sha256(first).hexdigest(), f"seed={seed}"
    assert P._sha256.cache_info().hits == hits + 1
    st = os.stat(f)
    f.write_bytes(second)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert P.sha256_file(f) == hashlib.sha256(second).hexdigest(), f"seed={seed}"
