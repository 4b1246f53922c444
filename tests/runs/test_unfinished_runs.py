"""Resume from the run's own config, and runs killed before their ending (real train.py processes on the
CPU, real files, the offline W&B run read back).

1. ``resume=true out_dir=RUN`` alone continues RUN with its saved config: it prepares no default data
   (offline: a download would fail) and trains with the run's data source.
2. A SIGKILLed run's summary.json says "running" forever; the readers (bench.report, bench.compare) report
   it as killed / unfinished with its last step, and resume rewrites the status first.
3. bench.compare never says "ok" for an unfinished run, tolerances or not.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers_train import (
    KILLED_AFTER,
    REPO,
    describe,
    offline_train_env,
    run_train,
    summary,
    train_command,
    train_env,
    train_losses,
)
from tests.wandb_offline import read_offline_run

pytestmark = pytest.mark.slow


def _copy(run: Path, tmp_path: Path) -> Path:
    dest = tmp_path / run.name
    shutil.copytree(run, dest)
    return dest


# ------------------------------------------------------------------------------------------ 1. resume config


def test_resume_without_overrides_takes_the_runs_config(tiny, tmp_path, shakespeare_path):
    """``resume=true out_dir=RUN max_steps=8``, launched from an empty folder with the network cut off:
    the run's saved config (char data, tiny model) is used; the default data (GPT-2 BPE Tiny Shakespeare,
    downloaded into data/shakespeare) is never prepared."""
    out = tmp_path / "run"
    first = run_train(tiny(out, max_steps=4, checkpoint__interval=4, wandb__mode="offline"))
    assert first.returncode == 0, describe(first)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cmd, env = train_command(["resume=true", f"out_dir={out}", "max_steps=8"], env=offline_train_env())
    again = subprocess.run(cmd, cwd=str(elsewhere), env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, describe(again)
    assert list(elsewhere.iterdir()) == []  # no data/, runs/ or anything else prepared here
    assert f"resume: config from {out}/config.resolved.yaml; set on this command line: max_steps" in (
        again.stdout
    )
    s = summary(out)
    assert s["status"] == "ok" and s["steps"] == 8, s
    assert sorted(train_losses(out)) == list(range(1, 9))
    wb = read_offline_run(out)
    assert wb["config"]["data"]["source"] == str(shakespeare_path)
    assert wb["config"]["model"]["name"] == "tiny" and wb["config"]["max_steps"] == 8
    assert wb["summary"]["status"] == "ok"


def test_changed_keys_of_group_choices():
    """What a resume command line sets over the saved config, as Hydra composes it: keys, what a group
    option changes, and the keys of ``_global_`` options (trainer=cpu, experiment=cpu_tiny with the groups
    its defaults pick); hydra.* overrides are no run keys."""
    from trainer.resume_config import changed_keys

    keys, _ = changed_keys({}, ["max_steps=8", "attention=naive", "logger=disabled", "hydra.run.dir=x"])
    assert {"max_steps", "attention.name", "wandb.mode"} <= keys and not any(
        k.startswith("hydra") for k in keys
    )
    exp, _ = changed_keys({}, ["experiment=cpu_tiny"])
    assert {
        "model.n_layer",
        "data.tokenizer",
        "seq_len",
        "optim.lr",
        "compile",
        "batch.tokens_per_step",
    } <= exp
    assert "optim.beta1" not in exp and not any(k.startswith("wandb") for k in exp)  # the rest stays saved
    back, _ = changed_keys({"trainer": "cpu"}, ["trainer=gpu"])  # a swapped option undoes the old one's keys
    assert "compile" in back


# ------------------------------------------------------------------------------------------ 2. killed runs


def test_readers_report_a_killed_run_as_unfinished(killed_run, tmp_path):
    from bench import report

    run = _copy(killed_run, tmp_path)
    last = max(train_losses(run))
    assert last >= KILLED_AFTER
    row = report.summarize_run(run, tmp_path)
    assert row["status"] == "killed" and row["steps"] >= last, row
    assert f"killed / unfinished (last step {last})" in row["error"]
    assert f"resume=true out_dir={run}" in row["error"]
    proc = subprocess.run(
        [sys.executable, "-m", "bench.report", str(tmp_path), "--out", str(tmp_path / "report")],
        cwd=str(REPO),
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, describe(proc)
    assert "| killed |" in proc.stdout and f"killed / unfinished (last step {last})" in proc.stdout


# ------------------------------------------------------------------------------------------ 3. compare


def test_compare_does_not_pass_an_unfinished_run(reference_run, killed_run, tmp_path, capsys):
    from bench import compare

    run = _copy(killed_run, tmp_path)
    last = max(train_losses(run))
    for tolerances in ([], ["--tolerance", "10"]):
        code = compare.main([str(reference_run), str(run), "--out", str(tmp_path / "c.png"), *tolerances])
        text = capsys.readouterr().out
        assert code == 1, text
        table_row = [line for line in text.splitlines() if line.startswith("| 1 |")][0]
        assert table_row.endswith("| not checked |") and " ok" not in table_row, text
        assert "NOT CHECKED (unfinished runs)" in text and "all within tolerance" not in text
        assert f"killed / unfinished (last step {last})" in text
        assert "the run is unfinished, so its comparison is not meaningful" in text
    # two finished runs still pass
    code = compare.main([str(reference_run), str(reference_run), "--out", str(tmp_path / "d.png")])
    assert code == 0 and "not checked" not in capsys.readouterr().out


# ------------------------------------------------------------------------------- 2. resume a killed run


def test_resume_rewrites_a_killed_runs_status(killed_run, tiny, tmp_path):
    killed_run = _copy(killed_run, tmp_path)
    last = max(train_losses(killed_run))
    resumed = run_train(tiny(killed_run, resume=True, checkpoint__interval=4, wandb__mode="offline"))
    assert resumed.returncode == 0, describe(resumed)
    out = resumed.stdout
    assert f"the previous process of this run was killed / unfinished (last step {last})" in out
    assert "(status killed) between checkpoints" in out  # the replay's reason reads the rewritten status
    s = summary(killed_run)
    assert s["status"] == "ok" and s["steps"] == 16, s
    assert read_offline_run(killed_run)["summary"]["status"] == "ok"
