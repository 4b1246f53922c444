"""Triton helpers of the FlashAttention kernels (`_triton_kernels.py`), and the dropout test kernel."""

import triton
import triton.language as tl


@triton.jit
def _row_max(x):
    """max over axis 1 by tl.reduce, not tl.max: tl.max is built in the mode of triton's own import, so an
    interpreted kernel of a process that imported triton before TRITON_INTERPRET=1 could not call it."""
    return tl.reduce(x, 1, tl.standard._elementwise_max)


@triton.jit
def _row_sum(x):
    """sum over axis 1 (tl.reduce, as `_row_max`)."""
    return tl.reduce(x, 1, tl.standard._sum_combine)


@triton.jit
def _max0(x):
    """max over axis 0 (tl.reduce, as `_row_max`)."""
    return tl.reduce(x, 0, tl.standard._elementwise_max)


@triton.jit
def _sum0(x):
    """sum over axis 0 (tl.reduce, as `_row_max`)."""
    return tl.reduce(x, 0, tl.standard._sum_combine)


@triton.jit
def _tanh(x):
    """tanh(x) = 2 / (1 + e^(-2x)) - 1 from exp2 (the interpreter has no libdevice), about 1 ulp; x clamped
    to [-10, 10] (where float32 tanh is +-1) so e^(-2x) stays finite."""
    x = tl.minimum(tl.maximum(x, -10.0), 10.0)
    return 2.0 / (1.0 + tl.math.exp2(x * -2.8853900817779268)) - 1.0


@triton.jit
def _softcap(qk, cap):
    """(cap * tanh(qk), tanh(qk)) for qk = (q . k) * scale / c, cap = c * log2(e): capped base-2 scores."""
    t = _tanh(qk)
    return t * cap, t


@triton.jit
def _scale_log2(softmax_scale, softcap):
    """The float32 score multiplier (Inductor passes Python floats as fp64): scale * log2(e) for base-2
    scores, or scale / c with soft-capping (softcap = c * log2(e); None: off)."""
    scale_log2 = tl.cast(softmax_scale, tl.float32) * 1.4426950408889634
    if softcap is not None:
        scale_log2 = scale_log2 / tl.cast(softcap, tl.float32)
    return scale_log2


@triton.jit
def _load_tile(ptrs, row_mask, col_mask, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    """Load a 2-D tile, masking rows and/or (padded head-dim) columns only when needed."""
    if CHECK_ROWS:
        if CHECK_COLS:
            x = tl.load(ptrs, mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        else:
            x = tl.load(ptrs, mask=row_mask[:, None], other=0.0)
    else:
        if CHECK_COLS:
            x = tl.load(ptrs, mask=col_mask[None, :], other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _store_tile(ptrs, x, row_mask, col_mask, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    """Store a 2-D tile with the same masking rules as `_load_tile`."""
    if CHECK_ROWS:
        if CHECK_COLS:
            tl.store(ptrs, x, mask=row_mask[:, None] & col_mask[None, :])
        else:
            tl.store(ptrs, x, mask=row_mask[:, None])
    else:
        if CHECK_COLS:
            tl.store(ptrs, x, mask=col_mask[None, :])
        else:
            tl.store(ptrs, x)


@triton.jit
def _key_block_bounds(m0, N_Q, N_K, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(full_end, hi) of the query block at row m0: key blocks before full_end need no mask, keys >= hi are
    invisible to the whole block. Clamped to >= 0 before dividing (Triton's division truncates)."""
    if CAUSAL:
        delta = N_K - N_Q
        # last row of the block (m0 + BLOCK_M - 1) sees keys < m0 + BLOCK_M + delta
        hi = tl.minimum(tl.maximum(m0 + BLOCK_M + delta, 0), N_K)
        # the first row (m0) sees keys < m0 + delta + 1; blocks entirely below that are full
        full_end = tl.minimum(tl.maximum(m0 + delta + 1, 0), N_K)
    else:
        hi = N_K
        full_end = N_K
    full_end = (full_end // BLOCK_N) * BLOCK_N
    return full_end, hi


@triton.jit
def _key_block_range(
    m0,
    N_Q,
    N_K,
    window,
    DOC_LO,
    DOC_HI,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_DOC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """(lo, full_lo, full_end, hi) of the query block at row m0 with the variants: key blocks in [lo, hi) are
    visited (a window costs O(N * w)), those in [full_lo, full_end) unmasked. Documents: row i sees keys
    [DOC_LO[i], DOC_HI[i]), non-decreasing in i, so the block's first and last rows bound it."""
    full_end, hi = _key_block_bounds(m0, N_Q, N_K, CAUSAL, BLOCK_M, BLOCK_N)
    lo = 0
    full_lo = 0
    if HAS_WINDOW:
        # the first row m0 sees keys >= m0 + delta - w + 1, the last row keys >= m0 + BLOCK_M + delta - w
        lo = tl.maximum(m0 + (N_K - N_Q) - window + 1, 0)
        full_lo = tl.maximum(m0 + BLOCK_M + (N_K - N_Q) - window, 0)
    if HAS_DOC:
        last = tl.minimum(m0 + BLOCK_M, N_Q) - 1
        lo = tl.maximum(lo, tl.load(DOC_LO + m0))
        full_lo = tl.maximum(full_lo, tl.load(DOC_LO + last))
        hi = tl.minimum(hi, tl.load(DOC_HI + last))
        full_end = tl.minimum(full_end, (tl.load(DOC_HI + m0) // BLOCK_N) * BLOCK_N)
    lo = (lo // BLOCK_N) * BLOCK_N
    full_lo = ((full_lo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    return lo, full_lo, full_end, hi


@triton.jit
def _query_block_range(
    n0,
    start_m,
    full_start,
    N_Q,
    N_K,
    window,
    DOC_LO,
    DOC_HI,
    HAS_WINDOW: tl.constexpr,
    HAS_DOC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """(start_m, full_start, full_end, hi) of the key block at n0 (dK/dV) from its causal bounds: query blocks
    in [start_m, hi) are visited, those in [full_start, full_end) unmasked. Documents: key j is seen by
    queries [DOC_LO[j], DOC_HI[j]). Rows past N_Q need no mask (their LSE reads +inf, so P = 0)."""
    hi = N_Q
    full_end = ((N_Q + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    if HAS_WINDOW:
        hi = tl.minimum(hi, tl.maximum(n0 + BLOCK_N - 1 - (N_K - N_Q) + window, 0))
        full_end = tl.minimum(full_end, (tl.maximum(n0 - (N_K - N_Q) + window, 0) // BLOCK_M) * BLOCK_M)
    if HAS_DOC:
        last = tl.minimum(n0 + BLOCK_N, N_K) - 1
        start_m = tl.maximum(start_m, (tl.load(DOC_LO + n0) // BLOCK_M) * BLOCK_M)
        full_start = tl.maximum(full_start, ((tl.load(DOC_LO + last) + BLOCK_M - 1) // BLOCK_M) * BLOCK_M)
        hi = tl.minimum(hi, tl.load(DOC_HI + last))
        full_end = tl.minimum(full_end, (tl.load(DOC_HI + n0) // BLOCK_M) * BLOCK_M)
    return start_m, full_start, full_end, hi


@triton.jit
def _edge_block(start, full_lo, full_end, LO_EDGE: tl.constexpr, HI_EDGE: tl.constexpr):
    """Does the block at `start` need the mask: start < full_lo (LO_EDGE) or start >= full_end (HI_EDGE).
    The plain kernels test one edge only: an extra live register spills the d = 128 dK/dV tile."""
    if LO_EDGE:
        if HI_EDGE:
            return (start < full_lo) | (start >= full_end)
        return start < full_lo
    return start >= full_end


@triton.jit
def _score_keep(
    rows,
    cols,
    doc_lo,
    doc_hi,
    N_Q,
    N_K,
    window,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_DOC: tl.constexpr,
    CHECK_COLS: tl.constexpr = True,
):
    """Keep tile of the scores, the one place every mask is decided (`reference.attention_mask` in PyTorch):
    rows / cols broadcastable index tiles, doc_lo / doc_hi each row's document key range. CHECK_COLS=False
    leaves out `cols < N_K` (dK/dV: rows of keys past N_K are never stored)."""
    if CHECK_COLS:
        keep = cols < N_K
        if CAUSAL:
            keep = keep & (cols <= rows + (N_K - N_Q))
    else:
        keep = cols <= rows + (N_K - N_Q) if CAUSAL else cols >= 0
    if HAS_WINDOW:
        keep = keep & (cols > rows + (N_K - N_Q) - window)
    if HAS_DOC:
        keep = keep & (cols >= doc_lo) & (cols < doc_hi)
    return keep


@triton.jit
def _variant_args(
    DOC, SEED, b, offs_rows, mask_rows, N_ROWS, dropout_p, HAS_DOC: tl.constexpr, HAS_DROPOUT: tl.constexpr
):
    """Per-program variant inputs: the document ranges of rows offs_rows of batch element b (DOC int32
    (2, B, N_ROWS); (BLOCK, 1) tiles and base pointers), the Philox key, dropout_p as fp32."""
    if HAS_DOC:
        lo_ptr = DOC + b * N_ROWS
        hi_ptr = DOC + (tl.num_programs(2) + b) * N_ROWS
        doc_lo = tl.load(lo_ptr + offs_rows, mask=mask_rows, other=0)[:, None]
        doc_hi = tl.load(hi_ptr + offs_rows, mask=mask_rows, other=0)[:, None]
    else:  # unused placeholders (a JIT function cannot return None)
        lo_ptr = 0
        hi_ptr = 0
        doc_lo = 0
        doc_hi = 0
    if HAS_DROPOUT:
        seed_lo, seed_hi = _philox_seed(SEED)
        dropout_p = tl.cast(dropout_p, tl.float32)
    else:
        seed_lo = 0
        seed_hi = 0
    return doc_lo, doc_hi, lo_ptr, hi_ptr, seed_lo, seed_hi, dropout_p


@triton.jit
def _philox_seed(SEED):
    """The 64-bit dropout seed (int64 tensor of one element) as the two 32-bit Philox key words."""
    seed = tl.load(SEED)
    return (seed & 0xFFFFFFFF).to(tl.uint32), ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)


@triton.jit
def _dropout_keep(seed_lo, seed_hi, rows, cols, bh, dropout_p):
    """Dropout keep tile, True with probability 1 - dropout_p: Philox4x32-10 (Salmon et al., SC 2011) of the
    counter (j, i, b * Hq + h, 0) under the key (seed_lo, seed_hi), u = top 24 bits, kept iff u >= p. Each
    element has its own counter, so every kernel regenerates the same mask in any tile shape; our own rather
    than tl.rand so it runs interpreted and the counter holds i, j and the head without overflow."""
    c0 = (cols + 0 * rows).to(tl.uint32)
    c1 = (rows + 0 * cols).to(tl.uint32)
    c2 = c0 * 0 + bh.to(tl.uint32)
    c3 = c0 * 0
    k0 = seed_lo
    k1 = seed_hi
    for _ in tl.static_range(10):
        x0 = c0
        x2 = c2
        c0 = tl.umulhi(x2, 0xCD9E8D57) ^ c1 ^ k0
        c2 = tl.umulhi(x0, 0xD2511F53) ^ c3 ^ k1
        c1 = x2 * 0xCD9E8D57
        c3 = x0 * 0xD2511F53
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    u = (c0 >> 8).to(tl.float32) * 5.960464477539063e-08  # 2**-24
    return u >= dropout_p


@triton.jit
def _dropout_mask_kernel(SEED, OUT, H_Q, N_Q, N_K, dropout_p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Test helper: the kernels' `_dropout_keep` mask, int8 (B, Hq, Nq, Nk) contiguous, 1 = kept.
    Grid (cdiv(Nq, BLOCK_M), Hq, B)."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    seed_lo, seed_hi = _philox_seed(SEED)
    dropout_p = tl.cast(dropout_p, tl.float32)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    base = OUT + (b * H_Q + h) * N_Q * N_K
    for start_n in range(0, N_K, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        keep = _dropout_keep(seed_lo, seed_hi, rows[:, None], cols[None, :], b * H_Q + h, dropout_p)
        tl.store(
            base + rows[:, None].to(tl.int64) * N_K + cols[None, :],
            keep.to(tl.int8),
            mask=(rows[:, None] < N_Q) & (cols[None, :] < N_K),
        )
