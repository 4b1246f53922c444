"""FlashAttention-2 on the output of a fused qkv projection: qkv (B, N, 3, H, d) in, o (B, N, H, d) out.

Why a packed entry point: a GPT block computes q, k and v with one projection (qkv = x W_qkv) and views
the three slices of its output. With separate q, k, v the backward returns dq, dk and dv as three
tensors, and autograd concatenates them into d(qkv) before the projection's backward: a copy of
3 * B * N * H * d elements per layer (302 MB read and written at B = 32, N = 1024, C = 768; bench/NOTES.md
v10). Here the backward kernels write dq, dk and dv straight into the three slices of one d(qkv) tensor,
so there is nothing to concatenate. FlashAttention-2's `flash_attn_qkvpacked_func` exists for the same
reason (Dao 2023; github.com/Dao-AILab/flash-attention, flash_attn_interface.py).

Same kernels, tiles and arithmetic as `flash_attention(q, k, v)` on the views q = qkv[:, :, 0].transpose(1, 2)
(and k, v likewise): outputs and gradients are bitwise equal (tested). Operators, as in `flash_attn.py`:
triton ops `flashgpt::flash_attn_qkvpacked_fwd` / `_bwd` for CUDA tensors (traced into compiled graphs)
and opaque custom ops `..._cpu` with fake implementations for the Triton interpreter.
"""

import torch

from ._checks import _type_name
from .flash_attn import SUPPORTED_DTYPES, _launch_bwd, _launch_fwd, _plain_eager_call, _prepare_call
from .flash_attn import _fwd_fake as _unpacked_fwd_fake
from .flash_attn import _packed_views as _views


def _forward(qkv, causal, softmax_scale, window, q_doc, k_doc, dropout_p, dropout_seed, traced):
    o, lse = _launch_fwd(*_views(qkv), causal, softmax_scale, traced, window, q_doc, k_doc, dropout_p,
                         dropout_seed)
    return o.transpose(1, 2), lse  # o (B, N, H, d): laid out as q, so contiguous for a contiguous qkv


def _backward(do, qkv, o, lse, causal, softmax_scale, dlse, window, q_doc, k_doc, dropout_p, dropout_seed,
              deterministic, traced):
    dqkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)  # (B, N, 3, H, d)
    _launch_bwd(do.transpose(1, 2), *_views(qkv), o.transpose(1, 2), lse, causal, softmax_scale, dlse, traced,
                window, q_doc, k_doc, dropout_p, dropout_seed, dqkv=dqkv, deterministic=deterministic)
    return dqkv


def _fwd_body(
    qkv: torch.Tensor, causal: bool, softmax_scale: float, window: int = 0, q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None, dropout_p: float = 0.0, dropout_seed: torch.Tensor | None = None,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward op: o (B, N, H, d) in qkv's dtype, lse float32 (B, H, N). Variants as `flash_attn_fwd`'s."""
    return _forward(qkv, causal, softmax_scale, window, q_doc, k_doc, dropout_p, dropout_seed, True)


def _bwd_body(
    do: torch.Tensor, qkv: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, causal: bool,
    softmax_scale: float, dlse: torch.Tensor | None = None, window: int = 0,
    q_doc: torch.Tensor | None = None, k_doc: torch.Tensor | None = None, dropout_p: float = 0.0,
    dropout_seed: torch.Tensor | None = None, deterministic: bool = False,
) -> torch.Tensor:
    """Backward op: d(qkv), a new contiguous (B, N, 3, H, d) tensor in qkv's dtype; the backward kernels as
    `flash_attn_bwd` picks them (deterministic: the split Triton ones)."""
    return _backward(do, qkv, o, lse, causal, softmax_scale, dlse, window, q_doc, k_doc, dropout_p,
                     dropout_seed, deterministic, True)


def _fwd_fake(qkv, causal, softmax_scale, window=0, q_doc=None, k_doc=None, dropout_p=0.0, dropout_seed=None,
              deterministic=False):
    o, lse = _unpacked_fwd_fake(*_views(qkv), causal, softmax_scale)  # the layout _forward gives
    return o.transpose(1, 2), lse


def _bwd_fake(do, qkv, o, lse, causal, softmax_scale, dlse=None, window=0, q_doc=None, k_doc=None,
              dropout_p=0.0, dropout_seed=None, deterministic=False):
    return torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)


# one body, two registrations (as in flash_attn.py): traced into compiled graphs on CUDA, opaque with a
# fake implementation for the interpreter
fwd_op = torch.library.triton_op("flashgpt::flash_attn_qkvpacked_fwd", _fwd_body, mutates_args=())
bwd_op = torch.library.triton_op("flashgpt::flash_attn_qkvpacked_bwd", _bwd_body, mutates_args=())
fwd_op_cpu = torch.library.custom_op("flashgpt::flash_attn_qkvpacked_fwd_cpu", _fwd_body, mutates_args=())
bwd_op_cpu = torch.library.custom_op("flashgpt::flash_attn_qkvpacked_bwd_cpu", _bwd_body, mutates_args=())
fwd_op_cpu.register_fake(_fwd_fake)
bwd_op_cpu.register_fake(_bwd_fake)


def _save(ctx, qkv, o, lse, causal, softmax_scale, window, q_doc, k_doc, dropout_p, dropout_seed,
          deterministic=False):
    ctx.save_for_backward(qkv, o, lse, q_doc, k_doc, dropout_seed)
    ctx.causal, ctx.softmax_scale, ctx.window, ctx.dropout_p = causal, softmax_scale, window, dropout_p
    ctx.deterministic = deterministic


def _setup_context(ctx, inputs, output):
    _save(ctx, inputs[0], *output, *inputs[1:])


def _grads(ctx, do, dlse, backward_fn):
    """(d(qkv), None, ...) from the saved tensors; `backward_fn` has the backward op's signature. A missing
    dO (only lse used) is zeros."""
    qkv, o, lse, q_doc, k_doc, dropout_seed = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(o)
    dqkv = backward_fn(do, qkv, o, lse, ctx.causal, ctx.softmax_scale, dlse, ctx.window, q_doc, k_doc,
                       ctx.dropout_p, dropout_seed, ctx.deterministic)
    return (dqkv,) + (None,) * 8


fwd_op.register_autograd(lambda ctx, do, dlse: _grads(ctx, do, dlse, bwd_op), setup_context=_setup_context)
fwd_op_cpu.register_autograd(lambda ctx, do, dlse: _grads(ctx, do, dlse, bwd_op_cpu),
                             setup_context=_setup_context)


def _eager_backward(*args):
    return _backward(*args, False)


class _QKVPackedEager(torch.autograd.Function):
    """Plain eager mode: the same launchers without the op dispatcher (as `flash_attn._FlashAttnEager`)."""

    @staticmethod
    def forward(ctx, qkv, causal, softmax_scale, window, q_doc, k_doc, dropout_p, dropout_seed,
                deterministic):
        o, lse = _forward(qkv, causal, softmax_scale, window, q_doc, k_doc, dropout_p, dropout_seed, False)
        _save(ctx, qkv, o, lse, causal, softmax_scale, window, q_doc, k_doc, dropout_p, dropout_seed,
              deterministic)
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        # create_graph=True: through the backward op, whose node raises if anything differentiates again
        op = bwd_op if ctx.saved_tensors[0].is_cuda else bwd_op_cpu
        return _grads(ctx, do, dlse, op if torch.is_grad_enabled() else _eager_backward)


def flash_attention_qkvpacked(qkv, *, causal=True, softmax_scale=None, return_lse=False, window=None,
                              doc_ids=None, dropout_p=0.0, dropout_seed=None, deterministic=False):
    """`flash_attention` on the packed output of a fused qkv projection; the backward returns d(qkv) whole.

    Equal, bit for bit, to ``flash_attention(q, k, v, ...).transpose(1, 2)`` with q, k, v =
    ``qkv[:, :, i].transpose(1, 2)`` for i = 0, 1, 2, and the same for the gradients; but the backward kernels
    write dq, dk and dv into the slices of one (B, N, 3, H, d) tensor, so autograd does not concatenate them
    (one copy of d(qkv) per layer saved; the reason for FlashAttention-2's qkvpacked API).

    Args:
        qkv: (B, N, 3, H, d), float16 / bfloat16 / float32, CUDA (or CPU with TRITON_INTERPRET=1); e.g. a
            (B, N, 3 * H * d) projection output viewed as ``.view(B, N, 3, H, d)``. Any strides (a non-unit
            stride on the last dim costs a copy). d in [8, 256].
        causal, softmax_scale, return_lse, window, doc_ids, dropout_p, dropout_seed, deterministic: as in
            `flash_attention`
            (doc_ids (B, N); the sequence is shared by queries and keys).
    Returns:
        o (B, N, H, d) in qkv's dtype (contiguous for a contiguous qkv), and with return_lse also lse float32
        (B, H, N) in natural-log units. Differentiable to first order, with qkv's gradient a contiguous
        (B, N, 3, H, d) tensor.
    Raises:
        TypeError: qkv not a tensor or not float16 / bfloat16 / float32, return_lse not a bool, and the
            argument errors of `flash_attention`.
        ValueError: qkv not 5-D with size 3 in dim 2 (the message shows the expected view), an empty B, N or
            H, and the shape, device and variant errors of `flash_attention`.
        FlashAttentionUnavailableError: as `flash_attention` (no CUDA and no TRITON_INTERPRET=1, no triton).
    """
    if not isinstance(qkv, torch.Tensor):
        raise TypeError(f"qkv must be a torch.Tensor, got {type(qkv).__name__}")
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(
            f"qkv must be (B, N, 3, H, d), got shape {tuple(qkv.shape)}; view a (B, N, 3 * H * d) projection "
            "output as qkv.view(B, N, 3, H, d), or pass separate q, k, v to flash_attention"
        )
    # what the q, k, v checks of flash_attention would say about a view, said of qkv itself
    if qkv.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"qkv has dtype {qkv.dtype}; flash attention supports float16, bfloat16 and "
                        "float32 - cast with qkv.to(torch.bfloat16) (or float16/float32)")
    if 0 in (qkv.shape[0], qkv.shape[1], qkv.shape[3]):
        raise ValueError(f"qkv {tuple(qkv.shape)} has an empty dim (B, N and H must be >= 1); skip the call "
                         "for empty batches or sequences")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {_type_name(return_lse)}")
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    scale, variants = _prepare_call(*_views(qkv), causal, softmax_scale, window, doc_ids, dropout_p,
                                    dropout_seed, deterministic)
    if _plain_eager_call(qkv):
        o, lse = _QKVPackedEager.apply(qkv, causal, scale, *variants)
    else:
        o, lse = (fwd_op if qkv.is_cuda else fwd_op_cpu)(qkv, causal, scale, *variants)
    return (o, lse) if return_lse else o
