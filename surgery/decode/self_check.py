"""The Decoder's construction-time self-check: prefill + steps against full recomputation on short random
probes (agreement.probes), refused by agreement's criteria.

Rounding or structure? When a bf16/fp16 Decoder disagrees with full recomputation past
agreement.LOW_PRECISION_REL_ERROR, the same check runs again on a float32 twin of the graph (same
weights, every traced bf16/fp16 cast made float32: precision.float32_twin), where the tight float32
criterion separates the two: a structural mistake (positions, caches, a kernel's convention) disagrees
there too, and rounding does not. Some hybrids amplify bf16 rounding past any fixed tolerance (a random
gla hybrid: 0.44 on the H200, issue 31), so a fixed tolerance alone refuses correct decoders.

The twin holds a float32 copy of the weights while the check runs (twice a bf16 model's bytes), and
only on this path: a graph that passes in its own precision never builds one."""
from __future__ import annotations

import dataclasses
import warnings
from typing import Callable

import torch

from ..errors import DecodeError
from .agreement import LOW_PRECISION_REL_ERROR, ProbeDisagreement, check_probe, probes, references
from .precision import LOW, float32_twin


def self_check(decoder, vocab: int, rebuild: Callable) -> None:
    """Refuse `decoder` (ProbeDisagreement) unless its probes agree, or in bf16/fp16 unless its float32
    twin's do (then one warning); rebuild(graph) makes a verifying Decoder of the same settings."""
    try:
        probe(decoder, vocab)
    except ProbeDisagreement as error:
        if decoder.graph.dtype not in LOW:
            raise
        warnings.warn(recheck_in_float32(decoder.graph, error, rebuild), stacklevel=3)


def probe(decoder, vocab: int) -> None:
    """Each probe's prefill + one step per token, eagerly, against full recomputation."""
    with decoder.eagerly():
        for n, first in probes(decoder.max_length, decoder.regimes.switches):
            ids = torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(0)).to(decoder.graph.device)
            decoder.reset(1, n)
            got = [decoder.prefill(ids[:, :first])] + [decoder.step(ids[:, t:t + 1]) for t in range(first, n)]
            decoder.reset()
            check_probe(torch.cat(got, dim=1), references(decoder.graph, ids, first))


def recheck_in_float32(graph, error: ProbeDisagreement, build: Callable) -> str:
    """Run `build(twin)` (a verifying Decoder of the same settings) on graph's float32 twin. Returns the
    warning to give when float32 agrees (the low-precision disagreement is rounding); raises `error`,
    with what float32 showed, when it does not. A twin that cannot be built (memory) keeps `error`."""
    try:
        twin = dataclasses.replace(graph, gm=float32_twin(graph.gm), teacher=None, cache={})
    except (RuntimeError, MemoryError) as exc:
        raise DecodeError(f"{error.problem} Checking it again in float32 was not possible ({type(exc).__name__}: {str(exc)[:120]}).",
                          error.fix) from None
    try:
        build(twin)
    except ProbeDisagreement as again:
        raise DecodeError(f"{error.problem} The same check on a float32 copy disagrees too ({again.measured}), so it is not rounding.",
                          error.fix) from None
    finally:
        del twin
    return (f"The Decoder's incremental logits differ from full recomputation's by more than low-precision rounding "
            f"usually does ({error.measured}; tolerance {LOW_PRECISION_REL_ERROR}). The same check on a float32 copy of "
            "the weights agrees, so this model amplifies rounding; it is not a decoding mistake, and decoding goes on. "
            "Load the model in float32 for logits nearer the exact ones.")
