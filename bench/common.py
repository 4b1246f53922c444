"""What the bench tools share: argument types, timing (do_bench on CUDA, CUDA graphs of decode calls), the
attention providers, results files rewritten as they grow, run directories, markdown tables and plots."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

# ------------------------------------------------------------------------------------------ arguments


def ints(low: int = 1, pow2: bool = False) -> Callable[[str], list[int]]:
    """argparse type of a comma list of integers >= `low` (powers of two with `pow2`); a bad list is a
    usage error (exit 2) naming the option and the value before anything runs."""

    def parse(text: str) -> list[int]:
        try:
            vals = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: must be a comma list of integers") from None
        if not vals:
            raise argparse.ArgumentTypeError(f"{text!r}: is an empty list")
        if any(n < low or (pow2 and n & (n - 1)) for n in vals):
            rule = "powers of two" if pow2 else "integers"
            raise argparse.ArgumentTypeError(f"{text!r}: must be {rule} >= {low}")
        return vals

    return parse


def positive(text: str) -> int:
    """argparse type of one integer >= 1."""
    vals = ints()(text)
    if len(vals) != 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be one integer >= 1")
    return vals[0]


def choices(valid: Sequence[str], unique: bool = False) -> Callable[[str], list[str]]:
    """argparse type of a comma list of names from `valid` (each at most once with `unique`)."""

    def parse(text: str) -> list[str]:
        vals = [x.strip() for x in text.split(",") if x.strip()]
        twice = unique and len(set(vals)) != len(vals) and "a name given twice"
        if (bad := [x for x in vals if x not in valid] or twice) or not vals:
            message = f"{text!r}: each once, from {', '.join(valid)} (bad: {bad or text!r})"
            raise argparse.ArgumentTypeError(message)
        return vals

    return parse


DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
DTYPES |= {"fp32": torch.float32, "float32": torch.float32}


def log(message: str) -> None:
    """A line on stderr: progress, warnings and errors (stdout holds the records and tables)."""
    print(message, file=sys.stderr, flush=True)


def error(message: str, status: int = 2) -> int:
    """Log "error: <message>" and return `status` (2: bad input or no GPU)."""
    log(f"error: {message}")
    return status


def commit(where: Path = Path(__file__).parent) -> str:
    """The checkout's short commit, with "+changes" when tracked files differ from it: a copy of a working
    tree whose git metadata is older than its files (the device machine's) says so instead of naming a
    commit it does not hold."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=where, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def environment(device: torch.device) -> dict:
    """Versions, commit and device facts of a results file (no hostname)."""
    import triton

    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    versions = dict(torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda)
    return dict(date=date, gpu=gpu, commit=commit(), **versions)


def default_tag(device: torch.device, cpu: str = "cpu") -> str:
    """'h200' on an H200, else a slug of the GPU name; `cpu` without CUDA."""
    if device.type != "cuda":
        return cpu
    name = torch.cuda.get_device_name(device)
    return "h200" if "H200" in name.upper() else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


# --------------------------------------------------------------------------------------------- timing


def failure(exc: BaseException) -> str:
    """Status of a call that failed: "oom" for out of memory, else "error: <Type>: <first line>"."""
    if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower():
        return "oom"
    return f"error: {type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"[:160]


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass
class Timer:
    """Median wall time of a callable in ms: triton.testing.do_bench on CUDA, perf_counter on CPU.

    ``slow_ms`` (CUDA, off by default): a call that takes at least that long after one warm-up call is
    timed as the median of ``slow_reps`` calls between CUDA events instead: do_bench would call it about
    ``5 + (warmup + rep) / time`` times, and at such lengths its L2 flush is moot and launch jitter tiny.
    """

    device: torch.device
    warmup_ms: int = 25
    rep_ms: int = 100
    cpu_reps: int = 3
    slow_ms: float | None = None
    slow_reps: int = 3
    cuda_graph: bool = False  # do_bench_cudagraph: back-to-back replays, no host time (and no L2 flush)

    def describe(self) -> str:
        if self.device.type != "cuda":
            return f"time.perf_counter median of {self.cpu_reps} reps after 1 warm-up (CPU dry run)"
        if self.cuda_graph:
            return f"triton.testing.do_bench_cudagraph(return_mode='median', rep={self.rep_ms} ms)"
        slow = f"; calls of >= {self.slow_ms} ms: median of {self.slow_reps} event-timed calls"
        return (
            f"triton.testing.do_bench(return_mode='median', warmup={self.warmup_ms} ms, rep={self.rep_ms} "
            f"ms, grads set to None between reps){slow if self.slow_ms is not None else ''}"
        )

    def _once(self, fn: Callable, grad_to_none) -> float:
        for t in grad_to_none or ():
            t.grad = None
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def __call__(self, fn: Callable[[], object], grad_to_none: Sequence[torch.Tensor] | None = None) -> float:
        cuda = self.device.type == "cuda"
        if not cuda or self.slow_ms is not None:
            once = lambda: self._once(fn, grad_to_none)
            once()  # warm-up (compilation, allocator); do_bench makes the same first call
            times = [once()]
            if not cuda or times[0] >= self.slow_ms:
                times += [once() for _ in range((self.slow_reps if cuda else self.cpu_reps) - 1)]
                return float(statistics.median(times))
        from triton.testing import do_bench, do_bench_cudagraph

        if self.cuda_graph:
            return float(do_bench_cudagraph(fn, self.rep_ms, grad_to_none, return_mode="median"))
        kw = dict(warmup=self.warmup_ms, rep=self.rep_ms, grad_to_none=grad_to_none, return_mode="median")
        return float(do_bench(fn, **kw))


# Calls per captured CUDA graph of the decode timings (ms = replay time / GRAPH_CALLS). One graph launch
# costs about a batch-1 decode kernel's time: a decode step pays it once for all layers, so a graph of one
# call would add it to every figure.
GRAPH_CALLS = 20


def decode_inputs(batch: int, kv_heads: int, group: int, context: int, d: int, dtype, device, seed: int):
    """q (B, Hkv * group, 1, d) and a full cache k, v (B, Hkv, context, d), standard normal from `seed`."""
    kw = dict(device=device, dtype=dtype, generator=torch.Generator(device=device).manual_seed(seed))
    q = torch.randn(batch, kv_heads * group, 1, d, **kw)
    return q, *(torch.randn(batch, kv_heads, context, d, **kw) for _ in range(2))


def l2_copies(q, k, v) -> list[tuple]:
    """(q, k, v) and copies of it, enough that GRAPH_CALLS calls cycling through them touch twice the L2
    between two reads of one copy: a decode step's layers each read their own cache, so re-reading one
    small cache would time the L2, not HBM (H200: 50 MB of L2 against 16.8 MB at batch 1, d 64, 8k)."""
    l2 = getattr(torch.cuda.get_device_properties(k.device), "L2_cache_size", 0)
    n = min(GRAPH_CALLS, max(1, math.ceil(2 * l2 / max(1, 2 * k.numel() * k.element_size()))))
    return [(q, k, v)] + [(q.clone(), k.clone(), v.clone()) for _ in range(n - 1)]


def graph_ms(fn, arg_sets: list[tuple], timer: Timer) -> float:
    """Time per call of GRAPH_CALLS back-to-back calls of fn (call i on arg_sets[i % len]) captured in one
    CUDA graph, after warm-up calls on a side stream (as torch.cuda.graphs documents). Each output is
    dropped at once, so the graph's pool reuses one call's memory."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for args in arg_sets[:3]:
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(GRAPH_CALLS):
            fn(*arg_sets[i % len(arg_sets)])
    try:
        return timer(graph.replay) / GRAPH_CALLS
    finally:
        del graph


# ------------------------------------------------------------------------------ attention providers

PROVIDERS = ("flash", "flash-det", "naive", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math", "flex")
SDPA_BACKENDS = ("flash", "cudnn", "efficient", "math")


def sdpa(backend: str | None, causal: bool = False) -> Callable:
    """fn(q, k, v) -> F.scaled_dot_product_attention (enable_gqa where k, v have fewer heads than q), pinned
    with sdpa_kernel to a backend of SDPA_BACKENDS, or PyTorch's choice for None."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend is not None and backend not in SDPA_BACKENDS:
        raise ValueError(f"unknown SDPA backend {backend!r}; valid: {', '.join(SDPA_BACKENDS)}")
    pinned = backend and getattr(SDPBackend, "MATH" if backend == "math" else f"{backend.upper()}_ATTENTION")

    def call(q, k, v):
        with sdpa_kernel(pinned) if pinned else contextlib.nullcontext():
            gqa = q.shape[1] != k.shape[1]  # fewer k, v heads
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    return call


_FLEX: list = []


def build_provider(name: str, *, n: int, device: torch.device, softcap: float | None = None) -> Callable:
    """``fn(q, k, v) -> o`` (causal, scale 1/sqrt(d)) of provider `name`: flash = kernels.flash_attention,
    flash-det the same with deterministic=True (the split Triton backward, bitwise reproducible); naive =
    model.attention.attention(..., "naive"); sdpa-<backend> = F.scaled_dot_product_attention pinned with
    sdpa_kernel; flex = compiled flex_attention with a causal block mask of length `n`. `softcap` c: scores
    c * tanh(s / c) (flex through a score_mod; sdpa has none: ValueError). ValueError for an unknown name."""
    if softcap and name.startswith("sdpa-"):
        raise ValueError(f"{name} cannot soft-cap scores (SDPA has no score modifier)")
    if name in ("flash", "flash-det"):
        import kernels

        kernels.check_flash_available(device)
        kw = dict(causal=True, deterministic=name == "flash-det", softcap=softcap)
        return lambda q, k, v: kernels.flash_attention(q, k, v, **kw)
    if name == "naive":
        from model.attention import attention

        return lambda q, k, v: attention(q, k, v, "naive", softcap=softcap)
    if name.startswith("sdpa-"):
        return sdpa(name[5:], causal=True)
    if name == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        if not _FLEX:  # compiled once; it recompiles per shape, so a full sweep must not hit the limit
            import torch._dynamo.config as dynamo_config

            dynamo_config.recompile_limit = max(64, dynamo_config.recompile_limit)
            _FLEX.append(torch.compile(flex_attention, dynamic=False))
        mask = create_block_mask(lambda b, h, q, k: q >= k, B=None, H=None, Q_LEN=n, KV_LEN=n, device=device)
        cap = (lambda s, b, h, i, j: softcap * torch.tanh(s / softcap)) if softcap else None
        return lambda q, k, v: _FLEX[0](q, k, v, block_mask=mask, score_mod=cap)
    raise ValueError(f"unknown provider {name!r}; valid: {', '.join(PROVIDERS)}")


# ------------------------------------------------------------------------------------- results files


def write_text(path: Path, text: str) -> None:
    """Write atomically (temporary file, then os.replace): a killed run leaves the old file or the new."""
    from data.prepare import atomic_write

    data = text.encode("utf-8")
    atomic_write(Path(path), lambda f: f.write(data))


def compact_json(obj: dict) -> str:
    """JSON with one line per top-level key and per item of a list value (a record): a re-measured cell
    changes one line of the diff. Loads back to `obj`."""
    parts = []
    for key, value in obj.items():
        if isinstance(value, list) and value:
            items = ",\n".join("  " + json.dumps(v) for v in value)
            parts.append(f" {json.dumps(key)}: [\n{items}\n ]")
        else:
            parts.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


class Results:
    """A results JSON (`meta` under `meta_key`, then record lists) and its markdown `markdown(meta, *lists)`,
    rewritten atomically by `save`: after every shape with complete False, at the end with True, so a run
    killed part-way keeps what it measured."""

    def __init__(self, path: Path, meta: dict, markdown: Callable[..., str], meta_key="meta", **lists: list):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.meta, self.markdown, self.meta_key, self.lists = path, meta, markdown, meta_key, lists

    def add(self, name: str, records: list[dict]) -> None:
        self.lists[name] += records
        self.save()

    def save(self, complete: bool = False) -> str:
        self.meta["complete"] = complete
        write_text(self.path, compact_json({self.meta_key: self.meta, **self.lists}))
        report = self.markdown(self.meta, *self.lists.values())
        write_text(self.path.with_suffix(".md"), report)
        return report


# ------------------------------------------------------------------------------------ run directories

UNFINISHED_STATUSES = ("killed", "running")  # runs that did not reach their end and record no ending


class RunDirError(FileNotFoundError):
    """A run directory (or a required file in it) is missing or unreadable."""


def find_run_dirs(root: str | Path) -> list[Path]:
    """Every directory at or under `root` holding summary.json, metrics.jsonl or .hydra/config.yaml,
    skipping wandb/, ckpt/ and hidden folders, in natural order. RunDirError when `root` is no folder."""
    root = Path(root)
    if not root.is_dir():
        raise RunDirError(
            f"sweep directory {root} {'is a file, not a folder' if root.exists() else 'does not exist'} "
            "(pass the Hydra multirun folder, e.g. multirun/2025-01-01_12-00-00)"
        )
    found = {p.parent for m in ("summary.json", "metrics.jsonl") for p in root.rglob(m)}
    found |= {p.parent.parent for p in root.rglob("config.yaml") if p.parent.name == ".hydra"}
    skip = lambda r: any(x in ("wandb", "ckpt") or x.startswith(".") for x in r.relative_to(root).parts)
    natural = lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]
    return sorted((r for r in found if not skip(r)), key=lambda p: (len(p.parts), natural(p)))


def read_metrics(run_dir: str | Path, *, required: bool = False) -> list[dict]:
    """Parsed lines of the live branch of `run_dir/metrics.jsonl` (or of that file given itself): the steps
    a resume replayed are dropped (`trainer.metrics.live_branch`); an unparsable line (the torn last line of
    a killed run) is skipped with a warning. Missing file: [] or, with `required`, RunDirError."""
    from trainer.metrics import live_branch

    path = Path(run_dir)
    path = path / "metrics.jsonl" if path.is_dir() else path
    if not path.is_file():
        if required:
            raise RunDirError(
                f"{path} not found: pass a run directory written by train.py (it holds metrics.jsonl) or "
                "the metrics.jsonl file itself"
            )
        return []
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        try:
            obj = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            log(f"warning: {path}:{lineno}: unparsable JSON line skipped")
            continue
        if isinstance(obj, dict):
            rows.append(obj)
    return live_branch(rows)


def read_summary(run_dir: str | Path) -> dict:
    """`run_dir/summary.json`, {} when missing or unreadable (`trainer.rundir.read_summary`)."""
    from trainer.rundir import read_summary

    return read_summary(Path(run_dir))


def run_status(run_dir: str | Path, summary: dict | None = None) -> tuple[str | None, str | None]:
    """(status, note) as it really is (`trainer.rundir.true_status`): a "running" summary whose process is
    gone is "killed", with a note naming its last step."""
    from trainer.rundir import true_status

    return true_status(Path(run_dir), read_summary(run_dir) if summary is None else summary)


def read_config(run_dir: str | Path) -> dict:
    """The run's config: `config.resolved.yaml` (the trainer's copy from the run's start; Hydra rewrites
    `.hydra/` for every command aimed at the folder, even a refused one), else `.hydra/config.yaml`
    unresolved; {} when neither is readable."""
    from omegaconf import OmegaConf

    from trainer.rundir import read_resolved_config

    if cfg := read_resolved_config(run_dir):
        return cfg
    try:
        cfg = OmegaConf.to_container(OmegaConf.load(Path(run_dir) / ".hydra" / "config.yaml"), resolve=False)
    except Exception:  # noqa: BLE001 - absent or not YAML: no config
        return {}
    return cfg if isinstance(cfg, dict) else {}


def cfg_get(cfg: dict, dotted: str, default: Any = None) -> Any:
    """cfg['a']['b'] for 'a.b'; `default` when a level is missing."""
    for key in dotted.split("."):
        if not isinstance(cfg, dict) or key not in cfg:
            return default
        cfg = cfg[key]
    return cfg


def plain(v: Any) -> bool:
    """A set value, not an unresolved interpolation."""
    return v is not None and not (isinstance(v, str) and "${" in v)


def attention_label(cfg: dict, summary: dict) -> str | None:
    """Backend label: config attention.name (or older spellings), else the summary's; sdpa pinned to a
    backend is 'sdpa-<backend>'."""
    keys = ("attention.name", "attention.backend", "attention", "model.attention")
    name = next((str(v) for k in keys if plain(v := cfg_get(cfg, k)) and not isinstance(v, dict)), None)
    if name is None and plain(summary.get("attention")):
        name = str(summary["attention"])
    if name == "sdpa":
        for key in ("attention.sdpa_backend", "sdpa_backend", "model.sdpa_backend"):
            if plain(sb := cfg_get(cfg, key)) and str(sb) != "auto":
                return f"sdpa-{sb}"
    return name


def seq_len_of(cfg: dict, summary: dict) -> int | None:
    """Sequence length: config seq_len (or data.seq_len, model.block_size), else the summary's."""
    for v in (cfg_get(cfg, "seq_len"), cfg_get(cfg, "data.seq_len"), cfg_get(cfg, "model.block_size")):
        if plain(v):
            with contextlib.suppress(TypeError, ValueError):  # not a number: the next key
                return int(v)
    return int(summary["seq_len"]) if isinstance(summary.get("seq_len"), int) else None


def series(rows: list[dict], key: str) -> dict[int, float]:
    """{step: value} of the rows having `key` (a later duplicate step replaces an earlier one), sorted;
    non-numeric values skipped, NaN kept."""
    out: dict[int, float] = {}
    for r in rows:
        with contextlib.suppress(TypeError, ValueError):  # a non-numeric step or value: skipped
            if key in r and "step" in r:
                out[int(r["step"])] = float(r[key])
    return dict(sorted(out.items()))


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# ---------------------------------------------------------------------------------- tables and plots


def md_table(header: Sequence, rows: Sequence[Sequence], align: str = "---:") -> list[str]:
    line = lambda cells: "| " + " | ".join(str(c) for c in cells) + " |"
    return [line(header), line([align] * len(header)), *(line(r) for r in rows)]


def subplots(nrows: int, ncols: int, w: float = 5.0, h: float = 3.6, **kw):
    """`plt.subplots` (Agg backend: files only) sized to the grid; always a 2-D axes array."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(nrows, ncols, figsize=(w * ncols, h * nrows), squeeze=False, **kw)


def finish_axes(ax, xs: Sequence[int] = (), failed: Sequence[tuple[list, str, str]] = ()) -> None:
    """log2 x-axis ticked at `xs`; each (xs, label, color) of `failed` marked by an 'x' at the top of the
    axes (above the data: the top is raised to make room); grid and legend."""
    if xs:
        ticks = sorted(set(xs))
        ax.set_xscale("log", base=2)
        ax.set_xlim(ticks[0] / 1.3, ticks[-1] * 1.3)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
    if failed:
        lo, hi = ax.get_ylim()
        grow = 0.05 * (len(failed) + 1)
        ax.set_ylim(lo, hi * (1 + 4 * grow) if ax.get_yscale() == "log" else hi + (hi - lo) * grow)
    for level, (fx, label, color) in enumerate(failed):
        y, top = [0.95 - 0.05 * level] * len(fx), ax.get_xaxis_transform()
        ax.scatter(fx, y, marker="x", s=60, color=color, label=label, transform=top, zorder=5)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def save_figure(fig, path: str | Path, title: str | None = None) -> Path:
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
