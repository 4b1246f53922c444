"""Helpers for the train.py tests: the tiny run's overrides, train.py in a subprocess or in this process, its
run directory read back or copied, and work done once per test session (``once``).

The tiny runs use the character-level Tiny Shakespeare (vocab 65): on a CPU the GPT-2 BPE's 50304-way
output layer costs ~20x more per step than the rest of the tiny model.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
TRAIN = REPO / "train.py"
FAULTY_TRAIN = REPO / "tests" / "faulty_train.py"

#: conftest's shared ``killed_run`` is SIGKILLed once it has logged this step (it checkpoints every 4 steps).
KILLED_AFTER = 5


def prepare_char_data(base: Path, source: Path) -> Path:
    """Prepare Tiny Shakespeare (char tokenizer) into ``base/shakespeare_char`` once (idempotent)."""
    from data.prepare import ensure_prepared

    out = base / "shakespeare_char"
    ensure_prepared(str(source), str(out), "char", 0.1)
    return out


def tiny_overrides(data_dir: Path, source: Path, out_dir: Path, **extra) -> list[str]:
    """Overrides for a 16-step tiny run: seq_len 64, 1024 tokens/step (8 x 64 x 2 micro-batches), dropout 0.1
    (so RNG state matters for resume), log every step, eval every 8, checkpoint every 8, W&B disabled.
    ``extra`` (key=value, dots as ``__``) appends/overrides; ``fault__NAME=V`` adds a test fault
    (``fault.NAME=V``, see ``train_command``)."""
    base = {
        "model": "tiny",
        "trainer": "cpu",
        "data": "shakespeare_char",
        "data.source": str(source),
        "data.dir": str(data_dir),
        "attention": "naive",
        "seq_len": 64,
        "seed": 7,
        "max_steps": 16,
        "batch.tokens_per_step": 1024,
        "batch.micro_batch_size": 8,
        "model.dropout": 0.1,
        "optim.lr": 2e-3,
        "optim.min_lr": 2e-4,
        "optim.warmup_steps": 4,
        "optim.decay_steps": 16,
        "eval.interval": 8,
        "eval.batches": 2,
        "log_interval": 1,
        "checkpoint.interval": 8,
        "wandb.mode": "disabled",
        "out_dir": str(out_dir),
    }
    for k, v in extra.items():
        base[k.replace("__", ".")] = v
    return [f"{k}={_fmt(v)}" for k, v in base.items()]


def _fmt(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def train_env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("WANDB_SILENT", "true")
    env["HYDRA_FULL_ERROR"] = "1"
    env.pop("TRITON_INTERPRET", None)
    env.setdefault(
        "OMP_NUM_THREADS", "1"
    )  # the tiny model gains nothing from a second thread; CI has two cores
    env.update({k: str(v) for k, v in extra.items()})
    return env


def offline_train_env() -> dict:
    """train.py's environment with the network cut off: any download fails at once."""
    dead = "http://127.0.0.1:9"  # the discard port: nothing listens
    return train_env(http_proxy=dead, https_proxy=dead, HTTP_PROXY=dead, HTTPS_PROXY=dead)


def split_faults(args: list[str]) -> tuple[dict[str, float], list[str]]:
    """``({NAME: VALUE}, the other args)`` of ``fault.NAME=VALUE`` arguments (see ``train_command``)."""
    faults = {
        a.split("=", 1)[0][len("fault.") :]: float(a.split("=", 1)[1]) for a in args if a.startswith("fault.")
    }
    return faults, [a for a in args if not a.startswith("fault.")]


def train_command(args: list[str], launcher: list[str] | None = None, env: dict | None = None):
    """(argv, env) of ``python train.py ARGS`` (or ``launcher + [train.py] + ARGS``).

    ``fault.NAME=VALUE`` arguments are test faults, not config keys: they are taken out of ARGS, passed as
    JSON in ``FLASHGPT_TEST_FAULTS`` and the script becomes tests/faulty_train.py, which monkeypatches
    the trainer (nan_at_step, raise_oom_at_step, step_sleep_s, eval_sleep_s) and runs train.py."""
    faults, rest = split_faults(args)
    env = dict(env or train_env())
    if faults:
        env["FLASHGPT_TEST_FAULTS"] = json.dumps(faults)
    script = FAULTY_TRAIN if faults else TRAIN
    return (launcher or [sys.executable]) + [str(script), *rest], env


def run_train(
    args: list[str], *, timeout: float = 300, env: dict | None = None, launcher: list[str] | None = None
):
    """Run ``python train.py ARGS`` (``train_command``); returns CompletedProcess (text)."""
    cmd, env = train_command(args, launcher, env)
    return subprocess.run(cmd, cwd=str(REPO), env=env, capture_output=True, text=True, timeout=timeout)


def describe(proc) -> str:
    out, err = proc.stdout[-4000:], proc.stderr[-4000:]
    return f"exit {proc.returncode}\n--- stdout ---\n{out}\n--- stderr ---\n{err}"


def read_jsonl(run_dir: Path) -> list[dict]:
    p = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def train_losses(run_dir: Path) -> dict[int, float]:
    """step -> train/loss from metrics.jsonl (a later line for the same step wins)."""
    return {r["step"]: r["train/loss"] for r in read_jsonl(run_dir) if "train/loss" in r}


def val_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["val/loss"] for r in read_jsonl(run_dir) if "val/loss" in r}


def summary(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def checkpoint_tensors(path: Path, tmp: Path) -> dict:
    """Every tensor of a checkpoint directory (model and optimizer state), by flattened key: DCP's own
    conversion to one torch.save file, read back."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, tmp / "flat.pt")
    out: dict = {}

    def walk(obj, key):
        if isinstance(obj, torch.Tensor):
            out[key] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{key}.{k}")

    walk(torch.load(tmp / "flat.pt", weights_only=True), "")
    (tmp / "flat.pt").unlink()
    return out


def copy_run(src: Path, dst: Path) -> Path:
    """A copy of run directory ``src`` at ``dst`` (lock file included: nobody holds its flock) that a test may
    resume or change; returns ``dst``."""
    shutil.copytree(src, dst)
    return Path(dst)


@contextlib.contextmanager
def once(path: Path):
    """Work on ``path`` that the processes of a test session (pytest-xdist workers) do once between them:
    holds an exclusive lock on ``path.lock`` and yields True to the first caller only (it makes ``path``),
    False to later callers (they find ``path`` made, or left as a failed first attempt left it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    started = path.with_name(path.name + ".started")
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        first = not started.exists()
        started.touch()
        yield first


def compose_cfg(overrides: list[str], *, return_hydra_config: bool = False):
    """The config train.py would get for ``overrides`` (Hydra compose API, in-process)."""
    from hydra import compose, initialize_config_dir

    import trainer.config  # noqa: F401 - the schema and model presets in Hydra's ConfigStore

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=return_hydra_config)


def run_inprocess(overrides: list[str], out_dir: Path, monkeypatch=None):
    """``trainer.loop.run`` on the composed config, in this process (for checks of a run's records and
    messages where no process behaviour is tested: signals, exit codes, locks, Hydra's run directory);
    returns its Outcome. A composition error (wrong type, unknown key) is reported as train.py reports it:
    ``config error: ...`` on stderr, Outcome("error", 2). ``fault.NAME=VALUE`` overrides are installed
    with pytest's ``monkeypatch`` (tests/faulty_train.py; not the SIGKILL faults)."""
    from trainer.config import TrainConfig
    from trainer.endings import EXIT_CONFIG, Outcome
    from trainer.fields import config_error_from
    from trainer.loop import run

    faults, overrides = split_faults(overrides)
    if faults:
        from tests import faulty_train

        if monkeypatch is None or any(name.startswith("sigkill") for name in faults):
            raise ValueError(f"faults {sorted(faults)} in this process need monkeypatch and no SIGKILL")
        faulty_train.install(faults, monkeypatch.setattr)

    try:
        cfg = compose_cfg(overrides)
    except Exception as e:
        err = config_error_from(e, TrainConfig)
        if err is None:
            raise
        print(f"config error: {err}", file=sys.stderr, flush=True)
        return Outcome("error", EXIT_CONFIG)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    return run(cfg, out_dir=Path(out_dir), multirun=False, overrides=overrides)
