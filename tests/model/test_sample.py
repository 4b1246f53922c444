"""Sampling: standalone checkpoints (tokenizer inside), the KV cache, sample.py and eval.py."""

from __future__ import annotations

import hashlib
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers_train import (
    REPO,
    describe,
    prepare_char_data,
    read_jsonl,
    run_train,
    tiny_overrides,
    train_env,
)
from tests.infer_batch import run_commands
from trainer import checkpoint as ckpt
from trainer.checkpoint import tokenizer_from_checkpoint, tokenizer_record

CHARS = list("\n !,.:;?ABCabc")


def _char_meta(itos=CHARS) -> dict:
    return {
        "format_version": 2,
        "tokenizer": "char",
        "vocab_size": len(itos),
        "train_tokens": 0,
        "val_tokens": 0,
        "source": "x",
        "source_sha256": "0",
        "dtype": "uint16",
        "shard_tokens": 1,
        "shards": {"train": [], "val": []},
        "itos": list(itos),
    }


def _write_meta(d, meta) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "meta.json").write_text(json.dumps(meta))


# ------------------------------------------------------------------------------ standalone checkpoints


def test_tokenizer_record_holds_char_vocabulary():
    rec = tokenizer_record(_char_meta())
    assert rec == {"name": "char", "vocab_size": len(CHARS), "itos": CHARS}
    tok = tokenizer_from_checkpoint({"tokenizer": rec, "config": {"data": {"dir": "/nonexistent"}}})
    assert tok.decode(tok.encode("Abc, cab!\n")) == "Abc, cab!\n"


def test_checkpoint_without_a_tokenizer_is_a_clear_error():
    with pytest.raises(ValueError, match="incomplete or unknown"):
        tokenizer_from_checkpoint({"tokenizer": {"name": "char", "vocab_size": 14}})
    with pytest.raises(ValueError, match="names no tokenizer"):
        tokenizer_from_checkpoint({"model": {}})


def test_gpt2_checkpoint_tokenizer(gpt2_bpe):
    tok = tokenizer_from_checkpoint({"tokenizer": {"name": "gpt2", "vocab_size": 50257}})
    assert tok.decode(tok.encode("To be, or not")) == "To be, or not"


# ------------------------------------------------------------------------ sample.py / eval.py end to end

SAMPLE = REPO / "sample.py"
EVAL = REPO / "eval.py"


def _tree(d: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under d (what a refused command must leave as it was)."""
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory, shakespeare_path):
    """A 6-step experiment=cpu_tiny run (seq_len 64): (run dir, data dir)."""
    base = tmp_path_factory.mktemp("sample")
    data = prepare_char_data(base, shakespeare_path)
    run = base / "run"
    args = tiny_overrides(
        data,
        shakespeare_path,
        run,
        max_steps=6,
        checkpoint__interval=3,
        optim__decay_steps=6,
        eval__interval=0,
        model__dropout=0.0,
    )
    proc = run_train(["experiment=cpu_tiny", *args])
    assert proc.returncode == 0, describe(proc)
    return run, data


def _run(script: Path, args: list[str], cwd: Path, **env):
    return subprocess.run(
        [sys.executable, str(script), *args],
        cwd=str(cwd),
        env=train_env(**env),
        capture_output=True,
        text=True,
        timeout=300,
    )


def _write_checkpoint(src: Path, dst: Path, state: dict) -> None:
    """A copy of checkpoint directory ``src`` at ``dst`` with ``state`` as its record."""
    import shutil

    shutil.copytree(src, dst, dirs_exist_ok=True)
    torch.save({k: v for k, v in state.items() if k != "path"}, dst / ckpt.RECORD)


def test_trainer_checkpoint_holds_char_vocabulary(trained):
    run, data = trained
    state = ckpt.load_checkpoint(run / "ckpt" / "step_00000006")
    assert state["tokenizer"]["itos"] == json.loads((data / "meta.json").read_text())["itos"]


def test_sample_end_to_end(trained, tmp_path):
    run, _ = trained
    records = {k: v for k, v in _tree(run).items() if not k.startswith(("samples", "evals"))}
    proc = _run(
        SAMPLE, [f"run={run}", "prompt=ROMEO:", "num_samples=2", "max_new_tokens=30", "seed=3"], tmp_path
    )
    assert proc.returncode == 0, describe(proc)
    assert "sample 1/2" in proc.stdout and "sample 2/2" in proc.stdout and "ROMEO:" in proc.stdout
    assert "step_00000006" in proc.stdout  # the newest checkpoint
    assert re.search(r"prefill 12 tokens at [\d.]+ tok/s \| decode 58 tokens at [\d.]+ tok/s", proc.stdout)
    (js,) = (run / "samples").glob("*.json")
    rec = json.loads(js.read_text())
    assert rec["step"] == 6 and len(rec["samples"]) == 2 and all(len(t) == 30 for t in rec["token_ids"])
    assert js.with_suffix(".txt").read_text().count("ROMEO:") == 2
    assert rec["decode_tokens_per_sec"] > 0 and rec["prefill_tokens_per_sec"] > 0
    assert list(tmp_path.iterdir()) == []  # nothing in the launch directory (no outputs/, .hydra/, log)
    after = {k: v for k, v in _tree(run).items() if not k.startswith(("samples", "evals"))}
    assert after == records  # training records untouched


@pytest.mark.slow
def test_sample_greedy_same_for_backends_and_without_cache(trained, tmp_path):
    """Greedy text of the trained model: the same with naive, sdpa (math), flash (interpreter; its decode
    steps run flash_decode), without the KV cache and with static decode steps."""
    run, _ = trained
    common = [f"run={run}", "prompt=First Citizen:", "num_samples=1", "max_new_tokens=8", "temperature=0"]
    texts = []
    for extra, env in [
        ([], {}),
        (["attention=sdpa", "attention.sdpa_backend=math"], {}),
        (["use_cache=false", "static_decode=true"], {}),
        (["static_decode=true"], {}),
        (["attention=flash"], {"TRITON_INTERPRET": "1"}),
        (["attention=flash", "static_decode=true"], {"TRITON_INTERPRET": "1"}),
    ]:
        out = tmp_path / f"{len(texts)}.txt"
        proc = _run(SAMPLE, [*common, *extra, f"out={out}"], tmp_path, **env)
        assert proc.returncode == 0, describe(proc)
        record = json.loads(out.with_suffix(".json").read_text())
        texts.append(record["token_ids"])
        # the record says what ran: no static step without the cache, and no CUDA graph on the CPU
        want = "static_decode=true" in extra and "use_cache=false" not in extra
        assert record["static_decode"] is want and record["cuda_graph"] is False, (extra, record)
    assert all(t == texts[0] for t in texts), texts


@pytest.mark.slow  # over 5 s on 2 cores
def test_sample_greedy_note_and_pinned_sdpa_kernel_in_the_header(trained, tmp_path):
    """temperature=0 with several samples says once (stderr) that they are identical, the files unchanged;
    the header line names a pinned SDPA kernel (attention.sdpa_backend=math), not just attention=sdpa."""
    run, _ = trained
    common = [f"run={run}", "prompt=First Citizen:", "max_new_tokens=4", "attention=sdpa"]  # trained naive
    proc = _run(SAMPLE, [*common, "num_samples=2", "temperature=0", f"out={tmp_path / 'g.txt'}"], tmp_path)
    assert proc.returncode == 0, describe(proc)
    assert proc.stderr.count("temperature=0 is greedy: the 2 samples are identical") == 1, describe(proc)
    assert "sample 2/2" in proc.stdout and "| attention=sdpa | device=" in proc.stdout
    assert (tmp_path / "g.txt").read_text().count("---------- sample") == 2
    proc = _run(
        SAMPLE,
        [*common, "num_samples=2", "attention.sdpa_backend=math", f"out={tmp_path / 'm.txt'}"],
        tmp_path,
    )
    assert proc.returncode == 0, describe(proc)
    assert "| attention=sdpa (sdpa_backend=math) | device=" in proc.stdout, describe(proc)
    assert "greedy" not in proc.stderr


@pytest.mark.slow  # over 5 s on 2 cores
def test_sample_from_checkpoint_file_alone(trained, tmp_path):
    """A checkpoint whose data directory is gone still samples (the vocabulary is inside)."""
    run, data = trained
    src = run / "ckpt" / "step_00000006"
    state = ckpt.load_checkpoint(src)
    state["config"]["data"]["dir"] = str(tmp_path / "gone")
    _write_checkpoint(src, tmp_path / "alone", state)
    proc = _run(SAMPLE, [f"ckpt={tmp_path / 'alone'}", "max_new_tokens=5", "num_samples=1"], tmp_path)
    assert proc.returncode == 0, describe(proc)
    assert len(list(tmp_path.glob("samples/*.txt"))) == 1  # beside the checkpoint: no ckpt/ folder above it


SAMPLE_REFUSALS = [
    (["run={tmp}/nope"], "no such run directory"),
    (["run={empty}"], "is not a flashgpt run directory (no summary.json or config.resolved.yaml)"),
    (["run={run}/ckpt"], "/ckpt is the checkpoint folder of a run: pass run="),
    (["ckpt={tmp}/nope"], "no such checkpoint directory"),
    (["ckpt={run}/ckpt/step_00000099"], "/ckpt holds step_00000006"),  # the run's checkpoints
    (["run={run}_gone"], "no such run directory (newest run with checkpoints: run="),
    ([], "say which run"),
    (["run={run}", "prompt='héllo'"], "character 'é'"),
    (["run={run}", "prompt=file:{tmp}/missing.txt"], "missing.txt: no such file; name an existing one"),
    (["run={run}", "prompt=''"], "prompt is empty"),
    (["run={run}", "num_samples=0"], "config error: num_samples=0 must be a positive integer"),
    (
        ["run={run}", "temprature=0.5"],
        "config error: temprature is not a config key; did you mean temperature?",
    ),
    (["run={run}", "+typo=1"], "config error: typo is not a config key"),
    (
        ["run={run}", "max_new_tokens=abc"],
        "config error: max_new_tokens='abc' must be a positive integer",
    ),
    (["run={run}", "max_new_tokens=0"], "config error: max_new_tokens=0 must be a positive integer"),
    (["run={run}", f"seed={2**64}"], "config error: seed=18446744073709551616 must be an integer from 0 to"),
    (["run={run}", "attention.window=8"], "config error: attention.window is not a config key"),
    (["run={run}", "attention=gpt"], "config error: attention=gpt is not a config of group attention"),
    (["run={run}", "temperature=-0.5"], "temperature must be >= 0"),
    (["run={run}", "top_k=0"], "top_k must be an int >= 1"),
    (["run={run}", "top_p=0"], r"top_p must be in (0, 1]"),
    (["run={run}", "top_p=1.2"], r"top_p must be in (0, 1]"),
    (["run={run}", "attention=flash"], "TRITON_INTERPRET=1"),
    (["run={run}", "dtype=float64"], "dtype='float64' is not supported"),
    (["run={run}", "device=tpu"], "device='tpu' is not a device"),
    (["run={run}", "device=cpu", "cuda_graph=true"], "cuda_graph=true needs device=cuda"),
]


def _refusals(script: Path, table: list, run: Path, base: Path) -> list:
    """Each command of ``table`` run (one process for all: ``tests.infer_batch``) from an empty folder
    ``launch`` of its own, beside an empty ``empty`` ({run}, {tmp} and {empty} in its arguments)."""
    cases = []
    for i, (args, _) in enumerate(table):
        tmp = base / str(i)
        (tmp / "empty").mkdir(parents=True)
        (tmp / "launch").mkdir()
        args = [a.format(run=run, tmp=tmp, empty=tmp / "empty") for a in args]
        cwd = str(tmp / "launch")
        cases.append({"script": str(script), "args": args, "cwd": cwd, "watch": [str(run), str(tmp)]})
    return run_commands(cases, base / "batch", train_env())


def _assert_refused(proc, message: str) -> None:
    """Exit 2 with ``message`` and no traceback, the run and the command's folders as they were; the line
    starts with its kind alone, as train.py's do (``config error: `` or ``error: ``, no script name)."""
    assert proc.returncode == 2, describe(proc)
    assert message in proc.stderr and "Traceback" not in proc.stderr, describe(proc)
    line = next(line for line in proc.stderr.splitlines() if message in line)
    assert line.startswith(("config error: ", "error: ")), describe(proc)
    assert proc.after == [proc.before[0], {"empty": None, "launch": None}], describe(proc)


@pytest.fixture(scope="module")
def sample_refusals(trained, tmp_path_factory):
    return _refusals(SAMPLE, SAMPLE_REFUSALS, trained[0], tmp_path_factory.mktemp("sample_refusals"))


@pytest.mark.parametrize("case", range(len(SAMPLE_REFUSALS)), ids=[m for _, m in SAMPLE_REFUSALS])
def test_sample_errors_exit_2_and_write_nothing(sample_refusals, case):
    _assert_refused(sample_refusals[case], SAMPLE_REFUSALS[case][1])


@pytest.mark.slow  # over 5 s on 2 cores
def test_empty_prompt_hint_suggests_prompts_that_work(trained, tmp_path):
    """The empty-prompt error suggests prompts that go through Hydra and the char vocabulary as typed in
    bash (not prompt='\\n', which arrives as a backslash and an n); each suggestion samples."""
    run, _ = trained
    proc = _run(SAMPLE, [f"run={run}", "prompt="], tmp_path)
    assert proc.returncode == 2 and "prompt is empty" in proc.stderr, describe(proc)
    hint = proc.stderr
    assert "prompt='\\n'" not in hint, hint
    make_file = "printf '\\n' > nl.txt"
    prompts = ["prompt=ROMEO:", "\"prompt='First Citizen:'\"", "prompt=file:nl.txt"]
    assert all(s in hint for s in [make_file, *prompts]), hint
    # as bash runs them: printf's file holds one newline, the quoted prompt is one argument
    for i, prompt in enumerate(prompts):
        cmd = f"{make_file} && {sys.executable} {SAMPLE} run={run} max_new_tokens=2 num_samples=1 {prompt}"
        proc = subprocess.run(
            ["bash", "-c", f"{cmd} out={tmp_path / f'{i}.txt'}"],
            cwd=tmp_path,
            env=train_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, describe(proc)
    got = [json.loads((tmp_path / f"{i}.json").read_text())["prompt"] for i in range(len(prompts))]
    assert got == ["ROMEO:", "First Citizen:", "\n"]


@pytest.mark.slow  # over 5 s on 2 cores
def test_sample_long_prompt_keeps_last_block(trained, tmp_path):
    run, _ = trained
    (tmp_path / "p.txt").write_text("ab" * 50)  # 100 chars, block size 64
    proc = _run(
        SAMPLE,
        [
            f"run={run}",
            f"prompt=file:{tmp_path / 'p.txt'}",
            "max_new_tokens=2",
            "num_samples=1",
            f"out={tmp_path / 's.txt'}",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, describe(proc)
    assert "keeping its last 64 tokens" in proc.stderr
    assert json.loads((tmp_path / "s.json").read_text())["prompt_tokens"] == 64


@pytest.mark.slow  # over 5 s on 2 cores
def test_eval_matches_the_runs_val_loss(trained, tmp_path):
    run, _ = trained
    records = {k: v for k, v in _tree(run).items() if not k.startswith(("samples", "evals"))}
    logged = [r["val/loss"] for r in read_jsonl(run) if "val/loss" in r][-1]
    results = {}
    for extra in ([], ["attention=sdpa"], ["data.split=train"]):
        proc = _run(EVAL, [f"run={run}", *extra], tmp_path)
        assert proc.returncode == 0, describe(proc)
        (new,) = set((run / "evals").glob("*.json")) - set(results.values())
        results[" ".join(extra)] = new
    val = json.loads(results[""].read_text())
    assert val["step"] == 6 and val["split"] == "val" and "perplexity" in val
    assert abs(val["loss"] - logged) < 1e-5, (val, logged)
    assert abs(json.loads(results["attention=sdpa"].read_text())["loss"] - logged) < 1e-5
    train = json.loads(results["data.split=train"].read_text())
    assert train["split"] == "train" and abs(train["loss"] - logged) > 1e-7 and train["loss"] < 4.0
    assert abs(val["perplexity"] - math.exp(val["loss"])) < 1e-9
    after = {k: v for k, v in _tree(run).items() if not k.startswith(("samples", "evals"))}
    assert after == records and list(tmp_path.iterdir()) == []


EVAL_REFUSALS = [
    (["run={tmp}/nope"], "no such run directory"),
    (["run={run}/config.resolved.yaml"], "config.resolved.yaml: is a file, not a run directory"),
    (
        ["run={run}", "data.split=test"],
        "config error: data.split='test' is not valid; choose one of: val, train",
    ),
    (["run={run}", "bathces=3"], "config error: bathces is not a config key; did you mean batches?"),
    (["run={run}", "+typo=1"], "config error: typo is not a config key"),
    (["run={run}", "seq_len=abc"], "config error: seq_len='abc' must be null or a positive integer"),
    (
        ["run={run}", "seed=-1"],
        "config error: seed=-1 must be null or an integer from 0 to 9223372036854775807",
    ),
    (["run={run}", "data.dir={tmp}/nodata"], "not found"),
    (["run={run}", "seq_len=65"], "exceeds the model's block size 64"),
]


@pytest.fixture(scope="module")
def eval_refusals(trained, tmp_path_factory):
    return _refusals(EVAL, EVAL_REFUSALS, trained[0], tmp_path_factory.mktemp("eval_refusals"))


@pytest.mark.parametrize("case", range(len(EVAL_REFUSALS)), ids=[m for _, m in EVAL_REFUSALS])
def test_eval_errors_exit_2_and_write_nothing(eval_refusals, case):
    _assert_refused(eval_refusals[case], EVAL_REFUSALS[case][1])


@pytest.mark.slow  # prepares a second corpus and runs eval.py, ~8 s
def test_eval_refuses_char_data_of_the_same_size_with_other_characters(trained, tmp_path, shakespeare_path):
    """Another char corpus with as many characters (65) but another set maps each id to another character:
    eval.py refuses it (exit 2, naming data.dir and the characters), where comparing sizes alone scored it."""
    from data.prepare import ensure_prepared

    run, _ = trained
    text = shakespeare_path.read_text()
    assert "Z" in text and "#" not in text
    source = tmp_path / "other.txt"
    source.write_text(text.replace("Z", "#"))
    other = tmp_path / "other_char"
    ensure_prepared(str(source), str(other), "char", 0.1)
    before = _tree(run)
    proc = _run(EVAL, [f"run={run}", f"data.dir={other}"], tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, describe(proc)
    assert f"data.dir={other} was tokenized unlike the checkpoint's" in proc.stderr, describe(proc)
    assert "not in the new data: 'Z'" in proc.stderr and "new: '#'" in proc.stderr, describe(proc)
    assert _tree(run) == before


@pytest.mark.slow  # over 5 s on 2 cores
def test_eval_and_sample_find_a_relative_data_dir_from_anywhere(trained, tmp_path):
    """A run trained with a relative data.dir (from its start directory, derived.cwd) is evaluated and
    sampled from another directory; a data.dir given to eval.py stays relative to the current directory."""
    import shutil

    import yaml

    src, data = trained
    start, elsewhere, run = tmp_path / "start", tmp_path / "elsewhere", tmp_path / "run"
    (start / "rel").mkdir(parents=True)
    (start / "rel" / "data").symlink_to(data, target_is_directory=True)
    elsewhere.mkdir()
    state = ckpt.load_checkpoint(src / "ckpt" / "step_00000006")
    state["config"]["data"]["dir"] = "rel/data"
    _write_checkpoint(src / "ckpt" / "step_00000006", run / "ckpt" / "step_00000006", state)
    saved = yaml.safe_load((src / "config.resolved.yaml").read_text())
    saved["data"]["dir"], saved["derived"]["cwd"] = "rel/data", str(start)
    (run / "config.resolved.yaml").write_text(yaml.safe_dump(saved))
    shutil.copy(src / "metrics.jsonl", run / "metrics.jsonl")

    proc = _run(EVAL, [f"run={run}"], elsewhere)
    assert proc.returncode == 0, describe(proc)
    (result,) = (run / "evals").glob("*.json")
    assert json.loads(result.read_text())["data_dir"] == str(start / "rel" / "data")
    proc = _run(SAMPLE, [f"run={run}", "max_new_tokens=3", "num_samples=1"], elsewhere)
    assert proc.returncode == 0, describe(proc)
    proc = _run(EVAL, [f"run={run}", "data.dir=rel/data", "write=false"], elsewhere)
    assert proc.returncode == 2 and "data.dir=rel/data (val): rel/data/meta.json not found" in proc.stderr
    assert list(elsewhere.iterdir()) == []


def test_samples_and_evals_of_the_same_second_get_their_own_files(tmp_path):
    """sample.py / eval.py name their files by the second: a second run in that second gets `-2`, never the
    first one's file (a `.txt` whose `.json` sibling exists counts as taken)."""
    from trainer.infer import claim_new_file

    first = claim_new_file(tmp_path / "samples", "20261201-195753_step_20", ".txt", siblings=(".json",))
    first.write_text("sample of seed 1")
    first.with_suffix(".json").write_text("{}")
    second = claim_new_file(tmp_path / "samples", "20261201-195753_step_20", ".txt", siblings=(".json",))
    assert second.name == "20261201-195753_step_20-2.txt" and second.exists()
    assert first.read_text() == "sample of seed 1"
    (tmp_path / "samples" / "x-2.json").write_text("{}")  # only the sibling of -2 exists
    (tmp_path / "samples" / "x.txt").write_text("")
    assert claim_new_file(tmp_path / "samples", "x", ".txt", siblings=(".json",)).name == "x-3.txt"


@pytest.mark.slow
def test_eval_caps_batches_and_batch_size_to_the_split(trained, tmp_path):
    """batch_size=100000 or batches=100000 on a ~111k-token split: cut to what covers the split once (a
    note says so, the result records it), instead of building gigabytes of batches or running for
    minutes; the run's own defaults are not cut."""
    import resource

    run, data = trained
    val_tokens = json.loads((data / "meta.json").read_text())["val_tokens"]
    for args, note, check in (
        (["batch_size=100000"], "using batch_size=", lambda r: r["batch_size"] * 64 <= val_tokens),
        (
            ["batches=100000"],
            "using batches=",
            lambda r: r["batches"] * r["batch_size"] * 64 < 2 * val_tokens,
        ),
    ):
        proc = _run(EVAL, [f"run={run}", *args], tmp_path)
        assert proc.returncode == 0, describe(proc)
        assert f"note: {args[0]} " in proc.stderr and note in proc.stderr, describe(proc)
        (new,) = sorted((run / "evals").glob("*.json"), key=lambda p: p.stat().st_mtime)[-1:]
        result = json.loads(new.read_text())
        assert check(result) and result["capped"], result
        assert math.isfinite(result["loss"])
    peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    assert peak_mib < 4096, peak_mib
    proc = _run(EVAL, [f"run={run}", "write=false"], tmp_path)  # the run's own batches: no note
    assert proc.returncode == 0 and "note:" not in proc.stderr, describe(proc)


@pytest.fixture
def read_only_run(trained, read_only_view):
    """The trained run seen through a read-only bind mount (a colleague's runs, a read-only share): as
    root, permission bits do not stop writes, a read-only mount does. Skips where mounting is refused."""
    return read_only_view(trained[0])


@pytest.mark.slow
def test_read_only_run_prints_results_and_exits_0(read_only_run, tmp_path):
    """sample.py, eval.py and bench.report on a read-only run: the result is printed, a note says what
    could not be written where and which option writes it elsewhere, exit 0, no traceback; with that
    option the files are written there."""
    run = read_only_run
    work = tmp_path / "work"
    work.mkdir()
    before = _tree(run)
    cases = [
        (SAMPLE, ["max_new_tokens=4", "num_samples=1"], "---------- sample 1/1", "samples", "out="),
        (EVAL, ["batches=1"], "val loss", "evals", "out="),
    ]
    for script, args, printed, folder, option in cases:
        proc = _run(script, [f"run={run}", *args], work)
        assert proc.returncode == 0, describe(proc)
        assert printed in proc.stdout and "Traceback" not in proc.stderr, describe(proc)
        assert f"not written: {run / folder} (Read-only file system)" in proc.stderr, describe(proc)
        assert f"Pass {option}" in proc.stderr
    elsewhere = tmp_path / "mine"
    proc = _run(SAMPLE, [f"run={run}", "max_new_tokens=4", "num_samples=1", f"out={elsewhere}/s.txt"], work)
    assert proc.returncode == 0 and (elsewhere / "s.txt").is_file() and (elsewhere / "s.json").is_file()
    proc = _run(EVAL, [f"run={run}", "batches=1", f"out={elsewhere}/e.json"], work)
    assert proc.returncode == 0 and json.loads((elsewhere / "e.json").read_text())["batches"] == 1

    report = [sys.executable, "-m", "bench.report", str(run)]
    printed = subprocess.run(report, cwd=str(REPO), capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0, describe(printed)
    assert f"could not write report.md, report.json, report_sweep.png in {run} (Read-only file system)" in (
        printed.stderr
    ), describe(printed)
    assert "--out DIR" in printed.stderr and "Traceback" not in printed.stderr
    proc = subprocess.run([*report, "--out", str(elsewhere)], cwd=str(REPO), capture_output=True, text=True)
    assert proc.returncode == 0 and (elsewhere / "report.md").is_file(), describe(proc)
    tables = [line for line in (elsewhere / "report.md").read_text().splitlines() if line.startswith("|")]
    assert tables and all(line in printed.stdout for line in tables)  # the same report, printed
    assert _tree(run) == before and list(work.iterdir()) == []
