"""Generation: the KV cache, the decode steps (growing, static, CUDA graph) and the sampling loop.

``generate`` prefills the prompt once into a ``KVCache`` and then feeds one token per sequence per step. The
model sees a cache only as ``GPT.forward(idx, cache=...)``: ``cache.append`` gives the new tokens' positions
and document ids, and each attention layer's ``cache.update`` stores its k, v and returns what to attend to.

``StaticStep(cache)`` is the same cache seen by one static decode step: token b goes to slot lengths[b] and
attends to the whole buffer with a length mask. Its shapes and Python state do not change between steps, so
one torch.compile graph or CUDA graph (``DecodeGraph``) serves every position; at small batch the host's
launch overhead sets the pace otherwise (gpt-fast and vLLM do the same).

With document masks the cache keeps the tokens and derives their document ids by data.docs' rule, the ids
the uncached forward derives from the same context, so every path masks documents as training does.
"""

from __future__ import annotations

import time

import torch

from data.docs import doc_ids_from_tokens

from .sampling import check_sampling_args, sample_next

__all__ = ["DecodeGraph", "KVCache", "StaticStep", "decode_graph", "generate", "release"]


class KVCache:
    """Keys and values of every layer for ``batch_size`` sequences, preallocated to block_size positions:
    k, v (n_layer, B, n_kv_head, block_size, hs), slots [0, length) valid; ``lengths`` (B,) is ``length`` on
    the device (what a static step reads); ``tokens`` (B, block_size) only with document masks."""

    def __init__(self, model, batch_size: int) -> None:
        c, w = model.config, model.transformer.wte.weight
        self.k = w.new_zeros((c.n_layer, batch_size, c.kv_heads, c.block_size, c.head_dim))
        self.v = torch.zeros_like(self.k)
        self.lengths = torch.zeros(batch_size, dtype=torch.int64, device=w.device)
        self.batch_size, self.max_len = batch_size, c.block_size
        self.length = self.start = 0  # slots [start, length): the forward in progress
        self.separator = c.doc_separator_ids if c.document_mask else None
        self.tokens = None
        if self.separator:
            self.tokens = torch.zeros(batch_size, c.block_size, dtype=torch.int64, device=w.device)

    def reset(self) -> None:
        """Forget every position (the buffers stay, overwritten by the next prefill)."""
        self.length = 0
        self.lengths.zero_()

    def doc_ids(self, end: int) -> torch.Tensor:
        return doc_ids_from_tokens(self.tokens[:, :end], self.separator)  # (B, end)

    def append(self, idx: torch.Tensor):
        """Take idx (B, T) as slots [length, length + T): their positions (T,) and document ids, a pair
        (doc_q (B, T), doc_k (B, length + T)), or None without document masks."""
        _check_batch(idx, self)
        T = idx.shape[1]
        start, end = self.length, self.length + T
        if end > self.max_len:
            raise ValueError(
                f"sequence length {T} at cache position {start} exceeds block_size={self.max_len} (no "
                "position embedding beyond it); reset the cache and prefill the last block_size tokens"
            )
        docs = None
        if self.tokens is not None:
            self.tokens[:, start:end] = idx
            ids = self.doc_ids(end)
            docs = (ids[:, start:], ids)
        self.start, self.length = start, end
        self.lengths.fill_(end)
        return torch.arange(start, end, device=idx.device), docs

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store layer ``layer``'s new k, v (B, nkv, T, hs); returns the keys, values and lengths (None) to
        attend to: the prefill its own rows, a later step the whole prefix (bottom-right causal mask)."""
        start, end = self.start, self.length
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        if start == 0:
            return k, v, None
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end], None  # (B, nkv, end, hs)


def _check_batch(idx: torch.Tensor, cache: KVCache) -> None:
    """A batch other than the cache's would broadcast into every row of it: refused (host-side shapes)."""
    if idx.shape[0] != cache.batch_size:
        raise ValueError(
            f"idx holds {idx.shape[0]} sequences but the KV cache was made for {cache.batch_size}: make it "
            f"with KVCache(model, {idx.shape[0]})"
        )


class StaticStep:
    """``cache`` seen by one static decode step: token b at slot ``cache.lengths[b]``, attending to the whole
    buffer with a length mask. Reads no Python state that changes between steps."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache

    def append(self, idx: torch.Tensor):
        """Positions (B, 1) and document ids (doc_q (B, 1), doc_k (B, max_len)) or None of idx (B, 1)."""
        c = self.cache
        pos = c.lengths[:, None]  # (B, 1)
        if c.tokens is None:
            return pos, None
        c.tokens.scatter_(1, pos, idx)
        # slots past lengths[b] hold stale tokens: harmless, an id depends only on the tokens before it
        ids = c.doc_ids(c.max_len)  # (B, max_len)
        return pos, (ids.gather(1, pos), ids)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        c, (B, H) = self.cache, k.shape[:2]
        # slot lengths[b], indexed in the base buffer (not a layer view: Inductor then writes in place)
        at = (
            torch.full_like(c.lengths, layer)[:, None],
            torch.arange(B, device=k.device)[:, None],
            torch.arange(H, device=k.device)[None, :],
            c.lengths[:, None],
        )  # each broadcast to (B, nkv)
        c.k.index_put_(at, k[:, :, 0])  # (B, nkv, hs)
        c.v.index_put_(at, v[:, :, 0])
        return c.k[layer], c.v[layer], c.lengths + 1


@torch.no_grad()
def forward_cached(model, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Feed idx (B, T) at positions cache.length.. (a prefill on an empty cache): logits (B, V) float32."""
    logits, _ = model(idx, cache=cache)
    return logits[:, -1].float()


@torch.no_grad()
def decode_step(model, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """One static decode step of idx (B, 1): logits (B, V) float32. Its tensor work is
    ``model._decode_static``, which may be replaced by its compiled self or captured as a CUDA graph."""
    _check_batch(idx, cache)
    if cache.length >= cache.max_len:
        raise ValueError(
            f"the KV cache is full (block_size={cache.max_len}); reset it and prefill the last "
            "block_size tokens"
        )
    # fresh (B, 1) strides whatever view idx is: at B = 1 a column of the growing token buffer counts as
    # contiguous with that buffer's row stride, a new stride each step (a recompile under torch.compile)
    logits = model._decode_static(idx.clone(memory_format=torch.contiguous_format), cache)
    cache.length += 1
    return logits


def decode_static(model, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """``GPT._decode_static``: the tensor work of ``decode_step``, logits (B, V) float32; lengths += 1."""
    logits, _ = model(idx, cache=StaticStep(cache))
    cache.lengths.add_(1)
    return logits[:, -1].float()


@torch.no_grad()
def generate(
    model,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    *,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    static_decode: bool = False,
    cuda_graph: bool = False,
    vocab_size: int | None = None,
    timings: dict | None = None,
) -> torch.Tensor:
    """``GPT.generate``: idx (B, T) with ``max_new_tokens`` sampled tokens appended; the context is the last
    block_size tokens.

    With ``use_cache`` the prompt is prefilled once and each step feeds one token; once the window slides
    past block_size the cache is refilled, so the tokens equal the uncached path's (the whole context through
    ``forward`` every step). ``static_decode`` runs ``decode_step``, ``cuda_graph`` replays it as a CUDA graph
    kept on the model. ``vocab_size`` keeps ids below it (the tokenizer's); ``timings`` (a dict) gets
    prefill_s, prefill_tokens, decode_s, decode_tokens. Call ``model.eval()`` first if it has dropout.
    """
    check_sampling_args(temperature, top_k, top_p)
    if idx.dim() != 2 or idx.shape[1] < 1:
        raise ValueError(f"idx must be a (B, N >= 1) tensor of prompt ids, got shape {tuple(idx.shape)}")
    if cuda_graph and (not use_cache or idx.device.type != "cuda"):
        raise ValueError(
            f"cuda_graph=True needs use_cache=True and a CUDA device (got use_cache={use_cache}, "
            f"device {idx.device}); pass cuda_graph=False"
        )
    bs = model.config.block_size
    sync = torch.cuda.synchronize if idx.device.type == "cuda" else (lambda: None)
    graph = cache = None
    if cuda_graph and max_new_tokens > 0:
        graph = decode_graph(model, idx.shape[0])  # kept on the model: captured once per batch size
        cache = graph.cache
    elif use_cache and max_new_tokens > 0:
        cache = KVCache(model, idx.shape[0])

    def next_logits(step: int) -> torch.Tensor:
        context = idx[:, -bs:]
        if cache is None:
            return model(context)[0][:, -1].float()
        if step == 0 or cache.length >= bs:  # prefill, or the window slid: every position shifted
            cache.reset()
            return forward_cached(model, context, cache)
        if graph is not None:
            return graph.step(context[:, -1:])
        if static_decode:
            return decode_step(model, context[:, -1:], cache)
        return forward_cached(model, context[:, -1:], cache)

    sync()
    t0 = t_prefill = time.perf_counter()
    for step in range(max_new_tokens):
        logits = next_logits(step)[:, :vocab_size]  # (B, V)
        idx = torch.cat([idx, sample_next(logits, temperature, top_k, top_p, generator).to(idx.dtype)], dim=1)
        if step == 0:
            sync()
            t_prefill = time.perf_counter()
    sync()
    if timings is not None:
        ctx, b = min(idx.shape[1] - max_new_tokens, bs), idx.shape[0]
        timings.update(
            prefill_s=t_prefill - t0,
            prefill_tokens=b * ctx if max_new_tokens else 0,
            decode_s=time.perf_counter() - t_prefill,
            decode_tokens=b * max(0, max_new_tokens - 1),
        )
    return idx


# ------------------------------------------------------------------------------------------ CUDA graph


def graph_key(model, batch_size: int) -> tuple:
    """What a kept graph depends on: the batch size, every parameter's and buffer's memory, dtype and device
    (a moved, cast or replaced weight, ``crop_block_size``), each layer's attention settings, the block size,
    the decode step itself (compiled or not) and inference mode (a cache made under inference_mode cannot be
    reset outside it)."""
    tensors = [*model.parameters(), *model.buffers()]
    attn = [
        (b.attn.attention_backend, b.attn.sdpa_backend, *b.attn.variants.items()) for b in model.transformer.h
    ]
    return (
        int(batch_size),
        tuple((t.data_ptr(), t.dtype, t.device) for t in tensors),
        tuple(attn),
        model.config.block_size,
        id(model.__dict__.get("_decode_static")),  # the step replaced (compiled) or not
        torch.is_inference_mode_enabled(),
    )


def decode_graph(model, batch_size: int) -> DecodeGraph:
    """The ``DecodeGraph`` kept on ``model`` for ``batch_size`` sequences, captured with a new cache unless
    the kept one has the same ``graph_key``; a new capture frees the previous graph first (peak memory)."""
    if model.training:
        raise ValueError("cuda_graph decoding needs model.eval() (a graph replays fixed kernels)")
    key = graph_key(model, batch_size)
    if getattr(model, "_decode_graph", (None,))[0] != key:
        release(model)
        model._decode_graph = (key, DecodeGraph(model, KVCache(model, int(batch_size))))
    return model._decode_graph[1]


def release(model) -> None:
    """Drop the graph and KV cache ``decode_graph`` keeps on ``model`` (their memory returns to PyTorch)."""
    model.__dict__.pop("_decode_graph", None)


class DecodeGraph:
    """``model._decode_static`` replayed as one CUDA graph bound to ``cache``'s buffers, which never move, so
    the graph stays valid across ``cache.reset()`` and new prefills.

    The capture runs the step twice on a side stream first (Triton / torch.compile / cuBLAS warm-up must not
    happen inside a capture), restoring ``cache.lengths`` after each run: the warm-up writes the slot at
    lengths, which the next real step overwrites before anything attends to it.
    """

    def __init__(self, model, cache: KVCache) -> None:
        if cache.k.device.type != "cuda":
            raise ValueError(
                f"cuda_graph decoding needs the model and its KV cache on a CUDA device, got "
                f"{cache.k.device}; use cuda_graph=False on the CPU"
            )
        self.cache = cache
        dev = cache.k.device
        # on the cache's device, also when it is not the current one (cuda:1): torch.cuda.graph's default
        # capture stream belongs to the current device, where nothing of this step would be captured
        with torch.cuda.device(dev), torch.no_grad():
            self.idx = torch.zeros((cache.batch_size, 1), dtype=torch.long, device=dev)
            saved = cache.lengths.clone()
            side = torch.cuda.Stream(device=dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(2):
                    model._decode_static(self.idx, cache)
                    cache.lengths.copy_(saved)
            torch.cuda.current_stream(dev).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=torch.cuda.Stream(device=dev)):
                self.logits = model._decode_static(self.idx, cache)  # (B, V) float32, the output buffer

    def step(self, idx: torch.Tensor) -> torch.Tensor:
        """One decode step of idx (B, 1), as ``decode_step``; returns the graph's logits buffer (B, V), which
        the next step overwrites (clone it to keep it)."""
        self.idx.copy_(idx)
        with torch.cuda.device(self.idx.device):
            self.graph.replay()
        self.cache.length += 1
        return self.logits
