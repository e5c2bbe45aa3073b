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

import torch
from torch.fx import Node

from ..core.rewrite import ancestors, descendants
from ..errors import NoAttentionError, SiteError
from .attention_op import AttentionOp, find_attention_ops, op_scale, softcap_and_scale
from .ops import (SHAPE_OPS, SOFTMAX_OPS, SDPA_OPS, bias_add, mask_mode as sdpa_mask_mode, module_path, param_names, path_params,
                  path_scalars, projection_parts, projections_before, touches)
from .latent import layer_input, low_rank_via
from .probe import ValueRun, index_heads
from .site import AttentionSite, Projection

aten = torch.ops.aten


def projections_of(arg: Node, params: set[str], what: str, layer: int) -> dict[Node, tuple]:
    """The parameter projections that feed an attention input, first met on each path back from it,
    in graph order: one, or (MLA's key) a per-head projection and a shared one."""
    found = projections_before(arg, params, lambda n: n.op == "call_function" and (n.target in SDPA_OPS or n.target in SOFTMAX_OPS))
    if not found:
        raise SiteError(
            f"Attention {layer}: expected a parameter projection producing {what}, found none.",
            "This attention layout is not supported yet; please report the architecture.",
        )
    if len(found) == 1:
        return found
    order = {n: i for i, n in enumerate(arg.graph.nodes)}
    return dict(sorted(found.items(), key=lambda item: order[item[0]]))


def site_projection(found: dict[Node, tuple], heads: list, vias: dict) -> Projection:
    """The Projection of one attention input: its first projection, and the others (MLA) in `more`."""
    (first, (_, w, b, t)), *rest = found.items()
    more = [dict(weight=rw, bias=rb, transposed=rt, node=n.name, via=vias[n]) for n, (_, rw, rb, rt) in rest]
    return Projection(w, b, t, heads, first.name, via=vias[first], more=more)


def input_node(x: Node, run: ValueRun) -> Node:
    """The [B, T, hidden] tensor behind a projection input (GPT-2 flattens it to 2-D first)."""
    while len(run.shape(x)) != 3 and x.op == "call_function" and x.target in SHAPE_OPS:
        x = x.args[0]
    return x


def output_node(o: Node, run: ValueRun, like: tuple) -> Node:
    while run.shape(o) != like:
        users = [u for u in o.users if u.op == "call_function" and u.target in SHAPE_OPS]
        if len(users) != 1:
            raise SiteError(f"The output projection '{o.name}' does not lead to a [batch, length, hidden] tensor.", "This attention layout is not supported yet.")
        o = users[0]
    return o


def output_projection(layer: int, core: AttentionOp, gm, run: ValueRun, params: set[str], heads: int, d: int):
    """Forward to the projection that consumes the attention output: (node, (weight, bias,
    transposed), o_heads), o_heads[h][i] = the input column that head h's dimension i reaches."""
    after = descendants(core.attn)
    o_proj = next((n for n in gm.graph.nodes if n in after and projection_parts(n, params) is not None), None)
    if o_proj is None:
        raise SiteError(f"Attention {layer}: no output projection consumes the attention output.", "This attention layout is not supported yet.")
    o_in, o_w, o_b, o_t = projection_parts(o_proj, params)
    out_val = torch.arange(heads * d, dtype=torch.float64, device=run[core.attn].device).view(1, heads, 1, d).expand(run.shape(core.attn))
    cols = run.probe(core.attn, o_in, out_val)
    flat = cols.reshape(-1, cols.shape[-1])[0]
    o_heads = [[0] * d for _ in range(heads)]
    for j, src in enumerate(flat.round().long().tolist()):
        o_heads[src // d][src % d] = j
    return o_proj, (o_w, o_b, o_t), o_heads


def head_rows(run: ValueRun, sources, arg: Node, transpose: bool = False) -> torch.Tensor:
    """[H, D] rows feeding each head of an attention input; with several source projections (MLA)
    the rows of each follow those of the ones before it."""
    values, offset = {}, 0
    for proj in sources:
        width = run.shape(proj)[-1]
        values[proj] = (torch.arange(width, dtype=torch.float64, device=run[proj].device) + offset).expand(run.shape(proj))
        offset += width
    p = run.probe(values, arg)
    return index_heads(p.transpose(-1, -2) if transpose else p, "Q/K/V")


def source_path(sources: set[Node], arg: Node) -> set[Node]:
    """The nodes from the projections of an attention input to it; of several projections (MLA's
    key), not the way from one into another (the latent's norm and up projection)."""
    return (set().union(*(descendants(n) for n in sources)) & ancestors(arg, stop=lambda n: n in sources)) - sources


def attention_inputs(layer: int, core: AttentionOp, run: ValueRun, params: set[str]):
    """The projections of Q, K and V ({node: (input, weight, bias, transposed)} each, a bias added
    after a bias-free matmul included), the layer input they all derive from, and each projection's
    low-rank path from it (None where it reads the layer input itself)."""
    found = {}
    for what, arg in (("Q", core.q), ("K", core.k), ("V", core.v)):
        found[what] = {n: (i, w, b or bias_add(n, params, run.shape(n)[-1], run)[1], t)
                       for n, (i, w, b, t) in projections_of(arg, params, what, layer).items()}
    every = {n: parts for f in found.values() for n, parts in f.items()}
    x = layer_input([parts[0] for parts in every.values()], layer)
    vias = {n: low_rank_via(parts[0], x, params, run, layer) for n, parts in every.items()}
    return found, x, vias


def build_site(layer: int, core: AttentionOp, gm, run: ValueRun, params: set[str]) -> AttentionSite:
    found, x, vias = attention_inputs(layer, core, run, params)
    b, heads, t, d = run.shape(core.q)
    q_idx, k_idx, v_idx = head_rows(run, found["Q"], core.q), head_rows(run, found["K"], core.k, core.k_transposed), head_rows(run, found["V"], core.v)
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

    dv = run.shape(core.attn)[-1]
    o_proj, (o_w, o_b, o_t), o_heads = output_projection(layer, core, gm, run, params, heads, dv)
    o_out, o_bias_add = bias_add(o_proj, params, run.shape(o_proj)[-1], run)

    x = input_node(x, run)
    out = output_node(o_out, run, run.shape(x))
    q_src, k_src = set(found["Q"]), set(found["K"])
    q_path, k_path = source_path(q_src, core.q), source_path(k_src, core.k)
    if core.kind == "sdpa":
        softcap = None
        scale = (core.scale if core.scale is not None else d ** -0.5) * path_scalars(q_path) * path_scalars(k_path)
    else:
        softcap, scale = softcap_and_scale(core)
        scale *= (core.scale or 1.0) * path_scalars(q_path) * path_scalars(k_path)
    trig = {aten.cos.default, aten.sin.default, aten.arange.default, aten.arange.start, aten.arange.start_step}
    q_first = next(iter(found["Q"]))
    return AttentionSite(
        layer=layer, module_path=module_path(core.attn) or module_path(q_first), kind=core.kind,
        num_heads=heads, num_kv_heads=len(unique), head_dim=d, hidden_size=run.shape(x)[-1], scale=float(scale),
        q=site_projection(found["Q"], q_idx.tolist(), vias), k=site_projection(found["K"], k_heads, vias),
        v=site_projection(found["V"], v_heads, vias),
        o=Projection(o_w, o_b or o_bias_add, o_t, o_heads, o_proj.name),
        kv_map=kv_map, rope=touches(q_path, q_src, trig) or touches(k_path, k_src, trig),
        q_norm=path_params(q_path, q_src, params), k_norm=path_params(k_path, k_src, params), softcap=softcap,
        input_node=x.name, output_node=out.name, attn_node=core.attn.name,
        q_node=core.q.name, k_node=core.k.name, v_node=core.v.name,
        probs_node=core.probs.name if core.probs is not None else None,
        mask_node=core.mask.name if core.mask is not None else None,
        v_head_dim=dv if dv != d else 0, **decode_fields(core, gm, run, d),
    )


ZERO_FACTORIES = {aten.zeros.default, aten.new_zeros.default, aten.zeros_like.default}


def is_zeros(node) -> bool:
    """A tensor the graph builds as zeros (a baddbmm "bias" that adds nothing, GPT-NeoX-Japanese's)."""
    return isinstance(node, Node) and node.op == "call_function" and node.target in ZERO_FACTORIES


def decode_fields(core: AttentionOp, gm, run: ValueRun, head_dim: int) -> dict:
    """What decoding reads from a site: the op's own scale, the SDPA flag and mask, the eager score
    matmul and the path from it to the softmax (node names, so the site stays JSON)."""
    mask_mode = None
    if core.mask is not None:
        dtype = core.mask.meta["val"].dtype if "val" in core.mask.meta else run[core.mask].dtype
        mask_mode = sdpa_mask_mode(dtype)
    return dict(
        op_scale=op_scale(core, head_dim), k_transposed=core.k_transposed, is_causal=core.causal_flag, mask_mode=mask_mode,
        scores_node=core.scores.name if core.scores is not None else None,
        scores_bias=core.scores is not None and core.scores.target is aten.baddbmm.default and not is_zeros(core.scores.args[0]),
        logits_path=[n.name for n in gm.graph.nodes if n in core.logits_path],
    )


def find_sites(graph) -> list[AttentionSite]:
    """All softmax-attention sites of a captured graph, in execution order."""
    gm = graph.gm
    vocab = vocab_size(graph.config, gm)
    run = ValueRun(gm, vocab, graph)
    params = param_names(gm)
    cores = find_attention_ops(gm, run)
    if not cores:
        raise NoAttentionError(
            "No softmax attention was found in the captured graph (neither scaled_dot_product_attention nor softmax(QK^T)V).",
            "surgery converts transformer decoders; state-space or attention-free models have nothing to replace.",
        )
    sites = [build_site(i, c, gm, run, params) for i, c in enumerate(cores)]
    check_causal(graph, vocab)
    return sites


def vocab_size(config, gm) -> int:
    """The config's vocab_size, else the rows of the graph's token embedding."""
    return int(getattr(config, "vocab_size", 0) or 0) or vocab_from_graph(gm)


def vocab_from_graph(gm) -> int:
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is aten.embedding.default:
            return int(gm.get_parameter(n.args[0].target).shape[0])
    raise NoAttentionError("The graph has no token embedding.", "surgery converts causal language models.")


def check_causal(graph, vocab: int) -> None:
    """An encoder (bidirectional attention) changes earlier logits when a later token changes."""
    device = graph.device
    ids = torch.randint(0, vocab, (1, 6), generator=torch.Generator().manual_seed(1)).to(device)
    other = ids.clone()
    other[0, -1] = (other[0, -1] + 1) % vocab
    with torch.no_grad():
        a, b = graph.logits(ids), graph.logits(other)
    if not torch.allclose(a[:, :-1].float(), b[:, :-1].float(), atol=1e-4, rtol=1e-3):
        raise NoAttentionError(
            "The model is not causal: changing the last token changes the predictions for earlier positions (an encoder?).",
            "surgery converts decoder-only causal LMs.",
        )
