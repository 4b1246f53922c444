"""FlashAttention-2 in Triton (FlashAttention-3-style Gluon kernels on sm_90): validation, ops, public API.

Algorithm: Tri Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning"
(2023): forward section 3.1, backward section 3.2; online softmax from Milakov & Gimelshein (2018). The
kernels are in `_triton_kernels.py` (and `_gluon_fwd.py`, `_gluon_bwd.py`); which of them runs, with which
tiles, is decided per call by `kernels/plan.py`; `_launch.py` executes that plan.

Operators, so torch.compile traces callers without graph breaks (`_make_ops`, one factory for the plain
q, k, v layout and the packed qkv one):
* CUDA tensors: `torch.library.triton_op`s `flashgpt::flash_attn_fwd` / `flash_attn_bwd` (and
  `flash_attn_qkvpacked_fwd` / `_bwd`). Under torch.compile their bodies are traced
  (`torch.library.wrap_triton`), so the compiled graph holds our Triton kernels and Inductor launches them
  from its generated code (no Python per call; CUDA graphs can capture them; the Gluon kernels stay opaque
  ops, `flashgpt::flash_attn_fwd_sm90` / `_bwd_sm90`). Tensor descriptors (TMA) are built on the device.
* CPU tensors (Triton interpreter): opaque custom ops `..._cpu` with fake implementations (tracing a triton
  op needs GPU kernels).
Autograd of each forward op calls its backward op. In plain eager mode the public functions call an
equivalent torch.autograd.Function over the same launchers instead (no op dispatch: less host time per call,
which at N <= 1024 is comparable to the kernels' own time: bench/NOTES.md v3), the ops everywhere else
(torch.compile tracing, FakeTensorMode / make_fx, vmap, tensor subclasses). Validation happens here, before
the op and any launch (under torch.compile once, while tracing).
"""

import math

import torch

from ._launch import dropout_mask, launch_bwd, launch_fwd
from ._runtime import (
    _HAS_TRITON,
    FlashAttentionUnavailableError,
    _device_problem,
    check_flash_available,
    empty_like_layout,
    ensure_scratch_allocator,
    interpret_enabled,
    packed_views,
    unit_last_stride,
)
from .plan import gluon_bwd, gluon_fwd

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM = 8
MAX_HEAD_DIM = 256
_MAX_GRID_YZ = 65535  # CUDA limit of grid dims y and z (heads, batch)


# ---------------------------------------------------------------------------------------------
# validation (Python wrapper, before the custom op)
# ---------------------------------------------------------------------------------------------


def _validate(q, k, v, causal, softmax_scale) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    layouts = (("q", q, "(B, Hq, Nq, d)"), ("k", k, "(B, Hkv, Nk, d)"), ("v", v, "(B, Hkv, Nk, d)"))
    for name, t, layout in layouts:
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D {layout} in SDPA layout, got shape {tuple(t.shape)}; "
                "for (B, N, H, d) tensors pass x.transpose(1, 2) (no copy needed)"
            )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{name} has dtype {t.dtype}; flash attention supports float16, bfloat16 and float32 "
                f"- cast with {name}.to(torch.bfloat16) (or float16/float32)"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k, v must have the same dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}; "
            "cast them to one dtype first"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k, v must be on the same device, got q={q.device}, k={k.device}, v={v.device}; "
            "move them with .to(device)"
        )
    # The device check reads the environment (TRITON_INTERPRET), which dynamo cannot trace; while
    # torch.compile traces, skip it (callers check first: the trainer calls check_flash_available).
    problem = None if torch.compiler.is_compiling() else _device_problem(q.device)
    if problem is not None:
        raise FlashAttentionUnavailableError(problem)
    B, Hq, Nq, d = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(
            f"batch size mismatch: q has B={B}, k has B={k.shape[0]}, v has B={v.shape[0]}; "
            "q, k and v must share dim 0"
        )
    if k.shape[3] != d or v.shape[3] != d:
        raise ValueError(
            f"head dim mismatch: q has d={d}, k has d={k.shape[3]}, v has d={v.shape[3]}; "
            "q, k and v must share the last dim"
        )
    if k.shape[2] != v.shape[2]:
        raise ValueError(
            f"k and v must have the same sequence length Nk (dim 2), got k: {k.shape[2]}, v: {v.shape[2]}"
        )
    if k.shape[1] != v.shape[1]:
        raise ValueError(
            f"k and v must have the same number of heads Hkv (dim 1), got k: {k.shape[1]}, v: {v.shape[1]}"
        )
    Hkv, Nk = k.shape[1], k.shape[2]
    if min(B, Hq, Hkv) == 0:
        raise ValueError(
            f"empty batch or head dim: q {tuple(q.shape)}, k {tuple(k.shape)}; B, Hq, Hkv must be >= 1"
        )
    if Nq == 0 or Nk == 0:
        raise ValueError(
            f"sequence length must be >= 1, got Nq={Nq} (q dim 2), Nk={Nk} (k/v dim 2); "
            "skip the attention call for empty sequences"
        )
    if Hq % Hkv != 0:
        raise ValueError(
            f"number of query heads Hq={Hq} must be a multiple of key/value heads Hkv={Hkv} (GQA/MQA); "
            "choose n_head divisible by n_kv_head"
        )
    if not (MIN_HEAD_DIM <= d <= MAX_HEAD_DIM):
        raise ValueError(
            f"head dim d={d} is outside the supported range [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]; "
            "change n_embd / n_head or use attention=sdpa"
        )
    if Hq > _MAX_GRID_YZ or B > _MAX_GRID_YZ:
        raise ValueError(
            f"B={B} and Hq={Hq} must each be <= {_MAX_GRID_YZ} (CUDA grid limit); split the batch"
        )
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {_type_name(causal)}")
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
        if not math.isfinite(softmax_scale):
            raise ValueError(f"softmax_scale must be finite, got {softmax_scale}; None means 1/sqrt(d)")


def check_softcap(softcap) -> float:
    """softcap as the ops take it: 0.0 for None, else the cap c (scores become c * tanh(s / c)).
    Raises ValueError unless it is None or a finite number > 0 (bools refused)."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 < softcap < math.inf:
        raise ValueError(
            f"softcap must be None (no capping) or a finite float > 0, e.g. softcap=50.0 (Gemma 2's "
            f"attention cap), got {softcap!r}"
        )
    return float(softcap)


def _check_variants(q, k, causal, window, doc_ids, dropout_p, dropout_seed):
    """Validate the variant arguments of `flash_attention` (see its docstring for the errors)."""
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(
                f"window must be None or an int >= 1 (keys per query, itself included), got {window!r}"
            )
        if not causal:
            raise ValueError(
                "window needs causal=True (a causal sliding window: query i sees keys "
                "i - w < j <= i); pass causal=True or window=None"
            )
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if dropout_seed is not None:
        if isinstance(dropout_seed, torch.Tensor):
            if dropout_seed.numel() != 1 or dropout_seed.dtype != torch.int64:
                raise ValueError(
                    f"dropout_seed as a tensor must be one int64 element, got dtype "
                    f"{dropout_seed.dtype}, shape {tuple(dropout_seed.shape)}; or pass an int"
                )
        elif (
            isinstance(dropout_seed, bool)
            or not isinstance(dropout_seed, int)
            or not 0 <= dropout_seed < 2**63
        ):
            raise ValueError(
                f"dropout_seed must be None, an int in [0, 2**63) or an int64 tensor of one "
                f"element, got {dropout_seed!r}"
            )
    if doc_ids is None:
        return None
    from .reference import split_doc_ids

    doc_q, doc_k = split_doc_ids(doc_ids, q.shape[2], k.shape[2])
    if doc_q.shape[0] != q.shape[0]:
        raise ValueError(
            f"doc_ids have batch size {doc_q.shape[0]}, q has B={q.shape[0]}; one row of ids per sequence"
        )
    if doc_q.device != q.device or doc_k.device != q.device:
        raise ValueError(
            f"doc_ids must be on q's device {q.device}, got {doc_q.device} / {doc_k.device}; "
            "move them with .to(q.device)"
        )
    if not torch.compiler.is_compiling():  # one device sync; traced graphs skip the check
        for name, t in (("doc_q", doc_q), ("doc_k", doc_k)):
            if t.shape[1] > 1 and not bool((t[:, 1:] >= t[:, :-1]).all()):
                raise ValueError(
                    f"document ids ({name}) must be non-decreasing along each sequence (packed "
                    "documents, each one contiguous); number the documents in order, e.g. "
                    "doc_ids = is_doc_start.cumsum(-1)"
                )
    return doc_q, doc_k


def document_ranges(doc_q: torch.Tensor, doc_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row document ranges the kernels read, from non-decreasing document ids.

    Args:
        doc_q: (B, Nq) integer ids of the query rows; doc_k: (B, Nk) of the keys; both non-decreasing.
    Returns:
        q_doc int32 (2, B, Nq): query row i sees keys [q_doc[0, b, i], q_doc[1, b, i]) (its document's keys);
        k_doc int32 (2, B, Nk): key j is seen by queries [k_doc[0, b, j], k_doc[1, b, j]).
        Computed with torch.searchsorted on the device (no sync, traceable).
    """
    dq, dk = doc_q.to(torch.int64).contiguous(), doc_k.to(torch.int64).contiguous()
    q_doc = torch.stack([torch.searchsorted(dk, dq, side="left"), torch.searchsorted(dk, dq, side="right")])
    k_doc = torch.stack([torch.searchsorted(dq, dk, side="left"), torch.searchsorted(dq, dk, side="right")])
    return q_doc.to(torch.int32).contiguous(), k_doc.to(torch.int32).contiguous()


def _seed_tensor(dropout_seed, device) -> torch.Tensor:
    """int64 (1,) seed on `device`: None draws one from torch's default CPU generator (so torch.manual_seed
    makes runs reproducible), an int is wrapped, a tensor is moved."""
    if dropout_seed is None:
        dropout_seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
    elif not isinstance(dropout_seed, torch.Tensor):
        dropout_seed = torch.tensor([dropout_seed], dtype=torch.int64)
    return dropout_seed.reshape(1).to(device)


def _type_name(x) -> str:
    """A value's type for an error message, module-qualified outside builtins (numpy's bool_ is also
    named "bool")."""
    t = type(x)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _prepare_call(
    q,
    k,
    v,
    causal,
    softmax_scale,
    window,
    doc_ids,
    dropout_p,
    dropout_seed,
    deterministic=False,
    softcap=None,
):
    """Validate a call (raises as `flash_attention` documents) and return (scale, variants): the softmax
    scale as a float and the op's variant arguments (window or 0, q_doc, k_doc, dropout_p, seed tensor,
    deterministic, softcap or 0)."""
    _validate(q, k, v, causal, softmax_scale)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {_type_name(deterministic)}")
    cap = check_softcap(softcap)
    docs = _check_variants(q, k, causal, window, doc_ids, dropout_p, dropout_seed)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    q_doc, k_doc = document_ranges(*docs) if docs is not None else (None, None)
    p = float(dropout_p)
    seed = _seed_tensor(dropout_seed, q.device) if p > 0.0 else None
    return scale, (0 if window is None else int(window), q_doc, k_doc, p, seed, deterministic, cap)


# ---------------------------------------------------------------------------------------------
# operators: one factory for the plain (q, k, v) and the packed (qkv) layouts
# ---------------------------------------------------------------------------------------------


def _plain_eager_call(*tensors: torch.Tensor) -> bool:
    """True when a public function may take the eager autograd.Function: no torch.compile tracing, no
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


class _Ops:
    """The four ops of one layout and the eager autograd.Function over the same launchers.

    `fwd_body(*inputs, causal, softmax_scale, *variants)` -> (o, lse) and `bwd_body(do, *inputs, o, lse,
    causal, softmax_scale, dlse, *variants)` -> the inputs' gradients (a tuple, or one tensor) are the
    annotated op bodies (traced launches); `fwd_eager` / `bwd_eager` the same with untraced launches.
    variants: (window, q_doc, k_doc, dropout_p, dropout_seed, deterministic, softcap).
    """

    def __init__(self, name, n_inputs, fwd_body, bwd_body, fwd_eager, bwd_eager, fwd_fake, bwd_fake):
        self.n_inputs = n_inputs
        # one body, two registrations: traced into the graph on CUDA, opaque (with a fake) for the interpreter
        self.fwd = torch.library.triton_op(f"flashgpt::{name}_fwd", fwd_body, mutates_args=())
        self.bwd = torch.library.triton_op(f"flashgpt::{name}_bwd", bwd_body, mutates_args=())
        self.fwd_cpu = torch.library.custom_op(f"flashgpt::{name}_fwd_cpu", fwd_body, mutates_args=())
        self.bwd_cpu = torch.library.custom_op(f"flashgpt::{name}_bwd_cpu", bwd_body, mutates_args=())
        self.fwd_cpu.register_fake(fwd_fake)
        self.bwd_cpu.register_fake(bwd_fake)
        self.fwd.register_autograd(lambda ctx, do, dlse: self._grads(ctx, do, dlse, self.bwd),
                                   setup_context=self._setup_context)  # fmt: skip
        self.fwd_cpu.register_autograd(lambda ctx, do, dlse: self._grads(ctx, do, dlse, self.bwd_cpu),
                                       setup_context=self._setup_context)  # fmt: skip
        ops = self

        class Eager(torch.autograd.Function):
            """Plain eager mode: the launchers without the custom-op dispatcher. Same kernels, same tiles,
            so both paths give bitwise-identical outputs and gradients (tested)."""

            @staticmethod
            def forward(ctx, *args):
                o, lse = fwd_eager(*args)
                ops._save(ctx, args, (o, lse))
                ctx.set_materialize_grads(False)  # an unused lse output gets None, not a tensor of zeros
                return o, lse

            @staticmethod
            def backward(ctx, do, dlse):
                # With create_graph=True (a gradient penalty) grad mode is on here: go through the backward
                # op, which has no autograd formula, so its graph node (with edges to the inputs) raises if
                # anything differentiates through these gradients -- never a silently dropped term.
                op = ops.bwd if ctx.saved_tensors[0].is_cuda else ops.bwd_cpu
                return ops._grads(ctx, do, dlse, op if torch.is_grad_enabled() else bwd_eager)

        self.eager = Eager

    def _save(self, ctx, inputs, output):
        """Keep what the backward needs: the inputs, o, lse and the variants' tensors, and the flags."""
        n = self.n_inputs
        causal, scale, window, q_doc, k_doc, dropout_p, dropout_seed, deterministic, softcap = inputs[n:]
        ctx.save_for_backward(*inputs[:n], *output, q_doc, k_doc, dropout_seed)
        ctx.causal, ctx.softmax_scale, ctx.window = causal, scale, window
        ctx.dropout_p, ctx.deterministic, ctx.softcap = dropout_p, deterministic, softcap

    def _setup_context(self, ctx, inputs, output):
        self._save(ctx, inputs, output)

    def _grads(self, ctx, do, dlse, backward_fn):
        """The inputs' gradients (and None for the rest) from the saved tensors; `backward_fn` has the
        backward op's signature. A missing dO (only lse used) is zeros."""
        *inputs, o, lse, q_doc, k_doc, dropout_seed = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        grads = backward_fn(do, *inputs, o, lse, ctx.causal, ctx.softmax_scale, dlse, ctx.window, q_doc,
                            k_doc, ctx.dropout_p, dropout_seed, ctx.deterministic, ctx.softcap)  # fmt: skip
        grads = grads if isinstance(grads, tuple) else (grads,)
        return (*grads,) + (None,) * 9

    def __call__(self, *args):
        """(o, lse) of validated arguments (*inputs, causal, softmax_scale, *variants)."""
        if _plain_eager_call(*args[: self.n_inputs]):
            return self.eager.apply(*args)  # same kernels, less host time
        return (self.fwd if args[0].is_cuda else self.fwd_cpu)(*args)  # compile, fake tensors, vmap, ...


def _fwd_body(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float,
    window: int = 0, q_doc: torch.Tensor | None = None, k_doc: torch.Tensor | None = None,
    dropout_p: float = 0.0, dropout_seed: torch.Tensor | None = None, deterministic: bool = False,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Forward op: o (B, Hq, Nq, d) in q's dtype, lse float32 (B, Hq, Nq) natural log. No validation
    (`flash_attention` validates). Variants: window (0 = none), q_doc / k_doc int32 (2, B, Nq) / (2, B, Nk)
    document ranges (`document_ranges`), dropout_p with an int64 (1,) seed, softcap (0 = none);
    deterministic is for the backward (saved)."""
    return launch_fwd(q, k, v, causal, softmax_scale, True, window, q_doc, k_doc, dropout_p, dropout_seed,
                      softcap)  # fmt: skip


def _bwd_body(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
    causal: bool, softmax_scale: float, dlse: torch.Tensor | None = None, window: int = 0,
    q_doc: torch.Tensor | None = None, k_doc: torch.Tensor | None = None, dropout_p: float = 0.0,
    dropout_seed: torch.Tensor | None = None, deterministic: bool = False, softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Backward op: (dq, dk, dv) shaped/typed like (q, k, v), each dense with its input's dim order
    (`empty_like_layout`). dlse: optional gradient of the lse output (float32 (B, Hq, Nq)). Variants
    as in the forward op; deterministic: the split backward even where the one-pass one would run."""
    return launch_bwd(do, q, k, v, o, lse, causal, softmax_scale, dlse, True, window, q_doc, k_doc, dropout_p,
                      dropout_seed, None, deterministic, softcap)  # fmt: skip


def _fwd_eager(q, k, v, causal, scale, window, q_doc, k_doc, dropout_p, dropout_seed, deterministic, softcap):
    return launch_fwd(q, k, v, causal, scale, False, window, q_doc, k_doc, dropout_p, dropout_seed, softcap)


def _bwd_eager(
    do, q, k, v, o, lse, causal, scale, dlse, window, q_doc, k_doc, dropout_p, seed, deterministic, softcap
):
    return launch_bwd(do, q, k, v, o, lse, causal, scale, dlse, False, window, q_doc, k_doc, dropout_p, seed,
                      None, deterministic, softcap)  # fmt: skip


def _fwd_fake(q, k, v, causal, softmax_scale, window=0, q_doc=None, k_doc=None, dropout_p=0.0,
              dropout_seed=None, deterministic=False, softcap=0.0):  # fmt: skip
    q = unit_last_stride(q)  # as launch_fwd sees it
    B, Hq, Nq, d = q.shape
    return empty_like_layout(q), q.new_empty((B, Hq, Nq), dtype=torch.float32)


def _bwd_fake(do, q, k, v, o, lse, causal, softmax_scale, dlse=None, window=0, q_doc=None, k_doc=None,
              dropout_p=0.0, dropout_seed=None, deterministic=False, softcap=0.0):  # fmt: skip
    q, k, v = (unit_last_stride(t) for t in (q, k, v))  # as launch_bwd sees them
    return empty_like_layout(q), empty_like_layout(k), empty_like_layout(v)


# Packed qkv (B, N, 3, H, d): why a packed entry point. A GPT block computes q, k and v with one projection
# and views the three slices of its output. With separate q, k, v the backward returns three tensors and
# autograd concatenates them into d(qkv): a copy of 3 * B * N * H * d elements per layer (302 MB read and
# written at B = 32, N = 1024, C = 768; bench/NOTES.md v10). Here the backward kernels write dq, dk and dv
# straight into the slices of one d(qkv) tensor (FlashAttention-2's `flash_attn_qkvpacked_func`, same reason).


def _packed_fwd(qkv, causal, softmax_scale, window, q_doc, k_doc, dropout_p, dropout_seed, deterministic,
                softcap, traced):  # fmt: skip
    o, lse = launch_fwd(*packed_views(qkv), causal, softmax_scale, traced, window, q_doc, k_doc, dropout_p,
                        dropout_seed, softcap)  # fmt: skip
    return o.transpose(1, 2), lse  # o (B, N, H, d): laid out as q, so contiguous for a contiguous qkv


def _packed_bwd(do, qkv, o, lse, causal, softmax_scale, dlse, window, q_doc, k_doc, dropout_p, dropout_seed,
                deterministic, softcap, traced):  # fmt: skip
    dqkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)  # (B, N, 3, H, d)
    do, o = do.transpose(1, 2), o.transpose(1, 2)
    launch_bwd(do, *packed_views(qkv), o, lse, causal, softmax_scale, dlse, traced, window, q_doc, k_doc,
               dropout_p, dropout_seed, dqkv=dqkv, deterministic=deterministic, softcap=softcap)  # fmt: skip
    return dqkv


def _packed_fwd_body(
    qkv: torch.Tensor, causal: bool, softmax_scale: float, window: int = 0, q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None, dropout_p: float = 0.0, dropout_seed: torch.Tensor | None = None,
    deterministic: bool = False, softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Packed forward op: o (B, N, H, d) in qkv's dtype, lse float32 (B, H, N). Variants as `_fwd_body`'s."""
    return _packed_fwd(qkv, causal, softmax_scale, window, q_doc, k_doc, dropout_p, dropout_seed,
                       deterministic, softcap, True)  # fmt: skip


def _packed_bwd_body(
    do: torch.Tensor, qkv: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, causal: bool,
    softmax_scale: float, dlse: torch.Tensor | None = None, window: int = 0,
    q_doc: torch.Tensor | None = None, k_doc: torch.Tensor | None = None, dropout_p: float = 0.0,
    dropout_seed: torch.Tensor | None = None, deterministic: bool = False, softcap: float = 0.0,
) -> torch.Tensor:  # fmt: skip
    """Packed backward op: d(qkv), a new contiguous (B, N, 3, H, d) tensor in qkv's dtype."""
    return _packed_bwd(do, qkv, o, lse, causal, softmax_scale, dlse, window, q_doc, k_doc, dropout_p,
                       dropout_seed, deterministic, softcap, True)  # fmt: skip


def _packed_fwd_fake(qkv, causal, softmax_scale, window=0, q_doc=None, k_doc=None, dropout_p=0.0,
                     dropout_seed=None, deterministic=False, softcap=0.0):  # fmt: skip
    o, lse = _fwd_fake(*packed_views(qkv), causal, softmax_scale)  # the layout _packed_fwd gives
    return o.transpose(1, 2), lse


def _packed_bwd_fake(do, qkv, o, lse, causal, softmax_scale, dlse=None, window=0, q_doc=None, k_doc=None,
                     dropout_p=0.0, dropout_seed=None, deterministic=False, softcap=0.0):  # fmt: skip
    return torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)


PLAIN = _Ops("flash_attn", 3, _fwd_body, _bwd_body, _fwd_eager, _bwd_eager, _fwd_fake, _bwd_fake)
PACKED = _Ops(
    "flash_attn_qkvpacked", 1, _packed_fwd_body, _packed_bwd_body,
    lambda *a: _packed_fwd(*a, False), lambda *a: _packed_bwd(*a, False), _packed_fwd_fake, _packed_bwd_fake,
)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------


def dropout_keep_mask(
    dropout_seed, B: int, Hq: int, Nq: int, Nk: int, dropout_p: float, device="cpu"
) -> torch.Tensor:
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
    return dropout_mask(_seed_tensor(dropout_seed, torch.device(device)), B, Hq, Nq, Nk, dropout_p)


def flash_attention(
    q,
    k,
    v,
    *,
    causal=True,
    softmax_scale=None,
    return_lse=False,
    window=None,
    doc_ids=None,
    dropout_p=0.0,
    dropout_seed=None,
    deterministic=False,
    softcap=None,
):
    """Exact attention softmax(q k^T * scale [+ causal mask]) v with FlashAttention-2 (Triton).

    Algorithm: Dao 2023 (FlashAttention-2) section 3.1 forward / 3.2 backward, online softmax of
    Milakov & Gimelshein 2018; on sm_90 from N = 1k-4k FlashAttention-3's schedule in Gluon (Shah et al. 2024;
    kernels/_gluon_fwd.py, _gluon_bwd.py). Memory is O(N) (no N x N tensor); the backward recomputes P from
    q, k and the saved LSE. Bitwise reproducible run to run (outputs, and gradients from the split Triton
    backward, which has no atomics) except dq where the one-pass Gluon backward runs (sm_90, causal, MHA,
    N % 128 == 0 from `plan.MIN_N_BWD`; its dq is summed by TMA reduce-add in no fixed order, to
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
        softcap: None, or c > 0: logit soft-capping (Gemma 2, Grok; FlashAttention-2's `softcap`), the
            scores s = scale * q_i . k_j become c * tanh(s / c) before the mask and the softmax, in the
            forward and the backward (dS times 1 - tanh^2); the LSE is that of the capped scores. Runs the
            Triton kernels (the sm_90 Gluon ones take no soft-capping; `describe_plan` says so).
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
            shape, batch, device or not non-decreasing; dropout_p outside [0, 1); a bad dropout_seed;
            softcap not None or a finite number > 0.
        FlashAttentionUnavailableError (RuntimeError and ValueError): CPU tensors without
            TRITON_INTERPRET=1, CUDA unavailable, or triton missing.
    """
    scale, variants = _prepare_call(q, k, v, causal, softmax_scale, window, doc_ids, dropout_p, dropout_seed,
                                    deterministic, softcap)  # fmt: skip
    q, k, v = unit_last_stride(q), unit_last_stride(k), unit_last_stride(v)
    o, lse = PLAIN(q, k, v, causal, scale, *variants)
    return (o, lse) if return_lse else o


def flash_attention_qkvpacked(
    qkv,
    *,
    causal=True,
    softmax_scale=None,
    return_lse=False,
    window=None,
    doc_ids=None,
    dropout_p=0.0,
    dropout_seed=None,
    deterministic=False,
    softcap=None,
):
    """`flash_attention` on the packed output of a fused qkv projection; the backward returns d(qkv) whole.

    Equal, bit for bit, to ``flash_attention(q, k, v, ...).transpose(1, 2)`` with q, k, v =
    ``qkv[:, :, i].transpose(1, 2)`` for i = 0, 1, 2, and the same for the gradients; but the backward kernels
    write dq, dk and dv into the slices of one (B, N, 3, H, d) tensor, so autograd does not concatenate them
    (one copy of d(qkv) per layer saved; the reason for FlashAttention-2's qkvpacked API).

    Args:
        qkv: (B, N, 3, H, d), float16 / bfloat16 / float32, CUDA (or CPU with TRITON_INTERPRET=1); e.g. a
            (B, N, 3 * H * d) projection output viewed as ``.view(B, N, 3, H, d)``. Any strides (a non-unit
            stride on the last dim costs a copy). d in [8, 256].
        causal, softmax_scale, return_lse, window, doc_ids, dropout_p, dropout_seed, deterministic, softcap:
            as in `flash_attention`
            (doc_ids (B, N); the sequence is shared by queries and keys).
    Returns:
        o (B, N, H, d) in qkv's dtype (contiguous for a contiguous qkv), and with return_lse also lse float32
        (B, H, N) in natural-log units. Differentiable to first order, with qkv's gradient a contiguous
        (B, N, 3, H, d) tensor.
    Raises:
        TypeError: qkv not a tensor or not float16 / bfloat16 / float32, return_lse not a bool, and the
            argument errors of `flash_attention`.
        ValueError: qkv not 5-D with size 3 in dim 2 (the message shows the expected view), an empty B, N or
            H, and the shape, device and variant errors of `flash_attention`.
        FlashAttentionUnavailableError: as `flash_attention` (no CUDA and no TRITON_INTERPRET=1, no triton).
    """
    if not isinstance(qkv, torch.Tensor):
        raise TypeError(f"qkv must be a torch.Tensor, got {type(qkv).__name__}")
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(
            f"qkv must be (B, N, 3, H, d), got shape {tuple(qkv.shape)}; view a (B, N, 3 * H * d) projection "
            "output as qkv.view(B, N, 3, H, d), or pass separate q, k, v to flash_attention"
        )
    # what the q, k, v checks of flash_attention would say about a view, said of qkv itself
    if qkv.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"qkv has dtype {qkv.dtype}; flash attention supports float16, bfloat16 and "
            "float32 - cast with qkv.to(torch.bfloat16) (or float16/float32)"
        )
    if 0 in (qkv.shape[0], qkv.shape[1], qkv.shape[3]):
        raise ValueError(
            f"qkv {tuple(qkv.shape)} has an empty dim (B, N and H must be >= 1); skip the call "
            "for empty batches or sequences"
        )
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {_type_name(return_lse)}")
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    scale, variants = _prepare_call(
        *packed_views(qkv),
        causal,
        softmax_scale,
        window,
        doc_ids,
        dropout_p,
        dropout_seed,
        deterministic,
        softcap,
    )
    o, lse = PACKED(qkv, causal, scale, *variants)
    return (o, lse) if return_lse else o


# A compiled graph loaded from Inductor's cache launches the backward kernels without running `launch_bwd`,
# so the scratch allocator is installed at import on a CUDA machine (not under the interpreter, where
# importing triton now would make compiled kernels impossible).
if _HAS_TRITON and not interpret_enabled() and torch.cuda.is_available():
    ensure_scratch_allocator()
    # the Gluon ops must exist before a graph that calls them is traced or loaded from Inductor's cache
    gluon_fwd()
    gluon_bwd()
