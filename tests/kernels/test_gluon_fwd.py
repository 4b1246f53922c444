"""CPU tests of the sm_90 Gluon kernels (kernels/_gluon_fwd.py, _gluon_bwd.py): they compile for sm_90 as
launched (asynchronous wgmma, TMA, within a block's shared memory, no or few spills), and `route` /
`route_bwd` keep them off CPU tensors and reject a bad FLASHGPT_GLUON_FWD / FLASHGPT_GLUON_BWD. Their
numerics are tested on the GPU (tests/kernels/test_gluon_fwd_gpu.py, test_gluon_bwd_gpu.py): Gluon has no
interpreter."""

import pytest
import torch

_COMPILE_ALL = """
import dataclasses, json, torch
from kernels.compile_report import compile_gluon
out = []
for which in ("fwd", "bwd"):
    for d in (64, 128):
        for dtype in (torch.bfloat16, torch.float16):
            info = compile_gluon(which, d, dtype)
            out.append(dict(dataclasses.asdict(info), config=None, line=info.line()))
print(json.dumps(out))
"""


def test_gluon_kernels_compile_for_sm90():
    """Forward and backward, d 64 / 128 x bf16 / fp16, as `run` launches them. In a fresh
    process: the Triton interpreter, which other tests run in this one, patches triton's math functions that
    Gluon's call too. The backward at d = 128 may spill a few registers (NOTES v14: 36 / 56 bytes, measured
    at 1.03-1.06x cuDNN), never more than 64 bytes."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_ALL], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[2], timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    infos = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(infos) == 8
    for info in infos:
        assert info["shared_bytes"] <= 227 * 1024, info["line"]
        budget = 64 if info["kernel"] == "gluon_bwd" and info["head_dim"] == 128 else 0
        assert info["spill_store_bytes"] <= budget and info["spill_load_bytes"] <= budget, info["line"]
        assert info["uses_wgmma"] and info["uses_tma"] and not info["wgmma_serialized"], info["line"]


def test_gluon_compile_rejects_what_the_route_never_sends():
    from kernels.compile_report import compile_gluon

    with pytest.raises(ValueError, match="d in \\[64, 128\\]"):
        compile_gluon("fwd", 96)
    with pytest.raises(ValueError, match="d in \\[64, 128\\]"):
        compile_gluon("bwd", 80)
    with pytest.raises(ValueError, match="bf16 / fp16"):
        compile_gluon("fwd", 64, torch.float32)


def test_serialization_warnings_are_recognised():
    from kernels.compile_report import _wgmma_serialized

    assert _wgmma_serialized("ptxas info    : (C7513) Potential Performance Loss: wgmma.mma_async ...")
    assert _wgmma_serialized("warning (C7515) ...")
    assert not _wgmma_serialized("ptxas info : Used 168 registers")


def test_route_off_the_gpu_and_bad_mode(monkeypatch):
    from kernels import plan as _gluon_route

    q = torch.randn(1, 2, 8192, 128, dtype=torch.bfloat16)
    monkeypatch.setenv(_gluon_route.ENV, "1")
    # CPU tensors: never
    assert _gluon_route.plan_fwd(q, q, q, True, 0.125, 0, None, 0.0).backend == "triton"
    monkeypatch.setenv(_gluon_route.ENV, "on")
    with pytest.raises(ValueError, match="FLASHGPT_GLUON_FWD='on'"):
        _gluon_route.plan_fwd(q, q, q, True, 0.125, 0, None, 0.0)


def test_route_bwd_off_the_gpu_and_bad_mode(monkeypatch):
    from kernels import plan as _gluon_route

    q = torch.randn(1, 2, 8192, 64, dtype=torch.bfloat16)
    monkeypatch.setenv(_gluon_route.ENV_BWD, "1")
    # CPU: never
    assert _gluon_route.plan_bwd(q, q, q, q, q, True, 0.125, 0, None, 0.0, False).backend == "triton"
    monkeypatch.setenv(_gluon_route.ENV_BWD, "fast")
    with pytest.raises(ValueError, match="FLASHGPT_GLUON_BWD='fast'"):
        _gluon_route.plan_bwd(q, q, q, q, q, True, 0.125, 0, None, 0.0, False)
    monkeypatch.setenv(_gluon_route.ENV_BWD, "auto")
    assert _gluon_route.mode(_gluon_route.ENV_BWD) == "auto" and _gluon_route.mode() == "auto"


def test_importing_the_route_imports_no_triton():
    """The rule is plain torch: a CPU process that only routes never imports triton's Gluon."""
    import subprocess
    import sys

    code = "import sys, kernels.plan; print('triton.experimental.gluon' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]


def test_tma_operand_rule():
    from kernels.plan import _span
    from kernels.plan import gluon_operand_ok as _tma_ok

    x = torch.randn(2, 4, 64, 3 * 64, dtype=torch.bfloat16)
    assert _tma_ok(x[..., :64]) and _tma_ok(x[..., 64:128])  # offsets of 128 bytes
    assert not _tma_ok(x[..., 4:68])  # an 8-byte offset
    assert not _tma_ok(x[..., :64].transpose(-1, -2))  # last stride not 1
    y = torch.randn(2, 4, 64, 68, dtype=torch.bfloat16)[..., :64]  # row stride 136 bytes
    assert not _tma_ok(y)
    e = torch.randn(2, 1, 64, 64, dtype=torch.bfloat16).expand(2, 8, 64, 64)  # an expanded (stride-0) dim
    assert not _tma_ok(e) and _tma_ok(e[:, :1])
    r = torch.randn(1, 1, 64, 64, dtype=torch.bfloat16).as_strided((1, 1, 64, 64), (4096, 4096, 32, 1))
    assert not _tma_ok(r)  # rows overlapping (row stride < d)
    # the span, not numel, bounds the 32-bit offsets: q of a packed qkv (B, N, 3, H, d) spans ~3x its numel
    qkv = torch.randn(2, 16, 3, 4, 64, dtype=torch.bfloat16)
    q = qkv[:, :, 0].transpose(1, 2)  # (2, 4, 16, 64)
    assert _span(q) == 1 + 1 * (16 * 3 * 4 * 64) + 3 * 64 + 15 * (3 * 4 * 64) + 63
    assert _span(q) > 2.5 * q.numel()
