"""Our FlashAttention kernels: Triton FlashAttention-2 (Dao 2023), FlashAttention-3-style Gluon kernels on
sm_90, and flash-decoding. docs/kernels.md describes the API, the algorithms and the files.

The `@triton.jit` kernels are imported at the first launch: TRITON_INTERPRET at that moment decides, for
the whole process, between compiler and interpreter (set it before the first flash call to run on the CPU).
"""

from ._runtime import FlashAttentionUnavailableError, check_flash_available, interpret_enabled
from .flash_attn import (
    MAX_HEAD_DIM,
    MIN_HEAD_DIM,
    document_ranges,
    dropout_keep_mask,
    flash_attention,
    flash_attention_qkvpacked,
)
from .flash_decode import flash_decode
from .plan import MAX_DECODE_ROWS, TileConfig, get_tile_config, override_tile_config
from .plan import describe as describe_plan

__all__ = [
    "FlashAttentionUnavailableError",
    "MAX_DECODE_ROWS",
    "MAX_HEAD_DIM",
    "MIN_HEAD_DIM",
    "TileConfig",
    "check_flash_available",
    "describe_plan",
    "document_ranges",
    "dropout_keep_mask",
    "flash_attention",
    "flash_attention_qkvpacked",
    "flash_decode",
    "get_tile_config",
    "interpret_enabled",
    "override_tile_config",
]
