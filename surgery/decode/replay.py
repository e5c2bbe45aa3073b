"""CUDA-graph replay of an eager forward: the same kernels, launched as one graph.

Eagerly a captured graph is bound by the host at short lengths: on the H200 the 75% GDN hybrid
(SmolLM2-135M shapes) took 82.9 ms at 2k tokens, batch 1, and 7.08 ms replayed, with bit-identical
logits (bench/RESULTS.md, sixteenth session); capturing took 0.08 s, not the 25-30 s of a compile.
A replay serves one input shape: the input is copied into the graph's static buffer and the outputs
live in the graph's memory until its next replay (a caller copies what it keeps).

Under autocast (a distillation's evaluations on CUDA) a capture runs with autocast's weight-cast cache
off (uncached_autocast): with it on, the graph reads the cache's bf16 copies of float32 weights, which
autocast frees when its context exits and which never see an optimizer's update. The twenty-second
session's H200 distillations logged every evaluation after the first as NaN through this (RESULTS.md).
A graph captured under one autocast setting is never replayed under another (the slot holds it).

Weights that change between calls (a distillation's optimizer steps between its evaluations, a user's
edit) drop every captured graph, which is captured again: a graph reads what it read at capture, and
some of that is derived from the weights and kept outside them (a GDN layer's concatenated input
projections, tcal.gdn.fused_weight), so it would stay stale, or be freed once an eager call rebuilds it.
The caller watches them (the fast route: surgery.decode.weight_watch, once a call, which also refreshes its
fused copies) and calls drop() when they changed."""
from __future__ import annotations

import contextlib
from collections import OrderedDict

import torch


WARMUP = 1  # eager runs on a side stream before a capture (lazy initialisations must not be captured)
# Inputs of more tokens (batch x length) run eagerly. Up to here replay was measured to pay (8k x 1: 60.7 ms
# eager against 19.6 replayed; 32k x 1: 90.3 against 86.9), while a kept graph holds its activations, the
# [B, T, V] logits included (3.2 GB at 32k for SmolLM2's vocabulary), so past it the gain cannot be worth it.
REPLAY_MAX_TOKENS = 32768


def autocast_setting(device_type: str):
    """The caller's autocast on `device_type` as a captured graph bakes it in: its dtype, or None (off)."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


@contextlib.contextmanager
def uncached_autocast(device_type: str):
    """The caller's autocast with its weight-cast cache off (nothing changes when autocast is off): a
    capture inside it records each cast as a kernel that reads the weight itself."""
    dtype = autocast_setting(device_type)
    if dtype is None:
        yield
        return
    with torch.autocast(device_type, dtype=dtype, cache_enabled=False):
        yield


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
        slot = self.slot(ids, key)
        if slot in self.graphs or slot in self.seen:
            return True
        self.seen.add(slot)
        return False

    def run(self, forward, ids: torch.Tensor, key):
        """(forward(ids)'s output through the shape's graph, the eager warm-up's output when the graph
        was captured by this call, else None): the caller checks a new graph against its warm-up."""
        slot = self.slot(ids, key)
        warm = None
        if slot not in self.graphs:
            static = ids.clone()
            with uncached_autocast(ids.device.type):
                graph, out, warm = self.capture(lambda: forward(static))
            self.graphs[slot] = (graph, static, out)
            while len(self.graphs) > self.keep:
                self.graphs.popitem(last=False)
        self.graphs.move_to_end(slot)
        graph, static, out = self.graphs[slot]
        static.copy_(ids)
        graph.replay()
        return out, warm

    def drop(self) -> None:
        """Forget every captured graph (each shape is captured again on its next call)."""
        self.graphs.clear()

    @staticmethod
    def slot(ids: torch.Tensor, key) -> tuple:
        """What one captured graph serves: an input shape, the caller's key, the autocast it was captured under."""
        return tuple(ids.shape), key, autocast_setting(ids.device.type)

    capture = staticmethod(capture)  # a test puts a stand-in here (the CPU has no CUDA graphs)

    def give_up(self, reason: str) -> None:
        self.failed = reason
        self.graphs.clear()
