"""The config of ``resume=true``: Hydra's compose API composes the run's own launch overrides (recorded in
config.resolved.yaml, ``derived.overrides``) with the resume command line's on top, so a resume prepares
no data of its own and rebuilds the same model; presets and swapped group options mean what they mean to
Hydra.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

from trainer.fields import ConfigError
from trainer.rundir import RESOLVED_CONFIG, read_resolved_config

#: keys a resume never takes from the run's overrides: this command's own (where, and that it resumes)
_NOT_RESUMED = ("out_dir", "run_name", "resume")
CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"
#: saved path keys that are relative to the working directory of the run's start
_CWD_PATHS = ("data.dir", "data.source")
#: data keys a resume may change: how many processes tokenize (the tokens are the same)
_DATA_KEYS_FREE = ("data.workers",)


def _parsed(overrides: list[str]):
    """Hydra's parse of the command line's overrides, ``hydra.*`` (no run keys) left out."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(
        [o for o in overrides if not o.lstrip("+~").startswith("hydra")]
    )
    return [o for o in parsed if not o.key_or_group.startswith("hydra")]


@contextlib.contextmanager
def _hydra():
    """Hydra's compose API: the running app's (train.py), else one on configs/ for this block."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        yield
        return
    import trainer.config  # noqa: F401 - the schema and the model presets in the ConfigStore

    with initialize_config_dir(config_dir=str(CONFIGS_DIR), version_base="1.3"):
        yield


def run_overrides(saved: list[str], given: list[str]) -> list[str]:
    """The run's overrides ``saved`` with the command line's ``given`` on top: a key or group that ``given``
    names replaces the run's (later wins, as on one command line); where and whether to resume are never
    the run's."""
    named = {o.key_or_group for o in _parsed(given)}
    kept = [
        o.input_line
        for o in _parsed(saved)
        if o.key_or_group not in named and o.key_or_group.lstrip("+~") not in _NOT_RESUMED
    ]
    return kept + [o.input_line for o in _parsed(given)]


def resume_config(cfg, run_dir: Path, overrides: list[str]):
    """``(cfg, given, overrides)``: the resume's config composed from the run's overrides and this command
    line's (``run_overrides``), what the command line sets (for the start-up line) and the merged
    overrides (the run's record for its next resume); ``(cfg, None, overrides)`` for a new run or a run
    directory without a saved config (it never got through set-up).

    Raises:
        ConfigError when config.resolved.yaml cannot be read, or when the command line changes the run's
        data or seed (one loss curve, one val split per run).
    """
    from hydra import compose
    from omegaconf import OmegaConf, open_dict

    path = Path(run_dir) / RESOLVED_CONFIG
    if not cfg.resume or not path.is_file():
        return cfg, None, overrides
    try:
        saved = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        if not isinstance(saved, dict) or not saved:  # e.g. truncated by a kill: never the defaults
            raise ValueError("empty, or not a mapping")
        merged_overrides = run_overrides(saved["derived"]["overrides"], overrides)
        with _hydra():
            run = compose("config", overrides=run_overrides(saved["derived"]["overrides"], []))
            merged = compose("config", overrides=merged_overrides)
    except Exception as e:  # noqa: BLE001 - YAML, Hydra's and OmegaConf's errors alike
        raise ConfigError(
            f"resume=true: the run's saved config {path} does not load ({type(e).__name__}: "
            f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); repeat the run's original "
            "overrides on the command line, or fix or delete that file"
        ) from e
    with open_dict(merged):
        for key in _NOT_RESUMED:
            merged[key] = cfg[key]
    named = {o.key_or_group.lstrip("+~") for o in _parsed(overrides)}
    run_cwd_ = saved_cwd(saved)
    for key in _CWD_PATHS:  # a relative path means what it meant where it was given
        old = OmegaConf.select(run, key)
        if isinstance(old, str):
            OmegaConf.update(run, key, anchored(old, run_cwd_))
        new = OmegaConf.select(merged, key)
        if isinstance(new, str) and new != (where := anchored(new, None if key in named else run_cwd_)):
            OmegaConf.update(merged, key, where)
            merged_overrides = [o for o in merged_overrides if not o.lstrip("+").startswith(key + "=")]
            merged_overrides.append(f"{key}={_quoted(where)}")  # the record holds the path as meant
    changed, moved = [], False
    # seed too: it draws the training windows and picks the validation batches (one val set per run)
    for key in sorted({f"data.{k}" for k in run.data} - set(_DATA_KEYS_FREE) | {"seed"}):
        old, new = OmegaConf.select(run, key), OmegaConf.select(merged, key)
        if key in _CWD_PATHS and isinstance(old, str) and isinstance(new, str):
            same = Path(old).expanduser().resolve() == Path(new).expanduser().resolve()
        else:
            same = old == new
        if not same and key == "data.source":
            same = moved = _same_corpus(new, merged)  # the run's corpus moved (or copied) to another path
        if not same:
            changed.append(f"{key} ({old!r} -> {new!r})")
    if changed:
        raise ConfigError(
            f"resume=true refused: this command changes the run's data: {'; '.join(changed)}. A resume "
            "continues on the run's own data (one loss curve, one val split): drop those overrides, or "
            "start a new run (another out_dir) to train on other data"
        )
    given = ", ".join(o.input_line for o in _parsed(overrides) if o.key_or_group not in _NOT_RESUMED)
    given = given or "nothing"
    if moved:
        given += f" (data.source holds the same data as the run's {run.data.source}: moved)"
    return merged, given, merged_overrides


def _quoted(value: str) -> str:
    """``value`` as Hydra's override grammar reads it back: quoted unless plain."""
    return value if re.fullmatch(r"[\w./:+-]*", value) else "'" + value.replace("'", "\\'") + "'"


def _same_corpus(source, merged) -> bool:
    """``source`` (a local text file, directory or glob) holds what the run's data.dir was prepared from:
    the SHA-256 its meta.json records (a text file's bytes; a directory's file names, sizes and mtimes)."""
    import json

    from data.prepare import source_sha256

    try:
        meta = json.loads((Path(str(merged.data.dir)).expanduser() / "meta.json").read_text())
    except (OSError, ValueError):
        return False
    recorded = meta.get("source_sha256") if isinstance(meta, dict) else None
    return recorded is not None and source_sha256(source, str(merged.data.text_field)) == recorded


def saved_cwd(saved: dict) -> str | None:
    """The working directory a run started in (``derived.cwd`` of its config.resolved.yaml, as a dict),
    which its relative paths are relative to; None when it is not recorded."""
    derived = saved.get("derived") if isinstance(saved, dict) else None
    cwd = derived.get("cwd") if isinstance(derived, dict) else None
    return cwd if isinstance(cwd, str) and cwd else None


def run_cwd(run_dir: Path) -> str | None:
    """``saved_cwd`` of ``<run_dir>/config.resolved.yaml``; None when that file is absent or unreadable."""
    return saved_cwd(read_resolved_config(run_dir))


def anchored(value: str, cwd: str | None) -> str:
    """A run's saved path ``value`` as it meant it: relative to ``cwd``, the directory it started in; an
    empty value, a URL, an absolute or ``~`` path, and a path with no ``cwd`` on record stay as they are."""
    if not value or cwd is None or value.startswith("hf:") or "://" in value:
        return value
    if os.path.isabs(os.path.expanduser(value)):
        return value
    if Path(cwd) == Path.cwd():
        return value
    return str(Path(cwd) / value)
