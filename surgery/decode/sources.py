"""Where a KV cache reads from: the narrowest tensor behind an attention's K (or V) that still holds
every head it reads, so the cache is as wide as the model's KV heads (repeat_kv undone)."""
from __future__ import annotations

import torch
from torch.fx import Node

from ..core.slice_fill import whole_slice
from .caches import CachePrep

aten = torch.ops.aten

# Ops that move K/V between the projection and the attention op without changing values: walking
# back through them from the attention's K finds the tensor before repeat_kv.
LAYOUT_OPS = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
    aten.unsqueeze.default, aten.transpose.int, aten.permute.default, aten.clone.default,
    aten.contiguous.default, aten.alias.default, aten.repeat_interleave.self_int, aten.repeat.default,
    aten.flatten.using_ints, aten.unflatten.int, aten.squeeze.dim,
}


def heads_view(val, length: int, dim: int):
    """A [B, n, L, dim] or [B, n, dim, L] tensor as ([B, n, L, dim], transposed?), else None."""
    if not isinstance(val, torch.Tensor) or val.dim() != 4:
        return None
    if tuple(val.shape[2:]) == (length, dim):
        return val, False
    if tuple(val.shape[2:]) == (dim, length):
        return val.transpose(-1, -2), True
    return None


def narrowest(node: Node, per_head: list, env: dict, length: int, dim: int):
    """Walking back through layout ops from `node`: the narrowest tensor holding every query head's
    values, as (node, transposed?, head_map, width), else None."""
    heads = len(per_head)
    best, cur = None, node
    while isinstance(cur, Node):
        view = heads_view(env.get(cur), length, dim)
        if view is not None:
            t, transposed = view
            found = [next((j for j in range(t.shape[1]) if torch.equal(per_head[h], t[:, j])), None) for h in range(heads)]
            if None not in found and (best is None or t.shape[1] < best[3]):
                best = (cur, transposed, found, t.shape[1])
        if cur.op == "call_function" and (cur.target in LAYOUT_OPS or whole_slice(cur)) and isinstance(cur.args[0], Node):
            cur = cur.args[0]
        else:
            break
    return best


def cache_source(node: Node, heads: int, env: dict, length: int, dim: int, kv_map: list):
    """The tensor behind an attention input (K or V) that the cache holds. Returns (node, CachePrep,
    head_map), or None; the map says which cached head each query head reads (None: the grouped
    layout of SDPA's enable_gqa). `env` holds every node's value on the probe."""
    start = heads_view(env.get(node), length, dim)
    if start is None:
        return None
    t0 = start[0]
    per_head = [t0[:, h * t0.shape[1] // heads] for h in range(heads)]  # SDPA enable_gqa / broadcast semantics
    best = narrowest(node, per_head, env, length, dim)
    if best is None:
        return None
    src, transposed, head_map, width = best
    select = None
    used = sorted(set(head_map))
    # heads that are copies of one KV head (a repeat the walk could not undo): keep one of each,
    # when the site's own head->KV map (read from the projection rows) agrees that they are copies
    firsts = {}
    for h, j in enumerate(head_map):
        firsts.setdefault(kv_map[h], j)
    if len(firsts) < len(used) and all(torch.equal(per_head[h], per_head[kv_map.index(kv_map[h])]) for h in range(heads)):
        select = tuple(firsts[u] for u in sorted(firsts))
        head_map = [sorted(firsts).index(kv_map[h]) for h in range(heads)]
        width = len(select)
    elif len(used) < width:
        select = tuple(used)
        head_map = [used.index(j) for j in head_map]
        width = len(used)
    if list(head_map) == [h * width // heads for h in range(heads)]:
        head_map = None  # the grouped layout: SDPA's enable_gqa, no copies
    return src, CachePrep(transposed, select), head_map
