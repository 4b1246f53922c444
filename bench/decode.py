"""Decode-step attention benchmark: flash-decoding against naive and every SDPA backend, and end-to-end
generation tokens/sec. H200 figures: bench/results/decode_h200.md (re-measure after kernel or timing changes).

Usage (GPU)::

    python -m bench.decode                                   # full sweep, bf16, writes bench/results/
    python -m bench.decode --contexts 8192,32768 --batches 1,16 --dims 128 --groups 4
    python -m bench.decode --e2e --batches 1,16              # GPT-2 124M generation tokens/sec
    TRITON_INTERPRET=1 python -m bench.decode --dry-run      # CPU plumbing check (outputs/bench/)

Kernel sweep: one decode step, q (B, Hq, 1, d) against a full cache k/v (B, Hkv, L, d) with
Hkv = ``--kv-heads`` (default 8) and Hq = group x Hkv, for context L in ``--contexts``, batch in
``--batches``, d in ``--dims``, group in ``--groups``. Providers: ``flash-decode``
(kernels.flash_decode), ``naive`` (float32 scores, k/v repeated for GQA), and
``sdpa-<auto|flash|cudnn|efficient|math>`` (SDPA pinned, ``enable_gqa=True``). Each is first checked
against a float32 reference on sequence 0 (status ``mismatch`` and not timed when off by more than 2x
the SDPA-math error + 1e-3), then timed (``bench._timing.Timer``: do_bench median on CUDA), twice on a
GPU: ``ms_eager`` calls the provider from Python each time (its host time included whenever the host is
slower than the kernel); ``ms`` is the replay time of one CUDA graph holding ``GRAPH_CALLS`` (20)
back-to-back calls (each call's output overwritten by the next), divided by
``GRAPH_CALLS`` (``--no-graphs`` to skip). That is how a serving loop or
``torch.compile(mode="reduce-overhead")`` runs a decode step, one graph holding every layer's attention
call: kernel time only, the same for every provider, with the graph-launch overhead (several us)
shared by the 20 calls instead of added to each, as a step shares it among its layers. Like a step's
layers, consecutive calls read different K/V: the calls cycle through enough copies of q, k, v to span
twice the L2 cache (``_l2_copies``), so a small cache is read from HBM, not from L2 left warm by the
call before. The tables and the bandwidth use ``ms``.
Achieved K/V read bandwidth = 2 * B * Hkv * L * d * bytes / time, against the copy ceiling measured
here (``torch.Tensor.copy_`` of a 2 GiB buffer: bytes read + written / time).

End to end (``--e2e``): randomly initialised GPT-2 124M, a ``--prompt-len`` prompt, ``--new-tokens`` greedy
tokens, per backend and batch, reporting prefill and decode tokens/sec from ``GPT.generate(timings=...)``.

Outputs in ``--out``: ``decode_<tag>.json`` and ``decode_<tag>.md`` (also printed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from bench._attention_report import compact_json
from bench._providers import sdpa_backend
from bench._timing import Timer

PROVIDERS = ("flash-decode", "naive", "sdpa-auto", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def provider_fn(name: str):
    """fn(q, k, v) -> o for one decode step (q one row; k/v the whole cache, all of it visible)."""
    if name == "flash-decode":
        from kernels import flash_decode

        return lambda q, k, v: flash_decode(q, k, v)
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
    """float32 decode attention of sequence 0 (all cache slots visible), GQA by repeating k/v."""
    g = q.shape[1] // k.shape[1]
    q0, k0, v0 = q[:1].float(), k[:1].float().repeat_interleave(g, 1), v[:1].float().repeat_interleave(g, 1)
    return torch.softmax(q0 @ k0.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ v0


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
    for p in args.providers.split(","):
        rec = dict(d=d, group=group, batch=b, context=ctx, provider=p, kv_bytes=kv_bytes)
        try:
            fn = provider_fn(p)
            err = (fn(q, k, v)[:1].float() - ref).abs().max().item()
            rec["max_abs_err"] = err
            if err > 2 * math_err + 1e-3:
                rec["status"] = f"mismatch: {err:.3g} (sdpa-math {math_err:.3g})"
            else:
                ms = ms_eager = timer(lambda fn=fn: fn(q, k, v))
                if args.graphs and device.type == "cuda":
                    copies = copies or _l2_copies(q, k, v, kv_bytes)
                    graph = _captured(fn, copies)
                    ms = timer(graph.replay) / GRAPH_CALLS
                    del graph
                rec.update(
                    status="ok",
                    ms=ms,
                    ms_eager=ms_eager,
                    gbs=kv_bytes / (ms * 1e-3) / 1e9,
                    timing="cuda_graph" if ms is not ms_eager else "eager",
                )
        except torch.OutOfMemoryError:
            rec["status"] = "oom"
        except Exception as e:  # noqa: BLE001 - a backend that cannot run is a result
            rec["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
        records.append(rec)
        print(json.dumps(rec), flush=True)
    return records


def kernel_sweep(args, device, timer, dtype) -> list[dict]:
    records = []
    for d in _ints(args.dims):
        for group in _ints(args.groups):
            for b in _ints(args.batches):
                for ctx in _ints(args.contexts):
                    records += bench_shape(args, device, timer, dtype, d, group, b, ctx)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    return records


def e2e_sweep(args, device, dtype) -> list[dict]:
    from model import GPT, PRESETS, GPTConfig

    records = []
    preset = PRESETS["tiny"] if args.dry_run else PRESETS["gpt2"]
    block = args.prompt_len + args.new_tokens
    for backend in args.e2e_backends.split(","):
        for static in (False, True):
            for b in _ints(args.batches):
                torch.manual_seed(args.seed)
                model = GPT(GPTConfig(block_size=block, vocab_size=50304, attention=backend, **preset))
                model = model.to(device=device, dtype=dtype).eval()
                prompt = torch.randint(0, 50257, (b, args.prompt_len), device=device)
                t: dict = {}
                rec = dict(
                    backend=backend,
                    static_decode=static,
                    batch=b,
                    prompt_len=args.prompt_len,
                    new_tokens=args.new_tokens,
                )
                try:
                    model.generate(prompt, 2, temperature=0, static_decode=static)  # warm-up
                    model.generate(prompt, args.new_tokens, temperature=0, static_decode=static, timings=t)
                    rec.update(
                        status="ok",
                        prefill_tokens_per_sec=t["prefill_tokens"] / t["prefill_s"],
                        decode_tokens_per_sec=t["decode_tokens"] / t["decode_s"],
                    )
                except Exception as e:  # noqa: BLE001
                    rec["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
                records.append(rec)
                print(json.dumps(rec), flush=True)
    return records


def markdown(meta: dict, kernel: list[dict], e2e: list[dict]) -> str:
    lines = [
        f"# Decode benchmark ({meta['device']}, {meta['dtype']})",
        "",
        f"Copy ceiling: {meta['copy_ceiling_gbs']:.0f} GB/s. Cells: ms / GB/s of K/V read "
        "(fraction of the ceiling). Where the JSON's `timing` says cuda_graph, ms = replay time of one "
        f"CUDA graph of {meta.get('graph_calls', 1)} back-to-back calls / {meta.get('graph_calls', 1)} "
        "(kernel time, graph launch shared; the calls cycle through copies of the inputs spanning twice "
        "the L2 cache, so K/V come from HBM; `ms_eager` there: called from Python), else ms of eager calls.",
        "",
    ]
    providers = sorted({r["provider"] for r in kernel if r["provider"] != "*"}, key=PROVIDERS.index)
    if kernel:
        lines += [
            "| d | group | batch | context | " + " | ".join(providers) + " |",
            "|---|---|---|---|" + "---|" * len(providers),
        ]
        keys = sorted({(r["d"], r["group"], r["batch"], r["context"]) for r in kernel})
        for key in keys:
            cells = []
            for p in providers:
                r = next(
                    (
                        r
                        for r in kernel
                        if (r["d"], r["group"], r["batch"], r["context"]) == key and r["provider"] in (p, "*")
                    ),
                    None,
                )
                if r is None or r.get("status") != "ok":
                    cells.append(r["status"].split(":")[0] if r else "-")
                else:
                    frac = r["gbs"] / meta["copy_ceiling_gbs"]
                    cells.append(f"{r['ms']:.3f} / {r['gbs']:.0f} ({frac:.0%})")
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | " + " | ".join(cells) + " |")
    if e2e:
        lines += [
            "",
            "| backend | static decode | batch | prefill tok/s | decode tok/s |",
            "|---|---|---|---|---|",
        ]
        for r in e2e:
            if r["status"] == "ok":
                lines.append(
                    f"| {r['backend']} | {r['static_decode']} | {r['batch']} | "
                    f"{r['prefill_tokens_per_sec']:.0f} | {r['decode_tokens_per_sec']:.0f} |"
                )
            else:
                lines.append(f"| {r['backend']} | {r['static_decode']} | {r['batch']} | {r['status']} | |")
    return "\n".join(lines) + "\n"


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
    ap.add_argument("--copy-bytes", type=int, default=2 << 30)
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
    args = ap.parse_args(argv)
    for key, value in (DRY_RUN_SHAPES if args.dry_run else GPU_SHAPES).items():
        if getattr(args, key) is None:  # what the user did not give
            setattr(args, key, value)
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
        timer = Timer(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    meta = dict(
        device=name,
        dtype=str(dtype)[6:],
        torch=torch.__version__,
        time=datetime.datetime.now().isoformat(),
        argv=sys.argv[1:] if argv is None else list(argv),
        copy_ceiling_gbs=copy_ceiling_gbs(device, timer, args.copy_bytes),
        graph_calls=GRAPH_CALLS,  # calls per captured graph behind `ms` (timing cuda_graph)
    )
    kernel = [] if args.e2e_only else kernel_sweep(args, device, timer, dtype)
    e2e = e2e_sweep(args, device, dtype) if (args.e2e or args.e2e_only) else []
    tag = args.tag or ("dryrun" if args.dry_run else "h200")
    out = Path(args.out or ("outputs/bench" if args.dry_run else "bench/results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"decode_{tag}.json").write_text(compact_json(dict(meta=meta, kernel=kernel, e2e=e2e)))
    report = markdown(meta, kernel, e2e)
    (out / f"decode_{tag}.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
