"""The recurrent state of each GatedDeltaNet placed by the replace pass, carried between decoding
calls. The layer makes its own cache (new_cache), so decoding needs nothing from the method's code."""
from __future__ import annotations

import torch
import torch.nn as nn

from .fused_linears import FusedWeight
from .row_linear import row_linear


class GDNState(nn.Module):
    """A GatedDeltaNet of the graph with the cache it carries between calls, made by the layer's own
    new_cache() (the module itself is shared with the graph, which stays stateless). With `in_place`
    (a decoder that takes static or CUDA-graph steps) its state tensors keep their memory from the
    prefill on, so a captured step reads and writes the same memory each replay; without it each
    call just keeps the new state."""

    def __init__(self, gdn: nn.Module, in_place: bool = True, state=None):
        super().__init__()
        self.gdn = gdn
        self.in_place = in_place
        self._state = (state,)  # the decoder's DecodeState (a tuple keeps it out of the module tree)
        self.projection: FusedWeight | None = None
        self.reset()

    def fuse_projection(self) -> FusedWeight:
        """A fused copy of the layer's input projections, which its static steps then use (one
        matmul instead of six; see surgery.decode.fused_linears), its rows aligned on CUDA: the layer
        slices its parts out of the output (tcal.gdn RecurrentLayer._input_projections)."""
        layers = [self.gdn.get_submodule(name) for name in self.gdn.INPUT_PROJECTIONS]
        self.projection = FusedWeight([l.weight for l in layers], [l.bias for l in layers], align_rows=True)
        return self.projection

    def reset(self) -> None:
        self.cache = self.gdn.new_cache()

    def nbytes(self) -> int:
        return self.cache.nbytes()

    def static_projection(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The fused input projection (weight, bias) while the decoder takes static steps, else None."""
        state = self._state[0]
        return self.projection.pair() if self.projection is not None and state is not None and state.static else None

    def step_cache(self):
        """The cache a call works on: this one's tensors, written in place when the decoder is."""
        work = self.gdn.new_cache()
        work.recurrent, work.conv, work.in_place = self.cache.recurrent, dict(self.cache.conv), self.in_place
        return work

    def forward(self, hidden_states):
        """The layer continued from the cache. In place, a new state is copied into the tensors that
        held the old one (when shapes agree), so their memory stays where a captured step reads it;
        a one-token step the layer takes in place (tcal.token_step) needs no copy."""
        work = self.step_cache()
        projection = self.static_projection()
        if projection is None:
            out = self.gdn(hidden_states, cache=work)
        else:  # a static step: its linears as few-row kernels where they win (surgery.decode.row_linear)
            out = self.gdn(hidden_states, cache=work, projection=projection, linear=row_linear)
        if work.recurrent is self.cache.recurrent and not work.conv:  # the layer wrote the state itself
            return out
        if self.in_place and self.cache.recurrent is not None and self.cache.recurrent.shape == work.recurrent.shape:
            self.cache.recurrent.copy_(work.recurrent)
            for name, tensor in work.conv.items():
                self.cache.conv[name].copy_(tensor)
        else:
            self.cache = work
        return out

    def load(self, recurrent, conv: dict) -> None:
        """The state a first prefill computed elsewhere (surgery.decode.prefill), copied: it may live
        in a CUDA graph's memory pool, which the next replay overwrites."""
        self.reset()
        self.cache.recurrent = recurrent.clone(memory_format=torch.contiguous_format)
        self.cache.conv = {name: t.clone(memory_format=torch.contiguous_format) for name, t in conv.items()}

    def snapshot(self) -> list:
        """Copies of the state tensors (restored by `restore` into the same tensors)."""
        return [t.clone() for t in self._tensors()]

    def restore(self, saved: list) -> None:
        for t, s in zip(self._tensors(), saved):
            t.copy_(s)

    def _tensors(self) -> list:
        return [t for t in (self.cache.recurrent, *self.cache.conv.values()) if t is not None]
