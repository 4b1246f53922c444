"""Generation: the KV cache, prefill and decode steps (growing, static, CUDA graph), and the sampling loop.

``GPT.generate`` prefills the prompt once into a ``KVCache`` (per-layer key/value buffers preallocated to
the block size, so no step allocates or concatenates) and then feeds one new token per sequence per step.
The model sees a cache only through ``GPT.forward(idx, cache=...)``: ``cache.append`` gives the new tokens'
positions and document ids, and each attention layer calls ``cache.attend``, which writes the layer's k/v
into the cache and attends the new queries to it (``model.attention.attention``).

Two views of one cache:

* ``KVCache`` itself, the growing view: the new tokens are slots ``[length, length + T)`` and attend to the
  prefix ``[:length + T]`` (bottom-right causal mask). The prefill (empty cache) attends to its own rows.
* ``StaticStep(cache)``, one static decode step (``GPT.decode_step``): token ``b`` goes to slot
  ``lengths[b]`` and attends to the whole buffer with a length mask. Its shapes and Python state do not
  change between steps, so one ``torch.compile`` graph or one CUDA graph (``DecodeGraph``) serves every
  position; at small batch the host's launch overhead sets the pace otherwise (gpt-fast and vLLM do the
  same).

Document masks (``GPTConfig.document_mask``): the cache keeps the tokens and derives their document ids
with the rule of ``data.docs`` (ids relative to the cache's first position, the same ids the uncached
forward derives from the same context), so a new query attends only to keys of its own document in every
path, as in training.
"""

from __future__ import annotations

import time

import torch

from .attention import attention
from .sampling import check_sampling_args, sample_next

__all__ = ["DecodeGraph", "KVCache", "StaticStep", "decode_graph", "generate", "release"]


class KVCache:
    """Keys and values of every layer for one batch of sequences, preallocated to ``max_len`` positions.

    Attributes:
        k, v: (n_layer, B, H, max_len, d), H the model's key/value heads (``n_kv_head``: grouped-query
            attention shrinks the cache by n_head / n_kv_head); slots ``[0, length)`` are valid.
        length: positions cached so far (the same for every sequence); ``lengths`` (B,) int64: the same
            count on the device, what a static step reads.
        tokens: (B, max_len) the cached token ids when ``doc_separator_ids`` is given (document masks),
            else None.
    """

    def __init__(self, n_layer, batch_size, n_head, max_len, head_dim, dtype, device, doc_separator_ids=None):
        shape = (n_layer, batch_size, n_head, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.int64, device=device)
        self.length = 0
        self.separator = tuple(doc_separator_ids) if doc_separator_ids else None
        self.tokens = None
        if self.separator:
            self.tokens = torch.zeros(batch_size, max_len, dtype=torch.int64, device=device)
        self._span = (0, 0)  # the slots of the forward in progress

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

    def _doc_ids(self, end: int) -> torch.Tensor:
        from data.docs import doc_ids_from_tokens

        return doc_ids_from_tokens(self.tokens[:, :end], self.separator)  # (B, end)

    def append(self, idx: torch.Tensor):
        """Take the new tokens ``idx`` (B, T) as slots ``[length, length + T)``; returns their positions
        (T,) (for the position embedding or RoPE) and document ids, a pair (doc_q (B, T), doc_k (B, length
        + T)) or None without document masks.

        Raises:
            ValueError: another batch size than the cache's, or length + T > max_len.
        """
        B, T = idx.shape
        start, end = self.length, self.length + T
        if B != self.batch_size:
            raise ValueError(f"the KV cache holds {self.batch_size} sequences, idx has {B}")
        if end > self.max_len:
            raise ValueError(
                f"sequence length {T} at cache position {start} exceeds block_size={self.max_len} (no "
                "position embedding beyond it); reset the cache and prefill the last block_size tokens"
            )
        docs = None
        if self.tokens is not None:
            self.tokens[:, start:end] = idx
            ids = self._doc_ids(end)
            docs = (ids[:, start:], ids)
        self._span = (start, end)
        self.length = end
        self.lengths.fill_(end)
        return torch.arange(start, end, device=idx.device), docs

    def attend(self, layer, q, k, v, backend, sdpa_backend, doc_ids=None, **variants) -> torch.Tensor:
        """Write layer ``layer``'s new k, v (B, T, nkv, hs) into the cache and attend the new queries q
        (B, T, nh, hs) to the cached prefix with ``attention``'s ``variants`` (window, softcap); returns
        (B, T, nh, hs)."""
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, nh|nkv, T, hs) strided views
        start, end = self._span
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        if start > 0:  # a decode step: attend to the whole prefix (bottom-right causal mask)
            k, v = self.k[layer, :, :, :end], self.v[layer, :, :, :end]  # (B, nkv, end, hs)
        y = attention(q, k, v, backend, sdpa_backend, doc_ids=doc_ids, **variants)  # (B, nh, T, hs)
        return y.transpose(1, 2)


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
        ids = c._doc_ids(c.max_len)  # (B, max_len)
        return pos, (ids.gather(1, pos), ids)

    def attend(self, layer, q, k, v, backend, sdpa_backend, doc_ids=None, **variants) -> torch.Tensor:
        c = self.cache
        B, _, H, _ = k.shape
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, nh|nkv, 1, hs)
        # slot lengths[b], indexed in the base buffer (not a layer view: Inductor then writes in place)
        dev = q.device
        at = (
            torch.full_like(c.lengths, layer)[:, None],
            torch.arange(B, device=dev)[:, None],
            torch.arange(H, device=dev)[None, :],
            c.lengths[:, None],
        )  # each broadcast to (B, nkv)
        c.k.index_put_(at, k[:, :, 0])  # k[:, :, 0]: (B, nkv, hs)
        c.v.index_put_(at, v[:, :, 0])
        y = attention(
            q,
            c.k[layer],
            c.v[layer],
            backend,
            sdpa_backend,
            doc_ids=doc_ids,
            lengths=c.lengths + 1,
            **variants,
        )  # (B, nh, 1, hs)
        return y.transpose(1, 2)


def make_kv_cache(model, batch_size: int, dtype=None, device=None) -> KVCache:
    """An empty ``KVCache`` for ``batch_size`` sequences of up to ``block_size`` positions; dtype and device
    default to the model's parameters'. It keeps the tokens when the model masks documents, and the
    model's ``kv_heads`` (n_kv_head) heads."""
    p, c = model.transformer.wte.weight, model.config
    sep = c.doc_separator_ids if c.document_mask else None
    return KVCache(
        c.n_layer, batch_size, c.kv_heads, c.block_size, c.head_dim, dtype or p.dtype, device or p.device, sep
    )


@torch.no_grad()
def forward_cached(model, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Feed ``idx`` (B, T) as positions ``cache.length ..`` (prefill when the cache is empty, a decode step
    for T = 1); returns the next-token logits (B, V) float32 of the last position."""
    logits, _ = model(idx, cache=cache)
    return logits[:, -1].float()


@torch.no_grad()
def decode_step(model, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """One static decode step (see ``StaticStep``): returns logits (B, V) float32, advances the cache.

    The tensor work is ``model._decode_static``; compile it (``model._decode_static =
    torch.compile(model._decode_static)``) or capture it as a CUDA graph once for all positions.

    Raises:
        ValueError: idx not (cache.batch_size, 1), or a full cache.
    """
    if idx.dim() != 2 or idx.shape != (cache.batch_size, 1):
        raise ValueError(f"decode_step takes idx of shape ({cache.batch_size}, 1), got {tuple(idx.shape)}")
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
    """The tensor work of ``decode_step`` (``GPT._decode_static``): logits (B, V) float32; lengths += 1."""
    logits, _ = model(idx, cache=StaticStep(cache))
    cache.lengths.add_(1)
    return logits[:, -1].float()


@torch.no_grad()
def generate(
    model,
    idx,
    max_new_tokens,
    temperature=1.0,
    top_k=None,
    generator=None,
    top_p=None,
    use_cache=True,
    timings=None,
    vocab_size=None,
    static_decode=False,
    cuda_graph=False,
):
    """``GPT.generate`` (see its docstring): (B, T + max_new_tokens) token ids."""
    check_sampling_args(temperature, top_k, top_p)
    if idx.dim() != 2 or idx.shape[1] < 1:
        raise ValueError(f"idx must be a (B, N >= 1) tensor of prompt ids, got shape {tuple(idx.shape)}")
    bs = model.config.block_size
    sync = torch.cuda.synchronize if idx.device.type == "cuda" else (lambda: None)
    if cuda_graph and (not use_cache or idx.device.type != "cuda"):
        raise ValueError(
            f"cuda_graph=True needs use_cache=True and a CUDA device (got use_cache={use_cache}, "
            f"device {idx.device}); pass cuda_graph=False"
        )
    graph = cache = None
    if cuda_graph and max_new_tokens > 0:
        graph = decode_graph(model, idx.shape[0])  # kept on the model: captured once per batch size
        cache = graph.cache
    elif use_cache and max_new_tokens > 0:
        cache = make_kv_cache(model, idx.shape[0])

    def next_logits(step: int) -> torch.Tensor:
        context = idx[:, -bs:]
        if cache is None:  # the reference: the whole context through the training forward
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
        logits = next_logits(step)  # (B, V)
        if vocab_size is not None:
            logits = logits[:, :vocab_size]
        idx = torch.cat([idx, sample_next(logits, temperature, top_k, top_p, generator).to(idx.dtype)], dim=1)
        if step == 0:
            sync()
            t_prefill = time.perf_counter()
    sync()
    t1 = time.perf_counter()
    if timings is not None:
        ctx, b = min(idx.shape[1] - max_new_tokens, bs), idx.shape[0]
        timings.update(
            prefill_s=t_prefill - t0,
            prefill_tokens=b * ctx if max_new_tokens else 0,
            decode_s=t1 - t_prefill,
            decode_tokens=b * max(0, max_new_tokens - 1),
        )
    return idx


# ------------------------------------------------------------------------------------------ CUDA graph


def graph_key(model, batch_size: int) -> tuple:
    """What a kept graph depends on: the batch size, every parameter's and buffer's memory, dtype and device
    (a moved, cast or replaced weight, ``crop_block_size``), each layer's attention backend, SDPA kernel and
    variants (window, softcap; ``set_attention_backend``), the block size, the decode step itself (compiled
    or not) and inference mode (a cache made under ``torch.inference_mode`` cannot be reset outside it)."""
    tensors = [*model.parameters(), *model.buffers()]
    attn = [
        (b.attn.attention_backend, b.attn.sdpa_backend, tuple(b.attn.variants.items()))
        for b in model.transformer.h
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
    """The ``DecodeGraph`` kept on ``model`` for ``batch_size`` sequences, captured (with a new cache) unless
    the kept one has the same ``graph_key``. One per model: a new capture frees the previous one first.

    Raises:
        ValueError: the model is in training mode (a graph replays fixed kernels), or as ``DecodeGraph``.
    """
    if model.training:
        raise ValueError("cuda_graph decoding needs model.eval() (a graph replays fixed kernels)")
    key = graph_key(model, batch_size)
    if getattr(model, "_decode_graph", (None,))[0] != key:
        release(model)  # the old graph and cache are freed before the new capture (peak memory)
        model._decode_graph = (key, DecodeGraph(model, make_kv_cache(model, int(batch_size))))
    return model._decode_graph[1]


def release(model) -> None:
    """Drop the graph and KV cache ``decode_graph`` keeps on ``model`` (their memory returns to PyTorch)."""
    model.__dict__.pop("_decode_graph", None)


class DecodeGraph:
    """``model._decode_static`` replayed as one CUDA graph bound to ``cache``'s buffers (which never move,
    so the graph stays valid across ``cache.reset()`` and new prefills).

    The capture runs the step twice on a side stream first (Triton / torch.compile / cuBLAS warm-up, which
    must not happen inside a capture) and restores ``cache.lengths`` after each run: the warm-up writes the
    slot at ``cache.lengths``, which the next real step overwrites before anything attends to it.

    Raises:
        ValueError: not a CUDA cache, the model in training mode, or a full cache.
    """

    def __init__(self, model, cache: KVCache) -> None:
        if cache.k.device.type != "cuda":
            raise ValueError(
                f"cuda_graph decoding needs the model and its KV cache on a CUDA device, got "
                f"{cache.k.device}; use cuda_graph=False on the CPU"
            )
        if model.training:
            raise ValueError("cuda_graph decoding needs model.eval() (a graph replays fixed kernels)")
        if cache.length >= cache.max_len:
            raise ValueError(f"the KV cache is full (max_len={cache.max_len}); reset it and prefill")
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
        """One decode step of ``idx`` (B, 1) at ``cache.lengths[b]``, as ``decode_step``; returns the graph's
        logits buffer (B, V) float32, which the next step overwrites (clone it to keep it)."""
        if idx.shape != self.idx.shape:
            raise ValueError(
                f"DecodeGraph.step takes idx of shape {tuple(self.idx.shape)}, got {tuple(idx.shape)}"
            )
        if self.cache.length >= self.cache.max_len:
            raise ValueError(f"the KV cache is full (max_len={self.cache.max_len}); reset it and prefill")
        self.idx.copy_(idx)
        with torch.cuda.device(self.idx.device):
            self.graph.replay()
        self.cache.length += 1
        return self.logits
