"""Edges of ``resume=true`` found by review (real train.py processes on the CPU, real run directories).

1. A resume pointed at a directory that holds no run stops with the no-checkpoint message before any
   data is prepared (no default download, nothing written where it was launched).
"""

from __future__ import annotations

import subprocess

import pytest
from helpers_train import describe, train_command, train_env

pytestmark = pytest.mark.slow


def _offline_env() -> dict:
    """train.py's environment with the network cut off: any download fails at once."""
    dead = "http://127.0.0.1:9"  # the discard port: nothing listens
    return train_env(http_proxy=dead, https_proxy=dead, HTTP_PROXY=dead, HTTPS_PROXY=dead)


def test_resume_into_a_dir_without_a_run_prepares_no_data(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    missing = tmp_path / "no_such_run"
    cmd, env = train_command(["resume=true", f"out_dir={missing}"], env=_offline_env())
    proc = subprocess.run(cmd, cwd=str(elsewhere), env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, describe(proc)
    assert "has no loadable checkpoint" in proc.stderr, describe(proc)
    assert "download" not in proc.stderr + proc.stdout, describe(proc)
    assert list(elsewhere.iterdir()) == []  # no data/shakespeare prepared (or attempted) here
