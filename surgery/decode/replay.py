"""CUDA-graph replay of an eager forward: the same kernels, launched as one graph.

Eagerly a captured graph is bound by the host at short lengths: on the H200 the 75% GDN hybrid
(SmolLM2-135M shapes) took 82.9 ms at 2k tokens, batch 1, and 7.08 ms replayed, with bit-identical
logits (bench/RESULTS.md, sixteenth session); capturing took 0.08 s, not the 25-30 s of a compile.
A replay serves one input shape: the input is copied into the graph's static buffer and the outputs
live in the graph's memory until its next replay (a caller copies what it keeps)."""
from __future__ import annotations

from collections import OrderedDict

import torch

WARMUP = 1  # eager runs on a side stream before a capture (lazy initialisations must not be captured)
# Inputs of more tokens (batch x length) run eagerly. Up to here replay was measured to pay (8k x 1: 60.7 ms
# eager against 19.6 replayed; 32k x 1: 90.3 against 86.9), while a kept graph holds its activations, the
# [B, T, V] logits included (3.2 GB at 32k for SmolLM2's vocabulary), so past it the gain cannot be worth it.
REPLAY_MAX_TOKENS = 32768


def capture(run, warmup: int = WARMUP):
    """(torch.cuda.CUDAGraph, run()'s output inside it, the last warm-up's output): run() is called
    `warmup` times on a side stream, then captured. Raises whatever capturing raises."""
    current = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(current)
    warm = None
    try:
        with torch.cuda.stream(side):
            for _ in range(warmup):
                warm = run()
    finally:
        current.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    return graph, out, warm


class Replays:
    """Captured graphs of `forward(input_ids=...)` by input shape, the `keep` most recently used, for
    inputs of at most REPLAY_MAX_TOKENS tokens.

    A shape is captured on its second call (the first runs eagerly: a shape seen once, such as a
    passkey prompt, never pays for a capture). `failed` holds the one-line reason replay was turned
    off for good (a capture that raised)."""

    def __init__(self, keep: int = 2, devices: tuple[str, ...] = ("cuda",)):
        self.keep, self.devices = keep, devices
        self.seen: set = set()
        self.graphs: OrderedDict = OrderedDict()  # (shape, key) -> (graph, static ids, output)
        self.failed: str | None = None

    def ready(self, ids: torch.Tensor, key) -> bool:
        """Whether this call replays (or captures): a CUDA input whose shape was seen before."""
        if self.failed is not None or ids.device.type not in self.devices or ids.numel() > REPLAY_MAX_TOKENS:
            return False
        slot = (tuple(ids.shape), key)
        if slot in self.graphs or slot in self.seen:
            return True
        self.seen.add(slot)
        return False

    def run(self, forward, ids: torch.Tensor, key):
        """(forward(ids)'s output through the shape's graph, the eager warm-up's output when the graph
        was captured by this call, else None): the caller checks a new graph against its warm-up."""
        slot = (tuple(ids.shape), key)
        warm = None
        if slot not in self.graphs:
            static = ids.clone()
            graph, out, warm = self.capture(lambda: forward(static))
            self.graphs[slot] = (graph, static, out)
            while len(self.graphs) > self.keep:
                self.graphs.popitem(last=False)
        self.graphs.move_to_end(slot)
        graph, static, out = self.graphs[slot]
        static.copy_(ids)
        graph.replay()
        return out, warm

    capture = staticmethod(capture)  # a test puts a stand-in here (the CPU has no CUDA graphs)

    def give_up(self, reason: str) -> None:
        self.failed = reason
        self.graphs.clear()
