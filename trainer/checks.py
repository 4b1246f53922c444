"""Config validation for train.py, run before any GPU work (trainer/README: "what the trainer checks").

Every error is a ``ConfigError`` whose message names the config key, the bad value and a valid value or
the fix; ``train.py`` prints it and exits with status 2 (no traceback: it is a user error, not a bug).

Order of use in the trainer:
1. ``resolve_plan(cfg, ...)``: pure config arithmetic (backends, shapes, batch split, devices, enums);
2. ``check_data_source(cfg)`` then the data is prepared, then ``check_data_fits(cfg, meta)``;
3. ``probe_attention(plan, cfg)``: flash availability and a pinned SDPA backend, tried on a tiny tensor
   with the real head dim and dtype on the target device;
4. on resume, ``check_resume_compatible(saved, new)``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from hydra.experimental.callback import Callback

SDPA_BACKENDS_FALLBACK = ("auto", "flash", "cudnn", "efficient", "math")
ATTENTION_BACKENDS_FALLBACK = ("naive", "sdpa", "flash")
FLASH_HEAD_DIM_RANGE_FALLBACK = (8, 256)
WANDB_MODES = ("auto", "online", "offline", "disabled")
NONFINITE_MODES = ("stop", "skip")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")
PARITY_REFERENCES = ("naive", "sdpa")
#: Model-shape keys that a resume may not change (they change parameter shapes).
SHAPE_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "bias")

#: Dense bf16 tensor-core peak FLOP/s by GPU name fragment (vendor data sheets), for MFU.
PEAK_FLOPS_BF16 = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
    "4090": 165e12,
}
DEFAULT_PEAK_FLOPS = 989e12


class ConfigError(Exception):
    """A mistake in the run's config or inputs. ``str(err)`` names the key and a valid value (the fix)."""


@dataclass
class Plan:
    """Settings derived from the config by ``resolve_plan`` (all validated).

    Attributes:
        device_type: "cuda" or "cpu".
        autocast_dtype: "bfloat16" for bf16 autocast, or None (plain float32).
        compile: whether to torch.compile the model.
        compile_mode: torch.compile mode (None for "default"; "reduce-overhead" adds CUDA graphs).
        micro_batch_size: sequences per forward/backward per rank.
        grad_accum: micro-batches per optimizer step per rank.
        eval_batch_size: sequences per validation batch.
        world_size: number of DDP processes.
        head_dim: n_embd // n_head.
        peak_flops: FLOP/s per device for MFU (float) or None to decide from the GPU name later.
    """

    device_type: str
    autocast_dtype: str | None
    compile: bool
    micro_batch_size: int
    grad_accum: int
    eval_batch_size: int
    world_size: int
    head_dim: int
    peak_flops: float | None
    compile_mode: str | None = None
    notes: list[str] = field(default_factory=list)


def _attention_backends() -> tuple[str, ...]:
    try:
        from model.attention import available_attention_backends

        return tuple(available_attention_backends())
    except ImportError:  # pragma: no cover - model package missing
        return ATTENTION_BACKENDS_FALLBACK


def _sdpa_backends() -> tuple[str, ...]:
    try:
        from model import SDPA_BACKENDS

        return tuple(SDPA_BACKENDS)
    except ImportError:  # pragma: no cover
        return SDPA_BACKENDS_FALLBACK


def _interpret_enabled() -> bool:
    """The kernels' own test for "TRITON_INTERPRET is on" (1/true/yes/on), so both always agree."""
    from kernels import interpret_enabled

    return interpret_enabled()


def _flash_head_dim_range() -> tuple[int, int]:
    try:
        from model.gpt import FLASH_HEAD_DIM_RANGE

        return tuple(FLASH_HEAD_DIM_RANGE)
    except ImportError:  # pragma: no cover
        return FLASH_HEAD_DIM_RANGE_FALLBACK


def _pos_int(cfg, key: str, value, *, allow_zero: bool = False, example: int = 1) -> int:
    ok = isinstance(value, int) and not isinstance(value, bool) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        kind = "a non-negative" if allow_zero else "a positive"
        raise ConfigError(f"{key}={value!r} must be {kind} integer, e.g. {key}={example}")
    return value


def _choice(key: str, value, choices) -> str:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not valid; choose one of: {', '.join(map(str, choices))}")
    return value


def _multiples_near(n: int, unit: int) -> str:
    lo = (n // unit) * unit
    hi = lo + unit
    return f"{lo}" if lo == n else (f"{lo} or {hi}" if lo > 0 else f"{hi}")


def _head_counts(n_embd: int, near: int, lo: int, hi: int | None = None) -> list[int]:
    """Values of model.n_head that divide ``n_embd`` with a head dim in [lo, hi], closest to ``near``
    first (ties: the larger head dim)."""
    ok = [h for h in range(1, n_embd + 1) if n_embd % h == 0 and lo <= n_embd // h <= (hi or n_embd)]
    return sorted(ok, key=lambda h: (abs(h - near), h))


def _embd_near(n_embd: int, n_head: int, lo: int) -> list[int]:
    """Multiples of ``n_head`` next to ``n_embd`` whose head dim is at least ``lo`` (model.n_embd fixes)."""
    below = (n_embd // n_head) * n_head
    picks = [c for c in (below, below + n_head) if c // n_head >= lo]
    return picks or [lo * n_head]


def _pow2_at_most(n: int) -> int:
    """The largest power of two <= n (n >= 1): a seq_len that divides the usual batch sizes."""
    return 1 << (max(1, n).bit_length() - 1)


def _finite_float(key: str, value, example: str) -> float:
    """``float(value)``, or ConfigError naming ``key`` when it is not a finite number."""
    try:
        x = math.nan if isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        x = math.nan
    if not math.isfinite(x):
        raise ConfigError(f"{key}={value!r} is not a finite number, e.g. {example}")
    return x


def out_dir_problem(out_dir, key: str = "out_dir") -> str | None:
    """Why ``out_dir`` cannot hold a run, as a message naming ``key`` and the fix, or None when it can.

    Problems: a file at that path or at a folder above it, and a directory that cannot be written (or,
    when it does not exist yet, a nearest existing folder that cannot be written, so it cannot be created).
    Writing is tried for real (a temporary file, removed at once): permission bits say nothing for root,
    and a read-only mount refuses everyone. Nothing is created otherwise.
    """
    path = Path(str(out_dir)).expanduser()
    existing = next((q for q in (path, *path.parents) if q.exists()), Path.cwd())
    if not existing.is_dir():
        if existing == path:
            return (
                f"{key}={out_dir} is an existing file, not a directory; pass another {key}, e.g. "
                f"{key}={out_dir}-run (or move that file away)"
            )
        return (
            f"{key}={out_dir} cannot be created: {existing} is a file, not a directory; set {key} to a "
            "path outside it"
        )
    try:
        fd, probe = tempfile.mkstemp(prefix=".flashgpt-write-test-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        what = "is not writable" if existing == path else f"cannot be created: {existing} is not writable"
        example = "sweep1" if "sweep" in key else "run1"
        return (
            f"{key}={out_dir} {what} ({e.strerror}); set {key} to a directory you can write to, e.g. "
            f"{key}=$HOME/flashgpt-runs/{example}"
        )
    return None


class OutDirCheck(Callback):
    """Hydra callback (``hydra.callbacks`` in configs/config.yaml): before Hydra creates the run directory
    (it would stop with a traceback), an out_dir (``hydra.sweep.dir`` under ``-m``) that cannot be created
    or written is a config error: ``config error: ...`` on stderr, exit status 2."""

    def on_run_start(self, config, **kwargs) -> None:  # noqa: ARG002 - Hydra's callback API
        """Check ``hydra.run.dir`` (= ``out_dir``)."""
        self._check(config, "hydra.run.dir", "out_dir")

    def on_multirun_start(self, config, **kwargs) -> None:  # noqa: ARG002 - Hydra's callback API
        """Check the sweep folder ``hydra.sweep.dir``."""
        self._check(config, "hydra.sweep.dir", "hydra.sweep.dir")

    @staticmethod
    def _check(config, node: str, key: str) -> None:
        from omegaconf import OmegaConf

        try:
            path = OmegaConf.select(config, node)
        except Exception:  # noqa: BLE001 - an unresolvable path is Hydra's to report
            return
        if path is None:
            return
        problem = out_dir_problem(path, key)
        if problem:
            print(f"config error: {problem}", file=sys.stderr, flush=True)
            raise SystemExit(2)  # not an Exception: Hydra lets it through without a traceback


def check_out_dir(cfg, out_dir: Path) -> None:
    """Refuse an out_dir that cannot be written, and a new run (resume=false) in a directory that already
    holds one.

    A run directory holds a run once it has checkpoints or a summary.json of a run that trained (any
    status but "error", which a refused config leaves); starting afresh there would
    append a second curve to its metrics.jsonl, overwrite its summary and mix two runs in one W&B run.
    Raises:
        ConfigError naming out_dir and the fixes (a writable out_dir; resume=true, or another out_dir).
    """
    problem = out_dir_problem(out_dir)
    if problem:
        raise ConfigError(problem)
    if cfg.resume:
        return
    out_dir = Path(out_dir)
    ckpts = list((out_dir / "ckpt").glob("step_*.pt")) if (out_dir / "ckpt").is_dir() else []
    try:
        status = json.loads((out_dir / "summary.json").read_text()).get("status")
    except (OSError, ValueError):
        status = None
    # a directory whose only "run" was refused by a config error (status "error", nothing trained) is free
    if ckpts or status not in (None, "error"):
        raise ConfigError(
            f"out_dir={out_dir} already holds a run (summary.json or checkpoints); pass resume=true to "
            "continue it, or choose a new out_dir (the default, runs/<time>_<backend>_n<seq_len>, is new)"
        )


def check_attention_variants(cfg) -> dict:
    """Validate the attention-variant keys (issue 16) and return them as GPTConfig keyword arguments.

    Keys: ``attention.window`` (null or an int >= 1), ``attention.document_mask`` (bool; needs
    ``data.doc_separator``), ``model.attn_dropout`` (float in [0, 1)), ``data.doc_separator`` (null or a
    non-empty string; the escapes \\n, \\t are understood). A missing key means its default (null / false /
    0). A data.dir prepared with another doc_separator is refused (other runs read it), as for another
    tokenizer. SDPA's pinned flash and cuDNN
    kernels take no mask, so they cannot run a window or a document mask.

    Returns:
        {"window", "document_mask", "attn_dropout"} (GPTConfig fields; doc_separator_ids come from the
        prepared meta.json, see trainer.loop).
    Raises:
        ConfigError naming the key and a valid value.
    """
    a, m, d = cfg.attention, cfg.model, cfg.data
    window = a.get("window", None)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ConfigError(f"attention.window={window!r} must be null or an int >= 1 (keys per token, itself "
                          "included), e.g. attention.window=256")
    document_mask = a.get("document_mask", False)
    if not isinstance(document_mask, bool):
        raise ConfigError(f"attention.document_mask={document_mask!r} is not valid; choose true or false")
    attn_dropout = _finite_float("model.attn_dropout", m.get("attn_dropout", 0.0), "model.attn_dropout=0.1")
    if not 0.0 <= attn_dropout < 1.0:
        raise ConfigError(f"model.attn_dropout={attn_dropout} must be in [0, 1), e.g. model.attn_dropout=0.1")
    separator = d.get("doc_separator", None)
    if separator is not None and (not isinstance(separator, str) or not separator):
        raise ConfigError(f"data.doc_separator={separator!r} must be null or a non-empty string, e.g. "
                          "data.doc_separator='\\n\\n' (Tiny Shakespeare: one speech per document)")
    if document_mask and separator is None:
        raise ConfigError("attention.document_mask=true needs documents: set data.doc_separator (e.g. "
                          "data.doc_separator='\\n\\n' for Tiny Shakespeare, with a data.dir of its own), "
                          "or attention.document_mask=false")
    pinned = a.get("sdpa_backend", "auto")
    if a.name == "sdpa" and pinned in ("flash", "cudnn") and (window is not None or document_mask):
        raise ConfigError(f"attention.sdpa_backend={pinned} takes no attention mask, so it cannot run "
                          "attention.window / attention.document_mask; use attention.sdpa_backend=auto (or "
                          "efficient / math), or attention=flash")
    from data.docs import parse_separator

    meta = _prepared_meta(Path(str(d.dir)).expanduser())
    if meta is not None and meta.get("doc_separator") != parse_separator(separator):
        given = Path(str(d.dir))
        other = given.parent / f"{given.name or 'data'}_{'docs' if separator is not None else 'nodocs'}"
        raise ConfigError(f"data.dir={d.dir} was prepared with data.doc_separator="
                          f"{meta.get('doc_separator')!r}, but data.doc_separator={separator!r}; set "
                          f"data.dir={other} (a folder of its own) or delete {d.dir} to re-prepare it")
    return {"window": window, "document_mask": document_mask, "attn_dropout": attn_dropout}


def resolve_plan(cfg, *, world_size: int, cuda_available: bool) -> Plan:
    """Validate the config's static settings and derive the batch split and devices.

    Args:
        cfg: the Hydra/OmegaConf run config (configs/config.yaml layout).
        world_size: number of DDP processes (WORLD_SIZE, 1 without torchrun).
        cuda_available: torch.cuda.is_available() (passed in so this function does no device work).

    Returns:
        Plan.

    Raises:
        ConfigError: naming the key and a valid value, for: unknown attention backend or sdpa_backend,
            n_embd not divisible by n_head, head dim out of the flash kernel's range, seq_len larger than an
            explicit model.block_size, batch.micro_batch_size / micro_tokens / tokens_per_step that do not
            divide, device=cuda without CUDA, attention=flash without CUDA (unless TRITON_INTERPRET=1), and
            bad enum values (dtype, compile, nonfinite, wandb.mode, parity.reference).
    """
    seq_len = _pos_int(cfg, "seq_len", cfg.seq_len, example=1024)
    _pos_int(cfg, "seed", cfg.seed, allow_zero=True, example=1337)
    _pos_int(cfg, "max_steps", cfg.max_steps, example=1000)
    _pos_int(cfg, "log_interval", cfg.log_interval, example=10)
    _pos_int(cfg, "eval.interval", cfg.eval.interval, allow_zero=True, example=100)
    _pos_int(cfg, "eval.batches", cfg.eval.batches, example=20)
    _pos_int(cfg, "checkpoint.interval", cfg.checkpoint.interval, allow_zero=True, example=500)
    _pos_int(cfg, "checkpoint.keep", cfg.checkpoint.keep, example=3)
    _pos_int(cfg, "parity.every", cfg.parity.every, allow_zero=True, example=50)
    _pos_int(cfg, "optim.warmup_steps", cfg.optim.warmup_steps, allow_zero=True, example=100)
    if cfg.optim.decay_steps is not None:
        _pos_int(cfg, "optim.decay_steps", cfg.optim.decay_steps, example=cfg.max_steps)
    _choice("nonfinite", cfg.nonfinite, NONFINITE_MODES)
    _choice("wandb.mode", cfg.wandb.mode, WANDB_MODES)
    if cfg.wandb.mode == "online":
        from trainer.metrics import wandb_logged_in

        if not wandb_logged_in():
            raise ConfigError(
                "wandb.mode=online but no W&B API key is configured; run `wandb login` (or set "
                "WANDB_API_KEY), or use wandb.mode=auto (online when logged in, else offline) or offline"
            )
    _choice("parity.reference", cfg.parity.reference, PARITY_REFERENCES)
    _choice("dtype", cfg.dtype, ("auto", "bfloat16", "float32"))
    _choice("device", cfg.device, ("auto", "cuda", "cpu"))
    if not (isinstance(cfg.compile, bool) or cfg.compile == "auto"):  # isinstance: 1 == True, 0 == False
        raise ConfigError(f"compile={cfg.compile!r} is not valid; choose one of: true, false, auto")
    compile_mode = _choice("compile_mode", cfg.get("compile_mode", "default"), COMPILE_MODES)
    _pos_int(cfg, "perf.profile_steps", cfg.perf.get("profile_steps", 0), allow_zero=True, example=5)
    for key in ("tf32", "deterministic", "resume", "eval.at_start", "checkpoint.at_end"):
        node = cfg
        for part in key.split("."):
            node = node.get(part, True) if node is not None else True
        value = node
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} is not valid; choose true or false")
    lr = _finite_float("optim.lr", cfg.optim.lr, "optim.lr=6e-4")
    min_lr = _finite_float("optim.min_lr", cfg.optim.min_lr, "optim.min_lr=6e-5")
    if not lr > 0 or not 0 <= min_lr <= lr:
        raise ConfigError(
            f"optim.lr={cfg.optim.lr} / optim.min_lr={cfg.optim.min_lr}: need 0 <= min_lr <= lr and lr > 0, "
            "e.g. optim.lr=6e-4 optim.min_lr=6e-5"
        )
    for key, example in (("beta1", "0.9"), ("beta2", "0.95")):
        beta = _finite_float(f"optim.{key}", cfg.optim[key], f"optim.{key}={example}")
        if not 0 <= beta < 1:
            raise ConfigError(f"optim.{key}={cfg.optim[key]} must be in [0, 1), e.g. optim.{key}={example}")
    for key, example in (("weight_decay", "0.1"), ("grad_clip", "1.0")):
        if _finite_float(f"optim.{key}", cfg.optim[key], f"optim.{key}={example}") < 0:
            raise ConfigError(f"optim.{key}={cfg.optim[key]} must be >= 0, e.g. optim.{key}={example}")

    # --- attention backend
    attn = cfg.attention.name
    _choice("attention.name (attention=...)", attn, _attention_backends())
    sdpa_backend = cfg.attention.get("sdpa_backend", "auto")
    _choice("attention.sdpa_backend", sdpa_backend, _sdpa_backends())
    check_attention_variants(cfg)

    # --- model shape
    m = cfg.model
    n_head = _pos_int(cfg, "model.n_head", m.n_head, example=12)
    n_embd = _pos_int(cfg, "model.n_embd", m.n_embd, example=768)
    _pos_int(cfg, "model.n_layer", m.n_layer, example=12)
    flash_lo, flash_hi = _flash_head_dim_range()
    min_head_dim = flash_lo  # smaller heads are no use to any backend, and flash refuses them
    if n_embd % n_head:
        heads = _head_counts(n_embd, n_head, min_head_dim, flash_hi if attn == "flash" else None)[:3]
        embds = " or ".join(f"model.n_embd={e}" for e in _embd_near(n_embd, n_head, min_head_dim))
        by_head = ", ".join(f"model.n_head={h}" for h in heads)
        by_head = f" or a model.n_head dividing it: {by_head}" if heads else ""
        raise ConfigError(
            f"model.n_embd={n_embd} is not divisible by model.n_head={n_head}; use {embds}{by_head}"
        )
    head_dim = n_embd // n_head
    if m.block_size is not None:
        _pos_int(cfg, "model.block_size", m.block_size, example=seq_len)
        if seq_len > m.block_size:
            raise ConfigError(
                f"seq_len={seq_len} is larger than model.block_size={m.block_size}; "
                f"use seq_len={m.block_size} (or smaller), "
                f"or model.block_size={seq_len} (or model.block_size=null to follow seq_len)"
            )
    if not 0.0 <= float(m.dropout) < 1.0:
        raise ConfigError(f"model.dropout={m.dropout} must be in [0, 1), e.g. model.dropout=0.0")

    # --- devices
    if cfg.device == "cuda" and not cuda_available:
        raise ConfigError("device=cuda but no CUDA GPU is visible to torch; use device=auto or device=cpu")
    device_type = "cuda" if (cfg.device == "cuda" or (cfg.device == "auto" and cuda_available)) else "cpu"
    if attn == "flash":
        lo, hi = flash_lo, flash_hi
        if not lo <= head_dim <= hi:
            heads = _head_counts(n_embd, n_embd // 64 or 1, lo, hi)  # closest to head dim 64 first
            change = (
                f"change model.n_head (e.g. model.n_head={heads[0]}: head dim {n_embd // heads[0]})"
                if heads
                else f"change the model width (e.g. model.n_embd={64 * n_head}: head dim 64)"
            )
            raise ConfigError(
                f"attention=flash supports head dims {lo}..{hi}, but model.n_embd={n_embd} / model.n_head="
                f"{n_head} gives {head_dim}; {change} or use attention=sdpa"
            )
        if device_type != "cuda" and not _interpret_enabled():
            raise ConfigError(
                "attention=flash needs a CUDA GPU (none here); use attention=sdpa (portable, any device), or "
                "set TRITON_INTERPRET=1 to run the Triton kernel slowly on the CPU for testing"
            )
    if cfg.dtype == "auto":
        autocast_dtype = "bfloat16" if device_type == "cuda" else None
    else:
        autocast_dtype = "bfloat16" if cfg.dtype == "bfloat16" else None
    compile_ = (device_type == "cuda") if cfg.compile == "auto" else bool(cfg.compile)
    if compile_mode == "reduce-overhead" and compile_ and world_size > 1:
        raise ConfigError(
            "compile_mode=reduce-overhead (CUDA graphs) is supported on one process only, and this run has "
            f"{world_size} ranks (DDP's gradient hooks run outside the graphs); use compile_mode=default"
        )

    # --- batch split: a token budget per micro-batch, so every seq_len runs without a batch override
    b = cfg.batch
    tokens_per_step = _pos_int(cfg, "batch.tokens_per_step", b.tokens_per_step, example=65536)
    if b.micro_batch_size is not None:
        micro_batch_size = _pos_int(cfg, "batch.micro_batch_size", b.micro_batch_size, example=8)
    elif b.get("micro_tokens") is not None:
        micro_tokens = _pos_int(cfg, "batch.micro_tokens", b.micro_tokens, example=32768)
        if micro_tokens > seq_len and micro_tokens % seq_len:
            raise ConfigError(
                f"batch.micro_tokens={micro_tokens} must be a multiple of seq_len={seq_len}, or at most "
                f"seq_len (one sequence per micro-batch); use batch.micro_tokens="
                f"{(micro_tokens // seq_len) * seq_len}"
            )
        # never more than one rank's share of the step, and at least one sequence
        budget = min(micro_tokens, max(1, tokens_per_step // world_size))
        micro_batch_size = max(1, budget // seq_len)
    else:
        raise ConfigError(
            "batch.micro_batch_size=null needs batch.micro_tokens; set batch.micro_tokens=32768 "
            "(tokens per micro-batch) or batch.micro_batch_size=8 (sequences)"
        )
    notes: list[str] = []
    if b.micro_batch_size is not None and b.get("micro_tokens") is not None:
        notes.append(f"note: batch.micro_batch_size={micro_batch_size} is set, so batch.micro_tokens="
                     f"{b.micro_tokens} is not used (batch.micro_batch_size=null uses the token budget)")
    if int(cfg.perf.get("profile_steps", 0)) and device_type != "cuda":
        notes.append("note: perf.profile_steps is a GPU measurement (CUDA kernel time); skipped on the CPU")
    if compile_mode == "reduce-overhead" and compile_ and device_type != "cuda":
        notes.append("note: compile_mode=reduce-overhead adds CUDA graphs, which the CPU does not have: "
                     "it runs like compile_mode=default here")
    per_micro = micro_batch_size * seq_len * world_size
    if tokens_per_step % per_micro:
        # the largest smaller micro-batch that divides, under the key the user set
        per_seq = seq_len * world_size
        fits = [m for m in range(micro_batch_size - 1, 0, -1) if tokens_per_step % (m * per_seq) == 0]
        if not fits and per_micro > tokens_per_step:
            smaller = "a shorter seq_len"  # one sequence per rank is already more than the step
        elif not fits:
            smaller = "a smaller batch.micro_batch_size"
        elif b.micro_batch_size is None:  # the micro-batch came from batch.micro_tokens
            smaller = f"batch.micro_tokens={fits[0] * seq_len}"
        else:
            smaller = f"batch.micro_batch_size={fits[0]}"
        raise ConfigError(
            f"batch.tokens_per_step={tokens_per_step} is not a multiple of "
            f"micro_batch_size({micro_batch_size}) "
            f"x seq_len({seq_len}) x world_size({world_size}) = {per_micro}; use batch.tokens_per_step="
            f"{_multiples_near(tokens_per_step, per_micro)}, or {smaller}"
        )
    grad_accum = tokens_per_step // per_micro
    eval_bs = cfg.eval.batch_size if cfg.eval.batch_size is not None else micro_batch_size
    _pos_int(cfg, "eval.batch_size", eval_bs, example=micro_batch_size)

    # --- MFU peak
    pf = cfg.perf.peak_flops
    if pf == "auto" or pf is None:
        peak = None
    else:
        try:
            peak = float(pf)
        except (TypeError, ValueError):
            peak = -1.0
        if not peak > 0:
            raise ConfigError(
                f"perf.peak_flops={pf!r} must be 'auto' or a positive FLOP/s, e.g. perf.peak_flops=989e12"
            )

    return Plan(
        device_type=device_type,
        autocast_dtype=autocast_dtype,
        compile=compile_,
        micro_batch_size=micro_batch_size,
        grad_accum=grad_accum,
        eval_batch_size=int(eval_bs),
        world_size=world_size,
        head_dim=head_dim,
        peak_flops=peak,
        compile_mode=None if compile_mode == "default" else compile_mode,
        notes=notes,
    )


def peak_flops_for(device_name: str | None) -> float:
    """bf16 dense peak FLOP/s for a GPU name (``torch.cuda.get_device_name()``); 989e12 when unknown/CPU."""
    for frag, flops in PEAK_FLOPS_BF16.items():
        if device_name and frag in device_name:
            return flops
    return DEFAULT_PEAK_FLOPS


def check_data_source(cfg) -> None:
    """Check ``data.source`` (a local file must exist and be readable) and ``data.dir`` (writable parent).

    Raises:
        ConfigError naming data.source / data.dir and the fix.
    """
    src = cfg.data.source
    if src is not None and not str(src).startswith(("http://", "https://")):
        p = Path(str(src)).expanduser()
        if not p.exists():
            raise ConfigError(
                f"data.source={src} does not exist (relative paths start at {Path.cwd()}); pass an "
                "existing UTF-8 text file, e.g. data.source=/path/to/corpus.txt, or data.source=null to "
                "download Tiny Shakespeare"
            )
        if not p.is_file():
            raise ConfigError(f"data.source={src} is not a file; pass a UTF-8 text file path")
        try:
            with open(p, "rb") as f:
                f.read(1)
        except OSError as e:
            raise ConfigError(f"data.source={src} is not readable ({e.strerror}); fix its permissions") from e
    d = Path(str(cfg.data.dir)).expanduser()
    if d.exists() and not d.is_dir():
        raise ConfigError(f"data.dir={cfg.data.dir} exists and is not a directory; pass a directory path")
    _check_data_dir_matches(cfg, d)


def _prepared_meta(data_dir: Path) -> dict | None:
    """The meta.json of a prepared data directory, or None (absent or unreadable)."""
    try:
        return json.loads((data_dir / "meta.json").read_text())
    except (OSError, ValueError):
        return None


def _check_data_dir_matches(cfg, data_dir: Path) -> None:
    """Refuse to re-prepare a data directory that holds another corpus, tokenizer or train/val split: other
    runs (and their resumes) read it. The user points data.dir at a directory of its own instead."""
    meta = _prepared_meta(data_dir)
    if meta is None:
        return

    def fix(suffix: str) -> str:
        # a sibling folder named after what differs: a real value the user can pass as typed
        given = Path(str(cfg.data.dir))
        other = given.parent / f"{given.name or 'data'}_{suffix}"
        return f"set data.dir={other} (a folder of its own) or delete {data_dir} to re-prepare it"

    if meta.get("tokenizer") != cfg.data.tokenizer:
        raise ConfigError(
            f"data.dir={cfg.data.dir} holds data tokenized with {meta.get('tokenizer')!r}, but "
            f"data.tokenizer={cfg.data.tokenizer}; {fix(str(cfg.data.tokenizer))}"
        )
    try:
        same_split = abs(float(meta.get("val_fraction")) - float(cfg.data.val_fraction)) < 1e-12
    except (TypeError, ValueError):
        same_split = True  # an older meta.json without val_fraction: data.prepare decides
    if not same_split:
        raise ConfigError(
            f"data.dir={cfg.data.dir} was split with val_fraction={meta.get('val_fraction')}, but "
            f"data.val_fraction={cfg.data.val_fraction}; "
            f"use data.val_fraction={meta.get('val_fraction')} or {fix(f'val{cfg.data.val_fraction}')}"
        )
    src = cfg.data.source
    if src is None or str(src).startswith(("http://", "https://")) or not meta.get("source_sha256"):
        return
    import hashlib

    digest = hashlib.sha256(Path(str(src)).expanduser().read_bytes()).hexdigest()
    if digest != meta["source_sha256"]:
        raise ConfigError(
            f"data.dir={cfg.data.dir} holds data prepared from {meta.get('source')}, which differs from "
            f"data.source={src} (sha256); {fix(Path(str(src)).stem)}"
        )


def effective_data_source(cfg) -> str | None:
    """``data.source``; when it is null (download) and ``data.dir`` already holds data prepared from a
    local file that still exists, that file (so a resume or a rerun needs neither the network nor the
    original ``data.source=`` override)."""
    if cfg.data.source is not None:
        return cfg.data.source
    meta = _prepared_meta(Path(str(cfg.data.dir)).expanduser())
    src = (meta or {}).get("source")
    if src and not str(src).startswith(("http://", "https://")) and Path(src).is_file():
        return str(src)
    return None


def check_data_fits(cfg, meta: dict) -> None:
    """The prepared corpus must hold at least seq_len + 1 tokens in each split (one window + its target).

    Raises:
        ConfigError naming seq_len, the split's token count and the largest valid seq_len.
    """
    need = cfg.seq_len + 1
    largest = min(int(meta["train_tokens"]), int(meta["val_tokens"])) - 1  # fits both splits
    for split in ("train", "val"):
        have = int(meta[f"{split}_tokens"])
        if have < need:
            fits = f"use seq_len={_pow2_at_most(largest)} (at most {largest}) or " if largest >= 1 else "use "
            raise ConfigError(
                f"seq_len={cfg.seq_len} needs {need} tokens per window, but the {split} split of "
                f"{cfg.data.dir} has only {have}; {fits}a larger corpus (data.source=PATH with a "
                "data.dir of its own)"
            )
    if meta.get("tokenizer") != cfg.data.tokenizer:  # pragma: no cover - ensure_prepared re-prepares
        raise ConfigError(
            f"data.tokenizer={cfg.data.tokenizer} but {cfg.data.dir}/meta.json is for {meta.get('tokenizer')}"
        )


def probe_attention(cfg, plan: Plan, device, n_head: int) -> None:
    """Try the configured attention on a tiny tensor of the real head dim and dtype on ``device``.

    For attention=flash: ``kernels.check_flash_available(device)`` when present. For a pinned SDPA backend
    (attention.sdpa_backend != auto): a (1, min(2, n_head), min(seq_len, 128), head_dim) causal forward and
    backward under ``sdpa_kernel([that backend])``; if it raises, the other SDPA backends are tried too so
    the error can list the ones that do run.

    Raises:
        ConfigError naming attention / attention.sdpa_backend, the shapes, and a backend that runs.
    """
    import torch

    name = cfg.attention.name
    if name == "flash":
        try:
            import kernels
        except ImportError as e:
            raise ConfigError(
                f"attention=flash: the kernels package failed to import ({e}); use attention=sdpa"
            ) from e
        check = getattr(kernels, "check_flash_available", None)
        if check is not None:
            try:
                check(torch.device(device))
            except RuntimeError as e:
                raise ConfigError(f"attention=flash cannot run here: {e}") from e
    sdpa_backend = cfg.attention.get("sdpa_backend", "auto")
    if name != "sdpa" or sdpa_backend == "auto":
        return
    from model.attention import attention as attention_fn

    dtype = torch.bfloat16 if plan.autocast_dtype == "bfloat16" else torch.float32
    shape = (1, min(2, n_head), min(cfg.seq_len, 128), plan.head_dim)

    def runs(backend: str) -> str | None:
        try:
            gen = torch.Generator(device=device).manual_seed(0)  # leaves the global RNG streams alone
            q, k, v = (
                torch.randn(shape, device=device, dtype=dtype, generator=gen).requires_grad_()
                for _ in range(3)
            )
            attention_fn(q, k, v, "sdpa", backend).sum().backward()
            return None
        except Exception as e:  # noqa: BLE001 - any failure means "cannot run"
            return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    err = runs(sdpa_backend)
    if err is None:
        return
    ok = [b for b in _sdpa_backends() if b not in ("auto", sdpa_backend) and runs(b) is None]
    raise ConfigError(
        f"attention.sdpa_backend={sdpa_backend} cannot run head_dim={plan.head_dim}, "
        f"dtype={str(dtype)[6:]} on "
        f"{device} ({err}); use attention.sdpa_backend=auto"
        + (" or one that runs here: " + ", ".join(f"attention.sdpa_backend={b}" for b in ok) if ok else "")
    )


def check_resume_compatible(saved: dict, new: dict) -> list[str]:
    """Compare a checkpoint's model/tokenizer settings with the new run's.

    Args:
        saved / new: dicts with "model_args" (GPTConfig fields), "tokenizer" (name) and "vocab_size" (of the
            tokenizer), and "attention" (name, sdpa_backend).

    Returns:
        Human-readable notes about allowed changes (attention backend), to log.

    Raises:
        ConfigError listing every model-shape or tokenizer key that differs (old -> new).
    """
    diffs = []
    for key in SHAPE_KEYS:
        a, b = saved["model_args"].get(key), new["model_args"].get(key)
        if a != b:
            hint = " (follows seq_len)" if key == "block_size" else ""
            diffs.append(f"model.{key}: {a} -> {b}{hint}")
    for key in ("tokenizer", "vocab_size"):
        a, b = saved.get(key), new.get(key)
        if a != b:
            diffs.append(f"data.{key}: {a} -> {b}")
    if diffs:
        raise ConfigError(
            "resume=true refused: the checkpoint was trained with a different model shape or tokenizer: "
            + "; ".join(diffs)
            + ". Resume with the original values, or start a new run (resume=false, a new out_dir)"
        )
    notes = []
    if tuple(saved.get("attention", ())) != tuple(new.get("attention", ())):
        notes.append(
            f"attention backend changed on resume: {saved.get('attention')} -> {new.get('attention')}"
        )
    return notes
