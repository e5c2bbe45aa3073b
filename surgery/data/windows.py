"""Windows of token ids cut from a text stream: evenly spread (calibration, layer scoring) or held
out from given spans (scoring a fit on text it never saw). With a lead token (the tokenizer's BOS,
surgery.core.bos) a window of `length` tokens is that token + length-1 text tokens."""
from __future__ import annotations

import torch

from ..errors import CalibrationError
from ..core.bos import lead_windows, leading_token, text_length
from .cache import token_stream


def window_starts(total: int, samples: int, length: int, seed: int) -> list[int]:
    """Where windows() cuts: `samples` starts spread evenly over a stream of `total` tokens, offset by the seed."""
    span = total - length
    g = torch.Generator().manual_seed(seed)
    starts = [(i * span) // max(samples, 1) for i in range(samples)]
    jitter = torch.randint(0, max(span // max(samples, 1), 1), (samples,), generator=g).tolist()
    return [min(s + j, span) for s, j in zip(starts, jitter)]


def window_spans(total: int, samples: int, length: int, seed: int, lead: int | None = None) -> list[tuple[int, int]]:
    """The [start, end) spans of the stream that windows() reads for these arguments."""
    span = text_length(length, lead)
    return [(s, s + span) for s in window_starts(total, samples, span, seed)]


def windows(ids: torch.Tensor, samples: int, length: int, seed: int, lead: int | None = None) -> torch.Tensor:
    """`samples` windows of `length` tokens spread evenly over the stream, offset by the seed."""
    span = text_length(length, lead)
    if ids.numel() < span:
        raise CalibrationError(
            f"The calibration text has {ids.numel()} tokens; one window needs {span}.",
            "Give more calibration text or a shorter length (e.g. --set calibrate.length=128).",
        )
    return lead_windows(torch.stack([ids[a:b] for a, b in window_spans(ids.numel(), samples, length, seed, lead)]), lead)


def held_out_windows(ids: torch.Tensor, samples: int, length: int, seed: int, avoid: list[tuple[int, int]],
                     lead: int | None = None) -> torch.Tensor:
    """`samples` windows of `length` tokens overlapping none of the [start, end) spans in `avoid`, so
    a model fitted on those spans is scored on text it never saw. The free runs of the stream are cut
    into non-overlapping tiles and a seeded draw picks among them."""
    length = text_length(length, lead)
    free = torch.ones(ids.numel(), dtype=torch.bool)
    for start, end in avoid:
        free[start:end] = False
    edges = torch.diff(torch.cat([torch.zeros(1, dtype=torch.int8), free.to(torch.int8), torch.zeros(1, dtype=torch.int8)]))
    runs = zip((edges == 1).nonzero().flatten().tolist(), (edges == -1).nonzero().flatten().tolist())
    tiles = [s for a, b in runs for s in range(a, b - length + 1, length)]
    if len(tiles) < samples:
        raise CalibrationError(
            f"The calibration text has {ids.numel()} tokens; outside the {len(avoid)} window(s) the init is fitted on "
            f"it holds {len(tiles)} held-out window(s) of {length} tokens, and {samples} are needed.",
            "Give more calibration text (--calibration), or fewer or shorter scoring windows (e.g. --set select.samples=4, select.length=128).",
        )
    pick = sorted(torch.randperm(len(tiles), generator=torch.Generator().manual_seed(seed))[:samples].tolist())
    return lead_windows(torch.stack([ids[tiles[i]:tiles[i] + length] for i in pick]), lead)


def calibration_ids(graph, files, samples: int, length: int, seed: int) -> torch.Tensor:
    """The calibration windows [samples, length] (length capped at the graph's), BOS-led when the tokenizer adds one."""
    length = min(length, graph.max_length)
    return windows(token_stream(graph.tokenizer, files), samples, length, seed, leading_token(graph.tokenizer))
