"""Low-level graph surgery shared by the passes: fork a GraphModule, splice a module call in place of
a region, prune what no longer reaches the output."""
from __future__ import annotations

import copy

import torch
from torch.fx import GraphModule, Node


# Queries of a tensor's shape: they depend on the input's length, never on its values.
SHAPE_QUERIES = {
    torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default, torch.ops.aten.sym_stride.int,
    torch.ops.aten.sym_storage_offset.default,
}


def token_dependent(gm: GraphModule, ids: Node) -> set:
    """Nodes whose result depends on the token values (or on anything computed from them); shape
    queries of the input do not, so positions and masks built from its length stay out."""
    value = {ids}
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr") or (n.op == "call_function" and n.target in SHAPE_QUERIES):
            continue
        if n.op == "output" or any(a in value for a in n.all_input_nodes):
            value.add(n)
    return value


def computed_buffers(module: torch.nn.Module) -> set[str]:
    """Names of the buffers module keeps out of its state_dict (non-persistent: computed from the config,
    as a rotary embedding's inv_freq)."""
    saved = set(module.state_dict(keep_vars=True))
    return {name for name, _ in module.named_buffers(remove_duplicate=False) if name not in saved}


def graph_module(root: torch.nn.Module, graph: torch.fx.Graph) -> GraphModule:
    """GraphModule(root, graph) in which the buffers root keeps out of its state_dict (non-persistent: a
    rotary embedding's inv_freq, computed from the config) stay out, as torch >= 2.14 copies them. torch
    2.11-2.13 registered every copied buffer as persistent, so inv_freq entered the checkpoints written
    there and no others, and a hybrid saved under one of the two did not load under the other."""
    made = GraphModule(root, graph)
    for path, module in root.named_modules():
        if not module._non_persistent_buffers_set:
            continue
        try:
            owner = made.get_submodule(path)
        except AttributeError:  # nothing of it is read by the graph, so nothing was copied
            continue
        owner._non_persistent_buffers_set.update(f for f in module._non_persistent_buffers_set if f in owner._buffers)
    return made


def fork(gm: GraphModule) -> GraphModule:
    """A new GraphModule with a copy of gm's graph that shares gm's parameter tensors.

    The teacher stays runnable (calibration reads it) without doubling the weights in memory."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    forked = graph_module(gm, graph)
    forked.meta = dict(getattr(gm, "meta", {}))
    return forked


def rewrite_matches(gm: GraphModule, match, rewrite, in_place: bool = False) -> tuple[GraphModule, int]:
    """A fork of `gm` (gm itself with in_place) in which rewrite(graph, node, found) ran for every node
    where match(node) found something (not None), then dead code removed; and how many. `gm` itself
    (and 0) when nothing matches. The pattern rewrites of the fast route (surgery.decode.fusions) use it."""
    if not any(match(n) is not None for n in gm.graph.nodes):
        return gm, 0
    forked = gm if in_place else fork(gm)
    count = 0
    for node in list(forked.graph.nodes):  # a node a rewrite erased no longer matches anything
        found = match(node)
        if found is not None:
            rewrite(forked.graph, node, found)
            count += 1
    forked.graph.eliminate_dead_code()
    forked.recompile()
    return forked, count


def call_in_place_of(node: Node, target, args: tuple) -> Node:
    """Call target(*args) right before `node`, route node's uses to it (with node's metadata) and erase node."""
    with node.graph.inserting_before(node):
        call = node.graph.call_function(target, args)
    call.meta = dict(node.meta)
    node.replace_all_uses_with(call)
    node.graph.erase_node(node)
    return call


def nodes_by_name(gm: GraphModule) -> dict[str, Node]:
    return {n.name: n for n in gm.graph.nodes}


def splice_module(gm: GraphModule, target: str, module: torch.nn.Module, inputs: list[Node], replaces: Node) -> Node:
    """Register `module` at `target`, call it on `inputs` right before `replaces`, and route every
    use of `replaces` to the call. The old region is left for prune() to remove."""
    set_submodule(gm, target, module)
    with gm.graph.inserting_before(replaces):
        call = gm.graph.call_module(target, tuple(inputs))
    parents = {k: v for k, v in (replaces.meta.get("nn_module_stack") or {}).items() if target.startswith(v[0] + ".")}
    call.meta["nn_module_stack"] = {**parents, target: (target, f"{type(module).__module__}.{type(module).__qualname__}")}
    if "val" in replaces.meta:
        call.meta["val"] = replaces.meta["val"]
    replaces.replace_all_uses_with(call)
    return call


def prune(gm: GraphModule) -> int:
    """Remove nodes that no longer reach the output; keep side-effecting checks on live values.

    torch.fx's eliminate_dead_code keeps every impure node (export's shape asserts) and with it the
    dead region those asserts look at, so it cannot be used here."""
    nodes = list(gm.graph.nodes)
    needed: set[Node] = set()
    for n in reversed(nodes):
        if n.op in ("output", "placeholder") or n in needed:
            needed.add(n)
            needed.update(n.all_input_nodes)
    removed = 0
    for n in reversed(nodes):
        if n in needed:
            continue
        if n.is_impure() and all(i in needed for i in n.all_input_nodes) and n.all_input_nodes:
            continue
        gm.graph.erase_node(n)
        removed += 1
    drop_unused_attributes(gm)
    return removed


def drop_unused_attributes(gm: GraphModule) -> None:
    """Delete parameters/buffers/submodules that no node references any more.

    A submodule no node references goes whole (its reference in gm, not its tensors): a module a call
    targets is shared with every fork of the graph (fork(), a Decoder's prefill graph), which may still
    run it, so stripping its buffers here broke them (a sliding-window layer lost its window)."""
    used = {n.target for n in gm.graph.nodes if n.op in ("get_attr", "call_module")}

    def referenced(name: str) -> bool:
        return any(u == name or u.startswith(name + ".") or name.startswith(u + ".") for u in used)

    tensors = list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False))
    live = {id(t) for name, t in tensors if referenced(name)}  # a tied weight keeps every name it has
    for name, module in sorted(gm.named_modules(remove_duplicate=False), key=lambda kv: kv[0].count(".")):
        if not name or referenced(name) or any(id(t) in live for t in (*module.parameters(), *module.buffers())):
            continue
        drop(gm, name)
    for name, t in tensors:
        if not referenced(name) and id(t) not in live:
            drop(gm, name)


def drop(gm: GraphModule, name: str) -> None:
    """delattr along a dotted path; nothing when the path is gone already (an ancestor went first)."""
    parent, _, leaf = name.rpartition(".")
    try:
        owner = gm.get_submodule(parent) if parent else gm
    except AttributeError:
        return
    if hasattr(owner, leaf):
        delattr(owner, leaf)


def set_submodule(gm: GraphModule, target: str, module: torch.nn.Module) -> None:
    """setattr along a dotted path, creating empty containers on the way."""
    owner = gm
    parts = target.split(".")
    for part in parts[:-1]:
        if not hasattr(owner, part):
            owner.add_module(part, torch.nn.Module())
        owner = getattr(owner, part)
    if hasattr(owner, parts[-1]):
        delattr(owner, parts[-1])
    owner.add_module(parts[-1], module)


def ancestors(node: Node, stop=lambda n: False) -> set[Node]:
    """Every node `node` depends on; the walk does not go past nodes for which stop() is true."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        for i in n.all_input_nodes:
            if i not in seen:
                seen.add(i)
                if not stop(i):
                    todo.append(i)
    return seen


def descendants(node: Node) -> set[Node]:
    """Every node that depends on `node`."""
    seen, todo = set(), [node]
    while todo:
        for u in todo.pop().users:
            if u not in seen:
                seen.add(u)
                todo.append(u)
    return seen


