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
    """Median wall time of a callable in ms: triton.testing.do_bench on CUDA, perf_counter on CPU.

    ``slow_ms`` (CUDA, off by default): a call that takes at least that long after one warm-up call is
    timed as the median of ``slow_reps`` calls between CUDA events instead. do_bench would call it about
    ``5 + (warmup + rep) / time`` more times (5 to estimate, then the warm-up and the reps: 9 calls of a
    50 ms call to return the median of 2), and at such lengths the per-call L2 flush it adds is moot (the
    call reads far more than the L2 holds) and launch jitter is a fraction of a percent.
    """

    device: torch.device
    warmup_ms: int = 25
    rep_ms: int = 100
    cpu_reps: int = 3
    slow_ms: float | None = None
    slow_reps: int = 3

    def describe(self) -> str:
        if self.device.type == "cuda":
            slow = (
                f"; calls of >= {self.slow_ms} ms: median of {self.slow_reps} event-timed calls"
                if self.slow_ms is not None
                else ""
            )
            return (
                f"triton.testing.do_bench(return_mode='median', warmup={self.warmup_ms} ms, "
                f"rep={self.rep_ms} ms, grads set to None between reps){slow}"
            )
        return f"time.perf_counter median of {self.cpu_reps} reps after 1 warm-up (CPU dry run)"

    def _event_times(self, fn: Callable[[], object], n: int, grad_to_none) -> list[float]:
        times = []
        for _ in range(n):
            for t in grad_to_none or ():
                t.grad = None
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return times

    def __call__(self, fn: Callable[[], object], grad_to_none: Sequence[torch.Tensor] | None = None) -> float:
        if self.device.type == "cuda":
            from triton.testing import do_bench

            if self.slow_ms is not None:
                fn()  # warm-up (compilation, allocator); do_bench makes the same first call
                first = self._event_times(fn, 1, grad_to_none)
                if first[0] >= self.slow_ms:
                    rest = self._event_times(fn, max(0, self.slow_reps - 1), grad_to_none)
                    return float(statistics.median(first + rest))
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
