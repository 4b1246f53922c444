"""Interleaved A/B timing of flash tile plans, measured like bench/attention.py (run on the GPU).

For each N it times every plan in turn, for --rounds rounds (A B C A B C ...), through `flash_attention`'s
autograd with `triton.testing.do_bench` medians (warm-up 25 ms, 100 ms of repetitions): the forward, and
forward+backward minus forward as the backward. Interleaving puts clock and thermal drift into every
plan alike, which separate runs do not (bench/NOTES.md v5). Prints, per (N, plan), the median over the
rounds of the forward and backward TFLOP/s (causal bf16, B·N = --tokens, H·d = --hidden).

A plan is 'fwd=CFG', 'dkdv=CFG', 'dq=CFG' or several joined by '+',
each CFG in the format of `bench.tune --configs` (BMxBNxWARPSxSTAGES[t]); 'default' is the current
defaults; 'provider:NAME' times another provider of bench/attention.py instead (e.g. provider:flex,
provider:sdpa-cudnn), as a yardstick in the same interleaved rounds.

    python -m bench.ab_tiles --d 64 --seqlens 4096,16384 --plans default fwd=128x64x8x3
"""

from __future__ import annotations

import statistics

import torch
import triton

from bench._gpu import parser, require_cuda
from bench.attention import build_provider
from bench.tune import parse_configs
from kernels import flash_attention
from kernels.tiles import override_tile_config

_KEYS = {"fwd": "fwd", "dkdv": "bwd_dkdv", "dq": "bwd_dq"}


def parse_plan(text: str) -> dict:
    """'fwd=128x64x8x3+dq=128x64x8x3t' -> {'fwd': TileConfig, 'bwd_dq': TileConfig}; 'default' -> {}."""
    if text == "default":
        return {}
    if text.startswith("provider:"):
        name = text.partition(":")[2]
        if not name or "+" in name or "=" in name:
            raise SystemExit(f"plan {text!r}: provider:NAME takes one provider of bench/attention.py "
                             "(e.g. provider:flex) and no tile overrides")
        return {"provider": name}
    plan = {}
    for part in text.split("+"):
        key, _, cfg = part.partition("=")
        if key not in _KEYS or not cfg:
            raise SystemExit(f"plan part {part!r}: expected fwd=CFG, dkdv=CFG or dq=CFG")
        plan[_KEYS[key]] = parse_configs(cfg)[0]
    return plan


def measure(n: int, d: int, plans: list, a) -> None:
    """Time every plan at sequence length n, interleaved over a.rounds rounds; print the medians."""
    dev = torch.device("cuda")
    b, h = max(1, a.tokens // n), a.hidden // d
    gen = torch.Generator(device=dev).manual_seed(n * 1000 + d)
    q, k, v, do = (torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16, generator=gen)
                   for _ in range(4))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    flops = 2 * b * h * n * n * d

    impl = {name: build_provider(plan["provider"], n=n, device=dev) if "provider" in plan else None
            for name, plan in plans}
    current = [None]

    def fwd():
        if current[0] is not None:
            return current[0](*leaves)
        return flash_attention(*leaves, causal=True)

    def fwdbwd():
        fwd().backward(do)

    res = {name: ([], []) for name, _ in plans}
    for _ in range(a.rounds):
        for name, plan in plans:
            current[0] = impl[name]
            tiles = {} if "provider" in plan else plan
            with override_tile_config(**tiles):
                t_f = triton.testing.do_bench(fwd, warmup=25, rep=100, return_mode="median")
                res[name][0].append(flops / t_f / 1e9)
                if not a.no_bwd:
                    t_fb = triton.testing.do_bench(fwdbwd, warmup=25, rep=100, grad_to_none=leaves,
                                                   return_mode="median")
                    res[name][1].append(2.5 * flops / (t_fb - t_f) / 1e9)
    for name, (f, bw) in res.items():
        line = (f"d={d} N={n:6d} {name:40s} fwd {statistics.median(f):6.1f} TF/s "
                f"({min(f):.0f}-{max(f):.0f})")
        if bw:
            line += f"  bwd {statistics.median(bw):6.1f} TF/s ({min(bw):.0f}-{max(bw):.0f})"
        print(line, flush=True)


def main() -> None:
    p = parser("python -m bench.ab_tiles", __doc__)
    p.add_argument("--d", type=int, required=True)
    p.add_argument("--seqlens", default="4096,16384")
    p.add_argument("--plans", nargs="+", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--no-bwd", action="store_true", help="forward only")
    a = p.parse_args()
    require_cuda("python -m bench.ab_tiles")
    plans = [(name, parse_plan(name)) for name in a.plans]
    for n in map(int, a.seqlens.split(",")):
        measure(n, a.d, plans, a)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
