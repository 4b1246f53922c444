"""GPT-2 language model (Radford et al. 2019) with a swappable attention backend, laid out as nanoGPT's.

Learned token and position embeddings, pre-LayerNorm blocks, a final LayerNorm and an lm_head tied to the
token embedding; GPT-2's initialisation and parameter names (``transformer.h.0.attn.c_attn`` ...). Attention
runs on naive, sdpa or flash (model/attention.py), the same function, so a model can switch backend on the
same weights. The ablation keys (docs/ablations.md) are off by default, so the default model is GPT-2's:
``n_kv_head`` (grouped-query attention), ``pos_emb="rope"`` (model/rope.py), ``qk_norm``, ``softcap``.
Generation and its KV cache: model/generate.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from data.docs import doc_ids_from_tokens

from . import generate as gen
from .attention import attention
from .config import PRESETS, GPTConfig
from .rope import apply_rope, rope_cos_sin

__all__ = ["GPT", "GPTConfig", "PRESETS", "fused_loss_on"]

#: 1 (default): a CUDA training step takes the fused loss of kernels/cross_entropy.py; 0: F.cross_entropy
FUSED_LOSS = "FLASHGPT_FUSED_LOSS"


def fused_loss_on() -> bool:
    """FLASHGPT_FUSED_LOSS, "1" (default) or "0"; ValueError naming the variable for another value."""
    value = os.environ.get(FUSED_LOSS, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(
            f"{FUSED_LOSS}={value!r}: use 1 (default: the fused classifier loss) or 0 (F.cross_entropy)"
        )
    return value == "1"


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer: int = 0) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, hs = config.n_head, config.kv_heads, config.head_dim
        # query, key, value projections for all heads, in one matmul (n_kv_head key and value heads)
        self.c_attn = nn.Linear(config.n_embd, (self.n_head + 2 * self.n_kv_head) * hs, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.q_norm = nn.RMSNorm(hs, eps=1e-6) if config.qk_norm else None
        self.k_norm = nn.RMSNorm(hs, eps=1e-6) if config.qk_norm else None
        self.layer = layer  # this layer's slice of a KV cache
        self.attention_backend = config.attention
        self.sdpa_backend = config.sdpa_backend
        self.variants = dict(window=config.window, softcap=config.softcap)
        self.attn_dropout = config.attn_dropout
        # q, k, v straight from the projection go to attention packed: flash's backward then writes d(qkv)
        # in one buffer, with no concatenation
        self.packed = self.n_kv_head == self.n_head and not config.qk_norm and config.pos_emb == "learned"

    def forward(self, x: torch.Tensor, cache=None, doc_ids=None, rope=None) -> torch.Tensor:
        B, T, C = x.size()  # batch size, sequence length, embedding dimensionality (n_embd)
        nh, nkv = self.n_head, self.n_kv_head
        qkv = self.c_attn(x).view(B, T, nh + 2 * nkv, C // nh)  # (B, T, nh + 2 nkv, hs)
        kw = dict(backend=self.attention_backend, sdpa_backend=self.sdpa_backend, doc_ids=doc_ids)
        kw.update(self.variants, dropout_p=self.attn_dropout if self.training and cache is None else 0.0)
        if self.packed and cache is None:
            y = attention(qkv=qkv.view(B, T, 3, nh, C // nh), **kw)  # (B, T, nh, hs)
        else:
            q, k, v = qkv.split([nh, nkv, nkv], dim=2)  # (B, T, nh, hs), (B, T, nkv, hs) x 2
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            if rope is not None:  # (cos, sin) of this forward's positions
                q, k = apply_rope(q, *rope), apply_rope(k, *rope)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, nh|nkv, T, hs)
            lengths = None
            if cache is not None:  # generating: k, v go into the cache, q attends to what it holds
                k, v, lengths = cache.update(self.layer, k, v)
            y = attention(q, k, v, lengths=lengths, **kw).transpose(1, 2)  # (B, T, nh, hs)
        y = y.reshape(B, T, C)  # re-assemble all head outputs side by side
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))  # GPT-2's tanh GELU


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer: int = 0) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, layer)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cache=None, doc_ids=None, rope=None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache, doc_ids, rope)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        emb = dict(wte=nn.Embedding(config.vocab_size, config.n_embd))
        if config.pos_emb == "learned":  # else rotary q and k; kept 2nd: the parameter order
            emb["wpe"] = nn.Embedding(config.block_size, config.n_embd)
        self.transformer = nn.ModuleDict(
            dict(
                **emb,
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList(Block(config, i) for i in range(config.n_layer)),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying (GPT-2)

        self.apply(self._init_weights)
        # GPT-2: the residual projections scaled by 1/sqrt(2 * n_layer) (two per block add to the stream)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None, cache=None, doc_ids=None, return_logits=True):
        """Logits (B, T, vocab_size) in the compute dtype (bfloat16 under bf16 autocast), and the mean
        cross-entropy over targets != -1 (or None), float32 or wider. doc_ids: (B, T) document ids for
        ``config.document_mask`` (default: from the tokens). cache: a ``generate.KVCache`` or ``StaticStep``:
        the last position's logits only. return_logits=False: None instead of the logits (the training
        step: a compiled graph's logits output gets a zero-filled (B, T, V) gradient in the backward); with
        grad on and on CUDA, the loss is kernels/cross_entropy.py's fused one (off: FLASHGPT_FUSED_LOSS=0)."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be a (B, N) tensor of token ids, got shape {tuple(idx.shape)}")
        T = idx.size(1)
        if cache is None:
            if T > self.config.block_size:
                raise ValueError(
                    f"sequence length {T} exceeds block_size={self.config.block_size} (no position embedding "
                    f"beyond it); feed at most {self.config.block_size} tokens (e.g. idx[:, -block_size:]), "
                    "or build/crop the model with a larger block_size"
                )
            pos = torch.arange(0, T, dtype=torch.long, device=idx.device)  # (T,)
            doc_ids = self.document_ids(idx, doc_ids)  # (B, T) or None
        else:  # the new tokens continue the cached positions and documents
            pos, doc_ids = cache.append(idx)

        cfg, x, rope = self.config, self.transformer.wte(idx), None  # (B, T, n_embd)
        if cfg.pos_emb == "rope":
            dtype = torch.promote_types(x.dtype, torch.float32)
            rope = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, dtype)  # (T | B, 1, 1, hs/2) x 2
        else:
            x = x + self.transformer.wpe(pos)
        x = self.transformer.drop(x)
        for block in self.transformer.h:
            x = block(x, cache, doc_ids, rope)
        x = self.transformer.ln_f(x)
        if cache is not None:
            x = x[:, -1:]  # generating: only the next token's logits are needed
        if targets is not None and targets.shape != idx.shape:
            raise ValueError(f"targets shape {tuple(targets.shape)} must equal idx shape {tuple(idx.shape)}")
        training_step = targets is not None and not return_logits and torch.is_grad_enabled()
        if training_step and x.is_cuda and fused_loss_on():
            # lm_head, loss and the logits' gradient in one pass; imported here: other runs load no kernels
            from kernels.cross_entropy import linear_cross_entropy

            return None, linear_cross_entropy(x.flatten(0, 1), self.lm_head.weight, targets.flatten())
        logits = self.lm_head(x)  # (B, T, vocab_size), in the autocast dtype
        loss = None
        if targets is not None:
            # a float32 softmax for 16-bit logits; the cast stays inside the loss, where the compiled graph
            # fuses it: returning float32 logits cost two (B, T, V) float32 passes a step (NOTES, "peer")
            flat = logits.flatten(0, 1)
            flat = flat.float() if flat.dtype in (torch.float16, torch.bfloat16) else flat
            loss = F.cross_entropy(flat, targets.flatten().long(), ignore_index=-1)
        return (logits if return_logits else None), loss

    def document_ids(self, idx: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """Document ids (B, T) for the document mask: ``doc_ids``, else derived from the tokens with
        ``config.doc_separator_ids`` (data/docs.py); None when the mask is off or no separator is known."""
        if not self.config.document_mask:
            return None
        if doc_ids is not None:  # attention() checks its shape
            return doc_ids.to(idx.device)
        if self.config.doc_separator_ids is None:
            return None
        return doc_ids_from_tokens(idx, self.config.doc_separator_ids)

    def set_attention_backend(self, name: str, sdpa_backend: str | None = None) -> None:
        """Switch every block to backend ``name`` (and ``sdpa_backend``; None keeps it) on the same weights;
        GPTConfig's check raises ValueError, changing nothing, for a choice it refuses."""
        sdpa_backend = self.config.sdpa_backend if sdpa_backend is None else sdpa_backend
        self.config = dataclasses.replace(self.config, attention=name, sdpa_backend=sdpa_backend)
        for block in self.transformer.h:
            block.attn.attention_backend, block.attn.sdpa_backend = name, sdpa_backend

    @contextlib.contextmanager
    def use_attention_backend(self, name: str, sdpa_backend: str | None = None) -> Iterator[GPT]:
        """Run the body with backend ``name``, restoring the previous one on exit (also on an error)."""
        previous = (self.config.attention, self.config.sdpa_backend)
        self.set_attention_backend(name, sdpa_backend)
        try:
            yield self
        finally:
            self.set_attention_backend(*previous)

    @property
    def attention_backend(self) -> str:
        return self.config.attention

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters (the tied lm_head/wte weight once); ``non_embedding`` leaves out the position embedding
        (nanoGPT's convention; wte stays: as lm_head its matmul costs real FLOPs)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and "wpe" in self.transformer:
            n -= self.transformer.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, PaLM (Chowdhery et al. 2022) appendix B, 6N + 12 L H Q T, the attention
        term halved for the causal mask."""
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
            raise ValueError(f"seq_len must be a positive int (tokens), got {seq_len!r}")
        return float(6 * self.num_params() + 6 * self.config.n_layer * self.config.n_embd * seq_len)

    def estimate_mfu(self, tokens_per_sec: float, seq_len: int, peak_flops: float = 989e12) -> float:
        """Model FLOPs utilisation; the default peak is one H100/H200 SXM's dense BF16 (multiply it by the
        GPUs that tokens_per_sec covers)."""
        return tokens_per_sec * self.flops_per_token(seq_len) / peak_flops

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type) -> torch.optim.AdamW:
        """AdamW with weight decay on the matmul and embedding weights (dim >= 2) only; fused (one kernel
        per group on CUDA and CPU alike, and the device-side skip of a non-finite step: trainer/loop.py).
        device_type is unused, kept so the call reads as nanoGPT's (bench.peer calls both models alike)."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=tuple(betas), fused=True)

    def crop_block_size(self, block_size: int) -> None:
        """Shrink the maximum sequence length to ``block_size`` in place (keeps the first position rows)."""
        if not isinstance(block_size, int) or not 0 < block_size <= self.config.block_size:
            raise ValueError(
                f"crop_block_size needs 1 <= block_size <= {self.config.block_size}, got {block_size!r}"
            )
        self.config = dataclasses.replace(self.config, block_size=block_size)
        if "wpe" in self.transformer:  # RoPE has no table to crop
            wpe = self.transformer.wpe
            wpe.weight = nn.Parameter(wpe.weight.detach()[:block_size].clone())
            wpe.num_embeddings = block_size

    # generation and its KV cache: model/generate.py
    generate = gen.generate
    _decode_static = gen.decode_static  # the tensor work of one static decode step: compile or graph this
