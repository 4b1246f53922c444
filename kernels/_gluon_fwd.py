"""Hopper-only causal FlashAttention forward in Gluon: a TMA producer warp and an 8-warp consumer.

Experimental (issue 14). The plain-Triton forward (`_triton_kernels._fwd_kernel`) stays the default and
the path the CPU interpreter checks; this kernel compiles for sm_90 only (Gluon's warp specialisation and
asynchronous wgmma have no interpreter) and is chosen by `flash_attention` only when asked for
(`FLASHGPT_GLUON_FWD=1`) until the H200 A/B in bench/NOTES.md says it is faster.

What it takes from FlashAttention-3 (Shah et al. 2024, §3.1-3.2):
- warp specialisation: one producer warp issues the TMA loads of Q and of a ring of K and V tiles and
  keeps only 24 registers; the consumer warps (two warpgroups of 64 query rows each) get the rest;
- intra-warpgroup overlap: while the softmax of S_j runs on the CUDA cores, the tensor cores already
  compute S_{j+1} = Q K_{j+1}^T (asynchronous wgmma, waited with one group still in flight), and P_j V_j
  runs while the next iteration's S is waited for;
- causal: query blocks in reverse order (the longest rows start first); only the diagonal key block is
  masked (BLOCK_M = BLOCK_N, so it is always the last one).

Layouts as the Triton kernels take them: q (B, Hq, N, d), k and v (B, Hkv, N, d) with any strides whose
last is 1 (TMA descriptors are built on the device per (batch, head), so views of a packed qkv work);
o is written in q's layout, LSE (B, Hq, N) float32 in natural-log units, as `_fwd_kernel` writes it.
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)


@gluon.jit
def head_descriptor(base, N, stride_n, BLOCK: gl.constexpr, HEAD_D: gl.constexpr):
    """A TMA descriptor over one (batch, head)'s rows of ``base`` ((N, d), row stride ``stride_n``, last
    stride 1): BLOCK x d tiles, zero-filled past row N. Built on the device (Triton's scratch allocator)."""
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, HEAD_D], base.dtype.element_ty)
    return tma.make_tensor_descriptor(base, [N, HEAD_D], [stride_n, 1], [BLOCK, HEAD_D], layout)


@gluon.jit
def barrier_ring(STAGES: gl.constexpr):
    """STAGES mbarriers in shared memory, each completing on one arrival (or one TMA transaction count)."""
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    return bars


@gluon.jit
def _ws_loader(
    q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty,
    m0, n_blocks, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
):
    """Producer (1 warp): Q once, then K_j and V_j into ring slot j % STAGES as the consumer frees them."""
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [m0, 0], q_bar, q_smem)
    for j in range(n_blocks):
        slot = j % STAGES
        phase = (j // STAGES) & 1
        # -- K_j: its slot is free once S_{j - STAGES} was waited for (barriers start as completed
        #    phase 1, so the first pass does not wait)
        mbarrier.wait(k_empty.index(slot), phase ^ 1)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [j * BLOCK_N, 0], k_ready.index(slot), k_bufs.index(slot))
        # -- V_j: free once P_{j - STAGES} V was waited for
        mbarrier.wait(v_empty.index(slot), phase ^ 1)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [j * BLOCK_N, 0], v_ready.index(slot), v_bufs.index(slot))


@gluon.jit
def _softmax_update(s, m_i, l_i, qk_scale, m0, n0, MASK: gl.constexpr, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """One online-softmax step (FlashAttention-2 Alg. 1, base 2): P_j, the rescale alpha, new m and l."""
    s = s * qk_scale
    if MASK:  # the diagonal block: key j visible to query i iff j <= i
        rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(cols[None, :] <= rows[:, None], s, float("-inf"))
    # -- update m_i and l_i
    m_new = gl.maximum(m_i, gl.max(s, 1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


@gluon.jit
def _ws_consumer(
    q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty,
    O, LSE, o_off, stride_on, lse_off, m0, n_blocks, N, qk_scale,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Consumer (the default partition, `num_warps` warps): S = Q K^T, online softmax, O += P V."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    dtype: gl.constexpr = q_smem.dtype

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.full([BLOCK_M], 0.0, gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

    # -- S_0 = Q K_0^T
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    mbarrier.arrive(k_empty.index(0), count=1)

    # -- full key blocks: j = 0 .. n_blocks - 2 (every block before the diagonal one)
    for j in range(n_blocks - 1):
        slot = j % STAGES
        nxt = (j + 1) % STAGES
        # issue S_{j+1} = Q K_{j+1}^T; it runs on the tensor cores under the softmax of S_j
        mbarrier.wait(k_ready.index(nxt), ((j + 1) // STAGES) & 1)
        s_next = warpgroup_mma(q_smem, k_bufs.index(nxt).permute((1, 0)), s_zero, use_acc=False,
                               is_async=True)
        p, alpha, m_i, l_i = _softmax_update(s, m_i, l_i, qk_scale, m0, j * BLOCK_N, False, BLOCK_M, BLOCK_N,
                                             s_layout)
        # -- O = diag(alpha) O + P_j V_j (acc was completed by the last iteration's wait)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        mbarrier.wait(v_ready.index(slot), (j // STAGES) & 1)
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_bufs.index(slot), acc, is_async=True)
        # both in flight: S_{j+1} (older) and P_j V_j; wait for both, then free K_{j+1}'s and V_j's slots
        s, acc = warpgroup_mma_wait(num_outstanding=0, deps=(s_next, acc))
        mbarrier.arrive(k_empty.index(nxt), count=1)
        mbarrier.arrive(v_empty.index(slot), count=1)

    # -- the diagonal block j = n_blocks - 1, masked, nothing left to prefetch
    j = n_blocks - 1
    slot = j % STAGES
    p, alpha, m_i, l_i = _softmax_update(s, m_i, l_i, qk_scale, m0, j * BLOCK_N, True, BLOCK_M, BLOCK_N,
                                         s_layout)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    mbarrier.wait(v_ready.index(slot), (j // STAGES) & 1)
    acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_bufs.index(slot), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

    # -- epilogue: O = acc / l, LSE = (m + log2 l) ln 2; rows past N (the last block) are not stored
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    out = (acc / l_o[:, None]).to(dtype)
    rows_o = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    cols_o = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = O + o_off + rows_o[:, None] * stride_on + cols_o[None, :]
    gl.store(o_ptrs, out, mask=rows_o[:, None] < N)
    rows_s = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
    gl.store(LSE + lse_off + rows_s, lse, mask=rows_s < N)


@gluon.jit
def _fwd_ws_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_on,
    H_Q, GROUP, N, qk_scale,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Causal forward, one program per (query block, batch * head), heaviest query blocks first.

    qk_scale = softmax_scale * log2(e) (exp2 with the scale folded in). Requires BLOCK_M == BLOCK_N.
    """
    pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // H_Q
    h = bh % H_Q
    hk = h // GROUP
    m0 = pid_m * BLOCK_M
    n_blocks = gl.cdiv(gl.minimum(m0 + BLOCK_M, N), BLOCK_N)
    dtype: gl.constexpr = Q.dtype.element_ty

    # -- one 2D TMA descriptor per (batch, head): rows = positions, columns = d; zero past row N
    q_desc = head_descriptor(Q + b * stride_qb + h * stride_qh, N, stride_qn, BLOCK_M, HEAD_D)
    k_desc = head_descriptor(K + b * stride_kb + hk * stride_kh, N, stride_kn, BLOCK_N, HEAD_D)
    v_desc = head_descriptor(V + b * stride_vb + hk * stride_vh, N, stride_vn, BLOCK_N, HEAD_D)

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_D], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    q_bar = barrier_ring(1).index(0)
    k_ready, k_empty = barrier_ring(STAGES), barrier_ring(STAGES)
    v_ready, v_empty = barrier_ring(STAGES), barrier_ring(STAGES)

    o_off = b * stride_ob + h * stride_oh
    lse_off = bh * N
    gl.warp_specialize(
        [
            (_ws_consumer, (q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty,
                            O, LSE, o_off, stride_on, lse_off, m0, n_blocks, N, qk_scale,
                            BLOCK_M, BLOCK_N, HEAD_D, STAGES, num_warps)),
            (_ws_loader, (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready,
                          v_empty, m0, n_blocks, BLOCK_N, STAGES)),
        ],
        [1],
        [24],
    )


# (head_dim) -> (BLOCK_M = BLOCK_N, STAGES, consumer warps): shared memory 2*STAGES + 1 tiles of
# BLOCK x d bf16 (d = 128: 160 KiB at 2 stages; d = 64: 112 KiB at 3)
CONFIGS = {64: (128, 3, 8), 128: (128, 2, 8)}


def fwd_gluon_launch(q, k, v, o, lse, softmax_scale: float, launcher=None) -> None:
    """Launch the warp-specialised causal forward: fills o (q's shape; any strides) and lse (B, Hq, N)
    float32 contiguous, natural log.

    q (B, Hq, N, d), k and v (B, Hkv, N, d) with Hq % Hkv == 0, bf16 or fp16, CUDA sm_90, d in CONFIGS,
    last stride 1 and the other strides and first elements 16-byte aligned (TMA). The caller checks
    these (`flash_attn._gluon_fwd_applies`) and sets Triton's scratch allocator; this only launches.
    launcher(kernel, grid) -> callable: how to launch (default kernel[grid]; the triton op passes
    `wrap_triton` so torch.compile records the launch).
    """
    B, Hq, N, d = (int(x) for x in q.shape)
    block, stages, warps = CONFIGS[d]
    grid = (triton.cdiv(N, block), B * Hq)
    launch = (launcher or (lambda kern, g: kern[g]))(_fwd_ws_kernel, grid)
    launch(
        q, k, v, o, lse,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
        Hq, Hq // int(k.shape[1]), N, softmax_scale * 1.4426950408889634,
        BLOCK_M=block, BLOCK_N=block, HEAD_D=d, STAGES=stages, num_warps=warps,
    )
