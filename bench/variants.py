"""Benchmark of the attention variants: sliding window and document masks, our flash kernels against full
causal and against FlexAttention with the same masks.

For each mask (causal; window w = 256, 1024, 4096; documents of random lengths), N (8k .. 64k) and mode
(fwd, fwd+bwd) it times ``kernels.flash_attention(..., window= / doc_ids=)`` and compiled
``flex_attention`` with the equivalent ``create_block_mask``, B * N = --tokens tokens per call, H heads of
dim d, bf16. Reported: median ms (``common.Timer``), TFLOP/s over the visible (i, j) pairs only (4 * d flops
per pair forward, 2.5x that for fwd+bwd), the speed-up over full causal flash at the same N, and
flash / flex (> 1: flash faster). The bar: at N = 32k, w = 1024 fwd+bwd >= 8x faster than full causal and
>= FlexAttention. Writes ``variants_<tag>.json`` (after every cell) and ``.md`` to --out.

    python -m bench.variants                                 # H200, bench/results
    python -m bench.variants --dry-run --out /tmp/v          # CPU plumbing check (interpreter, eager flex)
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

import torch

from bench import common

DOC_MEAN = 2048  # mean document length (tokens) of the random document masks


def doc_ids_for(b: int, n: int, mean: int, seed: int) -> torch.Tensor:
    """(b, n) int32 non-decreasing document ids, lengths ~ exponential(mean) (at least 1), seeded."""
    starts = torch.rand(b, n, generator=torch.Generator().manual_seed(seed)) < 1.0 / mean
    starts[:, 0] = True
    return (starts.cumsum(-1) - 1).to(torch.int32)


def visible_pairs(mask: str, n: int, doc_ids=None) -> int:
    """(query, key) pairs the mask keeps: for one sequence (causal, window), summed over the batch (docs)."""
    if mask == "causal":
        return n * (n + 1) // 2
    if mask.startswith("window"):
        w = min(int(mask[6:]), n)
        return w * (w + 1) // 2 + (n - w) * w
    lengths = [torch.unique_consecutive(row, return_counts=True)[1].to(torch.int64) for row in doc_ids]
    return sum(int((x * (x + 1) // 2).sum()) for x in lengths)


def make_attention(provider: str, mask: str, n: int, doc_ids, device, b: int, compiled: bool):
    """attn(q, k, v) -> o: flash_attention with the mask's arguments, or FlexAttention with its block mask."""
    if provider == "flash":
        from kernels import flash_attention

        kw = dict(window=int(mask[6:])) if mask.startswith("window") else {}
        kw |= dict(doc_ids=doc_ids) if mask == "docs" else {}
        return lambda q, k, v: flash_attention(q, k, v, causal=True, **kw)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if mask == "causal":
        mask_mod = lambda bi, hi, qi, ki: qi >= ki
    elif mask.startswith("window"):
        w = int(mask[6:])
        mask_mod = lambda bi, hi, qi, ki: (qi >= ki) & (qi - ki < w)
    else:
        docs = doc_ids.to(device)
        mask_mod = lambda bi, hi, qi, ki: (qi >= ki) & (docs[bi, qi] == docs[bi, ki])
    block = create_block_mask(mask_mod, b, None, n, n, device=str(device))
    if compiled:
        # a fresh Dynamo cache per cell: past the recompile limit compiled flex silently falls back to eager
        # flex, which materialises the B*H*N^2 scores (out of memory from N = 16k on the H200)
        torch._dynamo.reset()
    fn = torch.compile(flex_attention) if compiled else flex_attention
    return lambda q, k, v: fn(q, k, v, block_mask=block)


def bench_one(provider: str, mask: str, n: int, mode: str, args, device, timer) -> dict:
    """Time one (provider, mask, N, mode) cell; a failure is its status, not an exception."""
    b, h, d = max(1, args.tokens // n), args.heads, args.head_dim
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    g = torch.Generator().manual_seed(args.seed)
    q, k, v, do = (torch.randn(b, h, n, d, generator=g).to(device=device, dtype=dtype) for _ in range(4))
    doc_ids = doc_ids_for(b, n, args.doc_mean, args.seed).to(device) if mask == "docs" else None
    pairs = visible_pairs(mask, n, doc_ids) * (1 if mask == "docs" else b)
    rec = dict(provider=provider, mask=mask, n=n, mode=mode, b=b, h=h, d=d, visible_pairs=pairs)
    rec |= dict(doc_mean=args.doc_mean if mask == "docs" else None, ms=None, tflops=None)
    if provider == "flex" and mode == "fwd+bwd" and device.type == "cpu":
        return rec | dict(status="skipped: FlexAttention has no CPU backward")
    try:
        attn = make_attention(provider, mask, n, doc_ids, device, b, compiled=not args.dry_run)
        if mode == "fwd":
            with torch.no_grad():
                ms = timer(lambda: attn(q, k, v))
        else:
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            ms = timer(lambda: attn(*leaves).backward(do), grad_to_none=leaves)
        flops = 4.0 * d * pairs * h * (2.5 if mode == "fwd+bwd" else 1.0)
        rec.update(status="ok", ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
    except Exception as e:  # OOM, a compile failure: record and go on
        rec["status"] = common.failure(e)
    common.free_memory(device)
    return rec


def markdown(meta: dict, records: list[dict]) -> str:
    idx = {(r["provider"], r["mask"], r["n"], r["mode"]): r for r in records}
    lines = [
        f"# Attention variants: {meta['device']}",
        "",
        f"B * N = {meta['tokens']} tokens, H = {meta['heads']}, d = {meta['head_dim']}, {meta['dtype']}; "
        f"documents: random lengths, mean {meta['doc_mean']}; median ms (triton.testing.do_bench); TF/s "
        "over the visible pairs only.",
        "",
    ]
    if meta.get("dry_run"):
        lines += ["**Dry run** (CPU, Triton interpreter): the numbers are meaningless.", ""]
    if meta.get("complete") is False:
        lines += [f"**Incomplete**: stopped (time limit) after {len(records)} cells; — = not measured.", ""]
    fmt = lambda x, spec: "—" if x is None else format(x, spec)
    ms = lambda *key: (idx.get(key) or {}).get("ms")
    rows = []
    for mask, n, mode in itertools.product(meta["masks"], meta["ns"], meta["modes"]):
        f, x, c = ms("flash", mask, n, mode), ms("flex", mask, n, mode), ms("flash", "causal", n, mode)
        tf = (idx.get(("flash", mask, n, mode)) or {}).get("tflops")
        ratios = [fmt(x / f if f and x else None, ".2f"), f"{c / f:.2f}x" if f and c else "—"]
        rows.append([mask, n, mode, fmt(f, ".3f"), fmt(tf, ".0f"), fmt(x, ".3f"), *ratios])
    head = ["mask", "N", "mode", "flash ms", "flash TF/s", "flex ms", "flash / flex"]
    lines += common.md_table([*head, "vs full causal (flash)"], rows)
    bar = [("flash", "window1024"), ("flash", "causal"), ("flex", "window1024")]
    w, c, x = (ms(p, mask, 32768, "fwd+bwd") for p, mask in bar)
    if w and c and x:
        met = "met" if c / w >= 8 and x / w >= 1 else "NOT met"
        lines += [
            "",
            f"Bar (N = 32k, w = 1024, fwd+bwd): {c / w:.1f}x faster than full causal (need >= 8), "
            f"{x / w:.2f}x FlexAttention (need >= 1): {met}.",
        ]
    if failed := [r for r in records if r["status"] != "ok" and not r["status"].startswith("skipped")]:
        lines += ["", "Failed cells:"]
        lines += [f"- {r['provider']} {r['mask']} N={r['n']} {r['mode']}: {r['status']}" for r in failed]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.variants", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="output folder (default bench/results; --dry-run: outputs/bench)")
    p.add_argument("--dry-run", action="store_true", help="tiny CPU run under the Triton interpreter")
    p.add_argument("--ns", type=common.ints(), help="sequence lengths (default 8192,16384,32768,65536)")
    p.add_argument("--windows", type=common.ints(), help="window sizes (default 256,1024,4096)")
    p.add_argument("--tokens", type=common.positive, help="B * N per call (default 65536)")
    p.add_argument("--heads", type=common.positive, help="H (default 16)")
    p.add_argument("--head-dim", type=common.positive, help="d (default 64)")
    p.add_argument("--doc-mean", type=common.positive, help=f"mean document length (default {DOC_MEAN})")
    p.add_argument("--providers", type=common.choices(("flash", "flex")), default=["flash", "flex"])
    p.add_argument("--modes", type=common.choices(("fwd", "fwd+bwd")), default=["fwd", "fwd+bwd"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", help="file name tag (default: h200 / the GPU name / dryrun)")
    args = p.parse_args(argv)
    dry = args.dry_run
    gpu = dict(ns=[8192, 16384, 32768, 65536], windows=[256, 1024, 4096], tokens=65536, heads=16, head_dim=64)
    cpu = dict(ns=[64], windows=[16], tokens=192, heads=2, head_dim=16, doc_mean=24)
    for key, value in (cpu if dry else gpu | dict(doc_mean=DOC_MEAN)).items():
        setattr(args, key, getattr(args, key) or value)
    if dry:
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        return common.error("bench.variants times CUDA kernels and needs a CUDA GPU; on a CPU use --dry-run")
    device = torch.device("cpu" if dry else "cuda")
    timer = common.Timer(device)
    masks = ["causal"] + [f"window{w}" for w in args.windows] + ["docs"]
    env = common.environment(device)
    tag = args.tag or common.default_tag(device, cpu="dryrun")
    meta = dict(device=env["gpu"] or "cpu", dtype="float32" if dry else "bfloat16", tokens=args.tokens)
    meta |= dict(heads=args.heads, head_dim=args.head_dim, doc_mean=args.doc_mean, ns=args.ns, masks=masks)
    meta |= dict(modes=args.modes, dry_run=dry, torch=env["torch"], seed=args.seed, time_utc=env["date"])
    path = Path(args.out or ("outputs/bench" if dry else "bench/results")) / f"variants_{tag}.json"
    out = common.Results(path, meta, markdown, records=[])
    for n, mask, mode, provider in itertools.product(args.ns, masks, args.modes, args.providers):
        rec = bench_one(provider, mask, n, mode, args, device, timer)
        ms = "—" if rec["ms"] is None else f"{rec['ms']:.3f} ms"
        print(f"{provider:5s} {mask:11s} N={n:<6d} {mode:8s} {ms}  {rec['status'][:80]}", flush=True)
        out.add("records", [rec])  # after every cell: a run stopped by a time limit keeps it
    out.save(complete=True)
    print(f"wrote {out.path} and .md")
    return 1 if all(r["status"] != "ok" for r in out.lists["records"]) else 0


if __name__ == "__main__":
    sys.exit(main())
