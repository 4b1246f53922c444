"""Hopper-only causal dK/dV kernel in Gluon: a TMA producer warp and an 8-warp consumer (experimental).

It replaces `_triton_kernels._bwd_dkdv_kernel` (same inputs and outputs; Delta from the dQ kernel, which
runs first) when `FLASHGPT_GLUON_BWD=1` / `override_tile_config(gluon_bwd=True)` asks for it, for causal
bf16/fp16 self-attention without GQA or variants at d = 64 or 128. Like kernels/_gluon_fwd.py it has no
interpreter path and is unmeasured until the H200 A/B in bench/NOTES.md v9.

FlashAttention-2's backward with the key block outer (Dao 2023, §3.2, Algorithm 2), scheduled as
FlashAttention-3 does on Hopper (Shah et al. 2024, §3.3): K and V of the block stay in shared memory, dK
and dV in registers; one producer warp streams Q_i and dO_i through a ring of TMA loads; per query block
the consumer issues S^T = K Q_i^T and dP^T = V dO_i^T together, computes P^T = exp2(S^T - LSE_i) while
dP^T is still on the tensor cores, issues dV += P^T dO_i, forms dS^T = P^T (dP^T - Delta_i) under it, then
issues dK += dS^T Q_i and waits for both before the next block (an accumulator left in flight across loop
iterations makes ptxas serialise every wgmma, NOTES v9).
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from ._gluon_fwd import barrier_ring, head_descriptor


@gluon.jit
def _bwd_loader(
    k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar, ready, empty,
    n0, m_start, n_q, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
):
    """Producer (1 warp): K and V of the key block once, then Q_i and dO_i into ring slot i % STAGES."""
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [n0, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [n0, 0], kv_bar, v_smem)
    for i in range(n_q):
        slot = i % STAGES
        mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)  # free (the first pass does not wait)
        mbarrier.expect(ready.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        m = m_start + i * BLOCK_M
        tma.async_copy_global_to_shared(q_desc, [m, 0], ready.index(slot), q_bufs.index(slot))
        tma.async_copy_global_to_shared(do_desc, [m, 0], ready.index(slot), do_bufs.index(slot))


@gluon.jit
def _bwd_consumer(
    k_smem, v_smem, q_bufs, do_bufs, kv_bar, ready, empty,
    LSE, DELTA, DK, DV, stat_off, dk_off, dv_off, stride_dkn, stride_dvn,
    n0, m_start, n_q, N, softmax_scale, scale_log2,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Consumer (default partition): dV += P^T dO, dK += dS^T Q over the query blocks that see the keys."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    dtype: gl.constexpr = k_smem.dtype
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # one value per query (a column of S^T)

    dk = gl.zeros([BLOCK_N, HEAD_D], gl.float32, layout=acc_layout)
    dv = gl.zeros([BLOCK_N, HEAD_D], gl.float32, layout=acc_layout)
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
    keys = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    offs_m = gl.arange(0, BLOCK_M, layout=col_layout)
    mbarrier.wait(kv_bar, 0)

    for i in range(n_q):
        slot = i % STAGES
        m = m_start + i * BLOCK_M
        q_smem = q_bufs.index(slot)
        do_smem = do_bufs.index(slot)
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        # -- S^T = K Q_i^T and dP^T = V dO_i^T, both in flight
        s_t = warpgroup_mma(k_smem, q_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp_t = warpgroup_mma(v_smem, do_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        # -- LSE_i (base 2) and Delta_i of these query rows; past N: P = 0 (LSE = +inf), Delta = 0
        rows = m + offs_m
        lse2 = gl.load(LSE + stat_off + rows, mask=rows < N, other=float("inf")) * 1.4426950408889634
        delta = gl.load(DELTA + stat_off + rows, mask=rows < N, other=0.0)
        s_t = warpgroup_mma_wait(num_outstanding=1, deps=(s_t,))
        # -- P^T = exp2(S^T scale log2(e) - LSE); the first query blocks straddle the diagonal
        p_t = gl.exp2(s_t * scale_log2 - lse2[None, :])
        if i < BLOCK_N // BLOCK_M:
            p_t = gl.where(keys[:, None] <= rows[None, :], p_t, 0.0)
        # -- dV += P^T dO_i (P^T from registers) while dP^T finishes
        dv = warpgroup_mma(gl.convert_layout(p_t.to(dtype), a_layout), do_smem, dv, is_async=True)
        dp_t = warpgroup_mma_wait(num_outstanding=1, deps=(dp_t,))
        # -- dS^T = P^T (dP^T - Delta); dK += dS^T Q_i
        ds_t = p_t * (dp_t - delta[None, :])
        dk = warpgroup_mma(gl.convert_layout(ds_t.to(dtype), a_layout), q_smem, dk, is_async=True)
        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
        mbarrier.arrive(empty.index(slot), count=1)

    # -- dK (scaled: S = scale Q K^T) and dV of the key rows below N
    rows_k = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, acc_layout))
    keep = rows_k[:, None] < N
    dk = (dk * softmax_scale).to(dtype)
    gl.store(DK + dk_off + rows_k[:, None] * stride_dkn + cols[None, :], dk, mask=keep)
    gl.store(DV + dv_off + rows_k[:, None] * stride_dvn + cols[None, :], dv.to(dtype), mask=keep)


@gluon.jit
def _bwd_dkdv_ws_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don, stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    H, N, softmax_scale, scale_log2,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """dK, dV of one key block of one (batch, head); grid (cdiv(N, BLOCK_N), H, B). Causal, Nq = Nk,
    one query head per KV head; BLOCK_N a multiple of BLOCK_M (query blocks start on the key block)."""
    pid_n = gl.program_id(0)
    h = gl.program_id(1)
    b = gl.program_id(2)
    n0 = pid_n * BLOCK_N
    m_start = n0  # the first query that sees key n0 is n0 itself
    n_q = gl.cdiv(N - m_start, BLOCK_M)
    dtype: gl.constexpr = Q.dtype.element_ty

    k_desc = head_descriptor(K + b * stride_kb + h * stride_kh, N, stride_kn, BLOCK_N, HEAD_D)
    v_desc = head_descriptor(V + b * stride_vb + h * stride_vh, N, stride_vn, BLOCK_N, HEAD_D)
    q_desc = head_descriptor(Q + b * stride_qb + h * stride_qh, N, stride_qn, BLOCK_M, HEAD_D)
    do_desc = head_descriptor(DO + b * stride_dob + h * stride_doh, N, stride_don, BLOCK_M, HEAD_D)

    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_D], v_desc.layout)
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], do_desc.layout)
    kv_bar = barrier_ring(1).index(0)
    ready, empty = barrier_ring(STAGES), barrier_ring(STAGES)

    stat_off = (b * H + h) * N
    gl.warp_specialize(
        [
            (_bwd_consumer, (k_smem, v_smem, q_bufs, do_bufs, kv_bar, ready, empty,
                             LSE, DELTA, DK, DV, stat_off, b * stride_dkb + h * stride_dkh,
                             b * stride_dvb + h * stride_dvh, stride_dkn, stride_dvn,
                             n0, m_start, n_q, N, softmax_scale, scale_log2,
                             BLOCK_M, BLOCK_N, HEAD_D, STAGES, num_warps)),
            (_bwd_loader, (k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar, ready,
                           empty, n0, m_start, n_q, BLOCK_M, STAGES)),
        ],
        [1],
        [24],
    )


@gluon.jit
def _dq_loader(
    q_desc, do_desc, o_desc, k_desc, v_desc, q_smem, do_smem, o_smem, k_bufs, v_bufs, row_bar, ready, empty,
    m0, n_blocks, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
):
    """Producer (1 warp): Q_i, dO_i, O_i once, then K_j and V_j into ring slot j % STAGES."""
    mbarrier.expect(row_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes + o_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [m0, 0], row_bar, q_smem)
    tma.async_copy_global_to_shared(do_desc, [m0, 0], row_bar, do_smem)
    tma.async_copy_global_to_shared(o_desc, [m0, 0], row_bar, o_smem)
    for j in range(n_blocks):
        slot = j % STAGES
        mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(slot), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [j * BLOCK_N, 0], ready.index(slot), k_bufs.index(slot))
        tma.async_copy_global_to_shared(v_desc, [j * BLOCK_N, 0], ready.index(slot), v_bufs.index(slot))


@gluon.jit
def _dq_consumer(
    q_smem, do_smem, o_smem, k_bufs, v_bufs, row_bar, ready, empty,
    LSE, DELTA, DQ, stat_off, dq_off, stride_dqn, m0, n_blocks, N, softmax_scale, scale_log2,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Consumer (default partition): Delta_i = rowsum(dO_i O_i) (stored for dK/dV), dQ_i += dS K_j."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    tile_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    dtype: gl.constexpr = q_smem.dtype

    rows = m0 + gl.arange(0, BLOCK_M, layout=row_layout)
    lse2 = gl.load(LSE + stat_off + rows, mask=rows < N, other=float("inf")) * 1.4426950408889634
    mbarrier.wait(row_bar, 0)
    # -- Delta_i = rowsum(dO_i * O_i), stored for the dK/dV kernel (launched after this one)
    do_t = do_smem.load(tile_layout).to(gl.float32)
    o_t = o_smem.load(tile_layout).to(gl.float32)
    delta = gl.convert_layout(gl.sum(do_t * o_t, 1), row_layout)
    gl.store(DELTA + stat_off + rows, delta, mask=rows < N)

    dq = gl.zeros([BLOCK_M, HEAD_D], gl.float32, layout=acc_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    first_masked = m0 // BLOCK_N  # key blocks from here on reach past the first row of this block
    for j in range(n_blocks):
        slot = j % STAGES
        k_smem = k_bufs.index(slot)
        mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
        # -- S = Q_i K_j^T and dP = dO_i V_j^T, both in flight
        s = warpgroup_mma(q_smem, k_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp = warpgroup_mma(do_smem, v_bufs.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
        p = gl.exp2(s * scale_log2 - lse2[:, None])
        if j >= first_masked:
            cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            p = gl.where(cols[None, :] <= rows[:, None], p, 0.0)
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp,))
        # -- dS = P (dP - Delta); dQ += dS K_j
        ds = p * (dp - delta[:, None])
        dq = warpgroup_mma(gl.convert_layout(ds.to(dtype), a_layout), k_smem, dq, is_async=True)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
        mbarrier.arrive(empty.index(slot), count=1)

    rows_o = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
    cols_o = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, acc_layout))
    dq = (dq * softmax_scale).to(dtype)
    gl.store(DQ + dq_off + rows_o[:, None] * stride_dqn + cols_o[None, :], dq, mask=rows_o[:, None] < N)


@gluon.jit
def _bwd_dq_ws_kernel(
    Q, K, V, DO, O, LSE, DELTA, DQ,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don, stride_ob, stride_oh, stride_on, stride_dqb, stride_dqh, stride_dqn,
    H, N, softmax_scale, scale_log2,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """dQ (and Delta) of one query block of one (batch, head); grid (cdiv(N, BLOCK_M), H, B), heaviest
    query blocks first. Causal, Nq = Nk, one query head per KV head; BLOCK_M a multiple of BLOCK_N."""
    pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
    h = gl.program_id(1)
    b = gl.program_id(2)
    m0 = pid_m * BLOCK_M
    n_blocks = gl.cdiv(gl.minimum(m0 + BLOCK_M, N), BLOCK_N)
    dtype: gl.constexpr = Q.dtype.element_ty

    q_desc = head_descriptor(Q + b * stride_qb + h * stride_qh, N, stride_qn, BLOCK_M, HEAD_D)
    do_desc = head_descriptor(DO + b * stride_dob + h * stride_doh, N, stride_don, BLOCK_M, HEAD_D)
    o_desc = head_descriptor(O + b * stride_ob + h * stride_oh, N, stride_on, BLOCK_M, HEAD_D)
    k_desc = head_descriptor(K + b * stride_kb + h * stride_kh, N, stride_kn, BLOCK_N, HEAD_D)
    v_desc = head_descriptor(V + b * stride_vb + h * stride_vh, N, stride_vn, BLOCK_N, HEAD_D)

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_D], do_desc.layout)
    o_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_D], o_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    row_bar = barrier_ring(1).index(0)
    ready, empty = barrier_ring(STAGES), barrier_ring(STAGES)

    gl.warp_specialize(
        [
            (_dq_consumer, (q_smem, do_smem, o_smem, k_bufs, v_bufs, row_bar, ready, empty,
                            LSE, DELTA, DQ, (b * H + h) * N, b * stride_dqb + h * stride_dqh, stride_dqn,
                            m0, n_blocks, N, softmax_scale, scale_log2,
                            BLOCK_M, BLOCK_N, HEAD_D, STAGES, num_warps)),
            (_dq_loader, (q_desc, do_desc, o_desc, k_desc, v_desc, q_smem, do_smem, o_smem, k_bufs, v_bufs,
                          row_bar, ready, empty, m0, n_blocks, BLOCK_N, STAGES)),
        ],
        [1],
        [24],
    )


# dQ kernel: (head_dim) -> (BLOCK_M, BLOCK_N, STAGES, consumer warps); shared memory: Q, dO, O (BLOCK_M x d)
# and STAGES pairs of K, V tiles (BLOCK_N x d), bf16: d = 128 160 KiB, d = 64 88 KiB
DQ_CONFIGS = {64: (128, 64, 4, 8), 128: (128, 64, 3, 8)}


def dq_gluon_launch(q, k, v, do, o, lse, delta, dq, softmax_scale: float, launcher=None) -> None:
    """Launch the warp-specialised dQ kernel: fills dq (q's shape; any strides, last 1) and delta (B, H, N)
    float32 contiguous = rowsum(dO * O), which the dK/dV kernel reads. Inputs as `dkdv_gluon_launch`'s,
    plus o (B, H, N, d) from the forward (TMA-able strides)."""
    B, H, N, d = (int(x) for x in q.shape)
    block_m, block_n, stages, warps = DQ_CONFIGS[d]
    grid = (triton.cdiv(N, block_m), H, B)
    launch = (launcher or (lambda kern, g: kern[g]))(_bwd_dq_ws_kernel, grid)
    launch(
        q, k, v, do, o, lse, delta, dq,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2),
        o.stride(0), o.stride(1), o.stride(2), dq.stride(0), dq.stride(1), dq.stride(2),
        H, N, softmax_scale, softmax_scale * 1.4426950408889634,
        BLOCK_M=block_m, BLOCK_N=block_n, HEAD_D=d, STAGES=stages, num_warps=warps,
    )


# (head_dim) -> (BLOCK_M, BLOCK_N, STAGES, consumer warps); shared memory: K, V (BLOCK_N x d) and STAGES
# pairs of Q, dO tiles (BLOCK_M x d), bf16: d = 128 128 KiB, d = 64 80 KiB
CONFIGS = {64: (64, 128, 3, 8), 128: (64, 128, 2, 8)}


def dkdv_gluon_launch(q, k, v, do, lse, delta, dk, dv, softmax_scale: float, launcher=None) -> None:
    """Launch the warp-specialised dK/dV kernel: fills dk, dv (k's shape; any strides, last 1).

    q, k, v, do (B, H, N, d) bf16/fp16 on an sm_90 GPU, one query head per KV head, d in CONFIGS, TMA-able
    strides (`flash_attn._gluon_fwd_applies` checks them); lse, delta (B, H, N) float32 contiguous
    (lse natural log from the forward, delta = rowsum(dO * O) from the dQ kernel). launcher(kernel, grid)
    as in `_gluon_fwd.fwd_gluon_launch`.
    """
    B, H, N, d = (int(x) for x in q.shape)
    block_m, block_n, stages, warps = CONFIGS[d]
    grid = (triton.cdiv(N, block_n), H, B)
    launch = (launcher or (lambda kern, g: kern[g]))(_bwd_dkdv_ws_kernel, grid)
    launch(
        q, k, v, do, lse, delta, dk, dv,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        H, N, softmax_scale, softmax_scale * 1.4426950408889634,
        BLOCK_M=block_m, BLOCK_N=block_n, HEAD_D=d, STAGES=stages, num_warps=warps,
    )
