"""Tests of bench/: the attention benchmark's plumbing (CPU dry run), the sweep report and the loss-curve
compare on synthetic run directories, throughput's argument checks and trace gaps, tune's plan syntax. CPU
only; no assertions on timings."""

from __future__ import annotations

import gzip
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bench import attention as ba
from bench import common, throughput, tune
from bench import compare as bc
from bench import report as br

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    """The dry runs choose the Triton interpreter in os.environ: here it is restored after each test."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


RECORD_KEYS = {
    "provider",
    "N",
    "d",
    "B",
    "H",
    "mode",
    "ms_median",
    "tflops",
    "peak_gib",
    "status",
    "max_abs_err",
}


def _bench(tmp_path: Path, *args: str) -> dict:
    """bench.attention's dry run in this process (CPU providers only) -> its results JSON."""
    assert ba.main(["--dry-run", "--out", str(tmp_path), "--cpu-reps", "1", *args]) == 0
    for ext in ("json", "md", "png"):
        assert (tmp_path / f"attention_cpu.{ext}").stat().st_size > 0
    return json.loads((tmp_path / "attention_cpu.json").read_text())


def _check_flops(rec: dict) -> None:
    fwd = 4.0 * rec["B"] * rec["H"] * rec["N"] ** 2 * rec["d"] / 2.0  # causal forward
    if rec["ms_median"] <= 0:  # bwd = fwdbwd - fwd can come out <= 0 from CPU timing noise
        assert rec["mode"] == "bwd" and rec["tflops"] is None
        return
    flops = fwd * {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}[rec["mode"]]
    assert rec["tflops"] == pytest.approx(flops / (rec["ms_median"] * 1e-3) / 1e12, rel=1e-9)


# ------------------------------------------------------------------------------------------- attention


def test_attention_dry_run_plumbing(tmp_path, capsys):
    data = _bench(tmp_path, "--providers", "naive,sdpa-math", "--inject-failure", "sdpa-math:error")
    assert "| N |" in capsys.readouterr().out  # the markdown is printed
    meta, recs = data["metadata"], data["records"]
    assert {"gpu", "torch", "triton", "cuda", "date", "dtype"} <= set(meta)
    assert "hostname" not in json.dumps(meta).lower()
    assert len(recs) == 2 * 2 * 3  # providers x seqlens x modes
    for r in recs:
        assert RECORD_KEYS <= set(r) and r["B"] == max(1, 64 // r["N"]) and r["H"] == 64 // r["d"]
    for r in (r for r in recs if r["provider"] == "naive"):
        assert r["status"] == "ok" and r["max_abs_err"] < 1e-4, r
        _check_flops(r)
    for r in (r for r in recs if r["provider"] == "sdpa-math"):
        assert r["status"].startswith("error:") and "injected" in r["status"]
        assert r["ms_median"] is None and r["tflops"] is None
    md = (tmp_path / "attention_cpu.md").read_text()
    assert "naive" in md and "ERR" in md


@pytest.mark.slow  # over 5 s on 2 cores
def test_attention_dry_run_flash(tmp_path):
    """What a user types on a CPU: the CLI chooses the Triton interpreter itself before kernels/ loads."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "bench.attention", "--dry-run", "--out", str(tmp_path), "--cpu-reps", "1"]
    cmd += ["--providers", "flash,flash-det,naive", "--seqlens", "32"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    recs = json.loads((tmp_path / "attention_cpu.json").read_text())["records"]
    for name in ("flash", "flash-det"):  # flash-det: deterministic=True (the split backward everywhere)
        flash = [r for r in recs if r["provider"] == name]
        assert [r["mode"] for r in flash] == ["fwd", "bwd", "fwdbwd"]
        for r in flash:
            assert r["status"] == "ok" and r["max_abs_err"] < 1e-3, r  # checked against the reference
            _check_flops(r)


@pytest.mark.slow  # over 5 s on 2 cores
def test_attention_softcap_checks_every_provider_against_a_capped_reference(tmp_path, seed, capsys):
    """--softcap c: the reference and flash / naive soft-cap the scores, the rows go to their own file, and
    a provider that ignored the cap would fail the check (the capped and plain references differ by more
    than the tolerance); sdpa, which cannot cap, is refused naming it."""
    args = ["--dry-run", "--out", str(tmp_path), "--cpu-reps", "1", "--seqlens", "32", "--seed", str(seed)]
    assert ba.main([*args, "--providers", "flash,naive", "--softcap", "0.5"]) == 0
    data = json.loads((tmp_path / "attention_cpu_softcap0.5.json").read_text())
    assert data["metadata"]["softcap"] == 0.5 and len(data["records"]) == 2 * 3
    for r in data["records"]:
        assert r["status"] == "ok" and r["max_abs_err"] < 1e-3, r
    assert "c = 0.5" in (tmp_path / "attention_cpu_softcap0.5.md").read_text()
    # a given --tag keeps the suffix: the capped rows never overwrite the plain rows of that tag
    assert ba.main([*args, "--providers", "naive", "--tag", "t"]) == 0
    assert ba.main([*args, "--providers", "naive", "--softcap", "0.5", "--tag", "t"]) == 0
    plain_rows = json.loads((tmp_path / "attention_t.json").read_text())
    assert plain_rows["metadata"].get("softcap") is None
    assert json.loads((tmp_path / "attention_t_softcap0.5.json").read_text())["metadata"]["softcap"] == 0.5
    cpu = dict(device=torch.device("cpu"), dtype=torch.float32, seed=seed, need_grads=False)
    capped, plain = ba.make_inputs(2, 4, 32, 16, softcap=0.5, **cpu), ba.make_inputs(2, 4, 32, 16, **cpu)
    assert (capped.ref_o - plain.ref_o).abs().max() > 10 * ba.TOLERANCES[torch.float32][0]
    with pytest.raises(SystemExit) as exc:
        ba.main([*args, "--providers", "naive,sdpa-math", "--softcap", "0.5"])
    assert exc.value.code == 2 and "sdpa-math cannot soft-cap" in capsys.readouterr().err


@pytest.mark.slow  # over 5 s on 2 cores
def test_attention_merge_records_invocations(tmp_path):
    """Invocations with one tag and --merge: the file holds every run's rows, and its metadata and markdown
    say which seqlens were measured when; an invocation whose cells were all measured again leaves."""
    first = _bench(tmp_path, "--providers", "naive", "--seqlens", "16")
    assert "invocations" not in first["metadata"]
    data = _bench(tmp_path, "--providers", "naive", "--seqlens", "32", "--merge")
    assert sorted({r["N"] for r in data["records"]}) == [16, 32]
    inv = data["metadata"]["invocations"]
    assert [i["seqlens"] for i in inv] == [[16], [32]] and inv[0]["date"] == first["metadata"]["date"]
    md = (tmp_path / "attention_cpu.md").read_text()
    assert md.count("merged (`--merge`)") == 2 and "N = [16]" in md and "N = [32]" in md
    # re-measuring only the forward of N=16 keeps the first invocation (its bwd rows are left) ...
    part = _bench(tmp_path, "--providers", "naive", "--seqlens", "16", "--modes", "fwd", "--merge")
    assert [i["seqlens"] for i in part["metadata"]["invocations"]] == [[16], [32], [16]]
    # ... measuring all of N=16 again replaces its rows: both earlier N=16 lines go, the new one is last
    again = _bench(tmp_path, "--providers", "naive", "--seqlens", "16", "--merge")
    assert [i["seqlens"] for i in again["metadata"]["invocations"]] == [[32], [16]]
    assert len(again["records"]) == len(data["records"])


def test_attention_merge_refuses_bad_or_incomparable_files(tmp_path, capsys):
    """--merge onto a file of another shape, or measured with other table-wide settings: a clear error
    (exit 2), and the file is left as it was."""
    _bench(tmp_path, "--providers", "naive", "--seqlens", "16")
    path = tmp_path / "attention_cpu.json"
    good = path.read_text()
    rec = {"provider": "naive", "N": 16, "d": 16, "mode": "fwd"}
    bads = (
        *("[]", "null", '{"records": 5}', '{"records": [1, 2]}', '{"records": [], "metadata": "abc"}'),
        *('{"records": [{"provider": "naive"}]}', "{not json"),
        json.dumps({"records": [rec | {"N": "16"}]}),
        json.dumps({"records": [rec | {"provider": ["x"]}]}),
        json.dumps({"records": [rec], "metadata": {"invocations": "abc"}}),
        json.dumps({"records": [rec], "metadata": {"seqlens": 5}}),
        json.dumps({"records": [rec], "metadata": {"invocations": [{"seqlens": [[16]]}]}}),
    )
    for bad in bads:  # the reader refuses each; the CLI turns that into exit 2 (checked once below)
        path.write_text(bad)
        with pytest.raises(ValueError):
            ba.read_for_merge(path)
    argv = ["--dry-run", "--out", str(tmp_path), "--providers", "naive", "--seqlens", "32", "--merge"]
    capsys.readouterr()
    assert ba.main(argv) == 2 and "error: --merge: cannot read" in capsys.readouterr().err
    assert path.read_text() == bads[-1]
    path.write_text(good)
    assert ba.main([*argv, "--dtype", "float16"]) == 2
    err = capsys.readouterr().err
    assert "dtype=" in err and "another --tag" in err and path.read_text() == good


def test_flops_formula():
    assert ba.attention_flops(2, 3, 5, 7, "fwd") == 2 * 2 * 3 * 5 * 5 * 7
    assert ba.attention_flops(2, 3, 5, 7, "bwd") == 2.5 * 2 * 2 * 3 * 5 * 5 * 7
    assert ba.attention_flops(2, 3, 5, 7, "fwdbwd") == 3.5 * 2 * 2 * 3 * 5 * 5 * 7
    assert ba.shape_for(16384, 2048, 32768, 128) == (1, 16) and ba.shape_for(16384, 2048, 512, 64) == (32, 32)
    with pytest.raises(ValueError, match="multiple"):
        ba.shape_for(16384, 2048, 512, 96)


@pytest.mark.parametrize("softcap", [None, 1.5])
def test_reference_attention_matches_float64_autograd(seed, softcap):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(2, 3, 37, 8, generator=g, dtype=torch.float64) for _ in range(4))
    q = q * 3  # scores beyond the soft-cap, where tanh bends
    # 37 rows: 4 full chunks + 1 partial
    o_ref, grads = ba.chunked_causal_reference(q, k, v, do, chunk=8, softcap=softcap)
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    s = (qq @ kk.transpose(-1, -2)) / math.sqrt(8)
    s = softcap * torch.tanh(s / softcap) if softcap else s
    o = torch.softmax(s.masked_fill(torch.ones(37, 37, dtype=torch.bool).triu(1), float("-inf")), -1) @ vv
    o.backward(do)
    assert o_ref.dtype == torch.float32
    torch.testing.assert_close(o_ref.double(), o.detach(), atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, (qq.grad, kk.grad, vv.grad), strict=True):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def _provider_records(seed: int, kind: str | None, modes=ba.MODES, h: int = 2) -> list[dict]:
    cpu = torch.device("cpu")
    inp = ba.make_inputs(2, h, 16, 8, device=cpu, dtype=torch.float32, seed=seed, need_grads=True)
    fn = lambda: common.build_provider("sdpa-math", n=16, device=cpu)
    factory = (lambda: ba.inject_failure(fn(), kind)) if kind else fn
    timer = common.Timer(cpu, cpu_reps=1)
    return ba.bench_provider("sdpa-math", factory, inp, modes=modes, timer=timer, tol=(5e-3, 1e-2))


@pytest.mark.parametrize("kind, expect", [("oom", "oom"), ("error", "error:"), ("wrong", "mismatch:")])
def test_bench_provider_failures_recorded(kind, expect, seed):
    recs = _provider_records(seed, kind)
    assert [r["mode"] for r in recs] == list(ba.MODES)
    for r in recs:
        assert r["status"].startswith(expect), r
        assert r["ms_median"] is None and r["tflops"] is None  # failing providers are not timed
    if kind == "wrong":
        assert recs[0]["max_abs_err"] == pytest.approx(0.5, abs=1e-5)


def test_bench_provider_ok_checks_grads(seed):
    recs = _provider_records(seed, None, modes=("fwd", "bwd"), h=3)
    assert [r["status"] for r in recs] == ["ok", "ok"]
    assert set(recs[1]["errors"]) == {"o", "dq", "dk", "dv"} and recs[1]["max_abs_err"] < 1e-4


def _fake_record(provider, n, d, mode, status="ok", tflops=None, peak=None):
    rec = dict(provider=provider, N=n, d=d, B=16384 // n, H=2048 // d, mode=mode, status=status)
    rec |= dict(ms_median=1.0 if status == "ok" else None, tflops=tflops if status == "ok" else None)
    return rec | dict(
        peak_gib=peak, peak_extra_gib=None if peak is None else peak / 2, max_abs_err=1e-3, errors={"o": 1e-3}
    )


def test_markdown_and_plot_gpu_like_records(tmp_path, seed):
    rng = np.random.default_rng(seed)
    recs = []
    for d, n, p, m in np.ndindex(2, 2, 4, 3):
        d, n, p, m = (64, 128)[d], (1024, 32768)[n], ("flash", "sdpa-flash", "flex", "naive")[p], ba.MODES[m]
        if p == "naive" and n == 32768:
            recs.append(_fake_record(p, n, d, m, status="oom"))
        else:
            recs.append(
                _fake_record(p, n, d, m, tflops=float(rng.uniform(50, 500)), peak=float(rng.uniform(1, 9)))
            )
    md = ba.markdown({"gpu": "NVIDIA H200", "dtype": "bfloat16"}, recs)
    idx = {(r["provider"], r["N"], r["d"], r["mode"]): r for r in recs}
    assert (
        f"{idx[('flash', 1024, 128, 'bwd')]['tflops'] / idx[('flex', 1024, 128, 'bwd')]['tflops']:.2f}×" in md
    )
    assert "OOM" in md and "peak memory of one forward+backward" in md
    peak = idx[("sdpa-flash", 32768, 64, "fwd")]["peak_gib"]
    assert f"{peak:.2f} / {peak / 2:.2f}" in md
    assert ba.plot(recs, tmp_path / "a.png").stat().st_size > 0
    # --merge semantics: same key replaced in place, new keys appended
    new = [
        _fake_record("flash", 1024, 64, "fwd", tflops=1.0),
        _fake_record("flash", 2048, 64, "fwd", tflops=2.0),
    ]
    merged = ba.merge_records(recs, new)
    assert len(merged) == len(recs) + 1
    assert idx[("flash", 1024, 64, "fwd")] not in merged and new[0] in merged and merged[-1] is new[1]


# ------------------------------------------------------------------------------------ synthetic runs


def _random_walk(rng: np.random.Generator, n: int, start: float = 10.0) -> np.ndarray:
    return start - np.cumsum(np.abs(rng.normal(0.02, 0.05, n))) + rng.normal(0, 0.05, n)


def make_run(
    root: Path,
    name: str,
    backend: str,
    seq_len: int,
    *,
    status="ok",
    train=None,
    val=None,
    tps=None,
    sdpa_backend=None,
) -> Path:
    """A run directory as train.py writes it: .hydra/config.yaml, metrics.jsonl, summary.json."""
    d = root / name
    (d / ".hydra").mkdir(parents=True)
    att = f"  name: {backend}\n" + (f"  sdpa_backend: {sdpa_backend}\n" if sdpa_backend else "")
    (d / ".hydra" / "config.yaml").write_text(
        f"attention:\n{att}seq_len: {seq_len}\nrun_name: ${{now:%H}}_{backend}\nwandb:\n  project: "
        "flashgpt-test\n  group: sweep-test\n"
    )
    train, val, tps = train or {}, val or {}, tps or []
    steps = sorted(set(train) | set(val))
    with (d / "metrics.jsonl").open("w") as f:
        for i, s in enumerate(steps):
            row = (
                {"step": s}
                | ({"train/loss": train[s]} if s in train else {})
                | ({"val/loss": val[s]} if s in val else {})
            )
            if i < len(tps):
                row |= {
                    "perf/tokens_per_sec": tps[i],
                    "perf/mfu": tps[i] / 1e6,
                    "mem/peak_gib": 1.5 + i * 0.01,
                }
            f.write(json.dumps(row) + "\n")
    summary = {"status": status, "attention": backend, "seq_len": seq_len, "steps": steps[-1] if steps else 0}
    summary |= ({"final/train_loss": train[max(train)]} if train else {}) | (
        {"mem/peak_gib": 2.0} if status == "ok" else {}
    )
    (d / "summary.json").write_text(json.dumps(summary))
    return d


def _edit_summary(run: Path, **changes) -> dict:
    summary = json.loads((run / "summary.json").read_text()) | changes
    (run / "summary.json").write_text(json.dumps(summary))
    return summary


def test_report_sweep(tmp_path, seed, capsys):
    rng = np.random.default_rng(seed)
    sweep, out = tmp_path / "multirun", tmp_path / "out"
    expected_tps = {}
    for i, (backend, n) in enumerate([("naive", 256), ("flash", 256), ("flash", 512), ("sdpa", 512)]):
        tps = list(rng.uniform(1e4, 1e5, 20))
        train = dict(enumerate(_random_walk(rng, 20).tolist(), 1))
        sdpa = "flash" if backend == "sdpa" else None
        make_run(sweep, f"{i}_{backend}_n{n}", backend, n, train=train, tps=tps, sdpa_backend=sdpa)
        expected_tps[(backend if not sdpa else "sdpa-flash", n)] = float(
            np.median(tps[2:])
        )  # first 10 % dropped
    make_run(sweep, "4_naive_n512", "naive", 512, status="oom")
    make_run(sweep, "5_flash_n1024", "flash", 1024, status="nonfinite", train={1: 9.0, 2: float("nan")})
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    assert br.main([str(sweep), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    for name in (
        "0_naive_n256",
        "1_flash_n256",
        "2_flash_n512",
        "3_sdpa_n512",
        "4_naive_n512",
        "5_flash_n1024",
    ):
        assert name in md
    assert "OOM" in md and "nonfinite" in md and "sdpa-flash" in md
    pivot = md.split("## tokens/sec")[1].split("##")[0]
    assert "OOM" in next(line for line in pivot.splitlines() if line.startswith("| 512 |"))
    rep = json.loads((out / "report.json").read_text())
    assert len(rep["runs"]) == 6
    for r in (r for r in rep["runs"] if r["status"] == "ok"):
        assert r["tokens_per_sec"] == pytest.approx(expected_tps[(r["backend"], r["seq_len"])], rel=1e-12)
    assert (out / "report_sweep.png").stat().st_size > 0
    assert "OOM" in capsys.readouterr().out


def test_report_figures_agree_with_summary(tmp_path, seed):
    """bench.report shows each run's summary.json figures (the trainer's medians), not its own median of
    metrics.jsonl; a run without them falls back to the log, marked with a dagger. Two runs of one
    (seq_len, backend) cell are told apart by their run names."""
    rng = np.random.default_rng(seed)
    sweep, summaries = tmp_path / "sweep", {}
    for name in ("0_flash_n256", "1_flash_n256_rerun"):
        train = dict(enumerate(_random_walk(rng, 10).tolist(), 1))
        d = make_run(sweep, name, "flash", 256, train=train, tps=list(rng.uniform(1e4, 2e4, 10)))
        figures = {
            "perf/tokens_per_sec": rng.uniform(3e4, 4e4),
            "perf/mfu": rng.uniform(),
            "mem/peak_gib": rng.uniform(3, 4),
        }
        summaries[name] = _edit_summary(
            d, **{k: float(v) for k, v in figures.items()}, **{"final/val_loss": float(rng.uniform(4, 5))}
        )
    logged_tps = list(rng.uniform(1e4, 2e4, 10))
    make_run(sweep, "2_sdpa_n256", "sdpa", 256, train={s: 5.0 - s / 10 for s in range(1, 11)}, tps=logged_tps)
    assert br.main([str(sweep), "--out", str(tmp_path / "out")]) == 0
    rows = {r["run"]: r for r in json.loads((tmp_path / "out" / "report.json").read_text())["runs"]}
    for name, summary in summaries.items():
        r = rows[name]
        assert (
            r["tokens_per_sec"] == summary["perf/tokens_per_sec"]
            and r["sources"]["tokens_per_sec"] == "summary.json"
        )
        assert r["mfu_pct"] == pytest.approx(100 * summary["perf/mfu"], rel=1e-12)
        assert r["peak_gib"] == summary["mem/peak_gib"] and r["final_val_loss"] == summary["final/val_loss"]
    assert rows["2_sdpa_n256"]["tokens_per_sec"] == pytest.approx(float(np.median(logged_tps[1:])), rel=1e-12)
    assert rows["2_sdpa_n256"]["sources"]["tokens_per_sec"] == "metrics.jsonl median"
    pivot = (tmp_path / "out" / "report.md").read_text().split("## tokens/sec")[1].split("##")[0]
    row = next(line for line in pivot.splitlines() if line.startswith("| 256 |"))
    for name, summary in summaries.items():
        assert f"{summary['perf/tokens_per_sec']:,.0f} ({name})" in row, row
    assert f"{np.median(logged_tps[1:]):,.0f}†" in row, row


def test_report_leaves_out_an_untrained_val_loss(tmp_path, seed):
    """A run whose only eval was at step 0 (eval.at_start, stopped before its first interval) has no final
    val loss in the report (the untrained model's would read as the run's); one evaluated later keeps it."""
    rng = np.random.default_rng(seed)
    train = dict(enumerate(_random_walk(rng, 12).tolist(), 1))
    v0, v12 = float(rng.uniform(4, 5)), float(rng.uniform(2, 3))
    for name, val in (("0_flash_n64", {0: v0}), ("1_sdpa_n64", {0: v0, 12: v12})):
        d = make_run(
            tmp_path / "sweep", name, name.split("_")[1], 64, status="interrupted", train=train, val=val
        )
        _edit_summary(d, **{"final/val_loss": val[max(val)]})
    assert br.main([str(tmp_path / "sweep"), "--out", str(tmp_path / "out")]) == 0
    rows = {r["run"]: r for r in json.loads((tmp_path / "out" / "report.json").read_text())["runs"]}
    assert (
        rows["0_flash_n64"]["final_val_loss"] is None
        and "step 0" in rows["0_flash_n64"]["sources"]["final_val_loss"]
    )
    assert rows["1_sdpa_n64"]["final_val_loss"] == v12


def test_report_wandb_disabled_and_missing_dir(tmp_path, seed, monkeypatch, capsys):
    make_run(
        tmp_path / "s", "0_flash_n128", "flash", 128, train={1: float(np.random.default_rng(seed).normal())}
    )
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert br.main([str(tmp_path / "s"), "--wandb"]) == 0
    assert "W&B logging skipped" in capsys.readouterr().out
    assert br.main([str(tmp_path / "missing")]) == 2
    assert "sweep directory" in capsys.readouterr().err
    assert (
        br.main([str(tmp_path / "s" / "0_flash_n128" / "metrics.jsonl")]) == 2
    )  # a file: not "does not exist"
    assert "metrics.jsonl is a file, not a folder (pass the Hydra multirun folder" in capsys.readouterr().err


@pytest.mark.slow  # over 5 s on 2 cores
@pytest.mark.parametrize("tool", ["report", "compare"])
def test_report_and_compare_of_read_only_runs_print_and_exit_0(tmp_path, seed, tool):
    """A colleague's runs on a read-only file system: the report (or comparison table) is printed, a note
    names what could not be written where (and --out), exit 0, and the folder is unchanged. Root ignores
    permission bits, so as root the folder is a read-only bind mount in a private mount namespace; as another
    user it has no write bit."""
    rng = np.random.default_rng(seed)
    sweep = tmp_path / "sweep"
    train = dict(enumerate(_random_walk(rng, 5).tolist(), 1))
    make_run(sweep, "0_flash_n128", "flash", 128, train=train, tps=[1e4, 2e4])
    make_run(sweep, "1_sdpa_n128", "sdpa", 128, train=train, tps=[1e4, 2e4])
    before = sorted(p.relative_to(sweep) for p in sweep.rglob("*"))
    if tool == "report":
        cmd = [sys.executable, "-m", "bench.report", str(sweep), "--wandb"]
    else:
        cmd = [sys.executable, "-m", "bench.compare", str(sweep / "0_flash_n128"), str(sweep / "1_sdpa_n128")]
    if os.geteuid() == 0:
        if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode:
            pytest.skip("as root a read-only folder needs a mount namespace (unshare -m), not allowed here")
        cmd = ["unshare", "-m", "sh", "-c", 'mount --bind -o ro "$0" "$0" && exec "$@"', str(sweep), *cmd]
    else:
        for p in (sweep, *(p for p in sweep.rglob("*") if p.is_dir())):
            p.chmod(0o555)
    env = dict(os.environ, PYTHONPATH=str(REPO), WANDB_MODE="disabled")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and str(sweep) in proc.stderr and "--out" in proc.stderr
    if tool == "report":
        assert "| 128 |" in proc.stdout and "0_flash_n128" in proc.stdout  # the report itself
        assert "could not write report.md, report.json, report_sweep.png" in proc.stderr, proc.stderr
        assert "W&B logging skipped" in proc.stdout
    else:
        assert "| 1 | sdpa N=128 |" in proc.stdout  # the comparison table
        assert f"could not write {sweep / '0_flash_n128' / 'compare.png'}" in proc.stderr, proc.stderr
    assert sorted(p.relative_to(sweep) for p in sweep.rglob("*")) == before


@pytest.mark.slow
def test_report_wandb_offline(tmp_path, seed, monkeypatch, capsys):
    make_run(
        tmp_path / "s",
        "0_flash_n128",
        "flash",
        128,
        train={1: float(np.random.default_rng(seed).normal())},
        tps=[1e4, 2e4],
    )
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert br.main([str(tmp_path / "s"), "--out", str(tmp_path / "o"), "--wandb"]) == 0
    assert "group 'sweep-test'" in capsys.readouterr().out
    # run.finish() returns when wandb's service has the data; the service may write the offline file a
    # moment later, so wait for it (bounded) instead of reading once
    deadline = time.monotonic() + 60
    while (
        not (files := list((tmp_path / "o" / "wandb").rglob("*.wandb")))
        or b"report/table" not in files[0].read_bytes()
    ):
        assert time.monotonic() < deadline, files
        time.sleep(0.5)


@pytest.mark.slow
def test_report_wandb_falls_back_to_offline(tmp_path, seed, monkeypatch, capsys):
    """Without WANDB_MODE and without a W&B login, `--wandb` logs offline like the trainer's wandb.mode=auto
    and prints the `wandb sync` command, instead of trying to log in."""
    make_run(
        tmp_path / "s",
        "0_flash_n128",
        "flash",
        128,
        train={1: float(np.random.default_rng(seed).normal())},
        tps=[1e4, 2e4],
    )
    for var in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    assert br.main([str(tmp_path / "s"), "--out", str(tmp_path / "o"), "--wandb"]) == 0
    out = capsys.readouterr().out
    assert "(mode offline)" in out and "wandb sync " in out, out
    sync_dir = Path(out.split("wandb sync ")[1].split()[0])
    assert (
        sync_dir.is_dir() and sync_dir.name.startswith("offline-run-") and tmp_path / "o" in sync_dir.parents
    )


# ------------------------------------------------------------------------------------------- compare


def _expected_diffs(a: dict, b: dict, window: int) -> dict:
    steps = sorted(set(a) & set(b))
    x, y = np.array([a[s] for s in steps]), np.array([b[s] for s in steps])
    k = len(steps) // window
    wx, wy = x[: k * window].reshape(k, window).mean(1), y[: k * window].reshape(k, window).mean(1)
    return {
        "aligned": len(steps),
        "max": np.abs(x - y).max(),
        "mean": np.abs(x - y).mean(),
        "win": np.abs(wx - wy).max(),
    }


def test_compare_diffs_and_exit_codes(tmp_path, seed, capsys):
    rng = np.random.default_rng(seed)
    ref_train = dict(enumerate(_random_walk(rng, 120).tolist(), 1))
    near_train = {s: v + rng.normal(0, 0.01) for s, v in ref_train.items() if s <= 100 and s != 7}
    far_train = {s: v + 0.3 + rng.normal(0, 0.01) for s, v in ref_train.items()}
    ref_val = {s: ref_train[s] + 0.1 for s in (50, 100, 120)}
    near_val, far_val = (
        {50: ref_val[50] + 0.001, 100: ref_val[100] - 0.002},
        {s: v + 0.3 for s, v in ref_val.items()},
    )
    r0 = make_run(tmp_path, "ref", "naive", 256, train=ref_train, val=ref_val)
    r1 = make_run(tmp_path, "near", "flash", 256, train=near_train, val=near_val)
    r2 = make_run(tmp_path, "far", "sdpa", 256, train=far_train, val=far_val)
    js, png = tmp_path / "cmp.json", tmp_path / "cmp.png"
    assert bc.main([str(r0), str(r1), str(r2), "--window", "10", "--out", str(png), "--json", str(js)]) == 0
    assert png.stat().st_size > 0
    res = json.loads(js.read_text())["results"]
    for got, other, oval in ((res[0], near_train, near_val), (res[1], far_train, far_val)):
        want = _expected_diffs(ref_train, other, 10)
        assert got["aligned_steps"] == want["aligned"]
        for key, name in (("max_abs_diff", "max"), ("mean_abs_diff", "mean"), ("window_max_abs_diff", "win")):
            assert got[key] == pytest.approx(want[name], rel=1e-12)
        last = max(set(ref_val) & set(oval))
        assert got["val_step"] == last
        assert got["final_val_abs_diff"] == pytest.approx(abs(oval[last] - ref_val[last]), rel=1e-12)
    out = capsys.readouterr().out
    assert "naive N=256 (reference)" in out and "flash N=256" in out
    base = ["--window", "10", "--out", str(png)]
    # near passes, far exceeds (train ~0.3 and val 0.3 apart)
    assert bc.main([str(r0), str(r1), *base, "--tolerance", "0.05", "--val-tolerance", "0.05"]) == 0
    assert bc.main([str(r0), str(r2), *base, "--tolerance", "0.05"]) == 1
    assert "--tolerance" in capsys.readouterr().out
    assert bc.main([str(r0), str(r2), *base, "--val-tolerance", "0.05"]) == 1
    assert bc.main([str(r0), str(r2), "--tolerance", "1.0", "--val-tolerance", "1.0", "--out", str(png)]) == 0


def test_compare_nan_and_missing(tmp_path, seed, capsys):
    base = _random_walk(np.random.default_rng(seed), 30).tolist()
    r0 = make_run(tmp_path, "a", "naive", 64, train=dict(enumerate(base, 1)))
    r1 = make_run(tmp_path, "b", "flash", 64, train=dict(enumerate(base, 1)) | {30: float("nan")})
    png = str(tmp_path / "c.png")
    assert bc.main([str(r0), str(r1), "--tolerance", "10", "--out", png]) == 1  # NaN never passes
    assert bc.main([str(r0), str(tmp_path / "nope"), "--out", png]) == 2
    (tmp_path / "empty").mkdir()
    assert bc.main([str(r0), str(tmp_path / "empty"), "--out", png]) == 2
    assert bc.main([str(r0), "--out", png]) == 2
    (tmp_path / "e.jsonl").touch()  # the empty file named, not a metrics.jsonl beside it
    capsys.readouterr()
    assert bc.main([str(r0), str(tmp_path / "e.jsonl"), "--out", png]) == 2
    assert f"error: {tmp_path / 'e.jsonl'} holds no train/loss (" in capsys.readouterr().err
    for flag, value in (("--tolerance", "-1"), ("--val-tolerance", "nan")):  # every run would fail them
        with pytest.raises(SystemExit) as e:
            bc.main([str(r0), str(r1), flag, value, "--out", png])
        err = capsys.readouterr().err
        assert (
            e.value.code == 2
            and f"{flag} must be >= 0 (a loss difference), got {value}; e.g. {flag} 0.05" in err
        )


def test_compare_flags_incomplete_runs(tmp_path, seed, capsys):
    """A run that diverged (status nonfinite) fails a tolerance check even where its few points agree, and
    the PNG defaults to the first run's directory."""
    base = dict(enumerate(_random_walk(np.random.default_rng(seed), 40).tolist(), 1))
    r0 = make_run(tmp_path, "ok", "sdpa", 64, train=base)
    r1 = make_run(
        tmp_path, "diverged", "flash", 64, status="nonfinite", train={s: v for s, v in base.items() if s <= 3}
    )
    assert bc.main([str(r0), str(r1)]) == 0  # no tolerance asked: report only, with a warning
    assert (r0 / "compare.png").is_file()
    out = capsys.readouterr()
    assert "status 'nonfinite'" in out.err
    row = next(line for line in out.out.splitlines() if line.startswith("| 1 |"))  # the check column names it
    assert row.endswith("| — (flash N=64 nonfinite) |"), out.out  # no tolerance: nothing checked
    assert bc.main([str(r0), str(r1), "--tolerance", "1.0"]) == 1
    assert "not a complete run" in capsys.readouterr().out


def test_compare_max_step(tmp_path, seed):
    ref = dict(enumerate(_random_walk(np.random.default_rng(seed), 60).tolist(), 1))
    r0 = make_run(tmp_path, "a", "sdpa", 64, train=ref)
    r1 = make_run(
        tmp_path, "b", "flash", 64, train={s: v + (0.0 if s <= 30 else 0.5) for s, v in ref.items()}
    )
    argv = [str(r0), str(r1), "--window", "10", "--tolerance", "0.1", "--out", str(tmp_path / "c.png")]
    assert bc.main(argv) == 1 and bc.main([*argv, "--max-step", "30"]) == 0  # it diverges after step 30


def test_compare_val_difference_never_at_step_0(tmp_path, seed, capsys):
    """Step 0's val loss is the untrained model's: two runs whose only common val point is step 0 report no
    val difference (and --val-tolerance says it cannot be checked); with a later common point, that one."""
    rng = np.random.default_rng(seed)
    base = dict(enumerate(_random_walk(rng, 40).tolist(), 1))
    v0 = float(rng.uniform(9, 11))
    r0 = make_run(tmp_path, "a", "sdpa", 64, train=base, val={0: v0, 40: base[40] + 0.1})
    r1 = make_run(tmp_path, "b", "flash", 64, train=base, val={0: v0 + 0.5})  # no eval after step 0
    js, png = tmp_path / "c.json", ["--out", str(tmp_path / "c.png")]
    assert bc.main([str(r0), str(r1), *png, "--json", str(js)]) == 0
    res = json.loads(js.read_text())["results"][0]
    assert res["val_step"] is None and res["final_val_abs_diff"] is None, res
    assert bc.main([str(r0), str(r1), "--val-tolerance", "1", *png]) == 1
    assert "after step 0" in capsys.readouterr().out
    later = float(rng.uniform(0.01, 0.2))
    r2 = make_run(tmp_path, "c", "flash", 64, train=base, val={0: v0 + 0.5, 40: base[40] + 0.1 + later})
    assert bc.main([str(r0), str(r2), *png, "--json", str(js)]) == 0
    res = json.loads(js.read_text())["results"][0]
    assert res["val_step"] == 40 and res["final_val_abs_diff"] == pytest.approx(later, rel=1e-9)


def test_compare_warns_when_configs_differ(tmp_path, seed, capsys):
    """A run of another seq_len / max_steps / LR schedule is compared, but with a warning naming each key
    and both values; the backend, out_dir and W&B keys never count as differences."""
    base = dict(enumerate(_random_walk(np.random.default_rng(seed), 30).tolist(), 1))
    optim = {"lr": 6e-4, "warmup_steps": 5, "decay_steps": None}
    cfg = {"attention": {"name": "sdpa"}, "seq_len": 64, "max_steps": 30, "out_dir": "runs/a", "optim": optim}
    cfg["wandb"] = {"group": "g1"}
    runs = []
    for name, change in (
        ("ref", {}),
        ("same", {"attention": {"name": "flash"}, "out_dir": "runs/b", "wandb": {"group": "g2"}}),
        ("other", {"seq_len": 128, "max_steps": 60, "optim": optim | {"decay_steps": 30}}),
    ):
        d = make_run(tmp_path, name, "sdpa", 64, train=base)
        (d / "config.resolved.yaml").write_text(json.dumps(cfg | change))  # JSON is YAML
        runs.append(str(d))
    js, png = tmp_path / "c.json", ["--out", str(tmp_path / "c.png")]
    assert bc.main([runs[0], runs[1], *png, "--json", str(js)]) == 0
    assert "differ in config" not in capsys.readouterr().err
    assert json.loads(js.read_text())["results"][0]["config_differences"] == {}
    assert bc.main([*runs, *png, "--json", str(js)]) == 0
    err = capsys.readouterr().err
    warned = [line for line in err.splitlines() if "differ in config" in line]
    assert len(warned) == 1 and warned[0].startswith("warning: sdpa N=128 and the reference sdpa N=64"), err
    for text in ("seq_len: 64 vs 128", "max_steps: 30 vs 60", "optim.decay_steps: None vs 30"):
        assert text in warned[0], err
    diffs = json.loads(js.read_text())["results"][1]["config_differences"]
    assert diffs == {"max_steps": [30, 60], "optim.decay_steps": [None, 30], "seq_len": [64, 128]}


def test_compare_warns_when_a_run_has_no_config(tmp_path, seed, capsys):
    """A bare metrics.jsonl (its run's config not beside it): its tokenizer or max_steps cannot be compared,
    so a warning names it instead of mixing it in silently."""
    base = dict(enumerate(_random_walk(np.random.default_rng(seed), 30).tolist(), 1))
    ref, bare = make_run(tmp_path, "ref", "sdpa", 64, train=base), tmp_path / "bare"
    bare.mkdir()
    (bare / "metrics.jsonl").write_bytes((ref / "metrics.jsonl").read_bytes())
    assert bc.main([str(ref), str(bare), "--out", str(tmp_path / "c.png")]) == 0
    err = capsys.readouterr().err
    assert f"warning: no config (config.resolved.yaml or .hydra/config.yaml) for bare ({bare})" in err, err
    assert "max_steps" in err and "ref (" not in err, err


def test_compare_ignores_where_and_how_a_config_was_composed():
    """derived.cwd and derived.group_choices (attention=flash vs sdpa) are no config difference; a real key
    under derived (the micro-batch the plan chose) still is."""
    cfg = lambda cwd, backend: {
        "seq_len": 64,
        "derived": {"cwd": cwd, "group_choices": {"attention": backend}, "micro_batch_size": 8},
    }
    a, b = cfg("/x", "sdpa"), cfg("/y", "flash")
    assert bc.config_differences(a, b) == {}
    b["derived"]["micro_batch_size"] = 4
    assert bc.config_differences(a, b) == {"derived.micro_batch_size": (8, 4)}


def test_compare_names_and_reports_attention_variants(tmp_path, seed, capsys):
    """A window / document-mask / attention-dropout ablation: each run's label names its variant and the
    differing keys are reported (they change what the curve means), while the backend name is not."""
    rng = np.random.default_rng(seed)
    base = dict(enumerate(_random_walk(rng, 20).tolist(), 1))
    w = int(rng.integers(16, 512))
    runs = []
    for name, attn, p in (
        ("causal", {"name": "flash", "window": None, "document_mask": False}, 0.0),
        ("window", {"name": "flash", "window": w, "document_mask": False}, 0.0),
        ("docs", {"name": "sdpa", "window": None, "document_mask": True}, 0.1),
    ):
        d = make_run(tmp_path, name, attn["name"], 64, train=base)
        (d / "config.resolved.yaml").write_text(
            json.dumps({"attention": attn, "seq_len": 64, "model": {"attn_dropout": p}})
        )
        runs.append(str(d))
    labels = [bc.load_run(r).label for r in runs]
    assert labels == ["flash N=64", f"flash N=64 w={w}", "sdpa N=64 doc-mask attn-drop=0.1"]
    js = tmp_path / "c.json"
    assert bc.main([*runs, "--out", str(tmp_path / "c.png"), "--json", str(js)]) == 0
    res = json.loads(js.read_text())["results"]
    assert res[0]["config_differences"] == {"attention.window": [None, w]}
    assert res[1]["config_differences"] == {
        "attention.document_mask": [False, True],
        "model.attn_dropout": [0.0, 0.1],
    }
    assert "attention.window: None vs " + str(w) in capsys.readouterr().err


def test_run_config_prefers_the_trainers_copy(tmp_path):
    """Hydra rewrites .hydra/config.yaml for every command aimed at a run dir (also one the trainer then
    refuses); the trainer's config.resolved.yaml, written when the run started, is the run's config."""
    d = make_run(tmp_path, "r", "sdpa", 128, train={1: 4.0})  # .hydra says seq_len 128 (a refused command)
    assert common.read_config(d)["seq_len"] == 128
    (d / "config.resolved.yaml").write_text("attention:\n  name: sdpa\nseq_len: 256\n")
    assert common.read_config(d)["seq_len"] == 256 and bc.load_run(d).label == "sdpa N=256"


# ------------------------------------------------------------------------------------------- throughput


@pytest.mark.slow
def test_throughput_cpu_cell_agrees_with_the_runs_summary(tiny, tmp_path):
    """bench.throughput runs train.py once per cell (here one tiny CPU cell) and its JSON and table carry the
    run's own summary.json figures; the run directory goes to --runs-dir, not next to the results."""
    skip = (
        "out_dir=",
        "max_steps=",
        "log_interval=",
        "eval.interval=",
        "checkpoint.interval=",
        "wandb.mode=",
    )
    overrides = [a for a in tiny(tmp_path / "unused") if not a.startswith(skip)]
    out, runs = tmp_path / "res" / "tp", tmp_path / "runs"
    argv = ["--allow-cpu", "--backends", "naive", "--seq-lens", "64", "--steps", "4", "--warmup", "1"]
    argv += [
        "--profile-steps",
        "0",
        "--log-interval",
        "1",
        "--out",
        str(out),
        "--runs-dir",
        str(runs),
        "--",
        *overrides,
    ]
    assert throughput.main(argv) == 0
    (cell,) = json.loads(out.with_suffix(".json").read_text())["cells"]
    (summary_path,) = runs.glob("*/naive_n64/summary.json")
    summary = json.loads(summary_path.read_text())
    assert cell["status"] == "ok" and cell["tokens_per_sec"] == summary["perf/tokens_per_sec"] > 0
    assert f"{summary['perf/tokens_per_sec']:,.0f}" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").stat().st_size > 0
    assert sorted(p.name for p in out.parent.iterdir()) == ["tp.json", "tp.md", "tp.png"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_throughput_refuses_without_a_gpu_unless_allowed(tmp_path, capsys):
    """Without CUDA the default grid (GPT-2 124M cells) is refused, exit 2, nothing written; a long error line
    in a cell's log is kept from its start."""
    assert throughput.main(["--out", str(tmp_path / "tp"), "--runs-dir", str(tmp_path / "runs")]) == 2
    assert "--allow-cpu" in capsys.readouterr().err and not list(tmp_path.iterdir())
    line = "train.py: error: data files (ConnectionError: " + "x" * 900
    assert throughput.error_excerpt("step 1\n" + line + "\nTraceback tail").startswith("train.py: error")


@pytest.mark.parametrize(
    "flags,match",
    [
        (["--backends", ""], "--backends: '': each once"),
        (["--backends", ","], "--backends: ',': each once"),
        (["--seq-lens", "0"], "--seq-lens: '0': must be integers >= 1"),
        (["--timeout", "-1"], "--timeout must be a positive number"),
    ],
)
def test_throughput_refuses_bad_arguments(tmp_path, capsys, flags, match):
    """Usage errors, exit 2 and nothing written, not empty tables or one failed cell per backend."""
    argv = ["--allow-cpu", "--backends", "sdpa", "--seq-lens", "64", "--steps", "4", "--warmup", "1"]
    argv += ["--profile-steps", "0", "--out", str(tmp_path / "tp"), "--runs-dir", str(tmp_path / "runs")]
    with pytest.raises(SystemExit) as exc:
        throughput.main([*argv, *flags, "--", "experiment=cpu_tiny"])
    assert exc.value.code == 2 and match in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_throughput_gaps_attribute_idle_time_to_the_launching_host_op(tmp_path, capsys):
    """--gaps on a hand-made trace: device span and busy time, gaps over the threshold attributed to the host
    ops around the launch that ended them, a launch issued after the device went idle counted as host-caused,
    a gap under the threshold ignored; bad files exit 2 with the reason."""
    dev = lambda name, ts, dur, corr, cat="kernel": dict(
        cat=cat, name=name, ts=ts, dur=dur, args={"correlation": corr}
    )
    op = lambda name, ts, dur: dict(cat="cpu_op", name=name, ts=ts, dur=dur, tid=1)
    launch = lambda ts, dur, corr: (
        op("cudaLaunchKernel", ts, dur) | dict(cat="cuda_runtime", args={"correlation": corr})
    )
    events = [
        *(
            dev("k_a", 0, 10, 1),
            dev("k_b", 30, 10, 2),
            dev("k_c", 41, 5, 3),
            dev("Memcpy HtoD", 60, 5, 4, cat="gpu_memcpy"),
        ),
        *(op("Torch-Compiled Region", 0, 100), op("aten::mm", 24, 5), op("aten::copy_", 4, 3)),
        launch(25, 3, 2),  # after k_a ended at 10: the host made the device wait
        launch(5, 1, 4),  # issued early: the device waited for something else
    ]
    r = throughput.gaps(events)
    assert (r["span_us"], r["busy_us"], r["gap_us"], r["host_caused_us"]) == (65, 30, 34, 20)
    assert r["by_context"] == [
        ("Torch-Compiled Region", "aten::mm", 20, 1),
        ("Torch-Compiled Region", "aten::copy_", 14, 1),
    ]
    assert [g[:3] for g in r["gaps"]] == [(20, 30, "k_b"), (14, 60, "Memcpy HtoD")]

    def trace(name: str, evs: list) -> str:
        with gzip.open(tmp_path / name, "wt") as f:
            json.dump({"traceEvents": evs}, f)
        return str(tmp_path / name)

    assert throughput.main(["--gaps", trace("trace_step1-2.json.gz", events)]) == 0
    out = capsys.readouterr().out
    assert "device busy 0.03 ms (46.2%)" in out and "aten::mm" in out
    (tmp_path / "notes.txt").write_text("not a trace")
    assert (
        throughput.main(["--gaps", str(tmp_path / "notes.txt"), trace("cpu.json.gz", [op("aten::mm", 0, 5)])])
        == 2
    )
    err = capsys.readouterr().err
    assert "notes.txt" in err and "no device events" in err


# ------------------------------------------------------------------------------------------- tuning


def test_tune_records_of_default_tiles_are_json():
    """bench.tune writes every tile config it times into JSON lines, including defaults that carry a `no_tma`
    alternative (the d = 128 dK/dV tile); a nested TileConfig must not break the record."""
    from kernels.plan import KERNEL_NAMES, TileConfig, get_tile_config

    for kernel, d, dtype in np.ndindex(len(KERNEL_NAMES), 2, 3):
        dt = (torch.float16, torch.bfloat16, torch.float32)[dtype]
        cfg = get_tile_config(KERNEL_NAMES[kernel], (64, 128)[d], dt, True, 4096, 4096)
        back = json.loads(json.dumps(tune.cfg_fields(cfg)))
        assert back[:5] == [cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.tma]
        assert (len(back) == 6) == (cfg.no_tma is not None)
    alt = TileConfig(64, 64, 4, 2, tma=True, no_tma=TileConfig(64, 128, 8, 2))
    assert tune.cfg_fields(alt) == [64, 64, 4, 2, True, [64, 128, 8, 2, False]]
    assert tune.parse_configs("64x64x4x2t,128x64x8x3") == [
        TileConfig(64, 64, 4, 2, tma=True),
        TileConfig(128, 64, 8, 3),
    ]


def test_tune_plan_syntax():
    """Plan syntax of the interleaved A/B mode (`bench.tune --plans`)."""
    from kernels.plan import TileConfig

    assert tune.parse_plan("default") == {} and tune.parse_plan("provider:flex") == {"provider": "flex"}
    want = {"bwd_dkdv": TileConfig(64, 64, 4, 2, tma=True), "bwd_dq": TileConfig(128, 64, 8, 3)}
    assert tune.parse_plan("dkdv=64x64x4x2t+dq=128x64x8x3") == want
    for bad in ("provider:", "provider:flex+dkdv=64x64x4x2", "dkdv", "bogus=64x64x4x2", "dq=64x64", "fused"):
        with pytest.raises(SystemExit) as e:
            tune.parse_plan(bad)
        assert e.value.code == 2, bad  # bad input, as bench.tune's exit statuses say


def test_bench_uses_only_public_kernel_names_but_the_decode_tile_search():
    """bench/ imports kernels' public names only (the package's exports and its float32 reference); the one
    exceptions are the decode tile search (`bench.tune --decode`), which runs kernels.flash_decode's private
    launch with tile overrides, and `bench.attention`'s note of the Gluon routes."""
    import ast

    private = set()
    for path in sorted((REPO / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kernels"):
                private |= {(path.name, node.module, a.name) for a in node.names if node.module != "kernels"}
            elif isinstance(node, ast.Import):
                private |= {(path.name, a.name, None) for a in node.names if a.name.startswith("kernels.")}
    assert private == {
        ("attention.py", "kernels.reference", "chunked_causal_reference"),
        ("attention.py", "kernels.plan", "MIN_N"),
        ("attention.py", "kernels.plan", "MIN_N_BWD"),
    }, private
    tree = ast.parse((REPO / "bench" / "tune.py").read_text())
    used = {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.endswith("__")
    }
    assert used == {"_launch_decode"}, used


@pytest.mark.slow
def test_tune_dry_run_search_and_ab(tmp_path):
    """Both modes end to end on the CPU (interpreter, tiny shapes): the search writes one JSON line per timed
    candidate plus the default and names the best; the A/B mode prints one line per plan, and a plan whose
    tiles are not powers of two is refused before anything runs."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    run = lambda *a: subprocess.run(
        [sys.executable, "-m", "bench.tune", "--dry-run", *a],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = tmp_path / "search.jsonl"
    proc = run("--kernels", "fwd", "--configs", "16x16x4x1,32x16x4x1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["plan"] for r in recs] == ["default", "candidate", "candidate"] and "best" in proc.stdout
    assert [r["cfg"][:4] for r in recs[1:]] == [[16, 16, 4, 1], [32, 16, 4, 1]]
    assert all(r["err"] is None and r["ms"] > 0 and r["d"] == 16 and r["N"] == 32 for r in recs), recs
    proc = run("--plans", "default", "dq=16x16x4x1", "provider:naive", "--rounds", "1")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("d=16")]
    assert len(lines) == 3 and all("fwd" in x and "bwd" in x for x in lines), proc.stdout
    assert list(tmp_path.iterdir()) == [out]  # A/B writes no file unless --out names one
    bad = run("--plans", "fwd=24x16x4x1")
    assert bad.returncode != 0 and "power" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr


def test_tune_loss_search_checks_every_launch(monkeypatch, capsys):
    """`bench.tune --loss` (interpreter, tiny logits): one line per launch of LOSS_PROGRAMS, the best three;
    a launch whose loss differs from the float64 reference stops the search with status 1 and names it."""
    from tests.kernel_modes import enter

    enter("interpreter", monkeypatch)
    assert tune.main(["--dry-run", "--loss"]) == 0
    out = capsys.readouterr().out
    assert out.count(" TB/s") == len(tune.LOSS_PROGRAMS) and out.count("best: ") == 3, out
    real = F.cross_entropy
    monkeypatch.setattr(F, "cross_entropy", lambda *a, **k: real(*a, **k) + 0.1)  # a reference off by 0.1
    assert tune.main(["--dry-run", "--loss"]) == 1
    assert "programs/SM 1, BLOCK 128, warps 4: loss or gradient off by 1.00e-01" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a CUDA GPU")
@pytest.mark.parametrize("argv", [[], ["--d", "64", "--plans", "default"], ["--decode"]])
def test_tune_without_cuda_exits_cleanly(tmp_path, monkeypatch, capsys, argv):
    """bench.tune without --dry-run stops with status 2 and a message naming the fix, and writes nothing
    (it used to create tune.jsonl before failing)."""
    monkeypatch.chdir(tmp_path)
    assert tune.main(argv) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err and list(tmp_path.iterdir()) == []


def test_report_keeps_the_runs_of_an_ablation_sweep_apart(tmp_path, seed):
    """Four runs of one backend and seq_len that differ in model.pos_emb and model.qk_norm (the README's
    ablation sweep): each gets the differing keys in its label, so the table has a column per run; keys
    that differ only in bookkeeping (out_dir, wandb) do not count."""
    rng = np.random.default_rng(seed)
    for i, (pos, qk) in enumerate([("learned", False), ("learned", True), ("rope", False), ("rope", True)]):
        d = make_run(tmp_path, f"{i}_sdpa_n128", "sdpa", 128, train={1: float(rng.normal())}, tps=[1e4])
        with (d / ".hydra" / "config.yaml").open("a") as f:
            f.write(f"model:\n  pos_emb: {pos}\n  qk_norm: {str(qk).lower()}\nout_dir: runs/{i}\n")
    runs = br.collect(tmp_path)
    labels = sorted(r["backend"] for r in runs)
    assert labels == [
        "sdpa (pos_emb=learned, qk_norm=False)",
        "sdpa (pos_emb=learned, qk_norm=True)",
        "sdpa (pos_emb=rope, qk_norm=False)",
        "sdpa (pos_emb=rope, qk_norm=True)",
    ], labels
    md = br.markdown(runs, tmp_path, 0.1)
    assert all(label in md for label in labels)


@pytest.mark.slow  # two prepare processes, ~8 s
def test_prepare_bench_records_speed_memory_and_provenance(tmp_path, gpt2_bpe):
    """bench.prepare on a small corpus: a row per worker count with MB/s, tokens/s, the process's peak RSS,
    and the command, commit and date in the results file."""
    out = tmp_path / "prepare.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.prepare", "--mb", "0.3", "--workers", "1,2", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(out.read_text())
    assert [r["workers"] for r in record["rows"]] == [1, 2]
    for r in record["rows"]:
        assert r["tokens"] > 10_000 and r["mb_per_s"] > 0 and r["peak_rss_mb"] > 50, r
    assert record["command"].startswith("python -m bench.prepare --mb 0.3") and record["date"]


def test_compare_labels_name_the_ablation_keys():
    """A sweep over the ablation keys gives curves whose labels say which run is which."""
    base = {"attention": {"name": "flash", "window": None}, "seq_len": 1024, "model": {}}
    assert bc.label_of(base, {}) == "flash N=1024"
    cfg = {**base, "model": {"n_kv_head": 4, "pos_emb": "rope", "qk_norm": True}}
    cfg["attention"] = {"name": "flash", "softcap": 30.0}
    assert bc.label_of(cfg, {}) == "flash N=1024 kv=4 rope qk-norm cap=30"


def test_commit_says_when_the_files_differ_from_it(tmp_path):
    """A results file's commit: the short hash, "+changes" once a tracked file differs from it (the device
    machine's copy of a working tree kept git metadata of an older commit), "unknown" outside git."""
    import subprocess

    from bench import common

    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True, text=True)

    assert common.commit(tmp_path) == "unknown"
    git("init", "-q")
    (tmp_path / "f.py").write_text("a = 1\n")
    git("add", "f.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = git("rev-parse", "--short", "HEAD").stdout.strip()
    assert common.commit(tmp_path) == head
    (tmp_path / "new.py").write_text("untracked\n")  # an untracked file is not a change of the commit
    assert common.commit(tmp_path) == head
    (tmp_path / "f.py").write_text("a = 2\n")
    assert common.commit(tmp_path) == head + "+changes"
