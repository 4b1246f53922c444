"""Atomic checkpoints: write a temp file, flush + fsync, rename; keep the newest N; load the newest good one.

Layout: ``<out_dir>/ckpt/step_00000100.pt`` (``step`` = optimizer steps completed). A save that dies midway
(crash, full disk, a second signal) leaves at most a ``.tmp-<pid>-step_*.pt`` file, which is never read and
is removed by a later save once process <pid> is gone (a live process's temp file is left alone); the
previous checkpoints are untouched because ``os.replace`` is atomic on POSIX.

A checkpoint is a dict saved with ``torch.save`` that loads with ``torch.load(weights_only=True)`` (only
tensors, numbers, strings, lists, tuples, dicts): model and optimizer state dicts, step, data position,
RNG states (as tensors), the resolved config and the W&B run id. See ``trainer/loop.py`` for the keys.

``parallel=fsdp`` runs write DCP checkpoints instead (``torch.distributed.checkpoint``): a directory
``<out_dir>/ckpt/step_00000100/`` where every rank writes its shards of the model and optimizer
(``__<rank>_0.distcp``), the coordinator (rank 0) DCP's ``.metadata``, and rank 0 ``flashgpt.pt``, the
record of everything else (step, RNG states of every rank, config, model_args, tokenizer, W&B id: the keys
of a single-file checkpoint minus ``model`` / ``optimizer``). It is written as ``.tmp-<pid>-step_N/`` and
renamed when complete (``save_dcp_checkpoint``), so the same guarantees hold. DCP stores each tensor with
its global shape, so a directory saved at one world size loads at another (``load_dcp_into``), into a
sharded (FSDP2) or a plain model, and without any process group (sample.py, eval.py, one-process resumes).
Conversions: single file -> DCP run (a ddp/one-process run resumed with ``parallel=fsdp``: the trainer
loads the file into the plain model before sharding it, see trainer/build.py) and DCP -> any run or
inference; a DCP directory can also be turned into one ``torch.save`` file with
``python -m torch.distributed.checkpoint.format_utils dcp_to_torch DIR OUT.pt`` (its keys: ``model``,
``optimizer``; not a flashgpt single-file checkpoint, whose other keys are in ``flashgpt.pt``).

Checkpoints stand alone for sampling: ``state["tokenizer"]`` (``tokenizer_record``) holds the tokenizer's
name, vocab size and, for the char tokenizer, its character list ``itos``, so ``tokenizer_from_checkpoint``
rebuilds the tokenizer without the data directory. Checkpoints written before ``itos`` was stored fall back
to the ``meta.json`` of the data directory named in their config.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from data.prepare import atomic_write

CKPT_DIR_NAME = "ckpt"
_NAME_RE = re.compile(r"^step_(\d+)\.pt$")
_DIR_RE = re.compile(r"^step_(\d+)$")
#: rank 0's record inside a DCP checkpoint directory (step, config, RNG states ...; no tensors of the model)
DCP_RECORD = "flashgpt.pt"


def ckpt_dir(out_dir: str | os.PathLike) -> Path:
    """``<out_dir>/ckpt``."""
    return Path(out_dir) / CKPT_DIR_NAME


def ckpt_path(out_dir: str | os.PathLike, step: int, dcp: bool = False) -> Path:
    """Path of the checkpoint for ``step`` completed optimizer steps: ``step_N.pt`` (a file), or the
    directory ``step_N`` with ``dcp=True``."""
    return ckpt_dir(out_dir) / (f"step_{step:08d}" if dcp else f"step_{step:08d}.pt")


def is_dcp(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a DCP checkpoint directory (rather than a single-file checkpoint)."""
    return Path(path).is_dir()


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The step in a checkpoint's name (``step_N.pt`` or ``step_N``), or None for another name."""
    name = Path(path).name
    m = _NAME_RE.match(name) or _DIR_RE.match(name)
    return int(m.group(1)) if m else None


def list_checkpoints(out_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every finished checkpoint in ``<out_dir>/ckpt`` (files ``step_N.pt`` and DCP
    directories ``step_N``), newest (highest step) first."""
    d = ckpt_dir(out_dir)
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        m = _NAME_RE.match(p.name)
        if m and p.is_file():
            found.append((int(m.group(1)), p))
        m = _DIR_RE.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found, reverse=True)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _prune(out_dir: str | os.PathLike, keep: int) -> None:
    """Delete checkpoints beyond the newest ``keep`` and stale temp files / directories."""
    d = ckpt_dir(out_dir)
    for _, old in list_checkpoints(out_dir)[keep:]:
        _remove(old)
    for stale in d.glob(".tmp-*-step_*"):  # left by a process killed mid-save
        if _stale_temp(stale):
            _remove(stale)


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
    _prune(out_dir, keep)
    return final


def _dist_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _quiet_no_dist():
    """DCP warns that it assumes one process whenever there is no process group, even with
    ``no_dist=True``: that is the intent here (sample.py, eval.py, one-process runs)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or")
        yield


def save_dcp_checkpoint(
    model_state: dict,
    optim_state: dict,
    record: dict | None,
    out_dir: str | os.PathLike,
    step: int,
    keep: int,
) -> Path:
    """Save a DCP checkpoint ``<out_dir>/ckpt/step_{step:08d}/`` atomically; collective: every rank calls
    it (with the default process group, or alone without one).

    Args:
        model_state, optim_state: this rank's ``get_state_dict(model, optimizer)`` (DTensor shards under
            FSDP2, plain tensors otherwise); DCP writes each rank's shards and the coordinator the metadata.
        record: rank 0's ``flashgpt.pt`` (step, config, RNG states ...); None on the other ranks.
        keep: newest checkpoints kept (files and directories together).

    Algorithm: rank 0 picks ``.tmp-<its pid>-step_N`` (broadcast), every rank ``dcp.save``s into it (DCP's
    file writer fsyncs each file; the call returns on every rank only after the coordinator wrote
    ``.metadata``), rank 0 writes ``flashgpt.pt`` (atomic_write), fsyncs the folder and renames it onto
    ``step_N`` (an older ``step_N``, e.g. from an abandoned branch, is moved aside first and deleted
    after), then prunes beyond ``keep``. If anything raises before the rename, rank 0 deletes the temp
    directory and the error is re-raised: existing checkpoints are never touched by a failed save.

    Returns the final path (on every rank). Raises what DCP / the filesystem raise (DCP raises on every
    rank when one rank's write fails; rank 0's own errors after it only on rank 0, so the caller must
    tell the others, as ``Trainer._save`` does).
    """
    import torch.distributed.checkpoint as dcp

    ready = _dist_ready()
    main = not ready or torch.distributed.get_rank() == 0
    d = ckpt_dir(out_dir)
    final = ckpt_path(out_dir, step, dcp=True)
    tmp_name = f".tmp-{os.getpid()}-{final.name}" if main else None
    if main:
        d.mkdir(parents=True, exist_ok=True)
        _remove(d / tmp_name)
    if ready:
        box = [tmp_name]
        torch.distributed.broadcast_object_list(box, src=0)  # also: the folder exists before anyone writes
        tmp_name = box[0]
    tmp = d / tmp_name
    try:
        with _quiet_no_dist():
            state = {"model": model_state, "optimizer": optim_state}
            dcp.save(state, checkpoint_id=str(tmp), no_dist=not ready)
        if main:
            atomic_write(tmp / DCP_RECORD, lambda f: torch.save(record, f))
            _fsync_dir(tmp)
            aside = None
            if final.exists():
                aside = d / f".tmp-{os.getpid()}-old-{final.name}"
                _remove(aside)
                os.replace(final, aside)
            os.replace(tmp, final)
            _fsync_dir(d)
            if aside is not None:
                _remove(aside)
    except BaseException:
        if main:
            _remove(tmp)
        raise
    if main:
        _prune(out_dir, keep)
    return final


def load_dcp_into(path: str | os.PathLike, model: torch.nn.Module, optimizer=None) -> None:
    """Load a DCP checkpoint's model (and optimizer) state into ``model`` / ``optimizer`` in place.

    ``model`` may be FSDP2-sharded (each rank reads its shards) or plain (each rank reads the full
    tensors), at any world size: DCP reshards by global shape. Collective when a process group exists
    (every rank calls it); without one it reads in this process alone (sample.py, eval.py).

    Args:
        path: the checkpoint directory (``step_N``).
        model: the unwrapped model (not a DDP wrapper), already sharded if it is to be.
        optimizer: its optimizer, or None to load the weights only. A fresh optimizer has no state yet;
            ``get_state_dict`` initialises it (one step at lr 0) so DCP knows what to read.

    Raises:
        RuntimeError / CheckpointException (from DCP): missing keys or shapes that do not fit the model.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    no_dist = not _dist_ready()
    with _quiet_no_dist():
        if optimizer is None:
            msd = get_model_state_dict(model)
            dcp.load({"model": msd}, checkpoint_id=str(path), no_dist=no_dist)
            set_model_state_dict(model, msd)
            return
        msd, osd = get_state_dict(model, optimizer)
        dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=str(path), no_dist=no_dist)
        set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)


def _stale_temp(path: Path) -> bool:
    """True for a temp file of ours or of a dead process (``.tmp-<pid>-...``): a live process's temp
    file is its checkpoint being written, never ours to delete."""
    pid = path.name.split("-")[1] if path.name.count("-") >= 2 else ""
    if not pid.isdigit():
        return False
    from trainer.rundir import pid_alive

    return int(pid) == os.getpid() or not pid_alive(int(pid))


def load_checkpoint(path: str | os.PathLike, map_location="cpu") -> dict:
    """``torch.load(path, weights_only=True)``; raises on a truncated/corrupt file (RuntimeError, EOFError,
    ValueError for a file that is not a flashgpt checkpoint).

    For a DCP directory: its record (``flashgpt.pt``) with ``"dcp"`` set to the directory and no
    ``"model"`` / ``"optimizer"`` (``load_dcp_into`` reads those); ValueError when the directory lacks
    DCP's ``.metadata`` or the record (an incomplete save)."""
    p = Path(path)
    if p.is_dir():
        if not (p / ".metadata").is_file() or not (p / DCP_RECORD).is_file():
            raise ValueError(f"{p} is not a complete DCP checkpoint (no .metadata or {DCP_RECORD})")
        record = torch.load(p / DCP_RECORD, map_location=map_location, weights_only=True)
        if not isinstance(record, dict) or "step" not in record:
            raise ValueError(f"{p / DCP_RECORD} is not a flashgpt checkpoint record (no 'step')")
        return {**record, "dcp": str(p)}
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
    ``{"name", "vocab_size"}`` plus ``"itos"`` (list of single-character str) for the char tokenizer, and
    for the BPE its ``"encoding"`` and ``"vocab_sha256"`` when the meta.json has them (data prepared
    before they were recorded has not)."""
    record = {"name": str(meta["tokenizer"]), "vocab_size": int(meta["vocab_size"])}
    if meta["tokenizer"] == "char":
        record["itos"] = list(meta["itos"])
    for key in ("encoding", "vocab_sha256"):
        if isinstance(meta.get(key), str):
            record[key] = meta[key]
    return record


def _chars(cs) -> str:
    shown = ", ".join(repr(c) for c in cs[:8])
    return shown + (f" ... ({len(cs)} in all)" if len(cs) > 8 else "")


def tokenizer_difference(record: dict, meta: dict) -> str | None:
    """What differs between the tokenizer a checkpoint was trained with (``state["tokenizer"]``) and the
    one of a prepared data directory (its ``meta``), as text, or None when the ids mean the same tokens.

    Compared is what defines the ids: the tokenizer's name and vocab size; for the char tokenizer its
    character list (the same size with other characters, or the same characters in another order, maps
    the ids to other characters); for the BPE the encoding's name and its vocabulary's SHA-256 (each
    compared only when both sides recorded it)."""
    name, new_name = record.get("name"), meta.get("tokenizer")
    if name != new_name:
        sizes = f"vocab_size {record.get('vocab_size')} -> {meta.get('vocab_size')}"
        return f"tokenizer {name!r} -> {new_name!r} ({sizes})"
    diffs = []
    if record.get("vocab_size") != meta.get("vocab_size"):
        diffs.append(f"vocab_size {record.get('vocab_size')} -> {meta.get('vocab_size')}")
    old, new = record.get("itos"), meta.get("itos")
    if name == "char" and old is not None and new is not None and list(old) != list(new):
        gone = [c for c in old if c not in set(new)]
        added = [c for c in new if c not in set(old)]
        if not gone and not added:
            diffs.append(f"the same {len(old)} characters in another order (each id means another character)")
        else:
            text = f"character list of {len(old)} -> {len(new)} characters"
            if gone:
                text += f"; not in the new data: {_chars(gone)}"
            if added:
                text += f"; new: {_chars(added)}"
            diffs.append(text)
    for key, what in (("encoding", "BPE encoding"), ("vocab_sha256", "BPE vocabulary (sha256)")):
        a, b = record.get(key), meta.get(key)
        if a is not None and b is not None and a != b:
            a, b = (a[:12] + "...", b[:12] + "...") if key == "vocab_sha256" else (repr(a), repr(b))
            diffs.append(f"{what} {a} -> {b}")
    return "; ".join(diffs) or None


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
