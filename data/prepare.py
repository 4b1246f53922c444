"""Prepare step: a corpus -> token shards ``{train,val}_NNNNNN.bin`` (+ ``.idx``) and ``meta.json``.

The pattern is nanoGPT's (``data/openwebtext/prepare.py``): tokenize the corpus once and store the ids
raw (uint16, or uint32 for a larger vocabulary) so that training memory-maps them. Every source streams
through one path (``_prepare_stream``): ``data.sources`` reads it as pieces of documents,
``data.shards`` tokenizes them in parallel and writes resumable shards. See ``data/meta.py`` for the
file format and ``docs/data.md`` for the sources and the val split.

CLI (either form, from anywhere)::

    python -m data.prepare --source PATH --out-dir DIR --tokenizer gpt2|char [--val-fraction 0.1] [--force]
    python data/prepare.py  --source PATH --out-dir DIR --tokenizer gpt2|char

A DIR that already holds data of another tokenizer, corpus, split or separator is refused (exit 1, nothing
written: runs read it) unless ``--force``; the same arguments again just re-prepare it.

Without ``--source`` Tiny Shakespeare is downloaded into ``DIR/input.txt``; without ``--out-dir`` the
output goes to ``data/shakespeare`` (gpt2) or ``data/shakespeare_char`` (char) next to this file.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import http.client
import logging
import math
import os
import shutil
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as `python data/prepare.py`: import the `data` package from the repo root
    _HERE = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    sys.path.insert(0, os.path.dirname(_HERE))

import numpy as np  # noqa: E402

from data.docs import GPT2_EOT, parse_separator, separator_ids  # noqa: E402
from data.meta import (  # noqa: E402
    DTYPES,
    FORMAT_VERSION,
    META_NAME,
    SPLITS,
    atomic_write,
    check_bin_file,
    load_meta,
    meta_path,
    split_shards,
    token_dtype,
    write_json,
)
from data.shards import (  # noqa: E402
    ShardWriter,
    install,
    is_val_doc,
    load_state,
    save_state,
    stage_dir,
    tokenized_pieces,
)
from data.sources import (  # noqa: E402
    Source,
    fingerprint_diff,
    fingerprint_sha256,
    is_hf,
    open_source,
    source_stem,
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


# --------------------------------------------------------------------------------------------- helpers
def _is_url(source: str | os.PathLike | None) -> bool:
    return isinstance(source, str) and source.lower().startswith(("http://", "https://"))


def val_split(val_fraction: float | None, val_docs: int | None) -> tuple[float | None, int | None]:
    """The val split as (val_fraction, None) or (None, val_docs): a share, or a count of whole documents;
    neither set means ``DEFAULT_VAL_FRACTION``.

    Raises:
        ValueError: both set (naming both keys), or a value out of range.
    """
    if val_docs is not None:
        if val_fraction is not None:
            raise ValueError(
                f"val_fraction={val_fraction} and val_docs={val_docs} both set the val split: set one "
                "(data.val_fraction / --val-fraction for a share, data.val_docs / --val-docs for a count "
                "of documents)"
            )
        if isinstance(val_docs, bool) or not isinstance(val_docs, int) or val_docs < 1:
            raise ValueError(f"val_docs={val_docs!r} must be a positive number of documents, e.g. 100")
        return None, val_docs
    if val_fraction is None:
        return DEFAULT_VAL_FRACTION, None
    if (
        isinstance(val_fraction, bool)
        or not isinstance(val_fraction, (int, float))
        or not 0 < val_fraction < 1
    ):
        raise ValueError(f"val_fraction={val_fraction!r} must be a number strictly between 0 and 1, e.g. 0.1")
    return float(val_fraction), None


def sha256_file(path: str | os.PathLike, chunk_bytes: int = 1 << 20) -> str:
    """Hex SHA-256 of a file's bytes, read in ``chunk_bytes`` chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


def meta_split(meta: dict) -> tuple[float | None, int | None]:
    """(val_fraction, val_docs) a prepared directory was split with: a share, or (val_fraction null) the
    count of documents held out, which is its ``val_docs``."""
    if "val_fraction" in meta and meta["val_fraction"] is None:
        return None, meta.get("val_docs")
    return meta.get("val_fraction"), None


def split_point(num_tokens: int, val_fraction: float) -> int:
    """Number of training tokens: ``int(num_tokens * (1 - val_fraction))`` clamped to [1, num_tokens - 1].

    The first that many tokens of the stream are the training split, the rest the validation split, so
    both splits are non-empty (e.g. 338,025 tokens at 0.1 -> 304,222 train + 33,803 val).

    Raises:
        ValueError: fewer than 2 tokens (no way to have two non-empty splits).
    """
    if num_tokens < 2:
        raise ValueError(
            f"the corpus has {num_tokens} token(s); at least 2 are needed for a train and a val split. "
            "Use a bigger corpus."
        )
    return min(max(int(num_tokens * (1.0 - val_fraction)), 1), num_tokens - 1)


def _download(url: str, dest: Path) -> None:
    """Fetch ``url`` into ``dest`` (atomically).

    Raises:
        RuntimeError: network / HTTP failure or empty reply; the message says to pass a local path.
    """
    logger.info("downloading %s -> %s", url, dest)
    hint = (
        "If this machine has no network access, fetch the file elsewhere and pass a local path instead: "
        "data.source=PATH (Hydra) or --source PATH (CLI)."
    )
    try:
        with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as resp:
            payload = resp.read()
    except (OSError, http.client.HTTPException, ValueError) as e:  # URLError/HTTPError/timeouts are OSError
        raise RuntimeError(f"could not download {url} ({type(e).__name__}: {e}). {hint}") from e
    if not payload:
        raise RuntimeError(f"downloading {url} returned no data. {hint}")
    atomic_write(dest, lambda f: f.write(payload))


def _meta_source(out_dir: Path) -> str | None:
    """``meta["source"]`` of ``out_dir`` if it has a loadable meta.json, else None."""
    try:
        return load_meta(out_dir)["source"]
    except (FileNotFoundError, ValueError):
        return None


def _resolve_source(
    source: str | os.PathLike | None, out_dir: Path, *, fetch: bool, text_field: str = "text"
) -> Source:
    """Map ``source`` to a ``data.sources.Source`` (its ``label`` is stored in meta["source"]).

    ``None`` means the Tiny Shakespeare URL. When ``fetch`` is true a URL is downloaded into
    ``out_dir/input.txt``, unless that file exists already and ``out_dir/meta.json`` does not name another
    source (delete it to force a new download); a URL is a text source whose label is the URL.

    Raises:
        FileNotFoundError / IsADirectoryError: a local ``source`` that names no file.
        RuntimeError: download failure (see ``_download``).
    """
    if isinstance(source, str) and not source.strip():
        source = None  # an empty config value means "the default corpus"
    if source is None or _is_url(source):
        url = TINY_SHAKESPEARE_URL if source is None else str(source)
        dest = out_dir / DOWNLOAD_NAME
        if fetch:
            if dest.is_file() and _meta_source(out_dir) not in (None, url):
                dest.unlink()  # a download of another URL
            if not (dest.is_file() and dest.stat().st_size > 0):
                _download(url, dest)
        return Source(url, "text", [dest], out_dir, text_field=text_field)
    return open_source(source, text_field)


# ------------------------------------------------------------------------------------------------- API
@dataclass(frozen=True)
class Options:
    """What a prepared directory is prepared with besides source and tokenizer (compared on reuse)."""

    val_fraction: float | None = DEFAULT_VAL_FRACTION  # None: val_docs
    doc_separator: str | None = None
    text_field: str = "text"
    max_tokens: int | None = None
    val_docs: int | None = None

    def is_val(self, i: int) -> bool:
        """Document ``i`` (0-based, non-empty, in source order) is held out: the first ``val_docs``, or
        one in every 1/val_fraction (``data.shards.is_val_doc``)."""
        return i < self.val_docs if self.val_docs is not None else is_val_doc(i, self.val_fraction)


def prepare(
    source: str | os.PathLike | None,
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
) -> dict:
    """Tokenize a corpus into shards ``out_dir/{train,val}_NNNNNN.bin`` (+ ``.idx``) and ``meta.json``.

    Args:
        source: a UTF-8 text file; a directory or glob of text / .jsonl / .json.gz / .parquet files; a
            single .jsonl / .json.gz / .parquet file; ``hf:NAME[:CONFIG]`` (``data.sources``); an
            ``http(s)://`` URL (downloaded into ``out_dir/input.txt``, reused if that file exists); or
            ``None`` / ``""`` for Tiny Shakespeare (``TINY_SHAKESPEARE_URL``).
        out_dir: output directory (created if missing).
        tokenizer: ``"gpt2"`` (tiktoken GPT-2 BPE, ``encode_ordinary``, vocab 50257) or ``"char"``
            (vocab = sorted distinct characters of the corpus, stored as ``meta["itos"]``; a single
            text file only: the vocabulary needs the whole text).
        val_fraction: in (0, 1). A single text file: the share of the token stream (its end, moved to
            the next document start when there are documents) kept for validation. Any other source:
            the share of documents held out whole (``data.shards.is_val_doc``). None: 0.1, or val_docs.
        val_docs: or a count: the first that many documents are held out whole (a stream's length is
            unknown, so a count cannot be spread); a text file needs ``doc_separator``. Not with
            val_fraction (ValueError naming both).
        doc_separator: a single text file only: None (one document), or a string that separates
            documents in it (Tiny Shakespeare: "\n\n"). gpt2: the documents are joined with the
            end-of-text token (50256); char: the text is kept and the separator's characters mark the
            boundaries (``data.docs``). Escapes \\n, \\t, \\\\ are understood. Every other source is a
            list of documents, each followed by the end-of-text token.
        text_field: the record field (JSON) or column (Parquet, datasets) that holds a document's text.
        max_tokens: stop after this many tokens (the last document cut there), None for all.
        workers: tokenizer processes (default: the CPU count); 1 tokenizes inline.
        shard_tokens: tokens per shard file (the last one of a split may be shorter).
        dtype: ``"auto"`` (uint16 when the vocabulary fits, else uint32), ``"uint16"`` or ``"uint32"``.
        progress: show a tqdm bar (tokens, tokens/s) on stderr.

    Returns:
        The meta dict written to ``meta.json`` (``data.meta``): format_version 2, tokenizer, vocab_size,
        train_tokens, val_tokens, val_fraction, source (absolute path, glob, hf:NAME or URL),
        source_sha256 (a text file's bytes; else of ``source_fingerprint``: file names, sizes, mtimes),
        dtype, shard_tokens, shards, source_kind, text_field, max_tokens, for char itos, for gpt2
        encoding and vocab_sha256, and with documents doc_separator, doc_separator_ids, train_docs and
        val_docs (documents starting in each split).

    The shards are written into ``out_dir/.prepare-partial`` and moved in at the end (``data.shards``),
    the meta.json last: a prepare that fails or is interrupted leaves the data already prepared in
    ``out_dir`` as it was, and one that is interrupted continues from its last complete shard when run
    again with the same arguments. A failed prepare also removes the directories it created.

    Raises:
        ValueError: bad arguments, a non-UTF-8 file, a record without the text field, a source without
            (non-empty) documents, fewer than 2 tokens or an empty split; the message names the source.
        FileNotFoundError / IsADirectoryError: a local ``source`` that names no file.
        RuntimeError: download failed (says to pass a local path), or tiktoken's BPE files are unavailable.
    """
    opts = _options(
        tokenizer,
        val_fraction,
        doc_separator,
        val_docs=val_docs,
        text_field=text_field,
        max_tokens=max_tokens,
    )
    out = Path(out_dir).expanduser()
    with _locked(out):
        return _prepare_into(out, source, tokenizer, opts, workers, shard_tokens, dtype, progress)


def _options(
    tokenizer: str,
    val_fraction: float | None = None,
    doc_separator: str | None = None,
    *,
    val_docs: int | None = None,
    text_field: str = "text",
    max_tokens: int | None = None,
) -> Options:
    """``prepare``'s split and reading arguments, checked (ValueError naming the bad one)."""
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {tokenizer!r}; use one of {TOKENIZERS}")
    val_fraction, val_docs = val_split(val_fraction, val_docs)
    if not isinstance(text_field, str) or not text_field:
        raise ValueError(f"text_field={text_field!r} must be a non-empty field name, e.g. 'text'")
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 2
    ):
        raise ValueError(
            f"max_tokens={max_tokens!r} (data.max_tokens, --max-tokens) must be null (all tokens) or an "
            "integer >= 2, e.g. data.max_tokens=1000000000"
        )
    return Options(val_fraction, parse_separator(doc_separator), text_field, max_tokens, val_docs)


def _make_dirs(path: Path) -> list[Path]:
    """``mkdir -p path``; returns the directories this call created (deepest first): one that another
    process created at the same moment is not counted, so only its creator takes it back."""
    made = []
    for p in reversed(_missing_dirs(path)):
        try:
            p.mkdir()
        except FileExistsError:
            continue
        made.append(p)
    if not path.is_dir():
        path.mkdir(parents=True, exist_ok=True)  # raises what mkdir raises (a file in the way ...)
    return made[::-1]


@contextlib.contextmanager
def _locked(out: Path):
    """Create ``out`` and hold an exclusive ``flock`` on the directory itself while the block runs, so
    that launches which start together (a job array, a sweep launcher) prepare a data directory once:
    the first prepares, the others wait here and then find it up to date. The kernel drops the lock when
    its process dies, so a killed prepare never blocks the next one. A directory that was removed and
    created again while we waited (a failed prepare takes back what it created) is locked afresh.
    Where the filesystem has no ``flock`` (some network mounts) the block runs unlocked. A block that
    fails takes back the directories this process created (``_take_back``), under the lock: a waiter
    never starts on files about to be removed."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - no flock on this platform
        with _taking_back(_make_dirs(out)):
            yield
        return
    while True:
        created = _make_dirs(out)  # what this process made (again, after a retry)
        try:
            fd = os.open(out, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except FileNotFoundError:  # taken back by a failed prepare meanwhile
            continue
        try:
            locked = True
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                logger.info("waiting for another process that is preparing %s", out)
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as e:  # e.g. ENOLCK on a network mount: go on without the lock
                logger.warning("cannot lock %s (%s); preparing it without a lock", out, e.strerror)
                locked = False
            if locked:
                try:
                    same = os.path.samestat(os.stat(out), os.fstat(fd))
                except FileNotFoundError:
                    same = False
                if not same:
                    continue  # the finally closes fd (dropping the lock on the old directory)
            with _taking_back(created):
                yield
            return
        finally:
            os.close(fd)


@contextlib.contextmanager
def _taking_back(created: list[Path]):
    try:
        yield
    except BaseException as e:  # an interrupt (Ctrl-C) keeps the stage, to resume from
        _take_back(created, keep_stage=not isinstance(e, Exception))
        raise


def _missing_dirs(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist yet, deepest first (what ``mkdir`` creates)."""
    missing = []
    for p in (path, *path.parents):
        if p.exists() or p.is_symlink():
            break
        missing.append(p)
    return missing


def _take_back(created: list[Path], keep_stage: bool = False) -> None:
    """After a failed ``prepare``: remove the directories it created (``created``, deepest first) with the
    files it writes there (download, stage, meta.json). A directory holding anything else is kept, and so
    are those above it; a directory that existed before is never in ``created``. ``keep_stage``: an
    interrupted prepare (Ctrl-C) keeps its stage, to resume from."""
    if not created:
        return
    out = created[0]
    if not keep_stage:
        shutil.rmtree(stage_dir(out), ignore_errors=True)
    for path in (out / DOWNLOAD_NAME, meta_path(out)):
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass
    for d in created:
        try:
            d.rmdir()  # only when empty
        except OSError:
            return


def _source_identity(src: Source, opts: Options) -> tuple[str, dict | None]:
    """(source_sha256, source_fingerprint): a text file's bytes' SHA-256; else the SHA-256 of the
    fingerprint (file names, sizes, mtimes or the dataset name) and the fingerprint itself."""
    if src.kind == "text":
        return sha256_file(src.files[0]), None
    fp = src.fingerprint()
    return fingerprint_sha256(fp, opts.text_field), fp


def _tokenizer_meta(tok) -> dict:
    if tok.name == "char":
        return {"itos": tok.itos}
    # what the ids mean: the BPE's name and vocabulary (a resume compares them, trainer/setup.py)
    return {"encoding": tok.encoding, "vocab_sha256": tok.vocab_sha256()}


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


def _prepare_into(
    out: Path,
    source: str | os.PathLike | None,
    tokenizer: str,
    opts: Options,
    workers: int | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    dtype: str = "auto",
    progress: bool = True,
) -> dict:
    """``prepare`` into the existing directory ``out``."""
    if isinstance(shard_tokens, bool) or not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise ValueError(
            f"shard_tokens={shard_tokens!r} must be a positive integer, e.g. {DEFAULT_SHARD_TOKENS}"
        )
    workers = os.cpu_count() or 1 if workers is None else int(workers)
    if workers < 1:
        raise ValueError(f"workers={workers} must be >= 1 (default: the CPU count)")
    src = _resolve_source(source, out, fetch=True, text_field=opts.text_field)
    if src.kind == "docs" and tokenizer == "char":
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
    sha, fp = _source_identity(src, opts)
    stage = stage_dir(out)
    stage.mkdir(exist_ok=True)
    meta = {
        "format_version": FORMAT_VERSION,
        "tokenizer": tokenizer,
        "source": src.label,
        "source_sha256": sha,
        "source_kind": src.kind,
        "val_fraction": opts.val_fraction,
        "text_field": opts.text_field,
        "max_tokens": opts.max_tokens,
        "shard_tokens": shard_tokens,
    }
    key = {"meta": meta, "dtype": dtype, "fingerprint": fp, "doc_separator": opts.doc_separator}
    try:
        body = _prepare_stream(src, stage, tokenizer, opts, shard_tokens, dtype, workers, progress, key)
    except Exception:
        shutil.rmtree(stage, ignore_errors=True)  # a bad source: nothing to resume
        raise
    meta.update(body)
    if fp is not None:
        meta["source_fingerprint"] = fp
    logger.info(
        "prepare %s: %s tokenizer -> %d tokens (%d train / %d val, %s, %d + %d shards) -> %s",
        src.label,
        tokenizer,
        meta["train_tokens"] + meta["val_tokens"],
        meta["train_tokens"],
        meta["val_tokens"],
        meta["dtype"],
        len(meta["shards"]["train"]),
        len(meta["shards"]["val"]),
        out,
    )
    install(out, stage, meta["shards"], lambda: write_json(meta_path(out), meta))
    return meta


def _empty_split(label: str, n_docs: int, split: str, opts: Options) -> str:
    """The error for a split that got no document (``n_docs`` in all)."""
    # a value that runs as typed: hold out one whole document, or all but one (data.val_docs / --val-docs)
    if n_docs < 2:  # no split of one document holds a document on both sides
        return f"{label} gave {n_docs} document(s): a val split needs one of its own; use a source with more"
    fix = f"val_docs={1 if split == 'val' else n_docs - 1}"
    if opts.val_docs is not None:
        return (
            f"{label} gave {n_docs} document(s) and none for the {split} split at val_docs={opts.val_docs} "
            f"(the first {opts.val_docs} are held out): use {fix} (data.val_docs, --val-docs)"
        )
    return (
        f"{label} gave {n_docs} document(s) and none for the {split} split at val_fraction="
        f"{opts.val_fraction} (one in {1 / opts.val_fraction:.3g} documents is held out): use {fix} "
        "(data.val_docs, --val-docs; it replaces val_fraction) or a source with more documents"
    )


def _prepare_stream(
    src: Source,
    stage: Path,
    tokenizer: str,
    opts: Options,
    shard_tokens: int,
    dtype: str,
    workers: int,
    progress: bool,
    key: dict,
) -> dict:
    """Every source, streamed (``Source.pieces``): tokenized by ``workers`` processes, written into
    shards, resumed from ``stage``'s state when it holds one for ``key``.

    Documents: each document of a source of documents, and of a text file split on ``doc_separator`` by
    the GPT-2 BPE, is followed by the end-of-text token; the char tokenizer keeps the separator's
    characters. The val split is whole documents (``Options.is_val``), except a text file split by a
    share: its end, moved to the next document start, as when it was read whole (so the stream goes to
    the train split first and its end is moved to the val split, ``ShardWriter.split_off``).
    """
    from tqdm import tqdm

    text = src.kind == "text"
    sep = opts.doc_separator if text else None
    if tokenizer == "char":  # the vocabulary is the text's characters: a first pass over the file
        chars = "".join(sorted(src.characters()))
        tok, spec = make_tokenizer("char", itos=list(chars)), ("char", chars)
    else:
        tok, spec = make_tokenizer(tokenizer), tokenizer
    eot = not text or (sep is not None and tokenizer == "gpt2")  # end-of-text after every document
    sep_ids = [GPT2_EOT] if eot else (separator_ids(tokenizer, sep, tok) if sep is not None else None)
    by_doc = not text or opts.val_docs is not None  # else the stream's end (moved after it)
    dt = _dtype_for(tok.vocab_size, dtype)
    state = load_state(stage, key)
    stage.mkdir(exist_ok=True)
    splits = state["splits"] if state else {}
    writers = {s: ShardWriter(stage, s, shard_tokens, dt, splits.get(s)) for s in SPLITS}
    done, doc = (state["pieces"], state["doc"]) if state else (0, -1)
    total = sum(w.tokens for w in writers.values())
    if state:
        logger.info("resuming the prepare of %s after %d documents (%d tokens)", src.label, doc + 1, total)
    bar = tqdm(
        total=opts.max_tokens,
        initial=total,
        unit="tok",
        unit_scale=True,
        desc=f"prepare {Path(src.label).name or src.label}",
        disable=None if progress else True,  # None: only on a terminal (no bar in logs, pipes)
        mininterval=1.0,
    )
    # without max_tokens the bar's total (and ETA) is an estimate: the source's text size times the tokens
    # per character tokenized so far
    size = src.text_size()
    chars = new_tokens = 0
    try:
        pieces = tokenized_pieces(src.pieces(sep, keep_separator=not eot), spec, workers, skip=done)
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
                save_state(stage, key, k + 1, doc, writers)
            if opts.max_tokens is not None and total >= opts.max_tokens:
                break
        pieces.close()  # stops the tokenizer processes (after a max_tokens break)
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
            raise ValueError(_empty_split(src.label, doc + 1, split, opts))
    body = {"vocab_size": int(tok.vocab_size), "dtype": dt, **_tokenizer_meta(tok), "shards": {}}
    for split, w in writers.items():
        body["shards"][split] = w.shards
        body[f"{split}_tokens"] = w.tokens
        if sep_ids is not None:
            body[f"{split}_docs"] = w.docs
    if sep_ids is not None:
        body.update(doc_separator=sep, doc_separator_ids=sep_ids)
    return body


def _compare(meta: dict, src: Source, tokenizer: str, opts: Options, *, hash_text: bool = True) -> str | None:
    """What differs between ``meta`` (a prepared directory) and these arguments, in words, or None."""
    if meta["tokenizer"] != tokenizer:
        return (
            f"data tokenized with {meta['tokenizer']!r} (vocab_size {meta['vocab_size']}), not {tokenizer!r}"
        )
    if meta.get("doc_separator") != opts.doc_separator and src.kind == "text":
        return f"data prepared with doc_separator={meta.get('doc_separator')!r}, not {opts.doc_separator!r}"
    old_fraction, old_docs = meta_split(meta)
    if old_docs != opts.val_docs or (
        old_docs is None
        and old_fraction is not None  # format-1 metas may lack it
        and not math.isclose(float(old_fraction), opts.val_fraction, abs_tol=1e-12)
    ):
        old = f"val_docs={old_docs}" if old_docs is not None else f"val_fraction={old_fraction}"
        new = f"val_fraction={opts.val_fraction}" if opts.val_docs is None else f"val_docs={opts.val_docs}"
        # two shares: "val_fraction=0.1, not 0.2"
        return (
            f"data split with {old}, not {new.removeprefix('val_fraction=') if old[:5] == new[:5] else new}"
        )
    if meta.get("text_field", "text") != opts.text_field and src.kind == "docs":
        return f"data read from text_field={meta.get('text_field', 'text')!r}, not {opts.text_field!r}"
    if meta.get("max_tokens") != opts.max_tokens:
        return f"data capped at max_tokens={meta.get('max_tokens')}, not {opts.max_tokens}"
    if meta["source"] != src.label and (
        _is_url(src.label)
        or _is_url(meta["source"])
        # a directory moved or copied with its files' names, sizes and mtimes is the same corpus
        or (src.kind == "docs" and _source_identity(src, opts)[0] != meta.get("source_sha256"))
    ):
        return f"data prepared from {meta['source']}, not {src.label}"
    if src.kind == "docs":
        old = meta.get("source_fingerprint")
        new = src.fingerprint()
        diff = fingerprint_diff(old, new) if isinstance(old, dict) else "no recorded fingerprint"
        return (
            f"data prepared from {meta['source']} as it was before (source changed: {diff})" if diff else None
        )
    if _is_url(src.label):
        if not src.files[0].is_file():
            return None  # the download was deleted; the token files are still valid
    if hash_text:
        sha = sha256_file(src.files[0])
        if sha != meta["source_sha256"]:
            return (
                f"data prepared from {meta['source']} (another text than {src.label}: sha256 {sha[:12]}..., "
                f"prepared from {str(meta['source_sha256'])[:12]}...; source changed)"
            )
    return None


def stale_reason(source, out_dir, tokenizer: str = "gpt2", *split, **options) -> str | None:
    """Why ``out_dir`` needs (re-)preparing for these arguments (``prepare``'s: ``split`` = val_fraction,
    doc_separator; ``options`` = val_docs, text_field, max_tokens), or ``None`` if it is up to date.

    Up to date means: ``meta.json`` loads (format 1 or 2), every token file exists with the size it
    records, and tokenizer, separator, split, text field, cap and source match (``_compare``): a text
    file's SHA-256, a URL's name (and a kept download's SHA-256), the file names / sizes / mtimes of a
    directory or glob, a dataset's name. Costs one hash of a text source.

    Raises:
        FileNotFoundError / IsADirectoryError: local ``source`` names no file.
    """
    return _stale(source, Path(out_dir).expanduser(), tokenizer, _options(tokenizer, *split, **options))


def _stale(source, out: Path, tokenizer: str, opts: Options) -> str | None:
    src = _resolve_source(source, out, fetch=False, text_field=opts.text_field)
    if not (out / META_NAME).is_file():
        return "not prepared yet"
    try:
        meta = load_meta(out)
    except (FileNotFoundError, ValueError) as e:
        return f"no usable {META_NAME} ({e})"
    if broken := _shards_problem(out, meta):
        return broken
    diff = _compare(meta, src, tokenizer, opts)
    return f"{META_NAME} holds {diff}" if diff else None


def _shards_problem(out: Path, meta: dict) -> str | None:
    """What is wrong with ``out``'s token files (missing, or another size than meta.json records)."""
    for split in SPLITS:
        for path, n, _ in split_shards(out, meta, split):
            try:
                check_bin_file(path, n, token_dtype(meta))
            except (FileNotFoundError, ValueError) as e:
                return str(e)
    return None


def load_prepared(out_dir) -> dict:
    """``out_dir``'s meta dict when its data is complete (meta.json loads, every token file has the size it
    records), without reading the source it was prepared from: a resume whose corpus was moved or deleted
    goes on with the tokens it trained on.

    Raises:
        FileNotFoundError / ValueError naming what is missing or broken.
    """
    out = Path(out_dir).expanduser()
    meta = load_meta(out)
    if broken := _shards_problem(out, meta):
        raise ValueError(broken)
    return meta


def source_sha256(source, text_field: str = "text") -> str | None:
    """``meta["source_sha256"]`` that preparing local ``source`` now would record (a text file's SHA-256,
    a directory's or glob's fingerprint), or None for a URL, a dataset name or a source that names nothing:
    a moved corpus is recognised by it."""
    if source is None or _is_url(source) or is_hf(source):
        return None
    try:
        src = open_source(source, text_field)
        return _source_identity(src, Options(text_field=text_field))[0]
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
    """Return ``out_dir``'s meta dict, running ``prepare`` (with these arguments, as ``stale_reason``
    takes them) first only if it is missing or stale.

    Staleness is decided by ``stale_reason``; the reason is logged (INFO) before re-preparing. When up to
    date nothing is re-tokenized or rewritten (file mtimes are unchanged).

    The check and the prepare run under an exclusive lock on the directory (``_locked``): of several
    processes that start at once on a directory not prepared yet, one prepares and the others wait for
    it, then return its meta. With ``keep_other=True`` (the trainer) a directory that holds data of other
    arguments (``conflict_reason``) is an error, not re-prepared: runs read it. In distributed training
    call it on one rank, then barrier.

    Raises:
        Same as ``prepare``; ValueError naming what the directory holds (``keep_other``).
    """
    opts = _options(tokenizer, *split, **options)
    out = Path(out_dir).expanduser()
    with _locked(out):
        reason = _stale(source, out, tokenizer, opts)
        if reason is None:
            logger.info("data in %s is up to date", out_dir)
            return load_meta(out)
        held = _conflict(source, out, tokenizer, opts) if keep_other else None
        if held:
            other = out.parent / f"{out.name}_{source_stem(source)}"
            raise ValueError(
                f"{out_dir} holds {held}; runs read it, so it is not prepared again: use a data.dir of "
                f"its own, e.g. data.dir={other}"
            )
        logger.info("preparing data in %s: %s", out_dir, reason)
        return _prepare_into(out, source, tokenizer, opts, workers, progress=progress)


def conflict_reason(source, out_dir, tokenizer: str = "gpt2", *split, **options) -> str | None:
    """What ``out_dir`` already holds that preparing these arguments (as ``stale_reason`` takes them)
    there would replace, or None.

    A directory with a loadable ``meta.json`` holds data that runs read (and resume from): preparing
    another tokenizer, document separator, split, text field, cap or corpus there would swap it under
    them (a changed source included: its message names what differs). None when ``out_dir`` is not
    prepared (or its meta.json is broken) or holds exactly these arguments' data.

    Raises:
        FileNotFoundError / IsADirectoryError: local ``source`` names no file.
    """
    return _conflict(source, Path(out_dir).expanduser(), tokenizer, _options(tokenizer, *split, **options))


def _conflict(source, out: Path, tokenizer: str, opts: Options) -> str | None:
    try:
        meta = load_meta(out)
    except (FileNotFoundError, ValueError):
        return None
    src = _resolve_source(source, out, fetch=False, text_field=opts.text_field)
    return _compare(meta, src, tokenizer, opts)


# ------------------------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the process exit status (0 ok, 1 error with a message on stderr)."""
    parser = argparse.ArgumentParser(
        prog="python -m data.prepare",
        description="Tokenize a corpus into token shards ({train,val}_NNNNNN.bin + .idx) + meta.json.",
    )
    parser.add_argument(
        "--source",
        default=None,
        help="UTF-8 text file, directory or glob of text / .jsonl / .json.gz / .parquet files, "
        "hf:NAME[:CONFIG], or http(s) URL (default: download Tiny Shakespeare into OUT_DIR/input.txt)",
    )
    parser.add_argument(
        "--out-dir",
        default=None,
        help="output directory (default: data/shakespeare for gpt2, data/shakespeare_char for char)",
    )
    parser.add_argument("--tokenizer", choices=TOKENIZERS, default="gpt2")
    parser.add_argument(
        "--val-fraction",
        type=float,
        default=None,
        help="share held out for val (0.1): documents of a list of documents, the end of a text file",
    )
    parser.add_argument(
        "--val-docs",
        type=int,
        default=None,
        help="or hold out this many whole documents (the first in source order) instead of a share",
    )
    parser.add_argument(
        "--doc-separator",
        default=None,
        help="a text file only: string between documents, e.g. $'\\n\\n' (records document starts for "
        "document masking; gpt2 writes <|endoftext|> between documents)",
    )
    parser.add_argument("--text-field", default="text", help="record field / column with the text (text)")
    parser.add_argument("--max-tokens", type=int, default=None, help="stop after this many tokens")
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help=f"tokenizer processes (default: CPU count, {os.cpu_count()})",
    )
    parser.add_argument(
        "--shard-tokens",
        type=int,
        default=DEFAULT_SHARD_TOKENS,
        help=f"tokens per shard ({DEFAULT_SHARD_TOKENS})",
    )
    parser.add_argument("--dtype", choices=("auto", *DTYPES), default="auto", help="token file dtype (auto)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace data of another tokenizer, corpus, split or separator already in OUT_DIR",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    out_dir = args.out_dir if args.out_dir is not None else DEFAULT_OUT_DIRS[args.tokenizer]
    kw = {"text_field": args.text_field, "max_tokens": args.max_tokens, "val_docs": args.val_docs}
    try:
        held = conflict_reason(
            args.source, out_dir, args.tokenizer, args.val_fraction, args.doc_separator, **kw
        )
        if held and not args.force:
            other_tok = load_meta(Path(out_dir)).get("tokenizer") != args.tokenizer
            suffix = args.tokenizer if other_tok else source_stem(args.source)  # what differs
            other = Path(out_dir).parent / f"{Path(out_dir).name}_{suffix}"
            print(
                f"error: {out_dir} already holds {held}; preparing there would replace the token files and "
                f"meta.json that runs of it read. Use another --out-dir (e.g. --out-dir {other}), "
                "or add --force to replace it",
                file=sys.stderr,
            )
            return 1
        meta = prepare(
            args.source,
            out_dir,
            args.tokenizer,
            args.val_fraction,
            args.doc_separator,
            workers=args.workers,
            shard_tokens=args.shard_tokens,
            dtype=args.dtype,
            progress=not args.no_progress,
            **kw,
        )
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: what is written stays; the next run resumes from it
        print(
            f"\ninterrupted: {out_dir} keeps the complete shards written so far; run the same command again "
            "to continue from them",
            file=sys.stderr,
        )
        return 130
    shards = sum(len(v) for v in meta["shards"].values())
    print(
        f"wrote {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens "
        f"(tokenizer {meta['tokenizer']}, vocab_size {meta['vocab_size']}, {meta['dtype']}, {shards} shards) "
        f"to {Path(out_dir)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
