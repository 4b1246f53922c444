"""Triton kernel of the fused classifier loss (kernels/cross_entropy.py): cross-entropy and its gradient in
one pass over the logits, as llm.c's fused classifier does.

Each program walks rows pid, pid + P, ... (P programs, a few per SM) and reads every row twice: once for its
log-sum-exp, once to write softmax - onehot. The second read should come from L2, so the rows in flight are
bounded: P rows of V logits (GPT-2: 50,304 bf16, 100 KB) must fit the L2 next to the gradient being written
(2 programs per SM on an H100/H200: 264 rows, 26 MB of its 50 MB). One program per row would put every
resident program's row in flight at once (16 per SM at 4 warps: 210 MB) and read each row twice from HBM.
"""

import triton
import triton.language as tl

from ._triton_common import _max0, _row_max, _sum0  # noqa: F401 - _row_max: kernel_module's mode check

LOG2E = tl.constexpr(1.4426950408889634)  # globals in a kernel must be constexpr
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _cross_entropy_kernel(LOGITS, TARGETS, LOSS, stride_row, M, V, BLOCK: tl.constexpr):
    """Row r: LOSS[r] = logsumexp(x) - x[t], and x overwritten by softmax(x) - onehot(t), t = TARGETS[r];
    both zero for t = -1 (ignored). Computed in float32 from logits of any float dtype. In place: each block
    of the row is read before the same program writes it."""
    cols = tl.arange(0, BLOCK)
    for row in range(tl.program_id(0), M, tl.num_programs(0)):
        r = tl.cast(row, tl.int64)  # M x V passes 2^31 (GPT-2: 32,768 x 50,304 = 1.6e9 is near)
        x_row = LOGITS + r * stride_row
        t = tl.load(TARGETS + row).to(tl.int32)

        # -- pass 1: running max and sum of exponentials per lane, base 2 (m starts at a finite floor, not
        #    -inf: a lane that only sees the masked tail keeps exp2(-inf - floor) = 0 instead of NaN)
        m = tl.full([BLOCK], -1.0e30, tl.float32)
        s = tl.full([BLOCK], 0.0, tl.float32)  # tl.full, not tl.zeros: see `_triton_common._row_max`
        for start in range(0, V, BLOCK):
            c = start + cols
            x = tl.load(x_row + c, mask=c < V, other=float("-inf")).to(tl.float32) * LOG2E
            m_new = tl.maximum(m, x)
            s = s * tl.math.exp2(m - m_new) + tl.math.exp2(x - m_new)
            m = m_new
        # -- combine the lanes: lse2 = log2 sum_j 2^x_j
        m_row = _max0(m)
        lse2 = m_row + tl.math.log2(_sum0(s * tl.math.exp2(m - m_row)))

        # -- the loss, natural log: (lse2 - x_t log2 e) ln 2
        keep = t >= 0
        x_t = tl.load(x_row + tl.where(keep, t, 0)).to(tl.float32) * LOG2E
        tl.store(LOSS + row, tl.where(keep, (lse2 - x_t) * LN2, 0.0))

        # -- pass 2: the gradient of the row's loss, softmax - onehot, from the row read again (L2), written
        #    over it
        for start in range(0, V, BLOCK):
            c = start + cols
            x = tl.load(x_row + c, mask=c < V, other=0.0).to(tl.float32) * LOG2E
            g = tl.math.exp2(x - lse2) - tl.where(c == t, 1.0, 0.0)
            g = tl.where(keep, g, 0.0)
            tl.store(x_row + c, g.to(LOGITS.dtype.element_ty), mask=c < V)
