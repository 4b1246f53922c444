"""On-disk format of a prepared data directory, and the checks that read it back.

A prepared directory holds (format_version 1):

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
from pathlib import Path

import numpy as np

FORMAT_VERSION = 1
TOKEN_DTYPE = np.dtype("<u2")  # little-endian uint16 on disk, whatever the machine
DTYPE_NAME = "uint16"
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
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{path} has format_version={version!r}, but this code reads format_version={FORMAT_VERSION}. "
            f"{redo}"
        )
    missing = [k for k in REQUIRED_KEYS if k not in meta]
    if missing:
        raise ValueError(f"{path} lacks keys {missing}. {redo}")
    if meta["dtype"] != DTYPE_NAME:
        raise ValueError(f"{path} says dtype={meta['dtype']!r}; only {DTYPE_NAME!r} is supported. {redo}")
    if meta["tokenizer"] not in ("gpt2", "char"):
        raise ValueError(f"{path} names unknown tokenizer {meta['tokenizer']!r}. {redo}")
    if meta["tokenizer"] == "char" and not isinstance(meta.get("itos"), list):
        raise ValueError(f"{path} is for tokenizer 'char' but lacks the character list 'itos'. {redo}")
    for key in ("vocab_size", "train_tokens", "val_tokens"):
        if not isinstance(meta[key], int) or isinstance(meta[key], bool) or meta[key] < 0:
            raise ValueError(f"{path}: {key}={meta[key]!r} is not a non-negative integer. {redo}")
    return meta


def check_bin_file(path: str | os.PathLike, num_tokens: int) -> None:
    """Check that the token file ``path`` exists and is exactly ``num_tokens * 2`` bytes.

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
    expected = num_tokens * TOKEN_DTYPE.itemsize
    if size != expected:
        raise ValueError(
            f"{path} is {size} bytes, but {path.parent / META_NAME} says it holds {num_tokens} uint16 tokens "
            f"= {expected} bytes: the file is truncated or was written by another prepare run. Delete {path} "
            f"and {path.parent / META_NAME}, then re-run `{PREPARE_HINT}`."
        )
