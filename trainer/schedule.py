"""Learning-rate schedule: linear warmup, then cosine decay to ``optim.min_lr`` (nanoGPT's schedule)."""

from __future__ import annotations

import math


def lr_at(step: int, optim, max_steps: int) -> float:
    """Learning rate for update ``step`` (1-based); flat at ``optim.min_lr`` after the decay."""
    warmup = int(optim.warmup_steps)
    decay = int(optim.decay_steps or max_steps)
    if warmup and step <= warmup:
        return float(optim.lr) * step / warmup
    if step >= decay:
        return float(optim.min_lr)
    progress = (step - warmup) / max(1, decay - warmup)
    return float(optim.min_lr) + 0.5 * (1.0 + math.cos(math.pi * progress)) * (
        float(optim.lr) - float(optim.min_lr)
    )
