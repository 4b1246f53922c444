"""The one reference attention of the tests (and the model's mask builder): explicit mask, plain softmax.

`attention_reference(q, k, v, ...)` materialises the (Nq, Nk) scores: for tests and small shapes only.
It computes, per batch element b and query head h (GQA: kv head h // (Hq // Hkv)),

    s_ij   = scale * q_i . k_j                          (softcap c: c * tanh(s_ij / c); keep_ij False -> -inf)
    lse_i  = log sum_j exp(s_ij)                        (natural log; -inf for a row that keeps no key)
    p_ij   = exp(s_ij - lse_i)
    o_i    = sum_j p_ij * z_ij / (1 - p_drop) * v_j     (z: optional dropout keep mask; z = 1 without dropout)

in float64 by default (Vaswani et al. 2017, eq. 1; the normaliser and the LSE are those of the undropped
weights, as in FlashAttention). A row that keeps no key gets o = 0, lse = -inf and zero gradients.

The mask (`attention_mask`) is the conjunction of: causal, bottom-right aligned, j <= i + (Nk - Nq); a window
w (needs causal), j > i + (Nk - Nq) - w (FlashAttention-2's ``window_size=(w - 1, 0)``); documents,
doc_q[b, i] == doc_k[b, j]. ``doc_ids``: one integer tensor (B, Nk), query row i taking position
i + Nk - Nq's id, or a pair ``(doc_q (B, Nq), doc_k (B, Nk))``; any ids here (the kernels need them
non-decreasing).
"""

from __future__ import annotations

import math

import torch

__all__ = ["attention_mask", "attention_reference", "split_doc_ids"]


def split_doc_ids(doc_ids, n_q: int, n_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(doc_q (B, Nq), doc_k (B, Nk)) from ``doc_ids`` (module docstring); TypeError / ValueError."""
    if isinstance(doc_ids, torch.Tensor):
        if doc_ids.dim() != 2 or doc_ids.shape[1] != n_k:
            raise ValueError(
                f"doc_ids must be (B, Nk) = (B, {n_k}) (one id per key position), got shape "
                f"{tuple(doc_ids.shape)}; or pass a pair (doc_q (B, Nq), doc_k (B, Nk))"
            )
        if n_q > n_k:
            raise ValueError(
                f"a single doc_ids tensor needs Nq <= Nk (queries: the last Nq positions), got "
                f"Nq={n_q}, Nk={n_k}; pass a pair (doc_q (B, Nq), doc_k (B, Nk)) instead"
            )
        doc_q, doc_k = doc_ids[:, n_k - n_q :], doc_ids
    elif (
        isinstance(doc_ids, (tuple, list))
        and len(doc_ids) == 2
        and all(isinstance(t, torch.Tensor) for t in doc_ids)
    ):
        doc_q, doc_k = doc_ids
        if doc_q.dim() != 2 or doc_q.shape[1] != n_q or doc_k.dim() != 2 or doc_k.shape[1] != n_k:
            raise ValueError(
                f"doc_ids pair must be (doc_q (B, {n_q}), doc_k (B, {n_k})), got "
                f"{tuple(doc_q.shape)} and {tuple(doc_k.shape)}"
            )
        if doc_q.shape[0] != doc_k.shape[0]:
            raise ValueError(f"doc_q and doc_k must share B, got {doc_q.shape[0]} and {doc_k.shape[0]}")
    else:
        raise TypeError(
            f"doc_ids must be a (B, Nk) integer tensor or a pair (doc_q, doc_k), got {type(doc_ids).__name__}"
        )
    for name, t in (("doc_q", doc_q), ("doc_k", doc_k)):
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise TypeError(
                f"document ids ({name}) must be an integer tensor, got {t.dtype}; "
                "use e.g. doc_ids.to(torch.int32)"
            )
    return doc_q, doc_k


def attention_mask(
    n_q: int, n_k: int, *, causal: bool = True, window: int | None = None, doc_ids=None, device=None
) -> torch.Tensor:
    """Boolean keep mask (module docstring), True where query i may attend to key j: (Nq, Nk), or with
    doc_ids (B, 1, Nq, Nk). device: default the doc ids', else CPU. ValueError for a bad window / doc_ids."""
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be None or an int >= 1, got {window!r}")
        if not causal:
            raise ValueError("a sliding window is causal: pass causal=True with window")
    if doc_ids is not None:
        doc_q, doc_k = split_doc_ids(doc_ids, n_q, n_k)
        device = doc_q.device if device is None else device
    i = torch.arange(n_q, device=device)[:, None]
    j = torch.arange(n_k, device=device)[None, :]
    keep = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
    if causal:
        keep &= j <= i + (n_k - n_q)
    if window is not None:
        keep &= j > i + (n_k - n_q) - window
    if doc_ids is not None:
        same = doc_q.to(device)[:, :, None] == doc_k.to(device)[:, None, :]
        keep = (keep[None] & same)[:, None]
    return keep


def attention_reference(
    q,
    k,
    v,
    *,
    causal: bool = True,
    window: int | None = None,
    doc_ids=None,
    dropout_keep: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    mask: torch.Tensor | None = None,
    dtype: torch.dtype | None = torch.float64,
    softcap: float | None = None,
):
    """(o (B, Hq, Nq, d), lse (B, Hq, Nq)) with an explicit mask and softmax, differentiable, for tests.

    q (B, Hq, Nq, d), k / v (B, Hkv, Nk, d) (GQA); causal, window, doc_ids: `attention_mask`. dropout_keep:
    None or a bool mask broadcastable to (B, Hq, Nq, Nk), kept weights scaled by 1 / (1 - dropout_p). mask:
    a keep mask ANDed with the rest. dtype: default float64; None computes in q's dtype (the "same low
    precision" reference of the FlashAttention test rule). softcap c: scores c * tanh(s / c) before the mask.
    ValueError for bad shapes, dropout_p outside [0, 1), a bad window or doc ids.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape != v.shape or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"need q (B, Hq, Nq, d), k = v (B, Hkv, Nk, d), Hq % Hkv == 0; got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    dt = q.dtype if dtype is None else dtype
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    n_q, n_k, d = q.shape[2], k.shape[2], q.shape[3]
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    keep = attention_mask(n_q, n_k, causal=causal, window=window, doc_ids=doc_ids, device=q.device)
    if mask is not None:
        keep = keep & mask.to(q.device)
    keep = keep.expand(q.shape[0], q.shape[1], n_q, n_k)
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    row_any = keep.any(-1, keepdim=True)
    s = s.masked_fill(~keep, float("-inf")).masked_fill(~row_any, 0.0)  # all-masked rows: finite, then zeroed
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    p = torch.exp(s - lse) * keep
    if dropout_keep is not None:
        p = p * dropout_keep.to(q.device) / (1.0 - dropout_p)
    o = torch.matmul(p, v)
    lse = lse.squeeze(-1).masked_fill(~row_any.squeeze(-1), float("-inf"))
    return o, lse


def chunked_causal_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    chunk: int = 1024,
    dtype: torch.dtype = torch.float32,
    softcap: float | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
    """Causal self-attention (..., N, d) and its exact backward in `dtype`, chunk by chunk of query rows:
    the O(chunk * N)-memory form of `attention_reference`, with which `bench.attention` checks every provider
    at N of 32k+. do: dL/dO or None; returns (o, None) or (o, (dq, dk, dv)). The textbook gradient (Dao 2023,
    Alg. 2 without key tiling): dV = P^T dO, dS = P (dO V^T - rowsum(dO * O)), dQ = scale dS K, dK = scale
    dS^T Q; softcap c: scores c * tanh(s / c), dS times 1 - tanh^2. ValueError for unequal q / k lengths.
    """
    n, d = q.shape[-2], q.shape[-1]
    if k.shape[-2] != n or v.shape[-2] != n:
        raise ValueError(f"chunked_causal_reference needs equal query/key lengths, got {n} and {k.shape[-2]}")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qf, kf, vf = (t.detach().to(dtype) for t in (q, k, v))
    o = torch.empty_like(qf)
    grads = None
    if do is not None:
        dof = do.detach().to(dtype)
        dq, dk, dv = torch.empty_like(qf), torch.zeros_like(kf), torch.zeros_like(vf)
    cols = torch.arange(n, device=q.device)
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        qc, kc, vc = qf[..., s:e, :], kf[..., :e, :], vf[..., :e, :]
        scores = (qc @ kc.transpose(-1, -2)) * scale
        if softcap:
            th = torch.tanh(scores / softcap)
            scores = softcap * th
        rows = torch.arange(s, e, device=q.device)[:, None]
        scores.masked_fill_(cols[None, :e] > rows, float("-inf"))
        p = torch.softmax(scores, dim=-1)
        del scores
        oc = p @ vc
        o[..., s:e, :] = oc
        if do is not None:
            doc = dof[..., s:e, :]
            dv[..., :e, :] += p.transpose(-1, -2) @ doc
            dp = doc @ vc.transpose(-1, -2)
            ds = p * (dp - (doc * oc).sum(-1, keepdim=True))
            if softcap:
                ds = ds * (1 - th * th)  # d c tanh(s / c) / ds
            del dp
            dq[..., s:e, :] = (ds @ kc) * scale
            dk[..., :e, :] += (ds.transpose(-1, -2) @ qc) * scale
    if do is not None:
        grads = (dq, dk, dv)
    return o, grads
