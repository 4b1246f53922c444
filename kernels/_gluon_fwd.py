"""Hopper (sm_90) causal FlashAttention forward in Gluon: a TMA producer warp, two consumer warpgroups.

`flash_attn._launch_fwd` runs it instead of the Triton forward (`_triton_kernels._fwd_kernel`) where it
was measured faster: `kernels._gluon_route.route` says when (sm_90, causal, Nq == Nk, d 64 / 128, bf16 /
fp16, no variants, TMA-compatible strides, N from MIN_N up). The Triton kernel stays the one of the CPU
interpreter (Gluon's warp specialisation and asynchronous wgmma have none), other GPUs, other shapes and
the variants. The backward is unchanged: o
and LSE are written as `_fwd_kernel` writes them.

Schedule, after FlashAttention-3 (Shah et al. 2024, arXiv:2407.08608, section 3.1-3.2):
- warp specialisation: one producer warp (24 registers) issues the TMA loads of the two Q halves and of a
  ring of K and V tiles; two consumer warpgroups of 4 warps (240 registers each) own 64 query rows each
  of the program's 128 and share every K / V tile;
- intra-warpgroup overlap (section 3.2): step j issues S_j = Q K_j^T and O += P_{j-1} V_{j-1} together,
  waits for S_j only, runs the softmax of S_j under P_{j-1} V_{j-1}, then waits for it and rescales O.
  Nothing stays in flight across the loop's back edge, and P goes to the tensor cores from registers;
- causal: query blocks in reverse order (the longest rows start first); BLOCK_N = 128 = the program's
  rows, so only the diagonal key block is masked, and it is visited first (keys walk down to block 0,
  as in FlashAttention-3), which leaves the loop without a mask or a branch.
Measured and not kept (bench/NOTES.md v13): FlashAttention-3's ping-pong of the two warpgroups (an
mbarrier pair ordering their matrix products) gave nothing here.

Layouts: q (B, Hq, N, d), k and v (B, Hkv, N, d) with any strides whose last is 1 (the TMA descriptors
are built on the device per (batch, head), so views of a packed qkv work); o in q's layout; LSE
(B, Hq, N) float32 in natural-log units.
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


@gluon.jit
def _head_descriptor(base, N, stride_n, BLOCK: gl.constexpr, HEAD_D: gl.constexpr):
    """A TMA descriptor over one (batch, head)'s rows of ``base`` ((N, d), row stride ``stride_n``, last
    stride 1): BLOCK x d tiles, zero-filled past row N. Built on the device (Triton's scratch allocator)."""
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, HEAD_D], base.dtype.element_ty)
    return tma.make_tensor_descriptor(base, [N, HEAD_D], [stride_n, 1], [BLOCK, HEAD_D], layout)


@gluon.jit
def _barriers(COUNT: gl.constexpr, ARRIVALS: gl.constexpr):
    """COUNT mbarriers in shared memory, each completing a phase after ARRIVALS arrivals (or one TMA
    transaction count)."""
    bars = gl.allocate_shared_memory(gl.int64, [COUNT, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(COUNT):
        mbarrier.init(bars.index(i), count=ARRIVALS)
    return bars


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_bars, k_ready, k_empty, v_ready, v_empty,
            m0, n_blocks, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Producer (1 warp): the two Q halves once, then the j-th key block's K and V (the diagonal block
    first, then down to block 0) into ring slot j % STAGES as both consumers free it."""
    for w in gl.static_range(2):
        mbarrier.expect(q_bars.index(w), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [m0 + w * 64, 0], q_bars.index(w), q_bufs.index(w))
    for j in range(n_blocks):
        slot = j % STAGES
        phase = (j // STAGES) & 1
        # -- K_j: its slot is free once both warpgroups waited for S_{j - STAGES} (barriers start with
        #    phase 1 complete, so the first pass does not wait)
        mbarrier.wait(k_empty.index(slot), phase ^ 1)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        n0 = (n_blocks - 1 - j) * BLOCK_N  # the diagonal block first (see _consumer)
        tma.async_copy_global_to_shared(k_desc, [n0, 0], k_ready.index(slot), k_bufs.index(slot))
        # -- V_j: free once both waited for P_{j - STAGES} V_{j - STAGES}
        mbarrier.wait(v_empty.index(slot), phase ^ 1)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [n0, 0], v_ready.index(slot), v_bufs.index(slot))


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale, r0, n0, MASK: gl.constexpr, BLOCK_N: gl.constexpr,
                  s_layout: gl.constexpr, p_layout: gl.constexpr, DTYPE: gl.constexpr):
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
def _kv_step(q_smem, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, acc, p, m_i, l_i, j, r0,
             qk_scale, s_zero, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
             s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr):
    """Step j >= 1 (a full key block): S_j and P_{j-1} V_{j-1} issued together, the softmax of S_j under the
    latter."""
    slot = j % STAGES
    prev = (j - 1) % STAGES
    mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
    mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
    s = warpgroup_mma(q_smem, k_bufs.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    acc = warpgroup_mma(p, v_bufs.index(prev), acc, is_async=True)
    # S_j (the older group) done; P_{j-1} V_{j-1} still running
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
    mbarrier.arrive(k_empty.index(slot), count=1)
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale, r0, 0, False, BLOCK_N, s_layout, p_layout,
                                       q_smem.dtype)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(v_empty.index(prev), count=1)
    # -- O = diag(alpha) O: rescale to the new row max before P_j V_j is added
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    return acc, p, m_i, l_i


@gluon.jit
def _consumer(q_bufs, k_bufs, v_bufs, q_bars, k_ready, k_empty, v_ready, v_empty,
              O, LSE, o_off, stride_on, lse_off, m0, n_blocks, N, qk_scale,
              WG: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr):
    """Consumer warpgroup WG (4 warps): query rows m0 + 64 WG .. + 63; S = Q K^T, online softmax, O += P V."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    dtype: gl.constexpr = q_bufs.dtype
    q_smem = q_bufs.index(WG)
    r0 = m0 + WG * 64

    m_i = gl.full([64], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.full([64], 0.0, gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([64, HEAD_D], gl.float32, layout=o_layout)
    s_zero = gl.zeros([64, BLOCK_N], gl.float32, layout=s_layout)
    last = n_blocks - 1

    # -- step 0: the diagonal key block (the last one), masked; FlashAttention-3 also walks the keys from
    #    the diagonal down, so that no later step needs a mask or a branch
    mbarrier.wait(q_bars.index(WG), 0)
    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    mbarrier.arrive(k_empty.index(0), count=1)
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale, r0, last * BLOCK_N, True, BLOCK_N, s_layout,
                                       p_layout, dtype)

    # -- steps 1 .. last: key blocks last - 1 down to 0, all full
    for j in range(1, n_blocks):
        acc, p, m_i, l_i = _kv_step(q_smem, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, acc, p,
                                    m_i, l_i, j, r0, qk_scale, s_zero, BLOCK_N, STAGES,
                                    s_layout, o_layout, p_layout)

    # -- O += P V of the last step (key block 0)
    slot = last % STAGES
    mbarrier.wait(v_ready.index(slot), (last // STAGES) & 1)
    acc = warpgroup_mma(p, v_bufs.index(slot), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(v_empty.index(slot), count=1)

    # -- epilogue: O = acc / l, LSE = (m + log2 l) ln 2 (m is in scaled base-2 units); rows past N are
    #    not stored
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    out = (acc / l_o[:, None]).to(dtype)
    rows_o = r0 + gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout))
    cols_o = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, o_layout))
    gl.store(O + o_off + rows_o[:, None] * stride_on + cols_o[None, :], out, mask=rows_o[:, None] < N)
    rows_s = r0 + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
    gl.store(LSE + lse_off + rows_s, lse, mask=rows_s < N)


@gluon.jit
def _fwd_ws_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_on,
    H_Q, GROUP, N, qk_scale,
    HEAD_D: gl.constexpr, STAGES: gl.constexpr,
):
    """Causal forward, one program per (128 query rows, batch * head), heaviest query blocks first.
    qk_scale = softmax_scale * log2(e) (exp2 with the scale folded in). Launch with num_warps=4 (the
    default partition is consumer warpgroup 0) and maxnreg=168 (12 warps: 240 + 240 + 24 registers)."""
    BLOCK_N: gl.constexpr = 128
    pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // H_Q
    h = bh % H_Q
    hk = h // GROUP
    m0 = pid_m * 128
    n_blocks = gl.cdiv(gl.minimum(m0 + 128, N), BLOCK_N)
    dtype: gl.constexpr = Q.dtype.element_ty

    # -- one 2D TMA descriptor per (batch, head): rows = positions, columns = d; zero past row N
    q_desc = _head_descriptor(Q + b * stride_qb + h * stride_qh, N, stride_qn, 64, HEAD_D)
    k_desc = _head_descriptor(K + b * stride_kb + hk * stride_kh, N, stride_kn, BLOCK_N, HEAD_D)
    v_desc = _head_descriptor(V + b * stride_vb + hk * stride_vh, N, stride_vn, BLOCK_N, HEAD_D)

    q_bufs = gl.allocate_shared_memory(dtype, [2, 64, HEAD_D], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    q_bars = _barriers(2, 1)
    k_ready, v_ready = _barriers(STAGES, 1), _barriers(STAGES, 1)
    k_empty, v_empty = _barriers(STAGES, 2), _barriers(STAGES, 2)  # both warpgroups release a slot

    o_off = b * stride_ob + h * stride_oh
    lse_off = bh * N
    gl.warp_specialize(
        [
            (_consumer, (q_bufs, k_bufs, v_bufs, q_bars, k_ready, k_empty, v_ready, v_empty, O, LSE, o_off,
                         stride_on, lse_off, m0, n_blocks, N, qk_scale, 0, BLOCK_N, HEAD_D, STAGES)),
            (_consumer, (q_bufs, k_bufs, v_bufs, q_bars, k_ready, k_empty, v_ready, v_empty, O, LSE, o_off,
                         stride_on, lse_off, m0, n_blocks, N, qk_scale, 1, BLOCK_N, HEAD_D, STAGES)),
            (_loader, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_bars, k_ready, k_empty, v_ready,
                       v_empty, m0, n_blocks, BLOCK_N, STAGES)),
        ],
        [4, 1],
        [240, 24],
    )


# head_dim -> K/V ring stages; shared memory = 2 * 64 * d (Q) + 2 * STAGES * 128 * d (K, V) bf16:
# d = 64: 208 KiB at 6 stages; d = 128: 160 KiB at 2 (H200 A/B, NOTES v13: 6 over 4 stages +1.6-2.9% at
# d = 64; 3 stages at d = 128, 224 KiB, level)
STAGES = {64: 6, 128: 2}
NUM_WARPS, MAXNREG = 4, 168


def fwd_launch(q, k, v, o, lse, softmax_scale: float) -> None:
    """Launch the causal forward: fills o (q's shape; any strides) and lse (B, Hq, N) float32
    contiguous, natural log.

    q (B, Hq, N, d), k and v (B, Hkv, N, d) with Hq % Hkv == 0, bf16 or fp16 on a CUDA sm_90 device,
    d in STAGES, last stride 1 and the other strides and the base addresses 16-byte aligned (TMA). The
    caller checks these (`_gluon_route.route`) and sets Triton's scratch allocator (the device-side
    descriptors live there); this only launches.
    """
    B, Hq, N, d = (int(x) for x in q.shape)
    grid = (triton.cdiv(N, 128), B * Hq)
    _fwd_ws_kernel[grid](
        q, k, v, o, lse,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
        Hq, Hq // int(k.shape[1]), N, softmax_scale * 1.4426950408889634,
        HEAD_D=d, STAGES=STAGES[d], num_warps=NUM_WARPS, maxnreg=MAXNREG,
    )


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float) -> tuple[Tensor, Tensor]:
    """(o, lse) of the causal forward for inputs that `_gluon_route.route` accepts: o like q (its dim order),
    lse float32 (B, Hq, N) natural log. Eager calls launch through this; traced ones go through `forward`."""
    from .flash_attn import _device_ctx, _empty_like_layout, ensure_scratch_allocator

    ensure_scratch_allocator()  # the device-side TMA descriptors live in Triton's global scratch
    o = _empty_like_layout(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    with _device_ctx(q):
        fwd_launch(q, k, v, o, lse, softmax_scale)
    return o, lse


# An opaque custom op: Inductor cannot trace a Gluon kernel into its graph (it re-emits user kernels as
# @triton.jit source, where Gluon's annotations fail: NOTES v9), so a compiled graph calls this op.
forward = torch.library.custom_op("flashgpt::flash_attn_fwd_sm90", run, mutates_args=())


@forward.register_fake
def _forward_fake(q, k, v, softmax_scale):
    from .flash_attn import _empty_like_layout

    return _empty_like_layout(q), q.new_empty(q.shape[:3], dtype=torch.float32)
