"""Tile configuration of the FlashAttention-2 kernels, kept in one place so it can be tuned.

`get_tile_config(kernel, head_dim, dtype, causal, n_q, n_k)` returns the `TileConfig`
(BLOCK_M, BLOCK_N, num_warps, num_stages) for one of the three kernels:

* "fwd"      : forward; BLOCK_M query rows per program, streams BLOCK_N keys at a time.
* "bwd_dkdv" : dK/dV; BLOCK_N keys per program (outer), streams BLOCK_M query rows at a time.
* "bwd_dq"   : dQ (and Delta = rowsum(dO * O)); BLOCK_M query rows per program, streams BLOCK_N keys.

The backward is the dQ launch followed by the dK/dV launch. A one-launch fused backward was measured
3-7% slower on the H200 (bench/NOTES.md v2, v5) and removed.

The GPU values were tuned on the H200 (`python -m bench.tune`, bench/NOTES.md). Under TRITON_INTERPRET=1
(CPU testing) small blocks are used so the tests are quick and still cover several blocks, the diagonal
and the sequence end.

Tile sizes never change the math: every configuration computes the same result up to float32
rounding (the tests check this with `override_tile_config`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

KERNEL_NAMES = ("fwd", "bwd_dkdv", "bwd_dq")


@dataclass(frozen=True)
class TileConfig:
    """Launch configuration of one kernel. Blocks are powers of two >= 16 (tl.dot needs >= 16).

    tma: "bwd_dkdv" / "bwd_dq" only: stream the tiles of the inner loop (q/dO, resp. k/v) through
    Hopper tensor descriptors (TMA) where the inputs allow it (`kernels.flash_attn._tma_operand`: 16-bit
    dtype, d a power of two, one of two layouts) and the streamed length is a multiple of the block
    (Nq % BLOCK_M for dK/dV, Nk % BLOCK_N for dQ); otherwise the same tile with pointer loads, or
    `no_tma` if given. Only how tiles reach shared memory changes, the arithmetic and the result do not.
    no_tma: the config to launch instead when a `tma=True` config cannot use TMA (a tile that is fast
    with descriptors may spill with pointer loads: the d = 128 dK/dV tile, NOTES v6).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False
    no_tma: TileConfig | None = None


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def block_d_for(head_dim: int) -> int:
    """Padded head dim BLOCK_D = max(16, next power of two >= head_dim)."""
    return max(16, _next_pow2(head_dim))


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


def _gpu_config(kernel: str, block_d: int, dtype: torch.dtype, causal: bool, n: int) -> TileConfig:
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
        if kernel == "bwd_dq":
            return TileConfig(32, 32, 8, 1) if block_d <= 64 else TileConfig(16, 16, 4, 1)
    # fp16 / bf16: tuned on the H200 with `python -m bench.tune` (causal bf16, B*N = 16384, H*d = 2048);
    # bench/NOTES.md has the search and the timings. Short sequences (N <= 1024) prefer smaller tiles
    # (more programs in flight); long ones the larger tiles.
    short = n <= 1024
    if kernel == "fwd":
        if block_d <= 64:
            return TileConfig(64, 64, 4, 3) if short else TileConfig(128, 64, 8, 3)
        if block_d <= 128:  # 64x64 at N <= 1024: bench/results/ab_tiles_h200.log (NOTES v5)
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
    """Choose (BLOCK_M, BLOCK_N, num_warps, num_stages) for `kernel` in KERNEL_NAMES.

    Args:
        kernel: "fwd" | "bwd_dkdv" | "bwd_dq".
        head_dim: d (8..256); the kernels pad it to BLOCK_D = max(16, next_pow2(d)).
        dtype: torch.float16 | torch.bfloat16 | torch.float32 (input dtype).
        causal: causal masking on/off (currently unused; kept for tuning).
        n_q, n_k: query / key sequence lengths; blocks are capped at max(16, next_pow2(n)) so short
            sequences do not launch mostly-empty tiles.
        interpret: True under TRITON_INTERPRET=1 (small CPU-friendly blocks).
    Returns: TileConfig. BLOCK_M always indexes query rows, BLOCK_N key rows.
    Raises: ValueError for an unknown kernel name.
    """
    if kernel not in KERNEL_NAMES:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNEL_NAMES}")
    if kernel in _OVERRIDES:
        return _OVERRIDES[kernel]
    return _default_tile_config(kernel, head_dim, dtype, bool(causal), n_q, n_k, bool(interpret))


@functools.lru_cache(maxsize=1024)
def _default_tile_config(
    kernel: str, head_dim: int, dtype: torch.dtype, causal: bool, n_q: int, n_k: int, interpret: bool
) -> TileConfig:
    """The default of `get_tile_config`, cached: it runs on every launch, and at short sequences the
    host time of a call shows in the measured time (bench/NOTES.md v6)."""
    if interpret:
        # asymmetric on purpose: exercises BLOCK_M != BLOCK_N loop bounds in the CPU tests
        cfg = {
            "fwd": TileConfig(32, 16, 4, 1),
            "bwd_dkdv": TileConfig(16, 32, 4, 1),
            "bwd_dq": TileConfig(32, 16, 4, 1),
        }[kernel]
    else:
        cfg = _gpu_config(kernel, block_d_for(head_dim), dtype, causal, max(n_q, n_k))
    return _capped(cfg, n_q, n_k)


def _capped(cfg: TileConfig, n_q: int, n_k: int) -> TileConfig:
    """cfg (and its no_tma alternative) with blocks capped at max(16, next_pow2(n))."""
    cap_m = max(16, _next_pow2(n_q))
    cap_n = max(16, _next_pow2(n_k))
    alt = _capped(cfg.no_tma, n_q, n_k) if cfg.no_tma is not None else None
    return TileConfig(
        min(cfg.block_m, cap_m), min(cfg.block_n, cap_n), cfg.num_warps, cfg.num_stages, cfg.tma, alt
    )


def tma_override() -> bool | None:
    """The `override_tile_config(tma=...)` in force (True/False), or None (use `TileConfig.tma`)."""
    return _FLAG_OVERRIDE.get("tma")
