"""Causal-attention kernel benchmark: our FlashAttention (``flash``, and ``flash-det``: deterministic=True,
the bitwise-reproducible split backward) against naive attention, PyTorch SDPA pinned to each backend and
FlexAttention.

    python -m bench.attention                                   # full sweep, bf16, writes bench/results/
    python -m bench.attention --seqlens 1024,4096 --headdims 128 --providers flash,sdpa-flash
    python -m bench.attention --dry-run --out /tmp/b            # CPU plumbing check (Triton interpreter)

Workload: B x N = ``--tokens`` (16384) tokens, hidden ``--hidden`` (2048): B = max(1, tokens // N),
H = hidden // d; q, k, v, dO standard normal, (B, H, N, d). Per provider and shape it

1. checks O (and dQ/dK/dV for the backward modes) against a float32 reference on a few (batch, head)
   slices of the same inputs; a provider off by more than the tolerance is ``mismatch: ...``, not timed;
2. measures the peak memory of one forward+backward (CUDA only);
3. times ``fwd`` and ``fwdbwd`` (``common.Timer``: do_bench median) and derives ``bwd = fwdbwd - fwd``.

Out of memory is recorded as ``oom``, a provider that cannot run as ``error: <reason>``; the sweep goes on.
FLOPs (causal, half the dense 4*B*H*N^2*d): forward 2*B*H*N^2*d, backward 2.5x, both 3.5x (FlashAttention-2,
Dao 2023, Sec. 4.1). Writes ``attention_<tag>.json``, ``.md`` (also printed) and ``.png`` to ``--out``; JSON
and markdown after every shape (``complete: false`` until the end). ``--merge`` folds an invocation's
records into the JSON of the same tag (``--headdims 64``, then ``--headdims 128 --merge``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from bench import common
from bench.common import PROVIDERS, md_table
from kernels.reference import chunked_causal_reference

MODES = ("fwd", "bwd", "fwdbwd")
BWD = ("bwd", "fwdbwd")
GPU_PROVIDERS = ("flash", "flash-det", "naive", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex")
DRY_PROVIDERS = ("flash", "naive", "sdpa-math")
INJECT_KINDS = ("error", "oom", "wrong")
SPEEDUP_BASELINES = ("sdpa-flash", "flex", "sdpa-cudnn")  # first columns of the speedup table
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
# (abs tolerance on O, tolerance on dQ/dK/dV relative to max(1, max|reference grad|)); float32 leaves room
# for TF32 tensor-core dots on the GPU
TOLERANCES = {torch.bfloat16: (2e-2, 5e-2), torch.float16: (5e-3, 2e-2), torch.float32: (5e-3, 1e-2)}


def shape_for(tokens: int, hidden: int, n: int, d: int) -> tuple[int, int]:
    """(B, H) = (max(1, tokens // n), hidden // d); ValueError when hidden is not a multiple of d."""
    if min(tokens, hidden, n, d) <= 0:
        raise ValueError(f"tokens={tokens}, hidden={hidden}, N={n}, d={d} must all be positive")
    if hidden % d:
        raise ValueError(
            f"--hidden {hidden} is not a multiple of head dim {d}; pick a hidden size divisible by every "
            "--headdims value"
        )
    return max(1, tokens // n), hidden // d


def attention_flops(b: int, h: int, n: int, d: int, mode: str) -> float:
    """Causal attention FLOPs of `mode`: forward 2*B*H*N^2*d (half of two N x N x d matmuls per head)."""
    return 2.0 * b * h * n * n * d * FLOP_FACTOR[mode]


def check_pairs(b: int, h: int, max_all: int = 8) -> list[tuple[int, int]]:
    """(batch, head) pairs checked against the reference: all when B*H <= `max_all`, else (0, 0), (0, 1)
    and (B-1, H-1): first heads plus the last one, to catch batch/head stride bugs."""
    if b * h <= max_all:
        return [(i, j) for i in range(b) for j in range(h)]
    return list(dict.fromkeys([(0, 0), (0, min(1, h - 1)), (b - 1, h - 1)]))


def take_pairs(t: torch.Tensor, pairs: Sequence[tuple[int, int]]) -> torch.Tensor:
    """t[b, h] stacked for the pairs -> (len(pairs), N, d)."""
    return t.detach()[[p[0] for p in pairs], [p[1] for p in pairs]]


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in float32; inf when anything is not finite (so the check fails)."""
    diff = (a.float() - b.float()).abs()
    return float(diff.max()) if torch.isfinite(diff).all() else float("inf")


def inject_failure(fn: Callable, kind: str) -> Callable:
    """A provider that fails on purpose (testing the bookkeeping): "error" raises RuntimeError, "oom"
    torch.cuda.OutOfMemoryError, "wrong" returns O + 0.5."""
    if kind not in INJECT_KINDS:
        raise ValueError(f"unknown failure kind {kind!r}; valid: {', '.join(INJECT_KINDS)}")

    def failing(q, k, v):
        if kind == "error":
            raise RuntimeError("injected failure (--inject-failure)")
        if kind == "oom":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected by --inject-failure)")
        return fn(q, k, v) + 0.5

    return failing


@dataclass
class ShapeInputs:
    """Inputs of one (N, d) shape and the float32 reference on the checked (batch, head) pairs."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    pairs: list[tuple[int, int]]
    ref_o: torch.Tensor
    ref_grads: tuple | None


def make_inputs(b, h, n, d, *, device, dtype, seed: int, need_grads: bool, softcap=None) -> ShapeInputs:
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v, do = (torch.randn(b, h, n, d, device=device, dtype=dtype, generator=gen) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    pairs = check_pairs(b, h)
    picked = [take_pairs(t, pairs) for t in (q, k, v, do)]
    chunk = max(1, min(1024, (1 << 26) // max(1, len(pairs) * n)))  # float32 scores of 256 MiB at most
    grad_out = picked[3] if need_grads else None
    ref_o, ref_grads = chunked_causal_reference(*picked[:3], grad_out, chunk=chunk, softcap=softcap)
    return ShapeInputs(q, k, v, do, pairs, ref_o, ref_grads)


def peak_memory(fn: Callable) -> tuple[float, float]:
    """(peak GiB, GiB above what was allocated before) of one call of fn on CUDA."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    top = torch.cuda.max_memory_allocated()
    return top / 2**30, (top - base) / 2**30


def bench_provider(
    name: str, factory: Callable[[], Callable], inp: ShapeInputs, *, modes, timer, tol
) -> list[dict]:
    """Check, measure memory of and time one provider on one shape; one record per mode, never raises for a
    provider's failure. Status: ok, oom, error: ..., mismatch: ...; peak memory CUDA only."""
    q, k, v, do = inp.q, inp.k, inp.v, inp.do
    b, h, n, d = q.shape
    tol_o, tol_g = tol
    need_bwd = any(m != "fwd" for m in modes)
    status, ms, errors, peak, fn = dict.fromkeys(MODES, "ok"), dict.fromkeys(MODES), {}, (None, None), None

    def fail(which: Sequence[str], value: str) -> None:  # the first failure of a mode is its status
        status.update({m: value for m in which if status[m] == "ok"})

    def attempt(which: Sequence[str], step: Callable):
        """step() with a failure recorded on the modes `which`; gradients and cached memory freed after."""
        try:
            return step()
        except Exception as exc:
            fail(which, common.failure(exc))
        finally:
            for t in (q, k, v):
                t.grad = None
            common.free_memory(q.device)

    def check_backward(o) -> None:
        o.backward(do)
        for gname, t, ref in zip(("dq", "dk", "dv"), (q, k, v), inp.ref_grads, strict=True):
            if t.grad is None:
                raise RuntimeError(f"backward produced no gradient for {gname[1]}")
            errors[gname] = max_abs_diff(take_pairs(t.grad, inp.pairs), ref)
            if not errors[gname] <= (limit := tol_g * max(1.0, float(ref.abs().max()))):
                fail(BWD, f"mismatch: max|{gname} - ref| = {errors[gname]:.3g} > {limit:.3g}")

    def check() -> None:  # the forward against the reference, then the backward (whose failure leaves fwd)
        nonlocal fn
        fn = factory()
        o = fn(q, k, v)
        if o.shape != q.shape:
            raise RuntimeError(f"output shape {tuple(o.shape)} != q shape {tuple(q.shape)}")
        errors["o"] = max_abs_diff(take_pairs(o, inp.pairs), inp.ref_o)
        if not errors["o"] <= tol_o:
            fail(MODES, f"mismatch: max|O - ref| = {errors['o']:.3g} > {tol_o:g}")
        elif need_bwd:
            attempt(BWD, lambda: check_backward(o))

    attempt(MODES, check)
    bwd_ok = need_bwd and status["fwdbwd"] == "ok"
    fwd, fwdbwd = (lambda: fn(q, k, v)), (lambda: fn(q, k, v).backward(do))
    if q.is_cuda and status["fwd"] == "ok":  # peak memory of one forward(+backward)
        peak = attempt(MODES, lambda: peak_memory(fwdbwd if bwd_ok else fwd)) or peak
    if status["fwd"] == "ok":
        ms["fwd"] = attempt(MODES, lambda: timer(fwd))
    if bwd_ok and status["fwdbwd"] == "ok":
        ms["fwdbwd"] = attempt(BWD, lambda: timer(fwdbwd, grad_to_none=(q, k, v)))
    if ms["fwd"] is not None and ms["fwdbwd"] is not None:
        ms["bwd"] = ms["fwdbwd"] - ms["fwd"]
    records = []
    for m in modes:
        t = ms[m] if status[m] == "ok" else None
        errs = [e for x, e in errors.items() if m != "fwd" or x == "o"]
        rec = dict(provider=name, N=n, d=d, B=b, H=h, mode=m, ms_median=t)
        rec["tflops"] = attention_flops(b, h, n, d, m) / (t * 1e9) if t and t > 0 else None
        rec |= dict(peak_gib=peak[0], peak_extra_gib=peak[1], peak_of=peak[0] and ("fwd", "fwdbwd")[bwd_ok])
        rec |= dict(status=status[m], max_abs_err=max(errs) if errs else None, errors=dict(errors))
        records.append(rec | dict(tolerance={"o_abs": tol_o, "grad_rel": tol_g}))
    return records


def run_benchmark(run: dict, device, dtype, timer, tol, inject: dict, on_shape_done: Callable) -> list[dict]:
    """Every (d, N, provider) of `run` (seqlens, headdims, providers, modes, tokens, hidden, seed): inputs and
    reference built once per shape; an allocation that fails marks every provider of the shape.
    `on_shape_done(records)` after each shape (partial results are saved)."""
    modes, records, softcap = run["modes"], [], run.get("softcap")
    kw = dict(device=device, dtype=dtype, need_grads=any(m != "fwd" for m in modes))
    for d, n in itertools.product(run["headdims"], run["seqlens"]):
        b, h = shape_for(run["tokens"], run["hidden"], n, d)
        print(f"[bench] N={n} d={d} B={b} H={h}")
        try:
            inp = make_inputs(b, h, n, d, seed=run["seed"] + 7919 * n + d, softcap=softcap, **kw)
        except Exception as exc:
            none = dict.fromkeys(("ms_median", "tflops", "peak_gib", "peak_extra_gib", "max_abs_err"))
            shape = dict(N=n, d=d, B=b, H=h, status=common.failure(exc), **none)
            records += [dict(provider=p, mode=m, **shape) for p in run["providers"] for m in modes]
        else:
            for p in run["providers"]:

                def factory(p=p, n=n):
                    fn = common.build_provider(p, n=n, device=device, softcap=softcap)
                    return inject_failure(fn, inject[p]) if p in inject else fn

                recs = bench_provider(p, factory, inp, modes=modes, timer=timer, tol=tol)
                for r in recs:
                    t = f"{r['tflops']:.2f} TFLOP/s" if r["tflops"] is not None else "-"
                    print(f"  {p:15s} {r['mode']:7s} {t:>18s}  {r['status'][:90]}")
                records += recs
            del inp
        common.free_memory(device)
        on_shape_done(records)
    return records


def gluon_routes() -> dict:
    """Which forward and backward `flash` runs on sm_90 at long N: the Gluon kernels' shortest N per d and
    their environment switches (kernels/plan.py)."""
    from kernels.plan import MIN_N, MIN_N_BWD

    return dict(
        flash_gluon_fwd=os.environ.get("FLASHGPT_GLUON_FWD", "auto"),
        flash_gluon_min_n={str(d): n for d, n in MIN_N.items()},
        flash_gluon_bwd=os.environ.get("FLASHGPT_GLUON_BWD", "auto"),
        flash_gluon_min_n_bwd={str(d): n for d, n in MIN_N_BWD.items()},
    )


# ------------------------------------------------------------------------------ markdown and figure


def _fmt(x: float | None, spec: str | None = None) -> str:
    return "—" if x is None else format(x, spec or (".1f" if abs(x) >= 10 else ".3g"))


def short_status(status: str) -> str:
    return {"oom": "OOM", "mismatch": "FAIL", "error": "ERR"}.get(status.split(":")[0], status)


def _table_modes(records) -> list[str]:
    modes = list(dict.fromkeys(r["mode"] for r in records))
    return [m for m in ("fwd", "bwd") if m in modes] or modes


def markdown(meta: dict, records: Sequence[dict]) -> str:
    """Per head dim: TFLOP/s (rows N, columns providers, cells 'fwd / bwd'), speedup of flash over the
    baselines, peak memory, max abs errors; then the failures."""
    idx = {(r["provider"], r["N"], r["d"], r["mode"]): r for r in records}
    providers = list(dict.fromkeys(r["provider"] for r in records))
    ns, tmodes = sorted({r["N"] for r in records}), _table_modes(records)
    m = meta.get
    lines = [
        f"# Causal attention benchmark — {m('gpu') or m('device')} ({m('dtype')})"
        + (f", soft-capped scores c·tanh(s/c), c = {m('softcap')}" if meta.get("softcap") else ""),
        "",
        f"- date {m('date')}, commit {m('commit')}, torch {m('torch')}, triton {m('triton')}, "
        f"CUDA {m('cuda')}",
        f"- {m('tokens')} tokens per batch (B = tokens // N), hidden {m('hidden')} (H = hidden // d); "
        f"timing: {m('timing')}",
        f"- FLOPs: {m('flops')}",
    ]
    if m("flash_gluon_min_n"):
        lines += [
            f"- flash's forward on sm_90: the Gluon kernel from N = {m('flash_gluon_min_n')} (per d; "
            f"FLASHGPT_GLUON_FWD={m('flash_gluon_fwd')}), the Triton kernel otherwise",
            "- flash's backward on sm_90: the one-pass Gluon kernel from N = "
            f"{m('flash_gluon_min_n_bwd')} (MHA, N % 128 == 0; FLASHGPT_GLUON_BWD={m('flash_gluon_bwd')}), "
            "the split Triton kernels otherwise",
        ]
    lines.append(
        "- cells: OOM = out of memory, ERR = cannot run, FAIL = wrong result vs float32 reference (not "
        "timed), — = not measured"
    )
    for i in m("invocations") or ():
        lines.append(
            f"- merged (`--merge`): N = {i.get('seqlens')}, d = {i.get('headdims')}, providers "
            f"{i.get('providers')}, modes {i.get('modes') or list(MODES)} measured {i.get('date')} (torch "
            f"{i.get('torch')}, triton {i.get('triton')})"
        )
    if m("complete") is False:
        lines.append("- **incomplete**: the last invocation stopped before measuring every shape it lists")
    if m("dry_run"):
        lines.append("- **dry run** (CPU plumbing check): numbers are meaningless")
    mode_txt = " / ".join(tmodes)

    def cell(r) -> str:
        return "—" if r is None else _fmt(r["tflops"]) if r["status"] == "ok" else short_status(r["status"])

    def ratio(a, r) -> str:
        if a and r and a["tflops"] and r["tflops"]:
            return f"{a['tflops'] / r['tflops']:.2f}×"
        return short_status(r["status"]) if r is not None and r["status"] != "ok" else "—"

    def memory(r) -> str:
        if r is None or r.get("peak_gib") is None:
            return "—" if r is None or r["status"] == "ok" else short_status(r["status"])
        return f"{r['peak_gib']:.2f} / {r['peak_extra_gib']:.2f}"

    def errors(r) -> str:
        errs = (r or {}).get("errors") or {}
        grads = [errs[x] for x in ("dq", "dk", "dv") if x in errs]
        return f"{_fmt(errs.get('o'), '.2e')} / {_fmt(max(grads) if grads else None, '.2e')}"

    def section(d: int) -> list[str]:
        at = lambda p, n: [idx.get((p, n, d, mode)) for mode in tmodes]  # the table modes' records
        first = lambda p, n: next((idx[k] for m in MODES if (k := (p, n, d, m)) in idx), None)
        per_n = lambda cell, cols: [[n, *(cell(c, n) for c in cols)] for n in ns]
        bh = {r["N"]: f"{r['B']}×{r['H']}" for r in records if r["d"] == d}
        rows = per_n(lambda p, n: " / ".join(map(cell, at(p, n))), providers)
        out = ["", f"## d = {d}: TFLOP/s ({mode_txt})", ""]
        out += md_table(["N", "B×H", *providers], [[n, bh.get(n, "—"), *rest] for n, *rest in rows])
        bases = [p for p in SPEEDUP_BASELINES if p in providers]
        bases += [p for p in providers if p not in bases and p != "flash"]
        if "flash" in providers and bases:
            speedup = lambda b, n: " / ".join(map(ratio, at("flash", n), at(b, n)))
            out += ["", f"### d = {d}: speedup of flash (TFLOP/s ratio, {mode_txt})", ""]
            out += md_table(["N", *(f"vs {p}" for p in bases)], per_n(speedup, bases))
        if not any(r.get("peak_gib") is not None for r in records):
            out += ["", f"### d = {d}: peak memory not measured (needs CUDA)"]
        else:
            out += ["", f"### d = {d}: peak memory of one forward+backward, GiB (total / above inputs)", ""]
            out += md_table(["N", *providers], per_n(lambda p, n: memory(first(p, n)), providers))
        out += ["", f"### d = {d}: max abs error vs float32 reference (O / grads)", ""]
        return out + md_table(["N", *providers], per_n(lambda p, n: errors(first(p, n)), providers))

    for d in sorted({r["d"] for r in records}):
        lines += section(d)
    notes: dict = {}
    for r in records:
        if r["status"] != "ok":
            notes.setdefault((r["provider"], r["d"], r["status"]), []).append((r["N"], r["mode"]))
    if notes:
        lines += ["", "## Failures", ""]
        for (p, d, st), where in notes.items():
            n_txt = ",".join(str(x) for x in sorted({w[0] for w in where}))
            lines.append(f"- {p} d={d} N={n_txt} ({','.join(dict.fromkeys(w[1] for w in where))}): {st}")
    return "\n".join(lines) + "\n"


def plot(records: Sequence[dict], path: str | Path, title: str = "") -> Path:
    """Rows = head dims; columns = TFLOP/s vs N per table mode, then peak memory (when measured); one line
    per provider, failures marked at the top of the panel."""
    idx = {(r["provider"], r["N"], r["d"], r["mode"]): r for r in records}
    providers = list(dict.fromkeys(r["provider"] for r in records))
    ds, ns = sorted({r["d"] for r in records}) or [0], sorted({r["N"] for r in records})
    modes = _table_modes(records)
    panels = modes + (["mem"] if any(r.get("peak_gib") is not None for r in records) else [])
    fig, axes = common.subplots(len(ds), len(panels))
    for i, d in enumerate(ds):
        for j, m in enumerate(panels):
            ax, failures = axes[i][j], []
            for c, p in enumerate(providers):
                rs = [r for n in ns if (r := idx.get((p, n, d, modes[0] if m == "mem" else m)))]
                pts = [(r, r.get("peak_gib") if m == "mem" else r["tflops"]) for r in rs]
                ok = [(r["N"], y) for r, y in pts if r["status"] == "ok" and y is not None]
                if ok:
                    ax.plot(*zip(*ok, strict=True), marker="o", ms=3, label=p, color=f"C{c % 10}")
                if bad := [r for r in rs if r["status"] != "ok"]:
                    kinds = "/".join(dict.fromkeys(short_status(r["status"]) for r in bad))
                    failures.append(([r["N"] for r in bad], f"{p} {kinds}", f"C{c % 10}"))
            if m == "mem":  # quadratic (naive) vs linear memory: a log scale keeps both readable
                ax.set_ylabel("peak GiB (fwd+bwd)")
                if ax.lines:
                    ax.set_yscale("log", base=2)
            else:
                ax.set_ylabel("TFLOP/s")
                ax.set_ylim(bottom=0)
            ax.set_xlabel("sequence length N")
            ax.set_title(f"d={d} {'peak memory' if m == 'mem' else m}")
            common.finish_axes(ax, ns, failures)
    return common.save_figure(fig, path, title)


# ---------------------------------------------------------------------------------------- --merge

INVOCATION_KEYS = ("date", "seqlens", "headdims", "providers", "modes", "torch", "triton", "gpu")
MERGE_MUST_MATCH = ("device", "gpu", "dtype", "tokens", "hidden", "dry_run", "softcap", "timing")  # header
# the types of what merging reads: a record's keys, the lists of the metadata and of each invocation
RECORD_TYPES = dict(provider=str, mode=str, N=int, d=int)
LIST_TYPES = dict(seqlens=int, headdims=int, providers=str, modes=str)


def _typed(x, t: type) -> bool:
    return isinstance(x, t) and not isinstance(x, bool)


def merge_records(old: Sequence[dict], new: Sequence[dict]) -> list[dict]:
    """`old` with the records of the same (provider, N, d, mode) replaced by `new` ones, then the other new
    ones (a sweep split over several invocations of one tag)."""
    key = lambda r: (r["provider"], r["N"], r["d"], r["mode"])
    fresh = {key(r): r for r in new}
    merged = [fresh.pop(key(r), r) for r in old]
    return merged + [r for r in new if key(r) in fresh]


def read_for_merge(path: Path) -> tuple[list[dict], dict]:
    """(records, metadata) of an attention results JSON, checked to have the shape bench.attention writes.
    ValueError naming what is wrong; OSError when unreadable."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("records"), list):
        raise ValueError('expected an object with a "records" list')
    if not isinstance(meta := data.get("metadata", {}), dict):
        raise ValueError('"metadata" must be an object')
    for r in data["records"]:
        if not (isinstance(r, dict) and all(_typed(r.get(key), t) for key, t in RECORD_TYPES.items())):
            raise ValueError(f"a record needs provider, mode (strings), N, d (integers): {str(r)[:80]}")
    invocations = meta.get("invocations", [])
    if not isinstance(invocations, list) or not all(isinstance(i, dict) for i in invocations):
        raise ValueError('"metadata.invocations" must be a list of objects')
    for i in (meta, *invocations):
        for key, t in LIST_TYPES.items():
            if key in i and not (isinstance(i[key], list) and all(_typed(x, t) for x in i[key])):
                raise ValueError(f'metadata "{key}" must be a list of {t.__name__}')
    return data["records"], meta


def merge_clash(previous_meta: dict, meta: dict) -> str | None:
    """The table-wide settings that differ between an existing file and this invocation, or None."""
    diffs = [k for k in MERGE_MUST_MATCH if k in previous_meta and previous_meta[k] != meta.get(k)]
    return ", ".join(f"{k}={previous_meta[k]!r} (now {meta.get(k)!r})" for k in diffs) or None


def merged_invocations(previous_meta: dict, meta: dict) -> list[dict]:
    """The invocations a merged file holds rows of, oldest first: the earlier ones (or `previous_meta`
    itself), less those whose every (N, d, provider, mode) this one measured again, then this one."""

    def cells(m: dict) -> set:
        lists = [m.get(k) or () for k in ("seqlens", "headdims", "providers")]
        return set(itertools.product(*lists, m.get("modes") or MODES))

    earlier = previous_meta.get("invocations") or ([previous_meta] if previous_meta else [])
    kept = [m for m in earlier if not (cells(m) and cells(m) <= cells(meta))]
    return [{k: m.get(k) for k in INVOCATION_KEYS} for m in (*kept, meta)]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.attention", description=__doc__.split("\n\n")[0])
    add = p.add_argument
    ints = common.ints()
    add("--seqlens", type=ints, help="comma list of N (default 512 .. 32768; dry run 16,32)")
    add("--headdims", type=ints, help="comma list of d (default 64,128; dry run 16)")
    add("--providers", type=common.choices(PROVIDERS), help=f"from {','.join(PROVIDERS)}")
    add("--modes", type=common.choices(MODES), default=list(MODES), help="default fwd,bwd,fwdbwd")
    add("--dtype", choices=sorted(common.DTYPES), help="default bfloat16 (dry run float32)")
    add("--tokens", type=int, help="B*N tokens per shape (default 16384; dry run 64)")
    add("--hidden", type=int, help="H*d (default 2048; dry run 64)")
    add("--out", help="output directory (default bench/results; on a CPU outputs/bench)")
    add("--tag", help="file tag (default h200 / GPU-name slug / cpu)")
    add("--dry-run", action="store_true", help="tiny CPU run of the plumbing (Triton interpreter)")
    add("--device", help="cuda or cpu (default cuda when available)")
    add("--seed", type=int, default=0)
    add("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    add("--rep", type=int, default=100, help="do_bench repetition time, ms")
    add("--cuda-graph", action="store_true", help="time CUDA-graph replays: the kernels without host time")
    add("--cpu-reps", type=int, default=3, help="timed repetitions on a CPU")
    add("--atol-o", type=float, help="abs tolerance on O (default bf16 2e-2, fp16 5e-3, fp32 5e-3)")
    add("--rtol-grad", type=float, help="grad tolerance relative to max(1, max|ref|) (5e-2, 2e-2, 1e-2)")
    add("--merge", action="store_true", help="merge into attention_<tag>.json (same cells replaced)")
    softcap = "logit soft-capping c: scores c*tanh(s/c) in the reference and in flash, naive, flex (not sdpa)"
    add("--softcap", type=float, help=softcap)
    add("--inject-failure", action="append", default=[], help=argparse.SUPPRESS)  # PROVIDER[:kind]
    a = p.parse_args(argv)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() and not a.dry_run else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA device; use --dry-run (CPU) or a CUDA machine")
    small = device.type != "cuda"  # CPU: tiny dry-run shapes unless given
    if small and not a.dry_run:
        common.log("[bench] no CUDA device: running the CPU dry-run configuration")
    if small:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before kernels/ is imported
    a.out = a.out or ("outputs/bench" if small else "bench/results")
    a.seqlens = a.seqlens or ([16, 32] if small else [512, 1024, 2048, 4096, 8192, 16384, 32768])
    a.headdims = a.headdims or ([16] if small else [64, 128])
    a.providers = a.providers or list(DRY_PROVIDERS if small else GPU_PROVIDERS)
    dtype = common.DTYPES[a.dtype or ("float32" if small else "bfloat16")]
    a.tokens, a.hidden = a.tokens or (64 if small else 16384), a.hidden or (64 if small else 2048)
    if a.softcap is not None and not a.softcap > 0:
        p.error(f"--softcap must be a positive number, e.g. --softcap 30; got {a.softcap:g}")
    if a.softcap and (sdpa := [q for q in a.providers if q.startswith("sdpa-")]):
        p.error(f"--softcap: {','.join(sdpa)} cannot soft-cap (SDPA has no score modifier); drop them")
    suffix = f"_softcap{a.softcap:g}" if a.softcap else ""  # its own file: not mixed with plain rows
    a.modes, a.tag = [m for m in MODES if m in a.modes], (a.tag or common.default_tag(device)) + suffix
    inject = {}
    for spec in a.inject_failure:
        prov, _, kind = spec.partition(":")
        if prov not in PROVIDERS or (kind or "error") not in INJECT_KINDS:
            p.error(f"--inject-failure {spec!r}: expected PROVIDER[:{'|'.join(INJECT_KINDS)}]")
        inject[prov] = kind or "error"
    for d in a.headdims:
        try:
            shape_for(a.tokens, a.hidden, a.seqlens[0], d)
        except ValueError as exc:
            p.error(str(exc))
    timer = common.Timer(device, a.warmup, a.rep, a.cpu_reps, cuda_graph=a.cuda_graph)
    tol = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    tol = (tol[0] if a.atol_o is None else a.atol_o, tol[1] if a.rtol_grad is None else a.rtol_grad)
    path, previous, previous_meta = Path(a.out) / f"attention_{a.tag}.json", [], {}
    if a.merge and path.is_file():
        try:
            previous, previous_meta = read_for_merge(path)
        except (OSError, ValueError) as exc:
            fix = "fix or move it, or run without --merge"
            return common.error(f"--merge: cannot read {path} ({exc}); {fix}")
    from kernels import interpret_enabled

    meta = dict(benchmark="bench.attention", device=device.type, **common.environment(device), dry_run=small)
    meta |= dict(cudnn=torch.backends.cudnn.version(), dtype=str(dtype)[6:])
    keys = ("tag", "tokens", "hidden", "seqlens", "headdims", "providers", "modes", "seed", "softcap")
    meta |= {k: getattr(a, k) for k in keys} | dict(triton_interpret=interpret_enabled())
    meta |= gluon_routes() | dict(timing=timer.describe(), tolerance={"o_abs": tol[0], "grad_rel": tol[1]})
    meta["flops"] = "fwd = 2*B*H*N^2*d (causal half of 4*B*H*N^2*d); bwd = 2.5*fwd; fwdbwd = 3.5*fwd"
    meta["check"] = "O and dQ/dK/dV vs the float32 reference on (batch, head) pairs from check_pairs(B, H)"
    meta["naive_impl"] = "model.attention.attention(backend='naive')" if "naive" in a.providers else None
    meta |= dict(injected_failures=inject or None, merged_with_previous=bool(previous), complete=False)
    if previous and (clash := merge_clash(previous_meta, meta)):
        return common.error(
            f"--merge: {path} was measured with {clash}; one table must hold comparable rows: use another "
            "--tag (or the same settings)"
        )
    if previous:
        meta["invocations"] = merged_invocations(previous_meta, meta)
    results = common.Results(path, meta, markdown, meta_key="metadata", records=[])

    def save(records: list[dict], complete: bool = False) -> str:
        results.lists["records"] = merge_records(previous, records)
        return results.save(complete)

    print(save(run_benchmark(meta, device, dtype, timer, tol, inject, on_shape_done=save), complete=True))
    title = f"causal attention, {meta['gpu'] or meta['device']}, {meta['dtype']}"
    png = plot(results.lists["records"], path.with_suffix(".png"), title)
    print(f"wrote {path}, {path.with_suffix('.md')}, {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
