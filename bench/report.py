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

Per-run numbers: tokens/sec and MFU are medians over the logged steps after dropping the first
``--warmup-frac`` (10 %, at least one point when there are two or more) of them (compile/warm-up),
falling back to summary.json; peak GiB is the largest of summary.json and the logged values; final
losses come from summary.json, else the last logged value.

With ``--wandb`` the table (wandb.Table) and figure (wandb.Image) are logged to a new W&B run of
job_type "report" in the sweep's group (config `wandb.group`, else the sweep folder's name) and
project (config `wandb.project`, else "flashgpt"); mode from WANDB_MODE; WANDB_MODE=disabled or a
missing wandb package only prints a message.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
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

    def pick(metric_key: str, summary_key: str) -> float | None:
        vals = list(_rundir.series(rows, metric_key).values())
        med = post_warmup_median(vals, warmup_frac)
        if med is None and _rundir.finite(summary.get(summary_key)):
            med = float(summary[summary_key])
        return med

    def last(metric_key: str, summary_key: str) -> float | None:
        v = summary.get(summary_key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)  # NaN stays NaN (a non-finite run) and is shown as "—"
        s = _rundir.series(rows, metric_key)
        return list(s.values())[-1] if s else None

    tps = pick("perf/tokens_per_sec", "perf/tokens_per_sec")
    mfu = pick("perf/mfu", "perf/mfu")
    peaks = [v for v in _rundir.series(rows, "mem/peak_gib").values() if _rundir.finite(v)]
    if _rundir.finite(summary.get("mem/peak_gib")):
        peaks.append(float(summary["mem/peak_gib"]))
    steps = summary.get("steps")
    if steps is None and rows:
        steps = max((int(r["step"]) for r in rows if isinstance(r.get("step"), (int, float))), default=None)
    rel = run_dir.relative_to(sweep_dir) if run_dir != sweep_dir else Path(".")
    return {
        "run": str(rel),
        "backend": _rundir.attention_label(cfg, summary) or "?",
        "seq_len": _rundir.seq_len_of(cfg, summary),
        "status": status,
        "tokens_per_sec": tps,
        "mfu_pct": None if mfu is None else 100.0 * mfu,
        "peak_gib": max(peaks) if peaks else None,
        "final_train_loss": last("train/loss", "final/train_loss"),
        "final_val_loss": last("val/loss", "final/val_loss"),
        "steps": steps,
        "error": error_text(summary, status),
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
        raise _rundir.RunDirError(f"no run directories (with summary.json, metrics.jsonl or "
                                  f".hydra/config.yaml) under {sweep_dir}")
    runs = [summarize_run(d, sweep_dir, warmup_frac) for d in dirs]
    order = {b: i for i, b in enumerate(backends_of(runs))}
    runs.sort(key=lambda r: (order[r["backend"]], r["seq_len"] if r["seq_len"] is not None else -1, r["run"]))
    return runs


def _cell(run: dict, key: str, fmt: str) -> str:
    """Pivot cell: the value for an ok run, 'OOM' for an OOM run, else the run's status."""
    if run["status"] == "oom":
        return "OOM"
    if run["status"] != "ok":
        return run["status"]
    v = run.get(key)
    return "—" if v is None or not _rundir.finite(v) else fmt.format(v)


def _fmt_plain(v, fmt: str) -> str:
    return "—" if v is None or not _rundir.finite(v) else fmt.format(v)


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
        f"{len(runs)} runs; generated {now}. "
        f"tokens/sec and MFU: median of logged steps after the first {warmup_frac:.0%}; "
        "peak GiB: max allocated (torch.cuda.max_memory_allocated).",
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
            f"{_fmt_plain(r['tokens_per_sec'], '{:,.0f}')} | {_fmt_plain(r['mfu_pct'], '{:.1f}')} | "
            f"{_fmt_plain(r['peak_gib'], '{:.2f}')} | {_fmt_plain(r['final_train_loss'], '{:.4f}')} | "
            f"{_fmt_plain(r['final_val_loss'], '{:.4f}')} | {r['steps'] if r['steps'] is not None else '—'} |"
        )
    failed = [r for r in runs if r["status"] != "ok"]
    if failed:
        lines += ["", "## Failed runs", "", "| run | backend | seq_len | status | error |",
                  "| --- | --- | ---: | --- | --- |"]
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
                cells.append(", ".join(_cell(r, key, fmt) for r in match) if match else "—")
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
            mine = sorted((r for r in runs if r["backend"] == b and r["seq_len"] is not None),
                          key=lambda r: r["seq_len"])
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
    """Log the table and figure to a new W&B run in the sweep's group. Returns a one-line outcome;
    never raises (a report must not fail because W&B is unavailable)."""
    mode = os.environ.get("WANDB_MODE", "").strip().lower()
    if mode in ("disabled", "dryrun-disabled"):
        return "W&B logging skipped: WANDB_MODE=disabled"
    try:
        import wandb
    except ImportError:
        return "W&B logging skipped: the wandb package is not installed (pip install wandb)"
    group = next((r["wandb_group"] for r in runs if r.get("wandb_group")), None) or sweep_dir.resolve().name
    project = next((r["wandb_project"] for r in runs if r.get("wandb_project")), None) or "flashgpt"
    entity = next((r["wandb_entity"] for r in runs if r.get("wandb_entity")), None)
    columns = ["run", "backend", "seq_len", "status", "tokens_per_sec", "mfu_pct", "peak_gib",
               "final_train_loss", "final_val_loss", "steps"]
    try:
        run = wandb.init(project=project, entity=entity, group=group, job_type="report",
                         name=f"report-{sweep_dir.resolve().name}", dir=str(out_dir),
                         config={"sweep_dir": str(sweep_dir), "n_runs": len(runs)})
        table = wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in runs])
        run.log({"report/table": table, "report/plots": wandb.Image(str(png))})
        run.finish()
    except Exception as exc:  # network, auth, disabled service...
        return f"W&B logging failed ({type(exc).__name__}: {exc}); the local report files are complete"
    return f"W&B: logged report to project {project!r}, group {group!r} (mode {mode or 'default'})"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n\n")[0])
    p.add_argument("sweep_dir", help="Hydra multirun folder (or any folder holding run directories)")
    p.add_argument("--out", default=None, help="output folder (default SWEEP_DIR)")
    p.add_argument("--warmup-frac", type=float, default=0.1,
                   help="fraction of logged steps left out of the tokens/sec and MFU medians (default 0.1)")
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
    out.mkdir(parents=True, exist_ok=True)
    md = markdown(runs, sweep, args.warmup_frac)
    (out / "report.md").write_text(md)
    (out / "report.json").write_text(json.dumps(
        {"sweep_dir": str(sweep), "warmup_frac": args.warmup_frac, "runs": runs}, indent=1) + "\n")
    png = plot(runs, out / "report_sweep.png", title=f"sweep {sweep.resolve().name}")
    print(md)
    print(f"wrote {out / 'report.md'}, {out / 'report.json'}, {png}")
    if args.wandb:
        print(log_to_wandb(runs, png, sweep, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
