"""A GatedDeltaNet's recurrence inputs from its projections (after any short convolution), as one
kernel on CUDA (issue 29), with its reference beside it:

    q, k = l2norm(silu(q_raw)), l2norm(silu(k_raw));  v = silu(v_raw) or v_raw
    beta = sigmoid(b_raw);  g = -exp(A_log) * softplus(a_raw + dt_bias)

Why: composed, these were 16 launches a layer on CUDA at every prefill (SiLU and fla's l2norm for q
and k, four float32 casts of b, a, A_log and dt_bias with the gate's five elementwise ops and beta's
sigmoid, and the copy fla's input guard makes of the strided v slice), ~2.4 ms of q/k SiLU alone in
a 75% hybrid's 32k forward on the H200. `delta_inputs_triton` reads each input once through its
strides (slices of one fused projection stay views) and writes q, k, v contiguous in their dtype and
g, beta in float32: what fla's kernels take. It computes in float32 and rounds q, k and v once (the
composition also rounds SiLU's output before the norm). `delta_inputs_torch` is the same math in
PyTorch, in float32 (float64 for float64 inputs, for reference checks).

No backward: tcal.gdn takes the kernel only where no gradient is needed (inference, calibration
statistics); training keeps the composition, whose autograd is PyTorch's and fla's.

Shapes: q, k, v [B, T, H, D]; a, b [B, T, H] (any strides, all of them); A_log, dt_bias [H].
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .pdl import pdl_launch

try:  # Triton is a CUDA-side extra: CPU installs do not have it
    import triton
    import triton.language as tl
except Exception:  # a broken install raises more than ImportError
    triton = None

L2NORM_EPS = 1e-6  # fla's l2norm (tcal.gdn.l2norm)
MAX_HEAD_DIM = 256  # a program holds BLOCK_T rows of one head: wider heads keep the composition
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def delta_inputs_torch(q, k, v, a, b, A_log, dt_bias, v_silu: bool):
    """The reference: (q, k, v [B, T, H, D] in the inputs' dtype, g, beta [B, T, H] in float32 (float64
    for float64 inputs)), every step in that compute dtype, one rounding at the end."""
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32

    def unit(x):
        x = F.silu(x.to(cdt))
        return (x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2NORM_EPS)).to(q.dtype).contiguous()

    v = (F.silu(v.to(cdt)) if v_silu else v).to(v.dtype).contiguous()
    g = -A_log.to(cdt).exp() * F.softplus(a.to(cdt) + dt_bias.to(cdt))
    return unit(q), unit(k), v, g.contiguous(), b.to(cdt).sigmoid().contiguous()


if triton is not None:
    from .pdl import release_dependents, wait_for_inputs

    @triton.jit
    def _log1p(x):
        """log(1 + x), accurate for small x (Goldberg: log(u) * x / (u - 1), u = 1 + x rounded)."""
        u = 1.0 + x
        return tl.where(u == 1.0, x, tl.log(u) * (x / (u - 1.0)))

    @triton.jit
    def unit_silu(x_ptr, offs, inside, eps):
        """l2norm(silu(x)) of a [BLOCK_T, BD] tile, in float32 (also read by tcal.chunk_intra's raw form)."""
        x = tl.load(x_ptr + offs, mask=inside, other=0).to(tl.float32)
        x = x * tl.sigmoid(x)
        return x / tl.sqrt(tl.sum(x * x, 1) + eps)[:, None]

    @triton.jit
    def decay_and_beta(a, b, A_log_h, dt_bias_h):
        """g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b) of loaded rows, in float32."""
        x = a.to(tl.float32) + dt_bias_h.to(tl.float32)
        softplus = tl.where(x > 20.0, x, tl.maximum(x, 0.0) + _log1p(tl.exp(-tl.abs(x))))
        return -tl.exp(A_log_h.to(tl.float32)) * softplus, tl.sigmoid(b.to(tl.float32))

    @triton.jit
    def _delta_inputs_kernel(q, k, v, a, b, A_log, dt_bias, q_out, k_out, v_out, g_out, beta_out, rows, length, heads,
                             sq_b, sq_t, sq_h, sq_d, sk_b, sk_t, sk_h, sk_d,
                             sv_b, sv_t, sv_h, sv_d, sa_b, sa_t, sa_h, sb_b, sb_t, sb_h, eps,
                             D: tl.constexpr, BD: tl.constexpr, BLOCK_T: tl.constexpr, V_SILU: tl.constexpr,
                             PDL: tl.constexpr = False):
        """Program (row block i, head h): rows [i * BLOCK_T, (i + 1) * BLOCK_T) of the flattened [B * T]
        positions. The outputs are contiguous: q, k, v [B, T, H, D], g and beta [B, T, H]."""
        wait_for_inputs(PDL)
        i, h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
        r = i * BLOCK_T + tl.arange(0, BLOCK_T)
        d = tl.arange(0, BD)
        row_in = r < rows
        inside = row_in[:, None] & (d < D)[None, :]
        bi, t = r // length, r % length
        q_unit = unit_silu(q, (bi * sq_b + t * sq_t + h * sq_h)[:, None] + d[None, :] * sq_d, inside, eps)
        k_unit = unit_silu(k, (bi * sk_b + t * sk_t + h * sk_h)[:, None] + d[None, :] * sk_d, inside, eps)
        vv = tl.load(v + (bi * sv_b + t * sv_t + h * sv_h)[:, None] + d[None, :] * sv_d, mask=inside, other=0).to(tl.float32)
        if V_SILU:
            vv = vv * tl.sigmoid(vv)
        o = (r * heads + h)[:, None] * D + d[None, :]
        tl.store(q_out + o, q_unit.to(q_out.dtype.element_ty), mask=inside)
        tl.store(k_out + o, k_unit.to(k_out.dtype.element_ty), mask=inside)
        tl.store(v_out + o, vv.to(v_out.dtype.element_ty), mask=inside)
        g, beta = decay_and_beta(tl.load(a + bi * sa_b + t * sa_t + h * sa_h, mask=row_in, other=0),
                                 tl.load(b + bi * sb_b + t * sb_t + h * sb_h, mask=row_in, other=0),
                                 tl.load(A_log + h), tl.load(dt_bias + h))
        tl.store(g_out + r * heads + h, g, mask=row_in)
        tl.store(beta_out + r * heads + h, beta, mask=row_in)
        release_dependents(PDL)


class Projections(NamedTuple):
    """A GatedDeltaNet's projections as the recurrence's inputs come from them (after any short convolution),
    for a rule that may form the inputs itself (tcal.kernels.gated_delta_rule_from_projections)."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    v_silu: bool

    def prepared(self):
        """(q, k, v, g, beta) from this module's kernel."""
        return delta_inputs_triton(*self)


def kernel_takes(q, k, v, a, b) -> bool:
    """Triton imports; q, k, v [B, T, H, D] of one shape and kernel dtype, D <= MAX_HEAD_DIM; a, b [B, T, H]
    (any strides: a short convolution's output is a transposed view)."""
    if triton is None or q.dim() != 4 or q.shape[-1] > MAX_HEAD_DIM or q.dtype not in KERNEL_DTYPES:
        return False
    return (all(x.shape == q.shape and x.dtype == q.dtype for x in (k, v))
            and all(tuple(x.shape) == tuple(q.shape[:3]) for x in (a, b)))


def delta_inputs_triton(q, k, v, a, b, A_log, dt_bias, v_silu: bool):
    """The Triton kernel (inputs that kernel_takes, on CUDA; or CPU ones under TRITON_INTERPRET=1, as the
    CPU tests run it): the reference's outputs, each contiguous."""
    if not kernel_takes(q, k, v, a, b):
        raise ValueError("delta_inputs_triton takes q, k, v [B, T, H, D] of one shape and dtype and a, b [B, T, H], "
                         "with Triton installed; use delta_inputs_torch.")
    batch, length, heads, dim = q.shape
    rows = batch * length
    out = q.new_empty(3, batch, length, heads, dim)  # q, k, v: one allocation, each plane contiguous
    gb = q.new_empty(2, batch, length, heads, dtype=torch.float32)  # g, beta
    if rows:
        bd = triton.next_power_of_2(dim)
        block_t = max(1, min(32, 2048 // bd))
        _delta_inputs_kernel[(triton.cdiv(rows, block_t), heads)](
            q, k, v, a, b, A_log, dt_bias, *out, *gb, rows, length, heads,
            *q.stride(), *k.stride(), *v.stride(), *a.stride(), *b.stride(), L2NORM_EPS,
            D=dim, BD=bd, BLOCK_T=block_t, V_SILU=v_silu, num_warps=4, **pdl_launch(q.device),
        )
    return out[0], out[1], out[2], gb[0], gb[1]
