"""Typed configs of train.py: one dataclass per config group, stored in Hydra's ConfigStore.

OmegaConf refuses a wrong type or an unknown key while composing; ``validate`` then checks the typed config
once, without I/O. The ``model`` and ``attention`` groups are made from ``GPTConfig`` (model/config.py), so
the model has one schema and one validation. ``python -m trainer.config`` lists every key and its doc.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field, fields
from typing import Any

from hydra.core.config_store import ConfigStore

from model.config import (
    ATTENTION_KEYS,
    BOOL,
    FINITE,
    NONNEG,
    NONNEG_INT,
    NOT_KEYS,
    OPEN_UNIT,
    POS_INT,
    PRESETS,
    SEED,
    UNIT,
    GPTConfig,
)
from model.config import field_docs as gpt_docs
from trainer.fields import ConfigError, check_fields, check_known, print_keys, spec, step_span

__all__ = ["ConfigError", "TrainConfig", "gpt_config_for", "typed", "validate"]

#: GPTConfig fields that the trainer fills in when null: the data's vocab and seq_len.
FOLLOWS = ("block_size", "vocab_size")


def _group_of_gpt(cls_name: str, names: dict[str, str], preset: str | None = None) -> type:
    """A Hydra group's dataclass of GPTConfig's fields ``names`` ({key: field}; with ``preset``, a ``name``
    key first): each keeps its type, default and doc and names its GPTConfig field (metadata ``gpt``)."""
    hints, docs, default = typing.get_type_hints(GPTConfig), gpt_docs(), GPTConfig()
    rows = [("name", str, spec(preset, "preset name (for records; the sizes below are what counts)"))]
    for key, name in names.items():
        t, value = (hints[name] | None, None) if name in FOLLOWS else (hints[name], getattr(default, name))
        rows.append((key, t, field(default=value, metadata={"doc": docs[name], "gpt": name})))
    return dataclasses.make_dataclass(cls_name, rows[preset is None :], namespace={"__module__": __name__})


#: ``attention=naive|sdpa|flash`` (configs/attention/): ``name`` is GPTConfig's ``attention``.
AttentionConfig = _group_of_gpt("AttentionConfig", {k: f for f, k in ATTENTION_KEYS.items()})
#: ``model=<preset>``: GPT-2's shape (``model.config.PRESETS``, stored here as ``model/<name>``).
ModelConfig = _group_of_gpt(
    "ModelConfig",
    {f.name: f.name for f in dataclasses.fields(GPTConfig) if f.name not in (*ATTENTION_KEYS, *NOT_KEYS)},
    "gpt2",
)


@dataclass
class DataConfig:  # data=shakespeare|shakespeare_char (configs/data/): the corpus, where it is prepared
    name: str = spec("shakespeare", "dataset name (for records)")
    source: str | None = spec(
        None,
        "null = download Tiny Shakespeare; a UTF-8 text file or URL; a directory or glob of text / "
        ".jsonl / .json.gz / .parquet files; hf:NAME[:CONFIG] (docs/data.md)",
    )
    dir: str = spec("data/shakespeare", "where the token shards and meta.json go (relative to the cwd)")
    tokenizer: str = spec("gpt2", "gpt2 (tiktoken BPE) | char", ("gpt2", "char"))
    val_fraction: float | None = spec(
        None,
        "share held out for validation, in (0, 1): whole documents, or a text file's end; null = 0.1",
        OPEN_UNIT,
        0.1,
    )
    val_docs: int | None = spec(
        None, "or this many whole documents held out (the first); not with data.val_fraction", POS_INT, 100
    )
    doc_separator: str | None = spec(
        None,
        "null | the string between documents, e.g. '\\n\\n' (escapes "
        "understood); prepare records the documents",
    )
    text_field: str = spec("text", "record field / column holding the text (JSONL, Parquet, hf: sources)")
    max_tokens: int | None = spec(None, "prepare at most this many tokens; null = all", POS_INT, 1000000000)
    workers: int | None = spec(None, "tokenizer threads of the prepare step; null = CPU count", POS_INT, 8)


@dataclass
class OptimConfig:  # optim=adamw (configs/optim/): AdamW, linear warmup, cosine decay to min_lr
    name: str = spec("adamw", "optimizer (AdamW; decay on 2-D weights only, fused on CUDA)", ("adamw",))
    lr: float = spec(6.0e-4, "peak learning rate", FINITE)
    min_lr: float = spec(6.0e-5, "learning rate at the end of the cosine decay", FINITE)
    weight_decay: float = spec(0.1, "AdamW weight decay (2-D weights only)", NONNEG)
    beta1: float = spec(0.9, "AdamW beta1", UNIT)
    beta2: float = spec(0.95, "AdamW beta2", UNIT)
    grad_clip: float = spec(1.0, "max global grad norm (0 = no clipping; the norm is still checked)", NONNEG)
    warmup_steps: int = spec(100, "linear warmup length in optimizer steps", NONNEG_INT)
    decay_steps: int | None = spec(
        None, "cosine decay length in optimizer steps; null = max_steps", POS_INT, 1000
    )


@dataclass
class BatchConfig:  # batch.*: tokens per optimizer step, one rank's share cut into micro-batches
    tokens_per_step: int = spec(65536, "tokens per optimizer step, over micro-batches and ranks", POS_INT)
    micro_tokens: int | None = spec(
        32768,
        "tokens per forward/backward on one rank (at most); micro-batch = max(1, that // seq_len)",
        POS_INT,
    )
    micro_batch_size: int | None = spec(
        None, "sequences per forward/backward on one rank (wins over micro_tokens)", POS_INT, 8
    )


@dataclass
class EvalConfig:  # eval.*: validation passes on fixed batches
    interval: int = spec(
        100,
        "optimizer steps between validation passes (0: none between; at_start and the end still)",
        NONNEG_INT,
    )
    batches: int = spec(20, "fixed validation batches (same every eval, backend and resume)", POS_INT)
    batch_size: int | None = spec(
        None, "sequences per validation batch; null = the micro-batch size", POS_INT, 8
    )
    at_start: bool = spec(True, "also evaluate before the first step (step 0)", BOOL)


@dataclass
class CheckpointConfig:  # checkpoint.*: atomic checkpoints in <out_dir>/ckpt
    interval: int = spec(
        500, "optimizer steps between checkpoints (0 = only at the end / on preemption)", NONNEG_INT
    )
    keep: int = spec(3, "newest checkpoints kept", POS_INT)
    at_end: bool = spec(True, "save one after the last step", BOOL)


@dataclass
class ParityConfig:  # parity.*: loss/logits against a reference backend, same batch and weights
    every: int = spec(0, "compare every K steps (0 = off)", NONNEG_INT, 50)
    reference: str = spec("naive", "reference backend: naive | sdpa", ("naive", "sdpa"))


@dataclass
class PerfConfig:  # perf.*: throughput and MFU accounting
    peak_flops: Any = spec(
        "auto", "FLOP/s per device for MFU: auto (from the GPU name; no MFU on a CPU) or a number"
    )
    exclude_first_steps: int = spec(
        2, "steps (compile warm-up) left out of the median tokens/sec", NONNEG_INT
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
class WandbConfig:  # logger=wandb (key wandb): Weights & Biases run settings
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


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")
PARALLEL_MODES = ("ddp", "fsdp")


@dataclass
class TrainConfig:  # the whole train.py config (configs/config.yaml composes groups on top of it)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    seq_len: int = spec(1024, "tokens per training sequence; model.block_size follows it unless set", POS_INT)
    seed: int = spec(
        1337, "seeds weights, dropout and the data windows (seed, step, global micro-batch)", SEED
    )
    max_steps: int = spec(1000, "optimizer steps", POS_INT)
    device: str = spec("auto", "auto (cuda when present, else cpu) | cuda | cpu", ("auto", "cuda", "cpu"))
    dtype: str = spec(
        "auto",
        "auto (bf16 autocast on cuda, float32 on cpu) | bfloat16 | float32 (no float16: it needs a loss "
        "scaler, which the trainer has not; the kernels take fp16 called directly)",
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
        "starting weights; the model shape comes from the checkpoint (a model.* shape key typed with it: "
        "refused)",
    )
    nonfinite: str = spec(
        "stop", "non-finite loss/grad norm: stop (exit 1) | skip (drop the update)", ("stop", "skip")
    )
    oom_exit_code: int = spec(0, "exit status after a CUDA out-of-memory (0 lets sweeps go on)", NONNEG_INT)
    log_interval: int = spec(10, "optimizer steps between console / metrics.jsonl / W&B lines", POS_INT)
    batch: BatchConfig = field(default_factory=BatchConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parity: ParityConfig = field(default_factory=ParityConfig)
    perf: PerfConfig = field(default_factory=PerfConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    run_name: str = spec(
        "run", "run folder name (train.py: <time>_<backend>_n<seq_len>_<token>, configs/config.yaml)"
    )
    out_dir: str = spec(
        "runs/run", "run directory (= Hydra's run dir; train.py: runs/<time>_<backend>_n<seq_len>_<token>)"
    )


def typed(cfg) -> TrainConfig:
    """The composed config as a ``TrainConfig``; a key outside the schema (``+typo=1``, which gets past
    OmegaConf) is a ConfigError."""
    from omegaconf import OmegaConf, open_dict

    if isinstance(cfg, TrainConfig):
        return cfg
    check_known(cfg, TrainConfig)
    if "hydra" in cfg:  # an experiment's hydra.sweep settings: Hydra's, not the run's
        cfg = cfg.copy()
        with open_dict(cfg):
            del cfg["hydra"]
    return OmegaConf.to_object(cfg)


def gpt_config_for(cfg, vocab_size: int | None = None, doc_separator_ids=None) -> GPTConfig:
    """The run's ``GPTConfig`` from its ``model.*`` and ``attention.*`` keys; block_size null: ``seq_len``,
    vocab_size null: ``model.vocab_size``, else GPT-2's padded 50304 until the data are known."""
    args = {"doc_separator_ids": doc_separator_ids}
    for schema, group in ((ModelConfig, cfg.model), (AttentionConfig, cfg.attention)):
        args |= {f.metadata["gpt"]: getattr(group, f.name) for f in fields(schema) if "gpt" in f.metadata}
    args["block_size"] = args["block_size"] if args["block_size"] is not None else cfg.seq_len
    args["vocab_size"] = vocab_size or args["vocab_size"] or GPTConfig.vocab_size
    return GPTConfig(**args)


def validate(cfg) -> tuple[TrainConfig, GPTConfig]:
    """All static checks of a composed train.py config, once, before any data, model or GPU work; no I/O."""
    t = typed(cfg)
    check_fields(t, TrainConfig)
    try:
        gpt = gpt_config_for(t)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    m, a, d, o = t.model, t.attention, t.data, t.optim
    if m.block_size is not None and t.seq_len > m.block_size:
        raise ConfigError(
            f"seq_len={t.seq_len} is larger than model.block_size={m.block_size}; use seq_len={m.block_size} "
            f"(or smaller), or model.block_size={t.seq_len} (or model.block_size=null to follow seq_len)"
        )
    if d.doc_separator is not None and not d.doc_separator:
        raise ConfigError(
            f"data.doc_separator={d.doc_separator!r} must be null or a non-empty string, e.g. "
            "data.doc_separator='\\n\\n' (Tiny Shakespeare: one speech per document)"
        )
    from data.sources import is_document_source

    if a.document_mask and d.doc_separator is None and not is_document_source(d.source):
        raise ConfigError(
            "attention.document_mask=true needs documents: set data.doc_separator (e.g. "
            "data.doc_separator='\\n\\n' for Tiny Shakespeare, with a data.dir of its own), or a "
            "data.source of documents (a directory, glob, .jsonl, .parquet or hf:NAME), "
            "or attention.document_mask=false"
        )
    if not o.lr > 0 or not 0 <= o.min_lr <= o.lr:
        raise ConfigError(
            f"optim.lr={o.lr} / optim.min_lr={o.min_lr}: need 0 <= min_lr <= lr and lr > 0, "
            "e.g. optim.lr=6e-4 optim.min_lr=6e-5"
        )
    if t.perf.trace and not t.perf.profile_steps:
        raise ConfigError(
            "perf.trace=true traces the profiled steps, and perf.profile_steps=0 profiles none; "
            "set perf.profile_steps=3 (for example) or perf.trace=false"
        )
    PerfConfig.peak(t)
    return t, gpt


def notes(cfg: TrainConfig) -> list[str]:
    """What a valid config's keys do not do, for the start-up report."""
    b, a, out = cfg.batch, cfg.attention, []
    if b.micro_batch_size is not None and b.micro_tokens is not None:
        out.append(
            f"note: batch.micro_batch_size={b.micro_batch_size} is set, so batch.micro_tokens="
            f"{b.micro_tokens} is not used (batch.micro_batch_size=null uses the token budget)"
        )
    if a.name != "sdpa" and a.sdpa_backend != "auto":
        out.append(
            f"note: attention.sdpa_backend={a.sdpa_backend} applies to attention=sdpa only; "
            f"attention={a.name} does not use it"
        )
    if a.window is not None and a.window >= cfg.seq_len:
        out.append(
            f"note: attention.window={a.window} >= seq_len={cfg.seq_len}: every token sees all earlier "
            "ones, the same as attention.window=null (full causal)"
        )
    if cfg.optim.warmup_steps >= cfg.max_steps > 0:  # e.g. experiment=cpu_tiny (50) in a 10-step try-out
        o, last = cfg.optim, cfg.optim.lr * cfg.max_steps / cfg.optim.warmup_steps
        out.append(
            f"warning: optim.warmup_steps={o.warmup_steps} >= max_steps={cfg.max_steps}: the learning rate "
            f"only ramps up (to {last:.3g} at the last step, not optim.lr={o.lr:g}) and never decays; "
            f"for a run this short use e.g. optim.warmup_steps={cfg.max_steps // 10}"
        )
    ck = cfg.checkpoint
    last = cfg.max_steps // ck.interval * ck.interval if ck.interval else 0
    if not ck.at_end and last < cfg.max_steps:  # e.g. a one-off checkpoint.at_end=false kept by a resume
        saved = f"the last checkpoint is at step {last}" if last else "no checkpoint is written"
        out.append(
            f"warning: checkpoint.at_end=false with checkpoint.interval={ck.interval}: {saved}, so no "
            f"checkpoint will hold {step_span(last + 1, cfg.max_steps)} (eval.py, sample.py and resume=true "
            "read the newest one); pass checkpoint.at_end=true to keep the final weights"
        )
    return out


# the schema and the model presets (model/<name>) in Hydra's ConfigStore, on import
ConfigStore.instance().store(name="flashgpt_schema", node=TrainConfig)
for _name, _sizes in PRESETS.items():
    ConfigStore.instance().store(group="model", name=_name, node=ModelConfig(name=_name, **_sizes))

if __name__ == "__main__":  # python -m trainer.config: every key, its default and its doc
    print_keys(TrainConfig)
