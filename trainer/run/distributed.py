"""One process per GPU under torchrun (or a single process without it): NCCL on CUDA, gloo on the CPU.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous; nothing here replaces torch.distributed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def init_world(device_name: str) -> World:
    """Join the process group torchrun described (if any) and pick this rank's device."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device_name.startswith("cuda") or (device_name == "auto" and torch.cuda.is_available())
    if use_cuda:
        index = local_rank if device_name in ("auto", "cuda") else int(device_name.split(":")[1])
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    return World(rank, size, local_rank, device)


def all_reduce_sum(t: torch.Tensor, world: World) -> torch.Tensor:
    """Sum over ranks (a no-op alone); returns the tensor for chaining."""
    if world.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_gather_objects(obj: object, world: World) -> list:
    if not world.distributed:
        return [obj]
    out: list = [None] * world.size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: object, world: World) -> object:
    """Rank 0's value on every rank."""
    if not world.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def shutdown(world: World, together: bool = True) -> None:
    """Leave the process group. After a run every rank finished (`together`), the ranks first meet at a barrier, so no
    rank closes its gloo pairs (or exits) while a peer still reads its last collective from them. After a failure there
    is no barrier: the failing rank's peers may be blocked in a collective it will never join, and a barrier would hold
    it there with them; destroying the group is what ends their wait. Every group, a mesh's subgroups too, is destroyed.
    The process should then end with `process_exit.end_process`: a group outlives this while anything refers to it, and
    its threads can abort the interpreter's teardown."""
    if world.distributed and dist.is_initialized():
        if together:
            dist.barrier()
        dist.destroy_process_group()
