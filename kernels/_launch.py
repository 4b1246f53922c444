"""Launchers of the FlashAttention kernels: they execute a `kernels.plan.Plan` and decide nothing themselves.

`launch_fwd` / `launch_bwd` run the Gluon kernels (`_gluon_fwd.py`, `_gluon_bwd.py`) or the Triton ones
(`_triton_kernels.py`) with the plan's tiles and TMA choice; `dropout_mask` writes the kernels' dropout keep
mask (tests). Inputs are validated by `flash_attn`. `traced`: called inside a `triton_op` body, so the
launches go through `torch.library.wrap_triton` (torch.compile records them in the graph).
"""

import importlib

import torch

from . import plan as kplan
from ._runtime import (
    FlashAttentionUnavailableError,
    device_ctx,
    empty_like_layout,
    ensure_scratch_allocator,
    interpret_enabled,
    packed_views,
    unit_last_stride,
)

LOG2E = 1.4426950408889634


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dot_precision(dtype: torch.dtype):
    # float32 must not go through tf32 tensor cores (10-bit mantissa); ignored for 16-bit inputs
    return "ieee" if dtype == torch.float32 else None


def kernel_module(interpret: bool, name: str = "_triton_kernels"):
    """The module of Triton kernels `name` (`_triton_kernels`, `_triton_common`, `_decode_kernels`),
    imported at the first launch: its `@triton.jit` kernels are compiled, or interpreted when
    TRITON_INTERPRET was set then.

    Raises FlashAttentionUnavailableError when this call needs the other mode than the one the process is in:
    compiled kernels after triton was imported with TRITON_INTERPRET=1 (Triton's standard library is then
    interpreter-only), or a call of either mode after the kernels were imported for the other one."""
    import triton
    import triton.language as tl

    if not interpret and not isinstance(tl.sum, triton.JITFunction):
        raise FlashAttentionUnavailableError(
            "triton was imported while TRITON_INTERPRET=1 was set, so this process can only run the "
            "Triton interpreter; compiled GPU kernels need TRITON_INTERPRET unset before anything "
            "imports triton (run GPU jobs/tests in a process without it)"
        )
    module = importlib.import_module(f".{name}", __package__)
    compiled = isinstance(module._row_max, triton.JITFunction)
    if compiled == interpret:
        was, now = ("unset", "set") if compiled else ("set", "unset")
        raise FlashAttentionUnavailableError(
            f"the Triton kernels were imported with TRITON_INTERPRET {was} (at the first flash call of this "
            f"process) and cannot run with it {now}: the interpreter is chosen once per process, before the "
            "first call; run CPU (TRITON_INTERPRET=1) and GPU jobs in separate processes"
        )
    return module


def launcher(kernel, grid, traced: bool):
    """kernel[grid], or `torch.library.wrap_triton(kernel)[grid]` inside the triton ops, so that
    torch.compile (make_fx / AOTAutograd) records the launch itself and Inductor emits it in the
    generated code, instead of calling back into Python for every attention call."""
    if traced and not interpret_enabled():  # interpreter kernels are not JIT functions: launch directly
        return torch.library.wrap_triton(kernel)[grid]
    return kernel[grid]


def _scale_log2(softmax_scale: float, softcap: float) -> float:
    """The kernels' score multiplier: scale * log2(e) (base-2 scores), or scale / c with soft-capping, whose
    kernels then take c * tanh(.) in base 2 (`_triton_common._softcap`)."""
    return softmax_scale / softcap if softcap else softmax_scale * LOG2E


def _variant_kwargs(window: int, q_doc, dropout_p: float, dropout_seed, softcap: float) -> dict:
    """Kernel keyword arguments of the variants (window, documents, dropout, soft-capping); all off gives the
    plain causal kernels (softcap None: a constexpr, so the plain kernels compile exactly as without it)."""
    return dict(
        softcap=softcap * LOG2E if softcap else None,
        SOFTCAP=bool(softcap),
        Q_DOC=q_doc,
        SEED=dropout_seed,
        window=int(window),
        dropout_p=float(dropout_p),
        HAS_WINDOW=window > 0,
        HAS_DOC=q_doc is not None,
        HAS_DROPOUT=dropout_p > 0.0,
    )


def _strides(*tensors) -> list:
    """The (B, H, N) strides of each tensor: the kernels take no head-dim stride, it is 1 for every operand
    (`unit_last_stride` for the inputs; the outputs are made dense with a unit last stride)."""
    return [s for t in tensors for s in t.stride()[:3]]


def _options(cfg) -> dict:
    return {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def launch_fwd(
    q,
    k,
    v,
    causal: bool,
    softmax_scale: float,
    traced: bool = False,
    window: int = 0,
    q_doc=None,
    k_doc=None,
    dropout_p: float = 0.0,
    dropout_seed=None,
    softcap: float = 0.0,
):
    """Forward: (o, lse). Variants (validated by `flash_attention`): window w >= 1 (0: none), q_doc int32
    (2, B, Nq) document key ranges of the query rows (k_doc: unused here), dropout_p with its int64 (1,)
    seed, softcap c > 0 (0: none)."""
    if q.dtype == torch.bfloat16 and interpret_enabled():
        # numpy (the interpreter) has no bfloat16: compute in float32, return bfloat16
        o, lse = launch_fwd(
            q.float(), k.float(), v.float(), causal, softmax_scale, False, window, q_doc, k_doc, dropout_p,
            dropout_seed, softcap,
        )  # fmt: skip
        return o.to(torch.bfloat16), lse
    q, k, v = unit_last_stride(q), unit_last_stride(k), unit_last_stride(v)
    p = kplan.plan_fwd(q, k, v, causal, softmax_scale, window, q_doc, dropout_p, softcap)
    if p.backend == "gluon":  # sm_90 from plan.MIN_N: the Gluon forward
        g = kplan.gluon_fwd()
        return (g.forward if traced else g.run)(q, k, v, softmax_scale)
    B, Hq, Nq, d = (int(x) for x in q.shape)
    Hkv, Nk = int(k.shape[1]), int(k.shape[2])
    (cfg,) = p.tiles
    o = empty_like_layout(q)  # (B, Hq, Nq, d) laid out as q is
    lse = torch.empty((B, Hq, Nq), dtype=torch.float32, device=q.device)
    kern = kernel_module(interpret_enabled())._fwd_kernel
    with device_ctx(q):
        launcher(kern, (_cdiv(Nq, cfg.block_m), Hq, B), traced)(
            q, k, v, o, lse,
            *_strides(q, k, v, o),
            Hq, Hq // Hkv, Nq, Nk, d, _scale_log2(softmax_scale, softcap),
            CAUSAL=causal, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=p.block_d,
            EVEN_M=Nq % cfg.block_m == 0, EVEN_N=Nk % cfg.block_n == 0, EVEN_D=d == p.block_d,
            DOT_PRECISION=dot_precision(q.dtype), **_options(cfg),
            **_variant_kwargs(window, q_doc, dropout_p, dropout_seed, softcap),
        )  # fmt: skip
    return o, lse


def launch_bwd(
    do,
    q,
    k,
    v,
    o,
    lse,
    causal: bool,
    softmax_scale: float,
    dlse=None,
    traced: bool = False,
    window: int = 0,
    q_doc=None,
    k_doc=None,
    dropout_p: float = 0.0,
    dropout_seed=None,
    dqkv=None,
    deterministic: bool = False,
    softcap: float = 0.0,
):
    """Backward: (dq, dk, dv), new tensors laid out as q, k, v (`empty_like_layout`); with `dqkv` (a
    (B, N, 3, H, d) tensor, the packed entry point) the kernels write its three slices and the views of
    them are returned. The kernels then get dqkv itself, never the views: a compiled graph may clone an
    argument a kernel writes, and a clone of a view with gaps would not keep the strides the launch passes."""
    if q.dtype == torch.bfloat16 and interpret_enabled():
        grads = launch_bwd(
            do.float(), q.float(), k.float(), v.float(), o.float(), lse, causal, softmax_scale, dlse, False,
            window, q_doc, k_doc, dropout_p, dropout_seed, None, deterministic, softcap,
        )  # fmt: skip
        if dqkv is not None:
            dqkv.copy_(torch.stack(grads, dim=1).permute(0, 3, 1, 2, 4))  # (B, 3, H, N, d) -> (B, N, 3, H, d)
            return packed_views(dqkv)
        return tuple(g.to(torch.bfloat16) for g in grads)
    q, k, v, o = (unit_last_stride(t) for t in (q, k, v, o))
    do = unit_last_stride(do.to(q.dtype))
    lse = lse.to(torch.float32).contiguous()
    p = kplan.plan_bwd(
        do, q, k, v, o, causal, softmax_scale, window, q_doc, dropout_p, deterministic, softcap
    )
    if p.backend == "gluon":  # sm_90: the one-pass Gluon backward (dQ by TMA reduce-add)
        return kplan.gluon_bwd().call(do, q, k, v, o, lse, dlse, softmax_scale, traced, dqkv)
    B, Hq, Nq, d = (int(x) for x in q.shape)
    Hkv, Nk = int(k.shape[1]), int(k.shape[2])
    c_dq, c_dkdv = p.tiles
    tma_dq, tma_dkdv = p.tma
    even_d = d == p.block_d
    prec = dot_precision(q.dtype)
    kern = kernel_module(interpret_enabled())

    delta = torch.empty((B, Hq, Nq), dtype=torch.float32, device=q.device)
    if dlse is not None:
        dlse = dlse.to(torch.float32).contiguous()
    if dqkv is None:
        dq, dk, dv = empty_like_layout(q), empty_like_layout(k), empty_like_layout(v)  # laid out as inputs
        dq_arg, dk_arg, dv_arg, dk_off, dv_off = dq, dk, dv, 0, 0
    else:  # the slices of dqkv: q's starts at its first element, k's and v's one and two steps of dim 2 on
        dq, dk, dv = packed_views(dqkv)  # for the strides
        dq_arg, dk_arg, dv_arg, dk_off, dv_off = dqkv, dqkv, None, dqkv.stride(2), 2 * dqkv.stride(2)
    scale_args = (Hq, Hq // Hkv, Nq, Nk, d, softmax_scale, _scale_log2(softmax_scale, softcap))
    if (tma_dq is not None or tma_dkdv is not None) and q.is_cuda:
        ensure_scratch_allocator()
    with device_ctx(q):
        # dQ first: its programs also compute Delta = rowsum(dO * O) (- dLSE) of their rows and
        # store it for the dK/dV kernel (no separate preprocess launch)
        launcher(kern._bwd_dq_kernel, (_cdiv(Nq, c_dq.block_m), Hq, B), traced)(
            q, k, v, do, lse, delta, dq_arg, o, dlse,  # dlse None: HAS_DLSE=False, never read
            *_strides(q, k, v, do, dq, o),
            *scale_args, TMA_K=(tma_dq or (0, 0))[0], TMA_V=(tma_dq or (0, 0))[1],
            CAUSAL=causal, BLOCK_M=c_dq.block_m, BLOCK_N=c_dq.block_n, BLOCK_D=p.block_d,
            EVEN_M=Nq % c_dq.block_m == 0, EVEN_N=Nk % c_dq.block_n == 0, EVEN_D=even_d,
            DOT_PRECISION=prec, HAS_DLSE=dlse is not None,
            **_options(c_dq), **_variant_kwargs(window, q_doc, dropout_p, dropout_seed, softcap),
        )  # fmt: skip
        launcher(kern._bwd_dkdv_kernel, (_cdiv(Nk, c_dkdv.block_n), Hkv, B), traced)(
            q, k, v, do, lse, delta, dk_arg, dv_arg,
            *_strides(q, k, v, do, dk, dv),
            *scale_args, TMA_Q=(tma_dkdv or (0, 0))[0], TMA_DO=(tma_dkdv or (0, 0))[1],
            CAUSAL=causal, BLOCK_M=c_dkdv.block_m, BLOCK_N=c_dkdv.block_n, BLOCK_D=p.block_d,
            EVEN_M=Nq % c_dkdv.block_m == 0, EVEN_N=Nk % c_dkdv.block_n == 0, EVEN_D=even_d,
            DOT_PRECISION=prec, **_options(c_dkdv),
            **_variant_kwargs(window, q_doc, dropout_p, dropout_seed, softcap), K_DOC=k_doc,
            dk_offset=dk_off, dv_offset=dv_off,
        )  # fmt: skip
    return dq, dk, dv


def dropout_mask(
    dropout_seed: torch.Tensor, B: int, Hq: int, Nq: int, Nk: int, dropout_p: float
) -> torch.Tensor:
    """The kernels' own dropout keep mask, bool (B, Hq, Nq, Nk) on the seed's device (a test helper: the
    attention kernels never store it, they regenerate it). dropout_seed: int64 (1,) tensor."""
    out = torch.empty((B, Hq, Nq, Nk), dtype=torch.int8, device=dropout_seed.device)
    kern = kernel_module(interpret_enabled(), "_triton_common")._dropout_mask_kernel
    with device_ctx(out):
        kern[(_cdiv(Nq, 16), Hq, B)](dropout_seed, out, Hq, Nq, Nk, float(dropout_p), BLOCK_M=16, BLOCK_N=16)
    return out.bool()
