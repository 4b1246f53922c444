"""Hydra/OmegaConf composition errors as ``ConfigError`` (the trainer's wording: key and a valid value).

train.py (and tests/helpers_train.run_inprocess) print the result as ``config error: ...`` and exit 2;
sample.py and eval.py do the same against their own schemas (``schema=``, trainer/infer_config.py).
"""

from __future__ import annotations

import difflib
from dataclasses import fields

from trainer.config import TrainConfig
from trainer.fields import BOOL, FINITE, NONNEG_INT, ConfigError, dataclass_type, is_nullable, problem_with


def config_error_from(exc: BaseException, schema: type = TrainConfig) -> ConfigError | None:
    """The ``ConfigError`` for a Hydra/OmegaConf composition error (walks ``__cause__``), or None when
    ``exc`` is not one (a bug: let it raise). ``schema``: the dataclass the config was composed on
    (train.py's ``TrainConfig``; sample.py / eval.py pass theirs), whose keys the messages name.

    Wrong type: the key's check message (``seq_len='abc' must be a positive integer, e.g. seq_len=1024``).
    Unknown key: the key, the valid keys beside it and the closest one. Unknown group option: the options.
    Unparsable override: Hydra's own parse message.
    """
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
    from omegaconf.errors import (
        ConfigAttributeError,
        ConfigKeyError,
        OmegaConfBaseException,
        ValidationError,
    )

    unknown = (ConfigKeyError, ConfigAttributeError)

    e: BaseException | None = exc
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, MissingConfigException):
            return ConfigError(_missing_option(e))
        if isinstance(e, (*unknown, ValidationError)) and getattr(e, "full_key", None):
            key = str(e.full_key)
            if isinstance(e, unknown):
                return ConfigError(unknown_key(key, schema))
            check, example = _spec_of(key, schema)
            f = _field_of(key, schema)
            nullable = f is not None and is_nullable(f)
            msg = problem_with(key, e.value, check or _type_check(key, schema), example, nullable)
            if msg is None:
                msg = f"{key}={e.value!r} is not valid: {str(e).splitlines()[0]}"
            return ConfigError(msg)
        if isinstance(e, OverrideParseException):
            return ConfigError(
                f"{str(e).splitlines()[0]} (overrides are key=value, e.g. seq_len=1024; quote a value "
                "with spaces, non-ASCII or special characters, e.g. \"prompt='héllo, world'\")"
            )
        nxt = e.__cause__ or e.__context__
        if nxt is None and isinstance(e, (ConfigCompositionException, OmegaConfBaseException)):
            return ConfigError(str(e).splitlines()[0])
        e = nxt
    return None


def _field_of(key: str, schema: type = TrainConfig):
    f = None
    for part in key.split("."):
        if schema is None:
            return None
        f = next((x for x in fields(schema) if x.name == part), None)
        if f is None:
            return None
        schema = dataclass_type(f)
    return f


def _spec_of(key: str, schema: type = TrainConfig):
    f = _field_of(key, schema)
    return (f.metadata.get("check"), f.metadata.get("example")) if f is not None else (None, None)


def _type_check(key: str, schema: type = TrainConfig):
    """A check from the field's type when its spec has none (e.g. ``data.source`` is a string)."""
    f = _field_of(key, schema)
    t = str(f.type) if f is not None else ""
    return BOOL if "bool" in t else FINITE if "float" in t else NONNEG_INT if "int" in t else None


SUGGEST_CUTOFF = 0.75  # difflib ratio a key needs to be offered as "did you mean"


def unknown_key(key: str, schema: type = TrainConfig) -> str:
    """Message for ``key``, which ``schema`` (default ``TrainConfig``) does not have: the closest valid key
    and those beside it."""
    parent, _, name = key.rpartition(".")
    where_keys = "trainer/config.py" if schema is TrainConfig else "trainer/infer_config.py"
    if parent:
        f = _field_of(parent, schema)
        schema = dataclass_type(f) if f is not None else None
    if schema is None:
        return f"{key} is not a config key (nor is {parent}); see {where_keys} for the keys"
    names = [f.name for f in fields(schema)]
    # only a close match (a letter or two off: temprature, sq_len, bathces, all >= 0.85): difflib's
    # default cutoff 0.6 suggested dtype for +typo=1 (0.67), a guess that misleads more than it helps
    close = difflib.get_close_matches(name, names, n=1, cutoff=SUGGEST_CUTOFF)
    full = [f"{parent}.{n}" if parent else n for n in names]
    hint = f"did you mean {full[names.index(close[0])]}? " if close else ""
    where = f"under {parent}" if parent else "at the top level"
    return f"{key} is not a config key; {hint}valid keys {where}: {', '.join(full)}"


def _missing_option(e) -> str:
    text = str(e)
    group = getattr(e, "missing_cfg_file", None) or ""
    opts = list(getattr(e, "options", None) or [])
    if "/" in str(group) and opts:
        g, _, name = str(group).rpartition("/")
        choices = ", ".join(f"{g}={o}" for o in opts)
        return f"{g}={name} is not a config of group {g}; choose one of: {choices}"
    return text.splitlines()[0]
