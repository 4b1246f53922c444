"""GPU-busy fraction of training steps (torch.profiler): device kernel/memcpy/memset time over the steps'
wall time. Below 1 the GPU waits for the host; with a trace directory the window is also written as a
Chrome trace (``trace_step{first}-{last}.json.gz``, https://ui.perfetto.dev)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch


class GpuBusy:
    """Profile `steps` training steps after the first `skip` steps of this process."""

    def __init__(self, skip: int, steps: int, enabled: bool, trace_dir=None) -> None:
        self.skip, self.steps = int(skip), int(steps)
        self.enabled, self.active = bool(enabled) and self.steps > 0, False
        self.trace_dir, self._prof, self._done, self._wall_s = trace_dir, None, 0, 0.0
        self._gpu_us: float | None = None
        self._first = self._last = None  # global steps of the window (trace file name)

    @contextlib.contextmanager
    def step(self, steps_done: int, step: int | None = None):
        """Profile this step if it falls in the window [skip, skip + steps) of this process's steps (and the
        window was not closed early); ``step``: the global step, for the trace file's name."""
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
            self.active = self.enabled = False
            prof, self._prof = self._prof, None
            with contextlib.suppress(Exception):  # the step's own error is the one to report
                prof.__exit__(None, None, None)
            self._gpu_us, self._done, self._wall_s = None, 0, 0.0
            raise

    def add_wall(self, dt: float) -> bool:
        """Add the wall time (s) of the step just run (closing the window after its last); whether it was
        profiled (then left out of the tokens/sec median)."""
        if not self.active:
            return False
        self._wall_s, self._done = self._wall_s + dt, self._done + 1
        if self._done == self.steps:
            self.close()
        return True

    def close(self) -> None:
        """End the profiling window now, if open, and allow no other: sum the GPU time of the steps profiled
        so far and, with a trace_dir, write the trace."""
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
        # a run that ended inside its window: report the steps profiled; a failed device (the OOM ending)
        # must not hide the run's ending
        with contextlib.suppress(Exception):
            self.close()
        if self._gpu_us is None or self._wall_s <= 0:
            return {}
        return {
            "perf/gpu_busy": self._gpu_us * 1e-6 / self._wall_s,
            "perf/gpu_ms_per_step": self._gpu_us * 1e-3 / self._done,
            "perf/profiled_steps": self._done,
        }


def device_busy_us(events) -> float:
    """Time in µs during which the device ran at least one kernel, memcpy or memset."""
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
