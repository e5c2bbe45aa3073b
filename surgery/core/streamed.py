"""Run a graph whose parameters stay in the teacher's files (surgery.core.meta_capture) a segment at a
time: a segment's parameters are read onto the compute device once, every mini-batch goes through
the segment, and only the values a later segment reads (the residual stream, positions, the mask)
are kept per mini-batch. Peak device memory is one segment's weights plus those activations, never
the model; the callbacks see each node's value per mini-batch, in the same order as a plain run
within a segment."""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.fx import Node

from .run import interpret, placeholder_values


def segments(nodes: list[Node], cuts: Iterable[Node]) -> list[list[Node]]:
    """`nodes` (in execution order) split after each node of `cuts`; no empty segment."""
    cut = set(cuts)
    parts, current = [], []
    for n in nodes:
        current.append(n)
        if n in cut:
            parts.append(current)
            current = []
    return [p for p in parts + [current] if p]


def file_backed(gm: torch.fx.GraphModule, weights) -> set[Node]:
    """The get_attr nodes whose tensor the files hold (parameters; computed buffers are not)."""
    return {n for n in gm.graph.nodes if n.op == "get_attr" and n.target in weights}


def run_streamed(gm: torch.fx.GraphModule, weights, ids_batches: list[torch.Tensor], cuts: Iterable[Node], *,
                 device, dtype: torch.dtype, on_value: Callable[[Node, object], None] | None = None,
                 on_batch: Callable[[int], None] | None = None, only: set[Node] | None = None,
                 load: Callable[[str], torch.Tensor] | None = None) -> list[dict]:
    """Run gm on each mini-batch of ids, segment by segment (segments(…, cuts)).

    weights    WeightFiles (or anything with `in` and load(name, device, dtype))
    on_batch   called with the mini-batch index before that mini-batch runs through a segment
    only       run just these nodes (closed under inputs), e.g. what some taps need
    Returns per mini-batch the values that outlive the last segment (the output, when it is run)."""
    nodes = [n for n in gm.graph.nodes if (only is None or n in only) and n.op != "placeholder"]
    files = file_backed(gm, weights)
    parts = segments([n for n in nodes if n not in files], cuts)
    last_reader: dict[Node, int] = {}
    for k, part in enumerate(parts):
        for n in part:
            for a in n.all_input_nodes:
                last_reader[a] = k
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    envs = [dict(zip(holders, placeholder_values(gm, ids.to(device)))) for ids in ids_batches]
    def outlives(n: Node, k: int) -> bool:  # a later segment reads it, or it is the graph's output
        return last_reader.get(n, -1) > k or n.op == "output"

    read = load or (lambda name: weights.load(name, device, dtype))
    with torch.no_grad():
        for k, part in enumerate(parts):
            inside = set(part)
            needed = {a for n in part for a in n.all_input_nodes if a not in inside}
            loaded = {a: read(a.target) for a in needed & files}
            for b, env in enumerate(envs):
                if on_batch is not None:
                    on_batch(b)
                env.update(interpret(gm, given={a: env[a] for a in needed - files} | loaded, only=inside, on_value=on_value,
                                     keep=lambda n, k=k: outlives(n, k)))
                for a in [a for a in env if not outlives(a, k)]:
                    del env[a]
            del loaded
    return envs


def weight_readers(gm: torch.fx.GraphModule, weights) -> list[Node]:
    """The nodes that read a file-backed tensor: cut after each and no segment holds more than one
    node's weights (for a single input, where reading a weight twice is never needed)."""
    files = file_backed(gm, weights)
    return [n for n in gm.graph.nodes if any(a in files for a in n.all_input_nodes)]


def streamed_logits(graph, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits of an offloaded graph (graph.weights set) for one batch of ids, weights read as needed."""
    gm, weights = graph.gm, graph.weights
    offload = graph.meta["offload"]
    (env,) = run_streamed(gm, weights, [input_ids], weight_readers(gm, weights), device=offload["device"],
                          dtype=getattr(torch, offload["dtype"]))
    out = env[next(n for n in gm.graph.nodes if n.op == "output")]
    return out.logits if hasattr(out, "logits") else out[0]
