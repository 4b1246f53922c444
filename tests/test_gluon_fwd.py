"""CPU tests of the sm_90 Gluon forward (kernels/_gluon_fwd.py): it compiles for sm_90 as launched (no
spills, asynchronous wgmma, TMA, within a block's shared memory), and `route` keeps it off CPU tensors and
rejects a bad FLASHGPT_GLUON_FWD. Its numerics are tested on the GPU (tests/test_gluon_fwd_gpu.py): Gluon
has no interpreter."""

import pytest
import torch


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gluon_fwd_compiles_for_sm90(d, dtype):
    from kernels._triton_kernels import mode_problem
    from kernels.compile_report import compile_gluon_fwd

    if mode_problem(False):
        pytest.skip(mode_problem(False))
    info = compile_gluon_fwd(d, dtype)
    assert info.shared_bytes <= 227 * 1024, info.line()
    assert info.spill_store_bytes == 0 and info.spill_load_bytes == 0, info.line()
    assert info.uses_wgmma and info.uses_tma and not info.wgmma_serialized, info.line()


def test_serialization_warnings_are_recognised():
    from kernels.compile_report import _wgmma_serialized

    assert _wgmma_serialized("ptxas info    : (C7513) Potential Performance Loss: wgmma.mma_async ...")
    assert _wgmma_serialized("warning (C7515) ...")
    assert not _wgmma_serialized("ptxas info : Used 168 registers")


def test_route_off_the_gpu_and_bad_mode(monkeypatch):
    from kernels import _gluon_fwd

    q = torch.randn(1, 2, 8192, 128, dtype=torch.bfloat16)
    monkeypatch.setenv(_gluon_fwd.ENV, "1")
    assert not _gluon_fwd.route(q, q, q, True, 0, None, 0.0)  # CPU tensors: never
    monkeypatch.setenv(_gluon_fwd.ENV, "on")
    with pytest.raises(ValueError, match="FLASHGPT_GLUON_FWD='on'"):
        _gluon_fwd.route(q, q, q, True, 0, None, 0.0)


def test_tma_alignment_rule():
    from kernels._gluon_fwd import _tma_ok

    x = torch.randn(2, 4, 64, 3 * 64, dtype=torch.bfloat16)
    assert _tma_ok(x[..., :64]) and _tma_ok(x[..., 64:128])  # offsets of 128 bytes
    assert not _tma_ok(x[..., 4:68])  # an 8-byte offset
    assert not _tma_ok(x[..., :64].transpose(-1, -2))  # last stride not 1
    y = torch.randn(2, 4, 64, 68, dtype=torch.bfloat16)[..., :64]  # row stride 136 bytes
    assert not _tma_ok(y)
