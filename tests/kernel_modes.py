"""The two places a kernel test runs: the Triton interpreter on the CPU (small shapes) and CUDA (the full
grid). A kernel family's tests take ``device`` from ``DEVICES`` and call ``enter(device, monkeypatch)``.

One process runs one mode: the `@triton.jit` kernels are imported at the first launch, compiled or
interpreted by TRITON_INTERPRET at that moment (kernels/_launch.py). On a machine without CUDA the test
modules set TRITON_INTERPRET=1 before importing triton and the cuda params skip; on a GPU machine
``pytest -m gpu`` runs the cuda params and ``TRITON_INTERPRET=1 pytest -m "not gpu"`` the interpreter ones.
"""

import pytest
import torch

DEVICES = [
    pytest.param("interpreter", id="interpreter"),
    pytest.param("cuda", marks=pytest.mark.gpu, id="cuda"),
]


def enter(device: str, monkeypatch) -> torch.device:
    """Put this test in `device`'s mode and return the torch device of its tensors. Skips a cuda param
    without CUDA, and a param whose mode is not the one this process's kernels were imported in (the
    skip says so)."""
    from kernels import _launch

    interpret = device == "interpreter"
    if not interpret and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # float32 references in IEEE
    try:
        _launch.kernel_module(interpret)
    except _launch.FlashAttentionUnavailableError as e:
        pytest.skip(f"this process runs the other Triton mode: {e}")
    return torch.device("cpu" if interpret else "cuda")
