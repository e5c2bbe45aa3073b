"""A residual add and the RMSNorm that reads it, as one kernel on the fast route (reference beside it).

A pre-norm block adds each sublayer's output to the residual stream and normalises the sum for the
next sublayer: h = a + b; n = rms_norm(h) * w, with h read again by the next residual add. After
surgery.decode.fused_norms the norm is one call, so the pair is two launches and a round trip of h
through memory, twice per layer (60 of a 75% SmolLM2 hybrid's decode-step kernels). On CUDA,
`add_rms_norm` is one Triton kernel per row that writes h (rounded to its dtype, as the add does) and
the norm of that rounded h, in float32 with one rounding (as aten._fused_rms_norm); elsewhere it is
the two calls themselves, so the CPU keeps its numbers. `fuse_residual_norms` rewrites the graph's
add -> fused norm pairs (same shapes and dtype, the norm's weight that dtype or none) into it."""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from ..core.rewrite import rewrite_matches
from .fused_norms import fused_op, is_call

try:  # Triton is a CUDA-side extra: CPU installs do not have it
    import triton
    import triton.language as tl
except Exception:  # a broken install raises more than ImportError
    triton = None

aten = torch.ops.aten
MAX_WIDTH = 16384  # one program holds a row: wider rows keep the two calls


def add_rms_norm_torch(a, b, weight, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: (a + b, its fused RMSNorm), the two traced calls."""
    h = a + b
    return h, aten._fused_rms_norm(h, [h.shape[-1]], weight, eps)[0]


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(a, b, w, h_out, n_out, stride_a, stride_b, width, eps, BD: tl.constexpr,
                             HAS_W: tl.constexpr):
        """Program r: row r of h = a + b (rounded to h's dtype) and of rms_norm(h) * w."""
        r = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BD)
        inside = d < width
        x = tl.load(a + r * stride_a + d, mask=inside, other=0).to(tl.float32)
        x += tl.load(b + r * stride_b + d, mask=inside, other=0).to(tl.float32)
        h = x.to(h_out.dtype.element_ty)
        tl.store(h_out + r * width + d, h, mask=inside)
        hf = h.to(tl.float32)
        normed = hf * tl.rsqrt(tl.sum(hf * hf) / width + eps)
        if HAS_W:
            normed = normed * tl.load(w + d, mask=inside, other=0).to(tl.float32)
        tl.store(n_out + r * width + d, normed.to(n_out.dtype.element_ty), mask=inside)


def add_rms_norm_triton(a, b, weight, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel (CUDA tensors of one shape and dtype; weight [D] of that dtype, or None)."""
    if triton is None:
        raise RuntimeError("add_rms_norm_triton needs Triton; use add_rms_norm_torch.")
    width = a.shape[-1]
    ra, rb = (x.reshape(-1, width) for x in (a, b))
    ra, rb = (x if x.stride(-1) == 1 else x.contiguous() for x in (ra, rb))
    h, normed = torch.empty(a.shape, dtype=a.dtype, device=a.device), torch.empty(a.shape, dtype=a.dtype, device=a.device)
    if h.numel():
        block = triton.next_power_of_2(width)
        _add_rms_norm_kernel[(ra.shape[0],)](ra, rb, weight if weight is not None else ra, h, normed, ra.stride(0), rb.stride(0),
                                             width, float(eps), BD=block, HAS_W=weight is not None,
                                             num_warps=min(16, max(1, block // 256)))
    return h, normed


def add_rms_norm(a, b, weight, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(a + b, rms_norm(a + b) * weight): the Triton kernel on CUDA when Triton imports, else the reference."""
    if a.is_cuda and triton is not None and a.shape[-1] <= MAX_WIDTH:
        return add_rms_norm_triton(a, b, weight, eps)
    return add_rms_norm_torch(a, b, weight, eps)


def val(node):
    return node.meta.get("val") if isinstance(node, Node) else None


def residual_pair(norm: Node) -> tuple[Node, Node, Node, object, float] | None:
    """(add, a, b, weight, eps) where `norm` is _fused_rms_norm(a + b, [D], weight, eps) over the last
    dim with a, b, the sum and the weight of one dtype and a, b of the sum's shape, else None."""
    op = fused_op()
    if op is None or not is_call(norm, op.default) or len(norm.args) != 4:
        return None
    add, shape, weight, eps = norm.args
    if not is_call(add, aten.add.Tensor) or len(add.args) != 2 or add.kwargs or not isinstance(eps, float):
        return None
    a, b = add.args
    h, va, vb, vw = val(add), val(a), val(b), val(weight)
    if not all(isinstance(t, torch.Tensor) for t in (h, va, vb)) or list(shape) != [h.shape[-1]]:
        return None
    if va.shape != h.shape or vb.shape != h.shape or va.dtype != h.dtype or vb.dtype != h.dtype:
        return None
    if weight is not None and (not isinstance(vw, torch.Tensor) or vw.dtype != h.dtype) or not isinstance(h.shape[-1], int):
        return None
    return (add, a, b, weight, eps) if h.shape[-1] <= MAX_WIDTH else None


def fuse_residual_norms(gm: GraphModule, in_place: bool = False) -> tuple[GraphModule, int]:
    """A fork of `gm` (gm itself with in_place) with every add -> fused RMSNorm pair as one
    add_rms_norm call, and how many; `gm` itself (and 0) when it has none."""
    def fuse(graph, norm: Node, found) -> None:
        add, a, b, weight, eps = found
        with graph.inserting_before(add.next):  # right after the add: any earlier reader of the sum comes after h
            pair = graph.call_function(add_rms_norm, (a, b, weight, eps))
            h = graph.call_function(operator.getitem, (pair, 0))
            normed = graph.call_function(operator.getitem, (pair, 1))
        h.meta, normed.meta = dict(add.meta), dict(add.meta)
        for user in list(norm.users):  # the norm's getitem(., 0): the normalised rows
            if is_call(user, operator.getitem) and user.args[1] == 0:
                user.replace_all_uses_with(normed)
        add.replace_all_uses_with(h)  # the norm and the add are dead now

    return rewrite_matches(gm, residual_pair, fuse, in_place)
