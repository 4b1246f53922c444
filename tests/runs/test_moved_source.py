"""A corpus moved or deleted after its run started: the run's prepared data (data.dir) is intact, so a
resume continues on it (saying so in one line), with no data.source or with data.source at the corpus's
new path; a source whose content differs is still refused."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from tests.helpers_train import run_inprocess


def _args(src, data_dir, out, **extra) -> list[str]:
    base = {
        "model": "tiny",
        "trainer": "cpu",
        "attention": "naive",
        "data.source": src,
        "data.dir": data_dir,
        "data.workers": 1,
        "seq_len": 16,
        "max_steps": 2,
        "batch.tokens_per_step": 64,
        "batch.micro_batch_size": "null",
        "batch.micro_tokens": 64,
        "optim.warmup_steps": 1,
        "eval.interval": 2,
        "eval.batches": 1,
        "checkpoint.interval": 2,
        "wandb.mode": "disabled",
        "out_dir": out,
        **extra,
    }
    return [f"{k}={v}" for k, v in base.items()]


def _resume(data, run, max_steps, source=None) -> list[str]:
    """The resume command: data.source only when given (else the run's own, from its saved config)."""
    args = _args(source, data, run, max_steps=max_steps, resume="true")
    return [a for a in args if source is not None or not a.startswith("data.source=")]


def _trained_char_run(tmp_path, seed):
    """(corpus, data dir, run dir) of a finished 2-step char run on a random 4000-character corpus."""
    rng = np.random.default_rng(seed)
    src = tmp_path / "corpus.txt"
    src.write_text("".join(rng.choice(list("abcdefgh \n"), size=4000)))
    data, run = tmp_path / "data", tmp_path / "run"
    assert run_inprocess(_args(src, data, run, **{"data.tokenizer": "char"}), run).exit_code == 0
    return src, data, run


def test_resume_after_the_text_file_was_moved_continues_on_the_prepared_data(tmp_path, seed, capsys):
    src, data, run = _trained_char_run(tmp_path, seed)
    moved = tmp_path / "elsewhere.txt"
    shutil.move(src, moved)
    capsys.readouterr()

    # the run's own source is gone: its prepared tokens carry the resume, said in one line
    assert run_inprocess(_resume(data, run, 4), run).exit_code == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert f"data.source={src} no longer exists; continuing on the data prepared from it" in out, out

    # its new path, given as data.source: the same text (sha256), so the same data
    assert run_inprocess(_resume(data, run, 6, source=moved), run).exit_code == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "data.source holds the same data as the run's" in out, out

    # another text at a new path is still refused (exit 2), the run untouched
    other = tmp_path / "other.txt"
    other.write_text("edited " + moved.read_text())
    assert run_inprocess(_resume(data, run, 8, source=other), run).exit_code == 2
    err = capsys.readouterr().err
    assert "resume=true refused" in err and "data.source" in err, err


def test_resume_with_the_source_gone_and_its_tokens_broken_is_refused(tmp_path, seed, capsys):
    """No corpus and no complete prepared data: nothing to continue on, said with data.source named."""
    src, data, run = _trained_char_run(tmp_path, seed)
    src.unlink()
    next(data.glob("train_*.bin")).write_bytes(b"")
    capsys.readouterr()
    assert run_inprocess(_resume(data, run, 4), run).exit_code == 2
    err = capsys.readouterr().err
    assert f"data.source={src} no longer exists" in err and "put the corpus back" in err, err


def test_resume_after_the_directory_was_moved_continues(tmp_path, gpt2_bpe, seed, capsys):
    """A directory moved with its files' names, sizes and mtimes (mv, cp -rp) is the same corpus."""
    rng = np.random.default_rng(seed)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "ran", "far"]
    src = tmp_path / "texts"
    src.mkdir()
    for i in range(20):
        (src / f"{i:02d}.txt").write_text(" ".join(rng.choice(words, size=60)))
    data, run = tmp_path / "data", tmp_path / "run"
    assert run_inprocess(_args(src, data, run, data="shakespeare"), run).exit_code == 0
    moved = tmp_path / "moved_texts"
    shutil.move(src, moved)
    resume = _resume(data, run, 4, source=moved)
    assert run_inprocess(resume, run).exit_code == 0, capsys.readouterr().err
    assert "data.source holds the same data as the run's" in capsys.readouterr().out


@pytest.mark.slow  # three tiny runs in-process, ~5 s
def test_resume_onto_token_files_replaced_behind_their_meta_is_refused(tmp_path, seed, capsys):
    """The corpus is gone and data.dir's .bin files were replaced by other tokens of the same size (its
    meta.json left as it was): the checkpoint's digest of the token files tells, and the resume is refused
    (exit 2, naming the token files), the run untouched. The same files put back resume."""
    src, data, run = _trained_char_run(tmp_path, seed)
    src.unlink()
    shutil.copytree(data, tmp_path / "kept")
    for f in data.glob("*.bin"):  # the same ids in another order: same size, same vocabulary
        f.write_bytes(np.random.default_rng(seed).permutation(np.fromfile(f, dtype=np.uint16)).tobytes())
    before = sorted((p.name, p.stat().st_mtime_ns) for p in run.rglob("*"))
    capsys.readouterr()
    assert run_inprocess(_resume(data, run, 4), run).exit_code == 2
    err = capsys.readouterr().err
    assert "resume=true refused" in err and "the token files (.bin) differ" in err, err
    assert sorted((p.name, p.stat().st_mtime_ns) for p in run.rglob("*")) == before
    shutil.rmtree(data)
    shutil.copytree(tmp_path / "kept", data)
    assert run_inprocess(_resume(data, run, 4), run).exit_code == 0, capsys.readouterr().err
