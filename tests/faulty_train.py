"""``python tests/faulty_train.py ARGS``: train.py with test faults injected by monkeypatching the trainer.

The faults come from the environment variable ``FLASHGPT_TEST_FAULTS`` (JSON), which only the tests set
(``helpers_train.train_command`` turns ``fault.NAME=VALUE`` arguments into it; ``helpers_train.run_inprocess``
installs them in the test's own process); the product has no fault keys. Faults (all optional):

- ``nan_at_step``: update k reports a NaN loss and grad norm (the nonfinite=stop/skip paths);
- ``raise_oom_at_step``: update k raises ``torch.cuda.OutOfMemoryError`` (the OOM ending, on a CPU too);
- ``step_sleep_s``: sleep this long after each step, before the stop-signal check (time to send signals);
- ``eval_sleep_s``: sleep this long before each validation batch of an evaluation (a signal during it);
- ``checkpoint_sleep_s``: sleep this long in each checkpoint save once its shards are in the temp folder,
  before the rename (a signal during the save);
- ``sigkill_at_finish``: SIGKILL this process as it starts its ending (after the last step and its final
  checkpoint, before the final summary is written): a run killed during its ending;
- ``sigkill_at_step``: SIGKILL this process as update k ends (a run killed mid-training);
- ``fill_disk_before_summary``: fill the run directory's disk (a file ``FILLER`` beside the run directory,
  written until the disk is full) just before the k-th summary.json write (1: the "running" summary of
  the start-up, 2: the next one);
- ``fill_disk_before_metrics_at_step``: fill the disk just before the metrics.jsonl line of step k, and
  make that line longer than a page (a field ``fault/padding``), so it cannot fit into the room left in
  the file's last page: the write is cut short, as when the disk fills mid-line;
- ``fill_disk_before_log_at_step``: the same for train.log: the step line of step k, padded with spaces.
"""

from __future__ import annotations

import json
import math
import os
import runpy
import signal
import sys
import time
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[1] / "train.py"
FILLER = ".fault_disk_filler"
PAD = 6000  # longer than a tmpfs page (4 KiB): never fits into the room left in a file's last page


def fill_disk(beside: Path) -> None:
    """Write ``FILLER`` beside ``beside`` until its disk is full."""
    with open(Path(beside).parent / FILLER, "ab", buffering=0) as f:
        for chunk in (1 << 20, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError:
                pass


def install(faults: dict, setattr=setattr) -> None:
    """Patch the trainer's functions with the faults (see the module docstring). In a test's own process
    pass ``monkeypatch.setattr`` (the patches end with the test); the SIGKILL faults need a process of
    their own (``helpers_train.run_train``)."""
    import torch

    from trainer import checkpoint, endings, loop
    from trainer.metrics import RunLogger
    from trainer.state import RunState

    install_disk_faults(faults, RunState, RunLogger, setattr)
    step_fn, stop_fn, eval_fn, finish_fn = loop.train_step, loop.stop_requested, loop.evaluate, endings.finish
    nan_at, oom_at = faults.get("nan_at_step"), faults.get("raise_oom_at_step")
    kill_at = faults.get("sigkill_at_step")
    step_sleep, eval_sleep = float(faults.get("step_sleep_s", 0)), float(faults.get("eval_sleep_s", 0))
    ckpt_sleep, file_table = float(faults.get("checkpoint_sleep_s", 0)), checkpoint._file_table

    def train_step(self, s):
        if oom_at is not None and s == int(oom_at):
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (simulated: fault.raise_oom_at_step={s})")
        loss, grad_norm = step_fn(self, s)
        if kill_at is not None and s == int(kill_at):
            os.kill(os.getpid(), signal.SIGKILL)
        if nan_at is not None and s == int(nan_at):
            return torch.full_like(loss, math.nan), torch.full_like(grad_norm, math.nan)
        return loss, grad_norm

    def stop_requested(self, handler):
        if step_sleep:
            time.sleep(step_sleep)
        return stop_fn(self, handler)

    def evaluate(st, stop=None):
        if not eval_sleep:
            return eval_fn(st, stop)

        def slow_stop():  # eval_sleep_s before each batch, where the real evaluation asks whether to stop
            time.sleep(eval_sleep)
            return stop is not None and stop()

        return eval_fn(st, slow_stop)

    def finish(self, status, extra, exit_code):
        if faults.get("sigkill_at_finish"):
            os.kill(os.getpid(), signal.SIGKILL)
        return finish_fn(self, status, extra, exit_code)

    def _file_table(tmp):
        if ckpt_sleep:
            time.sleep(ckpt_sleep)
        return file_table(tmp)

    setattr(checkpoint, "_file_table", _file_table)
    setattr(loop, "train_step", train_step)
    setattr(loop, "stop_requested", stop_requested)
    setattr(loop, "evaluate", evaluate)
    setattr(endings, "finish", finish)


def install_disk_faults(faults: dict, RunState, RunLogger, setattr=setattr) -> None:
    """The ``fill_disk_*`` faults (see the module docstring)."""
    summary_at = faults.get("fill_disk_before_summary")
    metrics_at = faults.get("fill_disk_before_metrics_at_step")
    log_at = faults.get("fill_disk_before_log_at_step")
    summary_fn, log_fn, say_fn = RunLogger.set_summary, RunLogger.log, RunState.say
    calls = [0]

    def set_summary(self, values):
        calls[0] += 1
        if summary_at is not None and calls[0] == int(summary_at):
            fill_disk(self.out_dir)
        return summary_fn(self, values)

    def log(self, step, metrics, **kw):
        if metrics_at is not None and step == int(metrics_at) and "train/loss" in metrics:
            fill_disk(self.out_dir)
            metrics = {**metrics, "fault/padding": "x" * PAD}
        return log_fn(self, step, metrics, **kw)

    def say(self, msg):
        if log_at is not None and msg.startswith(f"step {int(log_at):>6}/") and "| loss" in msg:
            fill_disk(self.out_dir)
            msg = msg + " " * PAD
        return say_fn(self, msg)

    setattr(RunLogger, "set_summary", set_summary)
    setattr(RunLogger, "log", log)
    setattr(RunState, "say", say)


if __name__ == "__main__":
    sys.path.insert(0, str(TRAIN.parent))
    install(json.loads(os.environ.get("FLASHGPT_TEST_FAULTS", "{}")))
    sys.argv[0] = str(TRAIN)
    runpy.run_path(str(TRAIN), run_name="__main__")
