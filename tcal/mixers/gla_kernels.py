"""Gated linear attention (GLA): per head, with state S [Dk, Dv] and a decay per key channel,

    S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T,    o_t = S_t^T (scale * q_t)

Shapes: q, k, g [B, T, H, Dk] (g log-space, <= 0); v [B, T, H, Dv]; states [B, H, Dk, Dv] (fla's
chunk_gla / fused_recurrent_gla layout, so states pass between backends). Two PyTorch paths run
anywhere and are differentiable (a token loop, and a chunked form); on CUDA fla's Triton kernels.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import fla_available, fla_backward_supported

RECURRENT_MAX_T = 16  # at or below this length the token loop is cheaper than chunk matrices


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def initial_state_of(initial_state, b, h, dk, dv, like):
    return like.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.to(like.dtype)


def recurrent_gla_torch(q, k, v, g, scale, initial_state=None, output_final_state=False):
    """Token by token: exact, for decoding and short calls."""
    cdt = compute_dtype(q.dtype)
    q, k, v, g = (x.transpose(1, 2).to(cdt) for x in (q, k, v, g))
    b, h, t, dk = q.shape
    state = initial_state_of(initial_state, b, h, dk, v.shape[-1], q)
    outputs = []
    for i in range(t):
        state = state * g[:, :, i].exp()[..., None] + k[:, :, i, :, None] * v[:, :, i, None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, i] * scale, state))
    o = torch.stack(outputs, dim=1)
    return o, (state if output_final_state else None)


def chunks_of(x: torch.Tensor, pad: int, size: int, dtype) -> torch.Tensor:
    """[B, T, H, D] -> [B, H, N, C, D], zero-padded at the end (zero k and g: the state is kept)."""
    x = F.pad(x.to(dtype), (0, 0, 0, 0, 0, pad)) if pad else x.to(dtype)
    b, t, h, d = x.shape
    return x.view(b, t // size, size, h, d).permute(0, 3, 1, 2, 4)


def chunked_gla_torch(q, k, v, g, scale, initial_state=None, output_final_state=False, chunk_size=16):
    """Chunks of C tokens, a Python loop over chunks only. Within a chunk (G_i = g_1 + ... + g_i per
    key channel) o_i = sum_{j<=i} (q_i . (k_j * e^(G_i - G_j))) v_j + (q_i * e^(G_i)) S_0, every
    exponent <= 0 (strong decay underflows to 0, never overflows); memory O(T * C * Dk) per head."""
    out_dtype, cdt = v.dtype, compute_dtype(q.dtype)
    b, t, h, dk = q.shape
    pad = (-t) % chunk_size
    q, k, v, g = (chunks_of(x, pad, chunk_size, cdt) for x in (q, k, v, g))
    cum = g.cumsum(-2)  # [B, H, N, C, Dk]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    gap = (cum[..., :, None, :] - cum[..., None, :, :]).masked_fill(~causal[..., None], float("-inf"))
    scores = torch.einsum("bhnid,bhnjd,bhnijd->bhnij", q * scale, k, gap.exp())
    inside = scores @ v  # [B, H, N, C, Dv]
    tail = cum[..., -1:, :]
    k_end = k * (tail - cum).exp()  # what each key still weighs at the chunk's end
    state = initial_state_of(initial_state, b, h, dk, v.shape[-1], q)
    outs = []
    for n in range(q.shape[2]):
        outs.append(inside[:, :, n] + (q[:, :, n] * scale * cum[:, :, n].exp()) @ state)
        state = state * tail[:, :, n, 0, :, None].exp() + k_end[:, :, n].transpose(-1, -2) @ v[:, :, n]
    o = torch.stack(outs, dim=2).flatten(2, 3)[:, :, :t].transpose(1, 2)
    return o.to(out_dtype), (state if output_final_state else None)


@torch.compiler.disable  # fla's Triton launchers stay opaque to dynamo: a graph break, run eagerly
def _fla_gla(q, k, v, g, scale, initial_state, output_final_state):
    from fla.ops.gla import chunk_gla, fused_recurrent_gla

    if q.shape[1] <= 64 and not (torch.is_grad_enabled() and q.requires_grad):
        return fused_recurrent_gla(q, k, v, gk=g, scale=scale, initial_state=initial_state, output_final_state=output_final_state)
    return chunk_gla(q, k, v, g, scale=scale, initial_state=initial_state, output_final_state=output_final_state)


def run_kernel(name: str, backend: str, fla_run, recurrent, chunked, *args):
    """What a mixer's kernel entry point does with its backend: "fla" calls fla_run(*args); "torch"
    the token loop for short calls (<= RECURRENT_MAX_T tokens, such as one decoded token) and the
    chunked form otherwise, the output cast to v's dtype; "auto" is fla on CUDA when it imports and,
    when a gradient is needed, its backward is trustworthy on this Triton (as GDN's, tcal.kernels).
    args: (q, k, v, ..., scale, initial_state, output_final_state) as the kernels take them."""
    q, v = args[0], args[2]
    if backend == "auto":
        training = torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        backend = "fla" if q.is_cuda and fla_available() and (not training or fla_backward_supported()) else "torch"
    if backend == "fla":
        return fla_run(*args)
    if backend != "torch":
        raise ValueError(f"unknown {name} backend {backend!r}; use auto, torch or fla")
    o, state = (recurrent if q.shape[1] <= RECURRENT_MAX_T else chunked)(*args)
    return o.to(v.dtype), state


def gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False, backend="auto"):
    """(o [B, T, H, Dv], final state [B, H, Dk, Dv] or None). backend: "torch", "fla" (its Triton
    kernels), "auto" (fla on CUDA when it imports, else torch)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return run_kernel("GLA", backend, _fla_gla, recurrent_gla_torch, chunked_gla_torch,
                      q, k, v, g, scale, initial_state, output_final_state)
