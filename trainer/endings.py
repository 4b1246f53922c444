"""How a run ends (the ``Endings`` mixin of ``trainer.loop.Trainer``): the final summary, and the
endings by signal (checkpoint, resume hint), non-finite loss, a checkpoint that cannot be written (full
disk) and CUDA out of memory; plus the exceptions and ``Outcome`` they use and ``report_config_error``."""

from __future__ import annotations

import contextlib
import errno
import gc
import logging
import math
import os
import shutil
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer import checkpoint as ckpt
from trainer.checks import ConfigError
from trainer.metrics import DiskFullError, disk_full_in

EXIT_OK = 0
EXIT_NONFINITE = 1
EXIT_SAVE_FAILED = 1
EXIT_CONFIG = 2
GIB = float(1 << 30)
MIB = float(1 << 20)


class NonFiniteError(Exception):
    """Loss or gradient norm not finite at ``step`` with nonfinite=stop."""

    def __init__(self, step: int, loss: float, grad_norm: float) -> None:
        super().__init__(f"non-finite loss/grad norm at step {step}: loss={loss}, grad_norm={grad_norm}")
        self.step, self.loss, self.grad_norm = step, loss, grad_norm


class CheckpointSaveError(Exception):
    """The checkpoint of ``step`` could not be written; the earlier checkpoints are untouched.

    ``disk_full`` is True for a full disk or quota; ``need_bytes`` is the checkpoint's estimated size and
    ``free_bytes`` the space left beside it (None when unknown)."""

    def __init__(self, message: str, step: int, disk_full: bool, need_bytes: int, free_bytes: int | None):
        super().__init__(message)
        self.step, self.disk_full, self.need_bytes, self.free_bytes = step, disk_full, need_bytes, free_bytes


def _nbytes(obj) -> int:
    """Bytes of the tensors in a nested state (dicts, lists, tuples): about a checkpoint's size on disk."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def _os_error_in(e: BaseException) -> OSError | None:
    """The OSError behind ``e`` (itself, or in its cause/context chain): torch.save reports a failed write
    as a RuntimeError whose context is the OSError."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


@dataclass
class Outcome:
    """How a run ended: ``status`` (see module docstring) and the process exit code it asks for;
    ``taken_dir``: for a new run refused because its directory already holds a run, that directory."""

    status: str
    exit_code: int
    taken_dir: str | None = None


def _oom_types() -> tuple[type[BaseException], ...]:
    return (torch.cuda.OutOfMemoryError,)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


class Endings:
    """The ending methods of ``trainer.loop.Trainer`` (which holds the state they read)."""

    def _final_figures(self) -> dict:
        tps_list = self._step_tps
        ms_list = self._step_ms
        out = {
            "steps": self.step,
            "final/train_loss": self.last_train_loss,
            "final/val_loss": self.last_val_loss,
            "final/val_step": self.last_val_step,  # its step: 0 is the untrained model's (eval.at_start)
            "mem/peak_gib": self.peak_gib(),
            "train/skipped_steps": self.skipped,
            "last_checkpoint": str(self.last_ckpt) if self.last_ckpt else None,
        }
        if tps_list:
            tps = statistics.median(tps_list)
            out["perf/tokens_per_sec"] = tps
            out["perf/step_ms"] = statistics.median(ms_list)
            out["perf/mfu"] = self.raw_model.estimate_mfu(
                tps / self.dist.world_size, int(self.cfg.seq_len), self.peak_flops
            )
            out["perf/timed_steps"] = len(tps_list)
        out.update(self.gpu_busy.summary())
        return out

    def _finish(self, status: str, extra: dict, exit_code: int) -> None:
        """Write the final summary (summary.json + W&B), a last metrics.jsonl line, close W&B.

        On a full disk: status "ok" raises ``DiskFullError`` at once (the run then ends as disk_full,
        ``_end_disk_full``); any other ending frees the run's reserve (``RunLogger.release_reserve``),
        writes its records once more and, where they still do not fit, says so."""
        self._ending = True
        try:
            figures = self._final_figures()
        except Exception:  # noqa: BLE001 - never let reporting hide the real ending
            figures = {}
        summary = {
            "status": status,
            "attention": self.cfg.attention.name,
            "seq_len": int(self.cfg.seq_len),
            **figures,
            **extra,
        }
        last = {"status": status, **{k: v for k, v in extra.items() if k != "resume_hint"}}
        failed = None
        for _ in range(2):  # the second time with the reserve's room
            try:
                self.log.set_summary(summary)
                self.log.log(self.step, last, wandb_too=False)
                failed = None
                break
            except DiskFullError as e:
                failed = e
                _quiet_logging_errors()
                if status == "ok":
                    raise
                self.log.release_reserve()
        try:
            self.log.close(exit_code=exit_code)
        except Exception as e:  # noqa: BLE001 - W&B's files may not fit either; the ending is recorded
            if disk_full_in(e) is None and not isinstance(e, DiskFullError):
                raise
        if failed is not None:
            print(f"error: could not record status {status} in summary.json ({failed})", file=sys.stderr)

    def resume_command(self) -> str:
        """The command that continues this run; keeps TRITON_INTERPRET=1 (flash on a CPU) when it is set.
        Under torchrun it starts with this launch's torchrun (one node: ``torchrun --standalone
        --nproc_per_node=W``; several: ``--nnodes``/``--nproc_per_node`` and a placeholder for the
        rendezvous options); any other world size works too (see README "Several GPUs")."""
        from kernels import interpret_enabled

        keep = [o for o in self.overrides if not o.startswith(("resume=", "out_dir=", "+resume=", "~resume"))]
        env = [f"TRITON_INTERPRET={os.environ['TRITON_INTERPRET'].strip()}"] if interpret_enabled() else []
        launcher = "python train.py"
        dist = getattr(self, "dist", None)  # None: a stand-in without one (tests)
        if dist is not None and dist.enabled:
            world = dist.world_size
            local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            if local == world:
                launcher = f"torchrun --standalone --nproc_per_node={world} train.py"
            else:
                nodes = world // local
                launcher = f"torchrun --nnodes={nodes} --nproc_per_node={local} <rendezvous> train.py"
        return " ".join([*env, launcher, *keep, "resume=true", f"out_dir={self.out_dir}"])

    def restart_command(self) -> str:
        """``resume_command`` for a run that has no checkpoint: the same launch into a new run directory
        (out_dir left out: a new runs/<time>_..._<token>), since resume=true would be refused."""
        words = self.resume_command().split()
        return " ".join(w for w in words if w != "resume=true" and not w.startswith("out_dir="))

    def _end_interrupted(self, s: int, signum: int) -> Outcome:
        import signal

        if self.last_ckpt_step != s:
            self._save(s)
        name = signal.Signals(signum).name
        hint = self.resume_command()
        self.log.mark_preempting()
        self._finish("interrupted", {"signal": name, "resume_hint": hint}, exit_code=0)
        self.say(f"{name}: stopped after step {s}; checkpoint {self.last_ckpt}\nresume with:\n  {hint}")
        return Outcome("interrupted", 128 + signum)

    def _record_exit_now(self, signum: int) -> None:
        """Second signal (the process exits at once): summary.json says "interrupted", with the checkpoint
        to resume from and the command, instead of staying "running". Runs inside the signal handler."""
        if not self.dist.is_main:
            return
        import signal

        from trainer.metrics import write_json_atomic

        name = signal.Signals(signum).name
        hint = self.resume_command() if self.last_ckpt else None
        try:
            figures = self._final_figures()
        except Exception:  # noqa: BLE001 - the status matters more than the figures
            figures = {}
        extra = {"status": "interrupted", "signal": name, "exited_at_once": True, "resume_hint": hint}
        # summary.json first: a fresh file, while the metrics file may be mid-write in the interrupted code
        self.log.release_reserve()  # the process exits at once: nothing else removes it
        with contextlib.suppress(DiskFullError):
            write_json_atomic(self.out_dir / "summary.json", {**self.log.summary, **figures, **extra})
        with contextlib.suppress(Exception):
            self.log.log(
                self.step, {"status": "interrupted", "signal": name, "exited_at_once": True}, wandb_too=False
            )
        if hint:
            self.say(
                f"{name}: exited at once after step {self.step}; last checkpoint {self.last_ckpt}\n"
                f"resume with:\n  {hint}"
            )
        else:
            self.say(f"{name}: exited at once after step {self.step}; no checkpoint was saved yet")

    def _end_save_failed(self, e: CheckpointSaveError) -> Outcome:
        """A checkpoint could not be written: stop cleanly (status disk_full or save_failed, exit 1), say
        what the disk needs, keep everything written before and print how to resume."""
        if self.last_ckpt:
            kept = f"the previous checkpoint {self.last_ckpt} (step {self.last_ckpt_step}) is intact"
            hint: str | None = self.resume_command()
            then = f"resume with:\n  {hint}"
        else:
            kept, hint = "no earlier checkpoint exists", None
            then = "start the run again (there is no checkpoint to resume from yet)"
        if e.disk_full:
            short = e.need_bytes - (e.free_bytes or 0)
            # a quota can bite with space left: then ask for the whole checkpoint's room
            room = f"at least {short / MIB:.1f} MiB more" if short > 0 else f"{e.need_bytes / MIB:.1f} MiB"
            fix = f"free {room} there (or move the run to a bigger disk), then "
        else:
            fix = "fix that, then "
        msg = (
            f"{e} Run stopped after step {self.step}; {kept}; metrics.jsonl keeps every logged step. "
            f"To go on: {fix}{then}"
        )
        print(f"error: {msg}", file=sys.stderr, flush=True)
        status = "disk_full" if e.disk_full else "save_failed"
        extra = {"error": msg, "resume_hint": hint, "failed_checkpoint_step": e.step}
        try:
            self._finish(status, extra, exit_code=EXIT_SAVE_FAILED)  # a full disk: it says so itself
        except OSError as err:  # another write failure (an I/O error on that disk)
            print(f"error: could not record status {status} in summary.json ({err})", file=sys.stderr)
            with contextlib.suppress(Exception):
                self.log.close(exit_code=EXIT_SAVE_FAILED)
        return Outcome(status, EXIT_SAVE_FAILED)

    def _end_disk_full(self, e: BaseException) -> Outcome:
        """The disk filled while the run wrote something other than a checkpoint (metrics.jsonl,
        summary.json, train.log, config.resolved.yaml, W&B's files): stop with status disk_full (exit 1),
        like a checkpoint that did not fit; every file keeps its whole lines and the resume command is
        printed."""
        self._ending = True
        _quiet_logging_errors()
        where = _mount_hint(self.out_dir)  # before the reserve is freed: what the user's disk holds
        self.log.release_reserve()  # room for the ending's records
        cause = disk_full_in(e)
        what = str(e) if isinstance(e, DiskFullError) else f"disk full: {_first_line(cause or e)}"
        last_ckpt = getattr(self, "last_ckpt", None)
        if last_ckpt:
            kept = f"the last checkpoint {last_ckpt} (step {self.last_ckpt_step}) is intact"
            hint: str | None = self.resume_command()
            then = f"resume with:\n  {hint}"
        else:
            kept, hint = "no checkpoint was saved yet", None
            then = "start the run again (there is no checkpoint to resume from yet)"
        msg = (
            f"{what}. Run stopped after step {self.step}; {kept}; metrics.jsonl keeps every line written "
            f"whole. To go on: free space on {where}, then {then}"
        )
        print(f"error: {msg}", file=sys.stderr, flush=True)
        self._finish("disk_full", {"error": msg, "resume_hint": hint}, exit_code=EXIT_SAVE_FAILED)
        return Outcome("disk_full", EXIT_SAVE_FAILED)

    def _end_nonfinite(self, e: NonFiniteError) -> Outcome:
        config_file = self.out_dir / ".hydra" / "config.yaml"
        last = str(self.last_ckpt) if self.last_ckpt else "none (no checkpoint saved yet)"
        msg = (
            f"non-finite {'loss' if not math.isfinite(e.loss) else 'gradient norm'} at step {e.step} "
            f"(loss={e.loss}, grad_norm={e.grad_norm}); run stopped, nothing saved after it. "
            f"Last good checkpoint: {last}. Config: {config_file}. "
            + (
                "Fix: lower optim.lr or optim.grad_clip and resume from that checkpoint "
                f"(`{self.resume_command()}` plus the new optim values), or use nonfinite=skip"
                if self.last_ckpt
                else "Fix: lower optim.lr or optim.grad_clip and start the run again, in a new run directory "
                f"(there is no checkpoint to resume from): `{self.restart_command()}` plus the new optim "
                "values, or use nonfinite=skip"
            )
        )
        print(f"error: {msg}", file=sys.stderr, flush=True)
        self._finish("nonfinite", {"error": msg, "nonfinite/step": e.step}, exit_code=EXIT_NONFINITE)
        return Outcome("nonfinite", EXIT_NONFINITE)

    def _end_oom(self, message: str) -> Outcome:
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        mem: dict = {"mem/peak_gib": self.peak_gib()}
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            mem["mem/total_gib"] = torch.cuda.get_device_properties(self.device).total_memory / GIB
            mem["mem/reserved_peak_gib"] = torch.cuda.max_memory_reserved(self.device) / GIB
        s = self.step + 1
        text = (
            f"CUDA out of memory at step {s}: attention={self.cfg.attention.name} seq_len={self.cfg.seq_len} "
            f"micro_batch_size={self.plan.micro_batch_size} peak {mem['mem/peak_gib']:.2f} GiB"
            + (f" of {mem['mem/total_gib']:.1f} GiB" if "mem/total_gib" in mem else "")
            + f" ({message}). Lower batch.micro_batch_size / batch.micro_tokens or seq_len, "
            "or use attention=flash"
        )
        print(f"oom: {text}", file=sys.stderr, flush=True)
        self._finish(
            "oom",
            {"error": text, "oom/step": s, "micro_batch_size": self.plan.micro_batch_size, **mem},
            exit_code=0,
        )
        return Outcome("oom", int(self.cfg.oom_exit_code))

    def _save_problem(self, e: BaseException, s: int, need: int) -> tuple:
        """``CheckpointSaveError`` arguments for a failed save of step ``s``: a full disk (or quota) says so,
        with the checkpoint's size and the free space; anything else gives the error."""
        target = ckpt.ckpt_path(self.out_dir, s, dcp=getattr(self, "_dcp", False))
        try:
            free: int | None = shutil.disk_usage(target.parent).free
        except OSError:
            free = None
        cause = _os_error_in(e)
        if cause is not None:
            full = cause.errno in (errno.ENOSPC, errno.EDQUOT)
        else:  # no OSError to read: judge by the space left
            full = free is not None and free < need
        if not full:
            return f"could not save checkpoint {target}: {_first_line(cause or e)}.", s, False, need, free
        room = f", and {target.parent} has {free / MIB:.1f} MiB free" if free is not None else ""
        why = f" ({cause.strerror})" if cause is not None and cause.strerror else ""
        text = f"disk full: checkpoint {target} needs about {need / MIB:.1f} MiB{room}{why}."
        return text, s, True, need, free


def _quiet_logging_errors() -> None:
    """On a full disk every logging handler writing a file (Hydra's train.log, W&B's debug logs) fails;
    logging would print a traceback for each record (and W&B's console capture logs those again). The
    run's own message says what happened."""
    logging.raiseExceptions = False


def _mount_hint(path: Path) -> str:
    """``path``'s disk, as ``<path> (N MiB free)`` where the free space can be read."""
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return str(path)
    return f"the disk of {path} ({free / MIB:.1f} MiB free)"


def report_disk_full(e: BaseException, out_dir: Path | str | None = None) -> Outcome:
    """A full disk before the run could record anything (Hydra's files, the lock, the first records):
    one clear line, nothing trained, exit 1."""
    _quiet_logging_errors()
    cause = disk_full_in(e)
    what = str(e) if isinstance(e, DiskFullError) else f"disk full: {_first_line(cause or e)}"
    if isinstance(e, DiskFullError):
        pass
    elif cause is not None and getattr(cause, "filename", None):
        what = f"disk full: could not write {cause.filename} ({cause.strerror})"
    elif cause is not None and out_dir is not None:
        what = f"disk full: could not write the run directory {out_dir} ({cause.strerror})"
    where = _mount_hint(Path(out_dir)) if out_dir is not None else "that disk"
    print(
        f"error: {what}. Nothing was trained. Free space on {where} (or set out_dir= on another "
        "disk), then run the command again",
        file=sys.stderr,
        flush=True,
    )
    return Outcome("disk_full", EXIT_SAVE_FAILED)


def report_config_error(e: ConfigError, out_dir: Path, cfg, is_main: bool, multirun: bool = False) -> Outcome:
    """Print ``config error: ...`` (no traceback). A single run then takes back what it created in its run
    directory (``rundir.discard_refused_run``: a config error writes nothing); a job of a ``-m`` sweep, or a
    run that cannot take back what is there (a directory not noted by Hydra's ``OutDirCheck``, or holding
    more than a refused run writes), records status "error" in summary.json instead, which the sweep's
    summary and ``bench.report`` list."""
    from trainer.rundir import RunDirTaken

    taken = str(e.out_dir) if isinstance(e, RunDirTaken) else None  # another run's: never written to
    if is_main:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        from trainer.rundir import discard_refused_run

        try:
            if not multirun and discard_refused_run(out_dir):
                return Outcome("error", EXIT_CONFIG)
        except OSError:
            pass
        try:
            from trainer.metrics import write_json_atomic

            # Record the error only in a run directory of our own: a refused resume or a refused
            # re-use of an existing run must leave that run's summary as it was.
            if out_dir.is_dir() and not cfg.resume and not taken and not (out_dir / "summary.json").exists():
                write_json_atomic(
                    out_dir / "summary.json",
                    {
                        "status": "error",
                        "error": str(e),
                        "attention": cfg.attention.name,
                        "seq_len": cfg.seq_len,
                    },
                )
        except OSError:
            pass
        if taken and multirun:  # Hydra rewrote that run's .hydra/ files and logged there: put them back
            from trainer.hydra_files import restore_job

            try:
                restore_job(taken)
            except OSError:
                pass
    return Outcome("error", EXIT_CONFIG, taken)
