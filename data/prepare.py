"""Prepare step: a corpus -> token shards ``{train,val}_NNNNNN.bin`` (+ ``.idx``) and ``meta.json``, the ids
stored raw for training to memory-map (nanoGPT's pattern). Every source streams through ``_prepare_stream``:
``data.sources`` reads pieces of documents, ``data.shards`` tokenizes them into resumable shards. File
format: ``data/meta.py``; sources and the val split: ``docs/data.md``.

    python -m data.prepare --source PATH --out-dir DIR --tokenizer gpt2|char [--val-fraction 0.1] [--force]

A DIR that holds data of other arguments is refused (exit 1: runs read it) unless ``--force``. Without
``--source`` Tiny Shakespeare is downloaded into ``DIR/input.txt``; ``python data/prepare.py`` works too.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import hashlib
import http.client
import itertools
import json
import logging
import math
import os
import re
import shlex
import shutil
import sys
import urllib.request
from dataclasses import dataclass, fields
from pathlib import Path

if __package__ in (None, ""):  # run as `python data/prepare.py`: import the `data` package from the repo root
    _HERE = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    sys.path.insert(0, os.path.dirname(_HERE))

import numpy as np  # noqa: E402

from data import shards, sources  # noqa: E402
from data.docs import GPT2_EOT, parse_separator, separator_ids  # noqa: E402
from data.meta import (  # noqa: E402
    DTYPES,
    FORMAT_VERSION,
    META_NAME,
    SPLITS,
    atomic_write,
    check_shards,
    load_meta,
    write_json,
)
from data.tokenizer import MAX_VOCAB, TOKENIZERS, make_tokenizer  # noqa: E402

logger = logging.getLogger(__name__)

TINY_SHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)
DATA_DIR = Path(__file__).resolve().parent
DEFAULT_OUT_DIRS = {"gpt2": DATA_DIR / "shakespeare", "char": DATA_DIR / "shakespeare_char"}
DOWNLOAD_NAME = "input.txt"
DOWNLOAD_TIMEOUT_S = 60.0
DEFAULT_SHARD_TOKENS = 100_000_000  # 200 MB uint16 files, as llm.c's FineWeb shards
DEFAULT_VAL_FRACTION = 0.1


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def val_split(val_fraction: float | None, val_docs: int | None) -> tuple[float | None, int | None]:
    """The val split as (val_fraction, None) or (None, val_docs); neither set means the default share."""
    if val_docs is not None:
        if val_fraction is not None:
            raise ValueError(
                f"val_fraction={val_fraction} and val_docs={val_docs} both set the val split: set one "
                "(data.val_fraction / --val-fraction for a share, data.val_docs / --val-docs for a count "
                "of documents)"
            )
        if not _is_int(val_docs) or val_docs < 1:
            raise ValueError(f"val_docs={val_docs!r} must be a positive number of documents, e.g. 100")
        return None, val_docs
    if val_fraction is None:
        return DEFAULT_VAL_FRACTION, None
    if not (_is_int(val_fraction) or isinstance(val_fraction, float)) or not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction!r} must be a number strictly between 0 and 1, e.g. 0.1")
    return float(val_fraction), None


def sha256_file(path: str | os.PathLike) -> str:
    """The file's SHA-256, hashed once per process while its size and mtime stay (a launch checks the
    source before and while preparing: a multi-GB corpus would be read twice)."""
    st = os.stat(path)
    return _sha256(os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino)


@functools.lru_cache(maxsize=64)
def _sha256(path: str, *_stat) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def meta_split(meta: dict) -> tuple[float | None, int | None]:
    """(val_fraction, val_docs) a prepared directory was split with."""
    fraction = meta.get("val_fraction")
    return (None, meta.get("val_docs")) if fraction is None else (fraction, None)


def split_point(num_tokens: int, val_fraction: float) -> int:
    """Training tokens of a text file's stream: ``int(num_tokens * (1 - val_fraction))`` clamped so that
    both splits are non-empty (338,025 tokens at 0.1 -> 304,222 train + 33,803 val)."""
    if num_tokens < 2:
        raise ValueError(
            f"the corpus has {num_tokens} token(s); at least 2 are needed for a train and a val split. "
            "Use a bigger corpus."
        )
    return min(max(int(num_tokens * (1.0 - val_fraction)), 1), num_tokens - 1)


def _resolve_source(source, out_dir: Path, *, fetch: bool, text_field: str = "text") -> sources.Source:
    """``source`` as a ``data.sources.Source``. ``None`` / "" is Tiny Shakespeare; a URL is downloaded
    (``fetch``) into ``out_dir/input.txt``, unless that file is there and meta.json names no other URL."""
    if isinstance(source, str) and not source.strip():
        source = None  # an empty config value means "the default corpus"
    if source is not None and not sources.is_url(source):
        return sources.open_source(source, text_field)
    url = TINY_SHAKESPEARE_URL if source is None else str(source)
    dest = out_dir / DOWNLOAD_NAME
    with contextlib.suppress(FileNotFoundError, ValueError):
        if fetch and dest.is_file() and load_meta(out_dir)["source"] != url:
            dest.unlink()  # a download of another URL
    if fetch and not (dest.is_file() and dest.stat().st_size > 0):
        logger.info("downloading %s -> %s", url, dest)
        hint = (
            "If this machine has no network access, fetch the file elsewhere and pass a local path instead: "
            "data.source=PATH (Hydra) or --source PATH (CLI)."
        )
        try:
            with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as resp:
                payload = resp.read()
        except (OSError, http.client.HTTPException, ValueError) as e:  # URLError/HTTPError/timeouts: OSError
            raise RuntimeError(f"could not download {url} ({type(e).__name__}: {e}). {hint}") from e
        if not payload:
            raise RuntimeError(f"downloading {url} returned no data. {hint}")
        atomic_write(dest, lambda f: f.write(payload))
    return sources.Source(url, "text", [dest], out_dir, text_field=text_field)


@dataclass
class Options:
    """What a prepared directory is made of besides its source (compared on reuse), checked once here:
    a ValueError names the bad argument."""

    tokenizer: str = "gpt2"
    val_fraction: float | None = None  # None: the default share, or val_docs when that is set
    doc_separator: str | None = None
    val_docs: int | None = None
    text_field: str = "text"
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"unknown tokenizer {self.tokenizer!r}; use one of {TOKENIZERS}")
        self.val_fraction, self.val_docs = val_split(self.val_fraction, self.val_docs)
        if not isinstance(self.text_field, str) or not self.text_field:
            raise ValueError(f"text_field={self.text_field!r} must be a non-empty field name, e.g. 'text'")
        n = self.max_tokens
        if n is not None and (not _is_int(n) or n < 2):
            raise ValueError(
                f"max_tokens={n!r} (data.max_tokens, --max-tokens) must be null (all tokens) or an "
                "integer >= 2, e.g. data.max_tokens=1000000000"
            )
        self.doc_separator = parse_separator(self.doc_separator)

    def is_val(self, i: int) -> bool:
        """Document ``i`` is held out: one of the first ``val_docs``, or one in every 1/val_fraction."""
        return i < self.val_docs if self.val_docs is not None else shards.is_val_doc(i, self.val_fraction)


def prepare(
    source,
    out_dir: str | os.PathLike,
    tokenizer: str = "gpt2",
    val_fraction: float | None = None,
    doc_separator: str | None = None,
    *,
    val_docs: int | None = None,
    text_field: str = "text",
    max_tokens: int | None = None,
    workers: int | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    dtype: str = "auto",
    progress: bool = True,
    force: bool = True,
) -> dict:
    """Tokenize ``source`` (``data.sources``; a URL or None: a download) into ``out_dir``; returns the meta
    dict written to its ``meta.json``. The split is ``val_fraction`` (default 0.1; a text file: its stream's
    end, moved to the next document start; other sources: one document in 1/val_fraction) or the first
    ``val_docs`` documents; ``doc_separator`` splits a single text file into documents (escapes \\n, \\t,
    \\\\). A prepare that fails or is interrupted leaves the data already in ``out_dir`` as it was; run
    again, an interrupted one resumes from its last complete shard. Errors name the source and the fix.
    ``force=False``: ``HeldError`` where ``out_dir`` holds data of other arguments, checked under the lock
    (a prepare that waited for another one finds what that one wrote)."""
    opts = Options(tokenizer, val_fraction, doc_separator, val_docs, text_field, max_tokens)
    out = Path(out_dir).expanduser()
    with _locked(out):
        if not force and (held := _held(out, source, opts)):
            raise HeldError(held)
        return _prepare_into(out, source, opts, workers, shard_tokens, dtype, progress)


class HeldError(ValueError):
    """The output folder holds data of other arguments (the message: what), which runs read."""


@contextlib.contextmanager
def _locked(out: Path):
    """Create ``out`` and hold an exclusive ``flock`` on it while the block runs: of launches that start
    together (a job array, a sweep), one prepares and the others wait, then find it up to date. The kernel
    drops the lock when its process dies; where the filesystem has no ``flock`` (some network mounts) the
    block runs unlocked. A block that fails takes back the directories this call created, under the lock;
    a waiter whose directory was removed meanwhile locks the new one."""
    while True:
        created = list(itertools.takewhile(lambda p: not (p.exists() or p.is_symlink()), (out, *out.parents)))
        out.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:  # taken back by a failed prepare meanwhile
            continue
        try:
            if not _lock(fd, out):
                continue  # the finally closes fd, dropping the lock on the removed directory
            try:
                yield
            except BaseException as e:  # an interrupt (Ctrl-C) keeps the stage, to resume from
                _take_back(created, keep_stage=not isinstance(e, Exception))
                raise
            return
        finally:
            os.close(fd)


def _lock(fd: int, out: Path) -> bool:
    """Lock the directory open as ``fd``; False when ``out`` is no longer that directory (taken back by a
    failed prepare while this one waited)."""
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process that is preparing %s", out)
            fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as e:  # e.g. ENOLCK on a network mount: go on without the lock
        logger.warning("cannot lock %s (%s); preparing it without a lock", out, e.strerror)
        return True
    try:
        return os.path.samestat(os.stat(out), os.fstat(fd))
    except FileNotFoundError:
        return False


def _take_back(created: list[Path], keep_stage: bool = False) -> None:
    """After a failed prepare, remove the directories it created (deepest first) with the files it writes
    there (download, stage, meta.json); a directory holding anything else is kept, and those above it."""
    if not created:
        return
    out = created[0]
    if not keep_stage:
        shutil.rmtree(out / shards.STAGE_NAME, ignore_errors=True)
    for path in (out / DOWNLOAD_NAME, out / META_NAME):
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
    for d in created:
        try:
            d.rmdir()  # only when empty
        except OSError:
            return


def _source_identity(src: sources.Source) -> tuple[str, dict | None]:
    """(source_sha256, source_fingerprint): a text file's SHA-256, or the fingerprint's and itself."""
    if src.kind == "text":
        return sha256_file(src.files[0]), None
    fp = src.fingerprint()  # a docs source: SHA-256 of its fingerprint and the text field read
    payload = json.dumps({"fingerprint": fp, "text_field": src.text_field}, sort_keys=True).encode()
    return hashlib.sha256(payload).hexdigest(), fp


def _dtype_for(vocab_size: int, dtype: str) -> str:
    if dtype == "auto":
        return "uint16" if vocab_size <= MAX_VOCAB else "uint32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: use auto, uint16 or uint32")
    if dtype == "uint16" and vocab_size > MAX_VOCAB:
        raise ValueError(
            f"vocab_size {vocab_size} does not fit uint16 token files; use dtype=uint32 (or auto)"
        )
    return dtype


def _prepare_into(out: Path, source, opts: Options, workers, shard_tokens, dtype, progress) -> dict:
    """``prepare`` into the existing, locked directory ``out`` (the last four: ``prepare``'s arguments)."""
    if not _is_int(shard_tokens) or shard_tokens < 1:
        raise ValueError(
            f"shard_tokens={shard_tokens!r} must be a positive integer, e.g. {DEFAULT_SHARD_TOKENS}"
        )
    workers = (os.cpu_count() or 1) if workers is None else int(workers)
    if workers < 1:
        raise ValueError(f"workers={workers} must be >= 1 (default: the CPU count)")
    src = _resolve_source(source, out, fetch=True, text_field=opts.text_field)
    if src.kind == "docs" and opts.tokenizer == "char":
        raise ValueError(
            "tokenizer 'char' reads a single text file (its vocabulary is the file's characters); "
            f"{src.label} is a list of documents: use tokenizer gpt2 (data.tokenizer=gpt2, --tokenizer gpt2)"
        )
    if src.kind == "docs" and opts.doc_separator is not None:
        raise ValueError(
            f"doc_separator splits a single text file into documents; {src.label} is read as documents "
            "already (one per file or record, end-of-text between them): leave doc_separator unset"
        )
    if src.kind == "text" and opts.val_docs is not None and opts.doc_separator is None:
        raise ValueError(
            f"val_docs={opts.val_docs} holds out whole documents, and {src.label} is one document: set "
            "doc_separator (data.doc_separator) to split it into documents, or use val_fraction"
        )
    sha, fp = _source_identity(src)
    stage = out / shards.STAGE_NAME
    meta = dict(format_version=FORMAT_VERSION, tokenizer=opts.tokenizer, source=src.label, source_sha256=sha)
    meta.update(source_kind=src.kind, val_fraction=opts.val_fraction, text_field=opts.text_field)
    meta.update(max_tokens=opts.max_tokens, shard_tokens=shard_tokens)
    key = {"meta": meta, "dtype": dtype, "fingerprint": fp, "doc_separator": opts.doc_separator}
    try:
        meta.update(_prepare_stream(src, stage, opts, shard_tokens, dtype, workers, progress, key))
    except Exception:
        shutil.rmtree(stage, ignore_errors=True)  # a bad source: nothing to resume
        raise
    if fp is not None:
        meta["source_fingerprint"] = fp
    n = ", ".join(f"{meta[f'{s}_tokens']} {s} tokens in {len(meta['shards'][s])} shards" for s in SPLITS)
    logger.info(f"prepared {src.label} ({opts.tokenizer}, {meta['dtype']}): {n} -> {out}")
    shards.install(out, stage, meta["shards"], lambda: write_json(out / META_NAME, meta))
    return meta


def _empty_split(label: str, n_docs: int, split: str, opts: Options, capped: bool = False) -> str:
    """The error for a split that got no document, with a val_docs that runs as typed."""
    if capped:  # the source may well hold enough: the cap is the fix, not the source
        return (
            f"{label}: the read stopped at max_tokens={opts.max_tokens}, in document {n_docs}, and the "
            f"{split} split got no document of its own; drop the cap (all tokens) or raise it past the "
            "first documents"
        )
    if n_docs < 2:  # no split of one document holds a document on both sides
        return f"{label} gave {n_docs} document(s): a val split needs one of its own; use a source with more"
    head = f"{label} gave {n_docs} document(s) and none for the {split} split at"
    fix = f"use val_docs={1 if split == 'val' else n_docs - 1}"
    if opts.val_docs is not None:
        return f"{head} val_docs={opts.val_docs} (the first {opts.val_docs} are held out): {fix}"
    return (
        f"{head} val_fraction={opts.val_fraction} (one in {1 / opts.val_fraction:.3g} documents is held "
        f"out): {fix} (it replaces val_fraction) or a source with more documents"
    )


def _prepare_stream(
    src: sources.Source, stage: Path, opts: Options, shard_tokens, dtype, workers, progress, key
) -> dict:
    """Every source, streamed: tokenized, written into shards, resumed from ``stage``'s state for ``key``.
    The GPT-2 BPE writes end-of-text after each document of a source of documents or of a separated text
    file; the char tokenizer keeps the separator's characters. The val split is whole documents
    (``Options.is_val``), except a text file split by a share: its stream goes to the train split, whose
    end is then moved to the val split (``ShardWriter.split_off``)."""
    from tqdm import tqdm

    text, char = src.kind == "text", opts.tokenizer == "char"
    sep = opts.doc_separator if text else None
    tok = make_tokenizer(opts.tokenizer, itos=sorted(src.characters()) if char else None)  # a first pass
    eot = not text or (sep is not None and not char)  # end-of-text after every document
    sep_ids = [GPT2_EOT] if eot else (separator_ids(opts.tokenizer, sep, tok) if sep is not None else None)
    by_doc = not text or opts.val_docs is not None  # else the stream's end (moved after it)
    dt = _dtype_for(tok.vocab_size, dtype)
    state = shards.load_state(stage, key)
    stage.mkdir(exist_ok=True)
    splits = state["splits"] if state else {}
    writers = {s: shards.ShardWriter(stage, s, shard_tokens, dt, splits.get(s)) for s in SPLITS}
    done, doc = (state["pieces"], state["doc"]) if state else (0, -1)
    total = sum(w.tokens for w in writers.values())
    if state:
        logger.info("resuming the prepare of %s after %d documents (%d tokens)", src.label, doc + 1, total)
    # disable=None: a bar only on a terminal (none in logs, pipes)
    kw = dict(unit="tok", unit_scale=True, mininterval=1.0, disable=None if progress else True, initial=total)
    bar = tqdm(total=opts.max_tokens, desc=f"prepare {Path(src.label).name or src.label}", **kw)
    # without max_tokens the total (for the ETA) is estimated: the text's size times tokens per character
    size, chars, new_tokens = src.text_size(), 0, 0
    try:
        pieces = shards.tokenized_pieces(src.pieces(sep, keep_separator=not eot), tok, workers, skip=done)
        for k, (ids, start, end, n_chars) in enumerate(pieces, start=done):
            doc += start
            if end and eot:
                ids = np.append(ids, np.uint32(GPT2_EOT))
            if opts.max_tokens is not None:
                ids = ids[: opts.max_tokens - total]
            writers["val" if by_doc and opts.is_val(doc) else "train"].add(ids, start)
            total += len(ids)
            chars, new_tokens = chars + n_chars, new_tokens + len(ids)
            if opts.max_tokens is None and size and chars:
                bar.total = max(total, int(size * new_tokens / chars))
            bar.update(len(ids))
            if any(w.completed for w in writers.values()):
                shards.save_state(stage, key, k + 1, doc, writers)
            if opts.max_tokens is not None and total >= opts.max_tokens:
                break
        pieces.close()  # stops the tokenizer threads (after a max_tokens break)
        train, val = writers["train"], writers["val"]
        train.finish()
        if not by_doc and total:  # a text file's end, moved to the next document start when it has them
            n_train = split_point(total, opts.val_fraction)
            train.split_off(train.next_start(n_train) if sep_ids is not None else n_train, val)
        val.finish()
    finally:
        bar.close()
        for w in writers.values():
            w.close()
    if total == 0:
        raise ValueError(
            f"{src.label} is empty (no text besides separators); pass a non-empty UTF-8 text file"
            if text
            else f"{src.label} holds no non-empty document (field {opts.text_field!r} for records); pass a "
            "source with text"
        )
    for split in SPLITS:
        if writers[split].tokens == 0:
            capped = opts.max_tokens is not None and total >= opts.max_tokens
            raise ValueError(_empty_split(src.label, doc + 1, split, opts, capped))
    val, train = writers["val"].tokens, writers["train"].tokens
    if by_doc and val > train:  # e.g. val_docs=1 on a large first document
        held = f"val_docs={opts.val_docs}" if opts.val_docs else f"val_fraction={opts.val_fraction}"
        raise ValueError(
            f"{src.label}: the val split ({held}) holds {val} tokens, more than the {train} left to train "
            "on; hold out fewer or smaller documents, or use a source with more documents"
        )
    # what the ids mean (a resume compares it): the characters, or the BPE's name and vocabulary
    vocab = {"itos": tok.itos} if char else {"encoding": tok.encoding, "vocab_sha256": tok.vocab_sha256()}
    body = {"vocab_size": int(tok.vocab_size), "dtype": dt, **vocab}
    body["shards"] = {split: w.shards for split, w in writers.items()}
    body |= {f"{split}_tokens": w.tokens for split, w in writers.items()}
    if sep_ids is not None:  # a corpus of documents: their counts and the separator
        body |= {f"{split}_docs": w.docs for split, w in writers.items()}
        body.update(doc_separator=sep, doc_separator_ids=sep_ids)
    return body


def _compare(meta: dict, src: sources.Source, opts: Options) -> str | None:
    """What differs between ``meta`` (a prepared directory) and these arguments, in words, or None."""
    if meta["tokenizer"] != opts.tokenizer:
        old = f"{meta['tokenizer']!r} (vocab_size {meta['vocab_size']})"
        return f"data tokenized with {old}, not {opts.tokenizer!r}"
    if meta.get("doc_separator") != opts.doc_separator and src.kind == "text":
        return f"data prepared with doc_separator={meta.get('doc_separator')!r}, not {opts.doc_separator!r}"
    old_fraction, old_docs = meta_split(meta)
    if old_docs != opts.val_docs or (
        old_docs is None and not math.isclose(float(old_fraction), opts.val_fraction, abs_tol=1e-12)
    ):
        old = f"val_docs={old_docs}" if old_docs is not None else f"val_fraction={old_fraction}"
        new = f"val_fraction={opts.val_fraction}" if opts.val_docs is None else f"val_docs={opts.val_docs}"
        if old[:5] == new[:5]:  # two shares: "val_fraction=0.1, not 0.2"
            new = new.removeprefix("val_fraction=")
        return f"data split with {old}, not {new}"
    if meta.get("text_field", "text") != opts.text_field and src.kind == "docs":
        return f"data read from text_field={meta.get('text_field', 'text')!r}, not {opts.text_field!r}"
    if meta.get("max_tokens") != opts.max_tokens:
        return f"data capped at max_tokens={meta.get('max_tokens')}, not {opts.max_tokens}"
    if meta["source"] != src.label and (
        sources.is_url(src.label)
        or sources.is_url(meta["source"])
        # a directory moved or copied with its files' names, sizes and mtimes is the same corpus
        or (src.kind == "docs" and _source_identity(src)[0] != meta.get("source_sha256"))
    ):
        return f"data prepared from {meta['source']}, not {src.label}"
    if src.kind == "docs":
        diff = sources.fingerprint_diff(meta.get("source_fingerprint"), src.fingerprint())
        return diff and f"data prepared from {meta['source']} as it was before (source changed: {diff})"
    if not src.files[0].is_file():
        return None  # a deleted download; the token files are still valid
    sha = sha256_file(src.files[0])
    if sha != meta["source_sha256"]:
        return (
            f"data prepared from {meta['source']} (another text than {src.label}: sha256 {sha[:12]}..., "
            f"prepared from {str(meta['source_sha256'])[:12]}...; source changed)"
        )
    return None


def stale_reason(source, out_dir, tokenizer: str = "gpt2", *split, **options) -> str | None:
    """Why ``out_dir`` needs (re-)preparing for ``prepare``'s arguments (``split``: val_fraction,
    doc_separator; ``options``: val_docs, text_field, max_tokens), or None: its meta.json loads, every
    token file has the size it records, and tokenizer, split, cap and source match (``_compare``)."""
    out, opts = Path(out_dir).expanduser(), Options(tokenizer, *split, **options)
    src = _resolve_source(source, out, fetch=False, text_field=opts.text_field)
    if not (out / META_NAME).is_file():
        return "not prepared yet"
    meta = None
    try:
        meta = load_meta(out)
        check_shards(out, meta)  # a token file missing, of another size, or with an id beyond the vocabulary
    except (FileNotFoundError, ValueError) as e:
        return f"no usable {META_NAME} ({e})" if meta is None else str(e)
    diff = _compare(meta, src, opts)
    return f"{META_NAME} holds {diff}" if diff else None


def load_prepared(out_dir) -> dict:
    """``out_dir``'s meta dict when its data is complete, without reading the source: a resume whose corpus
    was moved or deleted goes on with the tokens it trained on (FileNotFoundError / ValueError if not)."""
    out = Path(out_dir).expanduser()
    meta = load_meta(out)
    check_shards(out, meta)
    return meta


def source_sha256(source, text_field: str = "text") -> str | None:
    """The ``source_sha256`` preparing local ``source`` now would record, or None (a URL, a dataset name,
    a source that names nothing): a moved corpus is recognised by it."""
    if source is None or sources.is_url(source) or sources.is_hf(source):
        return None
    try:
        return _source_identity(sources.open_source(source, text_field))[0]
    except (OSError, ValueError):
        return None


def ensure_prepared(
    source,
    out_dir,
    tokenizer: str = "gpt2",
    *split,
    keep_other: bool = False,
    workers: int | None = None,
    progress: bool = True,
    **options,
) -> dict:
    """``out_dir``'s meta dict, running ``prepare`` first only when ``stale_reason`` gives a reason
    (logged); up to date, nothing is rewritten. Under the directory's lock (``_locked``): of processes
    that start together one prepares, the others wait and return its meta. ``keep_other`` (the trainer):
    a directory that holds data of other arguments is an error naming them, not re-prepared."""
    opts, out, args = Options(tokenizer, *split, **options), Path(out_dir).expanduser(), (tokenizer, *split)
    with _locked(out):
        reason = stale_reason(source, out, *args, **options)
        if reason is None:
            logger.info("data in %s is up to date", out_dir)
            return load_meta(out)
        held = conflict_reason(source, out, *args, **options) if keep_other else None
        if held:
            other = out.parent / f"{out.name}_{sources.source_stem(source)}"
            raise ValueError(
                f"{out_dir} holds {held}; runs read it, so it is not prepared again: use a data.dir of "
                f"its own, e.g. data.dir={other}"
            )
        logger.info("preparing data in %s: %s", out_dir, reason)
        return _prepare_into(out, source, opts, workers, DEFAULT_SHARD_TOKENS, "auto", progress)


def conflict_reason(source, out_dir, tokenizer: str = "gpt2", *split, **options) -> str | None:
    """What ``out_dir`` holds that preparing these arguments (as ``stale_reason`` takes them) there would
    replace (runs read it), or None when it is not prepared or holds exactly this data."""
    return _held(Path(out_dir).expanduser(), source, Options(tokenizer, *split, **options))


def _held(out: Path, source, opts: Options) -> str | None:
    try:
        meta = load_meta(out)
    except (FileNotFoundError, ValueError):
        return None
    return _compare(meta, _resolve_source(source, out, fetch=False, text_field=opts.text_field), opts)


def document_fixes(source, text_field: str = "text", val_fraction=None, val_docs=None) -> list[str]:
    """prepare's arguments (``text_field=body``, ``val_docs=1``) that a local source of documents needs
    besides these, found by reading its first records and counting its documents until both splits would
    hold one: an error raised before the prepare names them with its own fix. [] when none is known."""
    if source is None or sources.is_url(source) or sources.is_hf(source):
        return []
    try:
        opts, fixes = Options("gpt2", val_fraction, None, val_docs, text_field), []
    except ValueError:
        return []  # its own error comes first
    # documents both splits need: up to the first that goes to another split than document 0
    limit = next((i + 1 for i in range(10_000) if opts.is_val(i) != opts.is_val(0)), None)
    if limit is None:
        return []
    while True:
        try:
            src = sources.open_source(source, opts.text_field)
            starts = (1 for _, start, _ in src.pieces() if start)  # documents, counted up to limit
            if src.kind != "docs" or (n := sum(itertools.islice(starts, limit))) >= limit:
                return fixes
            break
        except sources.SourceError as e:  # a text field named in the records: then count with it
            if e.fix is None or fixes:
                return fixes
            fixes.append(e.fix)
            opts.text_field = e.fix.partition("=")[2]
        except (OSError, ValueError):
            return fixes  # the prepare reports it
    if n >= 2:  # else no split holds a document on both sides (the prepare says so)
        val = [opts.is_val(i) for i in range(n)]
        fixes.append(f"val_docs={n - 1 if all(val) else 1}")
        if val_fraction is not None:
            fixes.append("val_fraction=null")
    return fixes


def prepare_command(
    out_dir, meta: dict | None = None, source: str = "CORPUS", tokenizer: str = "gpt2"
) -> str:
    """The ``python -m data.prepare`` command that prepares ``out_dir`` again as ``meta`` (default: what of
    its meta.json reads) records it, to run as typed; ``source`` and ``tokenizer`` where it records none."""
    if meta is None:
        with contextlib.suppress(OSError, ValueError):
            meta = json.loads((Path(out_dir) / META_NAME).read_text(encoding="utf-8"))
    meta = meta if isinstance(meta, dict) else {}
    args = {"source": meta.get("source") or source, "out-dir": out_dir}
    args["tokenizer"] = meta.get("tokenizer") or tokenizer
    fraction, docs = meta_split(meta)
    if docs is not None:
        args["val-docs"] = docs
    elif fraction is not None and fraction != DEFAULT_VAL_FRACTION:
        args["val-fraction"] = fraction
    if sep := meta.get("doc_separator"):  # escaped as the flag reads it (data.docs.parse_separator)
        args["doc-separator"] = sep.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")
    if meta.get("source_kind") == "docs" and meta.get("text_field", "text") != "text":
        args["text-field"] = meta["text_field"]
    if meta.get("max_tokens") is not None:
        args["max-tokens"] = meta["max_tokens"]
    if meta.get("shard_tokens", DEFAULT_SHARD_TOKENS) != DEFAULT_SHARD_TOKENS:
        args["shard-tokens"] = meta["shard_tokens"]
    auto = _dtype_for(meta["vocab_size"], "auto") if isinstance(meta.get("vocab_size"), int) else None
    if auto and meta.get("dtype", "auto") not in ("auto", auto):
        args["dtype"] = meta["dtype"]
    return " ".join(["python -m data.prepare", *(f"--{k} {shlex.quote(str(v))}" for k, v in args.items())])


# prepare's arguments in a message, written as the CLI's flags (text_field=body -> --text-field body)
_ARG = re.compile(r"(?<![.\w-])(doc_separator|val_fraction|val_docs|text_field|max_tokens)=")


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0 ok, 1 error with a message on stderr, 130 Ctrl-C)."""
    desc = "Tokenize a corpus into token shards ({train,val}_NNNNNN.bin + .idx) + meta.json."
    parser = argparse.ArgumentParser(prog="python -m data.prepare", description=desc)
    add = parser.add_argument
    add(
        "--source",
        help="UTF-8 text file, directory or glob of text / .jsonl / .json.gz / .parquet files, "
        "hf:NAME[:CONFIG], or http(s) URL (default: download Tiny Shakespeare into OUT_DIR/input.txt)",
    )
    add("--out-dir", help="output directory (default: data/shakespeare, data/shakespeare_char for char)")
    add("--tokenizer", choices=TOKENIZERS, default="gpt2")
    add("--val-fraction", type=float, help="share held out for val (0.1): documents, or a text file's end")
    add("--val-docs", type=int, help="or hold out this many whole documents (the first in source order)")
    add("--doc-separator", help="a text file only: string between documents, e.g. $'\\n\\n'")
    add("--text-field", default="text", help="record field / column with the text (%(default)s)")
    add("--max-tokens", type=int, help="stop after this many tokens")
    add("--workers", type=int, help=f"tokenizer threads (default: CPU count, {os.cpu_count()})")
    add("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard (%(default)s)")
    add("--dtype", choices=("auto", *DTYPES), default="auto", help="token file dtype (%(default)s)")
    add("--no-progress", action="store_true", help="no progress bar")
    add("--force", action="store_true", help="replace data of other arguments already in OUT_DIR")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    out_dir = args.out_dir if args.out_dir is not None else DEFAULT_OUT_DIRS[args.tokenizer]
    data = {f.name: getattr(args, f.name) for f in fields(Options)}  # the flags named as Options' fields
    if (inside := sources.prepared_inside_source(args.source, Path(out_dir))) is not None:
        print(
            f"error: --out-dir {out_dir} is inside --source {args.source}: its token files would join the "
            f"corpus; pass a folder outside it, e.g. --out-dir {inside}",
            file=sys.stderr,
        )
        return 1
    try:
        run = {"workers": args.workers, "shard_tokens": args.shard_tokens, "dtype": args.dtype}
        meta = prepare(args.source, out_dir, **data, **run, progress=not args.no_progress, force=args.force)
    except HeldError as e:  # found under the lock: also what a prepare that ran meanwhile wrote
        other_tok = load_meta(Path(out_dir)).get("tokenizer") != args.tokenizer
        suffix = args.tokenizer if other_tok else sources.source_stem(args.source)  # what differs
        other = Path(out_dir).parent / f"{Path(out_dir).name}_{suffix}"
        print(
            f"error: {out_dir} already holds {e}; preparing there would replace the token files and "
            f"meta.json that runs of it read. Use another --out-dir (e.g. --out-dir {other}), "
            "or add --force to replace it",
            file=sys.stderr,
        )
        return 1
    except (OSError, ValueError, RuntimeError) as e:
        msg = _ARG.sub(lambda m: f"--{m[1].replace('_', '-')} ", str(e))
        out = Path(out_dir)
        made = (FileExistsError, NotADirectoryError, FileNotFoundError)  # what its mkdir raises (not a read)
        if isinstance(e, made) and e.filename and Path(e.filename) in (out, *out.parents):
            on_path = isinstance(e, (FileExistsError, NotADirectoryError))
            why = "a file, not a folder, is on that path" if on_path else f"{e.strerror}: {e.filename}"
            home = Path.home() / "flashgpt-data" / (out.name or "data")
            msg = f"--out-dir {out_dir} cannot be made ({why}); pass a folder, e.g. --out-dir {home}"
        print(f"error: {msg}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # what is written stays; the next run resumes from it
        print(
            f"\ninterrupted: {out_dir} keeps the complete shards written so far; run the same command again "
            "to continue from them",
            file=sys.stderr,
        )
        return 130
    n = sum(len(v) for v in meta["shards"].values())
    print(
        f"wrote {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens "
        f"(tokenizer {meta['tokenizer']}, vocab_size {meta['vocab_size']}, {meta['dtype']}, {n} shards) "
        f"to {Path(out_dir)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
