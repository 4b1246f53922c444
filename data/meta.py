"""On-disk format of a prepared data directory (format 2, what ``data.prepare`` writes), and its checks.

- ``{split}_{k:06d}.bin``: shard k of a split's token stream, raw little-endian ``uint16`` or ``uint32``
  ids, ``shard_tokens`` each but the last; the split is the shards concatenated (documents cross them).
- ``{split}_{k:06d}.idx``: int64 little-endian offsets (in the shard) where a document starts.
- ``meta.json`` (written last, so its presence means the shards are complete)::

      {"format_version": 2, "tokenizer", "vocab_size", "train_tokens", "val_tokens", "val_fraction",
       "source", "source_sha256", "dtype": "uint16" | "uint32", "shard_tokens": int,
       "shards": {"train": [{"file": "train_000000.bin", "tokens": int, "docs": int,
                             "index": "train_000000.idx"}, ...], "val": [...]},
       "source_kind": "text" | "docs", "text_field", "max_tokens", "source_fingerprint" (docs kind),
       "doc_separator", "doc_separator_ids", "train_docs", "val_docs", "itos" | "encoding"/"vocab_sha256"}
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np

FORMAT_VERSION = 2
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
META_NAME = "meta.json"
SPLITS = ("train", "val")
REQUIRED_KEYS = "format_version tokenizer vocab_size train_tokens val_tokens source source_sha256".split()
REQUIRED_KEYS += ["dtype", "shard_tokens", "shards"]
_FULL_ID_CHECK_TOKENS = 1 << 24  # check every id of shards up to 16M tokens ...
_PARTIAL_ID_CHECK_TOKENS = 1 << 20  # ... else the first and last 1M ids


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write ``path`` through a hidden temporary file beside it, then ``os.replace`` it: a killed process
    leaves at most a ``.tmp-*`` file, never a partial ``path``."""
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


def write_json(path: Path, obj: dict) -> None:
    payload = (json.dumps(obj, indent=2) + "\n").encode("utf-8")
    atomic_write(path, lambda f: f.write(payload))


def load_meta(data_dir: str | os.PathLike) -> dict:
    """Read and validate ``data_dir/meta.json``: FileNotFoundError when absent, ValueError when unreadable,
    of another format or inconsistent (a caller that cannot prepare it adds ``prepare_command``)."""
    path = Path(data_dir) / META_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: {data_dir} is not a prepared data directory (never prepared, or a prepare "
            "step was interrupted)."
        )
    redo = "The directory must be prepared again."
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}). {redo}") from e
    if not isinstance(meta, dict):
        raise ValueError(f"{path} holds a {type(meta).__name__}, expected a JSON object. {redo}")
    version = meta.get("format_version")
    if version == 1:
        raise ValueError(
            f"{data_dir} was prepared with an older flashgpt (format_version 1: train.bin / val.bin), which "
            f"this one no longer reads: delete {data_dir} to prepare it again, or set data.dir=<a new "
            "folder> (--out-dir) to prepare the corpus there"
        )
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{path} has format_version={version!r}, but this code reads format_version "
            f"{FORMAT_VERSION}. {redo}"
        )
    if missing := [k for k in REQUIRED_KEYS if k not in meta]:
        raise ValueError(f"{path} lacks keys {missing}. {redo}")
    if meta["dtype"] not in DTYPES:
        raise ValueError(f"{path} says dtype={meta['dtype']!r}; supported: {tuple(DTYPES)}. {redo}")
    for split in SPLITS:
        shards = meta["shards"].get(split) if isinstance(meta["shards"], dict) else None
        total = sum(int(s.get("tokens", -1)) for s in shards) if isinstance(shards, list) else None
        if total is None or total != meta[f"{split}_tokens"]:
            raise ValueError(f"{path}: its {split} shards do not add up to {split}_tokens. {redo}")
    if meta["tokenizer"] not in ("gpt2", "char"):
        raise ValueError(f"{path} names unknown tokenizer {meta['tokenizer']!r}. {redo}")
    if meta["tokenizer"] == "char" and not isinstance(meta.get("itos"), list):
        raise ValueError(f"{path} is for tokenizer 'char' but lacks the character list 'itos'. {redo}")
    for key in ("vocab_size", "train_tokens", "val_tokens"):
        if not isinstance(meta[key], int) or isinstance(meta[key], bool) or meta[key] < 0:
            raise ValueError(f"{path}: {key}={meta[key]!r} is not a non-negative integer. {redo}")
    return meta


def split_shards(data_dir: str | os.PathLike, meta: dict, split: str) -> list[tuple[Path, int, Path]]:
    """(token file, tokens, document index file) of each shard of ``split``, in stream order."""
    d = Path(data_dir)
    return [(d / s["file"], int(s["tokens"]), d / s["index"]) for s in meta["shards"][split]]


def check_shards(data_dir, meta: dict, splits=SPLITS, check_ids: bool = True) -> list[tuple[Path, int, Path]]:
    """``split_shards`` of ``splits``, each token file checked: it exists, is exactly its tokens * itemsize
    bytes and (``check_ids``) holds no id >= vocab_size (``_max_id``), else FileNotFoundError / ValueError
    saying what is wrong."""
    shards = [s for split in splits for s in split_shards(data_dir, meta, split)]
    dtype = DTYPES[meta["dtype"]]
    for path, n, _ in shards:
        where = path.parent / META_NAME
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found although {where} exists")
        st = path.stat()
        if st.st_size != n * dtype.itemsize:
            raise ValueError(
                f"{path} is {st.st_size} bytes, but {where} says it holds {n} {dtype.name} tokens = "
                f"{n * dtype.itemsize} bytes: the file is truncated or was written by another prepare run"
            )
        if not check_ids:
            continue
        top = _max_id(os.path.realpath(path), n, dtype.str, st.st_size, st.st_mtime_ns, st.st_ino)
        if top >= meta["vocab_size"]:
            raise ValueError(
                f"{path} holds token id {top}, but {where} says vocab_size={meta['vocab_size']}: the file is "
                "corrupt or was written by another prepare run"
            )
    return shards


@functools.lru_cache(maxsize=256)
def _max_id(path: str, n: int, dtype: str, *_stat) -> int:
    """The largest id of a token file (-1 when empty): of every id up to 16M tokens, else of the first and
    last 1M. Read once per process while the file's size, mtime and inode (``_stat``) stay (a launch checks
    the data before preparing and again when it loads them)."""
    if n == 0:
        return -1
    data, k = np.memmap(path, dtype=dtype, mode="r", shape=(n,)), _PARTIAL_ID_CHECK_TOKENS
    return int((data if n <= _FULL_ID_CHECK_TOKENS else np.concatenate([data[:k], data[-k:]])).max())


def tokens_digest(data_dir: str | os.PathLike, meta: dict, samples: int = 16, block: int = 4096) -> str:
    """SHA-256 over every shard's name and size and ``samples`` evenly spaced blocks of its bytes: what a
    checkpoint records of its tokens, so a resume can tell token files replaced behind an unchanged
    meta.json, reading 64 KiB per shard whatever its length."""
    h = hashlib.sha256()
    for split in SPLITS:
        for path, _, _ in split_shards(data_dir, meta, split):
            size = path.stat().st_size
            h.update(f"{split}/{path.name}:{size};".encode())
            with open(path, "rb") as f:
                if size <= samples * block:
                    h.update(f.read())
                    continue
                for i in range(samples):
                    f.seek((size - block) * i // (samples - 1))
                    h.update(f.read(block))
    return h.hexdigest()
