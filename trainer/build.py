"""Set-up of a training run (the ``Setup`` mixin of ``trainer.loop.Trainer``): device, data, model
config, resume checks, model and optimizer, W&B, in ``Setup.setup``; ``gpt_config_for`` builds the
model's ``GPTConfig`` from the config's model keys. Every user error raises ``ConfigError`` before any GPU
allocation."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
from pathlib import Path

import torch
from omegaconf import OmegaConf

from data.prepare import atomic_write
from trainer import checkpoint as ckpt
from trainer import config as C
from trainer import progress, resume_config, rundir
from trainer.checks import (
    ConfigError,
    check_data_fits,
    check_resume_compatible,
    effective_data_source,
    peak_flops_for,
    probe_attention,
)
from trainer.compiling import compile_model
from trainer.schedule import lr_at


def _first(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def newest_run_with_checkpoints(root: Path) -> Path | None:
    """The run directory under ``root`` (``root/<run>/ckpt/step_*``) whose newest checkpoint was written
    last, or None. Checkpoint times, not the run directories': a resume that ends without training (a
    finished run, a refused one) still writes into its run directory and so bumps that one's mtime."""
    newest: tuple[float, Path] | None = None
    for p in root.glob("*/ckpt/step_*"):
        try:
            t = p.stat().st_mtime
        except OSError:  # removed meanwhile (keep=N rotation of a live run)
            continue
        if newest is None or t > newest[0]:
            newest = (t, p.parent.parent)
    return newest[1] if newest else None


def gpt_config_for(cfg, vocab_size: int, doc_separator_ids=None):
    """``model.GPTConfig`` of a run: every ``model.*`` and ``attention.*`` key that is a GPTConfig field, by
    name (``attention.name`` is GPTConfig's ``attention``; issue 16's ``window``, ``document_mask``,
    ``attn_dropout`` flow the same way), the block size (``model.block_size``, null = ``seq_len``),
    ``vocab_size`` and the prepared data's ``doc_separator_ids`` (meta.json).

    Raises:
        ValueError: from GPTConfig's own checks.
    """
    from model import GPTConfig

    names = {f.name for f in dataclasses.fields(GPTConfig)} - {"block_size", "vocab_size", "attention"}
    args = {}
    for group in (cfg.model, cfg.attention):
        keys = [f.name for f in dataclasses.fields(group)] if dataclasses.is_dataclass(group) else list(group)
        args.update({k: getattr(group, k) for k in keys if k in names})
    m = cfg.model
    return GPTConfig(
        **args,
        block_size=m.block_size if m.block_size is not None else cfg.seq_len,
        vocab_size=vocab_size,
        attention=cfg.attention.name,
        doc_separator_ids=doc_separator_ids,
    )


class Setup:
    """``setup()`` and what it needs; mixed into ``trainer.loop.Trainer`` (which holds the state)."""

    def setup(self) -> None:
        """Device, data, model config, resume checks, model and optimizer, logging, in that order. Raises
        ConfigError for user errors (before GPU allocation) and ``rundir.RunFinished``."""
        self._setup_device()
        self._check_something_to_resume()
        self._prepare_data()
        self._build_model_config()
        state = self._load_resume()
        self._build_model(state)
        self._start_logging(state)

    def _setup_device(self) -> None:
        """Device, TF32, determinism, the seed of this rank and the autocast context."""
        cfg, plan, d = self.cfg, self.plan, self.dist
        if plan.device_type == "cuda":
            self.device = torch.device("cuda", d.local_rank)
            torch.cuda.set_device(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)  # a previous multirun job's peak is not ours
            tf32 = bool(cfg.tf32)  # false: float32 runs use full-precision matmuls
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.backends.cudnn.allow_tf32 = tf32
        else:
            self.device = torch.device("cpu")
        if cfg.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        torch.manual_seed(int(cfg.seed) + d.rank)
        self.autocast = (
            torch.autocast(device_type=plan.device_type, dtype=torch.bfloat16)
            if plan.autocast_dtype == "bfloat16"
            else contextlib.nullcontext()
        )

    def _prepare_data(self) -> None:
        """Rank 0 prepares the data (the others wait and get its error, if any); the corpus must fit."""
        cfg, d = self.cfg, self.dist
        err = None
        if d.is_main:
            try:
                from data.prepare import ensure_prepared

                ensure_prepared(
                    effective_data_source(cfg),
                    cfg.data.dir,
                    cfg.data.tokenizer,
                    float(cfg.data.val_fraction),
                    cfg.data.doc_separator,
                    keep_other=True,  # data another launch prepared meanwhile is not replaced
                    text_field=cfg.data.text_field,
                    max_tokens=cfg.data.max_tokens,
                    workers=cfg.data.workers,
                )
            except (OSError, ValueError, RuntimeError) as e:
                err = f"data (data.source={cfg.data.source}, data.dir={cfg.data.dir}): {e}"
        err = self._broadcast(err)
        if err:
            raise ConfigError(err)
        from data.loader import load_meta

        self.meta = load_meta(cfg.data.dir)
        check_data_fits(cfg, self.meta, d.world_size)
        if cfg.attention.document_mask and self.meta.get("train_docs") == 1:
            # a separator that never occurs: one document, so the mask is plain causal attention
            self.say(
                f"warning: data.doc_separator={cfg.data.doc_separator!r} does not occur in the training "
                f"split of {cfg.data.dir} (1 document), so attention.document_mask=true changes nothing; "
                "check the separator (Tiny Shakespeare's speeches: data.doc_separator='\\n\\n')"
            )

    def _build_model_config(self) -> None:
        """``self.gpt_config`` from the model keys and the tokenizer's vocab; the attention probe."""
        cfg, plan, meta = self.cfg, self.plan, self.meta
        m = cfg.model
        vocab = int(m.vocab_size) if m.vocab_size is not None else -(-int(meta["vocab_size"]) // 64) * 64
        if vocab < int(meta["vocab_size"]):
            raise ConfigError(
                f"model.vocab_size={vocab} is smaller than the tokenizer's {meta['vocab_size']}; "
                "use model.vocab_size=null (rounds the tokenizer's size up to a multiple of 64)"
            )
        try:
            self.gpt_config = gpt_config_for(cfg, vocab, meta.get("doc_separator_ids"))
        except ValueError as e:
            raise ConfigError(f"model: {e}") from e
        self._init_weights = None
        if str(getattr(cfg, "init_from", "scratch")) != "scratch":  # GPT-2 weights: their shape wins
            from model.pretrained import load_gpt2

            try:
                pre, self._init_weights = load_gpt2(str(cfg.init_from), block_size=self.gpt_config.block_size)
            except ValueError as e:
                raise ConfigError(str(e)) from e
            if pre.vocab_size < int(meta["vocab_size"]) or cfg.data.tokenizer != "gpt2":
                raise ConfigError(
                    f"init_from={cfg.init_from} reads GPT-2 BPE ids (vocab {pre.vocab_size}); the data is "
                    f"tokenized with {cfg.data.tokenizer} (vocab {meta['vocab_size']}): use "
                    "data.tokenizer=gpt2"
                )
            shape = {k: getattr(pre, k) for k in ("n_layer", "n_head", "n_embd", "vocab_size", "bias")}
            self.gpt_config = dataclasses.replace(self.gpt_config, **shape)
        probe_attention(cfg, plan, self.device, self.gpt_config.n_head)

    def _check_something_to_resume(self) -> None:
        """resume=true on a directory without a single checkpoint (a mistyped out_dir, a run that died
        before its first one): the no-checkpoint error now, before data preparation, which would
        otherwise prepare (download) the defaults' data for a run that cannot start."""
        if not self.cfg.resume:
            return
        none = not ckpt.list_checkpoints(self.out_dir) if self.dist.is_main else None
        if self._broadcast(none):
            raise ConfigError(self._no_checkpoint_message())

    def _load_resume(self) -> dict | None:
        """resume=true: the newest loadable checkpoint, checked against this run's model and tokenizer
        (before anything is built on the GPU); None for a new run."""
        cfg, d, meta = self.cfg, self.dist, self.meta
        state = None
        if cfg.resume:
            path = None
            if d.is_main:
                path, state = ckpt.load_newest(self.out_dir, map_location="cpu", warn=self.say)
            path = self._broadcast(str(path) if path else None)
            if path is None:
                raise ConfigError(self._no_checkpoint_message())
            if state is None:
                state = ckpt.load_checkpoint(path, map_location="cpu")
            notes = check_resume_compatible(
                {
                    "model_args": state["model_args"],
                    "tokenizer": state["tokenizer"]["name"],
                    "vocab_size": state["tokenizer"]["vocab_size"],
                    "attention": state.get("attention", ()),
                },
                {
                    "model_args": dataclasses.asdict(self.gpt_config),
                    "tokenizer": cfg.data.tokenizer,
                    "vocab_size": int(meta["vocab_size"]),
                    "attention": self._attention_id(),
                },
            )  # another tokenizer name or vocab size: refused there, with the model shape that follows
            changed = ckpt.tokenizer_difference(state["tokenizer"], meta)
            if changed:  # same name and size, but the ids would mean other tokens (re-mapped data)
                raise ConfigError(self._tokenizer_change_message(state, Path(path), changed))
            self.resume_path, self.resume_notes = Path(path), notes
            self._resume_checks(state)
        return state

    def _build_model(self, state: dict | None) -> None:
        """Model (compiled; DDP-wrapped or FSDP2-sharded), optimizer and the resumed state; datasets and
        fixed eval batches.

        ``parallel=fsdp`` with several ranks: the blocks are compiled one by one (when compile is on) and
        sharded (``trainer.dist.shard_model``), then the optimizer is built on the sharded parameters. A
        resume loads a DCP checkpoint with ``checkpoint.load_dcp_into`` (any world size, sharded or plain
        model) and a single-file checkpoint into the plain model before it is sharded (its optimizer state
        by parameter name, then sharded by ``set_optimizer_state_dict``)."""
        from data.loader import BinDataset
        from model import GPT

        cfg, plan, d = self.cfg, self.plan, self.dist
        self.fsdp = plan.parallel == "fsdp" and d.enabled
        if self.fsdp and d.rank != 0:
            # FSDP2 keeps each rank's shard of the weights that rank built (DDP broadcasts rank 0's), so
            # every rank builds rank 0's initial weights: the seed of rank 0, in a forked RNG stream
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(int(cfg.seed))
                self.raw_model = GPT(self.gpt_config).to(self.device)
        else:
            self.raw_model = GPT(self.gpt_config).to(self.device)
        if getattr(self, "_init_weights", None) is not None:  # init_from: before DDP/FSDP wrap the model
            self.raw_model.load_state_dict(self._init_weights, strict=False)
            self._init_weights = None
        o = cfg.optim

        def make_optimizer():
            return self.raw_model.configure_optimizers(
                float(o.weight_decay), float(o.lr), (float(o.beta1), float(o.beta2)), plan.device_type
            )

        dcp_path = state.get("dcp") if state is not None else None
        full_optim = None
        if state is not None and dcp_path is None:
            self.raw_model.load_state_dict(state["model"])
            if self.fsdp:  # a single-file checkpoint into a sharded run: optimizer state by parameter name
                from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

                plain = make_optimizer()
                plain.load_state_dict(state["optimizer"])
                full_optim = get_optimizer_state_dict(self.raw_model, plain)
                del plain
        if self.fsdp:
            from trainer.compiling import compile_options
            from trainer.dist import shard_model

            shard_model(
                self.raw_model,
                plan.device_type,
                d.world_size,
                bf16=plan.autocast_dtype == "bfloat16" and plan.device_type == "cuda",
                compile_options=compile_options(plan.compile_mode) if plan.compile else None,
            )
        self.optimizer = make_optimizer()
        if state is not None:
            if dcp_path is not None:
                try:
                    ckpt.load_dcp_into(dcp_path, self.raw_model, self.optimizer)
                except Exception as e:  # noqa: BLE001 - DCP's errors: missing keys, shapes, I/O
                    raise ConfigError(
                        f"resume: the DCP checkpoint {dcp_path} does not load: {_first(e)}"
                    ) from e
            elif full_optim is not None:
                from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

                set_optimizer_state_dict(
                    self.raw_model, self.optimizer, full_optim, options=StateDictOptions(full_state_dict=True)
                )
                del full_optim
            else:
                self.optimizer.load_state_dict(state["optimizer"])
            self.step = int(state["step"])
            self.skipped = int(state.get("skipped_steps", 0))
            self.last_ckpt, self.last_ckpt_step = self.resume_path, self.step
            rngs = state["rng"]
            if len(rngs) != d.world_size:
                self.say(
                    f"note: checkpoint has RNG states of {len(rngs)} ranks, this run has {d.world_size}: "
                    f"rank r continues rank r mod {len(rngs)}'s streams (dropout differs from an "
                    "uninterrupted run; the data do not, they are drawn per global micro-batch)"
                )
            ckpt.set_rng_state(rngs[d.rank % len(rngs)])
        if self.fsdp:
            self.fwd_model = self.raw_model  # its blocks are compiled in place (shard_model)
        else:
            compiled = plan.compile
            self.fwd_model = compile_model(self.raw_model, plan.compile_mode) if compiled else self.raw_model
        # CUDA graphs (compile_mode=reduce-overhead): each forward starts a new graph step, so outputs of
        # the previous replay (the last micro-batch's loss) are never overwritten while still in use
        self._cudagraphs = plan.compile and plan.compile_mode == "reduce-overhead"
        if self._cudagraphs:
            # Gradients must live outside the graphs' memory pool: with grad None, autograd would keep the
            # backward graph's output buffer as .grad and the next micro-batch's replay would overwrite it
            # (gradient accumulation silently wrong; pytorch/pytorch#96693). With zero tensors in place it
            # adds into them instead, and zero_grad keeps them (set_to_none=False).
            for p in self.raw_model.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
        if self.fsdp:
            self.train_model = self.raw_model
        elif d.enabled:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.train_model = DDP(
                self.fwd_model, device_ids=[d.local_rank] if plan.device_type == "cuda" else None
            )
        else:
            self.train_model = self.fwd_model

        self.train_ds = BinDataset(cfg.data.dir, "train", int(cfg.seq_len))
        self.val_ds = BinDataset(cfg.data.dir, "val", int(cfg.seq_len))
        self.eval_batches = self.val_ds.eval_batches(
            int(cfg.eval.batches), plan.eval_batch_size, int(cfg.seed)
        )
        self.peak_flops = plan.peak_flops or peak_flops_for(
            torch.cuda.get_device_name(self.device) if plan.device_type == "cuda" else None
        )
        self.backend_ran = self._backend_that_ran()
        self.kernel_plan = self._kernel_plan()  # attention=flash: which kernels run (kernels/plan.py)

    def _start_logging(self, state: dict | None) -> None:
        """config.resolved.yaml, W&B, the running summary and the start-up lines."""
        cfg, plan, d = self.cfg, self.plan, self.dist
        wandb_id = state.get("wandb_run_id") if state is not None else None
        resolved = C.to_dict(cfg)
        resolved["derived"] = self._derived()
        resolved["derived"]["cwd"] = os.getcwd()  # what relative paths in this config are relative to
        # the group options (trainer=cpu, model=tiny, ...): a resume changing one undoes the old one's keys
        resolved["derived"][resume_config.CHOICES_KEY] = resume_config.run_choices(
            self.out_dir, self.overrides, bool(cfg.resume)
        )
        group = cfg.wandb.group
        if group is None and self.multirun:
            group = self.out_dir.parent.name
        if d.is_main:
            # temp file + rename: a kill mid-write never leaves a truncated record for the next resume
            text = OmegaConf.to_yaml(OmegaConf.create(resolved)).encode()
            atomic_write(self.out_dir / rundir.RESOLVED_CONFIG, lambda f: f.write(text))
        self.log.start_wandb(
            mode=cfg.wandb.mode,
            project=cfg.wandb.project,
            entity=cfg.wandb.entity,
            group=group,
            name=cfg.wandb.name or self.out_dir.name,
            tags=list(cfg.wandb.tags),
            config=resolved,
            run_id=wandb_id,
            fork_at=self._wandb_fork_step(),
        )
        self.log.set_summary(
            {
                "status": "running",
                "attention": cfg.attention.name,
                "attention/backend_ran": self.backend_ran,
                **({"attention/kernels": self.kernel_plan} if self.kernel_plan else {}),
                "seq_len": int(cfg.seq_len),
                "steps": self.step,
                "max_steps": int(cfg.max_steps),
                "wandb_run_id": self.log.wandb_id,
                "out_dir": str(self.out_dir),
                # who runs it: readers tell a dead "running" run by its lock, else by these
                "pid": os.getpid(),
                "host": socket.gethostname(),
                **self._derived(),
            }
        )
        d_ = self._derived()
        mode = f" ({plan.compile_mode})" if plan.compile and plan.compile_mode else ""
        self.say(
            f"flashgpt: {d_['n_params'] / 1e6:.2f}M params | attention={cfg.attention.name} "
            f"(ran: {self.backend_ran}) | seq_len={cfg.seq_len} | device={self.device} x{d.world_size} | "
            f"dtype={plan.autocast_dtype or 'float32'} | "
            f"compile={plan.compile}{mode} | "
            f"micro_batch={plan.micro_batch_size} "
            f"x accum {plan.grad_accum} x ranks {d.world_size} = {cfg.batch.tokens_per_step} tokens/step | "
            f"out_dir={self.out_dir}"
        )
        if self.kernel_plan:
            self.say(f"attention/kernels: {self.kernel_plan}")
        for note in plan.notes:
            self.say(note)
        if self.device.type == "cpu" and d.is_main and d_["n_params"] >= progress.CPU_WARN_PARAMS:
            per_token = self.raw_model.flops_per_token(int(cfg.seq_len))
            self.say(
                progress.cpu_warning(
                    d_["n_params"],
                    per_token,
                    int(cfg.batch.tokens_per_step),
                    int(cfg.max_steps) - self.step,
                    progress.matmul_flops(self.device),
                )
            )
        if cfg.resume:
            self.say(f"resumed from {self.resume_path} at step {self.step}")
            for line in self.resume_intro:
                self.say(line)
            for note in self.resume_notes:
                self.say(note)
            replay = self._replay_record()
            lost = self.metrics_lost
            if lost:
                parent = self.log.wandb_parent
                lost = {**lost, "wandb_parent": parent} if parent else lost
                self.log.set_summary({"metrics_lost": lost})
                replay = {**replay, "metrics_lost": lost}
            self.log.log(
                self.step,
                {"event": "resume", "from": str(self.resume_path), "notes": self.resume_notes, **replay},
                wandb_too=False,
            )
            if self.resume_notes:
                self.log.update_config({"resume_notes": self.resume_notes})

    def _kernel_plan(self) -> str | None:
        """attention=flash: one line naming the forward, backward and decode kernels of this run's shapes
        (``kernels.describe_plan``); None for the other backends."""
        if self.cfg.attention.name != "flash":
            return None
        from kernels import describe_plan

        g = self.gpt_config
        dtype = torch.bfloat16 if self.plan.autocast_dtype == "bfloat16" else torch.float32
        return describe_plan(
            g.n_embd // g.n_head, int(self.cfg.seq_len), dtype, self.device, bool(self.cfg.deterministic),
            window=g.window, documents=g.document_mask, dropout_p=g.attn_dropout,
        )  # fmt: skip

    def _attention_id(self) -> list[str]:
        return [self.cfg.attention.name, self.cfg.attention.sdpa_backend]

    def _derived(self) -> dict:
        return {
            "n_params": self.raw_model.num_params() if hasattr(self, "raw_model") else 0,
            "micro_batch_size": self.plan.micro_batch_size,
            "grad_accum": self.plan.grad_accum,
            "world_size": self.dist.world_size,
            "device": str(self.device),
            "dtype": self.plan.autocast_dtype or "float32",
            "compile": self.plan.compile,
            "compile_mode": self.plan.compile_mode or "default",
            "block_size": self.gpt_config.block_size,
            "vocab_size": self.gpt_config.vocab_size,
            "tokens_per_step": int(self.cfg.batch.tokens_per_step),
            "peak_flops": getattr(self, "peak_flops", None),
        }

    def _no_checkpoint_message(self) -> str:
        newest = newest_run_with_checkpoints(Path("runs"))
        status = rundir.read_summary(self.out_dir).get("status")
        if status not in (None, "error"):  # a run was here and died before its first checkpoint
            return (
                f"resume=true but {self.out_dir} has no loadable checkpoint: its run stopped before the "
                f"first one (summary status {status!r}), so there is nothing to continue; start it again "
                f"in a new out_dir (or delete {self.out_dir} if its records are not needed)"
            )
        hint = f" (newest run with checkpoints: out_dir={newest})" if newest else ""
        return (
            f"resume=true but {self.out_dir}/ckpt has no loadable checkpoint; pass out_dir=<run directory "
            f"of the run to continue>{hint}, or resume=false to start a new run"
        )

    def _tokenizer_change_message(self, state: dict, path: Path, changed: str) -> str:
        """resume=true onto data whose tokenizer differs from the checkpoint's: which data keys of the run
        changed (data.source, data.dir, ...), what differs, and the fix."""
        saved = (state.get("config") or {}).get("data") or {}
        keys = []
        for key in ("source", "dir", "tokenizer", "doc_separator"):
            old, new = saved.get(key), getattr(self.cfg.data, key)
            if key in saved and str(old) != str(new):
                keys.append(f"data.{key}={new} (the run's: {old})")
        where = (
            ", ".join(keys)
            if keys
            else f"data.dir={self.cfg.data.dir}, whose data was prepared again since (its meta.json)"
        )
        back = " ".join(f"data.{k}={saved[k]}" for k in ("source", "dir") if saved.get(k) is not None)
        return (
            f"resume=true refused: the data this command prepared ({where}) has another tokenizer than "
            f"the checkpoint {path} was trained with: {changed}. Its token ids would mean other tokens, so "
            f"the run would go on training on re-mapped data; nothing was changed in {self.out_dir}. Resume "
            f"without those data.* overrides (the run's own data: {back or 'its saved data.*'}), or train "
            "on the new data in a new run (resume=false, another out_dir)"
        )

    def _resume_checks(self, state: dict) -> None:
        """resume=true, once a checkpoint loads: refuse a run that already reached max_steps (RunFinished:
        nothing changes, a summary left "running" by a process killed in its ending included). Else a
        summary left "running" by a killed process is rewritten to "killed"
        (``rundir.mark_killed_on_resume``), then, before anything else is written: note a changed
        max_steps (it changes the LR schedule), and set apart the records of the logged steps after the
        checkpoint, which this resume replays."""
        cfg, k, max_steps = self.cfg, int(state["step"]), int(self.cfg.max_steps)
        summary = rundir.read_summary(self.out_dir) if self.dist.is_main else {}
        done, lost = k, None
        if summary.get("status") == "ok" and isinstance(summary.get("steps"), int):
            done = max(k, summary["steps"])  # finished even when its final checkpoint does not load
            lost = self._lost_checkpoint(k, summary) if done > k else None
        done, lost = self._broadcast((done, lost))
        old_max = (state.get("config") or {}).get("max_steps")
        if done > max_steps:  # a resume never takes steps back
            raise ConfigError(rundir.below_done_message(self.out_dir, done, max_steps, old_max))
        if done == max_steps and lost is not None:
            # finished, but its final weights are gone: replay from step k to rebuild them (same schedule)
            self.resume_notes.append(
                f"the run finished at step {done}, but its final checkpoint {lost}: rebuilding it by "
                f"replaying steps {k + 1}-{done} from the step-{k} checkpoint with the run's own schedule "
                f"(max_steps={max_steps}); on a deterministic path the rebuilt weights equal the lost ones"
            )
        elif done >= max_steps:  # refused (e.g. killed in its ending, past the last checkpoint): no rewrite
            cmd = " ".join(w for w in self.resume_command().split() if not w.startswith("max_steps="))
            raise rundir.RunFinished(rundir.finished_message(self.out_dir, done, max_steps, cmd))
        if self.dist.is_main:  # under this process's lock: a "running" summary is a dead process's
            killed = rundir.mark_killed_on_resume(self.out_dir)
            if killed:
                self.say(killed)
                summary = rundir.read_summary(self.out_dir)  # the replay reason reads "killed"
        if old_max is not None and int(old_max) != max_steps:
            self.resume_notes.append(rundir.max_steps_note(int(old_max), max_steps, k, cfg.optim, lr_at))
        last = self.log.last_logged_step() if self.dist.is_main else None
        # gone: deleted, or emptied although a step up to k must have been logged (log_interval)
        gone = not self.metrics_existed or k >= int(cfg.log_interval)
        if self.dist.is_main and last is None and k > 0 and gone:
            self._metrics_lost(k, summary)
            return
        if last is None or last <= k:
            return
        why = self._replay_reason(k, last, summary)
        moved = self.log.set_apart_after(k)
        if moved:
            self.replay = {
                "from_step": k + 1,
                "to_step": moved["last"],
                "reason": why,
                "abandoned_metrics": moved["path"].name,
                "wandb_steps": moved["wandb_steps"],
            }

    def _lost_checkpoint(self, k: int, summary: dict) -> str | None:
        """How a finished run's checkpoint newer than the loadable step ``k`` was lost ("step_N.pt does not
        load", "step_N.pt is missing (deleted)"), or None when none newer was ever written (e.g.
        ``checkpoint.at_end=false``: nothing was lost, the run stays finished)."""
        newer = [p for s, p in ckpt.list_checkpoints(self.out_dir) if s > k]
        if newer:
            return f"{newer[0].name} does not load"
        lc = str(summary.get("last_checkpoint") or "")
        lc_step = ckpt.checkpoint_step(lc) if lc else None
        if lc_step is not None and lc_step > k:
            return f"{Path(lc).name} is missing (deleted)"
        return None

    def _metrics_lost(self, k: int, summary: dict) -> None:
        """resume=true from step ``k`` of a run whose metrics.jsonl is gone or empty: say so (the curve up
        to step k is not in the run directory any more, the new file starts at step k + 1), and fork the
        W&B run at step k (``self.metrics_lost``): its history may run past k, and W&B would drop the
        steps logged below its current one, mixing two branches in one curve."""
        ran = summary.get("steps") if isinstance(summary.get("steps"), int) else None
        self.metrics_lost = {"checkpoint_step": k, "summary_steps": ran}
        past = f" (summary.json says the run reached step {ran})" if ran is not None else ""
        self.say(
            f"warning: {self.out_dir / 'metrics.jsonl'} is missing or empty (deleted?), but the run has a "
            f"checkpoint of step {k}{past}: the logged curve of steps 1-{k} is not in this run directory any "
            f"more and metrics.jsonl starts again at step {k + 1}. W&B (when on) continues in a new run "
            f"forked from the old one at step {k}, so its history is never mixed with steps past {k}"
        )

    def _wandb_fork_step(self) -> int | None:
        """The step at which the W&B run is forked: before the replayed steps, or at the checkpoint when
        metrics.jsonl was lost; None to continue the same W&B run."""
        if self.replay and self.replay["wandb_steps"]:
            return self.replay["from_step"] - 1
        return self.metrics_lost["checkpoint_step"] if self.metrics_lost else None

    def _replay_reason(self, k: int, last: int, summary: dict) -> str:
        """Why the newest loadable checkpoint (step k) is behind the last logged step."""
        newer = [(s, p) for s, p in ckpt.list_checkpoints(self.out_dir) if s > k]
        if newer:
            names = ", ".join(p.name for _, p in newer)
            return f"the newer checkpoint(s) {names} do not load"
        lc = str(summary.get("last_checkpoint") or "")
        lc_step = ckpt.checkpoint_step(lc) if lc else None
        if lc_step is not None and lc_step > k:
            return f"the newest checkpoint {lc} is missing (deleted)"
        return (
            f"no checkpoint was saved after step {k}: the run stopped at step {last} "
            f"(status {summary.get('status', 'unknown')}) between checkpoints "
            f"(checkpoint.interval={self.cfg.checkpoint.interval}, log_interval={self.cfg.log_interval})"
        )

    def _replay_record(self) -> dict:
        """Say which steps are replayed and why; record it in the summary and W&B config. Returns the
        fields for the resume event line of metrics.jsonl ({} when nothing is replayed)."""
        r = self.replay
        if not r:
            return {}
        a, b = r["from_step"], r["to_step"]
        parent = self.log.wandb_parent
        wb = (
            f" W&B: run {self.log.wandb_id} forked from {parent['run_id']} at step {parent['step']} "
            f"(the parent keeps steps {a}-{b} of the abandoned branch)."
            if parent
            else ""
        )
        self.say(
            f"replaying steps {a}-{b}: the newest loadable checkpoint is step {a - 1} and {r['reason']}. "
            f"Their earlier records (the abandoned branch) moved to {r['abandoned_metrics']}; metrics.jsonl "
            f"keeps steps up to {a - 1} and continues from step {a}.{wb}"
        )
        info = {"replayed_steps": [a, b], "abandoned_metrics": r["abandoned_metrics"], "reason": r["reason"]}
        if parent:
            info["wandb_parent"] = parent
        self.log.set_summary({"replay": info})
        self.log.update_config({"replay": info})
        return {"replay": info}

    def _backend_that_ran(self) -> str:
        name = self.cfg.attention.name
        if name != "sdpa":
            return name
        try:
            from model.attention import sdpa_backend_that_ran

            dtype = torch.bfloat16 if self.plan.autocast_dtype == "bfloat16" else torch.float32
            shape = (
                1,
                self.gpt_config.n_head,
                int(self.cfg.seq_len),
                self.gpt_config.n_embd // self.gpt_config.n_head,
            )
            gen = torch.Generator(device=self.device).manual_seed(0)  # leaves the global RNG streams alone
            q = torch.randn(shape, device=self.device, dtype=dtype, generator=gen)
            p = float(self.cfg.model.attn_dropout or 0.0)  # the training calls' dropout steers the choice
            return "sdpa:" + str(sdpa_backend_that_ran(q, q, q, self.cfg.attention.sdpa_backend, p))
        except Exception as e:  # noqa: BLE001 - best effort, for logging only
            return f"sdpa:unknown ({type(e).__name__})"
