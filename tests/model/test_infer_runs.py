"""eval.py and the run it is pointed at: the run's data changed since it trained."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.helpers_train import copy_run, describe
from tests.model.test_sample import EVAL, _run, _tree
from trainer import checkpoint as ckpt


@pytest.fixture
def run_copy(reference_run, tmp_path):
    """A copy of the shared reference run (checkpoints at steps 8 and 16) that a test may write into."""
    return copy_run(reference_run, tmp_path / "A")


def _refused(proc, *says):
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, describe(proc)
    for s in says:
        assert s in proc.stderr, describe(proc)


def test_eval_refuses_the_runs_data_dir_prepared_again_from_a_changed_corpus(run_copy, tmp_path):
    """As resume=true refuses: the corpus got a line more and its data dir was prepared again. eval.py
    says what differs and how to evaluate on the new data on purpose; the unchanged data evaluates."""
    from data.prepare import ensure_prepared

    old = ckpt.load_checkpoint(run_copy / "ckpt" / "step_00000016")
    source, data = tmp_path / "corpus.txt", tmp_path / "data"
    shutil.copy(old["config"]["data"]["source"], source)
    shutil.copytree(old["config"]["data"]["dir"], data)  # the run's own data, in a folder we may change
    for step in (8, 16):  # the run trained on data (as if with data.dir=data)
        d = ckpt.ckpt_path(run_copy, step)
        state = ckpt.load_checkpoint(d)
        state["config"]["data"]["dir"] = str(data)
        torch.save({k: v for k, v in state.items() if k != "path"}, d / ckpt.RECORD)
    work = tmp_path / "work"
    work.mkdir()
    proc = _run(EVAL, [f"run={run_copy}", "batches=1"], work)
    assert proc.returncode == 0 and "val loss" in proc.stdout, describe(proc)

    with open(source, "a") as f:
        f.write("ROMEO: one line more.\n")
    shutil.rmtree(data)
    ensure_prepared(str(source), str(data), "char", 0.1)
    before = _tree(run_copy)
    proc = _run(EVAL, [f"run={run_copy}", "batches=1"], work)
    new_sha = json.loads((data / "meta.json").read_text())["source_sha256"]
    _refused(
        proc,
        f"the data in {data} are not the data {ckpt.ckpt_path(run_copy, 16)} was trained on",
        f"source_sha256 {old['data']['source_sha256']} -> {new_sha}",
        f"pass data.dir={data} to evaluate on these data on purpose",
    )
    assert _tree(run_copy) == before and list(work.iterdir()) == []
    proc = _run(EVAL, [f"run={run_copy}", "batches=1", f"data.dir={data}", "write=false"], work)
    assert proc.returncode == 0 and "val loss" in proc.stdout, describe(proc)
    assert _tree(run_copy) == before
