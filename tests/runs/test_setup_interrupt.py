"""A signal during a run's set-up (train.py preparing ``data.source`` into ``data.dir``, building the model),
before the first step: the run directory says "interrupted" in summary.json, the command to start again is
printed, exit 128 + signal, no traceback; the data preparation continues from its complete shards."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

from tests.helpers_train import run_inprocess, tiny_overrides


def _interrupt_prepare(monkeypatch, signum: int) -> None:
    import data.prepare

    def interrupted(*args, **kwargs):
        if signum == signal.SIGINT:
            raise KeyboardInterrupt  # what Ctrl-C raises in the main thread
        os.kill(os.getpid(), signum)  # the handler of the set-up raises where the process is
        pytest.fail("the signal did not stop the set-up")

    monkeypatch.setattr(data.prepare, "ensure_prepared", interrupted)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_during_data_preparation_records_interrupted(
    tmp_path, shakespeare_path, monkeypatch, capsys, signum
):
    out = tmp_path / "run"
    args = tiny_overrides(tmp_path / "data", shakespeare_path, out)
    _interrupt_prepare(monkeypatch, signum)
    outcome = run_inprocess(args, out)
    assert (outcome.status, outcome.exit_code) == ("interrupted", 128 + signum)
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "interrupted" and s["steps"] == 0 and s["signal"] == signal.Signals(signum).name
    printed = capsys.readouterr().out
    hint = s["restart_hint"]
    assert f"Start the run again (in a new run directory) with:\n  {hint}" in printed, printed
    assert "resume=true" not in hint and "out_dir=" not in hint and "data.dir=" in hint
    assert signal.getsignal(signal.SIGTERM) is not None and "Traceback" not in printed


def test_signal_during_a_resumes_set_up_leaves_the_run_as_it_was(
    tmp_path, char_data, shakespeare_path, capsys
):
    out = tmp_path / "run"
    args = tiny_overrides(char_data, shakespeare_path, out, max_steps=8)
    assert run_inprocess(args, out).exit_code == 0
    before = (out / "summary.json").read_text()
    mp = pytest.MonkeyPatch()
    with mp.context() as m:
        _interrupt_prepare(m, signal.SIGINT)
        outcome = run_inprocess([*args[:-1], "resume=true", "max_steps=12", f"out_dir={out}"], out)
    assert (outcome.status, outcome.exit_code) == ("interrupted", 130)
    assert (out / "summary.json").read_text() == before
    printed = capsys.readouterr().out  # the command keeps TRITON_INTERPRET=1 when the tests run under it
    assert re.search(r"Resume with:\n  (TRITON_INTERPRET=\S+ )?python train.py", printed), printed
