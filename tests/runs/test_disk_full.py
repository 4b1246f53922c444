"""A full disk at any write, on a real small tmpfs: before the run starts, at the start-up's summary.json,
mid-line in metrics.jsonl and train.log, at the final summary. Every case ends as status disk_full (exit
1), says so in one message without a traceback, leaves no torn line and no temp file, and prints the
resume command when a checkpoint exists (which then finishes the run once room is made).

The ``fill_disk_*`` faults of tests/faulty_train.py fill the disk just before the write under test.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.faulty_train import FILLER, PAD
from tests.helpers_train import describe, read_jsonl, run_train, summary, train_losses


def _fill(disk: Path) -> None:
    with open(disk / FILLER, "ab", buffering=0) as f:
        for chunk in (1 << 20, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError:
                pass


def _clean_ending(proc, out: Path) -> dict:
    """What every full-disk ending shares: exit 1, one message, no traceback or logging noise, no temp
    file or torn line left; returns summary.json."""
    assert proc.returncode == 1, describe(proc)
    err = proc.stderr
    assert "error: disk full: could not write" in err, describe(proc)
    assert "Traceback" not in err and "Error executing job" not in err, describe(proc)
    assert "Logging error" not in err and "UsageError" not in err, describe(proc)
    assert len(err.splitlines()) < 60, describe(proc)  # W&B's own summary, not a flood
    left = [p.name for p in out.rglob("*") if ".tmp" in p.name or p.name == ".flashgpt.reserve"]
    assert left == [], left
    text = (out / "metrics.jsonl").read_text()
    assert text == "" or text.endswith("\n")
    rows = [json.loads(line) for line in text.splitlines()]  # every line parses: none torn
    assert not any("fault/padding" in r for r in rows)
    log = (out / "train.log").read_text()
    assert log.endswith("\n") and " " * PAD not in log
    s = summary(out)
    assert s["status"] == "disk_full" and "disk full: could not write" in s["error"], s
    assert rows and rows[-1]["status"] == "disk_full"
    return s


def _resume(s: dict, disk: Path):
    """Make room (the filler goes, the disk grows to hold two checkpoints), then run the printed
    resume command as typed."""
    from tests.helpers_train import REPO, train_env
    from tests.runs.test_stop_fail import _as_typed

    (disk / FILLER).unlink()
    subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)

    return subprocess.run(
        _as_typed(s["resume_hint"]),
        cwd=str(REPO),
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_disk_full_before_the_run_starts(tiny, small_disk):
    """Hydra cannot even write .hydra/config.yaml: a clear message, exit 1, no Hydra traceback."""
    _fill(small_disk)
    out = small_disk / "run"
    proc = run_train(tiny(out))
    assert proc.returncode == 1, describe(proc)
    assert f"error: disk full: could not write the run directory {out}" in proc.stderr, describe(proc)
    assert "Nothing was trained" in proc.stderr and "Traceback" not in proc.stderr, describe(proc)


@pytest.mark.slow
def test_disk_full_at_the_start_up_summary(tiny, small_disk):
    out = small_disk / "run"
    proc = run_train(tiny(out, fault__fill_disk_before_summary=1))
    s = _clean_ending(proc, out)
    assert s["steps"] == 0 and s["resume_hint"] is None and "start the run again" in proc.stderr
    assert train_losses(out) == {}


@pytest.mark.slow
@pytest.mark.parametrize("where", ["metrics", "log"])
def test_disk_full_mid_line_keeps_whole_lines_and_resumes(tiny, small_disk, where):
    """The disk fills as step 6's line is written (metrics.jsonl, or train.log with W&B offline too):
    the line is cut back, the run stops at step 6 with checkpoint 4 kept, and the printed resume command
    finishes the run once room is made."""
    out = small_disk / "run"
    fault = {f"fault__fill_disk_before_{where}_at_step": 6}
    proc = run_train(tiny(out, checkpoint__interval=4, wandb__mode="offline", **fault))
    s = _clean_ending(proc, out)
    assert s["steps"] == 6 and s["last_checkpoint"].endswith("step_00000004"), s
    assert f"could not write {out / ('metrics.jsonl' if where == 'metrics' else 'train.log')}" in s["error"]
    assert s["resume_hint"] and s["resume_hint"] in proc.stderr
    assert max(train_losses(out)) == 5  # step 6 stopped at its first record
    resumed = _resume(s, small_disk)
    assert resumed.returncode == 0, describe(resumed)
    assert summary(out)["status"] == "ok" and sorted(train_losses(out)) == list(range(1, 17))


@pytest.mark.slow
def test_disk_full_at_the_final_summary(tiny, small_disk):
    """The last write of a finished run (summary.json "ok") does not fit: disk_full, not a traceback, not
    a summary left "running"."""
    out = small_disk / "run"
    proc = run_train(
        tiny(out, max_steps=4, eval__interval=0, checkpoint__interval=4, fault__fill_disk_before_summary=2)
    )
    s = _clean_ending(proc, out)
    assert s["steps"] == 4 and sorted(train_losses(out)) == [1, 2, 3, 4], s


# ------------------------------------------------------------------------------------------ units


def test_writes_on_a_full_disk_leave_no_torn_line_or_temp_file(small_disk, seed):
    """RunLogger.log, append_line and write_json_atomic on a full tmpfs: DiskFullError, and each file is
    as it was before the failed write (a line longer than the room left in the file's last page)."""
    import random

    from trainer.metrics import RESERVE_NAME, DiskFullError, RunLogger, append_line, write_json_atomic

    rng = random.Random(seed)
    run = small_disk / "run"
    log = RunLogger(run)
    assert (run / RESERVE_NAME).stat().st_size > 0
    log.log(1, {"train/loss": rng.random()})
    append_line(run / "train.log", "step 1")
    write_json_atomic(run / "summary.json", {"status": "running"})
    before = {name: (run / name).read_bytes() for name in ("metrics.jsonl", "train.log", "summary.json")}
    _fill(small_disk)
    with pytest.raises(DiskFullError, match="metrics.jsonl"):
        log.log(2, {"train/loss": rng.random(), "pad": "x" * PAD})
    with pytest.raises(DiskFullError, match="train.log"):
        append_line(run / "train.log", "step 2" + " " * PAD)
    with pytest.raises(DiskFullError, match="summary.json"):
        write_json_atomic(run / "summary.json", {"status": "ok", "pad": "x" * PAD})
    assert {name: (run / name).read_bytes() for name in before} == before
    assert sorted(os.listdir(run)) == sorted([*before, RESERVE_NAME])
    assert log.release_reserve()  # its room takes the ending's records
    write_json_atomic(run / "summary.json", {"status": "disk_full"})
    log.log(2, {"status": "disk_full"})
    log.close()
    assert read_jsonl(run)[-1] == {"step": 2, "status": "disk_full"} and summary(run)["status"] == "disk_full"


@pytest.mark.parametrize("with_checkpoint", [False, True])
def test_failed_run_without_a_checkpoint_is_not_offered_resume(tmp_path, with_checkpoint):
    """A run that filled the disk before its first checkpoint, launched again into the same out_dir: the
    refusal offers resume=true only where a checkpoint exists (resume=true is refused without one)."""
    import json
    from types import SimpleNamespace

    from trainer.checkpoint import ckpt_dir
    from trainer.rundir import RunDirTaken, check_new_run_dir

    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text(json.dumps({"status": "disk_full", "steps": 4, "error": "disk full"}))
    (out / "metrics.jsonl").write_text('{"step": 1, "train/loss": 4.0}\n')
    if with_checkpoint:
        (ckpt_dir(out) / "step_4").mkdir(parents=True)
    with pytest.raises(RunDirTaken) as e:
        check_new_run_dir(SimpleNamespace(resume=False), out)
    assert ("resume=true to continue" in str(e.value)) == with_checkpoint, str(e.value)
    assert "new out_dir" in str(e.value), str(e.value)
