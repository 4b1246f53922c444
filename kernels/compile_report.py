"""Offline compile report of the flash kernels for an NVIDIA target -- no GPU needed.

Triton ships ptxas, so the full pipeline (Triton IR -> PTX -> cubin) runs on any machine. For each
(kernel, dtype, head dim) and its tile config from `kernels.plan.get_tile_config` (or explicit
blocks), this prints shared memory, registers per thread, spill bytes and whether Hopper wgmma
is used. Useful to reject configs that spill or exceed shared memory before spending GPU time.

The compile mimics a real launch: pointers and strides divisible by 16 (true when d % 16 == 0 for
contiguous/fused layouts), last-dim strides == 1, GROUP == 1 unless --gqa (Triton specializes
integer arguments equal to 1), sequence lengths not multiples of the blocks (EVEN_M/EVEN_N False;
--even for multiples). `serialized=True` flags ptxas warnings C7513-C7515: every wgmma of the kernel waits for
the previous one (removing it gave +2-12% on the H200 at d = 128; see bench/NOTES.md v5).

Usage:  python -m kernels.compile_report --dtype bf16 fp16 --d 64 128 [--arch 90] [--gqa]
        python -m kernels.compile_report --kernel bwd_dkdv --d 128 --blocks 64 64 --warps 8 --stages 2
"""

import argparse
import re
import subprocess
import tempfile
from dataclasses import dataclass

import torch

from .plan import KERNEL_NAMES, MIN_N, TileConfig, block_d_for, get_tile_config

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
_TL_NAME = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
_TENSORS = ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV")
_F32_TENSORS = ("LSE", "DELTA", "DLSE")
_INTS = ("H_Q", "GROUP", "N_Q", "N_K", "HEAD_DIM", "dk_offset", "dv_offset")  # offsets: 0 unless packed


@dataclass
class CompileInfo:
    kernel: str
    dtype: str
    head_dim: int
    config: TileConfig
    shared_bytes: int
    registers: int | None
    spill_store_bytes: int | None
    spill_load_bytes: int | None
    uses_wgmma: bool
    uses_tma: bool = False
    wgmma_serialized: bool = False  # ptxas C7513-C7515: wgmmas wait for each other

    def line(self) -> str:
        c = self.config
        return (
            f"{self.kernel:9s} {self.dtype:5s} d={self.head_dim:<4d} {c.block_m:>3d}x{c.block_n:<3d} "
            f"w{c.num_warps} s{c.num_stages}  smem={self.shared_bytes / 1024:6.1f} KiB  "
            f"regs={self.registers}  spill st/ld={self.spill_store_bytes}/{self.spill_load_bytes}  "
            f"wgmma={self.uses_wgmma} tma={self.uses_tma} serialized={self.wgmma_serialized}"
        )


def compile_kernel(
    kernel: str,
    dtype: torch.dtype,
    head_dim: int,
    *,
    causal: bool = True,
    config: TileConfig | None = None,
    arch: int = 90,
    gqa: bool = False,
    tma: bool | None = None,
    even: bool = False,
    inductor: bool = False,
    variants: tuple[str, ...] = (),
) -> CompileInfo:
    """Compile one kernel for sm_`arch` without a GPU and return its resource usage.

    kernel: one of KERNEL_NAMES; `config` defaults to `get_tile_config`'s.
    tma: compile "bwd_dkdv" / "bwd_dq" with (True) or without (False) tensor-descriptor (TMA) loads;
        None: as the launcher would (`TileConfig.tma`, 16-bit dtype, d a power of two, `even`). With TMA
        the streamed length is compiled as a multiple of the block (the launcher's condition for TMA).
        Without TMA a config's `no_tma` alternative (default or passed in `config`) is compiled, as
        the launcher runs it.
        "bwd_dq" computes Delta itself, as the launcher runs it.
        Raises ValueError for tma=True where the launcher never uses TMA.
    even: compile as for sequence lengths that are multiples of the blocks (EVEN_M / EVEN_N), the
        case of every benchmark shape; default False (the masked loads of ragged lengths).
    inductor: compile as torch.compile's Inductor compiles a user kernel (the triton ops' launches):
        Python float arguments typed fp64, and debug=True (int32 overflow checks as device asserts,
        from `torch._inductor.config.assert_indirect_indexing`).
    variants: any of "window", "doc", "dropout", "softcap": compile with the sliding window, the document
        ranges (int32 pointers), attention dropout (int64 seed pointer) and / or soft-capping switched on.
    Raises: ValueError for an unknown kernel or variant; triton.CompilationError when the kernel does
        not compile.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ._launch import kernel_module

    if kernel not in KERNEL_NAMES:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNEL_NAMES}")
    if set(variants) - {"window", "doc", "dropout", "softcap"}:
        raise ValueError(
            f"unknown variants {variants!r}; expected a subset of ('window', 'doc', 'dropout', 'softcap')"
        )
    big = 1 << 20
    cfg = config or get_tile_config(kernel, head_dim, dtype, causal, big, big)
    tma_possible = (
        kernel in ("bwd_dkdv", "bwd_dq") and dtype != torch.float32 and head_dim == block_d_for(head_dim)
    )
    if tma is None:
        tma = cfg.tma and tma_possible and even
    elif tma and not tma_possible:
        raise ValueError(
            "TMA loads are used only by bwd_dkdv / bwd_dq with a 16-bit dtype and a "
            f"power-of-two head dim >= 16 (got {kernel}, {dtype}, d={head_dim}); "
            "these run with pointer loads"
        )
    if not tma and cfg.no_tma is not None:
        cfg = cfg.no_tma
    fn = getattr(kernel_module(False), f"_{kernel}_kernel")
    names = fn.arg_names
    block_d = block_d_for(head_dim)
    aligned = head_dim % 16 == 0
    values = dict(
        CAUSAL=causal,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_D=block_d,
        EVEN_M=even,
        EVEN_N=even,
        EVEN_D=head_dim == block_d,
        HAS_DLSE=False,
        DOT_PRECISION="ieee" if dtype == torch.float32 else None,
        TMA_Q=int(tma),  # layout 1: heads contiguous (kernels.plan.tma_operand)
        TMA_DO=int(tma),
        TMA_K=int(tma),
        TMA_V=int(tma),
        HAS_WINDOW="window" in variants,
        HAS_DOC="doc" in variants,
        HAS_DROPOUT="dropout" in variants,
        SOFTCAP="softcap" in variants,
    )
    variant_ptrs = {"Q_DOC": ("doc", "*i32"), "K_DOC": ("doc", "*i32"), "SEED": ("dropout", "*i64")}
    if tma:  # the launcher uses TMA only when the streamed length is a multiple of the block
        values["EVEN_M" if kernel == "bwd_dkdv" else "EVEN_N"] = True
    signature, constants, divisible = {}, {}, []
    for i, name in enumerate(names):
        if name in variant_ptrs:
            if variant_ptrs[name][0] in variants:
                signature[name] = variant_ptrs[name][1]
            else:
                signature[name], constants[name] = "constexpr", None
        elif name == "window":
            signature[name] = "i32"
        elif name == "dropout_p" or (name == "softcap" and "softcap" in variants):
            signature[name] = "fp64" if inductor else "fp32"
        elif name == "softcap":  # None when off, as the launchers pass it
            signature[name], constants[name] = "constexpr", None
        elif name in _TENSORS or name in _F32_TENSORS:
            signature[name] = "*fp32" if name in _F32_TENSORS else "*" + _TL_NAME[dtype]
            divisible.append(i)
        elif name == "GROUP" and not gqa:
            signature[name], constants[name] = "constexpr", 1
        elif name.startswith("stride_") or name in _INTS:
            signature[name] = "i32"
            if aligned and name not in ("H_Q", "GROUP", "N_Q", "N_K"):
                divisible.append(i)
        elif name in ("scale_log2", "softmax_scale"):
            signature[name] = "fp64" if inductor else "fp32"
        else:
            signature[name], constants[name] = "constexpr", values[name]
    src = ASTSource(fn, signature, constants, attrs={(i,): [["tt.divisibility", 16]] for i in divisible})
    compiled = triton.compile(
        src,
        target=GPUTarget("cuda", arch, 32),
        options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, debug=inductor),
    )
    ptx = compiled.asm["ptx"]
    regs, st, ld, ptxas_log = _ptxas_report(ptx, arch)
    return CompileInfo(
        kernel, _TL_NAME[dtype], head_dim, cfg, compiled.metadata.shared, regs, st, ld,
        "wgmma" in ptx, "cp.async.bulk.tensor" in ptx, _wgmma_serialized(ptxas_log),
    )  # fmt: skip


def _wgmma_serialized(ptxas_log: str) -> bool:
    """ptxas warnings C7513-C7515: wgmma instructions made to wait for each other (a register operand
    defined inside the pipeline stage, an accumulator live across it, ...)."""
    return any(code in ptxas_log for code in ("C7513", "C7514", "C7515"))


def compile_gluon_fwd(head_dim: int, dtype: torch.dtype = torch.bfloat16) -> CompileInfo:
    """Compile the sm_90 Gluon forward (kernels/_gluon_fwd.py) without a GPU, as `fwd_launch`
    launches it; `registers` is the kernel-wide budget (the consumer warpgroups raise theirs to 240 with
    setmaxnreg). Raises ValueError for a head dim other than 64 / 128 or a dtype other than bf16 / fp16
    (what `plan.plan_fwd` sends to it), triton.CompilationError when it does not compile."""
    return _compile_gluon("fwd", head_dim, dtype)


def compile_gluon_bwd(head_dim: int, dtype: torch.dtype = torch.bfloat16) -> CompileInfo:
    """Compile the sm_90 Gluon one-pass backward (kernels/_gluon_bwd.py) as `bwd_launch` launches it;
    otherwise as `compile_gluon_fwd` (same errors)."""
    return _compile_gluon("bwd", head_dim, dtype)


def _compile_gluon(which: str, head_dim: int, dtype: torch.dtype) -> CompileInfo:
    if head_dim not in MIN_N or dtype not in (torch.bfloat16, torch.float16):  # before Gluon is imported
        got = f"d={head_dim}, {dtype}"
        raise ValueError(f"the Gluon kernels take d in {sorted(MIN_N)} and bf16 / fp16, got {got}")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    if which == "fwd":
        from . import _gluon_fwd as g

        rows = 64 * g.CONSUMERS[head_dim]  # one 64-row part per consumer warpgroup
        fn, cfg = g._fwd_ws_kernel, TileConfig(rows, 128, g.NUM_WARPS, g.STAGES[head_dim])
    else:
        from . import _gluon_bwd as g

        fn, cfg = g._bwd_ws_kernel, TileConfig(64, 128, g.NUM_WARPS, g.STAGES[head_dim])
    knobs = {"HEAD_D": head_dim, "STAGES": cfg.num_stages}
    maxnreg = g.MAXNREG
    if which == "fwd":
        nc = g.CONSUMERS[head_dim]
        knobs.update(Q_BUFS=g.Q_BUFS[head_dim], NC=nc, REGS=g.REGS[nc])
        maxnreg = g.MAXNREG[nc]
    else:
        knobs["DEFER"] = g.DEFER[head_dim]
    signature, constants = {}, {}
    for name in fn.arg_names:
        if name in knobs:
            signature[name], constants[name] = "constexpr", knobs[name]
        elif name in _TENSORS:
            signature[name] = "*" + _TL_NAME[dtype]
        elif name in _F32_TENSORS or name == "DQ_ACC":
            signature[name] = "*fp32"
        elif name == "COUNTER":
            signature[name] = "*i32"
        else:
            signature[name] = "fp32" if name in ("qk_scale", "softmax_scale", "scale_log2") else "i32"
    compiled = triton.compile(
        GluonASTSource(fn, signature, constants),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=g.NUM_WARPS, maxnreg=maxnreg),
    )
    ptx = compiled.asm["ptx"]
    regs, st, ld, ptxas_log = _ptxas_report(ptx, 90)
    tma, serial = "cp.async.bulk.tensor" in ptx, _wgmma_serialized(ptxas_log)
    name, shared, wgmma = f"gluon_{which}", compiled.metadata.shared, "wgmma" in ptx
    return CompileInfo(name, _TL_NAME[dtype], head_dim, cfg, shared, regs, st, ld, wgmma, tma, serial)


def _ptxas_report(ptx: str, arch: int) -> tuple[int | None, int | None, int | None, str]:
    """(registers, spill store bytes, spill load bytes, ptxas stderr) of PTX assembled for sm_`arch`."""
    import triton

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        suffix = "a" if arch == 90 else ""
        out = subprocess.run(
            [triton.knobs.nvidia.ptxas.path, f"-arch=sm_{arch}{suffix}", "-v", f.name, "-o", "/dev/null"],
            capture_output=True,
            text=True,
        )
    m = re.search(r"Used (\d+) registers", out.stderr)
    regs = int(m.group(1)) if m else None
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out.stderr)
    st, ld = (int(m.group(1)), int(m.group(2))) if m else (None, None)
    return regs, st, ld, out.stderr


def compile_decode_kernel(
    kernel: str,
    dtype: torch.dtype,
    head_dim: int,
    *,
    group: int = 4,
    n_q: int = 1,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    arch: int = 90,
    has_seqlens: bool = True,
    pdl: bool = False,
    softcap: bool = False,
):
    """Compile a flash-decoding kernel (``"split"`` or ``"combine"``, kernels/_decode_kernels.py) for
    sm_`arch` without a GPU, as ``kernels.flash_decode`` would launch it (block_n None: its GPU tile;
    has_seqlens False: the split kernel of cache_seqlens=None; pdl: with the programmatic-dependent-launch
    wait, as ``flash_decode`` launches it on Hopper);
    returns the compiled kernel (``.metadata.shared``, ``.asm["ptx"]``). Raises triton.CompilationError
    when it does not compile."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ._launch import kernel_module
    from .plan import _pow2, decode_block_n

    fn = getattr(kernel_module(False, "_decode_kernels"), f"_decode_{kernel}_kernel")
    block_d = _pow2(head_dim)
    values = dict(
        BLOCK_M=_pow2(group * n_q),
        BLOCK_N=decode_block_n(head_dim, dtype) if block_n is None else block_n,
        BLOCK_D=block_d,
        BLOCK_S=8,
        DOT_PRECISION="ieee" if dtype == torch.float32 else None,
        HAS_SEQLENS=has_seqlens,
        USE_PDL=pdl,
        SOFTCAP=softcap,
    )
    signature, constants = {}, {}
    for name in fn.arg_names:
        if name in ("Q", "K", "V") or (name == "O" and kernel == "combine"):
            signature[name] = "*" + _TL_NAME[dtype]
        elif name in ("O_PART", "LSE_PART", "LSE"):
            signature[name] = "*fp32"
        elif name == "SEQLENS" and has_seqlens:
            signature[name] = "*i32"
        elif name == "SEQLENS":  # None, as flash_decode passes it without lengths
            signature[name], constants[name] = "constexpr", None
        elif name == "scale_log2" or (name == "softcap" and softcap):
            signature[name] = "fp32"
        elif name == "softcap":
            signature[name], constants[name] = "constexpr", None
        elif name in values:
            signature[name], constants[name] = "constexpr", values[name]
        else:
            signature[name] = "i32"
    src = ASTSource(fn, signature, constants)
    return triton.compile(
        src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps, num_stages=num_stages)
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernel", nargs="+", default=list(KERNEL_NAMES), choices=list(KERNEL_NAMES))
    p.add_argument("--dtype", nargs="+", default=["bf16"], choices=sorted(DTYPES))
    p.add_argument("--d", nargs="+", type=int, default=[64, 128])
    p.add_argument("--arch", type=int, default=90, help="SM version, e.g. 90 for H100/H200, 80 for A100")
    p.add_argument("--non-causal", action="store_true")
    p.add_argument("--gqa", action="store_true", help="compile with a runtime GROUP (GQA/MQA) instead of 1")
    p.add_argument("--blocks", nargs=2, type=int, metavar=("BLOCK_M", "BLOCK_N"))
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument(
        "--even",
        action="store_true",
        help="sequence lengths multiples of the blocks (as in every benchmark shape)",
    )
    p.add_argument(
        "--inductor",
        action="store_true",
        help="compile as Inductor does (fp64 float scalars, debug=True overflow checks)",
    )
    p.add_argument(
        "--tma",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bwd_dkdv / bwd_dq with (--tma) or without (--no-tma) tensor-descriptor loads; "
        "default: as the tile config says",
    )
    args = p.parse_args(argv)
    cfg = TileConfig(args.blocks[0], args.blocks[1], args.warps, args.stages) if args.blocks else None
    for dt in args.dtype:
        for d in args.d:
            for kernel in args.kernel:
                try:
                    info = compile_kernel(
                        kernel,
                        DTYPES[dt],
                        d,
                        causal=not args.non_causal,
                        config=cfg,
                        arch=args.arch,
                        gqa=args.gqa,
                        tma=args.tma,
                        even=args.even,
                        inductor=args.inductor,
                    )
                    print(info.line(), flush=True)
                except Exception as err:  # report and continue with the other configs
                    print(
                        f"{kernel:9s} {dt:5s} d={d:<4d} FAILED: {type(err).__name__}: {str(err)[-800:]}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
