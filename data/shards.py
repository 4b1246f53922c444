"""Writing a prepared directory's shards: staging, resumable state, tokenization in threads.

A prepare writes into ``DIR/.prepare-partial/`` (the stage) and moves the finished shards into ``DIR``
only at the end, so a prepare that fails or is killed never touches data already prepared there. Each
split is appended to ``{split}.part.bin`` / ``.part.idx``, renamed ``{split}_{k:06d}.bin`` / ``.idx`` when
it reaches ``shard_tokens``. After each piece of text during which a shard was completed, ``state.json``
records the pieces done and each part's length: a prepare killed later resumes there, tokenizing again at
most the tokens since the last completed shard.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from data.meta import DTYPES, META_NAME, SPLITS, write_json

STAGE_NAME = ".prepare-partial"
STATE_NAME = "state.json"
BATCH_CHARS = 1 << 20  # ~1 MB of text per tokenizer task: bounded memory, few tasks
SHARD_RE = re.compile(r"^(train|val)_\d{6}\.(bin|idx)$")


def is_val_doc(i: int, val_fraction: float) -> bool:
    """Document ``i`` is held out: one in every 1/val_fraction, evenly spread (the 5th, 15th ... at 0.1),
    so a stream of unknown length gets its share without a second pass."""
    return int((i + 1) * val_fraction + 0.5) > int(i * val_fraction + 0.5)


class ShardWriter:
    """Appends documents (token id arrays) to one split's shards in the stage directory."""

    def __init__(self, stage: Path, split: str, shard_tokens: int, dtype: str, state: dict | None = None):
        self.stage, self.split, self.shard_tokens = stage, split, int(shard_tokens)
        self.dtype = DTYPES[dtype]
        state = state or {"shards": [], "part_tokens": 0, "part_docs": 0, "docs": 0}
        self.shards: list[dict] = list(state["shards"])
        self.part_tokens, self.part_docs, self.docs = state["part_tokens"], state["part_docs"], state["docs"]
        self.tokens = sum(s["tokens"] for s in self.shards) + self.part_tokens
        self.completed = False  # a shard was completed since the last saved state
        self._open_parts()

    def _open_parts(self) -> None:
        self._bin = self._open_part(".part.bin", self.part_tokens * self.dtype.itemsize)
        self._idx = self._open_part(".part.idx", self.part_docs * 8)

    def _open_part(self, suffix: str, length: int):
        path = self.stage / f"{self.split}{suffix}"
        f = open(path, "r+b" if path.exists() else "w+b")
        f.truncate(length)  # drop what was written after the saved state
        f.seek(length)
        return f

    def add(self, ids: np.ndarray, start: bool = True) -> None:
        """Token ids of a document (``start``) or of the rest of one; they may cross into the next shards."""
        if start:
            self._idx.write(np.int64(self.part_tokens).tobytes())
            self.part_docs += 1
            self.docs += 1
        pos = 0
        while pos < len(ids):
            take = min(len(ids) - pos, self.shard_tokens - self.part_tokens)
            self._bin.write(np.ascontiguousarray(ids[pos : pos + take], dtype=self.dtype).tobytes())
            self.part_tokens += take
            self.tokens += take
            pos += take
            if self.part_tokens == self.shard_tokens:
                self._close_shard()

    def _close_shard(self) -> None:
        name = f"{self.split}_{len(self.shards):06d}"
        self.state()  # synced before the rename
        self.close()
        for ext in (".bin", ".idx"):
            os.replace(self.stage / f"{self.split}.part{ext}", self.stage / f"{name}{ext}")
        n, docs = self.part_tokens, self.part_docs
        self.shards.append({"file": f"{name}.bin", "tokens": n, "docs": docs, "index": f"{name}.idx"})
        self.part_tokens = self.part_docs = 0
        self.completed = True
        self._open_parts()

    def state(self) -> dict:
        """What a resume needs of this split, its parts synced to disk first."""
        for f in (self._bin, self._idx):
            f.flush()
            os.fsync(f.fileno())
        return {k: getattr(self, k) for k in ("shards", "part_tokens", "part_docs", "docs")}

    def finish(self) -> None:
        """Close the last (partial) shard."""
        if self.part_tokens or not self.shards:
            self._close_shard()
        self.close()

    def close(self) -> None:
        self._bin.close()
        self._idx.close()

    def _starts(self, shard: dict) -> np.ndarray:
        return np.fromfile(self.stage / shard["index"], dtype="<i8")

    def next_start(self, at: int) -> int:
        """The first document start at or after token ``at`` of the finished split, else ``at``."""
        offset = 0
        for s in self.shards:
            if offset + s["tokens"] > at:
                later = self._starts(s) + offset
                later = later[later >= at]
                if len(later):
                    return int(later[0])
            offset += s["tokens"]
        return at

    def split_off(self, at: int, other: ShardWriter, chunk: int = 1 << 20) -> None:
        """Move tokens ``at:`` of this finished split (a document starts at ``at``) to the end of ``other``,
        ``chunk`` tokens at a time, and cut this split's shards there."""
        offset, kept = 0, []
        for s in self.shards:
            n, lo = s["tokens"], at - offset  # lo: where this shard's moved part begins
            offset += n
            if lo >= n and lo > 0:
                kept.append(s)
                continue
            starts = self._starts(s)
            first = lo >= 0 or (len(starts) > 0 and starts[0] == 0)  # a document starts at max(lo, 0)
            lo = max(lo, 0)
            cuts = [lo, *starts[starts > lo].tolist(), n]  # every cut but the first is a document start
            with open(self.stage / s["file"], "rb") as f:
                for i, (a, b) in enumerate(itertools.pairwise(cuts)):
                    f.seek(a * self.dtype.itemsize)
                    for c in range(a, b, chunk):
                        ids = np.fromfile(f, dtype=self.dtype, count=min(chunk, b - c))
                        other.add(ids, start=c == a and (i > 0 or first))
            if lo:  # this shard keeps its tokens before ``at``
                docs = int((starts < lo).sum())
                os.truncate(self.stage / s["file"], lo * self.dtype.itemsize)
                os.truncate(self.stage / s["index"], docs * 8)
                kept.append({**s, "tokens": lo, "docs": docs})
            else:
                for name in (s["file"], s["index"]):
                    (self.stage / name).unlink()
        self.shards = kept
        self.tokens, self.docs = at, sum(s["docs"] for s in kept)


def load_state(stage: Path, key: dict) -> dict | None:
    """The stage's state when it was written for ``key`` (same source and arguments), else None after
    clearing the stage (a stage of other arguments cannot be continued)."""
    try:
        state = json.loads((stage / STATE_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        state = None
    if state is not None and state.get("key") == key:
        return state
    shutil.rmtree(stage, ignore_errors=True)
    return None


def save_state(stage: Path, key: dict, pieces: int, doc: int, writers: dict[str, ShardWriter]) -> None:
    """Record ``pieces`` done, the index of the document the last one belongs to, and every part."""
    splits = {s: w.state() for s, w in writers.items()}
    write_json(stage / STATE_NAME, {"key": key, "pieces": pieces, "doc": doc, "splits": splits})
    for w in writers.values():
        w.completed = False


def install(out: Path, stage: Path, shards: dict[str, list[dict]], write_meta) -> None:
    """Move the staged shards into ``out``, its meta.json last: the old meta.json goes first (the directory
    reads as unprepared meanwhile), then the old token files; then the stage is removed."""
    (out / META_NAME).unlink(missing_ok=True)
    for p in out.iterdir():
        if p.is_file() and SHARD_RE.match(p.name):
            p.unlink()
    for split in SPLITS:
        for s in shards[split]:
            for name in (s["file"], s["index"]):
                os.replace(stage / name, out / name)
    write_meta()
    shutil.rmtree(stage, ignore_errors=True)


def _batches(pieces: Iterable, skip: int) -> Iterator[list]:
    """The pieces after the first ``skip``, in batches of ~BATCH_CHARS characters."""
    batch, size = [], 0
    for piece in itertools.islice(pieces, skip, None):
        batch.append(piece)
        size += len(piece[0])
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def tokenized_pieces(pieces: Iterable, tok, workers: int, skip: int = 0) -> Iterator[tuple]:
    """(token ids as uint32, starts a document, ends one, its characters) of each piece after the first
    ``skip``, in order. ``workers`` threads tokenize batches (tiktoken releases the GIL) while this one
    reads the source, with ``workers`` batches in flight: memory holds a few batches, not the corpus."""

    def encode(batch: list) -> list[np.ndarray]:
        return [tok.encode_array(text, np.uint32) for text, _, _ in batch]

    pool, pending = ThreadPoolExecutor(workers, thread_name_prefix="tokenize"), deque()

    def oldest() -> Iterator[tuple]:
        task, batch = pending.popleft()
        for ids, (text, start, end) in zip(task.result(), batch, strict=True):
            yield ids, start, end, len(text)

    try:
        for batch in _batches(pieces, skip):
            pending.append((pool.submit(encode, batch), batch))
            if len(pending) > workers:  # one more is read while these are tokenized
                yield from oldest()
        while pending:
            yield from oldest()
    finally:
        pool.shutdown(cancel_futures=True)
