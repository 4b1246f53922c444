"""The training loop behind ``train.py`` (Hydra entry point): set-up, steps, eval, logging, checkpoints.

Step numbering: ``step`` counts optimizer updates completed. Update ``s`` (1-based) uses the data of
``BinDataset.batch(..., seed=cfg.seed, step=s - 1, micro_step=m, rank=r)`` for micro-batches m of rank r,
so the data depend only on (seed, s, m, r), whatever the backend and across resumes. Metrics logged at
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
reached max_steps returns Outcome ``finished`` (exit 0) and writes nothing; a resume from a checkpoint
behind the last logged step sets the abandoned steps apart first (``RunLogger.set_apart_after``,
trainer/rundir.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import math
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf, open_dict

from trainer import checkpoint as ckpt
from trainer import rundir
from trainer.checks import (
    ConfigError,
    Plan,
    check_data_fits,
    check_data_source,
    check_out_dir,
    check_resume_compatible,
    effective_data_source,
    out_dir_problem,
    peak_flops_for,
    probe_attention,
    resolve_plan,
)
from trainer.gpu_busy import GpuBusy
from trainer.metrics import RunLogger
from trainer.signals import PreemptionHandler

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
    """How a run ended: ``status`` (see module docstring) and the process exit code it asks for."""

    status: str
    exit_code: int


@dataclass
class DistInfo:
    """torch.distributed facts for this process (``enabled`` False without torchrun)."""

    enabled: bool = False
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_type: str) -> DistInfo:
    """Join the torchrun process group (NCCL on CUDA, gloo on CPU) when ``WORLD_SIZE`` > 1 is set."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or "RANK" not in os.environ:
        return DistInfo()
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    return DistInfo(True, dist.get_rank(), local_rank, dist.get_world_size())


def lr_at(step: int, optim, max_steps: int) -> float:
    """Learning rate for update ``step`` (1-based): linear warmup over ``optim.warmup_steps`` updates to
    ``optim.lr``, then cosine decay to ``optim.min_lr`` at ``optim.decay_steps`` (default max_steps), then
    flat."""
    warmup = int(optim.warmup_steps)
    decay = int(optim.decay_steps or max_steps)
    if warmup and step <= warmup:
        return float(optim.lr) * step / warmup
    if step >= decay:
        return float(optim.min_lr)
    progress = (step - warmup) / max(1, decay - warmup)
    return float(optim.min_lr) + 0.5 * (1.0 + math.cos(math.pi * progress)) * (
        float(optim.lr) - float(optim.min_lr)
    )


def gpt_config_for(cfg, vocab_size: int):
    """``model.GPTConfig`` of a run: every ``model.*`` key that is a GPTConfig field (by name), the block
    size (``model.block_size``, null = ``seq_len``), ``vocab_size`` and the attention backend.

    Raises:
        ValueError: from GPTConfig's own checks.
    """
    from model import GPTConfig

    m = cfg.model
    names = {f.name for f in dataclasses.fields(GPTConfig)}
    args = {k: m[k] for k in m if k in names and k not in ("block_size", "vocab_size")}
    return GPTConfig(
        **args,
        block_size=m.block_size if m.block_size is not None else cfg.seq_len,
        vocab_size=vocab_size,
        attention=cfg.attention.name,
        sdpa_backend=cfg.attention.sdpa_backend,
    )


def _oom_types() -> tuple[type[BaseException], ...]:
    return (torch.cuda.OutOfMemoryError,)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


class Trainer:
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
        self.log = RunLogger(self.out_dir, enabled=dist.is_main)
        self.say = self._say if dist.is_main else (lambda *a, **k: None)
        self.step = 0
        self.skipped = 0
        self.last_ckpt: Path | None = None
        self.last_ckpt_step = -1
        self.last_train_loss: float | None = None
        self.last_val_loss: float | None = None
        self._peak_bytes = 0
        self._step_tps: list[float] = []
        self._step_ms: list[float] = []
        self._steps_here = 0
        self._cudagraphs = False
        self.gpu_busy = GpuBusy(int(cfg.perf.exclude_first_steps), int(cfg.perf.profile_steps),
                                enabled=plan.device_type == "cuda")
        self.replay: dict | None = None  # set by a resume that replays logged steps (_resume_checks)

    def _say(self, msg: str) -> None:
        """Progress line: to the console and appended to <out_dir>/train.log (beside Hydra's log lines),
        so a run started under nohup keeps its history."""
        print(msg, flush=True)
        try:
            with open(self.out_dir / "train.log", "a") as f:
                f.write(msg + "\n")
        except OSError:
            pass

    # ------------------------------------------------------------------------------------------ set-up
    def setup(self) -> None:
        """Data, model, optimizer, resume, W&B. Raises ConfigError for user errors (before GPU allocation)."""
        cfg, plan, d = self.cfg, self.plan, self.dist
        if plan.device_type == "cuda":
            self.device = torch.device("cuda", d.local_rank)
            torch.cuda.set_device(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)  # a previous multirun job's peak is not ours
            tf32 = bool(cfg.tf32)  # false: float32 runs use full-precision matmuls
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.backends.cudnn.allow_tf32 = tf32
        else:
            self.device = torch.device("cpu")
        if cfg.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        torch.manual_seed(int(cfg.seed) + d.rank)
        self.autocast = (
            torch.autocast(device_type=plan.device_type, dtype=torch.bfloat16)
            if plan.autocast_dtype == "bfloat16"
            else contextlib.nullcontext()
        )

        # data: rank 0 prepares, the others wait and get its error, if any
        err = None
        if d.is_main:
            try:
                from data.prepare import ensure_prepared

                ensure_prepared(
                    effective_data_source(cfg), cfg.data.dir, cfg.data.tokenizer, float(cfg.data.val_fraction)
                )
            except (OSError, ValueError, RuntimeError) as e:
                err = f"data (data.source={cfg.data.source}, data.dir={cfg.data.dir}): {e}"
        err = self._broadcast(err)
        if err:
            raise ConfigError(err)
        from data.loader import BinDataset, load_meta

        meta = load_meta(cfg.data.dir)
        check_data_fits(cfg, meta)
        self.meta = meta

        # model config
        from model import GPT

        m = cfg.model
        vocab = int(m.vocab_size) if m.vocab_size is not None else -(-int(meta["vocab_size"]) // 64) * 64
        if vocab < int(meta["vocab_size"]):
            raise ConfigError(
                f"model.vocab_size={vocab} is smaller than the tokenizer's {meta['vocab_size']}; "
                "use model.vocab_size=null (rounds the tokenizer's size up to a multiple of 64)"
            )
        try:
            self.gpt_config = gpt_config_for(cfg, vocab)
        except ValueError as e:
            raise ConfigError(f"model: {e}") from e
        probe_attention(cfg, plan, self.device, self.gpt_config.n_head)

        # resume: find and check the checkpoint before building anything on the GPU
        state = None
        if cfg.resume:
            path = None
            if d.is_main:
                path, state = ckpt.load_newest(self.out_dir, map_location="cpu", warn=self.say)
            path = self._broadcast(str(path) if path else None)
            if path is None:
                raise ConfigError(self._no_checkpoint_message())
            if state is None:
                state = ckpt.load_checkpoint(path, map_location="cpu")
            notes = check_resume_compatible(
                {
                    "model_args": state["model_args"],
                    "tokenizer": state["tokenizer"]["name"],
                    "vocab_size": state["tokenizer"]["vocab_size"],
                    "attention": state.get("attention", ()),
                },
                {
                    "model_args": dataclasses.asdict(self.gpt_config),
                    "tokenizer": cfg.data.tokenizer,
                    "vocab_size": int(meta["vocab_size"]),
                    "attention": self._attention_id(),
                },
            )
            self.resume_path, self.resume_notes = Path(path), notes
            self._resume_checks(state)

        # model, optimizer
        self.raw_model = GPT(self.gpt_config).to(self.device)
        o = cfg.optim
        self.optimizer = self.raw_model.configure_optimizers(
            float(o.weight_decay), float(o.lr), (float(o.beta1), float(o.beta2)), plan.device_type
        )
        if state is not None:
            self.raw_model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.step = int(state["step"])
            self.skipped = int(state.get("skipped_steps", 0))
            self.last_ckpt, self.last_ckpt_step = self.resume_path, self.step
            rngs = state["rng"]
            if len(rngs) != d.world_size:
                self.say(
                    f"warning: checkpoint has RNG states of {len(rngs)} ranks, this run has {d.world_size}"
                )
            ckpt.set_rng_state(rngs[d.rank % len(rngs)])
        self.fwd_model = (torch.compile(self.raw_model, mode=plan.compile_mode) if plan.compile
                          else self.raw_model)
        # CUDA graphs (compile_mode=reduce-overhead): each forward starts a new graph step, so outputs of
        # the previous replay (the last micro-batch's loss) are never overwritten while still in use
        self._cudagraphs = plan.compile and plan.compile_mode == "reduce-overhead"
        if self._cudagraphs:
            # Gradients must live outside the graphs' memory pool: with grad None, autograd would keep the
            # backward graph's output buffer as .grad and the next micro-batch's replay would overwrite it
            # (gradient accumulation silently wrong; pytorch/pytorch#96693). With zero tensors in place it
            # adds into them instead, and zero_grad keeps them (set_to_none=False).
            for p in self.raw_model.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
        if d.enabled:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.train_model = DDP(
                self.fwd_model, device_ids=[d.local_rank] if plan.device_type == "cuda" else None
            )
        else:
            self.train_model = self.fwd_model

        self.train_ds = BinDataset(cfg.data.dir, "train", int(cfg.seq_len))
        self.val_ds = BinDataset(cfg.data.dir, "val", int(cfg.seq_len))
        self.eval_batches = self.val_ds.eval_batches(
            int(cfg.eval.batches), plan.eval_batch_size, int(cfg.seed)
        )
        self.peak_flops = plan.peak_flops or peak_flops_for(
            torch.cuda.get_device_name(self.device) if plan.device_type == "cuda" else None
        )
        self.backend_ran = self._backend_that_ran()

        # logging
        wandb_id = state.get("wandb_run_id") if state is not None else None
        resolved = OmegaConf.to_container(cfg, resolve=True)
        resolved["derived"] = self._derived()
        group = cfg.wandb.group
        if group is None and self.multirun:
            group = self.out_dir.parent.name
        if d.is_main:
            (self.out_dir / "config.resolved.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(resolved)))
        self.log.start_wandb(
            mode=cfg.wandb.mode,
            project=cfg.wandb.project,
            entity=cfg.wandb.entity,
            group=group,
            name=cfg.wandb.name or self.out_dir.name,
            tags=list(cfg.wandb.tags),
            config=resolved,
            run_id=wandb_id,
            fork_at=self.replay["from_step"] - 1 if self.replay and self.replay["wandb_steps"] else None,
        )
        self.log.set_summary(
            {
                "status": "running",
                "attention": cfg.attention.name,
                "attention/backend_ran": self.backend_ran,
                "seq_len": int(cfg.seq_len),
                "steps": self.step,
                "max_steps": int(cfg.max_steps),
                "wandb_run_id": self.log.wandb_id,
                "out_dir": str(self.out_dir),
                **self._derived(),
            }
        )
        d_ = self._derived()
        mode = f" ({plan.compile_mode})" if plan.compile and plan.compile_mode else ""
        self.say(
            f"flashgpt: {d_['n_params'] / 1e6:.2f}M params | attention={cfg.attention.name} "
            f"(ran: {self.backend_ran}) | seq_len={cfg.seq_len} | device={self.device} x{d.world_size} | "
            f"dtype={plan.autocast_dtype or 'float32'} | "
            f"compile={plan.compile}{mode} | "
            f"micro_batch={plan.micro_batch_size} "
            f"x accum {plan.grad_accum} x ranks {d.world_size} = {cfg.batch.tokens_per_step} tokens/step | "
            f"out_dir={self.out_dir}"
        )
        for note in plan.notes:
            self.say(note)
        if cfg.resume:
            self.say(f"resumed from {self.resume_path} at step {self.step}")
            for note in self.resume_notes:
                self.say(note)
            replay = self._replay_record()
            self.log.log(
                self.step,
                {"event": "resume", "from": str(self.resume_path), "notes": self.resume_notes, **replay},
                wandb_too=False,
            )
            if self.resume_notes:
                self.log.update_config({"resume_notes": self.resume_notes})

    def _attention_id(self) -> list[str]:
        return [self.cfg.attention.name, self.cfg.attention.sdpa_backend]

    def _derived(self) -> dict:
        return {
            "n_params": self.raw_model.num_params() if hasattr(self, "raw_model") else 0,
            "micro_batch_size": self.plan.micro_batch_size,
            "grad_accum": self.plan.grad_accum,
            "world_size": self.dist.world_size,
            "device": str(self.device),
            "dtype": self.plan.autocast_dtype or "float32",
            "compile": self.plan.compile,
            "compile_mode": self.plan.compile_mode or "default",
            "block_size": self.gpt_config.block_size,
            "vocab_size": self.gpt_config.vocab_size,
            "tokens_per_step": int(self.cfg.batch.tokens_per_step),
            "peak_flops": getattr(self, "peak_flops", None),
        }

    def _no_checkpoint_message(self) -> str:
        runs = (
            sorted(
                (p.parent.parent for p in Path("runs").glob("*/ckpt/step_*.pt")),
                key=lambda p: p.stat().st_mtime,
            )
            if Path("runs").is_dir()
            else []
        )
        hint = f" (newest run with checkpoints: out_dir={runs[-1]})" if runs else ""
        return (
            f"resume=true but {self.out_dir}/ckpt has no loadable checkpoint; pass out_dir=<run directory "
            f"of the run to continue>{hint}, or resume=false to start a new run"
        )

    def _resume_checks(self, state: dict) -> None:
        """resume=true, before anything is written: refuse a run that already reached max_steps
        (RunFinished: nothing changes), note a changed max_steps (it changes the LR schedule), and set
        apart the records of the logged steps after the checkpoint, which this resume replays."""
        cfg, k, max_steps = self.cfg, int(state["step"]), int(self.cfg.max_steps)
        summary = rundir.read_summary(self.out_dir) if self.dist.is_main else {}
        done = k
        if summary.get("status") == "ok" and isinstance(summary.get("steps"), int):
            done = max(k, summary["steps"])  # finished even when its final checkpoint does not load
        done = self._broadcast(done)
        if done >= max_steps:
            cmd = " ".join(w for w in self.resume_command().split() if not w.startswith("max_steps="))
            raise rundir.RunFinished(rundir.finished_message(self.out_dir, done, max_steps, cmd))
        old_max = (state.get("config") or {}).get("max_steps")
        if old_max is not None and int(old_max) != max_steps:
            self.resume_notes.append(rundir.max_steps_note(int(old_max), max_steps, k, cfg.optim, lr_at))
        last = self.log.last_logged_step() if self.dist.is_main else None
        if last is None or last <= k:
            return
        why = self._replay_reason(k, last, summary)
        moved = self.log.set_apart_after(k)
        if moved:
            self.replay = {
                "from_step": k + 1,
                "to_step": moved["last"],
                "reason": why,
                "abandoned_metrics": moved["path"].name,
                "wandb_steps": moved["wandb_steps"],
            }

    def _replay_reason(self, k: int, last: int, summary: dict) -> str:
        """Why the newest loadable checkpoint (step k) is behind the last logged step."""
        newer = [s for s, _ in ckpt.list_checkpoints(self.out_dir) if s > k]
        if newer:
            names = ", ".join(ckpt.ckpt_path(self.out_dir, s).name for s in newer)
            return f"the newer checkpoint(s) {names} do not load"
        lc = str(summary.get("last_checkpoint") or "")
        name = Path(lc).name
        if name.startswith("step_") and name[5:-3].isdigit() and int(name[5:-3]) > k:
            return f"the newest checkpoint {lc} is missing (deleted)"
        return (
            f"no checkpoint was saved after step {k}: the run stopped at step {last} "
            f"(status {summary.get('status', 'unknown')}) between checkpoints "
            f"(checkpoint.interval={self.cfg.checkpoint.interval}, log_interval={self.cfg.log_interval})"
        )

    def _replay_record(self) -> dict:
        """Say which steps are replayed and why; record it in the summary and W&B config. Returns the
        fields for the resume event line of metrics.jsonl ({} when nothing is replayed)."""
        r = self.replay
        if not r:
            return {}
        a, b = r["from_step"], r["to_step"]
        parent = self.log.wandb_parent
        wb = (
            f" W&B: run {self.log.wandb_id} forked from {parent['run_id']} at step {parent['step']} "
            f"(the parent keeps steps {a}-{b} of the abandoned branch)."
            if parent
            else ""
        )
        self.say(
            f"replaying steps {a}-{b}: the newest loadable checkpoint is step {a - 1} and {r['reason']}. "
            f"Their earlier records (the abandoned branch) moved to {r['abandoned_metrics']}; metrics.jsonl "
            f"keeps steps up to {a - 1} and continues from step {a}.{wb}"
        )
        info = {"replayed_steps": [a, b], "abandoned_metrics": r["abandoned_metrics"], "reason": r["reason"]}
        if parent:
            info["wandb_parent"] = parent
        self.log.set_summary({"replay": info})
        self.log.update_config({"replay": info})
        return {"replay": info}

    def _backend_that_ran(self) -> str:
        name = self.cfg.attention.name
        if name != "sdpa":
            return name
        try:
            from model.attention import sdpa_backend_that_ran

            dtype = torch.bfloat16 if self.plan.autocast_dtype == "bfloat16" else torch.float32
            shape = (
                1,
                self.gpt_config.n_head,
                int(self.cfg.seq_len),
                self.gpt_config.n_embd // self.gpt_config.n_head,
            )
            gen = torch.Generator(device=self.device).manual_seed(0)  # leaves the global RNG streams alone
            q = torch.randn(shape, device=self.device, dtype=dtype, generator=gen)
            return "sdpa:" + str(
                sdpa_backend_that_ran(q, q, q, self.cfg.attention.sdpa_backend)
            )
        except Exception as e:  # noqa: BLE001 - best effort, for logging only
            return f"sdpa:unknown ({type(e).__name__})"

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
            micro_step=micro,
            rank=self.dist.rank,
        )
        nb = self.device.type == "cuda"
        if nb:
            x, y = x.pin_memory(), y.pin_memory()
        return x.to(self.device, non_blocking=nb), y.to(self.device, non_blocking=nb)

    def _all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.dist.enabled:
            import torch.distributed as dist

            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    # ------------------------------------------------------------------------------------------ steps
    def _train_step(self, s: int) -> tuple[float, float]:
        """Forward/backward over the micro-batches of update ``s``, then clip.

        Returns (mean loss over micro-batches and ranks, global grad norm before clipping) as floats."""
        cfg, accum = self.cfg, self.plan.grad_accum
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        for micro in range(accum):
            x, y = self._batch(s, micro)
            sync_ctx = (
                self.train_model.no_sync()
                if self.dist.enabled and micro < accum - 1
                else contextlib.nullcontext()
            )
            with sync_ctx:
                if self._cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                with self.autocast:
                    _, loss = self.train_model(x, y)
                (loss / accum).backward()
            loss_sum += loss.detach().float()
        loss_mean = self._all_reduce_sum(loss_sum / accum) / self.dist.world_size
        clip = float(cfg.optim.grad_clip)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.raw_model.parameters(), clip if clip > 0 else float("inf")
        )
        return float(loss_mean.item()), float(grad_norm.item())

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the fixed validation batches (split over ranks, then all-reduced)."""
        model = self.fwd_model
        model.eval()
        totals = torch.zeros(2, device=self.device, dtype=torch.float64)
        for x, y in self.eval_batches[self.dist.rank :: self.dist.world_size]:
            if self._cudagraphs:
                torch.compiler.cudagraph_mark_step_begin()
            with self.autocast:
                _, loss = model(x.to(self.device), y.to(self.device))
            totals[0] += loss.double()
            totals[1] += 1
        model.train()
        totals = self._all_reduce_sum(totals)
        return float(totals[0] / totals[1])

    def _parity(self, s: int) -> dict:
        """Loss/logits of update s's first micro-batch with the run's backend and the reference backend,
        without gradients, on the current weights (before update s). Memory it uses is kept out of
        ``mem/peak_gib`` (peak recorded before, stats reset after)."""
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
        rng = ckpt.rng_state()
        if self.dist.enabled:
            import torch.distributed as dist

            rngs: list = [None] * self.dist.world_size
            dist.all_gather_object(rngs, rng)
        else:
            rngs = [rng]
        path, problem = None, None
        if self.dist.is_main:
            state = {
                "format_version": 1,
                "step": s,
                "data_step": s,
                "seed": int(self.cfg.seed),
                "model": self.raw_model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "rng": rngs,
                "config": OmegaConf.to_container(self.cfg, resolve=True),
                "model_args": dataclasses.asdict(self.gpt_config),
                "tokenizer": ckpt.tokenizer_record(self.meta),
                "attention": self._attention_id(),
                "wandb_run_id": self.log.wandb_id,
                "skipped_steps": self.skipped,
                "world_size": self.dist.world_size,
                "torch_version": str(torch.__version__),
            }
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

    def _save_problem(self, e: BaseException, s: int, need: int) -> tuple:
        """``CheckpointSaveError`` arguments for a failed save of step ``s``: a full disk (or quota) says so,
        with the checkpoint's size and the free space; anything else gives the error."""
        target = ckpt.ckpt_path(self.out_dir, s)
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

    def _stop_requested(self, handler: PreemptionHandler) -> int:
        """Signal number if any rank got SIGTERM/SIGINT (agreed across ranks), else 0."""
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
        except BaseException as e:
            self._finish("error", {"error": _first_line(e)}, exit_code=1)
            raise
        finally:
            handler.uninstall()
        return self._end_oom(oom)  # outside the except block: the traceback's tensors are released

    def _loop(self, handler: PreemptionHandler) -> Outcome:
        cfg = self.cfg
        max_steps = int(cfg.max_steps)
        if self.step == 0 and cfg.eval.at_start:
            self.last_val_loss = self._evaluate_noting(handler)
            self.log.log(0, {"val/loss": self.last_val_loss})
            self.say(f"step {0:>6}/{max_steps} | val loss {self.last_val_loss:.4f}")
            signum = self._stop_requested(handler)
            if signum:  # a signal during this evaluation: stop before the first step
                return self._end_interrupted(0, signum)
        win_tokens, win_time, win_steps = 0, 0.0, 0
        every = int(cfg.parity.every)
        while self.step < max_steps:
            s = self.step + 1
            lr = lr_at(s, cfg.optim, max_steps)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            parity = self._parity(s) if every and s % every == 0 and self.dist.is_main else None

            self._sync()
            with self.gpu_busy.step(self._steps_here):
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
            self.gpu_busy.add_wall(dt)
            self.step = s
            self._steps_here += 1

            tokens = int(cfg.batch.tokens_per_step)
            if self._steps_here > int(cfg.perf.exclude_first_steps) and not self.gpu_busy.active:
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
                    f"peak {self.peak_gib():.2f} GiB"
                    + ("" if finite else f" | skipped (total {self.skipped})")
                )
                win_tokens, win_time, win_steps = 0, 0.0, 0
            if parity is not None:
                metrics.update(parity)
                if "parity/skipped" in parity:
                    self.say(f"step {s:>6} | parity skipped: {parity['parity/skipped']}")
            eval_every = int(cfg.eval.interval)
            if (eval_every and s % eval_every == 0) or s == max_steps:
                self.last_val_loss = self._evaluate_noting(handler)
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
        try:
            return self.evaluate()
        finally:
            handler.activity = "step"

    # ------------------------------------------------------------------------------------------ endings
    def _final_figures(self) -> dict:
        tps_list = self._step_tps
        ms_list = self._step_ms
        out = {
            "steps": self.step,
            "final/train_loss": self.last_train_loss,
            "final/val_loss": self.last_val_loss,
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
        """Write the final summary (summary.json + W&B), a last metrics.jsonl line, close W&B."""
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
        self.log.set_summary(summary)
        self.log.log(
            self.step,
            {"status": status, **{k: v for k, v in extra.items() if k != "resume_hint"}},
            wandb_too=False,
        )
        self.log.close(exit_code=exit_code)

    def resume_command(self) -> str:
        """The command that continues this run; keeps TRITON_INTERPRET=1 (flash on a CPU) when it is set."""
        from kernels import interpret_enabled

        keep = [o for o in self.overrides if not o.startswith(("resume=", "out_dir=", "+resume=", "~resume"))]
        env = [f"TRITON_INTERPRET={os.environ['TRITON_INTERPRET'].strip()}"] if interpret_enabled() else []
        return " ".join([*env, "python train.py", *keep, "resume=true", f"out_dir={self.out_dir}"])

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
        write_json_atomic(self.out_dir / "summary.json", {**self.log.summary, **figures, **extra})
        with contextlib.suppress(Exception):
            self.log.log(self.step, {"status": "interrupted", "signal": name, "exited_at_once": True},
                         wandb_too=False)
        if hint:
            self.say(f"{name}: exited at once after step {self.step}; last checkpoint {self.last_ckpt}\n"
                     f"resume with:\n  {hint}")
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
            self._finish(status, extra, exit_code=EXIT_SAVE_FAILED)
        except OSError as err:  # the disk may still be too full for summary.json
            print(f"error: could not record status {status} in summary.json ({err})", file=sys.stderr)
            with contextlib.suppress(Exception):
                self.log.close(exit_code=EXIT_SAVE_FAILED)
        return Outcome(status, EXIT_SAVE_FAILED)

    def _end_nonfinite(self, e: NonFiniteError) -> Outcome:
        config_file = self.out_dir / ".hydra" / "config.yaml"
        last = str(self.last_ckpt) if self.last_ckpt else "none (no checkpoint saved yet)"
        msg = (
            f"non-finite {'loss' if not math.isfinite(e.loss) else 'gradient norm'} at step {e.step} "
            f"(loss={e.loss}, grad_norm={e.grad_norm}); run stopped, nothing saved after it. "
            f"Last good checkpoint: {last}. Config: {config_file}. "
            "Fix: lower optim.lr or optim.grad_clip and resume from that checkpoint "
            f"(`{self.resume_command()}` plus the new optim values), or use nonfinite=skip"
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


def report_config_error(e: ConfigError, out_dir: Path, cfg, is_main: bool) -> Outcome:
    """Print ``config error: ...`` (no traceback) and record status "error" in summary.json."""
    if is_main:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        try:
            from trainer.metrics import write_json_atomic

            # Record the error only in a run directory of our own: a refused resume or a refused
            # re-use of an existing run must leave that run's summary as it was.
            if out_dir.is_dir() and not cfg.resume and not (out_dir / "summary.json").exists():
                write_json_atomic(
                    out_dir / "summary.json",
                    {
                        "status": "error",
                        "error": str(e),
                        "attention": cfg.attention.get("name"),
                        "seq_len": cfg.get("seq_len"),
                    },
                )
        except OSError:
            pass
    return Outcome("error", EXIT_CONFIG)


def run(cfg, *, out_dir: Path, multirun: bool, overrides: list[str]) -> Outcome:
    """Validate, set up and train one run; never raises for user errors (returns their Outcome)."""
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    is_main = int(os.environ.get("RANK", "0")) == 0
    with open_dict(cfg):
        cfg.out_dir = str(out_dir)
        cfg.run_name = Path(out_dir).name  # the folder's name (a later ${now:} would differ)
    problem = out_dir_problem(out_dir) if is_main else None  # the lock file needs a writable directory
    if problem:
        return report_config_error(ConfigError(problem), out_dir, cfg, is_main)
    try:  # one live process per run directory; the checks below hold only under this lock
        lock = rundir.claim_run_dir(out_dir, is_main=is_main)
    except rundir.RunDirBusy as e:  # the directory is another process's: write nothing into it
        print(f"config error: {e}", file=sys.stderr, flush=True)
        return Outcome("error", EXIT_CONFIG)
    try:
        rundir.check_new_run_dir(cfg, out_dir)  # before check_out_dir: the more specific message
        check_out_dir(cfg, out_dir)
        plan = resolve_plan(cfg, world_size=world, cuda_available=torch.cuda.is_available())
        check_data_source(cfg)
    except ConfigError as e:
        lock.release()
        return report_config_error(e, out_dir, cfg, is_main)
    dist = init_distributed(plan.device_type)
    try:
        if dist.enabled:
            out_dir = Path(_broadcast_obj(str(out_dir)))
            with open_dict(cfg):
                cfg.out_dir = str(out_dir)
        trainer = Trainer(cfg, plan, dist, out_dir, multirun=multirun, overrides=overrides)
        try:
            trainer.setup()
        except ConfigError as e:
            trainer.log.close(exit_code=EXIT_CONFIG)
            return report_config_error(e, out_dir, cfg, dist.is_main)
        except rundir.RunFinished as e:  # nothing was written: say so and leave the run as it is
            trainer.log.close(exit_code=0)
            if dist.is_main:
                print(str(e), flush=True)
            return Outcome("finished", EXIT_OK)
        except BaseException:
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


def _broadcast_obj(obj):
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
