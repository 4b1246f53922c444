"""GPT-2 language model with a swappable attention backend.

Architecture as in GPT-2 (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners",
section 2.3) and Karpathy's nanoGPT: learned token + position embeddings, a stack of pre-LayerNorm
transformer blocks (x + attn(ln_1(x)), then x + mlp(ln_2(x))), a final LayerNorm and an lm_head whose
weight is tied to the token embedding. Attention uses one fused projection ``c_attn`` (n_embd -> 3*n_embd)
and an output projection ``c_proj``; the MLP is n_embd -> 4*n_embd -> n_embd with tanh-approximated GELU.
Initialisation follows GPT-2: weights N(0, 0.02), biases 0, and the residual output projections
(``attn.c_proj`` and ``mlp.c_proj``) N(0, 0.02/sqrt(2*n_layer)).

Dropout: ``GPTConfig.dropout`` is applied to the embedding sum, to the attention output projection and to
the MLP output (residual dropout). ``GPTConfig.attn_dropout`` (default 0) drops attention probabilities
in training; with it 0, ``naive``, ``sdpa`` and ``flash`` compute exactly the same function and can be
swapped on the same weights.

Attention variants (issue 16, ``model.attention``): ``GPTConfig.window`` (causal sliding window of w keys,
in training and generation) and ``GPTConfig.document_mask`` (a token attends only to its own document;
document ids come from ``GPT.forward(..., doc_ids=)`` or, when not given, from the tokens: a document ends
with ``GPTConfig.doc_separator_ids``, see ``data.docs``). Generation treats the prompt as one document.

Parameter names match nanoGPT (``transformer.wte``, ``transformer.h.0.attn.c_attn`` ...).

Generation (``GPT.generate``) keeps a ``KVCache``: per-layer key/value buffers preallocated to the block
size, so no step allocates or concatenates. The prompt is prefilled with the chosen backend (causal, Nq ==
Nk); each decode step feeds one new token per sequence, writes its k/v at the next cache slot and attends its
query row to the cache prefix (``model.attention.cached_attention``, causal mask aligned bottom-right).
``GPT.decode_step`` is the static-shape variant: it writes slot ``lengths[b]`` and attends to the whole
buffer with a length mask, so one compiled graph / CUDA graph serves every position.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import time
from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import (
    attention,
    attention_qkvpacked,
    cached_attention,
    static_decode_attention,
)
from .config import PRESETS, GPTConfig  # noqa: F401 - re-exported (model.gpt.GPTConfig, PRESETS)
from .sampling import check_sampling_args, sample_next

__all__ = ["GPT", "GPTConfig", "KVCache", "PRESETS"]

class KVCache:
    """Key/value caches of every layer for one batch of sequences, preallocated to ``max_len`` positions.

    Attributes:
        k, v: (n_layer, B, H, max_len, d) tensors of ``dtype`` on ``device``; slots ``[0, length)`` are valid.
        length: number of positions cached so far (the same for every sequence of the batch).
        lengths: (B,) int64 on ``device``, the same count as a device tensor (what a static decode step
            reads, so that its shapes and Python state do not change from step to step).

    The buffers never change shape. ``GPT.forward_cached`` writes slots ``[length, length + N)`` and
    attends to the view ``[:length + N]``; ``GPT.decode_step`` writes slot ``lengths[b]`` and attends to the
    whole buffer with a length mask (static shapes: one torch.compile graph / CUDA graph for every step).
    """

    def __init__(self, n_layer: int, batch_size: int, n_head: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (n_layer, batch_size, n_head, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.int64, device=device)
        self.length = 0

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def reset(self) -> None:
        """Forget every cached position (the buffers are kept and overwritten by the next prefill)."""
        self.length = 0
        self.lengths.zero_()


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused qkv projection; backend chosen by name.

    Input and output (B, N, n_embd). Without a KV cache the c_attn output, viewed (B, N, 3, H, d), goes to
    ``attention_qkvpacked`` (flash takes it whole; other backends get strided (B, H, N, d) views of it, no
    copy); with a cache q, k, v are those views.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.attention_backend = config.attention
        self.sdpa_backend = config.sdpa_backend
        self.window = config.window
        self.attn_dropout = float(config.attn_dropout)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0,
                static: bool = False, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """(B, N, C) -> (B, N, C). With ``cache``: x holds positions ``cache.length .. + N - 1``; their k/v
        are written into layer ``layer``'s cache (``cache.length`` itself is advanced by ``GPT``). With
        ``static`` (N = 1): x holds position ``cache.lengths[b]`` of each sequence b. ``doc_ids`` (B, N):
        document ids for the document mask (no cache only)."""
        B, N, C = x.shape
        H = self.n_head
        qkv = self.c_attn(x).view(B, N, 3, H, C // H)
        if cache is None:  # training / evaluation: the backend may take qkv whole (flash: no dq/dk/dv concat)
            p = self.attn_dropout if self.training else 0.0
            y = attention_qkvpacked(qkv, self.attention_backend, self.sdpa_backend, window=self.window,
                                    doc_ids=doc_ids, dropout_p=p)  # (B, N, H, d)
            return self.resid_dropout(self.c_proj(y.reshape(B, N, C)))
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))  # (B, H, N, d) strided views
        if static:
            # slot lengths[b], indexed in the base buffer (not a layer view: Inductor then writes in place)
            at = (torch.full_like(cache.lengths, layer)[:, None], torch.arange(B, device=x.device)[:, None],
                  torch.arange(H, device=x.device)[None, :], cache.lengths[:, None])  # each (B, H) broadcast
            cache.k.index_put_(at, k[:, :, 0])  # k[:, :, 0]: (B, H, d)
            cache.v.index_put_(at, v[:, :, 0])
            y = static_decode_attention(q, cache.k[layer], cache.v[layer], cache.lengths + 1,
                                        self.attention_backend, self.sdpa_backend, window=self.window)
        else:
            start, end = cache.length, cache.length + N
            cache.k[layer, :, :, start:end] = k
            cache.v[layer, :, :, start:end] = v
            if start == 0:  # prefill: plain causal attention over the new rows, on the chosen backend
                y = attention(q, k, v, self.attention_backend, self.sdpa_backend, window=self.window)
            else:
                y = cached_attention(q, cache.k[layer, :, :, :end], cache.v[layer, :, :, :end],
                                     self.attention_backend, self.sdpa_backend, window=self.window)
        y = y.transpose(1, 2).reshape(B, N, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: Linear(C, 4C) -> GELU(tanh approximation, as GPT-2) -> Linear(4C, C)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x)). (B, N, C) -> (B, N, C)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0,
                static: bool = False, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache, layer, static, doc_ids)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 decoder-only language model (see the module docstring for the architecture and sources).

    Args:
        config: a validated ``GPTConfig``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"GPT expects a GPTConfig, got {type(config).__name__}")
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying (GPT-2 / nanoGPT)

        self.apply(self._init_weights)
        resid_std = 0.02 / math.sqrt(2 * config.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=resid_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        # nn.LayerNorm defaults (weight 1, bias 0) are GPT-2's.

    # ------------------------------------------------------------------------------ forward

    def document_ids(self, idx: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """Document ids (B, N) for the attention's document mask, or None (no mask): ``doc_ids`` when given,
        else derived from the tokens with ``config.doc_separator_ids`` (``data.docs.doc_ids_from_tokens``);
        None when ``config.document_mask`` is off or no separator is known (one document per window).
        Raises ValueError for doc_ids of another shape than idx."""
        if not self.config.document_mask:
            return None
        if doc_ids is not None:
            if doc_ids.shape != idx.shape:
                raise ValueError(f"doc_ids shape {tuple(doc_ids.shape)} must equal idx shape "
                                 f"{tuple(idx.shape)}")
            return doc_ids.to(idx.device)
        if self.config.doc_separator_ids is None:
            return None
        from data.docs import doc_ids_from_tokens

        return doc_ids_from_tokens(idx, self.config.doc_separator_ids)

    def _hidden(self, idx: torch.Tensor, cache: KVCache | None = None,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        if idx.dim() != 2:
            raise ValueError(f"idx must be a (B, N) tensor of token ids, got shape {tuple(idx.shape)}")
        if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
            raise TypeError(f"idx must hold integer token ids (e.g. torch.int64), got dtype {idx.dtype}")
        n = idx.shape[1]
        start = 0 if cache is None else cache.length
        if start + n > self.config.block_size:
            where = "" if cache is None else f" at cache position {start}"
            raise ValueError(
                f"sequence length {n}{where} exceeds block_size={self.config.block_size} (no position "
                f"embedding beyond it); feed at most {self.config.block_size} tokens (e.g. "
                "idx[:, -block_size:]), or build/crop the model with a larger block_size"
            )
        if cache is not None and cache.batch_size != idx.shape[0]:
            raise ValueError(f"the KV cache holds {cache.batch_size} sequences, idx has {idx.shape[0]}")
        pos = torch.arange(start, start + n, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        docs = self.document_ids(idx, doc_ids) if cache is None else None
        for layer, block in enumerate(self.transformer.h):
            x = block(x, cache, layer, False, docs)
        if cache is not None:
            cache.length += n
            cache.lengths.fill_(cache.length)
        return self.transformer.ln_f(x)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits for every position, and the mean next-token cross-entropy if ``targets`` is given.

        Args:
            idx: (B, N) integer token ids in [0, vocab_size), N <= block_size.
            targets: optional (B, N) integer ids; -1 marks positions excluded from the loss.
            doc_ids: optional (B, N) non-decreasing document ids for ``config.document_mask`` (e.g. from
                ``BinDataset.batch(..., with_doc_ids=True)``); by default derived from idx.

        Returns:
            logits: (B, N, vocab_size); float32 when the model runs in float16/bfloat16 (e.g. under
                autocast), otherwise the parameter dtype (float32 or float64).
            loss: scalar mean cross-entropy in nats over non-ignored positions (same dtype as logits),
                or None when ``targets`` is None.

        Raises:
            ValueError: idx not 2-D, or N > block_size. TypeError: non-integer idx.
        """
        x = self._hidden(idx, doc_ids=doc_ids)
        logits = self.lm_head(x)
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        loss = None
        if targets is not None:
            if targets.shape != idx.shape:
                raise ValueError(
                    f"targets shape {tuple(targets.shape)} must equal idx shape {tuple(idx.shape)}"
                )
            loss = F.cross_entropy(
                logits.reshape(-1, logits.size(-1)), targets.reshape(-1).long(), ignore_index=-1
            )
        return logits, loss

    # ------------------------------------------------------------------------------ attention backend

    def set_attention_backend(self, name: str, sdpa_backend: str | None = None) -> None:
        """Switch every block's attention backend in place (weights untouched); updates ``self.config``.

        Args:
            name: attention backend (see ``model.attention.available_attention_backends()``).
            sdpa_backend: SDPA kernel (one of ``SDPA_BACKENDS``); None keeps the current one.

        Raises:
            ValueError: unknown name / sdpa_backend, or head_dim unsupported by flash. On error nothing
                is changed.
        """
        new_sdpa = self.config.sdpa_backend if sdpa_backend is None else sdpa_backend
        new_config = dataclasses.replace(self.config, attention=name, sdpa_backend=new_sdpa)  # validates
        self.config = new_config
        for block in self.transformer.h:
            block.attn.attention_backend = name
            block.attn.sdpa_backend = new_sdpa

    @contextlib.contextmanager
    def use_attention_backend(self, name: str, sdpa_backend: str | None = None) -> Iterator[GPT]:
        """Context manager: run with backend ``name`` (and ``sdpa_backend``), restoring the previous
        backend on exit, also when the body raises. Used for loss parity between backends on one set
        of weights::

            with model.use_attention_backend("naive"):
                _, ref_loss = model(x, y)

        Yields the model. Raises ValueError like ``set_attention_backend``.
        """
        previous = (self.config.attention, self.config.sdpa_backend)
        self.set_attention_backend(name, sdpa_backend)
        try:
            yield self
        finally:
            self.set_attention_backend(*previous)

    @property
    def attention_backend(self) -> str:
        """Name of the attention backend currently used by the blocks."""
        return self.config.attention

    # ------------------------------------------------------------------------------ accounting

    def num_params(self, non_embedding: bool = True) -> int:
        """Number of parameters (tied lm_head/wte weight counted once).

        With ``non_embedding=True`` (nanoGPT's convention) the position embedding is subtracted; the token
        embedding is kept because, tied, it is also the lm_head weight whose matmul costs real FLOPs
        (2 * n_embd * vocab_size per token forward). This is the N used by ``flops_per_token``.
        """
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token at sequence length ``seq_len``.

        PaLM (Chowdhery et al. 2022), appendix B: 6*N + 12*L*H*Q*T, with N = ``num_params()`` (non-position-
        embedding parameters, lm_head included), L = n_layer, H*Q = n_embd, T = seq_len. The 12*L*H*Q*T term
        counts the two attention matmuls (q k^T and P v) over the full T x T matrix; with a causal mask only
        about half of it is needed, so we count half:

            flops_per_token = 6*N + 6 * n_layer * n_embd * seq_len

        Returns FLOPs (float). Raises ValueError if seq_len is not a positive int.
        """
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
            raise ValueError(f"seq_len must be a positive int (tokens), got {seq_len!r}")
        cfg = self.config
        return float(6 * self.num_params(non_embedding=True) + 6 * cfg.n_layer * cfg.n_embd * seq_len)

    def estimate_mfu(self, tokens_per_sec: float, seq_len: int, peak_flops: float = 989e12) -> float:
        """Model FLOPs utilisation: tokens_per_sec * flops_per_token(seq_len) / peak_flops (PaLM app. B).

        Args:
            tokens_per_sec: training throughput in tokens/s (summed over the devices that ``peak_flops``
                covers).
            seq_len: training sequence length in tokens.
            peak_flops: peak FLOP/s of the hardware; default 989e12 = dense BF16 tensor-core peak of one
                H100/H200 SXM (multiply by the number of GPUs for multi-GPU throughput).

        Returns:
            MFU as a fraction (in [0, 1] for physically possible inputs).

        Raises:
            ValueError: negative tokens_per_sec, non-positive peak_flops, bad seq_len.
        """
        if tokens_per_sec < 0:
            raise ValueError(f"tokens_per_sec must be >= 0, got {tokens_per_sec!r}")
        if peak_flops <= 0:
            raise ValueError(f"peak_flops must be > 0 (FLOP/s), got {peak_flops!r}")
        return float(tokens_per_sec) * self.flops_per_token(seq_len) / float(peak_flops)

    # ------------------------------------------------------------------------------ optimizer

    def configure_optimizers(
        self,
        weight_decay: float,
        learning_rate: float,
        betas: tuple[float, float],
        device_type: str,
    ) -> torch.optim.AdamW:
        """AdamW with weight decay on parameters of dim >= 2 (Linear/embedding weights) only.

        Biases and LayerNorm weights (dim < 2) get weight_decay=0. The tied wte/lm_head weight appears
        once. ``fused=True`` when device_type == "cuda" and this PyTorch's AdamW supports it.

        Args:
            weight_decay: decoupled weight decay for the decay group.
            learning_rate: initial learning rate (schedulers may change it later).
            betas: Adam (beta1, beta2).
            device_type: "cuda" or "cpu" (where the parameters live).

        Returns:
            torch.optim.AdamW with param_groups [decay, no_decay] (in that order).
        """
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        extra = {}
        if device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters:
            extra["fused"] = True
        return torch.optim.AdamW(groups, lr=learning_rate, betas=tuple(betas), **extra)

    # ------------------------------------------------------------------------------ utilities

    def crop_block_size(self, block_size: int) -> None:
        """Shrink the maximum sequence length to ``block_size`` in place (keeps the first position rows).

        Raises ValueError if block_size is not in 1..config.block_size.
        """
        if not isinstance(block_size, int) or not 0 < block_size <= self.config.block_size:
            raise ValueError(
                f"crop_block_size needs 1 <= block_size <= {self.config.block_size}, got {block_size!r}"
            )
        self.config = dataclasses.replace(self.config, block_size=block_size)
        wpe = self.transformer.wpe
        wpe.weight = nn.Parameter(wpe.weight.detach()[:block_size].clone())
        wpe.num_embeddings = block_size

    def make_kv_cache(
        self, batch_size: int, dtype: torch.dtype | None = None, device: torch.device | str | None = None
    ) -> KVCache:
        """An empty ``KVCache`` for ``batch_size`` sequences of up to ``block_size`` positions; dtype and
        device default to the model's parameters'."""
        p = self.transformer.wte.weight
        c = self.config
        return KVCache(c.n_layer, batch_size, c.n_head, c.block_size, c.head_dim,
                       dtype or p.dtype, device or p.device)

    @torch.no_grad()
    def forward_cached(self, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Feed ``idx`` (B, N) as positions ``cache.length .. + N - 1`` (prefill when the cache is empty, a
        decode step for N = 1), append their k/v to ``cache`` and return the next-token logits (B, V) of the
        last position, in float32.

        Raises:
            ValueError: cache.length + N > block_size, or a batch size other than the cache's.
        """
        x = self._hidden(idx, cache)
        return self.lm_head(x[:, -1, :]).float()

    @torch.no_grad()
    def decode_step(self, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One static-shape decode step: token ``idx[b, 0]`` at position ``cache.lengths[b]`` of each
        sequence, k/v written into that slot, the query row attending to the whole cache buffer with a
        length mask (``model.attention.static_decode_attention``); returns next-token logits (B, V) float32
        and advances ``cache.lengths`` and ``cache.length`` by one.

        The tensor work is ``_decode_static``, which reads no Python state that changes between steps:
        compile it (``model._decode_static = torch.compile(model._decode_static)``) or capture it in a CUDA
        graph once for all positions.

        Raises:
            ValueError: idx not (cache.batch_size, 1), or the cache is full (cache.length == block_size).
        """
        if idx.dim() != 2 or idx.shape != (cache.batch_size, 1):
            raise ValueError(f"decode_step takes idx of shape ({cache.batch_size}, 1), got "
                             f"{tuple(idx.shape)}")
        if cache.length >= self.config.block_size:
            raise ValueError(f"the KV cache is full (block_size={self.config.block_size}); reset it and "
                             "prefill the last block_size tokens")
        # fresh (B, 1) strides whatever view idx is: at B = 1 a column of the growing token buffer counts as
        # contiguous with that buffer's row stride, a new stride each step (a recompile under torch.compile)
        logits = self._decode_static(idx.clone(memory_format=torch.contiguous_format), cache)
        cache.length += 1
        return logits

    def _decode_static(self, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
        pos = cache.lengths  # (B,) position of each sequence's new token
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos)[:, None, :])
        for layer, block in enumerate(self.transformer.h):
            x = block(x, cache, layer, True)
        cache.lengths.add_(1)
        return self.lm_head(self.transformer.ln_f(x)[:, -1, :]).float()

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        top_p: float | None = None,
        use_cache: bool = True,
        timings: dict | None = None,
        vocab_size: int | None = None,
        static_decode: bool = False,
        cuda_graph: bool = False,
    ) -> torch.Tensor:
        """Sample ``max_new_tokens`` tokens autoregressively; the context is the last block_size tokens.

        With ``use_cache`` (default) the prompt is prefilled once into a ``KVCache`` and each step feeds
        only the new token. Once the window slides past block_size, the positions of the cached keys shift,
        so each later step recomputes the last block_size tokens (as the uncached path does at every step):
        the tokens equal the uncached ones either way.

        Args:
            idx: (B, N) int64 prompt token ids, N >= 1.
            max_new_tokens: number of tokens to append (>= 0).
            temperature: 0 = greedy (argmax), else logits are divided by it (must be >= 0).
            top_k: if given (>= 1), sample only among the top_k most likely tokens.
            generator: optional torch.Generator (on idx's device) for reproducible sampling.
            top_p: if given, in (0, 1]: nucleus sampling (``model.sampling.sample_next``).
            use_cache: False recomputes the whole context every step (reference path).
            timings: if a dict, filled with ``prefill_s``, ``prefill_tokens`` (B * context length),
                ``decode_s`` and ``decode_tokens`` (B * the steps after the prefill), wall-clock
                (CUDA synchronised).
            vocab_size: if given, only ids below it are generated (the tokenizer's size: the model's
                vocabulary is padded to a multiple of 64, and padding ids decode to nothing).
            static_decode: decode with ``decode_step`` (static shapes, whole-buffer length mask) instead of
                the growing cache view; same tokens.
            cuda_graph: static decoding replayed as one CUDA graph (``model.decode_graph``, kept on the
                model for later calls; implies static_decode; CUDA only): no per-kernel launch cost, which
                sets the pace at small batch. Same tokens.

        Returns:
            (B, N + max_new_tokens) int64 token ids (prompt included).

        Raises:
            ValueError: invalid sampling arguments, empty prompt, a backend without KV-cache support
                (``use_cache=True``), or cuda_graph without use_cache or off CUDA.

        Call ``model.eval()`` first if the model has dropout.
        """
        check_sampling_args(temperature, top_k, top_p)
        if idx.dim() != 2 or idx.shape[1] < 1:
            raise ValueError(f"idx must be a (B, N >= 1) tensor of prompt ids, got shape {tuple(idx.shape)}")
        bs = self.config.block_size
        sync = torch.cuda.synchronize if idx.device.type == "cuda" else (lambda: None)
        if cuda_graph and (not use_cache or idx.device.type != "cuda"):
            raise ValueError(f"cuda_graph=True needs use_cache=True and a CUDA device (got use_cache="
                             f"{use_cache}, device {idx.device}); pass cuda_graph=False")
        graph = cache = None
        if cuda_graph and max_new_tokens > 0:
            from .decode_graph import decode_graph

            graph = decode_graph(self, idx.shape[0])  # kept on the model: captured once per batch size
            cache = graph.cache
        elif use_cache and max_new_tokens > 0:
            cache = self.make_kv_cache(idx.shape[0])

        def next_logits(step: int) -> torch.Tensor:
            context = idx[:, -bs:]
            if cache is None:
                return self.lm_head(self._hidden(context)[:, -1, :]).float()  # (B, V)
            if step == 0 or cache.length >= bs:  # prefill, or the window slid: positions shifted
                cache.reset()
                return self.forward_cached(context, cache)
            if graph is not None:
                return graph.step(context[:, -1:])
            if static_decode:
                return self.decode_step(context[:, -1:], cache)
            return self.forward_cached(context[:, -1:], cache)

        sync()
        t0 = time.perf_counter()
        t_prefill = t0
        for step in range(max_new_tokens):
            logits = next_logits(step)
            if vocab_size is not None:
                logits = logits[:, :vocab_size]
            next_id = sample_next(logits, temperature, top_k, top_p, generator)
            idx = torch.cat([idx, next_id.to(idx.dtype)], dim=1)
            if step == 0:
                sync()
                t_prefill = time.perf_counter()
        sync()
        t1 = time.perf_counter()
        if timings is not None:
            ctx = min(idx.shape[1] - max_new_tokens, bs)
            b = idx.shape[0]
            timings.update(prefill_s=t_prefill - t0, prefill_tokens=b * ctx if max_new_tokens else 0,
                           decode_s=t1 - t_prefill, decode_tokens=b * max(0, max_new_tokens - 1))
        return idx
