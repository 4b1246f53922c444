"""The config of ``resume=true``: Hydra's compose API composes the run's own launch overrides (recorded in
config.resolved.yaml, ``derived.overrides``) with the resume command line's on top, so a resume prepares
no data of its own and rebuilds the same model; presets and swapped group options mean what they mean to
Hydra. Where the run's overrides now compose to other values than it trained with (configs/ edited since its
launch), the resume is refused, naming those keys and the overrides that keep the run's values. A run from
before ``derived.overrides`` resumes from its launch's ``.hydra/overrides.yaml``.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

from trainer.fields import ConfigError, fmt
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
        ConfigError when config.resolved.yaml cannot be read; when the run's overrides no longer compose
        to its saved values (``_drift``); when the command line changes the run's data or seed (one loss
        curve, one val split per run).
    """
    from hydra import compose
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf, open_dict

    path = Path(run_dir) / RESOLVED_CONFIG
    if not cfg.resume or not path.is_file():
        return cfg, None, overrides
    try:
        saved = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        if not isinstance(saved, dict) or not saved:  # e.g. truncated by a kill: never the defaults
            raise ValueError("empty, or not a mapping")
        recorded, source = _recorded_overrides(saved, Path(run_dir))
        with _hydra():
            if recorded is None:  # no record: this command line's config options are taken for the run's
                groups = set(GlobalHydra.instance().config_loader().list_groups(""))
                recorded = [o.input_line for o in _parsed(overrides) if _key(o).split("/")[0] in groups]
            merged_overrides = run_overrides(recorded, overrides)
            run = compose("config", overrides=run_overrides(recorded, []))
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
    named = {_key(o) for o in _parsed(overrides)}
    run_cwd_ = saved_cwd(saved)
    for key in _CWD_PATHS:  # a relative path means what it meant where it was given
        old = OmegaConf.select(run, key)
        if isinstance(old, str):
            OmegaConf.update(run, key, anchored(old, run_cwd_))
        new = OmegaConf.select(merged, key)
        if isinstance(new, str) and new != (where := anchored(new, None if key in named else run_cwd_)):
            OmegaConf.update(merged, key, where)
            merged_overrides = [o for o in merged_overrides if not o.lstrip("+").startswith(key + "=")]
            merged_overrides.append(override_text(key, where))  # the record holds the path as meant
    was = {
        k: anchored(v, run_cwd_) if k in _CWD_PATHS and isinstance(v, str) else v for k, v in _leaves(saved)
    }
    asked = [o.input_line for o in _parsed(overrides) if _key(o) not in _NOT_RESUMED]
    if drift := _drift(was, run, merged):
        raise ConfigError(_drift_message(drift, source, path, bare=not asked))
    changed, moved = [], False
    # seed too: it draws the training windows and picks the validation batches (one val set per run)
    for key in sorted({f"data.{k}" for k in run.data} - set(_DATA_KEYS_FREE) | {"seed"}):
        old, new = was.get(key, OmegaConf.select(run, key)), OmegaConf.select(merged, key)
        same = _same(key, old, new)
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
    given = ", ".join(asked) or "nothing"
    if moved:
        given += f" (data.source holds the same data as the run's {was.get('data.source')}: moved)"
    return merged, given, merged_overrides


def _key(override) -> str:
    """The key or group an override names, without its ``+`` / ``~``."""
    return override.key_or_group.lstrip("+~")


def _recorded_overrides(saved: dict, run_dir: Path) -> tuple[list[str] | None, str | None]:
    """``(overrides, where)``: the run's launch overrides and where they were read: config.resolved.yaml's
    ``derived.overrides``, else (a run started by an older flashgpt) ``.hydra/overrides.yaml``, the launch's
    own record; ``(None, None)`` when neither is there."""
    from omegaconf import OmegaConf

    derived = saved.get("derived")
    if isinstance(derived, dict) and "overrides" in derived:
        return [str(o) for o in derived["overrides"]], "the run's overrides (derived.overrides)"
    launch = run_dir / ".hydra" / "overrides.yaml"
    if launch.is_file():
        return [str(o) for o in OmegaConf.to_container(OmegaConf.load(launch))], (
            f"the run's launch overrides ({launch}: an older flashgpt started it)"
        )
    return None, None


def _leaves(d: dict, prefix: str = ""):
    """``(dotted key, value)`` of each leaf of a saved config (lists are leaves)."""
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _same(key: str, old, new) -> bool:
    """``old == new``; paths (``_CWD_PATHS``) compared where they point."""
    if key in _CWD_PATHS and isinstance(old, str) and isinstance(new, str):
        return Path(old).expanduser().resolve() == Path(new).expanduser().resolve()
    return old == new


#: saved keys never compared with the composition: the run's derived values, and where and whether it
#: resumes (``out_dir`` / ``run_name`` hold the folder; a composition draws ``${now:}`` and ``${run_token:}``)
_NOT_COMPARED = ("derived", *_NOT_RESUMED)


def _drift(was: dict, run, merged) -> list[tuple[str, object, object]]:
    """``(key, run's value, value composed now)`` for each key whose saved value (``was``) the run's overrides
    no longer compose to (configs/ edited since its launch) and that this command line leaves as composed:
    a resume would train on with it silently changed."""
    from omegaconf import OmegaConf

    now, given = (dict(_leaves(OmegaConf.to_container(c, resolve=True))) for c in (run, merged))
    return [
        (k, v, now[k])
        for k, v in was.items()
        if k.split(".")[0] not in _NOT_COMPARED
        and k in now  # a key this trainer no longer has is nothing to keep; a new one has no saved value
        and not _same(k, v, now[k])
        and _same(k, given.get(k), now[k])
    ]


def _drift_message(drift: list, source: str | None, path: Path, bare: bool) -> str:
    """The refusal of a resume with ``_drift``: each key with both values and the overrides that keep the
    run's; for a run without a record of its overrides (``source`` None), how to give them."""
    import shlex

    keys = ", ".join(f"{k} (run {fmt(v)}, now {fmt(n)})" for k, v, n in drift)
    words = " ".join(shlex.quote(override_text(k, v)) for k, v, _ in drift)
    older = (
        f"resume=true refused: the run was started by an older flashgpt, which recorded no overrides (no "
        f"derived.overrides in {path}, no .hydra/overrides.yaml beside it)"
    )
    if source is None and bare:
        return (
            f"{older}, and today's defaults differ from its config in {', '.join(k for k, _, _ in drift)}. "
            "Repeat the run's original overrides with resume=true: python train.py <its overrides> "
            f"resume=true {shlex.quote(override_text('out_dir', str(path.parent)))}; a key that still "
            "differs is then named with its value"
        )
    what = (
        f"{older}; this command line's config options" if source is None else f"resume=true refused: {source}"
    )
    return (
        f"{what} compose with today's configs/ to other values than the run trained with ({path}): "
        f"{keys}. To continue with the run's values add {words} to the resume command line; or start a "
        "new run (another out_dir) with the values composed now"
    )


def override_text(key: str, value) -> str:
    """``key=value`` as Hydra's override grammar reads ``value`` back: plain where it parses back as it is
    (a path, 0.0006, null, [1,2]), else quoted (a path with spaces or ``=``, a string like ``123``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if isinstance(value, list | tuple):
        plain = "[" + ",".join(override_text("k", v)[2:] for v in value) + "]"
    else:
        plain = fmt(value)
    try:
        if OverridesParser.create().parse_override(f"{key}={plain}").value() == value:
            return f"{key}={plain}"
    except Exception:  # noqa: BLE001 - Hydra's grammar refuses it: quoted
        pass
    # Hydra's quoted string: a backslash before a quote or at the end is doubled, a quote escaped
    text = re.sub(r"(\\+)(?='|$)", r"\1\1", str(value)).replace("'", "\\'")
    return f"{key}='{text}'"


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
