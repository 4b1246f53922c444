"""On-disk format of a prepared data directory, and the checks that read it back.

Format 2 (what ``data.prepare`` writes):

- ``{split}_{k:06d}.bin``: shard k of a split's token stream, raw little-endian ``uint16`` (vocabulary up
  to 65,536) or ``uint32`` token ids, ``shard_tokens`` tokens each but the last; the split's stream is
  the shards concatenated (a document may cross a shard boundary).
- ``{split}_{k:06d}.idx``: the document index of that shard: int64 little-endian offsets (in the shard)
  where a document starts.
- ``meta.json`` (written last)::

      {"format_version": 2, "tokenizer", "vocab_size", "train_tokens", "val_tokens", "val_fraction",
       "source", "source_sha256", "dtype": "uint16" | "uint32", "shard_tokens": int,
       "shards": {"train": [{"file": "train_000000.bin", "tokens": int, "docs": int,
                             "index": "train_000000.idx"}, ...], "val": [...]},
       "source_kind": "text" | "docs", "text_field", "max_tokens", "source_fingerprint" (docs kind),
       "doc_separator", "doc_separator_ids", "train_docs", "val_docs", "itos" | "encoding"/"vocab_sha256"}

Format 1 (prepared by earlier versions, still read):

- ``train.bin`` / ``val.bin``: the token stream's first / last part as raw little-endian ``uint16``
  token ids (no header), so a file of ``n`` tokens is exactly ``2 * n`` bytes.
- ``meta.json`` (written last, so its presence means the bins are complete)::

      {"format_version": 1, "tokenizer": "gpt2" | "char", "vocab_size": int,
       "train_tokens": int, "val_tokens": int, "val_fraction": float,
       "source": path or URL, "source_sha256": hex str, "dtype": "uint16",
       "itos": [sorted characters]   # only for tokenizer "char": id i <-> itos[i]
       "encoding": "gpt2", "vocab_sha256": hex str   # only for "gpt2": the BPE's name and vocabulary
      }
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np

FORMAT_VERSION = 2
READ_VERSIONS = (1, 2)
TOKEN_DTYPE = np.dtype("<u2")  # little-endian uint16 on disk, whatever the machine (format 1)
DTYPE_NAME = "uint16"
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
META_NAME = "meta.json"
SPLITS = ("train", "val")
REQUIRED_KEYS = (
    "format_version",
    "tokenizer",
    "vocab_size",
    "train_tokens",
    "val_tokens",
    "source",
    "source_sha256",
    "dtype",
)

PREPARE_HINT = "python -m data.prepare --source PATH --out-dir DIR --tokenizer gpt2|char"


def meta_path(data_dir: str | os.PathLike) -> Path:
    """Path of ``meta.json`` inside ``data_dir``."""
    return Path(data_dir) / META_NAME


def bin_path(data_dir: str | os.PathLike, split: str) -> Path:
    """Path of ``{split}.bin`` inside ``data_dir``; ``split`` is ``"train"`` or ``"val"``.

    Raises:
        ValueError: unknown split.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {SPLITS}")
    return Path(data_dir) / f"{split}.bin"


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


def write_json(path: Path, obj: dict) -> None:
    """``obj`` as indented JSON into ``path``, atomically (``atomic_write``)."""
    payload = (json.dumps(obj, indent=2) + "\n").encode("utf-8")
    atomic_write(path, lambda f: f.write(payload))


def load_meta(data_dir: str | os.PathLike) -> dict:
    """Read and validate ``data_dir/meta.json``.

    Returns:
        The meta dict (keys listed in this module's docstring).

    Raises:
        FileNotFoundError: no ``meta.json`` (directory never prepared, or a prepare was interrupted);
            the message says how to prepare it.
        ValueError: unreadable JSON, wrong ``format_version``, missing keys, unknown tokenizer or dtype;
            the message says to delete the directory's files and re-run the prepare step.
    """
    path = meta_path(data_dir)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: {data_dir} is not a prepared data directory (never prepared, or a prepare "
            f"step was interrupted). Prepare it with `{PREPARE_HINT}` or data.prepare.ensure_prepared(...)."
        )
    redo = f"Delete {path} and the .bin files next to it, then re-run `{PREPARE_HINT}`."
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}). {redo}") from e
    if not isinstance(meta, dict):
        raise ValueError(f"{path} holds a {type(meta).__name__}, expected a JSON object. {redo}")
    version = meta.get("format_version")
    if version not in READ_VERSIONS:
        raise ValueError(
            f"{path} has format_version={version!r}, but this code reads format_version "
            f"{' or '.join(map(str, READ_VERSIONS))}. {redo}"
        )
    missing = [
        k for k in REQUIRED_KEYS + (("shards", "shard_tokens") if version == 2 else ()) if k not in meta
    ]
    if missing:
        raise ValueError(f"{path} lacks keys {missing}. {redo}")
    allowed = tuple(DTYPES) if version == 2 else (DTYPE_NAME,)
    if meta["dtype"] not in allowed:
        raise ValueError(f"{path} says dtype={meta['dtype']!r}; supported: {allowed}. {redo}")
    if version == 2:
        for split in SPLITS:
            shards = meta["shards"].get(split) if isinstance(meta["shards"], dict) else None
            if (
                not isinstance(shards, list)
                or sum(int(s.get("tokens", -1)) for s in shards) != meta[f"{split}_tokens"]
            ):
                raise ValueError(f"{path}: its {split} shards do not add up to {split}_tokens. {redo}")
    if meta["tokenizer"] not in ("gpt2", "char"):
        raise ValueError(f"{path} names unknown tokenizer {meta['tokenizer']!r}. {redo}")
    if meta["tokenizer"] == "char" and not isinstance(meta.get("itos"), list):
        raise ValueError(f"{path} is for tokenizer 'char' but lacks the character list 'itos'. {redo}")
    for key in ("vocab_size", "train_tokens", "val_tokens"):
        if not isinstance(meta[key], int) or isinstance(meta[key], bool) or meta[key] < 0:
            raise ValueError(f"{path}: {key}={meta[key]!r} is not a non-negative integer. {redo}")
    return meta


def token_dtype(meta: dict) -> np.dtype:
    """The numpy dtype of a prepared directory's token files (little-endian uint16 or uint32)."""
    return DTYPES[meta["dtype"]]


def split_shards(data_dir: str | os.PathLike, meta: dict, split: str) -> list[tuple[Path, int, Path | None]]:
    """(token file, tokens, document index file or None) of each shard of ``split``, in stream order;
    a format-1 directory has one shard per split (``{split}.bin``) and no index."""
    if meta["format_version"] == 1:
        return [(bin_path(data_dir, split), int(meta[f"{split}_tokens"]), None)]
    d = Path(data_dir)
    return [
        (d / s["file"], int(s["tokens"]), d / s["index"] if s.get("index") else None)
        for s in meta["shards"][split]
    ]


def check_bin_file(path: str | os.PathLike, num_tokens: int, dtype: np.dtype = TOKEN_DTYPE) -> None:
    """Check that the token file ``path`` exists and is exactly ``num_tokens * itemsize`` bytes.

    Raises:
        FileNotFoundError: the file is missing (message: re-run the prepare step).
        ValueError: the size differs (truncated file, or a ``meta.json`` from another prepare run);
            the message names the file, both sizes, and says to delete it and re-run the prepare step.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found although {path.parent / META_NAME} exists. Delete {path.parent / META_NAME} "
            f"and re-run `{PREPARE_HINT}`."
        )
    size = path.stat().st_size
    expected = num_tokens * dtype.itemsize
    if size != expected:
        raise ValueError(
            f"{path} is {size} bytes, but {path.parent / META_NAME} says it holds {num_tokens} "
            f"{dtype.name} tokens "
            f"= {expected} bytes: the file is truncated or was written by another prepare run. Delete {path} "
            f"and {path.parent / META_NAME}, then re-run `{PREPARE_HINT}`."
        )


def tokens_digest(data_dir: str | os.PathLike, meta: dict, samples: int = 16, block: int = 4096) -> str:
    """SHA-256 over every shard's name and size and ``samples`` evenly spaced blocks of its bytes (all of a
    shard up to ``samples * block`` bytes): what a checkpoint records of the tokens it trained on, so a
    resume can tell token files replaced behind an unchanged meta.json, at a cost that does not grow with
    a shard's length (64 KiB read per shard)."""
    import hashlib

    h = hashlib.sha256()
    for split in ("train", "val"):
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
