"""Prepare step: UTF-8 text corpus -> ``train.bin`` / ``val.bin`` (uint16 token ids) + ``meta.json``.

The pattern is nanoGPT's (``data/shakespeare*/prepare.py``): tokenize the whole corpus once, keep the
first ``1 - val_fraction`` of the token stream for training and the rest for validation, and store the
ids as raw ``uint16`` so that training memory-maps them. See ``data/meta.py`` for the file format.

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
import json
import logging
import math
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

if __package__ in (None, ""):  # run as `python data/prepare.py`: import the `data` package from the repo root
    _HERE = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    sys.path.insert(0, os.path.dirname(_HERE))

import numpy as np  # noqa: E402

from data.docs import parse_separator  # noqa: E402
from data.meta import (  # noqa: E402
    DTYPE_NAME,
    FORMAT_VERSION,
    META_NAME,
    SPLITS,
    TOKEN_DTYPE,
    bin_path,
    check_bin_file,
    load_meta,
    meta_path,
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


# --------------------------------------------------------------------------------------------- helpers
def _is_url(source: str | os.PathLike | None) -> bool:
    return isinstance(source, str) and source.lower().startswith(("http://", "https://"))


def _check_args(tokenizer: str, val_fraction: float) -> None:
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {tokenizer!r}; use one of {TOKENIZERS}")
    if not isinstance(val_fraction, (int, float)) or not 0.0 < float(val_fraction) < 1.0:
        raise ValueError(f"val_fraction={val_fraction!r} must be a number strictly between 0 and 1, e.g. 0.1")


def sha256_file(path: str | os.PathLike, chunk_bytes: int = 1 << 20) -> str:
    """Hex SHA-256 of a file's bytes, read in ``chunk_bytes`` chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


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


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write ``path`` through a hidden temporary file in the same directory, then ``os.replace`` it.

    A killed process leaves at most a ``.tmp-*`` file, never a partial ``path``.
    """
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_array(path: Path, ids: np.ndarray) -> None:
    arr = np.ascontiguousarray(ids, dtype=TOKEN_DTYPE)
    atomic_write(path, lambda f: f.write(memoryview(arr).cast("B")))


def _write_meta(path: Path, meta: dict) -> None:
    payload = (json.dumps(meta, indent=2) + "\n").encode("utf-8")
    atomic_write(path, lambda f: f.write(payload))


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


def _resolve_source(source: str | os.PathLike | None, out_dir: Path, *, fetch: bool) -> tuple[Path, str]:
    """Map ``source`` to (local file to read, label stored in meta["source"]).

    ``None`` means the Tiny Shakespeare URL. When ``fetch`` is true a URL is downloaded into
    ``out_dir/input.txt``, unless that file exists already and ``out_dir/meta.json`` does not name another
    source (delete it to force a new download).

    Raises:
        FileNotFoundError / IsADirectoryError: a local ``source`` that is not an existing file.
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
        return dest, url
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"source text file {str(path)!r} does not exist (cwd: {os.getcwd()}). Pass an existing UTF-8 "
            "text file (data.source=PATH or --source PATH), or leave the source unset to download Tiny "
            "Shakespeare."
        )
    if not path.is_file():
        raise IsADirectoryError(f"source {str(path)!r} is not a regular file; pass a UTF-8 text file's path")
    path = path.resolve()
    return path, str(path)


def _decode_utf8(raw: bytes, path: Path) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path} is not UTF-8 text: byte {raw[e.start : e.start + 1]!r} at offset {e.start} is invalid "
            f"({e.reason}). Convert the file to UTF-8 first (e.g. `iconv -f latin1 -t utf-8 IN > OUT`) and "
            "pass the converted file."
        ) from e


# ------------------------------------------------------------------------------------------------- API
def prepare(
    source: str | os.PathLike | None,
    out_dir: str | os.PathLike,
    tokenizer: str = "gpt2",
    val_fraction: float = 0.1,
    doc_separator: str | None = None,
) -> dict:
    """Tokenize a UTF-8 text corpus into ``out_dir/{train,val}.bin`` + ``out_dir/meta.json``.

    Args:
        source: path of a UTF-8 text file; an ``http(s)://`` URL (downloaded into ``out_dir/input.txt``,
            reused if that file exists); or ``None`` / ``""`` for Tiny Shakespeare (``TINY_SHAKESPEARE_URL``).
        out_dir: output directory (created if missing).
        tokenizer: ``"gpt2"`` (tiktoken GPT-2 BPE, ``encode_ordinary``, vocab 50257) or ``"char"``
            (vocab = sorted distinct characters of the corpus, stored as ``meta["itos"]``).
        val_fraction: share of the token stream (its end) kept for validation, in (0, 1).
        doc_separator: None, or a string that separates documents in the text (Tiny Shakespeare: "\n\n",
            one speech per document). gpt2: the text is split on it and the documents are joined with the
            end-of-text token (50256) instead; char: the text is kept as it is (no end-of-text token in its
            vocabulary) and the separator's characters mark the boundaries (`data.docs`). The escapes
            \\n, \\t, \\\\ are understood (`data.docs.parse_separator`).

    Returns:
        The meta dict written to ``meta.json``: format_version (1), tokenizer, vocab_size, train_tokens,
        val_tokens, val_fraction, source (absolute path or URL), source_sha256 (of the file's bytes),
        dtype ("uint16"), for char itos, for gpt2 encoding (tiktoken's name) and vocab_sha256
        (``data.tokenizer.vocab_sha256`` of its tokens), and with doc_separator: doc_separator,
        doc_separator_ids (the token ids that end a document) and train_docs / val_docs (documents
        starting in each split).

    Files are written through temporary files and ``os.replace``; a previous ``meta.json`` is removed
    first and the new one written last, so an interrupted run never leaves a directory that looks
    prepared. The corpus is tokenized in memory (fine up to a few hundred MB). When it fails (e.g. a
    download without network), the directories this call created are removed again, with what it wrote
    there; a directory that existed before, or holds other files, is kept.

    Raises:
        ValueError: bad tokenizer / val_fraction, non-UTF-8 or empty corpus, fewer than 2 tokens.
        FileNotFoundError / IsADirectoryError: local ``source`` is not an existing file.
        RuntimeError: download failed (says to pass a local path), or tiktoken's BPE files are unavailable.
    """
    _check_args(tokenizer, val_fraction)
    out = Path(out_dir).expanduser()
    created: list[Path] = []
    with _locked(out, created):
        try:
            return _prepare_into(out, source, tokenizer, val_fraction, doc_separator)
        except BaseException:
            _take_back(created)  # a refused or failed prepare leaves no empty data directory of its own
            raise


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
def _locked(out: Path, created: list[Path]):
    """Create ``out`` and hold an exclusive ``flock`` on the directory itself while the block runs, so
    that launches which start together (a job array, a sweep launcher) prepare a data directory once:
    the first prepares, the others wait here and then find it up to date. The kernel drops the lock when
    its process dies, so a killed prepare never blocks the next one. A directory that was removed and
    created again while we waited (a failed prepare takes back what it created) is locked afresh.
    Where the filesystem has no ``flock`` (some network mounts) the block runs unlocked. The directories
    this process created are appended to ``created`` (deepest first), for ``_take_back``."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - no flock on this platform
        created[:] = _make_dirs(out)
        yield
        return
    while True:
        created[:] = _make_dirs(out)  # what this process made (again, after a retry)
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
            yield
            return
        finally:
            os.close(fd)


def _missing_dirs(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist yet, deepest first (what ``mkdir`` creates)."""
    missing = []
    for p in (path, *path.parents):
        if p.exists() or p.is_symlink():
            break
        missing.append(p)
    return missing


def _take_back(created: list[Path]) -> None:
    """After a failed ``prepare``: remove the directories it created (``created``, deepest first) with the
    files it writes there (download, token files, meta.json). A directory holding anything else is kept,
    and so are those above it; a directory that existed before is never in ``created``."""
    if not created:
        return
    out = created[0]
    for path in (out / DOWNLOAD_NAME, meta_path(out), *(bin_path(out, split) for split in SPLITS)):
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass
    for d in created:
        try:
            d.rmdir()  # only when empty
        except OSError:
            return


def _prepare_into(
    out: Path,
    source: str | os.PathLike | None,
    tokenizer: str,
    val_fraction: float,
    doc_separator: str | None,
) -> dict:
    """``prepare`` into the existing directory ``out``."""
    src_path, src_label = _resolve_source(source, out, fetch=True)

    raw = src_path.read_bytes()
    source_sha256 = hashlib.sha256(raw).hexdigest()
    text = _decode_utf8(raw, src_path)
    if not text:
        raise ValueError(f"{src_path} is empty; pass a non-empty UTF-8 text file")

    tok = make_tokenizer(tokenizer, text=text)
    sep_ids = None
    doc_separator = parse_separator(doc_separator)
    if doc_separator is not None:
        from data.docs import GPT2_EOT, separator_ids

        sep_ids = separator_ids(tokenizer, doc_separator, tok)
    if sep_ids is not None and tokenizer == "gpt2":
        # each non-empty document, then one end-of-text token (it ends the document)
        parts = []
        for doc in text.split(doc_separator):
            if doc:
                part = tok.encode_array(doc)
                parts += [part, np.full(1, GPT2_EOT, dtype=part.dtype)]
        ids = np.concatenate(parts) if parts else tok.encode_array(text)
    else:
        ids = tok.encode_array(text)
    if tok.vocab_size > MAX_VOCAB:  # pragma: no cover - both tokenizers stay below 2**16
        raise ValueError(f"vocab_size {tok.vocab_size} does not fit uint16 token files")
    n_train = split_point(len(ids), val_fraction)
    logger.info(
        "prepare %s: %s tokenizer, %d chars -> %d tokens (%d train / %d val) -> %s",
        src_label,
        tokenizer,
        len(text),
        len(ids),
        n_train,
        len(ids) - n_train,
        out,
    )

    meta_path(out).unlink(missing_ok=True)  # directory is "unprepared" until the new meta lands
    _write_array(bin_path(out, "train"), ids[:n_train])
    _write_array(bin_path(out, "val"), ids[n_train:])
    meta = {
        "format_version": FORMAT_VERSION,
        "tokenizer": tokenizer,
        "vocab_size": int(tok.vocab_size),
        "train_tokens": int(n_train),
        "val_tokens": int(len(ids) - n_train),
        "val_fraction": float(val_fraction),
        "source": src_label,
        "source_sha256": source_sha256,
        "dtype": DTYPE_NAME,
    }
    if tokenizer == "char":
        meta["itos"] = tok.itos
    else:  # what the ids mean: the BPE's name and vocabulary (a resume compares them, trainer/setup.py)
        meta["encoding"] = tok.encoding
        meta["vocab_sha256"] = tok.vocab_sha256()
    if sep_ids is not None:
        from data.docs import separator_ends

        ends = separator_ends(ids, sep_ids)
        meta["doc_separator"] = doc_separator
        meta["doc_separator_ids"] = sep_ids
        # documents starting in each split: position 0 and every position after a separator end
        meta["train_docs"] = 1 + int(ends[: n_train - 1].sum())
        meta["val_docs"] = 1 + int(ends[n_train : len(ids) - 1].sum())
    _write_meta(meta_path(out), meta)
    return meta


def stale_reason(
    source: str | os.PathLike | None,
    out_dir: str | os.PathLike,
    tokenizer: str = "gpt2",
    val_fraction: float = 0.1,
    doc_separator: str | None = None,
) -> str | None:
    """Why ``out_dir`` needs (re-)preparing for these arguments, or ``None`` if it is up to date.

    Up to date means: ``meta.json`` loads (format_version 1), its tokenizer and val_fraction match, both
    ``.bin`` files exist with the sizes it records, and the source matches: for a local file, its SHA-256
    equals ``meta["source_sha256"]``; for a URL (or ``None``), ``meta["source"]`` is that URL and a kept
    ``out_dir/input.txt``, if any, hashes to ``meta["source_sha256"]``. Costs one hash of the source file.

    Raises:
        FileNotFoundError / IsADirectoryError: local ``source`` is not an existing file.
    """
    out = Path(out_dir).expanduser()
    src_path, src_label = _resolve_source(source, out, fetch=False)
    if not (out / META_NAME).is_file():
        return "not prepared yet"
    try:
        meta = load_meta(out)
    except (FileNotFoundError, ValueError) as e:
        return f"no usable {META_NAME} ({e})"
    if meta["tokenizer"] != tokenizer:
        return f"{META_NAME} is for tokenizer {meta['tokenizer']!r}, requested {tokenizer!r}"
    doc_separator = parse_separator(doc_separator)
    if meta.get("doc_separator") != doc_separator:
        return f"{META_NAME} has doc_separator={meta.get('doc_separator')!r}, requested {doc_separator!r}"
    old_fraction = meta.get("val_fraction")
    if old_fraction is None or not math.isclose(float(old_fraction), float(val_fraction), abs_tol=1e-12):
        return f"{META_NAME} has val_fraction={old_fraction!r}, requested {val_fraction!r}"
    for split in SPLITS:
        try:
            check_bin_file(bin_path(out, split), meta[f"{split}_tokens"])
        except (FileNotFoundError, ValueError) as e:
            return str(e)
    if _is_url(src_label):
        if meta["source"] != src_label:
            return f"{META_NAME} was prepared from {meta['source']!r}, requested {src_label!r}"
        if not src_path.is_file():
            return None  # the download was deleted; the token files are still valid
    sha = sha256_file(src_path)
    if sha != meta["source_sha256"]:
        return (
            f"{src_path} has sha256 {sha[:12]}..., but {META_NAME} was prepared from content with sha256 "
            f"{str(meta['source_sha256'])[:12]}... (source changed)"
        )
    return None


def ensure_prepared(
    source: str | os.PathLike | None,
    out_dir: str | os.PathLike,
    tokenizer: str = "gpt2",
    val_fraction: float = 0.1,
    doc_separator: str | None = None,
    *,
    keep_other: bool = False,
) -> dict:
    """Return ``out_dir``'s meta dict, running ``prepare`` first only if it is missing or stale.

    Staleness is decided by ``stale_reason`` (missing/broken files, other tokenizer, other
    val_fraction, or a source whose SHA-256 differs); the reason is logged (INFO) before re-preparing.
    When up to date nothing is re-tokenized or rewritten (file mtimes are unchanged).

    The check and the prepare run under an exclusive lock on the directory (``_locked``): of several
    processes that start at once on a directory not prepared yet, one prepares and the others wait for
    it, then return its meta. With ``keep_other=True`` (the trainer) a directory that another process
    has meanwhile prepared with other arguments (``conflict_reason``) is an error, not re-prepared: runs
    read it. In distributed training call it on one rank, then barrier.

    Raises:
        Same as ``prepare``; ValueError naming what the directory holds (``keep_other``).
    """
    _check_args(tokenizer, val_fraction)
    out = Path(out_dir).expanduser()
    created: list[Path] = []
    with _locked(out, created):
        try:  # taken back under the lock: a waiter never starts on files about to be removed
            reason = stale_reason(source, out, tokenizer, val_fraction, doc_separator)
            if reason is None:
                logger.info("data in %s is up to date", out_dir)
                return load_meta(out)
            held = (
                conflict_reason(source, out, tokenizer, val_fraction, doc_separator) if keep_other else None
            )
            if held:
                raise ValueError(
                    f"{out_dir} now holds {held} (prepared by another process meanwhile); runs read it, so "
                    "it is not prepared again: use a data.dir of its own"
                )
            logger.info("preparing data in %s: %s", out_dir, reason)
            return _prepare_into(out, source, tokenizer, val_fraction, doc_separator)
        except BaseException:
            _take_back(created)
            raise


def conflict_reason(
    source: str | os.PathLike | None,
    out_dir: str | os.PathLike,
    tokenizer: str = "gpt2",
    val_fraction: float = 0.1,
    doc_separator: str | None = None,
) -> str | None:
    """What ``out_dir`` already holds that preparing these arguments there would replace, or None.

    A directory with a loadable ``meta.json`` holds data that runs read (and resume from): preparing
    another tokenizer, document separator, split or corpus there would swap it under them. None when
    ``out_dir`` is not prepared (or its meta.json is broken) or holds exactly these arguments' data.

    Raises:
        FileNotFoundError / IsADirectoryError: local ``source`` is not an existing file.
    """
    out = Path(out_dir).expanduser()
    try:
        meta = load_meta(out)
    except (FileNotFoundError, ValueError):
        return None
    src_path, src_label = _resolve_source(source, out, fetch=False)
    doc_separator = parse_separator(doc_separator)
    if meta["tokenizer"] != tokenizer:
        return (
            f"data tokenized with {meta['tokenizer']!r} (vocab_size {meta['vocab_size']}), not {tokenizer!r}"
        )
    if meta.get("doc_separator") != doc_separator:
        return f"data prepared with doc_separator={meta.get('doc_separator')!r}, not {doc_separator!r}"
    old_fraction = meta.get("val_fraction")
    if old_fraction is not None and not math.isclose(float(old_fraction), float(val_fraction), abs_tol=1e-12):
        return f"data split with val_fraction={old_fraction}, not {val_fraction}"
    if _is_url(src_label):
        if meta["source"] != src_label:
            return f"data prepared from {meta['source']}, not {src_label}"
    elif sha256_file(src_path) != meta["source_sha256"]:
        return f"data prepared from {meta['source']} (another text than {src_label})"
    return None


# ------------------------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the process exit status (0 ok, 1 error with a message on stderr)."""
    parser = argparse.ArgumentParser(
        prog="python -m data.prepare",
        description="Tokenize a UTF-8 text corpus into train.bin / val.bin (uint16) + meta.json.",
    )
    parser.add_argument(
        "--source",
        default=None,
        help="UTF-8 text file or http(s) URL (default: download Tiny Shakespeare into OUT_DIR/input.txt)",
    )
    parser.add_argument(
        "--out-dir",
        default=None,
        help="output directory (default: data/shakespeare for gpt2, data/shakespeare_char for char)",
    )
    parser.add_argument("--tokenizer", choices=TOKENIZERS, default="gpt2")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="share of tokens for val (0.1)")
    parser.add_argument(
        "--doc-separator",
        default=None,
        help="string between documents, e.g. $'\\n\\n' (records document starts for "
        "document masking; gpt2 writes <|endoftext|> between documents)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace data of another tokenizer, corpus, split or separator already in OUT_DIR",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    out_dir = args.out_dir if args.out_dir is not None else DEFAULT_OUT_DIRS[args.tokenizer]
    try:
        held = conflict_reason(args.source, out_dir, args.tokenizer, args.val_fraction, args.doc_separator)
        if held and not args.force:
            other = Path(out_dir).parent / f"{Path(out_dir).name}_{args.tokenizer}"
            print(
                f"error: {out_dir} already holds {held}; preparing there would replace the train.bin / "
                f"val.bin / meta.json that runs of it read. Use another --out-dir (e.g. --out-dir {other}), "
                "or add --force to replace it",
                file=sys.stderr,
            )
            return 1
        meta = prepare(args.source, out_dir, args.tokenizer, args.val_fraction, args.doc_separator)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(
        f"wrote {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens "
        f"(tokenizer {meta['tokenizer']}, vocab_size {meta['vocab_size']}) to {Path(out_dir)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
