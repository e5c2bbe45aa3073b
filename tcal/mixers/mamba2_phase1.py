"""Phase 1 for a Mamba2 layer (the GDN mapping, METHOD.md, where Mamba2 has the same part): A_log = 0
and dt_bias = softplus^-1(ln 2 / d_h) from the attention distance, so at dt_proj's contribution 0 each
head's memory halves after about d_h tokens (dt_proj damped by a_proj_scale, as GDN's a_proj); the
step dt = ln 2 / d_h also weighs what is written, so the state holds a decaying average of about
d_h / ln 2 values rather than their sum. B and C stay the teacher's K and Q (copied by replace); the
skip D = 0, so the layer's output is the recurrence alone; no write gate (Mamba2 has none); the
optional value scale and the output gate (RMS-matched amplitude by least squares) exactly as GDN's."""
from __future__ import annotations

import torch

from ..phase1 import Phase1Options, relative_error, scale_values, set_decay, set_gate
from .mamba2 import Mamba2


@torch.no_grad()
def calibrate_mamba2_layer(layer: Mamba2, x: torch.Tensor, ctx: torch.Tensor, target: torch.Tensor,
                           stats: dict, opts: Phase1Options) -> dict:
    """Apply Phase 1 to `layer` in place. x [N,T,hidden], ctx [N,T,H,D], target [N,T,hidden]."""
    report = {"rel_error_before": relative_error(layer(x), target)}
    layer.D.zero_()
    if opts.decay:
        set_decay(layer, stats, opts, report)
    if opts.value_scale:
        scale_values(layer, x, ctx, report)
    set_gate(layer, x, ctx, opts, report)
    report["rel_error_after"] = relative_error(layer(x), target)
    return report
