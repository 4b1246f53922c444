"""Flash-decoding: attention of 1..16 new query rows per sequence to a KV cache, split over the keys.

The kernels are in `_decode_kernels.py`, the tile and split rule in `plan.py` (H200 sweeps, bench/NOTES.md).
Inference only (no autograd): plain eager calls launch directly; torch.compile and fake tensors go through
the op `flashgpt::flash_decode` (a triton_op, traced on CUDA) or `flashgpt::flash_decode_cpu` (interpreter).
"""

from __future__ import annotations

import math

import torch

from . import plan as kplan
from ._launch import dot_precision, kernel_module, kernel_qkv, launcher, softcap_arg
from ._runtime import check_flash_available, device_ctx, interpret_enabled, strides
from .flash_attn import MAX_HEAD_DIM, MIN_HEAD_DIM, SUPPORTED_DTYPES, _plain_eager_call, check_softcap
from .plan import MAX_DECODE_ROWS


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


def _launch_decode(
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    scale: float,
    num_splits: int,
    traced: bool = False,
    softcap: float = 0.0,
    *,
    _tile_n: int | None = None,
    _num_warps: int | None = None,
    _num_stages: int | None = None,
    _pdl: bool | None = None,
):
    """Launch the split and combine kernels on inputs `flash_decode` validated; (o, lse). cache_seqlens None:
    every sequence fills the cache (no lengths tensor, no fill kernel per call). The private overrides
    (the split kernel's key tile and launch options, PDL; None: `plan`'s choice) serve the decode tile search
    (`python -m bench.tune --decode`, whose command line checks them)."""
    q, k_cache, v_cache = kernel_qkv(q, k_cache, v_cache)
    kernels = kernel_module(interpret_enabled(), "_decode_kernels")
    p = kplan.plan_decode(q, k_cache, num_splits, traced, _tile_n, _num_warps, _num_stages, _pdl)
    (tile,) = p.tiles
    B, Hq, Nq, d = (int(x) for x in q.shape)
    Hkv, n_max = int(k_cache.shape[1]), int(k_cache.shape[2])
    splits, pdl = p.splits, p.pdl
    launch_opts = {"num_warps": tile.num_warps} if tile.num_warps else {}
    if tile.num_stages:
        launch_opts["num_stages"] = tile.num_stages
    if pdl:
        launch_opts["launch_pdl"] = True
    o_part = torch.empty((B, Hq, Nq, splits, d), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((B, Hq, Nq, splits), dtype=torch.float32, device=q.device)
    o = torch.empty((B, Hq, Nq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, Nq), dtype=torch.float32, device=q.device)
    with device_ctx(q):
        launcher(kernels._decode_split_kernel, (splits, Hkv, B), traced)(
            q, k_cache, v_cache, cache_seqlens, o_part, lse_part, *strides(q, k_cache),
            Hq, Hq // Hkv, Nq, d, p.split_len, splits, n_max, scale,
            BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_D=p.block_d, USE_PDL=pdl,
            DOT_PRECISION=dot_precision(q.dtype), softcap=softcap_arg(softcap), **launch_opts,
        )  # fmt: skip
        launcher(kernels._decode_combine_kernel, (B * Hq * Nq,), traced)(
            o_part, lse_part, o, lse, *strides(o), Hq, Nq, d, splits, BLOCK_S=kplan._pow2(splits, low=2),
            BLOCK_D=p.block_d, USE_PDL=pdl, **({"launch_pdl": True} if pdl else {}),
        )  # fmt: skip
    return o, lse


def _decode_op_body(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | None,
    softmax_scale: float,
    num_splits: int,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op (validated by flash_decode): o (B, Hq, Nq, d) in q's dtype, lse (B, Hq, Nq) float32."""
    return _launch_decode(q, k_cache, v_cache, cache_seqlens, softmax_scale, num_splits, True, softcap)


def _decode_fake(q, k_cache, v_cache, cache_seqlens, softmax_scale, num_splits, softcap=0.0):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


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
    softcap=None,
):
    """Attention of the newest query rows of each sequence to its KV cache (split-K flash-decoding).

    Args:
        q: (B, Hq, Nq, d), 1 <= Nq <= 16, the queries of positions L_b - Nq .. L_b - 1 of sequence b; row i
            sees keys j <= L_b - Nq + i.
        k_cache, v_cache: (B, Hkv, Nmax, d), Hq a multiple of Hkv; positions 0 .. L_b - 1 in slots [0, L_b)
            (the new rows' keys included), later slots never read. Any strides with a unit last one.
            One dtype among float16, bfloat16 (float32 under the interpreter), float32; one device.
        cache_seqlens: (B,) int32/int64 L_b on q's device, Nq <= L_b <= Nmax; None: Nmax for all.
        softmax_scale: None = 1/sqrt(d). num_splits: key splits per (sequence, KV head); None: automatic.
        return_lse: also return the natural-log LSE (B, Hq, Nq) float32.
        check_lengths: range-check cache_seqlens on the host in eager mode (one device sync per call). False
            skips it (the model's KV cache: 12 layers would sync 12 times per token); the kernel clamps each
            length to [0, Nmax] either way, so an out-of-range length gives the clamped length's result.
        softcap: None, or c > 0: scores c * tanh(s / c) before the mask and softmax.
    Returns o (B, Hq, Nq, d) in q.dtype, and lse with return_lse.
    Raises ValueError for bad arguments (lengths only where checked: eager, not under CUDA-graph capture,
    torch.compile or fake tensors); FlashAttentionUnavailableError without CUDA or TRITON_INTERPRET=1.
    """
    _validate(q, k_cache, v_cache, cache_seqlens, softmax_scale, num_splits, check_lengths)
    cap = check_softcap(softcap)
    check_flash_available(q.device)
    if q.dtype == torch.bfloat16 and interpret_enabled():  # numpy has no bfloat16
        kw = dict(softmax_scale=softmax_scale, num_splits=num_splits, return_lse=return_lse, softcap=softcap)
        q, k_cache, v_cache = q.float(), k_cache.float(), v_cache.float()
        out = flash_decode(q, k_cache, v_cache, cache_seqlens, check_lengths=False, **kw)  # checked above
        return (out[0].to(torch.bfloat16), out[1]) if return_lse else out.to(torch.bfloat16)
    scale = 1.0 / math.sqrt(int(q.shape[3])) if softmax_scale is None else float(softmax_scale)
    splits = num_splits or kplan.decode_num_splits(q, k_cache)
    if cache_seqlens is not None:  # the kernel reads SEQLENS[b] at offset b: a strided view needs a copy
        cache_seqlens = cache_seqlens.contiguous()
    tensors = (q, k_cache, v_cache) if cache_seqlens is None else (q, k_cache, v_cache, cache_seqlens)
    if _plain_eager_call(*tensors):
        o, lse = _launch_decode(q, k_cache, v_cache, cache_seqlens, scale, splits, False, cap)
    else:  # an op: torch.compile / fake tensors see one node (traced into the graph on CUDA)
        op = flash_decode_op if q.is_cuda else flash_decode_cpu_op
        o, lse = op(q, k_cache, v_cache, cache_seqlens, scale, splits, cap)
    return (o, lse) if return_lse else o
