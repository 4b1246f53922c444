"""Our Triton FlashAttention-2 (Dao 2023, sections 3.1/3.2).

Public API:
* `flash_attention(q, k, v, *, causal=True, softmax_scale=None, return_lse=False)`
* `check_flash_available(device)` -> None or raises FlashAttentionUnavailableError (a RuntimeError)
* custom ops `torch.ops.flashgpt.flash_attn_fwd` / `torch.ops.flashgpt.flash_attn_bwd`
* tile configuration: `kernels.tiles.get_tile_config` (one place to tune block sizes)
"""

from .flash_attn import (
    FlashAttentionUnavailableError,
    check_flash_available,
    flash_attention,
    interpret_enabled,
)
from .tiles import TileConfig, get_tile_config, override_tile_config

__all__ = [
    "FlashAttentionUnavailableError",
    "TileConfig",
    "check_flash_available",
    "flash_attention",
    "get_tile_config",
    "interpret_enabled",
    "override_tile_config",
]
