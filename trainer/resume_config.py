"""The config of ``resume=true``: a run continues with its own saved config, not the defaults.

``resume_config(cfg, run_dir, overrides)`` loads ``<run_dir>/config.resolved.yaml`` (written at every start
of the run by trainer/setup.py) and puts on top only the keys the resume command line set
(``override_keys``), before any check or data preparation, so ``python train.py resume=true out_dir=RUN``
prepares no data of its own and rebuilds the same model.
"""

from __future__ import annotations

import os
from pathlib import Path

from trainer.fields import ConfigError
from trainer.rundir import RESOLVED_CONFIG, read_resolved_config

#: keys of config.resolved.yaml a resume never takes from it: this command's own (where, and that it resumes)
_NOT_RESUMED = ("out_dir", "run_name", "resume", "derived")
CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"


def override_keys(overrides: list[str]) -> set[str]:
    """Dotted keys the command line set: ``a.b=v`` sets ``a.b``; a group choice ``G=NAME`` sets what
    configs/G/NAME.yaml sets (``_group_keys``: the ``G`` subtree, or for a ``# @package _global_`` file
    such as ``trainer=cpu`` or ``experiment=cpu_tiny`` its keys and the groups its defaults list picks).
    ``hydra.*`` overrides are left out (they are no run keys)."""
    keys: set[str] = set()
    for key, value in _parsed(overrides):
        keys.add(key)
        if value is not None and "." not in key:
            keys |= _group_keys(key, value)
    return keys


def _parsed(overrides: list[str]) -> list[tuple[str, str | None]]:
    """(key, value or None for a bare ``~key``) of each override, ``+``/``~`` stripped, ``hydra.*`` and
    Hydra's own groups left out."""
    out = []
    for o in overrides:
        key, sep, value = o.lstrip("+~").partition("=")
        key = key.strip()
        if key and not key.startswith("hydra"):
            out.append((key, value.strip() if sep else None))
    return out


def _group_keys(group: str, name: str, depth: int = 0) -> set[str]:
    """The keys that option ``name`` of config group ``group`` sets: ``{group}`` (or its ``# @package``)
    for a packaged option or one from the ConfigStore (the model presets); for a ``_global_`` file its
    leaves and, recursively, the groups its defaults list overrides."""
    import yaml

    path = CONFIGS_DIR / group / f"{name}.yaml"
    try:
        text = path.read_text()
        spec = yaml.safe_load(text) or {}
    except (OSError, yaml.YAMLError):
        return {group}  # not a file of configs/ (a ConfigStore option, a plain key): the subtree at most
    header = next((ln for ln in text.splitlines() if ln.startswith("# @package")), "")
    package = header.split()[-1] if header else group
    if package != "_global_":
        return {package}
    keys: set[str] = set()
    for entry in (spec.pop("defaults", None) or []) if isinstance(spec, dict) else []:
        if isinstance(entry, dict) and depth < 4:
            for k, v in entry.items():
                keys |= _group_keys(str(k).split()[-1].lstrip("/"), str(v), depth + 1)

    def leaves(node: dict, prefix: str) -> None:
        for k, v in node.items():
            if isinstance(v, dict) and v:
                leaves(v, f"{prefix}{k}.")
            else:
                keys.add(f"{prefix}{k}")

    leaves(spec if isinstance(spec, dict) else {}, "")
    return keys


def _drop(saved: dict, composed, keys: set[str], prefix: str = "") -> dict:
    """``saved`` without the keys the command line set (``keys``, or a key under one of them) and without
    keys this config schema no longer has (a run saved by an older trainer)."""
    out = {}
    for k, v in saved.items():
        key = f"{prefix}{k}"
        if key in keys or any(key.startswith(p + ".") for p in keys) or k not in composed:
            continue
        if isinstance(v, dict) and hasattr(composed[k], "keys"):
            out[k] = _drop(v, composed[k], keys, key + ".")
        else:
            out[k] = v
    return out


def resume_config(cfg, run_dir: Path, overrides: list[str]):
    """The config of ``resume=true``: the run's own resolved config (``<run_dir>/config.resolved.yaml``),
    with only what this command line set on top. So ``python train.py resume=true out_dir=RUN`` continues
    the run with its data source, data dir, model and schedule, and prepares no data of its own (the
    defaults, e.g. a Tiny Shakespeare download, never come into play). Returns ``(cfg, keys)``: the merged
    DictConfig and the sorted keys the command line set over the saved ones; ``(cfg, None)`` unchanged
    for a new run or a run directory without a saved config (it never got through set-up).

    Raises:
        ConfigError when config.resolved.yaml cannot be read or no longer fits the schema.
    """
    from omegaconf import DictConfig, OmegaConf

    path = Path(run_dir) / RESOLVED_CONFIG
    if not cfg.resume or not path.is_file():
        return cfg, None
    try:
        saved = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        if not isinstance(saved, dict):
            raise ValueError("not a mapping")
        if not saved:  # an empty file (e.g. truncated by a kill) would silently resume with the defaults
            raise ValueError("empty")
        keys = override_keys(overrides) | set(_NOT_RESUMED)
        # a group option changed on resume (trainer=cpu -> trainer=gpu) also undoes what the run's old
        # option set, even keys the new one leaves at the schema default
        undone = set(keys)
        old_choices = _saved_choices(saved)
        for group in _groups_set(overrides):
            if old_choices.get(group) is not None:
                undone |= _group_keys(group, old_choices[group])
        merged = OmegaConf.merge(cfg, _drop(saved, cfg, undone))
        _anchor_relative_paths(merged, saved, keys)
    except Exception as e:  # noqa: BLE001 - YAML and OmegaConf's validation errors alike
        raise ConfigError(
            f"resume=true: the run's saved config {path} does not load ({type(e).__name__}: "
            f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); repeat the run's original "
            "overrides on the command line, or fix or delete that file"
        ) from e
    assert isinstance(merged, DictConfig)
    return merged, sorted(keys - set(_NOT_RESUMED))


def describe_set_here(overrides: list[str], keys: list[str]) -> str:
    """The "set on this command line" list of a resume's start-up line, from ``resume_config``'s keys: a
    preset that sets keys outside its own group (``experiment=cpu_tiny``, ``trainer=cpu``: a ``_global_``
    file) is named once, in command-line order, with the keys it set in parentheses (a key also given on
    its own is listed on its own instead); then the keys set one by one, sorted. "nothing" for none."""
    rest = set(keys)
    presets = []
    for key, value in _parsed(overrides):
        if value is None or "." in key or key not in rest:
            continue
        from_preset = _group_keys(key, value)
        if from_preset <= {key}:  # a plain key, or a group option that sets only its own subtree
            continue
        presets.append((key, value, from_preset))
    preset_names = {key for key, _, _ in presets}
    explicit = {key for key, _ in _parsed(overrides) if key not in preset_names}
    parts = []
    for key, value, from_preset in presets:
        mine = sorted((from_preset & rest) - explicit - {key})
        rest -= set(mine) | {key}
        parts.append(f"{key}={value}" + (f" ({', '.join(mine)})" if mine else ""))
    return ", ".join(parts + sorted(rest)) or "nothing"


# ------------------------------------------------------------------------------------------ group choices
#: where config.resolved.yaml records the run's config-group options (under "derived": never resumed)
CHOICES_KEY = "group_choices"


def _groups_set(overrides: list[str]) -> set[str]:
    """Config groups the command line chose an option of (``G=NAME``, ``+G=NAME``; no dotted keys)."""
    return {key for key, value in _parsed(overrides) if value is not None and "." not in key}


def _saved_choices(saved: dict) -> dict:
    derived = saved.get("derived")
    choices = derived.get(CHOICES_KEY) if isinstance(derived, dict) else None
    return {str(k): str(v) for k, v in choices.items() if v is not None} if isinstance(choices, dict) else {}


def run_choices(run_dir: Path, overrides: list[str], resume: bool) -> dict[str, str]:
    """This run's config-group options, for config.resolved.yaml: Hydra's runtime choices (its own
    ``hydra/*`` groups left out; {} outside a Hydra app). On resume the run's recorded options stay for
    the groups this command line does not choose (Hydra's choices there are the defaults, not the run's)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {}
    current = {
        str(k): str(v)
        for k, v in HydraConfig.get().runtime.choices.items()
        if v is not None and not str(k).startswith("hydra")
    }
    if not resume:
        return current
    old = _saved_choices(read_resolved_config(run_dir))  # resume_config has refused a broken record
    if not old:
        return current
    chosen = _groups_set(overrides)
    return {**old, **{g: v for g, v in current.items() if g in chosen}}


#: saved path keys that are relative to the working directory of the run's start
_CWD_PATHS = ("data.dir", "data.source")


def saved_cwd(saved: dict) -> str | None:
    """The working directory a run started in (``derived.cwd`` of its config.resolved.yaml, as a dict),
    which its relative paths are relative to; None when it is not recorded."""
    derived = saved.get("derived") if isinstance(saved, dict) else None
    cwd = derived.get("cwd") if isinstance(derived, dict) else None
    return cwd if isinstance(cwd, str) and cwd else None


def run_cwd(run_dir: Path) -> str | None:
    """``saved_cwd`` of ``<run_dir>/config.resolved.yaml``; None when that file is absent or unreadable
    (a checkpoint copied out of its run, a run from before the record)."""
    return saved_cwd(read_resolved_config(run_dir))


def anchored(value: str, cwd: str | None) -> str:
    """A run's saved path ``value`` as it meant it: relative to ``cwd``, the directory it started in, when
    it is relative and ``cwd`` is not this process's working directory; an empty value, a URL, an absolute
    or ``~`` path, and any path with no ``cwd`` on record come back as they are."""
    if not value or cwd is None or "://" in value or os.path.isabs(os.path.expanduser(value)):
        return value
    if Path(cwd) == Path.cwd():
        return value
    return str(Path(cwd) / value)


def _anchor_relative_paths(merged, saved: dict, set_here: set[str]) -> None:
    """A relative data.dir / data.source taken from the saved config means what it meant in the run's own
    working directory (``derived.cwd``), not in the resume's: a resume from elsewhere would otherwise
    prepare (or download) the data again in a new place. Keys this command line set keep their value."""
    from omegaconf import OmegaConf

    cwd = saved_cwd(saved)
    for key in _CWD_PATHS:
        value = OmegaConf.select(merged, key)
        if key not in set_here and isinstance(value, str) and anchored(value, cwd) != value:
            OmegaConf.update(merged, key, anchored(value, cwd))
