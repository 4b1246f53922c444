"""Hydra's own files of an earlier sweep, put back when a ``-m`` command into its folder is refused.

Under ``-m`` Hydra writes the sweep's ``multirun.yaml`` and, for each job, ``.hydra/config.yaml``,
``hydra.yaml`` and ``overrides.yaml`` in the job's folder and appends to its log file (``train.log``)
before any check of ours can refuse the job; the trainer writes its pid into the folder's lock file
(``.flashgpt.lock``) as it takes the lock, before it finds the folder taken. A job refused because its
folder already holds a run (``trainer.rundir.RunDirTaken``) would leave that run's records mixed with the
refused command's. So ``snapshot_sweep`` (called by ``OutDirCheck.on_multirun_start``, before the sweeper
starts) keeps a copy of those small files, and ``restore_job`` / ``restore_multirun_yaml`` put them back.
"""

from __future__ import annotations

from pathlib import Path

from trainer.rundir import LOCK_NAME

#: Hydra's files of each job folder of the sweep when the command started: path -> bytes
_FILES: dict[Path, bytes] = {}
#: each job folder's log file size then (a refused job's log lines are cut off again)
_LOG_SIZES: dict[Path, int] = {}
#: each job folder's lock file then (who held it last): path -> bytes
_LOCKS: dict[Path, bytes] = {}
_MULTIRUN: list[tuple[Path, bytes]] = []
#: how deep job folders sit under the sweep folder (hydra.sweep.subdir may nest one level)
_JOB_GLOBS = ("*/.hydra/*.yaml", "*/*/.hydra/*.yaml")
LOG_NAME = "train.log"  # ${hydra.job.name}.log of train.py


def snapshot_sweep(sweep_dir) -> None:
    """Copy Hydra's files of the job folders already in ``sweep_dir`` (nothing when it does not exist)."""
    _FILES.clear()
    _LOG_SIZES.clear()
    _LOCKS.clear()
    _MULTIRUN.clear()
    root = Path(sweep_dir)
    if not root.is_dir():
        return
    if (root / "multirun.yaml").is_file():
        _MULTIRUN.append((root / "multirun.yaml", (root / "multirun.yaml").read_bytes()))
    for pattern in _JOB_GLOBS:
        for path in root.glob(pattern):
            _FILES[path] = path.read_bytes()
            log, lock = path.parent.parent / LOG_NAME, path.parent.parent / LOCK_NAME
            if log.is_file():
                _LOG_SIZES[log] = log.stat().st_size
            if lock.is_file():
                _LOCKS[lock] = lock.read_bytes()


def snapshot_run(run_dir) -> None:
    """The same copy for one existing run directory of a single run (``OutDirCheck.on_run_start``, before
    Hydra rewrites its ``.hydra/`` and appends to its log): a resume refused by a config error, or one
    that finds the run finished, puts them back (``restore_job``) and so leaves the run as it was."""
    root = Path(run_dir)
    if not root.is_dir():
        return
    for path in root.glob(".hydra/*.yaml"):
        _FILES[path] = path.read_bytes()
    log, lock = root / LOG_NAME, root / LOCK_NAME
    if log.is_file():
        _LOG_SIZES[log] = log.stat().st_size
    if lock.is_file():
        _LOCKS[lock] = lock.read_bytes()


def restore_job(run_dir) -> bool:
    """Put back the ``.hydra/*.yaml`` files, the log length and the lock file's text that ``run_dir`` had
    when the sweep started, removing ``.hydra`` files Hydra added since; True when ``run_dir`` was in the
    snapshot. (The lock file is rewritten in place: the same inode, so a lock held on it stays held.)"""
    hydra_dir = Path(run_dir) / ".hydra"
    kept = {p: data for p, data in _FILES.items() if p.parent == hydra_dir}
    if not kept:
        return False
    for path in hydra_dir.glob("*.yaml"):
        if path not in kept:
            path.unlink()
    for path, data in kept.items():
        if not path.is_file() or path.read_bytes() != data:
            path.write_bytes(data)
    log = Path(run_dir) / LOG_NAME
    size = _LOG_SIZES.get(log)
    if size is not None and log.is_file() and log.stat().st_size > size:
        with open(log, "r+b") as f:
            f.truncate(size)
    lock = Path(run_dir) / LOCK_NAME
    if lock in _LOCKS and lock.is_file() and lock.read_bytes() != _LOCKS[lock]:
        with open(lock, "r+b") as f:
            f.truncate(0)
            f.write(_LOCKS[lock])
    return True


def restore_multirun_yaml() -> bool:
    """Put back the sweep folder's ``multirun.yaml`` (for a command whose every job was refused)."""
    if not _MULTIRUN:
        return False
    path, data = _MULTIRUN[0]
    path.write_bytes(data)
    return True
