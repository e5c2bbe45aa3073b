"""What each attention layer's KV cache costs at a given length, read from the graph: a layer whose
mask is a sliding window keeps at most `window` positions, a global (full causal) layer keeps all
of them. select's `window` option uses the layer kinds; its record reports the bytes.

The window is the one the decoder reads (surgery.decode.plan): the graph's own mask evaluated from
the input length alone, at min(max_length, 8192) tokens. A window longer than that is not seen, and
the layer counts as global (as the decoder treats it up to that length)."""
from __future__ import annotations

import torch

from surgery.core.graph import Graph
from surgery.core.rewrite import nodes_by_name
from surgery.decode.lengths import Lengths
from surgery.decode.masks import MASK_PROBE, MaskReader
from surgery.decode.plan import plan_attention

GLOBAL, WINDOW = "global", "window"
KV_LENGTH = 32768   # the length at which select reports the cache each selection keeps


def layer_windows(graph: Graph, mask_probe: int = MASK_PROBE) -> list[int | None]:
    """Per layer, the sliding window its mask shows (None: full causal attention, or a layer whose
    attention is no longer in the graph: a loaded hybrid's converted layer). Read once per teacher
    (the masks are the teacher's; branches share the cache)."""
    key = ("layer_windows", mask_probe)
    if key not in graph.cache:
        gm = graph.teacher_gm
        masks, nodes = MaskReader(gm, Lengths(gm)), nodes_by_name(gm)
        with torch.no_grad():
            graph.cache[key] = [plan_attention(site, nodes, masks, graph.max_length, mask_probe, graph.device).window
                                if site.attn_node in nodes else None for site in graph.sites]
    return list(graph.cache[key])


def layer_kinds(windows: list[int | None]) -> list[str]:
    """"window" for a layer with a sliding window, else "global"."""
    return [GLOBAL if w is None else WINDOW for w in windows]


def kv_cache_bytes(site, window: int | None, length: int, element_bytes: int, batch: int = 1, heads: int | None = None) -> int:
    """Bytes of one kept attention layer's cache after `length` tokens, as the decoder holds it: K and
    V for every KV head (or `heads` of them) over min(window, length) positions, plus a window layer's
    ring positions (int64)."""
    positions = length if window is None else min(window, length)
    ring = 0 if window is None else positions * 8
    return 2 * batch * (site.num_kv_heads if heads is None else heads) * site.head_dim * positions * element_bytes + ring


def kv_report(graph: Graph, convert: list[int], length: int = KV_LENGTH, kept_heads: dict | None = None) -> dict:
    """The KV cache a selection keeps at `length` tokens (batch 1, the graph's dtype): bytes per kept
    layer (0: converted; a converted layer that keeps some KV heads, `kept_heads` {layer: heads}: those
    heads' share) and in all, against the teacher's. GDN layers' fixed-size state is not counted here."""
    windows = layer_windows(graph)
    size = torch.empty((), dtype=graph.dtype).element_size()
    per_layer = [kv_cache_bytes(s, w, length, size) for s, w in zip(graph.sites, windows)]
    split = kept_heads or {}
    kept = [(kv_cache_bytes(graph.sites[layer], windows[layer], length, size, heads=len(split[layer])) if layer in split else 0)
            if layer in set(convert) else b for layer, b in enumerate(per_layer)]
    return {"length": length, "windows": windows, "kv_bytes": sum(kept), "teacher_kv_bytes": sum(per_layer), "kv_bytes_per_layer": kept}
