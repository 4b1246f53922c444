"""When the causal forward and backward run the sm_90 Gluon kernels (`kernels/_gluon_fwd.py`,
`kernels/_gluon_bwd.py`) instead of the Triton ones.

Plain torch: importing this module imports no triton, so the CPU tests can check the rules. `gluon_fwd()` and
`gluon_bwd()` import the kernel modules themselves, only for CUDA calls outside the interpreter.
"""

from __future__ import annotations

import importlib
import os

import torch

from ._checks import interpret_enabled

# Shortest N per head dim that takes the Gluon kernel: the H200 crossover against the Triton forward
# (bench/NOTES.md v13, v15: since the forward is persistent, d = 128 from 1k, d = 64 from 2k).
MIN_N = {64: 2048, 128: 1024}
# The same for the one-pass backward (bench/NOTES.md v14: below it the split Triton backward wins).
MIN_N_BWD = {64: 4096, 128: 2048}
ENV = "FLASHGPT_GLUON_FWD"  # "auto" (default): MIN_N decides; "1": wherever it can run; "0": never
ENV_BWD = "FLASHGPT_GLUON_BWD"  # the same for the backward (MIN_N_BWD)
_MODULES: dict = {}  # kernel module name -> the module, or None when Gluon cannot be imported here


def _import(name: str):
    if name not in _MODULES:
        try:
            _MODULES[name] = importlib.import_module(f".{name}", __package__)
        except (ImportError, AssertionError):  # Gluon's import asserts that triton is not in interpreter mode
            _MODULES[name] = None
    return _MODULES[name]


def gluon_fwd():
    """The `_gluon_fwd` module, or None where triton's Gluon does not import (an older triton, or a process
    whose triton was first imported under TRITON_INTERPRET=1). Imported once; importing it registers the
    op `flashgpt::flash_attn_fwd_sm90`."""
    return _import("_gluon_fwd")


def gluon_bwd():
    """The `_gluon_bwd` module (ops `flashgpt::flash_attn_bwd_sm90[_packed]`), or None as `gluon_fwd`."""
    return _import("_gluon_bwd")


def mode(env: str = ENV) -> str:
    """FLASHGPT_GLUON_FWD (or `env`, e.g. ENV_BWD): "auto", "0" or "1"; raises ValueError naming the variable
    for anything else."""
    raw = os.environ.get(env, "auto")
    value = raw.strip().lower() or "auto"
    if value not in ("auto", "0", "1"):
        raise ValueError(f"{env}={raw!r}: expected auto (the default), 1 (wherever it runs) or 0 (never)")
    return value


def _span(t: torch.Tensor) -> int:
    """Elements from t's first to its last element (a strided view spans more than its numel)."""
    return 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))


def _tma_ok(t: torch.Tensor) -> bool:
    """What the kernel's TMA descriptors and 32-bit offsets need of a (B, H, N, d) operand: unit last stride,
    rows at least d apart, the other strides positive (no expanded dims) and 16-byte aligned, a 16-byte
    aligned first element, and fewer than 2**31 elements spanned."""
    size, d = t.element_size(), t.shape[-1]
    if t.stride(-1) != 1 or t.stride(-2) < d or _span(t) >= 2**31:
        return False
    if any(st <= 0 or (st * size) % 16 for n, st in zip(t.shape[:-1], t.stride()[:-1], strict=True) if n > 1):
        return False
    try:
        return t.data_ptr() % 16 == 0
    except (RuntimeError, NotImplementedError):  # fake / functional tensors while tracing: the offset decides
        return (t.storage_offset() * size) % 16 == 0  # (torch's allocations are 512-byte aligned)


def _eligible(
    env: str,
    min_n: dict,
    extra: bool,
    q,
    k,
    operands,
    causal: bool,
    softmax_scale: float,
    window: int,
    q_doc,
    dropout_p: float,
    module,
) -> bool:
    """The rule both Gluon kernels share: `extra` (the caller's own conditions), a CUDA sm_90 device outside
    the interpreter, causal without window, documents or dropout, a positive softmax_scale, Nq == Nk, d in
    min_n, bf16 / fp16, B * Hq <= 65535 (the backward's grid dimension; the persistent forward has no such
    limit but was not tested above it), `operands` that `_tma_ok` accepts, N >= min_n[d] (any N with
    `env`=1, never with `env`=0), and the kernel `module()` importable. Cheap tests first: it runs per call.
    Raises ValueError for a bad value of `env`, whatever the inputs."""
    how = mode(env)
    if not extra or not q.is_cuda or not causal or window or q_doc is not None or dropout_p:
        return False
    B, Hq, N = q.shape[:3]
    d = int(q.shape[3])  # static (a SymInt under dynamic shapes is not hashable)
    if not softmax_scale > 0 or how == "0" or d not in min_n or not (how == "1" or N >= min_n[d]):
        return False
    if k.shape[2] != N or q.dtype not in (torch.bfloat16, torch.float16) or B * Hq > 65535:
        return False
    if interpret_enabled() or not torch.cuda.is_available() or not all(_tma_ok(t) for t in operands):
        return False
    return torch.cuda.get_device_capability(q.device) == (9, 0) and module() is not None


def route(q, k, v, causal: bool, softmax_scale: float, window: int, q_doc, dropout_p: float) -> bool:
    """Whether `flash_attn._launch_fwd` runs the Gluon kernel for validated inputs q (B, Hq, Nq, d), k / v
    (B, Hkv, Nk, d): a CUDA sm_90 device outside the interpreter, causal without window, documents or
    dropout, a positive softmax_scale, Nq == Nk, d 64 / 128, bf16 / fp16, B * Hq <= 65535, operands that
    `_tma_ok` accepts, and N >= MIN_N[d] (any N with FLASHGPT_GLUON_FWD=1). Under torch.compile this is
    decided while tracing, and a graph from Inductor's cache keeps the choice it was traced with. Raises
    ValueError for another value of FLASHGPT_GLUON_FWD (read on every forward launch, on any device)."""
    return _eligible(
        ENV, MIN_N, True, q, k, (q, k, v), causal, softmax_scale, window, q_doc, dropout_p, gluon_fwd
    )


def route_bwd(
    do,
    q,
    k,
    v,
    o,
    causal: bool,
    softmax_scale: float,
    window: int,
    q_doc,
    dropout_p: float,
    deterministic: bool,
) -> bool:
    """Whether `flash_attn._launch_bwd` runs the one-pass Gluon backward: what `route` asks of the forward
    (with MIN_N_BWD and FLASHGPT_GLUON_BWD), and also one query head per KV head, N a multiple of 128, do and
    o TMA-compatible, and neither `deterministic` nor `torch.are_deterministic_algorithms_enabled()` (its dQ
    is summed by TMA reduce-add in no fixed order; the split Triton backward is bitwise reproducible).
    Raises ValueError for a bad FLASHGPT_GLUON_BWD."""
    own = k.shape[1] == q.shape[1] and q.shape[2] % 128 == 0 and not deterministic
    own = own and not torch.are_deterministic_algorithms_enabled()
    return _eligible(
        ENV_BWD,
        MIN_N_BWD,
        own,
        q,
        k,
        (q, k, v, do, o),
        causal,
        softmax_scale,
        window,
        q_doc,
        dropout_p,
        gluon_bwd,
    )
