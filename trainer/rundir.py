"""Run directories that never mix: unique default names (``${run_token:}``), one live process per
directory (an ``flock`` the kernel drops when the process dies), no new run over an old one, an unwritable
out_dir refused as a config error, a refused launch leaving nothing behind, and a "running" summary of a
dead process reported (and, on resume, rewritten) as killed.
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import functools
import json
import os
import re
import socket
import sys
import tempfile
import time
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import QuotedString
from hydra.experimental.callback import Callback as _HydraCallback
from omegaconf import OmegaConf

from trainer.checkpoint import list_checkpoints, pid_alive
from trainer.fields import ConfigError
from trainer.metrics import new_run_id, read_metric_rows, step_of, write_json_atomic

LOCK_NAME = ".flashgpt.lock"
RESOLVED_CONFIG = "config.resolved.yaml"  # the run's resolved config, rewritten by every start (setup.py)


@functools.cache
def run_token() -> str:
    """6 random letters/digits, drawn once per process (``out_dir`` and Hydra's run dir, resolved at
    different times, name the same folder)."""
    return new_run_id(6)


def swept(_root_) -> str:
    """``_key-value`` for each key this multirun sweeps besides attention and seq_len, with this job's value:
    the folder ``3_flash_n1024_pos_emb-rope_qk_norm-true`` says which job it is."""
    try:
        task = dict(o.partition("=")[::2] for o in _root_.hydra.overrides.task)
        parsed = parse_overrides([a for a in sys.argv[1:] if not a.startswith("-")])
    except Exception:  # noqa: BLE001 - no Hydra config (a composed config) or no Hydra command line
        return ""
    named = {"attention", "attention.name", "seq_len"}  # already in a sweep job's folder name
    keys = [o.key_or_group for o in parsed if o.is_sweep_override() and o.key_or_group not in named]
    # key-value with a '-': a '=' in a folder name would break the out_dir= of a printed resume command
    shown = {"True": "true", "False": "false"}
    parts = (f"_{k.rsplit('.', 1)[-1]}-{shown.get(task[k], task[k])}" for k in keys if k in task)
    return "".join(re.sub(r"[^A-Za-z0-9._+-]", "-", p) for p in parts)


def parse_overrides(overrides: list[str]) -> list:
    """Hydra's parse of command-line overrides, ``hydra.*`` (no run keys) left out."""
    return OverridesParser.create().parse_overrides(
        [o for o in overrides if not o.lstrip("+~").startswith("hydra")]
    )


for _name, _resolver in (("run_token", run_token), ("swept", swept)):  # ${run_token:}, ${swept:}
    if not OmegaConf.has_resolver(_name):
        OmegaConf.register_new_resolver(_name, _resolver)


class RunDirBusy(ConfigError):
    """Another live process holds the run directory's lock."""


class RunDirLock:
    """An exclusive ``flock`` on ``<out_dir>/.flashgpt.lock`` (``fd`` None: a no-op lock of another rank)."""

    def __init__(self, out_dir: Path, fd: int | None) -> None:
        self.out_dir, self._fd = Path(out_dir), fd

    def write_holder(self) -> None:
        """Say who holds the lock, for the message another process prints."""
        if self._fd is not None:
            info = f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}"
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, info.encode() + b"\n", 0)

    def release(self) -> None:
        """Drop the lock (the file stays: removing it would let a waiter lock a different inode)."""
        if self._fd is not None:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            finally:
                os.close(self._fd)
                self._fd = None


def claim_run_dir(out_dir: Path, *, is_main: bool) -> RunDirLock:
    """Take this run's exclusive lock on ``out_dir`` (rank 0 only; other ranks get a no-op lock)."""
    out_dir = Path(out_dir)
    if not is_main:
        return RunDirLock(out_dir, None)
    out_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(out_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        try:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "unknown"
        finally:
            os.close(fd)
        raise RunDirBusy(
            f"out_dir={out_dir} is in use by another live train.py process ({holder}); two runs never "
            "share a directory. Choose another out_dir, or leave out_dir unset (each new run gets its "
            "own runs/<time>_<backend>_n<seq_len>_<token>)"
        ) from None
    lock = RunDirLock(out_dir, fd)
    if os.fstat(fd).st_size == 0:  # a new lock; an existing run's holder line changes once its checks pass
        lock.write_holder()
    return lock


def held_by_live_process(out_dir: Path) -> bool:
    """Whether another live process holds ``out_dir``'s lock."""
    try:
        fd = os.open(Path(out_dir) / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # dropped by the close below
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def read_summary(out_dir: Path) -> dict:
    """``<out_dir>/summary.json`` as a dict ({} when missing or unreadable)."""
    try:
        obj = json.loads((Path(out_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    return obj if isinstance(obj, dict) else {}


def read_resolved_config(run_dir) -> dict:
    """``<run_dir>/config.resolved.yaml`` as a plain dict, interpolations unresolved; {} when it is absent or
    unreadable (``resume_config`` refuses those itself)."""
    try:
        saved = OmegaConf.to_container(OmegaConf.load(Path(run_dir) / RESOLVED_CONFIG), resolve=False)
    except Exception:  # noqa: BLE001 - absent, truncated or not YAML: no record
        return {}
    return saved if isinstance(saved, dict) else {}


class RunDirTaken(ConfigError):
    """A new run refused because its directory ``out_dir`` already holds a run (which stays as it was)."""

    def __init__(self, message: str, out_dir: Path) -> None:
        super().__init__(message)
        self.out_dir = Path(out_dir)


def check_new_run_dir(cfg, out_dir: Path, multirun: bool = False) -> None:
    """A new run (resume=false) may only start in a directory that holds no run: no checkpoint, and no
    summary.json but that of a run refused before training (status ``error`` with no ``steps``, nothing in its
    metrics.jsonl, no W&B run)."""
    if cfg.resume:
        return
    out_dir = Path(out_dir)
    summary = read_summary(out_dir)
    status = summary.get("status")
    metrics = out_dir / "metrics.jsonl"
    logged = metrics.is_file() and metrics.stat().st_size > 0
    wandb = (out_dir / "wandb_run_id.txt").exists()
    refused = status == "error" and "steps" not in summary and not logged and not wandb  # free for a new run
    ckpts = list_checkpoints(out_dir)
    new = (  # a single run picks another out_dir, a -m job another sweep folder
        "use a new hydra.sweep.dir (or leave it unset: a new multirun/<time> folder)"
        if multirun
        else "choose a new out_dir (the default, runs/<time>_<backend>_n<seq_len>, is new)"
    )
    if status in ("error", "save_failed", "disk_full") and not refused:
        go_on = (  # resume=true only where there is a checkpoint to continue (else it is refused too)
            f"Pass resume=true to continue it from its newest checkpoint, or {new}"
            if ckpts
            else f"It has no checkpoint, so resume=true has nothing to continue: {new}"
        )
        when = (  # a crash in set-up (summary "failed_in"): nothing was trained
            f"failed in {summary['failed_in']}, before its first step"
            if summary.get("failed_in")
            else "started training and then failed"
        )
        why = (
            f"holds a run that {when} (status {status} after {summary.get('steps', '?')} steps: "
            f"{summary.get('error', 'see its train.log')}); its records are kept. {go_on}"
        )
    elif not ckpts and status not in (None, "error"):
        # e.g. a run killed (kill -9, out of memory) before its first checkpoint: nothing to resume either
        why = (
            f"already holds a run (summary status {status!r}) without a checkpoint, so resume=true has "
            f"nothing to continue; {new}, or delete {out_dir} if its records are not needed"
        )
    elif ckpts:
        why = f"already holds a run (summary.json or checkpoints); pass resume=true to continue it, or {new}"
    else:
        return
    raise RunDirTaken(f"out_dir={out_dir} {why}", out_dir)


class RunFinished(Exception):
    """resume=true on a run that already reached max_steps; ``str()`` is the message to print."""


def finished_message(out_dir: Path, steps: int, max_steps: int, resume_cmd: str) -> str:
    more = max(2 * max_steps, max_steps + 1)
    return (
        f"run in out_dir={out_dir} is already finished: {steps} of max_steps={max_steps} steps done; "
        "nothing was changed (metrics, summary, checkpoints, W&B, config.resolved.yaml are as they were). "
        f"To train it further, raise max_steps explicitly (e.g. {resume_cmd} max_steps={more}): the "
        "cosine LR schedule then decays over the new max_steps (unless optim.decay_steps is set), so "
        "the continued curve is not that of an uninterrupted longer run. Or start a new run (resume=false)."
    )


def below_done_message(out_dir: Path, done: int, max_steps: int, run_max: int | None) -> str:
    """The config error for resume=true with a max_steps below the steps the run already trained."""
    own = f"its own max_steps={run_max}" if run_max is not None else "its own max_steps"
    state = " (it is finished)" if run_max is not None and done >= int(run_max) else ""
    return (
        f"max_steps={max_steps} is below the {done} steps the run in out_dir={out_dir} has already "
        f"trained, so resume=true has nothing to do (a resume never takes steps back); nothing was "
        f"changed. Leave max_steps out to keep {own}{state}, or raise it to train further (e.g. "
        f"max_steps={max(2 * done, done + 1)}); for a {max_steps}-step run start a new one (resume=false)"
    )


def max_steps_note(old: int, new: int, step: int, optim, lr_at) -> str:
    """The resume note for a changed max_steps: what it does to the learning-rate schedule."""
    head = f"max_steps changed on resume: {old} -> {new} (explicit choice); "
    if optim.decay_steps:
        return f"{head}optim.decay_steps={optim.decay_steps} is fixed, so the LR schedule is unchanged"
    before, after = lr_at(step + 1, optim, old), lr_at(step + 1, optim, new)
    return (
        f"{head}the cosine LR schedule decays over max_steps, so from step {step + 1} on the learning rate "
        f"follows the {new}-step schedule (lr at step {step + 1}: {before:.3g} with max_steps={old}, "
        f"{after:.3g} now), which an uninterrupted {new}-step run would have followed from step 1"
    )


# ------------------------------------------------------------------------------------------ out_dir
def writable_place(name: str) -> Path:
    """A new path ``name`` in a folder this process can write: ``~/flashgpt-runs`` (its nearest existing
    folder writable), else the temp folder (an unwritable or read-only $HOME)."""
    for base in (Path("~/flashgpt-runs").expanduser(), Path(tempfile.gettempdir()) / "flashgpt-runs"):
        existing = next((q for q in (base, *base.parents) if q.exists()), None)
        if existing is not None and existing.is_dir() and os.access(existing, os.W_OK | os.X_OK):
            break
    place, n = base / name, 2
    while place.exists():
        place, n = base / f"{name}-{n}", n + 1
    return place


#: what a run (and sample.py, eval.py, bench.compare) writes into its folder (``fnmatch`` patterns): a folder
#: holding anything else is not a run's; the last two are an empty folder's placeholders, nothing of anyone's
RUN_FILES = f"""{LOCK_NAME} .flashgpt.reserve .hydra ckpt {RESOLVED_CONFIG} metrics.jsonl summary.json
summary.json.tmp* train.log wandb wandb_run_id.txt evals samples metrics.abandoned.*.jsonl trace_step*.json.gz
compare.png .gitkeep .DS_Store""".split()


def is_run_dir(path: Path) -> bool:
    """``path`` holds a run's record (its summary or resolved config)."""
    return (path / "summary.json").is_file() or (path / RESOLVED_CONFIG).is_file()


def foreign_entries(folder: Path, sweep: bool = False) -> list[str]:
    """Names in ``folder`` that no run wrote (a sweep folder: also its multirun.yaml and job folders)."""

    def ours(p: Path) -> bool:
        if any(fnmatch.fnmatch(p.name, pat) for pat in RUN_FILES):
            return True
        return sweep and (p.name == "multirun.yaml" or (p.is_dir() and not foreign_entries(p)))

    return sorted(p.name for p in folder.iterdir() if not ours(p))


def out_dir_problem(out_dir, key: str = "out_dir", resume: bool = False) -> str | None:
    """Why ``out_dir`` cannot hold a run (a new run's files would mix with others', it cannot be created or
    written), as a message naming ``key`` and a folder that works, or None when it can."""
    path = Path(str(out_dir))  # as Hydra makes it: a quoted ~ is a folder named ~, not $HOME
    sweep = "sweep" in key
    if not resume:
        example = f"{key}={'multirun/sweep1' if sweep else 'runs/run1'}"
        if (parent := next((q for q in path.resolve().parents if is_run_dir(q)), None)) is not None:
            return (
                f"{key}={path} lies inside the run folder {parent}: its files would mix with that run's; "
                f"pass a folder outside it, e.g. {example}"
            )
        if path.is_dir() and (foreign := foreign_entries(path, sweep)):
            names = ", ".join(foreign[:4]) + (", ..." if len(foreign) > 4 else "")
            return (
                f"{key}={path} already holds other files or runs ({names}): a run writes ckpt/, "
                f"metrics.jsonl, summary.json and train.log into its own folder, and they would mix with "
                f"these; pass a new or empty folder, e.g. {example} (or leave {key} out for a new folder)"
            )
    existing = next((q for q in (path, *path.parents) if q.exists()), Path.cwd())
    if not existing.is_dir():
        if existing == path:
            return (
                f"{key}={out_dir} is an existing file, not a directory; pass another {key}, e.g. "
                f"{key}={out_dir}-run (or move that file away)"
            )
        return (
            f"{key}={out_dir} cannot be created: {existing} is a file, not a directory; set {key} to a "
            "path outside it"
        )
    try:
        fd, probe = tempfile.mkstemp(prefix=".flashgpt-write-test-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        if resume and existing == path and list_checkpoints(path):
            copy = writable_place(path.resolve().name)
            return (
                f"resume=true: the run directory {out_dir} is not writable ({e.strerror}), and a resume "
                f"writes its checkpoints, metrics and log there; continue it from a copy in a folder you "
                f"can write to: `mkdir -p {copy.parent} && cp -rp {path} {copy} && chmod -R u+w {copy}` "
                f"(a copy keeps the files' read-only modes), then resume=true out_dir={copy}"
            )
        what = "is not writable" if existing == path else f"cannot be created: {existing} is not writable"
        example = writable_place("sweep1" if sweep else "run1")
        return (
            f"{key}={out_dir} {what} ({e.strerror}); set {key} to a directory you can write to, e.g. "
            f"{key}={example}"
        )
    return None


def sweep_changed(yaml: Path, given: list[str]) -> str | None:
    """Why resuming the sweep recorded in ``yaml`` (its multirun.yaml) with the overrides ``given`` would
    mix its jobs: Hydra numbers the jobs in the order of the swept values, and a resumed job continues the
    folder of its number, so the swept keys and their values must be those of the sweep, in its order."""

    def plain(v):
        if isinstance(v, QuotedString):
            return v.text
        return [plain(x) for x in v] if isinstance(v, list) else v

    def values(overrides):  # a=x,y / a='x', 'y' / a=choice(x,y) alike; a=[1,2] and a='x,y' are not swept
        parsed = parse_overrides(overrides)
        return [
            (o.key_or_group, [plain(v) for v in o.sweep_iterator()]) for o in parsed if o.is_sweep_override()
        ]

    if not yaml.is_file():
        return None
    try:
        saved = list(OmegaConf.select(OmegaConf.load(yaml), "hydra.overrides.task", default=[]) or [])
        if values(saved) == values(given):
            return None
    except Exception:  # noqa: BLE001 - an unreadable record: the jobs' checks; a bad override: Hydra's
        return None
    shown = lambda overrides: " ".join(o for o in overrides if values([o])) or "none"  # noqa: E731
    return (
        f"resume=true with -m: this sweep's values ({shown(given)}) are not those of the sweep in "
        f"{yaml.parent} ({shown(saved)}); a resumed job continues the folder of its number, so give the same "
        "values in the same order (or a new hydra.sweep.dir for a new sweep)"
    )


class OutDirCheck(_HydraCallback):
    """Hydra callback (``hydra.callbacks`` in configs/config.yaml): before Hydra creates the run directory (it
    would stop with a traceback), an out_dir (``hydra.sweep.dir`` under ``-m``) that cannot be created or
    written is a config error: ``config error: ...`` on stderr, exit status 2."""

    def on_run_start(self, config, **kwargs) -> None:  # noqa: ARG002 - Hydra's callback API
        if (path := self._check(config, "hydra.run.dir", "out_dir")) is not None:
            note_run_dir_before(path)  # so that a run refused later takes back what it created

    def on_multirun_start(self, config, **kwargs) -> None:  # noqa: ARG002 - Hydra's callback API
        """Also note the sweep's ``multirun.yaml`` before Hydra's sweeper writes it (``put_back_sweep``). An
        ``out_dir`` given with ``-m`` is refused: each job runs in its own folder of the sweep."""
        given = [o for o in OmegaConf.select(config, "hydra.overrides.task", default=[]) or [] if "=" in o]
        if out := next((o for o in given if o.split("=", 1)[0].lstrip("+~") == "out_dir"), None):
            _refuse(
                f"{out} does not apply with -m: every job of a sweep runs in its own folder under "
                f"hydra.sweep.dir; use hydra.sweep.dir={out.split('=', 1)[1]} instead (to resume a sweep's "
                "jobs: -m ... resume=true hydra.sweep.dir=<that sweep's folder>)"
            )
        if (path := self._check(config, "hydra.sweep.dir", "hydra.sweep.dir")) is not None:
            yaml = Path(_key(path)) / "multirun.yaml"
            if OmegaConf.select(config, "resume", default=False) is True and (
                problem := sweep_changed(yaml, given)
            ):
                _refuse(problem)  # before Hydra's sweeper writes anything
            note_run_dir_before(path)
            _SWEEP[:] = [(_key(path), yaml.read_bytes() if yaml.is_file() else None)]

    @staticmethod
    def _check(config, node: str, key: str) -> str | None:
        """The path at ``node`` (None when unset or unresolvable: Hydra's to report); exits 2 when it
        cannot hold a run."""
        try:
            path = OmegaConf.select(config, node)
        except Exception:  # noqa: BLE001 - an unresolvable path is Hydra's to report
            return None
        resume = OmegaConf.select(config, "resume", default=False) is True  # a run's (a sweep's) own folder
        if path is not None and (problem := out_dir_problem(path, key, resume=resume)):
            _refuse(problem)
        return path


def _refuse(problem: str):
    print(f"config error: {problem}", file=sys.stderr, flush=True)
    raise SystemExit(2)  # not an Exception: Hydra lets it through without a traceback


# ------------------------------------------------------------------------------- refused single runs
#: (first folder of the path that did not exist, or None when the run directory existed; the names it
#: held then, or None) of each run directory, noted by ``OutDirCheck`` before Hydra creates it
_BEFORE: dict[str, tuple[Path | None, frozenset[str] | None]] = {}
#: the sweep folder of this process's -m command and its multirun.yaml before Hydra wrote it
_SWEEP: list[tuple[str, bytes | None]] = []


def _key(path) -> str:
    return str(Path(str(path)).expanduser().resolve())


def note_run_dir_before(path) -> None:
    """Record whether run directory ``path`` exists and what it holds, before Hydra creates it: what
    ``discard_refused_run`` may take back."""
    p = Path(_key(path))
    if p.is_dir():
        _BEFORE[str(p)] = (None, frozenset(os.listdir(p)))
        return
    missing = [q for q in (p, *p.parents) if not q.exists()]
    _BEFORE[str(p)] = (missing[-1] if missing else p, None)


def put_back_sweep() -> None:
    """A ``-m`` command that ran no job: its sweep folder's ``multirun.yaml``, which Hydra's sweeper writes
    first, goes back to what it was (absent, or an earlier sweep's), and the folder goes when this process
    created it."""
    if not _SWEEP:
        return
    key, data = _SWEEP[0]
    yaml = Path(key) / "multirun.yaml"
    with contextlib.suppress(OSError):
        if data is not None:
            yaml.write_bytes(data)
        elif yaml.is_file():
            yaml.unlink()
        discard_refused_run(key)


def discard_refused_run(out_dir) -> bool:
    """Take back what this process created in ``out_dir`` for a run that a config error refused, so that the
    refused command leaves nothing behind; True when it did (then write nothing more there)."""
    key = _key(out_dir)
    if key not in _BEFORE:
        return False
    top, before = _BEFORE[key]
    p = Path(key)
    if not p.is_dir():
        return True
    new = set(os.listdir(p)) - set(before or ())
    # what a refused run may have created: the lock and set-up's empty metrics.jsonl (Hydra and the
    # trainer's record write nothing before the checks)
    metrics = p / "metrics.jsonl"
    if not new <= {LOCK_NAME, "metrics.jsonl"} or ("metrics.jsonl" in new and metrics.stat().st_size > 0):
        return False
    for name in new:
        (p / name).unlink()
    if before is None:  # created by this process (Hydra): the folder and the empty ones it made above it
        for d in (p, *p.parents):
            try:
                d.rmdir()
            except OSError:
                break
            if d == top:
                break
    del _BEFORE[key]
    return True


# ------------------------------------------------------------------------------------------ unfinished runs
KILLED = "killed"  # the status readers report for a "running" summary whose process is gone


def _unfinished(run_dir: Path) -> tuple[int | None, str]:
    """(last step with a train/loss in metrics.jsonl, "killed / unfinished (last step S)")."""
    steps = [step_of(r) for r in read_metric_rows(Path(run_dir)) if "train/loss" in r]
    last = max((s for s in steps if s is not None), default=None)
    return last, f"killed / unfinished (last step {last if last is not None else 'none'})"


def _stale(run_dir: Path, summary: dict) -> bool:
    """Whether the process of a "running" run is gone (SIGKILL, the OOM killer, a crash past the ending)."""
    if (run_dir / LOCK_NAME).is_file():
        return not held_by_live_process(run_dir)
    pid = summary.get("pid")
    return isinstance(pid, int) and summary.get("host") == socket.gethostname() and not pid_alive(pid)


def true_status(run_dir: Path, summary: dict) -> tuple[str | None, str | None]:
    """``(status, note)`` of a run as readers should report it: summary.json's status, except that a
    "running" one whose process is gone is ``KILLED``, with a note saying what to do."""
    status, run_dir = summary.get("status"), Path(run_dir)
    if status != "running" or not _stale(run_dir, summary):
        return status, None
    head = f"{_unfinished(run_dir)[1]}: summary.json still said 'running' but no process holds the run"
    max_steps, found = read_resolved_config(run_dir).get("max_steps"), list_checkpoints(run_dir)
    if isinstance(max_steps, int) and found and found[0][0] >= max_steps:  # a resume would find nothing to do
        note = (
            f"{head} directory any more (killed in its ending, after a checkpoint of its last step): its "
            f"training is complete, only the ending's records are missing; sample or evaluate it (python "
            f"eval.py run={run_dir}), a resume has nothing left to run"
        )
    else:
        note = (
            f"{head} directory any more (killed, or crashed past the normal ending); resume it with "
            f"python train.py resume=true out_dir={run_dir}"
        )
    return KILLED, note


def mark_killed_on_resume(run_dir: Path) -> str | None:
    """On resume, under this process's lock: a summary still saying "running" belongs to a run that died
    without its ending, so rewrite it to ``KILLED`` with the last trained step, before anything reads it."""
    summary = read_summary(run_dir)
    if summary.get("status") != "running":
        return None
    last, text = _unfinished(run_dir)
    steps = last if last is not None else summary.get("steps")
    error = f"{text}: no ending was recorded (killed, or a crash past it)"
    write_json_atomic(
        Path(run_dir) / "summary.json", {**summary, "status": KILLED, "steps": steps, "error": error}
    )
    return f"the previous process of this run was {text}; it is resumed now"


# ------------------------------------------------------------------------------------------ Hydra's files
def hydra_files(cfg) -> dict[str, str]:
    """What Hydra would write into this job's ``.hydra/`` (file name -> YAML); {} outside Hydra."""
    if not HydraConfig.initialized():
        return {}
    hydra = HydraConfig.instance().cfg  # {"hydra": HydraConfig.get()}, as Hydra saves it
    return {
        "config.yaml": OmegaConf.to_yaml(cfg),
        "hydra.yaml": OmegaConf.to_yaml(hydra),
        "overrides.yaml": OmegaConf.to_yaml(hydra.hydra.overrides.task),
    }


def write_hydra_files(out_dir: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (Path(out_dir) / ".hydra").mkdir(exist_ok=True)
        (Path(out_dir) / ".hydra" / name).write_text(text)
