"""Helpers of train.py: typed configs (config.py), the training loop (loop.py), config checks
(checks.py), atomic checkpoints (checkpoint.py), JSONL + W&B logging (metrics.py), preemption signals
(signals.py) and an offline W&B run reader (wandb_read.py, used by tests and tools)."""

from trainer import rundir as _rundir  # noqa: E402, F401 - registers the ${run_token:} resolver (configs/config.yaml)
