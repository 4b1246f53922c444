"""Causal-attention kernel benchmark: our Triton FlashAttention against naive attention, PyTorch SDPA
(pinned to each backend) and FlexAttention.

Usage (GPU)::

    python -m bench.attention                                   # full sweep, bf16, writes bench/results/
    python -m bench.attention --seqlens 1024,4096 --headdims 128 --providers flash,sdpa-flash
    TRITON_INTERPRET=1 python -m bench.attention --dry-run --out /tmp/b   # CPU plumbing check

Workload: batch x N = ``--tokens`` (default 16384) tokens, hidden ``--hidden`` (default 2048), so
``B = max(1, tokens // N)`` and ``H = hidden // d``. q, k, v, dO are standard normal, shape (B, H, N, d).

Per provider and shape the benchmark

1. checks the provider against a float32 reference (`reference_attention`) on a few (batch, head)
   slices of the same inputs: output O, and dQ/dK/dV for the backward modes. A provider that fails
   the check is recorded with status ``"mismatch: ..."`` and is not timed;
2. measures the peak memory of one forward+backward (CUDA only);
3. times ``fwd`` and ``fwdbwd`` with ``triton.testing.do_bench(return_mode="median")`` (CPU:
   `time.perf_counter` median) and derives ``bwd = fwdbwd - fwd``.

A provider that runs out of memory is recorded as ``"oom"``, one that cannot run as
``"error: <reason>"``; the sweep goes on.

FLOP counts (causal, so half of the dense 4*B*H*N^2*d): forward ``2*B*H*N^2*d``,
backward ``2.5 x`` forward, forward+backward ``3.5 x`` forward (the FlashAttention-2 paper's
convention, Dao 2023, Sec. 4.1).

Outputs in ``--out``: ``attention_<tag>.json`` (metadata + records), ``attention_<tag>.md``
(TFLOP/s, speedup, memory and error tables; also printed) and ``attention_<tag>.png``. JSON and
markdown are rewritten after every shape (metadata ``complete: false`` until the end), so a run cut
short by a time limit keeps its results; ``--merge`` folds a new invocation's records into an
existing JSON of the same tag (e.g. ``--headdims 64`` then ``--headdims 128 --merge``).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

PROVIDERS: tuple[str, ...] = (
    "flash", "naive", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math", "flex",
)
GPU_DEFAULT_PROVIDERS: tuple[str, ...] = (
    "flash", "naive", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex",
)
DRY_RUN_PROVIDERS: tuple[str, ...] = ("flash", "naive", "sdpa-math")
MODES: tuple[str, ...] = ("fwd", "bwd", "fwdbwd")
# Baselines for the "speedup of flash" table, in this order (other providers present follow them).
SPEEDUP_BASELINES: tuple[str, ...] = ("sdpa-flash", "flex", "sdpa-cudnn")
RECORD_KEYS: tuple[str, ...] = (
    "provider", "N", "d", "B", "H", "mode", "ms_median", "tflops", "peak_gib", "status", "max_abs_err",
)
GPU_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
GPU_HEADDIMS = (64, 128)
DRY_SEQLENS = (16, 32)
DRY_HEADDIMS = (16,)
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
_DTYPES = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float32": torch.float32, "fp32": torch.float32,
}
# (abs tolerance on O, tolerance on dQ/dK/dV relative to max(1, max|reference grad|)).
# float32 leaves room for TF32 tensor-core dots on GPU.
TOLERANCES = {torch.bfloat16: (2e-2, 5e-2), torch.float16: (5e-3, 2e-2), torch.float32: (5e-3, 1e-2)}
_INJECT_KINDS = ("error", "oom", "wrong")


# ----------------------------------------------------------------------------------------------- shapes


def shape_for(tokens: int, hidden: int, n: int, d: int) -> tuple[int, int]:
    """Batch and head count for sequence length `n` and head dim `d`: ``B = max(1, tokens // n)``,
    ``H = hidden // d``.

    Raises ValueError when `hidden` is not a multiple of `d` (fix: choose --hidden divisible by every
    --headdims value) or a size is not positive.
    """
    if min(tokens, hidden, n, d) <= 0:
        raise ValueError(f"tokens={tokens}, hidden={hidden}, N={n}, d={d} must all be positive")
    if hidden % d:
        raise ValueError(f"--hidden {hidden} is not a multiple of head dim {d}; pick a hidden size "
                         f"divisible by every --headdims value")
    return max(1, tokens // n), hidden // d


def attention_flops(b: int, h: int, n: int, d: int, mode: str, causal: bool = True) -> float:
    """FLOPs of causal attention for `mode` in {"fwd", "bwd", "fwdbwd"}.

    Forward = two (N x N x d) matmuls per head = ``4*B*H*N^2*d``, halved for the causal mask
    (``2*B*H*N^2*d``); backward = 2.5 x forward (five matmuls instead of two); fwd+bwd = 3.5 x forward.
    Raises KeyError for an unknown mode (valid: fwd, bwd, fwdbwd).
    """
    fwd = 4.0 * b * h * n * n * d
    if causal:
        fwd /= 2.0
    return fwd * FLOP_FACTOR[mode]


def tflops_from_ms(flops: float, ms: float | None) -> float | None:
    """TFLOP/s for `flops` done in `ms` milliseconds (None when the time is missing or not positive)."""
    if ms is None or not ms > 0:
        return None
    return flops / (ms * 1e-3) / 1e12


# ------------------------------------------------------------------------------------------- reference


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    chunk: int = 1024,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
    """Causal softmax attention and its exact backward, computed in `dtype` chunk by chunk of query rows.

    q, k, v: (..., N, d) of any float dtype on any device (copied to `dtype`); do: dL/dO of q's shape
    or None. Returns ``(o, None)`` or ``(o, (dq, dk, dv))``, all in `dtype`, shaped like q/k/v.
    Memory is O(chunk * N) per leading index instead of O(N^2): for rows [s, e) only keys [0, e) can be
    attended. Algorithm: the definition O = softmax(scale * Q K^T + causal mask) V and its textbook
    gradient (as written in the FlashAttention-2 paper, Dao 2023, Alg. 2, without tiling of keys):
    dV = P^T dO, dP = dO V^T, D = rowsum(dO * O), dS = P * (dP - D), dQ = scale dS K,
    dK = scale dS^T Q. Raises ValueError when q and k lengths differ (the causal mask here assumes
    self-attention).
    """
    n, d = q.shape[-2], q.shape[-1]
    if k.shape[-2] != n or v.shape[-2] != n:
        raise ValueError(f"reference_attention needs equal query/key lengths, got {n} and {k.shape[-2]}")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qf, kf, vf = (t.detach().to(dtype) for t in (q, k, v))
    o = torch.empty_like(qf)
    grads = None
    if do is not None:
        dof = do.detach().to(dtype)
        dq, dk, dv = torch.empty_like(qf), torch.zeros_like(kf), torch.zeros_like(vf)
    cols = torch.arange(n, device=q.device)
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        qc, kc, vc = qf[..., s:e, :], kf[..., :e, :], vf[..., :e, :]
        scores = (qc @ kc.transpose(-1, -2)) * scale
        rows = torch.arange(s, e, device=q.device)[:, None]
        scores.masked_fill_(cols[None, :e] > rows, float("-inf"))
        p = torch.softmax(scores, dim=-1)
        del scores
        oc = p @ vc
        o[..., s:e, :] = oc
        if do is not None:
            doc = dof[..., s:e, :]
            dv[..., :e, :] += p.transpose(-1, -2) @ doc
            dp = doc @ vc.transpose(-1, -2)
            ds = p * (dp - (doc * oc).sum(-1, keepdim=True))
            del dp
            dq[..., s:e, :] = (ds @ kc) * scale
            dk[..., :e, :] += (ds.transpose(-1, -2) @ qc) * scale
    if do is not None:
        grads = (dq, dk, dv)
    return o, grads


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


def _take(t: torch.Tensor, pairs: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Stack t[b, h] for the pairs -> (len(pairs), N, d)."""
    bi = torch.tensor([p[0] for p in pairs], device=t.device)
    hi = torch.tensor([p[1] for p in pairs], device=t.device)
    return t.detach()[bi, hi]


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
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
        return _naive_local, f"bench.attention._naive_local (model.attention not importable: {_short(exc)})"
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


def build_provider(name: str, *, n: int, device: torch.device) -> Callable:
    """Return ``fn(q, k, v) -> o`` (causal, default scale 1/sqrt(d)) for provider `name`.

    flash: kernels.flash_attention; naive: see `naive_impl`; sdpa-<backend>:
    F.scaled_dot_product_attention(is_causal=True) under torch.nn.attention.sdpa_kernel([backend]);
    flex: compiled flex_attention with a causal block mask built here, once per shape (length `n`).
    Raises ValueError for an unknown name (valid: PROVIDERS), ImportError/RuntimeError when the
    provider cannot exist here (e.g. kernels/ not importable, flash on CPU without TRITON_INTERPRET=1).
    """
    if name == "flash":
        import kernels

        if hasattr(kernels, "check_flash_available"):
            kernels.check_flash_available(device)
        flash_attention = kernels.flash_attention
        return lambda q, k, v: flash_attention(q, k, v, causal=True)
    if name == "naive":
        return naive_impl()[0]
    if name.startswith("sdpa-"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        table = {
            "sdpa-flash": SDPBackend.FLASH_ATTENTION,
            "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
            "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
            "sdpa-math": SDPBackend.MATH,
        }
        if name not in table:
            raise ValueError(f"unknown provider {name!r}; valid: {', '.join(PROVIDERS)}")
        backend = table[name]

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
        raise ValueError(f"unknown failure kind {kind!r}; valid: {', '.join(_INJECT_KINDS)}")
    return failing


# ------------------------------------------------------------------------------------------------ timing


def _short(exc: BaseException, limit: int = 160) -> str:
    """One-line 'Type: first line of message' (truncated) for a status string."""
    msg = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {msg[0] if msg else ''}".strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def classify_exception(exc: BaseException) -> str:
    """Status for a provider exception: "oom" for torch.cuda.OutOfMemoryError (or any message saying
    "out of memory"), else "error: <Type: first line>"."""
    if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower():
        return "oom"
    return "error: " + _short(exc)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass
class Timer:
    """Median wall time of a callable in ms: triton.testing.do_bench on CUDA, perf_counter on CPU."""

    device: torch.device
    warmup_ms: int = 25
    rep_ms: int = 100
    cpu_reps: int = 3

    def describe(self) -> str:
        if self.device.type == "cuda":
            return (f"triton.testing.do_bench(return_mode='median', warmup={self.warmup_ms} ms, "
                    f"rep={self.rep_ms} ms, grads set to None between reps)")
        return f"time.perf_counter median of {self.cpu_reps} reps after 1 warm-up (CPU dry run)"

    def __call__(self, fn: Callable[[], object], grad_to_none: Sequence[torch.Tensor] | None = None) -> float:
        if self.device.type == "cuda":
            from triton.testing import do_bench

            return float(do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms,
                                  grad_to_none=grad_to_none, return_mode="median"))
        times = []
        for i in range(self.cpu_reps + 1):
            for t in grad_to_none or ():
                t.grad = None
            t0 = time.perf_counter()
            fn()
            dt = (time.perf_counter() - t0) * 1e3
            if i:  # first call is the warm-up
                times.append(dt)
        return float(statistics.median(times))


# ---------------------------------------------------------------------------------------- benchmark core


@dataclass
class ShapeInputs:
    """Inputs of one (N, d) shape plus the float32 reference on the checked (batch, head) pairs."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    pairs: list[tuple[int, int]]
    ref_o: torch.Tensor
    ref_grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    extra: dict = field(default_factory=dict)


def make_inputs(b: int, h: int, n: int, d: int, *, device: torch.device, dtype: torch.dtype, seed: int,
                need_grads: bool, chunk: int = 1024) -> ShapeInputs:
    """Standard-normal q, k, v (requires_grad) and dO of shape (B, H, N, d), and the reference on
    `check_pairs(B, H)` computed by `reference_attention` in float32 from the very same values."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v, do = (torch.randn(b, h, n, d, device=device, dtype=dtype, generator=gen) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    pairs = check_pairs(b, h)
    ref_o, ref_grads = reference_attention(
        _take(q, pairs), _take(k, pairs), _take(v, pairs), _take(do, pairs) if need_grads else None,
        chunk=max(1, min(chunk, (1 << 26) // max(1, len(pairs) * n))),
    )
    return ShapeInputs(q, k, v, do, pairs, ref_o, ref_grads)


def bench_provider(
    name: str,
    fn_factory: Callable[[], Callable],
    inp: ShapeInputs,
    *,
    modes: Sequence[str],
    timer: Timer,
    tol: tuple[float, float],
) -> list[dict]:
    """Check, measure memory of, and time one provider on one shape; never raises for provider failures.

    Returns one record per mode in `modes` with keys RECORD_KEYS plus ``peak_extra_gib`` (peak minus
    the memory allocated before, i.e. inputs; GiB), ``peak_of`` ("fwdbwd", or "fwd" when no backward
    ran), ``errors`` (max abs error of o/dq/dk/dv on the checked pairs) and ``tolerance``.
    `tol` = (abs tolerance on O, tolerance on grads relative to max(1, max|ref grad|)).
    Status: "ok", "oom", "error: ...", "mismatch: ...". Peak memory is CUDA only (None on CPU).
    """
    q, k, v, do = inp.q, inp.k, inp.v, inp.do
    b, h, n, d = q.shape
    device = q.device
    need_bwd = any(m in ("bwd", "fwdbwd") for m in modes)
    status = {m: "ok" for m in MODES}
    errors: dict[str, float] = {}
    ms: dict[str, float | None] = {m: None for m in MODES}
    peak = extra = peak_of = None
    tol_o, tol_g = tol

    def set_status(which: Sequence[str], value: str) -> None:
        for m in which:
            if status[m] == "ok":
                status[m] = value

    def clear_grads() -> None:
        for t in (q, k, v):
            t.grad = None

    fn = None
    try:
        fn = fn_factory()
        # --- correctness: forward
        clear_grads()
        o = fn(q, k, v)
        if o.shape != q.shape:
            raise RuntimeError(f"output shape {tuple(o.shape)} != q shape {tuple(q.shape)}")
        errors["o"] = _max_abs(_take(o, inp.pairs), inp.ref_o)
        if not errors["o"] <= tol_o:
            set_status(MODES, f"mismatch: max|O - ref| = {errors['o']:.3g} > {tol_o:g}")
        # --- correctness: backward
        if need_bwd and status["fwd"] == "ok":
            try:
                o.backward(do)
                for gname, t, ref in zip(("dq", "dk", "dv"), (q, k, v), inp.ref_grads or (), strict=False):
                    if t.grad is None:
                        raise RuntimeError(f"backward produced no gradient for {gname[1]}")
                    errors[gname] = _max_abs(_take(t.grad, inp.pairs), ref)
                    limit = tol_g * max(1.0, float(ref.abs().max()))
                    if not errors[gname] <= limit:
                        set_status(("bwd", "fwdbwd"),
                                   f"mismatch: max|{gname} - ref| = {errors[gname]:.3g} > {limit:.3g}")
            except Exception as exc:  # backward unsupported / OOM: forward results still count
                set_status(("bwd", "fwdbwd"), classify_exception(exc))
        del o
        clear_grads()
        _free(device)
        bwd_ok = need_bwd and status["fwdbwd"] == "ok"

        def fwd() -> object:
            return fn(q, k, v)

        def fwdbwd() -> None:
            fn(q, k, v).backward(do)

        # --- peak memory of one forward+backward (forward only if backward cannot run)
        if device.type == "cuda" and status["fwd"] == "ok":
            try:
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                if bwd_ok:
                    fwdbwd()
                else:
                    fwd()
                torch.cuda.synchronize()
                peak_b = torch.cuda.max_memory_allocated()
                peak, extra = peak_b / 2**30, (peak_b - base) / 2**30
                peak_of = "fwdbwd" if bwd_ok else "fwd"
            except Exception as exc:
                set_status(MODES, classify_exception(exc))
            clear_grads()
            _free(device)
        # --- timing
        if status["fwd"] == "ok":
            try:
                ms["fwd"] = timer(fwd)
            except Exception as exc:
                set_status(MODES, classify_exception(exc))
            clear_grads()
            _free(device)
        if bwd_ok and status["fwdbwd"] == "ok":
            try:
                ms["fwdbwd"] = timer(fwdbwd, grad_to_none=(q, k, v))
            except Exception as exc:
                set_status(("bwd", "fwdbwd"), classify_exception(exc))
            clear_grads()
            _free(device)
        if ms["fwd"] is not None and ms["fwdbwd"] is not None:
            ms["bwd"] = ms["fwdbwd"] - ms["fwd"]
    except Exception as exc:  # provider cannot be built or its forward fails
        set_status(MODES, classify_exception(exc))
    finally:
        fn = None
        clear_grads()
        _free(device)

    records = []
    for m in modes:
        ok = status[m] == "ok"
        errs = [errors[key] for key in (("o",) if m == "fwd" else ("o", "dq", "dk", "dv")) if key in errors]
        records.append({
            "provider": name, "N": int(n), "d": int(d), "B": int(b), "H": int(h), "mode": m,
            "ms_median": ms[m] if ok else None,
            "tflops": tflops_from_ms(attention_flops(b, h, n, d, m), ms[m]) if ok else None,
            "peak_gib": peak, "peak_extra_gib": extra, "peak_of": peak_of,
            "status": status[m],
            "max_abs_err": max(errs) if errs else None,
            "errors": dict(errors), "tolerance": {"o_abs": tol_o, "grad_rel": tol_g},
        })
    return records


def run_benchmark(
    *,
    seqlens: Sequence[int],
    headdims: Sequence[int],
    providers: Sequence[str],
    modes: Sequence[str],
    tokens: int,
    hidden: int,
    dtype: torch.dtype,
    device: torch.device,
    timer: Timer,
    seed: int = 0,
    inject: dict[str, str] | None = None,
    tol: tuple[float, float] | None = None,
    log: Callable[[str], None] = print,
    on_shape_done: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """Run every (d, N, provider) combination and return the flat list of records (see bench_provider).

    Inputs and the float32 reference are built once per shape and shared by all providers; an input
    allocation that fails marks every provider of that shape with the same status.
    `on_shape_done(records_so_far)` is called after each shape (used to save partial results, so a
    run stopped by a time limit keeps what it measured).
    """
    inject = inject or {}
    tol = tol or TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    need_grads = any(m in ("bwd", "fwdbwd") for m in modes)
    records: list[dict] = []
    for d in headdims:
        for n in seqlens:
            b, h = shape_for(tokens, hidden, n, d)
            log(f"[bench] N={n} d={d} B={b} H={h}")
            try:
                inp = make_inputs(b, h, n, d, device=device, dtype=dtype, seed=seed + 7919 * n + d,
                                  need_grads=need_grads)
            except Exception as exc:
                st = classify_exception(exc)
                for p in providers:
                    for m in modes:
                        records.append({"provider": p, "N": n, "d": d, "B": b, "H": h, "mode": m,
                                        "ms_median": None, "tflops": None, "peak_gib": None,
                                        "peak_extra_gib": None, "status": st, "max_abs_err": None})
                _free(device)
                if on_shape_done:
                    on_shape_done(records)
                continue
            for p in providers:

                def factory(p=p, n=n):
                    fn = build_provider(p, n=n, device=device)
                    return inject_failure(fn, inject[p]) if p in inject else fn

                recs = bench_provider(p, factory, inp, modes=modes, timer=timer, tol=tol)
                for r in recs:
                    t = f"{r['tflops']:.2f} TFLOP/s" if r["tflops"] is not None else "-"
                    log(f"  {p:15s} {r['mode']:7s} {t:>18s}  {r['status'][:90]}")
                records.extend(recs)
            del inp
            _free(device)
            if on_shape_done:
                on_shape_done(records)
    return records


# ------------------------------------------------------------------------------------------------ output


def _fmt(x: float | None, spec: str | None = None) -> str:
    """'—' for None; by default one decimal for values >= 10, else 3 significant digits."""
    if x is None:
        return "—"
    if spec is None:
        spec = ".1f" if abs(x) >= 10 else ".3g"
    return format(x, spec)


def _short_status(status: str) -> str:
    if status == "oom":
        return "OOM"
    if status.startswith("mismatch"):
        return "FAIL"
    if status.startswith("error"):
        return "ERR"
    return status


def _index(records: Sequence[dict]) -> dict[tuple, dict]:
    return {(r["provider"], r["N"], r["d"], r["mode"]): r for r in records}


def _table_modes(modes: Sequence[str]) -> list[str]:
    return [m for m in ("fwd", "bwd") if m in modes] or [m for m in modes]


def _memory_table(records, idx, d, ns, providers, modes) -> list[str]:
    """Markdown lines of the peak-memory table of head dim `d` (cells 'total / above inputs' GiB)."""

    def row(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cells) + " |"

    lines = ["", f"### d = {d}: peak memory of one forward+backward, GiB (total / above inputs)", ""]
    lines.append(row(["N"] + providers))
    lines.append(row(["---:"] * (1 + len(providers))))
    for n in ns:
        cells = [str(n)]
        for p in providers:
            r = next((idx.get((p, n, d, m)) for m in modes if idx.get((p, n, d, m))), None)
            if r is None:
                cells.append("—")
            elif r.get("peak_gib") is None:
                cells.append(_short_status(r["status"]) if r["status"] != "ok" else "—")
            else:
                cells.append(f"{r['peak_gib']:.2f} / {r['peak_extra_gib']:.2f}")
        lines.append(row(cells))
    return lines


def markdown_report(records: Sequence[dict], meta: dict) -> str:
    """Markdown: per head dim, TFLOP/s (rows N, columns providers, cells 'fwd / bwd'), speedup of
    flash over the baselines, peak memory, max abs errors, and a list of failures."""
    idx = _index(records)
    providers = list(dict.fromkeys(r["provider"] for r in records))
    ds = sorted({r["d"] for r in records})
    ns = sorted({r["N"] for r in records})
    modes = list(dict.fromkeys(r["mode"] for r in records))
    tmodes = _table_modes(modes)
    mode_txt = " / ".join(tmodes)
    lines = [
        f"# Causal attention benchmark — {meta.get('gpu') or meta.get('device')} ({meta.get('dtype')})",
        "",
        f"- date {meta.get('date')}, torch {meta.get('torch')}, triton {meta.get('triton')}, "
        f"CUDA {meta.get('cuda')}",
        f"- {meta.get('tokens')} tokens per batch (B = tokens // N), hidden {meta.get('hidden')} "
        f"(H = hidden // d); timing: {meta.get('timing')}",
        f"- FLOPs: {meta.get('flops')}",
        "- cells: OOM = out of memory, ERR = cannot run, FAIL = wrong result vs float32 reference "
        "(not timed), — = not measured",
    ]
    for inv in meta.get("invocations") or ():
        lines.append(f"- merged (`--merge`): N = {inv.get('seqlens')}, d = {inv.get('headdims')}, providers "
                     f"{inv.get('providers')}, modes {inv.get('modes') or list(MODES)} measured "
                     f"{inv.get('date')} (torch {inv.get('torch')}, triton {inv.get('triton')})")
    if meta.get("complete") is False:
        lines.append("- **incomplete**: the last invocation stopped before measuring every shape it lists")
    if meta.get("dry_run"):
        lines.append("- **dry run** (CPU plumbing check): numbers are meaningless")

    def row(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cells) + " |"

    for d in ds:
        lines += ["", f"## d = {d}: TFLOP/s ({mode_txt})", ""]
        lines.append(row(["N", "B×H"] + providers))
        lines.append(row(["---:"] * (2 + len(providers))))
        for n in ns:
            any_rec = next((r for r in records if r["N"] == n and r["d"] == d), None)
            bh = f"{any_rec['B']}×{any_rec['H']}" if any_rec else "—"
            cells = [str(n), bh]
            for p in providers:
                parts = []
                for m in tmodes:
                    r = idx.get((p, n, d, m))
                    if r is None:
                        parts.append("—")
                    elif r["status"] != "ok":
                        parts.append(_short_status(r["status"]))
                    else:
                        parts.append(_fmt(r["tflops"]))
                cells.append(" / ".join(parts))
            lines.append(row(cells))

        # speedup of flash over the baselines
        if "flash" in providers:
            bases = [p for p in SPEEDUP_BASELINES if p in providers]
            bases += [p for p in providers if p not in bases and p != "flash"]
            if bases:
                lines += ["", f"### d = {d}: speedup of flash (TFLOP/s ratio, {mode_txt})", ""]
                lines.append(row(["N"] + [f"vs {p}" for p in bases]))
                lines.append(row(["---:"] * (1 + len(bases))))
                for n in ns:
                    cells = [str(n)]
                    for p in bases:
                        parts = []
                        for m in tmodes:
                            a, bb = idx.get(("flash", n, d, m)), idx.get((p, n, d, m))
                            if a and bb and a["tflops"] and bb["tflops"]:
                                parts.append(f"{a['tflops'] / bb['tflops']:.2f}×")
                            elif bb is not None and bb["status"] != "ok":
                                parts.append(_short_status(bb["status"]))
                            else:
                                parts.append("—")
                        cells.append(" / ".join(parts))
                    lines.append(row(cells))

        # peak memory
        if not any(r.get("peak_gib") is not None for r in records):
            lines += ["", f"### d = {d}: peak memory not measured (needs CUDA)"]
        else:
            lines += _memory_table(records, idx, d, ns, providers, modes)

        # errors
        lines += ["", f"### d = {d}: max abs error vs float32 reference (O / grads)", ""]
        lines.append(row(["N"] + providers))
        lines.append(row(["---:"] * (1 + len(providers))))
        for n in ns:
            cells = [str(n)]
            for p in providers:
                r = next((idx.get((p, n, d, m)) for m in modes if idx.get((p, n, d, m))), None)
                errs = (r or {}).get("errors") or {}
                go = errs.get("o")
                gg = [errs[x] for x in ("dq", "dk", "dv") if x in errs]
                cells.append(f"{_fmt(go, '.2e')} / {_fmt(max(gg) if gg else None, '.2e')}")
            lines.append(row(cells))

    notes = {}
    for r in records:
        if r["status"] != "ok":
            notes.setdefault((r["provider"], r["d"], r["status"]), []).append((r["N"], r["mode"]))
    if notes:
        lines += ["", "## Failures", ""]
        for (p, d, st), where in notes.items():
            ns_txt = ",".join(str(x) for x in sorted({w[0] for w in where}))
            ms_txt = ",".join(dict.fromkeys(w[1] for w in where))
            lines.append(f"- {p} d={d} N={ns_txt} ({ms_txt}): {st}")
    return "\n".join(lines) + "\n"


def plot_report(records: Sequence[dict], path: str | Path, title: str = "") -> Path:
    """PNG: rows = head dims; columns = TFLOP/s vs N for fwd and bwd (fwdbwd when neither ran), then
    peak memory vs N (when measured, i.e. on CUDA); one line per provider, log2 x-axis, failures
    marked with 'x' at the top of the panel."""
    from bench import _plot

    providers = list(dict.fromkeys(r["provider"] for r in records))
    ds = sorted({r["d"] for r in records}) or [0]
    ns = sorted({r["N"] for r in records})
    modes = _table_modes(list(dict.fromkeys(r["mode"] for r in records)))
    idx = _index(records)
    has_mem = any(r.get("peak_gib") is not None for r in records)
    panels = modes + (["mem"] if has_mem else [])
    fig, axes = _plot.subplots(len(ds), len(panels))
    colors = {p: f"C{i % 10}" for i, p in enumerate(providers)}
    for i, d in enumerate(ds):
        for j, m in enumerate(panels):
            ax = axes[i][j]
            rec_mode = m if m != "mem" else modes[0]
            failures: list[tuple[list[int], str, str]] = []
            for p in providers:
                xs, ys, failed = [], [], []
                for n in ns:
                    r = idx.get((p, n, d, rec_mode))
                    if r is None:
                        continue
                    y = r["tflops"] if m != "mem" else r.get("peak_gib")
                    if r["status"] != "ok":
                        failed.append((n, _short_status(r["status"])))
                    elif y is not None:
                        xs.append(n)
                        ys.append(y)
                if xs:
                    ax.plot(xs, ys, marker="o", ms=3, label=p, color=colors[p])
                if failed:
                    kinds = "/".join(dict.fromkeys(f[1] for f in failed))
                    failures.append(([f[0] for f in failed], f"{p} {kinds}", colors[p]))
            _plot.log2_xaxis(ax, ns)
            ax.set_xlabel("sequence length N")
            if m == "mem":  # quadratic (naive) vs linear memory: log scale keeps both readable
                ax.set_ylabel("peak GiB (fwd+bwd)")
                if ax.lines:
                    ax.set_yscale("log", base=2)
            else:
                ax.set_ylabel("TFLOP/s")
                ax.set_ylim(bottom=0)
            if failures:
                _plot.headroom(ax, 0.05 * (len(failures) + 1))
            for level, (xs, label, color) in enumerate(failures):
                _plot.mark_failed(ax, xs, label, color, level=level)
            ax.set_title(f"d={d} {m if m != 'mem' else 'peak memory'}")
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    return _plot.save(fig, path, title)


def collect_metadata(device: torch.device, dtype: torch.dtype, **extra) -> dict:
    """Versions and device facts (no hostname): GPU name, torch/triton/CUDA/cuDNN versions, ISO date."""
    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = None
    try:
        cudnn = torch.backends.cudnn.version()
    except Exception:
        cudnn = None
    from kernels import interpret_enabled  # the kernels' own test, so the record says what they ran

    meta = {
        "benchmark": "causal self-attention, bench.attention",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device.type,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "python": platform.python_version(),
        "dtype": str(dtype).replace("torch.", ""),
        "triton_interpret": interpret_enabled(),
        "flops": "fwd = 2*B*H*N^2*d (causal half of 4*B*H*N^2*d); bwd = 2.5*fwd; fwdbwd = 3.5*fwd",
        "check": "O and dQ/dK/dV vs float32 reference (bench.attention.reference_attention) on "
                 "(batch, head) pairs from check_pairs(B, H); tolerances: O abs, grads relative to "
                 "max(1, max|ref|)",
    }
    meta.update(extra)
    return meta


def default_tag(device: torch.device) -> str:
    """'h200' on an H200, else a lowercase slug of the GPU name, 'cpu' without CUDA."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device)
    if "H200" in name.upper():
        return "h200"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def output_paths(out_dir: str | Path, tag: str) -> dict[str, Path]:
    """{'json'|'md'|'png': out_dir/attention_<tag>.<ext>}."""
    return {ext: Path(out_dir) / f"attention_{tag}.{ext}" for ext in ("json", "md", "png")}


def merge_records(old: Sequence[dict], new: Sequence[dict]) -> list[dict]:
    """`old` records with those of the same (provider, N, d, mode) replaced by `new` ones, plus the
    remaining new records appended (lets a sweep be split over several invocations with one tag)."""
    key = lambda r: (r["provider"], r["N"], r["d"], r["mode"])
    fresh = {key(r): r for r in new}
    merged = [fresh.pop(key(r), r) for r in old]
    return merged + [r for r in new if key(r) in fresh]


_INVOCATION_KEYS = ("date", "seqlens", "headdims", "providers", "modes", "torch", "triton", "gpu")
# settings that make rows of two invocations incomparable (a merged table has one header for them)
_MERGE_MUST_MATCH = ("device", "gpu", "dtype", "tokens", "hidden", "dry_run")


def read_for_merge(path: Path) -> tuple[list[dict], dict]:
    """(records, metadata) of an existing results JSON, checked to have the shape this script writes.
    Raises ValueError (with what is wrong) for invalid JSON or another structure; OSError if unreadable."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("records"), list):
        raise ValueError('expected an object with a "records" list')
    meta = data.get("metadata", {})
    if not isinstance(meta, dict):
        raise ValueError('"metadata" must be an object')

    def is_int(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    def is_str(x) -> bool:
        return isinstance(x, str)

    for r in data["records"]:
        if not (isinstance(r, dict) and is_str(r.get("provider")) and is_str(r.get("mode"))
                and is_int(r.get("N")) and is_int(r.get("d"))):
            raise ValueError(f"a record needs provider, mode (strings), N, d (integers): {str(r)[:80]}")
    invocations = meta.get("invocations", [])
    if not isinstance(invocations, list) or not all(isinstance(m, dict) for m in invocations):
        raise ValueError('"metadata.invocations" must be a list of objects')
    for m in (meta, *invocations):
        for key, ok in (("seqlens", is_int), ("headdims", is_int), ("providers", is_str), ("modes", is_str)):
            if key in m and not (isinstance(m[key], list) and all(ok(x) for x in m[key])):
                kind = "integers" if ok is is_int else "strings"
                raise ValueError(f'metadata "{key}" must be a list of {kind}')
    return data["records"], meta


def merge_clash(previous_meta: dict, meta: dict) -> str | None:
    """Which table-wide setting differs between an existing file and this invocation, or None."""
    diffs = [f"{k}={previous_meta[k]!r} (now {meta.get(k)!r})" for k in _MERGE_MUST_MATCH
             if k in previous_meta and previous_meta[k] != meta.get(k)]
    return ", ".join(diffs) or None


def merged_invocations(previous_meta: dict, meta: dict) -> list[dict]:
    """The invocations whose records a merged file holds, oldest first: those listed in `previous_meta`
    (or `previous_meta` itself when it lists none), then this one. An earlier invocation whose every
    (N, d, provider, mode) this one measured again is dropped (none of its rows is left). Each entry: date,
    seqlens, headdims, providers, torch, triton, gpu -- so a merged table says when each row was measured."""
    def cells(m: dict) -> set:
        return {(n, d, p, mode) for n in m.get("seqlens") or () for d in m.get("headdims") or ()
                for p in m.get("providers") or () for mode in m.get("modes") or MODES}

    earlier = previous_meta.get("invocations") or ([previous_meta] if previous_meta else [])
    redone = cells(meta)
    kept = [m for m in earlier if not (cells(m) and cells(m) <= redone)]
    return [{k: m.get(k) for k in _INVOCATION_KEYS} for m in (*kept, meta)]


def write_outputs(records: Sequence[dict], meta: dict, out_dir: str | Path, tag: str,
                  *, png: bool = True) -> dict[str, Path]:
    """Write attention_<tag>.json/.md (and .png unless `png` is False) into `out_dir` (created);
    return the paths written."""
    paths = output_paths(out_dir, tag)
    paths["json"].parent.mkdir(parents=True, exist_ok=True)
    paths["json"].write_text(json.dumps({"metadata": meta, "records": list(records)}, indent=1) + "\n")
    paths["md"].write_text(markdown_report(records, meta))
    if not png:
        del paths["png"]
        return paths
    plot_report(records, paths["png"], title=f"causal attention, {meta.get('gpu') or meta.get('device')}, "
                                              f"{meta.get('dtype')}")
    return paths


# --------------------------------------------------------------------------------------------------- CLI


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _choice_list(valid: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        vals = [x for x in text.replace(" ", "").split(",") if x]
        bad = [x for x in vals if x not in valid]
        if bad or not vals:
            raise argparse.ArgumentTypeError(f"unknown {bad or text!r}; choose from {', '.join(valid)}")
        return vals

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.attention",
        description="Benchmark causal attention providers (TFLOP/s, memory, correctness).",
    )
    p.add_argument("--seqlens", type=_int_list, default=None,
                   help=f"comma list of N (default {','.join(map(str, GPU_SEQLENS))}; dry run 16,32)")
    p.add_argument("--headdims", type=_int_list, default=None,
                   help="comma list of d (default 64,128; dry run 16)")
    p.add_argument("--providers", type=_choice_list(PROVIDERS), default=None,
                   help=f"comma list from {','.join(PROVIDERS)} (default {','.join(GPU_DEFAULT_PROVIDERS)}; "
                        f"dry run {','.join(DRY_RUN_PROVIDERS)})")
    p.add_argument("--modes", type=_choice_list(MODES), default=list(MODES),
                   help="comma list (default fwd,bwd,fwdbwd)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                   help="default bfloat16 (dry run float32)")
    p.add_argument("--tokens", type=int, default=None,
                   help="B*N tokens per shape (default 16384; dry run 64)")
    p.add_argument("--hidden", type=int, default=None, help="H*d (default 2048; dry run 64)")
    p.add_argument("--out", default=None,
                   help="output directory (default bench/results on a GPU; outputs/bench on a CPU, so a "
                        "dry run never lands beside the committed GPU results)")
    p.add_argument("--tag", default=None, help="file tag (default h200 / GPU-name slug / cpu)")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny CPU run to test the plumbing (sets TRITON_INTERPRET=1 for flash)")
    p.add_argument("--device", default=None, help="cuda or cpu (default cuda when available, else cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    p.add_argument("--cpu-reps", type=int, default=3, help="timed repetitions on CPU")
    p.add_argument("--atol-o", type=float, default=None,
                   help="abs tolerance on O vs the float32 reference "
                        "(default bf16 2e-2, fp16 5e-3, fp32 5e-3)")
    p.add_argument("--rtol-grad", type=float, default=None,
                   help="tolerance on dQ/dK/dV relative to max(1, max|ref|) (default bf16 5e-2, fp16 2e-2, "
                        "fp32 1e-2)")
    p.add_argument("--merge", action="store_true",
                   help="merge into an existing attention_<tag>.json (same provider/N/d/mode replaced), "
                        "to split a sweep over several invocations")
    p.add_argument("--inject-failure", action="append", default=[], help=argparse.SUPPRESS)  # PROVIDER[:kind]
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.device is None:
        device = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    else:
        device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch.cuda.is_available() is False; use --dry-run (CPU) or a "
              "CUDA machine", file=sys.stderr)
        return 2
    small = device.type != "cuda"  # CPU: tiny dry-run shapes unless given explicitly
    if args.out is None:
        args.out = "outputs/bench" if small else "bench/results"
    if small and not args.dry_run:
        print("[bench] no CUDA device: running the CPU dry-run configuration", file=sys.stderr)
    if small:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before kernels/triton.jit are imported
    seqlens = args.seqlens or list(DRY_SEQLENS if small else GPU_SEQLENS)
    headdims = args.headdims or list(DRY_HEADDIMS if small else GPU_HEADDIMS)
    providers = args.providers or list(DRY_RUN_PROVIDERS if small else GPU_DEFAULT_PROVIDERS)
    dtype = _DTYPES[args.dtype or ("float32" if small else "bfloat16")]
    tokens = args.tokens or (64 if small else 16384)
    hidden = args.hidden or (64 if small else 2048)
    modes = [m for m in MODES if m in args.modes]
    inject = {}
    for spec in args.inject_failure:
        prov, _, kind = spec.partition(":")
        if prov not in PROVIDERS or (kind or "error") not in _INJECT_KINDS:
            print(f"error: --inject-failure {spec!r}: expected PROVIDER[:{'|'.join(_INJECT_KINDS)}]",
                  file=sys.stderr)
            return 2
        inject[prov] = kind or "error"
    for d in headdims:
        try:
            shape_for(tokens, hidden, seqlens[0], d)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    timer = Timer(device, warmup_ms=args.warmup, rep_ms=args.rep, cpu_reps=args.cpu_reps)
    default_tol = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    tol = (default_tol[0] if args.atol_o is None else args.atol_o,
           default_tol[1] if args.rtol_grad is None else args.rtol_grad)
    tag = args.tag or default_tag(device)
    previous: list[dict] = []
    previous_meta: dict = {}
    if args.merge and output_paths(args.out, tag)["json"].is_file():
        try:
            previous, previous_meta = read_for_merge(output_paths(args.out, tag)["json"])
        except (OSError, ValueError) as exc:
            print(f"error: --merge: cannot read {output_paths(args.out, tag)['json']} ({exc}); "
                  f"fix or move it, or run without --merge", file=sys.stderr)
            return 2
    meta = collect_metadata(
        device, dtype, tag=tag, dry_run=small, tokens=tokens, hidden=hidden, seqlens=seqlens,
        headdims=headdims, providers=providers, modes=modes, timing=timer.describe(), seed=args.seed,
        naive_impl=naive_impl()[1] if "naive" in providers else None,
        tolerance={"o_abs": tol[0], "grad_rel": tol[1]},
        injected_failures=inject or None, merged_with_previous=bool(previous), complete=False,
    )
    if previous:
        clash = merge_clash(previous_meta, meta)
        if clash:
            print(f"error: --merge: {output_paths(args.out, tag)['json']} was measured with {clash}; one "
                  "table must hold comparable rows: use another --tag (or the same settings)",
                  file=sys.stderr)
            return 2
        meta["invocations"] = merged_invocations(previous_meta, meta)

    def save_partial(recs: list[dict]) -> None:
        write_outputs(merge_records(previous, recs), meta, args.out, tag, png=False)

    records = run_benchmark(seqlens=seqlens, headdims=headdims, providers=providers, modes=modes,
                            tokens=tokens, hidden=hidden, dtype=dtype, device=device, timer=timer,
                            seed=args.seed, inject=inject, tol=tol, on_shape_done=save_partial)
    meta["complete"] = True
    paths = write_outputs(merge_records(previous, records), meta, args.out, tag)
    print(paths["md"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
