"""Config validation (trainer/checks.py): each user error is caught before any model is built, and the
message names the key and a valid value. Runs in-process through Hydra's compose API + trainer.loop.run."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from tests.helpers_train import compose_cfg, run_inprocess, tiny_overrides
from trainer.checks import ConfigError, check_resume_compatible, resolve_plan
from trainer.setup import no_checkpoint_message


@pytest.fixture
def expect_error(char_data, shakespeare_path, tmp_path, capsys, monkeypatch):
    """Run with overrides; assert exit status 2 and return the printed error (one line, no traceback)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def check(**extra) -> str:
        out = tmp_path / "run"
        outcome = run_inprocess(tiny_overrides(char_data, shakespeare_path, out, **extra), out)
        err = capsys.readouterr().err
        assert (outcome.status, outcome.exit_code) == ("error", 2), err
        assert err.startswith("config error: ") and "Traceback" not in err
        assert not (out / "ckpt").exists() and not (out / "wandb").exists()  # stopped before training
        return err

    return check


def test_seq_len_larger_than_block_size(expect_error):
    err = expect_error(**{"model.block_size": 32})
    assert "seq_len=64 is larger than model.block_size=32" in err and "model.block_size=64" in err


def test_seq_len_larger_than_data(expect_error, tmp_path):
    """The exact limit, from the prepared data: after preparing them in set-up, and before the batch checks
    once data.dir holds them."""
    small = tmp_path / "small.txt"
    small.write_text("To be, or not to be, that is the question.\n" * 40)  # 1720 chars: val split 172
    args = {"data.source": small, "data.dir": tmp_path / "small", "seq_len": 256, "batch.micro_batch_size": 4}
    exact = "so seq_len can be at most 171; use seq_len=128 (or any value up to 171)"
    for _ in ("prepared in set-up", "already prepared"):
        err = expect_error(**args)
        assert err.startswith("config error: seq_len=256 is longer than the data allows: ")
        assert f"data.dir={tmp_path / 'small'} holds 172 validation and 1,548 training tokens" in err, err
        assert exact in err, err


def test_tiny_corpus_suggestion_runs_as_typed(expect_error, tmp_path):
    """A 12-byte file: the suggestion is the exact limit of the prepared data."""
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("hello world\n")
    err = expect_error(**{"data.source": tiny, "data.dir": tmp_path / "tiny", "seq_len": 64})
    assert "holds 2 validation and 10 training tokens" in err and "use seq_len=1 " in err, err


def test_empty_documents_are_the_first_error(expect_error, tmp_path):
    """JSON Lines whose records are all empty: the empty corpus is named first, not seq_len."""
    jl = tmp_path / "empty.jsonl"
    jl.write_text('{"text": ""}\n{"text": ""}\n')
    args = {"data.source": jl, "data.dir": tmp_path / "jl", "data.tokenizer": "gpt2", "seq_len": 64}
    err = expect_error(**args)
    assert "holds no non-empty document" in err and "seq_len" not in err, err


def test_n_embd_not_divisible_by_n_head(expect_error):
    err = expect_error(**{"model.n_head": 3})
    assert "model.n_embd=128 is not divisible by model.n_head=3" in err


def test_unknown_attention_backend(expect_error):
    err = expect_error(**{"attention.name": "fast"})
    assert "attention.name (attention=...)='fast' is not valid" in err and "naive, sdpa, flash" in err


def test_unknown_attention_group_is_rejected_by_hydra():
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException, match="attention"):
        compose_cfg(["attention=fast"])


@pytest.mark.parametrize(
    ("args", "fixed"),
    [
        (["seq_len=64", "-m", "max_steps=2"], "-m seq_len=64 max_steps=2"),
        (["a=1", "--cfg", "job", "b=2"], "--cfg job a=1 b=2"),
        (["--config-name=x", "a=1"], None),  # flags first: Hydra's order
        (["-m", "seq_len=64,128", "max_steps=2"], None),
        (["seq_len=64", "-m"], None),  # flags after one run of overrides: argparse takes it
        (["prompt=-x", "b=2"], None),  # a value starting with '-' is no flag
    ],
)
def test_flag_between_overrides_names_the_order_that_works(args, fixed):
    """`python train.py seq_len=64 -m max_steps=2`: Hydra's argparse calls the overrides "unrecognized
    arguments"; refused naming the flag and the command with the flags first."""
    import train

    got = train.flag_between_overrides(args)
    if fixed is None:
        assert got is None, got
    else:
        assert got.startswith(f"{args[1]} must come before the overrides") and got.endswith(fixed), got


def test_flag_between_overrides_exits_2_and_writes_nothing(tmp_path):
    from tests.helpers_train import describe, run_train

    proc = run_train(["seq_len=64", "-m", f"hydra.sweep.dir={tmp_path / 'sweep'}"], timeout=120)
    assert proc.returncode == 2, describe(proc)
    assert proc.stderr.startswith("config error: -m must come before the overrides"), describe(proc)
    assert not (tmp_path / "sweep").exists()


def test_flash_without_cuda_points_to_sdpa(expect_error):
    err = expect_error(attention="flash")
    assert "needs a CUDA GPU" in err and "attention=sdpa" in err and "TRITON_INTERPRET=1" in err


def test_flash_head_dim_out_of_range(expect_error):
    err = expect_error(attention="flash", **{"model.n_head": 32})  # 128 / 32 = 4
    assert "head dims 8..256" in err and "gives head_dim=4" in err and "attention=sdpa" in err


def test_pinned_sdpa_backend_that_cannot_run(expect_error):
    err = expect_error(attention="sdpa", **{"attention.sdpa_backend": "cudnn"})
    assert "attention.sdpa_backend=cudnn cannot run head_dim=32, dtype=float32 on cpu" in err
    assert "attention.sdpa_backend=auto" in err and "math" in err  # math always runs on the CPU


def test_missing_data_file(expect_error, tmp_path):
    err = expect_error(**{"data.source": tmp_path / "nope.txt", "data.dir": tmp_path / "d"})
    assert f"data.source={tmp_path / 'nope.txt'} does not exist" in err
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("one document")
    err = expect_error(**{"data.source": tmp_path / "corpus", "data.dir": tmp_path / "d"})
    assert "is a list of documents: use data.tokenizer=gpt2" in err  # a directory is a corpus of documents


def test_documents_with_the_char_tokenizer_get_one_fix(expect_error, char_data, tmp_path):
    """A directory source with the char tokenizer and a data.dir that holds char data (the default): the
    first error names both changes, since data.tokenizer=gpt2 alone is refused next for that data.dir."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("one document")
    err = expect_error(**{"data.source": docs, "data.dir": char_data})
    fix = err.split("use ", 1)[1].split()
    assert fix[0] == "data.tokenizer=gpt2" and fix[1].startswith("data.dir="), err
    assert not os.path.exists(fix[1].split("=", 1)[1]), err  # a folder of its own


def test_small_record_file_names_its_content_before_its_size(expect_error, tmp_path):
    """A JSON Lines file too small for seq_len whose records lack the text field, or that the char
    tokenizer cannot read: the first error is the one a bigger file would hit too, not seq_len."""
    jl = tmp_path / "tiny.jsonl"
    jl.write_text('{"body": "hello world"}\n{"body": "more text"}\n')
    args = {"data.source": jl, "data.dir": tmp_path / "jl", "seq_len": 256, "batch.micro_batch_size": 4}
    err = expect_error(**args)  # the char tokenizer (tiny_overrides): it reads text files only
    assert "data.tokenizer=char reads a single text file" in err and "seq_len" not in err, err
    err = expect_error(**args, **{"data.tokenizer": "gpt2"})
    assert "has no field 'text' (its fields: body)" in err and "data.text_field" in err, err
    gpt2 = {"data.tokenizer": "gpt2", "data.text_field": "body"}
    err = expect_error(**args, **gpt2)  # two documents: none held out at the default share
    assert "gave 2 document(s) and none for the val split" in err and "use data.val_docs=1 " in err, err
    err = expect_error(**args, **gpt2, **{"data.val_docs": 1})
    assert err.startswith("config error: seq_len=256 is longer than the data allows"), err
    assert "holds 3 validation and 3 training tokens" in err, err  # exact: whole documents, end-of-text


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads any file")
def test_unreadable_data_file(expect_error, tmp_path):
    f = tmp_path / "secret.txt"
    f.write_text("hello")
    f.chmod(0)
    err = expect_error(**{"data.source": f, "data.dir": tmp_path / "d"})
    assert "is not readable" in err


def test_batch_does_not_divide_tokens_per_step(expect_error):
    err = expect_error(**{"batch.tokens_per_step": 1000})
    assert "batch.tokens_per_step=1000 is not a multiple of micro_batch_size(8) x seq_len(64)" in err
    assert "batch.tokens_per_step=512 or 1024" in err
    err = expect_error(**{"batch.micro_batch_size": None, "batch.micro_tokens": 100})
    assert "batch.micro_tokens=100 must be a multiple of seq_len=64, or at most seq_len" in err
    assert "batch.micro_tokens=64" in err


@pytest.mark.parametrize(
    ("seq_len", "world", "micro", "accum"),
    [
        (256, 1, 128, 2),
        (1024, 1, 32, 2),
        (8192, 1, 4, 2),
        (32768, 1, 1, 2),
        (1024, 8, 8, 1),  # never more than one rank's share of tokens_per_step
        (16384, 4, 1, 1),
    ],
)
def test_token_budget_batch_defaults(seq_len, world, micro, accum):
    """The default batch is a token budget per micro-batch (batch.micro_tokens), so `python train.py
    seq_len=N` needs no batch override at any N from 256 to 32768, on one or several ranks."""
    plan = resolve_plan(compose_cfg([f"seq_len={seq_len}"]), world_size=world, cuda_available=True)
    assert (plan.micro_batch_size, plan.grad_accum) == (micro, accum)
    assert plan.eval_batch_size == micro
    assert plan.micro_batch_size * seq_len * world * plan.grad_accum == 65536


def test_explicit_micro_batch_size_wins_over_the_token_budget():
    plan = resolve_plan(
        compose_cfg(["seq_len=1024", "batch.micro_batch_size=4"]), world_size=1, cuda_available=True
    )
    assert (plan.micro_batch_size, plan.grad_accum) == (4, 16)
    with pytest.raises(ConfigError, match="batch.micro_batch_size=null needs batch.micro_tokens"):
        resolve_plan(compose_cfg(["batch.micro_tokens=null"]), world_size=1, cuda_available=True)


def test_compile_mode_key():
    """compile_mode passes through to torch.compile ("default" -> None); unknown values and CUDA graphs
    under DDP are refused, naming the key."""
    for mode, expect in (
        ("default", None),
        ("reduce-overhead", "reduce-overhead"),
        ("max-autotune-no-cudagraphs", "max-autotune-no-cudagraphs"),
    ):
        plan = resolve_plan(compose_cfg([f"compile_mode={mode}"]), world_size=1, cuda_available=True)
        assert plan.compile and plan.compile_mode == expect
    with pytest.raises(
        ConfigError,
        match="compile_mode='turbo' is not valid; choose one of: default, "
        "reduce-overhead, max-autotune-no-cudagraphs",
    ):
        resolve_plan(compose_cfg(["compile_mode=turbo"]), world_size=1, cuda_available=True)
    with pytest.raises(ConfigError, match="compile_mode=reduce-overhead .* one process only"):
        resolve_plan(
            compose_cfg(["compile_mode=reduce-overhead", "batch.tokens_per_step=131072"]),
            world_size=2,
            cuda_available=True,
        )
    with pytest.raises(ConfigError, match="perf.profile_steps"):
        resolve_plan(compose_cfg(["perf.profile_steps=-1"]), world_size=1, cuda_available=True)
    traced = resolve_plan(
        compose_cfg(["perf.profile_steps=3", "perf.trace=true"]), world_size=1, cuda_available=True
    )
    assert traced.device_type == "cuda"


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("nonfinite", "ignore", "nonfinite='ignore' is not valid; choose one of: stop, skip"),
        (
            "wandb.mode",
            "cloud",
            "wandb.mode='cloud' is not valid; choose one of: auto, online, offline, disabled",
        ),
        ("parity.reference", "flash", "parity.reference='flash' is not valid; choose one of: naive, sdpa"),
        ("dtype", "float16", "dtype='float16' is not valid"),
        ("tf32", "maybe", "tf32='maybe' is not valid; choose true or false"),
        ("tf32", 1.0, "tf32=1.0 is not valid; choose true or false"),
        ("compile", 1, "compile=1 is not valid; choose one of: true, false, auto"),
        ("deterministic", "maybe", "deterministic='maybe' is not valid; choose true or false"),
        ("eval.at_start", "sometimes", "eval.at_start='sometimes' is not valid; choose true or false"),
        ("checkpoint.at_end", "maybe", "checkpoint.at_end='maybe' is not valid; choose true or false"),
        ("perf.trace", "maybe", "perf.trace='maybe' is not valid; choose true or false"),
        (
            "perf.trace",
            True,
            "perf.trace=true traces the profiled steps, and perf.profile_steps=0 profiles none",
        ),
        ("max_steps", 0, "max_steps=0 must be a positive integer"),
        ("optim.lr", "abc", "optim.lr='abc' is not a finite number"),
        ("optim.lr", "inf", "optim.lr=inf is not a finite number"),
        ("optim.beta1", 1.5, "optim.beta1=1.5 must be in [0, 1)"),
        ("optim.weight_decay", -5, "optim.weight_decay=-5.0 must be >= 0"),  # typed: a float
        ("optim.lr", True, "optim.lr=True is not a finite number"),
        ("seed", "abc", "seed='abc' must be an integer from 0 to 9223372036854775807, e.g. seed=1337"),
        ("seed", 2**64, f"seed={2**64} must be an integer from 0 to 9223372036854775807"),  # torch: overflow
        ("seed", -1, "seed=-1 must be an integer from 0 to 9223372036854775807"),  # torch wraps it
        ("data.val_fraction", 0.2, "holds data split with data.val_fraction=0.1, not 0.2; set data.dir="),
    ],
)
def test_enum_and_range_errors(expect_error, key, value, expected):
    assert expected in expect_error(**{key: value})


def test_device_cuda_without_gpu(expect_error):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert "device=cuda but no CUDA GPU" in expect_error(device="cuda")


def test_resume_without_checkpoint(expect_error):
    err = expect_error(resume=True)
    assert "resume=true but" in err and "has no loadable checkpoint" in err and "out_dir=" in err


def test_flash_allowed_under_triton_interpret(monkeypatch):
    cfg = compose_cfg(["model=tiny", "attention=flash", "seq_len=64"])
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError):
        resolve_plan(cfg, world_size=1, cuda_available=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_plan(cfg, world_size=1, cuda_available=False).device_type == "cpu"


def test_check_resume_compatible_lists_all_differences():
    base = {
        "model_args": {
            "n_layer": 2,
            "n_head": 4,
            "n_embd": 128,
            "block_size": 64,
            "vocab_size": 128,
            "bias": True,
        },
        "tokenizer": "char",
        "vocab_size": 65,
        "attention": ["naive", "auto"],
    }
    assert check_resume_compatible(base, {**base, "model_args": {**base["model_args"]}}) == []
    notes = check_resume_compatible(base, {**base, "attention": ["sdpa", "auto"]})
    assert notes == ["attention backend changed on resume: ['naive', 'auto'] -> ['sdpa', 'auto']"]
    # a variant the weights were not trained with is allowed, and said (key, old and new value)
    notes = check_resume_compatible(base, {**base, "model_args": {**base["model_args"], "window": 8}})
    assert notes == ["attention.window changed on resume: None -> 8 (the steps so far trained with None)"]
    with pytest.raises(ConfigError) as e:
        check_resume_compatible(
            base, {**base, "model_args": {**base["model_args"], "n_head": 8}, "tokenizer": "gpt2"}
        )
    assert "model.n_head: 4 -> 8" in str(e.value) and "data.tokenizer: char -> gpt2" in str(e.value)
    # and the values that resume it: the run's, each as a key=value to type; n_kv_head, null on both sides,
    # follows n_head and is not named (the user set none: the n_head difference says it)
    assert "the run's values (model.n_head=4 data.tokenizer=char)" in str(e.value), e.value
    assert "n_kv_head" not in str(e.value)


@pytest.mark.parametrize(
    "saved_kv, new_kv, listed",
    [
        (2, None, "model.n_kv_head: 2 -> 8"),  # the run's own n_kv_head, given up by this command
        (None, 2, "model.n_kv_head: 4 -> 2"),  # set by this command
        (2, 2, None),  # set on both sides, the same
        (None, None, None),  # follows n_head on both sides
    ],
)
def test_check_resume_compatible_names_n_kv_head_only_when_set(saved_kv, new_kv, listed):
    """A changed n_head lists n_kv_head only when it was set on either side and differs."""
    args = {"n_layer": 2, "n_head": 4, "n_embd": 128, "block_size": 64, "vocab_size": 128}
    base = {"model_args": {**args, "n_kv_head": saved_kv}, "tokenizer": "char", "vocab_size": 65}
    new = {**base, "model_args": {**args, "n_head": 8, "n_kv_head": new_kv}}
    with pytest.raises(ConfigError) as e:
        check_resume_compatible(base, new)
    err = str(e.value)
    assert "model.n_head: 4 -> 8" in err, err
    if listed:
        assert listed in err and f"model.n_kv_head={saved_kv or 4}" in err, err
    else:
        assert "n_kv_head" not in err, err


# ------------------------------------------------------------------------------------------ presets


@pytest.mark.parametrize("seq_len", [1024, 2048, 4096, 8192, 16384])
def test_context_sweep_fixes_tokens_per_step(seq_len):
    cfg = compose_cfg(["experiment=context_sweep", f"seq_len={seq_len}"], return_hydra_config=True)
    plan = resolve_plan(cfg, world_size=1, cuda_available=True)
    assert plan.micro_batch_size * seq_len == 16384 and plan.grad_accum == 8
    assert cfg.batch.tokens_per_step == 131072 and cfg.model.name == "gpt2"
    sweep = cfg.hydra.sweep
    assert "context_sweep" in sweep.dir
    assert sweep._get_node("subdir")._value() == "${hydra.job.num}_${attention.name}_n${seq_len}${swept:}"


def test_block_size_follows_seq_len_and_presets_compose():
    cfg = compose_cfg(["attention=naive", "seq_len=8192"])
    assert cfg.model.block_size is None and cfg.model.name == "gpt2" and cfg.attention.name == "naive"
    assert cfg.attention.sdpa_backend == "auto"  # typed: every attention config has every key
    tiny = compose_cfg(["experiment=cpu_tiny"])
    assert tiny.model.name == "mini" and tiny.data.tokenizer == "char" and tiny.seq_len == 128
    plan = resolve_plan(tiny, world_size=1, cuda_available=False)
    assert (plan.device_type, plan.compile, plan.autocast_dtype) == ("cpu", False, None)
    gpu = resolve_plan(
        compose_cfg(["experiment=gpt2_shakespeare", "seq_len=8192"]), world_size=1, cuda_available=True
    )
    assert (gpu.device_type, gpu.compile, gpu.autocast_dtype, gpu.micro_batch_size) == (
        "cuda",
        True,
        "bfloat16",
        2,
    )


def test_wandb_online_without_login(expect_error, monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    err = expect_error(**{"wandb.mode": "online"})
    assert "wandb.mode=online but no W&B API key" in err and "wandb login" in err and "offline" in err


def test_data_dir_holding_another_corpus_is_not_overwritten(expect_error, char_data, tmp_path):
    other = tmp_path / "other.txt"
    other.write_text("A different corpus, long enough for a few windows of text. " * 200)
    before = (char_data / "meta.json").read_text()
    err = expect_error(**{"data.source": other})
    assert f"data.dir={char_data} holds data prepared from" in err
    assert f"set data.dir={char_data.parent / 'other_char'} (a folder of its own)" in err
    assert (char_data / "meta.json").read_text() == before  # the shared data were not re-prepared


def _finished_run(path):
    path.mkdir(parents=True, exist_ok=True)
    summary = {"status": "ok", "final/val_loss": 2.5, "attention": "naive", "seq_len": 64}
    (path / "summary.json").write_text(json.dumps(summary))
    (path / "metrics.jsonl").write_text('{"step": 1, "train/loss": 4.0}\n')
    return (path / "summary.json").read_text(), (path / "metrics.jsonl").read_text()


def test_a_run_killed_before_its_first_checkpoint_is_not_a_loop_of_advice(expect_error, tmp_path):
    """A run killed hard before its first checkpoint (summary "running", no ckpt/): a new run there is
    refused without pointing at resume=true, and resume=true says there is nothing to continue instead of
    pointing at another run; the directory is left as it was."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"status": "running"}))
    (run / "metrics.jsonl").write_text('{"step": 1, "train/loss": 4.0}\n')
    err = expect_error()
    assert "without a checkpoint, so resume=true has nothing to continue" in err and "new out_dir" in err, err
    err = expect_error(resume=True)
    assert "stopped before the first one" in err and "newest run with checkpoints" not in err, err
    assert json.loads((run / "summary.json").read_text()) == {"status": "running"}


def test_resume_of_a_run_whose_checkpoints_were_deleted_says_so(expect_error, tmp_path):
    """A finished run with ckpt/ deleted (summary.json names its last checkpoint): not "stopped before the
    first one", which it did not."""
    run = tmp_path / "run"
    _finished_run(run)
    summary = json.loads((run / "summary.json").read_text()) | {
        "last_checkpoint": f"{run}/ckpt/step_00000016"
    }
    (run / "summary.json").write_text(json.dumps(summary))
    err = expect_error(resume=True)
    assert "its checkpoints are gone (it wrote up to step_00000016; ckpt/ holds none now), so there" in err, (
        err
    )
    assert "stopped before" not in err and json.loads((run / "summary.json").read_text()) == summary
    (run / "ckpt" / "step_00000016").mkdir(parents=True)  # there, but nothing in it loads: not "gone"
    msg = no_checkpoint_message(SimpleNamespace(out_dir=run))
    assert "no loadable checkpoint: none of its 1 checkpoints loads, so there" in msg, msg


def test_new_run_in_an_existing_run_dir_is_refused(expect_error, tmp_path):
    summary, metrics = _finished_run(tmp_path / "run")
    err = expect_error()
    assert "already holds a run" in err and "resume=true" in err and "new out_dir" in err
    assert (tmp_path / "run" / "summary.json").read_text() == summary
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics


def test_refused_resume_leaves_the_run_untouched(expect_error, tmp_path):
    summary, metrics = _finished_run(tmp_path / "run")
    expect_error(resume=True)  # no checkpoint to resume from
    assert (tmp_path / "run" / "summary.json").read_text() == summary
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics


def test_an_eval_batch_beyond_the_machine_is_refused_and_a_window_past_seq_len_noted():
    """An eval.batch_size whose logits need terabytes (any machine) is a config error naming a size that
    fits, before it takes the machine down; a window >= seq_len runs, with a note that it is full causal."""
    huge = ["experiment=cpu_tiny", "eval.batch_size=100000000"]
    with pytest.raises(ConfigError, match=r"eval.batch_size=100000000 needs about .* GiB .*use eval.batch_s"):
        resolve_plan(compose_cfg(huge), world_size=1, cuda_available=False)
    plan = resolve_plan(
        compose_cfg(["experiment=cpu_tiny", "attention.window=1000"]), world_size=1, cuda_available=False
    )
    assert any("attention.window=1000 >= seq_len=128" in n for n in plan.notes), plan.notes


def test_warmup_longer_than_the_run_is_warned_with_a_value_that_fits():
    """experiment=cpu_tiny (warmup 50) in the README's 10-step try-out: one warning naming both keys; the
    suggested warmup gets no warning; the full 2000-step preset none either."""
    import re

    def warnings(overrides):
        plan = resolve_plan(compose_cfg(overrides), world_size=1, cuda_available=False)
        return [n for n in plan.notes if "optim.warmup_steps" in n]

    (msg,) = warnings(["experiment=cpu_tiny", "max_steps=10"])
    assert msg.startswith("warning: optim.warmup_steps=50 >= max_steps=10") and "never decays" in msg, msg
    fix = re.search(r"use e\.g\. (optim\.warmup_steps=\d+)", msg).group(1)
    assert warnings(["experiment=cpu_tiny", "max_steps=10", fix]) == []
    assert warnings(["experiment=cpu_tiny"]) == []


def test_token_budget_batch_hint_names_what_the_user_set():
    """With the micro-batch from the token budget (cpu_tiny), a tokens_per_step that does not split names
    batch.micro_tokens (not a micro_batch_size the user never set) and suggests steps that do split."""
    import re

    with pytest.raises(ConfigError) as e:
        resolve_plan(
            compose_cfg(["experiment=cpu_tiny", "batch.tokens_per_step=1000"]),
            world_size=1,
            cuda_available=False,
        )
    msg = str(e.value)
    assert "batch.micro_tokens=2048" in msg and "micro_batch_size" not in msg, msg
    for t in map(int, re.search(r"use batch.tokens_per_step=([\d or]+)", msg).group(1).split(" or ")):
        plan = resolve_plan(
            compose_cfg(["experiment=cpu_tiny", f"batch.tokens_per_step={t}"]),
            world_size=1,
            cuda_available=False,
        )
        assert plan.micro_batch_size * 128 * plan.grad_accum == t


def test_plan_notes_say_what_a_key_does_not_do():
    """Keys that have no effect in a run say so at start-up: micro_tokens under an explicit
    micro_batch_size, GPU profiling and CUDA graphs on the CPU."""
    plan = resolve_plan(
        compose_cfg(["experiment=cpu_tiny", "batch.micro_batch_size=16", "batch.micro_tokens=4096"]),
        world_size=1,
        cuda_available=False,
    )
    assert any("batch.micro_tokens=4096 is not used" in n for n in plan.notes), plan.notes
    plan = resolve_plan(
        compose_cfg(
            ["experiment=cpu_tiny", "perf.profile_steps=2", "compile=true", "compile_mode=reduce-overhead"]
        ),
        world_size=1,
        cuda_available=False,
    )
    assert any("perf.profile_steps" in n for n in plan.notes) and any("CUDA graphs" in n for n in plan.notes)
    gpu = resolve_plan(compose_cfg(["perf.profile_steps=2"]), world_size=1, cuda_available=True)
    assert gpu.notes == []


@pytest.mark.parametrize(
    ("interval", "max_steps", "last", "span"),
    [(0, 10, 0, "steps 1-10"), (4, 10, 8, "steps 9-10"), (3, 10, 9, "step 10"), (5, 10, 10, None)],
)
def test_final_steps_outside_every_checkpoint_are_said(interval, max_steps, last, span):
    """checkpoint.at_end=false (e.g. kept from a one-off resume) where the interval does not reach max_steps:
    the start-up warning names the steps no checkpoint will hold and the key that keeps them."""
    keys = ["experiment=cpu_tiny", f"max_steps={max_steps}", "checkpoint.at_end=false"]
    plan = resolve_plan(
        compose_cfg([*keys, f"checkpoint.interval={interval}"]), world_size=1, cuda_available=False
    )
    said = [n for n in plan.notes if "checkpoint.at_end=false" in n]
    if span is None:
        assert said == [], plan.notes
    else:
        assert len(said) == 1 and f"no checkpoint will hold {span} (" in said[0], plan.notes
        assert "checkpoint.at_end=true" in said[0]


# ------------------------------------------------------------------------------------------ typed configs


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("seq_len", "abc", "seq_len='abc' must be a positive integer, e.g. seq_len=1024"),
        ("sq_len", 64, "sq_len is not a config key; did you mean seq_len?"),
        ("+typo", 1, "typo is not a config key"),
        ("+model.typo", 1, "model.typo is not a config key; valid keys under model: model.name"),
        ("model.n_heads", 4, "model.n_heads is not a config key; did you mean model.n_head?"),
        ("attention", "fast", "choose one of: attention=flash, attention=naive, attention=sdpa"),
        ("batch.micro_batch_size", 2.5, "batch.micro_batch_size=2.5 must be null or a positive integer"),
        ("batch.tokens_per_step", 2.5, "batch.tokens_per_step=2.5 must be a positive integer"),
        ("attention.window", 0, "attention.window=0 must be null or a positive integer"),
        ("model.attn_dropout", 1.5, "model.attn_dropout=1.5 must be in [0, 1)"),
        (
            "wandb.tags",
            "foo",
            "wandb.tags='foo' must be a list: wandb.tags=[foo] (several: wandb.tags=[a,b])",
        ),
    ],
)
def test_typed_config_errors_name_the_full_key(expect_error, key, value, expected):
    """OmegaConf's type and unknown-key errors (also ``+key=...``, which Hydra adds past the schema) end
    like the trainer's own checks: exit 2, one line naming the full key and a valid one."""
    assert expected in expect_error(**{key: value})


@pytest.mark.parametrize(
    ("key", "value"), [("trainer.max_steps", 3), ("experiment.batch.micro_batch_size", 4)]
)
def test_a_preset_groups_key_names_the_top_level_key_that_runs(expect_error, key, value):
    """trainer= and experiment= are presets of top-level keys: ``trainer.max_steps=3`` gets the key that
    means it, with the value given, and that override then runs (no "trainer is not a config key")."""
    err = expect_error(**{key: value})
    rest = key.partition(".")[2]
    assert f"{key} is not a config key" in err and f"set the key itself: {rest}={value}" in err, err
    plan = resolve_plan(
        compose_cfg(["experiment=cpu_tiny", f"{rest}={value}"]), world_size=1, cuda_available=False
    )
    assert plan is not None


@pytest.mark.parametrize(
    ("key", "hint"),
    [
        ("typo", None),  # 0.67 from dtype: no longer offered
        ("foo", None),
        ("sq_len", "seq_len"),
        ("max_step", "max_steps"),
        ("evl", "eval"),
        ("model.n_heads", "model.n_head"),
        ("lr", "optim.lr"),  # a group's key without its group
        ("n_layer", "model.n_layer"),
    ],
)
def test_unknown_key_suggests_only_a_close_match(key, hint):
    from trainer.config import TrainConfig
    from trainer.fields import unknown_key

    msg = unknown_key(key, TrainConfig)
    if hint is None:
        assert "did you mean" not in msg and msg.startswith(f"{key} is not a config key; valid keys"), msg
    else:
        assert f"did you mean {hint}? " in msg, msg
        if hint != "eval":  # a group, not a value
            compose_cfg([f"{hint}=3"])  # the suggestion is a key that composes


@pytest.mark.slow  # real train.py processes
def test_train_py_reports_composition_errors_with_exit_2(tmp_path):
    from tests.helpers_train import run_train

    for args in (["seq_len=abc"], ["+typo=1", "experiment=cpu_tiny"], ["model=gpt3"]):
        proc = run_train([*args, f"out_dir={tmp_path / 'run'}", "wandb.mode=disabled"], timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith("config error: ") and "Traceback" not in proc.stderr, proc.stderr
    assert "model=gpt3 is not a config of group model; choose one of: " in proc.stderr
    # an unquoted value Hydra's grammar cannot read (non-ASCII): the message says how to quote it
    proc = run_train(["wandb.tags=[héllo]", f"out_dir={tmp_path / 'run'}"], timeout=120)
    assert proc.returncode == 2 and "quote a value" in proc.stderr, proc.stderr


@pytest.mark.slow  # real train.py processes
def test_a_sweep_refused_before_its_first_job_leaves_no_folder(tmp_path):
    """`-m` with a bad sweep value: config error, exit 2, and no multirun/<time>_<token>/ holding only
    Hydra's multirun.yaml (config errors write nothing); a folder the user made keeps what it held."""
    import subprocess

    from tests.helpers_train import describe, train_command

    cmd, env = train_command(["-m", "experiment=cpu_tiny", "seq_len=128,abc", "wandb.mode=disabled"])
    proc = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "seq_len='abc'" in proc.stderr, describe(proc)
    assert list(tmp_path.iterdir()) == [], list(tmp_path.rglob("*"))
    mine = tmp_path / "mine"
    (mine / "notes").mkdir(parents=True)
    cmd, env = train_command(["-m", "seq_len=128,abc", f"hydra.sweep.dir={mine}", "wandb.mode=disabled"])
    proc = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, describe(proc)
    assert (mine / "notes").is_dir()


@pytest.mark.slow  # a real train.py process
def test_out_dir_with_a_sweep_is_refused_naming_hydra_sweep_dir(tmp_path):
    """`-m ... out_dir=X` would be ignored (each job runs in its sweep folder): a config error naming
    hydra.sweep.dir=X, exit 2, nothing created."""
    import subprocess

    from tests.helpers_train import describe, train_command

    target = tmp_path / "sw"
    cmd, env = train_command(
        ["-m", "experiment=cpu_tiny", "seed=1,2", f"out_dir={target}", "wandb.mode=disabled"]
    )
    proc = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, describe(proc)
    assert f"use hydra.sweep.dir={target} instead" in proc.stderr and "Traceback" not in proc.stderr, (
        describe(proc)
    )
    assert list(tmp_path.iterdir()) == [], list(tmp_path.rglob("*"))


def test_model_presets_are_the_model_package_presets():
    """``model=<name>`` is ``model.gpt.PRESETS[name]`` (one list of sizes), and sets only model keys."""
    from omegaconf import OmegaConf

    from model.gpt import PRESETS
    from trainer.config import gpt_config_for

    base = OmegaConf.to_container(compose_cfg([]))  # unresolved: run_name holds ${now:...}
    for name, sizes in PRESETS.items():
        cfg = compose_cfg([f"model={name}"])
        assert {k: cfg.model[k] for k in sizes} == sizes and cfg.model.name == name
        gpt = gpt_config_for(cfg, 128)
        assert {k: getattr(gpt, k) for k in sizes} == sizes and gpt.block_size == cfg.seq_len
        others = {k: v for k, v in OmegaConf.to_container(cfg).items() if k != "model"}
        assert others == {k: v for k, v in base.items() if k != "model"}


def test_issue16_keys_compose_with_their_defaults():
    cfg = compose_cfg([])
    assert (cfg.attention.window, cfg.attention.document_mask) == (None, False)
    assert (cfg.model.attn_dropout, cfg.data.doc_separator) == (0.0, None)
    assert compose_cfg(["data.doc_separator='<|endoftext|>'"]).data.doc_separator == "<|endoftext|>"


@pytest.mark.parametrize("micro_tokens,count", [(128, "gives 1 sequence of"), (256, "gives 2 sequences of")])
def test_token_budget_batch_hint_counts_sequences_in_english(micro_tokens, count):
    """The micro-batch count of the split error reads "1 sequence", "2 sequences"."""
    with pytest.raises(ConfigError) as e:
        resolve_plan(
            compose_cfg(
                ["experiment=cpu_tiny", f"batch.micro_tokens={micro_tokens}", "batch.tokens_per_step=1000"]
            ),
            world_size=1,
            cuda_available=False,
        )
    assert count in str(e.value), e.value


def test_resume_hint_names_the_run_with_the_newest_checkpoint(expect_error, tmp_path, monkeypatch):
    """resume=true in a directory without checkpoints points at the run whose checkpoint is newest, not
    at the run directory touched last (a no-op resume of an older run bumps that one's mtime)."""
    monkeypatch.chdir(tmp_path)
    for name, age in (("older", 3000), ("newer", 1000)):
        f = tmp_path / "runs" / name / "ckpt" / "step_00000008"
        f.mkdir(parents=True)
        t = 1_700_000_000 - age
        os.utime(f, (t, t))
        os.utime(f.parent.parent, (t, t))
    os.utime(tmp_path / "runs" / "older", (1_800_000_000, 1_800_000_000))  # a no-op resume of it, later
    err = expect_error(resume=True)
    assert f"(newest run with checkpoints: out_dir={os.path.join('runs', 'newer')})" in err, err
    from trainer.rundir import claim_run_dir

    lock = claim_run_dir(tmp_path / "runs" / "newer", is_main=True)  # still training: no run to resume
    try:
        err = expect_error(resume=True)
    finally:
        lock.release()
    assert f"(newest run with checkpoints: out_dir={os.path.join('runs', 'older')})" in err, err


def test_bad_gluon_env_is_a_config_error(monkeypatch):
    """FLASHGPT_GLUON_FWD (read by the flash forward) is checked before the run starts, naming the variable;
    other backends do not read it."""
    monkeypatch.setenv("FLASHGPT_GLUON_FWD", "bogus")
    with pytest.raises(ConfigError, match="FLASHGPT_GLUON_FWD='bogus'.*unset it"):
        resolve_plan(compose_cfg(["attention=flash"]), world_size=1, cuda_available=True)
    resolve_plan(compose_cfg(["attention=sdpa"]), world_size=1, cuda_available=True)
    monkeypatch.setenv("FLASHGPT_GLUON_FWD", "0")
    resolve_plan(compose_cfg(["attention=flash"]), world_size=1, cuda_available=True)
    monkeypatch.setenv("FLASHGPT_GLUON_BWD", "on")
    with pytest.raises(ConfigError, match="FLASHGPT_GLUON_BWD='on'.*unset it"):
        resolve_plan(compose_cfg(["attention=flash"]), world_size=1, cuda_available=True)


def test_bad_fused_loss_env_is_a_config_error(monkeypatch):
    """FLASHGPT_FUSED_LOSS (read by a CUDA training step, any backend) is checked before the run starts."""
    monkeypatch.setenv("FLASHGPT_FUSED_LOSS", "yes")
    for attention in ("sdpa", "flash"):
        with pytest.raises(ConfigError, match="FLASHGPT_FUSED_LOSS='yes'.*unset it"):
            resolve_plan(compose_cfg([f"attention={attention}"]), world_size=1, cuda_available=True)
    resolve_plan(compose_cfg(["attention=sdpa", "device=cpu"]), world_size=1, cuda_available=False)
    monkeypatch.setenv("FLASHGPT_FUSED_LOSS", "1")
    resolve_plan(compose_cfg(["attention=sdpa"]), world_size=1, cuda_available=True)


def test_a_tiny_non_utf8_source_is_reported_as_such_before_seq_len(expect_error, tmp_path):
    """A small file that is not UTF-8 would also be too short for seq_len: its encoding is the problem to
    fix first (a longer file of the same bytes would fail on it next)."""
    (bad := tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    err = expect_error(**{"data.source": bad, "data.dir": tmp_path / "d", "seq_len": 64})
    assert "is not UTF-8 text" in err and "offset 3" in err and "seq_len" not in err, err


def test_max_tokens_below_two_names_the_key_and_a_value(expect_error, tmp_path):
    err = expect_error(**{"data.max_tokens": 1, "data.dir": tmp_path / "d"})
    assert "data.max_tokens" in err and "data.max_tokens=1000000000" in err, err


def test_an_empty_source_directory_is_named_before_the_tokenizer_advice(expect_error, tmp_path):
    """An empty directory (or one of hidden files only) as data.source: that is the problem to fix, not the
    char tokenizer that cannot read a directory of documents (the fix it would suggest fails next)."""
    (empty := tmp_path / "corpus").mkdir()
    (empty / ".hidden.txt").write_text("not read\n")
    (empty / ".git").mkdir()
    (empty / ".git" / "HEAD").write_text("in a hidden folder: not read either\n")
    err = expect_error(**{"data.source": empty, "data.dir": tmp_path / "d"})
    assert "is a directory without a (non-hidden) file" in err and "tokenizer" not in err, err


def test_init_from_without_weights_is_refused_before_the_data_are_prepared(
    expect_error, tmp_path, monkeypatch
):
    """GPT-2 weights that cannot be read (offline, not in the cache) stop the run before data.dir is
    prepared: the corpus is not tokenized for a run that cannot start."""
    import model.pretrained as pretrained

    def offline(init_from, **_):
        raise pretrained.PretrainedError(f"could not load GPT-2 weights init_from={init_from} (offline)")

    monkeypatch.setattr(pretrained, "load_gpt2", offline)
    err = expect_error(**{"init_from": "gpt2", "data.tokenizer": "gpt2", "data.dir": tmp_path / "fresh"})
    assert "could not load GPT-2 weights init_from=gpt2" in err, err
    assert not (tmp_path / "fresh").exists()


def _no_weights_read(monkeypatch):
    """``load_gpt2`` fails the test if called: the shape check needs no weights (offline they are absent)."""
    import model.pretrained as pretrained

    def read(init_from, **_):
        raise AssertionError(f"GPT-2 weights of init_from={init_from} read before the shape check")

    monkeypatch.setattr(pretrained, "load_gpt2", read)


def test_init_from_refuses_a_model_shape_set_on_the_command_line(expect_error, tmp_path, monkeypatch):
    """init_from=gpt2 model.n_layer=6 trained GPT-2's 12 layers and said nothing: now a config error naming
    each key, the value given and GPT-2's, and both ways out; before the weights or the data are read and
    before the run's files are opened."""
    _no_weights_read(monkeypatch)
    out = tmp_path / "run"
    err = expect_error(
        **{
            "init_from": "gpt2",
            "data.tokenizer": "gpt2",
            "data.dir": tmp_path / "fresh",
            "model.n_layer": 6,
            "model.n_head": 5,  # 768 / 5: the plan's divisibility check would speak of a shape never built
            "model.dropout": 0.0,  # allowed: not fixed by the weights
        }
    )
    assert "model.n_layer=6 (init_from=gpt2's: 12); model.n_head=5 (init_from=gpt2's: 12)." in err, err
    assert "Drop model.n_layer=6 model.n_head=5 to train from init_from=gpt2 in its own shape" in err, err
    assert "drop init_from=gpt2 (init_from=scratch, the default)" in err, err
    assert "dropout" not in err and "n_embd" not in err, err  # the preset's (model=tiny) keys are not named
    assert not (tmp_path / "fresh").exists()
    assert not (out / "metrics.jsonl").exists() and not (out / "train.log").exists()


def _hf_config_dir(d, **shape):
    """A Hugging Face GPT-2 checkpoint directory with its config.json only (no weights: loading it fails)."""
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", **shape}))
    return d


def test_init_from_directory_names_each_key_its_weights_fix(expect_error, tmp_path, monkeypatch):
    _no_weights_read(monkeypatch)
    d = _hf_config_dir(tmp_path / "hf", n_layer=2, n_head=2, n_embd=32, n_positions=64)  # vocab: 50257
    given = {
        "model.n_embd": 64,
        "model.vocab_size": 50304,
        "model.bias": False,
        "model.n_kv_head": 1,
        "model.pos_emb": "rope",
        "model.qk_norm": True,
    }
    err = expect_error(init_from=d, **given)
    o = f"(init_from={d}'s:"
    for shown in (
        f"model.n_embd=64 {o} 32)",
        f"model.vocab_size=50304 {o} 50257)",
        f"model.bias=false {o} true)",
        f"model.n_kv_head=1 {o} 2)",
        f"model.pos_emb=rope {o} learned)",
        f"model.qk_norm=true {o} false)",
    ):
        assert shown in err, (shown, err)
    drop = "model.n_embd=64 model.vocab_size=50304 model.bias=false model.n_kv_head=1 model.pos_emb=rope"
    assert f"Drop {drop} model.qk_norm=true to train from init_from={d}" in err, err


def test_init_from_allows_the_keys_its_weights_leave_free(expect_error, tmp_path):
    """Values equal to the checkpoint's (or null: follow it), dropout, attention and a block_size within its
    positions pass the shape check: the run gets as far as reading the weights (absent here)."""
    d = _hf_config_dir(tmp_path / "hf", n_layer=2, n_head=2, n_embd=32, n_positions=64)
    err = expect_error(
        **{
            "init_from": d,
            "model.n_layer": 2,
            "model.n_kv_head": 2,
            "model.vocab_size": None,
            "model.bias": True,
            "model.dropout": 0.1,
            "model.attn_dropout": 0.1,
            "model.block_size": 64,
            "attention": "sdpa",
        }
    )
    assert f"could not load GPT-2 weights init_from={d}" in err, err


def test_a_model_beyond_the_machine_is_refused_naming_a_shape_that_fits():
    """model.n_embd=1000000 (nn.Linear asked for 12 TB in set-up): a config error from the plan with the
    parameter count, the GiB needed and a model.n_embd that fits, which passes as typed; the analytic count
    is the built model's."""
    import re

    import torch

    from model.config import GPTConfig
    from model.gpt import GPT

    for kw in ({}, {"bias": False, "n_kv_head": 4, "qk_norm": True, "pos_emb": "rope"}):
        with torch.device("meta"):
            assert GPT(GPTConfig(**kw)).num_params(non_embedding=False) == GPTConfig(**kw).param_count()
    huge = ["experiment=cpu_tiny", "model.n_embd=1000000"]
    with pytest.raises(ConfigError) as e:
        resolve_plan(compose_cfg(huge), world_size=1, cuda_available=False)
    msg = str(e.value)
    assert "model.n_embd=1000000 model.n_layer=4 is a 48,000,438,000,000-parameter model" in msg, msg
    assert re.search(r"needs about [\d,]+ GiB .* more than this machine's [\d,]+ GiB", msg), msg
    fix = re.search(r"use (model\.n_embd=\d+)", msg).group(1)
    resolve_plan(compose_cfg(["experiment=cpu_tiny", fix]), world_size=1, cuda_available=False)
    with pytest.raises(ConfigError, match=r"use model\.n_layer=\d+ \(at model\.n_embd=128\)"):
        deep = compose_cfg(["experiment=cpu_tiny", "model.n_layer=100000"])
        resolve_plan(deep, world_size=1, cuda_available=False)


@pytest.mark.slow  # a real train.py process
def test_train_py_refuses_a_model_beyond_the_machine_and_leaves_no_folder(tmp_path):
    from tests.helpers_train import describe, run_train

    out = tmp_path / "run"
    proc = run_train(["experiment=cpu_tiny", "max_steps=3", "model.n_embd=1000000", f"out_dir={out}"])
    assert proc.returncode == 2, describe(proc)
    assert proc.stderr.startswith("config error: model.n_embd=1000000") and "Traceback" not in proc.stderr
    assert not out.exists(), list(out.rglob("*"))


def test_a_training_micro_batch_beyond_the_machine_names_the_batch_key():
    """eval.batch_size=null evaluates with the training micro-batch: a micro-batch too large for the machine
    names the batch key the user set (never the eval.batch_size they did not), says training needs it too,
    and its value passes the plan as typed."""
    import re

    big = ["experiment=cpu_tiny", "batch.tokens_per_step=268435456"]
    for key in ("batch.micro_tokens=268435456", "batch.micro_batch_size=2097152"):
        with pytest.raises(ConfigError) as e:
            resolve_plan(compose_cfg([*big, key]), world_size=1, cuda_available=False)
        msg = str(e.value)
        assert msg.startswith(key) and "eval.batch_size=2097152" not in msg and "in training" in msg, msg
        fix = re.search(rf"use ({key.split('=')[0]}=\d+) or less", msg).group(1)
        plan = resolve_plan(compose_cfg([*big, fix]), world_size=1, cuda_available=False)
        assert plan.eval_batch_size == plan.micro_batch_size
        if key.startswith("batch.micro_tokens"):
            assert int(fix.split("=")[1]) % 128 == 0


def test_a_crash_in_set_up_records_error_and_the_folder_is_not_reused(
    char_data, shakespeare_path, tmp_path, capsys, monkeypatch
):
    """An exception in set-up after the run directory exists (a bug, the model build) is raised as it is, and
    summary.json says status error (failed in set-up): a new run there is refused, not mixed into it."""
    from trainer import setup

    out = tmp_path / "run"

    def broken(st, state):
        raise RuntimeError("injected set-up failure")

    with monkeypatch.context() as m:
        m.setattr(setup, "build_model", broken)
        with pytest.raises(RuntimeError, match="injected set-up failure"):
            run_inprocess(tiny_overrides(char_data, shakespeare_path, out), out)
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "error" and s["failed_in"] == "set-up" and "injected" in s["error"], s
    before = (out / "summary.json").read_text()
    outcome = run_inprocess(tiny_overrides(char_data, shakespeare_path, out), out)
    err = capsys.readouterr().err
    assert (outcome.status, outcome.exit_code) == ("error", 2), err
    assert "failed in set-up, before its first step" in err and "injected set-up failure" in err, err
    assert (out / "summary.json").read_text() == before


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["seq_len=null"], "seq_len=null is not valid here; e.g. seq_len=1024"),
        (["max_steps=null"], "max_steps=null is not valid here; e.g. max_steps=1000"),
        (["optim.lr=null"], "optim.lr=null is not valid here; e.g. optim.lr=0.0006"),
        (["seed=null"], "seed=null is not valid here; e.g. seed=1337"),
        (["dtype=null"], "dtype=null is not valid here; e.g. dtype=auto"),
        (["model.n_layer=null"], "model.n_layer=null is not valid here; e.g. model.n_layer=12"),
        (["eval=null"], "eval=null is not valid here; e.g. eval.interval=100"),
        (
            ["~seq_len", "out_dir=x"],
            "seq_len has no value (removed with ~seq_len?); give it one, e.g. seq_len=1024",
        ),
        (["~optim.lr"], "~optim.lr: optim.lr cannot be removed; set it instead, e.g. optim.lr=0.0006"),
        (
            ["~data.max_tokens"],
            "~data.max_tokens: data.max_tokens is null already, nothing to remove; drop ~data.max_tokens, "
            "or set it, e.g. data.max_tokens=1000000000",
        ),
        (
            ["attention=null"],
            "a config group cannot be null (e.g. attention=null): name one of its options, e.g. "
            "attention=sdpa or model=gpt2 (`--help` lists every group's options)",
        ),
    ],
)
def test_a_null_or_removed_key_names_a_value_that_works(overrides, expected):
    """OmegaConf's "field 'seq_len' is not Optional" and a key removed with ~ (with out_dir given: else
    Hydra's run dir fails first, below) are worded with the schema's example, for any key."""
    from trainer.config import TrainConfig
    from trainer.fields import config_error_from

    try:
        cfg = compose_cfg(["experiment=cpu_tiny", *overrides])
    except Exception as e:  # noqa: BLE001 - a composition error: its ConfigError text
        err = config_error_from(e, TrainConfig)
    else:
        with pytest.raises(ConfigError) as e:
            resolve_plan(cfg, world_size=1, cuda_available=False)
        err = e.value
    assert str(err) == expected


def test_a_bug_inside_a_job_is_a_traceback_not_a_config_error():
    """A config key misread by the trainer's own code (inside the task function) re-raises with its
    traceback; the same error while composing (outside any job) is one config error line, exit 2."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigAttributeError

    from trainer.config import TrainConfig
    from trainer.fields import in_job, report_config_errors

    cfg = OmegaConf.structured(TrainConfig)

    def job():
        with in_job():
            return cfg.seq_lenn  # a misspelt key in the code, not in the user's config

    with pytest.raises(ConfigAttributeError):
        report_config_errors(job, TrainConfig)
    assert report_config_errors(lambda: cfg.seq_lenn, TrainConfig, say=False) == 2


def test_an_interpolation_of_a_removed_key_names_a_value_that_works():
    """~seq_len without out_dir: Hydra's run dir ${out_dir} -> runs/${run_name} cannot be resolved;
    sample.py's ~temperature: the same check as train.py's."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from tests.helpers_train import CONFIGS
    from trainer.config import TrainConfig
    from trainer.fields import config_error_from
    from trainer.infer_config import EvalConfig, SampleConfig, check_config

    with pytest.raises(Exception) as e:
        OmegaConf.to_container(OmegaConf.create({"run_name": "n${seq_len}"}), resolve=True)
    assert str(config_error_from(e.value, TrainConfig)) == (
        "seq_len has no value (removed with ~seq_len?) and run_name is made from it; give it one, e.g. "
        "seq_len=1024"
    )
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="sample", overrides=["run=x", "~temperature"])
    with pytest.raises(ConfigError, match=r"^temperature has no value \(removed with ~temperature\?\); give"):
        check_config(cfg, SampleConfig)
    with pytest.raises(Exception) as e, initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        compose(config_name="eval", overrides=["run=x", "~seed"])  # eval.py: seed's default is null
    assert str(config_error_from(e.value, EvalConfig)) == (
        "~seed: seed is null already, nothing to remove; drop ~seed, or set it, e.g. seed=1337"
    )


def test_a_removed_key_without_a_working_default_names_no_null():
    """sample.py '~run': run's default (null) is refused itself, so the message suggests no value."""
    from trainer.fields import _removed
    from trainer.infer_config import SampleConfig

    assert _removed("run", SampleConfig) == "run has no value (removed with ~run?); give it one"
    assert _removed("seed", SampleConfig).endswith("give it one, e.g. seed=1337")
