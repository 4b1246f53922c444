"""One causal bf16 forward+backward of `flash_attention` as a target for Nsight Compute (run on the GPU).

Warms up (compiles) first, then runs --iters forward+backward passes, so that
`ncu --kernel-name regex:_bwd_dkdv --launch-skip 1 --launch-count 1` profiles a warm launch:

    ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --kernel-name regex:_bwd_dkdv --launch-skip 1 --launch-count 1 \\
        python3 -m bench.ncu_target --n 32768 --d 128

Shapes as in bench/attention.py: B = --tokens // N, H = --hidden // d.
"""

from __future__ import annotations

import argparse

import torch

from kernels import flash_attention


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=32768)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--iters", type=int, default=2)
    a = p.parse_args()
    b, h = max(1, a.tokens // a.n), a.hidden // a.d
    q, k, v, do = (torch.randn(b, h, a.n, a.d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    for _ in range(a.iters):
        flash_attention(*leaves, causal=True).backward(do)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
