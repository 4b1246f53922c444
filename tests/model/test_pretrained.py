"""init_from: a Hugging Face GPT-2 checkpoint in our GPT gives transformers' own logits and greedy tokens.

The reference is transformers' GPT2LMHeadModel itself, on a small randomly initialised GPT-2 that the
test builds and saves (no download): same logits in float32 (1e-5) on every attention backend (flash on
Triton's CPU interpreter), and cached greedy generation equal to theirs.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.helpers_train import REPO, describe, train_env
from tests.infer_batch import run_commands

transformers = pytest.importorskip("transformers")

from model.pretrained import PretrainedError, gpt_from_pretrained, load_gpt2  # noqa: E402


def _random_gpt2(d, **shape):
    """A randomly initialised GPT2LMHeadModel of ``shape``, saved into ``d`` (save_pretrained)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1234)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, bos_token_id=0, eos_token_id=0, **shape)).eval()
    with torch.no_grad():  # biases and LayerNorms away from their 0 / 1 init, so a dropped one shows
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(d)
    return d, hf


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return _random_gpt2(
        tmp_path_factory.mktemp("hf_gpt2"), n_head=4, n_embd=64, n_positions=32, vocab_size=97
    )


@pytest.fixture(scope="module")
def hf_bpe_dir(tmp_path_factory):
    """GPT-2's vocabulary (50257), so sample.py / eval.py can read text with GPT-2's BPE."""
    return _random_gpt2(
        tmp_path_factory.mktemp("hf_gpt2_bpe"), n_head=2, n_embd=32, n_positions=64, vocab_size=50257
    )


def _need(backend, monkeypatch):
    if backend == "flash":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        kernels = pytest.importorskip("kernels")
        kernels.check_flash_available(torch.device("cpu"))


@pytest.mark.parametrize("backend", ["naive", "sdpa", "flash"])
def test_logits_equal_transformers(hf_dir, backend, monkeypatch, seed):
    _need(backend, monkeypatch)
    d, hf = hf_dir
    model = gpt_from_pretrained(str(d), attention=backend).eval()
    c = model.config
    assert (c.n_layer, c.n_head, c.n_embd, c.block_size, c.vocab_size, c.bias) == (2, 4, 64, 32, 97, True)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 97, (2, 16), generator=g)
    with torch.no_grad():
        ours, _ = model(idx)
        theirs = hf(idx).logits
    assert ours.dtype == torch.float32
    err = (ours - theirs).abs().max().item()
    assert err <= 1e-5, f"seed={seed} backend={backend}: max |diff| {err}"


@pytest.mark.parametrize("backend", ["naive", "sdpa", "flash"])
def test_cached_greedy_generation_equals_transformers(hf_dir, backend, monkeypatch, seed):
    _need(backend, monkeypatch)
    d, hf = hf_dir
    model = gpt_from_pretrained(str(d), attention=backend).eval()
    idx = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(seed))
    ours = model.generate(idx, 12, temperature=0)
    theirs = hf.generate(idx, max_new_tokens=12, do_sample=False, use_cache=True, pad_token_id=0)
    assert torch.equal(ours, theirs), f"seed={seed} backend={backend}\n{ours}\n{theirs}"


def test_bad_init_from_is_named(tmp_path):
    with pytest.raises(PretrainedError, match=r"init_from='nope'.*gpt2"):
        load_gpt2("nope")
    with pytest.raises(
        PretrainedError, match=r"init_from=scratch means no pretrained weights.*init_from=gpt2"
    ):
        load_gpt2("scratch")  # sample.py / eval.py: not "neither one of ('scratch', ...)"
    (tmp_path / "empty").mkdir()
    with pytest.raises(PretrainedError, match=r"holds no config.json") as e:
        load_gpt2(str(tmp_path / "empty"))
    assert "huggingface-cli" not in str(e.value)  # a local folder is not a hub name to download
    run = tmp_path / "runs" / "A"
    (run / "ckpt" / "step_00000008").mkdir(parents=True)
    (run / "summary.json").write_text("{}")
    for given, names in ((run, run), (run / "ckpt", run), ("resume", "<run directory>")):
        with pytest.raises(PretrainedError, match="a flashgpt run is continued with resume=true") as e:
            load_gpt2(str(given))
        assert f"resume=true out_dir={names}" in str(e.value) and f"run={names}" in str(e.value)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{}")
    with pytest.raises(PretrainedError, match=r"could not load GPT-2 weights"):
        load_gpt2(str(tmp_path / "bad"))  # a Hugging Face folder without weights


def test_offline_gpt2_without_cache_says_what_to_fetch(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(PretrainedError, match=r"(?s)openai-community/gpt2.*huggingface-cli download"):
        load_gpt2("gpt2")


def _cli(script: str, args: list[str], cwd, **env):
    return subprocess.run(
        [sys.executable, str(REPO / script), *args],
        cwd=str(cwd),
        env=train_env(**env),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow  # over 5 s on 2 cores
def test_sample_init_from_greedy_equals_transformers(hf_bpe_dir, gpt2_bpe, tmp_path):
    d, hf = hf_bpe_dir
    prompt = "The quick brown fox"
    args = [f"init_from={d}", f"prompt={prompt}", "temperature=0", "num_samples=1", "max_new_tokens=12"]
    proc = _cli("sample.py", [*args, "device=cpu", f"out={tmp_path}/s.txt"], tmp_path)
    assert proc.returncode == 0, describe(proc)
    ours = json.loads((tmp_path / "s.json").read_text())["token_ids"][0]
    ids = torch.tensor([gpt2_bpe.encode(prompt)])
    theirs = hf.generate(ids, max_new_tokens=12, do_sample=False, use_cache=True, pad_token_id=0)
    assert ours == theirs[0, ids.shape[1] :].tolist()
    printed = _cli("sample.py", [*args, "device=cpu"], tmp_path)  # no run, no out=: printed only
    assert printed.returncode == 0 and "printed only" in printed.stderr, describe(printed)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json", "s.txt"]


def _hf_val_loss(hf, data_dir) -> float:
    """transformers' mean loss over eval.py's / the trainer's val batches (3 of 2 x 32 tokens, seed 7)."""
    from data.loader import BinDataset

    losses = []
    with torch.no_grad():
        for x, y in BinDataset(data_dir, "val", 32).eval_batches(3, 2, 7):
            logits = hf(x).logits.double()
            losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item())
    return sum(losses) / len(losses)


@pytest.mark.slow  # over 5 s on 2 cores
def test_eval_init_from_loss_equals_transformers(hf_bpe_dir, gpt2_bpe, tmp_path, seed):
    from data.prepare import prepare

    d, hf = hf_bpe_dir
    words = np.random.default_rng(seed).choice(
        ["the", "cat", "sat", "on", "a", "mat", "and", "ran", "."], 4000
    )
    (tmp_path / "c.txt").write_text(" ".join(words))
    prepare(tmp_path / "c.txt", tmp_path / "data", "gpt2", workers=1, progress=False)
    args = [
        f"init_from={d}",
        f"data.dir={tmp_path}/data",
        "seq_len=32",
        "batch_size=2",
        "batches=3",
        "seed=7",
    ]
    proc = _cli("eval.py", [*args, "device=cpu", f"out={tmp_path}/e.json"], tmp_path)
    assert proc.returncode == 0, describe(proc)
    ours = json.loads((tmp_path / "e.json").read_text())
    ref = _hf_val_loss(hf, tmp_path / "data")
    assert abs(ours["loss"] - ref) < 1e-5, f"seed={seed}: eval.py {ours['loss']} vs transformers {ref}"
    assert ours["step"] == 0 and ours["checkpoint"] == str(d)


INIT_FROM_REFUSALS = [
    ("sample.py", ["init_from=gpt2"], r"(?s)openai-community/gpt2.*huggingface-cli download"),
    ("eval.py", ["init_from=gpt2", "data.dir=x"], r"(?s)openai-community/gpt2.*huggingface-cli download"),
    ("sample.py", ["init_from={d}", "run=runs/x"], r"init_from=.* and run=runs/x name two models"),
    ("sample.py", ["init_from={small}"], r"97-token vocabulary.*GPT-2's BPE"),
    ("eval.py", ["init_from={d}"], r"pass data.dir=PATH"),
    # a model shape typed with init_from was ignored (GPT-2's trained): refused, naming the checkpoint's
    (
        "train.py",
        ["init_from=gpt2", "model.n_layer=6", "model.n_embd=512"],
        r"model\.n_layer=6 \(init_from=gpt2's: 12\); model\.n_embd=512 \(init_from=gpt2's: 768\)\. Drop "
        r"model\.n_layer=6 model\.n_embd=512 .*init_from=scratch",
    ),
    (  # a run that trains once the override is dropped
        "train.py",
        ["init_from={d}", "model.n_layer=6", "experiment=cpu_tiny", "data.tokenizer=gpt2"]
        + ["data.source={corpus}", "data.dir=data", "seq_len=32", "batch.tokens_per_step=64", "max_steps=1"]
        + ["batch.micro_batch_size=2", "eval.batches=1", "eval.batch_size=2", "wandb.mode=disabled"],
        r"model\.n_layer=6 \(init_from=.*'s: 2\)\. Drop model\.n_layer=6 ",
    ),
]


@pytest.fixture(scope="module")
def init_from_refusals(hf_dir, hf_bpe_dir, tmp_path_factory):
    """Each INIT_FROM_REFUSALS command, offline (HF_HUB_OFFLINE=1, an empty HF_HOME), from its own empty
    folder, all in one process (``tests.infer_batch``)."""
    base = tmp_path_factory.mktemp("init_from_refusals")
    corpus = base / "c.txt"
    corpus.write_text(" ".join(["the cat sat on a mat and ran ."] * 400))
    cases = []
    for i, (script, args, _) in enumerate(INIT_FROM_REFUSALS):
        args = [a.format(d=hf_bpe_dir[0], small=hf_dir[0], corpus=corpus) for a in args]
        (base / str(i)).mkdir()
        cwd = str(base / str(i))
        cases.append(
            {"script": str(REPO / script), "args": [*args, "device=cpu"], "cwd": cwd, "watch": [cwd]}
        )
    env = train_env(HF_HUB_OFFLINE=1, HF_HOME=base / "hf")
    return run_commands(cases, base / "batch", env)


@pytest.mark.parametrize(
    "case", range(len(INIT_FROM_REFUSALS)), ids=[" ".join(c[1]) for c in INIT_FROM_REFUSALS]
)
def test_init_from_errors_exit_2(init_from_refusals, case):
    """Offline without weights the error names what to fetch; a model shape the weights do not fit is named
    with theirs; nothing is written."""
    import re

    proc, message = init_from_refusals[case], INIT_FROM_REFUSALS[case][2]
    assert proc.returncode == 2, describe(proc)
    assert re.search(message, proc.stderr), describe(proc)
    assert proc.after == [{}], describe(proc)


@pytest.mark.slow  # a train.py process, ~17 s on 2 cores
def test_train_init_from_starts_at_transformers_loss(hf_bpe_dir, gpt2_bpe, tmp_path, seed):
    """train.py init_from=<checkpoint dir>: the model takes the checkpoint's shape (biases on) and its
    weights, so the step-0 validation loss is transformers' loss on the same evaluation batches; resumed with
    another shape, it is refused like any run."""

    d, hf = hf_bpe_dir
    words = np.random.default_rng(seed).choice(
        ["the", "cat", "sat", "on", "a", "mat", "and", "ran", "."], 4000
    )
    (tmp_path / "c.txt").write_text(" ".join(words))
    run = tmp_path / "run"
    args = [
        "experiment=cpu_tiny",
        f"init_from={d}",
        f"data.source={tmp_path / 'c.txt'}",
        f"data.dir={tmp_path / 'data'}",
        "data.tokenizer=gpt2",
        "seq_len=32",
        "batch.tokens_per_step=64",
        "batch.micro_batch_size=2",
        "max_steps=1",
        "eval.at_start=true",
        "eval.interval=0",
        "eval.batches=3",
        "eval.batch_size=2",
        "seed=7",
        "model.dropout=0.0",
        "wandb.mode=disabled",
        f"out_dir={run}",
    ]
    proc = _cli("train.py", args, tmp_path)
    assert proc.returncode == 0, describe(proc)
    # experiment=cpu_tiny's model (model=mini) gives way to the checkpoint's, said
    note = (
        f"note: init_from={d}: the model is the checkpoint's, model.n_layer=2 model.n_head=2 "
        "model.n_embd=32, not the preset's model.n_layer=4 model.n_head=4 model.n_embd=128 "
        "(model= / experiment=)"
    )
    assert note in proc.stdout, describe(proc)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    ours = next(r["val/loss"] for r in rows if r.get("step") == 0 and "val/loss" in r)
    saved = yaml_load(run / "config.resolved.yaml")["model"]
    assert (saved["n_layer"], saved["n_head"], saved["n_embd"], saved["bias"]) == (2, 2, 32, True), saved
    ref = _hf_val_loss(hf, tmp_path / "data")
    assert abs(ours - ref) < 1e-4, f"seed={seed}: train.py step 0 {ours} vs transformers {ref}"
    # its resume takes the shape from the run (the weights from its checkpoint), not from init_from's files
    # again: another model.n_layer is refused with the run's value, no longer trained as GPT-2's shape
    args = ["resume=true", f"out_dir={run}", "max_steps=2", "model.n_layer=3", "model.n_embd=64"]
    proc = _cli("train.py", args, tmp_path)
    assert proc.returncode == 2 and "model.n_layer: 2 -> 3; model.n_embd: 32 -> 64" in proc.stderr, describe(
        proc
    )
    assert "the run's values (model.n_layer=2 model.n_embd=32)" in proc.stderr, describe(proc)


def yaml_load(path):
    import yaml

    return yaml.safe_load(path.read_text())
