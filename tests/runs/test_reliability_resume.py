"""Resume and data-preparation faults a new user hit (real train.py / eval.py / sample.py processes, real
run and data directories).

1. resume=true onto other data (another char corpus of the same vocab size, or the same characters in
   another order) is refused, exit 2, naming the data keys and what differs, with the run directory byte
   for byte as it was; the tokenizers are compared by what defines the ids (the char list, the BPE's
   encoding name and vocabulary).
2. Launches that start together into a data directory not prepared yet: one prepares (a lock on the
   directory), the others wait and then use it.
3. A finished run whose final checkpoint is corrupt or deleted: eval.py / sample.py say the final
   weights are gone and how to rebuild them; resume=true rebuilds them by replaying the lost steps,
   bitwise equal to the lost checkpoint (CPU, float32).
4. metrics.jsonl deleted, then resume: a warning, and the W&B run forked at the checkpoint; a non-finite
   loss before any checkpoint prints a command that works; resume=true with a max_steps below the
   steps done is a config error naming max_steps; a refused or finished resume adds nothing to train.log.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers_train import (
    REPO,
    checkpoint_tensors,
    describe,
    read_jsonl,
    run_train,
    summary,
    train_env,
    train_losses,
)
from trainer import checkpoint as ckpt


def _tree(run_dir: Path) -> dict[str, bytes]:
    """Every file of a directory, Hydra's and the log included."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def _other_alphabet(src: Path, dest: Path) -> Path:
    """``src`` with each of its characters replaced by another one (Cyrillic code points): a corpus with
    the same vocab size whose ids mean other characters."""
    text = src.read_text(encoding="utf-8")
    mapping = {c: chr(0x400 + i) for i, c in enumerate(sorted(set(text)))}
    dest.write_text("".join(mapping[c] for c in text), encoding="utf-8")
    return dest


# ------------------------------------------------------------------------------------------ 1. tokenizer


def test_tokenizer_difference_compares_what_defines_the_ids(tmp_path, gpt2_bpe):
    from data.prepare import prepare

    src = tmp_path / "t.txt"
    src.write_text("To be, or not to be: that is the question.\n" * 20, encoding="utf-8")
    meta = prepare(str(src), tmp_path / "bpe", "gpt2", 0.2)
    assert meta["encoding"] == "gpt2" and len(meta["vocab_sha256"]) == 64
    record = ckpt.tokenizer_record(meta)
    assert ckpt.tokenizer_difference(record, meta) is None
    other = {**record, "vocab_sha256": "0" * 64}
    assert "BPE vocabulary (sha256)" in ckpt.tokenizer_difference(other, meta)
    assert "BPE encoding 'r50k'" in ckpt.tokenizer_difference({**record, "encoding": "r50k"}, meta)
    old = {k: v for k, v in record.items() if k not in ("encoding", "vocab_sha256")}  # an older checkpoint
    assert ckpt.tokenizer_difference(old, meta) is None

    chars = prepare(str(src), tmp_path / "char", "char", 0.2)
    rec = ckpt.tokenizer_record(chars)
    assert ckpt.tokenizer_difference(rec, chars) is None
    swapped = {**rec, "itos": rec["itos"][1:] + rec["itos"][:1]}
    assert "another order" in ckpt.tokenizer_difference(swapped, chars)
    assert "tokenizer 'char' -> 'gpt2'" in ckpt.tokenizer_difference(rec, meta)


@pytest.mark.slow
def test_resume_onto_another_char_vocabulary_is_refused(tiny, tmp_path, shakespeare_path):
    out = tmp_path / "run"
    proc = run_train(tiny(out, max_steps=4, checkpoint__interval=4, eval__interval=4))
    assert proc.returncode == 0, describe(proc)
    other = _other_alphabet(shakespeare_path, tmp_path / "other.txt")
    before = _tree(out)
    resumed = run_train(
        tiny(out, resume=True, max_steps=8, data__source=other, data__dir=tmp_path / "other_data")
    )
    assert resumed.returncode == 2, describe(resumed)
    err = resumed.stderr
    assert err.startswith("config error: resume=true refused"), describe(resumed)
    assert "the run's data: data.dir (" in err and f"-> '{other}')" in err, err
    assert "Traceback" not in err
    assert _tree(out) == before  # checkpoints, metrics, summary, .hydra/, train.log, the lock's text
    # the same characters in another order (another corpus, same ids): refused too, naming the key
    lines = shakespeare_path.read_text(encoding="utf-8").splitlines(keepends=True)
    (reversed_text := tmp_path / "reversed.txt").write_text("".join(lines[::-1]), encoding="utf-8")
    resumed = run_train(tiny(out, resume=True, max_steps=8, data__source=reversed_text))
    assert resumed.returncode == 2 and "data.source (" in resumed.stderr, describe(resumed)
    assert "data.dir" not in resumed.stderr.split("the run's data:")[1].split(". A resume")[0]
    assert _tree(out) == before

    # 4. the same run: a max_steps below the steps done is refused naming max_steps, nothing changed
    short = run_train(tiny(out, resume=True, max_steps=2))
    assert short.returncode == 2, describe(short)
    assert "max_steps=2 is below the 4 steps" in short.stderr and "of max_steps" not in short.stdout
    assert _tree(out) == before
    # and a resume of the finished run says so and leaves train.log and Hydra's files as they were
    again = run_train(tiny(out, resume=True, max_steps=4, checkpoint__interval=4, eval__interval=4))
    assert again.returncode == 0 and "is already finished" in again.stdout, describe(again)
    assert _tree(out) == before


@pytest.mark.slow
def test_resume_onto_a_changed_corpus_is_refused_even_when_its_data_dir_is_prepared_again(
    tiny, tmp_path, shakespeare_path
):
    """The corpus edited after the run (same length, same characters) and its data dir deleted, as the
    prepare step's own message suggests: the resume prepares the new text, then refuses it (exit 2, the run
    untouched); with the corpus restored it resumes."""
    corpus, data = tmp_path / "corpus.txt", tmp_path / "data"
    shutil.copy(shakespeare_path, corpus)
    args = dict(data__source=corpus, data__dir=data, max_steps=4, checkpoint__interval=4, eval__interval=4)
    out = tmp_path / "run"
    proc = run_train(tiny(out, **args))
    assert proc.returncode == 0, describe(proc)
    before = _tree(out)
    original = corpus.read_text(encoding="utf-8")
    corpus.write_text(original.replace("ROMEO", "OMERO"), encoding="utf-8")
    shutil.rmtree(data)
    resumed = run_train(tiny(out, **{**args, "max_steps": 6}, resume=True))
    assert resumed.returncode == 2, describe(resumed)
    assert "are not the data the checkpoint" in resumed.stderr and "source_sha256" in resumed.stderr
    assert "Traceback" not in resumed.stderr
    assert _tree(out) == before
    corpus.write_text(original, encoding="utf-8")
    shutil.rmtree(data)
    resumed = run_train(tiny(out, **{**args, "max_steps": 6}, resume=True))
    assert resumed.returncode == 0 and max(train_losses(out)) == 6, describe(resumed)
    # a resume keeps the launch's Hydra record (its own composition is the defaults under its overrides)
    assert (out / ".hydra" / "config.yaml").read_bytes() == before[".hydra/config.yaml"]


# ------------------------------------------------------------------------------------------ 2. data race

_PREPARE = """
import logging, sys, time
from pathlib import Path
from data.prepare import ensure_prepared
from data.meta import load_meta
go, ready, out, src = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
logging.basicConfig(level=logging.INFO, format="%(message)s")
ready.touch()
while not go.exists():
    time.sleep(0.002)
ensure_prepared(src, out, "char", 0.1)
for _ in range(50):  # once it returned, the directory stays prepared (nobody prepares it again)
    load_meta(out)
    time.sleep(0.005)
"""


@pytest.mark.slow  # over 5 s on 2 cores
def test_concurrent_prepares_prepare_once(tmp_path, shakespeare_path):
    """Four processes released at the same moment on a data directory that does not exist yet: one
    prepares it, the others wait for the lock and find it up to date; every one then reads it."""
    go, out, n = tmp_path / "go", tmp_path / "data" / "char", 4
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _PREPARE,
                str(go),
                str(tmp_path / f"ready{i}"),
                str(out),
                str(shakespeare_path),
            ],
            cwd=str(REPO),
            env=train_env(),
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(n)
    ]
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready{i}").exists() for i in range(n)) and time.monotonic() < deadline:
            time.sleep(0.01)
        go.touch()
        results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = "\n".join(e for _, e in results)
    assert [code for code, _ in results] == [0] * n, logs
    assert logs.count("preparing data in") == 1, logs
    assert logs.count("is up to date") == n - 1, logs
    assert sorted(p.name for p in out.iterdir()) == [
        "meta.json",
        "train_000000.bin",
        "train_000000.idx",
        "val_000000.bin",
        "val_000000.idx",
    ]  # one prepare's shards, no stage left behind


@pytest.mark.slow
def test_concurrent_train_launches_share_one_prepare(tmp_path, shakespeare_path):
    """Three ``train.py`` launches started together on a fresh data.dir: one prepares it, all train (exit
    0, status ok). The corpus is Tiny Shakespeare 8 times over, so that its preparation (seconds) outlasts
    the spread of the three start-ups and the launches meet at the data directory."""
    from tests.helpers_train import tiny_overrides, train_command

    data, corpus = tmp_path / "fresh_data", tmp_path / "corpus.txt"
    corpus.write_text(shakespeare_path.read_text(encoding="utf-8") * 8, encoding="utf-8")
    procs = []
    for seed in (1, 2, 3):
        args = tiny_overrides(data, corpus, tmp_path / f"run{seed}", seed=seed, max_steps=2)
        cmd, env = train_command(args)
        procs.append(
            subprocess.Popen(
                cmd, cwd=str(REPO), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outs = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=300)
            outs.append((p.returncode, o + e))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    text = "\n".join(o for _, o in outs)
    assert [code for code, _ in outs] == [0, 0, 0], text
    assert text.count("preparing data in") == 1, text
    for seed in (1, 2, 3):
        assert summary(tmp_path / f"run{seed}")["status"] == "ok"


# ------------------------------------------------------------------------------------------ 3. final ckpt


@pytest.mark.slow
@pytest.mark.parametrize("how", ["deleted", "corrupt", "shard"])
def test_lost_final_checkpoint_is_said_and_rebuilt(tiny, tmp_path, how):
    out = tmp_path / "run"
    base = dict(max_steps=8, checkpoint__interval=4, eval__interval=4)
    proc = run_train(tiny(out, **base))
    assert proc.returncode == 0, describe(proc)
    final = ckpt.ckpt_path(out, 8)
    lost = checkpoint_tensors(final, tmp_path)
    losses = train_losses(out)
    if how == "deleted":
        shutil.rmtree(final)
    elif how == "corrupt":
        record = final / ckpt.RECORD
        record.write_bytes(record.read_bytes()[:1000])  # truncated
    else:  # a truncated DCP shard: only the record's list of file sizes and checksums tells
        shard = final / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[:1000])

    tool = "sample.py" if how == "corrupt" else "eval.py"
    extra = ["batches=1", "batch_size=2"] if tool == "eval.py" else ["max_new_tokens=4", "num_samples=1"]
    read = subprocess.run(
        [sys.executable, str(REPO / tool), f"run={out}", "device=cpu", *extra],
        cwd=str(REPO),
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert read.returncode == 0, describe(read)
    assert "final weights (step 8) are gone" in read.stdout and "step 4" in read.stdout, describe(read)
    assert f"python train.py resume=true out_dir={out}" in read.stdout, describe(read)

    resumed = run_train(tiny(out, resume=True, **base))
    assert resumed.returncode == 0, describe(resumed)
    assert "rebuilding it by replaying steps 5-8" in resumed.stdout, describe(resumed)
    assert "already finished" not in resumed.stdout
    a, b = lost, checkpoint_tensors(final, tmp_path)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    assert train_losses(out) == losses  # the live curve: the same losses, each step once
    assert (out / "metrics.abandoned.5-8.jsonl").is_file()
    s = summary(out)
    assert s["status"] == "ok" and s["steps"] == 8 and s["replay"]["replayed_steps"] == [5, 8], s


# ------------------------------------------------------------------------------------------ 4. smaller


@pytest.mark.slow
def test_resume_without_metrics_warns_and_forks_wandb(tiny, tmp_path):
    from tests.wandb_offline import read_offline_run

    out = tmp_path / "run"
    base = dict(max_steps=8, checkpoint__interval=4, eval__interval=4, wandb__mode="offline")
    proc = run_train(tiny(out, fault__raise_oom_at_step=7, **base))  # ends after step 6; checkpoint 4
    assert proc.returncode == 0 and summary(out)["status"] == "oom", describe(proc)
    parent = (out / "wandb_run_id.txt").read_text().strip()
    (out / "metrics.jsonl").unlink()
    resumed = run_train(tiny(out, resume=True, **base))
    assert resumed.returncode == 0, describe(resumed)
    assert "metrics.jsonl is missing or empty" in resumed.stdout, describe(resumed)
    assert "forked from the old one at step 4" in resumed.stdout
    assert [r["step"] for r in read_jsonl(out) if "train/loss" in r] == [5, 6, 7, 8]
    s = summary(out)
    assert s["metrics_lost"]["checkpoint_step"] == 4 and s["wandb_run_id"] != parent, s
    wb = read_offline_run(out)
    assert wb["run_id"] == s["wandb_run_id"] and wb["parents"] == [
        {"run_id": parent, "step": 4, "metric": "_step"}
    ]


@pytest.mark.slow
def test_resume_after_a_cut_metrics_file_names_the_missing_steps(tiny, tmp_path):
    out = tmp_path / "run"
    base = dict(max_steps=8, checkpoint__interval=4)
    proc = run_train(tiny(out, fault__raise_oom_at_step=7, **base))  # ends after step 6; checkpoint 4
    assert proc.returncode == 0 and summary(out)["status"] == "oom", describe(proc)
    kept = [r for r in read_jsonl(out) if r.get("step", 0) <= 2]  # the file cut after step 2
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    resumed = run_train(tiny(out, resume=True, **base))
    assert resumed.returncode == 0, describe(resumed)
    assert "metrics.jsonl ends at step 2, but the checkpoint is of step 4" in resumed.stdout
    assert "steps 3-4 is not in it" in resumed.stdout, describe(resumed)
    assert [r["step"] for r in read_jsonl(out) if "train/loss" in r] == [1, 2, 5, 6, 7, 8]
    # logged every 4 steps up to the step-6 checkpoint, resumed logging every step: nothing was cut
    out = tmp_path / "every4"
    base = dict(max_steps=8, checkpoint__interval=6, log_interval=4)
    proc = run_train(tiny(out, fault__raise_oom_at_step=7, **base))
    assert proc.returncode == 0 and summary(out)["status"] == "oom", describe(proc)
    resumed = run_train(tiny(out, resume=True, **(base | {"log_interval": 1})))
    assert resumed.returncode == 0 and "metrics.jsonl ends at" not in resumed.stdout, describe(resumed)


@pytest.mark.slow
def test_nonfinite_before_any_checkpoint_prints_a_command_that_runs(tiny, tmp_path):
    out = tmp_path / "run"
    proc = run_train(tiny(out, max_steps=4, checkpoint__interval=8, fault__nan_at_step=2))
    assert proc.returncode == 1 and summary(out)["status"] == "nonfinite", describe(proc)
    hint = proc.stderr.split("start the run again")[1].split("`")[1]
    assert "resume=true" not in hint and f"out_dir={out}" not in hint, proc.stderr
    assert hint.startswith("python train.py ")
    args = hint.split()[2:] + [f"out_dir={tmp_path / 'again'}"]  # the default out_dir would be runs/ here
    again = run_train(args)
    assert again.returncode == 0 and summary(tmp_path / "again")["status"] == "ok", describe(again)
