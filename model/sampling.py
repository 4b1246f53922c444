"""Next-token choice from logits: greedy, temperature, top-k and top-p (nucleus) sampling.

Top-p follows Holtzman et al. 2020 ("The Curious Case of Neural Text Degeneration", section 3.1): keep the
smallest set of most likely tokens whose probabilities sum to at least p, renormalise, sample.
"""

from __future__ import annotations

import torch

__all__ = ["check_sampling_args", "sample_next"]


def check_sampling_args(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Raise ValueError naming the key and a valid value for an invalid sampling setting."""
    if not float(temperature) >= 0.0:  # also catches NaN
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}; e.g. temperature=0.8")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be an int >= 1 or null (no top-k), got {top_k!r}; e.g. top_k=200")
    if top_p is not None and not 0.0 < float(top_p) <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] or null (no top-p), got {top_p!r}; e.g. top_p=0.9")


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token id per row of logits (B, V): (B, 1) int64. temperature 0 is greedy (top_k / top_p then
    ignored); top_k keeps the k largest logits (ties at the k-th kept), top_p the nucleus."""
    check_sampling_args(temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / float(temperature)
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the more likely ones already reach top_p (the most likely is always kept)
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= float(top_p)
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)
