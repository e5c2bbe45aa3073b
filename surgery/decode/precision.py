"""Is the compiled graph as near the float32 answer as the eager one? (issue 29: compile stays off for a
use where it is not.) Both low-precision runs of a graph, eager and compiled on the fast route, are
compared with a float32 run of the same weights.

The float32 run needs more than parameters cast up: export traces the model's own casts to the
dtype it was captured in (RMSNorm's `.to(input_dtype)`), so a bf16 graph moved to float32 still
rounds to bf16 there (bench/RESULTS.md, "Agreement bisect"). float32_twin rewrites those casts too."""
from __future__ import annotations

import copy
import sys

import torch
from torch.fx import GraphModule

from .fast import FastGraph, first_output

LOW = (torch.bfloat16, torch.float16)


def float32_twin(gm: GraphModule) -> GraphModule:
    """A copy of `gm` (its own float32 parameters) in which every bf16/fp16 dtype the graph names is
    float32: the same function computed in float32."""
    twin = copy.deepcopy(gm).float()
    swap = lambda a: torch.float32 if a in LOW else a  # noqa: E731
    for n in twin.graph.nodes:
        n.args = torch.fx.node.map_aggregate(n.args, swap)
        n.kwargs = torch.fx.node.map_aggregate(n.kwargs, swap)
    twin.recompile()
    twin.meta = dict(getattr(gm, "meta", {}))
    return twin


def gaps(got: torch.Tensor, reference: torch.Tensor) -> dict:
    """Per-position relative logit error (||got - ref|| / ||ref||): its max and mean; top-1 agreement."""
    g, r = got.float(), reference.float()
    rel = (g - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-6)
    return {"max_rel": rel.max().item(), "mean_rel": rel.mean().item(),
            "top1": (g.argmax(-1) == r.argmax(-1)).float().mean().item()}


@torch.no_grad()
def float32_gaps(graph, ids: torch.Tensor, reference=None, report=sys.stderr) -> dict:
    """`graph` (bf16 or fp16) on ids [B, T], eagerly and compiled (the fast route's graphs), and on the
    default route's eager graph (with its fusions, where the device's route has them), each against float32: `reference` (a float32 Graph of the same weights, e.g. captured again in float32),
    else float32_twin of graph.gm. "compiled_no_farther": the compiled run's mean and max gaps are at
    most the eager run's (the condition for compiling by default; surgery.core.compiled.ROUTES)."""
    ids = ids.to(graph.device)
    fast = FastGraph(graph.gm, graph.device, "eval", True, limit=graph.max_length, label="graph (precision check)", report=report)
    compiled = first_output(fast(ids)).clone()
    if fast.failed is not None:
        raise RuntimeError(f"The graph did not compile ({fast.failed}).")
    eager = first_output(fast.eager(ids))
    default = first_output(FastGraph(graph.gm, graph.device, "eval", None, limit=graph.max_length, label="graph (precision check)",
                                     report=report).eager(ids)).clone()
    if reference is not None:
        exact = reference.logits(ids.to(reference.device)).to(graph.device)
    else:
        twin = float32_twin(graph.gm)
        exact = first_output(twin(input_ids=ids, **twin.meta.get("extra_inputs", {})))
        del twin
    out = {"eager": gaps(eager, exact), "compiled": gaps(compiled, exact), "compiled_vs_eager": gaps(compiled, eager),
           "default": gaps(default, exact)}
    out["compiled_no_farther"] = all(out["compiled"][k] <= out["eager"][k] for k in ("max_rel", "mean_rel"))
    return out
