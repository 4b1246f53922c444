"""Resuming a run whose directory cannot be written (a colleague's runs, a read-only share): the refusal
names that cause (not "no checkpoint", which led to another run) and a way forward that works as typed:
copy the run where it can be written, then resume the copy."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers_train import KILLED_AFTER, copy_run, describe, run_train, summary, train_env


@pytest.mark.slow  # three train.py processes (one resumes 10 steps), ~15 s on 2 shared cores
def test_resume_of_a_read_only_run_names_the_cause_and_a_copy_that_resumes(
    killed_run, tmp_path, read_only_view
):
    run = read_only_view(copy_run(killed_run, tmp_path / "run"))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    # $HOME itself read-only too: the copy goes to the temp folder, which can be written
    env = train_env(HOME=str(run), TMPDIR=str(tmp))
    proc = run_train(["resume=true", f"out_dir={run}"], env=env)
    assert proc.returncode == 2, describe(proc)
    err = proc.stderr
    assert f"the run directory {run} is not writable" in err and "newest run" not in err, err
    m = re.search(r"`(mkdir -p [^`]*)`.*, then resume=true out_dir=(\S+)", err)
    assert m, err
    copy = Path(m.group(2))
    assert copy.parent == tmp / "flashgpt-runs", err

    subprocess.run(m.group(1), shell=True, check=True, env=env)  # the advice, as typed
    proc = run_train(["resume=true", f"out_dir={copy}"], env=env)
    assert proc.returncode == 0, describe(proc)
    assert f"resumed from {copy}" in proc.stdout + proc.stderr, describe(proc)
    assert summary(copy)["status"] == "ok" and summary(copy)["steps"] == 16 > KILLED_AFTER
