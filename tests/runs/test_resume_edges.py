"""Edges of ``resume=true`` found by review (real train.py processes on the CPU, real run directories).

1. A resume pointed at a directory that holds no run stops with the no-checkpoint message before any
   data is prepared (no default download, nothing written where it was launched).
2. A run SIGKILLed during its ending (after its last step and final checkpoint, before the final
   summary) is refused by a resume as finished, and that refusal changes nothing: summary.json stays as
   the killed process left it, and the console does not say the run "is resumed now".
3. Readers that look at the same killed run at once (two bench.report / bench.compare) both see it
   killed: a reader's look at the run directory's lock does not pass for a live trainer; and a run
   that is still training is reported running, never killed.
5. An empty config.resolved.yaml (truncated by a kill while it was rewritten, or emptied by hand) is
   an error naming the file, not a silent resume with the defaults (whose data it would prepare).
4. A ``_global_`` group choice on the resume command line whose file sets nothing (``trainer=gpu``: the
   schema defaults) undoes the keys the run's own option set (``trainer=cpu``'s ``compile: false``),
   found through the group options that config.resolved.yaml records.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers_train import (
    REPO,
    compose_cfg,
    describe,
    offline_train_env,
    run_train,
    summary,
    train_command,
)
from trainer.checkpoint import list_checkpoints

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def killed_in_ending(tmp_path_factory, tiny) -> Path:
    """A 4-step run (checkpoint at step 4) SIGKILLed as its ending starts: summary.json says "running"."""
    out = tmp_path_factory.mktemp("ending") / "run"
    proc = run_train(tiny(out, max_steps=4, checkpoint__interval=4, fault__sigkill_at_finish=1))
    assert proc.returncode == -9, describe(proc)
    assert summary(out)["status"] == "running"
    assert [step for step, _ in list_checkpoints(out)][:1] == [4], list((out / "ckpt").iterdir())
    return out


def test_resume_without_out_dir_says_it_needs_the_run(tmp_path):
    """resume=true alone would continue a new, empty folder: the error says which key names the run (and
    not that a made-up folder has no checkpoint), exit 2, nothing written."""
    cmd, env = train_command(["resume=true", "experiment=cpu_tiny"], env=offline_train_env())
    proc = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, describe(proc)
    assert "resume=true needs the run to continue: pass out_dir=<its run directory>" in proc.stderr, describe(
        proc
    )
    assert list(tmp_path.iterdir()) == []


def test_resume_into_a_dir_without_a_run_prepares_no_data(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    missing = tmp_path / "no_such_run"
    cmd, env = train_command(["resume=true", f"out_dir={missing}"], env=offline_train_env())
    proc = subprocess.run(cmd, cwd=str(elsewhere), env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, describe(proc)
    assert "has no loadable checkpoint" in proc.stderr, describe(proc)
    assert "download" not in proc.stderr + proc.stdout, describe(proc)
    assert list(elsewhere.iterdir()) == []  # no data/shakespeare prepared (or attempted) here


def test_refused_resume_of_a_run_killed_in_its_ending_changes_nothing(killed_in_ending, tiny):
    before = (killed_in_ending / "summary.json").read_bytes()
    proc = run_train(tiny(killed_in_ending, resume=True, max_steps=4, checkpoint__interval=4))
    assert proc.returncode == 0, describe(proc)
    assert "is already finished" in proc.stdout, describe(proc)
    assert "is resumed now" not in proc.stdout, describe(proc)  # it is not: nothing is resumed
    assert (killed_in_ending / "summary.json").read_bytes() == before  # "nothing was changed" holds


def test_readers_do_not_advise_resuming_a_run_killed_in_its_ending(killed_in_ending, killed_run_dir):
    """Readers call a run killed in its ending (checkpoint of its last step) complete and point to eval,
    not to a resume that would only say it is finished; a run killed mid-training still gets the resume."""
    from trainer.rundir import true_status

    status, note = true_status(killed_in_ending, summary(killed_in_ending))
    assert status == "killed" and "its training is complete" in note and "eval.py" in note, note
    assert "resume it with" not in note, note
    status, note = true_status(killed_run_dir, summary(killed_run_dir))
    assert status == "killed" and "resume it with python train.py resume=true" in note, note


@pytest.fixture(scope="module")
def killed_run_dir(tmp_path_factory, tiny) -> Path:
    """A 16-step run SIGKILLed mid-training, after its step-8 checkpoint."""
    out = tmp_path_factory.mktemp("midway") / "run"
    proc = run_train(tiny(out, max_steps=16, checkpoint__interval=8, fault__sigkill_at_step=10))
    assert proc.returncode == -9, describe(proc)
    return out


def test_a_concurrent_reader_does_not_make_a_killed_run_look_alive(killed_in_ending):
    import fcntl

    from trainer.rundir import LOCK_NAME, true_status

    s = summary(killed_in_ending)
    assert true_status(killed_in_ending, s)[0] == "killed"
    fd = os.open(killed_in_ending / LOCK_NAME, os.O_RDONLY)
    try:  # another reader in the middle of its own look (the lock a reader takes)
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        assert true_status(killed_in_ending, s)[0] == "killed"
    finally:
        os.close(fd)


def test_readers_report_a_live_run_as_running(tiny, tmp_path):
    import time

    from bench import report
    from tests.helpers_train import read_jsonl
    from trainer.rundir import true_status

    out = tmp_path / "run"
    cmd, env = train_command(tiny(out, fault__step_sleep_s=0.5))
    proc = subprocess.Popen(cmd, cwd=str(REPO), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if (out / "metrics.jsonl").is_file() and any("train/loss" in r for r in read_jsonl(out)):
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it was read"
        assert true_status(out, summary(out)) == ("running", None)
        assert report.summarize_run(out, tmp_path)["status"] == "running"
        assert proc.poll() is None  # the readers' looks did not disturb it
    finally:
        proc.kill()
        proc.wait(timeout=60)


def test_resume_with_an_empty_saved_config_is_refused(killed_in_ending, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(killed_in_ending, run)
    saved = run / "config.resolved.yaml"
    saved.write_text("")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cmd, env = train_command(["resume=true", f"out_dir={run}"], env=offline_train_env())
    proc = subprocess.run(cmd, cwd=str(elsewhere), env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, describe(proc)
    assert f"the run's saved config {saved} does not load" in proc.stderr, describe(proc)
    assert "download" not in proc.stderr + proc.stdout, describe(proc)
    assert list(elsewhere.iterdir()) == []


def test_resume_trainer_gpu_over_a_cpu_run_takes_the_gpu_keys(killed_in_ending):
    from hydra import compose, initialize_config_dir

    import trainer.config  # noqa: F401 - the schema and model presets in the ConfigStore
    from trainer.resume_config import resume_config

    overrides = ["resume=true", f"out_dir={killed_in_ending}", "trainer=gpu"]
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        fresh = compose("config", overrides=overrides)
    merged, given = resume_config(fresh, killed_in_ending, overrides)
    assert given.startswith("trainer=gpu (") and "compile" in given  # what the start-up line says
    # the run was trainer=cpu (compile false, from configs/trainer/cpu.yaml); trainer=gpu: the default
    assert fresh.compile is not False and merged.compile == fresh.compile, merged.compile


def test_resume_from_another_folder_reads_the_runs_relative_data_dir(tiny, tmp_path):
    """A run started in folder A with a relative data.dir, resumed from folder B without overrides: the
    data dir is A's (derived.cwd anchors it), so B gets nothing (no second data preparation)."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    out = tmp_path / "run"
    cmd, env = train_command(tiny(out, max_steps=4, checkpoint__interval=4, data__dir="chars"))
    first = subprocess.run(cmd, cwd=str(a), env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0 and (a / "chars" / "train_000000.bin").is_file(), describe(first)
    cmd, env = train_command(["resume=true", f"out_dir={out}", "max_steps=6"], env=offline_train_env())
    again = subprocess.run(cmd, cwd=str(b), env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, describe(again)
    assert list(b.iterdir()) == [], list(b.rglob("*"))
    saved = (out / "config.resolved.yaml").read_text()
    assert f"dir: {a / 'chars'}" in saved, saved
    assert summary(out)["steps"] == 6


def test_resume_line_names_a_preset_instead_of_its_keys():
    """``experiment=cpu_tiny`` on a resume command line is named as the preset, with the keys it changed
    in parentheses, not listed as if each key had been typed; a key also typed on its own (max_steps) stays
    on its own, and plain keys and packaged groups (attention=flash) read as before."""
    from trainer.resume_config import changed_keys

    def line(overrides, choices=None):
        return changed_keys(choices or {}, overrides)[1]

    got = line(["experiment=cpu_tiny", "resume=true", "out_dir=/x", "max_steps=40"])
    assert got.startswith("experiment=cpu_tiny (batch.micro_tokens, ") and got.endswith("), max_steps")
    preset = got[len("experiment=cpu_tiny (") : -len("), max_steps")].split(", ")
    assert "seq_len" in preset and "model.n_layer" in preset and "max_steps" not in preset
    assert line(["resume=true", "max_steps=8"]) == "max_steps"
    got = line(["resume=true", "attention=flash", "model.n_layer=2"], {"attention": "sdpa"})
    assert got == "attention=flash (attention.name), model.n_layer"
    assert line(["resume=true"]) == "nothing"


@pytest.mark.parametrize("extra,refused", [(["seed=12345"], True), (["max_steps=40"], False)])
def test_resume_refuses_another_seed(killed_in_ending, extra, refused):
    """The seed draws the training windows and picks the validation batches: a resume with another seed
    would switch the val set mid-curve, so it is refused naming seed; max_steps may change."""
    from hydra import compose, initialize_config_dir

    import trainer.config  # noqa: F401 - the schema and model presets in the ConfigStore
    from trainer.config import ConfigError
    from trainer.resume_config import resume_config

    overrides = ["resume=true", f"out_dir={killed_in_ending}", *extra]
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        fresh = compose("config", overrides=overrides)
    if refused:
        with pytest.raises(ConfigError, match=r"resume=true refused: .*seed \(\d+ -> 12345\)"):
            resume_config(fresh, killed_in_ending, overrides)
    else:
        merged, _ = resume_config(fresh, killed_in_ending, overrides)
        assert merged.max_steps == 40


def test_resume_keeps_the_runs_values_when_configs_changed_since_its_launch(tmp_path, monkeypatch):
    """configs/ edited between launch and resume (cpu_tiny's lr): the resume continues with the run's saved
    lr, not the edited default; what the command line sets (max_steps) still applies."""
    import shutil

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from trainer import resume_config as R

    run = tmp_path / "run"
    run.mkdir()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=cpu_tiny", f"out_dir={run}"])
    saved = OmegaConf.to_container(cfg, resolve=True) | {
        "derived": {"cwd": str(tmp_path), R.CHOICES_KEY: {"experiment": "cpu_tiny"}}
    }
    OmegaConf.save(OmegaConf.create(saved), run / "config.resolved.yaml")
    lr = saved["optim"]["lr"]
    configs = tmp_path / "configs"
    shutil.copytree(REPO / "configs", configs)
    preset = configs / "experiment" / "cpu_tiny.yaml"
    edited = preset.read_text().replace("lr: 3.0e-3", "lr: 5.0e-3")
    assert edited != preset.read_text()
    preset.write_text(edited)
    monkeypatch.setattr(R, "CONFIGS_DIR", configs)
    with initialize_config_dir(config_dir=str(configs), version_base="1.3"):
        now = compose(
            "config", overrides=["experiment=cpu_tiny", "resume=true", f"out_dir={run}", "max_steps=9"]
        )
    assert now.optim.lr == 5e-3 != lr  # the edit is what a fresh composition gives
    merged, given = R.resume_config(now, run, ["resume=true", f"out_dir={run}", "max_steps=9"])
    assert merged.optim.lr == lr and merged.max_steps == 9 and given == "max_steps", (merged.optim.lr, given)


def test_resume_without_its_config_says_so_before_anything(tmp_path, capsys):
    """config.resolved.yaml gone (deleted, left out of a copy): the command line is the config, which the
    warning says first (before any data is prepared), naming the run's launch overrides."""
    from trainer import resume_config as R

    run = tmp_path / "run"
    (run / "ckpt").mkdir(parents=True)
    (run / ".hydra").mkdir()
    (run / ".hydra" / "overrides.yaml").write_text("- experiment=cpu_tiny\n- max_steps=6\n")
    overrides = ["resume=true", f"out_dir={run}"]
    cfg, given = R.resume_config(compose_cfg(overrides), run, overrides)
    err = capsys.readouterr().err
    assert given is None and f"{run / 'config.resolved.yaml'} is missing" in err, err
    assert "launch overrides are in " in err and "overrides.yaml: experiment=cpu_tiny max_steps=6" in err
