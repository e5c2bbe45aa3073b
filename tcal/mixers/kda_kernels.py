"""The gated delta rule with a decay per key channel (Kimi Delta Attention's recurrence): per head,

    S_t = diag(exp(g_t)) S_{t-1};   S_t += k_t (beta_t (v_t - S_t^T k_t))^T;   o_t = S_t^T (scale q_t)

Shapes: q, k, g [B, T, H, Dk] (g log-space, <= 0); v [B, T, H, Dv]; beta [B, T, H]; states
[B, H, Dk, Dv] (fla's chunk_kda layout). tcal.kernels' gated delta rule is the case of one decay per
head. A token loop and a chunked form (the WY/UT transform with the pairwise decays per channel)
in PyTorch, and fla's Triton kernels on CUDA.
"""
from __future__ import annotations

import torch

from .gla_kernels import chunks_of, compute_dtype, initial_state_of, run_kernel


def recurrent_kda_torch(q, k, v, g, beta, scale, initial_state=None, output_final_state=False):
    """Token by token: exact, for decoding and short calls."""
    cdt = compute_dtype(q.dtype)
    q, k, v, g, beta = (x.transpose(1, 2).to(cdt) for x in (q, k, v, g, beta))
    b, h, t, dk = q.shape
    state = initial_state_of(initial_state, b, h, dk, v.shape[-1], q)
    outputs = []
    for i in range(t):
        state = state * g[:, :, i].exp()[..., None]
        k_i = k[:, :, i]
        delta = beta[:, :, i, None] * (v[:, :, i] - torch.einsum("bhk,bhkv->bhv", k_i, state))
        state = state + k_i[..., :, None] * delta[..., None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, i] * scale, state))
    return torch.stack(outputs, dim=1), (state if output_final_state else None)


def chunked_kda_torch(q, k, v, g, beta, scale, initial_state=None, output_final_state=False, chunk_size=16):
    """Chunks of C tokens (G_i = g_1 + ... + g_i per key channel within a chunk). What each token
    writes solves the unit lower-triangular system (I + A) W = beta V - beta (K * e^G) S_0 with
    A_ij = beta_i (k_i * e^(G_i - G_j)) . k_j (j < i); then o_i = scale ((q_i * e^(G_i)) S_0 +
    sum_{j<=i} ((q_i * e^(G_i - G_j)) . k_j) W_j) and S_C = e^(G_C) S_0 + sum_j (k_j * e^(G_C - G_j)) W_j^T.
    Every exponent is <= 0; memory O(T * C * Dk) per head."""
    out_dtype, cdt = v.dtype, compute_dtype(q.dtype)
    b, t, h, dk = q.shape
    pad = (-t) % chunk_size
    q, k, v, g = (chunks_of(x, pad, chunk_size, cdt) for x in (q, k, v, g))
    beta = chunks_of(beta.unsqueeze(-1), pad, chunk_size, cdt)  # [B, H, N, C, 1]
    cum = g.cumsum(-2)
    rows = torch.arange(chunk_size, device=q.device)
    causal = rows[:, None] >= rows[None, :]
    pair = (cum[..., :, None, :] - cum[..., None, :, :]).masked_fill(~causal[..., None], float("-inf")).exp()
    a = torch.einsum("bhnid,bhnjd,bhnijd->bhnij", k, k, pair) * beta
    a = a.masked_fill(rows[:, None] <= rows[None, :], 0.0) + torch.eye(chunk_size, dtype=cdt, device=q.device)  # I + strictly lower A
    inverse = torch.linalg.solve_triangular(a, torch.eye(chunk_size, dtype=cdt, device=q.device).expand_as(a), upper=False, unitriangular=True)
    u, w = inverse @ (beta * v), inverse @ (beta * k * cum.exp())
    scores = torch.einsum("bhnid,bhnjd,bhnijd->bhnij", q * scale, k, pair)
    tail = cum[..., -1:, :]
    k_end = k * (tail - cum).exp()
    state = initial_state_of(initial_state, b, h, dk, v.shape[-1], q)
    outs = []
    for n in range(q.shape[2]):
        written = u[:, :, n] - w[:, :, n] @ state
        outs.append((q[:, :, n] * scale * cum[:, :, n].exp()) @ state + scores[:, :, n] @ written)
        state = state * tail[:, :, n, 0, :, None].exp() + k_end[:, :, n].transpose(-1, -2) @ written
    o = torch.stack(outs, dim=2).flatten(2, 3)[:, :, :t].transpose(1, 2)
    return o.to(out_dtype), (state if output_final_state else None)


@torch.compiler.disable  # fla's Triton launchers stay opaque to dynamo: a graph break, run eagerly
def _fla_kda(q, k, v, g, beta, scale, initial_state, output_final_state):
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    options = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state)
    if q.shape[1] <= 64 and not (torch.is_grad_enabled() and q.requires_grad):
        return fused_recurrent_kda(q, k, v, g, beta, **options)
    return chunk_kda(q, k, v, g, beta, **options)


def kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, backend="auto"):
    """(o [B, T, H, Dv], final state [B, H, Dk, Dv] or None). backend: "torch", "fla", "auto" (fla
    on CUDA when it imports, else torch)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return run_kernel("KDA", backend, _fla_kda, recurrent_kda_torch, chunked_kda_torch,
                      q, k, v, g, beta, scale, initial_state, output_final_state)
