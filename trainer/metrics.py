"""Run records: ``metrics.jsonl`` and ``summary.json`` (whole lines, atomic rewrites, a full disk named as
such), mirrored to Weights & Biases. Only rank 0 logs.

A resume from a checkpoint older than the last logged step moves the abandoned steps to
``metrics.abandoned.<from>-<to>.jsonl`` and forks the W&B run at the checkpoint (W&B drops a step logged
below the run's current one), so metrics.jsonl's steps never go back.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import netrc
import os
import secrets
import string
from pathlib import Path
from urllib.parse import urlparse

from data.meta import atomic_write

WANDB_ID_FILE = "wandb_run_id.txt"
# Room kept aside in the run directory while a run is live: when the disk fills, deleting it lets the run
# still record its ending (summary.json, the last metrics.jsonl line). Removed when the run ends.
RESERVE_NAME = ".flashgpt.reserve"
RESERVE_BYTES = 256 << 10
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def new_run_id(length: int = 8) -> str:
    """A fresh W&B run id (lowercase letters and digits, like wandb's own; also the run folders' token)."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(length))


def wandb_logged_in() -> bool:
    """True when a W&B API key is configured: ``WANDB_API_KEY`` or a netrc entry for the W&B host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        auth = netrc.netrc(path).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(auth and auth[2])


def resolve_wandb_mode(mode: str) -> str:
    """``wandb.mode`` as online | offline | disabled: auto is $WANDB_MODE, else online when logged in."""
    if mode != "auto":
        return mode
    env = os.environ.get("WANDB_MODE", "").lower()
    env = "offline" if env == "dryrun" else env
    if env in ("online", "offline", "disabled"):
        return env
    return "online" if wandb_logged_in() else "offline"


def _jsonable(v):
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep them readable
    return v


def first_line(e: BaseException) -> str:
    """``Type: first line of the message`` of an exception."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def step_of(row: dict) -> int | None:
    s = row.get("step")
    return int(s) if isinstance(s, (int, float)) and not isinstance(s, bool) else None


def live_branch(rows: list[dict]) -> list[dict]:
    """The rows of the live branch of a metrics.jsonl (a step below an earlier one drops those above it)."""
    out: list[dict] = []
    top: int | None = None
    for row in rows:
        s = step_of(row)
        if s is not None and top is not None and s < top:
            out = [r for r in out if (step_of(r) is None or step_of(r) <= s)]
        if s is not None:
            top = s if top is None or s < top else max(top, s)
        out.append(row)
    return out


def os_error_in(e: BaseException | None, errnos: tuple[int, ...] | None = None) -> OSError | None:
    """The OSError behind ``e`` (of ``errnos``, when given): itself, in its cause/context chain, or in a
    DCP failure of some rank."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError) and (errnos is None or e.errno in errnos):
            return e
        seen.add(id(e))
        for inner in (getattr(e, "failures", None) or {}).values():  # DCP's: (exception, traceback)
            found = os_error_in(inner[0] if isinstance(inner, tuple) else inner, errnos)
            if found is not None:
                return found
        e = e.__cause__ or e.__context__
    return None


def disk_full_in(e: BaseException | None) -> OSError | None:
    return os_error_in(e, DISK_FULL_ERRNOS)


class DiskFullError(Exception):
    """``path`` could not be written: its disk is full (or over quota). What was there before is intact:
    an append was cut back to its last whole line, a temp file was removed."""

    def __init__(self, path: str | os.PathLike, cause: OSError | None = None) -> None:
        why = cause.strerror if cause is not None and cause.strerror else "No space left on device"
        super().__init__(f"disk full: could not write {path} ({why})")
        self.path = Path(path)


@contextlib.contextmanager
def writing(path: Path, undo=None):
    """Raise a full disk (or quota) met inside the block as ``DiskFullError(path)``, after ``undo()``: a
    failed write's clean-up (remove what it created, truncate a torn line), run for any OSError."""
    try:
        yield
    except OSError as e:
        if undo is not None:
            with contextlib.suppress(OSError):
                undo()
        if e.errno in DISK_FULL_ERRNOS:
            raise DiskFullError(path, e) from e
        raise


def write_json_atomic(path: Path, obj: dict) -> None:
    """``obj`` as JSON through a temp file + ``os.replace``: a failed write leaves ``path`` as it was."""
    text = json.dumps({k: _jsonable(v) for k, v in obj.items()}, indent=2, sort_keys=True) + "\n"
    with writing(path):
        atomic_write(Path(path), lambda f: f.write(text.encode()))


def open_lines(path: Path) -> int:
    """``path`` opened to append lines (O_RDWR | O_APPEND, created if missing). A half line left by a killed
    writer is ended first, so it stays one bad line and the next record parses."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    end = os.fstat(fd).st_size
    if end and os.pread(fd, 1, end - 1) != b"\n":
        append_whole(fd, b"\n", path)
    return fd


def append_whole(fd: int, data: bytes, path: Path) -> None:
    """Append ``data`` to ``fd`` (O_APPEND) whole or not at all: a write cut short is truncated back."""
    start = os.fstat(fd).st_size
    with writing(path, undo=lambda: os.ftruncate(fd, start)):
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]


def append_line(path: Path, text: str) -> None:
    fd = open_lines(path)
    try:
        append_whole(fd, (text + "\n").encode(), path)
    finally:
        os.close(fd)


def _parse(line: str) -> dict | None:
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) else None


def read_metric_lines(out_dir: Path) -> list[tuple[dict | None, str]]:
    """(parsed row or None, raw line) of every non-blank line of ``<out_dir>/metrics.jsonl`` ([] without
    one); a line that does not parse (a killed run's truncated last one) gives None."""
    try:
        text = (Path(out_dir) / "metrics.jsonl").read_text()
    except OSError:
        return []
    return [(_parse(line), line) for line in text.splitlines() if line.strip()]


def read_metric_rows(out_dir: Path) -> list[dict]:
    return [r for r, _ in read_metric_lines(out_dir) if r is not None]


class RunLogger:
    """metrics.jsonl + summary.json + W&B for one run."""

    def __init__(self, out_dir: str | os.PathLike, enabled: bool = True) -> None:
        self.out_dir, self.enabled, self.summary = Path(out_dir), enabled, {}
        self.wandb_run, self.wandb_mode, self.wandb_parent = None, "disabled", None
        self._jsonl: int | None = None  # metrics.jsonl's file descriptor (O_APPEND)
        if enabled:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._open_jsonl()
            self._keep_reserve()

    def _open_jsonl(self) -> None:
        path = self.out_dir / "metrics.jsonl"
        with writing(path):
            self._jsonl = open_lines(path)

    def _keep_reserve(self) -> None:
        """Set ``RESERVE_BYTES`` aside, written out (not sparse): deleting it frees that room."""
        path = self.out_dir / RESERVE_NAME
        with writing(path, undo=path.unlink), open(path, "wb") as f:
            f.write(b"\0" * RESERVE_BYTES)
            f.flush()
            os.fsync(f.fileno())

    def release_reserve(self) -> bool:
        try:
            (self.out_dir / RESERVE_NAME).unlink()
            return True
        except OSError:
            return False

    # ---------------------------------------------------------------------------------------- W&B
    def start_wandb(self, *, mode: str, config: dict, run_id: str | None, fork_at: int | None = None, **kw):
        """``wandb.init`` into ``<out_dir>/wandb`` with ``id=run_id`` (new when None), ``resume="allow"``;
        ``kw``: project, entity, group, name, tags."""
        self.wandb_parent = None
        if not self.enabled:
            return
        self.wandb_mode = resolve_wandb_mode(mode)
        if self.wandb_mode == "disabled":
            return
        import wandb

        saved = self.out_dir / WANDB_ID_FILE
        run_id = run_id or (saved.read_text().strip() if saved.is_file() else None)
        common = {**kw, "tags": list(kw["tags"]), "job_type": "train"}
        common |= {"dir": str(self.out_dir), "mode": self.wandb_mode}
        if fork_at is not None and run_id:
            self.wandb_parent = {"run_id": run_id, "step": int(fork_at)}
            config = {**config, "wandb_parent": dict(self.wandb_parent)}
            self.wandb_run = self._init_fork(wandb, common, config, run_id, int(fork_at))
        else:
            run_id = run_id or new_run_id()
            self.wandb_run = wandb.init(**common, config=config, id=run_id, resume="allow")
        (self.out_dir / WANDB_ID_FILE).write_text(self.wandb_run.id + "\n")
        if self.wandb_mode == "offline":
            print(
                f"W&B offline run {self.wandb_run.id}; upload it later with: "
                f"wandb sync {self.wandb_sync_dir()}",
                flush=True,
            )

    def _init_fork(self, wandb, common: dict, config: dict, parent: str, step: int):
        """A run forked from ``parent`` at ``step``; where the server cannot fork, a new one linked to it."""
        try:
            return wandb.init(**common, config=config, id=new_run_id(), fork_from=f"{parent}?_step={step}")
        except Exception as e:  # noqa: BLE001 - e.g. forking not enabled for this account
            print(
                f"warning: W&B could not fork run {parent} at step {step} ({e}); starting a new "
                "run linked to it in the config (wandb_parent)",
                flush=True,
            )
        return wandb.init(**common, config=config, id=new_run_id())

    @property
    def wandb_id(self) -> str | None:
        return self.wandb_run.id if self.wandb_run is not None else None

    def wandb_sync_dir(self) -> str:
        return str(Path(self.wandb_run.dir).parent) if self.wandb_run is not None else ""

    def update_config(self, extra: dict) -> None:
        if self.wandb_run is not None:
            self.wandb_run.config.update(extra, allow_val_change=True)

    # ---------------------------------------------------------------------------------------- metrics
    def log(self, step: int, metrics: dict, *, wandb_too: bool = True) -> None:
        """Append ``{"step": step, **metrics}`` to metrics.jsonl and (``wandb_too``) log it to W&B."""
        if not self.enabled:
            return
        metrics = {k: _jsonable(v) for k, v in metrics.items()}
        row = json.dumps({"step": int(step), **metrics}) + "\n"
        append_whole(self._jsonl, row.encode(), self.out_dir / "metrics.jsonl")
        if wandb_too and self.wandb_run is not None:
            self.wandb_run.log(metrics, step=int(step))

    def last_logged_step(self) -> int | None:
        steps = [x for x in map(step_of, live_branch(read_metric_rows(self.out_dir))) if x is not None]
        return max(steps, default=None)

    def set_apart_after(self, step: int) -> dict | None:
        """Move the lines of steps after ``step`` (the abandoned branch of a resume from an older checkpoint)
        from metrics.jsonl to ``metrics.abandoned.<step+1>-<last>.jsonl``; metrics.jsonl keeps the live branch
        up to ``step``."""
        if not self.enabled:
            return None
        lines = read_metric_lines(self.out_dir)
        rows = [r for r, _ in lines if r is not None]
        keep_ids = {id(r) for r in live_branch(rows) if (step_of(r) or 0) <= step}
        kept = [raw for r, raw in lines if r is not None and id(r) in keep_ids]
        gone = [(r, raw) for r, raw in lines if r is None or id(r) not in keep_ids]
        if not gone:
            return None
        steps = [x for x in (step_of(r) for r, _ in gone if r is not None) if x is not None]
        last = max(steps, default=step + 1)
        payload = "".join(raw + "\n" for _, raw in gone)
        base = f"metrics.abandoned.{step + 1}-{last}"
        dest, n = self.out_dir / f"{base}.jsonl", 1
        while dest.exists() and dest.read_text() != payload:  # never overwrite an earlier branch
            n += 1
            dest = self.out_dir / f"{base}.{n}.jsonl"
        self._close_jsonl()
        live = self.out_dir / "metrics.jsonl"
        try:  # metrics.jsonl is whole either way (only atomic_write's os.replace changes it)
            with writing(live):
                atomic_write(dest, lambda f: f.write(payload.encode()))
                atomic_write(live, lambda f: f.write("".join(raw + "\n" for raw in kept).encode()))
        finally:
            self._open_jsonl()
        wandb_steps = sum(1 for r, _ in gone if r is not None and not ({"event", "status"} & r.keys()))
        return {"path": dest, "first": step + 1, "last": last, "lines": len(gone), "wandb_steps": wandb_steps}

    def set_summary(self, values: dict) -> None:
        """Merge into summary.json (atomic rewrite) and the W&B summary."""
        if not self.enabled:
            return
        self.summary.update({k: _jsonable(v) for k, v in values.items()})
        write_json_atomic(self.out_dir / "summary.json", self.summary)
        if self.wandb_run is not None:
            self.wandb_run.summary.update(dict(self.summary))

    def mark_preempting(self) -> None:
        if self.wandb_run is not None and hasattr(self.wandb_run, "mark_preempting"):
            self.wandb_run.mark_preempting()

    def _close_jsonl(self) -> None:
        if self._jsonl is not None:
            with contextlib.suppress(OSError):  # every line was written whole already
                os.fsync(self._jsonl)
            os.close(self._jsonl)
            self._jsonl = None

    def close(self, exit_code: int = 0) -> None:
        """Close metrics.jsonl and finish the W&B run (prints the sync command when offline)."""
        if not self.enabled:
            return
        self._close_jsonl()
        self.release_reserve()
        if self.wandb_run is not None:
            sync_dir = self.wandb_sync_dir()
            self.wandb_run.finish(exit_code=exit_code)
            if self.wandb_mode == "offline":
                print(f"W&B offline run saved; upload with: wandb sync {sync_dir}", flush=True)
            self.wandb_run = None
