"""The state of one training run, shared by set-up (trainer/setup.py), the loop (trainer/loop.py) and the
endings (trainer/endings.py), which are plain functions of it."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer.dist import DistInfo, broadcast_obj
from trainer.gpu_busy import GpuBusy
from trainer.metrics import DiskFullError, RunLogger, append_line
from trainer.rundir import RunDirLock, write_hydra_files

GIB = float(1 << 30)


class RunLog(logging.Handler):
    """``<out_dir>/train.log``: the run's ``say`` lines and, as a handler of the root logger, the logging
    records of its libraries (data preparation, W&B) in Hydra's format."""

    def __init__(self, path: Path) -> None:
        super().__init__(logging.INFO)
        self.path, self.held = path, []
        self.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.write(self.format(record))
        except Exception:  # noqa: BLE001 - logging's rule: report, never raise
            self.handleError(record)

    def write(self, line: str) -> None:
        if self.held is None:
            append_line(self.path, line)
        else:
            self.held.append(line)

    def open(self) -> None:
        held, self.held = self.held, None
        if held:
            append_line(self.path, "\n".join(held))


@dataclass
class RunState:
    cfg: Any  # the checked TrainConfig
    plan: Any  # trainer.checks.Plan
    dist: DistInfo
    out_dir: Path
    multirun: bool = False
    overrides: list[str] = field(default_factory=list)
    hydra_files: dict = field(default_factory=dict)  # rundir.hydra_files of this launch
    lock: RunDirLock | None = None
    # progress
    step: int = 0  # optimizer updates completed
    skipped: int = 0  # non-finite updates skipped (nonfinite=skip)
    last_ckpt: Path | None = None
    init_weights: dict | None = None  # init_from: GPT-2 weights, loaded once the model is built
    pretrained: Any = None  # init_from: the GPTConfig of those weights
    last_ckpt_step: int = -1
    last_train_loss: float | None = None
    last_val_loss: float | None = None
    last_val_step: int | None = None
    peak_bytes: int = 0  # peak before a parity check reset the CUDA stats
    step_tps: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    steps_here: int = 0  # steps run by this process (a resume starts at 0)
    prefetched: tuple | None = None  # ((step, micro), (x, y)) fetched ahead by loop.train_step
    ending: bool = False  # an ending runs: a full disk is then reported, not raised
    # resume
    resume_intro: list[str] = field(default_factory=list)
    resume_path: Path | None = None
    resume_notes: list[str] = field(default_factory=list)
    replay: dict | None = None  # a resume that replays logged steps (setup.resume_checks)
    metrics_lost: dict | None = None  # a resume that finds metrics.jsonl gone
    metrics_existed: bool = False
    # built by set-up
    log: RunLogger | None = None
    runlog: RunLog | None = None  # train.log (rank 0)
    gpu_busy: GpuBusy | None = None
    device: torch.device = torch.device("cpu")
    autocast: Any = field(default_factory=contextlib.nullcontext)
    meta: dict = field(default_factory=dict)
    tokens_digest: str | None = None  # data.meta.tokens_digest of data.dir (recorded in checkpoints)
    gpt_config: Any = None
    raw_model: Any = None  # the GPT itself (sharded in place under FSDP2)
    fwd_model: Any = None  # compiled
    train_model: Any = None  # DDP-wrapped
    optimizer: Any = None
    train_ds: Any = None
    eval_batches: list = field(default_factory=list)
    peak_flops: float | None = None
    backend_ran: str = ""
    kernel_plan: str | None = None
    fsdp: bool = False  # parallel=fsdp with several ranks
    cudagraphs: bool = False  # compile_mode=reduce-overhead

    @classmethod
    def open(cls, cfg, plan, dist, out_dir, **kw) -> RunState:
        """A new run's state with its RunLogger (metrics.jsonl opened), train.log and GPU-busy profiler."""
        out_dir = Path(out_dir)
        # before RunLogger creates it: a resume tells a deleted metrics.jsonl from a kept one
        st = cls(cfg, plan, dist, out_dir, metrics_existed=(out_dir / "metrics.jsonl").is_file(), **kw)
        st.log = RunLogger(out_dir, enabled=dist.is_main)
        if dist.is_main:
            st.runlog = RunLog(out_dir / "train.log")
            logging.getLogger().addHandler(st.runlog)
        st.gpu_busy = GpuBusy(
            int(cfg.perf.exclude_first_steps),
            int(cfg.perf.profile_steps),
            enabled=plan.device_type == "cuda" and dist.is_main,
            trace_dir=out_dir if cfg.perf.trace else None,
        )
        return st

    def record(self) -> None:
        """Once the run passed its checks: Hydra's ``.hydra/`` files, the lock's holder line, the held
        train.log lines."""
        if self.runlog is None or self.runlog.held is None:
            return
        if not (self.cfg.resume and (self.out_dir / ".hydra" / "config.yaml").is_file()):
            # a resume keeps the launch's record: its own composition (the defaults under the resume's
            # overrides) is not the run's config, which config.resolved.yaml holds
            write_hydra_files(self.out_dir, self.hydra_files)
        if self.lock is not None:
            self.lock.write_holder()
        self.runlog.open()

    def close_log(self) -> None:  # the next job of a -m sweep has its own train.log
        if self.runlog is not None:
            logging.getLogger().removeHandler(self.runlog)

    def say(self, msg: str) -> None:
        """To the console and <out_dir>/train.log; rank 0 only."""
        if not self.dist.is_main:
            return
        print(msg, flush=True)
        try:
            if self.runlog is not None:
                self.runlog.write(msg)
        except DiskFullError:
            if not self.ending:  # the run ends as disk_full; the ending says why
                raise
        except OSError:
            pass

    def broadcast(self, obj):
        return broadcast_obj(obj) if self.dist.enabled else obj

    def peak_gib(self) -> float:
        """Peak GPU memory of training (parity's excluded), GiB; 0.0 on the CPU."""
        if self.device.type != "cuda":
            return 0.0
        return max(self.peak_bytes, torch.cuda.max_memory_allocated(self.device)) / GIB

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def attention_id(self) -> list[str]:
        return [self.cfg.attention.name, self.cfg.attention.sdpa_backend]
