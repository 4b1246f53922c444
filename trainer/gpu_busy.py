"""GPU-busy fraction of training steps, measured with torch.profiler.

busy = (CUDA kernel, memcpy and memset time on the device) / (wall time of the same steps). A step whose
busy fraction is well below 1 leaves the GPU waiting for the host (Python, launches, data); at 1 the
step is GPU-bound and only faster kernels make it faster. Only CUDA activity is recorded (CUPTI), not
the CPU ops, so the profiler adds little host time; the profiled steps are still left out of the
tokens/sec median. With a trace directory the host side is recorded too (CPU ops, CUDA runtime calls) and
the steps are written as a Chrome trace (``trace_step{first}-{last}.json.gz``, open in
https://ui.perfetto.dev) to see where the GPU waits; the busy fraction of such a run includes the
profiler's host overhead.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch


class GpuBusy:
    """Profile `steps` training steps after the first `skip` steps of this process.

    Usage, once per step: ``with busy.step(steps_done, step):`` around the timed work, then
    ``busy.add_wall(dt)`` with the step's wall time in seconds (only counted for profiled steps). Before work
    that is not a training step (evaluation, parity, a checkpoint) call ``close()``: the window then ends
    with the steps profiled so far, so that work's kernels are never counted without its wall time.
    `summary()` (which closes an open window) gives {"perf/gpu_busy": fraction, "perf/gpu_ms_per_step": ms,
    "perf/profiled_steps": n} once at least one step was profiled, else {}.
    With ``trace_dir`` the host activity is recorded too and the window is written as
    ``trace_dir/trace_step{first}-{last}.json.gz`` (global step numbers, so a resumed run adds its own).
    """

    def __init__(self, skip: int, steps: int, enabled: bool, trace_dir=None) -> None:
        self.skip, self.steps = int(skip), int(steps)
        self.enabled = bool(enabled) and self.steps > 0
        self.trace_dir = trace_dir
        self._prof = None
        self._done = 0
        self._wall_s = 0.0
        self._gpu_us: float | None = None
        self._first = self._last = None  # global steps of the window (trace file name)
        self.active = False

    @contextlib.contextmanager
    def step(self, steps_done: int, step: int | None = None):
        """Profile this step if it falls in the window [skip, skip + steps) of this process's steps and the
        window was not closed early; `step` is the global step number (for the trace file's name)."""
        self.active = self.enabled and self.skip <= steps_done < self.skip + self.steps
        if not self.active:
            yield
            return
        if self._prof is None:
            from torch.profiler import ProfilerActivity, profile

            cpu = [ProfilerActivity.CPU] if self.trace_dir is not None else []
            self._prof = profile(activities=[*cpu, ProfilerActivity.CUDA])
            self._prof.__enter__()
            self._first = step
        self._last = step
        try:
            yield
        except BaseException:
            # a step that raised (non-finite stop, OOM) ran kernels whose wall time is never added: drop the
            # window rather than report a busy fraction inflated by them
            self._discard()
            raise

    def _discard(self) -> None:
        self.active = self.enabled = False
        prof, self._prof = self._prof, None
        if prof is not None:
            try:
                prof.__exit__(None, None, None)
            except Exception:  # noqa: BLE001 - the step's own error is the one to report
                pass
        self._gpu_us, self._done, self._wall_s = None, 0, 0.0

    def add_wall(self, dt: float) -> bool:
        """Record the wall time (s) of the step just run; closes the window after the last one. Returns
        whether that step was profiled (the caller leaves it out of the tokens/sec median)."""
        if not self.active:
            return False
        self._wall_s += dt
        self._done += 1
        if self._done == self.steps:
            self.close()
        return True

    def close(self) -> None:
        """End the profiling window now (no-op when none is open) and allow no other one: the GPU time of
        the steps profiled so far is summed and, with a trace_dir, the trace written."""
        self.active = False
        if self._prof is None:
            return
        self.enabled = False
        prof, self._prof = self._prof, None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        if not self._done:
            return
        self._gpu_us = device_busy_us(prof.events())
        if self.trace_dir is not None:
            name = f"trace_step{self._first}-{self._last}.json.gz"
            prof.export_chrome_trace(str(Path(self.trace_dir) / name))  # gzip for a .gz path

    def summary(self) -> dict:
        """{"perf/gpu_busy", "perf/gpu_ms_per_step", "perf/profiled_steps"} of the profiled steps, or {}."""
        try:
            self.close()  # a run that ended inside its window: report the steps profiled
        except Exception:  # noqa: BLE001 - a failed device (the OOM ending) must not hide the run's ending
            pass
        if self._gpu_us is None or self._wall_s <= 0:
            return {}
        return {
            "perf/gpu_busy": self._gpu_us * 1e-6 / self._wall_s,
            "perf/gpu_ms_per_step": self._gpu_us * 1e-3 / self._done,
            "perf/profiled_steps": self._done,
        }


def device_busy_us(events) -> float:
    """Time in µs during which the device ran at least one kernel, memcpy or memset.

    events: torch.profiler FunctionEvents (``prof.events()``). Device-side events only (host ops, which
    carry their kernels' time again when CPU activity is recorded, are left out), and not the
    ``gpu_user_annotation`` ranges (a ``record_function`` range drawn on the GPU timeline, spanning kernels
    that are counted themselves). The union of the intervals, so kernels that overlap (several streams) or
    an annotation that slipped through are counted once, and busy time never exceeds wall time.
    """
    from torch.autograd import DeviceType

    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)
    )
    total, covered_to = 0.0, float("-inf")
    for start, end in spans:  # by start: each span adds only what lies past the covered time
        if end > covered_to:
            total += end - max(start, covered_to)
            covered_to = end
    return float(total)
