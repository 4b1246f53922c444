"""Short-sequence check of the backward defaults against alternatives, in one process (run on the GPU).

For N in (512, 1024) and d in (64, 128) (B·N = 16384, H·d = 2048, causal bf16) it times forward+backward
minus forward through `flash_attention`'s autograd with `triton.testing.do_bench` (like bench/attention.py)
for the default tiles, TMA forced off, the dQ tile without its register cap (when it has one) and the
previous dQ tile, plus the wall time per call when 50 calls are queued back to back. Used for
bench/NOTES.md v4 (bench/results/diag_short_h200.log).

    python -m bench.diag_short
"""

import time
from dataclasses import replace

import torch
import triton

from bench._gpu import parser, require_cuda
from kernels import flash_attention
from kernels.tiles import TileConfig, get_tile_config, override_tile_config

DEV = torch.device("cuda")


def inputs(n: int, d: int):
    b, h = 16384 // n, 2048 // d
    g = torch.Generator(device=DEV).manual_seed(n + d)
    return [torch.randn(b, h, n, d, device=DEV, dtype=torch.bfloat16, generator=g) for _ in range(4)]


def measure(n: int, d: int, **overrides) -> str:
    q, k, v, do = inputs(n, d)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def fwd():
        return flash_attention(*leaves, causal=True)

    def fwdbwd():
        fwd().backward(do)

    with override_tile_config(**overrides):
        fwdbwd()
        torch.cuda.synchronize()
        t_fb = triton.testing.do_bench(fwdbwd, warmup=25, rep=100, grad_to_none=leaves, return_mode="median")
        t_f = triton.testing.do_bench(fwd, warmup=25, rep=100, return_mode="median")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            fwdbwd()
        t_queue = (time.perf_counter() - t0) / 50 * 1e3
        torch.cuda.synchronize()
    flops = 2.5 * 2 * q.shape[0] * q.shape[1] * n * n * d
    return (f"bwd {t_fb - t_f:.3f} ms ({flops / (t_fb - t_f) / 1e9:.0f} TF/s) fwd {t_f:.3f} "
            f"host/fwdbwd {t_queue:.3f} ms")


def main() -> None:
    parser("python -m bench.diag_short", __doc__).parse_args()
    require_cuda("python -m bench.diag_short")
    for n in (512, 1024):
        for d in (64, 128):
            dq = get_tile_config("bwd_dq", d, torch.bfloat16, True, n, n)
            print(n, d, "default", dq, measure(n, d), flush=True)
            print(n, d, "tma off", measure(n, d, tma=False), flush=True)
            if dq.maxnreg:
                print(n, d, "no maxnreg", measure(n, d, bwd_dq=replace(dq, maxnreg=None)), flush=True)
            old = TileConfig(128, 32, 8, 3) if d == 128 else TileConfig(64, 32, 4, 3)
            print(n, d, "old dq 128x32 ptr" if d == 128 else "old dq", measure(n, d, bwd_dq=old), flush=True)


if __name__ == "__main__":
    main()
