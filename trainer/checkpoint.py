"""Atomic checkpoints: write a temp file, flush + fsync, rename; keep the newest N; load the newest good one.

Layout: ``<out_dir>/ckpt/step_00000100.pt`` (``step`` = optimizer steps completed). A save that dies midway
(crash, full disk, a second signal) leaves at most a ``.tmp-<pid>-step_*.pt`` file, which is never read and
is removed by a later save once process <pid> is gone (a live process's temp file is left alone); the
previous checkpoints are untouched because ``os.replace`` is atomic on POSIX.

A checkpoint is a dict saved with ``torch.save`` that loads with ``torch.load(weights_only=True)`` (only
tensors, numbers, strings, lists, tuples, dicts): model and optimizer state dicts, step, data position,
RNG states (as tensors), the resolved config and the W&B run id. See ``trainer/loop.py`` for the keys.

Checkpoints stand alone for sampling: ``state["tokenizer"]`` (``tokenizer_record``) holds the tokenizer's
name, vocab size and, for the char tokenizer, its character list ``itos``, so ``tokenizer_from_checkpoint``
rebuilds the tokenizer without the data directory. Checkpoints written before ``itos`` was stored fall back
to the ``meta.json`` of the data directory named in their config.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

import numpy as np
import torch

from data.prepare import atomic_write

CKPT_DIR_NAME = "ckpt"
_NAME_RE = re.compile(r"^step_(\d+)\.pt$")


def ckpt_dir(out_dir: str | os.PathLike) -> Path:
    """``<out_dir>/ckpt``."""
    return Path(out_dir) / CKPT_DIR_NAME


def ckpt_path(out_dir: str | os.PathLike, step: int) -> Path:
    """Path of the checkpoint for ``step`` completed optimizer steps."""
    return ckpt_dir(out_dir) / f"step_{step:08d}.pt"


def list_checkpoints(out_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every finished checkpoint in ``<out_dir>/ckpt``, newest (highest step) first."""
    d = ckpt_dir(out_dir)
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        m = _NAME_RE.match(p.name)
        if m and p.is_file():
            found.append((int(m.group(1)), p))
    return sorted(found, reverse=True)


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def save_checkpoint(state: dict, out_dir: str | os.PathLike, step: int, keep: int) -> Path:
    """Save ``state`` atomically as ``<out_dir>/ckpt/step_{step:08d}.pt`` and keep only the newest ``keep``.

    Algorithm: ``torch.save`` into ``.tmp-<pid>-step_N.pt`` in the same folder, ``flush`` + ``os.fsync``,
    ``os.replace`` onto the final name, fsync the folder; only then delete checkpoints beyond ``keep``
    and stale temp files (this process's or a dead process's, never a live writer's). If anything
    raises before the rename, the temp file is deleted and the error
    re-raised: existing checkpoints are never touched by a failed save.

    Returns the checkpoint path. Raises whatever torch.save / the filesystem raise (OSError for a full disk).
    """
    d = ckpt_dir(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    final = ckpt_path(out_dir, step)
    atomic_write(final, lambda f: torch.save(state, f))
    _fsync_dir(d)
    for _, old in list_checkpoints(out_dir)[keep:]:
        old.unlink(missing_ok=True)
    for stale in d.glob(".tmp-*-step_*.pt"):  # left by a process killed mid-save
        if _stale_temp(stale):
            stale.unlink(missing_ok=True)
    return final


def _stale_temp(path: Path) -> bool:
    """True for a temp file of ours or of a dead process (``.tmp-<pid>-...``): a live process's temp
    file is its checkpoint being written, never ours to delete."""
    pid = path.name.split("-")[1] if path.name.count("-") >= 2 else ""
    if not pid.isdigit():
        return False
    if int(pid) == os.getpid():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: alive, another user's
        return False
    return False


def load_checkpoint(path: str | os.PathLike, map_location="cpu") -> dict:
    """``torch.load(path, weights_only=True)``; raises on a truncated/corrupt file (RuntimeError, EOFError,
    ValueError for a file that is not a flashgpt checkpoint)."""
    state = torch.load(path, map_location=map_location, weights_only=True)
    if not isinstance(state, dict) or "model" not in state or "step" not in state:
        raise ValueError(f"{path} is not a flashgpt checkpoint (no 'model'/'step' entries)")
    return state


def load_newest(
    out_dir: str | os.PathLike, map_location="cpu", warn=print
) -> tuple[Path | None, dict | None]:
    """The newest checkpoint of ``out_dir`` that loads, as (path, state); (None, None) if there is none.

    Unloadable files (truncated, corrupt) are skipped with a warning naming them, and the next older one
    is tried.
    """
    for _, path in list_checkpoints(out_dir):
        try:
            return path, load_checkpoint(path, map_location)
        except Exception as e:  # noqa: BLE001 - any unreadable file: fall back to an older one
            warn(f"warning: checkpoint {path} does not load ({type(e).__name__}: {e}); trying an older one")
    return None, None


# ------------------------------------------------------------------------------------------- tokenizer


def tokenizer_record(meta: dict) -> dict:
    """``state["tokenizer"]`` for a data directory's ``meta`` (``data.meta.load_meta``):
    ``{"name", "vocab_size"}`` plus ``"itos"`` (list of single-character str) for the char tokenizer."""
    record = {"name": str(meta["tokenizer"]), "vocab_size": int(meta["vocab_size"])}
    if meta["tokenizer"] == "char":
        record["itos"] = list(meta["itos"])
    return record


def tokenizer_from_checkpoint(state: dict, data_dir: str | os.PathLike | None = None):
    """The tokenizer a checkpoint's tokens were made with (``.encode``, ``.decode``, ``.vocab_size``).

    Uses ``state["tokenizer"]`` when it is complete (GPT-2: the name; char: the name and ``itos``). An
    older checkpoint without ``itos`` falls back to ``<data_dir>/meta.json``, where ``data_dir`` defaults to
    the ``data.dir`` of the checkpoint's resolved config (relative to the current directory).

    Raises:
        ValueError: the checkpoint names no tokenizer, or its char vocabulary is in neither the checkpoint
            nor a readable ``meta.json`` (the message names both places), or the meta.json's tokenizer or
            vocab size differs from the checkpoint's.
        RuntimeError: tiktoken's GPT-2 files cannot be loaded (offline without ``TIKTOKEN_CACHE_DIR``).
    """
    from data.meta import load_meta
    from data.tokenizer import make_tokenizer

    record = state.get("tokenizer")
    if not isinstance(record, dict) or "name" not in record:
        raise ValueError(
            "the checkpoint names no tokenizer (no state['tokenizer']['name']); it was not "
            "written by flashgpt's trainer"
        )
    name, vocab = record["name"], record.get("vocab_size")
    if name == "gpt2":
        tok = make_tokenizer("gpt2")
    elif name == "char" and record.get("itos") is not None:
        tok = make_tokenizer("char", itos=record["itos"])
    elif name == "char":
        # written before checkpoints carried the vocabulary: only the data directory has it
        if data_dir is None:
            data_dir = ((state.get("config") or {}).get("data") or {}).get("dir")
        if data_dir is None:
            raise ValueError(
                "the checkpoint's char vocabulary is not in the checkpoint (an older one) and "
                "its config names no data.dir; pass the data directory it was trained on"
            )
        try:
            meta = load_meta(data_dir)
        except (OSError, ValueError) as e:
            raise ValueError(
                f"the checkpoint's char vocabulary is not in the checkpoint (written before checkpoints held "
                f"it) and the data directory's meta.json cannot be read: {e}. Point data_dir at the data "
                "directory the run was trained on (train.py data.dir=...), or re-save the checkpoint with "
                "this trainer (resume it)"
            ) from e
        if meta["tokenizer"] != "char":
            raise ValueError(
                f"{data_dir}/meta.json is for tokenizer {meta['tokenizer']!r}, but the "
                "checkpoint was trained with 'char'; point data_dir at the run's own data dir"
            )
        tok = make_tokenizer("char", itos=meta["itos"])
    else:
        raise ValueError(f"the checkpoint names unknown tokenizer {name!r}")
    if vocab is not None and tok.vocab_size != int(vocab):
        raise ValueError(
            f"the checkpoint's tokenizer has vocab_size={vocab}, but the rebuilt {name} "
            f"tokenizer has {tok.vocab_size}: the data directory's vocabulary is not the one "
            "it trained on"
        )
    return tok


# ------------------------------------------------------------------------------------------- RNG state


def rng_state() -> dict:
    """This process's RNG states (torch CPU, CUDA (all devices), numpy global, python ``random``) as
    ``weights_only``-loadable values (tensors, ints, tuples)."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *map(_plain, np_state[2:])),
        "python": (py_state[0], list(py_state[1]), py_state[2]),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _plain(x):
    return x.item() if hasattr(x, "item") else x


def set_rng_state(state: dict) -> None:
    """Restore states saved by ``rng_state``."""
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
