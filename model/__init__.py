"""GPT-2 with swappable attention backends (naive / PyTorch SDPA / our Triton flash kernels).

To change the model open ``model/gpt.py``; the attention backends: ``model/attention.py``; generation and
the KV cache: ``model/generate.py``; the config and size presets: ``model/config.py``.
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
