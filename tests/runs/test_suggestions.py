"""Config errors whose first message names the real cause and whose suggestion runs as typed: each test
takes the suggested overrides out of the error message and runs the config check (or the run) with them.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.helpers_train import REPO, compose_cfg, describe, train_env
from trainer.checks import ConfigError, check_data_source, resolve_plan


def _config_check(overrides: list[str]) -> None:
    """What train.py checks before it builds anything (raises ConfigError). A later ``key=value`` wins,
    as when a suggestion is added to the end of the command line."""
    cfg = compose_cfg(list({o.split("=", 1)[0]: o for o in overrides}.values()))
    resolve_plan(cfg, world_size=1, cuda_available=False)
    check_data_source(cfg)


def _first_error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as e:  # duplicates kept: Hydra's own rule decides, as on a command line
        cfg = compose_cfg(overrides)
        resolve_plan(cfg, world_size=1, cuda_available=False)
        check_data_source(cfg)
    return str(e.value)


def _suggestion(message: str) -> list[str]:
    """The first suggestion of ``message`` ("...; use k=v [k2=v2 ...][ or ..|, or ..|(...)]") as
    overrides."""
    tail = message.split("; use ", 1)[1]
    first = re.split(r",| or | \(", tail, maxsplit=1)[0]
    return first.split()


@pytest.fixture
def data_args(char_data, shakespeare_path) -> list[str]:
    return [
        "data=shakespeare_char",
        f"data.source={shakespeare_path}",
        f"data.dir={char_data}",
        "model=tiny",
        "trainer=cpu",
        "wandb.mode=disabled",
        "seq_len=64",
        "batch.tokens_per_step=1024",
        "batch.micro_batch_size=8",
    ]


@pytest.mark.parametrize("others", [[], ["seq_len=4096"], ["batch.tokens_per_step=1000"], ["seq_len=127"]])
@pytest.mark.parametrize("value", ["0", "1", "0.0"])
def test_val_fraction_outside_the_open_interval_is_named_first(data_args, others, value):
    """data.val_fraction=0 (or 1) is the error, whatever else is wrong and in whatever order the keys are
    given; the example it gives passes the checks."""
    args = [a for a in others if not a.startswith("data.val_fraction")]
    for order in (
        [*data_args, f"data.val_fraction={value}", *args],
        [*args, *data_args, f"data.val_fraction={value}"],
    ):
        err = _first_error(order)
        assert err.startswith(f"data.val_fraction={float(value)} must be in (0, 1)"), err
        fix = err.rsplit("e.g. ", 1)[1]
        assert fix == "data.val_fraction=0.1"
        _config_check([*data_args, fix])  # passes as typed


def test_val_fraction_field_doc_and_check_agree():
    from trainer.config import DataConfig

    f = DataConfig.__dataclass_fields__["val_fraction"]
    assert "(0, 1)" in f.metadata["doc"] and f.metadata["check"] == "(0,1)"


def test_tiny_val_fraction_is_named_not_seq_len(data_args, shakespeare_path, tmp_path):
    """A validation share too small for one window: the error names data.val_fraction first, and its
    suggestion, with a data.dir of its own (the prepared one holds the tiny split now), passes as typed."""
    from data.prepare import ensure_prepared

    ensure_prepared(str(shakespeare_path), str(tmp_path / "data"), "char", 0.00001)
    args = [*data_args, "data.val_fraction=0.00001", f"data.dir={tmp_path / 'data'}", "seq_len=64"]
    err = _first_error(args)
    assert err.startswith("data.val_fraction=1e-05 is too small for seq_len=64"), err
    fix = _suggestion(err)
    assert fix[0] == "data.val_fraction=0.1" and fix[1].startswith(f"data.dir={tmp_path}/"), err
    _config_check([*args, *fix])


@pytest.mark.parametrize(("seq_len", "tokens"), [(127, 2048), (131, 2048), (113, 1000), (251, 65536)])
def test_prime_seq_len_gets_one_suggestion_that_runs(data_args, seq_len, tokens):
    """A prime seq_len with the token budget (batch.micro_tokens): the first suggestion fixes every batch
    check at once (it used to fix micro_tokens only, then tokens_per_step needed a second round)."""
    args = [
        *data_args,
        f"seq_len={seq_len}",
        "batch.micro_batch_size=null",
        "batch.micro_tokens=2048",
        f"batch.tokens_per_step={tokens}",
    ]
    err = _first_error(args)
    assert f"batch.micro_tokens=2048 must be a multiple of seq_len={seq_len}" in err, err
    fix = _suggestion(err)
    assert fix and all("=" in f for f in fix), err
    _config_check([*args, *fix])


@pytest.mark.slow
def test_empty_out_dir_is_refused_naming_it(tiny, tmp_path):
    """out_dir= (an unset shell variable in a job script) would write the run into the current
    directory: exit 2 naming out_dir and a folder that works; nothing is written there."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    base = [
        a
        for a in tiny(tmp_path / "unused", max_steps=1, eval__at_start=False)
        if not a.startswith("out_dir=")
    ]
    for empty in ("out_dir=", "out_dir=''", "hydra.run.dir="):
        proc = subprocess.run(
            [sys.executable, str(REPO / "train.py"), *base, empty],
            cwd=str(cwd),
            env=train_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 2, describe(proc)
        key = empty.split("=")[0]
        assert f"config error: {key}=" in proc.stderr and "is empty" in proc.stderr, describe(proc)
        assert "Traceback" not in proc.stderr
        assert list(cwd.iterdir()) == [], list(cwd.iterdir())
    first = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *base, "out_dir="],
        cwd=str(cwd),
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    fix = re.search(r"e\.g\. (out_dir=\S+),", first.stderr).group(1)
    ok = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *base, fix],
        cwd=str(cwd),
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ok.returncode == 0, describe(ok)
    assert (cwd / fix.split("=", 1)[1] / "summary.json").is_file()


@pytest.mark.slow
def test_out_dir_that_would_mix_a_run_with_other_files_is_refused(tiny, tmp_path):
    """out_dir=. (the repository or a corpus folder) or a folder inside a run: exit 2 naming out_dir and a
    folder that works, and nothing written into it; the folder named in the hint runs as typed."""
    cwd = tmp_path / "cwd"
    (cwd / "corpus").mkdir(parents=True)
    (cwd / "corpus" / "a.txt").write_text("a document\n")
    base = [
        a
        for a in tiny(tmp_path / "unused", max_steps=1, eval__at_start=False)
        if not a.startswith("out_dir=")
    ]

    def train(*extra):
        cmd = [sys.executable, str(REPO / "train.py"), *base, *extra]
        return subprocess.run(cmd, cwd=str(cwd), env=train_env(), capture_output=True, text=True, timeout=300)

    before = sorted(p.name for p in cwd.rglob("*"))
    for out_dir in (".", "corpus"):
        proc = train(f"out_dir={out_dir}")
        assert proc.returncode == 2, describe(proc)
        assert f"config error: out_dir={out_dir} already holds other files or runs" in proc.stderr, describe(
            proc
        )
        assert "Traceback" not in proc.stderr and sorted(p.name for p in cwd.rglob("*")) == before
    fix = re.search(r"e\.g\. (out_dir=\S+)", proc.stderr).group(1)
    assert (ok := train(fix)).returncode == 0, describe(ok)
    run = cwd / fix.split("=", 1)[1]
    proc = train(f"out_dir={run / 'ckpt'}")
    assert proc.returncode == 2 and f"lies inside the run folder {run}" in proc.stderr, describe(proc)
    assert not (run / "ckpt" / ".hydra").exists()


@pytest.mark.parametrize("separator", ["'@'", "'£'", "'\\n@'"])
def test_doc_separator_outside_the_vocabulary_names_the_key(data_args, separator):
    """A char-level separator the corpus cannot encode: the error names data.doc_separator (not only
    the vocabulary), before any data is prepared, and the separator it suggests passes as typed."""
    err = _first_error([*data_args, f"data.doc_separator={separator}"])
    assert err.startswith(f"data.doc_separator={separator}"), err
    assert "65 characters" in err, err
    fix = err.split("use e.g. ", 1)[1].split(", or ", 1)[0].split()
    assert fix[0] == "data.doc_separator='\\n\\n'", err
    _config_check([*data_args, *fix])


def test_user_facing_text_has_no_issue_numbers():
    """Messages, headings and printed help name what they are about, not the tracker's issue numbers:
    README headings, ``python -m bench``'s listing, bench.variants' --help text (its module docstring),
    and every string literal outside docstrings in the code."""
    import ast

    pattern = re.compile(r"\bissue \d+\b")
    headings = [line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("#")]
    assert [h for h in headings if pattern.search(h)] == []
    listing = subprocess.run([sys.executable, "-m", "bench"], cwd=str(REPO), capture_output=True, text=True)
    assert listing.returncode == 0 and not pattern.search(listing.stdout), listing.stdout
    assert not pattern.search(ast.get_docstring(ast.parse((REPO / "bench" / "variants.py").read_text())))
    found = []
    for path in sorted(REPO.glob("**/*.py")):
        if ".venv" in path.parts or "tests" in path.parts:
            continue
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                if pattern.search(node.value):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value[:80]!r}")
    assert found == [], found
