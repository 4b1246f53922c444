"""Which kernel runs, with which tiles, for one attention call: the one place that decides.

Modelled on FlashAttention-3's hopper/tile_size.h (a pure function of the problem for the tile) and
heuristics.h (a short rule for the run-time choices). The launchers in `kernels/_launch.py` and
`kernels/flash_decode.py` execute the `Plan` they get from `plan_fwd`, `plan_bwd` or `plan_decode`.

* `tile_size(kernel, head_dim, dtype, n_q, n_k, interpret)`: BLOCK_M, BLOCK_N, warps, stages of the Triton
  kernels "fwd", "bwd_dq", "bwd_dkdv" (tuned on the H200, `python -m bench.tune`, bench/NOTES.md).
* `use_gluon(...)`: whether the sm_90 Gluon forward / one-pass backward (FlashAttention-3's schedule) runs
  instead of the Triton FlashAttention-2 kernels (H200 crossovers `MIN_N`, `MIN_N_BWD`).
* TMA (`tma_operand`): whether the backward streams its inner-loop tiles through tensor descriptors.
* Decode: the key tile and split count of flash-decoding (`decode_block_n`, `decode_splits`).

Environment (read here only, on every call): FLASHGPT_GLUON_FWD / FLASHGPT_GLUON_BWD = auto (default: the
crossovers decide), 1 (the Gluon kernel wherever it can run), 0 (never). `python -m kernels` prints the
rule as the markdown table of the README; `describe(...)` says in one line what a training run will run.

Plain torch: importing this module imports no triton (the CPU tests check the rules without it).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ._runtime import interpret_enabled

KERNEL_NAMES = ("fwd", "bwd_dkdv", "bwd_dq")
# Shortest N per head dim that takes the Gluon kernel: the H200 crossover against the Triton forward
# (bench/NOTES.md v13, v15: since the forward is persistent, d = 128 from 1k, d = 64 from 2k).
MIN_N = {64: 2048, 128: 1024}
# The same for the one-pass backward (bench/NOTES.md v14: below it the split Triton backward wins).
MIN_N_BWD = {64: 4096, 128: 2048}
ENV = "FLASHGPT_GLUON_FWD"  # "auto" (default): MIN_N decides; "1": wherever it can run; "0": never
ENV_BWD = "FLASHGPT_GLUON_BWD"  # the same for the backward (MIN_N_BWD)
MAX_DECODE_ROWS = (
    16  # query rows per sequence of flash-decoding: all GROUP * Nq rows of a KV head share a tile
)


# ---------------------------------------------------------------------------------------------
# the plan record
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TileConfig:
    """Launch configuration of one kernel. Blocks are powers of two >= 16 (tl.dot needs >= 16).

    tma: "bwd_dkdv" / "bwd_dq" only: stream the tiles of the inner loop (q/dO, resp. k/v) through
    Hopper tensor descriptors (TMA) where the inputs allow it (`tma_operand`: 16-bit dtype, d a power of
    two, one of two layouts) and the streamed length is a multiple of the block (Nq % BLOCK_M for dK/dV,
    Nk % BLOCK_N for dQ); otherwise the same tile with pointer loads, or `no_tma` if given. Only how tiles
    reach shared memory changes, the arithmetic and the result do not.
    no_tma: the config to launch instead when a `tma=True` config cannot use TMA (a tile that is fast
    with descriptors may spill with pointer loads: the d = 128 dK/dV tile, NOTES v6).
    Decode plans use block_m (query rows), block_n (keys per split tile); num_warps / num_stages 0 there
    mean Triton's defaults.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False
    no_tma: TileConfig | None = None

    def short(self) -> str:
        """e.g. "128x64 w8 s3" (BLOCK_M x BLOCK_N, warps, stages)."""
        return f"{self.block_m}x{self.block_n} w{self.num_warps} s{self.num_stages}"


@dataclass(frozen=True)
class Plan:
    """What one call of one pass runs. Launchers execute it and decide nothing themselves.

    op: "fwd" | "bwd" | "decode". backend: "gluon" (sm_90 FlashAttention-3-style kernel) or "triton".
    block_d: padded head dim of the Triton kernels. tiles: the Triton launches in order: fwd (fwd,),
    bwd (bwd_dq, bwd_dkdv), decode (split,). tma: per tile, the TMA layout codes of the two streamed
    operands (`_tma_pair` of k, v for dQ; of q, dO for dK/dV), or None for pointer loads.
    splits / split_len / pdl: decode only (key splits, keys per split, programmatic dependent launch).
    """

    op: str
    backend: str
    block_d: int = 0
    tiles: tuple[TileConfig, ...] = ()
    tma: tuple[tuple[int, ...] | None, ...] = ()
    splits: int = 0
    split_len: int = 0
    pdl: bool = False


# ---------------------------------------------------------------------------------------------
# tile sizes (FlashAttention-3's tile_size.h): a pure function of the problem
# ---------------------------------------------------------------------------------------------


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def block_d_for(head_dim: int) -> int:
    """Padded head dim BLOCK_D = max(16, next power of two >= head_dim)."""
    return max(16, _next_pow2(head_dim))


def _gpu_tile(kernel: str, block_d: int, dtype: torch.dtype, n: int) -> TileConfig:
    """Hopper tile configs (n = max(Nq, Nk)).

    Checked offline with `python -m kernels.compile_report` (sm_90, GROUP=1): every fp16/bf16 config
    below fits shared memory and compiles without register spills except the d = 128 dK/dV pointer-load
    alternative 64x128x8x2 (4 bytes when N is a multiple of the blocks, 28 otherwise; the TMA tile
    64x64x4x2 spills none, and would spill 116 bytes with pointer loads). The d <= 128 ones use wgmma,
    which ptxas does not serialise (C7515) -- except tiles cut down to a short N (e.g. 64x64x8x2 at
    N <= 64), tiny shapes where it does not matter. float32 runs the IEEE FMA path (no tensor cores; a
    correctness path, not a fast one): its tiles are small to avoid spills.
    """
    if dtype == torch.float32:
        if kernel == "fwd":
            return TileConfig(32, 32, 8, 1) if block_d <= 128 else TileConfig(16, 16, 4, 1)
        if kernel == "bwd_dkdv":
            if block_d <= 64:
                return TileConfig(32, 32, 8, 1)
            return TileConfig(64, 32, 8, 1) if block_d <= 128 else TileConfig(16, 16, 4, 1)
        return TileConfig(32, 32, 8, 1) if block_d <= 64 else TileConfig(16, 16, 4, 1)
    # fp16 / bf16: tuned on the H200 with `python -m bench.tune` (causal bf16, B*N = 16384, H*d = 2048);
    # bench/NOTES.md has the search and the timings. Short sequences (N <= 1024) prefer smaller tiles
    # (more programs in flight); long ones the larger tiles.
    short = n <= 1024
    if kernel == "fwd":
        if block_d <= 64:
            return TileConfig(64, 64, 4, 3) if short else TileConfig(128, 64, 8, 3)
        if block_d <= 128:  # 64x64 at N <= 1024: bench/NOTES.md v5 (measured A/B)
            return TileConfig(64, 64, 4, 3) if short else TileConfig(128, 128, 8, 3)
        return TileConfig(64, 32, 8, 2)
    # Backward: tma=True streams the inner loop's tiles through tensor descriptors where the inputs
    # allow it (else the same tile with pointer loads); `bench.tune --kernels bwd --tma`, NOTES v4.
    # dK/dV re-tuned after the one-loop change (NOTES v5): the 64x128 d=64 tile spills ~900 bytes there.
    if kernel == "bwd_dkdv":
        if block_d <= 64:
            return TileConfig(32, 64, 4, 3)
        if block_d <= 128:
            # one warpgroup, 96.5 KiB: two programs per SM, one's exponentials overlap the other's
            # wgmmas (NOTES v6). With pointer loads this tile spills 116 bytes: then 64x128x8x2.
            return TileConfig(64, 64, 4, 2, tma=True, no_tma=TileConfig(64, 128, 8, 2))
        return TileConfig(32, 32, 8, 1)
    # bwd_dq
    if block_d <= 64:
        return TileConfig(64, 64, 4, 3, tma=True) if short else TileConfig(128, 64, 8, 3, tma=True)
    if block_d <= 128:
        return TileConfig(128, 64, 8, 3, tma=True)
    return TileConfig(32, 32, 8, 1)


@functools.lru_cache(maxsize=1024)
def tile_size(
    kernel: str, head_dim: int, dtype: torch.dtype, n_q: int, n_k: int, interpret: bool = False
) -> TileConfig:
    """The default tile of `kernel` in KERNEL_NAMES (cached: it runs per launch, and at short sequences the
    host time of a call shows in the measured time, bench/NOTES.md v6). Blocks are capped at
    max(16, next_pow2(n)) so short sequences do not launch mostly-empty tiles. Under the interpreter small
    asymmetric blocks (BLOCK_M != BLOCK_N loop bounds, several blocks, the diagonal and the sequence end in
    quick CPU tests)."""
    if interpret:
        cfg = {
            "fwd": TileConfig(32, 16, 4, 1),
            "bwd_dkdv": TileConfig(16, 32, 4, 1),
            "bwd_dq": TileConfig(32, 16, 4, 1),
        }[kernel]
    else:
        cfg = _gpu_tile(kernel, block_d_for(head_dim), dtype, max(n_q, n_k))
    return _capped(cfg, n_q, n_k)


def _capped(cfg: TileConfig, n_q: int, n_k: int) -> TileConfig:
    """cfg (and its no_tma alternative) with blocks capped at max(16, next_pow2(n))."""
    cap_m = max(16, _next_pow2(n_q))
    cap_n = max(16, _next_pow2(n_k))
    alt = _capped(cfg.no_tma, n_q, n_k) if cfg.no_tma is not None else None
    return TileConfig(
        min(cfg.block_m, cap_m), min(cfg.block_n, cap_n), cfg.num_warps, cfg.num_stages, cfg.tma, alt
    )


_OVERRIDES: dict[str, TileConfig] = {}
_FLAG_OVERRIDE: dict[str, bool] = {}


@contextlib.contextmanager
def override_tile_config(*, tma: bool | None = None, **configs: TileConfig) -> Iterator[None]:
    """Temporarily force tile configs, e.g. `with override_tile_config(fwd=TileConfig(32, 16, 4, 1)):`.

    Keys are kernel names (see KERNEL_NAMES); `tma=True/False` forces the tensor-descriptor
    (TMA) loads of both backward kernels on / off where the inputs allow them (None:
    each kernel's `TileConfig.tma`). A kernel that then runs without TMA launches its config's `no_tma`
    tile if it has one, so at d = 128 `tma=False` also changes the dK/dV tile (64x64x4x2 -> 64x128x8x2):
    a comparison of TMA on / off there compares two tiles, not only the loads. Meant for tests and
    tuning; not thread-safe.
    Raises ValueError for an unknown kernel name or a block that is not a power of two >= 16.
    """
    if tma is not None and not isinstance(tma, bool):
        raise ValueError(f"tma must be True, False or None, got {tma!r}")
    for name, cfg in configs.items():
        if name not in KERNEL_NAMES:
            raise ValueError(f"unknown kernel {name!r}; expected one of {KERNEL_NAMES}")
        for blk in (cfg.block_m, cfg.block_n):
            if blk < 16 or blk & (blk - 1):
                raise ValueError(f"{name}: block sizes must be powers of two >= 16, got {cfg}")
    saved, saved_flags = dict(_OVERRIDES), dict(_FLAG_OVERRIDE)
    _OVERRIDES.update(configs)
    if tma is not None:
        _FLAG_OVERRIDE["tma"] = tma
    try:
        yield
    finally:
        _OVERRIDES.clear()
        _OVERRIDES.update(saved)
        _FLAG_OVERRIDE.clear()
        _FLAG_OVERRIDE.update(saved_flags)


def get_tile_config(
    kernel: str,
    head_dim: int,
    dtype: torch.dtype,
    causal: bool,
    n_q: int,
    n_k: int,
    *,
    interpret: bool = False,
) -> TileConfig:
    """The tile `kernel` in KERNEL_NAMES launches with: an `override_tile_config` in force, else `tile_size`.

    head_dim: d (8..256; padded to BLOCK_D); dtype: float16 | bfloat16 | float32; causal: unused (kept for
    tuning); n_q, n_k: query / key lengths; interpret: under TRITON_INTERPRET=1. BLOCK_M always indexes
    query rows, BLOCK_N key rows. Raises ValueError for an unknown kernel name.
    """
    if kernel not in KERNEL_NAMES:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNEL_NAMES}")
    if kernel in _OVERRIDES:
        return _OVERRIDES[kernel]
    return tile_size(kernel, int(head_dim), dtype, int(n_q), int(n_k), bool(interpret))


def tma_override() -> bool | None:
    """The `override_tile_config(tma=...)` in force (True/False), or None (use `TileConfig.tma`)."""
    return _FLAG_OVERRIDE.get("tma")


# ---------------------------------------------------------------------------------------------
# run-time heuristics (FlashAttention-3's heuristics.h): Gluon or Triton, TMA, decode splits
# ---------------------------------------------------------------------------------------------


def mode(env: str = ENV) -> str:
    """FLASHGPT_GLUON_FWD (or `env`, e.g. ENV_BWD): "auto", "0" or "1"; raises ValueError naming the variable
    for anything else."""
    raw = os.environ.get(env, "auto")
    value = raw.strip().lower() or "auto"
    if value not in ("auto", "0", "1"):
        raise ValueError(f"{env}={raw!r}: expected auto (the default), 1 (wherever it runs) or 0 (never)")
    return value


def use_gluon(
    op: str, how: str, d: int, n_q: int, n_k: int, dtype: torch.dtype, plain_causal: bool, mha: bool
) -> bool:
    """The rule of the Gluon kernels on an sm_90 device, given that their operands suit TMA: `op` "fwd" or
    "bwd", `how` the mode of its environment variable, `plain_causal` causal without window, documents,
    dropout or soft-capping and a positive softmax_scale. Nq == Nk, d 64 / 128, bf16 / fp16, N >= MIN_N[d]
    (MIN_N_BWD for the backward; any N with how == "1", never with "0"). The backward also needs one query
    head per KV head (`mha`) and N a multiple of 128 (the caller excludes deterministic runs)."""
    min_n = MIN_N if op == "fwd" else MIN_N_BWD
    if how == "0" or not plain_causal or d not in min_n or n_q != n_k:
        return False
    if dtype not in (torch.bfloat16, torch.float16) or not (how == "1" or n_q >= min_n[d]):
        return False
    return op == "fwd" or (mha and n_q % 128 == 0)


_MODULES: dict = {}  # kernel module name -> the module, or None when Gluon cannot be imported here


def _import(name: str):
    if name not in _MODULES:
        try:
            _MODULES[name] = importlib.import_module(f".{name}", __package__)
        except (ImportError, AssertionError):  # Gluon's import asserts that triton is not in interpreter mode
            _MODULES[name] = None
    return _MODULES[name]


def gluon_fwd():
    """The `_gluon_fwd` module, or None where triton's Gluon does not import (an older triton, or a process
    whose triton was first imported under TRITON_INTERPRET=1). Imported once; importing it registers the
    op `flashgpt::flash_attn_fwd_sm90`."""
    return _import("_gluon_fwd")


def gluon_bwd():
    """The `_gluon_bwd` module (ops `flashgpt::flash_attn_bwd_sm90[_packed]`), or None as `gluon_fwd`."""
    return _import("_gluon_bwd")


def _span(t: torch.Tensor) -> int:
    """Elements from t's first to its last element (a strided view spans more than its numel)."""
    return 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))


def gluon_operand_ok(t: torch.Tensor) -> bool:
    """What the Gluon kernels' TMA descriptors and 32-bit offsets need of a (B, H, N, d) operand: unit last
    stride, rows at least d apart, the other strides positive (no expanded dims) and 16-byte aligned, a
    16-byte aligned first element, and fewer than 2**31 elements spanned."""
    size, d = t.element_size(), t.shape[-1]
    if t.stride(-1) != 1 or t.stride(-2) < d or _span(t) >= 2**31:
        return False
    if any(st <= 0 or (st * size) % 16 for n, st in zip(t.shape[:-1], t.stride()[:-1], strict=True) if n > 1):
        return False
    try:
        return t.data_ptr() % 16 == 0
    except (RuntimeError, NotImplementedError):  # fake / functional tensors while tracing: the offset decides
        return (t.storage_offset() * size) % 16 == 0  # (torch's allocations are 512-byte aligned)


def _gluon_call(
    op, env, q, k, operands, causal, softmax_scale, window, q_doc, dropout_p, softcap, mha
) -> bool:
    """Whether this call runs the Gluon kernel of `op`: `use_gluon` on a CUDA sm_90 device outside the
    interpreter, B * Hq <= 65535 (the backward's grid dimension; the persistent forward has no such limit but
    was not tested above it), `operands` that `gluon_operand_ok` accepts and the kernel module importable.
    Cheap tests first: it runs per call. Raises ValueError for a bad value of `env`, whatever the inputs."""
    how = mode(env)
    if not q.is_cuda:
        return False
    B, Hq, N = q.shape[:3]
    d = int(q.shape[3])  # static (a SymInt under dynamic shapes is not hashable)
    # the Gluon kernels take no variant: window, documents, dropout and soft-capping run the Triton ones
    plain = causal and not window and q_doc is None and not dropout_p and not softcap and softmax_scale > 0
    if not use_gluon(op, how, d, N, k.shape[2], q.dtype, plain, mha) or B * Hq > 65535:
        return False
    if interpret_enabled() or not torch.cuda.is_available() or not all(gluon_operand_ok(t) for t in operands):
        return False
    module = gluon_fwd if op == "fwd" else gluon_bwd
    return torch.cuda.get_device_capability(q.device) == (9, 0) and module() is not None


def tma_operand(t: torch.Tensor, block_d: int):
    """How the Triton backward kernels address t (B, H, N, d) through one 2-D tensor descriptor (TMA) or None.

    Returns (rows, cols, row_b, row_h, col_h): the descriptor spans rows x cols elements from t's
    first element with row stride t.stride(2), and row n of head h in batch b is descriptor row
    b * row_b + h * row_h + n, column h * col_h. Two layouts qualify, those the trainer and the
    benchmark produce: (B, H, N, d) with contiguous heads (rows b*H*N + h*N + n) and the (B, N, H, d)
    memory of a fused qkv projection viewed as (B, H, N, d) (rows b*N + n, heads side by side in a
    row). Anything else, or a tile TMA cannot address (not 16-bit, d != block_d, last stride != 1,
    first element or row stride not 16-byte aligned), gives None and the kernels load through
    pointers. The descriptor itself is built on the device (`_triton_kernels._tma_descriptor`), so
    this is integer arithmetic on the shape only: no host work per call, and traceable with fake
    tensors (torch.compile).
    """
    B, H, N, d = t.shape
    sb, sh, sn, sd = t.stride()
    esz = t.element_size()
    if (
        t.dtype not in (torch.float16, torch.bfloat16)
        or d != block_d
        or sd != 1
        or (t.storage_offset() * esz) % 16
        or (sn * esz) % 16
        or sn < d
    ):
        return None
    if type(t) is torch.Tensor and t.data_ptr() % 16:  # real tensors: the allocation itself too
        return None
    if (H == 1 or sh == N * sn) and (B == 1 or sb == H * N * sn):
        rows, cols, row_b, row_h, col_h = B * H * N, d, H * N, N, 0
    elif (B == 1 or sb == N * sn) and sh >= d and (H - 1) * sh + d <= sn:
        rows, cols, row_b, row_h, col_h = B * N, (H - 1) * sh + d, N, 0, sh
    else:
        return None
    if rows >= 2**31:
        return None
    return rows, cols, row_b, row_h, col_h


def _tma_pair(x: torch.Tensor, y: torch.Tensor, block_d: int):
    """The kernels' TMA layout codes of x and y (1: heads contiguous, 2: fused-qkv rows; see `tma_operand`)
    when both can be streamed through tensor descriptors, else None."""
    tx, ty = tma_operand(x, block_d), tma_operand(y, block_d)
    return None if tx is None or ty is None else (1 if tx[3] else 2, 1 if ty[3] else 2)


def _sizes(q, k) -> tuple[int, ...]:
    """(B, Hq, Nq, d, Hkv, Nk) as ints. Under dynamic-shape tracing they are SymInts: int() specialises
    the graph on them (a guard), which the kernels need anyway (tile choice, EVEN_* constexprs)."""
    B, Hq, Nq, d = (int(x) for x in q.shape)
    return B, Hq, Nq, d, int(k.shape[1]), int(k.shape[2])


def plan_fwd(
    q, k, v, causal: bool, softmax_scale: float, window: int = 0, q_doc=None, dropout_p=0.0, softcap=0.0
) -> Plan:
    """The forward of validated q (B, Hq, Nq, d), k / v (B, Hkv, Nk, d) with unit last strides: the Gluon
    kernel where `_gluon_call` allows (under torch.compile decided while tracing; a graph from Inductor's
    cache keeps the choice it was traced with), else the Triton kernel with `get_tile_config`'s tile.
    Raises ValueError for a bad FLASHGPT_GLUON_FWD (read on every call, on any device)."""
    if _gluon_call(
        "fwd", ENV, q, k, (q, k, v), causal, softmax_scale, window, q_doc, dropout_p, softcap, True
    ):
        return Plan("fwd", "gluon")
    _, _, Nq, d, _, Nk = _sizes(q, k)
    cfg = get_tile_config("fwd", d, q.dtype, causal, Nq, Nk, interpret=interpret_enabled())
    return Plan("fwd", "triton", block_d_for(d), (cfg,))


def plan_bwd(
    do,
    q,
    k,
    v,
    o,
    causal: bool,
    softmax_scale: float,
    window=0,
    q_doc=None,
    dropout_p=0.0,
    deterministic=False,
    softcap=0.0,
) -> Plan:
    """The backward: the one-pass Gluon kernel where `_gluon_call` allows and neither `deterministic` nor
    `torch.are_deterministic_algorithms_enabled()` (its dQ is summed by TMA reduce-add in no fixed order;
    the split Triton backward is bitwise reproducible), else the dQ then dK/dV Triton kernels, each with
    TMA loads for whole blocks of operands `tma_operand` accepts (past the sequence end a descriptor would
    read the next head's data) and otherwise pointer loads with the tile's `no_tma` alternative.
    Raises ValueError for a bad FLASHGPT_GLUON_BWD."""
    B, Hq, Nq, d, Hkv, Nk = _sizes(q, k)
    mha = Hkv == Hq and not deterministic and not torch.are_deterministic_algorithms_enabled()
    if _gluon_call(
        "bwd", ENV_BWD, q, k, (q, k, v, do, o), causal, softmax_scale, window, q_doc, dropout_p, softcap, mha
    ):
        return Plan("bwd", "gluon")
    interp = interpret_enabled()
    block_d = block_d_for(d)
    c_dkdv = get_tile_config("bwd_dkdv", d, q.dtype, causal, Nq, Nk, interpret=interp)
    c_dq = get_tile_config("bwd_dq", d, q.dtype, causal, Nq, Nk, interpret=interp)
    forced = tma_override()
    want_dkdv = (c_dkdv.tma if forced is None else forced) and Nq % c_dkdv.block_m == 0
    want_dq = (c_dq.tma if forced is None else forced) and Nk % c_dq.block_n == 0
    tma_dkdv = _tma_pair(q, do, block_d) if want_dkdv else None
    tma_dq = _tma_pair(k, v, block_d) if want_dq else None
    # a tile chosen for TMA may name another one for pointer loads (TileConfig.no_tma)
    if tma_dkdv is None and c_dkdv.no_tma is not None:
        c_dkdv = c_dkdv.no_tma
    if tma_dq is None and c_dq.no_tma is not None:
        c_dq = c_dq.no_tma
    return Plan("bwd", "triton", block_d, (c_dq, c_dkdv), (tma_dq, tma_dkdv))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int, low: int = 16) -> int:
    return max(low, 1 << (max(1, n) - 1).bit_length())


def decode_block_n(d: int, dtype: torch.dtype, interpret: bool = False) -> int:
    """Keys per tile of the split kernel (16 under the interpreter: small, quick CPU tests).

    128 for d <= 128 in bf16/fp16: the H200 tile sweep (bench/NOTES.md, "Decode tiles"; bf16, Hkv 8,
    group 8, one query row; do_bench_cudagraph) found BLOCK_N = 128 best or within noise of the best in
    every cell: batch 1, d 64: 9.5 -> 7.8 us at L 8k, 24.5 -> 21.8 us at 32k, 71 -> 66 us at 128k;
    d 128, L 8k: 13.4 -> 11.1 us
    (against the 64-key default before; part of the batch-1 gain was the per-call lengths fill that
    cache_seqlens=None no longer launches); within +-2% at batch 16, already at the copy ceiling. Shared
    memory is no limit there: 128 keys x d 128 in bf16 compiled and ran with num_stages 2 and 3 (about
    40 KiB at group 8, 64 KiB at 128 query rows per tile, kernels.compile_report). float32 keeps 64 (not
    swept; 128 x 128 float32 tiles need about 272 KiB at Triton's default 3 stages, over the 227 KiB an
    H100/H200 block may use), d > 128 keeps 32 (not swept).
    """
    if interpret:
        return 16
    if d > 128:
        return 32
    return 64 if dtype == torch.float32 else 128


def decode_splits(n_max: int, block_n: int, programs: int, sms: int | None, d: int) -> int:
    """Key splits per (sequence, KV head), at most one per 4 key tiles and 128 in all.

    GPU (`sms` its multiprocessors), with ``programs`` = B x Hkv (sequence, KV head) pairs and k = 2 programs
    per SM at d <= 64, 1 above: below the SMs, floor(k x SMs / pairs) splits (batch 1, Hkv 8 on the H200's
    132 SMs: 33 at d = 64, 16 at d = 128; batch 16: 2 and 1); from the SMs up, 4 per pair at d <= 64 and 1
    above; never a split of fewer than 4 key tiles. From the H200 sweep of session 13 (bench/NOTES.md,
    "Decode splits, session 13": bf16, Hkv 8, group 4, one query row, K/V cycling through L2-spanning copies,
    PDL launches), best split counts: d = 64 batch 1: 16 at 8k (4 tiles a split), 33 at 16k and 32k
    (20.93 us against 21.9 at 16 splits); d = 64 batch 16: 2; d = 128 batch 1: 16; d = 128 batch 16: 1
    (121.9 us at 8k against 124.2 at 2); batch 64: 4 at d = 64, 1 at d = 128 (470.2 against 486.8 us at 4).
    A d = 128 tile moves twice a d = 64 one's bytes, so one program per SM already keeps enough in flight.
    Without a GPU (`sms` None, the interpreter): 4 programs.
    """
    n_blocks = _cdiv(n_max, block_n)
    programs = max(1, programs)
    if sms is None:
        return max(1, min(n_blocks, 128, _cdiv(4, programs)))
    per_sm = 2 if d <= 64 else 1
    if programs < sms:
        want = max(1, per_sm * sms // programs)
    else:
        want = 4 if d <= 64 else 1
    return max(1, min(max(1, n_blocks // 4), 128, want))


def split_layout(n_max: int, num_splits: int, block_n: int) -> tuple[int, int]:
    """(keys per split, splits) of ``num_splits`` requested splits: a split is a whole number of key
    tiles, and the count is recomputed from that length so that no split is empty for Nmax."""
    split_len = _cdiv(_cdiv(n_max, num_splits), block_n) * block_n
    return split_len, _cdiv(n_max, split_len)


def use_pdl(device: torch.device, traced: bool) -> bool:
    """Whether the split and combine kernels launch with programmatic dependent launch (PDL): on CUDA devices
    of compute capability >= 9.0 (Hopper), in eager calls (a CUDA-graph capture of them included), not under
    the interpreter. Each kernel then waits for its predecessor's completion with ``griddepcontrol.wait``
    before touching memory, so the result is the same; what changes is that its launch overlaps the
    predecessor's execution. Kept out of traced (torch.compile) launches: Inductor's generated launch code
    is not known to pass Triton's ``launch_pdl`` option."""
    if traced or device.type != "cuda" or interpret_enabled():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def _sms(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count  # torch caches the properties


def decode_num_splits(q, k_cache) -> int:
    """The automatic split count of `flash_decode` for q (B, Hq, Nq, d) and k_cache (B, Hkv, Nmax, d)."""
    B, d, Hkv, n_max = int(q.shape[0]), int(q.shape[3]), int(k_cache.shape[1]), int(k_cache.shape[2])
    block_n = decode_block_n(d, q.dtype, interpret_enabled())
    return decode_splits(n_max, block_n, B * Hkv, _sms(q.device), d)


def plan_decode(
    q, k_cache, num_splits: int, traced: bool, tile_n=None, num_warps=None, num_stages=None, pdl=None
) -> Plan:
    """The split and combine launches of flash-decoding: one tile of all GROUP * Nq query rows of a KV head
    by `decode_block_n` keys (or the private overrides of ``python -m bench.decode_tiles``: tile_n,
    num_warps, num_stages, pdl; None keeps the automatic choice), `num_splits` requested splits."""
    _, Hq, Nq, d = (int(x) for x in q.shape)
    Hkv, n_max = int(k_cache.shape[1]), int(k_cache.shape[2])
    block_n = decode_block_n(d, q.dtype, interpret_enabled()) if tile_n is None else tile_n
    tile = TileConfig(_pow2((Hq // Hkv) * Nq), block_n, num_warps or 0, num_stages or 0)
    split_len, splits = split_layout(n_max, num_splits, block_n)
    pdl = use_pdl(q.device, traced) if pdl is None else bool(pdl)
    return Plan("decode", "triton", _pow2(d), (tile,), (), splits, split_len, pdl)


# ---------------------------------------------------------------------------------------------
# the rule as text: README table and a run's one-line description
# ---------------------------------------------------------------------------------------------

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in _DTYPES.items()}.get(dtype, str(dtype).replace("torch.", ""))


def _describe_pass(
    op: str,
    d: int,
    n: int,
    dtype: torch.dtype,
    sm90: bool,
    interp: bool,
    variants: bool,
    deterministic: bool,
    mha: bool = True,
) -> str:
    """What one pass of a causal self-attention (Nq = Nk = n, TMA-friendly layouts; `mha`: one query head per
    KV head) runs, as text."""
    env = ENV if op == "fwd" else ENV_BWD
    if sm90 and not interp and not (op == "bwd" and deterministic):
        if use_gluon(op, mode(env), d, n, n, dtype, not variants, mha):
            return "Gluon FA3 (sm_90)"
    if op == "fwd":
        return "Triton FA2 " + tile_size("fwd", d, dtype, n, n, interp).short()
    tiles = []
    for name in ("bwd_dq", "bwd_dkdv"):
        cfg = tile_size(name, d, dtype, n, n, interp)
        tma = cfg.tma and d == block_d_for(d) and dtype != torch.float32 and not interp
        tma = tma and n % (cfg.block_n if name == "bwd_dq" else cfg.block_m) == 0
        if not tma and cfg.no_tma is not None:
            cfg = cfg.no_tma
        tiles.append(f"{name[4:]} {cfg.short()}{' tma' if tma else ''}")
    return "Triton FA2 split (" + ", ".join(tiles) + ")"


def describe(
    head_dim: int,
    seq_len: int,
    dtype: torch.dtype,
    device,
    deterministic: bool = False,
    *,
    window=None,
    documents: bool = False,
    dropout_p: float = 0.0,
    softcap=None,
    kv_group: int = 1,
) -> str:
    """One line saying which kernels a run of attention=flash launches: forward, backward and decode, for a
    causal self-attention of head dim `head_dim` over `seq_len` tokens in `dtype` on `device` (a CUDA
    device's capability decides the Gluon kernels; CPU: the interpreter), with the variants given (window,
    documents, dropout, softcap: the Triton kernels, said in the line) and `kv_group` query heads per KV
    head (grouped-query attention: the Gluon backward takes one). Assumes the trainer's layouts (16-byte
    aligned, TMA-friendly).
    Raises ValueError for a bad FLASHGPT_GLUON_FWD / _BWD."""
    mode(ENV), mode(ENV_BWD)  # a bad value is an error here too, not only at the first call
    device = torch.device(device)
    sm90 = (
        device.type == "cuda"
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability(device)
        == (
            9,
            0,
        )
    )
    interp = device.type != "cuda"
    variants = bool(window) or documents or bool(dropout_p) or bool(softcap)
    fwd = _describe_pass("fwd", head_dim, seq_len, dtype, sm90, interp, variants, deterministic)
    bwd = _describe_pass(
        "bwd", head_dim, seq_len, dtype, sm90, interp, variants, deterministic, kv_group == 1
    )
    dec = decode_block_n(head_dim, dtype, interp)
    where = "interpreter" if interp else ("sm_90" if sm90 else "cuda")
    cap = f" softcap={softcap:g} (Triton: the Gluon kernels take none)" if softcap else ""
    cap += f" kv_group={kv_group}" if kv_group != 1 else ""
    return (
        f"d={head_dim} N={seq_len} {_dtype_name(dtype)} {where}{cap}: fwd {fwd} | bwd {bwd} | "
        f"decode split-K {_pow2(head_dim)}x{dec}"
    )


def _ranges(d: int) -> list[tuple[str, int]]:
    """(label, representative N) of the sequence lengths between the points where the rule changes for head
    dim d: the long-sequence tiles (N > 1024) and the Gluon crossovers. The representative is the largest
    multiple of 128 in the range (the Gluon backward and the TMA loads need whole blocks), else its start."""
    starts = sorted({1025, MIN_N.get(d, 1025), MIN_N_BWD.get(d, 1025)})
    out, lo = [], 1
    for s in starts:
        hi = s - 1
        label = f"{lo}..{hi}" if hi > lo else str(lo)
        out.append((label, hi // 128 * 128 if hi // 128 * 128 >= lo else lo))
        lo = s
    out.append((f">= {lo}", -(-lo // 128) * 128))
    return out


def table() -> str:
    """The rule as markdown (README, "The kernel"): what attention=flash runs on an H200 / H100 (sm_90) for a
    causal self-attention by head dim, sequence length, dtype and determinism, with FLASHGPT_GLUON_FWD / _BWD
    at their default (auto). Printed by ``python -m kernels``."""
    saved = {e: os.environ.pop(e, None) for e in (ENV, ENV_BWD)}
    try:
        rows = ["| d | N | dtype | deterministic | forward | backward |", "|---|---|---|---|---|---|"]
        cases = [(d, label, n, torch.bfloat16) for d in (64, 128) for label, n in _ranges(d)]
        cases += [(d, "any", 4096, torch.float32) for d in (64, 128)]
        for d, label, n, dtype in cases:
            dt = "bf16, fp16" if dtype == torch.bfloat16 else "fp32"
            fwd = _describe_pass("fwd", d, n, dtype, True, False, False, False)
            bwd = {det: _describe_pass("bwd", d, n, dtype, True, False, False, det) for det in (False, True)}
            if bwd[False] == bwd[True]:
                rows.append(f"| {d} | {label} | {dt} | any | {fwd} | {bwd[False]} |")
            else:
                for det in (False, True):
                    rows.append(f"| {d} | {label} | {dt} | {'yes' if det else 'no'} | {fwd} | {bwd[det]} |")
        rows.append("| other (8..256) | any | any | any | Triton FA2 | Triton FA2 split |")
    finally:
        for e, value in saved.items():
            if value is not None:
                os.environ[e] = value
    notes = (
        "Tiles: BLOCK_M x BLOCK_N, warps, stages (`kernels.plan.tile_size`); tma: the backward streams its "
        "inner loop through tensor descriptors. Window, document masks, dropout and soft-capping (`softcap`) "
        "always run the Triton kernels; so does every GPU other than sm_90, and the CPU (Triton interpreter, "
        "small tiles). "
        "The Gluon backward needs N % 128 == 0, the TMA loads N a multiple of the block. Decoding "
        "(`flash_decode`, "
        f"1..{MAX_DECODE_ROWS} query rows): Triton split-K with 128-key tiles (bf16/fp16, d <= 128), "
        "splits from the SM count. FLASHGPT_GLUON_FWD / FLASHGPT_GLUON_BWD = 1 / 0 force the Gluon kernels "
        "on / off."
    )
    return "\n".join(rows) + "\n\n" + notes
