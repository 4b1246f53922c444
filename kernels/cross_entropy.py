"""The fused classifier loss: lm_head matmul, cross-entropy and the logits' gradient in one autograd function.

`F.cross_entropy` on (B T, V) logits costs a step two passes over them after the matmul: the forward reads
them for the log-sum-exp, the backward reads them again and writes their gradient. Here one kernel
(`_loss_kernel.py`) reads each row, takes its log-sum-exp and writes softmax - onehot over it in the
same pass, during the forward; the backward is then only the two matmuls, and the loss's scale g / n
multiplies their (B T, C) and (V, C) results instead of a (B T, V) tensor (llm.c's fused classifier;
bench/NOTES.md, "Next lead"). The gradient is written over the logits, as Inductor's unfused backward does:
one (B T, V) buffer lives from the forward to the backward (a separate gradient buffer cost 3.0 GiB of peak
memory at the default micro-batch, bench/NOTES.md). The model uses it for every training step on CUDA
(model/gpt.py, ``fused_loss_on``; FLASHGPT_FUSED_LOSS=0 turns it off): measured +2% tokens/sec at seq_len
1024 and 8192 (bench/NOTES.md, "The fused classifier loss").
"""

import torch
import torch.nn.functional as F

from ._launch import kernel_module, launcher
from ._runtime import device_ctx, interpret_enabled

BLOCK, NUM_WARPS = 8192, 8  # logits a program reads at once: 32 bf16 (four 16-byte loads) per thread
PROGRAMS_PER_SM = 2  # rows in flight: 2 x 132 SMs x 100 KB of GPT-2 logits fit the L2 (_loss_kernel.py)


def _launch(logits: torch.Tensor, targets: torch.Tensor, traced: bool) -> torch.Tensor:
    """Loss per row, float32 (M,), of logits (M, V) and targets (M,) (-1: ignored); the logits are
    overwritten by their gradient softmax - onehot."""
    if logits.dtype == torch.bfloat16 and interpret_enabled():  # numpy has no bfloat16: compute in float32
        wide = logits.float()
        loss = _launch(wide, targets, traced)
        logits.copy_(wide)
        return loss
    if logits.stride(-1) != 1:  # F.linear's output is row-major; a view of another layout goes via a copy
        rows = logits.contiguous()
        loss = _launch(rows, targets, traced)
        logits.copy_(rows)
        return loss
    M, V = logits.shape
    loss = torch.empty(M, dtype=torch.float32, device=logits.device)
    kern = kernel_module(interpret_enabled(), "_loss_kernel")._cross_entropy_kernel
    sms = torch.cuda.get_device_properties(logits.device).multi_processor_count if logits.is_cuda else 2
    with device_ctx(logits):
        launcher(kern, (min(M, PROGRAMS_PER_SM * sms),), traced)(
            logits, targets, loss, logits.stride(0), M, V, BLOCK=BLOCK, num_warps=NUM_WARPS
        )
    return loss


def _body(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Loss per row of logits (M, V), targets (M,) (target -1: zero); logits := softmax - onehot."""
    return _launch(logits, targets, traced=True)


def _fake(logits, targets):
    del targets
    return logits.new_empty(logits.shape[0], dtype=torch.float32)


# CUDA: a triton_op (torch.compile puts the launch in its graph); the CPU interpreter: an opaque custom op.
# Both mutate the logits: the compiled graph keeps the write in place because nothing else reads them.
_OP = torch.library.triton_op("flashgpt::cross_entropy_grad_", _body, mutates_args={"logits"})
_OP_CPU = torch.library.custom_op("flashgpt::cross_entropy_grad_cpu_", _body, mutates_args={"logits"})
_OP_CPU.register_fake(_fake)


class LinearCrossEntropy(torch.autograd.Function):
    """mean over targets != -1 of cross_entropy(x @ weight.T, targets); the gradients of x and weight."""

    @staticmethod
    def forward(ctx, x, weight, targets):
        logits = F.linear(x, weight)  # (M, V), in the autocast dtype under autocast
        loss_rows = (_OP if logits.is_cuda else _OP_CPU)(logits, targets)
        dlogits = logits  # the kernel wrote softmax - onehot over them: one (M, V) buffer, not two
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
