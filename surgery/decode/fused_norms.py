"""RMSNorm's traced arithmetic as one kernel (aten._fused_rms_norm) on the fast route.

torch.export traces an RMSNorm as x.float() -> x^2 -> mean over the last dim -> + eps -> rsqrt ->
x * rsqrt(...) (then a cast and the weight): each step a launch over the whole activation, 61 norms
in SmolLM2's forward. On the H200 the 75% GDN hybrid's eager forward at 32k tokens spent about 27 of
its 81 ms in unfused elementwise and reduction kernels, which is most of what compiling removes
(bench/RESULTS.md, sixteenth session). Here the core, x * rsqrt(mean(x^2, -1) + eps) on a float32 x,
becomes one fused call on the same input: the same arithmetic up to the order of the sum. The cast
and the weight stay as traced, since families differ there (Llama's w * x.to(dtype), Gemma's
x * (1 + w)). A graph without the pattern, or a torch without the op, is left as it is."""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from ..core.rewrite import fork

aten = torch.ops.aten


def fused_op():
    """torch's fused RMSNorm, or None where this torch has none."""
    return getattr(aten, "_fused_rms_norm", None)


def is_call(node, target) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target is target


def last_dim_mean(node) -> bool:
    """mean(x, [-1], keepdim=True) (or the last dim named by its index), no dtype change."""
    if not is_call(node, aten.mean.dim) or node.kwargs.get("dtype") is not None:
        return False
    dims, keepdim = node.args[1], (node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
    rank = node.args[0].meta["val"].dim() if "val" in node.args[0].meta else None
    return keepdim is True and list(dims) in ([-1], [rank - 1] if rank else [-1])


def rms_core(mul: Node) -> tuple[Node, float] | None:
    """(x, eps) where `mul` is x * rsqrt(mean(x^2, -1, keepdim) + eps) with x float32, else None."""
    if not is_call(mul, aten.mul.Tensor) or len(mul.args) != 2:
        return None
    for x, r in (mul.args, mul.args[::-1]):
        if not is_call(r, aten.rsqrt.default) or not is_call(r.args[0], aten.add.Tensor):
            continue
        add = r.args[0]
        mean, eps = add.args
        if not isinstance(eps, (int, float)) or not last_dim_mean(mean):
            continue
        square = mean.args[0]
        if is_call(square, aten.pow.Tensor_Scalar) and square.args[0] is x and square.args[1] == 2:
            val = x.meta.get("val") if isinstance(x, Node) else None
            if isinstance(val, torch.Tensor) and val.dtype == torch.float32 and isinstance(val.shape[-1], int):
                return x, float(eps)
    return None


def fuse_rms_norms(gm: GraphModule, in_place: bool = False) -> tuple[GraphModule, int]:
    """A fork of `gm` (gm itself with in_place) with every RMSNorm core as one fused_rms_norm call,
    and how many; `gm` itself (and 0) when there is none or this torch lacks the op."""
    op = fused_op()
    if op is None or not any(rms_core(n) for n in gm.graph.nodes):
        return gm, 0
    forked = gm if in_place else fork(gm)
    graph, count = forked.graph, 0
    for mul in list(graph.nodes):
        found = rms_core(mul)
        if found is None:
            continue
        x, eps = found
        with graph.inserting_before(mul):
            fused = graph.call_function(op.default, (x, [x.meta["val"].shape[-1]], None, eps))
            out = graph.call_function(operator.getitem, (fused, 0))
        out.meta = dict(mul.meta)
        mul.replace_all_uses_with(out)
        graph.erase_node(mul)
        count += 1
    graph.eliminate_dead_code()
    forked.recompile()
    return forked, count

