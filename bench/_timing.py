"""Timing and failure bookkeeping shared by the bench CLIs (`bench.attention`, `bench.decode`,
`bench.tune`): the median wall time of a callable, and the status string of a provider that failed."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


def short_error(exc: BaseException, limit: int = 160) -> str:
    """One-line 'Type: first line of message' (truncated) for a status string."""
    msg = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {msg[0] if msg else ''}".strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def classify_exception(exc: BaseException) -> str:
    """Status for a provider exception: "oom" for torch.cuda.OutOfMemoryError (or any message saying
    "out of memory"), else "error: <Type: first line>"."""
    if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower():
        return "oom"
    return "error: " + short_error(exc)


def free_memory(device: torch.device) -> None:
    """Collect garbage and, on CUDA, return cached blocks to the driver (between providers and shapes)."""
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
            return (
                f"triton.testing.do_bench(return_mode='median', warmup={self.warmup_ms} ms, "
                f"rep={self.rep_ms} ms, grads set to None between reps)"
            )
        return f"time.perf_counter median of {self.cpu_reps} reps after 1 warm-up (CPU dry run)"

    def __call__(self, fn: Callable[[], object], grad_to_none: Sequence[torch.Tensor] | None = None) -> float:
        if self.device.type == "cuda":
            from triton.testing import do_bench

            return float(
                do_bench(
                    fn,
                    warmup=self.warmup_ms,
                    rep=self.rep_ms,
                    grad_to_none=grad_to_none,
                    return_mode="median",
                )
            )
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
