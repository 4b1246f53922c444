"""torch.distributed for the trainer: joining torchrun's process group, rank-0 broadcasts, FSDP2 sharding
(``parallel=fsdp``), the data index of a micro-batch, and the common exit of every rank on a config error."""

from __future__ import annotations

import os
import sys
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


def global_micro_index(micro: int, grad_accum: int, rank: int, world_size: int) -> int:
    """Index of rank ``rank``'s micro-batch ``micro`` in the step's global batch, in [0, grad_accum x
    world_size): ``micro * world_size + rank``. The data of a micro-batch are drawn from this index alone
    (``BinDataset.batch(micro_step=index, rank=0)``), so a step's global batch is the same set of windows
    at every world size with the same micro-batch size (one process: the index is ``micro``, as before),
    and a run resumed at another world size sees the data it would have seen."""
    if not 0 <= micro < grad_accum or not 0 <= rank < world_size:
        raise ValueError(f"micro={micro} / rank={rank} outside grad_accum={grad_accum} / world={world_size}")
    return micro * world_size + rank


def shard_model(model, device_type: str, world_size: int, bf16: bool, compile_options: dict | None):
    """FSDP2 (``torch.distributed.fsdp.fully_shard``) over all ranks: each transformer block, then the root
    (embeddings, final LayerNorm, the tied lm_head). In place; returns ``model`` (now an ``FSDPModule``).

    Args:
        model: a ``model.GPT`` with its weights in place (they are sharded as they are: rank r keeps
            dim-0 shard r of every parameter, as a DTensor).
        device_type: "cuda" or "cpu" (the 1-D device mesh; NCCL or gloo underneath).
        world_size: ranks of the default process group (the mesh's size).
        bf16: mixed precision ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``: the
            all-gathered parameters and the gradients are bfloat16, the reduce-scatter and the sharded
            master weights (what the optimizer updates) float32. False: float32 throughout.
        compile_options: torch.compile options (``trainer.compiling.compile_options``) to compile each
            block before it is sharded (``Block.compile``, in place, so parameter names do not change);
            None: eager. Per block, not the whole model: FSDP2's hooks run between the compiled blocks.

    Blocks reshard after forward (their parameters are gathered again in backward: memory per rank ~
    one block's full parameters at a time); the root keeps its parameters gathered after forward,
    since backward needs the lm_head first.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device_type, (world_size,))
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )
    for block in model.transformer.h:
        if compile_options is not None:
            block.compile(options=compile_options)
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    return model


def local_norm(t: torch.Tensor) -> torch.Tensor:
    """A norm from ``clip_grad_norm_`` as a plain tensor (a DTensor under FSDP2: its full value)."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def exit_together(code: int, timeout_s: float = 30.0) -> None:
    """Under torchrun, wait until every rank of this launch reaches here, then exit with ``code``.

    For config errors, which every rank finds alike (the same argv and config): without this, the first
    rank to exit makes torchrun's agent SIGTERM the others, which then end with -15 instead of ``code``.
    The ranks meet on the launch's c10d store (torchrun's agent store at MASTER_ADDR:MASTER_PORT; no
    process group needed: composition errors happen before there is one), then ignore SIGTERM for the last
    moments and exit. A rank that does not arrive within ``timeout_s`` seconds (an error only one rank
    saw) is not waited for. No-op (returns) without torchrun; otherwise never returns.
    """
    import signal
    import time

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or "RANK" not in os.environ or "MASTER_PORT" not in os.environ:
        return
    try:
        from datetime import timedelta

        from torch.distributed import TCPStore

        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        store = TCPStore(
            os.environ.get("MASTER_ADDR", "localhost"),
            int(os.environ["MASTER_PORT"]),
            world,
            is_master=not agent and int(os.environ["RANK"]) == 0,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
        key = f"flashgpt/exit/{run_id}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        store.add(key, 1)
        deadline = time.monotonic() + timeout_s
        while int(store.add(key, 0)) < world and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - no store to meet on: exit anyway
        pass
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # torchrun's SIGTERM for the ranks still exiting
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
