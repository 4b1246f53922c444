"""Sweep report: one table and one figure for a context-length sweep of training runs.

Usage::

    python -m bench.report SWEEP_DIR [--out DIR] [--wandb] [--warmup-frac 0.1]

Reads every run directory under SWEEP_DIR (any folder holding `summary.json`, `metrics.jsonl` or
`.hydra/config.yaml`; the run-directory layout is in README.md) and writes into --out (default
SWEEP_DIR):

* ``report.md``  — all runs (long table), the failed runs with their error text (summary.json
  ``error``), then pivot tables with rows = seq_len and one column per attention backend for
  tokens/sec, MFU %, peak GiB and final train loss; an OOM run shows "OOM", another failed run its
  status;
* ``report.json`` — the same numbers, one object per run;
* ``report_sweep.png`` — tokens/sec, peak memory and MFU vs seq_len (log2 axis), one line per
  backend, failed runs marked by an 'x' at the top of each panel.

Per-run numbers are the run's own `summary.json` figures, so the report agrees with it: tokens/sec
(``perf/tokens_per_sec``) and MFU (``perf/mfu``) are the trainer's medians over its timed steps, peak GiB is
``mem/peak_gib``, final losses ``final/train_loss`` / ``final/val_loss``. Only a run whose summary lacks
one (killed before writing it, an older trainer) falls back to its ``metrics.jsonl``: the median of the
logged values after dropping the first ``--warmup-frac`` (10 %, at least one point when there are two or
more) of them, the largest logged peak, the last logged loss; such a value is marked with a † and the
run's ``sources`` field in report.json names where each figure came from.

Pivot cells hold one value per run; when several runs share a (seq_len, backend) cell (seeds, repeats),
each value carries its run directory's name.

With ``--wandb`` the table (wandb.Table) and figure (wandb.Image) are logged to a new W&B run of
job_type "report" in the sweep's group (config `wandb.group`, else the sweep folder's name) and
project (config `wandb.project`, else "flashgpt"). The mode follows the trainer's ``wandb.mode=auto``
(`trainer.metrics.resolve_wandb_mode`): WANDB_MODE when set, else online when logged in, else offline;
an online run that cannot start (no network) is retried offline. An offline run prints the
``wandb sync`` command that uploads it. WANDB_MODE=disabled or a missing wandb package only prints a
message.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from bench import _rundir

METRIC_COLUMNS = (
    ("tokens_per_sec", "tokens/sec", "{:,.0f}"),
    ("mfu_pct", "MFU %", "{:.1f}"),
    ("peak_gib", "peak GiB", "{:.2f}"),
    ("final_train_loss", "final train loss", "{:.4f}"),
)
ALL_RUNS_COLUMNS = METRIC_COLUMNS + (("final_val_loss", "final val loss", "{:.4f}"),)


def post_warmup_median(values: Sequence[float], warmup_frac: float = 0.1) -> float | None:
    """Median of `values` (in step order) after dropping the first ceil(warmup_frac * n) of them
    (at least one when n >= 2, none when n == 1); non-finite values are ignored. None when empty."""
    n = len(values)
    if n == 0:
        return None
    drop = 0 if n == 1 else max(1, math.ceil(warmup_frac * n))
    drop = min(drop, n - 1)
    kept = [v for v in values[drop:] if _rundir.finite(v)]
    return float(statistics.median(kept)) if kept else None


def error_text(summary: dict, status: str) -> str | None:
    """What went wrong in a run that did not end "ok", on one line: summary.json's ``error`` (config error,
    OOM, non-finite loss, full disk...), else what the status implies; None for an ok run."""
    if status == "ok":
        return None
    err = summary.get("error")
    if err:
        return " ".join(str(err).split())
    if status == "interrupted":
        return f"interrupted by {summary.get('signal', 'a signal')} after step {summary.get('steps', '?')}"
    if status == "running":
        return "no ending recorded: still running, or killed without a chance to record it"
    return "no error recorded (no summary.json)" if status == "no summary" else None


def summarize_run(run_dir: Path, sweep_dir: Path, warmup_frac: float = 0.1) -> dict:
    """One run's row: backend, seq_len, status and the metrics described in the module docstring."""
    cfg = _rundir.read_config(run_dir)
    summary = _rundir.read_summary(run_dir)
    rows = _rundir.read_metrics(run_dir)
    status = str(summary.get("status", "no summary" if not summary else "unknown"))
    true, killed_note = _rundir.run_status(run_dir, summary)  # a dead "running" run is "killed"
    if killed_note is not None:
        status = str(true)

    sources: dict[str, str] = {}

    def pick(name: str, metric_key: str, summary_key: str) -> float | None:
        """summary.json's figure (NaN kept: a non-finite run), else the post-warm-up median of the log."""
        v = summary.get(summary_key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            sources[name] = "summary.json"
            return float(v)
        med = post_warmup_median(list(_rundir.series(rows, metric_key).values()), warmup_frac)
        if med is not None:
            sources[name] = "metrics.jsonl median"
        return med

    def last(name: str, metric_key: str, summary_key: str) -> float | None:
        v = summary.get(summary_key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            sources[name] = "summary.json"
            return float(v)  # NaN stays NaN (a non-finite run) and is shown as "—"
        s = _rundir.series(rows, metric_key)
        if s:
            sources[name] = "metrics.jsonl last"
        return list(s.values())[-1] if s else None

    tps = pick("tokens_per_sec", "perf/tokens_per_sec", "perf/tokens_per_sec")
    mfu = pick("mfu_pct", "perf/mfu", "perf/mfu")
    peak = summary.get("mem/peak_gib")
    if _rundir.finite(peak):
        peak, sources["peak_gib"] = float(peak), "summary.json"
    else:
        peaks = [v for v in _rundir.series(rows, "mem/peak_gib").values() if _rundir.finite(v)]
        peak = max(peaks) if peaks else None
        if peaks:
            sources["peak_gib"] = "metrics.jsonl max"
    steps = summary.get("steps")
    if (steps is None or killed_note is not None) and rows:  # a killed run's summary has its start step
        steps = max((int(r["step"]) for r in rows if isinstance(r.get("step"), (int, float))), default=None)
    final_val = last("final_val_loss", "val/loss", "final/val_loss")
    val_steps = list(_rundir.series(rows, "val/loss"))
    if final_val is not None and val_steps and max(val_steps) == 0 and (steps or 0) > 0:
        # the only eval was the untrained model's (eval.at_start; a run stopped before its first interval)
        final_val, sources["final_val_loss"] = None, "left out: the only eval was at step 0 (untrained)"
    rel = run_dir.relative_to(sweep_dir) if run_dir != sweep_dir else Path(".")
    return {
        "run": str(rel),
        "backend": _rundir.attention_label(cfg, summary) or "?",
        "seq_len": _rundir.seq_len_of(cfg, summary),
        "status": status,
        "tokens_per_sec": tps,
        "mfu_pct": None if mfu is None else 100.0 * mfu,
        "peak_gib": peak,
        "final_train_loss": last("final_train_loss", "train/loss", "final/train_loss"),
        "final_val_loss": final_val,
        "steps": steps,
        "sources": sources,
        "error": killed_note or error_text(summary, status),
        "wandb_group": _rundir.cfg_get(cfg, "wandb.group"),
        "wandb_project": _rundir.cfg_get(cfg, "wandb.project"),
        "wandb_entity": _rundir.cfg_get(cfg, "wandb.entity"),
    }


def collect(sweep_dir: str | Path, warmup_frac: float = 0.1) -> list[dict]:
    """Rows of every run under `sweep_dir`, sorted by (backend, seq_len, run).
    Raises RunDirError when the folder is missing or holds no run."""
    sweep_dir = Path(sweep_dir)
    dirs = _rundir.find_run_dirs(sweep_dir)
    if not dirs:
        raise _rundir.RunDirError(
            f"no run directories (with summary.json, metrics.jsonl or .hydra/config.yaml) under {sweep_dir}"
        )
    runs = [summarize_run(d, sweep_dir, warmup_frac) for d in dirs]
    order = {b: i for i, b in enumerate(backends_of(runs))}
    runs.sort(key=lambda r: (order[r["backend"]], r["seq_len"] if r["seq_len"] is not None else -1, r["run"]))
    return runs


def _cell(run: dict, key: str, fmt: str) -> str:
    """Pivot cell: the value for an ok run ('†' when it is not summary.json's), 'OOM' for an OOM run, else
    the run's status."""
    if run["status"] == "oom":
        return "OOM"
    if run["status"] != "ok":
        return run["status"]
    return _fmt_plain(run.get(key), fmt, run, key)


def _fmt_plain(v, fmt: str, run: dict | None = None, key: str | None = None) -> str:
    if v is None or not _rundir.finite(v):
        return "—"
    text = fmt.format(v)
    if run is not None and run.get("sources", {}).get(key, "summary.json") != "summary.json":
        text += "†"
    return text


def backends_of(runs: Sequence[dict]) -> list[str]:
    """Backends in a stable display order: naive, sdpa*, flash, then the rest alphabetically."""
    order = {"naive": 0, "sdpa": 1, "flash": 3}
    names = sorted({r["backend"] for r in runs})
    return sorted(names, key=lambda b: (order.get(b, 2 if b.startswith("sdpa") else 4), b))


def markdown(runs: Sequence[dict], sweep_dir: Path, warmup_frac: float) -> str:
    """report.md text: long table of every run, then one pivot table per metric."""
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    lines = [
        f"# Sweep report: {sweep_dir}",
        "",
        f"{len(runs)} runs; generated {now}. Every figure is the run's summary.json: tokens/sec and MFU "
        "are the trainer's medians over its timed steps (after `perf.exclude_first_steps`), peak GiB the "
        "largest memory allocated by tensors (torch.cuda.max_memory_allocated, GiB = 2^30 bytes), final "
        "losses those of the last step. † marks a value read from metrics.jsonl instead because the "
        f"summary lacks it (tokens/sec, MFU: median of the logged steps after the first {warmup_frac:.0%}).",
        "",
        "## All runs",
        "",
        "| run | backend | seq_len | status | tokens/sec | MFU % | peak GiB | final train loss | "
        "final val loss | steps |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in runs:
        status = "OOM" if r["status"] == "oom" else r["status"]
        seq = r["seq_len"] if r["seq_len"] is not None else "?"
        lines.append(
            f"| {r['run']} | {r['backend']} | {seq} | {status} | "
            + " | ".join(_fmt_plain(r[key], fmt, r, key) for key, _, fmt in ALL_RUNS_COLUMNS)
            + f" | {r['steps'] if r['steps'] is not None else '—'} |"
        )
    failed = [r for r in runs if r["status"] != "ok"]
    if failed:
        lines += [
            "",
            "## Failed runs",
            "",
            "| run | backend | seq_len | status | error |",
            "| --- | --- | ---: | --- | --- |",
        ]
        for r in failed:
            text = (r.get("error") or "—").replace("|", "\\|")  # a '|' would split the cell
            seq = r["seq_len"] if r["seq_len"] is not None else "?"
            lines.append(f"| {r['run']} | {r['backend']} | {seq} | {r['status']} | {text} |")
    backends = backends_of(runs)
    seqs = sorted({r["seq_len"] for r in runs if r["seq_len"] is not None})
    for key, title, fmt in METRIC_COLUMNS:
        lines += ["", f"## {title} (rows: seq_len, columns: attention backend)", ""]
        lines.append("| seq_len | " + " | ".join(backends) + " |")
        lines.append("| ---: |" + " ---: |" * len(backends))
        for n in seqs:
            cells = []
            for b in backends:
                match = [r for r in runs if r["backend"] == b and r["seq_len"] == n]
                if len(match) == 1:
                    cells.append(_cell(match[0], key, fmt))
                else:  # several runs in one cell: say which value is whose
                    cells.append("; ".join(f"{_cell(r, key, fmt)} ({r['run']})" for r in match) or "—")
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
    unknown = [r["run"] for r in runs if r["seq_len"] is None]
    if unknown:
        lines += ["", f"Runs without a seq_len (not in the pivot tables): {', '.join(unknown)}"]
    return "\n".join(lines) + "\n"


def plot(runs: Sequence[dict], path: Path, title: str) -> Path:
    """report_sweep.png: tokens/sec, peak GiB and MFU % vs seq_len; failures as 'x' at the top."""
    from bench import _plot

    backends = backends_of(runs)
    seqs = sorted({r["seq_len"] for r in runs if r["seq_len"] is not None})
    fig, axes = _plot.subplots(1, 3, panel_w=5.2, panel_h=4.0)
    panels = (("tokens_per_sec", "tokens / sec"), ("peak_gib", "peak memory, GiB"), ("mfu_pct", "MFU, %"))
    colors = {b: f"C{i % 10}" for i, b in enumerate(backends)}
    for ax, (key, ylabel) in zip(axes[0], panels, strict=True):
        failed: list[tuple[str, str, list[int]]] = []
        for b in backends:
            mine = sorted(
                (r for r in runs if r["backend"] == b and r["seq_len"] is not None),
                key=lambda r: r["seq_len"],
            )
            ok = [(r["seq_len"], r[key]) for r in mine if r["status"] == "ok" and _rundir.finite(r[key])]
            if ok:
                ax.plot([x for x, _ in ok], [y for _, y in ok], marker="o", ms=4, label=b, color=colors[b])
            by_status: dict[str, list[int]] = {}
            for r in mine:
                if r["status"] != "ok":
                    st = "OOM" if r["status"] == "oom" else r["status"]
                    by_status.setdefault(st, []).append(r["seq_len"])
            failed += [(b, st, xs) for st, xs in by_status.items()]
        _plot.log2_xaxis(ax, seqs)
        ax.set_xlabel("seq_len (tokens)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        if failed:
            _plot.headroom(ax, 0.25)
        for level, (b, st, xs) in enumerate(failed):
            _plot.mark_failed(ax, xs, f"{b} {st}", colors[b], level=level, text=st)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    return _plot.save(fig, path, title)


def log_to_wandb(runs: Sequence[dict], png: Path, sweep_dir: Path, out_dir: Path) -> str:
    """Log the table and figure to a new W&B run in the sweep's group, in the trainer's `wandb.mode=auto`
    mode (see the module docstring), under `out_dir/wandb/`. Returns the outcome as text (with the
    `wandb sync` command for an offline run); never raises: a report must not fail because W&B is
    unavailable."""
    from trainer.metrics import resolve_wandb_mode

    mode = resolve_wandb_mode("auto")
    if mode == "disabled":
        return "W&B logging skipped: WANDB_MODE=disabled"
    try:
        import wandb
    except ImportError:
        return "W&B logging skipped: the wandb package is not installed (pip install wandb)"
    group = next((r["wandb_group"] for r in runs if r.get("wandb_group")), None) or sweep_dir.resolve().name
    project = next((r["wandb_project"] for r in runs if r.get("wandb_project")), None) or "flashgpt"
    entity = next((r["wandb_entity"] for r in runs if r.get("wandb_entity")), None)
    columns = [
        "run",
        "backend",
        "seq_len",
        "status",
        "tokens_per_sec",
        "mfu_pct",
        "peak_gib",
        "final_train_loss",
        "final_val_loss",
        "steps",
    ]
    notes = []
    for attempt in (mode, "offline") if mode == "online" else (mode,):
        try:
            run = wandb.init(
                project=project,
                entity=entity,
                group=group,
                job_type="report",
                mode=attempt,
                name=f"report-{sweep_dir.resolve().name}",
                dir=str(out_dir),
                config={"sweep_dir": str(sweep_dir), "n_runs": len(runs)},
            )
            table = wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in runs])
            run.log({"report/table": table, "report/plots": wandb.Image(str(png))})
            run_dir = Path(run.dir).parent  # .../wandb/offline-run-<time>-<id>
            run.finish()
        except Exception as exc:  # network, auth, disabled service...
            notes.append(f"W&B {attempt} run failed ({type(exc).__name__}: {exc})")
            continue
        text = f"W&B: logged report to project {project!r}, group {group!r} (mode {attempt})"
        if attempt == "offline":
            text += f"; upload it later with: wandb sync {run_dir}"
        return "; ".join([*notes, text])
    return "; ".join(notes) + "; the local report files are complete"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n\n")[0])
    p.add_argument("sweep_dir", help="Hydra multirun folder (or any folder holding run directories)")
    p.add_argument("--out", default=None, help="output folder (default SWEEP_DIR)")
    p.add_argument(
        "--warmup-frac",
        type=float,
        default=0.1,
        help="fraction of logged steps left out of the tokens/sec and MFU medians (default 0.1)",
    )
    p.add_argument("--wandb", action="store_true", help="also log table and plots to W&B")
    args = p.parse_args(argv)
    if not 0.0 <= args.warmup_frac < 1.0:
        p.error(f"--warmup-frac must be in [0, 1), got {args.warmup_frac}")
    sweep = Path(args.sweep_dir)
    out = Path(args.out) if args.out else sweep
    try:
        runs = collect(sweep, args.warmup_frac)
    except _rundir.RunDirError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    md = markdown(runs, sweep, args.warmup_frac)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.md").write_text(md)
        (out / "report.json").write_text(
            json.dumps({"sweep_dir": str(sweep), "warmup_frac": args.warmup_frac, "runs": runs}, indent=1)
            + "\n"
        )
        png = plot(runs, out / "report_sweep.png", title=f"sweep {sweep.resolve().name}")
    except OSError as exc:  # a read-only sweep (a colleague's runs, a read-only mount): print it anyway
        print(md)
        print(
            f"note: report not written: {out} ({exc.strerror or type(exc).__name__}); the report is printed "
            "above. Pass --out DIR to write it elsewhere",
            file=sys.stderr,
        )
        return 0
    print(md)
    print(f"wrote {out / 'report.md'}, {out / 'report.json'}, {png}")
    if args.wandb:
        print(log_to_wandb(runs, png, sweep, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
