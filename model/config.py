"""``GPTConfig``: the model's hyper-parameters, their one validation, and the size ``PRESETS``.

GPTConfig is also the schema of train.py's ``model.*`` and ``attention.*`` keys (trainer/config.py builds
those groups from its fields and docstring), so the command line and Python meet the same check, whose
messages name the key, the bad value and one that works.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields

from .attention import BACKENDS, SDPA_BACKENDS, available_attention_backends, check_softcap

#: Model-size presets (GPT-2 sizes from the GPT-2 paper, table 2; "tiny" for CPU tests and smoke runs,
#: "mini" for the CPU quickstart, experiment=cpu_tiny: about 0.8M parameters, readable char-level text in
#: a few minutes on two cores). The one list of sizes: trainer/config.py stores each as ``model=<name>``.
PRESETS: dict[str, dict] = {
    "tiny": dict(n_layer=2, n_head=4, n_embd=128),
    "mini": dict(n_layer=4, n_head=4, n_embd=128),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),
}

#: Fields set by train.py's ``attention`` group (key ``attention.<value>``); the others are ``model.<name>``
#: but ``doc_separator_ids``, which comes from the prepared data.
ATTENTION_KEYS = {"attention": "name"} | {
    f: f for f in ("sdpa_backend", "window", "document_mask", "softcap")
}
NOT_KEYS = ("doc_separator_ids",)


def key(name: str) -> str:
    """train.py's key of GPTConfig field ``name`` (``window`` -> ``attention.window``)."""
    return f"attention.{ATTENTION_KEYS[name]}" if name in ATTENTION_KEYS else f"model.{name}"


@dataclass
class GPTConfig:
    """GPT hyper-parameters, checked on construction (and by ``dataclasses.replace``).

    Attributes:
        block_size: position-embedding length, the longest sequence (train.py: null = seq_len).
        vocab_size: token ids, 50304 = GPT-2's 50257 padded to a multiple of 64 (train.py: null = the
            tokenizer's vocab rounded up to 64).
        n_layer: transformer blocks.
        n_head: attention heads per block; head dim = n_embd / n_head.
        n_embd: model width (d_model).
        dropout: residual and embedding dropout probability.
        bias: biases in Linear layers and LayerNorms (GPT-2: true).
        attention: attention backend: naive | sdpa | flash (model.attention registry).
        sdpa_backend: SDPA kernel for attention=sdpa: auto | flash | cudnn | efficient | math (pinned:
            raises instead of falling back).
        window: causal sliding window: each token sees its w most recent positions (itself included);
            null = full causal.
        document_mask: a token attends only within its document (needs data.doc_separator).
        attn_dropout: dropout on the attention probabilities in training (every backend).
        doc_separator_ids: token ids that end a document (the data's meta.json), from which document ids
            come when document_mask is on and ``forward`` gets none.
        n_kv_head: key/value heads (grouped-query attention; 1 = multi-query), dividing n_head: query head
            h reads kv head h // (n_head / n_kv_head) and the KV cache holds n_kv_head heads; null = n_head.
        pos_emb: positions: learned (GPT-2's wpe) | rope (rotary q and k, model/rope.py; no wpe).
        rope_theta: RoPE's base, > 0 (RoFormer's 10000; Llama 3 uses 500000 for long contexts).
        qk_norm: RMSNorm of each head's q and k (learned scale) before the scores (OLMo 2, Gemma 3).
        softcap: scores become c * tanh(s / c) before the mask and softmax (Gemma 2); naive and flash
            (sdpa has none: docs/ablations.md); null = off.

    Raises:
        ValueError: naming the key (``key``), the bad value and a valid one (``problem``).
    """

    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    attention: str = "sdpa"
    sdpa_backend: str = "auto"
    window: int | None = None
    document_mask: bool = False
    attn_dropout: float = 0.0
    doc_separator_ids: tuple[int, ...] | None = None
    n_kv_head: int | None = None
    pos_emb: str = "learned"
    rope_theta: float = 10000.0
    qk_norm: bool = False
    softcap: float | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            if msg := problem(f.name, getattr(self, f.name)):
                raise ValueError(msg)
        if self.doc_separator_ids is not None:
            self.doc_separator_ids = tuple(self.doc_separator_ids)  # lists from a checkpoint's model_args
        if msg := self._shape_problem():
            raise ValueError(msg)

    def _shape_problem(self) -> str | None:
        """Rules between fields, each message naming a change that works."""
        from kernels.flash_attn import MAX_HEAD_DIM as hi
        from kernels.flash_attn import MIN_HEAD_DIM as lo

        n_head, n_embd, flash = self.n_head, self.n_embd, self.attention == "flash"
        if n_embd % n_head:  # smaller heads than the flash kernel's are no use to any backend
            below = n_embd // n_head * n_head
            embds = [e for e in (below, below + n_head) if e // n_head >= lo] or [lo * n_head]
            heads = ", ".join(
                f"model.n_head={h}" for h in _head_counts(n_embd, n_head, lo, hi if flash else None)[:3]
            )
            return (
                f"model.n_embd={n_embd} is not divisible by model.n_head={n_head}; use "
                + " or ".join(f"model.n_embd={e}" for e in embds)
                + (f" or a model.n_head dividing it: {heads}" if heads else "")
            )
        if flash and not lo <= self.head_dim <= hi:
            heads = _head_counts(n_embd, n_embd // 64 or 1, lo, hi)  # closest to head dim 64 first
            change = (
                f"change model.n_head (e.g. model.n_head={heads[0]}: head dim {n_embd // heads[0]})"
                if heads
                else f"change the model width (e.g. model.n_embd={64 * n_head}: head dim 64)"
            )
            return (
                f"attention=flash supports head dims {lo}..{hi}, but model.n_embd={n_embd} / model.n_head="
                f"{n_head} gives head_dim={self.head_dim}; {change} or use attention=sdpa"
            )
        if self.n_kv_head is not None and n_head % self.n_kv_head:
            ok = ", ".join(f"model.n_kv_head={h}" for h in range(1, n_head + 1) if n_head % h == 0)
            return f"model.n_kv_head={self.n_kv_head} does not divide model.n_head={n_head}; use {ok}"
        if self.pos_emb == "rope" and self.head_dim % 2:
            return (
                f"model.pos_emb=rope rotates pairs of features, but model.n_embd={n_embd} / model.n_head="
                f"{n_head} gives head_dim={self.head_dim}; change model.n_head or use model.pos_emb=learned"
            )
        try:  # a backend that has soft-capping (sdpa has none: docs/ablations.md)
            check_softcap(self.attention, self.softcap)
        except ValueError as e:
            return str(e)
        variants = {
            "attention.window": self.window is not None,
            "attention.document_mask": self.document_mask,
            "model.attn_dropout": self.attn_dropout > 0,
        }
        used = [k for k, on in variants.items() if on]
        if used and not BACKENDS[self.attention].variants:
            return (
                f"{' and '.join(used)} {'need' if len(used) > 1 else 'needs'} a backend registered with "
                f"variants=True, and attention={self.attention} was registered without it "
                f"(model/attention.py); use attention=naive, sdpa or flash, or drop {used[0]}"
            )
        masked = self.window is not None or self.document_mask
        if self.attention == "sdpa" and self.sdpa_backend in ("flash", "cudnn") and masked:
            return (
                f"attention.sdpa_backend={self.sdpa_backend} takes no attention mask, so it cannot run "
                "attention.window / attention.document_mask; use attention.sdpa_backend=auto (or "
                "efficient / math), or attention=flash"
            )
        return None

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    def param_count(self) -> int:
        """Parameters of ``model.gpt.GPT(self)`` (the tied lm_head/wte once, wpe included), without building
        it: ``GPT.num_params(non_embedding=False)``."""
        c, b = self.n_embd, int(self.bias)
        norm = 2 * c if self.bias else c  # a LayerNorm's weight (and bias)
        qkv = (self.n_head + 2 * self.kv_heads) * self.head_dim
        attn = c * qkv + b * qkv + c * c + b * c + (2 * self.head_dim if self.qk_norm else 0)
        mlp = 8 * c * c + b * 5 * c
        pos = self.block_size * c if self.pos_emb == "learned" else 0
        return self.vocab_size * c + pos + self.n_layer * (2 * norm + attn + mlp) + norm

    @classmethod
    def from_preset(cls, name: str, **overrides) -> GPTConfig:
        """Config for preset ``name`` (a key of ``PRESETS``) with keyword ``overrides`` on top."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


def field_docs() -> dict[str, str]:
    """``{"window": "causal sliding window: ...", ...}``: each field's doc from GPTConfig's docstring."""
    text = GPTConfig.__doc__.split("Attributes:")[1].split("Raises:")[0]
    rows = re.findall(r"^ {8}(\w+): (.*?)(?=^ {8}\w+: |\Z)", text, re.M | re.S)
    return {name: " ".join(doc.split()) for name, doc in rows}


# ------------------------------------------------------------------------------------------ the checks
POS_INT, NONNEG_INT, FINITE, NONNEG, UNIT, BOOL = "int>0", "int>=0", "finite", "float>=0", "[0,1)", "bool"
POSITIVE = "float>0"
OPEN_UNIT = "(0,1)"  # strictly between 0 and 1 (a share that must leave something on both sides)
# torch.manual_seed overflows past 2**64 - 1 (and wraps a negative one); rank r seeds seed + r: int64 is safe
SEED, SEED_END = "seed", 2**63
_WHAT = {
    SEED: f"must be an integer from 0 to {SEED_END - 1}",
    POS_INT: "must be a positive integer",
    NONNEG_INT: "must be a non-negative integer",
    NONNEG: "must be >= 0",
    POSITIVE: "must be > 0",
    UNIT: "must be in [0, 1)",
    OPEN_UNIT: "must be in (0, 1), strictly",
}

#: A field's range check and a value that works, for ``problem`` (attention: the registry's names); a new
#: field needs an entry only when its type alone does not say which values work.
CHECKS = dict(
    block_size=(POS_INT, 1024), vocab_size=(POS_INT, 50304), n_layer=(POS_INT, 12), n_head=(POS_INT, 12),
    n_embd=(POS_INT, 768), dropout=(UNIT, 0.0), bias=(BOOL, None), sdpa_backend=(SDPA_BACKENDS, "auto"),
    window=(POS_INT, 256), document_mask=(BOOL, None), attn_dropout=(UNIT, 0.1), n_kv_head=(POS_INT, 1),
    pos_emb=(("learned", "rope"), "learned"), rope_theta=(POSITIVE, 10000.0), qk_norm=(BOOL, None),
    softcap=(POSITIVE, 30.0),
)  # fmt: skip


def problem(name: str, value) -> str | None:
    """Why ``value`` cannot be GPTConfig field ``name``, naming its key and a value that works, or None:
    the one check of each field (the trainer words a value OmegaConf refused with it too)."""
    if name == "attention":
        return problem_with("attention.name (attention=...)", value, available_attention_backends(), "sdpa")
    if name == "doc_separator_ids":
        ok = value is None or (
            not isinstance(value, (str, bytes))
            and hasattr(value, "__len__")
            and len(value) > 0
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
        )
        return (
            None if ok else f"doc_separator_ids must be None or a non-empty list of token ids, got {value!r}"
        )
    check, example = CHECKS.get(name, (None, None))  # no entry: no check beyond the field's type
    nullable = "None" in GPTConfig.__dataclass_fields__[name].type
    if value is None and not nullable:
        return f"{key(name)}=null is not valid here; e.g. {key(name)}={fmt(example)}"
    return problem_with(key(name), value, check, example, nullable=nullable)


def fmt(v) -> str:
    """A value as typed on the command line (null, true, 6e-04 ...)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def problem_with(key: str, value, check, example=None, nullable: bool = False) -> str | None:
    """Why ``value`` fails ``check`` (a constant above, a tuple of the valid values, or None: no check), as
    a message naming ``key`` and a valid ``example``, or None; with ``nullable`` null passes too."""
    if value is None or check is None:
        return None
    if isinstance(check, tuple):
        if any(value == c and type(value) is type(c) for c in check):  # 1 is not true
            return None
        return f"{key}={value!r} is not valid; choose one of: {', '.join(map(fmt, check))}"
    if check == BOOL:
        return None if isinstance(value, bool) else f"{key}={value!r} is not valid; choose true or false"
    if check in (POS_INT, NONNEG_INT, SEED):
        end = SEED_END if check == SEED else math.inf
        if isinstance(value, int) and not isinstance(value, bool) and (check == POS_INT) <= value < end:
            return None
        what = _WHAT[check].replace("must be ", "must be null or ") if nullable else _WHAT[check]
        return f"{key}={value!r} {what}, e.g. {key}={fmt(example)}"
    try:
        x = math.nan if isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        x = math.nan
    if not math.isfinite(x):
        return f"{key}={value!r} is not a finite number, e.g. {key}={fmt(example)}"
    if (
        (check == NONNEG and x < 0)
        or (check == POSITIVE and not x > 0)
        or (check == UNIT and not 0 <= x < 1)
        or (check == OPEN_UNIT and not 0 < x < 1)
    ):
        return f"{key}={value!r} {_WHAT[check]}, e.g. {key}={fmt(example)}"
    return None


def _head_counts(n_embd: int, near: int, lo: int, hi: int | None = None) -> list[int]:
    """Values of n_head that divide ``n_embd`` with a head dim in [lo, hi], closest to ``near`` first
    (ties: the larger head dim)."""
    ok = [h for h in range(1, n_embd + 1) if n_embd % h == 0 and lo <= n_embd // h <= (hi or n_embd)]
    return sorted(ok, key=lambda h: (abs(h - near), h))
