"""The config of ``resume=true`` (``trainer.resume_config``), in-process on run directories written as
set-up writes them (config.resolved.yaml: the resolved config, ``derived.cwd``, ``derived.overrides``):

1. configs/ edited since the launch: the run's overrides now compose to other values than it trained with.
   The resume is refused naming each key with both values and the overrides that keep the run's; those
   overrides make the same resume pass; an unchanged run resumes as it is.
2. A run from before ``derived.overrides``: its launch's ``.hydra/overrides.yaml`` stands for them; with
   neither, the refusal says it is an older flashgpt's run and to repeat its overrides, which then works.
"""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import trainer.config as C
from tests.helpers_train import REPO
from trainer import resume_config as R
from trainer.fields import ConfigError

LAUNCH = ["experiment=cpu_tiny", "attention=naive", "max_steps=40", "data.dir=chars"]


def _launch(tmp_path: Path, overrides: list[str], record: str = "derived") -> Path:
    """A run directory as ``trainer.setup.start_logging`` leaves it, without training: ``record`` says where
    its overrides are: "derived" (config.resolved.yaml), "hydra" (.hydra/overrides.yaml only, a run of an
    older flashgpt) or "none"."""
    run = tmp_path / "run"
    run.mkdir()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, f"out_dir={run}"])
    cfg.out_dir, cfg.run_name = str(run), run.name  # as trainer.loop.run sets them
    resolved = C.to_dict(cfg)
    resolved["derived"] = {"n_params": 1, "cwd": str(tmp_path)}
    if record == "derived":
        resolved["derived"]["overrides"] = [*overrides, f"out_dir={run}"]
    OmegaConf.save(OmegaConf.create(resolved), run / "config.resolved.yaml")
    if record == "hydra":
        (run / ".hydra").mkdir()
        OmegaConf.save(OmegaConf.create([*overrides, f"out_dir={run}"]), run / ".hydra" / "overrides.yaml")
    return run


def _resume(run: Path, *extra: str):
    """``resume_config`` as ``python train.py resume=true out_dir=RUN EXTRA`` calls it."""
    overrides = ["resume=true", f"out_dir={run}", *extra]
    cfg = OmegaConf.create({"resume": True, "out_dir": str(run), "run_name": run.name})
    return R.resume_config(cfg, run, overrides)


def _edited_configs(tmp_path: Path, monkeypatch, file: str, old: str, new: str) -> None:
    """configs/ with ``old`` replaced by ``new`` in ``file``, as the configs a resume composes from."""
    configs = tmp_path / "configs"
    shutil.copytree(REPO / "configs", configs)
    text = (configs / file).read_text()
    assert old in text
    (configs / file).write_text(text.replace(old, new))
    monkeypatch.setattr(R, "CONFIGS_DIR", configs)


def _saved(run: Path, key: str):
    return OmegaConf.select(OmegaConf.load(run / "config.resolved.yaml"), key)


def test_an_unchanged_run_resumes_with_its_own_values(tmp_path):
    run = _launch(tmp_path, LAUNCH)
    merged, given, record = _resume(run, "max_steps=80")
    assert given == "max_steps=80" and merged.max_steps == 80
    assert merged.optim.lr == _saved(run, "optim.lr") == 3e-3 and merged.seq_len == 128
    assert merged.data.dir == str(tmp_path / "chars")  # anchored where the run started
    assert record[:2] == ["experiment=cpu_tiny", "attention=naive"]


def test_a_resume_after_configs_changed_is_refused_naming_the_keys(tmp_path, monkeypatch):
    """cpu_tiny's lr and seq_len edited since the launch: refused (nothing else, no max_steps), naming both
    with the run's and today's value and the overrides that keep the run's; with those it resumes."""
    run = _launch(tmp_path, LAUNCH)
    _edited_configs(tmp_path, monkeypatch, "experiment/cpu_tiny.yaml", "lr: 3.0e-3", "lr: 1.0e-3")
    text = (tmp_path / "configs/experiment/cpu_tiny.yaml").read_text().replace("seq_len: 128", "seq_len: 256")
    (tmp_path / "configs/experiment/cpu_tiny.yaml").write_text(text)
    with pytest.raises(ConfigError) as e:
        _resume(run, "max_steps=80")
    msg = str(e.value)
    assert msg.startswith("resume=true refused: the run's overrides (derived.overrides) compose with today's")
    assert "optim.lr (run 0.003, now 0.001)" in msg and "seq_len (run 128, now 256)" in msg, msg
    assert "max_steps" not in msg and "data.dir" not in msg and "run_name" not in msg, msg
    fix = msg.split(" add ")[1].split(" to the resume command line")[0]
    assert fix == "optim.lr=0.003 seq_len=128", msg
    assert "start a new run" in msg
    merged, _, record = _resume(run, "max_steps=80", *shlex.split(fix))
    assert merged.optim.lr == 3e-3 and merged.seq_len == 128 and merged.max_steps == 80
    assert {"optim.lr=0.003", "seq_len=128"} <= set(record)  # the next resume composes the run's values
    # a key the command line sets itself is its change, not a drift (here: lr, to a third value)
    merged, _, _ = _resume(run, "optim.lr=0.002", "seq_len=128")
    assert merged.optim.lr == 0.002


def test_a_resume_refuses_a_drifted_data_key_with_the_runs_value(tmp_path, monkeypatch):
    """data.dir of a group edited (no override of the run names it): the run's own folder is named."""
    run = _launch(tmp_path, ["experiment=cpu_tiny"])
    _edited_configs(tmp_path, monkeypatch, "data/shakespeare_char.yaml", "data/shakespeare_char", "data/x")
    with pytest.raises(ConfigError, match=r"data\.dir \(run \S*/data/shakespeare_char, now \S*/data/x\)"):
        _resume(run)


def test_a_run_without_derived_overrides_resumes_from_hydras_record(tmp_path):
    run = _launch(tmp_path, LAUNCH, record="hydra")
    merged, _, record = _resume(run, "max_steps=80")
    assert merged.seq_len == 128 and merged.model.name == "mini" and merged.max_steps == 80
    assert record[:2] == ["experiment=cpu_tiny", "attention=naive"]  # set-up writes it to derived.overrides
    # an older flashgpt's resume changed max_steps (config.resolved.yaml) but not the launch's record
    saved = OmegaConf.load(run / "config.resolved.yaml")
    saved.max_steps = 60
    OmegaConf.save(saved, run / "config.resolved.yaml")
    with pytest.raises(
        ConfigError, match=r"launch overrides \(.*overrides\.yaml.*max_steps \(run 60, now 40\)"
    ):
        _resume(run)
    assert _resume(run, "max_steps=60")[0].max_steps == 60


def test_a_run_without_any_record_of_its_overrides(tmp_path, monkeypatch):
    """No derived.overrides and no .hydra/overrides.yaml: refused as an older flashgpt's run, saying to
    repeat its overrides; repeated (with a change of max_steps) it resumes; group options alone name the
    keys still missing with their values."""
    run = _launch(tmp_path, LAUNCH, record="none")
    with pytest.raises(ConfigError) as e:
        _resume(run)
    msg = str(e.value)
    assert "the run was started by an older flashgpt, which recorded no overrides" in msg, msg
    assert "Repeat the run's original overrides with resume=true: python train.py <its overrides> " in msg
    assert f"resume=true out_dir={run}" in msg and "seq_len" in msg, msg
    with pytest.raises(ConfigError, match=r"add data\.dir=\S*chars max_steps=40 to the resume command"):
        _resume(run, "experiment=cpu_tiny", "attention=naive")
    monkeypatch.chdir(tmp_path)  # repeated where the run was launched (data.dir=chars is relative)
    merged, _, record = _resume(run, *LAUNCH, "max_steps=80")
    assert (
        merged.seq_len == 128
        and merged.max_steps == 80
        and Path(merged.data.dir).resolve() == tmp_path / "chars"
    )
    assert "experiment=cpu_tiny" in record and "max_steps=80" in record


def test_a_run_of_all_defaults_without_a_record_resumes(tmp_path):
    run = _launch(tmp_path, [], record="none")
    merged, _, _ = _resume(run)
    assert merged.model.name == "gpt2"


@pytest.mark.parametrize(
    "value",
    [0.0006, 6e-05, None, True, 7, [1, 2], [], "a b", "x'y", "123", "runs/k=v", "", "a,b\\c", "x y=\\"],
)
def test_override_text_parses_back_as_the_value(value):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    back = OverridesParser.create().parse_override(R.override_text("k", value)).value()
    assert back == value and type(back) is type(value)
