"""Decode-step attention benchmark: flash-decoding against naive and every SDPA backend, and end-to-end
generation tokens/sec.

    python -m bench.decode                                   # full sweep, bf16, writes bench/results/
    python -m bench.decode --contexts 8192,32768 --batches 1,16 --dims 128 --groups 4
    python -m bench.decode --e2e --batches 1,16              # GPT-2 124M generation tokens/sec
    python -m bench.decode --dry-run                         # CPU plumbing check (outputs/bench/)

Kernel sweep: one decode step, q (B, Hq, 1, d) against a full cache k/v (B, Hkv, L, d), Hq = group x Hkv.
Providers: flash-decode, naive, sdpa-<auto|flash|cudnn|efficient|math> (pinned, enable_gqa), and read-floor
(no attention: a kernel that reads the K/V bytes once, the floor of any provider's time here). Each is
checked against a float32 reference on sequence 0 (``mismatch``, not timed, past 2x the SDPA-math error +
1e-3), then timed: ``ms_eager`` from Python, ``ms`` the replay of one CUDA graph of 20 back-to-back calls / 20
(kernel time, as a serving loop runs a step's layers; the calls cycle through copies of q, k, v spanning twice
the L2, so K/V come from HBM). Calls of >= EAGER_ONLY_MS are timed eagerly only (``timing: "eager"``).
GB/s = K/V bytes / ms, against the copy ceiling measured here.

End to end (--e2e, --e2e-only): random GPT-2 124M, prefill and decode tokens/sec of ``GPT.generate`` per
backend, mode and batch after a 4-token warm-up. Modes: eager (growing cache view), static
(``static_decode=True``), compiled (static with ``torch.compile(model._decode_static)``; ``recompiles`` counts
graphs compiled in the timed run), graph / compiled-graph (one CUDA graph per step; CUDA only). The dry run
compiles with dynamo's eager backend (no Inductor code generation).

Writes decode_<tag>.json and .md to --out (tag h200, dryrun, ``_e2e`` appended for --e2e-only) after every
shape and e2e record (``complete`` False until the end); ``--report JSON`` rewrites a file's markdown.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

if __name__ == "__main__" and "--dry-run" in sys.argv[1:]:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import torch

from bench import common
from bench.common import GRAPH_CALLS, Timer, free_memory

PROVIDERS = ("flash-decode", "read-floor", "naive", *(f"sdpa-{b}" for b in ("auto", *common.SDPA_BACKENDS)))
EAGER_ONLY_MS = 1.0  # eager medians this long are not also timed as a graph
TIMER_SLOW_MS = 10.0  # Timer.slow_ms of the kernel sweep: such calls are timed as the median of 3
E2E_MODES = ("eager", "static", "compiled", "graph", "compiled-graph")
E2E_WARMUP_TOKENS = 4  # the warm-up generation: the prefill and the first decode steps (which compile)
GPU_GRID = dict(contexts=[1024 << i for i in range(8)], batches=[1, 16, 64], dims=[64, 128], groups=[1, 4, 8])
GPU_GRID |= dict(kv_heads=8, prompt_len=512, new_tokens=256, compile_backend="inductor")
DRY_GRID = dict(contexts=[40, 100], batches=[1, 2], dims=[16], groups=[1, 4], kv_heads=2, prompt_len=4)
DRY_GRID |= dict(new_tokens=3, compile_backend="eager")

# The read-floor provider: a kernel that only reads the K/V cache, once. Any decode kernel must read every
# K/V byte; this one does nothing else (each program sums a chunk of k and v), so its time in the same
# harness is a floor for the attention providers. 2048 programs of 8 warps, BLOCK 2048 were the fastest at
# every decode shape of a sweep on the H200 (bench/NOTES.md, "Decode floor").
FLOOR_PROGRAMS, FLOOR_BLOCK, FLOOR_WARPS = 2048, 2048, 8


@functools.cache
def _floor_kernel():
    """Built at first use, so that TRITON_INTERPRET set by a dry run is honoured."""
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def read_kernel(K, V, OUT, n, chunk, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
        if USE_PDL:  # wait for the previous kernel, then let the next one launch (as flash_decode)
            gdc_wait()
            gdc_launch_dependents()
        lo = tl.program_id(0).to(tl.int64) * chunk
        # tl.full / tl.reduce: tl.zeros / tl.sum are compiled-mode functions when triton was imported
        # before TRITON_INTERPRET=1 was set
        acc = tl.full([BLOCK], 0.0, tl.float32)
        for start in range(0, chunk, BLOCK):
            offs = lo + start + tl.arange(0, BLOCK)
            acc += tl.load(K + offs, mask=offs < n, other=0.0).to(tl.float32)
            acc += tl.load(V + offs, mask=offs < n, other=0.0).to(tl.float32)
        tl.store(OUT + tl.program_id(0), tl.reduce(acc, 0, tl.standard._sum_combine))

    return read_kernel


def read_floor(q, k, v) -> torch.Tensor:
    """Read every element of k and v once; returns per-program float32 sums (not attention; q unused).
    ValueError for non-tensors, non-contiguous k / v, or k / v of other shapes, dtypes or devices."""
    if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        raise ValueError(f"read-floor needs tensors k and v, got {type(k).__name__} and {type(v).__name__}")
    for problem, bad in (
        ("contiguous k and v (a copy would be timed too)", not (k.is_contiguous() and v.is_contiguous())),
        (f"k and v of one shape, got {tuple(k.shape)} and {tuple(v.shape)}", k.shape != v.shape),
        (f"k and v of one dtype, got {k.dtype} and {v.dtype}", k.dtype != v.dtype),
        (f"k and v on one device, got {k.device} and {v.device}", k.device != v.device),
    ):
        if bad:
            raise ValueError(f"read-floor needs {problem}")
    n, cdiv = k.numel(), lambda a, b: -(-a // b)
    programs = max(1, min(FLOOR_PROGRAMS, cdiv(n, FLOOR_BLOCK)))
    chunk = cdiv(cdiv(n, programs), FLOOR_BLOCK) * FLOOR_BLOCK  # elements per program, whole loop steps
    out = torch.empty(programs, dtype=torch.float32, device=k.device)
    # programmatic dependent launch on Hopper, eager calls outside the interpreter (flash_decode's rule)
    from kernels import interpret_enabled

    pdl = k.is_cuda and not interpret_enabled() and torch.cuda.get_device_capability(k.device)[0] >= 9
    opts = dict(num_warps=FLOOR_WARPS, launch_pdl=True) if pdl else dict(num_warps=FLOOR_WARPS)
    _floor_kernel()[(programs,)](k, v, out, n, chunk, BLOCK=FLOOR_BLOCK, USE_PDL=pdl, **opts)
    return out


def provider_fn(name: str):
    """fn(q, k, v) -> o for one decode step (q one row; k/v the whole cache, all of it visible)."""
    if name == "flash-decode":
        from kernels import flash_decode

        return lambda q, k, v: flash_decode(q, k, v)
    if name == "read-floor":
        return read_floor
    if name == "naive":

        def naive(q, k, v):
            g = q.shape[1] // k.shape[1]
            kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            s = torch.matmul(q.float(), kk.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
            return torch.matmul(torch.softmax(s, -1).to(v.dtype), vv)

        return naive
    if name.startswith("sdpa-"):
        return common.sdpa(None if name == "sdpa-auto" else name[5:])
    raise ValueError(f"unknown provider {name!r}; choose from {', '.join(PROVIDERS)}")


def reference(q, k, v) -> torch.Tensor:
    """float32 decode attention of sequence 0, (1, Hq, Nq, d). GQA: the query heads of one KV head are
    rows against that head's k/v (no float32 copy of the cache per query head: 8.6 GB at 131k, d 128)."""
    _, hq, nq, d = q.shape
    hkv = k.shape[1]
    q0 = q[:1].float().reshape(1, hkv, (hq // hkv) * nq, d)  # query head h = hk * group + g
    o = torch.softmax(q0 @ k[:1].float().transpose(-1, -2) / math.sqrt(d), -1) @ v[:1].float()
    return o.reshape(1, hq, nq, d)


def time_call(fn, args: tuple, timer, graph_ms=None) -> dict:
    """``ms``, ``ms_eager`` and ``timing`` of fn(*args): the eager median, then, unless `graph_ms` is None or
    the eager median is >= EAGER_ONLY_MS, ``graph_ms(fn)`` (the CUDA-graph time per call) as ``ms``."""
    ms_eager = timer(lambda: fn(*args))
    if graph_ms is None or ms_eager >= EAGER_ONLY_MS:
        return dict(ms=ms_eager, ms_eager=ms_eager, timing="eager")
    return dict(ms=graph_ms(fn), ms_eager=ms_eager, timing="cuda_graph")


def bench_shape(args, device, timer, dtype, d: int, group: int, b: int, ctx: int) -> list[dict]:
    """Records of every provider for one (d, group, batch, context) decode step."""
    shape = dict(d=d, group=group, batch=b, context=ctx)
    try:
        q, k, v = common.decode_inputs(b, args.kv_heads, group, ctx, d, dtype, device, args.seed)
    except torch.OutOfMemoryError:
        return [dict(shape, provider="*", status="oom")]
    ref = reference(q, k, v)
    math_err = (provider_fn("sdpa-math")(q[:1], k[:1], v[:1]).float() - ref).abs().max().item()
    kv_bytes = 2 * k.numel() * k.element_size()
    copies = []  # the L2-spanning input copies of the graph timing, made at the first graph

    def graph_ms(fn) -> float:
        copies[:] = copies or common.l2_copies(q, k, v)
        return common.graph_ms(fn, copies, timer)

    records, seconds, graphs = [], [], graph_ms if args.graphs and device.type == "cuda" else None
    for p in args.providers:
        t0 = time.perf_counter()
        rec = dict(shape, provider=p, kv_bytes=kv_bytes)
        try:
            fn = provider_fn(p)
            out = fn(q, k, v)
            err = None if p == "read-floor" else (out[:1].float() - ref).abs().max().item()  # no attention
            rec["max_abs_err"] = err
            if err is not None and err > 2 * math_err + 1e-3:
                rec["status"] = f"mismatch: {err:.3g} (sdpa-math {math_err:.3g})"
            else:
                timed = time_call(fn, (q, k, v), timer, graphs)
                rec.update(status="ok", **timed, gbs=kv_bytes / (timed["ms"] * 1e-3) / 1e9)
        except Exception as e:  # noqa: BLE001 - a backend that cannot run (or runs out of memory) is a result
            rec["status"] = common.failure(e)
        records.append(rec)
        seconds.append(f"{p} {time.perf_counter() - t0:.1f}")
        print(json.dumps(rec), flush=True)
    common.log(f"[bench.decode] d={d} group={group} batch={b} context={ctx}: seconds {', '.join(seconds)}")
    return records


def e2e_record(args, device, dtype, backend: str, mode: str, b: int) -> dict:
    """Prefill and decode tokens/sec of `GPT.generate` for one backend, mode (E2E_MODES) and batch."""
    from torch._dynamo.utils import counters

    from model import GPT, PRESETS, GPTConfig

    compiled, graph, static = mode.startswith("compiled"), mode.endswith("graph"), mode != "eager"
    rec = dict(backend=backend, mode=mode, static_decode=static, batch=b)
    rec |= dict(prompt_len=args.prompt_len, new_tokens=args.new_tokens)
    if compiled:
        rec["compile_backend"] = args.compile_backend
    model = None
    try:
        torch.manual_seed(args.seed)
        preset = PRESETS["tiny"] if args.dry_run else PRESETS["gpt2"]
        block = args.prompt_len + args.new_tokens
        cfg = GPTConfig(block_size=block, vocab_size=50304, attention=backend, **preset)
        model = GPT(cfg).to(device=device, dtype=dtype).eval()
        prompt = torch.randint(0, 50257, (b, args.prompt_len), device=device)
        if compiled:
            torch._dynamo.reset()  # a fresh cache per record: no guards left by other models
            model._decode_static = torch.compile(model._decode_static, backend=args.compile_backend)
        kw = dict(temperature=0, static_decode=static, cuda_graph=graph)
        model.generate(prompt, min(E2E_WARMUP_TOKENS, args.new_tokens), **kw)  # compiles, captures
        graphs, t = int(counters["stats"]["unique_graphs"]), {}
        model.generate(prompt, args.new_tokens, timings=t, **kw)
        if compiled:
            rec["recompiles"] = int(counters["stats"]["unique_graphs"]) - graphs
        rec.update(status="ok", prefill_tokens_per_sec=t["prefill_tokens"] / t["prefill_s"])
        rec["decode_tokens_per_sec"] = t["decode_tokens"] / t["decode_s"]
    except Exception as e:  # noqa: BLE001 - a backend or compilation that fails is a result
        rec["status"] = common.failure(e)
    finally:
        del model
        if compiled:
            torch._dynamo.reset()
        free_memory(device)
    return rec


def markdown(meta: dict, kernel: list[dict], e2e: list[dict]) -> str:
    """Kernel sweep (ms / GB/s per provider and shape) and end-to-end generation tables."""
    lines = [f"# Decode benchmark ({meta['device']}, {meta['dtype']})", ""]
    if not meta.get("complete", True):  # files of older runs have no flag: they were written at the end
        lines += [
            f"**Incomplete**: the run stopped (or is still running) after {len(kernel)} kernel and "
            f"{len(e2e)} end-to-end records; missing cells were not measured.",
            "",
        ]
    calls, ceiling = meta.get("graph_calls", 1), meta["copy_ceiling_gbs"]
    eager_only, tail = meta.get("eager_only_ms") if meta.get("graphs") else None, "."
    if eager_only is not None:
        tail = f" (cells marked e: calls of {eager_only:g} ms or more eagerly are not also timed as a graph, "
        tail += "since launch overhead is then a few percent at most and the cache far bigger than the L2)."
    lines += [
        f"Copy ceiling: {ceiling:.0f} GB/s. Cells: ms / GB/s of K/V read (fraction of the ceiling). Where "
        f"the JSON's `timing` says cuda_graph, ms = replay time of one CUDA graph of {calls} back-to-back "
        f"calls / {calls} (kernel time, graph launch shared; the calls cycle through copies of the inputs "
        "spanning twice the L2 cache, so K/V come from HBM; `ms_eager` there: called from Python), else ms "
        f"of eager calls{tail}",
        "",
    ]

    def cell(r: dict | None) -> str:
        if r is None or r.get("status") != "ok":
            return "-" if r is None else r["status"].split(":")[0]
        text = f"{r['ms']:.3f} / {r['gbs']:.0f} ({r['gbs'] / ceiling:.0%})"
        return text + (" e" if eager_only and r.get("timing") == "eager" else "")

    providers = sorted({r["provider"] for r in kernel if r["provider"] != "*"}, key=PROVIDERS.index)
    if kernel:
        index = {(r["d"], r["group"], r["batch"], r["context"], r["provider"]): r for r in kernel}
        shapes = sorted({(r["d"], r["group"], r["batch"], r["context"]) for r in kernel})
        rows = [[*s, *(cell(index.get((*s, p), index.get((*s, "*")))) for p in providers)] for s in shapes]
        lines += common.md_table(["d", "group", "batch", "context", *providers], rows, "---")
    if e2e:
        lines += [
            "",
            "End to end: mode eager = the growing cache view, static = `static_decode=True` (decode_step, "
            "eager), compiled = static with `torch.compile(model._decode_static)` (sample.py "
            "`compile=true`), graph / compiled-graph = the static / compiled step replayed as one CUDA "
            "graph (sample.py `cuda_graph=true`).",
            "",
        ]
        rows = []
        for r in e2e:
            cb, n, speed = r.get("compile_backend"), r.get("recompiles"), [r["status"], ""]
            note = [f"torch.compile backend {cb!r} (dry run: no Inductor)"] if cb and cb != "inductor" else []
            note += [f"{n} graph(s) compiled inside the timed run"] if n else []
            if r["status"] == "ok":
                speed = [f"{r['prefill_tokens_per_sec']:.0f}", f"{r['decode_tokens_per_sec']:.0f}"]
            mode = r.get("mode", "static" if r["static_decode"] else "eager")  # older files: no mode
            rows.append([r["backend"], mode, r["batch"], *speed, "; ".join(note)])
        head = ["backend", "mode", "batch", "prefill tok/s", "decode tok/s", "note"]
        lines += common.md_table(head, rows, "---")
    return "\n".join(lines) + "\n"


def rewrite_report(path: Path) -> str:
    """Rewrite the markdown beside a bench.decode results JSON (`--report`); ValueError naming the problem."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:  # missing, a directory, not JSON
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict) or not {"meta", "kernel", "e2e"} <= data.keys():
        raise ValueError(f"{path} is not a bench.decode results file (no meta, kernel and e2e)")
    try:
        report = markdown(data["meta"], data["kernel"], data["e2e"])
    except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
        message = f"{path}: records or meta not as bench.decode writes them ({type(e).__name__}: {e})"
        raise ValueError(message) from e
    common.write_text(path.with_suffix(".md"), report)
    return report


def main(argv=None) -> int:
    raw = argparse.RawDescriptionHelpFormatter  # --help shows the module docstring as written
    ap = argparse.ArgumentParser(prog="python -m bench.decode", description=__doc__, formatter_class=raw)
    add = ap.add_argument
    add("--contexts", type=common.ints(), help="comma list (GPU default: 1024 .. 131072)")
    add("--batches", type=common.ints(), help="comma list (GPU default: 1,16,64)")
    add("--dims", type=common.ints(), help="comma list of d (GPU default: 64,128)")
    add("--groups", type=common.ints(), help="query heads per KV head (GPU default: 1,4,8)")
    add("--kv-heads", type=common.positive, help="KV heads (GPU default: 8)")
    add("--providers", type=common.choices(PROVIDERS, unique=True), default=list(PROVIDERS))
    add("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    add("--seed", type=int, default=0)
    add("--e2e", action="store_true", help="also time GPT-2 124M generation end to end")
    add("--e2e-only", action="store_true")
    add("--e2e-backends", type=common.choices(("naive", "sdpa", "flash")), default=["sdpa", "flash"])
    add("--prompt-len", type=common.positive, help="GPU default: 512")
    add("--new-tokens", type=common.positive, help="GPU default: 256")
    add("--compile-backend", help="torch.compile backend of the compiled modes (inductor; dry run: eager)")
    add("--copy-bytes", type=int, default=2 << 30)
    add("--warmup-ms", type=int, default=10, help="do_bench warm-up per timing (GPU)")
    add("--rep-ms", type=int, default=40, help="do_bench repetition time per timing (GPU)")
    add("--graphs", action=argparse.BooleanOptionalAction, default=True, help="CUDA-graph timing (GPU)")
    add("--dry-run", action="store_true", help="CPU plumbing check: tiny shapes, fp32, 1 rep")
    add("--out", help="output directory (bench/results; --dry-run: outputs/bench)")
    add("--tag")
    add("--report", metavar="JSON", help="only rewrite the markdown of a results file")
    args = ap.parse_args(argv)
    if args.report is not None:
        try:
            print(rewrite_report(Path(args.report)))
        except ValueError as e:
            return common.error(f"--report: {e}")
        return 0
    for key, value in (DRY_GRID if args.dry_run else GPU_GRID).items():
        setattr(args, key, getattr(args, key) or value)  # what the user did not give (numbers are >= 1)
    if args.dry_run:
        device, dtype = torch.device("cpu"), torch.float32
        args.copy_bytes = min(args.copy_bytes, 1 << 22)
        timer = Timer(device, cpu_reps=1)
    elif not torch.cuda.is_available():
        return common.error("bench.decode times CUDA kernels and needs a GPU; use --dry-run on a CPU")
    else:
        device, dtype = torch.device("cuda"), common.DTYPES[args.dtype]
        timer = Timer(device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, slow_ms=TIMER_SLOW_MS)
    env = common.environment(device)
    src = torch.empty(args.copy_bytes // 2, dtype=torch.float16, device=device).normal_()
    dst = [torch.empty_like(src)]
    ceiling = 2 * args.copy_bytes / (timer(lambda: dst[0].copy_(src)) * 1e-3) / 1e9  # read + written
    src = dst = None  # 2 GiB on the GPU: gone before the sweep
    meta = dict(device=env["gpu"] or platform.processor() or "cpu", dtype=str(dtype)[6:], torch=env["torch"])
    meta |= dict(triton=env["triton"], time=env["date"], argv=sys.argv[1:] if argv is None else list(argv))
    graphs = bool(args.graphs and device.type == "cuda")
    meta |= dict(copy_ceiling_gbs=ceiling, graph_calls=GRAPH_CALLS, graphs=graphs)
    meta |= dict(eager_only_ms=EAGER_ONLY_MS, timer=timer.describe(), complete=False)
    # an --e2e-only run has its own default file: it must not replace the kernel sweep's results
    tag = args.tag or ("dryrun" if args.dry_run else "h200") + ("_e2e" if args.e2e_only else "")
    out = Path(args.out or ("outputs/bench" if args.dry_run else "bench/results"))
    results = common.Results(out / f"decode_{tag}.json", meta, markdown, kernel=[], e2e=[])
    results.save()
    if not args.e2e_only:
        for d, group, b, ctx in itertools.product(args.dims, args.groups, args.batches, args.contexts):
            results.add("kernel", bench_shape(args, device, timer, dtype, d, group, b, ctx))
            free_memory(device)
    if args.e2e or args.e2e_only:
        for backend, mode, b in itertools.product(args.e2e_backends, E2E_MODES, args.batches):
            if mode.endswith("graph") and device.type != "cuda":
                continue  # CUDA graphs: nothing to time on a CPU
            t0 = time.perf_counter()
            results.add("e2e", [rec := e2e_record(args, device, dtype, backend, mode, b)])
            print(json.dumps(rec), flush=True)
            common.log(f"[bench.decode] e2e {backend} {mode} batch={b}: {time.perf_counter() - t0:.1f} s")
    print(results.save(complete=True))
    # the plumbing check exists to run our kernel: its failure fails the check
    ours = [r for r in results.lists["kernel"] if r["provider"] == "flash-decode"]
    ours += [r for r in results.lists["e2e"] if r.get("backend") == "flash"]
    if args.dry_run and (bad := [r for r in ours if r.get("status") != "ok"]):
        return common.error(f"dry run: {len(bad)} flash record(s) failed, first: {bad[0].get('status')}", 1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
