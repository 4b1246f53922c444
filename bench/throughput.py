"""Training throughput of the attention backends across context lengths, and where the GPU waits.

Runs `python train.py attention=A seq_len=N` (GPT-2 124M, bf16, torch.compile, the token-based batch) per
backend and seq_len, each in a fresh process, with only the run length and the bookkeeping changed (no
evaluation or checkpoints, W&B off), and records per cell the median tokens/sec over the timed steps, MFU,
peak memory, step time and GPU busy (kernel time over step wall time, torch.profiler over --profile-steps
steps); out of memory is `oom` and the sweep goes on. Without CUDA it refuses (exit 2) unless --allow-cpu.
Writes OUT.json (after every cell), OUT.md and OUT.png; the run directories go to --runs-dir.

    python -m bench.throughput --out bench/results/throughput_h200 -- data.source=/path/to/tinyshakespeare.txt
    python -m bench.throughput --allow-cpu --backends naive --seq-lens 64 --steps 4 --warmup 1 \\
        --profile-steps 0 -- experiment=cpu_tiny      # a CPU try-out of the tool (no GPU figures)

`--gaps TRACE...` explains the GPU-busy figure: from the traces of `train.py perf.profile_steps=K
perf.trace=true`, the device events' span and busy time, the idle gaps over --min-gap-us summed by the host
context of the launch that ended each (outer and inner CPU op around the launch, through the profiler's
correlation ids; "? > ?" without one), the part the host caused (launched after the device went idle), device
time per kernel and the largest gaps.

    python -m bench.throughput --gaps runs/<run>/trace_step3-5.json.gz --top 10
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench import common

REPO = Path(__file__).resolve().parents[1]
BACKENDS = ("naive", "sdpa", "flash")
# summary.json keys of a cell's record, named by their last part (final/train_loss: final_train_loss)
SUMMARY_KEYS = """perf/tokens_per_sec perf/mfu perf/step_ms mem/peak_gib perf/gpu_busy perf/gpu_ms_per_step
perf/timed_steps micro_batch_size grad_accum final/train_loss attention/backend_ran compile_mode""".split()


def cell_command(backend: str, seq_len: int, a, out_dir: Path, *extra: str) -> list[str]:
    """train.py command line of one cell: the user's command plus run-length and bookkeeping keys (`extra`:
    more keys of the caller's, before the user's)."""
    keys = f"max_steps={a.steps} perf.exclude_first_steps={a.warmup} perf.profile_steps={a.profile_steps} "
    keys += f"log_interval={a.log_interval} eval.interval=0 eval.at_start=false eval.batches=1 "
    keys += "checkpoint.interval=0 checkpoint.at_end=false oom_exit_code=0 wandb.mode=disabled"
    args = [f"attention={backend}", f"seq_len={seq_len}", *extra, *keys.split(), f"out_dir={out_dir}"]
    return [sys.executable, str(REPO / "train.py"), *args, *a.overrides]


def run_cell(backend: str, seq_len: int, a, run_dir: Path, *extra: str) -> tuple[dict, str]:
    """Run one cell's train.py (its command printed first) in a fresh process, stopped after --timeout;
    (its record, the end of its log)."""
    cmd = cell_command(backend, seq_len, a, run_dir, *extra)
    tqdm.write(f"== {backend} seq_len={seq_len}: {shlex.join(cmd[1:])}")
    t0 = time.time()
    try:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=a.timeout, env=env)
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as e:
        rc, tail = -1, f"timed out after {a.timeout:.0f} s: {str(e.stdout or '')[-500:]}"
    return read_cell(backend, seq_len, run_dir, rc, time.time() - t0, tail), tail


def error_excerpt(log_tail: str, limit: int = 600) -> str:
    """The last log line naming an error, whole (up to `limit`), else the log's end: a long one-line message
    cut from its end loses what it says."""
    named = [line for line in log_tail.splitlines() if "error" in line.lower()]
    return (named[-1] if named else log_tail[-limit:])[:limit]


def read_cell(backend: str, seq_len: int, run_dir: Path, rc: int, wall_s: float, log_tail: str) -> dict:
    """One record from the run's summary.json (status, medians, memory, GPU busy); `rc`: its exit status."""
    rec = dict(backend=backend, seq_len=seq_len, returncode=rc, wall_s=round(wall_s, 1))
    if not (s := common.read_summary(run_dir)):
        return rec | dict(status="error", error=error_excerpt(log_tail) or f"exit {rc}, no summary.json")
    rec["status"] = s.get("status", "unknown")
    rec |= {k.replace("final/", "final_").split("/")[-1]: s[k] for k in SUMMARY_KEYS if s.get(k) is not None}
    if rec["status"] != "ok":
        rec["error"] = str(s.get("error") or error_excerpt(log_tail))[:600]
    return rec


def fmt_cell(rec: dict | None) -> str:
    if rec is None or rec["status"] != "ok":
        return "—" if rec is None else "not run" if rec["status"] == "not_run" else rec["status"].upper()
    busy = f", busy {100 * rec['gpu_busy']:.0f}%" if "gpu_busy" in rec else ""
    mfu = f"{100 * rec['mfu']:.1f}% MFU, " if "mfu" in rec else ""  # none on a CPU
    return f"{rec['tokens_per_sec']:,.0f} ({mfu}{rec['peak_gib']:.1f} GiB{busy})"


def markdown(meta: dict, cells: list[dict]) -> str:
    """One row per seq_len, one column per backend, and flash / sdpa tokens/sec."""
    backends = [b for b in BACKENDS if any(c["backend"] == b for c in cells)]
    by = {(c["backend"], c["seq_len"]): c for c in cells}
    ratio = {"flash", "sdpa"} <= set(backends)
    rows = []
    for n in sorted({c["seq_len"] for c in cells}):
        cs = [c for b in backends if (c := by.get((b, n))) and "micro_batch_size" in c]
        split = f"{cs[0]['micro_batch_size']} × {cs[0]['grad_accum']}" if cs else ""
        f, s = by.get(("flash", n)), by.get(("sdpa", n))
        ok = f and s and f["status"] == s["status"] == "ok"
        rows.append([n, split, *(fmt_cell(by.get((b, n))) for b in backends)])
        rows[-1] += [f"{f['tokens_per_sec'] / s['tokens_per_sec']:.3f}" if ok else "—"] if ratio else []
    head = ["seq_len", "micro-batch × accum", *backends, *(["flash / sdpa"] if ratio else [])]
    lines = [
        f"# Training throughput: {meta['gpu']}, {meta['date']}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}, commit {meta.get('commit')}. "
        f"Command per cell: `{meta['command']}` "
        f"({meta['steps']} steps, median tokens/sec over the steps after the first {meta['warmup']}, "
        f"{meta['profile_steps']} profiled steps left out). Cell: tokens/sec (MFU, peak memory, GPU busy = "
        "kernel time / step wall time; GPU figures only on a GPU).",
        "",
        *common.md_table(head, rows),
    ]
    if failed := [c for c in cells if c["status"] not in ("ok", "oom", "not_run")]:
        lines += ["", "Failed cells:"]
        lines += [f"- {c['backend']} N={c['seq_len']}: {c.get('error', '')[:300]}" for c in failed]
    return "\n".join(lines) + "\n"


def plot(path: Path, meta: dict, cells: list[dict]) -> None:
    """tokens/sec (left) and GPU busy (right) against seq_len, one line per backend; failed cells left out."""
    fig, axes = common.subplots(1, 2, w=5.5, h=4.0)
    ns = sorted({c["seq_len"] for c in cells})
    for b in BACKENDS:
        pts = sorted((c["seq_len"], c) for c in cells if c["backend"] == b and c["status"] == "ok")
        if tps := [(n, c["tokens_per_sec"] / 1e3) for n, c in pts]:
            axes[0][0].plot(*zip(*tps, strict=True), marker="o", label=b)
        if busy := [(n, 100 * c["gpu_busy"]) for n, c in pts if "gpu_busy" in c]:
            axes[0][1].plot(*zip(*busy, strict=True), marker="o", label=b)
    for ax, ylabel in zip(axes[0], ("tokens/sec (thousands)", "GPU busy (% of step wall time)"), strict=True):
        ax.set(xlabel="seq_len", ylabel=ylabel)
        ax.set_ylim(bottom=0)
        common.finish_axes(ax, ns)
    common.save_figure(fig, path, f"GPT-2 124M training, {meta['gpu']}, {meta['date'][:10]}")


def gaps(events: list[dict], min_gap_us: float = 2.0) -> dict:
    """Gaps between device events and their host context (module docstring): span_us, busy_us, gap_us,
    host_caused_us, by_context [(outer, inner, us, count)], by_kernel [(name, us)], gaps [(us, at_us, next
    event, outer, inner, host_caused)], each largest first. ValueError when there are no device events."""
    on_device = ("kernel", "gpu_memcpy", "gpu_memset")
    dev = sorted((e for e in events if e.get("cat") in on_device and "dur" in e), key=lambda e: e["ts"])
    if not dev:
        raise ValueError("no device events in the trace (profiled on a CPU?)")
    runtime = ("cuda_runtime", "cuda_driver")
    launches = {e["args"].get("correlation"): e for e in events if e.get("cat") in runtime and "args" in e}
    on_host, host = ("cpu_op", "python_function", "user_annotation"), collections.defaultdict(list)
    for e in sorted((e for e in events if e.get("cat") in on_host and "dur" in e), key=lambda e: e["ts"]):
        host[e["tid"]].append(e)  # per thread, by start time

    def context(launch: dict | None) -> tuple[str, str]:
        around = [] if launch is None else host.get(launch["tid"], ())
        around = [e for e in around if e["ts"] <= launch["ts"] <= e["ts"] + e["dur"]]
        return (around[0]["name"][:60], around[-1]["name"][:60]) if around else ("?", "?")

    t0, end = dev[0]["ts"], dev[0]["ts"] + dev[0]["dur"]
    by_ctx, count, kernels = collections.Counter(), collections.Counter(), collections.Counter()
    kernels[dev[0]["name"][:70]] += dev[0]["dur"]
    found, host_caused = [], 0.0
    for e in dev[1:]:
        kernels[e["name"][:70]] += e["dur"]
        if (gap := e["ts"] - end) > min_gap_us:
            launch = launches.get(e.get("args", {}).get("correlation"))
            ctx = context(launch)
            caused = launch is not None and launch["ts"] + launch.get("dur", 0) > end
            host_caused += gap if caused else 0.0
            by_ctx[ctx] += gap
            count[ctx] += 1
            found.append((gap, e["ts"] - t0, e["name"][:50], *ctx, caused))
        end = max(end, e["ts"] + e["dur"])
    by_context = [(o, i, us, count[(o, i)]) for (o, i), us in by_ctx.most_common()]
    out = dict(span_us=end - t0, busy_us=sum(e["dur"] for e in dev), gap_us=sum(by_ctx.values()))
    out |= dict(host_caused_us=host_caused, by_context=by_context, by_kernel=kernels.most_common())
    return out | dict(gaps=sorted(found, reverse=True))


def gaps_report(path: Path, min_gap_us: float, top: int) -> str:
    """The printed summary of one trace (.json or .json.gz); ValueError / OSError for another file."""
    with (gzip.open if path.suffix == ".gz" else open)(path, "rt") as f:
        events = json.load(f).get("traceEvents")
    if not events:
        raise ValueError("no traceEvents (not a torch.profiler Chrome trace?)")
    r, ms = gaps(events, min_gap_us), 1e-3
    lines = [
        f"{path}: span {r['span_us'] * ms:.2f} ms, device busy {r['busy_us'] * ms:.2f} ms "
        f"({100 * r['busy_us'] / r['span_us']:.1f}%)",
        f"gaps: {r['gap_us'] * ms:.2f} ms, of which the launch came after the device went idle: "
        f"{r['host_caused_us'] * ms:.2f} ms",
        *(f"  {us * ms:8.3f} ms  n={n:5d}  {o} > {i}" for o, i, us, n in r["by_context"][:top]),
        "device time by kernel:",
        *(f"  {us * ms:8.3f} ms  {name}" for name, us in r["by_kernel"][:top]),
        "largest gaps:",
    ]
    for g, at, name, o, i, host in r["gaps"][:top]:
        where = f"{o} > {i}" + (" | host" if host else "")  # host: launched after the device went idle
        lines.append(f"  {g * ms:7.3f} ms at {at * ms:9.3f} ms before {name} | {where}")
    return "\n".join(lines)


def cell_parser(prog: str, doc: str, timeout: float) -> argparse.ArgumentParser:
    """The arguments of the tools that run train.py cells (this one and bench.peer): run length, time limit,
    where results and run folders go, the CPU opt-in and the user's train.py overrides (after --)."""
    raw = argparse.RawDescriptionHelpFormatter  # --help shows the module docstring as written
    p = argparse.ArgumentParser(prog=f"python -m bench.{prog}", description=doc, formatter_class=raw)
    add = p.add_argument
    add("--steps", type=int, default=40, help="optimizer steps per cell (default 40)")
    add("--warmup", type=int, default=10, help="steps left out (compile; default 10)")
    add("--timeout", type=float, default=timeout, help="seconds per cell before it is stopped")
    add("--out", default=f"outputs/{prog}", help="results prefix: OUT.json, OUT.md, OUT.png")
    add("--runs-dir", default=f"outputs/{prog}_runs", help="run folders (%(default)s)")
    add("--allow-cpu", action="store_true", help="run without a CUDA GPU (a try-out, no figures)")
    add("overrides", nargs="*", help="more train.py overrides (after --)")
    return p


def check_cells(p: argparse.ArgumentParser, a, try_out: str) -> int | None:
    """Usage errors (exit 2) for a --timeout or --steps that measures nothing; without CUDA and --allow-cpu,
    2 with an error naming a CPU try-out (`try_out`: its arguments); else None."""
    if not a.timeout > 0:  # else every cell is recorded as "timed out after -1 s"
        p.error(f"--timeout must be a positive number of seconds, got {a.timeout:g}")
    if a.steps <= a.warmup + a.profile_steps:
        left_out = "--warmup + --profile-steps" if a.profile_steps else "--warmup"
        p.error(f"--steps ({a.steps}) must exceed {left_out} ({a.warmup + a.profile_steps})")
    if not a.allow_cpu and not torch.cuda.is_available():
        tool = p.prog.removeprefix("python -m ")
        return common.error(
            f"{tool} measures training on a CUDA GPU and none is visible; its default cells train "
            f"GPT-2 124M (days on a CPU). For a try-out of the tool on a CPU pass --allow-cpu with tiny "
            f"cells, e.g. --allow-cpu {try_out}"
        )
    return None


def start_cells(a, argv, markdown, **meta) -> tuple[Path, common.Results]:
    """The folder of this sweep's run folders (--runs-dir/<date-time>) and its results (OUT.json, rewritten
    after every cell so that a stopped sweep keeps what it measured): versions, GPU ("cpu" without CUDA),
    `meta` and the command line."""
    env = common.environment(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    meta = env | dict(gpu=env["gpu"] or "cpu", **meta, argv=sys.argv[1:] if argv is None else list(argv))
    results = common.Results(Path(a.out).with_suffix(".json"), meta, markdown, cells=[])
    return Path(a.runs_dir) / time.strftime("%Y%m%d-%H%M%S"), results


def main(argv=None) -> int:
    p = cell_parser("throughput", __doc__, timeout=600)
    add = p.add_argument
    add("--backends", type=common.choices(BACKENDS), default=list(BACKENDS), help="comma list")
    add("--seq-lens", type=common.ints(), default=[1024, 4096, 8192, 16384, 32768], help="comma list")
    add("--profile-steps", type=int, default=3, help="steps profiled for the GPU-busy fraction")
    add("--log-interval", type=int, default=10, help="train.py log_interval (default 10)")
    add("--naive-up-to", type=int, help="naive only up to this seq_len (its N^2 scores run out of memory)")
    add("--gaps", nargs="+", type=Path, metavar="TRACE", help="analyse these traces instead")
    add("--top", type=int, default=15, help="--gaps: rows per table (default 15)")
    add("--min-gap-us", type=float, default=2.0, help="--gaps: shorter gaps are ignored (default 2)")
    a = p.parse_args(argv)
    if a.gaps:
        status = 0
        for path in a.gaps:
            try:
                print(gaps_report(path, a.min_gap_us, a.top))
            except (OSError, ValueError) as e:  # includes json.JSONDecodeError and gzip's BadGzipFile
                status = common.error(f"{path}: {e}")
        return status
    try_out = "--backends naive --seq-lens 64 --steps 4 --warmup 1 --profile-steps 0 -- experiment=cpu_tiny"
    if status := check_cells(p, a, try_out):
        return status
    command = ("python train.py attention=A seq_len=N " + shlex.join(a.overrides)).strip()
    meta = dict(steps=a.steps, warmup=a.warmup, profile_steps=a.profile_steps, command=command)
    runs, results = start_cells(a, argv, markdown, **meta)
    # one line per cell on stdout; on a terminal also a bar on stderr with the elapsed time and the ETA
    cells = [(n, b) for n in a.seq_lens for b in a.backends]
    with tqdm(cells, desc="cells", unit="cell", file=sys.stderr, disable=not sys.stderr.isatty()) as bar:
        for n, b in bar:
            bar.set_postfix_str(f"{b} seq_len={n}")
            if b == "naive" and a.naive_up_to is not None and n > a.naive_up_to:
                why = f"not run: --naive-up-to {a.naive_up_to}"
                results.add("cells", [dict(backend=b, seq_len=n, status="not_run", error=why)])
                continue
            rec, tail = run_cell(b, n, a, runs / f"{b}_n{n}")
            tqdm.write(f"   {rec['status']}: {fmt_cell(rec)} [{rec['wall_s']:.0f} s]")
            if rec["status"] not in ("ok", "oom"):
                tqdm.write(tail[-1500:])
            results.add("cells", [rec])
    print(results.save(complete=True))
    plot(Path(a.out).with_suffix(".png"), results.meta, results.lists["cells"])
    return 0 if any(c["status"] == "ok" for c in results.lists["cells"]) else 1


if __name__ == "__main__":
    sys.exit(main())
