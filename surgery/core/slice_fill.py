"""Slices in a captured graph. Buffers filled slice by slice, made functional: `buf = x.new_empty(...)`,
then `buf[..., a:b].copy_(part)` for slices that tile one dimension, becomes `buf = cat(parts, dim)`.
And slices that keep everything (`x[:, :, None]` traces as slice(x, 0, 0, INT64_MAX), then unsqueeze)
are dropped: torch.export keeps them under dynamic-dimension hints (126 in SmolLM2's graph) and elides
them under named ranges, so without this the graph's form, and what a pattern sees, would depend on the
torch build (torch 2.11 on CUDA needs the hints; bench/RESULTS.md, twenty-first session).

Why: torch.export keeps such in-place fills as they are (MLA attention builds its key from the
per-head k_nope and the shared rope key this way), and the graph's data edges then miss them: the
attention op reads `new_empty`, whose ancestors hold neither part, so nothing after capture (site
discovery, the index probe) can follow the key back to its projections. The cat computes the same
tensor, exactly."""
from __future__ import annotations

import sys

import torch
from torch.fx import Node

aten = torch.ops.aten

EMPTY_OPS = {aten.new_empty.default, aten.empty.memory_format, aten.empty_like.default}


def shape_of(node) -> tuple | None:
    val = node.meta.get("val") if isinstance(node, Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def fill_parts(buf: Node) -> tuple[int, list[Node], list[Node]] | None:
    """(dim, the slices in order, their copy_ nodes) when every slice of `buf` is written by one
    copy_ of a tensor of its own shape and dtype, and the slices tile one dimension; else None."""
    shape = shape_of(buf)
    slices = [u for u in buf.users if u.op == "call_function" and u.target is aten.slice.Tensor]
    if shape is None or not slices:
        return None
    spans, copies = [], []
    for s in slices:
        users = list(s.users)
        if len(users) != 1 or users[0].target is not aten.copy_.default or users[0].args[0] is not s or users[0].users:
            return None
        src = users[0].args[1]
        if shape_of(src) != shape_of(s) or src.meta["val"].dtype != buf.meta["val"].dtype:
            return None
        dim, start, end, step = (list(s.args[1:]) + [0, 0, sys.maxsize, 1][len(s.args) - 1:])[:4]
        if not all(isinstance(v, int) for v in (dim, start, end, step)) or step != 1:
            return None
        spans.append((start, end, dim % len(shape), s, users[0]))
    spans.sort(key=lambda t: t[0])
    dims = {t[2] for t in spans}
    size = shape[spans[0][2]]
    if len(dims) != 1 or not isinstance(size, int):
        return None
    edge = 0
    for start, end, *_ in spans:
        if start != edge:
            return None
        edge = min(end, size)
    if edge != size:
        return None
    return spans[0][2], [t[3] for t in spans], [t[4] for t in spans]


def whole_slice(node: Node) -> bool:
    """node is slice(x, dim, 0 or None, >= 2**62 or None, 1 or None): a view of all of x."""
    if node.op != "call_function" or node.target is not aten.slice.Tensor:
        return False
    start, end, step = (list(node.args[2:]) + [None, None, None])[:3]
    start, end, step = node.kwargs.get("start", start), node.kwargs.get("end", end), node.kwargs.get("step", step)
    return start in (None, 0) and (end is None or (isinstance(end, int) and end >= 2**62)) and step in (None, 1)


def drop_whole_slices(gm: torch.fx.GraphModule) -> int:
    """Replace every whole slice by the tensor it views (exact: the same elements, and a write through
    it is a write to them); returns how many."""
    dropped = 0
    for node in list(gm.graph.nodes):
        if whole_slice(node) and isinstance(node.args[0], Node):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            dropped += 1
    if dropped:
        gm.recompile()
    return dropped


def fold_slice_fills(gm: torch.fx.GraphModule) -> int:
    """Rewrite every tiled slice fill of an uninitialised buffer as a cat; returns how many."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    folded = 0
    for buf in [n for n in gm.graph.nodes if n.op == "call_function" and n.target in EMPTY_OPS]:
        found = fill_parts(buf)
        if found is None:
            continue
        dim, slices, copies = found
        last = max(copies, key=order.__getitem__)
        readers = [u for u in buf.users if u not in slices]
        if any(order[r] < order[last] for r in readers):
            continue  # read before it is complete: not a plain fill
        with gm.graph.inserting_after(last):
            cat = gm.graph.call_function(aten.cat.default, ([c.args[1] for c in copies], dim))
        cat.meta = dict(buf.meta)
        for r in readers:
            r.replace_input_with(buf, cat)
        for c in copies:
            gm.graph.erase_node(c)
        for s in slices:
            gm.graph.erase_node(s)
        gm.graph.erase_node(buf)
        folded += 1
    if folded:
        gm.recompile()
    return folded
