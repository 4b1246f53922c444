"""torch.compile of the model: the mode a run asks for, with Inductor's per-kernel debug build off."""

from __future__ import annotations

import torch


def compile_options(mode: str | None) -> dict:
    """Inductor options equivalent to ``torch.compile(mode=mode)``, plus ``assert_indirect_indexing=False``.

    Why: while ``torch._inductor.config.assert_indirect_indexing`` is on (torch's default), Inductor
    compiles every user Triton kernel in the graph -- our FlashAttention kernels, launched through
    ``torch.library.wrap_triton`` -- with ``debug=True``, which makes Triton wrap each int32 index
    add/multiply in an overflow check (more registers, more instructions). Measured on the H200 at
    B=32, H=12, N=1024, d=64: compiled fwd+bwd 0.90 ms with the checks, 0.81 ms without
    (bench/NOTES.md v7). The option's own purpose, device-side bounds asserts on gathered indices such
    as token ids, is covered on the host: prepare checks every token id against the vocabulary.
    Applied for every backend, so the comparison between backends stays fair. ``torch.compile`` takes
    ``mode`` or ``options``, not both: hence the mode's options here.
    """
    from torch._inductor import list_mode_options

    opts = dict(list_mode_options(mode or "default"))
    opts["assert_indirect_indexing"] = False
    return opts


def compile_model(model: torch.nn.Module, mode: str | None) -> torch.nn.Module:
    """``torch.compile(model)`` with `compile_options(mode)`."""
    return torch.compile(model, options=compile_options(mode))
