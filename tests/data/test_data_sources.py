"""Corpora of documents: directories, JSONL, Parquet and local Hugging Face datasets prepared
into shards; uint32 shards, documents across shard boundaries, a resumed prepare, a re-shard.

The reference is tiktoken itself on each document the test wrote (and the EOT token after each)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from data import shards
from data.loader import BinDataset, load_meta
from data.prepare import conflict_reason, prepare

EOT = 50256


def _docs(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "\n", "é", "東京"]
    return [" ".join(rng.choice(words, size=int(rng.integers(5, 80)))) for _ in range(n)]


def _expected(docs, val_fraction=0.1):
    import tiktoken

    enc = tiktoken.get_encoding("gpt2")
    out = {"train": [], "val": []}
    for i, d in enumerate(docs):
        split = "val" if shards.is_val_doc(i, val_fraction) else "train"
        out[split] += enc.encode_ordinary(d) + [EOT]
    return {k: np.array(v) for k, v in out.items()}


def _stream(d, split):
    return BinDataset(d, split, 1, check_ids=True).tokens()


def _write_jsonl(path, docs, field="text"):
    with open(path, "w", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, field: d}) + "\n")


def _corpus(tmp_path, kind: str, docs: list[str]) -> str:
    """``docs`` written as a source of ``kind``: a directory of text files, a JSONL file, a Parquet file or
    a local Hugging Face dataset (hf:DIR)."""
    if kind == "dir":
        (tmp_path / "texts").mkdir()
        for i, d in enumerate(docs):
            (tmp_path / "texts" / f"{i:03d}.txt").write_text(d, encoding="utf-8")
        return str(tmp_path / "texts")
    if kind == "jsonl":
        _write_jsonl(tmp_path / "c.jsonl", docs)
        return str(tmp_path / "c.jsonl")
    if kind == "json_gz":  # gzip-compressed JSON Lines
        import gzip

        _write_jsonl(tmp_path / "c.jsonl", docs)
        (tmp_path / "c.json.gz").write_bytes(gzip.compress((tmp_path / "c.jsonl").read_bytes()))
        (tmp_path / "c.jsonl").unlink()
        return str(tmp_path / "c.json.gz")
    if kind == "glob":  # a glob of JSON Lines files, read in name order
        (tmp_path / "parts").mkdir()
        third = -(-len(docs) // 3)
        for i in range(3):
            _write_jsonl(tmp_path / "parts" / f"part{i}.jsonl", docs[i * third : (i + 1) * third])
        (tmp_path / "parts" / "notes.md").write_text("not matched by the glob")
        return str(tmp_path / "parts" / "part*.jsonl")
    if kind == "parquet":
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        table = pa.table({"id": list(range(len(docs))), "text": docs})
        pq.write_table(table, tmp_path / "c.parquet", row_group_size=7)
        return str(tmp_path / "c.parquet")
    datasets = pytest.importorskip("datasets")
    if kind.startswith("hf_saved"):  # Dataset / DatasetDict.save_to_disk: read with load_from_disk
        ds = datasets.Dataset.from_dict({"id": list(range(len(docs))), "text": docs})
        if kind == "hf_saved_dict":
            ds = datasets.DatasetDict({"train": ds, "validation": ds.select(range(2))})
        ds.save_to_disk(str(tmp_path / "saved"))
        return f"hf:{tmp_path / 'saved'}"
    (tmp_path / "ds" / "data").mkdir(parents=True)
    _write_jsonl(tmp_path / "ds" / "data" / "train.jsonl", docs)
    return f"hf:{tmp_path / 'ds'}"


@pytest.mark.parametrize(
    "kind", ["dir", "jsonl", "json_gz", "glob", "parquet", "hf", "hf_saved", "hf_saved_dict"]
)
def test_sources_prepare_every_document_with_eot(tmp_path, gpt2_bpe, seed, kind):
    docs = _docs(40, seed)
    out = tmp_path / "out"
    meta = prepare(
        _corpus(tmp_path, kind, docs), out, "gpt2", 0.1, shard_tokens=97, workers=1, progress=False
    )
    want = _expected(docs)
    for split in ("train", "val"):
        assert np.array_equal(_stream(out, split), want[split]), f"seed={seed} {kind} {split}"
        assert meta[f"{split}_docs"] == int((want[split] == EOT).sum())
    assert meta["doc_separator_ids"] == [EOT] and meta["dtype"] == "uint16"
    assert len(meta["shards"]["train"]) == -(-meta["train_tokens"] // 97)
    ds = BinDataset(out, "train", 16)
    starts = ds.doc_starts()
    toks = ds.tokens()
    assert np.array_equal(starts, np.concatenate([[0], np.flatnonzero(toks[:-1] == EOT) + 1]))
    x, y, doc = ds.batch(8, seed=1, step=0, with_doc_ids=True)  # documents cross the 97-token shards
    assert x.shape == (8, 16)


def test_saved_dataset_dict_without_train_split_names_its_splits(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": ["a b", "c d"]})
    datasets.DatasetDict({"validation": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"without a 'train' split \(its splits: validation\)"):
        prepare(f"hf:{tmp_path / 'dd'}", tmp_path / "o", "gpt2", workers=1, progress=False)


@pytest.mark.parametrize("kind", ["hf", "hf_saved"])
def test_an_edited_local_hf_dataset_is_a_changed_source(tmp_path, gpt2_bpe, seed, kind):
    """A local hf: directory is identified by its files (names, sizes, mtimes), not by its path only: after
    an edit, the prepared data are stale and a trainer (keep_other) refuses to re-prepare them."""
    from data.prepare import ensure_prepared, stale_reason

    src = _corpus(tmp_path, kind, _docs(30, seed))
    out = tmp_path / "out"
    prepare(src, out, "gpt2", workers=1, progress=False)
    assert stale_reason(src, out) is None and conflict_reason(src, out) is None
    data = tmp_path / ("ds/data/train.jsonl" if kind == "hf" else "saved/state.json")
    data.write_text(data.read_text() + "\n")
    for why in (stale_reason(src, out), conflict_reason(src, out)):
        assert why and "source changed" in why and data.name in why, why
    with pytest.raises(ValueError, match="source changed"):
        ensure_prepared(src, out, "gpt2", keep_other=True, workers=1, progress=False)


def test_workers_uint32_and_reshard_give_the_same_tokens_and_windows(tmp_path, gpt2_bpe, seed):
    docs = _docs(60, seed)
    src = tmp_path / "c.jsonl"
    _write_jsonl(src, docs)
    a = prepare(str(src), tmp_path / "a", "gpt2", 0.1, shard_tokens=10_000, workers=1, progress=False)
    b = prepare(
        str(src), tmp_path / "b", "gpt2", 0.1, shard_tokens=53, workers=2, dtype="uint32", progress=False
    )
    assert a["dtype"] == "uint16" and b["dtype"] == "uint32" and len(b["shards"]["train"]) > 3
    assert (tmp_path / "b" / b["shards"]["train"][0]["file"]).stat().st_size == 53 * 4
    for split in ("train", "val"):
        assert np.array_equal(_stream(tmp_path / "a", split), _stream(tmp_path / "b", split))
    da, db = BinDataset(tmp_path / "a", "train", 32), BinDataset(tmp_path / "b", "train", 32)
    for step in range(3):
        for xa, xb in zip(
            da.batch(4, seed=seed % 1000, step=step), db.batch(4, seed=seed % 1000, step=step), strict=True
        ):
            assert xa.equal(xb), f"seed={seed} step={step}"


def test_interrupted_prepare_resumes_from_its_last_shard(tmp_path, gpt2_bpe, seed, monkeypatch):
    docs = _docs(80, seed)
    src = tmp_path / "c.jsonl"
    _write_jsonl(src, docs)
    out = tmp_path / "out"
    real = shards.ShardWriter.add
    calls = []

    def dying(self, ids, start=True):
        calls.append(1)
        if len(calls) == 50:
            raise KeyboardInterrupt("simulated kill")
        return real(self, ids, start)

    monkeypatch.setattr(shards.ShardWriter, "add", dying)
    with pytest.raises(KeyboardInterrupt):
        prepare(str(src), out, "gpt2", 0.1, shard_tokens=101, workers=1, progress=False)
    state = json.loads((out / shards.STAGE_NAME / shards.STATE_NAME).read_text())
    assert 0 < state["pieces"] < 50 and not (out / "meta.json").exists()  # a piece per short document
    calls.clear()
    monkeypatch.setattr(shards.ShardWriter, "add", lambda self, *a: (calls.append(1), real(self, *a))[1])
    prepare(str(src), out, "gpt2", 0.1, shard_tokens=101, workers=1, progress=False)
    assert len(calls) == 80 - state["pieces"]  # the done documents were not written again
    want = _expected(docs)
    for split in ("train", "val"):
        assert np.array_equal(_stream(out, split), want[split]), f"seed={seed} {split}"
    assert not (out / shards.STAGE_NAME).exists()


@pytest.mark.slow
def test_changed_source_and_bad_input_are_named(tmp_path, gpt2_bpe):
    d = tmp_path / "texts"
    d.mkdir()
    (d / "a.txt").write_text("one document")
    (d / "b.txt").write_text("another document")
    out = tmp_path / "out"
    prepare(str(d), out, "gpt2", 0.5, workers=1, progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (d / "b.txt").write_text("changed document!")
    assert "b.txt" in conflict_reason(str(d), out, "gpt2", 0.5)
    (d / "c.txt").write_bytes("caf\u00e9".encode("latin-1"))
    with pytest.raises(ValueError, match=r"c\.txt is not UTF-8.*offset 3"):
        prepare(str(d), out, "gpt2", 0.5, workers=1, progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing prepared was touched
    # each bad source prepared into the folder that holds data: refused naming the source, the data untouched
    j = tmp_path / "c.jsonl"
    _write_jsonl(j, ["x", "y"], field="body")
    with pytest.raises(
        ValueError, match=r"c\.jsonl:1 has no field 'text' \(its fields: body, id\).*text_field"
    ):
        prepare(str(j), out, "gpt2", workers=1, progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    _write_jsonl(j, ["", ""])
    with pytest.raises(ValueError, match=r"c\.jsonl holds no non-empty document"):
        prepare(str(j), out, "gpt2", workers=1, progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    with pytest.raises(ValueError, match=r"c\.jsonl holds no non-empty document"):
        prepare(str(j), tmp_path / "o3", "gpt2", workers=1, progress=False)
    assert not (tmp_path / "o3").exists()  # a folder it created is taken back
    pytest.importorskip("datasets")
    with pytest.raises(ValueError, match=r"hf:no-such-org-xyz/none.*Hugging Face"):
        prepare("hf:no-such-org-xyz/none", out, "gpt2", workers=1, progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.parametrize("name", ["/no/such/dataset", "./no_such_dataset", "~/no_such_dataset_xyz"])
def test_a_local_hf_folder_that_does_not_exist_is_named_as_such(name, monkeypatch, tmp_path):
    """hf:/path (or ./, ~) names a local folder, not a hub dataset: no download advice, the folder named."""
    from data.sources import open_source

    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as e:
        open_source(f"hf:{name}")
    msg = str(e.value)
    assert "does not exist" in msg and str(Path(name).expanduser()) in msg, msg
    assert "huggingface-cli" not in msg and "hf:roneneldan/TinyStories" in msg, msg


def test_max_tokens_caps_the_corpus(tmp_path, gpt2_bpe, seed):
    src = tmp_path / "c.jsonl"
    _write_jsonl(src, _docs(50, seed))
    meta = prepare(str(src), tmp_path / "o", "gpt2", 0.1, max_tokens=500, workers=1, progress=False)
    assert meta["train_tokens"] + meta["val_tokens"] == 500 and load_meta(tmp_path / "o")["max_tokens"] == 500


_MEM_CHILD = """
import os, sys, threading, time
from data.tokenizer import make_tokenizer
from data.prepare import prepare
make_tokenizer("gpt2").encode("warm up the tokenizer " * 1000)  # the BPE tables are loaded: the baseline
page = os.sysconf("SC_PAGE_SIZE")
def rss():  # resident set now, kB (ru_maxrss would hide growth under the imports' high-water mark)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page // 1024
base, peak, done = rss(), [0], threading.Event()
def watch():  # sampled every 5 ms while the prepare runs
    while not done.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.005)
t = threading.Thread(target=watch)
t.start()
prepare(sys.argv[1], sys.argv[2], "gpt2", 0.01, workers=1, shard_tokens=1_000_000, progress=False)
done.set()
t.join()
print(base, max(peak[0], rss()))
"""


def _prepare_growth(tmp_path, kind: str, mb: int) -> tuple[int, int]:
    """(bytes of the corpus, kB the resident set grew while preparing it) for ``mb`` MB of ``kind``."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from bench.prepare import write_corpus

    d = tmp_path / f"{kind}{mb}"
    d.mkdir()
    size = write_corpus(d / "c.jsonl", mb)
    src = d / f"c.{kind}"
    if kind == "txt":
        with open(d / "c.jsonl", encoding="utf-8") as f, open(src, "w", encoding="utf-8") as out:
            for line in f:
                out.write(json.loads(line)["text"] + " ")
        (d / "c.jsonl").unlink()
    res = subprocess.run(
        [sys.executable, "-c", _MEM_CHILD, str(src), str(d / "o")],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert res.returncode == 0, res.stderr
    base, peak = map(int, res.stdout.split()[-2:])
    meta = load_meta(d / "o")
    assert meta["train_tokens"] > size / 8 and meta["source_kind"] == ("text" if kind == "txt" else "docs")
    src.unlink()
    return size, peak - base


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["jsonl", "txt"])
def test_prepare_of_a_corpus_larger_than_its_memory_cap_stays_under_it(tmp_path, gpt2_bpe, kind):
    """150 MB of JSONL, or one 150 MB text file (a single document, so every piece of it is cut at a word
    boundary, and its end is moved to the val split afterwards), prepared under a 14 MB cap on the growth
    of the resident set over the baseline (Python, numpy and the loaded BPE), sampled while it runs: the
    corpus is over 10x the cap, and the growth hardly moves from 16 MB to 150 MB (a prepare that held the
    corpus or its token list would go far over)."""
    cap_kb = 14 * 1024
    small_size, small = _prepare_growth(tmp_path, kind, 16)
    size, large = _prepare_growth(tmp_path, kind, 150)
    assert large < cap_kb <= size / 1024 / 10, f"resident set grew {large} kB preparing {size} bytes"
    # 134 MB more corpus: even its token ids as uint16 would be ~67 MB more; measured 0-2 MB (allocator)
    extra = (size - small_size) / 1024
    assert large - small < extra / 32, f"{small} kB at 16 MB, {large} kB at 150 MB: grows with the corpus"


@pytest.mark.parametrize("tokenizer,sep", [("gpt2", None), ("gpt2", "\n\n"), ("char", "\n\n")])
def test_a_text_file_streams_with_the_tokens_and_split_of_the_whole(
    tmp_path, gpt2_bpe, seed, monkeypatch, tokenizer, sep
):
    """A text file read in 64-byte blocks, tokenized in pieces of ~40 characters, written into 97-token
    shards: the tokens, the split (the end of the stream, moved to the next document start) and the
    document starts are those of the whole text tokenized at once (the reference, written here as the
    prepare step did before it streamed)."""
    import tiktoken

    from data import sources
    from data.docs import separator_ends

    for mod, name, value in (
        (sources, "BLOCK_BYTES", 64),
        (sources, "PIECE_CHARS", 40),
        (shards, "BATCH_CHARS", 100),
    ):
        monkeypatch.setattr(mod, name, value)
    rng = np.random.default_rng(seed)
    text = " ".join(rng.choice(["alpha", "beta", "\n", "\n\n", "\n\n\n", "é", "東京", "it's", " "], 3000))
    (tmp_path / "c.txt").write_text(text, encoding="utf-8")
    meta = prepare(str(tmp_path / "c.txt"), tmp_path / "o", tokenizer, 0.1, sep, shard_tokens=97, workers=1)
    enc = tiktoken.get_encoding("gpt2")
    if tokenizer == "char":
        chars = sorted(set(text))
        ids, sep_ids = np.array([chars.index(c) for c in text]), [chars.index(c) for c in sep]
    elif sep:
        ids, sep_ids = (
            np.array([t for d in text.split(sep) if d for t in enc.encode_ordinary(d) + [EOT]]),
            [EOT],
        )
    else:
        ids = np.array(enc.encode_ordinary(text))
    starts = (
        np.concatenate([[0], np.flatnonzero(separator_ends(ids, sep_ids)[:-1]) + 1]) if sep else np.zeros(1)
    )
    n_train = int(len(ids) * 0.9)
    later = starts[starts >= n_train]
    n_train = int(later[0]) if sep and len(later) else n_train
    assert np.array_equal(_stream(tmp_path / "o", "train"), ids[:n_train]), f"seed={seed}"
    assert np.array_equal(_stream(tmp_path / "o", "val"), ids[n_train:]), f"seed={seed}"
    assert len(meta["shards"]["train"]) == -(-n_train // 97)
    if sep:  # the document index: the reference's starts, and the val split's first token
        val_starts = np.concatenate([[0], starts[starts > n_train] - n_train])
        assert np.array_equal(BinDataset(tmp_path / "o", "val", 1).doc_starts(), val_starts), f"seed={seed}"
        assert np.array_equal(BinDataset(tmp_path / "o", "train", 1).doc_starts(), starts[starts < n_train])
        assert (meta["train_docs"], meta["val_docs"]) == ((starts < n_train).sum(), len(val_starts))


@pytest.mark.parametrize("tokenizer", ["gpt2", "char"])
def test_an_interrupted_text_file_prepare_resumes(tmp_path, gpt2_bpe, seed, monkeypatch, tokenizer):
    """A text file streams, so a killed prepare of one continues from its last shard (pieces skipped,
    the document count restored) and ends with the data and meta.json of an uninterrupted prepare."""
    from data import sources

    for mod, name, value in (
        (sources, "BLOCK_BYTES", 64),
        (sources, "PIECE_CHARS", 40),
        (shards, "BATCH_CHARS", 100),
    ):
        monkeypatch.setattr(mod, name, value)
    words = ["alpha", "beta", "\n", "\n\n", "é", "東京", "it's"]
    (tmp_path / "c.txt").write_text(
        " ".join(np.random.default_rng(seed).choice(words, 3000)), encoding="utf-8"
    )
    args = (str(tmp_path / "c.txt"), tmp_path / "out", tokenizer, 0.1, "\n\n")
    want = prepare(str(tmp_path / "c.txt"), tmp_path / "ref", *args[2:], shard_tokens=97, workers=1)
    real, calls = shards.ShardWriter.add, []

    def dying(self, ids, start=True):
        calls.append(1)
        if len(calls) == 150:
            raise KeyboardInterrupt("simulated kill")
        return real(self, ids, start)

    monkeypatch.setattr(shards.ShardWriter, "add", dying)
    with pytest.raises(KeyboardInterrupt):
        prepare(*args, shard_tokens=97, workers=1)
    state = json.loads((tmp_path / "out" / shards.STAGE_NAME / shards.STATE_NAME).read_text())
    assert 0 < state["doc"] < state["pieces"] < 150
    monkeypatch.setattr(shards.ShardWriter, "add", real)
    assert prepare(*args, shard_tokens=97, workers=1) == want
    for split in ("train", "val"):
        a, b = BinDataset(tmp_path / "out", split, 1), BinDataset(tmp_path / "ref", split, 1)
        assert np.array_equal(a.tokens(), b.tokens()) and np.array_equal(a.doc_starts(), b.doc_starts())


def test_val_docs_holds_out_the_first_documents(tmp_path, gpt2_bpe, seed):
    import tiktoken

    enc = tiktoken.get_encoding("gpt2")
    docs = _docs(30, seed)
    src = tmp_path / "c.jsonl"
    _write_jsonl(src, docs)
    meta = prepare(str(src), tmp_path / "o", "gpt2", val_docs=4, workers=1, progress=False)
    ids = [enc.encode_ordinary(d) + [EOT] for d in docs]
    assert meta["val_docs"] == 4 and meta["val_fraction"] is None and meta["train_docs"] == 26
    assert np.array_equal(_stream(tmp_path / "o", "val"), np.concatenate(ids[:4])), f"seed={seed}"
    assert np.array_equal(_stream(tmp_path / "o", "train"), np.concatenate(ids[4:])), f"seed={seed}"
    assert "val_docs=4, not val_fraction=0.1" in conflict_reason(str(src), tmp_path / "o", "gpt2")
    assert conflict_reason(str(src), tmp_path / "o", "gpt2", val_docs=4) is None
    # a text file of documents: the first ones too; one without documents is refused, naming the fix
    txt = tmp_path / "c.txt"
    txt.write_text("@@@".join(docs), encoding="utf-8")  # no document holds it
    meta = prepare(str(txt), tmp_path / "t", "gpt2", None, "@@@", val_docs=3, workers=1, progress=False)
    assert np.array_equal(_stream(tmp_path / "t", "val"), np.concatenate(ids[:3]))
    assert meta["val_docs"] == 3 and meta["train_docs"] == 27
    with pytest.raises(ValueError, match=r"val_docs=3 holds out whole documents.*doc_separator"):
        prepare(str(txt), tmp_path / "t2", "gpt2", val_docs=3, workers=1, progress=False)
    with pytest.raises(ValueError, match=r"none for the train split at val_docs=30.*use val_docs=29"):
        prepare(str(src), tmp_path / "t3", "gpt2", val_docs=30, workers=1, progress=False)
    assert not (tmp_path / "t2").exists() and not (tmp_path / "t3").exists()


def test_val_docs_and_val_fraction_together_are_refused_naming_both(tmp_path, char_data, shakespeare_path):
    import subprocess
    import sys

    from tests.helpers_train import REPO, compose_cfg
    from trainer.checks import ConfigError, resolve_plan

    with pytest.raises(ValueError, match=r"val_fraction=0.2 and val_docs=5 both set.*data.val_docs"):
        prepare(str(shakespeare_path), tmp_path / "o", "char", 0.2, val_docs=5)
    args = ["--source", str(shakespeare_path), "--out-dir", str(tmp_path / "o"), "--val-docs", "5"]
    res = subprocess.run(
        [sys.executable, "-m", "data.prepare", *args, "--val-fraction", "0.2", "--tokenizer", "char"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 1 and "--val-fraction" in res.stderr and "--val-docs" in res.stderr, res.stderr
    assert not (tmp_path / "o").exists()
    overrides = [f"data.dir={char_data}", "data=shakespeare_char", f"data.source={shakespeare_path}"]
    cfg = compose_cfg([*overrides, "data.val_fraction=0.2", "data.val_docs=5", "model=tiny", "trainer=cpu"])
    with pytest.raises(ConfigError, match=r"val_fraction=0.2 and val_docs=5 both set.*data.val_fraction"):
        resolve_plan(cfg, world_size=1, cuda_available=False)


@pytest.mark.slow  # a train.py process each, ~11 s on 2 shared cores
@pytest.mark.parametrize(
    "kind,split",
    [("dir", []), ("jsonl", ["data.val_docs=6"]), ("json_gz", []), ("glob", []), ("parquet", []), ("hf", [])],
)
def test_train_py_runs_on_every_source(tmp_path, gpt2_bpe, seed, kind, split):
    """python train.py on a corpus of each kind (GPT-2 BPE, document masking on): it prepares the data
    (shards, documents) and trains and evaluates a few steps."""
    from tests.helpers_train import describe, read_jsonl, run_train

    src = _corpus(tmp_path, kind, _docs(60, seed))
    args = [
        "experiment=cpu_tiny",
        "data=shakespeare",
        f"data.source={src}",
        f"data.dir={tmp_path / 'data'}",
        "data.workers=1",
        *split,
        "model=tiny",
        "attention.document_mask=true",
        "seq_len=32",
        "max_steps=2",
        "batch.tokens_per_step=256",
        "batch.micro_tokens=256",
        "eval.interval=2",
        "eval.batches=1",
        "checkpoint.interval=2",
        "wandb.mode=disabled",
        f"out_dir={tmp_path / 'run'}",
    ]
    proc = run_train(args)
    assert proc.returncode == 0, describe(proc)
    meta = load_meta(tmp_path / "data")
    assert meta["source_kind"] == "docs" and meta["doc_separator_ids"] == [EOT] and meta["val_docs"] >= 6
    assert (meta["val_fraction"] is None) == bool(split), meta
    losses = [r["val/loss"] for r in read_jsonl(tmp_path / "run") if "val/loss" in r]
    assert losses and all(0 < v < 20 for v in losses), f"seed={seed}: {losses}"


def test_ctrl_c_in_the_prepare_cli_says_how_to_continue(tmp_path, monkeypatch, capsys):
    """Ctrl-C in `python -m data.prepare`: no KeyboardInterrupt traceback, the note says that running the
    command again continues from the shards written, exit 130."""
    import data.prepare as dp

    (src := tmp_path / "c.jsonl").write_text('{"text": "a b c"}\n' * 10)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(dp, "prepare", interrupted)
    assert dp.main(["--source", str(src), "--out-dir", str(tmp_path / "d"), "--tokenizer", "gpt2"]) == 130
    err = capsys.readouterr().err
    assert "interrupted:" in err and "run the same command again" in err and "Traceback" not in err


def test_few_documents_get_a_val_docs_that_runs(tmp_path, seed):
    """4 documents at val_fraction=0.1 give none for the val split: the error's val_docs=1 then prepares."""
    rng = np.random.default_rng(seed)
    src = tmp_path / "docs"
    src.mkdir()
    for i in range(4):
        (src / f"{i}.txt").write_text(" ".join(rng.choice(["a", "cat", "sat", "on", "mat"], size=50)))
    with pytest.raises(ValueError, match="none for the val split") as e:
        prepare(str(src), tmp_path / "o", "gpt2", val_fraction=0.1, workers=1, progress=False)
    fix = str(e.value).split("use ", 1)[1].split()[0]
    assert fix == "val_docs=1", f"seed={seed}: {e.value}"
    meta = prepare(str(src), tmp_path / "o", "gpt2", val_docs=1, workers=1, progress=False)
    assert meta["val_docs"] == 1 and meta["train_docs"] == 3, f"seed={seed}"


def test_a_val_split_larger_than_train_is_refused(tmp_path, seed):
    """val_docs=1 on a first document larger than the others: more tokens held out than left to train on is
    an error naming both counts and the key (a new user followed a suggested val_docs=1 into it, silently);
    nothing is written. Two held out of four smaller ones prepares."""
    rng = np.random.default_rng(seed)
    src = tmp_path / "docs"
    src.mkdir()
    for i, words in enumerate([int(rng.integers(300, 400)), 50, 50, 50]):
        (src / f"{i}.txt").write_text(" ".join(rng.choice(["a", "cat", "sat", "on", "mat"], size=words)))
    with pytest.raises(
        ValueError, match=r"the val split \(val_docs=1\) holds (\d+) tokens, more than the"
    ) as e:
        prepare(str(src), tmp_path / "o", "gpt2", val_docs=1, workers=1, progress=False)
    val, train = map(int, re.findall(r"(\d+) tokens?, more than the (\d+)", str(e.value))[0])
    assert val > train and not (tmp_path / "o").exists(), f"seed={seed}: {e.value}"
    (src / "0.txt").write_text("a cat")  # now the first document is the smallest
    meta = prepare(str(src), tmp_path / "o", "gpt2", val_docs=2, workers=1, progress=False)
    assert meta["val_tokens"] < meta["train_tokens"], f"seed={seed}"


def test_one_document_names_the_source_once(tmp_path):
    """One document cannot give both splits: one fix (a source with more documents), said once."""
    src = tmp_path / "docs"
    src.mkdir()
    (src / "only.txt").write_text("a cat sat on the mat " * 20)
    for split in ({"val_fraction": 0.1}, {"val_docs": 1}):
        with pytest.raises(ValueError) as e:
            prepare(str(src), tmp_path / "o", "gpt2", workers=1, progress=False, **split)
        msg = str(e.value)
        assert "gave 1 document(s)" in msg and msg.count("more") == 1 and "val_docs=0" not in msg, msg


def test_progress_bar_estimates_the_total_for_an_eta(tmp_path, gpt2_bpe, seed, monkeypatch):
    """Without max_tokens the bar's total (what tqdm's ETA needs) is estimated from the source's bytes and
    the tokens per character so far: within 20% of the final count once a tenth is read, exact at the end."""
    import io

    import tqdm

    totals = []

    class Recording(tqdm.tqdm):
        def __init__(self, *args, **kw):
            super().__init__(*args, **{**kw, "disable": False, "file": io.StringIO(), "mininterval": 0})

        def update(self, n=1):
            totals.append((self.n, self.total))
            return super().update(n)

    monkeypatch.setattr(tqdm, "tqdm", Recording)
    src = tmp_path / "c.jsonl"
    _write_jsonl(src, _docs(400, seed))
    meta = prepare(str(src), tmp_path / "o", "gpt2", 0.1, workers=1, progress=True)
    final = meta["train_tokens"] + meta["val_tokens"]
    later = [t for n, t in totals if n >= final / 10]
    assert later and all(abs(t - final) <= 0.2 * final for t in later), f"seed={seed}: {later[:5]} vs {final}"
