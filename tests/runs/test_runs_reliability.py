"""Runs that never mix and never lose a record (real train.py processes, real files, offline W&B read back).

1. Launches in the same second get a directory each (single runs, multirun sweeps, torchrun), and two live
   processes never share one; a save never deletes another live process's temp file.
2. resume=true on a finished run changes nothing; raising max_steps is logged; a new run never reuses a
   directory whose run trained and then failed.
3. A resume from a checkpoint older than the last logged step sets the abandoned steps apart
   (metrics.abandoned.<a>-<b>.jsonl), keeps metrics.jsonl increasing, forks the W&B run at the
   checkpoint, and the tools read only the live branch.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers_train import (
    REPO,
    copy_run,
    describe,
    read_jsonl,
    run_train,
    summary,
    train_command,
    train_losses,
)
from tests.wandb_offline import (
    WandbFileIncomplete,
    find_wandb_files,
    read_offline_run,
    read_wandb_file,
    wait_run_file_finished,
)
from trainer import checkpoint as ckpt

pytestmark = pytest.mark.slow

TOKEN_DIR = re.compile(r"^\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_naive_n32_[a-z0-9]{6}$")


def _popen(args: list[str], cwd: Path, launcher: list[str] | None = None) -> subprocess.Popen:
    cmd, env = train_command(args, launcher)
    return subprocess.Popen(
        cmd,
        cwd=str(cwd),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(procs: list[subprocess.Popen], timeout: float = 300) -> list[tuple[int, str, str]]:
    out = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=timeout)
        finally:
            if p.poll() is None:
                p.kill()
        out.append((p.returncode, o, e))
    return out


def _steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(run_dir)]


def _assert_one_clean_run(run_dir: Path, max_steps: int) -> dict:
    """One run's records: every step logged once, in order, its own W&B run and checkpoints."""
    s = summary(run_dir)
    assert s["status"] == "ok" and s["steps"] == max_steps and s["out_dir"] == str(run_dir), s
    rows = [r for r in read_jsonl(run_dir) if "train/loss" in r]
    assert [r["step"] for r in rows] == list(range(1, max_steps + 1))
    assert _steps(run_dir) == sorted(_steps(run_dir))
    assert [r for r in read_jsonl(run_dir) if r.get("event") == "resume"] == []
    wb = read_offline_run(run_dir)
    assert wb["run_id"] == s["wandb_run_id"] and len(find_wandb_files(run_dir)) == 1
    assert sorted(h["_step"] for h in wb["history"] if "train/loss" in h) == list(range(1, max_steps + 1))
    state = ckpt.load_checkpoint(Path(s["last_checkpoint"]))
    assert state["wandb_run_id"] == s["wandb_run_id"] and Path(s["last_checkpoint"]).parent.parent == run_dir
    return s


# ------------------------------------------------------------------------------------------ 1. dirs


def test_same_second_launches_get_their_own_dirs(tiny, tmp_path):
    """Two launches with the same name prefix (as two launches in the same second get) and two with the
    default name, all at once: four directories, each holding exactly one run."""
    args = tiny(
        None, max_steps=4, eval__interval=2, checkpoint__interval=2, wandb__mode="offline", seq_len=32
    )
    same = [*args, "run_name=clash_${run_token:}"]
    procs = [_popen(same, tmp_path), _popen(same, tmp_path), _popen(args, tmp_path), _popen(args, tmp_path)]
    results = _finish(procs)
    for rc, o, e in results:
        assert rc == 0, f"{rc}\n{o[-2000:]}\n{e[-2000:]}"
    dirs = sorted(p for p in (tmp_path / "runs").iterdir())
    assert len(dirs) == 4, dirs
    clash = [d for d in dirs if d.name.startswith("clash_")]
    default = [d for d in dirs if not d.name.startswith("clash_")]
    assert len(clash) == 2 and all(re.fullmatch(r"clash_[a-z0-9]{6}", d.name) for d in clash), clash
    assert len(default) == 2 and all(TOKEN_DIR.match(d.name) for d in default), default
    ids = {_assert_one_clean_run(d.resolve(), 4)["wandb_run_id"] for d in dirs}
    assert len(ids) == 4


def test_two_live_processes_never_share_an_out_dir(tiny, tmp_path):
    """A second launch into the out_dir of a live run is refused (exit 2) and writes nothing there."""
    out = tmp_path / "run"
    # 16 steps of >= 3 s: the two refused launches (each a Python start, seconds on 2 loaded cores) fit
    first = _popen(tiny(out, fault__step_sleep_s=3.0, wandb__mode="offline"), REPO)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and first.poll() is None:
            if (out / "metrics.jsonl").is_file() and any("train/loss" in r for r in read_jsonl(out)):
                break
            time.sleep(0.05)
        assert first.poll() is None, "the first run ended too early"
        hydra_files = {p: p.read_bytes() for p in (out / ".hydra").iterdir()}
        for extra in ({}, {"resume": True}):
            second = run_train(tiny(out, wandb__mode="offline", **extra))
            # refused before Hydra writes: the live run's .hydra/*.yaml are untouched
            assert {p: p.read_bytes() for p in (out / ".hydra").iterdir()} == hydra_files
            assert first.poll() is None, "the first run ended before the second was refused"
            assert second.returncode == 2, describe(second)
            assert "in use by another live train.py process (pid" in second.stderr, second.stderr
            assert f"pid {first.pid} " in second.stderr and "Traceback" not in second.stderr
    finally:
        ((rc, o, e),) = _finish([first])
    assert rc == 0, f"{o[-2000:]}\n{e[-2000:]}"
    _assert_one_clean_run(out, 16)


def test_multirun_launches_get_their_own_sweep_dirs(tiny, tmp_path):
    args = [a for a in tiny(None, max_steps=2, seq_len=32, eval__interval=0) if not a.startswith("seed=")]
    sweep = ["-m", *args, "seed=1,2", "wandb.mode=offline"]
    results = _finish([_popen(sweep, tmp_path), _popen(sweep, tmp_path)])
    for rc, o, e in results:
        assert rc == 0, f"{rc}\n{o[-2000:]}\n{e[-2000:]}"
    sweeps = sorted((tmp_path / "multirun").iterdir())
    assert len(sweeps) == 2 and all(re.fullmatch(r"[\d_-]+_[a-z0-9]{6}", p.name) for p in sweeps), sweeps
    for sw in sweeps:
        jobs = sorted(p.name for p in sw.iterdir() if p.is_dir() and not p.name.startswith("."))
        assert jobs == ["0_naive_n32_seed-1", "1_naive_n32_seed-2"], jobs  # what the sweep varies
        for j in jobs:
            _assert_one_clean_run((sw / j).resolve(), 2)
            assert read_offline_run(sw / j)["group"] == sw.name


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_torchrun_ranks_agree_on_rank0s_new_dir(tiny, tmp_path, parallel):
    """Under torchrun (ddp and fsdp alike) rank 0 alone names, logs and owns the run: one directory, one
    W&B run, every step logged once; the fsdp checkpoint is a DCP directory whose record names that run."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    args = tiny(None, max_steps=2, seq_len=32, eval__interval=0, wandb__mode="offline", parallel=parallel)
    ((rc, o, e),) = _finish([_popen(args, tmp_path, launcher)])
    assert rc == 0, f"{o[-3000:]}\n{e[-3000:]}"
    dirs = list((tmp_path / "runs").iterdir())
    assert len(dirs) == 1 and TOKEN_DIR.match(dirs[0].name), dirs
    s = _assert_one_clean_run(dirs[0].resolve(), 2)
    assert s["world_size"] == 2


def test_save_leaves_a_live_processs_temp_file(tmp_path):
    """save_checkpoint removes its own and dead processes' temp directories, never a live writer's."""
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        d = ckpt.ckpt_dir(tmp_path)
        d.mkdir(parents=True)
        files = {
            who: d / f".tmp-{pid}-step_00000009"
            for who, pid in (("live", live.pid), ("dead", dead.pid), ("own", os.getpid()))
        }
        for f in files.values():
            f.mkdir()
            (f / "__0_0.distcp").write_bytes(b"partial")
        model = torch.nn.Linear(2, 2)
        ckpt.save_checkpoint(model, torch.optim.AdamW(model.parameters()), {"step": 1}, tmp_path, 1, keep=3)
        assert (files["live"] / "__0_0.distcp").read_bytes() == b"partial"
        assert not files["dead"].exists() and not files["own"].exists()
    finally:
        live.kill()
        live.wait()


# ------------------------------------------------------------------------------------------ 2. reuse


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    """Every file of a run directory but those every command touches: Hydra's .hydra/ and its log lines
    in train.log, the lock's holder line, wandb's debug logs."""
    return {
        str(p.relative_to(run_dir)): p.read_bytes()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file()
        and ".hydra" not in p.parts
        and "logs" not in p.parts
        and p.name not in (".flashgpt.lock", "train.log")
        and not p.name.startswith("debug")
    }


def test_resume_of_a_finished_run_changes_nothing(tiny, tmp_path):
    out = tmp_path / "run"
    base = dict(optim__decay_steps=None, wandb__mode="offline")  # cosine decay over max_steps
    proc = run_train(tiny(out, max_steps=8, **base))
    assert proc.returncode == 0, describe(proc)
    before = _snapshot(out)
    s0 = summary(out)
    assert s0["final/val_loss"] is not None and "perf/tokens_per_sec" in s0
    rows = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    val_rows = [r for r in rows if "val/loss" in r]
    assert s0["final/val_step"] == val_rows[-1]["step"] and s0["final/val_loss"] == val_rows[-1]["val/loss"]

    again = run_train(tiny(out, max_steps=8, resume=True, **base))
    assert again.returncode == 0, describe(again)
    assert "is already finished: 8 of max_steps=8 steps done; nothing was changed" in again.stdout
    assert "raise max_steps" in again.stdout and "cosine LR schedule" in again.stdout
    assert _snapshot(out) == before  # summary, metrics, config.resolved.yaml, checkpoints, W&B files
    wb = read_offline_run(out)
    assert len(find_wandb_files(out)) == 1 and wb["summary"]["final/val_loss"] == s0["final/val_loss"]

    more = run_train(tiny(out, max_steps=12, resume=True, **base))
    assert more.returncode == 0, describe(more)
    assert "max_steps changed on resume: 8 -> 12 (explicit choice); the cosine LR schedule" in more.stdout
    event = [r for r in read_jsonl(out) if r.get("event") == "resume"]
    assert len(event) == 1 and "max_steps changed on resume: 8 -> 12" in event[0]["notes"][0]
    assert sorted(train_losses(out)) == list(range(1, 13)) and _steps(out) == sorted(_steps(out))
    wb = read_offline_run(out)
    assert wb["run_id"] == s0["wandb_run_id"] and "max_steps changed" in wb["config"]["resume_notes"][0]
    assert sorted(h["_step"] for h in wb["history"] if "train/loss" in h) == list(range(1, 13))


def test_new_run_never_reuses_a_run_that_trained_then_failed(tiny, tmp_path):
    out = tmp_path / "run"
    # refused before training (config error): nothing written, the path stays free for a new run
    bad = run_train(tiny(out, max_steps=8, batch__tokens_per_step=1000))
    assert bad.returncode == 2 and not out.exists(), describe(bad)
    out.mkdir()
    # trains 4 steps, then its checkpoint save fails (ckpt/ is a file): status error after steps
    (out / "ckpt").write_text("not a directory")
    failed = run_train(tiny(out, max_steps=8, checkpoint__interval=4, wandb__mode="offline"))
    assert failed.returncode == 1, describe(failed)
    s = summary(out)
    assert s["status"] in ("error", "save_failed") and s["steps"] == 4, s
    before = _snapshot(out)
    (out / "ckpt").unlink()
    before.pop("ckpt")
    again = run_train(tiny(out, max_steps=8, wandb__mode="offline"))
    assert again.returncode == 2, describe(again)
    err = again.stderr
    assert err.startswith("config error: out_dir=") and "started training and then failed" in err
    assert "after 4 steps" in err and "resume=true" in err and "Traceback" not in err
    assert _snapshot(out) == before


# ------------------------------------------------------------------------------------------ 3. replays


@pytest.fixture(scope="module")
def stopped_after_10(tmp_path_factory, tiny) -> Path:
    """A 16-step run (checkpoints every 4, offline W&B) that ends cleanly after logging step 10 (a simulated
    OOM at step 11): trained once; the replay tests resume copies of it."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    proc = run_train(tiny(out, fault__raise_oom_at_step=11, checkpoint__interval=4, wandb__mode="offline"))
    assert proc.returncode == 0 and summary(out)["status"] == "oom", describe(proc)
    return out


@pytest.mark.parametrize("how", ["between", "corrupt", "deleted", "killed"])
def test_resume_behind_the_last_logged_step(request, reference_run, tiny, tmp_path, how):
    """Checkpoints every 4 steps; the run stopped after logging step 10 (a copy of ``stopped_after_10``), or
    was SIGKILLed after step 5 (a copy of conftest's ``killed_run``). The resume replays from the newest
    loadable checkpoint; only the live branch is read back."""
    from bench import compare, report

    base = dict(checkpoint__interval=4, wandb__mode="offline")
    source = request.getfixturevalue("killed_run" if how == "killed" else "stopped_after_10")
    out = copy_run(source, tmp_path / "run")
    assert summary(out)["status"] == ("running" if how == "killed" else "oom")
    first_rows = read_jsonl(out)
    first_losses = train_losses(out)
    last = max(first_losses)
    parent_id = (out / "wandb_run_id.txt").read_text().strip()
    if how == "corrupt":
        (out / "ckpt" / "step_00000008" / ckpt.RECORD).write_bytes(b"garbage")
    elif how == "deleted":
        shutil.rmtree(out / "ckpt" / "step_00000008")
    k = {"between": 8, "corrupt": 4, "deleted": 4}.get(how) or max(s for s, _ in ckpt.list_checkpoints(out))
    assert last > k

    resumed = run_train(tiny(out, resume=True, **base))
    assert resumed.returncode == 0, describe(resumed)
    why = {
        "between": "no checkpoint was saved after step 8",
        "corrupt": "step_00000008 do not load",
        "deleted": "step_00000008 is missing (deleted)",
        "killed": "(status killed) between",
    }[how]
    assert f"replaying steps {k + 1}-{last}: the newest loadable checkpoint is step {k}" in resumed.stdout
    assert why in resumed.stdout and f"metrics.abandoned.{k + 1}-{last}.jsonl" in resumed.stdout

    # the live metrics.jsonl: steps never go back, each step trained once, the uninterrupted losses
    assert _steps(out) == sorted(_steps(out))
    live = [r["step"] for r in read_jsonl(out) if "train/loss" in r]
    assert live == list(range(1, 17))
    assert train_losses(out) == train_losses(reference_run)
    # the abandoned branch is kept, apart
    abandoned = out / f"metrics.abandoned.{k + 1}-{last}.jsonl"
    gone = [json.loads(line) for line in abandoned.read_text().splitlines()]
    assert {r["step"]: r["train/loss"] for r in gone if "train/loss" in r} == {
        s: v for s, v in first_losses.items() if s > k
    }
    assert len(gone) + len([r for r in read_jsonl(out) if r["step"] <= k]) >= len(first_rows)
    s = summary(out)
    assert s["status"] == "ok" and s["replay"]["replayed_steps"] == [k + 1, last]
    assert s["replay"]["wandb_parent"] == {"run_id": parent_id, "step": k}

    # W&B: a fork at step k; read back it holds each step once, with the live values
    wb = read_offline_run(out)
    assert wb["run_id"] == s["wandb_run_id"] != parent_id
    assert wb["parents"] == [{"run_id": parent_id, "step": k, "metric": "_step"}]
    assert wb["config"]["wandb_parent"] == {"run_id": parent_id, "step": k}
    hist = [h for h in wb["history"] if "train/loss" in h]
    parent = [f for f in find_wandb_files(out) if f.name == f"run-{parent_id}.wandb"]
    kept = {h["_step"] for f in parent for h in read_wandb_file(f)["history"] if "train/loss" in h}
    # a SIGKILLed offline run may leave an empty .wandb file (wandb had not flushed it): then only the
    # fork's own steps can be read back
    first = 1 if how != "killed" or kept else k + 1
    assert [h["_step"] for h in hist] == list(range(first, 17))
    live_losses = {st: v for st, v in train_losses(out).items() if st >= first}
    assert {h["_step"]: h["train/loss"] for h in hist} == pytest.approx(live_losses, rel=1e-12)
    if how != "killed":
        assert set(range(k + 1, last + 1)) <= kept  # the parent keeps the abandoned steps

    # the tools read the live branch only
    cmp = compare.compare_pair(compare.load_run(reference_run), compare.load_run(out))
    assert cmp["aligned_steps"] == 16 and cmp["max_abs_diff"] == 0.0
    row = report.summarize_run(out, tmp_path)
    assert row["steps"] == 16 and row["status"] == "ok"


def test_tools_read_the_live_branch_of_older_files(tmp_path):
    """metrics.jsonl written before replays were set apart (steps 1..10, then a resume from 8 to 12):
    bench.compare and bench.report see steps 9 and 10 of the replay, not of the abandoned branch."""
    from bench import common as _rundir
    from bench import compare

    run = tmp_path / "old"
    run.mkdir()
    rows = [{"step": s, "train/loss": 10.0 + s} for s in range(1, 11)]
    rows += [{"step": 10, "status": "oom"}, {"step": 8, "event": "resume"}]
    rows += [{"step": s, "train/loss": 1.0 * s} for s in range(9, 13)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({"status": "ok", "steps": 12}))
    loaded = compare.load_run(run)
    assert loaded.train == {**{s: 10.0 + s for s in range(1, 9)}, **{s: 1.0 * s for s in range(9, 13)}}
    steps = [r["step"] for r in _rundir.read_metrics(run)]
    assert steps == sorted(steps) and "oom" not in [r.get("status") for r in _rundir.read_metrics(run)]


def test_wandb_fork_refused_starts_a_linked_run(tmp_path, monkeypatch, capsys):
    """Where W&B cannot fork (e.g. forking not enabled on the server), the replay goes to a new run in the
    same group, linked in its config; nothing is logged below the old run's last step."""
    import wandb

    from trainer.metrics import RunLogger

    first = RunLogger(tmp_path)
    kw = dict(mode="offline", project="flashgpt-tests", entity=None, group="g", name="n", tags=[], config={})
    first.start_wandb(**kw, run_id=None)
    parent = first.wandb_id
    for s in range(1, 7):
        first.log(s, {"train/loss": float(s)})
    first.close()

    real_init = wandb.init

    def init_without_forks(*args, fork_from=None, **kwargs):
        if fork_from is not None:
            raise RuntimeError("forking is not enabled for this entity")
        return real_init(*args, **kwargs)

    monkeypatch.setattr(wandb, "init", init_without_forks)
    second = RunLogger(tmp_path)
    moved = second.set_apart_after(4)
    assert moved["path"].name == "metrics.abandoned.5-6.jsonl" and moved["wandb_steps"] == 2
    second.start_wandb(**kw, run_id=parent, fork_at=4)
    assert "could not fork run" in capsys.readouterr().out
    for s in range(5, 9):
        second.log(s, {"train/loss": 10.0 * s})
    child = second.wandb_id
    second.close()
    assert child != parent and (tmp_path / "wandb_run_id.txt").read_text().strip() == child
    wb = read_offline_run(tmp_path)
    assert wb["run_id"] == child and wb["group"] == "g" and wb["branch_point"] is None
    assert wb["config"]["wandb_parent"] == {"run_id": parent, "step": 4}
    assert [h["_step"] for h in wb["history"]] == [5, 6, 7, 8]
    assert [r["step"] for r in read_jsonl(tmp_path)] == [1, 2, 3, 4, 5, 6, 7, 8]


def test_wandb_reader_waits_for_the_run_file_to_be_written_out(tmp_path, monkeypatch):
    """read_offline_run waits until wandb-core has written the run's .wandb file out. Run.finish() only
    asks wandb-core to close the run's stream and its file's buffered tail (for a short run, all but the
    header) is written when wandb-core gets to that: read right away, the file could hold no run (a flaky
    run_id "" under load). Simulated here: the finished file is held back and written 0.5 s after
    finish() returns. Bounded: a file that never completes is an error after ``wait_s``."""
    import threading

    from trainer.metrics import RunLogger

    kw = dict(mode="offline", project="flashgpt-tests", entity=None, group="g", name="n", tags=[], config={})
    late_writes: list[threading.Timer] = []

    def start(out: Path, write_back_after: float | None) -> RunLogger:
        log = RunLogger(out)
        log.start_wandb(**kw, run_id=None)
        for s in range(1, 4):
            log.log(s, {"train/loss": float(s)})
        run = log.wandb_run
        real_finish = run.finish

        def finish_then_lag(*args, **kwargs):
            real_finish(*args, **kwargs)
            f = Path(run.settings.sync_file)
            assert wait_run_file_finished(f, timeout=60)  # the file as wandb-core writes it in the end
            whole = f.read_bytes()
            f.write_bytes(whole[:7])  # as it is until wandb-core closes the stream: the header only
            if write_back_after is not None:
                late_writes.append(threading.Timer(write_back_after, f.write_bytes, [whole]))
                late_writes[-1].start()

        monkeypatch.setattr(run, "finish", finish_then_lag)
        return log

    log = start(tmp_path / "a", write_back_after=0.5)
    run_id = log.wandb_id
    log.close()
    wb = read_offline_run(tmp_path / "a")
    assert wb["run_id"] == run_id and [h["_step"] for h in wb["history"]] == [1, 2, 3]

    log = start(tmp_path / "b", write_back_after=None)
    log.close()
    t0 = time.monotonic()
    with pytest.raises(WandbFileIncomplete):
        read_offline_run(tmp_path / "b", wait_s=0.3)
    assert time.monotonic() - t0 < 10
    for t in late_writes:
        t.join()
