"""Causal-attention kernel benchmark: our Triton FlashAttention (``flash``, and ``flash-det`` with
deterministic=True: the bitwise-reproducible split backward) against naive attention, PyTorch SDPA (pinned to
each backend) and FlexAttention.

Usage (GPU)::

    python -m bench.attention                                   # full sweep, bf16, writes bench/results/
    python -m bench.attention --seqlens 1024,4096 --headdims 128 --providers flash,sdpa-flash
    TRITON_INTERPRET=1 python -m bench.attention --dry-run --out /tmp/b   # CPU plumbing check

Workload: batch x N = ``--tokens`` (default 16384) tokens, hidden ``--hidden`` (default 2048), so
``B = max(1, tokens // N)`` and ``H = hidden // d``. q, k, v, dO are standard normal, shape (B, H, N, d).

Per provider and shape the benchmark

1. checks the provider against a float32 reference (`reference_attention`) on a few (batch, head)
   slices of the same inputs: output O, and dQ/dK/dV for the backward modes. A provider that fails
   the check is recorded with status ``"mismatch: ..."`` and is not timed;
2. measures the peak memory of one forward+backward (CUDA only);
3. times ``fwd`` and ``fwdbwd`` with ``triton.testing.do_bench(return_mode="median")`` (CPU:
   `time.perf_counter` median) and derives ``bwd = fwdbwd - fwd``.

A provider that runs out of memory is recorded as ``"oom"``, one that cannot run as
``"error: <reason>"``; the sweep goes on.

FLOP counts (causal, so half of the dense 4*B*H*N^2*d): forward ``2*B*H*N^2*d``,
backward ``2.5 x`` forward, forward+backward ``3.5 x`` forward (the FlashAttention-2 paper's
convention, Dao 2023, Sec. 4.1).

Outputs in ``--out``: ``attention_<tag>.json`` (metadata + records), ``attention_<tag>.md``
(TFLOP/s, speedup, memory and error tables; also printed) and ``attention_<tag>.png``. JSON and
markdown are rewritten after every shape (metadata ``complete: false`` until the end), so a run cut
short by a time limit keeps its results; ``--merge`` folds a new invocation's records into an
existing JSON of the same tag (e.g. ``--headdims 64`` then ``--headdims 128 --merge``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from bench._attention_report import (  # noqa: F401  (re-exported: the benchmark's output API)
    MODES,
    markdown_report,
    merge_clash,
    merge_records,
    merged_invocations,
    output_paths,
    plot_report,
    read_for_merge,
    write_outputs,
)
from bench._providers import (  # noqa: F401  (re-exported: the providers and the reference)
    INJECT_KINDS,
    PROVIDERS,
    build_provider,
    check_pairs,
    inject_failure,
    max_abs_diff,
    naive_impl,
    reference_attention,
    take_pairs,
)
from bench._timing import Timer, classify_exception  # noqa: F401
from bench._timing import free_memory as _free

GPU_DEFAULT_PROVIDERS: tuple[str, ...] = (
    "flash", "flash-det", "naive", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex",
)
DRY_RUN_PROVIDERS: tuple[str, ...] = ("flash", "naive", "sdpa-math")
RECORD_KEYS: tuple[str, ...] = (
    "provider", "N", "d", "B", "H", "mode", "ms_median", "tflops", "peak_gib", "status", "max_abs_err",
)
GPU_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
GPU_HEADDIMS = (64, 128)
DRY_SEQLENS = (16, 32)
DRY_HEADDIMS = (16,)
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
_DTYPES = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float32": torch.float32, "fp32": torch.float32,
}
# (abs tolerance on O, tolerance on dQ/dK/dV relative to max(1, max|reference grad|)).
# float32 leaves room for TF32 tensor-core dots on GPU.
TOLERANCES = {torch.bfloat16: (2e-2, 5e-2), torch.float16: (5e-3, 2e-2), torch.float32: (5e-3, 1e-2)}

# ----------------------------------------------------------------------------------------------- shapes


def shape_for(tokens: int, hidden: int, n: int, d: int) -> tuple[int, int]:
    """Batch and head count for sequence length `n` and head dim `d`: ``B = max(1, tokens // n)``,
    ``H = hidden // d``.

    Raises ValueError when `hidden` is not a multiple of `d` (fix: choose --hidden divisible by every
    --headdims value) or a size is not positive.
    """
    if min(tokens, hidden, n, d) <= 0:
        raise ValueError(f"tokens={tokens}, hidden={hidden}, N={n}, d={d} must all be positive")
    if hidden % d:
        raise ValueError(f"--hidden {hidden} is not a multiple of head dim {d}; pick a hidden size "
                         f"divisible by every --headdims value")
    return max(1, tokens // n), hidden // d


def attention_flops(b: int, h: int, n: int, d: int, mode: str, causal: bool = True) -> float:
    """FLOPs of causal attention for `mode` in {"fwd", "bwd", "fwdbwd"}.

    Forward = two (N x N x d) matmuls per head = ``4*B*H*N^2*d``, halved for the causal mask
    (``2*B*H*N^2*d``); backward = 2.5 x forward (five matmuls instead of two); fwd+bwd = 3.5 x forward.
    Raises KeyError for an unknown mode (valid: fwd, bwd, fwdbwd).
    """
    fwd = 4.0 * b * h * n * n * d
    if causal:
        fwd /= 2.0
    return fwd * FLOP_FACTOR[mode]


def tflops_from_ms(flops: float, ms: float | None) -> float | None:
    """TFLOP/s for `flops` done in `ms` milliseconds (None when the time is missing or not positive)."""
    if ms is None or not ms > 0:
        return None
    return flops / (ms * 1e-3) / 1e12


# ---------------------------------------------------------------------------------------- benchmark core


@dataclass
class ShapeInputs:
    """Inputs of one (N, d) shape plus the float32 reference on the checked (batch, head) pairs."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    pairs: list[tuple[int, int]]
    ref_o: torch.Tensor
    ref_grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    extra: dict = field(default_factory=dict)


def make_inputs(b: int, h: int, n: int, d: int, *, device: torch.device, dtype: torch.dtype, seed: int,
                need_grads: bool, chunk: int = 1024) -> ShapeInputs:
    """Standard-normal q, k, v (requires_grad) and dO of shape (B, H, N, d), and the reference on
    `check_pairs(B, H)` computed by `reference_attention` in float32 from the very same values."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v, do = (torch.randn(b, h, n, d, device=device, dtype=dtype, generator=gen) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    pairs = check_pairs(b, h)
    ref_o, ref_grads = reference_attention(
        *(take_pairs(t, pairs) for t in (q, k, v)), take_pairs(do, pairs) if need_grads else None,
        chunk=max(1, min(chunk, (1 << 26) // max(1, len(pairs) * n))),
    )
    return ShapeInputs(q, k, v, do, pairs, ref_o, ref_grads)


def bench_provider(
    name: str,
    fn_factory: Callable[[], Callable],
    inp: ShapeInputs,
    *,
    modes: Sequence[str],
    timer: Timer,
    tol: tuple[float, float],
) -> list[dict]:
    """Check, measure memory of, and time one provider on one shape; never raises for provider failures.

    Returns one record per mode in `modes` with keys RECORD_KEYS plus ``peak_extra_gib`` (peak minus
    the memory allocated before, i.e. inputs; GiB), ``peak_of`` ("fwdbwd", or "fwd" when no backward
    ran), ``errors`` (max abs error of o/dq/dk/dv on the checked pairs) and ``tolerance``.
    `tol` = (abs tolerance on O, tolerance on grads relative to max(1, max|ref grad|)).
    Status: "ok", "oom", "error: ...", "mismatch: ...". Peak memory is CUDA only (None on CPU).
    """
    q, k, v, do = inp.q, inp.k, inp.v, inp.do
    b, h, n, d = q.shape
    device = q.device
    need_bwd = any(m in ("bwd", "fwdbwd") for m in modes)
    status = {m: "ok" for m in MODES}
    errors: dict[str, float] = {}
    ms: dict[str, float | None] = {m: None for m in MODES}
    peak = extra = peak_of = None
    tol_o, tol_g = tol

    def set_status(which: Sequence[str], value: str) -> None:
        for m in which:
            if status[m] == "ok":
                status[m] = value

    def clear_grads() -> None:
        for t in (q, k, v):
            t.grad = None

    fn = None
    try:
        fn = fn_factory()
        # --- correctness: forward
        clear_grads()
        o = fn(q, k, v)
        if o.shape != q.shape:
            raise RuntimeError(f"output shape {tuple(o.shape)} != q shape {tuple(q.shape)}")
        errors["o"] = max_abs_diff(take_pairs(o, inp.pairs), inp.ref_o)
        if not errors["o"] <= tol_o:
            set_status(MODES, f"mismatch: max|O - ref| = {errors['o']:.3g} > {tol_o:g}")
        # --- correctness: backward
        if need_bwd and status["fwd"] == "ok":
            try:
                o.backward(do)
                for gname, t, ref in zip(("dq", "dk", "dv"), (q, k, v), inp.ref_grads or (), strict=False):
                    if t.grad is None:
                        raise RuntimeError(f"backward produced no gradient for {gname[1]}")
                    errors[gname] = max_abs_diff(take_pairs(t.grad, inp.pairs), ref)
                    limit = tol_g * max(1.0, float(ref.abs().max()))
                    if not errors[gname] <= limit:
                        set_status(("bwd", "fwdbwd"),
                                   f"mismatch: max|{gname} - ref| = {errors[gname]:.3g} > {limit:.3g}")
            except Exception as exc:  # backward unsupported / OOM: forward results still count
                set_status(("bwd", "fwdbwd"), classify_exception(exc))
        del o
        clear_grads()
        _free(device)
        bwd_ok = need_bwd and status["fwdbwd"] == "ok"

        def fwd() -> object:
            return fn(q, k, v)

        def fwdbwd() -> None:
            fn(q, k, v).backward(do)

        # --- peak memory of one forward+backward (forward only if backward cannot run)
        if device.type == "cuda" and status["fwd"] == "ok":
            try:
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                if bwd_ok:
                    fwdbwd()
                else:
                    fwd()
                torch.cuda.synchronize()
                peak_b = torch.cuda.max_memory_allocated()
                peak, extra = peak_b / 2**30, (peak_b - base) / 2**30
                peak_of = "fwdbwd" if bwd_ok else "fwd"
            except Exception as exc:
                set_status(MODES, classify_exception(exc))
            clear_grads()
            _free(device)
        # --- timing
        if status["fwd"] == "ok":
            try:
                ms["fwd"] = timer(fwd)
            except Exception as exc:
                set_status(MODES, classify_exception(exc))
            clear_grads()
            _free(device)
        if bwd_ok and status["fwdbwd"] == "ok":
            try:
                ms["fwdbwd"] = timer(fwdbwd, grad_to_none=(q, k, v))
            except Exception as exc:
                set_status(("bwd", "fwdbwd"), classify_exception(exc))
            clear_grads()
            _free(device)
        if ms["fwd"] is not None and ms["fwdbwd"] is not None:
            ms["bwd"] = ms["fwdbwd"] - ms["fwd"]
    except Exception as exc:  # provider cannot be built or its forward fails
        set_status(MODES, classify_exception(exc))
    finally:
        fn = None
        clear_grads()
        _free(device)

    records = []
    for m in modes:
        ok = status[m] == "ok"
        errs = [errors[key] for key in (("o",) if m == "fwd" else ("o", "dq", "dk", "dv")) if key in errors]
        records.append({
            "provider": name, "N": int(n), "d": int(d), "B": int(b), "H": int(h), "mode": m,
            "ms_median": ms[m] if ok else None,
            "tflops": tflops_from_ms(attention_flops(b, h, n, d, m), ms[m]) if ok else None,
            "peak_gib": peak, "peak_extra_gib": extra, "peak_of": peak_of,
            "status": status[m],
            "max_abs_err": max(errs) if errs else None,
            "errors": dict(errors), "tolerance": {"o_abs": tol_o, "grad_rel": tol_g},
        })
    return records


def run_benchmark(
    *,
    seqlens: Sequence[int],
    headdims: Sequence[int],
    providers: Sequence[str],
    modes: Sequence[str],
    tokens: int,
    hidden: int,
    dtype: torch.dtype,
    device: torch.device,
    timer: Timer,
    seed: int = 0,
    inject: dict[str, str] | None = None,
    tol: tuple[float, float] | None = None,
    log: Callable[[str], None] = print,
    on_shape_done: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """Run every (d, N, provider) combination and return the flat list of records (see bench_provider).

    Inputs and the float32 reference are built once per shape and shared by all providers; an input
    allocation that fails marks every provider of that shape with the same status.
    `on_shape_done(records_so_far)` is called after each shape (used to save partial results, so a
    run stopped by a time limit keeps what it measured).
    """
    inject = inject or {}
    tol = tol or TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    need_grads = any(m in ("bwd", "fwdbwd") for m in modes)
    records: list[dict] = []
    for d in headdims:
        for n in seqlens:
            b, h = shape_for(tokens, hidden, n, d)
            log(f"[bench] N={n} d={d} B={b} H={h}")
            try:
                inp = make_inputs(b, h, n, d, device=device, dtype=dtype, seed=seed + 7919 * n + d,
                                  need_grads=need_grads)
            except Exception as exc:
                st = classify_exception(exc)
                for p in providers:
                    for m in modes:
                        records.append({"provider": p, "N": n, "d": d, "B": b, "H": h, "mode": m,
                                        "ms_median": None, "tflops": None, "peak_gib": None,
                                        "peak_extra_gib": None, "status": st, "max_abs_err": None})
                _free(device)
                if on_shape_done:
                    on_shape_done(records)
                continue
            for p in providers:

                def factory(p=p, n=n):
                    fn = build_provider(p, n=n, device=device)
                    return inject_failure(fn, inject[p]) if p in inject else fn

                recs = bench_provider(p, factory, inp, modes=modes, timer=timer, tol=tol)
                for r in recs:
                    t = f"{r['tflops']:.2f} TFLOP/s" if r["tflops"] is not None else "-"
                    log(f"  {p:15s} {r['mode']:7s} {t:>18s}  {r['status'][:90]}")
                records.extend(recs)
            del inp
            _free(device)
            if on_shape_done:
                on_shape_done(records)
    return records


def collect_metadata(device: torch.device, dtype: torch.dtype, **extra) -> dict:
    """Versions and device facts (no hostname): GPU name, torch/triton/CUDA/cuDNN versions, ISO date."""
    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = None
    try:
        cudnn = torch.backends.cudnn.version()
    except Exception:
        cudnn = None
    from kernels import interpret_enabled  # the kernels' own test, so the record says what they ran
    from kernels.plan import MIN_N as GLUON_MIN_N
    from kernels.plan import MIN_N_BWD as GLUON_MIN_N_BWD

    meta = {
        "benchmark": "causal self-attention, bench.attention",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device.type,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "python": platform.python_version(),
        "dtype": str(dtype).replace("torch.", ""),
        "triton_interpret": interpret_enabled(),
        # which forward `flash` runs on sm_90 at long N (kernels/_gluon_route.py): this and its MIN_N
        "flash_gluon_fwd": os.environ.get("FLASHGPT_GLUON_FWD", "auto"),
        "flash_gluon_min_n": {str(d): n for d, n in GLUON_MIN_N.items()},
        # and which backward: the one-pass Gluon kernel from MIN_N_BWD (MHA, N % 128 == 0)
        "flash_gluon_bwd": os.environ.get("FLASHGPT_GLUON_BWD", "auto"),
        "flash_gluon_min_n_bwd": {str(d): n for d, n in GLUON_MIN_N_BWD.items()},
        "flops": "fwd = 2*B*H*N^2*d (causal half of 4*B*H*N^2*d); bwd = 2.5*fwd; fwdbwd = 3.5*fwd",
        "check": "O and dQ/dK/dV vs float32 reference (bench.attention.reference_attention) on "
                 "(batch, head) pairs from check_pairs(B, H); tolerances: O abs, grads relative to "
                 "max(1, max|ref|)",
    }
    meta.update(extra)
    return meta


def default_tag(device: torch.device) -> str:
    """'h200' on an H200, else a lowercase slug of the GPU name, 'cpu' without CUDA."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device)
    if "H200" in name.upper():
        return "h200"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


# --------------------------------------------------------------------------------------------------- CLI


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _choice_list(valid: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        vals = [x for x in text.replace(" ", "").split(",") if x]
        bad = [x for x in vals if x not in valid]
        if bad or not vals:
            raise argparse.ArgumentTypeError(f"unknown {bad or text!r}; choose from {', '.join(valid)}")
        return vals

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.attention",
        description="Benchmark causal attention providers (TFLOP/s, memory, correctness).",
    )
    p.add_argument("--seqlens", type=_int_list, default=None,
                   help=f"comma list of N (default {','.join(map(str, GPU_SEQLENS))}; dry run 16,32)")
    p.add_argument("--headdims", type=_int_list, default=None,
                   help="comma list of d (default 64,128; dry run 16)")
    p.add_argument("--providers", type=_choice_list(PROVIDERS), default=None,
                   help=f"comma list from {','.join(PROVIDERS)} (default {','.join(GPU_DEFAULT_PROVIDERS)}; "
                        f"dry run {','.join(DRY_RUN_PROVIDERS)})")
    p.add_argument("--modes", type=_choice_list(MODES), default=list(MODES),
                   help="comma list (default fwd,bwd,fwdbwd)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                   help="default bfloat16 (dry run float32)")
    p.add_argument("--tokens", type=int, default=None,
                   help="B*N tokens per shape (default 16384; dry run 64)")
    p.add_argument("--hidden", type=int, default=None, help="H*d (default 2048; dry run 64)")
    p.add_argument("--out", default=None,
                   help="output directory (default bench/results on a GPU; outputs/bench on a CPU, so a "
                        "dry run never lands beside the committed GPU results)")
    p.add_argument("--tag", default=None, help="file tag (default h200 / GPU-name slug / cpu)")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny CPU run to test the plumbing (sets TRITON_INTERPRET=1 for flash)")
    p.add_argument("--device", default=None, help="cuda or cpu (default cuda when available, else cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    p.add_argument("--cpu-reps", type=int, default=3, help="timed repetitions on CPU")
    p.add_argument("--atol-o", type=float, default=None,
                   help="abs tolerance on O vs the float32 reference "
                        "(default bf16 2e-2, fp16 5e-3, fp32 5e-3)")
    p.add_argument("--rtol-grad", type=float, default=None,
                   help="tolerance on dQ/dK/dV relative to max(1, max|ref|) (default bf16 5e-2, fp16 2e-2, "
                        "fp32 1e-2)")
    p.add_argument("--merge", action="store_true",
                   help="merge into an existing attention_<tag>.json (same provider/N/d/mode replaced), "
                        "to split a sweep over several invocations")
    p.add_argument("--inject-failure", action="append", default=[], help=argparse.SUPPRESS)  # PROVIDER[:kind]
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.device is None:
        device = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    else:
        device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch.cuda.is_available() is False; use --dry-run (CPU) or a "
              "CUDA machine", file=sys.stderr)
        return 2
    small = device.type != "cuda"  # CPU: tiny dry-run shapes unless given explicitly
    if args.out is None:
        args.out = "outputs/bench" if small else "bench/results"
    if small and not args.dry_run:
        print("[bench] no CUDA device: running the CPU dry-run configuration", file=sys.stderr)
    if small:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before kernels/triton.jit are imported
    seqlens = args.seqlens or list(DRY_SEQLENS if small else GPU_SEQLENS)
    headdims = args.headdims or list(DRY_HEADDIMS if small else GPU_HEADDIMS)
    providers = args.providers or list(DRY_RUN_PROVIDERS if small else GPU_DEFAULT_PROVIDERS)
    dtype = _DTYPES[args.dtype or ("float32" if small else "bfloat16")]
    tokens = args.tokens or (64 if small else 16384)
    hidden = args.hidden or (64 if small else 2048)
    modes = [m for m in MODES if m in args.modes]
    inject = {}
    for spec in args.inject_failure:
        prov, _, kind = spec.partition(":")
        if prov not in PROVIDERS or (kind or "error") not in INJECT_KINDS:
            print(f"error: --inject-failure {spec!r}: expected PROVIDER[:{'|'.join(INJECT_KINDS)}]",
                  file=sys.stderr)
            return 2
        inject[prov] = kind or "error"
    for d in headdims:
        try:
            shape_for(tokens, hidden, seqlens[0], d)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    timer = Timer(device, warmup_ms=args.warmup, rep_ms=args.rep, cpu_reps=args.cpu_reps)
    default_tol = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    tol = (default_tol[0] if args.atol_o is None else args.atol_o,
           default_tol[1] if args.rtol_grad is None else args.rtol_grad)
    tag = args.tag or default_tag(device)
    previous: list[dict] = []
    previous_meta: dict = {}
    if args.merge and output_paths(args.out, tag)["json"].is_file():
        try:
            previous, previous_meta = read_for_merge(output_paths(args.out, tag)["json"])
        except (OSError, ValueError) as exc:
            print(f"error: --merge: cannot read {output_paths(args.out, tag)['json']} ({exc}); "
                  f"fix or move it, or run without --merge", file=sys.stderr)
            return 2
    meta = collect_metadata(
        device, dtype, tag=tag, dry_run=small, tokens=tokens, hidden=hidden, seqlens=seqlens,
        headdims=headdims, providers=providers, modes=modes, timing=timer.describe(), seed=args.seed,
        naive_impl=naive_impl()[1] if "naive" in providers else None,
        tolerance={"o_abs": tol[0], "grad_rel": tol[1]},
        injected_failures=inject or None, merged_with_previous=bool(previous), complete=False,
    )
    if previous:
        clash = merge_clash(previous_meta, meta)
        if clash:
            print(f"error: --merge: {output_paths(args.out, tag)['json']} was measured with {clash}; one "
                  "table must hold comparable rows: use another --tag (or the same settings)",
                  file=sys.stderr)
            return 2
        meta["invocations"] = merged_invocations(previous_meta, meta)

    def save_partial(recs: list[dict]) -> None:
        write_outputs(merge_records(previous, recs), meta, args.out, tag, png=False)

    records = run_benchmark(seqlens=seqlens, headdims=headdims, providers=providers, modes=modes,
                            tokens=tokens, hidden=hidden, dtype=dtype, device=device, timer=timer,
                            seed=args.seed, inject=inject, tol=tol, on_shape_done=save_partial)
    meta["complete"] = True
    paths = write_outputs(merge_records(previous, records), meta, args.out, tag)
    print(paths["md"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
