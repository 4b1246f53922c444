"""The trainer behind train.py (loop.py), sample.py and eval.py (infer.py)."""

from trainer import rundir as _rundir  # noqa: E402, F401 - registers the ${run_token:} resolver (configs/config.yaml)
