"""Tile-configuration search for the Triton FlashAttention kernels (run on the GPU).

For each (d, N) of the benchmark shapes (B·N = --tokens, H·d = --hidden, causal bf16) it times the
forward kernel and the backward (preprocess + dK/dV + dQ) for a grid of candidate tile configs, through
`kernels.tiles.override_tile_config`, and prints the best per (kernel, d, N). The backward search is
separable: dK/dV candidates are timed with dQ at its default and vice versa (the kernels are independent
launches, so their times add). Results go to --out as JSON lines; `bench/NOTES.md` records what was chosen.

    python -m bench.tune --seqlens 1024,4096,16384 --headdims 64,128 --out /tmp/tune.jsonl

`--kernels bwd` is the joint backward search: each candidate is a (dK/dV tile, dQ tile) plan, timed
like `bench/attention.py` times a provider -- forward+backward through
`flash_attention`'s autograd, minus the forward -- so host-side costs between launches count too.

    python -m bench.tune --kernels bwd --seqlens 1024,4096,16384 --out /tmp/tune_bwd.jsonl

`--kernels bwd --tma` searches two-kernel backward plans whose tiles choose tensor-descriptor (TMA) loads
per kernel (`TileConfig.tma`), against the current default plan of the same run.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from dataclasses import replace

import torch
import triton

from bench._gpu import parser, require_cuda
from kernels.flash_attn import _launch_bwd, _launch_fwd
from kernels.tiles import TileConfig, get_tile_config, override_tile_config


def cfg_fields(cfg: TileConfig) -> list:
    """JSON-friendly [BLOCK_M, BLOCK_N, warps, stages, tma] (+ no_tma's list if set)."""
    out = [cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.tma]
    if cfg.no_tma is not None:
        out.append(cfg_fields(cfg.no_tma))
    return out


def parse_configs(text: str) -> list[TileConfig]:
    """'BMxBNxWARPSxSTAGES[t]' comma-separated ('t': TMA loads), e.g. '128x64x8x3,64x128x4x2t'."""
    cfgs = []
    for item in text.split(","):
        item = item.strip()
        tma = item.endswith("t")
        parts = (item[:-1] if tma else item).split("x")
        if len(parts) != 4 or not all(x.isdigit() for x in parts):
            raise SystemExit(f"--configs: {item!r} is not BMxBNxWARPSxSTAGES[t] (e.g. 128x64x8x3)")
        cfgs.append(TileConfig(*map(int, parts), tma=tma))
    return cfgs


def candidates(kernel: str, d: int, explicit: list[TileConfig] | None = None):
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


def bwd_plans(d: int):
    """Candidate backward plans (dkdv TileConfig, dq TileConfig, tma override None) for the joint search."""
    T = TileConfig
    if d >= 128:
        for s in (2, 3):
            for dq in ((128, 32), (128, 64), (64, 64)):
                yield T(64, 128, 8, s), T(*dq, 8, s), None
        for dq in ((128, 32), (64, 64)):
            yield T(64, 64, 8, 3), T(*dq, 8, 3), None
        yield T(32, 128, 8, 3), T(128, 32, 8, 3), None
    else:
        for dkdv in ((64, 128), (64, 64), (32, 128), (128, 64)):
            for dq in ((128, 64), (64, 64), (128, 32)):
                yield T(*dkdv, 8, 3), T(*dq, 8, 3), None
        for dkdv in ((64, 64), (32, 64), (32, 128)):
            for dq in ((64, 64), (64, 32)):
                yield T(*dkdv, 4, 3), T(*dq, 4, 3), None
        yield T(64, 128, 8, 2), T(128, 64, 8, 2), None


def tma_plans(d: int, n: int):
    """Candidate plans of the two-kernel backward with tensor-descriptor (TMA) loads per kernel (`--tma`):
    (dkdv TileConfig, dq TileConfig, tma override None: each TileConfig's own `tma`).
    Around the pointer-load optimum; the same tiles with and without TMA separate the two effects."""
    T = TileConfig
    if d >= 128:
        k1, k1t = T(64, 128, 8, 3), T(64, 128, 8, 3, tma=True)
        for dq in (T(128, 64, 8, 3, tma=True), T(128, 64, 8, 3), T(128, 32, 8, 3, tma=True),
                   T(64, 64, 4, 3, tma=True)):
            yield k1, dq, None
        yield k1t, T(128, 64, 8, 3, tma=True), None
        yield T(64, 128, 8, 2), T(128, 64, 8, 3, tma=True), None
    else:
        if n <= 1024:
            k1s, dqs = (T(32, 64, 4, 3), T(64, 128, 4, 2)), (T(64, 32, 4, 3), T(64, 64, 4, 3))
        else:
            k1s, dqs = (T(64, 128, 4, 2),), (T(128, 64, 8, 3), T(64, 64, 4, 3))
        for k1 in k1s:
            for tma1 in (False, True):
                for dq in dqs:
                    for tma2 in (False, True):
                        yield replace(k1, tma=tma1), replace(dq, tma=tma2), None


def time_autograd(q, k, v, do, dkdv, dq, tma=None):
    """(fwd+bwd ms, fwd ms) through flash_attention's autograd with the given backward plan."""
    from kernels import flash_attention

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def fwd():
        return flash_attention(*leaves, causal=True)

    def fwdbwd():
        fwd().backward(do)

    with override_tile_config(bwd_dkdv=dkdv, bwd_dq=dq, tma=tma):
        try:
            fwdbwd()
            torch.cuda.synchronize()
        except Exception as e:  # out of shared memory / registers: skip the plan
            return None, None, type(e).__name__
        t_all = triton.testing.do_bench(fwdbwd, warmup=25, rep=100, grad_to_none=leaves, return_mode="median")
        t_fwd = triton.testing.do_bench(fwd, warmup=25, rep=100, return_mode="median")
    return t_all, t_fwd, None


def shape_inputs(a, n: int, d: int, dev: torch.device):
    """(B, H, (q, k, v, dO)) for one benchmark shape: B = max(1, tokens // N), H = hidden // d, bf16
    standard normal from a generator seeded by (N, d), so every search sees the same data per shape."""
    b, h = max(1, a.tokens // n), a.hidden // d
    gen = torch.Generator(device=dev).manual_seed(n * 1000 + d)
    qkvdo = tuple(torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(4))
    return b, h, qkvdo


def tune_bwd(a, out) -> None:
    """Joint backward search (see the module docstring); prints the best plan per (d, N)."""
    dev = torch.device("cuda")
    for d in map(int, a.headdims.split(",")):
        for n in map(int, a.seqlens.split(",")):
            b, h, (q, k, v, do) = shape_inputs(a, n, d, dev)
            bwd_flops = 2.5 * 2 * b * h * n * n * d
            d1 = get_tile_config("bwd_dkdv", d, torch.bfloat16, True, n, n)
            d2 = get_tile_config("bwd_dq", d, torch.bfloat16, True, n, n)
            plans = [(d1, d2, None)] + list(tma_plans(d, n) if a.tma else bwd_plans(d))
            rows, t0 = [], time.time()
            for i, (dkdv, dq, tma) in enumerate(plans):
                t_all, t_fwd, err = time_autograd(q, k, v, do, dkdv, dq, tma)
                tag = "default" if i == 0 else "plan"
                tag += "+tma" if tma else ""
                tag += "".join(f"+{part}:tma" for part, c in (("kv", dkdv), ("q", dq))
                               if c.tma and tma is None)
                rec = dict(kernel="bwd", d=d, N=n, B=b, H=h, dkdv=cfg_fields(dkdv),
                           dq=cfg_fields(dq), plan=tag, fwdbwd_ms=t_all, fwd_ms=t_fwd,
                           err=err, gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                           triton=triton.__version__,
                           date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
                if t_all is not None:
                    rec["bwd_tflops"] = bwd_flops / (t_all - t_fwd) / 1e9
                    rows.append((t_all - t_fwd, dkdv, dq, tag))
                out.write(json.dumps(rec) + "\n")
                out.flush()
                print(f"  d={d} N={n} {tag:16s} dkdv={tuple(cfg_fields(dkdv))} "
                      f"dq={tuple(cfg_fields(dq))}: "
                      + (f"bwd {t_all - t_fwd:.3f} ms {rec['bwd_tflops']:.0f} TF/s" if err is None else err),
                      flush=True)
            rows.sort(key=lambda r: r[0])
            ms, dkdv, dq, tag = rows[0]
            print(f"BEST bwd d={d} N={n}: {tag} dkdv={dkdv} dq={dq} {ms:.3f} ms "
                  f"({bwd_flops / ms / 1e9:.0f} TF/s) [{time.time() - t0:.0f}s]", flush=True)
            del q, k, v, do
            torch.cuda.empty_cache()


def time_config(kernel, cfg, q, k, v, o, lse, do, scale):
    with override_tile_config(**{kernel: cfg}):
        if kernel == "fwd":
            fn = lambda: _launch_fwd(q, k, v, True, scale)
        else:
            fn = lambda: _launch_bwd(do, q, k, v, o, lse, True, scale)
        try:
            fn()
            torch.cuda.synchronize()
        except Exception as e:  # out of shared memory / registers: skip the config
            return None, type(e).__name__
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"), None


def main() -> None:
    p = parser("python -m bench.tune", __doc__)
    p.add_argument("--seqlens", default="1024,4096,16384")
    p.add_argument("--headdims", default="64,128")
    p.add_argument("--kernels", default="fwd,bwd_dkdv,bwd_dq")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--out", default="tune.jsonl")
    p.add_argument("--configs", type=parse_configs, default=None,
                   help="explicit candidates for every kernel and d instead of the grid: "
                        "BMxBNxWARPSxSTAGES[t],... ('t': TMA loads, bwd_dkdv / bwd_dq only)")
    p.add_argument("--tma", action="store_true",
                   help="with --kernels bwd: search the two-kernel backward with tensor-descriptor "
                        "(TMA) loads")
    a = p.parse_args()
    require_cuda("python -m bench.tune")
    dev = torch.device("cuda")
    out = open(a.out, "a")
    if a.kernels == "bwd":
        tune_bwd(a, out)
        out.close()
        return
    best = {}
    for d in map(int, a.headdims.split(",")):
        for n in map(int, a.seqlens.split(",")):
            b, h, (q, k, v, do) = shape_inputs(a, n, d, dev)
            scale = 1 / math.sqrt(d)
            o, lse = _launch_fwd(q, k, v, True, scale)
            flops_fwd = 2 * b * h * n * n * d
            for kernel in a.kernels.split(","):
                default = get_tile_config(kernel, d, torch.bfloat16, True, n, n)
                base_ms, _ = time_config(kernel, default, q, k, v, o, lse, do, scale)
                rows = []
                t0 = time.time()
                for cfg in candidates(kernel, d, a.configs):
                    ms, err = time_config(kernel, cfg, q, k, v, o, lse, do, scale)
                    rec = dict(kernel=kernel, d=d, N=n, B=b, H=h, cfg=cfg_fields(cfg),
                               ms=ms, err=err, default=cfg_fields(default), default_ms=base_ms)
                    out.write(json.dumps(rec) + "\n")
                    if ms is not None:
                        rows.append((ms, cfg))
                    if a.configs is not None:
                        f = flops_fwd * (1 if kernel == "fwd" else 2.5)
                        what = "" if kernel == "fwd" else " whole bwd"
                        print(f"  {kernel:9s} d={d:3d} N={n:6d} {tuple(cfg_fields(cfg))}: "
                              + (f"{ms:.3f} ms ({f / ms / 1e9:.0f} TF/s{what})" if ms is not None else err),
                              flush=True)
                rows.sort(key=lambda r: r[0])
                top3 = [(round(m, 3), tuple(cfg_fields(c))) for m, c in rows[:3]]
                f = flops_fwd * (1 if kernel == "fwd" else 2.5)
                ms, cfg = rows[0]
                best[(kernel, d, n)] = (cfg, ms)
                print(f"{kernel:9s} d={d:3d} N={n:6d} default {default} {base_ms:.3f} ms "
                      f"({f / base_ms / 1e9:.0f} TF/s{' whole bwd' if kernel != 'fwd' else ''}) | best {cfg} "
                      f"{ms:.3f} ms ({f / ms / 1e9:.0f}) | top3 {top3}"
                      f" [{time.time() - t0:.0f}s]", flush=True)
            del q, k, v, do, o, lse
            torch.cuda.empty_cache()
    out.close()


if __name__ == "__main__":
    main()
