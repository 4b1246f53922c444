"""Config fields that carry their doc and check, and every config mistake worded the same way: the key,
the bad value and a valid value (``ConfigError``; ``config_error_from`` for Hydra/OmegaConf's errors)."""

from __future__ import annotations

import contextlib
import difflib
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import MISSING, field, fields, is_dataclass

from model.config import BOOL, FINITE, NONNEG_INT, problem, problem_with


class ConfigError(Exception):
    """A mistake in the run's config or inputs. ``str(err)`` names the key and a valid value (the fix)."""


def spec(default, doc: str, check=None, example=None):
    """A dataclass field with its one-line ``doc``, its ``check`` (``model.config.problem_with``) and a
    valid ``example`` for the messages (default: ``default``); a list default is copied per instance."""
    kw = {"default_factory": lambda: list(default)} if isinstance(default, list) else {"default": default}
    example = default if example is None else example
    return field(**kw, metadata={"doc": doc, "check": check, "example": example})


def field_problem(f, key: str, value) -> str | None:
    """Why ``value`` cannot be field ``f`` (at ``key``), or None."""
    if "gpt" in f.metadata:
        return problem(f.metadata["gpt"], value) if value is not None else None
    check, example = f.metadata.get("check"), f.metadata.get("example")
    if check is None:  # a check from the type (e.g. ``data.source`` is a string)
        t = str(f.type)
        check = BOOL if "bool" in t else FINITE if "float" in t else NONNEG_INT if "int" in t else None
    return problem_with(key, value, check, example, "None" in str(f.type))


def check_fields(node, schema: type, prefix: str = "") -> None:
    """Every field check of dataclass ``schema`` on ``node`` (a typed config), nested dataclasses included;
    GPTConfig's fields are left to GPTConfig."""
    for f in fields(schema):
        value = getattr(node, f.name, None)
        sub = dataclass_type(f)
        if sub is not None:
            check_fields(value, sub, f"{prefix}{f.name}.")
        elif "gpt" not in f.metadata:
            msg = f.metadata.get("check") and field_problem(f, prefix + f.name, value)
            if msg:
                raise ConfigError(msg)


def check_known(node, schema: type, root: type | None = None, prefix: str = "") -> None:
    """Refuse a key of ``node`` (a DictConfig) outside ``schema``: Hydra's ``+typo=1`` gets past OmegaConf,
    and ``OmegaConf.to_object`` would drop it silently (Hydra's own ``hydra`` node is no key of ours); and a
    schema key missing from it (``~seq_len``), which would otherwise take the schema's default unasked."""
    names = {f.name: f for f in fields(schema)}
    for k in names if hasattr(node, "keys") else ():  # ~seq_len: not the schema's default unasked
        if k not in node:
            raise ConfigError(_removed(f"{prefix}{k}", root or schema))
    for k in node.keys() if hasattr(node, "keys") else ():
        if k not in names and (prefix or k != "hydra"):
            raise ConfigError(unknown_key(f"{prefix}{k}", root or schema))
        sub = dataclass_type(names[k]) if k in names else None
        if sub is not None and node[k] is not None:
            check_known(node[k], sub, root or schema, f"{prefix}{k}.")


def dataclass_type(f) -> type | None:
    return f.default_factory if f.default_factory is not MISSING and is_dataclass(f.default_factory) else None


def print_keys(schema: type, quote: bool = False) -> None:
    """Every key of ``schema``, its default (``quote``: strings in quotes) and its doc, one a line."""
    import signal

    from omegaconf import OmegaConf

    from model.config import fmt

    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the listing quietly, as for any CLI
    defaults = OmegaConf.structured(schema)
    for key, doc in field_docs(schema).items():
        v = OmegaConf.select(defaults, key)
        print(f"{key} = {repr(v) if quote and isinstance(v, str) else fmt(v)}    # {doc}")


def field_docs(schema: type, prefix: str = "") -> dict[str, str]:
    """``{"batch.tokens_per_step": "tokens per optimizer step ...", ...}``: every key's one-line doc."""
    out = {}
    for f in fields(schema):
        sub = dataclass_type(f)
        out.update(
            field_docs(sub, f"{prefix}{f.name}.") if sub else {prefix + f.name: f.metadata.get("doc", "")}
        )
    return out


# ------------------------------------------------------------------------------ composition errors
SUGGEST_CUTOFF = 0.75  # difflib ratio a key needs to be offered as "did you mean"
GLOBAL_GROUPS = ("trainer", "experiment")  # configs/<group>/*.yaml are `@package _global_` presets


def _field_of(key: str, schema: type):
    f = None
    for part in key.split("."):
        if schema is None:
            return None
        f = next((x for x in fields(schema) if x.name == part), None)
        if f is None:
            return None
        schema = dataclass_type(f)
    return f


def unknown_key(key: str, schema: type, value: str = "VALUE") -> str:
    """Message for ``key``, which ``schema`` does not have: the closest valid key and those beside it."""
    lister = {"SampleConfig": "trainer.infer_config sample", "EvalConfig": "trainer.infer_config eval"}
    lister = f"`python -m {lister.get(schema.__name__, 'trainer.config')}` lists the keys"
    parent, _, name = key.rpartition(".")
    group, _, rest = key.partition(".")
    if group in GLOBAL_GROUPS and rest and _field_of(rest, schema) is not None:
        return (
            f"{key} is not a config key: {group} is a group of presets ({group}=NAME) that set top-level "
            f"keys; set the key itself: {rest}={value}"
        )
    if parent:
        f = _field_of(parent, schema)
        schema = dataclass_type(f) if f is not None else None
    if schema is None:
        return f"{key} is not a config key (nor is {parent}); {lister}"
    names = [f.name for f in fields(schema)]
    # only a close match (a letter or two off: temprature, sq_len, bathces, all >= 0.85): difflib's
    # default cutoff 0.6 suggested dtype for +typo=1 (0.67), a guess that misleads more than it helps
    close = difflib.get_close_matches(name, names, n=1, cutoff=SUGGEST_CUTOFF)
    full = [f"{parent}.{n}" if parent else n for n in names]
    hint = f"did you mean {full[names.index(close[0])]}? " if close else ""
    if not close and not parent:  # a group's key given without its group (lr for optim.lr)
        nested = [
            f"{g.name}.{name}" for g in fields(schema) if (t := dataclass_type(g)) and _field_of(name, t)
        ]
        hint = f"did you mean {' or '.join(nested)}? " if nested else ""
    where = f"under {parent}" if parent else "at the top level"
    return f"{key} is not a config key; {hint}valid keys {where}: {', '.join(full)}"


def config_error_from(exc: BaseException, schema: type) -> ConfigError | None:
    """The ``ConfigError`` for a Hydra/OmegaConf composition error (walks ``__cause__``), or None when ``exc``
    is not one (a bug: let it raise)."""
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

    e: BaseException | None = exc
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, MissingConfigException):
            return ConfigError(_missing_option(e))
        if isinstance(e, (ConfigKeyError, ConfigAttributeError, ValidationError)) and getattr(
            e, "full_key", None
        ):
            key = str(e.full_key)
            if not isinstance(e, ValidationError):
                # Hydra names the first part the schema lacks; the override's whole key says more
                given = re.search(r"Could not override '([^']+)'", str(exc))
                value = re.search(r"use \+\S+?=(\S+)", str(exc))
                if given and given.group(1).startswith(key + "."):
                    key = given.group(1)
                return ConfigError(unknown_key(key, schema, value.group(1) if value else "VALUE"))
            f = _field_of(key, schema)
            msg = field_problem(f, key, e.value) if f is not None else None
            if msg is None and f is not None and e.value is None:  # key=null where the schema takes none
                msg = f"{key}=null is not valid here; e.g. {_example(f, key)}"
            if msg is None and "is not a ListConfig" in str(e):  # wandb.tags=foo
                msg = f"{key}={e.value!r} must be a list: {key}=[{e.value}] (several: {key}=[a,b])"
            return ConfigError(msg or f"{key}={e.value!r} is not valid: {str(e).splitlines()[0]}")
        missing = re.match(r"Interpolation key '([^']+)' not found", str(e))
        if missing and _field_of(missing.group(1), schema) is not None:  # ~seq_len: run_name is made of it
            return ConfigError(_removed(missing.group(1), schema, f" and {e.full_key} is made from it"))
        k = str(getattr(e, "full_key", ""))
        if "does not support deletion" in str(e) and _field_of(k, schema):  # ~optim.lr: a group's keys stay
            return ConfigError(
                f"~{k}: {k} cannot be removed; set it instead, e.g. {_example(_field_of(k, schema), k)}"
            )
        gone = re.match(r"Could not delete from config. '([^']+)' does not exist", str(e))
        if gone and _field_of(gone.group(1), schema) is not None:  # ~data.max_tokens: null already
            k = gone.group(1)
            ex = _example(_field_of(k, schema), k)
            return ConfigError(
                f"~{k}: {k} is null already, nothing to remove; drop ~{k}"
                + ("" if ex.endswith("=null") else f", or set it, e.g. {ex}")
            )
        if isinstance(e, ValueError) and "Config group override must be" in str(e):  # attention=null
            return ConfigError(
                "a config group cannot be null (e.g. attention=null): name one of its options, e.g. "
                "attention=sdpa or model=gpt2 (`--help` lists every group's options)"
            )
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


_RAISED_IN_JOB: list[BaseException] = []  # what Hydra task functions raised (bugs, not config errors)


@contextlib.contextmanager
def in_job() -> Iterator[None]:
    """Mark the body of a Hydra task function: an exception raised there is a bug (traceback), never
    reported as a composition error by ``report_config_errors`` (recorded here: Hydra re-raises it after
    the body has left, so a flag set while the body runs would be down again)."""
    try:
        yield
    except Exception as e:
        _RAISED_IN_JOB.append(e)
        raise


def _raised_in_job(e: BaseException | None) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if any(e is x for x in _RAISED_IN_JOB):
            return True
        e = e.__cause__ or e.__context__
    return False


def report_config_errors(main: Callable[[], None], schema: type, say: bool = True) -> int:
    """Run the Hydra entry ``main`` (train.py's, sample.py's or eval.py's) with every mistake Hydra/OmegaConf
    find while composing on ``schema`` (a misspelt key, also ``+typo=1``, a wrong type, an unknown group
    option, an unparsable override) printed as ``config error: <key and a valid value>`` (``say``: false on
    all torchrun ranks but one), no traceback, like the trainer's own checks: exit status 2, else 0.

    Hydra is asked to raise instead of printing its own report (``HYDRA_FULL_ERROR=1``); an exception that
    is not a config error, or that a running job raised (``in_job``), is re-raised (a bug: full traceback)."""
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        main()
    except Exception as e:
        err = None if _raised_in_job(e) else config_error_from(e, schema)
        _RAISED_IN_JOB.clear()
        if err is None:
            raise
        if say:
            print(f"config error: {err}", file=sys.stderr, flush=True)
        return 2
    return 0


def _removed(key: str, schema: type, why: str = "") -> str:
    example = _example(_field_of(key, schema), key)
    example = "" if example.endswith("=null") else f", e.g. {example}"  # ~run: null is no value that works
    return f"{key} has no value (removed with ~{key}?){why}; give it one{example}"


def _example(f, key: str) -> str:
    """``key=value`` with a value that works for field ``f``: its example or default (a group: its first
    key's)."""
    from model.config import fmt

    if (sub := dataclass_type(f)) is not None:
        return _example(fields(sub)[0], f"{key}.{fields(sub)[0].name}")
    return f"{key}={fmt(f.metadata.get('example', f.default))}"


def _missing_option(e) -> str:
    group = str(getattr(e, "missing_cfg_file", None) or "")
    opts = list(getattr(e, "options", None) or [])
    if "/" in group and opts:
        g, _, name = group.rpartition("/")
        return (
            f"{g}={name} is not a config of group {g}; choose one of: {', '.join(f'{g}={o}' for o in opts)}"
        )
    return str(e).splitlines()[0]


def step_span(first: int, last: int) -> str:
    """ "step 5" or "steps 5-9" (for messages)."""
    return f"step {first}" if first == last else f"steps {first}-{last}"
