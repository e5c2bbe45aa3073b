"""swa: sliding-window softmax attention, the cheapest conversion (a baseline for the recurrent mixers).

The converted layer keeps everything the teacher computes up to the attention op (its projections,
RoPE, q/k norms) and after it (the output projection): only the op itself is swapped for this
module, which attends over the last `window` tokens instead of all of them, with the op's own scale
and softcap. Its decode state is a KV cache of `window` positions (surgery.decode keeps sliding-window
layers in a ring), so its memory stops growing at the window.

The window is a buffer (saved with the weights), so Phase 1 can set it: `phase1` picks, per layer,
the largest over heads of the smallest window that holds `window_quantile` (default 0.9) of the
head's mean attention mass on the calibration text (tcal.maps.window_from_mass). There is nothing to
train: Phase 2 leaves these layers alone (the teacher's projections stay the teacher's).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import maps
from ..phase1 import relative_error


class SlidingWindowAttention(nn.Module):
    """softmax(scale * q k^T, causal, last `window` keys) v for q [B, H, T, D] and k, v as the
    teacher's attention op received them: [B, Hk, T, D] (K^T [B, Hk, D, T] with k_transposed), Hk
    dividing H (query head h reads KV head h // (H / Hk), SDPA's grouped layout)."""

    DECODE = "window"  # decoded as a sliding-window attention layer (a KV cache of `window` positions)
    PARAMETER_ROLES: dict = {}
    COPIED_ROLES: tuple = ()

    def __init__(self, num_heads: int, head_dim: int, window: int, scale: float, softcap: float | None = None,
                 k_transposed: bool = False, layer_idx: int | None = None):
        arguments = dict(locals())
        super().__init__()
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._config = {k: v for k, v in arguments.items() if k not in ("self", "__class__")}
        self.num_heads, self.head_dim, self.scale, self.softcap = num_heads, head_dim, scale, softcap
        self.k_transposed, self.layer_idx = k_transposed, layer_idx
        self.register_buffer("window", torch.tensor(window, dtype=torch.int64))

    def param_groups(self) -> dict:
        return {}

    def copied_parameters(self) -> list:
        return []

    def gdn_config(self) -> dict:
        """Constructor arguments (the window as it is now), enough to rebuild this module."""
        return dict(self._config, window=int(self.window))

    @classmethod
    def from_gdn_config(cls, config: dict) -> "SlidingWindowAttention":
        return cls(**config)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}, window={int(self.window)}, softcap={self.softcap}"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.k_transposed:
            k = k.transpose(-1, -2)
        heads, t, s = q.shape[1], q.shape[2], k.shape[2]
        k, v = (x.repeat_interleave(heads // x.shape[1], dim=1) if x.shape[1] != heads else x for x in (k, v))
        i = torch.arange(s - t, s, device=q.device)[:, None]  # queries sit at the end of the keys
        j = torch.arange(s, device=q.device)[None, :]
        allowed = (j <= i) & (i - j < self.window)  # the buffer itself: int() would end a compiled graph
        if self.softcap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        scores = torch.tanh(scores / self.softcap) * self.softcap
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1, dtype=torch.float32)
        return torch.matmul(probs.to(v.dtype), v)


@torch.no_grad()
def phase1(layer: SlidingWindowAttention, qkv: tuple, ctx: torch.Tensor, stats: dict, quantile: float, max_window: int) -> dict:
    """Set the window from the teacher's attention-distance mass (module docstring); the report
    gives the relative error of the attention op's output (ctx [N, T, H, D]) before and after."""
    def error() -> float:
        return relative_error(layer(*qkv).transpose(1, 2), ctx)

    report = {"rel_error_before": error(), "window_before": int(layer.window)}
    heads = maps.window_from_mass(stats["distance_mass"], quantile)
    layer.window.fill_(int(min(int(heads.max()), max_window)))
    report.update(window=int(layer.window), head_windows=heads.tolist(), quantile=quantile, rel_error_after=error())
    return report
