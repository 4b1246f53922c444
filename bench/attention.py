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
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from bench import common
from bench.common import MODES, Timer, classify_exception, free_memory, max_abs_diff, take_pairs

GPU_PROVIDERS = ("flash", "flash-det", "naive", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex")
DRY_PROVIDERS = ("flash", "naive", "sdpa-math")
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


def make_inputs(b, h, n, d, *, device, dtype, seed: int, need_grads: bool) -> ShapeInputs:
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v, do = (torch.randn(b, h, n, d, device=device, dtype=dtype, generator=gen) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    pairs = common.check_pairs(b, h)
    ref_o, ref_grads = common.reference_attention(
        *(take_pairs(t, pairs) for t in (q, k, v)),
        take_pairs(do, pairs) if need_grads else None,
        chunk=max(1, min(1024, (1 << 26) // max(1, len(pairs) * n))),
    )
    return ShapeInputs(q, k, v, do, pairs, ref_o, ref_grads)


def bench_provider(
    name: str, factory: Callable[[], Callable], inp: ShapeInputs, *, modes, timer, tol
) -> list[dict]:
    """Check, measure memory of and time one provider on one shape; one record per mode, never raises for a
    provider's failure. Status: ok, oom, error: ..., mismatch: ...; peak memory CUDA only."""
    q, k, v, do = inp.q, inp.k, inp.v, inp.do
    b, h, n, d = q.shape
    device, tol_o, tol_g = q.device, *tol
    need_bwd = any(m in ("bwd", "fwdbwd") for m in modes)
    status, ms, errors = dict.fromkeys(MODES, "ok"), dict.fromkeys(MODES), {}
    peak = extra = peak_of = None

    def fail(which: Sequence[str], value: str) -> None:
        for m in which:
            if status[m] == "ok":
                status[m] = value

    def clean() -> None:
        for t in (q, k, v):
            t.grad = None
        free_memory(device)

    fn = None
    try:
        fn = factory()
        o = fn(q, k, v)
        if o.shape != q.shape:
            raise RuntimeError(f"output shape {tuple(o.shape)} != q shape {tuple(q.shape)}")
        errors["o"] = max_abs_diff(take_pairs(o, inp.pairs), inp.ref_o)
        if not errors["o"] <= tol_o:
            fail(MODES, f"mismatch: max|O - ref| = {errors['o']:.3g} > {tol_o:g}")
        if need_bwd and status["fwd"] == "ok":
            try:
                o.backward(do)
                for gname, t, ref in zip(("dq", "dk", "dv"), (q, k, v), inp.ref_grads, strict=True):
                    if t.grad is None:
                        raise RuntimeError(f"backward produced no gradient for {gname[1]}")
                    errors[gname] = max_abs_diff(take_pairs(t.grad, inp.pairs), ref)
                    limit = tol_g * max(1.0, float(ref.abs().max()))
                    if not errors[gname] <= limit:
                        fail(
                            ("bwd", "fwdbwd"),
                            f"mismatch: max|{gname} - ref| = {errors[gname]:.3g} > {limit:.3g}",
                        )
            except Exception as exc:  # backward unsupported / OOM: the forward's results still count
                fail(("bwd", "fwdbwd"), classify_exception(exc))
        del o
        clean()
        bwd_ok = need_bwd and status["fwdbwd"] == "ok"
        fwd = lambda: fn(q, k, v)
        fwdbwd = lambda: fn(q, k, v).backward(do)
        if device.type == "cuda" and status["fwd"] == "ok":  # peak memory of one forward(+backward)
            try:
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                (fwdbwd if bwd_ok else fwd)()
                torch.cuda.synchronize()
                top = torch.cuda.max_memory_allocated()
                peak, extra, peak_of = top / 2**30, (top - base) / 2**30, "fwdbwd" if bwd_ok else "fwd"
            except Exception as exc:
                fail(MODES, classify_exception(exc))
            clean()
        if status["fwd"] == "ok":
            try:
                ms["fwd"] = timer(fwd)
            except Exception as exc:
                fail(MODES, classify_exception(exc))
            clean()
        if bwd_ok and status["fwdbwd"] == "ok":
            try:
                ms["fwdbwd"] = timer(fwdbwd, grad_to_none=(q, k, v))
            except Exception as exc:
                fail(("bwd", "fwdbwd"), classify_exception(exc))
            clean()
        if ms["fwd"] is not None and ms["fwdbwd"] is not None:
            ms["bwd"] = ms["fwdbwd"] - ms["fwd"]
    except Exception as exc:  # the provider cannot be built or its forward fails
        fail(MODES, classify_exception(exc))
    finally:
        fn = None
        clean()
    records = []
    for m in modes:
        ok = status[m] == "ok"
        errs = [errors[x] for x in (("o",) if m == "fwd" else ("o", "dq", "dk", "dv")) if x in errors]
        t = ms[m] if ok else None
        records.append(
            dict(provider=name, N=n, d=d, B=b, H=h, mode=m, ms_median=t)
            | dict(tflops=attention_flops(b, h, n, d, m) / (t * 1e9) if t and t > 0 else None)
            | dict(peak_gib=peak, peak_extra_gib=extra, peak_of=peak_of, status=status[m])
            | dict(max_abs_err=max(errs) if errs else None, errors=dict(errors))
            | dict(tolerance={"o_abs": tol_o, "grad_rel": tol_g})
        )
    return records


def run_benchmark(
    run: dict, device, dtype, timer, tol, inject=None, log=print, on_shape_done=None
) -> list[dict]:
    """Every (d, N, provider) of `run` (seqlens, headdims, providers, modes, tokens, hidden, seed): inputs and
    reference built once per shape; an allocation that fails marks every provider of the shape.
    `on_shape_done(records)` after each shape (partial results are saved)."""
    inject, modes, records = inject or {}, run["modes"], []
    for d, n in ((d, n) for d in run["headdims"] for n in run["seqlens"]):
        b, h = shape_for(run["tokens"], run["hidden"], n, d)
        log(f"[bench] N={n} d={d} B={b} H={h}")
        try:
            seed, need_grads = run["seed"] + 7919 * n + d, any(m != "fwd" for m in modes)
            inp = make_inputs(b, h, n, d, device=device, dtype=dtype, seed=seed, need_grads=need_grads)
        except Exception as exc:
            none = dict(ms_median=None, tflops=None, peak_gib=None, peak_extra_gib=None, max_abs_err=None)
            st = classify_exception(exc)
            records += [
                dict(provider=p, N=n, d=d, B=b, H=h, mode=m, status=st, **none)
                for p in run["providers"]
                for m in modes
            ]
        else:
            for p in run["providers"]:

                def factory(p=p, n=n):
                    fn = common.build_provider(p, n=n, device=device)
                    return common.inject_failure(fn, inject[p]) if p in inject else fn

                recs = bench_provider(p, factory, inp, modes=modes, timer=timer, tol=tol)
                for r in recs:
                    t = f"{r['tflops']:.2f} TFLOP/s" if r["tflops"] is not None else "-"
                    log(f"  {p:15s} {r['mode']:7s} {t:>18s}  {r['status'][:90]}")
                records += recs
            del inp
        free_memory(device)
        if on_shape_done:
            on_shape_done(records)
    return records


def gluon_routes() -> dict:
    """Which forward and backward `flash` runs on sm_90 at long N: the Gluon kernels' shortest N per d and
    their environment switches (kernels/plan.py); {} where that module is not there."""
    try:
        from kernels.plan import MIN_N, MIN_N_BWD
    except ImportError:
        return {}
    return dict(
        flash_gluon_fwd=os.environ.get("FLASHGPT_GLUON_FWD", "auto"),
        flash_gluon_min_n={str(d): n for d, n in MIN_N.items()},
        flash_gluon_bwd=os.environ.get("FLASHGPT_GLUON_BWD", "auto"),
        flash_gluon_min_n_bwd={str(d): n for d, n in MIN_N_BWD.items()},
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.attention", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--seqlens", type=common.ints(), help="comma list of N (default 512 .. 32768; dry run 16,32)"
    )
    p.add_argument("--headdims", type=common.ints(), help="comma list of d (default 64,128; dry run 16)")
    p.add_argument(
        "--providers", type=common.choices(common.PROVIDERS), help=f"from {','.join(common.PROVIDERS)}"
    )
    p.add_argument("--modes", type=common.choices(MODES), default=list(MODES), help="default fwd,bwd,fwdbwd")
    p.add_argument("--dtype", choices=sorted(common.DTYPES), help="default bfloat16 (dry run float32)")
    p.add_argument("--tokens", type=int, help="B*N tokens per shape (default 16384; dry run 64)")
    p.add_argument("--hidden", type=int, help="H*d (default 2048; dry run 64)")
    p.add_argument("--out", help="output directory (default bench/results; on a CPU outputs/bench)")
    p.add_argument("--tag", help="file tag (default h200 / GPU-name slug / cpu)")
    p.add_argument("--dry-run", action="store_true", help="tiny CPU run of the plumbing (Triton interpreter)")
    p.add_argument("--device", help="cuda or cpu (default cuda when available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    p.add_argument("--cpu-reps", type=int, default=3, help="timed repetitions on a CPU")
    p.add_argument(
        "--atol-o", type=float, help="abs tolerance on O (default bf16 2e-2, fp16 5e-3, fp32 5e-3)"
    )
    p.add_argument(
        "--rtol-grad", type=float, help="grad tolerance relative to max(1, max|ref|) (5e-2, 2e-2, 1e-2)"
    )
    p.add_argument(
        "--merge", action="store_true", help="merge into attention_<tag>.json (same cells replaced)"
    )
    p.add_argument("--inject-failure", action="append", default=[], help=argparse.SUPPRESS)  # PROVIDER[:kind]
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() and not a.dry_run else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA device; use --dry-run (CPU) or a CUDA machine")
    small = device.type != "cuda"  # CPU: tiny dry-run shapes unless given
    if small and not a.dry_run:
        print("[bench] no CUDA device: running the CPU dry-run configuration", file=sys.stderr)
    if small:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before kernels/ is imported
    a.out = a.out or ("outputs/bench" if small else "bench/results")
    a.seqlens = a.seqlens or ([16, 32] if small else [512, 1024, 2048, 4096, 8192, 16384, 32768])
    a.headdims = a.headdims or ([16] if small else [64, 128])
    a.providers = a.providers or list(DRY_PROVIDERS if small else GPU_PROVIDERS)
    dtype = common.DTYPES[a.dtype or ("float32" if small else "bfloat16")]
    a.tokens, a.hidden = a.tokens or (64 if small else 16384), a.hidden or (64 if small else 2048)
    a.modes, a.tag = [m for m in MODES if m in a.modes], a.tag or common.default_tag(device)
    inject = {}
    for spec in a.inject_failure:
        prov, _, kind = spec.partition(":")
        if prov not in common.PROVIDERS or (kind or "error") not in common.INJECT_KINDS:
            p.error(f"--inject-failure {spec!r}: expected PROVIDER[:{'|'.join(common.INJECT_KINDS)}]")
        inject[prov] = kind or "error"
    for d in a.headdims:
        try:
            shape_for(a.tokens, a.hidden, a.seqlens[0], d)
        except ValueError as exc:
            p.error(str(exc))
    timer = Timer(device, warmup_ms=a.warmup, rep_ms=a.rep, cpu_reps=a.cpu_reps)
    tol = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    tol = (tol[0] if a.atol_o is None else a.atol_o, tol[1] if a.rtol_grad is None else a.rtol_grad)
    path, previous, previous_meta = f"{a.out}/attention_{a.tag}.json", [], {}
    if a.merge and os.path.isfile(path):
        try:
            previous, previous_meta = common.read_for_merge(path)
        except (OSError, ValueError) as exc:
            print(
                f"error: --merge: cannot read {path} ({exc}); fix or move it, or run without --merge",
                file=sys.stderr,
            )
            return 2
    from kernels import interpret_enabled

    meta = dict(benchmark="bench.attention", device=device.type, **common.environment(device), dry_run=small)
    meta |= dict(
        cudnn=torch.backends.cudnn.version(), dtype=str(dtype)[6:], triton_interpret=interpret_enabled()
    )
    meta |= {
        k: getattr(a, k)
        for k in ("tag", "tokens", "hidden", "seqlens", "headdims", "providers", "modes", "seed")
    }
    meta |= gluon_routes() | dict(timing=timer.describe(), tolerance={"o_abs": tol[0], "grad_rel": tol[1]})
    meta["flops"] = "fwd = 2*B*H*N^2*d (causal half of 4*B*H*N^2*d); bwd = 2.5*fwd; fwdbwd = 3.5*fwd"
    meta["check"] = "O and dQ/dK/dV vs the float32 reference on (batch, head) pairs from check_pairs(B, H)"
    meta["naive_impl"] = common.naive_impl()[1] if "naive" in a.providers else None
    meta |= dict(injected_failures=inject or None, merged_with_previous=bool(previous), complete=False)
    if previous and (clash := common.merge_clash(previous_meta, meta)):
        print(
            f"error: --merge: {path} was measured with {clash}; one table must hold comparable rows: use "
            "another --tag (or the same settings)",
            file=sys.stderr,
        )
        return 2
    if previous:
        meta["invocations"] = common.merged_invocations(previous_meta, meta)
    save = lambda recs, png=False: common.write_attention(
        common.merge_records(previous, recs), meta, a.out, a.tag, png
    )
    records = run_benchmark(meta, device, dtype, timer, tol, inject, on_shape_done=save)
    meta["complete"] = True
    paths = save(records, png=True)
    print(paths["md"].read_text())
    print("wrote " + ", ".join(str(x) for x in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
