"""RMSNorm's traced arithmetic as one kernel (aten._fused_rms_norm) on the fast route.

torch.export traces an RMSNorm as x.float() -> x^2 -> mean over the last dim -> + eps -> rsqrt ->
x * rsqrt(...) (then a cast and the weight): each step a launch over the whole activation, 61 norms
in SmolLM2's forward. On the H200 the 75% GDN hybrid's eager forward at 32k tokens spent about 27 of
its 81 ms in unfused elementwise and reduction kernels, which is most of what compiling removes
(bench/RESULTS.md, sixteenth session). Here the core, x * rsqrt(mean(x^2, -1) + eps) on a float32 x,
becomes one fused call on the same input: the same arithmetic up to the order of the sum.

Where the norm is Llama's whole form, w * (x.float() * rsqrt(...)).to(dtype) with w a [D] parameter of
that dtype (Llama, Qwen, Mistral, SmolLM2, Phi-3, OLMo2, ...), the casts and the weight go into the same
call: _fused_rms_norm(x, [D], w, eps) computes in float32 and rounds once where the traced form rounds
twice, so it is nearer float32 (bf16: max error 0.015 against the traced form's 0.025 on a [4, 7, 576]
check), and a norm is one kernel instead of eight (of ~970 in a 75% hybrid's decode step). Other forms
(Gemma's x * (1 + w) in float32) keep their cast and weight as traced. A graph without the pattern, or
a torch without the op, is left as it is."""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from ..core.rewrite import call_in_place_of, rewrite_matches

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


def single_user(node: Node):
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def cast_to(node, dtype) -> bool:
    """node is x.to(dtype) (aten.to.dtype, as torch.export traces .float() and .to(dtype))."""
    return is_call(node, aten.to.dtype) and len(node.args) >= 2 and node.args[1] == dtype and not node.kwargs


def weighted_form(core: Node, x: Node) -> tuple[Node, Node, Node] | None:
    """(source, weight, the weight's product) where `core` (the fused core's output) is followed by
    .to(dtype) and a product with a [D] parameter of that dtype, and x is source.float() (or source
    itself, already float32): the whole norm is then one fused call on source. Else None."""
    cast = single_user(core)
    if cast is None or not is_call(cast, aten.to.dtype) or len(cast.args) < 2 or cast.kwargs:
        return None
    dtype, product = cast.args[1], single_user(cast)
    if not is_call(product, aten.mul.Tensor) or len(product.args) != 2:
        return None
    weight = product.args[0] if product.args[1] is cast else product.args[1]
    val = weight.meta.get("val") if isinstance(weight, Node) else None
    width = core.meta["val"].shape[-1]
    if not isinstance(val, torch.Tensor) or weight.op != "get_attr" or val.dtype != dtype or tuple(val.shape) != (width,):
        return None
    source = x.args[0] if cast_to(x, torch.float32) else x
    src_val = source.meta.get("val") if isinstance(source, Node) else None
    if not isinstance(src_val, torch.Tensor) or src_val.dtype != dtype:
        return None
    return source, weight, product


def fuse_rms_norms(gm: GraphModule, in_place: bool = False) -> tuple[GraphModule, int]:
    """A fork of `gm` (gm itself with in_place) with every RMSNorm core as one fused_rms_norm call,
    and how many; `gm` itself (and 0) when there is none or this torch lacks the op."""
    op = fused_op()
    if op is None:
        return gm, 0

    def fuse(graph, mul: Node, found) -> None:
        x, eps = found
        whole = weighted_form(mul, x)
        source, weight, last = whole if whole is not None else (x, None, mul)
        with graph.inserting_before(last):
            fused = graph.call_function(op.default, (source, [x.meta["val"].shape[-1]], weight, eps))
        call_in_place_of(last, operator.getitem, (fused, 0))  # the whole form's cast and core are dead now

    return rewrite_matches(gm, rms_core, fuse, in_place)

