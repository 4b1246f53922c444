"""GPT-2's released weights (or any Hugging Face GPT-2 checkpoint directory) in our ``GPT``.

``init_from``: a GPT-2 size (from the Hugging Face cache, downloaded when online) or a local directory
saved by ``GPT2LMHeadModel.save_pretrained``. Parameter names match (nanoGPT's layout is GPT-2's), but
GPT-2's ``Conv1D`` stores its weight as (in, out), ``nn.Linear`` as (out, in): four projections are
transposed. The model shape comes from the checkpoint, with biases on.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from .config import GPTConfig
from .gpt import GPT

GPT2_SIZES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
GPT2_VOCAB = 50257  # the released sizes' vocabulary
#: GPTConfig fields a GPT-2 checkpoint fixes: its tensors' shapes and set (biases, one key/value head per
#: query head, a learned position table, no q/k norms). ``block_size`` is not one: it may cut the positions.
FIXED = ("n_layer", "n_head", "n_embd", "vocab_size", "bias", "n_kv_head", "pos_emb", "qk_norm")
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class PretrainedError(ValueError):
    """A checkpoint that cannot be loaded (the message names it and what to fetch)."""


def _hf_files(init_from: str):
    """(transformers' GPT2Config, raw state dict). The weights are read from the files, not through
    GPT2LMHeadModel.from_pretrained, whose hub-kernel hook takes our ``kernels`` for Hugging Face's."""
    try:
        from transformers import GPT2Config
    except ImportError as e:
        raise PretrainedError(
            f"init_from={init_from} needs the transformers package: pip install transformers"
        ) from e
    path = Path(init_from).expanduser()
    runs = [q for q in (path, *path.parents) if (q / "summary.json").is_file()] if path.is_dir() else []
    if init_from == "resume" or runs:  # nanoGPT's init_from=resume, or (a folder of) one of our own runs
        run = str(runs[0]) if runs else "<run directory>"
        raise PretrainedError(
            f"init_from={init_from} reads GPT-2 weights (a size or a Hugging Face directory); a flashgpt run "
            f"is continued with resume=true out_dir={run} (train.py; nanoGPT's init_from=resume), and "
            f"sampled or evaluated with run={run} (sample.py, eval.py)"
        )
    if path.is_dir() and not (path / "config.json").is_file():
        raise PretrainedError(
            f"init_from={init_from} holds no config.json, so it is not a Hugging Face GPT-2 checkpoint "
            f"directory (config.json + model.safetensors); pass one, or a GPT-2 size, e.g. init_from=gpt2"
        )
    if path.is_dir():
        source = str(path)
    elif init_from in GPT2_SIZES:
        source = f"openai-community/{init_from}"
    elif init_from == "scratch":  # the trainer's "no weights": nothing to load
        raise PretrainedError(
            "init_from=scratch means no pretrained weights (a model trained from its random start), so "
            f"there is nothing to load; pass a GPT-2 size ({', '.join(GPT2_SIZES)}), e.g. init_from=gpt2, "
            "or a local Hugging Face GPT-2 checkpoint directory (config.json + weights)"
        )
    else:
        raise PretrainedError(
            f"init_from={init_from!r} is not a GPT-2 size ({', '.join(GPT2_SIZES)}) nor a local Hugging Face "
            "GPT-2 checkpoint directory (config.json + weights); e.g. init_from=gpt2"
        )
    try:
        if not path.is_dir():
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(source, allow_patterns=["config.json", "model.safetensors"]))
        config = GPT2Config.from_pretrained(path)
        if (path / "model.safetensors").is_file():
            from safetensors.torch import load_file

            sd = load_file(path / "model.safetensors")
        elif (path / "pytorch_model.bin").is_file():
            sd = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        else:
            raise FileNotFoundError(f"no model.safetensors or pytorch_model.bin in {path}")
    except Exception as e:  # hub / network / format errors come in many classes
        why = (str(e).strip().splitlines() or [""])[0].split(". ")[0][:160]  # their first sentence
        raise PretrainedError(
            f"could not load GPT-2 weights init_from={init_from} from {source} ({type(e).__name__}: "
            f"{why}). Offline, fetch them on a machine with network (`huggingface-cli download "
            f"{source}`) into this machine's Hugging Face cache (HF_HOME, now "
            f"{os.environ.get('HF_HOME', '~/.cache/huggingface')}), or pass a local checkpoint directory"
        ) from e
    return config, sd


def differs(key: str, value, shape: dict) -> bool:
    """Whether ``model.<key>=value`` asks for another model than the checkpoint's ``shape[key]`` (a ``FIXED``
    key); null vocab_size and n_kv_head are what the checkpoint sets (the tokenizer's, one per query head)."""
    if value is None and key in ("vocab_size", "n_kv_head"):
        return False
    return value != shape[key]


def checkpoint_shape(init_from: str) -> dict | None:
    """The ``FIXED`` fields of ``init_from``'s model, read without its weights (a GPT-2 size's published
    shape, a directory's config.json); None when ``init_from`` names no such checkpoint (``load_gpt2`` says
    why). ``n_kv_head`` is given as the checkpoint's count, ``n_head``."""
    from .config import PRESETS

    path = Path(init_from).expanduser()
    if init_from in GPT2_SIZES and not path.is_dir():
        c = {**PRESETS[init_from], "vocab_size": GPT2_VOCAB}
    elif (path / "config.json").is_file() and not (path / "summary.json").is_file():
        try:  # transformers' reading of the file, as load_gpt2's (its defaults for a key left out)
            from transformers import GPT2Config

            hf = GPT2Config.from_pretrained(path)
            c = {k: int(getattr(hf, k)) for k in ("n_layer", "n_head", "n_embd", "vocab_size")}
        except Exception:  # noqa: BLE001 - no transformers, or a file it cannot read: load_gpt2 says why
            return None
    else:
        return None
    return {**c, "bias": True, "n_kv_head": c["n_head"], "pos_emb": "learned", "qk_norm": False}


def load_gpt2(init_from: str, **overrides) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """(GPTConfig with the checkpoint's shape, state dict in our layout) of a GPT-2 checkpoint; ``overrides``
    are other GPTConfig fields, and ``block_size`` may cut the checkpoint's position table."""
    c, raw = _hf_files(init_from)
    if (
        c.activation_function not in ("gelu_new", "gelu_pytorch_tanh")
        or not c.scale_attn_weights
        or getattr(c, "scale_attn_by_inverse_layer_idx", False)
        or getattr(c, "reorder_and_upcast_attn", False)
        or abs(float(c.layer_norm_epsilon) - 1e-5) > 1e-12
    ):
        raise PretrainedError(
            f"init_from={init_from}: a GPT-2 variant (activation {c.activation_function!r}, attention "
            f"scaling, layer_norm_epsilon={c.layer_norm_epsilon}), not GPT-2's tanh GELU, 1/sqrt(head_dim) "
            "scaling and 1e-5"
        )
    block_size = int(overrides.pop("block_size", None) or c.n_positions)
    if block_size > c.n_positions:
        raise PretrainedError(
            f"block_size={block_size} is longer than init_from={init_from}'s {c.n_positions} positions; use "
            f"seq_len <= {c.n_positions}"
        )
    config = GPTConfig(
        block_size=block_size,
        vocab_size=int(c.vocab_size),
        n_layer=int(c.n_layer),
        n_head=int(c.n_head),
        n_embd=int(c.n_embd),
        bias=True,
        **overrides,
    )
    sd = {}
    for k, v in raw.items():
        if not k.startswith(("transformer.", "lm_head.")):
            k = "transformer." + k  # GPT2Model's names (OpenAI's released files), not GPT2LMHeadModel's
        if k.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # causal-mask buffers of older transformers versions
        v = v.detach().to(torch.float32)
        if k.endswith(_CONV1D):
            v = v.t()
        sd[k] = v.contiguous()
    sd["transformer.wpe.weight"] = sd["transformer.wpe.weight"][:block_size]
    sd.setdefault("lm_head.weight", sd["transformer.wte.weight"])
    return config, sd


def load_into(model, sd: dict[str, torch.Tensor], init_from: str) -> None:
    """Load ``load_gpt2``'s state dict into our ``GPT`` built from its config, in place."""
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to wte
    if missing or unexpected:
        raise PretrainedError(
            f"init_from={init_from}: weights do not fit GPT-2's layout (missing {missing[:4]}, unexpected "
            f"{unexpected[:4]})"
        )


def gpt_from_pretrained(init_from: str, **overrides):
    """Our ``GPT`` with the weights of ``init_from`` (see ``load_gpt2``)."""
    config, sd = load_gpt2(init_from, **overrides)
    model = GPT(config)
    load_into(model, sd, init_from)
    return model


def inference_record(init_from: str, run: str | None = None, ckpt: str | None = None) -> dict:
    """What sample.py and eval.py read from a run's checkpoint, for released weights without a run: its
    ``model_args``, the GPT-2 BPE tokenizer, step 0, no run config, and ``weights`` (for ``load_into``)."""
    from data.tokenizer import GPT2_VOCAB_SIZE

    if run or ckpt:
        raise PretrainedError(
            f"init_from={init_from} and {'run' if run else 'ckpt'}={run or ckpt} name two models; pass one "
            "(init_from for released weights, run=/ckpt= for a run's checkpoint)"
        )
    config, sd = load_gpt2(init_from)
    if config.vocab_size < GPT2_VOCAB_SIZE:
        raise PretrainedError(
            f"init_from={init_from} has a {config.vocab_size}-token vocabulary; sample.py and eval.py read "
            f"text with GPT-2's BPE ({GPT2_VOCAB_SIZE} tokens): pass a GPT-2 checkpoint"
        )
    return {
        "model_args": dataclasses.asdict(config),
        "step": 0,
        "tokenizer": {"name": "gpt2", "vocab_size": GPT2_VOCAB_SIZE},
        "config": {},
        "path": str(init_from),
        "weights": sd,
    }
