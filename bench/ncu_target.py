"""Causal bf16 forward+backward passes of `flash_attention` as a target for Nsight Compute (run on the GPU).

Runs --iters forward+backward passes (the first one compiles), optionally under a tile plan of
`bench.ab_tiles` (--plan, e.g. dkdv=64x128x8x2); with --iters 2, `--launch-skip 1 --launch-count 1`
on one kernel profiles its warm launch:

    ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --kernel-name regex:_bwd_dkdv --launch-skip 1 --launch-count 1 \\
        python3 -m bench.ncu_target --n 32768 --d 128

Shapes as in bench/attention.py: B = --tokens // N, H = --hidden // d.
"""

from __future__ import annotations

import torch

from bench._gpu import parser, require_cuda
from bench.ab_tiles import parse_plan
from kernels import flash_attention
from kernels.tiles import override_tile_config


def main() -> None:
    p = parser("python -m bench.ncu_target", __doc__)
    p.add_argument("--n", type=int, default=32768)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--iters", type=int, default=2, help="forward+backward passes, the first one compiles")
    p.add_argument("--plan", default="default", help="tile plan as in bench.ab_tiles (not provider:NAME)")
    a = p.parse_args()
    require_cuda("python -m bench.ncu_target")
    plan = parse_plan(a.plan)
    if "provider" in plan:
        raise SystemExit("--plan: tile plans only (this script profiles flash_attention)")
    b, h = max(1, a.tokens // a.n), a.hidden // a.d
    q, k, v, do = (torch.randn(b, h, a.n, a.d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    with override_tile_config(**plan):
        for _ in range(a.iters):
            flash_attention(*leaves, causal=True).backward(do)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
