"""Where this process stands in a run: one process, or one of WORLD_SIZE started by torchrun."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from ..errors import DistillError
from .rendezvous import join

T = TypeVar("T")


@dataclass
class Placement:
    """This process's place in the run: rank, world, device; owns_group when distill() started it."""

    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")
    owns_group: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def main_first(self, make: Callable[[], T]) -> T:
        """make() on rank 0, then on the others: what rank 0 writes to a cache the others find."""
        if self.main:
            made = make()
        self.barrier()
        if not self.main:
            made = make()
        return made

    def shares(self, global_batch: int, micro_batch: int | None) -> tuple[int, int]:
        """(sequences this process takes a step, sequences per forward)."""
        if global_batch % self.world:
            raise DistillError(f"A global batch of {global_batch} sequences cannot be split over {self.world} processes.", "Use a --batch-size divisible by the number of processes.")
        local = global_batch // self.world
        micro = micro_batch or local
        if local % micro:
            raise DistillError(f"Each process takes {local} sequences a step, which {micro}-sequence micro-batches do not divide.", "Use a --micro-batch that divides --batch-size / processes.")
        return local, micro

    def agree(self, flag: bool) -> bool:
        """Rank 0's flag on every rank, so all processes take the same branch."""
        if self.world == 1:
            return flag
        value = torch.tensor(float(flag), device=self.device)
        dist.broadcast(value, 0)
        return bool(value.item())

    def largest(self, number: int) -> int:
        """The largest of every rank's `number` (an all-reduce), so all processes take the same branch."""
        if self.world == 1:
            return number
        value = torch.tensor(float(number), device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return int(value.item())

    def mean(self, total: torch.Tensor) -> torch.Tensor:
        """The average of `total` over processes, in place."""
        if self.world > 1:
            dist.all_reduce(total)
            total /= self.world
        return total

    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        """The module itself in one process, else under DDP (gradients averaged over processes)."""
        if self.world == 1:
            return module
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=ids, broadcast_buffers=False)


def local_device(device=None) -> torch.device:
    """The device this process computes on, made current: `device`, else CUDA when it is there, else the
    CPU; an unnumbered CUDA device is cuda:LOCAL_RANK under torchrun (the current one alone)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) if world > 1 else torch.cuda.current_device())
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev


def placement(device=None, group: bool = False) -> Placement:
    """One process, or one of WORLD_SIZE started by torchrun (or already in a process group):
    nccl on CUDA, gloo on CPU, on local_device(device).
    group: a lone process (no torchrun) gets a process group of its own (FSDP needs one)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = local_device(device)
    owns = False
    if (world > 1 or group) and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if world > 1:
            join(backend, int(os.environ.get("RANK", local)), world)  # names a rank that never starts
        else:
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
        owns = True
    if dist.is_initialized():
        return Placement(dist.get_rank(), dist.get_world_size(), dev, owns)
    return Placement(0, 1, dev, False)
