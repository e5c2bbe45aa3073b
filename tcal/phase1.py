"""Phase 1 of Taylor-Calibrate for one GDN layer: set decay, write gate, value scale and output gate
from the teacher's attention statistics and activations (METHOD.md, Phase 1).

The output gate is where we depart from the reference. Its gate g_proj = 0.01 * ratio * v_proj makes
silu(gate) ~ 0, so the layer starts as good as removed and Phase 1 alone equals zero-gate. Because
o_norm RMS-normalises each head, amplitude can only come back through the gate: we solve, per head,
for the gate pre-activation that makes RMSNorm(core) * silu(gate) match the teacher's context in
least squares ("constant": one amplitude per head; "tokenwise": one per token and head), and fit
g_proj to it by ridge regression on the layer input. That amplitude survives o_norm.

Defaults are measured (bench/RESULTS.md): "constant" generalises to held-out text, "tokenwise"
overfits 1,024 calibration tokens and Phase 2 starting from it ends worse; the per-head value scale
is off because o_norm cancels it exactly for a linear value path and through SiLU it only distorts
the values (Phase 2 from it ends worse too).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import maps
from .gate_forms import gate_preactivation, low_rank, write_gate_rows
from .gdn import GatedDeltaNet

GATES = ("reference", "zero", "constant", "tokenwise", "keep")
CONCENTRATION = ("minmax", "normalized")


@dataclass
class Phase1Options:
    """decay                  set each head's decay from the teacher's attention distance
    write_gate             set the write gate (b_proj) from the attention's concentration
    value_scale            scale the values per head (off: o_norm cancels it, measured worse)
    gate                   output gate: constant (one amplitude per head), tokenwise, reference, zero or keep
    concentration          how concentration is measured: minmax or normalized
    beta_low               lowest write-gate target (for the least concentrated head)
    beta_span              write-gate targets span [beta_low, beta_low + beta_span]
    a_proj_scale           a_proj's initial weights scaled by this (the decay varies little with the token)
    b_proj_scale           b_proj's initial weights scaled by this around the target's mean logit
    min_rate, max_rate     clamp of the decay rates derived from the attention distance
    gate_ridge             ridge strength of the output gate's fit to the layer input
    gate_floor             smallest gate amplitude fitted (silu's inverse needs a positive value)
    reference_gate_factor  gate: reference's factor (the reference's 0.01)
    window_quantile        swa: each layer's window keeps this share of its heads' attention mass"""

    decay: bool = True
    write_gate: bool = True
    value_scale: bool = False
    gate: str = "constant"
    concentration: str = "minmax"
    beta_low: float = 0.3
    beta_span: float = 0.4
    a_proj_scale: float = 0.1
    b_proj_scale: float = 0.1
    min_rate: float = 1e-3
    max_rate: float = 5.0
    gate_ridge: float = 1e-2
    gate_floor: float = 1e-2
    reference_gate_factor: float = 0.01
    window_quantile: float = 0.9  # swa: the window keeps this share of each head's attention mass


def ridge_rows(x: torch.Tensor, targets: torch.Tensor, ridge: float) -> torch.Tensor:
    """W [H, in] minimising ||targets - x W^T||^2 + lam ||W||^2, lam = ridge * mean diag(x^T x)."""
    x = x.reshape(-1, x.shape[-1]).double()
    t = targets.reshape(x.shape[0], -1).double()
    gram = x.T @ x
    lam = ridge * gram.diagonal().mean().clamp_min(1e-12)
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    return torch.linalg.solve(gram + lam * eye, x.T @ t).T


def _rms_normed(gdn: GatedDeltaNet, core: torch.Tensor) -> torch.Tensor:
    """o_norm without its gate: RMSNorm(core) * weight, float32."""
    c = core.float()
    return c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + gdn.o_norm.eps) * gdn.o_norm.weight.float()


def relative_error(out: torch.Tensor, target: torch.Tensor) -> float:
    return float((out.float() - target.float()).pow(2).sum() / target.float().pow(2).sum().clamp_min(1e-30))


@torch.no_grad()
def calibrate_layer(gdn: GatedDeltaNet, x: torch.Tensor, ctx: torch.Tensor, target: torch.Tensor, stats: dict, opts: Phase1Options) -> dict:
    """Apply Phase 1 to `gdn` (a GatedDeltaNet or another delta-rule layer with set_decay, such as
    tcal.mixers.kda's) in place. x [N,T,hidden], ctx [N,T,H,D], target [N,T,hidden]."""
    report = {"rel_error_before": relative_error(gdn(x), target)}
    if opts.decay:
        set_decay(gdn, stats, opts, report)
    if opts.write_gate:
        set_write_gate(gdn, x, stats, opts, report)
    if opts.value_scale:
        scale_values(gdn, x, ctx, report)
    set_gate(gdn, x, ctx, opts, report)
    report["rel_error_after"] = relative_error(gdn(x), target)
    return report


def set_decay(gdn: GatedDeltaNet, stats: dict, opts: Phase1Options, report: dict) -> None:
    """Each head's decay from the attention distance (METHOD.md, Decay) through the layer's set_decay
    (A_log, dt_bias per head): any layer whose decay is -exp(A_log) * softplus(proj + dt_bias) takes it."""
    a_log, dt_bias = maps.decay_from_distance(stats["distance"], opts.min_rate, opts.max_rate)
    gdn.set_decay(a_log, dt_bias, opts.a_proj_scale)
    report["distance"] = stats["distance"].tolist()
    report["alpha"] = torch.exp(-F.softplus(dt_bias.double())).tolist()


def set_write_gate(gdn: GatedDeltaNet, x, stats: dict, opts: Phase1Options, report: dict) -> None:
    """b_proj's rows so each head's mean pre-sigmoid logit is logit(beta*_h), beta* from the
    attention entropy (METHOD.md, write gate); any layer with a per-head b_proj takes it."""
    c = maps.concentration(stats, opts.concentration)
    beta = maps.write_gate_target(c, opts.beta_low, opts.beta_span)
    x_mean = x.reshape(-1, x.shape[-1]).double().mean(0).cpu()  # maps work on CPU float64
    w = maps.shift_rows_to_mean_logit(gdn.b_proj.weight.cpu(), x_mean, maps.logit(beta).cpu(), opts.b_proj_scale)
    gdn.b_proj.weight.copy_(w.to(gdn.b_proj.weight.dtype))
    report["concentration"] = c.tolist()
    report["beta_target"] = beta.tolist()


def scale_values(gdn: GatedDeltaNet, x, ctx, report: dict) -> None:
    """The per-head OLS value scale (METHOD.md, Value scale) multiplied into v_proj's rows."""
    core = gdn.forward_parts(x)["core"]
    sigma = maps.ols_scale(ctx, core, dim=2).to(gdn.v_proj.weight.device)
    rows = sigma.repeat_interleave(gdn.head_dim).to(gdn.v_proj.weight.dtype)
    gdn.v_proj.weight.mul_(rows[:, None])
    if gdn.v_proj.bias is not None:
        gdn.v_proj.bias.mul_(rows)
    report["value_scale"] = sigma.tolist()


def set_gate(gdn: GatedDeltaNet, x, ctx, opts: Phase1Options, report: dict) -> None:
    """The output gate g_proj by opts.gate (module docstring); any layer with GDN's output path
    (forward_parts' core and v, o_norm, g_proj, v_proj, head_dim) takes it."""
    if opts.gate == "keep":
        return
    if opts.gate == "zero":
        for p in gdn.g_proj.parameters():
            p.zero_()
        return
    if opts.gate == "reference" and low_rank(gdn):
        raise ValueError("calibrate.gate=reference writes g_proj as a multiple of v_proj, which a low-rank g_proj "
                         "(replace.kimi_form=true) cannot hold; use calibrate.gate=constant or tokenwise")
    if opts.gate == "reference":
        w = gdn.g_proj.weight
        v_act = gdn.forward_parts(x)["v"]
        alpha = maps.reference_gate_scale(ctx, v_act, opts.reference_gate_factor)
        w.copy_((alpha.to(w.device) * gdn.v_proj.weight.float()).to(w.dtype))
        report["gate_alpha"] = float(alpha)
        return
    normed = _rms_normed(gdn, gdn.forward_parts(x)["core"]).double()   # [N,T,H,D]
    c = ctx.double()
    dot, norm = (c * normed).sum(-1), normed.pow(2).sum(-1)            # [N,T,H]
    if opts.gate == "constant":
        amplitude = (dot.sum((0, 1)) / norm.sum((0, 1)).clamp_min(1e-30)).expand_as(dot)
    else:
        amplitude = dot / norm.clamp_min(1e-30)
    z = gate_preactivation(gdn, amplitude, opts.gate_floor)
    write_gate_rows(gdn, ridge_rows(x, z, opts.gate_ridge))            # rows [H, in]
    report["gate_amplitude"] = amplitude.mean((0, 1)).tolist()
