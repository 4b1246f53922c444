"""FlashAttention-2 in Triton: input validation, kernel launchers, torch.library ops, public API.

Algorithm: Tri Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning"
(2023): forward section 3.1, backward section 3.2; online softmax from Milakov & Gimelshein (2018). The
Triton kernels live in `kernels/_triton_kernels.py`, the tile sizes in `kernels/tiles.py`. On an H200 /
H100 (sm_90) the causal forward from `_gluon_route.MIN_N` runs the Gluon kernel of `kernels/_gluon_fwd.py`
(FlashAttention-3's warp-specialised schedule, persistent; `_gluon_route.route` says when), which writes o and
LSE as the Triton one does, and the backward the one-pass Gluon kernel of `kernels/_gluon_bwd.py`
(`_gluon_route.route_bwd`).

Operators, so torch.compile traces callers without graph breaks:
* CUDA tensors: `torch.library.triton_op`s
  `flashgpt::flash_attn_fwd(q, k, v, causal: bool, softmax_scale: float) -> (o, lse)` and
  `flashgpt::flash_attn_bwd(do, q, k, v, o, lse, causal, softmax_scale, dlse=None) -> (dq, dk, dv)`.
  Under torch.compile their bodies are traced (`torch.library.wrap_triton`), so the compiled graph holds
  our Triton kernels and Inductor launches them from its generated code (no Python per call; CUDA graphs
  can capture them; the Gluon forward stays one opaque op, `flashgpt::flash_attn_fwd_sm90`). Tensor
  descriptors (TMA) are built on the device, not per call on the host.
* CPU tensors (Triton interpreter): opaque custom ops `flashgpt::flash_attn_fwd_cpu` /
  `flashgpt::flash_attn_bwd_cpu` with fake implementations (tracing a triton op needs GPU kernels).
Autograd of each forward op calls its backward op. `flash_attention` calls, in plain eager mode, an
equivalent torch.autograd.Function over the same launchers (no op dispatch: less host time per call), and
the ops everywhere else (torch.compile tracing, FakeTensorMode / make_fx, vmap, tensor subclasses).
Validation happens in `flash_attention`, before the op and any launch (under torch.compile once, while
tracing). The Triton interpreter runs the kernels when TRITON_INTERPRET is truthy *at call time* (read on
every call); CPU tensors are only accepted in that mode.
"""

import contextlib

import torch

from . import _gluon_route
from ._checks import (  # noqa: F401 - re-exported: flash_attn is where users and tests import them
    _HAS_TRITON,
    MAX_HEAD_DIM,
    MIN_HEAD_DIM,
    SUPPORTED_DTYPES,
    FlashAttentionUnavailableError,
    _check_variants,
    _device_problem,
    _prepare_call,
    _seed_tensor,
    _validate,
    check_flash_available,
    document_ranges,
    interpret_enabled,
)
from .tiles import block_d_for, get_tile_config, tma_override

LOG2E = 1.4426950408889634


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """The kernels accept any strides except a non-unit stride on the last (head) dim: copy then."""
    return t if t.stride(-1) == 1 else t.contiguous()


# ---------------------------------------------------------------------------------------------
# launchers (called inside the custom ops, with validated inputs)
# ---------------------------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _dot_precision(dtype: torch.dtype):
    # float32 must not go through tf32 tensor cores (10-bit mantissa); ignored for 16-bit inputs
    return "ieee" if dtype == torch.float32 else None


def _kernels(interpret: bool) -> dict:
    from . import _triton_kernels

    problem = _triton_kernels.mode_problem(interpret)
    if problem is not None:
        raise FlashAttentionUnavailableError(problem)
    return _triton_kernels.build_kernels(interpret)


_SCRATCH_ALLOCATOR_READY = False


def _scratch_alloc(size: int, alignment: int, stream):
    """Global scratch for the device-side tensor descriptors: a torch CUDA allocation, so it comes
    from the caching allocator on the current stream (and from the graph's pool under CUDA graphs)."""
    del alignment, stream  # torch allocations are 512-byte aligned and stream-ordered
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_scratch_allocator() -> None:
    """Make Triton's global-scratch allocator available in every thread (idempotent).

    Kernels that build tensor descriptors on the device (`tl.make_tensor_descriptor`) need Triton to
    allocate 128 bytes per descriptor and program at launch, through the allocator given to
    `triton.set_allocator`. That one is a ContextVar: set in one thread it is missing in autograd's
    device thread, where the backward kernels launch (eagerly and from Inductor's compiled backward).
    So, unless an allocator is already set, ours becomes the variable's default for every thread.
    Falls back to `triton.set_allocator` (this thread only) if Triton's internals differ.
    """
    global _SCRATCH_ALLOCATOR_READY
    if _SCRATCH_ALLOCATOR_READY:
        return
    import contextvars

    import triton

    try:
        from triton.runtime import _allocation

        var = _allocation._allocator
        if isinstance(var.get(), _allocation.NullAllocator):
            _allocation._allocator = contextvars.ContextVar("_allocator", default=_scratch_alloc)
    except (ImportError, AttributeError):
        triton.set_allocator(_scratch_alloc)
    _SCRATCH_ALLOCATOR_READY = True


def _device_ctx(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it the tensor's device (no switch, and no
    host time spent, when it already is)."""
    if not t.is_cuda or t.get_device() == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(t.device)


def _launch_options(cfg) -> dict:
    return {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def _launcher(kernel, grid, traced: bool):
    """kernel[grid], or `torch.library.wrap_triton(kernel)[grid]` inside the triton ops, so that
    torch.compile (make_fx / AOTAutograd) records the launch itself and Inductor emits it in the
    generated code, instead of calling back into Python for every attention call."""
    if traced and not interpret_enabled():  # interpreter kernels are not JIT functions: launch directly
        return torch.library.wrap_triton(kernel)[grid]
    return kernel[grid]


def _static_sizes(q, k) -> tuple[int, ...]:
    """(B, Hq, Nq, d, Hkv, Nk) as ints. Under dynamic-shape tracing they are SymInts: int() specialises
    the graph on them (a guard), which the kernels need anyway (tile choice, EVEN_* constexprs)."""
    B, Hq, Nq, d = (int(x) for x in q.shape)
    return B, Hq, Nq, d, int(k.shape[1]), int(k.shape[2])


def _empty_like_layout(t: torch.Tensor, shape=None, dtype=None) -> torch.Tensor:
    """An empty dense tensor of `shape` (default t's) whose dims lie in memory in the order of t's strides.

    Why: the trainer's q, k, v are (B, N, H, d) memory (a fused qkv projection) viewed as (B, H, N, d).
    Gradients (and o) in that same order make the model's transpose(1, 2).reshape and the backward's
    concatenation of dq, dk, dv into d(qkv) plain copies or free views; contiguous (B, H, N, d)
    results cost a transposing copy per layer (4.5 ms of a 68 ms GPT-2 step at B=32, N=1024 on the
    H200, bench/NOTES.md v8). Dims with equal strides keep their order; the kernels take any strides.
    """
    shape = tuple(t.shape) if shape is None else tuple(shape)
    strides = t.stride()
    order = sorted(range(t.dim()), key=lambda i: -int(strides[i]))  # stable: ties keep dim order
    if order == list(range(t.dim())):
        return torch.empty(shape, dtype=dtype or t.dtype, device=t.device)
    dense = torch.empty([shape[i] for i in order], dtype=dtype or t.dtype, device=t.device)
    return dense.permute([order.index(i) for i in range(t.dim())])


def _launch_fwd(q, k, v, causal: bool, softmax_scale: float, traced: bool = False, window: int = 0,
                q_doc=None, k_doc=None, dropout_p: float = 0.0, dropout_seed=None):
    """Forward launch. Variants (validated by `flash_attention`): window w >= 1 (0: none), q_doc int32
    (2, B, Nq) document key ranges of the query rows (k_doc: unused here), dropout_p with its int64 (1,)
    seed."""
    if q.dtype == torch.bfloat16 and interpret_enabled():
        # numpy (the interpreter) has no bfloat16: compute in float32, return bfloat16
        o, lse = _launch_fwd(q.float(), k.float(), v.float(), causal, softmax_scale, False, window, q_doc,
                             k_doc, dropout_p, dropout_seed)
        return o.to(torch.bfloat16), lse
    B, Hq, Nq, d, Hkv, Nk = _static_sizes(q, k)
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    if _gluon_route.route(q, k, v, causal, softmax_scale, window, q_doc, dropout_p):
        g = _gluon_route.gluon_fwd()  # sm_90 from MIN_N: the Gluon forward
        return (g.forward if traced else g.run)(q, k, v, softmax_scale)
    o = _empty_like_layout(q)  # (B, Hq, Nq, d) laid out as q is
    lse = torch.empty((B, Hq, Nq), dtype=torch.float32, device=q.device)
    interp = interpret_enabled()
    cfg = get_tile_config("fwd", d, q.dtype, causal, Nq, Nk, interpret=interp)
    block_d = block_d_for(d)
    grid = (_cdiv(Nq, cfg.block_m), Hq, B)
    with _device_ctx(q):
        _launcher(_kernels(interp)["fwd"], grid, traced)(
            q, k, v, o, lse,
            *q.stride(), *k.stride(), *v.stride(), *o.stride(),
            Hq, Hq // Hkv, Nq, Nk, d, softmax_scale * LOG2E,
            CAUSAL=causal, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d,
            EVEN_M=Nq % cfg.block_m == 0, EVEN_N=Nk % cfg.block_n == 0, EVEN_D=d == block_d,
            DOT_PRECISION=_dot_precision(q.dtype), **_launch_options(cfg),
            **_variant_kwargs(window, q_doc, dropout_p, dropout_seed),
        )
    return o, lse


def _variant_kwargs(window: int, q_doc, dropout_p: float, dropout_seed) -> dict:
    """Kernel keyword arguments of the variants (issue 16); all off gives the plain causal kernels."""
    return dict(Q_DOC=q_doc, SEED=dropout_seed, window=int(window), dropout_p=float(dropout_p),
                HAS_WINDOW=window > 0, HAS_DOC=q_doc is not None, HAS_DROPOUT=dropout_p > 0.0)


def _dropout_mask(dropout_seed: torch.Tensor, B: int, Hq: int, Nq: int, Nk: int,
                  dropout_p: float) -> torch.Tensor:
    """The kernels' own dropout keep mask, bool (B, Hq, Nq, Nk) on the seed's device (a test helper: the
    attention kernels never store it, they regenerate it). dropout_seed: int64 (1,) tensor."""
    out = torch.empty((B, Hq, Nq, Nk), dtype=torch.int8, device=dropout_seed.device)
    interp = interpret_enabled()
    with _device_ctx(out):
        _kernels(interp)["dropout_mask"][(_cdiv(Nq, 16), Hq, B)](
            dropout_seed, out, Hq, Nq, Nk, float(dropout_p), BLOCK_M=16, BLOCK_N=16)
    return out.bool()


def _tma_operand(t: torch.Tensor, block_d: int):
    """How the kernels address t (B, H, N, d) through one 2-D tensor descriptor (TMA), or None.

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
    if (t.dtype not in (torch.float16, torch.bfloat16) or d != block_d or sd != 1
            or (t.storage_offset() * esz) % 16 or (sn * esz) % 16 or sn < d):
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


_NO_TMA = (0, 0, 0, 0, 0, 0, 0, 0, 0, 0)


def _tma_pair(x: torch.Tensor, y: torch.Tensor, block_d: int):
    """Kernel arguments (rows, cols, row_b, row_h, col_h of x, then of y) when both tensors can be
    streamed through tensor descriptors (`_tma_operand`), else None (the kernel then uses pointer loads)."""
    tx, ty = _tma_operand(x, block_d), _tma_operand(y, block_d)
    return None if tx is None or ty is None else (*tx, *ty)


def _launch_bwd(do, q, k, v, o, lse, causal: bool, softmax_scale: float, dlse=None, traced: bool = False,
                window: int = 0, q_doc=None, k_doc=None, dropout_p: float = 0.0, dropout_seed=None,
                dqkv=None, deterministic: bool = False):
    """Backward launch: (dq, dk, dv), new tensors laid out as q, k, v (`_empty_like_layout`); with `dqkv` (a
    (B, N, 3, H, d) tensor, `kernels.flash_qkvpacked`) the kernels write its three slices and the views of
    them are returned. The kernels then get dqkv itself, never the views: a compiled graph may clone an
    argument a kernel writes, and a clone of a view with gaps would not keep the strides the launch passes.
    The one-pass Gluon backward where `_gluon_route.route_bwd` allows (not `deterministic`), else the split
    Triton kernels."""
    if q.dtype == torch.bfloat16 and interpret_enabled():
        grads = _launch_bwd(do.float(), q.float(), k.float(), v.float(), o.float(), lse, causal,
                            softmax_scale, dlse, False, window, q_doc, k_doc, dropout_p, dropout_seed, None,
                            deterministic)
        if dqkv is not None:
            dqkv.copy_(torch.stack(grads, dim=1).permute(0, 3, 1, 2, 4))  # (B, 3, H, N, d) -> (B, N, 3, H, d)
            return _packed_views(dqkv)
        return tuple(g.to(torch.bfloat16) for g in grads)
    B, Hq, Nq, d, Hkv, Nk = _static_sizes(q, k)
    q, k, v, o = (_unit_last_stride(t) for t in (q, k, v, o))
    do = _unit_last_stride(do.to(q.dtype))
    lse = lse.to(torch.float32).contiguous()
    if _gluon_route.route_bwd(do, q, k, v, o, causal, softmax_scale, window, q_doc, dropout_p,
                              deterministic):  # sm_90: the one-pass Gluon backward (dQ by TMA reduce-add)
        return _gluon_route.gluon_bwd().call(do, q, k, v, o, lse, dlse, softmax_scale, traced, dqkv)
    interp = interpret_enabled()
    block_d = block_d_for(d)
    even_d = d == block_d
    prec = _dot_precision(q.dtype)
    kern = _kernels(interp)

    delta = torch.empty((B, Hq, Nq), dtype=torch.float32, device=q.device)
    if dlse is not None:
        dlse = dlse.to(torch.float32).contiguous()
    if dqkv is None:
        dq, dk, dv = _empty_like_layout(q), _empty_like_layout(k), _empty_like_layout(v)  # laid out as inputs
        dq_arg, dk_arg, dv_arg, dk_off, dv_off = dq, dk, dv, 0, 0
    else:  # the slices of dqkv: q's starts at its first element, k's and v's one and two steps of dim 2 on
        dq, dk, dv = _packed_views(dqkv)  # for the strides
        dq_arg, dk_arg, dv_arg, dk_off, dv_off = dqkv, dqkv, None, dqkv.stride(2), 2 * dqkv.stride(2)

    c1 = get_tile_config("bwd_dkdv", d, q.dtype, causal, Nq, Nk, interpret=interp)
    c2 = get_tile_config("bwd_dq", d, q.dtype, causal, Nq, Nk, interpret=interp)
    scale_args = (Hq, Hq // Hkv, Nq, Nk, d, softmax_scale, softmax_scale * LOG2E)
    forced = tma_override()
    # TMA only for whole blocks: past the sequence end a descriptor reads the next head's data
    want1 = (c1.tma if forced is None else forced) and Nq % c1.block_m == 0
    want2 = (c2.tma if forced is None else forced) and Nk % c2.block_n == 0
    tma1 = _tma_pair(q, do, block_d) if want1 else None
    tma2 = _tma_pair(k, v, block_d) if want2 else None
    # a tile chosen for TMA may name another one for pointer loads (tiles.TileConfig.no_tma)
    if tma1 is None and c1.no_tma is not None:
        c1 = c1.no_tma
    if tma2 is None and c2.no_tma is not None:
        c2 = c2.no_tma
    if (tma1 is not None or tma2 is not None) and q.is_cuda:
        ensure_scratch_allocator()
    with _device_ctx(q):
        # dQ first: its programs also compute Delta = rowsum(dO * O) (- dLSE) of their rows and
        # store it for the dK/dV kernel (no separate preprocess launch)
        _launcher(kern["bwd_dq"], (_cdiv(Nq, c2.block_m), Hq, B), traced)(
            q, k, v, do, lse, delta, dq_arg, o, dlse,  # dlse None: HAS_DLSE=False, never read
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(), *o.stride(),
            *scale_args, *(tma2 or _NO_TMA),
            CAUSAL=causal, BLOCK_M=c2.block_m, BLOCK_N=c2.block_n, BLOCK_D=block_d,
            EVEN_M=Nq % c2.block_m == 0, EVEN_N=Nk % c2.block_n == 0, EVEN_D=even_d,
            DOT_PRECISION=prec, USE_TMA=tma2 is not None, HAS_DLSE=dlse is not None,
            **_launch_options(c2), **_variant_kwargs(window, q_doc, dropout_p, dropout_seed),
        )
        _launcher(kern["bwd_dkdv"], (_cdiv(Nk, c1.block_n), Hkv, B), traced)(
            q, k, v, do, lse, delta, dk_arg, dv_arg,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(),
            *scale_args, *(tma1 or _NO_TMA),
            CAUSAL=causal, BLOCK_M=c1.block_m, BLOCK_N=c1.block_n, BLOCK_D=block_d,
            EVEN_M=Nq % c1.block_m == 0, EVEN_N=Nk % c1.block_n == 0, EVEN_D=even_d,
            DOT_PRECISION=prec, USE_TMA=tma1 is not None, **_launch_options(c1),
            **_variant_kwargs(window, q_doc, dropout_p, dropout_seed), K_DOC=k_doc,
            dk_offset=dk_off, dv_offset=dv_off,
        )
    return dq, dk, dv


def _packed_views(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as (B, H, N, d) views of a packed (B, N, 3, H, d) tensor; no copy."""
    q, k, v = qkv.unbind(2)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


# ---------------------------------------------------------------------------------------------
# operators: torch.library.triton_op for CUDA tensors, an opaque custom op for the interpreter
# ---------------------------------------------------------------------------------------------
#
# CUDA: `flashgpt::flash_attn_fwd` / `flashgpt::flash_attn_bwd` are triton ops. Eager calls run the
# body (plain launches); under torch.compile AOTAutograd traces the body, so the compiled graph holds
# the Triton kernels themselves (`wrap_triton`) and Inductor launches them from its generated code:
# no Python op, validation or launcher per attention call. Tracing needs kernels that can be compiled
# for the GPU, so CPU tensors (the Triton interpreter, for tests) go through the opaque custom ops
# `flashgpt::flash_attn_fwd_cpu` / `flashgpt::flash_attn_bwd_cpu` with the same launchers, which
# torch.compile, FakeTensorMode and make_fx see as one node with a fake implementation.


def _fwd_fake(q, k, v, causal, softmax_scale, window=0, q_doc=None, k_doc=None, dropout_p=0.0,
              dropout_seed=None, deterministic=False):
    q = _unit_last_stride(q)  # as _launch_fwd sees it
    B, Hq, Nq, d = q.shape
    return _empty_like_layout(q), q.new_empty((B, Hq, Nq), dtype=torch.float32)


def _bwd_fake(do, q, k, v, o, lse, causal, softmax_scale, dlse=None, window=0, q_doc=None, k_doc=None,
              dropout_p=0.0, dropout_seed=None, deterministic=False):
    q, k, v = (_unit_last_stride(t) for t in (q, k, v))  # as _launch_bwd sees them
    return _empty_like_layout(q), _empty_like_layout(k), _empty_like_layout(v)


def _fwd_op_body(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float,
    window: int = 0, q_doc: torch.Tensor | None = None, k_doc: torch.Tensor | None = None,
    dropout_p: float = 0.0, dropout_seed: torch.Tensor | None = None, deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward op: o (B, Hq, Nq, d) in q's dtype, lse float32 (B, Hq, Nq) natural log. No validation
    (`flash_attention` validates). Variants: window (0 = none), q_doc / k_doc int32 (2, B, Nq) / (2, B, Nk)
    document ranges (`document_ranges`), dropout_p with an int64 (1,) seed; deterministic is for the
    backward (saved)."""
    return _launch_fwd(q, k, v, causal, softmax_scale, True, window, q_doc, k_doc, dropout_p, dropout_seed)


def _bwd_op_body(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
    causal: bool, softmax_scale: float, dlse: torch.Tensor | None = None, window: int = 0,
    q_doc: torch.Tensor | None = None, k_doc: torch.Tensor | None = None, dropout_p: float = 0.0,
    dropout_seed: torch.Tensor | None = None, deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward op: (dq, dk, dv) shaped/typed like (q, k, v), each dense with its input's dim order
    (`_empty_like_layout`). dlse: optional gradient of the lse output (float32 (B, Hq, Nq)). Variants
    as in the forward op; deterministic: the split backward even where the one-pass one would run."""
    return _launch_bwd(do, q, k, v, o, lse, causal, softmax_scale, dlse, True, window, q_doc, k_doc,
                       dropout_p, dropout_seed, None, deterministic)


# one body, two registrations: traced into the graph on CUDA, opaque (with a fake) for the interpreter
flash_attn_fwd = torch.library.triton_op("flashgpt::flash_attn_fwd", _fwd_op_body, mutates_args=())
flash_attn_bwd = torch.library.triton_op("flashgpt::flash_attn_bwd", _bwd_op_body, mutates_args=())
flash_attn_fwd_cpu = torch.library.custom_op("flashgpt::flash_attn_fwd_cpu", _fwd_op_body, mutates_args=())
flash_attn_bwd_cpu = torch.library.custom_op("flashgpt::flash_attn_bwd_cpu", _bwd_op_body, mutates_args=())

flash_attn_fwd_cpu.register_fake(_fwd_fake)
flash_attn_bwd_cpu.register_fake(_bwd_fake)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, *variants = inputs
    o, lse = output
    _save(ctx, q, k, v, o, lse, causal, softmax_scale, *variants)


def _save(ctx, q, k, v, o, lse, causal, softmax_scale, window=0, q_doc=None, k_doc=None, dropout_p=0.0,
          dropout_seed=None, deterministic=False):
    """Keep what the backward needs: q, k, v, o, lse and the variants' tensors, and the flags."""
    ctx.save_for_backward(q, k, v, o, lse, q_doc, k_doc, dropout_seed)
    ctx.causal = causal
    ctx.softmax_scale = softmax_scale
    ctx.window = window
    ctx.dropout_p = dropout_p
    ctx.deterministic = deterministic


def _grads_from_saved(ctx, do, dlse, backward_fn):
    """(dq, dk, dv, None, None) from the tensors the forward saved; `backward_fn` has the signature of
    `flash_attn_bwd` (an op, or `_launch_bwd` directly). A missing dO (only lse used) is zeros."""
    q, k, v, o, lse, q_doc, k_doc, dropout_seed = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(o)
    dq, dk, dv = backward_fn(do, q, k, v, o, lse, ctx.causal, ctx.softmax_scale, dlse, window=ctx.window,
                             q_doc=q_doc, k_doc=k_doc, dropout_p=ctx.dropout_p, dropout_seed=dropout_seed,
                             deterministic=ctx.deterministic)
    return dq, dk, dv, None, None, None, None, None, None, None, None


flash_attn_fwd.register_autograd(lambda ctx, do, dlse: _grads_from_saved(ctx, do, dlse, flash_attn_bwd),
                                 setup_context=_setup_context)
flash_attn_fwd_cpu.register_autograd(
    lambda ctx, do, dlse: _grads_from_saved(ctx, do, dlse, flash_attn_bwd_cpu), setup_context=_setup_context)


def _ops_for(t: torch.Tensor):
    """(forward op, backward op) for t's device: the triton ops on CUDA, the opaque ones elsewhere."""
    return (flash_attn_fwd, flash_attn_bwd) if t.is_cuda else (flash_attn_fwd_cpu, flash_attn_bwd_cpu)


class _FlashAttnEager(torch.autograd.Function):
    """Eager-mode autograd of the same launchers as the ops, without the custom-op dispatcher.

    `flash_attention` uses this in plain eager mode (`_plain_eager_call`) and the ops otherwise
    (torch.compile, fake tensors, vmap). Same kernels, same tiles, so both paths give
    bitwise-identical outputs and gradients (tested); this one saves the host time of the op's
    dispatch and its Python autograd wrapper, which at short sequences (N <= 1024) is comparable to
    the kernels' own run time (bench/NOTES.md, variant v3).
    """

    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, window, q_doc, k_doc, dropout_p, dropout_seed,
                deterministic):
        o, lse = _launch_fwd(q, k, v, causal, softmax_scale, False, window, q_doc, k_doc, dropout_p,
                             dropout_seed)
        _save(ctx, q, k, v, o, lse, causal, softmax_scale, window, q_doc, k_doc, dropout_p, dropout_seed,
              deterministic)
        ctx.set_materialize_grads(False)  # an unused lse output gets None, not a tensor of zeros
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        # With create_graph=True (a gradient penalty) grad mode is on here: go through the backward op,
        # which has no autograd formula, so its graph node (with edges to q, k, v) raises if anything
        # differentiates through these gradients -- never a silently dropped term. Otherwise launch directly.
        backward_op = _ops_for(ctx.saved_tensors[0])[1]
        return _grads_from_saved(ctx, do, dlse, backward_op if torch.is_grad_enabled() else _launch_bwd)


def _plain_eager_call(*tensors: torch.Tensor) -> bool:
    """True when `flash_attention` may take the `_FlashAttnEager` path: no torch.compile tracing, no
    dispatch mode (FakeTensorMode, make_fx, ...), no functorch transform (vmap, ...) and plain tensors.
    Anything else gets the custom op, which those tools know how to handle (fake impl, schema)."""
    if torch.compiler.is_compiling():
        return False
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in tensors):  # FakeTensor, DTensor, ...
        return False
    try:
        if torch._C._len_torch_dispatch_stack() > 0:
            return False
        if torch._C._functorch.peek_interpreter_stack() is not None:
            return False
    except AttributeError:  # private API moved in another torch version: take the always-correct path
        return False
    return True


# ---------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------


def dropout_keep_mask(dropout_seed, B: int, Hq: int, Nq: int, Nk: int, dropout_p: float,
                      device="cpu") -> torch.Tensor:
    """The keep mask that `flash_attention(..., dropout_p=p, dropout_seed=seed)` applies, for tests.

    Args: dropout_seed (int or int64 (1,) tensor), the attention's shape B, Hq, Nq, Nk, dropout_p in [0, 1),
        device (CUDA, or CPU with TRITON_INTERPRET=1).
    Returns: bool (B, Hq, Nq, Nk), True where the attention weight is kept (then scaled by 1 / (1 - p)).
        `kernels.reference.attention_reference(..., dropout_keep=mask, dropout_p=p)` reproduces the kernels'
        output and gradients with it. Costs B * Hq * Nq * Nk bytes: small shapes only.
    Raises: ValueError for a bad dropout_p or seed.
    """
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    check_flash_available(device)
    return _dropout_mask(_seed_tensor(dropout_seed, torch.device(device)), B, Hq, Nq, Nk, dropout_p)


def flash_attention(q, k, v, *, causal=True, softmax_scale=None, return_lse=False, window=None, doc_ids=None,
                    dropout_p=0.0, dropout_seed=None, deterministic=False):
    """Exact attention softmax(q k^T * scale [+ causal mask]) v with FlashAttention-2 (Triton).

    Algorithm: Dao 2023 (FlashAttention-2) section 3.1 forward / 3.2 backward, online softmax of
    Milakov & Gimelshein 2018; on sm_90 from N = 1k-4k FlashAttention-3's schedule in Gluon (Shah et al. 2024;
    kernels/_gluon_fwd.py, _gluon_bwd.py). Memory is O(N) (no N x N tensor); the backward recomputes P from
    q, k and the saved LSE. Bitwise reproducible run to run (outputs, and gradients from the split Triton
    backward, which has no atomics) except dq where the one-pass Gluon backward runs (sm_90, causal, MHA,
    N % 128 == 0 from `_gluon_route.MIN_N_BWD`; its dq is summed by TMA reduce-add in no fixed order, to
    float32 rounding); `deterministic=True` or torch.use_deterministic_algorithms(True) keeps the split one.

    Args:
        q: (B, Hq, Nq, d) query, SDPA layout.
        k, v: (B, Hkv, Nk, d) key / value; Hq must be a multiple of Hkv (GQA/MQA: query head h uses
            kv head h // (Hq // Hkv), without copying k/v).
            dtype float16, bfloat16 or float32 (same for q, k, v); all accumulation is float32; fp32
            matmuls use IEEE precision (no tf32). d in [8, 256] (any value, padded internally).
            Any strides; only a non-unit stride on the last dim forces a copy (.contiguous()).
            Same device: CUDA, or CPU with TRITON_INTERPRET=1 (Triton interpreter; slow, for tests;
            numpy has no bfloat16, so there bf16 inputs are computed in float32 and cast back).
        causal: bottom-right aligned causal mask: query i sees key j iff j <= i + (Nk - Nq)
            (FlashAttention >= 2.1, torch.nn.attention.bias.causal_lower_right). When Nq > Nk the
            first Nq - Nk query rows see no key: their output is 0, their lse is -inf and they get
            zero gradients (no NaN).
        softmax_scale: multiplier of q k^T; default 1 / sqrt(d).
        return_lse: also return lse.
        window: None, or w >= 1 with causal=True: a causal sliding window, query i sees keys
            i + (Nk - Nq) - w < j <= i + (Nk - Nq) (FlashAttention-2's window_size=(w - 1, 0)). Key blocks
            wholly outside the window are skipped (forward and backward), so the cost grows as N * w.
        doc_ids: None, or integer document ids of packed sequences: a (B, Nk) tensor (query row i takes
            the id of position i + Nk - Nq) or a pair (doc_q (B, Nq), doc_k (B, Nk)); non-decreasing along
            each sequence (each document contiguous; checked with one device sync outside torch.compile).
            A query sees only keys of its own document (with causal / window on top). The kernels read
            per-row document ranges (`document_ranges`) and skip blocks that share no document.
        dropout_p: probability of dropping an attention weight, in [0, 1) (apply it in training only).
            Kept weights are scaled by 1 / (1 - p); the LSE is the undropped one. The mask comes from a
            counter-based generator (Philox4x32-10) of (seed, b * Hq + h, i, j), regenerated in the backward,
            never stored; dropout_p = 0 runs the kernels without any dropout code (bitwise equal to
            no dropout).
        dropout_seed: None (drawn from torch's default generator: reproducible under torch.manual_seed),
            an int in [0, 2**63), or an int64 tensor of one element (no recompilation per seed under
            torch.compile). Same seed, same mask. `dropout_keep_mask` returns the mask (for tests).
        deterministic: bitwise-reproducible gradients (the split Triton backward) wherever it runs.
    Returns:
        o (B, Hq, Nq, d) in the input dtype, a new dense tensor whose dims lie in memory in q's order
        (contiguous for contiguous q; (B, N, H, d) memory for the trainer's fused-qkv views, so
        o.transpose(1, 2) is contiguous), and if return_lse also
        lse (B, Hq, Nq) float32 = log(sum_j exp(scale * q_i . k_j)) in natural-log units.
        Both are differentiable, to first order (differentiating the gradients again, e.g. a gradient
        penalty, raises): under torch.compile, fake tensors, make_fx and vmap through the custom op
        flashgpt::flash_attn_fwd (registered autograd and fake implementation, no graph break), in
        plain eager mode through an autograd.Function calling the same kernels (bitwise-identical
        results, less host overhead).
    Raises (before any kernel launch):
        TypeError: non-tensor input, unsupported dtype, dtype mismatch, non-bool causal,
            non-numeric softmax_scale, doc_ids not an integer tensor (or pair), non-bool deterministic.
        ValueError: wrong rank, batch / head-dim / Nk / Hkv mismatch, Hq not a multiple of Hkv,
            d outside [8, 256], an empty dim (N == 0), tensors on different devices,
            non-finite softmax_scale; window not an int >= 1 or without causal; doc_ids of the wrong
            shape, batch, device or not non-decreasing; dropout_p outside [0, 1); a bad dropout_seed.
        FlashAttentionUnavailableError (RuntimeError and ValueError): CPU tensors without
            TRITON_INTERPRET=1, CUDA unavailable, or triton missing.
    """
    scale, variants = _prepare_call(q, k, v, causal, softmax_scale, window, doc_ids, dropout_p, dropout_seed,
                                    deterministic)
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    if _plain_eager_call(q, k, v):
        o, lse = _FlashAttnEager.apply(q, k, v, causal, scale, *variants)  # same kernels, less host time
    else:
        o, lse = _ops_for(q)[0](q, k, v, causal, scale, *variants)  # an op: compile, fake tensors, vmap, ...
    return (o, lse) if return_lse else o


# A compiled graph loaded from Inductor's cache launches the backward kernels without running `_launch_bwd`,
# so the scratch allocator is installed at import on a CUDA machine (not under the interpreter, where
# importing triton now would make compiled kernels impossible).
if _HAS_TRITON and not interpret_enabled() and torch.cuda.is_available():
    ensure_scratch_allocator()
    # the Gluon ops must exist before a graph that calls them is traced or loaded from Inductor's cache
    _gluon_route.gluon_fwd()
    _gluon_route.gluon_bwd()
