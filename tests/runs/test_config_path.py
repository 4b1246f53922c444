"""``attention.window`` from the command line to the kernel: one schema and one check (GPTConfig's), and a
short path (it once went through 15 files and 4 validations)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import model.config as model_config
import trainer.fields as fields
from model.config import GPTConfig
from tests.helpers_train import REPO, compose_cfg
from trainer.checks import ConfigError, resolve_plan
from trainer.config import TrainConfig

#: Where the value goes on its way to the kernel's entry (``kernels.flash_attention``): the schema and
#: check, the trainer's groups and notes, the GPTConfig of the run (and the logged kernel plan), the
#: model, its attention call, the kernel's entry.
WINDOW_PATH = {
    "model/config.py",
    "trainer/config.py",
    "trainer/setup.py",
    "model/gpt.py",
    "model/attention.py",
    "kernels/flash_attn.py",
}


def _names_window(path: Path) -> bool:
    """Whether the code of ``path`` (not its docstrings or comments) handles a ``window``."""
    for n in ast.walk(ast.parse(path.read_text())):
        if (
            (isinstance(n, ast.Name) and n.id == "window")
            or (isinstance(n, ast.Attribute) and n.attr == "window")
            or (isinstance(n, (ast.keyword, ast.arg)) and n.arg == "window")
        ):
            return True
    return False


def test_window_reaches_the_kernel_through_at_most_six_files():
    """Every module of the trainer and the model that handles ``window`` is on the listed path (the
    decode path, model/generate.py, is sample.py's), and the path has at most 6 files."""
    found = {
        str(p.relative_to(REPO))
        for p in [REPO / "train.py", *(REPO / "trainer").glob("*.py"), *(REPO / "model").glob("*.py")]
        if _names_window(p)
    }
    assert found - {"model/generate.py"} == WINDOW_PATH - {"kernels/flash_attn.py"}, found
    assert _names_window(REPO / "kernels" / "flash_attn.py") and len(WINDOW_PATH) <= 6


@pytest.fixture
def window_checks(monkeypatch):
    """Every verdict of GPTConfig's field check on ``window``: (value, message, calling function)."""
    seen = []
    check = model_config.problem

    def counted(name, value):
        msg = check(name, value)
        if name == "window":
            seen.append((value, msg, sys._getframe(1).f_code.co_name))
        return msg

    monkeypatch.setattr(model_config, "problem", counted)
    monkeypatch.setattr(fields, "problem", counted)
    return seen


@pytest.mark.parametrize("window", [0, -3])
def test_a_bad_window_is_refused_once_by_the_one_check(window_checks, window):
    """attention.window=0 from the command line: one refusal, by GPTConfig's check, whose message is the
    config error, word for word the one a Python caller of GPTConfig gets."""
    with pytest.raises(ConfigError) as e:
        resolve_plan(compose_cfg([f"attention.window={window}"]), world_size=1, cuda_available=False)
    refused = [(msg, caller) for _, msg, caller in window_checks if msg]
    assert refused == [(str(e.value), "__post_init__")], window_checks
    assert f"attention.window={window} must be null or a positive integer" in str(e.value)
    with pytest.raises(ValueError) as direct:
        GPTConfig(window=window)
    assert str(direct.value) == str(e.value)


def test_a_window_of_the_wrong_type_is_worded_by_the_same_check(window_checks):
    """OmegaConf refuses attention.window=true while composing; the message is GPTConfig's check's."""
    with pytest.raises(Exception) as e:
        compose_cfg(["attention.window=true"])
    err = fields.config_error_from(e.value, TrainConfig)
    assert [msg for _, msg, _ in window_checks if msg] == [str(err)], window_checks
    assert str(err).startswith("attention.window=True must be null or a positive integer, e.g. ")


def test_a_good_window_reaches_the_model_config():
    cfg = compose_cfg(["attention.window=1024", "model=tiny", "seq_len=2048"])
    plan = resolve_plan(cfg, world_size=1, cuda_available=True)
    from trainer.config import gpt_config_for

    assert gpt_config_for(cfg, 128).window == 1024 and plan.head_dim == 32
