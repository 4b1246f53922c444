"""Triton kernels of our FlashAttention-2 (forward; backward: dQ with Delta, then dK/dV).

Algorithm: Tri Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work
Partitioning" (2023), section 3.1 (forward) and section 3.2 (backward), with the online softmax of
Milakov & Gimelshein, "Online normalizer calculation for softmax" (2018). Written from the papers.

Conventions shared by every kernel
----------------------------------
* Layout: q (B, Hq, Nq, d), k/v (B, Hkv, Nk, d), any strides (last one 1 is checked by the wrapper,
  the kernels only need the four strides). LSE and Delta are contiguous float32 (B, Hq, Nq).
* GQA/MQA: query head h reads key/value head h // GROUP with GROUP = Hq // Hkv (no k/v copies).
* Scores are kept in base-2 units: s2 = (q . k) * softmax_scale * log2(e), so exp(x) becomes
  exp2(x2). LSE is stored in natural-log units: lse = ln(sum_j exp(softmax_scale * q_i . k_j)).
* Soft-capping (SOFTCAP, constexpr): the launcher passes scale_log2 = scale / c and softcap = c * log2(e),
  so the scores become c * tanh(s / c) in base 2 before the mask; dS takes the factor 1 - tanh^2.
* Causal masking is bottom-right aligned: query i sees key j iff j <= i + (Nk - Nq).
  A query row that sees no key (possible when Nq > Nk) gets o = 0, lse = -inf and zero gradients.
* Causal key blocks wholly above the diagonal are skipped through the loop bounds; the remaining
  key blocks are split into "full" blocks (no mask computed at all) and "masked" blocks (diagonal
  and/or sequence-end blocks).
* Head dim d is padded to BLOCK_D = max(16, next_pow2(d)) with masked loads/stores (EVEN_D skips it).
* Batch/head indices are int64 before multiplying by strides; the block start offsets are too.
* No atomics: every output element is written by exactly one program -> deterministic backward.
* Hopper TMA (backward, 16-bit, whole blocks): the streamed tiles come through 2-D tensor descriptors
  built on the device (`tl.make_tensor_descriptor`), so launches need no host-side descriptor objects.
* Arguments: the launched kernels take every stride and runtime scalar as an argument of its own, since
  torch.compile (torch 2.13) cannot emit a captured launch (`wrap_triton`) whose argument is a tuple of
  runtime values (Inductor's `signature_of` compares the tuple with the int32 range and fails). The inner
  loops get them grouped in tuples: `variant` / `VARIANT_FLAGS`, and the backward's `*_src` operands.

Interpreter or compiler: `@triton.jit` decides when this module is imported, from TRITON_INTERPRET then.
The launchers (`kernels/_launch.py`) import it at the first launch, not at package import, so a process that
sets TRITON_INTERPRET=1 before its first flash call runs the interpreter whatever it imported before; the
helpers avoid Triton's standard-library JIT functions (`_triton_common._row_max`), which are built when
triton itself is imported.
"""

import triton
import triton.language as tl

# shared helpers (tile loads/stores, block ranges, variant masks, Philox dropout) and the dropout test kernel
from ._triton_common import (
    _dropout_keep,
    _edge_block,
    _key_block_range,
    _load_tile,
    _philox_seed,
    _query_block_range,
    _row_max,
    _row_sum,
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
    stride_vn,
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

    Variants: `variant` holds their per-program values (mask_lo, doc_lo, doc_hi, window, seed_lo, seed_hi, bh,
    dropout_p, softcap), VARIANT_FLAGS the switches (HAS_WINDOW, HAS_DOC, HAS_DROPOUT, SOFTCAP); a value
    whose switch is off is an unused placeholder. Blocks before `mask_lo` are masked too (window / document
    start); the keep tile is `_score_keep`; HAS_DROPOUT drops P after the row sums (the normaliser and the
    LSE are the undropped ones) with `_dropout_keep` and scales the kept weights by 1 / (1 - dropout_p).

    MASKED: blocks starting at or after `mask_from` (the diagonal and sequence-end blocks) get the
    causal / sequence-end mask; the blocks before it skip the mask arithmetic. One loop, not one loop
    per part: with two pipelined loops carrying the accumulator, ptxas serialises every wgmma of the
    kernel (warning C7515, one wait after each wgmma; bench/NOTES.md v5).
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
        v_ptrs = v_base + start_64 * stride_vn + (offs_n[:, None] * stride_vn + offs_d[None, :])
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
    stride_vb,
    stride_vh,
    stride_vn,
    stride_ob,
    stride_oh,
    stride_om,
    H_Q,
    GROUP,
    N_Q,
    N_K,
    HEAD_DIM,
    scale_log2,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    Q_DOC=None,
    SEED=None,
    window=0,
    dropout_p=0.0,
    HAS_WINDOW: tl.constexpr = False,
    HAS_DOC: tl.constexpr = False,
    HAS_DROPOUT: tl.constexpr = False,
    softcap=None,
    SOFTCAP: tl.constexpr = False,
):
    """FlashAttention-2 forward (paper section 3.1). Grid: (cdiv(Nq, BLOCK_M), Hq, B).

    Variants: window (HAS_WINDOW), documents (HAS_DOC: Q_DOC int32 (2, B, Nq) holds each query row's document
    key range [lo, hi)), dropout (HAS_DROPOUT: SEED int64 (1,), dropout_p in (0, 1)).
    """
    scale_log2 = tl.cast(scale_log2, tl.float32)  # Inductor passes Python floats as fp64
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
    q_ptrs = (
        Q
        + b * stride_qb
        + h * stride_qh
        + m0_64 * stride_qm
        + tl.arange(0, BLOCK_M)[:, None] * stride_qm
        + offs_d[None, :]
    )
    q = _load_tile(q_ptrs, mask_m, mask_d, not EVEN_M, not EVEN_D)

    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh

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
        stride_vn,
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
    o_ptrs = (
        O
        + b * stride_ob
        + h * stride_oh
        + m0_64 * stride_om
        + tl.arange(0, BLOCK_M)[:, None] * stride_om
        + offs_d[None, :]
    )
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

    MASKED: query blocks starting before `mask_to` (those on the diagonal) get the causal mask; the
    later ones skip the mask arithmetic. One loop for both parts: with two pipelined loops carrying
    dK / dV, ptxas serialises every wgmma of the kernel (see `_fwd_inner`).
    q_src / do_src: where the q / dO tiles come from, (base pointer of this query head, row stride, 2-D
    tensor descriptor, row and column of this query head in it). USE_TMA: the tiles come through the
    descriptors QD / DOD (Hopper TMA) at rows q_row + start_m / do_row + start_m and columns q_col / do_col;
    else pointer loads, and the descriptors are None. TMA only with EVEN_M: past N_Q a
    descriptor would read another head's (or batch element's) data, and a non-finite value there
    would reach this head through 0 * inf in the dots; the pointer loads read zeros instead.
    Variants: `variant` holds their values (mask_from, Q_DOC_LO, Q_DOC_HI, window, seed_lo, seed_hi, bh,
    dropout_p, softcap), VARIANT_FLAGS the switches (HAS_WINDOW, HAS_DOC, HAS_DROPOUT, SOFTCAP), as in
    `_fwd_inner`. Query blocks starting at or after `mask_from` are masked too (window / document end), with
    the keep tile of `_score_keep` (Q_DOC_LO / Q_DOC_HI: base pointers of the rows' document key ranges);
    HAS_DROPOUT regenerates the forward's keep mask: dV uses the dropped, scaled P and
    dS = P * (Z dP / (1 - p) - Delta).
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
            q = _load_tile(
                q_base + start_64 * stride_qm + offs_m[:, None] * stride_qm + offs_d[None, :],
                mask_r,
                mask_d,
                not EVEN_M,
                not EVEN_D,
            )
            do = _load_tile(
                do_base + start_64 * stride_dom + offs_m[:, None] * stride_dom + offs_d[None, :],
                mask_r,
                mask_d,
                not EVEN_M,
                not EVEN_D,
            )
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
    """A (B, H, N, d) operand as one 2-D tensor descriptor (Hopper TMA): (descriptor, row_b, row_h, col_h);
    row n of head h in batch b is descriptor row b * row_b + h * row_h + n, column h * col_h.

    LAYOUT (`kernels.plan.tma_operand`): 1, heads contiguous (rows b*H*N + h*N + n, d columns); 2, the
    (B, N, H, d) memory of a fused qkv projection (rows b*N + n, the heads side by side in a row). d ==
    BLOCK_D (the plan's condition). Derived here from the strides, so the launch passes no extents.
    """
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
    """2-D tensor descriptor (Hopper TMA) over `rows` x `cols` elements from `base`, built on the device.

    Built inside the kernel (not on the host) so a launch costs no host work for it and the launch
    can be captured by torch.compile (`wrap_triton`) and CUDA graphs; it needs the global-scratch
    allocator that `kernels.flash_attn` installs (128 bytes per descriptor and program).
    """
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
    stride_vb,
    stride_vh,
    stride_vn,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dkb,
    stride_dkh,
    stride_dkn,
    stride_dvb,
    stride_dvh,
    stride_dvn,
    H_Q,
    GROUP,
    N_Q,
    N_K,
    HEAD_DIM,
    softmax_scale,
    scale_log2,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TMA_Q: tl.constexpr,
    TMA_DO: tl.constexpr,
    Q_DOC=None,
    K_DOC=None,
    SEED=None,
    window=0,
    dropout_p=0.0,
    HAS_WINDOW: tl.constexpr = False,
    HAS_DOC: tl.constexpr = False,
    HAS_DROPOUT: tl.constexpr = False,
    dk_offset=0,
    dv_offset=0,
    softcap=None,
    SOFTCAP: tl.constexpr = False,
):
    """dK, dV of one key/value block (paper section 3.2, Algorithm 2 with K/V as the outer loop).

    Grid: (cdiv(Nk, BLOCK_N), Hkv, B). Loops over the GROUP query heads that share this kv head and
    over the query blocks that can see this key block; P is recomputed from q, k and LSE.
    TMA_Q / TMA_DO: 0, pointer loads of q / dO; 1 or 2, tensor descriptors built here (`_tma_operand`'s
    layouts; both 0 or both not).
    Variants as in `_fwd_kernel`; K_DOC int32 (2, B, Nk) holds each key's document query range [lo, hi).
    Packed d(qkv) (`flash_attention_qkvpacked`): DV is None and dK, dV are written dk_offset / dv_offset
    elements past DK's start (the slices of one buffer, passed as one tensor: a compiled graph may clone a
    written argument, and two views of one buffer would be cloned apart).
    """
    softmax_scale = tl.cast(softmax_scale, tl.float32)  # Inductor passes Python floats as fp64
    scale_log2 = tl.cast(scale_log2, tl.float32)
    if SOFTCAP:
        softcap = tl.cast(softcap, tl.float32)
    if DV is None:
        DV = DK + dv_offset
    DK = DK + dk_offset
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
    k = _load_tile(
        K + b * stride_kb + hk * stride_kh + n0_64 * stride_kn + tile_n * stride_kn + offs_d[None, :],
        mask_n,
        mask_d,
        not EVEN_N,
        not EVEN_D,
    )
    v = _load_tile(
        V + b * stride_vb + hk * stride_vh + n0_64 * stride_vn + tile_n * stride_vn + offs_d[None, :],
        mask_n,
        mask_d,
        not EVEN_N,
        not EVEN_D,
    )
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
    _store_tile(
        DK + b * stride_dkb + hk * stride_dkh + n0_64 * stride_dkn + tile_n * stride_dkn + offs_d[None, :],
        dk.to(DK.dtype.element_ty),
        mask_n,
        mask_d,
        not EVEN_N,
        not EVEN_D,
    )
    _store_tile(
        DV + b * stride_dvb + hk * stride_dvh + n0_64 * stride_dvn + tile_n * stride_dvn + offs_d[None, :],
        dv.to(DV.dtype.element_ty),
        mask_n,
        mask_d,
        not EVEN_N,
        not EVEN_D,
    )


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
    """Accumulate dQ += dS K over key blocks [lo, hi) (scale applied by the caller).

    Variants (`variant`, VARIANT_FLAGS) as in `_fwd_inner`; with dropout dS = P * (Z dP / (1 - p) - Delta).

    MASKED: key blocks starting at or after `mask_from` get the causal / sequence-end mask (one loop;
    see `_fwd_inner` for why not two).
    k_src / v_src: where the k / v tiles come from, (base pointer of this kv head, row stride, 2-D tensor
    descriptor, row and column of this kv head in it). USE_TMA: the tiles come through the descriptors
    KD / VD (Hopper TMA) at rows k_row + start_n / v_row + start_n and columns k_col / v_col, only with EVEN_N
    (see `_bwd_dkdv_inner`); else pointer loads, and the descriptors are None.
    """
    k_base, stride_kn, KD, k_row, k_col = k_src
    v_base, stride_vn, VD, v_row, v_col = v_src
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
            v = VD.load([v_row + start_n, v_col])
        else:
            start_64 = tl.cast(start_n, tl.int64)
            k_ptrs = k_base + start_64 * stride_kn + (offs_n[:, None] * stride_kn + offs_d[None, :])
            k = _load_tile(k_ptrs, col_ok, mask_d, not EVEN_N, not EVEN_D)
            v_ptrs = v_base + start_64 * stride_vn + (offs_n[:, None] * stride_vn + offs_d[None, :])
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
    stride_vb,
    stride_vh,
    stride_vn,
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
    HEAD_DIM,
    softmax_scale,
    scale_log2,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TMA_K: tl.constexpr,
    TMA_V: tl.constexpr,
    HAS_DLSE: tl.constexpr,
    Q_DOC=None,
    SEED=None,
    window=0,
    dropout_p=0.0,
    HAS_WINDOW: tl.constexpr = False,
    HAS_DOC: tl.constexpr = False,
    HAS_DROPOUT: tl.constexpr = False,
    softcap=None,
    SOFTCAP: tl.constexpr = False,
):
    """dQ of one query block (paper section 3.2), and Delta of its rows. Grid: (cdiv(Nq, BLOCK_M), Hq, B).

    Computed by its own program (not accumulated from the dK/dV programs), so no atomics are needed;
    it loops over the visible key blocks like the forward. It also computes Delta = rowsum(dO * O)
    (- dLSE when HAS_DLSE) and stores it for `_bwd_dkdv_kernel`, which is launched after it (one
    launch and one pass over O and dO fewer than a separate preprocess kernel).
    TMA_K / TMA_V: 0, pointer loads of k / v; 1 or 2, tensor descriptors built here (`_tma_operand`'s
    layouts; both 0 or both not).
    """
    softmax_scale = tl.cast(softmax_scale, tl.float32)  # Inductor passes Python floats as fp64
    scale_log2 = tl.cast(scale_log2, tl.float32)
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
    q = _load_tile(
        Q + b * stride_qb + h * stride_qh + m0_64 * stride_qm + tile_m[:, None] * stride_qm + offs_d[None, :],
        mask_m,
        mask_d,
        not EVEN_M,
        not EVEN_D,
    )
    do = _load_tile(
        DO
        + b * stride_dob
        + h * stride_doh
        + m0_64 * stride_dom
        + tile_m[:, None] * stride_dom
        + offs_d[None, :],
        mask_m,
        mask_d,
        not EVEN_M,
        not EVEN_D,
    )
    o = _load_tile(
        O + b * stride_ob + h * stride_oh + m0_64 * stride_om + tile_m[:, None] * stride_om + offs_d[None, :],
        mask_m,
        mask_d,
        not EVEN_M,
        not EVEN_D,
    )
    row_ptr = (b * H_Q + h) * N_Q + offs_m
    delta = _row_sum(o.to(tl.float32) * do.to(tl.float32))
    if HAS_DLSE:
        # d lse_i / d s_ij = P_ij folds into dS = P * (dP - Delta) as Delta - dLSE
        delta -= tl.load(DLSE + row_ptr, mask=mask_m, other=0.0)
    tl.store(DELTA + row_ptr, delta, mask=mask_m)
    lse = tl.load(LSE + row_ptr, mask=mask_m, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)

    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    dq = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)

    if TMA_K:
        H_KV = H_Q // GROUP
        KD, row_kb, row_kh, col_kh = _tma_operand(K, stride_kh, stride_kn, H_KV, N_K, TMA_K, BLOCK_N, BLOCK_D)
        VD, row_vb, row_vh, col_vh = _tma_operand(V, stride_vh, stride_vn, H_KV, N_K, TMA_V, BLOCK_N, BLOCK_D)
    else:  # pointer loads, no descriptors: constexpr None (a tuple cannot hold an assigned, plain None)
        KD: tl.constexpr = None
        VD: tl.constexpr = None
        row_kb, row_kh, col_kh, row_vb, row_vh, col_vh = 0, 0, 0, 0, 0, 0
    # descriptor coordinates (int32; only used when USE_TMA)
    k_row = (b * row_kb + hk * row_kh).to(tl.int32)
    k_col = (hk * col_kh).to(tl.int32)
    v_row = (b * row_vb + hk * row_vh).to(tl.int32)
    v_col = (hk * col_vh).to(tl.int32)
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
        (v_base, stride_vn, VD, v_row, v_col),
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
        TMA_K > 0,
        (full_lo, doc_lo, doc_hi, window, seed_lo, seed_hi, b * H_Q + h, dropout_p, softcap),
        (HAS_WINDOW, HAS_DOC, HAS_DROPOUT, SOFTCAP),
    )
    # -- write dQ_i (scaled: S = scale * Q K^T)
    dq = dq * softmax_scale
    _store_tile(
        DQ
        + b * stride_dqb
        + h * stride_dqh
        + m0_64 * stride_dqm
        + tile_m[:, None] * stride_dqm
        + offs_d[None, :],
        dq.to(DQ.dtype.element_ty),
        mask_m,
        mask_d,
        not EVEN_M,
        not EVEN_D,
    )
