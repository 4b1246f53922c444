"""GPU-busy fraction of training steps, measured with torch.profiler.

busy = (CUDA kernel, memcpy and memset time on the device) / (wall time of the same steps). A step whose
busy fraction is well below 1 leaves the GPU waiting for the host (Python, launches, data); at 1 the
step is GPU-bound and only faster kernels make it faster. Only CUDA activity is recorded (CUPTI), not
the CPU ops, so the profiler adds little host time; the profiled steps are still left out of the
tokens/sec median. With ``trace`` the host side is recorded too (CPU ops, CUDA runtime calls) and the
steps are written as a Chrome trace (``trace.json.gz``, open in https://ui.perfetto.dev) to see where
the GPU waits; the busy fraction of such a run includes the profiler's host overhead.
"""

from __future__ import annotations

import contextlib

import torch


class GpuBusy:
    """Profile `steps` training steps after the first `skip` steps of this process.

    Usage, once per step: ``with busy.step(steps_done):`` around the timed work, then
    ``busy.add_wall(dt)`` with the step's wall time in seconds (only counted for profiled steps).
    `summary()` gives {"perf/gpu_busy": fraction, "perf/gpu_ms_per_step": ms, "perf/profiled_steps": n}
    once the window is complete, else {}.
    """

    def __init__(self, skip: int, steps: int, enabled: bool, trace_path=None) -> None:
        self.skip, self.steps = int(skip), int(steps)
        self.enabled = bool(enabled) and self.steps > 0
        self.trace_path = trace_path  # a .json.gz path: record host activity too and export there
        self._prof = None
        self._done = 0
        self._wall_s = 0.0
        self._gpu_us: float | None = None
        self.active = False

    @contextlib.contextmanager
    def step(self, steps_done: int):
        """Profile this step if it falls in the window [skip, skip + steps) of this process's steps."""
        self.active = self.enabled and self.skip <= steps_done < self.skip + self.steps
        if not self.active:
            yield
            return
        if self._prof is None:
            from torch.profiler import ProfilerActivity, profile

            cpu = [ProfilerActivity.CPU] if self.trace_path is not None else []
            self._prof = profile(activities=[*cpu, ProfilerActivity.CUDA])
            self._prof.__enter__()
        yield

    def add_wall(self, dt: float) -> None:
        """Record the wall time (s) of the step just run; closes the window after the last one."""
        if not self.active:
            return
        self._wall_s += dt
        self._done += 1
        if self._done == self.steps:
            torch.cuda.synchronize()
            self._prof.__exit__(None, None, None)
            # self time of device-side events: kernels, memcpy, memset (each counted once; with host activity
            # recorded, the CPU ops that launched them carry the same time again: left out)
            from torch.autograd import DeviceType

            self._gpu_us = sum(
                e.self_device_time_total for e in self._prof.key_averages() if e.device_type != DeviceType.CPU
            )
            if self.trace_path is not None:
                self._prof.export_chrome_trace(str(self.trace_path))  # gzip for a .gz path
            self._prof = None

    def summary(self) -> dict:
        if self._gpu_us is None or self._wall_s <= 0:
            return {}
        return {
            "perf/gpu_busy": self._gpu_us * 1e-6 / self._wall_s,
            "perf/gpu_ms_per_step": self._gpu_us * 1e-3 / self._done,
            "perf/profiled_steps": self._done,
        }
