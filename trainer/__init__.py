"""The trainer behind train.py: run state (state.py), set-up (setup.py), the loop (loop.py), endings
(endings.py), config checks (checks.py), DCP checkpoints (checkpoint.py), run directories (rundir.py),
JSONL + W&B logging (metrics.py) and preemption signals (signals.py)."""

from trainer import rundir as _rundir  # noqa: E402, F401 - registers the ${run_token:} resolver (configs/config.yaml)
