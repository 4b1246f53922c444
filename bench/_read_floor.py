"""The ``read-floor`` provider of ``bench.decode``: a kernel that only reads the K/V cache, once.

Any decode-attention kernel must read every K/V byte of the cache once; this kernel does that and nothing
else (each program sums a contiguous chunk of k and v in float32 and writes one number), so its time in the
same harness (a CUDA graph of back-to-back calls cycling through L2-spanning copies) is a floor for the
attention providers, and its bandwidth is the fraction of the copy ceiling that a read of that size can
reach at all. At small caches the fixed cost of a launch and of the first HBM round trips is a large part of
a call; this measures that cost where the attention providers are measured.

Configuration: ``PROGRAMS`` programs of ``NUM_WARPS`` warps, ``BLOCK`` elements of k and of v per loop step
(16-byte loads). In a scratch sweep on the H200 (session 13, bench/NOTES.md "Decode floor": programs 128 ..
2048, BLOCK 1024 .. 4096, 4 or 8 warps, with and without PDL) 2048 programs of 8 warps were the fastest at
every decode shape measured (d 64 / 128, batch 1 / 16, context 8k / 32k), with BLOCK 2048 or 4096 (1024 at
d = 128, batch 1). On Hopper the launch uses programmatic dependent launch, as ``flash_decode``'s does.
"""

from __future__ import annotations

import torch

PROGRAMS, BLOCK, NUM_WARPS = 2048, 2048, 8
_KERNEL: dict = {}


def _kernel():
    """The Triton kernel, built at first use (so TRITON_INTERPRET set by the dry run is honoured)."""
    if "read" not in _KERNEL:
        import triton
        import triton.language as tl
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

        @triton.jit
        def read_kernel(K, V, OUT, n, chunk, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
            if USE_PDL:  # wait for the previous kernel, then let the next one launch (as flash_decode)
                gdc_wait()
                gdc_launch_dependents()
            pid = tl.program_id(0)
            lo = pid.to(tl.int64) * chunk
            # tl.full / tl.reduce, not tl.zeros / tl.sum: those are compiled-mode functions when triton
            # was imported before TRITON_INTERPRET=1 was set (kernels/_triton_common.py says why)
            acc = tl.full([BLOCK], 0.0, tl.float32)
            for start in range(0, chunk, BLOCK):
                offs = lo + start + tl.arange(0, BLOCK)
                ok = offs < n
                acc += tl.load(K + offs, mask=ok, other=0.0).to(tl.float32)
                acc += tl.load(V + offs, mask=ok, other=0.0).to(tl.float32)
            tl.store(OUT + pid, tl.reduce(acc, 0, tl.standard._sum_combine))

        _KERNEL["read"] = read_kernel
    return _KERNEL["read"]


def read_floor(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Read every element of k and v once; returns the per-program sums (PROGRAMS,) float32 (not attention).

    q is unused (its bytes are negligible). k, v: contiguous, one shape and dtype, on one device.
    Raises ValueError for non-tensors, non-contiguous k / v or k / v of other shapes, dtypes or devices.
    """
    del q
    if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        raise ValueError(f"read-floor needs tensors k and v, got {type(k).__name__} and {type(v).__name__}")
    for problem, bad in (
        (
            "contiguous k and v (a copy to make them so would be timed too)",
            not (k.is_contiguous() and v.is_contiguous()),
        ),
        (f"k and v of one shape, got {tuple(k.shape)} and {tuple(v.shape)}", k.shape != v.shape),
        (f"k and v of one dtype, got {k.dtype} and {v.dtype}", k.dtype != v.dtype),
        (f"k and v on one device, got {k.device} and {v.device}", k.device != v.device),
    ):
        if bad:
            raise ValueError(f"read-floor needs {problem}")
    from kernels.plan import _cdiv
    from kernels.plan import use_pdl as _use_pdl

    n = k.numel()
    programs = max(1, min(PROGRAMS, _cdiv(n, BLOCK)))
    chunk = _cdiv(_cdiv(n, programs), BLOCK) * BLOCK  # elements per program, whole loop steps
    out = torch.empty(programs, dtype=torch.float32, device=k.device)
    pdl = _use_pdl(k.device, traced=False)  # the rule flash_decode's eager launches follow
    opts = dict(num_warps=NUM_WARPS, launch_pdl=True) if pdl else dict(num_warps=NUM_WARPS)
    _kernel()[(programs,)](k, v, out, n, chunk, BLOCK=BLOCK, USE_PDL=pdl, **opts)
    return out
