"""``gpt_config_for``: the model's ``GPTConfig`` from a run config's model keys (set-up: trainer/setup.py)."""

from __future__ import annotations

import dataclasses


def gpt_config_for(cfg, vocab_size: int, doc_separator_ids=None):
    """``model.GPTConfig`` of a run: every ``model.*`` and ``attention.*`` key that is a GPTConfig field, by
    name (``attention.name`` is GPTConfig's ``attention``; issue 16's ``window``, ``document_mask``,
    ``attn_dropout`` flow the same way), the block size (``model.block_size``, null = ``seq_len``),
    ``vocab_size`` and the prepared data's ``doc_separator_ids`` (meta.json).

    Raises:
        ValueError: from GPTConfig's own checks.
    """
    from model import GPTConfig

    names = {f.name for f in dataclasses.fields(GPTConfig)} - {"block_size", "vocab_size", "attention"}
    args = {}
    for group in (cfg.model, cfg.attention):
        keys = [f.name for f in dataclasses.fields(group)] if dataclasses.is_dataclass(group) else list(group)
        args.update({k: getattr(group, k) for k in keys if k in names})
    m = cfg.model
    return GPTConfig(
        **args,
        block_size=m.block_size if m.block_size is not None else cfg.seq_len,
        vocab_size=vocab_size,
        attention=cfg.attention.name,
        doc_separator_ids=doc_separator_ids,
    )
