"""Triton kernels of our FlashAttention-2 (Dao 2023, section 3.1 forward, 3.2 backward: dQ with Delta, then
dK/dV), with the online softmax of Milakov & Gimelshein (2018). Written from the papers.

Conventions of every kernel:
* q (B, Hq, Nq, d), k/v (B, Hkv, Nk, d), any strides with a unit last one, k and v (and dk and dv) the
  same ones; LSE and Delta contiguous float32 (B, Hq, Nq). GQA: query head h reads KV head h // GROUP.
* Scores in base 2: s2 = (q . k) * scale * log2(e), exp2 throughout; LSE stored in natural-log units.
  Soft-capping: softcap = c * log2(e), scores (q . k) * scale / c into `_softcap`, dS takes 1 - tanh^2.
* Variants are on when their argument is given: window, Q_DOC (documents), SEED (dropout), softcap; None
  compiles them out (Triton specialises None arguments as constants).
* Causal bottom-right: query i sees key j iff j <= i + (Nk - Nq); a row that sees no key gets o = 0,
  lse = -inf and zero gradients. Blocks above the diagonal are skipped by the loop bounds; only the
  diagonal and sequence-end blocks compute a mask.
* d padded to BLOCK_D with masked loads (EVEN_D = HEAD_DIM == BLOCK_D skips them); batch/head offsets in
  int64.
* No atomics: each output element has one writer, so the backward is deterministic.
* The launched kernels take every stride and scalar as an argument of its own: torch.compile (2.13) cannot
  emit a captured launch (`wrap_triton`) with a tuple of runtime values. The inner loops get them grouped.
"""

import triton
import triton.language as tl

from ._triton_common import (
    _dropout_keep,
    _edge_block,
    _key_block_range,
    _load_tile,
    _philox_seed,
    _query_block_range,
    _row_max,
    _row_sum,
    _scale_log2,
    _score_keep,
    _softcap,
    _store_tile,
    _variant_args,
)

# ---------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------


@triton.jit
def _fwd_inner(
    acc,
    m_i,
    l_i,
    q,
    k_base,
    v_base,
    lo,
    hi,
    mask_from,
    offs_m,
    offs_n,
    offs_d,
    mask_d,
    N_Q,
    N_K,
    scale_log2,
    stride_kn,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    variant,
    VARIANT_FLAGS: tl.constexpr,
):
    """Stream key/value blocks [lo, hi) through the online softmax of one query block.

    `variant`: (mask_lo, doc_lo, doc_hi, window, seed_lo, seed_hi, bh, dropout_p, softcap), placeholders where
    VARIANT_FLAGS (HAS_WINDOW, HAS_DOC, HAS_DROPOUT, SOFTCAP) is off. MASKED: blocks from `mask_from` (and
    before `mask_lo`) are masked. Dropout acts after the row sums (the LSE is the undropped one). One loop,
    not one per part: two pipelined loops carrying the accumulator make ptxas serialise every wgmma (C7515,
    bench/NOTES.md v5).
    """
    mask_lo, doc_lo, doc_hi, window, seed_lo, seed_hi, bh, dropout_p, softcap = variant
    HAS_WINDOW: tl.constexpr = VARIANT_FLAGS[0]
    HAS_DOC: tl.constexpr = VARIANT_FLAGS[1]
    HAS_DROPOUT: tl.constexpr = VARIANT_FLAGS[2]
    SOFTCAP: tl.constexpr = VARIANT_FLAGS[3]
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < N_K
        start_64 = tl.cast(start_n, tl.int64)
        k_ptrs = k_base + start_64 * stride_kn + (offs_n[:, None] * stride_kn + offs_d[None, :])
        k = _load_tile(k_ptrs, col_ok, mask_d, not EVEN_N, not EVEN_D)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if SOFTCAP:
            qk, _ = _softcap(qk, softcap)
        if MASKED:
            if _edge_block(start_n, mask_lo, mask_from, HAS_WINDOW or HAS_DOC, True):
                valid = _score_keep(
                    offs_m[:, None],
                    cols[None, :],
                    doc_lo,
                    doc_hi,
                    N_Q,
                    N_K,
                    window,
                    CAUSAL,
                    HAS_WINDOW,
                    HAS_DOC,
                )
                qk = tl.where(valid, qk, float("-inf"))
        m_new = tl.maximum(m_i, _row_max(qk))
        if MASKED:
            # a row with no visible key so far keeps m = -inf; use 0 as the shift so that
            # exp2(-inf - shift) = 0 instead of exp2(-inf + inf) = NaN
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_shift = m_new
        alpha = tl.math.exp2(m_i - m_shift)
        p = tl.math.exp2(qk - m_shift[:, None])
        l_i = l_i * alpha + _row_sum(p)
        if HAS_DROPOUT:
            p = tl.where(
                _dropout_keep(seed_lo, seed_hi, offs_m[:, None], cols[None, :], bh, dropout_p),
                p * (1.0 / (1.0 - dropout_p)),
                0.0,
            )
        v_ptrs = v_base + start_64 * stride_kn + (offs_n[:, None] * stride_kn + offs_d[None, :])
        v = _load_tile(v_ptrs, col_ok, mask_d, not EVEN_N, not EVEN_D)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_ob,
    stride_oh,
    stride_om,
    H_Q,
    GROUP,
    N_Q,
    N_K,
    HEAD_DIM: tl.constexpr,
    softmax_scale,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    Q_DOC=None,
    SEED=None,
    window=None,
    dropout_p=0.0,
    softcap=None,
):
    """FlashAttention-2 forward (section 3.1). Grid (cdiv(Nq, BLOCK_M), Hq, B). Q_DOC int32 (2, B, Nq): each
    query row's document key range; SEED int64 (1,). K and V share strides (the launcher makes them)."""
    HAS_WINDOW: tl.constexpr = window is not None
    HAS_DOC: tl.constexpr = Q_DOC is not None
    HAS_DROPOUT: tl.constexpr = SEED is not None
    SOFTCAP: tl.constexpr = softcap is not None
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    scale_log2 = _scale_log2(softmax_scale, softcap)
    if SOFTCAP:
        softcap = tl.cast(softcap, tl.float32)
    pid_m = tl.program_id(0)
    if CAUSAL:
        # later query blocks see more keys: schedule them first (less tail imbalance)
        pid_m = tl.num_programs(0) - 1 - pid_m
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    hk = h // GROUP
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < N_Q
    mask_d = offs_d < HEAD_DIM

    m0_64 = tl.cast(m0, tl.int64)
    q_base = Q + b * stride_qb + h * stride_qh + m0_64 * stride_qm
    q_ptrs = q_base + tl.arange(0, BLOCK_M)[:, None] * stride_qm + offs_d[None, :]
    q = _load_tile(q_ptrs, mask_m, mask_d, not EVEN_M, not EVEN_D)

    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_kb + hk * stride_kh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)

    doc_lo, doc_hi, doc_lo_ptr, doc_hi_ptr, seed_lo, seed_hi, dropout_p = _variant_args(
        Q_DOC, SEED, b, offs_m, mask_m, N_Q, dropout_p, HAS_DOC, HAS_DROPOUT
    )
    lo, full_lo, full_end, hi = _key_block_range(
        m0, N_Q, N_K, window, doc_lo_ptr, doc_hi_ptr, CAUSAL, HAS_WINDOW, HAS_DOC, BLOCK_M, BLOCK_N
    )
    # key blocks [full_lo, full_end) without mask arithmetic; the diagonal / window / document / sequence-end
    # blocks masked
    acc, m_i, l_i = _fwd_inner(
        acc,
        m_i,
        l_i,
        q,
        k_base,
        v_base,
        lo,
        hi,
        full_end,
        offs_m,
        offs_n,
        offs_d,
        mask_d,
        N_Q,
        N_K,
        scale_log2,
        stride_kn,
        CAUSAL or not EVEN_N or HAS_WINDOW or HAS_DOC,
        CAUSAL,
        BLOCK_N,
        EVEN_N,
        EVEN_D,
        DOT_PRECISION,
        (full_lo, doc_lo, doc_hi, window, seed_lo, seed_hi, b * H_Q + h, dropout_p, softcap),
        (HAS_WINDOW, HAS_DOC, HAS_DROPOUT, SOFTCAP),
    )

    has_key = l_i > 0.0
    l_safe = tl.where(has_key, l_i, 1.0)
    o = acc / l_safe[:, None]
    o_base = O + b * stride_ob + h * stride_oh + m0_64 * stride_om
    o_ptrs = o_base + tl.arange(0, BLOCK_M)[:, None] * stride_om + offs_d[None, :]
    _store_tile(o_ptrs, o.to(O.dtype.element_ty), mask_m, mask_d, not EVEN_M, not EVEN_D)
    # natural-log LSE: (m + log2 l) * ln 2 ; -inf for rows that see no key
    lse = tl.where(has_key, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    lse_ptrs = LSE + (b * H_Q + h) * N_Q + offs_m
    if EVEN_M:
        tl.store(lse_ptrs, lse)
    else:
        tl.store(lse_ptrs, lse, mask=mask_m)


# ---------------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------------


@triton.jit
def _load_row_stats(LSE, DELTA, row_ptr, mask_rows):
    """LSE converted to base 2 (+inf for rows that see no key or are padding, so P = 0) and Delta."""
    lse = tl.load(LSE + row_ptr, mask=mask_rows, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(DELTA + row_ptr, mask=mask_rows, other=0.0)
    return lse2, delta


@triton.jit
def _bwd_dkdv_inner(
    dk,
    dv,
    k,
    v,
    q_src,
    do_src,
    stat_base,
    LSE,
    DELTA,
    lo,
    hi,
    mask_to,
    offs_m,
    offs_n,
    offs_d,
    mask_d,
    N_Q,
    N_K,
    scale_log2,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
    variant,
    VARIANT_FLAGS: tl.constexpr,
):
    """Accumulate dV += P^T dO and dK += dS^T Q over query blocks [lo, hi) of one query head.

    MASKED: blocks before `mask_to` (the diagonal) and from `variant`'s mask_from (window / document end)
    are masked; one loop, as `_fwd_inner`. q_src / do_src: (base pointer, row stride, tensor descriptor or
    None, its row and column of this head). USE_TMA only with EVEN_M: past N_Q a descriptor reads the next
    head's data, whose non-finite values would leak in through 0 * inf. `variant` as in `_fwd_inner`, with
    the rows' document range pointers; with dropout dV uses the dropped P, dS = P (Z dP / (1 - p) - Delta).
    """
    q_base, stride_qm, QD, q_row, q_col = q_src
    do_base, stride_dom, DOD, do_row, do_col = do_src
    mask_from, Q_DOC_LO, Q_DOC_HI, window, seed_lo, seed_hi, bh, dropout_p, softcap = variant
    HAS_WINDOW: tl.constexpr = VARIANT_FLAGS[0]
    HAS_DOC: tl.constexpr = VARIANT_FLAGS[1]
    HAS_DROPOUT: tl.constexpr = VARIANT_FLAGS[2]
    SOFTCAP: tl.constexpr = VARIANT_FLAGS[3]
    tl.static_assert(EVEN_M or not USE_TMA, "TMA loads need N_Q % BLOCK_M == 0")
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        mask_r = rows < N_Q
        if USE_TMA:
            q = QD.load([q_row + start_m, q_col])
            do = DOD.load([do_row + start_m, do_col])
        else:
            start_64 = tl.cast(start_m, tl.int64)
            q_ptrs = q_base + start_64 * stride_qm + offs_m[:, None] * stride_qm + offs_d[None, :]
            q = _load_tile(q_ptrs, mask_r, mask_d, not EVEN_M, not EVEN_D)
            do_ptrs = do_base + start_64 * stride_dom + offs_m[:, None] * stride_dom + offs_d[None, :]
            do = _load_tile(do_ptrs, mask_r, mask_d, not EVEN_M, not EVEN_D)
        lse2, delta = _load_row_stats(LSE, DELTA, stat_base + rows, mask_r)
        # transposed scores: (BLOCK_N keys, BLOCK_M queries)
        qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * scale_log2
        if SOFTCAP:
            qk_t, tanh_t = _softcap(qk_t, softcap)
        p_t = tl.math.exp2(qk_t - lse2[None, :])
        if MASKED:
            if _edge_block(start_m, mask_to, mask_from, True, HAS_WINDOW or HAS_DOC):
                if HAS_DOC:
                    doc_lo = tl.load(Q_DOC_LO + rows, mask=mask_r, other=0)[None, :]
                    doc_hi = tl.load(Q_DOC_HI + rows, mask=mask_r, other=0)[None, :]
                else:
                    doc_lo = 0
                    doc_hi = 0
                p_t = tl.where(
                    _score_keep(
                        rows[None, :],
                        offs_n[:, None],
                        doc_lo,
                        doc_hi,
                        N_Q,
                        N_K,
                        window,
                        CAUSAL,
                        HAS_WINDOW,
                        HAS_DOC,
                        False,
                    ),
                    p_t,
                    0.0,
                )
        if HAS_DROPOUT:
            keep_t = _dropout_keep(seed_lo, seed_hi, rows[None, :], offs_n[:, None], bh, dropout_p)
            pd_t = tl.where(keep_t, p_t * (1.0 / (1.0 - dropout_p)), 0.0)
        else:
            pd_t = p_t
        dv = tl.dot(pd_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        if HAS_DROPOUT:
            dp_t = tl.where(keep_t, dp_t * (1.0 / (1.0 - dropout_p)), 0.0)
        ds_t = p_t * (dp_t - delta[None, :])
        if SOFTCAP:
            ds_t = ds_t * (1.0 - tanh_t * tanh_t)  # d c tanh(s / c) / ds
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _tma_operand(
    base, stride_h, stride_n, H, N, LAYOUT: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr
):
    """A (B, H, N, d) operand as one 2-D tensor descriptor: (descriptor, row_b, row_h, col_h) as in
    `plan.tma_operand`; LAYOUT 1: heads contiguous, 2: a fused qkv projection's (B, N, H, d) memory."""
    if LAYOUT == 1:
        rows = tl.num_programs(2) * H * N
        cols = BLOCK_D
        row_b = H * N
        row_h = N
        col_h = 0
    else:
        rows = tl.num_programs(2) * N
        cols = (H - 1) * stride_h + BLOCK_D
        row_b = N
        row_h = 0
        col_h = stride_h
    return _tma_descriptor(base, rows, cols, stride_n, BLOCK_ROWS, BLOCK_D), row_b, row_h, col_h


@triton.jit
def _tma_descriptor(base, rows, cols, row_stride, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """2-D tensor descriptor over `rows` x `cols` from `base`, built on the device: no host work per launch,
    and capturable by torch.compile and CUDA graphs (it needs the scratch allocator `_runtime` installs)."""
    return tl.make_tensor_descriptor(
        base, shape=[rows, cols], strides=[row_stride, 1], block_shape=[BLOCK_ROWS, BLOCK_D]
    )


@triton.jit
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dkb,
    stride_dkh,
    stride_dkn,
    H_Q,
    GROUP,
    N_Q,
    N_K,
    HEAD_DIM: tl.constexpr,
    softmax_scale,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TMA_Q: tl.constexpr,
    TMA_DO: tl.constexpr,
    Q_DOC=None,
    K_DOC=None,
    SEED=None,
    window=None,
    dropout_p=0.0,
    softcap=None,
    kv_step=0,
):
    """dK, dV of one key block (section 3.2, Algorithm 2), over the GROUP query heads of its KV head and
    the query blocks that see it. Grid (cdiv(Nk, BLOCK_N), Hkv, B). TMA_Q / TMA_DO: 0 pointer loads, else
    `_tma_operand`'s layout. K_DOC int32 (2, B, Nk): each key's document query range. K and V share
    strides, and so do dK and dV. Packed d(qkv): DV is None and dK, dV go one and two kv_step past DK (one
    buffer, which a compiled graph clones whole).
    """
    HAS_WINDOW: tl.constexpr = window is not None
    HAS_DOC: tl.constexpr = Q_DOC is not None
    HAS_DROPOUT: tl.constexpr = SEED is not None
    SOFTCAP: tl.constexpr = softcap is not None
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    scale_log2 = _scale_log2(softmax_scale, softcap)
    softmax_scale = tl.cast(softmax_scale, tl.float32)  # Inductor passes Python floats as fp64
    if SOFTCAP:
        softcap = tl.cast(softcap, tl.float32)
    if DV is None:
        DV = DK + 2 * kv_step
    DK = DK + kv_step
    pid_n = tl.program_id(0)
    hk = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    n0 = pid_n * BLOCK_N
    n0_64 = tl.cast(n0, tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_n = offs_n < N_K
    mask_d = offs_d < HEAD_DIM

    # -- load K_j, V_j of this block once; dK_j, dV_j accumulate in float32 registers
    tile_n = tl.arange(0, BLOCK_N)[:, None]
    k_ptrs = K + b * stride_kb + hk * stride_kh + n0_64 * stride_kn + tile_n * stride_kn + offs_d[None, :]
    k = _load_tile(k_ptrs, mask_n, mask_d, not EVEN_N, not EVEN_D)
    v_ptrs = V + b * stride_kb + hk * stride_kh + n0_64 * stride_kn + tile_n * stride_kn + offs_d[None, :]
    v = _load_tile(v_ptrs, mask_n, mask_d, not EVEN_N, not EVEN_D)
    dk = tl.full([BLOCK_N, BLOCK_D], 0.0, dtype=tl.float32)
    dv = tl.full([BLOCK_N, BLOCK_D], 0.0, dtype=tl.float32)

    if CAUSAL:
        delta_qk = N_K - N_Q
        # first query that sees key n0 is n0 - delta_qk; blocks before it are skipped
        start_m = (tl.maximum(n0 - delta_qk, 0) // BLOCK_M) * BLOCK_M
        # query blocks starting at or after the first row that sees the whole key block are unmasked
        full_start = tl.maximum(n0 + BLOCK_N - 1 - delta_qk, 0)
        full_start = ((full_start + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
        full_start = tl.maximum(tl.minimum(full_start, ((N_Q + BLOCK_M - 1) // BLOCK_M) * BLOCK_M), start_m)
    else:
        start_m = 0
        full_start = 0
    if HAS_DOC:  # (2, B, N) int32: lo of batch element b at b * N, hi at (B + b) * N
        q_doc_lo = Q_DOC + b * N_Q
        q_doc_hi = Q_DOC + (tl.num_programs(2) + b) * N_Q
        k_doc_lo = K_DOC + b * N_K
        k_doc_hi = K_DOC + (tl.num_programs(2) + b) * N_K
    else:  # unused placeholders
        q_doc_lo = 0
        q_doc_hi = 0
        k_doc_lo = 0
        k_doc_hi = 0
    if HAS_DROPOUT:
        seed_lo, seed_hi = _philox_seed(SEED)
        dropout_p = tl.cast(dropout_p, tl.float32)
    else:
        seed_lo = 0
        seed_hi = 0
    start_m, full_start, full_end, hi = _query_block_range(
        n0, start_m, full_start, N_Q, N_K, window, k_doc_lo, k_doc_hi, HAS_WINDOW, HAS_DOC, BLOCK_M, BLOCK_N
    )

    if TMA_Q:
        QD, row_qb, row_qh, col_qh = _tma_operand(Q, stride_qh, stride_qm, H_Q, N_Q, TMA_Q, BLOCK_M, BLOCK_D)
        DOD, row_dob, row_doh, col_doh = _tma_operand(
            DO, stride_doh, stride_dom, H_Q, N_Q, TMA_DO, BLOCK_M, BLOCK_D
        )
    else:  # pointer loads, no descriptors: constexpr None (a tuple cannot hold an assigned, plain None)
        QD: tl.constexpr = None
        DOD: tl.constexpr = None
        row_qb, row_qh, col_qh, row_dob, row_doh, col_doh = 0, 0, 0, 0, 0, 0
    for g in range(GROUP):
        h = hk * GROUP + g
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        stat_base = (b * H_Q + h) * N_Q
        # descriptor coordinates (int32; only used when USE_TMA)
        q_row = (b * row_qb + h * row_qh).to(tl.int32)
        q_col = (h * col_qh).to(tl.int32)
        do_row = (b * row_dob + h * row_doh).to(tl.int32)
        do_col = (h * col_doh).to(tl.int32)
        # -- for each query block i that sees key block j: dV_j += P_ij^T dO_i, dK_j += dS_ij^T Q_i;
        # blocks [start_m, full_start) straddle the diagonal (masked), the later ones see all of j
        dk, dv = _bwd_dkdv_inner(
            dk,
            dv,
            k,
            v,
            (q_base, stride_qm, QD, q_row, q_col),
            (do_base, stride_dom, DOD, do_row, do_col),
            stat_base,
            LSE,
            DELTA,
            start_m,
            hi,
            full_start,
            offs_m,
            offs_n,
            offs_d,
            mask_d,
            N_Q,
            N_K,
            scale_log2,
            CAUSAL or HAS_WINDOW or HAS_DOC,
            CAUSAL,
            BLOCK_M,
            EVEN_M,
            EVEN_D,
            DOT_PRECISION,
            TMA_Q > 0,
            (full_end, q_doc_lo, q_doc_hi, window, seed_lo, seed_hi, b * H_Q + h, dropout_p, softcap),
            (HAS_WINDOW, HAS_DOC, HAS_DROPOUT, SOFTCAP),
        )

    # -- write dK_j (scaled: S = scale * Q K^T) and dV_j
    dk = dk * softmax_scale
    dk_ptrs = DK + b * stride_dkb + hk * stride_dkh + n0_64 * stride_dkn + tile_n * stride_dkn
    _store_tile(dk_ptrs + offs_d[None, :], dk.to(DK.dtype.element_ty), mask_n, mask_d, not EVEN_N, not EVEN_D)
    dv_ptrs = DV + b * stride_dkb + hk * stride_dkh + n0_64 * stride_dkn + tile_n * stride_dkn
    _store_tile(dv_ptrs + offs_d[None, :], dv.to(DV.dtype.element_ty), mask_n, mask_d, not EVEN_N, not EVEN_D)


@triton.jit
def _bwd_dq_inner(
    dq,
    q,
    do,
    lse2,
    delta,
    k_src,
    v_src,
    lo,
    hi,
    mask_from,
    offs_m,
    offs_n,
    offs_d,
    mask_d,
    N_Q,
    N_K,
    scale_log2,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
    variant,
    VARIANT_FLAGS: tl.constexpr,
):
    """Accumulate dQ += dS K over key blocks [lo, hi) (scaled by the caller). MASKED and `variant` as in
    `_fwd_inner`, k_src / v_src and USE_TMA (only with EVEN_N) as q_src in `_bwd_dkdv_inner`."""
    k_base, stride_kn, KD, k_row, k_col = k_src
    v_base, VD = v_src  # V shares K's strides and descriptor coordinates
    mask_lo, doc_lo, doc_hi, window, seed_lo, seed_hi, bh, dropout_p, softcap = variant
    HAS_WINDOW: tl.constexpr = VARIANT_FLAGS[0]
    HAS_DOC: tl.constexpr = VARIANT_FLAGS[1]
    HAS_DROPOUT: tl.constexpr = VARIANT_FLAGS[2]
    SOFTCAP: tl.constexpr = VARIANT_FLAGS[3]
    tl.static_assert(EVEN_N or not USE_TMA, "TMA loads need N_K % BLOCK_N == 0")
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < N_K
        if USE_TMA:
            k = KD.load([k_row + start_n, k_col])
            v = VD.load([k_row + start_n, k_col])
        else:
            start_64 = tl.cast(start_n, tl.int64)
            k_ptrs = k_base + start_64 * stride_kn + (offs_n[:, None] * stride_kn + offs_d[None, :])
            k = _load_tile(k_ptrs, col_ok, mask_d, not EVEN_N, not EVEN_D)
            v_ptrs = v_base + start_64 * stride_kn + (offs_n[:, None] * stride_kn + offs_d[None, :])
            v = _load_tile(v_ptrs, col_ok, mask_d, not EVEN_N, not EVEN_D)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if SOFTCAP:
            qk, tanh = _softcap(qk, softcap)
        p = tl.math.exp2(qk - lse2[:, None])
        if MASKED:
            if _edge_block(start_n, mask_lo, mask_from, HAS_WINDOW or HAS_DOC, True):
                valid = _score_keep(
                    offs_m[:, None],
                    cols[None, :],
                    doc_lo,
                    doc_hi,
                    N_Q,
                    N_K,
                    window,
                    CAUSAL,
                    HAS_WINDOW,
                    HAS_DOC,
                )
                p = tl.where(valid, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        if HAS_DROPOUT:
            dp = tl.where(
                _dropout_keep(seed_lo, seed_hi, offs_m[:, None], cols[None, :], bh, dropout_p),
                dp * (1.0 / (1.0 - dropout_p)),
                0.0,
            )
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - tanh * tanh)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    O,
    DLSE,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dqb,
    stride_dqh,
    stride_dqm,
    stride_ob,
    stride_oh,
    stride_om,
    H_Q,
    GROUP,
    N_Q,
    N_K,
    HEAD_DIM: tl.constexpr,
    softmax_scale,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TMA_KV: tl.constexpr,
    Q_DOC=None,
    SEED=None,
    window=None,
    dropout_p=0.0,
    softcap=None,
):
    """dQ of one query block (section 3.2) by its own program (no atomics), and Delta = rowsum(dO * O)
    (- dLSE) of its rows for `_bwd_dkdv_kernel`, launched after it (no separate preprocess pass). Grid
    (cdiv(Nq, BLOCK_M), Hq, B). TMA_KV as TMA_Q in `_bwd_dkdv_kernel` (K and V share strides). DLSE None:
    no gradient flows into the LSE."""
    HAS_WINDOW: tl.constexpr = window is not None
    HAS_DOC: tl.constexpr = Q_DOC is not None
    HAS_DROPOUT: tl.constexpr = SEED is not None
    SOFTCAP: tl.constexpr = softcap is not None
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    scale_log2 = _scale_log2(softmax_scale, softcap)
    softmax_scale = tl.cast(softmax_scale, tl.float32)  # Inductor passes Python floats as fp64
    if SOFTCAP:
        softcap = tl.cast(softcap, tl.float32)
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m  # heaviest query blocks first
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    hk = h // GROUP
    m0 = pid_m * BLOCK_M
    m0_64 = tl.cast(m0, tl.int64)
    tile_m = tl.arange(0, BLOCK_M)
    offs_m = m0 + tile_m
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < N_Q
    mask_d = offs_d < HEAD_DIM

    # -- load Q_i, dO_i, O_i; Delta_i = rowsum(dO_i * O_i); LSE_i in base 2
    q_ptrs = Q + b * stride_qb + h * stride_qh + m0_64 * stride_qm + tile_m[:, None] * stride_qm
    q = _load_tile(q_ptrs + offs_d[None, :], mask_m, mask_d, not EVEN_M, not EVEN_D)
    do_ptrs = DO + b * stride_dob + h * stride_doh + m0_64 * stride_dom + tile_m[:, None] * stride_dom
    do = _load_tile(do_ptrs + offs_d[None, :], mask_m, mask_d, not EVEN_M, not EVEN_D)
    o_ptrs = O + b * stride_ob + h * stride_oh + m0_64 * stride_om + tile_m[:, None] * stride_om
    o = _load_tile(o_ptrs + offs_d[None, :], mask_m, mask_d, not EVEN_M, not EVEN_D)
    row_ptr = (b * H_Q + h) * N_Q + offs_m
    delta = _row_sum(o.to(tl.float32) * do.to(tl.float32))
    if DLSE is not None:
        # d lse_i / d s_ij = P_ij folds into dS = P * (dP - Delta) as Delta - dLSE
        delta -= tl.load(DLSE + row_ptr, mask=mask_m, other=0.0)
    tl.store(DELTA + row_ptr, delta, mask=mask_m)
    lse = tl.load(LSE + row_ptr, mask=mask_m, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)

    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_kb + hk * stride_kh
    dq = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)

    if TMA_KV:
        H_KV = H_Q // GROUP
        KD, row_kb, row_kh, col_kh = _tma_operand(
            K, stride_kh, stride_kn, H_KV, N_K, TMA_KV, BLOCK_N, BLOCK_D
        )
        VD = _tma_operand(V, stride_kh, stride_kn, H_KV, N_K, TMA_KV, BLOCK_N, BLOCK_D)[0]
    else:  # pointer loads, no descriptors: constexpr None (a tuple cannot hold an assigned, plain None)
        KD: tl.constexpr = None
        VD: tl.constexpr = None
        row_kb, row_kh, col_kh = 0, 0, 0
    # descriptor coordinates of K's and V's rows (int32; only used when USE_TMA)
    k_row = (b * row_kb + hk * row_kh).to(tl.int32)
    k_col = (hk * col_kh).to(tl.int32)
    # -- for each visible key block j: dQ_i += dS_ij K_j; blocks [0, full_end) unmasked, then masked
    doc_lo, doc_hi, doc_lo_ptr, doc_hi_ptr, seed_lo, seed_hi, dropout_p = _variant_args(
        Q_DOC, SEED, b, offs_m, mask_m, N_Q, dropout_p, HAS_DOC, HAS_DROPOUT
    )
    lo, full_lo, full_end, hi = _key_block_range(
        m0, N_Q, N_K, window, doc_lo_ptr, doc_hi_ptr, CAUSAL, HAS_WINDOW, HAS_DOC, BLOCK_M, BLOCK_N
    )
    dq = _bwd_dq_inner(
        dq,
        q,
        do,
        lse2,
        delta,
        (k_base, stride_kn, KD, k_row, k_col),
        (v_base, VD),
        lo,
        hi,
        full_end,
        offs_m,
        offs_n,
        offs_d,
        mask_d,
        N_Q,
        N_K,
        scale_log2,
        CAUSAL or not EVEN_N or HAS_WINDOW or HAS_DOC,
        CAUSAL,
        BLOCK_N,
        EVEN_N,
        EVEN_D,
        DOT_PRECISION,
        TMA_KV > 0,
        (full_lo, doc_lo, doc_hi, window, seed_lo, seed_hi, b * H_Q + h, dropout_p, softcap),
        (HAS_WINDOW, HAS_DOC, HAS_DROPOUT, SOFTCAP),
    )
    # -- write dQ_i (scaled: S = scale * Q K^T)
    dq = dq * softmax_scale
    dq_ptrs = DQ + b * stride_dqb + h * stride_dqh + m0_64 * stride_dqm + tile_m[:, None] * stride_dqm
    _store_tile(dq_ptrs + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask_m, mask_d, not EVEN_M, not EVEN_D)
