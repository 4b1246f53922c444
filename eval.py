"""Loss and perplexity of a run's checkpoint on its data (Hydra entry point; config ``configs/eval.yaml``).

    python eval.py run=runs/<run>                          # newest checkpoint, the run's val split
    python eval.py run=runs/<run> data.split=train attention=naive batches=50
    python eval.py ckpt=runs/<run>/ckpt/step_00000300 dtype=float32
    python eval.py init_from=gpt2 data.dir=data/web seq_len=1024   # released weights on GPT-2 BPE data

The batches are ``BinDataset.eval_batches(batches, batch_size, seed)`` of the run's data directory: with
the defaults (the run's eval.batches, evaluation batch size, seq_len and seed) they are the batches of the
run's own ``val/loss``, so the number printed for its last checkpoint matches its last logged val loss
(same backend and dtype). A relative ``data.dir`` of the run means what it meant where the run started
(``derived.cwd`` of its config.resolved.yaml, as for ``resume=true``); a ``data.dir=`` given to eval.py is
relative to the current directory. The run's training records (metrics.jsonl, summary.json, checkpoints,
config.resolved.yaml) are never written; the result goes to the console and to
``<run>/evals/<time>_<ckpt>_<split>_<backend>.json`` (``out=PATH``: there; ``write=false``: console
only); where that cannot be written (a read-only run directory) a note says so and the exit status stays
0. A ``batch_size`` or ``batches`` asking for more tokens than the split holds is cut to what covers it
once (a note says so).

Exit status: 0 ok; 2 for a user error (``error: ...``), nothing written: no run or checkpoint, ``run=``
with a ``ckpt=`` of another run, no data directory, a run's data directory that no longer holds the data it
trained on (a changed corpus, prepared again: what ``resume=true`` refuses; a ``data.dir=`` given here is
evaluated on purpose, its tokenizer checked only), a config error (a misspelt key, ``+typo=1``, a wrong type:
``config error: ...``). Prefixes as train.py's: the kind, no script name.
Keys: ``trainer/infer_config.py`` ``EvalConfig``.
"""

from __future__ import annotations

import json
import math
import sys
import time

import hydra
from omegaconf import DictConfig

from trainer.fields import report_config_errors
from trainer.infer import InferError
from trainer.infer_config import EvalConfig, run_job


def _pick(value, run_value, key: str, low: int = 1) -> int:
    v = run_value if value is None else value
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise InferError(f"{key} must be an int >= {low}, got {v!r}")
    return v


def _cap_to_split(
    tokens: int, split: str, seq_len: int, batch_size: int, batches: int, run_bs, run_batches
) -> tuple[int, int, list[str]]:
    """(batch_size, batches, notes): a request larger than the split is cut to what covers it once.

    The windows are drawn at random, so more tokens than the split holds only repeat it, at the cost of
    memory (every batch is built up front; one batch's logits grow with batch_size) and time. The run's
    own batch size and batch count (``run_bs``, ``run_batches``; None where this command changed the
    batch shape) are never cut: with the defaults the loss stays the run's val/loss.
    """
    notes = []
    most_bs = max(1, tokens // seq_len)  # one batch of the whole split
    if batch_size > max(most_bs, int(run_bs or 1)):
        notes.append(
            f"batch_size={batch_size} x seq_len={seq_len} is more than the {split} split's {tokens:,} "
            f"tokens: using batch_size={most_bs} (the whole split in one batch)"
        )
        batch_size = most_bs
    most = max(1, -(-tokens // (batch_size * seq_len)))  # batches that cover the split about once
    if batches > max(most, int(run_batches or 1)):
        notes.append(
            f"batches={batches} x batch_size={batch_size} x seq_len={seq_len} = "
            f"{batches * batch_size * seq_len:,} tokens is more than the {split} split's {tokens:,} (random "
            f"windows would only repeat it): using batches={most}, about the whole split once"
        )
        batches = most
    return batch_size, batches, notes


def check_same_data(state: dict, data_dir: str, meta: dict) -> None:
    """InferError when ``data_dir`` no longer holds the data the checkpoint recorded (``state["data"]``):
    a changed corpus, or the data dir prepared again; the comparison of resume=true."""
    from data.meta import tokens_digest
    from trainer.setup import data_difference

    saved = state.get("data") or {}
    digest = tokens_digest(data_dir, meta) if saved.get("tokens_digest") else None
    if moved := data_difference(saved, meta, digest):
        raise InferError(
            f"the data in {data_dir} are not the data {state['path']} was trained on ({moved}): the corpus "
            f"changed since, or its data dir was prepared again, so the loss would not be the run's. Restore "
            f"the run's data, or pass data.dir={data_dir} to evaluate on these data on purpose"
        )


def _eval(cfg: DictConfig) -> None:
    """Evaluate for ``cfg`` (``EvalConfig``, configs/eval.yaml); a user error raises ``InferError``."""
    import torch

    from data.loader import BinDataset
    from trainer.checkpoint import tokenizer_difference
    from trainer.infer import (
        build_model,
        checkpoint_of,
        resolve_device,
        resolve_dtype,
        run_data_dir,
        write_results,
    )
    from trainer.resume_config import anchored, run_cwd

    split = str(cfg.data.split)  # val | train (check_config)
    device = resolve_device(str(cfg.device))
    dtype = resolve_dtype(str(cfg.dtype), device)
    path, state, run_dir = checkpoint_of(cfg)  # init_from: no run, nothing is written without out=
    rc = state.get("config") or {}
    run_eval, run_batch = rc.get("eval") or {}, rc.get("batch") or {}
    block = int(state["model_args"]["block_size"])
    seq_len = _pick(cfg.seq_len, rc.get("seq_len", block), "seq_len")
    if seq_len > block:
        raise InferError(
            f"seq_len={seq_len} exceeds the model's block size {block}; use seq_len={block} or less"
        )
    # the trainer's evaluation batch: eval.batch_size, else the micro-batch (set or from micro_tokens)
    budget = min(
        int(run_batch.get("micro_tokens") or seq_len), int(run_batch.get("tokens_per_step") or seq_len)
    )
    run_bs = run_eval.get("batch_size") or run_batch.get("micro_batch_size") or max(1, budget // seq_len)
    batch_size = _pick(cfg.batch_size, run_bs, "batch_size")
    batches = _pick(cfg.batches, run_eval.get("batches", 20), "batches")
    seed = _pick(cfg.seed, rc.get("seed", 1337), "seed", low=0)
    # a data.dir given here is relative to this directory, the run's own to the one it started in
    data_dir = cfg.data.dir or run_data_dir(state, run_dir)
    if not data_dir:
        raise InferError("the checkpoint's config names no data.dir; pass data.dir=PATH (GPT-2 BPE data)")
    try:
        # the prepare command of an error: the run's own corpus, where its own data dir is read
        source = None if cfg.data.dir else (rc.get("data") or {}).get("source")
        corpus = (anchored(str(source), run_cwd(run_dir)) if source else "CORPUS", state["tokenizer"]["name"])
        ds = BinDataset(data_dir, split, seq_len, corpus=corpus)
    except (OSError, ValueError) as e:
        raise InferError(f"data.dir={data_dir} ({split}): {e}") from e
    # what defines the ids (char list, BPE name and vocabulary), not only the vocabulary size: 65 other
    # characters would score each id as another character without a word
    changed = tokenizer_difference(state["tokenizer"], ds.meta)
    if changed:
        raise InferError(
            f"data.dir={data_dir} was tokenized unlike the checkpoint's training data ({changed}), so its ids"
            " mean other tokens; pass the run's own data.dir, or data prepared with the same tokenizer"
        )
    if not cfg.data.dir:  # the run's own data dir: still the data it trained on (as resume=true checks)
        check_same_data(state, data_dir, ds.meta)
    # the run's own values are kept (its val/loss batches) unless this command changed the batch shape
    own_bs = run_bs if cfg.seq_len is None else None
    own_batches = run_eval.get("batches", 20) if cfg.seq_len is None and cfg.batch_size is None else None
    batch_size, batches, capped = _cap_to_split(
        ds.num_tokens, split, seq_len, batch_size, batches, own_bs, own_batches
    )
    for note in capped:
        print(f"note: {note}", file=sys.stderr, flush=True)
    model = build_model(state, cfg.attention.name, cfg.attention.sdpa_backend, device, dtype)

    total, n = 0.0, 0
    t0 = time.perf_counter()
    with torch.no_grad():
        for x, y in ds.eval_batches(batches, batch_size, seed):
            _, loss = model(x.to(device), y.to(device))
            total += float(loss.double())
            n += 1
    seconds = time.perf_counter() - t0
    loss = total / n
    result = {
        "checkpoint": str(path),
        "step": int(state["step"]),
        "split": split,
        "loss": loss,
        "perplexity": math.exp(loss),
        "batches": batches,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "seed": seed,
        "data_dir": str(data_dir),
        "attention": model.attention_backend,
        "device": str(device),
        "dtype": str(dtype)[6:],
        "seconds": seconds,
    }
    if capped:
        result["capped"] = capped
    print(
        f"{path} (step {result['step']}) | {split} loss {loss:.4f} | "
        f"perplexity {result['perplexity']:.3f} | {batches} x {batch_size} x {seq_len} tokens | "
        f"attention={model.attention_backend} | dtype={result['dtype']}"
    )
    if cfg.write and run_dir is None and not cfg.out:  # init_from: no run directory to write into
        print("note: init_from has no run directory: printed only (out=PATH.json writes it)", file=sys.stderr)
    elif cfg.write:
        stem = f"{time.strftime('%Y%m%d-%H%M%S')}_{path.stem}_{split}_{model.attention_backend}"
        text = json.dumps(result, indent=1) + "\n"
        out = write_results(
            cfg.out, run_dir, "evals", stem, {".json": text}, "the result file", "out=PATH.json"
        )
        if out is not None:
            print(f"written to {out}")


@hydra.main(config_path="configs", config_name="eval", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_job(cfg, EvalConfig, _eval)


if __name__ == "__main__":
    sys.exit(report_config_errors(main, EvalConfig))
