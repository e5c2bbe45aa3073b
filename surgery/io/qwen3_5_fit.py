"""What a hybrid's graph says its decoder is, in the parts Qwen3.5's class is built from: the token
embedding, then per layer x + mixer(RMSNorm(x)) and x + down(silu(gate(RMSNorm(x))) * up(RMSNorm(x))),
a final RMSNorm and one linear map to the logits.

Read backwards from the logits through the graph's dataflow (no parameter names, no module paths):
each residual add is split into the stream and its branch, each branch matched against the mixer
the sites and the recipe name for that layer, or against a SwiGLU MLP. The first part that does not
match is refused with what it is instead (a LayerNorm, a GELU MLP, a post-norm, a scaled embedding)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Node

from ..errors import ExportError
from ..sites.ops import projection_parts, resolve_param, scalar
from .hf_export import passes_through

aten = torch.ops.aten
CASTS = {aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.detach.default, aten.type_as.default}
RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
ACTIVATIONS = {aten.gelu.default, aten.relu.default, aten.tanh.default, aten.sigmoid.default, aten.silu.default}
LAYER_NORMS = {aten.layer_norm.default, aten.native_layer_norm.default, aten.group_norm.default}
FIX = "Qwen3.5's class cannot hold this teacher exactly; export it with --format hf."


@dataclass
class Norm:
    """An RMSNorm: x * rsqrt(mean(x^2) + eps) * (offset + weight)."""

    weight: str
    offset: float
    eps: float
    input: Node


@dataclass
class Linear:
    weight: str
    transposed: bool   # stored [in, out]


@dataclass
class Block:
    layer: int
    input_norm: Norm
    post_norm: Norm
    gate: Linear
    up: Linear
    down: Linear


@dataclass
class Layout:
    embedding: str
    final_norm: Norm
    lm_head: Linear
    blocks: list


def refuse(reason: str) -> ExportError:
    return ExportError(f"--format qwen3_5 does not fit this hybrid: {reason}.", FIX)


def strip(node):
    """The node behind casts and eval-mode identities (float32 casts, dropout, aliases)."""
    while isinstance(node, Node) and node.op == "call_function" and (node.target in CASTS or passes_through(node)):
        node = node.args[0]
    return node


def is_op(node, *ops) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in ops


def norm_weight(arg, params: set[str]) -> tuple[str, float] | None:
    """(parameter, offset) of a norm's scale: the parameter itself, or `offset + parameter`."""
    found = resolve_param(arg, params)
    if found:
        return found[0], 0.0
    node = strip(arg)
    if is_op(node, aten.add.Tensor, aten.add.Scalar) and len(node.args) == 2:
        for p, s in (node.args, node.args[::-1]):
            found, offset = resolve_param(p, params), scalar(s)
            if found and offset is not None:
                return found[0], offset
    return None


def rms_core(arg) -> tuple[Node, float] | None:
    """(x, eps) when `arg` is x * rsqrt(mean(x^2, -1) + eps)."""
    node = strip(arg)
    if not is_op(node, aten.mul.Tensor):
        return None
    for x, r in (node.args, node.args[::-1]):
        r = strip(r)
        if not (is_op(r, aten.rsqrt.default) and is_op(strip(r.args[0]), aten.add.Tensor, aten.add.Scalar)):
            continue
        mean, eps = strip(r.args[0]).args[:2]
        mean = strip(mean)
        if not (is_op(mean, aten.mean.dim) and list(mean.args[1]) == [-1] and is_op(strip(mean.args[0]), aten.pow.Tensor_Scalar)):
            continue
        square = strip(mean.args[0])
        if square.args[1] == 2 and strip(square.args[0]) is strip(x) and scalar(eps) is not None:
            return strip(x), float(eps)
    return None


def match_rms(node, params: set[str]) -> Norm | None:
    node = strip(node)
    if is_op(node, aten.rms_norm.default) and len(node.args) > 3 and resolve_param(node.args[2], params):
        return Norm(resolve_param(node.args[2], params)[0], 0.0, float(node.args[3]), strip(node.args[0]))
    if not is_op(node, aten.mul.Tensor):
        return None
    for w, x in (node.args, node.args[::-1]):
        weight, core = norm_weight(w, params), rms_core(x)
        if weight and core:
            return Norm(weight[0], weight[1], core[1], core[0])
    return None


def rms_norm(node, params: set[str], what: str) -> Norm:
    found = match_rms(node, params)
    if found is not None:
        return found
    behind = strip(node)
    while is_op(behind, *RESHAPES):
        behind = strip(behind.args[0])
    if is_op(behind, *LAYER_NORMS):
        raise refuse(f"{what} is a LayerNorm (it subtracts the mean); Qwen3.5 has RMSNorm only")
    raise refuse(f"{what} is not an RMSNorm with a weight ('{strip(node)}')")


def linear(node, params: set[str], what: str) -> tuple[Node, Linear] | None:
    """(input, Linear) of a bias-free parameter projection, None when `node` is none."""
    parts = projection_parts(strip(node), params) if isinstance(strip(node), Node) else None
    if parts is None:
        return None
    if parts[2] is not None:
        raise refuse(f"{what} has a bias; Qwen3.5's projections have none")
    return strip(parts[0]), Linear(parts[1], parts[3])


def swiglu(node, params: set[str], layer: int) -> tuple[Node, Linear, Linear, Linear]:
    """(input, gate, up, down) of down(silu(gate(x)) * up(x))."""
    what = f"layer {layer}'s MLP"
    down = linear(node, params, what)
    product = strip(down[0]) if down else None
    if is_op(product, aten.mul.Tensor):
        for act, up in (product.args, product.args[::-1]):
            act = strip(act)
            if not is_op(act, *ACTIVATIONS):
                continue
            if act.target is not aten.silu.default:
                raise refuse(f"{what} applies {act.target}, not SiLU (Qwen3.5's MLP is SwiGLU)")
            gate, up = linear(act.args[0], params, what), linear(up, params, what)
            if gate and up and gate[0] is up[0]:
                return gate[0], gate[1], up[1], down[1]
    raise refuse(f"{what} is not SwiGLU with separate gate and up projections, down(silu(gate(x)) * up(x))")


def residual(node, branch: Node | None, layer: int, what: str) -> tuple[Node, Node]:
    """(stream, branch) of stream + branch; `branch` given: the side that is it."""
    add = strip(node)
    if not (is_op(add, aten.add.Tensor) and len(add.args) == 2 and not add.kwargs.get("alpha")):
        raise refuse(f"layer {layer}'s {what} does not enter the residual stream by a plain add (a post-norm or a scaled residual?)")
    a, b = strip(add.args[0]), strip(add.args[1])
    if branch is None:
        if any(is_op(x, aten.mul.Tensor) and any(rms_core(y) for y in x.args) for x in (a, b)):
            raise refuse(f"layer {layer}'s {what} is normed before it is added to the residual stream (a post-norm block)")
        return (a, b) if is_op(b, aten.linear.default, aten.matmul.default, aten.addmm.default, aten.mm.default) else (b, a)
    if b is branch or a is branch:
        return (a, b) if b is branch else (b, a)
    raise refuse(f"layer {layer}'s {what} is changed before it is added to the residual stream (a post-attention norm?)")


def read_layout(gm: torch.fx.GraphModule, mixers: list[tuple[Node, Node]], params: set[str]) -> Layout:
    """The decoder's parts; mixers[i] = (input, output) of layer i's attention or GDN."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    logits = out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0]
    head = linear(logits, params, "the LM head")
    if head is None:
        raise refuse("the logits are not one linear map of the final norm (a logit softcap or scale?)")
    final = rms_norm(head[0], params, "the final norm")
    stream, blocks = strip(final.input), []
    for layer in reversed(range(len(mixers))):
        mixer_in, mixer_out = mixers[layer]
        after_mixer, mlp_out = residual(stream, None, layer, "MLP output")
        mlp_in, gate, up, down = swiglu(mlp_out, params, layer)
        post = rms_norm(mlp_in, params, f"layer {layer}'s MLP norm")
        if strip(post.input) is not after_mixer:
            raise refuse(f"layer {layer}'s MLP does not read a norm of the residual stream (a parallel block?)")
        stream, _ = residual(after_mixer, strip(mixer_out), layer, "mixer output")
        pre = rms_norm(mixer_in, params, f"layer {layer}'s input norm")
        if strip(pre.input) is not stream:
            raise refuse(f"layer {layer}'s mixer does not read a norm of the residual stream")
        blocks.append(Block(layer, pre, post, gate, up, down))
    if not (is_op(stream, aten.embedding.default) and resolve_param(stream.args[0], params)):
        raise refuse(f"the residual stream starts at '{stream}', not at the token embedding (a scaled embedding or position embeddings?)")
    return Layout(resolve_param(stream.args[0], params)[0], final, head[1], blocks[::-1])


def norm_of(gm: torch.fx.GraphModule, param: str, params: set[str]) -> Norm | None:
    """The RMSNorm whose weight is `param` (a q/k norm the site names), found from its users."""
    node = next((n for n in gm.graph.nodes if n.op == "get_attr" and n.target == param), None)
    near = [u for u in node.users] + [w for u in node.users for w in u.users] if node is not None else []
    return next((norm for n in near if (norm := match_rms(n, params)) is not None and norm.weight == param), None)
