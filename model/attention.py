"""Causal self-attention: one function, ``attention``, over interchangeable backends.

Every backend computes o = softmax(q k^T / sqrt(d), over the keys each query may see) v. "May see" is the
mask of ``kernels.reference.attention_mask``: causal aligned bottom-right (query i of Nq sees key
j <= i + Nk - Nq, so Nq < Nk are the newest rows of a KV cache), and the variants

* ``window=w``: only the w most recent keys (FlashAttention-2's window_size=(w-1, 0));
* ``doc_ids``: only keys of the query's own document ((B, Nk) ids, or a pair (doc_q (B, Nq), doc_k (B, Nk)));
* ``lengths`` (B,): one query row per sequence against a whole cache buffer, keys j < lengths[b] only
  (FlashAttention's cache_seqlens: static shapes, so one CUDA graph serves every position);
* ``dropout_p``: dropout on the attention weights (training);
* ``softcap=c``: scores s become c * tanh(s / c) before the mask (Gemma 2); naive and flash only.

k and v may have fewer heads than q (grouped-query attention): query head h reads kv head h // (Hq // Hkv).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "ATTENTION_BACKENDS",
    "BACKENDS",
    "SDPA_BACKENDS",
    "Backend",
    "attention",
    "available_attention_backends",
    "check_softcap",
    "register_attention_backend",
    "sdpa_backend_that_ran",
]

#: Built-in attention backends (``GPTConfig.attention`` / ``attention=<name>``).
ATTENTION_BACKENDS: tuple[str, ...] = ("naive", "sdpa", "flash")

#: Kernel choices for the ``"sdpa"`` backend. ``"auto"`` lets PyTorch choose; the others pin one kernel.
SDPA_BACKENDS: tuple[str, ...] = ("auto", "flash", "cudnn", "efficient", "math")


@dataclass(frozen=True)
class Backend:
    """One attention implementation; all its functions compute the function of the module docstring.

    ``full(q, k, v, sdpa_backend, **variants)``: q (B, Hq, Nq, d), k, v (B, Hkv, Nk, d) -> (B, Hq, Nq, d).
    ``packed(qkv, sdpa_backend, **variants)``: a fused projection's qkv (B, N, 3, H, d) -> (B, N, H, d)
    (flash: the backward writes d(qkv) whole); None: ``full`` gets the three views.
    ``decode(q, k, v, lengths, sdpa_backend, window=, doc_ids=)``: the static decode step; None: none.
    The flags say what the functions take: Nq < Nk (``kv_cache``), the keywords window, doc_ids and
    dropout_p (``variants``), fewer kv heads (``gqa``; else k, v are repeated to Hq heads), ``softcap``.
    """

    name: str
    full: Callable[..., torch.Tensor]
    packed: Callable[..., torch.Tensor] | None = None
    decode: Callable[..., torch.Tensor] | None = None
    kv_cache: bool = False
    variants: bool = False
    gqa: bool = False
    softcap: bool = False


BACKENDS: dict[str, Backend] = {}


def register_attention_backend(
    name: str,
    fn: Callable[..., torch.Tensor],
    *,
    overwrite: bool = False,
    kv_cache: bool = False,
    variants: bool = False,
    qkvpacked: Callable[..., torch.Tensor] | None = None,
    decode: Callable[..., torch.Tensor] | None = None,
    gqa: bool = False,
    softcap: bool = False,
) -> Backend:
    """Add backend ``name`` and return its ``Backend``. ``fn`` must compute causal attention with scale
    1/sqrt(d) and no dropout unless asked, so that every backend is the same function."""
    for what, f in (("fn", fn), ("qkvpacked", qkvpacked), ("decode", decode)):
        if (f is not None or what == "fn") and not callable(f):
            raise TypeError(
                f"register_attention_backend({name!r}): {what} must be callable, got {type(f).__name__}"
            )
    if name in BACKENDS and not overwrite:
        raise ValueError(
            f"attention backend {name!r} is already registered; pass overwrite=True to replace it "
            "or register under another name"
        )
    BACKENDS[name] = Backend(name, fn, qkvpacked, decode, kv_cache, variants, gqa, softcap)
    return BACKENDS[name]


def available_attention_backends() -> tuple[str, ...]:
    """Names of all registered backends (the built-ins of ``ATTENTION_BACKENDS`` plus any added later)."""
    return tuple(BACKENDS)


def check_softcap(backend: str, softcap) -> None:
    """Raise ValueError unless ``softcap`` is None or a finite number > 0 that ``backend`` can run.

    sdpa cannot: PyTorch's scaled_dot_product_attention has no soft-cap, and FlexAttention's ``score_mod``,
    which could add one, has no backward on the CPU in PyTorch 2.13, no dropout and compiles per shape."""
    if softcap is None:
        return
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 < softcap < math.inf:
        raise ValueError(f"attention.softcap must be null or a finite number > 0, e.g. 30.0, got {softcap!r}")
    if backend in BACKENDS and not BACKENDS[backend].softcap:
        why = (
            "PyTorch's scaled_dot_product_attention has no soft-cap (FlexAttention's score_mod has no CPU "
            "backward)"
            if backend == "sdpa"
            else "it was registered without softcap=True"
        )
        raise ValueError(
            f"attention.softcap={softcap} cannot run with attention={backend}: {why}; use attention=flash or "
            "attention=naive (a model trained with the cap needs it; a new train.py run may drop it with "
            "attention.softcap=null)"
        )


def attention(
    q: torch.Tensor | None = None,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    backend: str = "sdpa",
    sdpa_backend: str = "auto",
    *,
    qkv: torch.Tensor | None = None,
    window: int | None = None,
    doc_ids=None,
    dropout_p: float = 0.0,
    lengths: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention (scale 1/sqrt(d)) on ``backend`` with the variants of the module docstring.

    q (B, Hq, Nq, d), k, v (B, Hkv, Nk, d), Nq <= Nk, any strides -> (B, Hq, Nq, d) in v.dtype; or ``qkv``
    (B, N, 3, H, d), a fused projection's output -> (B, N, H, d). ``lengths`` (int64 on q's device, Nq = 1,
    1 <= lengths[b] <= Nk) is not checked on the device: the KV cache keeps it so. Errors name the config
    key to change.
    """
    if qkv is None:
        q_shape, k_shape = tuple(q.shape), tuple(k.shape)
    else:
        if q is not None or k is not None or v is not None or lengths is not None:
            raise ValueError("attention takes either q, k, v or qkv=, not both (and no lengths with qkv)")
        if not isinstance(qkv, torch.Tensor):
            raise TypeError(f"attention expects qkv as a torch.Tensor, got {type(qkv).__name__}")
        if qkv.dim() != 5 or qkv.shape[2] != 3:
            raise ValueError(f"attention expects qkv of shape (B, N, 3, H, d); got {tuple(qkv.shape)}")
        B, N, _, H, d = qkv.shape
        q_shape = k_shape = (B, H, N, d)
    b = _resolve(backend, sdpa_backend, q_shape, k_shape, window, doc_ids, dropout_p, lengths, softcap)
    if q_shape[1] != k_shape[1] and not b.gqa:  # grouped kv heads to a backend that wants Hq of them
        k, v = (t.repeat_interleave(q_shape[1] // k_shape[1], dim=1) for t in (k, v))
    kw = {}
    if window is not None or doc_ids is not None or dropout_p:  # else the plain call, for any backend
        kw = {"window": window, "doc_ids": doc_ids}
    if softcap is not None:
        kw["softcap"] = float(softcap)
    if lengths is not None:
        return b.decode(q, k, v, lengths, sdpa_backend, **kw)
    if kw:
        kw["dropout_p"] = float(dropout_p)
    if qkv is None:
        return b.full(q, k, v, sdpa_backend, **kw)
    if b.packed is None:
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))  # (B, H, N, d) strided views, no copy
        return b.full(q, k, v, sdpa_backend, **kw).transpose(1, 2)  # (B, N, H, d)
    o = b.packed(qkv, sdpa_backend, **kw)
    if tuple(o.shape) != (B, N, H, d):  # (B, H, N, d), the unpacked layout, would be read scrambled
        raise RuntimeError(
            f"attention backend {backend!r}: its qkvpacked function returned shape {tuple(o.shape)}, "
            f"expected (B, N, H, d) = {(B, N, H, d)} (not the (B, H, N, d) of the plain backend function)"
        )
    return o


def _resolve(
    backend, sdpa_backend, q_shape, k_shape, window, doc_ids, dropout_p, lengths, softcap
) -> Backend:
    """The ``Backend`` for a call of these shapes and variants, after every check of what the call asks."""
    if backend not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {backend!r}; valid names: {', '.join(BACKENDS)} "
            "(set attention=<one of these>)"
        )
    if sdpa_backend not in SDPA_BACKENDS:
        raise ValueError(
            f"unknown sdpa_backend {sdpa_backend!r}; valid names: {', '.join(SDPA_BACKENDS)} "
            "(set attention.sdpa_backend=auto to let PyTorch choose)"
        )
    check_softcap(backend, softcap)
    b = BACKENDS[backend]
    qs, ks = q_shape, k_shape
    if len(qs) != 4 or len(ks) != 4 or (ks[0], ks[3]) != (qs[0], qs[3]) or qs[1] % ks[1] or qs[2] > ks[2]:
        raise ValueError(
            f"attention needs q (B, Hq, Nq, d) and k, v (B, Hkv dividing Hq, Nk >= Nq, d); got q {qs}, k {ks}"
        )
    (nb, _, nq, _), nk = qs, ks[2]
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(
            f"window must be None or an int >= 1 (keys per query, itself included; attention.window), "
            f"got {window!r}"
        )
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(
            f"attention dropout_p must be a float in [0, 1) (model.attn_dropout), got {dropout_p!r}"
        )
    if dropout_p and (nq != nk or lengths is not None):
        raise ValueError("attention dropout is for training (Nq == Nk); pass dropout_p=0 with a KV cache")
    if doc_ids is not None:
        pair = isinstance(doc_ids, (tuple, list)) and len(doc_ids) == 2
        shapes = [tuple(getattr(t, "shape", ())) for t in (doc_ids if pair else [doc_ids])]
        if shapes not in ([(nb, nk)], [(nb, nq), (nb, nk)]):
            raise ValueError(
                f"doc_ids must be a (B, Nk) = {(nb, nk)} integer tensor or a pair (doc_q (B, Nq), "
                f"doc_k (B, Nk)) (attention.document_mask), got shapes {shapes}"
            )
    if (window is not None or doc_ids is not None or dropout_p) and not b.variants:
        raise ValueError(
            f"attention backend {backend!r} was registered without variants=True: it cannot run "
            "attention.window, attention.document_mask or model.attn_dropout; use naive, sdpa or flash"
        )
    if lengths is not None:
        if b.decode is None:
            raise ValueError(
                f"attention backend {backend!r} has no static decode step; use attention=naive, "
                "sdpa or flash, or generate with static_decode=False"
            )
        if nq != 1 or not isinstance(lengths, torch.Tensor) or tuple(lengths.shape) != (nb,):
            raise ValueError(
                f"lengths needs one query row and a (B,) = ({nb},) tensor; got q {q_shape}, "
                f"lengths {getattr(lengths, 'shape', lengths)}"
            )
    elif nq < nk and not b.kv_cache:
        raise ValueError(
            f"attention backend {backend!r} was registered without kv_cache=True, so it cannot attend to a "
            "KV cache (Nq < Nk); generate with use_cache=False, or register it with kv_cache=True"
        )
    return b


# --------------------------------------------------------------------------------------- naive


def _mask(n_q: int, n_k: int, window, doc_ids, device) -> torch.Tensor:
    # imported on first use: importing the model does not import the kernels package and triton
    from kernels.reference import attention_mask

    return attention_mask(n_q, n_k, causal=True, window=window, doc_ids=doc_ids, device=device)


def _decode_mask(lengths, n_k: int, window=None, doc_ids=None) -> torch.Tensor:
    """(B, 1, 1, Nk) keep mask of one query row at position lengths[b] - 1 of a whole cache buffer."""
    slots = torch.arange(n_k, device=lengths.device)
    keep = slots < lengths[:, None]  # (B, Nk)
    if window is not None:
        keep = keep & (slots >= lengths[:, None] - window)
    if doc_ids is not None:  # (doc_q (B, 1), doc_k (B, Nk)): the query's document only
        keep = keep & (doc_ids[1] == doc_ids[0])
    return keep[:, None, None, :]


def _softmax_attention(q, k, v, keep, dropout_p: float = 0.0, softcap=None) -> torch.Tensor:
    """Scores and softmax in float32 (float64 stays); a GQA group's query heads share their kv head through
    a broadcast matmul, with no copy of k and v."""
    (B, Hq, Nq, d), Hkv = q.shape, k.shape[1]
    dtype = torch.promote_types(q.dtype, torch.float32)
    qg = q.to(dtype).reshape(B, Hkv, Hq // Hkv * Nq, d)  # a group's query rows side by side
    scores = torch.matmul(qg, k.to(dtype).transpose(-2, -1)).view(B, Hq, Nq, -1)  # (B, Hq, Nq, Nk)
    # in place is safe: matmul's backward needs its inputs, masked_fill_'s only the mask
    scores.mul_(1.0 / math.sqrt(d))
    if softcap is not None:  # tanh's backward needs its output, so not in place
        scores = torch.tanh(scores / softcap) * softcap
    scores.masked_fill_(~keep, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p, training=True)  # kept weights scaled by 1 / (1 - p)
    o = torch.matmul(probs.to(v.dtype).view(B, Hkv, Hq // Hkv * Nq, -1), v)  # (B, Hkv, G * Nq, d)
    return o.view(B, Hq, Nq, d)


def _naive(q, k, v, sdpa_backend, *, window=None, doc_ids=None, dropout_p=0.0, softcap=None):
    keep = _mask(q.shape[-2], k.shape[-2], window, doc_ids, q.device)
    return _softmax_attention(q, k, v, keep, dropout_p, softcap)


def _naive_decode(q, k, v, lengths, sdpa_backend, *, window=None, doc_ids=None, softcap=None):
    return _softmax_attention(q, k, v, _decode_mask(lengths, k.shape[-2], window, doc_ids), softcap=softcap)


# ---------------------------------------------------------------------------------------- sdpa

_SDPA_NEEDS = {
    "flash": "needs float16/bfloat16 on a CUDA GPU (sm80+), head_dim <= 256 and no attention mask (on CPU, "
    "PyTorch's own CPU flash kernel runs in most builds)",
    "cudnn": "needs a CUDA GPU (sm80+) with cuDNN >= 9, float16/bfloat16 and no attention mask",
    "efficient": "needs a CUDA GPU (float32/float16/bfloat16)",
    "math": "runs everywhere",
}


def _sdpa(q, k, v, sdpa_backend, *, window=None, doc_ids=None, dropout_p=0.0, keep=None):
    nq, nk = q.shape[-2], k.shape[-2]
    if keep is None and (window is not None or doc_ids is not None or 1 < nq != nk):
        # an explicit mask: SDPA's is_causal aligns top-left when Nq != Nk, a cache needs bottom-right
        keep = _mask(nq, nk, window, doc_ids, q.device)
    # no mask tensor: Nq == Nk is plain causal, one decode row sees the whole prefix
    kw = dict(is_causal=nq == nk) if keep is None else dict(attn_mask=keep)
    if q.shape[1] != k.shape[1]:
        kw["enable_gqa"] = True  # only then: older kernels lack it
    if sdpa_backend == "auto":  # the training path: no context manager for torch.compile to trace
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, **kw)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernel = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}
    try:
        with sdpa_kernel([getattr(SDPBackend, kernel.get(sdpa_backend, "MATH"))]):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, **kw)
    except RuntimeError as err:
        others = ", ".join(b for b in SDPA_BACKENDS if b not in ("auto", sdpa_backend))
        raise RuntimeError(
            f"attention.sdpa_backend={sdpa_backend} was pinned, but PyTorch's {sdpa_backend!r} SDPA kernel "
            f"cannot run for q/k/v of shape {tuple(q.shape)}, dtype {q.dtype}, device {q.device} "
            f"({sdpa_backend} {_SDPA_NEEDS[sdpa_backend]}). "
            f"Fix: set attention.sdpa_backend=auto to let PyTorch choose, or pin another of: {others}. "
            f"PyTorch said: {err}"
        ) from err


def _sdpa_decode(q, k, v, lengths, sdpa_backend, *, window=None, doc_ids=None):
    return _sdpa(q, k, v, sdpa_backend, keep=_decode_mask(lengths, k.shape[-2], window, doc_ids))


def sdpa_backend_that_ran(q, k, v, sdpa_backend: str, dropout_p: float = 0.0) -> str:
    """Best-effort name of the SDPA kernel that ``attention(q, k, v, "sdpa", sdpa_backend)`` runs, for logs:
    for ``"auto"`` PyTorch's private dispatcher helper answers (on the CPU ``"flash"`` is PyTorch's C++
    kernel); if it fails, ``"math"`` on the CPU and ``"unknown"`` elsewhere."""
    if sdpa_backend not in SDPA_BACKENDS:
        raise ValueError(f"unknown sdpa_backend {sdpa_backend!r}; valid names: {', '.join(SDPA_BACKENDS)}")
    if sdpa_backend != "auto":
        return sdpa_backend
    try:
        from torch.nn.attention import SDPBackend

        choice = torch._fused_sdp_choice(q, k, v, dropout_p=float(dropout_p), is_causal=True)
        member = choice if isinstance(choice, SDPBackend) else SDPBackend(int(choice))
        return member.name.lower().removesuffix("_attention")  # FLASH_ATTENTION -> flash, MATH -> math
    except Exception:  # private API: any failure means "we don't know"
        return "math" if q.device.type == "cpu" else "unknown"


# --------------------------------------------------------------------------------------- flash


def _kernels():
    """The ``kernels`` package, imported on first use, with a clear error if it (or triton) cannot be."""
    try:
        import kernels
    except ImportError as err:
        raise RuntimeError(
            "attention=flash needs our Triton kernel package `kernels` (and triton), which failed to import: "
            f"{err}. Fix: install the repo with `pip install -e .` (and triton), or use attention=sdpa."
        ) from err
    return kernels


def _flash(q, k, v, sdpa_backend, *, window=None, doc_ids=None, dropout_p=0.0, softcap=None):
    kernels = _kernels()
    plain = window is None and doc_ids is None and not dropout_p
    grad = q.requires_grad or k.requires_grad or v.requires_grad
    if plain and q.shape[-2] < k.shape[-2] and q.shape[-2] <= kernels.MAX_DECODE_ROWS and not grad:
        return kernels.flash_decode(q, k, v, softcap=softcap)  # a KV-cache step: keys split over programs
    return kernels.flash_attention(
        q, k, v, causal=True, window=window, doc_ids=doc_ids, dropout_p=dropout_p, softcap=softcap
    )


def _flash_packed(qkv, sdpa_backend, *, window=None, doc_ids=None, dropout_p=0.0, softcap=None):
    return _kernels().flash_attention_qkvpacked(
        qkv, causal=True, window=window, doc_ids=doc_ids, dropout_p=dropout_p, softcap=softcap
    )


def _flash_decode(q, k, v, lengths, sdpa_backend, *, window=None, doc_ids=None, softcap=None):
    if window is not None or doc_ids is not None:  # flash_decode has no masks
        return _naive_decode(q, k, v, lengths, sdpa_backend, window=window, doc_ids=doc_ids, softcap=softcap)
    # the KV cache keeps 1 <= lengths <= Nk: no host read of the lengths (a device sync per layer and token)
    return _kernels().flash_decode(q, k, v, lengths, check_lengths=False, softcap=softcap)


register_attention_backend(
    "naive", _naive, kv_cache=True, variants=True, decode=_naive_decode, gqa=True, softcap=True
)
register_attention_backend("sdpa", _sdpa, kv_cache=True, variants=True, decode=_sdpa_decode, gqa=True)
register_attention_backend(
    "flash",
    _flash,
    kv_cache=True,
    variants=True,
    qkvpacked=_flash_packed,
    decode=_flash_decode,
    gqa=True,
    softcap=True,
)
