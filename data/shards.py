"""Writing a prepared directory's shards: staging, resumable state, parallel tokenization of documents.

A prepare writes into ``DIR/.prepare-partial/`` (the stage) and moves the finished shards into ``DIR``
only at the end, so a prepare that fails or is killed never touches data already prepared there. Each
split is appended to ``{split}.part.bin`` / ``{split}.part.idx``; a part that reaches ``shard_tokens``
tokens is renamed to ``{split}_{k:06d}.bin`` / ``.idx``. After every piece of text
(``data.sources.Piece``) during which a shard was completed, ``state.json`` records how many pieces are
done and how long each part is: a prepare killed later resumes there (parts truncated to the recorded
lengths, the done pieces skipped unread by the tokenizer), so at most the tokens since the last completed
shard are tokenized again.

Pieces are tokenized by ``workers`` processes (spawned: safe next to torch's threads), in batches of
about ``BATCH_CHARS`` characters; the main process reads the source and writes the shards, with at most
``2 * workers`` batches in flight (bounded memory: a batch, not the corpus).
"""

from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import os
import re
import shutil
import signal
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from data.meta import DTYPES, META_NAME, SPLITS, write_json

STAGE_NAME = ".prepare-partial"
STATE_NAME = "state.json"
BATCH_CHARS = 1 << 20  # ~1 MB of text per worker task: large enough to hide the pickling, small in RAM
SHARD_RE = re.compile(r"^(train|val)_\d{6}\.(bin|idx)$")


def stage_dir(out: Path) -> Path:
    return out / STAGE_NAME


def is_val_doc(i: int, val_fraction: float) -> bool:
    """Document ``i`` (0-based, non-empty documents in source order) is held out for validation: one in
    every 1/val_fraction documents, evenly spread (the 5th, 15th, 25th ... at 0.1), so a streamed
    corpus of unknown length gets val_fraction of its documents without a second pass."""
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
        self.completed = False  # a shard was completed since the last checkpoint
        self._bin = self._open_part(".part.bin", self.part_tokens * self.dtype.itemsize)
        self._idx = self._open_part(".part.idx", self.part_docs * 8)

    def _open_part(self, suffix: str, length: int):
        path = self.stage / f"{self.split}{suffix}"
        f = open(path, "r+b" if path.exists() else "w+b")
        f.truncate(length)  # drop what was written after the last checkpoint
        f.seek(length)
        return f

    def add(self, ids: np.ndarray, start: bool = True) -> None:
        """Token ids of a document (``start``) or of the rest of one; they may cross into the next
        shard(s)."""
        if start:
            self._idx.write(np.int64(self.part_tokens).tobytes())  # the document starts here
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
        for f, ext in ((self._bin, ".bin"), (self._idx, ".idx")):
            f.flush()
            os.fsync(f.fileno())
            f.close()
            os.replace(self.stage / f"{self.split}.part{ext}", self.stage / f"{name}{ext}")
        self.shards.append(
            {
                "file": f"{name}.bin",
                "tokens": self.part_tokens,
                "docs": self.part_docs,
                "index": f"{name}.idx",
            }
        )
        self.part_tokens = self.part_docs = 0
        self.completed = True
        self._bin = self._open_part(".part.bin", 0)
        self._idx = self._open_part(".part.idx", 0)

    def state(self) -> dict:
        for f in (self._bin, self._idx):
            f.flush()
            os.fsync(f.fileno())
        return {
            "shards": self.shards,
            "part_tokens": self.part_tokens,
            "part_docs": self.part_docs,
            "docs": self.docs,
        }

    def finish(self) -> list[dict]:
        """Close the last (partial) shard; returns the shard list."""
        if self.part_tokens or not self.shards:
            self._close_shard()
        else:
            self.close()
        return self.shards

    def close(self) -> None:
        for f in (self._bin, self._idx):
            if not f.closed:
                f.close()

    def _starts(self, shard: dict) -> np.ndarray:
        return np.fromfile(self.stage / shard["index"], dtype="<i8")

    def next_start(self, at: int) -> int:
        """The first document start at or after token ``at`` of the finished split, or ``at`` if none
        comes before its end."""
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
        """Move tokens ``at:`` of this finished split to the end of ``other`` (a document starts at ``at``;
        the later starts are kept), read ``chunk`` tokens at a time, and cut this split's shards there."""
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
                for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:], strict=True)):
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
    """The stage's resumable state when it was written for ``key`` (same source and arguments), else
    None after clearing the stage (a stage of other arguments cannot be continued)."""
    path = stage / STATE_NAME
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        state = None
    if state is not None and state.get("key") == key:
        return state
    if stage.exists():
        shutil.rmtree(stage)
    return None


def save_state(stage: Path, key: dict, pieces: int, doc: int, writers: dict[str, ShardWriter]) -> None:
    """Record ``pieces`` done, the index of the document the last one belongs to, and every part."""
    splits = {s: w.state() for s, w in writers.items()}
    write_json(stage / STATE_NAME, {"key": key, "pieces": pieces, "doc": doc, "splits": splits})
    for w in writers.values():
        w.completed = False


def install(out: Path, stage: Path, shards: dict[str, list[dict]], write_meta) -> None:
    """Move the staged shards into ``out`` and write its meta.json last: the old meta.json goes first (the
    directory reads as unprepared meanwhile), then the token files of the old data, then the new ones
    come in and the meta is written (``write_meta()``). The stage is removed."""
    (out / META_NAME).unlink(missing_ok=True)
    for p in out.iterdir():
        if p.is_file() and (SHARD_RE.match(p.name) or p.name in ("train.bin", "val.bin")):
            p.unlink()
    for split in SPLITS:
        for s in shards[split]:
            for name in (s["file"], s["index"]):
                os.replace(stage / name, out / name)
    write_meta()
    shutil.rmtree(stage, ignore_errors=True)


# ------------------------------------------------------------------------------- tokenization
def _batches(pieces: Iterable, skip: int) -> Iterator[list]:
    """The pieces after the first ``skip``, grouped into batches of ~BATCH_CHARS characters."""
    batch, size = [], 0
    for piece in itertools.islice(pieces, skip, None):
        batch.append(piece)
        size += len(piece[0])
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _split(result: tuple[np.ndarray, np.ndarray], batch: list) -> Iterator[tuple]:
    ids, lens = result
    ends = np.cumsum(lens)
    for a, b, (text, start, end) in zip(ends - lens, ends, batch, strict=True):
        yield ids[a:b], start, end, len(text)


def _ignore_sigint() -> None:
    """A tokenizer process leaves Ctrl-C to its parent, which stops the pool (else every worker prints a
    KeyboardInterrupt traceback of its own)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def tokenized_pieces(pieces: Iterable, tokenizer, workers: int, skip: int = 0) -> Iterator[tuple]:
    """(token ids as uint32, starts a document, ends one, its characters) of each piece
    (``data.sources.Piece``) after the first ``skip``, in order, tokenized by ``workers`` spawned processes
    (inline when ``workers <= 1``).
    ``tokenizer``: ``data.tokenizer.encode_documents``'s spec ("gpt2", or ("char", characters))."""
    from data.tokenizer import encode_documents

    if workers <= 1:
        for batch in _batches(pieces, skip):
            yield from _split(encode_documents(tokenizer, [p[0] for p in batch]), batch)
        return
    pool = mp.get_context("spawn").Pool(workers, initializer=_ignore_sigint)
    try:
        pending: deque = deque()
        for batch in _batches(pieces, skip):
            pending.append((pool.apply_async(encode_documents, (tokenizer, [p[0] for p in batch])), batch))
            if len(pending) >= 2 * workers:  # bounded: wait for the oldest before reading on
                task, done = pending.popleft()
                yield from _split(task.get(), done)
        while pending:
            task, done = pending.popleft()
            yield from _split(task.get(), done)
        pool.close()
    finally:
        pool.terminate()
        pool.join()
