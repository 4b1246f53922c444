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
import torch.nn.functional as F

from bench import common
from bench.common import DECODE_PROVIDERS as PROVIDERS
from bench.common import GRAPH_CALLS, Timer, free_memory

EAGER_ONLY_MS = 1.0  # eager medians this long are not also timed as a graph
TIMER_SLOW_MS = 10.0  # Timer.slow_ms of the kernel sweep: such calls are timed as the median of 3
E2E_MODES = ("eager", "static", "compiled", "graph", "compiled-graph")
E2E_WARMUP_TOKENS = 4  # the warm-up generation: the prefill and the first decode steps (which compile)
GPU_GRID = dict(contexts=[1024 << i for i in range(8)], batches=[1, 16, 64], dims=[64, 128], groups=[1, 4, 8])
GPU_GRID |= dict(kv_heads=8, prompt_len=512, new_tokens=256)
DRY_GRID = dict(
    contexts=[40, 100], batches=[1, 2], dims=[16], groups=[1, 4], kv_heads=2, prompt_len=4, new_tokens=3
)


def provider_fn(name: str):
    """fn(q, k, v) -> o for one decode step (q one row; k/v the whole cache, all of it visible)."""
    if name == "flash-decode":
        from kernels import flash_decode

        return lambda q, k, v: flash_decode(q, k, v)
    if name == "read-floor":
        return common.read_floor
    if name == "naive":

        def naive(q, k, v):
            g = q.shape[1] // k.shape[1]
            kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            s = torch.matmul(q.float(), kk.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
            return torch.matmul(torch.softmax(s, -1).to(v.dtype), vv)

        return naive
    if name.startswith("sdpa-"):
        from torch.nn.attention import sdpa_kernel

        backends = [common.sdpa_backend(name[5:])] if name != "sdpa-auto" else None

        def sdpa(q, k, v):
            gqa = q.shape[1] != k.shape[1]
            if backends is None:
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
            with sdpa_kernel(backends):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)

        return sdpa
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
    gen = torch.Generator(device=device).manual_seed(args.seed)
    hkv, shape = args.kv_heads, dict(d=d, group=group, batch=b, context=ctx)
    try:
        q = torch.randn(b, hkv * group, 1, d, device=device, dtype=dtype, generator=gen)
        k, v = (torch.randn(b, hkv, ctx, d, device=device, dtype=dtype, generator=gen) for _ in range(2))
    except torch.OutOfMemoryError:
        return [dict(shape, provider="*", status="oom")]
    ref = reference(q, k, v)
    math_err = (provider_fn("sdpa-math")(q[:1], k[:1], v[:1]).float() - ref).abs().max().item()
    kv_bytes = 2 * k.numel() * k.element_size()
    copies = []  # the L2-spanning input copies of the graph timing, made at the first graph

    def graph_ms(fn) -> float:
        copies[:] = copies or common.l2_copies(q, k, v, kv_bytes)
        return common.graph_ms(fn, copies, timer)

    records, seconds = [], []
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
                graphs = graph_ms if args.graphs and device.type == "cuda" else None
                timed = time_call(fn, (q, k, v), timer, graphs)
                rec.update(status="ok", **timed, gbs=kv_bytes / (timed["ms"] * 1e-3) / 1e9)
        except torch.OutOfMemoryError:
            rec["status"] = "oom"
        except Exception as e:  # noqa: BLE001 - a backend that cannot run is a result
            rec["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
        records.append(rec)
        seconds.append(f"{p} {time.perf_counter() - t0:.1f}")
        print(json.dumps(rec), flush=True)
    print(
        f"[bench.decode] d={d} group={group} batch={b} context={ctx}: seconds " + ", ".join(seconds),
        file=sys.stderr,
    )
    return records


def e2e_sweep(args, device, dtype, on_record) -> None:
    """Generation tokens/sec per backend, mode (E2E_MODES) and batch; on_record(rec) after each."""
    from torch._dynamo.utils import counters

    from model import GPT, PRESETS, GPTConfig

    preset = PRESETS["tiny"] if args.dry_run else PRESETS["gpt2"]
    for backend in args.e2e_backends:
        for mode in E2E_MODES:
            for b in args.batches:
                compiled, graph, static = mode.startswith("compiled"), mode.endswith("graph"), mode != "eager"
                if graph and device.type != "cuda":
                    continue  # CUDA graphs: nothing to time on a CPU
                t0 = time.perf_counter()
                rec = dict(backend=backend, mode=mode, static_decode=static, batch=b)
                rec |= dict(prompt_len=args.prompt_len, new_tokens=args.new_tokens)
                if compiled:
                    rec["compile_backend"] = args.compile_backend
                model = None
                try:
                    torch.manual_seed(args.seed)
                    cfg = GPTConfig(
                        block_size=args.prompt_len + args.new_tokens,
                        vocab_size=50304,
                        attention=backend,
                        **preset,
                    )
                    model = GPT(cfg).to(device=device, dtype=dtype).eval()
                    prompt = torch.randint(0, 50257, (b, args.prompt_len), device=device)
                    if compiled:
                        torch._dynamo.reset()  # a fresh cache per record: no guards left by other models
                        model._decode_static = torch.compile(
                            model._decode_static, backend=args.compile_backend
                        )
                    kw = dict(temperature=0, static_decode=static, cuda_graph=graph)
                    model.generate(
                        prompt, min(E2E_WARMUP_TOKENS, args.new_tokens), **kw
                    )  # compiles, captures
                    graphs, t = int(counters["stats"]["unique_graphs"]), {}
                    model.generate(prompt, args.new_tokens, timings=t, **kw)
                    if compiled:
                        rec["recompiles"] = int(counters["stats"]["unique_graphs"]) - graphs
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
                print(json.dumps(rec), flush=True)
                print(
                    f"[bench.decode] e2e {backend} {mode} batch={b}: {time.perf_counter() - t0:.1f} s",
                    file=sys.stderr,
                )
                on_record([rec])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.decode",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--contexts", type=common.ints(), help="comma list (GPU default: 1024 .. 131072)")
    ap.add_argument("--batches", type=common.ints(), help="comma list (GPU default: 1,16,64)")
    ap.add_argument("--dims", type=common.ints(), help="comma list of d (GPU default: 64,128)")
    ap.add_argument("--groups", type=common.ints(), help="query heads per KV head (GPU default: 1,4,8)")
    ap.add_argument("--kv-heads", type=common.positive, help="KV heads (GPU default: 8)")
    ap.add_argument("--providers", type=common.choices(PROVIDERS, unique=True), default=list(PROVIDERS))
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--e2e", action="store_true", help="also time GPT-2 124M generation end to end")
    ap.add_argument("--e2e-only", action="store_true")
    ap.add_argument(
        "--e2e-backends", type=common.choices(("naive", "sdpa", "flash")), default=["sdpa", "flash"]
    )
    ap.add_argument("--prompt-len", type=common.positive, help="GPU default: 512")
    ap.add_argument("--new-tokens", type=common.positive, help="GPU default: 256")
    ap.add_argument(
        "--compile-backend", help="torch.compile backend of the compiled modes (inductor; dry run: eager)"
    )
    ap.add_argument("--copy-bytes", type=int, default=2 << 30)
    ap.add_argument("--warmup-ms", type=int, default=10, help="do_bench warm-up per timing (GPU)")
    ap.add_argument("--rep-ms", type=int, default=40, help="do_bench repetition time per timing (GPU)")
    ap.add_argument(
        "--graphs", action=argparse.BooleanOptionalAction, default=True, help="CUDA-graph timing (GPU)"
    )
    ap.add_argument("--dry-run", action="store_true", help="CPU plumbing check: tiny shapes, fp32, 1 rep")
    ap.add_argument("--out", help="output directory (bench/results; --dry-run: outputs/bench)")
    ap.add_argument("--tag")
    ap.add_argument("--report", metavar="JSON", help="only rewrite the markdown of a results file")
    args = ap.parse_args(argv)
    if args.report is not None:
        try:
            print(common.rewrite_decode_report(Path(args.report)))
        except ValueError as e:
            print(f"error: --report: {e}", file=sys.stderr)
            return 2
        return 0
    for key, value in (DRY_GRID if args.dry_run else GPU_GRID).items():
        if getattr(args, key) is None:  # what the user did not give
            setattr(args, key, value)
    args.compile_backend = args.compile_backend or ("eager" if args.dry_run else "inductor")
    if args.dry_run:
        device, dtype = torch.device("cpu"), torch.float32
        args.copy_bytes = min(args.copy_bytes, 1 << 22)
        timer = Timer(device, cpu_reps=1)
    elif not torch.cuda.is_available():
        print(
            "error: bench.decode times CUDA kernels and needs a GPU; use --dry-run on a CPU", file=sys.stderr
        )
        return 2
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
    meta |= dict(
        copy_ceiling_gbs=ceiling, graph_calls=GRAPH_CALLS, graphs=bool(args.graphs and device.type == "cuda")
    )
    meta |= dict(eager_only_ms=EAGER_ONLY_MS, timer=timer.describe(), complete=False)
    # an --e2e-only run has its own default file: it must not replace the kernel sweep's results
    tag = args.tag or ("dryrun" if args.dry_run else "h200") + ("_e2e" if args.e2e_only else "")
    out = Path(args.out or ("outputs/bench" if args.dry_run else "bench/results"))
    results = common.Results(out / f"decode_{tag}.json", meta, common.decode_markdown, kernel=[], e2e=[])
    results.save()
    if not args.e2e_only:
        for d in args.dims:
            for group in args.groups:
                for b in args.batches:
                    for ctx in args.contexts:
                        results.add("kernel", bench_shape(args, device, timer, dtype, d, group, b, ctx))
                        free_memory(device)
    if args.e2e or args.e2e_only:
        e2e_sweep(args, device, dtype, lambda recs: results.add("e2e", recs))
    print(results.save(complete=True))
    if args.dry_run:  # the plumbing check exists to run our kernel: its failure fails the check
        bad = [
            r for r in results.lists["kernel"] if r["provider"] == "flash-decode" and r.get("status") != "ok"
        ]
        bad += [r for r in results.lists["e2e"] if r.get("backend") == "flash" and r.get("status") != "ok"]
        if bad:
            print(
                f"error: dry run: {len(bad)} flash record(s) failed, first: {bad[0].get('status')}",
                file=sys.stderr,
            )
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
