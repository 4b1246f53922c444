"""Tile search and interleaved A/B timing of our FlashAttention kernels' tile plans (run on the GPU).

Both modes time causal attention through the public API only: `kernels.flash_attention` (forward, and
forward+backward through its autograd; backward = forward+backward minus forward, as `bench.attention`
times a provider) with the tiles forced by `kernels.override_tile_config`. Shapes as in `bench.attention`:
B = max(1, --tokens // N), H = --hidden // d, q, k, v, dO standard normal in bf16 from a generator seeded
by (N, d), so every invocation sees the same data per shape. FLOPs: forward 2·B·H·N²·d (causal), backward
2.5× that (Dao 2023, FlashAttention-2, §4.1). `bench/NOTES.md` records what each search chose.

Search (default): for each (d, N), every candidate tile of one kernel, the other kernels at their
defaults; `fwd` candidates are timed by the forward, `bwd_dkdv` / `bwd_dq` candidates by the whole backward
(the two backward kernels are separate launches, so the search is separable). Prints the default, the best
and the top 3 per (kernel, d, N) and appends one JSON line per candidate to --out:

    python -m bench.tune --seqlens 1024,4096,16384 --headdims 64,128 --out /tmp/tune.jsonl
    python -m bench.tune --kernels bwd_dkdv --headdims 128 --configs 64x64x4x2t,64x128x8x2

`--kernels bwd` searches (dK/dV tile, dQ tile) pairs jointly; with `--tma`, pairs whose tiles choose
tensor-descriptor (TMA) loads per kernel (`TileConfig.tma`), the same tiles with and without TMA:

    python -m bench.tune --kernels bwd --tma --seqlens 1024,4096,16384 --out /tmp/tune_bwd.jsonl

Interleaved A/B (`--plans`): every plan in turn for --rounds rounds (A B C A B C ...), so clock and thermal
drift hit every plan alike, which separate runs do not (NOTES v5); prints per (N, plan) the median forward
and backward TFLOP/s over the rounds and their range. A plan is 'default', 'fwd=CFG', 'dkdv=CFG', 'dq=CFG'
or several joined by '+', or 'provider:NAME' to time another provider of `bench.attention` (e.g.
provider:flex, provider:sdpa-cudnn) as a yardstick in the same rounds:

    python -m bench.tune --d 64 --seqlens 4096,16384 --plans default fwd=128x64x8x3 provider:flex

CFG is BMxBNxWARPSxSTAGES with an optional 't' (TMA loads; dK/dV and dQ only), e.g. 128x64x8x3 or 64x64x4x2t.
`--dry-run` runs either mode on the CPU under TRITON_INTERPRET=1 with tiny float32 shapes (plumbing only:
the timings mean nothing).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

import torch

PLAN_KEYS = {"fwd": "fwd", "dkdv": "bwd_dkdv", "dq": "bwd_dq"}
SEARCH_KERNELS = ("fwd", "bwd_dkdv", "bwd_dq")


# --------------------------------------------------------------------------------------------- syntax


def cfg_fields(cfg) -> list:
    """JSON-friendly [BLOCK_M, BLOCK_N, warps, stages, tma] of a `kernels.TileConfig`, plus its `no_tma`
    alternative as a nested list when it has one."""
    out = [cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.tma]
    if cfg.no_tma is not None:
        out.append(cfg_fields(cfg.no_tma))
    return out


def _bad_input(message: str) -> NoReturn:
    """Print ``message`` to stderr and exit 2 (bad input, as the module's exit statuses say)."""
    print(message, file=sys.stderr)
    raise SystemExit(2)


def parse_configs(text: str) -> list:
    """'BMxBNxWARPSxSTAGES[t]' comma-separated ('t': TMA loads) -> [TileConfig, ...],
    e.g. '128x64x8x3,64x128x4x2t'. Exits 2 naming the item and the format when one is malformed."""
    from kernels import TileConfig

    cfgs = []
    for item in text.split(","):
        item = item.strip()
        tma = item.endswith("t")
        parts = (item[:-1] if tma else item).split("x")
        if len(parts) != 4 or not all(x.isdigit() for x in parts):
            _bad_input(f"error: tile config {item!r} is not BMxBNxWARPSxSTAGES[t] (e.g. 128x64x8x3)")
        cfgs.append(TileConfig(*map(int, parts), tma=tma))
    return cfgs


def parse_plan(text: str) -> dict:
    """A/B plan text -> overrides for `kernels.override_tile_config`: 'default' -> {},
    'fwd=128x64x8x3+dq=128x64x8x3t' -> {'fwd': TileConfig, 'bwd_dq': TileConfig},
    'provider:flex' -> {'provider': 'flex'}. Exits 2 naming the bad part and the valid forms."""
    if text == "default":
        return {}
    if text.startswith("provider:"):
        name = text.partition(":")[2]
        if not name or "+" in name or "=" in name:
            _bad_input(
                f"error: plan {text!r}: provider:NAME takes one provider of bench.attention "
                "(e.g. provider:flex) and no tile overrides"
            )
        return {"provider": name}
    plan = {}
    for part in text.split("+"):
        key, _, cfg = part.partition("=")
        if key not in PLAN_KEYS or not cfg:
            _bad_input(
                f"error: plan part {part!r}: expected default, fwd=CFG, dkdv=CFG, dq=CFG "
                "(joined by '+') or provider:NAME"
            )
        plan[PLAN_KEYS[key]] = parse_configs(cfg)[0]
    return plan


# ------------------------------------------------------------------------------------------ candidates


def candidates(kernel: str, d: int, explicit: list | None = None) -> Iterator:
    """Tile candidates of one kernel for head dim d: `explicit` when given, else a grid over
    (BLOCK_M, BLOCK_N, warps, stages), without tiles of more than 128×128 at d >= 128."""
    from kernels import TileConfig

    if explicit is not None:
        yield from explicit
        return
    if kernel == "fwd":
        space = itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))
    elif kernel == "bwd_dkdv":
        space = itertools.product((32, 64, 128), (64, 128), (4, 8), (2, 3))
    else:  # bwd_dq
        space = itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))
    for bm, bn, w, s in space:
        if d >= 128 and bm * bn > 128 * 128:
            continue
        yield TileConfig(bm, bn, w, s)


def bwd_plans(d: int, n: int, tma: bool) -> Iterator[tuple]:
    """(dK/dV tile, dQ tile) pairs of the joint backward search. Pointer loads around the optimum of
    NOTES v1 (`tma` False), or the TMA pairs of NOTES v4: the same tiles with and without TMA per kernel."""
    from kernels import TileConfig as T

    if not tma:
        if d >= 128:
            for s in (2, 3):
                for dq in ((128, 32), (128, 64), (64, 64)):
                    yield T(64, 128, 8, s), T(*dq, 8, s)
            for dq in ((128, 32), (64, 64)):
                yield T(64, 64, 8, 3), T(*dq, 8, 3)
            yield T(32, 128, 8, 3), T(128, 32, 8, 3)
        else:
            for dkdv in ((64, 128), (64, 64), (32, 128), (128, 64)):
                for dq in ((128, 64), (64, 64), (128, 32)):
                    yield T(*dkdv, 8, 3), T(*dq, 8, 3)
            for dkdv in ((64, 64), (32, 64), (32, 128)):
                for dq in ((64, 64), (64, 32)):
                    yield T(*dkdv, 4, 3), T(*dq, 4, 3)
            yield T(64, 128, 8, 2), T(128, 64, 8, 2)
        return
    if d >= 128:
        k1 = T(64, 128, 8, 3)
        for dq in (
            T(128, 64, 8, 3, tma=True),
            T(128, 64, 8, 3),
            T(128, 32, 8, 3, tma=True),
            T(64, 64, 4, 3, tma=True),
        ):
            yield k1, dq
        yield replace(k1, tma=True), T(128, 64, 8, 3, tma=True)
        yield T(64, 128, 8, 2), T(128, 64, 8, 3, tma=True)
        return
    if n <= 1024:
        k1s, dqs = (T(32, 64, 4, 3), T(64, 128, 4, 2)), (T(64, 32, 4, 3), T(64, 64, 4, 3))
    else:
        k1s, dqs = (T(64, 128, 4, 2),), (T(128, 64, 8, 3), T(64, 64, 4, 3))
    for k1, tma1, dq, tma2 in itertools.product(k1s, (False, True), dqs, (False, True)):
        yield replace(k1, tma=tma1), replace(dq, tma=tma2)


# -------------------------------------------------------------------------------------------- timing


class Shape:
    """Inputs of one benchmark shape: q, k, v (leaves with requires_grad) and dO, (B, H, N, d)."""

    def __init__(self, a, n: int, d: int):
        from bench.attention import shape_for

        self.n, self.d = n, d
        self.b, self.h = shape_for(a.tokens, a.hidden, n, d)
        gen = torch.Generator(device=a.device).manual_seed(n * 1000 + d)
        q, k, v, self.do = (
            torch.randn(self.b, self.h, n, d, device=a.device, dtype=a.dtype, generator=gen) for _ in range(4)
        )
        self.leaves = [t.requires_grad_() for t in (q, k, v)]
        self.fwd_flops = 2.0 * self.b * self.h * n * n * d  # causal forward; backward is 2.5x

    def describe(self) -> str:
        return f"d={self.d} N={self.n} (B={self.b}, H={self.h})"


def time_plan(
    shape: Shape,
    timer,
    tiles: dict,
    *,
    fn: Callable | None = None,
    bwd: bool = True,
    fwd_ms: float | None = None,
) -> tuple[float | None, float | None, str | None]:
    """(forward ms, backward ms, error) of `fn` (default `kernels.flash_attention(causal=True)`) on `shape`
    under `override_tile_config(**tiles)`; backward = forward+backward minus forward, None with `bwd` False.
    `fwd_ms` given: the forward is not timed again. A plan that cannot launch (tiles beyond the shared
    memory or registers) gives (None, None, exception type name) instead of raising."""
    from kernels import flash_attention, override_tile_config

    leaves, do = shape.leaves, shape.do
    call = fn or (lambda q, k, v: flash_attention(q, k, v, causal=True))

    def fwd():
        return call(*leaves)

    def fwdbwd():
        fwd().backward(do)

    with override_tile_config(**tiles):
        try:
            (fwdbwd if bwd else fwd)()
            if shape.do.is_cuda:
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


def _fmt_tf(x: float | None) -> str:
    return "—" if x is None else f"{x:.0f}"


def _record(a, shape: Shape, **fields) -> dict:
    return dict(
        d=shape.d,
        N=shape.n,
        B=shape.b,
        H=shape.h,
        **fields,
        gpu=a.gpu,
        torch=torch.__version__,
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )


def _progress(items: Sequence, desc: str):
    """tqdm over `items` on stderr (elapsed time and ETA of a long search), plain iteration without tqdm."""
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, leave=False, file=sys.stderr, disable=not sys.stderr.isatty())


# --------------------------------------------------------------------------------------------- modes


def search(a, out) -> None:
    """Tile search of the module docstring: separable per kernel, or joint backward (`--kernels bwd`)."""
    from kernels import get_tile_config

    for d in a.headdims:
        for n in a.seqlens:
            shape = Shape(a, n, d)
            fwd_default, _, err = time_plan(shape, a.timer, {}, bwd=False)
            if err:
                print(f"{shape.describe()}: the default tiles do not run ({err}); shape skipped", flush=True)
                continue
            for kernel in a.kernels:
                if kernel == "bwd":
                    defaults = tuple(
                        get_tile_config(k, d, a.dtype, True, n, n, interpret=a.dry_run)
                        for k in ("bwd_dkdv", "bwd_dq")
                    )
                    plans = [defaults, *bwd_plans(d, n, a.tma)]
                    to_tiles = lambda p: {"bwd_dkdv": p[0], "bwd_dq": p[1]}
                    fields = lambda p: {"dkdv": cfg_fields(p[0]), "dq": cfg_fields(p[1])}
                else:
                    default = get_tile_config(kernel, d, a.dtype, True, n, n, interpret=a.dry_run)
                    plans = [default, *candidates(kernel, d, a.configs)]
                    to_tiles = lambda p, kernel=kernel: {kernel: p}
                    fields = lambda p: {"cfg": cfg_fields(p)}
                flops = shape.fwd_flops * (1.0 if kernel == "fwd" else 2.5)
                rows, t0 = [], time.time()
                for i, plan in enumerate(_progress(plans, f"{kernel} d={d} N={n}")):
                    if kernel == "fwd":
                        ms, _, err = time_plan(shape, a.timer, to_tiles(plan), bwd=False)
                    else:
                        _, ms, err = time_plan(shape, a.timer, to_tiles(plan), fwd_ms=fwd_default)
                    tag = "default" if i == 0 else "candidate"
                    rec = _record(
                        a,
                        shape,
                        kernel=kernel,
                        plan=tag,
                        **fields(plan),
                        ms=ms,
                        err=err,
                        tflops=_tflops(flops, ms),
                    )
                    out.write(json.dumps(rec) + "\n")
                    out.flush()
                    if ms is not None:
                        rows.append((ms, i, plan))
                    if a.configs is not None or kernel == "bwd":
                        result = f"{ms:.3f} ms ({rec['tflops']:.0f} TF/s)" if err is None else err
                        what = json.dumps(fields(plan))
                        print(f"  {kernel:8s} {shape.describe()} {tag:9s} {what}: {result}", flush=True)
                if not rows:
                    print(f"{kernel:8s} {shape.describe()}: no candidate ran", flush=True)
                    continue
                base = next((r for r in rows if r[1] == 0), None)
                rows.sort(key=lambda r: r[0])
                top3 = [(round(ms, 3), fields(p)) for ms, _, p in rows[:3]]
                base_txt = (
                    f"default {base[0]:.3f} ms ({_fmt_tf(_tflops(flops, base[0]))} TF/s)"
                    if base
                    else "default did not run"
                )
                print(
                    f"{kernel:8s} {shape.describe()}: {base_txt} | best {json.dumps(fields(rows[0][2]))} "
                    f"{rows[0][0]:.3f} ms ({_fmt_tf(_tflops(flops, rows[0][0]))} TF/s) | top3 {top3} "
                    f"[{time.time() - t0:.0f} s]",
                    flush=True,
                )
            del shape
            _empty_cache(a)


def ab(a, out) -> None:
    """Interleaved A/B of the module docstring: every plan in turn for a.rounds rounds per (d, N)."""
    from bench._providers import build_provider

    plans = [(text, parse_plan(text)) for text in a.plans]
    for d in a.headdims:
        for n in a.seqlens:
            shape = Shape(a, n, d)
            impl = {
                text: build_provider(p["provider"], n=n, device=a.device) if "provider" in p else None
                for text, p in plans
            }
            res: dict[str, tuple[list, list, set]] = {text: ([], [], set()) for text, _ in plans}
            for _ in _progress(range(a.rounds), f"rounds d={d} N={n}"):
                for text, plan in plans:
                    tiles = {} if "provider" in plan else plan
                    f_ms, b_ms, err = time_plan(shape, a.timer, tiles, fn=impl[text], bwd=not a.no_bwd)
                    fwd_tf, bwd_tf, errs = res[text]
                    if err:
                        errs.add(err)
                        continue
                    fwd_tf.append(_tflops(shape.fwd_flops, f_ms))
                    if b_ms is not None:
                        bwd_tf.append(_tflops(2.5 * shape.fwd_flops, b_ms))
            for text, (fwd_tf, bwd_tf, errs) in res.items():
                line = f"d={d} N={n:6d} {text:40s} "
                if errs or not fwd_tf:
                    print(line + f"did not run: {', '.join(sorted(errs))}", flush=True)
                    continue
                bwd_tf = [x for x in bwd_tf if x is not None]
                line += f"fwd {statistics.median(fwd_tf):6.1f} TF/s ({min(fwd_tf):.0f}-{max(fwd_tf):.0f})"
                if bwd_tf:
                    line += (
                        f"  bwd {statistics.median(bwd_tf):6.1f} TF/s ({min(bwd_tf):.0f}-{max(bwd_tf):.0f})"
                    )
                elif not a.no_bwd:  # forward+backward timed no slower than forward alone: noise, no figure
                    line += "  bwd      — (fwd+bwd not slower than fwd: timing noise)"
                print(line, flush=True)
                if out is not None:
                    out.write(
                        json.dumps(
                            _record(
                                a, shape, plan=text, rounds=a.rounds, fwd_tflops=fwd_tf, bwd_tflops=bwd_tf
                            )
                        )
                        + "\n"
                    )
                    out.flush()
            del shape
            _empty_cache(a)


def _empty_cache(a) -> None:
    if a.device.type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------- CLI


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def build_parser() -> argparse.ArgumentParser:
    """The CLI of both modes; its --help is the module docstring (plan syntax, example commands)."""
    p = argparse.ArgumentParser(
        prog="python -m bench.tune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--seqlens",
        type=_ints,
        default=None,
        help="comma list of N (default: search 1024,4096,16384; --plans 4096,16384; dry run 32)",
    )
    p.add_argument(
        "--headdims",
        "--d",
        dest="headdims",
        type=_ints,
        default=None,
        help="comma list of d (default 64,128; dry run 16)",
    )
    p.add_argument(
        "--kernels",
        default="fwd,bwd_dkdv,bwd_dq",
        help="search: comma list from fwd,bwd_dkdv,bwd_dq, or bwd for the joint backward search",
    )
    p.add_argument(
        "--configs",
        type=parse_configs,
        default=None,
        help="search: explicit candidates for every kernel and d instead of the grid: "
        "BMxBNxWARPSxSTAGES[t],... ('t': TMA loads, bwd_dkdv / bwd_dq only)",
    )
    p.add_argument(
        "--tma",
        action="store_true",
        help="with --kernels bwd: search backward pairs with tensor-descriptor (TMA) loads",
    )
    p.add_argument(
        "--plans",
        nargs="+",
        default=None,
        help="interleaved A/B of these plans instead of a search (syntax in the description)",
    )
    p.add_argument("--rounds", type=int, default=3, help="A/B rounds (default 3)")
    p.add_argument("--no-bwd", action="store_true", help="A/B: forward only")
    p.add_argument("--tokens", type=int, default=None, help="B*N per shape (default 16384; dry run 64)")
    p.add_argument("--hidden", type=int, default=None, help="H*d (default 2048; dry run 32)")
    p.add_argument(
        "--out",
        default=None,
        help="JSON lines appended here (default: search outputs/tune.jsonl, --dry-run "
        "outputs/bench/tune_dryrun.jsonl; A/B: none, console only)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny CPU run under TRITON_INTERPRET=1 (float32) to check the plumbing",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the search, or the A/B with --plans; returns the exit status (0, or 2 for bad input or no GPU,
    with a message naming the fix and nothing written)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--dry-run" in argv:  # before kernels/ is imported (by --configs parsing too): triton.jit reads it
        os.environ.setdefault("TRITON_INTERPRET", "1")
    p = build_parser()
    a = p.parse_args(argv)
    kernels = [k.strip() for k in a.kernels.split(",") if k.strip()]
    if kernels != ["bwd"] and (not kernels or any(k not in SEARCH_KERNELS for k in kernels)):
        p.error(f"--kernels {a.kernels!r}: choose from {','.join(SEARCH_KERNELS)}, or bwd alone")
    if a.rounds < 1:
        p.error("--rounds must be >= 1")
    a.kernels = kernels
    from kernels import override_tile_config

    checks = [(text, parse_plan(text)) for text in a.plans or ()]
    checks += [(f"--configs {cfg}", {k: cfg}) for cfg in a.configs or () for k in SEARCH_KERNELS]
    for text, tiles in checks:  # bad plans and tiles are refused before any GPU work
        try:
            with override_tile_config(**{k: v for k, v in tiles.items() if k != "provider"}):
                pass
        except ValueError as exc:
            print(f"error: {text}: {exc}", file=sys.stderr)
            return 2
    if a.dry_run:
        a.device, a.dtype, a.gpu = torch.device("cpu"), torch.float32, None
    elif not torch.cuda.is_available():
        print(
            "error: python -m bench.tune times CUDA kernels and needs a CUDA GPU "
            "(torch.cuda.is_available() is False). On a CPU, `python -m bench.tune --dry-run ...` "
            "checks the plumbing and "
            "`python -m kernels.compile_report` compiles the kernels for sm_90 offline.",
            file=sys.stderr,
        )
        return 2
    else:
        a.device, a.dtype, a.gpu = torch.device("cuda"), torch.bfloat16, torch.cuda.get_device_name()
    small = a.dry_run
    a.seqlens = a.seqlens or ([32] if small else [4096, 16384] if a.plans else [1024, 4096, 16384])
    a.headdims = a.headdims or ([16] if small else [64, 128])
    a.tokens = a.tokens or (64 if small else 16384)
    a.hidden = a.hidden or (32 if small else 2048)
    from bench._timing import Timer
    from bench.attention import shape_for

    for d in a.headdims:
        try:
            shape_for(a.tokens, a.hidden, a.seqlens[0], d)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    a.timer = Timer(a.device, cpu_reps=1) if small else Timer(a.device)
    # outputs/ is git-ignored: a search never lands in the tree, and a dry run never beside a GPU search
    default_out = "outputs/bench/tune_dryrun.jsonl" if a.dry_run else "outputs/tune.jsonl"
    out_path = a.out or (None if a.plans else default_out)
    if out_path:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    out = open(out_path, "a") if out_path else None
    try:
        (ab if a.plans else search)(a, out)
    finally:
        if out is not None:
            out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
