"""Attention-site discovery from the captured graph alone (no model_type, no module paths).

An attention site is found from its core op: aten.scaled_dot_product_attention, or the eager form
softmax(Q K^T ...) V. From there the graph is walked back to the parameter projections that make
Q, K and V and forward to the projection that consumes the context. Which output rows of a (possibly
fused) projection feed which head is read with an *index probe*: the projection's output is replaced
by its own feature indices and pushed through the shape ops (view, transpose, split, slice, expand,
...) up to the attention op, while value-changing ops on the way (RoPE, q/k norms, casts) pass the
indices of their main input through. That handles split Q/K/V, GPT-2's fused Conv1D, Phi-3's sliced
qkv_proj, GPT-NeoX/Falcon's interleaved layouts and GQA's repeat_kv with one mechanism.
"""
from __future__ import annotations

import operator
from dataclasses import asdict, dataclass, field

import torch
from torch.fx import Node
from torch.fx.node import map_arg

from .capture import placeholder_values
from .errors import NoAttentionError, SiteError

aten = torch.ops.aten

SDPA_OPS = {aten.scaled_dot_product_attention.default}
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


@dataclass
class Projection:
    """Where a linear map lives: its parameters and, per head, the output rows (or input columns) it uses."""

    weight: str
    bias: str | None
    transposed: bool          # stored [in, out] (GPT-2's Conv1D) rather than nn.Linear's [out, in]
    heads: list               # heads[h][d] = output row (for q/k/v) or input column (for o) of the weight
    node: str                 # the graph node that applies it

    def rows(self, heads: list[int] | None = None) -> list[int]:
        picked = self.heads if heads is None else [self.heads[h] for h in heads]
        return [r for head in picked for r in head]

    def out_matrix(self, params: dict, heads: list[int] | None = None):
        """[len(rows), in] weight rows and the matching bias entries, for q/k/v projections."""
        w = params[self.weight]
        w = w.t() if self.transposed else w
        index = torch.tensor(self.rows(heads), device=w.device)
        bias = params[self.bias].index_select(0, index) if self.bias else None
        return w.index_select(0, index), bias

    def in_matrix(self, params: dict):
        """[out, H*D] weight columns ordered by (head, dim), and the bias, for the output projection."""
        w = params[self.weight]
        w = w.t() if self.transposed else w
        index = torch.tensor(self.rows(), device=w.device)
        return w.index_select(1, index), (params[self.bias] if self.bias else None)



@dataclass
class AttentionSite:
    """One softmax-attention layer as the graph shows it."""

    layer: int
    module_path: str
    kind: str                 # "sdpa" or "eager"
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    scale: float
    q: Projection
    k: Projection
    v: Projection
    o: Projection
    kv_map: list              # kv_map[h] = KV head that query head h reads
    rope: bool
    q_norm: list = field(default_factory=list)   # parameters applied to Q between projection and attention
    k_norm: list = field(default_factory=list)
    softcap: float | None = None
    causal: bool = True
    input_node: str = ""      # hidden states entering the Q/K/V projections [B, T, hidden]
    output_node: str = ""     # the output projection's result [B, T, hidden]
    attn_node: str = ""       # the attention op (SDPA, or the probabilities @ V matmul)
    q_node: str = ""          # Q, K, V as the attention op receives them [B, H, T, D]
    k_node: str = ""
    v_node: str = ""
    probs_node: str | None = None   # eager form: the softmax output [B, H, T, T]
    mask_node: str | None = None

    @property
    def fused_qkv(self) -> bool:
        return self.q.weight == self.k.weight or self.k.weight == self.v.weight

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "AttentionSite":
        d = dict(d)
        for key in ("q", "k", "v", "o"):
            d[key] = Projection(**d[key])
        return cls(**d)

    def summary(self) -> dict:
        """The row of `surgery inspect`."""
        return {
            "layer": self.layer, "path": self.module_path, "kind": self.kind, "heads": self.num_heads,
            "kv_heads": self.num_kv_heads, "head_dim": self.head_dim, "fused_qkv": self.fused_qkv,
            "qkv_bias": bool(self.q.bias or self.k.bias or self.v.bias), "rope": self.rope,
            "qk_norm": bool(self.q_norm or self.k_norm), "softcap": self.softcap, "scale": self.scale,
        }


# ----------------------------------------------------------------------------------------------
# graph helpers


def _params(gm: torch.fx.GraphModule) -> set[str]:
    return {name for name, _ in gm.named_parameters(remove_duplicate=False)}


def _resolve_param(node, params: set[str]) -> tuple[str, bool] | None:
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


def _projection_parts(node: Node, params: set[str]):
    """(input, weight, bias, transposed) if `node` applies a parameter matrix, else None."""
    if node.op != "call_function" or node.target not in LINEAR_OPS:
        return None
    if node.target is aten.linear.default:
        w = _resolve_param(node.args[1], params)
        if w is None:
            return None
        bias = _resolve_param(node.args[2], params) if len(node.args) > 2 else None
        return node.args[0], w[0], bias[0] if bias else None, w[1]
    if node.target is aten.addmm.default:
        w = _resolve_param(node.args[2], params)
        if w is None:
            return None
        bias = _resolve_param(node.args[0], params)
        return node.args[1], w[0], bias[0] if bias else None, not w[1]
    w = _resolve_param(node.args[1], params)  # x @ W: W stored [in, out] unless transposed on the way
    if w is None:
        return None
    return node.args[0], w[0], None, not w[1]


def _bias_add(node: Node, params: set[str], width: int, env) -> tuple[Node, str | None]:
    """A bias added right after a bias-free matmul (Falcon's linear does this)."""
    if len(node.users) == 1:
        user = next(iter(node.users))
        if user.op == "call_function" and user.target is aten.add.Tensor:
            other = user.args[1] if user.args[0] is node else user.args[0]
            found = _resolve_param(other, params)
            if found and tuple(env[other].shape) == (width,):
                return user, found[0]
    return node, None


def ancestors(node: Node, stop=lambda n: False) -> set[Node]:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        for i in n.all_input_nodes:
            if i not in seen:
                seen.add(i)
                if not stop(i):
                    todo.append(i)
    return seen


def descendants(node: Node) -> set[Node]:
    seen, todo = set(), [node]
    while todo:
        for u in todo.pop().users:
            if u not in seen:
                seen.add(u)
                todo.append(u)
    return seen


def _module_path(node: Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


def _scalar(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


# ----------------------------------------------------------------------------------------------
# the probe run: real values of every node on a small input, then index tensors pushed along paths


PROBE_LENGTH = 7  # odd and prime: never a head_dim, so K^T [.., D, T] is told from K [.., T, D]


class _Run:
    """Every node's value for one small input: gives concrete shapes and the non-probed operands."""

    def __init__(self, gm: torch.fx.GraphModule, vocab: int):
        device = next(gm.parameters()).device
        ids = torch.randint(0, vocab, (1, PROBE_LENGTH), generator=torch.Generator().manual_seed(0)).to(device)
        self.env: dict[Node, object] = {}
        interp = torch.fx.Interpreter(gm)
        orig = interp.run_node

        def record(n):
            value = orig(n)
            self.env[n] = value
            return value

        interp.run_node = record
        with torch.no_grad():
            interp.run(*placeholder_values(gm, ids))

    def __getitem__(self, n):
        return self.env[n]

    def shape(self, n) -> tuple:
        v = self.env[n]
        return tuple(v.shape) if isinstance(v, torch.Tensor) else ()

    def probe(self, src: Node, dst: Node, value: torch.Tensor) -> torch.Tensor:
        """Push `value` (standing for src's output) along every path src -> dst, moving indices through
        shape ops and passing the main operand through value-changing ops."""
        between = descendants(src) & (ancestors(dst) | {dst})
        probed = {src: value}
        for n in src.graph.nodes:
            if n not in between:
                continue
            if n.op == "call_function" and n.target in SHAPE_OPS:
                if not any(a in probed for a in n.all_input_nodes):
                    continue  # a side branch (a norm's statistics, say) that no index reaches
                args = map_arg(n.args, lambda a: probed.get(a, self.env.get(a)))
                kwargs = map_arg(n.kwargs, lambda a: probed.get(a, self.env.get(a)))
                probed[n] = n.target(*args, **kwargs)
                continue
            main = [a for a in n.all_input_nodes if a in probed and self.shape(a) == self.shape(n)]
            if main:
                probed[n] = probed[main[0]]
            elif n is dst:
                raise SiteError(
                    f"Cannot follow projection rows through node '{n.name}' ({n.target}): none of its inputs has its shape.",
                    "This attention layout is not supported yet; please report the architecture.",
                )
            # else: a reduction on a side branch (RMSNorm's mean): its value never carries rows
        return probed[dst]


def _index_heads(p: torch.Tensor, what: str) -> torch.Tensor:
    """[B, H, T, D] probe result -> [H, D] integer indices, checking it is a pure gather."""
    idx = p[0, :, 0, :]
    if not torch.equal(p, idx[None, :, None, :].expand_as(p)) or not torch.equal(idx, idx.round()):
        raise SiteError(f"The {what} rows are not a plain selection of projection outputs.", "This attention layout is not supported yet.")
    return idx.round().long()


# ----------------------------------------------------------------------------------------------
# discovery


@dataclass
class _Core:
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


def _to_4d(node: Node, run: _Run, up: bool) -> Node:
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


def _find_cores(gm: torch.fx.GraphModule, run: _Run) -> list[_Core]:
    cores = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target in SDPA_OPS:
            sig = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
            a = dict(zip(sig, n.args)) | dict(n.kwargs)
            mask = a.get("attn_mask")
            cores.append(_Core("sdpa", n, a["query"], a["key"], a["value"], mask=mask if isinstance(mask, Node) else None,
                               scale=a.get("scale"), causal_flag=bool(a.get("is_causal")), gqa=bool(a.get("enable_gqa"))))
        elif n.target in SOFTMAX_OPS:
            core = _eager_core(n, run)
            if core is not None:
                cores.append(core)
    return cores


def _eager_core(softmax: Node, run: _Run) -> _Core | None:
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
    q = _to_4d(logits_mm.args[first], run, up=True)
    kt = _to_4d(logits_mm.args[first + 1], run, up=True)
    v = _to_4d(out.args[1], run, up=True)
    attn_out = _to_4d(out, run, up=False)
    t_q, d = run.shape(q)[-2:]
    k_transposed = run.shape(kt)[-2:] == (d, run.shape(kt)[-1]) and run.shape(kt)[-1] != d
    path = descendants(logits_mm) & ancestors(softmax)
    return _Core("eager", attn_out, q, kt, v, k_transposed=k_transposed, probs=softmax, logits_path=path, scale=alpha)


def _projection_of(arg: Node, params: set[str], what: str, layer: int) -> tuple[Node, tuple]:
    """The single parameter projection that feeds an attention input."""
    found = {}

    def stop(n):
        parts = _projection_parts(n, params)
        if parts is not None:
            found[n] = parts
            return True
        return n.op in ("placeholder", "get_attr") or (n.op == "call_function" and (n.target in SDPA_OPS or n.target in SOFTMAX_OPS))

    if not stop(arg):
        ancestors(arg, stop=stop)
    if len(found) != 1:
        raise SiteError(
            f"Attention {layer}: expected one parameter projection producing {what}, found {len(found)}.",
            "This attention layout is not supported yet; please report the architecture.",
        )
    return next(iter(found.items()))


def _path_scalars(path: set[Node]) -> float:
    """Product of constant multipliers applied on a path (OPT scales Q after its projection)."""
    factor = 1.0
    for n in path:
        if n.op == "call_function" and n.target in (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar):
            s = _scalar(n.args[1]) if len(n.args) > 1 else None
            if s is not None:
                factor = factor * s if n.target in (aten.mul.Tensor, aten.mul.Scalar) else factor / s
    return factor


def _operands(path: set[Node], source: Node) -> set[Node]:
    """Inputs that enter a projection -> attention path from outside it (RoPE tables, norm weights)."""
    return {a for n in path for a in n.all_input_nodes if a not in path and a is not source}


def _local_ancestors(a: Node) -> set[Node]:
    return ancestors(a, stop=lambda x: x.op in ("placeholder", "get_attr")) | {a}


def _touches(path: set[Node], source: Node, targets) -> bool:
    """Does an operand of the path come from cos/sin or from positions (RoPE, table or computed)?"""
    return any(x.op == "call_function" and x.target in targets for a in _operands(path, source) for x in _local_ancestors(a))


def _path_params(path: set[Node], source: Node, params: set[str]) -> list[str]:
    """Parameters applied on the path (q/k norms), also through `1 + weight` style reparametrisations."""
    names = set()
    for a in _operands(path, source):
        for x in _local_ancestors(a):
            p = _resolve_param(x, params)
            if p:
                names.add(p[0])
    return sorted(names)


def _softcap_and_scale(core: _Core) -> tuple[float | None, float]:
    """Eager form: constant scale before the softmax, and tanh softcapping if present."""
    tanh = [n for n in core.logits_path if n.target is aten.tanh.default]
    if not tanh:
        return None, _path_scalars(core.logits_path)
    after = descendants(tanh[0]) & core.logits_path
    before = core.logits_path - after - {tanh[0]}
    cap = _path_scalars(after)
    return cap, _path_scalars(before) * cap


def _input_node(x: Node, run: _Run) -> Node:
    """The [B, T, hidden] tensor behind a projection input (GPT-2 flattens it to 2-D first)."""
    while len(run.shape(x)) != 3 and x.op == "call_function" and x.target in SHAPE_OPS:
        x = x.args[0]
    return x


def _output_node(o: Node, run: _Run, like: tuple) -> Node:
    while run.shape(o) != like:
        users = [u for u in o.users if u.op == "call_function" and u.target in SHAPE_OPS]
        if len(users) != 1:
            raise SiteError(f"The output projection '{o.name}' does not lead to a [batch, length, hidden] tensor.", "This attention layout is not supported yet.")
        o = users[0]
    return o


def _site(layer: int, core: _Core, gm, run: _Run, params: set[str]) -> AttentionSite:
    q_proj, (q_in, q_w, q_b, q_t) = _projection_of(core.q, params, "Q", layer)
    k_proj, (k_in, k_w, k_b, k_t) = _projection_of(core.k, params, "K", layer)
    v_proj, (v_in, v_w, v_b, v_t) = _projection_of(core.v, params, "V", layer)
    b, heads, t, d = run.shape(core.q)

    def rows(proj, arg, transpose=False):
        width = run.shape(proj)[-1]
        p = run.probe(proj, arg, torch.arange(width, dtype=torch.float64, device=run[proj].device).expand(run.shape(proj)))
        return _index_heads(p.transpose(-1, -2) if transpose else p, "Q/K/V")

    q_idx, k_idx, v_idx = rows(q_proj, core.q), rows(k_proj, core.k, core.k_transposed), rows(v_proj, core.v)
    kv_heads_in_arg = k_idx.shape[0]
    if core.gqa or kv_heads_in_arg != heads:
        group = heads // kv_heads_in_arg
        k_idx = k_idx.repeat_interleave(group, 0)
        v_idx = v_idx.repeat_interleave(group, 0)
    unique = []
    kv_map = []
    for h in range(heads):
        key = (tuple(k_idx[h].tolist()), tuple(v_idx[h].tolist()))
        if key not in unique:
            unique.append(key)
        kv_map.append(unique.index(key))
    k_heads = [list(u[0]) for u in unique]
    v_heads = [list(u[1]) for u in unique]

    # forward to the output projection
    after = descendants(core.attn)
    o_proj = next((n for n in gm.graph.nodes if n in after and _projection_parts(n, params) is not None), None)
    if o_proj is None:
        raise SiteError(f"Attention {layer}: no output projection consumes the attention output.", "This attention layout is not supported yet.")
    o_in, o_w, o_b, o_t = _projection_parts(o_proj, params)
    out_val = torch.arange(heads * d, dtype=torch.float64, device=run[core.attn].device).view(1, heads, 1, d).expand(run.shape(core.attn))
    cols = run.probe(core.attn, o_in, out_val)
    flat = cols.reshape(-1, cols.shape[-1])[0]
    o_heads = [[0] * d for _ in range(heads)]
    for j, src in enumerate(flat.round().long().tolist()):
        o_heads[src // d][src % d] = j
    o_out, o_bias_add = _bias_add(o_proj, params, run.shape(o_proj)[-1], run)
    q_b = q_b or _bias_add(q_proj, params, run.shape(q_proj)[-1], run)[1]
    k_b = k_b or _bias_add(k_proj, params, run.shape(k_proj)[-1], run)[1]
    v_b = v_b or _bias_add(v_proj, params, run.shape(v_proj)[-1], run)[1]

    x = _input_node(q_in, run)
    out = _output_node(o_out, run, run.shape(x))
    q_path = descendants(q_proj) & ancestors(core.q)
    k_path = descendants(k_proj) & ancestors(core.k)
    if core.kind == "sdpa":
        softcap = None
        scale = (core.scale if core.scale is not None else d ** -0.5) * _path_scalars(q_path) * _path_scalars(k_path)
    else:
        softcap, scale = _softcap_and_scale(core)
        scale *= (core.scale or 1.0) * _path_scalars(q_path) * _path_scalars(k_path)
    trig = {aten.cos.default, aten.sin.default, aten.arange.default, aten.arange.start, aten.arange.start_step}
    return AttentionSite(
        layer=layer, module_path=_module_path(core.attn) or _module_path(q_proj), kind=core.kind,
        num_heads=heads, num_kv_heads=len(unique), head_dim=d, hidden_size=run.shape(x)[-1], scale=float(scale),
        q=Projection(q_w, q_b, q_t, q_idx.tolist(), q_proj.name),
        k=Projection(k_w, k_b, k_t, k_heads, k_proj.name),
        v=Projection(v_w, v_b, v_t, v_heads, v_proj.name),
        o=Projection(o_w, o_b or o_bias_add, o_t, o_heads, o_proj.name),
        kv_map=kv_map, rope=_touches(q_path, q_proj, trig) or _touches(k_path, k_proj, trig),
        q_norm=_path_params(q_path, q_proj, params), k_norm=_path_params(k_path, k_proj, params), softcap=softcap,
        input_node=x.name, output_node=out.name, attn_node=core.attn.name,
        q_node=core.q.name, k_node=core.k.name, v_node=core.v.name,
        probs_node=core.probs.name if core.probs is not None else None,
        mask_node=core.mask.name if core.mask is not None else None,
    )


def find_sites(graph) -> list[AttentionSite]:
    """All softmax-attention sites of a captured graph, in execution order."""
    gm = graph.gm
    vocab = vocab_size(graph.config, gm)
    run = _Run(gm, vocab)
    params = _params(gm)
    cores = _find_cores(gm, run)
    if not cores:
        raise NoAttentionError(
            "No softmax attention was found in the captured graph (neither scaled_dot_product_attention nor softmax(QK^T)V).",
            "surgery converts transformer decoders; state-space or attention-free models have nothing to replace.",
        )
    sites = [_site(i, c, gm, run, params) for i, c in enumerate(cores)]
    _check_causal(graph, vocab)
    return sites


def vocab_size(config, gm) -> int:
    """The config's vocab_size, else the rows of the graph's token embedding."""
    return int(getattr(config, "vocab_size", 0) or 0) or _vocab_from_graph(gm)


def _vocab_from_graph(gm) -> int:
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is aten.embedding.default:
            return int(gm.get_parameter(n.args[0].target).shape[0])
    raise NoAttentionError("The graph has no token embedding.", "surgery converts causal language models.")


def _check_causal(graph, vocab: int) -> None:
    """An encoder (bidirectional attention) changes earlier logits when a later token changes."""
    from .capture import run_graph

    device = graph.device
    ids = torch.randint(0, vocab, (1, 6), generator=torch.Generator().manual_seed(1)).to(device)
    other = ids.clone()
    other[0, -1] = (other[0, -1] + 1) % vocab
    with torch.no_grad():
        a, b = run_graph(graph, ids), run_graph(graph, other)
    if not torch.allclose(a[:, :-1].float(), b[:, :-1].float(), atol=1e-4, rtol=1e-3):
        raise NoAttentionError(
            "The model is not causal: changing the last token changes the predictions for earlier positions (an encoder?).",
            "surgery converts decoder-only causal LMs.",
        )
