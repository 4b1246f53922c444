"""Checkpoints: ``torch.distributed.checkpoint`` (DCP) for one process, DDP and FSDP2 alike.

``<out_dir>/ckpt/step_00000100/`` holds DCP's shards (global shapes: they load at any world size, or without
a process group) and ``flashgpt.pt``, rank 0's record (step, every rank's RNG states, config, model_args,
tokenizer, W&B id). A save is written to ``.tmp-<pid>-step_N/`` and renamed when complete, so a save that
dies midway never touches the earlier checkpoints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import re
import shutil
import warnings
import zlib
from pathlib import Path

import numpy as np
import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from data.meta import atomic_write
from trainer.dist import broadcast_obj
from trainer.metrics import DISK_FULL_ERRNOS, first_line, os_error_in

CKPT_DIR_NAME = "ckpt"
RECORD = "flashgpt.pt"  # rank 0's record inside a checkpoint directory
_NAME_RE = re.compile(r"^step_(\d+)$")
MIB = float(1 << 20)


def ckpt_dir(out_dir) -> Path:
    return Path(out_dir) / CKPT_DIR_NAME


def ckpt_path(out_dir, step: int) -> Path:
    return ckpt_dir(out_dir) / f"step_{step:08d}"


def checkpoint_step(path) -> int | None:
    m = _NAME_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


def list_checkpoints(out_dir) -> list[tuple[int, Path]]:
    """(step, path) of every finished checkpoint in ``<out_dir>/ckpt``, newest first."""
    d = ckpt_dir(out_dir)
    if not d.is_dir():
        return []
    found = [(checkpoint_step(p), p) for p in d.iterdir() if p.is_dir()]
    return sorted(((s, p) for s, p in found if s is not None), reverse=True)


def newest_run_with_checkpoints(root: Path, skip=lambda run: False) -> Path | None:
    """The run directory under ``root`` whose newest checkpoint was written last (checkpoint times, not the
    run directory's: a refused resume bumps that), leaving out the runs for which ``skip(run)`` is true."""
    written: dict[Path, float] = {}
    for p in root.glob(f"*/{CKPT_DIR_NAME}/step_*"):
        with contextlib.suppress(OSError):  # removed meanwhile (keep=N rotation of a live run)
            written[p.parent.parent] = max(written.get(p.parent.parent, 0.0), p.stat().st_mtime)
    return next((run for run in sorted(written, key=written.get, reverse=True) if not skip(run)), None)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (another user's counts: EPERM)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass
    return True


def _prune(out_dir, keep: int) -> None:
    """Delete checkpoints beyond the newest ``keep``, and the temp directories of this or a dead process (a
    live process's is its checkpoint being written)."""
    for _, old in list_checkpoints(out_dir)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    for tmp in ckpt_dir(out_dir).glob(".tmp-*-step_*"):
        pid = tmp.name.split("-")[1]  # the glob leaves at least two dashes
        if pid.isdigit() and (int(pid) == os.getpid() or not pid_alive(int(pid))):
            shutil.rmtree(tmp, ignore_errors=True)


def remove_own_temps(out_dir) -> None:
    """Delete this process's temp checkpoint folders (a process exiting at once mid-save leaves none)."""
    for tmp in ckpt_dir(out_dir).glob(f".tmp-{os.getpid()}-*"):
        shutil.rmtree(tmp, ignore_errors=True)


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _no_dist_quiet():
    """DCP warns that it assumes one process whenever there is no process group: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or")
        yield


def _dist() -> bool:
    return tdist.is_available() and tdist.is_initialized()


def _crc32(path: Path) -> int:
    """CRC-32 of a file in 1 MiB blocks: 4.0 GB/s on a 2-core CPU box (sha256: 1.7), ~0.25 s per GB of
    shards; it catches a truncated, overwritten or bit-flipped shard (not tampering)."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            crc = zlib.crc32(block, crc)
    return crc


def _file_table(d: Path) -> dict[str, list[int]]:
    return {
        p.name: [p.stat().st_size, _crc32(p)] for p in sorted(d.iterdir()) if p.is_file() and p.name != RECORD
    }


def _verify_files(p: Path, files: dict) -> None:
    """ValueError naming the first file of ``files`` ({name: [size, crc32]}) that is missing or differs."""
    for name, (size, crc) in files.items():
        f = p / name
        if not f.is_file():
            raise ValueError(f"{f} is missing (the checkpoint's record lists it)")
        if (have := f.stat().st_size) != size:
            raise ValueError(
                f"{f} has {have} bytes, the checkpoint's record says {size} (truncated or overwritten)"
            )
        if (got := _crc32(f)) != crc:
            raise ValueError(
                f"{f} has checksum crc32 {got:08x}, the checkpoint's record says {crc:08x} (corrupt)"
            )


def save_checkpoint(model, optimizer, record: dict | None, out_dir, step: int, keep: int) -> Path:
    """Save ``<out_dir>/ckpt/step_{step:08d}/`` atomically; collective (every rank calls it)."""
    main = not _dist() or tdist.get_rank() == 0
    d, final = ckpt_dir(out_dir), ckpt_path(out_dir, step)
    tmp_name = f".tmp-{os.getpid()}-{final.name}"
    if main:
        d.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(d / tmp_name, ignore_errors=True)
    if _dist():
        tmp_name = broadcast_obj(tmp_name)  # also: the folder exists before anyone writes
    tmp = d / tmp_name
    try:
        # an optimizer that has not stepped has no state, and get_state_dict would make some by a zero-lr
        # step (step 1, zero moments): a resume from it would be one bias correction off, so none is saved
        msd, osd = get_state_dict(model, optimizer if optimizer is not None and optimizer.state else ())
        with _no_dist_quiet():
            dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp), no_dist=not _dist())
        del msd, osd
        if main:
            if record is not None:
                record = {**record, "files": _file_table(tmp)}
            atomic_write(tmp / RECORD, lambda f: torch.save(record, f))
            _fsync_dir(tmp)
            aside = d / f".tmp-{os.getpid()}-old-{final.name}"
            if final.exists():
                os.replace(final, aside)
            os.replace(tmp, final)
            _fsync_dir(d)
            shutil.rmtree(aside, ignore_errors=True)
    except BaseException:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if main:
        _prune(out_dir, keep)
    return final


def _has_optimizer_state(path) -> bool:
    """Whether a checkpoint holds optimizer state: not where the optimizer had not stepped (save_checkpoint),
    nor at step 0, where older saves hold get_state_dict's placeholder (step 1, zero moments)."""
    if checkpoint_step(path) == 0:
        return False
    keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return any(k.startswith("optimizer.") for k in keys)


def load_weights(path, model: torch.nn.Module, optimizer=None) -> None:
    """Load a checkpoint into ``model`` (the unwrapped module, sharded or not) and ``optimizer`` in place, at
    any world size; collective under a process group."""
    # no optimizer state saved: it had not stepped, so the fresh optimizer is the one saved (``()``: none)
    optims = optimizer if optimizer is not None and _has_optimizer_state(path) else ()
    msd, osd = get_state_dict(model, optims)
    with _no_dist_quiet():
        dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=str(path), no_dist=not _dist())
        set_state_dict(model, optims, model_state_dict=msd, optim_state_dict=osd)


def load_checkpoint(path) -> dict:
    """A checkpoint's record, with ``"path"`` set to its directory."""
    p = Path(path)
    if not (p / ".metadata").is_file() or not (p / RECORD).is_file():
        raise ValueError(f"{p} is not a complete checkpoint (no .metadata or {RECORD})")
    record = torch.load(p / RECORD, map_location="cpu", weights_only=True)
    if not isinstance(record, dict) or "step" not in record:
        raise ValueError(f"{p / RECORD} is not a flashgpt checkpoint record (no 'step')")
    if isinstance(record.get("files"), dict):
        _verify_files(p, record["files"])
    return {**record, "path": str(p)}


def load_newest(out_dir, warn=print) -> tuple[Path | None, dict | None]:
    """(path, record) of the newest checkpoint of ``out_dir`` that loads (the others skipped with a warning),
    or (None, None)."""
    for _, path in list_checkpoints(out_dir):
        try:
            return path, load_checkpoint(path)
        except Exception as e:  # noqa: BLE001 - any unreadable checkpoint: fall back to an older one
            warn(f"warning: checkpoint {path} does not load ({type(e).__name__}: {e}); trying an older one")
    return None, None


def lost_after(run_dir, k: int, summary: dict, all_newer: bool = False) -> tuple[int, str] | None:
    """(step, how) of a run's weights newer than its loadable step-``k`` checkpoint that were lost (a newer
    checkpoint that does not load, or summary.json's ``last_checkpoint`` gone), or None. A folder past the
    last step of a finished run is none of its checkpoints (it never trained there): not a loss."""
    final = summary.get("steps") if summary.get("status") == "ok" else None
    newer = [
        (s, p) for s, p in list_checkpoints(run_dir) if s > k and not (isinstance(final, int) and s > final)
    ]
    lc = str(summary.get("last_checkpoint") or "")
    if newer and all_newer:
        return newer[0][0], f"the newer checkpoint(s) {', '.join(p.name for _, p in newer)} do not load"
    if newer:
        return newer[0][0], f"{newer[0][1].name} does not load"
    if lc and (at := checkpoint_step(lc) or -1) > k:
        return at, f"{f'the newest checkpoint {lc}' if all_newer else Path(lc).name} is missing (deleted)"
    return None


# ----------------------------------------------------------------------------------- the trainer's save
class CheckpointSaveError(Exception):
    """The checkpoint of ``step`` could not be written (the earlier ones are untouched)."""

    def __init__(self, message: str, step: int, disk_full: bool, need_bytes: int, free_bytes: int | None):
        super().__init__(message)
        self.step, self.disk_full, self.need_bytes, self.free_bytes = step, disk_full, need_bytes, free_bytes


def save_problem(e: BaseException, target: Path, s: int, need: int) -> tuple:
    """``CheckpointSaveError`` arguments for a failed save of step ``s``: a full disk (or quota) says so,
    with the checkpoint's size and the free space; anything else gives the error."""
    try:
        free: int | None = shutil.disk_usage(target.parent).free
    except OSError:
        free = None
    cause = os_error_in(e)
    full = cause.errno in DISK_FULL_ERRNOS if cause is not None else (free is not None and free < need)
    if not full:
        return f"could not save checkpoint {target}: {first_line(cause or e)}.", s, False, need, free
    room = f", and {target.parent} has {free / MIB:.1f} MiB free" if free is not None else ""
    why = f" ({cause.strerror})" if cause is not None and cause.strerror else ""
    return f"disk full: checkpoint {target} needs about {need / MIB:.1f} MiB{room}{why}.", s, True, need, free


def save(st, s: int) -> Path:
    """The checkpoint after update ``s`` of run ``st`` (a ``trainer.state.RunState``); collective. Every
    rank returns the path, or every rank raises CheckpointSaveError."""
    st.gpu_busy.close()  # a checkpoint is not a training step
    rngs = [rng_state()]
    if st.dist.enabled:
        rngs = [None] * st.dist.world_size
        tdist.all_gather_object(rngs, rng_state())
    record = None
    if st.dist.is_main:
        record = {
            "format_version": 2,
            "step": s,
            "seed": int(st.cfg.seed),
            "rng": rngs,
            "config": dataclasses.asdict(st.cfg),
            "model_args": dataclasses.asdict(st.gpt_config),
            "tokenizer": tokenizer_record(st.meta),
            # which corpus and split the run trains on: a resume refuses data prepared from another
            "data": {
                **{k: st.meta.get(k) for k in ("source", "source_sha256", "train_tokens", "val_tokens")},
                "tokens_digest": st.tokens_digest,  # data.meta.tokens_digest: the token files themselves
            },
            "attention": st.attention_id(),
            "wandb_run_id": st.log.wandb_id,
            "skipped_steps": st.skipped,
            "world_size": st.dist.world_size,
            "parallel": st.plan.parallel,
            "torch_version": str(torch.__version__),
        }
    path, problem = None, None
    try:
        path = save_checkpoint(st.raw_model, st.optimizer, record, st.out_dir, s, int(st.cfg.checkpoint.keep))
    except (OSError, RuntimeError, dcp.CheckpointException) as e:
        leaves = torch.utils._pytree.tree_leaves([st.raw_model.state_dict(), st.optimizer.state_dict()])
        need = sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
        problem = save_problem(e, ckpt_path(st.out_dir, s), s, need)
    path, problem = st.broadcast((str(path) if path else None, problem))
    if problem is not None:  # every rank stops: the run cannot go on without its checkpoints
        raise CheckpointSaveError(*problem)
    st.last_ckpt, st.last_ckpt_step = Path(path), s
    return st.last_ckpt


# ------------------------------------------------------------------------------------------- tokenizer
def tokenizer_record(meta: dict) -> dict:
    """``state["tokenizer"]`` for a data directory's meta: name, vocab_size, the char tokenizer's ``itos``,
    the BPE's ``encoding`` and ``vocab_sha256`` where meta.json has them."""
    record = {"name": str(meta["tokenizer"]), "vocab_size": int(meta["vocab_size"])}
    if meta["tokenizer"] == "char":
        record["itos"] = list(meta["itos"])
    for key in ("encoding", "vocab_sha256"):
        if isinstance(meta.get(key), str):
            record[key] = meta[key]
    return record


def tokenizer_difference(record: dict, meta: dict) -> str | None:
    """What differs between the tokenizer a checkpoint was trained with (``state["tokenizer"]``) and the one
    of a prepared data directory (its ``meta``), as text, or None when the ids mean the same tokens."""
    name, new_name = record.get("name"), meta.get("tokenizer")
    sizes = f"vocab_size {record.get('vocab_size')} -> {meta.get('vocab_size')}"
    if name != new_name:
        return f"tokenizer {name!r} -> {new_name!r} ({sizes})"
    diffs = [sizes] if record.get("vocab_size") != meta.get("vocab_size") else []
    old, new = record.get("itos"), meta.get("itos")
    if name == "char" and old is not None and new is not None and list(old) != list(new):
        gone = [c for c in old if c not in set(new)]
        added = [c for c in new if c not in set(old)]
        if not gone and not added:
            diffs.append(f"the same {len(old)} characters in another order (each id means another character)")
        else:
            text = f"character list of {len(old)} -> {len(new)} characters"
            for what, cs in (("not in the new data", gone), ("new", added)):
                if cs:
                    more = f" ... ({len(cs)} in all)" if len(cs) > 8 else ""
                    text += f"; {what}: {', '.join(repr(c) for c in cs[:8])}{more}"
            diffs.append(text)
    for key, what in (("encoding", "BPE encoding"), ("vocab_sha256", "BPE vocabulary (sha256)")):
        a, b = record.get(key), meta.get(key)
        if a is not None and b is not None and a != b:
            a, b = (a[:12] + "...", b[:12] + "...") if key == "vocab_sha256" else (repr(a), repr(b))
            diffs.append(f"{what} {a} -> {b}")
    return "; ".join(diffs) or None


def tokenizer_from_checkpoint(state: dict):
    """The tokenizer a checkpoint's tokens were made with, from its record alone (ValueError: none or an
    incomplete one; RuntimeError: tiktoken's GPT-2 files cannot be loaded)."""
    from data.tokenizer import make_tokenizer

    record = state.get("tokenizer")
    if not isinstance(record, dict) or "name" not in record:
        raise ValueError(
            "the checkpoint names no tokenizer (no state['tokenizer']['name']); it was not "
            "written by flashgpt's trainer"
        )
    name = record["name"]
    if name == "gpt2":
        return make_tokenizer("gpt2")
    if name == "char" and record.get("itos") is not None:
        return make_tokenizer("char", itos=record["itos"])
    raise ValueError(f"the checkpoint's tokenizer record {record!r} is incomplete or unknown")


# ------------------------------------------------------------------------------------------- RNG state
def rng_state() -> dict:
    """This process's RNG states (torch CPU and CUDA, numpy, python ``random``) as ``weights_only``-loadable
    values (tensors, ints, tuples)."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    plain = [x.item() if hasattr(x, "item") else x for x in np_state[2:]]
    state = {
        "torch": torch.get_rng_state(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *plain),
        "python": (py_state[0], list(py_state[1]), py_state[2]),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
