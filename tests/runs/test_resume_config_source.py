"""Where ``resume=true`` reads the run's config from when its config.resolved.yaml is not there to read.

1. config.resolved.yaml missing (deleted, left out of a copy): the resume continues with the config the
   newest checkpoint records, with the launch's group options and working directory from
   .hydra/hydra.yaml, and says which file it read; with no such record either, a config error naming the
   missing file, before any data is prepared, the run directory left byte for byte as it was.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.helpers_train import compose_cfg, copy_run, describe, offline_train_env, summary, train_command
from trainer import resume_config as R
from trainer.checkpoint import RECORD
from trainer.fields import ConfigError


def _checkpoint(run: Path, step: int, config: dict | None, record: bytes | None = None) -> None:
    """A checkpoint directory whose record holds ``config`` (or the bytes ``record``); no shards."""
    d = run / "ckpt" / f"step_{step:08d}"
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"")
    if record is not None:
        (d / RECORD).write_bytes(record)
    else:
        torch.save({"step": step, "config": config}, d / RECORD)


def _launched(run: Path, launch_cwd: Path, max_steps: int) -> dict:
    """The config a cpu_tiny run with a relative data.dir was trained with (as its records hold it)."""
    cfg = compose_cfg(["experiment=cpu_tiny", "data.dir=chars", f"out_dir={run}", f"max_steps={max_steps}"])
    return {**OmegaConf.to_container(cfg, resolve=True), "derived": {"cwd": str(launch_cwd)}}


def _resume(run: Path, *extra: str):
    overrides = ["resume=true", f"out_dir={run}", *extra]
    return R.resume_config(compose_cfg(overrides), run, overrides)


def test_without_config_resolved_yaml_the_newest_checkpoints_config_is_resumed(tmp_path):
    """A cpu_tiny run (4 layers, char data in a data.dir relative to where it was launched) resumed with
    max_steps raised once, config.resolved.yaml gone: the step-8 record's config (max_steps 40, not the
    step-4 one's 20), the launch's cwd and group options, not the defaults (GPT-2, 12 layers)."""
    run, launch = tmp_path / "run", tmp_path / "launch"
    config = _launched(run, launch, 40)
    config.pop("derived")  # a checkpoint record holds the config without it
    _checkpoint(run, 4, {**config, "max_steps": 20})
    _checkpoint(run, 8, config)
    hydra = {"runtime": {"cwd": str(launch), "choices": {"experiment": "cpu_tiny", "trainer": "cpu"}}}
    (run / ".hydra").mkdir()
    OmegaConf.save(OmegaConf.create({"hydra": hydra}), run / ".hydra" / "hydra.yaml")

    merged, given, source = _resume(run)
    assert (merged.model.n_layer, merged.data.tokenizer, merged.max_steps) == (4, "char", 40)
    assert merged.data.dir == str(launch / "chars")  # where the run prepared it, not here
    assert given == "nothing"
    assert source == f"{run / 'ckpt' / 'step_00000008' / RECORD} (config.resolved.yaml is missing)"
    # the launch's group options: trainer=gpu undoes trainer=cpu's keys (compile false)
    merged, given, _ = _resume(run, "trainer=gpu")
    assert given.startswith("trainer=gpu (") and "compile" in given, given
    assert merged.compile is not False


def test_with_no_config_to_resume_with_the_error_names_the_missing_file(tmp_path):
    """config.resolved.yaml gone and no checkpoint record loads: a config error naming the file and what
    to do (not a resume with the defaults, whose data it would download); no checkpoint at all: left to
    set-up's no-checkpoint message."""
    run = tmp_path / "run"
    _checkpoint(run, 8, None, record=b"not a torch file")
    with pytest.raises(
        ConfigError, match=r"config\.resolved\.yaml is missing .* Put config\.resolved\.yaml back"
    ):
        _resume(run, "max_steps=25")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _resume(empty)[1:] == (None, None)


# ------------------------------------------------------------------------------------ train.py processes
def _files(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_train_py_resumes_a_run_without_config_resolved_yaml(reference_run, tmp_path):
    """The new-user walk: the run's own model and data (no default download from an empty folder,
    offline), one line naming the checkpoint record read; config.resolved.yaml written again."""
    run = copy_run(reference_run, tmp_path / "run")
    (run / "config.resolved.yaml").unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cmd, env = train_command(["resume=true", f"out_dir={run}", "max_steps=20"], env=offline_train_env())
    proc = subprocess.run(cmd, cwd=str(elsewhere), env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, describe(proc)
    record = run / "ckpt" / "step_00000016" / RECORD
    line = (
        f"resume: config from {record} (config.resolved.yaml is missing); set on this command line: max_steps"
    )
    assert line in proc.stdout, describe(proc)
    assert list(elsewhere.iterdir()) == []
    assert summary(run)["steps"] == 20
    saved = OmegaConf.load(run / "config.resolved.yaml")
    assert saved.model.n_layer == OmegaConf.load(reference_run / "config.resolved.yaml").model.n_layer
    assert saved.derived[R.CHOICES_KEY].model == "tiny"  # the launch's options, not the defaults (gpt2)


@pytest.mark.slow
def test_train_py_refuses_a_resume_with_no_config_and_changes_nothing(reference_run, tmp_path):
    run = copy_run(reference_run, tmp_path / "run")
    (run / "config.resolved.yaml").unlink()
    for record in (run / "ckpt").glob(f"*/{RECORD}"):
        record.write_bytes(b"lost")
    before = _files(run)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cmd, env = train_command(["resume=true", f"out_dir={run}", "max_steps=20"], env=offline_train_env())
    proc = subprocess.run(cmd, cwd=str(elsewhere), env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, describe(proc)
    assert f"config error: resume=true: the run's saved config {run / 'config.resolved.yaml'} is missing" in (
        proc.stderr
    ), describe(proc)
    assert "download" not in proc.stdout + proc.stderr, describe(proc)
    assert list(elsewhere.iterdir()) == []
    assert _files(run) == before
