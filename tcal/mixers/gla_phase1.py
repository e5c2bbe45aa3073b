"""Phase 1 for a GLA layer (the GDN mapping, METHOD.md, where GLA has the same part): the forget
gate's bias from the attention distance, so each head's memory halves after about d_h tokens (every
key channel of the head starts at the same rate; the gate's data-dependent part is damped by
a_proj_scale, as GDN's a_proj); no write gate (GLA has none); the optional value scale and the
output gate (RMS-matched amplitude by least squares, "constant" by default) exactly as for GDN."""
from __future__ import annotations

import torch

from .. import maps
from ..phase1 import Phase1Options, relative_error, scale_values, set_gate
from .gla import GatedLinearAttention


@torch.no_grad()
def calibrate_gla_layer(layer: GatedLinearAttention, x: torch.Tensor, ctx: torch.Tensor, target: torch.Tensor,
                        stats: dict, opts: Phase1Options) -> dict:
    """Apply Phase 1 to `layer` in place. x [N,T,hidden], ctx [N,T,H,D], target [N,T,hidden]."""
    report = {"rel_error_before": relative_error(layer(x), target)}
    if opts.decay:
        up = layer.gk_proj[1]
        bias = maps.gate_bias_from_distance(stats["distance"], layer.gate_logit_normalizer, opts.min_rate, opts.max_rate)
        up.bias.copy_(bias.repeat_interleave(layer.head_dim).to(up.bias))
        up.weight.mul_(opts.a_proj_scale)
        report["distance"] = stats["distance"].tolist()
        report["alpha"] = torch.exp(torch.nn.functional.logsigmoid(bias.double()) / layer.gate_logit_normalizer).tolist()
    if opts.value_scale:
        scale_values(layer, x, ctx, report)
    set_gate(layer, x, ctx, opts, report)
    report["rel_error_after"] = relative_error(layer(x), target)
    return report
