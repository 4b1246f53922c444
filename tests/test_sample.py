"""Sampling: standalone checkpoints (tokenizer inside), the KV cache, sample.py and eval.py."""

from __future__ import annotations

import json

import pytest

from trainer.checkpoint import tokenizer_from_checkpoint, tokenizer_record

CHARS = list("\n !,.:;?ABCabc")


def _char_meta(itos=CHARS) -> dict:
    return {"format_version": 1, "tokenizer": "char", "vocab_size": len(itos), "train_tokens": 0,
            "val_tokens": 0, "source": "x", "source_sha256": "0", "dtype": "uint16", "itos": list(itos)}


def _write_meta(d, meta) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "meta.json").write_text(json.dumps(meta))


# ------------------------------------------------------------------------------ standalone checkpoints


def test_tokenizer_record_holds_char_vocabulary():
    rec = tokenizer_record(_char_meta())
    assert rec == {"name": "char", "vocab_size": len(CHARS), "itos": CHARS}
    tok = tokenizer_from_checkpoint({"tokenizer": rec, "config": {"data": {"dir": "/nonexistent"}}})
    assert tok.decode(tok.encode("Abc, cab!\n")) == "Abc, cab!\n"


def test_old_checkpoint_falls_back_to_meta_json(tmp_path):
    _write_meta(tmp_path / "d", _char_meta())
    old = {"tokenizer": {"name": "char", "vocab_size": len(CHARS)},
           "config": {"data": {"dir": str(tmp_path / "d")}}}
    assert tokenizer_from_checkpoint(old).itos == CHARS
    # an explicit data_dir wins over the config's
    _write_meta(tmp_path / "e", _char_meta(CHARS[::-1]))
    assert tokenizer_from_checkpoint(old, tmp_path / "e").itos == CHARS[::-1]


def test_old_checkpoint_without_meta_json_is_a_clear_error(tmp_path):
    old = {"tokenizer": {"name": "char", "vocab_size": 14},
           "config": {"data": {"dir": str(tmp_path / "gone")}}}
    with pytest.raises(ValueError, match="not in the checkpoint.*meta.json"):
        tokenizer_from_checkpoint(old)
    with pytest.raises(ValueError, match="names no data.dir"):
        tokenizer_from_checkpoint({"tokenizer": {"name": "char", "vocab_size": 14}})
    _write_meta(tmp_path / "small", _char_meta(CHARS[:5]))
    with pytest.raises(ValueError, match="vocab_size=14"):
        tokenizer_from_checkpoint(old, tmp_path / "small")
    with pytest.raises(ValueError, match="names no tokenizer"):
        tokenizer_from_checkpoint({"model": {}})


def test_gpt2_checkpoint_tokenizer(gpt2_bpe):
    tok = tokenizer_from_checkpoint({"tokenizer": {"name": "gpt2", "vocab_size": 50257}})
    assert tok.decode(tok.encode("To be, or not")) == "To be, or not"
