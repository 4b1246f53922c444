"""Output of `bench.attention`: the markdown tables, the PNG, and the merge of several invocations into one
results file (`--merge`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

MODES: tuple[str, ...] = ("fwd", "bwd", "fwdbwd")
# Baselines for the "speedup of flash" table, in this order (other providers present follow them).
SPEEDUP_BASELINES: tuple[str, ...] = ("sdpa-flash", "flex", "sdpa-cudnn")


# ------------------------------------------------------------------------------------------------ output


def _fmt(x: float | None, spec: str | None = None) -> str:
    """'—' for None; by default one decimal for values >= 10, else 3 significant digits."""
    if x is None:
        return "—"
    if spec is None:
        spec = ".1f" if abs(x) >= 10 else ".3g"
    return format(x, spec)


def _short_status(status: str) -> str:
    if status == "oom":
        return "OOM"
    if status.startswith("mismatch"):
        return "FAIL"
    if status.startswith("error"):
        return "ERR"
    return status


def _index(records: Sequence[dict]) -> dict[tuple, dict]:
    return {(r["provider"], r["N"], r["d"], r["mode"]): r for r in records}


def _table_modes(modes: Sequence[str]) -> list[str]:
    return [m for m in ("fwd", "bwd") if m in modes] or [m for m in modes]


def _memory_table(records, idx, d, ns, providers, modes) -> list[str]:
    """Markdown lines of the peak-memory table of head dim `d` (cells 'total / above inputs' GiB)."""

    def row(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cells) + " |"

    lines = ["", f"### d = {d}: peak memory of one forward+backward, GiB (total / above inputs)", ""]
    lines.append(row(["N"] + providers))
    lines.append(row(["---:"] * (1 + len(providers))))
    for n in ns:
        cells = [str(n)]
        for p in providers:
            r = next((idx.get((p, n, d, m)) for m in modes if idx.get((p, n, d, m))), None)
            if r is None:
                cells.append("—")
            elif r.get("peak_gib") is None:
                cells.append(_short_status(r["status"]) if r["status"] != "ok" else "—")
            else:
                cells.append(f"{r['peak_gib']:.2f} / {r['peak_extra_gib']:.2f}")
        lines.append(row(cells))
    return lines


def markdown_report(records: Sequence[dict], meta: dict) -> str:
    """Markdown: per head dim, TFLOP/s (rows N, columns providers, cells 'fwd / bwd'), speedup of
    flash over the baselines, peak memory, max abs errors, and a list of failures."""
    idx = _index(records)
    providers = list(dict.fromkeys(r["provider"] for r in records))
    ds = sorted({r["d"] for r in records})
    ns = sorted({r["N"] for r in records})
    modes = list(dict.fromkeys(r["mode"] for r in records))
    tmodes = _table_modes(modes)
    mode_txt = " / ".join(tmodes)
    lines = [
        f"# Causal attention benchmark — {meta.get('gpu') or meta.get('device')} ({meta.get('dtype')})",
        "",
        f"- date {meta.get('date')}, torch {meta.get('torch')}, triton {meta.get('triton')}, "
        f"CUDA {meta.get('cuda')}",
        f"- {meta.get('tokens')} tokens per batch (B = tokens // N), hidden {meta.get('hidden')} "
        f"(H = hidden // d); timing: {meta.get('timing')}",
        f"- FLOPs: {meta.get('flops')}",
        *(
            [
                f"- flash's forward on sm_90: the Gluon kernel from N = {meta['flash_gluon_min_n']} (per d; "
                f"FLASHGPT_GLUON_FWD={meta.get('flash_gluon_fwd')}), the Triton kernel otherwise"
            ]
            if meta.get("flash_gluon_min_n")
            else []
        ),
        *(
            [
                "- flash's backward on sm_90: the one-pass Gluon kernel from N = "
                f"{meta['flash_gluon_min_n_bwd']} (MHA, N % 128 == 0; "
                f"FLASHGPT_GLUON_BWD={meta.get('flash_gluon_bwd')}), the split Triton kernels otherwise"
            ]
            if meta.get("flash_gluon_min_n_bwd")
            else []
        ),
        "- cells: OOM = out of memory, ERR = cannot run, FAIL = wrong result vs float32 reference "
        "(not timed), — = not measured",
    ]
    for inv in meta.get("invocations") or ():
        lines.append(
            f"- merged (`--merge`): N = {inv.get('seqlens')}, d = {inv.get('headdims')}, providers "
            f"{inv.get('providers')}, modes {inv.get('modes') or list(MODES)} measured "
            f"{inv.get('date')} (torch {inv.get('torch')}, triton {inv.get('triton')})"
        )
    if meta.get("complete") is False:
        lines.append("- **incomplete**: the last invocation stopped before measuring every shape it lists")
    if meta.get("dry_run"):
        lines.append("- **dry run** (CPU plumbing check): numbers are meaningless")

    def row(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cells) + " |"

    for d in ds:
        lines += ["", f"## d = {d}: TFLOP/s ({mode_txt})", ""]
        lines.append(row(["N", "B×H"] + providers))
        lines.append(row(["---:"] * (2 + len(providers))))
        for n in ns:
            any_rec = next((r for r in records if r["N"] == n and r["d"] == d), None)
            bh = f"{any_rec['B']}×{any_rec['H']}" if any_rec else "—"
            cells = [str(n), bh]
            for p in providers:
                parts = []
                for m in tmodes:
                    r = idx.get((p, n, d, m))
                    if r is None:
                        parts.append("—")
                    elif r["status"] != "ok":
                        parts.append(_short_status(r["status"]))
                    else:
                        parts.append(_fmt(r["tflops"]))
                cells.append(" / ".join(parts))
            lines.append(row(cells))

        # speedup of flash over the baselines
        if "flash" in providers:
            bases = [p for p in SPEEDUP_BASELINES if p in providers]
            bases += [p for p in providers if p not in bases and p != "flash"]
            if bases:
                lines += ["", f"### d = {d}: speedup of flash (TFLOP/s ratio, {mode_txt})", ""]
                lines.append(row(["N"] + [f"vs {p}" for p in bases]))
                lines.append(row(["---:"] * (1 + len(bases))))
                for n in ns:
                    cells = [str(n)]
                    for p in bases:
                        parts = []
                        for m in tmodes:
                            a, bb = idx.get(("flash", n, d, m)), idx.get((p, n, d, m))
                            if a and bb and a["tflops"] and bb["tflops"]:
                                parts.append(f"{a['tflops'] / bb['tflops']:.2f}×")
                            elif bb is not None and bb["status"] != "ok":
                                parts.append(_short_status(bb["status"]))
                            else:
                                parts.append("—")
                        cells.append(" / ".join(parts))
                    lines.append(row(cells))

        # peak memory
        if not any(r.get("peak_gib") is not None for r in records):
            lines += ["", f"### d = {d}: peak memory not measured (needs CUDA)"]
        else:
            lines += _memory_table(records, idx, d, ns, providers, modes)

        # errors
        lines += ["", f"### d = {d}: max abs error vs float32 reference (O / grads)", ""]
        lines.append(row(["N"] + providers))
        lines.append(row(["---:"] * (1 + len(providers))))
        for n in ns:
            cells = [str(n)]
            for p in providers:
                r = next((idx.get((p, n, d, m)) for m in modes if idx.get((p, n, d, m))), None)
                errs = (r or {}).get("errors") or {}
                go = errs.get("o")
                gg = [errs[x] for x in ("dq", "dk", "dv") if x in errs]
                cells.append(f"{_fmt(go, '.2e')} / {_fmt(max(gg) if gg else None, '.2e')}")
            lines.append(row(cells))

    notes = {}
    for r in records:
        if r["status"] != "ok":
            notes.setdefault((r["provider"], r["d"], r["status"]), []).append((r["N"], r["mode"]))
    if notes:
        lines += ["", "## Failures", ""]
        for (p, d, st), where in notes.items():
            ns_txt = ",".join(str(x) for x in sorted({w[0] for w in where}))
            ms_txt = ",".join(dict.fromkeys(w[1] for w in where))
            lines.append(f"- {p} d={d} N={ns_txt} ({ms_txt}): {st}")
    return "\n".join(lines) + "\n"


def plot_report(records: Sequence[dict], path: str | Path, title: str = "") -> Path:
    """PNG: rows = head dims; columns = TFLOP/s vs N for fwd and bwd (fwdbwd when neither ran), then
    peak memory vs N (when measured, i.e. on CUDA); one line per provider, log2 x-axis, failures
    marked with 'x' at the top of the panel."""
    from bench import _plot

    providers = list(dict.fromkeys(r["provider"] for r in records))
    ds = sorted({r["d"] for r in records}) or [0]
    ns = sorted({r["N"] for r in records})
    modes = _table_modes(list(dict.fromkeys(r["mode"] for r in records)))
    idx = _index(records)
    has_mem = any(r.get("peak_gib") is not None for r in records)
    panels = modes + (["mem"] if has_mem else [])
    fig, axes = _plot.subplots(len(ds), len(panels))
    colors = {p: f"C{i % 10}" for i, p in enumerate(providers)}
    for i, d in enumerate(ds):
        for j, m in enumerate(panels):
            ax = axes[i][j]
            rec_mode = m if m != "mem" else modes[0]
            failures: list[tuple[list[int], str, str]] = []
            for p in providers:
                xs, ys, failed = [], [], []
                for n in ns:
                    r = idx.get((p, n, d, rec_mode))
                    if r is None:
                        continue
                    y = r["tflops"] if m != "mem" else r.get("peak_gib")
                    if r["status"] != "ok":
                        failed.append((n, _short_status(r["status"])))
                    elif y is not None:
                        xs.append(n)
                        ys.append(y)
                if xs:
                    ax.plot(xs, ys, marker="o", ms=3, label=p, color=colors[p])
                if failed:
                    kinds = "/".join(dict.fromkeys(f[1] for f in failed))
                    failures.append(([f[0] for f in failed], f"{p} {kinds}", colors[p]))
            _plot.log2_xaxis(ax, ns)
            ax.set_xlabel("sequence length N")
            if m == "mem":  # quadratic (naive) vs linear memory: log scale keeps both readable
                ax.set_ylabel("peak GiB (fwd+bwd)")
                if ax.lines:
                    ax.set_yscale("log", base=2)
            else:
                ax.set_ylabel("TFLOP/s")
                ax.set_ylim(bottom=0)
            if failures:
                _plot.headroom(ax, 0.05 * (len(failures) + 1))
            for level, (xs, label, color) in enumerate(failures):
                _plot.mark_failed(ax, xs, label, color, level=level)
            ax.set_title(f"d={d} {m if m != 'mem' else 'peak memory'}")
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    return _plot.save(fig, path, title)


def output_paths(out_dir: str | Path, tag: str) -> dict[str, Path]:
    """{'json'|'md'|'png': out_dir/attention_<tag>.<ext>}."""
    return {ext: Path(out_dir) / f"attention_{tag}.{ext}" for ext in ("json", "md", "png")}


def merge_records(old: Sequence[dict], new: Sequence[dict]) -> list[dict]:
    """`old` records with those of the same (provider, N, d, mode) replaced by `new` ones, plus the
    remaining new records appended (lets a sweep be split over several invocations with one tag)."""
    key = lambda r: (r["provider"], r["N"], r["d"], r["mode"])
    fresh = {key(r): r for r in new}
    merged = [fresh.pop(key(r), r) for r in old]
    return merged + [r for r in new if key(r) in fresh]


_INVOCATION_KEYS = ("date", "seqlens", "headdims", "providers", "modes", "torch", "triton", "gpu")
# settings that make rows of two invocations incomparable (a merged table has one header for them)
_MERGE_MUST_MATCH = ("device", "gpu", "dtype", "tokens", "hidden", "dry_run")


def read_for_merge(path: Path) -> tuple[list[dict], dict]:
    """(records, metadata) of an existing results JSON, checked to have the shape this script writes.
    Raises ValueError (with what is wrong) for invalid JSON or another structure; OSError if unreadable."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("records"), list):
        raise ValueError('expected an object with a "records" list')
    meta = data.get("metadata", {})
    if not isinstance(meta, dict):
        raise ValueError('"metadata" must be an object')

    def is_int(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    def is_str(x) -> bool:
        return isinstance(x, str)

    for r in data["records"]:
        if not (
            isinstance(r, dict)
            and is_str(r.get("provider"))
            and is_str(r.get("mode"))
            and is_int(r.get("N"))
            and is_int(r.get("d"))
        ):
            raise ValueError(f"a record needs provider, mode (strings), N, d (integers): {str(r)[:80]}")
    invocations = meta.get("invocations", [])
    if not isinstance(invocations, list) or not all(isinstance(m, dict) for m in invocations):
        raise ValueError('"metadata.invocations" must be a list of objects')
    for m in (meta, *invocations):
        for key, ok in (("seqlens", is_int), ("headdims", is_int), ("providers", is_str), ("modes", is_str)):
            if key in m and not (isinstance(m[key], list) and all(ok(x) for x in m[key])):
                kind = "integers" if ok is is_int else "strings"
                raise ValueError(f'metadata "{key}" must be a list of {kind}')
    return data["records"], meta


def merge_clash(previous_meta: dict, meta: dict) -> str | None:
    """Which table-wide setting differs between an existing file and this invocation, or None."""
    diffs = [
        f"{k}={previous_meta[k]!r} (now {meta.get(k)!r})"
        for k in _MERGE_MUST_MATCH
        if k in previous_meta and previous_meta[k] != meta.get(k)
    ]
    return ", ".join(diffs) or None


def merged_invocations(previous_meta: dict, meta: dict) -> list[dict]:
    """The invocations whose records a merged file holds, oldest first: those listed in `previous_meta`
    (or `previous_meta` itself when it lists none), then this one. An earlier invocation whose every
    (N, d, provider, mode) this one measured again is dropped (none of its rows is left). Each entry: date,
    seqlens, headdims, providers, torch, triton, gpu -- so a merged table says when each row was measured."""

    def cells(m: dict) -> set:
        return {
            (n, d, p, mode)
            for n in m.get("seqlens") or ()
            for d in m.get("headdims") or ()
            for p in m.get("providers") or ()
            for mode in m.get("modes") or MODES
        }

    earlier = previous_meta.get("invocations") or ([previous_meta] if previous_meta else [])
    redone = cells(meta)
    kept = [m for m in earlier if not (cells(m) and cells(m) <= redone)]
    return [{k: m.get(k) for k in _INVOCATION_KEYS} for m in (*kept, meta)]


def compact_json(obj: dict) -> str:
    """JSON text of a results object with one line per top-level key, and one line per item of a list
    value (a benchmark record): about a fifth smaller than indent=1, and a re-measured cell changes one line
    of the diff. Loads back to `obj` with json.loads."""
    parts = []
    for key, value in obj.items():
        if isinstance(value, list) and value:
            items = ",\n".join("  " + json.dumps(v) for v in value)
            parts.append(f" {json.dumps(key)}: [\n{items}\n ]")
        else:
            parts.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def write_outputs(
    records: Sequence[dict], meta: dict, out_dir: str | Path, tag: str, *, png: bool = True
) -> dict[str, Path]:
    """Write attention_<tag>.json/.md (and .png unless `png` is False) into `out_dir` (created);
    return the paths written."""
    paths = output_paths(out_dir, tag)
    paths["json"].parent.mkdir(parents=True, exist_ok=True)
    paths["json"].write_text(compact_json({"metadata": meta, "records": list(records)}))
    paths["md"].write_text(markdown_report(records, meta))
    if not png:
        del paths["png"]
        return paths
    plot_report(
        records,
        paths["png"],
        title=f"causal attention, {meta.get('gpu') or meta.get('device')}, {meta.get('dtype')}",
    )
    return paths
