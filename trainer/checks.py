"""Plan a run from its validated config, and the checks that need the machine or the files.

``resolve_plan`` validates once (``trainer.config.validate``), then derives devices, dtype, compile and the
batch split; the data checks (``check_data_source``, ``check_data_fits``), ``probe_attention`` and
``check_resume_compatible`` follow. Every error is a ``ConfigError`` naming the key and a valid value
(train.py: exit 2).
"""

from __future__ import annotations

import bisect
import dataclasses
import glob
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from data.sources import (
    _is_glob,
    has_files,
    is_document_source,
    is_hf,
    is_url,
    prepared_inside_source,
    source_stem,
)
from trainer import config as C
from trainer.config import ConfigError

__all__ = ["ConfigError", "Plan", "resolve_plan"]

#: GPTConfig fields a resume may change: the attention backend, its masks and dropout (an ablation may
#: continue from a checkpoint). Every other field sets a parameter shape or the function the weights were
#: trained for, and must match the checkpoint.
RESUME_MAY_CHANGE = (
    "attention",
    "sdpa_backend",
    "window",
    "document_mask",
    "dropout",
    "attn_dropout",
    "doc_separator_ids",
)


#: Dense bf16 tensor-core peak FLOP/s by GPU name fragment (vendor data sheets), for MFU.
PEAK_FLOPS_BF16 = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
    "4090": 165e12,
}


@dataclass
class Plan:
    """What ``resolve_plan`` derives from a valid config for this machine and world size."""

    device_type: str  # cuda | cpu
    autocast_dtype: str | None  # "bfloat16", or None: plain float32
    compile: bool
    micro_batch_size: int  # sequences per forward/backward per rank
    grad_accum: int  # micro-batches per optimizer step per rank
    eval_batch_size: int
    world_size: int  # torchrun ranks
    head_dim: int
    peak_flops: float | None  # FLOP/s per device for MFU; None: from the GPU's name later
    compile_mode: str | None = None  # None: "default"; "reduce-overhead" adds CUDA graphs
    notes: list[str] = field(default_factory=list)
    parallel: str = "ddp"  # ddp | fsdp (DCP checkpoints, also at world size 1)


def _machine_bytes(device_type: str) -> int | None:
    """The memory one process of the run has: CPU RAM, or on CUDA the GPU's; None where it cannot be read."""
    try:
        if device_type == "cuda":
            import torch

            return torch.cuda.get_device_properties(0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except Exception:  # noqa: BLE001 - no size known (or no CUDA build): no limit
        return None


def _vocab_estimate(cfg) -> int:
    """The vocabulary before the data are read: GPT-2's padded 50304, a char corpus' few hundred at most."""
    return int(cfg.model.vocab_size or (50304 if cfg.data.tokenizer == "gpt2" else 256))


#: Bytes of training state per parameter: float32 weights, gradients and AdamW's two moments.
STATE_BYTES = 16


def _check_model_fits(cfg, gpt, total: int | None, device_type: str, world_size: int) -> None:
    """Refuse a model whose training state, parameters x 16 bytes (float32 weights, gradients, AdamW's two
    moments; FSDP shares it among the ranks), exceeds the machine's memory (CPU RAM; on CUDA the GPU's),
    before set-up builds it: model.n_embd=1000000 had nn.Linear ask for 12 TB in set-up (``total``: the
    machine's bytes, `_machine_bytes`). Names a model.n_embd (a multiple of model.n_head x 8) that fits at
    this model.n_layer, else a model.n_layer.
    Best effort: no limit where the memory size cannot be read; an init_from model's shape is the
    checkpoint's (not known here)."""
    if str(cfg.init_from) != "scratch" or total is None:
        return
    shards = world_size if cfg.parallel == "fsdp" else 1
    gpt = dataclasses.replace(gpt, vocab_size=_vocab_estimate(cfg))

    def need(**changed) -> int:
        return dataclasses.replace(gpt, **changed).param_count() * STATE_BYTES // shards

    n_params = gpt.param_count()
    needed = n_params * STATE_BYTES // shards
    if needed <= total:
        return
    step = gpt.n_head * 8

    def fits(**changed) -> bool:  # in half the memory: the rest for activations, logits and the data
        return need(**changed) <= total // 2

    # the largest k with n_embd = k x step that fits (0: none); fits() only fails from some k on: bisect
    lo = bisect.bisect(range(1, gpt.n_embd // step + 1), False, key=lambda k: not fits(n_embd=k * step))
    fix = None
    for k in range(lo, 0, -1):  # the largest that GPTConfig also accepts (flash: its head dims)
        try:
            dataclasses.replace(gpt, n_embd=k * step)
        except ValueError:
            continue
        fix = f"model.n_embd={k * step} (at model.n_layer={gpt.n_layer})"
        break
    layers = bisect.bisect(range(1, gpt.n_layer), False, key=lambda n: not fits(n_layer=n))  # the same
    if layers:
        other = f"model.n_layer={layers} (at model.n_embd={gpt.n_embd})"
        fix = f"{fix}, or {other}" if fix else other
    shard = f" / {shards} FSDP ranks" if shards > 1 else ""
    raise ConfigError(
        f"model.n_embd={gpt.n_embd} model.n_layer={gpt.n_layer} is a {n_params:,}-parameter model, whose "
        f"training state needs about {needed / 2**30:,.0f} GiB ({n_params:,} x {STATE_BYTES} bytes: float32 "
        f"weights, gradients and AdamW's two moments{shard}), more than this machine's "
        f"{total / 2**30:,.0f} GiB ({'the GPU' if device_type == 'cuda' else 'RAM'}); use "
        + (fix or "a smaller model (model=tiny or model=mini)")
    )


def _check_eval_batch_fits(
    cfg, eval_bs: int, total: int | None, device_type: str, world_size: int, gpt
) -> None:
    """Refuse an evaluation batch whose float32 logits, (eval_bs, seq_len, vocab) x 4 bytes, need with the
    loss' temporaries about 3x that (logits, log-softmax, its output) and exceed the machine's memory (CPU
    RAM; on CUDA the GPU's), before it takes the machine down: eval.batch_size=100000 at seq_len 128 on the
    65-symbol char corpus grew a process to 24 GB and had it killed (measured). With eval.batch_size=null
    the batch is the training micro-batch, which training runs too: the message names the batch key that
    sets it, with a value whose training activations fit as well (float32, per token and layer about
    2 x (34 n_embd + 5 n_head seq_len) bytes, Korthikanti et al. 2022 table 2, in half the memory: cpu_tiny
    measured 44 KB a token, this estimate 58 KB). Best effort: no limit where the memory size is unknown."""
    vocab, seq_len = _vocab_estimate(cfg), int(cfg.seq_len)
    need = 3 * int(eval_bs) * seq_len * vocab * 4
    if total is None or need <= total:
        return
    fit = max(1, total // (3 * 4 * seq_len * vocab) // 2)
    what = (
        f"({eval_bs} x seq_len {seq_len} x vocab {vocab} x 4 bytes, x 3), more than this machine's "
        f"{total / 2**30:,.0f} GiB"
    )
    if cfg.eval.batch_size is not None:
        raise ConfigError(
            f"eval.batch_size={eval_bs} needs about {need / 2**30:,.0f} GiB for its logits and loss {what}; "
            f"use eval.batch_size={fit} or less (null: the training micro-batch)"
        )
    per_token = gpt.n_layer * 2 * (34 * gpt.n_embd + 5 * gpt.n_head * seq_len) + 3 * vocab * 4
    fit = max(1, min(fit, total // 2 // (per_token * seq_len)))
    b = cfg.batch
    if b.micro_batch_size is not None:
        name, given, values = "micro_batch_size", b.micro_batch_size, range(fit, 0, -1)
    else:
        name, given, values = "micro_tokens", b.micro_tokens, range(fit * seq_len, 0, -seq_len)
    # the largest that splits the step (stops at the first: fit can be large)
    value = next((v for v in values if _valid(cfg, world_size, name, [v])), values[0])
    key = f"batch.{name}"
    raise ConfigError(
        f"{key}={given} gives micro-batches of {eval_bs} sequences, whose logits and loss need about "
        f"{need / 2**30:,.0f} GiB {what}: in training, and in evaluation (eval.batch_size=null uses the "
        f"training micro-batch); use {key}={value} or less"
    )


def resolve_plan(cfg, *, world_size: int, cuda_available: bool) -> Plan:
    """Validate the config (``trainer.config.validate``), then derive devices, dtype and the batch split."""
    cfg, gpt = C.validate(cfg)
    if cfg.device == "cuda" and not cuda_available:
        raise ConfigError("device=cuda but no CUDA GPU is visible to torch; use device=auto or device=cpu")
    device_type = "cuda" if (cfg.device == "cuda" or (cfg.device == "auto" and cuda_available)) else "cpu"
    if gpt.attention == "flash":
        from kernels import interpret_enabled  # the kernels' own test, so both always agree

        if device_type != "cuda" and not interpret_enabled():
            raise ConfigError(
                "attention=flash needs a CUDA GPU (none here); use attention=sdpa (portable, any device), or "
                "set TRITON_INTERPRET=1 to run the Triton kernel slowly on the CPU for testing"
            )
    try:  # the environment variables the kernels read: checked now rather than at the first step
        if gpt.attention == "flash":  # read by the flash forward and backward
            from kernels.plan import ENV, ENV_BWD, mode

            for env in (ENV, ENV_BWD):
                mode(env)
        if device_type == "cuda":  # the training step's loss reads it (model/gpt.py), every backend
            from model.gpt import fused_loss_on

            if fused_loss_on():  # its kernels loaded before torch.compile traces the step
                import kernels.cross_entropy  # noqa: F401
    except ValueError as e:
        raise ConfigError(f"environment variable {e}; unset it for the default") from None
    if cfg.wandb.mode == "online":
        from trainer.metrics import wandb_logged_in

        if not wandb_logged_in():
            raise ConfigError(
                "wandb.mode=online but no W&B API key is configured; run `wandb login` (or set "
                "WANDB_API_KEY), or use wandb.mode=auto (online when logged in, else offline) or offline"
            )
    autocast_dtype = (
        "bfloat16" if cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and device_type == "cuda") else None
    )
    compile_ = (device_type == "cuda") if cfg.compile == "auto" else bool(cfg.compile)
    compile_mode = cfg.compile_mode
    if compile_mode == "reduce-overhead" and compile_ and world_size > 1:
        raise ConfigError(
            "compile_mode=reduce-overhead (CUDA graphs) is supported on one process only, and this run has "
            f"{world_size} ranks ({cfg.parallel.upper()}'s gradient hooks and collectives run outside the "
            "graphs); use compile_mode=default"
        )
    check_data_source(cfg)  # what the data is, before how much of it there is
    check_seq_len_fits_data(cfg, world_size)  # before the batch split: the data's limit is the message
    micro_batch_size, grad_accum = split_batch(cfg, world_size)
    notes = C.notes(cfg)
    if cfg.parallel == "fsdp" and world_size <= 1:
        notes.append(
            "note: parallel=fsdp with one process (no torchrun, or --nproc_per_node=1): nothing to shard, so "
            "the model runs unsharded; checkpoints are still DCP directories (they resume at any world size)"
        )
    if cfg.perf.profile_steps and device_type != "cuda":
        what = "perf.profile_steps and perf.trace are" if cfg.perf.trace else "perf.profile_steps is"
        notes.append(f"note: {what} a GPU measurement (CUDA kernel time); skipped on the CPU")
    if compile_mode == "reduce-overhead" and compile_ and device_type != "cuda":
        notes.append(
            "note: compile_mode=reduce-overhead adds CUDA graphs, which the CPU does not have: "
            "it runs like compile_mode=default here"
        )
    total = _machine_bytes(device_type)
    _check_model_fits(cfg, gpt, total, device_type, world_size)
    eval_bs = cfg.eval.batch_size if cfg.eval.batch_size is not None else micro_batch_size
    _check_eval_batch_fits(cfg, eval_bs, total, device_type, world_size, gpt)
    return Plan(
        device_type=device_type,
        autocast_dtype=autocast_dtype,
        compile=compile_,
        micro_batch_size=micro_batch_size,
        grad_accum=grad_accum,
        eval_batch_size=int(eval_bs),
        world_size=world_size,
        head_dim=gpt.head_dim,
        peak_flops=C.PerfConfig.peak(cfg),
        compile_mode=None if compile_mode == "default" else compile_mode,
        notes=notes,
        parallel=cfg.parallel,
    )


def _micro_batch(b, seq_len: int, world_size: int) -> int | None:
    """Sequences per micro-batch of one rank from the batch keys ``b``: micro_batch_size, else the
    micro_tokens budget (never more than one rank's share of the step, at least one sequence); None when
    neither gives one (both null, or micro_tokens above seq_len and not a multiple of it)."""
    if b.micro_batch_size is not None:
        return int(b.micro_batch_size)
    if b.micro_tokens is None or (b.micro_tokens > seq_len and b.micro_tokens % seq_len):
        return None
    return max(1, min(b.micro_tokens, max(1, b.tokens_per_step // world_size)) // seq_len)


def split_batch(cfg, world_size: int) -> tuple[int, int]:
    """(micro_batch_size, grad_accum) of one rank for ``world_size`` ranks."""
    b, seq_len = cfg.batch, cfg.seq_len
    tokens_per_step = b.tokens_per_step
    micro_batch_size = _micro_batch(b, seq_len, world_size)
    if micro_batch_size is None and b.micro_tokens is None:
        raise ConfigError(
            "batch.micro_batch_size=null needs batch.micro_tokens; set batch.micro_tokens=32768 "
            "(tokens per micro-batch) or batch.micro_batch_size=8 (sequences)"
        )
    if micro_batch_size is None:
        raise ConfigError(
            f"batch.micro_tokens={b.micro_tokens} must be a multiple of seq_len={seq_len}, or at "
            f"most seq_len (one sequence per micro-batch); use {_whole_micro_tokens(cfg, world_size)}"
        )
    per_micro = micro_batch_size * seq_len * world_size
    if tokens_per_step % per_micro == 0:
        return micro_batch_size, tokens_per_step // per_micro
    fits = _valid(cfg, world_size, "micro_batch_size", range(micro_batch_size - 1, 0, -1))
    if not fits and per_micro > tokens_per_step:
        smaller = "a shorter seq_len"  # one sequence per rank is already more than the step
    elif not fits:
        smaller = "a smaller batch.micro_batch_size"
    elif b.micro_batch_size is None:  # the micro-batch came from batch.micro_tokens
        smaller = f"batch.micro_tokens={fits[0] * seq_len}"
    else:
        smaller = f"batch.micro_batch_size={fits[0]}"
    if b.micro_batch_size is None:  # token budget: the micro-batch follows tokens_per_step
        near = _valid(
            cfg, world_size, "tokens_per_step", _multiples_around(tokens_per_step, seq_len * world_size)
        )
        capped = (
            " (capped at one rank's share of the step)"
            if b.micro_tokens > tokens_per_step // world_size
            else ""
        )
        raise ConfigError(
            f"batch.tokens_per_step={tokens_per_step} does not split into micro-batches of whole "
            f"sequences: batch.micro_tokens={b.micro_tokens}{capped} gives {micro_batch_size} "
            f"sequence{'' if micro_batch_size == 1 else 's'} of seq_len={seq_len} per micro-batch "
            f"x world_size({world_size}) = "
            f"{per_micro} tokens; use batch.tokens_per_step={' or '.join(map(str, sorted(near[:2])))}"
            + (f", or {smaller}" if smaller.startswith("batch.micro_tokens=") else "")
        )
    lo = tokens_per_step // per_micro * per_micro
    near = [n for n in (lo, lo + per_micro) if n > 0]
    raise ConfigError(
        f"batch.tokens_per_step={tokens_per_step} is not a multiple of micro_batch_size({micro_batch_size}) "
        f"x seq_len({seq_len}) x world_size({world_size}) = {per_micro}; use batch.tokens_per_step="
        f"{' or '.join(map(str, near))}, or {smaller}"
    )


def _valid(cfg, world_size: int, key: str, values, **changed) -> list[int]:
    """The one nearest-valid-value search behind the batch and seq_len suggestions: the ``values`` of ``key``
    (seq_len or a batch.* key), in their order, with which cfg's batch splits into whole micro-batches
    (``split_batch``; with ``changed`` keys changed too), so each suggestion runs as typed."""
    keys = ("tokens_per_step", "micro_tokens", "micro_batch_size")
    out = []
    for v in values:
        c = SimpleNamespace(**{"seq_len": cfg.seq_len, **{k: getattr(cfg.batch, k) for k in keys}, **changed})
        setattr(c, key, v)
        micro = _micro_batch(c, c.seq_len, world_size)
        if micro is not None and c.tokens_per_step % (micro * c.seq_len * world_size) == 0:
            out.append(v)
    return out


def _whole_micro_tokens(cfg, world_size: int) -> str:
    """The fix for a batch.micro_tokens that is not a multiple of seq_len, as overrides that pass the batch
    checks as typed: the largest multiple below it, with a tokens_per_step near the current one when the
    current one does not split into it."""
    b, seq_len = cfg.batch, cfg.seq_len
    micro = max(seq_len, (b.micro_tokens // seq_len) * seq_len)
    fix = f"batch.micro_tokens={micro}"
    near = [b.tokens_per_step, *_multiples_around(b.tokens_per_step, seq_len * world_size)]
    near = _valid(cfg, world_size, "tokens_per_step", near, micro_tokens=micro)
    if near and near[0] == b.tokens_per_step:
        return fix
    return (
        f"{fix} batch.tokens_per_step={near[0]}" if near else f"{fix} and a batch.tokens_per_step it divides"
    )


def _multiples_around(n: int, unit: int, count: int = 64) -> list[int]:
    """Positive multiples of ``unit``, nearest to ``n`` first (ties: the smaller first)."""
    lo = (n // unit) * unit
    cands = {lo - k * unit for k in range(count)} | {lo + (k + 1) * unit for k in range(count)}
    return sorted((c for c in cands if c > 0), key=lambda c: (abs(c - n), c))


def peak_flops_for(device_name: str | None) -> float:
    """bf16 dense peak FLOP/s for a GPU name (``torch.cuda.get_device_name()``); 989e12 when unknown."""
    found = (flops for frag, flops in PEAK_FLOPS_BF16.items() if frag in (device_name or ""))
    return next(found, PEAK_FLOPS_BF16["H100"])


def check_data_source(cfg) -> None:
    """Check ``data.source`` (a local file must exist and be readable) and ``data.dir`` (no other data)."""
    src = cfg.data.source
    for key, value in (("data.source", src), ("data.dir", cfg.data.dir)):
        if value is not None and not str(value).strip():  # else the cwd itself: a corpus, or where data go
            null = ", or data.source=null to download Tiny Shakespeare" if key == "data.source" else ""
            example = "/path/to/corpus.txt" if key == "data.source" else "data/mycorpus"
            raise ConfigError(
                f"{key}= is empty (an unset shell variable?); pass a path, e.g. {key}={example}{null}"
            )
    if resumes_without_source(cfg):  # the run's prepared tokens stand in for a moved corpus (setup says so)
        return
    if src is not None and not (is_url(src) or is_hf(src) or _is_glob(str(src))):
        p = Path(str(src)).expanduser()
        if not p.exists():
            raise ConfigError(
                f"data.source={src} does not exist (relative paths start at {Path.cwd()}); pass an "
                "existing UTF-8 text file, e.g. data.source=/path/to/corpus.txt, a directory or glob of "
                "text / .jsonl / .parquet files, hf:NAME[:CONFIG], or data.source=null to download Tiny "
                "Shakespeare"
            )
        if p.is_dir() and not has_files(p):  # first, or the tokenizer's advice would come before it
            raise ConfigError(
                f"data.source={src} is a directory without a (non-hidden) file; pass a directory of text / "
                ".jsonl / .parquet files, or a UTF-8 text file"
            )
        if not p.is_dir():  # a directory of documents: data.prepare lists and reads its files
            if not p.is_file():
                raise ConfigError(f"data.source={src} is not a file; pass a UTF-8 text file path")
            try:
                with open(p, "rb") as f:
                    f.read(1)
            except OSError as e:
                raise ConfigError(
                    f"data.source={src} is not readable ({e.strerror}); fix its permissions"
                ) from e
    d = Path(str(cfg.data.dir)).expanduser()
    if not cfg.resume and (inside := prepared_inside_source(src, d)) is not None:  # a resume keeps its own
        raise ConfigError(
            f"data.dir={cfg.data.dir} is inside data.source={src}: its token files would join the corpus "
            f"(the next run finds the source changed); pass a folder outside it, e.g. data.dir={inside}"
        )
    if is_document_source(src) and cfg.data.tokenizer == "char":
        from data.prepare import document_fixes

        # one fix that runs as typed: a data.dir that holds (char) data would be refused next, and what
        # the documents need besides (data.text_field, data.val_docs) would be the next errors
        own = f" data.dir={_own_folder(cfg, 'gpt2')}" if d.is_dir() and any(d.iterdir()) else ""
        fixes = document_fixes(src, cfg.data.text_field, cfg.data.val_fraction, cfg.data.val_docs)
        more = "".join(f" {as_keys(f)}" for f in fixes)
        raise ConfigError(
            f"data.tokenizer=char reads a single text file (its vocabulary is the text's characters); "
            f"data.source={src} is a list of documents: use data.tokenizer=gpt2{own}{more}"
        )
    if d.exists() and not d.is_dir():
        raise ConfigError(f"data.dir={cfg.data.dir} exists and is not a directory; pass a directory path")
    _check_separator_in_vocabulary(cfg)  # first: a data.dir of its own would not fix it
    _check_data_dir_matches(cfg, d)


def _check_separator_in_vocabulary(cfg) -> None:
    """A char-level corpus can only separate documents with its own characters (its vocabulary is the set of
    characters of the text): name data.doc_separator and a separator it can encode, before the data is
    prepared."""
    from data.docs import parse_separator

    sep = parse_separator(cfg.data.doc_separator)
    if not sep or cfg.data.tokenizer != "char":
        return
    meta = prepared_meta(cfg)
    if meta and isinstance(meta.get("itos"), list):
        vocab, where = set(meta["itos"]), f"data.dir={cfg.data.dir}"
    else:
        src = effective_data_source(cfg)
        if not src or is_url(src):
            return
        try:
            vocab = set(Path(str(src)).expanduser().read_text(encoding="utf-8-sig"))  # as data.prepare
        except (OSError, UnicodeDecodeError):
            return  # the data preparation reports an unreadable corpus
        where = f"data.source={src}"
    missing = [c for c in dict.fromkeys(sep) if c not in vocab]
    if not missing:
        return
    shown = ", ".join(f"{c!r} (U+{ord(c):04X})" for c in missing)
    works = (w for w in ("\\n\\n", "\\n") if set(parse_separator(w)) <= vocab)
    works = next(works, None) or sorted(vocab)[0]
    example = f"data.doc_separator='{works}'"
    if meta and meta.get("doc_separator") != parse_separator(works):  # prepared without it: its own folder
        given = Path(str(cfg.data.dir))
        example += f" data.dir={given.parent / ((given.name or 'data') + '_docs')}"
    raise ConfigError(
        f"data.doc_separator='{cfg.data.doc_separator}' holds {shown}, which the character vocabulary "
        f"of {where} ({len(vocab)} characters) does not: a char-level separator must be made of the "
        f"corpus's own characters; use e.g. {example}, or data.doc_separator=null (no documents)"
    )


def prepared_meta(cfg) -> dict | None:
    """The meta.json of the prepared data.dir, or None (absent or unreadable)."""
    try:
        return json.loads((Path(str(cfg.data.dir)).expanduser() / "meta.json").read_text())
    except (OSError, ValueError):
        return None


def prepare_args(cfg) -> dict:
    """The data keys as ``data.prepare``'s arguments (what the prepared data is made of)."""
    keys = ("tokenizer", "val_fraction", "doc_separator", "val_docs", "text_field", "max_tokens")
    return {k: getattr(cfg.data, k) for k in keys}


def _check_data_dir_matches(cfg, data_dir: Path) -> None:
    """Refuse to re-prepare a data directory that holds other data (``data.prepare.conflict_reason``: another
    corpus, tokenizer, document separator, split, text field or cap): other runs (and their resumes) read it.
    """
    from data.prepare import conflict_reason

    src = effective_data_source(cfg)
    try:
        held = conflict_reason(src, data_dir, **prepare_args(cfg))
    except (OSError, ValueError) as e:
        raise ConfigError(f"data.source={src}: {e}") from e
    if held:
        # prepare's arguments named as the keys that set them (doc_separator=... -> data.doc_separator=...)
        held = as_keys(held)
        if "as it was before" in held or cfg.resume:  # a changed corpus: a resume needs it back as it was
            raise ConfigError(changed_source_message(cfg, held))
        raise ConfigError(
            f"data.dir={cfg.data.dir} holds {held}; set data.dir={_own_folder(cfg)} (a folder of its own) or "
            f"delete {cfg.data.dir} to re-prepare it"
        )


def _own_folder(cfg, tokenizer: str | None = None) -> Path:
    """A data.dir beside the given one that holds nothing yet, named after the corpus and the tokenizer
    (``other_char``, ``fineweb_gpt2``; default data.tokenizer), as nanoGPT's data/<corpus>/ folders."""
    given = Path(str(cfg.data.dir))
    name = f"{source_stem(cfg.data.source)}_{tokenizer or cfg.data.tokenizer}"
    other, n = given.parent / name, 2
    while other.exists():  # a folder of its own: never one that holds (other) data
        other, n = given.parent / f"{name}_{n}", n + 1
    return other


def changed_source_message(cfg, held: str) -> str:
    """The refusal of a data.dir that holds data of another (or a changed) corpus, with a way forward that
    works: a new run prepares the corpus as it is now into a folder of its own; a resume continues on the data
    it was trained on, so the corpus must be as it was (a directory is identified by its files' names, sizes
    and mtimes), or the changed corpus goes to a new run."""
    other = _own_folder(cfg)
    new_run = (
        f"set data.dir={other} (prepared afresh from it; the runs that read {cfg.data.dir} keep their data)"
    )
    if not cfg.resume:
        return (
            f"data.dir={cfg.data.dir} holds {held}, which runs read, so it is not prepared again. To "
            f"train on data.source={cfg.data.source} as it is now, {new_run}"
        )
    if is_document_source(cfg.data.source):  # identified by its files' names, sizes and mtimes
        as_was = (
            "the same files with the same sizes and modification times, e.g. restored with `cp -p` or "
            "`rsync -a` from a copy; editing a file back changes its time"
        )
    else:  # a text file: by its SHA-256
        as_was = "the same bytes, e.g. restored from a copy; its modification time does not matter"
    return (
        f"resume=true refused: data.dir={cfg.data.dir} holds {held}. A resume continues on the data it was "
        f"trained on: put data.source={cfg.data.source} back as it was ({as_was}), or train on the changed "
        f"corpus in a new run (resume=false, a new out_dir) and {new_run}"
    )


def resumes_without_source(cfg) -> bool:
    """A resume whose local ``data.source`` names nothing any more (a moved or deleted file, directory or
    glob) while ``data.dir`` still holds the data prepared for the run: it continues on those tokens (the
    checkpoint's recorded SHA-256 and token counts are checked against them in set-up), since nothing it needs
    is gone."""
    src = cfg.data.source
    if not cfg.resume or src is None or is_url(src) or is_hf(src):
        return False
    path = os.path.expanduser(str(src))
    if not str(src).strip() or os.path.exists(path) or glob.glob(path, recursive=True):
        return False
    return prepared_meta(cfg) is not None


def effective_data_source(cfg) -> str | None:
    """``data.source``; when it is null (download) and ``data.dir`` already holds data prepared from a local
    file that still exists, that file (so a resume or a rerun needs neither the network nor the original
    ``data.source=`` override)."""
    if cfg.data.source is not None:
        return cfg.data.source
    meta = prepared_meta(cfg)
    src = (meta or {}).get("source")
    if src and not is_url(src) and (is_hf(src) or Path(src).exists() or meta.get("source_kind") == "docs"):
        return str(src)
    return None


def as_keys(text: str) -> str:
    """prepare's arguments in a message named as the keys that set them (val_docs=1 -> data.val_docs=1)."""
    from data.prepare import _ARG  # the pattern its command line names them by (--val-docs)

    return _ARG.sub(r"data.\1=", text)


def check_data_fits(cfg, meta: dict, world_size: int = 1) -> None:
    """The prepared corpus must hold at least seq_len + 1 tokens in each split (one window + its target).
    When a validation share below the usual one is the cause, data.val_fraction is named first."""
    from data.prepare import DEFAULT_VAL_FRACTION as default
    from data.prepare import split_point

    n_val, n_train = int(meta["val_tokens"]), int(meta["train_tokens"])
    largest, total, fraction = min(n_val, n_train) - 1, n_val + n_train, cfg.data.val_fraction
    if cfg.seq_len <= largest:
        return
    what = f"data.dir={cfg.data.dir} holds {n_val:,} validation and {n_train:,} training tokens"
    if fraction is not None and fraction < default and cfg.seq_len < total - split_point(total, default):
        rest = seq_len_too_long(cfg, what, largest, world_size).split("; use ", 1)[1]
        raise ConfigError(
            f"data.val_fraction={fraction:g} is too small for seq_len={cfg.seq_len}: {what}, and one "
            f"validation window needs seq_len + 1 tokens; use data.val_fraction={default:g} "
            f"data.dir={_own_folder(cfg)} ({cfg.data.dir} holds this split now), or {rest}"
        )
    raise ConfigError(seq_len_too_long(cfg, what, largest, world_size))


def seq_len_too_long(cfg, what: str, largest: int, world_size: int = 1) -> str:
    """The one message for a seq_len longer than the data allows (``largest``), with one fix that gets past
    every check: the longest power of two within the limit when it fits the batch too, else the longest
    one that fits the current batch, with the batch change that the longer one needs."""
    head = (
        f"seq_len={cfg.seq_len} is longer than the data allows: {what}, and one training or validation "
        f"window needs seq_len + 1 tokens, so seq_len can be at most {largest:,}"
    )
    corpus = "a larger corpus (data.source=PATH with a data.dir of its own)"
    if largest < 1:
        return f"{head}; use {corpus}"
    best = 1 << (largest.bit_length() - 1)  # a power of two divides the usual batch sizes
    fitting = (_valid(cfg, world_size, "seq_len", [best >> i for i in range(best.bit_length())]) or [None])[0]
    if fitting == best:
        return f"{head}; use seq_len={best} (or any value up to {largest}), or {corpus}"
    # the longer one with the smallest batch.tokens_per_step from the current one up that it splits into
    unit = best * world_size
    first = -(-int(cfg.batch.tokens_per_step) // unit) * unit
    tokens = _valid(cfg, world_size, "tokens_per_step", range(first, first + 512 * unit, unit), seq_len=best)
    longer = f"seq_len={best} " + (f"batch.tokens_per_step={tokens[0]}" if tokens else "and a batch it fits")
    if fitting is None:
        return f"{head}; use {longer}, or {corpus}"
    return f"{head}; use seq_len={fitting} (fits the current batch), or {longer}, or {corpus}"


def check_seq_len_fits_data(cfg, world_size: int = 1) -> None:
    """Before the batch checks, where data.dir already holds this tokenizer and split: a seq_len longer
    than the data is the one message to give (the batch's own hint would lead to it next). Data not
    prepared yet are checked exactly once they are (``check_data_fits`` in set-up)."""
    from data.prepare import meta_split, val_split

    try:  # as the prepare step reads them: one of them set, a null share is 0.1
        fraction, docs = val_split(cfg.data.val_fraction, cfg.data.val_docs)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    meta = prepared_meta(cfg)
    try:
        same = (
            meta is not None
            and meta.get("tokenizer") == cfg.data.tokenizer
            and meta_split(meta)[1] == docs
            and (docs is not None or abs(float(meta.get("val_fraction")) - fraction) < 1e-12)
        )
    except (TypeError, ValueError):
        same = False
    if same and "train_tokens" in meta and "val_tokens" in meta:
        check_data_fits(cfg, meta, world_size)


def probe_attention(cfg, plan: Plan, device, n_head: int) -> None:
    """Try the configured attention on a tiny tensor of the real head dim and dtype on ``device``."""
    import torch

    name = cfg.attention.name
    if name == "flash":
        try:
            from kernels import check_flash_available
        except ImportError as e:
            raise ConfigError(
                f"attention=flash: the kernels package failed to import ({e}); use attention=sdpa"
            ) from e
        try:
            check_flash_available(torch.device(device))
        except RuntimeError as e:
            raise ConfigError(f"attention=flash cannot run here: {e}") from e
    sdpa_backend = cfg.attention.sdpa_backend
    if name != "sdpa" or sdpa_backend == "auto":
        return
    from model.attention import attention as attention_fn
    from trainer.metrics import first_line

    dtype = torch.bfloat16 if plan.autocast_dtype == "bfloat16" else torch.float32
    shape = (1, min(2, n_head), min(cfg.seq_len, 128), plan.head_dim)
    attn_dropout = float(cfg.model.attn_dropout or 0.0)

    def runs(backend: str) -> str | None:
        try:
            gen = torch.Generator(device=device).manual_seed(0)  # leaves the global RNG streams alone
            q, k, v = (
                torch.randn(shape, device=device, dtype=dtype, generator=gen).requires_grad_()
                for _ in range(3)
            )
            # as training calls it: with the run's attention dropout (some kernels have no dropout path)
            attention_fn(q, k, v, "sdpa", backend, dropout_p=attn_dropout).sum().backward()
            return None
        except Exception as e:  # noqa: BLE001 - any failure means "cannot run"
            return first_line(e)

    err = runs(sdpa_backend)
    if err is None:
        return
    from model import SDPA_BACKENDS

    ok = [b for b in SDPA_BACKENDS if b not in ("auto", sdpa_backend) and runs(b) is None]
    raise ConfigError(
        f"attention.sdpa_backend={sdpa_backend} cannot run head_dim={plan.head_dim}, "
        f"dtype={str(dtype)[6:]}" + (f", model.attn_dropout={attn_dropout}" if attn_dropout else "") + " on "
        f"{device} ({err}); use attention.sdpa_backend=auto"
        + (" or one that runs here: " + ", ".join(f"attention.sdpa_backend={b}" for b in ok) if ok else "")
    )


def check_init_from_overrides(cfg, overrides: list[str]) -> None:
    """init_from: the model is the checkpoint's (``model.pretrained.FIXED``: its shape, biases, key/value
    heads, positions, q/k norms), so a ``model.*`` key of those that the command line sets to another value
    would be ignored: refused, naming each key, the value given and the checkpoint's. Only keys typed on the
    command line count: a preset's (``model=``, ``experiment=``) give way to the checkpoint (set-up says so).
    Before the weights are read (a GPT-2 size's shape is known, a directory's is in its config.json)."""
    if str(cfg.init_from) == "scratch" or cfg.resume:  # a resume: the run's own shape, checked against it
        return
    from model.config import fmt
    from model.pretrained import FIXED, checkpoint_shape, differs
    from trainer.rundir import parse_overrides

    shape = checkpoint_shape(str(cfg.init_from))
    if shape is None:  # not a checkpoint: set-up's load_gpt2 says why
        return
    typed = {o.key_or_group: o.input_line for o in parse_overrides(overrides) if not o.is_delete()}
    given = {k: cfg.model[k] for k in FIXED if f"model.{k}" in typed}
    wrong = [k for k, v in given.items() if differs(k, v, shape)]
    if not wrong:
        return
    init = f"init_from={cfg.init_from}"
    listed = "; ".join(f"model.{k}={fmt(given[k])} ({init}'s: {fmt(shape[k])})" for k in wrong)
    raise ConfigError(
        f"{init} starts from weights that fit one model, and this command line sets another: {listed}. "
        f"Drop {' '.join(typed[f'model.{k}'] for k in wrong)} to train from {init} in its own shape, or drop "
        f"{init} (init_from=scratch, the default) to train the model you set from scratch"
    )


def check_resume_compatible(saved: dict, new: dict) -> list[str]:
    """Compare a checkpoint's model/tokenizer settings with the new run's."""
    from model.config import GPTConfig, fmt, key

    # a checkpoint from before a field existed has its default; n_kv_head null is n_head
    defaults = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    old, now = ({**defaults, **d["model_args"]} for d in (saved, new))
    # n_kv_head null on both sides follows n_head: a changed n_head says it (the user set no n_kv_head)
    follows = old["n_kv_head"] is None and now["n_kv_head"] is None
    for args in (old, now):
        args["n_kv_head"] = args["n_kv_head"] or args["n_head"]
    changed = [
        k
        for k in defaults
        if k not in RESUME_MAY_CHANGE and old[k] != now[k] and not (k == "n_kv_head" and follows)
    ]
    diffs = [f"{key(k)}: {old[k]} -> {now[k]}" + " (follows seq_len)" * (k == "block_size") for k in changed]
    values = [f"{key(k)}={fmt(old[k])}" for k in changed]
    for name in ("tokenizer", "vocab_size"):
        a, b = saved.get(name), new.get(name)
        if a != b:
            diffs.append(f"data.{name}: {a} -> {b}")
            values += [f"data.tokenizer={a}"] if name == "tokenizer" else []
    if diffs:
        raise ConfigError(
            "resume=true refused: the checkpoint was trained with another model shape or tokenizer (the "
            f"run's -> this command's): {'; '.join(diffs)}. Drop the overrides that change them (the key, "
            "or a model= / experiment= option that sets it) to resume with the run's values "
            f"({' '.join(values)}), or start a new run with the new values in another out_dir"
        )
    notes = []
    if tuple(saved.get("attention", ())) != tuple(new.get("attention", ())):
        notes.append(
            f"attention backend changed on resume: {saved.get('attention')} -> {new.get('attention')}"
        )
    # allowed, but the weights so far were trained for the other value: said, as the backend change is
    notes += [
        f"{key(k)} changed on resume: {old[k]} -> {now[k]} (the steps so far trained with {old[k]})"
        for k in RESUME_MAY_CHANGE
        if k not in ("attention", "doc_separator_ids") and old[k] != now[k]
    ]
    return notes
