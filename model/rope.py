"""Rotary position embeddings (RoPE; Su et al. 2021, "RoFormer", section 3.4), ``GPTConfig.pos_emb="rope"``.

Each head's query and key vectors are rotated by an angle proportional to the token's position, so the
score q_i . k_j depends on the positions only through i - j. Pairs are the two halves of the head
(x[:d/2], x[d/2:]) as in GPT-NeoX, not interleaved neighbours (x[2m], x[2m+1]) as in the RoFormer paper:
the same function up to a fixed permutation of q's and k's features, and two contiguous halves instead of
strided gathers. As a complex number z_m = x[m] + i x[m + d/2], pair m at position p becomes

    z_m * exp(i p theta^(-2m/d)),   m = 0 .. d/2 - 1.

The angles are computed in float64 from the positions of each forward (so a KV cache's decode step and
the sliding recomputation past block_size need no table of block_size rows): at position 8191 the angle
of the fastest pair is 8191 rad, where float32's spacing is 0.001 rad, an error float64 avoids.
"""

from __future__ import annotations

import torch

__all__ = ["apply_rope", "rope_cos_sin"]


def rope_cos_sin(pos: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype = torch.float32):
    """cos and sin of the rotation angles of positions ``pos`` ((T,), or (B, 1) for a static decode step),
    each of shape pos.shape + (1, head_dim // 2) in ``dtype``: broadcastable against q, k (B, T, H, d/2)."""
    inv_freq = theta ** (
        -torch.arange(0, head_dim, 2, dtype=torch.float64, device=pos.device) / head_dim
    )  # (d/2,)
    angles = pos.to(torch.float64)[..., None] * inv_freq  # (T, d/2) or (B, 1, d/2)
    angles = angles.unsqueeze(-2)  # a head axis: (T, 1, d/2) or (B, 1, 1, d/2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, H, d) rotated pairwise by the angles of ``rope_cos_sin``; computed in cos's dtype (float32
    for float16/bfloat16 x), returned in x.dtype."""
    x1, x2 = x.to(cos.dtype).chunk(2, dim=-1)  # (B, T, H, d/2) each: the real and imaginary parts
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.to(x.dtype)
