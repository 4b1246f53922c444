"""Train a GPT with a chosen attention backend (Hydra entry point).

    python train.py                                         # GPT-2 124M, sdpa, seq_len 1024
    python train.py experiment=cpu_tiny attention=naive     # tiny model on the CPU
    python train.py attention=sdpa seq_len=8192             # block size follows seq_len
    python train.py resume=true out_dir=runs/<run>          # continue it with its saved config
    python train.py -m experiment=context_sweep attention=naive,sdpa,flash seq_len=1024,2048,4096,8192,16384
    torchrun --nproc_per_node=N train.py ...                # DDP (NCCL on GPU, gloo on CPU)
    torchrun --nproc_per_node=N train.py model=gpt2-xl parallel=fsdp   # FSDP2, DCP checkpoints

Run directory (``out_dir``, = Hydra's run dir): ``config.resolved.yaml``, ``.hydra/``, ``metrics.jsonl``,
``summary.json``, ``train.log``, ``ckpt/``, ``wandb/``.
Exit status: 0 ok (also after a CUDA OOM, see ``oom_exit_code``), 1 non-finite loss, a checkpoint that
could not be written or a full disk at any write (status disk_full), 2 config error (under torchrun: one
``config error`` line from rank 0, every rank exits 2; torchrun then prints its own failure summary),
128 + signal after SIGTERM/SIGINT (checkpoint saved).
A ``-m`` sweep goes on past failed jobs and exits 0, unless every job failed: then it exits with their
common status (else 1). The training loop is in ``trainer/loop.py``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path


def _interrupted_at_start(signum, frame) -> None:  # noqa: ARG001 - signal API
    """SIGINT/SIGTERM while the libraries load (seconds), before ``run`` handles signals: exit 128 + signal
    with one line, not a KeyboardInterrupt traceback or a silent kill; the run directory Hydra made for
    this start goes again (``discard_refused_run``: only what this process created)."""
    with contextlib.suppress(Exception):  # not made yet, or the helpers not loaded yet: nothing to take back
        rundir = sys.modules["trainer.rundir"]
        rundir.discard_refused_run(_run_dir_known())
        rundir.put_back_sweep()  # -m: no job has run yet
    if int(os.environ.get("RANK", "0")) == 0:
        print("interrupted before training started; nothing was saved", file=sys.stderr, flush=True)
    os._exit(128 + signum)


def _after_the_end(status: str, exit_code: int):
    """The handler once a single run has recorded its ending (summary.json, W&B closed): a signal during
    the teardown that follows exits with the run's own status and one line, not 128 + signal unannounced."""

    def handler(signum, frame) -> None:  # noqa: ARG001 - signal API
        if int(os.environ.get("RANK", "0")) == 0:
            name = signal.Signals(signum).name
            print(
                f"{name} after the run ended ({status}): exiting with its status", file=sys.stderr, flush=True
            )
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os._exit(exit_code)

    return handler


# the signals handled here (none where train.py is imported, e.g. by tests)
_START_SIGNALS = (
    {s: signal.signal(s, _interrupted_at_start) for s in (signal.SIGINT, signal.SIGTERM)}
    if __name__ == "__main__"
    else {}
)

import hydra  # noqa: E402 - after the handler: importing them takes seconds
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.types import RunMode  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

import trainer.config  # noqa: E402, F401 - stores the schema and the model presets in Hydra's ConfigStore

_RANK_DIR_PREFIX = "flashgpt-rank"
# (run dir, status, exit code) of each job of a -m sweep run in this process (Hydra's basic launcher);
# status REFUSED: the job's directory already held a run (of an earlier sweep), left as it was
_SWEEP_JOBS: list[tuple[str, str, int]] = []
REFUSED = "refused"
_SWEEP_DIR: list[str] = []  # the sweep folder (hydra.sweep.dir), once known


@hydra.main(config_path="configs", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from trainer import rundir
    from trainer.endings import SignalInterrupt
    from trainer.fields import in_job
    from trainer.loop import run

    # from here a signal outside the trainer's own handlers (set-up, then trainer/signals.py) raises, in the
    # checks before set-up or the clean-up after the run: the except below ends the process
    def interrupt(signum, frame):  # noqa: ARG001 - signal API
        raise SignalInterrupt(signum)

    for sig in _START_SIGNALS:
        signal.signal(sig, interrupt)
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    out_dir = Path(hc.runtime.output_dir)
    try:
        with in_job():  # its exceptions are no config errors
            outcome = run(cfg, out_dir=out_dir, multirun=multirun, overrides=list(hc.overrides.task))
    except KeyboardInterrupt as e:  # before set-up (nothing of the run written yet: its lock goes), or after
        rundir.discard_refused_run(out_dir)
        if out_dir.name.startswith(_RANK_DIR_PREFIX):
            shutil.rmtree(out_dir, ignore_errors=True)
        if int(os.environ.get("RANK", "0")) == 0:
            print("interrupted; exiting now", file=sys.stderr, flush=True)
        os._exit(128 + getattr(e, "signum", signal.SIGINT))
    if out_dir.name.startswith(_RANK_DIR_PREFIX):  # a non-main rank's throwaway Hydra dir
        shutil.rmtree(out_dir, ignore_errors=True)
    if not multirun:  # a sweep's next job installs its own handlers
        for sig in _START_SIGNALS:
            signal.signal(sig, _after_the_end(outcome.status, outcome.exit_code))
    if multirun and int(os.environ.get("RANK", "0")) == 0:
        status = REFUSED if outcome.taken_dir else outcome.status
        _SWEEP_JOBS.append((str(out_dir), status, outcome.exit_code))
        _SWEEP_DIR[:] = [str(hc.sweep.dir)]
    if outcome.exit_code == 0:
        return
    if multirun and outcome.status != "interrupted":
        return  # the sweep goes on; the run's status is in its summary.json / W&B summary
    if multirun and int(os.environ.get("RANK", "0")) == 0:  # a signal stops the whole sweep: say so
        print(
            f"sweep stopped by a signal in job {hc.job.num} ({out_dir}): the jobs after it did not run. "
            f"Continue this job with the resume command above; re-launch the others with -m and their "
            f"values (python -m bench.report {hc.sweep.dir} lists the jobs that ran)",
            file=sys.stderr,
            flush=True,
        )
    sys.exit(outcome.exit_code)


def sweep_exit_code(jobs: list[tuple[str, str, int]], sweep_dir: str | None = None) -> int:
    """Exit status of a finished sweep from its jobs' (run dir, status, exit code): 0 when any job
    succeeded (an OOM with ``oom_exit_code=0`` counts as a result, not a failure) or none ran here; when
    every job failed, their common exit code, or 1 when they differ. Prints which jobs failed; a job
    ``REFUSED`` because its directory already holds a run is listed as such, with a new sweep folder to
    use (that run's summary.json is untouched and holds no error)."""
    failed = [j for j in jobs if j[2] != 0]
    if not failed:
        return 0
    sweep = sweep_dir or Path(failed[0][0]).parent
    listing = "\n".join(
        f"  refused: {run_dir} already holds a run; use a new hydra.sweep.dir"
        if status == REFUSED
        else f"  {status} (exit {code}): {run_dir}"
        for run_dir, status, code in failed
    )
    refused = sum(status == REFUSED for _, status, _ in failed)
    notes = []
    if len(failed) == len(jobs) and refused < len(failed):
        whose = (
            "the other failed runs' summary.json hold their errors"
            if refused
            else "each run's summary.json holds its error"
        )
        notes.append(f"{whose}; python -m bench.report {sweep} lists them")
    if refused:
        notes.append(
            f"the refused jobs ran nothing: {sweep} holds an earlier sweep's runs, kept as they were; run "
            f"the sweep again with a new hydra.sweep.dir (e.g. hydra.sweep.dir={_free_sibling(Path(sweep))}, "
            "or leave it unset for a new multirun/<time> folder)"
        )
    head = f"{len(failed)} of {len(jobs)}" if len(failed) < len(jobs) else f"all {len(jobs)}"
    print(f"sweep: {head} jobs failed:\n{listing}" + "".join(f"\n{n}" for n in notes), file=sys.stderr)
    if len(failed) < len(jobs):
        return 0
    codes = {code for _, _, code in failed}
    return codes.pop() if len(codes) == 1 else 1


def _free_sibling(sweep: Path) -> Path:
    """``<sweep>_2`` (or ``_3``, ...): a folder beside ``sweep`` that does not exist yet."""
    n = 2
    while sweep.with_name(f"{sweep.name}_{n}").exists():
        n += 1
    return sweep.with_name(f"{sweep.name}_{n}")


def _quiet_non_main_ranks() -> None:
    """Under torchrun, only rank 0 owns the run directory: other ranks get a throwaway Hydra dir and log
    nothing (their out_dir is rank 0's, broadcast in ``trainer.loop.run``)."""
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0 or any(a in ("-m", "--multirun") for a in sys.argv[1:]):
        return
    extra = ["hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    if not any(a.startswith("hydra.run.dir=") for a in sys.argv[1:]):
        extra.append(f"hydra.run.dir={tempfile.gettempdir()}/{_RANK_DIR_PREFIX}{rank}-{os.getpid()}")
    sys.argv.extend(extra)


def main_reporting_config_errors() -> int:
    """``main()`` with every config mistake Hydra/OmegaConf find while composing printed as ``config error:
    <key and a valid value>``, exit status 2, no traceback (``trainer.fields.report_config_errors``), and a
    full disk before the run could record itself said in one line. Returns the process exit status."""
    from trainer.config import TrainConfig
    from trainer.fields import report_config_errors
    from trainer.metrics import disk_full_in

    empty = empty_dir_override(sys.argv[1:]) or flag_between_overrides(sys.argv[1:])
    if empty:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"config error: {empty}", file=sys.stderr, flush=True)
        return 2
    try:  # under torchrun every rank finds a config error; one line says it
        code = report_config_errors(main, TrainConfig, say=int(os.environ.get("RANK", "0")) == 0)
    except Exception as e:
        if disk_full_in(e) is not None:  # Hydra's own files, the lock: before the run could record itself
            from trainer.endings import report_disk_full

            return report_disk_full(e, _run_dir_known()).exit_code
        raise
    if code:
        if not _SWEEP_JOBS:  # a -m command refused before its first job: no sweep folder left behind
            from trainer.rundir import put_back_sweep

            put_back_sweep()
        return 2
    if _SWEEP_JOBS and all(status == REFUSED for _, status, _ in _SWEEP_JOBS):
        from trainer.rundir import put_back_sweep

        put_back_sweep()  # the sweeper rewrote the earlier sweep's multirun.yaml: nothing ran
    return sweep_exit_code(_SWEEP_JOBS, next(iter(_SWEEP_DIR), None))


def flag_between_overrides(args: list[str]) -> str | None:
    """Why a Hydra flag between overrides (``python train.py seq_len=64 -m max_steps=2``) is refused, else
    None: Hydra's argparse takes one run of overrides and calls the rest "unrecognized arguments"."""
    is_override = ["=" in a and not a.startswith("-") for a in args]
    at = [i for i, o in enumerate(is_override) if o]
    late = [a for i, a in enumerate(args) if a.startswith("-") and at and at[0] < i < at[-1]]
    if not late:
        return None
    flags = [a for a, o in zip(args, is_override, strict=True) if not o]  # with their values (--cfg job)
    overrides = [a for a, o in zip(args, is_override, strict=True) if o]
    return (
        f"{late[0]} must come before the overrides (Hydra reads its flags first): "
        f"python train.py {' '.join(flags + overrides)}"
    )


def empty_dir_override(args: list[str]) -> str | None:
    """Why an override that names the run's folder is empty (``out_dir=``, e.g. an unset shell variable
    in a job script), else None: Hydra would take it as the current directory and write the run there."""
    for arg in args:
        key, eq, value = arg.lstrip("+~").partition("=")
        if eq and key in ("out_dir", "hydra.run.dir", "hydra.sweep.dir") and value.strip(" '\"") == "":
            example = "multirun/sweep1" if key == "hydra.sweep.dir" else "runs/run1"
            return (
                f"{key}={value} is empty (an unset shell variable?): the run would be written into the "
                f"current directory {os.getcwd()}. Pass a folder, e.g. {key}={example}, or leave {key} "
                "out for a new folder under runs/ (multirun/ with -m)"
            )
    return None


def _run_dir_known() -> str | None:
    """The run directory of this command where it is known: Hydra's, else the one named on the command
    line (None when neither is)."""
    try:
        return str(HydraConfig.get().runtime.output_dir)
    except Exception:  # noqa: BLE001 - Hydra has not set it up, or has cleared it after the failure
        pass
    for key in ("hydra.run.dir=", "out_dir="):
        given = [a[len(key) :] for a in sys.argv[1:] if a.startswith(key)]
        if given and given[-1]:
            return given[-1]
    return None


def exit_status() -> int:
    """``main_reporting_config_errors()``, with a run's own ``sys.exit(code)`` turned into its code."""
    try:
        return main_reporting_config_errors()
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return int(e.code or 0)
        raise


if __name__ == "__main__":
    _quiet_non_main_ranks()
    code = exit_status()
    if code == 2:  # a config error: under torchrun every rank exits 2 (not killed by the agent first)
        from trainer.dist import exit_together

        exit_together(code)
    sys.exit(code)
