"""Train a GPT with a chosen attention backend (Hydra entry point).

    python train.py                                         # GPT-2 124M, sdpa, seq_len 1024
    python train.py experiment=cpu_tiny attention=naive     # tiny model on the CPU
    python train.py attention=sdpa seq_len=8192             # block size follows seq_len
    python train.py <run's overrides> resume=true out_dir=runs/<run>   # continue from the newest checkpoint
    python train.py -m experiment=context_sweep attention=naive,sdpa,flash seq_len=1024,2048,4096,8192,16384
    torchrun --nproc_per_node=N train.py ...                # DDP (NCCL on GPU, gloo on CPU)

Run directory (``out_dir``, = Hydra's run dir): ``config.resolved.yaml``, ``.hydra/``, ``metrics.jsonl``,
``summary.json``, ``train.log``, ``ckpt/``, ``wandb/``.
Exit status: 0 ok (also after a CUDA OOM, see ``oom_exit_code``), 1 non-finite loss, 2 config error,
128 + signal after SIGTERM/SIGINT (checkpoint saved). The training loop is in ``trainer/loop.py``.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

_RANK_DIR_PREFIX = "flashgpt-rank"


@hydra.main(config_path="configs", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from trainer.loop import run

    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    out_dir = Path(hc.runtime.output_dir)
    outcome = run(cfg, out_dir=out_dir, multirun=multirun, overrides=list(hc.overrides.task))
    if out_dir.name.startswith(_RANK_DIR_PREFIX):  # a non-main rank's throwaway Hydra dir
        shutil.rmtree(out_dir, ignore_errors=True)
    if outcome.exit_code == 0:
        return
    if multirun and outcome.status != "interrupted":
        return  # the sweep goes on; the run's status is in its summary.json / W&B summary
    sys.exit(outcome.exit_code)


def _quiet_non_main_ranks() -> None:
    """Under torchrun, only rank 0 owns the run directory: other ranks get a throwaway Hydra dir and write
    no ``.hydra/`` (their out_dir is rank 0's, broadcast in ``trainer.loop.run``)."""
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0 or any(a in ("-m", "--multirun") for a in sys.argv[1:]):
        return
    extra = ["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    if not any(a.startswith("hydra.run.dir=") for a in sys.argv[1:]):
        extra.append(f"hydra.run.dir={tempfile.gettempdir()}/{_RANK_DIR_PREFIX}{rank}-{os.getpid()}")
    sys.argv.extend(extra)


if __name__ == "__main__":
    _quiet_non_main_ranks()
    main()
