"""Stopping and failing clearly: real train.py processes, real signals, a real full disk (a small tmpfs),
real unwritable out_dirs and real Hydra sweeps. Each test reads back the run directory it left.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers_train import (
    REPO,
    TRAIN,
    describe,
    read_jsonl,
    run_inprocess,
    run_train,
    summary,
    tiny_overrides,
    train_command,
    train_env,
    train_losses,
    val_losses,
)
from trainer import checkpoint as ckpt
from trainer.rundir import LOCK_NAME

pytestmark = pytest.mark.slow


class Train:
    """``python train.py ARGS`` as a background process whose train.log we can watch."""

    def __init__(self, args: list[str], out: Path) -> None:
        self.out = out
        cmd, env = train_command(args)
        self.proc = subprocess.Popen(
            cmd,
            cwd=str(REPO),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def wait_for_log(self, text: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        log = self.out / "train.log"
        while time.monotonic() < deadline and self.proc.poll() is None:
            if log.is_file() and text in log.read_text():
                return
            time.sleep(0.05)
        self.proc.kill()
        out, err = self.proc.communicate()
        pytest.fail(f"never logged {text!r} (exit {self.proc.returncode})\n{out[-3000:]}\n{err[-3000:]}")

    def signal(self, sig: int) -> None:
        assert self.proc.poll() is None, "the run ended before the signal was sent"
        self.proc.send_signal(sig)

    def finish(self, timeout: float = 120) -> tuple[int, str, str]:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        return self.proc.returncode, out, err


# ------------------------------------------------------------------------------------------ signals


#: ``python -c`` this, train.py, ARGS: train.py whose job imports trainer.loop (after Hydra made the run
#: directory, before the trainer handles signals) slowly: "loading" on stdout, then a minute; a signal then
#: stands for one during the seconds torch and Hydra take to load
SLOW_START = """import runpy, sys, time
class Slow:
    def find_spec(self, name, path=None, target=None):
        if name == "trainer.loop":
            print("loading", flush=True)
            time.sleep(60)
sys.meta_path.insert(0, Slow())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

#: ``python -c`` this, train.py, ARGS: train.py whose run() raises KeyboardInterrupt once it has ended, as a
#: second Ctrl-C does while run() cleans up (garbage collection, the CUDA cache) after its handlers are gone
LATE_SIGNAL = """import runpy, sys
import trainer.loop as loop
real = loop.run
def run(*args, **kwargs):
    real(*args, **kwargs)
    raise KeyboardInterrupt
loop.run = run
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_signal_while_the_run_cleans_up_exits_at_once(tiny, tmp_path):
    """Ctrl-C after the run has ended and its handlers are gone: exit 130 with one line, no traceback; the
    run's records stay as they ended."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-c", LATE_SIGNAL, str(TRAIN), *tiny(out)]
    proc = subprocess.run(cmd, cwd=str(REPO), env=train_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 128 + signal.SIGINT, f"{proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr and "interrupted; exiting now" in proc.stderr, proc.stderr
    assert summary(out)["status"] == "ok"


#: ``python -c`` this, train.py, ARGS: train.py that signals itself at interpreter exit, after the run ended
AFTER_THE_END = """import atexit, os, runpy, signal, sys, time
atexit.register(lambda: (os.kill(os.getpid(), int(os.environ["SIG"])), time.sleep(10)))  # runs last
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_after_the_run_ended_keeps_its_exit_status(tiny, tmp_path, sig):
    """A signal once the run has recorded its ending (here at interpreter exit): the run's own exit status
    and one line, no traceback, not 128 + signal for a complete run."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-c", AFTER_THE_END, str(TRAIN), *tiny(out)]
    env = {**train_env(), "SIG": str(int(sig))}
    proc = subprocess.run(cmd, cwd=str(REPO), env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    assert f"{sig.name} after the run ended (ok): exiting with its status" in proc.stderr, proc.stderr
    assert summary(out)["status"] == "ok"


#: ``python -c`` this, train.py, ARGS: train.py whose checks before set-up (the run dir claimed, its lock
#: taken) print "planning", then take a minute
SLOW_CHECKS = """import runpy, sys, time
import trainer.loop as loop
real = loop.resolve_plan
def resolve_plan(*args, **kwargs):
    print("planning", flush=True)
    time.sleep(60)
loop.resolve_plan = resolve_plan
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_signal_during_the_checks_before_set_up_leaves_no_run_dir(tiny, tmp_path):
    """SIGTERM while the config is checked (after the lock is taken, before set-up handles signals): exit
    143 with one line, no traceback, and the folder this start made goes again, its lock too."""
    out = tmp_path / "new" / "run"
    cmd = [sys.executable, "-c", SLOW_CHECKS, str(TRAIN), *tiny(out)]
    proc = subprocess.Popen(
        cmd, cwd=str(REPO), env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert proc.stdout.readline() == b"planning\n", proc.communicate()
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, f"{proc.returncode}\n{stdout}\n{stderr}"
    assert stderr.decode() == "interrupted; exiting now\n", stderr
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("sig, existed", [(signal.SIGINT, False), (signal.SIGTERM, True)])
def test_signal_while_libraries_load_exits_with_one_line(tiny, tmp_path, sig, existed):
    """A signal before the trainer's handlers are installed: exit 128 + signal, one line, no traceback; the
    run directory Hydra made for this start goes again, a folder that existed before stays."""
    out = tmp_path / "new" / "run"
    if existed:
        out.mkdir(parents=True)
    cmd = [sys.executable, "-c", SLOW_START, str(TRAIN), *tiny(out)]
    proc = subprocess.Popen(
        cmd, cwd=str(REPO), env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert proc.stdout.readline() == b"loading\n", proc.communicate()
        assert out.is_dir()  # Hydra made it before the job's imports
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, f"{proc.returncode}\n{stdout}\n{stderr}"
    assert stderr.decode() == "interrupted before training started; nothing was saved\n", stderr
    assert (sorted(os.listdir(out)) == []) if existed else not (tmp_path / "new").exists()


def test_signal_to_a_sweep_says_which_jobs_did_not_run(tiny, tmp_path):
    """SIGTERM during job 0 of a 2-job -m sweep: job 0 stops with its checkpoint and resume command, the
    sweep stops (exit 143), and stderr says that the jobs after job 0 did not run; job 1 has no folder."""
    sweep = tmp_path / "sw"
    args = [a for a in tiny(None, fault__step_sleep_s=0.2) if not a.startswith(("seed=", "out_dir="))]
    run = Train(["-m", *args, "seed=1,2", f"hydra.sweep.dir={sweep}"], sweep / "0_naive_n64_seed-1")
    run.wait_for_log("step      2/16 | loss")
    run.signal(signal.SIGTERM)
    code, stdout, stderr = run.finish()
    assert code == 128 + signal.SIGTERM, f"{code}\n{stdout[-2000:]}\n{stderr[-2000:]}"
    assert "sweep stopped by a signal in job 0" in stderr, stderr
    assert "the jobs after it did not run" in stderr, stderr
    assert summary(sweep / "0_naive_n64_seed-1")["status"] == "interrupted"
    assert not (sweep / "1_naive_n64_seed-2").exists()


def test_signal_during_eval_stops_it_without_another_step(tiny, tmp_path):
    """SIGTERM while the step-8 evaluation runs: that evaluation stops at its next batch and logs no val
    loss, step 9 never runs, step 8 is checkpointed, the resume command is printed and continues the run."""
    out = tmp_path / "run"
    run = Train(tiny(out, checkpoint__interval=4, fault__eval_sleep_s=1.0), out)
    run.wait_for_log("step      8/16 | loss")  # printed just before the evaluation of step 8 starts
    time.sleep(0.3)
    run.signal(signal.SIGTERM)
    code, stdout, stderr = run.finish()
    assert code == 128 + signal.SIGTERM, f"{code}\n{stdout}\n{stderr}"
    assert "finishing the current evaluation" in stderr
    s = summary(out)
    assert s["status"] == "interrupted" and s["steps"] == 8 and s["signal"] == "SIGTERM", s
    assert s["last_checkpoint"].endswith("step_00000008") and Path(s["last_checkpoint"]).is_dir()
    assert max(train_losses(out)) == 8  # no step after the evaluation
    assert list(val_losses(out)) == [0]  # the step-8 evaluation, stopped, leaves no partial mean
    assert "step      8/16 | evaluation stopped by the signal" in stdout, stdout
    assert "resume with:" in stdout and s["resume_hint"] in stdout

    resumed = subprocess.run(
        _as_typed(s["resume_hint"]),
        cwd=str(REPO),
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, describe(resumed)
    assert sorted(train_losses(out)) == list(range(1, 17)) and summary(out)["status"] == "ok"


def test_signal_during_first_eval_runs_no_step(tiny, tmp_path):
    """SIGINT during the evaluation before step 1: it stops, no training step runs, a step-0
    checkpoint is saved and the run ends "interrupted" (exit 130)."""
    out = tmp_path / "run"
    run = Train(tiny(out, fault__eval_sleep_s=1.0), out)
    run.wait_for_log("flashgpt:")  # set-up done; the step-0 evaluation (2 x 1 s) starts next
    time.sleep(0.3)
    run.signal(signal.SIGINT)
    code, stdout, stderr = run.finish()
    assert code == 128 + signal.SIGINT, f"{code}\n{stdout}\n{stderr}"
    assert "finishing the current evaluation" in stderr
    s = summary(out)
    assert s["status"] == "interrupted" and s["steps"] == 0, s
    assert train_losses(out) == {} and list(val_losses(out)) == []
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == ["step_00000000"]
    assert ckpt.load_checkpoint(out / "ckpt" / "step_00000000")["step"] == 0
    assert "resume=true" in stdout


def test_second_signal_records_interrupted_not_running(tiny, tmp_path):
    """A second signal exits at once without a checkpoint; summary.json then says "interrupted" (not
    "running"), names the last checkpoint, and its resume command works as printed."""
    out = tmp_path / "run"
    run = Train(tiny(out, checkpoint__interval=4, fault__eval_sleep_s=1.0), out)
    run.wait_for_log("step      8/16 | loss")
    time.sleep(0.3)
    run.signal(signal.SIGTERM)
    time.sleep(0.3)  # still inside the 2 s evaluation: the graceful stop has not happened yet
    run.signal(signal.SIGINT)
    code, stdout, stderr = run.finish()
    assert code == 128 + signal.SIGINT, f"{code}\n{stdout}\n{stderr}"
    assert "exiting now without a checkpoint" in stderr
    s = summary(out)
    assert s["status"] == "interrupted" and s["exited_at_once"] is True and s["signal"] == "SIGINT", s
    assert s["last_checkpoint"].endswith("step_00000004")
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == ["step_00000004"]
    assert read_jsonl(out)[-1]["status"] == "interrupted"
    assert s["resume_hint"] in stdout

    resumed = subprocess.run(
        _as_typed(s["resume_hint"]),
        cwd=str(REPO),
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, describe(resumed)
    assert "resumed from" in resumed.stdout and "step_00000004" in resumed.stdout
    assert sorted(train_losses(out)) == list(range(1, 17)) and summary(out)["status"] == "ok"


def test_second_signal_during_a_checkpoint_leaves_no_temp_folder(tiny, tmp_path):
    """Signals during the first checkpoint's save: the first waits for it, the second exits at once; the
    half-written temp folder (the size of a checkpoint) goes with the process, nothing stays in ckpt/."""
    out = tmp_path / "run"
    run = Train(tiny(out, checkpoint__interval=4, fault__checkpoint_sleep_s=3.0), out)
    run.wait_for_log("step      4/16 | loss")
    deadline = time.monotonic() + 60
    while not list((out / "ckpt").glob(".tmp-*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list((out / "ckpt").glob(".tmp-*")), "the save never started"
    run.signal(signal.SIGTERM)
    time.sleep(0.3)
    run.signal(signal.SIGTERM)
    code, stdout, stderr = run.finish()
    assert code == 128 + signal.SIGTERM and "exiting now without a checkpoint" in stderr, f"{code}\n{stderr}"
    assert summary(out)["status"] == "interrupted"
    assert list((out / "ckpt").iterdir()) == [], list((out / "ckpt").iterdir())


def _as_typed(command: str) -> list[str]:
    """A printed ``python train.py ...`` command as argv (this interpreter for ``python``)."""
    argv = shlex.split(command)
    assert argv[:2] == ["python", "train.py"], command
    return [sys.executable, str(TRAIN), *argv[2:]]


# ------------------------------------------------------------------------------------------ full disk


def test_full_disk_during_checkpoint_keeps_the_previous_one(tiny, small_disk):
    """The step-8 checkpoint does not fit: the run says the disk is full and what the checkpoint needs,
    ends with status disk_full (exit 1, no traceback), keeps step 4's checkpoint and every metric line;
    with room made, the printed resume command finishes the run."""
    out = small_disk / "run"
    proc = run_train(tiny(out, checkpoint__interval=4))
    assert proc.returncode == 1, describe(proc)
    err = proc.stderr
    assert "Traceback" not in err
    assert "disk full: checkpoint" in err and "step_00000008 needs about" in err and "MiB free" in err
    assert f"the previous checkpoint {out / 'ckpt' / 'step_00000004'} (step 4) is intact" in err
    s = summary(out)
    assert s["status"] == "disk_full" and s["failed_checkpoint_step"] == 8 and s["steps"] == 8, s
    assert s["last_checkpoint"].endswith("step_00000004")
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == ["step_00000004"]  # no temp file left
    state = ckpt.load_checkpoint(out / "ckpt" / "step_00000004")
    assert state["step"] == 4
    assert sorted(train_losses(out)) == list(range(1, 9)) and read_jsonl(out)[-1]["status"] == "disk_full"
    assert s["resume_hint"] in err

    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    resumed = subprocess.run(
        _as_typed(s["resume_hint"]),
        cwd=str(REPO),
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, describe(resumed)
    assert summary(out)["status"] == "ok" and summary(out)["steps"] == 16


# ------------------------------------------------------------------------------------------ out_dir


def test_out_dir_that_is_a_file_is_a_config_error(tiny, tmp_path):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("mine\n")
    for out, expected in (
        (blocker, f"config error: out_dir={blocker} is an existing file, not a directory"),
        (blocker / "run", f"config error: out_dir={blocker / 'run'} cannot be created: {blocker} is a file"),
    ):
        proc = run_train(tiny(out))
        assert proc.returncode == 2, describe(proc)
        assert expected in proc.stderr and "Traceback" not in proc.stderr
    assert blocker.read_text() == "mine\n"  # the user's file is untouched
    proc = run_train(tiny(tmp_path / "notes.txt-run", max_steps=1, eval__at_start=False))  # the hint
    assert proc.returncode == 0, describe(proc)


def test_read_only_out_dir_is_a_config_error(tiny, read_only_dir, capsys):
    for out in (read_only_dir, read_only_dir / "run"):
        proc = run_train(tiny(out))
        assert proc.returncode == 2, describe(proc)
        assert f"config error: out_dir={out} " in proc.stderr and "not writable" in proc.stderr
        assert "Traceback" not in proc.stderr
    # the same check in-process (trainer.loop.run on a composed config)
    outcome = run_inprocess(tiny(read_only_dir), read_only_dir)
    assert (outcome.status, outcome.exit_code) == ("error", 2)
    assert f"out_dir={read_only_dir} is not writable" in capsys.readouterr().err


def test_unwritable_sweep_dir_is_a_config_error(tiny, read_only_dir, tmp_path):
    args = [a for a in tiny(tmp_path / "unused") if not a.startswith("out_dir=")]
    proc = run_train(["-m", *args, "seq_len=32,64", f"hydra.sweep.dir={read_only_dir / 'sweep'}"])
    assert proc.returncode == 2, describe(proc)
    assert f"config error: hydra.sweep.dir={read_only_dir / 'sweep'} cannot be created" in proc.stderr
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------------------ sweeps


def _sweep_args(tiny, tmp_path) -> list[str]:
    args = tiny(tmp_path / "unused", max_steps=2, eval__at_start=False)
    return [a for a in args if not a.startswith("out_dir=")]


def test_sweep_where_every_job_failed_exits_nonzero_and_report_shows_errors(tiny, tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_train(
        ["-m", *_sweep_args(tiny, tmp_path), "batch.tokens_per_step=1000,1001", f"hydra.sweep.dir={sweep}"]
    )
    assert proc.returncode == 2, describe(proc)  # both jobs: config error (2)
    assert "sweep: all 2 jobs failed" in proc.stderr and f"python -m bench.report {sweep}" in proc.stderr
    report = subprocess.run(
        [sys.executable, "-m", "bench.report", str(sweep)],
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stderr
    md = (sweep / "report.md").read_text()
    assert "## Failed runs" in md
    for n in (1000, 1001):
        assert f"batch.tokens_per_step={n} is not a multiple of micro_batch_size(8)" in md
    rows = json.loads((sweep / "report.json").read_text())["runs"]
    assert all(r["status"] == "error" and "batch.tokens_per_step=" in r["error"] for r in rows)


def test_sweep_with_an_oom_and_a_failed_job_goes_on_and_exits_0(tiny, tmp_path):
    """An OOM (status oom, exit 0) is a result of the sweep, so not every job failed: exit 0, and the
    failure is listed; the report shows both jobs' error texts."""
    sweep = tmp_path / "sweep"
    proc = run_train(
        [
            "-m",
            *_sweep_args(tiny, tmp_path),
            "fault.raise_oom_at_step=1",
            "batch.tokens_per_step=1024,1000",
            f"hydra.sweep.dir={sweep}",
        ]
    )
    assert proc.returncode == 0, describe(proc)
    assert "sweep: 1 of 2 jobs failed" in proc.stderr
    statuses = sorted(summary(d)["status"] for d in sweep.iterdir() if (d / "summary.json").is_file())
    assert statuses == ["error", "oom"]
    report = subprocess.run(
        [sys.executable, "-m", "bench.report", str(sweep)],
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stderr
    md = (sweep / "report.md").read_text()
    assert "CUDA out of memory at step 1" in md and "batch.tokens_per_step=1000 is not a multiple" in md


def test_sweep_into_a_used_sweep_dir_says_refused_and_suggests_a_new_one(tiny, tmp_path):
    """The same sweep again into the same hydra.sweep.dir: every job is refused (its directory holds a
    run); the end-of-sweep message says so per job and names a new sweep folder, instead of pointing at
    error summaries that do not exist; the earlier runs' records and Hydra's files of that sweep
    (.hydra/*.yaml and train.log, which the trainer writes only once a job has passed its checks,
    multirun.yaml, which Hydra's sweeper rewrites before any job can be refused, and the lock file's
    text) are byte for byte as they were."""
    sweep = tmp_path / "sweep"
    args = [a for a in _sweep_args(tiny, tmp_path) if not a.startswith("attention=")]
    cmd = ["-m", *args, "attention=naive,sdpa", "eval.interval=0", f"hydra.sweep.dir={sweep}"]
    first = run_train(cmd)
    assert first.returncode == 0, describe(first)
    jobs = [sweep / "0_naive_n64", sweep / "1_sdpa_n64"]

    def records():  # the runs' own records and Hydra's files of the earlier sweep
        files = [sweep / "multirun.yaml"] + [
            j / name
            for j in jobs
            for name in ("summary.json", "metrics.jsonl", "train.log", "config.resolved.yaml", LOCK_NAME)
        ]
        files += sorted(p for j in jobs for p in (j / ".hydra").iterdir())
        return {p: p.read_bytes() for p in files}

    before = records()
    again = run_train(cmd + ["optim.lr=0.0123"])  # another config: Hydra's files would differ
    assert again.returncode == 2, describe(again)
    err = again.stderr
    assert "sweep: all 2 jobs failed" in err, describe(again)
    for j in jobs:
        assert f"refused: {j} already holds a run; use a new hydra.sweep.dir" in err, err
        assert f"config error: out_dir={j} already holds a run" in err, err
    assert f"hydra.sweep.dir={sweep}_2" in err and "multirun/<time>" in err, err
    assert "holds its error" not in err and "bench.report" not in err, err
    assert "runs/<time>_<backend>_n<seq_len>" not in err, err  # a single run's hint: not for -m
    assert records() == before
    assert all(summary(j)["status"] == "ok" for j in jobs)
    # a resume of the sweep with its values in another order: refused before Hydra writes anything
    cmd = ["-m", *args, "attention=sdpa,naive", "eval.interval=0", f"hydra.sweep.dir={sweep}", "resume=yes"]
    swapped = run_train([*cmd, "max_steps=3"])
    assert swapped.returncode == 2 and "Traceback" not in swapped.stderr, describe(swapped)
    assert "config error: resume=true with -m: this sweep's values (attention=sdpa,naive)" in swapped.stderr
    assert "(attention=naive,sdpa)" in swapped.stderr, describe(swapped)
    assert records() == before and sorted(p.name for p in sweep.iterdir()) == sorted(
        ["multirun.yaml", *(j.name for j in jobs)]
    )


def test_sweep_exit_code_lists_refused_jobs_apart(capsys, tmp_path):
    sys.path.insert(0, str(REPO))
    try:
        import train
    finally:
        sys.path.remove(str(REPO))
    sweep = tmp_path / "sw"
    (tmp_path / "sw_2").mkdir()  # taken: the suggestion is the next free name
    refused, err = (str(sweep / "0_a"), train.REFUSED, 2), (str(sweep / "1_b"), "error", 2)
    assert train.sweep_exit_code([refused, err], str(sweep)) == 2
    out = capsys.readouterr().err
    assert f"refused: {sweep / '0_a'} already holds a run; use a new hydra.sweep.dir" in out, out
    assert f"error (exit 2): {sweep / '1_b'}" in out, out
    assert "the other failed runs' summary.json hold their errors" in out, out
    assert f"python -m bench.report {sweep} lists them" in out and f"hydra.sweep.dir={sweep}_3" in out, out
    assert train.sweep_exit_code([refused, ("c", "ok", 0)], str(sweep)) == 0
    out = capsys.readouterr().err
    assert "1 of 2 jobs failed" in out and "refused: " in out and "bench.report" not in out, out


def test_sweep_exit_code_rules(capsys):
    sys.path.insert(0, str(REPO))
    try:
        import train
    finally:
        sys.path.remove(str(REPO))
    ok, oom, cfg_err, nan = ("a", "ok", 0), ("b", "oom", 0), ("c", "error", 2), ("d", "nonfinite", 1)
    assert train.sweep_exit_code([]) == 0  # jobs ran elsewhere (another launcher): nothing to judge
    assert train.sweep_exit_code([ok, oom]) == 0
    assert train.sweep_exit_code([oom, oom]) == 0  # OOM cells are results
    assert train.sweep_exit_code([ok, cfg_err]) == 0 and "1 of 2 jobs failed" in capsys.readouterr().err
    assert train.sweep_exit_code([cfg_err, cfg_err]) == 2
    assert train.sweep_exit_code([cfg_err, nan]) == 1
    assert "all 2 jobs failed" in capsys.readouterr().err


def test_read_only_data_dir_names_a_writable_one(
    char_data, shakespeare_path, read_only_dir, read_only_view, capsys
):
    """Data prepared on a read-only file system: a config error naming data.dir and a folder to use (no
    bare errno); data already prepared there is only read, so a read-only copy of it trains."""
    out = read_only_dir.parent / "run"
    outcome = run_inprocess(tiny_overrides(read_only_dir / "d", shakespeare_path, out, max_steps=1), out)
    err = capsys.readouterr().err
    assert (outcome.status, outcome.exit_code) == ("error", 2), err
    assert f"data.dir={read_only_dir / 'd'} cannot be written (Read-only file system" in err, err
    assert f"pass a folder you can write, e.g. data.dir={Path.home() / 'flashgpt-data' / 'd'} " in err
    assert "Traceback" not in err
    view, out = read_only_view(char_data), read_only_dir.parent / "run2"
    outcome = run_inprocess(tiny_overrides(view, shakespeare_path, out, max_steps=1), out)
    assert (outcome.status, outcome.exit_code) == ("ok", 0), capsys.readouterr().err
