"""Decode-step attention benchmark: flash-decoding against naive and every SDPA backend, and end-to-end
generation tokens/sec. H200 figures: bench/results/decode_h200_s13.md (context >= 8k, batch 1 and 16) and
decode_h200_e2e.md (re-measure after kernel or timing changes).

Usage (GPU)::

    python -m bench.decode                                   # full sweep, bf16, writes bench/results/
    python -m bench.decode --contexts 8192,32768 --batches 1,16 --dims 128 --groups 4
    python -m bench.decode --e2e --batches 1,16              # GPT-2 124M generation tokens/sec
    python -m bench.decode --dry-run                         # CPU plumbing check (outputs/bench/)

Kernel sweep: one decode step, q (B, Hq, 1, d) against a full cache k/v (B, Hkv, L, d) with
Hkv = ``--kv-heads`` (default 8) and Hq = group x Hkv, for context L in ``--contexts``, batch in
``--batches``, d in ``--dims``, group in ``--groups``. Providers: ``flash-decode``
(kernels.flash_decode), ``naive`` (float32 scores, k/v repeated for GQA), and
``sdpa-<auto|flash|cudnn|efficient|math>`` (SDPA pinned, ``enable_gqa=True``), and ``read-floor``: no
attention, a kernel that reads the K/V bytes once (``bench._read_floor``), the floor of any provider's
time in this harness. Each attention provider is first checked
against a float32 reference on sequence 0 (status ``mismatch`` and not timed when off by more than 2x
the SDPA-math error + 1e-3), then timed (``bench._timing.Timer``: do_bench median on CUDA, warm-up
``--warmup-ms`` 10, ``--rep-ms`` 40; calls of >= ``TIMER_SLOW_MS`` (10 ms): median of 3). On a GPU twice:
``ms_eager`` calls the provider from Python each time (host time included when the host is slower than the
kernel); ``ms`` is the replay time of one CUDA graph of ``GRAPH_CALLS`` (20) back-to-back calls / 20
(``--no-graphs`` to skip), as a serving loop or ``torch.compile(mode="reduce-overhead")`` runs a step's
layers: kernel time only, the graph launch shared by the 20 calls. Like a step's layers, consecutive calls
read different K/V: they cycle through copies of q, k, v spanning twice the L2 (``_l2_copies``), so a small
cache is read from HBM. Calls whose ``ms_eager`` is >= ``EAGER_ONLY_MS`` (1 ms) are timed eagerly only
(``timing: "eager"``, ``ms = ms_eager``; ``time_call``): launch overhead is then a few percent at most, the
cache is far bigger than the L2, and 20 calls of naive or sdpa-math at large cells would take seconds a
replay. The tables and the bandwidth use ``ms``.
Achieved K/V read bandwidth = 2 * B * Hkv * L * d * bytes / time, against the copy ceiling measured
here (``torch.Tensor.copy_`` of a 2 GiB buffer: bytes read + written / time).

End to end (``--e2e``): randomly initialised GPT-2 124M, a ``--prompt-len`` prompt, ``--new-tokens`` greedy
tokens, per backend, mode and batch (``--batches``), reporting prefill and decode tokens/sec from
``GPT.generate(timings=...)`` after a 4-token warm-up generation. Modes: ``eager`` (the growing cache
view), ``static`` (``static_decode=True``: ``decode_step``'s static shapes, still eager) and ``compiled``
(static, with ``model._decode_static = torch.compile(model._decode_static)`` as sample.py's
``compile=true``), and ``graph`` / ``compiled-graph``: the static or compiled step replayed as one CUDA
graph (``cuda_graph=True``, ``model.decode_graph``, sample.py ``cuda_graph=true``; captured in the warm-up,
CUDA only): no launch cost per kernel, so there the decode kernel, not Python, sets the speed. A compiled
record counts the graphs compiled during the timed generation (``recompiles``, 0 when the warm-up compiled
everything); a compilation failure is that record's error. ``--compile-backend``: inductor on a GPU; the
dry run defaults to dynamo's ``eager`` backend (the tracing and the op plumbing, without Inductor's CPU code
generation: about 20 s per model on two cores), recorded as ``compile_backend`` and in the markdown.

Outputs in ``--out``: ``decode_<tag>.json`` and ``.md`` (also printed; default tag ``h200``, or ``dryrun``
for the dry run, with ``_e2e`` appended for ``--e2e-only``), rewritten atomically after every
shape and e2e record with ``meta["complete"]`` False until the end: a run killed part-way keeps what it
measured. Per-shape seconds go to stderr; ``--report decode_<tag>.json`` rewrites a results file's markdown.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

if __name__ == "__main__" and "--dry-run" in sys.argv[1:]:
    # the CPU plumbing check runs the kernels in Triton's interpreter, which must be chosen before anything
    # imports triton (the imports below do)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

from bench._decode_report import PROVIDERS, Results, _write_text, markdown, rewrite_report  # noqa: F401
from bench._providers import sdpa_backend
from bench._timing import Timer, free_memory

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _grid_problem(value: str | None, low: int, pow2: bool = False) -> str | None:
    """What is wrong with one comma list of a grid (None: nothing, or the option not given)."""
    if value is None:
        return None
    try:
        ints = _ints(value)
    except ValueError:
        return "must be a comma list of integers"
    if not ints:
        return "is an empty list"
    rule = f"powers of two >= {low}" if pow2 else f"integers >= {low}"
    if any(n < low or (pow2 and n & (n - 1)) for n in ints):
        return f"must be {rule}"
    return None


def provider_fn(name: str):
    """fn(q, k, v) -> o for one decode step (q one row; k/v the whole cache, all of it visible)."""
    if name == "flash-decode":
        from kernels import flash_decode

        return lambda q, k, v: flash_decode(q, k, v)
    if name == "read-floor":  # not attention: the K/V read alone (bench/_read_floor.py)
        from bench._read_floor import read_floor

        return read_floor
    if name == "naive":

        def naive(q, k, v):
            g = q.shape[1] // k.shape[1]
            kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            s = torch.matmul(q.float(), kk.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
            return torch.matmul(torch.softmax(s, -1).to(v.dtype), vv)

        return naive
    if name.startswith("sdpa-"):
        backend = name[len("sdpa-") :]

        def sdpa(q, k, v):
            gqa = q.shape[1] != k.shape[1]
            if backend == "auto":
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
            from torch.nn.attention import sdpa_kernel

            with sdpa_kernel([sdpa_backend(backend)]):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)

        return sdpa
    raise ValueError(f"unknown provider {name!r}; choose from {', '.join(PROVIDERS)}")


def reference(q, k, v) -> torch.Tensor:
    """float32 decode attention of sequence 0 (all cache slots visible), (1, Hq, Nq, d). GQA: the query
    heads of one KV head are grouped as rows against that head's k/v, not k/v repeated per query head
    (the same products, without a float32 copy of the cache per query head: 8.6 GB at group 8, d 128,
    131k context)."""
    _, hq, nq, d = q.shape
    hkv = k.shape[1]
    q0 = q[:1].float().reshape(1, hkv, (hq // hkv) * nq, d)  # query head h = hk * group + g
    k0, v0 = k[:1].float(), v[:1].float()
    o = torch.softmax(q0 @ k0.transpose(-1, -2) / math.sqrt(d), -1) @ v0
    return o.reshape(1, hq, nq, d)


def copy_ceiling_gbs(device: torch.device, timer: Timer, nbytes: int) -> float:
    """Copy bandwidth (GB/s, read + write) of ``nbytes`` on ``device``: the ceiling a K/V stream can reach."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


# Calls of a provider per captured CUDA graph; ``ms`` = replay time / GRAPH_CALLS. One graph launch
# costs several microseconds, about a batch-1 decode kernel's own time: a decode step pays it once for
# all layers, so a graph of one call would add it to every figure (module docstring).
GRAPH_CALLS = 20
# A provider whose eager median is at least this long (ms) is not also timed as a CUDA graph (module
# docstring): its launch overhead is a few percent at most, its cache far bigger than the L2.
EAGER_ONLY_MS = 1.0
# Timer.slow_ms of the kernel sweep: calls this long (ms) are timed as the median of 3 calls
TIMER_SLOW_MS = 10.0


def _l2_copies(q, k, v, kv_bytes: int) -> list[tuple]:
    """(q, k, v) and fresh copies of it, enough that ``GRAPH_CALLS`` calls cycling through them touch
    twice the device's L2 cache between two reads of one copy (at most GRAPH_CALLS copies): a decode
    step's layers each read their own cache, so a benchmark that re-reads one small cache would time
    L2, not HBM (H200: 50 MB of L2 against a 16.8 MB cache at batch 1, d=64, 8k context)."""
    l2 = getattr(torch.cuda.get_device_properties(k.device), "L2_cache_size", 0)
    n = min(GRAPH_CALLS, max(1, math.ceil(2 * l2 / max(1, kv_bytes))))
    return [(q, k, v)] + [(q.clone(), k.clone(), v.clone()) for _ in range(n - 1)]


def _captured(fn, arg_sets: list[tuple], calls: int = GRAPH_CALLS) -> torch.cuda.CUDAGraph:
    """``calls`` back-to-back calls of fn, call i on ``arg_sets[i % len(arg_sets)]``, captured in one CUDA
    graph (after warm-up calls on a side stream, as torch.cuda.graphs documents); replaying it launches
    the same kernels with no Python in between. Each call's output is dropped at once, so the graph's
    pool reuses its memory for the next call's (one call's footprint, not ``calls``)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for args in arg_sets[:3]:
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(*arg_sets[i % len(arg_sets)])
    return graph


def time_call(fn, args: tuple, timer, graph_ms=None) -> dict:
    """``ms``, ``ms_eager`` and ``timing`` of ``fn(*args)``: the eager median from ``timer``, then, unless
    ``graph_ms`` is None (no graphs) or the eager median is at least ``EAGER_ONLY_MS``, ``graph_ms(fn)``
    (the CUDA-graph time per call) as ``ms``; else ``ms = ms_eager`` and timing "eager"."""
    ms_eager = timer(lambda: fn(*args))
    if graph_ms is None or ms_eager >= EAGER_ONLY_MS:
        return dict(ms=ms_eager, ms_eager=ms_eager, timing="eager")
    return dict(ms=graph_ms(fn), ms_eager=ms_eager, timing="cuda_graph")


def bench_shape(args, device, timer, dtype, d: int, group: int, b: int, ctx: int) -> list[dict]:
    """Records of every provider for one (d, group, batch, context) decode step."""
    hkv = args.kv_heads
    gen = torch.Generator(device=device).manual_seed(args.seed)
    try:
        q = torch.randn(b, hkv * group, 1, d, device=device, dtype=dtype, generator=gen)
        k = torch.randn(b, hkv, ctx, d, device=device, dtype=dtype, generator=gen)
        v = torch.randn(b, hkv, ctx, d, device=device, dtype=dtype, generator=gen)
    except torch.OutOfMemoryError:
        return [dict(d=d, group=group, batch=b, context=ctx, provider="*", status="oom")]
    ref = reference(q, k, v)
    math_err = (provider_fn("sdpa-math")(q[:1], k[:1], v[:1]).float() - ref).abs().max().item()
    kv_bytes = 2 * b * hkv * ctx * d * q.element_size()
    records = []
    copies = None  # the L2-spanning input copies of the graph timing, made at the first graph

    def graph_ms(fn) -> float:
        nonlocal copies
        copies = copies or _l2_copies(q, k, v, kv_bytes)
        graph = _captured(fn, copies)
        try:
            return timer(graph.replay) / GRAPH_CALLS
        finally:
            del graph

    seconds = []
    for p in args.providers.split(","):
        t0 = time.perf_counter()
        rec = dict(d=d, group=group, batch=b, context=ctx, provider=p, kv_bytes=kv_bytes)
        try:
            fn = provider_fn(p)
            out = fn(q, k, v)
            # read-floor computes no attention: nothing to check
            err = None if p == "read-floor" else (out[:1].float() - ref).abs().max().item()
            rec["max_abs_err"] = err
            if err is not None and err > 2 * math_err + 1e-3:
                rec["status"] = f"mismatch: {err:.3g} (sdpa-math {math_err:.3g})"
            else:
                timed = time_call(
                    fn, (q, k, v), timer, graph_ms if args.graphs and device.type == "cuda" else None
                )
                rec.update(status="ok", **timed, gbs=kv_bytes / (timed["ms"] * 1e-3) / 1e9)
        except torch.OutOfMemoryError:
            rec["status"] = "oom"
        except Exception as e:  # noqa: BLE001 - a backend that cannot run is a result
            rec["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
        records.append(rec)
        seconds.append(f"{p} {time.perf_counter() - t0:.1f}")
        print(json.dumps(rec), flush=True)
    shape = f"d={d} group={group} batch={b} context={ctx}"
    print(f"[bench.decode] {shape}: seconds per provider " + ", ".join(seconds), file=sys.stderr)
    return records


def kernel_sweep(args, device, timer, dtype, on_shape=None) -> list[dict]:
    """Records of every shape of the grid; ``on_shape(records)`` after each shape with that shape's."""
    records = []
    for d in _ints(args.dims):
        for group in _ints(args.groups):
            for b in _ints(args.batches):
                for ctx in _ints(args.contexts):
                    t0 = time.perf_counter()
                    shape = bench_shape(args, device, timer, dtype, d, group, b, ctx)
                    records += shape
                    free_memory(device)
                    if on_shape is not None:
                        on_shape(shape)
                    print(
                        f"[bench.decode] shape done in {time.perf_counter() - t0:.1f} s "
                        f"({len(records)} kernel records)",
                        file=sys.stderr,
                        flush=True,
                    )
    return records


# growing cache view; decode_step; decode_step compiled; decode_step as a CUDA graph (model.decode_graph),
# eager or compiled (CUDA only)
E2E_MODES = ("eager", "static", "compiled", "graph", "compiled-graph")
E2E_WARMUP_TOKENS = 4  # the warm-up generation: the prefill and the first decode steps (which compile)


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def e2e_sweep(args, device, dtype, on_record=None) -> list[dict]:
    """Generation tokens/sec per backend, mode (``E2E_MODES``) and batch; ``on_record(rec)`` after each."""
    from model import GPT, PRESETS, GPTConfig

    records = []
    preset = PRESETS["tiny"] if args.dry_run else PRESETS["gpt2"]
    block = args.prompt_len + args.new_tokens
    for backend in args.e2e_backends.split(","):
        for mode in E2E_MODES:
            for b in _ints(args.batches):
                compiled, graph = mode.startswith("compiled"), mode.endswith("graph")
                if graph and device.type != "cuda":
                    continue  # CUDA graphs: nothing to time on the CPU (the dry run)
                t0 = time.perf_counter()
                static = mode != "eager"
                rec = dict(
                    backend=backend,
                    mode=mode,
                    static_decode=static,
                    batch=b,
                    prompt_len=args.prompt_len,
                    new_tokens=args.new_tokens,
                )
                if compiled:
                    rec["compile_backend"] = args.compile_backend
                model = None
                try:
                    torch.manual_seed(args.seed)
                    model = GPT(GPTConfig(block_size=block, vocab_size=50304, attention=backend, **preset))
                    model = model.to(device=device, dtype=dtype).eval()
                    prompt = torch.randint(0, 50257, (b, args.prompt_len), device=device)
                    if compiled:
                        torch._dynamo.reset()  # a fresh cache per record: no guards left by other models
                        model._decode_static = torch.compile(
                            model._decode_static, backend=args.compile_backend
                        )
                    warm = min(E2E_WARMUP_TOKENS, args.new_tokens)
                    kw = dict(temperature=0, static_decode=static, cuda_graph=graph)
                    model.generate(prompt, warm, **kw)  # warm-up: compiles, captures the graph
                    graphs = _compiled_graphs()
                    t: dict = {}
                    model.generate(prompt, args.new_tokens, timings=t, **kw)
                    if compiled:
                        rec["recompiles"] = _compiled_graphs() - graphs
                    rec.update(
                        status="ok",
                        prefill_tokens_per_sec=t["prefill_tokens"] / t["prefill_s"],
                        decode_tokens_per_sec=t["decode_tokens"] / t["decode_s"],
                    )
                except torch.OutOfMemoryError:
                    rec["status"] = "oom"
                except Exception as e:  # noqa: BLE001 - a backend or compilation that fails is a result
                    rec["status"] = f"error: {type(e).__name__}: {str(e).strip().splitlines()[0][:120]}"
                finally:
                    del model
                    if compiled:
                        torch._dynamo.reset()
                    free_memory(device)
                records.append(rec)
                print(json.dumps(rec), flush=True)
                print(
                    f"[bench.decode] e2e {backend} {mode} batch={b}: {time.perf_counter() - t0:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
                if on_record is not None:
                    on_record(rec)
    return records


# the grids: the GPU benchmark's, and tiny shapes for a CPU plumbing check (--dry-run: seconds, not hours)
GPU_SHAPES = dict(
    contexts="1024,2048,4096,8192,16384,32768,65536,131072",
    batches="1,16,64",
    dims="64,128",
    groups="1,4,8",
    kv_heads=8,
    prompt_len=512,
    new_tokens=256,
)
DRY_RUN_SHAPES = dict(
    contexts="40,100", batches="1,2", dims="16", groups="1,4", kv_heads=2, prompt_len=4, new_tokens=3
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.decode",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # defaults: the GPU grid; --dry-run has tiny ones of its own (DRY_RUN_SHAPES)
    ap.add_argument("--contexts", default=None, help="comma list (GPU default: 1024 .. 131072)")
    ap.add_argument("--batches", default=None, help="comma list (GPU default: 1,16,64)")
    ap.add_argument("--dims", default=None, help="comma list of d (GPU default: 64,128)")
    ap.add_argument("--groups", default=None, help="query heads per KV head (GPU default: 1,4,8)")
    ap.add_argument("--kv-heads", type=int, default=None, help="KV heads (GPU default: 8)")
    ap.add_argument("--providers", default=",".join(PROVIDERS))
    ap.add_argument("--dtype", default="bf16", choices=DTYPES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--e2e", action="store_true", help="also time GPT-2 124M generation end to end")
    ap.add_argument("--e2e-only", action="store_true")
    ap.add_argument("--e2e-backends", default="sdpa,flash")
    ap.add_argument("--prompt-len", type=int, default=None, help="GPU default: 512")
    ap.add_argument("--new-tokens", type=int, default=None, help="GPU default: 256")
    ap.add_argument(
        "--compile-backend",
        default=None,
        help="torch.compile backend of the e2e compiled mode (default inductor; --dry-run: eager)",
    )
    ap.add_argument("--copy-bytes", type=int, default=2 << 30)
    ap.add_argument("--warmup-ms", type=int, default=10, help="do_bench warm-up per timing (GPU)")
    ap.add_argument("--rep-ms", type=int, default=40, help="do_bench repetition time per timing (GPU)")
    ap.add_argument(
        "--graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time each provider as a CUDA-graph replay (the tables use it; GPU only)",
    )
    ap.add_argument("--dry-run", action="store_true", help="CPU plumbing check: tiny shapes, fp32, 1 rep")
    ap.add_argument(
        "--out",
        default=None,
        help="output directory (default bench/results on a GPU, outputs/bench for --dry-run, "
        "so a dry run never lands beside the committed GPU results)",
    )
    ap.add_argument("--tag", default=None)
    ap.add_argument(
        "--report", default=None, metavar="JSON", help="only rewrite the markdown of a results file"
    )
    args = ap.parse_args(argv)
    if args.report is not None:
        try:
            print(rewrite_report(Path(args.report)))
        except ValueError as e:
            print(f"error: --report: {e}", file=sys.stderr)
            return 2
        return 0
    if args.compile_backend is None:
        args.compile_backend = "eager" if args.dry_run else "inductor"
    for key, value in (DRY_RUN_SHAPES if args.dry_run else GPU_SHAPES).items():
        if getattr(args, key) is None:  # what the user did not give
            setattr(args, key, value)
    for flag, key in (
        ("--contexts", "contexts"),
        ("--batches", "batches"),
        ("--dims", "dims"),
        ("--groups", "groups"),
    ):
        problem = _grid_problem(getattr(args, key), 1)
        if problem:
            ap.error(f"{flag} {getattr(args, key)!r}: {problem}")
    for flag, value in (("--kv-heads", args.kv_heads), ("--prompt-len", args.prompt_len)):
        if value < 1:
            ap.error(f"{flag} must be >= 1, got {value}")
    if args.new_tokens < 1:
        ap.error(f"--new-tokens must be >= 1, got {args.new_tokens}")
    names = [p.strip() for p in args.providers.split(",")]
    unknown = [p for p in names if p not in PROVIDERS]
    if unknown or len(set(names)) != len(names):
        bad = unknown or "a name given twice"
        ap.error(f"--providers {args.providers!r}: each once, from {', '.join(PROVIDERS)} (bad: {bad})")
    args.providers = ",".join(names)
    if args.e2e or args.e2e_only:
        backends = [b.strip() for b in args.e2e_backends.split(",")]
        bad = [b for b in backends if b not in ("naive", "sdpa", "flash")]
        if bad:
            ap.error(f"--e2e-backends {args.e2e_backends!r}: each of naive, sdpa, flash (bad: {bad})")
        args.e2e_backends = ",".join(backends)
    if args.dry_run:
        device, dtype = torch.device("cpu"), torch.float32
        args.copy_bytes = min(args.copy_bytes, 1 << 22)
        timer = Timer(device, cpu_reps=1)
    else:
        if not torch.cuda.is_available():
            print(
                "error: bench.decode times CUDA kernels and needs a GPU; use --dry-run on a CPU",
                file=sys.stderr,
            )
            return 2
        device, dtype = torch.device("cuda"), DTYPES[args.dtype]
        timer = Timer(device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, slow_ms=TIMER_SLOW_MS)
    import triton  # after the dry run's TRITON_INTERPRET choice (module top)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    meta = dict(
        device=name,
        dtype=str(dtype)[6:],
        torch=torch.__version__,
        triton=triton.__version__,
        time=datetime.datetime.now().isoformat(),
        argv=sys.argv[1:] if argv is None else list(argv),
        copy_ceiling_gbs=copy_ceiling_gbs(device, timer, args.copy_bytes),
        graph_calls=GRAPH_CALLS,  # calls per captured graph behind `ms` (timing cuda_graph)
        graphs=bool(args.graphs and device.type == "cuda"),
        eager_only_ms=EAGER_ONLY_MS,  # eager medians this long are not also timed as a graph
        timer=timer.describe(),
        complete=False,
    )
    # an --e2e-only run has its own default file: it must not replace the kernel sweep's results
    tag = args.tag or ("dryrun" if args.dry_run else "h200") + ("_e2e" if args.e2e_only else "")
    results = Results(Path(args.out or ("outputs/bench" if args.dry_run else "bench/results")), tag, meta)
    results.save()
    if not args.e2e_only:
        kernel_sweep(args, device, timer, dtype, on_shape=results.add_kernel)
    if args.e2e or args.e2e_only:
        e2e_sweep(args, device, dtype, on_record=results.add_e2e)
    print(results.save(complete=True))
    if args.dry_run:  # the plumbing check exists to run our kernel: its failure fails the check
        bad = [r for r in results.kernel if r["provider"] == "flash-decode" and r.get("status") != "ok"]
        bad += [r for r in results.e2e if r.get("backend") == "flash" and r.get("status") != "ok"]
        if bad:
            print(
                f"error: dry run: {len(bad)} flash record(s) failed, first: {bad[0].get('status')}",
                file=sys.stderr,
            )
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
