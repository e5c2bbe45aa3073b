"""A recurrent layer's gated output norm, RMSNorm(x) * weight * act(gate) per head, as one kernel on
CUDA that reads the gate through its strides (issue 29), with its reference beside it.

Why: the gate is a slice of the layer's one fused input projection (tcal.gdn._input_projections), so
fla's FusedRMSNormGated, whose input guard wants contiguous tensors, copied it first: a [T, H * D]
copy in every GDN layer of every prefill (22 of the ~60 copies a 75% hybrid's 32k forward showed on
the H200). `gated_rms_norm_triton` is one launch with the same float32 math and one rounding as fla's
kernel. No backward: tcal.gdn.GatedRMSNorm takes it only where no gradient is needed and keeps fla's
kernel (which has one) for training.

Shapes: x, gate [B, T, H, D] (any strides); weight [D]. The output is x's dtype, contiguous.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from .pdl import pdl_launch

try:  # Triton is a CUDA-side extra: CPU installs do not have it
    import triton
    import triton.language as tl
except Exception:  # a broken install raises more than ImportError
    triton = None

MAX_WIDTH = 1024  # a program holds rows of one head: wider heads keep fla's kernel
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ACTIVATIONS = {"silu": F.silu, "sigmoid": torch.sigmoid}  # "sigmoid": Kimi Linear's gated norm


class OutputNorm(NamedTuple):
    """A layer's gated output norm handed to the rule that computes its input (tcal.kernels.gated_delta_rule's
    output_norm): RMSNorm(o) * weight * act(gate) per head of o [B, T, H, D], o rounded to its dtype first. A
    kernel that holds whole heads applies it in its epilogue (tcal.chunk_states' output: one launch and one
    round trip of o less a GDN layer); every other path calls `apply(o)`, the layer's own norm."""
    gate: torch.Tensor
    weight: torch.Tensor
    eps: float
    activation: str
    apply: Callable[[torch.Tensor], torch.Tensor]


def normed(o: torch.Tensor, output_norm: OutputNorm | None) -> torch.Tensor:
    """o through a rule's output norm where one was handed in (the paths that cannot fold it), else o."""
    return o if output_norm is None else output_norm.apply(o)


def gated_rms_norm_torch(x, gate, weight, eps: float, activation: str = "silu") -> torch.Tensor:
    """The reference: in float32 (float64 for float64 x), one rounding to x's dtype."""
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(cdt)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.to(cdt) * ACTIVATIONS[activation](gate.to(cdt))).to(x.dtype).contiguous()


if triton is not None:
    from .pdl import release_dependents, wait_for_inputs

    @triton.jit
    def _gated_rms_norm_kernel(x, gate, weight, out, rows, length, heads, sx_b, sx_t, sx_h, sx_d,
                               sg_b, sg_t, sg_h, sg_d, eps, D: tl.constexpr, BD: tl.constexpr,
                               BLOCK_R: tl.constexpr, SIGMOID: tl.constexpr, PDL: tl.constexpr = False):
        """Program i: rows [i * BLOCK_R, (i + 1) * BLOCK_R) of the flattened [B * T * H] heads."""
        wait_for_inputs(PDL)
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        d = tl.arange(0, BD)
        inside = (r < rows)[:, None] & (d < D)[None, :]
        h, t, b = r % heads, (r // heads) % length, r // (heads * length)
        xv = tl.load(x + (b * sx_b + t * sx_t + h * sx_h)[:, None] + d[None, :] * sx_d, mask=inside, other=0).to(tl.float32)
        gv = tl.load(gate + (b * sg_b + t * sg_t + h * sg_h)[:, None] + d[None, :] * sg_d, mask=inside, other=0).to(tl.float32)
        rstd = 1 / tl.sqrt(tl.sum(xv * xv, 1) / D + eps)
        w = tl.load(weight + d, mask=d < D, other=0).to(tl.float32)
        if SIGMOID:  # Kimi Linear's gate
            act = tl.sigmoid(gv)
        else:
            act = gv * tl.sigmoid(gv)
        y = xv * rstd[:, None] * w[None, :] * act
        tl.store(out + r[:, None] * D + d[None, :], y.to(out.dtype.element_ty), mask=inside)
        release_dependents(PDL)


def kernel_takes(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, activation: str) -> bool:
    """Triton imports; x and gate [B, T, H, D] of one shape and kernel dtype, D <= MAX_WIDTH, weight [D]."""
    return (triton is not None and x.dim() == 4 and gate.shape == x.shape and x.dtype in KERNEL_DTYPES
            and gate.dtype == x.dtype and x.shape[-1] <= MAX_WIDTH and tuple(weight.shape) == (x.shape[-1],)
            and activation in ACTIVATIONS)


def gated_rms_norm_triton(x, gate, weight, eps: float, activation: str = "silu") -> torch.Tensor:
    """The Triton kernel (inputs that kernel_takes, on CUDA; or CPU ones under TRITON_INTERPRET=1)."""
    if not kernel_takes(x, gate, weight, activation):
        raise ValueError("gated_rms_norm_triton takes x and gate [B, T, H, D] of one shape and dtype, weight [D], "
                         f"activation one of {sorted(ACTIVATIONS)}, with Triton installed; use gated_rms_norm_torch.")
    batch, length, heads, dim = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = batch * length * heads
    if rows:
        bd = triton.next_power_of_2(dim)
        block_r = max(1, min(32, 2048 // bd))
        _gated_rms_norm_kernel[(triton.cdiv(rows, block_r),)](
            x, gate, weight, out, rows, length, heads, *x.stride(), *gate.stride(), float(eps),
            D=dim, BD=bd, BLOCK_R=block_r, SIGMOID=activation == "sigmoid", num_warps=4,
            **pdl_launch(x.device),
        )
    return out
