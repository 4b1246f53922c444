"""FlashAttention public API: argument validation, the torch ops, and the autograd wiring.

Which kernel runs with which tiles is decided per call by `plan.py`; `_launch.py` executes that plan.
On CUDA the ops are `torch.library.triton_op`s, so torch.compile traces our Triton kernels into its graph
(Inductor launches them, CUDA graphs capture them); under the interpreter they are opaque custom ops with
fakes. In plain eager mode an equivalent autograd.Function skips the op dispatch: at N <= 1024 that host
time is comparable to the kernels' own (bench/NOTES.md v3).
"""

import math

import torch

from ._launch import dropout_mask, kernel_qkv, launch_bwd, launch_fwd
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
from .plan import gluon

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
    """From non-decreasing ids doc_q (B, Nq), doc_k (B, Nk): q_doc int32 (2, B, Nq), query row i sees keys
    [q_doc[0, b, i], q_doc[1, b, i]); k_doc int32 (2, B, Nk), key j is seen by queries [k_doc[0, b, j],
    k_doc[1, b, j]). torch.searchsorted on the device: no sync, traceable."""
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


def _prepare(q, k, v, causal, scale, window, doc_ids, dropout_p, dropout_seed, deterministic, softcap):
    """Validate a call (raising as `flash_attention` says); (softmax scale, the ops' variant arguments)."""
    _validate(q, k, v, causal, scale)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {_type_name(deterministic)}")
    cap = check_softcap(softcap)
    docs = _check_variants(q, k, causal, window, doc_ids, dropout_p, dropout_seed)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
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
    """The four ops of one layout (traced on CUDA, opaque with a fake for the interpreter) and the eager
    autograd.Function over the same launchers. Op arguments: (*inputs, causal, softmax_scale, window,
    q_doc, k_doc, dropout_p, dropout_seed, deterministic, softcap)."""

    def __init__(self, name, n_inputs, fwd_body, bwd_body, fwd_eager, bwd_eager, fwd_fake, bwd_fake):
        self.n_inputs = n_inputs
        self.fwd = torch.library.triton_op(f"flashgpt::{name}_fwd", fwd_body, mutates_args=())
        self.bwd = torch.library.triton_op(f"flashgpt::{name}_bwd", bwd_body, mutates_args=())
        self.fwd_cpu = torch.library.custom_op(f"flashgpt::{name}_fwd_cpu", fwd_body, mutates_args=())
        self.bwd_cpu = torch.library.custom_op(f"flashgpt::{name}_bwd_cpu", bwd_body, mutates_args=())
        self.fwd_cpu.register_fake(fwd_fake)
        self.bwd_cpu.register_fake(bwd_fake)
        self.fwd.register_autograd(lambda ctx, do, dlse: self._grads(ctx, do, dlse, self.bwd),
                                   setup_context=self._save)  # fmt: skip
        self.fwd_cpu.register_autograd(lambda ctx, do, dlse: self._grads(ctx, do, dlse, self.bwd_cpu),
                                       setup_context=self._save)  # fmt: skip
        ops = self

        class Eager(torch.autograd.Function):
            """Plain eager mode: the same launchers without the op dispatcher (bitwise-identical results)."""

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
        n = self.n_inputs
        causal, scale, window, q_doc, k_doc, dropout_p, dropout_seed, deterministic, softcap = inputs[n:]
        ctx.save_for_backward(*inputs[:n], *output, q_doc, k_doc, dropout_seed)
        ctx.causal, ctx.softmax_scale, ctx.window = causal, scale, window
        ctx.dropout_p, ctx.deterministic, ctx.softcap = dropout_p, deterministic, softcap

    def _grads(self, ctx, do, dlse, backward_fn):
        """The inputs' gradients (None for the rest); `backward_fn` has the backward op's signature."""
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
    """Forward op (validated by `flash_attention`): o like q, lse float32 (B, Hq, Nq) natural log. window,
    softcap 0: none; q_doc / k_doc from `document_ranges`; deterministic is for the backward."""
    return launch_fwd(q, k, v, causal, softmax_scale, window, q_doc, k_doc, dropout_p, dropout_seed,
                      deterministic, softcap, traced=True)  # fmt: skip


def _bwd_body(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
    causal: bool, softmax_scale: float, dlse: torch.Tensor | None = None, window: int = 0,
    q_doc: torch.Tensor | None = None, k_doc: torch.Tensor | None = None, dropout_p: float = 0.0,
    dropout_seed: torch.Tensor | None = None, deterministic: bool = False, softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Backward op: (dq, dk, dv) laid out as (q, k, v); dlse: the lse output's gradient or None."""
    return launch_bwd(do, q, k, v, o, lse, causal, softmax_scale, dlse, window, q_doc, k_doc, dropout_p,
                      dropout_seed, deterministic, softcap, traced=True)  # fmt: skip


def _fwd_fake(q, k, v, *_):
    q = unit_last_stride(q)  # as launch_fwd sees it
    return empty_like_layout(q), q.new_empty(q.shape[:3], dtype=torch.float32)


def _bwd_fake(do, q, k, v, *_):
    q, k, v = kernel_qkv(q, k, v)  # as launch_bwd sees them
    return empty_like_layout(q), empty_like_layout(k), empty_like_layout(v)


# Packed qkv (B, N, 3, H, d): the backward kernels write dq, dk, dv into the slices of one d(qkv), so autograd
# concatenates nothing (a copy of 302 MB per layer at B = 32, N = 1024, C = 768; bench/NOTES.md v10).


def _packed_fwd(qkv, *args, traced=False):
    o, lse = launch_fwd(*packed_views(qkv), *args, traced=traced)
    return o.transpose(1, 2), lse  # o (B, N, H, d): laid out as q, so contiguous for a contiguous qkv


def _packed_bwd(do, qkv, o, lse, *args, traced=False):
    dqkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)  # (B, N, 3, H, d)
    views = packed_views(qkv)
    launch_bwd(do.transpose(1, 2), *views, o.transpose(1, 2), lse, *args, traced=traced, dqkv=dqkv)
    return dqkv


def _packed_fwd_body(
    qkv: torch.Tensor, causal: bool, softmax_scale: float, window: int = 0, q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None, dropout_p: float = 0.0, dropout_seed: torch.Tensor | None = None,
    deterministic: bool = False, softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Packed forward op: o (B, N, H, d), lse float32 (B, H, N)."""
    return _packed_fwd(qkv, causal, softmax_scale, window, q_doc, k_doc, dropout_p, dropout_seed,
                       deterministic, softcap, traced=True)  # fmt: skip


def _packed_bwd_body(
    do: torch.Tensor, qkv: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, causal: bool,
    softmax_scale: float, dlse: torch.Tensor | None = None, window: int = 0,
    q_doc: torch.Tensor | None = None, k_doc: torch.Tensor | None = None, dropout_p: float = 0.0,
    dropout_seed: torch.Tensor | None = None, deterministic: bool = False, softcap: float = 0.0,
) -> torch.Tensor:  # fmt: skip
    """Packed backward op: d(qkv), a new contiguous (B, N, 3, H, d) tensor."""
    return _packed_bwd(do, qkv, o, lse, causal, softmax_scale, dlse, window, q_doc, k_doc, dropout_p,
                       dropout_seed, deterministic, softcap, traced=True)  # fmt: skip


def _packed_fwd_fake(qkv, *_):
    o, lse = _fwd_fake(*packed_views(qkv))  # the layout _packed_fwd gives
    return o.transpose(1, 2), lse


def _packed_bwd_fake(do, qkv, *_):
    return torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)


PLAIN = _Ops("flash_attn", 3, _fwd_body, _bwd_body, launch_fwd, launch_bwd, _fwd_fake, _bwd_fake)
PACKED = _Ops(
    "flash_attn_qkvpacked",
    1,
    _packed_fwd_body,
    _packed_bwd_body,
    _packed_fwd,
    _packed_bwd,
    _packed_fwd_fake,
    _packed_bwd_fake,
)


# ---------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------


def dropout_keep_mask(
    dropout_seed, B: int, Hq: int, Nq: int, Nk: int, dropout_p: float, device="cpu"
) -> torch.Tensor:
    """The bool (B, Hq, Nq, Nk) keep mask that `flash_attention(..., dropout_p, dropout_seed)` applies (tests;
    `attention_reference(..., dropout_keep=mask, dropout_p=p)` reproduces the kernels with it)."""
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
    """Exact attention softmax(q k^T * scale [+ mask]) v in O(N) memory (FlashAttention-2; on sm_90 from
    N = 1k-4k FlashAttention-3's schedule in Gluon). Bitwise reproducible run to run, except dq where the
    one-pass Gluon backward runs (its TMA reduce-add has no fixed order); `deterministic=True` or
    torch.use_deterministic_algorithms(True) keeps the split Triton backward there.

    Args:
        q: (B, Hq, Nq, d); k, v: (B, Hkv, Nk, d), Hq a multiple of Hkv (GQA/MQA without copies). One dtype
            among float16, bfloat16, float32 (fp32 dots in IEEE precision), d in [8, 256], any strides (a
            non-unit last stride costs a copy), one device: CUDA, or CPU with TRITON_INTERPRET=1 (bf16 runs
            in float32 there: numpy has no bfloat16).
        causal: bottom-right aligned, query i sees key j iff j <= i + (Nk - Nq); a row that sees no key
            gets o = 0, lse = -inf and zero gradients.
        softmax_scale: default 1 / sqrt(d). return_lse: also return lse (B, Hq, Nq) float32, natural log.
        window: None, or w >= 1 with causal: query i sees keys i + (Nk - Nq) - w < j <= i + (Nk - Nq)
            (FlashAttention-2's window_size=(w - 1, 0)); blocks outside it are skipped, cost O(N * w).
        doc_ids: None, a (B, Nk) integer tensor (query row i takes position i + Nk - Nq's id) or a pair
            (doc_q (B, Nq), doc_k (B, Nk)), non-decreasing along each sequence (checked with one device sync
            outside torch.compile): a query sees only keys of its own document.
        dropout_p: in [0, 1); kept weights are scaled by 1 / (1 - p), the LSE is the undropped one. The mask
            is Philox4x32-10 of (seed, b * Hq + h, i, j), regenerated in the backward, never stored.
        dropout_seed: None (drawn from torch's default generator), an int in [0, 2**63) or an int64 tensor
            of one element (no recompilation per seed under torch.compile).
        deterministic: bitwise-reproducible gradients (the split Triton backward) wherever it runs.
        softcap: None, or c > 0: scores become c * tanh(s / c) before the mask and softmax (Gemma 2);
            runs the Triton kernels.
    Returns:
        o (B, Hq, Nq, d) in the input dtype, dense with q's dim order (so o.transpose(1, 2) is contiguous
        for the trainer's fused-qkv views), and lse if return_lse. Differentiable to first order (a double
        backward raises).
    Raises (before any launch): TypeError / ValueError naming the bad argument and a value that works;
        FlashAttentionUnavailableError (RuntimeError and ValueError): CPU tensors without
        TRITON_INTERPRET=1, no CUDA, or no triton.
    """
    scale, variants = _prepare(
        q, k, v, causal, softmax_scale, window, doc_ids, dropout_p, dropout_seed, deterministic, softcap
    )
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
    """`flash_attention` on qkv (B, N, 3, H, d), a fused projection's output viewed; o (B, N, H, d) (and lse
    (B, H, N)). Bitwise equal to `flash_attention` on the three slices, but the backward writes
    d(qkv) whole, a contiguous (B, N, 3, H, d) tensor (FlashAttention-2's qkvpacked API). The keywords and
    errors are `flash_attention`'s (doc_ids (B, N): queries and keys share the sequence).
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
    q, k, v = packed_views(qkv)
    scale, variants = _prepare(
        q, k, v, causal, softmax_scale, window, doc_ids, dropout_p, dropout_seed, deterministic, softcap
    )
    o, lse = PACKED(qkv, causal, scale, *variants)
    return (o, lse) if return_lse else o


# A compiled graph loaded from Inductor's cache launches the backward kernels without running `launch_bwd`,
# so the scratch allocator is installed at import on a CUDA machine (not under the interpreter, where
# importing triton now would make compiled kernels impossible).
if _HAS_TRITON and not interpret_enabled() and torch.cuda.is_available():
    ensure_scratch_allocator()
    # the Gluon ops must exist before a graph that calls them is traced or loaded from Inductor's cache
    gluon("fwd")
    gluon("bwd")
