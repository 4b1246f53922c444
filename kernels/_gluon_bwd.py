"""Hopper (sm_90) causal FlashAttention backward in Gluon: one pass over the key blocks, dQ by TMA reduce-add.

It replaces the split Triton backward (7 matrix products per tile, no atomics) where `plan.plan_bwd` allows
(sm_90, causal, Nq == Nk a multiple of 128, MHA, d 64 / 128, 16-bit, no variants, TMA-able strides) and
determinism is not asked for: dQ is summed in the order the key-block programs reach the L2, so it is not
bitwise reproducible run to run (dK and dV are: one program owns each key block).

Algorithm: FlashAttention-2's backward with the key block outer (Dao 2023, section 3.2, Algorithm 2), dQ added
across key blocks into a float32 buffer instead of recomputed by a second kernel, scheduled as
FlashAttention-3 does on Hopper (Shah et al. 2024, arXiv:2407.08608, section 3.3): 5 matrix products per
(key block, query block) tile instead of the split design's 7.
- warp specialisation: one producer warp loads K and V of the program's 128 keys once and streams Q_i and
  dO_i (64 query rows) through a ring of TMA loads; two consumer warpgroups own 64 keys each, their dK and
  dV in registers;
- per query block, warpgroup w: S^T = K_w Q_i^T and dP^T = V_w dO_i^T in flight together, P^T =
  exp2(S^T - LSE_i) under dP^T, dV_w += P^T dO_i (P^T from registers), dS^T = P^T (dP^T - Delta_i) under it,
  dK_w += dS^T Q_i; dS^T also goes to shared memory, where the two halves make the tile's (64 x 128) dS,
  and warpgroup w computes columns w d/2 .. of dQ_i = dS K and adds them to the float32 buffer with a TMA
  reduce-add;
- causal: the query blocks start at the key block's diagonal; the first two straddle it and are masked
  (peeled out of the loop, which then has no mask and no branch).
A preprocess kernel computes Delta = rowsum(dO * O); dQ is cast from the float32 buffer at the end. The
softmax scale is folded into dS (dK = dS^T Q, dQ = dS K come out scaled).

Layouts: q, k, v, do, o (B, H, N, d) with unit last stride and 16-byte aligned other strides (the TMA
descriptors are built on the device per (batch, head), so views of a packed qkv work); lse (B, H, N) float32
natural log as the forward stores it; dq, dk, dv any strides with unit last stride.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ._gluon_fwd import _barriers
from ._runtime import device_ctx, empty_like_layout, ensure_scratch_allocator, packed_views, strides

LOG2E = 1.4426950408889634


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """cp.reduce.async.bulk.tensor .add of the shared tile `src` into `tensor_desc` at `coord` (triton 3.6's
    Gluon builds this op, `ttng.async_tma_reduce`, but has no wrapper for it; `tma.store_wait` waits)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(
        ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle
    )


@gluon.jit
def _head_descriptor(base, N, stride_n, BLOCK: gl.constexpr, HEAD_D: gl.constexpr):
    """A TMA descriptor over one (batch, head)'s rows of ``base`` ((N, d), row stride ``stride_n``, last
    stride 1): BLOCK x d tiles, zero-filled past row N. Built on the device (Triton's scratch allocator),
    once per program."""
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, HEAD_D], base.dtype.element_ty)
    return tma.make_tensor_descriptor(base, [N, HEAD_D], [stride_n, 1], [BLOCK, HEAD_D], layout)


@gluon.jit
def _desc(
    base, N, stride_n, HEAD_D: gl.constexpr, BOX_M: gl.constexpr, BOX_D: gl.constexpr, layout: gl.constexpr
):
    """A TMA descriptor over one (batch, head)'s (N, HEAD_D) rows of ``base`` (row stride ``stride_n``, last
    stride 1), BOX_M x BOX_D boxes in shared-memory ``layout``: `_head_descriptor` with a box
    narrower than a row or a layout of one's own. Built on the device (Triton's scratch)."""
    return tma.make_tensor_descriptor(base, [N, HEAD_D], [stride_n, 1], [BOX_M, BOX_D], layout)


@gluon.jit
def _bwd_loader(
    descs,
    k_smem,
    v_smem,
    q_bufs,
    do_bufs,
    kv_bar,
    ready,
    empty,
    n0,
    n_q,
    STAGES: gl.constexpr,
):
    """Producer (1 warp): K and V of the 128 keys once (two 64-row boxes each), then Q_i and dO_i of query
    block i (rows n0 + 64 i ..) into ring slot i % STAGES as both consumers free it."""
    k_desc, v_desc, q_desc, do_desc = descs
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for w in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [n0 + 64 * w, 0], kv_bar, k_smem.slice(64 * w, 64))
        tma.async_copy_global_to_shared(v_desc, [n0 + 64 * w, 0], kv_bar, v_smem.slice(64 * w, 64))
    for i in range(n_q):
        slot = i % STAGES
        # barriers start with phase 1 complete, so the first pass does not wait
        mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        m = n0 + i * 64
        tma.async_copy_global_to_shared(q_desc, [m, 0], ready.index(slot), q_bufs.index(slot))
        tma.async_copy_global_to_shared(do_desc, [m, 0], ready.index(slot), do_bufs.index(slot))


@gluon.jit
def _dq_issue(ds_bufs, ds_full, k_half, dq_zero, j):
    """Issue dQ_j[:, w d/2 ..] = dS_j K[:, w d/2 ..] once both warpgroups' halves of dS_j are in."""
    mbarrier.wait(ds_full.index(j % 2), (j // 2) & 1)
    return warpgroup_mma(ds_bufs.index(j % 2), k_half, dq_zero, use_acc=False, is_async=True)


@gluon.jit
def _dq_reduce(dq, dq_smem, dq_desc, m, WG: gl.constexpr, HEAD_D: gl.constexpr):
    """Add this warpgroup's dQ half of query rows m .. m + 63 into the float32 buffer (TMA reduce-add),
    once the previous one has left dq_smem."""
    tma.store_wait(0)
    dq_smem.store(dq)
    fence_async_shared()
    _tma_reduce_add(dq_desc, [m, WG * (HEAD_D // 2)], dq_smem)


@gluon.jit
def _bwd_step(
    i,
    step,
    lse2,
    delta,
    dk,
    dv,
    WG: gl.constexpr,
    MASK: gl.constexpr,
    FIRST: gl.constexpr,
    DEFER: gl.constexpr,
    HEAD_D: gl.constexpr,
    STAGES: gl.constexpr,
    s_layout: gl.constexpr,
):
    """Query block i (rows m = n0 + 64 i ..) against this warpgroup's 64 keys: dV_w and dK_w updated, a dQ
    half added to the float32 buffer (dQ_i, or with DEFER dQ_{i-1}, issued behind S_i and dP_i so that the
    other warpgroup has a step longer to deliver its half of dS). lse2, delta: LSE_i (base 2) and Delta_i,
    loaded one step ahead; returns the next block's. MASK: a block straddling the diagonal (key c is
    visible to query r iff c <= r). FIRST: i == 0. `step`: what every step of the warpgroup reads."""
    w_smem, bars, dq_desc, stats, zeros, n0, scales = step
    k_w, v_w, k_half, q_bufs, do_bufs, p_smem, ds_bufs, dq_smem = w_smem
    ready, empty, ds_full, ds_empty = bars
    LSE, DELTA, stat_off, N = stats
    s_zero, dq_zero = zeros
    softmax_scale, scale_log2 = scales
    slot = i % STAGES
    m = n0 + i * 64
    q_smem = q_bufs.index(slot)
    do_smem = do_bufs.index(slot)
    rows = m + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))
    nxt = rows + 64  # past N after the last block: masked
    lse2_n = gl.load(LSE + stat_off + nxt, mask=nxt < N, other=0.0) * 1.4426950408889634
    delta_n = gl.load(DELTA + stat_off + nxt, mask=nxt < N, other=0.0)
    mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
    # -- S = Q_i K_w^T and dP = dO_i V_w^T (64 queries x 64 keys), both in flight
    s = warpgroup_mma(q_smem, k_w.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    dp = warpgroup_mma(do_smem, v_w.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if DEFER and not FIRST:
        dq = _dq_issue(ds_bufs, ds_full, k_half, dq_zero, i - 1)
        s = warpgroup_mma_wait(num_outstanding=2, deps=(s,))
    else:
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
    # -- P = exp2(S scale log2(e) - LSE_i) while dP runs
    p = gl.exp2(s * scale_log2 - lse2[:, None])
    if MASK:
        keys = n0 + 64 * WG + gl.arange(0, 64, layout=gl.SliceLayout(0, s_layout))
        p = gl.where(keys[None, :] <= rows[:, None], p, 0.0)
    # -- dV_w += P^T dO_i, P^T read from shared memory
    p_smem.store(p.to(q_smem.dtype))
    fence_async_shared()
    dv = warpgroup_mma(p_smem.permute((1, 0)), do_smem, dv, is_async=True)
    if DEFER and not FIRST:
        dp = warpgroup_mma_wait(num_outstanding=2, deps=(dp,))
    else:
        dp = warpgroup_mma_wait(num_outstanding=1, deps=(dp,))
    # -- dS = P (dP - Delta_i), scaled (S = scale Q K^T), into columns 64 WG .. of the tile's (64 x 128) dS
    ds = (p * (dp - delta[:, None]) * softmax_scale).to(q_smem.dtype)
    b = i % 2
    mbarrier.wait(ds_empty.index(b), ((i // 2) & 1) ^ 1)
    ds_w = ds_bufs.index(b).slice(64 * WG, 64, dim=1)
    ds_w.store(ds)
    fence_async_shared()
    mbarrier.arrive(ds_full.index(b), count=1)
    # -- dK_w += dS_w^T Q_i
    dk = warpgroup_mma(ds_w.permute((1, 0)), q_smem, dk, is_async=True)
    if DEFER:
        if FIRST:
            dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
            mbarrier.arrive(empty.index(slot), count=1)
        else:
            dq, dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dq, dv, dk))
            mbarrier.arrive(empty.index(slot), count=1)
            mbarrier.arrive(ds_empty.index((i - 1) % 2), count=1)
            _dq_reduce(dq, dq_smem, dq_desc, m - 64, WG, HEAD_D)
    else:
        dq = _dq_issue(ds_bufs, ds_full, k_half, dq_zero, i)
        dv, dk, dq = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, dq))
        mbarrier.arrive(empty.index(slot), count=1)
        mbarrier.arrive(ds_empty.index(b), count=1)
        _dq_reduce(dq, dq_smem, dq_desc, m, WG, HEAD_D)
    return dk, dv, lse2_n, delta_n


@gluon.jit
def _bwd_consumer(
    smem, gmem, WG: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr, DEFER: gl.constexpr
):
    """Consumer warpgroup WG (4 warps): keys n0 + 64 WG .. + 63; dK, dV in registers, dQ halves reduced."""
    k_smem, v_smem, q_bufs, do_bufs, p_bufs, ds_bufs, dq_bufs, kv_bar, bars, dq_desc = smem
    LSE, DELTA, DK, DV, stat_off, dk_off, dv_off, stride_dkn, stride_dvn, n0, n_q, N, scales = gmem
    ready, empty, ds_full, ds_empty = bars
    stats = (LSE, DELTA, stat_off, N)
    HALF: gl.constexpr = HEAD_D // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_D, 16]
    )
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16]
    )
    k_w = k_smem.slice(64 * WG, 64)
    v_w = v_smem.slice(64 * WG, 64)
    k_half = k_smem.slice(WG * HALF, HALF, dim=1)
    dq_smem = dq_bufs.index(WG)
    p_smem = p_bufs.index(WG)

    dk = gl.zeros([64, HEAD_D], gl.float32, layout=acc_layout)
    dv = gl.zeros([64, HEAD_D], gl.float32, layout=acc_layout)
    s_zero = gl.zeros([64, 64], gl.float32, layout=s_layout)
    dq_zero = gl.zeros([64, HALF], gl.float32, layout=dq_layout)
    rows = n0 + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))
    lse2 = gl.load(LSE + stat_off + rows) * 1.4426950408889634
    delta = gl.load(DELTA + stat_off + rows)
    mbarrier.wait(kv_bar, 0)
    w_smem = (k_w, v_w, k_half, q_bufs, do_bufs, p_smem, ds_bufs, dq_smem)
    step = (w_smem, bars, dq_desc, stats, (s_zero, dq_zero), n0, scales)
    # -- query blocks 0 and 1 straddle the diagonal of the 128 keys: masked, outside the loop
    dk, dv, lse2, delta = _bwd_step(
        0, step, lse2, delta, dk, dv, WG, True, True, DEFER, HEAD_D, STAGES, s_layout
    )
    dk, dv, lse2, delta = _bwd_step(
        1, step, lse2, delta, dk, dv, WG, True, False, DEFER, HEAD_D, STAGES, s_layout
    )
    for i in range(2, n_q):
        dk, dv, lse2, delta = _bwd_step(
            i, step, lse2, delta, dk, dv, WG, False, False, DEFER, HEAD_D, STAGES, s_layout
        )
    if DEFER:  # dQ of the last query block
        last = n_q - 1
        dq = _dq_issue(ds_bufs, ds_full, k_half, dq_zero, last)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
        mbarrier.arrive(ds_empty.index(last % 2), count=1)
        _dq_reduce(dq, dq_smem, dq_desc, n0 + last * 64, WG, HEAD_D)
    tma.store_wait(0)

    # -- dK (already scaled through dS) and dV of the 64 keys
    rows_k = n0 + 64 * WG + gl.arange(0, 64, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, acc_layout))
    dtype: gl.constexpr = k_smem.dtype
    gl.store(DK + dk_off + rows_k[:, None] * stride_dkn + cols[None, :], dk.to(dtype))
    gl.store(DV + dv_off + rows_k[:, None] * stride_dvn + cols[None, :], dv.to(dtype))


@gluon.jit
def _bwd_ws_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ_ACC,
    DK,
    DV,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_dob,
    stride_doh,
    stride_don,
    stride_dkb,
    stride_dkh,
    stride_dkn,
    stride_dvb,
    stride_dvh,
    stride_dvn,
    H,
    N,
    softmax_scale,
    scale_log2,
    HEAD_D: gl.constexpr,
    STAGES: gl.constexpr,
    DEFER: gl.constexpr,
):
    """One program per (128 keys, batch * head); grid (N / 128, B * H), key block 0 (the most query blocks)
    first. DQ_ACC: (B, H, N, HEAD_D) float32 contiguous, zeroed. Launch with num_warps=4 (the default
    partition is consumer warpgroup 0) and maxnreg=168 (12 warps: 240 + 240 + 24 registers)."""
    HALF: gl.constexpr = HEAD_D // 2
    n0 = gl.program_id(0) * 128
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    n_q = (N - n0) // 64
    dtype: gl.constexpr = Q.dtype.element_ty

    # K is sliced by columns for dQ = dS K: its swizzle must not span the halves (HALF * 2 bytes wide)
    k_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=HEAD_D, element_bitwidth=16, rank=2)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], dtype)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 128], dtype)
    dq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, HALF], gl.float32)
    k_desc = _desc(K + b * stride_kb + h * stride_kh, N, stride_kn, HEAD_D, 64, HEAD_D, k_layout)
    v_desc = _head_descriptor(V + b * stride_vb + h * stride_vh, N, stride_vn, 64, HEAD_D)
    q_desc = _head_descriptor(Q + b * stride_qb + h * stride_qh, N, stride_qn, 64, HEAD_D)
    do_desc = _head_descriptor(DO + b * stride_dob + h * stride_doh, N, stride_don, 64, HEAD_D)
    dq_desc = _desc(DQ_ACC + bh * N * HEAD_D, N, HEAD_D, HEAD_D, 64, HALF, dq_layout)

    k_smem = gl.allocate_shared_memory(dtype, [128, HEAD_D], k_layout)
    v_smem = gl.allocate_shared_memory(dtype, [128, HEAD_D], v_desc.layout)
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES, 64, HEAD_D], q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES, 64, HEAD_D], do_desc.layout)
    p_bufs = gl.allocate_shared_memory(dtype, [2, 64, 64], p_layout)  # one per warpgroup
    ds_bufs = gl.allocate_shared_memory(dtype, [2, 64, 128], ds_layout)  # double-buffered, shared
    dq_bufs = gl.allocate_shared_memory(gl.float32, [2, 64, HALF], dq_layout)
    kv_bar = _barriers(1, 1).index(0)
    ready, empty = _barriers(STAGES, 1), _barriers(STAGES, 2)  # both warpgroups free a Q / dO slot
    ds_full, ds_empty = _barriers(2, 2), _barriers(2, 2)

    stat_off = bh * N
    dk_off = b * stride_dkb + h * stride_dkh
    dv_off = b * stride_dvb + h * stride_dvh
    descs = (k_desc, v_desc, q_desc, do_desc)
    bars = (ready, empty, ds_full, ds_empty)
    smem = (k_smem, v_smem, q_bufs, do_bufs, p_bufs, ds_bufs, dq_bufs, kv_bar, bars, dq_desc)
    scales = (softmax_scale, scale_log2)
    gmem = (LSE, DELTA, DK, DV, stat_off, dk_off, dv_off, stride_dkn, stride_dvn, n0, n_q, N, scales)
    gl.warp_specialize(
        [
            (_bwd_consumer, (smem, gmem, 0, HEAD_D, STAGES, DEFER)),
            (_bwd_consumer, (smem, gmem, 1, HEAD_D, STAGES, DEFER)),
            (_bwd_loader, (descs, k_smem, v_smem, q_bufs, do_bufs, kv_bar, ready, empty, n0, n_q, STAGES)),
        ],
        [4, 1],
        [240, 24],
    )


@triton.jit
def _bwd_prep_kernel(
    O,
    DO,
    DLSE,
    DELTA,
    stride_ob,
    stride_oh,
    stride_on,
    stride_dob,
    stride_doh,
    stride_don,
    H,
    N,
    HEAD_D: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_DLSE: tl.constexpr,
):
    """Delta = rowsum(dO * O) - dLSE (float32 (B, H, N)) of BLOCK rows of one (batch, head); grid
    (N / BLOCK, B * H). dLSE (B, H, N) float32 contiguous, the gradient of the LSE output: with it
    dS = P (dP - Delta) still holds (d lse_i / d s_ij = P_ij)."""
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, HEAD_D)
    o = tl.load(O + b * stride_ob + h * stride_oh + rows[:, None] * stride_on + cols[None, :])
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows[:, None] * stride_don + cols[None, :])
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + bh * N + rows)
    tl.store(DELTA + bh * N + rows, delta)


# head_dim -> Q / dO ring stages. Shared memory: K, V 2 * 128 * d, Q and dO 2 * STAGES * 64 * d (bf16),
# dS 2 * 64 * 128 and P 2 * 64 * 64 (bf16), dQ halves 2 * 64 * d / 2 (float32): d = 64 160 KiB at 4 stages,
# d = 128 208 KiB at 2
STAGES = {64: 4, 128: 2}
# head_dim -> issue dQ_{i-1} in step i (H200, NOTES v14: +2.5-4.6% at d = 64; at d = 128 its accumulator
# beside dK, dV, S and dP spills 952 bytes and runs 0.65x)
DEFER = {64: True, 128: False}
NUM_WARPS, MAXNREG = 4, 168


def bwd_launch(do, q, k, v, o, lse, dlse, softmax_scale, dq, dk, dv) -> None:
    """Fill dq, dk, dv (any strides with a unit last one) for inputs `plan.plan_bwd` accepts (sm_90, N % 128
    == 0, d in STAGES, TMA-aligned strides): three kernels, Delta, the backward, dQ's cast."""
    ensure_scratch_allocator()  # the device-side TMA descriptors live in Triton's global scratch
    B, H, N, d = (int(x) for x in q.shape)
    lse = lse.contiguous()
    dlse = None if dlse is None else dlse.to(torch.float32).contiguous()
    delta = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
    dq_acc = torch.zeros((B, H, N, d), dtype=torch.float32, device=q.device)
    with device_ctx(q):
        _bwd_prep_kernel[(N // 64, B * H)](
            o, do, dlse, delta, *strides(o, do), H, N, HEAD_D=d, BLOCK=64, HAS_DLSE=dlse is not None,
            num_warps=4,
        )  # fmt: skip
        _bwd_ws_kernel[(N // 128, B * H)](
            q, k, v, do, lse, delta, dq_acc, dk, dv, *strides(q, k, v, do, dk, dv), H, N, softmax_scale,
            softmax_scale * LOG2E, HEAD_D=d, STAGES=STAGES[d], DEFER=DEFER[d], num_warps=NUM_WARPS,
            maxnreg=MAXNREG,
        )  # fmt: skip
        dq.copy_(dq_acc)


def run(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, dlse: Tensor | None,
    softmax_scale: float,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(dq, dk, dv), new tensors laid out as q, k, v (dlse: the LSE output's gradient or None)."""
    dq, dk, dv = empty_like_layout(q), empty_like_layout(k), empty_like_layout(v)
    bwd_launch(do, q, k, v, o, lse, dlse, softmax_scale, dq, dk, dv)
    return dq, dk, dv


def run_packed(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, dlse: Tensor | None,
    softmax_scale: float, dqkv: Tensor,
) -> None:  # fmt: skip
    """As `run`, writing into the three slices of dqkv (B, N, 3, H, d) (the packed entry point)."""
    bwd_launch(do, q, k, v, o, lse, dlse, softmax_scale, *packed_views(dqkv))


def call(do, q, k, v, o, lse, dlse, softmax_scale: float, traced: bool, dqkv):
    """`_launch.launch_bwd`'s Gluon path: (dq, dk, dv), new or views of dqkv; through the ops when traced."""
    if dqkv is None:
        return (backward if traced else run)(do, q, k, v, o, lse, dlse, softmax_scale)
    (backward_packed if traced else run_packed)(do, q, k, v, o, lse, dlse, softmax_scale, dqkv)
    return packed_views(dqkv)


# Opaque custom ops for compiled graphs (Inductor cannot trace a Gluon kernel: NOTES v9)
backward = torch.library.custom_op("flashgpt::flash_attn_bwd_sm90", run, mutates_args=())
packed_name = "flashgpt::flash_attn_bwd_sm90_packed"
backward_packed = torch.library.custom_op(packed_name, run_packed, mutates_args=("dqkv",))


@backward.register_fake
def _backward_fake(do, q, k, v, *_):
    return empty_like_layout(q), empty_like_layout(k), empty_like_layout(v)


@backward_packed.register_fake
def _backward_packed_fake(*_):
    return None
