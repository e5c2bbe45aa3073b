"""A captured graph cut into one submodule per decoder layer, so FSDP can shard it layer by layer.

A torch.export GraphModule reads every parameter through get_attr nodes at the top of one flat
graph: its `model.layers.N` modules own parameters but are never called, so FSDP's hooks on them
would never fire. split_by_layer rebuilds the graph as a root that calls "pre" (embeddings, RoPE
tables, masks), one unit per decoder layer and "post" (final norm, LM head) in turn. The layers
come from the graph: each site's decoder block is the parent of its module path, and a node belongs
to the latest block whose parameters it (or anything it depends on) reads. Every unit reads its
parameters itself (get_attr at the same qualified names as in the graph: `layer_3.model.layers.3.
mlp.up_proj.weight`), and the root keeps the graph's calling convention (input names, output type).
"""
from __future__ import annotations

import copy
import operator

import torch
from torch import fx

from ..core.rewrite import graph_module
from ..errors import DistillError

PRE, POST = "pre", "post"


def block_prefixes(sites) -> list[tuple[str, int]]:
    """(decoder block prefix with a trailing dot, unit number 1..L) per site, longest prefix first."""
    blocks = []
    for number, site in enumerate(sorted(sites, key=lambda s: s.layer), start=1):
        parent = site.module_path.rpartition(".")[0] or site.module_path
        if parent:
            blocks.append((parent + ".", number))
    return sorted(blocks, key=lambda b: -len(b[0]))


def block_of(target: str, blocks: list[tuple[str, int]]) -> int | None:
    for prefix, number in blocks:
        if target.startswith(prefix) or target + "." == prefix:
            return number
    return None


def assign_units(gm: fx.GraphModule, blocks: list[tuple[str, int]]) -> dict[fx.Node, int]:
    """Unit number of every computing node: the largest of its inputs' units and of the block whose
    parameters it reads; a node that reads a parameter outside every block after the last block has
    begun (final norm, LM head) opens "post". Edges only go to equal or later units, so the units
    run in order."""
    last = max((n for _, n in blocks), default=0)
    unit: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        number = max((unit.get(a, 0) for a in node.all_input_nodes), default=0)
        reads = [a.target for a in node.all_input_nodes if a.op == "get_attr"] + ([node.target] if node.op == "call_module" else [])
        for target in reads:
            block = block_of(target, blocks)
            number = max(number, block if block is not None else (last + 1 if number >= last > 0 else number))
        unit[node] = number
    return unit


def unit_name(number: int, last: int, layers: list[int]) -> str:
    return PRE if number == 0 else POST if number > last else f"layer_{layers[number - 1]}"


def build_unit(gm: fx.GraphModule, nodes: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]) -> fx.GraphModule:
    """A GraphModule computing `nodes` from `inputs` (placeholders) and returning `outputs` as a
    tuple; the attributes it reads are gm's own objects (shared, not copied)."""
    graph, env = fx.Graph(), {}
    for value in inputs:
        env[value] = graph.placeholder(value.name)
    for node in nodes:
        for a in node.all_input_nodes:
            if a.op == "get_attr" and a not in env:
                env[a] = graph.get_attr(a.target)
        env[node] = graph.node_copy(node, lambda x: env[x])
    graph.output(tuple(env[o] for o in outputs))
    return graph_module(gm, graph)


def split_by_layer(gm: fx.GraphModule, sites) -> fx.GraphModule:
    """gm (a captured graph with these attention sites) as a root calling pre, layer_<l> (one per
    site) and post; same inputs, same outputs, the same arithmetic in the same order. Parameters
    and submodules are gm's own objects (deep-copy gm first to keep them apart)."""
    blocks = block_prefixes(sites)
    if not blocks:
        raise DistillError("The graph's attention sites name no decoder blocks (no module paths), so it cannot be split by layer.",
                           "Recapture the model (surgery capture keeps module paths), or train without --fsdp.")
    unit = assign_units(gm, blocks)
    last, layers = max(n for _, n in blocks), sorted(s.layer for s in sites)
    members: dict[int, list[fx.Node]] = {}
    for node, number in unit.items():
        members.setdefault(number, []).append(node)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    if any(a.op == "get_attr" for a in out_node.all_input_nodes):
        raise DistillError("The graph returns a parameter directly; it cannot be split by layer.", "Train without --fsdp.")
    root, env = fx.Graph(), {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = root.node_copy(node)
    holder = torch.nn.Module()
    for number in sorted(members):
        nodes = members[number]
        inside = set(nodes)
        inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside and a.op != "get_attr"))
        outputs = [n for n in nodes if any(u not in inside for u in n.users)]
        name = unit_name(number, last, layers)
        holder.add_module(name, build_unit(gm, nodes, inputs, outputs))
        call = root.call_module(name, tuple(env[a] for a in inputs))
        for i, value in enumerate(outputs):
            env[value] = root.call_function(operator.getitem, (call, i))
    root.output(fx.map_arg(out_node.args[0], lambda x: env[x]))
    root.set_codegen(copy.deepcopy(gm.graph._codegen))  # the graph's calling convention (kwargs in, ModelOutput out)
    split = graph_module(holder, root)
    split.meta = dict(getattr(gm, "meta", {}))
    return split


def unit_names(split: fx.GraphModule) -> dict[str, str]:
    """Parameter name in the split module -> its name in the graph (the unit prefix dropped), every
    alias of a tied parameter included (the graph may know it by another of its names)."""
    return {name: name.partition(".")[2] for name, _ in split.named_parameters(remove_duplicate=False)}
