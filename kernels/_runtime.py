"""What every launcher shares: the interpreter / device checks and tensor helpers (plain torch, a leaf)."""

import contextlib
import importlib.util
import os

import torch


class FlashAttentionUnavailableError(RuntimeError, ValueError):
    """Flash attention cannot run on this device (no CUDA / no Triton / CPU without TRITON_INTERPRET); a
    RuntimeError and a ValueError (like `flash_attention`'s argument errors): either `except` catches it."""


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
    """Raise FlashAttentionUnavailableError unless flash attention runs on `device`: CUDA with triton, or the
    CPU under TRITON_INTERPRET=1."""
    problem = _device_problem(torch.device(device))
    if problem is not None:
        raise FlashAttentionUnavailableError(problem)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def strides(*tensors) -> list:
    """The (B, H, N) strides of each tensor (the kernels assume a unit head-dim stride)."""
    return [s for t in tensors for s in t.stride()[:3]]


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """The kernels accept any strides except a non-unit stride on the last (head) dim: copy then."""
    return t if t.stride(-1) == 1 else t.contiguous()


def empty_like_layout(t: torch.Tensor, shape=None, dtype=None) -> torch.Tensor:
    """An empty dense tensor of `shape` (default t's) whose dims lie in memory in the order of t's strides
    (ties keep their order; the last dim stays innermost). The trainer's q, k, v are (B, N, H, d) memory
    viewed as (B, H, N, d): contiguous results would cost a transposing copy per layer (4.5 ms of a 68 ms
    GPT-2 step at B=32, N=1024 on the H200, bench/NOTES.md v8)."""
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
    """Triton launches on the current CUDA device: make it the tensor's (no switch when it already is)."""
    if not t.is_cuda or t.get_device() == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(t.device)


_SCRATCH_ALLOCATOR_READY = False


def _scratch_alloc(size: int, alignment: int, stream):
    """Scratch of the device-side tensor descriptors, from torch's caching allocator (and graph pools)."""
    del alignment, stream  # torch allocations are 512-byte aligned and stream-ordered
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_scratch_allocator() -> None:
    """Make Triton's global-scratch allocator (device-side tensor descriptors) available in every thread.
    `triton.set_allocator` sets a ContextVar, missing in autograd's device thread where the backward kernels
    launch, so ours becomes the variable's default unless one is set (else set_allocator, this thread)."""
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
