"""The aten op sets that site discovery recognises, and small readers of the graph around them:
which parameter a node applies, constant factors and operands on a path."""
from __future__ import annotations

import operator

import torch
from torch.fx import Node

from ..core.rewrite import ancestors

aten = torch.ops.aten

SDPA_OPS = {aten.scaled_dot_product_attention.default}
SDPA_SIGNATURE = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
SOFTMAX_OPS = {aten._softmax.default, aten.softmax.int, aten._safe_softmax.default}
MATMUL_OPS = {aten.matmul.default, aten.bmm.default, aten.mm.default}
LINEAR_OPS = {aten.linear.default, aten.addmm.default, aten.matmul.default, aten.mm.default, aten.bmm.default}
TRANSPOSE_OPS = {aten.t.default, aten.transpose.int, aten.permute.default, aten.numpy_T.default}
# Ops that only move or select elements: the probe executes them on index tensors.
SHAPE_OPS = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.transpose.int,
    aten.permute.default, aten.t.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.squeeze.default, aten.expand.default, aten.slice.Tensor, aten.select.int, aten.split.Tensor,
    aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int, aten.narrow.default,
    aten.cat.default, aten.flatten.using_ints, aten.unflatten.int, aten.movedim.int,
    aten.contiguous.default, aten.clone.default, aten.alias.default, aten.repeat.default,
    aten.repeat_interleave.self_int, aten.index_select.default, aten.index.Tensor, aten.stack.default,
    aten.broadcast_to.default, operator.getitem,
}
# Casts between parameters and their use in a projection (weight.to(dtype) under autocast, say).
PASS_THROUGH_PARAM_OPS = TRANSPOSE_OPS | {aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.alias.default, aten.detach.default}


def param_names(gm: torch.fx.GraphModule) -> set[str]:
    return {name for name, _ in gm.named_parameters(remove_duplicate=False)}


def resolve_param(node, params: set[str]) -> tuple[str, bool] | None:
    """Follow transposes/casts from a node back to a parameter: (name, transposed?)."""
    flips = 0
    while isinstance(node, Node):
        if node.op == "get_attr":
            return (node.target, flips % 2 == 1) if node.target in params else None
        if node.op != "call_function" or node.target not in PASS_THROUGH_PARAM_OPS:
            return None
        if node.target in TRANSPOSE_OPS:
            flips += 1
        node = node.args[0]
    return None


def projection_parts(node: Node, params: set[str]):
    """(input, weight, bias, transposed) if `node` applies a parameter matrix, else None."""
    if node.op != "call_function" or node.target not in LINEAR_OPS:
        return None
    if node.target is aten.linear.default:
        w = resolve_param(node.args[1], params)
        if w is None:
            return None
        bias = resolve_param(node.args[2], params) if len(node.args) > 2 else None
        return node.args[0], w[0], bias[0] if bias else None, w[1]
    if node.target is aten.addmm.default:
        w = resolve_param(node.args[2], params)
        if w is None:
            return None
        bias = resolve_param(node.args[0], params)
        return node.args[1], w[0], bias[0] if bias else None, not w[1]
    w = resolve_param(node.args[1], params)  # x @ W: W stored [in, out] unless transposed on the way
    if w is None:
        return None
    return node.args[0], w[0], None, not w[1]


def projections_before(node: Node, params: set[str], boundary) -> dict[Node, tuple]:
    """The parameter projections first met on each path walking back from `node` (node -> its
    projection_parts), not past a node where boundary(n) holds, nor past placeholders and parameters."""
    found = {}

    def stop(n):
        parts = projection_parts(n, params)
        if parts is not None:
            found[n] = parts
            return True
        return n.op in ("placeholder", "get_attr") or boundary(n)

    if not stop(node):
        ancestors(node, stop=stop)
    return found


def bias_add(node: Node, params: set[str], width: int, env) -> tuple[Node, str | None]:
    """A bias added right after a bias-free matmul (Falcon's linear does this)."""
    if len(node.users) == 1:
        user = next(iter(node.users))
        if user.op == "call_function" and user.target is aten.add.Tensor:
            other = user.args[1] if user.args[0] is node else user.args[0]
            found = resolve_param(other, params)
            if found and tuple(env[other].shape) == (width,):
                return user, found[0]
    return node, None


def module_path(node: Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


def scalar(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def path_scalars(path: set[Node]) -> float:
    """Product of constant multipliers applied on a path (OPT scales Q after its projection)."""
    factor = 1.0
    for n in path:
        if n.op == "call_function" and n.target in (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar):
            s = scalar(n.args[1]) if len(n.args) > 1 else None
            if s is not None:
                factor = factor * s if n.target in (aten.mul.Tensor, aten.mul.Scalar) else factor / s
    return factor


def operands(path: set[Node], source: Node | set) -> set[Node]:
    """Inputs that enter a projection -> attention path from outside it (RoPE tables, norm weights);
    source: the projection (or the set of them, MLA's key) the path starts from."""
    sources = source if isinstance(source, set) else {source}
    return {a for n in path for a in n.all_input_nodes if a not in path and a not in sources}


def local_ancestors(a: Node) -> set[Node]:
    return ancestors(a, stop=lambda x: x.op in ("placeholder", "get_attr")) | {a}


def touches(path: set[Node], source: Node | set, targets) -> bool:
    """Does an operand of the path come from cos/sin or from positions (RoPE, table or computed)?"""
    return any(x.op == "call_function" and x.target in targets for a in operands(path, source) for x in local_ancestors(a))


def path_params(path: set[Node], source: Node | set, params: set[str]) -> list[str]:
    """Parameters applied on the path (q/k norms), also through `1 + weight` style reparametrisations."""
    names = set()
    for a in operands(path, source):
        for x in local_ancestors(a):
            p = resolve_param(x, params)
            if p:
                names.add(p[0])
    return sorted(names)


def sdpa_arguments(node: Node) -> dict:
    """An SDPA call's arguments by name, whether the graph passes them by position or keyword."""
    return dict(zip(SDPA_SIGNATURE, node.args)) | dict(node.kwargs)


def mask_mode(dtype: torch.dtype) -> str:
    """How an SDPA attn_mask of `dtype` reads: "keep" (bool, True = attend) or "additive" (float)."""
    return "keep" if dtype == torch.bool else "additive"
