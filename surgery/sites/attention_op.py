"""The attention op of each layer: aten.scaled_dot_product_attention, or the eager region
softmax(Q K^T * scale + mask) @ V with its casts, dropout, softcapping and bmm decompositions."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.fx import Node

from ..core.rewrite import ancestors, descendants
from ..errors import SiteError
from .ops import MATMUL_OPS, SDPA_OPS, SHAPE_OPS, SOFTMAX_OPS, path_scalars, sdpa_arguments
from .probe import ValueRun

aten = torch.ops.aten


@dataclass
class AttentionOp:
    """The attention op and the head tensors around it."""

    kind: str
    attn: Node
    q: Node
    k: Node
    v: Node
    k_transposed: bool = False
    probs: Node | None = None
    logits_path: set = field(default_factory=set)
    mask: Node | None = None
    scale: float | None = None
    causal_flag: bool = False
    gqa: bool = False
    scores: Node | None = None      # eager form: the Q.K^T matmul (or baddbmm) before the softmax


def to_4d(node: Node, run: ValueRun, up: bool) -> Node:
    """Walk through shape ops (inputs if up, single users otherwise) to the nearest 4-D tensor."""
    while len(run.shape(node)) != 4:
        if up:
            nxt = node.args[0] if node.op == "call_function" and node.target in SHAPE_OPS else None
        else:
            users = [u for u in node.users if u.op == "call_function" and u.target in SHAPE_OPS]
            nxt = users[0] if len(users) == 1 else None
        if not isinstance(nxt, Node):
            raise SiteError(f"Cannot find the head layout around node '{node.name}'.", "This attention layout is not supported yet.")
        node = nxt
    return node


def find_attention_ops(gm: torch.fx.GraphModule, run: ValueRun) -> list[AttentionOp]:
    cores = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target in SDPA_OPS:
            a = sdpa_arguments(n)
            mask = a.get("attn_mask")
            cores.append(AttentionOp("sdpa", n, a["query"], a["key"], a["value"], mask=mask if isinstance(mask, Node) else None,
                               scale=a.get("scale"), causal_flag=bool(a.get("is_causal")), gqa=bool(a.get("enable_gqa"))))
        elif n.target in SOFTMAX_OPS:
            core = eager_op(n, run)
            if core is not None:
                cores.append(core)
    return cores


def eager_op(softmax: Node, run: ValueRun) -> AttentionOp | None:
    """softmax(Q K^T * s + mask) @ V, possibly with casts, dropout, softcapping and bmm decompositions."""
    node, out = softmax, None
    for _ in range(6):  # probabilities -> (cast, dropout, expand, view) -> matmul with V
        users = [u for u in node.users if u.target is not aten._assert_tensor_metadata.default]
        mm = [u for u in users if u.op == "call_function" and u.target in MATMUL_OPS and u.args[0] is node]
        if mm:
            out = mm[0]
            break
        if len(users) != 1:
            return None
        node = users[0]
    if out is None:
        return None
    is_mm = lambda x: x.op == "call_function" and (x.target in MATMUL_OPS or x.target is aten.baddbmm.default)  # noqa: E731
    found = [a for a in ancestors(softmax, stop=is_mm) if is_mm(a) and len(run.shape(a)) >= 3]
    if len(found) != 1:
        return None
    logits_mm = found[0]
    # baddbmm(bias, Q, K^T, alpha=scale) adds a bias (BLOOM's ALiBi) and scales in one op
    first = 1 if logits_mm.target is aten.baddbmm.default else 0
    alpha = float(logits_mm.kwargs.get("alpha", 1.0)) if first else 1.0
    q = to_4d(logits_mm.args[first], run, up=True)
    kt = to_4d(logits_mm.args[first + 1], run, up=True)
    v = to_4d(out.args[1], run, up=True)
    attn_out = to_4d(out, run, up=False)
    t_q, d = run.shape(q)[-2:]
    k_transposed = run.shape(kt)[-2:] == (d, run.shape(kt)[-1]) and run.shape(kt)[-1] != d
    path = descendants(logits_mm) & ancestors(softmax)
    return AttentionOp("eager", attn_out, q, kt, v, k_transposed=k_transposed, probs=softmax, logits_path=path, scale=alpha,
                       scores=logits_mm)


def softcap_and_scale(core: AttentionOp) -> tuple[float | None, float]:
    """Eager form: constant scale before the softmax, and tanh softcapping if present."""
    tanh = [n for n in core.logits_path if n.target is aten.tanh.default]
    if not tanh:
        return None, path_scalars(core.logits_path)
    after = descendants(tanh[0]) & core.logits_path
    before = core.logits_path - after - {tanh[0]}
    cap = path_scalars(after)
    return cap, path_scalars(before) * cap


def op_scale(core: AttentionOp, head_dim: int) -> float:
    """The factor the op itself applies to Q.K: SDPA's scale argument (else d**-0.5); eager, the
    constant factors between the score matmul and the softmax times the matmul's alpha. Unlike a
    site's `scale`, it leaves out factors applied to Q or K before the op."""
    if core.kind == "sdpa":
        return float(core.scale) if core.scale is not None else head_dim ** -0.5
    _, scale = softcap_and_scale(core)
    scale *= core.scale or 1.0
    return float(scale)
