"""Calibration data: text files -> cached token stream -> fixed windows -> what the teacher's
attention does on them (inputs, outputs, contexts, streaming statistics), read from the graph."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from tcal.stats import AttentionStats, StatsError

from .capture import placeholder_values
from .checkpoint import sha256_file
from .errors import CalibrationError
from .evaluate import read_text, tokenize
from .rewrite import nodes_by_name

BUILTIN = "built-in sample"


def builtin_sample() -> Path:
    return Path(str(resources.files("surgery") / "data" / "calibration_sample.txt"))


def cache_dir(kind: str = "tokens") -> Path:
    """Where tokenised text is cached: $SURGERY_CACHE, else $XDG_CACHE_HOME/surgery or ~/.cache/surgery."""
    root = os.environ.get("SURGERY_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"), "surgery")
    return Path(root) / kind


def tokenizer_fingerprint(tokenizer) -> str:
    """Changes whenever the ids a text gets could change: the class, the whole vocabulary, a probe.
    Keys every on-disk token cache (calibration streams here, training corpora in surgery.tokens)."""
    vocab = sorted(tokenizer.get_vocab().items()) if hasattr(tokenizer, "get_vocab") else []
    probe = tokenizer("The corpus probe, 123 \n\t end. Ünïcödé", add_special_tokens=False)["input_ids"]
    blob = json.dumps([type(tokenizer).__name__, vocab, probe, getattr(tokenizer, "eos_token_id", None)], ensure_ascii=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def token_stream(tokenizer, files: list[str] | None) -> torch.Tensor:
    """All files tokenised and concatenated (1-D), cached on disk by content and tokenizer."""
    paths = [Path(f) for f in files] if files else [builtin_sample()]
    pieces = []
    fingerprint = tokenizer_fingerprint(tokenizer)  # hashes the whole vocabulary: once, not per file
    for path in paths:
        if not path.exists():
            raise CalibrationError(f"Calibration file '{path}' does not exist.", "Check the path given to --calibration.")
        cache = cache_dir() / f"{sha256_file(path)[:24]}-{fingerprint}.pt"
        if cache.exists():
            pieces.append(torch.load(cache))
            continue
        ids = tokenize(tokenizer, read_text(path))
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".tmp{os.getpid()}")
            torch.save(ids, tmp)
            os.replace(tmp, cache)
        except OSError:
            pass  # a read-only home only costs a re-tokenisation next time
        pieces.append(ids)
    ids = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
    if ids.numel() == 0:
        raise CalibrationError("The calibration text is empty.", "Pass --calibration with a non-empty text file.")
    return ids


def window_starts(total: int, samples: int, length: int, seed: int) -> list[int]:
    """Where windows() cuts: `samples` starts spread evenly over a stream of `total` tokens, offset by the seed."""
    span = total - length
    g = torch.Generator().manual_seed(seed)
    starts = [(i * span) // max(samples, 1) for i in range(samples)]
    jitter = torch.randint(0, max(span // max(samples, 1), 1), (samples,), generator=g).tolist()
    return [min(s + j, span) for s, j in zip(starts, jitter)]


def windows(ids: torch.Tensor, samples: int, length: int, seed: int) -> torch.Tensor:
    """`samples` windows of `length` tokens spread evenly over the stream, offset by the seed."""
    if ids.numel() < length:
        raise CalibrationError(
            f"The calibration text has {ids.numel()} tokens; one window needs {length}.",
            "Give more calibration text or a shorter length (e.g. --set calibrate.length=128).",
        )
    return torch.stack([ids[s:s + length] for s in window_starts(ids.numel(), samples, length, seed)])


def held_out_windows(ids: torch.Tensor, samples: int, length: int, seed: int, avoid: list[tuple[int, int]]) -> torch.Tensor:
    """`samples` windows of `length` tokens overlapping none of the [start, end) spans in `avoid`, so
    a model fitted on those spans is scored on text it never saw. The free runs of the stream are cut
    into non-overlapping tiles and a seeded draw picks among them."""
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
    return torch.stack([ids[tiles[i]:tiles[i] + length] for i in pick])


def calibration_ids(graph, files, samples: int, length: int, seed: int) -> torch.Tensor:
    length = min(length, graph.max_length)
    return windows(token_stream(graph.tokenizer, files), samples, length, seed)


class _Taps(torch.fx.Interpreter):
    """Runs a GraphModule and hands chosen node values to callbacks as they are computed."""

    def __init__(self, gm, callbacks: dict):
        super().__init__(gm)
        self.callbacks = callbacks

    def run_node(self, n):
        value = super().run_node(n)
        for fn in self.callbacks.get(n.name, ()):
            fn(value)
        return value


def run_with_taps(gm, ids: torch.Tensor, callbacks: dict) -> None:
    with torch.no_grad():
        _Taps(gm, callbacks).run(*placeholder_values(gm, ids))


@dataclass
class LayerData:
    """What the teacher's attention at one layer saw and produced on the calibration windows."""

    x: torch.Tensor          # attention input (after the block's norm)   [N, T, hidden]
    target: torch.Tensor     # attention output (after the output proj)  [N, T, hidden]
    ctx: torch.Tensor        # per-head context before the output proj  [N, T, H, D]
    stats: dict | None = None


def collect(graph, layers: list[int], ids: torch.Tensor, *, with_stats: bool, batch_size: int = 4,
            query_chunk: int = 256) -> dict[int, LayerData]:
    """Run the TEACHER graph over ids in mini-batches and gather, per layer, inputs, targets, contexts
    and (optionally) streaming attention statistics. Statistics come from Q/K as the attention op
    receives them (after RoPE), or from the probabilities an eager layer materialises."""
    gm = graph.teacher_gm
    nodes = nodes_by_name(gm)
    store = {l: {"x": [], "target": [], "ctx": []} for l in layers}
    stats = {l: AttentionStats(graph.sites[l].num_heads) for l in layers} if with_stats else {}
    callbacks: dict = {}

    def add(name, fn):
        if name not in nodes:
            raise CalibrationError(f"The teacher graph has no node '{name}'.", "Capture the teacher again; the graph and its sites disagree.")
        callbacks.setdefault(name, []).append(fn)

    for l in layers:
        s = graph.sites[l]
        add(s.input_node, lambda v, l=l: store[l]["x"].append(v.detach()))
        add(s.output_node, lambda v, l=l: store[l]["target"].append(v.detach()))
        add(s.attn_node, lambda v, l=l: store[l]["ctx"].append(v.detach().transpose(1, 2)))
        if with_stats and s.probs_node:
            add(s.probs_node, lambda v, l=l: stats[l].update_from_probs(v.detach(), query_chunk=query_chunk))
        elif with_stats:
            seen = {}
            add(s.q_node, lambda v, seen=seen: seen.__setitem__("q", v.detach()))
            if s.mask_node:
                add(s.mask_node, lambda v, seen=seen: seen.__setitem__("mask", v.detach()))
            add(s.k_node, lambda v, seen=seen: seen.__setitem__("k", v.detach()))

            def on_attn(_, l=l, s=s, seen=seen):
                stats[l].update_from_qk(seen["q"], seen["k"], scale=s.scale, mask=seen.get("mask"), softcap=s.softcap, query_chunk=query_chunk)
                seen.clear()

            add(s.attn_node, on_attn)
    for start in range(0, ids.shape[0], batch_size):
        run_with_taps(gm, ids[start:start + batch_size].to(graph.device), callbacks)
    out = {}
    for l in layers:
        data = LayerData(*(torch.cat(store[l][k]) for k in ("x", "target", "ctx")))
        if with_stats:
            try:
                data.stats = stats[l].result()
            except StatsError as exc:
                raise CalibrationError(f"Attention statistics of layer {l} are unusable: {exc}", "Check the calibration text and the teacher's weights (NaN?).") from exc
        for name in ("x", "target", "ctx"):
            if not torch.isfinite(getattr(data, name)).all():
                raise CalibrationError(f"The teacher produced NaN/inf {name} at layer {l} on the calibration text.", "Check the teacher's weights and dtype (float16 overflow?).")
        out[l] = data
    return out
