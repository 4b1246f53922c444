"""Read a prepared data directory: meta, tokenizer, and deterministic random-window batches.

Batches follow nanoGPT's ``get_batch``: ``batch_size`` windows of ``seq_len + 1`` consecutive tokens at
random offsets of a split's stream (its shards memory-mapped and read as one, so the windows do not depend
on the shard size). The offsets come from ``np.random.default_rng([seed, split_id, step, micro_step, rank])``,
so a batch depends on those numbers only (the same across attention backends, restarts and resumes).
"""

from __future__ import annotations

import operator
import os
from pathlib import Path

import numpy as np
import torch

from data.meta import DTYPES, FORMAT_VERSION, SPLITS, check_shards, load_meta
from data.prepare import prepare_command
from data.tokenizer import CharTokenizer, GPT2Tokenizer, make_tokenizer

__all__ = ["BinDataset", "load_meta", "tokenizer_from_meta", "SPLITS", "FORMAT_VERSION"]

SPLIT_IDS = {"train": 0, "val": 1}
# eval_batches' seed sequences [seed, split_id, _EVAL_STREAM, i] have 4 entries: never batch()'s 5
_EVAL_STREAM = 0x6576616C  # "eval"


def tokenizer_from_meta(meta: dict, data_dir: str | os.PathLike = "DIR") -> GPT2Tokenizer | CharTokenizer:
    """The tokenizer of a prepared directory ``data_dir`` (``load_meta``'s dict)."""
    try:  # a meta.json edited or damaged by hand
        tok = make_tokenizer(meta["tokenizer"], itos=meta.get("itos"))
        if tok.vocab_size != meta["vocab_size"]:
            raise ValueError(
                f"meta.json says vocab_size={meta['vocab_size']} but its {meta['tokenizer']} tokenizer has "
                f"{tok.vocab_size} tokens"
            )
    except ValueError as e:
        raise ValueError(
            f"{e}: the meta.json is corrupt; prepare it with `{prepare_command(data_dir, meta)}`"
        ) from e
    return tok


def _nonneg_int(name: str, value, low: int = 0) -> int:
    """``value`` as an int >= ``low``, else TypeError / ValueError naming ``name``."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if (value := operator.index(value)) < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


class BinDataset:
    """One split (``"train"`` / ``"val"``) of a prepared data directory, served as random windows of
    ``seq_len`` tokens. ``check_ids``: token ids < ``vocab_size`` (catches shards paired with another
    meta.json). Keeps read-only ``np.memmap``s of the shards; pickling (DataLoader workers) re-opens them."""

    def __init__(
        self, data_dir: str | os.PathLike, split: str, seq_len: int, *, check_ids: bool = True, corpus=None
    ):
        """``corpus``: (source, tokenizer) the directory was prepared from, for the command an error prints
        when its meta.json cannot say (default: what meta.json records)."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; use one of {SPLITS}")
        seq_len = _nonneg_int("seq_len", seq_len, 1)
        self.data_dir = Path(data_dir)
        self.split, self.split_id, self.seq_len = split, SPLIT_IDS[split], seq_len
        meta = None
        try:  # the errors end with the command that prepares the directory again
            self.meta = meta = load_meta(self.data_dir)
            self.vocab_size: int = meta["vocab_size"]
            self.dtype = DTYPES[meta["dtype"]]
            # [(file, tokens, index file)]; ids < vocab_size catches corrupt or mismatched shards
            self.shards = check_shards(self.data_dir, meta, [split], check_ids)
        except (FileNotFoundError, ValueError) as e:
            fix = prepare_command(self.data_dir, meta, *(corpus or ()))
            raise type(e)(f"{str(e).rstrip('.')}; prepare it with `{fix}`") from None
        self.num_tokens: int = meta[f"{split}_tokens"]
        # offsets[k] = position of shard k's first token in the split's stream
        self._offsets = np.cumsum([0] + [n for _, n, _ in self.shards]).astype(np.int64)
        if self.num_tokens < seq_len + 1:
            fraction = "larger" if split == "val" else "smaller"
            raise ValueError(
                f"the {split} split of {self.data_dir} has {self.num_tokens} tokens, but seq_len={seq_len} "
                f"needs at least {seq_len + 1} (a window of seq_len + 1 tokens: inputs + shifted targets). "
                f"Use a smaller seq_len (at most {max(self.num_tokens - 1, 0)} here), a bigger corpus, or "
                f"a {fraction} data.val_fraction."
            )
        self._data = self._open()

    def _open(self) -> list[np.ndarray]:
        # np.memmap refuses an empty file: an empty shard is an empty array
        return [
            np.memmap(p, dtype=self.dtype, mode="r", shape=(n,)) if n else np.zeros(0, self.dtype)
            for p, n, _ in self.shards
        ]

    def _read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the split's stream (a view within one shard, else a copy)."""
        parts, pos = [], max(0, start)
        stop = min(self.num_tokens, stop)
        while pos < stop:
            k = int(np.searchsorted(self._offsets, pos, side="right")) - 1
            off, end = int(self._offsets[k]), min(stop, int(self._offsets[k + 1]))
            parts.append(self._data[k][pos - off : end - off])
            pos = end
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.zeros(0, self.dtype)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("_data", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._data = self._open()

    # -- documents
    def doc_starts(self) -> np.ndarray:
        """Sorted int64 positions where a document starts in this split (0 and each start the shards'
        indexes record); ValueError for a corpus prepared without a doc_separator."""
        if getattr(self, "_doc_starts", None) is None:
            if not self.meta.get("doc_separator_ids"):
                raise ValueError(
                    f"{self.data_dir} was prepared without a document separator; set data.doc_separator "
                    "(e.g. data.doc_separator='\n\n' for Tiny Shakespeare) with a data.dir of its own"
                )
            parts = [np.zeros(1, np.int64)]
            for off, (_, _, idx) in zip(self._offsets, self.shards, strict=False):
                parts.append(np.fromfile(idx, dtype="<i8") + off)
            starts = np.unique(np.concatenate(parts))
            self._doc_starts = starts[starts < self.num_tokens].astype(np.int64)
        return self._doc_starts

    # -- batches
    def _windows(self, rng: np.random.Generator, batch_size: int, with_doc_ids: bool = False):
        # start in [0, num_tokens - seq_len - 1], so start + seq_len + 1 <= num_tokens
        starts = rng.integers(0, self.num_tokens - self.seq_len, size=batch_size)
        win = np.stack([self._read(s, s + self.seq_len + 1) for s in starts.tolist()]).astype(np.int64)
        x = torch.from_numpy(np.ascontiguousarray(win[:, :-1]))
        y = torch.from_numpy(np.ascontiguousarray(win[:, 1:]))
        if not with_doc_ids:
            return x, y
        # relative document ids (0 at a window's first token, rule in data.docs)
        doc, pos = self.doc_starts(), starts[:, None] + np.arange(self.seq_len)[None, :]
        ids = np.searchsorted(doc, pos, side="right") - np.searchsorted(doc, pos[:, :1], side="right")
        return x, y, torch.from_numpy(ids.astype(np.int32))

    def batch(
        self,
        batch_size: int,
        *,
        seed: int,
        step: int,
        micro_step: int = 0,
        rank: int = 0,
        with_doc_ids: bool = False,
    ) -> tuple[torch.Tensor, ...]:
        """(x, y) int64 (batch_size, seq_len), y shifted by one (with ``with_doc_ids`` also the windows'
        document ids), drawn with ``default_rng([seed, split_id, step, micro_step, rank])``."""
        batch_size = _nonneg_int("batch_size", batch_size, 1)
        ints = dict(seed=seed, step=step, micro_step=micro_step, rank=rank)
        key = [_nonneg_int(k, v) for k, v in ints.items()]
        key.insert(1, self.split_id)
        return self._windows(np.random.default_rng(key), batch_size, with_doc_ids)

    def eval_batches(
        self, n_batches: int, batch_size: int, seed: int, with_doc_ids: bool = False
    ) -> list[tuple[torch.Tensor, ...]]:
        """A fixed list of batches for evaluation: batch ``i`` uses ``default_rng([seed, split_id,
        _EVAL_STREAM, i])``, independent of ``batch()``'s and of ``n_batches``."""
        n_batches = _nonneg_int("n_batches", n_batches)
        batch_size = _nonneg_int("batch_size", batch_size, 1)
        key = [_nonneg_int("seed", seed), self.split_id, _EVAL_STREAM]
        return [
            self._windows(np.random.default_rng([*key, i]), batch_size, with_doc_ids)
            for i in range(n_batches)
        ]

    def tokens(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Token ids ``[start, stop)`` of the split as an int64 array (a copy)."""
        start, stop, _ = slice(start, stop).indices(self.num_tokens)
        return np.asarray(self._read(start, stop), dtype=np.int64)

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        return (
            f"BinDataset({str(self.data_dir)!r}, split={self.split!r}, seq_len={self.seq_len}, "
            f"num_tokens={self.num_tokens}, vocab_size={self.vocab_size})"
        )
