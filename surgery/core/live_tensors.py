"""Bytes of tensor memory alive, and their peak, counted on any device (the CPU has no allocator
statistics torch exposes): every tensor an op creates while the counter is active, plus the tensors
handed to track() (weights read from files). Storages are counted once however many views share them.
The layer-streamed conversion's memory claim is measured with it (tests, bench/speed.py)."""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensors(TorchDispatchMode):
    """with LiveTensors() as live: ...; live.peak is the most bytes alive at once, live.now those left."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, list[int]] = {}  # storage address -> [bytes, tensors alive on it]
        self.now = 0
        self.peak = 0

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return tensor
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key == 0:
            return tensor
        entry = self.storages.get(key)
        if entry is None:
            entry = self.storages[key] = [storage.nbytes(), 0]
            self.now += entry[0]
            self.peak = max(self.peak, self.now)
        entry[1] += 1
        weakref.finalize(tensor, self.release, key)
        return tensor

    def release(self, key: int) -> None:
        entry = self.storages.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self.storages[key]
            self.now -= entry[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            self.track(leaf)
        return out
