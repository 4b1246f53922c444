"""Model configuration: ``GPTConfig`` (validated where it is built) and the size ``PRESETS``.

Split from ``model/gpt.py``, which re-exports both names.
"""

from __future__ import annotations

from dataclasses import dataclass

from .attention import check_attention_backend, check_sdpa_backend, check_softcap

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


@dataclass
class GPTConfig:
    """GPT hyper-parameters; validated on construction (and by ``dataclasses.replace``).

    Attributes:
        block_size: maximum sequence length in tokens (size of the position embedding).
        vocab_size: number of token ids (50304 = GPT-2's 50257 padded up to a multiple of 64).
        n_layer: number of transformer blocks.
        n_head: attention heads per block; head_dim = n_embd // n_head.
        n_embd: model width (d_model).
        dropout: residual/embedding dropout probability in [0, 1); no attention-probability dropout.
        bias: whether Linear layers and LayerNorms have biases (GPT-2: True).
        attention: attention backend, one of ``model.attention.available_attention_backends()``.
        sdpa_backend: SDPA kernel when attention == "sdpa", one of ``SDPA_BACKENDS``.
        window: None, or w >= 1: each query attends to its w most recent positions (itself included).
        document_mask: attend only within documents (ids from ``forward(doc_ids=)`` or the tokens).
        attn_dropout: dropout probability on the attention weights in training, in [0, 1).
        doc_separator_ids: token ids that end a document (``meta["doc_separator_ids"]``), used to derive
            document ids from the tokens when ``document_mask`` is on and ``forward`` gets none.
        n_kv_head: key/value heads, None = n_head; fewer is grouped-query attention (Ainslie et al. 2023;
            1 = multi-query, Shazeer 2019): query head h reads kv head h // (n_head // n_kv_head), the KV
            cache holds n_kv_head heads. Must divide n_head.
        pos_emb: "learned" (GPT-2's position embedding wpe) or "rope" (rotary q and k, model/rope.py; no wpe).
        rope_theta: RoPE's base, > 0 (10000 as in RoFormer; Llama 3 uses 500000 for long contexts).
        qk_norm: RMSNorm of each head's q and k (learned scale per head_dim) before the scores, as in
            OLMo 2 and Gemma 3: bounded logits, so larger learning rates stay stable.
        softcap: None, or c > 0: attention scores become c * tanh(s / c) before the mask and softmax
            (Gemma 2). Runs on naive and flash; sdpa refuses it (PyTorch's SDPA has no soft-cap;
            docs/ablations.md).

    Raises:
        ValueError: a non-positive size, dropout / attn_dropout outside [0, 1), n_embd not divisible by
            n_head, unknown attention / sdpa_backend, head_dim outside the flash kernel's range
            (``kernels.flash_attn.MIN_HEAD_DIM..MAX_HEAD_DIM``) with attention="flash", window not None
            or an int >= 1, doc_separator_ids not None or a non-empty list of ints, n_kv_head not dividing
            n_head, an unknown pos_emb, rope with an odd head_dim, rope_theta <= 0, softcap not None or
            > 0, softcap with attention="sdpa".
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
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if self.window is not None and (
            isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1
        ):
            raise ValueError(f"GPTConfig.window must be None or an int >= 1, got {self.window!r}")
        if not isinstance(self.document_mask, bool):
            raise ValueError(f"GPTConfig.document_mask must be a bool, got {self.document_mask!r}")
        if not 0.0 <= float(self.attn_dropout) < 1.0:
            raise ValueError(f"GPTConfig.attn_dropout must be in [0, 1), got {self.attn_dropout!r}")
        if self.doc_separator_ids is not None:
            ids = self.doc_separator_ids
            if (
                isinstance(ids, (str, bytes))
                or not hasattr(ids, "__len__")
                or len(ids) == 0
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
            ):
                raise ValueError(
                    f"GPTConfig.doc_separator_ids must be None or a non-empty list of token ids, got {ids!r}"
                )
            self.doc_separator_ids = tuple(ids)  # lists from a checkpoint's model_args
        if self.n_embd % self.n_head != 0:
            suggestion = self.n_head * max(1, round(self.n_embd / self.n_head))
            raise ValueError(
                f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; choose n_embd a multiple "
                f"of n_head (e.g. n_embd={suggestion}) or an n_head that divides n_embd"
            )
        self._check_ablations()
        check_attention_backend(self.attention)
        check_sdpa_backend(self.sdpa_backend)
        check_softcap(self.attention, self.softcap)
        if self.attention == "flash":
            from kernels.flash_attn import MAX_HEAD_DIM as hi
            from kernels.flash_attn import MIN_HEAD_DIM as lo

            if not lo <= self.head_dim <= hi:
                raise ValueError(
                    f"attention=flash supports head_dim in {lo}..{hi}, but n_embd={self.n_embd} / "
                    f"n_head={self.n_head} gives head_dim={self.head_dim}; change n_head or use "
                    "attention=sdpa"
                )

    def _check_ablations(self) -> None:
        """n_kv_head, pos_emb, rope_theta, qk_norm and softcap (issue 38's keys)."""
        kv = self.n_kv_head
        if kv is not None and (
            isinstance(kv, bool) or not isinstance(kv, int) or kv <= 0 or self.n_head % kv
        ):
            ok = [h for h in range(1, self.n_head + 1) if self.n_head % h == 0]
            raise ValueError(
                f"model.n_kv_head={kv!r} must be null or a positive int dividing model.n_head={self.n_head}; "
                f"choose one of {ok}"
            )
        if self.pos_emb not in ("learned", "rope"):
            raise ValueError(f"model.pos_emb={self.pos_emb!r} is not valid; choose learned or rope")
        if self.pos_emb == "rope" and self.head_dim % 2:
            raise ValueError(
                f"model.pos_emb=rope rotates pairs of features, but head_dim={self.head_dim} (n_embd="
                f"{self.n_embd} / n_head={self.n_head}) is odd; choose an even head_dim or pos_emb=learned"
            )
        if isinstance(self.rope_theta, bool) or not 0 < float(self.rope_theta) < float("inf"):
            raise ValueError(
                f"model.rope_theta must be a finite number > 0, e.g. 10000, got {self.rope_theta!r}"
            )
        if not isinstance(self.qk_norm, bool):
            raise ValueError(f"model.qk_norm must be a bool, got {self.qk_norm!r}")

    @property
    def head_dim(self) -> int:
        """Per-head width d = n_embd // n_head."""
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``n_kv_head``, or n_head when it is None."""
        return self.n_kv_head or self.n_head

    @classmethod
    def from_preset(cls, name: str, **overrides) -> GPTConfig:
        """Config for preset ``name`` (a key of ``PRESETS``) with keyword ``overrides`` applied on top.

        Raises:
            ValueError: unknown preset (lists the valid ones) or an invalid resulting config.
            TypeError: an override that is not a GPTConfig field.
        """
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})
