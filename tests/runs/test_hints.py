"""Hints in error messages work as typed: each suggested override is a real key and, applied, gets past
the check that printed it; no message names a path of this project's development machines; one
definition of "TRITON_INTERPRET is on" serves the kernels and the trainer.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from tests.helpers_train import REPO, compose_cfg
from trainer.checks import (
    ConfigError,
    check_data_fits,
    check_data_source,
    probe_attention,
    resolve_plan,
)
from trainer.rundir import out_dir_problem

SOURCES = [
    *sorted((REPO / "trainer").glob("*.py")),
    *sorted((REPO / "data").glob("*.py")),
    *sorted((REPO / "model").glob("*.py")),
    REPO / "train.py",
    *sorted((REPO / "bench").glob("*.py")),
]
GROUPS = ("attention", "model", "data", "optim", "batch", "eval", "checkpoint", "parity", "perf", "wandb")
DOTTED_KEY = re.compile(r"(?<![\w./-])((?:" + "|".join(GROUPS) + r")\.[a-z_]+)=")
HINT = re.compile(r"(?<![\w./$-])([a-z_]+(?:\.[a-z_]+)*)=([^\s,;()]+)")


def _message_strings(path: Path) -> list[str]:
    """The text of every string literal of a source file but its docstrings (f-strings: literal parts)."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def hints(message: str, key: str, given=None) -> list[str]:
    """Values that ``message`` suggests for ``key`` (each ``key=value`` in it but the ``given`` one),
    trailing punctuation removed."""
    values = [v.rstrip(".:") for k, v in HINT.findall(message) if k == key]
    return [v for v in values if v != str(given)]


def accepted(overrides: list[str], *, cuda: bool = False):
    """The plan of ``overrides`` (raises ConfigError when the checks refuse them)."""
    return resolve_plan(compose_cfg(overrides), world_size=1, cuda_available=cuda)


def refused(overrides: list[str], *, cuda: bool = False) -> str:
    with pytest.raises(ConfigError) as e:
        accepted(overrides, cuda=cuda)
    return str(e.value)


# ------------------------------------------------------------------------------------------ static audit


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_messages_name_no_development_paths_or_fake_keys(path):
    for text in _message_strings(path):
        for bad in ("/work/", "../shared", ".gpu/", "/root/"):
            assert bad not in text, f"{path.name}: {text!r} names a path of the development machines"
        bare_tokenizer = re.search(r"(?<![\w.-])tokenizer=", text)
        assert not bare_tokenizer, f"{path.name}: {text!r}: the key is data.tokenizer"
        assert not re.search(r"\b[a-z_.]+<=\d", text), f"{path.name}: {text!r}: `key<=N` is a shell redirect"


def test_dotted_keys_in_messages_are_real_config_keys():
    cfg = compose_cfg([])
    found = {k for path in SOURCES for text in _message_strings(path) for k in DOTTED_KEY.findall(text)}
    assert {"model.n_head", "batch.micro_batch_size", "data.source", "optim.lr"} <= found  # the scan works
    missing = sorted(k for k in found if OmegaConf.select(cfg, k, default="<missing>") == "<missing>")
    assert not missing, f"messages name keys that configs/config.yaml does not have: {missing}"


# ------------------------------------------------------------------------------------------ model shape

TINY = ["model=tiny", "seq_len=64", "batch.tokens_per_step=1024", "batch.micro_batch_size=8"]


@pytest.mark.parametrize(
    ("attention", "n_embd", "n_head"), [("naive", 128, 3), ("sdpa", 20, 3), ("flash", 600, 7)]
)
def test_suggested_head_counts_and_widths_are_accepted(attention, n_embd, n_head):
    base = [*TINY, f"attention={attention}", f"model.n_embd={n_embd}"]
    msg = refused([*base, f"model.n_head={n_head}"], cuda=True)
    heads, embds = hints(msg, "model.n_head", n_head), hints(msg, "model.n_embd", n_embd)
    assert heads and embds, msg
    for h in heads:
        plan = accepted([*base, f"model.n_head={h}"], cuda=True)
        assert plan.head_dim >= 8, (msg, h)
    for e in embds:
        assert (
            accepted(
                [*TINY, f"attention={attention}", f"model.n_embd={e}", f"model.n_head={n_head}"], cuda=True
            ).head_dim
            >= 8
        ), (msg, e)


@pytest.mark.parametrize(("n_embd", "n_head"), [(128, 32), (4096, 8), (7, 1)])
def test_flash_head_dim_hint_is_accepted(n_embd, n_head):
    base = [*TINY, "attention=flash", f"model.n_embd={n_embd}"]
    msg = refused([*base, f"model.n_head={n_head}"], cuda=True)
    assert "attention=sdpa" in msg
    accepted([*base, f"model.n_head={n_head}", "attention=sdpa"], cuda=True)
    heads = hints(msg, "model.n_head", n_head)
    if heads:
        assert 8 <= accepted([*base, f"model.n_head={heads[0]}"], cuda=True).head_dim <= 256
    else:  # no head count of this width works: the hint changes the width
        (e,) = hints(msg, "model.n_embd", n_embd)
        assert accepted([*TINY, "attention=flash", f"model.n_embd={e}", f"model.n_head={n_head}"], cuda=True)


def test_block_size_hints_are_accepted():
    base = [*TINY, "seq_len=64"]
    msg = refused([*base, "model.block_size=32"])
    assert hints(msg, "seq_len", 64) == ["32"]
    accepted([*TINY, "model.block_size=32", "seq_len=32"])
    assert hints(msg, "model.block_size", 32) == ["64", "null"]
    for value in hints(msg, "model.block_size", 32):
        accepted([*base, f"model.block_size={value}"])


def test_batch_hints_are_accepted():
    msg = refused([*TINY, "batch.tokens_per_step=1000"])
    (value,) = hints(msg, "batch.tokens_per_step", 1000)
    accepted([*TINY, f"batch.tokens_per_step={value}"])
    msg = refused([*TINY, "batch.micro_batch_size=null", "batch.micro_tokens=100"])
    (value,) = hints(msg, "batch.micro_tokens", 100)
    accepted([*TINY, "batch.micro_batch_size=null", f"batch.micro_tokens={value}"])
    # trainer=cpu (2048 tokens per step, micro-batches of 8) at the default seq_len=1024: 8 x 1024
    # overshoots 2048 tokens per step
    # (a batch.micro_tokens budget is capped at tokens_per_step, so only micro_batch_size can overshoot)
    msg = refused(["trainer=cpu"])
    assert hints(msg, "batch.micro_batch_size", 8192) == ["2"], msg
    accepted(["trainer=cpu", "batch.micro_batch_size=2"])
    (value,) = hints(msg, "batch.tokens_per_step", 2048)
    accepted(["trainer=cpu", f"batch.tokens_per_step={value}"])
    accepted(["trainer=cpu", "batch.micro_batch_size=null", "batch.micro_tokens=8192"])
    # with micro_tokens the hint names micro_tokens: 3 sequences of 64 do not divide 1280 tokens per step
    by_tokens = [*TINY, "batch.micro_batch_size=null", "batch.tokens_per_step=1280"]
    msg = refused([*by_tokens, "batch.micro_tokens=192"])
    (value,) = hints(msg, "batch.micro_tokens", 192)
    accepted([*by_tokens, f"batch.micro_tokens={value}"])
    msg = refused([*TINY, "perf.peak_flops=-1"])
    (value,) = hints(msg, "perf.peak_flops", -1)
    accepted([*TINY, f"perf.peak_flops={value}"])


def test_pinned_sdpa_backend_hint_runs():
    cfg = compose_cfg([*TINY, "attention=sdpa", "attention.sdpa_backend=cudnn"])
    plan = resolve_plan(cfg, world_size=1, cuda_available=False)
    with pytest.raises(ConfigError) as e:
        probe_attention(cfg, plan, "cpu", int(cfg.model.n_head))
    suggested = hints(str(e.value), "attention.sdpa_backend", "cudnn")
    assert "auto" in suggested and "math" in suggested, str(e.value)
    for backend in suggested:
        cfg = compose_cfg([*TINY, "attention=sdpa", f"attention.sdpa_backend={backend}"])
        probe_attention(cfg, resolve_plan(cfg, world_size=1, cuda_available=False), "cpu", 4)


def test_pinned_sdpa_backend_is_probed_with_the_runs_attention_dropout():
    """SDPA's CPU flash kernel runs without dropout but not with it: the probe must try the run's
    model.attn_dropout, or the run fails at its first training step instead of exiting 2 up front."""
    cfg = compose_cfg([*TINY, "attention=sdpa", "attention.sdpa_backend=flash"])
    plan = resolve_plan(cfg, world_size=1, cuda_available=False)
    try:
        probe_attention(cfg, plan, "cpu", int(cfg.model.n_head))
    except ConfigError:
        pytest.skip("this torch build has no CPU flash SDPA kernel at all")
    cfg = compose_cfg([*TINY, "attention=sdpa", "attention.sdpa_backend=flash", "model.attn_dropout=0.1"])
    plan = resolve_plan(cfg, world_size=1, cuda_available=False)
    with pytest.raises(ConfigError) as e:
        probe_attention(cfg, plan, "cpu", int(cfg.model.n_head))
    assert "model.attn_dropout=0.1" in str(e.value) and "attention.sdpa_backend=auto" in str(e.value)
    (backend,) = [b for b in hints(str(e.value), "attention.sdpa_backend", "flash") if b != "auto"]
    ok = compose_cfg([*TINY, "attention=sdpa", f"attention.sdpa_backend={backend}", "model.attn_dropout=0.1"])
    probe_attention(ok, resolve_plan(ok, world_size=1, cuda_available=False), "cpu", 4)


# ------------------------------------------------------------------------------------------ data


def test_data_hints_are_accepted(char_data, tmp_path, shakespeare_path):
    base = [*TINY, f"data.source={shakespeare_path}"]
    # a data.dir of another tokenizer: the suggested sibling folder is free
    cfg = compose_cfg([*base, "data=shakespeare", f"data.dir={char_data}"])
    with pytest.raises(ConfigError) as e:
        check_data_source(cfg)
    (new_dir,) = hints(str(e.value), "data.dir", char_data)
    assert Path(new_dir).parent == char_data.parent and not Path(new_dir).exists()
    check_data_source(compose_cfg([*base, "data=shakespeare", f"data.dir={new_dir}"]))
    # a missing source: the message names no machine-specific example, and data.source=null is accepted
    cfg = compose_cfg([*TINY, f"data.source={tmp_path / 'nope.txt'}", f"data.dir={tmp_path / 'd'}"])
    with pytest.raises(ConfigError) as e:
        check_data_source(cfg)
    assert "data.source=null" in str(e.value)
    check_data_source(compose_cfg([*TINY, "data.source=null", f"data.dir={tmp_path / 'd'}"]))


@pytest.mark.parametrize("inside", [".", "tok", "a/b"])
def test_a_data_dir_inside_a_folder_source_is_refused_with_one_outside(tmp_path, shakespeare_path, inside):
    """data.dir in (or equal to) a folder data.source: its token files would join the corpus, and every later
    run would find the source changed; the error names a folder outside it, which is accepted."""
    src = tmp_path / "corpus"
    src.mkdir()
    (src / "a.txt").write_text(shakespeare_path.read_text()[:5000])
    base = [*TINY, "data.tokenizer=gpt2", f"data.source={src}"]
    with pytest.raises(ConfigError, match=r"is inside data.source=") as e:
        check_data_source(compose_cfg([*base, f"data.dir={src / inside}"]))
    (new_dir,) = hints(str(e.value), "data.dir", src / inside)
    assert not Path(new_dir).resolve().is_relative_to(src.resolve()), new_dir
    check_data_source(compose_cfg([*base, f"data.dir={new_dir}"]))
    check_data_source(compose_cfg([*base, f"data.dir={src / '.tok'}"]))  # hidden: never read as corpus
    check_data_source(compose_cfg([*base, f"data.dir={src / inside}", "resume=true"]))  # a run's own


@pytest.mark.parametrize("empty", ["data.source=", "data.source=''", "data.dir=", "data.dir=' '"])
def test_empty_data_paths_are_refused_naming_the_key(shakespeare_path, tmp_path, empty):
    """An empty data.source / data.dir (an unset shell variable) would make the working directory the corpus
    or the place prepared data go: refused naming the key; the suggested value is accepted."""
    key = empty.split("=")[0]
    base = [*TINY, f"data.source={shakespeare_path}", f"data.dir={tmp_path / 'd'}"]
    with pytest.raises(ConfigError) as e:
        check_data_source(compose_cfg([*base, empty]))
    assert f"{key}= is empty" in str(e.value)
    fixes = hints(str(e.value), key, "")
    assert fixes == (["/path/to/corpus.txt", "null"] if key == "data.source" else ["data/mycorpus"]), fixes
    # data.source=null works as typed (a download, not attempted here); the data.dir example too
    check_data_source(compose_cfg([*base, "data.source=null"]))
    check_data_source(compose_cfg([*base, f"data.dir={tmp_path / fixes[-1]}"]))


def test_seq_len_hint_fits_the_corpus_and_the_batch(tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("To be, or not to be, that is the question.\n" * 40)
    from data.prepare import ensure_prepared

    meta = ensure_prepared(str(small), str(tmp_path / "small"), "char", 0.1)
    base = [
        "model=tiny",
        "data=shakespeare_char",
        f"data.source={small}",
        f"data.dir={tmp_path / 'small'}",
        "batch.micro_batch_size=4",
        "batch.tokens_per_step=1024",
    ]
    with pytest.raises(ConfigError) as e:
        check_data_fits(compose_cfg([*base, "seq_len=256"]), meta)
    (value,) = hints(str(e.value), "seq_len", 256)
    cfg = compose_cfg([*base, f"seq_len={value}"])
    check_data_fits(cfg, meta)
    resolve_plan(cfg, world_size=1, cuda_available=False)


def test_seq_len_beyond_the_corpus_is_one_message_whose_fixes_pass(tmp_path):
    """seq_len=2000000 with cpu_tiny's batch and a prepared data.dir: one message from resolve_plan, before
    the batch split (whose own hint would lead to the corpus error next), naming the limit; each suggested
    seq_len (alone, or with its batch.tokens_per_step) gets past the data and the batch checks."""
    small = tmp_path / "small.txt"
    small.write_text("To be, or not to be, that is the question.\n" * 40)  # 1720 chars: 172 val tokens
    from data.prepare import ensure_prepared

    base = ["experiment=cpu_tiny", f"data.source={small}", f"data.dir={tmp_path / 'small'}"]
    meta = ensure_prepared(str(small), str(tmp_path / "small"), "char", 0.1)
    assert meta["val_tokens"] == 172
    for seq_len in (2000000, 172):
        with pytest.raises(ConfigError) as e:
            resolve_plan(compose_cfg([*base, f"seq_len={seq_len}"]), world_size=1, cuda_available=False)
        msg = str(e.value)
        assert "batch." not in msg.split(";")[0] and "so seq_len can be at most 171;" in msg, msg
        (fits,) = hints(msg, "seq_len", seq_len)
        assert fits == "128"
        cfg = compose_cfg([*base, f"seq_len={fits}"])
        resolve_plan(cfg, world_size=1, cuda_available=False)
        check_data_fits(cfg, meta)
    # a batch that one suggested seq_len fits: that one alone
    cfg = compose_cfg([*base, "seq_len=2000000", "batch.tokens_per_step=1024", "batch.micro_batch_size=4"])
    with pytest.raises(ConfigError) as e:
        resolve_plan(cfg, world_size=1, cuda_available=False)
    assert "use seq_len=128 (or any value up to 171)" in str(e.value), str(e.value)
    # a batch no power of two within the limit fits: the seq_len with the batch.tokens_per_step it needs
    cfg = compose_cfg([*base, "seq_len=2000000", "batch.tokens_per_step=1000", "batch.micro_batch_size=3"])
    with pytest.raises(ConfigError) as e:
        resolve_plan(cfg, world_size=1, cuda_available=False)
    (fits,) = hints(str(e.value), "seq_len", 2000000)
    (tokens,) = hints(str(e.value), "batch.tokens_per_step", 1000)
    cfg = compose_cfg(
        [*base, f"seq_len={fits}", f"batch.tokens_per_step={tokens}", "batch.micro_batch_size=3"]
    )
    resolve_plan(cfg, world_size=1, cuda_available=False)


def test_char_vocabulary_too_large_names_the_real_key():
    from data.tokenizer import MAX_VOCAB, make_tokenizer

    with pytest.raises(ValueError) as e:
        make_tokenizer("char", itos=[chr(0x100 + i) for i in range(MAX_VOCAB + 1)])
    assert "data.tokenizer=gpt2" in str(e.value) and "--tokenizer gpt2" in str(e.value)
    assert compose_cfg(["data.tokenizer=gpt2"]).data.tokenizer == "gpt2"


# ------------------------------------------------------------------------------------------ out_dir


def test_out_dir_hints_are_accepted(tmp_path):
    blocker = tmp_path / "results"
    blocker.write_text("x")
    msg = out_dir_problem(blocker)
    (value,) = hints(msg, "out_dir", blocker)
    assert out_dir_problem(value) is None and not Path(value).exists()  # checked, nothing created
    assert "cannot be created" in out_dir_problem(blocker / "run")
    assert out_dir_problem(tmp_path / "new" / "run") is None and not (tmp_path / "new").exists()


def test_out_dir_of_a_new_run_must_not_mix_with_other_files(tmp_path):
    """A new run's folder: new, empty (placeholders aside) or a run's own; not one holding other files,
    and not one inside a run (its files would mix); resume=true is checked against its run instead."""
    folder = tmp_path / "exp"
    folder.mkdir()
    (folder / ".gitkeep").write_text("")
    assert out_dir_problem(folder) is None
    (folder / "notes.txt").write_text("mine")
    msg = out_dir_problem(folder)
    assert "already holds other files or runs (notes.txt)" in msg and "out_dir=runs/run1" in msg, msg
    assert out_dir_problem(folder, resume=True) is None
    run = tmp_path / "run"
    (run / "ckpt").mkdir(parents=True)
    (run / "summary.json").write_text("{}")
    assert out_dir_problem(run) is None  # a run's folder: the run-directory check decides (resume or not)
    (run / "compare.png").write_bytes(b"")  # bench.compare's default output: still a run's folder
    assert out_dir_problem(run) is None
    assert f"lies inside the run folder {run}" in out_dir_problem(run / "ckpt" / "new")


def test_out_dir_hint_with_an_unwritable_home_names_a_writable_folder(tmp_path, monkeypatch, read_only_view):
    """$HOME read-only (a shared account, a read-only home mount): the suggested out_dir is not under it
    (it could not be created there) but under the temp folder, and it passes the out_dir check."""
    import os
    import tempfile

    home = tmp_path / "home"
    home.mkdir()
    if os.geteuid() != 0:
        home.chmod(0o555)
        ro = home
    else:  # root writes past permission bits; a read-only bind mount stops it
        ro = read_only_view(home)
    monkeypatch.setenv("HOME", str(ro))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    msg = out_dir_problem(ro / "run")
    (value,) = hints(msg, "out_dir", ro / "run")
    assert Path(value).parent == tmp_path / "tmp" / "flashgpt-runs", msg
    assert out_dir_problem(value) is None


# ------------------------------------------------------------------------------------------ TRITON_INTERPRET


@pytest.mark.parametrize("value", ["1", "true", "yes", "on", "TRUE", " On "])
def test_one_interpret_switch_for_kernels_and_trainer(value, monkeypatch):
    from kernels import interpret_enabled
    from trainer.endings import resume_command

    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interpret_enabled()
    plan = accepted([*TINY, "attention=flash"])  # the trainer lets flash run on the CPU
    assert plan.device_type == "cpu"
    fake = SimpleNamespace(overrides=["attention=flash"], out_dir=Path("runs/x"))
    assert resume_command(fake).startswith(f"TRITON_INTERPRET={value.strip()} python train.py")


@pytest.mark.parametrize("value", ["0", "false", "", "no"])
def test_interpreter_off_for_kernels_and_trainer(value, monkeypatch):
    from kernels import interpret_enabled
    from trainer.endings import resume_command

    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert not interpret_enabled()
    assert "TRITON_INTERPRET=1" in refused([*TINY, "attention=flash"])
    fake = SimpleNamespace(overrides=["attention=flash"], out_dir=Path("runs/x"))
    assert resume_command(fake).startswith("python train.py")


def test_sweep_resume_compares_the_values_as_hydra_sweeps_them(tmp_path):
    """resume=true with -m: the same values in the same order pass however they are written (spaces,
    quotes, choice()); another order, other values or another order of list values are named."""
    from trainer.rundir import sweep_changed

    yaml = tmp_path / "multirun.yaml"
    yaml.write_text("hydra:\n  overrides:\n    task:\n    - attention=naive,sdpa\n    - wandb.tags=[a],[b]\n")
    same = ["attention=naive, sdpa", "attention='naive','sdpa'", "attention=choice(naive,sdpa)"]
    for given in same:
        assert sweep_changed(yaml, [given, "wandb.tags=[a],[b]", "max_steps=5", "resume=true"]) is None, given
    for given in (
        ["attention=sdpa,naive", "wandb.tags=[a],[b]"],
        ["attention=naive,sdpa", "wandb.tags=[b],[a]"],
    ):
        msg = sweep_changed(yaml, given)
        assert (
            msg and "are not those of the sweep" in msg and "attention=naive,sdpa wandb.tags=[a],[b]" in msg
        )
    assert sweep_changed(yaml, ["attention=naive,sdpa", "wandb.tags=[a],[b]", "wandb.name='x,y'"]) is None
    assert sweep_changed(tmp_path / "none.yaml", ["attention=sdpa,naive"]) is None  # no record: jobs decide
