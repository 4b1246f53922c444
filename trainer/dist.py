"""torch.distributed for the trainer: joining torchrun's process group, rank-0 broadcasts, FSDP2 sharding
(``parallel=fsdp``), the data index of a micro-batch, and the common exit of every rank on a config error."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as tdist


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
    """Join torchrun's process group (NCCL on CUDA, gloo on CPU) when ``WORLD_SIZE`` > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or "RANK" not in os.environ:
        return DistInfo()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    tdist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    return DistInfo(True, tdist.get_rank(), local_rank, tdist.get_world_size())


def broadcast_obj(obj):
    """``obj`` of rank 0 on every rank (a process group must exist)."""
    box = [obj]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


def global_micro_index(micro: int, grad_accum: int, rank: int, world_size: int) -> int:
    """Index of rank ``rank``'s micro-batch ``micro`` in the step's global batch."""
    if not 0 <= micro < grad_accum or not 0 <= rank < world_size:
        raise ValueError(f"micro={micro} / rank={rank} outside grad_accum={grad_accum} / world={world_size}")
    return micro * world_size + rank


def shard_model(model, device_type: str, world_size: int, bf16: bool, compile_options: dict | None):
    """FSDP2 ``fully_shard`` over all ranks: each transformer block, then the root (embeddings, lm_head)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device_type, (world_size,))
    mp = MixedPrecisionPolicy(
        **({"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if bf16 else {})
    )
    for block in model.transformer.h:
        if compile_options is not None:
            block.compile(options=compile_options)
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)


def local_norm(t: torch.Tensor) -> torch.Tensor:
    """A norm from ``clip_grad_norm_`` as a plain tensor (a DTensor under FSDP2: its full value)."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def _launch_world() -> int:
    """WORLD_SIZE of a torchrun launch of several ranks (with a store address); 0 otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return world if world > 1 and "RANK" in os.environ and "MASTER_PORT" in os.environ else 0


def _launch_store(timeout_s: float):
    """A client of torchrun's agent store at MASTER_ADDR:MASTER_PORT, or None outside torchrun or without the
    agent store (a store of our own at that port would take the one ``init_process_group`` opens there)."""
    world = _launch_world()
    if not world or os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    return tdist.TCPStore(
        os.environ.get("MASTER_ADDR", "localhost"),
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def _launch_key(name: str) -> str:
    env = os.environ.get
    return f"flashgpt/{name}/{env('TORCHELASTIC_RUN_ID', '')}/{env('TORCHELASTIC_RESTART_COUNT', '0')}"


# rank0_verdict calls in this process (the jobs of a -m sweep run in the same order on every rank)
_VERDICTS = [0]


def rank0_verdict(problem: str | None, timeout_s: float = 300.0) -> str | None:
    """Rank 0's ``problem`` (None: none) on every rank, before any process group exists: rank 0 publishes it
    on the launch's store, the other ranks wait for it (at most ``timeout_s``; then None)."""
    _VERDICTS[0] += 1
    try:
        store = _launch_store(timeout_s)
    except Exception:  # noqa: BLE001 - no store: every rank decides alone, as before
        return problem
    if store is None:
        return problem
    key, gone = _launch_key(f"verdict{_VERDICTS[0]}"), _launch_key("exit")
    try:
        if int(os.environ["RANK"]) == 0:
            store.set(key, "" if problem is None else "!" + problem)
            return problem
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if store.check([key]):
                value = store.get(key).decode("utf-8", "replace")
                return value[1:] if value else None
            if int(store.add(gone, 0)) > 0:  # a rank is already exiting on a config error of its own
                return "another rank stopped on a config error (rank 0 printed it)"
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - no word from rank 0: go on (init_process_group decides)
        return None
    return None


def exit_together(code: int, timeout_s: float = 30.0) -> None:
    """Under torchrun, wait until every rank of this launch reaches here, then exit with ``code``."""
    world = _launch_world()
    if not world:
        return
    # From here on torchrun's SIGTERM (sent once the first rank has exited) is ignored: every rank ignores
    # it before it is counted, so none exits before all do.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with contextlib.suppress(Exception):  # no store to meet on: exit anyway
        if (store := _launch_store(timeout_s)) is not None:
            store.add(key := _launch_key("exit"), 1)
            deadline = time.monotonic() + timeout_s
            while int(store.add(key, 0)) < world and time.monotonic() < deadline:
                time.sleep(0.05)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
