"""Flash-decoding kernel (kernels/flash_decode.py) against float64 PyTorch, Triton interpreter on the CPU."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
from kernels import MAX_DECODE_ROWS, flash_decode  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read at call time


def reference(q, k, v, lengths, scale=None):
    """float64 attention per sequence b over keys [0, L_b), row i seeing keys j <= L_b - Nq + i; GQA by
    repeating each KV head for its query heads. Returns (o, natural-log lse)."""
    B, Hq, Nq, d = q.shape
    group = Hq // k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    o = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.zeros(q.shape[:3], dtype=torch.float64)
    for b in range(B):
        n = int(lengths[b])
        kk = k[b, :, :n].double().repeat_interleave(group, 0)
        vv = v[b, :, :n].double().repeat_interleave(group, 0)
        s = q[b].double() @ kk.transpose(-1, -2) * scale
        allowed = torch.arange(n)[None, :] <= torch.arange(Nq)[:, None] + (n - Nq)
        s = s.masked_fill(~allowed, -math.inf)
        lse[b] = torch.logsumexp(s, -1)
        o[b] = torch.softmax(s, -1) @ vv
    return o, lse


@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 1), (8, 2)])
@pytest.mark.parametrize("nq", [1, 3])
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_matches_float64_ragged_gqa(seed, hq, hkv, nq, num_splits):
    B, n_max, d = 3, 45, 24  # 45: not a multiple of the tile or the split; d 24: not a power of two
    q = torch.randn(B, hq, nq, d)
    k, v = torch.randn(B, hkv, n_max, d), torch.randn(B, hkv, n_max, d)
    lengths = torch.tensor([n_max, nq, 20], dtype=torch.int32)  # full, only the new rows, ragged
    o, lse = flash_decode(q, k, v, lengths, num_splits=num_splits, return_lse=True)
    ref_o, ref_lse = reference(q, k, v, lengths)
    assert o.shape == q.shape and o.dtype == torch.float32 and lse.shape == (B, hq, nq)
    err = (o.double() - ref_o).abs().max().item()
    lerr = (lse.double() - ref_lse).abs().max().item()
    assert err < 2e-5 and lerr < 2e-5, f"seed={seed}: o err {err}, lse err {lerr}"


def test_pdl_rule_and_split_rule(monkeypatch):
    """PDL only for eager launches on CUDA devices of compute capability >= 9. The GPU split rule (checked
    without a GPU through a stand-in for the device properties, 132 SMs as on the H200) gives the counts
    the session-13 sweep measured best (bench/NOTES.md): Hkv 8, 128-key tiles; the CPU rule 4 programs."""
    from types import SimpleNamespace

    from kernels.plan import _sms, decode_splits, use_pdl

    cpu = torch.device("cpu")
    assert not use_pdl(cpu, traced=False) and not use_pdl(cpu, traced=True)
    assert decode_splits(1000, 16, 1, _sms(cpu), 64) == 4 and decode_splits(1000, 16, 8, _sms(cpu), 64) == 1
    h200 = SimpleNamespace(multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: h200)
    sms = _sms(torch.device("cuda"))
    cases = {  # (context, batch, d) -> splits
        (8192, 1, 64): 16, (32768, 1, 64): 33, (8192, 16, 64): 2, (8192, 64, 64): 4,
        (8192, 1, 128): 16, (32768, 1, 128): 16, (8192, 16, 128): 1, (8192, 64, 128): 1,
        (1024, 1, 64): 2,  # 8 tiles: no split shorter than 4 tiles
    }  # fmt: skip
    for (ctx, b, d), want in cases.items():
        assert decode_splits(ctx, 128, b * 8, sms, d) == want, (ctx, b, d)


def test_strided_cache_view_default_lengths_and_scale(seed):
    """A prefix view of a bigger cache (as the model passes it), lengths None = Nmax, 16 rows."""
    cache = torch.randn(2, 2, 2, 64, 32)  # (k/v, B, Hkv, slots, d)
    k, v = cache[0, :, :, :40], cache[1, :, :, :40]
    q = torch.randn(2, 4, 40, 32).transpose(1, 2)[:, :, :MAX_DECODE_ROWS]  # strided (B, Hq, 16, d)
    o = flash_decode(q, k, v, softmax_scale=0.3)
    ref_o, _ = reference(q, k, v, [40, 40], scale=0.3)
    err = (o.double() - ref_o).abs().max().item()
    assert err < 2e-5, f"seed={seed}: {err}"


def test_no_lengths_equals_full_lengths(seed):
    """cache_seqlens=None (no lengths tensor, the kernel's HAS_SEQLENS=False) is bitwise the result of
    passing L_b = Nmax for every sequence, eagerly and through the CPU op (whose opcheck takes None)."""
    from kernels.flash_decode import flash_decode_cpu_op

    q = torch.randn(2, 4, 3, 24)
    k, v = torch.randn(2, 2, 37, 24), torch.randn(2, 2, 37, 24)
    full = torch.full((2,), 37, dtype=torch.int32)
    o, lse = flash_decode(q, k, v, full, num_splits=3, return_lse=True)
    o2, lse2 = flash_decode(q, k, v, None, num_splits=3, return_lse=True)
    assert torch.equal(o, o2) and torch.equal(lse, lse2), f"seed={seed}"
    o3, lse3 = flash_decode_cpu_op(q, k, v, None, 1.0 / math.sqrt(24), 3)
    assert torch.equal(o, o3) and torch.equal(lse, lse3), f"seed={seed}"
    result = torch.library.opcheck(flash_decode_cpu_op, (q, k, v, None, 0.25, 3))
    assert set(result.values()) == {"SUCCESS"}, result


def test_float16_close_to_float64(seed):
    q = torch.randn(2, 4, 1, 64).half()
    k, v = torch.randn(2, 2, 37, 64).half(), torch.randn(2, 2, 37, 64).half()
    lengths = torch.tensor([37, 11])
    o = flash_decode(q, k, v, lengths, num_splits=2)
    ref_o, _ = reference(q, k, v, lengths)
    # the FlashAttention rule: no worse than twice PyTorch's own float16 error, plus 1e-5
    torch_err = 0.0
    for b, n in enumerate(lengths.tolist()):
        kk = k[b, :, :n].repeat_interleave(2, 0)
        vv = v[b, :, :n].repeat_interleave(2, 0)
        p = torch.softmax((q[b].float() @ kk.float().transpose(-1, -2) / 8.0), -1).half()
        torch_err = max(torch_err, (p.float() @ vv.float()).half().double().sub(ref_o[b]).abs().max().item())
    err = (o.double() - ref_o).abs().max().item()
    assert o.dtype == torch.float16 and err <= 2 * torch_err + 1e-5, f"seed={seed}: {err} vs {torch_err}"


def test_unchecked_lengths_are_clamped_to_the_cache(seed):
    """check_lengths=False reads no lengths on the host (no error for out-of-range ones) and the kernel
    clamps each length to [0, Nmax]: a length past the cache gives the full cache's result, bitwise, and no
    slot outside the cache is read (the cache is a prefix view of a bigger buffer holding NaN past it)."""
    buf = torch.full((2, 2, 2, 50, 16), float("nan"))  # (k/v, B, Hkv, slots, d)
    buf[:, :, :, :30] = torch.randn(2, 2, 2, 30, 16)
    k, v = buf[0, :, :, :30], buf[1, :, :, :30]
    q = torch.randn(2, 4, 1, 16)
    lengths = torch.tensor([30, 12], dtype=torch.int32)
    with pytest.raises(ValueError, match="max 45"):
        flash_decode(q, k, v, torch.tensor([45, 12], dtype=torch.int32))
    over = flash_decode(q, k, v, torch.tensor([45, 12], dtype=torch.int32), check_lengths=False)
    assert torch.equal(over, flash_decode(q, k, v, lengths, check_lengths=False)), f"seed={seed}"
    ref_o, _ = reference(q, k, v, lengths)
    err = (over.double() - ref_o).abs().max().item()
    assert err < 2e-5, f"seed={seed}: {err}"


def test_strided_and_int64_lengths(seed):
    """A strided lengths view (every other element of a buffer) means its own elements, not the buffer's
    first B; an unchecked int64 length past 2**32 clamps to Nmax like any other length past the cache
    (it once wrapped to its low 32 bits: 2**32 + 3 gave length 3's result)."""
    q, k, v = torch.randn(3, 2, 1, 16), torch.randn(3, 2, 40, 16), torch.randn(3, 2, 40, 16)
    buf = torch.tensor([1, 0, 7, 0, 40, 0], dtype=torch.int32)
    lengths = buf[::2]
    ref_o, _ = reference(q, k, v, lengths)
    for check in (True, False):
        o = flash_decode(q, k, v, lengths, check_lengths=check)
        err = (o.double() - ref_o).abs().max().item()
        assert err < 2e-5, f"seed={seed} check_lengths={check}: {err}"
    huge = torch.full((3,), 2**32 + 3, dtype=torch.int64)
    o = flash_decode(q, k, v, huge, check_lengths=False)
    assert torch.equal(o, flash_decode(q, k, v)), f"seed={seed}"


@pytest.mark.parametrize(
    "override,match",
    [
        (dict(_tile_n=7), "_tile_n must be a power of two >= 16"),
        (dict(_tile_n=24), "_tile_n must be a power of two >= 16"),
        (dict(_tile_n=0), "_tile_n must be a power of two >= 16"),
        (dict(_tile_n=8), "_tile_n must be a power of two >= 16"),
        (dict(_tile_n=16.0), "_tile_n must be a power of two >= 16"),
        (dict(_num_warps=3), "_num_warps must be a power of two"),
        (dict(_num_stages=0), "_num_stages must be an int >= 1"),
    ],
)
def test_launch_overrides_refuse_bad_values(override, match):
    """The private tile sweep overrides fail with a clear error, not deep in Triton (or, for a tile of 8
    under the interpreter, not at all although no GPU tl.dot takes it)."""
    from kernels.flash_decode import _launch_decode

    q, k = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 40, 16)
    with pytest.raises(ValueError, match=match):
        _launch_decode(q, k, k, None, 0.25, 2, **override)
    o, _ = _launch_decode(q, k, k, None, 0.25, 2, _tile_n=32, _num_warps=4, _num_stages=2)
    assert torch.allclose(o, flash_decode(q, k, k), atol=1e-5)


def test_bfloat16_runs_in_float32_under_interpreter(seed):
    q, k = torch.randn(1, 2, 2, 16).bfloat16(), torch.randn(1, 2, 9, 16).bfloat16()
    o = flash_decode(q, k, k)
    ref_o, _ = reference(q, k, k, [9])
    assert o.dtype == torch.bfloat16 and (o.double() - ref_o).abs().max().item() < 2e-2, f"seed={seed}"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(q=torch.randn(1, 2, 17, 16)), "1..16 query rows"),
        (dict(q=torch.randn(1, 3, 1, 16)), "multiple of KV heads"),
        (dict(q=torch.randn(1, 2, 1, 16).double()), "one dtype"),
        (dict(cache_seqlens=torch.tensor([0])), r"cache_seqlens must be in \[Nq=1"),
        (dict(cache_seqlens=torch.tensor([11])), "max 11"),
        (dict(cache_seqlens=torch.tensor([3.0])), "int32/int64 tensor"),
        (dict(num_splits=0), "num_splits must be an int >= 1"),
        (dict(check_lengths="no"), "check_lengths must be True or False"),
        (dict(check_lengths=None), "check_lengths must be True or False"),
        (dict(k_cache=torch.randn(1, 0, 10, 16), v_cache=torch.randn(1, 0, 10, 16)), "one KV head"),
        (dict(softmax_scale=True), "softmax_scale must be a finite float"),
    ],
)
def test_errors(kwargs, match):
    args = dict(
        q=torch.randn(1, 2, 1, 16), k_cache=torch.randn(1, 2, 10, 16), v_cache=torch.randn(1, 2, 10, 16)
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        flash_decode(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), **args)


def test_read_floor_names_what_is_wrong():
    """bench.decode's read-floor provider: a clear error for inputs it cannot read as one flat stream, and
    per-program sums that add up to the sum of k and v (it reads every element once)."""
    from bench._read_floor import read_floor

    k, v = torch.randn(1, 2, 300, 16), torch.randn(1, 2, 300, 16)
    assert torch.allclose(read_floor(None, k, v).sum(), (k.sum() + v.sum()).float(), atol=1e-3)
    for bad_k, bad_v, match in (
        (k.transpose(2, 3), v.transpose(2, 3), "contiguous"),
        (k, v[..., :8].contiguous(), "one shape"),
        (k, v.double(), "one dtype"),
        (k, "v", "tensors k and v"),
    ):
        with pytest.raises(ValueError, match=match):
            read_floor(None, bad_k, bad_v)


def test_empty_batch_with_lengths():
    """B = 0 gives an empty result with or without a lengths tensor (no range check over nothing)."""
    q, k = torch.randn(0, 2, 1, 16), torch.randn(0, 2, 10, 16)
    for lengths in (None, torch.zeros(0, dtype=torch.int32)):
        assert flash_decode(q, k, k, lengths).shape == (0, 2, 1, 16)


def test_needs_interpreter_or_cuda(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        flash_decode(torch.randn(1, 1, 1, 16), torch.randn(1, 1, 4, 16), torch.randn(1, 1, 4, 16))


def test_kernels_compile_for_sm90():
    """No GPU here: compile both kernels for sm_90 as a launch would (the GPU tile, Triton's default 3
    stages), within an H100/H200 block's shared memory (catches compiled-mode-only errors and a tile too
    big; GPU accuracy is tests/test_flash_decode_gpu.py's). In a fresh process without TRITON_INTERPRET:
    the kernels are compiled or interpreted per process (the one of this test may run the interpreter)."""
    code = """
import os, sys, torch, triton
if not os.path.exists(triton.knobs.nvidia.ptxas.path): print('SKIP no ptxas'); sys.exit(0)
from kernels.compile_report import compile_decode_kernel
cases = [(torch.bfloat16, 128, 8, 1), (torch.bfloat16, 128, 8, 16), (torch.float16, 64, 1, 16),
         (torch.float32, 64, 4, 1), (torch.float32, 128, 8, 16)]
for dtype, d, group, n_q in cases:
    for has_seqlens in (True, False):
        split = compile_decode_kernel('split', dtype, d, group=group, n_q=n_q, num_stages=3,
                                      has_seqlens=has_seqlens, pdl=True)
        combine = compile_decode_kernel('combine', dtype, d, group=group, n_q=n_q, num_stages=3, pdl=True)
        where = (dtype, d, group, n_q, has_seqlens)
        assert split.metadata.shared <= 227 * 1024 and combine.asm['ptx'], (where, split.metadata.shared)
        # as a Hopper launch: both kernels wait for their predecessor (PDL) before touching memory
        for ptx in (split.asm['ptx'], combine.asm['ptx']):
            assert 'griddepcontrol.wait' in ptx, where
        if dtype != torch.float32:
            assert 'mma' in split.asm['ptx'], where  # the tile products run on tensor cores
print('ok')
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=600
    )
    if "SKIP" in out.stdout:
        pytest.skip("Triton's NVIDIA backend (ptxas) is not available")
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]


def test_decode_bench_dry_run(tmp_path):
    """bench.decode's plumbing on the CPU: every provider checked against the reference, then timed."""
    from bench import decode

    code = decode.main(
        [
            "--dry-run",
            "--out",
            str(tmp_path),
            "--contexts",
            "40",
            "--batches",
            "2",
            "--dims",
            "16",
            "--groups",
            "4",
            "--kv-heads",
            "2",
            "--providers",
            "flash-decode,naive,sdpa-math",
            "--e2e",
            "--e2e-backends",
            "naive",
            "--prompt-len",
            "4",
            "--new-tokens",
            "3",
        ]
    )
    assert code == 0
    data = __import__("json").loads((tmp_path / "decode_dryrun.json").read_text())
    assert [r["status"] for r in data["kernel"]] == ["ok"] * 3, data["kernel"]
    assert all(r["max_abs_err"] < 1e-4 for r in data["kernel"])
    assert [r["status"] for r in data["e2e"]] == ["ok"] * 3 and data["meta"]["copy_ceiling_gbs"] > 0
    # the three e2e modes; the dry run compiles with dynamo's eager backend (no Inductor) and says so
    assert [(r["mode"], r["static_decode"]) for r in data["e2e"]] == [
        ("eager", False),
        ("static", True),
        ("compiled", True),
    ]
    compiled = data["e2e"][2]
    assert compiled["compile_backend"] == "eager" and compiled["recompiles"] == 0, compiled
    assert data["meta"]["complete"] is True
    md = (tmp_path / "decode_dryrun.md").read_text()
    assert "flash-decode" in md and "| naive | compiled | 2 |" in md and "no Inductor" in md
    assert "Incomplete" not in md


def test_decode_bench_dry_run_defaults_are_tiny(tmp_path):
    """`--dry-run` alone (what the README shows) runs tiny shapes on the CPU, not the GPU grid (contexts up
    to 131072, batch 64: gigabytes of cache and hours under the interpreter)."""
    from bench import decode

    assert decode.main(["--dry-run", "--out", str(tmp_path), "--providers", "flash-decode,naive"]) == 0
    data = __import__("json").loads((tmp_path / "decode_dryrun.json").read_text())
    assert data["kernel"] and all(r["status"] == "ok" for r in data["kernel"]), data["kernel"]
    assert max(r["context"] for r in data["kernel"]) <= 100 and max(r["batch"] for r in data["kernel"]) <= 2


def test_op_path_equals_eager(seed):
    """Under torch.compile, fake tensors etc. flash_decode goes through flashgpt::flash_decode_cpu:
    same kernels, bitwise the same result as the eager launch; the fake gives the shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kernels.flash_decode import flash_decode_cpu_op

    q, k, v = torch.randn(2, 4, 2, 16), torch.randn(2, 2, 30, 16), torch.randn(2, 2, 30, 16)
    lengths = torch.tensor([30, 9], dtype=torch.int32)
    o, lse = flash_decode(q, k, v, lengths, num_splits=2, return_lse=True)
    o2, lse2 = flash_decode_cpu_op(q, k, v, lengths, 0.25, 2)
    assert torch.equal(o, o2) and torch.equal(lse, lse2), f"seed={seed}"
    with FakeTensorMode() as mode:
        fo = flash_decode(*(mode.from_tensor(t) for t in (q, k, v, lengths)))
    assert fo.shape == q.shape and fo.dtype == q.dtype
    result = torch.library.opcheck(flash_decode_cpu_op, (q, k, v, lengths, 0.25, 2))
    assert set(result.values()) == {"SUCCESS"}, result
