"""Read the files of a training run directory (see spec: `.hydra/config.yaml`, `metrics.jsonl`,
`summary.json`), tolerant of missing keys, partial files and older config layouts."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

RUN_MARKERS = ("summary.json", "metrics.jsonl", ".hydra/config.yaml")


class RunDirError(FileNotFoundError):
    """A run directory (or a required file in it) is missing or unreadable."""


def find_run_dirs(root: str | Path) -> list[Path]:
    """Every directory at or under `root` holding one of RUN_MARKERS, sorted, skipping `wandb/`,
    `ckpt/` and hidden folders. Raises RunDirError when `root` is not a directory."""
    root = Path(root)
    if not root.is_dir():
        raise RunDirError(
            f"sweep directory {root} does not exist (pass the Hydra multirun folder, "
            f"e.g. multirun/2025-01-01_12-00-00)"
        )
    found = set()
    for marker in ("summary.json", "metrics.jsonl", "config.yaml"):
        for p in root.rglob(marker):
            run = p.parent.parent if p.parent.name == ".hydra" else p.parent
            if marker == "config.yaml" and p.parent.name != ".hydra":
                continue
            rel = run.relative_to(root).parts if run != root else ()
            if any(part in ("wandb", "ckpt") or part.startswith(".") for part in rel):
                continue
            found.add(run)
    return sorted(found, key=lambda p: (len(p.parts), _natural_key(p.name)))


def _natural_key(name: str) -> tuple:
    import re

    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def read_metrics(run_dir: str | Path, *, required: bool = False) -> list[dict]:
    """Parsed lines of the live branch of `run_dir/metrics.jsonl` (a path to the file itself is accepted).

    Only the live branch: the trainer moves the steps a resume replays to `metrics.abandoned.*.jsonl`
    (never read here), and in files written before it did, the lines of abandoned steps (those after a
    later line's lower step) are dropped (`trainer.metrics.live_branch`).
    Blank lines are skipped; an unparsable line (e.g. a truncated last line of a killed run) is skipped
    with a warning on stderr. Missing file: [] or, with `required`, RunDirError.
    """
    path = Path(run_dir)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        if required:
            raise RunDirError(
                f"{path} not found: pass a run directory written by train.py "
                f"(it holds metrics.jsonl) or the metrics.jsonl file itself"
            )
        return []
    rows = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                print(f"warning: {path}:{lineno}: unparsable JSON line skipped", file=sys.stderr)
                continue
            if isinstance(obj, dict):
                rows.append(obj)
    from trainer.metrics import live_branch

    return live_branch(rows)


def read_summary(run_dir: str | Path) -> dict:
    """`run_dir/summary.json` as a dict, {} when missing or unreadable (warning on stderr)."""
    path = Path(run_dir) / "summary.json"
    if not path.is_file():
        return {}
    try:
        obj = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        print(f"warning: {path}: unreadable summary ({exc})", file=sys.stderr)
        return {}
    return obj if isinstance(obj, dict) else {}


def run_status(run_dir: str | Path, summary: dict | None = None) -> tuple[str | None, str | None]:
    """``(status, note)``: summary.json's status as it really is (``trainer.rundir.true_status``): a
    "running" summary whose process is gone (no live process holds the run directory's lock) is
    ``"killed"``, with the note "killed / unfinished (last step S): ..."; note None otherwise."""
    from trainer.rundir import true_status

    run_dir = Path(run_dir)
    return true_status(run_dir, read_summary(run_dir) if summary is None else summary)


#: statuses of a run that did not reach its end and still holds no ending: killed, or still training
UNFINISHED_STATUSES = ("killed", "running")


def read_config(run_dir: str | Path) -> dict:
    """The run's config as a plain dict: `run_dir/config.resolved.yaml` (written by the trainer when the run
    starts, so a later refused command cannot change it), else Hydra's `.hydra/config.yaml` with
    interpolations left unresolved ({} if neither exists). Hydra rewrites `.hydra/` for every command
    pointed at the directory, even one the trainer then refuses."""
    path = Path(run_dir) / "config.resolved.yaml"
    if not path.is_file():
        path = Path(run_dir) / ".hydra" / "config.yaml"
    if not path.is_file():
        return {}
    try:
        from omegaconf import OmegaConf

        cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception:
        try:
            import yaml

            cfg = yaml.safe_load(path.read_text())
        except Exception as exc:
            print(f"warning: {path}: unreadable config ({exc})", file=sys.stderr)
            return {}
    return cfg if isinstance(cfg, dict) else {}


def cfg_get(cfg: dict, dotted: str, default: Any = None) -> Any:
    """cfg['a']['b'] for 'a.b'; `default` when any level is missing or not a mapping."""
    cur: Any = cfg
    for key in dotted.split("."):
        if not isinstance(cur, dict) or key not in cur:
            return default
        cur = cur[key]
    return cur


def _is_plain(v: Any) -> bool:
    return v is not None and not (isinstance(v, str) and "${" in v)


def attention_label(cfg: dict, summary: dict) -> str | None:
    """Backend label: config `attention.name` (else `attention.backend`, else `attention` as a string,
    else `model.attention`), then summary['attention']; sdpa pinned to a backend becomes 'sdpa-<backend>'."""
    name = None
    for key in ("attention.name", "attention.backend", "attention", "model.attention"):
        v = cfg_get(cfg, key)
        if _is_plain(v) and not isinstance(v, dict):
            name = str(v)
            break
    if name is None and _is_plain(summary.get("attention")):
        name = str(summary["attention"])
    if name == "sdpa":
        for key in ("attention.sdpa_backend", "sdpa_backend", "model.sdpa_backend"):
            sb = cfg_get(cfg, key)
            if _is_plain(sb) and str(sb) != "auto":
                return f"sdpa-{sb}"
    return name


def variant_label(cfg: dict) -> str:
    """' w=<window>', ' doc-mask' and ' attn-drop=<p>' for the attention variants a run config sets (issue
    16: attention.window, attention.document_mask, model.attn_dropout), '' for plain causal attention."""
    out = ""
    window = cfg_get(cfg, "attention.window")
    if _is_plain(window):
        out += f" w={window}"
    if cfg_get(cfg, "attention.document_mask") is True:
        out += " doc-mask"
    p = cfg_get(cfg, "model.attn_dropout")
    if _is_plain(p) and isinstance(p, (int, float)) and p > 0:
        out += f" attn-drop={p:g}"
    return out


def seq_len_of(cfg: dict, summary: dict) -> int | None:
    """Sequence length: config `seq_len` (else `data.seq_len`, `model.block_size`), else summary."""
    for v in (
        cfg_get(cfg, "seq_len"),
        cfg_get(cfg, "data.seq_len"),
        cfg_get(cfg, "model.block_size"),
        summary.get("seq_len"),
    ):
        try:
            if _is_plain(v):
                return int(v)
        except (TypeError, ValueError):
            continue
    return None


def series(rows: list[dict], key: str) -> dict[int, float]:
    """{step: value} for rows having `key` and an integer 'step' (a later duplicate step replaces the
    earlier one; `read_metrics` already keeps only the live branch), sorted by step. Non-numeric values
    are skipped; NaN is kept."""
    out: dict[int, float] = {}
    for r in rows:
        if key in r and "step" in r:
            try:
                out[int(r["step"])] = float(r[key])
            except (TypeError, ValueError):
                continue
    return dict(sorted(out.items()))


def finite(x: Any) -> bool:
    """True for a real finite number."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
