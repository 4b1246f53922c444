"""How a run ends: the final summary, and the endings by signal (checkpoint, resume hint), non-finite loss,
a checkpoint that cannot be written, a full disk and CUDA out of memory; ``report_config_error`` and
``report_disk_full`` for runs refused before set-up. Plain functions of a ``RunState``."""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer import checkpoint as ckpt
from trainer import rundir
from trainer.checkpoint import MIB
from trainer.checks import ConfigError
from trainer.metrics import DiskFullError, disk_full_in, first_line, write_json_atomic
from trainer.state import GIB

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2


class NonFiniteError(Exception):
    """Loss or gradient norm not finite at ``step`` with nonfinite=stop."""

    def __init__(self, step: int, loss: float, grad_norm: float) -> None:
        super().__init__(f"non-finite loss/grad norm at step {step}: loss={loss}, grad_norm={grad_norm}")
        self.step, self.loss, self.grad_norm = step, loss, grad_norm


@dataclass
class Outcome:
    """How a run ended; ``taken_dir``: a new run refused because its directory already holds a run."""

    status: str
    exit_code: int
    taken_dir: str | None = None


def final_figures(st) -> dict:
    """The run's final figures; {} when they cannot be read (reporting never hides the real ending)."""
    try:
        out = {
            "steps": st.step,
            "final/train_loss": st.last_train_loss,
            "final/val_loss": st.last_val_loss,
            "final/val_step": st.last_val_step,  # 0 is the untrained model's (eval.at_start)
            "mem/peak_gib": st.peak_gib(),
            "train/skipped_steps": st.skipped,
            "last_checkpoint": str(st.last_ckpt) if st.last_ckpt else None,
        }
        if st.step_tps:
            tps = out["perf/tokens_per_sec"] = statistics.median(st.step_tps)
            out["perf/step_ms"], out["perf/timed_steps"] = statistics.median(st.step_ms), len(st.step_tps)
            if st.peak_flops:
                out["perf/mfu"] = st.raw_model.estimate_mfu(
                    tps / st.dist.world_size, int(st.cfg.seq_len), st.peak_flops
                )
        return out | st.gpu_busy.summary()
    except Exception:  # noqa: BLE001
        return {}


def finish(st, status: str, extra: dict, exit_code: int) -> None:
    """Write the final summary (summary.json + W&B) and a last metrics.jsonl line, close W&B."""
    st.ending = True
    summary = {"status": status, "attention": st.cfg.attention.name, "seq_len": int(st.cfg.seq_len)}
    summary |= final_figures(st) | extra
    last = {"status": status, **{k: v for k, v in extra.items() if k != "resume_hint"}}
    failed = None
    for _ in range(2):  # the second time with the reserve's room
        try:
            st.log.set_summary(summary)
            st.log.log(st.step, last, wandb_too=False)
            failed = None
            break
        except DiskFullError as e:
            failed = e
            logging.raiseExceptions = False  # a full disk: no traceback for each failing log record
            if status == "ok":
                raise
            st.log.release_reserve()
    try:
        st.log.close(exit_code=exit_code)
    except Exception as e:  # noqa: BLE001 - W&B's files may not fit either; the ending is recorded
        if disk_full_in(e) is None and not isinstance(e, DiskFullError):
            raise
    if failed is not None:
        print(f"error: could not record status {status} in summary.json ({failed})", file=sys.stderr)


def resume_command(st, resume: bool = True) -> str:
    """The command that continues this run (``resume=False``: the same launch into a new run directory), with
    TRITON_INTERPRET and this launch's torchrun kept; each override is one shell word."""
    from kernels import interpret_enabled

    keep = [o for o in st.overrides if not o.startswith(("resume=", "out_dir=", "+resume=", "~resume"))]
    keep = [shlex.quote(o) for o in keep]  # as the shell gave them to Hydra
    env = [f"TRITON_INTERPRET={os.environ['TRITON_INTERPRET'].strip()}"] if interpret_enabled() else []
    launcher = "python train.py"
    if (dist := getattr(st, "dist", None)) is not None and dist.enabled:
        world = dist.world_size
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        launcher = f"torchrun --standalone --nproc_per_node={world} train.py"
        if local != world:  # several nodes: a placeholder for the rendezvous options
            launcher = f"torchrun --nnodes={world // local} --nproc_per_node={local} <rendezvous> train.py"
    run = ["resume=true", hydra_arg("out_dir", st.out_dir)] if resume else []
    return " ".join([*env, launcher, *keep, *run])


def hydra_arg(key: str, value) -> str:
    """``key=value`` as one shell word that Hydra parses back to ``value`` (a path with ``=``, spaces or
    brackets Hydra-quoted and shell-quoted)."""
    text = str(value)
    if re.fullmatch(r"[\w./:+-]*", text):
        return f"{key}={text}"
    return shlex.quote(f"{key}='{text}'")


def _how_to_go_on(st, kept_what: str, none: str) -> tuple[str, str | None, str]:
    """(what is kept, resume hint or None, what to do then) for an ending that failed to write."""
    if st.last_ckpt:
        hint = resume_command(st)
        return (
            f"{kept_what} {st.last_ckpt} (step {st.last_ckpt_step}) is intact",
            hint,
            f"resume with:\n  {hint}",
        )
    # no checkpoint: resume=true would be refused, and this out_dir keeps the failed run's records
    again = resume_command(st, resume=False)
    return none, None, f"start the run again in a new out_dir (no checkpoint to resume yet):\n  {again}"


def end_interrupted(st, s: int, signum: int):
    if st.last_ckpt_step != s:
        ckpt.save(st, s)
    name = signal.Signals(signum).name
    hint = resume_command(st)
    st.log.mark_preempting()
    finish(st, "interrupted", {"signal": name, "resume_hint": hint}, exit_code=0)
    st.say(f"{name}: stopped after step {s}; checkpoint {st.last_ckpt}\nresume with:\n  {hint}")
    return Outcome("interrupted", 128 + signum)


class SignalInterrupt(KeyboardInterrupt):
    """SIGTERM during set-up, raised as Ctrl-C raises KeyboardInterrupt."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def signals_interrupt():
    """SIGTERM raises ``SignalInterrupt`` in the block (the default would kill the process without a
    summary); the previous handler comes back after it."""

    def interrupt(signum, frame):  # noqa: ARG001 - signal API
        raise SignalInterrupt(signum)

    if threading.current_thread() is not threading.main_thread():  # only the main thread may install it
        yield
        return
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def end_before_first_step(st, signum: int) -> Outcome:
    """A signal during set-up (the data preparation, the model build): nothing was trained."""
    name, code = signal.Signals(signum).name, 128 + signum
    data = f"the data preparation in data.dir={st.cfg.data.dir} continues from its complete shards"
    if st.cfg.resume:
        hint = resume_command(st)
        st.say(
            f"\n{name}: interrupted during set-up, before the first step of this resume; nothing was "
            f"changed in {st.out_dir} and {data}. Resume with:\n  {hint}"
        )
        with contextlib.suppress(Exception):
            st.log.close(exit_code=code)
        return Outcome("interrupted", code)
    hint = resume_command(st, resume=False)
    with contextlib.suppress(Exception):
        st.record()
    extra = {"signal": name, "interrupted_in": "set-up, before the first step", "restart_hint": hint}
    finish(st, "interrupted", extra, exit_code=code)
    st.say(
        f"\n{name}: interrupted during set-up, before the first step: nothing was trained (its records "
        f"stay in {st.out_dir}); {data}. Start the run again (in a new run directory) with:\n  {hint}"
    )
    return Outcome("interrupted", code)


def record_exit_now(st, signum: int) -> None:
    """Second signal (the process exits at once, in the signal handler): summary.json says "interrupted",
    with the command to resume, instead of staying "running"."""
    if not st.dist.is_main:
        return
    name = signal.Signals(signum).name
    with contextlib.suppress(OSError):  # a checkpoint being saved: its temp folder goes, not the run
        ckpt.remove_own_temps(st.out_dir)
    hint = resume_command(st) if st.last_ckpt else None
    figures, row = final_figures(st), {"status": "interrupted", "signal": name, "exited_at_once": True}
    # summary.json first: a fresh file, while the metrics file may be mid-write in the interrupted code
    st.log.release_reserve()  # the process exits at once: nothing else removes it
    with contextlib.suppress(DiskFullError):
        write_json_atomic(
            st.out_dir / "summary.json", {**st.log.summary, **figures, **row, "resume_hint": hint}
        )
    with contextlib.suppress(Exception):
        st.log.log(st.step, row, wandb_too=False)
    more = (
        f"last checkpoint {st.last_ckpt}\nresume with:\n  {hint}" if hint else "no checkpoint was saved yet"
    )
    st.say(f"{name}: exited at once after step {st.step}; {more}")


def end_save_failed(st, e: ckpt.CheckpointSaveError):
    """A checkpoint could not be written: stop (disk_full or save_failed, exit 1), say what the disk needs,
    keep everything written before and print how to resume."""
    kept, hint, then = _how_to_go_on(st, "the previous checkpoint", "no earlier checkpoint exists")
    if e.disk_full:
        short = e.need_bytes - (e.free_bytes or 0)
        # a quota can bite with space left: then ask for the whole checkpoint's room
        room = f"at least {short / MIB:.1f} MiB more" if short > 0 else f"{e.need_bytes / MIB:.1f} MiB"
        fix = f"free {room} there (or move the run to a bigger disk), then "
    else:
        fix = "fix that, then "
    msg = (
        f"{e} Run stopped after step {st.step}; {kept}; metrics.jsonl keeps every logged step. "
        f"To go on: {fix}{then}"
    )
    print(f"error: {msg}", file=sys.stderr, flush=True)
    status = "disk_full" if e.disk_full else "save_failed"
    try:
        finish(st, status, {"error": msg, "resume_hint": hint, "failed_checkpoint_step": e.step}, EXIT_FAILED)
    except OSError as err:  # another write failure (an I/O error on that disk)
        print(f"error: could not record status {status} in summary.json ({err})", file=sys.stderr)
        with contextlib.suppress(Exception):
            st.log.close(exit_code=EXIT_FAILED)
    return Outcome(status, EXIT_FAILED)


def end_disk_full(st, e: BaseException):
    """The disk filled while the run wrote something other than a checkpoint (metrics.jsonl, summary.json,
    train.log, W&B's files): status disk_full (exit 1); every file keeps its whole lines."""
    st.ending = True
    logging.raiseExceptions = False
    where = _mount_hint(st.out_dir)  # before the reserve is freed: what the user's disk holds
    st.log.release_reserve()  # room for the ending's records
    what = str(e) if isinstance(e, DiskFullError) else f"disk full: {first_line(disk_full_in(e) or e)}"
    kept, hint, then = _how_to_go_on(st, "the last checkpoint", "no checkpoint was saved yet")
    msg = (
        f"{what}. Run stopped after step {st.step}; {kept}; metrics.jsonl keeps every line written "
        f"whole. To go on: free space on {where}, then {then}"
    )
    print(f"error: {msg}", file=sys.stderr, flush=True)
    finish(st, "disk_full", {"error": msg, "resume_hint": hint}, exit_code=EXIT_FAILED)
    return Outcome("disk_full", EXIT_FAILED)


def end_nonfinite(st, e: NonFiniteError):
    last = str(st.last_ckpt) if st.last_ckpt else "none (no checkpoint saved yet)"
    lr = f"optim.lr={float(st.cfg.optim.lr) / 2:g}"
    clip = "optim.grad_clip=1.0" if float(st.cfg.optim.grad_clip) <= 0 else "a lower optim.grad_clip"
    lower = f"lower the learning rate (e.g. {lr}) or clip gradients ({clip})"
    fix = (
        f"Fix: {lower} and resume from that checkpoint "
        f"(`{resume_command(st)}` plus the new optim values), or use nonfinite=skip"
        if st.last_ckpt
        else f"Fix: {lower} and start the run again, in a new run directory "
        f"(there is no checkpoint to resume from): `{resume_command(st, resume=False)}` plus the new optim "
        "values, or use nonfinite=skip"
    )
    msg = (
        f"non-finite {'loss' if not math.isfinite(e.loss) else 'gradient norm'} at step {e.step} "
        f"(loss={e.loss}, grad_norm={e.grad_norm}); run stopped, nothing saved after it. "
        f"Last good checkpoint: {last}. Config: {st.out_dir / '.hydra' / 'config.yaml'}. {fix}"
    )
    print(f"error: {msg}", file=sys.stderr, flush=True)
    finish(st, "nonfinite", {"error": msg, "nonfinite/step": e.step}, exit_code=EXIT_FAILED)
    return Outcome("nonfinite", EXIT_FAILED)


def oom_advice(attention: str, micro_batch_size: int, seq_len: int) -> str:
    """What to change after an out-of-memory step; attention=flash only where another backend ran
    (suggesting it to a flash run sent users in a circle)."""
    if micro_batch_size > 1:
        half = micro_batch_size // 2
        advice = f"Try batch.micro_batch_size={half} (the same tokens per step, more accumulation)"
    else:
        advice = f"The micro-batch is one sequence already: try seq_len={seq_len // 2}"
    return advice + ("" if attention == "flash" else ", or attention=flash (no N x N scores in memory)")


def end_oom(st, message: str):
    st.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    mem: dict = {"mem/peak_gib": st.peak_gib()}
    if st.device.type == "cuda":
        torch.cuda.empty_cache()
        mem["mem/total_gib"] = torch.cuda.get_device_properties(st.device).total_memory / GIB
        mem["mem/reserved_peak_gib"] = torch.cuda.max_memory_reserved(st.device) / GIB
    s, mbs = st.step + 1, st.plan.micro_batch_size
    text = (
        f"CUDA out of memory at step {s}: attention={st.cfg.attention.name} seq_len={st.cfg.seq_len} "
        f"micro_batch_size={mbs} peak {mem['mem/peak_gib']:.2f} GiB"
        + (f" of {mem['mem/total_gib']:.1f} GiB" if "mem/total_gib" in mem else "")
        + f" ({message}). {oom_advice(st.cfg.attention.name, mbs, st.cfg.seq_len)}"
    )
    print(f"oom: {text}", file=sys.stderr, flush=True)
    finish(st, "oom", {"error": text, "oom/step": s, "micro_batch_size": mbs, **mem}, exit_code=0)
    return Outcome("oom", int(st.cfg.oom_exit_code))


def _mount_hint(path: Path) -> str:
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return str(path)
    return f"the disk of {path} ({free / MIB:.1f} MiB free)"


def report_disk_full(e: BaseException, out_dir: Path | str | None = None) -> Outcome:
    """A full disk before the run could record anything: one clear line, nothing trained, exit 1."""
    logging.raiseExceptions = False
    cause = disk_full_in(e)
    if isinstance(e, DiskFullError):
        what = str(e)  # its own message names the file
    elif cause is not None and (cause.filename or out_dir is not None):
        name = cause.filename or f"the run directory {out_dir}"
        what = f"disk full: could not write {name} ({cause.strerror})"
    else:
        what = f"disk full: {first_line(cause or e)}"
    where = _mount_hint(Path(out_dir)) if out_dir is not None else "that disk"
    more = f"Free space on {where} (or set out_dir= on another disk), then run the command again"
    print(f"error: {what}. Nothing was trained. {more}", file=sys.stderr, flush=True)
    return Outcome("disk_full", EXIT_FAILED)


def report_config_error(
    e: ConfigError, out_dir: Path, cfg, is_main: bool, multirun: bool = False, hydra_files: dict | None = None
) -> Outcome:
    """Print ``config error: ...`` (no traceback); record it only in a run directory of our own."""
    taken = str(e.out_dir) if isinstance(e, rundir.RunDirTaken) else None  # another run's: never written to
    if is_main:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):
            if not multirun and rundir.discard_refused_run(out_dir):
                return Outcome("error", EXIT_CONFIG)
        if out_dir.is_dir() and not cfg.resume and not taken and not (out_dir / "summary.json").exists():
            with contextlib.suppress(OSError):
                summary = {"status": "error", "error": str(e), "attention": cfg.attention.name}
                write_json_atomic(out_dir / "summary.json", {**summary, "seq_len": cfg.seq_len})
                rundir.write_hydra_files(out_dir, hydra_files or {})
    return Outcome("error", EXIT_CONFIG, taken)
