"""Loss-curve comparison of training runs against the first one (e.g. flash vs naive loss parity).

    python -m bench.compare RUN_DIR RUN_DIR [...] [--tolerance X] [--val-tolerance Y] [--window 20]
                            [--max-step N] [--out PNG] [--json OUT]

For every run after the first (the reference), on the steps where both logged ``train/loss``: max and mean
|loss_run - loss_ref|; ``window_max_abs_diff``, the largest difference of the means of consecutive windows of
``--window`` points (a trailing partial window dropped), which averages out batch noise and is what
``--tolerance`` bounds; ``final_val_abs_diff`` at the last common ``val/loss`` step after step 0 (the
untrained model, equal for one seed whatever the backend), bounded by ``--val-tolerance``.

Config keys that differ from the reference's (all but those that do not change a curve: backend, out_dir,
W&B, checkpoints...) are named in a warning and in the JSON's ``config_differences``; a run without a
config (a bare metrics.jsonl) is named in a warning, since nothing can be checked. A run that ended early
(diverged, oom, interrupted) is compared over its logged steps and named in the check column; an unfinished
run (summary "running": still training or killed) is never "ok" but "not checked". The check column: ok,
FAIL, not checked, or "—" without tolerances.

Exit status: 0 all within tolerance (or none given), 1 a tolerance exceeded or not checkable (no aligned
steps, a non-finite loss, an unfinished run), 2 bad input (missing run or metrics.jsonl, no train/loss, fewer
than two runs).
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

from bench import common

# Config keys (dotted prefixes) that do not change what a loss curve means: the backend under comparison
# (its variants, attention.window and attention.document_mask, do and are reported), where and how the run
# is recorded, bookkeeping, file paths (the same corpus elsewhere: its name and tokenizer are compared),
# the folder the run started in and the group options (whose keys are compared themselves).
CONFIG_KEYS_IGNORED = (
    "attention.name attention.backend attention.sdpa_backend out_dir run_name wandb logger checkpoint "
    "resume hydra parity perf debug oom_exit_code log_interval nonfinite device data.source data.dir "
    "derived.cwd derived.group_choices"
).split()


@dataclass
class Run:
    """One run's loss curves: ``train``/``val`` map step -> loss."""

    path: Path
    label: str
    train: dict[int, float]
    val: dict[int, float]
    config: dict = field(default_factory=dict)


def label_of(cfg: dict, summary: dict) -> str | None:
    """'<backend> N=<seq_len>', plus an explicit dtype (compared: float32 / bfloat16) and the attention
    variants (' w=<window>', ' doc-mask', ' attn-drop=<p>') and ablation keys (' kv=<n_kv_head>', ' rope',
    ' qk-norm', ' cap=<softcap>'); None when the config names no backend."""
    if (backend := common.attention_label(cfg, summary)) is None:
        return None
    label = backend + (f" N={n}" if (n := common.seq_len_of(cfg, summary)) is not None else "")
    if (dtype := common.cfg_get(cfg, "dtype")) in ("float32", "bfloat16"):
        no_tf32 = dtype == "float32" and common.cfg_get(cfg, "tf32") is False
        label += f" {dtype}" + (" no-TF32" if no_tf32 else "")
    label += f" w={w}" if common.plain(w := common.cfg_get(cfg, "attention.window")) else ""
    label += " doc-mask" if common.cfg_get(cfg, "attention.document_mask") is True else ""
    p = common.cfg_get(cfg, "model.attn_dropout")
    label += f" attn-drop={p:g}" if isinstance(p, (int, float)) and p > 0 else ""
    # the ablation keys, so a sweep's curves say which run is which
    label += f" kv={h}" if common.plain(h := common.cfg_get(cfg, "model.n_kv_head")) else ""
    label += " rope" if common.cfg_get(cfg, "model.pos_emb") == "rope" else ""
    label += " qk-norm" if common.cfg_get(cfg, "model.qk_norm") is True else ""
    c = common.cfg_get(cfg, "attention.softcap")
    return label + (f" cap={c:g}" if isinstance(c, (int, float)) and not isinstance(c, bool) else "")


def load_run(path: str | Path) -> Run:
    """A run directory (or its metrics.jsonl), labelled by `label_of` or else the folder name. RunDirError
    when the folder or metrics.jsonl is missing or holds no train/loss."""
    path = Path(path)
    run_dir = path.parent if path.is_file() else path
    if not path.exists():
        raise common.RunDirError(f"run directory {path} does not exist")
    rows = common.read_metrics(path, required=True)
    if not (train := common.series(rows, "train/loss")):
        jsonl = path if path.is_file() else run_dir / "metrics.jsonl"  # an empty file: not its folder's
        raise common.RunDirError(f"{jsonl} holds no train/loss (did the run stop before its first log step?)")
    cfg = common.read_config(run_dir)
    label = label_of(cfg, common.read_summary(run_dir)) or run_dir.resolve().name
    return Run(run_dir, label, train, common.series(rows, "val/loss"), cfg)


def flatten(cfg: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in cfg.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def config_differences(ref: dict, other: dict, ignored: Sequence[str] = CONFIG_KEYS_IGNORED) -> dict:
    """{dotted key: (ref value, other value)} of the leaf keys whose values differ (None where missing),
    keys under an `ignored` prefix left out; {} when either config is unknown."""
    if not ref or not other:
        return {}
    a, b = flatten(ref), flatten(other)
    # a bare `attention` leaf is the backend name of older configs (attention: flash)
    skip = lambda k: k == "attention" or any(k == p or k.startswith(p + ".") for p in ignored)
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if not skip(k) and a.get(k) != b.get(k)}


def window_means(x: np.ndarray, window: int) -> np.ndarray:
    """Means of consecutive windows of `window` points (trailing partial window dropped, unless there are
    fewer points than one window: then one window of all)."""
    if len(x) == 0:
        return np.empty(0)
    w = min(max(1, window), len(x))
    return x[: len(x) // w * w].reshape(-1, w).mean(axis=1)


def compare_pair(ref: Run, run: Run, window: int = 20) -> dict:
    """Differences of `run` against `ref` (module docstring): floats (NaN for a non-finite loss), or None."""
    steps = sorted(set(ref.train) & set(run.train))
    a, b = (np.array([r.train[s] for s in steps], dtype=np.float64) for r in (ref, run))
    out = dict(label=run.label, path=str(run.path), aligned_steps=len(steps), window=window)
    out |= dict(first_step=steps[0] if steps else None, last_step=steps[-1] if steps else None)
    out |= dict(max_abs_diff=None, mean_abs_diff=None, window_max_abs_diff=None, n_windows=0)
    if steps:
        wd = np.abs(window_means(b, window) - window_means(a, window))
        out |= dict(max_abs_diff=float(np.max(np.abs(b - a))), mean_abs_diff=float(np.mean(np.abs(b - a))))
        out |= dict(window_max_abs_diff=float(np.max(wd)), n_windows=len(wd))
    vsteps = sorted(s for s in set(ref.val) & set(run.val) if s > 0)  # step 0: the untrained model
    s = vsteps[-1] if vsteps else None
    out |= dict(val_step=s, final_val_abs_diff=abs(run.val[s] - ref.val[s]) if vsteps else None)
    return out | (dict(val_ref=ref.val[s], val_run=run.val[s]) if vsteps else {})


def check_tolerances(result: dict, tolerance: float | None, val_tolerance: float | None) -> list[str]:
    """Messages for every exceeded or uncheckable tolerance; NaN never passes (a non-finite loss at any
    aligned step fails --tolerance, also in the dropped partial window)."""
    msgs = []  # each prefixed with the run's label at the end
    if tolerance is not None:
        if (x := result["window_max_abs_diff"]) is None:
            msgs.append("no aligned train/loss steps with the reference, --tolerance cannot be checked")
        elif not math.isfinite(worst := result["max_abs_diff"]):
            msgs.append(f"non-finite train loss at an aligned step (max|Δ| = {worst}), --tolerance fails")
        elif not x <= tolerance:
            msgs.append(f"windowed train-loss diff {x:.4g} > --tolerance {tolerance:g}")
    if val_tolerance is not None:
        if (x := result["final_val_abs_diff"]) is None:
            msgs.append(
                "no common val/loss step after step 0 (the untrained model) with the reference, "
                "--val-tolerance cannot be checked"
            )
        elif not x <= val_tolerance:
            step = result["val_step"]
            msgs.append(f"final val-loss diff {x:.4g} (step {step}) > --val-tolerance {val_tolerance:g}")
    return [f"{result['label']}: {m}" for m in msgs]


def table(ref: Run, results: Sequence[dict], window: int) -> str:
    """Markdown table of the comparisons, reference first; the check column: ok, FAIL, not checked, or "—"
    without tolerances, with the runs that ended early in brackets."""
    f = lambda x: "—" if x is None else format(x, ".4g")

    def check(r: dict) -> str:
        if r["failures"] or r["not_checked"]:
            return "FAIL" if r["failures"] else "not checked"
        cell = "ok" if r["tolerance_checked"] else "—"
        return f"{cell} ({r['ended_early']})" if r["ended_early"] else cell

    head = ["#", "run", "aligned", "max|Δ|", "mean|Δ|", f"win{window} max|Δ|", "val step", "|Δ val|", "check"]
    rows = [[0, ref.label + " (reference)", len(ref.train), *[""] * 6]]
    for i, r in enumerate(results, 1):
        nums = [f(r[k]) for k in ("max_abs_diff", "mean_abs_diff", "window_max_abs_diff")]
        val = [r["val_step"] if r["val_step"] is not None else "—", f(r["final_val_abs_diff"])]
        rows.append([i, r["label"], r["aligned_steps"], *nums, *val, check(r)])
    return "\n".join(common.md_table(head, rows))


def plot(ref: Run, runs: Sequence[Run], path: Path, window: int) -> Path:
    """Top: train loss (lines) and val loss (dashed) of every run. Bottom: run − reference per aligned step
    (thin) and per window (thick steps)."""
    fig, axes = common.subplots(2, 1, w=9.0, sharex=True)
    top, bottom = axes[0][0], axes[1][0]
    for i, run in enumerate([ref, *runs]):
        color = f"C{i % 10}"
        top.plot(list(run.train), list(run.train.values()), color=color, lw=1.0, label=f"{run.label} train")
        if run.val:
            kw = dict(color=color, ls="--", marker="o", ms=3, label=f"{run.label} val")
            top.plot(list(run.val), list(run.val.values()), **kw)
        if not (steps := sorted(set(ref.train) & set(run.train)) if i else []):
            continue
        a, b = np.array([ref.train[s] for s in steps]), np.array([run.train[s] for s in steps])
        bottom.plot(steps, b - a, color=color, lw=0.6, alpha=0.6, label=f"{run.label} − ref (per step)")
        w = min(max(1, window), len(steps))
        centers = [steps[j * w + w // 2] for j in range(len(steps) // w)]
        wd, label = window_means(b, window) - window_means(a, window), f"{run.label} − ref ({w}-pt windows)"
        bottom.step(centers, wd, where="mid", color=color, lw=2.0, label=label)
    bottom.axhline(0.0, color="k", lw=0.5)
    top.set(ylabel="loss", title=f"loss curves (reference: {ref.label})")
    bottom.set(ylabel="loss − reference", xlabel="step")
    common.finish_axes(top)
    common.finish_axes(bottom)
    return common.save_figure(fig, path)


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, (dict, list)):
        return {k: _jsonable(v) for k, v in x.items()} if isinstance(x, dict) else [_jsonable(v) for v in x]
    return x


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("runs", nargs="+", help="run directories (or metrics.jsonl files); the first is the reference")
    add("--tolerance", type=float, help="max windowed train-loss difference (exit 1 when exceeded)")
    add("--val-tolerance", type=float, help="max final val-loss difference (exit 1 when exceeded)")
    add("--window", type=common.positive, default=20, help="points per averaging window (default 20)")
    add("--max-step", type=int, help="compare only steps <= this (e.g. the first 300 of longer runs)")
    add("--out", help="PNG path (default: compare.png in the first run's directory)")
    add("--json", help="also write the results as JSON here")
    args = p.parse_args(argv)
    for flag, tol in (("--tolerance", args.tolerance), ("--val-tolerance", args.val_tolerance)):
        if tol is not None and not tol >= 0:  # below 0 (or NaN) every run would fail it
            p.error(f"{flag} must be >= 0 (a loss difference), got {tol:g}; e.g. {flag} 0.05")
    if len(args.runs) < 2:
        return common.error("give at least two runs (the first is the reference)")
    try:
        runs = [load_run(r) for r in args.runs]
    except common.RunDirError as exc:
        return common.error(str(exc))
    labels = [r.label for r in runs]
    for r in runs:  # duplicate labels made unique with the folder name
        if labels.count(r.label) > 1:
            r.label = f"{r.label} ({r.path.resolve().name})"
        if args.max_step is not None:
            r.train, r.val = ({s: v for s, v in d.items() if s <= args.max_step} for d in (r.train, r.val))
    ref, others = runs[0], runs[1:]
    diffs = {run.label: config_differences(ref.config, run.config) for run in others}
    if unknown := [r for r in runs if not r.config]:  # a bare metrics.jsonl: nothing to compare it by
        common.log(
            f"warning: no config (config.resolved.yaml or .hydra/config.yaml) for "
            f"{', '.join(f'{r.label} ({r.path})' for r in unknown)}: its tokenizer, max_steps and other "
            "settings cannot be checked against the other runs'; the curves may not be comparable"
        )
    for label, diff in diffs.items():
        if diff:
            what = "; ".join(f"{k}: {va!r} vs {vb!r}" for k, (va, vb) in diff.items())
            common.log(
                f"warning: {label} and the reference {ref.label} differ in config ({what}); the curves "
                "differ for more than the attention backend"
            )
    statuses, unfinished = {}, {}
    for r in runs:
        status, note = common.run_status(r.path)
        statuses[r.label] = status or "ok"  # no summary (a bare metrics.jsonl): nothing says otherwise
        if statuses[r.label] in common.UNFINISHED_STATUSES:
            unfinished[r.label] = note or "still running (a live process holds its run directory)"
        elif statuses[r.label] != "ok":  # diverged, oom or interrupted: it stops early
            common.log(f"warning: {r.label} ended with status {status!r}; only its logged steps are compared")
    checked = args.tolerance is not None or args.val_tolerance is not None
    results, failures, not_checked = [], [], []
    for run in others:
        res = compare_pair(ref, run, args.window)
        pair = list(dict.fromkeys((ref.label, run.label)))
        early = [lab for lab in pair if statuses[lab] != "ok" and lab not in unfinished]
        res["config_differences"] = {k: list(v) for k, v in diffs[run.label].items()}
        res["tolerance_checked"] = checked
        incomplete = [f"{lab}: status {statuses[lab]!r} (not a complete run)" for lab in early if checked]
        res["failures"] = check_tolerances(res, args.tolerance, args.val_tolerance) + incomplete
        # with or without tolerances: a curve that is still growing (or was cut off) cannot pass
        why = "the run is unfinished, so its comparison is not meaningful"
        res["not_checked"] = [f"{lab}: {unfinished[lab]}; {why}" for lab in pair if lab in unfinished]
        res["ended_early"] = ", ".join(f"{lab} {statuses[lab]}" for lab in early) or None
        failures += res["failures"]
        not_checked += [m for m in res["not_checked"] if m not in not_checked]
        results.append(res)
    print(table(ref, results, args.window))
    png = Path(args.out) if args.out else ref.path / "compare.png"
    try:
        print(f"\nwrote {plot(ref, others, png, args.window)}")
    except OSError as exc:  # a colleague's runs, a read-only mount: the table above is the result
        common.log(f"note: could not write {png} ({exc.strerror or exc}); --out PNG writes it elsewhere")
    if args.json:
        out = dict(reference=dict(label=ref.label, path=str(ref.path)), window=args.window)
        out |= dict(tolerance=args.tolerance, val_tolerance=args.val_tolerance, results=results)
        out["passed"] = not failures and not not_checked
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(_jsonable(out), indent=1) + "\n")
        print(f"wrote {args.json}")
    if failures:
        print("\nFAILED:\n  " + "\n  ".join(failures))
    if not_checked:
        print("\nNOT CHECKED (unfinished runs):\n  " + "\n  ".join(not_checked))
    if checked and not failures and not not_checked:
        print("\nall within tolerance")
    return 1 if failures or not_checked else 0


if __name__ == "__main__":
    sys.exit(main())
