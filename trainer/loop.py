"""The training loop: ``run`` checks, sets up (setup.py), trains and ends (endings.py) one run.

Update ``s`` (1-based) draws micro-batch m of rank r from (seed, s - 1, m * world_size + r) alone, so the
data are the same across backends, resumes and world sizes. ``ckpt/step_{s}`` holds the state after s
updates. Exit statuses: ok 0, interrupted 128 + signal, nonfinite / disk_full / save_failed 1, oom
``oom_exit_code``, config error 2; a resume of a finished run is ``finished`` (0) and writes nothing.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
from omegaconf import open_dict

from trainer import checkpoint as ckpt
from trainer import config as C
from trainer import endings, resume_config, rundir, setup
from trainer.checks import ConfigError, check_init_from_overrides, resolve_plan
from trainer.dist import broadcast_obj, global_micro_index, init_distributed, local_norm, rank0_verdict
from trainer.endings import EXIT_CONFIG, EXIT_OK, NonFiniteError, Outcome
from trainer.metrics import DiskFullError, disk_full_in, first_line
from trainer.progress import Clock, evaluates_after
from trainer.schedule import lr_at
from trainer.signals import PreemptionHandler
from trainer.state import RunState


def batch(st: RunState, s: int, micro: int):
    p, d = st.plan, st.dist
    g = global_micro_index(micro, p.grad_accum, d.rank, d.world_size)
    x, y = st.train_ds.batch(p.micro_batch_size, seed=int(st.cfg.seed), step=s - 1, micro_step=g, rank=0)
    if st.device.type == "cuda":
        x, y = x.pin_memory(), y.pin_memory()
    return x.to(st.device, non_blocking=True), y.to(st.device, non_blocking=True)


def take_batch(st: RunState, s: int, micro: int):
    """``batch(st, s, micro)``, or the same batch already on the device when the previous step fetched it
    while the GPU still ran (about 1.4 ms of a 136 ms GPT-2 step on the H200, bench/NOTES.md v10)."""
    pre, st.prefetched = st.prefetched, None
    return pre[1] if pre is not None and pre[0] == (s, micro) else batch(st, s, micro)


def all_reduce_sum(st: RunState, t: torch.Tensor) -> torch.Tensor:
    if st.dist.enabled:
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
    return t


def train_step(st: RunState, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward/backward over the micro-batches of update ``s``, then clip: (mean loss, global grad norm before
    clipping) as 0-d float32 tensors, not yet read on the host."""
    accum = st.plan.grad_accum
    loss_sum = torch.zeros((), device=st.device, dtype=torch.float32)
    for micro in range(accum):
        x, y = take_batch(st, s, micro)
        sync_ctx = contextlib.nullcontext()
        if st.fsdp:
            st.train_model.set_requires_gradient_sync(micro == accum - 1)
        elif st.dist.enabled and micro < accum - 1:
            sync_ctx = st.train_model.no_sync()
        with sync_ctx:
            if st.cudagraphs:
                torch.compiler.cudagraph_mark_step_begin()
            with st.autocast:
                _, loss = st.train_model(x, y, return_logits=False)  # no (B, T, V) output to fill a grad for
            (loss / accum).backward()
        loss_sum += loss.detach().float()
    if s < int(st.cfg.max_steps):  # queued behind this step's work: ready when the next step begins
        st.prefetched = ((s + 1, 0), batch(st, s + 1, 0))
    loss_mean = all_reduce_sum(st, loss_sum / accum) / st.dist.world_size
    clip = float(st.cfg.optim.grad_clip)
    grad_norm = torch.nn.utils.clip_grad_norm_(st.raw_model.parameters(), clip if clip > 0 else float("inf"))
    return loss_mean, local_norm(grad_norm).float()


def step_unless_nonfinite(
    st: RunState, loss: torch.Tensor, grad_norm: torch.Tensor
) -> tuple[float, float, bool]:
    """The optimizer step when loss and grad norm are finite; (loss, norm, finite) on the host. Fused AdamW
    checks on the device (``found_inf``, as GradScaler's skip), so the GPU does not wait for the host between
    the backward and the optimizer; under FSDP2 (DTensor parameters) the host decides first."""
    opt, on_device = st.optimizer, not st.fsdp
    if on_device:
        opt.found_inf = (~(loss.isfinite() & grad_norm.isfinite())).float()
        try:
            opt.step()  # skipped, step count included, where found_inf is 1
        finally:
            del opt.found_inf
    loss_f, norm_f = float(loss.item()), float(grad_norm.item())
    finite = math.isfinite(loss_f) and math.isfinite(norm_f)
    if finite and not on_device:
        opt.step()
    return loss_f, norm_f, finite


@torch.no_grad()
def evaluate(st: RunState, stop=None) -> float | None:
    """Mean loss over the fixed validation batches (split over ranks; under FSDP2 a short share repeats a
    batch with weight 0, every forward being collective). ``stop()`` true before a batch: None, never a mean
    of part of the set."""
    model = st.fwd_model
    model.eval()
    totals = torch.zeros(2, device=st.device, dtype=torch.float64)
    mine = st.eval_batches[st.dist.rank :: st.dist.world_size]
    weights = [1.0] * len(mine)
    if st.fsdp:
        n = -(-len(st.eval_batches) // st.dist.world_size)
        pad = mine[0] if mine else st.eval_batches[0]
        mine, weights = mine + [pad] * (n - len(mine)), weights + [0.0] * (n - len(mine))
    for (x, y), w in zip(mine, weights, strict=True):
        if stop is not None and stop():
            model.train()
            return None
        if st.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        with st.autocast:
            _, loss = model(x.to(st.device), y.to(st.device))
        totals[0] += w * loss.double()
        totals[1] += w
    model.train()
    totals = all_reduce_sum(st, totals)
    return float(totals[0] / totals[1])


def parity(st: RunState, s: int) -> dict:
    """Loss/logits differences of update s's first micro-batch between the run's and the reference backend."""
    st.gpu_busy.close()  # its kernels are not a training step's
    ref, model, cuda = st.cfg.parity.reference, st.raw_model, st.device.type == "cuda"
    if cuda:
        st.sync()
        st.peak_bytes = max(st.peak_bytes, torch.cuda.max_memory_allocated(st.device))
    out: dict = {"parity/reference": ref}
    was_training = model.training
    model.eval()
    try:
        x, y = batch(st, s, 0)
        with torch.no_grad(), st.autocast:
            logits, loss = model(x, y)
            with model.use_attention_backend(ref, "auto" if ref == "sdpa" else None):
                ref_logits, ref_loss = model(x, y)
            out["parity/loss_abs_diff"] = float((loss.float() - ref_loss.float()).abs().item())
            out["parity/logits_max_abs_diff"] = float(
                ref_logits.float().sub_(logits.float()).abs_().max().item()
            )
        del logits, ref_logits, loss, ref_loss
    except Exception as e:  # noqa: BLE001 - parity must never kill the run
        why = f"{ref} reference failed"
        if isinstance(e, torch.cuda.OutOfMemoryError):
            why = f"out of memory in the {ref} reference at seq_len={st.cfg.seq_len}"
        out = {"parity/reference": ref, "parity/skipped": f"{why}: {first_line(e)}"}
    finally:
        model.train(was_training)
    if "parity/skipped" in out:
        gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(st.device)
    return out


def stop_requested(st: RunState, handler: PreemptionHandler) -> int:
    """Signal number if any rank got SIGTERM/SIGINT (agreed across ranks), else 0."""
    if not st.dist.enabled:
        return int(handler.signum or 0)
    flag = torch.tensor([handler.signum or 0], dtype=torch.int64, device=st.device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return int(flag.item())


def evaluate_noting(st: RunState, handler: PreemptionHandler, s: int) -> float | None:
    """``evaluate`` after update ``s``, recorded and said. A first signal stops it at its next batch (None),
    so that a preempted job's grace period (or a CPU evaluation of GPT-2: half an hour) goes to the
    checkpoint, not to a figure eval.py can recompute; the last one, and those under torchrun (the ranks
    would have to agree per batch), finish first."""
    max_steps = int(st.cfg.max_steps)
    stoppable = s < max_steps and not st.dist.enabled
    handler.activity = "evaluation batch" if stoppable else "evaluation"  # for the signal's message
    st.gpu_busy.close()  # evaluation kernels are not a training step's
    try:
        val = evaluate(st, (lambda: handler.signum is not None) if stoppable else None)
    finally:
        handler.activity = "step"
    if val is None:
        st.say(f"step {s:>6}/{max_steps} | evaluation stopped by the signal: no val loss for this step")
        return None
    st.last_val_loss, st.last_val_step = val, s
    st.say(f"step {s:>6}/{max_steps} | val loss {val:.4f}")
    return val


def train(st: RunState) -> Outcome:
    """Train to ``max_steps`` (or a stop signal / fault); the Outcome, its summary written."""
    handler = PreemptionHandler(
        grace_s=2.0 if st.dist.enabled else 0.0,
        verbose=st.dist.is_main,
        on_exit_now=lambda signum: endings.record_exit_now(st, signum),
    ).install()
    oom = None
    try:
        return train_loop(st, handler)
    except torch.cuda.OutOfMemoryError as e:
        oom = first_line(e)
    except NonFiniteError as e:
        return endings.end_nonfinite(st, e)
    except ckpt.CheckpointSaveError as e:
        return endings.end_save_failed(st, e)
    except BaseException as e:
        # a full disk (metrics.jsonl, train.log, summary.json, a library's write): no records any more
        if isinstance(e, DiskFullError) or disk_full_in(e) is not None:
            return endings.end_disk_full(st, e)
        endings.finish(st, "error", {"error": first_line(e)}, exit_code=1)
        raise
    finally:
        handler.uninstall()
    return endings.end_oom(st, oom)  # outside the except block: the traceback's tensors are released


def train_loop(st: RunState, handler: PreemptionHandler) -> Outcome:
    cfg = st.cfg
    max_steps, every = int(cfg.max_steps), int(cfg.parity.every)
    eval_every, ck_every = int(cfg.eval.interval), int(cfg.checkpoint.interval)
    if st.step == 0 and cfg.eval.at_start:
        if (val := evaluate_noting(st, handler, 0)) is not None:
            st.log.log(0, {"val/loss": val})
        signum = stop_requested(st, handler)
        if signum:  # a signal during this evaluation: stop before the first step
            return endings.end_interrupted(st, 0, signum)
    win_tokens, win_time, win_steps = 0, 0.0, 0
    clock = Clock(st.step)
    tokens = int(cfg.batch.tokens_per_step)
    while st.step < max_steps:
        s = st.step + 1
        lr = lr_at(s, cfg.optim, max_steps)
        for group in st.optimizer.param_groups:
            group["lr"] = lr
        par = parity(st, s) if every and s % every == 0 and (st.dist.is_main or st.fsdp) else None

        st.sync()
        with st.gpu_busy.step(st.steps_here, s):
            t0 = time.perf_counter()
            loss, grad_norm, finite = step_unless_nonfinite(st, *train_step(st, s))
            if not finite and cfg.nonfinite == "stop":
                raise NonFiniteError(s, loss, grad_norm)
            st.skipped += not finite
            st.optimizer.zero_grad(set_to_none=not st.cudagraphs)
            st.sync()
            dt = time.perf_counter() - t0
        profiled = st.gpu_busy.add_wall(dt)  # a profiled step stays out of the tokens/sec median
        st.step = s
        st.steps_here += 1
        if st.steps_here > int(cfg.perf.exclude_first_steps) and not profiled:
            st.step_tps.append(tokens / dt)
            st.step_ms.append(dt * 1e3)
        win_tokens, win_time, win_steps = win_tokens + tokens, win_time + dt, win_steps + 1
        if finite:
            st.last_train_loss = loss

        metrics: dict = {}
        if s % int(cfg.log_interval) == 0 or s == max_steps or not finite:
            tps, ms = win_tokens / win_time, 1e3 * win_time / win_steps
            metrics.update(
                {"lr": lr, "perf/tokens_per_sec": tps, "perf/step_ms": ms, "mem/peak_gib": st.peak_gib()}
            )
            mfu_text, peak = "", f"peak {st.peak_gib():.2f} GiB | " if st.device.type == "cuda" else ""
            if st.peak_flops:
                mfu = st.raw_model.estimate_mfu(tps / st.dist.world_size, int(cfg.seq_len), st.peak_flops)
                metrics["perf/mfu"], mfu_text = mfu, f"mfu {100 * mfu:.2f}% | "
            if finite:
                metrics |= {"train/loss": loss, "train/grad_norm": grad_norm}
            if cfg.nonfinite == "skip":
                metrics["train/skipped_steps"] = st.skipped
            st.say(
                f"step {s:>6}/{max_steps} | loss {loss:.4f} | lr {lr:.2e} | {tps:,.0f} tok/s | "
                f"{mfu_text}{ms:.1f} ms/step | {peak}"
                f"{clock.text(s, max_steps)}" + ("" if finite else f" | skipped (total {st.skipped})")
            )
            win_tokens, win_time, win_steps = 0, 0.0, 0
        if par is not None:
            metrics.update(par)
            if "parity/skipped" in par:
                st.say(f"step {s:>6} | parity skipped: {par['parity/skipped']}")
            elif "parity/loss_abs_diff" in par:
                loss_d, logits_d = par["parity/loss_abs_diff"], par["parity/logits_max_abs_diff"]
                st.say(
                    f"step {s:>6} | parity vs {par['parity/reference']}: loss diff {loss_d:.2e}, "
                    f"logits max diff {logits_d:.2e}"
                )
        if evaluates_after(s, eval_every, max_steps):
            if (val := evaluate_noting(st, handler, s)) is not None:
                metrics["val/loss"] = val
        if metrics:
            st.log.log(s, metrics)
        if (ck_every and s % ck_every == 0) or (s == max_steps and cfg.checkpoint.at_end):
            ckpt.save(st, s)
        signum = stop_requested(st, handler)
        if signum and s < max_steps:
            return endings.end_interrupted(st, s, signum)

    endings.finish(st, "ok", {}, exit_code=0)
    return Outcome("ok", EXIT_OK)


def run(cfg, *, out_dir: Path, multirun: bool, overrides: list[str]) -> Outcome:
    """Validate, set up and train one run; a user error returns its Outcome, never raises."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    is_main = int(os.environ.get("RANK", "0")) == 0
    # the run to resume: rank 0's out_dir; the other ranks' Hydra dir is a throwaway, the given key is not
    run_dir = Path(out_dir) if is_main else Path(str(cfg.out_dir))
    hydra_files = rundir.hydra_files(cfg) if is_main else {}  # Hydra's task config, before the lines below
    with open_dict(cfg):
        cfg.out_dir = str(out_dir)
        cfg.run_name = Path(out_dir).name  # the folder's name (a later ${now:} would differ)
    # Rank 0's own checks (its out_dir, its lock); under torchrun the other ranks hear its verdict and
    # stop with it (exit 2 on every rank) instead of waiting for it in init_process_group.
    problem, busy, lock = None, False, None
    if is_main:
        # the lock file needs a writable directory
        problem = rundir.out_dir_problem(out_dir, resume=cfg.resume is True)
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
        return endings.report_config_error(ConfigError(problem), out_dir, cfg, is_main, multirun, hydra_files)
    if lock is None:
        lock = rundir.claim_run_dir(out_dir, is_main=False)
    intro: list[str] = []
    try:
        if cfg.resume:
            # the run's own config before anything is checked or prepared (not the defaults' data)
            cfg, given = resume_config.resume_config(cfg, run_dir, overrides)
            if given is not None:
                saved = run_dir / rundir.RESOLVED_CONFIG
                intro.append(f"resume: config from {saved}; set on this command line: {given}")
        rundir.check_new_run_dir(cfg, out_dir, multirun)
        check_init_from_overrides(cfg, overrides)  # before the plan checks the shape the weights replace
        plan = resolve_plan(cfg, world_size=world, cuda_available=torch.cuda.is_available())
    except ConfigError as e:
        lock.release()
        return endings.report_config_error(e, out_dir, cfg, is_main, multirun, hydra_files)
    cfg = C.typed(cfg)  # checked: from here on the run reads a TrainConfig, not Hydra's DictConfig
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    dist = init_distributed(plan.device_type)
    st = None
    try:
        if dist.enabled:
            out_dir = Path(broadcast_obj(str(out_dir)))
            cfg.out_dir = str(out_dir)
        try:
            st = RunState.open(cfg, plan, dist, out_dir, multirun=multirun, overrides=overrides)
        except DiskFullError as e:  # not even metrics.jsonl fits
            return endings.report_disk_full(e, out_dir)
        st.resume_intro, st.hydra_files, st.lock = intro, hydra_files, lock
        try:
            with endings.signals_interrupt():  # SIGTERM too stops a data preparation, as Ctrl-C does
                setup.setup(st)
        except KeyboardInterrupt as e:  # during the data preparation or the model build
            return endings.end_before_first_step(st, getattr(e, "signum", signal.SIGINT))
        except ConfigError as e:
            st.log.close(exit_code=EXIT_CONFIG)
            return endings.report_config_error(e, out_dir, cfg, dist.is_main, multirun, hydra_files)
        except rundir.RunFinished as e:  # nothing was written: say so and leave the run as it is
            st.log.close(exit_code=0)
            if dist.is_main:
                print(str(e), flush=True)
            return Outcome("finished", EXIT_OK)
        except BaseException as e:
            with contextlib.suppress(Exception):  # failed past its checks: its records, for the ending
                st.record()
            if isinstance(e, DiskFullError) or disk_full_in(e) is not None:  # its first records
                return endings.end_disk_full(st, e)
            if cfg.resume:  # the run's records stay as they were: set-up changed nothing of them
                st.log.close(exit_code=1)
            else:  # summary.json says so, as for a failure in training: the folder is not taken for new
                try:
                    endings.finish(st, "error", {"error": first_line(e), "failed_in": "set-up"}, exit_code=1)
                except Exception:  # noqa: BLE001 - the set-up's error is the one to raise
                    with contextlib.suppress(Exception):
                        st.log.close(exit_code=1)
            raise
        return train(st)
    finally:
        if st is not None:
            st.close_log()
        st = None
        lock.release()
        # free what a finished run holds, so the next job of a -m sweep (same process) starts clean
        if plan.compile:
            torch._dynamo.reset()  # its caches keep the old model alive
        gc.collect()
        if plan.device_type == "cuda":
            torch.cuda.empty_cache()
        if dist.enabled:
            torch.distributed.destroy_process_group()
