"""The console's sense of time: elapsed/ETA on step lines (trainer/progress.py) and the warning for a
GPT-2-sized model started on the CPU."""

from __future__ import annotations

import random
import re

import pytest

from tests.helpers_train import run_inprocess
from trainer import progress

UNITS = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def _parse(text: str) -> tuple[int, int]:
    """(seconds, size of the smallest unit shown) of a ``format_duration`` string."""
    parts = re.fullmatch(r"(?:(\d+)([dhm]))?(\d+)([dhms])", text)
    assert parts, text
    big, big_unit, small, small_unit = parts.groups()
    total = int(small) * UNITS[small_unit] + (int(big) * UNITS[big_unit] if big else 0)
    return total, UNITS[small_unit]


def test_format_duration_reads_back_within_its_last_unit(seed):
    rng = random.Random(seed)
    for seconds in [rng.uniform(0, 10 ** rng.uniform(0, 6)) for _ in range(300)] + [59.9, 3600, 86400]:
        total, unit = _parse(progress.format_duration(seconds))
        assert total <= seconds < total + unit, (seed, seconds, progress.format_duration(seconds))


def test_clock_eta_is_steps_left_times_mean_step_time(monkeypatch, seed):
    rng = random.Random(seed)
    start, first, steps, max_steps = rng.uniform(0, 1e4), rng.randrange(0, 50), rng.randrange(1, 40), 100
    per_step = rng.uniform(0.5, 90.0)
    now = [start]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    clock = progress.Clock(first)
    assert clock.text(first, max_steps).endswith("eta ?")  # no step yet: no estimate
    now[0] = start + per_step * steps
    elapsed, eta = re.fullmatch(r"elapsed (\S+) \| eta (\S+)", clock.text(first + steps, max_steps)).groups()
    expect_eta = per_step * (max_steps - first - steps)
    for shown, expect in ((elapsed, per_step * steps), (eta, expect_eta)):
        total, unit = _parse(shown)
        assert total <= expect + 1e-6 and expect < total + unit, (seed, shown, expect)


def test_clock_eta_leaves_the_first_windows_one_time_costs_behind(monkeypatch, seed):
    """A first window slowed by one-time costs (a compile) sets the first ETA only; the second window's time
    per step replaces it, and later windows move it by 0.3 of their difference."""
    rng = random.Random(seed)
    slow, fast, later, max_steps = rng.uniform(20, 90), rng.uniform(0.1, 2.0), rng.uniform(0.1, 2.0), 5000
    now = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    clock = progress.Clock(0)

    def eta_after(step: int, per_step: float) -> float:
        now[0] += per_step * (step - clock.last[1])
        return _parse(re.search(r"eta (\S+)", clock.text(step, max_steps)).group(1))[0]

    assert eta_after(10, slow) == pytest.approx(slow * (max_steps - 10), abs=3600)
    assert eta_after(20, fast) == pytest.approx(fast * (max_steps - 20), abs=60), seed
    expect = (0.7 * fast + 0.3 * later) * (max_steps - 30)
    assert eta_after(30, later) == pytest.approx(expect, abs=60), seed


@pytest.mark.parametrize(("model", "warned"), [("gpt2", True), ("tiny", False)])
def test_cpu_run_of_a_gpt2_sized_model_says_how_slow(tiny, tmp_path, capsys, monkeypatch, model, warned):
    """Set-up on the CPU prints the warning (with experiment=cpu_tiny) for GPT-2 small, not for tiny."""
    from trainer import loop

    monkeypatch.setattr(loop, "train", lambda st: loop.Outcome("ok", 0))  # set-up only
    out = tmp_path / "run"
    outcome = run_inprocess(tiny(out, model=model, max_steps=1000), out)
    text = capsys.readouterr().out
    assert outcome.exit_code == 0, text
    line = next((x for x in text.splitlines() if x.startswith("warning: a ")), None)
    assert (line is not None) == warned, text
    if warned:
        assert "M-parameter model on the CPU" in line and "max_steps=1000 takes at least" in line, line
        assert "experiment=cpu_tiny" in line, line


def test_cpu_warning_on_resume_counts_the_steps_left():
    """A resume at step 300 of max_steps=1000: 700 steps of at least 1 s are left, named as such."""
    args = dict(n_params=124_000_000, flops_per_token=1e9, tokens_per_step=1000, flops_per_s=1e12)
    fresh = progress.cpu_warning(max_steps=1000, **args)
    assert "so max_steps=1000 takes at least 16m" in fresh, fresh
    resumed = progress.cpu_warning(max_steps=1000, step=300, **args)
    assert "so the 700 steps left of max_steps=1000 (resumed at step 300) take at least 11m" in resumed


def test_cpu_warning_counts_the_evaluations():
    """GPT-2's default on a CPU, max_steps=2: two evaluations of 20 x 32 x 1024 tokens outlast the two steps
    of 65,536 tokens tenfold, so the estimate holds them (it once said 18 minutes for a run of about 45)."""
    args = dict(n_params=124_000_000, flops_per_token=1e9, tokens_per_step=65_536, flops_per_s=1e11)
    evals = progress.evals_left(0, 2, 250, at_start=True)
    assert evals == 2 and progress.evals_left(0, 1000, 250, at_start=False) == 4
    assert progress.evals_left(300, 1000, 250, at_start=True) == 3  # 500, 750, 1000
    text = progress.cpu_warning(max_steps=2, evals=evals, eval_tokens=655_360, **args)
    step_s, eval_s = 1e9 * 65_536 / 1e11, 1e9 / 3 * 655_360 / 1e11  # 655 s and 2,185 s
    total = progress.format_duration(2 * step_s + 2 * eval_s)
    assert f"so max_steps=2 takes at least {total}, its 2 evaluations of 655,360 tokens included" in text
    assert f"({progress.format_duration(eval_s)} each)" in text, text


def test_step_lines_show_elapsed_and_eta(tiny, tmp_path, capsys):
    out = tmp_path / "run"
    outcome = run_inprocess(tiny(out, max_steps=4, **{"eval.interval": 0, "checkpoint.interval": 0}), out)
    text = capsys.readouterr().out
    assert outcome.exit_code == 0, text
    lines = [x for x in text.splitlines() if re.match(r"step +\d+/4 \| loss", x)]
    assert len(lines) == 4 and all(re.search(r"\| elapsed \S+ \| eta \S+$", x) for x in lines), text
    assert lines[-1].endswith("eta 0s"), lines[-1]


@pytest.mark.parametrize("peak", [None, 3e9])
def test_mfu_only_against_a_peak_the_machine_has(tiny, tmp_path, capsys, peak):
    """A CPU has no entry in the GPU peak table: no MFU unless perf.peak_flops gives one, and then it is
    tokens/sec x FLOPs per token / peak (the GPU's H100 default made CPU runs read ~0%)."""
    import json

    out = tmp_path / "run"
    extra = {"eval.interval": 0, "checkpoint.interval": 0, **({"perf.peak_flops": peak} if peak else {})}
    outcome = run_inprocess(tiny(out, max_steps=4, **extra), out)
    text = capsys.readouterr().out
    assert outcome.exit_code == 0, text
    lines = [x for x in text.splitlines() if re.match(r"step +\d+/4 \| loss", x)]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "perf/tokens_per_sec" in r]
    summary = json.loads((out / "summary.json").read_text())
    if peak is None:
        assert not any("mfu" in x for x in lines) and not any("perf/mfu" in r for r in rows), text
        assert "perf/mfu" not in summary
        return
    from omegaconf import OmegaConf

    from model.gpt import GPT
    from trainer.config import gpt_config_for

    run_cfg = OmegaConf.load(out / "config.resolved.yaml")
    flops = GPT(gpt_config_for(run_cfg, summary["vocab_size"])).flops_per_token(64)
    for r in rows:
        assert r["perf/mfu"] == pytest.approx(r["perf/tokens_per_sec"] * flops / peak, rel=1e-9)
    assert summary["perf/mfu"] == pytest.approx(summary["perf/tokens_per_sec"] * flops / peak, rel=1e-9)
    shown = float(re.search(r"mfu ([\d.]+)%", lines[-1]).group(1))
    assert shown == pytest.approx(100 * rows[-1]["perf/mfu"], abs=0.006)


def test_cpu_warning_for_a_small_model_with_a_huge_step():
    """A 0.8M-parameter model with batch.tokens_per_step=268435456 (a new user followed a micro-batch hint)
    took 12+ hours a step without a word: the step's FLOPs call the warning too, cpu_tiny's own step not."""
    flops_per_token = 6 * 810_000
    huge = progress.cpu_warning(810_000, flops_per_token, 268_435_456, max_steps=2, flops_per_s=1e11)
    assert huge is not None and "per step (268,435,456 tokens" in huge and "at least 3h" in huge, huge
    assert progress.cpu_warning(810_000, flops_per_token, 2048, max_steps=2000, flops_per_s=1e11) is None
