"""The two forms of a recurrent layer's output gate that Phase 1 fits (tcal.phase1.set_gate):

* GDN's: a full-rank g_proj and RMSNorm(core) * w * silu(g_proj x). The fitted amplitude a >= 0 is
  reached by the pre-activation silu^-1(a).
* Kimi Linear's (tcal.mixers.kda with kimi_form): g_proj = up(down(x)) of rank head_dim and
  sigmoid(g_proj x), which never exceeds 1. Each head's largest amplitude m_h is moved into o_proj's
  columns of that head (times 2 m_h), so the gate's target a / (2 m_h) is at most sigmoid(0) = 0.5,
  with room above for Phase 2; the "constant" gate is then exactly 0.5.
  Phase 1's gate rows (one per head) are written through the low rank exactly when heads <= rank.
"""
from __future__ import annotations

import torch
import torch.nn as nn


def silu_inverse(y: torch.Tensor, iterations: int = 30) -> torch.Tensor:
    """z >= 0 with z * sigmoid(z) = y for y >= 0 (the increasing branch), by Newton's method."""
    y = y.clamp_min(0)
    z = torch.maximum(y, torch.ones_like(y))
    for _ in range(iterations):
        s = torch.sigmoid(z)
        z = (z - (z * s - y) / (s * (1 + z * (1 - s)))).clamp_min(0)
    return z


def low_rank(layer: nn.Module) -> bool:
    """Whether the layer's g_proj is Kimi Linear's two-linear low-rank form."""
    return isinstance(getattr(layer, "g_proj", None), nn.Sequential)


def gate_preactivation(layer: nn.Module, amplitude: torch.Tensor, floor: float) -> torch.Tensor:
    """The gate pre-activation [N, T, H] that gives `amplitude` [N, T, H] (float64) through the layer's
    gate; a sigmoid gate first moves each head's mean amplitude into o_proj (module docstring)."""
    amplitude = amplitude.clamp_min(floor)
    if getattr(layer.o_norm, "activation", "silu") == "silu":
        return silu_inverse(amplitude)
    scale = 2 * amplitude.amax((0, 1))                                   # [H]
    o = layer.o_proj.weight
    o.mul_(scale.repeat_interleave(layer.head_dim).to(o)[None, :])
    target = (amplitude / scale).clamp(floor, 1 - floor)
    return torch.logit(target)


def write_gate_rows(layer: nn.Module, rows: torch.Tensor) -> None:
    """g_proj from one row per head [H, in] (every channel of a head gets its head's row). Low rank:
    down = the rows' leading right singular directions, up maps them back per head; exact when
    heads <= rank, else the best rank-`rank` approximation."""
    D = layer.head_dim
    if not low_rank(layer):
        w = layer.g_proj.weight
        w.copy_(rows.repeat_interleave(D, 0).to(w.dtype))
        return
    down, up = layer.g_proj[0].weight, layer.g_proj[1].weight
    u, s, vh = torch.linalg.svd(rows.double(), full_matrices=False)    # [H, k], [k], [k, in]
    k = min(s.shape[0], down.shape[0])
    down.zero_()
    up.zero_()
    down[:k] = (s[:k, None] * vh[:k]).to(down)
    up[:, :k] = u[:, :k].repeat_interleave(D, 0).to(up)
