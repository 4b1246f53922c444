"""Attention providers of the benchmarks (ours, naive, SDPA pinned to each backend, FlexAttention) and the
float32 reference they are checked against; shared by `bench.attention` and `bench.tune`."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from bench._timing import short_error
from kernels.reference import chunked_causal_reference as reference_attention  # noqa: F401

PROVIDERS: tuple[str, ...] = (
    "flash",
    "flash-det",
    "naive",
    "sdpa-flash",
    "sdpa-cudnn",
    "sdpa-efficient",
    "sdpa-math",
    "flex",
)
INJECT_KINDS = ("error", "oom", "wrong")


# ------------------------------------------------------------------------------------------- reference


def check_pairs(b: int, h: int, max_all: int = 8) -> list[tuple[int, int]]:
    """(batch, head) pairs checked against the reference: all when B*H <= `max_all`, else
    (0, 0), (0, 1) and (B-1, H-1) — first heads plus the last one to catch batch/head stride bugs."""
    if b * h <= max_all:
        return [(i, j) for i in range(b) for j in range(h)]
    pairs: list[tuple[int, int]] = []
    for p in ((0, 0), (0, min(1, h - 1)), (b - 1, h - 1)):
        if p not in pairs:
            pairs.append(p)
    return pairs


def take_pairs(t: torch.Tensor, pairs: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Stack t[b, h] for the pairs -> (len(pairs), N, d)."""
    bi = torch.tensor([p[0] for p in pairs], device=t.device)
    hi = torch.tensor([p[1] for p in pairs], device=t.device)
    return t.detach()[bi, hi]


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in float32 as a Python float (nan/inf propagate so that the check fails)."""
    diff = (a.float() - b.float()).abs()
    if not torch.isfinite(diff).all():
        return float("inf")
    return float(diff.max())


# ------------------------------------------------------------------------------------------- providers


def _naive_local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Naive causal attention: float32 scores, -inf above the diagonal, float32 softmax, then P @ V."""
    n, d = q.shape[-2], q.shape[-1]
    scores = (q.float() @ k.float().transpose(-1, -2)) * (1.0 / math.sqrt(d))
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
    p = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
    return p.to(v.dtype) @ v


def naive_impl() -> tuple[Callable, str]:
    """The naive provider: ``model.attention.attention(..., "naive")`` when the model package imports,
    else this module's float32-softmax implementation. Returns (fn, description)."""
    try:
        from model.attention import attention as model_attention
    except Exception as exc:  # model/ missing or broken: fall back, but say so in the metadata
        why = short_error(exc)
        return _naive_local, f"bench._providers._naive_local (model.attention not importable: {why})"
    return (lambda q, k, v: model_attention(q, k, v, "naive")), "model.attention.attention(backend='naive')"


_FLEX_COMPILED: Callable | None = None


def _compiled_flex() -> Callable:
    """torch.compile(flex_attention), built once; recompiles per shape (dynamic=False), so the
    recompile limit is raised so that a full sweep never falls back to eager flex."""
    global _FLEX_COMPILED
    if _FLEX_COMPILED is None:
        import torch._dynamo.config as dynamo_config
        from torch.nn.attention.flex_attention import flex_attention

        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(64, getattr(dynamo_config, name)))
        _FLEX_COMPILED = torch.compile(flex_attention, dynamic=False)
    return _FLEX_COMPILED


SDPA_BACKENDS = ("flash", "cudnn", "efficient", "math")


def sdpa_backend(name: str):
    """`torch.nn.attention.SDPBackend` member for a backend name in SDPA_BACKENDS (flash = FlashAttention-2,
    cudnn, efficient = memory-efficient, math). Raises ValueError for another name."""
    from torch.nn.attention import SDPBackend

    table = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }
    if name not in table:
        raise ValueError(f"unknown SDPA backend {name!r}; valid: {', '.join(SDPA_BACKENDS)}")
    return table[name]


def build_provider(name: str, *, n: int, device: torch.device) -> Callable:
    """Return ``fn(q, k, v) -> o`` (causal, default scale 1/sqrt(d)) for provider `name`.

    flash: kernels.flash_attention; flash-det: the same with deterministic=True (the split Triton backward,
    bitwise reproducible, where flash runs the one-pass Gluon backward on sm_90); naive: see `naive_impl`;
    sdpa-<backend>:
    F.scaled_dot_product_attention(is_causal=True) under torch.nn.attention.sdpa_kernel([backend]);
    flex: compiled flex_attention with a causal block mask built here, once per shape (length `n`).
    Raises ValueError for an unknown name (valid: PROVIDERS), ImportError/RuntimeError when the
    provider cannot exist here (e.g. kernels/ not importable, flash on CPU without TRITON_INTERPRET=1).
    """
    if name in ("flash", "flash-det"):
        import kernels

        if hasattr(kernels, "check_flash_available"):
            kernels.check_flash_available(device)
        flash_attention, det = kernels.flash_attention, name == "flash-det"
        return lambda q, k, v: flash_attention(q, k, v, causal=True, deterministic=det)
    if name == "naive":
        return naive_impl()[0]
    if name.startswith("sdpa-"):
        from torch.nn.attention import sdpa_kernel

        if name[len("sdpa-") :] not in SDPA_BACKENDS:
            raise ValueError(f"unknown provider {name!r}; valid: {', '.join(PROVIDERS)}")
        backend = sdpa_backend(name[len("sdpa-") :])

        def sdpa(q, k, v):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        return sdpa
    if name == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        def causal(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        block_mask = create_block_mask(causal, B=None, H=None, Q_LEN=n, KV_LEN=n, device=device)
        flex = _compiled_flex()
        return lambda q, k, v: flex(q, k, v, block_mask=block_mask)
    raise ValueError(f"unknown provider {name!r}; valid: {', '.join(PROVIDERS)}")


def inject_failure(fn: Callable, kind: str) -> Callable:
    """Wrap a provider so that it fails on purpose (testing the bookkeeping): "error" raises
    RuntimeError, "oom" raises torch.cuda.OutOfMemoryError, "wrong" returns O + 0.5."""
    if kind == "error":

        def failing(q, k, v):
            raise RuntimeError("injected failure (--inject-failure)")
    elif kind == "oom":

        def failing(q, k, v):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected by --inject-failure)")
    elif kind == "wrong":

        def failing(q, k, v):
            return fn(q, k, v) + 0.5
    else:
        raise ValueError(f"unknown failure kind {kind!r}; valid: {', '.join(INJECT_KINDS)}")
    return failing
