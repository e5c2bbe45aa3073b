"""The index probe: every node's value on a small input, then projection-row indices pushed along
the paths from a projection to the attention op (see surgery.sites.finder)."""
from __future__ import annotations

import torch
from torch.fx import Node
from torch.fx.node import map_arg

from ..core.rewrite import ancestors, descendants
from ..core.run import attribute, interpret, placeholder_values
from ..core.streamed import file_backed, run_streamed, weight_readers
from ..errors import SiteError
from .ops import SHAPE_OPS


PROBE_LENGTH = 7  # odd and prime: never a head_dim, so K^T [.., D, T] is told from K [.., T, D]


class ValueRun:
    """Every node's value for one small input: gives concrete shapes and the non-probed operands."""

    def __init__(self, gm: torch.fx.GraphModule, vocab: int, graph=None):
        """graph: the Graph gm belongs to, when its weights may be offloaded (read from files as needed;
        a file-backed parameter's node then holds its meta tensor: shape and dtype, no values)."""
        ids = torch.randint(0, vocab, (1, PROBE_LENGTH), generator=torch.Generator().manual_seed(0))
        weights = graph.weights if graph is not None else None
        with torch.no_grad():
            if weights is None:
                self.env: dict[Node, object] = interpret(gm, placeholder_values(gm, ids.to(next(gm.parameters()).device)))
                return
            self.env = {n: attribute(gm, n.target) for n in file_backed(gm, weights)}
            run_streamed(gm, weights, [ids], weight_readers(gm, weights), device=graph.device, dtype=graph.dtype,
                         on_value=self.env.__setitem__)
            self.env.update(zip([n for n in gm.graph.nodes if n.op == "placeholder"], placeholder_values(gm, ids.to(graph.device))))

    def __getitem__(self, n):
        return self.env[n]

    def shape(self, n) -> tuple:
        v = self.env[n]
        return tuple(v.shape) if isinstance(v, torch.Tensor) else ()

    def probe(self, src: Node | dict, dst: Node, value: torch.Tensor | None = None) -> torch.Tensor:
        """Push `value` (standing for src's output) along every path src -> dst, moving indices through
        shape ops and passing the main operand through value-changing ops. src may be a dict
        {node: value} of several sources at once (MLA's key joins two projections)."""
        sources = src if isinstance(src, dict) else {src: value}
        reach = set().union(*(descendants(s) for s in sources))
        between = reach & (ancestors(dst) | {dst})
        probed = dict(sources)
        for n in dst.graph.nodes:
            if n not in between or n in sources:
                continue
            if n.op == "call_function" and n.target in SHAPE_OPS:
                if not any(a in probed for a in n.all_input_nodes):
                    continue  # a side branch (a norm's statistics, say) that no index reaches
                args = map_arg(n.args, lambda a: probed.get(a, self.env.get(a)))
                kwargs = map_arg(n.kwargs, lambda a: probed.get(a, self.env.get(a)))
                probed[n] = n.target(*args, **kwargs)
                continue
            main = [a for a in n.all_input_nodes if a in probed and self.shape(a) == self.shape(n)]
            if main:
                probed[n] = probed[main[0]]
            elif n is dst:
                raise SiteError(
                    f"Cannot follow projection rows through node '{n.name}' ({n.target}): none of its inputs has its shape.",
                    "This attention layout is not supported yet; please report the architecture.",
                )
            # else: a reduction on a side branch (RMSNorm's mean): its value never carries rows
        return probed[dst]


def index_heads(p: torch.Tensor, what: str) -> torch.Tensor:
    """[B, H, T, D] probe result -> [H, D] integer indices, checking it is a pure gather."""
    idx = p[0, :, 0, :]
    if not torch.equal(p, idx[None, :, None, :].expand_as(p)) or not torch.equal(idx, idx.round()):
        raise SiteError(f"The {what} rows are not a plain selection of projection outputs.", "This attention layout is not supported yet.")
    return idx.round().long()
