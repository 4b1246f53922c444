"""Set-up of a training run: device, data, model config, resume checks, model and optimizer, logging.
Every user error raises ``ConfigError`` before any GPU allocation."""

from __future__ import annotations

import dataclasses
import errno
import os
import socket
from pathlib import Path

import torch
from omegaconf import OmegaConf

from data.loader import BinDataset
from data.meta import load_meta, tokens_digest
from data.prepare import atomic_write, load_prepared
from model import GPT
from model.config import fmt
from model.gpt import fused_loss_on
from model.pretrained import FIXED, differs, load_into
from trainer import checkpoint as ckpt
from trainer import progress, resume_config, rundir
from trainer.checks import (
    ConfigError,
    as_keys,
    check_data_fits,
    check_resume_compatible,
    effective_data_source,
    peak_flops_for,
    prepare_args,
    probe_attention,
    resumes_without_source,
)
from trainer.compiling import compile_model, compile_options
from trainer.config import gpt_config_for
from trainer.endings import hydra_arg, resume_command
from trainer.metrics import first_line
from trainer.schedule import lr_at
from trainer.state import RunState


def setup(st: RunState) -> None:
    """Raises ConfigError for user errors (before GPU allocation) and ``rundir.RunFinished``."""
    setup_device(st)
    if st.cfg.resume and st.broadcast(not ckpt.list_checkpoints(st.out_dir) if st.dist.is_main else None):
        # before data preparation, which would prepare (download) the defaults' data for nothing
        raise ConfigError(no_checkpoint_message(st))
    load_pretrained(st)  # before the data: offline without the weights, nothing is prepared for nothing
    prepare_data(st)
    build_model_config(st)
    state = load_resume(st)
    build_model(st, state)
    start_logging(st, state)


def setup_device(st: RunState) -> None:
    cfg, plan, d = st.cfg, st.plan, st.dist
    if plan.device_type == "cuda":
        st.device = torch.device("cuda", d.local_rank)
        torch.cuda.set_device(st.device)
        torch.cuda.reset_peak_memory_stats(st.device)  # a previous multirun job's peak is not ours
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = bool(cfg.tf32)
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(int(cfg.seed) + d.rank)
    if plan.autocast_dtype == "bfloat16":
        st.autocast = torch.autocast(device_type=plan.device_type, dtype=torch.bfloat16)


def prepare_data(st: RunState) -> None:
    """Rank 0 prepares the data (the others wait and get its error, if any); the corpus must fit."""
    cfg = st.cfg
    err = None
    if st.dist.is_main and resumes_without_source(cfg):
        try:
            sha = str(load_prepared(cfg.data.dir).get("source_sha256"))[:12]
            st.say(
                f"resume: data.source={cfg.data.source} no longer exists; continuing on the data prepared "
                f"from it in data.dir={cfg.data.dir} (sha256 {sha}...; the checkpoint's record of them is "
                "checked next)"
            )
        except (OSError, ValueError) as e:
            err = (
                f"data.source={cfg.data.source} no longer exists and data.dir={cfg.data.dir} does not hold "
                f"the complete data prepared from it ({e}); put the corpus back at data.source, or pass "
                "data.source=<where it is now>"
            )
    elif st.dist.is_main:
        try:
            from data.prepare import ensure_prepared

            ensure_prepared(
                effective_data_source(cfg),
                cfg.data.dir,
                **prepare_args(cfg),
                keep_other=True,  # data another launch prepared meanwhile is not replaced
                workers=cfg.data.workers,
            )
        except OSError as e:
            err = f"data (data.source={cfg.data.source}, data.dir={cfg.data.dir}): {e}"
            d = Path(str(cfg.data.dir))  # where the data would be prepared: its mkdir (/proc/x: ENOENT)
            made = isinstance(e, (FileExistsError, NotADirectoryError, FileNotFoundError))  # not a read
            mkdir = made and e.filename is not None and Path(e.filename) in (d, *d.parents)
            if mkdir or e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                # no ~ in it: the shell does not expand one after data.dir= (not a variable name)
                home = Path.home() / "flashgpt-data" / (d.name or "data")
                err = (
                    f"data.dir={cfg.data.dir} cannot be written ({e.strerror}: {e.filename}), and the data "
                    f"is prepared there; pass a folder you can write, e.g. data.dir={home} (data already "
                    "prepared is only read: a read-only data.dir works once it holds the data)"
                )
        except (ValueError, RuntimeError) as e:  # prepare's arguments named as the keys that set them
            err = f"data (data.source={cfg.data.source}, data.dir={cfg.data.dir}): {as_keys(str(e))}"
    err = st.broadcast(err)
    if err:
        raise ConfigError(err)
    st.meta = load_meta(cfg.data.dir)
    st.tokens_digest = tokens_digest(cfg.data.dir, st.meta)
    check_data_fits(cfg, st.meta, st.dist.world_size)
    if cfg.attention.document_mask and st.meta.get("train_docs") == 1:
        st.say(
            f"warning: data.doc_separator={cfg.data.doc_separator!r} does not occur in the training "
            f"split of {cfg.data.dir} (1 document), so attention.document_mask=true changes nothing; "
            "check the separator (Tiny Shakespeare's speeches: data.doc_separator='\\n\\n')"
        )


def load_pretrained(st: RunState) -> None:
    """init_from: GPT-2's config and weights (``st.pretrained``, ``st.init_weights``); ConfigError when they
    cannot be read (offline without them: what to fetch). Not for a resume: its checkpoint holds the weights
    and its saved config the shape (which GPT-2's would override, hiding a shape the command changed)."""
    cfg = st.cfg
    if str(cfg.init_from) == "scratch" or cfg.resume:
        return
    from model.pretrained import load_gpt2

    block_size = int(cfg.model.block_size or cfg.seq_len)  # as gpt_config_for resolves it
    try:
        st.pretrained, st.init_weights = load_gpt2(str(cfg.init_from), block_size=block_size)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def build_model_config(st: RunState) -> None:
    cfg, meta = st.cfg, st.meta
    m = cfg.model
    vocab = int(m.vocab_size) if m.vocab_size is not None else -(-int(meta["vocab_size"]) // 64) * 64
    if vocab < int(meta["vocab_size"]):
        raise ConfigError(
            f"model.vocab_size={vocab} is smaller than the tokenizer's {meta['vocab_size']}; "
            "use model.vocab_size=null (rounds the tokenizer's size up to a multiple of 64)"
        )
    try:  # the config's keys passed resolve_plan; the data's vocab and separator ids are new here
        st.gpt_config = gpt_config_for(cfg, vocab, meta.get("doc_separator_ids"))
    except ValueError as e:
        raise ConfigError(f"data.dir={cfg.data.dir}: {e}") from e
    if st.pretrained is not None:  # GPT-2 weights: their shape wins
        pre = st.pretrained
        if pre.vocab_size < int(meta["vocab_size"]) or cfg.data.tokenizer != "gpt2":
            raise ConfigError(
                f"init_from={cfg.init_from} reads GPT-2 BPE ids (vocab {pre.vocab_size}); the data is "
                f"tokenized with {cfg.data.tokenizer} (vocab {meta['vocab_size']}): use data.tokenizer=gpt2"
            )
        shape = {k: getattr(pre, k) for k in FIXED}
        # a preset's values (model=, experiment=) give way, said; typed ones were refused before (loop.run:
        # check_init_from_overrides)
        theirs = {**shape, "n_kv_head": pre.kv_heads}
        replaced = [k for k in FIXED if differs(k, getattr(cfg.model, k), theirs)]
        if replaced:
            st.say(
                f"note: init_from={cfg.init_from}: the model is the checkpoint's, "
                + " ".join(f"model.{k}={fmt(shape[k])}" for k in replaced)
                + ", not the preset's "
                + " ".join(f"model.{k}={fmt(getattr(cfg.model, k))}" for k in replaced)
                + " (model= / experiment=)"
            )
        st.gpt_config = dataclasses.replace(st.gpt_config, **shape)
        # the run's records (config.resolved.yaml, W&B) say the model it trains
        for key, value in shape.items():
            setattr(cfg.model, key, value)
    probe_attention(cfg, st.plan, st.device, st.gpt_config.n_head)


def load_resume(st: RunState) -> dict | None:
    """resume=true: the newest loadable checkpoint's record, checked against this run's model and
    tokenizer (before anything is built on the GPU); None for a new run."""
    cfg = st.cfg
    if not cfg.resume:
        return None
    path, state = ckpt.load_newest(st.out_dir, warn=st.say) if st.dist.is_main else (None, None)
    path = st.broadcast(str(path) if path else None)
    if path is None:
        raise ConfigError(no_checkpoint_message(st))
    if state is None:
        state = ckpt.load_checkpoint(path)
    notes = check_resume_compatible(
        {
            "model_args": state["model_args"],
            "tokenizer": state["tokenizer"]["name"],
            "vocab_size": state["tokenizer"]["vocab_size"],
            "attention": state.get("attention", ()),
        },
        {
            "model_args": dataclasses.asdict(st.gpt_config),
            "tokenizer": cfg.data.tokenizer,
            "vocab_size": int(st.meta["vocab_size"]),
            "attention": st.attention_id(),
        },
    )
    changed = ckpt.tokenizer_difference(state["tokenizer"], st.meta)
    if changed:  # same name and size, but the ids would mean other tokens (re-mapped data)
        raise ConfigError(tokenizer_change_message(st, state, Path(path), changed))
    if moved := data_difference(state.get("data") or {}, st.meta, st.tokens_digest):
        raise ConfigError(
            f"resume=true refused: the data in data.dir={st.cfg.data.dir} are not the data the checkpoint "
            f"{path} was trained on ({moved}): the corpus changed since, or its data dir was prepared again. "
            f"A resume continues on the run's own data; nothing was changed in {st.out_dir}. Restore the "
            "corpus (or its prepared data dir), or train on the new data in a new run (another out_dir)"
        )
    st.resume_path, st.resume_notes = Path(path), notes
    resume_checks(st, state)
    return state


def build_model(st: RunState, state: dict | None) -> None:
    """Model (compiled; DDP-wrapped or FSDP2-sharded), optimizer, the resumed state, data and eval batches."""
    cfg, plan, d = st.cfg, st.plan, st.dist
    st.fsdp = plan.parallel == "fsdp" and d.enabled
    # FSDP2 keeps the weights each rank built (DDP broadcasts rank 0's): every rank builds rank 0's
    with torch.random.fork_rng(devices=[], enabled=st.fsdp and d.rank != 0):
        if st.fsdp:
            torch.manual_seed(int(cfg.seed))
        st.raw_model = GPT(st.gpt_config).to(st.device)
    if st.init_weights is not None:  # init_from: before DDP/FSDP wrap the model
        try:  # every tensor, none left at its random start (lm_head is tied to wte)
            load_into(st.raw_model, st.init_weights, str(cfg.init_from))
        except ValueError as e:
            raise ConfigError(str(e)) from e
        st.init_weights = None
    if st.fsdp:
        from trainer.dist import shard_model

        shard_model(
            st.raw_model,
            plan.device_type,
            d.world_size,
            bf16=plan.autocast_dtype == "bfloat16" and plan.device_type == "cuda",
            compile_options=compile_options(plan.compile_mode) if plan.compile else None,
        )
    o = cfg.optim
    st.optimizer = st.raw_model.configure_optimizers(
        float(o.weight_decay), float(o.lr), (float(o.beta1), float(o.beta2)), plan.device_type
    )
    if state is not None:
        try:
            ckpt.load_weights(state["path"], st.raw_model, st.optimizer)
        except Exception as e:  # noqa: BLE001 - DCP's errors: missing keys, shapes, I/O
            raise ConfigError(f"resume: the checkpoint {state['path']} does not load: {first_line(e)}") from e
        st.step = int(state["step"])
        st.skipped = int(state.get("skipped_steps", 0))
        st.last_ckpt, st.last_ckpt_step = st.resume_path, st.step
        rngs = state["rng"]
        if len(rngs) != d.world_size:
            st.say(
                f"note: checkpoint has RNG states of {len(rngs)} ranks, this run has {d.world_size}: "
                f"rank r continues rank r mod {len(rngs)}'s streams (dropout differs from an "
                "uninterrupted run; the data do not, they are drawn per global micro-batch)"
            )
        ckpt.set_rng_state(rngs[d.rank % len(rngs)])
    # under FSDP2 the blocks were compiled in place (shard_model)
    compiled = plan.compile and not st.fsdp
    st.fwd_model = compile_model(st.raw_model, plan.compile_mode) if compiled else st.raw_model
    st.cudagraphs = plan.compile and plan.compile_mode == "reduce-overhead"
    if st.cudagraphs:
        # Gradients must live outside the graphs' memory pool: with grad None, autograd would keep the
        # backward graph's output buffer as .grad and the next micro-batch's replay would overwrite it
        # (pytorch/pytorch#96693); zero tensors are added into, and zero_grad keeps them.
        for p in st.raw_model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    if st.fsdp or not d.enabled:
        st.train_model = st.fwd_model
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        st.train_model = DDP(st.fwd_model, device_ids=[d.local_rank] if plan.device_type == "cuda" else None)
    st.train_ds = BinDataset(cfg.data.dir, "train", int(cfg.seq_len))
    val_ds = BinDataset(cfg.data.dir, "val", int(cfg.seq_len))
    st.eval_batches = val_ds.eval_batches(int(cfg.eval.batches), plan.eval_batch_size, int(cfg.seed))
    # MFU against a GPU's peak; a CPU has no table entry, so none unless perf.peak_flops says it
    st.peak_flops = plan.peak_flops or (
        peak_flops_for(torch.cuda.get_device_name(st.device)) if plan.device_type == "cuda" else None
    )
    st.backend_ran = backend_that_ran(st)
    st.kernel_plan = kernel_plan(st)


def start_logging(st: RunState, state: dict | None) -> None:
    """The run has passed its checks: Hydra's files and train.log (``RunState.record``),
    config.resolved.yaml, W&B, the running summary and the start-up lines."""
    cfg, plan, d = st.cfg, st.plan, st.dist
    st.record()
    resolved = dataclasses.asdict(cfg)
    resolved["derived"] = {
        **derived(st),
        "cwd": os.getcwd(),  # what relative paths in this config are relative to
        # the group options (trainer=cpu, ...): a resume changing one undoes the old one's keys
        resume_config.CHOICES_KEY: resume_config.run_choices(st.out_dir, st.overrides, bool(cfg.resume)),
    }
    group = cfg.wandb.group
    if group is None and st.multirun:
        group = st.out_dir.parent.name
    if d.is_main:
        # temp file + rename: a kill mid-write never leaves a truncated record for the next resume
        text = OmegaConf.to_yaml(OmegaConf.create(resolved)).encode()
        atomic_write(st.out_dir / rundir.RESOLVED_CONFIG, lambda f: f.write(text))
    st.log.start_wandb(
        mode=cfg.wandb.mode,
        project=cfg.wandb.project,
        entity=cfg.wandb.entity,
        group=group,
        name=cfg.wandb.name or st.out_dir.name,
        tags=list(cfg.wandb.tags),
        config=resolved,
        run_id=state.get("wandb_run_id") if state is not None else None,
        fork_at=wandb_fork_step(st),
    )
    st.log.set_summary(
        {
            "status": "running",
            "attention": cfg.attention.name,
            "attention/backend_ran": st.backend_ran,
            **({"attention/kernels": st.kernel_plan} if st.kernel_plan else {}),
            "seq_len": int(cfg.seq_len),
            "steps": st.step,
            "max_steps": int(cfg.max_steps),
            "wandb_run_id": st.log.wandb_id,
            "out_dir": str(st.out_dir),
            # who runs it: readers tell a dead "running" run by its lock, else by these
            "pid": os.getpid(),
            "host": socket.gethostname(),
            **derived(st),
        }
    )
    n_params = st.raw_model.num_params()
    mode = f" ({plan.compile_mode})" if plan.compile and plan.compile_mode else ""
    st.say(
        f"flashgpt: {n_params / 1e6:.2f}M params | attention={cfg.attention.name} "
        f"(ran: {st.backend_ran}) | seq_len={cfg.seq_len} | device={st.device} x{d.world_size} | "
        f"dtype={plan.autocast_dtype or 'float32'} | compile={plan.compile}{mode} | "
        f"micro_batch={plan.micro_batch_size} "
        f"x accum {plan.grad_accum} x ranks {d.world_size} = {cfg.batch.tokens_per_step} tokens/step | "
        f"out_dir={st.out_dir}"
    )
    if st.kernel_plan:
        st.say(f"attention/kernels: {st.kernel_plan}")
    for note in plan.notes:
        st.say(note)
    per_token, tokens = st.raw_model.flops_per_token(int(cfg.seq_len)), int(cfg.batch.tokens_per_step)
    if st.device.type == "cpu" and d.is_main and progress.cpu_warning_due(n_params, per_token, tokens):
        flops = progress.matmul_flops(st.device)  # measured only for a run that gets the warning
        max_steps, every = int(cfg.max_steps), int(cfg.eval.interval)
        evals = progress.evals_left(st.step, max_steps, every, bool(cfg.eval.at_start))
        eval_tok = sum(x.numel() for x, _ in st.eval_batches)
        st.say(progress.cpu_warning(n_params, per_token, tokens, max_steps, flops, st.step, evals, eval_tok))
    if cfg.resume:
        st.say(f"resumed from {st.resume_path} at step {st.step}")
        for line in st.resume_intro + st.resume_notes:
            st.say(line)
        replay = replay_record(st)
        lost = st.metrics_lost
        if lost:
            parent = st.log.wandb_parent
            lost = {**lost, "wandb_parent": parent} if parent else lost
            st.log.set_summary({"metrics_lost": lost})
            replay = {**replay, "metrics_lost": lost}
        event = {"event": "resume", "from": str(st.resume_path), "notes": st.resume_notes, **replay}
        st.log.log(st.step, event, wandb_too=False)
        if st.resume_notes:
            st.log.update_config({"resume_notes": st.resume_notes})


def kernel_plan(st: RunState) -> str | None:
    """attention=flash: the forward, backward and decode kernels of this run's shapes (kernels/plan.py)."""
    if st.cfg.attention.name != "flash":
        return None
    from kernels import describe_plan

    g = st.gpt_config
    dtype = torch.bfloat16 if st.plan.autocast_dtype == "bfloat16" else torch.float32
    return describe_plan(
        g.n_embd // g.n_head, int(st.cfg.seq_len), dtype, st.device, bool(st.cfg.deterministic),
        window=g.window, documents=g.document_mask, dropout_p=g.attn_dropout, softcap=g.softcap,
        kv_group=g.n_head // g.kv_heads,
    )  # fmt: skip


def derived(st: RunState) -> dict:
    plan = st.plan
    fused = plan.device_type == "cuda" and fused_loss_on()  # FLASHGPT_FUSED_LOSS
    return {
        "n_params": st.raw_model.num_params(),
        "micro_batch_size": plan.micro_batch_size,
        "grad_accum": plan.grad_accum,
        "world_size": st.dist.world_size,
        "device": str(st.device),
        "dtype": plan.autocast_dtype or "float32",
        "compile": plan.compile,
        "compile_mode": plan.compile_mode or "default",
        "block_size": st.gpt_config.block_size,
        "vocab_size": st.gpt_config.vocab_size,
        "tokens_per_step": int(st.cfg.batch.tokens_per_step),
        "peak_flops": st.peak_flops,
        "loss": "fused" if fused else "cross_entropy",
    }


def backend_that_ran(st: RunState) -> str:
    name = st.cfg.attention.name
    if name != "sdpa":
        return name
    try:
        from model.attention import sdpa_backend_that_ran

        g = st.gpt_config
        dtype = torch.bfloat16 if st.plan.autocast_dtype == "bfloat16" else torch.float32
        shape = (1, g.n_head, int(st.cfg.seq_len), g.n_embd // g.n_head)
        gen = torch.Generator(device=st.device).manual_seed(0)  # leaves the global RNG streams alone
        q = torch.randn(shape, device=st.device, dtype=dtype, generator=gen)
        p = float(st.cfg.model.attn_dropout or 0.0)  # the training calls' dropout steers the choice
        return "sdpa:" + str(sdpa_backend_that_ran(q, q, q, st.cfg.attention.sdpa_backend, p))
    except Exception as e:  # noqa: BLE001 - best effort, for logging only
        return f"sdpa:unknown ({type(e).__name__})"


# ------------------------------------------------------------------------------------------ resume
def no_checkpoint_message(st: RunState) -> str:
    summary = rundir.read_summary(st.out_dir)
    status, last = summary.get("status"), summary.get("last_checkpoint")
    if status not in (None, "error"):  # a run was here and died before its first checkpoint
        found = len(ckpt.list_checkpoints(st.out_dir))
        how = f"its run stopped before the first one (summary status {status!r})"
        if found:  # there, but none loads (load_newest said why)
            how = f"none of its {found} checkpoints loads"
        elif last:  # it wrote some, deleted since (ckpt/ removed to save space)
            how = f"its checkpoints are gone (it wrote up to {Path(last).name}; ckpt/ holds none now)"
        return (
            f"resume=true but {st.out_dir} has no loadable checkpoint: {how}, so there is nothing to "
            f"continue; start it again in a new out_dir (or delete {st.out_dir} if its records are not "
            "needed)"
        )
    if st.multirun:  # a sweep's job: its folder is the sweep's, not one of runs/
        return (
            f"resume=true but this sweep job's folder {st.out_dir} holds no checkpoint: resume a sweep with "
            "its own hydra.sweep.dir and the same values in the same order, or resume=false for a new sweep"
        )
    newest = ckpt.newest_run_with_checkpoints(Path("runs"), skip=rundir.held_by_live_process)  # none live
    hint = f" (newest run with checkpoints: {hydra_arg('out_dir', newest)})" if newest else ""
    if not any(o.lstrip("+").startswith(("out_dir=", "hydra.run.dir=")) for o in st.overrides):
        return (
            f"resume=true needs the run to continue: pass out_dir=<its run directory>{hint}; without it "
            f"the run gets a new folder ({st.out_dir}), which holds nothing to continue"
        )
    return (
        f"resume=true but {st.out_dir}/ckpt has no loadable checkpoint; pass out_dir=<run directory "
        f"of the run to continue>{hint}, or resume=false to start a new run"
    )


def data_difference(saved: dict, meta: dict, digest: str | None = None) -> str | None:
    """What differs between the data a checkpoint recorded (``state["data"]``; older checkpoints have none)
    and a prepared data dir's meta: the corpus's identity (the text's SHA-256, or the files' fingerprint),
    then the split's token counts, then (``digest``: ``data.meta.tokens_digest`` of the data dir) the token
    files themselves."""
    keys = [k for k in ("source_sha256", "train_tokens", "val_tokens") if saved.get(k) is not None]
    diff = [f"{k} {saved[k]} -> {meta.get(k)}" for k in keys if saved[k] != meta.get(k)]
    if not diff and saved.get("tokens_digest") and saved["tokens_digest"] != digest:
        diff = ["the token files (.bin) differ from those it trained on, under the same meta.json"]
    return "; ".join(diff) or None


def tokenizer_change_message(st: RunState, state: dict, path: Path, changed: str) -> str:
    """Which data keys of the run changed, what differs in the tokenizer, and the fix."""
    saved = (state.get("config") or {}).get("data") or {}
    keys = [
        f"data.{k}={getattr(st.cfg.data, k)} (the run's: {saved[k]})"
        for k in ("source", "dir", "tokenizer", "doc_separator")
        if k in saved and str(saved[k]) != str(getattr(st.cfg.data, k))
    ]
    where = (
        ", ".join(keys) or f"data.dir={st.cfg.data.dir}, whose data was prepared again since (its meta.json)"
    )
    back = " ".join(f"data.{k}={saved[k]}" for k in ("source", "dir") if saved.get(k) is not None)
    return (
        f"resume=true refused: the data this command prepared ({where}) has another tokenizer than "
        f"the checkpoint {path} was trained with: {changed}. Its token ids would mean other tokens, so "
        f"the run would go on training on re-mapped data; nothing was changed in {st.out_dir}. Resume "
        f"without those data.* overrides (the run's own data: {back or 'its saved data.*'}), or train "
        "on the new data in a new run (resume=false, another out_dir)"
    )


def resume_checks(st: RunState, state: dict) -> None:
    """Once a checkpoint loads: refuse a run that already reached max_steps (RunFinished: nothing changes),
    unless its final checkpoint was lost (then its steps are replayed)."""
    cfg, k, max_steps = st.cfg, int(state["step"]), int(st.cfg.max_steps)
    summary = rundir.read_summary(st.out_dir) if st.dist.is_main else {}
    done, lost = k, None
    if summary.get("status") == "ok" and isinstance(summary.get("steps"), int):
        done = max(k, summary["steps"])  # finished even when its final checkpoint does not load
        lost = ckpt.lost_after(st.out_dir, k, summary) if done > k else None
    done, lost = st.broadcast((done, lost))
    old_max = (state.get("config") or {}).get("max_steps")
    if done > max_steps:  # a resume never takes steps back
        raise ConfigError(rundir.below_done_message(st.out_dir, done, max_steps, old_max))
    if done == max_steps and lost is not None:
        st.resume_notes.append(
            f"the run finished at step {done}, but its final checkpoint {lost[1]}: rebuilding it by "
            f"replaying steps {k + 1}-{done} from the step-{k} checkpoint with the run's own schedule "
            f"(max_steps={max_steps}); on a deterministic path the rebuilt weights equal the lost ones"
        )
    elif done >= max_steps:  # e.g. killed in its ending, past the last checkpoint: no rewrite
        cmd = " ".join(w for w in resume_command(st).split() if not w.startswith("max_steps="))
        raise rundir.RunFinished(rundir.finished_message(st.out_dir, done, max_steps, cmd))
    if st.dist.is_main:  # under this process's lock: a "running" summary is a dead process's
        killed = rundir.mark_killed_on_resume(st.out_dir)
        if killed:
            st.say(killed)
            summary = rundir.read_summary(st.out_dir)  # the replay reason reads "killed"
    if old_max is not None and int(old_max) != max_steps:
        st.resume_notes.append(rundir.max_steps_note(int(old_max), max_steps, k, cfg.optim, lr_at))
    last = st.log.last_logged_step() if st.dist.is_main else None
    # gone: deleted, or emptied although a step up to k must have been logged (log_interval)
    gone = not st.metrics_existed or k >= int(cfg.log_interval)
    if st.dist.is_main and last is None and k > 0 and gone:
        metrics_lost(st, k, summary)
        return
    if last is None or last <= k:
        logged_every = int((state.get("config") or {}).get("log_interval") or cfg.log_interval)  # then
        if st.dist.is_main and last is not None and last <= k - logged_every:  # cut short
            st.resume_notes.append(
                f"warning: {st.out_dir / 'metrics.jsonl'} ends at step {last}, but the checkpoint is of step "
                f"{k}: the logged curve of steps {last + 1}-{k} is not in it any more (the file was cut?); "
                f"it continues at step {k + 1}, and W&B's history (when on) still holds those steps"
            )
        return
    lost = ckpt.lost_after(st.out_dir, k, summary, all_newer=True)
    why = (
        lost[1]
        if lost
        else (
            f"no checkpoint was saved after step {k}: the run stopped at step {last} "
            f"(status {summary.get('status', 'unknown')}) between checkpoints "
            f"(checkpoint.interval={cfg.checkpoint.interval}, log_interval={cfg.log_interval})"
        )
    )
    moved = st.log.set_apart_after(k)
    if moved:
        st.replay = {
            "from_step": k + 1,
            "to_step": moved["last"],
            "reason": why,
            "abandoned_metrics": moved["path"].name,
            "wandb_steps": moved["wandb_steps"],
        }


def metrics_lost(st: RunState, k: int, summary: dict) -> None:
    """A resume from step ``k`` of a run whose metrics.jsonl is gone or empty: say so, and fork the W&B run
    at step k (its history may run past k; W&B would drop the steps logged below its current one)."""
    ran = summary.get("steps") if isinstance(summary.get("steps"), int) else None
    st.metrics_lost = {"checkpoint_step": k, "summary_steps": ran}
    past = f" (summary.json says the run reached step {ran})" if ran is not None else ""
    st.say(
        f"warning: {st.out_dir / 'metrics.jsonl'} is missing or empty (deleted?), but the run has a "
        f"checkpoint of step {k}{past}: the logged curve of steps 1-{k} is not in this run directory any "
        f"more and metrics.jsonl starts again at step {k + 1}. W&B (when on) continues in a new run "
        f"forked from the old one at step {k}, so its history is never mixed with steps past {k}"
    )


def wandb_fork_step(st: RunState) -> int | None:
    """Where the W&B run is forked: before the replayed steps, or at the checkpoint when metrics.jsonl
    was lost; None to continue the same W&B run."""
    if st.replay and st.replay["wandb_steps"]:
        return st.replay["from_step"] - 1
    return st.metrics_lost["checkpoint_step"] if st.metrics_lost else None


def replay_record(st: RunState) -> dict:
    """Say which steps are replayed and why; record it in the summary and W&B config."""
    r = st.replay
    if not r:
        return {}
    a, b = r["from_step"], r["to_step"]
    parent = st.log.wandb_parent
    wb = (
        f" W&B: run {st.log.wandb_id} forked from {parent['run_id']} at step {parent['step']} "
        f"(the parent keeps steps {a}-{b} of the abandoned branch)."
        if parent
        else ""
    )
    st.say(
        f"replaying steps {a}-{b}: the newest loadable checkpoint is step {a - 1} and {r['reason']}. "
        f"Their earlier records (the abandoned branch) moved to {r['abandoned_metrics']}; metrics.jsonl "
        f"keeps steps up to {a - 1} and continues from step {a}.{wb}"
    )
    info = {"replayed_steps": [a, b], "abandoned_metrics": r["abandoned_metrics"], "reason": r["reason"]}
    if parent:
        info["wandb_parent"] = parent
    st.log.set_summary({"replay": info})
    st.log.update_config({"replay": info})
    return {"replay": info}
