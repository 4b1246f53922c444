"""bench.peer on the CPU: our tiny run, then a stand-in for nanoGPT's train.py (written here; it takes
nanoGPT's `--key=value` arguments and prints its per-iteration lines) given what that run resolved.

The stand-in checks what it was handed (the uint16 splits and meta.pkl in its data folder), records its
arguments, and prints iteration times from a seed, so the test knows the median tokens/sec to expect.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers_train import REPO, describe

FAKE_PEER = r"""
import json, os, pickle, random, sys
import numpy as np
args = dict(a[2:].split("=", 1) for a in sys.argv[1:])
data = os.path.join("data", args["dataset"])
meta = pickle.load(open(os.path.join(data, "meta.pkl"), "rb"))
train = np.fromfile(os.path.join(data, "train.bin"), dtype=np.uint16)
assert train.size > int(args["block_size"]) and train.max() < meta["vocab_size"], (train.size, meta)
json.dump(dict(args=args, vocab_size=meta["vocab_size"]), open(os.environ["FAKE_PEER_RECORD"], "w"))
if os.environ.get("FAKE_PEER_FAIL"):
    sys.exit("RuntimeError: the peer failed on purpose")
rng = random.Random(int(os.environ["FAKE_PEER_SEED"]))
for i in range(int(args["max_iters"]) + 1):
    ms = 5000.0 if i == 0 else rng.uniform(10, 90)  # iteration 0 compiles: left out by --warmup
    print(f"iter {i}: loss 4.1000, time {ms:.2f}ms, mfu 1.00%")
"""


@pytest.fixture
def fake_peer(tmp_path):
    d = tmp_path / "nanoGPT"
    d.mkdir()
    (d / "train.py").write_text(FAKE_PEER)
    (d / "model.py").write_text("")
    (d / "configurator.py").write_text("")
    return d / "train.py"


def _bench(tmp_path, peer, seed, *extra, env=None, data_args=()):
    cmd = [sys.executable, "-m", "bench.peer", "--allow-cpu", "--peer", str(peer), "--attention", "sdpa"]
    cmd += ["--seq-lens", "32", "--bias", "on", "--steps", "4", "--warmup", "1", "--out", str(tmp_path / "r")]
    cmd += ["--runs-dir", str(tmp_path / "runs"), *extra, "--", *data_args]
    env = {
        **os.environ,
        "FAKE_PEER_RECORD": str(tmp_path / "peer.json"),
        "FAKE_PEER_SEED": str(seed),
        **(env or {}),
    }
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.slow
def test_peer_gets_our_run_and_its_median_is_read(tmp_path, fake_peer, seed, char_data, shakespeare_path):
    data_args = ["model=tiny", "trainer=cpu", "data=shakespeare_char", f"data.source={shakespeare_path}"]
    data_args += [f"data.dir={char_data}", "batch.tokens_per_step=512", "batch.micro_batch_size=8"]
    proc = _bench(tmp_path, fake_peer, seed, data_args=data_args)
    assert proc.returncode == 0, describe(proc)
    cells = json.loads((tmp_path / "r.json").read_text())["cells"]
    ours, peer = cells
    assert ours["who"] == "flashgpt" and ours["status"] == "ok" and peer["status"] == "ok", cells
    # the peer was given what our run resolved: the model, the batch split, seq_len, the vocabulary
    run_cfg = next((tmp_path / "runs").glob("*/n32_bias1/config.resolved.yaml")).read_text()
    import yaml

    cfg = yaml.safe_load(run_cfg)
    got = json.loads((tmp_path / "peer.json").read_text())
    want = dict(
        n_layer=cfg["model"]["n_layer"],
        n_head=cfg["model"]["n_head"],
        n_embd=cfg["model"]["n_embd"],
        bias=True,
        block_size=32,
        batch_size=cfg["derived"]["micro_batch_size"],
        gradient_accumulation_steps=2,  # 512 tokens per step in micro-batches of 8 x 32
        max_iters=3,
        device="cpu",
        dtype="float32",
        compile=False,
    )
    assert {k: got["args"][k] for k in want} == {k: str(v) for k, v in want.items()}, got
    assert got["vocab_size"] == cfg["derived"]["vocab_size"]
    # its tokens/sec: tokens per iteration over the median time of iterations 1..3 (the seed's draws)
    rng = random.Random(seed)
    ms = sorted(round(rng.uniform(10, 90), 2) for _ in range(3))[1]
    assert peer["tokens_per_sec"] == pytest.approx(cfg["derived"]["tokens_per_step"] / (ms / 1000), rel=1e-6)
    md = (tmp_path / "r.md").read_text()
    ratio = ours["tokens_per_sec"] / peer["tokens_per_sec"]
    assert f"| 32 | on | {ours['tokens_per_sec']:,.0f} | {peer['tokens_per_sec']:,.0f} | {ratio:.3f} |" in md
    assert (tmp_path / "r.png").stat().st_size > 0
    # a peer that fails: its error is recorded, exit 1, our cell kept
    proc = _bench(tmp_path, fake_peer, seed, env={"FAKE_PEER_FAIL": "1"}, data_args=data_args)
    assert proc.returncode == 1, describe(proc)
    cells = json.loads((tmp_path / "r.json").read_text())["cells"]
    assert cells[0]["status"] == "ok" and cells[1]["status"] == "error"
    assert "failed on purpose" in cells[1]["error"]


def test_peer_that_is_not_nanogpt_is_refused(tmp_path, seed):
    lone = tmp_path / "train.py"
    lone.write_text("")
    proc = _bench(tmp_path, lone, seed)
    assert proc.returncode == 2 and "--peer" in proc.stderr and "model.py" in proc.stderr, describe(proc)
    assert not (tmp_path / "r.json").exists() and not Path(tmp_path / "runs").exists()


STAND_IN_MODEL = """
from model.gpt import GPT, GPTConfig as _Config

def GPTConfig(**kw):  # nanoGPT's GPTConfig has no attention key: this stand-in runs sdpa
    return _Config(attention="sdpa", **kw)
"""


def test_models_alone_without_cuda_is_refused(tmp_path, fake_peer):
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA")
    cmd = [sys.executable, "-m", "bench.peer", "--models", "--peer", str(fake_peer), "--seq-lens", "64"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--models" in proc.stderr and "CUDA" in proc.stderr, describe(proc)


@pytest.mark.gpu
def test_models_alone_times_and_profiles_both(tmp_path, fake_peer):
    (fake_peer.parent / "model.py").write_text(STAND_IN_MODEL)
    cmd = [sys.executable, "-m", "bench.peer", "--models", "--peer", str(fake_peer), "--seq-lens", "256"]
    cmd += ["--bias", "on", "--steps", "3", "--warmup", "1", "--top", "5"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, describe(proc)
    assert "== seq_len=256 bias=True: step ms flashgpt" in proc.stdout, describe(proc)
    for who in ("flashgpt", "peer"):
        assert f"-- {who} seq_len=256 bias=True: top kernels of one step" in proc.stdout, describe(proc)
