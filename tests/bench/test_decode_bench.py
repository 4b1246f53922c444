"""bench.decode's incremental results and timing rule, its compiled e2e mode, and the decode tile search
(`bench.tune --decode`) with kernels.flash_decode._launch_decode's private tile overrides (Triton
interpreter on the CPU)."""

from __future__ import annotations

import importlib
import json
import math

import pytest
import torch

pytest.importorskip("triton")
from bench import common, decode, tune  # noqa: E402
from kernels import plan as kplan  # noqa: E402

TINY = "--dry-run --dims 16 --groups 4 --kv-heads 2 --prompt-len 4 --new-tokens 3".split()


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read at call time


def test_interrupted_run_leaves_valid_incomplete_json(tmp_path, monkeypatch):
    """A run stopped during its second shape keeps the first shape's records in a valid JSON marked
    complete False, and its markdown (also from --report) says it is incomplete."""
    real, calls = decode.bench_shape, []

    def shape_then_interrupt(*a, **kw):
        calls.append(a[-1])
        if len(calls) == 2:
            raise KeyboardInterrupt  # what a timeout's signal does mid-shape
        return real(*a, **kw)

    monkeypatch.setattr(decode, "bench_shape", shape_then_interrupt)
    argv = TINY + [
        "--out",
        str(tmp_path),
        *"--contexts 40,100 --batches 1 --providers flash-decode,naive".split(),
    ]
    with pytest.raises(KeyboardInterrupt):
        decode.main(argv)
    assert calls == [40, 100]
    path = tmp_path / "decode_dryrun.json"
    data = json.loads(path.read_text())
    assert data["meta"]["complete"] is False
    assert [(r["context"], r["provider"], r["status"]) for r in data["kernel"]] == [
        (40, "flash-decode", "ok"),
        (40, "naive", "ok"),
    ]
    assert data["e2e"] == []
    assert "Incomplete" in (tmp_path / "decode_dryrun.md").read_text()
    assert not list(tmp_path.glob(".tmp-*"))  # the atomic writes left no temporary file behind
    (tmp_path / "decode_dryrun.md").unlink()
    assert decode.main(["--report", str(path)]) == 0
    assert "**Incomplete**" in (tmp_path / "decode_dryrun.md").read_text()


def test_results_saved_after_every_shape_and_complete_at_the_end(tmp_path):
    meta = dict(device="cpu", dtype="float32", copy_ceiling_gbs=1.0, graph_calls=20)
    results = common.Results(tmp_path / "decode_t.json", meta, decode.markdown, kernel=[], e2e=[])
    rec = dict(d=16, group=1, batch=1, context=40, provider="naive", status="ok", ms=1.0, gbs=1.0)
    results.add("kernel", [rec])
    first = json.loads((tmp_path / "decode_t.json").read_text())
    assert first["meta"]["complete"] is False and first["kernel"] == [rec]
    results.add("e2e", [dict(backend="naive", mode="eager", static_decode=False, batch=1, status="oom")])
    assert len(json.loads((tmp_path / "decode_t.json").read_text())["e2e"]) == 1
    md = results.save(complete=True)
    assert json.loads((tmp_path / "decode_t.json").read_text())["meta"]["complete"] is True
    assert "Incomplete" not in md and md == (tmp_path / "decode_t.md").read_text()


class FakeTimer:
    """Returns a fixed 'median' without calling the function more than once."""

    def __init__(self, ms: float):
        self.ms, self.calls = ms, 0

    def __call__(self, fn):
        self.calls += 1
        fn()
        return self.ms


@pytest.mark.parametrize(
    "eager_ms,graphs,timing",
    [
        (0.02, True, "cuda_graph"),
        (decode.EAGER_ONLY_MS * 0.99, True, "cuda_graph"),
        (decode.EAGER_ONLY_MS, True, "eager"),
        (35.0, True, "eager"),
        (0.02, False, "eager"),
    ],
)
def test_long_calls_are_timed_eagerly_only(eager_ms, graphs, timing):
    captured = []

    def graph_ms(fn):
        captured.append(fn)
        return 0.005

    ran = []
    timer = FakeTimer(eager_ms)
    out = decode.time_call(lambda *a: ran.append(a), (1, 2, 3), timer, graph_ms if graphs else None)
    assert timer.calls == 1 and ran == [(1, 2, 3)]
    assert out["timing"] == timing and out["ms_eager"] == eager_ms
    if timing == "eager":
        assert out["ms"] == eager_ms and not captured
    else:
        assert out["ms"] == 0.005 and len(captured) == 1


def test_compile_failure_is_that_records_error(tmp_path, monkeypatch):
    """A backend whose torch.compile fails gives an error record for the compiled mode; the others run."""

    def broken_compile(fn, **kw):
        def call(*a, **k):
            raise RuntimeError("inductor exploded")

        return call

    monkeypatch.setattr(torch, "compile", broken_compile)
    argv = TINY + ["--out", str(tmp_path), "--batches", "1", "--e2e-only", "--e2e-backends", "naive"]
    assert decode.main(argv) == 0
    data = json.loads((tmp_path / "decode_dryrun_e2e.json").read_text())
    status = {r["mode"]: r["status"] for r in data["e2e"]}
    assert status["eager"] == status["static"] == "ok", status
    assert status["compiled"] == "error: RuntimeError: inductor exploded", status
    assert "inductor exploded" in (tmp_path / "decode_dryrun_e2e.md").read_text()


def _reference64(q, k, v):
    g = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = q.double() @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(s, -1) @ vv


def test_launch_overrides_reach_the_kernel_launch(monkeypatch, seed):
    """_block_n / _num_warps / _num_stages change the split kernel's launch (tile, grid, options), and
    every tile gives the float64 result to fp32 tolerance."""
    fd = importlib.import_module("kernels.flash_decode")  # the module: the package exports the function
    launches = []
    real_launcher = fd.launcher

    def spy(kernel, grid, traced):
        run = real_launcher(kernel, grid, traced)

        def call(*a, **kw):
            launches.append((grid, kw))
            return run(*a, **kw)

        return call

    monkeypatch.setattr(fd, "launcher", spy)
    q, k, v = torch.randn(2, 8, 1, 16), torch.randn(2, 2, 100, 16), torch.randn(2, 2, 100, 16)
    ref = _reference64(q, k, v)
    for bn in (16, 32, 64):
        launches.clear()
        o, _ = fd._launch_decode(q, k, v, None, 0.25, 3, _tile_n=bn, _num_warps=8, _num_stages=3)
        (grid, kw), (_, combine_kw) = launches
        split_len, splits = kplan.split_layout(100, 3, bn)
        assert kw["BLOCK_N"] == bn and kw["num_warps"] == 8 and kw["num_stages"] == 3, kw
        assert grid == (splits, 2, 2) and combine_kw["BLOCK_S"] >= splits and split_len % bn == 0
        torch.testing.assert_close(o.double(), ref, atol=2e-5, rtol=0, msg=f"block_n={bn} seed={seed}")
    launches.clear()
    fd._launch_decode(q, k, v, None, 0.25, 3)  # no override: the interpreter's tile, Triton's options
    assert launches[0][1]["BLOCK_N"] == 16 and "num_warps" not in launches[0][1]
    assert kplan.split_layout(100, 3, 64) == (64, 2)  # 3 requested, 2 of whole 64-key tiles launched


@pytest.mark.slow  # over 5 s on 2 cores
def test_decode_tile_search_dry_run(tmp_path):
    assert tune.main(["--decode", "--dry-run", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "decode_tiles_dryrun.json").read_text())
    meta, records = data["meta"], data["records"]
    assert meta["complete"] is True and meta["triton"] and meta["torch"] and meta["device"]
    shapes = {tuple(s) for s in meta["shapes"]}
    assert shapes == set(tune.DRY_DECODE_SHAPES)
    for d, b, ctx in shapes:
        rs = [r for r in records if (r["d"], r["batch"], r["context"]) == (d, b, ctx)]
        assert sum(r["config"] == "auto" for r in rs) == 1
        sweep = [r for r in rs if r["config"] == "sweep"]
        # every (block_n, splits) of the dry grid with no more splits than key tiles, each matching
        want = {(bn, sp) for bn in (16, 32) for sp in (1, 2, 4) if sp <= -(-ctx // bn)}
        assert {(r["block_n"], r["splits_requested"]) for r in sweep} == want
        assert all(r["status"] == "ok" and r["max_abs_diff"] <= 1e-4 and r["ms"] > 0 for r in sweep), sweep
    md = (tmp_path / "decode_tiles_dryrun.md").read_text()
    assert md.count("Automatic (block_n 16") == 2 and "| block_n | warps | stages | s=1 |" in md
    assert "Incomplete" not in md


def test_dry_run_fails_when_the_flash_provider_fails(tmp_path, monkeypatch):
    """The plumbing check exists to run our kernel: a flash-decode record that errors makes the dry run
    exit 1 (other providers that cannot run on a CPU stay results)."""
    real = decode.provider_fn

    def broken_flash(name):
        if name == "flash-decode":

            def fail(q, k, v):
                raise RuntimeError("kernel plumbing broken")

            return fail
        return real(name)

    monkeypatch.setattr(decode, "provider_fn", broken_flash)
    argv = TINY + [
        "--out",
        str(tmp_path),
        *"--contexts 40 --batches 1 --providers flash-decode,naive".split(),
    ]
    assert decode.main(argv) == 1
    monkeypatch.setattr(decode, "provider_fn", real)
    assert decode.main(argv) == 0


@pytest.mark.parametrize(
    "flags,match",
    [
        (["--splits", "0"], "--splits: '0': must be integers >= 1"),
        (["--block-n", "7"], "--block-n: '7': must be powers of two >= 16"),
        (["--block-n", "0"], "--block-n: '0': must be powers of two >= 16"),
        (["--splits", ""], "--splits: '': is an empty list"),
        (["--block-n", ","], "--block-n: ',': is an empty list"),
        (["--warps", "3"], "--warps: '3': must be powers of two >= 1"),
        (["--contexts", "0"], "--contexts: '0': must be integers >= 1"),
        (["--dims", "x"], "--dims: 'x': must be a comma list of integers"),
        (["--group", "0"], "--group: '0': must be integers >= 1"),
    ],
)
def test_decode_tile_search_refuses_a_bad_grid(tmp_path, capsys, flags, match):
    """A bad grid is a usage error (exit 2) before anything runs or is written: an empty list once swept
    nothing and exited 0, --splits 0 died in a ZeroDivisionError, --block-n 7 in Triton errors."""
    with pytest.raises(SystemExit) as exc:
        tune.main(["--decode", "--dry-run", "--out", str(tmp_path), *flags])
    assert exc.value.code == 2 and match in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "content,match",
    [
        (None, "cannot read"),
        ('{"kernel": [', "cannot read"),
        ("[1, 2]", "not a bench.decode results file"),
        ('{"kernel": []}', "not a bench.decode results file"),
        ('{"meta": {}, "kernel": [], "e2e": []}', "not as bench.decode writes them"),
        ('{"meta": {"device": "x"}, "kernel": "abc", "e2e": []}', "not as bench.decode writes them"),
    ],
)
def test_report_of_a_missing_or_corrupt_file_is_one_error_line(tmp_path, capsys, content, match):
    path = tmp_path / "decode_x.json"
    if content is not None:
        path.write_text(content)
    assert decode.main(["--report", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --report: ") and match in err and "Traceback" not in err
    assert not path.with_suffix(".md").exists()


@pytest.mark.parametrize(
    "flags,match",
    [
        (["--contexts", "4x"], "--contexts: '4x': must be a comma list of integers"),
        (["--batches", "0"], "--batches: '0': must be integers >= 1"),
        (["--dims", ""], "--dims: '': is an empty list"),
        (["--providers", "flash-decode,foo"], "(bad: ['foo'])"),
        (["--providers", "read-floor,read-floor"], "a name given twice"),
        (["--kv-heads", "0"], "--kv-heads: '0': must be integers >= 1"),
        (["--e2e-only", "--new-tokens", "0"], "--new-tokens: '0': must be integers >= 1"),
        (["--e2e-only", "--e2e-backends", "flash,foo"], "from naive, sdpa, flash"),
    ],
)
def test_decode_refuses_a_bad_grid(tmp_path, capsys, flags, match):
    """A bad comma list is a usage error (exit 2, one line) before anything runs or is written."""
    with pytest.raises(SystemExit) as exc:
        decode.main(["--dry-run", "--out", str(tmp_path), *flags])
    assert exc.value.code == 2 and match in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
