"""Rotary position embeddings (RoPE; Su et al. 2021, "RoFormer", section 3.4), ``GPTConfig.pos_emb="rope"``.

q and k of each head are rotated by angles proportional to the token's position, so the score q_i . k_j
depends on the positions only through i - j. Pair m is (x[m], x[m + d/2]) as in GPT-NeoX, not interleaved
neighbours as in the paper: the same function up to a fixed permutation of features, with contiguous loads.
The angles come from each forward's positions in float64 (no table, so the KV cache's decode steps need
none): at position 8191 the fastest pair's angle is 8191 rad, where float32's spacing is 0.001 rad.
"""

from __future__ import annotations

import torch

__all__ = ["apply_rope", "rope_cos_sin"]


def rope_cos_sin(pos: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype = torch.float32):
    """cos and sin of the angles of positions ``pos`` ((T,), or (B, 1) for a static decode step), each
    pos.shape + (1, head_dim // 2) in ``dtype``: broadcastable against q, k (B, T, H, d/2)."""
    inv_freq = theta ** (
        -torch.arange(0, head_dim, 2, dtype=torch.float64, device=pos.device) / head_dim
    )  # (d/2,)
    angles = pos.to(torch.float64)[..., None] * inv_freq  # (T, d/2) or (B, 1, d/2)
    angles = angles.unsqueeze(-2)  # a head axis: (T, 1, d/2) or (B, 1, 1, d/2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, H, d) rotated by the angles of ``rope_cos_sin``, computed in cos's dtype, returned in x's."""
    x1, x2 = x.to(cos.dtype).chunk(2, dim=-1)  # (B, T, H, d/2) each: the real and imaginary parts
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.to(x.dtype)
