"""The training loop behind ``train.py`` (Hydra entry point): set-up, steps, eval, logging, checkpoints.

Step numbering: ``step`` counts optimizer updates completed. Update ``s`` (1-based) uses the data of
``BinDataset.batch(..., seed=cfg.seed, step=s - 1, micro_step=g, rank=0)`` for micro-batch m of rank r,
where ``g = m * world_size + r`` (``trainer.dist.global_micro_index``; one process: g = m), so the data
depend only on (seed, s, g), whatever the backend, across resumes and at any world size with the same
micro-batch size. Metrics logged at
``step=s`` describe update s (its loss is computed before the update); ``val/loss`` at step s is measured
after s updates (step 0 = at initialisation). A checkpoint ``ckpt/step_{s}.pt`` holds the state after s
updates; resuming from it continues with update s + 1.

Exit statuses (``summary.json["status"]``, also in the W&B summary and the last metrics.jsonl line):
``ok`` (exit 0), ``interrupted`` (SIGTERM/SIGINT: checkpoint saved, exit 128 + signal; after a second
signal: exited at once, nothing saved), ``nonfinite`` (exit 1; nothing saved), ``disk_full`` /
``save_failed`` (a checkpoint could not be written: exit 1; the previous checkpoints are intact), ``oom``
(CUDA out of memory: exit ``oom_exit_code``, default 0), ``error`` (config error: exit 2; unexpected
exception: traceback, exit 1). Under ``-m`` (multirun) only ``interrupted`` and unexpected exceptions stop
the sweep; a sweep whose every job failed exits non-zero (train.py). ``resume=true`` on a run that already
reached max_steps returns Outcome ``finished`` (exit 0) and writes nothing, unless its final checkpoint is
corrupt or deleted (then the lost steps are replayed to rebuild it); a resume from a checkpoint behind the
last logged step sets the abandoned steps apart first (``RunLogger.set_apart_after``, trainer/rundir.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import sys
import time
from pathlib import Path

import torch
from omegaconf import open_dict

from trainer import checkpoint as ckpt
from trainer import config as C
from trainer import resume_config, rundir
from trainer.build import Setup, gpt_config_for
from trainer.checks import ConfigError, Plan, check_data_source, resolve_plan
from trainer.dist import (
    DistInfo,
    broadcast_obj,
    global_micro_index,
    init_distributed,
    local_norm,
    rank0_verdict,
)
from trainer.endings import (
    EXIT_CONFIG,
    EXIT_OK,
    GIB,
    CheckpointSaveError,
    Endings,
    NonFiniteError,
    Outcome,
    _first_line,
    _nbytes,
    _oom_types,
    report_config_error,
    report_disk_full,
)
from trainer.gpu_busy import GpuBusy
from trainer.metrics import DiskFullError, RunLogger, append_line, disk_full_in
from trainer.progress import Clock
from trainer.rundir import check_out_dir, out_dir_problem
from trainer.schedule import lr_at
from trainer.signals import PreemptionHandler

__all__ = ["EXIT_CONFIG", "EXIT_OK", "Outcome", "Trainer", "gpt_config_for", "lr_at", "run"]


class Trainer(Setup, Endings):
    """One training run. ``run()`` returns an ``Outcome``; ConfigError from set-up is raised to the caller."""

    def __init__(
        self, cfg, plan: Plan, dist: DistInfo, out_dir: Path, *, multirun: bool, overrides: list[str]
    ):
        self.cfg = cfg
        self.plan = plan
        self.dist = dist
        self.out_dir = Path(out_dir)
        self.multirun = multirun
        self.overrides = overrides
        # before RunLogger opens (creates) it: a resume tells a deleted metrics.jsonl from a kept one
        self.metrics_existed = (self.out_dir / "metrics.jsonl").is_file()
        self._ending = False  # True once an ending runs (a full disk is then reported, not raised)
        self.log = RunLogger(self.out_dir, enabled=dist.is_main)
        self.say = self._say if dist.is_main else (lambda *a, **k: None)
        self.step = 0
        self.skipped = 0
        self.last_ckpt: Path | None = None
        self.last_ckpt_step = -1
        self.last_train_loss: float | None = None
        self.last_val_loss: float | None = None
        self.last_val_step: int | None = None  # the step of last_val_loss
        self._peak_bytes = 0
        self._step_tps: list[float] = []
        self._step_ms: list[float] = []
        self._steps_here = 0
        self._cudagraphs = False
        self._prefetched: tuple | None = None  # ((step, micro), (x, y)) fetched ahead by _train_step
        self.gpu_busy = GpuBusy(
            int(cfg.perf.exclude_first_steps),
            int(cfg.perf.profile_steps),
            enabled=plan.device_type == "cuda" and dist.is_main,
            trace_dir=self.out_dir if cfg.perf.trace else None,
        )
        self.resume_intro: list[str] = []  # resume: where its config came from (said at start-up)
        self.replay: dict | None = None  # set by a resume that replays logged steps (_resume_checks)
        self.metrics_lost: dict | None = None  # set by a resume that finds metrics.jsonl gone
        self.fsdp = False  # parallel=fsdp with several ranks (set by _build_model)
        self._dcp = plan.parallel == "fsdp"  # checkpoints are DCP directories (also at world size 1)

    def _say(self, msg: str) -> None:
        """Progress line: to the console and appended to <out_dir>/train.log (beside Hydra's log lines),
        so a run started under nohup keeps its history."""
        print(msg, flush=True)
        try:
            append_line(self.out_dir / "train.log", msg)
        except DiskFullError:
            if not getattr(self, "_ending", False):  # the run ends as disk_full; an ending says why
                raise
        except OSError:
            pass

    def _broadcast(self, obj):
        if not self.dist.enabled:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    # ------------------------------------------------------------------------------------------ helpers
    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def peak_gib(self) -> float:
        """Peak GPU memory of training (parity excluded), GiB; 0.0 on the CPU."""
        if self.device.type != "cuda":
            return 0.0
        return max(self._peak_bytes, torch.cuda.max_memory_allocated(self.device)) / GIB

    def _batch(self, s: int, micro: int):
        x, y = self.train_ds.batch(
            self.plan.micro_batch_size,
            seed=int(self.cfg.seed),
            step=s - 1,
            micro_step=global_micro_index(micro, self.plan.grad_accum, self.dist.rank, self.dist.world_size),
            rank=0,
        )
        nb = self.device.type == "cuda"
        if nb:
            x, y = x.pin_memory(), y.pin_memory()
        return x.to(self.device, non_blocking=nb), y.to(self.device, non_blocking=nb)

    def _take_batch(self, s: int, micro: int):
        """``_batch(s, micro)``, or the same batch already on the device when the previous step prefetched it
        (``_train_step`` fetches the next step's first micro-batch while the GPU still runs this step, so a
        step does not begin with the GPU waiting for NumPy, pinning and the copy: about 1.4 ms of a 136 ms
        GPT-2 step on the H200, bench/NOTES.md v10)."""
        pre, self._prefetched = self._prefetched, None
        if pre is not None and pre[0] == (s, micro):
            return pre[1]
        return self._batch(s, micro)

    def _all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.dist.enabled:
            import torch.distributed as dist

            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    # ------------------------------------------------------------------------------------------ steps
    def _train_step(self, s: int) -> tuple[float, float]:
        """Forward/backward over the micro-batches of update ``s``, then clip.

        Gradients are reduced across ranks only in the last micro-batch's backward: DDP's ``no_sync()``
        before it; under FSDP2 ``set_requires_gradient_sync(False)`` (the unsharded gradients accumulate
        locally, then one reduce-scatter). Clipping is ``clip_grad_norm_`` on the (sharded, DTensor)
        parameters: its norm is the global one.

        Returns (mean loss over micro-batches and ranks, global grad norm before clipping) as floats."""
        cfg, accum = self.cfg, self.plan.grad_accum
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        for micro in range(accum):
            x, y = self._take_batch(s, micro)
            if self.fsdp:
                self.train_model.set_requires_gradient_sync(micro == accum - 1)
                sync_ctx = contextlib.nullcontext()
            elif self.dist.enabled and micro < accum - 1:
                sync_ctx = self.train_model.no_sync()
            else:
                sync_ctx = contextlib.nullcontext()
            with sync_ctx:
                if self._cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                with self.autocast:
                    _, loss = self.train_model(x, y)
                (loss / accum).backward()
            loss_sum += loss.detach().float()
        if s < int(cfg.max_steps):  # queued behind this step's work: ready when the next step begins
            self._prefetched = ((s + 1, 0), self._batch(s + 1, 0))
        loss_mean = self._all_reduce_sum(loss_sum / accum) / self.dist.world_size
        clip = float(cfg.optim.grad_clip)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.raw_model.parameters(), clip if clip > 0 else float("inf")
        )
        return float(loss_mean.item()), float(local_norm(grad_norm).item())

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the fixed validation batches (split over ranks, then all-reduced).

        Under FSDP2 every forward is collective (the all-gathers), so every rank runs the same number of
        forwards: a rank whose share is short repeats its first batch with weight 0."""
        model = self.fwd_model
        model.eval()
        totals = torch.zeros(2, device=self.device, dtype=torch.float64)
        mine = self.eval_batches[self.dist.rank :: self.dist.world_size]
        weights = [1.0] * len(mine)
        if self.fsdp:
            n = -(-len(self.eval_batches) // self.dist.world_size)
            pad = self.eval_batches[0] if not mine else mine[0]
            mine, weights = mine + [pad] * (n - len(mine)), weights + [0.0] * (n - len(mine))
        for (x, y), w in zip(mine, weights, strict=True):
            if self._cudagraphs:
                torch.compiler.cudagraph_mark_step_begin()
            with self.autocast:
                _, loss = model(x.to(self.device), y.to(self.device))
            totals[0] += w * loss.double()
            totals[1] += w
        model.train()
        totals = self._all_reduce_sum(totals)
        return float(totals[0] / totals[1])

    def _parity(self, s: int) -> dict:
        """Loss/logits of update s's first micro-batch with the run's backend and the reference backend,
        without gradients, on the current weights (before update s). Memory it uses is kept out of
        ``mem/peak_gib`` (peak recorded before, stats reset after). Under FSDP2 every rank runs it (its
        forwards are collective); rank 0's result is the one logged."""
        self.gpu_busy.close()  # its kernels are not a training step's
        ref = self.cfg.parity.reference
        cuda = self.device.type == "cuda"
        if cuda:
            self._sync()
            self._peak_bytes = max(self._peak_bytes, torch.cuda.max_memory_allocated(self.device))
        model = self.raw_model
        out: dict = {"parity/reference": ref}
        reason = None
        was_training = model.training
        model.eval()
        try:
            x, y = self._batch(s, 0)
            with torch.no_grad(), self.autocast:
                logits, loss = model(x, y)
                with model.use_attention_backend(ref, "auto" if ref == "sdpa" else None):
                    ref_logits, ref_loss = model(x, y)
                out["parity/loss_abs_diff"] = float((loss.float() - ref_loss.float()).abs().item())
                out["parity/logits_max_abs_diff"] = float(
                    ref_logits.float().sub_(logits.float()).abs_().max().item()
                )
            del logits, ref_logits, loss, ref_loss
        except _oom_types() as e:
            reason = f"out of memory in the {ref} reference at seq_len={self.cfg.seq_len}: {_first_line(e)}"
        except Exception as e:  # noqa: BLE001 - parity must never kill the run
            reason = f"{ref} reference failed: {_first_line(e)}"
        finally:
            model.train(was_training)
        if reason is not None:
            out = {"parity/reference": ref, "parity/skipped": reason}
            gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        return out

    def _save(self, s: int) -> Path:
        """Checkpoint after update ``s``: a single file written by rank 0 (ddp, one process), or with
        ``parallel=fsdp`` a DCP directory to which every rank writes its shards (collective; also at world
        size 1). Every rank returns the path, or every rank raises CheckpointSaveError."""
        self.gpu_busy.close()  # a checkpoint is not a training step
        rng = ckpt.rng_state()
        if self.dist.enabled:
            import torch.distributed as dist

            rngs: list = [None] * self.dist.world_size
            dist.all_gather_object(rngs, rng)
        else:
            rngs = [rng]
        record = None
        if self.dist.is_main:
            record = {
                "format_version": 1,
                "step": s,
                "data_step": s,
                "seed": int(self.cfg.seed),
                "rng": rngs,
                "config": C.to_dict(self.cfg),
                "model_args": dataclasses.asdict(self.gpt_config),
                "tokenizer": ckpt.tokenizer_record(self.meta),
                "attention": self._attention_id(),
                "wandb_run_id": self.log.wandb_id,
                "skipped_steps": self.skipped,
                "world_size": self.dist.world_size,
                "parallel": self.plan.parallel,
                "torch_version": str(torch.__version__),
            }
        path, problem = None, None
        if self._dcp:
            from torch.distributed.checkpoint import CheckpointException
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_state, optim_state = get_state_dict(self.raw_model, self.optimizer)
            try:
                path = ckpt.save_dcp_checkpoint(
                    model_state, optim_state, record, self.out_dir, s, int(self.cfg.checkpoint.keep)
                )
            except (OSError, RuntimeError, CheckpointException) as e:
                problem = self._save_problem(e, s, _nbytes(model_state) + _nbytes(optim_state))
            del model_state, optim_state
        elif self.dist.is_main:
            state = {**record, "model": self.raw_model.state_dict(), "optimizer": self.optimizer.state_dict()}
            try:
                path = ckpt.save_checkpoint(state, self.out_dir, s, int(self.cfg.checkpoint.keep))
            except (OSError, RuntimeError) as e:  # RuntimeError: torch.save's wrapper of a failed write
                problem = self._save_problem(e, s, _nbytes(state))
            del state
        path, problem = self._broadcast((str(path) if path else None, problem))
        if problem is not None:  # every rank stops: the run cannot go on without its checkpoints
            raise CheckpointSaveError(*problem)
        self.last_ckpt, self.last_ckpt_step = Path(path), s
        return self.last_ckpt

    def _stop_requested(self, handler: PreemptionHandler) -> int:
        """Signal number if any rank got SIGTERM/SIGINT (agreed across ranks), else 0."""
        if not self.dist.enabled:  # nothing to agree on: no device tensor, no sync
            return int(handler.signum or 0)
        flag = torch.tensor([handler.signum or 0], dtype=torch.int64, device=self.device)
        if self.dist.enabled:
            import torch.distributed as dist

            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    # ------------------------------------------------------------------------------------------ loop
    def run(self) -> Outcome:
        """Train to ``max_steps`` (or a stop signal / fault); returns the Outcome (summary written)."""
        handler = PreemptionHandler(
            grace_s=2.0 if self.dist.enabled else 0.0,
            verbose=self.dist.is_main,
            on_exit_now=self._record_exit_now,
        ).install()
        oom = None
        try:
            return self._loop(handler)
        except _oom_types() as e:
            oom = _first_line(e)
        except NonFiniteError as e:
            return self._end_nonfinite(e)
        except CheckpointSaveError as e:
            return self._end_save_failed(e)
        except DiskFullError as e:  # metrics.jsonl, train.log, summary.json: the run cannot record itself
            return self._end_disk_full(e)
        except BaseException as e:
            if disk_full_in(e) is not None:  # a write by a library (W&B, torch): the same ending
                return self._end_disk_full(e)
            self._finish("error", {"error": _first_line(e)}, exit_code=1)
            raise
        finally:
            handler.uninstall()
        return self._end_oom(oom)  # outside the except block: the traceback's tensors are released

    def _loop(self, handler: PreemptionHandler) -> Outcome:
        cfg = self.cfg
        max_steps = int(cfg.max_steps)
        if self.step == 0 and cfg.eval.at_start:
            self.last_val_loss, self.last_val_step = self._evaluate_noting(handler), 0
            self.log.log(0, {"val/loss": self.last_val_loss})
            self.say(f"step {0:>6}/{max_steps} | val loss {self.last_val_loss:.4f}")
            signum = self._stop_requested(handler)
            if signum:  # a signal during this evaluation: stop before the first step
                return self._end_interrupted(0, signum)
        win_tokens, win_time, win_steps = 0, 0.0, 0
        every = int(cfg.parity.every)
        clock = Clock(self.step)
        while self.step < max_steps:
            s = self.step + 1
            lr = lr_at(s, cfg.optim, max_steps)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            parity = (
                self._parity(s) if every and s % every == 0 and (self.dist.is_main or self.fsdp) else None
            )

            self._sync()
            with self.gpu_busy.step(self._steps_here, s):
                t0 = time.perf_counter()
                loss, grad_norm = self._train_step(s)
                finite = math.isfinite(loss) and math.isfinite(grad_norm)
                if finite:
                    self.optimizer.step()
                elif cfg.nonfinite == "stop":
                    raise NonFiniteError(s, loss, grad_norm)
                else:
                    self.skipped += 1
                self.optimizer.zero_grad(set_to_none=not self._cudagraphs)
                self._sync()
                dt = time.perf_counter() - t0
            profiled = self.gpu_busy.add_wall(dt)  # a profiled step stays out of the tokens/sec median
            self.step = s
            self._steps_here += 1

            tokens = int(cfg.batch.tokens_per_step)
            if self._steps_here > int(cfg.perf.exclude_first_steps) and not profiled:
                self._step_tps.append(tokens / dt)
                self._step_ms.append(dt * 1e3)
            win_tokens, win_time, win_steps = win_tokens + tokens, win_time + dt, win_steps + 1
            if finite:
                self.last_train_loss = loss

            metrics: dict = {}
            if s % int(cfg.log_interval) == 0 or s == max_steps or not finite:
                tps = win_tokens / win_time
                mfu = self.raw_model.estimate_mfu(
                    tps / self.dist.world_size, int(cfg.seq_len), self.peak_flops
                )
                metrics.update(
                    {
                        "lr": lr,
                        "perf/tokens_per_sec": tps,
                        "perf/mfu": mfu,
                        "perf/step_ms": 1e3 * win_time / win_steps,
                        "mem/peak_gib": self.peak_gib(),
                    }
                )
                if finite:
                    metrics.update({"train/loss": loss, "train/grad_norm": grad_norm})
                if cfg.nonfinite == "skip":
                    metrics["train/skipped_steps"] = self.skipped
                self.say(
                    f"step {s:>6}/{max_steps} | loss {loss:.4f} | lr {lr:.2e} | {tps:,.0f} tok/s | "
                    f"mfu {100 * mfu:.2f}% | {1e3 * win_time / win_steps:.1f} ms/step | "
                    f"peak {self.peak_gib():.2f} GiB | {clock.text(s, max_steps)}"
                    + ("" if finite else f" | skipped (total {self.skipped})")
                )
                win_tokens, win_time, win_steps = 0, 0.0, 0
            if parity is not None:
                metrics.update(parity)
                if "parity/skipped" in parity:
                    self.say(f"step {s:>6} | parity skipped: {parity['parity/skipped']}")
            eval_every = int(cfg.eval.interval)
            if (eval_every and s % eval_every == 0) or s == max_steps:
                self.last_val_loss, self.last_val_step = self._evaluate_noting(handler), s
                metrics["val/loss"] = self.last_val_loss
                self.say(f"step {s:>6}/{max_steps} | val loss {self.last_val_loss:.4f}")
            if metrics:
                self.log.log(s, metrics)

            ck_every = int(cfg.checkpoint.interval)
            if (ck_every and s % ck_every == 0) or (s == max_steps and cfg.checkpoint.at_end):
                self._save(s)
            signum = self._stop_requested(handler)
            if signum and s < max_steps:
                return self._end_interrupted(s, signum)

        self._finish("ok", {}, exit_code=0)
        return Outcome("ok", EXIT_OK)

    def _evaluate_noting(self, handler: PreemptionHandler) -> float:
        """``evaluate()``, with ``handler`` told that an evaluation runs (a signal's message says it waits for
        the evaluation, not a step)."""
        handler.activity = "evaluation"
        self.gpu_busy.close()  # evaluation kernels are not a training step's
        try:
            return self.evaluate()
        finally:
            handler.activity = "step"


def run(cfg, *, out_dir: Path, multirun: bool, overrides: list[str]) -> Outcome:
    """Validate, set up and train one run; never raises for user errors (returns their Outcome)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    is_main = int(os.environ.get("RANK", "0")) == 0
    # the run to resume: rank 0's out_dir; the other ranks' Hydra dir is a throwaway, the given key is not
    run_dir = Path(out_dir) if is_main else Path(str(cfg.out_dir))
    with open_dict(cfg):
        cfg.out_dir = str(out_dir)
        cfg.run_name = Path(out_dir).name  # the folder's name (a later ${now:} would differ)
    # Rank 0's own checks (its out_dir, its lock); under torchrun the other ranks hear its verdict and
    # stop with it (exit 2 on every rank) instead of waiting for it in init_process_group.
    problem, busy, lock = None, False, None
    if is_main:
        problem = out_dir_problem(out_dir)  # the lock file needs a writable directory
        if not problem:
            try:  # one live process per run directory; the checks below hold only under this lock
                lock = rundir.claim_run_dir(out_dir, is_main=True)
            except rundir.RunDirBusy as e:  # the directory is another process's: write nothing into it
                problem, busy = str(e), True
    problem = rank0_verdict(problem)
    if problem:
        if busy:
            print(f"config error: {problem}", file=sys.stderr, flush=True)
            return Outcome("error", EXIT_CONFIG)
        return report_config_error(ConfigError(problem), out_dir, cfg, is_main, multirun)
    if lock is None:
        lock = rundir.claim_run_dir(out_dir, is_main=False)
    intro: list[str] = []  # resume: lines for the start-up report (where its config came from)
    try:
        if cfg.resume:
            # the run's own config before anything is checked or prepared (not the defaults' data)
            cfg, set_here = resume_config.resume_config(cfg, run_dir, overrides)
            if set_here is not None:
                given = resume_config.describe_set_here(overrides, set_here)  # presets named as such
                saved = run_dir / rundir.RESOLVED_CONFIG
                intro.append(f"resume: config from {saved}; set on this command line: {given}")
        rundir.check_new_run_dir(cfg, out_dir, multirun)  # before check_out_dir: the more specific message
        check_out_dir(cfg, out_dir, multirun)
        plan = resolve_plan(cfg, world_size=world, cuda_available=torch.cuda.is_available())
        check_data_source(cfg)
    except ConfigError as e:
        lock.release()
        return report_config_error(e, out_dir, cfg, is_main, multirun)
    cfg = C.typed(cfg)  # checked: from here on the run reads a TrainConfig, not Hydra's DictConfig
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    dist = init_distributed(plan.device_type)
    try:
        if dist.enabled:
            out_dir = Path(broadcast_obj(str(out_dir)))
            cfg.out_dir = str(out_dir)
        try:
            trainer = Trainer(cfg, plan, dist, out_dir, multirun=multirun, overrides=overrides)
        except DiskFullError as e:  # not even metrics.jsonl fits
            return report_disk_full(e, out_dir)
        trainer.resume_intro = intro
        try:
            trainer.setup()
        except ConfigError as e:
            trainer.log.close(exit_code=EXIT_CONFIG)
            return report_config_error(e, out_dir, cfg, dist.is_main, multirun)
        except rundir.RunFinished as e:  # nothing was written: say so and leave the run as it is
            trainer.log.close(exit_code=0)
            if dist.is_main:
                rundir.restore_run_files(out_dir)  # Hydra's .hydra/ rewrite and log lines go back too
                print(str(e), flush=True)
            return Outcome("finished", EXIT_OK)
        except BaseException as e:
            if isinstance(e, DiskFullError) or disk_full_in(e) is not None:  # its first records
                return trainer._end_disk_full(e)
            trainer.log.close(exit_code=1)
            raise
        return trainer.run()
    finally:
        trainer = None
        lock.release()
        _release_memory(plan)
        if dist.enabled:
            import torch.distributed as tdist

            tdist.destroy_process_group()


def _release_memory(plan: Plan) -> None:
    """Free what a finished run holds, so the next run of a multirun sweep (same process) starts clean:
    torch.compile's caches (they keep the old model alive), garbage, the CUDA caching allocator."""
    if plan.compile:
        torch._dynamo.reset()
    gc.collect()
    if plan.device_type == "cuda":
        torch.cuda.empty_cache()
