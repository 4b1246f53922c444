"""What the bench tools share: argument types, timing, the attention providers and their float32 reference,
the read-floor kernel, reading run directories, plots and markdown tables, and the results writers of
`bench.attention` and `bench.decode` (also used by `bench.tune --decode`)."""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kernels.reference import chunked_causal_reference as reference_attention  # noqa: F401 (re-exported)

# ------------------------------------------------------------------------------------------ arguments


def ints(low: int = 1, pow2: bool = False) -> Callable[[str], list[int]]:
    """argparse type of a comma list of integers >= `low` (powers of two with `pow2`); a bad list is a
    usage error (exit 2) naming the option and the value before anything runs."""
    rule = f"powers of two >= {low}" if pow2 else f"integers >= {low}"

    def parse(text: str) -> list[int]:
        try:
            vals = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: must be a comma list of integers") from None
        if not vals:
            raise argparse.ArgumentTypeError(f"{text!r}: is an empty list")
        if any(n < low or (pow2 and n & (n - 1)) for n in vals):
            raise argparse.ArgumentTypeError(f"{text!r}: must be {rule}")
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
        bad = [x for x in vals if x not in valid] or (
            unique and len(set(vals)) != len(vals) and "a name given twice"
        )
        if bad or not vals:
            raise argparse.ArgumentTypeError(
                f"{text!r}: each once, from {', '.join(valid)} (bad: {bad or text!r})"
            )
        return vals

    return parse


DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
DTYPES |= {"fp32": torch.float32, "float32": torch.float32}


def environment(device: torch.device) -> dict:
    """Versions and device facts of a results file (no hostname)."""
    import triton

    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return dict(
        date=date, gpu=gpu, torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda
    )


def default_tag(device: torch.device, cpu: str = "cpu") -> str:
    """'h200' on an H200, else a slug of the GPU name; `cpu` without CUDA."""
    if device.type != "cuda":
        return cpu
    name = torch.cuda.get_device_name(device)
    return "h200" if "H200" in name.upper() else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


# --------------------------------------------------------------------------------------------- timing


def short_error(exc: BaseException, limit: int = 160) -> str:
    """One-line 'Type: first line of message', truncated."""
    msg = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {msg[0] if msg else ''}".strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def classify_exception(exc: BaseException) -> str:
    """Status of a failed provider: "oom" for an out-of-memory error, else "error: <Type: first line>"."""
    if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower():
        return "oom"
    return "error: " + short_error(exc)


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

    def describe(self) -> str:
        if self.device.type != "cuda":
            return f"time.perf_counter median of {self.cpu_reps} reps after 1 warm-up (CPU dry run)"
        slow = f"; calls of >= {self.slow_ms} ms: median of {self.slow_reps} event-timed calls"
        return (
            f"triton.testing.do_bench(return_mode='median', warmup={self.warmup_ms} ms, rep={self.rep_ms} "
            f"ms, grads set to None between reps){slow if self.slow_ms is not None else ''}"
        )

    def _times(self, fn: Callable, n: int, grad_to_none, cuda: bool) -> list[float]:
        times = []
        for _ in range(n):
            for t in grad_to_none or ():
                t.grad = None
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return times

    def __call__(self, fn: Callable[[], object], grad_to_none: Sequence[torch.Tensor] | None = None) -> float:
        if self.device.type != "cuda":
            self._times(fn, 1, grad_to_none, False)  # warm-up
            return float(statistics.median(self._times(fn, self.cpu_reps, grad_to_none, False)))
        from triton.testing import do_bench

        if self.slow_ms is not None:
            fn()  # warm-up (compilation, allocator); do_bench makes the same first call
            first = self._times(fn, 1, grad_to_none, True)
            if first[0] >= self.slow_ms:
                rest = self._times(fn, max(0, self.slow_reps - 1), grad_to_none, True)
                return float(statistics.median(first + rest))
        return float(
            do_bench(
                fn, warmup=self.warmup_ms, rep=self.rep_ms, grad_to_none=grad_to_none, return_mode="median"
            )
        )


# Calls per captured CUDA graph of the decode timings (ms = replay time / GRAPH_CALLS). One graph launch
# costs about a batch-1 decode kernel's time: a decode step pays it once for all layers, so a graph of one
# call would add it to every figure.
GRAPH_CALLS = 20


def l2_copies(q, k, v, kv_bytes: int) -> list[tuple]:
    """(q, k, v) and copies of it, enough that GRAPH_CALLS calls cycling through them touch twice the L2
    between two reads of one copy: a decode step's layers each read their own cache, so re-reading one
    small cache would time the L2, not HBM (H200: 50 MB of L2 against 16.8 MB at batch 1, d 64, 8k)."""
    l2 = getattr(torch.cuda.get_device_properties(k.device), "L2_cache_size", 0)
    n = min(GRAPH_CALLS, max(1, math.ceil(2 * l2 / max(1, kv_bytes))))
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
INJECT_KINDS = ("error", "oom", "wrong")


def check_pairs(b: int, h: int, max_all: int = 8) -> list[tuple[int, int]]:
    """(batch, head) pairs checked against the reference: all when B*H <= `max_all`, else (0, 0), (0, 1)
    and (B-1, H-1): first heads plus the last one, to catch batch/head stride bugs."""
    if b * h <= max_all:
        return [(i, j) for i in range(b) for j in range(h)]
    return list(dict.fromkeys([(0, 0), (0, min(1, h - 1)), (b - 1, h - 1)]))


def take_pairs(t: torch.Tensor, pairs: Sequence[tuple[int, int]]) -> torch.Tensor:
    """t[b, h] stacked for the pairs -> (len(pairs), N, d)."""
    return t.detach()[[p[0] for p in pairs], [p[1] for p in pairs]]


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in float32; inf when anything is not finite (so the check fails)."""
    diff = (a.float() - b.float()).abs()
    return float(diff.max()) if torch.isfinite(diff).all() else float("inf")


def sdpa_backend(name: str):
    """`torch.nn.attention.SDPBackend` of a name in SDPA_BACKENDS."""
    from torch.nn.attention import SDPBackend

    if name not in SDPA_BACKENDS:
        raise ValueError(f"unknown SDPA backend {name!r}; valid: {', '.join(SDPA_BACKENDS)}")
    return getattr(SDPBackend, "MATH" if name == "math" else f"{name.upper()}_ATTENTION")


def naive_impl() -> tuple[Callable, str]:
    """The naive provider, `model.attention.attention(..., "naive")`, and its description."""
    from model.attention import attention

    return (lambda q, k, v: attention(q, k, v, "naive")), "model.attention.attention(backend='naive')"


_FLEX: list = []


def build_provider(name: str, *, n: int, device: torch.device) -> Callable:
    """``fn(q, k, v) -> o`` (causal, scale 1/sqrt(d)) of provider `name`: flash = kernels.flash_attention,
    flash-det the same with deterministic=True (the split Triton backward, bitwise reproducible); naive;
    sdpa-<backend> = F.scaled_dot_product_attention pinned with sdpa_kernel; flex = compiled flex_attention
    with a causal block mask of length `n`. ValueError for an unknown name."""
    if name in ("flash", "flash-det"):
        import kernels

        kernels.check_flash_available(device)
        det = name == "flash-det"
        return lambda q, k, v: kernels.flash_attention(q, k, v, causal=True, deterministic=det)
    if name == "naive":
        return naive_impl()[0]
    if name.startswith("sdpa-") and name[5:] in SDPA_BACKENDS:
        from torch.nn.attention import sdpa_kernel

        backend = sdpa_backend(name[5:])

        def sdpa(q, k, v):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        return sdpa
    if name == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        if not _FLEX:  # compiled once; it recompiles per shape, so a full sweep must not hit the limit
            import torch._dynamo.config as dynamo_config

            dynamo_config.recompile_limit = max(64, dynamo_config.recompile_limit)
            _FLEX.append(torch.compile(flex_attention, dynamic=False))
        mask = create_block_mask(lambda b, h, q, k: q >= k, B=None, H=None, Q_LEN=n, KV_LEN=n, device=device)
        return lambda q, k, v: _FLEX[0](q, k, v, block_mask=mask)
    raise ValueError(f"unknown provider {name!r}; valid: {', '.join(PROVIDERS)}")


def inject_failure(fn: Callable, kind: str) -> Callable:
    """A provider that fails on purpose (testing the bookkeeping): "error" raises RuntimeError, "oom"
    torch.cuda.OutOfMemoryError, "wrong" returns O + 0.5."""
    if kind not in INJECT_KINDS:
        raise ValueError(f"unknown failure kind {kind!r}; valid: {', '.join(INJECT_KINDS)}")

    def failing(q, k, v):
        if kind == "error":
            raise RuntimeError("injected failure (--inject-failure)")
        if kind == "oom":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected by --inject-failure)")
        return fn(q, k, v) + 0.5

    return failing


# ------------------------------------------------------------------------------------------ read floor

# The read-floor provider of bench.decode: a kernel that only reads the K/V cache, once. Any decode kernel
# must read every K/V byte; this one does nothing else (each program sums a chunk of k and v), so its time
# in the same harness is a floor for the attention providers. 2048 programs of 8 warps, BLOCK 2048 were the
# fastest at every decode shape of a sweep on the H200 (bench/NOTES.md, "Decode floor").
FLOOR_PROGRAMS, FLOOR_BLOCK, FLOOR_WARPS = 2048, 2048, 8
_FLOOR_KERNEL: list = []


def _floor_kernel():
    """Built at first use, so that TRITON_INTERPRET set by a dry run is honoured."""
    if not _FLOOR_KERNEL:
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

        _FLOOR_KERNEL.append(read_kernel)
    return _FLOOR_KERNEL[0]


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
            f"sweep directory {root} does not exist (pass the Hydra multirun folder, e.g. "
            "multirun/2025-01-01_12-00-00)"
        )
    found = {p.parent for m in ("summary.json", "metrics.jsonl") for p in root.rglob(m)}
    found |= {p.parent.parent for p in root.rglob("config.yaml") if p.parent.name == ".hydra"}
    found = {
        r
        for r in found
        if not any(x in ("wandb", "ckpt") or x.startswith(".") for x in r.relative_to(root).parts)
    }
    natural = lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]
    return sorted(found, key=lambda p: (len(p.parts), natural(p)))


def read_metrics(run_dir: str | Path, *, required: bool = False) -> list[dict]:
    """Parsed lines of the live branch of `run_dir/metrics.jsonl` (or of that file given itself): the steps
    a resume replayed are dropped (`trainer.metrics.live_branch`); an unparsable line (the torn last line of
    a killed run) is skipped with a warning. Missing file: [] or, with `required`, RunDirError."""
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
            print(f"warning: {path}:{lineno}: unparsable JSON line skipped", file=sys.stderr)
            continue
        if isinstance(obj, dict):
            rows.append(obj)
    from trainer.metrics import live_branch

    return live_branch(rows)


def read_summary(run_dir: str | Path) -> dict:
    """`run_dir/summary.json`, {} when missing or unreadable (warning on stderr)."""
    path = Path(run_dir) / "summary.json"
    if not path.is_file():
        return {}
    try:
        obj = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        print(f"warning: {path}: unreadable summary ({exc})", file=sys.stderr)
        return {}
    return obj if isinstance(obj, dict) else {}


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

    for path in (Path(run_dir) / "config.resolved.yaml", Path(run_dir) / ".hydra" / "config.yaml"):
        if path.is_file():
            try:
                cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
            except Exception as exc:
                print(f"warning: {path}: unreadable config ({exc})", file=sys.stderr)
                return {}
            return cfg if isinstance(cfg, dict) else {}
    return {}


def cfg_get(cfg: dict, dotted: str, default: Any = None) -> Any:
    """cfg['a']['b'] for 'a.b'; `default` when a level is missing."""
    for key in dotted.split("."):
        if not isinstance(cfg, dict) or key not in cfg:
            return default
        cfg = cfg[key]
    return cfg


def _plain(v: Any) -> bool:
    return v is not None and not (isinstance(v, str) and "${" in v)


def attention_label(cfg: dict, summary: dict) -> str | None:
    """Backend label: config attention.name (or older spellings), else the summary's; sdpa pinned to a
    backend is 'sdpa-<backend>'."""
    keys = ("attention.name", "attention.backend", "attention", "model.attention")
    name = next((str(v) for k in keys if _plain(v := cfg_get(cfg, k)) and not isinstance(v, dict)), None)
    if name is None and _plain(summary.get("attention")):
        name = str(summary["attention"])
    if name == "sdpa":
        for key in ("attention.sdpa_backend", "sdpa_backend", "model.sdpa_backend"):
            if _plain(sb := cfg_get(cfg, key)) and str(sb) != "auto":
                return f"sdpa-{sb}"
    return name


def variant_label(cfg: dict) -> str:
    """' w=<window>', ' doc-mask', ' attn-drop=<p>' for the attention variants a config sets, else ''."""
    out = f" w={w}" if _plain(w := cfg_get(cfg, "attention.window")) else ""
    out += " doc-mask" if cfg_get(cfg, "attention.document_mask") is True else ""
    p = cfg_get(cfg, "model.attn_dropout")
    return out + (f" attn-drop={p:g}" if isinstance(p, (int, float)) and p > 0 else "")


def seq_len_of(cfg: dict, summary: dict) -> int | None:
    """Sequence length: config seq_len (or data.seq_len, model.block_size), else the summary's."""
    for v in (cfg_get(cfg, "seq_len"), cfg_get(cfg, "data.seq_len"), cfg_get(cfg, "model.block_size")):
        if _plain(v):
            try:
                return int(v)
            except (TypeError, ValueError):
                pass
    return int(summary["seq_len"]) if isinstance(summary.get("seq_len"), int) else None


def series(rows: list[dict], key: str) -> dict[int, float]:
    """{step: value} of the rows having `key` (a later duplicate step replaces an earlier one), sorted;
    non-numeric values skipped, NaN kept."""
    out: dict[int, float] = {}
    for r in rows:
        try:
            if key in r and "step" in r:
                out[int(r["step"])] = float(r[key])
        except (TypeError, ValueError):
            continue
    return dict(sorted(out.items()))


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# ---------------------------------------------------------------------------------- tables and plots


def md_table(header: Sequence, rows: Sequence[Sequence], align: str = "---:") -> list[str]:
    """Lines of a markdown table."""
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
        y = [0.95 - 0.05 * level] * len(fx)
        ax.scatter(
            fx, y, marker="x", s=60, color=color, label=label, transform=ax.get_xaxis_transform(), zorder=5
        )
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


def write_text(path: Path, text: str) -> None:
    """Write atomically (temporary file, then os.replace): a killed run leaves the old file or the new."""
    from data.prepare import atomic_write

    data = text.encode("utf-8")
    atomic_write(Path(path), lambda f: f.write(data))


# ------------------------------------------------------------------------ bench.attention's results

MODES = ("fwd", "bwd", "fwdbwd")
SPEEDUP_BASELINES = ("sdpa-flash", "flex", "sdpa-cudnn")  # first columns of the speedup table


def _fmt(x: float | None, spec: str | None = None) -> str:
    return "—" if x is None else format(x, spec or (".1f" if abs(x) >= 10 else ".3g"))


def short_status(status: str) -> str:
    return {"oom": "OOM", "mismatch": "FAIL", "error": "ERR"}.get(status.split(":")[0], status)


def _table_modes(records) -> list[str]:
    modes = list(dict.fromkeys(r["mode"] for r in records))
    return [m for m in ("fwd", "bwd") if m in modes] or modes


def attention_markdown(records: Sequence[dict], meta: dict) -> str:
    """Per head dim: TFLOP/s (rows N, columns providers, cells 'fwd / bwd'), speedup of flash over the
    baselines, peak memory, max abs errors; then the failures."""
    idx = {(r["provider"], r["N"], r["d"], r["mode"]): r for r in records}
    providers = list(dict.fromkeys(r["provider"] for r in records))
    ns, modes, tmodes = sorted({r["N"] for r in records}), list(MODES), _table_modes(records)
    first = lambda p, n, d: next((idx[k] for m in modes if (k := (p, n, d, m)) in idx), None)
    inv = meta.get("invocations") or ()
    gluon = [
        f"- flash's forward on sm_90: the Gluon kernel from N = {meta.get('flash_gluon_min_n')} (per d; "
        f"FLASHGPT_GLUON_FWD={meta.get('flash_gluon_fwd')}), the Triton kernel otherwise",
        "- flash's backward on sm_90: the one-pass Gluon kernel from N = "
        f"{meta.get('flash_gluon_min_n_bwd')} (MHA, N % 128 == 0; "
        f"FLASHGPT_GLUON_BWD={meta.get('flash_gluon_bwd')}), the split Triton kernels otherwise",
    ]
    lines = [
        f"# Causal attention benchmark — {meta.get('gpu') or meta.get('device')} ({meta.get('dtype')})",
        "",
        f"- date {meta.get('date')}, torch {meta.get('torch')}, triton {meta.get('triton')}, CUDA "
        f"{meta.get('cuda')}",
        f"- {meta.get('tokens')} tokens per batch (B = tokens // N), hidden {meta.get('hidden')} (H = "
        f"hidden // d); timing: {meta.get('timing')}",
        f"- FLOPs: {meta.get('flops')}",
        *(gluon if meta.get("flash_gluon_min_n") else []),
        "- cells: OOM = out of memory, ERR = cannot run, FAIL = wrong result vs float32 reference (not "
        "timed), — = not measured",
        *(
            f"- merged (`--merge`): N = {i.get('seqlens')}, d = {i.get('headdims')}, providers "
            f"{i.get('providers')}, modes {i.get('modes') or list(MODES)} measured {i.get('date')} (torch "
            f"{i.get('torch')}, triton {i.get('triton')})"
            for i in inv
        ),
        *(
            ["- **incomplete**: the last invocation stopped before measuring every shape it lists"]
            * (meta.get("complete") is False)
        ),
        *(["- **dry run** (CPU plumbing check): numbers are meaningless"] * bool(meta.get("dry_run"))),
    ]
    mode_txt = " / ".join(tmodes)

    def cell(p, n, d) -> str:
        parts = []
        for m in tmodes:
            r = idx.get((p, n, d, m))
            parts.append(
                "—" if r is None else _fmt(r["tflops"]) if r["status"] == "ok" else short_status(r["status"])
            )
        return " / ".join(parts)

    def ratio(b, n, d) -> str:
        parts = []
        for m in tmodes:
            a, r = idx.get(("flash", n, d, m)), idx.get((b, n, d, m))
            if a and r and a["tflops"] and r["tflops"]:
                parts.append(f"{a['tflops'] / r['tflops']:.2f}×")
            else:
                parts.append(short_status(r["status"]) if r is not None and r["status"] != "ok" else "—")
        return " / ".join(parts)

    def memory(r) -> str:
        if r is None or (r.get("peak_gib") is None and r["status"] == "ok"):
            return "—"
        return (
            short_status(r["status"])
            if r.get("peak_gib") is None
            else f"{r['peak_gib']:.2f} / {r['peak_extra_gib']:.2f}"
        )

    def errors(r) -> str:
        errs = (r or {}).get("errors") or {}
        grads = [errs[x] for x in ("dq", "dk", "dv") if x in errs]
        return f"{_fmt(errs.get('o'), '.2e')} / {_fmt(max(grads) if grads else None, '.2e')}"

    for d in sorted({r["d"] for r in records}):
        bh = {r["N"]: f"{r['B']}×{r['H']}" for r in records if r["d"] == d}
        lines += ["", f"## d = {d}: TFLOP/s ({mode_txt})", ""]
        lines += md_table(
            ["N", "B×H", *providers], [[n, bh.get(n, "—"), *(cell(p, n, d) for p in providers)] for n in ns]
        )
        bases = [p for p in SPEEDUP_BASELINES if p in providers]
        bases += [p for p in providers if p not in bases and p != "flash"]
        if "flash" in providers and bases:
            lines += ["", f"### d = {d}: speedup of flash (TFLOP/s ratio, {mode_txt})", ""]
            lines += md_table(
                ["N", *(f"vs {p}" for p in bases)], [[n, *(ratio(b, n, d) for b in bases)] for n in ns]
            )
        if not any(r.get("peak_gib") is not None for r in records):
            lines += ["", f"### d = {d}: peak memory not measured (needs CUDA)"]
        else:
            lines += ["", f"### d = {d}: peak memory of one forward+backward, GiB (total / above inputs)", ""]
            lines += md_table(
                ["N", *providers], [[n, *(memory(first(p, n, d)) for p in providers)] for n in ns]
            )
        lines += ["", f"### d = {d}: max abs error vs float32 reference (O / grads)", ""]
        lines += md_table(["N", *providers], [[n, *(errors(first(p, n, d)) for p in providers)] for n in ns])
    notes: dict = {}
    for r in records:
        if r["status"] != "ok":
            notes.setdefault((r["provider"], r["d"], r["status"]), []).append((r["N"], r["mode"]))
    if notes:
        lines += ["", "## Failures", ""]
        for (p, d, st), where in notes.items():
            n_txt = ",".join(str(x) for x in sorted({w[0] for w in where}))
            lines.append(f"- {p} d={d} N={n_txt} ({','.join(dict.fromkeys(w[1] for w in where))}): {st}")
    return "\n".join(lines) + "\n"


def attention_plot(records: Sequence[dict], path: str | Path, title: str = "") -> Path:
    """Rows = head dims; columns = TFLOP/s vs N per table mode, then peak memory (when measured); one line
    per provider, failures marked at the top of the panel."""
    idx = {(r["provider"], r["N"], r["d"], r["mode"]): r for r in records}
    providers = list(dict.fromkeys(r["provider"] for r in records))
    ds, ns, modes = (
        sorted({r["d"] for r in records}) or [0],
        sorted({r["N"] for r in records}),
        _table_modes(records),
    )
    panels = modes + (["mem"] if any(r.get("peak_gib") is not None for r in records) else [])
    fig, axes = subplots(len(ds), len(panels))
    for i, d in enumerate(ds):
        for j, m in enumerate(panels):
            ax, failures = axes[i][j], []
            for c, p in enumerate(providers):
                rs = [r for n in ns if (r := idx.get((p, n, d, modes[0] if m == "mem" else m)))]
                ys = [r.get("peak_gib") if m == "mem" else r["tflops"] for r in rs]
                ok = [
                    (r["N"], y) for r, y in zip(rs, ys, strict=True) if r["status"] == "ok" and y is not None
                ]
                if ok:
                    ax.plot(*zip(*ok, strict=True), marker="o", ms=3, label=p, color=f"C{c % 10}")
                if bad := [r for r in rs if r["status"] != "ok"]:
                    kinds = "/".join(dict.fromkeys(short_status(r["status"]) for r in bad))
                    failures.append(([r["N"] for r in bad], f"{p} {kinds}", f"C{c % 10}"))
            if m == "mem":  # quadratic (naive) vs linear memory: a log scale keeps both readable
                ax.set_ylabel("peak GiB (fwd+bwd)")
                if ax.lines:
                    ax.set_yscale("log", base=2)
            else:
                ax.set_ylabel("TFLOP/s")
                ax.set_ylim(bottom=0)
            ax.set_xlabel("sequence length N")
            ax.set_title(f"d={d} {'peak memory' if m == 'mem' else m}")
            finish_axes(ax, ns, failures)
    return save_figure(fig, path, title)


def merge_records(old: Sequence[dict], new: Sequence[dict]) -> list[dict]:
    """`old` with the records of the same (provider, N, d, mode) replaced by `new` ones, then the other new
    ones (a sweep split over several invocations of one tag)."""
    key = lambda r: (r["provider"], r["N"], r["d"], r["mode"])
    fresh = {key(r): r for r in new}
    merged = [fresh.pop(key(r), r) for r in old]
    return merged + [r for r in new if key(r) in fresh]


INVOCATION_KEYS = ("date", "seqlens", "headdims", "providers", "modes", "torch", "triton", "gpu")
MERGE_MUST_MATCH = ("device", "gpu", "dtype", "tokens", "hidden", "dry_run")  # one table header holds them


def read_for_merge(path: Path) -> tuple[list[dict], dict]:
    """(records, metadata) of an attention results JSON, checked to have the shape bench.attention writes.
    ValueError naming what is wrong; OSError when unreadable."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("records"), list):
        raise ValueError('expected an object with a "records" list')
    meta = data.get("metadata", {})
    if not isinstance(meta, dict):
        raise ValueError('"metadata" must be an object')
    is_int = lambda x: isinstance(x, int) and not isinstance(x, bool)
    is_str = lambda x: isinstance(x, str)
    for r in data["records"]:
        if not (isinstance(r, dict) and is_str(r.get("provider")) and is_str(r.get("mode"))):
            raise ValueError(f"a record needs provider, mode (strings), N, d (integers): {str(r)[:80]}")
        if not (is_int(r.get("N")) and is_int(r.get("d"))):
            raise ValueError(f"a record needs provider, mode (strings), N, d (integers): {str(r)[:80]}")
    invocations = meta.get("invocations", [])
    if not isinstance(invocations, list) or not all(isinstance(m, dict) for m in invocations):
        raise ValueError('"metadata.invocations" must be a list of objects')
    for m in (meta, *invocations):
        for key, ok in (("seqlens", is_int), ("headdims", is_int), ("providers", is_str), ("modes", is_str)):
            if key in m and not (isinstance(m[key], list) and all(ok(x) for x in m[key])):
                raise ValueError(
                    f'metadata "{key}" must be a list of {"integers" if ok is is_int else "strings"}'
                )
    return data["records"], meta


def merge_clash(previous_meta: dict, meta: dict) -> str | None:
    """The table-wide settings that differ between an existing file and this invocation, or None."""
    diffs = [
        f"{k}={previous_meta[k]!r} (now {meta.get(k)!r})"
        for k in MERGE_MUST_MATCH
        if k in previous_meta and previous_meta[k] != meta.get(k)
    ]
    return ", ".join(diffs) or None


def merged_invocations(previous_meta: dict, meta: dict) -> list[dict]:
    """The invocations a merged file holds rows of, oldest first: the earlier ones (or `previous_meta`
    itself), less those whose every (N, d, provider, mode) this one measured again, then this one."""

    def cells(m: dict) -> set:
        return {
            (n, d, p, mode)
            for n in m.get("seqlens") or ()
            for d in m.get("headdims") or ()
            for p in m.get("providers") or ()
            for mode in m.get("modes") or MODES
        }

    earlier = previous_meta.get("invocations") or ([previous_meta] if previous_meta else [])
    kept = [m for m in earlier if not (cells(m) and cells(m) <= cells(meta))]
    return [{k: m.get(k) for k in INVOCATION_KEYS} for m in (*kept, meta)]


def write_attention(records, meta: dict, out_dir: str | Path, tag: str, png: bool = True) -> dict[str, Path]:
    """attention_<tag>.json and .md (and .png unless `png` is False) in `out_dir`; the paths written."""
    paths = {ext: Path(out_dir) / f"attention_{tag}.{ext}" for ext in ("json", "md", "png")}
    paths["json"].parent.mkdir(parents=True, exist_ok=True)
    write_text(paths["json"], compact_json({"metadata": meta, "records": list(records)}))
    write_text(paths["md"], attention_markdown(records, meta))
    if not png:
        del paths["png"]
        return paths
    attention_plot(
        records,
        paths["png"],
        f"causal attention, {meta.get('gpu') or meta.get('device')}, {meta.get('dtype')}",
    )
    return paths


# --------------------------------------------------------------------------- bench.decode's results

DECODE_PROVIDERS = (
    "flash-decode",
    "read-floor",
    "naive",
    "sdpa-auto",
    "sdpa-flash",
    "sdpa-cudnn",
    "sdpa-efficient",
)
DECODE_PROVIDERS += ("sdpa-math",)


def decode_markdown(meta: dict, kernel: list[dict], e2e: list[dict]) -> str:
    """Kernel sweep (ms / GB/s per provider and shape) and end-to-end generation tables."""
    lines = [f"# Decode benchmark ({meta['device']}, {meta['dtype']})", ""]
    if not meta.get("complete", True):  # files of older runs have no flag: they were written at the end
        lines += [
            f"**Incomplete**: the run stopped (or is still running) after {len(kernel)} kernel and "
            f"{len(e2e)} end-to-end records; missing cells were not measured.",
            "",
        ]
    calls, ceiling = meta.get("graph_calls", 1), meta["copy_ceiling_gbs"]
    eager_only = meta.get("eager_only_ms") if meta.get("graphs") else None
    lines += [
        f"Copy ceiling: {ceiling:.0f} GB/s. Cells: ms / GB/s of K/V read (fraction of the ceiling). Where "
        f"the JSON's `timing` says cuda_graph, ms = replay time of one CUDA graph of {calls} back-to-back "
        f"calls / {calls} (kernel time, graph launch shared; the calls cycle through copies of the inputs "
        "spanning twice the L2 cache, so K/V come from HBM; `ms_eager` there: called from Python), else ms "
        "of eager calls"
        + (
            f" (cells marked e: calls of {eager_only:g} ms or more eagerly are not also timed as a graph, "
            "since launch overhead is then a few percent at most and the cache far bigger than the L2)."
            if eager_only is not None
            else "."
        ),
        "",
    ]

    def cell(r: dict | None) -> str:
        if r is None:
            return "-"
        if r.get("status") != "ok":
            return r["status"].split(":")[0]
        text = f"{r['ms']:.3f} / {r['gbs']:.0f} ({r['gbs'] / ceiling:.0%})"
        return text + (" e" if eager_only and r.get("timing") == "eager" else "")

    providers = sorted({r["provider"] for r in kernel if r["provider"] != "*"}, key=DECODE_PROVIDERS.index)
    if kernel:
        index = {(r["d"], r["group"], r["batch"], r["context"], r["provider"]): r for r in kernel}
        shapes = sorted({(r["d"], r["group"], r["batch"], r["context"]) for r in kernel})
        rows = [[*s, *(cell(index.get((*s, p), index.get((*s, "*")))) for p in providers)] for s in shapes]
        lines += md_table(["d", "group", "batch", "context", *providers], rows, "---")
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
            cb, n = r.get("compile_backend"), r.get("recompiles")
            note = (
                [f"torch.compile backend {cb!r} (dry run: no Inductor)"]
                if cb not in (None, "inductor")
                else []
            )
            note = "; ".join(note + ([f"{n} graph(s) compiled inside the timed run"] if n else []))
            speed = (
                [f"{r['prefill_tokens_per_sec']:.0f}", f"{r['decode_tokens_per_sec']:.0f}"]
                if r["status"] == "ok"
                else [r["status"], ""]
            )
            mode = r.get("mode", "static" if r["static_decode"] else "eager")  # older files: no mode
            rows.append([r["backend"], mode, r["batch"], *speed, note])
        lines += md_table(["backend", "mode", "batch", "prefill tok/s", "decode tok/s", "note"], rows, "---")
    return "\n".join(lines) + "\n"


class Results:
    """A results JSON (`meta` and record lists) and its markdown, rewritten atomically by `save`: after
    every shape with complete False, at the end with True, so a run killed part-way keeps what it measured."""

    def __init__(self, path: Path, meta: dict, markdown: Callable[..., str], **lists: list):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.meta, self.markdown, self.lists = path, meta, markdown, lists

    def add(self, name: str, records: list[dict]) -> None:
        self.lists[name] += records
        self.save()

    def save(self, complete: bool = False) -> str:
        self.meta["complete"] = complete
        write_text(self.path, compact_json(dict(meta=self.meta, **self.lists)))
        report = self.markdown(self.meta, *self.lists.values())
        write_text(self.path.with_suffix(".md"), report)
        return report


def rewrite_decode_report(path: Path) -> str:
    """Rewrite the markdown beside a bench.decode results JSON (`--report`); ValueError naming the problem."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:  # missing, a directory, not JSON
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict) or not {"meta", "kernel", "e2e"} <= data.keys():
        raise ValueError(f"{path} is not a bench.decode results file (no meta, kernel and e2e)")
    try:
        report = decode_markdown(data["meta"], data["kernel"], data["e2e"])
    except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
        raise ValueError(
            f"{path}: records or meta not as bench.decode writes them ({type(e).__name__}: {e})"
        ) from e
    write_text(path.with_suffix(".md"), report)
    return report
