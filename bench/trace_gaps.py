"""Where does the GPU wait? Idle gaps between the device events of a torch.profiler trace, by host context.

Reads the traces that ``python train.py perf.profile_steps=K perf.trace=true`` writes
(``<run>/trace_step<first>-<last>.json.gz``) and prints, per trace: the device events' span and busy
time; the gaps between consecutive device events (kernels, memcpy, memset) longer than ``--min-gap-us``,
summed by the host context of the launch that ended each gap (outermost and innermost CPU op around the
launch call, found through the profiler's correlation ids); how much of it the host caused (the launch
was issued only after the device had gone idle); the device time per kernel; and the largest single
gaps with their time since the first event.

    python -m bench.trace_gaps runs/<run>/trace_step3-5.json.gz
    python -m bench.trace_gaps --top 10 runs/a/trace_*.json.gz runs/b/trace_*.json.gz

A gap whose launch has no correlated runtime call (some Triton launches) is shown under "? > ?".
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys
from pathlib import Path

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
RUNTIME_CATS = ("cuda_runtime", "cuda_driver")
HOST_CATS = ("cpu_op", "python_function", "user_annotation")


def load_events(path: Path) -> list[dict]:
    """The trace's events (a .json or .json.gz Chrome trace). Raises ValueError when it holds none."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = json.load(f).get("traceEvents")
    if not events:
        raise ValueError("no traceEvents (not a torch.profiler Chrome trace?)")
    return events


def analyse(events: list[dict], min_gap_us: float = 2.0) -> dict:
    """Gaps between device events and their host context (see the module docstring).

    Returns a dict: ``span_us``, ``busy_us``, ``gap_us`` (sum of gaps > min_gap_us), ``host_caused_us``,
    ``by_context`` [(outer, inner, total_us, count)] largest first, ``by_kernel`` [(name, total_us)] largest
    first, ``gaps`` [(gap_us, at_us, next_event_name, outer, inner, host_caused)] largest first.
    Raises ValueError when the trace holds no device events (a CPU run, or profiling without CUDA).
    """
    dev = sorted((e for e in events if e.get("cat") in DEVICE_CATS and "dur" in e), key=lambda e: e["ts"])
    if not dev:
        raise ValueError("no device events in the trace (profiled on a CPU?)")
    launches = {
        e["args"].get("correlation"): e for e in events if e.get("cat") in RUNTIME_CATS and "args" in e
    }
    host = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in HOST_CATS and "dur" in e:
            host[e["tid"]].append(e)

    def context(launch: dict | None) -> tuple[str, str]:
        if launch is None:
            return "?", "?"
        around = sorted(
            (e for e in host.get(launch["tid"], ()) if e["ts"] <= launch["ts"] <= e["ts"] + e["dur"]),
            key=lambda e: e["ts"],
        )
        return (around[0]["name"][:60], around[-1]["name"][:60]) if around else ("?", "?")

    t0 = dev[0]["ts"]
    end = dev[0]["ts"] + dev[0]["dur"]
    by_ctx, count, kernels = collections.Counter(), collections.Counter(), collections.Counter()
    kernels[dev[0]["name"][:70]] += dev[0]["dur"]
    gaps, host_caused = [], 0.0
    for e in dev[1:]:
        kernels[e["name"][:70]] += e["dur"]
        gap = e["ts"] - end
        if gap > min_gap_us:
            launch = launches.get(e.get("args", {}).get("correlation"))
            outer, inner = context(launch)
            caused = launch is not None and launch["ts"] + launch.get("dur", 0) > end
            host_caused += gap if caused else 0.0
            by_ctx[(outer, inner)] += gap
            count[(outer, inner)] += 1
            gaps.append((gap, e["ts"] - t0, e["name"][:50], outer, inner, caused))
        end = max(end, e["ts"] + e["dur"])
    return {
        "span_us": end - t0,
        "busy_us": sum(e["dur"] for e in dev),
        "gap_us": sum(by_ctx.values()),
        "host_caused_us": host_caused,
        "by_context": [(o, i, us, count[(o, i)]) for (o, i), us in by_ctx.most_common()],
        "by_kernel": kernels.most_common(),
        "gaps": sorted(gaps, reverse=True),
    }


def report(path: Path, r: dict, top: int) -> str:
    """The printed summary of one trace."""
    ms = 1e-3
    lines = [
        f"{path}: span {r['span_us'] * ms:.2f} ms, device busy {r['busy_us'] * ms:.2f} ms "
        f"({100 * r['busy_us'] / r['span_us']:.1f}%)",
        f"gaps: {r['gap_us'] * ms:.2f} ms, of which the launch came after the device went idle: "
        f"{r['host_caused_us'] * ms:.2f} ms",
    ]
    lines += [f"  {us * ms:8.3f} ms  n={n:5d}  {o} > {i}" for o, i, us, n in r["by_context"][:top]]
    lines.append("device time by kernel:")
    lines += [f"  {us * ms:8.3f} ms  {name}" for name, us in r["by_kernel"][:top]]
    lines.append("largest gaps:")
    lines += [
        f"  {g * ms:7.3f} ms at {at * ms:9.3f} ms before {name} | {o} > {i}" + (" | host" if caused else "")
        for g, at, name, o, i, caused in r["gaps"][:top]
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.trace_gaps",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument("traces", nargs="+", type=Path, help="Chrome traces (.json or .json.gz)")
    p.add_argument("--top", type=int, default=15, help="rows per table (default 15)")
    p.add_argument("--min-gap-us", type=float, default=2.0, help="shorter gaps are ignored (default 2)")
    a = p.parse_args(argv)
    status = 0
    for path in a.traces:
        try:
            print(report(path, analyse(load_events(path), a.min_gap_us), a.top))
        except (OSError, ValueError) as e:  # includes json.JSONDecodeError and gzip's BadGzipFile
            print(f"error: {path}: {e}", file=sys.stderr)
            status = 2
    return status


if __name__ == "__main__":
    sys.exit(main())
