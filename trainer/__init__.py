"""Helpers of train.py: the training loop (loop.py), config checks (checks.py), atomic checkpoints
(checkpoint.py), JSONL + W&B logging (metrics.py), preemption signals (signals.py) and an offline W&B
run reader (wandb_read.py, used by tests and tools)."""
