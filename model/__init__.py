"""GPT-2 model with swappable attention backends (naive / PyTorch SDPA / our Triton flash kernel).

Re-exports ``GPT``, ``GPTConfig``, ``PRESETS`` (from ``model.gpt``) and ``attention``,
``ATTENTION_BACKENDS``, ``SDPA_BACKENDS`` (from ``model.attention``).
"""

from .attention import (
    ATTENTION_BACKENDS,
    SDPA_BACKENDS,
    attention,
    available_attention_backends,
    register_attention_backend,
    sdpa_backend_that_ran,
)
from .gpt import GPT, PRESETS, GPTConfig

__all__ = [
    "ATTENTION_BACKENDS",
    "GPT",
    "PRESETS",
    "SDPA_BACKENDS",
    "GPTConfig",
    "attention",
    "available_attention_backends",
    "register_attention_backend",
    "sdpa_backend_that_ran",
]
