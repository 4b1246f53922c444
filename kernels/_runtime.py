"""What every launcher shares: the interpreter / device checks and the tensor helpers of the launches.

A leaf module (plain torch, no triton import): `plan`, the launchers and the Gluon kernels import it.
"""

import contextlib
import importlib.util
import os

import torch


class FlashAttentionUnavailableError(RuntimeError, ValueError):
    """Flash attention cannot run on this device (no CUDA / no Triton / CPU without TRITON_INTERPRET).

    Subclasses both RuntimeError (what `check_flash_available` documents) and ValueError (the
    argument-validation errors of `flash_attention`), so either `except` clause catches it.
    """


def interpret_enabled() -> bool:
    """True when TRITON_INTERPRET is set to a truthy value (1/true/yes/on) right now."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


_HAS_TRITON = importlib.util.find_spec("triton") is not None  # once, at import (not traceable by dynamo)


def _device_problem(device: torch.device) -> str | None:
    """Why flash attention cannot run on `device`, or None when it can."""
    if not _HAS_TRITON:
        return (
            "flash attention needs the `triton` package, which is not installed; install it "
            "(pip install triton, Linux + CUDA) or use attention=sdpa, the portable choice."
        )
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return (
                f"flash attention was asked to run on {device}, but torch.cuda.is_available() is "
                "False; use a CUDA build of torch on a GPU machine, or attention=sdpa (portable)."
            )
        return None
    if device.type == "cpu" and interpret_enabled():
        return None
    return (
        f"flash attention needs a CUDA GPU, but the tensors are on {device}. For slow CPU testing "
        "set TRITON_INTERPRET=1 (Triton interpreter); otherwise attention=sdpa is the portable choice."
    )


def check_flash_available(device) -> None:
    """Raise if flash attention cannot run on `device` (str or torch.device); return None otherwise.

    Runs on: CUDA devices (with triton installed), and CPU when TRITON_INTERPRET=1 (slow, testing).
    Raises:
        FlashAttentionUnavailableError (a RuntimeError): the message says flash needs a CUDA GPU, or
        TRITON_INTERPRET=1 for slow testing, and that attention=sdpa is the portable choice.
    """
    problem = _device_problem(torch.device(device))
    if problem is not None:
        raise FlashAttentionUnavailableError(problem)


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """The kernels accept any strides except a non-unit stride on the last (head) dim: copy then."""
    return t if t.stride(-1) == 1 else t.contiguous()


def empty_like_layout(t: torch.Tensor, shape=None, dtype=None) -> torch.Tensor:
    """An empty dense tensor of `shape` (default t's) whose dims lie in memory in the order of t's strides.

    Why: the trainer's q, k, v are (B, N, H, d) memory (a fused qkv projection) viewed as (B, H, N, d).
    Gradients (and o) in that same order make the model's transpose(1, 2).reshape and the backward's
    concatenation of dq, dk, dv into d(qkv) plain copies or free views; contiguous (B, H, N, d)
    results cost a transposing copy per layer (4.5 ms of a 68 ms GPT-2 step at B=32, N=1024 on the
    H200, bench/NOTES.md v8). Dims with equal strides keep their order; the last dim stays innermost (unit
    stride, which the kernels assume) even where t has a stride-0 (expanded) dim, which sorts after it.
    """
    shape = tuple(t.shape) if shape is None else tuple(shape)
    strides, last = t.stride(), t.dim() - 1
    order = sorted(range(last), key=lambda i: -int(strides[i])) + [last]  # stable: ties keep dim order
    if order == list(range(t.dim())):
        return torch.empty(shape, dtype=dtype or t.dtype, device=t.device)
    dense = torch.empty([shape[i] for i in order], dtype=dtype or t.dtype, device=t.device)
    return dense.permute([order.index(i) for i in range(t.dim())])


def packed_views(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as (B, H, N, d) views of a packed (B, N, 3, H, d) tensor; no copy."""
    q, k, v = qkv.unbind(2)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def device_ctx(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it the tensor's device (no switch, and no
    host time spent, when it already is)."""
    if not t.is_cuda or t.get_device() == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(t.device)


_SCRATCH_ALLOCATOR_READY = False


def _scratch_alloc(size: int, alignment: int, stream):
    """Global scratch for the device-side tensor descriptors: a torch CUDA allocation, so it comes
    from the caching allocator on the current stream (and from the graph's pool under CUDA graphs)."""
    del alignment, stream  # torch allocations are 512-byte aligned and stream-ordered
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_scratch_allocator() -> None:
    """Make Triton's global-scratch allocator available in every thread (idempotent).

    Kernels that build tensor descriptors on the device (`tl.make_tensor_descriptor`) need Triton to
    allocate 128 bytes per descriptor and program at launch, through the allocator given to
    `triton.set_allocator`. That one is a ContextVar: set in one thread it is missing in autograd's
    device thread, where the backward kernels launch (eagerly and from Inductor's compiled backward).
    So, unless an allocator is already set, ours becomes the variable's default for every thread.
    Falls back to `triton.set_allocator` (this thread only) if Triton's internals differ.
    """
    global _SCRATCH_ALLOCATOR_READY
    if _SCRATCH_ALLOCATOR_READY:
        return
    import contextvars

    import triton

    try:
        from triton.runtime import _allocation

        var = _allocation._allocator
        if isinstance(var.get(), _allocation.NullAllocator):
            _allocation._allocator = contextvars.ContextVar("_allocator", default=_scratch_alloc)
    except (ImportError, AttributeError):
        triton.set_allocator(_scratch_alloc)
    _SCRATCH_ALLOCATOR_READY = True
