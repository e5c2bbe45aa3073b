"""Multi-head latent attention (MLA: DeepSeek-V2/V3, MiniCPM3, Kimi Linear's full-attention layers)
as the graph shows it. Q, K and V are not each one projection of the layer input: K joins a per-head
part made from a compressed latent (kv_a_proj -> norm -> kv_b_proj) and a key shared by all heads
(the rope key, straight from kv_a_proj), and Q may itself come through a down projection and a norm.

What a site keeps of that (surgery.sites.site.Projection): every projection feeding an attention
input, in graph order, and for one that reads a latent rather than the layer input, the down
projection in front of it (`via`): which of its rows feed the latent, and one scale per latent
channel. The scale is exact (1) when only shape ops lie between; with a norm between (MLA's RMSNorm:
weight * z / rms(z)) no fixed linear map is exact, and a per-channel scale fitted on the probe
tokens stands for weight / rms (channel_scale): the simplest map of the layer input that a replacing
mixer's own projections can hold (its q/k/v take the layer input, as the teacher's projections do).
It is the teacher's up to one positive factor per token (the norm's 1/rms) for a value or a query,
not for a key that joins a latent part and the rope key (their factors differ per token); calibrate
(value scale) and align start from it."""
from __future__ import annotations

import torch
from torch.fx import Node

from ..core.rewrite import ancestors
from ..errors import SiteError
from .ops import SHAPE_OPS, projections_before
from .probe import ValueRun


def through_shapes(x: Node) -> Node:
    """The node behind a chain of shape ops (a projection's input may be a view of the layer input)."""
    while x.op == "call_function" and x.target in SHAPE_OPS and x.args and isinstance(x.args[0], Node):
        x = x.args[0]
    return x


def layer_input(inputs: list[Node], layer: int) -> Node:
    """The input every Q/K/V projection derives from: the one projection input all the others
    depend on (all the same one, except in MLA, where latents sit between)."""
    candidates = list(dict.fromkeys(inputs))
    if len(candidates) == 1:
        return candidates[0]
    order = {n: k for k, n in enumerate(candidates[0].graph.nodes)}
    c = min(candidates, key=order.__getitem__)  # the common input comes first; nothing before it leads to it
    if all(i is c or c in ancestors(i, stop=lambda n: order[n] <= order[c]) for i in candidates):
        return c
    raise SiteError(f"Attention {layer}: the Q/K/V projections read no common input.",
                    "This attention layout is not supported yet; please report the architecture.")


def low_rank_via(proj_in: Node, x: Node, params: set[str], run: ValueRun, layer: int) -> dict | None:
    """None when a projection reads the layer input `x`; else its down projection (which reads x),
    the rows of it that feed each input column, and the fitted per-column scale (see the module doc)."""
    if proj_in is x or through_shapes(proj_in) is through_shapes(x):
        return None
    found = projections_before(proj_in, params, lambda n: n is x)
    if len(found) != 1 or through_shapes(next(iter(found.values()))[0]) is not through_shapes(x):
        raise SiteError(f"Attention {layer}: a Q/K/V projection reads a latent that is not one down projection of the layer input.",
                        "This attention layout is not supported yet; please report the architecture.")
    down, (_, weight, bias, transposed) = next(iter(found.items()))
    width, columns = run.shape(down)[-1], run.shape(proj_in)[-1]
    index = run.probe({down: torch.arange(width, dtype=torch.float64, device=run[down].device).expand(run.shape(down))}, proj_in)
    index = index.reshape(-1, columns)
    if not torch.equal(index, index[:1].expand_as(index)) or not torch.equal(index, index.round()):
        raise SiteError(f"Attention {layer}: the latent of '{down.name}' is not a plain selection of its rows.",
                        "This attention layout is not supported yet; please report the architecture.")
    rows = index[0].round().long()
    actual = run[proj_in].reshape(-1, columns).double()
    base = run[down].reshape(-1, width).double().index_select(1, rows.to(run[down].device))
    return dict(weight=weight, bias=bias, transposed=transposed, node=down.name, rows=rows.tolist(), scale=channel_scale(actual, base).tolist())


def channel_scale(actual: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """One factor per channel j with actual[t, j] ~ scale[j] * base[t, j] ([tokens, channels]): the
    geometric mean over tokens of the ratio, signed. A norm's ratio is weight[j] / rms[t], rank one,
    so the factors stay proportional to its weight and the folded map is the teacher's up to one
    positive factor per token; through shape ops alone every ratio is 1 and so is the scale."""
    usable = base.abs() > 1e-12 * base.abs().max().clamp_min(1e-300)
    ratio = torch.where(usable, actual / torch.where(usable, base, 1.0), 1.0)
    count = usable.sum(0).clamp_min(1)
    log_size = torch.where(usable, ratio.abs().clamp_min(1e-300).log(), 0.0).sum(0) / count
    sign = torch.where(usable, ratio.sign(), 0.0).sum(0).sign()
    return torch.where(sign == 0, 1.0, sign) * log_size.exp()
