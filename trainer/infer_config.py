"""Typed configs of sample.py and eval.py, stored in Hydra's ConfigStore like train.py's schema, and
their config errors reported as train.py reports its own (``config error: ...``, exit 2).

    python -m trainer.infer_config sample     # every sample.py key, its default and its doc (eval: eval)
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore

from model.config import BOOL, POS_INT, SEED
from trainer.fields import ConfigError, check_fields, check_known, in_job, print_keys, spec

__all__ = [
    "ConfigError",
    "EvalConfig",
    "SampleConfig",
    "check_config",
    "run_job",
]


@dataclass
class InferAttentionConfig:  # attention=naive|sdpa|flash (configs/attention/); unset = the run's own
    name: str | None = spec(
        None, "attention backend: naive | sdpa | flash; null = the one the run trained with"
    )
    sdpa_backend: str | None = spec(
        None, "SDPA kernel for sdpa: auto | flash | cudnn | efficient | math; null = the run's"
    )


@dataclass
class SampleConfig:  # the whole sample.py config (configs/sample.yaml)
    attention: InferAttentionConfig = field(default_factory=InferAttentionConfig)
    run: str | None = spec(None, "run directory (runs/<name>); its newest checkpoint that loads is used")
    ckpt: str | None = spec(None, "or a checkpoint: runs/<run>/ckpt/step_<N> (or a file in it)")
    init_from: str | None = spec(
        None, "or released weights, no run: gpt2 | gpt2-medium | gpt2-large | gpt2-xl | a local HF GPT-2 dir"
    )
    prompt: str = spec("\n", "text, or file:PATH to read it from a UTF-8 file")
    num_samples: int = spec(3, "sequences, generated as one batch", POS_INT)
    max_new_tokens: int = spec(500, "tokens generated per sample", POS_INT)
    # temperature, top_k and top_p: their ranges are checked by model.sampling.check_sampling_args
    temperature: float = spec(0.8, "0 = greedy (argmax); must be >= 0")
    top_k: int | None = spec(200, "sample among the top_k likeliest tokens (>= 1); null = no top-k filter")
    top_p: float | None = spec(None, "nucleus sampling in (0, 1]; null = off")
    seed: int = spec(1337, "torch generator seed of the sampling", SEED)
    compile: bool = spec(
        False, "torch.compile the static decode step (implies static_decode; slow first call)", BOOL
    )
    static_decode: bool = spec(
        False, "decode steps over the whole cache buffer with a length mask (static shapes)", BOOL
    )
    cuda_graph: bool | None = spec(
        None,
        "replay the static decode step as one CUDA graph (implies static_decode; CUDA only); "
        "null = on for device cuda with use_cache",
        BOOL,
        True,
    )
    dtype: str = spec("auto", "auto (bfloat16 on cuda, float32 on cpu) | float32 | bfloat16 | float16")
    device: str = spec("auto", "auto | cpu | cuda")
    use_cache: bool = spec(True, "false: recompute the whole context every token (reference, slow)", BOOL)
    write: bool = spec(True, "false: print only (no <run>/samples/ files)", BOOL)
    out: str | None = spec(
        None, "samples file; null = <run>/samples/<time>_<ckpt>.txt (plus a .json of settings)"
    )


@dataclass
class EvalDataConfig:  # data.* of eval.py: which split of which data directory
    split: str = spec("val", "val | train", ("val", "train"))
    dir: str | None = spec(None, "data directory; null = the one the run trained on (its config's data.dir)")


@dataclass
class EvalConfig:  # the whole eval.py config (configs/eval.yaml)
    attention: InferAttentionConfig = field(default_factory=InferAttentionConfig)
    data: EvalDataConfig = field(default_factory=EvalDataConfig)
    run: str | None = spec(None, "run directory; its newest checkpoint that loads is used")
    ckpt: str | None = spec(None, "or a checkpoint: runs/<run>/ckpt/step_<N> (or a file in it)")
    init_from: str | None = spec(
        None, "or released weights, no run: gpt2 | gpt2-medium | gpt2-large | gpt2-xl | a local HF GPT-2 dir"
    )
    batches: int | None = spec(None, "fixed evaluation batches; null = the run's eval.batches", POS_INT, 20)
    batch_size: int | None = spec(
        None, "sequences per batch; null = the run's evaluation batch size", POS_INT, 8
    )
    seq_len: int | None = spec(
        None, "tokens per sequence; null = the run's seq_len (at most the model's block size)", POS_INT, 256
    )
    seed: int | None = spec(
        None,
        "seed of the fixed batches; null = the run's seed (same batches as its val/loss)",
        SEED,
        1337,
    )
    dtype: str = spec("auto", "auto (bfloat16 on cuda, float32 on cpu) | float32 | bfloat16 | float16")
    device: str = spec("auto", "auto | cpu | cuda")
    write: bool = spec(True, "false: print only (no <run>/evals/ file)", BOOL)
    out: str | None = spec(
        None, "result file (.json); null = <run>/evals/<time>_<ckpt>_<split>_<backend>.json"
    )


def check_config(cfg, schema: type) -> None:
    """Every field check of ``schema`` on the composed ``cfg``, and no key outside it (``+typo=1``)."""
    check_known(cfg, schema)
    check_fields(cfg, schema)


def run_job(cfg, schema: type, body: Callable[[object], None]) -> None:
    """The Hydra task function of sample.py / eval.py: ``schema``'s checks (``check_config``) before any
    checkpoint load, then ``body(cfg)``. A user error is one line (``config error: ...`` or ``error: ...``)
    and exit status 2; any other exception raised here is a bug (traceback), never reported as a
    composition error by ``trainer.fields.report_config_errors``."""
    from model.pretrained import PretrainedError
    from trainer.infer import InferError

    error = None
    with in_job():
        try:
            check_config(cfg, schema)
        except ConfigError as e:
            error = f"config error: {e}"
        else:
            try:
                body(cfg)
            except (InferError, PretrainedError) as e:
                error = f"error: {e}"
    if error:
        print(error, file=sys.stderr)
        sys.exit(2)


ConfigStore.instance().store(name="flashgpt_sample_schema", node=SampleConfig)  # on import
ConfigStore.instance().store(name="flashgpt_eval_schema", node=EvalConfig)

if __name__ == "__main__":  # python -m trainer.infer_config sample|eval
    _schema = {"sample": SampleConfig, "eval": EvalConfig}.get(sys.argv[1] if len(sys.argv) > 1 else "sample")
    if _schema is None:
        sys.exit("usage: python -m trainer.infer_config sample|eval")
    print_keys(_schema, quote=True)
