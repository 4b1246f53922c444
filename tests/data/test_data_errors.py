"""Errors of the data step as a user meets them: a corrupt token file is prepared again where the data's
arguments are known (train.py) and named with a command that runs as typed where they are not (a reader:
eval.py); a first error names every key a source of documents needs; a missing text field names the one
the records have, as a train.py key or as a ``python -m data.prepare`` flag."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest

from data import prepare as prep
from data.loader import BinDataset, load_meta
from data.prepare import ensure_prepared, prepare, prepare_command, stale_reason
from tests.helpers_train import run_inprocess, tiny_overrides


def _corrupt(path, seed: int) -> None:
    """Random bytes of the file's own size (ids up to 65535: beyond any char vocabulary)."""
    size = path.stat().st_size
    path.write_bytes(np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes())


def _run_command(cmd: str, capsys) -> str:
    """``cmd`` (a ``python -m data.prepare`` line, as a shell splits it) run in this process: its stdout."""
    argv = shlex.split(cmd)
    assert argv[:3] == ["python", "-m", "data.prepare"], cmd
    capsys.readouterr()
    assert prep.main(argv[3:]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def test_corrupt_shard_is_prepared_again_by_train(char_data, shakespeare_path, tmp_path, seed, capsys):
    """A train shard of the right size holding random bytes: train.py prepares the data again (as it does a
    truncated one) instead of a traceback, and trains on the same tokens as before."""
    data = tmp_path / "data"
    shutil.copytree(char_data, data)
    shard = data / "train_000000.bin"
    before = shard.read_bytes()
    _corrupt(shard, seed)
    reason = stale_reason(str(shakespeare_path), data, "char")
    assert reason.startswith(f"{shard} holds token id ") and "vocab_size=65" in reason, reason
    assert "data.prepare" not in reason  # prepared automatically: no command to type
    out = tmp_path / "run"
    outcome = run_inprocess(tiny_overrides(data, shakespeare_path, out, max_steps=1, eval__batches=1), out)
    err = capsys.readouterr().err
    assert (outcome.status, outcome.exit_code) == ("ok", 0), err
    assert shard.read_bytes() == before  # the same source, arguments and tokens


def test_reader_error_command_runs_as_typed(tmp_path, seed, capsys):
    """A corrupt shard met by a reader (eval.py's BinDataset): the error's command, with the directory's
    own source, tokenizer, separator and split filled in, prepares exactly the data meta.json recorded."""
    src = tmp_path / "my corpus.txt"  # a space: the command quotes it
    src.write_text("".join(f"speech {i}: to be or not to be\n\n" for i in range(60)))
    out = tmp_path / "d"
    meta = prepare(str(src), out, "char", 0.2, doc_separator="\\n\\n", workers=1, progress=False)
    _corrupt(out / "val_000000.bin", seed)
    with pytest.raises(ValueError, match=r"val_000000\.bin holds token id \d+, but .*vocab_size=") as e:
        BinDataset(out, "val", 4)
    cmd = str(e.value).split("prepare it with `", 1)[1].rstrip("`")
    assert "PATH" not in cmd and "gpt2|char" not in cmd and "--tokenizer char" in cmd, cmd
    _run_command(cmd, capsys)
    assert load_meta(out) == meta  # the same data: source, separator, split and tokens
    BinDataset(out, "val", 4)
    # no meta.json (never prepared): the directory is named, and the corpus (unknown here) as CORPUS
    (out / "meta.json").unlink()
    with pytest.raises(FileNotFoundError) as e:
        BinDataset(out, "val", 4)
    assert f"`python -m data.prepare --source CORPUS --out-dir {out} --tokenizer gpt2`" in str(e.value)
    assert prepare_command(out, source=str(src), tokenizer="char") == (
        f"python -m data.prepare --source {shlex.quote(str(src))} --out-dir {out} --tokenizer char"
    )


def test_automatic_reprepare_gives_no_command(tmp_path):
    """A truncated shard or an unreadable meta.json under ensure_prepared: prepared again, and the reason
    logged for it names no command (nothing is left for the user to do)."""
    src = tmp_path / "s.txt"
    src.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "o"
    meta = prepare(str(src), out, "char", workers=1, progress=False)
    with open(out / "train_000000.bin", "r+b") as f:
        f.truncate(10)
    assert "python -m" not in stale_reason(str(src), out, "char")
    (out / "meta.json").write_text("{not json")
    assert "python -m" not in stale_reason(str(src), out, "char")
    assert ensure_prepared(str(src), out, "char", workers=1, progress=False) == meta


def _docs_dir(tmp_path, n: int, words: int = 400):
    d = tmp_path / "txtdir"
    d.mkdir()
    for i in range(n):
        (d / f"p{i}.txt").write_text(" ".join(f"word{(i * 7 + k) % 50}" for k in range(words)))
    return d


def _fix(err: str) -> dict:
    """The key=value overrides after the error's 'use '."""
    return dict(kv.split("=", 1) for kv in err.split("use ", 1)[1].split())


def test_documents_with_char_get_one_fix_that_runs(char_data, shakespeare_path, tmp_path, gpt2_bpe, capsys):
    """4 text files with the char tokenizer into a data.dir that holds char data: the first error names the
    real cause and every key the run needs (the tokenizer, a gpt2-named folder of its own, a val split of
    whole documents), and those keys train as typed."""
    docs = _docs_dir(tmp_path, 4)
    out = tmp_path / "run"
    args = {"data__source": docs, "max_steps": 1, "eval__batches": 1}
    outcome = run_inprocess(tiny_overrides(char_data, shakespeare_path, out, **args), out)
    err = capsys.readouterr().err
    assert (outcome.status, outcome.exit_code) == ("error", 2) and "Traceback" not in err, err
    assert "data.tokenizer=char reads a single text file" in err, err
    fix = _fix(err)
    assert fix == {
        "data.tokenizer": "gpt2",
        "data.dir": str(char_data.parent / "txtdir_gpt2"),
        "data.val_docs": "1",
    }, err
    args.update({k.replace(".", "__"): v for k, v in fix.items()})
    outcome = run_inprocess(tiny_overrides(char_data, shakespeare_path, out, **args), out)
    assert (outcome.status, outcome.exit_code) == ("ok", 0), capsys.readouterr().err
    shutil.rmtree(fix["data.dir"])  # beside the session's char data


def test_document_fixes(tmp_path):
    """What a source of documents needs besides the given arguments: nothing for enough documents, a count
    of val documents for too few, the records' text field; never more than it reads to know it."""
    docs = _docs_dir(tmp_path, 4, words=5)
    assert prep.document_fixes(str(docs)) == ["val_docs=1"]
    assert prep.document_fixes(str(docs), val_fraction=0.1) == ["val_docs=1", "val_fraction=null"]
    assert prep.document_fixes(str(docs), val_fraction=0.25) == []  # the 2nd of 4 is held out
    assert prep.document_fixes(str(docs), val_docs=4) == ["val_docs=3"]  # none left for train
    assert prep.document_fixes(str(docs), val_docs=2) == []
    jl = tmp_path / "r.jsonl"
    jl.write_text("".join(json.dumps({"id": i, "body": f"text {i}"}) + "\n" for i in range(30)))
    assert prep.document_fixes(str(jl)) == ["text_field=body"]
    jl.write_text("".join(json.dumps({"id": i, "body": f"text {i}"}) + "\n" for i in range(3)))
    assert prep.document_fixes(str(jl)) == ["text_field=body", "val_docs=1"]
    one = tmp_path / "one"
    one.mkdir()
    (one / "a.txt").write_text("a single document")
    assert prep.document_fixes(str(one)) == []  # no split of one document works: the prepare says so
    assert prep.document_fixes(str(tmp_path / "s.txt")) == []  # not a source of documents


def test_a_record_missing_the_field_its_predecessors_have_suggests_no_other_field(tmp_path):
    """Line 5 of a JSON Lines file lacks "text", which lines 1-4 have: that record is broken, and naming its
    other field (which lines 1-4 lack) as text_field would send the user to a second error."""
    jl = tmp_path / "r.jsonl"
    rows = [{"text": f"document {i} " * 20} for i in range(4)] + [{"other": "x " * 40}]
    jl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(
        ValueError, match=r"r\.jsonl:5 has no field 'text' \(its fields: other\), which the 4 "
    ) as e:
        prepare(str(jl), tmp_path / "o", "gpt2", workers=1, progress=False)
    assert "text_field=other" not in str(e.value)


def test_missing_text_field_names_the_records_field(tmp_path, char_data, shakespeare_path, capsys):
    """Records without the text field: the field that holds their text is named as a value, as the CLI's
    flag under python -m data.prepare and as the train.py key under train.py, and it prepares."""
    jl = tmp_path / "r.jsonl"
    jl.write_text(
        "".join(json.dumps({"id": i, "n": i, "body": f"text number {i} " * 30}) + "\n" for i in range(30))
    )
    with pytest.raises(
        ValueError, match=r"r\.jsonl:1 has no field 'text' \(its fields: body, id, n\); set text_field=body"
    ):
        prepare(str(jl), tmp_path / "o", "gpt2", workers=1, progress=False)

    assert prep.main(["--source", str(jl), "--out-dir", str(tmp_path / "o"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "set --text-field body " in err and "data.text_field" not in err, err
    assert prep.main(["--source", str(jl), "--out-dir", str(tmp_path / "o"), "--text-field", "body"]) == 0

    out = tmp_path / "run"
    args = tiny_overrides(tmp_path / "t", shakespeare_path, out, data__source=jl, data__tokenizer="gpt2")
    outcome = run_inprocess(args, out)
    err = capsys.readouterr().err
    assert (outcome.status, outcome.exit_code) == ("error", 2) and "Traceback" not in err, err
    assert "set data.text_field=body " in err and "--text-field" not in err, err

    jl.write_text(json.dumps({"text": 5, "body": "words"}) + "\n")
    with pytest.raises(ValueError, match=r"field 'text' holds a int, not text; set text_field=body"):
        prepare(str(jl), tmp_path / "o2", "gpt2", workers=1, progress=False)
    jl.write_text(json.dumps({"id": 5}) + "\n")
    with pytest.raises(ValueError, match=r"its fields: id\); none of its fields holds text"):
        prepare(str(jl), tmp_path / "o2", "gpt2", workers=1, progress=False)


def test_missing_parquet_column_names_a_string_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"id": [1, 2], "content": ["one text", "another"]}), path)
    with pytest.raises(
        ValueError, match=r"no column 'text' \(its columns: id, content\); set text_field=content"
    ):
        prepare(str(path), tmp_path / "o", "gpt2", workers=1, progress=False)


def test_corrupt_char_list_in_meta_names_the_command_that_prepares_it(char_data, tmp_path, capsys):
    """meta.json's character list damaged (a character twice): the tokenizer's error says the meta.json is
    corrupt and ends with the directory's own prepare command, which runs as typed and repairs it."""
    from data.loader import tokenizer_from_meta

    data = tmp_path / "data"
    shutil.copytree(char_data, data)
    meta = json.loads((data / "meta.json").read_text())
    good = tokenizer_from_meta(meta, data)
    meta["itos"][1] = meta["itos"][0]
    with pytest.raises(ValueError, match="repeated characters.*meta.json is corrupt") as e:
        tokenizer_from_meta(meta, data)
    cmd = str(e.value).split("prepare it with `", 1)[1].rstrip("`")
    (data / "meta.json").write_text(json.dumps(meta))
    shutil.rmtree(data)  # prepare refuses to overwrite a directory it cannot recognise as its own
    _run_command(cmd, capsys)
    assert tokenizer_from_meta(load_meta(data), data).itos == good.itos


def test_an_out_dir_that_cannot_be_made_and_a_cap_name_what_works(
    tmp_path, gpt2_bpe, shakespeare_path, capsys
):
    """mkdir's "[Errno 17] File exists" / "[Errno 2]" name the flag (or key) and a folder to use; a cap that
    stops the read before a split has a document names the cap, not the source, as the fix."""
    src = tmp_path / "docs"
    src.mkdir()
    for i in range(3):
        (src / f"{i}.txt").write_text("a cat sat on the mat " * 20)
    (tmp_path / "afile").write_text("keep")
    for out in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        assert prep.main(["--source", str(src), "--out-dir", str(out), "--no-progress"]) == 1
        err = capsys.readouterr().err
        assert (
            f"error: --out-dir {out} cannot be made (a file, not a folder, is on that path); pass a " in err
        )
        assert "--out-dir /" in err.split("e.g.")[1] and (tmp_path / "afile").read_text() == "keep", err
    assert prep.main(["--source", str(src), "--out-dir", str(tmp_path / "o"), "--max-tokens", "10"]) == 1
    err = capsys.readouterr().err
    assert f"{src}: the read stopped at --max-tokens 10, in document 1, and the val split got no" in err, err
    assert "drop the cap (all tokens)" in err and not (tmp_path / "o").exists(), err
    if Path("/proc/self").is_dir():  # a folder nothing can be made in
        out = tmp_path / "run"
        outcome = run_inprocess(tiny_overrides(Path("/proc/x"), shakespeare_path, out), out)
        err = capsys.readouterr().err
        assert (outcome.status, outcome.exit_code) == ("error", 2) and "Traceback" not in err, err
        assert "config error: data.dir=/proc/x cannot be written (No such file or directory: /proc/x)" in err
        assert "pass a folder you can write, e.g. data.dir=" in err, err
