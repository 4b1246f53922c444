"""A directory source edited after its data were prepared: train.py refuses it as a changed source, and
the way forward that the message gives works, for a new run (a data.dir of its own, named) and for a
resume (the files put back as they were, as ``cp -p`` restores them)."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from tests.helpers_train import run_inprocess

pytestmark = pytest.mark.slow  # three tiny GPT-2 BPE runs in this process, ~15 s on 2 shared cores


def _args(src, data_dir, out, **extra) -> list[str]:
    base = {
        "experiment": "cpu_tiny",
        "data": "shakespeare",
        "data.source": src,
        "data.dir": data_dir,
        "data.workers": 1,
        "model": "tiny",
        "seq_len": 16,
        "max_steps": 2,
        "batch.tokens_per_step": 64,
        "batch.micro_tokens": 64,
        "eval.interval": 2,
        "eval.batches": 1,
        "checkpoint.interval": 2,
        "wandb.mode": "disabled",
        "out_dir": out,
        **extra,
    }
    return [f"{k}={v}" for k, v in base.items()]


def test_changed_directory_source_message_gives_commands_that_work(tmp_path, gpt2_bpe, seed, capsys):
    rng = np.random.default_rng(seed)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "ran", "far"]
    src = tmp_path / "texts"
    src.mkdir()
    for i in range(20):
        (src / f"{i:02d}.txt").write_text(" ".join(rng.choice(words, size=60)))
    data, run = tmp_path / "data", tmp_path / "run"
    assert run_inprocess(_args(src, data, run), run).exit_code == 0
    edited = src / "03.txt"
    original, st = edited.read_bytes(), edited.stat()
    edited.write_text("an edit " * 30)
    capsys.readouterr()

    # a new run: refused (exit 2), with a data.dir of its own to pass, which then works
    assert run_inprocess(_args(src, data, tmp_path / "run2"), tmp_path / "run2").exit_code == 2
    err = capsys.readouterr().err
    assert "source changed" in err and "03.txt" in err, err
    other = re.search(r"set data\.dir=(\S+)", err)
    assert other and other.group(1) == str(tmp_path / "texts_gpt2"), err
    run2 = tmp_path / "run2"
    assert run_inprocess(_args(src, other.group(1), run2), run2).exit_code == 0

    # a resume: refused, saying to put the files back with their times (cp -p), which then resumes
    resume = _args(src, data, run, max_steps=4, resume="true")
    assert run_inprocess(resume, run).exit_code == 2
    err = capsys.readouterr().err
    assert "resume=true refused" in err and "cp -p" in err and "data.dir=" in err, err
    edited.write_bytes(original)
    os.utime(edited, ns=(st.st_atime_ns, st.st_mtime_ns))  # what `cp -p` from a copy restores
    assert run_inprocess(resume, run).exit_code == 0, capsys.readouterr().err


def test_resume_after_an_edited_text_file_says_to_put_it_back_not_to_delete(tmp_path, gpt2_bpe, seed, capsys):
    """A single text file (identified by its SHA-256) edited before a resume: the refusal is the resume's
    (put the file back, or a new run), never "delete data.dir", which would destroy the run's own data."""
    rng = np.random.default_rng(seed)
    src = tmp_path / "corpus.txt"
    original = " ".join(rng.choice(["the", "cat", "sat", "on", "a", "mat"], size=2000))
    src.write_text(original)
    data, run = tmp_path / "data", tmp_path / "run"
    assert run_inprocess(_args(src, data, run), run).exit_code == 0
    src.write_text("an edit " + original)
    capsys.readouterr()
    resume = _args(src, data, run, max_steps=4, resume="true")
    assert run_inprocess(resume, run).exit_code == 2
    err = capsys.readouterr().err
    assert "resume=true refused" in err and "back as it was" in err and "delete" not in err, err
    assert "the same bytes" in err and "cp -p" not in err, err  # its SHA-256, not its time, is compared
    src.write_text(original)  # a new modification time: still the same corpus
    assert run_inprocess(resume, run).exit_code == 0, capsys.readouterr().err
