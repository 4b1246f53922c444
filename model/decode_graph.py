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


def graph_key(model, batch_size: int) -> tuple:
    """What a kept graph depends on: the batch size, every parameter's and buffer's memory, dtype and device
    (a moved, cast or replaced weight, ``crop_block_size``), each layer's attention backend, SDPA kernel and
    window (``set_attention_backend``), the block size, the decode step itself (replaced by its compiled
    version or not) and inference mode (a cache made under ``torch.inference_mode`` cannot be reset
    outside it)."""
    tensors = [*model.parameters(), *model.buffers()]
    attn = [
        (m.attention_backend, m.sdpa_backend, m.window)
        for m in model.modules()
        if hasattr(m, "attention_backend") and hasattr(m, "sdpa_backend")
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
    """The ``DecodeGraph`` kept on ``model`` for ``batch_size`` sequences, captured (with a new ``KVCache``)
    unless the one kept was captured with the same ``graph_key``. One is kept per model: a new capture
    drops the previous graph and cache first.

    Raises:
        ValueError: the model is in training mode (a graph captured in eval mode would replay without
            dropout), or as ``DecodeGraph``."""
    if model.training:
        raise ValueError("cuda_graph decoding needs model.eval() (a graph replays fixed kernels)")
    key = graph_key(model, batch_size)
    if getattr(model, "_decode_graph", (None,))[0] != key:
        release(model)  # the old graph and cache are freed before the new capture (peak memory)
        model._decode_graph = (key, DecodeGraph(model, model.make_kv_cache(int(batch_size))))
    return model._decode_graph[1]


def release(model) -> None:
    """Drop the graph and KV cache ``decode_graph`` keeps on ``model`` (their memory returns to PyTorch):
    ``from model.decode_graph import release; release(gpt)``."""
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
        with torch.cuda.device(self.idx.device):
            self.graph.replay()
        self.cache.length += 1
        return self.logits
