"""Hopper (sm_90) causal FlashAttention forward in Gluon: persistent, a TMA producer warp, NC consumers.

`plan.plan_fwd` sends it what it was measured faster on (sm_90, causal, Nq == Nk, d 64 / 128, 16-bit, no
variants, TMA-able strides, N from MIN_N); o and LSE are written as the Triton forward writes them.
Schedule after FlashAttention-3 (Shah et al. 2024, arXiv:2407.08608, sections 3.1-3.2):
- warp specialisation: one producer warp (24 registers) TMA-loads the tile's Q parts and a ring of K / V
  tiles; NC consumer warpgroups own 64 query rows each and share every K / V tile. NC = `CONSUMERS[d]`: 2 at
  d = 128, 3 at d = 64 (FlashAttention-3's 192 x 128 tiles: one warpgroup's softmax runs under two others'
  matrix products). In a 192-row tile a warpgroup releases the key blocks above its own diagonal unread;
- intra-warpgroup overlap: S_j = Q K_j^T and O += P_{j-1} V_{j-1} issued together, the softmax of S_j
  under the latter; P goes to the tensor cores from registers;
- causal: BLOCK_N = 128, and a warpgroup's diagonal key block is visited first, so the loop has no mask;
- persistent, dynamic schedule: one program per SM; the producer claims tiles from a counter in a plain
  grid's order and hands them over in shared memory, so the next tile's loads run under this one's end.
Measured and not kept (bench/NOTES.md v13, v15): FlashAttention-3's warpgroup ping-pong gave nothing; a
static round-robin of the tiles ran 7-13% below the dynamic schedule at N = 4k-8k.

Layouts: q (B, Hq, N, d), k and v (B, Hkv, N, d), any strides with a unit last one (4D TMA descriptors);
o in q's layout; LSE (B, Hq, N) float32 natural log. `bufs` below: the shared buffers and barriers.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ._runtime import device_ctx, empty_like_layout, ensure_scratch_allocator, strides


@gluon.jit
def _barriers(COUNT: gl.constexpr, ARRIVALS: gl.constexpr):
    """COUNT mbarriers in shared memory, each completing a phase after ARRIVALS arrivals (or one TMA
    transaction count)."""
    bars = gl.allocate_shared_memory(gl.int64, [COUNT, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(COUNT):
        mbarrier.init(bars.index(i), count=ARRIVALS)
    return bars


@gluon.jit
def _tile(t, n_mb, H_Q):
    """Tile t: (query block, batch, head). Tiles are numbered head by head, the longest query block of each
    head first: the order in which a plain grid's programs would start, so the programs running at once
    share one or two heads' K / V in the L2."""
    bh = t // n_mb
    return n_mb - 1 - t % n_mb, bh // H_Q, bh % H_Q


@gluon.jit
def _put_tile(tile_smem, tile_ready, tile_empty, n, t):
    """Producer: hand tile id t (its n-th) to both consumer warpgroups through a 2-slot ring."""
    slot = n % 2
    mbarrier.wait(tile_empty.index(slot), ((n // 2) & 1) ^ 1)
    tile_smem.index(slot).store(gl.full([1], t, gl.int32, layout=gl.BlockedLayout([1], [32], [1], [0])))
    mbarrier.arrive(tile_ready.index(slot), count=1)


@gluon.jit
def _get_tile(tile_smem, tile_ready, tile_empty, n):
    """Consumer warpgroup: the n-th tile id the producer handed over."""
    slot = n % 2
    mbarrier.wait(tile_ready.index(slot), (n // 2) & 1)
    t = gl.max(tile_smem.index(slot).load(gl.BlockedLayout([1], [32], [4], [0])), 0)
    mbarrier.arrive(tile_empty.index(slot), count=1)
    return t


@gluon.jit
def _load_q(q_desc, q_bufs, q_bars, qi, b, h, row):
    """Producer: TMA-load the 64 query rows row .. row + 63 of (b, h) into Q part qi."""
    mbarrier.expect(q_bars.index(qi), q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(
        q_desc, [b, h, row, 0], q_bars.index(qi), q_bufs.index(qi).reshape([1, 1, 64, q_bufs.shape[2]])
    )


@gluon.jit
def _loader(args, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, Q_BUFS: gl.constexpr, NC: gl.constexpr):
    """Producer (1 warp): takes tiles (pid, then the next unclaimed one from `counter`: programs that finish
    early take more) and hands each to the consumers; per tile, K of the last key block it needs, the NC
    64-row Q parts into Q set n % Q_BUFS once free, then V and the next K blocks down to block 0 into the
    ring (slot g % STAGES for the program's g-th key block) as all consumers free it."""
    q_desc, k_desc, v_desc, bufs, counter, pid, G, T, n_mb, H_Q, GROUP, N = args
    q_bufs, k_bufs, v_bufs, q_bars, q_empty, k_ready, k_empty, v_ready, v_empty, tiles = bufs
    tile_smem, tile_ready, tile_empty = tiles
    TM: gl.constexpr = 64 * NC
    n_kb = gl.cdiv(N, BLOCK_N)
    g = 0
    n = 0
    t = pid
    while t < T:
        _put_tile(tile_smem, tile_ready, tile_empty, n, t)
        t_next = G + gl.atomic_add(counter, 1)  # claimed now: its latency hides under this tile's loads
        mb, b, h = _tile(t, n_mb, H_Q)
        hk = h // GROUP
        if NC == 2:
            n_blocks = mb + 1  # 128-row tiles: the tile's diagonal block
        else:
            n_blocks = gl.minimum(gl.cdiv((mb + 1) * TM, BLOCK_N), n_kb)  # up to the last row's diagonal
        for j in range(n_blocks):
            slot = g % STAGES
            phase = (g // STAGES) & 1
            n0 = (n_blocks - 1 - j) * BLOCK_N  # the diagonal block first (see _consumer)
            # -- K_j: its slot is free once all consumers waited for the S that read it (barriers start
            #    with phase 1 complete, so the first pass does not wait)
            mbarrier.wait(k_empty.index(slot), phase ^ 1)
            mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(
                k_desc,
                [b, hk, n0, 0],
                k_ready.index(slot),
                k_bufs.index(slot).reshape([1, 1, BLOCK_N, k_bufs.shape[2]]),
            )
            if j == 0:
                # -- Q: warpgroup w's part of set n % Q_BUFS is free once w waited for its last S of
                #    tile n - Q_BUFS; a part past row N is not loaded, only signalled
                for w in gl.static_range(NC):
                    qi = (n % Q_BUFS) * NC + w
                    mbarrier.wait(q_empty.index(qi), ((n // Q_BUFS) & 1) ^ 1)
                    if NC == 2:  # 128-row tiles: the second part may lie past N (TMA zero-fills it)
                        _load_q(q_desc, q_bufs, q_bars, qi, b, h, mb * TM + w * 64)
                    elif mb * TM + w * 64 < N:
                        _load_q(q_desc, q_bufs, q_bars, qi, b, h, mb * TM + w * 64)
                    else:
                        mbarrier.arrive(q_bars.index(qi), count=1)
            # -- V_j: free once all consumers waited for the P V that read it
            mbarrier.wait(v_empty.index(slot), phase ^ 1)
            mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(
                v_desc,
                [b, hk, n0, 0],
                v_ready.index(slot),
                v_bufs.index(slot).reshape([1, 1, BLOCK_N, v_bufs.shape[2]]),
            )
            g += 1
        n += 1
        t = t_next
    _put_tile(tile_smem, tile_ready, tile_empty, n, t)  # t >= T: the consumers stop


@gluon.jit
def _softmax_step(
    s,
    m_i,
    l_i,
    qk_scale,
    r0,
    n0,
    MASK: gl.constexpr,
    BLOCK_N: gl.constexpr,
    s_layout: gl.constexpr,
    p_layout: gl.constexpr,
    DTYPE: gl.constexpr,
):
    """One online-softmax step (FlashAttention-2 Alg. 1, base 2) on the raw scores S_j (64 x BLOCK_N
    float32): P_j (bf16 / fp16, as the register A operand of the next P V), the rescale alpha of O, the new
    row max m and row sum l (both in scaled base-2 units). MASK: the diagonal block, where key c is visible
    to query row r iff c <= r."""
    if MASK:
        rows = r0 + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))
        cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(cols[None, :] <= rows[:, None], s, float("-inf"))
    # -- update m_i and l_i (the scale folded into one FFMA per score)
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    return gl.convert_layout(p.to(DTYPE), p_layout), alpha, m_new, l_i


@gluon.jit
def _kv_step(
    q_smem,
    ring,
    acc,
    p,
    m_i,
    l_i,
    j,
    r0,
    qk_scale,
    s_zero,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    s_layout: gl.constexpr,
    o_layout: gl.constexpr,
    p_layout: gl.constexpr,
):
    """Step j >= 1 of a tile (a full key block; j counts the program's key blocks, its ring position): S_j
    and P_{j-1} V_{j-1} issued together, the softmax of S_j under the latter."""
    k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty = ring
    slot = j % STAGES
    prev = (j - 1) % STAGES
    mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
    mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
    s = warpgroup_mma(q_smem, k_bufs.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    acc = warpgroup_mma(p, v_bufs.index(prev), acc, is_async=True)
    # S_j (the older group) done; P_{j-1} V_{j-1} still running
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
    mbarrier.arrive(k_empty.index(slot), count=1)
    p, alpha, m_i, l_i = _softmax_step(
        s, m_i, l_i, qk_scale, r0, 0, False, BLOCK_N, s_layout, p_layout, q_smem.dtype
    )
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(v_empty.index(prev), count=1)
    # -- O = diag(alpha) O: rescale to the new row max before P_j V_j is added
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    return acc, p, m_i, l_i


@gluon.jit
def _consumer(
    args,
    WG: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD_D: gl.constexpr,
    STAGES: gl.constexpr,
    Q_BUFS: gl.constexpr,
    NC: gl.constexpr,
):
    """Consumer warpgroup WG (4 warps) of NC: per tile, query rows 64 (NC mb + WG) .. + 63; S = Q K^T,
    online softmax, O += P V over key blocks r0 // 128 (its diagonal) down to 0. The tile's blocks above
    its diagonal (loaded for the tile's later rows when NC = 3) it releases unread; rows past N it skips."""
    bufs, O, LSE, stride_ob, stride_oh, stride_on, T, n_mb, H_Q, N, qk_scale = args
    q_bufs, k_bufs, v_bufs, q_bars, q_empty, k_ready, k_empty, v_ready, v_empty, tiles = bufs
    tile_smem, tile_ready, tile_empty = tiles
    ring = (k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty)
    out = (O, LSE, stride_ob, stride_oh, stride_on)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_D, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    TM: gl.constexpr = 64 * NC
    n_kb = gl.cdiv(N, BLOCK_N)
    g = 0  # key blocks this program has consumed (the ring's position)
    n = 0  # tiles
    t = _get_tile(tile_smem, tile_ready, tile_empty, 0)
    while t < T:
        mb, b, h = _tile(t, n_mb, H_Q)
        qi = (n % Q_BUFS) * NC + WG
        q_smem = q_bufs.index(qi)
        r0 = mb * TM + WG * 64
        if NC == 2:
            # 128-row tiles: both warpgroups read every block the producer loads, and row r0 < N
            mbarrier.wait(q_bars.index(qi), (n // Q_BUFS) & 1)
            g = _consume_rows(
                q_smem,
                ring,
                q_empty.index(qi),
                out,
                b,
                h,
                H_Q,
                N,
                r0,
                mb + 1,
                g,
                qk_scale,
                BLOCK_N,
                HEAD_D,
                STAGES,
                s_layout,
                o_layout,
                p_layout,
            )
        else:
            n_tile = gl.minimum(gl.cdiv((mb + 1) * TM, BLOCK_N), n_kb)  # the blocks the producer loads
            n_blocks = 0
            if r0 < N:
                n_blocks = r0 // BLOCK_N + 1  # 64 rows never straddle two 128-key blocks
            # -- blocks above this warpgroup's diagonal: release them unread, in the ring's order
            for j in range(n_tile - n_blocks):
                slot = (g + j) % STAGES
                mbarrier.wait(k_ready.index(slot), ((g + j) // STAGES) & 1)
                mbarrier.arrive(k_empty.index(slot), count=1)
                mbarrier.wait(v_ready.index(slot), ((g + j) // STAGES) & 1)
                mbarrier.arrive(v_empty.index(slot), count=1)
            g += n_tile - n_blocks
            mbarrier.wait(q_bars.index(qi), (n // Q_BUFS) & 1)
            if n_blocks > 0:
                g = _consume_rows(
                    q_smem,
                    ring,
                    q_empty.index(qi),
                    out,
                    b,
                    h,
                    H_Q,
                    N,
                    r0,
                    n_blocks,
                    g,
                    qk_scale,
                    BLOCK_N,
                    HEAD_D,
                    STAGES,
                    s_layout,
                    o_layout,
                    p_layout,
                )
            else:
                mbarrier.arrive(q_empty.index(qi), count=1)
        n += 1
        t = _get_tile(tile_smem, tile_ready, tile_empty, n)


@gluon.jit
def _consume_rows(
    q_smem,
    ring,
    q_free,
    out,
    b,
    h,
    H_Q,
    N,
    r0,
    n_blocks,
    g,
    qk_scale,
    BLOCK_N: gl.constexpr,
    HEAD_D: gl.constexpr,
    STAGES: gl.constexpr,
    s_layout: gl.constexpr,
    o_layout: gl.constexpr,
    p_layout: gl.constexpr,
):
    """One warpgroup's 64 query rows r0 .. r0 + 63 of one (batch, head) over key blocks n_blocks - 1 (the
    diagonal) down to 0, ring positions g .. g + n_blocks - 1 (Q resident in q_smem, released through
    q_free after the last Q K^T); stores O and LSE. Returns the ring position after."""
    k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty = ring
    O, LSE, stride_ob, stride_oh, stride_on = out
    dtype: gl.constexpr = q_smem.dtype
    s_zero = gl.zeros([64, BLOCK_N], gl.float32, layout=s_layout)
    m_i = gl.full([64], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.full([64], 0.0, gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([64, HEAD_D], gl.float32, layout=o_layout)

    # -- step 0: the diagonal key block (the last one), masked; FlashAttention-3 also walks the keys
    #    from the diagonal down, so that no later step needs a mask or a branch
    slot = g % STAGES
    mbarrier.wait(k_ready.index(slot), (g // STAGES) & 1)
    s = warpgroup_mma(q_smem, k_bufs.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    mbarrier.arrive(k_empty.index(slot), count=1)
    p, alpha, m_i, l_i = _softmax_step(
        s, m_i, l_i, qk_scale, r0, (n_blocks - 1) * BLOCK_N, True, BLOCK_N, s_layout, p_layout, dtype
    )

    # -- steps 1 .. mb: key blocks mb - 1 down to 0, all full
    for j in range(1, n_blocks):
        acc, p, m_i, l_i = _kv_step(
            q_smem,
            ring,
            acc,
            p,
            m_i,
            l_i,
            g + j,
            r0,
            qk_scale,
            s_zero,
            BLOCK_N,
            STAGES,
            s_layout,
            o_layout,
            p_layout,
        )
    # every Q K^T of this tile has been waited for: the producer may load the next tile's Q
    mbarrier.arrive(q_free, count=1)

    # -- O += P V of the last step (key block 0)
    slot = (g + n_blocks - 1) % STAGES
    mbarrier.wait(v_ready.index(slot), ((g + n_blocks - 1) // STAGES) & 1)
    acc = warpgroup_mma(p, v_bufs.index(slot), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(v_empty.index(slot), count=1)
    g += n_blocks

    # -- epilogue: O = acc / l, LSE = (m + log2 l) ln 2 (m is in scaled base-2 units); rows past N are
    #    not stored. The producer is already loading the next tile meanwhile.
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    out = (acc / l_o[:, None]).to(dtype)
    rows_o = r0 + gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout))
    cols_o = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = O + b * stride_ob + h * stride_oh + rows_o[:, None] * stride_on + cols_o[None, :]
    gl.store(o_ptrs, out, mask=rows_o[:, None] < N)
    rows_s = r0 + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
    gl.store(LSE + (b * H_Q + h) * N + rows_s, lse, mask=rows_s < N)
    return g


@gluon.jit
def _head_major_descriptor(
    base, B, H, N, stride_b, stride_h, stride_n, BLOCK: gl.constexpr, HEAD_D: gl.constexpr
):
    """A 4D TMA descriptor over ``base`` ((B, H, N, d), last stride 1): 1 x 1 x BLOCK x d tiles, zero-filled
    past row N of each head. Built on the device (Triton's scratch allocator), once per program."""
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, 1, BLOCK, HEAD_D], base.dtype.element_ty)
    return tma.make_tensor_descriptor(
        base, [B, H, N, HEAD_D], [stride_b, stride_h, stride_n, 1], [1, 1, BLOCK, HEAD_D], layout
    )


@gluon.jit
def _fwd_ws_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    COUNTER,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_ob,
    stride_oh,
    stride_on,
    B,
    H_Q,
    H_KV,
    N,
    qk_scale,
    HEAD_D: gl.constexpr,
    STAGES: gl.constexpr,
    Q_BUFS: gl.constexpr,
    NC: gl.constexpr,
    REGS: gl.constexpr,
):
    """Causal forward, persistent: G programs (one per SM) take tiles (64 NC query rows of one (batch,
    head), `_tile`) until none is left; the ring of K / V carries over from tile to tile, so the producer
    loads the next tile under this one's last steps and epilogue. COUNTER: one int32, zero at launch (the
    tiles claimed after the first G). qk_scale = softmax_scale * log2(e) (exp2 with the scale folded
    in). NC consumer warpgroups (2 or 3) with REGS registers each. Launch with num_warps=4 (the default
    partition is consumer warpgroup 0) and maxnreg=MAXNREG[NC]."""
    BLOCK_N: gl.constexpr = 128
    pid = gl.program_id(0)
    G = gl.num_programs(0)
    n_mb = gl.cdiv(N, 64 * NC)
    T = B * H_Q * n_mb
    dtype: gl.constexpr = Q.dtype.element_ty

    # -- 4D TMA descriptors (batch, head, position, d), zero past row N
    q_desc = _head_major_descriptor(Q, B, H_Q, N, stride_qb, stride_qh, stride_qn, 64, HEAD_D)
    k_desc = _head_major_descriptor(K, B, H_KV, N, stride_kb, stride_kh, stride_kn, BLOCK_N, HEAD_D)
    v_desc = _head_major_descriptor(V, B, H_KV, N, stride_vb, stride_vh, stride_vn, BLOCK_N, HEAD_D)

    layout_q: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, HEAD_D], dtype)
    layout_kv: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_D], dtype)
    q_bufs = gl.allocate_shared_memory(dtype, [NC * Q_BUFS, 64, HEAD_D], layout_q)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], layout_kv)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], layout_kv)
    tile_smem = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_bars, q_empty = _barriers(NC * Q_BUFS, 1), _barriers(NC * Q_BUFS, 1)
    k_ready, v_ready = _barriers(STAGES, 1), _barriers(STAGES, 1)
    k_empty, v_empty = _barriers(STAGES, NC), _barriers(STAGES, NC)  # every consumer releases a slot
    tile_ready, tile_empty = _barriers(2, 1), _barriers(2, NC)

    GROUP = H_Q // H_KV
    tiles = (tile_smem, tile_ready, tile_empty)
    bufs = (q_bufs, k_bufs, v_bufs, q_bars, q_empty, k_ready, k_empty, v_ready, v_empty, tiles)
    consumer = (bufs, O, LSE, stride_ob, stride_oh, stride_on, T, n_mb, H_Q, N, qk_scale)
    loader = (q_desc, k_desc, v_desc, bufs, COUNTER, pid, G, T, n_mb, H_Q, GROUP, N)
    # the default partition is consumer 0, then the other consumers and the producer warp. The partition
    # list must be a literal, and the constexprs must be passed in it (a tuple built beforehand loses their
    # constexpr-ness, triton 3.6): one call per consumer count
    if NC == 3:
        gl.warp_specialize(
            [
                (_consumer, (consumer, 0, BLOCK_N, HEAD_D, STAGES, Q_BUFS, NC)),
                (_consumer, (consumer, 1, BLOCK_N, HEAD_D, STAGES, Q_BUFS, NC)),
                (_consumer, (consumer, 2, BLOCK_N, HEAD_D, STAGES, Q_BUFS, NC)),
                (_loader, (loader, BLOCK_N, STAGES, Q_BUFS, NC)),
            ],
            [4, 4, 1],
            [REGS, REGS, 24],
        )
    else:
        gl.warp_specialize(
            [
                (_consumer, (consumer, 0, BLOCK_N, HEAD_D, STAGES, Q_BUFS, NC)),
                (_consumer, (consumer, 1, BLOCK_N, HEAD_D, STAGES, Q_BUFS, NC)),
                (_loader, (loader, BLOCK_N, STAGES, Q_BUFS, NC)),
            ],
            [4, 1],
            [REGS, 24],
        )


# head_dim -> K/V ring stages, Q sets (a second set lets the producer load the next tile's Q before this
# tile's last Q K^T) and consumer warpgroups; shared memory = Q_BUFS * NC * 64 * d (Q) + 2 * STAGES * 128 * d
# (K, V) bf16: d = 64: 216 KiB at 6 stages, 1 set, 3 consumers; d = 128: 160 KiB at 2 stages, 1 set, 2
# consumers (H200 A/B, NOTES v13: 6 over 4 stages +1.6-2.9% at d = 64, 3 stages at d = 128 level; v15: 2 Q
# sets +1-4% at d = 64 with 2 consumers, level or -1-2% at d = 128; v17: 3 consumers +6-12% at d = 64 from
# 2k, where a third Q part leaves room for 6 stages and 1 set only; at d = 128 3 x 64 rows x 128 registers
# of O cannot fit next to S and P)
STAGES = {64: 6, 128: 2}
Q_BUFS = {64: 1, 128: 1}
CONSUMERS = {64: 3, 128: 2}
# consumer warpgroups -> kernel-wide registers per thread (the launch's maxnreg) and each consumer's (raised
# with setmaxnreg; the producer warp's group gets 24): 12 warps 240 + 240 + 24, 16 warps 160 x 3 + 24
NUM_WARPS, MAXNREG, REGS = 4, {2: 168, 3: 128}, {2: 240, 3: 160}


def _tma_strides(t: Tensor) -> list[int]:
    """t's strides of (B, H, N) for a TMA descriptor: a dim of size 1 is never stepped, so its stride
    (which may be anything in a view) is replaced by a legal one (a multiple of 16 bytes)."""
    legal = 16 // t.element_size()
    return [st if n > 1 else legal for n, st in zip(t.shape[:3], t.stride()[:3], strict=True)]


def fwd_launch(q, k, v, o, lse, softmax_scale: float) -> None:
    """Fill o (laid out as q) and lse (B, Hq, N) float32 natural log for inputs `plan.plan_fwd` accepts: one
    persistent program per SM (or per tile, if fewer)."""
    B, Hq, N, d = (int(x) for x in q.shape)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count  # torch caches the properties
    nc = CONSUMERS[d]
    grid = (min(sms, triton.cdiv(N, 64 * nc) * B * Hq),)
    counter = torch.zeros(1, dtype=torch.int32, device=q.device)
    _fwd_ws_kernel[grid](
        q, k, v, o, lse, counter, *_tma_strides(q), *_tma_strides(k), *_tma_strides(v), *strides(o),
        B, Hq, int(k.shape[1]), N, softmax_scale * 1.4426950408889634, HEAD_D=d, STAGES=STAGES[d],
        Q_BUFS=Q_BUFS[d], NC=nc, REGS=REGS[nc], num_warps=NUM_WARPS, maxnreg=MAXNREG[nc],
    )  # fmt: skip


def run(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float) -> tuple[Tensor, Tensor]:
    """(o, lse) of the causal forward; eager calls launch through this, traced ones through `forward`."""
    ensure_scratch_allocator()  # the device-side TMA descriptors live in Triton's global scratch
    o = empty_like_layout(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    with device_ctx(q):
        fwd_launch(q, k, v, o, lse, softmax_scale)
    return o, lse


# An opaque custom op: Inductor cannot trace a Gluon kernel into its graph (it re-emits user kernels as
# @triton.jit source, where Gluon's annotations fail: NOTES v9), so a compiled graph calls this op.
forward = torch.library.custom_op("flashgpt::flash_attn_fwd_sm90", run, mutates_args=())


@forward.register_fake
def _forward_fake(q, k, v, softmax_scale):
    return empty_like_layout(q), q.new_empty(q.shape[:3], dtype=torch.float32)
