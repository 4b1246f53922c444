"""End-to-end CPU tests of train.py through Hydra (subprocess runs of the tiny model on Tiny Shakespeare).

Each run is a real ``python train.py ...`` process; W&B runs offline where a test reads it back with
``wandb_offline.read_offline_run`` (tests/) (no mocking). The uninterrupted reference run (conftest's
``reference_run``, trained once per session) is shared by the backend-agreement, resume and signal tests.
"""

from __future__ import annotations

import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers_train import (
    REPO,
    checkpoint_tensors,
    describe,
    read_jsonl,
    run_inprocess,
    run_train,
    summary,
    train_command,
    train_env,
    train_losses,
    val_losses,
)
from tests.wandb_offline import read_offline_run
from trainer import checkpoint as ckpt

pytestmark = pytest.mark.slow


def test_reference_run_learns_and_logs(reference_run):
    s = summary(reference_run)
    assert s["status"] == "ok" and s["steps"] == 16 and s["attention"] == "naive" and s["seq_len"] == 64
    losses = train_losses(reference_run)
    assert sorted(losses) == list(range(1, 17))
    assert losses[16] < losses[1] - 0.5, losses  # ln(65) = 4.17 at init
    vals = val_losses(reference_run)
    assert sorted(vals) == [0, 8, 16] and vals[16] < vals[0]
    rows = [r for r in read_jsonl(reference_run) if "train/loss" in r]
    for key in ("lr", "perf/tokens_per_sec", "perf/step_ms", "mem/peak_gib"):
        assert all(key in r for r in rows), key
    assert not any("perf/mfu" in r for r in rows) and "perf/mfu" not in s  # a CPU has no peak to divide by
    assert s["perf/tokens_per_sec"] > 0 and s["perf/timed_steps"] == 14  # first 2 steps excluded
    assert (reference_run / ".hydra" / "config.yaml").is_file()
    assert (reference_run / "config.resolved.yaml").is_file()
    assert sorted(p.name for p in (reference_run / "ckpt").iterdir()) == [
        "step_00000008",
        "step_00000016",
    ]

    run = read_offline_run(reference_run)
    assert run["run_id"] == s["wandb_run_id"] == (reference_run / "wandb_run_id.txt").read_text().strip()
    hist = {r["_step"]: r for r in run["history"]}
    for step, loss in losses.items():
        assert hist[step]["train/loss"] == pytest.approx(loss, rel=1e-12)
        for key in ("lr", "perf/tokens_per_sec", "perf/step_ms", "mem/peak_gib"):
            assert key in hist[step]
    assert hist[16]["val/loss"] == pytest.approx(vals[16], rel=1e-12)
    assert run["summary"]["status"] == "ok"
    assert run["summary"]["final/train_loss"] == pytest.approx(losses[16])
    assert run["summary"]["attention/backend_ran"] == "naive"
    assert run["config"]["attention"]["name"] == "naive" and run["config"]["seq_len"] == 64
    assert run["config"]["derived"]["grad_accum"] == 2
    assert run["config"]["derived"]["loss"] == "cross_entropy"  # the fused loss runs on CUDA only


def test_sdpa_matches_naive_and_parity_is_logged(reference_run, tiny, tmp_path):
    """Same seed/data: sdpa's loss curve equals naive's within float32 noise; parity vs naive is tiny."""
    out = tmp_path / "sdpa"
    proc = run_train(
        tiny(out, attention="sdpa", parity__every=4, parity__reference="naive", wandb__mode="offline")
    )
    assert proc.returncode == 0, describe(proc)
    a, b = train_losses(reference_run), train_losses(out)
    assert a.keys() == b.keys()
    assert max(abs(a[k] - b[k]) for k in a) < 1e-4, (a, b)
    assert (
        max(
            abs(x - y)
            for x, y in zip(val_losses(reference_run).values(), val_losses(out).values(), strict=True)
        )
        < 1e-4
    )
    parity = [r for r in read_jsonl(out) if "parity/reference" in r]
    assert [r["step"] for r in parity] == [4, 8, 12, 16]
    for r in parity:
        assert r["parity/reference"] == "naive"
        assert 0 <= r["parity/loss_abs_diff"] < 1e-5 and 0 <= r["parity/logits_max_abs_diff"] < 1e-4, r
        said = f"step {r['step']:>6} | parity vs naive: loss diff {r['parity/loss_abs_diff']:.2e}, "
        assert said in proc.stdout + proc.stderr, describe(proc)  # on the console too
    hist = {r["_step"]: r for r in read_offline_run(out)["history"]}
    assert hist[8]["parity/reference"] == "naive"
    assert hist[8]["parity/loss_abs_diff"] == pytest.approx(parity[1]["parity/loss_abs_diff"], abs=1e-12)
    assert summary(out)["attention/backend_ran"].startswith("sdpa:")


def test_stop_and_resume_is_bitwise(reference_run, tiny, tmp_path):
    """Train 8 of 16 steps, then resume=true to 16: every train/val loss equals the uninterrupted run's."""
    out = tmp_path / "run"
    first = run_train(tiny(out, max_steps=8))
    assert first.returncode == 0, describe(first)
    assert summary(out)["last_checkpoint"].endswith("step_00000008")
    second = run_train(tiny(out, max_steps=16, resume=True))
    assert second.returncode == 0, describe(second)
    assert "resumed from" in second.stdout
    assert train_losses(out) == train_losses(reference_run)  # exact float equality
    assert val_losses(out) == val_losses(reference_run)


def test_sigterm_checkpoints_and_resume_reproduces(reference_run, tiny, tmp_path):
    """SIGTERM to a real train.py: it finishes the step, checkpoints, exits 143 with a resume hint; resuming
    gives the uninterrupted losses bitwise and continues the same W&B run id."""
    out = tmp_path / "run"
    args = tiny(out, fault__step_sleep_s=0.25, wandb__mode="offline")
    cmd, env = train_command(args)
    proc = subprocess.Popen(
        cmd,
        cwd=str(REPO),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            metrics = out / "metrics.jsonl"
            if metrics.is_file() and any(
                r.get("step", 0) >= 3 and "train/loss" in r for r in read_jsonl(out)
            ):
                break
            time.sleep(0.05)
        assert proc.poll() is None, "run ended before the signal was sent"
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, f"{proc.returncode}\n{stdout}\n{stderr}"
    s = summary(out)
    k = s["steps"]
    assert s["status"] == "interrupted" and 3 <= k < 16, s
    assert f"step_{k:08d}" in s["last_checkpoint"] and Path(s["last_checkpoint"]).is_dir()
    assert "resume=true" in stdout and f"out_dir={out}" in stdout
    first_id = s["wandb_run_id"]

    resumed = run_train(tiny(out, wandb__mode="offline", resume=True))
    assert resumed.returncode == 0, describe(resumed)
    assert train_losses(out) == train_losses(reference_run)
    assert val_losses(out) == val_losses(reference_run)
    assert summary(out)["wandb_run_id"] == first_id
    run = read_offline_run(out)
    assert run["run_id"] == first_id
    logged = sorted({r["_step"] for r in run["history"] if "train/loss" in r})
    assert logged == list(range(1, 17))


def test_resume_refuses_shape_and_tokenizer_change_allows_attention(reference_run, tiny, tmp_path, capsys):
    """In-process (compose + trainer.loop.run): refusals name the differing keys; a backend change is
    allowed."""

    out = tmp_path / "run"
    shutil.copytree(reference_run / "ckpt", out / "ckpt")
    shutil.rmtree(out / "ckpt" / "step_00000016")  # resume from step 8

    def refused(**extra) -> str:
        outcome = run_inprocess(tiny(out, resume=True, **extra), out)
        err = capsys.readouterr().err
        assert (outcome.status, outcome.exit_code) == ("error", 2), err
        assert "resume=true refused" in err
        return err

    err = refused(model__n_layer=3, model__n_embd=96)
    assert "model.n_layer: 2 -> 3" in err and "model.n_embd: 128 -> 96" in err
    assert "model.block_size: 64 -> 32" in refused(seq_len=32)
    # the ablation keys: other parameters (q/k norms, kv heads, positions) or another function (softcap)
    assert "model.qk_norm: False -> True" in refused(model__qk_norm=True)
    assert "model.pos_emb: learned -> rope" in refused(model__pos_emb="rope")
    assert "model.n_kv_head: 4 -> 2" in refused(model__n_kv_head=2)
    assert "attention.softcap: None -> 2.0" in refused(attention__softcap=2.0)
    # a refused resume touches none of the run's records
    assert not list(out.glob("wandb")) and not (out / "summary.json").exists()

    outcome = run_inprocess(tiny(out, resume=True, attention="sdpa"), out)
    captured = capsys.readouterr()
    assert (outcome.status, outcome.exit_code) == ("ok", 0), captured.err
    assert "attention backend changed on resume: ['naive', 'auto'] -> ['sdpa', 'auto']" in captured.out
    assert summary(out)["status"] == "ok" and summary(out)["steps"] == 16
    assert any(r.get("event") == "resume" and r["notes"] for r in read_jsonl(out))
    losses, ref = train_losses(out), train_losses(reference_run)
    assert max(abs(losses[k] - ref[k]) for k in range(9, 17)) < 1e-4  # sdpa continues naive's curve


def test_resume_refuses_tokenizer_change(reference_run, tiny, tmp_path, capsys, gpt2_bpe):
    """The GPT-2 BPE version of the same text (prepared on demand into its own folder) is refused, naming
    the tokenizer and vocab size; the run's records stay untouched."""

    out = tmp_path / "run"
    shutil.copytree(reference_run / "ckpt", out / "ckpt")
    overrides = tiny(
        out, resume=True, data="shakespeare", data__dir=tmp_path / "gpt2data", data__source=_source(tiny)
    )
    outcome = run_inprocess(overrides, out)
    err = capsys.readouterr().err
    assert (outcome.status, outcome.exit_code) == ("error", 2), err
    assert "resume=true refused" in err
    assert "data.tokenizer: char -> gpt2" in err and "model.vocab_size: 128 -> 50304" in err
    assert not list(out.glob("wandb")) and not (out / "summary.json").exists()


def _source(tiny) -> str:
    args = dict(a.split("=", 1) for a in tiny(Path("/x")))
    return args["data.source"]


# In-process (``run_inprocess`` with the faults monkeypatched): the run's records and messages; the exit
# status is the Outcome's, which train.py passes to sys.exit (tested with real processes elsewhere).


def test_nan_stops_without_overwriting_checkpoints(tiny, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    args = tiny(out, fault__nan_at_step=6, checkpoint__interval=2, checkpoint__keep=5)
    outcome = run_inprocess(args, out, monkeypatch)
    err = capsys.readouterr().err
    assert (outcome.status, outcome.exit_code) == ("nonfinite", 1), err
    assert "non-finite loss at step 6" in err
    assert "step_00000004" in err and ".hydra/config.yaml" in err and "nonfinite=skip" in err
    assert "(e.g. optim.lr=" in err and "grad_clip" in err  # keys with values that run as typed
    ckpts = sorted(p.name for p in (out / "ckpt").iterdir())
    assert ckpts == ["step_00000002", "step_00000004"], ckpts
    assert ckpt.load_checkpoint(out / "ckpt" / "step_00000004")["step"] == 4
    weights = checkpoint_tensors(out / "ckpt" / "step_00000004", tmp_path)
    assert weights and all(torch.isfinite(v).all() for v in weights.values())
    s = summary(out)
    assert s["status"] == "nonfinite" and s["nonfinite/step"] == 6 and s["steps"] == 5
    assert read_jsonl(out)[-1]["status"] == "nonfinite"


def test_nan_skip_counts_skipped_steps(tiny, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    args = tiny(out, fault__nan_at_step=3, nonfinite="skip", max_steps=6, wandb__mode="offline")
    outcome = run_inprocess(args, out, monkeypatch)
    assert (outcome.status, outcome.exit_code) == ("ok", 0), capsys.readouterr().err
    s = summary(out)
    assert s["status"] == "ok" and s["train/skipped_steps"] == 1 and s["steps"] == 6
    losses = train_losses(out)
    assert 3 not in losses and all(math.isfinite(v) for v in losses.values())
    run = read_offline_run(out)
    skipped = {r["_step"]: r["train/skipped_steps"] for r in run["history"] if "train/skipped_steps" in r}
    assert skipped[2] == 0 and skipped[3] == 1 and skipped[6] == 1
    assert run["summary"]["train/skipped_steps"] == 1


def test_simulated_oom_ends_cleanly(tiny, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    outcome = run_inprocess(tiny(out, fault__raise_oom_at_step=3, wandb__mode="offline"), out, monkeypatch)
    err = capsys.readouterr().err
    assert (outcome.status, outcome.exit_code) == ("oom", 0), err  # oom_exit_code=0 by default
    assert "out of memory at step 3" in err and "Traceback" not in err
    assert "batch.micro_batch_size=4" in err and "attention=flash" in err, err  # tiny: micro-batch 8, naive

    s = summary(out)
    assert s["status"] == "oom" and s["seq_len"] == 64 and s["attention"] == "naive" and s["oom/step"] == 3
    assert "mem/peak_gib" in s and s["steps"] == 2
    assert read_jsonl(out)[-1]["status"] == "oom"
    assert read_offline_run(out)["summary"]["status"] == "oom"


def test_oom_advice_runs_as_typed():
    """Halve the micro-batch (or seq_len at one sequence); never advise attention=flash to a flash run."""
    from trainer.endings import oom_advice

    assert "batch.micro_batch_size=16" in oom_advice("flash", 32, 1024)
    assert "attention=flash" not in oom_advice("flash", 32, 1024)
    assert "attention=flash" in oom_advice("sdpa", 32, 1024)
    assert "seq_len=4096" in oom_advice("flash", 1, 8192) and "micro_batch_size" not in oom_advice(
        "flash", 1, 8192
    )


def test_multirun_two_runs(tiny, tmp_path):
    sweep = tmp_path / "sweep"
    args = [
        a
        for a in tiny(tmp_path / "unused", max_steps=3, seq_len=32)
        if not a.startswith(("attention=", "out_dir="))
    ]
    proc = run_train(["-m", *args, "attention=naive,sdpa", f"hydra.sweep.dir={sweep}", "wandb.mode=offline"])
    assert proc.returncode == 0, describe(proc)
    dirs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert dirs == ["0_naive_n32", "1_sdpa_n32"], dirs
    for name, backend in (("0_naive_n32", "naive"), ("1_sdpa_n32", "sdpa")):
        s = summary(sweep / name)
        assert s["status"] == "ok" and s["attention"] == backend and s["seq_len"] == 32 and s["steps"] == 3
        run = read_offline_run(sweep / name)
        assert run["group"] == "sweep" and run["name"] == name
    # resumed with the same values in the same order (as Hydra reads them: spaces and quotes aside), after
    # bench.report wrote into the sweep's folder: each job continues its own folder
    (sweep / "report.md").write_text("a report of the sweep")
    more = [a if not a.startswith("max_steps=") else "max_steps=4" for a in args]
    cmd = [
        "-m",
        *more,
        "attention='naive', sdpa",
        f"hydra.sweep.dir={sweep}",
        "wandb.mode=offline",
        "resume=true",
    ]
    proc = run_train(cmd)
    assert proc.returncode == 0, describe(proc)
    assert [summary(sweep / n)["steps"] for n in dirs] == [4, 4]


def test_torchrun_two_gloo_processes(tiny, tmp_path):
    out = tmp_path / "ddp"
    args = tiny(out, max_steps=4, eval__interval=2)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    tmp = tmp_path / "tmp"  # the ranks' own temp dir: other tests' torchrun ranks come and go in /tmp
    tmp.mkdir()
    proc = run_train(args, launcher=launcher, timeout=300, env={**train_env(), "TMPDIR": str(tmp)})
    assert proc.returncode == 0, describe(proc)
    assert not list(tmp.glob("flashgpt-rank*"))  # rank 1's Hydra dir removed
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".hydra")) == [".hydra"]
    s = summary(out)
    assert s["status"] == "ok" and s["world_size"] == 2 and s["grad_accum"] == 1 and s["steps"] == 4
    losses = train_losses(out)
    assert sorted(losses) == [1, 2, 3, 4] and all(math.isfinite(v) for v in losses.values())
    assert (out / "ckpt" / "step_00000004").is_dir()
    state = ckpt.load_checkpoint(out / "ckpt" / "step_00000004")
    assert len(state["rng"]) == 2 and state["world_size"] == 2


def test_config_error_exits_2_without_traceback_and_writes_nothing(tiny, tmp_path):
    """A config error found inside the training task, after Hydra created the run directory and the
    trainer took its lock there (the batch split; set-up's missing checkpoint on resume, metrics.jsonl
    open), takes all of that back: no run directory, no runs/ folder, no .hydra/ or train.log (written
    only once a run has passed its checks). A folder that existed before keeps exactly what it held."""
    proc = run_train(tiny(tmp_path / "runs" / "run", **{"batch.tokens_per_step": 1000}))
    assert proc.returncode == 2, describe(proc)
    assert "config error: batch.tokens_per_step=1000" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()
    proc = run_train(tiny(tmp_path / "runs" / "new", resume=True))  # refused in set-up: metrics.jsonl open
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, describe(proc)
    assert not (tmp_path / "runs").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    for extra in ({"batch.tokens_per_step": 1000}, {"resume": True}):
        proc = run_train(tiny(mine, **extra))
        assert proc.returncode == 2, describe(proc)
        assert [p.name for p in mine.iterdir()] == ["notes.txt"], describe(proc)
        assert (mine / "notes.txt").read_text() == "the user's"
