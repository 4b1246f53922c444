"""Shared guard of the GPU-only bench scripts (ab_tiles, tune, host_overhead, ncu_target, profile_kernels)."""

from __future__ import annotations

import argparse
import sys

import torch


def require_cuda(script: str) -> None:
    """Exit (status 2), naming the fix, when no CUDA GPU is visible; call it before writing anything."""
    if not torch.cuda.is_available():
        print(f"error: {script} times CUDA kernels and needs a CUDA GPU (torch.cuda.is_available() is "
              "False). "
              "On a CPU, `python -m bench.attention --dry-run` exercises the benchmark plumbing and "
              "`python -m kernels.compile_report` compiles the kernels for sm_90 offline.", file=sys.stderr)
        raise SystemExit(2)


def parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """ArgumentParser whose --help shows the module docstring as written (plan syntax, example commands)."""
    return argparse.ArgumentParser(prog=prog, description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
