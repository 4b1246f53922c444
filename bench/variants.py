"""Benchmark of the attention variants: sliding window and document masks, our flash kernels
against full causal and against FlexAttention with the same masks.

For each mask (causal; window w = 256, 1024, 4096; documents of random lengths), N (8k .. 64k) and mode
(fwd, fwd+bwd) it times ``kernels.flash_attention(..., window= / doc_ids=)`` and
``torch.nn.attention.flex_attention.flex_attention`` (compiled) with the equivalent ``create_block_mask``
mask, B * N = --tokens tokens per call (B = tokens // N), H heads of dim d, bf16. Reported: median ms
(``triton.testing.do_bench``), effective TFLOP/s over the visible (i, j) pairs only (4 * d flops per pair
forward, 2.5x that for fwd+bwd: FlashAttention-2's counting), the speed-up over full causal flash at the
same N, and flash / flex (> 1: flash faster). Writes ``variants_<tag>.json`` and ``variants_<tag>.md`` to
--out. The issue's bar: at N = 32k, w = 1024 fwd+bwd >= 8x faster than full causal and >= FlexAttention.

    python -m bench.variants --out bench/results                       # H200 (the lead runs it)
    python -m bench.variants --dry-run --out /tmp/v                    # CPU plumbing check (interpreter)

--dry-run: tiny shapes on the CPU, flash under TRITON_INTERPRET=1, FlexAttention eager; numbers meaningless.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

DOC_MEAN = 2048  # mean document length (tokens) of the random document masks


def doc_ids_for(b: int, n: int, mean: int, seed: int):
    """(b, n) int32 non-decreasing document ids, lengths ~ exponential(mean) (at least 1), seeded."""
    import torch

    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(b, n, generator=g) < 1.0 / mean
    starts[:, 0] = True
    return (starts.cumsum(-1) - 1).to(torch.int32)


def visible_pairs(mask: str, n: int, doc_ids=None) -> int:
    """Number of (query, key) pairs the mask keeps, summed over the batch (doc_ids: (B, N)) or for one
    sequence (causal / window)."""
    if mask == "causal":
        return n * (n + 1) // 2
    if mask.startswith("window"):
        w = int(mask[len("window") :])
        w = min(w, n)
        return w * (w + 1) // 2 + (n - w) * w
    import torch

    total = 0
    for row in doc_ids:
        lengths = torch.unique_consecutive(row, return_counts=True)[1].to(torch.int64)
        total += int((lengths * (lengths + 1) // 2).sum())
    return total


def make_flex(mask: str, n: int, doc_ids, device, b: int, h: int, compiled: bool):
    """(attn(q, k, v) -> o) with FlexAttention and the block mask of `mask`."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if mask == "causal":

        def mask_mod(bi, hi, qi, ki):
            return qi >= ki
    elif mask.startswith("window"):
        w = int(mask[len("window") :])

        def mask_mod(bi, hi, qi, ki):
            return (qi >= ki) & (qi - ki < w)
    else:
        docs = doc_ids.to(device)

        def mask_mod(bi, hi, qi, ki):
            return (qi >= ki) & (docs[bi, qi] == docs[bi, ki])

    block = create_block_mask(mask_mod, b, None, n, n, device=str(device))
    if compiled:
        # a fresh Dynamo cache per cell: torch.compile(flex_attention) shares one code object across
        # cells, and past Dynamo's recompile limit (8) it silently falls back to eager flex, which
        # materialises the B*H*N^2 scores (measured: out of memory from N = 16k on the H200)
        torch._dynamo.reset()
    fn = torch.compile(flex_attention) if compiled else flex_attention
    return lambda q, k, v: fn(q, k, v, block_mask=block)


def make_flash(mask: str, doc_ids):
    from kernels import flash_attention

    if mask == "causal":
        return lambda q, k, v: flash_attention(q, k, v, causal=True)
    if mask.startswith("window"):
        w = int(mask[len("window") :])
        return lambda q, k, v: flash_attention(q, k, v, causal=True, window=w)
    return lambda q, k, v: flash_attention(q, k, v, causal=True, doc_ids=doc_ids)


def time_ms(fn, dry_run: bool, reps: int = 3) -> float:
    """Median ms: triton.testing.do_bench on the GPU, time.perf_counter on the CPU (dry run)."""
    if not dry_run:
        import triton

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def bench_one(provider: str, mask: str, n: int, mode: str, args, device) -> dict:
    """Time one (provider, mask, N, mode) cell; failures become a status, not an exception."""
    import torch

    b = max(1, args.tokens // n)
    h, d = args.heads, args.head_dim
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    q, k, v, do = (torch.randn(b, h, n, d, generator=g).to(device=device, dtype=dtype) for _ in range(4))
    doc_ids = doc_ids_for(b, n, args.doc_mean, args.seed).to(device) if mask == "docs" else None
    pairs = visible_pairs(mask, n, doc_ids) * (1 if mask == "docs" else b)
    rec = dict(
        provider=provider,
        mask=mask,
        n=n,
        mode=mode,
        b=b,
        h=h,
        d=d,
        visible_pairs=pairs,
        doc_mean=args.doc_mean if mask == "docs" else None,
    )
    if provider == "flex" and mode == "fwd+bwd" and device.type == "cpu":
        rec.update(status="skipped: FlexAttention has no CPU backward", ms=None, tflops=None)
        return rec
    try:
        attn = (
            make_flash(mask, doc_ids)
            if provider == "flash"
            else make_flex(mask, n, doc_ids, device, b, h, compiled=not args.dry_run)
        )
        if mode == "fwd":
            with torch.no_grad():
                ms = time_ms(lambda: attn(q, k, v), args.dry_run)
        else:
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

            def step():
                for t in (qg, kg, vg):
                    t.grad = None
                attn(qg, kg, vg).backward(do)

            ms = time_ms(step, args.dry_run)
        flops = 4.0 * d * pairs * h * (2.5 if mode == "fwd+bwd" else 1.0)
        rec.update(status="ok", ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
    except Exception as e:  # OOM, a compile failure: record and go on
        rec.update(status=f"{type(e).__name__}: {str(e)[:200]}", ms=None, tflops=None)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rec


def markdown(records: list[dict], meta: dict) -> str:
    idx = {(r["provider"], r["mask"], r["n"], r["mode"]): r for r in records}
    lines = [
        f"# Attention variants: {meta['device']}",
        "",
        f"B * N = {meta['tokens']} tokens, H = {meta['heads']}, d = {meta['head_dim']}, "
        f"{meta['dtype']}; documents: random lengths, mean {meta['doc_mean']}; median ms "
        "(triton.testing.do_bench); TF/s over the visible pairs only.",
        "",
    ]
    if meta.get("dry_run"):
        lines += ["**Dry run** (CPU, Triton interpreter): the numbers are meaningless.", ""]
    if meta.get("complete") is False:
        lines += [
            f"**Incomplete**: stopped (time limit) after {len(records)} cells; — = not measured.",
            "",
        ]
    lines += [
        "| mask | N | mode | flash ms | flash TF/s | flex ms | flash / flex | vs full causal (flash) |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]

    def fmt(x, spec):
        return "—" if x is None else format(x, spec)

    for mask in meta["masks"]:
        for n in meta["ns"]:
            for mode in meta["modes"]:
                f, x = idx.get(("flash", mask, n, mode)), idx.get(("flex", mask, n, mode))
                c = idx.get(("flash", "causal", n, mode))
                fm, xm = (f or {}).get("ms"), (x or {}).get("ms")
                cm = (c or {}).get("ms")
                ratio = xm / fm if fm and xm else None
                speedup = f"{cm / fm:.2f}x" if fm and cm else "—"
                tf = (f or {}).get("tflops")
                lines.append(
                    f"| {mask} | {n} | {mode} | {fmt(fm, '.3f')} | {fmt(tf, '.0f')} "
                    f"| {fmt(xm, '.3f')} | {fmt(ratio, '.2f')} | {speedup} |"
                )
    bar = (
        idx.get(("flash", "window1024", 32768, "fwd+bwd")),
        idx.get(("flash", "causal", 32768, "fwd+bwd")),
        idx.get(("flex", "window1024", 32768, "fwd+bwd")),
    )
    if all(r and r.get("ms") for r in bar):
        speed, vs_flex = bar[1]["ms"] / bar[0]["ms"], bar[2]["ms"] / bar[0]["ms"]
        ok = speed >= 8 and vs_flex >= 1
        lines += [
            "",
            f"Bar (N = 32k, w = 1024, fwd+bwd): {speed:.1f}x faster than full causal (need >= 8), "
            f"{vs_flex:.2f}x FlexAttention (need >= 1): {'met' if ok else 'NOT met'}.",
        ]
    failed = [r for r in records if r["status"] != "ok" and not r["status"].startswith("skipped")]
    if failed:
        lines += ["", "Failed cells:"] + [
            f"- {r['provider']} {r['mask']} N={r['n']} {r['mode']}: {r['status']}" for r in failed
        ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.variants",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out",
        default=None,
        help="output directory (JSON + markdown; default bench/results, outputs/bench for --dry-run)",
    )
    p.add_argument("--dry-run", action="store_true", help="tiny CPU run under the Triton interpreter")
    p.add_argument("--ns", type=int, nargs="+", default=None, help="sequence lengths (default 8k..64k)")
    p.add_argument("--windows", type=int, nargs="+", default=None, help="window sizes (256 1024 4096)")
    p.add_argument("--tokens", type=int, default=None, help="B * N per call (default 65536)")
    p.add_argument("--heads", type=int, default=None, help="H (default 16)")
    p.add_argument("--head-dim", type=int, default=None, help="d (default 64)")
    p.add_argument("--doc-mean", type=int, default=None, help=f"mean document length ({DOC_MEAN})")
    p.add_argument("--providers", nargs="+", default=["flash", "flex"], choices=["flash", "flex"])
    p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default=None, help="file name tag (default: h200 / the GPU name / dryrun)")
    args = p.parse_args(argv)
    dry = args.dry_run
    args.out = args.out or ("outputs/bench" if dry else "bench/results")
    args.ns = args.ns or ([64] if dry else [8192, 16384, 32768, 65536])
    args.windows = args.windows or ([16] if dry else [256, 1024, 4096])
    args.tokens = args.tokens or (192 if dry else 65536)
    args.heads = args.heads or (2 if dry else 16)
    args.head_dim = args.head_dim or (16 if dry else 64)
    args.doc_mean = args.doc_mean or (24 if dry else DOC_MEAN)
    if dry:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    if not dry and not torch.cuda.is_available():
        print(
            "error: bench.variants times CUDA kernels and needs a CUDA GPU; on a CPU use --dry-run",
            file=sys.stderr,
        )
        return 2
    device = torch.device("cpu" if dry else "cuda")
    masks = ["causal"] + [f"window{w}" for w in args.windows] + ["docs"]
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    tag = args.tag or ("dryrun" if dry else ("h200" if "H200" in gpu else gpu.split()[-1].lower()))
    meta = dict(
        device=gpu,
        dtype="float32" if dry else "bfloat16",
        tokens=args.tokens,
        heads=args.heads,
        head_dim=args.head_dim,
        doc_mean=args.doc_mean,
        ns=args.ns,
        masks=masks,
        modes=args.modes,
        dry_run=dry,
        torch=torch.__version__,
        seed=args.seed,
        time_utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = []

    def save(complete: bool) -> None:
        meta["complete"] = complete
        text = json.dumps(dict(meta=meta, records=records), indent=1)
        (out / f"variants_{tag}.json").write_text(text + "\n")

    for n in args.ns:
        for mask in masks:
            for mode in args.modes:
                for provider in args.providers:
                    rec = bench_one(provider, mask, n, mode, args, device)
                    records.append(rec)
                    ms = "—" if rec["ms"] is None else f"{rec['ms']:.3f} ms"
                    print(
                        f"{provider:5s} {mask:11s} N={n:<6d} {mode:8s} {ms}  {rec['status'][:80]}", flush=True
                    )
                # written after every cell, so a run stopped by a time limit keeps what it measured
                save(False)
    save(True)
    (out / f"variants_{tag}.md").write_text(markdown(records, meta))
    print(f"wrote {out / f'variants_{tag}.json'} and .md")
    bad = sum(r["status"] != "ok" for r in records)
    return 1 if bad == len(records) else 0


if __name__ == "__main__":
    sys.exit(main())
