"""The mixers a converted attention layer can become (`replace.mixer`), each declared once here: its
layer class (which names its parameters, their roles: what replace copies from the teacher, what
Phase 1 sets, what Phase 2 trains, and the decode state it carries), how it enters the graph, and
its Phase 1.

replaces  "layer": the module takes the attention block's input (the normed hidden states) and
          returns its output; the teacher's Q/K/V/O projections are copied into it (gdn, gla, kda, mamba2).
          "op": the module takes Q, K, V as the teacher's attention op receives them (after RoPE and
          any q/k norm) and returns the op's output; the projections stay the teacher's own (swa).
phase1    "layer": phase1(module, x, ctx, target, stats, options) -> report;
          "op": phase1(module, (q, k, v), ctx, stats, quantile, max_window) -> report.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..gdn import GatedDeltaNet
from ..phase1 import calibrate_layer
from . import swa
from .gla import GatedLinearAttention
from .gla_phase1 import calibrate_gla_layer
from .kda import KimiDeltaAttention
from .mamba2 import Mamba2
from .mamba2_phase1 import calibrate_mamba2_layer


@dataclass(frozen=True)
class Mixer:
    name: str
    module: type
    replaces: str
    phase1: Callable
    summary: str


MIXERS: dict[str, Mixer] = {
    "gdn": Mixer("gdn", GatedDeltaNet, "layer", calibrate_layer,
                 "Gated DeltaNet: per-head decay and write gate, delta rule (the default)"),
    "swa": Mixer("swa", swa.SlidingWindowAttention, "op", swa.phase1,
                 "sliding-window softmax attention over the last `window` tokens (a baseline)"),
    "gla": Mixer("gla", GatedLinearAttention, "layer", calibrate_gla_layer,
                 "gated linear attention: data-dependent decay per key channel, no delta rule"),
    "kda": Mixer("kda", KimiDeltaAttention, "layer", calibrate_layer,
                 "Kimi Delta Attention's recurrence: GDN with a decay per key channel"),
    "mamba2": Mixer("mamba2", Mamba2, "layer", calibrate_mamba2_layer,
                    "Mamba2's SSD: one decay per head, B/C from the teacher's K/Q, no delta rule"),
}
DEFAULT = "gdn"


def get_mixer(name: str) -> Mixer:
    """The mixer called `name`; ValueError naming the choices for any other name."""
    if name not in MIXERS:
        raise ValueError(f"unknown mixer {name!r}; choose one of {', '.join(MIXERS)}")
    return MIXERS[name]


def mixer_of(module) -> Mixer:
    """The mixer whose layer class `module` is (exactly: a subclass is not its parent's mixer)."""
    for mixer in MIXERS.values():
        if type(module) is mixer.module:
            return mixer
    raise ValueError(f"{type(module).__name__} is no registered mixer's layer ({', '.join(MIXERS)})")
