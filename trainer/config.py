"""Typed configs of train.py: one dataclass per config group, registered in Hydra's ConfigStore.

Hydra composes ``configs/config.yaml`` on top of the schema ``TrainConfig`` (stored as ``flashgpt_schema``),
so OmegaConf itself rejects a value of the wrong type (``seq_len=abc``) and an unknown key (``sq_len=1``,
``+typo=1``, ``model.n_heads=4``), naming the full key. What types cannot say (ranges, choices, keys that
depend on each other) is checked next to the dataclass it concerns: each field's ``check`` metadata
(``spec(...)``, trainer/fields.py) and each class's ``validate(cfg)``; ``validate(cfg)`` at the bottom runs
them all and raises ``ConfigError`` with the key and a valid value. ``trainer.config_errors`` turns an
OmegaConf/Hydra composition error into the same text, so every config mistake ends the same way
(``config error: ...`` on stderr, exit status 2, no traceback; train.py).

Groups (configs/): ``attention`` -> ``AttentionConfig``, ``model`` -> ``ModelConfig`` (presets stored here
from ``model.gpt.PRESETS``, the one list of GPT sizes), ``data`` -> ``DataConfig``, ``optim`` ->
``OptimConfig``, ``trainer`` -> the top-level run keys of ``TrainConfig`` with ``BatchConfig``,
``EvalConfig``, ``CheckpointConfig``, ``ParityConfig``, ``PerfConfig``; ``logger`` -> ``WandbConfig``
(key ``wandb``); ``experiment`` presets combine them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from hydra.core.config_store import ConfigStore

from trainer.fields import (
    BOOL,
    FINITE,
    NONNEG,
    NONNEG_INT,
    OPEN_UNIT,
    POS_INT,
    UNIT,
    ConfigError,
    check_fields,
    dataclass_type,
    fmt,
    problem_with,
    spec,
)

__all__ = ["ConfigError", "TrainConfig", "validate"]


# ------------------------------------------------------------------------------------------ groups
@dataclass
class AttentionConfig:
    """``attention=naive|sdpa|flash`` (configs/attention/)."""

    name: str = spec("sdpa", "attention backend: naive | sdpa | flash (model.attention registry)")
    sdpa_backend: str = spec(
        "auto",
        "SDPA kernel for attention=sdpa: auto | flash | cudnn | efficient | "
        "math (pinned: raises instead of falling back)",
    )
    window: int | None = spec(
        None,
        "causal sliding window: each token sees its w most recent positions "
        "(itself included); null = full causal",
        POS_INT,
        256,
    )
    document_mask: bool = spec(
        False, "a token attends only within its document (needs data.doc_separator)", BOOL
    )

    @staticmethod
    def validate(cfg) -> None:
        """Backend names against the registries of model.attention (they may grow at run time); a document
        mask needs data.doc_separator; SDPA's pinned flash and cuDNN kernels take no mask (window, docs)."""
        from model.attention import SDPA_BACKENDS, available_attention_backends

        a = cfg.attention
        if a.name not in available_attention_backends():
            raise ConfigError(
                problem_with(
                    "attention.name (attention=...)", a.name, tuple(available_attention_backends()), "sdpa"
                )
            )
        msg = problem_with("attention.sdpa_backend", a.sdpa_backend, tuple(SDPA_BACKENDS), "auto")
        if msg:
            raise ConfigError(msg)
        from data.sources import is_document_source

        if a.document_mask and cfg.data.doc_separator is None and not is_document_source(cfg.data.source):
            raise ConfigError(
                "attention.document_mask=true needs documents: set data.doc_separator (e.g. "
                "data.doc_separator='\\n\\n' for Tiny Shakespeare, with a data.dir of its own), or a "
                "data.source of documents (a directory, glob, .jsonl, .parquet or hf:NAME), "
                "or attention.document_mask=false"
            )
        masked = a.window is not None or a.document_mask
        if a.name == "sdpa" and a.sdpa_backend in ("flash", "cudnn") and masked:
            raise ConfigError(
                f"attention.sdpa_backend={a.sdpa_backend} takes no attention mask, so it cannot run "
                "attention.window / attention.document_mask; use attention.sdpa_backend=auto (or "
                "efficient / math), or attention=flash"
            )


def flash_head_dim_range() -> tuple[int, int]:
    """(min, max) head dim of our Triton kernel: ``kernels.flash_attn.MIN_HEAD_DIM/MAX_HEAD_DIM``."""
    from kernels.flash_attn import MAX_HEAD_DIM, MIN_HEAD_DIM

    return MIN_HEAD_DIM, MAX_HEAD_DIM


@dataclass
class ModelConfig:
    """``model=tiny|gpt2|gpt2-medium|gpt2-large|gpt2-xl``: GPT-2 shape (``model.gpt.PRESETS``)."""

    name: str = spec("gpt2", "preset name (for records; the sizes below are what counts)")
    n_layer: int = spec(12, "transformer blocks", POS_INT, 12)
    n_head: int = spec(12, "attention heads per block; head dim = n_embd / n_head", POS_INT, 12)
    n_embd: int = spec(768, "model width (d_model)", POS_INT, 768)
    dropout: float = spec(0.0, "residual and embedding dropout probability", UNIT, 0.0)
    attn_dropout: float = spec(
        0.0, "dropout on the attention probabilities in training (every backend)", UNIT, 0.1
    )
    bias: bool = spec(True, "biases in Linear layers and LayerNorms (GPT-2: true)", BOOL)
    block_size: int | None = spec(None, "position-embedding length; null = seq_len", POS_INT, 1024)
    vocab_size: int | None = spec(
        None, "token ids; null = the tokenizer's vocab rounded up to 64", POS_INT, 50304
    )

    @staticmethod
    def validate(cfg) -> None:
        """n_embd divisible by n_head (hints: widths and head counts that work), the flash kernel's head-dim
        range, seq_len <= an explicit block_size."""
        m, seq_len, attn = cfg.model, cfg.seq_len, cfg.attention.name
        n_head, n_embd = m.n_head, m.n_embd
        lo, hi = flash_head_dim_range()  # smaller heads are no use to any backend, and flash refuses them
        if n_embd % n_head:
            heads = _head_counts(n_embd, n_head, lo, hi if attn == "flash" else None)[:3]
            embds = " or ".join(f"model.n_embd={e}" for e in _embd_near(n_embd, n_head, lo))
            by_head = ", ".join(f"model.n_head={h}" for h in heads)
            by_head = f" or a model.n_head dividing it: {by_head}" if heads else ""
            raise ConfigError(
                f"model.n_embd={n_embd} is not divisible by model.n_head={n_head}; use {embds}{by_head}"
            )
        head_dim = n_embd // n_head
        if m.block_size is not None and seq_len > m.block_size:
            raise ConfigError(
                f"seq_len={seq_len} is larger than model.block_size={m.block_size}; "
                f"use seq_len={m.block_size} (or smaller), "
                f"or model.block_size={seq_len} (or model.block_size=null to follow seq_len)"
            )
        if attn == "flash" and not lo <= head_dim <= hi:
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


@dataclass
class DataConfig:
    """``data=shakespeare|shakespeare_char`` (configs/data/): the corpus and where it is prepared."""

    name: str = spec("shakespeare", "dataset name (for records)")
    source: str | None = spec(
        None,
        "null = download Tiny Shakespeare; a UTF-8 text file or URL; a directory or glob of text / "
        ".jsonl / .json.gz / .parquet files; hf:NAME[:CONFIG] (docs/data.md)",
    )
    dir: str = spec("data/shakespeare", "where the token shards and meta.json go (relative to the cwd)")
    tokenizer: str = spec("gpt2", "gpt2 (tiktoken BPE) | char", ("gpt2", "char"))
    val_fraction: float = spec(
        0.1, "share of the corpus (its end) held out for validation, in (0, 1)", OPEN_UNIT, 0.1
    )
    doc_separator: str | None = spec(
        None,
        "null | the string between documents, e.g. '\\n\\n' (escapes "
        "understood); prepare records the documents",
    )
    text_field: str = spec("text", "record field / column holding the text (JSONL, Parquet, hf: sources)")
    max_tokens: int | None = spec(None, "prepare at most this many tokens; null = all", POS_INT, 1000000000)
    workers: int | None = spec(None, "tokenizer processes of the prepare step; null = CPU count", POS_INT, 8)

    @staticmethod
    def validate(cfg) -> None:
        """data.doc_separator: null or a non-empty string."""
        sep = cfg.data.doc_separator
        if sep is not None and not sep:
            raise ConfigError(
                f"data.doc_separator={sep!r} must be null or a non-empty string, e.g. "
                "data.doc_separator='\\n\\n' (Tiny Shakespeare: one speech per document)"
            )


@dataclass
class OptimConfig:
    """``optim=adamw`` (configs/optim/): AdamW, linear warmup, cosine decay to min_lr."""

    name: str = spec("adamw", "optimizer (AdamW; decay on 2-D weights only, fused on CUDA)", ("adamw",))
    lr: float = spec(6.0e-4, "peak learning rate", FINITE, 6e-4)
    min_lr: float = spec(6.0e-5, "learning rate at the end of the cosine decay", FINITE, 6e-5)
    weight_decay: float = spec(0.1, "AdamW weight decay (2-D weights only)", NONNEG, 0.1)
    beta1: float = spec(0.9, "AdamW beta1", UNIT, 0.9)
    beta2: float = spec(0.95, "AdamW beta2", UNIT, 0.95)
    grad_clip: float = spec(
        1.0, "max global grad norm (0 = no clipping; the norm is still checked)", NONNEG, 1.0
    )
    warmup_steps: int = spec(100, "linear warmup length in optimizer steps", NONNEG_INT, 100)
    decay_steps: int | None = spec(
        None, "cosine decay length in optimizer steps; null = max_steps", POS_INT, 1000
    )

    @staticmethod
    def validate(cfg) -> None:
        """0 <= min_lr <= lr and lr > 0."""
        o = cfg.optim
        if not o.lr > 0 or not 0 <= o.min_lr <= o.lr:
            raise ConfigError(
                f"optim.lr={o.lr} / optim.min_lr={o.min_lr}: need 0 <= min_lr <= lr and lr > 0, "
                "e.g. optim.lr=6e-4 optim.min_lr=6e-5"
            )


@dataclass
class BatchConfig:
    """``batch.*``: tokens per optimizer step and how one rank's share is cut into micro-batches."""

    tokens_per_step: int = spec(
        65536, "tokens per optimizer step, over micro-batches and ranks", POS_INT, 65536
    )
    micro_tokens: int | None = spec(
        32768,
        "tokens per forward/backward on one rank (at most); micro-batch = max(1, that // seq_len)",
        POS_INT,
        32768,
    )
    micro_batch_size: int | None = spec(
        None, "sequences per forward/backward on one rank (wins over micro_tokens)", POS_INT, 8
    )

    @staticmethod
    def split(cfg, world_size: int) -> tuple[int, int, list[str]]:
        """(micro_batch_size, grad_accum, notes) of one rank for ``world_size`` ranks.

        A token budget per micro-batch (``micro_tokens``), so every seq_len runs without a batch override;
        never more than one rank's share of the step, at least one sequence.

        Raises:
            ConfigError: micro_tokens not a multiple of seq_len, both sizes null, or tokens_per_step not a
                multiple of micro_batch_size x seq_len x world_size (the hint names the key the user set).
        """
        b, seq_len = cfg.batch, cfg.seq_len
        tokens_per_step = b.tokens_per_step
        if b.micro_batch_size is not None:
            micro_batch_size = b.micro_batch_size
        elif b.micro_tokens is not None:
            if b.micro_tokens > seq_len and b.micro_tokens % seq_len:
                raise ConfigError(
                    f"batch.micro_tokens={b.micro_tokens} must be a multiple of seq_len={seq_len}, or at "
                    f"most seq_len (one sequence per micro-batch); use "
                    f"{_whole_micro_tokens(cfg, world_size)}"
                )
            budget = min(b.micro_tokens, max(1, tokens_per_step // world_size))
            micro_batch_size = max(1, budget // seq_len)
        else:
            raise ConfigError(
                "batch.micro_batch_size=null needs batch.micro_tokens; set batch.micro_tokens=32768 "
                "(tokens per micro-batch) or batch.micro_batch_size=8 (sequences)"
            )
        notes = []
        if b.micro_batch_size is not None and b.micro_tokens is not None:
            notes.append(
                f"note: batch.micro_batch_size={micro_batch_size} is set, so batch.micro_tokens="
                f"{b.micro_tokens} is not used (batch.micro_batch_size=null uses the token budget)"
            )
        per_micro = micro_batch_size * seq_len * world_size
        if tokens_per_step % per_micro:
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
            if b.micro_batch_size is None:  # token budget: the micro-batch follows tokens_per_step

                def splits(t: int) -> bool:
                    m = max(1, min(b.micro_tokens, max(1, t // world_size)) // seq_len)
                    return t % (m * per_seq) == 0

                near = [t for t in _multiples_around(tokens_per_step, per_seq) if splits(t)][:2]
                capped = " (capped at one rank's share of the step)" if b.micro_tokens > budget else ""
                raise ConfigError(
                    f"batch.tokens_per_step={tokens_per_step} does not split into micro-batches of whole "
                    f"sequences: batch.micro_tokens={b.micro_tokens}{capped} gives {micro_batch_size} "
                    f"sequence{'' if micro_batch_size == 1 else 's'} of seq_len={seq_len} per micro-batch "
                    f"x world_size({world_size}) = "
                    f"{per_micro} tokens; use batch.tokens_per_step={' or '.join(map(str, sorted(near)))}"
                    + (f", or {smaller}" if smaller.startswith("batch.micro_tokens=") else "")
                )
            raise ConfigError(
                f"batch.tokens_per_step={tokens_per_step} is not a multiple of "
                f"micro_batch_size({micro_batch_size}) "
                f"x seq_len({seq_len}) x world_size({world_size}) = {per_micro}; use batch.tokens_per_step="
                f"{_multiples_near(tokens_per_step, per_micro)}, or {smaller}"
            )
        return micro_batch_size, tokens_per_step // per_micro, notes


def _splits(cfg, world_size: int, **batch) -> bool:
    """Whether ``BatchConfig.split`` accepts cfg's batch keys with ``batch`` changed."""
    from types import SimpleNamespace

    b = cfg.batch
    keys = ("tokens_per_step", "micro_tokens", "micro_batch_size")
    changed = SimpleNamespace(**{k: batch.get(k, getattr(b, k)) for k in keys})
    try:
        BatchConfig.split(SimpleNamespace(batch=changed, seq_len=cfg.seq_len), world_size)
    except ConfigError:
        return False
    return True


def _whole_micro_tokens(cfg, world_size: int) -> str:
    """The fix for a batch.micro_tokens that is not a multiple of seq_len, as overrides that pass the
    batch checks as typed: the largest multiple below it, with a tokens_per_step near the current one
    when the current one does not split into it."""
    b, seq_len = cfg.batch, cfg.seq_len
    micro = max(seq_len, (b.micro_tokens // seq_len) * seq_len)
    fix = f"batch.micro_tokens={micro}"
    if _splits(cfg, world_size, micro_tokens=micro):
        return fix
    near = [
        t
        for t in _multiples_around(b.tokens_per_step, seq_len * world_size)
        if _splits(cfg, world_size, micro_tokens=micro, tokens_per_step=t)
    ]
    return (
        f"{fix} batch.tokens_per_step={near[0]}" if near else f"{fix} and a batch.tokens_per_step it divides"
    )


def _multiples_around(n: int, unit: int, count: int = 64) -> list[int]:
    """Positive multiples of ``unit``, nearest to ``n`` first (ties: the smaller first)."""
    lo = (n // unit) * unit
    cands = {lo - k * unit for k in range(count)} | {lo + (k + 1) * unit for k in range(count)}
    return sorted((c for c in cands if c > 0), key=lambda c: (abs(c - n), c))


def _multiples_near(n: int, unit: int) -> str:
    lo = (n // unit) * unit
    hi = lo + unit
    return f"{lo}" if lo == n else (f"{lo} or {hi}" if lo > 0 else f"{hi}")


@dataclass
class EvalConfig:
    """``eval.*``: validation passes on fixed batches."""

    interval: int = spec(
        100, "optimizer steps between validation passes (0 = only at the end)", NONNEG_INT, 100
    )
    batches: int = spec(20, "fixed validation batches (same every eval, backend and resume)", POS_INT, 20)
    batch_size: int | None = spec(
        None, "sequences per validation batch; null = the micro-batch size", POS_INT, 8
    )
    at_start: bool = spec(True, "also evaluate before the first step (step 0)", BOOL)


@dataclass
class CheckpointConfig:
    """``checkpoint.*``: atomic checkpoints in <out_dir>/ckpt."""

    interval: int = spec(
        500, "optimizer steps between checkpoints (0 = only at the end / on preemption)", NONNEG_INT, 500
    )
    keep: int = spec(3, "newest checkpoints kept", POS_INT, 3)
    at_end: bool = spec(True, "save one after the last step", BOOL)


@dataclass
class ParityConfig:
    """``parity.*``: loss/logits against a reference backend on the same batch and weights."""

    every: int = spec(0, "compare every K steps (0 = off)", NONNEG_INT, 50)
    reference: str = spec("naive", "reference backend: naive | sdpa", ("naive", "sdpa"))


@dataclass
class PerfConfig:
    """``perf.*``: throughput and MFU accounting."""

    peak_flops: Any = spec("auto", "FLOP/s per device for MFU: auto (from the GPU name) or a number")
    exclude_first_steps: int = spec(
        2, "steps (compile warm-up) left out of the median tokens/sec", NONNEG_INT, 2
    )
    profile_steps: int = spec(0, ">0: profile this many CUDA steps and report perf/gpu_busy", NONNEG_INT, 5)
    trace: bool = spec(
        False,
        "with profile_steps > 0: also record host activity, write <out_dir>/trace_stepA-B.json.gz (Perfetto)",
        BOOL,
    )

    @staticmethod
    def peak(cfg) -> float | None:
        """``perf.peak_flops`` as FLOP/s, or None for auto. Raises ConfigError unless auto or positive."""
        pf = cfg.perf.peak_flops
        if pf == "auto" or pf is None:
            return None
        try:
            peak = -1.0 if isinstance(pf, bool) else float(pf)
        except (TypeError, ValueError):
            peak = -1.0
        if not peak > 0 or not math.isfinite(peak):
            raise ConfigError(
                f"perf.peak_flops={pf!r} must be 'auto' or a positive FLOP/s, e.g. perf.peak_flops=989e12"
            )
        return peak


@dataclass
class WandbConfig:
    """``logger=wandb`` (key ``wandb``): Weights & Biases run settings."""

    mode: str = spec(
        "auto",
        "auto (online when logged in, else offline) | online | offline | disabled",
        ("auto", "online", "offline", "disabled"),
    )
    project: str = spec("flashgpt", "W&B project")
    entity: str | None = spec(None, "W&B entity (team/user); null = your default")
    group: str | None = spec(None, "null: none for single runs, the sweep folder's name under -m")
    name: str | None = spec(None, "null: the run folder's name (time, backend, seq_len)")
    tags: list[str] = spec([], "W&B tags")

    @staticmethod
    def validate(cfg) -> None:
        """wandb.mode=online needs a W&B login."""
        if cfg.wandb.mode == "online":
            from trainer.metrics import wandb_logged_in

            if not wandb_logged_in():
                raise ConfigError(
                    "wandb.mode=online but no W&B API key is configured; run `wandb login` (or set "
                    "WANDB_API_KEY), or use wandb.mode=auto (online when logged in, else offline) or offline"
                )


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")
PARALLEL_MODES = ("ddp", "fsdp")


@dataclass
class TrainConfig:
    """The whole train.py config (configs/config.yaml composes groups on top of it)."""

    attention: AttentionConfig = field(default_factory=AttentionConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    seq_len: int = spec(
        1024, "tokens per training sequence; model.block_size follows it unless set", POS_INT, 1024
    )
    seed: int = spec(
        1337, "seeds weights, dropout and the data windows (seed, step, global micro-batch)", NONNEG_INT, 1337
    )
    max_steps: int = spec(1000, "optimizer steps", POS_INT, 1000)
    device: str = spec("auto", "auto (cuda when present, else cpu) | cuda | cpu", ("auto", "cuda", "cpu"))
    dtype: str = spec(
        "auto",
        "auto (bf16 autocast on cuda, float32 on cpu) | bfloat16 | float32",
        ("auto", "bfloat16", "float32"),
    )
    tf32: bool = spec(True, "CUDA: float32 matmuls may use TF32 tensor cores (false = full float32)", BOOL)
    compile: Any = spec(
        "auto", "torch.compile the model: true | false | auto (true on cuda)", (True, False, "auto")
    )
    compile_mode: str = spec(
        "default",
        "torch.compile mode: default | reduce-overhead (CUDA graphs) | max-autotune-no-cudagraphs",
        COMPILE_MODES,
    )
    parallel: str = spec(
        "ddp",
        "several ranks (torchrun): ddp (replicated, all-reduce) | fsdp (FSDP2 sharded; DCP checkpoints)",
        PARALLEL_MODES,
    )
    deterministic: bool = spec(
        False,
        "torch.use_deterministic_algorithms (bitwise-reproducible runs; flash: the split backward on sm_90)",
        BOOL,
    )
    resume: bool = spec(False, "continue the run in out_dir from its newest loadable checkpoint", BOOL)
    init_from: str = spec(
        "scratch",
        "scratch | gpt2 | gpt2-medium | gpt2-large | gpt2-xl | a local HF GPT-2 checkpoint dir: the "
        "starting weights; the model shape comes from the checkpoint (model.* sizes ignored)",
    )
    nonfinite: str = spec(
        "stop", "non-finite loss/grad norm: stop (exit 1) | skip (drop the update)", ("stop", "skip")
    )
    oom_exit_code: int = spec(
        0, "exit status after a CUDA out-of-memory (0 lets sweeps go on)", NONNEG_INT, 0
    )
    log_interval: int = spec(10, "optimizer steps between console / metrics.jsonl / W&B lines", POS_INT, 10)
    batch: BatchConfig = field(default_factory=BatchConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parity: ParityConfig = field(default_factory=ParityConfig)
    perf: PerfConfig = field(default_factory=PerfConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    run_name: str = spec("run", "run folder name (configs/config.yaml: time, backend, seq_len, token)")
    out_dir: str = spec("runs/run", "run directory (= Hydra's run dir); resume=true: the run to continue")


def validate(cfg) -> None:
    """All static checks of a composed train.py config, before any data, model or GPU work.

    Order: every field's type/range/choice check (``spec``), then each group's ``validate`` (backend
    names, masks, model shape, lr pair, doc separator, W&B login).

    Raises:
        ConfigError: naming the key and a valid value.
    """
    from trainer.config_errors import unknown_key

    check_fields(cfg, TrainConfig, ignore={"hydra"}, unknown=unknown_key)
    for group in (AttentionConfig, ModelConfig, DataConfig, OptimConfig, WandbConfig):
        group.validate(cfg)


def typed(cfg) -> TrainConfig:
    """A validated config as a ``TrainConfig`` instance, interpolations resolved (``OmegaConf.to_object``):
    what the trainer reads after ``loop.run`` has checked it. A TrainConfig is returned as it is."""
    from omegaconf import OmegaConf

    return cfg if isinstance(cfg, TrainConfig) else OmegaConf.to_object(cfg)


def to_dict(cfg) -> dict:
    """A config (``TrainConfig`` or DictConfig) as plain, resolved dicts and lists: for the records
    (config.resolved.yaml, checkpoints, the W&B config)."""
    import dataclasses

    from omegaconf import OmegaConf

    if dataclasses.is_dataclass(cfg):
        return dataclasses.asdict(cfg)
    return OmegaConf.to_container(cfg, resolve=True)


def field_docs(schema: type = TrainConfig, prefix: str = "") -> dict[str, str]:
    """``{"batch.tokens_per_step": "tokens per optimizer step ...", ...}``: every key's one-line doc."""
    out = {}
    for f in fields(schema):
        sub = dataclass_type(f)
        if sub is not None:
            out.update(field_docs(sub, prefix + f.name + "."))
        else:
            out[prefix + f.name] = f.metadata.get("doc", "")
    return out


# ------------------------------------------------------------------------------------------ store
def register() -> None:
    """Store the schema (``flashgpt_schema``) and the model presets (``model/<name>`` from
    ``model.gpt.PRESETS``) in Hydra's ConfigStore. Idempotent; called on import of this module."""
    from model.gpt import PRESETS

    cs = ConfigStore.instance()
    cs.store(name="flashgpt_schema", node=TrainConfig)
    for name, sizes in PRESETS.items():
        cs.store(group="model", name=name, node=ModelConfig(name=name, **sizes))


register()

if __name__ == "__main__":  # python -m trainer.config: every key, its default and its doc
    from omegaconf import OmegaConf

    _defaults = OmegaConf.structured(TrainConfig)
    for _key, _doc in field_docs().items():
        print(f"{_key} = {fmt(OmegaConf.select(_defaults, _key))}    # {_doc}")
