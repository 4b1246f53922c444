"""eval.py / sample.py and the run they are pointed at: the run's data changed since it trained, run= and
ckpt= of two runs, a checkpoint file, a folder that is no run or has no checkpoint yet, a corrupt record.
Each refusal exits 2 with the key and a value that works, and writes nothing anywhere."""

from __future__ import annotations

import json
import pickle
import shutil
import socket

import pytest
import torch

from tests.helpers_train import copy_run, describe
from tests.helpers_train import summary as read_summary
from tests.model.test_sample import EVAL, SAMPLE, _run, _tree
from trainer import checkpoint as ckpt
from trainer.infer import InferError, find_checkpoint


@pytest.fixture
def run_copy(reference_run, tmp_path):
    """A copy of the shared reference run (checkpoints at steps 8 and 16) that a test may write into."""
    return copy_run(reference_run, tmp_path / "A")


def _refused(proc, *says):
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, describe(proc)
    for s in says:
        assert s in proc.stderr, describe(proc)


@pytest.mark.slow  # over 5 s on 2 cores
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


@pytest.mark.slow  # over 5 s on 2 cores
def test_run_and_a_checkpoint_of_another_run_are_refused(reference_run, run_copy, tmp_path):
    """run=A ckpt=<B's checkpoint> would write B's results into A: refused like init_from with run=, naming
    both keys and a command that works, nothing written into either run; a ckpt= inside run= still works."""
    other = ckpt.ckpt_path(reference_run, 8)
    before = _tree(run_copy), _tree(reference_run)
    for script in (EVAL, SAMPLE):
        proc = _run(script, [f"run={run_copy}", f"ckpt={other}"], tmp_path)
        _refused(
            proc,
            f"run={run_copy} and ckpt={other} do not agree",
            f"ckpt={other} alone (results in {reference_run})",
            f"or run={run_copy} alone",
        )
    assert (_tree(run_copy), _tree(reference_run)) == before and list(tmp_path.iterdir()) == [run_copy]
    proc = _run(EVAL, [f"run={run_copy}", f"ckpt={ckpt.ckpt_path(run_copy, 8)}", "batches=1"], tmp_path)
    assert proc.returncode == 0, describe(proc)
    (result,) = (run_copy / "evals").glob("*.json")
    assert json.loads(result.read_text())["step"] == 8


@pytest.mark.slow  # over 5 s on 2 cores
def test_sample_from_a_checkpoint_file_and_write_false(run_copy, tmp_path):
    """ckpt=<step dir>/flashgpt.pt is its checkpoint (samples into its run); write=false prints only."""
    record = ckpt.ckpt_path(run_copy, 8) / ckpt.RECORD
    proc = _run(SAMPLE, [f"ckpt={record}", "max_new_tokens=2", "num_samples=1"], tmp_path)
    assert proc.returncode == 0 and "step_00000008" in proc.stdout, describe(proc)
    assert len(list((run_copy / "samples").glob("*_step_00000008.txt"))) == 1
    shutil.rmtree(run_copy / "samples")
    before = _tree(run_copy)
    proc = _run(SAMPLE, [f"run={run_copy}", "max_new_tokens=2", "num_samples=1", "write=false"], tmp_path)
    assert proc.returncode == 0 and "sample 1/1" in proc.stdout, describe(proc)
    assert "written" not in proc.stdout and _tree(run_copy) == before
    assert list(tmp_path.iterdir()) == [run_copy]


def test_ckpt_of_a_run_directory_suggests_run(run_copy, tmp_path):
    before = _tree(run_copy)
    proc = _run(EVAL, [f"ckpt={run_copy}"], tmp_path)
    _refused(proc, f"ckpt={run_copy} is a run directory, not a checkpoint: did you mean run={run_copy}?")
    assert _tree(run_copy) == before


def _find_error(run=None, ckpt_path=None) -> str:
    with pytest.raises(InferError) as e:
        find_checkpoint(None if run is None else str(run), None if ckpt_path is None else str(ckpt_path))
    return str(e.value)


def test_a_folder_past_a_finished_runs_last_step_is_no_lost_checkpoint(run_copy):
    """An empty ckpt/step_<N> folder past the last step of a finished run (made by hand) does not load and
    is skipped with a warning, but is not "the run's newest weights, gone": the run never trained there,
    and the resume that warning would suggest has nothing to do (a new-user walk found the two at odds)."""
    final = read_summary(run_copy)["steps"]
    stray = ckpt.ckpt_path(run_copy, final + 4)
    stray.mkdir()
    said = []
    path, state, _ = find_checkpoint(str(run_copy), None, warn=said.append)
    assert state["step"] == final and path == ckpt.ckpt_path(run_copy, final), said
    assert len(said) == 1 and f"checkpoint {stray} does not load" in said[0], said
    assert ckpt.lost_after(run_copy, final, read_summary(run_copy)) is None
    record = ckpt.ckpt_path(run_copy, final) / ckpt.RECORD  # now the final checkpoint is lost too
    record.write_bytes(record.read_bytes()[:1000])
    said.clear()
    path, state, _ = find_checkpoint(str(run_copy), None, warn=said.append)
    gone = f"its final weights (step {final}) are gone: {ckpt.ckpt_path(run_copy, final).name} does not load"
    assert state["step"] < final and gone in said[-1], said


def test_run_holding_or_inside_the_checkpoints_run_is_refused(run_copy, tmp_path):
    """run= a folder above the checkpoint's run (runs/, .) or its ckpt/ folder: the results would go there
    (./evals/, ckpt/samples/), not into the run. Refused like another run's checkpoint, naming both keys and
    the ckpt= alone that works; a ckpt= of run= itself (not its newest, as its record file) is used."""
    step8 = ckpt.ckpt_path(run_copy, 8)
    for run in (tmp_path, run_copy / "ckpt", tmp_path / "nope"):
        said = _find_error(run, step8)
        assert f"run={run} and ckpt={step8} do not agree" in said and f"ckpt={step8} alone" in said, said
        assert "or run=" not in said, said  # no run to suggest: none of these is one
    path, state, run_dir = find_checkpoint(f"{run_copy}/", str(step8 / ckpt.RECORD))
    assert (path, state["step"], run_dir.resolve()) == (step8, 8, run_copy.resolve())


def test_run_that_is_no_run_or_has_no_checkpoint_yet_says_which(run_copy, tmp_path):
    """run= of a ckpt/ folder, of a folder that is no run, of a live or killed run before its first
    checkpoint, of a run that ended before it: each says so (not always "it ended before ...")."""
    assert f"run={run_copy}/ckpt is the checkpoint folder of a run: pass run={run_copy}" in _find_error(
        run_copy / "ckpt"
    )
    assert f"ckpt={run_copy}/ckpt is the checkpoint folder of a run: pass run={run_copy}" in _find_error(
        ckpt_path=run_copy / "ckpt"
    )
    step8 = ckpt.ckpt_path(run_copy, 8)
    assert (
        f"run={step8} is a checkpoint of a run: did you mean ckpt={step8}? (or run={run_copy})"
        in _find_error(step8)
    )
    (tmp_path / "notarun").mkdir()
    assert "is not a flashgpt run directory (no summary.json or config.resolved.yaml)" in _find_error(
        tmp_path / "notarun"
    )
    live = tmp_path / "live"
    live.mkdir()
    cases = [
        (
            {"status": "running"},
            "has no checkpoint yet",
            "it is still running (summary.json status 'running')",
        ),
        (
            {"status": "running", "pid": 2**22 + 1, "host": socket.gethostname()},  # no such process
            "has no checkpoint (looked in",
            "it was killed before its first checkpoint",
        ),
        ({"status": "error"}, "has no checkpoint (looked in", "it ended (status 'error') before its first"),
        (  # a finished run whose ckpt/ was deleted: not "ended before its first checkpoint"
            {"status": "ok", "last_checkpoint": str(live / "ckpt" / "step_00000016")},
            "has no checkpoint (looked in",
            "its checkpoints are gone (it wrote up to step_00000016; ckpt/ holds none now); train anew",
        ),
    ]
    for summary, head, why in cases:
        (live / "summary.json").write_text(json.dumps(summary))
        text = _find_error(live)
        assert f"run={live} {head}" in text and why in text, text
        assert "ended before" not in text or summary["status"] == "error"


def test_a_corrupt_record_says_so_and_an_older_checkpoint_is_used(run_copy):
    """A flashgpt.pt that is no checkpoint record (here a pickled class, which torch's weights-only loader
    answers with "Re-running torch.load with weights_only=False will likely succeed"): said to be corrupt
    or not a flashgpt checkpoint; run= falls back to the older checkpoint."""
    bad = ckpt.ckpt_path(run_copy, 16)
    (bad / ckpt.RECORD).write_bytes(pickle.dumps(object, protocol=2))
    text = _find_error(ckpt_path=bad)
    assert f"ckpt={bad} does not load: {bad / ckpt.RECORD} is corrupt or not a flashgpt checkpoint" in text
    assert "weights_only" not in text
    warnings: list[str] = []
    path, state, _ = find_checkpoint(str(run_copy), None, warn=warnings.append)
    assert path == ckpt.ckpt_path(run_copy, 8) and state["step"] == 8
    assert "is corrupt or not a flashgpt checkpoint record" in warnings[0], warnings
    assert not any("weights_only" in w for w in warnings), warnings


def test_a_run_that_trained_past_its_newest_checkpoint_is_said(run_copy):
    """checkpoint.at_end=false: the run's summary says 20 steps, its newest checkpoint is step 16; eval.py and
    sample.py use step 16 and say that steps 17-20 were never saved."""
    path = run_copy / "summary.json"
    said: list[str] = []
    find_checkpoint(str(run_copy), None, warn=said.append)
    assert said == []  # the run ended at its newest checkpoint
    path.write_text(json.dumps(json.loads(path.read_text()) | {"steps": 20}))
    p, state, _ = find_checkpoint(str(run_copy), None, warn=said.append)
    assert state["step"] == 16 and p.name == "step_00000016"
    assert (
        len(said) == 1 and "trained to step 20" in said[0] and "no checkpoint holds steps 17-20" in said[0]
    ), said


@pytest.mark.slow  # over 5 s on 2 cores
def test_eval_on_a_data_dir_without_meta_prints_the_runs_own_prepare_command(run_copy, tmp_path):
    """The run's data dir lost its meta.json: the error's prepare command names the run's corpus and
    tokenizer (from the checkpoint), not a placeholder, and runs as typed."""
    import shlex
    import subprocess
    import sys

    from tests.helpers_train import REPO

    old = ckpt.load_checkpoint(run_copy / "ckpt" / "step_00000016")
    data = tmp_path / "data"
    shutil.copytree(old["config"]["data"]["dir"], data)
    for step in (8, 16):
        d = ckpt.ckpt_path(run_copy, step)
        state = ckpt.load_checkpoint(d)
        state["config"]["data"]["dir"] = str(data)
        torch.save({k: v for k, v in state.items() if k != "path"}, d / ckpt.RECORD)
    (data / "meta.json").unlink()
    work = tmp_path / "work"
    work.mkdir()
    proc = _run(EVAL, [f"run={run_copy}", "batches=1"], work)
    assert proc.returncode == 2 and "CORPUS" not in proc.stderr, describe(proc)
    source = old["config"]["data"]["source"]
    fix = proc.stderr.split("prepare it with `", 1)[1].split("`", 1)[0]
    assert f"--source {shlex.quote(str(source))}" in fix and "--tokenizer char" in fix, fix
    subprocess.run([sys.executable, *shlex.split(fix)[1:]], cwd=REPO, check=True, capture_output=True)
    proc = _run(EVAL, [f"run={run_copy}", "batches=1", "write=false"], work)
    assert proc.returncode == 0 and "val loss" in proc.stdout, describe(proc)
