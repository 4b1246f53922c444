"""Launchers of the FlashAttention kernels: they execute a `kernels.plan.Plan` and decide nothing themselves.

Inputs are validated by `flash_attn`. `traced`: called inside a `triton_op` body, so the launches go through
`torch.library.wrap_triton` (torch.compile records them in the graph).
"""

import importlib

import torch

from . import plan as kplan
from ._runtime import (
    FlashAttentionUnavailableError,
    cdiv,
    device_ctx,
    empty_like_layout,
    ensure_scratch_allocator,
    interpret_enabled,
    packed_views,
    strides,
    unit_last_stride,
)

LOG2E = 1.4426950408889634


def dot_precision(dtype: torch.dtype):
    # float32 must not go through tf32 tensor cores (10-bit mantissa); ignored for 16-bit inputs
    return "ieee" if dtype == torch.float32 else None


def kernel_module(interpret: bool, name: str = "_triton_kernels"):
    """The Triton kernel module `name`, imported at the first launch (compiled, or interpreted when
    TRITON_INTERPRET was set then). FlashAttentionUnavailableError when this call needs the other mode than
    the one the process is in."""
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
    """kernel[grid], or `wrap_triton(kernel)[grid]` inside the triton ops: Inductor then emits the launch in
    its generated code instead of calling back into Python per attention call."""
    if traced and not interpret_enabled():  # interpreter kernels are not JIT functions: launch directly
        return torch.library.wrap_triton(kernel)[grid]
    return kernel[grid]


def _variant_kwargs(window: int, q_doc, dropout_p: float, dropout_seed, softcap: float) -> dict:
    """Kernel keywords of the variants: a variant off passes None, which compiles it out."""
    return dict(
        Q_DOC=q_doc,
        SEED=dropout_seed if dropout_p > 0.0 else None,
        window=int(window) if window > 0 else None,
        dropout_p=float(dropout_p),
        softcap=softcap_arg(softcap),
    )


def softcap_arg(softcap: float):
    """The kernels' softcap argument: c * log2(e) (base-2 scores), or None (off: compiled out)."""
    return softcap * LOG2E if softcap else None


def kernel_qkv(q, k, v):
    """q, k, v as the Triton kernels take them: a unit last stride each, and one set of strides for k and v
    (copies only for unusual inputs: the model's and the packed op's k and v already share theirs)."""
    q, k, v = unit_last_stride(q), unit_last_stride(k), unit_last_stride(v)
    return (q, k, v) if k.stride() == v.stride() else (q, k.contiguous(), v.contiguous())


def _options(cfg) -> dict:
    return {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def launch_fwd(
    q,
    k,
    v,
    causal: bool,
    softmax_scale: float,
    window: int = 0,
    q_doc=None,
    k_doc=None,
    dropout_p: float = 0.0,
    dropout_seed=None,
    deterministic: bool = False,
    softcap: float = 0.0,
    *,
    traced: bool = False,
):
    """Forward: (o, lse); the arguments of the forward op (k_doc and deterministic unused here)."""
    if q.dtype == torch.bfloat16 and interpret_enabled():  # numpy has no bfloat16: compute in float32
        variants = (window, q_doc, k_doc, dropout_p, dropout_seed, deterministic, softcap)
        o, lse = launch_fwd(q.float(), k.float(), v.float(), causal, softmax_scale, *variants)
        return o.to(torch.bfloat16), lse
    q, k, v = kernel_qkv(q, k, v)
    p = kplan.plan_fwd(q, k, v, causal, softmax_scale, window, q_doc, dropout_p, softcap)
    if p.backend == "gluon":  # sm_90 from plan.MIN_N: the Gluon forward
        g = kplan.gluon("fwd")
        return (g.forward if traced else g.run)(q, k, v, softmax_scale)
    B, Hq, Nq, d = (int(x) for x in q.shape)
    Hkv, Nk = int(k.shape[1]), int(k.shape[2])
    (cfg,) = p.tiles
    o = empty_like_layout(q)  # (B, Hq, Nq, d) laid out as q is
    lse = torch.empty((B, Hq, Nq), dtype=torch.float32, device=q.device)
    kern = kernel_module(interpret_enabled())._fwd_kernel
    with device_ctx(q):
        launcher(kern, (cdiv(Nq, cfg.block_m), Hq, B), traced)(
            q, k, v, o, lse,
            *strides(q, k, o),
            Hq, Hq // Hkv, Nq, Nk, d, softmax_scale,
            CAUSAL=causal, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=p.block_d,
            EVEN_M=Nq % cfg.block_m == 0, EVEN_N=Nk % cfg.block_n == 0,
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
    window: int = 0,
    q_doc=None,
    k_doc=None,
    dropout_p: float = 0.0,
    dropout_seed=None,
    deterministic: bool = False,
    softcap: float = 0.0,
    *,
    traced: bool = False,
    dqkv=None,
):
    """Backward: (dq, dk, dv), new tensors laid out as q, k, v; the arguments of the backward op. With `dqkv`
    (B, N, 3, H, d) the kernels write its three slices and the views are returned. The kernels get dqkv
    itself, never the views: a compiled graph may clone a written argument, and a clone of a view with
    gaps would not keep the strides the launch passes."""
    if q.dtype == torch.bfloat16 and interpret_enabled():
        variants = (window, q_doc, k_doc, dropout_p, dropout_seed, deterministic, softcap)
        inputs = (t.float() for t in (do, q, k, v, o))
        grads = launch_bwd(*inputs, lse, causal, softmax_scale, dlse, *variants)
        if dqkv is not None:
            dqkv.copy_(torch.stack(grads, dim=1).permute(0, 3, 1, 2, 4))  # (B, 3, H, N, d) -> (B, N, 3, H, d)
            return packed_views(dqkv)
        return tuple(g.to(torch.bfloat16) for g in grads)
    q, k, v = kernel_qkv(q, k, v)
    o = unit_last_stride(o)
    do = unit_last_stride(do.to(q.dtype))
    lse = lse.to(torch.float32).contiguous()
    p = kplan.plan_bwd(
        do, q, k, v, o, causal, softmax_scale, window, q_doc, dropout_p, deterministic, softcap
    )
    if p.backend == "gluon":  # sm_90: the one-pass Gluon backward (dQ by TMA reduce-add)
        return kplan.gluon("bwd").call(do, q, k, v, o, lse, dlse, softmax_scale, traced, dqkv)
    B, Hq, Nq, d = (int(x) for x in q.shape)
    Hkv, Nk = int(k.shape[1]), int(k.shape[2])
    c_dq, c_dkdv = p.tiles
    tma_dq, tma_dkdv = p.tma
    prec = dot_precision(q.dtype)
    kern = kernel_module(interpret_enabled())

    delta = torch.empty((B, Hq, Nq), dtype=torch.float32, device=q.device)
    if dlse is not None:
        dlse = dlse.to(torch.float32).contiguous()
    if dqkv is None:
        dq, dk, dv = empty_like_layout(q), empty_like_layout(k), empty_like_layout(v)  # laid out as inputs
        dq_arg, dk_arg, dv_arg, kv_step = dq, dk, dv, 0
    else:  # the slices of dqkv: q's starts at its first element, k's and v's one and two steps of dim 2 on
        dq, dk, dv = packed_views(dqkv)  # for the strides
        dq_arg, dk_arg, dv_arg, kv_step = dqkv, dqkv, None, dqkv.stride(2)
    scale_args = (Hq, Hq // Hkv, Nq, Nk, d, softmax_scale)
    if (tma_dq is not None or tma_dkdv is not None) and q.is_cuda:
        ensure_scratch_allocator()
    with device_ctx(q):
        # dQ first: its programs also compute Delta = rowsum(dO * O) (- dLSE) of their rows and
        # store it for the dK/dV kernel (no separate preprocess launch)
        launcher(kern._bwd_dq_kernel, (cdiv(Nq, c_dq.block_m), Hq, B), traced)(
            q, k, v, do, lse, delta, dq_arg, o, dlse,  # dlse None: never read
            *strides(q, k, do, dq, o),
            *scale_args, TMA_KV=(tma_dq or (0, 0))[0],
            CAUSAL=causal, BLOCK_M=c_dq.block_m, BLOCK_N=c_dq.block_n, BLOCK_D=p.block_d,
            EVEN_M=Nq % c_dq.block_m == 0, EVEN_N=Nk % c_dq.block_n == 0, DOT_PRECISION=prec,
            **_options(c_dq), **_variant_kwargs(window, q_doc, dropout_p, dropout_seed, softcap),
        )  # fmt: skip
        launcher(kern._bwd_dkdv_kernel, (cdiv(Nk, c_dkdv.block_n), Hkv, B), traced)(
            q, k, v, do, lse, delta, dk_arg, dv_arg,
            *strides(q, k, do, dk),
            *scale_args, TMA_Q=(tma_dkdv or (0, 0))[0], TMA_DO=(tma_dkdv or (0, 0))[1],
            CAUSAL=causal, BLOCK_M=c_dkdv.block_m, BLOCK_N=c_dkdv.block_n, BLOCK_D=p.block_d,
            EVEN_M=Nq % c_dkdv.block_m == 0, EVEN_N=Nk % c_dkdv.block_n == 0, DOT_PRECISION=prec,
            **_options(c_dkdv), **_variant_kwargs(window, q_doc, dropout_p, dropout_seed, softcap),
            K_DOC=k_doc, kv_step=kv_step,
        )  # fmt: skip
    return dq, dk, dv


def dropout_mask(
    dropout_seed: torch.Tensor, B: int, Hq: int, Nq: int, Nk: int, dropout_p: float
) -> torch.Tensor:
    """The kernels' own dropout keep mask, bool (B, Hq, Nq, Nk) on the int64 (1,) seed's device (tests)."""
    out = torch.empty((B, Hq, Nq, Nk), dtype=torch.int8, device=dropout_seed.device)
    kern = kernel_module(interpret_enabled(), "_triton_common")._dropout_mask_kernel
    with device_ctx(out):
        kern[(cdiv(Nq, 16), Hq, B)](dropout_seed, out, Hq, Nq, Nk, float(dropout_p), BLOCK_M=16, BLOCK_N=16)
    return out.bool()
