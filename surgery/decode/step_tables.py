"""A static step's length-only tables, computed once per capacity instead of at every step.

Positions are continued by evaluating what the graph computes from the input's length alone at
cache+new length and slicing the new token's row (surgery.decode.positions). A static step's length
is the capacity, so every step rebuilt the RoPE tables (or a learned position table's lookup) for all
C positions to keep one row: at C = 64k, some ten kernels over 64k x head-width float32 tensors a step.
Those tables depend only on the capacity and the step's shape values, never on the tokens or the
offset, so `hoist_tables` moves the chains that end in a slice into one StepTables module that keeps
their values; the step then only slices them (the index_select at the offset)."""
from __future__ import annotations

import operator

import torch
import torch.nn as nn
from torch.fx import GraphModule, Node

from ..core.rewrite import SHAPE_QUERIES, ancestors, graph_module, set_submodule
from ..core.run import attribute

TARGET = "_step_tables"


class StepTables(nn.Module):
    """The length-only tables of a step graph (`sub`, over the shape values it reads), kept: computed
    again only when the capacity, those values or a tensor it reads (by its version) change, then
    written into the kept tensors, where a captured CUDA graph reads them. Outside static steps
    (state.static false) it computes them at every call."""

    def __init__(self, sub: GraphModule, state):
        super().__init__()
        self.sub = sub
        self._state = (state,)
        self.reads = [n.target for n in sub.graph.nodes if n.op == "get_attr"]
        self.key = self.values = None

    def forward(self, *sizes):
        state = self._state[0]
        if not state.static:
            return tuple(self.sub(*sizes))
        read = (attribute(self.sub, t) for t in self.reads)
        key = (state.static_length, sizes, tuple((id(t), getattr(t, "_version", 0)) for t in read))
        if key != self.key:
            fresh = tuple(self.sub(*sizes))
            if self.values is not None and all(same_layout(a, b) for a, b in zip(self.values, fresh)):
                for kept, new in zip(self.values, fresh):
                    kept.copy_(new)
            else:
                self.values = fresh
            self.key = key
        return self.values


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and a.stride() == b.stride()


def outside(n: Node) -> bool:
    """Where a table's chain starts: the graph's inputs and the shape queries of them."""
    return n.op == "placeholder" or (n.op == "call_function" and n.target in SHAPE_QUERIES)


def chain_of(x: Node, state_target: str) -> set | None:
    """The nodes that compute table `x` from shape values alone, or None if x reads an input's
    values, a slice of another table, a module other than the length query or an impure op."""
    nodes = {n for n in ancestors(x, stop=outside) if not outside(n)} | {x}
    for n in nodes:
        if n.op == "get_attr" or (n.op == "call_function" and not n.is_impure()):
            if not any(a.op == "placeholder" for a in n.all_input_nodes):
                continue
        elif n.op == "call_module" and n.target == state_target and not n.kwargs and len(n.args) == 1:
            if not any(a.op == "placeholder" for a in n.all_input_nodes):
                continue
        return None
    return nodes


def computed_as(n, memo: dict):
    """A hashable form of what node n computes from the chain's starts (placeholders, shape queries and
    attributes stand for themselves): two nodes with the same form hold the same values."""
    if isinstance(n, Node):
        if n not in memo:
            if outside(n) or n.op in ("placeholder", "get_attr"):
                memo[n] = ("node", n)
            else:
                memo[n] = (n.op, str(n.target), computed_as(n.args, memo), computed_as(n.kwargs, memo))
        return memo[n]
    if isinstance(n, (list, tuple)):
        return (type(n).__name__, *(computed_as(a, memo) for a in n))
    if isinstance(n, dict):
        return ("dict", *((k, computed_as(v, memo)) for k, v in sorted(n.items())))
    return (type(n).__name__, repr(n))


def merge_same_slices(gm: GraphModule, slices: list, chains: list) -> tuple[list, list]:
    """Each layer slices its own copy of the same table (an unsqueeze of the shared cos/sin per layer):
    slices of tables computed the same way become one, so a step selects each table's row once."""
    memo, first, kept = {}, {}, []
    for s, chain in zip(slices, chains):
        key = (computed_as(s.args[0], memo), computed_as(s.kwargs, memo))
        if key in first:
            s.replace_all_uses_with(first[key])
            gm.graph.erase_node(s)
        else:
            first[key] = s
            kept.append((s, chain))
    return [s for s, _ in kept], [c for _, c in kept]


def hoist_tables(gm: GraphModule, state_target: str = "_decode") -> int:
    """Move every length-only table that a slice of `state_target` (DecodeState(x, dim)) reads into
    one StepTables call (TARGET) in gm, in place, slices of equal tables merged; how many tables."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    slices, chains = [], []
    for n in gm.graph.nodes:
        if n.op == "call_module" and n.target == state_target and "dim" in n.kwargs and isinstance(n.args[0], Node):
            chain = chain_of(n.args[0], state_target)
            if chain is not None and isinstance(n.args[0].meta.get("val"), torch.Tensor):
                slices.append(n)
                chains.append(chain)
    if not slices:
        return 0
    slices, chains = merge_same_slices(gm, slices, chains)
    chain = set().union(*chains)
    sizes = sorted({a for n in chain for a in n.all_input_nodes if outside(a)}, key=order.get)
    first = min(slices, key=order.get)
    if any(order[s] > order[first] for s in sizes):
        return 0
    graph = torch.fx.Graph()
    env = {s: graph.placeholder(s.name) for s in sizes}
    for n in sorted(chain, key=order.get):
        env[n] = graph.node_copy(n, lambda a: env[a])
    tables = [s.args[0] for s in slices]
    graph.output(tuple(env[t] for t in tables))
    set_submodule(gm, TARGET, StepTables(graph_module(gm, graph), gm.get_submodule(state_target)))
    with gm.graph.inserting_before(first):
        call = gm.graph.call_module(TARGET, tuple(sizes))
        for i, (s, t) in enumerate(zip(slices, tables)):
            got = gm.graph.call_function(operator.getitem, (call, i))
            got.meta = dict(t.meta)
            s.args = (got,) + tuple(s.args[1:])
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return len(slices)
