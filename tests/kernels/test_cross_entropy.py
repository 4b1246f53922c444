"""The fused classifier loss `linear_cross_entropy` (kernels/cross_entropy.py): one grid over {interpreter,
cuda}, small shapes under the Triton interpreter, GPT-2's vocabulary on the GPU.

Accuracy, FlashAttention's rule: err <= 2 * err_pt + tol, err the largest difference of the loss, d(x) and
d(weight) from a float64 PyTorch reference, err_pt the same for PyTorch's own path in the input dtype (the
model's F.cross_entropy on the lm_head's logits). Fresh seeded inputs per test (a failure prints the seed).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels import cross_entropy as ce  # the @triton.jit kernel is imported at the first launch
from model.gpt import FUSED_LOSS, fused_loss_on
from tests.kernel_modes import DEVICES, enter

REPO = Path(__file__).resolve().parents[2]
# (M rows, C, V): V below, at and across the kernel's block of ce.BLOCK logits, odd sizes for the masked tail
SHAPES_CPU = [(5, 8, 7), (33, 16, ce.BLOCK), (17, 24, ce.BLOCK + 301)]
SHAPES_GPU = SHAPES_CPU + [(4096, 768, 50304), (1000, 128, 50257), (257, 64, 3 * ce.BLOCK + 5)]


def _inputs(seed, M, C, V, device):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(M, C, generator=g)
    w = torch.randn(V, C, generator=g) * 0.5  # logits of a few units: a peaked softmax, as after training
    t = torch.randint(0, V, (M,), generator=g)
    t[torch.rand(M, generator=g) < 0.2] = -1  # ignored rows
    t[0] = V - 1  # the last column, in the masked tail when V is not a multiple of the block
    return x.to(device), w.to(device), t.to(device)


def _loss_and_grads(fn, x, w, t, dtype):
    x = x.detach().to(dtype).requires_grad_()
    w = w.detach().to(dtype).requires_grad_()
    loss = fn(x, w, t)
    loss.backward()
    return loss.detach().double(), x.grad.double(), w.grad.double()


def _torch_path(x, w, t):  # the model's unfused loss: logits in the input dtype, a float32 softmax
    return F.cross_entropy(F.linear(x, w).float(), t, ignore_index=-1)


def _grid() -> list:
    """(device, shape, dtype, seed): the interpreter on the small shapes in float32 / float16 (its bfloat16
    loads are wrong), CUDA on every shape and dtype."""
    F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
    cells = [(d, s, dt) for d in DEVICES for s in SHAPES_CPU for dt in (F32, F16) if d.id == "interpreter"]
    cells += [(d, s, dt) for d in DEVICES for s in SHAPES_GPU for dt in (F32, F16, BF16) if d.id == "cuda"]
    ids = [f"{d.id}-{s}-{str(dt)[6:]}".replace(" ", "") for d, s, dt in cells]
    return [pytest.param(d.values[0], s, dt, i, marks=d.marks, id=i_) for i, ((d, s, dt), i_) in
            enumerate(zip(cells, ids, strict=True))]  # fmt: skip


def _err(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a, b, strict=True))


@pytest.mark.parametrize(("device", "shape", "dtype", "seed"), _grid())
def test_against_float64(device, shape, dtype, seed, monkeypatch):
    dev = enter(device, monkeypatch)
    x, w, t = _inputs(seed, *shape, dev)
    ref = _loss_and_grads(_torch_path, x, w, t, torch.float64)
    ours = _loss_and_grads(ce.linear_cross_entropy, x, w, t, dtype)
    pt = _loss_and_grads(_torch_path, x, w, t, dtype)
    err, err_pt = _err(ours, ref), _err(pt, ref)
    assert err <= 2 * err_pt + 1e-6, f"seed {seed}: err {err:.3e}, PyTorch's {err_pt:.3e}"


@pytest.mark.parametrize("device", DEVICES)
def test_all_ignored_and_one_row(device, monkeypatch):
    """One row and V = 1 (lse = x, loss 0 up to the rounding of exp2 / log2: 4e-9 on an H100); all rows
    ignored: NaN, as F.cross_entropy gives."""
    dev = enter(device, monkeypatch)
    x, w = torch.randn(1, 4, device=dev), torch.randn(1, 4, device=dev)
    assert abs(ce.linear_cross_entropy(x, w, torch.zeros(1, dtype=torch.long, device=dev)).item()) <= 1e-6
    x, w, t = _inputs(7, 6, 8, 50, dev)
    assert ce.linear_cross_entropy(x, w, torch.full_like(t, -1)).isnan().item()
    assert F.cross_entropy(x @ w.t(), torch.full_like(t, -1), ignore_index=-1).isnan().item()


@pytest.mark.gpu
@pytest.mark.parametrize("fused", ["1", "0"])
def test_model_training_step_takes_the_fused_loss(fused, monkeypatch):
    """GPT's training call (return_logits=False, grad on, CUDA): the fused loss when FLASHGPT_FUSED_LOSS=1,
    F.cross_entropy when 0; both agree with the float64 loss of the same logits to PyTorch's bf16 error."""
    enter("cuda", monkeypatch)
    from model import GPT, GPTConfig

    monkeypatch.setenv(FUSED_LOSS, fused)
    torch.manual_seed(3)
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=256, vocab_size=50304, attention="sdpa")
    m = GPT(cfg).cuda()
    idx = torch.randint(0, 50304, (4, 256), device="cuda")
    with torch.autocast("cuda", torch.bfloat16):
        logits, loss = m(idx, idx, return_logits=False)
    assert logits is None
    loss.backward()
    assert (type(loss.grad_fn).__name__ == "LinearCrossEntropyBackward") == (fused == "1"), type(loss.grad_fn)
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        ref = F.cross_entropy(m(idx)[0].double().flatten(0, 1), idx.flatten())
    assert abs(loss.item() - ref.item()) < 2e-2, (loss.item(), ref.item())
    assert all(p.grad is not None and p.grad.isfinite().all() for p in m.parameters())


@pytest.mark.gpu
def test_compiled_training_step_equals_the_unfused_one(monkeypatch):
    """The trainer's compiled step (torch.compile, bf16 autocast, flash): the fused loss traces into the graph
    and gives F.cross_entropy's loss and parameter gradients to bf16 rounding."""
    import copy

    enter("cuda", monkeypatch)
    from model import GPT, GPTConfig

    torch.manual_seed(5)
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=256, vocab_size=50304, attention="flash")
    base, idx = GPT(cfg).cuda(), torch.randint(0, 50304, (8, 256), device="cuda")
    out = {}
    for fused in ("0", "1"):
        monkeypatch.setenv(FUSED_LOSS, fused)
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        with torch.autocast("cuda", torch.bfloat16):
            _, loss = torch.compile(model)(idx, idx, return_logits=False)
        loss.backward()
        out[fused] = loss.item(), [p.grad.float() for p in model.parameters()]
    (loss0, grads0), (loss1, grads1) = out["0"], out["1"]
    assert abs(loss0 - loss1) < 1e-2, (loss0, loss1)
    for a, b in zip(grads0, grads1, strict=True):
        assert ((a - b).norm() / a.norm().clamp_min(1e-12)).item() < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_one_logits_buffer(compiled, monkeypatch):
    """The gradient is written over the logits, eager and under torch.compile (which must keep the op's write
    in place): the loss's forward and backward together hold one (M, V) buffer at their peak, not two."""
    enter("cuda", monkeypatch)
    M, C, V = 8192, 256, 50304
    buf = M * V * 2  # one bf16 (M, V) buffer, 824 MB
    x, w, t = _inputs(11, M, C, V, "cuda")
    x, w = x.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    fn = torch.compile(ce.linear_cross_entropy) if compiled else ce.linear_cross_entropy
    fn(x, w, t).backward()  # compile and load the kernel first
    x.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(x, w, t).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    mib = f"peak {extra / 2**20:.0f} MiB above the inputs, one buffer {buf / 2**20:.0f} MiB"
    assert buf <= extra < 1.5 * buf, mib


def test_env_value_is_checked(monkeypatch):
    monkeypatch.setenv(FUSED_LOSS, "yes")
    with pytest.raises(ValueError, match="FLASHGPT_FUSED_LOSS=.yes.: use 1"):
        fused_loss_on()
    monkeypatch.setenv(FUSED_LOSS, "0")
    assert not fused_loss_on()
    monkeypatch.delenv(FUSED_LOSS)
    assert fused_loss_on()  # on by default: measured faster at seq_len 1024 and 8192 (bench/NOTES.md)


def test_shapes_are_checked():
    x, w = torch.randn(3, 4), torch.randn(10, 4)
    with pytest.raises(ValueError, match=r"weight \(V, C\)"):
        ce.linear_cross_entropy(x, torch.randn(10, 5), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"targets must be \(M,\) = \(3,\)"):
        ce.linear_cross_entropy(x, w, torch.zeros(3, 1, dtype=torch.long))


def test_kernel_compiles_for_sm90():
    """No GPU here: compile the kernel for sm_90 as a launch would (a fresh process without
    TRITON_INTERPRET). Its registers let PROGRAMS_PER_SM programs share an SM (64K registers), nothing
    spills, and GPT-2's padded vocabulary (50,304, a multiple of 16) gets 16-byte loads only."""
    code = f"""
import os, sys, torch, triton
if not os.path.exists(triton.knobs.nvidia.ptxas.path): print('SKIP no ptxas'); sys.exit(0)
from kernels.compile_report import compile_loss_kernel
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    info = compile_loss_kernel(dtype)
    assert info['registers'] * {ce.NUM_WARPS * 32 * ce.PROGRAMS_PER_SM} <= 65536, (dtype, info)
    assert info['spill_store_bytes'] == info['spill_load_bytes'] == 0, (dtype, info)
    assert info['v4_loads'] >= info['loads'] - 2, (dtype, info)  # the target's load is one element
# twice the warps for the same block: half the logits per thread, so fewer registers (the loss search's grid)
wide = compile_loss_kernel(torch.bfloat16, block={ce.BLOCK}, num_warps={2 * ce.NUM_WARPS})
assert wide['registers'] < compile_loss_kernel(torch.bfloat16)['registers'], wide
print('ok')
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True)
    if "SKIP" in out.stdout:
        pytest.skip("Triton's NVIDIA backend (ptxas) is not available")
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
