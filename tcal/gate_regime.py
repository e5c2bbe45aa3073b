"""Where a recurrent layer's gates sit on real inputs: how long its state remembers (the memory
horizon, 1 / mean(-g) tokens for the per-token decay g = log retention), how strongly it writes
(beta) and how large its output gate is.

Why: a layer whose horizon falls under one token mixes only the current token, and its decay sits
where exp and softplus pass little gradient, so distillation at its usual learning rate hardly
brings the memory back. Phase 2 drove 8 of Gemma-3-270M's 9 `ar` layers from horizons of 59-134
tokens (Phase 1) to 0.04-0.15, and that init, 25x better at the start, fell behind the copy-only
one within 2.1M distillation tokens (bench/RESULTS.md, twenty-third session)."""
from __future__ import annotations

import torch

from .gated_norm import ACTIVATIONS as GATE_ACTIVATIONS

SHORT_MEMORY = 1.0  # tokens: a horizon below this keeps nothing past the current token


@torch.no_grad()
def gate_regime(layer, x: torch.Tensor) -> dict[str, float]:
    """{horizon, retention, write, output_gate} of `layer` (a recurrent mixer with forward_parts) on
    its input x [B, T, hidden], averaged over tokens and heads; a key is absent where the mixer has
    no such gate (no decay: no horizon; no delta rule: no write strength)."""
    parts = layer.forward_parts(x)
    regime = {}
    if parts.get("g") is not None:
        g = parts["g"].float()
        regime["retention"] = float(g.exp().mean())
        regime["horizon"] = float(1.0 / (-g).mean().clamp_min(1e-6))
    if parts.get("beta") is not None:
        regime["write"] = float(parts["beta"].float().mean())
    if parts.get("gate") is not None:
        activation = GATE_ACTIVATIONS[getattr(layer.o_norm, "activation", "silu")]
        regime["output_gate"] = float(activation(parts["gate"].float()).abs().mean())
    return regime
