"""Rotary position embedding as one kernel on the fast route (with its reference beside it).

transformers applies RoPE as x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1) of x's two
halves: five launches per tensor (neg, cat, two products, the sum), twice per kept attention layer, a
fifth of a 75% hybrid's decode-step kernels after the other fusions. On CUDA, `rope` is one Triton
kernel over (batch, head) rows, a block of positions a program, that computes both halves in float32 and rounds once (the traced
form rounds after each product and after the sum); elsewhere, or for inputs it does not take, it is
the traced arithmetic itself. `fuse_rope` rewrites the graph's rotate-half pattern (a tensor's two
halves by slices of its last dim, the first negated second) into `rope` calls."""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from ..core.rewrite import call_in_place_of, rewrite_matches
from .fused_norms import is_call

try:  # Triton is a CUDA-side extra: CPU installs do not have it
    import triton
    import triton.language as tl
except Exception:  # a broken install raises more than ImportError
    triton = None

aten = torch.ops.aten
# Positions a program of a prompt's RoPE covers. One a program (with one warp) made 18k programs of 32 columns for a
# 2k prompt's q at SmolLM2's shapes: 8.9 us a call, 0.142 ms of a 75% hybrid's 2k prefill (thirty-fourth session).
PREFILL_ROWS = 32


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The reference: the traced arithmetic, x * cos + cat(-x2, x1) * sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


if triton is not None:

    @triton.jit
    def _rope_kernel(x, cos, sin, out, heads, length, sxb, sxh, sxt, scb, sct, ssb, sst, sob, soh, sot,
                     HALF: tl.constexpr, BH: tl.constexpr, ROWS: tl.constexpr):
        """Program (i, bh): rows t = i*ROWS .. i*ROWS+ROWS-1 of head (b, h) of out = x * cos + rotate_half(x) * sin;
        cos and sin [B or 1, 1, T, D]."""
        bh = tl.program_id(1).to(tl.int64)
        h = bh % heads
        b = bh // heads
        t = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        d = tl.arange(0, BH)
        inside = (t[:, None] < length) & (d[None, :] < HALF)
        xr = x + b * sxb + h * sxh + t[:, None] * sxt + d[None, :]
        x1 = tl.load(xr, mask=inside, other=0).to(tl.float32)
        x2 = tl.load(xr + HALF, mask=inside, other=0).to(tl.float32)
        cr = cos + b * scb + t[:, None] * sct + d[None, :]
        sr = sin + b * ssb + t[:, None] * sst + d[None, :]
        c1 = tl.load(cr, mask=inside, other=0).to(tl.float32)
        c2 = tl.load(cr + HALF, mask=inside, other=0).to(tl.float32)
        s1 = tl.load(sr, mask=inside, other=0).to(tl.float32)
        s2 = tl.load(sr + HALF, mask=inside, other=0).to(tl.float32)
        orow = out + b * sob + h * soh + t[:, None] * sot + d[None, :]
        tl.store(orow, (x1 * c1 - x2 * s1).to(out.dtype.element_ty), mask=inside)
        tl.store(orow + HALF, (x2 * c2 + x1 * s2).to(out.dtype.element_ty), mask=inside)


def kernel_takes(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """x [B, H, T, D] (even D, unit last stride), cos and sin [B or 1, 1, T, D] of x's dtype (unit last stride)."""
    if x.dim() != 4 or x.shape[-1] % 2 or x.stride(-1) != 1:
        return False
    batch, _, length, width = x.shape
    return all(t.dim() == 4 and t.shape[1] == 1 and t.shape[0] in (1, batch) and tuple(t.shape[2:]) == (length, width)
               and t.stride(-1) == 1 and t.dtype == x.dtype for t in (cos, sin))


def rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The Triton kernel (CUDA tensors that kernel_takes); the output has x's layout, as the traced form's."""
    if triton is None:
        raise RuntimeError("rope_triton needs Triton; use rope_torch.")
    batch, heads, length, width = x.shape
    out = torch.empty_like(x)
    if out.numel():
        cb, sb = (0 if t.shape[0] == 1 else t.stride(0) for t in (cos, sin))
        rows = 1 if length == 1 else PREFILL_ROWS  # a decoded token's row alone; a prompt's in blocks
        _rope_kernel[(triton.cdiv(length, rows), batch * heads)](
            x, cos, sin, out, heads, length, x.stride(0), x.stride(1), x.stride(2), cb, cos.stride(2), sb, sin.stride(2),
            out.stride(0), out.stride(1), out.stride(2), HALF=width // 2, BH=triton.next_power_of_2(width // 2), ROWS=rows,
            num_warps=1 if rows == 1 else 4)
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin: the Triton kernel on CUDA where it takes the inputs, else the reference."""
    if x.is_cuda and triton is not None and kernel_takes(x, cos, sin):
        return rope_triton(x, cos, sin)
    return rope_torch(x, cos, sin)


def half_slice(node, x: Node, first: bool) -> bool:
    """node is x[..., :D/2] (first) or x[..., D/2:] along x's last dim."""
    if not is_call(node, aten.slice.Tensor) or node.args[0] is not x:
        return False
    val = x.meta.get("val")
    if not isinstance(val, torch.Tensor) or not isinstance(val.shape[-1], int) or val.shape[-1] % 2:
        return False
    dim, start, end = (list(node.args[1:]) + [0, None, None])[:3]
    width, half = val.shape[-1], val.shape[-1] // 2
    if dim not in (-1, val.dim() - 1):
        return False
    return (start in (0, None) and end == half) if first else (start == half and (end is None or end >= width))


def rotated(node) -> Node | None:
    """x where node is cat([-x[..., D/2:], x[..., :D/2]], -1), else None."""
    if not is_call(node, aten.cat.default) or len(node.args[0]) != 2:
        return None
    (neg, first), dim = node.args[0], (node.args[1] if len(node.args) > 1 else 0)
    if not is_call(neg, aten.neg.default) or not isinstance(first, Node) or not is_call(first, aten.slice.Tensor):
        return None
    x = first.args[0]
    val = x.meta.get("val") if isinstance(x, Node) else None
    if not isinstance(val, torch.Tensor) or dim not in (-1, val.dim() - 1):
        return None
    return x if half_slice(first, x, True) and half_slice(neg.args[0], x, False) else None


def other(mul: Node, node: Node):
    return mul.args[1] if mul.args[0] is node else mul.args[0]


def rope_pattern(add: Node) -> tuple[Node, Node, Node] | None:
    """(x, cos, sin) where `add` is x * cos + rotate_half(x) * sin (products in either order), else None."""
    if not is_call(add, aten.add.Tensor) or len(add.args) != 2 or add.kwargs:
        return None
    for a, b in (add.args, add.args[::-1]):
        if not (is_call(a, aten.mul.Tensor) and is_call(b, aten.mul.Tensor)):
            continue
        for r in b.args:
            x = rotated(r) if isinstance(r, Node) else None
            if x is not None and x in a.args and len(r.users) == 1 and len(b.users) == 1 and len(a.users) == 1:
                cos, sin = other(a, x), other(b, r)
                if isinstance(cos, Node) and isinstance(sin, Node):
                    return x, cos, sin
    return None


def fuse_rope(gm: GraphModule, in_place: bool = False) -> tuple[GraphModule, int]:
    """A fork of `gm` (gm itself with in_place) with every rotate-half RoPE as one rope call, and how
    many; `gm` itself (and 0) when it has none."""
    return rewrite_matches(gm, rope_pattern, lambda graph, add, found: call_in_place_of(add, rope, found), in_place)

