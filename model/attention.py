"""Causal self-attention backends behind one function, selected by name.

Every backend computes the same function, causal scaled dot-product attention without dropout
(Vaswani et al. 2017, "Attention Is All You Need", eq. 1, with a causal mask as in GPT-2):

    o[b, h, i] = sum_{j <= i} softmax_j(q[b, h, i] . k[b, h, j] / sqrt(d)) * v[b, h, j]

Inputs are q, k, v of shape (B, H, N, d) (batch, heads, sequence length, head dim), all the same shape,
dtype and device; any strides are accepted. The output has shape (B, H, N, d) and the dtype of v.

Backends (``ATTENTION_BACKENDS``):

* ``"naive"``: materialises the N x N score matrix, scores and softmax in float32 (or float64 when the
  inputs are float64), then casts the probabilities to v.dtype and multiplies by v. Memory O(B*H*N^2).
* ``"sdpa"``: ``torch.nn.functional.scaled_dot_product_attention(..., is_causal=True)``. With
  ``sdpa_backend="auto"`` PyTorch picks the kernel; any other value of ``SDPA_BACKENDS`` pins one kernel
  with ``torch.nn.attention.sdpa_kernel`` and raises a clear RuntimeError if it cannot run.
* ``"flash"``: our Triton FlashAttention-2 kernel, ``kernels.flash_attention(q, k, v, causal=True)``,
  imported lazily on first use (it needs a CUDA GPU, or TRITON_INTERPRET=1 for slow CPU testing).

A new backend is added with one call, ``register_attention_backend(name, fn)``.

Variants (issue 16), in every built-in backend, passed as keywords to ``attention``:

* ``window=w``: causal sliding window, query i sees keys i - w < j <= i (FlashAttention-2's
  ``window_size=(w - 1, 0)``);
* ``doc_ids`` (B, N) integer document ids (non-decreasing for flash): a token attends only to its own
  document;
* ``dropout_p``: dropout on the attention probabilities (training only; the caller passes 0 in eval).
  naive drops P (``F.dropout``), sdpa passes ``dropout_p``, flash drops inside the kernel (Philox).

naive and sdpa build the explicit boolean mask with ``kernels.reference.attention_mask``; flash skips the
blocks outside the window / document in the kernel. Without variants each backend runs its plain causal path
(no mask tensor).

KV-cache decoding (``cached_attention``): q holds the Nq newest rows, k/v the Nk >= Nq keys of the cache
prefix (the last Nq of them are the new rows' own keys). The causal mask is aligned bottom-right: query row
i sees keys j <= i + Nk - Nq. Every built-in backend supports it (naive: a shifted mask; sdpa: no mask for
one row, an explicit boolean mask otherwise, because SDPA's ``is_causal`` aligns top-left when Nq != Nk;
flash: ``kernels.flash_decode`` for 1..16 rows without gradients, else ``flash_attention(causal=True)``,
which aligns bottom-right too). Backends registered later declare it
with ``register_attention_backend(..., kv_cache=True)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = [
    "ATTENTION_BACKENDS",
    "SDPA_BACKENDS",
    "attention",
    "attention_qkvpacked",
    "available_attention_backends",
    "cached_attention",
    "check_attention_backend",
    "check_sdpa_backend",
    "check_variants",
    "register_attention_backend",
    "sdpa_backend_that_ran",
    "static_decode_attention",
]

#: Built-in attention backends (names accepted by ``attention`` and ``GPTConfig.attention``).
ATTENTION_BACKENDS: tuple[str, ...] = ("naive", "sdpa", "flash")

#: Kernel choices for the ``"sdpa"`` backend. ``"auto"`` lets PyTorch choose; the others pin one kernel.
SDPA_BACKENDS: tuple[str, ...] = ("auto", "flash", "cudnn", "efficient", "math")

#: A backend function: ``fn(q, k, v, sdpa_backend) -> o`` with q, k, v, o of shape (B, H, N, d).
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, str], torch.Tensor]

#: A packed backend function: ``fn(qkv, sdpa_backend, *, window, doc_ids, dropout_p) -> o`` with qkv
#: (B, N, 3, H, d) and o (B, N, H, d) (``attention_qkvpacked``).
QKVPackedFn = Callable[..., torch.Tensor]

_REGISTRY: dict[str, AttentionFn] = {}
_QKVPACKED: dict[str, QKVPackedFn] = {}  # backends that take a fused projection's qkv whole
_KV_CACHE_OK: set[str] = set()  # backends whose fn accepts Nq < Nk (bottom-right causal mask)
_VARIANTS_OK: set[str] = set()  # backends whose fn takes window= / doc_ids= / dropout_p= keywords


def register_attention_backend(
    name: str,
    fn: AttentionFn,
    *,
    overwrite: bool = False,
    kv_cache: bool = False,
    variants: bool = False,
    qkvpacked: QKVPackedFn | None = None,
) -> None:
    """Register ``fn`` as attention backend ``name``.

    Args:
        name: backend name, as used in ``attention(..., backend=name)`` and ``GPTConfig.attention``.
        fn: ``fn(q, k, v, sdpa_backend) -> o``; q, k, v (B, H, N, d) of one dtype/device (any strides),
            o (B, H, N, d) in v.dtype. Must compute causal attention with scale 1/sqrt(d) and no dropout,
            so that all backends are the same function (the loss-parity checks rely on it).
        overwrite: allow replacing an existing backend.
        kv_cache: ``fn`` also accepts q of shape (B, H, Nq, d) with k, v of shape (B, H, Nk, d), Nq <= Nk,
            masking causally aligned bottom-right (query i sees keys j <= i + Nk - Nq); required for
            ``GPT.generate`` with the KV cache.
        variants: ``fn`` also takes the keywords ``window`` (None or int >= 1), ``doc_ids`` (None or (B, N)
            integer ids) and ``dropout_p`` (float in [0, 1)) with the meaning of ``attention``'s.
        qkvpacked: optional ``fn(qkv, sdpa_backend, *, window, doc_ids, dropout_p) -> o``, the same function
            on a fused projection's output qkv (B, N, 3, H, d), returning o (B, N, H, d); the model trains
            through it (``attention_qkvpacked``). Without it the backend gets the three slices.

    Raises:
        ValueError: ``name`` is already registered and ``overwrite`` is False (pass overwrite=True or
            pick another name), or ``name`` is not a non-empty string.
        TypeError: ``fn`` or ``qkvpacked`` is not callable.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"attention backend name must be a non-empty string, got {name!r}")
    for what, f in (("fn", fn), ("qkvpacked", qkvpacked if qkvpacked is not None else fn)):
        if not callable(f):
            raise TypeError(
                f"register_attention_backend({name!r}): {what} must be callable, got {type(f).__name__}"
            )
    if name in _REGISTRY and not overwrite:
        raise ValueError(
            f"attention backend {name!r} is already registered; pass overwrite=True to replace it "
            "or register under another name"
        )
    _REGISTRY[name] = fn
    if kv_cache:
        _KV_CACHE_OK.add(name)
    else:
        _KV_CACHE_OK.discard(name)
    if variants:
        _VARIANTS_OK.add(name)
    else:
        _VARIANTS_OK.discard(name)
    if qkvpacked is not None:
        _QKVPACKED[name] = qkvpacked
    else:
        _QKVPACKED.pop(name, None)


def available_attention_backends() -> tuple[str, ...]:
    """Names of all registered backends (the built-ins of ``ATTENTION_BACKENDS`` plus any added later)."""
    return tuple(_REGISTRY)


def check_attention_backend(name: str) -> None:
    """Raise ValueError naming the valid choices if ``name`` is not a registered attention backend."""
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown attention backend {name!r}; valid names: {', '.join(_REGISTRY)} "
            "(set attention=<one of these>)"
        )


def check_sdpa_backend(name: str) -> None:
    """Raise ValueError naming the valid choices if ``name`` is not one of ``SDPA_BACKENDS``."""
    if name not in SDPA_BACKENDS:
        raise ValueError(
            f"unknown sdpa_backend {name!r}; valid names: {', '.join(SDPA_BACKENDS)} "
            "(set attention.sdpa_backend=auto to let PyTorch choose)"
        )


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4:
        raise ValueError(f"attention expects q, k, v of shape (B, H, N, d); got q of shape {tuple(q.shape)}")
    if q.shape != k.shape or q.shape != v.shape:
        raise ValueError(
            "attention expects q, k, v of the same shape (B, H, N, d); got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError(
            "attention expects q, k, v with one dtype and device; got "
            f"{q.dtype}/{q.device}, {k.dtype}/{k.device}, {v.dtype}/{v.device}"
        )


def check_variants(window=None, doc_ids=None, dropout_p: float = 0.0, n: int | None = None) -> None:
    """Raise ValueError naming the argument if a variant value is invalid (see ``attention``)."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(
            f"window must be None or an int >= 1 (keys per query, itself included), got {window!r}"
        )
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"attention dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if doc_ids is not None:
        if (
            not isinstance(doc_ids, torch.Tensor)
            or doc_ids.dim() != 2
            or (n is not None and doc_ids.shape[1] != n)
        ):
            raise ValueError(
                f"doc_ids must be a (B, N) integer tensor with N = {n}, got "
                f"{getattr(doc_ids, 'shape', type(doc_ids).__name__)}"
            )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    backend: str,
    sdpa_backend: str = "auto",
    *,
    window: int | None = None,
    doc_ids: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Causal scaled dot-product attention (scale 1/sqrt(d)) with the chosen backend, and its variants.

    Args:
        q, k, v: (B, H, N, d) tensors, same shape, dtype and device; strided views are fine.
        backend: one of ``available_attention_backends()`` (built-ins: ``ATTENTION_BACKENDS``).
        sdpa_backend: one of ``SDPA_BACKENDS``; only used by the ``"sdpa"`` backend.
        window: None, or w >= 1: query i sees only keys i - w < j <= i (sliding window).
        doc_ids: None, or (B, N) integer document ids, non-decreasing along each sequence (packed documents):
            a query sees only keys of its own document.
        dropout_p: dropout probability on the attention weights, in [0, 1) (pass 0 in eval). Each backend
            draws its own mask (naive / sdpa from torch's generator, flash from a Philox seed drawn from it),
            so with dropout the backends agree in distribution, not elementwise.

    Returns:
        o: (B, H, N, d) in v.dtype.

    Raises:
        ValueError: unknown backend / sdpa_backend (the message lists the valid names), bad shapes, bad
            variant values, or variants with a backend registered without ``variants=True``.
        RuntimeError: a pinned sdpa_backend cannot run on these inputs (the message says how to fix it);
            the flash kernel is unavailable (from ``kernels``).
    """
    check_attention_backend(backend)
    check_sdpa_backend(sdpa_backend)
    _check_qkv(q, k, v)
    return _call(
        _REGISTRY[backend], (q, k, v), backend, sdpa_backend, window, doc_ids, dropout_p, q.shape[-2]
    )


def _call(fn, tensors, backend, sdpa_backend, window, doc_ids, dropout_p, n):
    """``fn(*tensors, sdpa_backend)``, with the variant keywords when any variant is set (checked, and the
    backend must have been registered with ``variants=True``)."""
    if window is None and doc_ids is None and not dropout_p:
        return fn(*tensors, sdpa_backend)
    check_variants(window, doc_ids, dropout_p, n)
    if backend not in _VARIANTS_OK:
        raise ValueError(
            f"attention backend {backend!r} was registered without variants=True: it cannot "
            "run attention.window, attention.document_mask or model.attn_dropout; use naive, "
            "sdpa or flash"
        )
    return fn(*tensors, sdpa_backend, window=window, doc_ids=doc_ids, dropout_p=float(dropout_p))


def attention_qkvpacked(
    qkv: torch.Tensor,
    backend: str,
    sdpa_backend: str = "auto",
    *,
    window: int | None = None,
    doc_ids: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """``attention`` on the output of a fused qkv projection, as the model trains it.

    Args:
        qkv: (B, N, 3, H, d): q, k, v stacked in dim 2 (a (B, N, 3 * H * d) projection output viewed so).
        backend, sdpa_backend, window, doc_ids, dropout_p: as in ``attention``.

    Returns:
        o: (B, N, H, d) in qkv's dtype (the layout the output projection reads).

    A backend registered with ``qkvpacked=`` gets qkv whole (flash: its backward writes d(qkv) in one
    buffer, so autograd does not concatenate dq, dk and dv: one copy of d(qkv) per layer saved); the others
    get the views ``qkv[:, :, i].transpose(1, 2)``, as ``attention`` takes them. Same function either way.

    Raises:
        TypeError: qkv is not a tensor.
        ValueError: qkv not (B, N, 3, H, d), and the errors of ``attention``.
        RuntimeError: a registered ``qkvpacked`` function returned another shape than (B, N, H, d).
    """
    if not isinstance(qkv, torch.Tensor):
        raise TypeError(f"attention_qkvpacked expects qkv as a torch.Tensor, got {type(qkv).__name__}")
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"attention_qkvpacked expects qkv of shape (B, N, 3, H, d); got {tuple(qkv.shape)}")
    packed = _QKVPACKED.get(backend)
    if packed is None:
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))  # (B, H, N, d) views
        o = attention(q, k, v, backend, sdpa_backend, window=window, doc_ids=doc_ids, dropout_p=dropout_p)
        return o.transpose(1, 2)
    check_sdpa_backend(sdpa_backend)
    o = _call(packed, (qkv,), backend, sdpa_backend, window, doc_ids, dropout_p, qkv.shape[1])
    B, N, _, H, d = qkv.shape
    if tuple(o.shape) != (B, N, H, d):  # (B, H, N, d), the unpacked contract, would be read scrambled
        raise RuntimeError(
            f"attention backend {backend!r}: its qkvpacked function returned shape {tuple(o.shape)}, "
            f"expected (B, N, H, d) = {(B, N, H, d)} (not the (B, H, N, d) of the plain backend function)"
        )
    return o


def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    backend: str,
    sdpa_backend: str = "auto",
    *,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of the Nq newest query rows to a KV-cache prefix of Nk >= Nq keys (decode / chunked prefill).

    Args:
        q: (B, H, Nq, d), the queries of the newest Nq positions.
        k, v: (B, H, Nk, d), keys/values of positions 0..Nk-1 (the last Nq are the new rows' own);
            typically a view of a preallocated cache (any strides).
        backend, sdpa_backend: as for ``attention``.
        window: None, or w >= 1: row i also only sees keys j > i + Nk - Nq - w (the model's sliding window).

    Returns:
        o: (B, H, Nq, d) in v.dtype; row i attends to keys j <= i + Nk - Nq (bottom-right causal mask).

    Raises:
        ValueError: unknown backend / sdpa_backend, a backend registered without ``kv_cache=True``, or
            shapes that do not fit (Nq > Nk, other B/H/d, mixed dtype or device).
        RuntimeError: as for ``attention``.
    """
    check_attention_backend(backend)
    check_sdpa_backend(sdpa_backend)
    if backend not in _KV_CACHE_OK:
        raise ValueError(
            f"attention backend {backend!r} was registered without kv_cache=True, so it cannot attend to a "
            "KV cache; generate with use_cache=False, or register it with kv_cache=True"
        )
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(
            f"cached_attention expects q (B, H, Nq, d), k = v (B, H, Nk, d); got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    b, h, nq, d = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (b, h, d) or nq > k.shape[2]:
        raise ValueError(
            f"cached_attention needs k/v of shape (B, H, Nk >= Nq, d) for q {tuple(q.shape)}; "
            f"got {tuple(k.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError(
            "cached_attention expects q, k, v with one dtype and device; got "
            f"{q.dtype}/{q.device}, {k.dtype}/{k.device}, {v.dtype}/{v.device}"
        )
    if window is not None:
        check_variants(window)
        if backend not in _VARIANTS_OK:
            raise ValueError(
                f"attention backend {backend!r} was registered without variants=True: it cannot "
                "run a sliding window; use naive, sdpa or flash"
            )
        return _REGISTRY[backend](q, k, v, sdpa_backend, window=window, doc_ids=None, dropout_p=0.0)
    return _REGISTRY[backend](q, k, v, sdpa_backend)


def static_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    backend: str,
    sdpa_backend: str = "auto",
    *,
    window: int | None = None,
) -> torch.Tensor:
    """One decode row per sequence against the whole preallocated cache, with per-sequence lengths.

    Shapes do not depend on the lengths (they are a device tensor), so torch.compile / CUDA graphs can
    capture the step once for every position.

    Args:
        q: (B, H, 1, d), the newest position's queries.
        k, v: (B, H, T, d), the full cache buffers (T = block size); slots >= lengths[b] are ignored.
        lengths: (B,) int64 on q's device, 1 <= lengths[b] <= T: keys [0, lengths[b]) are visible (the
            new row's own key included).
        backend, sdpa_backend: a built-in backend (naive, sdpa, flash) and the SDPA kernel choice.
        window: None, or w >= 1: only keys [lengths[b] - w, lengths[b]) are visible (flash then runs the
            naive formula: flash-decoding has no window).

    Returns:
        o: (B, H, 1, d) in v.dtype.

    Raises:
        ValueError: q with more than one row, unknown or non-built-in backend.
        RuntimeError: as for ``attention`` (pinned SDPA kernel that cannot run, flash unavailable).
    """
    check_attention_backend(backend)
    check_sdpa_backend(sdpa_backend)
    if q.dim() != 4 or q.shape[-2] != 1 or k.shape != v.shape or k.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"static_decode_attention expects q (B, H, 1, d) and k = v (B, H, T, d); got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if window is not None:
        check_variants(window)
    if backend == "flash" and window is None:
        from kernels import flash_decode

        # the KV cache keeps 1 <= lengths <= T: no host read of the lengths, which would synchronise the
        # device once per layer and token in eager decoding
        return flash_decode(q, k, v, lengths, check_lengths=False)
    # (B, 1, 1, T): True where the key slot holds a position of that sequence
    slots = torch.arange(k.shape[-2], device=q.device)
    visible = slots < lengths[:, None]
    if window is not None:
        visible = visible & (slots >= lengths[:, None] - window)
    visible = visible[:, None, None, :]
    if backend in ("naive", "flash"):
        compute_dtype = torch.promote_types(q.dtype, torch.float32)
        scores = torch.matmul(q.to(compute_dtype), k.to(compute_dtype).transpose(-2, -1))
        scores = scores.mul_(1.0 / math.sqrt(q.shape[-1])).masked_fill_(~visible, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)
    if backend == "sdpa":
        if sdpa_backend == "auto":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
        from torch.nn.attention import sdpa_kernel

        try:
            with sdpa_kernel([_sdpa_enum(sdpa_backend)]):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
        except RuntimeError as err:
            raise RuntimeError(
                f"attention.sdpa_backend={sdpa_backend} was pinned, but its SDPA kernel cannot run a masked "
                f"decode step ({_SDPA_HINTS[sdpa_backend]}; the flash kernel takes no mask); use "
                f"attention.sdpa_backend=auto or efficient/math. PyTorch said: {err}"
            ) from err
    raise ValueError(
        f"static decode steps support the built-in backends naive, sdpa, flash, not "
        f"{backend!r}; generate with static_decode=False"
    )


# --------------------------------------------------------------------------------------- naive


def _variant_mask(q: torch.Tensor, k: torch.Tensor, window, doc_ids) -> torch.Tensor:
    """Boolean keep mask (Nq, Nk) or (B, 1, Nq, Nk) of the causal (bottom-right) + window + document mask."""
    from kernels.reference import attention_mask

    return attention_mask(
        q.shape[-2], k.shape[-2], causal=True, window=window, doc_ids=doc_ids, device=q.device
    )


def _naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sdpa_backend: str,
    *,
    window=None,
    doc_ids=None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Materialised attention: S = q k^T / sqrt(d) and P = softmax(S) in >= float32, then (P.to(v)) @ v.

    Memory: one (B, H, N, N) float32 score buffer (scaled and masked in place) and the float32 softmax
    output (kept by autograd for softmax's backward), plus its v.dtype cast (kept for the matmul's backward;
    no copy when v is float32). Variants: the explicit mask of ``_variant_mask``; dropout on P
    (``F.dropout``: kept weights scaled by 1 / (1 - p)).
    """
    d = q.shape[-1]
    nq, nk = q.shape[-2], k.shape[-2]
    compute_dtype = torch.promote_types(q.dtype, torch.float32)  # float32, or float64 for float64 inputs
    scores = torch.matmul(q.to(compute_dtype), k.to(compute_dtype).transpose(-2, -1))  # (B, H, Nq, Nk)
    # In place is safe: matmul's backward needs its inputs, not its output; masked_fill_'s backward needs
    # only the mask.
    scores.mul_(1.0 / math.sqrt(d))
    if window is None and doc_ids is None:
        # bottom-right aligned: row i sees keys j <= i + nk - nq (the usual causal mask when nq == nk)
        hidden = torch.ones(nq, nk, dtype=torch.bool, device=q.device).triu_(nk - nq + 1)
    else:
        hidden = ~_variant_mask(q, k, window, doc_ids)
    scores.masked_fill_(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    return torch.matmul(probs.to(v.dtype), v)


# ---------------------------------------------------------------------------------------- sdpa


def _sdpa_enum(name: str):
    from torch.nn.attention import SDPBackend

    return {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }[name]


_SDPA_HINTS = {
    "flash": "needs float16/bfloat16 on a CUDA GPU (sm80+) and head_dim <= 256 (on CPU, PyTorch's own CPU "
    "flash kernel runs in most builds)",
    "cudnn": "needs a CUDA GPU (sm80+) with cuDNN >= 9 and float16/bfloat16",
    "efficient": "needs a CUDA GPU (float32/float16/bfloat16)",
    "math": "runs everywhere",
}


def _sdpa_call(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window=None, doc_ids=None, dropout_p: float = 0.0
) -> torch.Tensor:
    nq, nk = q.shape[-2], k.shape[-2]
    if window is not None or doc_ids is not None:  # explicit boolean mask (True = attend)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=_variant_mask(q, k, window, doc_ids), dropout_p=dropout_p
        )
    if dropout_p > 0.0:
        if nq != nk:
            raise ValueError("attention dropout is for training (Nq == Nk); pass dropout_p=0 with a KV cache")
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
    if nq == nk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if nq == 1:  # one decode row sees the whole prefix: no mask, so every SDPA kernel can run it
        return F.scaled_dot_product_attention(q, k, v)
    # SDPA's is_causal aligns top-left when nq != nk; the cache needs bottom-right (True = attend)
    keep = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril_(nk - nq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sdpa_backend: str,
    *,
    window=None,
    doc_ids=None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """SDPA; variants: an explicit boolean mask (window / documents; the flash and cuDNN kernels of SDPA
    take no mask, so pin efficient or math, or use auto) and SDPA's own ``dropout_p``."""
    if sdpa_backend == "auto":
        return _sdpa_call(q, k, v, window, doc_ids, dropout_p)
    from torch.nn.attention import sdpa_kernel

    try:
        with sdpa_kernel([_sdpa_enum(sdpa_backend)]):
            return _sdpa_call(q, k, v, window, doc_ids, dropout_p)
    except RuntimeError as err:
        others = ", ".join(b for b in SDPA_BACKENDS if b not in ("auto", sdpa_backend))
        raise RuntimeError(
            f"attention.sdpa_backend={sdpa_backend} was pinned, but PyTorch's {sdpa_backend!r} SDPA kernel "
            f"cannot run for q/k/v of shape {tuple(q.shape)}, dtype {q.dtype}, device {q.device} "
            f"({sdpa_backend} {_SDPA_HINTS[sdpa_backend]}). "
            f"Fix: set attention.sdpa_backend=auto to let PyTorch choose, or pin another of: {others}. "
            f"PyTorch said: {err}"
        ) from err


_ENUM_TO_NAME = {
    "MATH": "math",
    "FLASH_ATTENTION": "flash",
    "EFFICIENT_ATTENTION": "efficient",
    "CUDNN_ATTENTION": "cudnn",
    "OVERRIDEABLE": "overrideable",
    "ERROR": "error",
}


def sdpa_backend_that_ran(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sdpa_backend: str, dropout_p: float = 0.0
) -> str:
    """Best-effort name of the SDPA kernel that ``attention(q, k, v, "sdpa", sdpa_backend)`` uses, for logs.

    A pinned ``sdpa_backend`` is returned as is (if it could not run, ``attention`` raises instead).
    For ``"auto"`` this asks PyTorch's private dispatcher helper ``torch._fused_sdp_choice`` (same inputs,
    is_causal=True, respecting any active ``sdpa_kernel`` context) and maps its answer to one of
    ``"flash"``, ``"efficient"``, ``"cudnn"``, ``"math"`` (or ``"overrideable"``). On CPU PyTorch has its
    own C++ flash kernel, so CPU float inputs usually report ``"flash"`` meaning that CPU kernel, not the
    CUDA FlashAttention. If the private helper is missing or fails (it may change between PyTorch
    versions), returns ``"math"`` on CPU and ``"unknown"`` elsewhere. Best effort only: the real dispatcher
    can still differ in corner cases (e.g. requires_grad-dependent choices).

    Args:
        q, k, v: (B, H, N, d) tensors as passed to ``attention``.
        sdpa_backend: one of ``SDPA_BACKENDS``.
        dropout_p: the attention dropout of the calls (training): kernels that take no dropout are not
            chosen (on the CPU, PyTorch's flash kernel; math runs instead).

    Returns:
        a backend name (str).

    Raises:
        ValueError: unknown ``sdpa_backend``.
    """
    check_sdpa_backend(sdpa_backend)
    if sdpa_backend != "auto":
        return sdpa_backend
    try:
        from torch.nn.attention import SDPBackend

        choice = torch._fused_sdp_choice(q, k, v, dropout_p=float(dropout_p), is_causal=True)
        member = choice if isinstance(choice, SDPBackend) else SDPBackend(int(choice))
        return _ENUM_TO_NAME.get(member.name, member.name.lower())
    except Exception:  # private API: any failure means "we don't know"
        return "math" if q.device.type == "cpu" else "unknown"


# --------------------------------------------------------------------------------------- flash


def _kernels():
    """The `kernels` package, imported on first use; a clear error if it (or triton) cannot be imported."""
    try:
        import kernels
    except ImportError as err:
        raise RuntimeError(
            "attention=flash needs our Triton kernel package `kernels` (and triton), which failed to import: "
            f"{err}. Fix: install the repo with `pip install -e .` (and triton), or use attention=sdpa."
        ) from err
    return kernels


def _flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sdpa_backend: str,
    *,
    window=None,
    doc_ids=None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    flash_attention = _kernels().flash_attention
    if window is not None or doc_ids is not None or dropout_p > 0.0:
        return flash_attention(q, k, v, causal=True, window=window, doc_ids=doc_ids, dropout_p=dropout_p)
    nq, nk = q.shape[-2], k.shape[-2]
    if nq < nk and not (q.requires_grad or k.requires_grad or v.requires_grad):
        from kernels import MAX_DECODE_ROWS, flash_decode

        if nq <= MAX_DECODE_ROWS:  # a KV-cache decode step: split the keys (flash-decoding)
            return flash_decode(q, k, v)
    return flash_attention(q, k, v, causal=True)


def _flash_qkvpacked(
    qkv: torch.Tensor, sdpa_backend: str, *, window=None, doc_ids=None, dropout_p: float = 0.0
) -> torch.Tensor:
    return _kernels().flash_attention_qkvpacked(
        qkv, causal=True, window=window, doc_ids=doc_ids, dropout_p=dropout_p
    )


register_attention_backend("naive", _naive, kv_cache=True, variants=True)
register_attention_backend("sdpa", _sdpa, kv_cache=True, variants=True)
register_attention_backend("flash", _flash, kv_cache=True, variants=True, qkvpacked=_flash_qkvpacked)
