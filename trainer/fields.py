"""Declared checks of config fields (used by trainer/config.py's dataclasses) and ``ConfigError``.

``spec(default, doc, check, example)`` makes a dataclass field that carries its one-line doc and a check;
``check_fields`` applies the checks of a whole (nested) schema to a composed config and ``problem_with``
words one failure: the key, the bad value and a valid value, as every config error of the trainer does.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, field, fields, is_dataclass


class ConfigError(Exception):
    """A mistake in the run's config or inputs. ``str(err)`` names the key and a valid value (the fix)."""


# ------------------------------------------------------------------------------------------ field specs
POS_INT, NONNEG_INT, FINITE, NONNEG, UNIT, BOOL = "int>0", "int>=0", "finite", "float>=0", "[0,1)", "bool"
OPEN_UNIT = "(0,1)"  # strictly between 0 and 1 (a share that must leave something on both sides)

_WHAT = {
    POS_INT: "must be a positive integer",
    NONNEG_INT: "must be a non-negative integer",
    FINITE: "is not a finite number",
    NONNEG: "must be >= 0",
    UNIT: "must be in [0, 1)",
    OPEN_UNIT: "must be in (0, 1), strictly",
}


def spec(default, doc: str, check=None, example=None):
    """A dataclass field with its one-line ``doc`` and its value check.

    Args:
        default: the default value (a list is copied per instance).
        doc: one line: what the key does, its unit, what null means.
        check: POS_INT | NONNEG_INT | FINITE | NONNEG | UNIT | OPEN_UNIT | BOOL, or a tuple of the valid
            values, or None.
        example: a valid value for error messages (default: ``default``).
    """
    kw = {"default_factory": lambda: list(default)} if isinstance(default, list) else {"default": default}
    example = default if example is None else example
    return field(**kw, metadata={"doc": doc, "check": check, "example": example})


def fmt(v) -> str:
    """A value as typed on the command line (null, true, 6e-04 ...)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def problem_with(key: str, value, check, example, nullable: bool = False) -> str | None:
    """Why ``value`` fails ``check`` (see ``spec``) as a message naming ``key`` and a valid value, or None.
    A null value passes (nullable fields are typed ``Optional``; OmegaConf refuses null elsewhere); for
    those, ``nullable`` says so in the message ("must be null or a positive integer")."""
    if value is None or check is None:
        return None
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if isinstance(check, tuple):
        if any(value == c and type(value) is type(c) for c in check):  # 1 is not true
            return None
        return f"{key}={value!r} is not valid; choose one of: {', '.join(map(fmt, check))}"
    if check == BOOL:
        return None if isinstance(value, bool) else f"{key}={value!r} is not valid; choose true or false"
    if check in (POS_INT, NONNEG_INT):
        if is_int and (value > 0 if check == POS_INT else value >= 0):
            return None
        what = _WHAT[check].replace("must be ", "must be null or ") if nullable else _WHAT[check]
        return f"{key}={value!r} {what}, e.g. {key}={fmt(example)}"
    try:
        x = math.nan if isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        x = math.nan
    if not math.isfinite(x):
        return f"{key}={value!r} is not a finite number, e.g. {key}={fmt(example)}"
    if (
        (check == NONNEG and x < 0)
        or (check == UNIT and not 0.0 <= x < 1.0)
        or (check == OPEN_UNIT and not 0.0 < x < 1.0)
    ):
        return f"{key}={value!r} {_WHAT[check]}, e.g. {key}={fmt(example)}"
    return None


def check_fields(node, schema: type, prefix: str = "", *, ignore=frozenset(), unknown=None) -> None:
    """Apply every field's ``check`` of dataclass ``schema`` to ``node`` (a DictConfig), recursing into
    nested dataclass fields.

    Args:
        ignore: keys of ``node`` (at this level) that are not the schema's, e.g. Hydra's ``hydra``.
        unknown: ``unknown(full_key) -> message`` for a key the schema does not have (Hydra's ``+key=value``
            gets past OmegaConf); None: a short default message.

    Raises:
        ConfigError: the first failing or unknown key, with a valid value.
    """
    known = {f.name for f in fields(schema)} | set(ignore)
    extra = [k for k in (node.keys() if hasattr(node, "keys") else ()) if k not in known]
    if extra:
        key = prefix + str(extra[0])
        raise ConfigError(unknown(key) if unknown else f"{key} is not a config key")
    for f in fields(schema):
        key = prefix + f.name
        value = getattr(node, f.name, None)
        sub = dataclass_type(f)
        if sub is not None and value is not None:
            check_fields(value, sub, key + ".", unknown=unknown)
            continue
        msg = problem_with(key, value, f.metadata.get("check"), f.metadata.get("example"), is_nullable(f))
        if msg:
            raise ConfigError(msg)


def is_nullable(f) -> bool:
    """Whether dataclass field ``f`` is typed ``X | None``."""
    return "None" in str(f.type)


def dataclass_type(f) -> type | None:
    if f.default_factory is not MISSING and is_dataclass(f.default_factory):
        return f.default_factory
    return None
