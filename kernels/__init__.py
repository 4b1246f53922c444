"""Our Triton FlashAttention-2 (Dao 2023, sections 3.1 forward / 3.2 backward).

Public API:
* `flash_attention(q, k, v, *, causal=True, softmax_scale=None, return_lse=False, window=None, doc_ids=None,
  dropout_p=0.0, dropout_seed=None, deterministic=False)` -- with issue 16's variants (sliding window,
  document masks, dropout); deterministic=True keeps the bitwise-reproducible split backward on sm_90
* `flash_attention_qkvpacked(qkv, ...)` -- the same on a fused projection's qkv (B, N, 3, H, d): the backward
  writes d(qkv) whole, so autograd concatenates nothing (`flash_qkvpacked.py`)
* `dropout_keep_mask(seed, B, Hq, Nq, Nk, p)` -- the kernels' own dropout keep mask (tests);
  `document_ranges(doc_q, doc_k)` -- the per-row document ranges the kernels read
* `flash_decode(q, k_cache, v_cache, cache_seqlens=None, *, softmax_scale=None, num_splits=None,
  return_lse=False)` -- split-K flash-decoding of 1..16 query rows against a KV cache (inference only;
  verified under the CPU interpreter and on the H200)
* `check_flash_available(device)` -> None, or raises FlashAttentionUnavailableError (a RuntimeError)
* ops `torch.ops.flashgpt.flash_attn_fwd` / `flash_attn_bwd` (triton ops, CUDA) and `flash_attn_fwd_cpu` /
  `flash_attn_bwd_cpu` (custom ops, interpreter)

Files:
* `flash_attn.py`      launchers, ops, public API (re-exports the names of `_checks.py`)
* `_checks.py`         device / interpreter checks, argument and variant validation, `document_ranges`,
                       `_prepare_call`
* `_triton_kernels.py` the Triton kernels (forward; dQ with Delta; dK/dV) and `build_kernels`
* `_triton_common.py`  their shared helpers (tile loads, block ranges, variant masks, Philox dropout)
* `_gluon_fwd.py`      the sm_90 causal forward in Gluon (FlashAttention-3's schedule, persistent), N >= 1k/2k
* `_gluon_bwd.py`      the sm_90 causal backward in Gluon: one pass, dQ by TMA reduce-add, from N = 2k / 4k
* `_gluon_route.py`    when the forward and backward take them (plain torch: no triton import)
* `flash_qkvpacked.py` the packed-qkv entry point and its ops (same launchers)
* `flash_decode.py` / `_decode_kernels.py`  flash-decoding wrapper / its split and combine kernels
* `reference.py`       `attention_reference` / `attention_mask`: the one float64 reference, explicit mask
* `tiles.py`           `get_tile_config` -- the one place where block sizes / warps / stages are chosen
* `compile_report.py`  `python -m kernels.compile_report`: compile for sm_90 without a GPU and print
                       shared memory, registers and spills per tile config (for tuning)

Kernels are built on first use, for the interpreter when TRITON_INTERPRET is set at call time,
compiled otherwise. Importing this package imports triton only on a CUDA machine without
TRITON_INTERPRET, to install the scratch allocator of the device-side tensor descriptors.
"""

from .flash_attn import (
    FlashAttentionUnavailableError,
    check_flash_available,
    document_ranges,
    dropout_keep_mask,
    flash_attention,
    interpret_enabled,
)
from .flash_decode import MAX_DECODE_ROWS, flash_decode
from .flash_qkvpacked import flash_attention_qkvpacked
from .tiles import TileConfig, get_tile_config, override_tile_config

__all__ = [
    "FlashAttentionUnavailableError",
    "MAX_DECODE_ROWS",
    "TileConfig",
    "check_flash_available",
    "document_ranges",
    "dropout_keep_mask",
    "flash_attention",
    "flash_attention_qkvpacked",
    "flash_decode",
    "get_tile_config",
    "interpret_enabled",
    "override_tile_config",
]
