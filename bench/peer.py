"""Our default training command beside a peer's training script (nanoGPT's train.py), in one invocation.

For each seq_len and bias setting it first runs `python train.py attention=flash seq_len=N model.bias=B`
(bench.throughput's cell: no evaluation, checkpoints or W&B), then the peer's train.py with what that run
resolved: the same model shape (n_layer, n_head, n_embd, vocab_size, bias), micro-batch, gradient
accumulation, seq_len, dtype and compile, on the same prepared tokens. The peer is given by path and run as
it is, from a scratch folder that links its train.py, model.py and configurator.py and holds
data/flashgpt/{train,val}.bin (uint16, the start of our prepared splits) and meta.pkl (our vocab_size, so both
models have the same embedding). Its tokens/sec is tokens per iteration over the median of the "time ..ms"
it prints per iteration after the first --warmup; ours is the median tokens/sec of our run after as many
steps. Writes OUT.json (after every cell), OUT.md and OUT.png.

    python -m bench.peer --peer ~/nanoGPT/train.py --out bench/results/peer_h200 -- data.source=PATH
    python -m bench.peer --models --peer ~/nanoGPT/train.py --seq-lens 1024      # the two models alone

`--models` leaves both training scripts out: in one process it builds our GPT (attention=flash) and the
peer's model.py GPT with the same shape, compiles both, and times one training step each (micro-batches of
32,768 tokens, two of them, bf16 autocast, clip, fused AdamW) alternately, then prints each one's top CUDA
kernels from torch.profiler: where a gap between the two scripts comes from the model and where from the loop.

    python -m bench.peer --allow-cpu --peer ~/nanoGPT/train.py --attention sdpa --seq-lens 64 --steps 4 \\
        --warmup 1 -- experiment=cpu_tiny data.source=PATH      # a CPU try-out of the tool (no figures)
"""

from __future__ import annotations

import importlib.util
import pickle
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from bench import common, throughput

BIASES = {"on": [True], "off": [False], "both": [True, False]}  # --bias: the model.bias values run
PEER_FILES = ("train.py", "model.py", "configurator.py")
#: nanoGPT prints "iter 12: loss 4.1234, time 123.45ms, mfu 40.12%" once per iteration (log_interval=1)
ITER_LINE = re.compile(r"^iter (\d+): loss [-+.\w]+, time ([\d.]+)ms", re.M)


def peer_command(cfg: dict, steps: int, out_dir: Path) -> list[str]:
    """The peer's command line for the run our cell resolved (`cfg`: its config.resolved.yaml, whose
    ``derived`` part holds what the trainer decided: batch split, dtype, compile, device): the same model,
    batch split, seq_len, dtype and compile; evaluation only at its iteration 0 (one batch: nanoGPT always
    evaluates there), no checkpoint, no W&B."""
    m, d = cfg["model"], cfg["derived"]
    args = dict(dataset="flashgpt", out_dir=str(out_dir), n_layer=m["n_layer"], n_head=m["n_head"])
    args |= dict(n_embd=m["n_embd"], bias=bool(m["bias"]), dropout=0.0, block_size=d["block_size"])
    args |= dict(batch_size=d["micro_batch_size"], gradient_accumulation_steps=d["grad_accum"])
    # nanoGPT runs iterations 0..max_iters; dtype: bfloat16 autocast or float32, as nanoGPT names them
    args |= dict(max_iters=steps - 1, eval_interval=steps + 1, eval_iters=1)
    args |= dict(log_interval=1, always_save_checkpoint=False, wandb_log=False, compile=bool(d["compile"]))
    args |= dict(dtype=d["dtype"], device=d["device"])
    return [sys.executable, "train.py", *(f"--{k}={v}" for k, v in args.items())]


def peer_folder(peer: Path, data_dir: Path, vocab_size: int, tokens: int, where: Path) -> Path:
    """A scratch folder to run the peer in: links to its files, and our splits as nanoGPT reads them."""
    from data.loader import BinDataset

    for f in PEER_FILES:
        (where / f).symlink_to(peer.parent / f)
    out = where / "data" / "flashgpt"
    out.mkdir(parents=True)
    for split in ("train", "val"):
        ds = BinDataset(data_dir, split, seq_len=1, check_ids=False)
        if np.dtype(ds.dtype).itemsize != 2:
            raise SystemExit(f"error: {data_dir} holds {ds.dtype} tokens; nanoGPT reads uint16 only")
        ds._read(0, min(tokens, ds.num_tokens)).astype(np.uint16).tofile(out / f"{split}.bin")
    (out / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": vocab_size}))
    return where


def peer_tokens_per_sec(log: str, tokens_per_iter: int, warmup: int) -> dict:
    """tokens_per_sec (over the median iteration time, the first `warmup` out), timed_steps and step_ms
    (every iteration's) from the peer's per-iteration lines; ValueError when none is timed."""
    iters = [(int(i), float(ms)) for i, ms in ITER_LINE.findall(log)]
    if not (timed := [ms for i, ms in iters if i >= warmup]):
        raise ValueError(f"no 'iter N: loss ..., time ..ms' line after iteration {warmup - 1} in its output")
    tokens_per_sec = tokens_per_iter / (statistics.median(timed) / 1000)
    return dict(tokens_per_sec=tokens_per_sec, timed_steps=len(timed), step_ms=[ms for _, ms in iters])


def run_peer(a, cell: dict, run_dir: Path) -> dict:
    """Run the peer for our finished cell `run_dir`; its record (status, tokens_per_sec or error)."""
    cfg = common.read_config(run_dir)
    d = cfg["derived"]
    rec = dict(who="peer", seq_len=cell["seq_len"], bias=cell["bias"])
    with tempfile.TemporaryDirectory(prefix="flashgpt-peer-") as tmp:
        # nanoGPT draws random windows from these tokens
        keep = max(4 * d["tokens_per_step"], 2 * d["block_size"] + 2)
        data_dir = Path(d["cwd"]) / cfg["data"]["dir"]
        where = peer_folder(a.peer, data_dir, d["vocab_size"], keep, Path(tmp))
        cmd = peer_command(cfg, a.steps, Path(tmp) / "out")
        rec["command"] = shlex.join([str(a.peer), *cmd[2:]])
        try:
            proc = subprocess.run(cmd, cwd=where, capture_output=True, text=True, timeout=a.timeout)
        except subprocess.TimeoutExpired:
            return rec | dict(status="error", error=f"timed out after {a.timeout:.0f} s")
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        return rec | dict(status="error", error=throughput.error_excerpt(log[-3000:]))
    try:
        return rec | dict(status="ok", **peer_tokens_per_sec(log, d["tokens_per_step"], a.warmup))
    except ValueError as e:
        return rec | dict(status="error", error=str(e))


def train_step(model, compiled, opt, x) -> None:
    """One update over the micro-batches x (accum, B, N): bf16 autocast, clip at 1, the optimizer's step;
    ours without logits, as trainer.loop calls it (nanoGPT's model returns them)."""
    from model import GPT

    ours = {"return_logits": False} if isinstance(model, GPT) else {}
    for micro in x:
        with torch.autocast("cuda", torch.bfloat16):
            _, loss = compiled(micro, micro, **ours)
        (loss / len(x)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def time_models(a) -> int:
    """--models: our GPT and the peer's, same shape, one process; median step ms and the top kernels."""
    from model.gpt import GPT, GPTConfig
    from trainer.compiling import compile_model

    if not torch.cuda.is_available():
        return common.error("--models times CUDA steps and this machine has no CUDA GPU; leave --models out")
    spec = importlib.util.spec_from_file_location("peer_model", a.peer.parent / "model.py")
    peer_mod, dev = importlib.util.module_from_spec(spec), torch.device("cuda")
    spec.loader.exec_module(peer_mod)  # the peer's model.py as a module (nanoGPT: GPT, GPTConfig)
    shape = dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50304, dropout=0.0)
    for n in a.seq_lens:
        for bias in BIASES[a.bias]:
            torch.manual_seed(0)
            ours = GPT(GPTConfig(block_size=n, bias=bias, attention=a.attention, **shape))
            peer = peer_mod.GPT(peer_mod.GPTConfig(block_size=n, bias=bias, **shape))
            steps = {}
            for who, m in (("flashgpt", ours), ("peer", peer)):
                m = m.to(dev).train()
                opt = m.configure_optimizers(0.1, 6e-4, (0.9, 0.95), "cuda")
                steps[who] = (m, compile_model(m, None) if who == "flashgpt" else torch.compile(m), opt)
            x = torch.randint(0, 50257, (2, 32768 // n, n), device=dev)

            ms = {who: [] for who in steps}
            for i in range(a.steps):
                for who in steps:  # alternately, so both see the same clocks
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    train_step(*steps[who], x)
                    torch.cuda.synchronize()
                    if i >= a.warmup:
                        ms[who].append(1e3 * (time.perf_counter() - t0))
            med = {who: statistics.median(v) for who, v in ms.items()}
            step_ms = ", ".join(f"{w} {v:.2f}" for w, v in med.items())
            speed = f"flashgpt / peer speed {med['peer'] / med['flashgpt']:.3f}"
            print(f"== seq_len={n} bias={bias}: step ms {step_ms}; {speed}", flush=True)
            for who in steps:
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    train_step(*steps[who], x)
                    torch.cuda.synchronize()
                print(f"-- {who} seq_len={n} bias={bias}: top kernels of one step")
                kw = dict(sort_by="cuda_time_total", row_limit=a.top, max_name_column_width=90)
                print(prof.key_averages().table(**kw))
            del steps, ours, peer, m
            torch.cuda.empty_cache()
    return 0


def markdown(meta: dict, cells: list[dict]) -> str:
    """One row per seq_len and bias: ours, the peer's, ours / peer."""
    by = {(c["who"], c["seq_len"], c["bias"]): c for c in cells}
    done = lambda c: c is not None and c["status"] == "ok"
    cell = lambda c: f"{c['tokens_per_sec']:,.0f}" if done(c) else (c or {}).get("status", "—")
    rows = []
    for n, bias in sorted({(c["seq_len"], c["bias"]) for c in cells}):
        ours, peer = by.get(("flashgpt", n, bias)), by.get(("peer", n, bias))
        ratio = f"{ours['tokens_per_sec'] / peer['tokens_per_sec']:.3f}" if done(ours) and done(peer) else "—"
        rows.append([n, "on" if bias else "off", cell(ours), cell(peer), ratio])
    lines = [
        f"# Training throughput against a peer: {meta['gpu']}, {meta['date']}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}, commit {meta['commit']}. `python -m bench.peer "
        f"{' '.join(meta['argv'])}`: ours `{meta['command']}`, the peer {meta['peer']} with the same model, "
        f"batch split and tokens ({meta['steps']} steps each, median tokens/sec after the first "
        f"{meta['warmup']}).",
        "",
        *common.md_table(["seq_len", "biases", "flashgpt", "peer", "flashgpt / peer"], rows),
        *(f"- {c['who']} N={c['seq_len']}: {c.get('error', '')[:300]}" for c in cells if c["status"] != "ok"),
    ]
    return "\n".join(lines) + "\n"


def plot(path: Path, cells: list[dict]) -> None:
    fig, axes = common.subplots(1, 1)
    ax, ok = axes[0][0], [c for c in cells if c["status"] == "ok"]
    for who in ("flashgpt", "peer"):
        for bias, style in ((True, "-o"), (False, "--s")):
            mine = [c for c in ok if (c["who"], c["bias"]) == (who, bias)]
            if pts := sorted((c["seq_len"], c["tokens_per_sec"]) for c in mine):
                ax.plot(*zip(*pts, strict=True), style, label=f"{who}, biases {'on' if bias else 'off'}")
    ax.set(xlabel="seq_len", ylabel="tokens/sec")
    common.finish_axes(ax, [c["seq_len"] for c in cells])
    common.save_figure(fig, path, "training throughput against a peer")


def main(argv=None) -> int:
    p = throughput.cell_parser("peer", __doc__, timeout=900)
    add = p.add_argument
    add("--peer", type=Path, required=True, help="the peer's train.py (nanoGPT's), run as it is")
    add("--seq-lens", type=common.ints(), default=[1024, 8192], help="comma list (default 1024,8192)")
    add("--bias", choices=("on", "off", "both"), default="both", help="model biases (default both)")
    add("--attention", default="flash", help="our backend (default flash)")
    p.set_defaults(profile_steps=0, log_interval=1)  # what bench.throughput's cell command reads
    add("--models", action="store_true", help="time and profile the two models alone (CUDA)")
    add("--top", type=common.positive, default=25, help="--models: kernels listed per model")
    a = p.parse_args(argv)
    a.peer = a.peer.expanduser().resolve()
    missing = [f for f in PEER_FILES if not (a.peer.parent / f).is_file()]
    if a.peer.name != "train.py" or missing:
        p.error(f"--peer {a.peer}: give nanoGPT's train.py, beside its {', '.join(PEER_FILES[1:])}")
    if a.models:
        return time_models(a)
    try_out = "--attention sdpa --seq-lens 64 --steps 4 --warmup 1 -- experiment=cpu_tiny"
    if status := throughput.check_cells(p, a, try_out):
        return status
    meta = dict(peer=str(a.peer), steps=a.steps, warmup=a.warmup)
    runs, results = throughput.start_cells(a, argv, markdown, **meta)
    ours = ["python train.py", f"attention={a.attention}", "seq_len=N", "model.bias=B", *a.overrides]
    results.meta["command"] = " ".join(ours)
    for n in a.seq_lens:
        for bias in BIASES[a.bias]:
            run_dir = runs / f"n{n}_bias{int(bias)}"
            rec, _ = throughput.run_cell(a.attention, n, a, run_dir, f"model.bias={str(bias).lower()}")
            results.add("cells", [ours := rec | dict(who="flashgpt", bias=bias)])
            print(f"   {ours['status']}: {ours.get('tokens_per_sec', ours.get('error', ''))}", flush=True)
            if ours["status"] == "ok":
                print(f"== peer seq_len={n} bias={bias}", flush=True)
                results.add("cells", [peer := run_peer(a, ours, run_dir)])
                print(f"   {peer['status']}: {peer.get('tokens_per_sec', peer.get('error', ''))}", flush=True)
    print(results.save(complete=True))
    plot(Path(a.out).with_suffix(".png"), results.lists["cells"])
    return 0 if all(c["status"] == "ok" for c in results.lists["cells"]) else 1


if __name__ == "__main__":
    sys.exit(main())
