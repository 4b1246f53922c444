"""Host (CPU) cost of one causal forward / forward+backward call, per provider (run on the GPU).

The GPU is first blocked by a spin kernel (`torch.cuda._sleep`), so every call below only enqueues work
and never waits for the GPU: the wall time per call is the host cost (Python, autograd, launches,
TMA descriptors). Compared with the GPU time of the same call (do_bench median), it says whether short
sequences are host-bound, which makes their TFLOP/s in bench/attention.py noisy.

    PYTHONPATH=. python -m bench.host_overhead --seqlens 512,1024 --headdims 64,128
"""

from __future__ import annotations

import statistics
import time

import torch
import triton

from bench._gpu import parser, require_cuda
from bench.ab_tiles import parse_plan
from bench.attention import build_provider
from kernels.tiles import override_tile_config


def host_ms(fn, calls: int) -> float:
    """Median over 5 batches of the host time per call while the GPU is blocked."""
    out = []
    for _ in range(5):
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU spin: the queue never drains below
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e3)
        torch.cuda.synchronize()
    return statistics.median(out)


def main() -> None:
    p = parser("python -m bench.host_overhead", __doc__)
    p.add_argument("--seqlens", default="512,1024")
    p.add_argument("--headdims", default="64,128")
    p.add_argument("--providers", default="flash,flex,sdpa-cudnn")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--plans", nargs="+", default=["default"],
                   help="flash tile plans as in bench.ab_tiles (default, dkdv=CFG, dq=CFG, ...)")
    a = p.parse_args()
    require_cuda("python -m bench.host_overhead")
    for plan in a.plans:
        if "provider" in parse_plan(plan):
            raise SystemExit(f"--plans {plan!r}: name other providers in --providers, not as a plan")
    dev = torch.device("cuda")
    for d in map(int, a.headdims.split(",")):
        for n in map(int, a.seqlens.split(",")):
            b, h = max(1, 16384 // n), 2048 // d
            q, k, v, do = (torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16) for _ in range(4))
            leaves = [t.requires_grad_() for t in (q, k, v)]
            print(f"d={d} N={n} (B={b}, H={h})", flush=True)
            runs = [(name, plan) for name in a.providers.split(",")
                    for plan in (a.plans if name == "flash" else ["default"])]
            for name, plan in runs:
                with override_tile_config(**parse_plan(plan)):
                    label = name if plan == "default" else f"{name}[{plan}]"
                    measure(label, build_provider(name, n=n, device=dev), leaves, do, a.calls)


def measure(label: str, attn, leaves, do, calls: int) -> None:
    """Print host and do_bench times of one provider's forward and forward+backward."""

    def fwd():
        return attn(*leaves)

    def fwdbwd():
        for t in leaves:
            t.grad = None
        fwd().backward(do)

    fwdbwd()
    torch.cuda.synchronize()
    gpu_f = triton.testing.do_bench(fwd, warmup=25, rep=100, return_mode="median")
    gpu_fb = triton.testing.do_bench(fwdbwd, warmup=25, rep=100, return_mode="median")
    h_f, h_fb = host_ms(fwd, calls), host_ms(fwdbwd, calls)
    print(f"{label:40s} host fwd {h_f * 1e3:6.0f} us  fwd+bwd {h_fb * 1e3:6.0f} us"
          f" | do_bench fwd {gpu_f * 1e3:6.0f} us  fwd+bwd {gpu_fb * 1e3:6.0f} us", flush=True)


if __name__ == "__main__":
    main()
