"""Phase 1 for a KDA layer: GDN's mapping (METHOD.md) with the decay set per key channel. Every
channel of head h starts at the rate that halves the memory after about d_h tokens (A_log = 0,
dt_bias = softplus^-1(ln 2 / d_h), f_proj's data-dependent part damped by a_proj_scale); the write
gate from the attention entropy, the optional value scale and the output gate exactly as for GDN."""
from __future__ import annotations

import torch

from .. import maps
from ..phase1 import Phase1Options, relative_error, scale_values, set_gate, set_write_gate
from .kda import KimiDeltaAttention


@torch.no_grad()
def calibrate_kda_layer(layer: KimiDeltaAttention, x: torch.Tensor, ctx: torch.Tensor, target: torch.Tensor,
                        stats: dict, opts: Phase1Options) -> dict:
    """Apply Phase 1 to `layer` in place. x [N,T,hidden], ctx [N,T,H,D], target [N,T,hidden]."""
    report = {"rel_error_before": relative_error(layer(x), target)}
    if opts.decay:
        a_log, dt_bias = maps.decay_from_distance(stats["distance"], opts.min_rate, opts.max_rate)
        layer.A_log.copy_(a_log)
        layer.dt_bias.copy_(dt_bias.repeat_interleave(layer.head_dim).to(layer.dt_bias))
        layer.f_proj[1].weight.mul_(opts.a_proj_scale)
        report["distance"] = stats["distance"].tolist()
        report["alpha"] = torch.exp(-torch.nn.functional.softplus(dt_bias.double())).tolist()
    if opts.write_gate:
        set_write_gate(layer, x, stats, opts, report)
    if opts.value_scale:
        scale_values(layer, x, ctx, report)
    set_gate(layer, x, ctx, opts, report)
    report["rel_error_after"] = relative_error(layer(x), target)
    return report
