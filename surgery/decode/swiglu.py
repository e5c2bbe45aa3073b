"""SwiGLU's product, silu(gate) * up, as one kernel on the fast route (with its reference beside it).

The traced MLP of the Llama family runs silu(gate) and then the product: two launches and an
intermediate over the [tokens, intermediate] activation, in every layer. On CUDA, `silu_mul` is one
Triton kernel that reads both inputs once, computes in float32 and rounds once (the traced form rounds
after the SiLU and again after the product, so the kernel is nearer float32); elsewhere it is the
traced arithmetic itself, so the CPU keeps its numbers. `fuse_swiglu` rewrites a graph's
silu(a) * b pairs (same shape and dtype, the SiLU used only there) into `silu_mul` calls."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from ..core.rewrite import call_in_place_of, rewrite_matches

try:  # Triton is a CUDA-side extra: CPU installs do not have it
    import triton
    import triton.language as tl
except Exception:  # a broken install raises more than ImportError
    triton = None

aten = torch.ops.aten
BLOCK = 1024  # elements per program: a plain streaming kernel, no autotuning (so no cold-start cost)


def silu_mul_torch(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The reference: the traced arithmetic, F.silu(a) * b."""
    return F.silu(a) * b


if triton is not None:

    @triton.jit
    def _silu_mul_kernel(a, b, out, n, width, stride_a, stride_b, BLOCK: tl.constexpr):
        """Program i: elements [i * BLOCK, (i + 1) * BLOCK) of the [rows, width] output, read through
        each input's row stride (a slice of a fused gate-and-up projection stays a view)."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        row, col = offs // width, offs % width
        x = tl.load(a + row * stride_a + col, mask=inside, other=0).to(tl.float32)
        y = tl.load(b + row * stride_b + col, mask=inside, other=0).to(tl.float32)
        tl.store(out + offs, (x * tl.sigmoid(x) * y).to(out.dtype.element_ty), mask=inside)


def rows_of(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, width] with unit last stride (a view where it can be)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def silu_mul_triton(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The Triton kernel (CUDA tensors of one shape and dtype)."""
    if triton is None:
        raise RuntimeError("silu_mul_triton needs Triton; use silu_mul_torch.")
    ra, rb = rows_of(a), rows_of(b)
    out = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    n = out.numel()
    if n:
        _silu_mul_kernel[(triton.cdiv(n, BLOCK),)](ra, rb, out, n, a.shape[-1], ra.stride(0), rb.stride(0), BLOCK=BLOCK,
                                                   num_warps=4)
    return out


def silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu(a) * b: the Triton kernel on CUDA (when Triton imports), else the reference."""
    if a.is_cuda and triton is not None and a.shape == b.shape and a.dtype == b.dtype and a.dim() >= 1:
        return silu_mul_triton(a, b)
    return silu_mul_torch(a, b)


def same_shape_and_dtype(x, y) -> bool:
    """Whether the traced values agree, where both are known; nodes a rewrite added carry none, and
    then silu_mul itself checks at run time (anything but equal shapes and dtypes takes the reference)."""
    vx, vy = (n.meta.get("val") if isinstance(n, Node) else None for n in (x, y))
    if not (isinstance(vx, torch.Tensor) and isinstance(vy, torch.Tensor)):
        return True
    return vx.shape == vy.shape and vx.dtype == vy.dtype


def swiglu_pair(mul: Node) -> tuple[Node, Node] | None:
    """(a, b) where `mul` is silu(a) * b (either order) and the SiLU has no other user, else None."""
    if not (mul.op == "call_function" and mul.target is aten.mul.Tensor and len(mul.args) == 2 and not mul.kwargs):
        return None
    for s, other in (mul.args, mul.args[::-1]):
        if isinstance(s, Node) and s.op == "call_function" and s.target is aten.silu.default and len(s.users) == 1 \
                and isinstance(other, Node) and same_shape_and_dtype(s.args[0], other) and same_shape_and_dtype(s, mul):
            return s.args[0], other
    return None


def fuse_swiglu(gm: GraphModule, in_place: bool = False) -> tuple[GraphModule, int]:
    """A fork of `gm` (gm itself with in_place) with every silu(a) * b as one silu_mul call, and how
    many; `gm` itself (and 0) when it has none."""
    return rewrite_matches(gm, swiglu_pair, lambda graph, mul, pair: call_in_place_of(mul, silu_mul, pair), in_place)
