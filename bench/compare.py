"""Loss-curve comparison of training runs against the first one (e.g. flash vs naive loss parity).

Usage::

    python -m bench.compare RUN_DIR RUN_DIR [RUN_DIR ...] [--tolerance X] [--val-tolerance Y]
                            [--window 20] [--max-step N] [--out PNG] [--json OUT]

Each RUN_DIR is a run directory written by train.py (or its metrics.jsonl). For every run after the
first (the reference), on the aligned steps (steps where both logged ``train/loss``):

* ``max_abs_diff`` / ``mean_abs_diff``: max and mean of |loss_run - loss_ref| (raw, per step);
* ``window_max_abs_diff``: the aligned points are cut into consecutive non-overlapping windows of
  ``--window`` points (= steps when the loss is logged every step; a trailing partial window is
  dropped; fewer points than one window make one window of all of them), each window is averaged
  per run, and the largest |mean_run - mean_ref| over windows is reported — this averages out
  batch-to-batch noise and is what ``--tolerance`` applies to;
* ``final_val_abs_diff``: |val_run - val_ref| at the last step after step 0 where both logged
  ``val/loss`` (step 0 is the untrained model: two runs of one seed agree there whatever their backends,
  so it is never reported as the difference); ``--val-tolerance`` applies to it.

Before comparing, the runs' configs are compared key by key (all keys except those that do not change the
curves, e.g. the attention backend, out_dir, W&B, checkpoints): a warning lists every key whose value
differs from the reference's (seq_len, max_steps, the LR schedule, batch, seed, model, data...), since
curves of different setups differ for reasons other than the attention kernel. The JSON holds them as
``config_differences``.

A run that is unfinished (its summary.json says "running": still training, or killed, e.g. by SIGKILL,
before it could record an ending; ``bench._rundir.run_status`` tells them apart) is never "ok": its
comparison shows "not checked" and is listed under NOT CHECKED with its last step, with or without
tolerances, since its curve is cut off wherever it stopped.

The table's check column: ok (within the tolerances given), FAIL, not checked (an unfinished run), or
"—" when no tolerance was given, since then nothing was checked; a run that ended early is named there.

Exit status: 0 all within tolerance (or no tolerance given), 1 a tolerance exceeded or could not be
checked (no aligned steps, non-finite loss, an unfinished run; each printed), 2 bad input (missing run
directory or metrics.jsonl, no train/loss, fewer than two runs).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench import _rundir


@dataclass
class Run:
    """One run's loss curves: ``train``/``val`` map step -> loss."""

    path: Path
    label: str
    train: dict[int, float]
    val: dict[int, float]
    config: dict = field(default_factory=dict)


def load_run(path: str | Path) -> Run:
    """Read a run directory (or its metrics.jsonl). Label: '<backend> N=<seq_len>' from the Hydra
    config / summary when known, plus the attention variant ('w=256', 'doc-mask', 'attn-drop=0.1'; see
    `_rundir.variant_label`), else the directory name. Raises RunDirError when the directory or
    metrics.jsonl is missing or holds no train/loss."""
    path = Path(path)
    run_dir = path.parent if path.is_file() else path
    if not path.exists():
        raise _rundir.RunDirError(f"run directory {path} does not exist")
    rows = _rundir.read_metrics(path, required=True)
    train = _rundir.series(rows, "train/loss")
    if not train:
        raise _rundir.RunDirError(
            f"{run_dir}/metrics.jsonl has no 'train/loss' entries "
            f"(was the run stopped before its first log step?)"
        )
    cfg, summary = _rundir.read_config(run_dir), _rundir.read_summary(run_dir)
    backend, seq_len = _rundir.attention_label(cfg, summary), _rundir.seq_len_of(cfg, summary)
    if backend is not None:
        label = backend + (f" N={seq_len}" if seq_len is not None else "")
        dtype = _rundir.cfg_get(cfg, "dtype")
        if dtype in ("float32", "bfloat16"):  # an explicit dtype (not "auto") is part of what is compared
            no_tf32 = dtype == "float32" and _rundir.cfg_get(cfg, "tf32") is False
            label += f" {dtype}" + (" no-TF32" if no_tf32 else "")
        label += _rundir.variant_label(cfg)
    else:
        label = run_dir.resolve().name
    return Run(run_dir, label, train, _rundir.series(rows, "val/loss"), cfg)


# Config keys (dotted prefixes) that do not change what a loss curve means: the backend under comparison
# (its mask variants, attention.window and attention.document_mask, do change it and are reported),
# where and how the run is recorded, run bookkeeping, and file paths (the same corpus lies elsewhere on
# another machine; its name and tokenizer are compared). Every other key that differs is reported.
CONFIG_KEYS_IGNORED = (
    "attention.name",
    "attention.backend",
    "attention.sdpa_backend",
    "out_dir",
    "run_name",
    "wandb",
    "logger",
    "checkpoint",
    "resume",
    "hydra",
    "parity",
    "perf",
    "debug",
    "oom_exit_code",
    "log_interval",
    "nonfinite",
    "device",
    "data.source",
    "data.dir",
    "derived.cwd",  # the folder the run started in
    "derived.group_choices",  # the group options (attention=flash, ...): their keys are compared themselves
)


def _flatten(cfg, prefix: str = "") -> dict:
    out = {}
    for k, v in cfg.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def config_differences(ref: dict, other: dict, ignored: Sequence[str] = CONFIG_KEYS_IGNORED) -> dict:
    """{dotted key: (ref value, other value)} for every leaf key of two run configs (nested dicts, as
    `_rundir.read_config` returns) whose values differ, a key missing on one side giving None there;
    keys equal to or under a prefix in `ignored` are left out. {} when either config is empty (unknown)."""
    if not ref or not other:
        return {}
    a, b = _flatten(ref), _flatten(other)

    def skip(key: str) -> bool:
        # a bare `attention` leaf is the backend name of older configs (attention: flash)
        return key == "attention" or any(key == p or key.startswith(p + ".") for p in ignored)

    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if not skip(k) and a.get(k) != b.get(k)}


def window_means(x: np.ndarray, window: int) -> np.ndarray:
    """Means of consecutive non-overlapping windows of `window` points; a trailing partial window is
    dropped unless there are fewer than `window` points (then one window of all). Empty -> empty."""
    n = len(x)
    if n == 0:
        return np.empty(0)
    w = min(max(1, window), n)
    k = n // w
    return x[: k * w].reshape(k, w).mean(axis=1)


def compare_pair(ref: Run, run: Run, window: int = 20) -> dict:
    """Differences of `run` against `ref` (see module docstring). Values are floats (NaN when a loss
    is non-finite) or None when there is nothing to compare."""
    steps = sorted(set(ref.train) & set(run.train))
    a = np.array([ref.train[s] for s in steps], dtype=np.float64)
    b = np.array([run.train[s] for s in steps], dtype=np.float64)
    out: dict = {
        "label": run.label,
        "path": str(run.path),
        "aligned_steps": len(steps),
        "first_step": steps[0] if steps else None,
        "last_step": steps[-1] if steps else None,
        "window": window,
    }
    if steps:
        diff = np.abs(b - a)
        wd = np.abs(window_means(b, window) - window_means(a, window))
        out.update(
            max_abs_diff=float(np.max(diff)),
            mean_abs_diff=float(np.mean(diff)),
            window_max_abs_diff=float(np.max(wd)),
            n_windows=int(len(wd)),
        )
    else:
        out.update(max_abs_diff=None, mean_abs_diff=None, window_max_abs_diff=None, n_windows=0)
    vsteps = sorted(s for s in set(ref.val) & set(run.val) if s > 0)  # step 0: the untrained model
    if vsteps:
        s = vsteps[-1]
        out.update(
            val_step=s,
            final_val_abs_diff=float(abs(run.val[s] - ref.val[s])),
            val_ref=ref.val[s],
            val_run=run.val[s],
        )
    else:
        out.update(val_step=None, final_val_abs_diff=None)
    return out


def check_tolerances(result: dict, tolerance: float | None, val_tolerance: float | None) -> list[str]:
    """Messages for every exceeded (or uncheckable) tolerance of one comparison; [] when fine.
    NaN never passes: a non-finite loss at any aligned step fails --tolerance even when it lies in
    the dropped trailing partial window."""
    msgs = []
    if tolerance is not None:
        x = result["window_max_abs_diff"]
        if x is None:
            msgs.append(
                f"{result['label']}: no aligned train/loss steps with the reference, "
                f"--tolerance cannot be checked"
            )
        elif not math.isfinite(result["max_abs_diff"]):
            msgs.append(
                f"{result['label']}: non-finite train loss at an aligned step "
                f"(max|Δ| = {result['max_abs_diff']}), --tolerance fails"
            )
        elif not x <= tolerance:
            msgs.append(f"{result['label']}: windowed train-loss diff {x:.4g} > --tolerance {tolerance:g}")
    if val_tolerance is not None:
        x = result["final_val_abs_diff"]
        if x is None:
            msgs.append(
                f"{result['label']}: no common val/loss step after step 0 (the untrained model) "
                f"with the reference, --val-tolerance cannot be checked"
            )
        elif not x <= val_tolerance:
            msgs.append(
                f"{result['label']}: final val-loss diff {x:.4g} (step {result['val_step']}) > "
                f"--val-tolerance {val_tolerance:g}"
            )
    return msgs


def _f(x, spec: str = ".4g") -> str:
    return "—" if x is None else format(x, spec)


def _check_cell(r: dict) -> str:
    """The table's check column: FAIL, not checked (an unfinished run), ok (within the tolerances), or
    "—" when no tolerance was given (nothing was checked); a run that ended early (interrupted,
    diverged, oom: compared over its logged steps only) is named after it."""
    if r.get("failures"):
        return "FAIL"
    if r.get("not_checked"):
        return "not checked"
    cell = "ok" if r.get("tolerance_checked") else "—"
    return f"{cell} ({r['ended_early']})" if r.get("ended_early") else cell


def text_table(ref: Run, results: Sequence[dict], window: int) -> str:
    """Fixed-width text table of the comparisons (reference first)."""
    head = ["#", "run", "aligned", "max|Δ|", "mean|Δ|", f"win{window} max|Δ|", "val step", "|Δ val|", "check"]
    rows = [["0", ref.label + " (reference)", str(len(ref.train)), "", "", "", "", "", ""]]
    for i, r in enumerate(results, 1):
        val_step = str(r["val_step"]) if r["val_step"] is not None else "—"
        rows.append(
            [
                str(i),
                r["label"],
                str(r["aligned_steps"]),
                _f(r["max_abs_diff"]),
                _f(r["mean_abs_diff"]),
                _f(r["window_max_abs_diff"]),
                val_step,
                _f(r["final_val_abs_diff"]),
                _check_cell(r),
            ]
        )
    widths = [max(len(row[j]) for row in [head] + rows) for j in range(len(head))]

    def fmt(row: list[str]) -> str:
        cells = zip(row, widths, strict=True)
        return "  ".join(c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(cells))

    return "\n".join([fmt(head), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows])


def plot(ref: Run, runs: Sequence[Run], path: Path, window: int) -> Path:
    """Top: train loss (lines) and val loss (dashed, markers) of every run. Bottom: run − reference
    train loss per aligned step (thin) and per window (thick steps)."""
    from bench import _plot

    fig, axes = _plot.subplots(2, 1, panel_w=9.0, panel_h=3.6, sharex=True)
    top, bottom = axes[0][0], axes[1][0]
    for i, run in enumerate([ref, *runs]):
        color = f"C{i % 10}"
        top.plot(list(run.train), list(run.train.values()), color=color, lw=1.0, label=f"{run.label} train")
        if run.val:
            top.plot(
                list(run.val),
                list(run.val.values()),
                color=color,
                ls="--",
                marker="o",
                ms=3,
                label=f"{run.label} val",
            )
        if i == 0:
            continue
        steps = sorted(set(ref.train) & set(run.train))
        if not steps:
            continue
        a = np.array([ref.train[s] for s in steps])
        b = np.array([run.train[s] for s in steps])
        bottom.plot(steps, b - a, color=color, lw=0.6, alpha=0.6, label=f"{run.label} − ref (per step)")
        w = min(max(1, window), len(steps))
        k = len(steps) // w
        if k:
            wd = window_means(b, window) - window_means(a, window)
            centers = [steps[j * w + w // 2] for j in range(k)]
            bottom.step(
                centers, wd, where="mid", color=color, lw=2.0, label=f"{run.label} − ref ({w}-pt windows)"
            )
    bottom.axhline(0.0, color="k", lw=0.5)
    top.set_ylabel("loss")
    top.set_title(f"loss curves (reference: {ref.label})")
    bottom.set_ylabel("loss − reference")
    bottom.set_xlabel("step")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    return _plot.save(fig, path)


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_jsonable(v) for v in x]
    return x


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.compare", description="Compare loss curves of runs against the first run."
    )
    p.add_argument(
        "runs", nargs="+", help="run directories (or metrics.jsonl files); the first is the reference"
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="max allowed windowed train-loss difference (exit 1 when exceeded)",
    )
    p.add_argument(
        "--val-tolerance",
        type=float,
        default=None,
        help="max allowed final val-loss difference (exit 1 when exceeded)",
    )
    p.add_argument("--window", type=int, default=20, help="points per averaging window (default 20)")
    p.add_argument(
        "--max-step",
        type=int,
        default=None,
        help="compare only steps <= this (e.g. the first 300 of longer runs)",
    )
    p.add_argument("--out", default=None, help="PNG path (default: compare.png in the first run's directory)")
    p.add_argument("--json", default=None, help="also write the results as JSON here")
    args = p.parse_args(argv)
    if args.window < 1:
        p.error("--window must be >= 1")
    if len(args.runs) < 2:
        print("error: give at least two runs (the first is the reference)", file=sys.stderr)
        return 2
    try:
        runs = [load_run(r) for r in args.runs]
    except _rundir.RunDirError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    labels = [r.label for r in runs]
    for r in runs:  # make duplicate labels unique with the folder name
        if labels.count(r.label) > 1:
            r.label = f"{r.label} ({r.path.resolve().name})"
    if args.max_step is not None:
        for r in runs:
            r.train = {s: v for s, v in r.train.items() if s <= args.max_step}
            r.val = {s: v for s, v in r.val.items() if s <= args.max_step}
    ref, others = runs[0], runs[1:]
    results, failures = [], []
    diffs = {run.label: config_differences(ref.config, run.config) for run in others}
    for label, diff in diffs.items():
        if diff:
            what = "; ".join(f"{k}: {va!r} vs {vb!r}" for k, (va, vb) in diff.items())
            print(
                f"warning: {label} and the reference {ref.label} differ in config ({what}); the curves "
                "differ for more than the attention backend",
                file=sys.stderr,
            )
    statuses, unfinished = {}, {}
    for r in runs:
        status, note = _rundir.run_status(r.path)
        statuses[r.label] = status or "ok"  # no summary (a bare metrics.jsonl): nothing says otherwise
        if statuses[r.label] in _rundir.UNFINISHED_STATUSES:
            unfinished[r.label] = note or "still running (a live process holds its run directory)"
    for label, status in statuses.items():
        if status != "ok" and label not in unfinished:  # a diverged, OOM or interrupted run: stops early
            print(
                f"warning: {label} ended with status {status!r}; only its logged steps are compared",
                file=sys.stderr,
            )
    not_checked = []
    checked = args.tolerance is not None or args.val_tolerance is not None
    for run in others:
        res = compare_pair(ref, run, args.window)
        res["config_differences"] = {k: list(v) for k, v in diffs[run.label].items()}
        res["failures"] = check_tolerances(res, args.tolerance, args.val_tolerance)
        res["tolerance_checked"] = checked
        pair = list(dict.fromkeys((ref.label, run.label)))
        # a run that ended early (interrupted, diverged, oom) is compared over its logged steps only: say so
        early = [lab for lab in pair if statuses[lab] != "ok" and lab not in unfinished]
        if checked:
            res["failures"] += [f"{lab}: status {statuses[lab]!r} (not a complete run)" for lab in early]
        # with or without tolerances: a curve that is still growing (or was cut off) cannot pass
        res["not_checked"] = [
            f"{lab}: {unfinished[lab]}; the run is unfinished, so its comparison is not meaningful"
            for lab in pair
            if lab in unfinished
        ]
        res["ended_early"] = ", ".join(f"{lab} {statuses[lab]}" for lab in early) or None
        failures += res["failures"]
        not_checked += [m for m in res["not_checked"] if m not in not_checked]
        results.append(res)
    print(text_table(ref, results, args.window))
    png = plot(ref, others, Path(args.out) if args.out else ref.path / "compare.png", args.window)
    print(f"\nwrote {png}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps(
                _jsonable(
                    {
                        "reference": {"label": ref.label, "path": str(ref.path)},
                        "window": args.window,
                        "tolerance": args.tolerance,
                        "val_tolerance": args.val_tolerance,
                        "results": results,
                        "passed": not failures and not not_checked,
                    }
                ),
                indent=1,
            )
            + "\n"
        )
        print(f"wrote {args.json}")
    if failures:
        print("\nFAILED:\n  " + "\n  ".join(failures))
    if not_checked:
        print("\nNOT CHECKED (unfinished runs):\n  " + "\n  ".join(not_checked))
    if failures or not_checked:
        return 1
    if checked:
        print("\nall within tolerance")
    return 0


if __name__ == "__main__":
    sys.exit(main())
