"""What the console says about time: elapsed time and ETA on each step line, and, for a large model or a
large step started on the CPU, how slow that will be (with the pointer to ``experiment=cpu_tiny``)."""

from __future__ import annotations

import time

import torch

#: Models above this many parameters get the CPU warning (GPT-2 small is 124M; experiment=cpu_tiny is 0.81M).
CPU_WARN_PARAMS = 10e6
#: So do steps of more training FLOPs than this (about a minute at a CPU's 100 GFLOP/s; cpu_tiny's: 5e10): a
#: small model with batch.tokens_per_step=268435456 was accepted without a word and took 12+ hours a step.
CPU_WARN_STEP_FLOPS = 6e12


def cpu_warning_due(n_params: int, flops_per_token: float, tokens_per_step: int) -> bool:
    """Whether a CPU run of this model and step gets ``cpu_warning``."""
    return n_params >= CPU_WARN_PARAMS or flops_per_token * tokens_per_step >= CPU_WARN_STEP_FLOPS


def format_duration(seconds: float) -> str:
    """``seconds`` as ``45s``, ``12m05s``, ``3h20m`` or ``2d04h`` (rounded down; negative reads 0s)."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


class Clock:
    """``elapsed`` and ``eta`` for the console line. The ETA follows the time per step between lines: the
    first window holds one-time costs (compile, warm-up), so the second replaces it, later ones weigh 0.3."""

    def __init__(self, first_step: int) -> None:
        self.t0 = time.perf_counter()
        self.last = (self.t0, first_step)  # (time, step) of the previous line
        self.windows, self.per_step = 0, float("nan")

    def text(self, step: int, max_steps: int) -> str:
        now = time.perf_counter()
        (t_prev, s_prev), self.last = self.last, (now, step)
        if step > s_prev:
            rate = (now - t_prev) / (step - s_prev)
            self.windows += 1
            self.per_step = rate if self.windows <= 2 else 0.7 * self.per_step + 0.3 * rate
        eta = self.per_step * (max_steps - step)
        return f"elapsed {format_duration(now - self.t0)} | eta {format_duration(eta) if eta == eta else '?'}"


def matmul_flops(device: torch.device, n: int = 512, reps: int = 4) -> float:
    """Measured float32 matmul FLOP/s of ``device`` (an upper bound for training); global RNGs untouched."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=gen)
    a @ a
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ a
    return 2.0 * n**3 * reps / max(time.perf_counter() - t0, 1e-9)


def evaluates_after(s: int, every: int, max_steps: int) -> bool:
    """Whether the loop evaluates after update ``s``: every ``every`` updates (0: none between), the last."""
    return (every > 0 and s % every == 0) or s == max_steps


def evals_left(step: int, max_steps: int, every: int, at_start: bool) -> int:
    """Evaluations a run at ``step`` still makes: step 0's (``at_start``), then those ``evaluates_after``."""
    later = sum(evaluates_after(s, every, max_steps) for s in range(step + 1, max_steps + 1))
    return int(at_start and step == 0 < max_steps) + later


def cpu_warning(
    n_params: int,
    flops_per_token: float,
    tokens_per_step: int,
    max_steps: int,
    flops_per_s: float,
    step: int = 0,
    evals: int = 0,
    eval_tokens: int = 0,
) -> str | None:
    """The warning for a model of ``n_params`` trained on the CPU (None unless ``cpu_warning_due``): the steps
    left at the model's training FLOPs (PaLM appendix B) and the CPU's measured matmul speed, plus ``evals``
    evaluations of ``eval_tokens`` at a third of that (forward only; GPT-2's outlasts ten steps)."""
    if not cpu_warning_due(n_params, flops_per_token, tokens_per_step):
        return None
    step_s = flops_per_token * tokens_per_step / flops_per_s
    eval_s = flops_per_token / 3 * eval_tokens / flops_per_s
    left = max(0, max_steps - step)
    steps = (
        f"max_steps={max_steps} takes"
        if step == 0
        else f"the {left} steps left of max_steps={max_steps} (resumed at step {step}) take"
    )
    return (
        f"warning: a {n_params / 1e6:.0f}M-parameter model on the CPU: at least {format_duration(step_s)} "
        f"per step ({tokens_per_step:,} tokens at this CPU's measured {flops_per_s / 1e9:.0f} GFLOP/s), "
        f"so {steps} at least {format_duration(step_s * left + eval_s * evals)}"
        + (
            f", its {evals} evaluation{'s' if evals > 1 else ''} of {eval_tokens:,} tokens included "
            f"({format_duration(eval_s)} each)"
            if evals
            else ""
        )
        + ". For a CPU try-out "
        "use experiment=cpu_tiny (a 0.8M-parameter char-level GPT, about 4 minutes, 2,048 tokens a step); "
        "train this model and batch on a CUDA GPU"
    )
