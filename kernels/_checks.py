"""Argument and device checks of `flash_attention` (before any op or Triton launch).

Split from `kernels/flash_attn.py` (which re-exports every name here): the device/interpreter checks,
the validation of q, k, v and softmax_scale, and of the variant arguments (window, doc_ids, dropout), with
`document_ranges`, which turns document ids into the per-row key ranges the kernels read.
"""

import importlib.util
import math
import os

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM = 8
MAX_HEAD_DIM = 256
_MAX_GRID_YZ = 65535  # CUDA limit of grid dims y and z (heads, batch)


class FlashAttentionUnavailableError(RuntimeError, ValueError):
    """Flash attention cannot run on this device (no CUDA / no Triton / CPU without TRITON_INTERPRET).

    Subclasses both RuntimeError (what `check_flash_available` documents) and ValueError (the
    argument-validation errors of `flash_attention`), so either `except` clause catches it.
    """


def interpret_enabled() -> bool:
    """True when TRITON_INTERPRET is set to a truthy value (1/true/yes/on) right now."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


_HAS_TRITON = importlib.util.find_spec("triton") is not None  # once, at import (not traceable by dynamo)


def _device_problem(device: torch.device) -> str | None:
    """Why flash attention cannot run on `device`, or None when it can."""
    if not _HAS_TRITON:
        return (
            "flash attention needs the `triton` package, which is not installed; install it "
            "(pip install triton, Linux + CUDA) or use attention=sdpa, the portable choice."
        )
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return (
                f"flash attention was asked to run on {device}, but torch.cuda.is_available() is "
                "False; use a CUDA build of torch on a GPU machine, or attention=sdpa (portable)."
            )
        return None
    if device.type == "cpu" and interpret_enabled():
        return None
    return (
        f"flash attention needs a CUDA GPU, but the tensors are on {device}. For slow CPU testing "
        "set TRITON_INTERPRET=1 (Triton interpreter); otherwise attention=sdpa is the portable choice."
    )


def check_flash_available(device) -> None:
    """Raise if flash attention cannot run on `device` (str or torch.device); return None otherwise.

    Runs on: CUDA devices (with triton installed), and CPU when TRITON_INTERPRET=1 (slow, testing).
    Raises:
        FlashAttentionUnavailableError (a RuntimeError): the message says flash needs a CUDA GPU, or
        TRITON_INTERPRET=1 for slow testing, and that attention=sdpa is the portable choice.
    """
    problem = _device_problem(torch.device(device))
    if problem is not None:
        raise FlashAttentionUnavailableError(problem)


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
    q, k, v, causal, softmax_scale, window, doc_ids, dropout_p, dropout_seed, deterministic=False
):
    """Validate a call (raises as `flash_attention` documents) and return (scale, variants): the softmax
    scale as a float and the op's variant arguments (window or 0, q_doc, k_doc, dropout_p, seed tensor,
    deterministic)."""
    _validate(q, k, v, causal, softmax_scale)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {_type_name(deterministic)}")
    docs = _check_variants(q, k, causal, window, doc_ids, dropout_p, dropout_seed)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    q_doc, k_doc = document_ranges(*docs) if docs is not None else (None, None)
    p = float(dropout_p)
    seed = _seed_tensor(dropout_seed, q.device) if p > 0.0 else None
    return scale, (0 if window is None else int(window), q_doc, k_doc, p, seed, deterministic)
