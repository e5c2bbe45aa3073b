"""Decode steps with every shape fixed, replayed as one CUDA graph.

A decode step of a small model launches many tiny kernels; issued from Python (the FX
graph, or transformers' generate) the step is bound by the host, whatever the context length (the
measured times per step are in bench/RESULTS.md, "Numbers formerly in decode comments"). With the
KV buffers at full capacity, the new token's slot and position given by a device tensor
(DecodeState.index) and the GDN states updated in place, a step launches the same kernels on the
same memory at every offset, so it is captured once per reset (batch, capacity) and then replayed:
one launch per token.

With compile on, the static step is torch.compile'd and the compiled step is what is captured.
The capture runs two warm-up steps first (compiling kernels, filling the fused-weight caches); they
write the KV slot of the current offset, which the real step rewrites with the same values, and
advance the GDN states, which are restored afterwards."""
from __future__ import annotations

import warnings

import torch

from ..core.run import graph_logits
from .replay import capture, uncached_autocast

WARMUP = 2


class StaticStep:
    """One-token steps of a Decoder through the static path, as a CUDA graph when `cuda_graph`."""

    def __init__(self, decoder, cuda_graph: bool, runner=None):
        self.decoder = decoder
        self.cuda_graph = cuda_graph
        self.runner = runner  # the step graph as the step runs it (a CompiledGraph), None: dec.step_gm
        self.release()

    def release(self) -> None:
        """Drop the captured graph (a reset reallocates the buffers it reads)."""
        self.graph = self.ids = self.logits = None

    def ready(self, ids: torch.Tensor) -> bool:
        """Static steps need a capacity from reset, a prefill that allocated the buffers at that
        capacity, and one token per row of the batch the buffers hold."""
        dec = self.decoder
        if dec.capacity is None or dec.state.offset == 0 or dec.state.offset >= dec.capacity:
            return False
        if dec.regimes.crosses(dec.state.offset, 1) or not dec.regimes.same(dec.capacity, dec.state.offset + 1):
            return False  # its tables, built at capacity, are not this length's (surgery.decode.regimes)
        if ids.shape[1] != 1 or (dec.batch_size is not None and ids.shape[0] != dec.batch_size):
            return False
        if self.graph is not None:  # captured on these buffers, which keep their memory until reset
            return ids.shape[0] == self.ids.shape[0]
        if any(m.cache.recurrent is None for m in dec.gdn.values()):
            return False
        return all(m.static_ready(dec.capacity) for m in dec.attention.values())

    def _run(self, ids: torch.Tensor) -> torch.Tensor:
        dec = self.decoder
        dec.state.static_length = dec.capacity
        try:
            return graph_logits(dec.step_gm if self.runner is None else self.runner, ids)
        finally:
            dec.state.static_length = None

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, 1, V] of one new token per row; advances the decoder's offset."""
        dec = self.decoder
        state = dec.state
        if state.index is None or state.index.device != ids.device:
            state.index = torch.zeros(1, dtype=torch.long, device=ids.device)
        state.index.fill_(state.offset)
        with torch.no_grad():
            if self.cuda_graph and self.graph is None:
                self._capture(ids)
            if self.graph is None:
                logits = self._run(ids)
            else:
                self.ids.copy_(ids)
                self.graph.replay()
                logits = self.logits.clone()
        state.offset += 1
        return logits

    def _capture(self, ids: torch.Tensor) -> None:
        dec = self.decoder
        saved = {key: m.snapshot() for key, m in dec.gdn.items()}
        self.ids = ids.clone()
        try:
            with uncached_autocast(ids.device.type):  # a cached cast would be freed, and stale, after autocast exits
                self.graph, self.logits, _ = capture(lambda: self._run(self.ids), warmup=WARMUP)
        except Exception as exc:  # a kernel that cannot be captured: the same static steps, eagerly
            self.release()
            self.cuda_graph = False
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            warnings.warn(f"Capturing the decode step as a CUDA graph failed ({first}); decoding without it.", stacklevel=3)
        finally:
            for key, m in dec.gdn.items():
                m.restore(saved[key])
