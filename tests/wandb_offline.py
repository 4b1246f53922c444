"""Read an offline W&B run back from its `.wandb` transaction log (no network, no mocking).

An offline run (``wandb.init(mode="offline")``) writes ``<dir>/wandb/offline-run-<time>-<id>/run-<id>.wandb``.
That file is a LevelDB-style log (the format of LevelDB's write-ahead log, which wandb adopted):

* a 7-byte file header: ``b":W&B"``, the magic ``0xBEE1`` (uint16 little endian) and a version byte (0);
* then 32 KiB blocks holding chunks, each with a 7-byte header
  ``<crc32:uint32 LE><length:uint16 LE><type:uint8>`` followed by ``length`` bytes; type 1 = FULL record,
  2 = FIRST, 3 = MIDDLE, 4 = LAST piece of a record that spans blocks. A block tail shorter than a chunk
  header is zero padding. The CRC is zlib's CRC-32 of the data seeded with the CRC-32 of the type byte
  (as in ``wandb/sdk/internal/datastore.py`` of older wandb versions; wandb 0.31 no longer ships it in
  Python, and its Go core writes the same format).
* each record is a serialized ``wandb.proto.wandb_internal_pb2.Record`` protobuf.

Older wandb versions ship a reader (``wandb.sdk.internal.datastore.DataStore``); it is used when present, and
the small reader below otherwise (wandb 0.31, installed here, has none). The tests read runs with it: the
trainer itself only writes (W&B mirrors metrics.jsonl).
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

_FILE_HEADER = struct.Struct("<4sHB")
_CHUNK_HEADER = struct.Struct("<IHB")
_IDENT = b":W&B"
_MAGIC = 0xBEE1
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


class WandbFileError(ValueError):
    """The file is not a readable W&B transaction log (bad header, checksum or truncated chunk)."""


class WandbFileIncomplete(WandbFileError):
    """The file holds no run record yet: wandb-core has not written it out (the run is still running or
    finishing), or the run was killed before wandb flushed it."""


def _iter_raw_records(data: bytes, path: str, verify_crc: bool = True) -> Iterator[bytes]:
    """Yield each record's serialized bytes from the LevelDB-style log in ``data``.

    A truncated final chunk (a run killed while writing) ends the iteration quietly; a bad header or
    checksum raises WandbFileError naming the file and offset.
    """
    if len(data) < _FILE_HEADER.size:
        raise WandbFileError(f"{path}: too short ({len(data)} bytes) to be a W&B run file")
    ident, magic, version = _FILE_HEADER.unpack_from(data, 0)
    if ident != _IDENT or magic != _MAGIC or version != 0:
        raise WandbFileError(
            f"{path}: not a W&B run file (header {ident!r} {magic:#x} v{version}; expected b':W&B' 0xbee1 v0)"
        )
    pos = _FILE_HEADER.size
    pending: bytearray | None = None
    while pos < len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK_HEADER.size:  # block trailer padding
            pos += left
            continue
        if pos + _CHUNK_HEADER.size > len(data):
            return  # truncated header at the end of a killed run
        crc, length, ctype = _CHUNK_HEADER.unpack_from(data, pos)
        if crc == 0 and length == 0 and ctype == 0:  # zero padding up to the block end
            pos += left
            continue
        start = pos + _CHUNK_HEADER.size
        end = start + length
        if end > len(data):
            return  # truncated chunk: the writer was killed mid-record
        chunk = data[start:end]
        if verify_crc:
            want = zlib.crc32(chunk, zlib.crc32(bytes([ctype]))) & 0xFFFFFFFF
            if want != crc:
                raise WandbFileError(f"{path}: checksum mismatch at byte {pos} (chunk type {ctype})")
        pos = end
        if ctype == _FULL:
            yield bytes(chunk)
        elif ctype == _FIRST:
            pending = bytearray(chunk)
        elif ctype == _MIDDLE and pending is not None:
            pending += chunk
        elif ctype == _LAST and pending is not None:
            pending += chunk
            yield bytes(pending)
            pending = None
        else:
            raise WandbFileError(f"{path}: unexpected chunk type {ctype} at byte {pos}")


def _raw_records(path: str) -> Iterator[bytes]:
    """Serialized records of ``path``: wandb's own DataStore reader when this wandb has one, else ours."""
    try:
        from wandb.sdk.internal import datastore  # wandb <= 0.2x
    except ImportError:
        datastore = None
    if datastore is not None and hasattr(datastore, "DataStore"):
        store = datastore.DataStore()
        store.open_for_scan(path)
        while True:
            raw = store.scan_data()
            if raw is None:
                return
            yield raw
    else:
        yield from _iter_raw_records(Path(path).read_bytes(), path)


def iter_records(wandb_file: str | Path):
    """Yield the ``wandb_internal_pb2.Record`` messages of one ``.wandb`` file, in write order."""
    from wandb.proto import wandb_internal_pb2 as pb

    path = str(wandb_file)
    for raw in _raw_records(path):
        rec = pb.Record()
        rec.ParseFromString(raw)
        yield rec


def _item_path(item) -> list[str]:
    return [item.key] if item.key else list(item.nested_key)


def _history_value(item):
    """Decode a HistoryItem: newer wandb uses typed fields (oneof ``value``), older ones ``value_json``."""
    which = item.WhichOneof("value") if "value" in item.DESCRIPTOR.oneofs_by_name else None
    if which == "none":
        return None
    if which in ("boolean", "integer", "number", "text"):
        return getattr(item, which)
    if which == "json":
        return json.loads(item.json)
    return json.loads(item.value_json) if item.value_json else None


def _set_path(d: dict, path: list[str], value) -> None:
    for key in path[:-1]:
        d = d.setdefault(key, {})
    d[path[-1]] = value


def _del_path(d: dict, path: list[str]) -> None:
    for key in path[:-1]:
        d = d.get(key, {})
    d.pop(path[-1], None)


def _apply_config(config: dict, rec) -> None:
    for item in rec.update:
        _set_path(config, _item_path(item), json.loads(item.value_json))
    for item in rec.remove:
        _del_path(config, _item_path(item))


def read_wandb_file(wandb_file: str | Path) -> dict:
    """Parse one ``.wandb`` file into ``dict(history, summary, config, run_id)``.

    history: list of dicts, one per ``wandb.log`` call, with ``_step`` set (int) and the logged keys
    (keys containing "/" such as ``train/loss`` are kept flat, as W&B logs them).
    summary: the final run summary (later updates win). config: the run config (nested dicts), without
    wandb's internal ``_wandb`` entry. run_id: the 8-character W&B run id, "" when the file holds no run
    record (a killed run's never-flushed file, or one wandb-core is still writing; ``read_offline_run``
    raises WandbFileIncomplete for such a run). Also group, name, tags (from the run record) and
    branch_point: dict(run_id, step, metric) of a forked run's parent, else None.
    Raises WandbFileError for a file that is not a W&B log.
    """
    history: list[dict] = []
    summary: dict = {}
    config: dict = {}
    run_id = ""
    extra: dict = {"branch_point": None}
    for rec in iter_records(wandb_file):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run_id = rec.run.run_id or run_id
            extra = {"group": rec.run.run_group, "name": rec.run.display_name, "tags": list(rec.run.tags)}
            bp = rec.run.branch_point if rec.run.HasField("branch_point") else None
            extra["branch_point"] = (
                {"run_id": bp.run, "step": int(bp.value), "metric": bp.metric} if bp and bp.run else None
            )
            _apply_config(config, rec.run.config)
            for item in rec.run.summary.update:
                _set_path(summary, _item_path(item), json.loads(item.value_json))
        elif kind == "config":
            _apply_config(config, rec.config)
        elif kind == "history":
            row: dict = {}
            for item in rec.history.item:
                _set_path(row, _item_path(item), _history_value(item))
            if "_step" not in row:
                row["_step"] = int(rec.history.step.num)
            row["_step"] = int(row["_step"])
            history.append(row)
        elif kind == "summary":
            for item in rec.summary.update:
                _set_path(summary, _item_path(item), json.loads(item.value_json))
            for item in rec.summary.remove:
                _del_path(summary, _item_path(item))
    config.pop("_wandb", None)
    return {"history": history, "summary": summary, "config": config, "run_id": run_id, **extra}


def run_file_finished(wandb_file: str | Path) -> bool:
    """True when ``wandb_file`` holds the run's exit record, i.e. wandb-core has written the whole run out.

    wandb-core buffers the file in 32 KiB blocks and writes the last one only when it closes the run's
    stream, which ``Run.finish()`` asks for without waiting. Only the last
    few records are decoded (the exit record is the last, or near it in older wandb versions), so this is
    cheap for a long run's file too. False for a missing, short or damaged file.
    """
    from collections import deque

    from wandb.proto import wandb_internal_pb2 as pb

    path = str(wandb_file)
    try:
        tail = deque(_iter_raw_records(Path(path).read_bytes(), path, verify_crc=False), maxlen=4)
    except (OSError, WandbFileError):
        return False
    for raw in tail:
        rec = pb.Record()
        try:
            rec.ParseFromString(raw)
        except Exception:  # noqa: BLE001 - a record being written; the next poll sees it whole
            continue
        if rec.WhichOneof("record_type") == "exit":
            return True
    return False


def wait_run_file_finished(wandb_file: str | Path, timeout: float = 5.0) -> bool:
    """Wait (at most ``timeout`` seconds) until ``run_file_finished(wandb_file)``; returns whether it is.
    ``Run.finish()`` only asks wandb-core to close the run's stream; the file's buffered tail (for a short
    run, all but the header) is written when wandb-core gets to it, so a reader right after finish() could
    find no run in the file. Usually it is complete at the first look: one read of the file."""
    deadline = time.monotonic() + timeout
    delay = 0.002
    while True:
        if run_file_finished(wandb_file):
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(delay, left))
        delay = min(delay * 2, 0.1)


def find_wandb_files(run_dir: str | Path) -> list[Path]:
    """All ``*.wandb`` files of a run directory (``<run_dir>/wandb/*/run-*.wandb``), oldest first.

    The folder names start with the start time (``offline-run-YYYYMMDD_HHMMSS-<id>``), so they are sorted by
    that time, and folders of the same second by the file's last write (not by the random id: a resume
    started within the second of the previous process must still come after it); a resumed run has one
    folder per process that logged to it.
    """
    run_dir = Path(run_dir)

    def started(p: Path) -> tuple[str, int]:
        return p.parent.name.split("-", 2)[-1].rsplit("-", 1)[0], p.stat().st_mtime_ns

    files = sorted(run_dir.glob("wandb/*run-*/run-*.wandb"), key=started)
    if not files:
        files = sorted(run_dir.glob("*run-*/run-*.wandb"), key=started)
    return files


def read_offline_run(run_dir_or_wandb_file: str | Path, wait_s: float = 5.0) -> dict:
    """Read what an offline W&B run logged: dict(history=list[dict], summary=dict, config=dict, run_id=str).

    Accepts a ``.wandb`` file, a W&B run folder (``offline-run-*``), or a trainer run directory (holding
    ``wandb/``). When a run directory holds several W&B folders of the same run id (a resumed run), they are
    merged in time order: histories concatenated, config and summary updated by the later ones. Folders of
    other run ids than the newest one are ignored, except the parents of a forked newest run (see
    ``branch_point``): their history up to the fork step is prepended and ``parents`` lists them.
    The newest file is first waited for (at most ``wait_s``) until wandb-core has written it out.
    Raises FileNotFoundError when no ``.wandb`` file is found, WandbFileError for a damaged header/checksum
    and WandbFileIncomplete when the newest file holds no run record yet (rather than a run with run_id "").
    """
    p = Path(run_dir_or_wandb_file)
    if p.is_file():
        wait_run_file_finished(p, timeout=wait_s)
        return _check_has_run(read_wandb_file(p), p)
    files = find_wandb_files(p)
    if not files:
        files = sorted(p.glob("run-*.wandb"))
    if not files:
        raise FileNotFoundError(
            f"no W&B run file (*.wandb) under {p}; was the run started with wandb.mode=offline|online?"
        )
    wait_run_file_finished(files[-1], timeout=wait_s)  # the newest run may have just finished
    runs = [read_wandb_file(f) for f in files]
    _check_has_run(runs[-1], files[-1])
    merged = _merge_same_id(runs, runs[-1]["run_id"])
    # a fork (a resume that replayed steps): its parent's history up to the fork step comes first, as
    # W&B shows it; the parent's later (abandoned) steps are left out. "parents" lists the chain.
    merged["parents"] = []
    child, seen = merged, {merged["run_id"]}
    while child.get("branch_point") and child["branch_point"]["run_id"] not in seen:
        bp = child["branch_point"]
        seen.add(bp["run_id"])
        merged["parents"].append(bp)
        if not any(r["run_id"] == bp["run_id"] for r in runs):
            break  # the parent was logged elsewhere, or its file holds no run record (a killed run)
        parent = _merge_same_id(runs, bp["run_id"])
        merged["history"] = [h for h in parent["history"] if h["_step"] <= bp["step"]] + merged["history"]
        child = parent
    return merged


def _check_has_run(run: dict, path: Path) -> dict:
    """``run`` (read from ``path``) unless it has no run id: then WandbFileIncomplete says why."""
    if run["run_id"]:
        return run
    size = path.stat().st_size
    raise WandbFileIncomplete(
        f"{path}: no run record in it yet ({size} bytes): wandb-core has not written the run out - it is "
        "still running or finishing (past read_offline_run's wait_s), or it was killed before wandb flushed "
        "the file"
    )


def _merge_same_id(runs: list[dict], run_id: str) -> dict:
    """The files of one run id merged in time order (histories concatenated, later config/summary win)."""
    mine = [r for r in runs if r["run_id"] == run_id]
    merged = {**mine[-1], "history": [], "summary": {}, "config": {}}
    merged["branch_point"] = next((r["branch_point"] for r in mine if r.get("branch_point")), None)
    for run in mine:
        merged["history"].extend(run["history"])
        merged["summary"].update(run["summary"])
        merged["config"].update(run["config"])
    return merged
