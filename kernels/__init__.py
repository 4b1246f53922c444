"""Our FlashAttention kernels: Triton FlashAttention-2 (Dao 2023, sections 3.1 forward / 3.2 backward),
FlashAttention-3-style Gluon kernels on sm_90, and flash-decoding.

Public API:
* `flash_attention(q, k, v, *, causal=True, softmax_scale=None, return_lse=False, window=None, doc_ids=None,
  dropout_p=0.0, dropout_seed=None, deterministic=False, softcap=None)` -- with the variants (sliding
  window, document masks, dropout, logit soft-capping c * tanh(s / c)); deterministic=True keeps the
  bitwise-reproducible split backward on sm_90
* `flash_attention_qkvpacked(qkv, ...)` -- the same on a fused projection's qkv (B, N, 3, H, d): the backward
  writes d(qkv) whole, so autograd concatenates nothing
* `dropout_keep_mask(seed, B, Hq, Nq, Nk, p)` -- the kernels' own dropout keep mask (tests);
  `document_ranges(doc_q, doc_k)` -- the per-row document ranges the kernels read
* `flash_decode(q, k_cache, v_cache, cache_seqlens=None, *, softmax_scale=None, num_splits=None,
  return_lse=False, softcap=None)` -- split-K flash-decoding of 1..16 query rows against a KV cache
* `check_flash_available(device)` -> None, or raises FlashAttentionUnavailableError (a RuntimeError)
* `describe_plan(head_dim, seq_len, dtype, device, deterministic, ...)` -- one line: what a run launches
* ops `torch.ops.flashgpt.flash_attn_fwd` / `flash_attn_bwd` (and `flash_attn_qkvpacked_*`; triton ops, CUDA)
  and `..._cpu` (custom ops, interpreter)

Files:
* `plan.py`            which kernel runs with which tiles, TMA and splits, per call (`python -m kernels`
                       prints the rule); reads FLASHGPT_GLUON_FWD / FLASHGPT_GLUON_BWD
* `flash_attn.py`      argument validation, the ops (one factory for plain and packed qkv), public API
* `_launch.py`         the launchers: execute a plan
* `_runtime.py`        interpreter / device checks and the tensor helpers every launcher shares
* `_triton_kernels.py` the Triton kernels (forward; dQ with Delta; dK/dV), `@triton.jit`
* `_triton_common.py`  their shared helpers (tile loads, block ranges, variant masks, Philox dropout)
* `_gluon_fwd.py`      the sm_90 causal forward in Gluon (FlashAttention-3's schedule, persistent)
* `_gluon_bwd.py`      the sm_90 causal backward in Gluon: one pass, dQ by TMA reduce-add
* `flash_decode.py` / `_decode_kernels.py`  flash-decoding wrapper / its split and combine kernels
* `reference.py`       `attention_reference` / `attention_mask`: the one float64 reference, explicit mask
* `compile_report.py`  `python -m kernels.compile_report`: compile for sm_90 without a GPU and print
                       shared memory, registers and spills per tile config (for tuning)

Interpreter or compiler: the Triton kernels are `@triton.jit` functions, imported at the first kernel
launch; TRITON_INTERPRET at that moment decides for the whole process (set it before the first flash call
to run on the CPU). Importing this package imports triton only on a CUDA machine without TRITON_INTERPRET,
to install the scratch allocator of the device-side tensor descriptors.
"""

from ._runtime import FlashAttentionUnavailableError, check_flash_available, interpret_enabled
from .flash_attn import (
    MAX_HEAD_DIM,
    MIN_HEAD_DIM,
    document_ranges,
    dropout_keep_mask,
    flash_attention,
    flash_attention_qkvpacked,
)
from .flash_decode import flash_decode
from .plan import MAX_DECODE_ROWS, TileConfig, get_tile_config, override_tile_config
from .plan import describe as describe_plan

__all__ = [
    "FlashAttentionUnavailableError",
    "MAX_DECODE_ROWS",
    "MAX_HEAD_DIM",
    "MIN_HEAD_DIM",
    "TileConfig",
    "check_flash_available",
    "describe_plan",
    "document_ranges",
    "dropout_keep_mask",
    "flash_attention",
    "flash_attention_qkvpacked",
    "flash_decode",
    "get_tile_config",
    "interpret_enabled",
    "override_tile_config",
]
