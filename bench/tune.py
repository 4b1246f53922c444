"""Tile searches of our kernels (run on the GPU; `bench/NOTES.md` records what each search chose).

Attention, through the public API only: `kernels.flash_attention` (forward; backward = forward+backward minus
forward) with tiles forced by `kernels.override_tile_config`; shapes as in `bench.attention`, bf16 inputs
seeded by (N, d). Search (default): per (d, N), every candidate tile of one kernel, the others at their
defaults (`fwd` timed by the forward, `bwd_dkdv` / `bwd_dq` by the backward); prints the default, the best and
the top 3 and appends one JSON line per candidate to --out. `--kernels bwd` searches (dK/dV, dQ) tile pairs
jointly, with `--tma` pairs with and without tensor-descriptor (TMA) loads. Interleaved A/B (`--plans`): every
plan in turn for --rounds rounds, so clock and thermal drift hit all alike (NOTES v5); per (N, plan) the
median forward and backward TFLOP/s and their range. A plan: 'default', 'fwd=CFG', 'dkdv=CFG', 'dq=CFG',
several joined by '+', or 'provider:NAME' (a `bench.attention` provider as a yardstick); CFG is
BMxBNxWARPSxSTAGES with an optional 't' (TMA loads; dK/dV and dQ only).

    python -m bench.tune --seqlens 1024,4096,16384 --headdims 64,128 --out /tmp/tune.jsonl
    python -m bench.tune --kernels bwd --tma --seqlens 1024,4096,16384 --out /tmp/tune_bwd.jsonl
    python -m bench.tune --d 64 --seqlens 4096,16384 --plans default fwd=128x64x8x3 provider:flex

Decode (`--decode`): the flash-decode split kernel's key tile (BLOCK_N) x splits x warps x stages per shape
against the automatic choice, through `kernels.flash_decode._launch_decode`'s private tile overrides (the
splits launched after `kernels.plan.split_layout` rounds them to whole tiles are ``splits``); each output
checked against `flash_decode` (``mismatch`` past DECODE_TOLERANCE), timed as `bench.decode`'s ``ms``.
Default: the shapes of
DECODE_SHAPES, less splits beyond the key tiles and (default splits only) < 8 at batch 1 or > 33 at batch
>= 16 (far from the best on the H200), about 2 minutes; --dims / --batches / --contexts: their product.
Writes decode_tiles_<tag>.json and .md to --out (bench/results) after every shape:

    python -m bench.tune --decode --dims 128 --batches 1 --contexts 8192,32768 --splits 8,16,33

Loss (`--loss`): the fused classifier loss kernel's launch (kernels/cross_entropy.py: programs per SM x
logits per block x warps) on (32,768 x 50,304) bf16 logits, GPT-2's micro-batch; each launch checked against
float64 F.cross_entropy, then timed in place (TB/s of one read and one write) beside a copy of the logits:

    python -m bench.tune --loss

`--dry-run`: any mode on the CPU under TRITON_INTERPRET=1, tiny float32 shapes (plumbing only).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench import common

PLAN_KEYS = {"fwd": "fwd", "dkdv": "bwd_dkdv", "dq": "bwd_dq"}
SEARCH_KERNELS = ("fwd", "bwd_dkdv", "bwd_dq")
# The joint backward search (--kernels bwd): per key, lines "dK/dV tiles : dQ tiles", each the product of
# its comma lists of BMxBNxWARPSxSTAGES tiles ('t': TMA loads, 't?': without and with). Pointer loads around
# NOTES v1's optimum; with --tma the TMA pairs of NOTES v4, the same tiles with and without TMA per kernel.
BWD_PLANS = {
    "d128": [
        "64x128x8x2 : 128x32x8x2, 128x64x8x2, 64x64x8x2",
        "64x128x8x3 : 128x32x8x3, 128x64x8x3, 64x64x8x3",
        "64x64x8x3 : 128x32x8x3, 64x64x8x3",
        "32x128x8x3 : 128x32x8x3",
    ],
    "d64": [
        "64x128x8x3, 64x64x8x3, 32x128x8x3, 128x64x8x3 : 128x64x8x3, 64x64x8x3, 128x32x8x3",
        "64x64x4x3, 32x64x4x3, 32x128x4x3 : 64x64x4x3, 64x32x4x3",
        "64x128x8x2 : 128x64x8x2",
    ],
    "tma d128": [
        "64x128x8x3 : 128x64x8x3t, 128x64x8x3, 128x32x8x3t, 64x64x4x3t",
        "64x128x8x3t : 128x64x8x3t",
        "64x128x8x2 : 128x64x8x3t",
    ],
    "tma d64 N<=1024": ["32x64x4x3t?, 64x128x4x2t? : 64x32x4x3t?, 64x64x4x3t?"],
    "tma d64": ["64x128x4x2t? : 128x64x8x3t?, 64x64x4x3t?"],
}
DECODE_SHAPES = ((128, 1, 8192), (128, 1, 32768), (128, 16, 8192), (128, 16, 32768), (64, 1, 8192))
DECODE_SHAPES += ((64, 64, 8192), (64, 64, 32768))
DRY_DECODE_SHAPES = ((16, 1, 40), (16, 2, 100))
DECODE_GRID = dict(block_n=[32, 64, 128], splits=[1, 2, 4, 8, 16, 33, 66, 132], warps=[4, 8], stages=[2, 3])
DRY_DECODE_GRID = dict(block_n=[16, 32], splits=[1, 2, 4], warps=[4], stages=[2])
DECODE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}


def cfg_fields(cfg) -> list:
    """[BLOCK_M, BLOCK_N, warps, stages, tma] of a TileConfig, plus its `no_tma` alternative nested."""
    out = [cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.tma]
    return out + [cfg_fields(cfg.no_tma)] if cfg.no_tma is not None else out


def parse_configs(text: str) -> list:
    """'BMxBNxWARPSxSTAGES[t],...' -> [TileConfig, ...]; exits 2 naming a malformed item."""
    from kernels import TileConfig

    cfgs = []
    for item in (x.strip() for x in text.split(",")):
        parts = item.removesuffix("t").split("x")
        if len(parts) != 4 or not all(x.isdigit() for x in parts):
            message = f"tile config {item!r} is not BMxBNxWARPSxSTAGES[t] (e.g. 128x64x8x3)"
            raise SystemExit(common.error(message))
        cfgs.append(TileConfig(*map(int, parts), tma=item.endswith("t")))
    return cfgs


def parse_plan(text: str) -> dict:
    """A/B plan -> overrides of `override_tile_config`: 'default' -> {}, 'fwd=CFG+dq=CFG' ->
    {'fwd': TileConfig, 'bwd_dq': TileConfig}, 'provider:flex' -> {'provider': 'flex'}; exits 2 otherwise."""
    if text == "default":
        return {}
    if text.startswith("provider:"):
        name = text.partition(":")[2]
        if not name or "+" in name or "=" in name:
            message = f"plan {text!r}: provider:NAME takes one provider of bench.attention and no tiles"
            raise SystemExit(common.error(message))
        return {"provider": name}
    plan = {}
    for part in text.split("+"):
        key, _, cfg = part.partition("=")
        if key not in PLAN_KEYS or not cfg:
            expected = "default, fwd=CFG, dkdv=CFG, dq=CFG (joined by '+') or provider:NAME"
            raise SystemExit(common.error(f"plan part {part!r}: expected {expected}"))
        plan[PLAN_KEYS[key]] = parse_configs(cfg)[0]
    return plan


def candidates(kernel: str, d: int, explicit: list | None = None):
    """Tile candidates of one kernel: `explicit`, else a grid without tiles over 128x128 at d >= 128."""
    from kernels import TileConfig

    if explicit is not None:
        return list(explicit)
    space = {
        "fwd": ((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)),
        "bwd_dkdv": ((32, 64, 128), (64, 128), (4, 8), (2, 3)),
        "bwd_dq": ((64, 128), (32, 64, 128), (4, 8), (2, 3)),
    }[kernel]
    return [TileConfig(*c) for c in itertools.product(*space) if d < 128 or c[0] * c[1] <= 128 * 128]


def bwd_plans(d: int, n: int, tma: bool) -> list[tuple]:
    """(dK/dV tile, dQ tile) pairs of the joint backward search: BWD_PLANS' lines for d, N and `tma`."""
    key = ("tma " if tma else "") + ("d128" if d >= 128 else "d64 N<=1024" if tma and n <= 1024 else "d64")
    tiles = lambda text: parse_configs(re.sub(r"(\w+)t\?", r"\1,\1t", text))
    return [p for line in BWD_PLANS[key] for p in itertools.product(*map(tiles, line.split(":")))]


class Shape:
    """Inputs of one shape: q, k, v (leaves with requires_grad) and dO, (B, H, N, d)."""

    def __init__(self, a, n: int, d: int):
        from bench.attention import shape_for

        self.n, self.d = n, d
        self.b, self.h = shape_for(a.tokens, a.hidden, n, d)
        gen = torch.Generator(device=a.device).manual_seed(n * 1000 + d)
        kw = dict(device=a.device, dtype=a.dtype, generator=gen)
        q, k, v, self.do = (torch.randn(self.b, self.h, n, d, **kw) for _ in range(4))
        self.leaves = [t.requires_grad_() for t in (q, k, v)]
        self.fwd_flops = 2.0 * self.b * self.h * n * n * d  # causal forward; backward is 2.5x

    def describe(self) -> str:
        return f"d={self.d} N={self.n} (B={self.b}, H={self.h})"


def time_plan(shape: Shape, timer, tiles: dict, *, fn=None, bwd=True, fwd_ms=None):
    """(forward ms, backward ms, error) of `fn` (default flash_attention, causal) under
    `override_tile_config(**tiles)`; backward None without `bwd`; `fwd_ms` given: the forward is not timed
    again. A plan that cannot launch (shared memory, registers) gives (None, None, exception type name)."""
    from kernels import flash_attention, override_tile_config

    leaves, do = shape.leaves, shape.do
    call = fn or (lambda q, k, v: flash_attention(q, k, v, causal=True))
    fwd = lambda: call(*leaves)
    fwdbwd = lambda: fwd().backward(do)
    with override_tile_config(**tiles):
        try:
            (fwdbwd if bwd else fwd)()
            if do.is_cuda:
                torch.cuda.synchronize()
        except Exception as exc:  # out of shared memory / registers: skip the plan
            return None, None, type(exc).__name__
        finally:
            for t in leaves:
                t.grad = None
        t_f = timer(fwd) if fwd_ms is None else fwd_ms
        t_b = timer(fwdbwd, grad_to_none=leaves) - t_f if bwd else None
    return t_f, t_b, None


def _tflops(flops: float, ms: float | None) -> float | None:
    return None if ms is None or ms <= 0 else flops / ms / 1e9


def _write(out, a, shape: Shape, **fields) -> None:
    rec = dict(d=shape.d, N=shape.n, B=shape.b, H=shape.h, **fields, gpu=a.gpu, torch=torch.__version__)
    rec["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out.write(json.dumps(rec) + "\n")
    out.flush()


def _progress(items, desc: str):
    """tqdm on stderr (elapsed time and ETA of a long search) when it is a terminal."""
    from tqdm import tqdm

    return tqdm(items, desc=desc, leave=False, file=sys.stderr, disable=not sys.stderr.isatty())


def search(a, out) -> None:
    """Tile search: separable per kernel, or joint backward (`--kernels bwd`)."""
    from kernels import get_tile_config

    for d, n in itertools.product(a.headdims, a.seqlens):
        shape = Shape(a, n, d)
        fwd_default, _, err = time_plan(shape, a.timer, {}, bwd=False)
        if err:
            print(f"{shape.describe()}: the default tiles do not run ({err}); shape skipped")
            continue
        for kernel in a.kernels:
            default = lambda k, d=d, n=n: get_tile_config(k, d, a.dtype, True, n, n, interpret=a.dry_run)
            if kernel == "bwd":
                plans = [(default("bwd_dkdv"), default("bwd_dq")), *bwd_plans(d, n, a.tma)]
                to_tiles = lambda p: {"bwd_dkdv": p[0], "bwd_dq": p[1]}
                fields = lambda p: {"dkdv": cfg_fields(p[0]), "dq": cfg_fields(p[1])}
            else:
                plans = [default(kernel), *candidates(kernel, d, a.configs)]
                to_tiles = lambda p, kernel=kernel: {kernel: p}
                fields = lambda p: {"cfg": cfg_fields(p)}
            flops = shape.fwd_flops * (1.0 if kernel == "fwd" else 2.5)
            tf = lambda ms, flops=flops: f"{ms:.3f} ms ({_tflops(flops, ms):.0f} TF/s)"
            rows, t0 = [], time.time()
            for i, plan in enumerate(_progress(plans, f"{kernel} d={d} N={n}")):
                if kernel == "fwd":
                    ms, _, err = time_plan(shape, a.timer, to_tiles(plan), bwd=False)
                else:
                    _, ms, err = time_plan(shape, a.timer, to_tiles(plan), fwd_ms=fwd_default)
                tag = "default" if i == 0 else "candidate"
                tflops = _tflops(flops, ms)
                _write(out, a, shape, kernel=kernel, plan=tag, **fields(plan), ms=ms, err=err, tflops=tflops)
                if ms is not None:
                    rows.append((ms, i, plan))
                if a.configs is not None or kernel == "bwd":
                    result = tf(ms) if err is None else err
                    print(f"  {kernel:8s} {shape.describe()} {tag:9s} {json.dumps(fields(plan))}: {result}")
            if not rows:
                print(f"{kernel:8s} {shape.describe()}: no candidate ran")
                continue
            base = next((f"default {tf(r[0])}" for r in rows if r[1] == 0), "default did not run")
            rows.sort(key=lambda r: r[0])
            top3 = [(round(ms, 3), fields(p)) for ms, _, p in rows[:3]]
            best = f"best {json.dumps(fields(rows[0][2]))} {tf(rows[0][0])}"
            print(f"{kernel:8s} {shape.describe()}: {base} | {best} | top3 {top3} [{time.time() - t0:.0f} s]")
        del shape
        common.free_memory(a.device)


def ab(a, out) -> None:
    """Interleaved A/B: every plan in turn for a.rounds rounds per (d, N)."""
    plans = [(text, parse_plan(text)) for text in a.plans]
    for d, n in itertools.product(a.headdims, a.seqlens):
        shape = Shape(a, n, d)
        impl = {
            t: common.build_provider(p["provider"], n=n, device=a.device) for t, p in plans if "provider" in p
        }
        res = {text: ([], [], set()) for text, _ in plans}
        for _ in _progress(range(a.rounds), f"rounds d={d} N={n}"):
            for text, plan in plans:
                tiles = {} if "provider" in plan else plan
                f_ms, b_ms, err = time_plan(shape, a.timer, tiles, fn=impl.get(text), bwd=not a.no_bwd)
                fwd_tf, bwd_tf, errs = res[text]
                if err:
                    errs.add(err)
                    continue
                fwd_tf.append(_tflops(shape.fwd_flops, f_ms))
                if (b := _tflops(2.5 * shape.fwd_flops, b_ms)) is not None:
                    bwd_tf.append(b)
        for text, (fwd_tf, bwd_tf, errs) in res.items():
            line = f"d={d} N={n:6d} {text:40s} "
            if errs or not fwd_tf:
                print(line + f"did not run: {', '.join(sorted(errs))}")
                continue
            stat = lambda xs: f"{statistics.median(xs):6.1f} TF/s ({min(xs):.0f}-{max(xs):.0f})"
            line += f"fwd {stat(fwd_tf)}"
            if bwd_tf:
                line += f"  bwd {stat(bwd_tf)}"
            elif not a.no_bwd:  # forward+backward timed no slower than the forward alone: noise, no figure
                line += "  bwd      — (fwd+bwd not slower than fwd: timing noise)"
            print(line)
            if out is not None:
                _write(out, a, shape, plan=text, rounds=a.rounds, fwd_tflops=fwd_tf, bwd_tflops=bwd_tf)
        del shape
        common.free_memory(a.device)


# ------------------------------------------------------------------------------- decode tile search


def decode_shape(a, d: int, batch: int, context: int) -> list[dict]:
    """The automatic configuration's record, then one per (block_n, splits, warps, stages) of the grid."""
    from kernels import interpret_enabled
    from kernels import plan as kplan

    fd = importlib.import_module("kernels.flash_decode")  # the module (kernels exports its function)

    hkv, group, dtype = a.kv_heads, a.group, a.dtype
    q, k, v = common.decode_inputs(batch, hkv, group, context, d, dtype, a.device, a.seed)
    kv_bytes = 2 * k.numel() * k.element_size()
    copies = common.l2_copies(q, k, v) if a.device.type == "cuda" else None
    measure = lambda fn: common.graph_ms(fn, copies, a.timer) if copies else a.timer(lambda: fn(q, k, v))
    base = dict(d=d, batch=batch, context=context, kv_heads=hkv, group=group, kv_bytes=kv_bytes)
    ref = fd.flash_decode(q, k, v)
    bn = kplan.decode_block_n(d, dtype, interpret_enabled())
    splits = kplan.split_layout(context, kplan.decode_num_splits(q, k), bn)[1]
    ms = measure(lambda q, k, v: fd.flash_decode(q, k, v))
    auto = dict(config="auto", block_n=bn, splits=splits, warps=None, stages=None, status="ok", ms=ms)
    records = [dict(base, **auto, gbs=kv_bytes / (ms * 1e-3) / 1e9)]
    for bn, sp, w, st in itertools.product(a.block_n, a.splits, a.warps, a.stages):
        if sp > -(-context // bn) or (a.prune and ((batch == 1 and sp < 8) or (batch >= 16 and sp > 33))):
            continue
        split = kplan.split_layout(context, sp, bn)[1]
        rec = dict(base, config="sweep", block_n=bn, splits_requested=sp, splits=split, warps=w, stages=st)

        def fn(q, k, v, bn=bn, sp=sp, w=w, st=st):
            scale = 1.0 / d**0.5
            return fd._launch_decode(q, k, v, None, scale, sp, _tile_n=bn, _num_warps=w, _num_stages=st)[0]

        try:
            rec["max_abs_diff"] = diff = (fn(q, k, v).float() - ref.float()).abs().max().item()
            if not diff <= DECODE_TOLERANCE[dtype]:  # NaN fails too
                rec["status"] = f"mismatch: {diff:.3g} > {DECODE_TOLERANCE[dtype]:g}"
            else:
                ms = measure(fn)
                rec.update(status="ok", ms=ms, gbs=kv_bytes / (ms * 1e-3) / 1e9)
        except Exception as e:  # noqa: BLE001 - a configuration that does not compile or run is a result
            rec["status"] = common.failure(e)
        records.append(rec)
        print(json.dumps(rec))
    return records


def decode_markdown(meta: dict, records: list[dict]) -> str:
    """Per shape: the automatic configuration's time, the best 4, and time by splits per (block_n, warps,
    stages), with the splits launched in brackets where rounding to whole tiles changed the count."""
    us = lambda ms: f"{ms * 1e3:.1f}"
    label = lambda r: f"bn {r['block_n']} s{r['splits']} w{r['warps']} st{r['stages']}"
    lines = [f"# Decode tile sweep ({meta['device']}, {meta['dtype']})", ""]
    if not meta.get("complete", True):
        lines += [f"**Incomplete**: the run stopped (or is still running) after {len(records)} records.", ""]
    lines += [
        f"Times in us per call ({meta['timing']}); GB/s of K/V read. Every configuration is checked against "
        f"flash_decode (max abs difference <= {meta['tolerance']:g}).",
        "",
    ]
    shapes = sorted({(r["d"], r["batch"], r["context"]) for r in records}, key=lambda s: (-s[0], *s[1:]))
    for shape in shapes:
        rs = [r for r in records if (r["d"], r["batch"], r["context"]) == shape]
        auto, sweep = next(r for r in rs if r["config"] == "auto"), [r for r in rs if r["config"] == "sweep"]
        ok = sorted((r for r in sweep if r["status"] == "ok"), key=lambda r: r["ms"])
        best = "; ".join(f"{label(r)}: {us(r['ms'])} us, {r['gbs']:.0f} GB/s" for r in ok[:4]) or "none"
        lines += [
            f"## d {shape[0]}, batch {shape[1]}, context {shape[2]} (Hkv {auto['kv_heads']}, group "
            f"{auto['group']}, K/V {auto['kv_bytes'] / 1e6:.1f} MB)",
            "",
            f"Automatic (block_n {auto['block_n']}, splits {auto['splits']}, Triton's warps/stages): "
            f"{us(auto['ms'])} us, {auto['gbs']:.0f} GB/s.",
            "",
            f"Best: {best}",
            "",
        ]
        if bad := [r for r in sweep if r["status"] != "ok"]:
            not_timed = "; ".join(label(r) + " " + r["status"] for r in bad[:4])
            lines += [f"Not timed: {len(bad)} ({not_timed})", ""]
        if not sweep:
            continue

        def cell(r: dict | None, c: int) -> str:
            if r is None or r["status"] != "ok":
                return "-" if r is None else r["status"].split(":")[0]
            return us(r["ms"]) + (f" ({r['splits']})" if r["splits"] != c else "")

        cols, rows = sorted({r["splits_requested"] for r in sweep}), []
        for key in sorted({(r["block_n"], r["warps"], r["stages"]) for r in sweep}):
            row = {r["splits_requested"]: r for r in sweep if (r["block_n"], r["warps"], r["stages"]) == key}
            rows.append([*key, *(cell(row.get(c), c) for c in cols)])
        head = ["block_n", "warps", "stages", *(f"s={c}" for c in cols)]
        lines += [*common.md_table(head, rows, "---"), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def decode_search(a) -> int:
    """The decode tile search over DECODE_SHAPES (or the product of --dims, --batches, --contexts)."""
    shapes = list(default := DRY_DECODE_SHAPES if a.dry_run else DECODE_SHAPES)
    if (given := (a.dims, a.batches, a.contexts)) != (None, None, None):  # the first shape's for the others
        shapes = list(itertools.product(*(x or [y] for x, y in zip(given, default[0], strict=True))))
    a.prune = a.splits is None and not a.dry_run  # splits given by the user are swept as given
    for key, value in (DRY_DECODE_GRID if a.dry_run else DECODE_GRID).items():
        setattr(a, key, getattr(a, key) or value)
    a.kv_heads = a.kv_heads or (2 if a.dry_run else 8)
    a.timer = common.Timer(a.device, warmup_ms=10, rep_ms=40, cpu_reps=1)  # CPU (dry run): one timed call
    timing = "CPU dry run: median of 1 eager call after a warm-up"
    if not a.dry_run:
        timing = f"CUDA graph of {common.GRAPH_CALLS} calls cycling through L2-spanning K/V copies, "
        timing += f"{a.timer.describe()} / {common.GRAPH_CALLS}"
    env = common.environment(a.device)
    grid = dict(block_n=a.block_n, splits=a.splits, warps=a.warps, stages=a.stages, pruned=a.prune)
    meta = dict(device=env["gpu"] or "cpu", dtype=str(a.dtype)[6:], torch=env["torch"], triton=env["triton"])
    meta |= dict(time=env["date"], argv=a.argv, shapes=[list(s) for s in shapes], kv_heads=a.kv_heads)
    meta |= dict(group=a.group, grid=grid, tolerance=DECODE_TOLERANCE[a.dtype], timing=timing)
    out = Path(a.out or ("outputs/bench" if a.dry_run else "bench/results"))
    tag = a.tag or ("dryrun" if a.dry_run else "h200")
    results = common.Results(out / f"decode_tiles_{tag}.json", meta, decode_markdown, records=[])
    results.save()
    for d, b, ctx in shapes:
        t0 = time.perf_counter()
        results.add("records", decode_shape(a, d, b, ctx))
        common.free_memory(a.device)
        common.log(f"[bench.tune --decode] d={d} batch={b} context={ctx}: {time.perf_counter() - t0:.1f} s")
    print(results.save(complete=True))
    bad = [r for r in results.lists["records"] if r.get("status") != "ok"]
    if a.dry_run and bad:  # the plumbing check: every configuration must run and match
        return common.error(f"dry run: {len(bad)} configuration(s) failed, first: {bad[0].get('status')}", 1)
    return 0


# (BLOCK, warps) of the loss search: 8-64 logits a thread; registers 128 / 64 / 128 / 64 / 125 (offline
# sm_90 compile, `python -m kernels.compile_report --loss 4096x4 ...`; 16,384 x 8 takes 252: one program
# per SM)
LOSS_TILES = [(4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16)]
LOSS_PROGRAMS = [1, 2, 3, 4]


def loss_search(a) -> int:
    """Every launch of LOSS_TILES x LOSS_PROGRAMS: checked (the loss of every row, the gradient of the first
    and last), then timed; prints each and the best three."""
    from kernels import cross_entropy as ce

    rows, vocab = (8, 300) if a.dry_run else (32768, 50304)
    gen = torch.Generator(device=a.device).manual_seed(a.seed)
    x = torch.randn(rows, vocab, device=a.device, dtype=a.dtype, generator=gen)
    t = torch.randint(0, vocab, (rows,), device=a.device, generator=gen)
    want = F.cross_entropy(x.double(), t, reduction="none")
    ends = x[[0, -1]].double()  # (2, V): softmax - onehot of the first and last row
    want_grad = ends.softmax(-1) - F.one_hot(t[[0, -1]], vocab).double()
    ops = torch.ops.flashgpt
    op = ops.cross_entropy_grad_ if a.device.type == "cuda" else ops.cross_entropy_grad_cpu_
    work, gb = x.clone(), 2 * x.numel() * x.element_size() / 1e9  # the logits read once, written once
    copy_ms = a.timer(lambda: work.copy_(x))
    print(f"{a.gpu or 'cpu'}, logits ({rows} x {vocab}) {str(a.dtype)[6:]}: copy {copy_ms:.3f} ms")
    default, timed = (ce.PROGRAMS_PER_SM, ce.BLOCK, ce.NUM_WARPS), []
    tiles = [(128, 4)] if a.dry_run else LOSS_TILES
    try:
        for launch in [(p, b, w) for p in LOSS_PROGRAMS for b, w in tiles]:
            ce.PROGRAMS_PER_SM, ce.BLOCK, ce.NUM_WARPS = launch
            name = "programs/SM {}, BLOCK {}, warps {}".format(*launch)
            work.copy_(x)
            err = (op(work, t).double() - want).abs().max().item()
            err = max(err, (work[[0, -1]].double() - want_grad).abs().max().item())
            if err > 1e-2:
                return common.error(f"{name}: loss or gradient off by {err:.2e} (float64 reference)", 1)
            ms = a.timer(lambda: op(work, t))  # in place: later calls read the gradient, the same bytes
            timed.append((ms, name))
            print(f"{name}: {ms:.3f} ms, {gb / ms:.2f} TB/s{' (default)' if launch == default else ''}")
    finally:
        ce.PROGRAMS_PER_SM, ce.BLOCK, ce.NUM_WARPS = default
    for ms, name in sorted(timed)[:3]:
        print(f"best: {name}: {ms:.3f} ms, {ms / copy_ms:.2f}x a copy's time")
    return 0


def main(argv=None) -> int:
    """Exit status 0, 1 (a dry run whose decode configuration failed), or 2 for bad input or no GPU, with a
    message naming the fix and nothing written."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--dry-run" in argv:  # before kernels/ is imported (by --configs parsing too)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    ints = common.ints()
    raw = argparse.RawDescriptionHelpFormatter  # --help shows the module docstring as written
    p = argparse.ArgumentParser(prog="python -m bench.tune", description=__doc__, formatter_class=raw)
    add = p.add_argument
    add("--seqlens", type=ints, help="N (default 1024,4096,16384; --plans 4096,16384; dry run 32)")
    add("--headdims", "--d", dest="headdims", type=ints, help="d (default 64,128; dry run 16)")
    add("--kernels", default="fwd,bwd_dkdv,bwd_dq", help="search: from fwd,bwd_dkdv,bwd_dq, or bwd")
    add("--configs", type=parse_configs, help="search: explicit candidates BMxBNxWARPSxSTAGES[t],...")
    add("--tma", action="store_true", help="with --kernels bwd: pairs with TMA loads")
    add("--plans", nargs="+", help="interleaved A/B of these plans instead of a search")
    add("--rounds", type=common.positive, default=3, help="A/B rounds (default 3)")
    add("--no-bwd", action="store_true", help="A/B: forward only")
    add("--tokens", type=int, help="B*N per shape (default 16384; dry run 64)")
    add("--hidden", type=int, help="H*d (default 2048; dry run 32)")
    add("--decode", action="store_true", help="the flash-decode tile and split search")
    add("--loss", action="store_true", help="the fused loss kernel's launch search")
    add("--dims", type=ints, help="decode: d (with --batches/--contexts: their product)")
    add("--batches", type=ints, help="decode: batch sizes")
    add("--contexts", type=ints, help="decode: context lengths")
    add("--kv-heads", type=common.positive, help="decode: KV heads (default 8)")
    add("--group", type=common.positive, default=4, help="decode: query heads per KV head")
    add("--block-n", type=common.ints(16, pow2=True), help="decode: key tiles (default 32,64,128)")
    add("--splits", type=ints, help="decode: requested splits (default 1 .. 132)")
    add("--warps", type=common.ints(1, pow2=True), help="decode: num_warps (default 4,8)")
    add("--stages", type=ints, help="decode: num_stages (default 2,3)")
    add("--seed", type=int, default=0)
    add("--tag", help="decode: file tag (default h200; dry run dryrun)")
    add("--out", help="search: JSON lines appended (outputs/tune.jsonl); A/B: none; decode: a folder")
    add("--dry-run", action="store_true", help="tiny CPU run under TRITON_INTERPRET=1 (float32)")
    a = p.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # each result as it comes, also into a pipe or a log
    a.argv, a.kernels = argv, [k.strip() for k in a.kernels.split(",") if k.strip()]
    if a.kernels != ["bwd"] and (not a.kernels or any(k not in SEARCH_KERNELS for k in a.kernels)):
        p.error(f"--kernels {','.join(a.kernels)!r}: choose from {','.join(SEARCH_KERNELS)}, or bwd alone")
    from bench.attention import shape_for
    from kernels import override_tile_config

    checks = [(text, parse_plan(text)) for text in a.plans or ()]
    checks += [(f"--configs {cfg}", {k: cfg}) for cfg in a.configs or () for k in SEARCH_KERNELS]
    for text, tiles in checks:  # bad plans and tiles are refused before any GPU work
        try:
            with override_tile_config(**{k: v for k, v in tiles.items() if k != "provider"}):
                pass
        except ValueError as exc:
            return common.error(f"{text}: {exc}")
    if a.dry_run:
        a.device, a.dtype, a.gpu = torch.device("cpu"), torch.float32, None
    elif not torch.cuda.is_available():
        return common.error(
            "python -m bench.tune times CUDA kernels and needs a CUDA GPU "
            "(torch.cuda.is_available() is False). On a CPU, `python -m bench.tune --dry-run ...` checks "
            "the plumbing and `python -m kernels.compile_report` compiles the kernels for sm_90 offline."
        )
    else:
        a.device, a.dtype, a.gpu = torch.device("cuda"), torch.bfloat16, torch.cuda.get_device_name()
    a.timer = common.Timer(a.device, cpu_reps=1)  # CPU (dry run): one timed call; --decode sets its own
    if a.decode:
        return decode_search(a)
    if a.loss:
        return loss_search(a)
    small = a.dry_run
    a.seqlens = a.seqlens or ([32] if small else [4096, 16384] if a.plans else [1024, 4096, 16384])
    a.headdims = a.headdims or ([16] if small else [64, 128])
    a.tokens, a.hidden = a.tokens or (64 if small else 16384), a.hidden or (32 if small else 2048)
    for d in a.headdims:
        try:
            shape_for(a.tokens, a.hidden, a.seqlens[0], d)
        except ValueError as exc:
            return common.error(str(exc))
    # outputs/ is git-ignored: a search never lands in the tree, and a dry run never beside a GPU search
    default = None if a.plans else "outputs/bench/tune_dryrun.jsonl" if small else "outputs/tune.jsonl"
    out_path = a.out or default
    if out_path:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "a") if out_path else contextlib.nullcontext() as out:
        (ab if a.plans else search)(a, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
