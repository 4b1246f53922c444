"""Several ranks on the CPU: parallel=fsdp (FSDP2 over gloo) and DDP against one process, DCP
checkpoints resumed at another world size, SIGTERM and config errors under torchrun.

Every multi-rank test launches real ``torchrun --standalone --nproc_per_node=2`` processes (gloo) on the tiny
char-level model and is marked ``slow``; the checks without a process group run in the default set. References
are independent runs: the single-process run (no process group, no FSDP, no DDP) with the same global batch
and seed. Dropout is 0 where runs of different world sizes are compared (each rank has its own dropout
stream). Tolerance: the runs differ only in the order of float32 sums (all-reduce / reduce-scatter of
gradients, accumulation over micro-batches); measured differences are about 1e-7 on losses near 4, so
``TOL = 1e-4`` (absolute, on losses and grad norms) leaves a margin of ~1000x while a wrong shard, a missed
gradient sync or a wrongly scaled accumulation moves the loss by 1e-3 or more within two steps.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers_train import (
    REPO,
    compose_cfg,
    describe,
    read_jsonl,
    run_train,
    summary,
    train_command,
    train_losses,
    val_losses,
)
from trainer import checkpoint as ckpt
from trainer.checks import ConfigError, resolve_plan
from trainer.dist import global_micro_index

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
TOL = 1e-4
STEPS = 6


def _grad_norms(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train/grad_norm"] for r in read_jsonl(run_dir) if "train/grad_norm" in r}


def _args(tiny, out: Path, **extra) -> list[str]:
    """6 steps of 1024 tokens (4 sequences of 64 per micro-batch: one process accumulates 4, each of two
    ranks 2), no dropout, 3 eval batches (odd: the two ranks' shares differ), a checkpoint every 3 steps.
    ``optim.decay_steps`` is fixed (16), so the LR schedule does not depend on max_steps."""
    base = dict(
        max_steps=STEPS,
        model__dropout=0.0,
        batch__micro_batch_size=4,
        eval__batches=3,
        eval__interval=3,
        checkpoint__interval=3,
        seed=11,
    )
    base.update(extra)
    return tiny(out, **base)


def _assert_close(got: dict, want: dict, what: str, steps=None) -> None:
    steps = sorted(want) if steps is None else steps
    assert all(s in got for s in steps), f"{what}: steps {sorted(got)}, want {steps}"
    worst = max(abs(got[s] - want[s]) for s in steps)
    assert worst <= TOL, f"{what}: largest difference {worst:.3g} > {TOL} ({got} vs {want})"


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory) -> Path:
    """The single-process run (no process group) every multi-rank run is compared with."""
    out = tmp_path_factory.mktemp("parallel") / "one_process"
    proc = run_train(_args(tiny, out))
    assert proc.returncode == 0, describe(proc)
    assert summary(out)["grad_accum"] == 4
    return out


# ------------------------------------------------------------------------------ no process group


def test_global_micro_index_is_the_same_global_batch_at_every_world_size():
    """One process with 4 micro-batches draws indices 0..3; two ranks with 2 each draw the same set."""
    one = sorted(global_micro_index(m, 4, 0, 1) for m in range(4))
    two = sorted(global_micro_index(m, 2, r, 2) for r in range(2) for m in range(2))
    assert one == two == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        global_micro_index(2, 2, 0, 2)


def test_parallel_key_choices_and_the_one_process_note():
    """parallel=fsdp without torchrun runs as one process (a note says so); unknown modes are refused."""
    plan = resolve_plan(
        compose_cfg(["experiment=cpu_tiny", "parallel=fsdp"]), world_size=1, cuda_available=False
    )
    assert plan.parallel == "fsdp"
    assert any("parallel=fsdp with one process" in n for n in plan.notes), plan.notes
    assert (
        resolve_plan(compose_cfg(["experiment=cpu_tiny"]), world_size=2, cuda_available=False).parallel
        == "ddp"
    )
    with pytest.raises(ConfigError, match=r"reduce-overhead.*2 ranks \(FSDP's gradient hooks"):
        resolve_plan(
            compose_cfg(["parallel=fsdp", "compile_mode=reduce-overhead"]), world_size=2, cuda_available=True
        )
    with pytest.raises(ConfigError, match="parallel='zero3' is not valid; choose one of: ddp, fsdp"):
        resolve_plan(
            compose_cfg(["experiment=cpu_tiny", "parallel=zero3"]), world_size=2, cuda_available=False
        )


def test_gpt2_large_and_xl_presets():
    for name, (layers, heads, width) in {"gpt2-large": (36, 20, 1280), "gpt2-xl": (48, 25, 1600)}.items():
        m = compose_cfg([f"model={name}", "parallel=fsdp"]).model
        assert (m.name, m.n_layer, m.n_head, m.n_embd) == (name, layers, heads, width)
        assert m.n_embd // m.n_head == 64


def _tiny_dcp_state():
    """A plain model + optimizer with state, saved and loaded in this process (no process group)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def test_dcp_save_is_atomic_and_loads_without_a_process_group(tmp_path, seed, monkeypatch):
    """A DCP directory loads into a fresh model and optimizer in one process; a save that fails midway
    leaves the previous checkpoint as it was and no partial step directory; keep prunes directories."""
    model, opt = _tiny_dcp_state()
    path = ckpt.save_checkpoint(model, opt, {"step": 1, "rng": []}, tmp_path, 1, keep=2)
    assert path == ckpt.ckpt_path(tmp_path, 1) and path.is_dir()
    assert ckpt.load_checkpoint(path)["path"] == str(path)

    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    ckpt.load_weights(path, fresh, fresh_opt)
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], fresh_opt.state_dict()["state"][0]["exp_avg"])

    def broken_write(path, write):  # the record's write fails after DCP wrote every shard
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "atomic_write", broken_write)
    with pytest.raises(OSError, match="No space left"):
        ckpt.save_checkpoint(model, opt, {"step": 2}, tmp_path, 2, keep=2)
    monkeypatch.undo()
    assert [p.name for _, p in ckpt.list_checkpoints(tmp_path)] == ["step_00000001"]
    assert not [p for p in ckpt.ckpt_dir(tmp_path).iterdir() if p.name.startswith(".tmp-")]

    for s in (2, 3):
        ckpt.save_checkpoint(model, opt, {"step": s}, tmp_path, s, keep=2)
    assert [p.name for _, p in ckpt.list_checkpoints(tmp_path)] == ["step_00000003", "step_00000002"]


def test_incomplete_dcp_directory_is_skipped(tmp_path):
    """A step directory without DCP's .metadata (a save killed midway by SIGKILL) does not load; the
    newest loadable checkpoint is the older one."""
    model, opt = _tiny_dcp_state()
    ckpt.save_checkpoint(model, opt, {"step": 1}, tmp_path, 1, keep=3)
    broken = ckpt.ckpt_path(tmp_path, 2)
    broken.mkdir(parents=True)
    (broken / "__0_0.distcp").write_bytes(b"partial")
    warnings: list[str] = []
    path, state = ckpt.load_newest(tmp_path, warn=warnings.append)
    assert path == ckpt.ckpt_path(tmp_path, 1) and state["step"] == 1
    assert "step_00000002 does not load" in warnings[0]


# ------------------------------------------------------------------------------ torchrun, 2 ranks


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["fsdp", "ddp"])
def test_two_ranks_match_one_process(tiny, tmp_path, reference, parallel):
    """Two gloo ranks (2 micro-batches each: gradient accumulation with the sync on the last one only)
    give the single-process run's losses, grad norms (clipping on) and val losses within TOL."""
    out = tmp_path / parallel
    proc = run_train(_args(tiny, out, parallel=parallel), launcher=TORCHRUN)
    assert proc.returncode == 0, describe(proc)
    s = summary(out)
    assert s["status"] == "ok" and s["world_size"] == 2 and s["grad_accum"] == 2
    _assert_close(train_losses(out), train_losses(reference), f"{parallel} train/loss")
    _assert_close(_grad_norms(out), _grad_norms(reference), f"{parallel} train/grad_norm")
    _assert_close(val_losses(out), val_losses(reference), f"{parallel} val/loss")
    names = sorted(p.name for p in (out / "ckpt").iterdir())
    assert names == ["step_00000003", "step_00000006"], names
    files = sorted(p.name for p in (out / "ckpt" / "step_00000006").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "flashgpt.pt"], files


@pytest.mark.slow
def test_fsdp_with_compiled_blocks_matches_one_process(tiny, tmp_path, reference):
    """compile=true under fsdp compiles each block before sharding it (Inductor on the CPU); the first two
    steps give the eager single-process losses within TOL."""
    out = tmp_path / "compiled"
    proc = run_train(_args(tiny, out, parallel="fsdp", compile="true", max_steps=2), launcher=TORCHRUN)
    assert proc.returncode == 0, describe(proc)
    assert summary(out)["compile"] is True
    _assert_close(train_losses(out), train_losses(reference), "compiled fsdp train/loss", [1, 2])
    _assert_close(val_losses(out), val_losses(reference), "compiled fsdp val/loss", [0])


def _truncate_to(src: Path, dst: Path, step: int) -> None:
    """A copy of run ``src`` as if it had stopped right after the checkpoint of ``step``."""
    shutil.copytree(src, dst)
    for s, p in ckpt.list_checkpoints(dst):
        if s > step:
            shutil.rmtree(p)
    lines = [r for r in read_jsonl(dst) if r["step"] <= step and "status" not in r]
    (dst / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    s = summary(dst)
    s.update(status="interrupted", steps=step)
    (dst / "summary.json").write_text(json.dumps(s))
    (dst / ".flashgpt.lock").unlink(missing_ok=True)


@pytest.fixture(scope="module")
def fsdp_first_half(tiny, tmp_path_factory) -> Path:
    """A 2-rank fsdp run of the first 3 steps (its step-3 DCP checkpoint is resumed below)."""
    first = tmp_path_factory.mktemp("parallel") / "fsdp_first_half"
    proc = run_train(_args(tiny, first, parallel="fsdp", max_steps=3), launcher=TORCHRUN)
    assert proc.returncode == 0, describe(proc)
    assert ckpt.ckpt_path(first, 3).is_dir()
    return first


@pytest.mark.slow
@pytest.mark.parametrize(("world", "parallel"), [(1, "fsdp"), (2, "fsdp"), (2, "ddp")])
def test_dcp_checkpoint_of_two_ranks_resumes_at_world(
    tiny, tmp_path, reference, fsdp_first_half, world, parallel
):
    """The step-3 DCP checkpoint of a 2-rank fsdp run resumes at 1 process (unsharded, no process group),
    at 2 fsdp ranks (sharded) and at 2 ddp ranks (each reads the full tensors), and steps 4-6 give the
    uninterrupted losses within TOL; eval.py reads the resumed run's final checkpoint (DCP for fsdp, a file
    for ddp) in one process and gets its last val loss."""
    out = tmp_path / f"resumed_w{world}_{parallel}"
    _truncate_to(fsdp_first_half, out, 3)
    proc = run_train(
        _args(tiny, out, parallel=parallel, resume="true"), launcher=TORCHRUN if world == 2 else None
    )
    assert proc.returncode == 0, describe(proc)
    assert f"resumed from {ckpt.ckpt_path(out, 3)} at step 3" in proc.stdout
    if world == 1:  # no torchrun: one unsharded process, said so; RNG states of 2 ranks for 1
        assert "note: parallel=fsdp with one process" in proc.stdout, proc.stdout
        assert "checkpoint has RNG states of 2 ranks, this run has 1" in proc.stdout
    s = summary(out)
    assert s["status"] == "ok" and s["steps"] == STEPS and s["world_size"] == world
    _assert_close(train_losses(out), train_losses(reference), f"world {world} train/loss", [4, 5, 6])
    _assert_close(val_losses(out), val_losses(reference), f"world {world} val/loss", [6])
    final = ckpt.ckpt_path(out, 6)
    assert final.is_dir()

    ev = subprocess.run(
        [sys.executable, str(REPO / "eval.py"), f"run={out}", "write=false"],
        cwd=str(tmp_path),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ev.returncode == 0, describe(ev)
    m = re.search(r"val loss (\d+\.\d+)", ev.stdout)
    assert m and abs(float(m.group(1)) - val_losses(out)[6]) <= 1e-4 + 5e-5, ev.stdout  # printed to 4 places


def _env() -> dict:
    from tests.helpers_train import train_env

    return train_env()


@pytest.mark.slow
def test_single_file_checkpoint_resumes_into_fsdp(tiny, tmp_path, reference):
    """A one-process (ddp default) run's single-file checkpoint continues as a 2-rank fsdp run: weights
    loaded before sharding, optimizer state by parameter name; steps 4-6 match the uninterrupted run."""
    first = tmp_path / "first"
    proc = run_train(_args(tiny, first, max_steps=3))
    assert proc.returncode == 0, describe(proc)
    out = tmp_path / "as_fsdp"
    _truncate_to(first, out, 3)
    proc = run_train(_args(tiny, out, parallel="fsdp", resume="true"), launcher=TORCHRUN)
    assert proc.returncode == 0, describe(proc)
    _assert_close(train_losses(out), train_losses(reference), "file -> fsdp train/loss", [4, 5, 6])
    assert ckpt.ckpt_path(out, 6).is_dir()


def _sigterm_once_logged(cmd, env, log: Path, text: str) -> tuple[str, str]:
    """Start ``cmd``, send it SIGTERM once ``log`` holds ``text``; its (stdout, stderr)."""
    proc = subprocess.Popen(
        cmd, cwd=str(REPO), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if log.is_file() and text in log.read_text():
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before the signal"
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_sigterm_under_fsdp_saves_one_checkpoint_and_every_rank_exits(tiny, tmp_path):
    """SIGTERM to torchrun: it forwards SIGTERM to both ranks, which agree to stop after the current
    step, write one DCP checkpoint together and exit on their own (torchrun never has to SIGKILL them);
    the run's summary says interrupted and names that checkpoint, and the printed command uses torchrun."""
    out = tmp_path / "run"
    args = _args(tiny, out, parallel="fsdp", max_steps=40, eval__interval=0, checkpoint__interval=0)
    cmd, env = train_command([*args, "fault.step_sleep_s=0.3"], TORCHRUN)
    stdout, stderr = _sigterm_once_logged(cmd, env, out / "train.log", "step      2/40 | loss")
    assert "SIGKILL" not in stderr, stderr[-3000:]  # torchrun kills ranks that outlive its 30 s grace
    s = summary(out)
    assert s["status"] == "interrupted" and s["signal"] == "SIGTERM", s
    k = s["steps"]
    assert 2 <= k < 40 and max(train_losses(out)) == k
    assert [p.name for _, p in ckpt.list_checkpoints(out)] == [f"step_{k:08d}"]
    assert ckpt.load_checkpoint(ckpt.ckpt_path(out, k))["step"] == k
    assert not [p for p in (out / "ckpt").iterdir() if p.name.startswith(".tmp-")]
    assert "torchrun --standalone --nproc_per_node=2 train.py" in s["resume_hint"]
    assert stdout.count("SIGTERM: stopped after step") == 1  # rank 0 only


@pytest.mark.slow
def test_fsdp_resume_from_step_0_matches_one_process(tiny, tmp_path, reference):
    """SIGTERM during the start-of-run evaluation of a 2-rank fsdp run: a step-0 checkpoint, whose sharded
    optimizer had not stepped; the resume's losses are the uninterrupted ones from update 2 on too (it
    loaded DCP's placeholder optimizer state before: Adam's bias correction one step off)."""
    out = tmp_path / "run"
    cmd, env = train_command([*_args(tiny, out, parallel="fsdp"), "fault.eval_sleep_s=1"], TORCHRUN)
    stdout, stderr = _sigterm_once_logged(cmd, env, out / "train.log", "flashgpt:")  # evaluation next
    assert "stopped after step 0" in stdout, stdout + stderr[-3000:]
    resumed = run_train(_args(tiny, out, parallel="fsdp", resume="true"), launcher=TORCHRUN)
    assert resumed.returncode == 0, describe(resumed)
    _assert_close(train_losses(out), train_losses(reference), "step 0 -> fsdp train/loss")


@pytest.mark.slow
@pytest.mark.parametrize("bad", ["batch.tokens_per_step=1000", "sq_len=64"])
def test_config_error_under_torchrun(tiny, tmp_path, bad):
    """A trainer check (tokens_per_step) and a composition error (unknown key): one ``config error`` line
    (rank 0), no worker traceback, and both ranks exit 2 (none is SIGTERMed by torchrun first)."""
    proc = run_train([*tiny(tmp_path / "run", max_steps=2), bad], launcher=TORCHRUN, timeout=120)
    assert proc.stderr.count("config error: ") == 1, describe(proc)
    assert bad.split("=")[0] in proc.stderr
    assert proc.stderr.count("exitcode  : 2") == 2, describe(proc)  # torchrun's table: every rank
    assert "exitcode  : -15" not in proc.stderr
    for ours in ("train.py", "trainer", "model", "kernels", "data"):  # no traceback through our code
        assert 'File "' + str(REPO / ours) not in proc.stderr, describe(proc)  # (torchrun's own is there)


@pytest.mark.slow
def test_busy_run_dir_under_torchrun_stops_every_rank(tiny, tmp_path):
    """A check only rank 0 makes (its run directory's lock, held here by another process): rank 1 hears
    rank 0's verdict instead of waiting for it in init_process_group; one config error line, both ranks
    exit 2, and rank 0's record of the directory is not touched."""
    from trainer import rundir

    out = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; sys.path.insert(0, sys.argv[1]); from trainer import rundir; "
            "from pathlib import Path; rundir.claim_run_dir(Path(sys.argv[2]), is_main=True); "
            "print('locked', flush=True); time.sleep(120)",
            str(REPO),
            str(out),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        t0 = time.monotonic()
        proc = run_train(tiny(out, max_steps=2), launcher=TORCHRUN, timeout=120)
        took = time.monotonic() - t0
    finally:
        holder.kill()
        holder.wait()
    assert proc.stderr.count("config error: ") == 1 and "in use by another live train.py" in proc.stderr, (
        describe(proc)
    )
    assert proc.stderr.count("exitcode  : 2") == 2, describe(proc)
    assert took < 60, f"took {took:.0f} s: rank 1 waited for rank 0 instead of hearing its verdict"
    assert not (out / "summary.json").exists() and rundir.LOCK_NAME in {p.name for p in out.iterdir()}
