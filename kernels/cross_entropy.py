"""The fused classifier loss: lm_head matmul, cross-entropy and the logits' gradient in one autograd function.

`F.cross_entropy` on (B T, V) logits costs a step two passes over them after the matmul: the forward reads
them for the log-sum-exp, the backward reads them again and writes their gradient. Here one kernel
(`_loss_kernel.py`) reads each row, takes its log-sum-exp and writes softmax - onehot in the same pass,
during the forward; the backward is then only the two matmuls, and the loss's scale g / n multiplies their
(B T, C) and (V, C) results instead of a (B T, V) tensor (llm.c's fused classifier; bench/NOTES.md, "Next
lead"). The logits live as long as the kernel, their gradient from the forward to the backward; while the
kernel runs both are held, one (B T, V) buffer more than Inductor's unfused loss, which writes the gradient
over the logits (3.1 GiB at the default micro-batch). The model uses it for every training step on CUDA
(model/gpt.py, ``fused_loss_on``; FLASHGPT_FUSED_LOSS=0 turns it off): measured +2% tokens/sec at seq_len 1024
and 8192 (bench/NOTES.md, "The fused classifier loss").
"""

import torch
import torch.nn.functional as F

from ._launch import kernel_module, launcher
from ._runtime import device_ctx, interpret_enabled

BLOCK, NUM_WARPS = 8192, 8  # logits a program reads at once: 32 bf16 (four 16-byte loads) per thread
PROGRAMS_PER_SM = 2  # rows in flight: 2 x 132 SMs x 100 KB of GPT-2 logits fit the L2 (_loss_kernel.py)


def _launch(logits: torch.Tensor, targets: torch.Tensor, traced: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss per row float32 (M,), dlogits like logits) of logits (M, V) and targets (M,) (-1: ignored)."""
    if logits.dtype == torch.bfloat16 and interpret_enabled():  # numpy has no bfloat16: compute in float32
        loss, dlogits = _launch(logits.float(), targets, traced)
        return loss, dlogits.to(torch.bfloat16)
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    M, V = logits.shape
    loss = torch.empty(M, dtype=torch.float32, device=logits.device)
    dlogits = torch.empty((M, V), dtype=logits.dtype, device=logits.device)
    kern = kernel_module(interpret_enabled(), "_loss_kernel")._cross_entropy_kernel
    sms = torch.cuda.get_device_properties(logits.device).multi_processor_count if logits.is_cuda else 2
    with device_ctx(logits):
        launcher(kern, (min(M, PROGRAMS_PER_SM * sms),), traced)(
            logits, targets, loss, dlogits, logits.stride(0), dlogits.stride(0), M, V, BLOCK=BLOCK,
            num_warps=NUM_WARPS,
        )  # fmt: skip
    return loss, dlogits


def _body(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss per row, softmax - onehot) of logits (M, V) and targets (M,); rows with target -1 are zero."""
    return _launch(logits, targets, traced=True)


def _fake(logits, targets):
    del targets
    return logits.new_empty(logits.shape[0], dtype=torch.float32), logits.new_empty(logits.shape)


# CUDA: a triton_op (torch.compile puts the launch in its graph); the CPU interpreter: an opaque custom op
_OP = torch.library.triton_op("flashgpt::cross_entropy_grad", _body, mutates_args=())
_OP_CPU = torch.library.custom_op("flashgpt::cross_entropy_grad_cpu", _body, mutates_args=())
_OP_CPU.register_fake(_fake)


class LinearCrossEntropy(torch.autograd.Function):
    """mean over targets != -1 of cross_entropy(x @ weight.T, targets); the gradients of x and weight."""

    @staticmethod
    def forward(ctx, x, weight, targets):
        logits = F.linear(x, weight)  # (M, V), in the autocast dtype under autocast
        loss_rows, dlogits = (_OP if logits.is_cuda else _OP_CPU)(logits, targets)
        n = (targets != -1).sum()
        ctx.save_for_backward(x, weight, dlogits, n)
        return loss_rows.sum() / n

    @staticmethod
    def backward(ctx, g):
        x, weight, dlogits, n = ctx.saved_tensors
        scale = (g / n).to(torch.float32)  # d(loss) / d(logits) = g / n (softmax - onehot)
        dx = (dlogits @ weight.to(dlogits.dtype)).float() * scale  # (M, C)
        dw = (dlogits.t() @ x.to(dlogits.dtype)).float() * scale  # (V, C)
        return dx.to(x.dtype), dw.to(weight.dtype), None


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of the logits x @ weight.T (x (M, C), weight (V, C)) over the targets (M,) that
    are not -1 (F.cross_entropy's ignore_index=-1), float32; differentiable in x and weight. Targets must lie
    in [-1, V): the kernel does not check them (the data loader does)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x (M, C) and weight (V, C) needed, got {tuple(x.shape)} and {tuple(weight.shape)}")
    if targets.shape != x.shape[:1]:
        raise ValueError(f"targets must be (M,) = {tuple(x.shape[:1])}, got {tuple(targets.shape)}")
    return LinearCrossEntropy.apply(x, weight, targets)
