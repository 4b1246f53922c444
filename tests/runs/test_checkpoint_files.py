"""A checkpoint's record lists the size and CRC-32 of each of its files, and ``load_checkpoint`` checks
them: a truncated or overwritten DCP shard of the newest checkpoint is found (DCP alone raises EOFError or
loads NaNs), so ``load_newest`` falls back to the older checkpoint. Records written before the list load
as before. (End to end, eval.py and resume=true over such a shard: test_reliability_resume.py.)"""

from __future__ import annotations

import pytest
import torch

from trainer import checkpoint as ckpt

SHARD = "__0_0.distcp"


@pytest.fixture
def two_checkpoints(tmp_path):
    """Checkpoints of steps 1 and 2 of a small model and its AdamW state (seed 0)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in (1, 2):
        model(torch.randn(8, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ckpt.save_checkpoint(model, opt, {"step": step}, tmp_path, step, keep=2)
    return tmp_path, model


def test_record_lists_every_file_but_itself_and_an_intact_checkpoint_loads(two_checkpoints):
    out, model = two_checkpoints
    path, record = ckpt.load_newest(out, warn=pytest.fail)
    assert path == ckpt.ckpt_path(out, 2) and record["step"] == 2
    fresh = torch.nn.Linear(64, 64)
    ckpt.load_weights(path, fresh)
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True)
    )
    files = record["files"]
    assert sorted(files) == sorted(p.name for p in path.iterdir() if p.name != ckpt.RECORD), files
    assert SHARD in files and ".metadata" in files
    assert all(isinstance(s, int) and isinstance(c, int) for s, c in files.values())
    assert files[SHARD][0] == (path / SHARD).stat().st_size


def _truncate(f):
    f.write_bytes(f.read_bytes()[:1000])


def _flip_middle(f):
    data = bytearray(f.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = bytes(b ^ 0xFF for b in data[mid : mid + 64])  # same size, other bytes
    f.write_bytes(bytes(data))


def _delete(f):
    f.unlink()


@pytest.mark.parametrize(
    "damage, says",
    [(_truncate, "has 1000 bytes"), (_flip_middle, "checksum crc32"), (_delete, "is missing")],
)
def test_a_damaged_shard_does_not_load_and_the_older_checkpoint_is_used(two_checkpoints, damage, says):
    out, _ = two_checkpoints
    newest = ckpt.ckpt_path(out, 2)
    damage(newest / SHARD)
    with pytest.raises(ValueError, match=SHARD) as e:
        ckpt.load_checkpoint(newest)
    assert says in str(e.value), e.value
    warned = []
    path, record = ckpt.load_newest(out, warn=warned.append)
    assert path == ckpt.ckpt_path(out, 1) and record["step"] == 1
    assert len(warned) == 1 and newest.name in warned[0] and SHARD in warned[0], warned


def test_a_record_without_the_file_list_loads_as_before(two_checkpoints):
    """Checkpoints written before records listed their files: nothing to check, the record loads."""
    out, model = two_checkpoints
    path = ckpt.ckpt_path(out, 2)
    record = torch.load(path / ckpt.RECORD, weights_only=True)
    del record["files"]
    torch.save(record, path / ckpt.RECORD)
    _flip_middle(path / SHARD)  # undetectable without the list, as before
    assert ckpt.load_checkpoint(path) == {"step": 2, "path": str(path)}
    assert ckpt.load_newest(out, warn=pytest.fail)[0] == path
