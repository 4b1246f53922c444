"""Tile-configuration search for the Triton FlashAttention kernels (run on the GPU).

For each (d, N) of the benchmark shapes (B·N = --tokens, H·d = --hidden, causal bf16) it times the
forward kernel and the backward (preprocess + dK/dV + dQ) for a grid of candidate tile configs, through
`kernels.tiles.override_tile_config`, and prints the best per (kernel, d, N). The backward search is
separable: dK/dV candidates are timed with dQ at its default and vice versa (the kernels are independent
launches, so their times add). Results go to --out as JSON lines; `bench/NOTES.md` records what was chosen.

    python -m bench.tune --seqlens 1024,4096,16384 --headdims 64,128 --out /tmp/tune.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time

import torch
import triton

from kernels.flash_attn import _launch_bwd, _launch_fwd
from kernels.tiles import TileConfig, get_tile_config, override_tile_config


def candidates(kernel: str, d: int):
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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlens", default="1024,4096,16384")
    p.add_argument("--headdims", default="64,128")
    p.add_argument("--kernels", default="fwd,bwd_dkdv,bwd_dq")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--out", default="tune.jsonl")
    a = p.parse_args()
    dev = torch.device("cuda")
    out = open(a.out, "a")
    best = {}
    for d in map(int, a.headdims.split(",")):
        for n in map(int, a.seqlens.split(",")):
            b, h = max(1, a.tokens // n), a.hidden // d
            gen = torch.Generator(device=dev).manual_seed(n * 1000 + d)
            q, k, v, do = (torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16, generator=gen)
                           for _ in range(4))
            scale = 1 / math.sqrt(d)
            o, lse = _launch_fwd(q, k, v, True, scale)
            flops_fwd = 2 * b * h * n * n * d
            for kernel in a.kernels.split(","):
                default = get_tile_config(kernel, d, torch.bfloat16, True, n, n)
                base_ms, _ = time_config(kernel, default, q, k, v, o, lse, do, scale)
                rows = []
                t0 = time.time()
                for cfg in candidates(kernel, d):
                    ms, err = time_config(kernel, cfg, q, k, v, o, lse, do, scale)
                    rec = dict(kernel=kernel, d=d, N=n, B=b, H=h, cfg=list(cfg.__dict__.values()),
                               ms=ms, err=err, default=list(default.__dict__.values()), default_ms=base_ms)
                    out.write(json.dumps(rec) + "\n")
                    if ms is not None:
                        rows.append((ms, cfg))
                rows.sort(key=lambda r: r[0])
                top3 = [(round(m, 3), tuple(c.__dict__.values())) for m, c in rows[:3]]
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
