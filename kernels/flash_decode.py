"""Flash-decoding: attention of 1..16 new query rows per sequence to a KV cache, split over the keys.

``flash_decode(q, k_cache, v_cache, cache_seqlens=None, *, softmax_scale=None, num_splits=None,
return_lse=False)``; the algorithm and kernels are in ``kernels/_decode_kernels.py``.

Inference only (no autograd). In plain eager mode the kernels launch directly; under torch.compile,
fake tensors and the like through the op ``flashgpt::flash_decode`` (a ``triton_op``, traced into the
compiled graph on CUDA) or ``flashgpt::flash_decode_cpu`` (opaque, with a fake, for the interpreter).
Verified on the CPU under TRITON_INTERPRET=1 against float64 PyTorch and on the GPU in
tests/test_flash_decode_gpu.py (bf16/fp16 FlashAttention accuracy rule, the triton_op path: passed on the
H200). GPU tiles (``_gpu_block_n``) and the program count (``_choose_programs``) come from H200 sweeps
(bench/NOTES.md, "Decode tiles" and "Decode splits"); the speed figures are in
bench/results/decode_h200.md (``python -m bench.decode``; to be re-measured with the split rule of
"Decode splits", which no full benchmark has run yet).
"""

from __future__ import annotations

import math

import torch

from .flash_attn import (
    LOG2E,
    MAX_HEAD_DIM,
    MIN_HEAD_DIM,
    SUPPORTED_DTYPES,
    _cdiv,
    _device_ctx,
    _dot_precision,
    _launcher,
    _plain_eager_call,
    check_flash_available,
    interpret_enabled,
)

MAX_DECODE_ROWS = 16  # query rows per sequence: all GROUP * Nq rows of a KV head share one tile


def _pow2(n: int, low: int = 16) -> int:
    return max(low, 1 << (max(1, n) - 1).bit_length())


def _choose_programs(n_tiles: int, pairs: int, d: int, dtype: torch.dtype, device: torch.device) -> int:
    """Programs of the stream-K split kernel: one per SM (one wave; every program gets the same number of
    key tiles whatever B x Hkv is), at most one per tile. Under the interpreter: 4 programs in all (small
    CPU tests whose runs still cross pair boundaries).

    Why one per SM: in the H200 sweeps of the split design (bench/NOTES.md, "Decode splits") about one
    program per SM was the fastest count at batch 1 (16 splits x 8 pairs = 128 programs) and batch 16
    (1 split x 128 pairs: 125.7 us against 127.2 at 2 and 130.7 at 4, d = 128, 8k), and a 4-warp program
    per SM read K/V at 98% of the copy ceiling there; what that design could not do is fill the 132nd SM
    (128 programs) or balance 256 programs over 132 SMs. Two programs per SM fit by registers (243-255
    per thread offline, sm_90); ``python -m bench.decode_tiles --programs 132,264`` compares them.
    d and dtype: kept for a per-shape rule once measured.
    """
    total = max(1, n_tiles * pairs)
    if device.type != "cuda":
        return min(total, 4)
    return min(total, torch.cuda.get_device_properties(device).multi_processor_count)


def _validate(q, k, v, cache_seqlens, softmax_scale, num_splits, check_lengths: bool = True) -> None:
    if not isinstance(check_lengths, bool):  # check_lengths="no" would be truthy: the check would run
        raise ValueError(f"check_lengths must be True or False, got {check_lengths!r}")
    for name, t in (("q", q), ("k_cache", k), ("v_cache", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(
                f"flash_decode expects 4-D {name} (B, H, N, d), got "
                f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
            )
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"flash_decode needs q, k_cache, v_cache of one dtype among {SUPPORTED_DTYPES}, got "
            f"{q.dtype}, {k.dtype}, {v.dtype}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k_cache, v_cache must be on one device, got {q.device}, {k.device}, {v.device}")
    B, Hq, Nq, d = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != d:
        raise ValueError(
            f"k_cache and v_cache must both be (B={B}, Hkv, Nmax, d={d}); got {tuple(k.shape)} "
            f"and {tuple(v.shape)}"
        )
    Hkv, n_max = k.shape[1], k.shape[2]
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv}) (GQA/MQA)")
    if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head dim {d} outside {MIN_HEAD_DIM}..{MAX_HEAD_DIM}")
    if not 1 <= Nq <= min(MAX_DECODE_ROWS, n_max):
        raise ValueError(
            f"flash_decode takes 1..{MAX_DECODE_ROWS} query rows (and at most the cache size "
            f"{n_max}), got {Nq}; use flash_attention for a prefill"
        )
    if cache_seqlens is not None:
        if (
            not isinstance(cache_seqlens, torch.Tensor)
            or cache_seqlens.shape != (B,)
            or cache_seqlens.dtype not in (torch.int32, torch.int64)
            or cache_seqlens.device != q.device
        ):
            raise ValueError(f"cache_seqlens must be an int32/int64 tensor of shape ({B},) on {q.device}")
        # the range check reads the lengths on the host: eager mode only, not while a CUDA graph is
        # captured, torch.compile traces or fake tensors flow (a data-dependent read breaks all three)
        # (is_compiling first: dynamo cannot trace is_current_stream_capturing, a graph break)
        if (
            check_lengths
            and not torch.compiler.is_compiling()
            and _plain_eager_call(q, cache_seqlens)
            and not (q.is_cuda and torch.cuda.is_current_stream_capturing())
        ):
            lo, hi = int(cache_seqlens.min()), int(cache_seqlens.max())
            if lo < Nq or hi > n_max:
                raise ValueError(
                    f"cache_seqlens must be in [Nq={Nq}, Nmax={n_max}] (each length counts "
                    f"the new rows' own keys), got min {lo}, max {hi}"
                )
    if softmax_scale is not None and not (
        isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale)
    ):
        raise ValueError(f"softmax_scale must be a finite float or None, got {softmax_scale!r}")
    if num_splits is not None and (
        isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1
    ):
        raise ValueError(f"num_splits must be an int >= 1 or None (automatic), got {num_splits!r}")


def _gpu_block_n(d: int, dtype: torch.dtype) -> int:
    """Keys per tile of the split kernel on the GPU.

    128 for d <= 128 in bf16/fp16: the H200 tile sweep (bench/NOTES.md, "Decode tiles"; bf16, Hkv 8,
    group 8, one query row; do_bench_cudagraph) found BLOCK_N = 128 best or within noise of the best in
    every cell: batch 1, d 64: 9.5 -> 7.8 us at L 8k, 24.5 -> 21.8 us at 32k, 71 -> 66 us at 128k;
    d 128, L 8k: 13.4 -> 11.1 us
    (against the 64-key default before; part of the batch-1 gain was the per-call lengths fill that
    cache_seqlens=None no longer launches); within +-2% at batch 16, already at the copy ceiling. Shared
    memory is no limit there: 128 keys x d 128 in bf16 compiled and ran with num_stages 2 and 3 (about
    40 KiB at group 8, 64 KiB at 128 query rows per tile, kernels.compile_report). float32 keeps 64 (not
    swept; 128 x 128 float32 tiles need about 272 KiB at Triton's default 3 stages, over the 227 KiB an
    H100/H200 block may use), d > 128 keeps 32 (not swept).
    """
    if d > 128:
        return 32
    return 64 if dtype == torch.float32 else 128


def _block_n(d: int, dtype: torch.dtype) -> int:
    return 16 if interpret_enabled() else _gpu_block_n(d, dtype)  # interpreter: small, quick CPU tests


def _stream_layout(n_max: int, pairs: int, programs: int, block_n: int) -> tuple[int, int, int, int]:
    """(tiles per pair, tiles in all, programs launched, partial slots per pair) of the stream-K split:
    at most one program per tile; a pair's tiles meet at most ceil(programs / pairs) + 1 programs."""
    n_tiles = _cdiv(n_max, block_n)
    total = n_tiles * pairs
    programs = max(1, min(programs, total))
    return n_tiles, total, programs, _cdiv(programs, pairs) + 1


def _check_overrides(tile_n, num_warps, num_stages) -> None:
    """``_launch_decode``'s private overrides: a bad one is a clear ValueError here, not a Triton error
    deep in the launch (or, for a tile of 0, a ZeroDivisionError in ``_stream_layout``)."""

    def bad(value, low: int, pow2: bool) -> bool:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            return True
        return pow2 and value & (value - 1) != 0

    for name, value, low, pow2, rule in (
        ("_tile_n", tile_n, 16, True, "a power of two >= 16"),
        ("_num_warps", num_warps, 1, True, "a power of two >= 1"),
        ("_num_stages", num_stages, 1, False, "an int >= 1"),
    ):
        if value is not None and bad(value, low, pow2):
            raise ValueError(f"{name} must be {rule} or None, got {value!r}")


def _launch_decode(
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    scale: float,
    num_programs: int,
    traced: bool = False,
    *,
    _tile_n: int | None = None,
    _num_warps: int | None = None,
    _num_stages: int | None = None,
):
    """Allocate the partial buffers and launch the split and combine kernels; (o, lse). The inputs are not
    validated (``flash_decode`` does that); the private overrides below are. num_programs: the split
    kernel's programs (stream-K, capped at one per key tile).
    cache_seqlens None: every sequence fills the cache (the kernel's HAS_SEQLENS=False; no lengths tensor
    is built, so no fill kernel runs per call).

    ``_tile_n``, ``_num_warps``, ``_num_stages``: private overrides of the split kernel's key tile (a power
    of two >= 16) and Triton launch options, for the tile sweep ``python -m bench.decode_tiles``; None
    keeps the automatic tile (``_block_n``) and Triton's defaults (no option passed)."""
    from ._decode_kernels import build_decode_kernels
    from ._triton_kernels import mode_problem
    from .flash_attn import FlashAttentionUnavailableError

    _check_overrides(_tile_n, _num_warps, _num_stages)
    interp = interpret_enabled()
    problem = mode_problem(interp)
    if problem is not None:
        raise FlashAttentionUnavailableError(problem)
    kernels = build_decode_kernels(interp)
    B, Hq, Nq, d = (int(x) for x in q.shape)
    Hkv, n_max = int(k_cache.shape[1]), int(k_cache.shape[2])
    group = Hq // Hkv
    block_d, block_m = _pow2(d), _pow2(group * Nq)
    block_n = _block_n(d, q.dtype) if _tile_n is None else _tile_n
    launch_opts = {
        name: value
        for name, value in (("num_warps", _num_warps), ("num_stages", _num_stages))
        if value is not None
    }
    n_tiles, total, programs, parts = _stream_layout(n_max, B * Hkv, num_programs, block_n)
    o_part = torch.empty((B, Hq, Nq, parts, d), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((B, Hq, Nq, parts), dtype=torch.float32, device=q.device)
    o = torch.empty((B, Hq, Nq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, Nq), dtype=torch.float32, device=q.device)
    with _device_ctx(q):
        _launcher(kernels["split"], (programs,), traced)(
            q,
            k_cache,
            v_cache,
            cache_seqlens,
            o_part,
            lse_part,
            *q.stride(),
            *k_cache.stride(),
            *v_cache.stride(),
            Hq,
            Hkv,
            group,
            Nq,
            d,
            n_tiles,
            total,
            programs,
            parts,
            n_max,
            scale * LOG2E,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
            DOT_PRECISION=_dot_precision(q.dtype),
            HAS_SEQLENS=cache_seqlens is not None,  # None: L_b = Nmax, the pointer never read
            **launch_opts,
        )
        _launcher(kernels["combine"], (B * Hq * Nq,), traced)(
            o_part,
            lse_part,
            o,
            lse,
            *o.stride(),
            Hq,
            Hkv,
            group,
            Nq,
            d,
            n_tiles,
            total,
            programs,
            parts,
            BLOCK_S=_pow2(parts, low=2),
            BLOCK_D=block_d,
        )
    return o, lse


def _decode_op_body(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | None,
    softmax_scale: float,
    num_programs: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op: o (B, Hq, Nq, d) in q's dtype and lse (B, Hq, Nq) float32; validated by flash_decode.
    cache_seqlens None: all sequences fill the cache (as flash_attn's ops take q_doc=None)."""
    return _launch_decode(q, k_cache, v_cache, cache_seqlens, softmax_scale, num_programs, traced=True)


def _decode_fake(q, k_cache, v_cache, cache_seqlens, softmax_scale, num_programs):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


# as flash_attn's ops: traced into the compiled graph on CUDA (triton_op), opaque with a fake on the CPU
flash_decode_op = torch.library.triton_op("flashgpt::flash_decode", _decode_op_body, mutates_args=())
flash_decode_cpu_op = torch.library.custom_op("flashgpt::flash_decode_cpu", _decode_op_body, mutates_args=())
flash_decode_cpu_op.register_fake(_decode_fake)


def flash_decode(
    q,
    k_cache,
    v_cache,
    cache_seqlens=None,
    *,
    softmax_scale=None,
    num_splits=None,
    return_lse=False,
    check_lengths=True,
):
    """Attention of the newest query rows of each sequence to its KV cache (split-K flash-decoding).

    Args:
        q: (B, Hq, Nq, d), 1 <= Nq <= 16, the queries of positions L_b - Nq .. L_b - 1 of sequence b.
        k_cache, v_cache: (B, Hkv, Nmax, d), Hq a multiple of Hkv (GQA/MQA: no copies); keys/values of
            positions 0 .. L_b - 1 in slots [0, L_b) (the new rows' own keys included); slots past L_b
            are never read. Any strides with a unit last stride (e.g. a view of a bigger cache).
        cache_seqlens: (B,) int32/int64 L_b on q's device, Nq <= L_b <= Nmax; None = Nmax for all.
        softmax_scale: None = 1/sqrt(d).
        num_splits: split-kernel programs per (sequence, KV head), on average: the keys of all pairs are
            cut into B x Hkv x num_splits equal runs of whole tiles (stream-K: a run may cross pairs);
            None: one wave that fills the GPU (``_choose_programs``).
        return_lse: also return the natural-log LSE (B, Hq, Nq) float32.
        check_lengths: in eager mode, read cache_seqlens on the host to range-check them (one device
            synchronisation per call). False skips the read, for a caller that keeps the lengths in range
            itself (the model's KV cache: 12 layers would otherwise synchronise 12 times per token); the
            kernel clamps each length to [0, Nmax] either way, so no slot outside the cache is read, but an
            out-of-range length then gives that clamped length's result instead of an error.

    q, k_cache, v_cache share one dtype among float16, bfloat16, float32 (bfloat16 runs in float32 under
    the interpreter) and one device. Row i of sequence b attends to keys j <= L_b - Nq + i.

    Returns:
        o (B, Hq, Nq, d) in q.dtype, and lse when ``return_lse``.

    Raises:
        ValueError: bad shapes, dtypes, devices, lengths out of range (checked in eager mode only, with
            check_lengths, not under CUDA-graph capture, torch.compile or fake tensors), Nq outside
            1..16, head dim outside 8..256, bad softmax_scale / num_splits, check_lengths not a bool.
        FlashAttentionUnavailableError (a RuntimeError): no CUDA and no TRITON_INTERPRET=1, or no Triton.
    """
    _validate(q, k_cache, v_cache, cache_seqlens, softmax_scale, num_splits, check_lengths)
    check_flash_available(q.device)
    if q.dtype == torch.bfloat16 and interpret_enabled():  # numpy has no bfloat16
        out = flash_decode(
            q.float(),
            k_cache.float(),
            v_cache.float(),
            cache_seqlens,
            softmax_scale=softmax_scale,
            num_splits=num_splits,
            return_lse=return_lse,
            check_lengths=False,  # checked above
        )
        return (out[0].to(torch.bfloat16), out[1]) if return_lse else out.to(torch.bfloat16)
    B, Hq, Nq, d = (int(x) for x in q.shape)
    Hkv, n_max = int(k_cache.shape[1]), int(k_cache.shape[2])
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    n_tiles = _cdiv(n_max, _block_n(d, q.dtype))
    # programs of the stream-K split: a wave that fills the GPU, or num_splits per (sequence, KV head)
    pairs = B * Hkv
    programs = pairs * num_splits if num_splits else _choose_programs(n_tiles, pairs, d, q.dtype, q.device)
    q, k_cache, v_cache = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k_cache, v_cache))
    if cache_seqlens is not None:  # the kernel reads SEQLENS[b] at offset b: a strided view needs a copy
        cache_seqlens = cache_seqlens.contiguous()
    tensors = (q, k_cache, v_cache) if cache_seqlens is None else (q, k_cache, v_cache, cache_seqlens)
    if _plain_eager_call(*tensors):
        o, lse = _launch_decode(q, k_cache, v_cache, cache_seqlens, scale, programs)
    else:  # an op: torch.compile / fake tensors see one node (traced into the graph on CUDA)
        op = flash_decode_op if q.is_cuda else flash_decode_cpu_op
        o, lse = op(q, k_cache, v_cache, cache_seqlens, scale, programs)
    return (o, lse) if return_lse else o
