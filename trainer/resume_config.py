"""The config of ``resume=true``: the run's own saved config (config.resolved.yaml) with only what the
resume command line changes on top, as Hydra's compose API composes it (presets and swapped group options
included), so a resume prepares no data of its own and rebuilds the same model.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from trainer.fields import ConfigError
from trainer.metrics import first_line
from trainer.rundir import RESOLVED_CONFIG, parse_overrides, read_resolved_config

#: keys of config.resolved.yaml a resume never takes from it: this command's own (where, and that it resumes)
_NOT_RESUMED = ("out_dir", "run_name", "resume", "derived")
CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"
CHOICES_KEY = "group_choices"  # the run's config-group options, under config.resolved.yaml's "derived"
_DATA_KEYS_FREE = ("data.workers",)  # data keys a resume may change: how many processes tokenize
_CWD_PATHS = ("data.dir", "data.source")  # saved path keys relative to the working directory of the run


def _hydra():
    """Hydra's compose API: the running app's (train.py), else one on configs/ for this block."""
    if GlobalHydra.instance().is_initialized():
        return contextlib.nullcontext()
    import trainer.config  # noqa: F401 - the schema and the model presets in the ConfigStore

    return initialize_config_dir(config_dir=str(CONFIGS_DIR), version_base="1.3")


def _leaves(node, prefix: str = "") -> dict:
    out = {}
    for k, v in node.items():
        if isinstance(v, dict) and v:
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def changed_keys(choices: dict[str, str], overrides: list[str]) -> tuple[set[str], str]:
    """What this command line sets over a run composed from the group options ``choices``: the dotted keys
    it names or whose composed value it changes (a preset, a swapped group option), and their description
    (``experiment=cpu_tiny (batch.micro_tokens, ..., seq_len), max_steps``; "nothing" for none)."""
    parsed = parse_overrides(overrides)
    named = {o.key_or_group for o in parsed}
    base = [f"{g}={v}" for g, v in choices.items()]
    rest = [b for b, g in zip(base, choices, strict=True) if g not in named]
    with _hydra():
        before = compose("config", overrides=base)
        after = compose("config", overrides=rest + [o.input_line for o in parsed], return_hydra_config=True)
    groups = set(after.hydra.runtime.choices)
    a, b = (_leaves(OmegaConf.to_container(c, resolve=False)) for c in (before, after))
    keys = {o.key_or_group for o in parsed if o.key_or_group not in groups}
    by_options = {k for k in a.keys() | b.keys() if not k.startswith("hydra.") and a.get(k) != b.get(k)}
    keep = lambda k: k.split(".")[0] not in _NOT_RESUMED  # noqa: E731
    keys, by_options = {k for k in keys if keep(k)}, {k for k in by_options - keys if keep(k)}
    chosen = ", ".join(o.input_line.lstrip("+") for o in parsed if o.key_or_group in groups)
    if chosen and by_options:
        chosen += f" ({', '.join(sorted(by_options))})"
    return keys | by_options, ", ".join(([chosen] if chosen else []) + sorted(keys)) or "nothing"


def _drop(saved: dict, composed, keys: set[str], prefix: str = "") -> dict:
    """``saved`` without ``keys`` (and keys under them) and keys the schema no longer has."""
    out = {}
    for k, v in saved.items():
        key = f"{prefix}{k}"
        if key in keys or any(key.startswith(p + ".") for p in keys) or k not in composed:
            continue
        out[k] = (
            _drop(v, composed[k], keys, key + ".")
            if isinstance(v, dict) and hasattr(composed[k], "keys")
            else v
        )
    return out


def resume_config(cfg, run_dir: Path, overrides: list[str]):
    """The run's own config.resolved.yaml with only what this command line changes on top, and the
    description of those changes (None without a record)."""
    path = Path(run_dir) / RESOLVED_CONFIG
    main = os.environ.get("RANK", "0") == "0"
    if cfg.resume and main and not path.is_file() and (Path(run_dir) / "ckpt").is_dir():
        # a run without its config (deleted, left out of a copy): said before any data is prepared
        launch = Path(run_dir) / ".hydra" / "overrides.yaml"
        with contextlib.suppress(Exception):
            launch = f"{launch}: {' '.join(OmegaConf.load(launch))}"
        print(
            f"warning: resume=true: {path} is missing, so this resume's config is the command line's (the "
            f"defaults and its overrides), which the checkpoint's checks then compare with the run's; the "
            f"run's own launch overrides are in {launch}",
            file=sys.stderr,
            flush=True,
        )
    if not cfg.resume or not path.is_file():
        return cfg, None
    try:
        saved = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        if not isinstance(saved, dict):
            raise ValueError("not a mapping")
        if not saved:  # an empty file (e.g. truncated by a kill) would silently resume with the defaults
            raise ValueError("empty")
        keys, given = changed_keys(_saved_choices(saved), overrides)
        merged = OmegaConf.merge(cfg, _drop(saved, cfg, keys | set(_NOT_RESUMED)))
        _anchor_relative_paths(merged, saved, keys)
    except Exception as e:  # noqa: BLE001 - YAML, Hydra's and OmegaConf's errors alike
        raise ConfigError(
            f"resume=true: the run's saved config {path} does not load ({first_line(e)}); repeat the run's "
            "original overrides on the command line, or fix or delete that file"
        ) from e
    assert isinstance(merged, DictConfig)
    changed, moved = _data_changes(saved, merged, keys)
    if changed:
        raise ConfigError(
            f"resume=true refused: this command changes the run's data: {'; '.join(changed)}. A resume "
            "continues on the run's own data (one loss curve, one val split): drop those overrides, or "
            "start a new run (another out_dir) to train on other data"
        )
    if moved:
        given += f" (data.source holds the same data as the run's {_leaves(saved).get('data.source')}: moved)"
    return merged, given


def _data_changes(saved: dict, merged, keys: set[str]) -> tuple[list[str], bool]:
    """``key (run's value -> this command's)`` for each ``data.*`` key (and ``seed``) the command line changed
    (paths compared where they point), and whether data.source is another path of the run's corpus (moved)."""
    cwd, run, out, moved = saved_cwd(saved), _leaves(saved), [], False
    # seed too: it draws the training windows and picks the validation batches (one val set per run)
    for key in sorted(k for k in keys if (k.startswith("data.") or k == "seed") and k not in _DATA_KEYS_FREE):
        old, new = run.get(key), OmegaConf.select(merged, key)
        if key in _CWD_PATHS and isinstance(old, str) and isinstance(new, str):
            same = Path(anchored(old, cwd)).expanduser().resolve() == Path(new).expanduser().resolve()
        else:
            same = old == new
        if not same and key == "data.source":
            same = moved = _same_corpus(new, merged)  # the run's corpus moved (or copied) to another path
        if not same:
            out.append(f"{key} ({old!r} -> {new!r})")
    return out, moved


def _same_corpus(source, merged) -> bool:
    """``source`` (a local file, directory or glob) has the SHA-256 the run's data.dir/meta.json records."""
    from data.prepare import source_sha256
    from trainer.checks import prepared_meta

    meta = prepared_meta(merged)
    recorded = meta.get("source_sha256") if isinstance(meta, dict) else None
    return recorded is not None and source_sha256(source, str(merged.data.text_field)) == recorded


# ------------------------------------------------------------------------------------------ group choices
def _derived(saved, key: str):
    derived = saved.get("derived") if isinstance(saved, dict) else None
    return derived.get(key) if isinstance(derived, dict) else None


def _saved_choices(saved: dict) -> dict:
    choices = _derived(saved, CHOICES_KEY)
    return {str(k): str(v) for k, v in choices.items() if v is not None} if isinstance(choices, dict) else {}


def run_choices(run_dir: Path, overrides: list[str], resume: bool) -> dict[str, str]:
    """This run's config-group options for config.resolved.yaml (Hydra's own groups left out)."""
    if not HydraConfig.initialized():
        return {}
    current = {
        str(k): str(v)
        for k, v in HydraConfig.get().runtime.choices.items()
        if v is not None and not str(k).startswith("hydra")
    }
    old = _saved_choices(read_resolved_config(run_dir)) if resume else {}
    chosen = {o.key_or_group for o in parse_overrides(overrides)}
    return {**old, **{g: v for g, v in current.items() if g in chosen or g not in old}}


def saved_cwd(saved: dict) -> str | None:
    """The working directory a run started in (``derived.cwd``), None when it is not recorded."""
    cwd = _derived(saved, "cwd")
    return cwd if isinstance(cwd, str) and cwd else None


def run_cwd(run_dir: Path) -> str | None:
    return saved_cwd(read_resolved_config(run_dir))


def anchored(value: str, cwd: str | None) -> str:
    """A run's saved relative path ``value`` as it meant it: relative to ``cwd``, the directory it started in;
    an empty value, a URL, an absolute or ``~`` path, or no ``cwd`` on record: as it is."""
    if not value or cwd is None or "://" in value or os.path.isabs(os.path.expanduser(value)):
        return value
    return value if Path(cwd) == Path.cwd() else str(Path(cwd) / value)


def _anchor_relative_paths(merged, saved: dict, set_here: set[str]) -> None:
    """A relative data.dir / data.source from the saved config means what it meant in the run's own cwd: a
    resume from elsewhere would otherwise prepare (or download) the data again in a new place."""
    cwd = saved_cwd(saved)
    for key in _CWD_PATHS:
        value = OmegaConf.select(merged, key)
        if key not in set_here and isinstance(value, str) and anchored(value, cwd) != value:
            OmegaConf.update(merged, key, anchored(value, cwd))
