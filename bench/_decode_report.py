"""The results files of ``bench.decode``: markdown tables of the kernel sweep and the end-to-end records, and
``decode_<tag>.json`` / ``.md`` written atomically as the run goes."""

from __future__ import annotations

import json
from pathlib import Path

from bench._attention_report import compact_json
from data.prepare import atomic_write

PROVIDERS = (
    "flash-decode",
    "read-floor",
    "naive",
    "sdpa-auto",
    "sdpa-flash",
    "sdpa-cudnn",
    "sdpa-efficient",
    "sdpa-math",
)


def _kernel_cell(r: dict | None, ceiling: float, mark_eager: bool) -> str:
    if r is None:
        return "-"
    if r.get("status") != "ok":
        return r["status"].split(":")[0]
    cell = f"{r['ms']:.3f} / {r['gbs']:.0f} ({r['gbs'] / ceiling:.0%})"
    return cell + (" e" if mark_eager and r.get("timing") == "eager" else "")


def _e2e_note(r: dict) -> str:
    notes = []
    if r.get("compile_backend") not in (None, "inductor"):
        notes.append(f"torch.compile backend {r['compile_backend']!r} (dry run: no Inductor)")
    if r.get("recompiles"):
        notes.append(f"{r['recompiles']} graph(s) compiled inside the timed run")
    return "; ".join(notes)


def markdown(meta: dict, kernel: list[dict], e2e: list[dict]) -> str:
    lines = [f"# Decode benchmark ({meta['device']}, {meta['dtype']})", ""]
    if not meta.get("complete", True):  # files of older runs have no flag: they were written at the end
        lines += [
            f"**Incomplete**: the run stopped (or is still running) after {len(kernel)} kernel and "
            f"{len(e2e)} end-to-end records; missing cells were not measured.",
            "",
        ]
    calls = meta.get("graph_calls", 1)
    eager_only = meta.get("eager_only_ms") if meta.get("graphs") else None
    lines += [
        f"Copy ceiling: {meta['copy_ceiling_gbs']:.0f} GB/s. Cells: ms / GB/s of K/V read "
        "(fraction of the ceiling). Where the JSON's `timing` says cuda_graph, ms = replay time of one "
        f"CUDA graph of {calls} back-to-back calls / {calls} "
        "(kernel time, graph launch shared; the calls cycle through copies of the inputs spanning twice "
        "the L2 cache, so K/V come from HBM; `ms_eager` there: called from Python), else ms of eager calls"
        + (
            f" (cells marked e: calls of {eager_only:g} ms or more eagerly are not also timed as a graph, "
            "since launch overhead is then a few percent at most and the cache far bigger than the L2)."
            if eager_only is not None
            else "."
        ),
        "",
    ]
    providers = sorted({r["provider"] for r in kernel if r["provider"] != "*"}, key=PROVIDERS.index)
    if kernel:
        lines += [
            "| d | group | batch | context | " + " | ".join(providers) + " |",
            "|---|---|---|---|" + "---|" * len(providers),
        ]
        index = {(r["d"], r["group"], r["batch"], r["context"], r["provider"]): r for r in kernel}
        for key in sorted({(r["d"], r["group"], r["batch"], r["context"]) for r in kernel}):
            cells = [
                _kernel_cell(
                    index.get((*key, p), index.get((*key, "*"))), meta["copy_ceiling_gbs"], bool(eager_only)
                )
                for p in providers
            ]
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | " + " | ".join(cells) + " |")
    if e2e:
        lines += [
            "",
            "End to end: mode eager = the growing cache view, static = `static_decode=True` (decode_step, "
            "eager), compiled = static with `torch.compile(model._decode_static)` "
            "(sample.py `compile=true`), graph / compiled-graph = the static / compiled step replayed as "
            "one CUDA graph (sample.py `cuda_graph=true`).",
            "",
            "| backend | mode | batch | prefill tok/s | decode tok/s | note |",
            "|---|---|---|---|---|---|",
        ]
        for r in e2e:
            mode = r.get("mode", "static" if r["static_decode"] else "eager")  # older files: no mode
            if r["status"] == "ok":
                lines.append(
                    f"| {r['backend']} | {mode} | {r['batch']} | "
                    f"{r['prefill_tokens_per_sec']:.0f} | {r['decode_tokens_per_sec']:.0f} | {_e2e_note(r)} |"
                )
            else:
                lines.append(f"| {r['backend']} | {mode} | {r['batch']} | {r['status']} | | {_e2e_note(r)} |")
    return "\n".join(lines) + "\n"


def _write_text(path: Path, text: str) -> None:
    data = text.encode("utf-8")
    atomic_write(path, lambda f: f.write(data))


class Results:
    """``decode_<tag>.json`` and ``.md`` in ``out``, rewritten atomically (temporary file, then
    os.replace) by ``save``: after every shape with ``complete=False``, at the end with True."""

    def __init__(self, out: Path, tag: str, meta: dict):
        out.mkdir(parents=True, exist_ok=True)
        self.json_path, self.md_path = out / f"decode_{tag}.json", out / f"decode_{tag}.md"
        self.meta, self.kernel, self.e2e = meta, [], []

    def add_kernel(self, records: list[dict]) -> None:
        self.kernel += records
        self.save()

    def add_e2e(self, rec: dict) -> None:
        self.e2e.append(rec)
        self.save()

    def save(self, complete: bool = False) -> str:
        """Write both files; returns the markdown."""
        self.meta["complete"] = complete
        _write_text(self.json_path, compact_json(dict(meta=self.meta, kernel=self.kernel, e2e=self.e2e)))
        report = markdown(self.meta, self.kernel, self.e2e)
        _write_text(self.md_path, report)
        return report


def rewrite_report(path: Path) -> str:
    """Rewrite the markdown beside a results JSON (``--report``), complete or not; returns it."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:  # missing, a directory, not JSON
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict) or not {"meta", "kernel", "e2e"} <= data.keys():
        raise ValueError(f"{path} is not a bench.decode results file (no meta, kernel and e2e)")
    try:
        report = markdown(data["meta"], data["kernel"], data["e2e"])
    except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
        raise ValueError(
            f"{path}: records or meta not as bench.decode writes them ({type(e).__name__}: {e})"
        ) from e
    _write_text(path.with_suffix(".md"), report)
    return report
