"""Flash-decoding: attention of 1..16 new query rows per sequence to a KV cache, split over the keys.

``flash_decode(q, k_cache, v_cache, cache_seqlens=None, *, softmax_scale=None, num_splits=None,
return_lse=False)``; the algorithm and kernels are in ``kernels/_decode_kernels.py``.

Inference only (no autograd). In plain eager mode the kernels launch directly; under torch.compile,
fake tensors and the like through the op ``flashgpt::flash_decode`` (a ``triton_op``, traced into the
compiled graph on CUDA) or ``flashgpt::flash_decode_cpu`` (opaque, with a fake, for the interpreter).
Verified on the CPU under TRITON_INTERPRET=1 against float64 PyTorch and on the GPU in
tests/test_flash_decode_gpu.py (bf16/fp16 FlashAttention accuracy rule, the triton_op path: passed on the
H200). GPU tiles (``_gpu_block_n``) and split count (``_choose_splits``) come from H200 sweeps
(bench/NOTES.md, "Decode tiles", "Decode splits" and "Decode splits, session 13"); the speed figures are in
bench/results/decode_h200_s13.md (``python -m bench.decode``).
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


def _choose_splits(n_max: int, block_n: int, programs: int, device: torch.device, d: int) -> int:
    """Key splits per (sequence, KV head), at most one per 4 key tiles and 128 in all.

    GPU, with ``programs`` = B x Hkv (sequence, KV head) pairs and k = 2 programs per SM at d <= 64, 1 above:
    below the SMs, floor(k x SMs / pairs) splits (batch 1, Hkv 8 on the H200's 132 SMs: 33 at d = 64, 16 at
    d = 128; batch 16: 2 and 1); from the SMs up, 4 per pair at d <= 64 and 1 above; never a split of fewer
    than 4 key tiles. From the H200 sweep of session 13 (bench/NOTES.md, "Decode splits, session 13": bf16,
    Hkv 8, group 4, one query row, K/V cycling through L2-spanning copies, PDL launches), best split counts:
    d = 64 batch 1: 16 at 8k (4 tiles a split), 33 at 16k and 32k (20.93 us against 21.9 at 16 splits);
    d = 64 batch 16: 2; d = 128 batch 1: 16; d = 128 batch 16: 1 (121.9 us at 8k against 124.2 at 2);
    batch 64: 4 at d = 64, 1 at d = 128 (470.2 against 486.8 us at 4). A d = 128 tile moves twice a d = 64
    one's bytes, so one program per SM already keeps enough in flight. Under the interpreter: 4 programs.
    """
    n_blocks = _cdiv(n_max, block_n)
    programs = max(1, programs)
    if device.type != "cuda":
        return max(1, min(n_blocks, 128, _cdiv(4, programs)))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    per_sm = 2 if d <= 64 else 1
    if programs < sms:
        want = max(1, per_sm * sms // programs)
    else:
        want = 4 if d <= 64 else 1
    return max(1, min(max(1, n_blocks // 4), 128, want))


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
    if Hkv < 1 or Hq < 1:
        raise ValueError(f"flash_decode needs at least one query and one KV head, got Hq={Hq}, Hkv={Hkv}")
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
            and B > 0  # an empty batch has no lengths to check (and min() of nothing fails)
        ):
            lo, hi = int(cache_seqlens.min()), int(cache_seqlens.max())
            if lo < Nq or hi > n_max:
                raise ValueError(
                    f"cache_seqlens must be in [Nq={Nq}, Nmax={n_max}] (each length counts "
                    f"the new rows' own keys), got min {lo}, max {hi}"
                )
    if softmax_scale is not None and (
        isinstance(softmax_scale, bool)
        or not (isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale))
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


def _split_layout(n_max: int, num_splits: int, block_n: int) -> tuple[int, int]:
    """(keys per split, splits) of ``num_splits`` requested splits: a split is a whole number of key
    tiles, and the count is recomputed from that length so that no split is empty for Nmax."""
    split_len = _cdiv(_cdiv(n_max, num_splits), block_n) * block_n
    return split_len, _cdiv(n_max, split_len)


def _check_overrides(tile_n, num_warps, num_stages) -> None:
    """``_launch_decode``'s private overrides: a bad one is a clear ValueError here, not a Triton error
    deep in the launch (or, for a tile of 0, a ZeroDivisionError in ``_split_layout``)."""

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


def _use_pdl(device: torch.device, traced: bool) -> bool:
    """Whether the split and combine kernels launch with programmatic dependent launch (PDL): on CUDA devices
    of compute capability >= 9.0 (Hopper), in eager calls (a CUDA-graph capture of them included), not under
    the interpreter. Each kernel then waits for its predecessor's completion with ``griddepcontrol.wait``
    before touching memory, so the result is the same; what changes is that its launch overlaps the
    predecessor's execution. Kept out of traced (torch.compile) launches: Inductor's generated launch code
    is not known to pass Triton's ``launch_pdl`` option."""
    if traced or device.type != "cuda" or interpret_enabled():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def _launch_decode(
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    scale: float,
    num_splits: int,
    traced: bool = False,
    *,
    _tile_n: int | None = None,
    _num_warps: int | None = None,
    _num_stages: int | None = None,
    _pdl: bool | None = None,
):
    """Allocate the partial buffers and launch the split and combine kernels; (o, lse). The inputs are not
    validated (``flash_decode`` does that); the private overrides below are.
    cache_seqlens None: every sequence fills the cache (the kernel's HAS_SEQLENS=False; no lengths tensor
    is built, so no fill kernel runs per call).

    ``_tile_n``, ``_num_warps``, ``_num_stages``: private overrides of the split kernel's key tile (a power
    of two >= 16) and Triton launch options, for the tile sweep ``python -m bench.decode_tiles``; None
    keeps the automatic tile (``_block_n``) and Triton's defaults (no option passed). ``_pdl``: launch both
    kernels with programmatic dependent launch (``_use_pdl``); None: the default rule."""
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
    pdl = _use_pdl(q.device, traced) if _pdl is None else bool(_pdl)
    if pdl:
        launch_opts["launch_pdl"] = True
    split_len, splits = _split_layout(n_max, num_splits, block_n)
    o_part = torch.empty((B, Hq, Nq, splits, d), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((B, Hq, Nq, splits), dtype=torch.float32, device=q.device)
    o = torch.empty((B, Hq, Nq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, Nq), dtype=torch.float32, device=q.device)
    with _device_ctx(q):
        _launcher(kernels["split"], (splits, Hkv, B), traced)(
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
            group,
            Nq,
            d,
            split_len,
            splits,
            n_max,
            scale * LOG2E,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
            DOT_PRECISION=_dot_precision(q.dtype),
            HAS_SEQLENS=cache_seqlens is not None,  # None: L_b = Nmax, the pointer never read
            USE_PDL=pdl,
            **launch_opts,
        )
        _launcher(kernels["combine"], (B * Hq * Nq,), traced)(
            o_part,
            lse_part,
            o,
            lse,
            *o.stride(),
            Hq,
            Nq,
            d,
            splits,
            BLOCK_S=_pow2(splits, low=2),
            BLOCK_D=block_d,
            USE_PDL=pdl,
            **({"launch_pdl": True} if pdl else {}),
        )
    return o, lse


def _decode_op_body(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | None,
    softmax_scale: float,
    num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op: o (B, Hq, Nq, d) in q's dtype and lse (B, Hq, Nq) float32; validated by flash_decode.
    cache_seqlens None: all sequences fill the cache (as flash_attn's ops take q_doc=None)."""
    return _launch_decode(q, k_cache, v_cache, cache_seqlens, softmax_scale, num_splits, traced=True)


def _decode_fake(q, k_cache, v_cache, cache_seqlens, softmax_scale, num_splits):
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
        num_splits: key splits per (sequence, KV head); None chooses from the grid size.
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
    splits = num_splits or _choose_splits(n_max, _block_n(d, q.dtype), B * Hkv, q.device, d)
    q, k_cache, v_cache = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k_cache, v_cache))
    if cache_seqlens is not None:  # the kernel reads SEQLENS[b] at offset b: a strided view needs a copy
        cache_seqlens = cache_seqlens.contiguous()
    tensors = (q, k_cache, v_cache) if cache_seqlens is None else (q, k_cache, v_cache, cache_seqlens)
    if _plain_eager_call(*tensors):
        o, lse = _launch_decode(q, k_cache, v_cache, cache_seqlens, scale, splits)
    else:  # an op: torch.compile / fake tensors see one node (traced into the graph on CUDA)
        op = flash_decode_op if q.is_cuda else flash_decode_cpu_op
        o, lse = op(q, k_cache, v_cache, cache_seqlens, scale, splits)
    return (o, lse) if return_lse else o
