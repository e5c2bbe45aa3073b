"""Mamba2's state-space duality (SSD) as a gated linear attention with ONE decay per head (fla's
"simple GLA"): per head, with state S [Dk, Dv] and a scalar log-space decay g_t <= 0,

    S_t = exp(g_t) S_{t-1} + k_t v_t^T,    o_t = S_t^T (scale * q_t)

so o_t = scale * sum_{s<=t} (q_t . k_s) e^(G_t - G_s) v_s + scale * e^(G_t) q_t S_0 (G the running
sum of g). Mamba2 reads q = C, k = B, v = dt * x, g = -exp(A_log) * dt (tcal.mixers.mamba2).

Shapes: q, k [B, T, H, Dk]; v [B, T, H, Dv]; g [B, T, H]; states [B, H, Dk, Dv] (fla's
chunk_simple_gla / fused_recurrent_simple_gla layout, so states pass between backends). A token loop
and a chunked form in PyTorch (differentiable, any device; the token loop is GLA's), fla's Triton
kernels on CUDA.
"""
from __future__ import annotations

import torch

from .gla_kernels import chunks_of, compute_dtype, initial_state_of, recurrent_gla_torch, run_kernel


def recurrent_ssd_torch(q, k, v, g, scale, initial_state=None, output_final_state=False):
    """Token by token (exact, for decoding and short calls): GLA's token loop with the head's decay
    on every key channel."""
    return recurrent_gla_torch(q, k, v, g.unsqueeze(-1).expand_as(q), scale, initial_state, output_final_state)


def chunked_ssd_torch(q, k, v, g, scale, initial_state=None, output_final_state=False, chunk_size=32):
    """Chunks of C tokens, a Python loop over chunks only. One decay per head makes the pairwise
    decays within a chunk a [C, C] matrix L_ij = e^(G_i - G_j) (i >= j, else 0), so the chunk's own
    part is ((Q K^T) * L) V and the carried state enters as (Q * e^G) S_0: every exponent <= 0
    (strong decay underflows to 0, never overflows); memory O(T * C) per head for the decays."""
    out_dtype, cdt = v.dtype, compute_dtype(q.dtype)
    b, t, h, _ = q.shape
    pad = (-t) % chunk_size
    q, k, v = (chunks_of(x, pad, chunk_size, cdt) for x in (q, k, v))
    cum = chunks_of(g.unsqueeze(-1), pad, chunk_size, cdt).squeeze(-1).cumsum(-1)  # [B, H, N, C]
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    pairwise = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    inside = ((q * scale) @ k.transpose(-1, -2) * pairwise) @ v  # [B, H, N, C, Dv]
    q_start = q * scale * cum[..., None].exp()                    # what the carried state is read with
    k_end = k * (cum[..., -1:] - cum)[..., None].exp()            # what each key still weighs at the chunk's end
    state = initial_state_of(initial_state, b, h, q.shape[-1], v.shape[-1], q)
    outs = []
    for n in range(q.shape[2]):
        outs.append(inside[:, :, n] + q_start[:, :, n] @ state)
        state = cum[:, :, n, -1, None, None].exp() * state + k_end[:, :, n].transpose(-1, -2) @ v[:, :, n]
    o = torch.stack(outs, dim=2).flatten(2, 3)[:, :, :t].transpose(1, 2)
    return o.to(out_dtype), (state if output_final_state else None)


@torch.compiler.disable  # fla's Triton launchers stay opaque to dynamo: a graph break, run eagerly
def _fla_ssd(q, k, v, g, scale, initial_state, output_final_state):
    from fla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla

    options = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state)
    if q.shape[1] <= 64 and not (torch.is_grad_enabled() and q.requires_grad):
        return fused_recurrent_simple_gla(q, k, v, g, **options)
    return chunk_simple_gla(q, k, v, g, **options)


def ssd(q, k, v, g, scale=None, initial_state=None, output_final_state=False, backend="auto"):
    """(o [B, T, H, Dv], final state [B, H, Dk, Dv] or None). backend: "torch", "fla" (its Triton
    kernels), "auto" (fla on CUDA when it imports, else torch)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return run_kernel("Mamba2", backend, _fla_ssd, recurrent_ssd_torch, chunked_ssd_torch,
                      q, k, v, g, scale, initial_state, output_final_state)
