r"""Corpus sources of the prepare step: what ``data.source`` / ``--source`` names, read as documents.

- a UTF-8 text file: kind ``"text"``, one document or documents split on ``data.doc_separator``;
- a directory (its non-hidden files, sorted), a glob, or one ``.jsonl`` / ``.jsonl.gz`` / ``.json.gz`` /
  ``.parquet`` file: kind ``"docs"``; a text file is one document, a record file one per line / row (its
  ``text_field``). Identified by the files' names, sizes and mtimes (hashing 50 GB per launch costs minutes);
- ``hf:NAME[:CONFIG]``: a Hugging Face dataset's ``train`` split (``datasets``, streaming; a folder written
  by ``save_to_disk`` through ``load_from_disk``), identified by name, config and a local folder's files.

``Source.pieces()`` yields the text in a fixed order (a prepare resumes by skipping pieces). A file is read
in ``BLOCK_BYTES`` blocks and a document longer than ``PIECE_CHARS`` is cut at a space between two words,
where GPT-2's pre-tokenizer starts a word anyway (`` ?\p{L}+``), so the tokens are those of the whole text
and memory holds a few pieces, never a file.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import itertools
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

RECORD_SUFFIXES = (".jsonl", ".jsonl.gz", ".json.gz", ".parquet")
HF_PREFIX = "hf:"
_GLOB_CHARS = "*?["
BLOCK_BYTES = 1 << 20  # a text file is read in blocks of 1 MB
PIECE_CHARS = 1 << 16  # a document is tokenized in pieces of about 64k characters
BOM = "\ufeff"  # the byte-order mark some editors write at the start of a UTF-8 file: a marker, not text
Piece = tuple[str, bool, bool]  # (text, starts a document, ends a document)


class SourceError(ValueError):
    """A source that cannot be read as documents (the message names it and a fix; ``fix``: prepare's
    argument that reads it, e.g. ``text_field=body``, where one is known)."""

    def __init__(self, message: str, fix: str | None = None):
        super().__init__(message)
        self.fix = fix


def _field_fix(names: Iterable[str], what: str) -> tuple[str, str | None]:
    """(the advice, ``text_field=NAME``) for the first of ``names`` (fields or columns that hold text)."""
    name = next(iter(names), None)
    if name is None:
        return f"none of its {what}s holds text: pass records with a text {what}", None
    return f"set text_field={name} (the {what} that holds the text)", f"text_field={name}"


def is_hf(source) -> bool:
    return isinstance(source, str) and source.startswith(HF_PREFIX)


def is_url(source) -> bool:
    return isinstance(source, str) and source.lower().startswith(("http://", "https://"))


def is_records(path: Path) -> bool:
    return path.name.lower().endswith(RECORD_SUFFIXES)


def _is_glob(text: str) -> bool:
    return any(c in text for c in _GLOB_CHARS) and not Path(text).expanduser().exists()


def is_document_source(source) -> bool:
    """Whether ``source`` is read as a list of documents (hf:, a directory, a glob, a record file); cheap."""
    if source is None or is_url(source):
        return False
    text = str(source)
    return is_hf(text) or is_records(Path(text)) or Path(text).expanduser().is_dir() or _is_glob(text)


def _not_utf8(where: str, e: UnicodeDecodeError, offset: int) -> SourceError:
    byte = e.object[e.start : e.start + 1]
    if b"\0" in e.object:  # text has no NUL bytes; an image, archive or compiled file has many
        return SourceError(
            f"{where} looks binary (it holds NUL bytes; byte {byte!r} at offset {offset} is not UTF-8), not "
            "text: leave it out of the corpus, e.g. move it away or pass a glob of the text files only "
            "(data.source='DIR/**/*.txt', --source 'DIR/**/*.txt')"
        )
    return SourceError(
        f"{where} is not UTF-8 text: byte {byte!r} at offset {offset} is invalid ({e.reason}). Convert the "
        "file to UTF-8 first (e.g. `iconv -f latin1 -t utf-8 IN > OUT`) and pass the converted file."
    )


def read_blocks(path: Path) -> Iterator[str]:
    """A UTF-8 file's text in blocks of about ``BLOCK_BYTES``, a leading byte-order mark dropped; a bad byte
    is an error naming the file and its offset in the file's bytes."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    done, first = 0, True  # bytes decoded before this block; no text yielded yet
    with open(path, "rb") as f:
        while True:
            raw = f.read(BLOCK_BYTES)
            pending = len(decoder.getstate()[0])  # the start of a character cut by the last block
            try:
                text = decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as e:
                raise _not_utf8(str(path), e, done - pending + e.start) from e
            done += len(raw)
            if first and text:
                text, first = text.removeprefix(BOM), False
            if text:
                yield text
            if not raw:
                return


def _cut(buf: str, lo: int, hi: int, end: int) -> int:
    """Where to cut ``buf`` after ``lo``: the last space between two non-spaces before ``hi``, else the
    first one before ``end``; 0 for none. No GPT-2 pre-tokenizer pattern crosses such a space."""
    end = min(end, len(buf) - 1)

    def word_start(p: int) -> bool:
        return not (buf[p - 1].isspace() or buf[p + 1].isspace())

    p = buf.rfind(" ", lo + 1, min(hi, end))
    while p > lo and not word_start(p):
        p = buf.rfind(" ", lo + 1, p)
    if p > lo:
        return p
    p = buf.find(" ", max(hi, lo + 1), end)
    while p >= 0 and not word_start(p):
        p = buf.find(" ", p + 1, end)
    return max(p, 0)


def text_pieces(blocks: Iterable[str], sep: str | None = None, keep_sep: bool = False) -> Iterator[Piece]:
    """The non-empty documents of a stream of text ``blocks`` (one, or separated by ``sep``) as pieces of
    about ``PIECE_CHARS`` (``_cut``; up to 8 pieces without a word boundary are read before cutting anyway).

    ``keep_sep`` (the char tokenizer): a document ends after every occurrence of ``sep``, overlapping ones
    too (``data.docs``'s rule); otherwise the documents are those of ``str.split(sep)``.
    """
    n = len(sep) if sep else 1
    buf, pos, find_from, start = "", 0, 0, True  # buf[pos:] is not yielded yet
    for block in itertools.chain(blocks, [None]):
        if block is not None:
            drop = min(pos, find_from) if sep else pos  # keep_sep: a separator may begin before pos
            buf, pos, find_from = buf[drop:] + block, pos - drop, find_from - drop
        while sep:  # every document that ends in buf
            q = buf.find(sep, find_from)
            if q < 0:
                find_from = max(find_from, len(buf) - n + 1)  # an occurrence yet to come starts here
                break
            end = q + n if keep_sep else q
            if end > pos or not start:  # a non-empty document, or the end of one begun
                yield buf[pos:end], start, True
            pos, find_from, start = q + n, q + 1 if keep_sep else q + n, True
        if block is None:
            if len(buf) > pos or not start:
                yield buf[pos:], start, True
            return
        while len(buf) - pos > 2 * PIECE_CHARS:  # a long document: a piece (no separator starts before it)
            limit = len(buf) - n + 1
            c = _cut(buf, pos, pos + PIECE_CHARS, limit) or (limit if len(buf) - pos > 8 * PIECE_CHARS else 0)
            if not c:
                break
            yield buf[pos:c], start, False
            pos, start = c, False


@dataclass
class Source:
    """A parsed source: ``label`` (meta["source"]), ``kind`` ("text" | "docs"), the files it reads, and for
    ``hf:`` the dataset's name and config."""

    label: str
    kind: str
    files: list[Path] = field(default_factory=list)
    root: Path | None = None  # names in the fingerprint are relative to it (a moved corpus still matches)
    hf_name: str | None = None
    hf_config: str | None = None
    text_field: str = "text"

    def fingerprint(self) -> dict:
        """{"files": [[name, size, mtime_ns], ...]} and for hf: {"hf": name, "config": config}."""
        hf = {"hf": self.hf_name, "config": self.hf_config} if self.hf_name is not None else {}
        if hf and not self.files:  # a hub dataset: its name (its revision is the hub's)
            return hf
        stats = [(str(p.relative_to(self.root)) if self.root else str(p), p.stat()) for p in self.files]
        return {**hf, "files": [[name, st.st_size, st.st_mtime_ns] for name, st in stats]}

    def pieces(self, doc_separator: str | None = None, keep_separator: bool = False) -> Iterator[Piece]:
        """Every non-empty document in a fixed order, as pieces (``text_pieces``)."""
        if self.hf_name is not None:  # before the files: a local dataset's files are datasets' to read
            yield from self._documents((r, f"{self.label} record {i}") for i, r in enumerate(open_hf(self)))
            return
        for path in self.files:
            if path.name.lower().endswith(".parquet"):
                yield from self._documents(_parquet_records(path, self.text_field))
            elif is_records(path):
                yield from self._documents(_json_records(path))
            else:
                yield from text_pieces(read_blocks(path), doc_separator, keep_separator)

    def _documents(self, records: Iterable[tuple[object, str]]) -> Iterator[Piece]:
        """The pieces of each record's text field; ``records`` are (record, where it is) pairs."""
        for i, (record, where) in enumerate(records):
            yield from text_pieces([self._field(record, where, i)])

    def characters(self) -> set[str]:
        """The distinct characters of the text files (the char tokenizer's vocabulary)."""
        return {c for path in self.files for block in read_blocks(path) for c in set(block)}

    def text_size(self) -> int:
        """About how many characters the source holds, for the progress bar's estimate: the text files'
        bytes, JSON Lines' bytes times the share of text in the first MB of records; 0 when unknown."""
        if self.hf_name is not None or any(p.name.lower().endswith((".gz", ".parquet")) for p in self.files):
            return 0
        size = sum(p.stat().st_size for p in self.files)
        records = [p for p in self.files if is_records(p)]
        if not records:
            return size
        with open(records[0], "rb") as f:
            head = f.read(1 << 20).rsplit(b"\n", 1)[0]
        try:
            text = sum(len(str(json.loads(line).get(self.text_field, ""))) for line in head.splitlines())
        except (ValueError, AttributeError):
            return 0  # the prepare reports a bad record
        return int(size * text / len(head)) if head else 0

    def _field(self, record, where: str, index: int = 0) -> str:
        if not isinstance(record, dict):
            raise SourceError(f"{where} holds a {type(record).__name__}, not a JSON object with a text field")
        text = record.get(self.text_field, 0)  # 0: no such field
        if text is None or isinstance(text, str):
            return text or ""
        # the field holding the longest text is the likely one
        texts = sorted(
            (k for k, v in record.items() if isinstance(v, str) and v), key=lambda k: -len(record[k])
        )
        advice, fix = _field_fix(texts, "field")
        if self.text_field not in record:
            fields = ", ".join(sorted(map(str, record))[:8]) or "none"
            if index:  # the records before it have the field: this one is broken, not the choice of field
                raise SourceError(
                    f"{where} has no field {self.text_field!r} (its fields: {fields}), which the {index} "
                    "records before it have; fix or drop this record"
                )
            raise SourceError(
                f"{where} has no field {self.text_field!r} (its fields: {fields}); {advice}", fix
            )
        raise SourceError(
            f"{where}: field {self.text_field!r} holds a {type(text).__name__}, not text; {advice}", fix
        )


def _json_records(path: Path) -> Iterator[tuple[object, str]]:
    """(record, "path:line") of a JSON Lines file, gzip-compressed or not."""
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    yield json.loads(line.decode("utf-8").removeprefix(BOM)), where
                except UnicodeDecodeError as e:
                    raise _not_utf8(where, e, e.start) from e
                except json.JSONDecodeError as e:
                    raise SourceError(
                        f"{where} is not a JSON object per line ({e.msg}); pass JSON Lines files"
                    ) from e
    except (gzip.BadGzipFile, EOFError) as e:
        raise SourceError(f"{path} is not a readable gzip file ({e})") from e


def _parquet_records(path: Path, column: str) -> Iterator[tuple[dict, str]]:
    """({column: value}, "path row i") of a Parquet file, read 1024 rows at a time."""
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError variants
        raise SourceError(f"{path} is not a readable Parquet file ({type(e).__name__}: {e})") from e
    names = pf.schema_arrow.names
    if column not in names:
        strings = [f.name for f in pf.schema_arrow if str(f.type) in ("string", "large_string")]
        advice, fix = _field_fix(strings, "column")
        raise SourceError(
            f"{path} has no column {column!r} (its columns: {', '.join(names[:8])}); {advice}", fix
        )
    rows = itertools.chain.from_iterable(
        b.column(0).to_pylist() for b in pf.iter_batches(1024, columns=[column])
    )
    for i, value in enumerate(rows):
        yield {column: value}, f"{path} row {i}"


def open_hf(src: Source):
    """The ``train`` split of an ``hf:`` source: ``load_from_disk`` for a ``save_to_disk`` folder (which
    ``load_dataset`` refuses), else ``load_dataset(..., streaming=True)``; errors name the source."""
    import datasets

    name, label = src.hf_name, src.label
    root = Path(name)
    saved_dict = (root / "dataset_dict.json").is_file()
    if saved_dict or ((root / "state.json").is_file() and (root / "dataset_info.json").is_file()):
        if src.hf_config:
            raise SourceError(
                f"{label}: {name} is a dataset saved with save_to_disk, which has no configs; pass hf:{name}"
            )
        try:
            ds = datasets.load_from_disk(name)
        except Exception as e:  # a corrupt or partial save: datasets raises several classes
            raise SourceError(f"{label}: {name} does not load with datasets.load_from_disk ({e})") from e
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                splits = ", ".join(ds) or "none"
                raise SourceError(
                    f"{label} is a DatasetDict without a 'train' split (its splits: {splits}); "
                    f"save the split to read on its own (ds['{next(iter(ds), 'SPLIT')}'].save_to_disk(DIR)) "
                    "and pass hf:DIR"
                )
            ds = ds["train"]
        return ds
    try:
        return datasets.load_dataset(name, src.hf_config, split="train", streaming=True)
    except Exception as e:  # hub / network / not-found errors come in many classes
        offline = os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1"
        raise SourceError(
            f"could not open the Hugging Face dataset {label} ({type(e).__name__}: {str(e)[:300]}). "
            + ("Offline mode is on: " if offline else "Without network access: ")
            + f"fetch it on a machine with network (`huggingface-cli download --repo-type dataset {name}`) "
            "into this machine's Hugging Face cache (HF_HOME), or download its .parquet / .jsonl files and "
            "pass them as data.source=DIR (or a glob)"
        ) from e


def _visible_files(directory: str | Path):
    """The regular files under ``directory``, hidden ones and hidden folders left out, in os.walk order."""
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        yield from (p for f in filenames if not f.startswith(".") and (p := Path(dirpath) / f).is_file())


def has_files(directory: str | Path) -> bool:
    """Whether ``list_files(directory)`` would find a file, stopping at the first one."""
    return any(_visible_files(directory))


def list_files(where: str | Path) -> list[Path]:
    """The regular files under a directory (hidden ones and hidden folders left out) or matched by a glob
    (resolved), sorted."""
    if not Path(where).is_dir():
        found = sorted(Path(p) for p in glob.glob(os.path.expanduser(str(where)), recursive=True))
        return [p.resolve() for p in found if p.is_file()]
    return sorted(_visible_files(where))


def open_source(source: str | os.PathLike, text_field: str = "text") -> Source:
    """Parse a local or Hugging Face ``source`` (URLs and None are ``data.prepare``'s): FileNotFoundError
    for a path or glob that names no file, SourceError for ``hf:`` without a name."""
    text = str(source)
    if is_hf(source):
        name, _, config = text[len(HF_PREFIX) :].partition(":")  # NAME may be a local folder (no colon)
        if not name:
            raise SourceError(
                f"{source!r} names no dataset; use hf:NAME[:CONFIG], e.g. hf:roneneldan/TinyStories"
            )
        local, files, root = Path(name).expanduser(), [], None
        if name.startswith(("/", ".", "~")) or local.is_dir():  # a local dataset folder
            if not local.is_dir():  # a path, not a hub name: nothing to download
                raise FileNotFoundError(
                    f"{source!r} names a local dataset folder, and {local} does not exist (cwd: "
                    f"{os.getcwd()}); pass an existing folder (one written by save_to_disk, or of .parquet / "
                    ".jsonl files), or a hub dataset by its name, e.g. hf:roneneldan/TinyStories"
                )
            root = local.resolve()
            name, files = str(root), list_files(root)  # its identity: these files' sizes and mtimes
        label = f"{HF_PREFIX}{name}" + (f":{config}" if config else "")
        return Source(label, "docs", files, root, name, config or None, text_field)
    path = Path(text).expanduser()
    if _is_glob(text):
        files = list_files(text)
        if not files:
            raise FileNotFoundError(
                f"source glob {text!r} matches no file (cwd: {os.getcwd()}); pass a pattern that matches "
                "text / .jsonl / .json.gz / .parquet files, e.g. data.source='corpus/*.jsonl'"
            )
        root = Path(os.path.commonpath([str(p.parent) for p in files]))
        return Source(text, "docs", files, root, text_field=text_field)
    if not path.exists():
        raise FileNotFoundError(
            f"source {str(path)!r} does not exist (cwd: {os.getcwd()}). Pass an existing UTF-8 text file, a "
            "directory or glob of text / .jsonl / .json.gz / .parquet files, or hf:NAME[:CONFIG] "
            "(data.source=PATH or --source PATH), or leave the source unset to download Tiny Shakespeare."
        )
    path = path.resolve()
    if path.is_dir():
        files = list_files(path)
        if not files:
            raise FileNotFoundError(f"source directory {str(path)!r} holds no (non-hidden) file")
        return Source(str(path), "docs", files, path, text_field=text_field)
    if not path.is_file():
        raise IsADirectoryError(f"source {str(path)!r} is not a regular file or directory")
    kind = "docs" if is_records(path) else "text"
    return Source(str(path), kind, [path], path.parent, text_field=text_field)


def prepared_inside_source(source, out: Path) -> Path | None:
    """A folder beside a directory ``source`` when ``out`` is it or inside it, in a part that is read (its
    token files and meta.json would become documents of the corpus; a hidden folder is never read), else
    None."""
    if source is None or is_url(source) or is_hf(source) or _is_glob(str(source)):
        return None
    try:
        src = Path(str(source)).expanduser().resolve()
        rel = out.expanduser().resolve().relative_to(src).parts
    except (ValueError, OSError, RuntimeError):  # not inside; a symlink loop (the source's checks say so)
        return None
    if not src.is_dir() or any(part.startswith(".") for part in rel):
        return None
    return src.parent / f"{src.name}_tokens"


def source_stem(source) -> str:
    """A folder-name part for a source (suggested ``data.dir`` names): its file or folder name without
    the record / text suffixes, a glob's folder, a dataset's name ("corpus" when none is left)."""
    text = str(source or "")
    if is_hf(text):
        text = text[len(HF_PREFIX) :].partition(":")[0]
    parts = [p for p in Path(text.rstrip("/")).parts if not any(c in p for c in _GLOB_CHARS) and p != "/"]
    name = parts[-1] if parts else ""
    while Path(name).suffix.lower() in (".gz", ".jsonl", ".json", ".parquet", ".txt", ".text"):
        name = Path(name).stem
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name).strip("_") or "corpus"


def fingerprint_diff(old: dict | None, new: dict) -> str | None:
    """What differs between two fingerprints, in words (the first few files), or None."""
    if not isinstance(old, dict):
        return "no recorded fingerprint"
    if old == new:
        return None
    if "files" in old and "files" in new:
        a, b = ({r[0]: r[1:] for r in fp["files"]} for fp in (old, new))
        changed = sorted(k for k in set(a) & set(b) if a[k] != b[k])
        parts = []
        gone, added = sorted(set(a) - set(b)), sorted(set(b) - set(a))
        for what, names in (("removed", gone), ("added", added), ("changed (size or mtime)", changed)):
            if names:
                more = f" and {len(names) - 3} more" if len(names) > 3 else ""
                parts.append(f"{what}: {', '.join(names[:3])}{more}")
        return "; ".join(parts) or "the file list differs"
    if "hf" in old and "files" in new and {**old, "files": None} == {**new, "files": None}:
        return "its files were not recorded when it was prepared, so an edit cannot be ruled out"
    return f"was {old}, now {new}"
