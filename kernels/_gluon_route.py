"""Where the experimental Hopper Gluon kernels replace the Triton ones (opt-in, bench/NOTES.md v9).

`flash_attn._launch_fwd` / `_launch_bwd` call `forward` / `backward` for causal self-attention without
variants (the backward also: one query head per KV head, no LSE gradient). Each launches its Gluon kernels
and returns True only when they are asked for (`tiles.gluon_requested`: FLASHGPT_GLUON_FWD=1 /
FLASHGPT_GLUON_BWD=1, or `override_tile_config(gluon_fwd=..., gluon_bwd=...)`) and the inputs suit them
(`applies`); otherwise the Triton kernels run. The Gluon modules are imported only then.
"""

from __future__ import annotations

import torch

from .tiles import gluon_requested


def applies(*ts: torch.Tensor) -> bool:
    """Whether the Gluon kernels can read these tensors (q first): an sm_90 GPU, bf16/fp16, d = 64 or 128
    (their CONFIGS), and what their TMA descriptors need (last stride 1, other strides and the first
    element 16-byte aligned). Shape arithmetic only, so it holds for torch.compile's fake tensors."""
    q = ts[0]
    if q.dtype not in (torch.bfloat16, torch.float16) or int(q.shape[-1]) not in (64, 128):
        return False
    if not q.is_cuda or torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    for t in ts:
        if t.stride(-1) != 1 or any(int(s) % 8 for s in t.stride()[:-1]) or int(t.storage_offset()) % 8:
            return False
    return True


def _launcher(traced: bool):
    from .flash_attn import _launcher, ensure_scratch_allocator

    ensure_scratch_allocator()  # the Gluon kernels build their TMA descriptors on the device
    return lambda kernel, grid: _launcher(kernel, grid, traced)


def forward(q, k, v, o, lse, softmax_scale: float, traced: bool) -> bool:
    """Run the Gluon forward into o, lse if asked for and applicable; True when it ran."""
    if not (gluon_requested("fwd") and applies(q, k, v)):
        return False
    from ._gluon_fwd import fwd_gluon_launch

    fwd_gluon_launch(q, k, v, o, lse, softmax_scale, _launcher(traced))
    return True


def backward(q, k, v, do, o, lse, delta, dq, dk, dv, softmax_scale: float, traced: bool) -> bool:
    """Run the Gluon dQ kernel (which also stores Delta) and then the Gluon dK/dV kernel into dq, dk, dv if
    asked for and applicable; True when they ran."""
    if not (gluon_requested("bwd") and applies(q, k, v, do, o)):
        return False
    from ._gluon_bwd import dkdv_gluon_launch, dq_gluon_launch

    launcher = _launcher(traced)
    dq_gluon_launch(q, k, v, do, o, lse, delta, dq, softmax_scale, launcher)
    dkdv_gluon_launch(q, k, v, do, lse, delta, dk, dv, softmax_scale, launcher)
    return True
