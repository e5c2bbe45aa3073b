"""What-if variants of a captured teacher, for scoring layers: one attention layer removed (its output
zeroed, so the block's residual carries its input on unchanged), or chosen layers swapped for given
modules. Each variant is a Graph branch with its own forked GraphModule over the shared teacher
weights, so a variant costs a graph copy, not a model copy."""
from __future__ import annotations

import math
from typing import Callable

import torch

from ..core import progress
from ..core.graph import Graph
from ..core.rewrite import fork, nodes_by_name, prune, splice_module
from .perplexity import score_windows


class ZeroOutput(torch.nn.Module):
    """Stands in for a removed attention block: zeros as wide as the block's output."""

    def __init__(self, width: int):
        super().__init__()
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(*x.shape[:-1], self.width)


def variant(graph: Graph, modules: dict[int, tuple[str, torch.nn.Module]]) -> Graph:
    """A branch of the teacher in which each layer l of `modules` = {l: (target, module)} has its
    attention region (input node .. output node) replaced by a call to `module`, registered at `target`."""
    teacher = graph.teacher_gm
    gm = fork(teacher)
    nodes = nodes_by_name(gm)
    for layer, (target, module) in modules.items():
        site = graph.sites[layer]
        splice_module(gm, target, module, [nodes[site.input_node]], nodes[site.output_node])
    prune(gm)
    gm.recompile()
    out = graph.branch()
    out.gm, out.teacher = gm, teacher
    return out


def without_attention(graph: Graph, layer: int) -> Graph:
    """The teacher with layer `layer`'s attention output set to zero (attention removal)."""
    site = graph.sites[layer]
    return variant(graph, {layer: (f"{site.module_path}_removed", ZeroOutput(site.hidden_size))})


def window_perplexity(graph: Graph, windows: torch.Tensor, batch_size: int = 4) -> float:
    """Perplexity over every predicted token of the windows [N, T] as given (each scored on its own;
    a BOS they carry is kept)."""
    ppl = score_windows(graph, windows, batch_size=batch_size, label=None)["perplexity"]  # the caller reports its layers
    return ppl if math.isfinite(ppl) else math.inf


def removal_scores(graph: Graph, measure: Callable[[Graph], float], name: str = "perplexity") -> tuple[float, list[dict]]:
    """measure(teacher) and, per layer, measure of the teacher with that layer's attention removed:
    (baseline, [{"layer", name, "increase"}]). select's ar measures perplexity (window_perplexity),
    its retrieval policy the passkey answer's NLL (surgery.eval.passkey.answer_nll)."""
    baseline = measure(graph.branch())
    rows = []
    with progress.task(f"select: attention removal ({name})", graph.num_layers, "layers") as bar:
        for layer in range(graph.num_layers):
            value = measure(without_attention(graph, layer))
            rows.append({"layer": layer, name: value, "increase": value - baseline})
            bar.advance()
    return baseline, rows


def keep_one_scores(graph: Graph, modules: dict[int, tuple[str, torch.nn.Module]], windows: torch.Tensor,
                    batch_size: int = 4) -> list[dict]:
    """Per layer l, the perplexity of the hybrid that keeps only l as attention and swaps every other
    layer for its module in `modules` (which must cover every layer)."""
    rows = []
    with progress.task("select: keep-one probes", graph.num_layers, "layers") as bar:
        for layer in range(graph.num_layers):
            probe = variant(graph, {l: m for l, m in modules.items() if l != layer})
            rows.append({"layer": layer, "perplexity": window_perplexity(probe, windows, batch_size)})
            bar.advance()
    return rows
