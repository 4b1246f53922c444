"""Prepare throughput and peak memory: ``python -m bench.prepare [--mb 64] [--workers 1,2] [--out FILE]``.

Writes a JSONL corpus of ``--mb`` MB of synthetic English-like documents (a fixed seed), prepares it
with each worker count in a fresh subprocess (``python -m data.prepare``, GPT-2 BPE) and records MB/s,
tokens/s and the process's peak RSS (the tokenizer workers are threads of it: tiktoken releases the GIL).
Results go to ``bench/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

WORDS = (
    "the of and to in a is that for it as was with be by on not he I this are or his from at which but "
    "have an they you were her she there one all we can their has been if more when will would who so no "
    "attention model token window kernel memory shard corpus document training loss step value"
).split()


def write_corpus(path: Path, mb: float, seed: int = 0) -> int:
    """A JSONL file of about ``mb`` MB: documents of 50-2000 words drawn from WORDS. Returns bytes."""
    rng = np.random.default_rng(seed)
    target, size = int(mb * 1e6), 0
    with open(path, "w", encoding="utf-8") as f:
        while size < target:
            words = rng.choice(WORDS, size=int(rng.integers(50, 2000)))
            line = json.dumps({"text": " ".join(words)}) + "\n"
            f.write(line)
            size += len(line)
    return size


def run_one(src: Path, out: Path, workers: int, shard_tokens: int) -> dict:
    """One prepare in a subprocess: wall time, tokens, peak RSS (MB)."""
    cmd = [sys.executable, "-c", _CHILD, str(src), str(out), str(workers), str(shard_tokens)]
    env, t0 = {**os.environ, "PYTHONPATH": os.getcwd()}, time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    wall = time.perf_counter() - t0
    return {"workers": workers, "wall_s": wall, **json.loads(res.stdout.strip().splitlines()[-1])}


_CHILD = """
import json, resource, sys, time
from data.prepare import prepare
src, out, workers, shard = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
t0 = time.perf_counter()
meta = prepare(src, out, "gpt2", 0.01, workers=workers, shard_tokens=shard, progress=False)
dt = time.perf_counter() - t0
tokens = meta["train_tokens"] + meta["val_tokens"]
print(json.dumps({"prepare_s": dt, "tokens": tokens,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.prepare", description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=64.0, help="corpus size in MB (64)")
    p.add_argument("--workers", default="1,2", help="comma-separated worker counts (1,2)")
    p.add_argument("--shard-tokens", type=int, default=10_000_000)
    p.add_argument("--out", default="bench/results/prepare_cpu.json")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "corpus.jsonl"
        size = write_corpus(src, args.mb)
        for w in [int(x) for x in args.workers.split(",")]:
            r = run_one(src, Path(tmp) / f"out{w}", w, args.shard_tokens)
            r.update(mb_per_s=size / 1e6 / r["prepare_s"], tokens_per_s=r["tokens"] / r["prepare_s"])
            rows.append(r)
            print(
                f"workers={w}: {r['mb_per_s']:.2f} MB/s, {r['tokens_per_s'] / 1e6:.2f} M tokens/s, "
                f"peak RSS {r['peak_rss_mb']:.0f} MB (corpus {size / 1e6:.0f} MB)"
            )
    cpu = dict(cpu=platform.processor() or platform.machine(), cpu_count=os.cpu_count())
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    cpu |= dict(commit=git.stdout.strip() or None, date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    command = "python -m bench.prepare " + " ".join(argv if argv is not None else sys.argv[1:])
    record = dict(corpus_mb=size / 1e6, **cpu, shard_tokens=args.shard_tokens, command=command, rows=rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
