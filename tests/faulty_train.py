"""``python tests/faulty_train.py ARGS``: train.py with test faults injected by monkeypatching the trainer.

The faults come from the environment variable ``FLASHGPT_TEST_FAULTS`` (JSON), which only the tests set
(``helpers_train.train_command`` turns ``fault.NAME=VALUE`` arguments into it; ``helpers_train.run_inprocess``
installs them in the test's own process); the product has no fault keys. Faults (all optional):

- ``nan_at_step``: update k reports a NaN loss and grad norm (the nonfinite=stop/skip paths);
- ``raise_oom_at_step``: update k raises ``torch.cuda.OutOfMemoryError`` (the OOM ending, on a CPU too);
- ``step_sleep_s``: sleep this long after each step, before the stop-signal check (time to send signals);
- ``eval_sleep_s``: sleep this long per validation batch before an evaluation (a signal during it);
- ``sigkill_at_finish``: SIGKILL this process as it starts its ending (after the last step and its final
  checkpoint, before the final summary is written): a run killed during its ending;
- ``sigkill_at_step``: SIGKILL this process as update k ends (a run killed mid-training).
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


def install(faults: dict, setattr=setattr) -> None:
    """Patch ``trainer.loop.Trainer`` with the faults (see the module docstring). In a test's own process
    pass ``monkeypatch.setattr`` (the patches end with the test); the SIGKILL faults need a process of
    their own (``helpers_train.run_train``)."""
    import torch

    from trainer.loop import Trainer

    step_fn, stop_fn, eval_fn = Trainer._train_step, Trainer._stop_requested, Trainer.evaluate
    finish_fn = Trainer._finish
    nan_at, oom_at = faults.get("nan_at_step"), faults.get("raise_oom_at_step")
    kill_at = faults.get("sigkill_at_step")
    step_sleep, eval_sleep = float(faults.get("step_sleep_s", 0)), float(faults.get("eval_sleep_s", 0))

    def train_step(self, s):
        if oom_at is not None and s == int(oom_at):
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (simulated: fault.raise_oom_at_step={s})")
        loss, grad_norm = step_fn(self, s)
        if kill_at is not None and s == int(kill_at):
            os.kill(os.getpid(), signal.SIGKILL)
        if nan_at is not None and s == int(nan_at):
            return math.nan, math.nan
        return loss, grad_norm

    def stop_requested(self, handler):
        if step_sleep:
            time.sleep(step_sleep)
        return stop_fn(self, handler)

    def evaluate(self):
        if eval_sleep:
            time.sleep(eval_sleep * len(self.eval_batches))
        return eval_fn(self)

    def finish(self, status, extra, exit_code):
        if faults.get("sigkill_at_finish"):
            os.kill(os.getpid(), signal.SIGKILL)
        return finish_fn(self, status, extra, exit_code)

    patches = {"_train_step": train_step, "_stop_requested": stop_requested, "evaluate": evaluate}
    for name, fn in {**patches, "_finish": finish}.items():
        setattr(Trainer, name, fn)


if __name__ == "__main__":
    sys.path.insert(0, str(TRAIN.parent))
    install(json.loads(os.environ.get("FLASHGPT_TEST_FAULTS", "{}")))
    sys.argv[0] = str(TRAIN)
    runpy.run_path(str(TRAIN), run_name="__main__")
