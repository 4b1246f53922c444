"""GPU tests of the trainer's compile modes and GPU-busy measurement (skipped without CUDA).

Tiny GPT (model=tiny) on character Tiny Shakespeare with torch.compile on the GPU, two micro-batches per
optimizer step, so CUDA graphs meet gradient accumulation (pytorch/pytorch#96693: with .grad left None
the second micro-batch's replay overwrites the first's gradients)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers_train import describe, run_train, summary, tiny_overrides, train_losses

pytestmark = pytest.mark.gpu


def _gpu_run(char_data, shakespeare_path, out, **extra):
    args = tiny_overrides(
        char_data,
        shakespeare_path,
        out,
        device="cuda",
        compile=True,
        max_steps=12,
        eval__interval=0,
        checkpoint__interval=0,
        checkpoint__at_end=False,
        model__dropout=0.0,
        **extra,
    )
    proc = run_train(args, timeout=600)
    assert proc.returncode == 0, describe(proc)
    return train_losses(out), summary(out)


@pytest.mark.parametrize("attention", ["flash", "sdpa"])
def test_cuda_graphs_give_the_same_losses(char_data, shakespeare_path, tmp_path, attention):
    """compile_mode=reduce-overhead (CUDA graphs) logs the same losses as compile_mode=default, step for
    step, with gradient accumulation (2 micro-batches per step) and deterministic kernels."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    common = dict(attention=attention, deterministic=True, dtype="float32", tf32=False)
    base, _ = _gpu_run(char_data, shakespeare_path, tmp_path / "default", **common)
    graphs, s = _gpu_run(
        char_data, shakespeare_path, tmp_path / "graphs", compile_mode="reduce-overhead", **common
    )
    assert s["grad_accum"] == 2 and s["compile_mode"] == "reduce-overhead"
    assert sorted(base) == sorted(graphs) == list(range(1, 13))
    for step in base:
        assert graphs[step] == base[step], f"{attention} step {step}: {graphs[step]} vs {base[step]}"


def test_gpu_busy_fraction_in_the_summary(char_data, shakespeare_path, tmp_path):
    """perf.profile_steps=K profiles K steps after the excluded ones: summary.json gets perf/gpu_busy in
    (0, 1.05] and the profiled steps are left out of the tokens/sec median."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _, s = _gpu_run(
        char_data,
        shakespeare_path,
        tmp_path / "busy",
        attention="flash",
        perf__exclude_first_steps=3,
        perf__profile_steps=2,
    )
    assert 0.0 < s["perf/gpu_busy"] <= 1.05, s
    assert s["perf/profiled_steps"] == 2 and s["perf/timed_steps"] == 12 - 3 - 2, s


def test_trace_writes_a_chrome_trace(char_data, shakespeare_path, tmp_path):
    """perf.trace=true: <out_dir>/trace_step4-5.json.gz holds the profiled steps' kernels and host ops, and
    the GPU time per step is counted once (the host ops that launched the kernels are not added again)."""
    import gzip
    import json

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    runs = {}
    for trace in (False, True):
        _, runs[trace] = _gpu_run(
            char_data,
            shakespeare_path,
            tmp_path / f"trace_{trace}",
            attention="flash",
            perf__exclude_first_steps=3,
            perf__profile_steps=2,
            perf__trace=trace,
        )
    assert not list((tmp_path / "trace_False").glob("trace_step*"))
    # steps 4 and 5: after the 3 excluded steps
    with gzip.open(tmp_path / "trace_True" / "trace_step4-5.json.gz", "rt") as f:
        events = json.load(f)["traceEvents"]
    cats = {e.get("cat") for e in events}
    assert {"kernel", "cpu_op"} <= cats, sorted(c for c in cats if c)
    plain, traced = runs[False]["perf/gpu_ms_per_step"], runs[True]["perf/gpu_ms_per_step"]
    assert 0.5 * plain < traced < 1.5 * plain, (plain, traced)
