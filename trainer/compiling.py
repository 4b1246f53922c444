"""torch.compile of the model: the mode a run asks for, with Inductor's per-kernel debug build off."""

from __future__ import annotations

import torch


def compile_options(mode: str | None) -> dict:
    """Inductor's options of ``torch.compile(mode=mode)`` (it takes mode or options, not both) plus
    ``assert_indirect_indexing=False``: with it on, Inductor builds every user Triton kernel (our flash
    kernels, via ``wrap_triton``) with ``debug=True``, an overflow check on each int32 index op; compiled
    fwd+bwd on the H200 at B=32, H=12, N=1024, d=64: 0.90 ms with, 0.81 ms without (bench/NOTES.md v7).
    Its own purpose, bounds asserts on token ids, is covered by prepare's vocabulary check. Applied for
    every backend, so the comparison stays fair."""
    from torch._inductor import list_mode_options

    opts = dict(list_mode_options(mode or "default"))
    opts["assert_indirect_indexing"] = False
    return opts


def compile_model(model: torch.nn.Module, mode: str | None) -> torch.nn.Module:
    return torch.compile(model, options=compile_options(mode))
