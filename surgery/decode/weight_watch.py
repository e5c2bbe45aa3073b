"""Whether a graph's weights were edited, moved or cast since the last look: one pass over them a call.

A replayed CUDA graph reads what it read at capture, and the fast route also reads copies derived from the
weights (the fused sibling projections, surgery.decode.fused_linears; a GDN layer's concatenated input
projections, tcal.gdn.fused_weight), so a call must notice a parameter edited in place (its version counter)
or moved or cast (its storage). The fast route used to look twice (the replays' check and every fused copy's own
key): one look took a replayed 2k x 1 call's host work from 120.7 to 68.2 us for SmolLM2's 75% hybrid on the CPU
machine, against about 3.5 ms for the call on the H200 (bench/RESULTS.md, thirty-eighth session).
An edit through `p.data` (a fresh version counter) or a parameter replaced by another object is not seen."""
from __future__ import annotations

from typing import Callable, Iterable

import torch


class WeightWatch:
    """`changed()`: True on the first look and whenever a watched tensor's version or storage moved since
    the previous look. The tensors are listed once, on the first look."""

    def __init__(self, tensors: Callable[[], Iterable[torch.Tensor]]):
        self.tensors = tensors
        self.watched: list[torch.Tensor] | None = None
        self.versions: list[int] | None = None
        self.pointers: list[int] | None = None

    def changed(self) -> bool:
        if self.watched is None:
            self.watched = list(self.tensors())
        versions = [t._version for t in self.watched]
        pointers = [t.data_ptr() for t in self.watched]
        if versions == self.versions and pointers == self.pointers:
            return False
        self.versions, self.pointers = versions, pointers
        return True
