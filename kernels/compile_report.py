"""Offline sm_90 compile report of the kernels -- no GPU needed; the CPU tests' guard of the Hopper paths.

Triton ships ptxas, so the whole pipeline runs anywhere. Per (kernel, dtype, head dim) and tile this prints
shared memory, registers, spills, whether wgmma and TMA are used, and whether ptxas serialised the wgmmas
(C7513-C7515; removing it gave +2-12% on the H200 at d = 128, bench/NOTES.md v5). As a real launch:
16-divisible pointers and strides, GROUP == 1 unless --gqa, ragged lengths unless --even.

Usage:  python -m kernels.compile_report --dtype bf16 fp16 --d 64 128 [--gqa] [--even] [--inductor]
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
_INTS = ("H_Q", "GROUP", "N_Q", "N_K", "kv_step")  # kv_step: 0 unless packed
VARIANTS = ("window", "doc", "dropout", "softcap")


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


def _sm90(source, **options):
    """triton.compile of an AST source for sm_90 (a CUDA target: no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget

    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def _wgmma_serialized(ptxas_log: str) -> bool:
    """ptxas warnings C7513-C7515: wgmma instructions made to wait for each other."""
    return any(code in ptxas_log for code in ("C7513", "C7514", "C7515"))


def _ptxas(ptx: str) -> tuple[int | None, int | None, int | None, str]:
    """(registers, spill store bytes, spill load bytes, log) of PTX assembled by Triton's ptxas for sm_90a."""
    import triton

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        cmd = [triton.knobs.nvidia.ptxas.path, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"]
        log = subprocess.run(cmd, capture_output=True, text=True).stderr
    regs = int(m.group(1)) if (m := re.search(r"Used (\d+) registers", log)) else None
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    st, ld = (int(spills.group(1)), int(spills.group(2))) if spills else (None, None)
    return regs, st, ld, log


def _report(name: str, dtype: torch.dtype, head_dim: int, cfg: TileConfig, compiled) -> CompileInfo:
    """CompileInfo of a compiled kernel: its PTX assembled by Triton's ptxas for sm_90a with -v."""
    ptx = compiled.asm["ptx"]
    regs, st, ld, log = _ptxas(ptx)
    wgmma, tma, shared = "wgmma" in ptx, "cp.async.bulk.tensor" in ptx, compiled.metadata.shared
    return CompileInfo(
        name, _TL_NAME[dtype], head_dim, cfg, shared, regs, st, ld, wgmma, tma, _wgmma_serialized(log)
    )


def compile_kernel(
    kernel: str,
    dtype: torch.dtype,
    head_dim: int,
    *,
    causal: bool = True,
    config: TileConfig | None = None,
    gqa: bool = False,
    tma: bool | None = None,
    even: bool = False,
    inductor: bool = False,
    variants: tuple[str, ...] = (),
) -> CompileInfo:
    """Compile one Triton attention kernel (of KERNEL_NAMES) for sm_90 without a GPU and report it.

    config: default `get_tile_config`'s (its `no_tma` where TMA is off). tma: the backward kernels with /
    without TMA loads; None: as the launcher would. even: lengths multiples of the blocks. inductor: as
    Inductor compiles a user kernel (fp64 float arguments, debug=True). variants: any of VARIANTS on.
    ValueError for an unknown kernel or variant or an impossible tma=True; triton.CompilationError.
    """
    from triton.compiler import ASTSource

    from ._launch import dot_precision, kernel_module

    if kernel not in KERNEL_NAMES:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNEL_NAMES}")
    if set(variants) - set(VARIANTS):
        raise ValueError(f"unknown variants {variants!r}; expected a subset of {VARIANTS}")
    cfg = config or get_tile_config(kernel, head_dim, dtype, causal, 1 << 20, 1 << 20)
    block_d = block_d_for(head_dim)
    tma_possible = kernel in ("bwd_dkdv", "bwd_dq") and dtype != torch.float32 and head_dim == block_d
    if tma is None:
        tma = cfg.tma and tma_possible and even
    elif tma and not tma_possible:
        raise ValueError(
            "TMA loads are used only by bwd_dkdv / bwd_dq with a 16-bit dtype and a power-of-two head dim "
            f">= 16 (got {kernel}, {dtype}, d={head_dim}); these run with pointer loads"
        )
    cfg = cfg.launched(tma)
    fn = getattr(kernel_module(False), f"_{kernel}_kernel")
    values = dict(CAUSAL=causal, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, EVEN_M=even)
    values |= dict(EVEN_N=even, HEAD_DIM=head_dim, DOT_PRECISION=dot_precision(dtype))
    values |= {f"TMA_{x}": int(tma) for x in ("Q", "DO", "KV")}  # layout 1: heads contiguous
    if tma:  # the launcher uses TMA only when the streamed length is a multiple of the block
        values["EVEN_M" if kernel == "bwd_dkdv" else "EVEN_N"] = True
    variant_ptrs = {"Q_DOC": ("doc", "*i32"), "K_DOC": ("doc", "*i32"), "SEED": ("dropout", "*i64")}
    variant_ptrs |= {"DLSE": ("dlse", None), "window": ("window", "i32")}  # no LSE gradient: as in training
    scalar = "fp64" if inductor else "fp32"
    signature, constants, divisible = {}, {}, []
    for i, name in enumerate(fn.arg_names):
        if name in variant_ptrs and variant_ptrs[name][0] in variants:
            signature[name] = variant_ptrs[name][1]
        elif name in variant_ptrs or (name == "softcap" and "softcap" not in variants):
            signature[name], constants[name] = "constexpr", None  # off: None, as the launchers pass it
        elif name in ("dropout_p", "softcap", "softmax_scale"):
            signature[name] = scalar
        elif name in _TENSORS or name in _F32_TENSORS:
            signature[name] = "*fp32" if name in _F32_TENSORS else "*" + _TL_NAME[dtype]
            divisible.append(i)
        elif name == "GROUP" and not gqa:
            signature[name], constants[name] = "constexpr", 1
        elif name.startswith("stride_") or name in _INTS:
            signature[name] = "i32"
            if head_dim % 16 == 0 and name not in ("H_Q", "GROUP", "N_Q", "N_K"):
                divisible.append(i)
        else:
            signature[name], constants[name] = "constexpr", values[name]
    attrs = {(i,): [["tt.divisibility", 16]] for i in divisible}
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, debug=inductor)
    return _report(
        kernel, dtype, head_dim, cfg, _sm90(ASTSource(fn, signature, constants, attrs=attrs), **options)
    )


def compile_gluon(which: str, head_dim: int, dtype: torch.dtype = torch.bfloat16) -> CompileInfo:
    """Compile the sm_90 Gluon kernel of `which` ("fwd" / "bwd") as its module launches it (`registers`: the
    kernel-wide budget). ValueError for what `plan` never sends it (d not 64 / 128, not bf16 / fp16)."""
    if head_dim not in MIN_N or dtype not in (torch.bfloat16, torch.float16):  # before Gluon is imported
        raise ValueError(
            f"the Gluon kernels take d in {sorted(MIN_N)} and bf16 / fp16, got d={head_dim}, {dtype}"
        )
    from triton.experimental.gluon._runtime import GluonASTSource

    if which == "fwd":
        from . import _gluon_fwd as g

        nc = g.CONSUMERS[head_dim]  # one 64-row part per consumer warpgroup
        fn, maxnreg = g._fwd_ws_kernel, g.MAXNREG[nc]
        cfg = TileConfig(64 * nc, 128, g.NUM_WARPS, g.STAGES[head_dim])
        knobs = dict(Q_BUFS=g.Q_BUFS[head_dim], NC=nc, REGS=g.REGS[nc])
    else:
        from . import _gluon_bwd as g

        fn, cfg, maxnreg = g._bwd_ws_kernel, TileConfig(64, 128, g.NUM_WARPS, g.STAGES[head_dim]), g.MAXNREG
        knobs = dict(DEFER=g.DEFER[head_dim])
    knobs |= dict(HEAD_D=head_dim, STAGES=cfg.num_stages)
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
    compiled = _sm90(GluonASTSource(fn, signature, constants), num_warps=g.NUM_WARPS, maxnreg=maxnreg)
    return _report(f"gluon_{which}", dtype, head_dim, cfg, compiled)


def compile_decode_kernel(
    kernel: str,
    dtype: torch.dtype,
    head_dim: int,
    *,
    group: int = 4,
    n_q: int = 1,
    num_stages: int = 2,
    has_seqlens: bool = True,
    pdl: bool = False,
    softcap: bool = False,
):
    """Compile the decode kernel "split" or "combine" for sm_90 as `flash_decode` launches it; the compiled
    kernel (``.metadata.shared``, ``.asm["ptx"]``)."""
    from triton.compiler import ASTSource

    from ._launch import dot_precision, kernel_module
    from .plan import _pow2, decode_block_n

    fn = getattr(kernel_module(False, "_decode_kernels"), f"_decode_{kernel}_kernel")
    values = dict(BLOCK_M=_pow2(group * n_q), BLOCK_N=decode_block_n(head_dim, dtype), BLOCK_S=8)
    values |= dict(BLOCK_D=_pow2(head_dim), DOT_PRECISION=dot_precision(dtype), USE_PDL=pdl)
    signature, constants = {}, {}
    for name in fn.arg_names:
        if name in ("Q", "K", "V") or (name == "O" and kernel == "combine"):
            signature[name] = "*" + _TL_NAME[dtype]
        elif name in ("O_PART", "LSE_PART", "LSE"):
            signature[name] = "*fp32"
        elif name == "SEQLENS" and has_seqlens:
            signature[name] = "*i32"
        elif name == "softmax_scale" or (name == "softcap" and softcap):
            signature[name] = "fp32"
        elif name in ("SEQLENS", "softcap"):  # off: None, as flash_decode passes them
            signature[name], constants[name] = "constexpr", None
        elif name in values:
            signature[name], constants[name] = "constexpr", values[name]
        else:
            signature[name] = "i32"
    return _sm90(ASTSource(fn, signature, constants), num_warps=4, num_stages=num_stages)


def compile_loss_kernel(dtype: torch.dtype, vocab_size: int = 50304, block=None, num_warps=None) -> dict:
    """Compile the fused loss kernel (`_loss_kernel.py`) for sm_90 as `cross_entropy` launches it (or with
    ``block`` logits a step on ``num_warps`` warps), with the ints' divisibility by 16 that Triton
    specialises at a launch; its registers, spills and how many of its global loads are 16-byte vectors
    (``v4_loads`` of ``loads``). `python -m kernels.compile_report --loss` prints it per (BLOCK, warps)."""
    from triton.compiler import ASTSource

    from . import cross_entropy as ce
    from ._launch import kernel_module

    fn = kernel_module(False, "_loss_kernel")._cross_entropy_kernel
    t = "*" + _TL_NAME[dtype]
    signature = dict(LOGITS=t, TARGETS="*i64", LOSS="*fp32", stride_row="i32", M="i32", V="i32")
    signature["BLOCK"] = "constexpr"
    ints = ["stride_row", "M"] + (["V"] if vocab_size % 16 == 0 else [])
    divisible = [fn.arg_names.index(n) for n in ["LOGITS", "TARGETS", "LOSS", *ints]]
    attrs = {(i,): [["tt.divisibility", 16]] for i in divisible}
    source = ASTSource(fn, signature, dict(BLOCK=block or ce.BLOCK), attrs=attrs)
    ptx = _sm90(source, num_warps=num_warps or ce.NUM_WARPS).asm["ptx"]
    regs, st, ld, _ = _ptxas(ptx)
    loads = ptx.count("ld.global")
    return dict(
        registers=regs,
        spill_store_bytes=st,
        spill_load_bytes=ld,
        v4_loads=ptx.count("ld.global.v4"),
        loads=loads,
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernel", nargs="+", default=list(KERNEL_NAMES), choices=list(KERNEL_NAMES))
    p.add_argument("--dtype", nargs="+", default=["bf16"], choices=sorted(DTYPES))
    p.add_argument("--d", nargs="+", type=int, default=[64, 128])
    p.add_argument("--gqa", action="store_true", help="compile with a runtime GROUP (GQA/MQA) instead of 1")
    p.add_argument("--blocks", nargs=2, type=int, metavar=("BLOCK_M", "BLOCK_N"))
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--even", action="store_true", help="sequence lengths multiples of the blocks")
    p.add_argument("--inductor", action="store_true", help="as Inductor compiles (fp64 scalars, debug)")
    p.add_argument("--tma", action=argparse.BooleanOptionalAction, help="bwd kernels with / without TMA")
    p.add_argument("--loss", nargs="+", metavar="BLOCKxWARPS", help="the fused loss kernel, e.g. 8192x8")
    a = p.parse_args(argv)
    for launch in a.loss or ():
        block, warps = (int(x) for x in launch.split("x"))
        print(
            f"loss {launch}: {compile_loss_kernel(torch.bfloat16, block=block, num_warps=warps)}", flush=True
        )
    if a.loss:
        return
    cfg = TileConfig(*a.blocks, a.warps, a.stages) if a.blocks else None
    for dt in a.dtype:
        for d in a.d:
            for kernel in a.kernel:
                try:
                    kw = dict(config=cfg, gqa=a.gqa, tma=a.tma, even=a.even, inductor=a.inductor)
                    print(compile_kernel(kernel, DTYPES[dt], d, **kw).line(), flush=True)
                except Exception as err:  # report and continue with the other configs
                    error = f"{type(err).__name__}: {str(err)[-800:]}"
                    print(f"{kernel:9s} {dt:5s} d={d:<4d} FAILED: {error}", flush=True)


if __name__ == "__main__":
    main()
