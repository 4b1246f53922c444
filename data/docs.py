"""Documents in a token stream: the separator between them, and per-token document ids (document masking).

A corpus prepared with ``data.doc_separator`` is a sequence of documents, each followed by the separator
token sequence ``sep`` (``meta["doc_separator_ids"]``): one end-of-text token (50256) for the GPT-2 BPE,
the separator's characters for the char tokenizer. A separator ends at token t when
``tokens[t - L + 1 : t + 1] == sep``; the next document starts at t + 1 (prepare, loader and model agree).

Per-token ids inside a window are relative: 0 for the window's first token, +1 after every separator end.
The loader (whole split) and the model (the window only) differ only when a multi-token separator
straddles the window's first position.
"""

from __future__ import annotations

import re

import numpy as np
import torch

__all__ = ["GPT2_EOT", "doc_ids_from_tokens", "parse_separator", "separator_ends", "separator_ids"]

GPT2_EOT = 50256  # <|endoftext|> of the GPT-2 BPE
_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def parse_separator(separator: str | None) -> str | None:
    """The separator with the escapes \\n, \\t and \\\\ turned into their characters (Hydra passes
    ``data.doc_separator='\\n\\n'`` through literally)."""
    return None if separator is None else re.sub(r"\\([nt\\])", lambda m: _ESCAPES[m[1]], separator)


def separator_ids(tokenizer_name: str, separator: str, tok) -> list[int]:
    """Token ids written between documents: [GPT2_EOT] for "gpt2", the separator's characters for "char"."""
    if not isinstance(separator, str) or not separator:
        raise ValueError(f"doc_separator must be a non-empty string, got {separator!r}")
    if tokenizer_name == "gpt2":
        return [GPT2_EOT]
    return [int(t) for t in tok.encode(separator)]


def _ends(tokens, sep, ends):
    """``ends`` (zeros like ``tokens``, numpy or torch) set True where a separator ends, on the last axis."""
    n, length = tokens.shape[-1], len(sep)
    if n >= length:
        hit = tokens[..., length - 1 :] == sep[-1]
        for k, s in enumerate(sep[:-1]):
            hit &= tokens[..., k : n - length + 1 + k] == s
        ends[..., length - 1 :] = hit
    return ends


def separator_ends(tokens: np.ndarray, sep: list[int] | tuple[int, ...]) -> np.ndarray:
    """Bool array like ``tokens``: True at each position where a separator ends."""
    tokens = np.asarray(tokens)
    return _ends(tokens, sep, np.zeros(tokens.shape, dtype=bool))


def doc_ids_from_tokens(idx: torch.Tensor, sep: list[int] | tuple[int, ...]) -> torch.Tensor:
    """Relative document ids (B, N) int32 of token windows (B, N): the number of separator ends before
    each position (0 at t = 0, non-decreasing, as the flash kernels need). Traceable, on idx's device."""
    ends = _ends(idx, sep, torch.zeros(idx.shape, dtype=torch.bool, device=idx.device)).to(torch.int32)
    return (torch.cumsum(ends, dim=-1, dtype=torch.int32) - ends).to(torch.int32)
