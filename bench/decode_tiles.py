"""Flash-decode tile and split sweep: the split kernel's key tile (BLOCK_N), split count, num_warps and
num_stages, per decode shape, against the automatic choice (``kernels.plan``'s ``decode_block_n`` and
``decode_num_splits``).

Usage (GPU)::

    python -m bench.decode_tiles                                   # the default grid (below), bf16
    python -m bench.decode_tiles --dims 128 --batches 1 --contexts 8192,32768 --splits 8,16,33
    TRITON_INTERPRET=1 python -m bench.decode_tiles --dry-run      # CPU plumbing check (outputs/bench/)

Each configuration runs the real launch code, ``kernels.flash_decode._launch_decode`` with its private
``_tile_n`` / ``_num_warps`` / ``_num_stages`` overrides and an explicit split count (the count actually
launched, after ``_split_layout`` rounds each split to whole tiles, is the record's ``splits``;
``splits_requested`` is the grid's). Every output is checked against ``flash_decode`` itself (the automatic
configuration) on the same inputs: status ``mismatch`` and not timed past ``TOLERANCE`` (max abs
difference; 2e-2 in bf16/fp16, 1e-4 in fp32). Timing (GPU) as ``bench.decode``'s ``ms``: one CUDA graph
of ``GRAPH_CALLS`` (20) back-to-back calls cycling through copies of q, k, v spanning twice the L2
(``bench.decode._l2_copies`` / ``_captured``), replay time (do_bench median, warm-up 10 ms, rep 40 ms) /
20; on the CPU (dry run) one eager call.

Default GPU grid: Hkv 8, group 4, one query row, bf16; (d, batch, context) in ``GPU_SHAPES``: d 128 at
batch 1 and 16 for 8k and 32k, d 64 at batch 1 for 8k, d 64 at batch 64 for 8k and 32k; BLOCK_N 32, 64,
128 x splits 1, 2, 4, 8, 16, 33, 66, 132 x warps 4, 8 x stages 2, 3, minus splits with more splits than
key tiles, and (default splits only) splits below 8 at batch 1 or above 33 at batch >= 16 (far from the
best on the H200: too few programs, or too many small splits). About 2 minutes on an H200 (a scratch run
of the same grid took 93 s). ``--dims`` / ``--batches`` / ``--contexts``: their product instead
(defaults for the ones not given: 128, 1, 8192).

Outputs in ``--out`` (bench/results; ``--dry-run``: outputs/bench): ``decode_tiles_<tag>.json`` (records
and meta: GPU, torch, triton, date, grid) and ``decode_tiles_<tag>.md`` (per shape: the automatic
configuration's time, the best 4, and a table of time by splits for every (block_n, warps, stages)),
rewritten atomically after every shape (``meta["complete"]`` False until the end).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import itertools
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

if __name__ == "__main__" and "--dry-run" in sys.argv[1:]:
    # the CPU plumbing check runs the kernels in Triton's interpreter, which must be chosen before anything
    # imports triton (the imports below do)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from bench._attention_report import compact_json
from bench._timing import Timer, free_memory
from bench.decode import DTYPES, GRAPH_CALLS, _captured, _grid_problem, _ints, _l2_copies, _write_text

GPU_SHAPES = (
    (128, 1, 8192),
    (128, 1, 32768),
    (128, 16, 8192),
    (128, 16, 32768),
    (64, 1, 8192),
    (64, 64, 8192),
)
GPU_SHAPES += ((64, 64, 32768),)
DRY_RUN_SHAPES = ((16, 1, 40), (16, 2, 100))
GPU_GRID = dict(block_n="32,64,128", splits="1,2,4,8,16,33,66,132", warps="4,8", stages="2,3", kv_heads=8)
DRY_RUN_GRID = dict(block_n="16,32", splits="1,2,4", warps="4", stages="2", kv_heads=2)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}


def _pruned(batch: int, splits: int) -> bool:
    """The default GPU grid's cut (module docstring): too few programs at batch 1, too many at >= 16."""
    return (batch == 1 and splits < 8) or (batch >= 16 and splits > 33)


def configs(args, context: int, batch: int) -> list[tuple[int, int, int, int]]:
    """(block_n, requested splits, warps, stages) of one shape's sweep."""
    from kernels.plan import _cdiv

    out = []
    for bn, sp, w, st in itertools.product(
        _ints(args.block_n), _ints(args.splits), _ints(args.warps), _ints(args.stages)
    ):
        if sp > _cdiv(context, bn) or (args.prune and _pruned(batch, sp)):
            continue
        out.append((bn, sp, w, st))
    return out


def sweep_shape(args, device, timer, dtype, d: int, batch: int, context: int) -> list[dict]:
    """The automatic configuration's record, then one per configuration of ``configs``."""
    fd = importlib.import_module("kernels.flash_decode")  # the module (kernels exports its function)
    from kernels import interpret_enabled
    from kernels import plan as kplan

    hkv, group = args.kv_heads, args.group
    gen = torch.Generator(device=device).manual_seed(args.seed)
    q = torch.randn(batch, hkv * group, 1, d, device=device, dtype=dtype, generator=gen)
    k = torch.randn(batch, hkv, context, d, device=device, dtype=dtype, generator=gen)
    v = torch.randn(batch, hkv, context, d, device=device, dtype=dtype, generator=gen)
    kv_bytes = 2 * k.numel() * k.element_size()
    copies = _l2_copies(q, k, v, kv_bytes) if device.type == "cuda" else [(q, k, v)]
    scale, tol = 1.0 / math.sqrt(d), TOLERANCE[dtype]

    def measure(fn) -> float:
        if device.type != "cuda":
            return timer(lambda: fn(q, k, v))
        graph = _captured(fn, copies)
        try:
            return timer(graph.replay) / GRAPH_CALLS
        finally:
            del graph

    base = dict(d=d, batch=batch, context=context, kv_heads=hkv, group=group, kv_bytes=kv_bytes)
    ref = fd.flash_decode(q, k, v)
    auto_bn = kplan.decode_block_n(d, dtype, interpret_enabled())
    auto_count = kplan.decode_num_splits(q, k)
    auto_splits = kplan.split_layout(context, auto_count, auto_bn)
    auto_ms = measure(lambda q, k, v: fd.flash_decode(q, k, v))
    records = [
        dict(
            base,
            config="auto",
            block_n=auto_bn,
            splits=auto_splits[1],
            warps=None,
            stages=None,
            status="ok",
            ms=auto_ms,
            gbs=kv_bytes / (auto_ms * 1e-3) / 1e9,
        )
    ]
    for bn, sp, w, st in configs(args, context, batch):
        rec = dict(
            base,
            config="sweep",
            block_n=bn,
            splits_requested=sp,
            splits=kplan.split_layout(context, sp, bn)[1],
            warps=w,
            stages=st,
        )

        def fn(q, k, v, bn=bn, sp=sp, w=w, st=st):
            return fd._launch_decode(q, k, v, None, scale, sp, _tile_n=bn, _num_warps=w, _num_stages=st)[0]

        try:
            diff = (fn(q, k, v).float() - ref.float()).abs().max().item()
            rec["max_abs_diff"] = diff
            if not diff <= tol:  # NaN fails too
                rec["status"] = f"mismatch: {diff:.3g} > {tol:g}"
            else:
                ms = measure(fn)
                rec.update(status="ok", ms=ms, gbs=kv_bytes / (ms * 1e-3) / 1e9)
        except torch.OutOfMemoryError:
            rec["status"] = "oom"
        except Exception as e:  # noqa: BLE001 - a config that does not compile or run is a result
            rec["status"] = f"error: {type(e).__name__}: {str(e).strip().splitlines()[0][:120]}"
        records.append(rec)
        print(json.dumps(rec), flush=True)
    return records


def _us(ms: float) -> str:
    return f"{ms * 1e3:.1f}"


def _label(r: dict) -> str:
    return f"bn {r['block_n']} s{r['splits']} w{r['warps']} st{r['stages']}"


def markdown(meta: dict, records: list[dict]) -> str:
    lines = [f"# Decode tile sweep ({meta['device']}, {meta['dtype']})", ""]
    if not meta.get("complete", True):
        lines += [f"**Incomplete**: the run stopped (or is still running) after {len(records)} records.", ""]
    lines += [
        f"Times in us per call ({meta['timing']}); GB/s of K/V read. Every configuration is checked "
        f"against flash_decode (max abs difference <= {meta['tolerance']:g}). Cells of the tables: time "
        "by requested splits, with the splits launched in brackets where the rounding to whole tiles "
        "changed the count.",
        "",
    ]
    shapes = sorted({(r["d"], r["batch"], r["context"]) for r in records}, key=lambda s: (-s[0], s[1], s[2]))
    for d, b, ctx in shapes:
        rs = [r for r in records if (r["d"], r["batch"], r["context"]) == (d, b, ctx)]
        auto = next(r for r in rs if r["config"] == "auto")
        sweep = [r for r in rs if r["config"] == "sweep"]
        ok = sorted((r for r in sweep if r["status"] == "ok"), key=lambda r: r["ms"])
        lines += [
            f"## d {d}, batch {b}, context {ctx} (Hkv {auto['kv_heads']}, group {auto['group']}, "
            f"K/V {auto['kv_bytes'] / 1e6:.1f} MB)",
            "",
            f"Automatic (block_n {auto['block_n']}, splits {auto['splits']}, Triton's warps/stages): "
            f"{_us(auto['ms'])} us, {auto['gbs']:.0f} GB/s.",
            "",
            "Best: "
            + ("; ".join(f"{_label(r)}: {_us(r['ms'])} us, {r['gbs']:.0f} GB/s" for r in ok[:4]) or "none"),
            "",
        ]
        bad = [r for r in sweep if r["status"] != "ok"]
        if bad:
            lines += [
                f"Not timed: {len(bad)} ({'; '.join(_label(r) + ' ' + r['status'] for r in bad[:4])})",
                "",
            ]
        if not sweep:
            continue
        cols = sorted({r["splits_requested"] for r in sweep})
        lines += [
            "| block_n | warps | stages | " + " | ".join(f"s={c}" for c in cols) + " |",
            "|---|---|---|" + "---|" * len(cols),
        ]
        for bn, w, st in sorted({(r["block_n"], r["warps"], r["stages"]) for r in sweep}):
            row = {
                r["splits_requested"]: r
                for r in sweep
                if (r["block_n"], r["warps"], r["stages"]) == (bn, w, st)
            }
            cells = []
            for c in cols:
                r = row.get(c)
                if r is None:
                    cells.append("-")
                elif r["status"] != "ok":
                    cells.append(r["status"].split(":")[0])
                else:
                    cells.append(_us(r["ms"]) + (f" ({r['splits']})" if r["splits"] != c else ""))
            lines.append(f"| {bn} | {w} | {st} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def _save(out: Path, tag: str, meta: dict, records: list[dict], complete: bool) -> str:
    meta["complete"] = complete
    _write_text(out / f"decode_tiles_{tag}.json", compact_json(dict(meta=meta, records=records)))
    report = markdown(meta, records)
    _write_text(out / f"decode_tiles_{tag}.md", report)
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.decode_tiles",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--dims", default=None, help="comma list of d (with --batches/--contexts: their product)")
    ap.add_argument("--batches", default=None, help="comma list")
    ap.add_argument("--contexts", default=None, help="comma list")
    ap.add_argument("--kv-heads", type=int, default=None, help="KV heads (GPU default: 8)")
    ap.add_argument("--group", type=int, default=4, help="query heads per KV head")
    ap.add_argument("--block-n", default=None, help="comma list of key tiles (GPU default: 32,64,128)")
    ap.add_argument("--splits", default=None, help="comma list of requested splits (GPU default: 1 .. 132)")
    ap.add_argument("--warps", default=None, help="comma list of num_warps (GPU default: 4,8)")
    ap.add_argument("--stages", default=None, help="comma list of num_stages (GPU default: 2,3)")
    ap.add_argument("--dtype", default="bf16", choices=DTYPES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dry-run", action="store_true", help="CPU plumbing check: tiny shapes, fp32, 1 rep")
    ap.add_argument("--out", default=None, help="output directory (bench/results; --dry-run: outputs/bench)")
    ap.add_argument("--tag", default=None)
    args = ap.parse_args(argv)
    # the default split grid is pruned (module docstring); splits given by the user are swept as given
    args.prune = args.splits is None and not args.dry_run
    for key, value in (DRY_RUN_GRID if args.dry_run else GPU_GRID).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    # a bad grid is a usage error before anything runs: an empty list swept nothing and still exited 0,
    # --splits 0 or --block-n 0 died in a ZeroDivisionError, --block-n 7 in one Triton error per config
    for flag, key, low, pow2 in (
        ("--block-n", "block_n", 16, True),
        ("--splits", "splits", 1, False),
        ("--warps", "warps", 1, True),
        ("--stages", "stages", 1, False),
        ("--dims", "dims", 1, False),
        ("--batches", "batches", 1, False),
        ("--contexts", "contexts", 1, False),
    ):
        problem = _grid_problem(getattr(args, key), low, pow2)
        if problem:
            ap.error(f"{flag} {getattr(args, key)!r}: {problem}")
    for flag, value in (("--kv-heads", args.kv_heads), ("--group", args.group)):
        if value < 1:
            ap.error(f"{flag} must be >= 1, got {value}")
    if args.dims is None and args.batches is None and args.contexts is None:
        shapes = list(DRY_RUN_SHAPES if args.dry_run else GPU_SHAPES)
    else:
        first = (DRY_RUN_SHAPES if args.dry_run else GPU_SHAPES)[0]
        shapes = list(
            itertools.product(
                _ints(args.dims or str(first[0])),
                _ints(args.batches or str(first[1])),
                _ints(args.contexts or str(first[2])),
            )
        )
    if args.dry_run:
        device, dtype = torch.device("cpu"), torch.float32
        timer = Timer(device, cpu_reps=1)
        timing = "CPU dry run: median of 1 eager call after a warm-up"
    else:
        if not torch.cuda.is_available():
            print("error: bench.decode_tiles needs a GPU; use --dry-run on a CPU", file=sys.stderr)
            return 2
        device, dtype = torch.device("cuda"), DTYPES[args.dtype]
        timer = Timer(device, warmup_ms=10, rep_ms=40)
        timing = (
            f"CUDA graph of {GRAPH_CALLS} calls cycling through L2-spanning K/V copies, "
            f"{timer.describe()} of the replay / {GRAPH_CALLS}"
        )
    import triton

    meta = dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        dtype=str(dtype)[6:],
        torch=torch.__version__,
        triton=triton.__version__,
        time=datetime.datetime.now().isoformat(),
        argv=sys.argv[1:] if argv is None else list(argv),
        shapes=[list(s) for s in shapes],
        kv_heads=args.kv_heads,
        group=args.group,
        grid=dict(
            block_n=args.block_n, splits=args.splits, warps=args.warps, stages=args.stages, pruned=args.prune
        ),
        tolerance=TOLERANCE[dtype],
        timing=timing,
    )
    tag = args.tag or ("dryrun" if args.dry_run else "h200")
    out = Path(args.out or ("outputs/bench" if args.dry_run else "bench/results"))
    out.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []
    _save(out, tag, meta, records, complete=False)
    for d, b, ctx in shapes:
        t0 = time.perf_counter()
        records += sweep_shape(args, device, timer, dtype, d, b, ctx)
        free_memory(device)
        _save(out, tag, meta, records, complete=False)
        print(
            f"[bench.decode_tiles] d={d} batch={b} context={ctx}: {time.perf_counter() - t0:.1f} s",
            file=sys.stderr,
        )
    print(_save(out, tag, meta, records, complete=True))
    bad = [r for r in records if r.get("status") != "ok"]
    if args.dry_run and bad:  # the plumbing check: every configuration must run and match
        print(
            f"error: dry run: {len(bad)} configuration(s) failed, first: {bad[0].get('status')}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
