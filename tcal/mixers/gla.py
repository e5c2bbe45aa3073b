"""gla: gated linear attention, flash-linear-attention's GatedLinearAttention semantics (expand_k =
expand_v = 1 so the teacher's heads carry over, no feature map, low-rank forget gate, RMS-normed
output gated by swish), in plain PyTorch; the recurrence goes through tcal.mixers.gla_kernels.

Per token: decay per key channel g_t = logsigmoid(gk_proj(x_t)) / gate_logit_normalizer (log-space),
S_t = diag(e^(g_t)) S_{t-1} + k_t v_t^T, o_t = S_t^T q_t / sqrt(Dk); no write gate, no delta rule.
As with tcal.gdn: q/k/v/o may carry the teacher's biases, the short convolutions are optional (SiLU
after them, as fla) and start as the identity, v's activation is selectable.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..gdn import GDNCache, RecurrentLayer
from .gla_kernels import gla

PARAMETER_ROLES = {
    "qkv": ("q_proj", "k_proj", "v_proj"),          # copied from the teacher's attention
    "conv": ("q_conv1d", "k_conv1d", "v_conv1d"),    # new, start as the identity
    "gates": ("gk_proj", "g_proj"),                  # new: the forget gate (its bias set by Phase 1), the output gate
    "output": ("o_proj",),                           # copied from the teacher's attention
    "norm": ("o_norm",),                             # new
}


class GatedLinearAttention(RecurrentLayer):
    """GLA layer: [B, T, hidden] -> [B, T, hidden]; decode state [B, H, Dk, Dv] (+ conv inputs)."""

    PARAMETER_ROLES = PARAMETER_ROLES
    COPIED_ROLES = ("qkv", "output")
    INPUT_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "gk_proj.0", "g_proj")

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, *, q_bias: bool = False, k_bias: bool = False,
                 v_bias: bool = False, o_bias: bool = False, use_short_conv: bool = False, conv_size: int = 4,
                 conv_identity_init: bool = True, norm_eps: float = 1e-5, v_activation: str = "silu", backend: str = "auto",
                 gate_low_rank_dim: int = 16, gate_logit_normalizer: int = 16, layer_idx: int | None = None):
        arguments = dict(locals())
        super().__init__()
        self._common(arguments)
        self.gate_logit_normalizer = gate_logit_normalizer
        self._add_qkv(q_bias, k_bias, v_bias)
        low_rank = nn.Linear(hidden_size, gate_low_rank_dim, bias=False)
        self.gk_proj = nn.Sequential(low_rank, nn.Linear(gate_low_rank_dim, num_heads * head_dim, bias=True))  # fla's names
        self._add_convs_and_output(conv_size, conv_identity_init, norm_eps, o_bias)

    def decay(self, gk_low: torch.Tensor) -> torch.Tensor:
        """Log-space decay per key channel from the gate's low-rank input: [B, T, H, Dk], float32."""
        up = self.gk_proj[1]
        logits = F.linear(gk_low.float(), up.weight.float(), up.bias.float())
        return self._split_heads(F.logsigmoid(logits) / self.gate_logit_normalizer)

    def forward_parts(self, hidden_states: torch.Tensor, cache: GDNCache | None = None, projection=None) -> dict:
        """Every intermediate of the forward pass; with a cache, continue the sequence it holds (the
        conv streams and the recurrent state are updated in it)."""
        p = self._input_projections(hidden_states, projection)
        q, k, v = self.linear_attention_inputs(p, cache)
        g = self.decay(p["gk_proj.0"])
        state = None if cache is None else cache.recurrent
        core, final = gla(q, k, v, g, scale=self.head_dim ** -0.5, initial_state=state,
                          output_final_state=cache is not None, backend=self.backend)
        if cache is not None:
            cache.recurrent = final
        return dict(q=q, k=k, v=v, g=g, **self.gated_output(core, p, v.dtype))
