"""Unit tests of the trainer helpers: LR schedule, atomic checkpoints, RNG state, signals, W&B mode,
the offline W&B reader (on files written by an independent writer below), and parity logging."""

from __future__ import annotations

import math
import os
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch.distributed.checkpoint.state_dict import get_state_dict

from model.gpt import GPT, GPTConfig
from tests.helpers_train import REPO
from tests.wandb_offline import (
    WandbFileError,
    WandbFileIncomplete,
    read_offline_run,
    read_wandb_file,
    run_file_finished,
    wait_run_file_finished,
)
from trainer import checkpoint as ckpt
from trainer import loop
from trainer.dist import DistInfo
from trainer.gpu_busy import GpuBusy
from trainer.metrics import resolve_wandb_mode
from trainer.schedule import lr_at
from trainer.signals import PreemptionHandler
from trainer.state import RunState

# ------------------------------------------------------------------------------------------ LR


def test_lr_schedule_warmup_then_cosine():
    o = OmegaConf.create({"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 10, "decay_steps": None})
    assert lr_at(1, o, 110) == pytest.approx(1e-4)
    assert lr_at(10, o, 110) == pytest.approx(1e-3)
    mid = 10 + 50  # half-way through the 100 decay steps: cos(pi/2) = 0
    assert lr_at(mid, o, 110) == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4))
    assert lr_at(110, o, 110) == pytest.approx(1e-4) and lr_at(500, o, 110) == pytest.approx(1e-4)
    lrs = [lr_at(s, o, 110) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))
    o2 = OmegaConf.create({"lr": 1.0, "min_lr": 0.0, "warmup_steps": 0, "decay_steps": 4})
    assert [lr_at(s, o2, 100) for s in range(1, 5)] == pytest.approx(
        [0.5 * (1 + math.cos(math.pi * s / 4)) for s in range(1, 5)]
    )


# ------------------------------------------------------------------------------------------ checkpoints


def _model(step: int, seed: int):
    g = torch.Generator().manual_seed(seed + step)
    model = torch.nn.Linear(16, 16, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.randn(16, 16, generator=g))
    return model, torch.optim.AdamW(model.parameters())


def _save(tmp_path, step: int, seed: int, keep: int):
    model, opt = _model(step, seed)
    return ckpt.save_checkpoint(model, opt, {"step": step, "rng": []}, tmp_path, step, keep=keep)


def _weights(path, seed: int) -> torch.Tensor:
    model, opt = _model(999, seed)
    ckpt.load_weights(path, model, opt)
    return model.weight.detach()


def _tiny_gpt(seed: int):
    """A small GPT and the trainer's optimizer (fused AdamW, two groups), its weights from ``seed``."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=2, n_embd=16))
    return model, model.configure_optimizers(0.1, 1e-2, (0.9, 0.95), "cpu")


def _train(model, opt, seed: int, steps: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 16, (2, 8), generator=g)
        model(x, x)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("older_save", [False, True])
def test_resume_from_step_0_trains_as_an_uninterrupted_run(tmp_path, seed, older_save):
    """A step-0 checkpoint (a stop during the start-of-run evaluation) resumes into the same updates as no
    checkpoint, float-equal. Its optimizer had not stepped: DCP's get_state_dict gives such an optimizer
    placeholder state (step 1, zero moments), which loaded in its place put Adam's bias correction one step
    off. Older saves wrote that placeholder (``older_save``): a step-0 load leaves it out."""
    expected = _train(*_tiny_gpt(seed), seed)
    model, opt = _tiny_gpt(seed)
    if older_save:
        get_state_dict(model, opt)  # what save_checkpoint did first: the placeholder state, in opt
    path = ckpt.save_checkpoint(model, opt, {"step": 0, "rng": []}, tmp_path, 0, keep=2)
    fresh, fresh_opt = _tiny_gpt(seed + 1)  # other weights: the load sets every one
    ckpt.load_weights(path, fresh, fresh_opt)
    got = _train(fresh, fresh_opt, seed)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert bool(opt.state) == older_save  # the save leaves an optimizer that has not stepped as it was


def test_save_keeps_newest_n(tmp_path, seed):
    for step in range(1, 6):
        _save(tmp_path, step, seed, keep=2)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [5, 4]
    path, state = ckpt.load_newest(tmp_path)
    assert path.name == "step_00000005" and state["step"] == 5 and state["path"] == str(path)
    assert torch.equal(_weights(path, seed), _model(5, seed)[0].weight.detach())
    assert not list((tmp_path / "ckpt").glob(".*tmp*"))


def test_interrupted_save_leaves_previous_checkpoint_intact(tmp_path, monkeypatch, seed):
    """A save that fails after DCP wrote the shards (the record's write: a full disk) leaves no temp
    directory and the previous checkpoint as it was."""
    first = _save(tmp_path, 1, seed, keep=3)
    before = {p.name: p.read_bytes() for p in first.iterdir()}

    def dies_midway(path, write):
        with open(path, "wb") as f:
            f.write(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "atomic_write", dies_midway)
    with pytest.raises(OSError, match="No space left"):
        _save(tmp_path, 2, seed, keep=1)
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_00000001"]  # no temp dir left
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before
    path, state = ckpt.load_newest(tmp_path)
    assert state["step"] == 1 and torch.equal(_weights(path, seed), _model(1, seed)[0].weight.detach())


def test_load_newest_skips_a_corrupt_checkpoint(tmp_path, seed):
    good = _save(tmp_path, 3, seed, keep=5)
    bad = ckpt.ckpt_path(tmp_path, 7)
    shutil.copytree(good, bad)
    record = (bad / ckpt.RECORD).read_bytes()
    (bad / ckpt.RECORD).write_bytes(record[: len(record) // 3])  # e.g. copied half-way
    warnings = []
    path, state = ckpt.load_newest(tmp_path, warn=warnings.append)
    assert path.name == "step_00000003" and state["step"] == 3
    assert len(warnings) == 1 and "step_00000007 does not load" in warnings[0]
    assert ckpt.load_newest(tmp_path / "nothing") == (None, None)


def test_rng_state_round_trip_is_loadable_weights_only(tmp_path, seed):
    import random

    import numpy as np

    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)
    state = ckpt.rng_state()
    torch.save({"rng": state}, tmp_path / "r.pt")
    first = (torch.rand(5), np.random.rand(3), random.random())
    ckpt.set_rng_state(torch.load(tmp_path / "r.pt", weights_only=True)["rng"])
    again = (torch.rand(5), np.random.rand(3), random.random())
    assert torch.equal(first[0], again[0]) and (first[1] == again[1]).all() and first[2] == again[2]


# ------------------------------------------------------------------------------------------ signals


def test_first_signal_sets_the_flag():
    handler = PreemptionHandler(verbose=False).install()
    try:
        assert handler.signum is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert handler.signum == signal.SIGTERM
    finally:
        handler.uninstall()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_second_signal_exits_at_once():
    code = textwrap.dedent(
        """
        import os, signal, time
        from trainer.signals import PreemptionHandler
        h = PreemptionHandler().install()
        os.kill(os.getpid(), signal.SIGINT)
        assert h.signum == signal.SIGINT
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr
    assert "SIGINT received" in proc.stderr and "second signal (SIGINT): exiting now" in proc.stderr


# ------------------------------------------------------------------------------------------ W&B mode


def test_wandb_mode_auto(monkeypatch, tmp_path):
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert resolve_wandb_mode("auto") == "offline"
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password abc123\n")
    (tmp_path / "netrc").chmod(0o600)
    assert resolve_wandb_mode("auto") == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert resolve_wandb_mode("auto") == "disabled"
    assert resolve_wandb_mode("offline") == "offline"


# ------------------------------------------------------------------------------------------ W&B reader


def _write_leveldb_log(path, records: list[bytes], block: int = 32768) -> None:
    """Independent writer of the LevelDB log format (header ':W&B' 0xBEE1 v0; chunks split at blocks)."""
    out = bytearray(b":W&B" + struct.pack("<HB", 0xBEE1, 0))
    for data in records:
        first = True
        while True:
            left = block - len(out) % block
            if left < 7:
                out += b"\0" * left
                left = block
            n = min(len(data), left - 7)
            chunk, data = data[:n], data[n:]
            kind = (1 if not data else 2) if first else (4 if not data else 3)
            crc = zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF
            out += struct.pack("<IHB", crc, len(chunk), kind) + chunk
            first = False
            if not data:
                break
    path.write_bytes(bytes(out))


def _records(seed: int) -> tuple[list[bytes], list[float]]:
    import json
    import random

    from wandb.proto import wandb_internal_pb2 as pb

    rng = random.Random(seed)
    run = pb.Record()
    run.run.run_id = "abcd1234"
    run.run.run_group = "g"
    item = run.run.config.update.add()
    item.key, item.value_json = "attention", json.dumps({"name": "sdpa"})
    recs, losses = [run.SerializeToString()], []
    for step in range(200):
        r = pb.Record()
        loss = rng.uniform(1, 5)
        losses.append(loss)
        for key, value in (("train/loss", loss), ("_step", step), ("note", "x" * rng.randint(0, 400))):
            it = r.history.item.add()
            it.nested_key.append(key)
            it.value_json = json.dumps(value)
        recs.append(r.SerializeToString())
    big = pb.Record()  # one record spanning three blocks (FIRST, MIDDLE, LAST chunks)
    s = big.summary.update.add()
    s.key, s.value_json = "blob", json.dumps("y" * 70000)
    s = big.summary.update.add()
    s.key, s.value_json = "status", json.dumps("ok")
    recs.append(big.SerializeToString())
    return recs, losses


def test_reader_parses_records_across_blocks(tmp_path, seed):
    recs, losses = _records(seed)
    f = tmp_path / "run-abcd1234.wandb"
    _write_leveldb_log(f, recs)
    assert f.stat().st_size > 3 * 32768
    run = read_offline_run(f, wait_s=0)
    assert run["run_id"] == "abcd1234" and run["group"] == "g"
    assert run["config"] == {"attention": {"name": "sdpa"}}
    assert [h["_step"] for h in run["history"]] == list(range(200))
    assert [h["train/loss"] for h in run["history"]] == losses
    assert run["summary"]["status"] == "ok" and len(run["summary"]["blob"]) == 70000
    # a run killed mid-write: the truncated last record is dropped, the rest reads
    f.write_bytes(f.read_bytes()[:-1000])
    assert len(read_offline_run(f, wait_s=0)["history"]) == 200


def test_reader_rejects_bad_header_and_checksum(tmp_path, seed):
    recs, _ = _records(seed)
    f = tmp_path / "run-x.wandb"
    _write_leveldb_log(f, recs[:3])
    raw = bytearray(f.read_bytes())
    raw[20] ^= 0xFF
    f.write_bytes(bytes(raw))
    with pytest.raises(WandbFileError, match="checksum mismatch"):
        read_offline_run(f, wait_s=0)
    f.write_bytes(b"PK\x03\x04" + bytes(raw[4:]))
    with pytest.raises(WandbFileError, match="not a W&B run file"):
        read_offline_run(f, wait_s=0)
    with pytest.raises(FileNotFoundError, match="no W&B run file"):
        read_offline_run(tmp_path / "empty_dir_that_does_not_exist")


def _exit_record() -> bytes:
    from wandb.proto import wandb_internal_pb2 as pb

    r = pb.Record()
    r.exit.exit_code = 0
    return r.SerializeToString()


def test_wandb_reader_refuses_a_file_without_its_run_record(tmp_path, seed):
    """A .wandb file cut before its run record is complete (what a reader finds while wandb-core still
    buffers the run, or after a kill before it flushed): read_offline_run raises WandbFileIncomplete instead
    of returning a run with run_id "". read_wandb_file (one file, low level) still reads it as empty."""
    recs, _ = _records(seed)
    whole = tmp_path / "whole.wandb"
    _write_leveldb_log(whole, recs)
    data = whole.read_bytes()
    for cut in (7, 7 + 7 + len(recs[0]) // 2):  # the header only; the run record's chunk cut in half
        f = tmp_path / f"run-cut{cut}.wandb"
        f.write_bytes(data[:cut])
        assert read_wandb_file(f)["run_id"] == "" and read_wandb_file(f)["history"] == []
        with pytest.raises(WandbFileIncomplete, match=f"no run record in it yet \\({cut} bytes\\)"):
            read_offline_run(f, wait_s=0)
        assert issubclass(WandbFileIncomplete, WandbFileError)
    # a run directory: the newest file decides; an older file without a run record (killed) is skipped
    run_dir = tmp_path / "run"
    older = run_dir / "wandb" / "offline-run-20250101_000000-abcd1234" / "run-abcd1234.wandb"
    newer = run_dir / "wandb" / "offline-run-20250101_000001-abcd1234" / "run-abcd1234.wandb"
    older.parent.mkdir(parents=True)
    newer.parent.mkdir(parents=True)
    older.write_bytes(data[:7])
    newer.write_bytes(data)
    assert read_offline_run(run_dir, wait_s=0)["run_id"] == "abcd1234"
    older.write_bytes(data)
    newer.write_bytes(data[:7])
    with pytest.raises(WandbFileIncomplete, match="offline-run-20250101_000001-abcd1234"):
        read_offline_run(run_dir, wait_s=0)


def test_wandb_run_file_finished_waits_for_the_exit_record(tmp_path, seed):
    """run_file_finished: True once the exit record is in the file (wandb-core has written the run out);
    wait_run_file_finished polls for it, bounded."""
    import threading
    import time

    recs, _ = _records(seed)
    f = tmp_path / "run-abcd1234.wandb"
    assert not run_file_finished(f)  # no file
    _write_leveldb_log(f, recs)
    assert not run_file_finished(f)  # a live run: no exit record yet
    _write_leveldb_log(f, [*recs, _exit_record()])
    whole = f.read_bytes()
    assert run_file_finished(f)
    f.write_bytes(whole[:-2])  # the exit record's chunk half written
    assert not run_file_finished(f)
    t0 = time.monotonic()
    assert not wait_run_file_finished(f, timeout=0.2)
    assert 0.2 <= time.monotonic() - t0 < 2
    later = threading.Timer(0.3, f.write_bytes, [whole])
    later.start()
    try:
        assert wait_run_file_finished(f, timeout=30)
        assert f.read_bytes() == whole
    finally:
        later.join()


# ------------------------------------------------------------------------------------------ parity


def _parity_state(model, ref: str, monkeypatch) -> RunState:
    """A RunState with just what ``loop.parity`` uses (CPU, float32), around ``model``."""
    cfg = OmegaConf.create({"parity": {"reference": ref}, "seq_len": 32})
    st = RunState(cfg, None, DistInfo(), Path("."), raw_model=model, gpu_busy=GpuBusy(0, 0, enabled=False))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, model.config.vocab_size, (2, 32), generator=g)
    monkeypatch.setattr(loop, "batch", lambda st, s, micro: (x, torch.roll(x, -1, dims=1)))
    return st


def test_parity_small_diff_and_skip_on_oom(seed, monkeypatch):
    from model import GPT, GPTConfig

    torch.manual_seed(seed)
    model = GPT(GPTConfig(block_size=32, vocab_size=64, n_layer=2, n_head=2, n_embd=32, attention="sdpa"))
    t = _parity_state(model, "naive", monkeypatch)
    out = loop.parity(t, 4)
    assert out["parity/reference"] == "naive" and "parity/skipped" not in out
    assert 0 <= out["parity/loss_abs_diff"] < 1e-5 and 0 <= out["parity/logits_max_abs_diff"] < 1e-4
    assert model.training and model.attention_backend == "sdpa"

    def oom(*a, **k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")

    monkeypatch.setattr(model, "use_attention_backend", oom)
    out = loop.parity(t, 8)
    assert set(out) == {"parity/reference", "parity/skipped"}
    assert out["parity/skipped"].startswith("out of memory in the naive reference at seq_len=32")
    assert model.training and model.attention_backend == "sdpa"


def test_resume_command_keeps_interpreter_env(monkeypatch, tmp_path):
    """The printed resume command must run as printed: flash on a CPU needs TRITON_INTERPRET=1 too."""
    from types import SimpleNamespace

    from trainer.endings import resume_command

    run = SimpleNamespace(
        overrides=["experiment=cpu_tiny", "attention=flash", "resume=false", "out_dir=old"],
        out_dir=tmp_path / "run",
    )
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert resume_command(run) == (
        f"python train.py experiment=cpu_tiny attention=flash resume=true out_dir={tmp_path / 'run'}"
    )
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resume_command(run).startswith("TRITON_INTERPRET=1 python train.py experiment=cpu_tiny")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert resume_command(run).startswith("python train.py")


def test_resume_and_restart_commands_keep_each_override_one_shell_word(monkeypatch, tmp_path):
    """An override with a space (data.dir=data/my data, quoted when launched) stays one word of the printed
    commands, as the shell splits them; the restart command drops resume and out_dir."""
    import shlex
    from types import SimpleNamespace

    from trainer.endings import resume_command

    given = ["experiment=cpu_tiny", "data.dir=data/my data", "wandb.tags=[a,b]", "out_dir=runs/sp ace"]
    run = SimpleNamespace(overrides=given, out_dir=tmp_path / "sp ace")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    words = shlex.split(resume_command(run))
    assert words[:2] == ["python", "train.py"] and words[2:5] == given[:3], words
    assert words[5:] == ["resume=true", f"out_dir='{tmp_path / 'sp ace'}'"], words
    assert shlex.split(resume_command(run, resume=False)) == ["python", "train.py", *given[:3]]


def test_discard_refused_run_takes_back_only_what_the_run_created(tmp_path):
    """rundir.discard_refused_run (a config error writes nothing): what set-up made in a new directory (the
    lock, an empty metrics.jsonl; Hydra writes nothing there) goes, with the empty folders above it that did
    not exist; a folder that existed keeps what it held; anything else new (W&B files, logged metrics)
    leaves the directory as it is (returns False); a directory Hydra's OutDirCheck never noted is not
    touched."""
    from trainer import rundir

    def refused_run(d):
        d.mkdir(parents=True, exist_ok=True)
        for name in (rundir.LOCK_NAME, "metrics.jsonl"):
            (d / name).write_text("" if name == "metrics.jsonl" else "line\n")

    (tmp_path / "runs").mkdir()
    new = tmp_path / "runs" / "a" / "b"
    rundir.note_run_dir_before(new)
    refused_run(new)
    assert rundir.discard_refused_run(new)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"] and not any((tmp_path / "runs").iterdir())

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    (mine / "train.log").write_text("an earlier log\n")
    rundir.note_run_dir_before(mine)
    refused_run(mine)
    assert rundir.discard_refused_run(mine)
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt", "train.log"]
    assert (mine / "train.log").read_text() == "an earlier log\n"

    more = tmp_path / "more"
    rundir.note_run_dir_before(more)
    refused_run(more)
    (more / "wandb").mkdir()
    (more / "metrics.jsonl").write_text('{"step": 1}\n')
    assert not rundir.discard_refused_run(more)
    assert sorted(p.name for p in more.iterdir()) == sorted([rundir.LOCK_NAME, "metrics.jsonl", "wandb"])

    unnoted = tmp_path / "unnoted"
    refused_run(unnoted)
    assert not rundir.discard_refused_run(unnoted) and (unnoted / rundir.LOCK_NAME).is_file()


def test_take_batch_uses_a_prefetched_batch_once(monkeypatch):
    """The batch prefetched for (step, micro) is used for exactly that (step, micro), once; anything else
    (a resume, a parity batch, a stop between steps) draws its batch afresh."""
    t = RunState(None, None, DistInfo(), Path("."))
    calls = []
    monkeypatch.setattr(loop, "batch", lambda st, s, m: calls.append((s, m)) or ("fresh", s, m))
    t.prefetched = ((5, 0), ("prefetched", 5, 0))
    assert loop.take_batch(t, 4, 0) == ("fresh", 4, 0) and t.prefetched is None  # stale: dropped
    t.prefetched = ((5, 0), ("prefetched", 5, 0))
    assert loop.take_batch(t, 5, 0) == ("prefetched", 5, 0)
    assert loop.take_batch(t, 5, 0) == ("fresh", 5, 0)
    assert calls == [(4, 0), (5, 0)]


@pytest.mark.parametrize("fsdp", [False, True], ids=["device_check", "host_check"])
def test_a_nonfinite_update_leaves_weights_and_optimizer_state_as_they_were(seed, fsdp):
    """``step_unless_nonfinite`` with the trainer's fused AdamW: a finite update steps as a single-tensor
    AdamW (the reference) does; a NaN loss or an infinite grad norm leaves the weights, both moments and the
    step count bitwise as they were, and the next finite update is the reference's next step. The
    device-side check (fused AdamW's found_inf) and the host-side one (FSDP2) alike."""
    import copy
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Linear(8, 8)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    st = SimpleNamespace(optimizer=opt, fsdp=fsdp)

    def snapshot():
        state = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
        return [p.detach().clone() for p in model.parameters()], state

    for bad in (None, "loss", "norm", None, "both", None):
        grads = [torch.randn(p.shape, generator=g) for p in model.parameters()]
        for p, q, gr in zip(model.parameters(), ref.parameters(), grads, strict=True):
            p.grad, q.grad = gr.clone(), gr.clone()
        loss, norm = torch.rand((), generator=g) + 1, torch.rand((), generator=g) + 1
        if bad in ("loss", "both"):
            loss = torch.tensor(math.nan)
        if bad in ("norm", "both"):
            norm = torch.tensor(math.inf)
        before = snapshot()
        *got, finite = loop.step_unless_nonfinite(st, loss, norm)
        assert finite == (not bad) and (bad or got == [loss.item(), norm.item()])
        if bad:
            after = snapshot()
            assert all(torch.equal(a, b) for a, b in zip(before[0], after[0], strict=True)), bad
            for sa, sb in zip(before[1], after[1], strict=True):
                assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), bad
            continue
        ref_opt.step()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert [int(opt.state[p]["step"]) for p in model.parameters()] == [
            int(ref_opt.state[q]["step"]) for q in ref.parameters()
        ]
    assert not hasattr(opt, "found_inf")  # nothing left on the optimizer for its state_dict or a GradScaler


def test_a_half_written_last_line_stays_apart_from_the_next_record(tmp_path, seed):
    """A run killed mid-write leaves metrics.jsonl (or train.log) without its last newline; the next record
    (a resume's) starts a line of its own: the half stays one unparsable line and every whole record parses.
    It used to be glued onto the half, both lost as one bad line. The cut is random from the test's seed."""
    import random

    from trainer.metrics import RunLogger, append_line, read_metric_lines

    first = RunLogger(tmp_path)
    for s in range(1, 4):
        first.log(s, {"train/loss": 1.0 / s}, wandb_too=False)
    first.close()
    path = tmp_path / "metrics.jsonl"
    text = path.read_bytes()
    last = len(text.splitlines()[-1])
    cut = random.Random(seed).randint(
        1, last
    )  # 1: its newline only (the line is whole), up to all but a byte
    path.write_bytes(text[:-cut])
    second = RunLogger(tmp_path)
    second.log(3, {"train/loss": 0.5}, wandb_too=False)
    second.close()
    rows = [r for r, _ in read_metric_lines(tmp_path)]
    want = [1, 2, 3 if cut == 1 else None, 3]
    assert [r and r["step"] for r in rows] == want, f"seed={seed} cut={cut}: {rows}"
    log = tmp_path / "train.log"
    log.write_text("step 1\nstep 2 lo")
    append_line(log, "resumed")
    assert log.read_text() == "step 1\nstep 2 lo\nresumed\n"


def test_gpu_busy_window_with_a_failing_step_reports_nothing(tmp_path):
    """A step that raises inside the profiling window (its kernels ran, its wall time is never added) drops
    the window: no busy figure at all rather than an inflated one, and no later window opens."""
    busy = GpuBusy(skip=0, steps=3, enabled=True, trace_dir=tmp_path)
    with busy.step(0, 1):
        pass
    assert busy.add_wall(0.01)
    with pytest.raises(RuntimeError, match="boom"), busy.step(1, 2):
        raise RuntimeError("boom")
    assert busy.summary() == {} and not busy.active
    with busy.step(2, 3):
        pass
    assert not busy.active and busy.add_wall(0.01) is False


def test_device_busy_time_is_the_union_of_device_events(seed):
    """GPU time of a profiled window: device events only, user annotations left out, overlapping kernels
    counted once (events built by hand with torch's FunctionEvent; random spans from the test's seed)."""
    import random

    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    from trainer.gpu_busy import device_busy_us

    rng = random.Random(seed)

    def ev(i, start, end, device=DeviceType.CUDA, annotation=False):
        return FunctionEvent(
            id=i,
            name=f"e{i}",
            thread=0,
            start_us=start,
            end_us=end,
            device_type=device,
            is_user_annotation=annotation,
        )

    spans = [(s, s + rng.uniform(1, 50)) for s in sorted(rng.uniform(0, 500) for _ in range(30))]
    events = [ev(i, a, b) for i, (a, b) in enumerate(spans)]
    events += [ev(100, 0, 600, DeviceType.CPU), ev(101, -50, 700, annotation=True)]  # host op, annotation
    covered = [False] * 60000  # reference: 0.01 µs cells marked by any kernel
    for a, b in spans:
        for c in range(round(a * 100), round(b * 100)):
            covered[c] = True
    want = sum(covered) / 100
    got = device_busy_us(rng.sample(events, len(events)))
    assert abs(got - want) < 0.02 * 30, f"seed={seed}: {got} vs {want}"
    assert got <= max(b for _, b in spans) - spans[0][0] + 1e-9, f"seed={seed}"


def test_gpu_busy_window_ends_before_other_work_and_names_its_trace(tmp_path):
    """GpuBusy profiles the steps of its window; close() (called before an evaluation, a parity check or a
    checkpoint) ends it early with the steps done so far and no later window opens; the trace is named by
    the global steps it holds. (On the CPU the profiler records no device time: only the bookkeeping.)"""
    busy = GpuBusy(skip=1, steps=3, enabled=True, trace_dir=tmp_path)
    profiled, told = [], []
    for done, step in enumerate(range(11, 17)):  # a resumed run: global steps 11.., this process's 0..
        with busy.step(done, step):
            torch.ones(4).sum()
        profiled.append(busy.active)
        told.append(busy.add_wall(0.01))
        if step == 13:
            busy.close()  # e.g. an evaluation after step 13
    assert profiled == [False, True, True, False, False, False]
    assert told == profiled  # what the trainer leaves out of the tokens/sec median
    (tmp_path / "whole").mkdir()  # a window that ends by itself at its last step (CPU: host activity)
    whole = GpuBusy(skip=0, steps=2, enabled=True, trace_dir=tmp_path / "whole")
    for done in range(3):
        with whole.step(done, done + 1):
            pass
        told_whole = whole.add_wall(0.01)
        assert told_whole == (done < 2), f"step {done + 1}: add_wall said {told_whole}"
    assert [p.name for p in tmp_path.glob("trace_*")] == ["trace_step12-13.json.gz"]
    s = busy.summary()
    assert s["perf/profiled_steps"] == 2 and s["perf/gpu_busy"] >= 0.0
    (tmp_path / "idle").mkdir()
    idle = GpuBusy(skip=0, steps=2, enabled=True, trace_dir=tmp_path / "idle")  # CPU: host activity only
    idle.close()  # nothing open yet: the window is still to come
    with idle.step(0, 1):
        pass
    assert idle.active
    idle.close()  # a profiler left open crashes the interpreter at exit (CPU torch 2.13: SIGSEGV)


def test_trainer_import_graph_has_no_circle():
    """trainer/ modules import each other without a circle (module- and function-level imports)."""
    import ast

    graph = {}
    for path in (REPO / "trainer").glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "trainer":
                parts = node.module.split(".")
                deps |= {parts[1]} if len(parts) > 1 else {a.name for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name.split(".")[1] for a in node.names if a.name.startswith("trainer.")}
        graph[path.stem] = deps - {path.stem}
    done, stack = set(), []

    def visit(m):
        assert m not in stack, f"import circle: {' -> '.join(stack[stack.index(m) :] + [m])}"
        if m in done or m not in graph:
            return
        stack.append(m)
        for d in sorted(graph[m]):
            visit(d)
        stack.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)
    assert {"loop", "setup", "endings", "checkpoint", "rundir", "state"} <= done


@pytest.mark.parametrize(
    "path", ["runs/a_1", "/x/multirun/1_sdpa_n128_qk_norm=False", "/x/my run [2]", "~/r"]
)
def test_resume_command_out_dir_parses_back_as_typed(path):
    """The out_dir= of a printed resume command is one shell word that Hydra parses back to the path (a
    sweep job folder with '=' in its name, spaces, brackets): a command that works as typed."""
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from trainer.endings import hydra_arg

    (word,) = shlex.split(hydra_arg("out_dir", path))
    (override,) = OverridesParser.create().parse_overrides([word])
    assert override.key_or_group == "out_dir" and override.value() == path


def test_an_unknown_key_points_to_the_lister_of_its_own_script():
    """sample.py / eval.py keys are listed by trainer.infer_config, train.py's by trainer.config."""
    from trainer.config import TrainConfig
    from trainer.fields import unknown_key
    from trainer.infer_config import EvalConfig, SampleConfig

    assert "`python -m trainer.infer_config sample` lists" in unknown_key("data.dir", SampleConfig)
    assert "`python -m trainer.infer_config eval` lists" in unknown_key("foo.bar", EvalConfig)
    assert "`python -m trainer.config` lists" in unknown_key("foo.bar", TrainConfig)
