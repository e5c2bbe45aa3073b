"""Running a captured GraphModule: its logits for token ids, and the one interpreter that hands
node values to whoever needs them (site discovery, teacher statistics, decode analysis)."""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.fx import Node
from torch.fx.node import map_arg

from ..errors import CaptureError


def placeholder_values(gm: torch.fx.GraphModule, input_ids: torch.Tensor) -> list:
    """Positional inputs of the graph's placeholders: the ids, then the extra inputs capture fixed."""
    return [input_ids, *gm.meta.get("extra_inputs", {}).values()]


def graph_logits(module, input_ids: torch.Tensor, extra_inputs: dict | None = None) -> torch.Tensor:
    """Logits of a captured forward: a GraphModule (its own extra inputs) or a wrapper of one such
    as DDP (pass the graph's extra inputs), whatever output structure the model returns."""
    extra = extra_inputs if extra_inputs is not None else module.meta.get("extra_inputs", {})
    out = module(input_ids=input_ids, **extra)
    return out.logits if hasattr(out, "logits") else out[0]


def run_graph(graph, input_ids: torch.Tensor, module=None) -> torch.Tensor:
    """Logits of a Graph (through `module`, e.g. its compiled form, when given), with a clear error
    for inputs the graph cannot take."""
    if input_ids.dim() != 2:
        raise CaptureError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}.", "Add a batch dimension.")
    length = input_ids.shape[1]
    if length < 1 or length > graph.max_length:
        raise CaptureError(
            f"A sequence of {length} tokens does not fit this graph, which takes 1 to {graph.max_length} tokens.",
            "Split the input into chunks of at most that length (surgery eval does this).",
        )
    return graph_logits(graph.gm if module is None else module, input_ids)


def attribute(gm: torch.nn.Module, target: str):
    """The tensor or module a get_attr node names."""
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def interpret(gm: torch.fx.GraphModule, inputs: list | None = None, *, given: dict | None = None,
              only: Iterable[Node] | None = None, on_value: Callable[[Node, object], None] | None = None,
              keep: Callable[[Node], bool] = lambda n: True) -> dict:
    """Run the graph node by node and return {node: value} for the nodes `keep` accepts.

    inputs    positional values of the placeholders (placeholder_values); without them a placeholder
              takes its value from `given`, else from the graph's fixed extra inputs (None for the ids)
    given     values that replace nodes (they are not computed, nor is anything only they need)
    only      compute just these nodes (the caller passes a set closed under inputs)
    on_value  called with every computed node and its value, in execution order
    A value no later node reads and `keep` rejects is dropped as soon as it is used up, so a pass
    over a long input holds only what is live (torch.fx.Interpreter's garbage collection)."""
    given = dict(given or {})
    nodes = [n for n in gm.graph.nodes if only is None or n in only or n in given]
    chosen = set(nodes)
    last_use: dict[Node, Node] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            last_use[a] = n
    env: dict = {}
    extra = gm.meta.get("extra_inputs", {})
    position = 0
    out = {}
    for n in nodes:
        if n in given:
            value = given[n]
        elif n.op == "placeholder":
            value = inputs[position] if inputs is not None else extra.get(n.target)
            position += 1
        elif n.op == "get_attr":
            value = attribute(gm, n.target)
        elif n.op == "output":
            value = map_arg(n.args[0], lambda a: env[a])
        else:
            args = map_arg(n.args, lambda a: env[a])
            kwargs = map_arg(n.kwargs, lambda a: env[a])
            if n.op == "call_function":
                value = n.target(*args, **kwargs)
            elif n.op == "call_module":
                value = gm.get_submodule(n.target)(*args, **kwargs)
            else:
                value = getattr(args[0], n.target)(*args[1:], **kwargs)
        env[n] = value
        if on_value is not None and n not in given:
            on_value(n, value)
        if keep(n):
            out[n] = value
        for a in n.all_input_nodes:
            if last_use.get(a) is n and a in chosen:
                env.pop(a, None)
    return out
