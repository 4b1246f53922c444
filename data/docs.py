"""Documents in a token stream: where they start, and per-token document ids (for document masking).

A corpus prepared with ``data.doc_separator`` (``python -m data.prepare --doc-separator``) is a sequence of
documents, each followed by a separator token sequence ``sep`` recorded in ``meta["doc_separator_ids"]``:
the GPT-2 BPE writes one end-of-text token (``<|endoftext|>``, id 50256) between documents instead of the
separator text; the char tokenizer (which has no end-of-text token) keeps the separator's characters.
The rule, the same everywhere (prepare, loader, model): a separator ends at token t when
``tokens[t - L + 1 : t + 1] == sep`` (L = len(sep)); the next document starts at t + 1. The separator belongs
to the document it ends.

Per-token ids inside a window are relative: id 0 for the window's first token, +1 after every separator end.
The loader (which sees the whole split) and the model (which sees the window only) give the same ids except
when a multi-token separator straddles the window's first position (the model cannot see its first part).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["GPT2_EOT", "doc_ids_from_tokens", "parse_separator", "separator_ends", "separator_ids"]

GPT2_EOT = 50256  # <|endoftext|> of the GPT-2 BPE


def parse_separator(separator: str | None) -> str | None:
    """The separator as typed on a command line or in YAML, with the escapes \\n, \\t and \\\\ turned into
    a newline, a tab and a backslash (Hydra passes ``data.doc_separator='\\n\\n'`` through literally)."""
    if separator is None or "\\" not in separator:
        return separator
    out, i = [], 0
    while i < len(separator):
        c = separator[i]
        if c == "\\" and i + 1 < len(separator) and separator[i + 1] in "nt\\":
            out.append({"n": "\n", "t": "\t", "\\": "\\"}[separator[i + 1]])
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def separator_ids(tokenizer_name: str, separator: str, tok) -> list[int]:
    """Token ids written between documents: [GPT2_EOT] for "gpt2", the separator's characters for "char".

    Raises ValueError for an empty separator or one the char vocabulary cannot encode.
    """
    if not isinstance(separator, str) or not separator:
        raise ValueError(f"doc_separator must be a non-empty string, got {separator!r}")
    if tokenizer_name == "gpt2":
        return [GPT2_EOT]
    return [int(t) for t in tok.encode(separator)]


def separator_ends(tokens: np.ndarray, sep: list[int] | tuple[int, ...]) -> np.ndarray:
    """Bool array like ``tokens`` (1-D): True at each position t where a separator ends (see module doc)."""
    tokens = np.asarray(tokens)
    n, length = tokens.shape[-1], len(sep)
    ends = np.zeros(tokens.shape, dtype=bool)
    if n < length:
        return ends
    hit = np.ones(tokens[..., length - 1 :].shape, dtype=bool)
    for k, s in enumerate(sep):
        hit &= tokens[..., k : n - length + 1 + k] == s
    ends[..., length - 1 :] = hit
    return ends


def doc_ids_from_tokens(idx: torch.Tensor, sep: list[int] | tuple[int, ...]) -> torch.Tensor:
    """Relative document ids (B, N) int32 of a batch of token windows (B, N), from the tokens alone.

    id[t] = number of separator ends at positions < t: non-decreasing, 0 at t = 0 (what the flash kernels
    need). Runs on idx's device; traceable (no data-dependent shapes).
    """
    length = len(sep)
    n = idx.shape[-1]
    ends = torch.zeros(idx.shape, dtype=torch.bool, device=idx.device)
    if n >= length:
        hit = torch.ones(idx[..., length - 1 :].shape, dtype=torch.bool, device=idx.device)
        for k, s in enumerate(sep):
            hit &= idx[..., k : n - length + 1 + k] == s
        ends[..., length - 1 :] = hit
    ends = ends.to(torch.int32)
    return (torch.cumsum(ends, dim=-1, dtype=torch.int32) - ends).to(torch.int32)
