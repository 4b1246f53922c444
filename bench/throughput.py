"""Training throughput of the three attention backends across context lengths (run on the GPU).

Runs the user's training command, `python train.py attention=A seq_len=N` (the defaults: GPT-2 124M,
bf16, torch.compile, the token-based batch), for every backend and seq_len in one invocation, each in a
fresh process, with only the run length and the bookkeeping changed (no evaluation passes or
checkpoints, W&B off). Per cell it records the median tokens/sec over the timed steps, MFU, peak GPU
memory, the step time and the GPU-busy fraction of a step (CUDA kernel time over step wall time, from
torch.profiler over `--profile-steps` steps after the warm-up; trainer/gpu_busy.py). A run that runs
out of memory is recorded as `oom` and the sweep goes on.

    python -m bench.throughput --out bench/results/throughput_h200 -- data.source=/path/to/tinyshakespeare.txt
    python -m bench.throughput --backends sdpa,flash --seq-lens 1024 -- compile_mode=reduce-overhead
    python -m bench.throughput --allow-cpu --backends naive,sdpa --seq-lens 64,128 --steps 4 --warmup 1 \
        --profile-steps 0 -- experiment=cpu_tiny      # a CPU try-out of the tool (no GPU figures)

Without a CUDA GPU it refuses (exit 2) unless given --allow-cpu: the default cells train GPT-2 124M at
65,536 tokens a step, days on a CPU.

Writes OUT.json (GPU, versions, date, command, one record per cell), OUT.md (table) and OUT.png (tokens/sec
and GPU busy against seq_len). The run directories go to --runs-dir (default outputs/throughput_runs),
not into the results.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BACKENDS = ("naive", "sdpa", "flash")
SEQ_LENS = (1024, 4096, 8192, 16384, 32768)


def cell_command(backend: str, seq_len: int, a, out_dir: Path) -> list[str]:
    """The train.py command line of one cell: the user's command plus run-length and bookkeeping keys."""
    return [
        sys.executable,
        str(REPO / "train.py"),
        f"attention={backend}",
        f"seq_len={seq_len}",
        f"max_steps={a.steps}",
        f"perf.exclude_first_steps={a.warmup}",
        f"perf.profile_steps={a.profile_steps}",
        f"log_interval={a.log_interval}",
        "eval.interval=0",
        "eval.at_start=false",
        "eval.batches=1",
        "checkpoint.interval=0",
        "checkpoint.at_end=false",
        "oom_exit_code=0",
        "wandb.mode=disabled",
        f"out_dir={out_dir}",
        *a.overrides,
    ]


def _error_excerpt(log_tail: str, limit: int = 600) -> str:
    """The last line of a cell's log that names an error, whole (up to ``limit`` characters), else the
    log's last ``limit`` characters: a long one-line message cut from its end loses what it says."""
    named = [line for line in log_tail.splitlines() if "error" in line.lower()]
    return (named[-1] if named else log_tail[-limit:])[:limit]


def read_cell(
    backend: str, seq_len: int, run_dir: Path, returncode: int, wall_s: float, log_tail: str
) -> dict:
    """One result record from the run's summary.json (status, medians, memory, GPU busy)."""
    rec = {"backend": backend, "seq_len": seq_len, "returncode": returncode, "wall_s": round(wall_s, 1)}
    path = run_dir / "summary.json"
    if not path.is_file():
        rec.update(status="error", error=_error_excerpt(log_tail) or f"exit {returncode}, no summary.json")
        return rec
    s = json.loads(path.read_text())
    rec["status"] = s.get("status", "unknown")
    for key, name in (
        ("perf/tokens_per_sec", "tokens_per_sec"),
        ("perf/mfu", "mfu"),
        ("perf/step_ms", "step_ms"),
        ("mem/peak_gib", "peak_gib"),
        ("perf/gpu_busy", "gpu_busy"),
        ("perf/gpu_ms_per_step", "gpu_ms_per_step"),
        ("perf/timed_steps", "timed_steps"),
        ("micro_batch_size", "micro_batch_size"),
        ("grad_accum", "grad_accum"),
        ("final/train_loss", "final_train_loss"),
        ("attention/backend_ran", "backend_ran"),
        ("compile_mode", "compile_mode"),
    ):
        if s.get(key) is not None:
            rec[name] = s[key]
    if rec["status"] != "ok":
        rec["error"] = str(s.get("error") or _error_excerpt(log_tail))[:600]
    return rec


def _fmt_cell(rec: dict | None) -> str:
    if rec is None:
        return "—"
    if rec["status"] != "ok":
        return "not run" if rec["status"] == "not_run" else rec["status"].upper()
    busy = f", busy {100 * rec['gpu_busy']:.0f}%" if "gpu_busy" in rec else ""
    return f"{rec['tokens_per_sec']:,.0f} ({100 * rec['mfu']:.1f}% MFU, {rec['peak_gib']:.1f} GiB{busy})"


def write_markdown(path: Path, meta: dict, cells: list[dict]) -> None:
    """Table: one row per seq_len, one column per backend, and flash / sdpa tokens/sec."""
    backends = [b for b in BACKENDS if any(c["backend"] == b for c in cells)]
    seq_lens = sorted({c["seq_len"] for c in cells})
    by = {(c["backend"], c["seq_len"]): c for c in cells}
    lines = [
        f"# Training throughput: {meta['gpu']}, {meta['date']}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}. Command per cell: `{meta['command']}` "
        f"({meta['steps']} steps, median tokens/sec over the steps after the first {meta['warmup']}, "
        f"{meta['profile_steps']} profiled steps left out). Cell: tokens/sec (MFU, peak memory, GPU busy = "
        "kernel time / step wall time; GPU figures only on a GPU).",
        "",
        "| seq_len | micro-batch × accum | "
        + " | ".join(backends)
        + (" | flash / sdpa |" if {"flash", "sdpa"} <= set(backends) else " |"),
        "| ---: | ---: | "
        + " | ".join("---" for _ in backends)
        + (" | ---: |" if {"flash", "sdpa"} <= set(backends) else " |"),
    ]
    for n in seq_lens:
        split = next(
            (
                f"{c['micro_batch_size']} × {c['grad_accum']}"
                for b in backends
                if (c := by.get((b, n))) and "micro_batch_size" in c
            ),
            "",
        )
        row = f"| {n} | {split} | " + " | ".join(_fmt_cell(by.get((b, n))) for b in backends)
        if {"flash", "sdpa"} <= set(backends):
            f, s = by.get(("flash", n)), by.get(("sdpa", n))
            ok = f and s and f["status"] == s["status"] == "ok"
            row += f" | {f['tokens_per_sec'] / s['tokens_per_sec']:.3f} |" if ok else " | — |"
        else:
            row += " |"
        lines.append(row)
    failed = [c for c in cells if c["status"] not in ("ok", "oom", "not_run")]
    if failed:
        lines += ["", "Failed cells:"] + [
            f"- {c['backend']} N={c['seq_len']}: {c.get('error', '')[:300]}" for c in failed
        ]
    path.write_text("\n".join(lines) + "\n")


def write_plot(path: Path, meta: dict, cells: list[dict]) -> None:
    """tokens/sec (left) and GPU busy (right) against seq_len, one line per backend; OOM cells omitted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for b in BACKENDS:
        pts = sorted((c["seq_len"], c) for c in cells if c["backend"] == b and c["status"] == "ok")
        if not pts:
            continue
        ns = [n for n, _ in pts]
        ax1.plot(ns, [c["tokens_per_sec"] / 1e3 for _, c in pts], marker="o", label=b)
        busy = [(n, c["gpu_busy"]) for n, c in pts if "gpu_busy" in c]
        if busy:
            ax2.plot([n for n, _ in busy], [100 * v for _, v in busy], marker="o", label=b)
    for ax, ylabel in ((ax1, "tokens/sec (thousands)"), (ax2, "GPU busy (% of step wall time)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("seq_len")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend()
    ax1.set_ylim(bottom=0)
    fig.suptitle(f"GPT-2 124M training, {meta['gpu']}, {meta['date'][:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def environment() -> dict:
    import torch
    import triton

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.throughput",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated (default: %(default)s)")
    p.add_argument(
        "--seq-lens", default=",".join(map(str, SEQ_LENS)), help="comma-separated (default: %(default)s)"
    )
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per cell")
    p.add_argument("--warmup", type=int, default=10, help="steps left out (compile; default 10)")
    p.add_argument("--profile-steps", type=int, default=3, help="steps profiled for the GPU-busy fraction")
    p.add_argument("--log-interval", type=int, default=10, help="train.py log_interval (default 10)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per cell before it is stopped")
    p.add_argument(
        "--naive-up-to",
        type=int,
        default=None,
        help="run naive only up to this seq_len; longer cells are recorded as not run "
        "(naive materialises B*H*N^2 scores: past ~8k it runs out of memory after compiling)",
    )
    p.add_argument("--out", default="outputs/throughput", help="results prefix: OUT.json, OUT.md, OUT.png")
    p.add_argument("--runs-dir", default="outputs/throughput_runs", help="run folders (%(default)s)")
    p.add_argument(
        "--allow-cpu", action="store_true", help="run without a CUDA GPU (a try-out of the tool, no figures)"
    )
    p.add_argument("overrides", nargs="*", help="more train.py overrides (after --)")
    a = p.parse_args(argv)
    backends = [b.strip() for b in a.backends.split(",") if b.strip()]
    bad = [b for b in backends if b not in BACKENDS]
    if bad or not backends:  # an empty list once ran no cell and wrote an empty table
        p.error(f"--backends: unknown {bad or repr(a.backends)}; choose from {', '.join(BACKENDS)}")
    try:
        seq_lens = [int(n) for n in a.seq_lens.split(",")]
    except ValueError:
        p.error(f"--seq-lens must be comma-separated integers, got {a.seq_lens!r}")
    if min(seq_lens) < 1:  # else one failed cell per backend, each a fresh train.py process
        p.error(f"--seq-lens must be positive, got {a.seq_lens!r}")
    if not a.timeout > 0:  # else every cell is recorded as "timed out after -1 s"
        p.error(f"--timeout must be a positive number of seconds, got {a.timeout:g}")
    if a.steps <= a.warmup + a.profile_steps:
        p.error(f"--steps ({a.steps}) must exceed --warmup + --profile-steps ({a.warmup + a.profile_steps})")
    if not a.allow_cpu:
        import torch

        if not torch.cuda.is_available():
            print(
                "error: bench.throughput measures training on a CUDA GPU and none is visible; its default "
                "cells train GPT-2 124M (days on a CPU). For a try-out of the tool on a CPU pass --allow-cpu "
                "with tiny cells, e.g. --allow-cpu --backends naive --seq-lens 64 --steps 4 --warmup 1 "
                "--profile-steps 0 -- experiment=cpu_tiny",
                file=sys.stderr,
            )
            return 2

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = Path(a.runs_dir) / time.strftime("%Y%m%d-%H%M%S")
    user_cmd = "python train.py attention=A seq_len=N " + " ".join(shlex.quote(o) for o in a.overrides)
    meta = {
        **environment(),
        "steps": a.steps,
        "warmup": a.warmup,
        "profile_steps": a.profile_steps,
        "command": user_cmd.strip(),
        "argv": sys.argv[1:],
    }
    cells: list[dict] = []
    from tqdm import tqdm

    # one line per cell on stdout; on a terminal also a bar on stderr with the elapsed time and the ETA
    bar = tqdm(
        [(n, b) for n in seq_lens for b in backends],
        desc="cells",
        unit="cell",
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
    )
    for n, b in bar:
        bar.set_postfix_str(f"{b} seq_len={n}")
        if b == "naive" and a.naive_up_to is not None and n > a.naive_up_to:
            cells.append(
                {
                    "backend": b,
                    "seq_len": n,
                    "status": "not_run",
                    "error": f"not run: --naive-up-to {a.naive_up_to}",
                }
            )
            continue
        run_dir = runs / f"{b}_n{n}"
        cmd = cell_command(b, n, a, run_dir)
        tqdm.write(f"== {b} seq_len={n}: {' '.join(shlex.quote(c) for c in cmd[1:])}")
        t0 = time.time()
        try:
            proc = subprocess.run(
                cmd,
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=a.timeout,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
            )
            rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
        except subprocess.TimeoutExpired as e:
            rc, tail = -1, f"timed out after {a.timeout:.0f} s: {str(e.stdout or '')[-500:]}"
        rec = read_cell(b, n, run_dir, rc, time.time() - t0, tail)
        cells.append(rec)
        tqdm.write(f"   {rec['status']}: {_fmt_cell(rec)} [{rec['wall_s']:.0f} s]")
        if rec["status"] not in ("ok", "oom"):
            tqdm.write(tail[-1500:])
        # results so far, so a stopped sweep keeps what it measured
        out.with_suffix(".json").write_text(json.dumps({"meta": meta, "cells": cells}, indent=1) + "\n")
    bar.close()
    write_markdown(out.with_suffix(".md"), meta, cells)
    write_plot(out.with_suffix(".png"), meta, cells)
    print(out.with_suffix(".md").read_text())
    return 0 if any(c["status"] == "ok" for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
