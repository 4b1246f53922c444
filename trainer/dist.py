"""torch.distributed for the trainer: joining torchrun's process group, and rank-0 broadcasts."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass
class DistInfo:
    """torch.distributed facts for this process (``enabled`` False without torchrun)."""

    enabled: bool = False
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_type: str) -> DistInfo:
    """Join the torchrun process group (NCCL on CUDA, gloo on CPU) when ``WORLD_SIZE`` > 1 is set."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or "RANK" not in os.environ:
        return DistInfo()
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    return DistInfo(True, dist.get_rank(), local_rank, dist.get_world_size())


def broadcast_obj(obj):
    """``obj`` of rank 0 on every rank (``broadcast_object_list``; a process group must exist)."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
