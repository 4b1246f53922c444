"""Triton kernels of flash-decoding (Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context inference",
2023): with 1 to 16 query rows per sequence, one program per (sequence, head) cannot fill a GPU, so the keys
are split as well.

1. ``_decode_split_kernel``, grid (num_splits, Hkv, B): program (s, hk, b) streams keys
   [s * SPLIT_LEN, min((s + 1) * SPLIT_LEN, L_b)) of KV head hk through the online softmax for all
   GROUP * Nq query rows of its query heads at once (row r = g * Nq + i: one read of each K/V tile serves the
   GQA group), and writes the normalised partial output and its base-2 LSE (o = 0, lse = -inf past L_b).
2. ``_decode_combine_kernel``, grid (B * Hq * Nq,): o = sum_s 2^(lse_s - lse) o_s, lse = log2 sum_s 2^lse_s,
   returned in natural-log units.

Causal bottom-right per sequence: row i of Nq sees keys j <= L_b - Nq + i. The lengths are read on the
device, so the grid depends only on the cache size (CUDA-graph friendly).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._triton_common import _max0, _row_max, _row_sum, _scale_log2, _softcap, _sum0


@triton.jit
def _pdl_wait_and_release():
    """Programmatic dependent launch (griddepcontrol): wait for the previous kernel's writes before touching
    memory, then let the next kernel launch under this one. No-ops in a launch without the PDL attribute."""
    gdc_wait()
    gdc_launch_dependents()


@triton.jit
def _decode_split_kernel(
    Q,
    K,
    V,
    SEQLENS,
    O_PART,
    LSE_PART,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    H_Q,
    GROUP,
    N_Q,
    HEAD_DIM,
    SPLIT_LEN,
    NUM_SPLITS,
    N_MAX,
    softmax_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    softcap=None,
):
    """Partial attention of one key split. O_PART (B, Hq, Nq, NUM_SPLITS, HEAD_DIM) and LSE_PART
    (B, Hq, Nq, NUM_SPLITS) are contiguous float32; LSE_PART is in base-2 units. L_b is SEQLENS[b], or N_MAX
    with SEQLENS None (every sequence fills the cache). K and V share strides. USE_PDL: launched with
    programmatic dependent launch (``_pdl_wait_and_release``). softcap: as in the attention kernels."""
    HAS_SEQLENS: tl.constexpr = SEQLENS is not None
    SOFTCAP: tl.constexpr = softcap is not None
    if USE_PDL:
        _pdl_wait_and_release()
    scale_log2 = _scale_log2(softmax_scale, softcap)
    if SOFTCAP:
        softcap = tl.cast(softcap, tl.float32)
    split = tl.program_id(0)
    hk = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    if HAS_SEQLENS:
        # clamped to the cache: a length the wrapper did not range-check (check_lengths=False) can never
        # make the loop read past the cache's slots; clamped before the int32 cast, so an int64 length
        # past 2**31 clamps to N_MAX instead of wrapping to some other length
        seq_len = tl.minimum(tl.maximum(tl.load(SEQLENS + b), 0), N_MAX).to(tl.int32)
    else:  # no lengths tensor: no load here, and no fill kernel launched per call by the wrapper
        seq_len = N_MAX

    offs_r = tl.arange(0, BLOCK_M)
    row_ok = offs_r < GROUP * N_Q
    g = offs_r // N_Q
    qi = offs_r % N_Q
    h = hk * GROUP + g  # int64
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)

    q_ptrs = Q + b * stride_qb + h[:, None] * stride_qh + qi[:, None] * stride_qm + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & mask_d[None, :], other=0.0)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_kb + hk * stride_kh

    lo = split * SPLIT_LEN
    hi = tl.minimum(lo + SPLIT_LEN, seq_len)
    last_key = seq_len - N_Q + qi  # bottom-right causal: row qi sees keys <= last_key

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        cols = start + offs_n
        col_ok = cols < hi
        cols_64 = cols.to(tl.int64)
        kv_mask = col_ok[:, None] & mask_d[None, :]
        k = tl.load(k_base + cols_64[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if SOFTCAP:
            qk, _ = _softcap(qk, softcap)
        valid = col_ok[None, :] & (cols[None, :] <= last_key[:, None])
        qk = tl.where(valid, qk, float("-inf"))
        m_new = tl.maximum(m_i, _row_max(qk))
        # rows that see no key yet keep m = -inf: shift by 0 so exp2(-inf - 0) = 0, not NaN
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_shift)
        p = tl.math.exp2(qk - m_shift[:, None])
        l_i = l_i * alpha + _row_sum(p)
        v = tl.load(v_base + cols_64[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new

    has_key = l_i > 0.0
    l_safe = tl.where(has_key, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse2 = tl.where(has_key, m_i + tl.math.log2(l_safe), float("-inf"))
    row = (b * H_Q + h) * N_Q + qi  # int64 index of (b, h, qi)
    part = row * NUM_SPLITS + split
    tl.store(O_PART + part[:, None] * HEAD_DIM + offs_d[None, :], o, mask=row_ok[:, None] & mask_d[None, :])
    tl.store(LSE_PART + part, lse2, mask=row_ok)


@triton.jit
def _decode_combine_kernel(
    O_PART,
    LSE_PART,
    O,
    LSE,
    stride_ob,
    stride_oh,
    stride_om,
    H_Q,
    N_Q,
    HEAD_DIM,
    NUM_SPLITS,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Combine the splits of one (b, h, query row): LSE-weighted sum of the partial outputs."""
    if USE_PDL:
        _pdl_wait_and_release()
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    lse2 = tl.load(LSE_PART + row * NUM_SPLITS + offs_s, mask=s_ok, other=float("-inf"))
    m = _max0(lse2)
    m_shift = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse2 - m_shift)  # 0 for empty splits (lse = -inf)
    total = _sum0(w)
    o_part = tl.load(
        O_PART + (row * NUM_SPLITS + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_ok[:, None] & mask_d[None, :],
        other=0.0,
    )
    total_safe = tl.where(total > 0.0, total, 1.0)
    o = _sum0(o_part * w[:, None]) / total_safe
    b = row // (H_Q * N_Q)
    h = (row // N_Q) % H_Q
    qi = row % N_Q
    tl.store(
        O + b * stride_ob + h * stride_oh + qi * stride_om + offs_d,
        o.to(O.dtype.element_ty),
        mask=mask_d,
    )
    lse = tl.where(total > 0.0, (m + tl.math.log2(total_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(LSE + row, lse)
