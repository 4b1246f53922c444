"""Run logging: ``metrics.jsonl`` and ``summary.json`` in the run directory, and Weights & Biases.

Only rank 0 logs (``enabled=False`` elsewhere makes every method a no-op).

W&B mode (``wandb.mode``): ``online`` | ``offline`` | ``disabled`` | ``auto``. ``auto`` honours a
``WANDB_MODE`` environment variable, else is ``online`` when an API key is configured (``WANDB_API_KEY``
or a netrc entry for the W&B host, which is where ``wandb login`` stores it) and ``offline`` otherwise;
an offline run prints the ``wandb sync <dir>`` command that uploads it later. W&B files go to
``<out_dir>/wandb/``. The run id is stored in ``<out_dir>/wandb_run_id.txt`` (and in checkpoints) so that a
resumed run continues the same W&B run (``resume="allow"``).
"""

from __future__ import annotations

import json
import math
import netrc
import os
from pathlib import Path
from urllib.parse import urlparse

WANDB_ID_FILE = "wandb_run_id.txt"


def new_run_id() -> str:
    """A fresh 8-character W&B run id (lowercase letters and digits, like wandb's own)."""
    import secrets
    import string

    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def wandb_logged_in() -> bool:
    """True when a W&B API key is configured: ``WANDB_API_KEY`` or a netrc entry for the W&B host.

    (``wandb.api.api_key`` reads the same sources but is deprecated in wandb >= 0.2x and warns.)
    """
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        auth = netrc.netrc(path).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(auth and auth[2])


def resolve_wandb_mode(mode: str) -> str:
    """Map ``wandb.mode`` to online | offline | disabled (see the module docstring for ``auto``)."""
    if mode != "auto":
        return mode
    env = os.environ.get("WANDB_MODE", "").lower()
    if env in ("online", "offline", "disabled"):
        return env
    if env == "dryrun":
        return "offline"
    return "online" if wandb_logged_in() else "offline"


def _jsonable(v):
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep them readable
    return v


def write_json_atomic(path: Path, obj: dict) -> None:
    """Write ``obj`` as pretty JSON through a temp file + ``os.replace``."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({k: _jsonable(v) for k, v in obj.items()}, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


class RunLogger:
    """metrics.jsonl + summary.json + W&B for one run.

    Args:
        out_dir: the run directory.
        enabled: False on ranks other than 0 (then nothing is written).
    """

    def __init__(self, out_dir: str | os.PathLike, enabled: bool = True) -> None:
        self.out_dir = Path(out_dir)
        self.enabled = enabled
        self.wandb_run = None
        self.wandb_mode = "disabled"
        self._jsonl = None
        self.summary: dict = {}
        if enabled:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(self.out_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115

    # ---------------------------------------------------------------------------------------- W&B
    def saved_wandb_id(self) -> str | None:
        p = self.out_dir / WANDB_ID_FILE
        return (p.read_text().strip() or None) if p.is_file() else None

    def start_wandb(
        self,
        *,
        mode: str,
        project: str,
        entity: str | None,
        group: str | None,
        name: str,
        tags: list[str],
        config: dict,
        run_id: str | None,
    ) -> None:
        """``wandb.init`` into ``<out_dir>/wandb`` with ``id=run_id`` (new when None), ``resume="allow"``."""
        if not self.enabled:
            return
        self.wandb_mode = resolve_wandb_mode(mode)
        if self.wandb_mode == "disabled":
            return
        import wandb

        run_id = run_id or self.saved_wandb_id() or new_run_id()
        (self.out_dir / WANDB_ID_FILE).write_text(run_id + "\n")
        self.wandb_run = wandb.init(
            project=project,
            entity=entity,
            group=group,
            name=name,
            tags=list(tags),
            config=config,
            dir=str(self.out_dir),
            mode=self.wandb_mode,
            id=run_id,
            resume="allow",
            job_type="train",
        )
        if self.wandb_mode == "offline":
            print(
                f"W&B offline run {run_id}; upload it later with: wandb sync {self.wandb_sync_dir()}",
                flush=True,
            )

    @property
    def wandb_id(self) -> str | None:
        return self.wandb_run.id if self.wandb_run is not None else None

    def wandb_sync_dir(self) -> str:
        return str(Path(self.wandb_run.dir).parent) if self.wandb_run is not None else ""

    def update_config(self, extra: dict) -> None:
        if self.wandb_run is not None:
            self.wandb_run.config.update(extra, allow_val_change=True)

    # ---------------------------------------------------------------------------------------- metrics
    def log(self, step: int, metrics: dict, *, wandb_too: bool = True) -> None:
        """Append ``{"step": step, **metrics}`` to metrics.jsonl (line-buffered) and, unless ``wandb_too`` is
        False, ``wandb.log(metrics, step=step)``."""
        if not self.enabled:
            return
        row = {"step": int(step), **{k: _jsonable(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(row) + "\n")
        if wandb_too and self.wandb_run is not None:
            self.wandb_run.log({k: _jsonable(v) for k, v in metrics.items()}, step=int(step))

    def set_summary(self, values: dict) -> None:
        """Merge into the run summary: summary.json (atomic rewrite) and the W&B summary."""
        if not self.enabled:
            return
        self.summary.update({k: _jsonable(v) for k, v in values.items()})
        write_json_atomic(self.out_dir / "summary.json", self.summary)
        if self.wandb_run is not None:
            self.wandb_run.summary.update(dict(self.summary))

    def mark_preempting(self) -> None:
        if self.wandb_run is not None and hasattr(self.wandb_run, "mark_preempting"):
            self.wandb_run.mark_preempting()

    def close(self, exit_code: int = 0) -> None:
        """Flush and close metrics.jsonl and finish the W&B run (prints the sync command when offline)."""
        if not self.enabled:
            return
        if self._jsonl is not None:
            self._jsonl.flush()
            os.fsync(self._jsonl.fileno())
            self._jsonl.close()
            self._jsonl = None
        if self.wandb_run is not None:
            sync_dir = self.wandb_sync_dir()
            self.wandb_run.finish(exit_code=exit_code)
            if self.wandb_mode == "offline":
                print(f"W&B offline run saved; upload with: wandb sync {sync_dir}", flush=True)
            self.wandb_run = None
