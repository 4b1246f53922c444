"""Sweep report: one table and one figure for a sweep of training runs (`train.py -m`).

    python -m bench.report SWEEP_DIR [--out DIR] [--wandb] [--warmup-frac 0.1]

Reads every run directory under SWEEP_DIR, prints the report and writes into --out (default SWEEP_DIR)
``report.md`` (all runs, the failed ones with their error, then pivot tables of tokens/sec, MFU %, peak GiB
and final train loss: rows seq_len, a column per backend), ``report.json`` (one object per run) and
``report_sweep.png`` (the same against seq_len, failed runs marked at the top). A folder that cannot be
written (a colleague's runs, a read-only mount) costs only the files: a note says which were not written
where, exit status 0.

Figures are each run's summary.json (the trainer's medians), so the report agrees with it; a run whose
summary lacks one falls back to metrics.jsonl (the median after the first ``--warmup-frac`` of the logged
values, the largest peak, the last loss), marked † and named in ``sources``. ``--wandb`` logs the table and
figure to a new run of job_type "report" in the sweep's group and project, in the trainer's
``wandb.mode=auto`` (an online run that cannot start is retried offline, with its ``wandb sync`` command).
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

from bench import common
from bench.compare import config_differences, flatten

METRICS = (
    ("tokens_per_sec", "tokens/sec", "{:,.0f}"),
    ("mfu_pct", "MFU %", "{:.1f}"),
    ("peak_gib", "peak GiB", "{:.2f}"),
    ("final_train_loss", "final train loss", "{:.4f}"),
)
COLUMNS = ("run", "backend", "seq_len", "status", *(m[0] for m in METRICS), "final_val_loss", "steps")


def post_warmup_median(values: Sequence[float], warmup_frac: float = 0.1) -> float | None:
    """Median of `values` after dropping the first ceil(warmup_frac * n) (at least one of n >= 2, none of
    one); non-finite values ignored; None when nothing is left."""
    n = len(values)
    drop = 0 if n <= 1 else min(n - 1, max(1, math.ceil(warmup_frac * n)))
    kept = [v for v in values[drop:] if common.finite(v)]
    return float(statistics.median(kept)) if kept else None


def error_text(summary: dict, status: str) -> str | None:
    """What went wrong in a run that did not end "ok", on one line; None for an ok run."""
    if status == "ok":
        return None
    if err := summary.get("error"):
        return " ".join(str(err).split())
    if status == "interrupted":
        return f"interrupted by {summary.get('signal', 'a signal')} after step {summary.get('steps', '?')}"
    if status == "running":
        return "no ending recorded: still running, or killed without a chance to record it"
    return "no error recorded (no summary.json)" if status == "no summary" else None


def summarize_run(run_dir: Path, sweep_dir: Path, warmup_frac: float = 0.1) -> dict:
    """One run's row: backend, seq_len, status and the figures of the module docstring."""
    cfg, summary = common.read_config(run_dir), common.read_summary(run_dir)
    rows = common.read_metrics(run_dir)
    status = str(summary.get("status", "no summary" if not summary else "unknown"))
    true, killed_note = common.run_status(run_dir, summary)  # a dead "running" run is "killed"
    status = str(true) if killed_note is not None else status
    sources: dict[str, str] = {}

    def figure(name: str, key: str, summary_key: str, fallback: str) -> float | None:
        """summary.json's figure (NaN kept: a non-finite run), else `fallback` of the logged values."""
        v = summary.get(summary_key)
        if common.finite(v) or (fallback != "max" and isinstance(v, float)):  # NaN or inf: a float
            sources[name] = "summary.json"
            return float(v)
        logged = list(common.series(rows, key).values())
        if fallback == "median":
            value = post_warmup_median(logged, warmup_frac)
        else:  # the largest finite value, or the last
            logged = [v for v in logged if fallback == "last" or common.finite(v)]
            value = (max(logged) if fallback == "max" else logged[-1]) if logged else None
        if value is not None:
            sources[name] = f"metrics.jsonl {fallback}"
        return value

    tps = figure("tokens_per_sec", "perf/tokens_per_sec", "perf/tokens_per_sec", "median")
    mfu = figure("mfu_pct", "perf/mfu", "perf/mfu", "median")
    peak = figure("peak_gib", "mem/peak_gib", "mem/peak_gib", "max")
    steps = summary.get("steps")
    if (steps is None or killed_note is not None) and rows:  # a killed run's summary has its start step
        steps = max((int(r["step"]) for r in rows if isinstance(r.get("step"), (int, float))), default=None)
    final_val = figure("final_val_loss", "val/loss", "final/val_loss", "last")
    val_steps = list(common.series(rows, "val/loss"))
    if final_val is not None and val_steps and max(val_steps) == 0 and (steps or 0) > 0:
        # the only eval was the untrained model's (eval.at_start; stopped before its first interval)
        final_val, sources["final_val_loss"] = None, "left out: the only eval was at step 0 (untrained)"
    row = dict(run=str(run_dir.relative_to(sweep_dir)) if run_dir != sweep_dir else ".")
    row |= dict(backend=common.attention_label(cfg, summary) or "?", seq_len=common.seq_len_of(cfg, summary))
    row |= dict(status=status, tokens_per_sec=tps, mfu_pct=None if mfu is None else 100.0 * mfu)
    final_train = figure("final_train_loss", "train/loss", "final/train_loss", "last")
    row |= dict(peak_gib=peak, final_train_loss=final_train, final_val_loss=final_val, steps=steps)
    row |= dict(sources=sources, error=killed_note or error_text(summary, status))
    return row | {f"wandb_{k}": common.cfg_get(cfg, f"wandb.{k}") for k in ("group", "project", "entity")}


def backends_of(runs: Sequence[dict]) -> list[str]:
    """Display order: naive, sdpa*, flash, then the rest alphabetically."""
    rank = lambda b: ({"naive": 0, "sdpa": 1, "flash": 3}.get(b, 2 if b.startswith("sdpa") else 4), b)
    return sorted({r["backend"] for r in runs}, key=rank)


def _label_variants(runs: list[dict], configs: list[dict]) -> None:
    """Runs of one (backend, seq_len) that differ in other keys (an ablation sweep, model.qk_norm=false,true)
    get those keys in their backend label, ``sdpa (pos_emb=rope, qk_norm=True)``, so the tables keep them
    apart instead of listing four runs in one cell (the keys bench.compare warns about)."""
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(runs):
        groups.setdefault((r["backend"], r["seq_len"]), []).append(i)
    for first, *rest in (m for m in groups.values() if len(m) > 1):
        keys = sorted({k for i in rest for k in config_differences(configs[first], configs[i])})
        for i in (first, *rest) if keys else ():
            flat = flatten(configs[i])
            shown = ", ".join(f"{k.split('.')[-1]}={flat.get(k)}" for k in keys)
            runs[i]["backend"] = f"{runs[i]['backend']} ({shown})"


def collect(sweep_dir: str | Path, warmup_frac: float = 0.1) -> list[dict]:
    """Rows of every run under `sweep_dir`, by (backend, seq_len, run); RunDirError when there is none."""
    sweep_dir = Path(sweep_dir)
    if not (dirs := common.find_run_dirs(sweep_dir)):
        raise common.RunDirError(
            f"no run directories (with summary.json, metrics.jsonl or .hydra/config.yaml) under {sweep_dir}"
        )
    runs = [summarize_run(d, sweep_dir, warmup_frac) for d in dirs]
    _label_variants(runs, [common.read_config(d) for d in dirs])
    order = {b: i for i, b in enumerate(backends_of(runs))}
    key = lambda r: (order[r["backend"]], r["seq_len"] if r["seq_len"] is not None else -1, r["run"])
    return sorted(runs, key=key)


def _fmt(run: dict, key: str, fmt: str) -> str:
    v = run.get(key)
    if v is None or not common.finite(v):
        return "—"
    return fmt.format(v) + ("†" if run["sources"].get(key, "summary.json") != "summary.json" else "")


def markdown(runs: Sequence[dict], sweep_dir: Path, warmup_frac: float) -> str:
    """report.md: every run, the failed ones, then one pivot table per metric."""
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    status = lambda r: "OOM" if r["status"] == "oom" else r["status"]
    seq = lambda r: r["seq_len"] if r["seq_len"] is not None else "?"
    lines = [
        f"# Sweep report: {sweep_dir}",
        "",
        f"{len(runs)} runs; generated {now}. Every figure is the run's summary.json: tokens/sec and MFU are "
        "the trainer's medians over its timed steps (after `perf.exclude_first_steps`), peak GiB the "
        "largest memory allocated by tensors (torch.cuda.max_memory_allocated, GiB = 2^30 bytes), final "
        "losses those of the last step. † marks a value read from metrics.jsonl instead because the "
        f"summary lacks it (tokens/sec, MFU: median of the logged steps after the first {warmup_frac:.0%}).",
        "",
        "## All runs",
        "",
    ]
    fmts = [*METRICS, ("final_val_loss", "", "{:.4f}")]
    end = lambda r: [*(_fmt(r, k, f) for k, _, f in fmts), r["steps"] if r["steps"] is not None else "—"]
    rows = [[r["run"], r["backend"], seq(r), status(r), *end(r)] for r in runs]
    head = ["run", "backend", "seq_len", "status", *(t for _, t, _ in METRICS), "final val loss", "steps"]
    lines += common.md_table(head, rows, "---")
    if failed := [r for r in runs if r["status"] != "ok"]:
        error = lambda r: (r["error"] or "—").replace("|", "\\|")
        rows = [[r["run"], r["backend"], seq(r), r["status"], error(r)] for r in failed]
        head = ["run", "backend", "seq_len", "status", "error"]
        lines += ["", "## Failed runs", "", *common.md_table(head, rows, "---")]
    backends, seqs = backends_of(runs), sorted({r["seq_len"] for r in runs if r["seq_len"] is not None})
    cell = lambda r, key, fmt: status(r) if r["status"] != "ok" else _fmt(r, key, fmt)
    several = lambda m, key, fmt: "; ".join(f"{cell(r, key, fmt)} ({r['run']})" for r in m) or "—"
    for key, title, fmt in METRICS:
        rows = []
        for n in seqs:
            match = [[r for r in runs if r["backend"] == b and r["seq_len"] == n] for b in backends]
            rows.append([n, *(cell(m[0], key, fmt) if len(m) == 1 else several(m, key, fmt) for m in match)])
        lines += ["", f"## {title} (rows: seq_len, columns: attention backend)", ""]
        lines += common.md_table(["seq_len", *backends], rows)
    if unknown := [r["run"] for r in runs if r["seq_len"] is None]:
        lines += ["", f"Runs without a seq_len (not in the pivot tables): {', '.join(unknown)}"]
    return "\n".join(lines) + "\n"


def plot(runs: Sequence[dict], path: Path, title: str) -> Path:
    """tokens/sec, peak GiB and MFU % vs seq_len; failed runs as 'x' at the top of each panel."""
    backends = backends_of(runs)
    known = sorted((r for r in runs if r["seq_len"] is not None), key=lambda r: r["seq_len"])
    fig, axes = common.subplots(1, 3, w=5.2, h=4.0)
    panels = (("tokens_per_sec", "tokens / sec"), ("peak_gib", "peak memory, GiB"), ("mfu_pct", "MFU, %"))
    for ax, (key, ylabel) in zip(axes[0], panels, strict=True):
        failed = []
        for c, b in enumerate(backends):
            mine = [r for r in known if r["backend"] == b]
            if ok := [(r["seq_len"], r[key]) for r in mine if r["status"] == "ok" and common.finite(r[key])]:
                ax.plot(*zip(*ok, strict=True), marker="o", ms=4, label=b, color=f"C{c % 10}")
            for st in dict.fromkeys(r["status"] for r in mine if r["status"] != "ok"):
                xs = [r["seq_len"] for r in mine if r["status"] == st]
                failed.append((xs, f"{b} {'OOM' if st == 'oom' else st}", f"C{c % 10}"))
        ax.set(xlabel="seq_len (tokens)", ylabel=ylabel)
        ax.set_ylim(bottom=0)
        common.finish_axes(ax, [r["seq_len"] for r in known], failed)
    return common.save_figure(fig, path, title)


def log_to_wandb(runs: Sequence[dict], png: Path, sweep_dir: Path, out_dir: Path) -> str:
    """Log the table and figure to a new W&B run (module docstring) under `out_dir/wandb/`; returns what
    happened (with the `wandb sync` command of an offline run). Never raises: W&B is optional."""
    from trainer.metrics import resolve_wandb_mode

    if (mode := resolve_wandb_mode("auto")) == "disabled":
        return "W&B logging skipped: WANDB_MODE=disabled"
    import wandb

    first = lambda key: next((r[key] for r in runs if r.get(key)), None)
    group, project = first("wandb_group") or sweep_dir.resolve().name, first("wandb_project") or "flashgpt"
    columns, notes = list(COLUMNS), []
    init = dict(project=project, entity=first("wandb_entity"), group=group, job_type="report")
    init |= dict(name=f"report-{sweep_dir.resolve().name}", dir=str(out_dir))
    init["config"] = {"sweep_dir": str(sweep_dir), "n_runs": len(runs)}
    for attempt in (mode, "offline") if mode == "online" else (mode,):
        try:
            run = wandb.init(**init, mode=attempt)
            table = wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in runs])
            run.log({"report/table": table, "report/plots": wandb.Image(str(png))})
            run_dir = Path(run.dir).parent  # .../wandb/offline-run-<time>-<id>
            run.finish()
        except Exception as exc:  # network, auth, disabled service...
            notes.append(f"W&B {attempt} run failed ({type(exc).__name__}: {exc})")
            continue
        text = f"W&B: logged report to project {project!r}, group {group!r} (mode {attempt})"
        sync = f"; upload it later with: wandb sync {run_dir}" if attempt == "offline" else ""
        return "; ".join([*notes, text + sync])
    return "; ".join(notes) + "; the local report files are complete"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("sweep_dir", help="Hydra multirun folder (or any folder holding run directories)")
    add("--out", help="output folder (default SWEEP_DIR)")
    add("--warmup-frac", type=float, default=0.1, help="logged steps left out of the medians (0.1)")
    add("--wandb", action="store_true", help="also log table and plots to W&B")
    args = p.parse_args(argv)
    if not 0.0 <= args.warmup_frac < 1.0:
        p.error(f"--warmup-frac must be in [0, 1), got {args.warmup_frac}")
    sweep = Path(args.sweep_dir)
    out = Path(args.out) if args.out else sweep
    try:
        runs = collect(sweep, args.warmup_frac)
    except common.RunDirError as exc:
        return common.error(str(exc))
    md = markdown(runs, sweep, args.warmup_frac)
    print(md)
    report = json.dumps(dict(sweep_dir=str(sweep), warmup_frac=args.warmup_frac, runs=runs), indent=1) + "\n"
    written, png = [], out / "report_sweep.png"
    try:  # a folder that cannot be written (read-only, full) costs only the files: the report is printed
        out.mkdir(parents=True, exist_ok=True)
        for name, text in (("report.md", md), ("report.json", report)):
            common.write_text(out / name, text)
            written.append(out / name)
        written.append(plot(runs, png, title=f"sweep {sweep.resolve().name}"))
    except OSError as exc:
        left = [n for n in ("report.md", "report.json", png.name) if out / n not in written]
        common.log(
            f"note: could not write {', '.join(left)} in {out} ({exc.strerror or exc}); the report above is "
            "complete; pass --out DIR to write the files elsewhere"
        )
    if written:
        print("wrote " + ", ".join(map(str, written)))
    if args.wandb and png not in written:
        print("W&B logging skipped: no figure written")
    elif args.wandb:
        print(log_to_wandb(runs, png, sweep, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
