"""Which kernel runs, with which tiles, for one attention call: the one place that decides.

After FlashAttention-3's hopper/tile_size.h (the tile, a pure function of the problem) and heuristics.h (a
short rule for the run-time choices): `tile_size` (Triton tiles, tuned on the H200 with `python -m
bench.tune`), `use_gluon` (the sm_90 Gluon kernels from the H200 crossovers MIN_N, MIN_N_BWD), `tma_operand`
(TMA loads of the backward), `decode_block_n` / `decode_splits` (flash-decoding). The launchers execute the
`Plan` of `plan_fwd`, `plan_bwd` or `plan_decode`. FLASHGPT_GLUON_FWD / _BWD are read here, on every call.
Plain torch: importing this module imports no triton.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ._runtime import cdiv, interpret_enabled

KERNEL_NAMES = ("fwd", "bwd_dkdv", "bwd_dq")
# Shortest N per head dim that takes the Gluon kernel: the H200 crossover against the Triton forward
# (bench/NOTES.md v13, v15: since the forward is persistent, d = 128 from 1k, d = 64 from 2k).
MIN_N = {64: 2048, 128: 1024}
# The same for the one-pass backward (bench/NOTES.md v14: below it the split Triton backward wins).
MIN_N_BWD = {64: 4096, 128: 2048}
ENV = "FLASHGPT_GLUON_FWD"  # "auto" (default): MIN_N decides; "1": wherever it can run; "0": never
ENV_BWD = "FLASHGPT_GLUON_BWD"  # the same for the backward (MIN_N_BWD)
MAX_DECODE_ROWS = 16  # query rows per sequence of flash-decoding (a KV head's GROUP * Nq: one tile)


# ---------------------------------------------------------------------------------------------
# the plan record
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TileConfig:
    """Launch configuration of one kernel; blocks are powers of two >= 16 (tl.dot needs >= 16).

    tma (backward kernels): stream the inner loop's tiles through tensor descriptors where `plan_bwd`
    allows, else pointer loads with the same tile, or `no_tma` if given (a tile fast with descriptors may
    spill with pointer loads: d = 128 dK/dV, NOTES v6). The result does not change. Decode: num_warps /
    num_stages 0 mean Triton's defaults.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False
    no_tma: TileConfig | None = None

    def launched(self, tma: bool) -> TileConfig:
        """The tile that launches: this one with TMA loads, else its `no_tma` if it has one."""
        return self if tma or self.no_tma is None else self.no_tma

    def short(self) -> str:
        """e.g. "128x64 w8 s3" (BLOCK_M x BLOCK_N, warps, stages)."""
        return f"{self.block_m}x{self.block_n} w{self.num_warps} s{self.num_stages}"


@dataclass(frozen=True)
class Plan:
    """What one call of one pass runs. op: "fwd" | "bwd" | "decode"; backend: "gluon" | "triton"; block_d:
    the padded head dim; tiles: the Triton launches in order (fwd; bwd_dq, bwd_dkdv; decode split); tma:
    per tile the `_tma_pair` codes of its streamed operands or None; splits, split_len, pdl: decode only."""

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


def _pow2(n: int, low: int = 16) -> int:
    """max(low, the next power of two >= n)."""
    return max(low, 1 << (max(1, int(n)) - 1).bit_length())


def block_d_for(head_dim: int) -> int:
    """Padded head dim BLOCK_D of the Triton kernels."""
    return _pow2(head_dim)


# Hopper tiles of fp16 / bf16 per kernel and head-dim class (BLOCK_D <= 64, <= 128, 256): (the tile at
# N <= 1024, above: short sequences prefer more programs in flight). H200-tuned (`python -m bench.tune`,
# causal bf16, B*N = 16384, H*d = 2048; bench/NOTES.md v4-v6). `python -m kernels.compile_report` (sm_90):
# each fits shared memory without spills except the d = 128 dK/dV pointer-load 64x128x8x2 (4 bytes at whole
# blocks, 28 otherwise), and the d <= 128 ones keep wgmma asynchronous.
_TILES = {
    "fwd": (
        (TileConfig(64, 64, 4, 3), TileConfig(128, 64, 8, 3)),
        (TileConfig(64, 64, 4, 3), TileConfig(128, 128, 8, 3)),  # 64x64 at N <= 1024: NOTES v5 (A/B)
        (TileConfig(64, 32, 8, 2),) * 2,
    ),
    # re-tuned after the one-loop change (NOTES v5): 64x128 at d = 64 spills ~900 bytes there. d = 128: one
    # warpgroup, 96.5 KiB, two programs per SM, one's exponentials under the other's wgmmas (NOTES v6); it
    # spills 116 bytes with pointer loads, which take 64x128x8x2 instead
    "bwd_dkdv": (
        (TileConfig(32, 64, 4, 3),) * 2,
        (TileConfig(64, 64, 4, 2, tma=True, no_tma=TileConfig(64, 128, 8, 2)),) * 2,
        (TileConfig(32, 32, 8, 1),) * 2,
    ),
    "bwd_dq": (
        (TileConfig(64, 64, 4, 3, tma=True), TileConfig(128, 64, 8, 3, tma=True)),
        (TileConfig(128, 64, 8, 3, tma=True),) * 2,
        (TileConfig(32, 32, 8, 1),) * 2,
    ),
}
# float32 runs the IEEE FMA path (a correctness path, not a fast one): small tiles against spills
_TILES_FP32 = {
    "fwd": (TileConfig(32, 32, 8, 1), TileConfig(32, 32, 8, 1), TileConfig(16, 16, 4, 1)),
    "bwd_dkdv": (TileConfig(32, 32, 8, 1), TileConfig(64, 32, 8, 1), TileConfig(16, 16, 4, 1)),
    "bwd_dq": (TileConfig(32, 32, 8, 1), TileConfig(16, 16, 4, 1), TileConfig(16, 16, 4, 1)),
}
# the interpreter: small asymmetric blocks, so quick CPU tests see several blocks, the diagonal and the end
_TILES_INTERPRETER = {
    "fwd": TileConfig(32, 16, 4, 1),
    "bwd_dkdv": TileConfig(16, 32, 4, 1),
    "bwd_dq": TileConfig(32, 16, 4, 1),
}


@functools.lru_cache(maxsize=1024)
def tile_size(
    kernel: str, head_dim: int, dtype: torch.dtype, n_q: int, n_k: int, interpret: bool = False
) -> TileConfig:
    """The default tile of `kernel` from the tables above, blocks capped at _pow2(n) (cached: at short
    sequences a call's host time shows, NOTES v6)."""
    if interpret:
        cfg = _TILES_INTERPRETER[kernel]
    else:
        block_d = block_d_for(head_dim)
        size = 0 if block_d <= 64 else 1 if block_d <= 128 else 2
        fp32 = dtype == torch.float32
        cfg = _TILES_FP32[kernel][size] if fp32 else _TILES[kernel][size][max(n_q, n_k) > 1024]
    return _capped(cfg, n_q, n_k)


def _capped(cfg: TileConfig, n_q: int, n_k: int) -> TileConfig:
    """cfg (and its no_tma alternative) with blocks capped at _pow2(n)."""
    cap_m, cap_n = _pow2(n_q), _pow2(n_k)
    alt = _capped(cfg.no_tma, n_q, n_k) if cfg.no_tma is not None else None
    return TileConfig(
        min(cfg.block_m, cap_m), min(cfg.block_n, cap_n), cfg.num_warps, cfg.num_stages, cfg.tma, alt
    )


_OVERRIDES: dict = {}  # kernel name -> TileConfig, and "tma" -> bool (`override_tile_config`)


@contextlib.contextmanager
def override_tile_config(*, tma: bool | None = None, **configs: TileConfig) -> Iterator[None]:
    """Temporarily force tiles, e.g. `with override_tile_config(fwd=TileConfig(32, 16, 4, 1)):` (tests and
    tuning; not thread-safe). tma=True/False forces the backward's TMA loads on / off where the inputs allow
    (a tile without TMA launches its `no_tma`, so at d = 128 tma=False also changes the dK/dV tile).
    ValueError for an unknown kernel name or a block that is not a power of two >= 16."""
    if tma is not None and not isinstance(tma, bool):
        raise ValueError(f"tma must be True, False or None, got {tma!r}")
    for name, cfg in configs.items():
        if name not in KERNEL_NAMES:
            raise ValueError(f"unknown kernel {name!r}; expected one of {KERNEL_NAMES}")
        for blk in (cfg.block_m, cfg.block_n):
            if blk < 16 or blk & (blk - 1):
                raise ValueError(f"{name}: block sizes must be powers of two >= 16, got {cfg}")
    saved = dict(_OVERRIDES)
    _OVERRIDES.update(configs, **({} if tma is None else {"tma": tma}))
    try:
        yield
    finally:
        _OVERRIDES.clear()
        _OVERRIDES.update(saved)


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
    """The tile `kernel` launches with: an `override_tile_config` in force, else `tile_size` (causal is
    unused, kept for the tuning tools). ValueError for an unknown kernel name."""
    if kernel not in KERNEL_NAMES:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNEL_NAMES}")
    if kernel in _OVERRIDES:
        return _OVERRIDES[kernel]
    return tile_size(kernel, int(head_dim), dtype, int(n_q), int(n_k), bool(interpret))


def tma_override() -> bool | None:
    """The `override_tile_config(tma=...)` in force (True/False), or None (use `TileConfig.tma`)."""
    return _OVERRIDES.get("tma")


# ---------------------------------------------------------------------------------------------
# run-time heuristics (FlashAttention-3's heuristics.h): Gluon or Triton, TMA, decode splits
# ---------------------------------------------------------------------------------------------


def mode(env: str = ENV) -> str:
    """FLASHGPT_GLUON_FWD (or `env`): "auto", "0" or "1"; ValueError naming the variable otherwise."""
    raw = os.environ.get(env, "auto")
    value = raw.strip().lower() or "auto"
    if value not in ("auto", "0", "1"):
        raise ValueError(f"{env}={raw!r}: expected auto (the default), 1 (wherever it runs) or 0 (never)")
    return value


def use_gluon(
    op: str, how: str, d: int, n_q: int, n_k: int, dtype: torch.dtype, plain_causal: bool, mha: bool
) -> bool:
    """The Gluon rule on sm_90 for TMA-able operands: plain causal (no variant, scale > 0), Nq == Nk, d 64 /
    128, 16-bit, N >= MIN_N[d] (MIN_N_BWD; any N with how "1", none with "0"); the backward also needs
    `mha` (one query head per KV head, not deterministic) and N % 128 == 0."""
    min_n = MIN_N if op == "fwd" else MIN_N_BWD
    if how == "0" or not plain_causal or d not in min_n or n_q != n_k:
        return False
    if dtype not in (torch.bfloat16, torch.float16) or not (how == "1" or n_q >= min_n[d]):
        return False
    return op == "fwd" or (mha and n_q % 128 == 0)


_GLUON: dict = {}  # "fwd" / "bwd" -> its Gluon module, or None where Gluon cannot be imported


def gluon(op: str):
    """The `_gluon_fwd` / `_gluon_bwd` module (importing it registers its ops), or None where Gluon does not
    import (an older triton, or triton first imported under TRITON_INTERPRET=1)."""
    if op not in _GLUON:
        try:
            _GLUON[op] = importlib.import_module(f"._gluon_{op}", __package__)
        except (ImportError, AssertionError):  # Gluon's import asserts that triton is not in interpreter mode
            _GLUON[op] = None
    return _GLUON[op]


def _span(t: torch.Tensor) -> int:
    """Elements from t's first to its last element (a strided view spans more than its numel)."""
    return 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))


def gluon_operand_ok(t: torch.Tensor) -> bool:
    """What the Gluon kernels' TMA descriptors and 32-bit offsets need of a (B, H, N, d) operand: unit last
    stride, rows >= d apart, other strides positive and 16-byte aligned, an aligned start, span < 2**31."""
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
    """Whether this call runs the Gluon kernel of `op`: `use_gluon`, CUDA sm_90 outside the interpreter,
    B * Hq <= 65535 (the backward's grid; the forward was not tested above it), `gluon_operand_ok` operands,
    the module importable. Cheap tests first (it runs per call); ValueError for a bad `env` on any input."""
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
    return torch.cuda.get_device_capability(q.device) == (9, 0) and gluon(op) is not None


def tma_operand(t: torch.Tensor, block_d: int):
    """How the Triton backward addresses t (B, H, N, d) through one 2-D tensor descriptor, or None (pointer
    loads). (rows, cols, row_b, row_h, col_h): row n of head h in batch b is descriptor row b * row_b +
    h * row_h + n, column h * col_h. Two layouts qualify: contiguous heads, and the (B, N, H, d) memory of a
    fused qkv projection; 16-bit, d == block_d, 16-byte aligned. Shape arithmetic only (traceable)."""
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
    """The TMA layout codes of x and y (1: heads contiguous, 2: fused-qkv rows) if both qualify, else None."""
    tx, ty = tma_operand(x, block_d), tma_operand(y, block_d)
    return None if tx is None or ty is None else (1 if tx[3] else 2, 1 if ty[3] else 2)


def _sizes(q, k) -> tuple[int, ...]:
    """(B, Hq, Nq, d, Hkv, Nk) as ints: under dynamic shapes int() guards on them, which the tiles need."""
    B, Hq, Nq, d = (int(x) for x in q.shape)
    return B, Hq, Nq, d, int(k.shape[1]), int(k.shape[2])


def plan_fwd(
    q, k, v, causal: bool, softmax_scale: float, window: int = 0, q_doc=None, dropout_p=0.0, softcap=0.0
) -> Plan:
    """The forward of validated inputs with unit last strides: Gluon where `_gluon_call` allows (under
    torch.compile decided while tracing), else the Triton kernel. ValueError for a bad FLASHGPT_GLUON_FWD."""
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
    """The backward: the one-pass Gluon kernel where `_gluon_call` allows and determinism is not asked for
    (its dQ reduce-add has no fixed order), else dQ then dK/dV in Triton, with TMA loads for whole blocks
    only (past the end a descriptor reads the next head). ValueError for a bad FLASHGPT_GLUON_BWD."""
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
    c_dq, c_dkdv = c_dq.launched(tma_dq is not None), c_dkdv.launched(tma_dkdv is not None)
    return Plan("bwd", "triton", block_d, (c_dq, c_dkdv), (tma_dq, tma_dkdv))


def decode_block_n(d: int, dtype: torch.dtype, interpret: bool = False) -> int:
    """Keys per tile of the split kernel (16 under the interpreter). 128 for d <= 128 in bf16/fp16: best or
    within noise in every cell of the H200 sweep (NOTES "Decode tiles": batch 1, d 64: 9.5 -> 7.8 us at L 8k,
    71 -> 66 us at 128k; d 128, L 8k: 13.4 -> 11.1 us against 64 keys; +-2% at batch 16). float32 keeps 64
    (128 x 128 fp32 tiles need ~272 KiB at 3 stages), d > 128 keeps 32 (neither swept)."""
    if interpret:
        return 16
    if d > 128:
        return 32
    return 64 if dtype == torch.float32 else 128


def decode_splits(n_max: int, block_n: int, programs: int, sms: int | None, d: int) -> int:
    """Key splits per (sequence, KV head): with `programs` = B x Hkv pairs below the SMs, floor(k x SMs /
    pairs) (k = 2 programs per SM at d <= 64, 1 above: a d = 128 tile moves twice the bytes); from the SMs
    up 4 per pair at d <= 64, 1 above; never under 4 key tiles a split, at most 128. H200 sweep (NOTES "Decode
    splits, session 13"): d 64 batch 1: 33 at 16k-32k (20.93 us against 21.9 at 16); d 128 batch 16: 1
    (121.9 us against 124.2 at 2); batch 64: 470.2 against 486.8 us at 4. Without a GPU: 4 programs."""
    n_blocks = cdiv(n_max, block_n)
    programs = max(1, programs)
    if sms is None:
        return max(1, min(n_blocks, 128, cdiv(4, programs)))
    per_sm = 2 if d <= 64 else 1
    if programs < sms:
        want = max(1, per_sm * sms // programs)
    else:
        want = 4 if d <= 64 else 1
    return max(1, min(max(1, n_blocks // 4), 128, want))


def split_layout(n_max: int, num_splits: int, block_n: int) -> tuple[int, int]:
    """(keys per split, splits) of `num_splits` requested: whole key tiles, and no split empty for Nmax."""
    split_len = cdiv(cdiv(n_max, num_splits), block_n) * block_n
    return split_len, cdiv(n_max, split_len)


def use_pdl(device: torch.device, traced: bool) -> bool:
    """Programmatic dependent launch of the decode kernels: on sm_90+ in eager calls (CUDA graphs included);
    not in traced launches (Inductor's launch code is not known to pass ``launch_pdl``)."""
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
    """Flash-decoding: one tile of all GROUP * Nq query rows of a KV head by `decode_block_n` keys, or the
    overrides of the decode tile search (tile_n, num_warps, num_stages, pdl; None: automatic)."""
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
    """What one pass of a causal self-attention (Nq = Nk = n, TMA-friendly layouts) runs, as text."""
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
        cfg = cfg.launched(tma)
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
    """One line: the forward, backward and decode kernels a run of attention=flash launches for a causal
    self-attention of `seq_len` tokens on `device`, with its variants and `kv_group` query heads per KV head
    (the trainer's TMA-friendly layouts). ValueError for a bad FLASHGPT_GLUON_FWD / _BWD."""
    mode(ENV), mode(ENV_BWD)  # a bad value is an error here too, not only at the first call
    device = torch.device(device)
    cuda = device.type == "cuda" and torch.cuda.is_available()
    sm90 = cuda and torch.cuda.get_device_capability(device) == (9, 0)
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
    """(label, representative N) of the ranges between the rule's change points for head dim d (N > 1024
    tiles, the Gluon crossovers): the range's largest multiple of 128, else its start."""
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
    """The rule as the README's markdown table (``python -m kernels``): what attention=flash runs on sm_90 by
    head dim, sequence length, dtype and determinism, with FLASHGPT_GLUON_FWD / _BWD at auto."""
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
        "small tiles). The Gluon backward needs N % 128 == 0, the TMA loads N a multiple of the block. "
        f"Decoding (`flash_decode`, 1..{MAX_DECODE_ROWS} query rows): Triton split-K with 128-key tiles "
        "(bf16/fp16, d <= 128), splits from the SM count. FLASHGPT_GLUON_FWD / FLASHGPT_GLUON_BWD = 1 / 0 "
        "force the Gluon kernels on / off."
    )
    return "\n".join(rows) + "\n\n" + notes
