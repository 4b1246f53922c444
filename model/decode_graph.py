"""One CUDA graph per KV cache for the static decode step (``GPT.decode_step``), replayed once per token.

At small batch a decode step of a GPT-2-sized model is a few microseconds of GPU work per kernel and tens
of microseconds of Python and launch overhead per kernel, so the host sets the pace (bench/results: batch 1
decodes at a few hundred tokens/sec compiled, whatever the attention kernel). ``GPT._decode_static`` has
static shapes and reads its position from ``cache.lengths`` on the device, so one capture serves every
position (the approach of gpt-fast and of vLLM's decode graphs; here with ``torch.cuda.CUDAGraph``
directly, which also captures an already ``torch.compile``d step and needs no marking of the cache as a
static input).
"""

from __future__ import annotations

import torch


def decode_graph(model, batch_size: int) -> DecodeGraph:
    """The ``DecodeGraph`` kept on ``model`` for ``batch_size`` sequences, captured (with a new ``KVCache``)
    when there is none for this batch size, or the weights moved, or ``model._decode_static`` was replaced
    (e.g. by its ``torch.compile``d version) since the capture. One is kept per model: capturing another
    batch size drops the previous graph and cache.

    Raises:
        ValueError: the model is in training mode (a graph captured in eval mode would replay without
            dropout), or as ``DecodeGraph``."""
    if model.training:
        raise ValueError("cuda_graph decoding needs model.eval() (a graph replays fixed kernels)")
    key = (
        int(batch_size),
        model.transformer.wte.weight.data_ptr(),
        model.transformer.wte.weight.dtype,
        id(model.__dict__.get("_decode_static")),  # the step replaced (compiled) or not
    )
    held = getattr(model, "_decode_graph", None)
    if held is None or held[0] != key:
        release(model)
        held = (key, DecodeGraph(model, model.make_kv_cache(int(batch_size))))
        model._decode_graph = held
    return held[1]


def release(model) -> None:
    """Drop the graph and KV cache ``decode_graph`` keeps on ``model`` (their memory returns to PyTorch)."""
    model.__dict__.pop("_decode_graph", None)


class DecodeGraph:
    """Replay ``model._decode_static`` as one CUDA graph bound to ``cache``'s buffers.

    Args:
        model: a ``GPT`` on a CUDA device, in eval mode (dropout off: a graph replays fixed kernels).
        cache: the ``KVCache`` the graph reads and writes (its buffers never move, so the graph stays valid
            across ``cache.reset()`` and new prefills).

    The capture runs the step twice on a side stream first (Triton / torch.compile / cuBLAS warm-up, which
    must not happen inside a capture) and restores ``cache.lengths`` after each run, so capturing changes
    no cache state: the warm-up writes the slot at ``cache.lengths``, which the next real step overwrites
    before anything attends to it. Needs a free slot (``cache.length < max_len``), as every decode step.

    Raises:
        ValueError: not a CUDA cache, the model in training mode, or a full cache.
    """

    def __init__(self, model, cache) -> None:
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
        self.idx = torch.zeros((cache.batch_size, 1), dtype=torch.long, device=cache.k.device)
        saved = cache.lengths.clone()
        side = torch.cuda.Stream(device=cache.k.device)
        side.wait_stream(torch.cuda.current_stream(cache.k.device))
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(2):
                model._decode_static(self.idx, cache)
                cache.lengths.copy_(saved)
        torch.cuda.current_stream(cache.k.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.no_grad():
            self.logits = model._decode_static(self.idx, cache)  # (B, V) float32, the graph's output buffer
        # capture records kernels without running them: cache.lengths is as it was

    def step(self, idx: torch.Tensor) -> torch.Tensor:
        """One decode step: ``idx`` (B, 1) int64 at position ``cache.lengths[b]``; advances the cache like
        ``GPT.decode_step`` and returns the next-token logits (B, V) float32. The returned tensor is the
        graph's output buffer: the next ``step`` overwrites it (clone it to keep it)."""
        if idx.shape != self.idx.shape:
            raise ValueError(
                f"DecodeGraph.step takes idx of shape {tuple(self.idx.shape)}, got {tuple(idx.shape)}"
            )
        if self.cache.length >= self.cache.max_len:
            raise ValueError(f"the KV cache is full (max_len={self.cache.max_len}); reset it and prefill")
        self.idx.copy_(idx)
        self.graph.replay()
        self.cache.length += 1
        return self.logits
