"""kda: Gated DeltaNet with a decay per key channel (the recurrence of Kimi Delta Attention, fla's
KimiDeltaAttention), in plain PyTorch; the recurrence goes through tcal.mixers.kda_kernels.

Per token: g_t = -exp(A_log_h) * softplus(f_proj(x_t) + dt_bias) per key channel (f_proj low rank,
dt_bias [H * Dk], as fla), beta_t = sigmoid(b_proj(x_t)), q and k L2-normalised after SiLU, then the
delta rule of tcal.mixers.kda_kernels. The output path is GDN's (RMSNorm(o) * w * silu(g_proj x),
full-rank g_proj) rather than fla's low-rank sigmoid gate, so Phase 1's output gate is GDN's own.

kimi_form=True builds the layer in Kimi Linear's own parametrisation (transformers' KimiLinearDeltaAttention,
which `surgery export --format kimi_linear` writes): f_proj and g_proj both of rank head_dim (g_proj a
two-linear Sequential), and a sigmoid output gate, RMSNorm(o) * w * sigmoid(g_proj x).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..gdn import GatedRMSNorm, GDNCache, RecurrentLayer
from .kda_kernels import kda

PARAMETER_ROLES = {
    "qkv": ("q_proj", "k_proj", "v_proj"),                           # copied from the teacher's attention
    "conv": ("q_conv1d", "k_conv1d", "v_conv1d"),                     # new, start as the identity
    "gates": ("f_proj", "b_proj", "g_proj", "A_log", "dt_bias"),      # new, set by Phase 1
    "output": ("o_proj",),                                            # copied from the teacher's attention
    "norm": ("o_norm",),                                              # new
}


def fla_channel_decay_init(num_heads: int, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's KDA init: A ~ U(1, 16) per head; dt log-uniform in [1e-3, 0.1] per channel, floored at 1e-4."""
    a_log = torch.empty(num_heads, dtype=torch.float32).uniform_(1, 16).log()
    dt = torch.exp(torch.rand(channels) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
    return a_log, dt + torch.log(-torch.expm1(-dt))


class KimiDeltaAttention(RecurrentLayer):
    """KDA layer: [B, T, hidden] -> [B, T, hidden]; decode state [B, H, Dk, Dv] (+ conv inputs)."""

    PARAMETER_ROLES = PARAMETER_ROLES
    COPIED_ROLES = ("qkv", "output")
    INPUT_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "f_proj.0", "b_proj", "g_proj")
    TOKEN_STEP = True  # GDN's recurrence with a decay per key channel: tcal.token_step takes it

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, *, q_bias: bool = False, k_bias: bool = False,
                 v_bias: bool = False, o_bias: bool = False, use_short_conv: bool = False, conv_size: int = 4,
                 conv_identity_init: bool = True, norm_eps: float = 1e-5, v_activation: str = "silu", backend: str = "auto",
                 gate_low_rank_dim: int = 16, kimi_form: bool = False, layer_idx: int | None = None):
        """kimi_form: Kimi Linear's parametrisation (module docstring); gate_low_rank_dim is then head_dim."""
        arguments = dict(locals())
        super().__init__()
        self._common(arguments)
        self._add_qkv(q_bias, k_bias, v_bias)
        inner, rank = num_heads * head_dim, head_dim if kimi_form else gate_low_rank_dim
        self.kimi_form = kimi_form
        self.f_proj = nn.Sequential(nn.Linear(hidden_size, rank, bias=False), nn.Linear(rank, inner, bias=False))
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        a_log, dt_bias = fla_channel_decay_init(num_heads, inner)
        self.A_log, self.dt_bias = nn.Parameter(a_log), nn.Parameter(dt_bias)
        self.A_log._no_weight_decay = self.dt_bias._no_weight_decay = True
        self._add_convs_and_output(conv_size, conv_identity_init, norm_eps, o_bias)
        if kimi_form:
            self.g_proj = nn.Sequential(nn.Linear(hidden_size, head_dim, bias=False), nn.Linear(head_dim, inner, bias=False))
            self.o_norm = GatedRMSNorm(head_dim, eps=norm_eps, activation="sigmoid")
            self.INPUT_PROJECTIONS = self.INPUT_PROJECTIONS[:-1] + ("g_proj.0",)

    @torch.no_grad()
    def set_decay(self, a_log: torch.Tensor, dt_bias: torch.Tensor, proj_scale: float) -> None:
        """Phase 1's decay per head (A_log, dt_bias [H], GDN's mapping: METHOD.md): every key channel of
        head h starts at the head's rate; f_proj's data-dependent part damped by proj_scale."""
        self.A_log.copy_(a_log)
        self.dt_bias.copy_(dt_bias.repeat_interleave(self.head_dim).to(self.dt_bias))
        self.f_proj[1].weight.mul_(proj_scale)

    def decay(self, f_low: torch.Tensor) -> torch.Tensor:
        """Log-space decay per key channel from f_proj's low-rank input: [B, T, H, Dk], float32."""
        up = self.f_proj[1]
        rate = F.softplus(F.linear(f_low.float(), up.weight.float()) + self.dt_bias.float())
        return -self._split_heads(rate) * self.A_log.float().exp()[:, None]

    def forward_parts(self, hidden_states: torch.Tensor, cache: GDNCache | None = None, projection=None) -> dict:
        """Every intermediate of the forward pass; with a cache, continue the sequence it holds."""
        p = self._input_projections(hidden_states, projection)
        if self.kimi_form:
            p["g_proj"] = self.g_proj[1](p["g_proj.0"])
        q, k, v, beta_logit, beta = self.delta_rule_inputs(p, cache)
        g = self.decay(p["f_proj.0"])
        state = None if cache is None else cache.recurrent
        core, final = kda(q, k, v, g, beta, scale=self.head_dim ** -0.5, initial_state=state,
                          output_final_state=cache is not None, backend=self.backend)
        if cache is not None:
            cache.recurrent = final
        return dict(q=q, k=k, v=v, g=g, beta=beta, beta_logit=beta_logit, **self.gated_output(core, p, v.dtype))

    def token_decay_input(self, p: dict) -> torch.Tensor:
        """The decay's input per key channel for the fused token step, as decay() computes it: [B, 1, H * Dk]
        (Kimi Linear's form, with its sigmoid output gate, composes its token instead: takes_token_step)."""
        return F.linear(p["f_proj.0"].float(), self.f_proj[1].weight.float())
