"""mamba2: Mamba2's selective state space (SSD) layer with the teacher's heads, in plain PyTorch; the
recurrence goes through tcal.mixers.mamba2_kernels (fla's simple GLA on CUDA).

Per token and head: step dt_t = softplus(dt_proj(x_t) + dt_bias), log-space decay
g_t = -exp(A_log) * dt_t, and with C = q_proj, B = k_proj, x = v_proj (named after the teacher
projections they are copied from; B and C one per head, the teacher's K heads GQA-expanded, so the
heads of one KV group start with one shared B, as Mamba2's n_groups)

    S_t = e^(g_t) S_{t-1} + B_t (dt_t x_t)^T,    y_t = S_t^T (scale C_t) + D x_t,

scale = head_dim^-0.5 (the attention logits' scale, which the copied Q/K were trained for). No
write gate, no delta rule. Differences from fla's Mamba2, each on purpose: separate projections
(the teacher's, biases kept) instead of one fused in_proj; B and C free per head (no tied groups); the
short convolutions optional (SiLU after them) and starting as the identity; v's activation
selectable; the output path is GDN's (RMSNorm(y) * w * silu(g_proj x) per head, then o_proj), so
Phase 1's output gate is GDN's own. The copy-only baseline keeps fla's init: A ~ U(1, 16), dt
log-uniform in [1e-3, 0.1], D = 1.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..gdn import GDNCache, RecurrentLayer
from .kda import fla_channel_decay_init
from .mamba2_kernels import ssd

PARAMETER_ROLES = {
    "qkv": ("q_proj", "k_proj", "v_proj"),                         # C, B, x: copied from the teacher's Q, K, V
    "conv": ("q_conv1d", "k_conv1d", "v_conv1d"),                   # new, start as the identity
    "gates": ("dt_proj", "g_proj", "A_log", "dt_bias", "D"),        # new, set by Phase 1 (D to 0)
    "output": ("o_proj",),                                          # copied from the teacher's attention
    "norm": ("o_norm",),                                            # new
}


class Mamba2(RecurrentLayer):
    """Mamba2 layer: [B, T, hidden] -> [B, T, hidden]; decode state [B, H, Dk, Dv] (+ conv inputs)."""

    PARAMETER_ROLES = PARAMETER_ROLES
    COPIED_ROLES = ("qkv", "output")
    INPUT_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "dt_proj", "g_proj")

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, *, q_bias: bool = False, k_bias: bool = False,
                 v_bias: bool = False, o_bias: bool = False, use_short_conv: bool = False, conv_size: int = 4,
                 conv_identity_init: bool = True, norm_eps: float = 1e-5, v_activation: str = "silu", backend: str = "auto",
                 layer_idx: int | None = None):
        arguments = dict(locals())
        super().__init__()
        self._common(arguments)
        self._add_qkv(q_bias, k_bias, v_bias)
        self.dt_proj = nn.Linear(hidden_size, num_heads, bias=False)
        a_log, dt_bias = fla_channel_decay_init(num_heads, num_heads)
        self.A_log, self.dt_bias, self.D = nn.Parameter(a_log), nn.Parameter(dt_bias), nn.Parameter(torch.ones(num_heads))
        self.A_log._no_weight_decay = self.dt_bias._no_weight_decay = self.D._no_weight_decay = True
        self._add_convs_and_output(conv_size, conv_identity_init, norm_eps, o_bias)

    @torch.no_grad()
    def set_decay(self, a_log: torch.Tensor, dt_bias: torch.Tensor, proj_scale: float) -> None:
        """Phase 1's decay per head (A_log, dt_bias [H], GDN's mapping: METHOD.md), dt_proj's
        data-dependent part damped by proj_scale."""
        self.A_log.copy_(a_log)
        self.dt_bias.copy_(dt_bias)
        self.dt_proj.weight.mul_(proj_scale)

    def step_size(self, dt_in: torch.Tensor) -> torch.Tensor:
        """dt = softplus(dt_proj x + dt_bias) from dt_proj's output: [B, T, H], float32."""
        return F.softplus(dt_in.float() + self.dt_bias.float())

    def forward_parts(self, hidden_states: torch.Tensor, cache: GDNCache | None = None, projection=None) -> dict:
        """Every intermediate of the forward pass; with a cache, continue the sequence it holds (the
        conv streams and the recurrent state are updated in it). q = C, k = B, v = x."""
        p = self._input_projections(hidden_states, projection)
        q, k, v = self.linear_attention_inputs(p, cache)
        dt = self.step_size(p["dt_proj"])
        g = -dt * self.A_log.float().exp()
        state = None if cache is None else cache.recurrent
        y, final = ssd(q, k, (v * dt[..., None]).to(v.dtype), g, scale=self.head_dim ** -0.5, initial_state=state,
                       output_final_state=cache is not None, backend=self.backend)
        if cache is not None:
            cache.recurrent = final
        core = y + self.D.to(y.dtype)[:, None] * v.to(y.dtype)
        return dict(q=q, k=k, v=v, dt=dt, g=g, **self.gated_output(core, p, v.dtype))
